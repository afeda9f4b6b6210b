use super::super::keys;
use std::collections::BTreeMap;

use super::*;
use crate::state::jobs::{DoneFile, JobState};
use crate::state::tests::open;
use crate::state::ttl::TtlAction;
use crate::state::{Fingerprint, Kind, Owner, Persist, SyncBatch, UfsEntry};
use granary_common::ufs::UfsSpec;

fn fp(n: u64) -> Fingerprint {
    Fingerprint {
        etag: format!("\"e{n}\""),
        size: n,
        mtime_ms: n as i64 * 1000 + 7,
        version_id: format!("v{n}"),
    }
}

/// An inode with no field at its default, so a field the conversion forgets shows.
fn inode() -> Inode {
    Inode {
        id: 42,
        parent: 9,
        name: "ünï code.bin".into(),
        kind: Kind::File,
        mode: 0o640,
        mtime_ms: -5,
        length: u64::MAX,
        block_size: 4 << 20,
        fingerprint: Some(fp(3)),
        version: 77,
        mount_id: Some(0),
        ufs_path: "a/b.bin".into(),
        is_mount_point: true,
        children_loaded: true,
        complete: false,
        owner: Some(Owner { uid: 1000, gid: 0 }),
        persist: Persist::NotPersisted,
        persist_worker: 5,
        created: true,
        creator: Some("alice".into()),
        listed_ms: 123,
    }
}

fn mount() -> Mount {
    Mount {
        id: 3,
        path: "/data".into(),
        inode: 12,
        spec: UfsSpec {
            uri: "s3://bucket/prefix".into(),
            options: BTreeMap::from([("region".into(), "eu".into()), ("a".into(), "".into())]),
        },
    }
}

fn job() -> Job {
    Job {
        id: 8,
        kind: "load".into(),
        path: "/data/x".into(),
        replicas: 2,
        state: JobState::Cancelled,
        created_ms: 1,
        finished_ms: 2,
        total_files: 3,
        total_bytes: 4,
        done_files: 5,
        done_bytes: 6,
        failed_files: 7,
        fetched_bytes: 8,
        error: "boom".into(),
    }
}

fn failed() -> FailedFile {
    FailedFile {
        inode: 4,
        path: "/data/x/y".into(),
        reason: "gone".into(),
    }
}

fn roundtrip<T: Record + PartialEq + std::fmt::Debug>(r: &T) {
    assert_eq!(&T::decode(&r.encode()).unwrap(), r);
}

