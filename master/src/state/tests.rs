use super::keys;
use std::collections::{BTreeMap, HashMap};

use granary_common::ufs::UfsSpec;

use super::*;

pub(super) fn open() -> (tempfile::TempDir, StateMachine) {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = rocksdb::Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    let db = Arc::new(DB::open_cf(&opts, dir.path(), [CF_STATE]).unwrap());
    let sm = StateMachine::open(db).unwrap();
    (dir, sm)
}

fn spec(uri: &str) -> UfsSpec {
    UfsSpec {
        uri: uri.into(),
        options: BTreeMap::new(),
    }
}

/// `file:///a` mounted at `path` (the first applied entry).
fn mounted(sm: &StateMachine, path: &str) -> Mount {
    let out = sm.apply(
        1,
        &Command::AddMount {
            path: path.into(),
            spec: spec("file:///a"),
            now_ms: 1,
        },
    );
    match out {
        Ok(ApplyOutput::Mount(m)) => m,
        other => panic!("mounting {path}: {other:?}"),
    }
}

fn file(name: &str, size: u64) -> UfsEntry {
    UfsEntry {
        name: name.into(),
        kind: Kind::File,
        fingerprint: Some(Fingerprint {
            etag: format!("etag-{name}"),
            size,
            mtime_ms: 1,
            version_id: String::new(),
        }),
    }
}

#[test]
fn mounts_refuse_nesting_and_duplicates() {
    let (_d, sm) = open();
    let out = sm
        .apply(
            1,
            &Command::AddMount {
                path: "/data/s3".into(),
                spec: spec("file:///a"),
                now_ms: 1,
            },
        )
        .unwrap();
    let ApplyOutput::Mount(m) = out else { panic!() };
    assert_eq!(m.path, "/data/s3");
    // The parent was created as a plain directory.
    assert!(sm.resolve_loaded("/data").unwrap().is_some());
    for (i, p) in ["/data/s3/x", "/data", "/"].iter().enumerate() {
        let err = sm
            .apply(
                2 + i as u64,
                &Command::AddMount {
                    path: p.to_string(),
                    spec: spec("file:///b"),
                    now_ms: 1,
                },
            )
            .unwrap_err();
        assert!(
            matches!(err, MasterError::FailedPrecondition { .. }),
            "{p}: {err:?}"
        );
    }
    let err = sm
        .apply(
            9,
            &Command::AddMount {
                path: "/data/s3".into(),
                spec: spec("file:///b"),
                now_ms: 1,
            },
        )
        .unwrap_err();
    assert!(matches!(err, MasterError::AlreadyExists { .. }));
    assert_eq!(sm.mounts().unwrap().len(), 1);
    assert_eq!(sm.applied_index().unwrap(), 9);
}

#[test]
fn load_dir_is_idempotent_and_counts_inodes() {
    let (_d, sm) = open();
    let ApplyOutput::Mount(m) = sm
        .apply(
            1,
            &Command::AddMount {
                path: "/".into(),
                spec: spec("file:///a"),
                now_ms: 1,
            },
        )
        .unwrap()
    else {
        panic!()
    };
    let load = Command::LoadDir {
        dir: ROOT_INODE,
        mount_id: m.id,
        entries: vec![
            file("a", 3),
            file("b", 0),
            UfsEntry {
                name: "sub".into(),
                kind: Kind::Directory,
                fingerprint: None,
            },
        ],
        now_ms: 1,
        block_size: 1 << 20,
    };
    sm.apply(2, &load).unwrap();
    sm.apply(3, &load).unwrap();
    assert_eq!(sm.inode_count().unwrap(), 4);
    let a = sm.resolve_loaded("/a").unwrap().unwrap();
    assert_eq!(a.length, 3);
    assert_eq!(a.ufs_path, "a");
    assert_ne!(a.version, 0);
    let names: Vec<String> = sm
        .children(ROOT_INODE, None, 10)
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(names, ["a", "b", "sub"]);
    let page: Vec<String> = sm
        .children(ROOT_INODE, Some("a"), 1)
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(page, ["b"]);
    // Removing the root mount empties the namespace but keeps the root.
    sm.apply(4, &Command::RemoveMount { path: "/".into() })
        .unwrap();
    assert_eq!(sm.inode_count().unwrap(), 1);
    assert!(sm.children(ROOT_INODE, None, 10).unwrap().is_empty());
    assert!(sm.mounts().unwrap().is_empty());
}

