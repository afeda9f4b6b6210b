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
//! transport streams them to followers that need them, which verify and install them in one
//! atomic RocksDB write.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use rocksdb::{WriteBatch, DB};

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
        let file = std::fs::File::create(tmp).map_err(|e| io_err("creating", tmp, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        let mut crc = 0u32;
        let mut count = 0u64;
        // A group that may hold masters of a release before format 1 gets what they read.
        let json = crate::state::format::snapshot_in_json(&db, cf)?;
        let mut it = db.raw_iterator_cf(cf);
        it.seek_to_first();
        while it.valid() {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            let Some(v) = crate::state::format::snapshot_value(k, v, json)? else {
                it.next();
                continue;
            };
            for part in [k, &*v] {
                let len = (part.len() as u32).to_le_bytes();
                crc = crc32c::crc32c_append(crc, &len);
                crc = crc32c::crc32c_append(crc, part);
                w.write_all(&len).map_err(|e| io_err("writing", tmp, e))?;
                w.write_all(part).map_err(|e| io_err("writing", tmp, e))?;
            }
            count += 1;
            it.next();
        }
        it.status()?;
        w.write_all(MAGIC).map_err(|e| io_err("writing", tmp, e))?;
        w.write_all(&count.to_le_bytes())
            .map_err(|e| io_err("writing", tmp, e))?;
        w.write_all(&crc.to_le_bytes())
            .map_err(|e| io_err("writing", tmp, e))?;
        let file = w
            .into_inner()
            .map_err(|e| io_err("writing", tmp, e.error()))?;
        file.sync_all().map_err(|e| io_err("syncing", tmp, e))?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        drop(file);
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

/// Adds the records of the snapshot file at `path` to `batch`, replacing the whole `state`
/// column family. Verifies the checksum before anything is written.
pub fn load_into(db: &DB, path: &Path, batch: &mut WriteBatch) -> Result<(), MasterError> {
    let cf = db
        .cf_handle(CF_STATE)
        .ok_or_else(|| MasterError::corrupt("column family 'state' is missing"))?;
    verify(path)?;
    batch.delete_range_cf(cf, [0u8].as_slice(), [0xffu8; 64].as_slice());
    // Keys starting with 0xff..: none exist (all keys start with an ASCII letter).
    load(path, |k, v| {
        batch.put_cf(cf, k, v);
        Ok(())
    })
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
