//! Node-local copies (`--locality node`): with hash placement a node owns 1/N of the
//! blocks, so on N nodes most of every warm epoch would come from other nodes' workers over
//! the network. A mount with node locality reads a block another node's worker owns from
//! that owner (which fetches it from the under-store once for the whole cluster), then has
//! its own node's worker copy the block from the owner in the background — from peers only,
//! never from the store — so the next epoch reads it from this node's disk (short-circuit
//! or passthrough). The worker keeps such pages as node copies: evicted before any page it
//! owns, and never evicting one; a worker started with `--locality cluster` keeps none.
//!
//! A copy is an ordinary read of one byte per page under the caller's own grant (the
//! worker's `from_peers` read): it gives the caller nothing it could not read itself.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use granary_proto::v1 as pb;

use crate::fs::{lock, FileSystem};
use crate::placement::order_workers;

/// Node copies being made at once, all blocks together.
const COPIES_IN_FLIGHT: usize = 8;
/// Node copies waiting to start at most (more are skipped: the next epoch asks again).
const MAX_PENDING: usize = 1024;
/// Blocks remembered as copied (or being copied) at most.
const MAX_REMEMBERED: usize = 100_000;
/// How long a worker that refused node copies (`--locality cluster`) is not asked again.
const REFUSED_FOR: Duration = Duration::from_secs(60);
/// A failed copy is logged as a warning at most this often (the others at debug level;
/// `granary_client_node_copy_failures_total` counts them all).
const WARN_EVERY: Duration = Duration::from_secs(60);

/// A mount's node-copy state.
pub struct NodeCopier {
    enabled: AtomicBool,
    /// Blocks copied or being copied: (inode, version, index).
    copied: Mutex<HashSet<(u64, u64, u32)>>,
    pending: AtomicUsize,
    slots: Arc<tokio::sync::Semaphore>,
    /// Workers that refused node copies, and when.
    refused: Mutex<HashMap<u64, Instant>>,
    /// When a failed copy was last logged as a warning.
    warned: Mutex<Option<Instant>>,
}

impl Default for NodeCopier {
    fn default() -> Self {
        Self {
            enabled: AtomicBool::new(false),
            copied: Mutex::new(HashSet::new()),
            pending: AtomicUsize::new(0),
            slots: Arc::new(tokio::sync::Semaphore::new(COPIES_IN_FLIGHT)),
            refused: Mutex::new(HashMap::new()),
            warned: Mutex::new(None),
        }
    }
}

impl NodeCopier {
    /// Whether block `key` is new here (now remembered as being copied).
    fn claim(&self, key: (u64, u64, u32)) -> bool {
        let mut m = lock(&self.copied);
        if m.len() >= MAX_REMEMBERED && !m.contains(&key) {
            m.clear();
        }
        m.insert(key)
    }

    fn forget(&self, key: &(u64, u64, u32)) {
        lock(&self.copied).remove(key);
    }

    /// Whether a failed copy is to be logged as a warning now (the first, then at most one
    /// per [`WARN_EVERY`]).
    fn warn_now(&self) -> bool {
        let mut last = lock(&self.warned);
        let due = last.is_none_or(|t| t.elapsed() >= WARN_EVERY);
        if due {
            *last = Some(Instant::now());
        }
        due
    }
}

/// A node copy asked for and not finished (counted from the read that asks for it to the
/// copy's end: `granary_client_node_copies_pending`).
struct Pending(Arc<FileSystem>);

impl Pending {
    /// `None` when too many copies wait already.
    fn take(fs: &Arc<FileSystem>) -> Option<Self> {
        let prev = fs.node_copier.pending.fetch_add(1, Ordering::AcqRel);
        if prev >= MAX_PENDING {
            fs.node_copier.pending.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        fs.metrics.node_copies_pending.inc();
        Some(Self(fs.clone()))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.node_copier.pending.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.node_copies_pending.dec();
    }
}

impl FileSystem {
    /// Node locality (`--locality node`): blocks other nodes' workers own are copied to
    /// this node's worker after they are read (see [`crate::nodecopy`]).
    pub fn set_node_local(&self, on: bool) {
        self.node_copier.enabled.store(on, Ordering::Relaxed);
    }

