//! The one mapping from client errors to errno.

use fuser::Errno;
use granary_client::ClientError;

pub fn errno(e: &ClientError) -> Errno {
    match e {
        ClientError::NotFound(_) => Errno::ENOENT,
        ClientError::AlreadyExists(_) => Errno::EEXIST,
        ClientError::InvalidArgument(_) => Errno::EINVAL,
        ClientError::FailedPrecondition(_) => Errno::EIO,
        ClientError::Unavailable(_) | ClientError::Internal(_) => Errno::EIO,
        // A deadline ran out (a hung worker or under-store): the operation failed, the mount
        // did not.
        ClientError::Timeout(_) => Errno::EIO,
        ClientError::Stale(_) => Errno::ESTALE,
        ClientError::PermissionDenied(_) | ClientError::GrantRefused(_) => Errno::EACCES,
        ClientError::Posix(n, _) => Errno::from_i32(*n),
    }
}
