//! The block-location table in a form small enough for tens of millions of cached blocks.
//!
//! One map entry per file (not per block, nor per block and holder), workers named by a
//! 16-bit slot instead of their 64-bit id, and the common case — a file of one block held
//! by one or two workers — stored inline in the entry (24 bytes, no allocation). Anything
//! else (several blocks, versions or holders) is a list of `(version, index, slot)` rows,
//! and a hash set of them past 64 (a big file, or a hostile report).
//! Nothing is indexed by worker: what a worker holds is found by a scan of the table, which
//! only registration, loss and a change of the pin set need (each rare); heartbeats,
//! lookups, stale notices and `free` go by inode.

use std::collections::{HashMap, HashSet};

use granary_proto::BlockId;

/// A worker's number in the table, from 1 (0 marks an empty inline place).
type Slot = u16;

/// One block version held by one worker.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Row {
    version: u64,
    index: u32,
    slot: Slot,
}

/// Rows a file keeps in a list; more go in a hash set, so that no report — a file of
/// millions of blocks, or a worker sending them in the worst order — costs a pass over
/// the list per block.
const LIST_MAX: usize = if cfg!(test) { 4 } else { 64 };

/// What the workers hold of one file. The collections are boxed to keep the entry at 24
/// bytes (a bare `Vec` would make every entry 32).
#[derive(Debug)]
#[allow(clippy::box_collection)]
enum Held {
    /// One block of one version on one or two workers (`slots[1]` 0 when only one).
    One {
        version: u64,
        index: u32,
        slots: [Slot; 2],
    },
    /// Up to `LIST_MAX` rows, one per block version and holder (empty only transiently:
    /// the table drops an empty entry).
    List(Box<Vec<Row>>),
    /// More.
    Set(Box<HashSet<Row>>),
}

