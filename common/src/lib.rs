//! Pieces every Granary crate shares: sizes, paths, ids, the under-store seam, metrics
//! serving, logging, gRPC channel settings and transport security (TLS, principals, the
//! authorization table).
//!
//! Invariants kept here:
//! - a Granary path is absolute, normalised (`/a/b`), and never contains `.`/`..`/empty parts;
//! - a file version (`version_of`) is a pure function of its under-store fingerprint, so the
//!   same object version always maps to the same cached pages and a changed one never does.

pub mod authz;
pub mod grant;
pub mod grpc;
pub mod ids;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod paths;
pub mod sequential;
pub mod size;
pub mod tls;
pub mod tls_conns;
pub mod ufs;

/// Default size of a page: the unit a worker fetches, checksums, caches and evicts.
pub const DEFAULT_PAGE_SIZE: u64 = 1024 * 1024;
/// Default size of a block: the unit of placement and location tracking.
pub const DEFAULT_BLOCK_SIZE: u64 = 64 * 1024 * 1024;

/// Smallest block size a file may be created with (`CreateFile.block_size`; 0 = default).
pub const MIN_BLOCK_SIZE: u64 = 64 * 1024;
/// Largest block size a file may be created with: a block is the unit a worker fetches
/// and places, so it bounds what one request makes a worker read.
pub const MAX_BLOCK_SIZE: u64 = 1024 * 1024 * 1024;
/// Largest file length a file may claim (`CompleteFile.length`, and what a load job plans
/// for): 64 TiB, above every object store's largest object.
pub const MAX_FILE_LENGTH: u64 = 64 << 40;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The name of the node this process runs on, as workers report it and clients compare it
/// for short-circuit reads: `GRANARY_NODE_NAME` when set (on Kubernetes, the pod's
/// `spec.nodeName`), else the kernel hostname.
pub fn node_name() -> String {
    if let Ok(n) = std::env::var("GRANARY_NODE_NAME") {
        if !n.trim().is_empty() {
            return n.trim().to_string();
        }
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}
