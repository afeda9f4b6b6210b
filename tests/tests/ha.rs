//! Acceptance tests of multi-master (Raft) high availability: real `granary master` groups on
//! loopback, killed with SIGKILL, paused with SIGSTOP, wiped, grown and shrunk, while a
//! `granary bench metadata` process writes and logs every acknowledged create. No
//! acknowledged write may be lost, every member must converge on the same namespace, and no
//! term may ever have two leaders.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use granary_tests::stores::{FaultProxy, TestStore};
use granary_tests::*;
use rand::{Rng, SeedableRng};

const MIB: u64 = 1024 * 1024;

/// A fresh directory for one test (under /tmp: mount points must be real paths, and the
/// target dir may sit behind a symlink).
fn workdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("granary-ha-")
        .tempdir()
        .unwrap()
}

/// A few files of 1-3 MiB and some small ones.
fn dataset(root: &Path) -> PathBuf {
    let dir = root.join("ufs");
    for (name, len) in [
        ("a/x.bin", 3 * MIB + 5),
        ("a/y.bin", 12345),
        ("b.bin", MIB),
        ("c/big.bin", 2 * MIB + 7),
        ("c/d/one.bin", 1),
        ("empty", 0),
    ] {
        random_file(&dir.join(name), len).unwrap();
    }
    for i in 0..10 {
        random_file(&dir.join(format!("small/s{i}.bin")), 100 + i * 37).unwrap();
    }
    dir
}

fn mkdir_p(addrs: &str, path: &str) {
    granary_ok(&["fs", "mkdir", path, "-p", "--master", addrs]).unwrap();
}

/// Asserts that every running member of `g` lists every name of `want` under `dir` and that
/// all of them list exactly the same names; returns those names.
fn assert_members_hold(g: &MasterGroup, dir: &str, want: &BTreeSet<String>) -> BTreeSet<String> {
    let mut listings: Vec<(u64, BTreeSet<String>)> = Vec::new();
    for id in g.running_ids() {
        let names = g
            .stale_ls(id, dir)
            .unwrap_or_else(|e| panic!("stale ls {dir} on master {id}: {e:#}\n{}", g.logs()));
        let missing: Vec<&String> = want.difference(&names).take(10).collect();
        assert!(
            missing.is_empty(),
            "master {id} lost {} acknowledged creates under {dir} (of {}), e.g. {missing:?}\n{}",
            want.difference(&names).count(),
            want.len(),
            g.logs()
        );
        listings.push((id, names));
    }
    let (fid, fnames) = listings.first().expect("no running master").clone();
    for (id, names) in &listings[1..] {
        let only_first: Vec<&String> = fnames.difference(names).take(10).collect();
        let only_this: Vec<&String> = names.difference(&fnames).take(10).collect();
        assert!(
            fnames == *names,
            "masters {fid} and {id} differ under {dir}: only on {fid}: {only_first:?}, \
             only on {id}: {only_this:?}\n{}",
            g.logs()
        );
    }
    fnames
}

fn json_u64(v: &serde_json::Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("bench output has no integer {key:?}: {v}"))
}

