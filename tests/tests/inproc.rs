//! The in-process tier (`granary_tests::inproc`): masters, workers and the client library
//! in this process, with faults placed on exact calls. Each test runs in seconds; what
//! needs real processes (FUSE, kill -9, TLS between processes, emulators) is elsewhere.

use std::time::Duration;

use anyhow::{Context as _, Result};
use granary_common::net::{Fault, Rule};
use granary_proto as pb;
use granary_tests::inproc::{eventually, Cluster, Node, Shape};

fn names(list: &[pb::FileStatus]) -> Vec<String> {
    let mut v: Vec<String> = list.iter().map(|s| s.name.clone()).collect();
    v.sort();
    v
}

/// The job once it has finished (within a minute).
async fn finished(master: &granary_client::MasterClient, id: u64) -> Result<pb::JobInfo> {
    eventually(
        "the job to finish",
        Duration::from_secs(60),
        || async move {
            let j = master.get_job(id, 10).await.ok()?;
            j.job_state().finished().then_some(j)
        },
    )
    .await
}

type RawMaster =
    granary_proto::master_service_client::MasterServiceClient<granary_common::net::GrpcChannel>;

/// A gRPC client of the first master as the client library reaches it (for requests
/// the library never sends).
fn raw_master(c: &Cluster) -> Result<RawMaster> {
    let ch = c
        .faults(Node::Client)
        .net()
        .channel(c.master_addr(0), granary_common::net::ServerKind::Master)
        .map_err(anyhow::Error::msg)?;
    Ok(granary_proto::master_service_client::MasterServiceClient::new(ch))
}

fn root() -> pb::path_or_id::Target {
    pb::path_or_id::Target::Path("/".into())
}

/// A mutation whose answer is lost after the leader applied it is retried under the
/// same request id and applies once; with the leader stopped, the client finds the new
/// one, and the stopped master catches up when it comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutations_apply_once_when_answers_are_lost_and_survive_a_leader_stop() -> Result<()> {
    let mut c = Cluster::start(Shape {
        masters: 3,
        workers: 0,
        ..Shape::default()
    })
    .await?;
    let fs = c.client()?;
    let lose = c
        .faults(Node::Client)
        .add(Rule::new(Fault::Lose).method("Mkdir").times(3));
    for i in 0..5 {
        fs.master.mkdir(&format!("/d{i}"), false, 0o755).await?;
    }
    assert_eq!(
        c.faults(Node::Client).fired(lose),
        3,
        "the answers were not lost"
    );
    assert_eq!(
        names(&fs.list(root()).await?),
        ["d0", "d1", "d2", "d3", "d4"]
    );
    // The same for the other namespace mutations: each answer lost once.
    let client = c.faults(Node::Client);
    let lost: Vec<_> = ["CreateFile", "Rename", "Delete"]
        .iter()
        .map(|m| client.add(Rule::new(Fault::Lose).method(m).times(1)))
        .collect();
    fs.master.create_file("/d0/f", 0o644, false).await?;
    fs.master.rename("/d0/f", "/d1/g").await?;
    fs.master.delete("/d2", false).await?;
    assert!(lost.iter().all(|r| client.fired(*r) == 1));
    assert_eq!(names(&fs.list(root()).await?), ["d0", "d1", "d3", "d4"]);
    let d1 = pb::path_or_id::Target::Path("/d1".into());
    assert_eq!(names(&fs.list(d1).await?), ["g"]);
    fs.master.mkdir("/d2", false, 0o755).await?;

    let old = c.leader().await?;
    c.stop_master(old).await?;
    fs.master.mkdir("/after", false, 0o755).await?;
    let new = c.leader().await?;
    assert_ne!(new, old);
    assert_eq!(names(&fs.list(root()).await?).len(), 6);

    // The old leader rejoins and catches up: its own applied state lists all six.
    c.start_master(old).await?;
    let rejoined = c.master(old).expect("started").core.clone();
    eventually(
        "the old leader to catch up",
        Duration::from_secs(20),
        || {
            let core = rejoined.clone();
            async move {
                let list = core.namespace().sm.children(1, None, 100).ok()?;
                (list.len() == 6).then_some(())
            }
        },
    )
    .await?;
    c.stop().await
}

/// A worker cut off from the master (its heartbeats dropped, load tasks to it refused)
/// is declared lost, and a load job places its blocks on the workers left instead of
/// failing files: every file ends cached, the job succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_finishes_on_the_workers_left_when_one_is_cut_off() -> Result<()> {
    let c = Cluster::start(Shape {
        masters: 1,
        workers: 3,
        worker_timeout: Duration::from_secs(1),
        ..Shape::default()
    })
    .await?;
    for i in 0..24 {
        std::fs::write(c.store.join(format!("f{i:02}")), vec![i as u8; 100_000])?;
    }
    c.mount_store().await?;
    let cut = c.worker(1).expect("started").addr.to_string();
    let silent = c
        .faults(Node::Worker(1))
        .add(Rule::new(Fault::Drop).method("WorkerHeartbeat"));
    let refused = c.faults(Node::Master(0)).add(
        Rule::new(Fault::Error(tonic::Code::Unavailable))
            .method("LoadBlocks")
            .target(&cut),
    );
    let fs = c.client()?;
    let job = fs.master.start_job(pb::JobKind::Load, "/data", 1).await?;
    let done = finished(&fs.master, job.id).await?;
    assert_eq!(
        (done.job_state(), done.done_files, done.failed_files),
        (pb::JobState::Succeeded, 24, 0),
        "{done:?}"
    );
    assert_eq!(done.state, "succeeded");
    assert!(c.faults(Node::Worker(1)).fired(silent) > 0);
    // Whether a task reached the cut-off worker before it was declared lost depends on
    // timing; what counts is that none of its refusals failed a file.
    let _ = c.faults(Node::Master(0)).fired(refused);
    // Every byte is cached on the two workers left.
    let cached: u64 = [0, 2]
        .iter()
        .map(|&i| c.worker(i).expect("started").store.used())
        .sum();
    assert!(cached >= 24 * 100_000, "{cached} bytes cached");
    c.stop().await
}

/// A load walks its tree a page at a time and feeds the planner as it goes (the files it
/// holds are bounded, whatever the tree): a folder of several listing pages, folders
/// nested below it and an empty one are all loaded, the totals are exact, every byte is
/// fetched once, and a second load of the same tree fetches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_of_folders_bigger_than_a_listing_page_caches_every_file_once() -> Result<()> {
    let c = Cluster::start(Shape {
        masters: 1,
        workers: 2,
        ..Shape::default()
    })
    .await?;
    let mut expected = (0u64, 0u64);
    let mut write = |path: std::path::PathBuf, len: usize| -> Result<()> {
        std::fs::create_dir_all(path.parent().expect("a parent"))?;
        std::fs::write(&path, vec![b'x'; len])?;
        expected.0 += 1;
        expected.1 += len as u64;
        Ok(())
    };
    for i in 0..2_300 {
        write(c.store.join(format!("big/{i:05}")), 1 + i % 700)?;
    }
    for d in ["a", "a/b", "a/b/c", "z"] {
        for i in 0..3 {
            write(c.store.join(format!("{d}/f{i}")), 5_000 + i)?;
        }
    }
    std::fs::create_dir_all(c.store.join("empty"))?;
    c.mount_store().await?;
    let fs = c.client()?;
    let job = fs.master.start_job(pb::JobKind::Load, "/data", 1).await?;
    let done = finished(&fs.master, job.id).await?;
    assert_eq!(
        (done.job_state(), done.failed_files),
        (pb::JobState::Succeeded, 0),
        "{done:?}"
    );
    assert_eq!((done.total_files, done.total_bytes), expected, "{done:?}");
    assert_eq!((done.done_files, done.done_bytes), expected, "{done:?}");
    assert_eq!(done.fetched_bytes, expected.1, "every byte fetched once");
    let again = fs.master.start_job(pb::JobKind::Load, "/data", 1).await?;
    let again = finished(&fs.master, again.id).await?;
    assert_eq!(
        (again.done_files, again.fetched_bytes),
        (expected.0, 0),
        "{again:?}"
    );
    c.stop().await
}

