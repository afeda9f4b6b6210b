//! The page store: cached pages of blocks on local disk.
//!
//! Layout under `--cache-dir`:
//! - `files/<xx>/<inode>-<version>`: one sparse file per cached file version, its blocks at
//!   their offsets in the file: page `p` of block `i` lives at `i * block_size +
//!   p * page_size`. A file whose pages are all cached is one plain local file with the
//!   file's bytes at the file's offsets — what short-circuit reads and FUSE passthrough
//!   serve directly, whatever the file's length.
//! - `index/`: a RocksDB with one record per cached page (length, CRC32C, whether it is a
//!   node copy, and its file's block size), reloaded at start.
//!
//! Caches of the layout before (`blocks/`, a file per block; records without a block size)
//! are dropped at start with a log line: nothing says where their blocks would lie.
//!
//! Invariants: the bytes accounted as used (committed pages + reservations of in-flight
//! fills) never exceed the capacity — space is reserved, evicting first, before a page is
//! admitted; a page whose bytes fail their checksum is dropped and never served.
//!
//! Held pages are never evicted: pages of a *pinned* inode (pins come from the master), and
//! pages under a short-circuit *lease* (a client on this host reads them from the block file
//! directly until the lease ends or is replaced). Held pages are kept out of the eviction
//! policy altogether, so a cache full of held pages refuses new fills (they are served
//! uncached) instead of scanning past them. Leases are bounded so they cannot starve the
//! cache: a window of at most [`LEASE_WINDOW_PAGES`] pages each, and at most
//! [`LEASED_SHARE`] of the capacity leased at once (beyond it a lease comes back smaller or
//! empty and the client reads over gRPC). Stale-version and corrupt pages are dropped even
//! when held.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Instant;

use bytes::Bytes;
use granary_common::ids::{block_name, parse_block_name};
use granary_proto as pb;
use rocksdb::DB;
use thiserror::Error;

use crate::evict::{EvictionPolicy, PolicyKind};
use crate::metrics::WorkerMetrics;

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("cache directory {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cache index: {0}")]
    Index(#[from] rocksdb::Error),
    #[error("page {page} of block {index} does not fit blocks of {block_size} bytes, or the file's cached pages have another block size")]
    Layout {
        index: u32,
        page: u32,
        block_size: u64,
    },
}

/// Why a cached page's bytes cannot be served.
#[derive(Debug, Error)]
enum Unusable {
    #[error("failed its checksum")]
    Checksum,
    #[error("unreadable in {0}")]
    Unreadable(String),
    #[error("lies past any file offset")]
    PastOffsets,
}

/// (inode, version, block index)
pub type BlockKey = (u64, u64, u32);
/// (block, page index)
pub type PageKey = (BlockKey, u32);

pub fn block_key(id: &pb::BlockId) -> BlockKey {
    (id.inode, id.version, id.index)
}

pub fn block_id(k: &BlockKey) -> pb::BlockId {
    pb::BlockId {
        inode: k.0,
        version: k.1,
        index: k.2,
    }
}

#[derive(Debug, Clone, Copy)]
struct PageMeta {
    len: u32,
    crc: u32,
    /// Which caching of the page this is (a store-wide counter, not persisted): a read
    /// that failed drops the page only if it was not removed and cached again meanwhile.
    gen: u64,
    /// The block size of the page's file (where its block lies in the file).
    stride: u64,
}

/// Offset of page `key` in its file's cache file, for blocks of `stride` bytes of
/// `page_size` pages (`None`: past what a file offset can be).
fn page_offset(key: &PageKey, stride: u64, page_size: u64) -> Option<u64> {
    let off = stride
        .checked_mul(u64::from(key.0 .2))?
        .checked_add(u64::from(key.1).checked_mul(page_size)?)?;
    (off <= i64::MAX as u64).then_some(off)
}

struct Inner {
    /// Ordered, so the pages of one inode are one range (stale drops touch only them).
    pages: BTreeMap<PageKey, PageMeta>,
    policy: Box<dyn EvictionPolicy<PageKey>>,
    pages_per_block: HashMap<BlockKey, u32>,
    used: u64,
    reserved: u64,
    /// Block report deltas since the last heartbeat.
    added: HashSet<BlockKey>,
    removed: HashSet<BlockKey>,
    /// Inodes whose pages are never evicted.
    pinned: HashSet<u64>,
    /// Inodes the master says are pinned (`granary pin`); kept apart from the write path's
    /// pins so neither undoes the other.
    master_pinned: HashSet<u64>,
    /// Short-circuit leases by id: their pages and until when.
    leases: HashMap<u64, (Vec<PageKey>, Instant)>,
    /// The same leases ordered by expiry, so expiring them never scans every lease.
    lease_expiry: BTreeSet<(Instant, u64)>,
    /// How many leases hold each page.
    leased: HashMap<PageKey, u32>,
    /// Pages named by all leases together (a page counts once per lease holding it).
    lease_refs: usize,
    leased_bytes: u64,
    /// The next [`PageMeta::gen`].
    next_gen: u64,
    /// (used bytes, pages) last added to the worker-wide gauges.
    reported: (i64, i64),
    /// Pages evicted and being moved to the tier below: still readable here (their bytes
    /// stay in the block file) until the tier below has them, so a page is never in
    /// neither tier.
    moving: HashMap<PageKey, PageMeta>,
    /// Node copies: pages of blocks another worker owns, kept for clients on this node
    /// (see [`PageStore::reserve_node_copy`]). Evicted first, oldest first (`node_order`
    /// may name pages no longer node copies: skipped when popped).
    node_copies: HashSet<PageKey>,
    node_order: VecDeque<PageKey>,
}

impl Inner {
    fn held(&self, key: &PageKey) -> bool {
        self.pinned.contains(&key.0 .0)
            || self.master_pinned.contains(&key.0 .0)
            || self.leased.contains_key(key)
    }

    /// Page `key` is no longer held (lease ended, unpinned): the policy may evict it again,
    /// and a node copy goes back in the node copies' line.
    fn make_evictable(&mut self, key: PageKey) {
        self.policy.insert(key);
        if self.node_copies.contains(&key) {
            self.node_order.push_back(key);
        }
    }

