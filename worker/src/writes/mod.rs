//! Writes: files created through Granary (checkpoints, outputs), received from a client,
//! journaled on local disk, cached as pages, and uploaded to the under-store.
//!
//! Layout under `--cache-dir`: `writes/<inode>-<version>.data` holds the bytes as received,
//! `writes/<inode>-<version>.json` what the write is ([`Journal`]). A journal marked
//! `closed` is a finished async-through write that is not uploaded yet: it is the durable
//! local copy. At start every closed journal resumes its upload (or, for a replica, its
//! watch); an unclosed one is an interrupted write (its client saw the failure) and is
//! removed.
//!
//! Guarantees: an async-through file's pages are pinned (never evicted) until the master
//! records it persisted; the journal is removed only after that (or when the file was
//! removed or replaced meanwhile). A cache-through or through write answers only after the
//! under-store has the whole object.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use granary_client::master::MasterClient;
use granary_proto as pb;
use object_store::ObjectStoreExt as _;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tonic::Status;

use crate::error::RpcError;

use crate::metrics::WorkerMetrics;
use crate::ufs_fetch::Fetcher;

/// How often a replica checks whether its file was persisted.
const REPLICA_CHECK: Duration = Duration::from_secs(2);
/// How often a stream whose writer the master vouches for only at open asks again whether
/// its version is still being written.
const RECHECK_EVERY: Duration = Duration::from_secs(5);
/// How long the persisting worker may be missing before a replica uploads instead.
const TAKEOVER_AFTER: Duration = Duration::from_secs(15);
/// How long a journal waits for its client to commit the file before it is dropped.
const UNCOMMITTED_GIVE_UP: Duration = Duration::from_secs(600);
/// Write streams one caller may keep open on a worker at once.
pub const MAX_STREAMS_PER_CALLER: usize = 4096;

/// One open write stream of a caller (see [`Writes::stream_slot`]); its place is given
/// back when dropped.
pub struct StreamSlot {
    writes: Arc<Writes>,
    who: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut of = lock(&self.writes.streams_of);
        if let Some(open) = of.get_mut(&self.who) {
            *open -= 1;
            if *open == 0 {
                of.remove(&self.who);
            }
        }
    }
}

/// The longest wait between two questions whether a finished file was committed.
const UNCOMMITTED_MAX_WAIT: Duration = Duration::from_secs(10);
/// A replica uploads a file still pending this long after it was committed even while its
/// persisting worker is live: a writer may name a worker that holds no journal (the file
/// would stay pending, and the replicas' pages pinned, for good), or the upload is stuck.
/// A second upload of the same version is harmless (the master records the first).
const PENDING_TAKEOVER_AFTER: Duration = Duration::from_secs(3600);
/// Longest pause between retries of a failed upload.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Journal {
    pub inode: u64,
    pub version: u64,
    pub block_size: u64,
    pub mount_id: u64,
    pub ufs_path: String,
    pub mode: i32,
    /// This worker uploads it (false: a replica).
    pub persist: bool,
    pub length: u64,
    pub closed: bool,
}

pub struct Writes {
    dir: PathBuf,
    fetcher: Arc<Fetcher>,
    master: MasterClient,
    metrics: WorkerMetrics,
    worker_id: u64,
    /// Journals with a task uploading or watching them.
    active: Mutex<HashSet<(u64, u64)>>,
    /// File versions being received now.
    receiving: Mutex<HashSet<(u64, u64)>>,
    /// File versions this worker took a write of, and when (see [`Writes::claim`]).
    taken: Mutex<std::collections::HashMap<(u64, u64), std::time::Instant>>,
    /// Write streams open now, by caller (see [`Writes::stream_slot`]).
    streams_of: Mutex<std::collections::HashMap<String, usize>>,
    /// The worker's cache folder: journals kept after their write (async-through, until
    /// uploaded) count against the capacity of the tier on its disk.
    cache_dir: std::path::PathBuf,
}

/// Creates (or truncates) a file readable by the worker's user only.
fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The free space a write's journal leaves on the cache's disk: 1 % of the disk, at most
/// 256 MiB. A journal not counted against `--cache-size` (a cache-through or through write
/// until it is uploaded, an async-through one past the cache's room) stops with
/// `NO_SPACE` there rather than fill the disk the cache, the other journals and the
/// worker's own files need.
fn disk_reserve(disk_bytes: u64) -> u64 {
    (disk_bytes / 100).min(256 << 20)
}

/// Whether `n` more bytes fit on the disk of `dir` above [`disk_reserve`] (true when the
/// disk cannot be asked: the write's own I/O reports a full disk then).
fn disk_takes(dir: &Path, n: u64) -> bool {
    let Ok(s) = nix::sys::statvfs::statvfs(dir) else {
        return true;
    };
    let unit = s.fragment_size();
    let free = s.blocks_available().saturating_mul(unit);
    let size = s.blocks().saturating_mul(unit);
    free >= n.saturating_add(disk_reserve(size))
}

/// A write's message in its place: an abort gives the write up, nothing may follow the
/// finish; `finished`: the length a finish named.
fn in_order(msg: &pb::WriteFileRequest, finished: &mut Option<u64>) -> Result<(), RpcError> {
    if msg.abort {
        return Err(RpcError::Aborted("the client gave the write up".into()));
    }
    if finished.is_some() {
        return Err(RpcError::Invalid(
            "a message followed the write's finish".into(),
        ));
    }
    if msg.finish {
        *finished = Some(msg.length);
    }
    Ok(())
}

/// A write's stream ended after `arrived` bytes: finished as its client said (`finishes`:
/// it sends a finish, `finished`: the length its finish named), else given up.
fn ended(finishes: bool, finished: Option<u64>, arrived: u64) -> Result<(), RpcError> {
    match finished {
        // The client dropped its writer or stopped part-way: what arrived is not the file,
        // and is neither cached nor uploaded.
        None if finishes => Err(RpcError::Aborted(
            "the write ended before its finish".into(),
        )),
        Some(n) if n != arrived => Err(RpcError::Invalid(format!(
            "the client finished the file at {n} bytes, {arrived} arrived"
        ))),
        _ => Ok(()),
    }
}

/// The writer's stream broke.
fn went_away(e: Status) -> RpcError {
    RpcError::Aborted(format!("the client went away: {}", e.message()))
}

