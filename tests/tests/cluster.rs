//! The cluster cache with real processes: three workers and three FUSE mounts (as on three
//! nodes) over one S3 bucket (s3s-fs), read concurrently.

use std::path::Path;
use std::time::Duration;

use granary_tests::stores::TestStore;
use granary_tests::*;

const MIB: u64 = 1024 * 1024;

/// About 1 GiB of mixed sizes: many small files, some medium, a few spanning several blocks.
fn mixed_dataset(dir: &Path) -> u64 {
    let mut total = 0;
    let mut add = |name: String, len: u64| {
        random_file(&dir.join(name), len).unwrap();
        total += len;
    };
    for i in 0..300u64 {
        // 1 KiB to ~1.2 MiB, deterministic spread.
        add(
            format!("small/s{:02}/f{i:03}.bin", i % 16),
            1024 + (i * 4099 % 300) * 4096,
        );
    }
    for i in 0..16u64 {
        add(format!("medium/m{i:02}.bin"), (6 + i) * MIB + i);
    }
    for i in 0..3u64 {
        add(format!("large/l{i}.bin"), 210 * MIB + 7 * i);
    }
    total
}

fn sum(workers: &[Worker], name: &str) -> f64 {
    workers.iter().map(|w| w.metric(name)).sum()
}