#[test]
fn leader_kill9_during_a_create_loop_loses_no_acknowledged_write() {
    let root = workdir();
    let root = root.path();
    let src = dataset(root);
    let mut g = MasterGroup::start(root, 3, 1000).unwrap();
    let addrs = g.addrs();
    g.wait_leader(Duration::from_secs(30)).unwrap();
    let _w1 = Worker::start(root, "w1", &addrs, "1GiB").unwrap();
    let _w2 = Worker::start(root, "w2", &addrs, "1GiB").unwrap();
    wait_live_workers(&addrs, 2).unwrap();
    mount_local("/data", &src, &addrs).unwrap();
    let fuse = Fuse::start(root, &addrs).unwrap();
    let mnt = fuse.mountpoint.join("data");
    let expected = tree_sums(&src).unwrap();
    assert_eq!(expected.len(), 16);
    assert_eq!(tree_sums(&mnt).unwrap(), expected, "first read differs");

    mkdir_p(&addrs, "/loop");
    let mut bench = Bench::spawn(root, "bench", &addrs, "/loop", &["--duration", "20s"]).unwrap();
    bench.wait_acks(50, Duration::from_secs(30)).unwrap();

    let leader = g.wait_leader(Duration::from_secs(10)).unwrap();
    let killed_at = Instant::now();
    g.kill9(leader).unwrap();
    let at_kill = bench.ack_count();

    // Watch the ack log closely for the first acknowledgement after the kill.
    let watcher = {
        let acks = bench.acks.clone();
        std::thread::spawn(move || -> Option<Duration> {
            let deadline = killed_at + Duration::from_secs(30);
            while Instant::now() < deadline {
                if read_acks(&acks).len() > at_kill {
                    return Some(killed_at.elapsed());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            None
        })
    };
    // Reads through the mount keep working while the group fails over.
    let mut reads = 0;
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let got = tree_sums(&mnt)
            .unwrap_or_else(|e| panic!("reading the mount during failover: {e:#}\n{}", g.logs()));
        assert_eq!(got, expected, "read {reads} during failover differs");
        reads += 1;
        let n = bench.ack_count();
        if n >= at_kill + 50 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {} creates acknowledged in 40 s after killing leader {leader}\nbench log:\n{}\n{}",
            n.saturating_sub(at_kill),
            log_tail(&bench.proc.log, 100),
            g.logs()
        );
        assert!(
            bench.is_running(),
            "the bench exited {} creates after the kill\nbench log:\n{}\n{}",
            n.saturating_sub(at_kill),
            log_tail(&bench.proc.log, 100),
            g.logs()
        );
    }
    // Some other member became leader after the kill (read before the killed one returns).
    let terms = g.leader_terms().unwrap();
    let killed_term = terms
        .iter()
        .filter(|(_, ids)| ids.contains(&leader))
        .map(|(t, _)| *t)
        .max()
        .unwrap_or_else(|| panic!("master {leader} never logged becoming leader: {terms:?}"));
    assert!(
        terms
            .range(killed_term + 1..)
            .any(|(_, ids)| !ids.contains(&leader)),
        "no other member logged becoming leader after {leader} was killed: {terms:?}\n{}",
        g.logs()
    );
    let failover = watcher
        .join()
        .unwrap()
        .expect("no create acknowledged after the kill (watcher)");
    eprintln!(
        "failover: first acknowledged write {} ms after kill ({reads} tree reads meanwhile)",
        failover.as_millis()
    );
    assert!(
        failover < Duration::from_secs(15),
        "failover took {failover:?}\n{}",
        g.logs()
    );

    let out = bench.wait(Duration::from_secs(60)).unwrap();
    eprintln!("bench: {out}");
    let acked = bench.acked();
    assert_eq!(
        json_u64(&out, "creates") as usize,
        acked.len(),
        "the bench's count of creates differs from its ack log"
    );
    assert!(
        json_u64(&out, "max_create_gap_ms") < 15_000,
        "longest pause between acknowledgements: {out}"
    );
    let names = ack_names(&acked, "/loop");

    g.restart(leader).unwrap();
    g.wait_caught_up(Duration::from_secs(60)).unwrap();
    assert_eq!(g.running_ids().len(), 3);
    let held = assert_members_hold(&g, "/loop", &names);
    assert!(held.len() >= names.len());

    // The workers re-registered with the new leader; the mount still reads right.
    wait_live_workers(&addrs, 2).unwrap();
    assert_eq!(
        tree_sums(&mnt).unwrap(),
        expected,
        "read after restart differs"
    );

    g.assert_one_leader_per_term();
}

