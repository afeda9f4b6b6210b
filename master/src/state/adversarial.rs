//! The adversarial model test: random sequences of every state-machine command, from random
//! principals (admin, users with and without a subtree, a worker, a master), through the same gate
//! the service puts in front of the state machine (the role table of
//! `granary_common::authz` and the subtree rule), applied to the real state machine. The
//! commands the leader proposes itself from under-store listings and job progress carry
//! arbitrary values: a misbehaving store or a buggy leader must not stop the members either.
//!
//! After every step: the apply never fails as a storage failure or an inconsistency (so no
//! master stops), every rule of [`super::invariants`] holds, a refusal says why and changes
//! nothing, and a snapshot of the state restored into a fresh store is the same state.
//!
//! Seeded: a failure prints the seed; `PROPTEST_CASES` and proptest's `PROPTEST_RNG_SEED`
//! replay or widen a run.

use super::keys;
use std::collections::BTreeMap;

use granary_common::authz::allowed_roles;
use granary_common::paths;
use granary_common::tls::{Principal, Role};
use granary_common::ufs::UfsSpec;
use proptest::prelude::*;

use super::jobs::{DoneFile, FailedFile, JobState};
use super::ttl::{Ttl, TtlAction};
use super::*;

fn principals() -> Vec<Principal> {
    vec![
        Principal::new("ops", &[Role::Admin], None),
        Principal::new("team", &[Role::User], None),
        Principal::new("team-a", &[Role::User], Some("/a".into())),
        Principal::new("worker-1", &[Role::Node], None),
        Principal::new("master-2", &[Role::Master], None),
    ]
}

/// Paths: a few names deep, over names that make mount points, their parents and children
/// collide.
fn path() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(vec!["a", "m", "x"]), 0..4)
        .prop_map(|v| format!("/{}", v.join("/")))
}

fn fingerprint() -> impl Strategy<Value = Fingerprint> {
    (
        prop::sample::select(vec!["e1", "e2"]),
        prop_oneof![
            Just(0u64),
            Just(5),
            Just(1 << 20),
            Just(1 << 58),
            any::<u64>()
        ],
    )
        .prop_map(|(etag, size)| Fingerprint {
            etag: etag.into(),
            size,
            mtime_ms: 1,
            version_id: String::new(),
        })
}

fn entry() -> impl Strategy<Value = UfsEntry> {
    (
        prop::sample::select(vec!["a", "b", "m", "x", "..", "", "c/d"]),
        any::<bool>(),
        fingerprint(),
    )
        .prop_map(|(name, dir, fp)| UfsEntry {
            name: name.into(),
            kind: if dir { Kind::Directory } else { Kind::File },
            fingerprint: (!dir).then_some(fp),
        })
}

fn small() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..24, Just(u64::MAX)]
}

fn ttl() -> impl Strategy<Value = Option<Ttl>> {
    prop::option::of((any::<i64>(), any::<bool>()).prop_map(|(t, d)| Ttl {
        expires_ms: t,
        action: if d {
            TtlAction::Delete
        } else {
            TtlAction::Free
        },
    }))
}

fn job_state() -> impl Strategy<Value = JobState> {
    prop::sample::select(vec![
        JobState::Planning,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ])
}

fn persist() -> impl Strategy<Value = Persist> {
    prop::sample::select(vec![
        Persist::Persisted,
        Persist::Pending,
        Persist::NotPersisted,
    ])
}

