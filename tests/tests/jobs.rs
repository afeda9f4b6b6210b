//! Jobs with real processes: `granary load` over an S3 bucket (s3s-fs) on three workers,
//! with unreadable objects, and across a kill -9 of the master leader.

use std::path::Path;
use std::time::Duration;

use granary_tests::stores::TestStore;
use granary_tests::*;

const MIB: u64 = 1024 * 1024;

/// Many small files and a few multi-block ones; returns (relative path, length) of each.
fn dataset(dir: &Path, small: u64, large: u64) -> Vec<(String, u64)> {
    let mut files = Vec::new();
    for i in 0..small {
        let name = format!("small/d{:02}/s{i:05}.jpg", i % 20);
        let len = 2048 + (i * 7919 % 60) * 1024;
        random_file(&dir.join(&name), len).unwrap();
        files.push((name, len));
    }
    for i in 0..large {
        let name = format!("large/l{i}.bin");
        let len = 80 * MIB + 4097 * i;
        random_file(&dir.join(&name), len).unwrap();
        files.push((name, len));
    }
    files
}

fn sum(workers: &[Worker], name: &str) -> f64 {
    workers.iter().map(|w| w.metric(name)).sum()
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// Checks a job's JSON against the documented schema (docs/cli.md): every field, its type.
fn check_job_schema(j: &serde_json::Value) {
    let obj = j.as_object().expect("a job is an object");
    for k in [
        "id",
        "replicas",
        "created_ms",
        "total_files",
        "total_bytes",
        "done_files",
        "done_bytes",
        "failed_files",
        "fetched_bytes",
    ] {
        assert!(obj[k].is_u64(), "{k} is not an unsigned integer: {j}");
    }
    for k in ["kind", "path", "state"] {
        assert!(obj[k].is_string(), "{k} is not a string: {j}");
    }
    assert!(obj["cached_percent"].is_number(), "cached_percent: {j}");
    assert!(obj["finished_ms"].is_u64() || obj["finished_ms"].is_null());
    assert!(obj["error"].is_string() || obj["error"].is_null());
    assert!(obj["failed"].is_array(), "failed: {j}");
    for f in obj["failed"].as_array().unwrap() {
        assert!(f["path"].is_string() && f["reason"].is_string(), "{f}");
    }
    assert!(
        ["planning", "running", "succeeded", "failed", "cancelled"]
            .contains(&obj["state"].as_str().unwrap()),
        "state: {j}"
    );
    assert_eq!(obj.len(), 16, "unexpected fields: {j}");
}

/// Checks `granary report --json` against the documented schema (docs/cli.md).
fn check_report_schema(r: &serde_json::Value) {
    for k in [
        "leader_id",
        "inodes",
        "mounts",
        "capacity_bytes",
        "used_bytes",
        "cache_hit_bytes",
        "cache_miss_bytes",
        "ufs_read_bytes",
        "ufs_bytes_saved",
    ] {
        assert!(r[k].is_u64(), "{k}: {r}");
    }
    assert!(r["hit_ratio"].is_number());
    let mp = &r["miss_penalty_ms"];
    assert!(mp["samples"].is_u64(), "{mp}");
    for q in ["p50", "p99"] {
        assert!(mp[q].is_number() || mp[q].is_null(), "{mp}");
    }
    r["jobs_running"]
        .as_array()
        .expect("jobs_running")
        .iter()
        .for_each(check_job_schema);
    for m in r["masters"].as_array().expect("masters") {
        assert!(m["id"].is_u64() && m["address"].is_string() && m["role"].is_string());
        assert!(m["term"].is_u64() && m["commit_index"].is_u64() && m["applied_index"].is_u64());
    }
    for w in r["workers"].as_array().expect("workers") {
        for k in ["address", "host", "state"] {
            assert!(w[k].is_string(), "{k}: {w}");
        }
        for k in [
            "id",
            "last_heartbeat_ms_ago",
            "blocks",
            "capacity_bytes",
            "used_bytes",
            "cache_hit_bytes",
            "cache_miss_bytes",
            "ufs_read_bytes",
            "ufs_requests",
            "evicted_bytes",
            "short_circuit_bytes",
            "peer_served_bytes",
            "peer_fill_bytes",
            "node_copy_bytes",
        ] {
            assert!(w[k].is_u64(), "{k}: {w}");
        }
        for t in w["tiers"].as_array().expect("tiers") {
            assert!(
                t["tier"].is_string() && t["capacity_bytes"].is_u64() && t["used_bytes"].is_u64()
            );
        }
    }
}

#[test]
fn load_caches_every_readable_byte_once_and_lists_the_files_it_could_not() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-jobs-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    let files = dataset(&src, 2000, 2);
    let s3 = TestStore::s3(root, "dataset", "jobs-access", "jobs-secret-key").unwrap();
    s3.load(&src).unwrap();

    let master = Master::start(root).unwrap();
    let addr = master.addr.clone();
    let workers: Vec<Worker> = (1..=3)
        .map(|i| Worker::start(root, &format!("w{i}"), &addr, "1GiB").unwrap())
        .collect();
    wait_live_workers(&addr, 3).unwrap();
    s3.mount(&addr, "/data", &["sync_interval=never"]).unwrap();

    // Bad input changes nothing: exit 1 with one sentence, no job.
    let out = granary(&["load", "/data/nope", "--master", &addr]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no such file or directory"), "{err}");
    assert_eq!(
        granary(&["load", "/data", "--replicas", "0", "--master", &addr])
            .status
            .code(),
        Some(2)
    );
    let out = granary(&["job", "status", "99", "--master", &addr]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such job: 99"));
    assert_eq!(
        json(&granary_ok(&["job", "list", "--json", "--master", &addr]).unwrap()),
        serde_json::json!([])
    );

    // The namespace knows every file (listed once); then three objects become unreadable.
    let mut dirs = vec![
        "/data".to_string(),
        "/data/small".into(),
        "/data/large".into(),
    ];
    dirs.extend((0..20).map(|d| format!("/data/small/d{d:02}")));
    for d in &dirs {
        granary_ok(&["fs", "ls", d, "--master", &addr]).unwrap();
    }
    let broken = [
        "small/d03/s00003.jpg",
        "small/d07/s01007.jpg",
        "large/l1.bin",
    ];
    let mut broken_bytes = 0;
    for b in broken {
        std::fs::remove_file(s3.object_file(b).unwrap()).unwrap();
        broken_bytes += files.iter().find(|(n, _)| n == b).unwrap().1;
    }
    let total: u64 = files.iter().map(|(_, l)| l).sum();

    let started = std::time::Instant::now();
    let out = granary(&["load", "/data", "--json", "--master", &addr]);
    let took = started.elapsed();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("finished with 3 files not cached"),
        "{stderr}"
    );
    let j = json(&String::from_utf8_lossy(&out.stdout));
    check_job_schema(&j);
    eprintln!(
        "load of {} files ({total} bytes) took {took:?}: {j}",
        files.len()
    );
    assert_eq!(j["state"], "failed");
    assert_eq!(j["total_files"], files.len() as u64);
    assert_eq!(j["total_bytes"], total);
    assert_eq!(j["done_files"], files.len() as u64 - 3);
    assert_eq!(j["done_bytes"], total - broken_bytes);
    assert_eq!(j["failed_files"], 3);
    let mut failed: Vec<String> = j["failed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_string())
        .collect();
    failed.sort();
    let mut want: Vec<String> = broken.iter().map(|b| format!("/data/{b}")).collect();
    want.sort();
    assert_eq!(failed, want);
    for f in j["failed"].as_array().unwrap() {
        assert!(!f["reason"].as_str().unwrap().is_empty(), "{f}");
    }
    // Gone from the store: reported at once, never tried again.
    assert_eq!(
        metric_at(&master.metrics, "granary_master_load_retries_total"),
        0.0,
        "objects gone from the store were loaded again"
    );
    // Every readable byte came from the store exactly once, spread over the owners.
    let from_store = sum(&workers, "granary_worker_ufs_read_bytes_total");
    assert_eq!(from_store, (total - broken_bytes) as f64);
    assert_eq!(j["fetched_bytes"], total - broken_bytes);
    for w in &workers {
        assert!(
            w.metric("granary_worker_cache_used_bytes") > 0.0,
            "a worker got no blocks"
        );
    }

    // The report: schema, and the misses the load paid for (one per fetched page). Worker
    // counters reach the master with heartbeats, so the report may trail the load's last
    // fetches by one heartbeat.
    let report = poll(
        "the report to count every store byte",
        Duration::from_secs(20),
        || {
            let r = json(&granary_ok(&["report", "--json", "--master", &addr]).ok()?);
            (r["ufs_read_bytes"] == total - broken_bytes).then_some(r)
        },
    )
    .unwrap();
    check_report_schema(&report);
    let samples = report["miss_penalty_ms"]["samples"].as_u64().unwrap();
    assert!(samples >= files.len() as u64 - 3, "{report}");
    assert!(
        report["miss_penalty_ms"]["p99"].as_f64().unwrap()
            >= report["miss_penalty_ms"]["p50"].as_f64().unwrap()
    );
    assert_eq!(report["ufs_read_bytes"], total - broken_bytes);

    // A second load finds everything cached: no store reads at all, same failures. Not
    // on a terminal and without --json: progress as plain lines, a human summary.
    let out = granary(&["load", "/data", "--master", &addr]);
    assert_eq!(out.status.code(), Some(1));
    let plain = String::from_utf8_lossy(&out.stderr);
    assert!(
        plain
            .lines()
            .any(|l| l.starts_with("job 2: ") && l.contains("% cached, files ")),
        "{plain}"
    );
    assert!(!plain.contains('\r') && !plain.contains("\x1b["), "{plain}");
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(summary.contains("failed  /data/large/l1.bin"), "{summary}");
    let j2 = json(&granary_ok(&["job", "status", "2", "--json", "--master", &addr]).unwrap());
    assert_eq!(j2["fetched_bytes"], 0);
    assert_eq!(j2["done_bytes"], total - broken_bytes);
    assert_eq!(
        sum(&workers, "granary_worker_ufs_read_bytes_total"),
        from_store
    );
    // Reads through a mount now cost the store nothing either.
    let fuse = Fuse::start(root, &addr).unwrap();
    let readable = |dir: &Path| {
        sh(&format!(
            "cd '{}' && find . -type f ! -name l1.bin ! -name s00003.jpg ! -name s01007.jpg -print0 | sort -z | xargs -0 sha256sum",
            dir.display()
        ))
        .unwrap()
    };
    let through_mount = readable(&fuse.mountpoint.join("data"));
    assert_eq!(through_mount.lines().count(), files.len() - 3);
    assert!(through_mount == readable(&src), "bytes differ");
    assert_eq!(
        sum(&workers, "granary_worker_ufs_read_bytes_total"),
        from_store
    );

    // list / status / cancel of a finished job.
    let list = json(&granary_ok(&["job", "list", "--json", "--master", &addr]).unwrap());
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), 2);
    list.iter().for_each(check_job_schema);
    let st = json(&granary_ok(&["job", "status", "1", "--json", "--master", &addr]).unwrap());
    check_job_schema(&st);
    assert_eq!(st["failed"].as_array().unwrap().len(), 3);
    let human = granary_ok(&["job", "status", "1", "--master", &addr]).unwrap();
    assert!(human.contains("failed  /data/large/l1.bin"), "{human}");
    let c = json(&granary_ok(&["job", "cancel", "1", "--json", "--master", &addr]).unwrap());
    assert_eq!(c["state"], "failed", "a finished job stays as it ended");

    // free: a folder needs -R; then every worker drops every page, and the next load
    // fetches everything again.
    let out = granary(&["free", "/data", "--master", &addr]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("use -R"));
    let freed = json(&granary_ok(&["free", "-R", "/data", "--json", "--master", &addr]).unwrap());
    assert_eq!(freed["files"], files.len() as u64);
    assert_eq!(freed["cached_files"], files.len() as u64 - 3);
    poll(
        "the workers to drop the freed pages",
        Duration::from_secs(30),
        || (sum(&workers, "granary_worker_cache_used_bytes") == 0.0).then_some(()),
    )
    .unwrap();
    // This load runs under a terminal (a pty): a live progress bar, then the summary.
    let (code, screen) = under_pty(&["load", "/data", "--master", &addr]);
    assert_eq!(code, 1, "{screen}");
    assert!(
        screen.contains("ETA") && screen.contains("files "),
        "{screen}"
    );
    assert!(
        screen.contains('\r') || screen.contains("\x1b["),
        "no redraws: {screen}"
    );
    assert!(screen.contains("fetched (not cached before)"), "{screen}");
    let st = json(&granary_ok(&["job", "status", "3", "--json", "--master", &addr]).unwrap());
    assert_eq!(st["fetched_bytes"], total - broken_bytes);
}