#[test]
fn a_wiped_follower_catches_up_through_a_snapshot() {
    let root = workdir();
    let root = root.path();
    let mut g = MasterGroup::start(root, 3, 100).unwrap();
    let addrs = g.addrs();
    let leader = g.wait_leader(Duration::from_secs(30)).unwrap();
    mkdir_p(&addrs, "/s");
    let mut bench = Bench::spawn(
        root,
        "bench",
        &addrs,
        "/s",
        &["--ops", "600", "--duration", "120s"],
    )
    .unwrap();
    let out = bench.wait(Duration::from_secs(120)).unwrap();
    assert_eq!(json_u64(&out, "creates"), 600, "{out}");
    assert_eq!(json_u64(&out, "create_errors"), 0, "{out}");
    let names = ack_names(&bench.acked(), "/s");
    assert_eq!(names.len(), 600);

    let followers: Vec<u64> = [1, 2, 3].into_iter().filter(|&i| i != leader).collect();
    let (f, other) = (followers[0], followers[1]);
    let marker = format!("raft: node {f} installed snapshot at index");
    let snapshots_before = count_in_log(&g.member(f).log, &marker);
    g.kill9(f).unwrap();
    g.wipe(f).unwrap();
    assert!(!g.member(f).data_dir.exists());
    g.restart(f).unwrap();
    g.wait_caught_up(Duration::from_secs(60)).unwrap();
    assert!(
        count_in_log(&g.member(f).log, &marker) > snapshots_before,
        "wiped master {f} caught up without installing a snapshot\n{}",
        g.logs()
    );
    // Every member reads this release's entry format, so the group proposes in it, and the
    // wiped member learnt so from what it caught up with.
    for id in [1, 2, 3] {
        let me = g.self_entry(id).unwrap();
        assert_eq!(json_u64(&me, "entry_format"), 1, "{me}");
    }
    let leader = g.wait_leader(Duration::from_secs(10)).unwrap();
    let on_leader = g.stale_ls(leader, "/s").unwrap();
    assert_eq!(
        on_leader, names,
        "the leader's /s differs from the acknowledged creates"
    );
    assert_eq!(
        g.stale_ls(f, "/s").unwrap(),
        on_leader,
        "wiped master {f} differs from leader {leader}\n{}",
        g.logs()
    );

    // A plain kill -9 and restart of the other follower, with writes while it is down.
    g.kill9(other).unwrap();
    mkdir_p(&addrs, "/s2");
    let mut bench2 = Bench::spawn(
        root,
        "bench2",
        &addrs,
        "/s2",
        &["--ops", "150", "--duration", "120s"],
    )
    .unwrap();
    let out2 = bench2.wait(Duration::from_secs(120)).unwrap();
    assert_eq!(json_u64(&out2, "creates"), 150, "{out2}");
    let names2 = ack_names(&bench2.acked(), "/s2");
    assert_eq!(names2.len(), 150);
    g.restart(other).unwrap();
    g.wait_caught_up(Duration::from_secs(60)).unwrap();
    assert_eq!(assert_members_hold(&g, "/s", &names), names);
    assert_eq!(assert_members_hold(&g, "/s2", &names2), names2);
}

#[test]
fn a_paused_follower_catches_up_after_many_snapshots() {
    let root = workdir();
    let root = root.path();
    let mut g = MasterGroup::start(root, 3, 100).unwrap();
    let addrs = g.addrs();
    let leader = g.wait_leader(Duration::from_secs(30)).unwrap();
    mkdir_p(&addrs, "/p");
    g.wait_caught_up(Duration::from_secs(30)).unwrap();
    let f = [1, 2, 3].into_iter().find(|&i| i != leader).unwrap();

    g.signal(f, "STOP").unwrap();
    let mut bench = Bench::spawn(
        root,
        "bench",
        &addrs,
        "/p",
        &["--ops", "800", "--duration", "120s"],
    )
    .unwrap();
    let out = bench.wait(Duration::from_secs(120));
    // Resume it before any assertion can fail, so it is never left stopped.
    g.signal(f, "CONT").unwrap();
    let out = out.unwrap();
    assert_eq!(json_u64(&out, "creates"), 800, "{out}");
    assert_eq!(json_u64(&out, "create_errors"), 0, "{out}");
    let names = ack_names(&bench.acked(), "/p");
    assert_eq!(names.len(), 800);

    g.wait_caught_up(Duration::from_secs(60)).unwrap();
    assert_eq!(assert_members_hold(&g, "/p", &names), names);
    assert!(
        g.is_running(f),
        "resumed master {f} exited\n{}",
        log_tail(&g.member(f).log, 200)
    );
}

