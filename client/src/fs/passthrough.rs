//! FUSE passthrough opens: a file wholly cached on this node's worker is handed to the
//! kernel as that worker's cache file, under leases renewed while it stays open (see
//! docs/semantics.md for what is checked and when).

use futures::StreamExt;

use super::*;

/// Lease of a file open in passthrough mode, and how often it is renewed.
const PASSTHROUGH_HOLD: Duration = Duration::from_secs(60);
const PASSTHROUGH_RENEW: Duration = Duration::from_secs(20);

/// A file opened for FUSE passthrough: hand `file` to the kernel, call
/// [`FileSystem::close_passthrough`] with `handle` when it is closed.
pub struct PassthroughFile {
    pub file: std::fs::File,
    /// 0 when no lease is held: a one-page file, whose block file is never punched out
    /// under the kernel's reads (see `park`).
    pub handle: u64,
    /// Set for a one-page file: the kernel may keep reading the block file after the file
    /// is closed, until the next check is due (see [`crate::local::Parkable`]).
    pub park: Option<crate::local::Parkable>,
    /// The worker whose cache file it is.
    pub worker_id: u64,
}

/// The leases of a file open in passthrough mode: one per block, all of one worker.
#[derive(Clone)]
pub(super) struct Held {
    worker: pb::WorkerInfo,
    leases: Vec<(pb::BlockId, u64)>,
    renewed: Instant,
}

/// The files open in passthrough mode: their leases by handle.
pub(super) struct Handles {
    pub(super) held: Mutex<HashMap<u64, Held>>,
    pub(super) next: std::sync::atomic::AtomicU64,
}

impl Default for Handles {
    fn default() -> Self {
        Self {
            held: Mutex::new(HashMap::new()),
            next: std::sync::atomic::AtomicU64::new(1),
        }
    }
}

/// Blocks a file opened in passthrough may have (256 GiB in 64 MiB blocks); a longer file
/// is read through the daemon.
const MAX_PASSTHROUGH_BLOCKS: u32 = 4096;
/// Lease requests of one passthrough open (or renewal) in flight at once.
const PASSTHROUGH_LEASES_IN_FLIGHT: usize = 16;

impl FileSystem {
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
            .passthrough
            .next
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let worker_id = w.worker_id;
        lock(&self.passthrough.held).insert(
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
        if let Some(h) = lock(&self.passthrough.held).remove(&handle) {
            for (_, lease_id) in h.leases {
                self.spawn_release(h.worker.clone(), lease_id);
            }
        }
    }

    /// Gives up the leases of a file open in passthrough (`handle`) to the next daemon of
    /// the mount, which renews and releases them from now on
    /// ([`adopt_passthrough_leases`](Self::adopt_passthrough_leases)).
    pub fn hand_over_passthrough_leases(&self, handle: u64) -> Option<pb::FuseLeases> {
        let h = lock(&self.passthrough.held).remove(&handle)?;
        let (blocks, lease_ids) = h.leases.into_iter().unzip();
        Some(pb::FuseLeases {
            worker: Some(h.worker),
            blocks,
            lease_ids,
        })
    }

    /// What the leases of a file open in passthrough (`handle`) hold, for the mount's
    /// descriptor holder: a successor after a crash renews and releases them.
    pub fn passthrough_leases(&self, handle: u64) -> Option<pb::FuseLeases> {
        let held = lock(&self.passthrough.held);
        let h = held.get(&handle)?;
        let (blocks, lease_ids) = h.leases.iter().cloned().unzip();
        Some(pb::FuseLeases {
            worker: Some(h.worker.clone()),
            blocks,
            lease_ids,
        })
    }

    /// Takes over leases a previous daemon of the mount held for a file open in passthrough
    /// (renewed from now on as if this process had taken them); returns their handle.
    pub fn adopt_passthrough_leases(&self, l: pb::FuseLeases) -> Option<u64> {
        let worker = l.worker?;
        if l.blocks.len() != l.lease_ids.len() || l.blocks.is_empty() {
            return None;
        }
        let handle = self
            .passthrough
            .next
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        lock(&self.passthrough.held).insert(
            handle,
            Held {
                worker,
                leases: l.blocks.into_iter().zip(l.lease_ids).collect(),
                // Due for renewal at once: the previous daemon's last renewal is unknown.
                renewed: Instant::now()
                    .checked_sub(PASSTHROUGH_RENEW)
                    .unwrap_or_else(Instant::now),
            },
        );
        Some(handle)
    }

    /// Renews the leases of files open in passthrough mode that are due.
    pub(super) async fn renew_passthrough(&self) {
        let due: Vec<(u64, Held)> = lock(&self.passthrough.held)
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
            let mut held = lock(&self.passthrough.held);
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

    /// A file opened in passthrough mode (on `worker`, else this node's worker as last
    /// listed): the kernel reads the worker's cache file and the daemon sees none of the
    /// reads, so the open counts as a read of the whole file — what a loader does; for a
    /// reader of part of a big file, more than it read. The bytes go to the worker with
    /// the short-circuit reads (`report`'s hits and local reads).
    pub fn count_passthrough_open(&self, file: &pb::FileStatus, worker: Option<u64>) {
        self.metrics.passthrough_opens.inc();
        self.metrics.add_read("passthrough", file.length);
        let worker = worker.or_else(|| {
            lock(&self.routes.view)
                .workers
                .iter()
                .find(|w| self.short_circuit.same_node(w))
                .map(|w| w.worker_id)
        });
        if let Some(w) = worker {
            self.short_circuit.count_read(w, file.length);
        }
    }
}
