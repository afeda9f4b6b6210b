//! Acceptance tests of the foundation: real `granary` processes on loopback, a real FUSE
//! mount read by ordinary programs (`sha256sum`, `ls`, `find`, `cat`), real metrics.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use granary_tests::*;

const MIB: u64 = 1024 * 1024;

/// The dataset of the acceptance criteria, built once per test binary.
fn dataset() -> &'static (PathBuf, u64) {
    static DATA: OnceLock<(PathBuf, u64)> = OnceLock::new();
    DATA.get_or_init(|| {
        // Kept under cargo's per-target temp dir and reused by later runs (330 MiB); the
        // marker beside it records the total once the tree is complete.
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let dir = base.join("acceptance-dataset-v1");
        let marker = base.join("acceptance-dataset-v1.total");
        if let Some(total) = std::fs::read_to_string(&marker)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            return (dir, total);
        }
        let _ = std::fs::remove_dir_all(&dir);
        let mut total = 0;
        for (name, len) in [
            ("empty", 0),
            ("one-byte", 1),
            ("four-k", 4096),
            ("one-mib-plus-one", MIB + 1),
            ("big/130mib.bin", 130 * MIB),
        ] {
            random_file(&dir.join(name), len).expect("dataset file");
            total += len;
        }
        for i in 0..2000u64 {
            let p = dir.join(format!("small/d{:02}/e{}/f{:04}.bin", i % 20, i % 3, i));
            random_file(&p, 100 * 1024).expect("dataset file");
            total += 100 * 1024;
        }
        std::fs::write(&marker, total.to_string()).expect("dataset marker");
        (dir, total)
    })
}

fn small_dataset(root: &Path) -> (PathBuf, u64) {
    let dir = root.join("ufs");
    let files = [("a/x.bin", 3 * MIB + 5), ("a/y.bin", 12345), ("b.bin", MIB)];
    for (n, l) in files {
        random_file(&dir.join(n), l).unwrap();
    }
    (dir, files.iter().map(|f| f.1).sum())
}

fn workdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("granary-it-")
        .tempdir()
        .unwrap()
}

fn ufs_reads(workers: &[&Worker]) -> f64 {
    workers
        .iter()
        .map(|w| w.metric("granary_worker_ufs_read_bytes_total"))
        .sum()
}

fn hits(workers: &[&Worker]) -> f64 {
    workers
        .iter()
        .map(|w| w.metric("granary_worker_cache_hit_bytes_total"))
        .sum()
}

#[test]
fn two_workers_serve_the_tree_exactly_and_the_second_read_is_all_cache() {
    let (src, total) = dataset();
    let root = workdir();
    let master = Master::start(root.path()).unwrap();
    let w1 = Worker::start(root.path(), "w1", &master.addr, "2GiB").unwrap();
    let w2 = Worker::start(root.path(), "w2", &master.addr, "2GiB").unwrap();
    wait_live_workers(&master.addr, 2).unwrap();
    granary_ok(&[
        "mount",
        "add",
        "/data",
        &src.to_string_lossy(),
        "--master",
        &master.addr,
    ])
    .unwrap();
    // Byte accounting below needs every read to reach the daemon (no passthrough).
    let fuse = Fuse::start_opts(root.path(), "mnt", &master.addr, &["--no-passthrough"]).unwrap();
    let mnt = fuse.mountpoint.join("data");

    // Listing and sizes.
    assert_eq!(
        sh(&format!("cd '{}' && ls -R .", mnt.display())).unwrap(),
        sh(&format!("cd '{}' && ls -R .", src.display())).unwrap(),
        "ls -R differs"
    );
    assert_eq!(
        tree_stats(&mnt).unwrap(),
        tree_stats(src).unwrap(),
        "sizes differ"
    );

    // Bytes.
    let expected = tree_sums(src).unwrap();
    assert_eq!(expected.len(), 2005);
    assert_eq!(
        tree_sums(&mnt).unwrap(),
        expected,
        "first read differs from the source"
    );
    let ufs_after_first = ufs_reads(&[&w1, &w2]);
    assert_eq!(
        ufs_after_first, *total as f64,
        "each byte is fetched from the under-store exactly once"
    );
    let hits_before = hits(&[&w1, &w2]);
    let short_circuit =
        |f: &Fuse| f.metric("granary_client_read_bytes_total{source=\"short_circuit\"}");
    let sc_before = short_circuit(&fuse);

    // Second pass (as on a node that has not read the files: the kernel's copy dropped): all
    // from the workers' caches, over gRPC or straight from their block files.
    drop_page_cache(&mnt).unwrap();
    assert_eq!(
        tree_sums(&mnt).unwrap(),
        expected,
        "second read differs from the source"
    );
    assert_eq!(
        ufs_reads(&[&w1, &w2]),
        ufs_after_first,
        "second read touched the under-store"
    );
    let hit_delta = hits(&[&w1, &w2]) - hits_before + short_circuit(&fuse) - sc_before;
    assert!(
        hit_delta >= *total as f64,
        "second read hit only {hit_delta} of {total} bytes"
    );
    // Both workers took a share (rendezvous placement).
    assert!(w1.metric("granary_worker_cache_used_bytes") > 0.0);
    assert!(w2.metric("granary_worker_cache_used_bytes") > 0.0);
    poll(
        "granary_master_inodes to count the tree",
        Duration::from_secs(5),
        || (metric_at(&master.metrics, "granary_master_inodes") >= 2005.0 + 1.0).then_some(()),
    )
    .unwrap();
}