/// A worker is told the pinned files it holds, not the whole pinned namespace: with one
/// replica each pinned file is pinned on the one worker holding it. A file renamed into
/// the pinned folder becomes pinned where it is cached; an unpin empties every set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_are_told_the_pinned_files_they_hold_and_follow_renames_and_unpins() -> Result<()> {
    let c = Cluster::start(Shape {
        masters: 1,
        workers: 2,
        ..Shape::default()
    })
    .await?;
    for i in 0..10 {
        std::fs::create_dir_all(c.store.join("hot"))?;
        std::fs::create_dir_all(c.store.join("cold"))?;
        std::fs::write(c.store.join(format!("hot/h{i}")), vec![1u8; 10_000 + i])?;
        std::fs::write(c.store.join(format!("cold/c{i}")), vec![2u8; 10_000 + i])?;
    }
    c.mount_store().await?;
    let fs = c.client()?;
    let cold = fs
        .master
        .start_job(pb::JobKind::Load, "/data/cold", 1)
        .await?;
    finished(&fs.master, cold.id).await?;
    let pin = fs.master.set_pin("/data/hot", 1).await?;
    assert_eq!(finished(&fs.master, pin.id).await?.done_files, 10);
    let mut hot = std::collections::BTreeSet::new();
    for i in 0..10 {
        hot.insert(fs.stat(&format!("/data/hot/h{i}")).await?.inode);
    }
    let moved = fs.stat("/data/cold/c0").await?.inode;
    let sets = || {
        [0, 1].map(|i| {
            let set = c.worker(i).expect("started").store.pinned();
            set.into_iter().collect::<std::collections::BTreeSet<u64>>()
        })
    };
    // Each hot file on exactly one worker, pinned there only.
    let [a, b] = eventually(
        "the pins to reach the workers",
        Duration::from_secs(20),
        || {
            let [a, b] = sets();
            let union: std::collections::BTreeSet<u64> = a.union(&b).copied().collect();
            let ok = union == hot && a.len() + b.len() == 10;
            async move { ok.then_some([a, b]) }
        },
    )
    .await?;
    assert!(a.is_disjoint(&b), "{a:?} {b:?}");
    fs.master.rename("/data/cold/c0", "/data/hot/c0").await?;
    eventually(
        "the renamed file to be pinned",
        Duration::from_secs(20),
        || {
            let [a, b] = sets();
            async move {
                (a.len() + b.len() == 11 && (a.contains(&moved) || b.contains(&moved)))
                    .then_some(())
            }
        },
    )
    .await?;
    // A load task pins only files it loads: one naming others pins nothing.
    let w0 = c.worker(0).expect("started").addr.to_string();
    let ch = c
        .faults(Node::Client)
        .net()
        .channel(&w0, granary_common::net::ServerKind::Node)
        .map_err(anyhow::Error::msg)?;
    let before = sets();
    granary_proto::worker_service_client::WorkerServiceClient::new(ch)
        .load_blocks(pb::LoadBlocksRequest {
            blocks: vec![],
            holders: vec![],
            pinned_inodes: vec![999_999, u64::MAX, 0],
        })
        .await?;
    assert_eq!(sets(), before);
    fs.master.set_pin("/data/hot", 0).await?;
    eventually(
        "the unpin to reach the workers",
        Duration::from_secs(20),
        || {
            let [a, b] = sets();
            async move { (a.is_empty() && b.is_empty()).then_some(()) }
        },
    )
    .await?;
    c.stop().await
}

/// A TTL set through one leader is acted on by the next: the leader that recorded it is
/// stopped at once, and the file still goes (from the store too) when it is due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_is_acted_on_by_the_next_leader_and_a_retried_pin_loads_once() -> Result<()> {
    let mut c = Cluster::start(Shape {
        masters: 3,
        workers: 1,
        ..Shape::default()
    })
    .await?;
    std::fs::write(c.store.join("old.bin"), b"expires")?;
    std::fs::write(c.store.join("kept.bin"), b"stays")?;
    c.mount_store().await?;
    let fs = c.client()?;
    fs.stat("/data/old.bin").await?;
    fs.master
        .set_ttl("/data/old.bin", 1_500, pb::TtlAction::Delete)
        .await?;
    let old = c.leader().await?;
    c.stop_master(old).await?;
    let gone = c.store.join("old.bin");
    eventually("the TTL's delete", Duration::from_secs(30), || {
        let gone = gone.clone();
        async move { (!gone.exists()).then_some(()) }
    })
    .await?;
    assert_ne!(c.leader().await?, old);
    let err = fs
        .master
        .get_status(pb::path_or_id::Target::Path("/data/old.bin".into()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no such file"), "{err}");
    assert!(c.store.join("kept.bin").exists());

    // A pin whose answer is lost, retried: one pin, one load job.
    let lose = c
        .faults(Node::Client)
        .add(Rule::new(Fault::Lose).method("SetPin").times(1));
    let job = fs.master.set_pin("/data/kept.bin", 1).await?;
    assert_eq!(c.faults(Node::Client).fired(lose), 1);
    let jobs = fs.master.list_jobs().await?;
    let loads: Vec<u64> = jobs
        .iter()
        .filter(|j| j.path == "/data/kept.bin")
        .map(|j| j.id)
        .collect();
    assert_eq!(loads, [job.id], "{jobs:?}");
    c.stop().await
}

/// A re-listing that fails — at once, or part of the way through a listing — leaves what
/// was known of the folder intact and served; the next one that succeeds applies the
/// store's changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_store_leaves_the_known_listing_intact_until_a_sync_succeeds() -> Result<()> {
    use granary_common::ufs::faults::{StoreFault, StoreOp, StoreRule};
    let c = Cluster::start(Shape::default()).await?;
    for name in ["a", "b", "c"] {
        std::fs::write(c.store.join(name), name)?;
    }
    c.mount_store().await?;
    let fs = c.client()?;
    let data = || pb::path_or_id::Target::Path("/data".into());
    assert_eq!(names(&fs.list(data()).await?), ["a", "b", "c"]);
    std::fs::remove_file(c.store.join("b"))?;
    std::fs::write(c.store.join("d"), "d")?;

    for fault in [StoreFault::Unavailable, StoreFault::FailAfter(1)] {
        let rule = c
            .store_faults
            .add(StoreRule::new(StoreOp::List, fault.clone()));
        let synced = fs.master.sync_metadata("/data", false).await?;
        assert_eq!(synced.failures.len(), 1, "{fault:?}: {synced:?}");
        assert!(synced.failures[0].contains("injected"), "{synced:?}");
        assert!(c.store_faults.fired(rule) > 0);
        assert_eq!(names(&fs.list(data()).await?), ["a", "b", "c"], "{fault:?}");
        c.store_faults.remove(rule);
    }
    let synced = fs.master.sync_metadata("/data", false).await?;
    assert!(synced.failures.is_empty(), "{synced:?}");
    assert_eq!(names(&fs.list(data()).await?), ["a", "c", "d"]);
    c.stop().await
}

/// A pin outlives its leader: after the leader that recorded it stops and a worker holding
/// a replica goes, the next leader loads the pinned file again until it is on two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_keeps_its_replicas_across_a_leader_change_and_a_lost_worker() -> Result<()> {
    let mut c = Cluster::start(Shape {
        masters: 3,
        workers: 3,
        ..Shape::default()
    })
    .await?;
    std::fs::create_dir_all(c.store.join("p"))?;
    std::fs::write(c.store.join("p/a"), vec![7u8; 300_000])?;
    c.mount_store().await?;
    let fs = c.client()?;
    let file = fs.stat("/data/p/a").await?;
    let job = fs.master.set_pin("/data/p", 2).await?;
    let done = finished(&fs.master, job.id).await?;
    assert_eq!(done.job_state(), pb::JobState::Succeeded, "{done:?}");
    let holders = |c: &Cluster| -> Vec<usize> {
        (0..3)
            .filter(|&i| {
                c.worker(i)
                    .is_some_and(|w| w.store.holds_version(file.inode, file.version))
            })
            .collect()
    };
    let first = holders(&c);
    assert_eq!(first.len(), 2, "{first:?}");

    let leader = c.leader().await?;
    c.stop_master(leader).await?;
    c.stop_worker(first[0]).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let now = holders(&c);
        if now.len() == 2 {
            assert!(!now.contains(&first[0]));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the pin stayed at {now:?} after worker {} went",
            first[0]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_ne!(c.leader().await?, leader);
    c.stop().await
}

