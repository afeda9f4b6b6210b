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
pub mod paths;
pub mod size;
pub mod tls;
pub mod ufs;

/// Default size of a page: the unit a worker fetches, checksums, caches and evicts.
pub const DEFAULT_PAGE_SIZE: u64 = 1024 * 1024;
/// Default size of a block: the unit of placement and location tracking.
pub const DEFAULT_BLOCK_SIZE: u64 = 64 * 1024 * 1024;

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