#[test]
fn random_crash_restart_rounds_lose_no_acknowledged_write() {
    let seed: u64 = match std::env::var("GRANARY_CHAOS_SEED") {
        Ok(s) => s.trim().parse().expect("GRANARY_CHAOS_SEED is not a u64"),
        Err(_) => rand::random(),
    };
    eprintln!("chaos seed: {seed} (rerun with GRANARY_CHAOS_SEED={seed})");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let root = workdir();
    let root = root.path();
    let mut g = MasterGroup::start(root, 3, 150).unwrap();
    let addrs = g.addrs();
    g.wait_leader(Duration::from_secs(30)).unwrap();
    mkdir_p(&addrs, "/r");
    // Longer than the rounds need; it is killed after them.
    let mut bench = Bench::spawn(root, "bench", &addrs, "/r", &["--duration", "120s"]).unwrap();
    bench.wait_acks(20, Duration::from_secs(30)).unwrap();

    for round in 1..=6 {
        let victim: u64 = rng.gen_range(1..=3);
        let before = bench.ack_count();
        eprintln!("round {round}: kill -9 master {victim} ({before} creates acknowledged)");
        g.kill9(victim).unwrap();
        // Two of three keep making progress.
        bench
            .wait_acks(before + 20, Duration::from_secs(30))
            .unwrap_or_else(|e| {
                panic!(
                    "round {round} (seed {seed}), master {victim} down: {e:#}\n{}",
                    g.logs()
                )
            });
        g.restart(victim).unwrap();
        g.wait_member_caught_up(victim, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("round {round} (seed {seed}): {e:#}"));
    }
    assert!(
        bench.is_running(),
        "the bench ended before the rounds did\nbench log:\n{}",
        log_tail(&bench.proc.log, 100)
    );
    bench.kill9().unwrap();
    let names = ack_names(&bench.acked(), "/r");
    assert!(
        names.len() >= 140,
        "only {} creates acknowledged",
        names.len()
    );

    g.wait_caught_up(Duration::from_secs(60)).unwrap();
    assert_eq!(g.running_ids().len(), 3);
    assert_members_hold(&g, "/r", &names);
    g.assert_one_leader_per_term();
}

