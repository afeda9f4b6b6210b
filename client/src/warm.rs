//! Folder warming: a folder whose small files are being read in a random order while they
//! are not cached (the first epoch of a training job) has its other files fetched into the
//! cache in the background, many at a time, so the readers find them cached instead of
//! each waiting for its own fetch.
//!
//! A reader earns warming by its misses: nothing happens before [`WARM_AFTER_MISSES`]
//! files of a folder were read uncached, and the warm goes at most [`FILES_PER_MISS`]
//! files past the misses seen so far, in name order, one listing page at a time — so a
//! program reading a handful of files of a huge folder costs at most a bounded multiple
//! of what it read, and one sweeping the folder has it all cached ahead of it. Bytes are
//! bounded per folder (`--warm-folder-bytes`, and half of the cluster's cache capacity).
//!
//! A warm asks each file's owner worker to cache it, many files in one `CacheBlocks`
//! request, each under the caller's own read grant: the worker fetches, checks and caches
//! the pages as it would for a reader of the whole file (an older worker gets an ordinary
//! read of one byte of each page instead). It gives the caller nothing it could not read
//! itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use granary_proto::v1 as pb;

use crate::fs::{lock, FileSystem};
use crate::placement::order_workers;

/// Uncached files of a folder read before its warm starts.
pub const WARM_AFTER_MISSES: u64 = 8;
/// Files a warm may go ahead per uncached read seen in the folder.
pub const FILES_PER_MISS: u64 = 100;
/// Default bytes warmed per folder (`--warm-folder-bytes`).
pub const DEFAULT_WARM_FOLDER_BYTES: u64 = 4 << 30;
/// Warm reads in flight at once, all folders together.
const WARM_IN_FLIGHT: usize = 64;
/// Owners a warm group's requests go to at once.
const WARM_OWNERS_AT_ONCE: usize = 4;
/// One file's warm, and why it failed (`None`: cached now).
type Warmed = (pb::FileStatus, Option<crate::ClientError>);
/// Listing page of a warm.
const WARM_PAGE: u32 = 1000;
/// After a folder was warmed through, misses there start counting again only after this
/// long (a folder warmed once is not listed again and again while its readers catch up).
const WARM_AGAIN_AFTER: Duration = Duration::from_secs(60);
/// Warm reads that failed in a row before a folder's warm gives up (until
/// [`WARM_AGAIN_AFTER`]).
const WARM_MAX_FAILURES: u32 = 8;
/// Folders tracked at once.
const MAX_FOLDERS: usize = 4096;

/// What is known of one folder's warm.
#[derive(Debug, Default, Clone, PartialEq)]
struct Folder {
    /// Uncached reads of its files seen out of name order.
    misses: u64,
    /// The file of the last uncached read.
    last_miss: u64,
    /// Files warmed (or found not worth warming) so far.
    warmed: u64,
    /// Bytes asked for so far.
    bytes: u64,
    /// The warm goes on after this name.
    after: String,
    /// A warm task is running.
    running: bool,
    /// Warmed through, or given up: when.
    finished: Option<Instant>,
}

/// The warm state of a mount's folders (pure bookkeeping; [`FileSystem`] runs the warms).
#[derive(Default)]
pub struct Warmer {
    /// Bytes warmed per folder at most (0: warming is off).
    max_bytes: AtomicU64,
    folders: Mutex<HashMap<u64, Folder>>,
    slots: std::sync::OnceLock<Arc<tokio::sync::Semaphore>>,
}

/// A warm to run: the folder, and the name it goes on after.
#[derive(Debug, PartialEq)]
pub struct Start {
    pub parent: u64,
    pub after: String,
}

/// How a warm task stopped after a page.
#[derive(Debug, PartialEq)]
pub enum Next {
    /// Go on with the next page, after this name.
    Page(String),
    /// Wait for more misses (they start it again).
    Pause,
    /// Done with the folder.
    Done,
}

impl Warmer {
    pub fn new(max_bytes: u64) -> Self {
        Self {
            max_bytes: AtomicU64::new(max_bytes),
            ..Default::default()
        }
    }

    pub fn set_max_bytes(&self, n: u64) {
        self.max_bytes.store(n, Ordering::Relaxed);
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes.load(Ordering::Relaxed)
    }

    fn slots(&self) -> Arc<tokio::sync::Semaphore> {
        self.slots
            .get_or_init(|| Arc::new(tokio::sync::Semaphore::new(WARM_IN_FLIGHT)))
            .clone()
    }

