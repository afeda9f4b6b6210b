//! File handles across daemons of one mount (see `crate::handover`): handles carry the
//! generation of the daemon that gave them, a handle an earlier daemon gave is found again
//! by inode, and what a handover hands on (open handles, passthrough backing files, their
//! leases) is given up by one daemon and taken on by the next.

use super::*;

/// The read handles open through the mount, by handle, counted in
/// `granary_client_fuse_open_files`. A handle is entered before the kernel has the open's
/// reply: the kernel may send its RELEASE as soon as it has it, and a handle entered after
/// its release would stay forever (a successor would even take it for a program still
/// reading the file through the daemon, and refuse that file passthrough).
pub(crate) struct OpenFiles {
    map: Mutex<HashMap<u64, Arc<pb::FileStatus>>>,
    count: prometheus_client::metrics::gauge::Gauge,
}

impl OpenFiles {
    pub(crate) fn new(count: prometheus_client::metrics::gauge::Gauge) -> Self {
        count.set(0);
        Self {
            map: Mutex::new(HashMap::new()),
            count,
        }
    }

    fn counted<T>(&self, f: impl FnOnce(&mut HashMap<u64, Arc<pb::FileStatus>>) -> T) -> T {
        let mut m = lock(&self.map);
        let out = f(&mut m);
        self.count.set(i64::try_from(m.len()).unwrap_or(i64::MAX));
        out
    }

    pub(crate) fn insert(&self, fh: u64, s: Arc<pb::FileStatus>) {
        self.counted(|m| m.insert(fh, s));
    }

    /// The handle's file, entered now unless it was already.
    pub(crate) fn get_or_insert(&self, fh: u64, s: Arc<pb::FileStatus>) -> Arc<pb::FileStatus> {
        self.counted(|m| m.entry(fh).or_insert(s).clone())
    }

    pub(crate) fn remove(&self, fh: u64) -> Option<Arc<pb::FileStatus>> {
        self.counted(|m| m.remove(&fh))
    }

    pub(crate) fn get(&self, fh: u64) -> Option<Arc<pb::FileStatus>> {
        lock(&self.map).get(&fh).cloned()
    }

    /// Every handle and its file (for a handover).
    pub(crate) fn all(&self) -> Vec<(u64, Arc<pb::FileStatus>)> {
        lock(&self.map)
            .iter()
            .map(|(fh, s)| (*fh, s.clone()))
            .collect()
    }
}

/// File handles carry the generation of the daemon that gave them (so handles of an earlier
/// daemon of the mount are told apart after a takeover), whether they write, and a tag of
/// the file version they read: `[generation: 12][writer: 1][version tag: 11][count: 40]`.
const FH_COUNT_BITS: u32 = 40;
const FH_TAG_MASK: u64 = (1 << 11) - 1;
pub(super) const FH_WRITER: u64 = 1 << 51;
const FH_GENERATION_SHIFT: u32 = 52;

/// `fh` of a handle reading `version` of a file.
pub(super) fn tagged(fh: u64, version: u64) -> u64 {
    fh | ((version & FH_TAG_MASK) << FH_COUNT_BITS)
}

fn generation_of(fh: u64) -> u32 {
    (fh >> FH_GENERATION_SHIFT) as u32
}

/// Whether `fh` was given for `version` (of all versions, one in 2,048 shares a tag).
fn tag_matches(fh: u64, version: u64) -> bool {
    (fh >> FH_COUNT_BITS) & FH_TAG_MASK == version & FH_TAG_MASK
}

/// Bit of a request's unique id that marks a request the kernel sent again
/// (`FUSE_UNIQUE_RESEND`).
const RESENT: u64 = 1 << 63;

impl GranaryFs {
    /// A new file handle of this daemon.
    pub(super) fn new_fh(&self) -> u64 {
        let count = self.next_fh.fetch_add(1, Ordering::Relaxed) & ((1 << FH_COUNT_BITS) - 1);
        (u64::from(self.generation & 0xfff) << FH_GENERATION_SHIFT) | count
    }

    /// Counts a request the kernel sent again after a takeover.
    pub(super) fn note_resent(&self, req: &Request) {
        if req.unique().0 & RESENT != 0 {
            self.client.metrics.fuse_resent_requests.inc();
        }
    }

    /// Forgets what was found of handle `fh` of an earlier daemon (its release).
    pub(super) fn forget_dead(&self, fh: u64) {
        if self.earlier(fh) {
            lock(&self.dead_fhs).remove(&fh);
        }
    }

    /// Whether `fh` is a handle an earlier daemon of this mount gave.
    fn earlier(&self, fh: u64) -> bool {
        generation_of(fh) != self.generation & 0xfff
    }

