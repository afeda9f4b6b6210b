//! Raft log, hard state and conf state in RocksDB (column family `raft`).
//!
//! Layout: `hs` → HardState, `cs` → ConfState, `snap` → (index, term) of the last compaction
//! point (0, 0 until the log is first compacted), `sm` → metadata of the newest local
//! state-machine snapshot file, `inst` → metadata of a snapshot being installed (present
//! only while its records replace the state, and after a stop part-way: the install is
//! finished at the next open), `e` + index (big endian) → Entry. (Member addresses live in
//! the state machine, so they travel with snapshots.)
//! Every write is synced before `append`/`persist_*` return: Raft acknowledges nothing that
//! could be lost by kill -9 or a power cut.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};
use rocksdb::{WriteBatch, WriteOptions, DB};

use crate::error::MasterError;

pub const CF_RAFT: &str = "raft";

const KEY_HARD_STATE: &[u8] = b"hs";
const KEY_CONF_STATE: &[u8] = b"cs";
const KEY_SNAPSHOT_POINT: &[u8] = b"snap";
const KEY_SNAPSHOT_META: &[u8] = b"sm";
const KEY_INSTALLING: &[u8] = b"inst";

fn entry_key(index: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = b'e';
    k[1..].copy_from_slice(&index.to_be_bytes());
    k
}

#[derive(Debug, Clone, Copy, Default)]
struct Bounds {
    /// Index and term of the entry just before the first stored one.
    snap_index: u64,
    snap_term: u64,
    /// Index of the last stored entry (== snap_index when the log is empty).
    last_index: u64,
}

/// How many of the newest entries [`Tail`] keeps decoded, and how many bytes of them.
const TAIL_ENTRIES: usize = 4096;
const TAIL_BYTES: usize = 16 << 20;

/// The newest entries of the log, decoded: a suffix that ends at the last index (or
/// nothing). Raft asks for the terms and entries it has just appended several times a
/// round (each follower's append, the commit check, applying); each was a RocksDB read
/// and a decode of the whole entry. Entries share their data with the caller's (`Bytes`).
#[derive(Default)]
struct Tail {
    entries: VecDeque<Entry>,
    bytes: usize,
}

fn tail_size(e: &Entry) -> usize {
    e.data.len() + e.context.len() + 32
}

impl Tail {
    fn get(&self, index: u64) -> Option<&Entry> {
        let first = self.entries.front()?.index;
        let i = usize::try_from(index.checked_sub(first)?).ok()?;
        self.entries.get(i)
    }

    /// `entries` were written at their indexes, replacing every entry from the first on.
    /// A suffix that replaces entries (after a leader change) starts the tail afresh.
    fn appended(&mut self, entries: &[Entry]) {
        let Some(first) = entries.first() else {
            return;
        };
        if self
            .entries
            .back()
            .is_some_and(|e| e.index + 1 != first.index)
        {
            self.clear();
        }
        for e in entries {
            self.bytes += tail_size(e);
            self.entries.push_back(e.clone());
        }
        while self.entries.len() > TAIL_ENTRIES || self.bytes > TAIL_BYTES {
            match self.entries.pop_front() {
                Some(e) => self.bytes -= tail_size(&e),
                None => break,
            }
        }
    }

    /// The log was compacted up to `index` (inclusive).
    fn compacted(&mut self, index: u64) {
        while self.entries.front().is_some_and(|e| e.index <= index) {
            if let Some(e) = self.entries.pop_front() {
                self.bytes -= tail_size(&e);
            }
        }
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }
}

/// RocksDB-backed `raft::Storage`.
#[derive(Clone)]
pub struct RocksLogStorage {
    db: Arc<DB>,
    bounds: Arc<Mutex<Bounds>>,
    tail: Arc<Mutex<Tail>>,
    /// Set when raft-rs asked for a snapshot newer than the one on disk.
    snapshot_wanted: Arc<std::sync::atomic::AtomicBool>,
}

fn storage_err(e: impl std::fmt::Display) -> raft::Error {
    raft::Error::Store(StorageError::Other(e.to_string().into()))
}

