//! Decoded inodes and folder entries in front of RocksDB.
//!
//! Every path a request names is resolved one component at a time (`child`, then `inode`),
//! and each step was a RocksDB point get plus a JSON decode: a create under `/a/b` read six
//! records before writing any. The records used most are the same few folders, so the
//! state machine keeps the most recently used ones decoded here, bounded by bytes (names
//! and paths counted: long names chosen by a caller cannot grow it).
//!
//! Consistency: the apply thread is the only writer. A commit writes RocksDB first, then
//! updates this cache under its lock and moves the generation on. A reader that missed
//! notes the generation before it reads RocksDB and adds what it read only if no commit
//! came in between — otherwise the value it read may already be older than the store, and
//! it is dropped rather than cached.

use std::sync::Mutex;

use lru::LruCache;

use super::records::Inode;

/// Bytes of decoded inodes kept (a few hundred bytes each with their names and paths:
/// ~100,000 typical ones).
const INODE_BYTES: usize = 32 << 20;
/// Bytes of folder entries (`parent`, `name` → inode id) kept.
const ENTRY_BYTES: usize = 16 << 20;
/// What the LRU's own bookkeeping costs per item, beyond the key and value.
const PER_ITEM: usize = 64;

pub(super) struct Cache {
    inner: Mutex<Inner>,
}

struct Inner {
    generation: u64,
    inodes: Weighed<u64, Inode>,
    /// Keyed by the entry's record key (`c` + parent + name).
    entries: Weighed<Vec<u8>, u64>,
}

/// An LRU that evicts by the summed weight of what it holds.
struct Weighed<K: std::hash::Hash + Eq, V> {
    lru: LruCache<K, (V, usize)>,
    bytes: usize,
    budget: usize,
    weigh: fn(&K, &V) -> usize,
}

impl<K: std::hash::Hash + Eq, V: Clone> Weighed<K, V> {
    fn new(budget: usize, weigh: fn(&K, &V) -> usize) -> Self {
        Self {
            lru: LruCache::unbounded(),
            bytes: 0,
            budget,
            weigh,
        }
    }

    fn get<Q>(&mut self, k: &Q) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.lru.get(k).map(|(v, _)| v.clone())
    }

    fn put(&mut self, k: K, v: V) {
        let w = (self.weigh)(&k, &v) + PER_ITEM;
        if let Some((_, old)) = self.lru.put(k, (v, w)) {
            self.bytes -= old;
        }
        self.bytes += w;
        while self.bytes > self.budget {
            match self.lru.pop_lru() {
                Some((_, (_, old))) => self.bytes -= old,
                None => break,
            }
        }
    }

    fn pop(&mut self, k: &K) {
        if let Some((_, old)) = self.lru.pop(k) {
            self.bytes -= old;
        }
    }

    fn clear(&mut self) {
        self.lru.clear();
        self.bytes = 0;
    }
}

fn inode_weight(_: &u64, i: &Inode) -> usize {
    let strings = i.name.len()
        + i.ufs_path.len()
        + i.creator.as_ref().map_or(0, String::len)
        + i.fingerprint
            .as_ref()
            .map_or(0, |f| f.etag.len() + f.version_id.len());
    std::mem::size_of::<Inode>() + strings
}

#[allow(clippy::ptr_arg)] // the shape `Weighed` asks for: `fn(&K, &V)`
fn entry_weight(k: &Vec<u8>, _: &u64) -> usize {
    std::mem::size_of::<(Vec<u8>, u64)>() + k.len()
}

/// A folder entry held: its record key and inode id.
pub(super) type EntryItem = (Vec<u8>, u64);

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
        Self::with_budget(INODE_BYTES, ENTRY_BYTES)
    }

    /// A cache holding at most `inodes` bytes of inodes and `entries` bytes of entries.
    pub fn with_budget(inodes: usize, entries: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                generation: 0,
                inodes: Weighed::new(inodes, inode_weight),
                entries: Weighed::new(entries, entry_weight),
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
            Some(i) => Ok(i),
            None => Err(g.generation),
        }
    }

    /// The cached entry's inode id, or the generation to pass to [`Cache::offer_entry`].
    pub fn entry(&self, key: &[u8]) -> Result<u64, u64> {
        let mut g = self.lock();
        match g.entries.get(key) {
            Some(id) => Ok(id),
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

    /// Every inode and entry held (for the invariant check: they must match the store).
    pub fn held_items(&self) -> (Vec<(u64, Inode)>, Vec<EntryItem>) {
        let g = self.lock();
        let inodes = g.inodes.lru.iter().map(|(k, (v, _))| (*k, v.clone()));
        let entries = g.entries.lru.iter().map(|(k, (v, _))| (k.clone(), *v));
        (inodes.collect(), entries.collect())
    }

    /// Inodes and entries held, and their bytes.
    #[cfg(test)]
    pub fn held(&self) -> [usize; 4] {
        let g = self.lock();
        [
            g.inodes.lru.len(),
            g.inodes.bytes,
            g.entries.lru.len(),
            g.entries.bytes,
        ]
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
    fn bounded_by_bytes_long_names_included_and_cleared_whole() {
        let one = inode_weight(&0, &dir(0, "d")) + PER_ITEM;
        let c = Cache::with_budget(3 * one, 1 << 20);
        for id in 10..20 {
            let g = c.inode(id).err().unwrap_or_default();
            c.offer_inode(g, &dir(id, "d"));
        }
        assert_eq!(c.held()[..2], [3, 3 * one]);
        assert!(c.inode(19).is_ok() && c.inode(16).is_err());
        // A longest name weighs its bytes: it pushes the others out, and stays in budget.
        let mut long = dir(30, &"n".repeat(255));
        long.ufs_path = "p".repeat(4096);
        let g = c.inode(30).err().unwrap_or_default();
        c.offer_inode(g, &long);
        assert!(c.held()[1] <= 3 * one, "{:?}", c.held());
        // Rewriting a held inode replaces its weight rather than adding to it.
        for _ in 0..10 {
            c.committed(Written {
                inodes: vec![(19, Some(dir(19, "d")))],
                ..Default::default()
            });
        }
        assert!(c.held()[1] <= 3 * one, "{:?}", c.held());
        // Entries likewise, and removals give their bytes back.
        let key = |i: u8| [b'c', i].repeat(100);
        for i in 0..50u8 {
            let g = c.entry(&key(i)).err().unwrap_or_default();
            c.offer_entry(g, &key(i), u64::from(i));
        }
        let [_, _, n, bytes] = c.held();
        assert_eq!(bytes, n * (entry_weight(&key(0), &0) + PER_ITEM));
        c.committed(Written {
            entries: vec![(key(49), None)],
            ..Default::default()
        });
        assert_eq!(c.held()[2..], [n - 1, bytes - bytes / n]);
        let Err(g) = c.inode(1) else {
            panic!("never cached")
        };
        c.clear();
        c.offer_inode(g, &dir(1, "before the snapshot"));
        assert_eq!(c.held(), [0; 4]);
    }
}
