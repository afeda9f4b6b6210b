//! Eviction policies, selectable per worker (`--eviction`).
//!
//! - `lru`: least recently used. Best when the working set fits the cache; collapses to no
//!   hits when epochs scan a dataset larger than the cache (each page is evicted just
//!   before it is read again).
//! - `lfu-admission` (default): LRU among the cached pages plus a frequency admission filter
//!   (the TinyLFU idea). Accesses of every page, cached or not, are counted in a small
//!   count-min sketch that halves its counters periodically (so old popularity fades). When
//!   the cache is full, a missed page is admitted only if it was accessed more often *before
//!   this access* than the page it would evict. A one-off scan therefore cannot flush hot
//!   pages, and cyclic epochs over a dataset larger than the cache keep a stable part of it
//!   cached (hit ratio ≈ cache / dataset) instead of thrashing.

use std::hash::{BuildHasher, Hash};

/// Chooses victims among cached entries.
pub trait EvictionPolicy<K>: Send {
    /// An entry was inserted.
    fn insert(&mut self, key: K);
    /// An entry was read.
    fn touch(&mut self, key: &K);
    /// An entry left the cache for another reason (corruption, invalidation).
    fn remove(&mut self, key: &K);
    /// The next victim, removed from the policy's bookkeeping.
    fn pop_victim(&mut self) -> Option<K>;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A page not in the cache was accessed and is about to be filled: record the access
    /// and say whether it may enter. `full`: entries must be evicted to make room.
    fn admit(&mut self, _key: &K, _full: bool) -> bool {
        true
    }
    /// Would [`EvictionPolicy::admit`] let `key` in now? (No access is recorded; read-ahead
    /// asks before fetching pages nobody waits for yet.)
    fn would_admit(&self, _key: &K, _full: bool) -> bool {
        true
    }
}

/// The policies `--eviction` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyKind {
    Lru,
    #[default]
    LfuAdmission,
}

impl PolicyKind {
    pub const NAMES: &'static [&'static str] = &["lru", "lfu-admission"];

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "lru" => Some(Self::Lru),
            "lfu-admission" => Some(Self::LfuAdmission),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::LfuAdmission => "lfu-admission",
        }
    }

    /// A policy for a cache of about `entries` pages.
    pub fn build<K: Hash + Eq + Clone + Send + 'static>(
        self,
        entries: u64,
    ) -> Box<dyn EvictionPolicy<K>> {
        match self {
            Self::Lru => Box::new(Lru::default()),
            Self::LfuAdmission => Box::new(LfuAdmission::new(entries)),
        }
    }
}

/// Least recently used.
pub struct Lru<K: Hash + Eq> {
    order: lru::LruCache<K, ()>,
}

impl<K: Hash + Eq> Default for Lru<K> {
    fn default() -> Self {
        Self {
            order: lru::LruCache::unbounded(),
        }
    }
}

impl<K: Hash + Eq> Lru<K> {
    fn peek_victim(&self) -> Option<&K> {
        self.order.peek_lru().map(|(k, ())| k)
    }
}

impl<K: Hash + Eq + Clone + Send> EvictionPolicy<K> for Lru<K> {
    fn insert(&mut self, key: K) {
        self.order.put(key, ());
    }
    fn touch(&mut self, key: &K) {
        self.order.promote(key);
    }
    fn remove(&mut self, key: &K) {
        self.order.pop(key);
    }
    fn pop_victim(&mut self) -> Option<K> {
        self.order.pop_lru().map(|(k, ())| k)
    }
    fn len(&self) -> usize {
        self.order.len()
    }
}

/// Counts per key, approximately, in fixed memory: `DEPTH` rows of saturating 4-bit-range
/// counters; an estimate is the smallest of a key's counters. After `sample` increments
/// every counter is halved (aging).
struct CountMin {
    rows: Vec<Vec<u8>>,
    mask: u64,
    hasher: std::collections::hash_map::RandomState,
    added: u64,
    sample: u64,
}

const DEPTH: usize = 4;
/// Counters saturate here (more history than this says nothing more about the future).
const COUNTER_MAX: u8 = 15;

impl CountMin {
    fn new(entries: u64) -> Self {
        // Room for several times the cached entries: the keys that compete for admission
        // (a dataset larger than the cache) must not collide much.
        let width = (entries.max(256) * 4).next_power_of_two();
        Self {
            rows: vec![vec![0; width as usize]; DEPTH],
            mask: width - 1,
            hasher: std::collections::hash_map::RandomState::new(),
            added: 0,
            sample: width * 10,
        }
    }

    fn slots<K: Hash>(&self, key: &K) -> [usize; DEPTH] {
        let h = self.hasher.hash_one(key);
        let (h1, h2) = (h, h.rotate_left(32) | 1);
        std::array::from_fn(|i| (h1.wrapping_add((i as u64).wrapping_mul(h2)) & self.mask) as usize)
    }