/// Runs `granary ARGS` under a pseudo-terminal; returns its exit code and everything it
/// wrote to the terminal.
fn under_pty(args: &[&str]) -> (i32, String) {
    const PTY: &str = r#"
import os, pty, sys
pid, fd = pty.fork()
if pid == 0:
    os.environ["GRANARY_LOG"] = "warn"
    os.execv(sys.argv[1], sys.argv[1:])
out = b""
while True:
    try:
        data = os.read(fd, 65536)
    except OSError:
        break
    if not data:
        break
    out += data
_, status = os.waitpid(pid, 0)
sys.stdout.buffer.write(out)
sys.exit(os.waitstatus_to_exitcode(status))
"#;
    let bin = granary_bin();
    let mut cmd = std::process::Command::new("python3");
    granary_tests::secure_command(&mut cmd, args);
    let out = cmd
        .arg("-c")
        .arg(PTY)
        .arg(&bin)
        .args(args)
        .output()
        .expect("python3 with pty");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn a_load_survives_a_kill9_of_the_master_leader_and_status_never_goes_back() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-jobs-ha-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    let files = dataset(&src, 3000, 3);
    let total: u64 = files.iter().map(|(_, l)| l).sum();
    let s3 = TestStore::s3(root, "hadata", "jobs-access", "jobs-secret-key").unwrap();
    s3.load(&src).unwrap();

    let mut group = MasterGroup::start(root, 3, 0).unwrap();
    let first = group.wait_leader(Duration::from_secs(30)).unwrap();
    let addrs = group.addrs();
    let workers: Vec<Worker> = (1..=3)
        .map(|i| Worker::start(root, &format!("w{i}"), &addrs, "1GiB").unwrap())
        .collect();
    wait_live_workers(&addrs, 3).unwrap();
    s3.mount(&addrs, "/data", &["sync_interval=never"]).unwrap();

    let out = granary_ok(&["load", "/data", "--detach", "--json", "--master", &addrs]).unwrap();
    let id = json(&out)["id"].as_u64().unwrap();
    let status = |addrs: &str| -> Option<serde_json::Value> {
        let id = id.to_string();
        granary_ok(&["job", "status", &id, "--json", "--master", addrs])
            .ok()
            .map(|o| json(&o))
    };
    // Kill the leader once some, but not all, files are cached.
    let before = poll(
        "part of the dataset loaded",
        Duration::from_secs(120),
        || {
            status(&addrs).filter(|j| {
                let d = j["done_files"].as_u64().unwrap_or(0);
                d > 200 && d < files.len() as u64
            })
        },
    )
    .unwrap();
    group.kill9(first).unwrap();
    let second = group.wait_leader(Duration::from_secs(30)).unwrap();
    assert_ne!(first, second);
    // Progress never goes back; the job finishes under the new leader.
    let mut last = before["done_files"].as_u64().unwrap();
    let done = poll("the load to finish", Duration::from_secs(300), || {
        let j = status(&addrs)?;
        let d = j["done_files"].as_u64().unwrap();
        assert!(d >= last, "done_files went from {last} back to {d}");
        last = d;
        (j["state"] != "running" && j["state"] != "planning").then_some(j)
    })
    .unwrap();
    check_job_schema(&done);
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["done_files"], files.len() as u64);
    assert_eq!(done["done_bytes"], total);
    // Each byte from the store exactly once: the new leader's tasks find what the old
    // one's cached (or still fetches) and fetch only the rest.
    let from_store = sum(&workers, "granary_worker_ufs_read_bytes_total");
    assert_eq!(from_store, total as f64, "some bytes were fetched twice");
}

