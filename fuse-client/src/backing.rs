//! The kernel's backing files of files open in passthrough mode (one per inode, shared by
//! its open handles, as the kernel requires), and those kept after their last close:
//! "parked". A one-page block file checked whole is only ever removed by its worker, never
//! punched out, so the kernel may go on reading it without a lease; a parked backing lets
//! the file's next open pass it to the kernel at once — no lease request, no read through
//! the daemon, and no descriptor of this process held (a training loader reopens tens of
//! thousands of samples every epoch; open files are capped per process, kernel references
//! are not).
//!
//! A parked backing is let go when its file is due for a new check of its checksums
//! (`Parkable::until`), when its worker removed the block file (found by [`sweep`] within
//! `KEPT_SWEEP_EVERY`: the reference holds the file's disk space), when the file has a new
//! version, or when more than [`MAX_PARKED`] are parked (oldest first).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use fuser::{BackingId, ReplyOpen};
use granary_client::local::Parkable;
use granary_client::metrics::ClientMetrics;

/// Backing files kept after their last close, at most (each is a kernel reference to a
/// block file and a little kernel memory).
pub const MAX_PARKED: usize = 65_536;

struct Backing {
    version: u64,
    id: Arc<BackingId>,
    opens: usize,
    /// The client's lease handles (`PassthroughFile::handle`) holding the backing file's
    /// pages for its open handles: released at its last close, not at the close of the
    /// handle whose open took them (another may still read).
    leases: Vec<u64>,
    /// Set for a one-page block file checked whole: kept after its last close.
    park: Option<Parkable>,
    /// Stamp of its latest parking (matches its entry in the parking order).
    stamp: u64,
}

pub struct Backings {
    map: HashMap<u64, Backing>,
    /// Backings of handles a previous daemon of the mount opened (handed over with it),
    /// still as the kernel's raw ids: made [`BackingId`]s at the next open (they can only
    /// be wrapped through a reply), closed then if no handle uses them any more.
    adopted: Vec<Adopted>,
    /// Parked backings, oldest first, as (inode, stamp); entries whose backing was opened
    /// again or let go since are skipped.
    order: VecDeque<(u64, u64)>,
    parked: usize,
    stamp: u64,
    metrics: ClientMetrics,
}