#[test]
fn namespace_mutations_outside_mounts() {
    let (_d, sm) = open();
    sm.apply(
        1,
        &Command::Mkdir {
            path: "/a/b".into(),
            recursive: true,
            mode: 0,
            now_ms: 1,
            owner: None,
        },
    )
    .unwrap();
    let err = sm
        .apply(
            2,
            &Command::Mkdir {
                path: "/x/y".into(),
                recursive: false,
                mode: 0,
                now_ms: 1,
                owner: None,
            },
        )
        .unwrap_err();
    assert!(matches!(err, MasterError::NotFound { .. }));
    let ApplyOutput::Inode(f) = sm
        .apply(
            3,
            &Command::CreateFile {
                path: "/a/b/f".into(),
                mode: 0,
                block_size: 0,
                now_ms: 1,
                overwrite: false,
                owner: None,
                creator: None,
            },
        )
        .unwrap()
    else {
        panic!()
    };
    assert!(!f.complete);
    sm.apply(
        4,
        &Command::CompleteFile {
            inode: f.id,
            length: 10,
            fingerprint: None,
            now_ms: 2,
            version: None,
            persist: Persist::Persisted,
            persist_worker: 0,
        },
    )
    .unwrap();
    let err = sm
        .apply(
            5,
            &Command::Delete {
                path: "/a".into(),
                recursive: false,
            },
        )
        .unwrap_err();
    assert!(matches!(err, MasterError::NotEmpty { .. }));
    sm.apply(
        6,
        &Command::Rename {
            src: "/a/b".into(),
            dst: "/c".into(),
            now_ms: 3,
        },
    )
    .unwrap();
    assert_eq!(sm.resolve_loaded("/c/f").unwrap().unwrap().length, 10);
    let err = sm
        .apply(
            7,
            &Command::Rename {
                src: "/c".into(),
                dst: "/c/d".into(),
                now_ms: 3,
            },
        )
        .unwrap_err();
    assert!(matches!(err, MasterError::InvalidArgument { .. }));
    sm.apply(
        8,
        &Command::Delete {
            path: "/c".into(),
            recursive: true,
        },
    )
    .unwrap();
    assert!(sm.resolve_loaded("/c").unwrap().is_none());
    assert_eq!(sm.inode_count().unwrap(), 2); // root + /a
}

#[test]
fn watchers_hear_which_inodes_each_applied_entry_changed() {
    let (_d, sm) = open();
    let mut rx = sm.watch();
    let mkdir = |path: &str, recursive: bool| Command::Mkdir {
        path: path.into(),
        recursive,
        mode: 0,
        now_ms: 1,
        owner: None,
    };
    sm.apply(1, &mkdir("/a", true)).unwrap();
    let a = sm.resolve_loaded("/a").unwrap().unwrap().id;
    let c = rx.try_recv().unwrap();
    assert_eq!((c.index, c.reset), (1, false));
    // The new folder and the folder that got an entry.
    assert_eq!(&*c.inodes, &[ROOT_INODE, a]);
    // A failed command changes nothing and announces nothing.
    sm.apply(2, &mkdir("/x/y", false)).unwrap_err();
    assert!(rx.try_recv().is_err());
    // A rename: the entry, both folders.
    sm.apply(3, &mkdir("/b", true)).unwrap();
    let b = sm.resolve_loaded("/b").unwrap().unwrap().id;
    rx.try_recv().unwrap();
    sm.apply(
        4,
        &Command::Rename {
            src: "/a".into(),
            dst: "/b/a".into(),
            now_ms: 2,
        },
    )
    .unwrap();
    let c = rx.try_recv().unwrap();
    assert_eq!(c.index, 4);
    let mut want = [ROOT_INODE, a, b];
    want.sort_unstable();
    assert_eq!(&*c.inodes, &want[..]);
    sm.announce_reset(9);
    assert!(rx.try_recv().unwrap().reset);
}