/// One command of each kind, every field set. The match names every kind: a new one does
/// not compile until it is added here, and so tried.
fn commands() -> Vec<Command> {
    let entry = |name: &str, kind| UfsEntry {
        name: name.into(),
        kind,
        fingerprint: (kind == Kind::File).then(|| fp(9)),
    };
    let ttl = Ttl {
        expires_ms: 99,
        action: TtlAction::Delete,
    };
    let all = vec![
        Command::AddMount {
            path: "/m".into(),
            spec: mount().spec,
            now_ms: 1,
        },
        Command::RemoveMount { path: "/m".into() },
        Command::DecommissionWorker { worker_id: 5 },
        Command::RecommissionWorker { worker_id: 6 },
        Command::LoadDir {
            dir: 2,
            mount_id: 3,
            entries: vec![entry("a", Kind::File), entry("b", Kind::Directory)],
            now_ms: 4,
            block_size: 5,
        },
        Command::SyncDir {
            dir: 2,
            mount_id: 3,
            entries: vec![entry("c", Kind::File)],
            now_ms: 4,
            block_size: 5,
            seen: Some(BTreeMap::from([("c".into(), 1), ("d".into(), 2)])),
            batch: Some(SyncBatch {
                removed: vec!["e".into()],
                last: true,
            }),
        },
        Command::SyncDir {
            dir: 2,
            mount_id: 3,
            entries: vec![],
            now_ms: 4,
            block_size: 5,
            seen: Some(BTreeMap::new()),
            batch: Some(SyncBatch::default()),
        },
        Command::AddUfsChild {
            dir: 2,
            mount_id: 3,
            entry: entry("f", Kind::Directory),
            now_ms: 4,
            block_size: 5,
        },
        Command::RefreshFile {
            inode: 7,
            fingerprint: fp(1),
            seen_version: Some(0),
        },
        Command::Mkdir {
            path: "/x".into(),
            recursive: true,
            mode: 0o700,
            now_ms: 1,
            owner: Some(Owner { uid: 1, gid: 2 }),
        },
        Command::CreateFile {
            path: "/x/y".into(),
            mode: 0o600,
            block_size: 1 << 20,
            now_ms: 2,
            overwrite: true,
            owner: Some(Owner { uid: 3, gid: 4 }),
            creator: Some(String::new()),
        },
        Command::CompleteFile {
            inode: 7,
            length: 8,
            fingerprint: Some(fp(2)),
            now_ms: 9,
            version: Some(10),
            persist: Persist::Pending,
            persist_worker: 11,
        },
        Command::FilePersisted {
            inode: 7,
            version: 8,
            fingerprint: fp(4),
            ufs_path: "x/y".into(),
        },
        Command::Delete {
            path: "/x".into(),
            recursive: true,
        },
        Command::Rename {
            src: "/a".into(),
            dst: "/b".into(),
            now_ms: 3,
        },
        Command::SetTtl {
            path: "/a".into(),
            ttl: Some(ttl),
        },
        Command::SetTtl {
            path: "/a".into(),
            ttl: None,
        },
        Command::EndTtl { inode: 4, was: ttl },
        Command::SetPin {
            path: "/a".into(),
            replicas: 3,
        },
        Command::CreateJob {
            kind: "load".into(),
            path: "/a".into(),
            replicas: 2,
            now_ms: 1,
        },
        Command::JobPlanned {
            id: 1,
            total_files: 2,
            total_bytes: 3,
        },
        Command::JobProgress {
            id: 1,
            done: vec![DoneFile {
                inode: 2,
                length: 3,
            }],
            failed: vec![failed()],
            fetched_bytes: 4,
        },
        Command::UseFormat { version: 1 },
        Command::FinishJob {
            id: 1,
            state: JobState::Failed,
            error: "e".into(),
            now_ms: 2,
        },
    ];
    for c in &all {
        match c {
            Command::AddMount { .. }
            | Command::RemoveMount { .. }
            | Command::DecommissionWorker { .. }
            | Command::RecommissionWorker { .. }
            | Command::LoadDir { .. }
            | Command::SyncDir { .. }
            | Command::AddUfsChild { .. }
            | Command::RefreshFile { .. }
            | Command::Mkdir { .. }
            | Command::CreateFile { .. }
            | Command::CompleteFile { .. }
            | Command::FilePersisted { .. }
            | Command::Delete { .. }
            | Command::Rename { .. }
            | Command::SetTtl { .. }
            | Command::EndTtl { .. }
            | Command::SetPin { .. }
            | Command::CreateJob { .. }
            | Command::JobPlanned { .. }
            | Command::JobProgress { .. }
            | Command::UseFormat { .. }
            | Command::FinishJob { .. } => {}
        }
    }
    all
}