impl RocksLogStorage {
    /// Opens the log in `db`, reading the log bounds. A brand-new log is initialised with
    /// `initial_voters` as its configuration.
    pub fn open(db: Arc<DB>, initial_voters: &[u64]) -> Result<Self, MasterError> {
        let s = Self {
            db,
            bounds: Arc::new(Mutex::new(Bounds::default())),
            tail: Arc::default(),
            snapshot_wanted: Arc::default(),
        };
        let (snap_index, snap_term) = match s.get(KEY_SNAPSHOT_POINT)? {
            Some(v) if v.len() == 16 => (
                u64::from_be_bytes(v[..8].try_into().unwrap_or_default()),
                u64::from_be_bytes(v[8..].try_into().unwrap_or_default()),
            ),
            Some(_) => return Err(MasterError::corrupt("raft snapshot point has a bad length")),
            None => (0, 0),
        };
        let last_index = s.scan_last_index()?.unwrap_or(snap_index);
        *s.lock() = Bounds {
            snap_index,
            snap_term,
            last_index,
        };
        if s.get(KEY_CONF_STATE)?.is_none() {
            let mut cs = ConfState::default();
            cs.set_voters(initial_voters.to_vec());
            s.put_sync(KEY_CONF_STATE, &encode(&cs)?)?;
        }
        Ok(s)
    }

    pub fn db(&self) -> &Arc<DB> {
        &self.db
    }

    /// Metadata of the newest local snapshot file, if any.
    pub fn snapshot_meta(&self) -> Result<Option<SnapshotMetadata>, MasterError> {
        self.get(KEY_SNAPSHOT_META)?.map(|v| decode(&v)).transpose()
    }

    /// Takes the "raft-rs wants a newer snapshot" flag.
    pub fn take_snapshot_wanted(&self) -> bool {
        self.snapshot_wanted
            .swap(false, std::sync::atomic::Ordering::Relaxed)
    }

    /// Records a freshly written local snapshot and compacts the log up to `compact_to`
    /// (which must not pass the snapshot), in one synced write.
    pub fn snapshot_written(
        &self,
        meta: &SnapshotMetadata,
        compact_to: u64,
    ) -> Result<(), MasterError> {
        let cf = self.cf()?;
        let mut batch = WriteBatch::default();
        batch.put_cf(cf, KEY_SNAPSHOT_META, encode(meta)?);
        let mut bounds = self.lock();
        let compact_to = compact_to.min(meta.index).min(bounds.last_index);
        if compact_to > bounds.snap_index {
            let term = self
                .read_entry(compact_to)
                .map_err(|e| MasterError::Storage {
                    message: format!("reading the term of index {compact_to}: {e}"),
                })?
                .term;
            batch.delete_range_cf(cf, entry_key(bounds.snap_index), entry_key(compact_to + 1));
            batch.put_cf(cf, KEY_SNAPSHOT_POINT, point(compact_to, term));
            let mut wo = WriteOptions::default();
            wo.set_sync(true);
            self.db.write_opt(batch, &wo)?;
            bounds.snap_index = compact_to;
            bounds.snap_term = term;
            self.tail().compacted(compact_to);
        } else {
            let mut wo = WriteOptions::default();
            wo.set_sync(true);
            self.db.write_opt(batch, &wo)?;
        }
        Ok(())
    }

    /// Records (synced) that the state is about to be replaced by the snapshot `meta`: until
    /// [`install_snapshot_into`](Self::install_snapshot_into)'s batch is written, the state
    /// may be part old, part new, and an open finishes the install first
    /// ([`installing`](Self::installing)).
    pub fn begin_install(&self, meta: &SnapshotMetadata) -> Result<(), MasterError> {
        self.put_sync(KEY_INSTALLING, &encode(meta)?)
    }

    /// The snapshot whose install was begun and not finished, if any.
    pub fn installing(&self) -> Result<Option<SnapshotMetadata>, MasterError> {
        self.get(KEY_INSTALLING)?.map(|v| decode(&v)).transpose()
    }