/// Codes no version defines, in the fields that name a job kind or a TTL action, are
/// refused with INVALID_ARGUMENT and change nothing — whatever text comes with them — and
/// the text of an older client still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undefined_kind_and_action_codes_are_refused_and_change_nothing() -> Result<()> {
    let c = Cluster::start(Shape::default()).await?;
    std::fs::write(c.store.join("f"), b"data")?;
    c.mount_store().await?;
    let mut m = raw_master(&c)?;
    for (code, text) in [(99, "free"), (-1, ""), (i32::MAX, "delete")] {
        let err = m
            .set_ttl(pb::SetTtlRequest {
                path: "/data/f".into(),
                ttl_ms: 1_000,
                action: text.into(),
                action_code: code,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{code}: {err:?}");
    }
    for (code, text) in [(42, "load"), (0, "evict"), (0, "")] {
        let err = m
            .start_job(pb::StartJobRequest {
                kind: text.into(),
                kind_code: code,
                path: "/data".into(),
                replicas: 1,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{code}: {err:?}");
    }
    let fs = c.client()?;
    assert!(
        fs.master.list_jobs().await?.is_empty(),
        "a refused job started"
    );
    let st = fs.stat("/data/f").await?;
    assert_eq!(st.ttl_expires_ms, 0, "a refused TTL was set");
    // An older client's text alone.
    let job = m
        .start_job(pb::StartJobRequest {
            kind: "load".into(),
            path: "/data".into(),
            replicas: 1,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_ne!(job.job_state(), pb::JobState::Unspecified);
    assert_eq!(job.kind_code(), pb::JobKind::Load);
    c.stop().await
}

/// A request id replays only the request it was first used for: the same mkdir again
/// answers as the first did; another request reusing the id gets its own checks' error,
/// not the first outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_replays_only_its_own_request() -> Result<()> {
    let c = Cluster::start(Shape::default()).await?;
    let mut m = raw_master(&c)?;
    let mkdir = |path: &str, request_id: u64| pb::MkdirRequest {
        path: path.into(),
        mode: 0o755,
        request_id,
        ..Default::default()
    };
    let first = m.mkdir(mkdir("/r1", 777)).await?.into_inner();
    let again = m.mkdir(mkdir("/r1", 777)).await?.into_inner();
    assert_eq!(first.status.map(|s| s.inode), again.status.map(|s| s.inode));
    let other = m.mkdir(mkdir("/missing/x", 777)).await.unwrap_err();
    assert_eq!(other.code(), tonic::Code::NotFound, "{other:?}");
    let fresh = m.mkdir(mkdir("/r1", 778)).await.unwrap_err();
    assert_eq!(fresh.code(), tonic::Code::AlreadyExists, "{fresh:?}");
    // The first outcome was for /r1: a request for /r2 under its id is another request.
    c.client()?.master.rename("/r1", "/r2").await?;
    let moved = m.mkdir(mkdir("/r2", 777)).await.unwrap_err();
    assert_eq!(moved.code(), tonic::Code::AlreadyExists, "{moved:?}");
    c.stop().await
}

/// Found by `security.rs`'s arbitrary requests (seed 1187739214903341865): an id reused
/// for another request — of another kind, or one whose path is invalid — got the first
/// request's outcome: deleting the root answered OK, and a create whose path held a NUL
/// answered INTERNAL ("inode 9 has no parent": the replayed folder had been removed since).
/// Each request now gets its own checks' answer; a retry after the entry is gone is
/// NOT_FOUND.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_reused_for_another_request_never_gets_the_first_outcome() -> Result<()> {
    let c = Cluster::start(Shape::default()).await?;
    let mut m = raw_master(&c)?;
    fn code<T>(r: Result<tonic::Response<T>, tonic::Status>) -> tonic::Code {
        r.map_or_else(|e| e.code(), |_| tonic::Code::Ok)
    }
    m.mkdir(pb::MkdirRequest {
        path: "/team-a/d".into(),
        recursive: true,
        mode: 0o755,
        request_id: 1,
    })
    .await?;
    let delete = |path: &str, recursive: bool, request_id: u64| pb::DeleteRequest {
        path: path.into(),
        recursive,
        request_id,
    };
    let root = m.delete(delete("/", false, 1)).await;
    assert_eq!(code(root), tonic::Code::InvalidArgument);
    m.delete(delete("/team-a", true, 2)).await?;
    let create = |path: &str, request_id: u64| pb::CreateFileRequest {
        path: path.into(),
        mode: 0o644,
        request_id,
        ..Default::default()
    };
    let nul = m.create_file(create("/team-a/a\0b/m", 1)).await;
    assert_eq!(code(nul), tonic::Code::InvalidArgument);
    // The largest id is an id like any other: the same mkdir under it replays.
    let big = pb::MkdirRequest {
        path: "/big".into(),
        mode: 0o755,
        request_id: u64::MAX,
        ..Default::default()
    };
    let first = m.mkdir(big.clone()).await?.into_inner().status;
    let again = m.mkdir(big).await?.into_inner().status;
    assert_eq!(first.map(|s| s.inode), again.map(|s| s.inode));
    // The same id on a job, a completion and a pin: each its own answer.
    let job = m
        .start_job(pb::StartJobRequest {
            kind_code: pb::JobKind::Load as i32,
            path: "/team-a".into(),
            replicas: 1,
            request_id: 1,
            ..Default::default()
        })
        .await;
    assert_eq!(code(job), tonic::Code::NotFound);
    let pin = m
        .set_pin(pb::SetPinRequest {
            path: "/team-a/d".into(),
            replicas: 1,
            request_id: 1,
        })
        .await;
    assert_eq!(code(pin), tonic::Code::NotFound);
    // A completion retried after its file and folder were removed: NOT_FOUND, not a status
    // built from the removed entry.
    m.mkdir(pb::MkdirRequest {
        path: "/w".into(),
        mode: 0o755,
        ..Default::default()
    })
    .await?;
    let f = m
        .create_file(create("/w/f", 5))
        .await?
        .into_inner()
        .status
        .context("no status")?;
    let complete = pb::CompleteFileRequest {
        inode: f.inode,
        version: f.version,
        length: 0,
        request_id: 6,
        persist_state: pb::PersistState::Persisted as i32,
        ..Default::default()
    };
    let done = m.complete_file(complete.clone()).await;
    assert_eq!(code(done), tonic::Code::Ok);
    let wrong = m
        .complete_file(pb::CompleteFileRequest {
            inode: 1 << 40,
            request_id: 1,
            ..complete.clone()
        })
        .await;
    assert_eq!(code(wrong), tonic::Code::NotFound);
    m.delete(delete("/w", true, 7)).await?;
    let retried = m.complete_file(complete).await;
    assert_eq!(code(retried), tonic::Code::NotFound);
    c.stop().await
}

/// A refused call is a structured error: its code, the path it concerns and the status
/// that caused it, so callers decide by code and never by text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_call_names_its_code_and_path() -> Result<()> {
    use granary_client::ErrorCode;
    let c = Cluster::start(Shape::default()).await?;
    let fs = c.client()?;
    fs.master.mkdir("/here", false, 0o755).await?;
    let cases = [
        (
            fs.master.mkdir("/missing/x", false, 0o755).await.map(drop),
            ErrorCode::NotFound,
            "/missing/x",
            tonic::Code::NotFound,
        ),
        (
            fs.master.mkdir("/here", false, 0o755).await.map(drop),
            ErrorCode::AlreadyExists,
            "/here",
            tonic::Code::AlreadyExists,
        ),
        (
            fs.master
                .get_status(pb::path_or_id::Target::Path("/gone".into()))
                .await
                .map(drop),
            ErrorCode::NotFound,
            "/gone",
            tonic::Code::NotFound,
        ),
        (
            fs.master.rename("/nothing", "/else").await.map(drop),
            ErrorCode::NotFound,
            "/nothing",
            tonic::Code::NotFound,
        ),
    ];
    for (res, code, path, status) in cases {
        let e = res.expect_err(path);
        assert_eq!(
            (e.code(), e.path(), e.status_code()),
            (code, Some(path), Some(status)),
            "{e}"
        );
    }
    c.stop().await
}

/// A file asked for by inode only (as a mount's opens ask) is checked against the store on
/// the mount's `sync_interval` like a lookup of its name: an object replaced in the store
/// shows its new version, whether its folder was listed or only its name looked up. (Found
/// by the under-store acceptance test: the mount served a replaced object's old bytes for
/// as long as a reader kept opening it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_asked_for_by_inode_sees_its_object_replaced_in_the_store() -> Result<()> {
    let c = Cluster::start(Shape::default()).await?;
    std::fs::create_dir_all(c.store.join("listed"))?;
    std::fs::create_dir_all(c.store.join("probed"))?;
    std::fs::write(c.store.join("listed/f"), "old")?;
    std::fs::write(c.store.join("probed/f"), "old")?;
    c.mount_store_with(&[("sync_interval", "1s")]).await?;
    let fs = c.client()?;
    let path = |p: &str| pb::path_or_id::Target::Path(p.into());
    // One folder listed, one only looked into by name (a HEAD of the object).
    assert_eq!(names(&fs.list(path("/data/listed")).await?), ["f"]);
    let mut ids = Vec::new();
    for p in ["/data/listed/f", "/data/probed/f"] {
        let s = fs.master.get_status(path(p)).await?;
        assert_eq!(s.length, 3, "{p}");
        ids.push((p, s.inode, s.version));
    }
    std::fs::write(c.store.join("listed/f"), "new bytes")?;
    std::fs::write(c.store.join("probed/f"), "new bytes")?;
    for (p, inode, old) in ids {
        let master = &fs.master;
        let s = eventually(
            "the replaced object's new version",
            Duration::from_secs(15),
            || async move {
                let s = master
                    .get_status(pb::path_or_id::Target::Inode(inode))
                    .await
                    .ok()?;
                (s.length == 9).then_some(s)
            },
        )
        .await
        .with_context(|| format!("{p} asked for by inode"))?;
        assert_ne!(s.version, old, "{p}: a new object keeps its old version");
    }
    c.stop().await
}

/// A cluster whose store holds `dir/f` ("old"), mounted with a 1 s sync interval, the
/// folder listed once; from now on the store takes 10 s to list (the rule returned).
async fn a_folder_about_to_list_slowly() -> Result<(
    Cluster,
    std::sync::Arc<granary_client::FileSystem>,
    granary_common::ufs::faults::StoreRuleId,
)> {
    use granary_common::ufs::faults::{StoreFault, StoreOp, StoreRule};
    let c = Cluster::start(Shape::default()).await?;
    std::fs::create_dir_all(c.store.join("dir"))?;
    std::fs::write(c.store.join("dir/f"), "old")?;
    c.mount_store_with(&[("sync_interval", "1s")]).await?;
    let fs = c.client()?;
    let dir = pb::path_or_id::Target::Path("/data/dir".into());
    assert_eq!(names(&fs.list(dir).await?), ["f"]);
    let slow = c.store_faults.add(StoreRule::new(
        StoreOp::List,
        StoreFault::Delay(Duration::from_secs(10)),
    ));
    Ok((c, fs, slow))
}

/// A folder's re-listing never holds up requests by inode (a mount's opens): while the
/// store takes 10 s to list the folder, a file of it asked for by inode is answered at once
/// from what is known, and the re-listing's outcome shows when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_relisting_does_not_hold_up_requests_by_inode() -> Result<()> {
    let (c, fs, slow) = a_folder_about_to_list_slowly().await?;
    let path = |p: &str| pb::path_or_id::Target::Path(p.into());
    let inode = fs.master.get_status(path("/data/dir/f")).await?.inode;
    std::fs::write(c.store.join("dir/f"), "new bytes")?;
    let master = &fs.master;
    let by_inode = || async move {
        tokio::time::timeout(
            Duration::from_secs(5),
            master.get_status(pb::path_or_id::Target::Inode(inode)),
        )
        .await
    };
    // Asked until the re-listing is under way (the interval passes first); every answer
    // comes within the 5 s bound, while the listing takes 10.
    let faults = &c.store_faults;
    let by_inode = &by_inode;
    eventually(
        "the slow re-listing to start",
        Duration::from_secs(10),
        || async move {
            let s = by_inode()
                .await
                .expect("a request by inode waited for the re-listing")
                .ok()?;
            assert_eq!(s.length, 3, "{s:?}");
            (faults.fired(slow) > 0).then_some(())
        },
    )
    .await?;
    let s = by_inode()
        .await
        .context("a request by inode waited for the re-listing")??;
    assert_eq!(
        s.length, 3,
        "answered from what is known while the store lists"
    );
    c.store_faults.remove(slow);
    eventually(
        "the re-listing's outcome",
        Duration::from_secs(30),
        || async move {
            let s = by_inode().await.ok()?.ok()?;
            (s.length == 9).then_some(())
        },
    )
    .await?;
    c.stop().await
}

