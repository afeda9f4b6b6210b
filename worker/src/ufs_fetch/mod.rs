//! Read-through fills. A cold read fetches *parts* of a block — `part_size` bytes, several
//! cache pages, one ranged GET — and hands each page to its waiting readers and to the cache
//! as soon as its bytes have arrived (no store-then-serve). A sequential reader keeps
//! `part_concurrency` parts in flight ahead of it. Every page is fetched once however many
//! readers miss it at once (single-flight), and every response is checked against the
//! file's fingerprint.

use std::collections::{HashMap, VecDeque};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use granary_client::mounts::MountStores;
use granary_client::MasterClient;
use granary_common::net::GrpcChannel as Channel;
use granary_common::ufs::Ufs;
use granary_proto as pb;
use granary_proto::worker_service_client::WorkerServiceClient;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use crate::metrics::{UfsMetrics, WorkerMetrics};
use crate::store::{BlockKey, BlockStore, PageKey};

/// Read-ahead parts in flight at most, across all readers of this worker.
pub const PREFETCH_IN_FLIGHT: usize = 32;
/// MiB of clients' `CacheBlocks` blocks cached at once by this worker, all callers and
/// streams together (a block takes a permit per started MiB, at least one): what a caller
/// asking for many blocks, on many streams, or going away and coming back can make the
/// worker hold and fetch at a time. A client's folder warm keeps 64 small files in flight.
pub const CACHE_BLOCK_PERMITS: u32 = 256;
/// MiB of `ReadBlock` pages this worker holds for its readers at once (fetched or read,
/// waiting for the reader to take them), all callers together; a page takes a permit per
/// started MiB. A reader that never takes what it asked for holds its pages, so without
/// this bound streams of readers that read nothing held the worker's memory until it ran
/// out.
pub const READ_BLOCK_PERMITS: u32 = 1024;
/// The share of [`READ_BLOCK_PERMITS`] one caller (principal) may hold: readers that never
/// read cannot take every reader's room.
pub const READ_BLOCK_PERMITS_PER_CALLER: u32 = 256;

/// How long a ranged GET may go without a byte (for its answer, then between body
/// chunks) before it counts as stalled. A slow store that keeps sending is never cut off:
/// the bytes it sent would be paid for twice.
pub const UFS_TIMEOUT: Duration = Duration::from_secs(60);

/// Deadline of asking the master who holds a block before a fill (on a miss, so short).
const LOCATIONS_TIMEOUT: Duration = Duration::from_millis(500);

/// Deadline of copying one part from a peer worker (then the store serves the rest).
const PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// Attempts of one part whose GET failed in a way worth retrying (a dropped connection
/// mid-body, a stall; `object_store` already retries throttling and 5xx answers before the
/// body), counted since the last attempt that brought bytes.
const PART_ATTEMPTS: u32 = 3;

/// Memory for pages served but not cached ([`Fetcher::keep_uncached`]): at most this much
/// (and an eighth of the cache), each for at most [`UNCACHED_TTL`].
pub const UNCACHED_MAX_BYTES: u64 = 64 * 1024 * 1024;
pub const UNCACHED_TTL: Duration = Duration::from_secs(5);

/// Recently fetched pages that the cache did not take, by age, within a byte budget.
struct Uncached {
    pages: lru::LruCache<PageKey, (Bytes, Instant)>,
    bytes: u64,
    budget: u64,
}

impl Uncached {
    fn new(budget: u64) -> Self {
        Self {
            pages: lru::LruCache::unbounded(),
            bytes: 0,
            budget,
        }
    }

    fn put(&mut self, key: PageKey, data: Bytes) {
        let n = data.len() as u64;
        if let Some((old, _)) = self.pages.put(key, (data, Instant::now())) {
            self.bytes -= old.len() as u64;
        }
        self.bytes += n;
        while self.bytes > self.budget {
            match self.pages.pop_lru() {
                Some((_, (old, _))) => self.bytes -= old.len() as u64,
                None => break,
            }
        }
    }

    fn get(&mut self, key: &PageKey) -> Option<Bytes> {
        let (data, at) = self.pages.peek(key)?;
        if at.elapsed() < UNCACHED_TTL {
            return Some(data.clone());
        }
        if let Some((old, _)) = self.pages.pop(key) {
            self.bytes -= old.len() as u64;
        }
        None
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    #[error("the file changed in the under-store (fingerprint mismatch): {0}")]
    Changed(String),
    #[error("not found in the under-store: {0}")]
    NotFound(String),
    #[error("the under-store refused access: {0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Unavailable(String),
    /// A node copy found no other worker holding a page (it never reads the store).
    #[error("no other worker holds it: {0}")]
    NoPeer(String),
}

/// A block being read: its descriptor and geometry.
#[derive(Debug)]
pub struct BlockRef {
    pub desc: pb::BlockDescriptor,
    pub key: BlockKey,
    /// File offset of the block's first byte.
    pub start: u64,
    /// Bytes in the block.
    pub len: u64,
    /// The workers that held the block when its load task was made (peers to copy from);
    /// `None`: ask the master before filling from the under-store.
    pub holders: Option<Vec<pb::WorkerAddress>>,
    /// A node copy: filled only from peers (the holders, then the placement owner), never
    /// from the under-store, and cached as a node copy.
    pub peers_only: bool,
}

type Outcome = Option<Result<Bytes, FetchError>>;

/// A claimed page's fetch id and the sender its readers wait on.
type Slot = (u64, watch::Sender<Outcome>);

/// Consecutive claimed pages: the first page and its slots (one GET).
type Claimed = (u64, Vec<Slot>);

/// A page being fetched: readers wait on `rx`; `id` tells this fetch from a later one.
struct Pending {
    id: u64,
    rx: watch::Receiver<Outcome>,
}

/// Where a served page came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Cache,
    UnderStore,
}

