//! Short-circuit leases of this node's workers' block files (see [`crate::local`]):
//! taking and releasing leases, reading under them, and reporting the bytes read that way.
//! Passthrough opens, which hold leases too, are in [`super::passthrough`].

use super::*;

/// Warmed small files leased, checked and kept in one request at most (the worker leases at
/// most 64 `more` blocks besides the first).
pub(crate) const WARM_LEASE_GROUP: usize = 65;

/// Leases taken ahead of readers, and what decides when to take them.
#[derive(Default)]
pub(super) struct Ahead {
    /// A background lease request for the small files ahead of a reader is in flight.
    pub(super) leasing_ahead: AtomicBool,
    /// Lease windows being leased ahead of a sequential reader: (inode, version, block,
    /// window).
    pub(super) windows_ahead: Mutex<std::collections::HashSet<(u64, u64, u32, u32)>>,
    /// Where the last read served from leases ended, by inode (sequential detection of the
    /// fast path).
    pub(super) leased_ends: ReadEnds<u64>,
    /// The small file read last in each folder: parent → inode (name-order detection).
    pub(super) last_read_in_dir: Mutex<HashMap<u64, u64>>,
    /// Folders where a small file's lease at its open found it not cached, when: a cold
    /// epoch, whose other opens there ask for no lease for a while (see
    /// [`FileSystem::open_lease_paused`]).
    pub(super) open_lease_misses: Mutex<HashMap<u64, Instant>>,
}

impl FileSystem {
    /// Reads a range of a block from a same-node worker's block file under leases (see
    /// [`crate::local`]), one lease window at a time; `None`: read it over gRPC instead.
    pub(super) async fn read_local(
        &self,
        w: &pb::WorkerInfo,
        id: &pb::BlockId,
        offset: u64,
        len: u64,
    ) -> Option<Bytes> {
        let span = self.short_circuit.page_size() * u64::from(crate::local::LEASE_WINDOW_PAGES);
        if offset % span + len <= span {
            return self.read_local_window(w, id, offset, len).await;
        }
        let mut parts = Vec::new();
        let mut pos = offset;
        while pos < offset + len {
            let n = (span - pos % span).min(offset + len - pos);
            parts.push(self.read_local_window(w, id, pos, n).await?);
            pos += n;
        }
        Some(crate::transport::join(parts, len))
    }

    /// [`read_local`](Self::read_local) of a range inside one lease window.
    pub(super) async fn read_local_window(
        &self,
        w: &pb::WorkerInfo,
        id: &pb::BlockId,
        offset: u64,
        len: u64,
    ) -> Option<Bytes> {
        let try_read = |lease: Arc<LocalLease>| async move {
            let l = lease.clone();
            let res = tokio::task::spawn_blocking(move || l.read(offset, len))
                .await
                .unwrap_or(Err(Miss::Bad));
            (lease, res)
        };
        // Leases start at a window's first page: each window has its own.
        let window = self.short_circuit.window_of(offset);
        let first_page = window.saturating_mul(crate::local::LEASE_WINDOW_PAGES);
        let mut replaces = None;
        if let Some(lease) = self.short_circuit.lease(id, window) {
            let fresh = lease.fresh();
            match try_read(lease).await {
                (l, Ok(data)) => {
                    self.short_circuit
                        .count_read(l.worker_id, data.len() as u64);
                    return Some(data);
                }
                (_, Err(Miss::NotCached)) if fresh => return None,
                (l, Err(Miss::NotCached | Miss::Expiring | Miss::Outside)) => {
                    replaces = (l.worker_id == w.worker_id).then_some(l.id);
                }
                (_, Err(Miss::Bad)) => {
                    self.short_circuit.forget(id, window);
                    return None;
                }
            }
        } else if self.short_circuit.recently_missing(id) {
            return None;
        }
        let lease = self.take_lease(w, id, first_page, replaces, false).await?;
        match try_read(lease).await {
            (l, Ok(data)) => {
                self.short_circuit
                    .count_read(l.worker_id, data.len() as u64);
                Some(data)
            }
            (_, Err(Miss::Bad)) => {
                self.short_circuit.forget(id, window);
                None
            }
            (_, Err(_)) => None,
        }
    }

    /// The page size short-circuit leases are counted in (the workers' page size).
    pub(crate) fn short_circuit_page_size(&self) -> u64 {
        self.short_circuit.page_size()
    }

