//! Granary's wire contract: the `.proto` files under `proto/` and the tonic/prost code
//! generated from them. Nothing else speaks on the wire.

#![allow(clippy::all, missing_docs)]

/// Version 1 of the wire contract.
pub mod v1 {
    tonic::include_proto!("granary.v1");
}

pub use v1::*;

/// The message encoding, for the framed streams that carry these messages outside gRPC
/// (the block data plane).
pub use prost;

/// Largest gRPC message Granary sends or accepts (block reads stream 1 MiB chunks).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// gRPC metadata key carrying the Linux errno that fits an error precisely (ENOTEMPTY,
/// ENOTDIR, EXDEV, EISDIR, EROFS…), where the status code alone would merge several.
pub const ERRNO_KEY: &str = "granary-errno";
/// gRPC metadata a worker adds to a `PERMISSION_DENIED` that refuses the request's read
/// grant (value [`GRANT_REFUSAL`]): a new grant from the master may help, which a refusal
/// of the caller itself would not.
pub const REFUSAL_KEY: &str = "granary-refusal";
pub const GRANT_REFUSAL: &str = "grant";
/// gRPC metadata a FUSE mount adds to namespace requests: the uid and gid of the local
/// process it acts for (owner of what it creates; checked against entries' modes).
pub const CALLER_UID_KEY: &str = "granary-uid";
pub const CALLER_GID_KEY: &str = "granary-gid";
