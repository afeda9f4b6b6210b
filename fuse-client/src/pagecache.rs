//! The kernel's page cache of the mount's files, as far as this mount knows it, and small
//! files pushed into it ahead of a reader going through a folder in name order.
//!
//! An open keeps the kernel's pages of a file (`FOPEN_KEEP_CACHE`) only when the pages it
//! may hold are of the version being opened. A loader reading a folder of small files in
//! name order (`tar`, `cp -r`, a data loader over sorted sample files) pays one `READ` round
//! trip per file and waits on the block file's disk read. When such a reader's read of a
//! file reaches the daemon (the kernel did not hold it), the next files of the folder are
//! read from this node's worker (short-circuit leases already held, never the network) and
//! stored into the kernel's page cache (`FUSE_NOTIFY_STORE`), so the reader finds them
//! there. A reader whose files the kernel already holds sends no reads and gets no pushes;
//! a reader in random order is not seen as sequential and gets none either.
//!
//! Stale bytes are never stored for an open: a file's pages are pushed only when the pages
//! the kernel may hold are of the same version (or it holds none), and an open of another
//! version waits for a store of its file in progress to end before the reply that makes the
//! kernel drop its pages. A file opened before its push got to it is left to its reads; a
//! read of a file reaching the daemon while its push is reading it waits for the push's
//! bytes instead of reading the file a second time.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fuser::INodeNo;
use granary_client::FileSystem;
use granary_proto as pb;

use crate::fs::lock;

/// Files whose page-cache version is remembered; past this the table starts afresh, and
/// files it no longer knows are not pushed (their pages' version is unknown).
const VERSIONS_TRACKED: usize = 100_000;
/// The version of pages the kernel may hold when it is unknown (never a file's version).
const UNKNOWN: u64 = u64::MAX;
/// Files expected next (successors of files just opened) remembered at once.
const EXPECTED_TRACKED: usize = 1024;
/// Pushed files not opened since, remembered at once.
const PUSHED_TRACKED: usize = 4096;
/// Generations of pushes after one read showing the kernel lacks a folder's files: each
/// opened pushed file pushes the files after it with one less (about `ahead` × 128 files
/// in all; bounds what is pushed needlessly when the kernel holds the files after all).
const CHAIN_CREDIT: u32 = 128;
/// A file whose pages the kernel got this recently is taken to hold them still (the
/// files a reader ahead in the same folder opened are not pushed again).
const RECENT: Duration = Duration::from_secs(1);
/// Pushes in flight at once (each holds its file's bytes).
const PUSHES_IN_FLIGHT: usize = 16;
/// How long a push waits for a short-circuit lease before giving the file up.
const LEASE_WAIT: Duration = Duration::from_secs(2);
/// How long a read waits for the bytes of a push reading its file before reading them
/// itself (a push's read takes well under a millisecond; one waiting for a lease would
/// find the read waiting for the same lease).
const SHARE_WAIT: Duration = Duration::from_millis(100);

/// A push's read of its file, shared with reads of the file reaching the daemon meanwhile.
struct InFlight {
    version: u64,
    /// None until the push's read ends; then its bytes (None: it failed).
    bytes: Mutex<Option<Option<Bytes>>>,
    ready: Condvar,
    /// A read took the whole file: its reply gave the kernel every page, no store needed.
    taken: AtomicBool,
}

impl InFlight {
    fn new(version: u64) -> Self {
        Self {
            version,
            bytes: Mutex::new(None),
            ready: Condvar::new(),
            taken: AtomicBool::new(false),
        }
    }

    fn set(&self, bytes: Option<Bytes>) {
        let mut b = lock(&self.bytes);
        if b.is_none() {
            *b = Some(bytes);
            self.ready.notify_all();
        }
    }

    /// The push's bytes, waiting at most `within` for its read to end.
    fn wait(&self, within: Duration) -> Option<Bytes> {
        let b = lock(&self.bytes);
        let (b, _) = self
            .ready
            .wait_timeout_while(b, within, |b| b.is_none())
            .unwrap_or_else(|p| p.into_inner());
        b.clone().flatten()
    }
}

