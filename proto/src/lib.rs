//! Granary's wire contract: the `.proto` files under `proto/` and the tonic/prost code
//! generated from them. Nothing else speaks on the wire.

#![allow(clippy::all, missing_docs)]

/// Version 1 of the wire contract.
pub mod v1 {
    tonic::include_proto!("granary.v1");
}

pub use v1::*;

/// The masters' replicated state as stored (RocksDB records, Raft entries): not a wire
/// contract, but versioned like one (see `proto/granary/state/v1/state.proto`).
pub mod state {
    pub mod v1 {
        tonic::include_proto!("granary.state.v1");
    }
}

/// The Container Storage Interface's Identity and Node services (the spec's package
/// `csi.v1`), served by `granary csi` to the kubelet.
pub mod csi {
    pub mod v1 {
        tonic::include_proto!("csi.v1");
    }
}

/// The message encoding, for the framed streams that carry these messages outside gRPC
/// (the block data plane).
pub use prost;

/// Largest gRPC message Granary sends or accepts (block reads stream 1 MiB chunks).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// gRPC metadata key carrying the Linux errno that fits an error precisely (ENOTEMPTY,
/// ENOTDIR, EXDEV, EISDIR, EROFS…), where the status code alone would merge several; the
/// values are [`errno`]'s.
pub const ERRNO_KEY: &str = "granary-errno";

/// The Linux errno values sent in [`ERRNO_KEY`] (the wire carries numbers, so they are
/// fixed here rather than taken from the sender's libc).
pub mod errno {
    pub const EBUSY: i32 = 16;
    pub const EXDEV: i32 = 18;
    pub const ENOTDIR: i32 = 20;
    pub const EISDIR: i32 = 21;
    pub const ENOSPC: i32 = 28;
    pub const EROFS: i32 = 30;
    pub const ENOTEMPTY: i32 = 39;
}

/// gRPC metadata key carrying the leader's address on a master's `NotLeader` status.
pub const LEADER_HINT_KEY: &str = "granary-leader";
/// gRPC metadata a worker adds to a `PERMISSION_DENIED` that refuses the request's read
/// grant (value [`GRANT_REFUSAL`]): a new grant from the master may help, which a refusal
/// of the caller itself would not.
pub const REFUSAL_KEY: &str = "granary-refusal";
pub const GRANT_REFUSAL: &str = "grant";
/// gRPC metadata a FUSE mount adds to namespace requests: the uid and gid of the local
/// process it acts for (owner of what it creates; checked against entries' modes).
pub const CALLER_UID_KEY: &str = "granary-uid";
pub const CALLER_GID_KEY: &str = "granary-gid";

impl WorkerState {
    /// The text `WorkerInfo.state` carries.
    pub fn text(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Draining => "draining",
            Self::Lost => "lost",
            Self::Unspecified => "",
        }
    }
}

impl WorkerInfo {
    /// The worker's state (from the text an older master sent when the code is not set).
    pub fn worker_state(&self) -> WorkerState {
        match self.state_code() {
            WorkerState::Unspecified => match self.state.as_str() {
                "live" => WorkerState::Live,
                "draining" => WorkerState::Draining,
                "lost" => WorkerState::Lost,
                _ => WorkerState::Unspecified,
            },
            s => s,
        }
    }

    pub fn is_live(&self) -> bool {
        self.worker_state() == WorkerState::Live
    }
}

impl JobState {
    /// The text `JobInfo.state` carries.
    pub fn text(self) -> &'static str {
        match self {
            Self::Planning => "planning",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Unspecified => "",
        }
    }

    /// Whether a job in this state has ended.
    pub fn finished(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

impl JobKind {
    pub fn text(self) -> &'static str {
        match self {
            Self::Load => "load",
            Self::Unspecified => "",
        }
    }

    /// The kind a request names: its code, else its text (older clients); None: unknown
    /// (a code no version defines is not overruled by the text).
    pub fn requested(code: i32, text: &str) -> Option<JobKind> {
        match JobKind::try_from(code) {
            Ok(JobKind::Unspecified) => match text {
                "load" => Some(JobKind::Load),
                _ => None,
            },
            Ok(k) => Some(k),
            Err(_) => None,
        }
    }
}

impl JobInfo {
    /// The job's state (from the text an older master sent when the code is not set).
    pub fn job_state(&self) -> JobState {
        match self.state_code() {
            JobState::Unspecified => match self.state.as_str() {
                "planning" => JobState::Planning,
                "running" => JobState::Running,
                "succeeded" => JobState::Succeeded,
                "failed" => JobState::Failed,
                "cancelled" => JobState::Cancelled,
                _ => JobState::Unspecified,
            },
            s => s,
        }
    }
}

impl TtlAction {
    pub fn text(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Delete => "delete",
            Self::Unspecified => "",
        }
    }

    /// The action a request names: its code, else its text (older clients; empty:
    /// free); None: unknown.
    pub fn requested(code: i32, text: &str) -> Option<TtlAction> {
        match TtlAction::try_from(code) {
            Ok(TtlAction::Unspecified) => match text {
                "free" | "" => Some(TtlAction::Free),
                "delete" => Some(TtlAction::Delete),
                _ => None,
            },
            Ok(a) => Some(a),
            Err(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_win_and_text_from_older_peers_is_understood() {
        // An older master sends only the text.
        let old = WorkerInfo {
            state: "draining".into(),
            ..Default::default()
        };
        assert_eq!(old.worker_state(), WorkerState::Draining);
        assert!(!old.is_live());
        let new = WorkerInfo {
            state: "lost".into(),
            state_code: WorkerState::Live as i32,
            ..Default::default()
        };
        assert!(new.is_live(), "the code decides");
        // A code no version defines, with no text: nothing is assumed.
        let odd = WorkerInfo {
            state_code: 99,
            ..Default::default()
        };
        assert_eq!(odd.worker_state(), WorkerState::Unspecified);
        let job = JobInfo {
            state: "cancelled".into(),
            ..Default::default()
        };
        assert!(job.job_state().finished());
        assert!(!JobInfo::default().job_state().finished());
        for s in [
            JobState::Planning,
            JobState::Running,
            JobState::Succeeded,
            JobState::Failed,
            JobState::Cancelled,
        ] {
            let by_text = JobInfo {
                state: s.text().into(),
                ..Default::default()
            };
            assert_eq!(by_text.job_state(), s);
        }
    }

    #[test]
    fn requests_name_kinds_and_actions_by_code_or_text_and_refuse_the_rest() {
        assert_eq!(
            JobKind::requested(JobKind::Load as i32, ""),
            Some(JobKind::Load)
        );
        assert_eq!(JobKind::requested(0, "load"), Some(JobKind::Load));
        assert_eq!(JobKind::requested(0, "LOAD"), None);
        assert_eq!(JobKind::requested(0, ""), None);
        assert_eq!(JobKind::requested(42, "load"), None, "an unknown code");
        assert_eq!(TtlAction::requested(0, ""), Some(TtlAction::Free));
        assert_eq!(TtlAction::requested(0, "delete"), Some(TtlAction::Delete));
        assert_eq!(
            TtlAction::requested(TtlAction::Delete as i32, "free"),
            Some(TtlAction::Delete)
        );
        assert_eq!(TtlAction::requested(7, "free"), None, "an unknown code");
        assert_eq!(TtlAction::requested(0, "evict"), None);
    }
}
