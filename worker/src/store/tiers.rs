//! A worker's cache as tiers (`--tier mem:SIZE`, `--tier ssd:DIR:SIZE`, `--tier hdd:DIR:SIZE`,
//! any subset), fastest first. Each tier is a [`PageStore`] with its own quota, index and
//! eviction policy; a page lives in one tier.
//!
//! - **Admission**: a new page goes to the top tier whose policy admits it (the top one
//!   first; a tier's admission filter may pass it down).
//! - **Demotion**: a page evicted from a tier moves to the tier below (which makes room for
//!   it the same way, without its admission filter: the page earned its place above); only
//!   the bottom tier's evictions leave the cache.
//! - **Promotion**: a page read from a lower tier moves to the top tier when the top tier's
//!   policy admits it (under `lfu-admission`, when it has been read more often than what it
//!   would displace; under `lru`, on every read).
//!
//! Every tier's used + reserved bytes stay within its own quota at every instant: moves
//! reserve in the target tier (evicting there first) before they write.
//!
//! The memory tier is a tier whose directory is on tmpfs (`/dev/shm/granary-<worker id>`
//! unless `mem:DIR:SIZE` names another, e.g. a Kubernetes `emptyDir` with medium `Memory`):
//! its pages are ordinary files in memory, so short-circuit reads work on it as on disks,
//! and it counts against the memory limit of the worker's container.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use granary_proto as pb;

use super::{
    block_id, BlockKey, BlockStore, Lease, PageKey, PageStore, Reservation, StoreError, TierUsage,
};
use crate::evict::PolicyKind;
use crate::metrics::WorkerMetrics;

/// Kinds of tiers, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TierKind {
    Mem,
    Ssd,
    Hdd,
}

impl TierKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Mem => "mem",
            Self::Ssd => "ssd",
            Self::Hdd => "hdd",
        }
    }
}

/// One `--tier` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierSpec {
    pub kind: TierKind,
    /// Required for `ssd` and `hdd`; `mem` defaults to `/dev/shm/granary-<worker id>`.
    pub dir: Option<PathBuf>,
    pub size: u64,
}

impl TierSpec {
    /// Parses `mem:SIZE`, `mem:DIR:SIZE`, `ssd:DIR:SIZE` or `hdd:DIR:SIZE`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (kind, rest) = s
            .split_once(':')
            .ok_or_else(|| format!("tier {s:?} must look like mem:SIZE or ssd:DIR:SIZE"))?;
        let kind = match kind {
            "mem" => TierKind::Mem,
            "ssd" => TierKind::Ssd,
            "hdd" => TierKind::Hdd,
            other => {
                return Err(format!(
                    "unknown tier kind {other:?} in {s:?}; expected mem, ssd or hdd"
                ))
            }
        };
        let (dir, size) = match rest.rsplit_once(':') {
            Some((dir, size)) => (Some(PathBuf::from(dir)), size),
            None => (None, rest),
        };
        if kind != TierKind::Mem && dir.is_none() {
            return Err(format!(
                "tier {s:?} needs a directory: {}:DIR:SIZE",
                kind.name()
            ));
        }
        if dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
            return Err(format!("tier {s:?} has an empty directory"));
        }
        let size =
            granary_common::size::parse_size(size).map_err(|e| format!("tier {s:?}: {e}"))?;
        Ok(Self { kind, dir, size })
    }
}

/// Checks a set of tiers: at most one of each kind, each at least one page.
pub fn validate_tiers(tiers: &[TierSpec], page_size: u64) -> Result<(), String> {
    let mut seen = HashSet::new();
    for t in tiers {
        if !seen.insert(t.kind) {
            return Err(format!("more than one {} tier", t.kind.name()));
        }
        if t.size < page_size {
            return Err(format!(
                "the {} tier's size {} is smaller than one page ({page_size} bytes)",
                t.kind.name(),
                t.size
            ));
        }
    }
    Ok(())
}