/// Every error a request may have had. The match names every kind, as in [`commands`].
fn errors() -> Vec<MasterError> {
    use MasterError as E;
    let all = vec![
        E::NotFound { path: "/a".into() },
        E::NoSuchJob { id: 4 },
        E::AlreadyExists { path: "/a".into() },
        E::InvalidArgument {
            message: "m".into(),
        },
        E::FailedPrecondition {
            message: "m".into(),
        },
        E::NotADirectory { path: "/a".into() },
        E::NotEmpty { path: "/a".into() },
        E::CrossMount {
            src: "/a".into(),
            dst: "/b".into(),
        },
        E::IsADirectory { path: "/a".into() },
        E::ReadOnly {
            path: "/a".into(),
            mount: "/m".into(),
        },
        E::PermissionDenied {
            message: "m".into(),
        },
        E::NotLeader {
            leader_hint: Some("h:1".into()),
        },
        E::NotLeader { leader_hint: None },
        E::Unavailable {
            message: "m".into(),
        },
        E::Busy {
            path: "/a".into(),
            mount: "/a/m".into(),
        },
        E::Inconsistent {
            message: "m".into(),
        },
        E::Corrupt {
            message: "m".into(),
        },
        E::Storage {
            message: "m".into(),
        },
        E::ShuttingDown,
    ];
    for e in &all {
        match e {
            E::NotFound { .. }
            | E::NoSuchJob { .. }
            | E::AlreadyExists { .. }
            | E::InvalidArgument { .. }
            | E::FailedPrecondition { .. }
            | E::NotADirectory { .. }
            | E::NotEmpty { .. }
            | E::CrossMount { .. }
            | E::MoveTooBig { .. }
            | E::IsADirectory { .. }
            | E::ReadOnly { .. }
            | E::PermissionDenied { .. }
            | E::NotLeader { .. }
            | E::Unavailable { .. }
            | E::Busy { .. }
            | E::Inconsistent { .. }
            | E::Corrupt { .. }
            | E::Storage { .. }
            | E::ShuttingDown => {}
        }
    }
    all
}

#[test]
fn every_command_is_the_same_after_its_entry_format() {
    for (i, cmd) in commands().into_iter().enumerate() {
        let p = Proposal {
            request_id: i as u64,
            at_ms: -(i as i64),
            cmd,
        };
        let bytes = p.encode();
        assert_eq!(bytes[0], FORMAT_VERSION);
        assert_eq!(Proposal::decode(&bytes).unwrap(), p);
    }
}

#[test]
fn every_record_is_the_same_after_its_format() {
    roundtrip(&inode());
    roundtrip(&Inode::directory(1, 1, "", 0o755, 0));
    roundtrip(&mount());
    roundtrip(&job());
    roundtrip(&failed());
    roundtrip(&Pin { replicas: 3 });
    roundtrip(&Ttl {
        expires_ms: -1,
        action: TtlAction::Free,
    });
    let outputs = [
        ApplyOutput::None,
        ApplyOutput::Inode(inode()),
        ApplyOutput::Mount(mount()),
        ApplyOutput::Job(job()),
    ];
    let results = outputs
        .into_iter()
        .map(Ok)
        .chain(errors().into_iter().map(Err));
    for result in results {
        let r = RequestOutcome { at_ms: 5, result };
        let back = RequestOutcome::decode(&r.encode()).unwrap();
        assert_eq!((back.at_ms, &back.result), (r.at_ms, &r.result));
    }
}

#[test]
fn what_this_version_does_not_know_is_corrupt_never_misread() {
    // A kind of file this version has no name for (a newer release's).
    let mut m = pb::Inode::from(&inode());
    m.kind = 7;
    let e = Inode::decode(&m.encode_to_vec()).unwrap_err();
    assert!(e.is_local_failure());
    assert!(
        e.to_string().contains("stored inode: unknown kind 7"),
        "{e}"
    );
    // A remembered outcome with no result, a mount with no store.
    let e = RequestOutcome::decode(&[]).unwrap_err().to_string();
    assert!(e.contains("no result"), "{e}");
    let e = Mount::decode(&[]).unwrap_err().to_string();
    assert!(e.contains("no under-store"), "{e}");
    // Entries of a newer format, and of none.
    let mut entry = Proposal::encode_of(1, 2, &Command::RemoveMount { path: "/m".into() });
    entry[0] = 2;
    let e = Proposal::decode(&entry).unwrap_err();
    assert!(e.starts_with("format 2;"), "{e}");
    assert_eq!(
        Proposal::decode(&[FORMAT_VERSION]).unwrap_err(),
        "no command"
    );
    assert!(Proposal::decode(&[]).is_err());
}