    /// Small files just warmed into `w`'s cache (one page each, see [`crate::warm`]):
    /// leased in one request, checked whole and kept open, as a file read and closed is —
    /// so the loader's open that follows is answered from the kept file on the kernel's
    /// request thread (passthrough), with no lease request and no read of its own. Files
    /// beyond the room left for kept files are left to their opens.
    pub(crate) async fn keep_warmed(
        self: &Arc<Self>,
        w: &pb::WorkerInfo,
        files: &[pb::FileStatus],
    ) {
        let ps = self.short_circuit.page_size();
        if !self.short_circuit.applies_to(w) {
            return;
        }
        let files: Vec<&pb::FileStatus> = files
            .iter()
            .filter(|f| f.length > 0 && f.length <= ps)
            .take(self.short_circuit.kept_room().min(WARM_LEASE_GROUP))
            .collect();
        let Some((first, rest)) = files.split_first() else {
            return;
        };
        let id = |f: &pb::FileStatus| pb::BlockId {
            inode: f.inode,
            version: f.version,
            index: 0,
        };
        let more = rest.iter().map(|f| id(f)).collect();
        let Some(l) = self
            .ask_lease_more(w, &id(first), 0, None, 0, true, more)
            .await
        else {
            return;
        };
        self.short_circuit.keep(&id(first), l);
        let me = self.clone();
        let files: Vec<(pb::BlockId, u64)> = files.iter().map(|f| (id(f), f.length)).collect();
        let _ = tokio::task::spawn_blocking(move || {
            let sc = &me.short_circuit;
            for (id, len) in files {
                let Some(l) = sc.lease(&id, 0) else {
                    continue; // not cached there after all: its open asks
                };
                // Checked now whatever an earlier check: the kept file is opened in
                // passthrough only when its own lease read it whole.
                let checked = l.verify_whole(len, true).is_some();
                drop(l); // the table's is the only reference again: it can be moved
                if checked {
                    sc.note_verified(&id);
                    sc.keep_open(&id, len);
                    me.metrics.warm_kept.inc();
                } else {
                    sc.done_with(&id, 0);
                }
            }
        })
        .await;
    }

    /// Asks `w` for a lease on a block it caches and opens the block file; `ahead`: taken
    /// ahead of a sequential reader (which is done with windows far behind it).
    pub(super) async fn take_lease(
        &self,
        w: &pb::WorkerInfo,
        id: &pb::BlockId,
        first_page: u32,
        replaces: Option<u64>,
        ahead: bool,
    ) -> Option<Arc<LocalLease>> {
        let more = if id.index == 0 && first_page == 0 {
            self.small_files_after(id.inode)
        } else {
            Vec::new()
        };
        let l = self
            .ask_lease_more(w, id, first_page, replaces, 0, false, more)
            .await?;
        if ahead {
            self.short_circuit.keep_ahead(id, l.clone());
        } else {
            self.short_circuit.keep(id, l.clone());
        }
        Some(l)
    }

    /// The blocks of the small files listed after `inode` (up to [`LEASE_AHEAD_FILES`]) that
    /// have no lease yet: leased together with it, a loader reading a folder file by file
    /// costs one lease request per batch rather than per file.
    pub(super) fn small_files_after(&self, inode: u64) -> Vec<pb::BlockId> {
        if lock(&self.meta.recent).get(&inode).is_none_or(|e| {
            e.status.length
                > self.short_circuit_page_size() * u64::from(crate::local::LEASE_WINDOW_PAGES)
        }) || !self.in_name_order(inode)
        {
            return Vec::new();
        }
        let small = self.short_circuit_page_size() * u64::from(crate::local::LEASE_WINDOW_PAGES);
        let next = lock(&self.meta.next_in_dir);
        let recent = lock(&self.meta.recent);
        let mut out = Vec::new();
        let mut cur = inode;
        for _ in 0..LEASE_AHEAD_FILES * 2 {
            let Some(n) = next.get(&cur).copied() else {
                break;
            };
            cur = n;
            let Some(crate::fs::meta::Recent { status: s, .. }) = recent.get(&n) else {
                continue;
            };
            let Some(id) = self.small_block_to_lease(s, small) else {
                continue;
            };
            out.push(id);
            if out.len() == LEASE_AHEAD_FILES {
                break;
            }
        }
        out
    }

    /// The only block of `s` when it is a small file (at most `small` bytes, one lease
    /// window) with no lease yet and not known to be uncached: worth leasing ahead.
    pub(super) fn small_block_to_lease(
        &self,
        s: &pb::FileStatus,
        small: u64,
    ) -> Option<pb::BlockId> {
        if s.kind != pb::FileKind::File as i32 || s.length == 0 || s.length > small {
            return None;
        }
        let id = pb::BlockId {
            inode: s.inode,
            version: s.version,
            index: 0,
        };
        let leased =
            self.short_circuit.lease(&id, 0).is_some() || self.short_circuit.kept(&id).is_some();
        (!leased && !self.short_circuit.recently_missing(&id)).then_some(id)
    }

    /// Asks `w` for a lease (see [`crate::local`]) and opens the block file.
    pub(super) async fn ask_lease(
        &self,
        w: &pb::WorkerInfo,
        id: &pb::BlockId,
        first_page: u32,
        replaces: Option<u64>,
        hold_ms: u64,
        whole_block: bool,
    ) -> Option<Arc<LocalLease>> {
        self.ask_lease_more(
            w,
            id,
            first_page,
            replaces,
            hold_ms,
            whole_block,
            Vec::new(),
        )
        .await
    }

