//! The namespace watch: a stream from the leader naming the inodes its state changes as it
//! applies them (`WatchNamespace`), so a mount can answer lookups, `stat`s and opens from
//! the statuses it already holds instead of asking the master for each — and drop them the
//! moment the master announces a change.
//!
//! A cached status is trusted beyond the mount's attribute timeout only when all of these
//! hold (see [`Watch::trusts`]):
//! - the watch has heard from the leader within [`SILENCE`] (the leader sends a heartbeat
//!   every half second, and only while a quorum confirms it is the leader);
//! - the request that fetched it was sent in the current *epoch* of the watch (an epoch
//!   ends whenever the stream breaks or the leader says the watcher must start over): the
//!   master answered it from a state whose later changes this watch announces;
//! - no change of its inode was announced after that request was sent (an announcement
//!   may overtake the reply it makes stale);
//! - its folder is not due to be listed again from the under-store: the master says how
//!   long in the status (`cache_ms`, from the mount's `sync_interval`), so objects added or
//!   changed in the store still appear on the same schedule as without a cache.
//!
//! What is not trusted is asked of the master as before; the watch only ever saves round
//! trips. A master without `WatchNamespace` (an older version) or a refused watch leaves
//! the mount on its attribute timeout alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use granary_proto as pb;

use crate::error::ClientError;

/// How long without a message from the leader before cached statuses are no longer
/// trusted (three heartbeats).
pub const SILENCE: Duration = Duration::from_millis(1500);
/// How long an announced change is remembered: longer than any master request may take,
/// so a reply to a request sent before the announcement is never trusted.
const CHANGE_MEMORY: Duration = Duration::from_secs(120);
/// Announced changes remembered at most (beyond this many within [`CHANGE_MEMORY`], the
/// epoch moves on: nothing fetched before is trusted).
const CHANGES_REMEMBERED: usize = 100_000;
/// Backoff between attempts to (re)open the watch.
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// When a request to the master was sent, as the watch saw it (see [`Watch::since`]).
#[derive(Clone, Copy, Debug)]
pub struct Since {
    epoch: u64,
    ms: u64,
}

/// Who hears about changed inodes, and about the names this client knew in changed
/// folders (the FUSE mount: it drops the kernel's caches of both).
pub type ChangeListener = Box<dyn Fn(&[u64], &[(u64, String)]) + Send + Sync>;

pub struct Watch {
    /// A fixed origin for the millisecond clocks below.
    origin: Instant,
    /// Added to the clock (tests move time on with it).
    skew_ms: AtomicU64,
    /// The current epoch (0: no watch yet; every status fetched in epoch 0 is untrusted).
    epoch: AtomicU64,
    /// Until when the watch is known live (ms since `origin`; 0: not live).
    live_until_ms: AtomicU64,
    /// Inodes announced changed lately → when (ms since `origin`).
    changed: Mutex<HashMap<u64, u64>>,
    listener: OnceLock<ChangeListener>,
}

impl Default for Watch {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            skew_ms: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            live_until_ms: AtomicU64::new(0),
            changed: Mutex::new(HashMap::new()),
            listener: OnceLock::new(),
        }
    }
}

use crate::fs::lock;

