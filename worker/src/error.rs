//! The worker's request errors and their one mapping onto gRPC status codes, as the
//! master's `MasterError` has: what a caller may do next follows from the variant (and so
//! from the code and its metadata), never from the message's text.

use granary_proto as pb;
use thiserror::Error;

use crate::ufs_fetch::FetchError;

#[derive(Debug, Error)]
pub enum RpcError {
    /// A malformed request: sending it again changes nothing (INVALID_ARGUMENT).
    #[error("{0}")]
    Invalid(String),
    /// A byte range outside the block (OUT_OF_RANGE).
    #[error("{0}")]
    OutOfRange(String),
    /// What a cached-only read or a lease asked for is not cached here (NOT_FOUND): read it
    /// another way.
    #[error("{0}")]
    NotCached(String),
    /// This worker already took the write (ALREADY_EXISTS).
    #[error("{0}")]
    AlreadyTaken(String),
    /// The request does not fit the state of the file or of this worker
    /// (FAILED_PRECONDITION).
    #[error("{0}")]
    Precondition(String),
    /// Try again, here or elsewhere (UNAVAILABLE).
    #[error("{0}")]
    Unavailable(String),
    /// The caller went away or gave the request up (ABORTED).
    #[error("{0}")]
    Aborted(String),
    /// The worker's disk is full (RESOURCE_EXHAUSTED; a mount reports ENOSPC).
    #[error("{0}")]
    NoSpace(String),
    /// More than the worker takes at once (RESOURCE_EXHAUSTED).
    #[error("{0}")]
    TooMuch(String),
    /// The request's grant does not cover it (PERMISSION_DENIED, marked as a grant refusal:
    /// a new grant may help).
    #[error("{0}")]
    GrantRefused(String),
    /// The worker failed in a way the caller cannot mend (INTERNAL).
    #[error("{0}")]
    Internal(String),
    /// Fetching from a peer or the under-store failed.
    #[error(transparent)]
    Fetch(#[from] FetchError),
}

impl RpcError {
    /// A failed local file operation: ENOSPC is the disk being full, anything else internal.
    pub fn io(what: &str, e: std::io::Error) -> Self {
        if e.raw_os_error() == Some(pb::errno::ENOSPC) {
            return Self::NoSpace(format!("{what}: the worker's disk is full"));
        }
        Self::Internal(format!("{what}: {e}"))
    }
}

impl From<RpcError> for tonic::Status {
    fn from(e: RpcError) -> Self {
        use tonic::Status;
        let message = e.to_string();
        match e {
            RpcError::Invalid(_) => Status::invalid_argument(message),
            RpcError::OutOfRange(_) => Status::out_of_range(message),
            RpcError::NotCached(_) => Status::not_found(message),
            RpcError::AlreadyTaken(_) => Status::already_exists(message),
            RpcError::Precondition(_) => Status::failed_precondition(message),
            RpcError::Unavailable(_) => Status::unavailable(message),
            RpcError::Aborted(_) => Status::aborted(message),
            RpcError::NoSpace(_) => {
                let mut s = Status::resource_exhausted(message);
                s.metadata_mut().insert(
                    pb::ERRNO_KEY,
                    tonic::metadata::MetadataValue::from(pb::errno::ENOSPC),
                );
                s
            }
            RpcError::TooMuch(_) => Status::resource_exhausted(message),
            RpcError::GrantRefused(_) => granary_common::grant::grant_denial(message),
            RpcError::Internal(_) => Status::internal(message),
            RpcError::Fetch(f) => match f {
                FetchError::Changed(_) => Status::aborted(message),
                FetchError::NotFound(_) | FetchError::NoPeer(_) => Status::not_found(message),
                FetchError::PermissionDenied(_) => Status::permission_denied(message),
                FetchError::Unavailable(_) => Status::unavailable(message),
            },
        }
    }
}

impl From<FetchError> for tonic::Status {
    fn from(e: FetchError) -> Self {
        RpcError::Fetch(e).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn each_error_has_its_code_and_a_full_disk_its_errno() {
        let cases: Vec<(RpcError, Code)> = vec![
            (RpcError::Invalid("x".into()), Code::InvalidArgument),
            (RpcError::OutOfRange("x".into()), Code::OutOfRange),
            (RpcError::NotCached("x".into()), Code::NotFound),
            (RpcError::AlreadyTaken("x".into()), Code::AlreadyExists),
            (RpcError::Precondition("x".into()), Code::FailedPrecondition),
            (RpcError::Unavailable("x".into()), Code::Unavailable),
            (RpcError::Aborted("x".into()), Code::Aborted),
            (RpcError::NoSpace("x".into()), Code::ResourceExhausted),
            (RpcError::TooMuch("x".into()), Code::ResourceExhausted),
            (RpcError::GrantRefused("x".into()), Code::PermissionDenied),
            (RpcError::Internal("x".into()), Code::Internal),
            (FetchError::Changed("x".into()).into(), Code::Aborted),
            (FetchError::NotFound("x".into()).into(), Code::NotFound),
            (FetchError::NoPeer("x".into()).into(), Code::NotFound),
            (
                FetchError::PermissionDenied("x".into()).into(),
                Code::PermissionDenied,
            ),
            (
                FetchError::Unavailable("x".into()).into(),
                Code::Unavailable,
            ),
        ];
        for (e, code) in cases {
            let errno = matches!(e, RpcError::NoSpace(_));
            let grant = matches!(e, RpcError::GrantRefused(_));
            let s = tonic::Status::from(e);
            assert_eq!(s.code(), code, "{s:?}");
            assert_eq!(s.metadata().get(pb::ERRNO_KEY).is_some(), errno, "{s:?}");
            assert_eq!(granary_common::grant::is_grant_denial(&s), grant, "{s:?}");
        }
        let full = std::io::Error::from_raw_os_error(pb::errno::ENOSPC);
        let s = tonic::Status::from(RpcError::io("writing the journal", full));
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(
            s.metadata().get(pb::ERRNO_KEY).map(|v| v.to_str().unwrap()),
            Some("28")
        );
        let other = std::io::Error::from_raw_os_error(5);
        assert_eq!(
            tonic::Status::from(RpcError::io("x", other)).code(),
            Code::Internal
        );
    }
}
