//! The conversions between the state's types and their stored messages (format 1), and
//! the Raft entry codec. See [`super`] for the format's rules.

use granary_proto::prost::Message;
use granary_proto::state::v1 as pb;

use super::super::jobs::{DoneFile, FailedFile, Job, JobState};
use super::super::pins::Pin;
use super::super::ttl::{Ttl, TtlAction};
use super::super::{
    ApplyOutput, Command, Fingerprint, Inode, Kind, Mount, Owner, Persist, Proposal,
    RequestOutcome, SyncBatch, UfsEntry,
};
use super::FORMAT_VERSION;
use crate::error::MasterError;
use granary_common::ufs::UfsSpec;

/// Why a message does not convert: what this version does not know, or what is missing.
type Bad = String;

fn enum_value<T: TryFrom<i32>>(what: &str, v: i32) -> Result<T, Bad> {
    T::try_from(v).map_err(|_| format!("unknown {what} {v} (written by a newer release?)"))
}

fn needed<T>(what: &str, v: Option<T>) -> Result<T, Bad> {
    v.ok_or_else(|| format!("no {what}"))
}

// ----- records

impl From<&Fingerprint> for pb::Fingerprint {
    fn from(f: &Fingerprint) -> Self {
        Self {
            etag: f.etag.clone(),
            size: f.size,
            mtime_ms: f.mtime_ms,
            version_id: f.version_id.clone(),
        }
    }
}

impl From<pb::Fingerprint> for Fingerprint {
    fn from(f: pb::Fingerprint) -> Self {
        Self {
            etag: f.etag,
            size: f.size,
            mtime_ms: f.mtime_ms,
            version_id: f.version_id,
        }
    }
}

impl From<Owner> for pb::Owner {
    fn from(o: Owner) -> Self {
        Self {
            uid: o.uid,
            gid: o.gid,
        }
    }
}

impl From<pb::Owner> for Owner {
    fn from(o: pb::Owner) -> Self {
        Self {
            uid: o.uid,
            gid: o.gid,
        }
    }
}

fn kind_to(k: Kind) -> i32 {
    match k {
        Kind::File => pb::Kind::File as i32,
        Kind::Directory => pb::Kind::Directory as i32,
    }
}

fn kind_from(v: i32) -> Result<Kind, Bad> {
    Ok(match enum_value("kind", v)? {
        pb::Kind::File => Kind::File,
        pb::Kind::Directory => Kind::Directory,
    })
}

fn persist_to(p: Persist) -> i32 {
    match p {
        Persist::Persisted => pb::Persist::Persisted as i32,
        Persist::Pending => pb::Persist::Pending as i32,
        Persist::NotPersisted => pb::Persist::NotPersisted as i32,
    }
}

fn persist_from(v: i32) -> Result<Persist, Bad> {
    Ok(match enum_value("persistence", v)? {
        pb::Persist::Persisted => Persist::Persisted,
        pb::Persist::Pending => Persist::Pending,
        pb::Persist::NotPersisted => Persist::NotPersisted,
    })
}

impl From<&Inode> for pb::Inode {
    fn from(i: &Inode) -> Self {
        Self {
            id: i.id,
            parent: i.parent,
            name: i.name.clone(),
            kind: kind_to(i.kind),
            mode: i.mode,
            mtime_ms: i.mtime_ms,
            length: i.length,
            block_size: i.block_size,
            fingerprint: i.fingerprint.as_ref().map(Into::into),
            version: i.version,
            mount_id: i.mount_id,
            ufs_path: i.ufs_path.clone(),
            is_mount_point: i.is_mount_point,
            children_loaded: i.children_loaded,
            incomplete: !i.complete,
            owner: i.owner.map(Into::into),
            persist: persist_to(i.persist),
            persist_worker: i.persist_worker,
            created: i.created,
            creator: i.creator.clone(),
            listed_ms: i.listed_ms,
        }
    }
}