/// Every command of the state machine.
fn command() -> impl Strategy<Value = Command> {
    prop_oneof![
        4 => (path(), prop::sample::select(vec!["file:///srv/a", "s3://b/p"])).prop_map(|(p, u)| {
            Command::AddMount {
                path: p,
                spec: UfsSpec {
                    uri: u.into(),
                    options: BTreeMap::new(),
                },
                now_ms: 1,
            }
        }),
        2 => path().prop_map(|path| Command::RemoveMount { path }),
        1 => small().prop_map(|worker_id| Command::DecommissionWorker { worker_id }),
        1 => small().prop_map(|worker_id| Command::RecommissionWorker { worker_id }),
        1 => (small(), small(), prop::collection::vec(entry(), 0..4), any::<u64>()).prop_map(
            |(dir, mount_id, entries, block_size)| Command::LoadDir {
                dir,
                mount_id,
                entries,
                now_ms: 1,
                block_size,
            }
        ),
        1 => (
            small(),
            small(),
            prop::collection::vec(entry(), 0..4),
            prop::option::of((
                prop::collection::vec(prop::sample::select(vec!["a".to_string(), "m".into()]), 0..2),
                any::<bool>()
            )),
            prop::option::of(prop::collection::btree_map(
                prop::sample::select(vec!["a".to_string(), "m".into(), "x".into()]),
                small(),
                0..3
            )),
        )
            .prop_map(|(dir, mount_id, entries, batch, seen)| Command::SyncDir {
                dir,
                mount_id,
                entries,
                now_ms: 1,
                block_size: 1 << 20,
                seen,
                batch: batch.map(|(removed, last)| SyncBatch { removed, last }),
            }),
        1 => (small(), small(), entry()).prop_map(|(dir, mount_id, entry)| Command::AddUfsChild {
            dir,
            mount_id,
            entry,
            now_ms: 1,
            block_size: 1 << 20,
        }),
        1 => (small(), fingerprint(), prop::option::of(small())).prop_map(
            |(inode, fingerprint, seen_version)| Command::RefreshFile {
                inode,
                fingerprint,
                seen_version,
            }
        ),
        4 => (path(), any::<bool>(), any::<u32>()).prop_map(|(path, recursive, mode)| {
            Command::Mkdir {
                path,
                recursive,
                mode,
                now_ms: 1,
                owner: None,
            }
        }),
        1 => (path(), any::<bool>(), prop::sample::select(vec![0u64, 1 << 20, 1, u64::MAX]))
            .prop_map(|(path, overwrite, block_size)| Command::CreateFile {
                path,
                mode: 0,
                block_size,
                now_ms: 2,
                overwrite,
                owner: None,
                creator: None,
            }),
        1 => (
            small(),
            prop_oneof![Just(0u64), Just(7), Just(1 << 58), any::<u64>()],
            prop::option::of(fingerprint()),
            prop::option::of(small()),
            persist(),
            small()
        )
            .prop_map(|(inode, length, fingerprint, version, persist, persist_worker)| {
                Command::CompleteFile {
                    inode,
                    length,
                    fingerprint,
                    now_ms: 3,
                    version,
                    persist,
                    persist_worker,
                }
            }),
        1 => (small(), small(), fingerprint(), prop::sample::select(vec!["", "x", "a/b"])).prop_map(
            |(inode, version, fingerprint, p)| Command::FilePersisted {
                inode,
                version,
                fingerprint,
                ufs_path: p.into(),
            }
        ),
        4 => (path(), any::<bool>()).prop_map(|(path, recursive)| Command::Delete { path, recursive }),
        4 => (path(), path()).prop_map(|(src, dst)| Command::Rename { src, dst, now_ms: 4 }),
        1 => (path(), ttl()).prop_map(|(path, ttl)| Command::SetTtl { path, ttl }),
        1 => (small(), ttl()).prop_map(|(inode, was)| Command::EndTtl {
            inode,
            was: was.unwrap_or(Ttl {
                expires_ms: 0,
                action: TtlAction::Free
            }),
        }),
        1 => (path(), prop_oneof![Just(0u32), Just(1), Just(3), any::<u32>()])
            .prop_map(|(path, replicas)| Command::SetPin { path, replicas }),
        1 => (path(), any::<u32>()).prop_map(|(path, replicas)| Command::CreateJob {
            kind: "load".into(),
            path,
            replicas,
            now_ms: 5,
        }),
        1 => (small(), any::<u64>(), any::<u64>()).prop_map(|(id, total_files, total_bytes)| {
            Command::JobPlanned {
                id,
                total_files,
                total_bytes,
            }
        }),
        1 => (
            small(),
            prop::collection::vec((small(), any::<u64>()), 0..3),
            prop::collection::vec(small(), 0..3),
            any::<u64>()
        )
            .prop_map(|(id, done, failed, fetched_bytes)| Command::JobProgress {
                id,
                done: done
                    .into_iter()
                    .map(|(inode, length)| DoneFile { inode, length })
                    .collect(),
                failed: failed
                    .into_iter()
                    .map(|inode| FailedFile {
                        inode,
                        path: "/x".into(),
                        reason: "r".into(),
                    })
                    .collect(),
                fetched_bytes,
            }),
        1 => (small(), job_state()).prop_map(|(id, state)| Command::FinishJob {
            id,
            state,
            error: String::new(),
            now_ms: 6,
        }),
    ]
}