#[derive(Default)]
struct State {
    /// The version whose pages the kernel may hold, per file (its last open or push).
    versions: HashMap<u64, (u64, Instant)>,
    /// `versions` was emptied once: a file not in it may have pages of any version.
    forgot: bool,
    /// Files being stored into the kernel now, with the version.
    storing: HashMap<u64, u64>,
    /// Files a push is reading now (from when it starts until it ends).
    reading: HashMap<u64, Arc<InFlight>>,
    /// Files queued or pushed and not opened since, with the chain's credit: how many more
    /// files the opens of pushed files may push before a read reaching the daemon shows
    /// again that the kernel lacks the folder's files.
    pushed: HashMap<u64, u32>,
    /// Files a reader going through a folder in name order opens next (the successors of
    /// files just opened), with the file opened before each; oldest first.
    expected: HashMap<u64, u64>,
    expected_order: VecDeque<u64>,
    /// Files opened as such a successor whose first read has not reached the daemon yet,
    /// with the file opened before each.
    sequential: HashMap<u64, u64>,
    /// Files the kernel lacked lately (their first read reached the daemon, or they were
    /// pushed), with when.
    lacked: HashMap<u64, Instant>,
}

impl State {
    fn may_hold_only(&self, inode: u64, version: u64) -> bool {
        match self.versions.get(&inode) {
            Some(&(v, _)) => v == version,
            None => !self.forgot,
        }
    }

    /// Whether the kernel got the file's pages (an open or a push) within [`RECENT`]: it
    /// most likely holds them still.
    fn recent(&self, inode: u64, now: Instant) -> bool {
        self.versions
            .get(&inode)
            .is_some_and(|&(_, at)| now.saturating_duration_since(at) < RECENT)
    }

    /// Records that the kernel may hold pages of `version` (it gets them `now`); true when
    /// that was already so.
    fn note(&mut self, inode: u64, version: u64, now: Instant) -> bool {
        if self.versions.len() >= VERSIONS_TRACKED && !self.versions.contains_key(&inode) {
            self.versions.clear();
            self.forgot = true;
        }
        self.versions
            .insert(inode, (version, now))
            .is_some_and(|(v, _)| v == version)
    }

    fn expect(&mut self, inode: u64, after: u64) {
        if self.expected.insert(inode, after).is_none() {
            self.expected_order.push_back(inode);
            if self.expected_order.len() > EXPECTED_TRACKED {
                if let Some(old) = self.expected_order.pop_front() {
                    self.expected.remove(&old);
                }
            }
        }
    }

    /// An open of `inode` at `version` whose folder successor is `next`: None while pages
    /// of another version are being stored (the open waits); else whether the kernel may
    /// keep its pages, and the credit of the push chain the file was part of (0: none).
    fn open(
        &mut self,
        inode: u64,
        version: u64,
        next: Option<u64>,
        now: Instant,
    ) -> Option<(bool, u32)> {
        if self.storing.get(&inode).is_some_and(|&v| v != version) {
            return None;
        }
        let keep = self.note(inode, version, now);
        let credit = self.pushed.remove(&inode).unwrap_or(0);
        if let Some(prev) = self.expected.remove(&inode) {
            if self.sequential.len() >= EXPECTED_TRACKED {
                self.sequential.clear();
            }
            self.sequential.insert(inode, prev);
        }
        if let Some(n) = next {
            self.expect(n, inode);
        }
        Some((keep, credit))
    }

    /// Queues `inode` at `version` for a push with `credit` when that is safe and useful:
    /// not queued or being stored already, the kernel holding no pages of another version,
    /// and not just given them. A file queued already keeps the larger credit.
    fn queue(&mut self, inode: u64, version: u64, credit: u32, now: Instant) -> bool {
        if let Some(c) = self.pushed.get_mut(&inode) {
            *c = (*c).max(credit);
            return false;
        }
        if self.storing.contains_key(&inode)
            || !self.may_hold_only(inode, version)
            || self.recent(inode, now)
        {
            return false;
        }
        if self.pushed.len() >= PUSHED_TRACKED {
            self.pushed.clear();
        }
        self.pushed.insert(inode, credit);
        true
    }

