//! Worker metrics (`granary_worker_*`). Counters get the `_total` suffix when rendered.

use std::sync::atomic::{AtomicI64, AtomicU64};

use granary_common::metrics::SharedRegistry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

/// Labels of per-mount under-store metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UfsOp {
    pub mount_id: String,
    /// `get` (ranged read).
    pub op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UfsOpError {
    pub mount_id: String,
    pub op: String,
    /// `changed`, `not_found`, `timeout` or `failed`.
    pub error: String,
}

/// Why pages left the cache.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropReason {
    /// `capacity`, `stale` or `corrupt`.
    pub reason: String,
}

/// A cache tier: `mem`, `ssd` or `hdd`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Tier {
    pub tier: String,
}

impl Tier {
    pub fn new(name: &str) -> Self {
        Self {
            tier: name.to_string(),
        }
    }
}

type Latency = Family<UfsOp, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 1 ms … ~33 s
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// Per-mount under-store request metrics.
#[derive(Clone)]
pub struct UfsMetrics {
    pub requests: Family<UfsOp, Counter>,
    pub bytes: Family<UfsOp, Counter>,
    pub errors: Family<UfsOpError, Counter>,
    pub seconds: Latency,
}

impl Default for UfsMetrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            bytes: Family::default(),
            errors: Family::default(),
            seconds: Family::new_with_constructor(latency_histogram),
        }
    }
}

impl UfsMetrics {
    pub fn op(mount_id: u64, op: &str) -> UfsOp {
        UfsOp {
            mount_id: mount_id.to_string(),
            op: op.to_string(),
        }
    }

    pub fn error(&self, mount_id: u64, op: &str, error: &str) {
        self.errors
            .get_or_create(&UfsOpError {
                mount_id: mount_id.to_string(),
                op: op.to_string(),
                error: error.to_string(),
            })
            .inc();
    }
}

#[derive(Clone, Default)]
pub struct WorkerMetrics {
    pub ufs: UfsMetrics,
    pub cache_hit_bytes: Counter<u64, AtomicU64>,
    pub cache_miss_bytes: Counter<u64, AtomicU64>,
    pub ufs_read_bytes: Counter<u64, AtomicU64>,
    pub ufs_requests: Counter<u64, AtomicU64>,
    pub ufs_errors: Counter<u64, AtomicU64>,
    pub evicted_bytes: Counter<u64, AtomicU64>,
    pub stale_dropped_bytes: Counter<u64, AtomicU64>,
    pub prefetched_pages: Counter<u64, AtomicU64>,
    pub checksum_failures: Counter<u64, AtomicU64>,
    pub uncached_fills: Counter<u64, AtomicU64>,
    pub cache_write_errors: Counter<u64, AtomicU64>,
    pub admission_rejected_pages: Counter<u64, AtomicU64>,
    pub singleflight_waits: Counter<u64, AtomicU64>,
    pub dropped_pages: Family<DropReason, Counter>,
    pub peer_fill_bytes: Counter<u64, AtomicU64>,
    pub node_copy_bytes: Counter<u64, AtomicU64>,
    pub peer_served_bytes: Counter<u64, AtomicU64>,
    pub data_plane_bytes: Counter<u64, AtomicU64>,
    pub data_plane_refused: Counter<u64, AtomicU64>,
    pub short_circuit_leases: Counter<u64, AtomicU64>,
    pub short_circuit_bytes: Counter<u64, AtomicU64>,
    pub active_leases: Gauge<i64, AtomicI64>,
    pub read_requests: Counter<u64, AtomicU64>,
    pub cache_blocks_asked: Counter<u64, AtomicU64>,
    pub cache_used_bytes: Gauge<i64, AtomicI64>,
    pub cache_capacity_bytes: Gauge<i64, AtomicI64>,
    pub cache_pages: Gauge<i64, AtomicI64>,
    pub tier_used_bytes: Family<Tier, Gauge>,
    pub tier_capacity_bytes: Family<Tier, Gauge>,
    pub tier_pages: Family<Tier, Gauge>,
    /// Pages moved down a tier when evicted from the one above.
    pub tier_demoted_pages: Family<Tier, Counter>,
    /// Pages copied up to the top tier when read from a lower one.
    pub tier_promoted_pages: Family<Tier, Counter>,
    /// Bytes received from clients writing files.
    pub written_bytes: Counter<u64, AtomicU64>,
    /// Bytes of written files uploaded to under-stores.
    pub uploaded_bytes: Counter<u64, AtomicU64>,
    pub write_failures: Counter<u64, AtomicU64>,
    pub upload_failures: Counter<u64, AtomicU64>,
    /// Async-through files whose upload the master recorded.
    pub persisted_files: Counter<u64, AtomicU64>,
    /// Async-through files journaled here and not persisted yet (uploading or replicas).
    pub pending_uploads: Gauge<i64, AtomicI64>,
    /// Async-through writes uploaded before close returned (the cache could not pin them).
    pub async_writes_uploaded_at_close: Counter<u64, AtomicU64>,
    /// Latency of page reads that missed the cache (for the cluster report's p50/p99).
    pub miss_latency: std::sync::Arc<MissLatency>,
}