/// The RPC through which a principal's request becomes `cmd`, and the paths it names;
/// `None`: the leader proposes it itself (from listings, lookups, job and TTL progress).
fn rpc_of(cmd: &Command) -> Option<(String, Vec<&str>)> {
    let (name, paths): (&str, Vec<&str>) = match cmd {
        Command::AddMount { path, .. } => ("AddMount", vec![path]),
        Command::RemoveMount { path } => ("RemoveMount", vec![path]),
        Command::DecommissionWorker { .. } => ("DecommissionWorker", vec![]),
        Command::RecommissionWorker { .. } => ("RecommissionWorker", vec![]),
        Command::SetTtl { path, .. } => ("SetTtl", vec![path]),
        Command::SetPin { path, .. } => ("SetPin", vec![path]),
        Command::CreateJob { path, .. } => ("StartJob", vec![path]),
        Command::Mkdir { path, .. } => ("Mkdir", vec![path]),
        Command::CreateFile { path, .. } => ("CreateFile", vec![path]),
        Command::CompleteFile { .. } => ("CompleteFile", vec![]),
        Command::FilePersisted { .. } => ("FilePersisted", vec![]),
        Command::Delete { path, .. } => ("Delete", vec![path]),
        Command::Rename { src, dst, .. } => ("Rename", vec![src, dst]),
        _ => return None,
    };
    Some((format!("/granary.v1.MasterService/{name}"), paths))
}

/// Does the service let `who` propose `cmd`? The role table, then the subtree.
fn admitted(who: &Principal, cmd: &Command) -> bool {
    let Some((rpc, paths_named)) = rpc_of(cmd) else {
        return true;
    };
    let Some(roles) = allowed_roles(&rpc) else {
        return false;
    };
    if !roles.iter().any(|r| who.has(*r)) {
        return false;
    }
    paths_named
        .iter()
        .all(|p| match (&who.subtree, paths::normalize(p)) {
            (None, _) => true,
            (Some(top), Ok(p)) => paths::is_within(&p, top),
            (Some(_), Err(_)) => false,
        })
}

/// The whole `state` column family but the applied index.
fn dump(sm: &StateMachine) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut out = BTreeMap::new();
    let cf = sm.cf().unwrap();
    let mut it = sm.db.raw_iterator_cf(cf);
    it.seek_to_first();
    while it.valid() {
        let (k, v) = (it.key().unwrap(), it.value().unwrap());
        if k != keys::APPLIED {
            out.insert(k.to_vec(), v.to_vec());
        }
        it.next();
    }
    out
}

/// Snapshot file of `sm` restored into a fresh store: the same records.
fn round_trip(sm: &StateMachine, dir: &std::path::Path, step: usize) -> BTreeMap<Vec<u8>, Vec<u8>> {
    use crate::raft::snapshot;
    let cp = dir.join(format!("cp-{step}"));
    let tmp = dir.join(format!("snap-{step}.tmp"));
    let out = dir.join(format!("snap-{step}"));
    snapshot::checkpoint(&sm.db, &cp).unwrap();
    snapshot::write_from_checkpoint(&cp, &tmp, &out).unwrap();
    let (_fresh_dir, fresh) = open_both();
    let tables = snapshot::stage(&out, &dir.join(format!("staging-{step}"))).unwrap();
    snapshot::ingest(&fresh.db, &tables).unwrap();
    let _ = std::fs::remove_file(&out);
    let restored = StateMachine::open(fresh.db.clone()).unwrap();
    assert!(restored.check_invariants(true, 4).unwrap().is_empty());
    dump(&restored)
}

/// A state store with both column families (the snapshot code reads a checkpoint's raft
/// family too).
fn open_both() -> (tempfile::TempDir, StateMachine) {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = rocksdb::Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    let db = Arc::new(
        DB::open_cf(&opts, dir.path(), [CF_STATE, crate::raft::storage::CF_RAFT]).unwrap(),
    );
    (dir, StateMachine::open(db).unwrap())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn no_sequence_of_requests_stops_a_master_or_breaks_a_rule(
        steps in prop::collection::vec((0usize..5, command()), 1..60)
    ) {
        let (dir, sm) = open_both();
        let who = principals();
        for (i, (p, cmd)) in steps.iter().enumerate() {
            let index = i as u64 + 1;
            if !admitted(&who[*p], cmd) {
                continue;
            }
            let before = dump(&sm);
            match sm.apply(index, cmd) {
                Ok(_) => {}
                Err(e) => {
                    prop_assert!(
                        !e.is_local_failure() && !matches!(e, MasterError::Inconsistent { .. }),
                        "step {i}: {cmd:?} from {} stopped the master: {e}", who[*p].name
                    );
                    prop_assert!(!e.to_string().trim().is_empty(), "step {i}: an empty refusal");
                    prop_assert_eq!(&dump(&sm), &before, "step {}: refused {:?} changed the state", i, cmd);
                }
            }
            prop_assert_eq!(sm.applied_index().unwrap(), index);
            let broken = sm.check_invariants(true, 4).unwrap();
            prop_assert!(broken.is_empty(), "step {i}: after {cmd:?} from {}: {broken:?}", who[*p].name);
            // A snapshot now restores exactly this state (every few steps: checkpoints cost).
            if i % 4 == 3 || i + 1 == steps.len() {
                prop_assert_eq!(round_trip(&sm, dir.path(), i), dump(&sm), "step {}: snapshot differs", i);
            }
        }
    }
}