pub struct Fetcher {
    /// Bounds the read-ahead parts in flight across all readers.
    prefetch_slots: Arc<Semaphore>,
    /// Bounds the bytes of clients' `CacheBlocks` blocks being cached at once, all callers
    /// together: a permit per started MiB ([`CACHE_BLOCK_PERMITS`]).
    pub(crate) cache_slots: Arc<Semaphore>,
    /// Bounds the bytes of `ReadBlock` pages held for readers ([`READ_BLOCK_PERMITS`]).
    pub(crate) read_slots: Arc<Semaphore>,
    /// Each caller's share of them, by principal name.
    read_slots_of: Mutex<HashMap<String, Arc<Semaphore>>>,
    master: MasterClient,
    pub(crate) stores: MountStores,
    inflight: Mutex<HashMap<PageKey, Pending>>,
    next_id: AtomicU64,
    /// Where the last read of a block ended (a read starting there is sequential).
    read_ends: granary_common::sequential::ReadEnds<BlockKey>,
    /// Pages fetched but not cached (full cache, not admitted), kept briefly in memory: a
    /// reader usually asks for a page in several requests, which must not each cost a GET.
    uncached: Mutex<Uncached>,
    /// This worker's id (its own block locations are not peers to fill from).
    worker_id: u64,
    /// Channels to other workers, for filling from a peer.
    peers: Mutex<HashMap<String, WorkerServiceClient<Channel>>>,
    pub store: Arc<dyn BlockStore>,
    metrics: WorkerMetrics,
    /// Fetched pages waiting to be written into the cache, and the threads writing them.
    commits: Mutex<VecDeque<Commit>>,
    committers: AtomicUsize,
    /// Whether the leader said at the last registration or heartbeat that it knows no
    /// other worker: then no peer can hold a block, and a fill does not ask who does.
    alone: AtomicBool,
    /// The live workers as the master last listed them, and when (placement owners of
    /// blocks this worker keeps node copies of).
    live: tokio::sync::Mutex<Option<(Instant, Vec<pb::WorkerInfo>)>>,
}

/// How long the live worker list is used before it is asked for again.
const LIVE_WORKERS_TTL: Duration = Duration::from_secs(5);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Pages of one GET, claimed by the task that fetches them. Pages still owed when it is
/// dropped (error, timeout, panic) are failed, so no reader waits forever.
struct Run {
    fetcher: Arc<Fetcher>,
    block: Arc<BlockRef>,
    first: u64,
    slots: Vec<Slot>,
    /// Index in `slots` of the next page owed.
    next: usize,
    cache: bool,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Run {
    fn page_len(&self, i: usize) -> u64 {
        let ps = self.fetcher.store.page_size();
        ps.min(self.block.len - (self.first + i as u64) * ps)
    }

    /// Hands the next page to its readers, then to the cache (off the async threads; the
    /// page stays joinable in flight until it is cached, so nobody fetches it twice).
    fn deliver(&mut self, data: Bytes) {
        if let Some(c) = self.take_next().hand_out(data) {
            Fetcher::submit_commit(&self.fetcher, c);
        }
    }

    /// Takes the next page's slot out of the run, to be delivered by whoever reads it.
    fn take_next(&mut self) -> Delivery {
        let page = self.first + self.next as u64;
        let (id, tx) = std::mem::replace(&mut self.slots[self.next], (0, watch::channel(None).0));
        self.next += 1;
        Delivery {
            fetcher: self.fetcher.clone(),
            key: (self.block.key, page as u32),
            block_size: self.block.desc.block_size,
            id,
            tx: Some(tx),
            cache: self.cache,
            node_copy: self.block.peers_only,
        }
    }

    /// Gives back the slot [`take_next`](Self::take_next) took (its page was not read whole).
    fn put_back(&mut self, mut d: Delivery) {
        if let Some(tx) = d.tx.take() {
            self.next -= 1;
            self.slots[self.next] = (d.id, tx);
        }
    }

    fn fail_rest(&mut self, e: &FetchError) {
        while self.next < self.slots.len() {
            let key = (self.block.key, (self.first + self.next as u64) as u32);
            let (id, tx) = &self.slots[self.next];
            tx.send_replace(Some(Err(e.clone())));
            self.fetcher.forget(key, *id);
            self.next += 1;
        }
    }
}

/// A fetched page on its way into the cache; its slot stays in flight until then.
struct Commit {
    key: PageKey,
    /// The block size of the page's file (where the page lies in its cache file).
    block_size: u64,
    data: Bytes,
    id: u64,
    /// Held until the page is settled (cached, kept uncached or refused): dropping it tells
    /// those waiting for that.
    _settles: watch::Sender<Outcome>,
    cache: bool,
    node_copy: bool,
}

/// Ends a page's time in flight when dropped: however [`Commit::run`] ends (a panic in the
/// store included), the page is no longer in flight, so a later reader fetches it again
/// instead of finding an entry nobody will settle.
struct Settled<'a> {
    fetcher: &'a Fetcher,
    key: PageKey,
    id: u64,
}

impl Drop for Settled<'_> {
    fn drop(&mut self) {
        self.fetcher.forget(self.key, self.id);
    }
}

impl Commit {
    fn run(self, f: &Fetcher) {
        // Dropped before `self` (a function's locals before its parameters): the page
        // leaves the in-flight table, then its sender goes, which tells waiters it settled.
        let _settled = Settled {
            fetcher: f,
            key: self.key,
            id: self.id,
        };
        if self.cache {
            let len = self.data.len() as u64;
            let reserved = if self.node_copy {
                f.store.reserve_node_copy(&self.key, len)
            } else {
                f.store.reserve(&self.key, len)
            };
            match reserved {
                Some(r) => {
                    let done = if self.node_copy {
                        let done =
                            f.store
                                .commit_node_copy(r, self.key, self.block_size, &self.data);
                        if done.is_ok() {
                            f.metrics.node_copy_bytes.inc_by(len);
                        }
                        done
                    } else {
                        f.store.commit(r, self.key, self.block_size, &self.data)
                    };
                    if let Err(e) = done {
                        // A failing disk fails every page: the first failure and then one
                        // in a thousand are logged, all are counted.
                        f.metrics.cache_write_errors.inc();
                        let n = f.metrics.cache_write_errors.get();
                        if n % 1000 == 1 {
                            tracing::warn!(error = %e, failures = n, "cannot cache a page; serving it uncached");
                        }
                    }
                }
                None => {
                    f.metrics.uncached_fills.inc();
                    f.keep_uncached(self.key, self.data.clone());
                }
            }
        }
    }
}

