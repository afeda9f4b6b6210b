//! Records of the replicated state machine, as stored in RocksDB (column family `state`)
//! in the binary format of [`super::format`]. Their serde forms are the JSON of the
//! releases before that format: read once, to upgrade an older store, and from the Raft
//! entries such a release proposes. Commands are the only way the state changes; each carries everything its
//! apply needs (including the proposer's clock), so apply is deterministic on every replica.

use granary_common::ufs::UfsSpec;
use serde::{Deserialize, Serialize};

pub const ROOT_INODE: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    File,
    Directory,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    #[serde(default)]
    pub etag: String,
    #[serde(default)]
    pub size: u64,
    #[serde(default)]
    pub mtime_ms: i64,
    #[serde(default)]
    pub version_id: String,
}

impl Fingerprint {
    /// Do two fingerprints (e.g. one from a listing, one from a HEAD) name the same object?
    /// ETags decide when both have one (quotes aside); otherwise size and modification time
    /// to the second (`Last-Modified` has no finer precision; listings often do).
    pub fn same_object(&self, other: &Fingerprint) -> bool {
        use granary_common::ufs::bare_etag;
        if !self.etag.is_empty() && !other.etag.is_empty() {
            return bare_etag(&self.etag) == bare_etag(&other.etag) && self.size == other.size;
        }
        self.size == other.size && self.mtime_ms.div_euclid(1000) == other.mtime_ms.div_euclid(1000)
    }