/// Lease ids carry their tier in the low bits.
const TIER_BITS: u64 = 3;

pub struct TieredStore {
    /// Fastest first.
    pub tiers: Vec<Arc<PageStore>>,
    /// All tiers together.
    pub capacity: u64,
    pub page_size: u64,
}

/// Creates a tier's folder if missing, checks that it is a folder of this user's own (not
/// a link, not another user's) and closes it to others (0700). Found by a review: the
/// default memory tier is `/dev/shm/granary-<worker id>`, where anyone may make folders;
/// one a local user made before the worker started let them swap the cache's `files/`
/// for their own and read or rewrite what every tenant reads.
fn own_tier_dir(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| super::io_err(dir, e))?;
    let meta = std::fs::symlink_metadata(dir).map_err(|e| super::io_err(dir, e))?;
    let me = nix::unistd::geteuid().as_raw();
    if !meta.is_dir() || meta.uid() != me {
        let why =
            format!(
            "a cache tier's folder must be a folder of the worker's user (uid {me}): this is {} \
             of uid {}, so another user could change what the cache holds; remove it, or name \
             a folder of this user's",
            if meta.is_dir() { "a folder" } else { "not a folder" },
            meta.uid()
        );
        return Err(super::io_err(
            dir,
            std::io::Error::new(std::io::ErrorKind::PermissionDenied, why),
        ));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| super::io_err(dir, e))?;
    }
    Ok(())
}

impl TieredStore {
    /// Opens the tiers (sorted fastest first); `mem_default` is the memory tier's directory
    /// when its spec names none.
    pub fn open(
        specs: &[TierSpec],
        mem_default: &Path,
        page_size: u64,
        policy: PolicyKind,
        metrics: WorkerMetrics,
    ) -> Result<Arc<Self>, StoreError> {
        let mut specs = specs.to_vec();
        specs.sort_by_key(|t| t.kind);
        let mut tiers: Vec<Arc<PageStore>> = Vec::with_capacity(specs.len());
        for t in &specs {
            let dir = t.dir.clone().unwrap_or_else(|| mem_default.to_path_buf());
            own_tier_dir(&dir)?;
            // Absolute and plain: leases name block files by it, and mounts open only
            // paths shaped as cache files (no `.`, no `..`, from the root).
            let dir = std::fs::canonicalize(&dir).map_err(|e| super::io_err(&dir, e))?;
            let store = PageStore::open_tier(
                t.kind.name(),
                &dir,
                t.size,
                page_size,
                policy,
                metrics.clone(),
            )?;
            if let Some(above) = tiers.last() {
                above.set_lower(store.clone());
            }
            tiers.push(store);
        }
        Ok(Self::from_tiers(tiers, page_size))
    }

    /// A cache of one tier.
    pub fn single(store: Arc<PageStore>) -> Arc<Self> {
        let ps = store.page_size;
        Self::from_tiers(vec![store], ps)
    }

    fn from_tiers(tiers: Vec<Arc<PageStore>>, page_size: u64) -> Arc<Self> {
        Arc::new(Self {
            capacity: tiers.iter().map(|t| t.capacity).sum(),
            tiers,
            page_size,
        })
    }

    fn promote(&self, from: usize, key: &PageKey, data: &[u8]) {
        let (top, lower) = (&self.tiers[0], &self.tiers[from]);
        if !top.would_admit(key) {
            top.record_access(key); // so a page read often enough gets in later
            return;
        }
        let Some(stride) = lower.stride_of(key) else {
            return; // gone meanwhile
        };
        // Out of the lower tier's accounting first, so the evictions the move causes find
        // its room there; readable below until it is in the top tier. Held pages stay.
        if !lower.begin_move(key) {
            return;
        }
        let placed = top
            .reserve(key, data.len() as u64)
            .map(|r| top.commit(r, *key, stride, data));
        match placed {
            Some(Ok(())) => lower.finish_move(key, Some("promoted")),
            other => {
                if let Some(Err(e)) = other {
                    tracing::warn!(error = %e, "cannot promote a page to the top tier");
                }
                // Back where it was (the bytes never left the block file).
                let back = lower
                    .reserve_with(key, data.len() as u64, false)
                    .map(|r| lower.commit(r, *key, stride, data).is_ok())
                    .unwrap_or(false);
                lower.finish_move(key, if back { None } else { Some("capacity") });
            }
        }
    }
}