    /// Adds to `batch` the log side of installing a snapshot received from the leader: the
    /// log is emptied, the compaction point and configuration come from the snapshot, the
    /// commit index moves up to it, and the install is over ([`begin_install`]'s mark goes).
    /// Call `snapshot_installed` after the batch is written.
    ///
    /// [`begin_install`]: Self::begin_install
    pub fn install_snapshot_into(
        &self,
        meta: &SnapshotMetadata,
        batch: &mut WriteBatch,
    ) -> Result<(), MasterError> {
        let cf = self.cf()?;
        let bounds = *self.lock();
        batch.delete_range_cf(
            cf,
            entry_key(0),
            entry_key(bounds.last_index.max(meta.index) + 1),
        );
        batch.put_cf(cf, KEY_SNAPSHOT_POINT, point(meta.index, meta.term));
        batch.put_cf(cf, KEY_SNAPSHOT_META, encode(meta)?);
        batch.put_cf(cf, KEY_CONF_STATE, encode(meta.get_conf_state())?);
        let mut hs = self.hard_state()?;
        hs.commit = hs.commit.max(meta.index);
        hs.term = hs.term.max(meta.term);
        batch.put_cf(cf, KEY_HARD_STATE, encode(&hs)?);
        batch.delete_cf(cf, KEY_INSTALLING);
        Ok(())
    }

    pub fn snapshot_installed(&self, meta: &SnapshotMetadata) {
        self.tail().clear();
        *self.lock() = Bounds {
            snap_index: meta.index,
            snap_term: meta.term,
            last_index: meta.index,
        };
    }

    /// Adds to `batch` a new configuration.
    pub fn conf_state_into(
        &self,
        cs: &ConfState,
        batch: &mut WriteBatch,
    ) -> Result<(), MasterError> {
        batch.put_cf(self.cf()?, KEY_CONF_STATE, encode(cs)?);
        Ok(())
    }