impl TryFrom<pb::Inode> for Inode {
    type Error = Bad;
    fn try_from(i: pb::Inode) -> Result<Self, Bad> {
        Ok(Self {
            id: i.id,
            parent: i.parent,
            name: i.name,
            kind: kind_from(i.kind)?,
            mode: i.mode,
            mtime_ms: i.mtime_ms,
            length: i.length,
            block_size: i.block_size,
            fingerprint: i.fingerprint.map(Into::into),
            version: i.version,
            mount_id: i.mount_id,
            ufs_path: i.ufs_path,
            is_mount_point: i.is_mount_point,
            children_loaded: i.children_loaded,
            complete: !i.incomplete,
            owner: i.owner.map(Into::into),
            persist: persist_from(i.persist)?,
            persist_worker: i.persist_worker,
            created: i.created,
            creator: i.creator,
            listed_ms: i.listed_ms,
        })
    }
}

fn spec_to(s: &UfsSpec) -> pb::UfsSpec {
    pb::UfsSpec {
        uri: s.uri.clone(),
        options: s.options.clone(),
    }
}

fn spec_from(s: pb::UfsSpec) -> UfsSpec {
    UfsSpec {
        uri: s.uri,
        options: s.options,
    }
}

impl From<&Mount> for pb::Mount {
    fn from(m: &Mount) -> Self {
        Self {
            id: m.id,
            path: m.path.clone(),
            inode: m.inode,
            spec: Some(spec_to(&m.spec)),
        }
    }
}

impl TryFrom<pb::Mount> for Mount {
    type Error = Bad;
    fn try_from(m: pb::Mount) -> Result<Self, Bad> {
        Ok(Self {
            id: m.id,
            path: m.path,
            inode: m.inode,
            spec: spec_from(needed("under-store", m.spec)?),
        })
    }
}

impl From<&Pin> for pb::Pin {
    fn from(p: &Pin) -> Self {
        Self {
            replicas: p.replicas,
        }
    }
}

impl TryFrom<pb::Pin> for Pin {
    type Error = Bad;
    fn try_from(p: pb::Pin) -> Result<Self, Bad> {
        Ok(Self {
            replicas: p.replicas,
        })
    }
}

impl From<&Ttl> for pb::Ttl {
    fn from(t: &Ttl) -> Self {
        Self {
            expires_ms: t.expires_ms,
            action: match t.action {
                TtlAction::Free => pb::TtlAction::Free as i32,
                TtlAction::Delete => pb::TtlAction::Delete as i32,
            },
        }
    }
}

impl TryFrom<pb::Ttl> for Ttl {
    type Error = Bad;
    fn try_from(t: pb::Ttl) -> Result<Self, Bad> {
        Ok(Self {
            expires_ms: t.expires_ms,
            action: match enum_value("TTL action", t.action)? {
                pb::TtlAction::Free => TtlAction::Free,
                pb::TtlAction::Delete => TtlAction::Delete,
            },
        })
    }
}

fn job_state_to(s: JobState) -> i32 {
    (match s {
        JobState::Planning => pb::JobState::Planning,
        JobState::Running => pb::JobState::Running,
        JobState::Succeeded => pb::JobState::Succeeded,
        JobState::Failed => pb::JobState::Failed,
        JobState::Cancelled => pb::JobState::Cancelled,
    }) as i32
}

fn job_state_from(v: i32) -> Result<JobState, Bad> {
    Ok(match enum_value("job state", v)? {
        pb::JobState::Planning => JobState::Planning,
        pb::JobState::Running => JobState::Running,
        pb::JobState::Succeeded => JobState::Succeeded,
        pb::JobState::Failed => JobState::Failed,
        pb::JobState::Cancelled => JobState::Cancelled,
    })
}

impl From<&Job> for pb::Job {
    fn from(j: &Job) -> Self {
        Self {
            id: j.id,
            kind: j.kind.clone(),
            path: j.path.clone(),
            replicas: j.replicas,
            state: job_state_to(j.state),
            created_ms: j.created_ms,
            finished_ms: j.finished_ms,
            total_files: j.total_files,
            total_bytes: j.total_bytes,
            done_files: j.done_files,
            done_bytes: j.done_bytes,
            failed_files: j.failed_files,
            fetched_bytes: j.fetched_bytes,
            error: j.error.clone(),
        }
    }
}