/// A page's slot taken out of its run ([`Run::take_next`]): delivered, it goes to its
/// readers and then into the cache in the calling thread; dropped undelivered (an error, a
/// panic), its readers are failed as the run fails them.
struct Delivery {
    fetcher: Arc<Fetcher>,
    key: PageKey,
    block_size: u64,
    id: u64,
    tx: Option<watch::Sender<Outcome>>,
    cache: bool,
    node_copy: bool,
}

impl Delivery {
    /// Hands `data` to the page's readers; what is left is its way into the cache.
    fn hand_out(mut self, data: Bytes) -> Option<Commit> {
        let tx = self.tx.take()?;
        tx.send_replace(Some(Ok(data.clone())));
        Some(Commit {
            key: self.key,
            block_size: self.block_size,
            data,
            id: self.id,
            _settles: tx,
            cache: self.cache,
            node_copy: self.node_copy,
        })
    }

    /// Hands `data` to the page's readers, then writes it into the cache in this thread.
    fn deliver(self, data: Bytes) {
        let fetcher = self.fetcher.clone();
        if let Some(c) = self.hand_out(data) {
            c.run(&fetcher);
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            tx.send_replace(Some(Err(FetchError::Unavailable(
                "the under-store fetch was abandoned".into(),
            ))));
            self.fetcher.forget(self.key, self.id);
        }
    }
}

/// Most threads writing fetched pages into the cache at once.
const MAX_COMMITTERS: usize = 4;
/// Pages waiting per committer before another one starts.
const COMMITS_PER_COMMITTER: usize = 8;

impl Drop for Run {
    fn drop(&mut self) {
        self.fail_rest(&FetchError::Unavailable(
            "the under-store fetch was abandoned".into(),
        ));
    }
}

impl Fetcher {
    pub fn new(master: MasterClient, store: Arc<dyn BlockStore>, metrics: WorkerMetrics) -> Self {
        Self {
            prefetch_slots: Arc::new(Semaphore::new(PREFETCH_IN_FLIGHT)),
            cache_slots: Arc::new(Semaphore::new(CACHE_BLOCK_PERMITS as usize)),
            read_slots: Arc::new(Semaphore::new(READ_BLOCK_PERMITS as usize)),
            read_slots_of: Mutex::new(HashMap::new()),
            master,
            stores: MountStores::default(),
            inflight: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            read_ends: Default::default(),
            uncached: Mutex::new(Uncached::new(
                (store.capacity() / 8).clamp(store.page_size(), UNCACHED_MAX_BYTES),
            )),
            worker_id: 0,
            peers: Mutex::new(HashMap::new()),
            store,
            metrics,
            commits: Mutex::new(VecDeque::new()),
            committers: AtomicUsize::new(0),
            alone: AtomicBool::new(false),
            live: tokio::sync::Mutex::new(None),
        }
    }