#[test]
fn pinned_data_outlives_cache_pressure_and_a_lost_worker_and_keeps_its_replicas() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-pin-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    // Pinned: 300 small files and one of 20 MiB (~32 MiB); the rest: 320 MiB of others.
    for i in 0..300u64 {
        random_file(&src.join(format!("hot/h{i:03}.bin")), 40 * 1024 + i).unwrap();
    }
    random_file(&src.join("hot/big.bin"), 20 * MIB + 1).unwrap();
    for i in 0..40u64 {
        random_file(&src.join(format!("cold/c{i:02}.bin")), 8 * MIB).unwrap();
    }
    let s3 = TestStore::s3(root, "pins", "pin-access", "pin-secret-key").unwrap();
    s3.load(&src).unwrap();
    let master = Master::start(root).unwrap();
    let addr = master.addr.clone();
    // LRU: every page read goes in and pushes another out (no admission filter to hide
    // behind), so only the pin keeps the hot pages.
    let mut workers: Vec<Worker> = (1..=3)
        .map(|i| {
            let name = format!("w{i}");
            let cache = root.join(format!("{name}-cache"));
            Worker::start_opts(root, &name, &addr, "64MiB", &cache, &["--eviction", "lru"]).unwrap()
        })
        .collect();
    wait_live_workers(&addr, 3).unwrap();
    s3.mount(&addr, "/data", &["sync_interval=never"]).unwrap();

    let out = granary(&["pin", "/data/nope", "--master", &addr]);
    assert_eq!(out.status.code(), Some(1), "pinning a missing path fails");
    let j = json(
        &granary_ok(&[
            "pin",
            "/data/hot",
            "--replicas",
            "2",
            "--json",
            "--master",
            &addr,
        ])
        .unwrap(),
    );
    assert_eq!(j["state"], "succeeded", "{j}");
    let hot_bytes = j["total_bytes"].as_u64().unwrap();
    assert_eq!(j["done_bytes"], hot_bytes);
    let ls = granary_ok(&["fs", "ls", "/data", "--master", &addr]).unwrap();
    assert!(ls.lines().any(|l| l == "hot (pinned)"), "{ls}");
    for p in ["/data/hot/h001.bin", "/data"] {
        let out = granary(&["free", "-R", p, "--master", &addr]);
        assert_eq!(out.status.code(), Some(1), "freeing pinned {p}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("is pinned"));
    }
    assert!(ls.lines().any(|l| l == "cold"), "{ls}");
    let st = json(&granary_ok(&["fs", "ls", "/data/hot", "--json", "--master", &addr]).unwrap());
    assert!(st
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["pinned_replicas"] == 2));

    // Far more than the caches hold goes through them; the pinned pages stay.
    let _ = granary(&["load", "/data/cold", "--master", &addr]);
    let evicted = sum(&workers, "granary_worker_evicted_bytes_total");
    assert!(
        evicted > 100.0 * MIB as f64,
        "no pressure: {evicted} bytes evicted"
    );
    let check = |addr: &str| {
        json(
            &granary_ok(&[
                "load",
                "/data/hot",
                "--replicas",
                "2",
                "--json",
                "--master",
                addr,
            ])
            .unwrap(),
        )
    };
    let again = check(&addr);
    assert_eq!(again["state"], "succeeded");
    assert_eq!(
        again["fetched_bytes"], 0,
        "a pinned page was evicted: {again}"
    );

    // A worker holding replicas dies: the pin is loaded again onto the two left, from the
    // surviving copies (no store reads).
    let store_before = sum(&workers[1..], "granary_worker_ufs_read_bytes_total");
    workers[0].proc.kill9().unwrap();
    let jobs_before = json(&granary_ok(&["job", "list", "--json", "--master", &addr]).unwrap())
        .as_array()
        .unwrap()
        .len();
    let repin = poll("the pin re-replicated", Duration::from_secs(60), || {
        let list = json(&granary_ok(&["job", "list", "--json", "--master", &addr]).ok()?);
        let list = list.as_array()?.clone();
        let j = list.get(jobs_before)?.clone();
        (j["path"] == "/data/hot" && j["state"] != "running" && j["state"] != "planning")
            .then_some(j)
    })
    .unwrap();
    assert_eq!(repin["state"], "succeeded", "{repin}");
    assert_eq!(repin["replicas"], 2);
    assert_eq!(
        sum(&workers[1..], "granary_worker_ufs_read_bytes_total"),
        store_before,
        "re-replication read the store"
    );
    let again = check(&addr);
    assert_eq!(again["fetched_bytes"], 0, "not back to 2 replicas: {again}");

    // Unpinned: marked no more.
    granary_ok(&["unpin", "/data/hot", "--master", &addr]).unwrap();
    let ls = granary_ok(&["fs", "ls", "/data", "--master", &addr]).unwrap();
    assert!(ls.lines().any(|l| l == "hot"), "{ls}");
}

