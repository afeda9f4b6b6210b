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
//!
//! Under a descriptor holder (`granary fuse --supervise`) every backing file registered, the
//! handles opened and released on those that are not parked, and every backing file closed
//! are told to the holder before the kernel is answered ([`Mirror`]). After a crash the
//! successor takes them on: handles of the dead daemon keep their backing file and leases
//! (closed after the last one's release, as if this daemon had opened them), and a parked
//! backing file, whose handles are not counted, stays the inode's for its next opens while
//! its block file is in place ("orphaned": the kernel refuses a second backing file for an
//! inode that a handle of the dead daemon may still read through).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use fuser::{BackingId, ReplyOpen};
use granary_client::local::Parkable;
use granary_client::metrics::ClientMetrics;
use granary_proto as pb;

use crate::handover::{now_ms, Mirror};

/// Backing files kept after their last close, at most (each is a kernel reference to a
/// block file and a little kernel memory).
pub const MAX_PARKED: usize = 65_536;

/// A backing file registered with the kernel: closed when dropped (the holder told first).
pub struct Registered {
    raw: u32,
    id: Option<BackingId>,
    mirror: Option<Slot>,
}

impl Registered {
    /// Registers `f` with the kernel through `reply` (the mount's channel).
    #[allow(unsafe_code)]
    fn open<F: std::os::fd::AsFd>(
        reply: &ReplyOpen,
        f: F,
        mirror: Option<Slot>,
    ) -> std::io::Result<Self> {
        let raw = reply.open_backing(f)?.into_raw();
        // SAFETY: `raw` was registered just above on this mount's channel and given up by
        // the `BackingId` that registered it (`into_raw`): the one made here is its only
        // owner.
        let id = unsafe { reply.wrap_backing(raw) };
        Ok(Self {
            raw,
            id: Some(id),
            mirror,
        })
    }

    /// A backing id of this mount's channel that this process owns (adopted).
    #[allow(unsafe_code)]
    fn wrap(reply: &ReplyOpen, raw: u32, mirror: Option<Slot>) -> Self {
        // SAFETY: `raw` is a backing id of this mount's FUSE session, opened by a previous
        // daemon, which gave it up (`BackingId::into_raw`) when it handed the mount over
        // and exited, or died; nothing else in this process holds or closes it, and it is
        // wrapped once: the `BackingId` made here is its only owner from now on.
        let id = unsafe { reply.wrap_backing(raw) };
        Self {
            raw,
            id: Some(id),
            mirror,
        }
    }

    /// The kernel's id, no longer closed by this process (handed to the next daemon).
    fn give_up(mut self) -> u32 {
        self.mirror = None;
        if let Some(id) = self.id.take() {
            id.into_raw()
        } else {
            self.raw
        }
    }
}