impl TryFrom<pb::Job> for Job {
    type Error = Bad;
    fn try_from(j: pb::Job) -> Result<Self, Bad> {
        Ok(Self {
            id: j.id,
            kind: j.kind,
            path: j.path,
            replicas: j.replicas,
            state: job_state_from(j.state)?,
            created_ms: j.created_ms,
            finished_ms: j.finished_ms,
            total_files: j.total_files,
            total_bytes: j.total_bytes,
            done_files: j.done_files,
            done_bytes: j.done_bytes,
            failed_files: j.failed_files,
            fetched_bytes: j.fetched_bytes,
            error: j.error,
        })
    }
}

impl From<&FailedFile> for pb::FailedFile {
    fn from(f: &FailedFile) -> Self {
        Self {
            inode: f.inode,
            path: f.path.clone(),
            reason: f.reason.clone(),
        }
    }
}

impl TryFrom<pb::FailedFile> for FailedFile {
    type Error = Bad;
    fn try_from(f: pb::FailedFile) -> Result<Self, Bad> {
        Ok(Self {
            inode: f.inode,
            path: f.path,
            reason: f.reason,
        })
    }
}

fn error_to(e: &MasterError) -> pb::Error {
    use pb::ErrorKind as K;
    use MasterError as E;
    let of = |kind: K, text: &str, other: &str| pb::Error {
        kind: kind as i32,
        text: text.to_string(),
        other: other.to_string(),
        job: 0,
        leader_hint: None,
    };
    match e {
        E::NotFound { path } => of(K::NotFound, path, ""),
        E::NoSuchJob { id } => pb::Error {
            job: *id,
            ..of(K::NoSuchJob, "", "")
        },
        E::AlreadyExists { path } => of(K::AlreadyExists, path, ""),
        E::InvalidArgument { message } => of(K::InvalidArgument, message, ""),
        E::FailedPrecondition { message } => of(K::FailedPrecondition, message, ""),
        E::NotADirectory { path } => of(K::NotADirectory, path, ""),
        E::NotEmpty { path } => of(K::NotEmpty, path, ""),
        E::CrossMount { src, dst } => of(K::CrossMount, src, dst),
        // Refused before any proposal: no entry records it; kept as its sentence.
        E::MoveTooBig { .. } => of(K::FailedPrecondition, &e.to_string(), ""),
        E::IsADirectory { path } => of(K::IsADirectory, path, ""),
        E::ReadOnly { path, mount } => of(K::ReadOnly, path, mount),
        E::PermissionDenied { message } => of(K::PermissionDenied, message, ""),
        E::NotLeader { leader_hint } => pb::Error {
            leader_hint: leader_hint.clone(),
            ..of(K::NotLeader, "", "")
        },
        E::Unavailable { message } => of(K::Unavailable, message, ""),
        E::Busy { path, mount } => of(K::Busy, path, mount),
        E::Inconsistent { message } => of(K::Inconsistent, message, ""),
        E::Corrupt { message } => of(K::Corrupt, message, ""),
        E::Storage { message } => of(K::Storage, message, ""),
        E::ShuttingDown => of(K::ShuttingDown, "", ""),
    }
}

fn error_from(e: pb::Error) -> Result<MasterError, Bad> {
    use pb::ErrorKind as K;
    use MasterError as E;
    let (path, message) = (e.text.clone(), e.text);
    Ok(match enum_value("error kind", e.kind)? {
        K::Unspecified => return Err("an error of no kind".into()),
        K::NotFound => E::NotFound { path },
        K::NoSuchJob => E::NoSuchJob { id: e.job },
        K::AlreadyExists => E::AlreadyExists { path },
        K::InvalidArgument => E::InvalidArgument { message },
        K::FailedPrecondition => E::FailedPrecondition { message },
        K::NotADirectory => E::NotADirectory { path },
        K::NotEmpty => E::NotEmpty { path },
        K::CrossMount => E::CrossMount {
            src: path,
            dst: e.other,
        },
        K::IsADirectory => E::IsADirectory { path },
        K::ReadOnly => E::ReadOnly {
            path,
            mount: e.other,
        },
        K::PermissionDenied => E::PermissionDenied { message },
        K::NotLeader => E::NotLeader {
            leader_hint: e.leader_hint,
        },
        K::Unavailable => E::Unavailable { message },
        K::Busy => E::Busy {
            path,
            mount: e.other,
        },
        K::Inconsistent => E::Inconsistent { message },
        K::Corrupt => E::Corrupt { message },
        K::Storage => E::Storage { message },
        K::ShuttingDown => E::ShuttingDown,
    })
}

