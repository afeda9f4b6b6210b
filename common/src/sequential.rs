//! The one sequential-read detector: where each stream of reads (a file, a block) last
//! ended, so a read can tell whether it continues the one before it. The client's lease
//! windows and next-block warm-up and the worker's read-ahead all ask it; each decides its
//! own rule (a slack, whether a read from the start counts) with [`continues`].

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

/// Streams remembered by default: past it the table starts over (a reader forgotten that
/// way reads once more as if new, which costs a read-ahead, not a wrong byte).
pub const TRACKED: usize = 4096;

/// Where the last read of each stream ended, and anything else a caller keeps with it.
pub struct ReadEnds<K, V = ()> {
    map: Mutex<HashMap<K, (u64, V)>>,
    cap: usize,
}

impl<K: Eq + Hash, V: Default + Copy> Default for ReadEnds<K, V> {
    fn default() -> Self {
        Self::new(TRACKED)
    }
}

impl<K: Eq + Hash, V: Default + Copy> ReadEnds<K, V> {
    pub fn new(cap: usize) -> Self {
        ReadEnds {
            map: Mutex::new(HashMap::new()),
            cap: cap.max(1),
        }
    }

    /// Notes a read of `key` that ended at `end`; returns where the read before it ended
    /// (None: the first remembered) and the value kept with it, which `update` may change.
    pub fn note(&self, key: K, end: u64, update: impl FnOnce(Option<u64>, &mut V)) -> Option<u64> {
        let mut m = match self.map.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if m.len() >= self.cap && !m.contains_key(&key) {
            m.clear();
        }
        let (prev, mut value) = match m.get(&key) {
            Some(&(e, v)) => (Some(e), v),
            None => (None, V::default()),
        };
        update(prev, &mut value);
        m.insert(key, (end, value));
        prev
    }

    /// As [`ReadEnds::note`], for callers that keep nothing with the ends.
    pub fn note_end(&self, key: K, end: u64) -> Option<u64> {
        self.note(key, end, |_, _| {})
    }
}

/// Whether a read at `offset` continues the one that ended at `prev`: within `slack`
/// bytes of its end, or — with `from_start` — at the stream's first byte.
pub fn continues(prev: Option<u64>, offset: u64, slack: u64, from_start: bool) -> bool {
    (from_start && offset == 0) || prev.is_some_and(|p| offset.abs_diff(p) <= slack)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_continue_within_the_slack_and_the_table_stays_bounded() {
        let ends: ReadEnds<u64> = ReadEnds::new(2);
        assert_eq!(ends.note_end(1, 100), None);
        assert!(continues(ends.note_end(1, 200), 100, 0, false));
        assert!(!continues(ends.note_end(1, 900), 500, 0, false), "a jump");
        assert!(
            continues(ends.note_end(1, 1000), 905, 8, false),
            "within the slack"
        );
        assert!(continues(None, 0, 0, true), "the first byte");
        assert!(!continues(None, 0, 0, false));
        ends.note_end(2, 10);
        // A third stream starts the table over.
        ends.note_end(3, 10);
        assert_eq!(ends.note_end(1, 10), None, "forgotten");
        let kept: ReadEnds<u64, u32> = ReadEnds::default();
        kept.note(7, 10, |_, v| *v = 3);
        let mut seen = 0;
        assert_eq!(
            kept.note(7, 20, |prev, v| seen = *v + prev.unwrap_or(0) as u32),
            Some(10)
        );
        assert_eq!(seen, 13);
    }
}