    /// Caller `who`'s share of the `ReadBlock` budget (looked up once per stream).
    pub fn read_share(&self, who: &str) -> Arc<Semaphore> {
        lock(&self.read_slots_of)
            .entry(who.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(READ_BLOCK_PERMITS_PER_CALLER as usize)))
            .clone()
    }

    /// Room for one page of `ReadBlock` in a caller's `share` first, then in the worker's
    /// budget. Held until the page leaves for the reader's connection.
    pub async fn read_room(
        &self,
        share: &Arc<Semaphore>,
    ) -> Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> {
        let n = self.store.page_size().div_ceil(1 << 20).max(1) as u32;
        let mine = share.clone().acquire_many_owned(n).await.ok()?;
        let all = self.read_slots.clone().acquire_many_owned(n).await.ok()?;
        Some((mine, all))
    }

    /// The placement owner of block `id` among the live workers (the worker every client
    /// reads it from first), unless it is this worker; `None` also when the master cannot
    /// say.
    async fn owner(&self, id: &pb::BlockId) -> Option<pb::WorkerAddress> {
        let workers = {
            let mut live = self.live.lock().await;
            match &*live {
                Some((at, w)) if at.elapsed() < LIVE_WORKERS_TTL => w.clone(),
                _ => {
                    let ask = self.master.cluster_info(false);
                    let info = tokio::time::timeout(LOCATIONS_TIMEOUT, ask)
                        .await
                        .ok()?
                        .ok()?;
                    let w: Vec<pb::WorkerInfo> =
                        info.workers.into_iter().filter(|w| w.is_live()).collect();
                    *live = Some((Instant::now(), w.clone()));
                    w
                }
            }
        };
        let owner = granary_client::placement::order_workers(id, &workers)
            .into_iter()
            .next()?;
        (owner.worker_id != self.worker_id).then_some(pb::WorkerAddress {
            worker_id: owner.worker_id,
            address: owner.address,
            host: owner.host,
        })
    }

    /// Notes how many workers the leader knows, this one included (0: not said, or no
    /// answer: peers are asked for again).
    pub fn note_workers(&self, workers: u32) {
        self.alone.store(workers == 1, Ordering::Relaxed);
    }

    pub fn with_worker_id(mut self, id: u64) -> Self {
        self.worker_id = id;
        self
    }

    fn peer(&self, address: &str) -> Option<WorkerServiceClient<Channel>> {
        let mut m = lock(&self.peers);
        if let Some(c) = m.get(address) {
            return Some(c.clone());
        }
        let ch = self
            .master
            .net()
            .channel(address, granary_common::net::ServerKind::Node)
            .ok()?;
        let c = WorkerServiceClient::new(ch)
            .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(pb::MAX_MESSAGE_BYTES);
        m.insert(address.to_string(), c.clone());
        Some(c)
    }

    /// Queues a fetched page for the cache. A few blocking threads drain the queue (one
    /// more for every [`COMMITS_PER_COMMITTER`] waiting pages, up to [`MAX_COMMITTERS`]):
    /// a thread already busy takes the next page without being woken, so a load of many
    /// small files does not pay a thread hand-off per page.
    fn submit_commit(f: &Arc<Fetcher>, c: Commit) {
        let waiting = {
            let mut q = lock(&f.commits);
            q.push_back(c);
            q.len()
        };
        let running = f.committers.load(Ordering::SeqCst);
        let wanted = waiting
            .div_ceil(COMMITS_PER_COMMITTER)
            .clamp(1, MAX_COMMITTERS);
        if running < wanted
            && f.committers
                .compare_exchange(running, running + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            let f = f.clone();
            tokio::task::spawn_blocking(move || f.drain_commits());
        }
    }

    fn drain_commits(&self) {
        loop {
            let next = lock(&self.commits).pop_front();
            match next {
                Some(c) => {
                    // A page that cannot be cached must not stop this thread (its readers
                    // already have the bytes; its waiters see the fetch end).
                    let done =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.run(self)));
                    if done.is_err() {
                        tracing::error!("writing a fetched page into the cache panicked");
                    }
                }
                None => {
                    self.committers.fetch_sub(1, Ordering::SeqCst);
                    // A page queued by someone who saw this thread still running is taken
                    // here (the queue is checked after the count went down).
                    if lock(&self.commits).is_empty() {
                        return;
                    }
                    self.committers.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }

    fn keep_uncached(&self, key: PageKey, data: Bytes) {
        lock(&self.uncached).put(key, data);
    }

    fn recent_uncached(&self, key: &PageKey) -> Option<Bytes> {
        lock(&self.uncached).get(key)
    }

    fn forget(&self, key: PageKey, id: u64) {
        let mut m = lock(&self.inflight);
        if m.get(&key).is_some_and(|p| p.id == id) {
            m.remove(&key);
        }
    }

    async fn ufs(&self, block: &BlockRef) -> Result<(Ufs, pb::UfsLocation), FetchError> {
        let loc =
            block.desc.ufs.clone().ok_or_else(|| {
                FetchError::Unavailable("block has no under-store location".into())
            })?;
        let ufs = self
            .stores
            .get(&self.master, loc.mount_id)
            .await
            .map_err(|e| FetchError::Unavailable(e.to_string()))?;
        Ok((ufs, loc))
    }

    /// Pages in one part of this mount, and parts a sequential reader keeps in flight; a
    /// cache too small for that much read-ahead fetches single pages and reads no further.
    fn geometry(&self, ufs: &Ufs) -> (u64, u64) {
        let ps = self.store.page_size();
        let part_pages = ufs.part_size.div_ceil(ps).max(1);
        let window = part_pages * ps * ufs.part_concurrency as u64;
        if self.store.capacity() < 4 * window {
            (1, 0)
        } else {
            (part_pages, ufs.part_concurrency as u64)
        }
    }

    /// Claims the pages of `pages` that are neither cached nor being fetched, as runs of
    /// consecutive pages (one GET each). Only `wanted` (the page a reader waits for) is
    /// claimed regardless; the others only if they will be cached — a page nobody waits for
    /// that the cache would not admit is not worth a fetch.
    fn claim(
        &self,
        block: &Arc<BlockRef>,
        pages: RangeInclusive<u64>,
        wanted: Option<u64>,
        cache: bool,
    ) -> Vec<Claimed> {
        let mut runs: Vec<Claimed> = Vec::new();
        let mut m = lock(&self.inflight);
        let mut open = false;
        for page in pages {
            let key = (block.key, page as u32);
            let worth = wanted == Some(page) || (cache && self.store.would_admit(&key));
            if !worth || m.contains_key(&key) || self.store.contains(&key) {
                open = false;
                continue;
            }
            let (tx, rx) = watch::channel(None);
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            m.insert(key, Pending { id, rx });
            if !open {
                runs.push((page, Vec::new()));
                open = true;
            }
            if let Some(run) = runs.last_mut() {
                run.1.push((id, tx));
            }
        }
        runs
    }

    fn spawn_runs(
        self: &Arc<Self>,
        block: &Arc<BlockRef>,
        runs: Vec<Claimed>,
        cache: bool,
        mut permit: Option<OwnedSemaphorePermit>,
    ) {
        for (first, slots) in runs {
            let run = Run {
                fetcher: self.clone(),
                block: block.clone(),
                first,
                slots,
                next: 0,
                cache,
                _permit: permit.take(),
            };
            tokio::spawn(run.fetch());
        }
    }

    /// Bytes page `page` of `block` holds (its block's geometry says so).
    fn page_len(&self, block: &BlockRef, page: u64) -> u64 {
        let ps = self.store.page_size();
        ps.min(block.len.saturating_sub(page.saturating_mul(ps)))
    }

    /// Page `page` of `block` when it is cached with the length the block's geometry gives
    /// it. A cached page of another length was cached for other geometry (it cannot be the
    /// bytes this block holds there): it is dropped, never served.
    pub fn cached_page(&self, block: &BlockRef, page: u64) -> Option<Bytes> {
        let key = (block.key, page as u32);
        let b = self.store.get(&key)?;
        if b.len() as u64 == self.page_len(block, page) {
            return Some(b);
        }
        tracing::warn!(
            ?key,
            len = b.len(),
            "a cached page has the wrong length; dropping it"
        );
        self.store
            .drop_page(&key, "has the wrong length for its block");
        None
    }

    /// Page `page` of `block` when it is not cached but on its way here (fetched by a
    /// reader of this worker, or kept uncached briefly): its bytes once they arrive, within
    /// `wait`. What a peer filling its own cache from this one may have, since waiting for
    /// a fetch in flight costs no store read.
    pub async fn arriving_page(
        &self,
        block: &BlockRef,
        page: u64,
        wait: Duration,
    ) -> Option<Bytes> {
        if let Some(b) = self.recent_uncached_page(block, page) {
            return Some(b);
        }
        let key = (block.key, page as u32);
        let mut rx = lock(&self.inflight).get(&key).map(|p| p.rx.clone())?;
        let outcome = tokio::time::timeout(wait, rx.wait_for(Option::is_some))
            .await
            .ok()?
            .ok()?
            .clone();
        match outcome {
            Some(Ok(b)) if b.len() as u64 == self.page_len(block, page) => Some(b),
            _ => None,
        }
    }

    /// A page fetched recently but not cached, when its length fits the block.
    fn recent_uncached_page(&self, block: &BlockRef, page: u64) -> Option<Bytes> {
        let key = (block.key, page as u32);
        let b = self.recent_uncached(&key)?;
        if b.len() as u64 == self.page_len(block, page) {
            return Some(b);
        }
        let mut u = lock(&self.uncached);
        if let Some((old, _)) = u.pages.pop(&key) {
            u.bytes -= old.len() as u64;
        }
        None
    }

    /// Page `page` of `block`: from the cache, from a fetch in flight, or fetched now with
    /// the rest of its part.
    pub async fn page(
        self: &Arc<Self>,
        block: &Arc<BlockRef>,
        page: u64,
        cache: bool,
    ) -> Result<(Bytes, Source), FetchError> {
        let key = (block.key, page as u32);
        let started = std::time::Instant::now();
        for _ in 0..4 {
            if let Some(b) = self.cached_page(block, page) {
                return Ok((b, Source::Cache));
            }
            if let Some(b) = self.recent_uncached_page(block, page) {
                return Ok((b, Source::Cache));
            }
            let (ufs, _) = self.ufs(block).await?;
            let (part_pages, _) = self.geometry(&ufs);
            let last_page = (block.len - 1) / self.store.page_size();
            let part_end = ((page / part_pages + 1) * part_pages - 1).min(last_page);
            let runs = self.claim(block, page..=part_end, Some(page), cache);
            // Our own claim: subscribe before the fetch starts (it may finish at once).
            let own = runs
                .first()
                .filter(|r| r.0 == page)
                .and_then(|r| r.1.first())
                .map(|(_, tx)| tx.subscribe());
            self.spawn_runs(block, runs, cache, None);
            let rx = match own {
                Some(rx) => Some(rx),
                None => {
                    let rx = lock(&self.inflight).get(&key).map(|p| p.rx.clone());
                    if rx.is_some() {
                        // Another reader's fetch (or read-ahead) has this page in flight.
                        self.metrics.singleflight_waits.inc();
                    }
                    rx
                }
            };
            let Some(mut rx) = rx else {
                continue; // cached meanwhile (or just evicted again): look once more
            };
            let outcome = match rx.wait_for(Option::is_some).await {
                Ok(v) => v.clone(),
                Err(_) => None,
            };
            return match outcome {
                Some(Ok(b)) if b.len() as u64 != self.page_len(block, page) => {
                    // A fetch for other geometry (a node's descriptor) had this page in
                    // flight: once it has settled, the page is dropped (its length is not
                    // this block's) and fetched again.
                    self.cached_after_fetch(&key).await;
                    continue;
                }
                Some(Ok(b)) => {
                    self.metrics.miss_latency.record(started.elapsed());
                    Ok((b, Source::UnderStore))
                }
                // A node copy's fill had this page and found no peer with it: this reader
                // may read the store, so it claims the page itself.
                Some(Err(FetchError::NoPeer(_))) if !block.peers_only => continue,
                Some(Err(e)) => Err(e),
                None => Err(FetchError::Unavailable(
                    "the under-store fetch was abandoned".into(),
                )),
            };
        }
        Err(FetchError::Unavailable(format!(
            "page {page} of block {:?} was evicted as fast as it was fetched; the cache is too small for this load",
            block.key
        )))
    }

    /// Whether page `key` is cached once its fetch is done with it (a fetched page reaches
    /// its readers before it is written to the cache; it stays in flight until then).
    pub async fn cached_after_fetch(&self, key: &PageKey) -> bool {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if self.store.contains(key) {
                return true;
            }
            let Some(mut rx) = lock(&self.inflight).get(key).map(|p| p.rx.clone()) else {
                return self.store.contains(key);
            };
            // The fetch drops its sender once the page is cached (or refused by the cache).
            let settled = async { while rx.changed().await.is_ok() {} };
            if tokio::time::timeout_at(deadline, settled).await.is_err() {
                return self.store.contains(key);
            }
        }
    }

    /// Notes a read of `block` ending at byte `end` (block offset) and tells whether it
    /// continued the previous one (or starts the block): a sequential reader.
    pub fn sequential(&self, block: &BlockRef, offset: u64, end: u64) -> bool {
        let prev = self.read_ends.note_end(block.key, end);
        granary_common::sequential::continues(prev, offset, 0, true)
    }

    /// Keeps `part_concurrency` parts in flight after page `after` of `block` (read-ahead
    /// of a sequential reader), each through the same single-flight path as reads, so a
    /// reader arriving meanwhile joins the fetch. Bounded by [`PREFETCH_IN_FLIGHT`] across
    /// readers; pages cached or in flight cost nothing.
    pub fn read_ahead(self: &Arc<Self>, block: &Arc<BlockRef>, after: u64) {
        let ps = self.store.page_size();
        let last_page = (block.len - 1) / ps;
        if after >= last_page {
            return;
        }
        let me = self.clone();
        let block = block.clone();
        tokio::spawn(async move {
            let Ok((ufs, _)) = me.ufs(&block).await else {
                return; // the reader's own fetch reports the error
            };
            let (part_pages, parts) = me.geometry(&ufs);
            let end = last_page.min(after + part_pages * parts);
            let mut from = after + 1;
            while from <= end {
                let part_end = ((from / part_pages + 1) * part_pages - 1).min(end);
                let Ok(permit) = me.prefetch_slots.clone().try_acquire_owned() else {
                    return; // busy enough: readers fetch what they need
                };
                let runs = me.claim(&block, from..=part_end, None, true);
                let pages: usize = runs.iter().map(|r| r.1.len()).sum();
                me.metrics.prefetched_pages.inc_by(pages as u64);
                me.spawn_runs(&block, runs, true, Some(permit));
                from = part_end + 1;
            }
        });
    }

    /// Counts `n` bytes read from the under-store by `op`.
    fn count_read(&self, op: &crate::metrics::UfsOp, n: usize) {
        self.metrics.ufs_read_bytes.inc_by(n as u64);
        self.metrics.ufs.bytes.get_or_create(op).inc_by(n as u64);
    }

    /// Records an under-store error of mount `mount_id` and turns it into a [`FetchError`].
    fn classify(&self, mount_id: u64, path: &str, e: object_store::Error) -> FetchError {
        self.metrics.ufs_errors.inc();
        let (kind, err) = match e {
            object_store::Error::Precondition { source, .. } => {
                tracing::warn!(path, reason = %source, "under-store object changed; not served");
                ("changed", FetchError::Changed(format!("{path} ({source})")))
            }
            object_store::Error::NotFound { .. } => {
                ("not_found", FetchError::NotFound(path.to_string()))
            }
            e if granary_common::ufs::is_access_denied(&e) => {
                tracing::warn!(path, error = %e, "under-store refused access");
                ("denied", FetchError::PermissionDenied(path.to_string()))
            }
            e => {
                let message = format!("under-store read of {path} failed: {e}");
                tracing::warn!(error = %message, "under-store read failed");
                ("failed", FetchError::Unavailable(message))
            }
        };
        self.metrics.ufs.error(mount_id, "get", kind);
        err
    }
}

