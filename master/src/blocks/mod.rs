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
}

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
