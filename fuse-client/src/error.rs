//! The one mapping from client errors to errno.

use fuser::Errno;
use granary_client::{ClientError, ErrorCode};

pub fn errno(e: &ClientError) -> Errno {
    match e.code() {
        ErrorCode::NotFound => Errno::ENOENT,
        ErrorCode::AlreadyExists => Errno::EEXIST,
        ErrorCode::InvalidArgument => Errno::EINVAL,
        ErrorCode::FailedPrecondition => Errno::EIO,
        ErrorCode::Unavailable | ErrorCode::Internal => Errno::EIO,
        // A deadline ran out (a hung worker or under-store): the operation failed, the mount
        // did not.
        ErrorCode::Timeout => Errno::EIO,
        ErrorCode::Stale => Errno::ESTALE,
        ErrorCode::PermissionDenied | ErrorCode::GrantRefused => Errno::EACCES,
        ErrorCode::Posix(n) => Errno::from_i32(n),
    }
}
