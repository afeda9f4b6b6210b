//! `granary-client`: the one FileSystem API that the FUSE mount, the CLI and the tests use.
//!
//! Metadata goes to the master (with deadlines and retry of idempotent calls while it is
//! unreachable); data comes from the block's owner worker (rendezvous hashing over live
//! workers), then any other live worker, and finally straight from the under-store — a read
//! never fails just because workers are down.

pub mod direct;
pub mod error;
pub mod fs;
pub mod local;
pub mod master;
pub mod metrics;
pub mod mounts;
pub mod nodecopy;
pub mod placement;
pub mod transport;
pub mod warm;
pub mod watch;
pub mod write;

pub use error::{ClientError, ErrorCode};
pub use fs::FileSystem;
pub use master::{as_caller, MasterClient};
pub use write::{FileWriter, WriteMode};
