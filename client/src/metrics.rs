//! Client metrics: where read bytes came from. Registered by processes that serve
//! `/metrics` (the FUSE mount, `granary local`); always counted, so `read_stats` works
//! without a registry.

use std::sync::atomic::AtomicU64;

use granary_common::metrics::SharedRegistry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

/// A plain counter (as kept by callers that count often).
pub type Count = Counter<u64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReadSource {
    /// `worker` (over gRPC), `short_circuit` (a same-host worker's block file, read
    /// directly) or `under_store` (no worker could serve).
    pub source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Op {
    /// The FUSE operation: `lookup`, `getattr`, `open`, `read`, `opendir`, `statfs`.
    pub op: String,
}

/// Latency of mount operations that wait on the network, by operation (100 µs … 26 s).
#[derive(Clone)]
pub struct OpLatency(pub Family<Op, Histogram, fn() -> Histogram>);

fn op_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 4.0, 10))
}

impl Default for OpLatency {
    fn default() -> Self {
        Self(Family::new_with_constructor(op_histogram))
    }
}

#[derive(Clone, Default)]
pub struct ClientMetrics {
    pub op_timeouts: Family<Op, Counter>,
    pub op_seconds: OpLatency,
    pub read_bytes: Family<ReadSource, Counter>,
    pub worker_failures: Counter<u64, AtomicU64>,
    pub short_circuit_leases: Counter<u64, AtomicU64>,
    pub passthrough_opens: Counter<u64, AtomicU64>,
    /// Bytes fetched ahead of sequential readers (adaptive prefetch of the mount).
    pub prefetched_bytes: Counter<u64, AtomicU64>,
    /// Bytes of reads answered from what was fetched ahead.
    pub prefetch_hit_bytes: Counter<u64, AtomicU64>,
    /// Bytes of small files stored into the kernel's page cache ahead of a reader.
    pub pushed_bytes: Counter<u64, AtomicU64>,
    /// Bytes of reads answered from a push reading the same file at the time.
    pub push_shared_bytes: Counter<u64, AtomicU64>,
    /// Times the namespace watch was opened, and inodes it announced changed.
    pub watch_starts: Counter<u64, AtomicU64>,
    pub watch_changes: Counter<u64, AtomicU64>,
    /// Reads of small files answered from block files kept open after their leases.
    pub kept_reads: Counter<u64, AtomicU64>,
    /// Requests the kernel sent the FUSE daemon, by operation (answered locally or not).
    pub fuse_requests: Family<Op, Counter>,
    /// Passthrough backing files kept after their files' last close, and opens they served.
    pub parked_backings: Gauge,
    pub parked_opens: Counter<u64, AtomicU64>,
    /// Backing files a crashed daemon of the mount left parked, kept for their inodes.
    pub fuse_orphan_backings: Gauge,
    /// Folder warms started, and the files and bytes they had cached.
    pub warm_folders: Counter<u64, AtomicU64>,
    pub warm_files: Counter<u64, AtomicU64>,
    pub warm_bytes: Counter<u64, AtomicU64>,
    /// Warmed small files leased, checked and kept open for their readers' opens.
    pub warm_kept: Counter<u64, AtomicU64>,
    /// Bytes read over gRPC from workers on other nodes (part of source="worker").
    pub peer_read_bytes: Counter<u64, AtomicU64>,
    /// Blocks (and bytes) copied to this node's worker, copies that failed or were skipped.
    pub node_copies: Counter<u64, AtomicU64>,
    pub node_copy_bytes: Counter<u64, AtomicU64>,
    pub node_copy_failures: Counter<u64, AtomicU64>,
    pub data_plane_failures: Counter<u64, AtomicU64>,
    pub node_copy_skipped: Counter<u64, AtomicU64>,
    /// Node copies asked for and not finished.
    pub node_copies_pending: Gauge,
    /// This daemon's place in its mount's line of daemons (0: it mounted; each takeover, after
    /// an upgrade or a crash, adds one).
    pub fuse_generation: Gauge,
    /// Read handles the kernel holds open through the mount.
    pub fuse_open_files: Gauge,
    /// Mounts this daemon took over from a running daemon or its holder.
    pub fuse_takeovers: Counter<u64, AtomicU64>,
    /// Requests the kernel sent again after a takeover (read but not answered before).
    pub fuse_resent_requests: Counter<u64, AtomicU64>,
    /// Handles an earlier daemon of the mount opened, found again by inode at their first use.
    pub fuse_recovered_handles: Counter<u64, AtomicU64>,
    /// Folders whose first listing page was asked for ahead of their opening (a walk of
    /// folders in order), and those of them the opening used.
    pub fuse_dir_pages_ahead: Counter<u64, AtomicU64>,
    pub fuse_dir_pages_ahead_used: Counter<u64, AtomicU64>,
    /// Seconds the mount was not fully served during takeovers (from the previous daemon's
    /// last change, or its death, to this one serving).
    pub fuse_unserved_seconds: Counter<f64, AtomicU64>,
}