impl From<&ApplyOutput> for pb::ApplyOutput {
    fn from(o: &ApplyOutput) -> Self {
        use pb::apply_output::Output;
        Self {
            output: match o {
                ApplyOutput::None => None,
                ApplyOutput::Inode(i) => Some(Output::Inode(i.into())),
                ApplyOutput::Mount(m) => Some(Output::Mount(m.into())),
                ApplyOutput::Job(j) => Some(Output::Job(j.into())),
            },
        }
    }
}

impl TryFrom<pb::ApplyOutput> for ApplyOutput {
    type Error = Bad;
    fn try_from(o: pb::ApplyOutput) -> Result<Self, Bad> {
        use pb::apply_output::Output;
        Ok(match o.output {
            None => ApplyOutput::None,
            Some(Output::Inode(i)) => ApplyOutput::Inode(i.try_into()?),
            Some(Output::Mount(m)) => ApplyOutput::Mount(m.try_into()?),
            Some(Output::Job(j)) => ApplyOutput::Job(j.try_into()?),
        })
    }
}

impl From<&RequestOutcome> for pb::RequestOutcome {
    fn from(r: &RequestOutcome) -> Self {
        use pb::request_outcome::Result as R;
        Self {
            at_ms: r.at_ms,
            result: Some(match &r.result {
                Ok(o) => R::Ok(o.into()),
                Err(e) => R::Err(error_to(e)),
            }),
        }
    }
}

impl TryFrom<pb::RequestOutcome> for RequestOutcome {
    type Error = Bad;
    fn try_from(r: pb::RequestOutcome) -> Result<Self, Bad> {
        use pb::request_outcome::Result as R;
        Ok(Self {
            at_ms: r.at_ms,
            result: match needed("result", r.result)? {
                R::Ok(o) => Ok(o.try_into()?),
                R::Err(e) => Err(error_from(e)?),
            },
        })
    }
}

// ----- Raft entries

impl From<&UfsEntry> for pb::UfsEntry {
    fn from(e: &UfsEntry) -> Self {
        Self {
            name: e.name.clone(),
            kind: kind_to(e.kind),
            fingerprint: e.fingerprint.as_ref().map(Into::into),
        }
    }
}

impl TryFrom<pb::UfsEntry> for UfsEntry {
    type Error = Bad;
    fn try_from(e: pb::UfsEntry) -> Result<Self, Bad> {
        Ok(Self {
            name: e.name,
            kind: kind_from(e.kind)?,
            fingerprint: e.fingerprint.map(Into::into),
        })
    }
}

fn entries_to(entries: &[UfsEntry]) -> Vec<pb::UfsEntry> {
    entries.iter().map(Into::into).collect()
}

fn entries_from(entries: Vec<pb::UfsEntry>) -> Result<Vec<UfsEntry>, Bad> {
    entries.into_iter().map(TryInto::try_into).collect()
}

impl From<&Command> for pb::Command {
    fn from(c: &Command) -> Self {
        Self {
            // Every command is one or the other (the round-trip test tries each).
            command: namespace_to(c).or_else(|| others_to(c)),
        }
    }
}