impl Run {
    /// Fetches the run's pages with one ranged GET (resumed at the byte where it stopped if
    /// the body breaks off or stalls), delivering each page as soon as its bytes are in.
    async fn fetch(mut self) {
        let f = self.fetcher.clone();
        self.copy_from_peers().await;
        if self.next >= self.slots.len() {
            return;
        }
        if self.block.peers_only {
            let page = self.first + self.next as u64;
            return self.fail_rest(&FetchError::NoPeer(format!(
                "page {page} of block {:?} (a node copy is filled from other workers only)",
                self.block.key
            )));
        }
        // A version without a fingerprint is not in the under-store (yet): a file written
        // async-through or must-cache, whose store path may still hold the object it
        // replaces. Only cached copies serve it; bytes fetched from the store would be
        // another version's, cached under this one's name for every reader.
        let Some(fingerprint) = self.block.desc.fingerprint.as_ref() else {
            return self.fail_rest(&FetchError::Unavailable(format!(
                "version {} of file {} is not in the under-store yet (no fingerprint): only cached copies serve it",
                self.block.desc.id.as_ref().map_or(0, |i| i.version),
                self.block.desc.id.as_ref().map_or(0, |i| i.inode),
            )));
        };
        let expect = Some(granary_common::ufs::Expected::from(fingerprint));
        let (ufs, loc) = match f.ufs(&self.block).await {
            Ok(x) => x,
            Err(e) => return self.fail_rest(&e),
        };
        let op = UfsMetrics::op(loc.mount_id, "get");
        let ps = f.store.page_size();
        let end = self
            .block
            .len
            .min((self.first + self.slots.len() as u64) * ps);
        // The page being assembled: kept across attempts, so no byte is asked for twice.
        let mut buf = BytesMut::with_capacity(self.page_len(self.next) as usize);
        let mut attempt = 0;
        while self.next < self.slots.len() {
            attempt += 1;
            let from = (self.first + self.next as u64) * ps + buf.len() as u64;
            f.metrics.ufs_requests.inc();
            f.metrics.ufs.requests.get_or_create(&op).inc();
            let started = Instant::now();
            let mark = (self.next, buf.len());
            let res = self
                .stream(&ufs, &loc, expect.as_ref(), from..end, &op, &mut buf)
                .await;
            f.metrics
                .ufs
                .seconds
                .get_or_create(&op)
                .observe(started.elapsed().as_secs_f64());
            let err = match res {
                Ok(()) => break,
                Err(e) => e,
            };
            if (self.next, buf.len()) != mark {
                attempt = 1; // it brought bytes: a new stall gets its own attempts
            }
            let retry = matches!(err, FetchError::Unavailable(_)) && attempt < PART_ATTEMPTS;
            if !retry {
                return self.fail_rest(&err);
            }
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
        }
        if self.next < self.slots.len() {
            let e = FetchError::Changed(format!(
                "{}: the under-store returned fewer bytes than the object's recorded size",
                loc.path
            ));
            self.fail_rest(&e);
        }
    }

