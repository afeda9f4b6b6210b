//! Short-circuit leases of this node's workers' block files, and passthrough opens (see
//! [`crate::local`]): taking, renewing and releasing leases, reading under them, and
//! reporting the bytes read that way.

use futures::StreamExt;

use super::*;

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

    /// A file to open in FUSE passthrough mode: when every block of it is cached in one
    /// tier of a worker on this node, leases those blocks for as long as the file stays
    /// open (renewed in the background until [`close_passthrough`](Self::close_passthrough))
    /// after checking every page's CRC32C (at most once per [`crate::local::REVERIFY_AFTER`]
    /// for each block). The kernel then reads the file version's cache file itself — the
    /// file's bytes at the file's offsets, whatever its length: no daemon, no checksums on
    /// the way (see docs/semantics.md).
    pub async fn open_passthrough(&self, file: &pb::FileStatus) -> Option<PassthroughFile> {
        let bs = block_size(file);
        if file.length == 0 || file.kind != pb::FileKind::File as i32 {
            return None;
        }
        let blocks = u32::try_from(file.length.div_ceil(bs))
            .ok()
            .filter(|&n| n <= MAX_PASSTHROUGH_BLOCKS)?;
        let ids: Vec<pb::BlockId> = (0..blocks)
            .map(|index| pb::BlockId {
                inode: file.inode,
                version: file.version,
                index,
            })
            .collect();
        let workers = self.live_workers().await;
        let w = order_workers(&ids[0], &workers)
            .into_iter()
            .find(|w| self.short_circuit.applies_to(w))?;
        self.grant_for(file, false).await.ok()?;
        let hold = PASSTHROUGH_HOLD.as_millis() as u64;
        let leases: Vec<Option<Arc<LocalLease>>> = futures::stream::iter(ids.clone())
            .map(|id| {
                let w = &w;
                async move { self.ask_lease(w, &id, 0, None, hold, true).await }
            })
            .buffered(PASSTHROUGH_LEASES_IN_FLIGHT)
            .collect()
            .await;
        let release = |leases: &[Option<Arc<LocalLease>>]| {
            for l in leases.iter().flatten() {
                self.spawn_release(w.clone(), l.id);
            }
        };
        // Every block in one cache file (one tier), each at its offset in the file.
        let first_path = leases[0].as_ref().map(|l| l.path().to_path_buf());
        let one_file = leases.iter().zip(&ids).all(|(l, id)| {
            l.as_ref().is_some_and(|l| {
                Some(l.path()) == first_path.as_deref() && l.base() == u64::from(id.index) * bs
            })
        });
        if !one_file {
            if leases[0].is_none() {
                self.note_open_lease_miss(file);
            }
            release(&leases);
            return None;
        }
        let checks: Vec<bool> = ids
            .iter()
            .map(|id| self.short_circuit.needs_verify(id))
            .collect();
        let checked = {
            let (leases, checks, len) = (leases.clone(), checks.clone(), file.length);
            tokio::task::spawn_blocking(move || {
                let mut first = None;
                for (i, (l, check)) in leases.iter().zip(checks).enumerate() {
                    let l = l.as_ref()?;
                    let start = i as u64 * bs;
                    let f = l.verify_whole(bs.min(len - start), check)?;
                    first.get_or_insert(f);
                }
                // The cache file holds nothing past the file's end: the kernel reads it up
                // to its own length.
                first.filter(|f| f.metadata().is_ok_and(|m| m.len() == len))
            })
            .await
            .ok()
            .flatten()
        };
        let Some(f) = checked else {
            release(&leases);
            return None;
        };
        if file.length > self.short_circuit.page_size() {
            // The kernel reads the backing file with this descriptor's read-ahead, not the
            // reader's: a reader's own SEQUENTIAL hint (`cat`, fio) is not passed on, and
            // a shard read front to back got half the raw disk's read-ahead. Random reads
            // of a part of a file read only what they ask for either way.
            let _ = nix::fcntl::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
                0,
                nix::fcntl::PosixFadviseAdvice::POSIX_FADV_SEQUENTIAL,
            );
        }
        for (id, check) in ids.iter().zip(checks) {
            if check {
                self.short_circuit.note_verified(id);
            }
        }
        let leases: Vec<Arc<LocalLease>> = leases.into_iter().flatten().collect();
        if blocks == 1 && leases[0].one_page(file.length) {
            // Only ever removed whole: no lease needs to be held while the kernel reads it.
            self.short_circuit.queue_release(&leases[0]);
            let park = self
                .short_circuit
                .verified_at(&ids[0])
                .and_then(|at| crate::local::Parkable::new(&f, leases[0].path(), at));
            return Some(PassthroughFile {
                file: f,
                handle: 0,
                park,
                worker_id: w.worker_id,
            });
        }
        let handle = self
            .next_held
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let worker_id = w.worker_id;
        lock(&self.held).insert(
            handle,
            Held {
                worker: w,
                leases: ids.into_iter().zip(leases.iter().map(|l| l.id)).collect(),
                renewed: Instant::now(),
            },
        );
        Some(PassthroughFile {
            file: f,
            handle,
            park: None,
            worker_id,
        })
    }

    /// The file opened by [`open_passthrough`](Self::open_passthrough) was closed: its
    /// lease ends.
    pub fn close_passthrough(&self, handle: u64) {
        if let Some(h) = lock(&self.held).remove(&handle) {
            for (_, lease_id) in h.leases {
                self.spawn_release(h.worker.clone(), lease_id);
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

    /// Renews the leases of files open in passthrough mode that are due.
    pub(super) async fn renew_passthrough(&self) {
        let due: Vec<(u64, Held)> = lock(&self.held)
            .iter()
            .filter(|(_, h)| h.renewed.elapsed() >= PASSTHROUGH_RENEW)
            .map(|(k, h)| (*k, h.clone()))
            .collect();
        for (handle, h) in due {
            let hold = PASSTHROUGH_HOLD.as_millis() as u64;
            let Some(&(block, _)) = h.leases.first() else {
                continue;
            };
            // The file may stay open longer than its grant: a new one when due.
            let file = pb::FileStatus {
                inode: block.inode,
                version: block.version,
                ..Default::default()
            };
            if let Err(e) = self.grant_for(&file, false).await {
                tracing::warn!(inode = block.inode, error = %e, "cannot renew the read grant of a file open in passthrough mode");
            }
            let renewed: Vec<Option<Arc<LocalLease>>> = futures::stream::iter(h.leases.clone())
                .map(|(b, id)| {
                    let w = &h.worker;
                    async move { self.ask_lease(w, &b, 0, Some(id), hold, true).await }
                })
                .buffered(PASSTHROUGH_LEASES_IN_FLIGHT)
                .collect()
                .await;
            let mut held = lock(&self.held);
            let Some(e) = held.get_mut(&handle) else {
                drop(held);
                for l in renewed.iter().flatten() {
                    self.spawn_release(h.worker.clone(), l.id); // closed meanwhile
                }
                continue;
            };
            e.renewed = Instant::now();
            for ((b, lease_id), l) in e.leases.iter_mut().zip(renewed) {
                match l {
                    Some(l) => *lease_id = l.id,
                    None => tracing::warn!(
                        worker = h.worker.worker_id,
                        inode = b.inode,
                        block = b.index,
                        "cannot renew the lease of a file open in passthrough mode"
                    ),
                }
            }
        }
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
