//! Masters and workers are distinct identities, and every request has a bounded cost at
//! the transport: real `granary` processes on loopback, with TLS (the harness issues each
//! master a `master` certificate of its id, workers a `node` one); the test talks gRPC
//! itself with identities of its choice.

use std::path::Path;
use std::time::Duration;

use granary_common::tls;
use granary_proto as pb;
use granary_proto::master_service_client::MasterServiceClient;
use granary_proto::raft_service_client::RaftServiceClient;
use granary_proto::worker_service_client::WorkerServiceClient;
use granary_tests::*;

/// The suite may run plaintext (`GRANARY_TEST_INSECURE=1`): identities need TLS.
fn tls_suite() -> bool {
    !insecure_suite()
}

/// A mutual-TLS channel to `addr` with the identity in `dir`, verifying the server by
/// `server_name`.
fn channel_as(addr: &str, dir: &Path, server_name: &str) -> tonic::transport::Channel {
    channel_to(addr, Some(&creds_in(dir)), server_name)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A raft-rs `eraftpb::Message` (protobuf) heartbeat `from` → `to` in `term`: stepped by a
/// follower, a term above the group's makes it follow `from` and unseats the real leader.
fn heartbeat(from: u64, to: u64, term: u64) -> Vec<u8> {
    const MSG_HEARTBEAT: u64 = 8;
    let mut m = Vec::new();
    for (field, v) in [(1u64, MSG_HEARTBEAT), (2, to), (3, from), (4, term)] {
        varint(&mut m, field << 3);
        varint(&mut m, v);
    }
    m
}

fn send(
    addr: &str,
    identity: &Path,
    from: u64,
    to: u64,
    term: u64,
) -> Result<pb::RaftAck, tonic::Status> {
    rt().block_on(async {
        let mut c = RaftServiceClient::new(channel_as(addr, identity, tls::MASTER_SERVER_NAME));
        c.send(pb::RaftBatch {
            from,
            to,
            messages: vec![heartbeat(from, to, term).into()],
        })
        .await
        .map(|r| r.into_inner())
    })
}

/// `(leader id, term)` as the group reports it.
fn leader_and_term(g: &MasterGroup) -> (u64, u64) {
    let e = g.leader_entry(Duration::from_secs(30)).unwrap();
    (e["id"].as_u64().unwrap(), e["term"].as_u64().unwrap())
}

/// `RaftService/GrantKey` as `identity`, asking for master `from`.
fn grant_key(addr: &str, identity: &Path, from: u64) -> Result<pb::GrantKeyReply, tonic::Status> {
    rt().block_on(async {
        let mut c = RaftServiceClient::new(channel_as(addr, identity, tls::MASTER_SERVER_NAME));
        c.grant_key(pb::GrantKeyRequest { from })
            .await
            .map(|r| r.into_inner())
    })
}

/// The leader's grant key signs what workers cache: only a member of the group, with its
/// own master certificate, gets it, and only from the leader. Users, admins, workers, a
/// master claiming another's id, a master certificate of an id outside the group and huge
/// ids are refused; the group keeps its leader and commits.
#[test]
fn only_a_member_master_gets_the_leaders_grant_key() {
    if !tls_suite() {
        return;
    }
    let tmp = workdir("granary-ids-grantkey-");
    let g = MasterGroup::start(tmp.path(), 3, 1000).unwrap();
    let (leader, term) = leader_and_term(&g);
    let follower = g.running_ids().into_iter().find(|&i| i != leader).unwrap();
    let (laddr, faddr) = (g.addr(leader), g.addr(follower));
    let t = TestTls::get();
    for who in ["user", "admin", "node"] {
        let e = grant_key(&laddr, &t.identity(who), follower).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{who}: {e:?}");
        assert!(
            e.message().contains("GrantKey needs the master role"),
            "{who}: {e:?}"
        );
    }
    // A member's certificate speaks for its own id only.
    let e = grant_key(&laddr, &t.master(follower), leader).unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    for id in [9, u64::MAX] {
        let e = grant_key(&laddr, &t.master(follower), id).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{id}: {e:?}");
    }
    // A master certificate of an id that is not a member.
    let e = grant_key(&laddr, &t.master(9), 9).unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("not a member"), "{e:?}");
    // A follower has no key of its own to give: it names the leader.
    let e = grant_key(&faddr, &t.master(leader), leader).unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    // A member asking the leader gets a usable key, in the leader's term; twice, the same.
    let first = grant_key(&laddr, &t.master(follower), follower).unwrap();
    let again = grant_key(&laddr, &t.master(follower), follower).unwrap();
    assert_eq!(first.term, term);
    let key = first.key.expect("a key");
    assert!(key.id != 0 && key.key.len() == 32, "{key:?}");
    assert_eq!(again.key, Some(key));
    assert_eq!(leader_and_term(&g), (leader, term), "{}", g.logs());
    granary_ok(&["fs", "mkdir", "/after", "--master", &g.addrs()]).unwrap();
}