#[test]
fn writes_inside_mounts_keep_store_paths_and_persistence() {
    let (_d, sm) = open();
    let mut n = 0;
    let mut apply = |cmd: Command| {
        n += 1;
        sm.apply(n, &cmd)
    };
    apply(Command::AddMount {
        path: "/m".into(),
        spec: spec("file:///a"),
        now_ms: 1,
    })
    .unwrap();
    let Ok(ApplyOutput::Inode(d)) = apply(Command::Mkdir {
        path: "/m/x/y".into(),
        recursive: true,
        mode: 0,
        now_ms: 1,
        owner: None,
    }) else {
        panic!()
    };
    assert_eq!(
        (d.mount_id, d.ufs_path.as_str(), d.created),
        (Some(1), "x/y", true)
    );
    let create = |path: &str, overwrite: bool| Command::CreateFile {
        path: path.into(),
        mode: 0,
        block_size: 0,
        now_ms: 5,
        overwrite,
        owner: None,
        creator: None,
    };
    let Ok(ApplyOutput::Inode(f)) = apply(create("/m/x/y/ckpt", false)) else {
        panic!()
    };
    assert_eq!(f.ufs_path, "x/y/ckpt");
    assert!(!f.complete && f.version != 0);
    // Pending: cached on worker 7, not in the store yet.
    let Ok(ApplyOutput::Inode(f)) = apply(Command::CompleteFile {
        inode: f.id,
        length: 100,
        fingerprint: None,
        now_ms: 6,
        version: Some(f.version),
        persist: Persist::Pending,
        persist_worker: 7,
    }) else {
        panic!()
    };
    assert_eq!(
        (f.persist, f.persist_worker, f.length),
        (Persist::Pending, 7, 100)
    );
    // A listing of x that shows nothing keeps the made directory and the pending file.
    let x = sm.resolve_loaded("/m/x").unwrap().unwrap();
    apply(Command::SyncDir {
        dir: x.id,
        mount_id: 1,
        entries: vec![],
        now_ms: 10_000_000,
        block_size: 0,
        seen: None,
        batch: None,
    })
    .unwrap();
    let y = sm.resolve_loaded("/m/x/y").unwrap().unwrap();
    apply(Command::SyncDir {
        dir: y.id,
        mount_id: 1,
        entries: vec![],
        now_ms: 10_000_000,
        block_size: 0,
        seen: None,
        batch: None,
    })
    .unwrap();
    assert!(sm.resolve_loaded("/m/x/y/ckpt").unwrap().is_some());
    // Moving the directory moves the store paths below it.
    apply(Command::Rename {
        src: "/m/x".into(),
        dst: "/m/z".into(),
        now_ms: 7,
    })
    .unwrap();
    let f2 = sm.resolve_loaded("/m/z/y/ckpt").unwrap().unwrap();
    assert_eq!((f2.id, f2.ufs_path.as_str()), (f.id, "z/y/ckpt"));
    // An upload recorded for the old path is stale; for the new one it is kept, and the
    // version stays (cached pages stay valid).
    let fp = Fingerprint {
        etag: "\"e1\"".into(),
        size: 100,
        mtime_ms: 8,
        version_id: String::new(),
    };
    let persisted = |path: &str| Command::FilePersisted {
        inode: f.id,
        version: f.version,
        fingerprint: fp.clone(),
        ufs_path: path.into(),
    };
    assert_eq!(apply(persisted("x/y/ckpt")).unwrap(), ApplyOutput::None);
    let Ok(ApplyOutput::Inode(p)) = apply(persisted("z/y/ckpt")) else {
        panic!()
    };
    assert_eq!((p.persist, p.version), (Persist::Persisted, f.version));
    assert_eq!(p.fingerprint, Some(fp));
    // Replacing it keeps the inode, with a new version.
    let Ok(ApplyOutput::Inode(r)) = apply(create("/m/z/y/ckpt", true)) else {
        panic!()
    };
    assert_eq!(r.id, f.id);
    assert_ne!(r.version, f.version);
    assert!(!r.complete);
    assert!(matches!(
        apply(create("/m/z/y/ckpt", false)),
        Err(MasterError::AlreadyExists { .. })
    ));
    // Completing with the replaced version is refused.
    assert!(matches!(
        apply(Command::CompleteFile {
            inode: f.id,
            length: 1,
            fingerprint: None,
            now_ms: 9,
            version: Some(f.version),
            persist: Persist::Persisted,
            persist_worker: 0,
        }),
        Err(MasterError::FailedPrecondition { .. })
    ));
    // Out of the mount, and the mount point itself: refused, nothing changed.
    assert!(matches!(
        apply(Command::Rename {
            src: "/m/z".into(),
            dst: "/elsewhere".into(),
            now_ms: 9,
        }),
        Err(MasterError::CrossMount { .. })
    ));
    assert!(matches!(
        apply(Command::Delete {
            path: "/m".into(),
            recursive: true,
        }),
        Err(MasterError::Busy { .. })
    ));
    assert!(sm.resolve_loaded("/m/z/y/ckpt").unwrap().is_some());
}

