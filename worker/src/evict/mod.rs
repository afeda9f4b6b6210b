//! Eviction policy. LRU for now; the policy is a trait so scan-resistant policies (S3-FIFO,
//! ARC) slot in per worker.

use std::hash::Hash;

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
}