impl BlockStore for TieredStore {
    fn page_size(&self) -> u64 {
        self.page_size
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn tiers(&self) -> Vec<TierUsage> {
        self.tiers
            .iter()
            .map(|t| TierUsage {
                tier: t.tier.clone(),
                capacity: t.capacity,
                used: t.used(),
            })
            .collect()
    }

    /// Room on the tier whose folder is `dir` (else the last tier).
    fn reserve_room_in(&self, dir: &Path, len: u64) -> Option<Reservation> {
        self.tiers
            .iter()
            .find(|t| t.dir() == dir)
            .or(self.tiers.last())
            .and_then(|t| t.reserve_room(len))
    }

    /// Reserves room for a new page in the fastest tier that admits it.
    fn reserve(&self, key: &PageKey, len: u64) -> Option<Reservation> {
        self.tiers.iter().find_map(|t| t.reserve(key, len))
    }

    /// Commits a page into its reservation (`block_size`: its file's, see
    /// [`PageStore::commit`]).
    fn commit(
        &self,
        r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
    ) -> Result<(), StoreError> {
        let store = r.store.clone();
        store.commit(r, key, block_size, data)
    }

    /// Reserves room for a node copy of a page (see [`PageStore::reserve_node_copy`]) in
    /// the fastest tier that has it without evicting an owned page.
    fn reserve_node_copy(&self, key: &PageKey, len: u64) -> Option<Reservation> {
        self.tiers
            .iter()
            .find_map(|t| t.reserve_node_copy(key, len))
    }

    /// Commits a node copy into its reservation.
    fn commit_node_copy(
        &self,
        r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
    ) -> Result<(), StoreError> {
        let store = r.store.clone();
        store.commit_with(r, key, block_size, data, true)
    }

    /// Bytes of node copies held, all tiers together.
    fn node_copy_bytes(&self) -> u64 {
        self.tiers.iter().map(|t| t.node_copy_bytes()).sum()
    }

    /// Reads a cached page from whichever tier holds it, moving it up to the top tier when
    /// that tier's policy admits it.
    fn get(&self, key: &PageKey) -> Option<Bytes> {
        for (i, t) in self.tiers.iter().enumerate() {
            if let Some(b) = t.get(key) {
                if i > 0 {
                    self.promote(i, key, &b);
                }
                return Some(b);
            }
        }
        None
    }

    fn contains(&self, key: &PageKey) -> bool {
        self.tiers.iter().any(|t| t.contains(key))
    }

    /// Whether any tier holds a page of version `version` of file `inode`.
    fn holds_version(&self, inode: u64, version: u64) -> bool {
        self.tiers.iter().any(|t| t.holds_version(inode, version))
    }

    /// Drops a page from whichever tier holds it (see [`PageStore::drop_page`]).
    fn drop_page(&self, key: &PageKey, why: &str) {
        for t in &self.tiers {
            t.drop_page(key, why);
        }
    }

    fn would_admit(&self, key: &PageKey) -> bool {
        self.tiers.iter().any(|t| t.would_admit(key))
    }

    fn used(&self) -> u64 {
        self.tiers.iter().map(|t| t.used()).sum()
    }

    fn used_and_reserved(&self) -> u64 {
        self.tiers.iter().map(|t| t.used_and_reserved()).sum()
    }

    fn page_count(&self) -> u64 {
        self.tiers.iter().map(|t| t.page_count()).sum()
    }

    fn blocks(&self) -> Vec<pb::BlockId> {
        let mut all: HashSet<BlockKey> = HashSet::new();
        for t in &self.tiers {
            all.extend(t.block_keys());
        }
        all.iter().map(block_id).collect()
    }

    /// Block report deltas of all tiers: a block that left one tier but is still in
    /// another is not reported removed.
    fn take_deltas(&self) -> (Vec<pb::BlockId>, Vec<pb::BlockId>) {
        if self.tiers.len() == 1 {
            return self.tiers[0].take_deltas();
        }
        let (mut added, mut removed) = (HashSet::new(), HashSet::new());
        for t in &self.tiers {
            let (a, r) = t.take_delta_keys();
            added.extend(a);
            removed.extend(r);
        }
        removed.retain(|b| !self.tiers.iter().any(|t| t.has_block(b)));
        added.retain(|b| self.tiers.iter().any(|t| t.has_block(b)));
        (
            added.iter().map(block_id).collect(),
            removed.iter().map(block_id).collect(),
        )
    }

    fn clear_deltas(&self) {
        for t in &self.tiers {
            t.clear_deltas();
        }
    }

    fn drop_stale_many(&self, files: &[(u64, u64)]) -> u64 {
        self.tiers.iter().map(|t| t.drop_stale_many(files)).sum()
    }

    fn drop_version(&self, inode: u64, version: u64) -> u64 {
        self.tiers
            .iter()
            .map(|t| t.drop_version(inode, version))
            .sum()
    }

    fn pin(&self, inode: u64) {
        for t in &self.tiers {
            t.pin(inode);
        }
    }

    fn unpin(&self, inode: u64) {
        for t in &self.tiers {
            t.unpin(inode);
        }
    }

    fn set_pinned(&self, inodes: &HashSet<u64>) {
        for t in &self.tiers {
            t.set_pinned(inodes);
        }
    }

    /// Inodes whose pages are never evicted, in any tier (see [`PageStore::pinned`]).
    fn pinned(&self) -> HashSet<u64> {
        self.tiers.iter().flat_map(|t| t.pinned()).collect()
    }

    /// See [`PageStore::add_pinned`].
    fn add_pinned(&self, inodes: &[u64]) {
        for t in &self.tiers {
            t.add_pinned(inodes);
        }
    }

    /// Lease ids name their tier.
    fn lease_pages(
        &self,
        b: &BlockKey,
        first: u32,
        max_pages: u32,
        until: Instant,
        replaces: Option<u64>,
    ) -> Option<Lease> {
        if let Some(id) = replaces {
            self.release(id);
        }
        self.tiers.iter().enumerate().find_map(|(i, t)| {
            if !t.contains(&(*b, first)) {
                return None;
            }
            t.lease_pages(b, first, max_pages, until, None)
                .map(|mut l| {
                    l.id = (l.id << TIER_BITS) | i as u64;
                    l
                })
        })
    }

    fn release(&self, id: u64) {
        if let Some(t) = self.tiers.get((id & ((1 << TIER_BITS) - 1)) as usize) {
            t.release(id >> TIER_BITS);
        }
    }

    /// [`release`](Self::release) of several leases (one lock per tier).
    fn release_many(&self, ids: &[u64]) {
        for (i, t) in self.tiers.iter().enumerate() {
            let mine: Vec<u64> = ids
                .iter()
                .filter(|&&id| (id & ((1 << TIER_BITS) - 1)) as usize == i)
                .map(|&id| id >> TIER_BITS)
                .collect();
            if !mine.is_empty() {
                t.release_many(&mine);
            }
        }
    }

    /// Leases in force and the bytes they hold, all tiers.
    fn lease_stats(&self) -> (usize, u64) {
        self.tiers.iter().fold((0, 0), |(n, b), t| {
            let (tn, tb) = t.lease_stats();
            (n + tn, b + tb)
        })
    }
}

#[cfg(test)]
mod tests;