    /// What read handle `fh` of `ino` was opened as. A handle an earlier daemon of the mount
    /// gave that this one was not handed (it crashed, or the open came during the
    /// handover) is found again by inode, once, on this kernel thread: the file's version
    /// must still carry the handle's tag, else the handle is stale (ESTALE, never bytes of
    /// another version).
    pub(super) fn file_of(&self, ino: u64, fh: u64) -> Result<Arc<pb::FileStatus>, Errno> {
        if let Some(f) = self.files.get(fh) {
            return Ok(f);
        }
        if !self.earlier(fh) || fh & FH_WRITER != 0 {
            return Err(Errno::EBADF);
        }
        // Found stale (or not a file) once: answered so at once from then on, not with a
        // call to the master on this kernel thread for every read of a program that loops.
        if let Some(e) = lock(&self.dead_fhs).get(&fh) {
            return Err(*e);
        }
        let dead = |e: Errno| {
            let mut d = lock(&self.dead_fhs);
            if d.len() >= DEAD_FHS {
                d.clear();
            }
            d.insert(fh, e);
            Err(e)
        };
        let client = self.client.clone();
        let s = self
            .rt
            .block_on(self.deadline.run("open", client.open_inode(ino)))
            .map_err(|e| errno(&e))?;
        if s.kind != pb::FileKind::File as i32 {
            return dead(Errno::EBADF);
        }
        if !tag_matches(fh, s.version) {
            tracing::warn!(inode = ino, path = %s.path, "a file open before the mount's daemon was replaced has changed since: its handle is stale");
            return dead(Errno::ESTALE);
        }
        self.client.metrics.fuse_recovered_handles.inc();
        let s = Arc::new(s);
        // Read through the daemon: a handle of the kernel's cached I/O mode.
        lock(&self.backings).opened_cached(s.inode, fh);
        Ok(self.files.get_or_insert(fh, s))
    }

    /// Directory handle `fh` of `ino`; one an earlier daemon of the mount gave is opened
    /// again by inode (its listing starts over; offsets stay those of the same order).
    pub(super) fn dir_of(
        &self,
        ino: u64,
        fh: u64,
    ) -> Result<Arc<tokio::sync::Mutex<DirHandle>>, Errno> {
        if let Some(h) = lock(&self.dirs).get(&fh) {
            return Ok(h.clone());
        }
        if !self.earlier(fh) {
            return Err(Errno::EBADF);
        }
        let dir = self
            .rt
            .block_on(self.deadline.run("opendir", self.client.stat_inode(ino)))
            .map_err(|e| errno(&e))?;
        if dir.kind != pb::FileKind::Directory as i32 {
            return Err(Errno::ENOTDIR);
        }
        self.client.metrics.fuse_recovered_handles.inc();
        let h = Arc::new(tokio::sync::Mutex::new(DirHandle::new(
            dir,
            self.walk.clone(),
        )));
        Ok(lock(&self.dirs).get_or_insert(fh, h))
    }

    /// Whether `fh`, not open for writing here, is a write handle an earlier daemon of the
    /// mount gave: what was written went with that daemon, the file was never completed,
    /// and the program is answered EIO (it must write the file again).
    pub(super) fn lost_writer(&self, fh: u64) -> bool {
        let lost = self.earlier(fh) && fh & FH_WRITER != 0;
        if lost {
            tracing::warn!(fh, "a file was being written when the mount's daemon was replaced: its writes are lost and it was not completed; answering EIO");
        }
        lost
    }

    /// What a handover to the next daemon of the mount needs of this filesystem.
    pub fn donor(&self) -> Donor {
        Donor {
            client: self.client.clone(),
            files: self.files.clone(),
            fhs: self.passthrough_fhs.clone(),
            backings: self.backings.clone(),
            gate: self.gate.clone(),
            quiesce: self.quiesce.clone(),
            kernel: self.kernel.clone(),
            cache: self.cache.clone(),
            writes: self.writes.clone(),
            generation: self.generation,
        }
    }

    /// Takes on the open handles, backing files and leases the previous daemon of the mount
    /// handed over.
    pub fn adopt(&self, h: &pb::FuseHandover) {
        let mut fhs = lock(&self.passthrough_fhs);
        let mut cached = Vec::new();
        for f in &h.files {
            if let Some(s) = &f.status {
                self.files.insert(f.fh, Arc::new(s.clone()));
                if f.passthrough {
                    fhs.insert(f.fh, s.inode);
                } else {
                    cached.push((s.inode, f.fh));
                }
            }
        }
        // Handles open in passthrough on counted backings (after a crash, only these are
        // known: the holder's mirror).
        for b in &h.backings {
            for fh in &b.handles {
                fhs.insert(*fh, b.inode);
            }
        }
        drop(fhs);
        // After a crash only the holder knows the dead daemon's handles.
        cached.extend(h.cached.iter().map(|c| (c.inode, c.fh)));
        let mut b = lock(&self.backings);
        for (inode, fh) in cached {
            b.opened_cached(inode, fh);
        }
        drop(b);
        adopt_backings(&self.client, &self.backings, h);
        self.cache.adopt(
            &h.page_inodes,
            &h.page_versions,
            h.pages_forgot,
            h.pages_known,
        );
    }
}