    /// Records page `key` as a node copy (or, `false`, as owned).
    fn mark_node_copy(&mut self, key: PageKey, node_copy: bool) {
        if !node_copy {
            self.node_copies.remove(&key);
            return;
        }
        if self.node_copies.insert(key) {
            self.node_order.push_back(key);
            if self.node_order.len() > 2 * self.node_copies.len() + 1024 {
                let live = &self.node_copies;
                self.node_order.retain(|k| live.contains(k));
            }
        }
    }

    /// The block size of the pages of `inode`'s version `version` held here (cached or
    /// being moved out), if any is.
    fn version_stride(&self, inode: u64, version: u64) -> Option<u64> {
        let of_it = |k: &PageKey| k.0 .0 == inode && k.0 .1 == version;
        self.pages
            .range(((inode, version, 0), 0)..)
            .next()
            .filter(|(k, _)| of_it(k))
            .map(|(_, m)| m.stride)
            .or_else(|| {
                self.moving
                    .iter()
                    .find(|(k, _)| of_it(k))
                    .map(|(_, m)| m.stride)
            })
    }

    /// The cached pages of one inode (every version and block).
    fn inode_pages(&self, inode: u64) -> Vec<PageKey> {
        self.pages
            .range(((inode, 0, 0), 0)..)
            .map(|(k, _)| *k)
            .take_while(|k| k.0 .0 == inode)
            .collect()
    }

    /// Ends the leases that expired by `now`; their pages become evictable again.
    fn expire_leases(&mut self, now: Instant) {
        while let Some(&(until, id)) = self.lease_expiry.first() {
            if until > now {
                break;
            }
            self.end_lease(id);
        }
    }

    fn end_lease(&mut self, id: u64) {
        let Some((keys, until)) = self.leases.remove(&id) else {
            return;
        };
        self.lease_expiry.remove(&(until, id));
        self.lease_refs -= keys.len();
        for k in keys {
            let last = match self.leased.get_mut(&k) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    false
                }
                Some(_) => true,
                None => false,
            };
            if !last {
                continue;
            }
            self.leased.remove(&k);
            // The page may have been dropped (stale, corrupt) meanwhile.
            if let Some(m) = self.pages.get(&k) {
                self.leased_bytes -= u64::from(m.len);
                if !self.held(&k) {
                    self.make_evictable(k);
                }
            }
        }
    }
}

/// Most pages one short-circuit lease covers (from the page the client asked for).
pub const LEASE_WINDOW_PAGES: u32 = 16;
/// Most of the capacity held by short-circuit leases at once.
pub const LEASED_SHARE: f64 = 0.25;

/// Page references all leases together may hold: this many, plus four per page of the
/// leased share (a lease request past it is answered as not cached; the client reads
/// through the worker instead).
pub const MAX_LEASE_REFS_BASE: usize = 65_536;

/// A short-circuit lease: cached pages of one block that stay in the block file (never
/// evicted) until `until` or until the lease is released.
#[derive(Debug, Clone)]
pub struct Lease {
    pub id: u64,
    /// The cache file of the block's file version.
    pub path: PathBuf,
    /// Offset of the block's first byte in `path`.
    pub offset: u64,
    /// (page index, length, CRC32C) of the leased pages, in order.
    pub pages: Vec<(u32, u32, u32)>,
    pub until: Instant,
}

/// Space reserved for one page being filled. Dropping it without `commit` releases it.
pub struct Reservation {
    store: Arc<PageStore>,
    len: u64,
    done: bool,
}

impl Reservation {
    /// Bytes reserved.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds `other`'s room to this reservation (both of one store; else `other` is given
    /// back).
    pub fn absorb(&mut self, mut other: Reservation) -> Result<(), Reservation> {
        if !Arc::ptr_eq(&self.store, &other.store) {
            return Err(other);
        }
        self.len += other.len;
        other.done = true;
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            let mut inner = self.store.lock();
            inner.reserved -= self.len;
        }
    }
}

pub struct PageStore {
    dir: PathBuf,
    pub capacity: u64,
    pub page_size: u64,
    index: DB,
    inner: Mutex<Inner>,
    metrics: WorkerMetrics,
    /// This tier's name in metrics (`mem`, `ssd`, `hdd`).
    pub tier: String,
    /// The tier below: evicted pages move there instead of leaving the cache.
    lower: OnceLock<Arc<PageStore>>,
    /// Cache files by [`file_lock`](Self::file_lock) stripe: a commit holds its file's
    /// stripe shared while it writes and indexes a page; removing pages holds it exclusive
    /// while it re-checks and deletes or punches, so a page committed into a cache file
    /// that another thread found empty is never deleted with it.
    files: Box<[RwLock<()>]>,
}

/// Stripes of [`PageStore::files`].
const FILE_LOCKS: usize = 64;

impl Drop for PageStore {
    fn drop(&mut self) {
        // Take this store's share out of the worker-wide gauges.
        let (u, p) = self.lock().reported;
        self.metrics.cache_used_bytes.dec_by(u);
        self.metrics.cache_pages.dec_by(p);
    }
}