/// A loaded folder whose re-listing is due and slow (10 s) still answers lookups by name,
/// statuses by path and listings at once, from what is known (stale-while-revalidate);
/// the re-listing's outcome shows once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_relisting_does_not_hold_up_lookups_or_listings_of_its_folder() -> Result<()> {
    let (c, fs, slow) = a_folder_about_to_list_slowly().await?;
    let path = |p: &str| pb::path_or_id::Target::Path(p.into());
    let dir = fs.master.get_status(path("/data/dir")).await?.inode;
    std::fs::write(c.store.join("dir/g"), "new")?;
    let master = &fs.master;
    // Every request answers within 5 s, while the listing takes 10.
    let quick = |what: &'static str| async move {
        let bound = Duration::from_secs(5);
        let by_path = tokio::time::timeout(bound, master.get_status(path("/data/dir/f")))
            .await
            .unwrap_or_else(|_| panic!("{what}: a status by path waited for the re-listing"))?;
        assert_eq!(by_path.length, 3);
        let by_name = tokio::time::timeout(bound, master.lookup(dir, "f"))
            .await
            .unwrap_or_else(|_| panic!("{what}: a lookup waited for the re-listing"))?;
        assert_eq!(by_name.inode, by_path.inode);
        let page = tokio::time::timeout(
            bound,
            master.list_page(path("/data/dir"), String::new(), 100, false),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: a listing waited for the re-listing"))?;
        anyhow::Ok(names(&page.entries))
    };
    let faults = &c.store_faults;
    let quick = &quick;
    eventually(
        "the slow re-listing to start",
        Duration::from_secs(10),
        || async move {
            quick("before").await.expect("answered");
            (faults.fired(slow) > 0).then_some(())
        },
    )
    .await?;
    assert_eq!(
        quick("while listing").await?,
        ["f"],
        "answered from what is known"
    );
    c.store_faults.remove(slow);
    eventually(
        "the re-listing's outcome",
        Duration::from_secs(30),
        || async move { (quick("after").await.ok()? == ["f", "g"]).then_some(()) },
    )
    .await?;
    c.stop().await
}

/// A folder whose listing takes longer than its sync interval is not listed again as soon
/// as the interval has passed after it (the store would list it all the time): the next
/// listing waits as long as the last one took. Listings take 4 s here, the interval is 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_slower_to_list_than_its_interval_waits_as_long_as_its_listing_took() -> Result<()>
{
    let (c, fs, slow) = a_folder_about_to_list_slowly().await?;
    c.store_faults.remove(slow);
    let slow = c
        .store_faults
        .add(granary_common::ufs::faults::StoreRule::new(
            granary_common::ufs::faults::StoreOp::List,
            granary_common::ufs::faults::StoreFault::Delay(Duration::from_secs(4)),
        ));
    std::fs::write(c.store.join("dir/g"), "new")?;
    let dir = || pb::path_or_id::Target::Path("/data/dir".into());
    let fs = &fs;
    eventually(
        "the slow re-listing's outcome",
        Duration::from_secs(30),
        || async move { (names(&fs.list(dir()).await.ok()?) == ["f", "g"]).then_some(()) },
    )
    .await?;
    let listed = c.store_faults.fired(slow);
    // Read for 2 s, twice the interval and half the listing's time: no listing starts.
    let until = std::time::Instant::now() + Duration::from_secs(2);
    while std::time::Instant::now() < until {
        fs.list(dir()).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        c.store_faults.fired(slow),
        listed,
        "listed again before as long as its last listing took had passed"
    );
    // It is listed again once that has passed.
    let faults = &c.store_faults;
    eventually(
        "the next re-listing",
        Duration::from_secs(30),
        || async move {
            fs.list(dir()).await.ok()?;
            (faults.fired(slow) > listed).then_some(())
        },
    )
    .await?;
    c.stop().await
}

/// A rename moves a cached file into a pinned folder without any new block report (a file
/// outside mounts keeps its inode, version and blocks): the worker holding it is still
/// told it is pinned, and told again when it moves out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_file_renamed_into_a_pinned_folder_is_pinned_where_it_is_held() -> Result<()> {
    let c = Cluster::start(Shape {
        masters: 1,
        workers: 1,
        ..Shape::default()
    })
    .await?;
    let fs = c.client()?;
    fs.master.mkdir("/scratch", false, 0o755).await?;
    fs.master.mkdir("/keep", false, 0o755).await?;
    let mut w = fs
        .create_writer(
            "/scratch/f",
            0o644,
            false,
            granary_client::WriteMode::MustCache,
            1,
        )
        .await?;
    w.write(0, bytes::Bytes::from(vec![7u8; 100_000])).await?;
    let status = w.close().await?;
    let inode = status.inode;
    let block = pb::BlockId {
        inode,
        version: status.version,
        index: 0,
    };
    let pin = fs.master.set_pin("/keep", 1).await?;
    finished(&fs.master, pin.id).await?;
    let worker = c.worker(0).expect("started");
    let pinned = || worker.store.pinned().contains(&inode);
    // Reported (the heartbeat after the write) and not pinned.
    let fs2 = &fs;
    let block = &block;
    eventually(
        "the file's blocks to be reported",
        Duration::from_secs(20),
        || async move {
            let fs = fs2;
            let l = fs.master.block_locations(vec![*block]).await.ok()?;
            (l.len() == 1 && !l[0].workers.is_empty()).then_some(())
        },
    )
    .await?;
    assert!(!pinned());
    fs.master.rename("/scratch/f", "/keep/f").await?;
    eventually(
        "the moved file to be pinned",
        Duration::from_secs(20),
        || async move { pinned().then_some(()) },
    )
    .await?;
    fs.master.rename("/keep/f", "/scratch/g").await?;
    eventually(
        "the moved-out file to be unpinned",
        Duration::from_secs(20),
        || async move { (!pinned()).then_some(()) },
    )
    .await?;
    c.stop().await
}