impl std::ops::Deref for Registered {
    type Target = BackingId;
    fn deref(&self) -> &BackingId {
        match &self.id {
            Some(id) => id,
            None => unreachable!("a backing file given up is not used"),
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if self.id.is_some() {
            if let Some(m) = self.mirror.as_ref().and_then(|m| m.get()) {
                m.send(&pb::FuseMirror {
                    closed: vec![self.raw],
                    ..Default::default()
                });
            }
        }
        // `id` closes the kernel's backing file as it drops.
    }
}

struct Backing {
    version: u64,
    id: Arc<Registered>,
    opens: usize,
    /// The open handles (fh) of a backing that is never parked, as the holder knows them;
    /// a parked kind's handles are not counted (its opens are the hot path).
    handles: HashSet<u64>,
    /// The client's lease handles (`PassthroughFile::handle`) holding the backing file's
    /// pages for its open handles: released at its last close, not at the close of the
    /// handle whose open took them (another may still read).
    leases: Vec<u64>,
    /// Set for a one-page block file checked whole: kept after its last close.
    park: Option<Parkable>,
    /// Stamp of its latest parking (matches its entry in the parking order).
    stamp: u64,
    /// Parked by a daemon of the mount that crashed, with handles of its own in unknown
    /// number: never let go for room, only when its block file is gone or replaced or the
    /// file has a new version.
    orphan: bool,
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
    /// Orphans in `map` ([`Backing::orphan`]).
    orphans: usize,
    stamp: u64,
    metrics: ClientMetrics,
    /// The holder this daemon's backing files are mirrored to, once set.
    mirror: Slot,
    /// Describes a lease handle of the client for the holder.
    describe: Option<Describe>,
    /// Lease handles of backings let go outside a close, released at the next close.
    to_release: Vec<u64>,
    /// Read handles answered without passthrough (the kernel's cached I/O mode), per
    /// inode: while one is open the kernel fails a passthrough open of the inode with EIO,
    /// as it fails a cached open while a passthrough handle is open.
    cached: HashMap<u64, usize>,
    /// The same handles by fh, with their inode (mirrored to the holder: after a crash the
    /// dead daemon's are known too).
    cached_fhs: HashMap<u64, u64>,
}

type Slot = Arc<OnceLock<Mirror>>;

/// What a lease handle of the client holds (`FileSystem::passthrough_leases`).
pub type Describe = Arc<dyn Fn(u64) -> Option<pb::FuseLeases> + Send + Sync>;

/// A backing handed over by the previous daemon of the mount, or left by one that crashed.
#[derive(Debug, Clone)]
pub struct Adopted {
    pub inode: u64,
    pub version: u64,
    /// The kernel's backing id, owned by this daemon now.
    pub id: u32,
    pub opens: usize,
    /// The open handles, where counted.
    pub handles: Vec<u64>,
    /// The client's lease handles holding its pages.
    pub leases: Vec<u64>,
    /// Parked by a daemon that crashed: its handles are not known ([`Backing::orphan`]).
    pub orphan: bool,
    pub park: Option<Parkable>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Backings {
    /// Whether programs hold `inode` open in passthrough (as far as this daemon knows:
    /// its own handles and those handed over to it): the kernel then fails any open of the
    /// inode that is not in passthrough with EIO, after the daemon has answered it.
    pub fn open_in_passthrough(&self, inode: u64) -> bool {
        self.map.get(&inode).is_some_and(|b| b.opens > 0)
            || self.adopted.iter().any(|a| a.inode == inode && a.opens > 0)
    }

    pub fn new(metrics: ClientMetrics) -> Self {
        Self {
            map: HashMap::new(),
            adopted: Vec::new(),
            order: VecDeque::new(),
            parked: 0,
            orphans: 0,
            stamp: 0,
            metrics,
            mirror: Arc::new(OnceLock::new()),
            describe: None,
            to_release: Vec::new(),
            cached: HashMap::new(),
            cached_fhs: HashMap::new(),
        }
    }

    fn set_parked(&mut self, n: usize) {
        self.parked = n;
        self.metrics.parked_backings.set(n as i64);
    }

    fn set_orphans(&mut self, n: usize) {
        self.orphans = n;
        self.metrics.fuse_orphan_backings.set(n as i64);
    }

    /// Tells `mirror` (the mount's descriptor holder) about this daemon's backing files
    /// from now on: all it has first, then every change. `describe` says what a lease
    /// handle of the client holds. Once per daemon.
    pub fn set_mirror(&mut self, mirror: Mirror, describe: Describe) {
        self.describe = Some(describe);
        let mut all: Vec<pb::FuseBacking> = self
            .map
            .iter()
            .map(|(inode, e)| self.describe_backing(*inode, e))
            .collect();
        all.extend(self.adopted.iter().map(|a| self.describe_adopted(a)));
        mirror.send(&pb::FuseMirror {
            snapshot: true,
            registered: all,
            cached_opened: self.cached_handles(),
            ..Default::default()
        });
        if self.mirror.set(mirror).is_err() {
            tracing::warn!("the mount's backing files are mirrored to a holder already");
        }
    }

    fn send(&self, m: pb::FuseMirror) {
        if let Some(mirror) = self.mirror.get() {
            mirror.send(&m);
        }
    }

    fn leases_of(&self, handles: &[u64]) -> Vec<pb::FuseLeases> {
        let Some(d) = &self.describe else {
            return Vec::new();
        };
        handles.iter().filter_map(|h| d(*h)).collect()
    }

    fn describe_backing(&self, inode: u64, e: &Backing) -> pb::FuseBacking {
        let mut b = pb::FuseBacking {
            inode,
            version: e.version,
            backing_id: e.id.raw,
            opens: u32::try_from(e.opens).unwrap_or(u32::MAX),
            leases: self.leases_of(&e.leases),
            opens_unknown: e.orphan || e.park.is_some() || e.handles.len() != e.opens,
            handles: e.handles.iter().copied().collect(),
            ..Default::default()
        };
        describe_park(&mut b, e.park.as_ref());
        b
    }

    fn describe_adopted(&self, a: &Adopted) -> pb::FuseBacking {
        let mut b = pb::FuseBacking {
            inode: a.inode,
            version: a.version,
            backing_id: a.id,
            opens: u32::try_from(a.opens).unwrap_or(u32::MAX),
            leases: self.leases_of(&a.leases),
            opens_unknown: a.orphan || a.handles.len() != a.opens,
            handles: a.handles.clone(),
            ..Default::default()
        };
        describe_park(&mut b, a.park.as_ref());
        b
    }

    /// The kernel's backing file for `version` of `inode` for a new open handle `fh`: the
    /// one registered (open or parked), or a new one from `file()`. None when there can be
    /// none: the file is open in another version, `file()` has none, or the kernel refused
    /// (then passthrough is off from now on, `on`). `lease` (0: none): the client's lease
    /// handle the open took for `file()`'s pages, kept with the backing when it is
    /// returned (the caller releases it on `None`).
    pub fn open<F: std::os::fd::AsFd>(
        &mut self,
        on: &AtomicBool,
        (inode, version): (u64, u64),
        reply: &ReplyOpen,
        (fh, lease): (u64, u64),
        file: impl FnOnce() -> Option<(F, Option<Parkable>)>,
    ) -> Option<Arc<Registered>> {
        if self.cached.contains_key(&inode) {
            return None; // the kernel holds it in cached I/O mode
        }
        let (id, new) = self.open_backing(on, (inode, version), reply, file)?;
        let mirroring = self.mirror.get().is_some();
        let e = self.map.get_mut(&inode)?;
        if lease != 0 {
            e.leases.push(lease);
        }
        let counted = e.park.is_none() && !e.orphan;
        if counted {
            e.handles.insert(fh);
        }
        if mirroring {
            if new {
                let b = self.describe_backing(inode, &self.map[&inode]);
                self.send(pb::FuseMirror {
                    registered: vec![b],
                    ..Default::default()
                });
            } else if counted {
                let leases = (lease != 0)
                    .then(|| self.leases_of(&[lease]).pop())
                    .flatten();
                self.send(pb::FuseMirror {
                    opened: vec![pb::FuseHandleEvent {
                        backing_id: id.raw,
                        fh,
                        leases,
                        ..Default::default()
                    }],
                    ..Default::default()
                });
            }
        }
        Some(id)
    }

    /// An open of `version` of `inode` about to be answered without passthrough: the
    /// backing file registered for it when there is one (the kernel takes only that one
    /// while a handle reads through it, and no cached open); else the handle is counted
    /// as one of cached I/O ([`closed_cached`](Self::closed_cached) at its release).
    /// `Err(())` while handles of another version of the file read it in passthrough: the
    /// kernel would fail the open (EIO); the caller answers EBUSY.
    pub fn open_registered_or_cached(
        &mut self,
        on: &AtomicBool,
        (inode, version): (u64, u64),
        reply: &ReplyOpen,
        fh: u64,
    ) -> Result<Option<Arc<Registered>>, ()> {
        let other_version_open = self
            .map
            .get(&inode)
            .map(|e| (e.version, e.opens))
            .into_iter()
            .chain(
                self.adopted
                    .iter()
                    .filter(|a| a.inode == inode)
                    .map(|a| (a.version, a.opens)),
            )
            .any(|(v, opens)| v != version && opens > 0);
        if other_version_open {
            return Err(());
        }
        if on.load(Ordering::Relaxed) {
            let none = || None::<(std::fs::File, Option<Parkable>)>;
            if let Some(id) = self.open(on, (inode, version), reply, (fh, 0), none) {
                return Ok(Some(id));
            }
        }
        self.opened_cached(inode, fh);
        Ok(None)
    }

    /// Read handle `fh` of `inode` in cached I/O mode (not passthrough) is open (again
    /// for one known already: nothing changes).
    pub fn opened_cached(&mut self, inode: u64, fh: u64) {
        if self.cached_fhs.insert(fh, inode).is_some() {
            return;
        }
        *self.cached.entry(inode).or_default() += 1;
        self.send_cached(true, fh, inode);
    }

    /// Handle `fh`, if one in cached I/O mode, was released.
    pub fn closed_cached(&mut self, fh: u64) {
        let Some(inode) = self.cached_fhs.remove(&fh) else {
            return;
        };
        if let Some(n) = self.cached.get_mut(&inode) {
            *n -= 1;
            if *n == 0 {
                self.cached.remove(&inode);
            }
        }
        self.send_cached(false, fh, inode);
    }

    /// Tells the holder that cached I/O handle `fh` of `inode` was `opened` (or released).
    fn send_cached(&self, opened: bool, fh: u64, inode: u64) {
        if self.mirror.get().is_none() {
            return;
        }
        let e = vec![pb::FuseHandleEvent {
            fh,
            inode,
            ..Default::default()
        }];
        let (cached_opened, cached_released) = if opened {
            (e, Vec::new())
        } else {
            (Vec::new(), e)
        };
        self.send(pb::FuseMirror {
            cached_opened,
            cached_released,
            ..Default::default()
        });
    }

    /// The read handles open in cached I/O mode, for the holder or the next daemon.
    pub fn cached_handles(&self) -> Vec<pb::FuseHandleEvent> {
        self.cached_fhs
            .iter()
            .map(|(fh, inode)| pb::FuseHandleEvent {
                fh: *fh,
                inode: *inode,
                ..Default::default()
            })
            .collect()
    }

    /// `open`'s backing file, and whether it was registered now.
    fn open_backing<F: std::os::fd::AsFd>(
        &mut self,
        on: &AtomicBool,
        (inode, version): (u64, u64),
        reply: &ReplyOpen,
        file: impl FnOnce() -> Option<(F, Option<Parkable>)>,
    ) -> Option<(Arc<Registered>, bool)> {
        if !self.adopted.is_empty() {
            self.wrap_adopted(reply);
        }
        let now = Instant::now();
        // An orphan due for a new check: kept if the checked file is the same block file.
        let mut orphan = None;
        if let Some(e) = self.map.get_mut(&inode) {
            let current = e.version == version && e.park.as_ref().is_none_or(|p| p.usable(now));
            if e.opens > 0 {
                // Handles of one inode share its backing; an older version's handles are
                // still open: this one reads through the daemon.
                if e.version != version {
                    return None;
                }
                e.opens += 1;
                return Some((e.id.clone(), false));
            }
            if current {
                e.opens = 1;
                let id = e.id.clone();
                if !e.orphan {
                    self.set_parked(self.parked - 1);
                }
                self.metrics.parked_opens.inc();
                return Some((id, false));
            }
            // Parked for an older version, or due for a new check.
            let e = self.map.remove(&inode)?;
            if !e.orphan {
                self.set_parked(self.parked - 1);
            } else if e.version == version {
                orphan = Some(e);
            } else {
                self.set_orphans(self.orphans.saturating_sub(1));
                self.to_release.extend(e.leases);
            }
        }
        let Some((f, park)) = file() else {
            if let Some(e) = orphan {
                self.map.insert(inode, e);
            }
            return None;
        };
        if let Some(mut e) = orphan {
            if let (Some(old), Some(new)) = (&e.park, &park) {
                if old.same_file(new) {
                    // Checked again and still the same block file: the dead daemon's
                    // handles and this one share it.
                    e.park = park;
                    e.opens = 1;
                    let id = e.id.clone();
                    self.map.insert(inode, e);
                    return Some((id, false));
                }
            }
            self.set_orphans(self.orphans.saturating_sub(1));
            self.to_release.append(&mut e.leases);
            tracing::debug!(
                inode,
                "a backing file a crashed daemon left is let go: its block file changed (a handle of that daemon still reading it makes the kernel refuse this open)"
            );
        }
        match Registered::open(reply, f, Some(self.mirror.clone())) {
            Ok(id) => {
                let id = Arc::new(id);
                self.map.insert(
                    inode,
                    Backing {
                        version,
                        id: id.clone(),
                        opens: 1,
                        handles: HashSet::new(),
                        leases: Vec::new(),
                        park,
                        stamp: 0,
                        orphan: false,
                    },
                );
                Some((id, true))
            }
            Err(e) => {
                tracing::warn!(error = %e, "the kernel refused a passthrough backing file; reads go through the daemon from now on");
                on.store(false, Ordering::Relaxed);
                None
            }
        }
    }

    /// Backings handed over by the previous daemon of the mount, or left by one that
    /// crashed ([`Adopted`]).
    pub fn adopt(&mut self, adopted: Vec<Adopted>) {
        self.adopted.extend(adopted);
    }

    /// Makes the adopted raw ids [`Registered`]s (closed when dropped) through `reply`, the
    /// mount's channel: those still open or orphaned join the registered backings, the
    /// others close.
    fn wrap_adopted(&mut self, reply: &ReplyOpen) {
        for a in std::mem::take(&mut self.adopted) {
            let id = Arc::new(Registered::wrap(reply, a.id, Some(self.mirror.clone())));
            if a.opens == 0 && !a.orphan {
                self.to_release.extend(a.leases);
                continue; // its handles were released meanwhile: closed here
            }
            if a.orphan {
                self.set_orphans(self.orphans + 1);
            }
            self.map.insert(
                a.inode,
                Backing {
                    version: a.version,
                    id,
                    opens: a.opens,
                    handles: a.handles.into_iter().collect(),
                    leases: a.leases,
                    park: a.park,
                    stamp: 0,
                    orphan: a.orphan,
                },
            );
        }
    }

    /// Hands the backings of open handles (and orphans) over to the next daemon of the
    /// mount: each becomes the kernel's raw id, no longer closed by this process; parked
    /// ones (no open handle) are closed. Backings still shared with a request in progress
    /// stay (none are once the handover gate has drained).
    pub fn hand_over(&mut self) -> Vec<Adopted> {
        let mut out = std::mem::take(&mut self.adopted);
        for (inode, e) in std::mem::take(&mut self.map) {
            if e.opens == 0 && !e.orphan {
                continue; // parked: dropping it closes the kernel's backing file
            }
            match Arc::try_unwrap(e.id) {
                Ok(id) => out.push(Adopted {
                    inode,
                    version: e.version,
                    id: id.give_up(),
                    opens: e.opens,
                    handles: e.handles.into_iter().collect(),
                    leases: e.leases,
                    orphan: e.orphan,
                    park: e.park,
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
        self.set_orphans(0);
        out
    }

    /// Handle `fh` of `inode`, open in passthrough, was released: after its last one the
    /// backing is parked when it may be (else closed). Returns the lease handles to release
    /// (those of its opens, after its last close).
    #[must_use]
    pub fn close(&mut self, inode: u64, fh: u64) -> Vec<u64> {
        let mut out = std::mem::take(&mut self.to_release);
        if let Some(a) = self.adopted.iter_mut().find(|a| a.inode == inode) {
            a.opens = a.opens.saturating_sub(1);
            let counted = a.handles.contains(&fh);
            a.handles.retain(|h| *h != fh);
            if a.opens == 0 && !a.orphan {
                out.append(&mut a.leases);
            } else if counted {
                let raw = a.id;
                self.send_released(raw, fh);
            }
            return out;
        }
        let Some(e) = self.map.get_mut(&inode) else {
            return out;
        };
        e.opens = e.opens.saturating_sub(1);
        let counted = e.handles.remove(&fh);
        if e.opens > 0 || e.orphan {
            // Still open; or left by a crashed daemon whose handles may still read it: it
            // stays the inode's (parked outside the parking order).
            if counted {
                let raw = e.id.raw;
                self.send_released(raw, fh);
            }
            return out;
        }
        out.append(&mut e.leases);
        if !e.park.as_ref().is_some_and(|p| p.usable(Instant::now())) {
            self.map.remove(&inode); // closes the kernel's backing file
            return out;
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
        out
    }

    fn send_released(&self, backing_id: u32, fh: u64) {
        self.send(pb::FuseMirror {
            released: vec![pb::FuseHandleEvent {
                backing_id,
                fh,
                leases: None,
                ..Default::default()
            }],
            ..Default::default()
        });
    }

    /// Lets go of `inode`'s backing if it is still the one parked at `stamp` (an orphan's
    /// stamp is 0: only the sweep lets it go).
    fn unpark(&mut self, inode: u64, stamp: u64) -> bool {
        let Some(e) = self.map.get(&inode) else {
            return false;
        };
        if e.opens != 0 || e.stamp != stamp {
            return false;
        }
        let orphan = e.orphan;
        if let Some(e) = self.map.remove(&inode) {
            self.to_release.extend(e.leases);
        }
        if orphan {
            self.set_orphans(self.orphans.saturating_sub(1));
        } else {
            self.set_parked(self.parked - 1);
        }
        true
    }

    /// The parked backings and orphans, to check outside the lock: (inode, stamp, block
    /// file, orphan).
    fn parked_list(&self) -> Vec<(u64, u64, Parkable, bool)> {
        self.map
            .iter()
            .filter(|(_, e)| e.opens == 0)
            .filter_map(|(i, e)| Some((*i, e.stamp, e.park.clone()?, e.orphan)))
            .collect()
    }
}

/// Describes a parked backing's block file for the holder.
pub fn describe_park(b: &mut pb::FuseBacking, park: Option<&Parkable>) {
    let Some(p) = park else { return };
    let (dev, ino) = p.identity();
    b.block_path = p.path().display().to_string();
    b.block_dev = dev;
    b.block_ino = ino;
    let left = p.until.saturating_duration_since(Instant::now());
    b.check_due_ms = now_ms().saturating_add(left.as_millis() as u64);
}

/// A parked backing's block file as the holder describes it.
pub fn park_of(b: &pb::FuseBacking) -> Option<Parkable> {
    if b.block_path.is_empty() {
        return None;
    }
    // A check is never due later than a full interval from now, whatever the value says.
    let left = Duration::from_millis(b.check_due_ms.saturating_sub(now_ms()))
        .min(granary_client::local::REVERIFY_AFTER);
    Some(Parkable::from_parts(
        b.block_path.clone().into(),
        b.block_dev,
        b.block_ino,
        Instant::now() + left,
    ))
}

/// Lets go of parked backings that are due for a new check or whose block files their
/// worker removed (blocking: a `stat` each). Returns how many went.
pub fn sweep(backings: &Mutex<Backings>) -> usize {
    let list = lock(backings).parked_list();
    let now = Instant::now();
    let gone: Vec<(u64, u64)> = list
        .into_iter()
        .filter(|(i, _, p, orphan)| {
            // An orphan is let go only once its block file is gone: a handle of the
            // crashed daemon may read through it (see `Backing::orphan`).
            let (due, removed) = (!orphan && !p.usable(now), p.removed());
            if due || removed {
                tracing::debug!(
                    inode = i,
                    due,
                    removed,
                    orphan,
                    "a parked backing file is let go"
                );
            }
            due || removed
        })
        .map(|(i, s, _, _)| (i, s))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_described_block_file_is_due_within_one_check_interval_whatever_it_says() {
        for due in [0, 1, now_ms(), u64::MAX] {
            let b = pb::FuseBacking {
                block_path: "/nowhere/block".into(),
                check_due_ms: due,
                ..Default::default()
            };
            let p = park_of(&b).unwrap();
            assert!(p.until <= Instant::now() + granary_client::local::REVERIFY_AFTER);
        }
        assert!(park_of(&pb::FuseBacking::default()).is_none());
    }
}