#[test]
fn a_json_store_is_upgraded_once_and_reads_as_it_did() {
    let (_dir, sm) = open();
    let cf = sm.cf().unwrap();
    let json = |v: &dyn erased::Json| v.json();
    let outcome = RequestOutcome {
        at_ms: 5,
        result: Err(MasterError::NotEmpty { path: "/a".into() }),
    };
    let records: Vec<(Vec<u8>, Vec<u8>)> = vec![
        (keys::inode(42), json(&inode())),
        (keys::mount(3), json(&mount())),
        (keys::request(77), json(&outcome)),
        (keys::job(8), json(&job())),
        (
            b"f\0\0\0\0\0\0\0\x08\0\0\0\0\0\0\0\x04".to_vec(),
            json(&failed()),
        ),
        (keys::pin(42), json(&Pin { replicas: 2 })),
        (
            keys::ttl(42),
            json(&Ttl {
                expires_ms: 9,
                action: TtlAction::Delete,
            }),
        ),
    ];
    for (k, v) in &records {
        sm.db.put_cf(cf, k, v).unwrap();
    }
    // A binary record already upgraded (an upgrade stopped part-way) stays as it is.
    let done = Pin { replicas: 4 }.encode();
    sm.db.put_cf(cf, keys::pin(43), &done).unwrap();
    sm.db.delete_cf(cf, keys::FORMAT).unwrap();

    let sm = StateMachine::open(sm.db.clone()).unwrap();
    assert_eq!(sm.get(keys::FORMAT).unwrap(), Some(vec![FORMAT_VERSION]));
    assert_eq!(sm.inode(42).unwrap(), Some(inode()));
    assert_eq!(sm.mount(3).unwrap(), Some(mount()));
    assert_eq!(sm.job(8).unwrap(), Some(job()));
    assert_eq!(sm.job_failed(8, 10).unwrap(), vec![failed()]);
    assert_eq!(
        sm.request_outcome(77).unwrap(),
        Some(Err(MasterError::NotEmpty { path: "/a".into() }))
    );
    assert_eq!(sm.pin_of(42).unwrap().map(|p| p.replicas), Some(2));
    assert_eq!(sm.pin_of(43).unwrap().map(|p| p.replicas), Some(4));
    assert_eq!(sm.ttl_of(42).unwrap().map(|t| t.expires_ms), Some(9));
    // Every record is binary now, and a second upgrade has nothing to do.
    for (k, _) in &records {
        let v = sm.get(k).unwrap().unwrap();
        assert_ne!(v.first(), Some(&b'{'), "{k:?} is still JSON");
    }
    assert_eq!(sm.upgrade_format().unwrap(), 0);
}

#[test]
fn a_store_of_a_newer_format_is_refused() {
    let (_dir, sm) = open();
    sm.db.put_cf(sm.cf().unwrap(), keys::FORMAT, [2]).unwrap();
    let Err(e) = StateMachine::open(sm.db.clone()) else {
        panic!("a store of format 2 opened");
    };
    assert!(e.to_string().contains("format [2]"), "{e}");
}

/// JSON of any record, as the releases before format 1 wrote it.
mod erased {
    pub trait Json {
        fn json(&self) -> Vec<u8>;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> Vec<u8> {
            serde_json::to_vec(self).unwrap()
        }
    }
}

