//! The filesystem callbacks.

use granary_client::ErrorCode;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    IoctlFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyOpen,
    ReplyStatfs, ReplyWrite, Request, WriteFlags,
};
use granary_client::FileSystem;
use granary_proto as pb;

use crate::error::errno;
use crate::handover::{Gate, Pass, Quiesce};
use crate::pagecache::PageCache;
use crate::FuseConfig;

mod dirs;
mod handles;
mod open;
use dirs::{DirHandle, DirWalk, Dirs};
pub use handles::Donor;
use handles::{tagged, OpenFiles, FH_WRITER};
use open::{small_via_lease, Passthrough};

/// The mount's deadline on an operation's network work: on expiry the operation fails (EIO),
/// is logged and counted, and the mount carries on; later operations start afresh.
#[derive(Clone)]
struct Deadline {
    limit: Duration,
    metrics: granary_client::metrics::ClientMetrics,
}

impl Deadline {
    /// [`run`](Self::run) on behalf of the process that made the request: the namespace
    /// requests carry its uid and gid (the master records them as the owner of what it
    /// creates, and checks the entries' modes against them).
    async fn run_as<T>(
        &self,
        caller: (u32, u32),
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, granary_client::ClientError>>,
    ) -> Result<T, granary_client::ClientError> {
        self.run(op, granary_client::as_caller(caller.0, caller.1, fut))
            .await
    }

    async fn run<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, granary_client::ClientError>>,
    ) -> Result<T, granary_client::ClientError> {
        let start = std::time::Instant::now();
        let res = tokio::time::timeout(self.limit, fut).await;
        self.metrics
            .op_seconds
            .0
            .get_or_create(&granary_client::metrics::Op { op: op.into() })
            .observe(start.elapsed().as_secs_f64());
        match res {
            Ok(r) => r,
            Err(_) => {
                self.metrics
                    .op_timeouts
                    .get_or_create(&granary_client::metrics::Op { op: op.into() })
                    .inc();
                tracing::warn!(op, limit = ?self.limit, "operation did not finish in time; answering EIO");
                Err(granary_client::ClientError::timeout(format!(
                    "{op} did not finish within {:?}",
                    self.limit
                )))
            }
        }
    }
}

/// First in every request handler: once the mount is being handed over to a successor that
/// cannot have the kernel resend (see [`Quiesce`]), this thread handles the request and
/// then parks.
macro_rules! quiesced {
    ($self:ident, $method:ident ( $($arg:expr),* )) => {
        if let Some(_parking) = $self.quiesce.enter() {
            return <Self as Filesystem>::$method($self, $($arg),*);
        }
    };
}

/// Largest read/readahead the kernel is asked to send (1 MiB requests).
pub(crate) const MAX_IO: u32 = 1024 * 1024;
/// The memory budget's unit.
pub(crate) const BUDGET_UNIT: u64 = 4096;
/// Longest file name, in bytes (as on Linux file systems; statfs says the same).
const NAME_MAX: usize = 255;
/// Cluster cache capacity, used bytes and inode count (what statfs reports).
type Capacity = (u64, u64, u64);

/// How long a statfs answer is reused.
const CAPACITY_TTL: Duration = Duration::from_secs(5);

/// Counters of the kernel's requests by kind (`granary_client_fuse_requests`).
struct Requests {
    lookup: Counter,
    getattr: Counter,
    open: Counter,
    read: Counter,
    release: Counter,
    flush: Counter,
    opendir: Counter,
    readdir: Counter,
    releasedir: Counter,
    statfs: Counter,
    access: Counter,
    write: Counter,
    other: Counter,
}

type Counter = granary_client::metrics::Count;

impl Requests {
    fn new(m: &granary_client::metrics::ClientMetrics) -> Self {
        let c = |op: &str| m.fuse_request_counter(op);
        Self {
            lookup: c("lookup"),
            getattr: c("getattr"),
            open: c("open"),
            read: c("read"),
            release: c("release"),
            flush: c("flush"),
            opendir: c("opendir"),
            readdir: c("readdir"),
            releasedir: c("releasedir"),
            statfs: c("statfs"),
            access: c("access"),
            write: c("write"),
            other: c("other"),
        }
    }
}

pub struct GranaryFs {
    client: Arc<FileSystem>,
    requests: Requests,
    rt: tokio::runtime::Handle,
    attr_ttl: Duration,
    entry_ttl: Duration,
    negative_ttl: Duration,
    /// The last cluster capacity answer for statfs: when, (capacity, used, files).
    capacity: Arc<Mutex<Option<(std::time::Instant, Capacity)>>>,
    uid: u32,
    gid: u32,
    next_fh: AtomicU64,
    /// This daemon's place in its mount's line of daemons (see [`crate::handover`]).
    generation: u32,
    /// Holds back opens, releases and changes while the mount is handed over.
    gate: Arc<Gate>,
    /// Stops the reader threads, each after the request it has, for a handover the kernel
    /// cannot resend.
    quiesce: Arc<Quiesce>,
    /// The kernel's INIT as this mount began, and what was granted (for a successor).
    kernel: Arc<Mutex<Option<pb::FuseHandover>>>,
    files: Arc<OpenFiles>,
    /// What the kernel's page cache holds of each file, and small files pushed into it.
    cache: Arc<PageCache>,
    /// Passthrough asked for and granted by the kernel at mount.
    passthrough: Arc<AtomicBool>,
    passthrough_wanted: bool,
    /// Smaller files are read through the daemon (see `FuseConfig::passthrough_min_size`).
    passthrough_min: u64,
    /// The kernel's backing file of each inode open in passthrough mode (one per inode, as
    /// the kernel requires), its version and how many handles use it.
    backings: Arc<Mutex<crate::backing::Backings>>,
    deadline: Deadline,
    /// The memory budget of reads in flight, in 4 KiB units (`--max-memory`).
    budget: Arc<tokio::sync::Semaphore>,
    /// Open handles in passthrough mode: fh → inode (the leases go with the inode's
    /// backing, see `backing::Backings`).
    passthrough_fhs: Arc<Mutex<HashMap<u64, u64>>>,
    dirs: Dirs,
    /// Folders opened in their parent's order, and a first page asked for ahead.
    walk: Arc<DirWalk>,
    /// Files open for writing, and the mount's write settings.
    writes: crate::write::Writes,
    read_only: bool,
    /// The memory budget as prefetch uses it: the same semaphore, half left to reads.
    prefetch_budget: crate::prefetch::Budget,
    /// Adaptive prefetch state of each open file handle.
    readahead: Arc<Mutex<HashMap<u64, Arc<Mutex<crate::prefetch::Readahead>>>>>,
    /// Handles of an earlier daemon found stale or not a file's, and how they are answered
    /// (see `file_of`); at most [`DEAD_FHS`].
    dead_fhs: Mutex<HashMap<u64, Errno>>,
}

