//! Short-circuit reads: a client on the same host as a worker that caches a block reads the
//! block file itself instead of streaming it over gRPC.
//!
//! Protocol: the client asks the worker for a *lease* on the block (`LeaseLocalBlock`); the
//! answer names the block file and lists the cached pages with their lengths and CRC32C.
//! Until the lease ends (`lease_ms` after the client *sent* the request, so the client's
//! view never outlasts the worker's) the worker does not evict those pages. The client reads
//! whole pages and checks their CRC32C on every read (as the worker does for gRPC reads: a
//! page that rotted on disk is never served), and discards any read that finished after the
//! lease ended. Anything else — no lease, a page not cached, a file it
//! cannot open (another mount namespace), a bad checksum — falls back to the gRPC read.
//!
//! "Same host" means the worker's reported host equals this client's node name
//! ([`granary_common::node_name`]: `GRANARY_NODE_NAME`, else the hostname); the block file
//! must be visible at the same path (on Kubernetes: the cache hostPath mounted at the same
//! path into the FUSE pod).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use granary_proto as pb;

/// (inode, version, block index)
type BlockKey = (u64, u64, u32);
/// A block and one of its lease windows (pages `[w * LEASE_WINDOW_PAGES, (w + 1) *
/// LEASE_WINDOW_PAGES)`).
type WindowKey = (BlockKey, u32);

fn block_key(id: &pb::BlockId) -> BlockKey {
    (id.inode, id.version, id.index)
}

/// Pages one lease covers at most (the worker's window; ranges are read in such windows,
/// aligned to multiples of it).
pub const LEASE_WINDOW_PAGES: u32 = 16;
/// How long a block file checked whole for passthrough is trusted without a new check.
pub const REVERIFY_AFTER: Duration = Duration::from_secs(600);
/// Block files remembered as checked.
const MAX_VERIFIED: usize = 100_000;
/// Leases kept open (one file descriptor each).
const MAX_LEASES: usize = 1024;
/// Released leases queued per worker (beyond it they just expire).
const MAX_DONE: usize = 4096;
/// A lease is renewed when less than this is left (a read started in it must finish in it).
const RENEW_MARGIN: Duration = Duration::from_secs(2);
/// How long a worker whose files this client cannot open is not tried again.
const NOT_LOCAL_FOR: Duration = Duration::from_secs(60);
/// Deadline of a lease request.
pub const LEASE_TIMEOUT: Duration = Duration::from_secs(5);
/// Small files' block files kept open after their leases are given back, at most (each
/// holds one descriptor, two at times; fewer when the process may open few files).
const KEPT_FILES: usize = 65_536;
/// Bytes of the block files kept open, at most.
const KEPT_BYTES: u64 = 8 << 30;
/// How often kept block files are checked for removal by their worker (a removed file
/// still takes disk space while a descriptor holds it: those are let go).
pub const KEPT_SWEEP_EVERY: Duration = Duration::from_secs(10);
/// A block that had no lease, or whose lease lacked a page, is read over gRPC for this long
/// before a new lease is asked for (a cold block does not cost a lease request per read).
const RETRY_LEASE_AFTER: Duration = Duration::from_millis(50);

pub struct LocalLease {
    pub worker_id: u64,
    pub id: u64,
    /// The pages the lease could cover: [first, first + window).
    first: u32,
    window: u32,
    /// The block file, for reads through the page cache: opened with the lease when direct
    /// reads are not possible, else at the first read that needs it (a small file read
    /// whole never does, which saves an open per file).
    file: OnceLock<File>,
    /// The cache file of the block's file version (its blocks at their file offsets).
    path: PathBuf,
    /// Offset of the block's first byte in `path`.
    base: u64,
    /// The same block file opened for direct reads (`None`: its file system refuses them).
    direct: Option<File>,
    page_size: u64,
    /// page index → (length, CRC32C)
    pages: HashMap<u32, (u32, u32)>,
    /// Bit `i`: page `first + i` was read whole and matched its CRC32C under this lease
    /// (pages past the 64th of a window are not remembered).
    verified: AtomicU64,
    /// When a read of a kept file last checked every page of it (ms since `taken`; 0:
    /// never): a kept file opened in passthrough is read by the kernel unchecked.
    checked_whole_ms: AtomicU64,
    /// When the worker may evict the pages again (at the earliest).
    until: Instant,
    taken: Instant,
    /// The block, and the pages checked by any lease of this client (see [`PageChecks`]).
    checks: Option<(BlockKey, Arc<PageChecks>)>,
}

/// Pages of block files read whole and checked, and when, by any lease of this client: a
/// later lease's read of part of such a page within [`REVERIFY_AFTER`] reads just that
/// part, as a read under the lease that checked it does (a random reader's 100 KB reads
/// otherwise cost a 1 MiB read and checksum whenever its lease is new). The rule is the one
/// passthrough opens follow for whole files: a page the worker evicted and fetched again
/// holds the same bytes; what goes unseen for up to 10 minutes is rot on the worker's disk.
#[derive(Default)]
pub struct PageChecks(Mutex<HashMap<(BlockKey, u32), Instant>>);

/// Pages remembered as checked (256 GiB of 1 MiB pages); the oldest checks are forgotten
/// first when full.
const MAX_PAGE_CHECKS: usize = 262_144;

impl PageChecks {
    fn checked(&self, block: BlockKey, page: u32) -> bool {
        lock(&self.0)
            .get(&(block, page))
            .is_some_and(|t| t.elapsed() < REVERIFY_AFTER)
    }

    fn note(&self, block: BlockKey, page: u32) {
        let mut m = lock(&self.0);
        if m.len() >= MAX_PAGE_CHECKS && !m.contains_key(&(block, page)) {
            m.retain(|_, t| t.elapsed() < REVERIFY_AFTER / 2);
            if m.len() >= MAX_PAGE_CHECKS {
                m.clear();
            }
        }
        m.insert((block, page), Instant::now());
    }
}

/// Why a leased read did not happen.
#[derive(Debug, PartialEq, Eq)]
pub enum Miss {
    /// The lease ends too soon: ask for a new one.
    Expiring,
    /// A needed page inside the window is not in the lease (not cached when the lease was
    /// taken, or leases held their share): ask again only after a while.
    NotCached,
    /// A needed page is outside the lease's window: ask for a lease from it.
    Outside,
    /// The file is unusable (bad checksum, read error): drop the lease, read over gRPC.
    Bad,
}

impl LocalLease {
    /// Opens the block file of a lease granted at `sent`.
    pub fn open(
        worker_id: u64,
        r: &pb::LeaseLocalBlockResponse,
        sent: Instant,
    ) -> std::io::Result<Self> {
        let path = PathBuf::from(&r.path);
        let direct = crate::direct::open(&path);
        let file = OnceLock::new();
        if direct.is_none() {
            let _ = file.set(open_buffered(&path)?);
        }
        let first = r.pages.first().map_or(0, |p| p.index);
        Ok(Self {
            worker_id,
            id: r.lease_id,
            first,
            window: r.window_pages.max(1),
            file,
            path,
            base: r.block_offset,
            direct,
            page_size: r.page_size.max(1),
            pages: r
                .pages
                .iter()
                .map(|p| (p.index, (p.length, p.crc32c)))
                .collect(),
            verified: AtomicU64::new(0),
            checked_whole_ms: AtomicU64::new(0),
            until: sent + Duration::from_millis(r.lease_ms),
            taken: sent,
            checks: None,
        })
    }

