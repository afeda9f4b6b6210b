//! Transport security: every port refuses plaintext, foreign and expired certificates;
//! roles decide who may administer; clients verify the servers they talk to.
//!
//! The harness runs every process with TLS (a test CA per test process); here the test
//! also talks gRPC itself with identities of its choice.

use std::path::Path;
use std::time::Duration;

use granary_common::tls::{self, LeafSpec, Pems, Role, TlsFiles};
use granary_proto as pb;
use granary_proto::master_service_client::MasterServiceClient;
use granary_proto::worker_service_client::WorkerServiceClient;
use granary_tests::*;

/// `GetClusterInfo` on a master.
fn master_call(
    addr: &str,
    creds: Option<&Creds>,
) -> Result<pb::GetClusterInfoResponse, tonic::Status> {
    rt().block_on(async {
        let mut c = MasterServiceClient::new(channel(addr, creds));
        c.get_cluster_info(pb::GetClusterInfoRequest { allow_stale: false })
            .await
            .map(|r| r.into_inner())
    })
}

/// `GetCacheInfo` on a worker.
fn worker_call(
    addr: &str,
    creds: Option<&Creds>,
) -> Result<pb::GetCacheInfoResponse, tonic::Status> {
    rt().block_on(async {
        let mut c = WorkerServiceClient::new(channel(addr, creds));
        c.get_cache_info(pb::GetCacheInfoRequest {})
            .await
            .map(|r| r.into_inner())
    })
}

/// The test CA's certificate and key.
fn test_ca() -> Pems {
    let ca_dir = TestTls::get().ca();
    Pems {
        cert: std::fs::read_to_string(ca_dir.join("ca.crt")).unwrap(),
        key: std::fs::read_to_string(ca_dir.join("ca.key")).unwrap(),
    }
}

/// A certificate of the test CA whose validity ended yesterday.
fn expired_creds() -> Creds {
    let ca = test_ca();
    let mut spec = LeafSpec::new("expired-admin", &[Role::Admin], 1);
    spec.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(30);
    spec.not_after = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    let own = tls::issue(&ca, &spec).unwrap();
    Creds {
        ca: ca.cert,
        cert: own.cert,
        key: own.key,
    }
}

/// A CA of its own, with an admin and a master (id 1) identity: `(admin dir, master dir)`.
fn foreign_ca(root: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let ca = root.join("other-ca").to_string_lossy().to_string();
    granary_ok(&["cert", "init", "--ca-dir", &ca]).unwrap();
    let mut dirs = Vec::new();
    for (role, args) in [
        ("admin", &["--role", "admin"][..]),
        ("master", &["--role", "master", "--master-id", "1"][..]),
    ] {
        let out = root.join(format!("other-{role}"));
        let name = format!("other-{role}");
        dirs.push(issue_identity(Path::new(&ca), &name, &out, args).unwrap());
    }
    (dirs[0].clone(), dirs[1].clone())
}

fn expect_refused<T: std::fmt::Debug>(what: &str, r: Result<T, tonic::Status>) {
    match r {
        Ok(v) => panic!("{what} was served: {v:?}"),
        Err(s) => assert!(
            matches!(
                s.code(),
                tonic::Code::Unavailable
                    | tonic::Code::Unknown
                    | tonic::Code::Internal
                    | tonic::Code::Cancelled
                    | tonic::Code::Unauthenticated
            ),
            "{what}: unexpected status {s:?}"
        ),
    }
}

/// Writes a TLS folder (`ca.crt`, `tls.crt`, `tls.key`), each file renamed into place as a
/// Kubernetes Secret's volume (or `granary cert issue --force`) replaces it.
fn write_tls_dir(dir: &Path, ca: &str, own: &Pems) {
    std::fs::create_dir_all(dir).unwrap();
    TlsFiles::in_dir(dir).write(ca, own).unwrap();
}

/// A certificate renewed in a server's TLS folder is used without a restart, by both
/// sides of its connections: a worker whose first certificate expires seconds after it
/// starts stays reachable over new connections once a renewed one is written over it,
/// and reaches a restarted master again with it (a new connection from the worker); a
/// replacement naming another principal is refused and the renewed material kept.
#[test]
fn a_renewed_certificate_is_used_without_a_restart() {
    if insecure_suite() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("tls-reload")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let ca = test_ca();
    let admin = creds_in(&TestTls::get().identity("admin"));
    let node_dir = root.join("node-tls");
    let mut spec = LeafSpec::new("reload-node", &[Role::Node], 1);
    let expires = time::OffsetDateTime::now_utc() + time::Duration::seconds(25);
    spec.not_after = expires;
    write_tls_dir(&node_dir, &ca.cert, &tls::issue(&ca, &spec).unwrap());

    let data_dir = root.join("master-data");
    let port = free_port();
    let master = Master::start_on(root, &data_dir, port).unwrap();
    let nd = node_dir.to_string_lossy().to_string();
    let cache = root.join("w1-cache");
    let mut worker = Worker::start_opts(
        root,
        "w1",
        &master.addr,
        "64MiB",
        &cache,
        &["--tls-dir", &nd, "--tls-reload-every", "200ms"],
    )
    .unwrap();
    wait_live_workers(&master.addr, 1).unwrap();
    worker_call(&worker.addr, Some(&admin)).expect("the worker answers with its first certificate");

    // Renewed before it expires: a new key, valid for a day.
    let mut renewed = LeafSpec::new("reload-node", &[Role::Node], 1);
    renewed.hosts = spec.hosts.clone();
    write_tls_dir(&node_dir, &ca.cert, &tls::issue(&ca, &renewed).unwrap());
    worker
        .proc
        .wait_for_line("TLS material reloaded", Duration::from_secs(10))
        .unwrap();

    // Past the first certificate's end, new connections still verify: the worker serves
    // with the renewed one.
    poll(
        "the first certificate to expire",
        Duration::from_secs(30),
        || (time::OffsetDateTime::now_utc() > expires + time::Duration::seconds(1)).then_some(()),
    )
    .unwrap();
    worker_call(&worker.addr, Some(&admin))
        .expect("a new connection to the worker after its first certificate expired");

    // The worker's own new connections present the renewed certificate: a restarted master
    // hears its heartbeats again.
    drop(master);
    let master = Master::start_on(root, &data_dir, port).unwrap();
    wait_live_workers(&master.addr, 1)
        .expect("the worker reached the restarted master with its renewed certificate");

    // Another principal written over the files: refused, the renewed material kept.
    let intruder = tls::issue(
        &ca,
        &LeafSpec::new("intruder", &[Role::Node, Role::Admin], 1),
    )
    .unwrap();
    write_tls_dir(&node_dir, &ca.cert, &intruder);
    worker
        .proc
        .wait_for_line(
            "cannot be used; keeping the current material",
            Duration::from_secs(10),
        )
        .unwrap();
    worker_call(&worker.addr, Some(&admin))
        .expect("the worker still answers after a refused replacement");
    assert!(
        worker.proc.log_text().contains("now names"),
        "the refusal names the principals:\n{}",
        worker.proc.log_text()
    );
}

/// A CA dropped from a server's `ca.crt` ends the connections it signed that are already
/// open, within one reload and without a restart: a client of the dropped CA whose
/// connection to a worker was open before gets no more answers over it (and cannot make a
/// new one), while clients of the CA kept are still served. Before, an open connection kept
/// the trust it was verified with for as long as it stayed open.
#[test]
fn a_dropped_ca_ends_the_open_connections_it_signed() {
    if insecure_suite() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("tls-drop-ca")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let ca = test_ca();
    let other_ca = tls::new_ca("the CA to drop", 1).unwrap();
    let node_dir = root.join("node-tls");
    let node = tls::issue(&ca, &LeafSpec::new("drop-ca-node", &[Role::Node], 1)).unwrap();
    write_tls_dir(&node_dir, &format!("{}{}", ca.cert, other_ca.cert), &node);

    let master = Master::start(root).unwrap();
    let nd = node_dir.to_string_lossy().to_string();
    let mut worker = Worker::start_opts(
        root,
        "w1",
        &master.addr,
        "64MiB",
        &root.join("w1-cache"),
        &["--tls-dir", &nd, "--tls-reload-every", "200ms"],
    )
    .unwrap();
    wait_live_workers(&master.addr, 1).unwrap();

    // An admin of the other CA, verifying the worker by the cluster CA.
    let outsider = tls::issue(&other_ca, &LeafSpec::new("outsider", &[Role::Admin], 1)).unwrap();
    let outsider = Creds {
        ca: ca.cert.clone(),
        cert: outsider.cert,
        key: outsider.key,
    };
    let rt = rt();
    let open = rt.block_on(async { channel(&worker.addr, Some(&outsider)) });
    let call = |ch: &tonic::transport::Channel| {
        rt.block_on(async {
            WorkerServiceClient::new(ch.clone())
                .get_cache_info(pb::GetCacheInfoRequest {})
                .await
        })
    };
    call(&open).expect("the worker trusts both CAs at first");

    write_tls_dir(&node_dir, &ca.cert, &node);
    worker
        .proc
        .wait_for_line(
            "ended open connections whose certificates the new CA file does not verify",
            Duration::from_secs(10),
        )
        .unwrap();
    // Calls find the connection ended (a transport error), then a new connection whose
    // handshake the worker refuses; none is answered.
    poll("a refused handshake", Duration::from_secs(10), || {
        let e = call(&open).expect_err("the open connection of the dropped CA was ended");
        format!("{e:?}").contains("UnknownCA").then_some(())
    })
    .unwrap();
    let admin = creds_in(&TestTls::get().identity("admin"));
    worker_call(&worker.addr, Some(&admin)).expect("a client of the CA kept is served");
    wait_live_workers(&master.addr, 1).expect("the worker still reaches its master");
}

