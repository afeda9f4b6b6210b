//! The master's error type and its one mapping onto gRPC status codes.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum MasterError {
    #[error("no such file or directory: {path}")]
    NotFound { path: String },
    #[error("no such job: {id} (`granary job list` shows the jobs kept)")]
    NoSuchJob { id: u64 },
    #[error("already exists: {path}")]
    AlreadyExists { path: String },
    #[error("{message}")]
    InvalidArgument { message: String },
    #[error("{message}")]
    FailedPrecondition { message: String },
    #[error("not a directory: {path}")]
    NotADirectory { path: String },
    #[error("directory not empty: {path}")]
    NotEmpty { path: String },
    #[error("cannot move {src} to {dst}: they are in different mounts (copy, then delete)")]
    CrossMount { src: String, dst: String },
    /// A folder move that would rewrite more entries than one apply may: refused before
    /// the store is touched, never a command's recorded outcome.
    #[error("cannot move {path}: it holds more than {limit} entries, and a move changes each of them at once (move what it holds a part at a time, or copy it, then delete it)")]
    MoveTooBig { path: String, limit: u64 },
    #[error("is a directory: {path}")]
    IsADirectory { path: String },
    #[error("{path} is in the read-only mount {mount}")]
    ReadOnly { path: String, mount: String },
    #[error("{message}")]
    PermissionDenied { message: String },
    #[error("this master is not the leader")]
    NotLeader { leader_hint: Option<String> },
    #[error("{message}")]
    Unavailable { message: String },
    #[error("cannot remove or move {path}: the mount point {mount} is at or below it (remove the mount first: `granary mount remove {mount}`)")]
    Busy { path: String, mount: String },
    /// The replicated state breaks one of its rules (a record naming a missing one). The
    /// same on every member, so it is the command's result, never a reason to stop.
    #[error(
        "the namespace is inconsistent: {message} (see docs/operations.md, \"Inconsistent state\")"
    )]
    Inconsistent { message: String },
    #[error("master storage is corrupt or inconsistent: {message}")]
    Corrupt { message: String },
    #[error("storage error: {message}")]
    Storage { message: String },
    #[error("the master is shutting down")]
    ShuttingDown,
}

impl MasterError {
    pub fn corrupt(message: impl Into<String>) -> Self {
        Self::Corrupt {
            message: message.into(),
        }
    }
    pub fn inconsistent(message: impl Into<String>) -> Self {
        Self::Inconsistent {
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidArgument {
            message: message.into(),
        }
    }
    pub fn precondition(message: impl Into<String>) -> Self {
        Self::FailedPrecondition {
            message: message.into(),
        }
    }
    pub fn not_found(path: impl Into<String>) -> Self {
        Self::NotFound { path: path.into() }
    }
    /// A failure of this master's own storage (not a deterministic outcome of a command):
    /// applying must stop rather than record it.
    pub fn is_local_failure(&self) -> bool {
        matches!(self, Self::Storage { .. } | Self::Corrupt { .. })
    }
}

impl From<rocksdb::Error> for MasterError {
    fn from(e: rocksdb::Error) -> Self {
        Self::Storage {
            message: e.to_string(),
        }
    }
}

impl From<granary_common::paths::PathError> for MasterError {
    fn from(e: granary_common::paths::PathError) -> Self {
        Self::invalid(e.to_string())
    }
}

impl From<granary_common::ufs::UfsError> for MasterError {
    fn from(e: granary_common::ufs::UfsError) -> Self {
        use granary_common::ufs::UfsError as U;
        match e {
            // The store's configuration was rejected while building its client.
            U::Open { .. } => Self::invalid(e.to_string().replace('\n', " ")),
            U::Probe { message } => Self::precondition(message),
            _ => Self::invalid(e.to_string()),
        }
    }
}

use granary_proto::errno as libc_errno;
pub use granary_proto::LEADER_HINT_KEY;

impl From<MasterError> for tonic::Status {
    fn from(e: MasterError) -> Self {
        use tonic::Code;
        let code = match &e {
            MasterError::NotFound { .. } | MasterError::NoSuchJob { .. } => Code::NotFound,
            MasterError::AlreadyExists { .. } => Code::AlreadyExists,
            MasterError::InvalidArgument { .. } => Code::InvalidArgument,
            MasterError::FailedPrecondition { .. }
            | MasterError::NotADirectory { .. }
            | MasterError::NotEmpty { .. }
            | MasterError::CrossMount { .. }
            | MasterError::MoveTooBig { .. }
            | MasterError::IsADirectory { .. }
            | MasterError::ReadOnly { .. }
            | MasterError::Busy { .. } => Code::FailedPrecondition,
            MasterError::NotLeader { .. }
            | MasterError::Unavailable { .. }
            | MasterError::ShuttingDown => Code::Unavailable,
            MasterError::Corrupt { .. }
            | MasterError::Storage { .. }
            | MasterError::Inconsistent { .. } => Code::Internal,
            MasterError::PermissionDenied { .. } => Code::PermissionDenied,
        };
        let mut status = tonic::Status::new(code, e.to_string());
        // The precise POSIX outcome, for the FUSE client (codes alone merge several).
        let errno = match &e {
            MasterError::NotADirectory { .. } => Some(libc_errno::ENOTDIR),
            MasterError::NotEmpty { .. } => Some(libc_errno::ENOTEMPTY),
            // `mv` then copies and deletes, a file at a time.
            MasterError::CrossMount { .. } | MasterError::MoveTooBig { .. } => {
                Some(libc_errno::EXDEV)
            }
            MasterError::IsADirectory { .. } => Some(libc_errno::EISDIR),
            MasterError::ReadOnly { .. } => Some(libc_errno::EROFS),
            MasterError::Busy { .. } => Some(libc_errno::EBUSY),
            _ => None,
        };
        if let Some(n) = errno {
            status.metadata_mut().insert(
                granary_proto::ERRNO_KEY,
                tonic::metadata::MetadataValue::from(n),
            );
        }
        if let MasterError::NotLeader {
            leader_hint: Some(hint),
        } = &e
        {
            if let Ok(v) = hint.parse() {
                status.metadata_mut().insert(LEADER_HINT_KEY, v);
            }
        }
        status
    }
}