    /// Adds `chunk` (the bytes after those in `buf`) to the page being assembled, delivering
    /// every page it completes (a whole page at the front of `chunk` goes out as it is).
    fn feed(&mut self, buf: &mut BytesMut, chunk: &mut Bytes) {
        while !chunk.is_empty() && self.next < self.slots.len() {
            let page_len = self.page_len(self.next) as usize;
            if buf.is_empty() && chunk.len() >= page_len {
                self.deliver(chunk.split_to(page_len));
                continue;
            }
            let want = page_len - buf.len();
            let take = want.min(chunk.len());
            buf.extend_from_slice(&chunk.split_to(take));
            if buf.len() == self.page_len(self.next) as usize {
                self.deliver(buf.split().freeze());
                if self.next < self.slots.len() {
                    buf.reserve(self.page_len(self.next) as usize);
                }
            }
        }
    }

    /// Copies what it can of the run from other workers that hold the block (after a
    /// membership change: its previous owner, a decommissioned worker), cached pages only,
    /// so the under-store is asked only for what no peer has. Best effort: any failure
    /// leaves the rest to the store.
    async fn copy_from_peers(&mut self) {
        let f = self.fetcher.clone();
        let Some(id) = self.block.desc.id else {
            return;
        };
        if f.worker_id == 0 {
            return; // not a registered worker (tests): no peers
        }
        if self.block.holders.is_none() && f.alone.load(Ordering::Relaxed) {
            return; // the only worker: nobody to ask (one round trip less per cold read)
        }
        let mut holders: Vec<pb::WorkerAddress> = match &self.block.holders {
            Some(known) => known.clone(),
            None => {
                let ask = f.master.block_locations(vec![id]);
                match tokio::time::timeout(LOCATIONS_TIMEOUT, ask).await {
                    Ok(Ok(locations)) => locations.into_iter().flat_map(|l| l.workers).collect(),
                    // The master is busy or away: the store serves this part.
                    _ if !self.block.peers_only => return,
                    _ => Vec::new(),
                }
            }
        };
        if self.block.peers_only {
            // The placement owner first: it has the canonical copy, and the master may not
            // have heard of it yet (it was filled since the owner's last heartbeat).
            if let Some(owner) = f.owner(&id).await {
                holders.retain(|w| w.worker_id != owner.worker_id);
                holders.insert(0, owner);
            }
        }
        let peers = holders.into_iter().filter(|w| w.worker_id != f.worker_id);
        let ps = f.store.page_size();
        let end = self
            .block
            .len
            .min((self.first + self.slots.len() as u64) * ps);
        for peer in peers {
            if self.next >= self.slots.len() {
                return;
            }
            let Some(mut client) = f.peer(&peer.address) else {
                continue;
            };
            let from = (self.first + self.next as u64) * ps;
            let mut req = tonic::Request::new(pb::ReadBlockRequest {
                block: Some(self.block.desc.clone()),
                offset: from,
                length: end - from,
                cache: false,
                cached_only: true,
                grant: None, // a node needs none
                from_peers: false,
            });
            req.set_timeout(PEER_TIMEOUT);
            let copy = async {
                let mut body = client.read_block(req).await?.into_inner();
                let mut buf = BytesMut::new();
                let mut at = from;
                while let Some(msg) = body.message().await? {
                    if msg.offset != at {
                        break; // not what was asked for: the store serves the rest
                    }
                    at += msg.data.len() as u64;
                    f.metrics.peer_fill_bytes.inc_by(msg.data.len() as u64);
                    let mut chunk = msg.data;
                    self.feed(&mut buf, &mut chunk);
                }
                Ok::<(), tonic::Status>(())
            };
            if let Ok(Err(e)) = tokio::time::timeout(PEER_TIMEOUT, copy).await {
                if e.code() != tonic::Code::NotFound {
                    tracing::debug!(peer = peer.worker_id, error = %e, "filling from a peer failed");
                }
            }
        }
    }