impl Watch {
    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64 + self.skew_ms.load(Ordering::Relaxed)
    }

    /// Taken before a request to the master: what its reply may be trusted as.
    pub fn since(&self) -> Since {
        let now = self.now_ms();
        Since {
            epoch: if self.live_at(now) {
                self.epoch.load(Ordering::Acquire)
            } else {
                0
            },
            ms: now,
        }
    }

    /// The epoch a status of `inode` fetched by a request sent at `since` belongs to: 0
    /// (never trusted beyond the attribute timeout) when the watch was not live then, its
    /// epoch has ended, or a change of `inode` was announced since.
    pub fn epoch_for(&self, inode: u64, since: Since) -> u64 {
        if since.epoch == 0
            || since.epoch != self.epoch.load(Ordering::Acquire)
            || lock(&self.changed)
                .get(&inode)
                .is_some_and(|&at| at >= since.ms)
        {
            return 0;
        }
        since.epoch
    }

    /// Whether no change of `inode` may have been announced since a request sent at
    /// `since`: false once a change was announced or the epoch ended; true when the watch
    /// was not live then (such a reply counts for the attribute timeout alone, as every
    /// status does without a watch).
    pub fn unchanged_since(&self, inode: u64, since: Since) -> bool {
        since.epoch == 0 || self.epoch_for(inode, since) != 0
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether the watch has heard from the leader lately.
    pub fn live(&self) -> bool {
        self.live_at(self.now_ms())
    }

    fn live_at(&self, now: u64) -> bool {
        now < self.live_until_ms.load(Ordering::Acquire)
    }

    /// Whether a status received in `epoch`, `age` ago, with `cache_ms` from the master,
    /// may still be used without asking the master.
    pub fn trusts(&self, epoch: u64, age: Duration, cache_ms: u64) -> bool {
        epoch != 0
            && epoch == self.epoch.load(Ordering::Acquire)
            && self.live_at(self.now_ms())
            && age.as_millis() < u128::from(cache_ms)
    }

    /// Sets who hears about changed inodes (once).
    pub fn on_change(&self, listener: ChangeListener) {
        let _ = self.listener.set(listener);
    }

    /// A new epoch: nothing fetched before is trusted any more.
    fn start_over(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// The stream broke: nothing is trusted until it is back.
    fn down(&self) {
        self.live_until_ms.store(0, Ordering::Release);
        self.start_over();
    }

    /// One message from the leader.
    fn heard(&self, m: &pb::NamespaceChanges) {
        if m.reset {
            self.start_over();
        }
        if !m.inodes.is_empty() {
            let now = self.now_ms();
            let memory = CHANGE_MEMORY.as_millis() as u64;
            let mut changed = lock(&self.changed);
            if changed.len() + m.inodes.len() > CHANGES_REMEMBERED {
                changed.retain(|_, at| now < *at + memory);
                if changed.len() + m.inodes.len() > CHANGES_REMEMBERED {
                    // Too many to remember: start over rather than trust a stale reply.
                    changed.clear();
                    self.start_over();
                }
            }
            for &i in &m.inodes {
                changed.insert(i, now);
            }
        }
        self.live_until_ms.store(
            self.now_ms() + SILENCE.as_millis() as u64,
            Ordering::Release,
        );
    }
}

impl crate::FileSystem {
    /// Starts the namespace watch in the background (a FUSE mount does; one-shot commands
    /// need none). Runs until the file system is dropped.
    pub fn start_watch(self: &Arc<Self>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak = Arc::downgrade(self);
        rt.spawn(async move {
            let mut backoff = RETRY_MIN;
            let mut warned = false;
            loop {
                let Some(fs) = weak.upgrade() else { return };
                match fs.master.watch_namespace().await {
                    Ok(stream) => {
                        if warned {
                            tracing::info!("namespace watch open again: cached statuses are used");
                            warned = false;
                        }
                        backoff = RETRY_MIN;
                        drop(fs);
                        if !Self::follow(&weak, stream).await {
                            return;
                        }
                    }
                    Err(e) => {
                        if !warned {
                            tracing::warn!(error = %e, "no namespace watch: lookups and opens ask the master once the attribute timeout has passed");
                            warned = true;
                        }
                        drop(fs);
                    }
                }
                if let Some(fs) = weak.upgrade() {
                    fs.meta.watch.down();
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RETRY_MAX);
            }
        });
    }

    /// Reads the watch until it breaks or goes silent; false when the file system is gone.
    async fn follow(
        weak: &std::sync::Weak<Self>,
        mut stream: tonic::Streaming<pb::NamespaceChanges>,
    ) -> bool {
        let mut first = true;
        loop {
            let next = tokio::time::timeout(SILENCE, stream.message()).await;
            let Some(fs) = weak.upgrade() else {
                return false;
            };
            match next {
                Ok(Ok(Some(m))) => {
                    fs.meta.watch.heard(&m);
                    if !m.inodes.is_empty() {
                        tracing::debug!(index = m.applied_index, inodes = ?m.inodes, "namespace changes announced");
                    }
                    if std::mem::take(&mut first) {
                        fs.metrics.watch_starts.inc();
                    }
                    if !m.inodes.is_empty() {
                        fs.metrics.watch_changes.inc_by(m.inodes.len() as u64);
                        fs.forget_changed(&m.inodes);
                    }
                }
                Ok(Ok(None)) => return true,
                Ok(Err(status)) => {
                    let e = ClientError::from_status(status);
                    tracing::debug!(error = %e, "namespace watch ended");
                    return true;
                }
                Err(_) => {
                    tracing::debug!("namespace watch silent; opening it again");
                    return true;
                }
            }
        }
    }

    /// Drops the cached statuses of changed inodes, and tells the listener (the FUSE
    /// mount) about those this client had handed out.
    fn forget_changed(&self, inodes: &[u64]) {
        let (known, folders): (Vec<u64>, Vec<u64>) = {
            let mut recent = lock(&self.meta.recent);
            let mut known = Vec::new();
            let mut folders = Vec::new();
            for i in inodes {
                if let Some(r) = recent.remove(i) {
                    known.push(*i);
                    if r.status.kind == pb::FileKind::Directory as i32 {
                        folders.push(*i);
                    }
                }
            }
            (known, folders)
        };
        if known.is_empty() {
            return;
        }
        // An entry of a changed folder may now name another inode, or none: the names
        // this client handed out there are dropped (the kernel asks again).
        let entries: Vec<(u64, String)> = if folders.is_empty() {
            Vec::new()
        } else {
            let mut names = lock(&self.meta.names);
            folders
                .iter()
                .flat_map(|&p| names.take_dir(p).into_iter().map(move |n| (p, n)))
                .collect()
        };
        if let Some(l) = self.meta.watch.listener.get() {
            l(&known, &entries);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(reset: bool, inodes: &[u64]) -> pb::NamespaceChanges {
        pb::NamespaceChanges {
            applied_index: 1,
            reset,
            inodes: inodes.to_vec(),
        }
    }

    fn advance(w: &Watch, d: Duration) {
        w.skew_ms.fetch_add(d.as_millis() as u64, Ordering::Relaxed);
    }

    const HOUR: u64 = 3_600_000;
    const AGE: Duration = Duration::from_secs(5);

    #[test]
    fn nothing_is_trusted_without_a_live_watch() {
        let w = Watch::default();
        assert_eq!(w.epoch_for(7, w.since()), 0, "no watch yet");
        assert!(!w.trusts(0, Duration::ZERO, u64::MAX));
        // A request sent before the watch began: its reply may predate what it announces.
        let early = w.since();
        w.heard(&msg(true, &[]));
        assert_eq!(w.epoch_for(7, early), 0);
        let e = w.epoch_for(7, w.since());
        assert_ne!(e, 0);
        assert!(w.trusts(e, AGE, HOUR));
        // Silence: the leader may be cut off.
        advance(&w, SILENCE);
        assert!(!w.trusts(e, AGE, HOUR));
        assert_eq!(w.epoch_for(7, w.since()), 0);
        // Heard again, same epoch: trusted again.
        w.heard(&msg(false, &[]));
        assert!(w.trusts(e, AGE, HOUR));
        // The stream broke: never again for statuses of that epoch.
        let during = w.since();
        w.down();
        w.heard(&msg(true, &[]));
        assert!(!w.trusts(e, AGE, HOUR));
        assert_eq!(w.epoch_for(7, during), 0, "a request sent in the old epoch");
        assert_ne!(w.epoch_for(7, w.since()), e);
    }

    #[test]
    fn a_status_is_trusted_only_as_long_as_its_folder_is_not_due_for_a_listing() {
        let w = Watch::default();
        w.heard(&msg(true, &[]));
        let e = w.epoch_for(7, w.since());
        assert!(w.trusts(e, Duration::from_millis(9_999), 10_000));
        assert!(!w.trusts(e, Duration::from_millis(10_000), 10_000));
        assert!(!w.trusts(e, Duration::from_millis(1), 0));
    }

    #[test]
    fn a_reply_to_a_request_sent_before_its_inode_changed_is_not_trusted() {
        let w = Watch::default();
        w.heard(&msg(true, &[]));
        let sent = w.since();
        advance(&w, Duration::from_millis(3));
        w.heard(&msg(false, &[7]));
        assert_eq!(w.epoch_for(7, sent), 0, "the change overtook the reply");
        assert_ne!(w.epoch_for(8, sent), 0, "other inodes are not concerned");
        advance(&w, Duration::from_millis(3));
        assert_ne!(w.epoch_for(7, w.since()), 0, "asked again after the change");
        // A reset from the leader (a snapshot installed, a watcher that fell behind).
        let e = w.epoch_for(8, w.since());
        w.heard(&msg(true, &[]));
        assert!(!w.trusts(e, Duration::ZERO, HOUR));
    }
}
