//! Decoded inodes and folder entries in front of RocksDB.
//!
//! Every path a request names is resolved one component at a time (`child`, then `inode`),
//! and each step was a RocksDB point get plus a JSON decode: a create under `/a/b` read six
//! records before writing any. The records used most are the same few folders, so the
//! state machine keeps the most recently used ones decoded here, bounded by count.
//!
//! Consistency: the apply thread is the only writer. A commit writes RocksDB first, then
//! updates this cache under its lock and moves the generation on. A reader that missed
//! notes the generation before it reads RocksDB and adds what it read only if no commit
//! came in between — otherwise the value it read may already be older than the store, and
//! it is dropped rather than cached.

use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;

use super::records::Inode;

/// Inodes kept decoded (a few hundred bytes each with their names).
const INODES: usize = 65_536;
/// Folder entries (`parent`, `name` → inode id) kept.
const ENTRIES: usize = 65_536;

pub(super) struct Cache {
    inner: Mutex<Inner>,
}

struct Inner {
    generation: u64,
    inodes: LruCache<u64, Inode>,
    /// Keyed by the entry's record key (`c` + parent + name).
    entries: LruCache<Vec<u8>, u64>,
}

/// What one commit changed, for [`Cache::committed`].
#[derive(Default)]
pub(super) struct Written {
    /// Inodes written (their new record) or removed (`None`).
    pub inodes: Vec<(u64, Option<Inode>)>,
    /// Entries written (the inode id) or removed (`None`), by record key.
    pub entries: Vec<(Vec<u8>, Option<u64>)>,
}

impl Cache {
    pub fn new() -> Self {
        Self::with_capacity(INODES, ENTRIES)
    }

    pub fn with_capacity(inodes: usize, entries: usize) -> Self {
        let cap = |n: usize| NonZeroUsize::new(n.max(1)).unwrap_or(NonZeroUsize::MIN);
        Self {
            inner: Mutex::new(Inner {
                generation: 0,
                inodes: LruCache::new(cap(inodes)),
                entries: LruCache::new(cap(entries)),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached inode, or the generation to pass to [`Cache::offer_inode`] after reading
    /// the store.
    pub fn inode(&self, id: u64) -> Result<Inode, u64> {
        let mut g = self.lock();
        match g.inodes.get(&id) {
            Some(i) => Ok(i.clone()),
            None => Err(g.generation),
        }
    }

    /// The cached entry's inode id, or the generation to pass to [`Cache::offer_entry`].
    pub fn entry(&self, key: &[u8]) -> Result<u64, u64> {
        let mut g = self.lock();
        match g.entries.get(key) {
            Some(id) => Ok(*id),
            None => Err(g.generation),
        }
    }

    /// Keeps `inode`, read from the store at `generation`, unless a commit came since.
    pub fn offer_inode(&self, generation: u64, inode: &Inode) {
        let mut g = self.lock();
        if g.generation == generation {
            g.inodes.put(inode.id, inode.clone());
        }
    }

    /// Keeps an entry read from the store at `generation`, unless a commit came since.
    pub fn offer_entry(&self, generation: u64, key: &[u8], id: u64) {
        let mut g = self.lock();
        if g.generation == generation {
            g.entries.put(key.to_vec(), id);
        }
    }

    /// Applies what a commit (already in the store) wrote.
    pub fn committed(&self, w: Written) {
        let mut g = self.lock();
        g.generation += 1;
        for (id, inode) in w.inodes {
            match inode {
                Some(i) => {
                    g.inodes.put(id, i);
                }
                None => {
                    g.inodes.pop(&id);
                }
            }
        }
        for (key, id) in w.entries {
            match id {
                Some(id) => {
                    g.entries.put(key, id);
                }
                None => {
                    g.entries.pop(&key);
                }
            }
        }
    }

    /// Forgets everything (the store was replaced: a snapshot was installed).
    pub fn clear(&self) {
        let mut g = self.lock();
        g.generation += 1;
        g.inodes.clear();
        g.entries.clear();
    }

    /// Inodes and entries held.
    #[cfg(test)]
    pub fn len(&self) -> (usize, usize) {
        let g = self.lock();
        (g.inodes.len(), g.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(id: u64, name: &str) -> Inode {
        Inode::directory(id, 1, name, 0o755, 0)
    }

    #[test]
    fn a_value_read_before_a_commit_is_not_kept_after_it() {
        let c = Cache::new();
        let Err(g) = c.inode(5) else {
            panic!("empty cache hit")
        };
        // The apply thread commits a new record for inode 5 while the reader held the old.
        c.committed(Written {
            inodes: vec![(5, Some(dir(5, "new")))],
            ..Default::default()
        });
        c.offer_inode(g, &dir(5, "old"));
        assert_eq!(c.inode(5).map(|i| i.name), Ok("new".to_string()));
        // A removal likewise: the stale read is dropped, the removal stands.
        let Err(g) = c.entry(b"c-key") else {
            panic!("empty cache hit")
        };
        c.committed(Written {
            entries: vec![(b"c-key".to_vec(), None)],
            ..Default::default()
        });
        c.offer_entry(g, b"c-key", 9);
        assert!(c.entry(b"c-key").is_err());
        // Read with no commit in between: kept.
        let Err(g) = c.entry(b"c-key") else {
            panic!("removed entry hit")
        };
        c.offer_entry(g, b"c-key", 9);
        assert_eq!(c.entry(b"c-key"), Ok(9));
    }

    #[test]
    fn bounded_by_count_and_cleared_whole() {
        let c = Cache::with_capacity(3, 2);
        for id in 10..20 {
            let g = c.inode(id).err().unwrap_or_default();
            c.offer_inode(g, &dir(id, "d"));
            let g = c.entry(&id.to_be_bytes()).err().unwrap_or_default();
            c.offer_entry(g, &id.to_be_bytes(), id);
        }
        assert_eq!(c.len(), (3, 2));
        assert!(c.inode(19).is_ok() && c.inode(16).is_err());
        let Err(g) = c.inode(1) else {
            panic!("never cached")
        };
        c.clear();
        c.offer_inode(g, &dir(1, "before the snapshot"));
        assert_eq!(c.len(), (0, 0));
    }
}