    /// The block file for reads through the page cache, opened now if not yet.
    fn file(&self) -> std::io::Result<&File> {
        if let Some(f) = self.file.get() {
            return Ok(f);
        }
        let f = open_buffered(&self.path)?;
        Ok(self.file.get_or_init(|| f))
    }

    fn usable(&self, now: Instant) -> bool {
        now + RENEW_MARGIN < self.until
    }

    /// The bit of page `index` in `verified`, if it has one.
    fn verified_bit(&self, index: u32) -> Option<u64> {
        let i = index.checked_sub(self.first)?;
        (i < 64).then(|| 1u64 << i)
    }

    /// Shares the pages this lease checks, and uses those checked before, with the other
    /// leases of this client (see [`PageChecks`]).
    pub fn checked_by(mut self, id: &pb::BlockId, checks: Arc<PageChecks>) -> Self {
        self.checks = Some((block_key(id), checks));
        self
    }

    /// Whether page `index` was read whole and checked under this lease (or under another
    /// within [`REVERIFY_AFTER`], see [`PageChecks`]).
    fn is_verified(&self, index: u32) -> bool {
        self.verified_bit(index)
            .is_some_and(|b| self.verified.load(Ordering::Relaxed) & b != 0)
            || self
                .checks
                .as_ref()
                .is_some_and(|(block, c)| c.checked(*block, index))
    }

    fn mark_verified(&self, index: u32) {
        if let Some(b) = self.verified_bit(index) {
            self.verified.fetch_or(b, Ordering::Relaxed);
        }
        if let Some((block, c)) = &self.checks {
            c.note(*block, index);
        }
        if index == 0 && self.first == 0 && self.pages.len() == 1 {
            // A lease of one page checked whole: kept at the file's close (one page is all
            // of it then, see `ShortCircuit::keep_open`), it may be opened in passthrough.
            self.note_checked_whole();
        }
    }

    fn note_checked_whole(&self) {
        self.checked_whole_ms.store(
            (self.taken.elapsed().as_millis() as u64).max(1),
            Ordering::Relaxed,
        );
    }

    /// Too recent to ask again for pages it lacked.
    pub fn fresh(&self) -> bool {
        self.taken.elapsed() < RETRY_LEASE_AFTER
    }

    /// Reads `len` bytes at `offset` of the block (blocking file I/O).
    pub fn read(&self, offset: u64, len: u64) -> Result<Bytes, Miss> {
        self.read_via(offset, len, self.direct.as_ref())
    }

    /// [`read`](Self::read), whole pages by direct reads of `direct` when given.
    fn read_via(&self, offset: u64, len: u64, direct: Option<&File>) -> Result<Bytes, Miss> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        if !self.usable(Instant::now()) {
            return Err(Miss::Expiring);
        }
        let ps = self.page_size;
        let (first, last) = (offset / ps, (offset + len - 1) / ps);
        // Every page the range touches: (start in the block, length, CRC32C).
        let mut pages = Vec::with_capacity((last - first + 1) as usize);
        for page in first..=last {
            let index = u32::try_from(page).map_err(|_| Miss::Bad)?;
            if index < self.first || index - self.first >= self.window {
                return Err(Miss::Outside);
            }
            let &(plen, crc) = self.pages.get(&index).ok_or(Miss::NotCached)?;
            let page_start = page * ps;
            if (offset + len).min(page_start + ps) > page_start + u64::from(plen) {
                return Err(Miss::NotCached); // a short page cannot hold the range
            }
            pages.push((page_start, u64::from(plen), crc));
        }
        let whole_pages = pages.first().is_some_and(|p| p.0 == offset)
            && pages.last().is_some_and(|p| p.0 + p.1 == offset + len);
        let out = match (direct, whole_pages) {
            (Some(direct), true) => {
                crate::direct::read_at(direct, self.base + offset, len as usize)
            }
            _ => None,
        };
        let out = match out {
            Some(out) => {
                // Pages lie back to back in the block file: check each one's slice.
                for &(page_start, plen, crc) in &pages {
                    let at = (page_start - offset) as usize;
                    if crc32c::crc32c(&out[at..at + plen as usize]) != crc {
                        return Err(Miss::Bad);
                    }
                    self.mark_verified((page_start / ps) as u32);
                }
                out
            }
            None => self.read_buffered(offset, len, ps, &pages)?,
        };
        // Bytes read after the lease ended may have been evicted under us.
        if Instant::now() >= self.until {
            return Err(Miss::Expiring);
        }
        Ok(out)
    }

    /// [`read`](Self::read) through the page cache; `pages` as `read` found them. A part of
    /// a page already checked whole under this lease is read alone, without its CRC32C
    /// (a random reader's 4 KiB reads otherwise cost a 1 MiB read and checksum each).
    fn read_buffered(
        &self,
        offset: u64,
        len: u64,
        ps: u64,
        pages: &[(u64, u64, u32)],
    ) -> Result<Bytes, Miss> {
        let file = self.file().map_err(|_| Miss::Bad)?;
        let base = self.base;
        crate::direct::filled(len as usize, |out| {
            for &(page_start, plen, crc) in pages {
                let from = offset.max(page_start);
                let to = (offset + len).min(page_start + plen);
                let dst = &mut out[(from - offset) as usize..(to - offset) as usize];
                let index = (page_start / ps) as u32;
                if from == page_start && to == page_start + plen {
                    // The whole page: read it in place.
                    file.read_exact_at(dst, base + from)
                        .map_err(|_| Miss::Bad)?;
                    if crc32c::crc32c(dst) != crc {
                        return Err(Miss::Bad);
                    }
                    self.mark_verified(index);
                } else if self.is_verified(index) {
                    file.read_exact_at(dst, base + from)
                        .map_err(|_| Miss::Bad)?;
                } else {
                    let mut whole = vec![0u8; plen as usize];
                    file.read_exact_at(&mut whole, base + page_start)
                        .map_err(|_| Miss::Bad)?;
                    if crc32c::crc32c(&whole) != crc {
                        return Err(Miss::Bad);
                    }
                    self.mark_verified(index);
                    dst.copy_from_slice(
                        &whole[(from - page_start) as usize..(to - page_start) as usize],
                    );
                }
            }
            Ok(())
        })
    }
}

impl LocalLease {
    /// Whether the lease holds every byte of a `len`-byte block from its first page (all
    /// of a small file).
    pub fn holds_whole(&self, len: u64) -> bool {
        let ps = self.page_size;
        self.first == 0
            && len > 0
            && (0..len.div_ceil(ps)).all(|p| {
                u32::try_from(p)
                    .ok()
                    .and_then(|i| self.pages.get(&i))
                    .is_some_and(|&(l, _)| u64::from(l) == ps.min(len - p * ps))
            })
    }