/// A writer dropped part-way (a copy whose source failed, a close that timed out) ends its
/// stream without the finish `close` sends: the worker gives the write up instead of
/// caching and uploading the partial file under the file's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_dropped_part_way_uploads_nothing() -> Result<()> {
    let c = Cluster::start(Shape {
        masters: 1,
        workers: 1,
        ..Shape::default()
    })
    .await?;
    c.mount_store().await?;
    let fs = c.client()?;
    let worker = c.worker(0).expect("started");
    let failures = || worker.metrics.write_failures.get();
    for mode in [
        granary_client::WriteMode::CacheThrough,
        granary_client::WriteMode::Through,
    ] {
        let before = failures();
        let name = format!("partial-{}.bin", mode.name());
        let mut w = fs
            .create_writer(&format!("/data/{name}"), 0o644, false, mode, 1)
            .await?;
        w.write(0, bytes::Bytes::from(vec![7u8; 100_000])).await?;
        drop(w);
        eventually(
            "the worker to give the dropped write up",
            Duration::from_secs(20),
            || async move { (failures() > before).then_some(()) },
        )
        .await?;
        assert!(
            !c.store.join(&name).exists(),
            "{name}: a partial file reached the store"
        );
    }
    // A writer closed as it should still writes the file.
    let mut w = fs
        .create_writer(
            "/data/whole.bin",
            0o644,
            false,
            granary_client::WriteMode::CacheThrough,
            1,
        )
        .await?;
    w.write(0, bytes::Bytes::from(vec![7u8; 100_000])).await?;
    w.close().await?;
    assert_eq!(
        std::fs::read(c.store.join("whole.bin"))?,
        vec![7u8; 100_000]
    );
    c.stop().await
}

/// A version not in the under-store (a must-cache write over an object of the store, as
/// an async-through one is until uploaded) whose cached copies cannot be reached is not
/// read from the store: what lies at its path is the object it replaced. The read fails
/// instead of answering the old bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_version_is_never_read_from_the_object_it_replaced() -> Result<()> {
    let mut c = Cluster::start(Shape {
        masters: 1,
        workers: 1,
        ..Shape::default()
    })
    .await?;
    std::fs::write(c.store.join("f.bin"), vec![1u8; 10_000])?;
    c.mount_store().await?;
    let fs = c.client()?;
    assert_eq!(fs.stat("/data/f.bin").await?.length, 10_000);
    let mut w = fs
        .create_writer(
            "/data/f.bin",
            0o644,
            true,
            granary_client::WriteMode::MustCache,
            1,
        )
        .await?;
    w.write(0, bytes::Bytes::from(vec![2u8; 4_000])).await?;
    let written = w.close().await?;
    assert!(written.fingerprint.is_none(), "{written:?}");
    c.stop_worker(0).await?;
    let st = fs.stat("/data/f.bin").await?;
    assert_eq!((st.version, st.length), (written.version, 4_000));
    let e = fs
        .read(&st, 0, st.length)
        .await
        .expect_err("a pending version was read from the store");
    assert!(e.to_string().contains("does not have this version"), "{e}");
    // The store still holds the old object, untouched.
    let old = std::fs::read(c.store.join("f.bin"))?;
    assert!(old.len() == 10_000 && old.iter().all(|b| *b == 1));
    c.stop().await
}

/// A caller touching many due folders at once gets answers at once, but the leader lists
/// at most 16 of them from the store at a time; the others stay due and are listed by a
/// later access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touching_many_due_folders_starts_a_bounded_number_of_listings() -> Result<()> {
    use granary_common::ufs::faults::{StoreFault, StoreOp, StoreRule};
    let c = Cluster::start(Shape::default()).await?;
    for i in 0..24 {
        std::fs::create_dir_all(c.store.join(format!("d{i}")))?;
        std::fs::write(c.store.join(format!("d{i}/f")), "x")?;
    }
    c.mount_store_with(&[("sync_interval", "1s")]).await?;
    let fs = c.client()?;
    let path = |p: String| pb::path_or_id::Target::Path(p);
    for i in 0..24 {
        assert_eq!(names(&fs.list(path(format!("/data/d{i}"))).await?), ["f"]);
    }
    let slow = c.store_faults.add(StoreRule::new(
        StoreOp::List,
        StoreFault::Delay(Duration::from_secs(8)),
    ));
    let ns = c.master(0).expect("started").core.namespace();
    let deferred = || ns.metrics.relists_deferred.get();
    let before = deferred();
    // Every folder due (1 s; the last one listed is the last to be due), then each of the
    // others asked for once, quickly.
    let (fs2, faults) = (&fs, &c.store_faults);
    eventually(
        "the folders to be due",
        Duration::from_secs(10),
        || async move {
            let s = fs2
                .master
                .get_status(path("/data/d23/f".into()))
                .await
                .ok()?;
            (s.length == 1 && faults.fired(slow) > 0).then_some(())
        },
    )
    .await?;
    for i in 0..23 {
        let s = tokio::time::timeout(
            Duration::from_secs(4),
            fs.master.get_status(path(format!("/data/d{i}/f"))),
        )
        .await
        .context("a status waited for a re-listing")??;
        assert_eq!(s.length, 1);
    }
    assert!(
        c.store_faults.fired(slow) <= 16,
        "{} listings at once",
        c.store_faults.fired(slow)
    );
    assert_eq!(deferred() - before, 24 - c.store_faults.fired(slow));
    c.store_faults.remove(slow);
    c.stop().await
}

/// Callers asking at once for a folder to be listed again now (`SyncMetadata`) share
/// listings: each is answered by a listing that started after it asked, so eight callers
/// cost at most two store listings, not eight in a row (a write to the folder would wait
/// behind all of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_syncing_a_folder_at_once_share_its_listings() -> Result<()> {
    use granary_common::ufs::faults::{StoreFault, StoreOp, StoreRule};
    let c = Cluster::start(Shape::default()).await?;
    std::fs::create_dir_all(c.store.join("dir"))?;
    std::fs::write(c.store.join("dir/f"), "x")?;
    c.mount_store_with(&[("sync_interval", "1h")]).await?;
    let fs = c.client()?;
    let dir = pb::path_or_id::Target::Path("/data/dir".into());
    assert_eq!(names(&fs.list(dir.clone()).await?), ["f"]);
    std::fs::write(c.store.join("dir/g"), "y")?;
    let slow = c.store_faults.add(StoreRule::new(
        StoreOp::List,
        StoreFault::Delay(Duration::from_secs(1)),
    ));
    let syncs: Vec<_> = (0..8)
        .map(|_| {
            let fs = fs.clone();
            tokio::spawn(async move { fs.master.sync_metadata("/data/dir", false).await })
        })
        .collect();
    for s in syncs {
        s.await??;
    }
    let listed = c.store_faults.fired(slow);
    assert!(
        (1..=2).contains(&listed),
        "{listed} listings for eight callers at once"
    );
    c.store_faults.remove(slow);
    assert_eq!(names(&fs.list(dir).await?), ["f", "g"]);
    c.stop().await
}

/// Reads every file of `files` whole through a new client (no bytes kept from an earlier
/// pass) and checks them against the source; returns the client's read counters.
async fn read_exact(
    c: &Cluster,
    files: &[(String, Vec<u8>)],
) -> Result<granary_client::fs::ReadStats> {
    use sha2::{Digest, Sha256};
    let fs = c.client()?;
    for (path, want) in files {
        let st = fs.stat(path).await?;
        let got = fs.read(&st, 0, st.length).await?;
        assert_eq!(
            Sha256::digest(&got),
            Sha256::digest(want),
            "{path}: {} bytes read, {} in the store",
            got.len(),
            want.len()
        );
    }
    Ok(fs.read_stats())
}

/// A worker whose cache disk fails keeps serving: while page writes fail it serves every
/// read from the under-store with exact bytes and caches nothing; once the disk heals it
/// caches again; a disk that loses pages at read makes it fetch them again, never serve
/// a lost page. Every byte goes through the worker, none around it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_cache_disk_fails_serves_exact_bytes_and_caches_once_it_heals() -> Result<()>
{
    let c = Cluster::start(Shape::default()).await?;
    std::fs::create_dir_all(c.store.join("d"))?;
    let files: Vec<(String, Vec<u8>)> = (0..6u32)
        .map(|i| {
            let bytes = (0..300_000 + i * 1_001)
                .map(|j| (j.wrapping_mul(31) ^ i) as u8)
                .collect();
            (format!("/data/d/f{i}"), bytes)
        })
        .collect();
    for (i, (_, bytes)) in files.iter().enumerate() {
        std::fs::write(c.store.join(format!("d/f{i}")), bytes)?;
    }
    c.mount_store().await?;
    let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
    let worker = c.worker(0).context("worker 0")?;
    let disk = c.disk(0);
    use std::sync::atomic::Ordering::Relaxed;

    disk.fail_writes.store(true, Relaxed);
    let stats = read_exact(&c, &files).await?;
    assert_eq!((stats.worker_bytes, stats.direct_ufs_bytes), (total, 0));
    let failed = disk.writes_failed.load(Relaxed);
    assert!(failed >= files.len() as u64, "{failed} page writes failed");
    assert_eq!(
        worker.metrics.cache_write_errors.get(),
        failed,
        "each counted"
    );
    assert_eq!(
        worker.store.page_count(),
        0,
        "nothing cached on a failing disk"
    );
    assert_eq!(worker.store.used_and_reserved(), 0, "no room left reserved");

    disk.fail_writes.store(false, Relaxed);
    let stats = read_exact(&c, &files).await?;
    assert_eq!((stats.worker_bytes, stats.direct_ufs_bytes), (total, 0));
    let pages = files.len() as u64; // one page each (1 MiB pages)
    eventually(
        "every file cached once the disk healed",
        Duration::from_secs(10),
        || {
            let n = worker.store.page_count();
            async move { (n == pages).then_some(()) }
        },
    )
    .await?;

    disk.lose_reads.store(true, Relaxed);
    let stats = read_exact(&c, &files).await?;
    assert_eq!((stats.worker_bytes, stats.direct_ufs_bytes), (total, 0));
    assert!(
        disk.reads_lost.load(Relaxed) >= 1,
        "no cached page was read"
    );
    disk.lose_reads.store(false, Relaxed);
    // What was lost was fetched and cached again.
    eventually("lost pages cached again", Duration::from_secs(10), || {
        let n = worker.store.page_count();
        async move { (n == pages).then_some(()) }
    })
    .await?;
    c.stop().await
}