/// The namespace's commands (None: another kind).
fn namespace_to(c: &Command) -> Option<pb::command::Command> {
    use pb::command::Command as P;
    Some(match c {
        Command::LoadDir {
            dir,
            mount_id,
            entries,
            now_ms,
            block_size,
        } => P::LoadDir(pb::LoadDir {
            dir: *dir,
            mount_id: *mount_id,
            entries: entries_to(entries),
            now_ms: *now_ms,
            block_size: *block_size,
        }),
        Command::SyncDir {
            dir,
            mount_id,
            entries,
            now_ms,
            block_size,
            seen,
            batch,
        } => P::SyncDir(pb::SyncDir {
            dir: *dir,
            mount_id: *mount_id,
            entries: entries_to(entries),
            now_ms: *now_ms,
            block_size: *block_size,
            seen: seen.as_ref().map(|s| pb::Seen {
                versions: s.clone(),
            }),
            batch: batch.as_ref().map(|b| pb::SyncBatch {
                removed: b.removed.clone(),
                last: b.last,
            }),
        }),
        Command::AddUfsChild {
            dir,
            mount_id,
            entry,
            now_ms,
            block_size,
        } => P::AddUfsChild(pb::AddUfsChild {
            dir: *dir,
            mount_id: *mount_id,
            entry: Some(entry.into()),
            now_ms: *now_ms,
            block_size: *block_size,
        }),
        Command::RefreshFile {
            inode,
            fingerprint,
            seen_version,
        } => P::RefreshFile(pb::RefreshFile {
            inode: *inode,
            fingerprint: Some(fingerprint.into()),
            seen_version: *seen_version,
        }),
        Command::Mkdir {
            path,
            recursive,
            mode,
            now_ms,
            owner,
        } => P::Mkdir(pb::Mkdir {
            path: path.clone(),
            recursive: *recursive,
            mode: *mode,
            now_ms: *now_ms,
            owner: owner.map(Into::into),
        }),
        Command::CreateFile {
            path,
            mode,
            block_size,
            now_ms,
            overwrite,
            owner,
            creator,
        } => P::CreateFile(pb::CreateFile {
            path: path.clone(),
            mode: *mode,
            block_size: *block_size,
            now_ms: *now_ms,
            overwrite: *overwrite,
            owner: owner.map(Into::into),
            creator: creator.clone(),
        }),
        Command::CompleteFile {
            inode,
            length,
            fingerprint,
            now_ms,
            version,
            persist,
            persist_worker,
        } => P::CompleteFile(pb::CompleteFile {
            inode: *inode,
            length: *length,
            fingerprint: fingerprint.as_ref().map(Into::into),
            now_ms: *now_ms,
            version: *version,
            persist: persist_to(*persist),
            persist_worker: *persist_worker,
        }),
        _ => return None,
    })
}

/// Every other command (None: one of the namespace's).
fn others_to(c: &Command) -> Option<pb::command::Command> {
    use pb::command::Command as P;
    Some(match c {
        Command::AddMount { path, spec, now_ms } => P::AddMount(pb::AddMount {
            path: path.clone(),
            spec: Some(spec_to(spec)),
            now_ms: *now_ms,
        }),
        Command::RemoveMount { path } => P::RemoveMount(pb::RemoveMount { path: path.clone() }),
        Command::DecommissionWorker { worker_id } => P::DecommissionWorker(pb::Worker {
            worker_id: *worker_id,
        }),
        Command::RecommissionWorker { worker_id } => P::RecommissionWorker(pb::Worker {
            worker_id: *worker_id,
        }),
        Command::FilePersisted {
            inode,
            version,
            fingerprint,
            ufs_path,
        } => P::FilePersisted(pb::FilePersisted {
            inode: *inode,
            version: *version,
            fingerprint: Some(fingerprint.into()),
            ufs_path: ufs_path.clone(),
        }),
        Command::Delete { path, recursive } => P::Delete(pb::Delete {
            path: path.clone(),
            recursive: *recursive,
        }),
        Command::Rename { src, dst, now_ms } => P::Rename(pb::Rename {
            src: src.clone(),
            dst: dst.clone(),
            now_ms: *now_ms,
        }),
        Command::SetTtl { path, ttl } => P::SetTtl(pb::SetTtl {
            path: path.clone(),
            ttl: ttl.as_ref().map(Into::into),
        }),
        Command::EndTtl { inode, was } => P::EndTtl(pb::EndTtl {
            inode: *inode,
            was: Some(was.into()),
        }),
        Command::SetPin { path, replicas } => P::SetPin(pb::SetPin {
            path: path.clone(),
            replicas: *replicas,
        }),
        Command::CreateJob {
            kind,
            path,
            replicas,
            now_ms,
        } => P::CreateJob(pb::CreateJob {
            kind: kind.clone(),
            path: path.clone(),
            replicas: *replicas,
            now_ms: *now_ms,
        }),
        Command::JobPlanned {
            id,
            total_files,
            total_bytes,
        } => P::JobPlanned(pb::JobPlanned {
            id: *id,
            total_files: *total_files,
            total_bytes: *total_bytes,
        }),
        Command::JobProgress {
            id,
            done,
            failed,
            fetched_bytes,
        } => P::JobProgress(pb::JobProgress {
            id: *id,
            done: done
                .iter()
                .map(|d| pb::DoneFile {
                    inode: d.inode,
                    length: d.length,
                })
                .collect(),
            failed: failed.iter().map(Into::into).collect(),
            fetched_bytes: *fetched_bytes,
        }),
        Command::UseFormat { version } => P::UseFormat(pb::UseFormat { version: *version }),
        Command::FinishJob {
            id,
            state,
            error,
            now_ms,
        } => P::FinishJob(pb::FinishJob {
            id: *id,
            state: job_state_to(*state),
            error: error.clone(),
            now_ms: *now_ms,
        }),
        _ => return None,
    })
}