    /// Reads `len` bytes at `offset` of a block file kept open after its lease was given
    /// back (see [`ShortCircuit::keep_open`]). The worker may have evicted the block since:
    /// a removed file still reads as it was (this descriptor holds it), a page punched out
    /// or written again reads as zeros or other bytes and fails its checksum. So every
    /// page read is checked whole, every time, and nothing depends on the lease's end.
    pub fn read_kept(&self, offset: u64, len: u64) -> Result<Bytes, Miss> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let ps = self.page_size;
        let (first, last) = (offset / ps, (offset + len - 1) / ps);
        let from = first * ps;
        let mut want = 0u64;
        let mut pages = Vec::with_capacity((last - first + 1) as usize);
        for page in first..=last {
            let index = u32::try_from(page).map_err(|_| Miss::Bad)?;
            let &(plen, crc) = self.pages.get(&index).ok_or(Miss::NotCached)?;
            let end = page * ps + u64::from(plen);
            if (offset + len).min(page * ps + ps) > end {
                return Err(Miss::NotCached);
            }
            want = end - from;
            pages.push((page * ps, u64::from(plen), crc));
        }
        let whole = match &self.direct {
            Some(d) => crate::direct::read_at(d, self.base + from, want as usize),
            None => None,
        };
        let whole = match whole {
            Some(w) => w,
            None => {
                let file = self.file().map_err(|_| Miss::Bad)?;
                crate::direct::filled(want as usize, |out| {
                    file.read_exact_at(out, self.base + from)
                        .map_err(|_| Miss::Bad)
                })?
            }
        };
        for &(page_start, plen, crc) in &pages {
            let at = (page_start - from) as usize;
            let bytes = whole.get(at..at + plen as usize).ok_or(Miss::Bad)?;
            if crc32c::crc32c(bytes) != crc {
                return Err(Miss::Bad);
            }
        }
        if from == 0 && pages.len() == self.pages.len() {
            self.note_checked_whole();
        }
        let at = (offset - from) as usize;
        Ok(whole.slice(at..at + len as usize))
    }

    /// A descriptor of its own for a kept file of one page that a read checked whole less
    /// than [`REVERIFY_AFTER`] ago, to hand the kernel for passthrough (see
    /// [`ShortCircuit::kept_for_passthrough`]).
    fn passthrough_file(&self) -> Option<(File, Parkable)> {
        let at = self.checked_whole_ms.load(Ordering::Relaxed);
        if at == 0
            || self
                .taken
                .elapsed()
                .saturating_sub(Duration::from_millis(at))
                >= REVERIFY_AFTER
            || self.pages.len() != 1
            || self.base != 0
        {
            return None;
        }
        let fd = match (&self.direct, self.file.get()) {
            (Some(f), _) | (None, Some(f)) => std::os::fd::AsRawFd::as_raw_fd(f),
            (None, None) => return None,
        };
        // Reopened through /proc: the same file even if the worker removed it since (its
        // bytes are still this version's), without O_DIRECT and with read-ahead of its own.
        let file = File::open(format!("/proc/self/fd/{fd}")).ok()?;
        let park = Parkable::new(&file, &self.path, self.taken + Duration::from_millis(at))?;
        Some((file, park))
    }

    /// Whether a `len`-byte block is one page of this lease's page size and the first
    /// block of its file (so all of it): its page is only ever evicted by removing the
    /// whole file (never punched out under a reader).
    pub fn one_page(&self, len: u64) -> bool {
        len > 0 && len <= self.page_size && self.base == 0
    }

    /// Offset of the block's first byte in [`path`](Self::path).
    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// For passthrough: checks that the lease holds the whole of a `len`-byte block from
    /// page 0, that the cache file reaches the block's end, and (`checksums`) every page's
    /// CRC32C (blocking I/O). Returns a descriptor of the cache file: the caller checks that
    /// it is exactly as long as the file.
    pub fn verify_whole(&self, len: u64, checksums: bool) -> Option<File> {
        let ps = self.page_size;
        let n = len.div_ceil(ps);
        let held: u64 = (0..n)
            .map(|p| u32::try_from(p).ok().and_then(|i| self.pages.get(&i)))
            .map(|m| m.map_or(0, |(l, _)| u64::from(*l)))
            .sum();
        let file = self.file().ok()?;
        if held != len || file.metadata().ok()?.len() < self.base + len {
            return None;
        }
        if checksums {
            // The whole block is read now: let the kernel fetch it from the disk in parallel.
            let _ = nix::fcntl::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(file),
                self.base as i64,
                len as i64,
                nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
            );
            // Through the page cache: the passthrough reads that follow find the file there.
            for p in 0..n {
                let from = p * ps;
                self.read_via(from, ps.min(len - from), None).ok()?;
            }
        }
        // A descriptor of its own (not a dup sharing the lease's read-ahead state), so each
        // passthrough open starts with fresh sequential read-ahead.
        let fd = std::os::fd::AsRawFd::as_raw_fd(file);
        File::open(format!("/proc/self/fd/{fd}"))
            .or_else(|_| file.try_clone())
            .ok()
    }
}