/// Connections that send nothing hold a server's TLS handshakes only for a while and only
/// so many from one address: past 256 at once from one address a new connection is closed
/// at once (its client fails fast), and each silent one is closed after 5 s, when new
/// connections are served again. Before, any number of silent connections each held a
/// task and buffers for as long as they stayed open.
#[test]
fn silent_connections_hold_a_servers_handshakes_briefly_and_boundedly() {
    if insecure_suite() {
        return;
    }
    use std::io::Read;
    let tmp = tempfile::Builder::new().prefix("silent").tempdir().unwrap();
    let master = Master::start(tmp.path()).unwrap();
    let addr: std::net::SocketAddr = master.addr.parse().unwrap();
    let silent: Vec<std::net::TcpStream> = (0..256)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    // Closed by the server without an answer (end of stream, or a reset).
    let closed = |mut s: &std::net::TcpStream, within: Duration| {
        s.set_read_timeout(Some(within)).unwrap();
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(0) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
            Ok(_) => false,
        }
    };
    // The 257th from this address is closed at once, while the others wait.
    poll("the 256 to be accepted", Duration::from_secs(10), || {
        let extra = std::net::TcpStream::connect(addr).unwrap();
        closed(&extra, Duration::from_millis(500)).then_some(())
    })
    .unwrap();
    assert!(
        master
            .proc
            .log_text()
            .contains("too many TLS handshakes at once from one address"),
        "{}",
        master.proc.log_text()
    );
    // Each silent one is closed after its handshake's 5 s.
    let started = std::time::Instant::now();
    for s in &silent {
        assert!(
            closed(s, Duration::from_secs(15)),
            "a silent connection stayed open"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(15));
    // And a client is served again.
    wait_live_workers(&master.addr, 0).expect("the master answers once the slots are free");
}

/// A master, a live worker and a source folder of random files (relative path → size),
/// mounted at `at` unless `None`; the test folder goes when it is dropped (last).
struct Node {
    master: Master,
    worker: Worker,
    src: std::path::PathBuf,
    tmp: tempfile::TempDir,
}

fn node(prefix: &str, files: &[(&str, u64)], at: Option<&str>) -> Node {
    let tmp = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let root = tmp.path();
    let src = root.join("src");
    for (f, size) in files {
        random_file(&src.join(f), *size).unwrap();
    }
    let master = Master::start(root).unwrap();
    let worker = Worker::start(root, "w1", &master.addr, "64MiB").unwrap();
    wait_live_workers(&master.addr, 1).unwrap();
    if let Some(at) = at {
        mount_local(at, &src, &master.addr).unwrap();
    }
    Node {
        master,
        worker,
        src,
        tmp,
    }
}