    /// A queued push starts reading `inode` at `version`: None when it must not (opened
    /// before the push got to it: left to its reads, or read by another push now).
    fn start_read(&mut self, inode: u64, version: u64) -> Option<Arc<InFlight>> {
        if !self.pushed.contains_key(&inode) || self.reading.contains_key(&inode) {
            return None;
        }
        let slot = Arc::new(InFlight::new(version));
        self.reading.insert(inode, slot.clone());
        Some(slot)
    }

    fn end_read(&mut self, inode: u64, slot: &Arc<InFlight>) {
        if self
            .reading
            .get(&inode)
            .is_some_and(|s| Arc::ptr_eq(s, slot))
        {
            self.reading.remove(&inode);
        }
    }

    /// A push that read `inode` is about to store it at `version`: false when it must not
    /// (pages of another version may be held now: opened or changed meanwhile). An open of
    /// the same version meanwhile does not stop it: the bytes are that open's too.
    fn begin_store(&mut self, inode: u64, version: u64, now: Instant) -> bool {
        if !self.reading.contains_key(&inode)
            || self.storing.contains_key(&inode)
            || !self.may_hold_only(inode, version)
        {
            return false;
        }
        self.storing.insert(inode, version);
        self.note(inode, version, now);
        self.lacks(inode, now);
        true
    }

    /// The kernel lacks `inode` now (its first read reached the daemon, or it is pushed).
    fn lacks(&mut self, inode: u64, now: Instant) {
        if self.lacked.len() >= EXPECTED_TRACKED {
            self.lacked.clear();
        }
        self.lacked.insert(inode, now);
    }

    /// A read of `inode` from its start reached the daemon (the kernel lacks its first
    /// page): whether the files after it should be pushed — it was opened as the successor
    /// of a file the kernel lacked too, within [`RECENT`]. One such read alone (a page the
    /// kernel dropped from a folder it holds) starts nothing.
    fn read_from_start(&mut self, inode: u64, now: Instant) -> bool {
        let prev = self.sequential.remove(&inode);
        self.lacks(inode, now);
        prev.and_then(|p| self.lacked.get(&p))
            .is_some_and(|&at| now.saturating_duration_since(at) < RECENT)
    }

    /// The file changed through this mount: the version of its pages is unknown.
    fn forget(&mut self, inode: u64) {
        self.note(inode, UNKNOWN, Instant::now());
        self.pushed.remove(&inode);
    }

    /// A queued push ended without storing: the file's open must not move the chain on.
    fn not_pushed(&mut self, inode: u64) {
        if let Some(c) = self.pushed.get_mut(&inode) {
            *c = 0;
        }
    }
}

pub(crate) struct PageCache {
    state: Mutex<State>,
    notifier: OnceLock<fuser::Notifier>,
    client: Arc<FileSystem>,
    rt: tokio::runtime::Handle,
    /// Files pushed ahead of a reader (0: none).
    ahead: usize,
    /// Largest file pushed.
    max_len: u64,
    in_flight: AtomicUsize,
    /// Held by the push asking for leases (one lease request for pushes at a time).
    leasing: tokio::sync::Mutex<()>,
    budget: crate::prefetch::Budget,
    /// Files not to push (being written through this mount).
    busy: Box<dyn Fn(u64) -> bool + Send + Sync>,
}

impl PageCache {
    pub fn new(
        client: Arc<FileSystem>,
        rt: tokio::runtime::Handle,
        ahead: usize,
        max_len: u64,
        budget: crate::prefetch::Budget,
        busy: Box<dyn Fn(u64) -> bool + Send + Sync>,
    ) -> Self {
        Self {
            state: Mutex::new(State::default()),
            notifier: OnceLock::new(),
            client,
            rt,
            ahead,
            max_len,
            in_flight: AtomicUsize::new(0),
            leasing: tokio::sync::Mutex::new(()),
            budget,
            busy,
        }
    }