impl Writes {
    pub fn open(
        cache_dir: &Path,
        fetcher: Arc<Fetcher>,
        master: MasterClient,
        metrics: WorkerMetrics,
        worker_id: u64,
    ) -> std::io::Result<Arc<Self>> {
        let dir = cache_dir.join("writes");
        // Journals hold what principals wrote: the worker's user only (0700, files 0600).
        crate::store::private_dir(&dir)?;
        Ok(Arc::new(Self {
            dir,
            cache_dir: cache_dir.to_path_buf(),
            fetcher,
            master,
            metrics,
            worker_id,
            active: Mutex::new(HashSet::new()),
            receiving: Mutex::new(HashSet::new()),
            taken: Mutex::new(std::collections::HashMap::new()),
            streams_of: Mutex::new(std::collections::HashMap::new()),
        }))
    }

    fn paths(&self, inode: u64, version: u64) -> (PathBuf, PathBuf) {
        let base = format!("{inode:016x}-{version:016x}");
        (
            self.dir.join(format!("{base}.data")),
            self.dir.join(format!("{base}.json")),
        )
    }

    fn save(&self, j: &Journal) -> std::io::Result<()> {
        let (_, meta) = self.paths(j.inode, j.version);
        let tmp = meta.with_extension("json.tmp");
        let body = serde_json::to_vec(j).map_err(std::io::Error::other)?;
        let f = private_file(&tmp)?;
        std::io::Write::write_all(&mut &f, &body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &meta)?;
        std::fs::File::open(&self.dir)?.sync_all()
    }

    /// A place for one more write stream of caller `who`, held until the slot is dropped:
    /// each stream holds a task, a journal's descriptor and two files for as long as its
    /// caller keeps it open, so one caller keeps at most [`MAX_STREAMS_PER_CALLER`].
    pub fn stream_slot(self: &Arc<Self>, who: &str) -> Result<StreamSlot, RpcError> {
        let mut of = lock(&self.streams_of);
        let open = of.entry(who.to_string()).or_default();
        if *open >= MAX_STREAMS_PER_CALLER {
            return Err(RpcError::TooMuch(format!(
                "{who} has {MAX_STREAMS_PER_CALLER} write streams open on this worker already; \
                 close some first"
            )));
        }
        *open += 1;
        Ok(StreamSlot {
            writes: self.clone(),
            who: who.to_string(),
        })
    }

    /// [`save`](Self::save) off the async threads (it syncs twice): a burst of new write
    /// streams stalled every request of the worker.
    async fn save_blocking(self: &Arc<Self>, j: &Journal) -> Result<(), RpcError> {
        let (me, j) = (self.clone(), j.clone());
        tokio::task::spawn_blocking(move || me.save(&j))
            .await
            .map_err(|e| RpcError::Internal(format!("saving the write journal: {e}")))?
            .map_err(|e| RpcError::io("saving the write journal", e))
    }

    fn remove(&self, inode: u64, version: u64) {
        let (data, meta) = self.paths(inode, version);
        let _ = std::fs::remove_file(meta);
        let _ = std::fs::remove_file(data);
    }

    /// Takes the write of one file version: once per version per worker. A version's
    /// pages, once cached here, are what its readers get; a second stream (a writer's grant
    /// used again after the file was completed) could cache other bytes under that name.
    /// Versions written here are remembered for a write grant's lifetime, so a write
    /// whose pages were evicted since cannot be taken again either.
    fn claim(&self, inode: u64, version: u64) -> Result<(), RpcError> {
        let key = (inode, version);
        let mut receiving = lock(&self.receiving);
        let (_, meta) = self.paths(inode, version);
        let taken = {
            let mut taken = lock(&self.taken);
            let now = std::time::Instant::now();
            let fresh = |at: &std::time::Instant| {
                now.duration_since(*at) < granary_common::grant::GRANT_LIFETIME
            };
            if taken.len() >= MAX_TAKEN {
                taken.retain(|_, at| fresh(at));
            }
            let seen = taken.get(&key).is_some_and(fresh);
            if !seen && taken.len() < MAX_TAKEN {
                taken.insert(key, now);
            }
            seen
        };
        if taken
            || receiving.contains(&key)
            || lock(&self.active).contains(&key)
            || meta.exists()
            || self.fetcher.store.holds_version(inode, version)
        {
            return Err(RpcError::AlreadyTaken(format!(
                "this worker already took version {version:x} of file {inode}"
            )));
        }
        receiving.insert(key);
        Ok(())
    }

    /// Whether the master still has version `version` of file `inode` being written (created,
    /// not completed): a write grant lasts minutes, and without this its holder could stream
    /// other bytes for a completed version to a worker that never saw it — cached under the
    /// version's name for every reader. Asked for writes of principals other than nodes.
    pub async fn being_written(&self, inode: u64, version: u64) -> Result<(), RpcError> {
        match self
            .master
            .get_status(pb::path_or_id::Target::Inode(inode))
            .await
        {
            Ok(s) if s.version == version && !s.complete => Ok(()),
            Ok(s) if s.version == version => Err(RpcError::Precondition(format!(
                "version {version:x} of file {inode} is complete; it cannot be written again"
            ))),
            Ok(_) => Err(RpcError::Precondition(format!(
                "file {inode} is no longer at version {version:x} (replaced or removed)"
            ))),
            Err(e) if e.code() == granary_client::ErrorCode::NotFound => {
                Err(RpcError::Precondition(format!(
                    "file {inode} is no longer at version {version:x} (replaced or removed)"
                )))
            }
            Err(e) => Err(RpcError::Unavailable(format!(
                "cannot ask the master whether file {inode} is being written: {e}"
            ))),
        }
    }

    /// [`being_written`](Self::being_written), except that a master that cannot answer now
    /// refutes nothing (the writer was vouched for when its stream opened).
    async fn not_completed(&self, inode: u64, version: u64) -> Result<(), RpcError> {
        match self.being_written(inode, version).await {
            Err(RpcError::Unavailable(_)) => Ok(()),
            other => other,
        }
    }

    /// The stream's next message. With `recheck` (when the master was last asked), the
    /// master is asked again every [`RECHECK_EVERY`], whether messages arrive or not: a
    /// stream kept open after its file was completed through another worker ends, and what
    /// it cached goes, instead of serving as the completed version's bytes.
    async fn next_checked<S>(
        &self,
        h: &pb::WriteFileHeader,
        inbound: &mut S,
        recheck: &mut Option<std::time::Instant>,
    ) -> Result<Option<pb::WriteFileRequest>, RpcError>
    where
        S: futures::Stream<Item = Result<pb::WriteFileRequest, Status>> + Unpin + Send,
    {
        loop {
            let Some(at) = *recheck else {
                return inbound.next().await.transpose().map_err(went_away);
            };
            let wait = RECHECK_EVERY.saturating_sub(at.elapsed());
            if !wait.is_zero() {
                if let Ok(next) = tokio::time::timeout(wait, inbound.next()).await {
                    return next.transpose().map_err(went_away);
                }
            }
            self.not_completed(h.inode, h.version).await?;
            *recheck = Some(std::time::Instant::now());
        }
    }