    /// The rest of a ranged GET answered by a local file (a folder under-store), starting at
    /// object offset `at`: read a page at a time, each in one blocking step straight into
    /// the page's buffer (`object_store` would stream it in 8 KiB chunks, a thread hand-off
    /// and a copy each). A read that hangs (a stuck network file system) fails the part as
    /// stalled after [`UFS_TIMEOUT`]; the blocking thread is left to finish.
    async fn read_file(
        &mut self,
        file: std::fs::File,
        mut at: u64,
        loc: &pb::UfsLocation,
        op: &crate::metrics::UfsOp,
        buf: &mut BytesMut,
    ) -> Result<(), FetchError> {
        let f = self.fetcher.clone();
        let file = Arc::new(file);
        while self.next < self.slots.len() {
            let want = self.page_len(self.next) - buf.len() as u64;
            let read = {
                let file = file.clone();
                tokio::task::spawn_blocking(move || read_at_most(&file, at, want))
            };
            let failed = |e: String| {
                let e = object_store::Error::Generic {
                    store: "LocalFileSystem",
                    source: e.into(),
                };
                f.classify(loc.mount_id, &loc.path, e)
            };
            let data = match tokio::time::timeout(UFS_TIMEOUT, read).await {
                Ok(Ok(Ok(data))) => data,
                Ok(Ok(Err(e))) => return Err(failed(e.to_string())),
                Ok(Err(e)) => return Err(failed(e.to_string())),
                Err(_) => return Err(stalled(&f, loc)),
            };
            if data.is_empty() {
                return Ok(()); // shorter than recorded: the caller reports it
            }
            at += data.len() as u64;
            f.count_read(op, data.len());
            self.feed(buf, &mut Bytes::from(data));
        }
        Ok(())
    }