    fn tail(&self) -> std::sync::MutexGuard<'_, Tail> {
        match self.tail.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Bounds> {
        match self.bounds.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn cf(&self) -> Result<&rocksdb::ColumnFamily, MasterError> {
        self.db
            .cf_handle(CF_RAFT)
            .ok_or_else(|| MasterError::corrupt("column family 'raft' is missing"))
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, MasterError> {
        Ok(self.db.get_cf(self.cf()?, key)?)
    }

    fn put_sync(&self, key: &[u8], value: &[u8]) -> Result<(), MasterError> {
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        Ok(self.db.put_cf_opt(self.cf()?, key, value, &wo)?)
    }

    fn scan_last_index(&self) -> Result<Option<u64>, MasterError> {
        let mut it = self.db.raw_iterator_cf(self.cf()?);
        it.seek_for_prev(entry_key(u64::MAX));
        if it.valid() {
            if let Some(k) = it.key() {
                if k.len() == 9 && k[0] == b'e' {
                    let idx = u64::from_be_bytes(k[1..].try_into().unwrap_or_default());
                    return Ok(Some(idx));
                }
            }
        }
        it.status()?;
        Ok(None)
    }

    pub fn hard_state(&self) -> Result<HardState, MasterError> {
        match self.get(KEY_HARD_STATE)? {
            Some(v) => decode(&v),
            None => Ok(HardState::default()),
        }
    }

    pub fn conf_state(&self) -> Result<ConfState, MasterError> {
        match self.get(KEY_CONF_STATE)? {
            Some(v) => decode(&v),
            None => Ok(ConfState::default()),
        }
    }

    /// Term of the entry at `idx` (the compaction point's term for `idx == first - 1`).
    pub fn term_of(&self, idx: u64) -> raft::Result<u64> {
        Storage::term(self, idx)
    }

    pub fn last(&self) -> u64 {
        self.lock().last_index
    }

    pub fn first(&self) -> u64 {
        self.lock().snap_index + 1
    }

    /// Appends entries (truncating any conflicting suffix) and, if given, the hard state, in
    /// one synced write.
    pub fn persist(&self, entries: &[Entry], hs: Option<&HardState>) -> Result<(), MasterError> {
        self.write_log(entries, hs, true)
    }

    fn write_log(
        &self,
        entries: &[Entry],
        hs: Option<&HardState>,
        sync: bool,
    ) -> Result<(), MasterError> {
        if entries.is_empty() && hs.is_none() {
            return Ok(());
        }
        let cf = self.cf()?;
        let mut batch = WriteBatch::default();
        let mut bounds = self.lock();
        let mut new_last = bounds.last_index;
        if let Some(first) = entries.first() {
            if first.index <= bounds.snap_index {
                return Err(MasterError::corrupt(format!(
                    "append at index {} is at or before the compaction point {}",
                    first.index, bounds.snap_index
                )));
            }
            if first.index > bounds.last_index + 1 {
                return Err(MasterError::corrupt(format!(
                    "append at index {} leaves a gap after last index {}",
                    first.index, bounds.last_index
                )));
            }
            // Entries after the new suffix's start are replaced.
            for idx in first.index..=bounds.last_index {
                batch.delete_cf(cf, entry_key(idx));
            }
            for e in entries {
                batch.put_cf(cf, entry_key(e.index), encode(e)?);
            }
            new_last = entries.last().map(|e| e.index).unwrap_or(new_last);
        }
        if let Some(hs) = hs {
            batch.put_cf(cf, KEY_HARD_STATE, encode(hs)?);
        }
        let mut wo = WriteOptions::default();
        wo.set_sync(sync);
        self.db.write_opt(batch, &wo)?;
        bounds.last_index = new_last;
        self.tail().appended(entries);
        Ok(())
    }

    /// Writes the unsynced writes buffered since the last synced one (applied entries, the
    /// commit index) to the log file, without syncing it: after a round of the Raft loop
    /// they survive a crash of this process, as each did when written alone.
    pub fn flush_wal(&self) -> Result<(), MasterError> {
        Ok(self.db.flush_wal(false)?)
    }

    /// Records a hard state whose term and vote are those already recorded (only its
    /// commit index moved): not synced, as [`Self::persist_commit`].
    pub fn persist_commit_of(&self, hs: &HardState) -> Result<(), MasterError> {
        self.write_log(&[], Some(hs), false)
    }

    /// Records a new commit index in the hard state. Not synced: a commit index lost in a
    /// crash is learnt again from the leader (and boot validation raises it to the applied
    /// index), so it need not cost an fsync per commit.
    pub fn persist_commit(&self, commit: u64) -> Result<(), MasterError> {
        let mut hs = self.hard_state()?;
        if hs.commit != commit {
            hs.commit = commit;
            self.write_log(&[], Some(&hs), false)?;
        }
        Ok(())
    }

    /// Checks the invariants Raft relies on and repairs the one benign case (a commit index
    /// persisted behind an already-applied index). Returns a clear error instead of letting
    /// raft-rs panic on an inconsistent store.
    pub fn validate(&self, applied: u64) -> Result<(), MasterError> {
        let mut hs = self.hard_state()?;
        let b = *self.lock();
        if hs.commit > b.last_index {
            return Err(MasterError::corrupt(format!(
                "raft hard state commit index {} is beyond the last log index {}",
                hs.commit, b.last_index
            )));
        }
        if applied > b.last_index {
            return Err(MasterError::corrupt(format!(
                "state machine applied index {applied} is beyond the last log index {}",
                b.last_index
            )));
        }
        if applied < b.snap_index {
            return Err(MasterError::corrupt(format!(
                "state machine applied index {applied} is before the log's compaction point {}",
                b.snap_index
            )));
        }
        if let Some(meta) = self.snapshot_meta()? {
            if meta.index < b.snap_index {
                return Err(MasterError::corrupt(format!(
                    "the newest snapshot (index {}) is older than the log's compaction point {}",
                    meta.index, b.snap_index
                )));
            }
            if meta.index > applied {
                return Err(MasterError::corrupt(format!(
                    "the newest snapshot (index {}) is ahead of the applied index {applied}",
                    meta.index
                )));
            }
        } else if b.snap_index > 0 {
            return Err(MasterError::corrupt(format!(
                "the log is compacted up to {} but no snapshot is recorded",
                b.snap_index
            )));
        }
        if hs.commit < applied {
            // Applied entries were committed; the commit index write just had not landed.
            hs.commit = applied;
            self.persist(&[], Some(&hs))?;
        }
        // Every index in (snap_index, last_index] must be present.
        let mut it = self.db.raw_iterator_cf(self.cf()?);
        let mut expected = b.snap_index + 1;
        it.seek(entry_key(expected));
        while it.valid() {
            let Some(k) = it.key() else { break };
            if k.len() != 9 || k[0] != b'e' {
                break;
            }
            let idx = u64::from_be_bytes(k[1..].try_into().unwrap_or_default());
            if idx != expected {
                return Err(MasterError::corrupt(format!(
                    "raft log has a hole: expected index {expected}, found {idx}"
                )));
            }
            expected += 1;
            it.next();
        }
        it.status()?;
        if expected != b.last_index + 1 {
            return Err(MasterError::corrupt(format!(
                "raft log ends at {} but last index is {}",
                expected - 1,
                b.last_index
            )));
        }
        Ok(())
    }

    fn read_entry(&self, idx: u64) -> raft::Result<Entry> {
        let cf = self.cf().map_err(storage_err)?;
        match self.db.get_cf(cf, entry_key(idx)).map_err(storage_err)? {
            Some(v) => decode(&v).map_err(storage_err),
            None => Err(raft::Error::Store(StorageError::Unavailable)),
        }
    }
}

fn point(index: u64, term: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(16);
    v.extend_from_slice(&index.to_be_bytes());
    v.extend_from_slice(&term.to_be_bytes());
    v
}

pub(crate) fn encode<M: protobuf::Message>(m: &M) -> Result<Vec<u8>, MasterError> {
    m.write_to_bytes()
        .map_err(|e| MasterError::corrupt(format!("encoding raft message: {e}")))
}

pub(crate) fn decode<M: protobuf::Message>(bytes: &[u8]) -> Result<M, MasterError> {
    M::parse_from_bytes(bytes)
        .map_err(|e| MasterError::corrupt(format!("decoding raft record: {e}")))
}

impl Storage for RocksLogStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(
            self.hard_state().map_err(storage_err)?,
            self.conf_state().map_err(storage_err)?,
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let b = *self.lock();
        if low <= b.snap_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > b.last_index + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let mut out = Vec::with_capacity((high - low) as usize);
        for idx in low..high {
            let cached = self.tail().get(idx).cloned();
            out.push(match cached {
                Some(e) => e,
                None => self.read_entry(idx)?,
            });
        }
        raft::util::limit_size(&mut out, max_size.into());
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        let b = *self.lock();
        if idx == b.snap_index {
            return Ok(b.snap_term);
        }
        if idx < b.snap_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if idx > b.last_index {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        if let Some(e) = self.tail().get(idx) {
            return Ok(e.term);
        }
        Ok(self.read_entry(idx)?.term)
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.first())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        // The snapshot's bytes live in a file the transport streams; the message carries
        // only the metadata. A snapshot whose configuration does not include the receiver
        // (taken before it was added) would be refused by it forever: ask for a newer one.
        let includes = |meta: &SnapshotMetadata| {
            let cs = meta.get_conf_state();
            cs.voters.contains(&to) || cs.learners.contains(&to)
        };
        match self.snapshot_meta().map_err(storage_err)? {
            Some(meta)
                if meta.index >= request_index
                    && meta.index >= self.first() - 1
                    && includes(&meta) =>
            {
                let mut snap = Snapshot::default();
                snap.set_metadata(meta);
                Ok(snap)
            }
            _ => {
                self.snapshot_wanted
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                Err(raft::Error::Store(
                    StorageError::SnapshotTemporarilyUnavailable,
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_db(dir: &std::path::Path) -> Arc<DB> {
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        Arc::new(DB::open_cf(&opts, dir, [CF_RAFT]).unwrap())
    }

    fn entry(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            data: vec![index as u8].into(),
            ..Default::default()
        }
    }

    /// The decoded tail answers exactly what the store holds: appends, conflicting
    /// suffixes (the tail cut back, or past its start), compactions and the tail's own
    /// bounds, against a model of the log and against the store read after a reopen.
    #[test]
    fn the_decoded_tail_answers_what_the_store_holds() {
        let dir = tempfile::tempdir().unwrap();
        let db = open_db(dir.path());
        let s = RocksLogStorage::open(db.clone(), &[1]).unwrap();
        let mut model: Vec<Entry> = Vec::new(); // index i + 1 at i
        let (mut term, mut seed, mut compacted) = (1u64, 7u64, 0u64);
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        for step in 0..400 {
            let last = model.len() as u64;
            let from = match next() % 10 {
                // A conflicting suffix from a new term, near the end or far back.
                0 if last > compacted + 1 => {
                    term += 1;
                    last - next() % (last - compacted).min(if step % 3 == 0 { 5000 } else { 8 })
                }
                _ => last + 1,
            }
            .max(compacted + 1);
            let n = 1 + next() % 40;
            let batch: Vec<Entry> = (from..from + n)
                .map(|i| Entry {
                    index: i,
                    term,
                    data: vec![(i % 251) as u8; (next() % 64) as usize].into(),
                    ..Default::default()
                })
                .collect();
            s.persist(&batch, None).unwrap();
            model.truncate(from as usize - 1);
            model.extend(batch);
            if step % 50 == 49 {
                let to = (model.len() as u64).saturating_sub(3000);
                if to > compacted {
                    let meta = SnapshotMetadata {
                        index: to,
                        term: model[to as usize - 1].term,
                        ..Default::default()
                    };
                    s.snapshot_written(&meta, to).unwrap();
                    compacted = to;
                }
            }
            let last = model.len() as u64;
            assert_eq!(s.last(), last);
            for idx in [
                compacted + 1,
                last.saturating_sub(4100).max(compacted + 1),
                last,
            ] {
                assert_eq!(s.term(idx).unwrap(), model[idx as usize - 1].term, "{idx}");
            }
            let low = last.saturating_sub(next() % 5000).max(compacted + 1);
            let got = s
                .entries(low, last + 1, None, GetEntriesContext::empty(false))
                .unwrap();
            assert_eq!(
                got,
                model[low as usize - 1..].to_vec(),
                "entries {low}..={last}"
            );
        }
        assert!(s.tail().entries.len() <= TAIL_ENTRIES);
        drop(s);
        let reopened = RocksLogStorage::open(db, &[1]).unwrap();
        let last = model.len() as u64;
        let got = reopened
            .entries(
                compacted + 1,
                last + 1,
                None,
                GetEntriesContext::empty(false),
            )
            .unwrap();
        assert_eq!(got, model[compacted as usize..].to_vec());
    }

    #[test]
    fn append_truncate_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = RocksLogStorage::open(open_db(dir.path()), &[1]).unwrap();
            s.persist(&[entry(1, 1), entry(2, 1), entry(3, 1)], None)
                .unwrap();
            // A conflicting suffix from a new term replaces 2..=3.
            s.persist(&[entry(2, 2)], None).unwrap();
            assert_eq!(s.last(), 2);
            assert_eq!(s.term(2).unwrap(), 2);
            let hs = HardState {
                commit: 2,
                term: 2,
                ..Default::default()
            };
            s.persist(&[], Some(&hs)).unwrap();
        }
        let s = RocksLogStorage::open(open_db(dir.path()), &[1]).unwrap();
        assert_eq!(s.last(), 2);
        assert_eq!(s.hard_state().unwrap().commit, 2);
        assert_eq!(s.conf_state().unwrap().voters, vec![1]);
        s.validate(2).unwrap();
        assert!(s.validate(3).is_err());
        let got = s
            .entries(1, 3, None, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn commit_behind_applied_is_repaired() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksLogStorage::open(open_db(dir.path()), &[1]).unwrap();
        s.persist(&[entry(1, 1), entry(2, 1)], None).unwrap();
        s.validate(2).unwrap();
        assert_eq!(s.hard_state().unwrap().commit, 2);
    }

    #[test]
    fn compaction_behind_a_snapshot_survives_reopen_and_is_validated() {
        let dir = tempfile::tempdir().unwrap();
        let meta = |index, term| {
            let mut m = SnapshotMetadata {
                index,
                term,
                ..Default::default()
            };
            m.mut_conf_state().set_voters(vec![1, 2, 3]);
            m
        };
        {
            let s = RocksLogStorage::open(open_db(dir.path()), &[1, 2, 3]).unwrap();
            let entries: Vec<Entry> = (1..=10)
                .map(|i| entry(i, if i < 6 { 1 } else { 2 }))
                .collect();
            s.persist(&entries, None).unwrap();
            s.snapshot_written(&meta(8, 2), 6).unwrap();
            assert_eq!(s.first(), 7);
            assert_eq!(s.term(6).unwrap(), 2);
            assert!(matches!(
                s.entries(5, 8, None, GetEntriesContext::empty(false)),
                Err(raft::Error::Store(StorageError::Compacted))
            ));
            // raft-rs gets the snapshot's metadata to send, to a member it includes.
            assert_eq!(s.snapshot(0, 2).unwrap().get_metadata().index, 8);
            assert!(
                s.snapshot(0, 4).is_err(),
                "sent to a member it does not include"
            );
            assert!(s.take_snapshot_wanted());
            // A request for a newer one is refused and remembered.
            assert!(s.snapshot(9, 2).is_err());
            assert!(s.take_snapshot_wanted());
        }
        let s = RocksLogStorage::open(open_db(dir.path()), &[1, 2, 3]).unwrap();
        assert_eq!((s.first(), s.last()), (7, 10));
        s.validate(9).unwrap();
        let e = s.validate(7).unwrap_err().to_string();
        assert!(e.contains("ahead of the applied index 7"), "{e}");
        let e = s.validate(5).unwrap_err().to_string();
        assert!(e.contains("before the log's compaction point 6"), "{e}");
    }

    #[test]
    fn an_installed_snapshot_replaces_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let db = open_db(dir.path());
        let s = RocksLogStorage::open(db.clone(), &[1, 2, 3]).unwrap();
        s.persist(&[entry(1, 1), entry(2, 1)], None).unwrap();
        let mut meta = SnapshotMetadata {
            index: 50,
            term: 3,
            ..Default::default()
        };
        meta.mut_conf_state().set_voters(vec![1, 2, 3, 4]);
        let mut batch = WriteBatch::default();
        s.install_snapshot_into(&meta, &mut batch).unwrap();
        db.write(batch).unwrap();
        s.snapshot_installed(&meta);
        assert_eq!((s.first(), s.last()), (51, 50));
        assert_eq!(s.term(50).unwrap(), 3);
        assert_eq!(s.hard_state().unwrap().commit, 50);
        assert_eq!(s.conf_state().unwrap().voters, vec![1, 2, 3, 4]);
        s.validate(50).unwrap();
        let again = RocksLogStorage::open(db, &[1]).unwrap();
        assert_eq!((again.first(), again.last()), (51, 50));
    }

    #[test]
    fn a_compacted_log_without_a_snapshot_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = open_db(dir.path());
        let s = RocksLogStorage::open(db.clone(), &[1]).unwrap();
        s.persist(&[entry(1, 1), entry(2, 1), entry(3, 1)], None)
            .unwrap();
        s.put_sync(KEY_SNAPSHOT_POINT, &point(2, 1)).unwrap();
        let s = RocksLogStorage::open(db, &[1]).unwrap();
        let e = s.validate(3).unwrap_err().to_string();
        assert!(e.contains("no snapshot is recorded"), "{e}");
    }

    #[test]
    fn gap_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksLogStorage::open(open_db(dir.path()), &[1]).unwrap();
        assert!(s.persist(&[entry(5, 1)], None).is_err());
    }
}