/// A one-page block file checked whole, opened for the kernel to read in passthrough: the
/// kernel's reference to it may outlive the open that made it ("parked" by the mount), so
/// the file's next opens need no lease and no read, until the next check is due or the
/// worker removes the file. A removed file still reads as it was (the reference holds it;
/// its bytes are this version's), but holds its disk space: [`removed`](Self::removed)
/// finds those.
#[derive(Clone, Debug)]
pub struct Parkable {
    /// The next check of the file's checksums is due then.
    pub until: Instant,
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Parkable {
    /// `file`, opened from `path`, was checked whole at `checked`.
    pub fn new(file: &File, path: &Path, checked: Instant) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata().ok()?;
        Some(Self {
            until: checked + REVERIFY_AFTER,
            path: path.to_path_buf(),
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// A block file known by its path and identity (`st_dev`, `st_ino`), due for its next
    /// check at `until` (a parked backing file a previous daemon of the mount described).
    pub fn from_parts(path: PathBuf, dev: u64, ino: u64, until: Instant) -> Self {
        Self {
            until,
            path,
            dev,
            ino,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The block file's identity: (`st_dev`, `st_ino`).
    pub fn identity(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    /// Whether `other` is the same block file (not one put in its place since).
    pub fn same_file(&self, other: &Parkable) -> bool {
        self.identity() == other.identity()
    }

    /// Not due for a new check yet.
    pub fn usable(&self, now: Instant) -> bool {
        now < self.until
    }

    /// Whether the worker removed the block file (or put another in its place) since
    /// (blocking: one `stat`).
    pub fn removed(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(&self.path)
            .map_or(true, |m| m.dev() != self.dev || m.ino() != self.ino)
    }
}

/// Opens a block file for reads through the page cache. Block files are read front to
/// back: the kernel may read ahead further.
fn open_buffered(path: &Path) -> std::io::Result<File> {
    let file = crate::direct::open_for_reading(path, 0)?;
    let _ = nix::fcntl::posix_fadvise(
        std::os::fd::AsRawFd::as_raw_fd(&file),
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_SEQUENTIAL,
    );
    Ok(file)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The short-circuit state of one client.
pub struct ShortCircuit {
    pub enabled: AtomicBool,
    node: Mutex<String>,
    /// One lease per lease window of a block, so a reader and the prefetch running ahead
    /// of it in the next window each keep their own (one lease per block made them replace
    /// each other's, and the loser read over gRPC).
    leases: Mutex<HashMap<WindowKey, Arc<LocalLease>>>,
    /// Blocks the worker had nothing of, when it said so.
    missing: Mutex<HashMap<BlockKey, Instant>>,
    /// Block files whose every page passed its checksum for a passthrough open, when.
    verified: Mutex<HashMap<BlockKey, Instant>>,
    /// Bytes read per worker not yet reported to it.
    unreported: Mutex<HashMap<u64, u64>>,
    /// Workers that serve no leases (an older worker), since when.
    not_local: Mutex<HashMap<u64, Instant>>,
    /// Tier folders of same-host workers whose block files this client could not open
    /// (not shared with it: a memory tier private to the worker's pod, a disk not mounted
    /// here), since when. Blocks in other tiers of the same worker are still read directly.
    unreachable: Mutex<HashMap<std::path::PathBuf, Instant>>,
    /// The workers' page size, learnt from their leases (to name the first page wanted).
    page_size: AtomicU64,
    /// Leases this client is done with, to be released on their worker: worker → ids.
    done: Mutex<HashMap<u64, Vec<u64>>>,
    /// Small files' block files kept open after their leases were given back.
    kept: Mutex<Kept>,
    /// Pages checked by any lease (see [`PageChecks`]).
    page_checks: Arc<PageChecks>,
}

/// Block files of small files read whole and closed, kept open (see
/// [`ShortCircuit::keep_open`]); the oldest go first.
#[derive(Default)]
struct Kept {
    files: HashMap<BlockKey, (Arc<LocalLease>, u64)>,
    order: std::collections::VecDeque<BlockKey>,
    bytes: u64,
    max_files: usize,
}

impl Kept {
    fn remove(&mut self, key: &BlockKey) {
        if let Some((_, len)) = self.files.remove(key) {
            self.bytes -= len;
        }
    }

    fn insert(&mut self, key: BlockKey, lease: Arc<LocalLease>, len: u64) {
        self.remove(&key);
        while !self.order.is_empty()
            && (self.files.len() >= self.max_files || self.bytes + len > KEPT_BYTES)
        {
            if let Some(old) = self.order.pop_front() {
                self.remove(&old);
            }
        }
        if self.files.len() >= self.max_files || self.bytes + len > KEPT_BYTES {
            return;
        }
        self.files.insert(key, (lease, len));
        self.order.push_back(key);
        self.bytes += len;
        // Keys of files removed meanwhile are dropped as they reach the front.
        if self.order.len() > 2 * self.max_files.max(1) {
            let files = &self.files;
            self.order.retain(|k| files.contains_key(k));
        }
    }
}

/// How many block files may be kept open, given the descriptors this process may open
/// (half the limit, less what the rest of the process may need).
fn kept_files_limit() -> usize {
    let soft = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft)
        .unwrap_or(1024);
    let room = (soft / 2).saturating_sub(4096);
    KEPT_FILES.min(usize::try_from(room).unwrap_or(KEPT_FILES))
}

impl ShortCircuit {
    pub fn new(node: String) -> Self {
        Self {
            enabled: AtomicBool::new(true),
            node: Mutex::new(node),
            leases: Mutex::new(HashMap::new()),
            missing: Mutex::new(HashMap::new()),
            verified: Mutex::new(HashMap::new()),
            unreported: Mutex::new(HashMap::new()),
            not_local: Mutex::new(HashMap::new()),
            unreachable: Mutex::new(HashMap::new()),
            page_size: AtomicU64::new(granary_common::DEFAULT_PAGE_SIZE),
            done: Mutex::new(HashMap::new()),
            kept: Mutex::new(Kept {
                max_files: kept_files_limit(),
                ..Kept::default()
            }),
            page_checks: Arc::default(),
        }
    }

    /// The pages checked by this client's leases, for a new lease to share.
    pub fn page_checks(&self) -> Arc<PageChecks> {
        self.page_checks.clone()
    }

    /// A small file (one block of `len` bytes) read and closed: its lease is given back as
    /// by [`done_with`](Self::done_with), but when the lease held the whole file its block
    /// file stays open here, so the file's next reads (the next epoch of a training loop)
    /// need no new lease. A block file stays valid to read through a descriptor whatever
    /// the worker does to it later (see [`LocalLease::read_kept`]); what it costs is disk
    /// space the worker freed but this client still holds — at most [`KEPT_BYTES`].
    pub fn keep_open(&self, id: &pb::BlockId, len: u64) {
        let lease = {
            let mut m = lock(&self.leases);
            Self::take_unused(&mut m, (block_key(id), 0))
        };
        let Some(l) = lease else { return };
        self.queue_release(&l);
        if l.holds_whole(len) {
            lock(&self.kept).insert(block_key(id), l, len);
        }
    }

    /// A small file (one block of `len` bytes) was just read under a lease: when the lease
    /// holds all of it, its block file is kept open from now on (as at its close, see
    /// [`keep_open`](Self::keep_open)) — leases taken ahead for other files may push this
    /// one out of the lease table before the file is closed.
    pub fn keep_if_whole(&self, id: &pb::BlockId, len: u64) {
        let key = block_key(id);
        if lock(&self.kept).files.contains_key(&key) {
            return;
        }
        let Some(l) = lock(&self.leases).get(&(key, 0)).cloned() else {
            return;
        };
        if l.holds_whole(len) {
            lock(&self.kept).insert(key, l, len);
        }
    }

    /// The block file of a small file kept open (see [`keep_open`](Self::keep_open)).
    pub fn kept(&self, id: &pb::BlockId) -> Option<Arc<LocalLease>> {
        lock(&self.kept)
            .files
            .get(&block_key(id))
            .map(|(l, _)| l.clone())
    }

    /// For a FUSE passthrough open of a small file without a lease: a descriptor of its
    /// kept block file, when the file is one page (a page of a one-page block is only ever
    /// evicted by removing the file, which a descriptor still reads as it was — never
    /// punched out under the kernel's reads) and a read checked it whole within the last
    /// [`REVERIFY_AFTER`] (the rule for passthrough opens under leases too).
    pub fn kept_for_passthrough(&self, id: &pb::BlockId) -> Option<(File, Parkable)> {
        self.kept(id)?.passthrough_file()
    }

    /// A kept block file failed a read: it is let go.
    pub fn drop_kept(&self, id: &pb::BlockId) {
        lock(&self.kept).remove(&block_key(id));
    }

    /// How many more block files may be kept open before older ones are let go.
    pub fn kept_room(&self) -> usize {
        let k = lock(&self.kept);
        k.max_files.saturating_sub(k.files.len())
    }

    /// Block files kept open now.
    pub fn kept_files(&self) -> usize {
        lock(&self.kept).files.len()
    }

    /// Lets go of kept block files their worker removed (evicted, dropped): their disk
    /// space is freed once no descriptor holds them. Returns how many went.
    pub fn sweep_kept(&self) -> usize {
        use std::os::unix::fs::MetadataExt;
        let kept: Vec<(BlockKey, Arc<LocalLease>)> = lock(&self.kept)
            .files
            .iter()
            .map(|(k, (l, _))| (*k, l.clone()))
            .collect();
        let removed: Vec<BlockKey> = kept
            .into_iter()
            .filter(|(_, l)| {
                let file = l.direct.as_ref().or_else(|| l.file.get());
                file.and_then(|f| f.metadata().ok())
                    .is_none_or(|m| m.nlink() == 0)
            })
            .map(|(k, _)| k)
            .collect();
        let mut m = lock(&self.kept);
        for k in &removed {
            m.remove(k);
        }
        removed.len()
    }

    /// Sets the node this client runs on (default: [`granary_common::node_name`]).
    pub fn set_node(&self, node: &str) {
        *lock(&self.node) = node.to_string();
    }

    pub fn page_size(&self) -> u64 {
        self.page_size.load(Ordering::Relaxed).max(1)
    }

    pub fn set_page_size(&self, ps: u64) {
        if ps > 0 {
            self.page_size.store(ps, Ordering::Relaxed);
        }
    }

    /// Is `w` on this node (same node name)? Whether or not short-circuit reads are on.
    pub fn same_node(&self, w: &pb::WorkerInfo) -> bool {
        w.host == *lock(&self.node)
    }

    /// Should reads of `w`'s blocks try its block files?
    pub fn applies_to(&self, w: &pb::WorkerInfo) -> bool {
        self.enabled.load(Ordering::Relaxed)
            && w.host == *lock(&self.node)
            && lock(&self.not_local)
                .get(&w.worker_id)
                .is_none_or(|t| t.elapsed() >= NOT_LOCAL_FOR)
    }

    pub fn mark_not_local(&self, worker_id: u64) {
        lock(&self.not_local).insert(worker_id, Instant::now());
    }

    /// The tier folder a cache file lies in (`<tier>/files/<xx>/<inode>-<version>`).
    fn tier_of(block_file: &std::path::Path) -> Option<&std::path::Path> {
        block_file.ancestors().nth(3)
    }

    /// This client could not open `block_file`: unless its tier folder is visible here (then
    /// only that block had a problem), the tier is not shared with this client. Returns
    /// whether the tier was marked.
    pub fn mark_unreachable(&self, block_file: &std::path::Path) -> bool {
        let Some(tier) = Self::tier_of(block_file) else {
            return false;
        };
        if tier.join("files").is_dir() {
            return false;
        }
        {
            let mut m = lock(&self.unreachable);
            if m.len() >= 1024 {
                m.clear();
            }
            m.insert(tier.to_path_buf(), Instant::now());
        }
        true
    }

    /// Whether `path` has the shape of a worker's cache file:
    /// `/…/<tier>/files/<xx>/<16 hex digits>-<16 hex digits>`, `xx` the name's 15th and 16th
    /// digits, no `.` or `..`. A lease names its file, and the mount (often root) opens it:
    /// a holder of a node certificate posing as this node's worker could otherwise have it
    /// open any file of the node and learn its bytes from the checksum comparisons.
    pub fn cache_file_shaped(path: &std::path::Path) -> bool {
        use std::path::Component;
        let mut parts = path.components();
        let (Some(Component::RootDir), true) = (
            parts.next(),
            parts.clone().all(|c| matches!(c, Component::Normal(_))),
        ) else {
            return false;
        };
        let names: Vec<&str> = path
            .iter()
            .rev()
            .take(3)
            .filter_map(|n| n.to_str())
            .collect();
        let [name, shard, files] = names[..] else {
            return false;
        };
        let hex =
            |s: &str| s.len() == 16 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        files == "files"
            && name.len() == 33
            && name.as_bytes()[16] == b'-'
            && hex(&name[..16])
            && hex(&name[17..])
            && shard == &name[14..16]
    }

    /// Can this client open block files in `block_file`'s tier folder (as far as it knows)?
    /// Never a path that is not shaped as a cache file ([`Self::cache_file_shaped`]).
    pub fn reachable(&self, block_file: &std::path::Path) -> bool {
        if !Self::cache_file_shaped(block_file) {
            return false;
        }
        Self::tier_of(block_file).is_none_or(|tier| {
            lock(&self.unreachable)
                .get(tier)
                .is_none_or(|t| t.elapsed() >= NOT_LOCAL_FOR)
        })
    }

    /// The lease window holding byte `offset` of a block.
    pub fn window_of(&self, offset: u64) -> u32 {
        u32::try_from(offset / (self.page_size() * u64::from(LEASE_WINDOW_PAGES)))
            .unwrap_or(u32::MAX)
    }

    /// A still usable lease (from any same-host worker) on lease window `window` of a block.
    pub fn lease(&self, id: &pb::BlockId, window: u32) -> Option<Arc<LocalLease>> {
        let key = (block_key(id), window);
        let mut m = lock(&self.leases);
        match m.get(&key) {
            Some(l) if l.usable(Instant::now()) => Some(l.clone()),
            Some(_) => {
                m.remove(&key);
                None
            }
            None => None,
        }
    }

    /// The reader is done with window `window` of block `id` (its file was closed, or a
    /// sequential reader moved on): forgets its lease and queues its release on the worker
    /// — unless a read is using it at this moment (then it simply expires). A later read
    /// takes a new lease.
    pub fn done_with(&self, id: &pb::BlockId, window: u32) {
        let lease = {
            let mut m = lock(&self.leases);
            Self::take_unused(&mut m, (block_key(id), window))
        };
        if let Some(l) = lease {
            self.queue_release(&l);
        }
    }

    /// The file (inode, version) was closed: every lease on its blocks is released, unless
    /// a read is using it.
    pub fn done_with_file(&self, inode: u64, version: u64) {
        let mut m = lock(&self.leases);
        self.release_where(&mut m, |k| k.0 .0 == inode && k.0 .1 == version);
    }

    /// Forgets the leases whose key matches and that no read is using, and queues their
    /// release on their workers.
    fn release_where(
        &self,
        m: &mut HashMap<WindowKey, Arc<LocalLease>>,
        matches: impl Fn(&WindowKey) -> bool,
    ) {
        let keys: Vec<WindowKey> = m.keys().filter(|k| matches(k)).copied().collect();
        for k in keys {
            if let Some(l) = Self::take_unused(m, k) {
                self.queue_release(&l);
            }
        }
    }

    fn take_unused(
        m: &mut HashMap<WindowKey, Arc<LocalLease>>,
        key: WindowKey,
    ) -> Option<Arc<LocalLease>> {
        match m.get(&key) {
            Some(l) if Arc::strong_count(l) == 1 => m.remove(&key),
            _ => None,
        }
    }

    /// Queues `l`'s release on its worker (sent with the next lease request, or by the
    /// periodic report).
    pub fn queue_release(&self, l: &LocalLease) {
        let mut d = lock(&self.done);
        let ids = d.entry(l.worker_id).or_default();
        if ids.len() < MAX_DONE {
            ids.push(l.id);
        }
    }

    /// The leases to release on `worker_id` (see [`done_with`](Self::done_with)).
    pub fn take_done(&self, worker_id: u64) -> Vec<u64> {
        lock(&self.done).remove(&worker_id).unwrap_or_default()
    }

    /// The workers that have leases to release.
    pub fn workers_with_done(&self) -> Vec<u64> {
        lock(&self.done).keys().copied().collect()
    }

    /// Keeps a lease for the reads of its window (a random reader keeps every window it
    /// reads until the leases end or the file closes).
    pub fn keep(&self, id: &pb::BlockId, lease: Arc<LocalLease>) {
        let window = lease.first / LEASE_WINDOW_PAGES;
        let mut m = lock(&self.leases);
        Self::make_room(&mut m);
        m.insert((block_key(id), window), lease);
    }

    /// [`keep`](Self::keep) for a lease taken ahead of a sequential reader: the same file's
    /// leases more than two windows behind it (earlier windows of the block, earlier
    /// blocks) are released: the reader is done with them — unless a read is using them.
    pub fn keep_ahead(&self, id: &pb::BlockId, lease: Arc<LocalLease>) {
        let window = lease.first / LEASE_WINDOW_PAGES;
        let block = block_key(id);
        let mut m = lock(&self.leases);
        // The next window is leased as soon as a reader enters one, and the kernel's
        // read-ahead (up to 8 MiB for a reader that asked for sequential access) is still
        // sending reads of the window before: the two windows before this one (the
        // previous block's last ones, for a block's first two) are kept. Releasing the
        // second one made ~1 in 10 windows lose their last reads to the slow path.
        let behind = |k: &WindowKey| {
            k.0 .0 == block.0
                && k.0 .1 == block.1
                && (k.0 .2 + 1 < block.2
                    || (k.0 .2 + 1 == block.2 && window > 1)
                    || (k.0 .2 == block.2 && k.1 + 2 < window))
        };
        self.release_where(&mut m, behind);
        Self::make_room(&mut m);
        m.insert((block, window), lease);
    }

    /// Makes room for one more lease in a full table.
    fn make_room(m: &mut HashMap<WindowKey, Arc<LocalLease>>) {
        if m.len() >= MAX_LEASES {
            let now = Instant::now();
            m.retain(|_, l| l.usable(now));
            if m.len() >= MAX_LEASES {
                // Drop the oldest quarter, not all: the rest are leases taken ahead for
                // files about to be read (clearing them all made a loader re-lease each
                // small file several times).
                let mut taken: Vec<Instant> = m.values().map(|l| l.taken).collect();
                taken.sort_unstable();
                let cut = taken[MAX_LEASES / 4];
                m.retain(|_, l| l.taken > cut);
            }
        }
    }

    /// The worker had no page of the block: read it over gRPC for a while.
    pub fn note_missing(&self, id: &pb::BlockId) {
        let mut m = lock(&self.missing);
        if m.len() >= MAX_LEASES {
            m.retain(|_, t| t.elapsed() < RETRY_LEASE_AFTER);
        }
        m.insert((id.inode, id.version, id.index), Instant::now());
    }

    pub fn recently_missing(&self, id: &pb::BlockId) -> bool {
        lock(&self.missing)
            .get(&(id.inode, id.version, id.index))
            .is_some_and(|t| t.elapsed() < RETRY_LEASE_AFTER)
    }

    /// Must a passthrough open of this block check every page's checksum? Not when that
    /// was done less than [`REVERIFY_AFTER`] ago (an epoch re-opening a file then costs no
    /// extra read of it).
    pub fn needs_verify(&self, id: &pb::BlockId) -> bool {
        lock(&self.verified)
            .get(&(id.inode, id.version, id.index))
            .is_none_or(|t| t.elapsed() >= REVERIFY_AFTER)
    }

    /// When `id`'s block file was last checked whole for passthrough (within
    /// [`REVERIFY_AFTER`]).
    pub fn verified_at(&self, id: &pb::BlockId) -> Option<Instant> {
        lock(&self.verified)
            .get(&(id.inode, id.version, id.index))
            .copied()
            .filter(|t| t.elapsed() < REVERIFY_AFTER)
    }

    pub fn note_verified(&self, id: &pb::BlockId) {
        let mut m = lock(&self.verified);
        if m.len() >= MAX_VERIFIED {
            m.retain(|_, t| t.elapsed() < REVERIFY_AFTER);
            if m.len() >= MAX_VERIFIED {
                m.clear();
            }
        }
        m.insert((id.inode, id.version, id.index), Instant::now());
    }

    pub fn forget(&self, id: &pb::BlockId, window: u32) {
        lock(&self.leases).remove(&(block_key(id), window));
    }

    pub fn count_read(&self, worker_id: u64, bytes: u64) {
        *lock(&self.unreported).entry(worker_id).or_default() += bytes;
    }

    /// Takes the bytes to report to `worker_id`.
    pub fn take_unreported(&self, worker_id: u64) -> u64 {
        lock(&self.unreported).remove(&worker_id).unwrap_or(0)
    }

    /// Takes every worker's unreported bytes.
    pub fn take_all_unreported(&self) -> Vec<(u64, u64)> {
        lock(&self.unreported).drain().collect()
    }

    /// Gives back bytes whose report failed.
    pub fn unreport(&self, worker_id: u64, bytes: u64) {
        if bytes > 0 {
            self.count_read(worker_id, bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease over a three-byte block file, an empty lease table and block 0 of inode 7.
    fn one_block_lease() -> (tempfile::TempDir, LocalLease, ShortCircuit, pb::BlockId) {
        let (d, l) = lease_over(&[1, 2, 3], 4096, 60_000);
        let id = pb::BlockId {
            inode: 7,
            version: 1,
            index: 0,
        };
        (d, l, ShortCircuit::new("n".into()), id)
    }

    fn lease_over(data: &[u8], ps: u64, lease_ms: u64) -> (tempfile::TempDir, LocalLease) {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("block");
        std::fs::write(&path, data).unwrap();
        let l = lease_on(&path, data, ps, lease_ms);
        (d, l)
    }

    /// A new lease on the block file at `path` whose pages, when cached, held `data`.
    fn lease_on(path: &std::path::Path, data: &[u8], ps: u64, lease_ms: u64) -> LocalLease {
        let pages = data
            .chunks(ps as usize)
            .enumerate()
            .map(|(i, c)| pb::LocalPage {
                index: i as u32,
                length: c.len() as u32,
                crc32c: crc32c::crc32c(c),
            })
            .collect();
        let r = pb::LeaseLocalBlockResponse {
            path: path.to_string_lossy().into_owned(),
            page_size: ps,
            pages,
            lease_ms,
            lease_id: 1,
            window_pages: 16,
            ..Default::default()
        };
        LocalLease::open(1, &r, Instant::now()).unwrap()
    }

    #[test]
    fn a_page_checked_under_one_lease_is_read_in_part_under_the_next_without_its_whole() {
        use std::os::unix::fs::FileExt;
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("block");
        std::fs::write(&path, &data).unwrap();
        let checks = Arc::new(PageChecks::default());
        let id = pb::BlockId {
            inode: 3,
            version: 1,
            index: 0,
        };
        let first = lease_on(&path, &data, 4096, 60_000).checked_by(&id, checks.clone());
        assert_eq!(&first.read(0, 4096).unwrap()[..], &data[..4096]);
        // The page's tail rots on the disk, outside the part read next.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0xff; 16], 4000).unwrap();
        let next = lease_on(&path, &data, 4096, 60_000).checked_by(&id, checks.clone());
        assert_eq!(
            &next.read(100, 200).unwrap()[..],
            &data[100..300],
            "read alone: the first lease checked the page"
        );
        // Without the shared checks a part is read with its whole page, which fails.
        let alone = lease_on(&path, &data, 4096, 60_000);
        assert_eq!(alone.read(100, 200), Err(Miss::Bad));
        let other = pb::BlockId { inode: 4, ..id };
        let elsewhere = lease_on(&path, &data, 4096, 60_000).checked_by(&other, checks);
        assert_eq!(
            elsewhere.read(100, 200),
            Err(Miss::Bad),
            "another block's checks do not count"
        );
        // A page never checked is read whole and checked.
        assert_eq!(&next.read(5000, 100).unwrap()[..], &data[5000..5100]);
    }

    #[test]
    fn a_small_file_kept_open_reads_right_after_its_lease_and_never_wrong() {
        let data: Vec<u8> = (0..6_000u32).map(|i| (i * 13 % 251) as u8).collect();
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("block");
        std::fs::write(&path, &data).unwrap();
        // A lease that has already ended: what is kept does not depend on it.
        let sc = ShortCircuit::new("n".into());
        let id = pb::BlockId {
            inode: 7,
            version: 1,
            index: 0,
        };
        sc.keep(&id, Arc::new(lease_on(&path, &data, 4096, 0)));
        sc.keep_open(&id, data.len() as u64);
        assert_eq!(sc.take_done(1), vec![1], "the lease itself is given back");
        let kept = sc.kept(&id).expect("kept open");
        assert_eq!(&kept.read_kept(0, 6_000).unwrap()[..], &data[..]);
        assert_eq!(&kept.read_kept(4000, 200).unwrap()[..], &data[4000..4200]);
        // The worker evicts the block: the removed file still reads as it was, and the
        // sweep lets it go (its space is freed).
        std::fs::remove_file(&path).unwrap();
        assert_eq!(&kept.read_kept(100, 50).unwrap()[..], &data[100..150]);
        assert_eq!(sc.sweep_kept(), 1);
        assert!(sc.kept(&id).is_none());
        // A page punched out or written again in place fails its checksum: never served.
        std::fs::write(&path, &data).unwrap();
        sc.keep(&id, Arc::new(lease_on(&path, &data, 4096, 0)));
        sc.keep_open(&id, data.len() as u64);
        let kept = sc.kept(&id).unwrap();
        let mut other = data.clone();
        other[5000] ^= 1;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&other[4096..], 4096)
            .unwrap();
        assert_eq!(kept.read_kept(5000, 10), Err(Miss::Bad));
        assert_eq!(sc.sweep_kept(), 0, "not removed: kept until a read fails");
        // Only a file of one page, checked whole by a read, is handed out for passthrough.
        assert!(sc.kept_for_passthrough(&id).is_none(), "two pages");
        let small = pb::BlockId { inode: 9, ..id };
        let one = d.path().join("one");
        std::fs::write(&one, &data[..3000]).unwrap();
        sc.keep(&small, Arc::new(lease_on(&one, &data[..3000], 4096, 0)));
        sc.keep_open(&small, 3000);
        assert!(sc.kept_for_passthrough(&small).is_none(), "not checked yet");
        sc.kept(&small).unwrap().read_kept(0, 3000).unwrap();
        let (f, park) = sc.kept_for_passthrough(&small).expect("checked whole");
        assert!(park.usable(Instant::now()) && !park.removed());
        assert!(
            !park.usable(Instant::now() + REVERIFY_AFTER + Duration::from_secs(1)),
            "due for a new check"
        );
        std::fs::remove_file(&one).unwrap();
        assert!(park.removed(), "the worker removed the block file");
        std::fs::write(&one, &data[..3000]).unwrap();
        assert!(park.removed(), "another file in its place");
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut &f, &mut got).unwrap();
        assert_eq!(
            got,
            &data[..3000],
            "the removed file's bytes, through its own descriptor"
        );
        // A lease that lacked part of the file keeps nothing.
        let part = pb::BlockId { inode: 8, ..id };
        sc.keep(&part, Arc::new(lease_on(&path, &data[..4096], 4096, 0)));
        sc.keep_open(&part, data.len() as u64);
        assert!(sc.kept(&part).is_none());
    }

    #[test]
    fn reads_ranges_across_pages_and_checks_every_read() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (d, l) = lease_over(&data, 4096, 60_000);
        assert_eq!(&l.read(100, 5000).unwrap()[..], &data[100..5100]);
        assert_eq!(
            l.read(8192, 1809),
            Err(Miss::NotCached),
            "past the short last page"
        );
        assert_eq!(&l.read(0, 4096).unwrap()[..], &data[..4096]);
        // Whole pages, the short last one included, in one read.
        assert_eq!(&l.read(0, 10_000).unwrap()[..], &data[..]);
        // A page that rots on disk after it was read is caught by the next read.
        let mut bad = data.clone();
        bad[9000] ^= 0xff;
        bad[10] ^= 0xff;
        std::fs::write(d.path().join("block"), &bad).unwrap();
        assert_eq!(
            l.read(0, 4096),
            Err(Miss::Bad),
            "whole pages are checked on every read"
        );
        // A part of a page checked whole under this lease is read without its checksum
        // until the lease ends; the next lease checks the page again.
        assert_eq!(&l.read(9000, 1).unwrap()[..], &bad[9000..9001]);
        let fresh = lease_on(&d.path().join("block"), &data, 4096, 60_000);
        assert_eq!(fresh.read(9000, 1), Err(Miss::Bad));
        assert_eq!(fresh.read(10, 1), Err(Miss::Bad));
        assert_eq!(&fresh.read(4096, 10).unwrap()[..], &data[4096..4106]);
        std::fs::write(d.path().join("block"), &data).unwrap();
        assert_eq!(&l.read(8192, 1808).unwrap()[..], &data[8192..]);
    }

    #[test]
    fn an_unreachable_tier_leaves_the_other_tiers_of_the_worker_readable() {
        let sc = ShortCircuit::new("n".into());
        let mem = std::path::Path::new("/cache/memory/files/01/0000000000000001-0000000000000002");
        let nvme = std::path::Path::new("/cache/nvme/files/03/0000000000000003-0000000000000004");
        assert!(sc.reachable(mem) && sc.reachable(nvme));
        sc.mark_unreachable(mem);
        assert!(!sc.reachable(mem));
        assert!(!sc.reachable(std::path::Path::new(
            "/cache/memory/files/09/0000000000000009-0000000000000002"
        )));
        assert!(sc.reachable(nvme));
    }

    /// Found by a review: a lease could name any file of the node (`/etc/shadow`, the
    /// mount's TLS key) and the mount opened it and compared its pages with the lease's
    /// checksums. Only paths shaped as cache files are opened.
    #[test]
    fn only_paths_shaped_as_cache_files_are_opened() {
        let sc = ShortCircuit::new("n".into());
        let good = "/var/cache/granary/nvme/files/2a/00000000000000002a-000000000000000b";
        for bad in [
            "/etc/shadow",
            "/etc/granary/tls/tls.key",
            "relative/files/2a/000000000000002a-000000000000000b",
            "/cache/files/2a/../2a/000000000000002a-000000000000000b",
            "/cache/files/2b/000000000000002a-000000000000000b",
            "/cache/other/2a/000000000000002a-000000000000000b",
            "/cache/files/2A/000000000000002A-000000000000000b",
            "/cache/files/2a/000000000000002a_000000000000000b",
            "/cache/files/2a/000000000000002a-000000000000000b.tmp",
        ] {
            assert!(!sc.reachable(std::path::Path::new(bad)), "{bad}");
        }
        assert!(
            !ShortCircuit::cache_file_shaped(std::path::Path::new(good)),
            "17 digits"
        );
        let good = "/var/cache/granary/nvme/files/2a/000000000000002a-000000000000000b";
        assert!(sc.reachable(std::path::Path::new(good)));
    }

    #[test]
    fn a_lease_about_to_end_asks_for_renewal() {
        let (_d, l) = lease_over(&[1, 2, 3], 4096, 1_000);
        assert_eq!(l.read(0, 3), Err(Miss::Expiring));
    }

    #[test]
    fn a_full_lease_table_keeps_the_newest_leases() {
        let (_d, l) = lease_over(&[1, 2, 3], 4096, 60_000);
        let sc = ShortCircuit::new("n".into());
        let id = |i: u64| pb::BlockId {
            inode: i,
            version: 1,
            index: 0,
        };
        let total = MAX_LEASES as u64 + 10;
        for i in 0..total {
            let f = l.file().unwrap().try_clone().unwrap();
            let lease = LocalLease {
                worker_id: 1,
                id: i,
                first: 0,
                window: 16,
                file: OnceLock::from(f),
                path: l.path.clone(),
                base: 0,
                direct: None,
                page_size: 4096,
                pages: l.pages.clone(),
                verified: AtomicU64::new(0),
                checked_whole_ms: AtomicU64::new(0),
                until: l.until,
                taken: l.taken + Duration::from_millis(i),
                checks: None,
            };
            sc.keep(&id(i), Arc::new(lease));
        }
        // The oldest were dropped, the leases just taken (ahead of reads) are all kept.
        assert!(sc.lease(&id(0), 0).is_none());
        assert!((total - 700..total).all(|i| sc.lease(&id(i), 0).is_some()));
        assert!(lock(&sc.leases).len() <= MAX_LEASES);
    }

    #[test]
    fn whole_pages_read_directly_open_no_second_descriptor() {
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
        let (_d, l) = lease_over(&data, 4096, 60_000);
        if l.direct.is_none() {
            eprintln!("skipped: no O_DIRECT on the test's file system");
            return;
        }
        assert_eq!(&l.read(0, 8192).unwrap()[..], &data[..]);
        assert!(
            l.file.get().is_none(),
            "a read of whole pages opened the buffered descriptor"
        );
        assert_eq!(&l.read(10, 100).unwrap()[..], &data[10..110]);
        assert!(l.file.get().is_some(), "a part of a page is read buffered");
    }

    #[test]
    fn bytes_handed_out_stay_intact_while_their_thread_reads_on() {
        // Page 0 is all 1s, page 1 all 2s; reads reuse the thread's buffer once free.
        let data: Vec<u8> = (0..8192u32).map(|i| (i / 4096 + 1) as u8).collect();
        let (_d, l) = lease_over(&data, 4096, 60_000);
        for _ in 0..3 {
            let first = l.read(0, 4096).unwrap();
            let second = l.read(4096, 4096).unwrap();
            // Parts of pages: read through the page cache, into the same reused buffer.
            let third = l.read(10, 100).unwrap();
            let fourth = l.read(4106, 100).unwrap();
            assert!(
                first.iter().all(|&b| b == 1),
                "a later read overwrote held bytes"
            );
            assert!(second.iter().all(|&b| b == 2));
            assert!(third.len() == 100 && third.iter().all(|&b| b == 1));
            assert!(fourth.len() == 100 && fourth.iter().all(|&b| b == 2));
        }
    }

    #[test]
    fn each_window_keeps_its_lease_and_leases_far_behind_are_released() {
        let (_d, l, sc, id) = one_block_lease();
        let at = |window: u32, lease_id: u64| LocalLease {
            worker_id: 1,
            id: lease_id,
            first: window * LEASE_WINDOW_PAGES,
            window: LEASE_WINDOW_PAGES,
            file: OnceLock::from(l.file().unwrap().try_clone().unwrap()),
            path: l.path.clone(),
            base: 0,
            direct: None,
            page_size: 4096,
            pages: l.pages.clone(),
            verified: AtomicU64::new(0),
            checked_whole_ms: AtomicU64::new(0),
            until: l.until,
            taken: l.taken,
            checks: None,
        };
        sc.set_page_size(4096);
        assert_eq!(sc.window_of(16 * 4096 - 1), 0);
        assert_eq!(sc.window_of(16 * 4096), 1);
        sc.keep_ahead(&id, Arc::new(at(0, 10)));
        sc.keep_ahead(&id, Arc::new(at(1, 11)));
        // A reader in window 0 and a prefetch in window 1 do not replace each other's.
        assert_eq!(sc.lease(&id, 0).unwrap().id, 10);
        assert_eq!(sc.lease(&id, 1).unwrap().id, 11);
        // Window 2 (leased as the reader enters window 1): the read-ahead may still be
        // reading window 0, which stays.
        sc.keep_ahead(&id, Arc::new(at(2, 12)));
        assert!(sc.take_done(1).is_empty());
        assert_eq!(sc.lease(&id, 0).unwrap().id, 10);
        // Window 4: 2 and beyond stay, 0 and 1 are done with — unless in use.
        let reading = sc.lease(&id, 1).unwrap();
        sc.keep_ahead(&id, Arc::new(at(4, 14)));
        assert_eq!(sc.take_done(1), vec![10]);
        assert!(sc.lease(&id, 0).is_none());
        assert_eq!(sc.lease(&id, 1).unwrap().id, reading.id);
        assert_eq!(sc.lease(&id, 2).unwrap().id, 12);
        drop(reading);
        // The next block's first two windows keep the previous block (the reader may still
        // be in its last windows); its third releases it.
        let next = pb::BlockId { index: 1, ..id };
        sc.keep_ahead(&next, Arc::new(at(0, 20)));
        sc.keep_ahead(&next, Arc::new(at(1, 21)));
        assert!(sc.take_done(1).is_empty());
        sc.keep_ahead(&next, Arc::new(at(2, 22)));
        let mut done = sc.take_done(1);
        done.sort_unstable();
        assert_eq!(done, vec![11, 12, 14]);
        // A random reader's lease (not taken ahead) releases nothing.
        sc.keep(&next, Arc::new(at(9, 29)));
        assert!(sc.take_done(1).is_empty());
        // Closing the file releases the rest.
        sc.done_with_file(7, 1);
        let mut done = sc.take_done(1);
        done.sort_unstable();
        assert_eq!(done, vec![20, 21, 22, 29]);
        assert!(sc.lease(&next, 0).is_none() && sc.lease(&next, 1).is_none());
    }

    #[test]
    fn a_lease_in_use_is_not_released_when_its_file_closes() {
        let (_d, l, sc, id) = one_block_lease();
        sc.keep(&id, Arc::new(l));
        let reading = sc.lease(&id, 0).unwrap();
        sc.done_with(&id, 0);
        assert!(sc.take_done(1).is_empty(), "a read holds it");
        drop(reading);
        sc.done_with(&id, 0);
        assert_eq!(sc.take_done(1), vec![1]);
        assert!(sc.lease(&id, 0).is_none());
        assert!(sc.take_done(1).is_empty());
    }
}