    /// The rest of the run from a local folder store, object bytes `at..end`: each step on
    /// a blocking thread reads one page straight into its buffer (the first step also
    /// opens and checks the file: the links policy, the version `expect` names), hands it
    /// to its readers and writes it into the cache, so a cold small file costs one thread
    /// hand-off, not one for the check, the open, the read and the cache write each. A
    /// step that hangs (a stuck network file system) fails the part as stalled after
    /// [`UFS_TIMEOUT`]; the blocking thread is left to finish.
    #[allow(clippy::too_many_arguments)]
    async fn read_local(
        &mut self,
        local: &granary_common::ufs::ConfinedLocal,
        path: object_store::path::Path,
        expect: Option<&granary_common::ufs::Expected>,
        mut at: u64,
        end: u64,
        loc: &pb::UfsLocation,
        op: &crate::metrics::UfsOp,
        buf: &mut BytesMut,
    ) -> Result<(), FetchError> {
        let f = self.fetcher.clone();
        let mut file: Option<Arc<std::fs::File>> = None;
        while self.next < self.slots.len() && at < end {
            let page_len = self.page_len(self.next);
            let want = (page_len - buf.len() as u64).min(end - at);
            // A page the step completes goes out from the blocking thread itself: its
            // readers first, then the cache.
            let whole = buf.is_empty() && want == page_len;
            // Shared with the step: whichever comes first takes it (the step to deliver the
            // page, the run to fail it when the step has hung past the deadline).
            let out = whole.then(|| Arc::new(Mutex::new(Some(self.take_next()))));
            let take = |out: &Option<Arc<Mutex<Option<Delivery>>>>| {
                out.as_ref().and_then(|o| lock(o).take())
            };
            let step = {
                let (local, path) = (local.clone(), path.clone());
                let expect = expect.cloned();
                let file = file.clone();
                let (f, op) = (f.clone(), op.clone());
                let out = out.clone();
                tokio::task::spawn_blocking(move || {
                    // A failed step leaves the slot to the run, so its readers get this
                    // error.
                    let file = match file {
                        Some(file) => file,
                        None => match open_checked(&local, &path, expect.as_ref()) {
                            Ok(file) => Arc::new(file),
                            Err(e) => return Err(Box::new(e)),
                        },
                    };
                    let data = match read_at_most(&file, at, want) {
                        Ok(data) => data,
                        Err(e) => {
                            let e = object_store::Error::Generic {
                                store: "LocalFileSystem",
                                source: e.into(),
                            };
                            return Err(Box::new(e));
                        }
                    };
                    // Counted before its readers have it (a reader may look next).
                    f.count_read(&op, data.len());
                    let data = match take(&out) {
                        Some(d) if data.len() as u64 == want => {
                            d.deliver(Bytes::from(data));
                            None
                        }
                        // Short (the file shrank): the slot goes back to the run, which
                        // reports it. (None: the run has given up on this step already.)
                        d => Some((Bytes::from(data), d)),
                    };
                    Ok((file, data))
                })
            };
            let (opened, data) = match tokio::time::timeout(UFS_TIMEOUT, step).await {
                Ok(Ok(Ok(x))) => x,
                Ok(Ok(Err(e))) => {
                    if let Some(slot) = take(&out) {
                        self.put_back(slot);
                    }
                    return Err(f.classify(loc.mount_id, &loc.path, *e));
                }
                Ok(Err(e)) => {
                    let e = object_store::Error::Generic {
                        store: "LocalFileSystem",
                        source: e.to_string().into(),
                    };
                    return Err(f.classify(loc.mount_id, &loc.path, e));
                }
                Err(_) => {
                    // The step hangs (a stuck network file system): its page's readers
                    // are failed now, not whenever the blocking thread returns, and the
                    // page may be fetched again.
                    if let Some(slot) = take(&out) {
                        self.put_back(slot);
                    }
                    return Err(stalled(&f, loc));
                }
            };
            file = Some(opened);
            match data {
                None => at += want,
                Some((data, slot)) => {
                    if let Some(slot) = slot {
                        self.put_back(slot);
                    }
                    if data.is_empty() {
                        return Ok(()); // shorter than recorded: the caller reports it
                    }
                    at += data.len() as u64;
                    self.feed(buf, &mut data.clone());
                }
            }
        }
        Ok(())
    }

    /// One ranged GET of `range` (block offsets), feeding the pages it completes as the
    /// body arrives (the partial page in `buf` goes on from where it is). Fails as
    /// unavailable when the store sends nothing for [`UFS_TIMEOUT`].
    async fn stream(
        &mut self,
        ufs: &Ufs,
        loc: &pb::UfsLocation,
        expect: Option<&granary_common::ufs::Expected>,
        range: std::ops::Range<u64>,
        op: &crate::metrics::UfsOp,
        buf: &mut BytesMut,
    ) -> Result<(), FetchError> {
        let f = self.fetcher.clone();
        let base = self.block.start;
        if let Some(local) = &ufs.local {
            let path = ufs.path_of(&loc.path);
            let at = base + range.start;
            return self
                .read_local(local, path, expect, at, base + range.end, loc, op, buf)
                .await;
        }
        let stalled = || stalled(&f, loc);
        let answer = ufs.get_range(&loc.path, expect, base + range.start..base + range.end);
        let answer = tokio::time::timeout(UFS_TIMEOUT, answer)
            .await
            .map_err(|_| stalled())?
            .map_err(|e| f.classify(loc.mount_id, &loc.path, e))?;
        let answer = match answer.payload {
            object_store::GetResultPayload::File(file, _) => {
                return self.read_file(file, answer.range.start, loc, op, buf).await;
            }
            payload => object_store::GetResult { payload, ..answer },
        };
        let mut body = answer.into_stream();
        loop {
            let chunk = match tokio::time::timeout(UFS_TIMEOUT, body.next()).await {
                Ok(Some(chunk)) => chunk,
                Ok(None) => return Ok(()),
                Err(_) => return Err(stalled()),
            };
            let mut chunk = chunk.map_err(|e| f.classify(loc.mount_id, &loc.path, e))?;
            f.count_read(op, chunk.len());
            self.feed(buf, &mut chunk);
        }
    }
}

/// Opens `path` of a local folder store in place ([`ConfinedLocal::open_blocking`]) and
/// checks that it is still the version `expect` names (as a ranged GET's answer is).
///
/// [`ConfinedLocal::open_blocking`]: granary_common::ufs::ConfinedLocal::open_blocking
fn open_checked(
    local: &granary_common::ufs::ConfinedLocal,
    path: &object_store::path::Path,
    expect: Option<&granary_common::ufs::Expected>,
) -> Result<std::fs::File, object_store::Error> {
    let (file, meta) = local.open_blocking(path)?;
    if let Some(want) = expect {
        want.check(&meta)?;
    }
    Ok(file)
}

/// Counts a stalled under-store read and says so.
fn stalled(f: &Fetcher, loc: &pb::UfsLocation) -> FetchError {
    f.metrics.ufs_errors.inc();
    f.metrics.ufs.error(loc.mount_id, "get", "timeout");
    FetchError::Unavailable(format!(
        "under-store read of {} sent nothing for {UFS_TIMEOUT:?}",
        loc.path
    ))
}

/// Up to `len` bytes of `file` from offset `at` (fewer only at its end), read into a
/// buffer of exactly that capacity without zeroing it first.
fn read_at_most(file: &std::fs::File, at: u64, len: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = file;
    file.seek(SeekFrom::Start(at))?;
    let mut data = Vec::with_capacity(len as usize);
    file.take(len).read_to_end(&mut data)?;
    Ok(data)
}

#[cfg(test)]
mod tests;