#[test]
fn ttls_free_or_delete_on_time_and_unset_ones_do_nothing() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-ttl-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    let mut sizes = std::collections::BTreeMap::new();
    for (dir, n) in [("a", 20u64), ("b", 5), ("c", 5)] {
        for i in 0..n {
            let name = format!("{dir}/f{i:02}.bin");
            let len = 100_000 + i * 17;
            random_file(&src.join(&name), len).unwrap();
            sizes.insert(name, len);
        }
    }
    let bytes = |prefix: &str| -> u64 {
        sizes
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    };
    let s3 = TestStore::s3(root, "ttls", "ttl-access", "ttl-secret-key").unwrap();
    s3.load(&src).unwrap();
    let master = Master::start(root).unwrap();
    let addr = master.addr.clone();
    let workers = vec![Worker::start(root, "w1", &addr, "256MiB").unwrap()];
    wait_live_workers(&addr, 1).unwrap();
    s3.mount(&addr, "/data", &["sync_interval=never"]).unwrap();
    granary_ok(&["load", "/data", "--master", &addr]).unwrap();
    let used = || sum(&workers, "granary_worker_cache_used_bytes") as u64;
    assert_eq!(used(), bytes(""));

    // Bad input changes nothing.
    for (args, code) in [
        (vec!["ttl", "set", "/data/nope", "5s"], 1),
        (vec!["ttl", "set", "/data/a", "0s"], 1),
        (vec!["ttl", "set", "/", "5s"], 1),
        (vec!["ttl", "set", "/data/a", "5s", "--action", "shred"], 2),
        (vec!["ttl", "set", "/data/a", "soon"], 2),
    ] {
        let mut a = args.clone();
        a.extend(["--master", addr.as_str()]);
        assert_eq!(granary(&a).status.code(), Some(code), "{args:?}");
    }

    let set_at = std::time::Instant::now();
    granary_ok(&["ttl", "set", "/data/a", "3s", "--master", &addr]).unwrap();
    granary_ok(&[
        "ttl",
        "set",
        "/data/b/f02.bin",
        "3s",
        "--action",
        "delete",
        "--master",
        &addr,
    ])
    .unwrap();
    granary_ok(&["ttl", "set", "/data/c", "2s", "--master", &addr]).unwrap();
    granary_ok(&["ttl", "unset", "/data/c", "--master", &addr]).unwrap();
    let st = json(&granary_ok(&["fs", "stat", "/data/a", "--json", "--master", &addr]).unwrap());
    assert_eq!(st["ttl"]["action"], "free", "{st}");
    let c = json(&granary_ok(&["fs", "stat", "/data/c", "--json", "--master", &addr]).unwrap());
    assert!(c["ttl"].is_null(), "{c}");

    let want = bytes("") - bytes("a/") - sizes["b/f02.bin"];
    poll("the TTLs to act", Duration::from_secs(20), || {
        (used() == want).then_some(())
    })
    .unwrap();
    let took = set_at.elapsed();
    assert!(
        took >= Duration::from_secs(3),
        "acted early, after {took:?}"
    );
    assert!(took < Duration::from_secs(8), "acted late, after {took:?}");
    // Deleted: gone from the namespace and the store; freed: still there, re-readable.
    let ls = granary_ok(&["fs", "ls", "/data/b", "--master", &addr]).unwrap();
    assert!(!ls.contains("f02.bin") && ls.contains("f01.bin"), "{ls}");
    assert!(!s3.object_file("b/f02.bin").unwrap().exists());
    let ls = granary_ok(&["fs", "ls", "/data/a", "--master", &addr]).unwrap();
    assert_eq!(ls.lines().count(), 20);
    let st = json(&granary_ok(&["fs", "stat", "/data/a", "--json", "--master", &addr]).unwrap());
    assert!(st["ttl"].is_null(), "an acted-on TTL is removed: {st}");
    // The unset TTL (due 2 s after it was set, over 3 s ago) never acted: /data/c is still
    // cached (its bytes are in `want`).
    assert_eq!(used(), want);

    // fs: stat shows where a file is cached; du, ls -R, mv and rm -R.
    let stat =
        |p: &str| json(&granary_ok(&["fs", "stat", p, "--json", "--master", &addr]).unwrap());
    let c0 = stat("/data/c/f00.bin");
    assert_eq!(
        (c0["cached_percent"].as_f64(), c0["replicas"].as_u64()),
        (Some(100.0), Some(1)),
        "{c0}"
    );
    assert_eq!(c0["locations"].as_array().unwrap().len(), 1, "{c0}");
    // Freed: the worker reports the dropped blocks at its next heartbeat.
    let a0 = poll(
        "the freed blocks to leave the locations",
        Duration::from_secs(10),
        || {
            let a0 = stat("/data/a/f00.bin");
            (a0["cached_percent"].as_f64() == Some(0.0)).then_some(a0)
        },
    )
    .unwrap();
    assert_eq!(a0["replicas"], 0, "{a0}");
    let du = json(&granary_ok(&["fs", "du", "-s", "/data", "--json", "--master", &addr]).unwrap());
    assert_eq!(du["bytes"], bytes("") - sizes["b/f02.bin"]);
    assert_eq!(du["files"], sizes.len() as u64 - 1);
    let all = granary_ok(&["fs", "ls", "-R", "/data", "--master", &addr]).unwrap();
    assert_eq!(all.lines().count(), 3 + sizes.len() - 1, "{all}");
    assert!(all.lines().any(|l| l == "/data/a/f07.bin"), "{all}");
    granary_ok(&[
        "fs",
        "mv",
        "/data/c/f00.bin",
        "/data/c/g00.bin",
        "--master",
        &addr,
    ])
    .unwrap();
    assert!(s3.object_file("c/g00.bin").unwrap().exists());
    assert!(!s3.object_file("c/f00.bin").unwrap().exists());
    let out = granary(&["fs", "rm", "/data/c", "--master", &addr]);
    assert_eq!(out.status.code(), Some(1), "a directory needs -R");
    assert!(s3.object_file("c/f01.bin").unwrap().exists());
    granary_ok(&["fs", "rm", "-R", "/data/c", "--master", &addr]).unwrap();
    assert!(!s3.object_file("c/f01.bin").unwrap().exists());
    let out = granary(&["fs", "stat", "/data/c", "--master", &addr]);
    assert_eq!(out.status.code(), Some(1));

    // fs cp: within Granary (the copy lands in the store: cache-through), to and from the
    // local disk; an existing destination needs --force.
    granary_ok(&[
        "fs",
        "cp",
        "/data/b/f00.bin",
        "/data/b/copy.bin",
        "--master",
        &addr,
    ])
    .unwrap();
    let sha = |p: &Path| sh(&format!("sha256sum < '{}'", p.display())).unwrap();
    assert_eq!(
        sha(&s3.object_file("b/copy.bin").unwrap()),
        sha(&src.join("b/f00.bin"))
    );
    let out = granary(&[
        "fs",
        "cp",
        "/data/b/f01.bin",
        "/data/b/copy.bin",
        "--master",
        &addr,
    ]);
    assert_eq!(out.status.code(), Some(1), "replaced without --force");
    let local = root.join("out.bin");
    let to_local = format!("file:{}", local.display());
    granary_ok(&["fs", "cp", "/data/b/copy.bin", &to_local, "--master", &addr]).unwrap();
    assert_eq!(sha(&local), sha(&src.join("b/f00.bin")));
    let from_local = format!("file:{}", src.join("a/f03.bin").display());
    granary_ok(&[
        "fs",
        "cp",
        &from_local,
        "/data/b/f01.bin",
        "-f",
        "--master",
        &addr,
    ])
    .unwrap();
    assert_eq!(
        sha(&s3.object_file("b/f01.bin").unwrap()),
        sha(&src.join("a/f03.bin"))
    );
}
