//! State-machine snapshots as files.
//!
//! A snapshot is taken at an applied index by creating a RocksDB checkpoint (hard links,
//! cheap, on the Raft thread so nothing is applied meanwhile), then copying the checkpoint's
//! `state` column family into one file off the Raft thread. The file is a sequence of
//! `[u32 key len][key][u32 value len][value]` records followed by a footer: the magic
//! `GRSNAPv1`, the record count and the CRC32C of everything before the footer.
//!
//! Records are written in the group's format: as JSON while its Raft entries are (see
//! `state::format`), so that a master of an older release can install them.
//!
//! Files are named `snap-<index>-<term>.bin` in the master's `snapshots/` directory; the
//! transport streams them to followers that need them, which install them ([`install`]): the
//! records become RocksDB table files (in order, checksum verified) that replace the state,
//! under a mark in the log that makes an open after a stop part-way finish the install.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use raft::eraftpb::SnapshotMetadata;
use rocksdb::{WriteBatch, DB};

use super::storage::RocksLogStorage;
use crate::error::MasterError;
use crate::state::CF_STATE;

const MAGIC: &[u8; 8] = b"GRSNAPv1";
const FOOTER_LEN: u64 = 8 + 8 + 4;

fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> MasterError {
    MasterError::Storage {
        message: format!("{what} {}: {e}", path.display()),
    }
}

/// The directory holding snapshot files.
#[derive(Debug, Clone)]
pub struct SnapshotDir {
    dir: PathBuf,
}