#[test]
fn entries_stay_json_until_the_group_records_the_format_every_member_reads() {
    let (_dir, sm) = open();
    let format = sm.entry_format();
    let cmd = Command::RemoveMount { path: "/m".into() };
    // A new group proposes JSON, which a master of the release before reads.
    assert_eq!(format.version(), 0);
    let json = format.encode(3, 4, &cmd).unwrap();
    assert_eq!(json[0], b'{');
    let legacy: Proposal = serde_json::from_slice(&json).unwrap();
    assert_eq!((legacy.request_id, legacy.at_ms, &legacy.cmd), (3, 4, &cmd));

    // A format this master cannot read is refused and changes nothing.
    let newer = Command::UseFormat {
        version: u32::from(FORMAT_VERSION) + 1,
    };
    let e = sm.apply(1, &newer).unwrap_err();
    assert!(e.to_string().contains("newer than this master's"), "{e}");
    assert_eq!(
        (format.version(), sm.get(keys::ENTRY_FORMAT).unwrap()),
        (0, None)
    );

    sm.apply(2, &Command::UseFormat { version: 1 }).unwrap();
    assert_eq!(format.version(), FORMAT_VERSION);
    let binary = format.encode(3, 4, &cmd).unwrap();
    assert_eq!(binary, Proposal::encode_of(3, 4, &cmd));
    // An older format recorded later does not move it back; a restart keeps it.
    sm.apply(3, &Command::UseFormat { version: 0 }).unwrap();
    assert_eq!(format.version(), FORMAT_VERSION);
    let reopened = StateMachine::open(sm.db.clone()).unwrap();
    assert_eq!(reopened.entry_format().version(), FORMAT_VERSION);
}

#[test]
fn a_snapshot_is_json_while_the_entries_are_and_a_master_of_this_release_upgrades_it() {
    let (_dir, sm) = open();
    let mkdir = |path: &str| Command::Mkdir {
        path: path.into(),
        recursive: false,
        mode: 0o750,
        now_ms: 9,
        owner: Some(Owner { uid: 5, gid: 6 }),
    };
    sm.apply(1, &mkdir("/a")).unwrap();
    sm.apply(
        2,
        &Command::SetPin {
            path: "/a".into(),
            replicas: 2,
        },
    )
    .unwrap();
    let records = |sm: &StateMachine, json: bool| -> Vec<(Vec<u8>, Vec<u8>)> {
        let cf = sm.cf().unwrap();
        assert_eq!(snapshot_in_json(&sm.db, cf).unwrap(), json);
        let mut out = Vec::new();
        let mut it = sm.db.raw_iterator_cf(cf);
        it.seek_to_first();
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            if let Some(v) = snapshot_value(k, v, json).unwrap() {
                out.push((k.to_vec(), v.into_owned()));
            }
            it.next();
        }
        out
    };
    // Entries still JSON: so is the snapshot, all of it, as a release before wrote it.
    let snap = records(&sm, true);
    assert!(!snap.iter().any(|(k, _)| k == keys::FORMAT));
    let a = snap
        .iter()
        .find(|(k, _)| k[0] == b'i' && k[1..] == 2u64.to_be_bytes());
    let a: Inode = serde_json::from_slice(&a.unwrap().1).unwrap();
    assert_eq!((a.name.as_str(), a.mode), ("a", 0o750));
    let pin = snap.iter().find(|(k, _)| k[0] == b'P').unwrap();
    assert_eq!(serde_json::from_slice::<Pin>(&pin.1).unwrap().replicas, 2);

    // Installed on a master of this release: upgraded, the same state.
    let (_other, installed) = open();
    let cf = installed.cf().unwrap();
    installed
        .db
        .delete_range_cf(cf, [0u8].as_slice(), [0xffu8; 64].as_slice())
        .unwrap();
    for (k, v) in &snap {
        installed.db.put_cf(cf, k, v).unwrap();
    }
    assert!(
        installed.upgrade_format().unwrap() >= 3,
        "root, /a and the pin"
    );
    assert_eq!(installed.inode(2).unwrap(), sm.inode(2).unwrap());
    assert_eq!(installed.pin_of(2).unwrap(), sm.pin_of(2).unwrap());

    // Once the group records format 1, snapshots are the store as it is.
    sm.apply(3, &Command::UseFormat { version: 1 }).unwrap();
    let snap = records(&sm, false);
    assert!(snap
        .iter()
        .any(|(k, v)| k == keys::FORMAT && v == &[FORMAT_VERSION]));
    let cf = sm.cf().unwrap();
    for (k, v) in &snap {
        assert_eq!(sm.db.get_cf(cf, k).unwrap().as_ref(), Some(v));
    }
}