    /// Room for `len` more bytes of journal on the tier in the cache folder (else the last
    /// tier), as journals live on its disk (`None`: it cannot be had).
    fn journal_room(&self, len: u64) -> Option<crate::store::Reservation> {
        self.fetcher.store.reserve_room_in(&self.cache_dir, len)
    }

    /// Resumes what a previous run left: closed journals are uploaded (or watched), others
    /// removed. Returns how many were resumed.
    pub fn resume(self: &Arc<Self>) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut resumed = 0;
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            let journal: Option<Journal> = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            match journal {
                Some(j) if j.closed => {
                    self.fetcher.store.pin(j.inode);
                    tracing::info!(
                        inode = j.inode,
                        bytes = j.length,
                        "resuming the upload of a file written async-through"
                    );
                    // Counted against the cache again (a smaller cache than when it was
                    // written may not hold it: it is kept and uploaded all the same).
                    let room = self.journal_room(j.length);
                    if room.is_none() && j.length > 0 {
                        tracing::warn!(
                            inode = j.inode,
                            bytes = j.length,
                            "the cache cannot count this journal; it is kept until uploaded"
                        );
                    }
                    self.spawn_background(j, room);
                    resumed += 1;
                }
                Some(j) => {
                    tracing::warn!(
                        inode = j.inode,
                        "removing the journal of a write interrupted before it finished"
                    );
                    self.remove(j.inode, j.version);
                }
                None => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        self.metrics.pending_uploads.set(resumed as i64);
        resumed
    }

    /// Serves one WriteFile stream; answers go to `tx`.
    pub async fn receive<S>(
        self: Arc<Self>,
        header: pb::WriteFileHeader,
        inbound: S,
        tx: mpsc::Sender<Result<pb::WriteFileResponse, Status>>,
    ) where
        S: futures::Stream<Item = Result<pb::WriteFileRequest, Status>> + Unpin + Send,
    {
        self.receive_as(header, false, inbound, tx).await
    }

    /// [`receive`](Self::receive); with `recheck` (a writer the master vouched for at open
    /// only) the master is asked again, while the stream lasts and at its finish, whether
    /// the version is still being written.
    pub async fn receive_as<S>(
        self: Arc<Self>,
        header: pb::WriteFileHeader,
        recheck: bool,
        mut inbound: S,
        tx: mpsc::Sender<Result<pb::WriteFileResponse, Status>>,
    ) where
        S: futures::Stream<Item = Result<pb::WriteFileRequest, Status>> + Unpin + Send,
    {
        let (inode, version, mode) = (header.inode, header.version, header.mode);
        if let Err(e) = self.claim(inode, version) {
            self.metrics.write_failures.inc();
            let _ = tx.send(Err(e.into())).await;
            return;
        }
        let recheck = recheck.then(std::time::Instant::now);
        let out = self
            .clone()
            .receive_inner(header, recheck, &mut inbound, &tx)
            .await;
        lock(&self.receiving).remove(&(inode, version));
        if let Err(e) = out {
            tracing::warn!(inode, error = %e, "write failed");
            self.metrics.write_failures.inc();
            let active = lock(&self.active).contains(&(inode, version));
            if !active {
                self.remove(inode, version);
                // What the stream cached is no file's: a writer that gave up (or that
                // completed the file through another worker) leaves none of it readable.
                self.fetcher.store.drop_version(inode, version);
                if mode == pb::WriteMode::AsyncThrough as i32 {
                    self.fetcher.store.unpin(inode);
                }
            }
            let _ = tx.send(Err(e.into())).await;
        }
    }

    /// The write mode and block size a header asks for, refused when no write can have
    /// them.
    fn check_header(&self, h: &pb::WriteFileHeader) -> Result<(pb::WriteMode, u64), RpcError> {
        let mode = pb::WriteMode::try_from(h.mode)
            .map_err(|_| RpcError::Invalid(format!("unknown write mode {}", h.mode)))?;
        if h.inode == 0 || h.version == 0 {
            return Err(RpcError::Invalid(
                "the header needs an inode and a version".into(),
            ));
        }
        if h.ufs.is_none() && mode != pb::WriteMode::MustCache {
            return Err(RpcError::Invalid(
                "a file outside any mount can only be written must-cache".into(),
            ));
        }
        let block_size = granary_common::grant::effective_block_size(h.block_size);
        if block_size < self.fetcher.store.page_size() {
            return Err(RpcError::Invalid(format!(
                "block size {block_size} is below the worker's page size {}",
                self.fetcher.store.page_size()
            )));
        }
        if block_size > granary_common::MAX_BLOCK_SIZE {
            return Err(RpcError::Invalid(format!(
                "block size {block_size} is above the largest a file may have ({} bytes)",
                granary_common::MAX_BLOCK_SIZE
            )));
        }
        Ok((mode, block_size))
    }

    /// Holds `n` more journal bytes against the cache's capacity in `room`; false (and
    /// nothing held) when the cache cannot hold them.
    fn hold_room(&self, n: u64, room: &mut Option<crate::store::Reservation>) -> bool {
        match self.journal_room(n) {
            Some(r) => {
                match room.as_mut() {
                    // One tier: always the same store.
                    Some(held) => {
                        let _ = held.absorb(r);
                    }
                    None => *room = Some(r),
                }
                true
            }
            None => {
                *room = None;
                false
            }
        }
    }