    fn estimate<K: Hash>(&self, key: &K) -> u8 {
        let slots = self.slots(key);
        (0..DEPTH)
            .map(|i| self.rows[i][slots[i]])
            .min()
            .unwrap_or(0)
    }

    fn increment<K: Hash>(&mut self, key: &K) {
        let slots = self.slots(key);
        for (row, slot) in self.rows.iter_mut().zip(slots) {
            row[slot] = row[slot].saturating_add(1).min(COUNTER_MAX);
        }
        self.added += 1;
        if self.added >= self.sample {
            self.added = 0;
            for row in &mut self.rows {
                for c in row.iter_mut() {
                    *c /= 2;
                }
            }
        }
    }
}

/// LRU with a frequency admission filter (see the module comment).
pub struct LfuAdmission<K: Hash + Eq> {
    lru: Lru<K>,
    freq: CountMin,
}

impl<K: Hash + Eq> LfuAdmission<K> {
    pub fn new(entries: u64) -> Self {
        Self {
            lru: Lru::default(),
            freq: CountMin::new(entries),
        }
    }

    fn beats_victim(&self, key: &K) -> bool {
        match self.lru.peek_victim() {
            Some(v) => self.freq.estimate(key) > self.freq.estimate(v),
            None => true,
        }
    }
}

impl<K: Hash + Eq + Clone + Send> EvictionPolicy<K> for LfuAdmission<K> {
    fn insert(&mut self, key: K) {
        self.lru.insert(key);
    }
    fn touch(&mut self, key: &K) {
        self.freq.increment(key);
        self.lru.touch(key);
    }
    fn remove(&mut self, key: &K) {
        self.lru.remove(key);
    }
    fn pop_victim(&mut self) -> Option<K> {
        self.lru.pop_victim()
    }
    fn len(&self) -> usize {
        self.lru.len()
    }
    fn admit(&mut self, key: &K, full: bool) -> bool {
        let admit = !full || self.beats_victim(key);
        self.freq.increment(key);
        admit
    }
    fn would_admit(&self, key: &K, full: bool) -> bool {
        !full || self.beats_victim(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_order() {
        let mut l = Lru::default();
        l.insert(1);
        l.insert(2);
        l.insert(3);
        l.touch(&1);
        l.remove(&3);
        assert_eq!(l.pop_victim(), Some(2));
        assert_eq!(l.pop_victim(), Some(1));
        assert_eq!(l.pop_victim(), None);
    }

    /// Hit ratio of `epochs` cyclic scans over `dataset` keys with room for `cache`.
    fn cyclic_hit_ratio(mut p: Box<dyn EvictionPolicy<u64>>, cache: usize, dataset: u64) -> f64 {
        let (mut hits, mut reads) = (0u64, 0u64);
        let mut cached = std::collections::HashSet::new();
        for epoch in 0..6 {
            for key in 0..dataset {
                let counted = epoch > 0;
                reads += u64::from(counted);
                if cached.contains(&key) {
                    hits += u64::from(counted);
                    p.touch(&key);
                    continue;
                }
                let full = cached.len() >= cache;
                if !p.admit(&key, full) {
                    continue;
                }
                if full {
                    let v = p.pop_victim().unwrap();
                    cached.remove(&v);
                }
                cached.insert(key);
                p.insert(key);
            }
        }
        hits as f64 / reads as f64
    }

    #[test]
    fn cyclic_scans_larger_than_the_cache_keep_hitting_with_the_admission_filter() {
        let lru = cyclic_hit_ratio(PolicyKind::Lru.build(1000), 1000, 2000);
        let lfu = cyclic_hit_ratio(PolicyKind::LfuAdmission.build(1000), 1000, 2000);
        assert_eq!(lru, 0.0, "LRU thrashes on loops (that is the point)");
        assert!(lfu > 0.45, "lfu-admission hit ratio {lfu}");
    }

    #[test]
    fn a_working_set_that_fits_is_kept_by_both() {
        for kind in [PolicyKind::Lru, PolicyKind::LfuAdmission] {
            let r = cyclic_hit_ratio(kind.build(1000), 1000, 900);
            assert!(r > 0.99, "{}: {r}", kind.name());
        }
    }

    #[test]
    fn a_one_off_scan_does_not_flush_hot_entries() {
        let mut p = LfuAdmission::new(100);
        for k in 0..100u64 {
            assert!(p.admit(&k, false));
            p.insert(k);
        }
        for _ in 0..3 {
            for k in 0..100u64 {
                p.touch(&k);
            }
        }
        // A scan of new keys three times the cache, each seen once: none gets in.
        for k in 1000..1300u64 {
            assert!(!p.would_admit(&k, true));
            assert!(!p.admit(&k, true), "scan key {k} admitted");
        }
        // A new key read repeatedly earns its place once it beats the coldest entry.
        let mut admitted = false;
        for _ in 0..COUNTER_MAX {
            if p.admit(&7777, true) {
                admitted = true;
                break;
            }
        }
        assert!(admitted);
    }
}