    /// File `inode` of folder `parent` was read while not cached: a warm to start, if this
    /// miss earns one. `follows(prev)`: whether `inode` comes right after `prev` in the
    /// folder's name order — a reader going through the folder in name order (`cp -r`,
    /// `tar`) earns nothing (pushes ahead serve it, and it may stop anywhere).
    pub fn miss(&self, parent: u64, inode: u64, follows: impl Fn(u64) -> bool) -> Option<Start> {
        if self.max_bytes() == 0 {
            return None;
        }
        let mut m = lock(&self.folders);
        if m.len() >= MAX_FOLDERS && !m.contains_key(&parent) {
            m.retain(|_, f| f.running);
        }
        let f = m.entry(parent).or_default();
        if let Some(t) = f.finished {
            if t.elapsed() < WARM_AGAIN_AFTER {
                return None;
            }
            *f = Folder::default();
        }
        let prev = std::mem::replace(&mut f.last_miss, inode);
        if prev != 0 && (prev == inode || follows(prev)) {
            return None;
        }
        f.misses += 1;
        let earned = f.misses >= WARM_AFTER_MISSES && f.warmed < f.misses * FILES_PER_MISS;
        if f.running || !earned {
            return None;
        }
        f.running = true;
        Some(Start {
            parent,
            after: f.after.clone(),
        })
    }

    /// How many files and bytes the warm of `parent` may still take now.
    fn allowance(&self, parent: u64, cap: u64) -> (u64, u64) {
        let m = lock(&self.folders);
        m.get(&parent).map_or((0, 0), |f| {
            (
                (f.misses * FILES_PER_MISS).saturating_sub(f.warmed),
                cap.saturating_sub(f.bytes),
            )
        })
    }

    /// A page of `parent`'s warm is done: `files` and `bytes` taken, the page's last
    /// name, and whether it was the folder's last page (or the warm must stop: `give_up`).
    fn page_done(&self, parent: u64, files: u64, bytes: u64, last: &str, end: bool) -> Next {
        let mut m = lock(&self.folders);
        let Some(f) = m.get_mut(&parent) else {
            return Next::Done;
        };
        f.warmed += files;
        f.bytes += bytes;
        if !last.is_empty() {
            f.after = last.to_string();
        }
        if end {
            f.running = false;
            f.finished = Some(Instant::now());
            return Next::Done;
        }
        if f.warmed >= f.misses * FILES_PER_MISS {
            f.running = false;
            return Next::Pause;
        }
        Next::Page(f.after.clone())
    }

    /// The warm of `parent` stops (failures, the byte cap): not again before
    /// [`WARM_AGAIN_AFTER`].
    fn give_up(&self, parent: u64) {
        if let Some(f) = lock(&self.folders).get_mut(&parent) {
            f.running = false;
            f.finished = Some(Instant::now());
        }
    }
}