fn io_err(path: &Path, source: std::io::Error) -> StoreError {
    StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn index_key(k: &PageKey) -> Vec<u8> {
    let mut v = Vec::with_capacity(24);
    v.extend_from_slice(&k.0 .0.to_be_bytes());
    v.extend_from_slice(&k.0 .1.to_be_bytes());
    v.extend_from_slice(&k.0 .2.to_be_bytes());
    v.extend_from_slice(&k.1.to_be_bytes());
    v
}

fn parse_index_key(v: &[u8]) -> Option<PageKey> {
    if v.len() != 24 {
        return None;
    }
    let inode = u64::from_be_bytes(v[0..8].try_into().ok()?);
    let version = u64::from_be_bytes(v[8..16].try_into().ok()?);
    let index = u32::from_be_bytes(v[16..20].try_into().ok()?);
    let page = u32::from_be_bytes(v[20..24].try_into().ok()?);
    Some(((inode, version, index), page))
}

impl PageStore {
    /// Opens (or creates) the store and reloads the index of pages cached before a restart.
    pub fn open(
        dir: &Path,
        capacity: u64,
        page_size: u64,
        policy: PolicyKind,
        metrics: WorkerMetrics,
    ) -> Result<Arc<Self>, StoreError> {
        Self::open_tier("ssd", dir, capacity, page_size, policy, metrics)
    }

    /// Opens one tier of a tiered cache (`tier` names it in metrics).
    pub fn open_tier(
        tier: &str,
        dir: &Path,
        capacity: u64,
        page_size: u64,
        policy: PolicyKind,
        metrics: WorkerMetrics,
    ) -> Result<Arc<Self>, StoreError> {
        // Cached bytes are the data of every principal: readable by the worker's user only
        // (folders 0700, block files 0600; a folder made by an older version is closed too).
        let files = dir.join("files");
        private_dir(&files).map_err(|e| io_err(&files, e))?;
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        let index = DB::open(&opts, dir.join("index"))?;
        let store = Arc::new(Self {
            dir: dir.to_path_buf(),
            capacity,
            page_size,
            index,
            inner: Mutex::new(Inner {
                pages: BTreeMap::new(),
                policy: policy.build(capacity / page_size.max(1)),
                pages_per_block: HashMap::new(),
                used: 0,
                reserved: 0,
                added: HashSet::new(),
                removed: HashSet::new(),
                pinned: HashSet::new(),
                master_pinned: HashSet::new(),
                leases: HashMap::new(),
                lease_expiry: BTreeSet::new(),
                leased: HashMap::new(),
                lease_refs: 0,
                leased_bytes: 0,
                next_gen: 1,
                reported: (0, 0),
                moving: HashMap::new(),
                node_copies: HashSet::new(),
                node_order: VecDeque::new(),
            }),
            metrics,
            tier: tier.to_string(),
            lower: OnceLock::new(),
            files: (0..FILE_LOCKS).map(|_| RwLock::new(())).collect(),
        });
        store
            .metrics
            .tier_capacity_bytes
            .get_or_create(&crate::metrics::Tier::new(tier))
            .set(capacity as i64);
        store.reload()?;
        Ok(store)
    }

    /// Makes evicted pages move to `lower` (the next tier) instead of leaving the cache.
    pub fn set_lower(&self, lower: Arc<PageStore>) {
        let _ = self.lower.set(lower);
    }

    /// Publishes used bytes and pages: this tier's gauges, and the change to the
    /// worker-wide totals.
    fn report(&self, inner: &mut Inner) {
        let (u, p) = (inner.used as i64, inner.pages.len() as i64);
        let (ru, rp) = inner.reported;
        self.metrics.cache_used_bytes.inc_by(u - ru);
        self.metrics.cache_pages.inc_by(p - rp);
        inner.reported = (u, p);
        let t = crate::metrics::Tier::new(&self.tier);
        self.metrics.tier_used_bytes.get_or_create(&t).set(u);
        self.metrics.tier_pages.get_or_create(&t).set(p);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The stripe of [`files`](Self::files) that guards the cache file of block `b`'s
    /// file version.
    fn file_lock(&self, b: &BlockKey) -> &RwLock<()> {
        let h =
            b.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(b.1.wrapping_mul(0xc2b2_ae3d_27d4_eb4f));
        &self.files[(h % FILE_LOCKS as u64) as usize]
    }

    /// The cache file of block `b`'s file version (every cached block of that version
    /// lies in it at its offset).
    pub fn block_path(&self, b: &BlockKey) -> PathBuf {
        let name = format!("{:016x}-{:016x}", b.0, b.1);
        self.dir.join("files").join(&name[14..16]).join(name)
    }

    /// The block size of the file version whose page `key` is cached here.
    pub fn stride_of(&self, key: &PageKey) -> Option<u64> {
        let inner = self.lock();
        inner
            .pages
            .get(key)
            .or(inner.moving.get(key))
            .map(|m| m.stride)
    }

    /// Drops a cache of the layout before this one (a file per block under `blocks/`):
    /// its records name no block size, so nothing says where their pages would lie in a
    /// file's cache file.
    fn drop_old_layout(&self, records: usize) {
        let old = self.dir.join("blocks");
        if !old.exists() && records == 0 {
            return;
        }
        tracing::warn!(
            tier = %self.tier,
            pages = records,
            dir = %old.display(),
            "dropping a cache of an older layout (a file per block): its files are cached again on their next read"
        );
        if let Err(e) = std::fs::remove_dir_all(&old) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %old.display(), error = %e, "cannot remove the older cache layout");
            }
        }
    }

    fn reload(self: &Arc<Self>) -> Result<(), StoreError> {
        let (mut stale, mut old_layout) = (Vec::new(), 0);
        {
            let mut inner = self.lock();
            let mut exists = HashMap::new();
            for item in self.index.iterator(rocksdb::IteratorMode::Start) {
                let (k, v) = item?;
                // (len, crc, 1 for a node copy else 0, block size). Records of 8 or 9 bytes
                // are of the layout before (a file per block).
                if v.len() == 8 || v.len() == 9 {
                    old_layout += 1;
                    stale.push(k.to_vec());
                    continue;
                }
                let (Some(key), true) = (parse_index_key(&k), v.len() == 17) else {
                    stale.push(k.to_vec());
                    continue;
                };
                let node_copy = v[8] == 1;
                let len = u32::from_be_bytes([v[0], v[1], v[2], v[3]]);
                let crc = u32::from_be_bytes([v[4], v[5], v[6], v[7]]);
                let stride = u64::from_be_bytes(v[9..17].try_into().unwrap_or_default());
                let fits = page_offset(&key, stride, self.page_size).is_some()
                    && u64::from(key.1) * self.page_size + u64::from(len) <= stride;
                let file_there = *exists
                    .entry((key.0 .0, key.0 .1))
                    .or_insert_with(|| self.block_path(&key.0).exists());
                if !fits
                    || !file_there
                    || inner
                        .version_stride(key.0 .0, key.0 .1)
                        .is_some_and(|s| s != stride)
                {
                    stale.push(k.to_vec());
                    continue;
                }
                let gen = inner.next_gen;
                inner.next_gen += 1;
                inner.pages.insert(
                    key,
                    PageMeta {
                        len,
                        crc,
                        gen,
                        stride,
                    },
                );
                inner.policy.insert(key);
                inner.mark_node_copy(key, node_copy);
                *inner.pages_per_block.entry(key.0).or_default() += 1;
                inner.used += u64::from(len);
            }
        }
        for k in stale {
            self.index.delete(k)?;
        }
        self.drop_old_layout(old_layout);
        // A smaller capacity than last time: evict down to it.
        let victims = {
            let mut inner = self.lock();
            let mut v = Vec::new();
            while inner.used > self.capacity {
                match Self::evict_one(&mut inner) {
                    Some(x) => v.push(x),
                    None => break,
                }
            }
            inner.added.clear();
            inner.removed.clear();
            v
        };
        self.finish_evictions(victims);
        let mut inner = self.lock();
        self.report(&mut inner);
        tracing::info!(
            pages = inner.pages.len(),
            used = inner.used,
            "cache index reloaded"
        );
        Ok(())
    }

    /// Bytes of committed pages.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    /// Bytes of committed pages plus in-flight reservations (never above capacity).
    pub fn used_and_reserved(&self) -> u64 {
        let i = self.lock();
        i.used + i.reserved
    }

    pub fn page_count(&self) -> u64 {
        self.lock().pages.len() as u64
    }

    pub fn blocks(&self) -> Vec<pb::BlockId> {
        self.lock().pages_per_block.keys().map(block_id).collect()
    }

    pub fn block_keys(&self) -> Vec<BlockKey> {
        self.lock().pages_per_block.keys().copied().collect()
    }

    pub fn has_block(&self, b: &BlockKey) -> bool {
        self.lock().pages_per_block.contains_key(b)
    }

    /// Takes the block-report deltas accumulated since the last call.
    pub fn take_deltas(&self) -> (Vec<pb::BlockId>, Vec<pb::BlockId>) {
        let (added, removed) = self.take_delta_keys();
        (
            added.iter().map(block_id).collect(),
            removed.iter().map(block_id).collect(),
        )
    }

    /// [`take_deltas`](Self::take_deltas) as block keys.
    pub fn take_delta_keys(&self) -> (Vec<BlockKey>, Vec<BlockKey>) {
        let mut i = self.lock();
        (i.added.drain().collect(), i.removed.drain().collect())
    }

    pub fn clear_deltas(&self) {
        let mut i = self.lock();
        i.added.clear();
        i.removed.clear();
    }

    /// Would a fill of `key` be admitted now? (Nothing recorded: read-ahead asks before
    /// fetching pages that nobody waits for yet.)
    pub fn would_admit(&self, key: &PageKey) -> bool {
        let inner = self.lock();
        let full = inner.used + inner.reserved + self.page_size > self.capacity;
        inner.policy.would_admit(key, full)
    }

    /// Records an access of a page that is not in this tier (admission frequency only).
    pub fn record_access(&self, key: &PageKey) {
        let mut inner = self.lock();
        inner.policy.admit(key, true);
    }

    /// Whether a page is cached (index only: no read, no recency update).
    pub fn contains(&self, key: &PageKey) -> bool {
        let inner = self.lock();
        inner.pages.contains_key(key) || inner.moving.contains_key(key)
    }

    /// Reads a cached page; `None` when absent or when it fails its checksum (then it is
    /// dropped so the caller refetches).
    pub fn get(self: &Arc<Self>, key: &PageKey) -> Option<Bytes> {
        let mut meta = {
            let mut inner = self.lock();
            match inner.pages.get(key) {
                Some(m) => {
                    let m = *m;
                    inner.policy.touch(key);
                    m
                }
                None => *inner.moving.get(key)?,
            }
        };
        // A failed read of a page that was removed and cached again meanwhile (its block
        // file deleted under the read, then written anew) is no sign of corruption: read the
        // new caching, a few times at most.
        for _ in 0..3 {
            match self.read_cached(key, &meta) {
                Ok(b) => return Some(b),
                Err(e) => {
                    let now = {
                        let inner = self.lock();
                        inner.pages.get(key).or(inner.moving.get(key)).copied()
                    };
                    match now {
                        Some(m) if m.gen != meta.gen => meta = m,
                        Some(_) => {
                            let checksum = matches!(e, Unusable::Checksum);
                            self.drop_bad_page(key, meta.gen, &e.to_string(), checksum);
                            return None;
                        }
                        None => return None, // removed meanwhile: not cached
                    }
                }
            }
        }
        None
    }

    /// The bytes of a cached page (blocking I/O); an error says why they are unusable.
    fn read_cached(&self, key: &PageKey, meta: &PageMeta) -> Result<Bytes, Unusable> {
        let path = self.block_path(&key.0);
        let at = page_offset(key, meta.stride, self.page_size).ok_or(Unusable::PastOffsets)?;
        // read_to_end fills spare capacity without zeroing it first.
        let mut buf = Vec::with_capacity(meta.len as usize);
        let read = File::open(&path).and_then(|mut f| {
            f.seek(SeekFrom::Start(at))?;
            f.take(u64::from(meta.len)).read_to_end(&mut buf)?;
            if buf.len() == meta.len as usize {
                Ok(())
            } else {
                Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof))
            }
        });
        match read {
            Ok(()) if crc32c::crc32c(&buf) == meta.crc => Ok(Bytes::from(buf)),
            Ok(()) => Err(Unusable::Checksum),
            Err(e) => Err(Unusable::Unreadable(format!("{}: {e}", path.display()))),
        }
    }

    /// Drops a page whose bytes are bad, unless it was cached again since `gen`;
    /// `checksum`: they failed their checksum (counted).
    fn drop_bad_page(self: &Arc<Self>, key: &PageKey, gen: u64, why: &str, checksum: bool) {
        let removed = {
            let mut inner = self.lock();
            if inner.pages.get(key).is_none_or(|m| m.gen != gen) {
                return;
            }
            Self::take_page(&mut inner, key).map(|(meta, gone)| (*key, meta, gone))
        };
        tracing::warn!(block = %block_name(&block_id(&key.0)), page = key.1, "cached page {why}; dropping it");
        if checksum {
            self.metrics.checksum_failures.inc();
        }
        if let Some(r) = removed {
            self.remove_pages(vec![r], "corrupt");
        }
    }

    /// Whether any page of version `version` of file `inode` is cached in this tier.
    pub fn holds_version(&self, inode: u64, version: u64) -> bool {
        let inner = self.lock();
        let first = ((inode, version, 0), 0);
        let of_it = |k: &PageKey| k.0 .0 == inode && k.0 .1 == version;
        inner
            .pages
            .range(first..)
            .next()
            .is_some_and(|(k, _)| of_it(k))
            || inner.moving.keys().any(of_it)
    }

    /// Drops a cached page whatever holds it (its bytes are unusable: `why` says why).
    pub fn drop_page(self: &Arc<Self>, key: &PageKey, why: &str) {
        let gen = match self.lock().pages.get(key) {
            Some(m) => m.gen,
            None => return,
        };
        self.drop_bad_page(key, gen, why, false);
    }

    /// Pins `inode`: its cached pages, and those cached later, are never evicted (until
    /// [`unpin`](Self::unpin)). Returns whether it was newly pinned.
    pub fn pin(&self, inode: u64) -> bool {
        let mut inner = self.lock();
        if !inner.pinned.insert(inode) {
            return false;
        }
        for k in inner.inode_pages(inode) {
            inner.policy.remove(&k);
        }
        true
    }

    /// Unpins `inode`: its pages become evictable again (unless leased).
    pub fn unpin(&self, inode: u64) -> bool {
        let mut inner = self.lock();
        if !inner.pinned.remove(&inode) {
            return false;
        }
        for k in inner.inode_pages(inode) {
            if !inner.held(&k) {
                inner.make_evictable(k);
            }
        }
        true
    }

    /// Makes the master's pinned set exactly `inodes` (`granary pin`): their pages, and
    /// those cached later, are never evicted; pages of inodes no longer listed become
    /// evictable again (unless pinned by a write or leased).
    pub fn set_pinned(&self, inodes: &HashSet<u64>) {
        let mut inner = self.lock();
        let gone: Vec<u64> = inner.master_pinned.difference(inodes).copied().collect();
        let new: Vec<u64> = inodes.difference(&inner.master_pinned).copied().collect();
        inner.master_pinned = inodes.clone();
        for inode in new {
            for k in inner.inode_pages(inode) {
                inner.policy.remove(&k);
            }
        }
        for inode in gone {
            for k in inner.inode_pages(inode) {
                if !inner.held(&k) {
                    inner.make_evictable(k);
                }
            }
        }
    }

    /// Adds `inodes` to the master's pinned set (pinned files a load task carries, or a
    /// heartbeat's additions): their pages, and those cached later, are never evicted.
    pub fn add_pinned(&self, inodes: &[u64]) {
        let mut inner = self.lock();
        for &inode in inodes {
            if inner.master_pinned.insert(inode) {
                for k in inner.inode_pages(inode) {
                    inner.policy.remove(&k);
                }
            }
        }
    }

    /// Inodes whose pages are never evicted (by a write or by the master).
    pub fn pinned(&self) -> HashSet<u64> {
        let inner = self.lock();
        inner.pinned.union(&inner.master_pinned).copied().collect()
    }

    /// Grants a short-circuit lease until `until` on the cached pages of block `b` from
    /// page `first` on (at most [`LEASE_WINDOW_PAGES`], consecutive, within the leased-bytes
    /// cap); `replaces` (a lease of the same client) is released first. `None` when no page
    /// could be leased.
    pub fn lease(
        &self,
        b: &BlockKey,
        first: u32,
        until: Instant,
        replaces: Option<u64>,
    ) -> Option<Lease> {
        self.lease_pages(b, first, LEASE_WINDOW_PAGES, until, replaces)
    }

    /// [`lease`](Self::lease) of up to `max_pages` pages.
    pub fn lease_pages(
        &self,
        b: &BlockKey,
        first: u32,
        max_pages: u32,
        until: Instant,
        replaces: Option<u64>,
    ) -> Option<Lease> {
        let mut inner = self.lock();
        if let Some(old) = replaces {
            inner.end_lease(old);
        }
        inner.expire_leases(Instant::now());
        let cap = (self.capacity as f64 * LEASED_SHARE) as u64;
        // Leases of pages already leased take no share of the bytes, but each holds its
        // list of pages: without a bound on those, a caller leasing the same pages again
        // and again held the worker's memory until it ran out.
        if inner.lease_refs >= MAX_LEASE_REFS_BASE + 4 * (cap / self.page_size.max(1)) as usize {
            return None;
        }
        let mut keys = Vec::new();
        let mut pages = Vec::new();
        let mut offset = 0;
        for page in first..first.saturating_add(max_pages) {
            let k = (*b, page);
            let Some(m) = inner.pages.get(&k).copied() else {
                break; // only the consecutive cached run the reader is about to use
            };
            let already = inner.leased.contains_key(&k);
            if !already && inner.leased_bytes + u64::from(m.len) > cap {
                break;
            }
            if !already {
                inner.leased_bytes += u64::from(m.len);
                inner.policy.remove(&k);
            }
            *inner.leased.entry(k).or_default() += 1;
            keys.push(k);
            pages.push((page, m.len, m.crc));
            offset = m.stride * u64::from(b.2);
        }
        if keys.is_empty() {
            return None;
        }
        // Unguessable: `release_leases` ends any lease it names, whoever asks, so a lease id
        // must not be one another client can count to (sequential ids let anyone end every
        // lease, and the pages punched out under a reader read as zeros).
        // 56 random bits: a tiered store puts the tier in the low bits of the ids it hands out.
        let fresh = || (rand::random::<u64>() >> 8).max(1);
        let mut id = fresh();
        while inner.leases.contains_key(&id) {
            id = fresh();
        }
        inner.lease_refs += keys.len();
        inner.leases.insert(id, (keys, until));
        inner.lease_expiry.insert((until, id));
        drop(inner);
        Some(Lease {
            id,
            path: self.block_path(b),
            offset,
            pages,
            until,
        })
    }

    /// Ends a lease now (its pages become evictable again unless otherwise held).
    pub fn release(&self, id: u64) {
        self.lock().end_lease(id);
    }

    /// [`release`](Self::release) of several leases at once (unknown ids are ignored).
    pub fn release_many(&self, ids: &[u64]) {
        let mut inner = self.lock();
        for &id in ids {
            inner.end_lease(id);
        }
    }

    /// Leases that have not expired, and the bytes they hold.
    pub fn lease_stats(&self) -> (usize, u64) {
        let mut inner = self.lock();
        inner.expire_leases(Instant::now());
        (inner.leases.len(), inner.leased_bytes)
    }

    /// Drops every cached page of `inode` whose version is not `keep` (its under-store
    /// object changed or vanished; 0 keeps nothing). Returns the bytes freed.
    pub fn drop_stale(self: &Arc<Self>, inode: u64, keep: u64) -> u64 {
        self.drop_stale_many(&[(inode, keep)])
    }

    /// [`drop_stale`](Self::drop_stale) for several files in one pass over the index.
    pub fn drop_stale_many(self: &Arc<Self>, files: &[(u64, u64)]) -> u64 {
        self.drop_versions(files, false)
    }

    /// Drops the cached pages of version `version` of `inode` (a write of it failed).
    pub fn drop_version(self: &Arc<Self>, inode: u64, version: u64) -> u64 {
        self.drop_versions(&[(inode, version)], true)
    }

    /// Drops the pages of each `(inode, version)` (`exact`) or of the inode's other versions.
    fn drop_versions(self: &Arc<Self>, files: &[(u64, u64)], exact: bool) -> u64 {
        if files.is_empty() {
            return 0;
        }
        let keep: HashMap<u64, u64> = files.iter().copied().collect();
        let victims = {
            let mut inner = self.lock();
            let mut keys: Vec<PageKey> = Vec::new();
            for (&inode, &version) in &keep {
                keys.extend(
                    inner
                        .inode_pages(inode)
                        .into_iter()
                        .filter(|k| (k.0 .1 == version) == exact),
                );
            }
            let mut victims = Vec::with_capacity(keys.len());
            for key in keys {
                if let Some((meta, gone)) = Self::take_page(&mut inner, &key) {
                    victims.push((key, meta, gone));
                }
            }
            victims
        };
        let freed = victims.iter().map(|v| u64::from(v.1.len)).sum();
        if !exact {
            self.metrics.stale_dropped_bytes.inc_by(freed);
        }
        self.remove_pages(victims, if exact { "its write failed" } else { "stale" });
        freed
    }

    fn unref_block(inner: &mut Inner, b: &BlockKey) -> bool {
        let gone = match inner.pages_per_block.get_mut(b) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                inner.pages_per_block.remove(b);
                true
            }
            None => false,
        };
        if gone {
            inner.added.remove(b);
            inner.removed.insert(*b);
        }
        gone
    }

    /// Removes a page from the accounting whatever holds it (stale or corrupt); returns its
    /// record and whether its block became empty.
    fn take_page(inner: &mut Inner, key: &PageKey) -> Option<(PageMeta, bool)> {
        let meta = inner.pages.remove(key)?;
        inner.policy.remove(key);
        inner.node_copies.remove(key);
        inner.used -= u64::from(meta.len);
        if inner.leased.contains_key(key) {
            inner.leased_bytes -= u64::from(meta.len);
        }
        let gone = Self::unref_block(inner, &key.0);
        Some((meta, gone))
    }

    /// Pops one victim, node copies first; returns (key, meta, whether its block became
    /// empty).
    fn evict_one(inner: &mut Inner) -> Option<(PageKey, PageMeta, bool)> {
        Self::evict_node_copy(inner).or_else(|| Self::evict_by_policy(inner))
    }

    /// Pops the policy's victim.
    fn evict_by_policy(inner: &mut Inner) -> Option<(PageKey, PageMeta, bool)> {
        let key = inner.policy.pop_victim()?;
        inner.node_copies.remove(&key);
        let meta = inner.pages.remove(&key)?;
        inner.used -= u64::from(meta.len);
        let block_gone = Self::unref_block(inner, &key.0);
        Some((key, meta, block_gone))
    }

    /// Pops the oldest node copy that nothing holds (leases, pins), if any.
    /// A held one (leased, pinned) leaves the line and joins it again at the back when it
    /// is let go ([`Inner::make_evictable`]), so each eviction costs O(1) however many are
    /// held.
    fn evict_node_copy(inner: &mut Inner) -> Option<(PageKey, PageMeta, bool)> {
        let mut found = None;
        while let Some(key) = inner.node_order.pop_front() {
            if !inner.node_copies.contains(&key) || !inner.pages.contains_key(&key) {
                inner.node_copies.remove(&key);
                continue;
            }
            if inner.held(&key) {
                continue;
            }
            found = Some(key);
            break;
        }
        let key = found?;
        inner.node_copies.remove(&key);
        inner.policy.remove(&key);
        let meta = inner.pages.remove(&key)?;
        inner.used -= u64::from(meta.len);
        let block_gone = Self::unref_block(inner, &key.0);
        Some((key, meta, block_gone))
    }

    /// Reserves `len` bytes of this tier for something that is not a page (the journal of
    /// an async-through write, kept on this disk until uploaded), evicting pages as for a
    /// page but without the admission filter. The room is held until the reservation is
    /// dropped; `None` when it cannot be freed (the rest is pinned, leased or in flight).
    pub fn reserve_room(self: &Arc<Self>, len: u64) -> Option<Reservation> {
        self.reserve_with(&((0, 0, 0), 0), len, false)
    }

    /// Reserves `len` bytes for page `key` as a node copy (a page of a block another
    /// worker owns, kept for clients on this node): admitted as any page, but it makes
    /// room only by evicting other node copies, never a page this worker owns. `None`:
    /// not cached (the caller serves the page anyway).
    pub fn reserve_node_copy(self: &Arc<Self>, key: &PageKey, len: u64) -> Option<Reservation> {
        self.reserve_as(key, len, true, true)
    }

    /// Bytes of node copies held (see [`reserve_node_copy`](Self::reserve_node_copy)).
    pub fn node_copy_bytes(&self) -> u64 {
        let inner = self.lock();
        inner
            .node_copies
            .iter()
            .filter_map(|k| inner.pages.get(k))
            .map(|m| u64::from(m.len))
            .sum()
    }

    /// The tier's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reserves `len` bytes for page `key` about to be filled, evicting pages as the
    /// policy chooses. `None` when the policy does not admit the page into a full cache, or
    /// when the space cannot be freed (everything else is in flight): the caller serves the
    /// page without caching it.
    pub fn reserve(self: &Arc<Self>, key: &PageKey, len: u64) -> Option<Reservation> {
        self.reserve_with(key, len, true)
    }

    /// [`reserve`](Self::reserve); `admit: false` skips the admission filter (a page
    /// demoted from the tier above earned its place there).
    pub fn reserve_with(
        self: &Arc<Self>,
        key: &PageKey,
        len: u64,
        admit: bool,
    ) -> Option<Reservation> {
        self.reserve_as(key, len, admit, false)
    }

    /// The reservations above. Node copies are evicted first, and dropped rather than
    /// moved to the tier below; `node_copy`: the page is one, and makes room only by
    /// evicting other node copies.
    fn reserve_as(
        self: &Arc<Self>,
        key: &PageKey,
        len: u64,
        admit: bool,
        node_copy: bool,
    ) -> Option<Reservation> {
        if len > self.capacity {
            return None;
        }
        if admit {
            let mut inner = self.lock();
            let full = inner.used + inner.reserved + len > self.capacity;
            if !inner.policy.admit(key, full) {
                drop(inner);
                self.metrics.admission_rejected_pages.inc();
                return None;
            }
        }
        let (victims, node_copies, fits) = {
            let mut inner = self.lock();
            let (mut victims, mut node_copies) = (Vec::new(), Vec::new());
            if inner.used + inner.reserved + len > self.capacity {
                inner.expire_leases(Instant::now());
            }
            let demote = self.lower.get().is_some();
            while inner.used + inner.reserved + len > self.capacity {
                if let Some(v) = Self::evict_node_copy(&mut inner) {
                    node_copies.push(v);
                    continue;
                }
                if node_copy {
                    break;
                }
                match Self::evict_by_policy(&mut inner) {
                    Some(v) => {
                        if demote {
                            inner.moving.insert(v.0, v.1);
                        }
                        victims.push(v)
                    }
                    None => break,
                }
            }
            let fits = inner.used + inner.reserved + len <= self.capacity;
            if fits {
                inner.reserved += len;
            }
            (victims, node_copies, fits)
        };
        self.remove_pages(node_copies, "capacity");
        self.finish_evictions(victims);
        fits.then(|| Reservation {
            store: self.clone(),
            len,
            done: false,
        })
    }

    /// Releases the disk space and index records of evicted pages, first moving each to the
    /// tier below when there is one (and it makes room for it).
    fn finish_evictions(&self, victims: Vec<(PageKey, PageMeta, bool)>) {
        let Some(lower) = self.lower.get() else {
            return self.remove_pages(victims, "capacity");
        };
        let (mut moved, mut dropped) = (Vec::new(), Vec::new());
        for v in victims {
            let ok = self
                .read_page(&v.0, &v.1)
                .and_then(|data| {
                    let r = lower.reserve_with(&v.0, data.len() as u64, false)?;
                    lower.commit(r, v.0, v.1.stride, &data).ok()
                })
                .is_some();
            if ok {
                moved.push(v);
            } else {
                dropped.push(v);
            }
        }
        {
            let mut inner = self.lock();
            for v in moved.iter().chain(&dropped) {
                inner.moving.remove(&v.0);
            }
        }
        self.remove_pages(moved, "demoted");
        self.remove_pages(dropped, "capacity");
    }

    /// The bytes of a page just taken out of the index (for demotion); `None` when they
    /// cannot be read or fail their checksum.
    fn read_page(&self, key: &PageKey, meta: &PageMeta) -> Option<Vec<u8>> {
        let f = File::open(self.block_path(&key.0)).ok()?;
        let mut buf = vec![0u8; meta.len as usize];
        f.read_exact_at(&mut buf, page_offset(key, meta.stride, self.page_size)?)
            .ok()?;
        (crc32c::crc32c(&buf) == meta.crc).then_some(buf)
    }

    /// Starts moving a page to another tier: it leaves this tier's accounting but stays
    /// readable here until [`finish_move`](Self::finish_move). Held pages do not move.
    pub fn begin_move(&self, key: &PageKey) -> bool {
        let mut inner = self.lock();
        if inner.held(key) || inner.moving.contains_key(key) {
            return false;
        }
        match Self::take_page(&mut inner, key) {
            Some((meta, _)) => {
                inner.moving.insert(*key, meta);
                true
            }
            None => false,
        }
    }

    /// Ends a move: `Some(reason)` frees the page's bytes here (`promoted` when it reached
    /// its new tier, `capacity` when it could go nowhere); `None` keeps them (the page was
    /// put back into this tier).
    pub fn finish_move(&self, key: &PageKey, reason: Option<&str>) {
        let meta = self.lock().moving.remove(key);
        if let (Some(meta), Some(reason)) = (meta, reason) {
            self.remove_pages(vec![(*key, meta, true)], reason);
        }
    }

    /// Deletes removed pages from the index and the disk (punching them out of their block
    /// file, or deleting the file with its last page).
    /// `reason` labels `granary_worker_dropped_pages_total`: `capacity` (evicted to make
    /// room), `stale` (a new version of the file), `corrupt` (failed its checksum or could
    /// not be read).
    /// `demoted` and `promoted` pages moved to another tier: counted as such
    /// (`granary_worker_tier_{demoted,promoted}_pages_total`), not as dropped.
    fn remove_pages(&self, victims: Vec<(PageKey, PageMeta, bool)>, reason: &str) {
        if victims.is_empty() {
            return;
        }
        let label = crate::metrics::DropReason {
            reason: reason.to_string(),
        };
        let tier = crate::metrics::Tier::new(&self.tier);
        // A file version this batch empties has its cache file deleted whole, never punched
        // page by page first (a reader holding the file open, e.g. in FUSE passthrough,
        // keeps intact bytes): its pages were all taken out of the index before, so the
        // first of its victims finds it empty. A page of it cached again since keeps the
        // file; the victims are then punched out like any other.
        for (key, meta, _) in victims {
            match reason {
                "demoted" => {
                    self.metrics.tier_demoted_pages.get_or_create(&tier).inc();
                }
                "promoted" => {
                    self.metrics.tier_promoted_pages.get_or_create(&tier).inc();
                }
                _ => {
                    if reason != "stale" {
                        self.metrics.evicted_bytes.inc_by(u64::from(meta.len));
                    }
                    self.metrics.dropped_pages.get_or_create(&label).inc();
                }
            }
            // No commit into this block file runs while we look and act; one that ran since
            // the victims were taken shows in the index.
            let _file = self
                .file_lock(&key.0)
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let (recommitted, live_stride) = {
                let inner = self.lock();
                (
                    inner.pages.contains_key(&key) || inner.moving.contains_key(&key),
                    // Pages being moved out are still read from the file.
                    inner.version_stride(key.0 .0, key.0 .1),
                )
            };
            if recommitted {
                // Cached again in this tier since it was taken: its new bytes and record stay.
                continue;
            }
            if let Err(e) = self.index.delete(index_key(&key)) {
                tracing::error!(error = %e, "cannot delete a page from the cache index");
            }
            let path = self.block_path(&key.0);
            let Some(stride) = live_stride else {
                if let Err(e) = std::fs::remove_file(&path) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(path = %path.display(), error = %e, "cannot remove a cache file");
                    }
                }
                continue;
            };
            // The file was emptied and cached again with another block size: its bytes at
            // this page's old place are no one's (and not this page's to punch).
            let at =
                page_offset(&key, meta.stride, self.page_size).filter(|_| stride == meta.stride);
            if let (Some(at), Ok(f)) = (at, OpenOptions::new().write(true).open(&path)) {
                let off = at as i64;
                use std::os::fd::AsRawFd;
                let res = nix::fcntl::fallocate(
                    f.as_raw_fd(),
                    nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                        | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
                    off,
                    i64::from(meta.len),
                );
                if let Err(e) = res {
                    tracing::warn!(path = %path.display(), error = %e, "cannot punch out an evicted page");
                }
            }
        }
        let mut inner = self.lock();
        self.report(&mut inner);
    }

    /// Writes a filled page into its reservation and indexes it.
    /// `block_size`: the block size of the page's file (where its block lies in the
    /// file's cache file; every cached page of one file version has the same).
    pub fn commit(
        self: &Arc<Self>,
        r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
    ) -> Result<(), StoreError> {
        self.commit_with(r, key, block_size, data, false)
    }

    /// [`commit`](Self::commit); `node_copy`: the page is a node copy (see
    /// [`reserve_node_copy`](Self::reserve_node_copy)), recorded as such in the index.
    pub fn commit_with(
        self: &Arc<Self>,
        mut r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
        node_copy: bool,
    ) -> Result<(), StoreError> {
        debug_assert!(data.len() as u64 <= r.len);
        let layout = || StoreError::Layout {
            index: key.0 .2,
            page: key.1,
            block_size,
        };
        // The page lies inside its block, the block inside what a file offset can be.
        let at = page_offset(&key, block_size, self.page_size)
            .filter(|_| u64::from(key.1) * self.page_size + data.len() as u64 <= block_size)
            .ok_or_else(layout)?;
        // Held until the page is indexed, so no removal deletes the file under it.
        let _file = self
            .file_lock(&key.0)
            .read()
            .unwrap_or_else(|p| p.into_inner());
        // Pages of one file version share its cache file: all at one block size.
        if self
            .lock()
            .version_stride(key.0 .0, key.0 .1)
            .is_some_and(|s| s != block_size)
        {
            return Err(layout());
        }
        let path = self.block_path(&key.0);
        if let Some(parent) = path.parent() {
            if !parent.is_dir() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(parent)
                    .map_err(|e| io_err(parent, e))?;
            }
        }
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| io_err(&path, e))?;
        f.write_all_at(data, at).map_err(|e| io_err(&path, e))?;
        let mut meta = PageMeta {
            len: data.len() as u32,
            crc: crc32c::crc32c(data),
            gen: 0,
            stride: block_size,
        };
        // A page this worker owns stays owned when a node copy of it lands too.
        let node_copy = node_copy && {
            let inner = self.lock();
            !inner.pages.contains_key(&key) || inner.node_copies.contains(&key)
        };
        let mut v = Vec::with_capacity(17);
        v.extend_from_slice(&meta.len.to_be_bytes());
        v.extend_from_slice(&meta.crc.to_be_bytes());
        v.push(u8::from(node_copy));
        v.extend_from_slice(&block_size.to_be_bytes());
        self.index.put(index_key(&key), v)?;
        let mut inner = self.lock();
        meta.gen = inner.next_gen;
        inner.next_gen += 1;
        inner.reserved -= r.len;
        r.done = true;
        let leased = inner.leased.contains_key(&key);
        if leased {
            inner.leased_bytes += u64::from(meta.len);
        }
        inner.mark_node_copy(key, node_copy);
        if let Some(old) = inner.pages.insert(key, meta) {
            // A concurrent fill of the same page won; keep one accounting entry.
            inner.used -= u64::from(old.len);
            if leased {
                inner.leased_bytes -= u64::from(old.len);
            }
            inner.policy.touch(&key);
        } else {
            if !inner.held(&key) {
                inner.policy.insert(key);
            }
            let n = inner.pages_per_block.entry(key.0).or_default();
            *n += 1;
            if *n == 1 {
                inner.removed.remove(&key.0);
                inner.added.insert(key.0);
            }
        }
        inner.used += u64::from(meta.len);
        self.report(&mut inner);
        Ok(())
    }
}

/// Creates `dir` (and its parents) if missing and makes it readable by this user only
/// (0700), also when it already existed.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Reads the worker's persistent id from `dir/worker-id`, creating it on first start.
pub fn worker_id(dir: &Path) -> Result<u64, StoreError> {
    let path = dir.join("worker-id");
    match std::fs::read_to_string(&path) {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|v| *v != 0)
            .ok_or_else(|| {
                io_err(
                    &path,
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "worker-id is not a positive integer",
                    ),
                )
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = loop {
                let v: u64 = rand::random::<u64>() >> 1;
                if v != 0 {
                    break v;
                }
            };
            std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
            let tmp = dir.join("worker-id.tmp");
            std::fs::write(&tmp, format!("{id}\n")).map_err(|e| io_err(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| io_err(&path, e))?;
            Ok(id)
        }
        Err(e) => Err(io_err(&path, e)),
    }
}

/// Parses a block file name back into its key (for tools and tests).
pub fn parse_block_file(name: &str) -> Option<BlockKey> {
    parse_block_name(name).map(|b| block_key(&b))
}

pub mod block_store;
pub mod faults;
pub mod tiers;

pub use block_store::{BlockStore, TierUsage};
pub use tiers::{TierKind, TierSpec, TieredStore};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod proptests;