/// Takes on the backing files (raw kernel ids) and leases of `h`.
fn adopt_backings(
    client: &FileSystem,
    backings: &Mutex<crate::backing::Backings>,
    h: &pb::FuseHandover,
) {
    let adopted = h
        .backings
        .iter()
        .map(|b| crate::backing::Adopted {
            inode: b.inode,
            version: b.version,
            id: b.backing_id,
            opens: b.opens as usize,
            handles: b.handles.clone(),
            leases: b
                .leases
                .iter()
                .filter_map(|l| client.adopt_passthrough_leases(l.clone()))
                .collect(),
            orphan: b.opens_unknown,
            park: crate::backing::park_of(b),
        })
        .collect();
    lock(backings).adopt(adopted);
}

/// What a handover needs of a serving [`GranaryFs`] (which belongs to the FUSE session by
/// then).
#[derive(Clone)]
pub struct Donor {
    client: Arc<FileSystem>,
    files: Arc<OpenFiles>,
    fhs: Arc<Mutex<HashMap<u64, u64>>>,
    backings: Arc<Mutex<crate::backing::Backings>>,
    pub gate: Arc<Gate>,
    pub quiesce: Arc<crate::handover::Quiesce>,
    kernel: Arc<Mutex<Option<pb::FuseHandover>>>,
    cache: Arc<crate::pagecache::PageCache>,
    writes: crate::write::Writes,
    generation: u32,
}

impl Donor {
    /// Files open for writing, or being completed, through this mount.
    pub fn writing(&self) -> usize {
        self.writes.open_count()
    }

    /// The kernel's session as this daemon began it, with its generation and no handles
    /// (what a descriptor holder keeps); None before INIT.
    pub fn session(&self) -> Option<pb::FuseHandover> {
        let mut h = lock(&self.kernel).clone()?;
        h.format = crate::handover::FORMAT;
        h.generation = self.generation;
        Some(h)
    }

    /// Tells the mount's descriptor holder on `s` about this daemon's passthrough backing
    /// files from now on (see `crate::backing`).
    pub fn mirror_to(&self, s: std::os::unix::net::UnixStream) {
        let client = self.client.clone();
        let describe: crate::backing::Describe =
            Arc::new(move |handle| client.passthrough_leases(handle));
        lock(&self.backings).set_mirror(crate::handover::Mirror::new(s), describe);
    }

    /// Takes back the backing files and leases of a handover that did not reach its
    /// successor.
    pub fn take_back(&self, h: &pb::FuseHandover) {
        adopt_backings(&self.client, &self.backings, h);
    }

    /// The whole handover: the session and the open handles; this daemon gives up the
    /// backing files and leases of files open in passthrough (it must not serve the mount
    /// any more). Call with the gate closed and drained.
    pub fn hand_over(&self, mountpoint: &str) -> Option<pb::FuseHandover> {
        let mut h = self.session()?;
        h.mountpoint = mountpoint.to_string();
        h.donor_version = env!("CARGO_PKG_VERSION").to_string();
        (h.page_inodes, h.page_versions, h.pages_forgot) = self.cache.hand_over();
        h.pages_known = true;
        let fhs = lock(&self.fhs).clone();
        h.files = self
            .files
            .all()
            .into_iter()
            .map(|(fh, s)| pb::FuseOpenFile {
                fh,
                status: Some((*s).clone()),
                passthrough: fhs.contains_key(&fh),
            })
            .collect();
        h.cached = lock(&self.backings).cached_handles();
        let adopted = lock(&self.backings).hand_over();
        h.backings = adopted
            .into_iter()
            .map(|a| {
                let mut b = pb::FuseBacking {
                    inode: a.inode,
                    version: a.version,
                    backing_id: a.id,
                    opens: u32::try_from(a.opens).unwrap_or(u32::MAX),
                    leases: a
                        .leases
                        .iter()
                        .filter_map(|l| self.client.hand_over_passthrough_leases(*l))
                        .collect(),
                    opens_unknown: a.orphan,
                    handles: a.handles,
                    ..Default::default()
                };
                crate::backing::describe_park(&mut b, a.park.as_ref());
                b
            })
            .collect();
        Some(h)
    }
}