impl ClientMetrics {
    pub fn register(&self, registry: &SharedRegistry) {
        if let Ok(mut r) = registry.lock() {
            r.register(
                "granary_client_read_bytes",
                "Bytes this client read, by source: worker (gRPC), short_circuit (a same-host worker's block file), under_store (no worker could serve)",
                self.read_bytes.clone(),
            );
            r.register(
                "granary_client_op_seconds",
                "Latency of mount operations that wait on the network (lookup, getattr, open, read, readdir, create, write, ...), timeouts included",
                self.op_seconds.0.clone(),
            );
            r.register(
                "granary_client_op_timeouts",
                "Mount operations that hit --op-timeout and were answered EIO (the mount carries on)",
                self.op_timeouts.clone(),
            );
            r.register(
                "granary_client_worker_failures",
                "Worker reads that failed and were retried on another source",
                self.worker_failures.clone(),
            );
            r.register(
                "granary_client_short_circuit_leases",
                "Short-circuit leases taken from same-host workers",
                self.short_circuit_leases.clone(),
            );
            r.register(
                "granary_client_prefetched_bytes",
                "Bytes fetched ahead of sequential readers (the window doubles per sequential read up to 32 MiB, drawn from --max-memory)",
                self.prefetched_bytes.clone(),
            );
            r.register(
                "granary_client_prefetch_hit_bytes",
                "Bytes of reads answered from what was fetched ahead",
                self.prefetch_hit_bytes.clone(),
            );
            r.register(
                "granary_client_pushed_bytes",
                "Bytes of small files sent into the kernel's page cache ahead of a reader going through a folder in name order (--push-ahead-files)",
                self.pushed_bytes.clone(),
            );
            r.register(
                "granary_client_push_shared_bytes",
                "Bytes of reads that reached the daemon while a push was reading their file, answered from the push's bytes instead of a second read",
                self.push_shared_bytes.clone(),
            );
            r.register(
                "granary_client_namespace_watch_starts",
                "Times this client opened its namespace watch on the leader (statuses it caches are used past the attribute timeout while the watch is live)",
                self.watch_starts.clone(),
            );
            r.register(
                "granary_client_namespace_watch_changes",
                "Inodes the leader announced changed on the namespace watch (their cached statuses are dropped, and the kernel's caches of them)",
                self.watch_changes.clone(),
            );
            r.register(
                "granary_client_kept_reads",
                "Reads of small files answered from their block files kept open since an earlier read (no lease request: the next epoch of a loader)",
                self.kept_reads.clone(),
            );
            r.register(
                "granary_client_fuse_requests",
                "Requests the kernel sent this FUSE mount, by operation (lookup, getattr, open, read, release, ...), whether answered from the mount's caches or over the network",
                self.fuse_requests.clone(),
            );
            r.register(
                "granary_client_parked_backings",
                "Passthrough backing files (checked one-page block files) the kernel keeps after their files' last close, so the next open needs no lease and no read",
                self.parked_backings.clone(),
            );
            r.register(
                "granary_client_fuse_orphan_backings",
                "Passthrough backing files a crashed daemon of this mount left parked, kept for their files while a handle of that daemon may still read through them (the kernel takes no other for such a file)",
                self.fuse_orphan_backings.clone(),
            );
            r.register(
                "granary_client_parked_opens",
                "Opens in passthrough mode answered from a parked backing file (no lease request, no read through the daemon)",
                self.parked_opens.clone(),
            );
            r.register(
                "granary_client_passthrough_opens",
                "Files opened in FUSE passthrough mode (the kernel reads a worker's block file; the daemon sees no reads)",
                self.passthrough_opens.clone(),
            );
            r.register(
                "granary_client_warm_folders",
                "Folder warms started: a folder whose small files were read in a random order while uncached has its other files fetched into the cache ahead of its readers (--warm-folder-bytes)",
                self.warm_folders.clone(),
            );
            r.register(
                "granary_client_warm_files",
                "Files folder warms had fetched into the cache",
                self.warm_files.clone(),
            );
            r.register(
                "granary_client_warm_bytes",
                "Bytes of the files folder warms had fetched into the cache",
                self.warm_bytes.clone(),
            );
            r.register(
                "granary_client_warm_kept",
                "Small files folder warms had cached that this mount then leased, checked and kept open, so their first open is answered in passthrough without a lease request",
                self.warm_kept.clone(),
            );
            r.register(
                "granary_client_peer_read_bytes",
                "Bytes read over gRPC from workers on other nodes (also in granary_client_read_bytes{source=\"worker\"})",
                self.peer_read_bytes.clone(),
            );
            r.register(
                "granary_client_node_copies",
                "Blocks this node's worker copied from their owners for this mount (--locality node), so later reads are local",
                self.node_copies.clone(),
            );
            r.register(
                "granary_client_node_copy_bytes",
                "Bytes of the blocks this node's worker copied for this mount (--locality node)",
                self.node_copy_bytes.clone(),
            );
            r.register(
                "granary_client_data_plane_failures",
                "Reads whose worker's block data plane failed (connection, torn stream, bad checksum): read again over gRPC, and that data plane left alone for 30 s",
                self.data_plane_failures.clone(),
            );
            r.register(
                "granary_client_node_copy_failures",
                "Node copies that failed (the block is read from its owner until a later read copies it)",
                self.node_copy_failures.clone(),
            );
            r.register(
                "granary_client_node_copies_pending",
                "Node copies asked for and not finished yet (--locality node)",
                self.node_copies_pending.clone(),
            );
            r.register(
                "granary_client_node_copy_skipped",
                "Node copies not started because 1,024 were waiting already",
                self.node_copy_skipped.clone(),
            );
            self.register_takeovers(&mut r);
        }
    }