/// A backing handed over by the previous daemon of the mount.
#[derive(Debug, Clone, PartialEq)]
pub struct Adopted {
    pub inode: u64,
    pub version: u64,
    /// The kernel's backing id, owned by this daemon now.
    pub id: u32,
    pub opens: usize,
    /// The client's lease handles holding its pages.
    pub leases: Vec<u64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Backings {
    pub fn new(metrics: ClientMetrics) -> Self {
        Self {
            map: HashMap::new(),
            adopted: Vec::new(),
            order: VecDeque::new(),
            parked: 0,
            stamp: 0,
            metrics,
        }
    }

    fn set_parked(&mut self, n: usize) {
        self.parked = n;
        self.metrics.parked_backings.set(n as i64);
    }

    /// The kernel's backing file for `version` of `inode` for a new open handle: the one
    /// registered (open or parked), or a new one from `file()`. None when there can be
    /// none: the file is open in another version, `file()` has none, or the kernel refused
    /// (then passthrough is off from now on, `on`). `lease` (0: none): the client's lease
    /// handle the open took for `file()`'s pages, kept with the backing when it is
    /// returned (the caller releases it on `None`).
    pub fn open<F: std::os::fd::AsFd>(
        &mut self,
        on: &AtomicBool,
        (inode, version): (u64, u64),
        reply: &ReplyOpen,
        lease: u64,
        file: impl FnOnce() -> Option<(F, Option<Parkable>)>,
    ) -> Option<Arc<BackingId>> {
        let id = self.open_backing(on, (inode, version), reply, file)?;
        if lease != 0 {
            if let Some(e) = self.map.get_mut(&inode) {
                e.leases.push(lease);
            }
        }
        Some(id)
    }

    fn open_backing<F: std::os::fd::AsFd>(
        &mut self,
        on: &AtomicBool,
        (inode, version): (u64, u64),
        reply: &ReplyOpen,
        file: impl FnOnce() -> Option<(F, Option<Parkable>)>,
    ) -> Option<Arc<BackingId>> {
        if !self.adopted.is_empty() {
            self.wrap_adopted(reply);
        }
        let now = Instant::now();
        if let Some(e) = self.map.get_mut(&inode) {
            let current = e.version == version && e.park.as_ref().is_none_or(|p| p.usable(now));
            if e.opens > 0 {
                // Handles of one inode share its backing; an older version's handles are
                // still open: this one reads through the daemon.
                if e.version != version {
                    return None;
                }
                e.opens += 1;
                return Some(e.id.clone());
            }
            if current {
                e.opens = 1;
                let id = e.id.clone();
                self.set_parked(self.parked - 1);
                self.metrics.parked_opens.inc();
                return Some(id);
            }
            // Parked for an older version, or due for a new check.
            self.map.remove(&inode);
            self.set_parked(self.parked - 1);
        }
        let (f, park) = file()?;
        match reply.open_backing(f) {
            Ok(id) => {
                let id = Arc::new(id);
                self.map.insert(
                    inode,
                    Backing {
                        version,
                        id: id.clone(),
                        opens: 1,
                        leases: Vec::new(),
                        park,
                        stamp: 0,
                    },
                );
                Some(id)
            }
            Err(e) => {
                tracing::warn!(error = %e, "the kernel refused a passthrough backing file; reads go through the daemon from now on");
                on.store(false, Ordering::Relaxed);
                None
            }
        }
    }

    /// Backings handed over by the previous daemon of the mount ([`Adopted`]).
    pub fn adopt(&mut self, adopted: Vec<Adopted>) {
        self.adopted.extend(adopted);
    }

    /// Makes the adopted raw ids [`BackingId`]s (closed when dropped) through `reply`, the
    /// mount's channel: those still open join the registered backings, the others close.
    #[allow(unsafe_code)]
    fn wrap_adopted(&mut self, reply: &ReplyOpen) {
        for a in std::mem::take(&mut self.adopted) {
            // SAFETY: `a.id` is a backing id of this mount's FUSE session, opened by the
            // previous daemon, which gave it up (`BackingId::into_raw`) when it handed the
            // mount over and exited; nothing else in this process holds or closes it, and it
            // is wrapped once: the `BackingId` made here is its only owner from now on.
            let id = Arc::new(unsafe { reply.wrap_backing(a.id) });
            if a.opens == 0 {
                continue; // its handles were released meanwhile: closed here
            }
            self.map.insert(
                a.inode,
                Backing {
                    version: a.version,
                    id,
                    opens: a.opens,
                    leases: a.leases,
                    park: None,
                    stamp: 0,
                },
            );
        }
    }

    /// Hands the backings of open handles over to the next daemon of the mount: each
    /// becomes the kernel's raw id, no longer closed by this process; parked ones (no open
    /// handle) are closed. Backings still shared with a request in progress stay (none are
    /// once the handover gate has drained).
    pub fn hand_over(&mut self) -> Vec<Adopted> {
        let mut out = std::mem::take(&mut self.adopted);
        for (inode, e) in std::mem::take(&mut self.map) {
            if e.opens == 0 {
                continue; // parked: dropping it closes the kernel's backing file
            }
            match Arc::try_unwrap(e.id) {
                Ok(id) => out.push(Adopted {
                    inode,
                    version: e.version,
                    id: id.into_raw(),
                    opens: e.opens,
                    leases: e.leases,
                }),
                Err(id) => {
                    tracing::warn!(
                        inode,
                        "a passthrough backing file in use cannot be handed over"
                    );
                    self.map.insert(inode, Backing { id, ..e });
                }
            }
        }
        self.order.clear();
        self.set_parked(0);
        out
    }

    /// A handle of `inode` open in passthrough was released: after its last one the backing
    /// is parked when it may be (else closed). Returns the lease handles to release (those
    /// of its opens, after its last close).
    #[must_use]
    pub fn close(&mut self, inode: u64) -> Vec<u64> {
        if let Some(a) = self.adopted.iter_mut().find(|a| a.inode == inode) {
            a.opens = a.opens.saturating_sub(1);
            return if a.opens == 0 {
                std::mem::take(&mut a.leases)
            } else {
                Vec::new()
            };
        }
        let Some(e) = self.map.get_mut(&inode) else {
            return Vec::new();
        };
        e.opens = e.opens.saturating_sub(1);
        if e.opens > 0 {
            return Vec::new();
        }
        let leases = std::mem::take(&mut e.leases);
        if !e.park.as_ref().is_some_and(|p| p.usable(Instant::now())) {
            self.map.remove(&inode); // closes the kernel's backing file
            return leases;
        }
        self.stamp += 1;
        e.stamp = self.stamp;
        self.order.push_back((inode, self.stamp));
        self.set_parked(self.parked + 1);
        while self.parked > MAX_PARKED {
            let Some((old, stamp)) = self.order.pop_front() else {
                break;
            };
            self.unpark(old, stamp);
        }
        if self.order.len() > 2 * MAX_PARKED {
            let map = &self.map;
            self.order
                .retain(|(i, s)| map.get(i).is_some_and(|e| e.opens == 0 && e.stamp == *s));
        }
        leases
    }

    /// Lets go of `inode`'s backing if it is still the one parked at `stamp`.
    fn unpark(&mut self, inode: u64, stamp: u64) -> bool {
        if self
            .map
            .get(&inode)
            .is_some_and(|e| e.opens == 0 && e.stamp == stamp)
        {
            self.map.remove(&inode);
            self.set_parked(self.parked - 1);
            return true;
        }
        false
    }

    /// The parked backings, to check outside the lock.
    fn parked_list(&self) -> Vec<(u64, u64, Parkable)> {
        self.map
            .iter()
            .filter(|(_, e)| e.opens == 0)
            .filter_map(|(i, e)| Some((*i, e.stamp, e.park.clone()?)))
            .collect()
    }
}

/// Lets go of parked backings that are due for a new check or whose block files their
/// worker removed (blocking: a `stat` each). Returns how many went.
pub fn sweep(backings: &Mutex<Backings>) -> usize {
    let list = lock(backings).parked_list();
    let now = Instant::now();
    let gone: Vec<(u64, u64)> = list
        .into_iter()
        .filter(|(i, _, p)| {
            let (due, removed) = (!p.usable(now), p.removed());
            if due || removed {
                tracing::debug!(inode = i, due, removed, "a parked backing file is let go");
            }
            due || removed
        })
        .map(|(i, s, _)| (i, s))
        .collect();
    let mut b = lock(backings);
    gone.into_iter().filter(|(i, s)| b.unpark(*i, *s)).count()
}

/// Sweeps `backings` every `every` until they are dropped.
pub fn spawn_sweeper(
    rt: &tokio::runtime::Handle,
    backings: Weak<Mutex<Backings>>,
    every: std::time::Duration,
) {
    rt.spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let Some(b) = backings.upgrade() else { break };
            let gone = tokio::task::spawn_blocking(move || sweep(&b))
                .await
                .unwrap_or(0);
            if gone > 0 {
                tracing::debug!(gone, "parked passthrough backing files let go");
            }
        }
    });
}