impl SnapshotDir {
    pub fn open(dir: PathBuf) -> Result<Self, MasterError> {
        std::fs::create_dir_all(&dir).map_err(|e| io_err("creating", &dir, e))?;
        // Leftovers of interrupted builds and transfers.
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".tmp") || name.starts_with("checkpoint-") {
                    let p = e.path();
                    let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
                }
            }
        }
        Ok(Self { dir })
    }

    pub fn path_for(&self, index: u64, term: u64) -> PathBuf {
        self.dir.join(format!("snap-{index:020}-{term:020}.bin"))
    }

    /// A temporary file of its own for each writer (two transfers of one snapshot may
    /// overlap, e.g. from an old and a new leader).
    pub fn temp_path(&self, index: u64, term: u64) -> PathBuf {
        self.dir.join(format!(
            "snap-{index:020}-{term:020}.{:016x}.tmp",
            rand::random::<u64>()
        ))
    }

    /// The folder of table files a snapshot is staged into for its install (removed at
    /// the next open when left).
    pub fn staging_path(&self, index: u64) -> PathBuf {
        self.dir.join(format!("install-{index:020}.tmp"))
    }

    pub fn checkpoint_path(&self, index: u64) -> PathBuf {
        self.dir.join(format!("checkpoint-{index:020}"))
    }

    /// Removes the snapshot files older than `keep_index` (newer ones may be a transfer
    /// just received and not installed yet).
    pub fn prune(&self, keep_index: u64) {
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let index = name
                    .strip_prefix("snap-")
                    .filter(|_| name.ends_with(".bin"))
                    .and_then(|rest| rest.get(..20))
                    .and_then(|i| i.parse::<u64>().ok());
                if index.is_some_and(|i| i < keep_index) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

/// Creates a checkpoint of `db` (on the Raft thread, at the current applied index).
pub fn checkpoint(db: &DB, path: &Path) -> Result<(), MasterError> {
    let _ = std::fs::remove_dir_all(path);
    let cp = rocksdb::checkpoint::Checkpoint::new(db)
        .map_err(|e| io_err("preparing a checkpoint at", path, e))?;
    cp.create_checkpoint(path)
        .map_err(|e| io_err("creating the checkpoint", path, e))
}

/// Writes the `state` column family of the checkpoint at `checkpoint` into the snapshot file
/// `out` (via a temporary file, synced), then removes the checkpoint. Returns the file size.
pub fn write_from_checkpoint(
    checkpoint: &Path,
    tmp: &Path,
    out: &Path,
) -> Result<u64, MasterError> {
    let result = (|| {
        let opts = rocksdb::Options::default();
        let db = DB::open_cf_for_read_only(
            &opts,
            checkpoint,
            [super::storage::CF_RAFT, CF_STATE],
            false,
        )
        .map_err(|e| io_err("opening the checkpoint", checkpoint, e))?;
        let cf = db
            .cf_handle(CF_STATE)
            .ok_or_else(|| MasterError::corrupt("checkpoint has no state column family"))?;
        let mut w = RecordWriter::create(tmp)?;
        // A group that may hold masters of a release before format 1 gets what they read.
        let json = crate::state::format::snapshot_in_json(&db, cf)?;
        let mut it = db.raw_iterator_cf(cf);
        it.seek_to_first();
        while it.valid() {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            if let Some(v) = crate::state::format::snapshot_value(k, v, json)? {
                w.push(k, &v)?;
            }
            it.next();
        }
        it.status()?;
        let len = w.finish()?;
        std::fs::rename(tmp, out).map_err(|e| io_err("renaming", out, e))?;
        sync_dir(out);
        Ok(len)
    })();
    let _ = std::fs::remove_dir_all(checkpoint);
    if result.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    result
}

/// Writes a snapshot file's records and footer.
pub(crate) struct RecordWriter {
    w: BufWriter<std::fs::File>,
    path: PathBuf,
    crc: u32,
    count: u64,
}

impl RecordWriter {
    pub(crate) fn create(path: &Path) -> Result<Self, MasterError> {
        let file = std::fs::File::create(path).map_err(|e| io_err("creating", path, e))?;
        Ok(Self {
            w: BufWriter::with_capacity(1 << 20, file),
            path: path.to_path_buf(),
            crc: 0,
            count: 0,
        })
    }

    pub(crate) fn push(&mut self, key: &[u8], value: &[u8]) -> Result<(), MasterError> {
        for part in [key, value] {
            let len = (part.len() as u32).to_le_bytes();
            self.crc = crc32c::crc32c_append(self.crc, &len);
            self.crc = crc32c::crc32c_append(self.crc, part);
            self.write(&len)?;
            self.write(part)?;
        }
        self.count += 1;
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), MasterError> {
        self.w
            .write_all(bytes)
            .map_err(|e| io_err("writing", &self.path, e))
    }

    /// Writes the footer and syncs the file. Returns its size.
    pub(crate) fn finish(mut self) -> Result<u64, MasterError> {
        self.write(MAGIC)?;
        self.write(&self.count.to_le_bytes())?;
        self.write(&self.crc.to_le_bytes())?;
        let file = self
            .w
            .into_inner()
            .map_err(|e| io_err("writing", &self.path, e.error()))?;
        file.sync_all()
            .map_err(|e| io_err("syncing", &self.path, e))?;
        Ok(file.metadata().map(|m| m.len()).unwrap_or(0))
    }
}

/// Fsyncs the directory holding `path` so a rename survives a crash.
pub fn sync_dir(path: &Path) {
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
}

/// Checks a snapshot file's footer and checksum without loading it.
pub fn verify(path: &Path) -> Result<(), MasterError> {
    load(path, |_, _| Ok(()))
}

/// Records written into one table file at most, in bytes of keys and values: what a
/// table writer holds until its file is finished (the file's index and filter) grows with
/// a file, not with the snapshot.
const TABLE_BYTES: usize = 64 << 20;

/// Writes the records of the snapshot file at `path` into table files in the folder
/// `staging` (made anew), in key order, and checks the snapshot's checksum: nothing in the
/// store changes, and nothing is kept when the file is corrupt or its keys are out of order.
/// Returns the table files.
pub fn stage(path: &Path, staging: &Path) -> Result<Vec<PathBuf>, MasterError> {
    stage_in_tables_of(path, staging, TABLE_BYTES)
}

fn stage_in_tables_of(
    path: &Path,
    staging: &Path,
    table_bytes: usize,
) -> Result<Vec<PathBuf>, MasterError> {
    let result = (|| {
        let _ = std::fs::remove_dir_all(staging);
        std::fs::create_dir_all(staging).map_err(|e| io_err("creating", staging, e))?;
        let opts = crate::state_options();
        let mut files = Vec::new();
        let mut writer: Option<(rocksdb::SstFileWriter, usize)> = None;
        // The last key, across table files too (a table checks only its own order).
        let mut last: Option<Vec<u8>> = None;
        load(path, |k, v| {
            match &mut last {
                Some(l) if l.as_slice() >= k => {
                    return Err(MasterError::corrupt(format!(
                        "snapshot {} cannot be installed: its keys are out of order",
                        path.display()
                    )))
                }
                Some(l) => {
                    l.clear();
                    l.extend_from_slice(k);
                }
                None => last = Some(k.to_vec()),
            }
            let (w, bytes) = match &mut writer {
                Some(w) => w,
                None => {
                    let file = staging.join(format!("{:06}.sst", files.len()));
                    let w = rocksdb::SstFileWriter::create(&opts);
                    w.open(&file)
                        .map_err(|e| io_err("creating the table file", &file, e))?;
                    files.push(file);
                    writer.insert((w, 0))
                }
            };
            w.put(k, v).map_err(|e| {
                MasterError::corrupt(format!(
                    "snapshot {} cannot be installed: {e}",
                    path.display()
                ))
            })?;
            *bytes += k.len() + v.len();
            if *bytes >= table_bytes {
                if let Some((mut w, _)) = writer.take() {
                    w.finish()?;
                }
            }
            Ok(())
        })?;
        if let Some((mut w, _)) = writer.take() {
            w.finish()?;
        }
        Ok(files)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(staging);
    }
    result
}

/// Replaces the whole `state` column family of `db` with the table files of [`stage`]
/// (moved into the store, not copied, and not written through its log). Not atomic: a
/// stop part-way leaves a state part old, part new, which the caller's mark
/// ([`RocksLogStorage::begin_install`]) makes the next open redo.
pub fn ingest(db: &DB, files: &[PathBuf]) -> Result<(), MasterError> {
    let cf = db
        .cf_handle(CF_STATE)
        .ok_or_else(|| MasterError::corrupt("column family 'state' is missing"))?;
    // Keys starting with 0xff..: none exist (all keys start with an ASCII letter). The
    // tables ingested after the range deletion take newer sequence numbers: they win.
    db.delete_range_cf(cf, [0u8].as_slice(), [0xffu8; 64].as_slice())?;
    if files.is_empty() {
        return Ok(());
    }
    let mut opts = rocksdb::IngestExternalFileOptions::default();
    opts.set_move_files(true);
    db.ingest_external_file_cf_opts(cf, &opts, files.to_vec())?;
    Ok(())
}

/// Installs the snapshot `meta` (its file in `dir`) as the state and the log's start: its
/// records are staged as table files (memory bounded whatever its size; a corrupt file
/// changes nothing), the install is marked in the log, the tables replace the state, and
/// one synced write ends the install and empties the log. A stop part-way is finished by
/// [`finish_install`] at the next open.
pub fn install(
    log: &RocksLogStorage,
    dir: &SnapshotDir,
    meta: &SnapshotMetadata,
) -> Result<(), MasterError> {
    let path = dir.path_for(meta.index, meta.term);
    let staging = dir.staging_path(meta.index);
    let files = stage(&path, &staging)?;
    let result = (|| {
        log.begin_install(meta)?;
        ingest(log.db(), &files)?;
        let mut batch = WriteBatch::default();
        log.install_snapshot_into(meta, &mut batch)?;
        let mut wo = rocksdb::WriteOptions::default();
        wo.set_sync(true);
        log.db().write_opt(batch, &wo)?;
        log.snapshot_installed(meta);
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&staging);
    result
}

/// Finishes the install of a snapshot that a stop interrupted (see [`install`]), before
/// anything reads the state. Returns the snapshot's index, if there was one.
pub fn finish_install(
    log: &RocksLogStorage,
    dir: &SnapshotDir,
) -> Result<Option<u64>, MasterError> {
    let Some(meta) = log.installing()? else {
        return Ok(None);
    };
    tracing::warn!(
        index = meta.index,
        "the install of a snapshot was interrupted: finishing it"
    );
    install(log, dir, &meta).map_err(|e| MasterError::Storage {
        message: format!(
            "the install of snapshot {} was interrupted and cannot be finished: {e}",
            meta.index
        ),
    })?;
    Ok(Some(meta.index))
}

fn load(
    path: &Path,
    mut each: impl FnMut(&[u8], &[u8]) -> Result<(), MasterError>,
) -> Result<(), MasterError> {
    let file = std::fs::File::open(path).map_err(|e| io_err("opening", path, e))?;
    let total = file
        .metadata()
        .map_err(|e| io_err("reading", path, e))?
        .len();
    if total < FOOTER_LEN {
        return Err(MasterError::corrupt(format!(
            "snapshot {} is truncated",
            path.display()
        )));
    }
    let body = total - FOOTER_LEN;
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut crc = 0u32;
    let mut read = 0u64;
    let mut count = 0u64;
    let bad = |what: &str| {
        MasterError::corrupt(format!("snapshot {} is corrupt: {what}", path.display()))
    };
    let mut key = Vec::new();
    let mut value = Vec::new();
    while read < body {
        for buf in [&mut key, &mut value] {
            let mut len = [0u8; 4];
            r.read_exact(&mut len).map_err(|_| bad("record header"))?;
            let n = u32::from_le_bytes(len) as u64;
            if read + 4 + n > body {
                return Err(bad("record runs past the end"));
            }
            buf.resize(n as usize, 0);
            r.read_exact(buf).map_err(|_| bad("record body"))?;
            crc = crc32c::crc32c_append(crc, &len);
            crc = crc32c::crc32c_append(crc, buf);
            read += 4 + n;
        }
        each(&key, &value)?;
        count += 1;
    }
    let mut footer = [0u8; FOOTER_LEN as usize];
    r.read_exact(&mut footer).map_err(|_| bad("footer"))?;
    if &footer[..8] != MAGIC {
        return Err(bad("bad magic"));
    }
    let want_count = u64::from_le_bytes(footer[8..16].try_into().unwrap_or_default());
    let want_crc = u32::from_le_bytes(footer[16..20].try_into().unwrap_or_default());
    if want_count != count || want_crc != crc {
        return Err(bad("checksum mismatch"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use raft::Storage;

    use super::*;
    use crate::state::tests::mkdir_at as mkdir;
    use crate::state::StateMachine;

    fn records(db: &DB) -> Vec<(Vec<u8>, Vec<u8>)> {
        let cf = db.cf_handle(CF_STATE).unwrap();
        db.iterator_cf(cf, rocksdb::IteratorMode::Start)
            .map(|r| {
                let (k, v) = r.unwrap();
                (k.to_vec(), v.to_vec())
            })
            .collect()
    }

    /// Asserts that two stores' records are the same, naming the first that differs.
    fn same(got: &[(Vec<u8>, Vec<u8>)], want: &[(Vec<u8>, Vec<u8>)]) {
        let first = got.iter().zip(want).position(|(g, w)| g != w);
        assert!(
            first.is_none() && got.len() == want.len(),
            "{} records, {} wanted; first difference at {first:?}: {:?} against {:?}",
            got.len(),
            want.len(),
            first.map(|i| &got[i]),
            first.map(|i| &want[i]),
        );
    }

    fn meta(index: u64, term: u64) -> SnapshotMetadata {
        let mut m = SnapshotMetadata {
            index,
            term,
            ..Default::default()
        };
        m.mut_conf_state().set_voters(vec![1, 2, 3]);
        m
    }

    #[test]
    fn an_install_stopped_part_way_is_finished_at_the_next_open_and_a_bad_file_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // The leader's state: enough folders for several small table files.
        let ldb = Arc::new(crate::open_db(&d.join("leader")).unwrap());
        let leader = StateMachine::open(ldb.clone()).unwrap();
        for i in 1..=300 {
            mkdir(&leader, i, &format!("/d{i:03}/sub"));
        }
        let snaps = SnapshotDir::open(d.join("snapshots")).unwrap();
        let m = meta(300, 2);
        checkpoint(&ldb, &snaps.checkpoint_path(300)).unwrap();
        write_from_checkpoint(
            &snaps.checkpoint_path(300),
            &snaps.temp_path(300, 2),
            &snaps.path_for(300, 2),
        )
        .unwrap();
        // What the file holds (the leader's records but those of the leader alone).
        let mut want = Vec::new();
        load(&snaps.path_for(300, 2), |k, v| {
            want.push((k.to_vec(), v.to_vec()));
            Ok(())
        })
        .unwrap();
        assert!(want.len() > 600, "{} records", want.len());

        // The follower: a state of its own and a log.
        let db = Arc::new(crate::open_db(&d.join("follower")).unwrap());
        let sm = StateMachine::open(db.clone()).unwrap();
        mkdir(&sm, 1, "/old");
        let log = super::super::storage::RocksLogStorage::open(db.clone(), &[1, 2, 3]).unwrap();
        let before = records(&db);

        // A corrupt file, and one whose keys are out of order under a good checksum: each is
        // refused before anything changes.
        let good = std::fs::read(snaps.path_for(300, 2)).unwrap();
        let mut bad = good.clone();
        bad[good.len() / 2] ^= 1;
        std::fs::write(snaps.path_for(400, 2), &bad).unwrap();
        let mut w = RecordWriter::create(&snaps.path_for(500, 2)).unwrap();
        w.push(b"b", b"1").unwrap();
        w.push(b"a", b"2").unwrap();
        w.finish().unwrap();
        // Out of order across table files too (each table checks only its own).
        let e = stage_in_tables_of(&snaps.path_for(500, 2), &snaps.staging_path(500), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("keys are out of order"), "{e}");
        assert!(!snaps.staging_path(500).exists());
        for (index, what) in [(400, "is corrupt"), (500, "keys are out of order")] {
            let e = install(&log, &snaps, &meta(index, 2))
                .unwrap_err()
                .to_string();
            assert!(e.contains(what), "{e}");
            same(&records(&db), &before);
            assert!(log.installing().unwrap().is_none());
            assert!(!snaps.staging_path(index).exists());
            assert_eq!(log.first_index().unwrap(), 1);
        }

        // Stopped after the mark, the range deletion and one table file of several.
        let staging = snaps.staging_path(300);
        let tables = stage_in_tables_of(&snaps.path_for(300, 2), &staging, 4096).unwrap();
        assert!(tables.len() > 3, "{} table files", tables.len());
        log.begin_install(&m).unwrap();
        ingest(&db, &tables[..1]).unwrap();
        assert_ne!(records(&db), want);
        drop((sm, log, db));

        let db = Arc::new(crate::open_db(&d.join("follower")).unwrap());
        let log = super::super::storage::RocksLogStorage::open(db.clone(), &[1]).unwrap();
        let snaps = SnapshotDir::open(d.join("snapshots")).unwrap();
        assert!(!staging.exists(), "the staged tables are left over");
        assert_eq!(finish_install(&log, &snaps).unwrap(), Some(300));
        same(&records(&db), &want);
        assert!(log.installing().unwrap().is_none());
        assert_eq!(log.first_index().unwrap(), 301);
        assert_eq!(log.last_index().unwrap(), 300);
        assert_eq!(
            log.initial_state().unwrap().conf_state.get_voters(),
            [1, 2, 3]
        );
        let sm = StateMachine::open(db.clone()).unwrap();
        assert!(sm.resolve_loaded("/old").unwrap().is_none());
        assert!(sm.resolve_loaded("/d123/sub").unwrap().is_some());
        // Nothing left to finish at the next open.
        assert_eq!(finish_install(&log, &snaps).unwrap(), None);
    }
}