    /// The metrics of a FUSE daemon's takeovers (docs/operations.md, "Restarting and
    /// upgrading a mount").
    fn register_takeovers(&self, r: &mut prometheus_client::registry::Registry) {
        r.register(
            "granary_client_fuse_generation",
            "This daemon's place in its mount's line of daemons: 0 for the one that mounted, one more at each takeover (upgrade or crash recovery)",
            self.fuse_generation.clone(),
        );
        r.register(
            "granary_client_fuse_open_files",
            "Read handles the kernel holds open through the mount (files being written are not counted); handed on at a takeover",
            self.fuse_open_files.clone(),
        );
        r.register(
            "granary_client_fuse_takeovers",
            "Mounts this daemon took over from a running daemon (--takeover) or from its descriptor holder after a crash (--supervise)",
            self.fuse_takeovers.clone(),
        );
        r.register(
            "granary_client_fuse_resent_requests",
            "Requests the kernel sent again after a takeover: read by the previous daemon and not answered by it",
            self.fuse_resent_requests.clone(),
        );
        r.register(
            "granary_client_fuse_dir_pages_ahead",
            "Folders whose first listing page was asked for before they were opened, because folders were being opened in their parent's order (find, du, a dataset scan)",
            self.fuse_dir_pages_ahead.clone(),
        );
        r.register(
            "granary_client_fuse_dir_pages_ahead_used",
            "First listing pages asked for ahead that the folder's opening used (the rest were unused, too old, or of a folder changed meanwhile)",
            self.fuse_dir_pages_ahead_used.clone(),
        );
        r.register(
            "granary_client_fuse_recovered_handles",
            "Open handles of an earlier daemon of this mount found again by inode at their first use (after a crash, or opened during a handover)",
            self.fuse_recovered_handles.clone(),
        );
        r.register(
            "granary_client_fuse_unserved_seconds",
            "Seconds the mount was not fully served during takeovers: from the previous daemon's pause (or death) to this daemon answering",
            self.fuse_unserved_seconds.clone(),
        );
    }

    /// The counter of FUSE requests of kind `op` (kept by the caller: counting is then
    /// one atomic add, no label lookup per request).
    pub fn fuse_request_counter(&self, op: &str) -> Count {
        self.fuse_requests
            .get_or_create(&Op { op: op.to_string() })
            .clone()
    }

    pub fn add_read(&self, source: &str, bytes: u64) {
        self.read_bytes
            .get_or_create(&ReadSource {
                source: source.to_string(),
            })
            .inc_by(bytes);
    }

    pub fn read(&self, source: &str) -> u64 {
        self.read_bytes
            .get_or_create(&ReadSource {
                source: source.to_string(),
            })
            .get()
    }
}