fn mkdir_cmd(path: &str) -> Command {
    Command::Mkdir {
        path: path.into(),
        recursive: false,
        mode: 0o755,
        now_ms: 5,
        owner: None,
    }
}

#[test]
fn a_retried_request_returns_its_first_outcome_and_applies_once() {
    let (_d, sm) = open();
    let p = |rid, path: &str| Proposal {
        request_id: rid,
        at_ms: 1_000_000,
        cmd: mkdir_cmd(path),
    };
    let first = sm.apply_request(1, &p(42, "/a")).unwrap();
    let count = sm.inode_count().unwrap();
    // The retry (e.g. after a leader change) succeeds with the same inode, changing nothing.
    assert_eq!(sm.apply_request(2, &p(42, "/a")).unwrap(), first);
    assert_eq!(sm.inode_count().unwrap(), count);
    assert_eq!(sm.applied_index().unwrap(), 2);
    // Without the id, the same command is a second, failing mkdir.
    assert!(matches!(
        sm.apply_request(3, &p(0, "/a")),
        Err(MasterError::AlreadyExists { .. })
    ));
    // A remembered failure stays the answer even once the command could succeed.
    let err = sm.apply_request(4, &p(7, "/x/y")).unwrap_err();
    assert!(matches!(err, MasterError::NotFound { .. }));
    sm.apply_request(5, &p(8, "/x")).unwrap();
    assert_eq!(sm.apply_request(6, &p(7, "/x/y")).unwrap_err(), err);
    assert!(sm.resolve_loaded("/x/y").unwrap().is_none());
}

#[test]
fn remembered_outcomes_expire_after_the_retention() {
    let (_d, sm) = open();
    let at = |ms| Proposal {
        request_id: 0,
        at_ms: ms,
        cmd: mkdir_cmd("/unused"),
    };
    let mut old = at(1_000);
    old.request_id = 11;
    old.cmd = mkdir_cmd("/old");
    sm.apply_request(1, &old).unwrap();
    assert!(sm.get(&keys::request(11)).unwrap().is_some());
    let mut later = at(1_000 + REQUEST_RETENTION_MS + 1);
    later.request_id = 12;
    later.cmd = mkdir_cmd("/new");
    sm.apply_request(2, &later).unwrap();
    assert!(sm.get(&keys::request(11)).unwrap().is_none(), "not pruned");
    assert!(sm.get(&keys::request(12)).unwrap().is_some());
}

/// Skipping the scan for outcomes past their retention (while the oldest kept is known to
/// be within it) forgets exactly what a scan on every request forgets: one state machine
/// applies requests with clocks that jump forward, sometimes past the retention, and
/// sometimes back (leaders' clocks differ); the other forgets what it knows before each
/// request (so it scans every time). Both remember the same outcomes after every step.
#[test]
fn skipping_the_retention_scan_forgets_what_a_scan_would() {
    use rand::{Rng, SeedableRng};
    let ((_a, sm), (_b, scans)) = (open(), open());
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut at_ms = 1_000_i64;
    let remembered = |sm: &StateMachine| {
        let mut it = sm.db.raw_iterator_cf(sm.cf().unwrap());
        it.seek(b"q");
        let mut ids = Vec::new();
        while let Some(k) = it.key().filter(|k| k[0] == b'q') {
            ids.push(k.to_vec());
            it.next();
        }
        ids
    };
    for i in 1..=400u64 {
        at_ms += match rng.gen_range(0..20) {
            0 => REQUEST_RETENTION_MS / 2,
            1 => -rng.gen_range(0..60_000),
            _ => rng.gen_range(0..20_000),
        };
        let p = Proposal {
            request_id: i,
            at_ms,
            cmd: mkdir_cmd(&format!("/d{i}")),
        };
        sm.apply_request(i, &p).unwrap();
        scans.forget_cached();
        scans.apply_request(i, &p).unwrap();
        assert_eq!(
            remembered(&sm),
            remembered(&scans),
            "after request {i} at {at_ms}"
        );
    }
    assert!(remembered(&sm).len() < 400, "nothing was forgotten");
}