    pub fn node_local(&self) -> bool {
        self.node_copier.enabled.load(Ordering::Relaxed)
    }

    /// Block `index` of `file` was read from another node's worker: has this node's worker
    /// copy it from its peers in the background (once per block).
    pub(crate) fn copy_to_node(self: &Arc<Self>, file: &pb::FileStatus, index: u64) {
        let Ok(i) = u32::try_from(index) else {
            return;
        };
        let key = (file.inode, file.version, i);
        if !self.node_copier.claim(key) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.node_copier.forget(&key);
            return;
        };
        let Some(pending) = Pending::take(self) else {
            self.node_copier.forget(&key);
            self.metrics.node_copy_skipped.inc();
            return;
        };
        let me = self.clone();
        let file = file.clone();
        rt.spawn(async move {
            let _pending = pending;
            let Ok(_slot) = me.node_copier.slots.clone().acquire_owned().await else {
                return;
            };
            match me.copy_block_to_node(&file, index).await {
                Ok(true) => {
                    me.metrics.node_copies.inc();
                }
                Ok(false) => me.node_copier.forget(&key),
                Err(e) => {
                    me.node_copier.forget(&key);
                    me.metrics.node_copy_failures.inc();
                    if me.node_copier.warn_now() {
                        tracing::warn!(path = %file.path, block = index, error = %e, "copying a block to this node's worker failed (the next epoch reads it from its owner and asks again; further failures within a minute are logged at debug level)");
                    } else {
                        tracing::debug!(path = %file.path, block = index, error = %e, "copying a block to this node's worker failed");
                    }
                }
            }
        });
    }

    /// Asks this node's worker for every page of block `index` of `file` as a node copy
    /// (one byte of each page; it fills what it lacks from its peers). `Ok(false)`: no
    /// worker on this node, or it owns the block.
    async fn copy_block_to_node(
        &self,
        file: &pb::FileStatus,
        index: u64,
    ) -> Result<bool, crate::ClientError> {
        let mut desc = Self::descriptor(file, index)?;
        let id = desc.id.unwrap_or_default();
        let workers = self.live_workers().await;
        let order = order_workers(&id, &workers);
        let owner = order.first().map_or(0, |w| w.worker_id);
        let Some(local) = order
            .iter()
            .find(|w| self.short_circuit.same_node(w) && w.worker_id != owner)
        else {
            return Ok(false);
        };
        let refused_at = lock(&self.node_copier.refused)
            .get(&local.worker_id)
            .copied();
        if refused_at.is_some_and(|t| t.elapsed() < REFUSED_FOR) {
            return Ok(false);
        }
        let grant = self.grant_for(file, false).await?;
        Self::with_grant_terms(&mut desc, grant.as_ref());
        let bs = crate::fs::block_size(file);
        let len = bs.min(file.length.saturating_sub(index * bs));
        let ps = self.short_circuit_page_size().max(1);
        let mut pos = 0;
        while pos < len {
            let res = self
                .read_from_worker_opts(&local.address, &desc, pos, 1, grant.clone(), true)
                .await;
            if let Some(m) = res
                .as_ref()
                .err()
                .filter(|e| e.code() == crate::ErrorCode::FailedPrecondition)
            {
                tracing::info!(worker = local.worker_id, reason = %m, "this node's worker keeps no node copies; reading other owners' blocks from them");
                lock(&self.node_copier.refused).insert(local.worker_id, Instant::now());
            }
            res?;
            pos += ps;
        }
        self.metrics.node_copy_bytes.inc_by(len);
        Ok(true)
    }
}

#[cfg(test)]
mod warn_tests {
    use super::*;

    #[test]
    fn a_failed_copy_is_a_warning_at_most_once_a_minute() {
        let c = NodeCopier::default();
        assert!(c.warn_now(), "the first failure is a warning");
        assert!(!c.warn_now(), "the next within a minute is not");
        if let Some(then) = Instant::now().checked_sub(WARN_EVERY) {
            *lock(&c.warned) = Some(then);
            assert!(c.warn_now(), "a minute later it is again");
        }
    }
}