/// Handles of earlier daemons remembered as stale at most (all are forgotten past this).
const DEAD_FHS: usize = 4096;

/// How long an open for writing waits for passthrough readers' closes to reach the daemon
/// before it is refused with EBUSY.
const RELEASE_WAIT: Duration = Duration::from_secs(1);

/// How long an open waits for the pages of another version of its file to be stored
/// (a push of the old version ending) before it fails with EIO.
const STORING_WAIT: Duration = Duration::from_secs(30);

/// Ends an open of `s` for reading: the handle's status is kept, and the kernel keeps its
/// page cache of the file when the pages it may hold are of this version. Waits (on the
/// runtime) while pages of another version of the file are being stored.
fn opened_file(
    cache: &Arc<PageCache>,
    files: &Arc<OpenFiles>,
    (pt, quiesce): (Passthrough, &Arc<Quiesce>),
    fh: u64,
    s: pb::FileStatus,
    reply: ReplyOpen,
) {
    let fh = tagged(fh, s.version);
    let Some(keep) = cache.open(&s) else {
        let (cache, files, q) = (cache.clone(), files.clone(), quiesce.clone());
        // Counted as a reply in flight (a handover waits for it) and bounded: the
        // program's open is answered whatever the push storing the other version does.
        cache.runtime().clone().spawn(quiesce.track(async move {
            let waited = tokio::time::timeout(STORING_WAIT, async {
                while cache.storing_other_version(&s) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await;
            if waited.is_err() {
                tracing::warn!(inode = s.inode, path = %s.path, "an open waited too long for the pages of another version of the file to be stored");
                return reply.error(Errno::EIO);
            }
            opened_file(&cache, &files, (pt, &q), fh, s, reply);
        }));
        return;
    };
    // Another handle of the file reads it in passthrough: this one must name the same
    // backing file (the kernel fails a cached open of it with EIO).
    let joined =
        lock(&pt.backings).open_registered_or_cached(&pt.on, (s.inode, s.version), &reply, fh);
    let Ok(joined) = joined else {
        tracing::warn!(inode = s.inode, path = %s.path, "a file changed while a program holds an older version of it open in passthrough: it opens again once that program closes it (EBUSY)");
        return reply.error(Errno::EBUSY);
    };
    if let Some(id) = joined {
        open::enter_passthrough(&pt.fhs, files, fh, s);
        reply.opened_passthrough(FileHandle(fh), FopenFlags::FOPEN_NOFLUSH, &id);
        return;
    }
    let flags = if keep {
        FopenFlags::FOPEN_KEEP_CACHE
    } else {
        FopenFlags::empty()
    };
    files.insert(fh, Arc::new(s));
    // Nothing to flush in a read-only handle: the kernel skips the FLUSH round trip at
    // every close (Linux 5.16+; older kernels ignore the flag).
    reply.opened(FileHandle(fh), flags | FopenFlags::FOPEN_NOFLUSH);
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn kind_of(s: &pb::FileStatus) -> FileType {
    if s.kind == pb::FileKind::Directory as i32 {
        FileType::Directory
    } else {
        FileType::RegularFile
    }
}

impl GranaryFs {
    pub fn new(client: Arc<FileSystem>, config: &FuseConfig, rt: tokio::runtime::Handle) -> Self {
        let metrics = client.metrics.clone();
        let budget_units =
            (config.max_memory / BUDGET_UNIT).clamp(MAX_IO as u64 / BUDGET_UNIT, 1 << 40);
        let budget = Arc::new(tokio::sync::Semaphore::new(budget_units as usize));
        use std::os::unix::fs::MetadataExt;
        let (uid, gid) = std::fs::metadata("/proc/self")
            .map(|m| (m.uid(), m.gid()))
            .unwrap_or((0, 0));
        let writes = crate::write::Writes::for_mount(client.clone(), config, budget.clone());
        let prefetch_budget = crate::prefetch::Budget {
            memory: budget.clone(),
            unit: BUDGET_UNIT,
            reserve: (budget_units / 2).min(u64::from(u32::MAX)) as u32,
        };
        let written = writes.clone();
        let cache = PageCache::new(
            client.clone(),
            rt.clone(),
            config.push_ahead,
            config.push_max_size.min(if config.passthrough {
                config.passthrough_min_size.saturating_sub(1)
            } else {
                u64::MAX
            }),
            prefetch_budget.clone(),
            Box::new(move |inode| written.size_of(inode).is_some()),
        );
        let backings = Arc::new(Mutex::new(crate::backing::Backings::new(
            client.metrics.clone(),
        )));
        crate::backing::spawn_sweeper(
            &rt,
            Arc::downgrade(&backings),
            granary_client::local::KEPT_SWEEP_EVERY,
        );
        Self {
            client: client.clone(),
            requests: Requests::new(&client.metrics),
            rt: rt.clone(),
            attr_ttl: config.attr_timeout,
            entry_ttl: config.entry_timeout,
            negative_ttl: config.negative_timeout,
            capacity: Arc::new(Mutex::new(None)),
            uid,
            gid,
            next_fh: AtomicU64::new(1),
            generation: config.generation,
            gate: Arc::new(Gate::default()),
            quiesce: Quiesce::new(config.threads),
            kernel: Arc::new(Mutex::new(None)),
            files: Arc::new(OpenFiles::new(client.metrics.fuse_open_files.clone())),
            cache: Arc::new(cache),
            passthrough: Arc::new(AtomicBool::new(false)),
            passthrough_wanted: config.passthrough,
            passthrough_min: config.passthrough_min_size,
            backings,
            passthrough_fhs: Arc::new(Mutex::new(HashMap::new())),
            dead_fhs: Mutex::new(HashMap::new()),
            budget: budget.clone(),
            deadline: Deadline {
                limit: config.op_timeout,
                metrics: metrics.clone(),
            },
            dirs: Default::default(),
            walk: Arc::new(DirWalk::default()),
            writes,
            read_only: config.read_only,
            readahead: Arc::new(Mutex::new(HashMap::new())),
            prefetch_budget,
        }
    }

    /// Answers a request from a task (counted while in flight: see [`Quiesce`]).
    fn spawn<F>(&self, reply: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.rt.spawn(self.quiesce.track(reply));
    }

    /// What the mount knows of the kernel's page cache (it needs the mount's channel to
    /// the kernel once mounted).
    fn pt(&self) -> Passthrough {
        Passthrough {
            on: self.passthrough.clone(),
            backings: self.backings.clone(),
            fhs: self.passthrough_fhs.clone(),
            files: self.files.clone(),
        }
    }

    pub(crate) fn page_cache(&self) -> Arc<PageCache> {
        self.cache.clone()
    }

    /// A name the kernel passed, checked: ENAMETOOLONG, or ENOENT when not UTF-8.
    fn name_of(name: &OsStr) -> Result<String, Errno> {
        if name.len() > NAME_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        name.to_str().map(str::to_string).ok_or(Errno::ENOENT)
    }

    /// Refuses a change on a read-only mount.
    fn writable(&self) -> Result<(), Errno> {
        if self.read_only {
            Err(Errno::EROFS)
        } else {
            Ok(())
        }
    }
}

/// The kernel's attributes of an entry: its owner when it has one (its own, or its
/// mount's `uid`/`gid`), else the mount daemon's (`uid`, `gid`).
fn attr_of(s: &pb::FileStatus, uid: u32, gid: u32) -> FileAttr {
    let (uid, gid) = if s.has_owner {
        (s.uid, s.gid)
    } else {
        (uid, gid)
    };
    let kind = kind_of(s);
    let mtime = if s.mtime_ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(s.mtime_ms as u64)
    } else {
        UNIX_EPOCH
    };
    let default_perm = if kind == FileType::Directory {
        0o755
    } else {
        0o644
    };
    let perm = if s.mode == 0 {
        default_perm
    } else {
        (s.mode & 0o7777) as u16
    };
    FileAttr {
        ino: INodeNo(s.inode),
        size: s.length,
        blocks: s.length.div_ceil(512),
        atime: mtime,
        mtime,
        ctime: mtime,
        crtime: mtime,
        kind,
        perm,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid,
        gid,
        rdev: 0,
        blksize: MAX_IO,
        flags: 0,
    }
}

impl Filesystem for GranaryFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // The kernel's offer, kept for a successor daemon (see `crate::handover`).
        let kernel_readahead = config.set_max_readahead(MAX_IO).unwrap_or_else(|n| n);
        let offered = config.capabilities();
        let _ = config.set_max_write(MAX_IO);
        // O_TRUNC arrives with the open (else the kernel truncates by setattr first, which
        // a whole-object write cannot tell from a resize).
        let _ = config.add_capabilities(InitFlags::FUSE_ATOMIC_O_TRUNC);
        // Listings carry attributes; the kernel decides per directory whether to ask.
        let _ = config
            .add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
        if self.passthrough_wanted {
            match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
                Ok(()) => {
                    let _ = config.set_max_stack_depth(1);
                    self.passthrough.store(true, Ordering::Relaxed);
                    tracing::info!("FUSE passthrough on: fully cached files on this node's worker bypass the daemon");
                }
                Err(_) => tracing::info!(
                    "the kernel offers no FUSE passthrough (Linux 6.9+); reads go through the daemon"
                ),
            }
        }
        let passthrough = self.passthrough.load(Ordering::Relaxed);
        // A successor is offered what this daemon was, less passthrough when it was not
        // granted (the kernel would refuse a successor's passthrough opens).
        let flags = if passthrough {
            offered
        } else {
            offered - InitFlags::FUSE_PASSTHROUGH
        };
        let abi = config.kernel_abi();
        *lock(&self.kernel) = Some(pb::FuseHandover {
            kernel_major: abi.0,
            kernel_minor: abi.1,
            kernel_flags: flags.bits(),
            max_readahead: kernel_readahead,
            passthrough,
            ..Default::default()
        });
        self.client
            .metrics
            .fuse_generation
            .set(i64::from(self.generation));
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        quiesced!(self, lookup(req, parent, name, reply));
        self.requests.lookup.inc();
        self.note_resent(req);
        let caller = (req.uid(), req.gid());
        if name.len() > NAME_MAX {
            reply.error(Errno::ENAMETOOLONG);
            return;
        }
        let Some(name) = name.to_str().map(str::to_string) else {
            reply.error(Errno::ENOENT);
            return;
        };
        let (ttl, uid, gid) = (self.entry_ttl, self.uid, self.gid);
        // A name from a fresh listing: answered here, without a hop to the runtime.
        if let Some(s) = self.client.lookup_fresh(parent.0, &name) {
            reply.entry(&ttl, &attr_of(&s, uid, gid), Generation(0));
            return;
        }
        let client = self.client.clone();
        let negative = self.negative_ttl;
        let dl = self.deadline.clone();
        self.spawn(async move {
            match dl
                .run_as(caller, "lookup", client.lookup_cached(parent.0, &name))
                .await
            {
                Ok(s) => reply.entry(&ttl, &attr_of(&s, uid, gid), Generation(0)),
                // A negative entry (node id 0): the kernel remembers the miss for a while.
                Err(e) if e.code() == ErrorCode::NotFound && !negative.is_zero() => {
                    let mut none = attr_of(&pb::FileStatus::default(), uid, gid);
                    none.ino = INodeNo(0);
                    reply.entry(&negative, &none, Generation(0))
                }
                Err(e) => {
                    if e.code() != ErrorCode::NotFound {
                        tracing::warn!(parent = parent.0, %name, error = %e, "lookup failed");
                    }
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn getattr(&self, req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        quiesced!(self, getattr(req, ino, _fh, reply));
        self.requests.getattr.inc();
        self.note_resent(req);
        let (ttl, uid, gid) = (self.attr_ttl, self.uid, self.gid);
        // A file's status seen within the attribute timeout (a listing, a lookup, an open):
        // answered here, without a hop to the runtime — the staleness lookups and opens
        // already allow. Not a folder (the kernel asks after changing its entries) nor a
        // file being written through this mount.
        if self.writes.size_of(ino.0).is_none() {
            if let Some(s) = self.client.cached_open_status(ino.0) {
                if s.kind == pb::FileKind::File as i32 {
                    reply.attr(&ttl, &attr_of(&s, uid, gid));
                    return;
                }
            }
            // A folder, only when the namespace watch vouches for it.
            if let Some(s) = self.client.watched_dir_status(ino.0) {
                reply.attr(&ttl, &attr_of(&s, uid, gid));
                return;
            }
        }
        let client = self.client.clone();
        let dl = self.deadline.clone();
        let writes = self.writes.clone();
        self.spawn(async move {
            match dl.run("getattr", client.stat_inode(ino.0)).await {
                Ok(mut s) => {
                    // Being written through this mount: its size so far.
                    if let Some(n) = writes.size_of(ino.0) {
                        s.length = n;
                    }
                    reply.attr(&ttl, &attr_of(&s, uid, gid))
                }
                Err(e) => {
                    tracing::warn!(inode = ino.0, error = %e, "getattr failed");
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        quiesced!(self, open(req, ino, flags, reply));
        self.requests.open.inc();
        self.note_resent(req);
        let pass = self.gate.pass();
        if flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0 {
            self.open_for_write(ino, flags, reply, pass);
            return;
        }
        let fh = self.new_fh();
        let pt_min = self.passthrough_min;
        // A file whose status is fresh and that will not be opened in passthrough: answer on
        // this thread (a hop to the runtime costs more than the rest of the open).
        let mut reply = reply;
        let mut small_checked = None;
        if let Some(s) = self.client.cached_open_status(ino.0) {
            let pt = self.passthrough.load(Ordering::Relaxed);
            if s.kind == pb::FileKind::File as i32 && pt && s.length < pt_min {
                // A small file read before: the kernel reads its block file directly (no
                // READ requests, no copy through the daemon).
                match self.open_kept_passthrough(&s, fh, reply) {
                    None => return,
                    Some(r) => reply = r,
                }
            }
            if s.kind == pb::FileKind::File as i32 {
                let via_lease =
                    pt && (s.length >= pt_min || small_via_lease(&self.client, &self.writes, &s));
                if !via_lease {
                    return opened_file(
                        &self.cache,
                        &self.files,
                        (self.pt(), &self.quiesce),
                        fh,
                        s,
                        reply,
                    );
                }
                small_checked = Some(s.inode);
            }
        }
        let client = self.client.clone();
        let files = self.files.clone();
        let cache = self.cache.clone();
        let writes = self.writes.clone();
        let pt = self.pt();
        let dl = self.deadline.clone();
        let quiesce = self.quiesce.clone();
        self.spawn(async move {
            let _pass = pass; // held until the reply is sent
            match dl.run("open", client.open_inode(ino.0)).await {
                Ok(s) if s.kind == pb::FileKind::Directory as i32 => reply.error(Errno::EISDIR),
                Ok(s) => {
                    let fh = tagged(fh, s.version);
                    // A file being written here is not opened in passthrough (its
                    // writer's handle holds the kernel's cached I/O mode).
                    let via_lease = writes.size_of(s.inode).is_none()
                        && (s.length >= pt_min
                            || small_checked == Some(s.inode)
                            || small_via_lease(&client, &writes, &s));
                    let (reply, s) = if pt.on.load(Ordering::Relaxed) && via_lease {
                        match pt.try_open(&client, s, fh, reply).await {
                            Some(back) => back,
                            None => return,
                        }
                    } else {
                        (reply, s)
                    };
                    opened_file(&cache, &files, (pt, &quiesce), fh, s, reply);
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        quiesced!(
            self,
            read(req, ino, fh, offset, size, _flags, _lock_owner, reply)
        );
        self.requests.read.inc();
        self.note_resent(req);
        let file = match self.file_of(ino.0, fh.0) {
            Ok(f) => f,
            Err(e) => return reply.error(e),
        };
        // Warm data on this node: from a push reading the file now, else under a
        // short-circuit lease, read on this thread.
        let leased = self.cache.pushed_bytes(&file, offset, size).or_else(|| {
            let _rt = self.rt.enter(); // leases of the files ahead are asked for from a task
            self.client.read_leased(&file, offset, u64::from(size))
        });
        if let Some(data) = leased {
            reply.data(&data);
            if offset == 0 {
                self.cache.read_from_start(&file);
            }
            return;
        }
        // A sequential reader's bytes may already be fetched ahead (in flight or done).
        let ra = lock(&self.readahead).entry(fh.0).or_default().clone();
        let ahead = {
            let _rt = self.rt.enter(); // prefetches are spawned on the runtime
            lock(&ra).read(
                &self.client,
                &file,
                &self.prefetch_budget,
                offset,
                u64::from(size),
            )
        };
        if let Some(parts) = ahead {
            let dl = self.deadline.clone();
            let client = self.client.clone();
            self.spawn(async move {
                match dl.run("read", crate::prefetch::assemble(parts)).await {
                    Ok(data) => {
                        client.metrics.prefetch_hit_bytes.inc_by(data.len() as u64);
                        reply.data(&data)
                    }
                    Err(e) => {
                        lock(&ra).forget();
                        tracing::error!(inode = ino.0, path = %file.path, offset, size, error = %e, "read failed");
                        reply.error(errno(&e))
                    }
                }
            });
            return;
        }
        let client = self.client.clone();
        let dl = self.deadline.clone();
        let budget = self.budget.clone();
        self.spawn(async move {
            // The read's buffer comes out of the mount's memory budget (waiting for room
            // counts against the deadline); the permit is held until the reply is sent.
            let units = u64::from(size).div_ceil(BUDGET_UNIT).max(1) as u32;
            let read = async {
                let permit = budget
                    .acquire_many_owned(units)
                    .await
                    .map_err(|e| granary_client::ClientError::internal(e.to_string()))?;
                let data = client.read(&file, offset, u64::from(size)).await?;
                Ok((permit, data))
            };
            match dl.run("read", read).await {
                Ok((_permit, data)) => reply.data(&data),
                Err(e) => {
                    tracing::error!(inode = ino.0, path = %file.path, offset, size, error = %e, "read failed");
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn release(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        quiesced!(
            self,
            release(req, _ino, fh, _flags, _lock_owner, _flush, reply)
        );
        self.requests.release.inc();
        self.note_resent(req);
        let _pass = self.gate.pass();
        let file = self.files.remove(fh.0);
        self.forget_dead(fh.0);
        lock(&self.readahead).remove(&fh.0); // frees what was fetched ahead
        self.writes.release(fh.0, &self.rt);
        let passthrough = lock(&self.passthrough_fhs).remove(&fh.0);
        if let Some(file) = file {
            self.client.closed(&file);
        }
        if passthrough.is_none() {
            // Also a handle of a crashed daemon never used since (known from the holder).
            lock(&self.backings).closed_cached(fh.0);
        }
        if let Some(inode) = passthrough {
            let leases = lock(&self.backings).close(inode, fh.0);
            if !leases.is_empty() {
                let _rt = self.rt.enter(); // the lease releases are sent from tasks
                for handle in leases {
                    self.client.close_passthrough(handle);
                }
            }
        }
        reply.ok();
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        quiesced!(self, opendir(req, ino, _flags, reply));
        self.requests.opendir.inc();
        self.note_resent(req);
        let client = self.client.clone();
        let dirs = self.dirs.clone();
        let walk = self.walk.clone();
        let fh = self.new_fh();
        if let Err(e) = lock(&self.dirs).take(fh, req.uid()) {
            return reply.error(e);
        }
        let dl = self.deadline.clone();
        self.spawn(async move {
            let ahead = walk.opened(&client, ino.0);
            let opened = async {
                // A folder's status the namespace watch vouches for needs no round trip
                // (a `find` opens every folder right after listing its parent).
                let dir = match client.watched_dir_status(ino.0) {
                    Some(s) => s,
                    None => client.stat_inode(ino.0).await?,
                };
                if dir.kind != pb::FileKind::Directory as i32 {
                    return Err(granary_client::ClientError::posix(
                        libc::ENOTDIR,
                        format!("{} is not a directory", dir.path),
                    ));
                }
                let mut h = DirHandle::new(dir, walk);
                // The first page now (or the one asked for ahead): a listing that fails
                // fails the open.
                let asked_ahead = ahead.is_some();
                h.ahead = ahead;
                if let Err(e) = h.fetch_page(&client, ino.0).await {
                    // A page asked for ahead that failed is asked for again, now.
                    if !asked_ahead {
                        return Err(e);
                    }
                    h.fetch_page(&client, ino.0).await?;
                }
                Ok(h)
            };
            match dl.run("opendir", opened).await {
                Ok(h) => {
                    lock(&dirs).insert(fh, Arc::new(tokio::sync::Mutex::new(h)));
                    reply.opened(FileHandle(fh), FopenFlags::empty());
                }
                Err(e) => {
                    tracing::warn!(inode = ino.0, error = %e, "listing failed");
                    lock(&dirs).remove(&fh);
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        quiesced!(self, readdir(req, ino, fh, offset, reply));
        self.requests.readdir.inc();
        self.note_resent(req);
        let h = match self.dir_of(ino.0, fh.0) {
            Ok(h) => h,
            Err(e) => return reply.error(e),
        };
        let client = self.client.clone();
        let dl = self.deadline.clone();
        self.spawn(async move {
            let mut h = h.lock().await;
            if let Err(e) = dl
                .run("readdir", h.fetch_past(&client, ino.0, offset))
                .await
            {
                return reply.error(errno(&e));
            }
            for (next, e) in h.from(offset) {
                let s = &e.status;
                if reply.add(INodeNo(s.inode), next, kind_of(s), e.name()) {
                    break;
                }
            }
            reply.ok();
        });
    }

    /// Entries with their attributes (the kernel then needs no lookup per entry: `ls -l`
    /// and `os.scandir` + `stat` cost one listing).
    fn readdirplus(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: fuser::ReplyDirectoryPlus,
    ) {
        quiesced!(self, readdirplus(req, ino, fh, offset, reply));
        self.requests.readdir.inc();
        self.note_resent(req);
        let h = match self.dir_of(ino.0, fh.0) {
            Ok(h) => h,
            Err(e) => return reply.error(e),
        };
        let client = self.client.clone();
        let dl = self.deadline.clone();
        let (ttl, uid, gid) = (self.entry_ttl, self.uid, self.gid);
        let writes = self.writes.clone();
        self.spawn(async move {
            let mut h = h.lock().await;
            if let Err(e) = dl
                .run("readdir", h.fetch_past(&client, ino.0, offset))
                .await
            {
                return reply.error(errno(&e));
            }
            for (next, e) in h.from(offset) {
                let (s, name) = (&e.status, e.name());
                let mut attr = attr_of(s, uid, gid);
                if let Some(n) = writes.size_of(s.inode) {
                    attr.size = n;
                }
                if reply.add(INodeNo(s.inode), next, name, &ttl, &attr, Generation(0)) {
                    break;
                }
            }
            reply.ok();
        });
    }

    fn releasedir(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        quiesced!(self, releasedir(req, _ino, fh, _flags, reply));
        self.requests.releasedir.inc();
        self.note_resent(req);
        lock(&self.dirs).remove(&fh.0);
        reply.ok();
    }

    /// Answered from the cluster capacity fetched at most [`CAPACITY_TTL`] ago (`df` and
    /// training launchers call statfs often); a failed refresh answers the last known.
    fn statfs(&self, req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        quiesced!(self, statfs(req, _ino, reply));
        self.requests.statfs.inc();
        self.note_resent(req);
        const BSIZE: u64 = 4096;
        let answer = |reply: ReplyStatfs, (cap, used, files): (u64, u64, u64)| {
            let blocks = cap / BSIZE;
            let free = cap.saturating_sub(used) / BSIZE;
            reply.statfs(
                blocks,
                free,
                free,
                files,
                0,
                BSIZE as u32,
                NAME_MAX as u32,
                BSIZE as u32,
            );
        };
        let cached = *lock(&self.capacity);
        if let Some((at, v)) = cached {
            if at.elapsed() < CAPACITY_TTL {
                return answer(reply, v);
            }
        }
        let client = self.client.clone();
        let dl = self.deadline.clone();
        let capacity = self.capacity.clone();
        self.spawn(async move {
            match dl.run("statfs", client.master.cluster_info(false)).await {
                Ok(info) => {
                    let stats = || info.workers.iter().filter_map(|w| w.stats.as_ref());
                    let v = (
                        stats().map(|s| s.capacity_bytes).sum(),
                        stats().map(|s| s.used_bytes).sum(),
                        info.inode_count,
                    );
                    *lock(&capacity) = Some((std::time::Instant::now(), v));
                    answer(reply, v)
                }
                Err(_) => answer(reply, cached.map(|(_, v)| v).unwrap_or((0, 0, 0))),
            }
        });
    }

    fn access(&self, req: &Request, _ino: INodeNo, mask: fuser::AccessFlags, reply: ReplyEmpty) {
        quiesced!(self, access(req, _ino, mask, reply));
        self.requests.access.inc();
        self.note_resent(req);
        if mask.contains(fuser::AccessFlags::W_OK) && self.read_only {
            reply.error(Errno::EROFS);
        } else {
            reply.ok();
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        quiesced!(self, create(req, parent, name, mode, umask, _flags, reply));
        self.requests.other.inc();
        self.note_resent(req);
        let pass = self.gate.pass();
        let name = match self.writable().and_then(|()| Self::name_of(name)) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let caller = (req.uid(), req.gid());
        let writes = self.writes.clone();
        let fh = self.new_fh() | FH_WRITER;
        let (ttl, uid, gid) = (self.entry_ttl, self.uid, self.gid);
        let dl = self.deadline.clone();
        self.spawn(async move {
            let _pass = pass; // held until the reply is sent
            let open = async {
                let path = writes.child_path(parent.0, &name).await?;
                let dir = writes.client.stat_inode(parent.0).await?;
                let Some(mount) = dir.ufs.as_ref().map(|u| u.mount_id) else {
                    return Err(granary_client::ClientError::posix(
                        libc::EROFS,
                        format!("{path}: files can only be written inside a mounted under-store"),
                    ));
                };
                let mount = Some(mount);
                writes
                    .open(fh, &path, mode & !umask & 0o7777, false, mount)
                    .await
            };
            match dl.run_as(caller, "create", open).await {
                Ok(s) => reply.created(
                    &ttl,
                    &attr_of(&s, uid, gid),
                    Generation(0),
                    FileHandle(fh),
                    FopenFlags::FOPEN_DIRECT_IO,
                ),
                Err(e) => {
                    tracing::warn!(parent = parent.0, %name, error = %e, "create failed");
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        quiesced!(
            self,
            write(
                req,
                _ino,
                fh,
                offset,
                data,
                _write_flags,
                _flags,
                _lock_owner,
                reply
            )
        );
        self.requests.write.inc();
        self.note_resent(req);
        let Some(h) = self.writes.handle(fh.0) else {
            return reply.error(if self.lost_writer(fh.0) {
                Errno::EIO
            } else {
                Errno::EBADF
            });
        };
        let data = bytes::Bytes::copy_from_slice(data);
        let writes = self.writes.clone();
        self.spawn(async move {
            match writes.write(&h, offset, data).await {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(e),
            }
        });
    }

    fn flush(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        quiesced!(self, flush(req, _ino, fh, _lock_owner, reply));
        self.requests.flush.inc();
        self.note_resent(req);
        self.on_writer(fh, reply, |w, h| async move { w.flush(&h).await });
    }

    fn fsync(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        quiesced!(self, fsync(req, _ino, fh, _datasync, reply));
        self.requests.other.inc();
        self.note_resent(req);
        self.on_writer(fh, reply, |w, h| async move { w.fsync(&h).await });
    }

    /// No ioctl is supported: a regular file's answer, `ENOTTY`, on this thread. Python's
    /// `open()` asks every file it opens whether it is a terminal (`TCGETS`), and the
    /// kernel forwards each such call (fuser's default answer also logged a warning per call).
    fn ioctl(
        &self,
        req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        quiesced!(
            self,
            ioctl(req, _ino, _fh, _flags, _cmd, _in_data, _out_size, reply)
        );
        self.requests.other.inc();
        self.note_resent(req);
        reply.error(Errno::ENOTTY);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        quiesced!(self, mkdir(req, parent, name, mode, umask, reply));
        self.requests.other.inc();
        self.note_resent(req);
        let pass = self.gate.pass();
        let name = match self.writable().and_then(|()| Self::name_of(name)) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let caller = (req.uid(), req.gid());
        let writes = self.writes.clone();
        let (ttl, uid, gid) = (self.entry_ttl, self.uid, self.gid);
        let dl = self.deadline.clone();
        self.spawn(async move {
            let _pass = pass; // held until the reply is sent
            let made = async {
                let path = writes.child_path(parent.0, &name).await?;
                writes
                    .client
                    .master
                    .mkdir(&path, false, mode & !umask & 0o7777)
                    .await
            };
            match dl.run_as(caller, "mkdir", made).await {
                Ok(s) => reply.entry(&ttl, &attr_of(&s, uid, gid), Generation(0)),
                Err(e) => {
                    tracing::warn!(parent = parent.0, %name, error = %e, "mkdir failed");
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        quiesced!(self, unlink(req, parent, name, reply));
        self.requests.other.inc();
        self.note_resent(req);
        self.remove((req.uid(), req.gid()), parent, name, false, reply);
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        quiesced!(self, rmdir(req, parent, name, reply));
        self.requests.other.inc();
        self.note_resent(req);
        self.remove((req.uid(), req.gid()), parent, name, true, reply);
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        quiesced!(
            self,
            rename(req, parent, name, newparent, newname, flags, reply)
        );
        self.requests.other.inc();
        self.note_resent(req);
        let pass = self.gate.pass();
        let names = self
            .writable()
            .and_then(|()| Ok((Self::name_of(name)?, Self::name_of(newname)?)));
        let (name, newname) = match names {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        if flags.contains(RenameFlags::RENAME_EXCHANGE)
            || flags.contains(RenameFlags::RENAME_WHITEOUT)
        {
            return reply.error(Errno::EINVAL);
        }
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let caller = (req.uid(), req.gid());
        let writes = self.writes.clone();
        let cache = self.cache.clone();
        let dl = self.deadline.clone();
        self.spawn(async move {
            let _pass = pass; // held until the reply is sent
            let moved = async {
                let src = writes.child_path(parent.0, &name).await?;
                let dst = writes.child_path(newparent.0, &newname).await?;
                if noreplace {
                    match writes.client.lookup(newparent.0, &newname).await {
                        Ok(_) => {
                            return Err(granary_client::ClientError::already_exists(dst));
                        }
                        Err(e) if e.code() == ErrorCode::NotFound => {}
                        Err(e) => return Err(e),
                    }
                }
                let moved = writes.client.master.rename(&src, &dst).await?;
                writes.client.forget_status(moved.inode);
                Ok(moved)
            };
            match dl.run_as(caller, "rename", moved).await {
                Ok(s) => {
                    cache.forget(s.inode);
                    reply.ok()
                }
                Err(e) => {
                    tracing::warn!(%name, %newname, error = %e, "rename failed");
                    reply.error(errno(&e))
                }
            }
        });
    }

    /// Sizes: only what the file already has (a truncate to 0 of a file being written from
    /// its start, `ftruncate` to the current size); anything else is EOPNOTSUPP. Mode,
    /// owner and times are accepted and not stored (the under-store has no place for them;
    /// `cp -p` and `touch` keep working).
    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        quiesced!(
            self,
            setattr(
                req, ino, _mode, _uid, _gid, size, _atime, _mtime, _ctime, _fh, _crtime, _chgtime,
                _bkuptime, _flags, reply
            )
        );
        self.requests.other.inc();
        self.note_resent(req);
        let pass = self.gate.pass();
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let client = self.client.clone();
        let writes = self.writes.clone();
        let (ttl, uid, gid) = (self.attr_ttl, self.uid, self.gid);
        let dl = self.deadline.clone();
        self.spawn(async move {
            let _pass = pass; // held until the reply is sent
            match dl.run("setattr", client.stat_inode(ino.0)).await {
                Ok(mut s) => {
                    if let Some(n) = writes.size_of(ino.0) {
                        s.length = n;
                    }
                    if size.is_some_and(|n| n != s.length) {
                        tracing::warn!(inode = ino.0, path = %s.path, from = s.length, to = ?size, "resizing a file is not supported");
                        return reply.error(Errno::EOPNOTSUPP);
                    }
                    reply.attr(&ttl, &attr_of(&s, uid, gid))
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }
}

impl GranaryFs {
    /// Runs `op` on the write handle `fh` in a task and replies with its outcome; a handle
    /// that is not being written (a reader's) has nothing to do: ok.
    fn on_writer<F, Fut>(&self, fh: FileHandle, reply: ReplyEmpty, op: F)
    where
        F: FnOnce(crate::write::Writes, Arc<tokio::sync::Mutex<crate::write::WriteHandle>>) -> Fut,
        Fut: std::future::Future<Output = Result<(), Errno>> + Send + 'static,
    {
        let Some(h) = self.writes.handle(fh.0) else {
            // A reader's handle has nothing to flush; a writer's of an earlier daemon lost
            // its bytes (see `lost_writer`).
            return if self.lost_writer(fh.0) {
                reply.error(Errno::EIO)
            } else {
                reply.ok()
            };
        };
        let fut = op(self.writes.clone(), h);
        self.spawn(async move {
            match fut.await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(e),
            }
        });
    }

    /// Opens an existing file for writing: with O_TRUNC (or when it is empty) it is
    /// replaced by what is written; appending to or rewriting a file with data is
    /// EOPNOTSUPP.
    /// Opens a small file in passthrough from its block file kept open since an earlier
    /// read (see `ShortCircuit::kept_for_passthrough`), on this thread; gives the reply
    /// back when it cannot.
    fn open_kept_passthrough(
        &self,
        s: &pb::FileStatus,
        fh: u64,
        reply: ReplyOpen,
    ) -> Option<ReplyOpen> {
        if s.length == 0 || self.writes.size_of(s.inode).is_some() {
            return Some(reply);
        }
        let fh = tagged(fh, s.version);
        let id = pb::BlockId {
            inode: s.inode,
            version: s.version,
            index: 0,
        };
        let backing = lock(&self.backings).open(
            &self.passthrough,
            (s.inode, s.version),
            &reply,
            (fh, 0),
            || {
                self.client
                    .short_circuit
                    .kept_for_passthrough(&id)
                    .map(|(f, park)| (f, Some(park)))
            },
        );
        let Some(backing) = backing else {
            return Some(reply);
        };
        // The kernel's reference holds the block file now: its descriptor is not needed.
        self.client.short_circuit.drop_kept(&id);
        self.client.count_passthrough_open(s, None);
        open::enter_passthrough(&self.passthrough_fhs, &self.files, fh, s.clone());
        reply.opened_passthrough(FileHandle(fh), FopenFlags::FOPEN_NOFLUSH, &backing);
        None
    }

    fn open_for_write(&self, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen, pass: Pass) {
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let truncate = flags.0 & libc::O_TRUNC != 0;
        let append = flags.0 & libc::O_APPEND != 0;
        let writes = self.writes.clone();
        let fh = self.new_fh() | FH_WRITER;
        let cache = self.cache.clone();
        let dl = self.deadline.clone();
        let backings = self.backings.clone();
        self.spawn(async move {
            let _pass = pass; // held until the reply is sent
            // While programs read the file in passthrough the kernel fails this open (EIO)
            // once answered, and the file would already be an empty new version: it is
            // refused before anything changes. A reader's close reaches the daemon a little
            // after the kernel let go of the file (RELEASE is sent in the background): a
            // moment is waited for that first.
            let until = std::time::Instant::now() + RELEASE_WAIT;
            while lock(&backings).open_in_passthrough(ino.0) {
                if std::time::Instant::now() >= until {
                    tracing::info!(
                        inode = ino.0,
                        "open for writing refused: programs read the file in passthrough"
                    );
                    return reply.error(Errno::EBUSY);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let open = async {
                let s = writes.client.stat_inode(ino.0).await?;
                if s.kind == pb::FileKind::Directory as i32 {
                    return Err(granary_client::ClientError::posix(
                        libc::EISDIR,
                        format!("{} is a directory", s.path),
                    ));
                }
                if !truncate && (append || s.length > 0) {
                    return Err(granary_client::ClientError::posix(
                        libc::EOPNOTSUPP,
                        format!(
                            "{}: files are written whole; open with O_TRUNC to replace it (appending and rewriting in place are not supported)",
                            s.path
                        ),
                    ));
                }
                let mount = s.ufs.as_ref().map(|u| u.mount_id);
                writes.open(fh, &s.path, s.mode, true, mount).await
            };
            match dl.run("open", open).await {
                Ok(s) => {
                    cache.forget(s.inode);
                    reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO)
                }
                Err(e) => {
                    tracing::warn!(inode = ino.0, error = %e, "open for writing failed");
                    reply.error(errno(&e))
                }
            }
        });
    }

    /// unlink (`dir` false) and rmdir (`dir` true).
    fn remove(
        &self,
        caller: (u32, u32),
        parent: INodeNo,
        name: &OsStr,
        dir: bool,
        reply: ReplyEmpty,
    ) {
        let pass = self.gate.pass();
        let name = match self.writable().and_then(|()| Self::name_of(name)) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let writes = self.writes.clone();
        let cache = self.cache.clone();
        let dl = self.deadline.clone();
        self.spawn(async move {
            let _pass = pass; // held until the reply is sent
            let removed = async {
                let entry = writes.client.lookup(parent.0, &name).await?;
                let is_dir = entry.kind == pb::FileKind::Directory as i32;
                if dir && !is_dir {
                    return Err(granary_client::ClientError::posix(
                        libc::ENOTDIR,
                        format!("{} is not a directory", entry.path),
                    ));
                }
                if !dir && is_dir {
                    return Err(granary_client::ClientError::posix(
                        libc::EISDIR,
                        format!("{} is a directory", entry.path),
                    ));
                }
                writes.client.master.delete(&entry.path, false).await?;
                writes.client.forget_status(entry.inode);
                Ok(entry.inode)
            };
            let op = if dir { "rmdir" } else { "unlink" };
            match dl.run_as(caller, op, removed).await {
                Ok(inode) => {
                    cache.forget(inode);
                    reply.ok()
                }
                Err(e) => {
                    if e.code() != ErrorCode::NotFound {
                        tracing::warn!(%name, error = %e, "remove failed");
                    }
                    reply.error(errno(&e))
                }
            }
        });
    }
}