#[test]
fn entries_from_before_request_ids_still_decode() {
    let bare = serde_json::to_vec(&mkdir_cmd("/a")).unwrap();
    let p = Proposal::decode(&bare).unwrap();
    assert_eq!(p.request_id, 0);
    assert_eq!(p.cmd, mkdir_cmd("/a"));
}

#[test]
fn sync_dir_adds_removes_and_reversions_without_touching_unchanged_entries() {
    let (_d, sm) = open();
    let m = mounted(&sm, "/m");
    let dir = |name: &str| UfsEntry {
        name: name.into(),
        kind: Kind::Directory,
        fingerprint: None,
    };
    let sync = |entries: Vec<UfsEntry>| Command::SyncDir {
        dir: m.inode,
        mount_id: m.id,
        entries,
        now_ms: 2,
        block_size: 1 << 20,
        seen: None,
        batch: None,
    };
    // On a directory never loaded, a sync is a load.
    sm.apply(
        2,
        &sync(vec![
            file("keep", 3),
            file("change", 4),
            file("gone", 5),
            dir("sub"),
        ]),
    )
    .unwrap();
    sm.apply(
        3,
        &Command::LoadDir {
            dir: sm.resolve_loaded("/m/sub").unwrap().unwrap().id,
            mount_id: m.id,
            entries: vec![file("deep", 1)],
            now_ms: 2,
            block_size: 1 << 20,
        },
    )
    .unwrap();
    let keep = sm.resolve_loaded("/m/keep").unwrap().unwrap();
    let change = sm.resolve_loaded("/m/change").unwrap().unwrap();
    let count = sm.inode_count().unwrap();
    let mut changed = file("change", 40);
    changed.fingerprint.as_mut().unwrap().etag = "etag-new".into();
    // `sub` became a file; `gone` vanished; `new` appeared; `change` has a new fingerprint.
    sm.apply(
        4,
        &sync(vec![
            file("keep", 3),
            changed,
            file("sub", 9),
            file("new", 1),
        ]),
    )
    .unwrap();
    assert_eq!(sm.resolve_loaded("/m/keep").unwrap().unwrap(), keep);
    let now = sm.resolve_loaded("/m/change").unwrap().unwrap();
    assert_eq!(now.id, change.id, "same inode, new version");
    assert_eq!(now.length, 40);
    assert_ne!(now.version, change.version);
    assert!(sm.resolve_loaded("/m/gone").unwrap().is_none());
    let sub = sm.resolve_loaded("/m/sub").unwrap().unwrap();
    assert_eq!(sub.kind, Kind::File);
    assert!(sm.resolve_loaded("/m/sub/deep").unwrap().is_none());
    assert!(sm.resolve_loaded("/m/new").unwrap().is_some());
    // -gone, -sub(dir), -deep, +sub(file), +new
    assert_eq!(sm.inode_count().unwrap(), count - 1);
    // A fingerprint checked on open.
    let mut fp = now.fingerprint.clone().unwrap();
    fp.etag = "etag-newer".into();
    let ApplyOutput::Inode(r) = sm
        .apply(
            5,
            &Command::RefreshFile {
                inode: now.id,
                fingerprint: fp.clone(),
                seen_version: Some(now.version),
            },
        )
        .unwrap()
    else {
        panic!()
    };
    assert_ne!(r.version, now.version);
    // An older HEAD (proposed before that refresh) does not roll the version back.
    let ApplyOutput::Inode(again) = sm
        .apply(
            6,
            &Command::RefreshFile {
                inode: now.id,
                fingerprint: now.fingerprint.clone().unwrap(),
                seen_version: Some(now.version),
            },
        )
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(again.version, r.version);
    // Nor does a listing that started before it.
    let mut seen = BTreeMap::new();
    seen.insert("change".to_string(), now.version);
    seen.insert("keep".to_string(), keep.version);
    let mut stale = file("change", 40);
    stale.fingerprint.as_mut().unwrap().etag = "etag-new".into();
    sm.apply(
        7,
        &Command::SyncDir {
            dir: m.inode,
            mount_id: m.id,
            entries: vec![file("keep", 3), stale],
            now_ms: 3,
            block_size: 1 << 20,
            seen: Some(seen),
            batch: None,
        },
    )
    .unwrap();
    let after = sm.resolve_loaded("/m/change").unwrap().unwrap();
    assert_eq!(
        after.version, r.version,
        "an older listing rolled a file back"
    );
    // Entries added after the listing started (e.g. `new`, `sub`) are not removed by it.
    assert!(sm.resolve_loaded("/m/new").unwrap().is_some());
}