/// The scenario that stopped every master: a mount below a folder, the folder removed by a
/// user, then the mount removed by an admin.
#[test]
fn a_folder_holding_a_mount_point_is_busy_and_the_mount_still_goes() {
    let (_d, sm) = open_both();
    let mut i = 0;
    let mut apply = |cmd: Command| {
        i += 1;
        sm.apply(i, &cmd)
    };
    apply(Command::Mkdir {
        path: "/datasets".into(),
        recursive: true,
        mode: 0,
        now_ms: 1,
        owner: None,
    })
    .unwrap();
    apply(Command::AddMount {
        path: "/datasets/imagenet".into(),
        spec: UfsSpec {
            uri: "file:///srv/imagenet".into(),
            options: BTreeMap::new(),
        },
        now_ms: 1,
    })
    .unwrap();
    for cmd in [
        Command::Delete {
            path: "/datasets".into(),
            recursive: true,
        },
        Command::Delete {
            path: "/datasets/imagenet".into(),
            recursive: true,
        },
        Command::Rename {
            src: "/datasets".into(),
            dst: "/old".into(),
            now_ms: 2,
        },
        Command::Rename {
            src: "/datasets/imagenet".into(),
            dst: "/datasets/in".into(),
            now_ms: 2,
        },
    ] {
        let err = apply(cmd.clone()).unwrap_err();
        assert!(
            matches!(&err, MasterError::Busy { mount, .. } if mount == "/datasets/imagenet"),
            "{cmd:?}: {err:?}"
        );
        let status = tonic::Status::from(err);
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert_eq!(
            status
                .metadata()
                .get(granary_proto::ERRNO_KEY)
                .and_then(|v| v.to_str().ok()),
            Some("16"),
            "EBUSY"
        );
    }
    // An empty folder renamed onto the mount point: busy too.
    apply(Command::Mkdir {
        path: "/datasets/e".into(),
        recursive: false,
        mode: 0,
        now_ms: 1,
        owner: None,
    })
    .unwrap();
    let err = apply(Command::Rename {
        src: "/datasets/e".into(),
        dst: "/datasets/imagenet".into(),
        now_ms: 2,
    })
    .unwrap_err();
    assert!(matches!(err, MasterError::Busy { .. }), "{err:?}");
    apply(Command::RemoveMount {
        path: "/datasets/imagenet".into(),
    })
    .unwrap();
    assert!(sm.check_invariants(true, 4).unwrap().is_empty());
    apply(Command::Delete {
        path: "/datasets".into(),
        recursive: true,
    })
    .unwrap();
}

/// A state an older version left broken (a mount record whose inode is gone): the boot
/// check names it, commands over it fail without stopping the master, `mount remove`
/// repairs it.
#[test]
fn a_broken_state_is_named_and_repaired_by_mount_remove() {
    let (_d, sm) = open_both();
    sm.apply(
        1,
        &Command::AddMount {
            path: "/datasets/imagenet".into(),
            spec: UfsSpec {
                uri: "file:///srv/imagenet".into(),
                options: BTreeMap::new(),
            },
            now_ms: 1,
        },
    )
    .unwrap();
    let mount = sm.mounts().unwrap().remove(0);
    // What `fs rm -R /datasets` used to leave: the inodes gone, the mount record kept.
    let datasets = sm.resolve_loaded("/datasets").unwrap().unwrap();
    let mut txn = Txn::new(&sm);
    txn.remove_subtree(&datasets, true).unwrap();
    txn.commit().unwrap();
    let broken = sm.check_invariants(false, 10).unwrap();
    assert_eq!(broken.len(), 1, "{broken:?}");
    assert_eq!(broken[0].key, format!("m{}", mount.id));
    assert!(
        broken[0].rule.contains("names inode") && broken[0].rule.contains("does not exist"),
        "{}",
        broken[0]
    );
    sm.apply(
        2,
        &Command::RemoveMount {
            path: "/datasets/imagenet".into(),
        },
    )
    .unwrap();
    assert!(sm.mounts().unwrap().is_empty());
    assert!(sm.check_invariants(true, 10).unwrap().is_empty());
    assert_eq!(sm.applied_index().unwrap(), 2);
}