    /// The mount's channel to the kernel, once mounted.
    pub fn set_notifier(&self, n: fuser::Notifier) {
        let _ = self.notifier.set(n);
    }

    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.rt
    }

    /// Whether pages of another version of `s` than its own are being stored now.
    pub fn storing_other_version(&self, s: &pb::FileStatus) -> bool {
        lock(&self.state)
            .storing
            .get(&s.inode)
            .is_some_and(|&v| v != s.version)
    }

    /// The file changed through this mount (written, renamed, removed): the version of the
    /// pages the kernel holds is unknown until its next open, which drops them.
    pub fn forget(&self, inode: u64) {
        lock(&self.state).forget(inode);
    }

    /// The master announced that these inodes changed (the namespace watch): the kernel
    /// drops its attributes and cached pages of each now, rather than when its attribute
    /// timeout runs out or the file is next opened.
    pub fn changed(&self, inodes: &[u64], entries: &[(u64, String)]) {
        let Some(n) = self.notifier.get() else {
            return;
        };
        for &inode in inodes {
            lock(&self.state).forget(inode);
            // ENOENT: the kernel no longer knows the inode; nothing to drop.
            if let Err(e) = n.inval_inode(INodeNo(inode), 0, 0) {
                tracing::trace!(inode, error = %e, "kernel invalidation of a changed inode");
            }
        }
        for (parent, name) in entries {
            if let Err(e) = n.inval_entry(INodeNo(*parent), std::ffi::OsStr::new(name)) {
                tracing::trace!(parent, name, error = %e, "kernel invalidation of a name");
            }
        }
    }

    /// What a successor daemon of the mount needs to know of the kernel's pages: the
    /// version each file's pages are of, as (inodes, versions), and whether a file not
    /// listed may hold pages of any version (see `State::forgot`). Files being stored now
    /// are left out, and then a file not listed may hold any.
    pub fn hand_over(&self) -> (Vec<u64>, Vec<u64>, bool) {
        let st = lock(&self.state);
        let (inodes, versions) = st
            .versions
            .iter()
            .filter(|(i, _)| !st.storing.contains_key(*i))
            .map(|(i, (v, _))| (*i, *v))
            .unzip();
        (inodes, versions, st.forgot || !st.storing.is_empty())
    }

    /// Takes on what the previous daemon of the mount knew of the kernel's pages; `known`
    /// false (after a crash, or from a build that did not say): the kernel may hold pages
    /// of any version of any file, so none is pushed before its next open, and that open
    /// drops what the kernel holds.
    pub fn adopt(&self, inodes: &[u64], versions: &[u64], forgot: bool, known: bool) {
        let mut st = lock(&self.state);
        if !known || inodes.len() != versions.len() {
            st.forgot = true;
            return;
        }
        // Not recent: whether the kernel still holds them is not known.
        let then = Instant::now()
            .checked_sub(RECENT)
            .unwrap_or_else(Instant::now);
        for (i, v) in inodes.iter().zip(versions).take(VERSIONS_TRACKED) {
            st.versions.insert(*i, (*v, then));
        }
        st.forgot = forgot || inodes.len() > VERSIONS_TRACKED;
    }

    /// An open of `s` for reading: whether the kernel may keep its pages of the file (they
    /// are of this version). None while the kernel is being sent pages of another version
    /// of the file: the open must wait (its reply makes the kernel drop the pages it holds,
    /// which must come after the store).
    pub fn open(self: &Arc<Self>, s: &pb::FileStatus) -> Option<bool> {
        let next = (self.ahead > 0)
            .then(|| self.client.next_in_folder(s.inode))
            .flatten();
        let (keep, credit) = lock(&self.state).open(s.inode, s.version, next, Instant::now())?;
        // A pushed file opened: the chain moves on while it has credit.
        if credit > 0 {
            self.push_after(s, credit - 1);
        }
        Some(keep)
    }

    /// The bytes `offset..offset + size` of `file` from a push reading it now (same
    /// version), waiting briefly for its read to end; None when no push is reading it (or
    /// it failed, or took too long): the caller reads the file itself.
    pub fn pushed_bytes(&self, file: &pb::FileStatus, offset: u64, size: u32) -> Option<Bytes> {
        let slot = lock(&self.state)
            .reading
            .get(&file.inode)
            .filter(|s| s.version == file.version)
            .cloned()?;
        let data = slot.wait(SHARE_WAIT)?;
        let len = data.len() as u64;
        if offset >= len {
            return None;
        }
        let end = len.min(offset.saturating_add(u64::from(size)));
        if offset == 0 && end == len {
            slot.taken.store(true, Ordering::Release);
        }
        self.client.metrics.push_shared_bytes.inc_by(end - offset);
        Some(data.slice(offset as usize..end as usize))
    }

    /// The daemon is reading `file` from its start (the kernel lacks its first page): when
    /// a reader going through the folder in name order opened it right after a file the
    /// kernel lacked too, the files after it are pushed into the kernel in the background,
    /// and so on as the reader opens them (see [`CHAIN_CREDIT`]). Two files in a row make
    /// the rule: the kernel drops a page of a file now and then, and one read of it in a
    /// folder the kernel holds would push the whole folder again.
    pub fn read_from_start(self: &Arc<Self>, file: &pb::FileStatus) {
        if self.ahead > 0 && lock(&self.state).read_from_start(file.inode, Instant::now()) {
            self.push_after(file, CHAIN_CREDIT);
        }
    }

    /// Queues the next [`ahead`](Self::ahead) files after `file` in its folder that are not
    /// queued yet, each with `credit`; files being written through this mount are left out.
    fn push_after(self: &Arc<Self>, file: &pb::FileStatus, credit: u32) {
        if self.notifier.get().is_none() {
            return;
        }
        for f in self.client.fresh_entries_after(file.inode, self.ahead) {
            if f.kind != pb::FileKind::File as i32
                || f.length == 0
                || f.length > self.max_len
                || (self.busy)(f.inode)
            {
                continue;
            }
            if self.in_flight.load(Ordering::Acquire) >= PUSHES_IN_FLIGHT {
                return;
            }
            if !lock(&self.state).queue(f.inode, f.version, credit, Instant::now()) {
                continue;
            }
            let Some(permit) = self.budget.try_take(f.length) else {
                lock(&self.state).pushed.remove(&f.inode);
                return;
            };
            self.in_flight.fetch_add(1, Ordering::AcqRel);
            let me = self.clone();
            self.rt.spawn_blocking(move || {
                if !me.push(&f) {
                    lock(&me.state).not_pushed(f.inode);
                }
                me.in_flight.fetch_sub(1, Ordering::AcqRel);
                drop(permit);
            });
        }
    }

    /// Reads `f` from this node's worker under a short-circuit lease (held now, or taken
    /// for it) and stores it into the kernel's page cache. False when it was not (opened
    /// meanwhile, not cached on this node, another version seen meanwhile). Runs on a
    /// blocking thread.
    fn push(&self, f: &pb::FileStatus) -> bool {
        let Some(notifier) = self.notifier.get() else {
            return false;
        };
        let Some(slot) = lock(&self.state).start_read(f.inode, f.version) else {
            return false; // opened meanwhile: its reads fetch it
        };
        // Whatever happens, the read ends: reads waiting for its bytes go on.
        struct Reading<'a>(&'a Mutex<State>, u64, Arc<InFlight>);
        impl Drop for Reading<'_> {
            fn drop(&mut self) {
                self.2.set(None);
                lock(self.0).end_read(self.1, &self.2);
            }
        }
        let _reading = Reading(&self.state, f.inode, slot.clone());
        let leased = {
            let _rt = self.rt.enter(); // leases of the files ahead are asked for from a task
            self.client.read_leased(f, 0, f.length)
        };
        // No lease held yet (the leases taken ahead of reads lag behind the pushes): one
        // push at a time takes the lease, with the files after it, from this node's worker
        // (`read_local_file` reads a lease the push before it took as it is).
        let data = leased.or_else(|| {
            self.rt.block_on(async {
                let take = async {
                    let _one = self.leasing.lock().await;
                    self.client.read_local_file(f).await
                };
                tokio::time::timeout(LEASE_WAIT, take).await.ok().flatten()
            })
        });
        let Some(data) = data.filter(|d| d.len() as u64 == f.length) else {
            return false;
        };
        slot.set(Some(data.clone()));
        if slot.taken.load(Ordering::Acquire) {
            return true; // a read's reply gave the kernel the whole file
        }
        if !lock(&self.state).begin_store(f.inode, f.version, Instant::now()) {
            return false;
        }
        // Whatever happens, the store ends: opens of another version wait for that.
        struct Storing<'a>(&'a Mutex<State>, u64);
        impl Drop for Storing<'_> {
            fn drop(&mut self) {
                lock(self.0).storing.remove(&self.1);
            }
        }
        let storing = Storing(&self.state, f.inode);
        let stored = notifier.store(INodeNo(f.inode), 0, &data);
        drop(storing);
        match stored {
            Ok(()) => {
                self.client.metrics.pushed_bytes.inc_by(f.length);
                true
            }
            Err(e) => {
                tracing::debug!(inode = f.inode, error = %e, "storing a file into the kernel's page cache failed");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LATER: Duration = Duration::from_secs(5);

    #[test]
    fn an_open_keeps_the_pages_only_of_the_version_they_are_of() {
        let mut st = State::default();
        let t = Instant::now();
        assert_eq!(st.open(7, 1, None, t), Some((false, 0)), "first open");
        assert_eq!(st.open(7, 1, None, t), Some((true, 0)), "same version");
        assert_eq!(st.open(7, 2, None, t), Some((false, 0)), "new version");
    }

    #[test]
    fn pages_of_one_version_are_never_pushed_over_another() {
        let mut st = State::default();
        let t = Instant::now();
        st.open(7, 1, None, t);
        let later = t + LATER;
        assert!(!st.queue(7, 2, 10, later), "the kernel may hold version 1");
        assert!(st.queue(7, 1, 10, later));
        assert!(st.start_read(7, 1).is_some());
        // The file changed while its push read it: the store is refused.
        st.open(7, 2, None, later);
        assert!(!st.begin_store(7, 1, later));
        // Changed through this mount: nothing is pushed until an open says which version.
        st.forget(8);
        assert!(!st.queue(8, 1, 10, later));
        assert_eq!(st.open(8, 1, None, later), Some((false, 0)));
        assert!(st.queue(8, 1, 10, later + LATER));
    }

    #[test]
    fn an_open_of_another_version_waits_for_a_store_in_progress() {
        let mut st = State::default();
        let t = Instant::now();
        assert!(st.queue(7, 1, 10, t));
        assert!(st.start_read(7, 1).is_some());
        assert!(st.begin_store(7, 1, t));
        assert_eq!(st.open(7, 2, None, t), None, "must wait for the store");
        // The same version need not wait: the pages being stored are its own.
        assert_eq!(st.open(7, 1, None, t), Some((true, 10)));
        st.storing.remove(&7);
        assert_eq!(st.open(7, 2, None, t), Some((false, 0)));
    }

    #[test]
    fn a_file_opened_before_its_push_is_left_to_its_reads() {
        let mut st = State::default();
        let t = Instant::now();
        assert!(st.queue(7, 1, 10, t));
        assert!(!st.queue(7, 1, 20, t), "queued once");
        assert_eq!(
            st.open(7, 1, None, t),
            Some((false, 20)),
            "the larger credit"
        );
        assert!(st.start_read(7, 1).is_none(), "opened before the push");
        assert!(!st.begin_store(7, 1, t));
    }

    #[test]
    fn a_file_opened_while_its_push_reads_it_is_stored_only_at_the_version_opened() {
        let mut st = State::default();
        let t = Instant::now();
        assert!(st.queue(7, 1, 10, t));
        let slot = st.start_read(7, 1).unwrap();
        assert!(st.start_read(7, 1).is_none(), "one push reads a file");
        st.open(7, 1, None, t);
        assert!(st.begin_store(7, 1, t), "the open's own version");
        st.storing.remove(&7);
        st.end_read(7, &slot);
        assert!(st.reading.is_empty());
        assert!(st.queue(8, 1, 10, t));
        let slot = st.start_read(8, 1).unwrap();
        st.open(8, 2, None, t);
        assert!(!st.begin_store(8, 1, t), "opened at another version");
        st.end_read(8, &slot);
    }

    #[test]
    fn a_read_gets_the_bytes_of_the_push_reading_its_file() {
        let slot = Arc::new(InFlight::new(1));
        assert_eq!(slot.wait(Duration::from_millis(1)), None, "not read yet");
        let waiter = {
            let slot = slot.clone();
            std::thread::spawn(move || slot.wait(Duration::from_secs(60)))
        };
        slot.set(Some(Bytes::from_static(b"abc")));
        assert_eq!(waiter.join().unwrap().as_deref(), Some(&b"abc"[..]));
        slot.set(None); // the push's end changes nothing once its bytes are in
        assert_eq!(slot.wait(Duration::ZERO).as_deref(), Some(&b"abc"[..]));
        let failed = InFlight::new(1);
        failed.set(None);
        assert_eq!(
            failed.wait(Duration::from_secs(60)),
            None,
            "failed: no wait"
        );
    }

    #[test]
    fn files_the_kernel_just_got_are_not_pushed_again() {
        let mut st = State::default();
        let t = Instant::now();
        st.open(7, 1, None, t);
        assert!(!st.queue(7, 1, 10, t + RECENT / 2));
        assert!(st.queue(7, 1, 10, t + RECENT));
    }

    #[test]
    fn a_forgotten_table_pushes_only_files_it_knows() {
        let mut st = State::default();
        let t = Instant::now();
        for i in 0..VERSIONS_TRACKED as u64 {
            st.note(i, 1, t);
        }
        assert!(!st.forgot);
        st.note(u64::MAX - 1, 1, t); // one more: the table starts afresh
        assert!(st.forgot);
        assert!(
            !st.queue(3, 1, 10, t + LATER),
            "its pages' version is unknown"
        );
        assert!(st.queue(u64::MAX - 1, 1, 10, t + LATER));
    }

    #[test]
    fn pushes_start_when_two_files_in_a_row_reach_the_daemon() {
        let mut st = State::default();
        let t = Instant::now();
        st.open(1, 1, Some(2), t);
        st.open(2, 1, Some(3), t);
        // The kernel held file 1 (no read of it reached the daemon): file 2 alone is a
        // page the kernel dropped, not a folder it lacks.
        assert!(!st.read_from_start(2, t));
        st.open(3, 1, Some(4), t);
        assert!(st.read_from_start(3, t), "files 2 and 3 both lacked");
        assert!(!st.read_from_start(3, t), "once per open");
        // A file lacked longer ago than RECENT does not count.
        st.open(4, 1, Some(5), t + LATER);
        assert!(!st.read_from_start(4, t + LATER));
        // A pushed file counts as lacked: a read after the chain ran out starts it again.
        assert!(st.queue(5, 1, 1, t + LATER));
        assert!(st.start_read(5, 1).is_some());
        assert!(st.begin_store(5, 1, t + LATER));
        st.open(5, 1, Some(6), t + LATER);
        st.open(6, 1, Some(7), t + LATER);
        assert!(st.read_from_start(6, t + LATER));
    }

    #[test]
    fn a_successor_opened_next_is_a_sequential_reader() {
        let mut st = State::default();
        let t = Instant::now();
        st.open(1, 1, Some(2), t);
        st.open(2, 1, Some(3), t);
        assert!(st.sequential.contains_key(&2));
        assert!(!st.sequential.contains_key(&1));
        // Out of order: not sequential.
        st.open(9, 1, Some(10), t);
        assert!(!st.sequential.contains_key(&9));
        // A push that did not happen gives no credit to the open.
        assert!(st.queue(3, 1, 10, t));
        st.not_pushed(3);
        assert_eq!(st.open(3, 1, None, t), Some((false, 0)));
    }
}