#[test]
fn a_batched_sync_marks_the_directory_listed_only_with_its_last_batch() {
    let (_d, sm) = open();
    let m = mounted(&sm, "/b");
    let batch = |entries: Vec<UfsEntry>, removed: Vec<&str>, last: bool| Command::SyncDir {
        dir: m.inode,
        mount_id: m.id,
        entries,
        now_ms: 2,
        block_size: 1 << 20,
        seen: Some(BTreeMap::new()),
        batch: Some(SyncBatch {
            removed: removed.into_iter().map(String::from).collect(),
            last,
        }),
    };
    sm.apply(2, &batch(vec![file("a", 1), file("b", 2)], vec![], false))
        .unwrap();
    assert!(!sm.inode(m.inode).unwrap().unwrap().children_loaded);
    sm.apply(3, &batch(vec![file("c", 3)], vec![], true))
        .unwrap();
    assert!(sm.inode(m.inode).unwrap().unwrap().children_loaded);
    let names = |sm: &StateMachine| -> Vec<String> {
        sm.children(m.inode, None, 10)
            .unwrap()
            .into_iter()
            .map(|i| i.name)
            .collect()
    };
    assert_eq!(names(&sm), vec!["a", "b", "c"]);
    // A later re-listing: `b` vanished, `a` changed. `seen` guards each touched name.
    let a = sm.resolve_loaded("/b/a").unwrap().unwrap();
    let b = sm.resolve_loaded("/b/b").unwrap().unwrap();
    let mut seen = BTreeMap::new();
    seen.insert("a".to_string(), a.version);
    seen.insert("b".to_string(), b.version);
    let mut changed = file("a", 10);
    changed.fingerprint.as_mut().unwrap().etag = "etag-a2".into();
    sm.apply(
        4,
        &Command::SyncDir {
            dir: m.inode,
            mount_id: m.id,
            entries: vec![changed],
            now_ms: 3,
            block_size: 1 << 20,
            seen: Some(seen),
            batch: Some(SyncBatch {
                removed: vec!["b".into()],
                last: true,
            }),
        },
    )
    .unwrap();
    assert_eq!(names(&sm), vec!["a", "c"]);
    assert_ne!(
        sm.resolve_loaded("/b/a").unwrap().unwrap().version,
        a.version
    );
}

#[test]
fn decommissioned_workers_are_remembered_and_reapplying_is_harmless() {
    let (_d, sm) = open();
    assert!(sm.decommissioned().unwrap().is_empty());
    for (i, id) in [7u64, 3, 7].into_iter().enumerate() {
        sm.apply(i as u64 + 1, &Command::DecommissionWorker { worker_id: id })
            .unwrap();
    }
    // Other records around the 'D' prefix do not leak into the set.
    sm.apply(
        4,
        &Command::AddMount {
            path: "/m".into(),
            spec: spec("file:///a"),
            now_ms: 1,
        },
    )
    .unwrap();
    let ids: Vec<u64> = sm.decommissioned().unwrap().into_iter().collect();
    assert_eq!(ids, [3, 7]);
    sm.apply(5, &Command::RecommissionWorker { worker_id: 7 })
        .unwrap();
    let ids: Vec<u64> = sm.decommissioned().unwrap().into_iter().collect();
    assert_eq!(ids, [3]);
}