    /// [`ask_lease`](Self::ask_lease), also leasing `more` blocks (kept for later reads).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn ask_lease_more(
        &self,
        w: &pb::WorkerInfo,
        id: &pb::BlockId,
        first_page: u32,
        replaces: Option<u64>,
        hold_ms: u64,
        whole_block: bool,
        more: Vec<pb::BlockId>,
    ) -> Option<Arc<LocalLease>> {
        let mut client = self.worker_client(&w.address).ok()?;
        let bytes_read = self.short_circuit.take_unreported(w.worker_id);
        let grants = self.held_grants(
            std::iter::once((id.inode, id.version))
                .chain(more.iter().map(|b| (b.inode, b.version))),
        );
        let mut req = tonic::Request::new(pb::LeaseLocalBlockRequest {
            grants,
            block: Some(*id),
            bytes_read,
            first_page,
            release_lease: replaces.unwrap_or(0),
            hold_ms,
            whole_block,
            more,
            release_leases: self.short_circuit.take_done(w.worker_id),
            reads_block_offset: true,
        });
        req.set_timeout(LEASE_TIMEOUT);
        let sent = Instant::now();
        let r = match tokio::time::timeout(LEASE_TIMEOUT, client.lease_local_block(req)).await {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(s)) => {
                match s.code() {
                    // Counted by the worker before it looked for the block.
                    tonic::Code::NotFound => self.short_circuit.note_missing(id),
                    tonic::Code::Unimplemented => {
                        self.short_circuit.mark_not_local(w.worker_id);
                        self.short_circuit.unreport(w.worker_id, bytes_read);
                    }
                    _ => self.short_circuit.unreport(w.worker_id, bytes_read),
                }
                return None;
            }
            Err(_) => {
                self.short_circuit.unreport(w.worker_id, bytes_read);
                return None;
            }
        };
        // A block in a tier this client cannot see (a memory tier private to the worker's
        // pod): the lease goes back, this block is read over gRPC for a while, and the
        // worker's other tiers stay readable directly.
        let path = std::path::Path::new(&r.path);
        let opened = if self.short_circuit.reachable(path) {
            LocalLease::open(w.worker_id, &r, sent)
                .map(|l| l.checked_by(id, self.short_circuit.page_checks()))
        } else {
            Err(std::io::Error::from(std::io::ErrorKind::NotFound))
        };
        match opened {
            Ok(l) => {
                self.short_circuit.set_page_size(r.page_size);
                self.metrics.short_circuit_leases.inc();
                for m in &r.more {
                    let reachable = self.short_circuit.reachable(std::path::Path::new(&m.path));
                    let opened = reachable.then(|| LocalLease::open(w.worker_id, m, sent));
                    let (Some(block), Some(Ok(l))) = (m.block, opened) else {
                        self.spawn_release(w.clone(), m.lease_id);
                        continue;
                    };
                    let l = l.checked_by(&block, self.short_circuit.page_checks());
                    self.metrics.short_circuit_leases.inc();
                    self.short_circuit.keep(&block, Arc::new(l));
                }
                Some(Arc::new(l))
            }
            Err(e) => {
                if self.short_circuit.reachable(path) && self.short_circuit.mark_unreachable(path) {
                    tracing::info!(worker = w.worker_id, path = %r.path, error = %e, "a same-host worker's cache tier is not visible here; reading that tier over gRPC");
                }
                self.short_circuit.note_missing(id);
                self.spawn_release(w.clone(), r.lease_id);
                None
            }
        }
    }

    pub(super) fn spawn_release(&self, w: pb::WorkerInfo, lease_id: u64) {
        let Ok(mut client) = self.worker_client(&w.address) else {
            return;
        };
        tokio::spawn(async move {
            let mut req = tonic::Request::new(pb::LeaseLocalBlockRequest {
                release_lease: lease_id,
                ..Default::default()
            });
            req.set_timeout(LEASE_TIMEOUT);
            let _ = client.lease_local_block(req).await;
        });
    }

    /// Reports bytes read by short-circuit to their workers (their
    /// `granary_worker_short_circuit_bytes_total`).
    pub async fn report_short_circuit(&self) {
        let mut pending: HashMap<u64, u64> = self
            .short_circuit
            .take_all_unreported()
            .into_iter()
            .collect();
        for w in self.short_circuit.workers_with_done() {
            pending.entry(w).or_default();
        }
        if pending.is_empty() {
            return;
        }
        let workers = self.live_workers().await;
        for (worker_id, bytes) in pending {
            let Some(w) = workers.iter().find(|w| w.worker_id == worker_id) else {
                self.short_circuit.take_done(worker_id);
                continue; // gone: nobody to report to
            };
            let Ok(mut client) = self.worker_client(&w.address) else {
                continue;
            };
            let mut req = tonic::Request::new(pb::LeaseLocalBlockRequest {
                block: None,
                bytes_read: bytes,
                release_leases: self.short_circuit.take_done(worker_id),
                ..Default::default()
            });
            req.set_timeout(LEASE_TIMEOUT);
            if client.lease_local_block(req).await.is_err() {
                self.short_circuit.unreport(worker_id, bytes);
            }
        }
    }
}