    /// The wire form (also the input of `granary_common::ids::version_of`).
    pub fn to_proto(&self) -> granary_proto::Fingerprint {
        granary_proto::Fingerprint {
            etag: self.etag.clone(),
            size: self.size,
            mtime_ms: self.mtime_ms,
            version_id: self.version_id.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inode {
    pub id: u64,
    pub parent: u64,
    pub name: String,
    pub kind: Kind,
    #[serde(default)]
    pub mode: u32,
    #[serde(default)]
    pub mtime_ms: i64,
    #[serde(default)]
    pub length: u64,
    #[serde(default)]
    pub block_size: u64,
    #[serde(default)]
    pub fingerprint: Option<Fingerprint>,
    /// Hash of the fingerprint (see `granary_common::ids::version_of`).
    #[serde(default)]
    pub version: u64,
    /// The mount this entry belongs to (None: exists only in Granary).
    #[serde(default)]
    pub mount_id: Option<u64>,
    /// Path relative to the mount root, `/`-separated, empty for the mount point.
    #[serde(default)]
    pub ufs_path: String,
    #[serde(default)]
    pub is_mount_point: bool,
    /// For directories in a mount: children were loaded from the under-store.
    #[serde(default)]
    pub children_loaded: bool,
    #[serde(default = "yes")]
    pub complete: bool,
    /// Owner recorded at create (mkdir/create through a mount that passes its caller);
    /// None: the mount's default owner, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
    /// Whether the under-store holds this version (files written through Granary).
    #[serde(default)]
    pub persist: Persist,
    /// For `Persist::Pending`: the worker uploading it.
    #[serde(default)]
    pub persist_worker: u64,
    /// Made through Granary inside a mount (mkdir, a written file): a re-listing that does
    /// not show it yet (a directory with nothing uploaded under it, a file just uploaded
    /// while the listing ran) keeps it.
    #[serde(default)]
    pub created: bool,
    /// The principal writing this version (a file created or replaced through Granary, until
    /// it is complete): only it, or an admin, may complete it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creator: Option<String>,
    /// For folders in a mount: when the leader last listed it from the store (the
    /// proposer's clock), recorded with the listing, so followers know how fresh what they
    /// hold is (see `namespace::follower`). 0: not recorded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub listed_ms: i64,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

fn yes() -> bool {
    true
}

/// Persistence of a file's current version.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Persist {
    /// The under-store has it (every file listed from one).
    #[default]
    Persisted,
    /// Written async-through: cached and pinned on workers, being uploaded.
    Pending,
    /// Written must-cache (or outside any mount): cached only, not durable.
    NotPersisted,
}

impl Persist {
    pub fn to_proto(self) -> granary_proto::PersistState {
        match self {
            Persist::Persisted => granary_proto::PersistState::Persisted,
            Persist::Pending => granary_proto::PersistState::Pending,
            Persist::NotPersisted => granary_proto::PersistState::NotPersisted,
        }
    }

    pub fn from_proto(p: i32) -> Self {
        match granary_proto::PersistState::try_from(p) {
            Ok(granary_proto::PersistState::Pending) => Persist::Pending,
            Ok(granary_proto::PersistState::NotPersisted) => Persist::NotPersisted,
            _ => Persist::Persisted,
        }
    }
}

impl Inode {
    /// A directory that exists only in Granary (not loaded from an under-store).
    pub fn directory(id: u64, parent: u64, name: &str, mode: u32, mtime_ms: i64) -> Self {
        Self {
            id,
            parent,
            name: name.to_string(),
            kind: Kind::Directory,
            mode,
            mtime_ms,
            length: 0,
            block_size: 0,
            fingerprint: None,
            version: 0,
            mount_id: None,
            ufs_path: String::new(),
            is_mount_point: false,
            children_loaded: true,
            complete: true,
            persist: Persist::Persisted,
            persist_worker: 0,
            created: false,
            owner: None,
            creator: None,
            listed_ms: 0,
        }
    }

    /// A re-listing of its directory that does not show this entry leaves it alone: being
    /// written, not uploaded yet, a directory made here, or a file uploaded so recently
    /// that the listing may predate it.
    pub fn kept_when_unlisted(&self, now_ms: i64) -> bool {
        !self.complete
            || self.persist != Persist::Persisted
            || (self.created
                && (self.kind == Kind::Directory || self.mtime_ms > now_ms - RECENT_WRITE_MS))
    }

    /// A file whose current version the store does not hold (being written, pending,
    /// must-cache): its object is not compared with the store.
    pub fn not_in_store(&self) -> bool {
        self.kind == Kind::File && (!self.complete || self.persist != Persist::Persisted)
    }

    /// A re-listing leaves its fingerprint alone (the upload records it).
    pub fn being_written(&self) -> bool {
        !self.complete || self.persist == Persist::Pending
    }
}

/// How long a file uploaded through Granary is kept when a listing does not show it.
pub const RECENT_WRITE_MS: i64 = 60_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount {
    pub id: u64,
    pub path: String,
    pub inode: u64,
    pub spec: UfsSpec,
}

/// One entry of an under-store directory listing, as loaded by the leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UfsEntry {
    pub name: String,
    pub kind: Kind,
    #[serde(default)]
    pub fingerprint: Option<Fingerprint>,
}

/// The owner of an entry (POSIX uid and gid).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// A state-machine command. Adding a variant or a defaulted field is backwards compatible.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    AddMount {
        path: String,
        spec: UfsSpec,
        now_ms: i64,
    },
    RemoveMount {
        path: String,
    },
    /// A worker is decommissioned: clients place no blocks on it (it keeps serving peers).
    /// Replicated so the mark survives a master failover and a worker restart.
    DecommissionWorker {
        worker_id: u64,
    },
    /// Undoes `DecommissionWorker`: blocks are placed on the worker again.
    RecommissionWorker {
        worker_id: u64,
    },
    /// Records the children of a mounted directory as listed from the under-store.
    LoadDir {
        dir: u64,
        mount_id: u64,
        entries: Vec<UfsEntry>,
        now_ms: i64,
        block_size: u64,
    },
    /// Brings a loaded directory of a mount in line with a fresh listing: new entries are
    /// added, vanished ones removed (with everything below), files whose fingerprint
    /// changed take the new one (a new version: old cached pages no longer match).
    SyncDir {
        dir: u64,
        mount_id: u64,
        entries: Vec<UfsEntry>,
        now_ms: i64,
        block_size: u64,
        /// Name → version of the entries known when the listing started: an entry changed
        /// or added since (by a newer lookup) is left alone. None: reconcile everything.
        #[serde(default)]
        seen: Option<std::collections::BTreeMap<String, u64>>,
        /// Batched form (large directories span several entries): `entries` are only the
        /// entries to add or update and `removed` the names to remove; only the last batch
        /// marks the directory listed. None: `entries` is the whole listing.
        #[serde(default)]
        batch: Option<SyncBatch>,
    },
    /// One entry of a directory not listed yet, found by a HEAD (or a prefixed list) when a
    /// known path was looked up: the directory stays unlisted.
    AddUfsChild {
        dir: u64,
        mount_id: u64,
        entry: UfsEntry,
        now_ms: i64,
        block_size: u64,
    },
    /// A file's fingerprint as checked against the under-store (validate-on-open).
    RefreshFile {
        inode: u64,
        fingerprint: Fingerprint,
        /// The version the proposer saw before its HEAD: if the file moved on since, the
        /// (older) HEAD is not applied.
        #[serde(default)]
        seen_version: Option<u64>,
    },
    Mkdir {
        path: String,
        recursive: bool,
        mode: u32,
        now_ms: i64,
        /// Owner of the directories made (None: the mount's default).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<Owner>,
    },
    CreateFile {
        path: String,
        mode: u32,
        block_size: u64,
        now_ms: i64,
        /// Replace an existing file: same inode, new version, empty until completed.
        #[serde(default)]
        overwrite: bool,
        /// Owner of a new file (a replaced file keeps its owner).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<Owner>,
        /// The principal creating it (who may complete it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        creator: Option<String>,
    },
    CompleteFile {
        inode: u64,
        length: u64,
        fingerprint: Option<Fingerprint>,
        now_ms: i64,
        /// The version it was created with; the file must still have it (None: older
        /// proposers, the version follows the fingerprint).
        #[serde(default)]
        version: Option<u64>,
        #[serde(default)]
        persist: Persist,
        #[serde(default)]
        persist_worker: u64,
    },
    /// A pending file was uploaded: record the store's fingerprint, keep the version.
    FilePersisted {
        inode: u64,
        version: u64,
        fingerprint: Fingerprint,
        ufs_path: String,
    },
    Delete {
        path: String,
        recursive: bool,
    },
    Rename {
        src: String,
        dst: String,
        now_ms: i64,
    },
    /// Sets (or with None removes) the TTL of a path; see `state::ttl`.
    SetTtl {
        path: String,
        ttl: Option<super::ttl::Ttl>,
    },
    /// A TTL was acted on: removed unless it changed meanwhile.
    EndTtl {
        inode: u64,
        was: super::ttl::Ttl,
    },
    /// Pins a path with `replicas` (0: unpins it); see `state::pins`.
    SetPin {
        path: String,
        replicas: u32,
    },
    /// A new job (see `state::jobs`).
    CreateJob {
        kind: String,
        path: String,
        replicas: u32,
        now_ms: i64,
    },
    /// The job's files are enumerated: it runs.
    JobPlanned {
        id: u64,
        total_files: u64,
        total_bytes: u64,
    },
    /// Files the job finished or gave up on since the last report.
    JobProgress {
        id: u64,
        #[serde(default)]
        done: Vec<super::jobs::DoneFile>,
        #[serde(default)]
        failed: Vec<super::jobs::FailedFile>,
        #[serde(default)]
        fetched_bytes: u64,
    },
    /// Every voter reads Raft entries of format `version`: leaders propose them in it from
    /// now on (see `state::format`). A lower version than the one in use changes nothing.
    UseFormat {
        version: u32,
    },
    /// The job ended (succeeded, failed, cancelled); nothing changes if it already had.
    FinishJob {
        id: u64,
        state: super::jobs::JobState,
        #[serde(default)]
        error: String,
        now_ms: i64,
    },
}