#[test]
fn only_a_masters_own_certificate_speaks_raft_and_the_group_stays_healthy() {
    if !tls_suite() {
        return;
    }
    let tmp = workdir("granary-ids-raft-");
    let g = MasterGroup::start(tmp.path(), 3, 1000).unwrap();
    let (leader, term) = leader_and_term(&g);
    let follower = g.running_ids().into_iter().find(|&i| i != leader).unwrap();
    let other = g
        .running_ids()
        .into_iter()
        .find(|&i| i != leader && i != follower)
        .unwrap();
    let faddr = g.addr(follower);
    let t = TestTls::get();
    let hostile = term + 100;

    // A worker's certificate: refused by the authorization layer, whatever it claims.
    let e = send(&faddr, &t.identity("node"), leader, follower, hostile).unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(
        e.message()
            .contains("Send needs the master role; test-node (node) does not have it"),
        "{e:?}"
    );
    // A user's and an admin's alike.
    for who in ["user", "admin"] {
        let e = send(&faddr, &t.identity(who), leader, follower, hostile).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{who}: {e:?}");
    }
    // Another master's certificate speaks for its own id only: master `other` may not send
    // as the leader, nor put the leader's id in the messages of a batch of its own.
    let e = send(&faddr, &t.master(other), leader, follower, hostile).unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert_eq!(
        e.message(),
        format!(
            "a raft message from master {leader} refused: the certificate of master-{other} names master {other}"
        )
    );
    let e = rt()
        .block_on(async {
            let mut c = RaftServiceClient::new(channel_as(
                &faddr,
                &t.master(other),
                tls::MASTER_SERVER_NAME,
            ));
            c.send(pb::RaftBatch {
                from: other,
                to: follower,
                messages: vec![heartbeat(leader, follower, hostile).into()],
            })
            .await
        })
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // A snapshot stream is checked the same way (its first message names the sender).
    let e = rt()
        .block_on(async {
            let mut c =
                RaftServiceClient::new(channel_as(&faddr, &t.identity("node"), "granary-master"));
            let first = pb::SnapshotChunk {
                message: heartbeat(leader, follower, hostile).into(),
                ..Default::default()
            };
            c.install_snapshot(futures::stream::iter(vec![first])).await
        })
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");

    // Each refusal is logged by the follower.
    let log = g.log_text(follower);
    assert!(log.contains("request refused"), "{log}");
    assert!(
        log.contains("raft message refused: the sender is not the caller's master id"),
        "{log}"
    );

    // Nothing was stepped: same leader, same term, and the group still commits.
    assert_eq!(leader_and_term(&g), (leader, term), "{}", g.logs());
    granary_ok(&["fs", "mkdir", "/after", "--master", &g.addrs()]).unwrap();
    g.wait_caught_up(Duration::from_secs(30)).unwrap();
    assert_eq!(leader_and_term(&g), (leader, term), "{}", g.logs());
    // The members' own Raft traffic (master certificates of their ids) flows: every
    // member applied the write above.
    for id in g.running_ids() {
        let ls = granary_ok(&["fs", "ls", "/", "--master", &g.addr(id)]).unwrap();
        assert!(ls.lines().any(|l| l == "after"), "master {id}: {ls}");
    }
}