#[test]
fn every_port_refuses_plaintext_foreign_and_expired_clients() {
    let n = node("granary-tls-", &[("a.bin", 300_000)], Some("/d"));
    let (root, src, master, w) = (n.tmp.path(), &n.src, &n.master, &n.worker);
    let want = sh(&format!("sha256sum < '{}'", src.join("a.bin").display())).unwrap();
    let got = sh(&format!(
        "GRANARY_TLS_DIR='{}' '{}' fs cat /d/a.bin --master {} | sha256sum",
        TestTls::get().identity("admin").display(),
        granary_bin().display(),
        master.addr
    ))
    .unwrap();
    assert_eq!(got, want, "a read over TLS returned other bytes");

    let admin = creds_in(&TestTls::get().identity("admin"));
    let (other_admin, other_node) = foreign_ca(root);
    let foreign = creds_in(&other_admin);
    let expired = expired_creds();
    for _ in 0..2 {
        expect_refused(
            "plaintext call to the master",
            master_call(&master.addr, None),
        );
        expect_refused("plaintext call to the worker", worker_call(&w.addr, None));
        expect_refused(
            "master call with another CA's certificate",
            master_call(&master.addr, Some(&foreign)),
        );
        expect_refused(
            "worker call with another CA's certificate",
            worker_call(&w.addr, Some(&foreign)),
        );
        expect_refused(
            "master call with an expired certificate",
            master_call(&master.addr, Some(&expired)),
        );
        expect_refused(
            "worker call with an expired certificate",
            worker_call(&w.addr, Some(&expired)),
        );
    }
    // The servers carry on for valid clients.
    let info = master_call(&master.addr, Some(&admin)).unwrap();
    assert_eq!(info.workers.len(), 1);
    assert!(worker_call(&w.addr, Some(&admin)).unwrap().capacity_bytes > 0);

    // The CLI says so in one sentence and exits 1.
    let addr = master.addr.as_str();
    let out = granary(&["report", "--master", addr, "--insecure"]);
    assert_one_sentence_error(&out, "plaintext report");
    let other = other_admin.to_string_lossy().to_string();
    let out = granary(&["report", "--master", addr, "--tls-dir", &other]);
    assert_one_sentence_error(&out, "report with another CA's certificate");
    let out = granary(&["report", "--master", addr]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Clients verify servers too: a master whose certificate comes from another CA is not
    // trusted by the cluster's admin.
    let rogue_dir = root.join("rogue");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let data = rogue_dir.to_string_lossy().to_string();
    let node = other_node.to_string_lossy().to_string();
    let mut rogue = Proc::spawn(
        "rogue-master",
        root,
        &[
            "master",
            "--data-dir",
            &data,
            "--listen",
            &listen,
            "--tls-dir",
            &node,
        ],
    )
    .unwrap();
    rogue
        .wait_for_line("granary master listening on", Duration::from_secs(60))
        .unwrap();
    let out = granary(&["report", "--master", &listen]);
    assert_one_sentence_error(&out, "report against a master of another CA");
    expect_refused(
        "a call to a master of another CA",
        master_call(&listen, Some(&admin)),
    );

    // A master starts only with a master certificate, and never with an expired one.
    let admin_dir = TestTls::get()
        .identity("admin")
        .to_string_lossy()
        .to_string();
    let out = granary(&[
        "master",
        "--data-dir",
        &data,
        "--listen",
        "127.0.0.1:0",
        "--tls-dir",
        &admin_dir,
    ]);
    assert_one_sentence_error(&out, "a master with an admin certificate");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a master"));
    let exp_dir = root.join("expired");
    std::fs::create_dir_all(&exp_dir).unwrap();
    std::fs::write(exp_dir.join("ca.crt"), &expired.ca).unwrap();
    std::fs::write(exp_dir.join("tls.crt"), &expired.cert).unwrap();
    std::fs::write(exp_dir.join("tls.key"), &expired.key).unwrap();
    let exp = exp_dir.to_string_lossy().to_string();
    let out = granary(&["report", "--master", addr, "--tls-dir", &exp]);
    assert_one_sentence_error(&out, "report with an expired certificate");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not valid now"));
    // Without any TLS material nothing runs, and --insecure with TLS flags is refused.
    let out = std::process::Command::new(granary_bin())
        .args(["report", "--master", addr])
        .env("GRANARY_LOG", "warn")
        .output()
        .unwrap();
    assert_one_sentence_error(&out, "report without TLS material");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--insecure"));
    let out = granary(&[
        "report",
        "--master",
        addr,
        "--insecure",
        "--tls-dir",
        &admin_dir,
    ]);
    assert_one_sentence_error(&out, "--insecure with --tls-dir");
}

#[test]
fn roles_decide_who_may_administer() {
    let n = node("granary-roles-", &[("a.bin", 100_000)], None);
    let (src, master, w) = (&n.src, &n.master, &n.worker);
    let user_dir = TestTls::get().issue("alice", &["--role", "user"]).unwrap();
    let user = user_dir.to_string_lossy().to_string();
    let s = src.to_string_lossy().to_string();
    let addr = master.addr.as_str();

    // A user may not add a mount; nothing changes.
    let out = granary(&[
        "mount",
        "add",
        "/d",
        &s,
        "--master",
        addr,
        "--tls-dir",
        &user,
    ]);
    assert_one_sentence_error(&out, "mount add by a user");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs the admin role") && err.contains("alice"),
        "{err}"
    );
    let mounts = granary_ok(&["mount", "list", "--json", "--master", addr]).unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&mounts)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        0
    );

    // An admin may; the user can then read, but not start a load, pin, free or decommission.
    mount_local("/d", src, addr).unwrap();
    let listing = granary_ok(&["fs", "ls", "/d", "--master", addr, "--tls-dir", &user]).unwrap();
    assert!(listing.contains("a.bin"), "{listing}");
    for (what, args) in [
        ("load", vec!["load", "/d"]),
        ("pin", vec!["pin", "/d", "--detach"]),
        ("free", vec!["free", "-R", "/d"]),
        ("ttl", vec!["ttl", "set", "/d", "1h", "--action", "free"]),
        ("decommission", vec!["worker", "decommission", "1"]),
        ("mount remove", vec!["mount", "remove", "/d"]),
    ] {
        let mut a = args.clone();
        a.extend(["--master", addr, "--tls-dir", &user]);
        let out = granary(&a);
        assert_one_sentence_error(&out, what);
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("needs the admin role"),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let jobs = granary_ok(&["job", "list", "--json", "--master", addr]).unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&jobs)
            .unwrap()
            .as_array()
            .map(Vec::len),
        Some(0),
        "{jobs}"
    );

    // Direct calls: exact codes. A user and an admin cannot do a node's work, and a
    // node's work (tasks for workers) is refused to anyone else.
    let user_creds = creds_in(&user_dir);
    let admin_creds = creds_in(&TestTls::get().identity("admin"));
    rt().block_on(async {
        let mut m = MasterServiceClient::new(channel(addr, Some(&user_creds)));
        let e = m
            .add_mount(pb::AddMountRequest {
                path: "/x".into(),
                uri: format!("file://{s}"),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        let e = m
            .get_mount_access(pb::GetMountAccessRequest { mount_id: 1 })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        let mut m = MasterServiceClient::new(channel(addr, Some(&admin_creds)));
        let e = m
            .register_worker(pb::RegisterWorkerRequest {
                worker_id: 99,
                address: "127.0.0.1:1".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        let mut wc = WorkerServiceClient::new(channel(&w.addr, Some(&admin_creds)));
        let e = wc
            .load_blocks(pb::LoadBlocksRequest::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    });
    let info = master_call(addr, Some(&admin_creds)).unwrap();
    assert_eq!(
        info.workers.len(),
        1,
        "a refused registration changed the workers"
    );

    // A node reporting the largest counters there are (every byte count u64::MAX): the
    // report still answers, text and JSON (its sums saturate, never overflow).
    let node_creds = creds_in(&TestTls::get().identity("node"));
    rt().block_on(async {
        let mut m = MasterServiceClient::new(channel(addr, Some(&node_creds)));
        let max = u64::MAX;
        m.register_worker(pb::RegisterWorkerRequest {
            worker_id: 77,
            address: "127.0.0.1:1".into(),
            host: "hostile".into(),
            stats: Some(pb::WorkerStats {
                capacity_bytes: max,
                used_bytes: max,
                cache_hit_bytes: max,
                cache_miss_bytes: max,
                ufs_read_bytes: max,
                short_circuit_bytes: max,
                peer_served_bytes: max,
                peer_fill_bytes: max,
                node_copy_bytes: max,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    });
    for json in [false, true] {
        let mut args = vec!["report", "--master", addr];
        if json {
            args.push("--json");
        }
        let out = granary(&args);
        assert!(
            out.status.success(),
            "report with huge counters: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_subtree_certificate_reaches_only_its_subtree() {
    let files = [("team-a/x.bin", 2_100_000), ("team-b/y.bin", 100_000)];
    let n = node("granary-subtree-", &files, None);
    let (root, src, master) = (n.tmp.path(), &n.src, &n.master);
    std::fs::write(src.join("top.txt"), "top\n").unwrap();
    mount_local("/data", src, &master.addr).unwrap();
    let team_a = TestTls::get()
        .issue("team-a", &["--role", "user", "--subtree", "/data/team-a"])
        .unwrap();
    let ta = team_a.to_string_lossy().to_string();
    let fuse = Fuse::start_opts(root, "mnt", &master.addr, &["--tls-dir", &ta]).unwrap();
    let m = fuse.mountpoint.join("data");

    // Inside: reads, listings and writes work, bytes exact.
    let sha = |p: &Path| sh(&format!("sha256sum < '{}'", p.display())).unwrap();
    let want = sha(&src.join("team-a/x.bin"));
    assert_eq!(sha(&m.join("team-a/x.bin")), want);
    sh(&format!("mkdir '{}'", m.join("team-a/new").display())).unwrap();
    // Writes and warm reads carry the user's grants: a copy reaches the store byte for
    // byte, and a second read of x.bin comes from this host's worker's block file.
    sh(&format!(
        "cp '{}' '{}'",
        m.join("team-a/x.bin").display(),
        m.join("team-a/new/copy.bin").display()
    ))
    .unwrap();
    assert_eq!(sha(&src.join("team-a/new/copy.bin")), want);
    drop_page_cache(&m).unwrap();
    assert_eq!(sha(&m.join("team-a/x.bin")), want);
    let short_circuit = "granary_client_read_bytes_total{source=\"short_circuit\"}";
    let passthrough = "granary_client_passthrough_opens_total";
    assert!(
        fuse.metric(short_circuit) + fuse.metric(passthrough) > 0.0,
        "no read came from the block file: {} {}",
        fuse.metric(short_circuit),
        fuse.metric(passthrough),
    );
    // Above: only the way down is listed.
    assert_eq!(
        sh(&format!("ls '{}'", m.display())).unwrap().trim(),
        "team-a"
    );
    // Beside: refused with EACCES, nothing changes.
    for cmd in [
        format!("cat '{}'", m.join("team-b/y.bin").display()),
        format!("ls '{}'", m.join("team-b").display()),
        format!("cat '{}'", m.join("top.txt").display()),
        format!("mkdir '{}'", m.join("team-b/new").display()),
    ] {
        let out = std::process::Command::new("bash")
            .args(["-c", &cmd])
            .output()
            .unwrap();
        assert!(!out.status.success(), "`{cmd}` succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("Permission denied"), "`{cmd}`: {err}");
    }
    assert!(!src.join("team-b/new").exists());

    // The same through the CLI and a direct call: exact code and message.
    let out = granary(&[
        "fs",
        "cat",
        "/data/team-b/y.bin",
        "--master",
        &master.addr,
        "--tls-dir",
        &ta,
    ]);
    assert_one_sentence_error(&out, "cat beside the subtree");
    assert!(String::from_utf8_lossy(&out.stderr).contains("outside the subtree /data/team-a"));
    let creds = creds_in(&team_a);
    rt().block_on(async {
        let mut c = MasterServiceClient::new(channel(&master.addr, Some(&creds)));
        let target = |p: &str| {
            Some(pb::PathOrId {
                target: Some(pb::path_or_id::Target::Path(p.into())),
            })
        };
        let e = c
            .get_status(pb::GetStatusRequest {
                target: target("/data/team-b/y.bin"),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        let e = c
            .rename(pb::RenameRequest {
                src: "/data/team-a/x.bin".into(),
                dst: "/data/team-b/x.bin".into(),
                request_id: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        let e = c
            .delete(pb::DeleteRequest {
                path: "/data/team-a/../team-b/y.bin".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        let mounts = c
            .list_mounts(pb::ListMountsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(mounts.mounts.len(), 1);
        // Where blocks are cached: asked of a file inside, answered; of a file beside (its
        // inode learned by an admin), refused as an inode that does not exist.
        let admin = creds_in(&TestTls::get().identity("admin"));
        let mut a = MasterServiceClient::new(channel(&master.addr, Some(&admin)));
        let mut block0 = Vec::new();
        for (client, path) in [
            (&mut c, "/data/team-a/x.bin"),
            (&mut a, "/data/team-b/y.bin"),
        ] {
            let s = client
                .get_status(pb::GetStatusRequest {
                    target: target(path),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .status
                .unwrap();
            block0.push(pb::BlockId {
                inode: s.inode,
                version: s.version,
                index: 0,
            });
        }
        let locations = |blocks: Vec<pb::BlockId>| pb::GetBlockLocationsRequest { blocks };
        let inside = c
            .get_block_locations(locations(vec![block0[0]]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(inside.locations.len(), 1, "{inside:?}");
        for blocks in [vec![block0[1]], vec![block0[0], block0[1]]] {
            let e = c.get_block_locations(locations(blocks)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
            assert!(
                e.message().contains(&format!("inode {}", block0[1].inode)),
                "{e:?}"
            );
        }
        // Paged listings above the subtree, a page of one entry at a time: only the way
        // down, and no page token names a sibling (`team-b`, `top.txt`).
        for (folder, way_down) in [("/", "data"), ("/data", "team-a")] {
            let (mut shown, mut token) = (Vec::new(), String::new());
            for _ in 0..10 {
                let page = c
                    .list_status(pb::ListStatusRequest {
                        target: target(folder),
                        page_size: 1,
                        page_token: token.clone(),
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner();
                shown.extend(page.entries.iter().map(|e| e.name.clone()));
                assert!(
                    page.next_page_token.is_empty() || page.next_page_token == way_down,
                    "{folder}: a page token names {:?}",
                    page.next_page_token
                );
                if page.next_page_token.is_empty() {
                    break;
                }
                token = page.next_page_token;
            }
            assert_eq!(shown, [way_down], "{folder}");
        }
    });
    // Jobs: a load an admin started beside the subtree is neither listed nor shown to the
    // subtree's user (its path and its failed files are not theirs to learn); one inside
    // is.
    let job_id = |path: &str| {
        let out = granary(&["load", path, "--master", &master.addr, "--json"]);
        assert!(
            out.status.success(),
            "load {path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["id"].as_u64().unwrap()
    };
    let (beside, inside) = (job_id("/data/team-b"), job_id("/data/team-a"));
    rt().block_on(async {
        let mut c = MasterServiceClient::new(channel(&master.addr, Some(&creds)));
        let jobs = c
            .list_jobs(pb::ListJobsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .jobs;
        let ids: Vec<u64> = jobs.iter().map(|j| j.id).collect();
        assert_eq!(ids, [inside], "{jobs:?}");
        let e = c
            .get_job(pb::GetJobRequest {
                id: beside,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
        let shown = c
            .get_job(pb::GetJobRequest {
                id: inside,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(shown.path, "/data/team-a");
    });
    // An admin confined to the subtree cancels no job beside it (as if there were none).
    let sub_admin = TestTls::get()
        .issue(
            "team-a-admin",
            &["--role", "admin", "--subtree", "/data/team-a"],
        )
        .unwrap();
    rt().block_on(async {
        let mut c = MasterServiceClient::new(channel(&master.addr, Some(&creds_in(&sub_admin))));
        let e = c
            .cancel_job(pb::GetJobRequest {
                id: beside,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    });
    // Nor does it act anywhere else: TTLs, frees, pins, loads and mounts beside or above
    // the subtree, and changes to the whole cluster, are refused; inside they work.
    let sa = sub_admin.to_string_lossy().to_string();
    let as_sub_admin = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--master", &master.addr, "--tls-dir", &sa]);
        granary(&all)
    };
    for (args, why) in [
        (
            &["ttl", "set", "/data/team-b", "1s", "--action", "delete"][..],
            "outside the subtree",
        ),
        (
            &["free", "/data/team-b", "-R", "--force"][..],
            "outside the subtree",
        ),
        (
            &["pin", "/data/team-b", "--detach"][..],
            "outside the subtree",
        ),
        (
            &["load", "/data/team-b", "--detach"][..],
            "outside the subtree",
        ),
        (&["mount", "remove", "/data"][..], "outside the subtree"),
        (
            &["mount", "add", "/data/team-a/b", "file:///tmp"][..],
            "changes the whole cluster",
        ),
        (
            &["worker", "decommission", "1"][..],
            "changes the whole cluster",
        ),
    ] {
        let out = as_sub_admin(args);
        assert_one_sentence_error(&out, &args.join(" "));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "{args:?}: {err}");
    }
    let out = as_sub_admin(&["free", "/data/team-a", "-R"]);
    assert!(
        out.status.success(),
        "free inside: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mounts = granary_ok(&["mount", "list", "--master", &master.addr]).unwrap();
    assert!(mounts.contains("/data"), "{mounts}");
    assert!(src.join("team-b/y.bin").exists() && src.join("team-a/x.bin").exists());
}

/// Reads a whole one-block file from a worker as `creds`, showing `grant`.
async fn read_with_grant(
    worker: &str,
    creds: &Creds,
    file: &pb::FileStatus,
    grant: Option<pb::ReadGrant>,
) -> Result<Vec<u8>, tonic::Status> {
    read_block0(worker, creds, file, grant, false).await
}

/// Block 0 of `file` from `worker` (`cached_only`: what it holds, as a peer asks).
async fn read_block0(
    worker: &str,
    creds: &Creds,
    file: &pb::FileStatus,
    grant: Option<pb::ReadGrant>,
    cached_only: bool,
) -> Result<Vec<u8>, tonic::Status> {
    let mut wc = WorkerServiceClient::new(channel(worker, Some(creds)));
    let req = pb::ReadBlockRequest {
        block: Some(pb::BlockDescriptor {
            id: Some(pb::BlockId {
                inode: file.inode,
                version: file.version,
                index: 0,
            }),
            ufs: file.ufs.clone(),
            fingerprint: file.fingerprint.clone(),
            file_length: file.length,
            block_size: file.block_size,
        }),
        offset: 0,
        length: file.length,
        cache: true,
        cached_only,
        grant,
        from_peers: false,
    };
    let mut stream = wc.read_block(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await? {
        out.extend_from_slice(&m.data);
    }
    Ok(out)
}

#[test]
fn a_worker_serves_blocks_only_with_a_valid_grant() {
    use sha2::{Digest, Sha256};
    let files = [("a.bin", 300_000), ("b.bin", 200_000)];
    let n = node("granary-grant-", &files, Some("/d"));
    let tls = TestTls::get();
    let alice = creds_in(&tls.issue("alice", &["--role", "user"]).unwrap());
    let bob = creds_in(&tls.issue("bob", &["--role", "user"]).unwrap());
    let node_creds = creds_in(&tls.identity("node"));
    let want = Sha256::digest(std::fs::read(n.src.join("a.bin")).unwrap());
    let w = n.worker.addr.clone();
    rt().block_on(async {
        let m = MasterServiceClient::new(channel(&n.master.addr, Some(&alice)));
        let status = |path: &str| {
            let req = pb::GetStatusRequest {
                target: Some(pb::PathOrId {
                    target: Some(pb::path_or_id::Target::Path(path.into())),
                }),
                ..Default::default()
            };
            let mut m = m.clone();
            async move {
                m.get_status(req)
                    .await
                    .unwrap()
                    .into_inner()
                    .status
                    .unwrap()
            }
        };
        let a = status("/d/a.bin").await;
        let b = status("/d/b.bin").await;
        let ga = a
            .grant
            .clone()
            .expect("a TLS master signs a grant with the status");
        assert_eq!(
            (ga.inode, ga.principal.as_str(), ga.write),
            (a.inode, "alice", false)
        );
        let left = ga.expires_ms as i64 - granary_common::now_ms();
        assert!(
            (500_000..=600_000).contains(&left),
            "grant lifetime {left} ms"
        );

        // With the grant: the exact bytes.
        let got = read_with_grant(&w, &alice, &a, Some(ga.clone()))
            .await
            .unwrap();
        assert_eq!(Sha256::digest(&got), want);

        // Refused, each with PERMISSION_DENIED and the reason.
        let refused = |r: Result<Vec<u8>, tonic::Status>, why: &str| {
            let e = r.expect_err(why);
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{why}: {e:?}");
            assert!(e.message().contains(why), "{why}: {e:?}");
        };
        refused(read_with_grant(&w, &alice, &a, None).await, "no read grant");
        refused(
            read_with_grant(&w, &alice, &a, b.grant.clone()).await,
            "not file",
        );
        refused(
            read_with_grant(&w, &bob, &a, Some(ga.clone())).await,
            "given to alice, not bob",
        );
        let mut longer = ga.clone();
        longer.expires_ms += 24 * 3600 * 1000;
        refused(
            read_with_grant(&w, &alice, &a, Some(longer)).await,
            "forged or altered",
        );
        let mut unsigned = ga.clone();
        unsigned.key_id ^= 1;
        refused(
            read_with_grant(&w, &alice, &a, Some(unsigned)).await,
            "does not know",
        );
        // a.bin's grant does not make the worker fetch another object of the store.
        let mut elsewhere = a.clone();
        elsewhere.ufs.as_mut().unwrap().path = "b.bin".into();
        refused(
            read_with_grant(&w, &alice, &elsewhere, Some(ga.clone())).await,
            "does not cover",
        );

        // Short-circuit leases and writes need grants too; a read grant does not write.
        let mut wc = WorkerServiceClient::new(channel(&w, Some(&alice)));
        let lease = pb::LeaseLocalBlockRequest {
            block: Some(pb::BlockId {
                inode: a.inode,
                version: a.version,
                index: 0,
            }),
            ..Default::default()
        };
        let e = wc.lease_local_block(lease.clone()).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        let leased = wc
            .lease_local_block(pb::LeaseLocalBlockRequest {
                grants: vec![ga.clone()],
                ..lease
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!leased.pages.is_empty());
        let header = pb::WriteFileHeader {
            inode: a.inode,
            version: a.version + 1,
            block_size: a.block_size,
            ufs: a.ufs.clone(),
            mode: pb::WriteMode::CacheThrough as i32,
            persist: true,
            grant: Some(ga.clone()),
            finishes: true,
        };
        let first = pb::WriteFileRequest {
            header: Some(header),
            ..Default::default()
        };
        let e = wc
            .write_file(futures::stream::iter(vec![first]))
            .await
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("not writing"), "{e:?}");

        // A node reading cached pages only (a worker filling its cache from a peer) needs
        // none; a node's read that may fill the cache needs one like anyone's.
        let got = read_block0(&w, &node_creds, &a, None, true).await.unwrap();
        assert_eq!(Sha256::digest(&got), want);
        let e = read_with_grant(&w, &node_creds, &a, None)
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    });
    // Nothing was written over a.bin.
    assert_eq!(
        Sha256::digest(std::fs::read(n.src.join("a.bin")).unwrap()),
        want
    );
}

#[test]
fn credentials_never_appear_in_clear_in_logs_outputs_metrics_or_the_masters_files() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-secrets-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    random_file(&src.join("d/a.bin"), 1_500_000).unwrap();
    random_file(&src.join("d/b.bin"), 70_000).unwrap();
    let tag = format!("{:016x}", rand::random::<u64>());
    let secret = format!("SeCrEt{tag}Value");
    let key_id = format!("KeyId{tag}");
    let s3 = granary_tests::stores::TestStore::s3(root, "secrets", &key_id, &secret).unwrap();
    s3.load(&src).unwrap();
    // Three masters snapshotting often: the mount is in logs, state and snapshot files.
    let group = MasterGroup::start(root, 3, 5).unwrap();
    group.wait_leader(Duration::from_secs(30)).unwrap();
    let masters = group.addrs();
    let w = Worker::start(root, "w1", &masters, "64MiB").unwrap();
    wait_live_workers(&masters, 1).unwrap();
    // The secret from a file (never on a command line); the reads below work only if it
    // reached the store (s3s-fs refuses a wrong secret).
    let secret_file = root.join("s3-secret");
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let mut args = vec!["mount".to_string(), "add".into(), "/s3".into(), s3.uri()];
    for o in &s3.options {
        if o.starts_with("secret_access_key=") {
            args.push("--option-file".into());
            args.push(format!("secret_access_key={}", secret_file.display()));
        } else {
            args.extend(["--option".to_string(), o.clone()]);
        }
    }
    args.extend(["--master".to_string(), masters.clone()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    granary_ok(&args).unwrap();
    let fuse = Fuse::start(root, &masters).unwrap();
    let m = fuse.mountpoint.join("s3/d");
    for f in ["a.bin", "b.bin"] {
        let want = sh(&format!(
            "sha256sum < '{}'",
            src.join("d").join(f).display()
        ))
        .unwrap();
        assert_eq!(
            sh(&format!("sha256sum < '{}'", m.join(f).display())).unwrap(),
            want
        );
    }
    for i in 0..10 {
        granary_ok(&[
            "fs",
            "mkdir",
            &format!("/s3/d/dir{i}"),
            "--master",
            &masters,
        ])
        .unwrap();
    }
    group.wait_caught_up(Duration::from_secs(30)).unwrap();

    // Everything an operator can print.
    let mut outputs = Vec::new();
    for args in [
        vec!["mount", "list"],
        vec!["mount", "list", "--json"],
        vec!["report"],
        vec!["report", "--json"],
        vec!["fs", "stat", "/s3/d/a.bin"],
        vec!["fs", "ls", "-l", "-R", "/s3"],
        vec!["master", "list"],
    ] {
        let mut a = args.clone();
        a.extend(["--master", &masters]);
        let out = granary(&a);
        outputs.push(String::from_utf8_lossy(&out.stdout).to_string());
        outputs.push(String::from_utf8_lossy(&out.stderr).to_string());
    }
    // An error that names the store (a read of a missing object).
    let out = granary(&["fs", "cat", "/s3/d/missing.bin", "--master", &masters]);
    outputs.push(String::from_utf8_lossy(&out.stderr).to_string());
    outputs.push(scrape(&w.metrics).unwrap());
    outputs.push(
        fuse.metrics
            .as_deref()
            .map(|a| scrape(a).unwrap())
            .unwrap_or_default(),
    );
    for id in group.running_ids() {
        let log = group.log_text(id);
        let addr = log
            .lines()
            .find_map(|l| l.split("metrics on http://").nth(1))
            .map(|s| s.trim_end_matches("/metrics").trim().to_string())
            .unwrap();
        outputs.push(scrape(&addr).unwrap());
    }
    let listing = &outputs[0];
    assert!(
        listing.contains("secret_access_key=***"),
        "mount list: {listing}"
    );
    for (i, o) in outputs.iter().enumerate() {
        assert!(!o.contains(&secret), "output {i} shows the secret: {o}");
    }
    // Every log of Granary's processes (the store's own log is not ours).
    for e in std::fs::read_dir(root).unwrap().flatten() {
        let p = e.path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if name.ends_with(".log") && !name.starts_with("s3s-fs") {
            let text = std::fs::read_to_string(&p).unwrap();
            assert!(!text.contains(&secret), "{name} shows the secret");
        }
    }
    // The masters' RocksDB files (log, state, snapshots): the secret nowhere, while the
    // access key id next to it (not a secret) is found in clear — the scan can see it.
    for id in 1..=3u64 {
        let dir = group.member(id).data_dir.clone();
        assert!(
            !files_containing(&dir, key_id.as_bytes()).is_empty(),
            "the scan of {} found no clear option at all",
            dir.display()
        );
        let hits = files_containing(&dir, secret.as_bytes());
        assert!(hits.is_empty(), "the secret in clear in {hits:?}");
    }
}

/// A pass-through codec: the test writes the protobuf bytes itself (bad UTF-8, huge).
#[derive(Clone, Copy, Default)]
struct RawCodec;
struct RawEnc;
struct RawDec;

impl tonic::codec::Encoder for RawEnc {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        let n = bytes::Buf::remaining(src);
        Ok(Some(bytes::Buf::copy_to_bytes(src, n).to_vec()))
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEnc;
    type Decoder = RawDec;
    fn encoder(&mut self) -> RawEnc {
        RawEnc
    }
    fn decoder(&mut self) -> RawDec {
        RawDec
    }
}

async fn raw_call(
    ch: tonic::transport::Channel,
    path: &'static str,
    body: Vec<u8>,
) -> Result<Vec<u8>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(ch).max_encoding_message_size(usize::MAX);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    grpc.unary(tonic::Request::new(body), path, RawCodec)
        .await
        .map(|r| r.into_inner())
}

#[test]
fn malformed_requests_get_precise_errors_and_change_nothing() {
    let n = node("granary-hostile-", &[("a.bin", 100_000)], Some("/d"));
    let (master, w) = (&n.master, &n.worker);
    granary_ok(&["fs", "ls", "/d", "--master", &master.addr]).unwrap();
    let admin = creds_in(&TestTls::get().identity("admin"));
    let before = master_call(&master.addr, Some(&admin)).unwrap();
    use tonic::Code::{FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange};
    rt().block_on(async {
        let mut m = MasterServiceClient::new(channel(&master.addr, Some(&admin)));
        let deep = format!("/d/{}", "x/".repeat(2500));
        let long_name = format!("/d/{}", "n".repeat(300));
        for (what, path, want) in [
            ("a .. component", "/d/../etc", InvalidArgument),
            ("a NUL byte", "/d/a\0b", InvalidArgument),
            ("a 300-byte name", long_name.as_str(), InvalidArgument),
            (
                "a 5,000-byte, 2,500-level path",
                deep.as_str(),
                InvalidArgument,
            ),
            ("a relative path", "d/x", InvalidArgument),
            ("an empty path", "", InvalidArgument),
        ] {
            let e = m
                .mkdir(pb::MkdirRequest {
                    path: path.into(),
                    recursive: true,
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), want, "mkdir with {what}: {e:?}");
            assert!(!e.message().is_empty(), "mkdir with {what}: no message");
            let e = m
                .create_file(pb::CreateFileRequest {
                    path: path.into(),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), want, "create with {what}: {e:?}");
            let e = m
                .rename(pb::RenameRequest {
                    src: "/d/a.bin".into(),
                    dst: path.into(),
                    request_id: 0,
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), want, "rename to {what}: {e:?}");
            let e = m
                .delete(pb::DeleteRequest {
                    path: path.into(),
                    recursive: true,
                    request_id: 0,
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), want, "delete of {what}: {e:?}");
        }
        // A page size far above the limit is capped, a garbage page token is harmless.
        let target = Some(pb::PathOrId {
            target: Some(pb::path_or_id::Target::Path("/d".into())),
        });
        let page = m
            .list_status(pb::ListStatusRequest {
                target: target.clone(),
                page_size: u32::MAX,
                page_token: "\u{10FFFF}".repeat(100_000),
                allow_stale: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.entries.is_empty());
        // Bad UTF-8 in a string field and a message above the size limit, as raw bytes.
        let ch = channel(&master.addr, Some(&admin));
        let e = raw_call(
            ch.clone(),
            "/granary.v1.MasterService/Mkdir",
            vec![0x0a, 0x04, b'/', b'd', 0xff, 0xfe],
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), Internal, "{e:?}");
        assert!(e.message().contains("UTF-8"), "{e:?}");
        let mut huge = vec![0x0a];
        let len = 65 * 1024 * 1024u64;
        let mut v = len;
        while v >= 0x80 {
            huge.push((v as u8) | 0x80);
            v >>= 7;
        }
        huge.push(v as u8);
        huge.resize(huge.len() + len as usize, b'a');
        let e = raw_call(ch.clone(), "/granary.v1.MasterService/Mkdir", huge)
            .await
            .unwrap_err();
        assert_eq!(e.code(), OutOfRange, "{e:?}");
        // A length prefix promising more than the body holds.
        let e = raw_call(
            ch,
            "/granary.v1.MasterService/Mkdir",
            vec![0x0a, 0xff, 0xff, 0xff, 0x7f, b'/'],
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), Internal, "{e:?}");

        // Workers: a read far outside any block, and one of a block of no file.
        let mut wc = WorkerServiceClient::new(channel(&w.addr, Some(&admin)));
        let block = |offset: u64, length: u64| pb::ReadBlockRequest {
            block: Some(pb::BlockDescriptor {
                id: Some(pb::BlockId {
                    inode: 987_654,
                    version: 1,
                    index: 0,
                }),
                ufs: None,
                fingerprint: None,
                file_length: 10,
                block_size: 64 << 20,
            }),
            offset,
            length,
            cache: true,
            cached_only: false,
            grant: None,
            from_peers: false,
        };
        let e = match wc.read_block(block(u64::MAX - 5, u64::MAX)).await {
            Err(e) => e,
            Ok(r) => r.into_inner().message().await.unwrap_err(),
        };
        assert_eq!(e.code(), InvalidArgument, "{e:?}");
        let e = match wc.read_block(block(0, 10)).await {
            Err(e) => e,
            Ok(r) => r.into_inner().message().await.unwrap_err(),
        };
        assert!(
            matches!(e.code(), InvalidArgument | NotFound | FailedPrecondition),
            "{e:?}"
        );
        // A load task (a master's call) naming the holders of some of its blocks only, and
        // one of more blocks than a task may carry.
        let master_creds = creds_in(&TestTls::get().master(1));
        let mut wc = WorkerServiceClient::new(channel(&w.addr, Some(&master_creds)));
        let desc = block(0, 10).block.unwrap();
        let e = wc
            .load_blocks(pb::LoadBlocksRequest {
                blocks: vec![desc.clone(), desc.clone()],
                holders: vec![pb::BlockHolders::default()],
                pinned_inodes: vec![],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), InvalidArgument, "{e:?}");
        assert!(e.message().contains("holders"), "{e:?}");
        let e = wc
            .load_blocks(pb::LoadBlocksRequest {
                blocks: vec![desc; 257],
                holders: vec![],
                pinned_inodes: vec![],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), InvalidArgument, "{e:?}");
    });
    // Nothing changed, and both servers still serve.
    let after = master_call(&master.addr, Some(&admin)).unwrap();
    assert_eq!(after.inode_count, before.inode_count);
    assert!(worker_call(&w.addr, Some(&admin)).is_ok());
    let listing = granary_ok(&["fs", "ls", "/d", "--master", &master.addr]).unwrap();
    assert_eq!(listing.trim().lines().count(), 1, "{listing}");
}

/// Runs `cmd` with bash as `uid`/`gid` and no supplementary groups.
fn sh_as(uid: u32, gid: u32, cmd: &str) -> std::process::Output {
    std::process::Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={gid}"),
            "--clear-groups",
            "bash",
            "-c",
            cmd,
        ])
        .output()
        .unwrap()
}

#[test]
fn owners_and_modes_are_enforced_for_the_users_of_a_mount() {
    let n = node("granary-posix-", &[("team/a.bin", 300_000)], None);
    let (root, src, master) = (n.tmp.path(), &n.src, &n.master);
    // The mount's objects belong to 1000:1000, folders 0750, files 0640.
    let s = src.to_string_lossy();
    let opts = ["uid=1000", "gid=1000", "dir_mode=0750", "file_mode=0640"];
    let mut args = vec!["mount", "add", "/p", s.as_ref(), "--master", &master.addr];
    for o in &opts {
        args.extend(["-o", o]);
    }
    granary_ok(&args).unwrap();
    let fuse = Fuse::start_opts(root, "mnt", &master.addr, &["--allow-other"]).unwrap();
    let m = fuse.mountpoint.join("p");
    // Root's permissive test folder: other users must reach the mount point.
    sh(&format!(
        "chmod 755 '{}' '{}'",
        root.display(),
        fuse.mountpoint.display()
    ))
    .unwrap();
    let stat = |p: &Path| sh(&format!("stat -c '%u:%g %a' '{}'", p.display())).unwrap();
    assert_eq!(stat(&m.join("team")).trim(), "1000:1000 750");
    assert_eq!(stat(&m.join("team/a.bin")).trim(), "1000:1000 640");
    let want = sh(&format!(
        "sha256sum < '{}'",
        src.join("team/a.bin").display()
    ))
    .unwrap();
    let a = m.join("team/a.bin");
    let team = m.join("team");
    let denied = |out: std::process::Output, what: &str| {
        assert!(!out.status.success(), "{what} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("Permission denied"), "{what}: {err}");
    };

    // The owner reads, makes a folder and writes a file; what it makes is its own, with the
    // modes its umask leaves.
    let out = sh_as(1000, 1000, &format!("sha256sum < '{}'", a.display()));
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
    let out = sh_as(
        1000,
        1000,
        &format!(
            "umask 022 && mkdir '{0}/new' && echo checkpoint > '{0}/new/f.txt'",
            team.display()
        ),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stat(&team.join("new")).trim(), "1000:1000 755");
    assert_eq!(stat(&team.join("new/f.txt")).trim(), "1000:1000 644");
    assert_eq!(
        std::fs::read_to_string(src.join("team/new/f.txt")).unwrap(),
        "checkpoint\n"
    );
    // Its group reads (0640) but may not add to the folder (0750).
    let out = sh_as(1001, 1000, &format!("sha256sum < '{}'", a.display()));
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
    denied(
        sh_as(1001, 1000, &format!("touch '{}/x'", team.display())),
        "group touch",
    );
    denied(
        sh_as(1001, 1000, &format!("rm '{}'", a.display())),
        "group rm",
    );
    // Others get nowhere.
    denied(
        sh_as(2000, 2000, &format!("cat '{}'", a.display())),
        "other cat",
    );
    denied(
        sh_as(2000, 2000, &format!("ls '{}'", team.display())),
        "other ls",
    );
    assert!(!src.join("team/x").exists() && src.join("team/a.bin").exists());

    // The master checks the same for a mount's caller (not only the kernel): a direct
    // request on behalf of uid 1001 is refused and changes nothing; 1000's works.
    let creds = creds_in(&TestTls::get().identity("node"));
    rt().block_on(async {
        let mut c = MasterServiceClient::new(channel(&master.addr, Some(&creds)));
        let mkdir = |uid: u32, path: &str| {
            let mut req = tonic::Request::new(pb::MkdirRequest {
                path: path.into(),
                recursive: false,
                mode: 0o755,
                request_id: 0,
            });
            let md = req.metadata_mut();
            md.insert(pb::CALLER_UID_KEY, uid.into());
            md.insert(pb::CALLER_GID_KEY, 1000u32.into());
            req
        };
        let e = c.mkdir(mkdir(1001, "/p/team/by-1001")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(
            e.message()
                .contains("uid 1001 may not change entries of /p/team"),
            "{e:?}"
        );
        let made = c.mkdir(mkdir(1000, "/p/team/by-1000")).await.unwrap();
        let s = made.into_inner().status.unwrap();
        assert_eq!((s.uid, s.gid, s.has_owner), (1000, 1000, true));
    });
    let listing = granary_ok(&["fs", "ls", "/p/team", "--master", &master.addr]).unwrap();
    assert!(
        listing.contains("by-1000") && !listing.contains("by-1001"),
        "{listing}"
    );
    // Root may do anything.
    sh(&format!("touch '{}/by-root'", team.display())).unwrap();
}

/// Mounts a fresh tmpfs at `dir` (it holds sparse files of any length); unmounted on drop.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        sh(&format!(
            "mount -t tmpfs -o size=4m granary-test {}",
            dir.display()
        ))
        .unwrap();
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// What stopped every master for good: a user removes the folder above a mount point, an
/// admin then removes the mount (the committed entry failed its apply as "storage corrupt"
/// on every member, at every restart). And a "load bomb": files claiming absurd lengths.
/// On a 3-master TLS group, with the `user` certificate: the removal and the move are
/// refused (one-sentence CLI error naming the mount; EBUSY through FUSE), the mount keeps
/// serving its bytes, `mount remove` succeeds; a file written by one principal cannot be
/// completed by another, nor claim 2^58 bytes or a 1-byte block size; a store file that
/// claims 2^58 bytes fails its load with a reason. Every master stays up throughout and
/// the group keeps committing.
#[test]
fn no_user_request_stops_a_master_group() {
    let tmp = tempfile::Builder::new()
        .prefix("gr-busy")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    random_file(&src.join("a/f1"), 300_000).unwrap();
    random_file(&src.join("f2"), 70_000).unwrap();
    let g = MasterGroup::start(root, 3, 1000).unwrap();
    let addrs = g.addrs();
    g.wait_leader(Duration::from_secs(30)).unwrap();
    let _w = Worker::start(root, "w1", &addrs, "256MiB").unwrap();
    wait_live_workers(&addrs, 1).unwrap();
    granary_ok(&["fs", "mkdir", "-p", "/datasets", "--master", &addrs]).unwrap();
    mount_local("/datasets/imagenet", &src, &addrs).unwrap();
    let user = TestTls::get().identity("user");
    let user = user.to_string_lossy();

    for args in [
        vec!["fs", "rm", "-R", "/datasets"],
        vec!["fs", "rm", "-R", "/datasets/imagenet"],
        vec!["fs", "mv", "/datasets", "/old"],
    ] {
        let mut all = args.clone();
        all.extend(["--master", &addrs, "--tls-dir", &user]);
        let out = granary(&all);
        assert_one_sentence_error(&out, &format!("{args:?}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("the mount point /datasets/imagenet is at or below it"),
            "{args:?}: {err}"
        );
    }
    let fuse = Fuse::start(root, &addrs).unwrap();
    let mnt = fuse.mountpoint.clone();
    let renamed = sh(&format!(
        "python3 -c 'import os,sys\ntry:\n os.rename(sys.argv[1], sys.argv[2])\nexcept OSError as e:\n print(e.errno)' {} {}",
        mnt.join("datasets").display(),
        mnt.join("old").display()
    ))
    .unwrap();
    assert_eq!(
        renamed.trim(),
        "16",
        "rename of a folder holding a mount: EBUSY"
    );
    assert_eq!(
        tree_sums(&mnt.join("datasets/imagenet")).unwrap(),
        tree_sums(&src).unwrap(),
        "the mount serves its bytes after the refused removal"
    );

    // Writes: only the writer completes its file, with a real length and block size.
    let alice = TestTls::get()
        .issue("alice", &["--role", "user", "--days", "1"])
        .unwrap();
    let bob = TestTls::get()
        .issue("bob", &["--role", "user", "--days", "1"])
        .unwrap();
    let leader_addr = g.addr(g.wait_leader(Duration::from_secs(10)).unwrap());
    rt().block_on(async {
        let mut a = MasterServiceClient::new(channel(&leader_addr, Some(&creds_in(&alice))));
        let mut b = MasterServiceClient::new(channel(&leader_addr, Some(&creds_in(&bob))));
        let create = |block_size| pb::CreateFileRequest {
            path: "/scratch-file".into(),
            block_size,
            ..Default::default()
        };
        let e = a.create_file(create(1)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        let e = a.create_file(create(1 << 40)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        let f = a
            .create_file(create(0))
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap();
        let complete = |length| pb::CompleteFileRequest {
            inode: f.inode,
            length,
            version: f.version,
            ..Default::default()
        };
        let e = b.complete_file(complete(10)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("alice"), "{e:?}");
        let e = a.complete_file(complete(1 << 58)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        let done = a.complete_file(complete(0)).await.unwrap().into_inner();
        assert!(done.status.unwrap().complete);

        // The same request id from another principal is another request: bob's create is
        // made, not answered with alice's outcome (and a write grant on her file).
        let mine = |path: &str| pb::CreateFileRequest {
            path: path.into(),
            request_id: 77,
            ..Default::default()
        };
        let fa = a
            .create_file(mine("/rid-alice"))
            .await
            .unwrap()
            .into_inner();
        let fb = b.create_file(mine("/rid-bob")).await.unwrap().into_inner();
        let (fa, fb) = (fa.status.unwrap(), fb.status.unwrap());
        assert_ne!(fa.inode, fb.inode);
        assert_eq!(fb.path, "/rid-bob");
        // Even the very same message (path and id) from bob is his own request: his checks
        // answer (the file exists), never alice's outcome and a write grant on her file.
        let e = b.create_file(mine("/rid-alice")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e:?}");
        // Alice's own retry still gets her first outcome.
        let again = a
            .create_file(mine("/rid-alice"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(again.status.unwrap().inode, fa.inode);
        // A location ask past the limit is refused.
        let e = a
            .get_block_locations(pb::GetBlockLocationsRequest {
                blocks: (0..5000)
                    .map(|index| pb::BlockId {
                        inode: fa.inode,
                        version: fa.version,
                        index,
                    })
                    .collect(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    });

    // A principal limited to a subtree learns nothing of names outside it: a path that
    // exists and one that does not get the same refusal.
    let team = TestTls::get()
        .issue(
            "team-x",
            &[
                "--role",
                "user",
                "--subtree",
                "/datasets/team-x",
                "--days",
                "1",
            ],
        )
        .unwrap();
    rt().block_on(async {
        let mut t = MasterServiceClient::new(channel(&leader_addr, Some(&creds_in(&team))));
        for path in ["/scratch-file", "/no-such-file"] {
            let e = t
                .get_status(pb::GetStatusRequest {
                    target: Some(pb::PathOrId {
                        target: Some(pb::path_or_id::Target::Path(path.into())),
                    }),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{path}: {e:?}");
        }
        // Nor by inode id: an inode outside the subtree and one that does not exist get the
        // same refusal, which names neither path (ids are easy to guess).
        let mut a = MasterServiceClient::new(channel(&leader_addr, Some(&creds_in(&alice))));
        let scratch = a
            .get_status(pb::GetStatusRequest {
                target: Some(pb::PathOrId {
                    target: Some(pb::path_or_id::Target::Path("/scratch-file".into())),
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap();
        for id in [scratch.inode, 1 << 40] {
            let by_id = || {
                Some(pb::PathOrId {
                    target: Some(pb::path_or_id::Target::Inode(id)),
                })
            };
            let e = t
                .get_status(pb::GetStatusRequest {
                    target: by_id(),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            let e2 = t
                .list_status(pb::ListStatusRequest {
                    target: by_id(),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            for e in [e, e2] {
                assert_eq!(e.code(), tonic::Code::PermissionDenied, "{id}: {e:?}");
                assert!(
                    e.message()
                        == format!("inode {id} is outside the subtree /datasets/team-x of team-x"),
                    "{id}: {e:?}"
                );
            }
        }
    });

    // A store file claiming 2^58 bytes (sparse, on a tmpfs): its load fails with a reason,
    // the file beside it loads.
    let bomb_dir = root.join("bomb");
    let _tmpfs = Tmpfs::mount(&bomb_dir);
    sh(&format!(
        "truncate -s {} {}",
        1u64 << 58,
        bomb_dir.join("huge").display()
    ))
    .unwrap();
    std::fs::write(bomb_dir.join("small"), b"0123456789").unwrap();
    mount_local("/bomb", &bomb_dir, &addrs).unwrap();
    let out = granary(&["load", "/bomb", "--json", "--master", &addrs]);
    let job: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(job["state"], "failed", "{job}");
    assert_eq!(job["done_files"], 1, "{job}");
    assert_eq!(job["failed_files"], 1, "{job}");
    let reason = job["failed"][0]["reason"].as_str().unwrap_or_default();
    assert!(
        job["failed"][0]["path"] == "/bomb/huge" && reason.contains("288230376151711744 bytes"),
        "{job}"
    );

    // The admin removes the mount; the folder can go then.
    granary_ok(&["mount", "remove", "/datasets/imagenet", "--master", &addrs]).unwrap();
    granary_ok(&["mount", "remove", "/bomb", "--master", &addrs]).unwrap();
    granary_ok(&[
        "fs",
        "rm",
        "-R",
        "/datasets",
        "--master",
        &addrs,
        "--tls-dir",
        &user,
    ])
    .unwrap();
    granary_ok(&["fs", "mkdir", "/after", "--master", &addrs]).unwrap();
    g.wait_caught_up(Duration::from_secs(30)).unwrap();
    let mut g = g;
    for id in 1..=3 {
        assert!(g.is_running(id), "master {id} stopped:\n{}", g.log_text(id));
    }
    assert!(!g.logs().contains("stops applying"), "{}", g.logs());
    drop(fuse);
}

/// A seeded stream of arbitrary namespace requests against a real master group and its
/// worker, from an admin, a user and a user limited to a subtree: hostile paths (traversal,
/// NUL, megabyte paths, bidi controls), any block size, length, inode, version and page
/// size. Each answer is a success or a precise refusal — never INTERNAL/UNKNOWN, never an
/// empty message — and afterwards every master is up, none logged a panic or a stop, and
/// the namespace still serves. `GRANARY_TEST_SEED` replays a run.
#[test]
fn arbitrary_requests_get_precise_answers_and_no_master_stops() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = std::env::var("GRANARY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("GRANARY_TEST_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let tmp = tempfile::Builder::new()
        .prefix("gr-fuzz")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    random_file(&src.join("d/f"), 100_000).unwrap();
    let g = MasterGroup::start(root, 3, 200).unwrap();
    let addrs = g.addrs();
    g.wait_leader(Duration::from_secs(30)).unwrap();
    let _w = Worker::start(root, "w1", &addrs, "64MiB").unwrap();
    wait_live_workers(&addrs, 1).unwrap();
    granary_ok(&["fs", "mkdir", "-p", "/t/team-a", "--master", &addrs]).unwrap();
    mount_local("/t/m", &src, &addrs).unwrap();
    let team_a = TestTls::get()
        .issue(
            "fuzz-team-a",
            &["--role", "user", "--subtree", "/t/team-a", "--days", "1"],
        )
        .unwrap();
    let who = [
        creds_in(&TestTls::get().identity("admin")),
        creds_in(&TestTls::get().identity("user")),
        creds_in(&team_a),
    ];
    let leader = g.addr(g.wait_leader(Duration::from_secs(10)).unwrap());
    let names = [
        "t",
        "m",
        "d",
        "f",
        "team-a",
        "x",
        "..",
        ".",
        "",
        "a\0b",
        "\u{202e}z",
    ];
    let path = |rng: &mut rand::rngs::StdRng| -> String {
        match rng.gen_range(0..12) {
            0 => format!("/{}", "x".repeat(rng.gen_range(250..5000))),
            1 => "relative/p".into(),
            2 => format!("/{}", "d/".repeat(3000)),
            _ => {
                let n = rng.gen_range(0..5);
                let parts: Vec<&str> = (0..n)
                    .map(|_| names[rng.gen_range(0..names.len())])
                    .collect();
                format!("/{}", parts.join("/"))
            }
        }
    };
    let mut answered = std::collections::BTreeMap::<String, usize>::new();
    rt().block_on(async {
        let clients: Vec<_> = who
            .iter()
            .map(|c| MasterServiceClient::new(channel(&leader, Some(c))))
            .collect();
        for i in 0..300 {
            let mut c = clients[rng.gen_range(0..clients.len())].clone();
            let inode = if rng.gen_bool(0.5) {
                rng.gen_range(0..40)
            } else {
                rng.gen()
            };
            let pick: u64 = [0, 1, 1 << 16, 64 << 20, 1 << 58, u64::MAX][rng.gen_range(0..6)];
            let kind = rng.gen_range(0..10);
            let r: Result<(), tonic::Status> = match kind {
                0 => c
                    .mkdir(pb::MkdirRequest {
                        path: path(&mut rng),
                        recursive: rng.gen(),
                        mode: rng.gen(),
                        request_id: rng.gen_range(0..4),
                    })
                    .await
                    .map(drop),
                1 => c
                    .create_file(pb::CreateFileRequest {
                        path: path(&mut rng),
                        block_size: pick,
                        overwrite: rng.gen(),
                        request_id: rng.gen_range(0..4),
                        ..Default::default()
                    })
                    .await
                    .map(drop),
                2 => c
                    .complete_file(pb::CompleteFileRequest {
                        inode,
                        length: pick,
                        version: [0, 1, rng.gen()][rng.gen_range(0..3)],
                        persist_state: rng.gen_range(0..4),
                        persist_worker: rng.gen_range(0..3),
                        ..Default::default()
                    })
                    .await
                    .map(drop),
                3 => c
                    .delete(pb::DeleteRequest {
                        path: path(&mut rng),
                        recursive: rng.gen(),
                        request_id: rng.gen_range(0..4),
                    })
                    .await
                    .map(drop),
                4 => c
                    .rename(pb::RenameRequest {
                        src: path(&mut rng),
                        dst: path(&mut rng),
                        request_id: rng.gen_range(0..4),
                    })
                    .await
                    .map(drop),
                5 => c
                    .get_status(pb::GetStatusRequest {
                        target: Some(pb::PathOrId {
                            target: Some(if rng.gen() {
                                pb::path_or_id::Target::Inode(inode)
                            } else {
                                pb::path_or_id::Target::Path(path(&mut rng))
                            }),
                        }),
                        ..Default::default()
                    })
                    .await
                    .map(drop),
                6 => c
                    .list_status(pb::ListStatusRequest {
                        target: Some(pb::PathOrId {
                            target: Some(pb::path_or_id::Target::Path(path(&mut rng))),
                        }),
                        page_size: rng.gen(),
                        page_token: names[rng.gen_range(0..names.len())].into(),
                        allow_stale: rng.gen(),
                    })
                    .await
                    .map(drop),
                7 => c
                    .lookup(pb::LookupRequest {
                        parent: inode,
                        name: names[rng.gen_range(0..names.len())].into(),
                    })
                    .await
                    .map(drop),
                8 => c
                    .get_block_locations(pb::GetBlockLocationsRequest {
                        blocks: (0..rng.gen_range(0..6000u32))
                            .map(|index| pb::BlockId {
                                inode,
                                version: 1,
                                index,
                            })
                            .collect(),
                    })
                    .await
                    .map(drop),
                _ => c
                    .sync_metadata(pb::SyncMetadataRequest {
                        path: path(&mut rng),
                        recursive: rng.gen(),
                    })
                    .await
                    .map(drop),
            };
            let label = match &r {
                Ok(()) => "ok".to_string(),
                Err(s) => {
                    assert!(
                        !matches!(s.code(), tonic::Code::Internal | tonic::Code::Unknown),
                        "request {i} (kind {kind}, seed {seed}): {s:?}"
                    );
                    assert!(!s.message().trim().is_empty(), "request {i}: {s:?}");
                    format!("{:?}", s.code())
                }
            };
            *answered.entry(label).or_default() += 1;
        }
    });
    eprintln!("answers: {answered:?}");
    assert!(
        answered.get("ok").copied().unwrap_or(0) > 10,
        "{answered:?}"
    );
    assert!(answered.len() >= 4, "too few kinds of answer: {answered:?}");
    // Every master is up, none stopped or panicked, the namespace serves.
    granary_ok(&["fs", "mkdir", "/after-fuzz", "--master", &addrs]).unwrap();
    g.wait_caught_up(Duration::from_secs(30)).unwrap();
    let mut g = g;
    for id in 1..=3 {
        assert!(g.is_running(id), "master {id} stopped:\n{}", g.log_text(id));
    }
    let logs = g.logs();
    assert!(
        !logs.contains("panicked") && !logs.contains("stops applying"),
        "{logs}"
    );
    let listed = granary_ok(&["fs", "ls", "/t/m/d", "--master", &addrs]).unwrap();
    assert!(listed.contains('f'), "{listed}");
}

/// The namespace watch from a hostile caller's side: a subtree user may watch (what it
/// hears is inode numbers — the message has no field for a name, a path or bytes), the same
/// principal may watch twice, and a watcher that stops reading stalls nothing: the master
/// keeps applying and answering, holds at most a bounded backlog for it, and the watcher
/// later hears every change or is told to start over (`reset`).
#[test]
fn a_watcher_that_never_reads_stalls_nothing_and_hears_only_inode_numbers() {
    let n = node("granary-watch-", &[("a.bin", 1000)], Some("/d"));
    let addr = n.master.addr.as_str();
    let carol = TestTls::get()
        .issue("carol", &["--role", "user", "--subtree", "/d/team"])
        .unwrap();
    let carol = creds_in(&carol);
    rt().block_on(async {
        let mut m = MasterServiceClient::new(channel(addr, Some(&carol)));
        let mut first = m
            .watch_namespace(pb::WatchNamespaceRequest {})
            .await
            .unwrap()
            .into_inner();
        let mut idle = m
            .watch_namespace(pb::WatchNamespaceRequest {})
            .await
            .unwrap()
            .into_inner();
        let hello = first.message().await.unwrap().unwrap();
        assert!(hello.reset, "a watch starts with a reset: {hello:?}");
        assert!(idle.message().await.unwrap().unwrap().reset);
        // More applied entries than the master buffers for a watcher (4,096), while `idle`
        // reads nothing (its stream fills, then the master's sender for it waits).
        let admin = creds_in(&TestTls::get().identity("admin"));
        let mut a = MasterServiceClient::new(channel(addr, Some(&admin)));
        a.mkdir(pb::MkdirRequest {
            path: "/x".into(),
            recursive: true,
            ..Default::default()
        })
        .await
        .unwrap();
        for chunk in (0..4200).collect::<Vec<u32>>().chunks(16) {
            let calls = chunk.iter().map(|i| {
                let mut a = a.clone();
                async move {
                    a.mkdir(pb::MkdirRequest {
                        path: format!("/x/{i}"),
                        ..Default::default()
                    })
                    .await
                }
            });
            for r in futures::future::join_all(calls).await {
                r.unwrap();
            }
        }
        // The reading watcher heard inode numbers of those changes.
        let mut heard = 0;
        while heard == 0 {
            let c = tokio::time::timeout(Duration::from_secs(10), first.message())
                .await
                .expect("the watch went silent")
                .unwrap()
                .unwrap();
            heard += c.inodes.len();
        }
        // The one that read nothing then hears every change, or is told to start over
        // (`reset`) where the master did not keep them: never less than that.
        let mut reset = false;
        let mut inodes = std::collections::HashSet::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !reset && inodes.len() < 4200 && tokio::time::Instant::now() < deadline {
            let c = tokio::time::timeout(Duration::from_secs(10), idle.message())
                .await
                .expect("the idle watch went silent")
                .unwrap()
                .unwrap();
            reset |= c.reset;
            inodes.extend(c.inodes);
        }
        assert!(
            reset || inodes.len() >= 4200,
            "the idle watcher heard of {} new inodes and no reset",
            inodes.len()
        );
    });
    assert!(granary_ok(&["fs", "ls", "/d", "--master", addr])
        .unwrap()
        .contains("a.bin"));
}

/// A watcher that reads nothing (an HTTP/2 window of 0: the answers of its stream can
/// never be sent, which keeps the stream and its connection open) does not keep a master
/// from stopping: SIGTERM ends it within the server's grace for open connections.
#[test]
fn a_watcher_that_reads_nothing_does_not_keep_a_master_from_stopping() {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let tmp = tempfile::Builder::new()
        .prefix("granary-lazy-watch-")
        .tempdir()
        .unwrap();
    let mut master = Master::start(tmp.path()).unwrap();
    let c = creds_in(&TestTls::get().issue("lazy", &["--role", "user"]).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let _watch = rt.block_on(async {
        let ch = Endpoint::from_shared(format!("https://{}", master.addr))
            .unwrap()
            .tls_config(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&c.ca))
                    .identity(Identity::from_pem(&c.cert, &c.key))
                    .domain_name(tls::NODE_SERVER_NAME),
            )
            .unwrap()
            .initial_stream_window_size(0)
            .connect()
            .await
            .unwrap();
        MasterServiceClient::new(ch)
            .watch_namespace(pb::WatchNamespaceRequest::default())
            .await
            .unwrap()
            .into_inner()
    });
    // The stream is open and its first answer waits for a window that never comes.
    let code = master.proc.stop("TERM", Duration::from_secs(60)).unwrap();
    assert_eq!(code, Some(0), "{}", master.proc.log_text());
}