/// Applies `mkdir -p path` at Raft index `index`.
pub(crate) fn mkdir_at(sm: &StateMachine, index: u64, path: &str) {
    let cmd = Command::Mkdir {
        path: path.into(),
        recursive: true,
        mode: 0,
        now_ms: 1,
        owner: None,
    };
    sm.apply(index, &cmd).unwrap();
}

#[test]
fn a_snapshot_installed_under_cached_records_replaces_them() {
    let mkdir = |sm: &StateMachine, path: &str| mkdir_at(sm, 1, path);
    let dir = tempfile::tempdir().unwrap();
    let store = |name: &str| {
        let db = crate::open_db(&dir.path().join(name)).unwrap();
        StateMachine::open(Arc::new(db)).unwrap()
    };
    let (follower, leader) = (store("follower"), store("leader"));
    mkdir(&follower, "/old");
    mkdir(&leader, "/new/x");
    // Read, so that the follower holds `/old` (inode 2, as `/new` is on the leader) decoded.
    assert!(follower.resolve_loaded("/old").unwrap().is_some());

    // The leader's state as a snapshot file, installed into the follower's store.
    use crate::raft::snapshot;
    let checkpoint = dir.path().join("checkpoint");
    snapshot::checkpoint(&leader.db, &checkpoint).unwrap();
    let file = dir.path().join("snapshot");
    snapshot::write_from_checkpoint(&checkpoint, &dir.path().join("tmp"), &file).unwrap();
    let tables = snapshot::stage(&file, &dir.path().join("staging")).unwrap();
    snapshot::ingest(&follower.db, &tables).unwrap();
    follower.snapshot_installed().unwrap();

    assert!(follower.resolve_loaded("/old").unwrap().is_none());
    let x = follower.resolve_loaded("/new/x").unwrap().unwrap();
    assert_eq!(follower.path_of(&x).unwrap(), "/new/x");
}

#[test]
fn the_pins_of_a_page_are_found_by_one_scan_or_one_by_one() {
    let (_d, sm) = open();
    let mut ids = Vec::new();
    for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
        let ApplyOutput::Inode(d) = sm
            .apply(
                i as u64 + 1,
                &Command::Mkdir {
                    path: format!("/{name}"),
                    recursive: false,
                    mode: 0,
                    now_ms: 1,
                    owner: None,
                },
            )
            .unwrap()
        else {
            panic!("not an inode");
        };
        ids.push(d.id);
    }
    for (index, (path, replicas)) in [("/b", 2), ("/d", 3)].into_iter().enumerate() {
        sm.apply(
            10 + index as u64,
            &Command::SetPin {
                path: path.into(),
                replicas,
            },
        )
        .unwrap();
    }
    let want: HashMap<u64, u32> = [(ids[1], 2), (ids[3], 3)].into();
    let found = |ids: &[u64]| -> HashMap<u64, u32> {
        sm.pins_among(ids)
            .unwrap()
            .into_iter()
            .map(|(id, p)| (id, p.replicas))
            .collect()
    };
    // Close ids: one scan, which must not pick up pins of ids not asked for.
    assert_eq!(found(&ids), want);
    assert_eq!(found(&ids[..2]), [(ids[1], 2)].into());
    assert_eq!(found(&[ids[0], ids[2]]), HashMap::new());
    // Scattered ids: one read each.
    assert_eq!(found(&[ids[3], u64::MAX - 1]), [(ids[3], 3)].into());
    assert!(found(&[]).is_empty());
}