impl TryFrom<pb::Command> for Command {
    type Error = Bad;
    fn try_from(c: pb::Command) -> Result<Self, Bad> {
        use pb::command::Command as P;
        Ok(match needed("command", c.command)? {
            P::LoadDir(c) => Command::LoadDir {
                dir: c.dir,
                mount_id: c.mount_id,
                entries: entries_from(c.entries)?,
                now_ms: c.now_ms,
                block_size: c.block_size,
            },
            P::SyncDir(c) => Command::SyncDir {
                dir: c.dir,
                mount_id: c.mount_id,
                entries: entries_from(c.entries)?,
                now_ms: c.now_ms,
                block_size: c.block_size,
                seen: c.seen.map(|s| s.versions),
                batch: c.batch.map(|b| SyncBatch {
                    removed: b.removed,
                    last: b.last,
                }),
            },
            P::AddUfsChild(c) => Command::AddUfsChild {
                dir: c.dir,
                mount_id: c.mount_id,
                entry: needed("entry", c.entry)?.try_into()?,
                now_ms: c.now_ms,
                block_size: c.block_size,
            },
            P::RefreshFile(c) => Command::RefreshFile {
                inode: c.inode,
                fingerprint: needed("fingerprint", c.fingerprint)?.into(),
                seen_version: c.seen_version,
            },
            P::Mkdir(c) => Command::Mkdir {
                path: c.path,
                recursive: c.recursive,
                mode: c.mode,
                now_ms: c.now_ms,
                owner: c.owner.map(Into::into),
            },
            P::CreateFile(c) => Command::CreateFile {
                path: c.path,
                mode: c.mode,
                block_size: c.block_size,
                now_ms: c.now_ms,
                overwrite: c.overwrite,
                owner: c.owner.map(Into::into),
                creator: c.creator,
            },
            P::CompleteFile(c) => Command::CompleteFile {
                inode: c.inode,
                length: c.length,
                fingerprint: c.fingerprint.map(Into::into),
                now_ms: c.now_ms,
                version: c.version,
                persist: persist_from(c.persist)?,
                persist_worker: c.persist_worker,
            },
            other => others_from(other)?,
        })
    }
}

