//! The FileSystem API used by the FUSE mount and the CLI: metadata from the master, data from
//! workers (the block's rendezvous owner first), and straight from the under-store when no
//! worker can serve.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use granary_common::net::GrpcChannel as Channel;
use granary_common::sequential::{continues, ReadEnds};
use granary_proto as pb;
use granary_proto::worker_service_client::WorkerServiceClient;

use crate::error::ClientError;
use crate::local::{LocalLease, Miss, ShortCircuit, LEASE_TIMEOUT};
use crate::master::MasterClient;
use crate::metrics::ClientMetrics;
use crate::mounts::MountStores;
use crate::placement::order_workers;

mod grants;
mod leases;
pub mod meta;
mod passthrough;
mod routing;

pub(crate) use leases::WARM_LEASE_GROUP;
pub use passthrough::PassthroughFile;

/// How long the list of live workers is reused before asking the master again.
const WORKERS_TTL: Duration = Duration::from_secs(2);
/// How long a worker that failed a read is tried last.
const SUSPECT_FOR: Duration = Duration::from_secs(10);
/// Deadline of one block read from a worker.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Default)]
struct WorkerView {
    fetched: Option<Instant>,
    workers: Vec<pb::WorkerInfo>,
    suspects: HashMap<u64, Instant>,
    /// Reads in flight per worker (a bounded pool: more reads wait for a slot).
    slots: HashMap<String, Arc<tokio::sync::Semaphore>>,
}

/// Reads one client keeps in flight to one worker; more wait (within their deadline).
pub const MAX_READS_PER_WORKER: usize = 64;

/// Counters of where read bytes came from (for tests and `report`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReadStats {
    pub worker_bytes: u64,
    pub short_circuit_bytes: u64,
    pub direct_ufs_bytes: u64,
    pub worker_failures: u64,
}

/// How often bytes read by short-circuit are reported to their workers.
const SHORT_CIRCUIT_REPORT_EVERY: Duration = Duration::from_secs(2);

pub struct FileSystem {
    pub master: MasterClient,
    /// Which workers serve a block, and the transports that read it from them (see
    /// [`routing`]).
    routes: routing::Routes,
    ufs: MountStores,
    pub metrics: ClientMetrics,
    pub short_circuit: ShortCircuit,
    /// Files open in passthrough mode and their leases (see [`passthrough`]).
    passthrough: passthrough::Handles,
    /// Sequential readers: by inode, the end of its last read and the next block already
    /// warmed.
    sequential: ReadEnds<u64, u64>,
    /// Statuses seen lately, their names and the namespace watch (see [`meta`]).
    pub meta: meta::MetaCache,
    /// Short-circuit leases taken ahead of readers (see [`leases`]).
    ahead: leases::Ahead,
    /// The newest read grant seen for each version of each file, by (inode, version) (TLS
    /// clusters: workers serve a file's blocks only with one, for the version it names;
    /// see `granary_common::grant`).
    grants: grants::Grants,
    /// Folders whose next listing page is being fetched ahead of lookups.
    listing_ahead: Mutex<std::collections::HashSet<u64>>,
    /// Folders read at random while uncached, warmed ahead of their readers (see
    /// [`crate::warm`]).
    pub(crate) warmer: crate::warm::Warmer,
    /// Node copies of blocks other nodes' workers own (see [`crate::nodecopy`]).
    pub(crate) node_copier: crate::nodecopy::NodeCopier,
}

/// Entries a lookup that had to ask the master fetches ahead (the listing page after it).
const LOOKUP_AHEAD: u32 = 1000;

/// A worker refused a fresh grant: it may not have the new leader's key yet (it gets it
/// with its next heartbeat), so the read is tried once more after this pause.
const GRANT_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// How long the opens of small files in a folder ask for no lease after one found its file
/// not cached (see [`FileSystem::open_lease_paused`]).
const OPEN_LEASE_PAUSE: Duration = Duration::from_secs(1);

