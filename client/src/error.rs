//! Client errors, converted from gRPC status in one place.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ClientError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    PermissionDenied(String),
    /// A worker refused the request's read grant (missing, expired, signed by a leader it
    /// does not know yet): a new grant may help.
    #[error("{0}")]
    GrantRefused(String),
    #[error("the file changed in the under-store while it was read: {0}")]
    Stale(String),
    #[error("{0}")]
    Internal(String),
    /// A refusal with a precise POSIX meaning (errno, message).
    #[error("{1}")]
    Posix(i32, String),
}

/// Errnos a server may name are below this (the kernel refuses a FUSE reply with an error
/// of 512 or more, which would leave the caller's system call waiting); another value is
/// ignored and the status code decides.
const MAX_ERRNO: i32 = 512;

impl ClientError {
    /// The error a status stands for, by its code and metadata (never by its text).
    pub fn from_status(s: tonic::Status) -> Self {
        Self::from_status_with(s, None)
    }

    /// As [`from_status`](Self::from_status), by a caller that knows whether it connected
    /// with TLS (`tls`): a failure that looks like a TLS mismatch then names its likely
    /// cause more precisely.
    pub fn from_status_with(s: tonic::Status, tls: Option<bool>) -> Self {
        use tonic::Code;
        let msg = s.message().to_string();
        if let Some(n) = s
            .metadata()
            .get(granary_proto::ERRNO_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i32>().ok())
            .filter(|n| (1..MAX_ERRNO).contains(n))
        {
            return Self::Posix(n, msg);
        }
        if granary_common::grant::is_grant_denial(&s) {
            return Self::GrantRefused(msg);
        }
        match s.code() {
            Code::NotFound => Self::NotFound(msg),
            Code::AlreadyExists => Self::AlreadyExists(msg),
            Code::InvalidArgument | Code::OutOfRange => Self::InvalidArgument(msg),
            Code::FailedPrecondition => Self::FailedPrecondition(msg),
            Code::Aborted => Self::Stale(msg),
            Code::DeadlineExceeded => Self::Timeout(msg),
            Code::PermissionDenied | Code::Unauthenticated => Self::PermissionDenied(msg),
            Code::Unavailable | Code::Cancelled | Code::Unknown | Code::ResourceExhausted => {
                Self::Unavailable(if msg.is_empty() {
                    "service unavailable".into()
                } else {
                    with_tls_hint(msg, tls)
                })
            }
            _ => Self::Internal(with_tls_hint(msg, tls)),
        }
    }

    /// Worth trying another replica or source?
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Unavailable(_) | Self::Timeout(_) | Self::Internal(_)
        )
    }
}

/// A failed connection whose message points at a TLS mismatch gets a hint of the likely
/// cause (a plaintext client meets a TLS server as an HTTP/2 protocol error); `tls`: whether
/// the caller connected with TLS, where it knows.
fn with_tls_hint(msg: String, tls: Option<bool>) -> String {
    let m = msg.to_ascii_lowercase();
    let tls_like = [
        "h2 protocol error",
        "certificate",
        "handshake",
        "tls",
        "alert",
        "corrupt message",
    ]
    .iter()
    .any(|w| m.contains(w));
    if !tls_like {
        return msg;
    }
    let hint = match tls {
        // Masters are verified by the name only master certificates carry.
        Some(true) | None if m.contains(granary_common::tls::MASTER_SERVER_NAME) => {
            "the server is not a master of this cluster: its certificate is not a master's (is this a worker's address?)"
        }
        Some(true) => "TLS mismatch: the server may run --insecure, hold a certificate of another CA, or have refused this one",
        Some(false) => "the server may require TLS: pass --tls-dir with a certificate of the cluster CA",
        None => "TLS mismatch: one side may run without TLS (--insecure) or hold a certificate of another CA",
    };
    format!("{msg} ({hint})")
}

impl From<tonic::Status> for ClientError {
    fn from(s: tonic::Status) -> Self {
        Self::from_status(s)
    }
}

impl From<object_store::Error> for ClientError {
    fn from(e: object_store::Error) -> Self {
        match e {
            object_store::Error::NotFound { .. } => Self::NotFound(e.to_string()),
            object_store::Error::Precondition { .. } | object_store::Error::NotModified { .. } => {
                Self::Stale(e.to_string())
            }
            _ if granary_common::ufs::is_access_denied(&e) => {
                Self::PermissionDenied(format!("the under-store refused access: {e}"))
            }
            _ => Self::Unavailable(format!("under-store read failed: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_errno_the_kernel_takes_is_kept() {
        let with = |errno: &str| {
            let mut s = tonic::Status::unavailable("x");
            s.metadata_mut()
                .insert(granary_proto::ERRNO_KEY, errno.parse().unwrap());
            ClientError::from_status(s)
        };
        assert_eq!(with("28"), ClientError::Posix(28, "x".into()));
        for bad in ["0", "-5", "512", "100000", "nope"] {
            assert_eq!(with(bad), ClientError::Unavailable("x".into()), "{bad}");
        }
    }
}