fn others_from(c: pb::command::Command) -> Result<Command, Bad> {
    use pb::command::Command as P;
    Ok(match c {
        P::AddMount(c) => Command::AddMount {
            path: c.path,
            spec: spec_from(needed("under-store", c.spec)?),
            now_ms: c.now_ms,
        },
        P::RemoveMount(c) => Command::RemoveMount { path: c.path },
        P::DecommissionWorker(c) => Command::DecommissionWorker {
            worker_id: c.worker_id,
        },
        P::RecommissionWorker(c) => Command::RecommissionWorker {
            worker_id: c.worker_id,
        },
        P::FilePersisted(c) => Command::FilePersisted {
            inode: c.inode,
            version: c.version,
            fingerprint: needed("fingerprint", c.fingerprint)?.into(),
            ufs_path: c.ufs_path,
        },
        P::Delete(c) => Command::Delete {
            path: c.path,
            recursive: c.recursive,
        },
        P::Rename(c) => Command::Rename {
            src: c.src,
            dst: c.dst,
            now_ms: c.now_ms,
        },
        P::SetTtl(c) => Command::SetTtl {
            path: c.path,
            ttl: c.ttl.map(TryInto::try_into).transpose()?,
        },
        P::EndTtl(c) => Command::EndTtl {
            inode: c.inode,
            was: needed("TTL", c.was)?.try_into()?,
        },
        P::SetPin(c) => Command::SetPin {
            path: c.path,
            replicas: c.replicas,
        },
        P::CreateJob(c) => Command::CreateJob {
            kind: c.kind,
            path: c.path,
            replicas: c.replicas,
            now_ms: c.now_ms,
        },
        P::JobPlanned(c) => Command::JobPlanned {
            id: c.id,
            total_files: c.total_files,
            total_bytes: c.total_bytes,
        },
        P::JobProgress(c) => Command::JobProgress {
            id: c.id,
            done: c
                .done
                .into_iter()
                .map(|d| DoneFile {
                    inode: d.inode,
                    length: d.length,
                })
                .collect(),
            failed: c
                .failed
                .into_iter()
                .map(TryInto::try_into)
                .collect::<Result<_, _>>()?,
            fetched_bytes: c.fetched_bytes,
        },
        P::UseFormat(c) => Command::UseFormat { version: c.version },
        P::FinishJob(c) => Command::FinishJob {
            id: c.id,
            state: job_state_from(c.state)?,
            error: c.error,
            now_ms: c.now_ms,
        },
        // `Command::try_from` converts the namespace's commands.
        P::LoadDir(_)
        | P::SyncDir(_)
        | P::AddUfsChild(_)
        | P::RefreshFile(_)
        | P::Mkdir(_)
        | P::CreateFile(_)
        | P::CompleteFile(_) => return Err("a namespace command out of place".into()),
    })
}

impl Proposal {
    /// A Raft entry's data: the format version, then the proposal.
    pub fn encode(&self) -> Vec<u8> {
        Self::encode_of(self.request_id, self.at_ms, &self.cmd)
    }

    /// [`Proposal::encode`] of a proposal of these parts.
    pub fn encode_of(request_id: u64, at_ms: i64, cmd: &Command) -> Vec<u8> {
        let m = pb::Proposal {
            request_id,
            at_ms,
            cmd: Some(cmd.into()),
        };
        let mut out = Vec::with_capacity(1 + m.encoded_len());
        out.push(FORMAT_VERSION);
        out.extend_from_slice(&m.encode_to_vec());
        out
    }

    /// Decodes a Raft entry's data: format 1, or the JSON of the releases before it
    /// (entries written before request ids existed hold a bare command).
    pub fn decode(data: &[u8]) -> Result<Self, String> {
        match data.first() {
            Some(&FORMAT_VERSION) => {
                let m = pb::Proposal::decode(&data[1..]).map_err(|e| e.to_string())?;
                Ok(Self {
                    request_id: m.request_id,
                    at_ms: m.at_ms,
                    cmd: needed("command", m.cmd)?.try_into()?,
                })
            }
            Some(b'{') => serde_json::from_slice::<Self>(data)
                .or_else(|_| {
                    serde_json::from_slice::<Command>(data).map(|cmd| Self {
                        request_id: 0,
                        at_ms: 0,
                        cmd,
                    })
                })
                .map_err(|e| format!("JSON of a release before format 1: {e}")),
            Some(v) => Err(format!(
                "format {v}; this master reads format {FORMAT_VERSION} and the JSON before it \
                 (written by a newer release?)"
            )),
            None => Err("no data".into()),
        }
    }
}