/// A decommissioned worker hands its blocks over without a store read: it turns
/// `draining`, clients stop placing reads on it once their worker list refreshes, the
/// worker that owns its blocks now copies them from it, and once it stops every byte is
/// still served exactly with the store read once in all. Bad input changes nothing.
/// (Moved here from the real-process tier: this is placement logic, not process
/// behaviour; the CLI's wording of the refusals stays checked there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decommissioned_worker_hands_its_blocks_over_without_store_reads() -> Result<()> {
    use granary_client::ErrorCode;
    let mut c = Cluster::start(Shape {
        workers: 2,
        ..Shape::default()
    })
    .await?;
    std::fs::create_dir_all(c.store.join("d"))?;
    let files: Vec<(String, Vec<u8>)> = (0..16u32)
        .map(|i| {
            let bytes = (0..200_000 + i * 37_001)
                .map(|j| (j.wrapping_mul(131) ^ (i * 7)) as u8)
                .collect();
            (format!("/data/d/f{i:02}"), bytes)
        })
        .collect();
    for (path, bytes) in &files {
        std::fs::write(c.store.join(path.trim_start_matches("/data/")), bytes)?;
    }
    c.mount_store().await?;
    let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
    let metrics = |i: usize| c.worker(i).map(|w| w.metrics.clone());
    let (m0, m1) = (metrics(0).context("w0")?, metrics(1).context("w1")?);
    let from_store = || m0.ufs_read_bytes.get() + m1.ufs_read_bytes.get();

    let stats = read_exact(&c, &files).await?;
    assert_eq!((stats.worker_bytes, stats.direct_ufs_bytes), (total, 0));
    assert_eq!(from_store(), total);
    assert!(m0.cache_used_bytes.get() > 0, "w0 owns no block");

    let fs = c.client()?;
    // The master learns where blocks are from heartbeats: a hand-over copies what it knows.
    eventually(
        "the master to know where every block is",
        Duration::from_secs(10),
        || async {
            let info = fs.master.cluster_info(false).await.ok()?;
            let known: u64 = info.workers.iter().map(|w| w.block_count).sum();
            (known == files.len() as u64).then_some(())
        },
    )
    .await?;
    let w0 = c.worker(0).context("w0")?.worker_id;
    // Ids no worker has (0, the largest, a neighbour of a real one) change nothing.
    for id in [0, u64::MAX, w0.wrapping_add(999)] {
        let unknown = fs.master.decommission_worker(id, false).await.unwrap_err();
        assert_eq!(unknown.code(), ErrorCode::NotFound, "{id}: {unknown}");
        let never = fs.master.recommission_worker(id).await.unwrap_err();
        assert_eq!(never.code(), ErrorCode::FailedPrecondition, "{id}: {never}");
    }
    let in_service = fs.master.recommission_worker(w0).await.unwrap_err();
    assert_eq!(
        in_service.code(),
        ErrorCode::FailedPrecondition,
        "{in_service}"
    );
    fs.master.decommission_worker(w0, false).await?;
    let info = fs.master.cluster_info(false).await?;
    let state = info.workers.iter().find(|w| w.worker_id == w0);
    assert_eq!(
        state.map(|w| w.state_code()),
        Some(pb::WorkerState::Draining)
    );
    // The last worker in service is not decommissioned (nothing could take new blocks,
    // writes or loads) unless forced.
    let w1 = c.worker(1).context("w1")?.worker_id;
    let last = fs.master.decommission_worker(w1, false).await.unwrap_err();
    assert_eq!(last.code(), ErrorCode::FailedPrecondition, "{last}");
    assert!(last.to_string().contains("last live worker"), "{last}");

    // Clients place nothing on w0 once their worker list refreshes; w1 copies w0's pages
    // from w0, not from the store.
    eventually("reads to move off w0", Duration::from_secs(20), || {
        let before = m0.read_requests.get();
        let c = &c;
        let files = &files;
        let m0 = &m0;
        async move {
            read_exact(c, files).await.ok()?;
            (m0.read_requests.get() == before).then_some(())
        }
    })
    .await?;
    assert_eq!(from_store(), total, "the hand-over read the store");
    assert!(m1.peer_fill_bytes.get() > 0);
    assert!(m0.peer_served_bytes.get() > 0);

    // Stopped: everything it owned is already on w1; still no store read.
    c.stop_worker(0).await?;
    let stats = read_exact(&c, &files).await?;
    assert_eq!((stats.worker_bytes, stats.direct_ufs_bytes), (total, 0));
    assert_eq!(from_store(), total);
    c.stop().await
}

/// A finished load says where its blocks are at once: the master records the load's own
/// answers, so a stat right after a load that reported 100 % shows every block cached even
/// when no heartbeat has arrived since. (Moved here from the real-process tier, where it
/// waited on an 8 s heartbeat: here the heartbeats are dropped outright.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_load_shows_its_blocks_cached_before_the_next_heartbeat() -> Result<()> {
    let c = Cluster::start(Shape {
        worker_timeout: Duration::from_secs(60),
        ..Shape::default()
    })
    .await?;
    // Every heartbeat from here on is dropped (the files do not exist yet, so none sent
    // before could name their blocks).
    c.faults(Node::Worker(0))
        .add(Rule::new(Fault::Drop).method("WorkerHeartbeat"));
    std::fs::create_dir_all(c.store.join("d"))?;
    let mut files = Vec::new();
    for i in 0..20u64 {
        let len = 10_000 + i * 9_973;
        std::fs::write(
            c.store.join(format!("d/f{i:02}")),
            vec![i as u8; len as usize],
        )?;
        files.push(format!("/data/d/f{i:02}"));
    }
    c.mount_store().await?;
    let fs = c.client()?;
    let job = fs.master.start_job(pb::JobKind::Load, "/data", 1).await?;
    let done = finished(&fs.master, job.id).await?;
    assert_eq!(done.job_state(), pb::JobState::Succeeded, "{done:?}");
    assert_eq!(done.done_files, files.len() as u64, "{done:?}");
    let w0 = c.worker(0).context("worker 0")?.worker_id;
    for path in &files {
        let st = fs.stat(path).await?;
        let block = pb::BlockId {
            inode: st.inode,
            version: st.version,
            index: 0,
        };
        let locations = fs.master.block_locations(vec![block]).await?;
        let holders: Vec<u64> = locations
            .iter()
            .flat_map(|l| l.workers.iter().map(|w| w.worker_id))
            .collect();
        assert_eq!(holders, [w0], "{path}");
    }
    c.stop().await
}

/// A master whose peers refuse a stream of Raft messages (`SendStream`, as a release
/// before it does: PERMISSION_DENIED, the method is not in its table) sends them a call
/// per batch instead: with every stream refused, the
/// group elects, commits, answers at followers and survives its leader's stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masters_send_a_call_per_batch_to_peers_that_refuse_raft_streams() -> Result<()> {
    let mut c = Cluster::start(Shape {
        masters: 3,
        workers: 0,
        ..Shape::default()
    })
    .await?;
    // What an older release answers (its authorization layer does not know the method),
    // and what a server without the method would.
    let codes = [
        tonic::Code::PermissionDenied,
        tonic::Code::Unimplemented,
        tonic::Code::PermissionDenied,
    ];
    let refused: Vec<_> = (0..3)
        .map(|i| {
            c.faults(Node::Master(i))
                .add(Rule::new(Fault::Error(codes[i])).method("SendStream"))
        })
        .collect();
    // Restarted, each opens its streams anew and meets the refusal; the others' streams
    // to it break and are opened anew too.
    for i in 0..3 {
        c.stop_master(i).await?;
        c.start_master(i).await?;
    }
    let fs = c.client()?;
    for i in 0..5 {
        fs.master.mkdir(&format!("/d{i}"), false, 0o755).await?;
    }
    let fired: Vec<u64> = (0..3)
        .map(|i| c.faults(Node::Master(i)).fired(refused[i]))
        .collect();
    assert!(fired.iter().all(|n| *n > 0), "streams refused: {fired:?}");
    assert_eq!(
        names(&fs.list(root()).await?),
        ["d0", "d1", "d2", "d3", "d4"]
    );
    let old = c.leader().await?;
    c.stop_master(old).await?;
    fs.master.mkdir("/after", false, 0o755).await?;
    assert_ne!(c.leader().await?, old);
    assert_eq!(
        names(&fs.list(root()).await?),
        ["after", "d0", "d1", "d2", "d3", "d4"]
    );
    Ok(())
}