#[test]
fn membership_grows_to_four_and_back_to_three_under_writes() {
    let root = workdir();
    let root = root.path();
    let mut g = MasterGroup::start(root, 3, 1000).unwrap();
    let addrs3 = g.addrs();
    g.wait_leader(Duration::from_secs(30)).unwrap();
    mkdir_p(&addrs3, "/m");
    let mut bench = Bench::spawn(root, "bench", &addrs3, "/m", &["--duration", "60s"]).unwrap();
    bench.wait_acks(20, Duration::from_secs(30)).unwrap();

    g.start_joining(4).unwrap();
    let addr4 = g.addr(4);
    let addrs = g.addrs();
    granary_ok(&["master", "add", "4", &addr4, "--master", &addrs3])
        .unwrap_or_else(|e| panic!("{e:#}\n{}", g.logs()));
    let ids_of = |v: &[serde_json::Value]| -> BTreeSet<u64> {
        v.iter().filter_map(|e| e["id"].as_u64()).collect()
    };
    let mut last = String::new();
    poll(
        "master 4 to be listed as a follower",
        Duration::from_secs(60),
        || {
            let v = g.list(&addrs).ok()?;
            last = serde_json::to_string(&v).ok()?;
            let four = v.iter().find(|e| e["id"].as_u64() == Some(4))?;
            (ids_of(&v) == BTreeSet::from([1, 2, 3, 4])
                && four["address"] == addr4.as_str()
                && four["role"] == "follower")
                .then_some(())
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\nlast list: {last}\n{}", g.logs()));
    g.wait_member_caught_up(4, Duration::from_secs(60)).unwrap();
    assert!(
        bench.is_running(),
        "the bench ended before master 4 caught up"
    );

    // Adding an id that is already a member fails cleanly and changes nothing.
    let members = |v: &[serde_json::Value]| -> BTreeSet<(u64, String)> {
        v.iter()
            .map(|e| {
                (
                    e["id"].as_u64().unwrap(),
                    e["address"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let before = members(&g.list(&addrs).unwrap());
    // (at another name of its own address: it answers there as master 2, so the refusal
    // is the membership's, not the joiner check's)
    let dup_addr = g.addr(2).replace("127.0.0.1", "localhost");
    let out = granary(&["master", "add", "2", &dup_addr, "--master", &addrs]);
    assert_one_sentence_error(&out, "duplicate add");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already a member"), "{err}");
    assert_eq!(
        members(&g.list(&addrs).unwrap()),
        before,
        "a refused add changed the group"
    );
    // So does adding a new id at a running master's address (it would never answer as
    // that id).
    let out = granary(&["master", "add", "5", &addr4, "--master", &addrs]);
    assert_one_sentence_error(&out, "add of another master's address");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is master 4, not 5"), "{err}");
    assert_eq!(
        members(&g.list(&addrs).unwrap()),
        before,
        "a refused add changed the group"
    );
    // And adding a master nothing answers for (a voter that never votes).
    let nobody = format!("127.0.0.1:{}", free_port());
    let out = granary(&["master", "add", "5", &nobody, "--master", &addrs]);
    assert_one_sentence_error(&out, "add of an address nothing answers at");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no master answers at"), "{err}");
    assert_eq!(
        members(&g.list(&addrs).unwrap()),
        before,
        "a refused add changed the group"
    );

    granary_ok(&["master", "remove", "4", "--master", &addrs])
        .unwrap_or_else(|e| panic!("{e:#}\n{}", g.logs()));
    poll(
        "master 4 to leave the group",
        Duration::from_secs(60),
        || {
            let v = g.list(&addrs3).ok()?;
            last = serde_json::to_string(&v).ok()?;
            (v.len() == 3 && ids_of(&v) == BTreeSet::from([1, 2, 3])).then_some(())
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}\nlast list: {last}\n{}", g.logs()));
    g.stop(4).unwrap();
    // Writes go on with the three.
    let n = bench.ack_count();
    bench
        .wait_acks(n + 20, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e:#}\n{}", g.logs()));
    bench.kill9().unwrap();
    let names = ack_names(&bench.acked(), "/m");

    g.wait_caught_up(Duration::from_secs(60)).unwrap();
    assert_eq!(g.running_ids(), vec![1, 2, 3]);
    assert_members_hold(&g, "/m", &names);
    g.assert_one_leader_per_term();
}

/// A removal that would leave the group without a majority that answers is refused: with
/// master 3 down, removing master 2 would leave {1, 3}, one answering of two, and the group
/// could decide nothing more. Removing the silent master 3 is what works.
#[test]
fn a_removal_keeps_a_majority_of_masters_that_answer() {
    let root = workdir();
    let mut g = MasterGroup::start(root.path(), 3, 1000).unwrap();
    g.wait_leader(Duration::from_secs(30)).unwrap();
    let addrs12 = format!("{},{}", g.addr(1), g.addr(2));
    g.stop(3).unwrap();
    // Once the leader has not heard from master 3 for a while (its metric says so).
    let answering = |id: u64| -> Option<u64> {
        let (_, body) = http_get(&metrics_addr(&g, id), "/metrics").ok()?;
        body.lines()
            .find_map(|l| l.strip_prefix("granary_master_raft_voters_answering "))
            .and_then(|v| v.trim().parse().ok())
    };
    poll(
        "the leader to hear from two masters only",
        Duration::from_secs(30),
        || [1, 2].into_iter().find(|id| answering(*id) == Some(2)),
    )
    .unwrap();
    let out = granary(&["master", "remove", "2", "--master", &addrs12]);
    assert_one_sentence_error(&out, "a removal leaving no majority");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a majority"), "{err}");
    let ids = |v: Vec<serde_json::Value>| -> BTreeSet<u64> {
        v.iter().filter_map(|e| e["id"].as_u64()).collect()
    };
    assert_eq!(ids(g.list(&addrs12).unwrap()), BTreeSet::from([1, 2, 3]));
    granary_ok(&["master", "remove", "3", "--master", &addrs12])
        .unwrap_or_else(|e| panic!("{e:#}\n{}", g.logs()));
    poll(
        "master 3 to leave the group",
        Duration::from_secs(60),
        || (ids(g.list(&addrs12).ok()?) == BTreeSet::from([1, 2])).then_some(()),
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", g.logs()));
    // The two decide on: a folder made now is there.
    mkdir_p(&addrs12, "/after-removal");
}

/// The metrics address a master printed at start.
fn metrics_addr(g: &MasterGroup, id: u64) -> String {
    g.log_text(id)
        .lines()
        .find_map(|l| l.split("metrics on http://").nth(1))
        .map(|s| s.trim_end_matches("/metrics").trim().to_string())
        .unwrap_or_else(|| panic!("master {id} printed no metrics address"))
}

#[test]
fn readiness_follows_the_quorum() {
    let root = workdir();
    let mut g = MasterGroup::start(root.path(), 3, 1000).unwrap();
    g.wait_leader(Duration::from_secs(30)).unwrap();
    let addrs: Vec<String> = (1..=3).map(|id| metrics_addr(&g, id)).collect();
    for a in &addrs {
        poll("every member ready", Duration::from_secs(20), || {
            matches!(http_get(a, "/ready"), Ok((200, _))).then_some(())
        })
        .unwrap();
    }
    // A worker is ready once it registered with the leader.
    let w = Worker::start(root.path(), "w1", &g.addrs(), "64MiB").unwrap();
    poll("the worker ready", Duration::from_secs(20), || {
        matches!(http_get(&w.metrics, "/ready"), Ok((200, _))).then_some(())
    })
    .unwrap();
    // Two of three gone: the last one loses its leader (check-quorum) and says so, while
    // it stays alive.
    g.stop(2).unwrap();
    g.stop(3).unwrap();
    let (code, body) = poll("master 1 unready", Duration::from_secs(30), || {
        http_get(&addrs[0], "/ready")
            .ok()
            .filter(|(code, _)| *code == 503)
    })
    .unwrap();
    assert!(body.contains("no leader known"), "{code}: {body}");
    assert_eq!(http_get(&addrs[0], "/healthz").unwrap().0, 200);
}

/// Every master answers namespace reads (issue 31). A follower's answer includes every
/// write acknowledged before it (ReadIndex through the leader): a folder made through the
/// group is found at once by a client that knows only a follower. A mounted folder is
/// answered by the follower while its last listing (recorded through Raft, an unchanged
/// re-listing too) is within the mount's `sync_interval`; past it the follower sends the
/// read to the leader, which lists the store, and the client sees the store's new object
/// either way. The counters say who answered.
#[test]
fn followers_answer_reads_and_see_every_acknowledged_write() {
    let root = workdir();
    let g = MasterGroup::start(root.path(), 3, 1000).unwrap();
    let leader = g.wait_leader(Duration::from_secs(30)).unwrap();
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let (all, at_follower) = (g.addrs(), g.addr(follower));
    let metrics = metrics_addr(&g, follower);
    let answered = || metric_at(&metrics, "granary_master_follower_reads_total");
    let redirected = || metric_at(&metrics, "granary_master_follower_redirects_total");
    mkdir_p(&all, "/lin");
    let before = answered();
    for i in 0..10 {
        let path = format!("/lin/d{i}");
        granary_ok(&["fs", "mkdir", &path, "--master", &all]).unwrap();
        let out = granary(&["fs", "stat", &path, "--master", &at_follower]);
        assert!(
            out.status.success(),
            "stat {path} at follower {follower} right after it was made: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            g.logs()
        );
    }
    assert!(
        answered() >= before + 10.0,
        "the follower did not answer the stats"
    );

    // A store folder, listed through the group (the leader lists it).
    let _w = Worker::start(root.path(), "w1", &all, "64MiB").unwrap();
    wait_live_workers(&all, 1).unwrap();
    let store = root.path().join("store");
    std::fs::create_dir_all(store.join("dir")).unwrap();
    std::fs::write(store.join("dir/a"), "a").unwrap();
    let uri = store.to_string_lossy().to_string();
    granary_ok(&[
        "mount",
        "add",
        "/data",
        &uri,
        "--option",
        "sync_interval=5s",
        "--master",
        &all,
    ])
    .unwrap();
    let ls = |at: &str| granary_ok(&["fs", "ls", "/data/dir", "--master", at]).unwrap();
    assert_eq!(ls(&all), "a\n");
    // Fresh: the follower answers (once it has applied the listing).
    let (a0, r0) = (answered(), redirected());
    assert_eq!(ls(&at_follower), "a\n");
    assert!(
        answered() > a0,
        "the follower did not answer a fresh folder"
    );
    assert_eq!(
        redirected(),
        r0,
        "the follower sent a fresh folder's read on"
    );
    // The follower signs the grants of what it answers with the leader's key (workers
    // accept no other): a file read through a worker with it gets its bytes.
    let a2 = answered();
    let cat = granary_ok(&["fs", "cat", "/data/dir/a", "--master", &at_follower]).unwrap();
    assert_eq!(cat, "a");
    assert!(
        answered() > a2,
        "the follower did not answer the file's status"
    );
    // Past the interval, with a new object in the store: the leader answers (and lists
    // it again), so the new object shows wherever the client asks.
    std::fs::write(store.join("dir/b"), "b").unwrap();
    let listed = poll("the new object listed", Duration::from_secs(30), || {
        let out = ls(&at_follower);
        (out == "a\nb\n").then_some(out)
    });
    assert!(listed.is_ok(), "{listed:?}\n{}", g.logs());
    assert!(
        redirected() > r0,
        "no read of the due folder went to the leader"
    );
    // An unchanged re-listing is recorded too: the follower answers again afterwards.
    let a1 = answered();
    poll(
        "the follower answers the re-listed folder",
        Duration::from_secs(30),
        || {
            assert_eq!(ls(&at_follower), "a\nb\n");
            (answered() > a1).then_some(())
        },
    )
    .unwrap();
}

/// A folder's first listing is merged a page at a time; its leader is killed with the
/// store's listing held at its 13th page (100 keys each, 3,000 objects). The `fs sync`
/// that started it goes on at the next leader, which lists the folder again (the pages
/// the first one applied are known by then), and every member ends with exactly the
/// store's names.
#[test]
fn a_leader_killed_mid_listing_leaves_a_folder_the_next_leader_lists_exactly() {
    let tmp = workdir();
    let root = tmp.path();
    let s3 = TestStore::s3(root, "flat", "ha-access", "ha-secret-key-1").unwrap();
    let n = 3000;
    for i in 0..n {
        random_file(&s3.object_file(&format!("big/f{i:07}")).unwrap(), 0).unwrap();
    }
    let want: BTreeSet<String> = (0..n).map(|i| format!("f{i:07}")).collect();
    let proxy = FaultProxy::start(root, &s3.url(), 1_000_000).unwrap();
    let mut g = MasterGroup::start(root, 3, 0).unwrap();
    let first = g.wait_leader(Duration::from_secs(30)).unwrap();
    let addrs = g.addrs();
    let mut args = vec!["mount".to_string(), "add".into(), "/data".into(), s3.uri()];
    for o in s3.options_through(&proxy.url()) {
        args.extend(["--option".into(), o]);
    }
    args.extend(
        [
            "--option",
            "list_page_keys=100",
            "--option",
            "sync_interval=never",
        ]
        .map(String::from),
    );
    args.extend(["--master".to_string(), addrs.clone()]);
    granary_ok(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();

    proxy.hold_lists_after(12).unwrap();
    let a = addrs.clone();
    let sync = std::thread::spawn(move || granary(&["fs", "sync", "/data/big", "--master", &a]));
    poll(
        "the listing to reach the held page",
        Duration::from_secs(60),
        || (proxy.counts().unwrap()["waiting"].as_u64() == Some(1)).then_some(()),
    )
    .unwrap();
    g.kill9(first).unwrap();
    proxy.release().unwrap();
    let second = g.wait_leader(Duration::from_secs(30)).unwrap();
    assert_ne!(first, second);
    let out = sync.join().unwrap();
    assert!(
        out.status.success(),
        "fs sync across the failover: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        g.logs()
    );
    // Followers learn the last commit index with the next append or heartbeat.
    g.wait_caught_up(Duration::from_secs(30)).unwrap();
    assert_eq!(assert_members_hold(&g, "/data/big", &want), want);
}

/// A master of this release starts on the data dir of the release before (records and
/// Raft entries as JSON, made by `tests/fixtures/make-state-fixture.sh`): it rewrites the
/// records once, in the binary format, and serves the same namespace, pins, TTLs and jobs.
#[test]
fn a_master_reads_the_data_dir_of_the_release_before() {
    let dir = workdir();
    let root = dir.path();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/state-json.tar.gz");
    sh(&format!(
        "tar -C {} -xzf {}",
        root.display(),
        fixture.display()
    ))
    .unwrap();
    let data = root.join("master");
    let rewrote = "rewrote the state's JSON records in the binary format";

    let mut m = Master::start_on(root, &data, free_port()).unwrap();
    assert_eq!(
        count_in_log(&m.proc.log, rewrote),
        1,
        "{}",
        m.proc.log_text()
    );
    // Alone in its group, it moves its Raft entries to the binary format at once.
    let formats = |m: &Master| {
        let out = granary_ok(&["master", "list", "--json", "--master", &m.addr]).unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (
            json_u64(&v[0], "state_format"),
            json_u64(&v[0], "entry_format"),
        )
    };
    poll("entries in format 1", Duration::from_secs(20), || {
        (formats(&m) == (1, 1)).then_some(())
    })
    .unwrap();
    let ls = |m: &Master, path: &str| {
        granary_ok(&["fs", "ls", "--master", &m.addr, "-R", "-l", path]).unwrap()
    };
    // Kind, size and pin of every entry the old master had listed.
    let listing = |m: &Master| -> BTreeSet<String> {
        ls(m, "/data")
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split('\t').map(str::trim).collect();
                format!("{} {} {} {}", f[0], f[1], f[3], f[4])
            })
            .collect()
    };
    let mut want = BTreeSet::new();
    for (d, pin) in [("train/a", "pinned:1"), ("train/b", "-"), ("val", "-")] {
        want.insert(format!("dir 0 {pin} /data/{d}"));
        for i in 1..=3 {
            let len = i * 1000 + d.len();
            want.insert(format!("file {len} {pin} /data/{d}/s{i}.bin"));
        }
    }
    want.insert("dir 0 - /data/train".into());
    assert_eq!(listing(&m), want);
    let top = granary_ok(&["fs", "ls", "--master", &m.addr, "/"]).unwrap();
    assert_eq!(top.lines().collect::<Vec<_>>(), ["data", "scratch"]);
    let stat = granary_ok(&["fs", "stat", "--master", &m.addr, "/data/val"]).unwrap();
    assert!(stat.contains("ttl:         free at"), "{stat}");
    let jobs = granary_ok(&["job", "list", "--master", &m.addr]).unwrap();
    for want in ["3/3        0  /data/train/a", "6/6        0  /data/train"] {
        assert!(jobs.contains(want) && jobs.contains("succeeded"), "{jobs}");
    }

    // What it writes now, and what it rewrote, read back after a restart; nothing is
    // rewritten twice.
    granary_ok(&["fs", "mkdir", "--master", &m.addr, "/scratch/after"]).unwrap();
    m.proc.stop("TERM", Duration::from_secs(20)).unwrap();
    let m = Master::start_on(root, &data, free_port()).unwrap();
    assert_eq!(count_in_log(&m.proc.log, rewrote), 1);
    assert_eq!(formats(&m), (1, 1));
    assert_eq!(listing(&m), want);
    let scratch = granary_ok(&["fs", "ls", "--master", &m.addr, "/scratch"]).unwrap();
    assert_eq!(scratch.trim(), "after");
}