/// Buckets of [`MissLatency`]: bucket `i` counts latencies up to 2^(i/4) µs (about 19 %
/// apart), the last one everything longer (~36 min).
pub const MISS_BUCKETS: usize = 128;

/// Latencies of reads that missed the cache, in log-scale buckets of microseconds that
/// add up across workers (the report merges them and reads quantiles off the sum).
pub struct MissLatency {
    buckets: Vec<AtomicU64>,
}

impl Default for MissLatency {
    fn default() -> Self {
        Self {
            buckets: (0..MISS_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl MissLatency {
    /// The bucket of a latency of `us` microseconds.
    pub fn bucket(us: u64) -> usize {
        if us <= 1 {
            return 0;
        }
        ((4.0 * (us as f64).log2()).ceil() as usize).min(MISS_BUCKETS - 1)
    }

    /// The upper bound of bucket `i`, in microseconds.
    pub fn bound_us(i: usize) -> f64 {
        2f64.powf(i as f64 / 4.0)
    }

    pub fn record(&self, d: std::time::Duration) {
        let i = Self::bucket(d.as_micros().min(u128::from(u64::MAX)) as u64);
        self.buckets[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn counts(&self) -> Vec<u64> {
        self.buckets
            .iter()
            .map(|b| b.load(std::sync::atomic::Ordering::Relaxed))
            .collect()
    }

    /// The `q` quantile (0..1) of bucket `counts`, as the bucket's upper bound in
    /// microseconds; None without samples.
    pub fn quantile_us(counts: &[u64], q: f64) -> Option<f64> {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Some(Self::bound_us(i));
            }
        }
        Some(Self::bound_us(counts.len().saturating_sub(1)))
    }
}

impl WorkerMetrics {
    pub fn register(registry: &SharedRegistry) -> Self {
        let m = Self::default();
        if let Ok(mut r) = registry.lock() {
            r.register(
                "granary_worker_cache_hit_bytes",
                "Bytes served from the cache",
                m.cache_hit_bytes.clone(),
            );
            r.register(
                "granary_worker_cache_miss_bytes",
                "Bytes served that were not cached",
                m.cache_miss_bytes.clone(),
            );
            r.register(
                "granary_worker_ufs_read_bytes",
                "Bytes read from under-stores",
                m.ufs_read_bytes.clone(),
            );
            r.register(
                "granary_worker_ufs_requests",
                "Requests sent to under-stores",
                m.ufs_requests.clone(),
            );
            r.register(
                "granary_worker_ufs_errors",
                "Failed under-store requests",
                m.ufs_errors.clone(),
            );
            r.register(
                "granary_worker_peer_fill_bytes",
                "Bytes this worker cached by copying them from another worker instead of the under-store",
                m.peer_fill_bytes.clone(),
            );
            r.register(
                "granary_worker_node_copy_bytes",
                "Bytes this worker cached as node copies: pages of blocks another worker owns, copied from peers for clients on this node (--locality node), evicted before any owned page",
                m.node_copy_bytes.clone(),
            );
            r.register(
                "granary_worker_peer_served_bytes",
                "Cached bytes this worker served to other workers filling their caches",
                m.peer_served_bytes.clone(),
            );
            r.register(
                "granary_worker_data_plane_bytes",
                "Bytes this worker sent over its block data plane (--data-listen), whole cached pages by sendfile",
                m.data_plane_bytes.clone(),
            );
            r.register(
                "granary_worker_data_plane_refused",
                "Data plane connections closed at once because as many as it serves were open (their clients read over gRPC meanwhile)",
                m.data_plane_refused.clone(),
            );
            r.register(
                "granary_worker_short_circuit_leases",
                "Short-circuit leases granted to clients on this host (each holds a block's cached pages from eviction while the client reads the block file directly)",
                m.short_circuit_leases.clone(),
            );
            r.register(
                "granary_worker_short_circuit_bytes",
                "Bytes clients on this host read straight from this worker's block files, as they report them when they renew a lease",
                m.short_circuit_bytes.clone(),
            );
            r.register(
                "granary_worker_short_circuit_active_leases",
                "Short-circuit leases in force (each holds up to 16 cached pages of a block from eviction)",
                m.active_leases.clone(),
            );
            r.register(
                "granary_worker_dropped_pages",
                "Pages removed from the cache, by reason: capacity (evicted), stale (new version), corrupt",
                m.dropped_pages.clone(),
            );
            r.register(
                "granary_worker_singleflight_waits",
                "Reads that found their page already being fetched from the under-store and waited for that fetch instead of starting another",
                m.singleflight_waits.clone(),
            );
            r.register(
                "granary_worker_admission_rejected_pages",
                "Pages fetched but not cached: the eviction policy's admission filter ranked them below what they would evict",
                m.admission_rejected_pages.clone(),
            );
            r.register(
                "granary_worker_evicted_bytes",
                "Bytes evicted from the cache",
                m.evicted_bytes.clone(),
            );
            r.register(
                "granary_worker_ufs_op_requests",
                "Under-store requests by mount and operation",
                m.ufs.requests.clone(),
            );
            r.register(
                "granary_worker_ufs_op_bytes",
                "Bytes read from under-stores by mount and operation",
                m.ufs.bytes.clone(),
            );
            r.register(
                "granary_worker_ufs_op_errors",
                "Failed under-store requests by mount, operation and kind of error",
                m.ufs.errors.clone(),
            );
            r.register(
                "granary_worker_ufs_op_seconds",
                "Latency of under-store requests by mount and operation",
                m.ufs.seconds.clone(),
            );
            r.register(
                "granary_worker_prefetched_pages",
                "Pages fetched ahead of cold sequential reads",
                m.prefetched_pages.clone(),
            );
            r.register(
                "granary_worker_stale_dropped_bytes",
                "Bytes of cached pages dropped because their under-store object changed or vanished",
                m.stale_dropped_bytes.clone(),
            );
            r.register(
                "granary_worker_checksum_failures",
                "Cached pages that failed their checksum",
                m.checksum_failures.clone(),
            );
            r.register(
                "granary_worker_uncached_fills",
                "Pages served without caching (no space could be freed)",
                m.uncached_fills.clone(),
            );
            r.register(
                "granary_worker_cache_write_errors",
                "Pages the cache disk failed to take (served uncached)",
                m.cache_write_errors.clone(),
            );
            r.register(
                "granary_worker_read_requests",
                "Block read requests",
                m.read_requests.clone(),
            );
            r.register(
                "granary_worker_cache_blocks_asked",
                "Blocks clients asked this worker to cache ahead of their readers (CacheBlocks: a folder warm's batches), each under a grant",
                m.cache_blocks_asked.clone(),
            );
            r.register(
                "granary_worker_cache_used_bytes",
                "Bytes of cached pages",
                m.cache_used_bytes.clone(),
            );
            r.register(
                "granary_worker_cache_capacity_bytes",
                "Cache capacity in bytes",
                m.cache_capacity_bytes.clone(),
            );
            r.register(
                "granary_worker_tier_used_bytes",
                "Bytes of cached pages per tier",
                m.tier_used_bytes.clone(),
            );
            r.register(
                "granary_worker_tier_capacity_bytes",
                "Capacity per tier",
                m.tier_capacity_bytes.clone(),
            );
            r.register(
                "granary_worker_tier_pages",
                "Cached pages per tier",
                m.tier_pages.clone(),
            );
            r.register(
                "granary_worker_tier_demoted_pages",
                "Pages evicted from a tier and moved to the tier below it (labelled with the tier they left)",
                m.tier_demoted_pages.clone(),
            );
            r.register(
                "granary_worker_tier_promoted_pages",
                "Pages read from a lower tier and moved up to the top tier (labelled with the tier they left)",
                m.tier_promoted_pages.clone(),
            );
            r.register(
                "granary_worker_cache_pages",
                "Cached pages",
                m.cache_pages.clone(),
            );
            r.register(
                "granary_worker_written_bytes",
                "Bytes received from clients writing files",
                m.written_bytes.clone(),
            );
            r.register(
                "granary_worker_uploaded_bytes",
                "Bytes of written files uploaded to under-stores",
                m.uploaded_bytes.clone(),
            );
            r.register(
                "granary_worker_write_failures",
                "File writes that failed (the client was told)",
                m.write_failures.clone(),
            );
            r.register(
                "granary_worker_upload_failures",
                "Background uploads of async-through files that failed (retried)",
                m.upload_failures.clone(),
            );
            r.register(
                "granary_worker_persisted_files",
                "Async-through files uploaded and recorded by the master",
                m.persisted_files.clone(),
            );
            r.register(
                "granary_worker_pending_uploads",
                "Async-through files journaled here and not persisted yet",
                m.pending_uploads.clone(),
            );
            r.register(
                "granary_worker_async_writes_uploaded_at_close",
                "Async-through writes uploaded before close returned because the cache could not pin them",
                m.async_writes_uploaded_at_close.clone(),
            );
        }
        m
    }
}

#[cfg(test)]
mod miss_latency_tests {
    use super::MissLatency;
    use std::time::Duration;

    #[test]
    fn quantiles_come_within_a_bucket_of_the_truth() {
        let m = MissLatency::default();
        for ms in 1..=100u64 {
            m.record(Duration::from_millis(ms));
        }
        let c = m.counts();
        let p50 = MissLatency::quantile_us(&c, 0.5).unwrap();
        let p99 = MissLatency::quantile_us(&c, 0.99).unwrap();
        assert!((50_000.0..=50_000.0 * 1.19).contains(&p50), "p50 {p50}");
        assert!((99_000.0..=99_000.0 * 1.19).contains(&p99), "p99 {p99}");
        assert_eq!(MissLatency::quantile_us(&[0; 4], 0.5), None);
        // Workers' buckets add up.
        let sum: Vec<u64> = c.iter().map(|x| x * 2).collect();
        assert_eq!(MissLatency::quantile_us(&sum, 0.5), Some(p50));
    }
}
