//! The client's metadata cache: statuses seen lately (lookups, listings, opens), the names
//! listings gave them, each listed entry's successor in its folder, and the namespace watch
//! that lets them be trusted beyond the attribute timeout (see [`crate::watch`]). No I/O:
//! `FileSystem` asks the master and hands the answers here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use granary_proto as pb;

use super::lock;
use crate::watch::{Since, Watch};

/// Statuses kept for opens (older ones are dropped when the map is full).
pub(crate) const RECENT_STATUSES: usize = 100_000;

/// A status seen lately: when it arrived and in which epoch of the namespace watch.
pub(crate) struct Recent {
    pub(crate) at: Instant,
    pub(crate) epoch: u64,
    /// Shared with the listing page it came from (a status is ~500 bytes and a dozen heap
    /// allocations: a copy for this map, made and freed per listed entry, was a fifth of
    /// a warm `find`'s CPU).
    pub(crate) status: Arc<pb::FileStatus>,
}

/// Names seen in listings and lookups, by folder: parent → name → inode (the statuses are
/// in `recent`). By folder, so a lookup needs no key allocated and a changed folder's
/// names are found without a scan of all.
#[derive(Default)]
pub(crate) struct Names {
    by_dir: HashMap<u64, HashMap<String, u64>>,
    len: usize,
}

impl Names {
    pub(crate) fn get(&self, parent: u64, name: &str) -> Option<u64> {
        self.by_dir.get(&parent)?.get(name).copied()
    }

    /// Remembers a name (everything is forgotten first when [`RECENT_STATUSES`] are held).
    pub(crate) fn insert(&mut self, parent: u64, name: &str, inode: u64) {
        if self.len >= RECENT_STATUSES {
            self.by_dir.clear();
            self.len = 0;
        }
        if self
            .by_dir
            .entry(parent)
            .or_default()
            .insert(name.to_string(), inode)
            .is_none()
        {
            self.len += 1;
        }
    }

    /// Forgets the names of folder `parent`, returning them.
    pub(crate) fn take_dir(&mut self, parent: u64) -> Vec<String> {
        let names: Vec<String> = self
            .by_dir
            .remove(&parent)
            .map(|m| m.into_keys().collect())
            .unwrap_or_default();
        self.len -= names.len();
        names
    }
}

#[derive(Default)]
pub struct MetaCache {
    /// Statuses seen lately, by inode: an open within the status TTL of one uses it
    /// instead of asking the master again.
    pub(crate) recent: Mutex<HashMap<u64, Recent>>,
    /// The namespace watch: statuses it covers are used beyond the status TTL.
    pub watch: Watch,
    /// How long a fetched status may be used, in ms (0: never).
    ttl_ms: AtomicU64,
    /// The entry listed after each file (by inode): a reader of a folder of small files
    /// leases the next ones with the one it opens.
    pub(crate) next_in_dir: Mutex<HashMap<u64, u64>>,
    /// Names seen in listings: (parent, name) → inode (its status is in `recent`).
    pub(crate) names: Mutex<Names>,
}

impl MetaCache {
    pub fn set_ttl(&self, ttl: std::time::Duration) {
        self.ttl_ms.store(ttl.as_millis() as u64, Ordering::Relaxed);
    }

    /// How long a fetched status (and a name from a listing) may be used, in ms (0: never).
    pub fn ttl(&self) -> u64 {
        self.ttl_ms.load(Ordering::Relaxed)
    }

    /// Keeps a status the master sent in answer to a request sent at `since`.
    pub(crate) fn remember(&self, s: &pb::FileStatus, since: Since) {
        if self.ttl() > 0 {
            self.remember_all(&[Arc::new(s.clone())], since);
        }
    }

    /// [`MetaCache::remember`] of several statuses, under one lock.
    fn remember_all(&self, statuses: &[Arc<pb::FileStatus>], since: Since) {
        if self.ttl() == 0 {
            return;
        }
        let at = Instant::now();
        let kept: Vec<(u64, Recent)> = statuses
            .iter()
            .map(|s| {
                let recent = Recent {
                    at,
                    epoch: self.watch.epoch_for(s.inode, since),
                    status: s.clone(),
                };
                (s.inode, recent)
            })
            .collect();
        let mut r = lock(&self.recent);
        for (inode, recent) in kept {
            if r.len() >= RECENT_STATUSES {
                r.clear();
            }
            r.insert(inode, recent);
        }
    }

    /// Keeps the name a lookup found.
    pub(crate) fn remember_name(&self, s: &pb::FileStatus) {
        if self.ttl() > 0 {
            lock(&self.names).insert(s.parent, &s.name, s.inode);
        }
    }

    /// Keeps what a listing page shows: its statuses (asked at `since`), their names, and
    /// each entry's successor.
    pub(crate) fn remember_page(&self, entries: &[Arc<pb::FileStatus>], since: Since) {
        self.remember_all(entries, since);
        if self.ttl() > 0 {
            let mut names = lock(&self.names);
            for e in entries {
                names.insert(e.parent, &e.name, e.inode);
            }
        }
        let mut next = lock(&self.next_in_dir);
        if next.len() >= RECENT_STATUSES {
            next.clear();
        }
        for pair in entries.windows(2) {
            next.insert(pair[0].inode, pair[1].inode);
        }
    }

    pub fn forget(&self, inode: u64) {
        lock(&self.recent).remove(&inode);
    }

    /// Whether a status seen lately may be used without asking the master: within the
    /// attribute timeout `ttl` (ms; 0: never), or beyond it while the namespace watch
    /// covers it.
    fn fresh(&self, e: &Recent, ttl: u64) -> bool {
        if ttl == 0 {
            return false;
        }
        let age = e.at.elapsed();
        age.as_millis() < u128::from(ttl) || self.watch.trusts(e.epoch, age, e.status.cache_ms)
    }