#[test]
fn a_worker_cannot_pose_as_a_master_nor_start_as_one() {
    if !tls_suite() {
        return;
    }
    let tmp = workdir("granary-ids-pose-");
    let root = tmp.path();
    let master = Master::start(root).unwrap();
    let worker = Worker::start(root, "w1", &master.addr, "64MiB").unwrap();
    wait_live_workers(&master.addr, 1).unwrap();
    let t = TestTls::get();

    // A client pointed at the worker's port as its master refuses it at the handshake:
    // the worker's certificate is not a master's.
    let out = granary(&["fs", "ls", "/", "--master", &worker.addr]);
    assert_one_sentence_error(&out, "a worker's port as the master");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("certificate not valid for name \"granary-master\"")
            && err.contains("the server is not a master of this cluster"),
        "not a TLS identity error: {err}"
    );
    let direct = |addr: &str| {
        rt().block_on(async {
            let mut c = MasterServiceClient::new(channel_as(
                addr,
                &t.identity("admin"),
                tls::MASTER_SERVER_NAME,
            ));
            c.get_cluster_info(pb::GetClusterInfoRequest { allow_stale: false })
                .await
        })
    };
    let e = direct(&worker.addr).unwrap_err();
    assert_ne!(
        e.code(),
        tonic::Code::Unimplemented,
        "the worker was reached: {e:?}"
    );
    assert!(
        format!("{e:?}").contains("certificate"),
        "not a certificate error: {e:?}"
    );
    // The real master passes the same check.
    assert_eq!(direct(&master.addr).unwrap().into_inner().workers.len(), 1);

    // What only masters ask of workers is refused to a worker's (and a user's) certificate.
    for who in ["node", "user"] {
        let e = rt()
            .block_on(async {
                let mut c = WorkerServiceClient::new(channel_as(
                    &worker.addr,
                    &t.identity(who),
                    tls::NODE_SERVER_NAME,
                ));
                c.load_blocks(pb::LoadBlocksRequest::default()).await
            })
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{who}: {e:?}");
        assert!(
            e.message().contains("LoadBlocks needs the master role"),
            "{e:?}"
        );
    }

    // A master does not start with a worker's certificate, nor with another master's.
    let data = root.join("m2").to_string_lossy().to_string();
    let node = t.identity("node").to_string_lossy().to_string();
    let out = granary(&[
        "master",
        "--data-dir",
        &data,
        "--listen",
        "127.0.0.1:0",
        "--tls-dir",
        &node,
    ]);
    assert_one_sentence_error(&out, "a master with a worker's certificate");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a master"),
        "{out:?}"
    );
    let m2 = t.master(2).to_string_lossy().to_string();
    let out = granary(&[
        "master",
        "--id",
        "1",
        "--data-dir",
        &data,
        "--listen",
        "127.0.0.1:0",
        "--tls-dir",
        &m2,
    ]);
    assert_one_sentence_error(&out, "master 1 with master 2's certificate");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("but this is master 1 (--id)"),
        "{out:?}"
    );
    assert!(!Path::new(&data).join("meta").exists());

    // `cert issue` keeps the master role and its id together.
    let ca = t.ca().to_string_lossy().to_string();
    let o = root.join("bad").to_string_lossy().to_string();
    for args in [
        &["--role", "master"][..],
        &["--role", "node", "--master-id", "1"][..],
    ] {
        let mut all = vec!["cert", "issue", "x", "--ca-dir", &ca, "--out", &o];
        all.extend_from_slice(args);
        assert_one_sentence_error(&granary(&all), &format!("cert issue {args:?}"));
    }
    let shown = granary_ok(&["cert", "show", "--json", "--tls-dir", &m2]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(v["roles"], serde_json::json!(["master"]));
    assert_eq!(v["master_id"], 2);
}