    /// Room for `n` more bytes of a write's journal. An async-through journal (`pinned`)
    /// counts against the cache until uploaded while the cache has room (a replica is
    /// refused beyond it; the persisting worker goes on `uncounted`, uploading before it
    /// answers). A journal counted nowhere (cache-through and through until uploaded, an
    /// async-through one past the cache's room) must leave the disk its reserve.
    fn room_for(
        &self,
        n: u64,
        pinned: bool,
        persist: bool,
        room: &mut Option<crate::store::Reservation>,
        uncounted: &mut bool,
    ) -> Result<(), RpcError> {
        if pinned && !*uncounted {
            *uncounted = !self.hold_room(n, room);
            if *uncounted && !persist {
                return Err(RpcError::NoSpace(
                    "the worker's cache cannot hold this replica of an async-through write \
                     (its pages and its journal count against --cache-size until uploaded)"
                        .to_string(),
                ));
            }
        }
        if (!pinned || *uncounted) && !disk_takes(&self.dir, n) {
            return Err(RpcError::NoSpace(
                "the worker's cache disk is nearly full: this write's journal would leave \
                 less than its reserve (1 % of the disk, at most 256 MiB) free"
                    .to_string(),
            ));
        }
        Ok(())
    }

    async fn receive_inner<S>(
        self: Arc<Self>,
        h: pb::WriteFileHeader,
        mut recheck: Option<std::time::Instant>,
        inbound: &mut S,
        tx: &mpsc::Sender<Result<pb::WriteFileResponse, Status>>,
    ) -> Result<(), RpcError>
    where
        S: futures::Stream<Item = Result<pb::WriteFileRequest, Status>> + Unpin + Send,
    {
        let (mode, block_size) = self.check_header(&h)?;
        let ufs = h.ufs.clone();
        // Block indexes are 32-bit: a file ends before block 2^32 (and at the largest length).
        let max_length = granary_common::MAX_FILE_LENGTH.min(block_size << 32);
        let mut journal = Journal {
            inode: h.inode,
            version: h.version,
            block_size,
            mount_id: ufs.as_ref().map(|u| u.mount_id).unwrap_or(0),
            ufs_path: ufs.as_ref().map(|u| u.path.clone()).unwrap_or_default(),
            mode: h.mode,
            persist: h.persist || mode != pb::WriteMode::AsyncThrough,
            length: 0,
            closed: false,
        };
        let (data_path, _) = self.paths(h.inode, h.version);
        self.save_blocking(&journal).await?;
        let file =
            private_file(&data_path).map_err(|e| RpcError::io("creating the write journal", e))?;
        let caching = mode != pb::WriteMode::Through;
        let pinned = mode == pb::WriteMode::AsyncThrough;
        // An async-through journal outlives the write (until uploaded): its bytes are held
        // against the cache's capacity as they arrive. When the cache cannot hold them, the
        // persisting worker uploads the file before answering (its journal then goes at
        // once) and a replica refuses the write.
        let mut room: Option<crate::store::Reservation> = None;
        let mut uncounted = false;
        if pinned {
            self.fetcher.store.pin(h.inode);
        }
        let mut sink = Some(Sink {
            file,
            pages: PageCutter::new(
                (h.inode, h.version),
                block_size,
                self.fetcher.store.page_size(),
            ),
            store: self.fetcher.store.clone(),
            caching,
            cache_full: false,
        });
        let mut offset = 0u64;
        let mut finished = None;
        while let Some(msg) = self.next_checked(&h, inbound, &mut recheck).await? {
            in_order(&msg, &mut finished)?;
            let (n, sync) = (msg.data.len() as u64, msg.sync);
            if offset.saturating_add(n) > max_length {
                return Err(RpcError::Invalid(format!(
                    "the file would be longer than {max_length} bytes (the most a file of \
                     {block_size}-byte blocks may have)"
                )));
            }
            if n > 0 {
                self.room_for(n, pinned, journal.persist, &mut room, &mut uncounted)?;
            }
            if n > 0 || sync {
                blocking(&mut sink, move |s| {
                    s.take(&msg.data)?;
                    if sync {
                        s.file.sync_data()?;
                    }
                    Ok(())
                })
                .await
                .map_err(|e| RpcError::io("writing the journal", e))?;
                offset += n;
                self.metrics.written_bytes.inc_by(n);
            }
            if sync {
                let _ = tx
                    .send(Ok(pb::WriteFileResponse {
                        synced: offset,
                        ..Default::default()
                    }))
                    .await;
            }
        }
        ended(h.finishes, finished, offset)?;
        if recheck.is_some() {
            // Completed meanwhile through another worker: these bytes are not the file's.
            self.not_completed(h.inode, h.version).await?;
        }
        blocking(&mut sink, |s| {
            s.finish();
            s.file.sync_all()
        })
        .await
        .map_err(|e| RpcError::io("syncing the journal", e))?;
        let cache_full = sink.as_ref().is_none_or(|s| s.cache_full);
        drop(sink);
        journal.length = offset;
        let answer =
            |fingerprint: Option<pb::Fingerprint>, persisted: bool| pb::WriteFileResponse {
                synced: offset,
                fingerprint,
                done: true,
                persisted,
            };
        match mode {
            pb::WriteMode::MustCache => {
                self.remove(h.inode, h.version);
                if cache_full {
                    return Err(RpcError::TooMuch(
                        "the worker's cache cannot hold the file (must-cache writes are only cached)"
                            .into(),
                    ));
                }
                let _ = tx.send(Ok(answer(None, false))).await;
            }
            pb::WriteMode::AsyncThrough if !((cache_full || uncounted) && journal.persist) => {
                journal.closed = true;
                self.save_blocking(&journal).await?;
                self.metrics.pending_uploads.inc();
                self.spawn_background(journal, room.take());
                let _ = tx.send(Ok(answer(None, false))).await;
            }
            _ => {
                if mode == pb::WriteMode::AsyncThrough {
                    // The cache cannot hold it pinned: it is uploaded before the answer.
                    self.metrics.async_writes_uploaded_at_close.inc();
                }
                let fp = self.upload(&journal).await.map_err(|e| {
                    RpcError::Unavailable(format!("uploading to the under-store failed: {e}"))
                })?;
                self.remove(h.inode, h.version);
                if pinned {
                    self.fetcher.store.unpin(h.inode);
                }
                let _ = tx.send(Ok(answer(Some(fp), true))).await;
            }
        }
        Ok(())
    }

    /// Uploads a journal's bytes to its file's current under-store path; the object's
    /// fingerprint.
    async fn upload(&self, j: &Journal) -> Result<pb::Fingerprint, String> {
        self.upload_to(j, &j.ufs_path, j.mount_id).await
    }