/// Files after the one being read whose block files are leased with it.
const LEASE_AHEAD_FILES: usize = 32;
/// Reads this large or larger lease the next window ahead (the kernel's read-ahead sends
/// sequential readers' reads at 128 KiB and more; small random reads lease nothing ahead).
const LEASE_NEXT_MIN_READ: u64 = 128 * 1024;
/// How far from where the last leased read ended a read still counts as sequential (the
/// kernel's read-ahead requests arrive slightly out of order, from several threads).
const LEASE_NEXT_SLACK: u64 = 8 << 20;
/// Lease requests ahead of sequential readers in flight at once.
const MAX_WINDOWS_AHEAD: usize = 256;

/// Files whose read position is remembered for sequential detection.
const SEQUENTIAL_TRACKED: usize = 4096;

/// A file's block size (0 in its status: the default).
pub(crate) fn block_size(file: &pb::FileStatus) -> u64 {
    if file.block_size == 0 {
        granary_common::DEFAULT_BLOCK_SIZE
    } else {
        file.block_size
    }
}

/// The bytes `[offset, end)` of a file as (block index, offset in the block, length) pieces.
fn block_ranges(offset: u64, end: u64, bs: u64) -> impl Iterator<Item = (u64, u64, u64)> {
    let mut pos = offset;
    std::iter::from_fn(move || {
        (pos < end).then(|| {
            let index = pos / bs;
            let in_block = pos - index * bs;
            let n = (bs - in_block).min(end - pos);
            pos += n;
            (index, in_block, n)
        })
    })
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl FileSystem {
    pub fn new(master: MasterClient) -> Arc<Self> {
        let net = master.net().clone();
        let fs = Arc::new(Self {
            master,
            routes: routing::Routes::new(&net),
            ufs: MountStores::default(),
            metrics: ClientMetrics::default(),
            short_circuit: ShortCircuit::new(granary_common::node_name()),
            passthrough: passthrough::Handles::default(),
            sequential: ReadEnds::default(),
            meta: meta::MetaCache::default(),
            ahead: leases::Ahead::default(),
            grants: grants::Grants::default(),
            listing_ahead: Mutex::new(std::collections::HashSet::new()),
            warmer: crate::warm::Warmer::new(crate::warm::DEFAULT_WARM_FOLDER_BYTES),
            node_copier: crate::nodecopy::NodeCopier::default(),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&fs);
            rt.spawn(async move {
                let mut swept = Instant::now();
                loop {
                    tokio::time::sleep(SHORT_CIRCUIT_REPORT_EVERY).await;
                    let Some(fs) = weak.upgrade() else { break };
                    fs.report_short_circuit().await;
                    fs.renew_passthrough().await;
                    if swept.elapsed() >= crate::local::KEPT_SWEEP_EVERY {
                        swept = Instant::now();
                        let me = fs.clone();
                        let _ = tokio::task::spawn_blocking(move || me.short_circuit.sweep_kept())
                            .await;
                    }
                }
            });
        }
        fs
    }

    /// Bytes warmed ahead of random readers per folder at most (0: no folder warming; see
    /// [`crate::warm`]).
    pub fn set_warm_folder_bytes(&self, n: u64) {
        self.warmer.set_max_bytes(n);
    }

    /// The deadline of one read from one worker or from the under-store (default 60 s).
    pub fn set_read_timeout(&self, d: Duration) {
        self.routes.read_timeout_ms.store(
            d.as_millis().max(1) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    pub fn read_timeout(&self) -> Duration {
        Duration::from_millis(
            self.routes
                .read_timeout_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Turns reads over workers' block data planes on or off (default on: used where a
    /// worker offers one and the cluster has no TLS).
    pub fn set_data_plane(&self, enabled: bool) {
        self.routes.data_plane_on.store(enabled, Ordering::Relaxed);
    }

    /// Turns short-circuit reads of same-host workers' block files on or off (default on).
    pub fn set_short_circuit(&self, enabled: bool) {
        self.short_circuit
            .enabled
            .store(enabled, std::sync::atomic::Ordering::Relaxed);
    }

    /// A client of the masters at `master_addr`, reaching them and the workers over `net`.
    pub fn connect(
        net: granary_common::net::Net,
        master_addr: &str,
    ) -> Result<Arc<Self>, ClientError> {
        Ok(Self::new(MasterClient::new(net, master_addr)?))
    }

    pub fn read_stats(&self) -> ReadStats {
        ReadStats {
            worker_bytes: self.metrics.read("worker"),
            short_circuit_bytes: self.metrics.read("short_circuit"),
            direct_ufs_bytes: self.metrics.read("under_store"),
            worker_failures: self.metrics.worker_failures.get(),
        }
    }

    /// Lets an open use a status the client saw less than `ttl` ago (a lookup, a listing)
    /// instead of asking the master again — the same staleness the kernel's attribute
    /// cache already allows. Files of `validate_on_open` mounts are always asked for.
    pub fn set_status_ttl(&self, ttl: Duration) {
        self.meta.set_ttl(ttl);
    }

    /// Keeps a status the master sent in answer to a request sent at `since` (and the
    /// grant it carries).
    pub(crate) fn remember(&self, s: &pb::FileStatus, since: crate::watch::Since) {
        self.note_grant(s);
        self.meta.remember(s, since);
    }

    /// Forgets what the client saw of `inode` (it changed through this client).
    pub fn forget_status(&self, inode: u64) {
        self.meta.forget(inode);
    }

    pub async fn stat(&self, path: &str) -> Result<pb::FileStatus, ClientError> {
        let s = self
            .master
            .get_status(pb::path_or_id::Target::Path(path.to_string()))
            .await?;
        self.note_grant(&s);
        Ok(s)
    }

    /// Keeps the grant a status carries when it is the newest seen for its file.
    pub(crate) fn note_grant(&self, s: &pb::FileStatus) {
        self.grants.note(s);
    }

    /// The grant to show workers for `file` (`None` on a plaintext cluster): the newest
    /// held, or — when it ends within the refresh margin, or `renew` — a new one from the
    /// master.
    pub(crate) async fn grant_for(
        &self,
        file: &pb::FileStatus,
        renew: bool,
    ) -> Result<Option<pb::ReadGrant>, ClientError> {
        if self.master.net().tls().is_none() {
            return Ok(None);
        }
        self.note_grant(file);
        let now = granary_common::now_ms().max(0) as u64;
        if let Some(g) = self
            .grants
            .fresh(file.inode, file.version, now)
            .filter(|_| !renew)
        {
            return Ok(Some(g));
        }
        let s = self
            .master
            .get_status(pb::path_or_id::Target::Inode(file.inode))
            .await?;
        self.note_grant(&s);
        // Only a grant for the version read (a file replaced meanwhile: the old version's
        // grant while it lasts).
        Ok(self.grants.get(file.inode, file.version))
    }

    /// The unexpired grants held for these files' versions (sent with lease requests).
    fn held_grants(&self, files: impl IntoIterator<Item = (u64, u64)>) -> Vec<pb::ReadGrant> {
        self.grants.held(files)
    }

    /// The status an open may use without asking the master (seen within the status TTL;
    /// never for validate-on-open mounts).
    pub fn cached_open_status(&self, inode: u64) -> Option<pb::FileStatus> {
        self.meta.open_status(inode)
    }

    /// A folder's status when the namespace watch vouches for it (any change of its
    /// entries is announced, which drops it): a `stat` of a folder may use it. Without
    /// the watch a folder is always asked for (its entries may have just changed).
    pub fn watched_dir_status(&self, inode: u64) -> Option<pb::FileStatus> {
        self.meta.watched_dir(inode)
    }

    /// The entry after `inode` in its folder's name order, as the last listing page that
    /// held both gave it.
    pub fn next_in_folder(&self, inode: u64) -> Option<u64> {
        self.meta.next_in_folder(inode)
    }

    /// Up to `n` entries after `inode` in its folder's name order whose statuses are fresh
    /// enough for an open to use them ([`cached_open_status`](Self::cached_open_status)),
    /// stopping at the first that is not: the files a reader going through the folder in
    /// name order opens next, with the versions those opens will see.
    pub fn fresh_entries_after(&self, inode: u64, n: usize) -> Vec<pb::FileStatus> {
        let mut out = Vec::with_capacity(n);
        let mut cur = inode;
        while out.len() < n {
            let Some(next) = self.next_in_folder(cur) else {
                break;
            };
            let Some(s) = self.meta.open_status(next) else {
                break;
            };
            out.push(s);
            cur = next;
        }
        out
    }

    /// The status of a file being opened (validate-on-open mounts check the object first).
    /// A file of a folder listed before whose status has grown stale (the kernel kept its
    /// name longer than the attribute timeout) also fetches the listing page after it in
    /// the background, as lookups do: a reader going through the folder in name order then
    /// opens the next files from fresh statuses instead of asking the master for each.
    pub async fn open_inode(self: &Arc<Self>, inode: u64) -> Result<pb::FileStatus, ClientError> {
        if let Some(s) = self.meta.open_status(inode) {
            return Ok(s);
        }
        let since = self.meta.watch.since();
        let s = self
            .master
            .get_status_opts(pb::path_or_id::Target::Inode(inode), true)
            .await?;
        self.remember(&s, since);
        let listed = self.meta.knows_name(s.parent, &s.name);
        if listed && !s.validate_on_open {
            self.list_ahead(s.parent, &s.name);
        }
        Ok(s)
    }

    pub async fn stat_inode(&self, inode: u64) -> Result<pb::FileStatus, ClientError> {
        let since = self.meta.watch.since();
        let s = self
            .master
            .get_status(pb::path_or_id::Target::Inode(inode))
            .await?;
        self.remember(&s, since);
        Ok(s)
    }

    pub async fn lookup(&self, parent: u64, name: &str) -> Result<pb::FileStatus, ClientError> {
        let since = self.meta.watch.since();
        let s = self.master.lookup(parent, name).await?;
        self.remember(&s, since);
        self.meta.remember_name(&s);
        Ok(s)
    }

    /// A lookup answered from a listing fetched within the status TTL, if it holds the
    /// name (cheap: no await, callable from a FUSE thread). The staleness is the attribute
    /// timeout's, as for opens.
    pub fn lookup_fresh(&self, parent: u64, name: &str) -> Option<pb::FileStatus> {
        self.meta.lookup(parent, name)
    }

    /// A lookup for the kernel (FUSE): answered from a fresh listing when it holds the name
    /// ([`Self::lookup_fresh`]); else asked of the master, and the listing page after the
    /// name is fetched in the background, so a reader going through a folder in name order
    /// costs one listing per page instead of one round trip per name.
    pub async fn lookup_cached(
        self: &Arc<Self>,
        parent: u64,
        name: &str,
    ) -> Result<pb::FileStatus, ClientError> {
        if let Some(s) = self.lookup_fresh(parent, name) {
            return Ok(s);
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            let (inode, entry) = self.meta.describe(parent, name);
            tracing::debug!(
                parent,
                name,
                ?inode,
                ?entry,
                live = self.meta.watch.live(),
                epoch = self.meta.watch.epoch(),
                "lookup asks the master"
            );
        }
        let s = self.lookup(parent, name).await?;
        if self.meta.ttl() > 0 {
            self.list_ahead(parent, name);
        }
        Ok(s)
    }

    /// Fetches the listing page of `parent` after `after` in the background (one at a time
    /// per folder).
    fn list_ahead(self: &Arc<Self>, parent: u64, after: &str) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !lock(&self.listing_ahead).insert(parent) {
            return;
        }
        let me = self.clone();
        let after = after.to_string();
        rt.spawn(async move {
            let target = pb::path_or_id::Target::Inode(parent);
            match me.list_page(target, &after, LOOKUP_AHEAD).await {
                Ok((entries, _)) => {
                    tracing::debug!(parent, after, entries = entries.len(), "listed ahead")
                }
                Err(e) => tracing::debug!(parent, error = %e, "listing ahead of lookups failed"),
            }
            lock(&me.listing_ahead).remove(&parent);
        });
    }

    /// One page of a directory listing, in name order after `after`. The statuses are
    /// shared with the metadata cache, which keeps them for lookups and opens.
    pub async fn list_page(
        &self,
        target: pb::path_or_id::Target,
        after: &str,
        page_size: u32,
    ) -> Result<(Vec<Arc<pb::FileStatus>>, String), ClientError> {
        let since = self.meta.watch.since();
        let r = self
            .master
            .list_page(target, after.to_string(), page_size, false)
            .await?;
        for e in &r.entries {
            self.note_grant(e);
        }
        let entries: Vec<Arc<pb::FileStatus>> = r.entries.into_iter().map(Arc::new).collect();
        self.meta.remember_page(&entries, since);
        Ok((entries, r.next_page_token))
    }

    /// The whole listing of a directory (all pages).
    pub async fn list(
        &self,
        target: pb::path_or_id::Target,
    ) -> Result<Vec<pb::FileStatus>, ClientError> {
        self.list_with(target, false).await
    }

    /// The whole listing; `stale` reads the first configured master's own applied state
    /// instead of the leader's (diagnostics: compare replicas).
    pub async fn list_with(
        &self,
        target: pb::path_or_id::Target,
        stale: bool,
    ) -> Result<Vec<pb::FileStatus>, ClientError> {
        let mut out = Vec::new();
        let mut token = String::new();
        loop {
            let r = self
                .master
                .list_page(target.clone(), token.clone(), 0, stale)
                .await?;
            let (mut entries, next) = (r.entries, r.next_page_token);
            out.append(&mut entries);
            if next.is_empty() {
                return Ok(out);
            }
            token = next;
        }
    }

    /// Reads up to `len` bytes at `offset` of a file (short only at end of file).
    pub async fn read(
        self: &Arc<Self>,
        file: &pb::FileStatus,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, ClientError> {
        if file.kind != pb::FileKind::File as i32 {
            return Err(ClientError::invalid(format!("{} is not a file", file.path)));
        }
        if offset >= file.length || len == 0 {
            return Ok(Bytes::new());
        }
        let end = file.length.min(offset.saturating_add(len));
        let bs = block_size(file);
        self.warm_next_block(file, offset, end, bs);
        let mut parts: Vec<Bytes> = Vec::new();
        for (index, in_block, n) in block_ranges(offset, end, bs) {
            let data = self
                .read_block_range(file, index, index * bs, in_block, n)
                .await?;
            if index == 0 {
                self.keep_small_file(file);
            }
            if data.len() as u64 != n {
                return Err(ClientError::internal(format!(
                    "short read of {} at {}: wanted {n} bytes, got {}",
                    file.path,
                    index * bs + in_block,
                    data.len()
                )));
            }
            parts.push(data);
        }
        Ok(crate::transport::join(parts, end - offset))
    }

    /// Remembers `file` as its folder's last read when it is a small file (one block, one
    /// lease window); false when it is not.
    fn note_small_read(&self, file: &pb::FileStatus) -> bool {
        let small = self.short_circuit_page_size() * u64::from(crate::local::LEASE_WINDOW_PAGES);
        if file.length == 0 || file.length > small || file.length > block_size(file) {
            return false;
        }
        let mut m = lock(&self.ahead.last_read_in_dir);
        if m.len() >= SEQUENTIAL_TRACKED && !m.contains_key(&file.parent) {
            m.clear();
        }
        m.insert(file.parent, file.inode);
        true
    }

    fn note_open_lease_miss(&self, file: &pb::FileStatus) {
        if file.length > self.short_circuit_page_size() {
            return;
        }
        let mut m = lock(&self.ahead.open_lease_misses);
        if m.len() >= SEQUENTIAL_TRACKED && !m.contains_key(&file.parent) {
            m.retain(|_, t| t.elapsed() < OPEN_LEASE_PAUSE);
            if m.len() >= SEQUENTIAL_TRACKED {
                m.clear();
            }
        }
        m.insert(file.parent, Instant::now());
    }

    /// Whether small files opened in folder `parent` ask for no lease at their open for
    /// now: one there found its file not cached within the last [`OPEN_LEASE_PAUSE`], and
    /// no read there found one cached since (a cold epoch reads each file through the
    /// daemon, which fetches and caches it; a lease request per open would only hear "not
    /// cached" again).
    pub fn open_lease_paused(&self, parent: u64) -> bool {
        lock(&self.ahead.open_lease_misses)
            .get(&parent)
            .is_some_and(|t| t.elapsed() < OPEN_LEASE_PAUSE)
    }

    /// A small file is being opened: is it the one after its folder's last read in name
    /// order (see [`in_name_order`](Self::in_name_order))? It becomes the folder's last
    /// read either way.
    pub fn small_open_in_name_order(&self, file: &pb::FileStatus) -> bool {
        let next = self.in_name_order(file.inode);
        self.note_small_read(file);
        next
    }

    /// Is `inode` read right after the file listed before it in its folder (a reader going
    /// through the folder in name order)? Only then are the files after it leased ahead:
    /// a shuffled loader reads a file's neighbours at random times, and leases taken for
    /// them ran out before use and filled the worker's leased share.
    fn in_name_order(&self, inode: u64) -> bool {
        let Some(parent) = lock(&self.meta.recent).get(&inode).map(|e| e.status.parent) else {
            return false;
        };
        let Some(last) = lock(&self.ahead.last_read_in_dir).get(&parent).copied() else {
            return false;
        };
        last == inode || lock(&self.meta.next_in_dir).get(&last) == Some(&inode)
    }

    /// A small file was read: remembered as its folder's last read (see
    /// [`in_name_order`](Self::in_name_order)); when it was read under a lease, its block
    /// file stays open for later reads (see `ShortCircuit::keep_if_whole`).
    fn keep_small_file(&self, file: &pb::FileStatus) {
        if !self.note_small_read(file) {
            return;
        }
        // Its folder's files are cached now (the epoch after a cold one): opens there take
        // their leases again.
        lock(&self.ahead.open_lease_misses).remove(&file.parent);
        let id = pb::BlockId {
            inode: file.inode,
            version: file.version,
            index: 0,
        };
        self.short_circuit.keep_if_whole(&id, file.length);
    }

    /// Reads a range only from short-circuit leases already held (no network, no lease
    /// request; blocking file I/O): the FUSE mount's fast path for warm data on this node.
    /// `None` when any part of the range is not covered — then use [`read`](Self::read).
    pub fn read_leased(
        self: &Arc<Self>,
        file: &pb::FileStatus,
        offset: u64,
        len: u64,
    ) -> Option<Bytes> {
        if file.kind != pb::FileKind::File as i32 || offset >= file.length || len == 0 {
            return None;
        }
        let end = file.length.min(offset.saturating_add(len));
        let bs = block_size(file);
        let mut parts: Vec<Bytes> = Vec::new();
        let mut reads = Vec::new();
        let mut from_kept = false;
        let span = self.short_circuit_page_size() * u64::from(crate::local::LEASE_WINDOW_PAGES);
        for (index, in_block, n) in block_ranges(offset, end, bs) {
            let id = pb::BlockId {
                inode: file.inode,
                version: file.version,
                index: u32::try_from(index).ok()?,
            };
            // One lease window at a time.
            let mut pos = in_block;
            while pos < in_block + n {
                let k = (span - pos % span).min(in_block + n - pos);
                let data = match self
                    .short_circuit
                    .lease(&id, self.short_circuit.window_of(pos))
                {
                    Some(lease) => {
                        let data = lease.read(pos, k).ok()?;
                        reads.push((lease.worker_id, data.len() as u64));
                        if index == 0 {
                            self.keep_small_file(file);
                        }
                        data
                    }
                    // A small file read before: its block file may still be open here.
                    None => {
                        let kept = self.short_circuit.kept(&id)?;
                        match kept.read_kept(pos, k) {
                            Ok(data) => {
                                from_kept = true;
                                self.note_small_read(file);
                                self.metrics.kept_reads.inc();
                                reads.push((kept.worker_id, data.len() as u64));
                                data
                            }
                            Err(miss) => {
                                tracing::debug!(
                                    inode = file.inode,
                                    ?miss,
                                    "a kept block file failed a read; let go"
                                );
                                self.short_circuit.drop_kept(&id);
                                return None;
                            }
                        }
                    }
                };
                parts.push(data);
                pos += k;
            }
        }
        // A file kept open: its neighbours were most likely read (and kept) too.
        if let ([(worker, _)], false) = (&reads[..], from_kept) {
            let worker = *worker;
            if offset == 0 {
                self.lease_further_ahead(file, worker);
            }
        }
        if let Some(&(worker, _)) = reads.last() {
            let prev = self.ahead.leased_ends.note_end(file.inode, end);
            let sequential = continues(prev, offset, LEASE_NEXT_SLACK, false);
            if sequential {
                self.lease_next_window(file, end, len, worker);
            }
        }
        for (worker, n) in reads {
            self.short_circuit.count_read(worker, n);
            self.metrics.add_read("short_circuit", n);
        }
        Some(crate::transport::join(parts, end - offset))
    }

    /// Reads a whole file of one block only from a worker on this node (short-circuit),
    /// taking a lease when none is held — which leases the small files listed after it too.
    /// Never reads over the network: `None` when no worker on this node caches the file.
    pub async fn read_local_file(self: &Arc<Self>, file: &pb::FileStatus) -> Option<Bytes> {
        if file.kind != pb::FileKind::File as i32
            || file.length == 0
            || file.length > block_size(file)
        {
            return None;
        }
        let id = pb::BlockId {
            inode: file.inode,
            version: file.version,
            index: 0,
        };
        for w in order_workers(&id, &self.live_workers().await) {
            if !self.short_circuit.applies_to(&w) {
                continue;
            }
            if let Some(data) = self.read_local(&w, &id, 0, file.length).await {
                self.metrics.add_read("short_circuit", data.len() as u64);
                return Some(data);
            }
        }
        None
    }

    /// Whether byte `offset` of `file` is under a short-circuit lease held now (a read of
    /// it takes the FUSE mount's fast path: fetching it ahead would read it twice).
    pub fn leased(&self, file: &pb::FileStatus, offset: u64) -> bool {
        let bs = block_size(file);
        let Ok(index) = u32::try_from(offset / bs) else {
            return false;
        };
        let id = pb::BlockId {
            inode: file.inode,
            version: file.version,
            index,
        };
        self.short_circuit
            .lease(&id, self.short_circuit.window_of(offset % bs))
            .is_some()
    }

    /// A file opened for reading was closed: the leases on its block files are given back,
    /// so files read once do not keep the worker's leased share full until their leases
    /// expire.
    pub fn closed(&self, file: &pb::FileStatus) {
        let small = self.short_circuit_page_size() * u64::from(crate::local::LEASE_WINDOW_PAGES);
        if file.kind != pb::FileKind::File as i32 || file.length == 0 {
            return;
        }
        if file.length <= small && file.length <= block_size(file) {
            let id = pb::BlockId {
                inode: file.inode,
                version: file.version,
                index: 0,
            };
            self.short_circuit.keep_open(&id, file.length);
        } else if file.length <= small {
            let id = pb::BlockId {
                inode: file.inode,
                version: file.version,
                index: 0,
            };
            self.short_circuit.done_with(&id, 0);
        } else {
            self.short_circuit.done_with_file(file.inode, file.version);
        }
    }

    /// A loader reading a folder of small files under leases taken ahead (see
    /// [`small_files_after`](Self::small_files_after)): once it is halfway through them,
    /// the next files are leased in the background, so readers never wait for a lease
    /// request — and several reader threads do not all ask for the same files at once.
    fn lease_further_ahead(self: &Arc<Self>, file: &pb::FileStatus, worker_id: u64) {
        let small = self.short_circuit_page_size() * u64::from(crate::local::LEASE_WINDOW_PAGES);
        if file.length > small || !self.in_name_order(file.inode) {
            return;
        }
        let target = {
            let next = lock(&self.meta.next_in_dir);
            let mut cur = file.inode;
            for _ in 0..LEASE_AHEAD_FILES / 2 {
                let Some(&n) = next.get(&cur) else {
                    return;
                };
                cur = n;
            }
            cur
        };
        let Some(s) = lock(&self.meta.recent)
            .get(&target)
            .map(|e| e.status.clone())
        else {
            return;
        };
        let Some(id) = self.small_block_to_lease(&s, small) else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.ahead.leasing_ahead.swap(true, Ordering::AcqRel) {
            return; // one such request at a time
        }
        let me = self.clone();
        rt.spawn(async move {
            let w = me
                .live_workers()
                .await
                .into_iter()
                .find(|w| w.worker_id == worker_id);
            if let Some(w) = w {
                me.take_lease(&w, &id, 0, None, false).await;
            }
            me.ahead.leasing_ahead.store(false, Ordering::Release);
        });
    }

    /// A large read continuing the previous one (a sequential reader under short-circuit
    /// leases; see [`LEASE_NEXT_SLACK`]): the next window is
    /// leased in the background, so the reader finds its lease there and never waits for a
    /// lease request nor falls back to the slower paths. As soon as a window is entered:
    /// the kernel's read-ahead runs up to 8 MiB (half a window) ahead of the program.
    /// `worker` holds the window just read.
    fn lease_next_window(self: &Arc<Self>, file: &pb::FileStatus, end: u64, len: u64, worker: u64) {
        let span = self.short_circuit_page_size() * u64::from(crate::local::LEASE_WINDOW_PAGES);
        let bs = block_size(file);
        if len < LEASE_NEXT_MIN_READ || end >= file.length {
            return;
        }
        // The window after the one holding the read's last byte.
        let last = end - 1;
        let (index, in_block) = (last / bs, (last % bs) / span * span + span);
        let next_block = in_block >= bs;
        let (index, in_block) = if next_block {
            (index + 1, 0)
        } else {
            (index, in_block)
        };
        if index * bs + in_block >= file.length {
            return;
        }
        let Ok(index) = u32::try_from(index) else {
            return;
        };
        let id = pb::BlockId {
            inode: file.inode,
            version: file.version,
            index,
        };
        let window = self.short_circuit.window_of(in_block);
        if self.short_circuit.lease(&id, window).is_some()
            || self.short_circuit.recently_missing(&id)
        {
            return;
        }
        let key = (id.inode, id.version, id.index, window);
        {
            let mut m = lock(&self.ahead.windows_ahead);
            if m.len() >= MAX_WINDOWS_AHEAD || !m.insert(key) {
                return;
            }
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            lock(&self.ahead.windows_ahead).remove(&key);
            return;
        };
        let me = self.clone();
        rt.spawn(async move {
            // The same worker for the rest of its block; the block's placement for the next.
            let workers = me.live_workers().await;
            let w = order_workers(&id, &workers)
                .into_iter()
                .filter(|w| me.short_circuit.applies_to(w))
                .min_by_key(|w| !next_block && w.worker_id != worker);
            if let Some(w) = w {
                let first = window.saturating_mul(crate::local::LEASE_WINDOW_PAGES);
                me.take_lease(&w, &id, first, None, true).await;
            }
            lock(&me.ahead.windows_ahead).remove(&key);
        });
    }

    /// A sequential reader in the second half of a block: asks the next block's worker for
    /// its first byte in the background, so that worker starts its fetch and read-ahead
    /// while this block is still being read (a cold reader does not stall at every block
    /// boundary). Once per block; nothing for random readers.
    fn warm_next_block(self: &Arc<Self>, file: &pb::FileStatus, offset: u64, end: u64, bs: u64) {
        let next = end / bs + 1;
        let mut warm = false;
        self.sequential.note(file.inode, end, |prev, warmed| {
            warm = continues(prev, offset, 0, true)
                && end % bs >= bs / 2
                && next * bs < file.length
                && *warmed < next;
            if warm {
                *warmed = next;
            }
        });
        if !warm {
            return;
        }
        let me = self.clone();
        let file = file.clone();
        tokio::spawn(async move {
            let Ok(mut desc) = Self::descriptor(&file, next) else {
                return;
            };
            let block_id = desc.id.unwrap_or_default();
            let workers = me.live_workers().await;
            let Some(owner) = order_workers(&block_id, &workers).into_iter().next() else {
                return;
            };
            let grant = me.grant_for(&file, false).await.ok().flatten();
            Self::with_grant_terms(&mut desc, grant.as_ref());
            if let Err(e) = me
                .read_from_worker(&owner.address, &desc, 0, 1, grant)
                .await
            {
                tracing::debug!(path = %file.path, block = next, error = %e, "warming the next block failed");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::block_ranges;

    #[test]
    fn ranges_split_at_block_boundaries() {
        let v: Vec<_> = block_ranges(90, 250, 100).collect();
        assert_eq!(v, vec![(0, 90, 10), (1, 0, 100), (2, 0, 50)]);
        assert_eq!(block_ranges(5, 5, 100).count(), 0);
        assert_eq!(
            block_ranges(0, 100, 100).collect::<Vec<_>>(),
            vec![(0, 0, 100)]
        );
    }
}