#[test]
fn control_requests_are_bounded_in_size_and_data_requests_are_not_cut() {
    if !tls_suite() {
        return;
    }
    let tmp = workdir("granary-ids-limits-");
    let root = tmp.path();
    let src = root.join("src");
    random_file(&src.join("big.bin"), 6 << 20).unwrap();
    let master = Master::start(root).unwrap();
    let _worker = Worker::start(root, "w1", &master.addr, "64MiB").unwrap();
    wait_live_workers(&master.addr, 1).unwrap();
    let t = TestTls::get();
    let mkdir = |len: usize| {
        rt().block_on(async {
            let mut c = MasterServiceClient::new(channel_as(
                &master.addr,
                &t.identity("admin"),
                tls::MASTER_SERVER_NAME,
            ))
            .max_encoding_message_size(usize::MAX);
            c.mkdir(pb::MkdirRequest {
                path: format!("/{}", "a".repeat(len)),
                recursive: false,
                mode: 0o755,
                request_id: 0,
            })
            .await
        })
    };
    // 5 MiB in a control request: refused from its header, before the master reads it.
    let e = mkdir(5 << 20).unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e:?}");
    assert!(e.message().contains("message length too large"), "{e:?}");
    // Under the limit, a request is decoded and answered for what it says: a valid mkdir,
    // and 3 MiB of block ids (about 250,000) for their locations.
    mkdir(200).unwrap();
    let r = rt().block_on(async {
        let mut c = MasterServiceClient::new(channel_as(
            &master.addr,
            &t.identity("admin"),
            tls::MASTER_SERVER_NAME,
        ))
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX);
        let blocks = (1..250_000u64)
            .map(|i| pb::BlockId {
                inode: 1 << 40 | i,
                version: 1 << 40,
                index: 0,
            })
            .collect();
        c.get_block_locations(pb::GetBlockLocationsRequest { blocks })
            .await
    });
    if let Err(e) = &r {
        // A cap on the list's length may refuse it, but for its length, not its size.
        assert_ne!(e.code(), tonic::Code::OutOfRange, "{e:?}");
        assert!(!e.message().contains("message length too large"), "{e:?}");
    }
    // The master serves on, and a 6 MiB file goes through the data path (4 MiB write
    // messages, 1 MiB read chunks): uploaded to a mounted folder and read back byte for
    // byte.
    let out_dir = root.join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    mount_local("/d", &out_dir, &master.addr).unwrap();
    let s = format!("file:{}", src.join("big.bin").display());
    granary_ok(&["fs", "cp", &s, "/d/big.bin", "--master", &master.addr]).unwrap();
    let back = root.join("back.bin");
    let b = format!("file:{}", back.display());
    granary_ok(&["fs", "cp", "/d/big.bin", &b, "--master", &master.addr]).unwrap();
    let want = sha256_file(&src.join("big.bin"));
    assert_eq!(
        sha256_file(&out_dir.join("big.bin")),
        want,
        "uploaded other bytes"
    );
    assert_eq!(sha256_file(&back), want, "read back other bytes");
}

fn sha256_file(p: &Path) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(std::fs::read(p).unwrap()))
}

#[test]
fn recursive_syncs_are_limited_per_principal() {
    if !tls_suite() {
        return;
    }
    let tmp = workdir("granary-ids-sync-");
    let root = tmp.path();
    let src = root.join("src");
    for i in 0..40 {
        for j in 0..40 {
            let d = src.join(format!("d{i}/e{j}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("f"), b"x").unwrap();
        }
    }
    let master = Master::start(root).unwrap();
    mount_local("/d", &src, &master.addr).unwrap();
    // Every folder loaded: a recursive sync lists each of them from the folder again.
    let all = granary_ok(&["fs", "ls", "-R", "/d", "--master", &master.addr]).unwrap();
    assert_eq!(all.lines().count(), 40 + 1600 + 1600, "{}", &all[..200]);
    let t = TestTls::get();
    let alice = t
        .issue("alice", &["--role", "user", "--days", "1"])
        .unwrap();
    let ops = t.identity("admin");
    let sync = |who: &Path| {
        let (addr, who) = (master.addr.clone(), who.to_path_buf());
        async move {
            let ch = channel_as(&addr, &who, tls::MASTER_SERVER_NAME);
            let mut c = MasterServiceClient::new(ch);
            c.sync_metadata(pb::SyncMetadataRequest {
                path: "/d".into(),
                recursive: true,
            })
            .await
            .map(|r| r.into_inner())
        }
    };
    // Six at once from alice (and one from the admin meanwhile): beyond two of alice's,
    // RESOURCE_EXHAUSTED; the others complete. Repeated until a round overlaps (each
    // sync lists 1,641 folders, so nearly every round does).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (mine, theirs) = rt().block_on(async {
            let mine = futures::future::join_all((0..6).map(|_| sync(&alice)));
            futures::join!(mine, sync(&ops))
        });
        let ops_sync = theirs.expect("another principal's sync is not held up");
        assert_eq!(ops_sync.dirs_listed, 1641, "{ops_sync:?}");
        let refused: Vec<&tonic::Status> = mine.iter().filter_map(|r| r.as_ref().err()).collect();
        for e in &refused {
            assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
            assert_eq!(
                e.message(),
                "alice already runs 2 recursive metadata syncs at once (the most one principal may); retry when one ends"
            );
        }
        for r in mine.iter().flatten() {
            assert_eq!(r.dirs_listed, 1641, "{r:?}");
        }
        assert!(refused.len() <= 4, "at most 4 of 6 refused: {refused:?}");
        if !refused.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no round ran more than two of alice's syncs at once"
        );
    }
    // Slots are given back: alone, a sync of alice's runs.
    assert_eq!(rt().block_on(sync(&alice)).unwrap().dirs_listed, 1641);
}