    async fn upload_to(
        &self,
        j: &Journal,
        ufs_path: &str,
        mount_id: u64,
    ) -> Result<pb::Fingerprint, String> {
        let ufs = self
            .fetcher
            .stores
            .get(&self.master, mount_id)
            .await
            .map_err(|e| e.to_string())?;
        let path = ufs.path_of(ufs_path);
        let (data, _) = self.paths(j.inode, j.version);
        let mut src = tokio::fs::File::open(&data)
            .await
            .map_err(|e| format!("opening the journal: {e}"))?;
        let mut w = object_store::buffered::BufWriter::with_capacity(
            ufs.store.clone(),
            path.clone(),
            UPLOAD_PART,
        );
        let copied = tokio::io::copy(&mut src, &mut w).await;
        match copied {
            Ok(n) if n == j.length => {}
            Ok(n) => {
                let _ = w.abort().await;
                return Err(format!(
                    "the journal holds {n} bytes, expected {}",
                    j.length
                ));
            }
            Err(e) => {
                let _ = w.abort().await;
                return Err(e.to_string());
            }
        }
        w.shutdown().await.map_err(|e| e.to_string())?;
        let meta = ufs.store.head(&path).await.map_err(|e| e.to_string())?;
        if meta.size != j.length {
            return Err(format!(
                "the store holds {} bytes after the upload, expected {}",
                meta.size, j.length
            ));
        }
        self.metrics.uploaded_bytes.inc_by(j.length);
        Ok(granary_common::ufs::fingerprint_of(&meta))
    }

