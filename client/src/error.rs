//! Client errors, converted from gRPC status in one place.

use std::sync::Arc;

/// What went wrong, as a code: errno choices and retry decisions go by it, never by text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    NotFound,
    AlreadyExists,
    InvalidArgument,
    FailedPrecondition,
    Unavailable,
    Timeout,
    PermissionDenied,
    /// A worker refused the request's read grant (missing, expired, signed by a leader it
    /// does not know yet): a new grant may help.
    GrantRefused,
    /// The file changed in the under-store while it was read.
    Stale,
    Internal,
    /// A refusal with a precise POSIX meaning (the errno).
    Posix(i32),
}

/// A failed client call: its [`ErrorCode`], a message for people, the namespace path it
/// concerns where one is known, and the error that caused it (a gRPC status, an under-store
/// error, another client error) through [`std::error::Error::source`].
#[derive(Debug, Clone)]
pub struct ClientError {
    code: ErrorCode,
    message: String,
    path: Option<String>,
    cause: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

/// Equal when code, message and path are: the cause is context, not identity.
impl PartialEq for ClientError {
    fn eq(&self, other: &Self) -> bool {
        self.code == other.code && self.message == other.message && self.path == other.path
    }
}

impl Eq for ClientError {}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.code == ErrorCode::Stale {
            f.write_str("the file changed in the under-store while it was read: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|c| c as &(dyn std::error::Error + 'static))
    }
}

impl ClientError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            path: None,
            cause: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    pub fn already_exists(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::AlreadyExists, message)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }

    pub fn precondition(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::FailedPrecondition, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Unavailable, message)
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Timeout, message)
    }

    pub fn denied(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::PermissionDenied, message)
    }

    pub fn stale(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Stale, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }

    pub fn posix(errno: i32, message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Posix(errno), message)
    }

    /// The namespace path this error concerns (kept if one is already set: the innermost
    /// call knows best).
    pub fn at(mut self, path: impl Into<String>) -> Self {
        if self.path.is_none() {
            self.path = Some(path.into());
        }
        self
    }

    /// The error that caused this one.
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.cause = Some(Arc::new(cause));
        self
    }

    pub fn code(&self) -> ErrorCode {
        self.code
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn path(&self) -> Option<&str> {
        self.path.as_deref()
    }

    /// The gRPC code a server answered, when a status caused this error.
    pub fn status_code(&self) -> Option<tonic::Code> {
        let mut next = self
            .cause
            .as_deref()
            .map(|c| c as &(dyn std::error::Error + 'static));
        while let Some(e) = next {
            if let Some(s) = e.downcast_ref::<tonic::Status>() {
                return Some(s.code());
            }
            next = e.source();
        }
        None
    }

    /// Same code, message and path, another message (a wrapper that adds context keeps
    /// this error as its cause).
    pub fn context(self, message: impl Into<String>) -> Self {
        let mut wrapped = Self::new(self.code, message);
        wrapped.path = self.path.clone();
        wrapped.caused_by(self)
    }
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
        let errno = s
            .metadata()
            .get(granary_proto::ERRNO_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i32>().ok())
            .filter(|n| (1..MAX_ERRNO).contains(n));
        let (code, msg) = if let Some(n) = errno {
            (ErrorCode::Posix(n), msg)
        } else if granary_common::grant::is_grant_denial(&s) {
            (ErrorCode::GrantRefused, msg)
        } else {
            match s.code() {
                Code::NotFound => (ErrorCode::NotFound, msg),
                Code::AlreadyExists => (ErrorCode::AlreadyExists, msg),
                Code::InvalidArgument | Code::OutOfRange => (ErrorCode::InvalidArgument, msg),
                Code::FailedPrecondition => (ErrorCode::FailedPrecondition, msg),
                Code::Aborted => (ErrorCode::Stale, msg),
                Code::DeadlineExceeded => (ErrorCode::Timeout, msg),
                Code::PermissionDenied | Code::Unauthenticated => {
                    (ErrorCode::PermissionDenied, msg)
                }
                Code::Unavailable | Code::Cancelled | Code::Unknown | Code::ResourceExhausted => (
                    ErrorCode::Unavailable,
                    if msg.is_empty() {
                        "service unavailable".into()
                    } else {
                        with_tls_hint(msg, tls)
                    },
                ),
                _ => (ErrorCode::Internal, with_tls_hint(msg, tls)),
            }
        };
        Self::new(code, msg).caused_by(s)
    }

    /// Worth trying another replica or source?
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.code,
            ErrorCode::Unavailable | ErrorCode::Timeout | ErrorCode::Internal
        )
    }

    /// The master or worker is unreachable or slow: worth trying another master.
    pub fn is_unreachable(&self) -> bool {
        matches!(self.code, ErrorCode::Unavailable | ErrorCode::Timeout)
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
        let (code, msg) = match e {
            object_store::Error::NotFound { .. } => (ErrorCode::NotFound, e.to_string()),
            object_store::Error::Precondition { .. } | object_store::Error::NotModified { .. } => {
                (ErrorCode::Stale, e.to_string())
            }
            _ if granary_common::ufs::is_access_denied(&e) => (
                ErrorCode::PermissionDenied,
                format!("the under-store refused access: {e}"),
            ),
            _ => (
                ErrorCode::Unavailable,
                format!("under-store read failed: {e}"),
            ),
        };
        Self::new(code, msg).caused_by(e)
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
        assert_eq!(with("28"), ClientError::posix(28, "x"));
        for bad in ["0", "-5", "512", "100000", "nope"] {
            assert_eq!(with(bad), ClientError::unavailable("x"), "{bad}");
        }
    }

    #[test]
    fn an_error_keeps_its_code_path_and_cause() {
        let e = ClientError::from_status(tonic::Status::not_found("no such file"))
            .at("/data/a")
            .at("/ignored");
        assert_eq!(e.code(), ErrorCode::NotFound);
        assert_eq!(e.path(), Some("/data/a"));
        assert_eq!(e.status_code(), Some(tonic::Code::NotFound));
        assert_eq!(e.to_string(), "no such file");
        let wrapped = e.clone().context("reading /data/a failed: no such file");
        assert_eq!(wrapped.code(), ErrorCode::NotFound);
        assert_eq!(wrapped.path(), Some("/data/a"));
        assert_eq!(wrapped.status_code(), Some(tonic::Code::NotFound));
        let inner = std::error::Error::source(&wrapped)
            .and_then(|c| c.downcast_ref::<ClientError>())
            .expect("the cause is kept");
        assert_eq!(inner, &e);
        assert_eq!(ClientError::timeout("slow").status_code(), None);
    }
}