/// A folder read at random while uncached is warmed ahead of its reader: after a few misses
/// every other file of it reaches the worker's cache, each fetched from the store once,
/// through `CacheBlocks` streams (one per group of files, not a read each). A worker that
/// does not know `CacheBlocks` (an older one: the call answers UNIMPLEMENTED) gets a read
/// of each file instead, with the same outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_read_at_random_is_warmed_by_cache_blocks_or_by_reads_of_an_older_worker(
) -> Result<()> {
    const FILES: u64 = 150;
    let c = Cluster::start(Shape::default()).await?;
    let mut want = std::collections::HashMap::new();
    for folder in ["new", "old"] {
        std::fs::create_dir_all(c.store.join(folder))?;
        for i in 0..FILES {
            let bytes: Vec<u8> = (0..1_000 + i).map(|b| (b * 7 + i) as u8).collect();
            std::fs::write(c.store.join(format!("{folder}/f{i:03}")), &bytes)?;
            want.insert(format!("/data/{folder}/f{i:03}"), bytes);
        }
    }
    c.mount_store().await?;
    let fs = c.client()?;
    let worker = c.worker(0).context("worker 0")?;
    let gets = || worker.metrics.ufs_requests.get();
    // Out of name order: misses that earn a warm.
    let order = [140u64, 3, 77, 20, 111, 58, 9, 131, 45, 88];
    let warm = |folder: &'static str, fetched_before: u64| {
        let fs = fs.clone();
        let want = &want;
        async move {
            for i in order {
                let path = format!("/data/{folder}/f{i:03}");
                let st = fs.stat(&path).await?;
                let got = fs.read(&st, 0, st.length).await?;
                assert_eq!(got, want[&path], "{path}");
            }
            let warmed = eventually("the folder warmed through", Duration::from_secs(30), || {
                let n = fs.metrics.warm_files.get();
                async move { (n >= fetched_before + FILES).then_some(n) }
            })
            .await?;
            assert_eq!(
                warmed,
                fetched_before + FILES,
                "{folder}: every file warmed once"
            );
            Ok::<_, anyhow::Error>(())
        }
    };
    warm("new", 0).await?;
    assert_eq!(worker.metrics.cache_blocks_asked.get(), FILES);
    assert_eq!(gets(), FILES, "each file fetched from the store once");
    let reads = worker.metrics.read_requests.get();
    assert!(
        reads <= order.len() as u64,
        "{reads} reads: the warm read no file"
    );

    let older = c
        .faults(Node::Client)
        .add(Rule::new(Fault::Error(tonic::Code::Unimplemented)).method("CacheBlocks"));
    warm("old", FILES).await?;
    assert!(c.faults(Node::Client).fired(older) > 0);
    assert_eq!(
        worker.metrics.cache_blocks_asked.get(),
        FILES,
        "no stream reached it"
    );
    assert_eq!(gets(), 2 * FILES, "each file fetched from the store once");
    assert!(worker.metrics.read_requests.get() >= reads + FILES - order.len() as u64);
    // Every file of both folders is cached: reading them all costs no store request.
    for (path, bytes) in &want {
        let st = fs.stat(path).await?;
        assert_eq!(&fs.read(&st, 0, st.length).await?, bytes, "{path}");
    }
    assert_eq!(gets(), 2 * FILES);
    c.stop().await
}

/// A local folder is one listing page, recorded in batches of 2,000 entries of which
/// several are in flight at once through the 3-master group: a folder of 11,001 files (six
/// batches) lists exactly, on every member; a re-listing that removes 4,000 and adds 2,500
/// (batches of removals and additions, in flight together) leaves exactly the store's
/// names; and with the store's listing failing nothing of what was known is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_listed_in_batches_in_flight_together_is_exact_on_every_member() -> Result<()> {
    use granary_common::ufs::faults::{StoreFault, StoreOp, StoreRule};
    let c = Cluster::start(Shape {
        masters: 3,
        workers: 0,
        ..Shape::default()
    })
    .await?;
    let wide = c.store.join("wide");
    std::fs::create_dir_all(&wide)?;
    let mut want: Vec<String> = (0..11_001).map(|i| format!("f{i:05}")).collect();
    for n in &want {
        std::fs::write(wide.join(n), b"")?;
    }
    c.mount_store().await?;
    let fs = c.client()?;
    let target = || pb::path_or_id::Target::Path("/data/wide".into());
    // Each member's own applied state: every name of the store, once.
    let on_every_member = |want: Vec<String>| {
        let cores: Vec<_> = (0..3)
            .map(|i| c.master(i).expect("started").core.clone())
            .collect();
        async move {
            eventually(
                "every member to hold exactly the store's names",
                Duration::from_secs(30),
                || {
                    let (cores, want) = (cores.clone(), want.clone());
                    async move {
                        for core in &cores {
                            let sm = &core.namespace().sm;
                            let dir = sm.child(1, "data").ok()??;
                            let dir = sm.child(dir.id, "wide").ok()??;
                            let mut got: Vec<String> = sm
                                .children(dir.id, None, usize::MAX)
                                .ok()?
                                .into_iter()
                                .map(|i| i.name)
                                .collect();
                            got.sort();
                            if got != want {
                                return None;
                            }
                        }
                        Some(())
                    }
                },
            )
            .await
        }
    };
    assert_eq!(names(&fs.list(target()).await?), want);
    on_every_member(want.clone()).await?;

    for n in want.iter().take(8_000).skip(1).step_by(2) {
        std::fs::remove_file(wide.join(n))?;
    }
    for i in 0..2_500 {
        std::fs::write(wide.join(format!("g{i:05}")), b"")?;
    }
    let store_names = || -> Result<Vec<String>> {
        let mut v: Vec<String> = std::fs::read_dir(&wide)?
            .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_>>()?;
        v.sort();
        Ok(v)
    };
    want = store_names()?;
    assert_eq!(want.len(), 11_001 - 4_000 + 2_500);

    let rule = c
        .store_faults
        .add(StoreRule::new(StoreOp::List, StoreFault::Unavailable));
    let synced = fs.master.sync_metadata("/data/wide", false).await?;
    assert_eq!(synced.failures.len(), 1, "{synced:?}");
    c.store_faults.remove(rule);
    assert_eq!(
        fs.list(target()).await?.len(),
        11_001,
        "a failed re-listing keeps what was known"
    );

    let synced = fs.master.sync_metadata("/data/wide", false).await?;
    assert!(synced.failures.is_empty(), "{synced:?}");
    assert_eq!(names(&fs.list(target()).await?), want);
    on_every_member(want).await?;
    c.stop().await
}

/// A mount removal's purge keeps the files only workers hold (written must-cache) and the
/// folders above them, so that the check made again after the purge refuses the removal
/// (found by a review: a file finished while the purge ran was removed with the rest, and
/// the check after the purge no longer saw it: its only copies were lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_removals_purge_keeps_the_files_only_workers_hold() -> Result<()> {
    use granary_master::purge::PURGE_PAGE;
    let c = Cluster::start(Shape {
        masters: 1,
        workers: 1,
        ..Shape::default()
    })
    .await?;
    let big = PURGE_PAGE as usize + 300;
    for dir in ["big", "big/sub", "big/other"] {
        std::fs::create_dir_all(c.store.join(dir))?;
    }
    std::fs::write(c.store.join("big/f00000"), b"")?;
    for i in 1..big {
        std::fs::hard_link(
            c.store.join("big/f00000"),
            c.store.join(format!("big/f{i:05}")),
        )?;
    }
    for dir in ["big/sub", "big/other"] {
        std::fs::write(c.store.join(format!("{dir}/a")), b"x")?;
    }
    c.mount_store_with(&[("sync_interval", "1h")]).await?;
    let fs = c.client()?;
    let target = |p: &str| pb::path_or_id::Target::Path(p.to_string());
    assert_eq!(fs.list(target("/data/big")).await?.len(), big + 2);
    assert_eq!(fs.list(target("/data/big/sub")).await?.len(), 1);
    assert_eq!(fs.list(target("/data/big/other")).await?.len(), 1);
    // Written must-cache after the removal's first check (as while its purge runs).
    for path in ["/data/big/zz-late", "/data/big/sub/late"] {
        let mut w = fs
            .create_writer(path, 0o644, false, granary_client::WriteMode::MustCache, 1)
            .await?;
        w.write(0, bytes::Bytes::from(vec![7u8; 1000])).await?;
        w.close().await?;
    }
    let core = &c.master(0).context("the master")?.core;
    let sm = &core.namespace().sm;
    let mount = sm.mounts()?.into_iter().find(|m| m.path == "/data");
    let mount = mount.context("the mount")?.id;
    let point = sm.resolve_loaded("/data")?.context("the mount point")?;
    let proposed = core
        .namespace()
        .purge_below(&point, "/data", Some(mount))
        .await?;
    assert!(proposed > big as u64, "{proposed} removals proposed");
    let names = |p: &str| -> Result<Vec<String>> {
        let dir = sm.resolve_loaded(p)?.with_context(|| format!("{p} kept"))?;
        Ok(sm
            .children(dir.id, None, 10)?
            .into_iter()
            .map(|i| i.name)
            .collect())
    };
    assert_eq!(names("/data")?, ["big"]);
    assert_eq!(names("/data/big")?, ["sub", "zz-late"]);
    assert_eq!(names("/data/big/sub")?, ["late"]);
    let e = fs
        .master
        .remove_mount("/data", false)
        .await
        .expect_err("files only workers hold");
    assert!(
        e.message()
            .contains("2 file(s) of the mount at /data are only on workers"),
        "{e}"
    );
    assert_eq!(fs.stat("/data/big/zz-late").await?.length, 1000);
    c.stop().await
}