    /// Uploads (or watches, for a replica) a closed journal in the background; `room` (its
    /// bytes held in the cache) is released once the journal is gone.
    fn spawn_background(self: &Arc<Self>, j: Journal, room: Option<crate::store::Reservation>) {
        if !lock(&self.active).insert((j.inode, j.version)) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let key = (j.inode, j.version);
            if j.persist {
                me.persist(j).await;
            } else {
                me.watch(j).await;
            }
            drop(room);
            lock(&me.active).remove(&key);
            me.metrics.pending_uploads.dec();
        });
    }

    /// Ends a journal: unpins the file's pages and removes the local copy.
    fn finish(&self, j: &Journal) {
        self.fetcher.store.unpin(j.inode);
        self.remove(j.inode, j.version);
    }

    /// The file as the master knows it now: None when it is gone or was replaced.
    async fn current(&self, j: &Journal) -> Result<Option<pb::FileStatus>, String> {
        match self
            .master
            .get_status(pb::path_or_id::Target::Inode(j.inode))
            .await
        {
            Ok(s) if s.version == j.version => Ok(Some(s)),
            Ok(_) => Ok(None),
            Err(e) if e.code() == granary_client::ErrorCode::NotFound => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Uploads an async-through file until the master records it (retrying with backoff
    /// through store and master outages).
    async fn persist(&self, j: Journal) {
        let mut backoff = Duration::from_millis(500);
        let mut uncommitted_wait = Duration::from_millis(200);
        let started = tokio::time::Instant::now();
        loop {
            match self.persist_once(&j).await {
                Ok(()) => {
                    self.finish(&j);
                    return;
                }
                Err(Retry::Uncommitted) if started.elapsed() > UNCOMMITTED_GIVE_UP => {
                    tracing::warn!(
                        inode = j.inode,
                        "the client never committed the file; dropping its journal"
                    );
                    self.finish(&j);
                    return;
                }
                Err(Retry::Uncommitted) => {
                    // The client commits right after its workers answer: asked soon, then
                    // less and less often (a writer that never commits made every such
                    // file cost the master five requests a second for ten minutes).
                    tokio::time::sleep(uncommitted_wait).await;
                    uncommitted_wait = (uncommitted_wait * 2).min(UNCOMMITTED_MAX_WAIT);
                }
                Err(Retry::Failed(e)) => {
                    self.metrics.upload_failures.inc();
                    tracing::warn!(inode = j.inode, error = %e, retry_in = ?backoff, "uploading a file written async-through failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    async fn persist_once(&self, j: &Journal) -> Result<(), Retry> {
        let Some(status) = self.current(j).await.map_err(Retry::Failed)? else {
            tracing::info!(
                inode = j.inode,
                "the file was removed or replaced before its upload; dropping it"
            );
            return Ok(());
        };
        if !status.complete {
            // The client commits it once every worker answered: shortly.
            return Err(Retry::Uncommitted);
        }
        if status.persist_state != pb::PersistState::Pending as i32 {
            return Ok(());
        }
        let ufs = status
            .ufs
            .ok_or_else(|| Retry::Failed("the file is not in a mount".to_string()))?;
        let fp = self
            .upload_to(j, &ufs.path, ufs.mount_id)
            .await
            .map_err(Retry::Failed)?;
        let recorded = self
            .master
            .file_persisted(pb::FilePersistedRequest {
                inode: j.inode,
                version: j.version,
                fingerprint: Some(fp),
                ufs_path: ufs.path.clone(),
            })
            .await
            .map_err(|e| Retry::Failed(e.to_string()))?;
        if recorded {
            tracing::info!(inode = j.inode, path = %ufs.path, bytes = j.length, "file persisted");
            self.metrics.persisted_files.inc();
            return Ok(());
        }
        // Moved or removed while it was uploading: the object just written is stale.
        let now = self.current(j).await.map_err(Retry::Failed)?;
        let moved = now
            .as_ref()
            .and_then(|s| s.ufs.as_ref())
            .is_some_and(|u| u.path != ufs.path);
        if now.is_none() || moved {
            if let Ok(store) = self.fetcher.stores.get(&self.master, ufs.mount_id).await {
                let _ = store.store.delete(&store.path_of(&ufs.path)).await;
            }
        }
        if moved {
            return Err(Retry::Failed(format!(
                "{} moved during its upload",
                ufs.path
            )));
        }
        Ok(())
    }

    /// A replica of an async-through file: kept (pinned) until the file is persisted;
    /// uploads it if the persisting worker stays gone.
    async fn watch(&self, j: Journal) {
        let mut missing_since: Option<tokio::time::Instant> = None;
        let mut pending_since: Option<tokio::time::Instant> = None;
        let started = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(REPLICA_CHECK).await;
            let status = match self.current(&j).await {
                Ok(Some(s)) => s,
                Ok(None) => break,
                Err(_) => continue,
            };
            if !status.complete {
                if started.elapsed() > UNCOMMITTED_GIVE_UP {
                    break;
                }
                continue;
            }
            if status.persist_state != pb::PersistState::Pending as i32 {
                break;
            }
            let owner_live = self
                .master
                .cluster_info(false)
                .await
                .map(|c| {
                    c.workers.iter().any(|w| {
                        w.worker_id == status.persist_worker
                            && w.worker_state() != pb::WorkerState::Lost
                    })
                })
                .unwrap_or(true);
            let pending_for = pending_since
                .get_or_insert_with(tokio::time::Instant::now)
                .elapsed();
            if status.persist_worker != self.worker_id && pending_for >= PENDING_TAKEOVER_AFTER {
                tracing::warn!(
                    inode = j.inode,
                    worker = status.persist_worker,
                    pending_s = pending_for.as_secs(),
                    "the file is still not persisted by the worker it names; this replica uploads it"
                );
                self.persist(j).await;
                return;
            }
            if owner_live || status.persist_worker == self.worker_id {
                missing_since = None;
                continue;
            }
            let since = *missing_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= TAKEOVER_AFTER {
                tracing::warn!(
                    inode = j.inode,
                    worker = status.persist_worker,
                    "the persisting worker is gone; this replica uploads the file"
                );
                self.persist(j).await;
                return;
            }
        }
        self.finish(&j);
    }
}

/// Why an upload attempt must be tried again.
enum Retry {
    /// The master does not have the file committed yet.
    Uncommitted,
    Failed(String),
}

/// File versions [`Writes::claim`] remembers at most (writes of a grant's lifetime).
const MAX_TAKEN: usize = 100_000;

/// Bytes per part of an upload.
const UPLOAD_PART: usize = 16 * 1024 * 1024;

/// Runs one step of disk work off the async threads, handing the sink back.
async fn blocking(
    sink: &mut Option<Sink>,
    step: impl FnOnce(&mut Sink) -> std::io::Result<()> + Send + 'static,
) -> std::io::Result<()> {
    let Some(mut s) = sink.take() else {
        return Err(std::io::Error::other("the journal is gone"));
    };
    let (s, r) = tokio::task::spawn_blocking(move || {
        let r = step(&mut s);
        (s, r)
    })
    .await
    .map_err(std::io::Error::other)?;
    *sink = Some(s);
    r
}

/// The receiving end of one write: the journal file and the pages being cut from it.
struct Sink {
    file: std::fs::File,
    pages: PageCutter,
    store: Arc<dyn crate::store::BlockStore>,
    caching: bool,
    /// The cache refused a page: nothing more of this file is cached.
    cache_full: bool,
}

impl Sink {
    /// Appends bytes to the journal and caches the pages they complete.
    fn take(&mut self, data: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        self.file.write_all(data)?;
        if self.caching && !self.cache_full {
            for (key, page) in self.pages.push(data) {
                if !self.cache(key, &page) {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Caches the last, partial page.
    fn finish(&mut self) {
        if self.caching && !self.cache_full {
            if let Some((key, page)) = self.pages.finish() {
                self.cache(key, &page);
            }
        }
    }

    fn cache(&mut self, key: crate::store::PageKey, page: &[u8]) -> bool {
        let ok = match self.store.reserve(&key, page.len() as u64) {
            Some(r) => self
                .store
                .commit(r, key, self.pages.block_size, page)
                .is_ok(),
            None => false,
        };
        self.cache_full = !ok;
        ok
    }
}

/// Cuts a written byte stream into the pages of its blocks.
struct PageCutter {
    file: (u64, u64),
    block_size: u64,
    page_size: u64,
    /// File offset of `buf`'s first byte.
    start: u64,
    buf: BytesMut,
}

impl PageCutter {
    fn new(file: (u64, u64), block_size: u64, page_size: u64) -> Self {
        Self {
            file,
            block_size,
            page_size,
            start: 0,
            buf: BytesMut::new(),
        }
    }

    fn key(&self) -> crate::store::PageKey {
        let block = self.start / self.block_size;
        let page = (self.start % self.block_size) / self.page_size;
        ((self.file.0, self.file.1, block as u32), page as u32)
    }

    /// Bytes until the end of the current page (pages end at block ends too).
    fn room(&self) -> usize {
        let in_block = self.start % self.block_size;
        let page_end = ((in_block / self.page_size) + 1) * self.page_size;
        (page_end.min(self.block_size) - in_block) as usize
    }

    /// Adds bytes; returns the pages they complete.
    fn push(&mut self, mut data: &[u8]) -> Vec<(crate::store::PageKey, Bytes)> {
        let mut out = Vec::new();
        while !data.is_empty() {
            let want = self.room() - self.buf.len();
            let take = want.min(data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.buf.len() == self.room() {
                let key = self.key();
                let page = self.buf.split().freeze();
                self.start += page.len() as u64;
                out.push((key, page));
            }
        }
        out
    }

    /// The last, partial page.
    fn finish(&mut self) -> Option<(crate::store::PageKey, Bytes)> {
        if self.buf.is_empty() {
            return None;
        }
        let key = self.key();
        let page = self.buf.split().freeze();
        self.start += page.len() as u64;
        Some((key, page))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{PageStore, TieredStore};

    const PS: u64 = 4096;

    /// Writes over a cache of `pages` pages in a temp dir, with an in-memory store as
    /// mount 1.
    fn writes(dir: &Path, pages: u64) -> Arc<Writes> {
        let metrics = WorkerMetrics::default();
        let store = PageStore::open(
            dir,
            pages * PS,
            PS,
            crate::evict::PolicyKind::Lru,
            metrics.clone(),
        )
        .unwrap();
        let master = MasterClient::new(granary_common::net::Tcp::plain(), "127.0.0.1:1").unwrap();
        let fetcher = Arc::new(Fetcher::new(
            master.clone(),
            TieredStore::single(store),
            metrics.clone(),
        ));
        fetcher.stores.insert(
            1,
            granary_common::ufs::Ufs {
                store: Arc::new(object_store::memory::InMemory::new()),
                pager: None,
                prefix: object_store::path::Path::default(),
                part_size: PS,
                part_concurrency: 1,
                local: None,
            },
        );
        Writes::open(dir, fetcher, master, metrics, 1).unwrap()
    }

    /// The header of file `inode` (version 1) of mount 1 in `mode`, from a client that
    /// finishes its writes.
    fn header(inode: u64, mode: pb::WriteMode, persist: bool) -> pb::WriteFileHeader {
        pb::WriteFileHeader {
            inode,
            version: 1,
            block_size: 4 * PS,
            ufs: Some(pb::UfsLocation {
                mount_id: 1,
                path: format!("f{inode}"),
            }),
            mode: mode as i32,
            persist,
            grant: None,
            finishes: true,
        }
    }

    /// Writes `len` bytes as file `inode` (version 1) in `mode`; the last answer.
    async fn write(
        w: &Arc<Writes>,
        inode: u64,
        len: usize,
        mode: pb::WriteMode,
        persist: bool,
    ) -> Result<pb::WriteFileResponse, Status> {
        let header = header(inode, mode, persist);
        let data = pb::WriteFileRequest {
            data: vec![7u8; len].into(),
            finish: true,
            length: len as u64,
            ..Default::default()
        };
        let (tx, mut rx) = mpsc::channel(8);
        w.clone()
            .receive(header, futures::stream::iter(vec![Ok(data)]), tx)
            .await;
        let mut last = Err(Status::internal("no answer"));
        while let Some(a) = rx.recv().await {
            last = a;
        }
        last
    }

    /// A stream ends a write as its client says: a client that sends `finish` (its header
    /// says so) has a stream that ends without one given up, nothing may follow the finish,
    /// a finish naming another length than arrived is refused, and an older client's stream
    /// still finishes the file by ending.
    #[tokio::test]
    async fn a_stream_ends_a_write_only_as_its_client_says() {
        let dir = tempfile::tempdir().unwrap();
        let w = writes(dir.path(), 64);
        // 1,000 bytes; with a finish naming the file's length.
        let data = |finish: Option<u64>| pb::WriteFileRequest {
            data: vec![7u8; 1000].into(),
            finish: finish.is_some(),
            length: finish.unwrap_or(0),
            ..Default::default()
        };
        let invalid = Err(tonic::Code::InvalidArgument);
        for (inode, finishes, msgs, want) in [
            (1, true, vec![data(None)], Err(tonic::Code::Aborted)),
            (2, true, vec![data(Some(1000)), data(None)], invalid),
            (3, true, vec![data(None), data(Some(2000))], Ok(2000)),
            (4, false, vec![data(None)], Ok(1000)),
            (5, true, vec![data(None), data(Some(1500))], invalid),
        ] {
            let header = pb::WriteFileHeader {
                finishes,
                ..header(inode, pb::WriteMode::CacheThrough, true)
            };
            let (tx, mut rx) = mpsc::channel(8);
            let msgs: Vec<Result<_, Status>> = msgs.into_iter().map(Ok).collect();
            w.clone()
                .receive(header, futures::stream::iter(msgs), tx)
                .await;
            let mut last = Err(Status::internal("no answer"));
            while let Some(a) = rx.recv().await {
                last = a;
            }
            let got = last.map(|a| a.synced).map_err(|e| e.code());
            assert_eq!(got, want, "inode {inode}");
            let (data, meta) = w.paths(inode, 1);
            assert!(
                !data.exists() && !meta.exists(),
                "inode {inode}: a journal was kept"
            );
        }
    }

    /// A write that fails part-way (here: a stream ending without the finish its client
    /// promised) leaves none of its pages readable, only the cache's room it took back.
    #[tokio::test]
    async fn a_failed_write_leaves_none_of_its_pages_cached() {
        let dir = tempfile::tempdir().unwrap();
        let w = writes(dir.path(), 64);
        let data = pb::WriteFileRequest {
            data: vec![7u8; 3 * PS as usize + 10].into(),
            ..Default::default()
        };
        let (tx, mut rx) = mpsc::channel(8);
        let header = header(9, pb::WriteMode::CacheThrough, true);
        w.clone()
            .receive(header, futures::stream::iter(vec![Ok(data)]), tx)
            .await;
        let mut last = Ok(pb::WriteFileResponse::default());
        while let Some(a) = rx.recv().await {
            last = a;
        }
        assert_eq!(last.unwrap_err().code(), tonic::Code::Aborted);
        assert!(!w.fetcher.store.holds_version(9, 1));
        assert_eq!(w.fetcher.store.used(), 0);
    }

    /// One caller keeps at most so many write streams open; a slot given back makes room,
    /// and another caller is not held back by the first.
    #[tokio::test]
    async fn one_caller_keeps_at_most_its_write_streams() {
        let dir = tempfile::tempdir().unwrap();
        let w = writes(dir.path(), 64);
        let held: Vec<_> = (0..MAX_STREAMS_PER_CALLER)
            .map(|_| w.stream_slot("mallory").unwrap())
            .collect();
        let e = tonic::Status::from(w.stream_slot("mallory").err().unwrap());
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("4096 write streams"), "{e:?}");
        let other = w.stream_slot("alice").unwrap();
        drop(held);
        drop(other);
        assert!(lock(&w.streams_of).is_empty());
        w.stream_slot("mallory").unwrap();
    }

    /// A tmpfs of `mib` MiB mounted on a new temp dir (root), unmounted when dropped.
    struct Tmpfs(tempfile::TempDir);

    impl Tmpfs {
        fn new(mib: u32) -> Self {
            let d = tempfile::tempdir().unwrap();
            let st = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
                .arg(d.path())
                .status()
                .unwrap();
            assert!(st.success(), "mounting a tmpfs (the test needs root)");
            Self(d)
        }

        fn free(&self) -> u64 {
            let s = nix::sys::statvfs::statvfs(self.0.path()).unwrap();
            s.blocks_available() * s.fragment_size()
        }
    }

    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg(self.0.path())
                .status();
        }
    }

    /// A write whose journal is not counted against the cache (cache-through: kept until
    /// it is uploaded) stops with NO_SPACE before the disk is full, whatever its length:
    /// the disk keeps its reserve, and a small write fits afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_journal_never_fills_the_cache_disk() {
        let disk = Tmpfs::new(8);
        let w = writes(disk.0.path(), 16);
        let header = pb::WriteFileHeader {
            inode: 30,
            version: 1,
            block_size: 4 * PS,
            ufs: Some(pb::UfsLocation {
                mount_id: 1,
                path: "big".into(),
            }),
            mode: pb::WriteMode::CacheThrough as i32,
            persist: true,
            grant: None,
            finishes: true,
        };
        let chunk = pb::WriteFileRequest {
            data: vec![7u8; 1 << 20].into(),
            ..Default::default()
        };
        let (tx, mut rx) = mpsc::channel(8);
        w.clone()
            .receive(header, futures::stream::iter(vec![Ok(chunk); 16]), tx)
            .await;
        let mut last = Err(Status::internal("no answer"));
        while let Some(a) = rx.recv().await {
            last = a;
        }
        let e = last.expect_err("16 MiB were journaled on an 8 MiB disk");
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("nearly full"), "{e:?}");
        assert!(
            disk.free() >= disk_reserve(8 << 20),
            "{} bytes left",
            disk.free()
        );
        let a = write(&w, 31, 2 * PS as usize, pb::WriteMode::CacheThrough, true).await;
        assert!(a.as_ref().is_ok_and(|a| a.done), "{a:?}");
    }

    fn mode_of(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn async_through_journals_count_against_the_cache_and_are_private() {
        let d = tempfile::tempdir().unwrap();
        let w = writes(d.path(), 32);
        let store = w.fetcher.store.clone();
        // A replica of 8 pages: its pages (pinned) and its journal, 16 pages in all.
        let len = 8 * PS as usize;
        let a = write(&w, 10, len, pb::WriteMode::AsyncThrough, false).await;
        assert!(a.as_ref().is_ok_and(|a| a.done), "{a:?}");
        assert_eq!(store.used(), 8 * PS);
        assert_eq!(store.used_and_reserved(), 16 * PS);
        let (data, meta) = w.paths(10, 1);
        assert_eq!(std::fs::metadata(&data).unwrap().len(), len as u64);
        assert_eq!((mode_of(&data), mode_of(&meta)), (0o600, 0o600));
        assert_eq!(mode_of(&d.path().join("writes")), 0o700);
        // A second replica that does not fit beside them (20 pages + 20 of journal): refused,
        // and nothing of it stays counted.
        let e = write(&w, 11, 20 * PS as usize, pb::WriteMode::AsyncThrough, false)
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert_eq!(
            e.metadata().get(pb::ERRNO_KEY).map(|v| v.as_bytes()),
            Some(&b"28"[..]),
            "ENOSPC through a mount"
        );
        assert_eq!(store.used_and_reserved(), 16 * PS);
        assert!(!w.paths(11, 1).0.exists());
        // The persisting copy of a file too big to hold is uploaded before the answer, and
        // leaves no journal counted either.
        let a = write(&w, 12, 20 * PS as usize, pb::WriteMode::AsyncThrough, true)
            .await
            .unwrap();
        assert!(a.persisted && a.fingerprint.is_some(), "{a:?}");
        assert!(!w.paths(12, 1).0.exists());
        let journals = |s: &Arc<dyn crate::store::BlockStore>| s.used_and_reserved() - s.used();
        assert_eq!(journals(&store), 8 * PS, "only the first replica's journal");
        // A cache-through write's journal goes with its upload: only its pages stay.
        let a = write(&w, 13, 2 * PS as usize, pb::WriteMode::CacheThrough, true)
            .await
            .unwrap();
        assert!(a.persisted);
        assert_eq!(journals(&store), 8 * PS);
        assert!(store.get(&((13, 1, 0), 1)).is_some());
        // One write per version per worker: the first file cannot be written again.
        let e = write(&w, 10, PS as usize, pb::WriteMode::MustCache, false)
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e:?}");
        assert_eq!(store.get(&((10, 1, 0), 0)).unwrap()[..], [7u8; PS as usize]);
        assert!(
            data.exists() && meta.exists(),
            "the refusal removed the first journal"
        );
        assert_eq!(journals(&store), 8 * PS);
        // Nor can file 13, written through and gone from the journal, once its pages are
        // gone too (the worker remembers it took that version).
        store.drop_stale(13, 0);
        assert!(!store.holds_version(13, 1));
        let e = write(&w, 13, PS as usize, pb::WriteMode::CacheThrough, true)
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e:?}");
    }

    #[test]
    fn a_resumed_journal_counts_against_the_cache_again() {
        let d = tempfile::tempdir().unwrap();
        let rt = || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap()
        };
        // A replica written, then the worker stops (its tasks and store go with the runtime).
        {
            let rt = rt();
            rt.block_on(async {
                let w = writes(d.path(), 32);
                let a = write(&w, 30, 6 * PS as usize, pb::WriteMode::AsyncThrough, false).await;
                assert!(a.is_ok(), "{a:?}");
            });
            rt.shutdown_timeout(Duration::from_secs(10));
        }
        // Restarted: the closed journal is resumed and held against the capacity again.
        let rt = rt();
        rt.block_on(async {
            let w = writes(d.path(), 32);
            assert_eq!(w.resume(), 1);
            let store = &w.fetcher.store;
            assert_eq!(store.used_and_reserved() - store.used(), 6 * PS);
            assert_eq!(store.used(), 6 * PS, "its pages, cached before the restart");
        });
        rt.shutdown_timeout(Duration::from_secs(10));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_of_a_hostile_block_size_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let w = writes(d.path(), 8);
        for (i, bs) in [granary_common::MAX_BLOCK_SIZE + 1, u64::MAX, PS - 1]
            .into_iter()
            .enumerate()
        {
            let header = pb::WriteFileHeader {
                inode: 20 + i as u64,
                version: 1,
                block_size: bs,
                ufs: None,
                mode: pb::WriteMode::MustCache as i32,
                persist: true,
                grant: None,
                finishes: true,
            };
            let (tx, mut rx) = mpsc::channel(8);
            let data = pb::WriteFileRequest {
                data: vec![1u8; 10].into(),
                ..Default::default()
            };
            w.clone()
                .receive(header, futures::stream::iter(vec![Ok(data)]), tx)
                .await;
            let e = rx.recv().await.unwrap().unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bs}: {e:?}");
        }
        assert_eq!(w.fetcher.store.used_and_reserved(), 0);
    }

    #[test]
    fn pages_end_at_page_and_block_boundaries() {
        // Blocks of 10 bytes, pages of 4: pages 0..4, 4..8, 8..10 per block.
        let mut c = PageCutter::new((7, 9), 10, 4);
        let data: Vec<u8> = (0..23).collect();
        let mut pages = Vec::new();
        for chunk in data.chunks(3) {
            pages.extend(c.push(chunk));
        }
        pages.extend(c.finish());
        let got: Vec<(u32, u32, usize, u8)> = pages
            .iter()
            .map(|((k, p), b)| (k.2, *p, b.len(), b[0]))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0, 4, 0),
                (0, 1, 4, 4),
                (0, 2, 2, 8),
                (1, 0, 4, 10),
                (1, 1, 4, 14),
                (1, 2, 2, 18),
                (2, 0, 3, 20),
            ]
        );
        let all: Vec<u8> = pages.iter().flat_map(|(_, b)| b.to_vec()).collect();
        assert_eq!(all, data);
    }
}