impl Held {
    fn iter(&self) -> impl Iterator<Item = Row> + '_ {
        let (version, index, slots, rows, set): (u64, u32, &[Slot], &[Row], _) = match self {
            Held::One {
                version,
                index,
                slots,
            } => (*version, *index, &slots[..], &[], None),
            Held::List(rows) => (0, 0, &[], rows.as_slice(), None),
            Held::Set(set) => (0, 0, &[], &[], Some(set.as_ref())),
        };
        slots
            .iter()
            .filter(|s| **s != 0)
            .map(move |&slot| Row {
                version,
                index,
                slot,
            })
            .chain(rows.iter().copied())
            .chain(set.into_iter().flatten().copied())
    }

    fn holds(&self, row: &Row) -> bool {
        match self {
            Held::One {
                version,
                index,
                slots,
            } => *version == row.version && *index == row.index && slots.contains(&row.slot),
            Held::List(rows) => rows.contains(row),
            Held::Set(set) => set.contains(row),
        }
    }

    fn len(&self) -> usize {
        match self {
            Held::One { slots, .. } => slots.iter().filter(|s| **s != 0).count(),
            Held::List(rows) => rows.len(),
            Held::Set(set) => set.len(),
        }
    }

    /// Adds a row; false when it was there already.
    fn add(&mut self, row: Row) -> bool {
        if self.holds(&row) {
            return false;
        }
        match self {
            Held::One {
                version,
                index,
                slots,
            } if *version == row.version && *index == row.index && slots[1] == 0 => {
                slots[1] = row.slot;
            }
            Held::List(rows) if rows.len() < LIST_MAX => rows.push(row),
            Held::Set(set) => {
                set.insert(row);
            }
            _ => *self = Held::from_rows(self.iter().chain([row]).collect()),
        }
        true
    }

    /// Removes a row; false when it was not there.
    fn remove(&mut self, row: &Row) -> bool {
        let gone = match self {
            Held::Set(set) => set.remove(row),
            _ => self.holds(row),
        };
        if !gone {
            return false;
        }
        match self {
            // A set turns back into a list well below the size that made it one, not at
            // once (a file at the boundary would convert on every report).
            Held::Set(set) if set.len() > LIST_MAX / 2 => {}
            _ => *self = Held::from_rows(self.iter().filter(|r| r != row).collect()),
        }
        true
    }

    /// Keeps the rows `keep` accepts; returns how many went. The caller drops an entry left
    /// empty ([`Held::is_empty`]).
    fn retain(&mut self, keep: impl Fn(&Row) -> bool) -> u64 {
        let gone = self.iter().filter(|r| !keep(r)).count() as u64;
        if gone > 0 {
            *self = Held::from_rows(self.iter().filter(|r| keep(r)).collect());
        }
        gone
    }

    /// The most compact form of `rows` (none: an empty list).
    fn from_rows(rows: Vec<Row>) -> Held {
        match rows.as_slice() {
            [a] => Held::One {
                version: a.version,
                index: a.index,
                slots: [a.slot, 0],
            },
            [a, b] if a.version == b.version && a.index == b.index => Held::One {
                version: a.version,
                index: a.index,
                slots: [a.slot, b.slot],
            },
            _ if rows.len() <= LIST_MAX => Held::List(Box::new(rows)),
            _ => Held::Set(Box::new(rows.into_iter().collect())),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A worker known to the table.
#[derive(Clone, Copy, Default)]
struct SlotUse {
    /// 0: the slot is free.
    worker: u64,
    /// Block versions the worker holds.
    blocks: u64,
}

/// The table is full: more workers hold blocks than a slot can number.
#[derive(Debug, PartialEq, Eq)]
pub struct TooManyWorkers;

#[derive(Default)]
pub(super) struct Table {
    files: HashMap<u64, Held>,
    /// Slot `s` is `slots[s - 1]`.
    slots: Vec<SlotUse>,
    slot_of: HashMap<u64, Slot>,
    free: Vec<Slot>,
}

impl Table {
    fn slot(&self, worker: u64) -> Option<Slot> {
        self.slot_of.get(&worker).copied()
    }

    /// The worker's slot, numbering it if it has none.
    pub fn enlist(&mut self, worker: u64) -> Result<(), TooManyWorkers> {
        self.slot_for(worker).map(|_| ())
    }

    fn slot_for(&mut self, worker: u64) -> Result<Slot, TooManyWorkers> {
        if let Some(s) = self.slot(worker) {
            return Ok(s);
        }
        let s = match self.free.pop() {
            Some(s) => s,
            None => {
                let s = Slot::try_from(self.slots.len() + 1).map_err(|_| TooManyWorkers)?;
                self.slots.push(SlotUse::default());
                s
            }
        };
        self.slots[usize::from(s) - 1] = SlotUse { worker, blocks: 0 };
        self.slot_of.insert(worker, s);
        Ok(s)
    }

    pub fn add(&mut self, worker: u64, b: &BlockId) -> Result<(), TooManyWorkers> {
        let slot = self.slot_for(worker)?;
        let row = Row {
            version: b.version,
            index: b.index,
            slot,
        };
        let added = match self.files.get_mut(&b.inode) {
            Some(held) => held.add(row),
            None => {
                self.files.insert(b.inode, Held::from_rows(vec![row]));
                true
            }
        };
        if added {
            self.slots[usize::from(slot) - 1].blocks += 1;
        }
        Ok(())
    }

    pub fn remove(&mut self, worker: u64, b: &BlockId) {
        let Some(slot) = self.slot(worker) else {
            return;
        };
        let Some(held) = self.files.get_mut(&b.inode) else {
            return;
        };
        let row = Row {
            version: b.version,
            index: b.index,
            slot,
        };
        if held.remove(&row) {
            self.slots[usize::from(slot) - 1].blocks -= 1;
        }
        if held.is_empty() {
            self.files.remove(&b.inode);
        }
    }

    /// Forgets every block `worker` holds and frees its slot.
    pub fn drop_worker(&mut self, worker: u64) {
        let Some(slot) = self.slot_of.remove(&worker) else {
            return;
        };
        if self.slots[usize::from(slot) - 1].blocks > 0 {
            self.files.retain(|_, held| {
                held.retain(|r| r.slot != slot);
                !held.is_empty()
            });
        }
        self.slots[usize::from(slot) - 1] = SlotUse::default();
        self.free.push(slot);
    }

    /// The workers holding block `b`, by id, ascending.
    pub fn workers_of(&self, b: &BlockId) -> Vec<u64> {
        let Some(held) = self.files.get(&b.inode) else {
            return Vec::new();
        };
        let mut out: Vec<u64> = match held {
            // A file of many rows: one probe per known worker, not a pass over the rows.
            Held::Set(set) => self
                .slot_of
                .iter()
                .filter(|(_, slot)| {
                    set.contains(&Row {
                        version: b.version,
                        index: b.index,
                        slot: **slot,
                    })
                })
                .map(|(worker, _)| *worker)
                .collect(),
            _ => held
                .iter()
                .filter(|r| r.version == b.version && r.index == b.index)
                .map(|r| self.slots[usize::from(r.slot) - 1].worker)
                .collect(),
        };
        out.sort_unstable();
        out
    }

    /// `(worker, version)` for every block of `inode` held anywhere.
    pub fn holders(&self, inode: u64) -> Vec<(u64, u64)> {
        let Some(held) = self.files.get(&inode) else {
            return Vec::new();
        };
        held.iter()
            .map(|r| (self.slots[usize::from(r.slot) - 1].worker, r.version))
            .collect()
    }

    /// The files `worker` holds a block of (a scan of the whole table).
    pub fn inodes_of(&self, worker: u64) -> HashSet<u64> {
        let Some(slot) = self.slot(worker) else {
            return HashSet::new();
        };
        if self.slots[usize::from(slot) - 1].blocks == 0 {
            return HashSet::new();
        }
        self.files
            .iter()
            .filter(|(_, held)| held.iter().any(|r| r.slot == slot))
            .map(|(inode, _)| *inode)
            .collect()
    }

    pub fn block_count(&self, worker: u64) -> u64 {
        self.slot(worker)
            .map(|s| self.slots[usize::from(s) - 1].blocks)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Add(u64, BlockId),
        Remove(u64, BlockId),
        Drop(u64),
    }

    fn block() -> impl Strategy<Value = BlockId> {
        (1u64..4, 1u64..3, 0u32..3).prop_map(|(inode, version, index)| BlockId {
            inode,
            version,
            index,
        })
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (1u64..6, block()).prop_map(|(w, b)| Op::Add(w, b)),
            3 => (1u64..6, block()).prop_map(|(w, b)| Op::Remove(w, b)),
            1 => (1u64..6).prop_map(Op::Drop),
        ]
    }

    type Model = BTreeMap<(u64, u64, u32), BTreeSet<u64>>;

    proptest! {
        /// The compact table answers every question as a plain map of block → holders
        /// would, whatever the order of reports, removals and worker losses.
        #[test]
        fn the_table_agrees_with_a_plain_map(ops in prop::collection::vec(op(), 0..80)) {
            let mut t = Table::default();
            let mut model = Model::new();
            for op in &ops {
                match op {
                    Op::Add(w, b) => {
                        t.add(*w, b).unwrap();
                        model.entry((b.inode, b.version, b.index)).or_default().insert(*w);
                    }
                    Op::Remove(w, b) => {
                        t.remove(*w, b);
                        if let Some(set) = model.get_mut(&(b.inode, b.version, b.index)) {
                            set.remove(w);
                        }
                    }
                    Op::Drop(w) => {
                        t.drop_worker(*w);
                        for set in model.values_mut() {
                            set.remove(w);
                        }
                    }
                }
                model.retain(|_, s| !s.is_empty());
                for inode in 1..4 {
                    let mut holders = t.holders(inode);
                    holders.sort_unstable();
                    let mut want: Vec<(u64, u64)> = model
                        .iter()
                        .filter(|(k, _)| k.0 == inode)
                        .flat_map(|(k, s)| s.iter().map(move |w| (*w, k.1)))
                        .collect();
                    want.sort_unstable();
                    prop_assert_eq!(holders, want);
                    for version in 1..3 {
                        for index in 0..3 {
                            let b = BlockId { inode, version, index };
                            let want: Vec<u64> = model
                                .get(&(inode, version, index))
                                .map(|s| s.iter().copied().collect())
                                .unwrap_or_default();
                            prop_assert_eq!(t.workers_of(&b), want);
                        }
                    }
                }
                for w in 1..6 {
                    let held: Vec<_> = model.iter().filter(|(_, s)| s.contains(&w)).collect();
                    prop_assert_eq!(t.block_count(w), held.len() as u64);
                    let inodes: HashSet<u64> = held.iter().map(|(k, _)| k.0).collect();
                    prop_assert_eq!(t.inodes_of(w), inodes);
                }
                prop_assert_eq!(t.files.len(), model.keys().map(|k| k.0).collect::<HashSet<_>>().len());
            }
        }
    }

    #[test]
    fn a_small_file_on_two_workers_takes_no_allocation() {
        assert_eq!(std::mem::size_of::<Held>(), 24);
        let mut t = Table::default();
        let b = BlockId {
            inode: 7,
            version: 3,
            index: 0,
        };
        t.add(10, &b).unwrap();
        t.add(20, &b).unwrap();
        assert!(matches!(t.files[&7], Held::One { .. }));
        let c = BlockId { index: 1, ..b };
        t.add(10, &c).unwrap();
        assert!(matches!(t.files[&7], Held::List(_)));
        t.remove(10, &c);
        assert!(matches!(t.files[&7], Held::One { .. }));
    }

    /// A report of a file's blocks in the worst order (a list would be scanned once per
    /// block: quadratic, minutes for this many) lands in a set, and shrinks back to a list.
    #[test]
    fn a_file_of_many_blocks_is_held_in_a_set() {
        let mut t = Table::default();
        let n = 200_000u32;
        for index in (0..n).rev() {
            let b = BlockId {
                inode: 3,
                version: 1,
                index,
            };
            t.add(1, &b).unwrap();
            t.add(2, &b).unwrap();
        }
        assert!(matches!(t.files[&3], Held::Set(_)));
        assert_eq!(t.block_count(1), u64::from(n));
        let b = |index| BlockId {
            inode: 3,
            version: 1,
            index,
        };
        assert_eq!(t.workers_of(&b(n / 2)), vec![1, 2]);
        for index in 1..n {
            t.remove(2, &b(index));
            t.remove(1, &b(index));
        }
        assert!(matches!(t.files[&3], Held::One { .. }));
        assert_eq!(t.workers_of(&b(0)), vec![1, 2]);
        assert_eq!((t.block_count(1), t.block_count(2)), (1, 1));
    }

    #[test]
    fn slots_run_out_and_come_back() {
        let mut t = Table::default();
        let b = BlockId {
            inode: 1,
            version: 1,
            index: 0,
        };
        for w in 1..=u64::from(Slot::MAX) {
            t.enlist(w).unwrap();
        }
        assert_eq!(t.add(u64::MAX, &b), Err(TooManyWorkers));
        t.drop_worker(5);
        t.add(u64::MAX, &b).unwrap();
        assert_eq!(t.workers_of(&b), vec![u64::MAX]);
    }
}