    /// The status an open may use (fresh, complete, not of a validate-on-open mount).
    pub fn open_status(&self, inode: u64) -> Option<pb::FileStatus> {
        let ttl = self.ttl();
        let r = lock(&self.recent);
        let e = r.get(&inode)?;
        let s = &e.status;
        (self.fresh(e, ttl) && !s.validate_on_open && s.complete).then(|| (**s).clone())
    }

    /// A folder's status when the namespace watch vouches for it (any change of its
    /// entries is announced, which drops it).
    pub fn watched_dir(&self, inode: u64) -> Option<pb::FileStatus> {
        let r = lock(&self.recent);
        let e = r.get(&inode)?;
        (e.status.kind == pb::FileKind::Directory as i32
            && self.ttl() > 0
            && self
                .watch
                .trusts(e.epoch, e.at.elapsed(), e.status.cache_ms))
        .then(|| (*e.status).clone())
    }

    /// The entry after `inode` in its folder's name order, as the last listing page that
    /// held both gave it.
    pub fn next_in_folder(&self, inode: u64) -> Option<u64> {
        lock(&self.next_in_dir).get(&inode).copied()
    }

    /// The fresh status of `name` in `parent`, when a listing or lookup gave it.
    pub fn lookup(&self, parent: u64, name: &str) -> Option<pb::FileStatus> {
        let ttl = self.ttl();
        if ttl == 0 {
            return None;
        }
        let inode = lock(&self.names).get(parent, name)?;
        let r = lock(&self.recent);
        let e = r.get(&inode)?;
        let s = &e.status;
        (self.fresh(e, ttl) && s.parent == parent && s.name == name).then(|| (**s).clone())
    }

    /// Whether a listing or lookup gave `name` in `parent`.
    pub(crate) fn knows_name(&self, parent: u64, name: &str) -> bool {
        lock(&self.names).get(parent, name).is_some()
    }

    /// For a debug line: the inode a name had, and (epoch, age, cache_ms) of its status.
    pub(crate) fn describe(
        &self,
        parent: u64,
        name: &str,
    ) -> (Option<u64>, Option<(u64, std::time::Duration, u64)>) {
        let inode = lock(&self.names).get(parent, name);
        let entry = inode.and_then(|i| {
            lock(&self.recent)
                .get(&i)
                .map(|e| (e.epoch, e.at.elapsed(), e.status.cache_ms))
        });
        (inode, entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn file(inode: u64, parent: u64, name: &str) -> pb::FileStatus {
        pb::FileStatus {
            inode,
            parent,
            name: name.into(),
            kind: pb::FileKind::File as i32,
            complete: true,
            ..Default::default()
        }
    }

    fn page(entries: Vec<pb::FileStatus>) -> Vec<Arc<pb::FileStatus>> {
        entries.into_iter().map(Arc::new).collect()
    }

    #[test]
    fn without_a_ttl_nothing_is_kept() {
        let m = MetaCache::default();
        let since = m.watch.since();
        m.remember_page(&page(vec![file(2, 1, "a"), file(3, 1, "b")]), since);
        assert_eq!(m.lookup(1, "a"), None);
        assert_eq!(m.open_status(2), None);
        assert!(!m.knows_name(1, "a"));
        // Successors are kept whatever the TTL (they name no status).
        assert_eq!(m.next_in_folder(2), Some(3));
    }

    #[test]
    fn a_listing_answers_lookups_and_opens_until_forgotten() {
        let m = MetaCache::default();
        m.set_ttl(Duration::from_secs(3600));
        let since = m.watch.since();
        let mut checked = file(4, 1, "c");
        checked.validate_on_open = true;
        let mut partial = file(5, 1, "d");
        partial.complete = false;
        m.remember_page(
            &page(vec![file(2, 1, "a"), file(3, 1, "b"), checked, partial]),
            since,
        );
        assert_eq!(m.lookup(1, "b").map(|s| s.inode), Some(3));
        assert_eq!(m.lookup(1, "zz"), None);
        assert_eq!(m.lookup(9, "b"), None, "another folder's name");
        assert_eq!(m.next_in_folder(2), Some(3));
        assert_eq!(m.next_in_folder(5), None, "the last entry has no successor");
        assert_eq!(m.open_status(2).map(|s| s.inode), Some(2));
        assert_eq!(
            m.open_status(4),
            None,
            "validate-on-open files are always asked for"
        );
        assert_eq!(m.open_status(5), None, "a file being written is asked for");
        // Renamed since: the old name no longer answers for it.
        m.remember(&file(3, 1, "renamed"), m.watch.since());
        assert_eq!(m.lookup(1, "b"), None);
        m.forget(2);
        assert_eq!((m.open_status(2), m.lookup(1, "a")), (None, None));
    }

    #[test]
    fn a_folder_is_trusted_only_while_the_watch_vouches_for_it() {
        let m = MetaCache::default();
        m.set_ttl(Duration::from_secs(3600));
        let dir = pb::FileStatus {
            inode: 7,
            parent: 1,
            name: "d".into(),
            kind: pb::FileKind::Directory as i32,
            cache_ms: u64::MAX,
            ..Default::default()
        };
        m.remember(&dir, m.watch.since());
        // No watch heard from: a folder's entries may have changed at any time.
        assert_eq!(m.watched_dir(7), None);
        assert_eq!(m.lookup(1, "d"), None, "a lookup keeps no name");
        m.remember_name(&dir);
        assert_eq!(m.lookup(1, "d").map(|s| s.inode), Some(7));
    }
}
