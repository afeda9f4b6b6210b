//! A folder listed from its under-store and merged into the namespace a page at a time
//! (see [`super::merge`]): each page's changes are proposed as `SyncDir` batches as soon as
//! the page came, and the last batch marks the folder listed. The leader holds one page of
//! the listing and one page of known children, whatever the folder's size (a store that
//! does not page, such as a local folder, answers the whole folder as its one page). A
//! listing that fails part-way keeps what the pages that came said and leaves alone what
//! is known past them; the failure is recorded and retried like any other.
//!
//! A folder never listed streams to its readers: the first page asked for starts its
//! listing on a task of its own, and each page of children is answered as soon as the
//! listing has decided every name up to its last (see [`Merge::decided_below`]) — the
//! first entries of a folder of a million objects reach `ls` after one request to the
//! store, not after all of them.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::sync::watch;

use granary_common::ufs::ListFailure;

use super::merge::{Changes, Known, Merge, MergeError};
use super::*;

/// How far a listing has come: every name below `decided_below` is as the listing says.
#[derive(Clone, Debug, Default)]
pub(super) struct Progress {
    decided_below: Option<String>,
    done: bool,
}

/// Listings readers wait on, by folder.
pub(super) type ProgressMap = Mutex<HashMap<u64, watch::Sender<Progress>>>;

/// How long a reader waits for a listing's progress before it checks that one still runs.
const PROGRESS_CHECK: Duration = Duration::from_secs(1);

