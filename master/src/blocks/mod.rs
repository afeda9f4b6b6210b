//! Block locations: soft state, rebuilt from worker registrations and heartbeats; never
//! journaled. After a master restart the map starts empty and fills as workers re-register.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use granary_proto::BlockId;

type Key = (u64, u64, u32);

fn key(b: &BlockId) -> Key {
    (b.inode, b.version, b.index)
}

#[derive(Default)]
struct Inner {
    by_block: HashMap<Key, HashSet<u64>>,
    by_worker: HashMap<u64, HashSet<Key>>,
}

#[derive(Default)]
pub struct BlockLocations {
    inner: Mutex<Inner>,
    /// Files whose under-store object changed or vanished: inode → the version to keep
    /// (0: none), with when it was noted. Workers holding other versions are told to drop
    /// them on their next heartbeat.
    stale: Mutex<HashMap<u64, (u64, std::time::Instant)>>,
    /// Files freed (`granary free`), per worker holding some of their blocks: told once,
    /// on its next heartbeat, to drop every page of them.
    freed: Mutex<HashMap<u64, HashSet<u64>>>,
}

/// How long a noted change is passed on to workers (a worker away longer re-registers with
/// a full report, and pages of a version no inode has are never read again anyway).
const STALE_RETENTION: std::time::Duration = std::time::Duration::from_secs(300);

impl BlockLocations {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Forgets every location (a new leader rebuilds them from fresh worker reports).
    pub fn clear(&self) {
        *self.lock() = Inner::default();
        match self.stale.lock() {
            Ok(mut g) => g.clear(),
            Err(p) => p.into_inner().clear(),
        }
    }

    /// The files `worker` holds a block of (any version), once each.
    pub fn inodes_of(&self, worker: u64) -> HashSet<u64> {
        let inner = self.lock();
        inner
            .by_worker
            .get(&worker)
            .map(|keys| keys.iter().map(|k| k.0).collect())
            .unwrap_or_default()
    }

    /// Replaces everything known about `worker` with a full report.
    pub fn replace_worker(&self, worker: u64, blocks: &[BlockId]) {
        let mut inner = self.lock();
        Self::drop_worker_locked(&mut inner, worker);
        for b in blocks {
            let k = key(b);
            inner.by_block.entry(k).or_default().insert(worker);
            inner.by_worker.entry(worker).or_default().insert(k);
        }
    }

    pub fn update(&self, worker: u64, added: &[BlockId], removed: &[BlockId]) {
        let mut inner = self.lock();
        for b in removed {
            let k = key(b);
            if let Some(set) = inner.by_block.get_mut(&k) {
                set.remove(&worker);
                if set.is_empty() {
                    inner.by_block.remove(&k);
                }
            }
            if let Some(set) = inner.by_worker.get_mut(&worker) {
                set.remove(&k);
            }
        }
        for b in added {
            let k = key(b);
            inner.by_block.entry(k).or_default().insert(worker);
            inner.by_worker.entry(worker).or_default().insert(k);
        }
    }

    pub fn drop_worker(&self, worker: u64) {
        let mut inner = self.lock();
        Self::drop_worker_locked(&mut inner, worker);
    }

    fn drop_worker_locked(inner: &mut Inner, worker: u64) {
        if let Some(keys) = inner.by_worker.remove(&worker) {
            for k in keys {
                if let Some(set) = inner.by_block.get_mut(&k) {
                    set.remove(&worker);
                    if set.is_empty() {
                        inner.by_block.remove(&k);
                    }
                }
            }
        }
    }

    pub fn workers_of(&self, b: &BlockId) -> Vec<u64> {
        let inner = self.lock();
        let mut v: Vec<u64> = inner
            .by_block
            .get(&key(b))
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    }

    /// Notes that only `keep` (0: no version) of `inode` is current.
    pub fn note_stale(&self, inode: u64, keep: u64) {
        let mut stale = match self.stale.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        stale.insert(inode, (keep, std::time::Instant::now()));
        if stale.len() % 256 == 0 {
            stale.retain(|_, (_, at)| at.elapsed() < STALE_RETENTION);
        }
    }