#[test]
fn cache_quota_is_never_exceeded_and_reads_stay_correct() {
    let root = workdir();
    let src = root.path().join("ufs");
    random_file(&src.join("big.bin"), 40 * MIB).unwrap();
    for i in 0..20 {
        random_file(&src.join(format!("s/{i}.bin")), 300 * 1024).unwrap();
    }
    let quota = 8 * MIB;
    let master = Master::start(root.path()).unwrap();
    // LRU: every pass evicts (the admission filter would keep the first 8 MiB instead; the
    // store's property test covers quotas under both policies).
    let w = Worker::start_opts(
        root.path(),
        "w1",
        &master.addr,
        &quota.to_string(),
        &root.path().join("w1-cache"),
        &["--eviction", "lru"],
    )
    .unwrap();
    wait_live_workers(&master.addr, 1).unwrap();
    granary_ok(&[
        "mount",
        "add",
        "/d",
        &src.to_string_lossy(),
        "--master",
        &master.addr,
    ])
    .unwrap();
    let fuse = Fuse::start(root.path(), &master.addr).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        let metrics = w.metrics.clone();
        let cache = w.cache_dir.clone();
        std::thread::spawn(move || {
            let (mut max_metric, mut max_disk, mut samples) = (0f64, 0u64, 0u32);
            while !stop.load(Ordering::Relaxed) {
                if let Ok(t) = scrape(&metrics) {
                    if let Some(v) = metric(&t, "granary_worker_cache_used_bytes") {
                        max_metric = max_metric.max(v);
                        samples += 1;
                    }
                }
                // Allocated bytes of the block files (sparse files count what they hold).
                if let Ok(out) = sh(&format!("du -s --block-size=1 '{}/files'", cache.display())) {
                    if let Some(v) = out.split_whitespace().next().and_then(|v| v.parse().ok()) {
                        max_disk = max_disk.max(v);
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            (max_metric, max_disk, samples)
        })
    };
    let mnt = fuse.mountpoint.join("d");
    let expected = tree_sums(&src).unwrap();
    for _ in 0..2 {
        assert_eq!(tree_sums(&mnt).unwrap(), expected);
    }
    stop.store(true, Ordering::Relaxed);
    let (max_metric, max_disk, samples) = sampler.join().unwrap();
    assert!(samples > 10, "too few samples ({samples})");
    assert!(
        max_metric <= quota as f64,
        "used bytes reached {max_metric} > quota {quota}"
    );
    assert!(
        max_metric > (quota / 2) as f64,
        "the cache was barely used ({max_metric})"
    );
    // Directories and file-system block rounding add a little on disk.
    assert!(
        max_disk <= quota + MIB,
        "block files took {max_disk} bytes on disk > quota {quota}"
    );
    assert!(w.metric("granary_worker_evicted_bytes_total") > 0.0);
    assert!(w.metric("granary_worker_cache_used_bytes") <= quota as f64);
}

#[test]
fn master_kill9_restart_keeps_mounts_and_namespace() {
    let root = workdir();
    let (src, _) = small_dataset(root.path());
    let other = root.path().join("other");
    random_file(&other.join("o.bin"), 777).unwrap();
    let mut master = Master::start(root.path()).unwrap();
    let addr = master.addr.clone();
    let w = Worker::start(root.path(), "w1", &addr, "1GiB").unwrap();
    wait_live_workers(&addr, 1).unwrap();
    granary_ok(&[
        "mount",
        "add",
        "/data",
        &src.to_string_lossy(),
        "--master",
        &addr,
    ])
    .unwrap();
    granary_ok(&[
        "mount",
        "add",
        "/other",
        &other.to_string_lossy(),
        "--master",
        &addr,
    ])
    .unwrap();
    let listing = granary_ok(&["fs", "ls", "/data/a", "--master", &addr]).unwrap();
    assert_eq!(listing, "x.bin\ny.bin\n");
    let mounts_before = granary_ok(&["mount", "list", "--master", &addr]).unwrap();
    let stat_before =
        granary_ok(&["fs", "stat", "/data/a/x.bin", "--json", "--master", &addr]).unwrap();
    let fuse = Fuse::start(root.path(), &addr).unwrap();

    master.proc.kill9().unwrap();
    let master = Master::start_on(root.path(), &master.data_dir, master.port).unwrap();
    assert_eq!(master.addr, addr);
    assert_eq!(
        granary_ok(&["mount", "list", "--master", &addr]).unwrap(),
        mounts_before
    );
    assert_eq!(
        granary_ok(&["fs", "stat", "/data/a/x.bin", "--json", "--master", &addr]).unwrap(),
        stat_before,
        "namespace entry changed across the restart"
    );
    // The worker re-registers; a read through the mount that was up all along works.
    wait_live_workers(&addr, 1).unwrap();
    let expected = tree_sums(&src).unwrap();
    assert_eq!(tree_sums(&fuse.mountpoint.join("data")).unwrap(), expected);
    assert_eq!(
        sh(&format!(
            "sha256sum < '{}'",
            fuse.mountpoint.join("other/o.bin").display()
        ))
        .unwrap(),
        sh(&format!("sha256sum < '{}'", other.join("o.bin").display())).unwrap()
    );
    assert!(w.metric("granary_worker_ufs_read_bytes_total") > 0.0);
}

#[test]
fn reads_survive_a_worker_kill9() {
    let root = workdir();
    let (src, _) = small_dataset(root.path());
    // Over gRPC only (a dead worker's block files stay readable on this host, which would
    // hide the failover), and with the kernel's copy dropped before every pass.
    let mut c = Cluster::start_opts(root.path(), 2, "1GiB", &src, &["--no-short-circuit"]).unwrap();
    let mnt = c.data();
    let expected = tree_sums(&src).unwrap();
    let pass = |mnt: &Path| {
        drop_page_cache(mnt).unwrap();
        tree_sums(mnt).unwrap()
    };
    assert_eq!(pass(&mnt), expected);
    c.workers[0].proc.kill9().unwrap();
    let before = c.workers[1].metric("granary_worker_read_requests_total");
    // Immediately (the master has not noticed yet) and after it declared the worker lost.
    assert_eq!(pass(&mnt), expected);
    wait_live_workers(&c.master.addr, 1).unwrap();
    assert_eq!(pass(&mnt), expected);
    assert!(c.workers[1].metric("granary_worker_read_requests_total") > before);
    // With no worker left, the client reads the under-store directly.
    c.workers[1].proc.kill9().unwrap();
    assert_eq!(pass(&mnt), expected);
    wait_live_workers(&c.master.addr, 0).unwrap();
    assert_eq!(pass(&mnt), expected);
    assert!(
        c.fuse
            .metric("granary_client_read_bytes_total{source=\"under_store\"}")
            > 0.0
    );
}

#[test]
fn restarted_worker_serves_its_cache_without_under_store_reads() {
    let root = workdir();
    let (src, total) = small_dataset(root.path());
    let master = Master::start(root.path()).unwrap();
    let mut w = Worker::start(root.path(), "w1", &master.addr, "1GiB").unwrap();
    wait_live_workers(&master.addr, 1).unwrap();
    granary_ok(&[
        "mount",
        "add",
        "/data",
        &src.to_string_lossy(),
        "--master",
        &master.addr,
    ])
    .unwrap();
    // Byte accounting below needs every read to reach the daemon (no passthrough).
    let fuse = Fuse::start_opts(root.path(), "mnt", &master.addr, &["--no-passthrough"]).unwrap();
    let mnt = fuse.mountpoint.join("data");
    let expected = tree_sums(&src).unwrap();
    assert_eq!(tree_sums(&mnt).unwrap(), expected);
    assert_eq!(
        w.metric("granary_worker_ufs_read_bytes_total"),
        total as f64
    );
    let cache_dir = w.cache_dir.clone();
    w.proc.kill9().unwrap();

    let w = Worker::start_with(root.path(), "w1-again", &master.addr, "1GiB", &cache_dir).unwrap();
    assert_eq!(w.metric("granary_worker_cache_used_bytes"), total as f64);
    // Wait until the master lists the restarted worker's new address.
    poll(
        "the restarted worker to be listed",
        Duration::from_secs(30),
        || {
            let v = wait_live_workers(&master.addr, 1).ok()?;
            (v["workers"]
                .as_array()?
                .iter()
                .any(|x| x["address"] == w.addr.as_str() && x["state"] == "live"))
            .then_some(())
        },
    )
    .unwrap_or_else(|e| {
        // Seen once under full-suite load; keep what is needed to diagnose it.
        panic!(
            "{e:#}\nreport: {}\nrestarted worker log:\n{}\nmaster log:\n{}",
            String::from_utf8_lossy(
                &granary(&["report", "--json", "--master", &master.addr]).stdout
            ),
            w.proc.log_text(),
            master.proc.log_text()
        )
    });
    // The mount's cached worker list still names the old address: the client must find the
    // new one through the master rather than fall back to the under-store.
    let sc = |f: &Fuse| f.metric("granary_client_read_bytes_total{source=\"short_circuit\"}");
    let sc_before = sc(&fuse);
    drop_page_cache(&mnt).unwrap();
    assert_eq!(tree_sums(&mnt).unwrap(), expected);
    assert_eq!(w.metric("granary_worker_ufs_read_bytes_total"), 0.0);
    assert_eq!(
        fuse.metric("granary_client_read_bytes_total{source=\"under_store\"}"),
        0.0
    );
    assert!(
        w.metric("granary_worker_cache_hit_bytes_total") + sc(&fuse) - sc_before >= total as f64
    );
}

#[test]
fn a_corrupted_cached_page_is_never_served() {
    let root = workdir();
    let (src, _) = small_dataset(root.path());
    let c = Cluster::start(root.path(), 1, "1GiB", &src).unwrap();
    let w = &c.workers[0];
    let file = c.data().join("b.bin");
    let want = sh(&format!("sha256sum < '{}'", src.join("b.bin").display())).unwrap();
    assert_eq!(
        sh(&format!("sha256sum < '{}'", file.display())).unwrap(),
        want
    );
    let ufs_before = w.metric("granary_worker_ufs_read_bytes_total");

    // b.bin is the only 1 MiB file (one block of one page): flip a byte of its block file.
    let blocks = sh(&format!(
        "find '{}/files' -type f -size 1048576c",
        w.cache_dir.display()
    ))
    .unwrap();
    let block = blocks
        .lines()
        .next()
        .expect("a cached block file")
        .to_string();
    let mut bytes = std::fs::read(&block).unwrap();
    bytes[1000] ^= 0xff;
    std::fs::write(&block, &bytes).unwrap();
    // The kernel still holds the good bytes it read: make the next read reach the daemon
    // (which, on this host, reads the block file itself under a short-circuit lease — its
    // checksum check must send it back to the worker).
    drop_page_cache(&c.data()).unwrap();

    assert_eq!(
        sh(&format!("sha256sum < '{}'", file.display())).unwrap(),
        want
    );
    assert_eq!(w.metric("granary_worker_checksum_failures_total"), 1.0);
    assert_eq!(
        w.metric("granary_worker_ufs_read_bytes_total") - ufs_before,
        MIB as f64
    );
    // And the refetched page is good again.
    assert_eq!(
        sh(&format!("sha256sum < '{}'", file.display())).unwrap(),
        want
    );
    assert_eq!(w.metric("granary_worker_checksum_failures_total"), 1.0);
}

#[test]
fn bad_input_gets_a_clear_error_and_changes_nothing() {
    let root = workdir();
    let (src, _) = small_dataset(root.path());
    let master = Master::start(root.path()).unwrap();
    let m = master.addr.as_str();
    granary_ok(&[
        "mount",
        "add",
        "/data",
        &src.to_string_lossy(),
        "--master",
        m,
    ])
    .unwrap();
    // Load /data's metadata first: lazy loading on lookup is not a change by bad input.
    granary_ok(&["fs", "ls", "/data", "--master", m]).unwrap();
    let mounts = granary_ok(&["mount", "list", "--json", "--master", m]).unwrap();
    let inodes = granary_ok(&["report", "--json", "--master", m]).unwrap();
    let inodes: serde_json::Value = serde_json::from_str(&inodes).unwrap();

    let out = granary(&[
        "mount",
        "add",
        "/missing",
        "/definitely/not/a/dir",
        "--master",
        m,
    ]);
    assert_one_sentence_error(&out, "mount add of a missing directory");
    assert!(String::from_utf8_lossy(&out.stderr).contains("/definitely/not/a/dir"));

    let out = granary(&[
        "mount",
        "add",
        "/data/nested",
        &src.to_string_lossy(),
        "--master",
        m,
    ]);
    assert_one_sentence_error(&out, "nested mount");

    let out = granary(&["mount", "add", "/rel", "relative/dir", "--master", m]);
    assert_one_sentence_error(&out, "mount add of a relative path");

    let out = granary(&["fs", "stat", "/data/nope.bin", "--master", m]);
    assert_one_sentence_error(&out, "fs stat of a missing path");
    assert!(String::from_utf8_lossy(&out.stderr).contains("/data/nope.bin"));

    let out = granary(&[
        "worker",
        "--master",
        m,
        "--cache-dir",
        "/tmp/x",
        "--cache-size",
        "12XB",
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "malformed size is a usage error"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid size"));

    let missing_mp = root.path().join("no-such-mountpoint");
    let out = granary(&[
        "fuse",
        "--master",
        m,
        "--mount",
        &missing_mp.to_string_lossy(),
    ]);
    assert_one_sentence_error(&out, "fuse on a missing mount point");
    let out = granary(&[
        "local",
        "--ufs",
        &src.to_string_lossy(),
        "--mount",
        &missing_mp.to_string_lossy(),
    ]);
    assert_one_sentence_error(&out, "local on a missing mount point");

    for verb in ["decommission", "recommission"] {
        let out = granary(&["worker", verb, "999", "--master", m]);
        assert_one_sentence_error(&out, &format!("{verb} of an unknown worker"));
    }

    let out = granary(&["fs", "ls", "/", "--master", "127.0.0.1:1"]);
    assert_one_sentence_error(&out, "unreachable master");

    // A reader that stops early (`granary fs ls / | head`) ends the command as it ends
    // `ls`: by SIGPIPE, with nothing on stderr (it panicked with a backtrace).
    let args = ["fs", "ls", "/", "--master", m];
    let mut cmd = std::process::Command::new(granary_bin());
    secure_command(&mut cmd, &args);
    let mut child = cmd
        .args(args)
        .env("GRANARY_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(13),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    assert_eq!(
        granary_ok(&["mount", "list", "--json", "--master", m]).unwrap(),
        mounts
    );
    let after: serde_json::Value =
        serde_json::from_str(&granary_ok(&["report", "--json", "--master", m]).unwrap()).unwrap();
    assert_eq!(
        after["inodes"], inodes["inodes"],
        "bad input changed the namespace"
    );
    assert_eq!(after["mounts"], 1);
}

#[test]
fn local_mode_serves_a_folder_and_unmounts_on_ctrl_c() {
    let root = workdir();
    let (src, total) = small_dataset(root.path());
    let mp = root.path().join("mnt");
    std::fs::create_dir_all(&mp).unwrap();
    let _unmount = UnmountOnDrop(mp.clone());
    // The README command, with a private cache dir.
    let mut p = Proc::spawn(
        "local",
        root.path(),
        &[
            "local",
            "--ufs",
            &src.to_string_lossy(),
            "--mount",
            &mp.to_string_lossy(),
            "--cache-dir",
            &root.path().join("cache").to_string_lossy(),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    )
    .unwrap();
    p.wait_for_line("granary mounted at", Duration::from_secs(60))
        .unwrap();
    let metrics = p
        .wait_for_line("metrics on http://", Duration::from_secs(5))
        .unwrap();
    let metrics = metrics.trim_end_matches("/metrics").to_string();
    assert!(is_mounted(&mp));
    let expected = tree_sums(&src).unwrap();
    assert_eq!(tree_sums(&mp).unwrap(), expected);
    drop_page_cache(&mp).unwrap();
    assert_eq!(tree_sums(&mp).unwrap(), expected);
    let text = scrape(&metrics).unwrap();
    metrics_are_documented(&text);
    // The second pass came from the cache: in passthrough for the two files of at least
    // 1 MiB (every file is one block; smaller ones are read through the daemon).
    assert_eq!(
        metric(&text, "granary_worker_ufs_read_bytes_total"),
        Some(total as f64)
    );
    assert!(metric(&text, "granary_client_passthrough_opens_total").unwrap() >= 2.0);
    // The master refreshes its gauges periodically.
    poll(
        "granary_master_inodes to count the tree",
        Duration::from_secs(5),
        || (metric_at(&metrics, "granary_master_inodes") == 5.0).then_some(()),
    )
    .unwrap();

    assert_eq!(
        p.stop("INT", Duration::from_secs(20)).unwrap(),
        Some(0),
        "log:\n{}",
        p.log_text()
    );
    assert!(!is_mounted(&mp), "still mounted after Ctrl-C");

    // A second run over the same cache dir serves from the cache it kept.
    let mut p = Proc::spawn(
        "local2",
        root.path(),
        &[
            "local",
            "--ufs",
            &src.to_string_lossy(),
            "--mount",
            &mp.to_string_lossy(),
            "--cache-dir",
            &root.path().join("cache").to_string_lossy(),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    )
    .unwrap();
    p.wait_for_line("granary mounted at", Duration::from_secs(60))
        .unwrap();
    let metrics = p
        .wait_for_line("metrics on http://", Duration::from_secs(5))
        .unwrap();
    let metrics = metrics.trim_end_matches("/metrics").to_string();
    assert_eq!(tree_sums(&mp).unwrap(), expected);
    assert_eq!(
        metric_at(&metrics, "granary_worker_ufs_read_bytes_total"),
        0.0
    );
    assert_eq!(p.stop("TERM", Duration::from_secs(20)).unwrap(), Some(0));
    assert!(!is_mounted(&mp));
}

#[test]
fn a_changed_under_store_object_is_refused_not_mixed() {
    let root = workdir();
    let (src, _) = small_dataset(root.path());
    let c = Cluster::start(root.path(), 1, "1GiB", &src).unwrap();
    let w = &c.workers[0];
    // Load the metadata (fingerprints), then change the object behind Granary's back.
    sh(&format!("ls -l '{}'", c.data().display())).unwrap();
    random_file(&src.join("b.bin"), MIB).unwrap();
    let out = std::process::Command::new("cat")
        .arg(c.data().join("b.bin"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "a changed object was served");
    assert!(
        out.stdout.is_empty(),
        "bytes of a changed object were served"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Stale file handle"),
        "expected ESTALE, got: {err}"
    );
    assert_eq!(
        w.metric("granary_worker_cache_used_bytes"),
        0.0,
        "a changed object was cached"
    );
}

#[test]
fn a_read_only_mount_refuses_every_change_with_erofs() {
    let root = workdir();
    let (src, _) = small_dataset(root.path());
    let master = Master::start(root.path()).unwrap();
    granary_ok(&[
        "mount",
        "add",
        "/data",
        &src.to_string_lossy(),
        "--master",
        &master.addr,
    ])
    .unwrap();
    let fuse = Fuse::start_opts(root.path(), "mnt", &master.addr, &["--read-only"]).unwrap();
    let d = fuse.mountpoint.join("data");
    for cmd in [
        format!("echo x > '{}/new.txt'", d.display()),
        format!("echo x >> '{}/b.bin'", d.display()),
        format!("truncate -s 0 '{}/b.bin'", d.display()),
        format!("mkdir '{}/newdir'", d.display()),
        format!("rm '{}/b.bin'", d.display()),
        format!("mv '{}/b.bin' '{}/c.bin'", d.display(), d.display()),
    ] {
        let err = sh(&cmd).expect_err(&cmd).to_string();
        assert!(err.contains("Read-only file system"), "{cmd}: {err}");
    }
    // Nothing changed, in Granary or in the under-store.
    assert_eq!(tree_sums(&d).unwrap(), tree_sums(&src).unwrap());
    assert_eq!(
        granary_ok(&["fs", "ls", "/data", "--master", &master.addr]).unwrap(),
        "a\nb.bin\n"
    );
}

#[test]
fn a_config_file_sets_flags_and_the_command_line_wins() {
    let root = workdir();
    let port = free_port();
    let data = root.path().join("cfg-master");
    let cfg = root.path().join("granary.toml");
    std::fs::write(
        &cfg,
        format!(
            "masters = \"127.0.0.1:{port}\"\n[master]\ndata-dir = \"{}\"\nlisten = \"127.0.0.1:1\"\nworker_timeout = \"3s\"\n",
            data.display()
        ),
    )
    .unwrap();
    let c = cfg.to_string_lossy().to_string();
    let listen = format!("127.0.0.1:{port}");
    // --listen on the command line overrides the file's.
    let mut m = Proc::spawn(
        "cfg-master",
        root.path(),
        &["--config", &c, "master", "--listen", &listen],
    )
    .unwrap();
    let addr = m
        .wait_for_line("granary master listening on", Duration::from_secs(60))
        .unwrap();
    assert_eq!(addr, listen);
    assert!(data.join("meta").is_dir(), "data-dir from the file unused");
    // Client commands take the master list from the top-level key.
    let out = granary(&["fs", "mkdir", "/from-config", "--config", &c]);
    assert!(out.status.success(), "{out:?}");
    let ls = granary_ok(&["fs", "ls", "/", "--master", &addr]).unwrap();
    assert_eq!(ls, "from-config\n");
    // An unknown setting is a usage error naming it; nothing starts.
    std::fs::write(&cfg, "[master]\ndata-dirr = \"/x\"\n").unwrap();
    let out = granary(&["master", "--config", &c]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown setting \"data-dirr\""), "{err}");
    m.stop("TERM", Duration::from_secs(10)).unwrap();
}

#[test]
fn short_circuit_reads_same_host_block_files_and_counts_them() {
    let root = workdir();
    let src = root.path().join("ufs");
    let files = [
        ("big.bin", 5 * MIB + 123),
        ("one.bin", MIB),
        ("small.bin", 4321),
    ];
    for (n, l) in files {
        random_file(&src.join(n), l).unwrap();
    }
    let total: u64 = files.iter().map(|f| f.1).sum();
    // Passthrough off: this is about reads the daemon serves from block files.
    let c = Cluster::start_opts(root.path(), 1, "1GiB", &src, &["--no-passthrough"]).unwrap();
    let w = &c.workers[0];
    let expected = tree_sums(&src).unwrap();
    let client = |f: &Fuse, source: &str| {
        f.metric(&format!(
            "granary_client_read_bytes_total{{source=\"{source}\"}}"
        ))
    };

    // Cold pass: every byte from the under-store once, through the worker.
    assert_eq!(tree_sums(&c.data()).unwrap(), expected);
    assert_eq!(
        w.metric("granary_worker_ufs_read_bytes_total"),
        total as f64
    );
    let sc_cold = client(&c.fuse, "short_circuit");
    let grpc_cold = client(&c.fuse, "worker");
    assert_eq!(
        sc_cold + grpc_cold,
        total as f64,
        "cold pass: every byte from the worker"
    );

    // Warm pass with the kernel's copy dropped: every byte from the worker's block files,
    // none over gRPC, none from the under-store.
    drop_page_cache(&c.data()).unwrap();
    assert_eq!(tree_sums(&c.data()).unwrap(), expected);
    assert_eq!(
        client(&c.fuse, "short_circuit") - sc_cold,
        total as f64,
        "the warm pass was not all short-circuit"
    );
    assert_eq!(client(&c.fuse, "worker"), grpc_cold);
    assert_eq!(
        w.metric("granary_worker_ufs_read_bytes_total"),
        total as f64
    );
    assert!(w.metric("granary_worker_short_circuit_leases_total") >= 2.0);
    assert!(c.fuse.metric("granary_client_short_circuit_leases_total") >= 2.0);
    // The client reports what it read to the worker (every 2 s).
    let sc_total = client(&c.fuse, "short_circuit");
    poll(
        "the worker to count the short-circuit bytes",
        Duration::from_secs(20),
        || (w.metric("granary_worker_short_circuit_bytes_total") == sc_total).then_some(()),
    )
    .unwrap();

    // A mount with short-circuit off reads the same bytes over gRPC (cache hits).
    let plain = Fuse::start_opts(
        root.path(),
        "plain",
        &c.master.addr,
        &["--no-short-circuit"],
    )
    .unwrap();
    let hits_before = w.metric("granary_worker_cache_hit_bytes_total");
    assert_eq!(tree_sums(&plain.mountpoint.join("data")).unwrap(), expected);
    assert_eq!(client(&plain, "short_circuit"), 0.0);
    assert_eq!(client(&plain, "worker"), total as f64);
    assert_eq!(
        w.metric("granary_worker_cache_hit_bytes_total") - hits_before,
        total as f64
    );
    assert_eq!(
        w.metric("granary_worker_ufs_read_bytes_total"),
        total as f64
    );
}

#[test]
fn tiers_keep_every_page_within_their_quotas_and_move_pages_between_them() {
    let root = workdir();
    let src = root.path().join("ufs");
    for i in 0..10u64 {
        random_file(&src.join(format!("f{i}.bin")), 4 * MIB + i * 1000).unwrap();
    }
    let total: u64 = (0..10u64).map(|i| 4 * MIB + i * 1000).sum();
    let master = Master::start(root.path()).unwrap();
    let cache = root.path().join("w1-cache");
    let (ssd, hdd) = (root.path().join("ssd"), root.path().join("hdd"));
    let ssd_tier = format!("ssd:{}:16MiB", ssd.display());
    let hdd_tier = format!("hdd:{}:32MiB", hdd.display());
    // mem: the default place, /dev/shm/granary-<worker id>; LRU, so every read of a lower
    // tier moves the page up.
    let flags = [
        "--tier",
        "mem:8MiB",
        "--tier",
        &hdd_tier,
        "--tier",
        &ssd_tier,
        "--eviction",
        "lru",
    ];
    let start = |name: &str| {
        Worker::start_opts(root.path(), name, &master.addr, "", &cache, &flags).unwrap()
    };
    let mut w = start("w1");
    let id = std::fs::read_to_string(cache.join("worker-id")).unwrap();
    let mem_dir = PathBuf::from(format!("/dev/shm/granary-{}", id.trim()));
    struct RemoveDir(PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _mem_cleanup = RemoveDir(mem_dir.clone());
    assert!(
        mem_dir.join("files").is_dir(),
        "no memory tier in {mem_dir:?}"
    );
    wait_live_workers(&master.addr, 1).unwrap();
    mount_local("/data", &src, &master.addr).unwrap();
    // Over gRPC, so every read is the worker's (short-circuit reads do not promote).
    let fuse = Fuse::start_opts(root.path(), "mnt", &master.addr, &["--no-short-circuit"]).unwrap();
    let mnt = fuse.mountpoint.join("data");
    let expected = tree_sums(&src).unwrap();
    let tier = |w: &Worker, name: &str, t: &str| {
        metric(
            &scrape(&w.metrics).unwrap(),
            &format!("{name}{{tier=\"{t}\"}}"),
        )
        .unwrap_or(0.0)
    };
    // Pages the worker dropped for `reason` (None: never counted).
    let dropped = |w: &Worker, reason: &str| {
        metric(
            &scrape(&w.metrics).unwrap(),
            &format!("granary_worker_dropped_pages_total{{reason=\"{reason}\"}}"),
        )
    };
    let check_quotas = |w: &Worker| {
        for (t, quota) in [("mem", 8 * MIB), ("ssd", 16 * MIB), ("hdd", 32 * MIB)] {
            let used = tier(w, "granary_worker_tier_used_bytes", t);
            assert!(used <= quota as f64, "{t} tier holds {used} > {quota}");
            assert!(used > 0.0, "{t} tier is empty");
            assert_eq!(
                tier(w, "granary_worker_tier_capacity_bytes", t),
                quota as f64
            );
        }
    };

    // 40 MiB through 8 + 16 + 32 MiB of tiers: pages move down, none leaves the cache.
    assert_eq!(tree_sums(&mnt).unwrap(), expected);
    assert_eq!(
        w.metric("granary_worker_ufs_read_bytes_total"),
        total as f64
    );
    // Pages reach the cache after their readers got them: the last may still be on its way.
    poll(
        "every page to be in the cache",
        Duration::from_secs(10),
        || (w.metric("granary_worker_cache_used_bytes") == total as f64).then_some(()),
    )
    .unwrap();
    check_quotas(&w);
    assert!(tier(&w, "granary_worker_tier_demoted_pages_total", "mem") > 0.0);
    assert!(tier(&w, "granary_worker_tier_demoted_pages_total", "ssd") > 0.0);
    assert_eq!(dropped(&w, "capacity"), None, "a page left the cache");

    // The report shows each tier of the worker.
    poll(
        "the report to show the tiers",
        Duration::from_secs(10),
        || {
            let out = granary_ok(&["report", "--json", "--master", &master.addr]).ok()?;
            let v: serde_json::Value = serde_json::from_str(&out).ok()?;
            let tiers = v["workers"][0]["tiers"].as_array()?.clone();
            let names: Vec<&str> = tiers.iter().filter_map(|t| t["tier"].as_str()).collect();
            let used: u64 = tiers.iter().filter_map(|t| t["used_bytes"].as_u64()).sum();
            (names == ["mem", "ssd", "hdd"] && used == total).then_some(())
        },
    )
    .unwrap();

    // Read again: all from the tiers, the ones below moving up.
    drop_page_cache(&mnt).unwrap();
    assert_eq!(tree_sums(&mnt).unwrap(), expected);
    assert_eq!(
        w.metric("granary_worker_ufs_read_bytes_total"),
        total as f64
    );
    assert!(tier(&w, "granary_worker_tier_promoted_pages_total", "hdd") > 0.0);
    check_quotas(&w);
    // Moving pages between tiers while they are read loses none of them.
    assert_eq!(w.metric("granary_worker_cache_used_bytes"), total as f64);
    assert_eq!(
        dropped(&w, "corrupt"),
        None,
        "a page moved between tiers was taken for corrupt"
    );

    // A restarted worker finds its pages in every tier, the memory tier included.
    w.proc.kill9().unwrap();
    let w = start("w1-again");
    assert_eq!(w.metric("granary_worker_cache_used_bytes"), total as f64);
    check_quotas(&w);
    poll(
        "the restarted worker to be live",
        Duration::from_secs(30),
        || {
            let v = wait_live_workers(&master.addr, 1).ok()?;
            v["workers"]
                .as_array()?
                .iter()
                .any(|x| x["address"] == w.addr.as_str())
                .then_some(())
        },
    )
    .unwrap();
    drop_page_cache(&mnt).unwrap();
    assert_eq!(tree_sums(&mnt).unwrap(), expected);
    assert_eq!(w.metric("granary_worker_ufs_read_bytes_total"), 0.0);
}

#[test]
fn a_wholly_cached_file_is_served_in_passthrough_mode() {
    let root = workdir();
    let src = root.path().join("ufs");
    random_file(&src.join("small.bin"), 5 * MIB + 17).unwrap();
    random_file(&src.join("two-blocks.bin"), 64 * MIB + 5).unwrap();
    let c = Cluster::start(root.path(), 1, "1GiB", &src).unwrap();
    let w = &c.workers[0];
    let expected = tree_sums(&src).unwrap();
    let daemon_reads = |f: &Fuse| -> f64 {
        ["worker", "short_circuit", "under_store"]
            .iter()
            .map(|s| {
                f.metric(&format!(
                    "granary_client_read_bytes_total{{source=\"{s}\"}}"
                ))
            })
            .sum()
    };
    let opens = |f: &Fuse| f.metric("granary_client_passthrough_opens_total");
    let sha = |p: &Path| sh(&format!("sha256sum < '{}'", p.display())).unwrap();

    // Cold: nothing cached yet, so through the daemon.
    assert_eq!(tree_sums(&c.data()).unwrap(), expected);
    assert_eq!(opens(&c.fuse), 0.0);
    let before = daemon_reads(&c.fuse);
    assert!(before > 0.0);

    // Cached now: both files open in passthrough — the two-block one too, from its
    // version's cache file that holds both blocks at their offsets — and the daemon sees no
    // read of them.
    drop_page_cache(&c.data()).unwrap(); // opens every file (in passthrough)
    let opened = opens(&c.fuse);
    assert_eq!(opened, 2.0);
    let small = c.data().join("small.bin");
    assert_eq!(sha(&small), sha(&src.join("small.bin")));
    assert_eq!(opens(&c.fuse), opened + 1.0);
    assert_eq!(
        daemon_reads(&c.fuse),
        before,
        "the daemon served a passthrough read"
    );
    assert!(c.fuse.proc.log_text().contains("FUSE passthrough on"));
    let big = c.data().join("two-blocks.bin");
    drop_page_cache(&src).unwrap();
    assert_eq!(sha(&big), sha(&src.join("two-blocks.bin")));
    assert_eq!(opens(&c.fuse), opened + 2.0);
    assert_eq!(
        daemon_reads(&c.fuse),
        before,
        "the daemon served a passthrough read"
    );
    // Each passthrough open counts its file's length as read from the cache (the daemon
    // sees none of the reads), and the worker hears of it with the short-circuit bytes:
    // `report`'s hits include passthrough reads.
    let passthrough = c
        .fuse
        .metric("granary_client_read_bytes_total{source=\"passthrough\"}");
    assert_eq!(
        passthrough,
        (2 * (5 * MIB + 17) + 2 * (64 * MIB + 5)) as f64
    );
    let local = c
        .fuse
        .metric("granary_client_read_bytes_total{source=\"short_circuit\"}");
    poll(
        "the worker to hear of the passthrough reads",
        Duration::from_secs(10),
        || {
            (w.metric("granary_worker_short_circuit_bytes_total") == local + passthrough)
                .then_some(())
        },
    )
    .unwrap();

    // While a passthrough file is open its pages are leased (the two-block file: a lease
    // per block); they are held until its last handle closes, not its first.
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let hold_open = |p: &Path| {
        Kill(
            std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("exec 3< '{}'; exec sleep 30", p.display()))
                .spawn()
                .unwrap(),
        )
    };
    let leases = || w.metric("granary_worker_short_circuit_active_leases");
    let mut first = hold_open(&big);
    poll("the open file's leases", Duration::from_secs(10), || {
        (opens(&c.fuse) == opened + 3.0 && leases() == 2.0).then_some(())
    })
    .unwrap();
    let second = hold_open(&big);
    poll("the second handle", Duration::from_secs(10), || {
        (opens(&c.fuse) == opened + 4.0).then_some(())
    })
    .unwrap();
    let releases = || {
        c.fuse
            .metric("granary_client_fuse_requests_total{op=\"release\"}")
    };
    let released = releases();
    let _ = first.0.kill();
    let _ = first.0.wait();
    poll(
        "the first handle's release",
        Duration::from_secs(10),
        || (releases() > released).then_some(()),
    )
    .unwrap();
    assert_eq!(leases(), 2.0, "the leases went with the first handle");
    // Read by the kernel from the cache file while the second handle is open: whole.
    drop_page_cache(&src).unwrap();
    assert_eq!(sha(&big), sha(&src.join("two-blocks.bin")));
    assert_eq!(daemon_reads(&c.fuse), before);
    drop(second);
    poll(
        "the leases to end with the file",
        Duration::from_secs(10),
        || (leases() == 0.0).then_some(()),
    )
    .unwrap();

    // A mount with passthrough off reads through the daemon.
    let plain =
        Fuse::start_opts(root.path(), "plain", &c.master.addr, &["--no-passthrough"]).unwrap();
    let p = plain.mountpoint.join("data/small.bin");
    assert_eq!(sha(&p), sha(&src.join("small.bin")));
    assert_eq!(opens(&plain), 0.0);
    assert_eq!(daemon_reads(&plain), (5 * MIB + 17) as f64);
}

/// Every metric `granary local` exports (master, worker and mount in one registry) is in
/// docs/metrics.md, and every metric documented there is exported.
fn metrics_are_documented(exported: &str) {
    let base = |n: &str| n.trim_end_matches("_total").to_string();
    let exported: std::collections::BTreeSet<String> = exported
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(base)
        .collect();
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md"),
    )
    .unwrap();
    let mut documented = std::collections::BTreeSet::new();
    for line in doc.lines().filter(|l| l.starts_with("| `granary_")) {
        let first = line.split('|').nth(1).unwrap_or_default();
        for name in first.split('`').skip(1).step_by(2) {
            let name = name.split('{').next().unwrap_or_default();
            documented.insert(base(name));
        }
    }
    let undocumented: Vec<_> = exported.difference(&documented).collect();
    let missing: Vec<_> = documented.difference(&exported).collect();
    assert!(
        undocumented.is_empty() && missing.is_empty(),
        "exported but not in docs/metrics.md: {undocumented:?}; documented but not exported: {missing:?}"
    );
}