impl FileSystem {
    /// A one-block file was read from a worker that did not have all of it cached: may
    /// start warming its folder (see [`crate::warm`]).
    pub(crate) fn note_cold_read(self: &Arc<Self>, file: &pb::FileStatus) {
        let follows = |prev: u64| self.next_in_folder(prev) == Some(file.inode);
        let Some(start) = self.warmer.miss(file.parent, file.inode, follows) else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.warmer.give_up(start.parent);
            return;
        };
        let me = self.clone();
        rt.spawn(async move { me.warm_folder(start).await });
    }

    async fn warm_folder(self: Arc<Self>, start: Start) {
        let parent = start.parent;
        let workers = self.live_workers().await;
        // Never more than half of what the cluster can cache: a folder larger than that
        // would only push itself out again.
        let capacity: u64 = workers
            .iter()
            .map(|w| w.stats.as_ref().map_or(0, |s| s.capacity_bytes))
            .sum();
        let cap = self.warmer.max_bytes().min(capacity / 2);
        self.metrics.warm_folders.inc();
        tracing::debug!(parent, after = %start.after, cap, "warming a folder read at random while uncached");
        let mut after = start.after;
        let mut failures = 0u32;
        loop {
            let target = pb::path_or_id::Target::Inode(parent);
            let (entries, token) = match self.list_page(target, &after, WARM_PAGE).await {
                Ok(page) => page,
                Err(e) => {
                    tracing::debug!(parent, error = %e, "listing a folder to warm failed");
                    self.warmer.give_up(parent);
                    return;
                }
            };
            let (mut files_left, mut bytes_left) = self.warmer.allowance(parent, cap);
            let mut take = Vec::new();
            let mut last = String::new();
            let mut taken = 0u64;
            for e in &entries {
                if files_left == 0 {
                    break;
                }
                files_left -= 1;
                taken += 1;
                last = e.name.clone();
                let one_block = e.length <= crate::fs::block_size(e);
                if e.kind != pb::FileKind::File as i32 || !e.complete || e.length == 0 {
                    continue;
                }
                if !one_block || e.length > bytes_left {
                    continue;
                }
                bytes_left -= e.length;
                take.push((**e).clone());
            }
            let bytes: u64 = take.iter().map(|e| e.length).sum();
            let slots = self.warmer.slots();
            let me = &self;
            let mut failed = Vec::new();
            // In groups: each group's files are leased and kept for their readers' opens
            // while the next group is fetched.
            let mut keeping: Option<tokio::task::JoinHandle<()>> = None;
            for group in take.chunks(crate::fs::WARM_LEASE_GROUP) {
                let done = me.warm_group(group, &workers, &slots).await;
                let mut warmed = Vec::new();
                for (e, err) in done {
                    match err {
                        None => warmed.push(e),
                        Some(err) => failed.push(err),
                    }
                }
                if let Some(k) = keeping.take() {
                    let _ = k.await;
                }
                let mut by_owner: HashMap<u64, (pb::WorkerInfo, Vec<pb::FileStatus>)> =
                    HashMap::new();
                for e in warmed {
                    if let Some(w) = Self::owner_of(&e, &workers) {
                        by_owner
                            .entry(w.worker_id)
                            .or_insert((w, Vec::new()))
                            .1
                            .push(e);
                    }
                }
                let me = self.clone();
                keeping = Some(tokio::spawn(async move {
                    for (w, files) in by_owner.into_values() {
                        me.keep_warmed(&w, &files).await;
                    }
                }));
            }
            if let Some(k) = keeping.take() {
                let _ = k.await;
            }
            if failed.is_empty() {
                failures = 0;
            } else {
                failures += failed.len() as u32;
                tracing::debug!(parent, failed = failed.len(), first = %failed[0], "warm reads failed");
            }
            let whole_page = taken == entries.len() as u64;
            let end = entries.is_empty() || (token.is_empty() && whole_page);
            if failures >= WARM_MAX_FAILURES || bytes_left == 0 {
                self.warmer.page_done(parent, taken, bytes, &last, false);
                self.warmer.give_up(parent);
                return;
            }
            match self.warmer.page_done(parent, taken, bytes, &last, end) {
                Next::Page(a) => after = a,
                Next::Pause | Next::Done => return,
            }
        }
    }

    /// Has every file of `group` (one-block files) cached by its owner worker: one
    /// `CacheBlocks` stream per owner, each file under the caller's grant and holding a warm
    /// slot while the worker fetches it.
    async fn warm_group(
        &self,
        group: &[pb::FileStatus],
        workers: &[pb::WorkerInfo],
        slots: &Arc<tokio::sync::Semaphore>,
    ) -> Vec<Warmed> {
        let mut out = Vec::new();
        let mut by_owner: HashMap<u64, (pb::WorkerInfo, Vec<pb::FileStatus>)> = HashMap::new();
        for e in group {
            match Self::owner_of(e, workers) {
                Some(w) => by_owner
                    .entry(w.worker_id)
                    .or_insert((w, Vec::new()))
                    .1
                    .push(e.clone()),
                None => out.push((
                    e.clone(),
                    Some(crate::ClientError::unavailable("no live worker")),
                )),
            }
        }
        let done: Vec<Vec<Warmed>> = futures::stream::iter(by_owner.into_values())
            .map(|(w, files)| self.warm_on(w, files, workers, slots))
            .buffer_unordered(WARM_OWNERS_AT_ONCE)
            .collect()
            .await;
        out.extend(done.into_iter().flatten());
        out
    }

    /// [`warm_group`](Self::warm_group)'s stream to one owner: a file sent whenever a warm
    /// slot is free, the slot held until the worker answers it. A worker that does not know
    /// `CacheBlocks` (older) has each file read instead.
    async fn warm_on(
        &self,
        w: pb::WorkerInfo,
        files: Vec<pb::FileStatus>,
        workers: &[pb::WorkerInfo],
        slots: &Arc<tokio::sync::Semaphore>,
    ) -> Vec<Warmed> {
        let mut out = Vec::new();
        let mut pending = std::collections::VecDeque::with_capacity(files.len());
        for f in files {
            match self.warm_descriptor(&f).await {
                Ok((desc, grant)) => {
                    let b = pb::CacheBlock {
                        block: Some(desc),
                        grant,
                    };
                    pending.push_back((f, b));
                }
                Err(e) => out.push((f, Some(e))),
            }
        }
        if pending.is_empty() {
            return out;
        }
        // Each round of the worker's fetches gets a read's deadline.
        let rounds = 1 + pending.len().div_ceil(WARM_IN_FLIGHT) as u32;
        let timeout = self.read_timeout() * rounds;
        // The files sent and not answered yet, each holding its warm slot.
        let mut asked: HashMap<(u64, u64), (pb::FileStatus, tokio::sync::OwnedSemaphorePermit)> =
            HashMap::new();
        let answered = tokio::time::timeout(timeout, async {
            let mut client = self
                .worker_client(&w.address)
                .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
            let (tx, rx) = tokio::sync::mpsc::channel(WARM_IN_FLIGHT);
            let mut tx = Some(tx);
            let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            req.set_timeout(timeout);
            let mut results = client.cache_blocks(req).await?.into_inner();
            loop {
                tokio::select! {
                    // A file is sent when a warm slot frees, so a folder's warm keeps as
                    // many fetches in flight as there are slots, whatever the others do.
                    slot = slots.clone().acquire_owned(), if !pending.is_empty() => {
                        let (Ok(slot), Some((f, b)), Some(sender)) = (slot, pending.pop_front(), &tx) else {
                            break;
                        };
                        if let Err(unsent) = sender.send(b).await {
                            pending.push_front((f, unsent.0));
                            break;
                        }
                        asked.insert((f.inode, f.version), (f, slot));
                        if pending.is_empty() {
                            tx = None; // done asking
                        }
                    }
                    r = results.message() => {
                        let Some(r) = r? else { break };
                        let Some((f, _slot)) = r.block.and_then(|b| asked.remove(&(b.inode, b.version))) else {
                            continue;
                        };
                        out.push(self.warmed(f, &r));
                        if asked.is_empty() && pending.is_empty() {
                            break;
                        }
                    }
                }
            }
            Ok::<_, tonic::Status>(())
        })
        .await
        .unwrap_or_else(|_| {
            Err(tonic::Status::deadline_exceeded(format!(
                "worker {} did not cache the files within {timeout:?}",
                w.address
            )))
        });
        let left: Vec<pb::FileStatus> = asked
            .into_values()
            .map(|(f, _)| f)
            .chain(pending.into_iter().map(|(f, _)| f))
            .collect();
        match answered {
            Err(s) if s.code() == tonic::Code::Unimplemented => {
                // An older worker: a read of each file, as many at once as warms may be.
                let read: Vec<Warmed> = futures::stream::iter(left)
                    .map(|f| async move {
                        let Ok(_slot) = slots.clone().acquire_owned().await else {
                            return (f, None);
                        };
                        let err = self.warm_file(&f, workers).await.err();
                        (f, err)
                    })
                    .buffer_unordered(WARM_IN_FLIGHT)
                    .collect()
                    .await;
                out.extend(read);
            }
            Err(s) => {
                let e = crate::ClientError::from_status(s);
                out.extend(left.into_iter().map(|f| (f, Some(e.clone()))));
            }
            Ok(()) => out.extend(left.into_iter().map(|f| {
                let e = crate::ClientError::unavailable("the worker gave no answer for this file");
                (f, Some(e))
            })),
        }
        out
    }

    /// A file's warm as its owner answered it.
    fn warmed(&self, f: pb::FileStatus, r: &pb::LoadResult) -> Warmed {
        if r.error.is_empty() {
            self.metrics.warm_files.inc();
            self.metrics.warm_bytes.inc_by(f.length);
            return (f, None);
        }
        let e = match pb::LoadError::try_from(r.code) {
            Ok(pb::LoadError::NotFound) => crate::ClientError::not_found(&r.error),
            Ok(pb::LoadError::Denied) => crate::ClientError::denied(&r.error),
            Ok(pb::LoadError::Invalid) => crate::ClientError::invalid(&r.error),
            Ok(pb::LoadError::Changed) => crate::ClientError::stale(&r.error),
            _ => crate::ClientError::unavailable(&r.error),
        };
        (f, Some(e))
    }

    /// The first block of a one-block file as a warm names it, with the caller's grant (its
    /// terms in the descriptor).
    async fn warm_descriptor(
        &self,
        file: &pb::FileStatus,
    ) -> Result<(pb::BlockDescriptor, Option<pb::ReadGrant>), crate::ClientError> {
        let mut desc = Self::descriptor(file, 0)?;
        let grant = self.grant_for(file, false).await?;
        Self::with_grant_terms(&mut desc, grant.as_ref());
        Ok((desc, grant))
    }

    /// The worker that caches the first block of `file` (its placement owner).
    fn owner_of(file: &pb::FileStatus, workers: &[pb::WorkerInfo]) -> Option<pb::WorkerInfo> {
        let id = pb::BlockId {
            inode: file.inode,
            version: file.version,
            index: 0,
        };
        order_workers(&id, workers).into_iter().next()
    }

    /// Has every page of a one-block file fetched and cached by its owner worker (a read of
    /// the first byte of each page, under the caller's grant).
    async fn warm_file(
        &self,
        file: &pb::FileStatus,
        workers: &[pb::WorkerInfo],
    ) -> Result<(), crate::ClientError> {
        let owner = Self::owner_of(file, workers)
            .ok_or_else(|| crate::ClientError::unavailable("no live worker"))?;
        let (desc, grant) = self.warm_descriptor(file).await?;
        let ps = self.short_circuit_page_size().max(1);
        let mut pos = 0;
        while pos < file.length {
            self.read_from_worker(&owner.address, &desc, pos, 1, grant.clone())
                .await?;
            pos += ps;
        }
        self.metrics.warm_files.inc();
        self.metrics.warm_bytes.inc_by(file.length);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A miss of a new file of `parent`, out of name order.
    fn miss(w: &Warmer, parent: u64) -> Option<Start> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        w.miss(parent, NEXT.fetch_add(1, Ordering::Relaxed), |_| false)
    }

    #[test]
    fn warming_is_earned_by_misses_and_bounded_by_them() {
        let w = Warmer::new(1 << 30);
        for _ in 0..WARM_AFTER_MISSES - 1 {
            assert_eq!(miss(&w, 7), None);
        }
        assert_eq!(
            miss(&w, 7),
            Some(Start {
                parent: 7,
                after: String::new()
            })
        );
        // Running: more misses start nothing more.
        assert_eq!(miss(&w, 7), None);
        // 9 misses allow 900 files: a page of 1,000 stops the warm at 900.
        assert_eq!(w.allowance(7, 1 << 30), (900, 1 << 30));
        assert_eq!(w.page_done(7, 900, 900 << 10, "f0899", false), Next::Pause);
        assert_eq!(w.allowance(7, 1 << 30).0, 0);
        // The next miss allows 100 more, from where it stopped.
        assert_eq!(
            miss(&w, 7),
            Some(Start {
                parent: 7,
                after: "f0899".into()
            })
        );
        assert_eq!(w.allowance(7, 1 << 30), (100, (1 << 30) - (900 << 10)));
        assert_eq!(w.page_done(7, 50, 50 << 10, "f0949", true), Next::Done);
        // Warmed through: misses start nothing for a while.
        for _ in 0..100 {
            assert_eq!(miss(&w, 7), None);
        }
        // Other folders are counted on their own.
        assert_eq!(miss(&w, 8), None);
    }

    #[test]
    fn a_folder_warm_goes_on_page_by_page_while_misses_allow() {
        let w = Warmer::new(1 << 30);
        for _ in 0..WARM_AFTER_MISSES {
            miss(&w, 1);
        }
        for _ in 0..20 {
            miss(&w, 1); // running: counted, starts nothing
        }
        // 28 misses: 2,800 files.
        assert_eq!(w.page_done(1, 1000, 0, "a", false), Next::Page("a".into()));
        assert_eq!(w.page_done(1, 1000, 0, "b", false), Next::Page("b".into()));
        assert_eq!(w.page_done(1, 800, 0, "c", false), Next::Pause);
    }

    #[test]
    fn warming_off_or_given_up_starts_nothing() {
        let w = Warmer::new(0);
        for _ in 0..100 {
            assert_eq!(miss(&w, 1), None);
        }
        let w = Warmer::new(1 << 20);
        for _ in 0..WARM_AFTER_MISSES {
            miss(&w, 2);
        }
        w.give_up(2);
        for _ in 0..100 {
            assert_eq!(miss(&w, 2), None);
        }
    }

    #[test]
    fn name_order_readers_earn_no_warming() {
        let w = Warmer::new(1 << 30);
        // Files 1, 2, 3, ... of folder 5, each right after the one before.
        for i in 1..100u64 {
            assert_eq!(w.miss(5, i, |prev| prev + 1 == i), None);
        }
        // The same file missed again (several pages of one read) counts once.
        for _ in 0..20 {
            assert_eq!(w.miss(6, 42, |_| false), None);
        }
        assert_eq!(lock(&w.folders)[&6].misses, 1);
    }

    #[test]
    fn tracked_folders_are_bounded() {
        let w = Warmer::new(1 << 30);
        for p in 0..(MAX_FOLDERS as u64 * 3) {
            w.miss(p, 1012, |_| false);
        }
        assert!(lock(&w.folders).len() <= MAX_FOLDERS);
    }
}