impl Namespace {
    /// One page of children (`after`, `limit` as [`Namespace::list`]) of the folder `dir`,
    /// never listed, answered while its listing runs (started here when none does): as
    /// soon as the listing has decided every name up to the page's last. `None` when
    /// this cannot be (not the leader, no task to list on, the listing ended or never
    /// started): the caller lists as before.
    pub(super) async fn list_while_listing(
        &self,
        dir: &Inode,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Option<Vec<Inode>>, MasterError> {
        if dir.mount_id.is_none()
            || dir.kind != Kind::Directory
            || !self.leads()
            || self.backing_off(dir.id).is_some()
        {
            return Ok(None);
        }
        let mut rx = lock(&self.progress)
            .entry(dir.id)
            .or_insert_with(|| watch::channel(Progress::default()).0)
            .subscribe();
        if !matches!(
            self.list_in_background(dir.id),
            Background::Started | Background::Running
        ) {
            // Listed by this request itself (as before): nobody else waits on this entry.
            let mut map = lock(&self.progress);
            if map.get(&dir.id).is_some_and(|tx| tx.receiver_count() <= 1) {
                map.remove(&dir.id);
            }
            return Ok(None);
        }
        loop {
            let p = rx.borrow_and_update().clone();
            if p.done {
                return Ok(None);
            }
            // Read the page only once the listing has decided something past `after`.
            if let Some(below) = p
                .decided_below
                .as_deref()
                .filter(|b| after.is_none_or(|a| a < *b))
            {
                let page = self.sm.children(dir.id, after, limit)?;
                if page.len() == limit && page.last().is_some_and(|l| l.name.as_str() < below) {
                    return Ok(Some(page));
                }
            }
            match tokio::time::timeout(PROGRESS_CHECK, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Ok(None),
                // Still listing? (A task that found nothing to list sends nothing.)
                Err(_) => {
                    let running = lock(&self.relisting).contains(&dir.id)
                        || lock(&self.loading).contains_key(&dir.id);
                    if !running {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Tells readers waiting on a listing of `dir` how far it has come.
    fn listing_progress(&self, dir: u64, decided_below: Option<String>) {
        if let Some(tx) = lock(&self.progress).get(&dir) {
            tx.send_replace(Progress {
                decided_below,
                done: false,
            });
        }
    }

    /// A listing of `dir` ended (done or failed): readers waiting on it list as before.
    pub(super) fn listing_over(&self, dir: u64) {
        if let Some(tx) = lock(&self.progress).remove(&dir) {
            tx.send_replace(Progress {
                decided_below: None,
                done: true,
            });
        }
    }

    /// Lists `dir` and merges the listing into the namespace. Returns whether anything
    /// was proposed (nothing: the folder was loaded and the listing said what is known).
    pub(super) async fn merge_listing(
        &self,
        mount: &Mount,
        dir: &Inode,
        mount_id: u64,
    ) -> Result<bool, MasterError> {
        let ufs = self.ufs.get(mount)?;
        let location = ufs.path_of(&dir.ufs_path);
        // A handle (the family's guard must not be held across the listing).
        let requests = self
            .metrics
            .list_requests
            .get_or_create(&MountLabel {
                mount: mount.path.clone(),
            })
            .clone();
        let mut pages = ufs.folder_pages(&location, mount.spec.list_page_keys(), UFS_DEADLINE);
        let mut merge = Merge::default();
        let mut proposed = false;
        let result = loop {
            let (listing, last) = match pages.next().await {
                Ok(Some(page)) => page,
                Ok(None) => break Ok(proposed),
                Err(f) => break Err(self.listing_failed(mount, dir, f)),
            };
            let known = &mut |after: Option<&str>, n| {
                let page = self.sm.children(dir.id, after, n)?;
                Ok::<_, MasterError>(page.into_iter().map(Known::from).collect())
            };
            let changes = match merge.page(entries_of(&listing), last, known) {
                Ok(c) => c,
                Err(MergeError::Known(e)) => break Err(e),
                Err(MergeError::OutOfOrder(o)) => {
                    break Err(MasterError::Unavailable {
                        message: self.ufs.scrub(
                            mount,
                            &format!(
                                "listing {} in the under-store {} came out of order ({:?} after {:?}); keeping what is known",
                                shown(dir), mount.spec.uri, o.key, o.after
                            ),
                        ),
                    })
                }
            };
            // The last batch marks the folder listed: sent when something changed or the
            // folder was never listed; an unchanged re-listing is recorded apart.
            let mark = last && (proposed || !dir.children_loaded);
            if !changes.is_empty() || mark {
                if let Err(e) = self.propose_changes(dir, mount_id, changes, last).await {
                    break Err(e);
                }
                proposed = true;
            }
            if !last {
                self.listing_progress(dir.id, merge.decided_below());
            }
        };
        requests.inc_by(pages.requests() as u64);
        result
    }

    /// Proposes one page's changes, in batches small enough for one Raft entry each (a
    /// local folder of a million files is one page); `last` marks the folder listed with
    /// the final batch. Workers are then told which cached versions went stale.
    async fn propose_changes(
        &self,
        dir: &Inode,
        mount_id: u64,
        changes: Changes,
        last: bool,
    ) -> Result<(), MasterError> {
        let Changes {
            mut upserts,
            removed,
            retyped,
            seen,
            files,
        } = changes;
        self.purge_vanished(dir, &removed, &retyped, &seen).await?;
        // In name order: inodes a listing makes get numbers in the order listings read
        // them back, so a page's records lie together.
        upserts.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        let chunks = upserts
            .len()
            .div_ceil(SYNC_BATCH)
            .max(removed.len().div_ceil(SYNC_BATCH))
            .max(1);
        let (mut ups, mut rems) = (upserts.into_iter(), removed.into_iter());
        let mut in_flight = std::collections::VecDeque::new();
        for i in 0..chunks {
            let part: Vec<UfsEntry> = ups.by_ref().take(SYNC_BATCH).collect();
            let gone: Vec<String> = rems.by_ref().take(SYNC_BATCH).collect();
            let part_seen: BTreeMap<String, u64> = part
                .iter()
                .map(|e| e.name.as_str())
                .chain(gone.iter().map(String::as_str))
                .filter_map(|n| seen.get(n).map(|v| (n.to_string(), *v)))
                .collect();
            let marks = last && i + 1 == chunks;
            let cmd = Command::SyncDir {
                dir: dir.id,
                mount_id,
                entries: part,
                now_ms: granary_common::now_ms(),
                block_size: self.block_size,
                seen: Some(part_seen),
                batch: Some(crate::state::SyncBatch {
                    removed: gone,
                    last: marks,
                }),
            };
            // Batches are disjoint (names, in order), so several are in flight at once:
            // the next is encoded and sent while the last is replicated and applied. The
            // batch that marks the folder listed goes once every other batch has applied:
            // a listing that fails part-way never marks a folder listed with a batch missing.
            let ahead = if marks { 0 } else { SYNC_IN_FLIGHT - 1 };
            while in_flight.len() > ahead {
                if let Some(w) = in_flight.pop_front() {
                    w.await?;
                }
            }
            in_flight.push_back(self.raft.start_proposal(&cmd)?);
        }
        while let Some(w) = in_flight.pop_front() {
            w.await?;
        }
        for (name, inode, version) in files {
            match self.sm.child(dir.id, &name)? {
                Some(c) if c.id == inode && c.version == version => {}
                Some(c) if c.id == inode => self.blocks.note_stale(inode, c.version),
                _ => self.blocks.note_stale(inode, 0),
            }
        }
        Ok(())
    }

    /// The error of a listing that failed, its message scrubbed of secrets.
    fn listing_failed(&self, mount: &Mount, dir: &Inode, failure: ListFailure) -> MasterError {
        let (at, uri) = (shown(dir), &mount.spec.uri);
        let (text, denied) = match &failure {
            ListFailure::Store { error, .. } => (
                format!("listing {at} in the under-store {uri} failed: {error}"),
                granary_common::ufs::is_access_denied(error),
            ),
            ListFailure::TimedOut { pages: 0 } => (
                format!(
                    "listing {at} in the under-store {uri} did not finish within {UFS_DEADLINE:?}"
                ),
                false,
            ),
            ListFailure::TimedOut { pages } => (
                format!(
                    "listing {at} in the under-store {uri}: page {} did not come within {UFS_DEADLINE:?}",
                    pages + 1
                ),
                false,
            ),
            ListFailure::Endless { pages } => (
                format!("listing {at} in the under-store {uri} did not end after {pages} pages"),
                false,
            ),
        };
        let message = self.ufs.scrub(mount, &text);
        if denied {
            MasterError::PermissionDenied { message }
        } else {
            MasterError::Unavailable { message }
        }
    }
}

/// A folder's path in its store, as messages show it.
fn shown(dir: &Inode) -> &str {
    if dir.ufs_path.is_empty() {
        "/"
    } else {
        &dir.ufs_path
    }
}

/// One page of a listing as entries (names Granary cannot show included: the merge needs
/// every key to know how far the page reached, and leaves them out itself).
fn entries_of(listing: &object_store::ListResult) -> Vec<UfsEntry> {
    let dirs = listing.common_prefixes.iter().filter_map(|p| {
        Some(UfsEntry {
            name: p.filename()?.to_string(),
            kind: Kind::Directory,
            fingerprint: None,
        })
    });
    let files = listing.objects.iter().filter_map(|o| {
        Some(UfsEntry {
            name: o.location.filename()?.to_string(),
            kind: Kind::File,
            fingerprint: Some(fingerprint_of(o)),
        })
    });
    dirs.chain(files).collect()
}
