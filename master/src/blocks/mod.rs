//! Block locations: soft state, rebuilt from worker registrations and heartbeats; never
//! journaled. After a master restart the map starts empty and fills as workers re-register.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use granary_proto::BlockId;

mod table;

use table::Table;
pub use table::TooManyWorkers;

#[derive(Default)]
pub struct BlockLocations {
    inner: Mutex<Table>,
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
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Forgets every location (a new leader rebuilds them from fresh worker reports).
    pub fn clear(&self) {
        *self.lock() = Table::default();
        match self.stale.lock() {
            Ok(mut g) => g.clear(),
            Err(p) => p.into_inner().clear(),
        }
    }

    /// The files `worker` holds a block of (any version), once each. A scan of every
    /// location: for rare events only (a change of the pin set).
    pub fn inodes_of(&self, worker: u64) -> HashSet<u64> {
        self.lock().inodes_of(worker)
    }

    /// Replaces everything known about `worker` with a full report. Refused when more
    /// workers hold blocks than the table can number (65,535).
    pub fn replace_worker(&self, worker: u64, blocks: &[BlockId]) -> Result<(), TooManyWorkers> {
        let mut table = self.lock();
        table.drop_worker(worker);
        table.enlist(worker)?;
        for b in blocks {
            table.add(worker, b)?;
        }
        Ok(())
    }

    pub fn update(&self, worker: u64, added: &[BlockId], removed: &[BlockId]) {
        let mut table = self.lock();
        for b in removed {
            table.remove(worker, b);
        }
        for b in added {
            if table.add(worker, b).is_err() {
                tracing::warn!(worker, "block locations full: a report is ignored");
                return;
            }
        }
    }

    pub fn drop_worker(&self, worker: u64) {
        self.lock().drop_worker(worker);
    }

    pub fn workers_of(&self, b: &BlockId) -> Vec<u64> {
        self.lock().workers_of(b)
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
        // By noted change, not by what the worker holds (a scan of that per noted change
        // made a re-listing that changed a big folder cost changes × blocks per heartbeat).
        let table = self.lock();
        let mut out: Vec<(u64, u64)> = stale
            .iter()
            .filter(|(inode, keep)| {
                table
                    .holders(**inode)
                    .iter()
                    .any(|(w, v)| *w == worker && v != *keep)
            })
            .map(|(i, k)| (*i, *k))
            .collect();
        out.sort_unstable();
        out
    }

    /// Queues `inodes` to be dropped by every worker holding blocks of them. Returns
    /// (files with cached blocks, workers holding some).
    pub fn free(&self, inodes: &HashSet<u64>) -> (usize, usize) {
        let mut per_worker: HashMap<u64, HashSet<u64>> = HashMap::new();
        {
            let table = self.lock();
            for inode in inodes {
                for (w, _) in table.holders(*inode) {
                    per_worker.entry(w).or_default().insert(*inode);
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
        self.lock().block_count(worker)
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
        m.replace_worker(1, &[b(0), b(1)]).unwrap();
        m.replace_worker(
            2,
            &[BlockId {
                inode: 6,
                version: 1,
                index: 0,
            }],
        )
        .unwrap();
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
        m.replace_worker(1, &[b(0), b(1)]).unwrap();
        m.replace_worker(2, &[b(1)]).unwrap();
        assert_eq!(m.workers_of(&b(1)), vec![1, 2]);
        m.update(1, &[b(2)], &[b(1)]);
        assert_eq!(m.workers_of(&b(1)), vec![2]);
        assert_eq!(m.workers_of(&b(2)), vec![1]);
        m.drop_worker(2);
        assert!(m.workers_of(&b(1)).is_empty());
        assert_eq!(m.block_count(1), 2);
        m.replace_worker(1, &[]).unwrap();
        assert_eq!(m.block_count(1), 0);
    }
}