#[test]
fn three_nodes_read_one_dataset_and_the_store_serves_each_byte_once() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-cluster-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    let total = mixed_dataset(&src);
    assert!(total > 1000 * MIB, "dataset of {total} bytes");
    let expected = tree_sums(&src).unwrap();
    let s3 = TestStore::s3(root, "dataset", "cluster-access", "cluster-secret-key").unwrap();
    s3.load(&src).unwrap();

    let master = Master::start(root).unwrap();
    let addr = master.addr.clone();
    // Three "nodes": worker i and mount i share node name i, so each mount reads its own
    // worker's block files directly (short-circuit) and the other owners' over gRPC.
    let mut workers: Vec<Worker> = (1..=3)
        .map(|i| {
            let name = format!("w{i}");
            let node = format!("node{i}");
            let cache = root.join(format!("{name}-cache"));
            Worker::start_opts(root, &name, &addr, "1GiB", &cache, &["--node-name", &node]).unwrap()
        })
        .collect();
    wait_live_workers(&addr, 3).unwrap();
    s3.mount(&addr, "/data", &["sync_interval=never"]).unwrap();
    let mounts: Vec<Fuse> = (1..=3)
        .map(|i| {
            let node = format!("node{i}");
            Fuse::start_opts(root, &node, &addr, &["--node-name", &node]).unwrap()
        })
        .collect();

    // Every node reads the whole dataset twice, all three at once; each pass starts without
    // the kernel's copy (as a node whose page cache the last epoch did not fit in).
    let read_all = |passes: usize| {
        std::thread::scope(|s| {
            let readers: Vec<_> = mounts
                .iter()
                .map(|m| {
                    let dir = m.mountpoint.join("data");
                    s.spawn(move || {
                        (0..passes)
                            .map(|_| {
                                drop_page_cache(&dir)?;
                                tree_sums(&dir)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for (node, r) in readers.into_iter().enumerate() {
                for (pass, sums) in r.join().unwrap().into_iter().enumerate() {
                    let sums = sums.unwrap_or_else(|e| panic!("node {node} pass {pass}: {e:#}"));
                    assert!(sums == expected, "node {node} pass {pass}: bytes differ");
                }
            }
        })
    };
    read_all(2);
    // Six reads of the dataset, one under-store read of each byte.
    let from_store = sum(&workers, "granary_worker_ufs_read_bytes_total");
    eprintln!(
        "under-store bytes / dataset bytes = {:.4} ({} GETs)",
        from_store / total as f64,
        sum(&workers, "granary_worker_ufs_requests_total")
    );
    assert_eq!(
        from_store, total as f64,
        "the store served some bytes twice"
    );
    let client = |m: &Fuse, source: &str| {
        m.metric(&format!(
            "granary_client_read_bytes_total{{source=\"{source}\"}}"
        ))
    };
    for (w, m) in workers.iter().zip(&mounts) {
        // The load spreads over the three owners; each node reads its own worker's share
        // from the block files and the rest over gRPC.
        assert!(w.metric("granary_worker_ufs_read_bytes_total") > 0.0);
        assert!(w.metric("granary_worker_cache_hit_bytes_total") > 0.0);
        assert!(w.metric("granary_worker_short_circuit_leases_total") > 0.0);
        assert!(client(m, "short_circuit") > 0.0);
        assert!(client(m, "worker") > 0.0);
        assert_eq!(client(m, "under_store"), 0.0);
    }
    let served = |workers: &[Worker]| {
        sum(workers, "granary_worker_cache_hit_bytes_total")
            + mounts
                .iter()
                .map(|m| client(m, "short_circuit"))
                .sum::<f64>()
    };

    // One worker killed with -9 in the middle of a concurrent pass: no read fails, no byte
    // is wrong (its blocks move to the next owners, which fetch them from the store).
    let served_before = served(&workers);
    std::thread::scope(|s| {
        let pass = s.spawn(|| read_all(1));
        poll(
            "a third of the pass to be read",
            Duration::from_secs(300),
            || (served(&workers) - served_before > total as f64).then_some(()),
        )
        .unwrap();
        workers[1].proc.kill9().unwrap();
        pass.join().unwrap();
    });
    drop(mounts);
}

#[test]
fn a_node_local_mount_copies_other_owners_blocks_to_its_worker_and_then_reads_locally() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-node-local-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    let mut total = 0;
    // Small samples (one page), medium files (several pages), one of three blocks.
    for i in 0..120u64 {
        let len = 20_000 + i * 3_001;
        random_file(&src.join(format!("s/f{i:03}.bin")), len).unwrap();
        total += len;
    }
    for i in 0..4u64 {
        let len = 5 * MIB + i * 12_345;
        random_file(&src.join(format!("m/m{i}.bin")), len).unwrap();
        total += len;
    }
    random_file(&src.join("big.bin"), 130 * MIB).unwrap();
    total += 130 * MIB;
    let expected = tree_sums(&src).unwrap();

    let master = Master::start(root).unwrap();
    let addr = master.addr.clone();
    // Two nodes: worker and mount of node n1 read with --locality node; n2 has a worker
    // that keeps no node copies (--locality cluster) and no mount.
    let w1 = Worker::start_opts(
        root,
        "w1",
        &addr,
        "1GiB",
        &root.join("w1-cache"),
        &["--node-name", "n1"],
    )
    .unwrap();
    let w2 = Worker::start_opts(
        root,
        "w2",
        &addr,
        "1GiB",
        &root.join("w2-cache"),
        &["--node-name", "n2", "--locality", "cluster"],
    )
    .unwrap();
    wait_live_workers(&addr, 2).unwrap();
    mount_local("/data", &src, &addr).unwrap();
    let m1 = Fuse::start_opts(
        root,
        "n1",
        &addr,
        &["--node-name", "n1", "--locality", "node"],
    )
    .unwrap();
    let dir = m1.mountpoint.join("data");
    let from_store = || {
        w1.metric("granary_worker_ufs_read_bytes_total")
            + w2.metric("granary_worker_ufs_read_bytes_total")
    };
    let peer_bytes = || m1.metric("granary_client_peer_read_bytes_total");

    // First pass: w2's blocks come over gRPC from w2 (which fetches them from the store),
    // and w1 copies each of them from w2 in the background.
    assert!(
        tree_sums(&dir).unwrap() == expected,
        "first pass: bytes differ"
    );
    let from_w2 = peer_bytes();
    assert!(from_w2 > 0.0, "no block was owned by w2");
    // Every copy the first pass asked for is done (counted from the read that asked).
    let copies = poll("node copies to finish", Duration::from_secs(120), || {
        let c = m1.metric("granary_client_node_copies_total");
        (c > 0.0 && m1.metric("granary_client_node_copies_pending") == 0.0).then_some(c)
    })
    .unwrap();
    assert_eq!(
        m1.metric("granary_client_node_copy_failures_total"),
        0.0,
        "node copies failed; {}",
        log_tail(&root.join("fuse-n1.log"), 20)
    );
    // What w1 cached as node copies is exactly what the mount had it copy, all from w2.
    let copied = m1.metric("granary_client_node_copy_bytes_total");
    assert_eq!(w1.metric("granary_worker_node_copy_bytes_total"), copied);
    assert_eq!(w1.metric("granary_worker_peer_fill_bytes_total"), copied);
    assert!(copied > 0.0, "{copies} copies of nothing");
    // Not one byte more from the store than the dataset: copies come from peers only.
    assert_eq!(from_store(), total as f64, "a node copy read the store");
    // `granary report` shows them per node (from the workers' heartbeats).
    poll(
        "the report to show n1's node copies",
        Duration::from_secs(10),
        || {
            let out = granary_ok(&["report", "--json", "--master", &addr]).ok()?;
            let v: serde_json::Value = serde_json::from_str(&out).ok()?;
            let n1 = v["workers"]
                .as_array()?
                .iter()
                .find(|w| w["host"] == "n1")?
                .clone();
            (n1["node_copy_bytes"].as_f64() == Some(copied)
                && n1["peer_fill_bytes"].as_f64() == Some(copied))
            .then_some(())
        },
    )
    .unwrap();
    let text = granary_ok(&["report", "--master", &addr]).unwrap();
    assert!(
        text.contains("node n1:") && text.contains("node n2:"),
        "{text}"
    );

    // Second pass: every byte from n1's own worker; nothing over the network, nothing
    // from the store.
    drop_page_cache(&dir).unwrap();
    assert!(
        tree_sums(&dir).unwrap() == expected,
        "second pass: bytes differ"
    );
    assert_eq!(peer_bytes(), from_w2, "the second pass read from w2");
    assert_eq!(from_store(), total as f64);

    // w2 keeps no node copies: a mount of n2 asking for them reads correctly from the
    // owners, and w2 caches nothing of w1's.
    let m2 = Fuse::start_opts(
        root,
        "n2",
        &addr,
        &["--node-name", "n2", "--locality", "node"],
    )
    .unwrap();
    assert!(
        tree_sums(&m2.mountpoint.join("data")).unwrap() == expected,
        "n2: bytes differ"
    );
    poll("n2's refused copy", Duration::from_secs(30), || {
        (m2.metric("granary_client_node_copy_failures_total") >= 1.0).then_some(())
    })
    .unwrap();
    assert_eq!(m2.metric("granary_client_node_copies_total"), 0.0);
    assert_eq!(w2.metric("granary_worker_node_copy_bytes_total"), 0.0);
    assert_eq!(from_store(), total as f64);
    drop(m2);
    drop(m1);
}

/// A master, `n` workers serving block data planes (`--data-listen`) and a mount on a
/// node of its own (every read goes to a worker), over `src`; `plain`: the cluster runs
/// without TLS, else with the suite's security.
fn data_plane_cluster(
    root: &Path,
    src: &Path,
    n: usize,
    plain: bool,
) -> (Master, Vec<Worker>, Fuse) {
    let allowed = src.parent().unwrap_or(src).to_string_lossy().to_string();
    let insecure: &[&str] = if plain { &["--insecure"] } else { &[] };
    let master = if plain {
        Master::start_with(root, &["--insecure", "--allow-local-root", &allowed]).unwrap()
    } else {
        Master::start(root).unwrap()
    };
    let addr = master.addr.clone();
    let workers: Vec<Worker> = (1..=n)
        .map(|i| {
            let name = format!("w{i}");
            let node = format!("node{i}");
            let mut extra = vec!["--node-name", node.as_str(), "--data-listen", "127.0.0.1:0"];
            extra.extend_from_slice(insecure);
            Worker::start_opts(root, &name, &addr, "1GiB", &root.join(&name), &extra).unwrap()
        })
        .collect();
    poll(
        &format!("{n} live workers"),
        Duration::from_secs(30),
        || {
            let mut args = vec!["report", "--json", "--master", &addr];
            args.extend_from_slice(insecure);
            let v: serde_json::Value = serde_json::from_slice(&granary(&args).stdout).ok()?;
            let w = v["workers"].as_array()?;
            (w.iter().filter(|w| w["state"] == "live").count() == n).then_some(())
        },
    )
    .unwrap();
    let src_s = src.to_string_lossy();
    let mut args = vec!["mount", "add", "/data", &src_s, "--master", &addr];
    args.extend_from_slice(insecure);
    granary_ok(&args).unwrap();
    let mut extra = vec!["--node-name", "reader"];
    extra.extend_from_slice(insecure);
    let m = Fuse::start_opts(root, "m", &addr, &extra).unwrap();
    (master, workers, m)
}

/// Peer reads over the workers' block data planes (`--data-listen`), with the suite's
/// security (mutual TLS unless GRANARY_TEST_INSECURE=1): every byte exact (each frame's
/// CRC32C checked by the mount), the warm pass carried by the data planes with no
/// failure, a worker killed in the middle of reads costs no failed read (the mount moves to
/// the next worker, which fetches from the store), and a caller without a certificate of
/// the cluster gets nothing from a TLS data plane. Then the same warm pass on a cluster
/// without TLS, where whole pages go by `sendfile`.
#[test]
fn peer_reads_over_the_data_plane_are_exact_and_survive_a_worker_killed_mid_read() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-data-plane-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    let mut total = 0;
    for i in 0..24u64 {
        let len = 300_000 + i * 77_777;
        random_file(&src.join(format!("f{i:02}.bin")), len).unwrap();
        total += len;
    }
    random_file(&src.join("big.bin"), 150 * MIB + 3).unwrap();
    total += 150 * MIB + 3;
    let expected = tree_sums(&src).unwrap();
    let sent = |ws: &[Worker]| sum(ws, "granary_worker_data_plane_bytes_total");

    let (master, mut workers, m) = data_plane_cluster(&root.join("tls"), &src, 2, false);
    let dir = m.mountpoint.join("data");
    assert_eq!(tree_sums(&dir).unwrap(), expected, "cold pass");
    let before = sent(&workers);
    drop_page_cache(&dir).unwrap();
    assert_eq!(tree_sums(&dir).unwrap(), expected, "warm pass");
    assert!(
        sent(&workers) - before >= total as f64,
        "the warm pass sent {} bytes over the data planes of {total}",
        sent(&workers) - before
    );
    assert_eq!(m.metric("granary_client_data_plane_failures_total"), 0.0);
    // Whole 64 MiB blocks per request through the client library (answers of many
    // frames), all over the data planes and well within a read's deadline.
    let before = sent(&workers);
    let t = std::time::Instant::now();
    granary_ok(&[
        "bench",
        "read",
        "/data/big.bin",
        "--passes",
        "1",
        "--master",
        &master.addr,
    ])
    .unwrap();
    assert!(
        sent(&workers) - before >= (150 * MIB) as f64,
        "a block read went elsewhere than the data planes"
    );
    assert!(t.elapsed() < Duration::from_secs(50), "{:?}", t.elapsed());

    if !insecure_suite() {
        // Plain TCP, no certificate, to a TLS data plane: no handshake, no bytes.
        let out = granary(&["report", "--json", "--master", &master.addr]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let data = v["workers"][0]["data_address"]
            .as_str()
            .unwrap()
            .to_string();
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&data).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let req = [0u8, 0, 0, 2, 0x08, 0x01];
        let _ = s.write_all(&req);
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        // At most a TLS alert record (type 21), never a frame.
        assert!(
            got.is_empty() || (got[0] == 0x15 && got.len() < 64),
            "a caller without a certificate got an answer: {got:?}"
        );
    }

    // A worker killed while big.bin is being read: the read still ends with the right bytes.
    drop_page_cache(&dir).unwrap();
    let big = dir.join("big.bin");
    let reader = std::thread::spawn(move || sh(&format!("sha256sum < '{}'", big.display())));
    let read = || m.metric("granary_client_read_bytes_total{source=\"worker\"}");
    let start = read();
    poll(
        "the reader to be under way",
        Duration::from_secs(60),
        || (read() - start > 20.0 * MIB as f64).then_some(()),
    )
    .unwrap();
    workers[1].proc.kill9().unwrap();
    let got = reader.join().unwrap().unwrap();
    let want = sh(&format!("sha256sum < '{}'", src.join("big.bin").display())).unwrap();
    assert_eq!(got, want, "big.bin read across the worker's death");
    drop((m, workers, master));

    // Without TLS: whole cached pages by sendfile.
    let (_master, workers, m) = data_plane_cluster(&root.join("plain"), &src, 1, true);
    let dir = m.mountpoint.join("data");
    assert_eq!(tree_sums(&dir).unwrap(), expected, "cold pass, plain");
    let before = sent(&workers);
    drop_page_cache(&dir).unwrap();
    assert_eq!(tree_sums(&dir).unwrap(), expected, "warm pass, plain");
    assert!(sent(&workers) - before >= total as f64);
    assert_eq!(m.metric("granary_client_data_plane_failures_total"), 0.0);
}