/// A listing's batches leave the state cache as they found it, less what they changed:
/// the inodes and entries they make are not cached (a first listing of a million files
/// evicted every folder paths resolve through), and an inode they change is dropped from
/// the cache, never left there in its old version; a request's writes are still cached.
#[test]
fn listing_batches_drop_what_they_change_from_the_state_cache_and_fill_nothing() {
    let (_d, sm) = open();
    let m = mounted(&sm, "/m");
    let sync = |entries: Vec<UfsEntry>, now_ms: i64| Command::SyncDir {
        dir: m.inode,
        mount_id: m.id,
        entries,
        now_ms,
        block_size: 1 << 20,
        seen: None,
        batch: None,
    };
    let sub = UfsEntry {
        name: "sub".into(),
        kind: Kind::Directory,
        fingerprint: None,
    };
    sm.apply(2, &sync(vec![file("a", 3), file("b", 4), sub.clone()], 2))
        .unwrap();
    // (A scan keeps nothing in the cache; a point read keeps what it decoded.)
    let listed = sm.children(m.inode, None, 10).unwrap();
    assert_eq!(listed.len(), 3);
    assert!(listed.iter().all(|i| sm.cache.inode(i.id).is_err()));
    let a = sm.resolve_loaded("/m/a").unwrap().unwrap();
    let b = sm.resolve_loaded("/m/b").unwrap().unwrap();
    assert_eq!(sm.cache.inode(a.id).ok().map(|i| i.length), Some(3));
    let ApplyOutput::Inode(made) = sm.apply(3, &mkdir_cmd("/m/made")).unwrap() else {
        panic!()
    };
    assert!(
        sm.cache.inode(made.id).is_ok(),
        "a request's inode is cached"
    );

    // The store changed `a`: the next listing drops the cached old version.
    sm.apply(4, &sync(vec![file("a", 30), file("b", 4), sub], 3))
        .unwrap();
    assert!(sm.cache.inode(a.id).is_err(), "the old version is dropped");
    let a2 = sm.resolve_loaded("/m/a").unwrap().unwrap();
    assert_eq!((a2.id, a2.length), (a.id, 30));
    assert!(a2.version > a.version);
    assert_eq!(sm.inode(b.id).unwrap().unwrap().length, 4);
    // A folder listed for the first time by `LoadDir` caches none of its entries either.
    let sub = sm.resolve_loaded("/m/sub").unwrap().unwrap();
    sm.apply(
        6,
        &Command::LoadDir {
            dir: sub.id,
            mount_id: m.id,
            entries: vec![file("deep", 1)],
            now_ms: 4,
            block_size: 1 << 20,
        },
    )
    .unwrap();
    let deep = sm.children(sub.id, None, 10).unwrap();
    assert_eq!(deep.len(), 1);
    assert!(sm.cache.inode(deep[0].id).is_err());
}

#[test]
fn a_rename_never_makes_a_path_longer_than_the_limit() {
    let (_d, sm) = open();
    let mkdir = |path: String| Command::Mkdir {
        path,
        recursive: true,
        mode: 0,
        now_ms: 1,
        owner: None,
    };
    let rename = |src: &str, dst: String| Command::Rename {
        src: src.into(),
        dst,
        now_ms: 2,
    };
    // Two chains of 2,000 folders, each path inside the limit on its own.
    let chain = |top: &str| format!("/{top}{}", "/a".repeat(2000));
    sm.apply(1, &mkdir(chain("f1"))).unwrap();
    sm.apply(2, &mkdir(chain("f2"))).unwrap();
    let before = sm.inode_count().unwrap();
    // Moving one chain to the bottom of the other would make a path of 8,000 bytes (and
    // each such move deeper trees for the next one to rewrite).
    let err = sm
        .apply(3, &rename("/f1", format!("{}/x", chain("f2"))))
        .unwrap_err();
    assert!(
        matches!(err, MasterError::InvalidArgument { .. })
            && err.to_string().contains("longer than 4096 bytes"),
        "{err}"
    );
    assert!(sm.resolve_loaded(&chain("f1")).unwrap().is_some());
    assert!(sm
        .resolve_loaded(&format!("{}/x", chain("f2")))
        .unwrap()
        .is_none());
    assert_eq!(sm.inode_count().unwrap(), before);
    // A move that keeps every path inside the limit goes ahead, to a longer name too.
    sm.apply(4, &rename("/f1", "/f2/a-longer-name".into()))
        .unwrap();
    let moved = format!("/f2/a-longer-name{}", "/a".repeat(2000));
    assert!(sm.resolve_loaded(&moved).unwrap().is_some());
}