    /// `(inode, version to keep)` for every noted change of which `worker` still holds
    /// another version.
    pub fn stale_for(&self, worker: u64) -> Vec<(u64, u64)> {
        let stale: HashMap<u64, u64> = {
            let g = match self.stale.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            g.iter()
                .filter(|(_, (_, at))| at.elapsed() < STALE_RETENTION)
                .map(|(i, (k, _))| (*i, *k))
                .collect()
        };
        if stale.is_empty() {
            return Vec::new();
        }
        let inner = self.lock();
        let Some(held) = inner.by_worker.get(&worker) else {
            return Vec::new();
        };
        // One pass over what the worker holds (a scan of it per noted change made a
        // re-listing that changed a big folder cost changes × blocks on every heartbeat).
        let mut out: Vec<(u64, u64)> = held
            .iter()
            .filter_map(|k| {
                let keep = *stale.get(&k.0)?;
                (k.1 != keep).then_some((k.0, keep))
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Queues `inodes` to be dropped by every worker holding blocks of them. Returns
    /// (files with cached blocks, workers holding some).
    pub fn free(&self, inodes: &HashSet<u64>) -> (usize, usize) {
        let mut per_worker: HashMap<u64, HashSet<u64>> = HashMap::new();
        {
            let inner = self.lock();
            for (w, keys) in &inner.by_worker {
                for k in keys {
                    if inodes.contains(&k.0) {
                        per_worker.entry(*w).or_default().insert(k.0);
                    }
                }
            }
        }
        let files: HashSet<u64> = per_worker.values().flatten().copied().collect();
        let workers = per_worker.len();
        let mut freed = match self.freed.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        for (w, set) in per_worker {
            freed.entry(w).or_default().extend(set);
        }
        (files.len(), workers)
    }

    /// The freed files `worker` must drop now (each handed out once).
    pub fn take_freed(&self, worker: u64) -> Vec<u64> {
        let mut freed = match self.freed.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        freed
            .remove(&worker)
            .map(|s| s.into_iter().collect())
            .unwrap_or_default()
    }

    pub fn block_count(&self, worker: u64) -> u64 {
        self.lock()
            .by_worker
            .get(&worker)
            .map(|s| s.len() as u64)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(i: u32) -> BlockId {
        BlockId {
            inode: 5,
            version: 9,
            index: i,
        }
    }

    #[test]
    fn stale_versions_are_reported_to_the_workers_holding_them() {
        let m = BlockLocations::default();
        m.replace_worker(1, &[b(0), b(1)]);
        m.replace_worker(
            2,
            &[BlockId {
                inode: 6,
                version: 1,
                index: 0,
            }],
        );
        // The version a worker holds is the one to keep: nothing to drop.
        m.note_stale(5, 9);
        assert!(m.stale_for(1).is_empty());
        // Once per file, however many of its blocks the worker holds.
        m.note_stale(5, 10);
        assert_eq!(m.stale_for(1), vec![(5, 10)]);
        assert!(m.stale_for(2).is_empty());
        // Once the worker reports the old blocks gone, nothing more is asked.
        m.update(1, &[], &[b(0), b(1)]);
        assert!(m.stale_for(1).is_empty());
    }

    #[test]
    fn report_update_drop() {
        let m = BlockLocations::default();
        m.replace_worker(1, &[b(0), b(1)]);
        m.replace_worker(2, &[b(1)]);
        assert_eq!(m.workers_of(&b(1)), vec![1, 2]);
        m.update(1, &[b(2)], &[b(1)]);
        assert_eq!(m.workers_of(&b(1)), vec![2]);
        assert_eq!(m.workers_of(&b(2)), vec![1]);
        m.drop_worker(2);
        assert!(m.workers_of(&b(1)).is_empty());
        assert_eq!(m.block_count(1), 2);
        m.replace_worker(1, &[]);
        assert_eq!(m.block_count(1), 0);
    }
}