/// The applied index of every running master, once they all agree (within 60 s).
async fn agreed_applied(c: &Cluster, masters: usize) -> Result<u64> {
    use std::sync::atomic::Ordering::Relaxed;
    eventually(
        "every master at the same index",
        Duration::from_secs(60),
        || async {
            let applied: Vec<u64> = (0..masters)
                .filter_map(|i| c.master(i))
                .map(|m| m.core.raft().status.applied.load(Relaxed))
                .collect();
            (applied.len() == masters && applied.iter().all(|a| *a == applied[0]))
                .then(|| applied[0])
        },
    )
    .await
}

/// A recursive delete of a folder bigger than one apply may change goes in bounded steps
/// on every master (a Raft entry per file of a flat folder, one per small subfolder)
/// and leaves nothing below it on any; a move of a mounted folder holding more than a
/// move may rewrite is refused (`EXDEV`, so `mv` copies) before the store is touched.
/// Before, each was one apply in proportion to the folder on every master: seconds of
/// stall and a gigabyte of memory per master for a million files anyone may create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_folder_is_deleted_in_bounded_steps_and_too_big_a_move_is_refused() -> Result<()> {
    use granary_master::purge::{MAX_MOVE_ENTRIES, PURGE_PAGE};
    let c = Cluster::start(Shape {
        masters: 3,
        workers: 0,
        ..Shape::default()
    })
    .await?;
    // A flat folder of more files than a step; a tree of more entries than a step in
    // small subfolders; a wide tree of more entries than a move.
    let flat = PURGE_PAGE as usize + 2_000;
    let (subfolders, each) = (12usize, 1_000usize);
    let wide = MAX_MOVE_ENTRIES as usize / each + 1;
    let mut dirs = vec![("flat".to_string(), flat)];
    dirs.extend((0..subfolders).map(|d| (format!("tree/d{d:03}"), each)));
    dirs.extend((0..wide).map(|d| (format!("wide/d{d:03}"), each)));
    // Empty files, a folder's as links to its first (an inode each made this test slow).
    for (dir, files) in &dirs {
        std::fs::create_dir_all(c.store.join(dir))?;
        let first = c.store.join(format!("{dir}/f00000"));
        std::fs::write(&first, b"")?;
        for i in 1..*files {
            std::fs::hard_link(&first, c.store.join(format!("{dir}/f{i:05}")))?;
        }
    }
    // A big folder nobody listed: the delete lists it, then purges (found by a review: the
    // purge was judged on what was listed before, and the delete was one apply again).
    let late = PURGE_PAGE as usize + 500;
    std::fs::create_dir_all(c.store.join("late"))?;
    std::fs::write(c.store.join("late/f00000"), b"")?;
    for i in 1..late {
        std::fs::hard_link(
            c.store.join("late/f00000"),
            c.store.join(format!("late/f{i:05}")),
        )?;
    }
    // Listed when asked only: no re-listing of its own adds entries to those counted.
    c.mount_store_with(&[("sync_interval", "1h")]).await?;
    let fs = c.client()?;
    let path = |p: &str| pb::path_or_id::Target::Path(format!("/data/{p}"));
    assert_eq!(fs.list(path("tree")).await?.len(), subfolders);
    assert_eq!(fs.list(path("wide")).await?.len(), wide);
    for (dir, files) in &dirs {
        assert_eq!(fs.list(path(dir)).await?.len(), *files, "{dir}");
    }

    // A big folder holding a mount point is refused before anything changes (found by a
    // review: the purge removed what was beside the mount, then the delete was refused).
    let second = c.store.join("second");
    std::fs::create_dir_all(&second)?;
    std::fs::write(second.join("f00000"), b"")?;
    for i in 1..=PURGE_PAGE {
        std::fs::hard_link(second.join("f00000"), second.join(format!("f{i:05}")))?;
    }
    fs.master.mkdir("/outer/keep", true, 0o755).await?;
    let uri = format!("file://{}", second.display());
    fs.master.add_mount("/outer/m", &uri, Vec::new()).await?;
    let in_second = |p: &str| pb::path_or_id::Target::Path(format!("/outer/{p}"));
    assert_eq!(
        fs.list(in_second("m")).await?.len(),
        PURGE_PAGE as usize + 1
    );
    let e = fs
        .master
        .delete("/outer", true)
        .await
        .expect_err("a folder holding a mount point");
    assert_eq!(
        e.code(),
        granary_client::ErrorCode::Posix(libc::EBUSY),
        "{e}"
    );
    let outer = pb::path_or_id::Target::Path("/outer".into());
    assert_eq!(names(&fs.list(outer).await?), ["keep", "m"]);
    assert_eq!(
        fs.list(in_second("m")).await?.len(),
        PURGE_PAGE as usize + 1
    );

    let e = fs
        .master
        .rename("/data/wide", "/data/moved")
        .await
        .expect_err("a move of more entries than one apply may rewrite");
    assert_eq!(
        e.code(),
        granary_client::ErrorCode::Posix(libc::EXDEV),
        "{e}"
    );
    assert!(e.message().contains("more than 100000 entries"), "{e}");
    assert!(c.store.join("wide/d100/f00999").exists() && !c.store.join("moved").exists());
    assert_eq!(fs.stat("/data/wide/d100/f00999").await?.length, 0);
    // A move of a smaller folder is one apply, as before.
    fs.master.rename("/data/wide/d000", "/data/moved").await?;
    assert_eq!(fs.list(path("moved")).await?.len(), each);

    for (path, steps) in [
        // A file a step (the folder holds no subfolder to take whole), then the folder.
        ("/data/flat", flat as u64 + 1),
        // A subfolder a step, then the folder.
        ("/data/tree", subfolders as u64 + 1),
    ] {
        let before = agreed_applied(&c, 3).await?;
        fs.master.delete(path, true).await?;
        let applied = agreed_applied(&c, 3).await? - before;
        // A new leader's first entry, should the test machine be slow enough for one.
        assert!(
            (steps..=steps + 6).contains(&applied),
            "{path}: {applied} Raft entries applied for the delete, {steps} expected"
        );
        for i in 0..3 {
            let sm = &c.master(i).context("a master")?.core.namespace().sm;
            assert!(
                sm.resolve_loaded(path)?.is_none(),
                "master {i} keeps {path}"
            );
        }
    }
    assert!(!c.store.join("flat").exists() && !c.store.join("tree").exists());
    let before = agreed_applied(&c, 3).await?;
    fs.master.delete("/data/late", true).await?;
    let applied = agreed_applied(&c, 3).await? - before;
    // The listing's batches, then a file a step, then the folder.
    assert!(
        applied > late as u64,
        "/data/late: {applied} Raft entries applied for the delete, more than {late} expected"
    );
    assert!(!c.store.join("late").exists());
    for i in 0..3 {
        let sm = &c.master(i).context("a master")?.core.namespace().sm;
        assert!(sm.resolve_loaded("/data/late")?.is_none(), "master {i}");
    }
    // A big folder deleted in the store by other means: the re-listing that finds it gone
    // removes what was cached below it in the same steps (a subfolder each; d000 moved).
    std::fs::remove_dir_all(c.store.join("wide"))?;
    let before = agreed_applied(&c, 3).await?;
    // A listing cut short by a leader change (a loaded test machine) is asked for again:
    // what was removed stays removed.
    for attempt in 1.. {
        let synced = fs.master.sync_metadata("/data", false).await?;
        if synced.failures.is_empty() {
            break;
        }
        assert!(attempt < 3, "{:?}", synced.failures);
    }
    let applied = agreed_applied(&c, 3).await? - before;
    assert!(
        (wide as u64 - 1..=wide as u64 + 6).contains(&applied),
        "{applied} Raft entries applied for the re-listing, {} expected",
        wide
    );
    for i in 0..3 {
        let sm = &c.master(i).context("a master")?.core.namespace().sm;
        assert!(
            sm.resolve_loaded("/data/wide")?.is_none(),
            "master {i} keeps /data/wide"
        );
        let point = sm.resolve_loaded("/data")?.context("the mount point")?;
        let kept: Vec<String> = sm
            .children(point.id, None, 10)?
            .into_iter()
            .map(|i| i.name)
            .collect();
        assert_eq!(kept, ["moved", "second"], "master {i}");
    }
    c.stop().await
}