/// One batch of a directory's re-listing (see `Command::SyncDir`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncBatch {
    #[serde(default)]
    pub removed: Vec<String>,
    #[serde(default)]
    pub last: bool,
}

/// What applying a command produced, handed back to the proposer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ApplyOutput {
    None,
    Inode(Inode),
    Mount(Mount),
    Job(super::jobs::Job),
}

/// What a Raft log entry carries: a command, the client's request id (0 = none) and the
/// leader's clock when it was proposed (used to expire remembered request outcomes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    #[serde(default)]
    pub request_id: u64,
    #[serde(default)]
    pub at_ms: i64,
    pub cmd: Command,
}

/// The remembered outcome of a request id.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RequestOutcome {
    pub at_ms: i64,
    pub result: Result<ApplyOutput, crate::error::MasterError>,
}

#[cfg(test)]
mod tests {
    use super::Fingerprint;

    fn fp(etag: &str) -> Fingerprint {
        Fingerprint {
            etag: etag.into(),
            size: 7,
            mtime_ms: 0,
            version_id: String::new(),
        }
    }

    #[test]
    fn an_etag_is_the_same_however_it_is_quoted() {
        // GCS lists a base64 MD5 bare and sends it quoted; one in 4,096 begins with `W/`.
        assert!(fp("W/Jgw/R5W7gtUNfkgH5Wrw==").same_object(&fp("\"W/Jgw/R5W7gtUNfkgH5Wrw==\"")));
        assert!(fp("W/\"abc\"").same_object(&fp("\"abc\"")));
        assert!(fp("abc").same_object(&fp("\"abc\"")));
        assert!(!fp("W/abc").same_object(&fp("abc")));
    }
}
