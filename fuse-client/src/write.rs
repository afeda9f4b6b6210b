//! The write side of the mount: files opened for writing, and the namespace changes
//! (mkdir, unlink, rmdir, rename) — each one request to the master, which changes the
//! under-store first.
//!
//! A write handle streams its bytes in order to workers ([`granary_client::FileWriter`]);
//! `flush` (every `close`) commits the file and returns the outcome of the mode
//! (cache-through: after the under-store has it). Only sequential writes from offset 0
//! work; anything else is `EOPNOTSUPP` and the file is not committed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fuser::Errno;
use granary_client::write::Held;
use granary_client::{ClientError, FileSystem, FileWriter, WriteMode};
use granary_proto as pb;

use crate::error::errno;

/// One open handle of a file being written.
pub struct WriteHandle {
    pub inode: u64,
    writer: Option<FileWriter>,
    /// Its place among the files this mount writes at once, until committed.
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The outcome of the commit, once flushed.
    done: Option<Result<(), Errno>>,
    /// Bytes written so far (what getattr reports while the file is open).
    pub size: Arc<AtomicU64>,
}

pub type Handles = Arc<Mutex<HashMap<u64, Arc<tokio::sync::Mutex<WriteHandle>>>>>;
/// Inode → bytes written so far, for files open for writing on this mount.
pub type Sizes = Arc<Mutex<HashMap<u64, Arc<AtomicU64>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The share of the mount's memory budget (`--max-memory`) that writes may use: bytes
/// waiting in a write's queues hold units of the budget (at most a quarter of it: prefetch
/// holds at most half, so reads always have the rest) until the worker's stream takes
/// them; and as each file open for writing may also hold about two writes' worth in the
/// streams below the queues, at most a quarter of the budget divided by that many files
/// are written at once (`ENFILE` past it).
#[derive(Clone)]
pub struct WriteMemory {
    /// The mount's whole budget (shared with reads), in units.
    pub budget: Arc<tokio::sync::Semaphore>,
    /// A quarter of it: what writes may hold at once.
    pub cap: Arc<tokio::sync::Semaphore>,
    /// Files written at once.
    pub slots: Arc<tokio::sync::Semaphore>,
    pub slots_total: usize,
    /// Bytes per unit.
    pub unit: u64,
    /// Units in `cap`.
    share: u64,
}

impl WriteMemory {
    /// Budget `units` units of `unit` bytes; `per_file` bytes held by a file being written
    /// outside its queues.
    pub fn new(budget: Arc<tokio::sync::Semaphore>, units: u64, unit: u64, per_file: u64) -> Self {
        let share = (units / 4).clamp(1, u64::from(u32::MAX >> 3));
        let slots = ((share * unit) / per_file.max(1)).clamp(1, 1 << 20) as usize;
        Self {
            budget,
            cap: Arc::new(tokio::sync::Semaphore::new(share as usize)),
            slots: Arc::new(tokio::sync::Semaphore::new(slots)),
            slots_total: slots,
            unit,
            share,
        }
    }

    /// Room for `n` bytes queued for the workers: waits for the writes' share, then for the
    /// budget (always in that order, so writers never wait on each other in a circle).
    async fn room(&self, n: usize) -> Result<Held, ClientError> {
        // A write larger than the writes' share takes all of it.
        let units = (n as u64).div_ceil(self.unit).clamp(1, self.share);
        let units = u32::try_from(units).unwrap_or(u32::MAX);
        let closed = |e: tokio::sync::AcquireError| ClientError::internal(e.to_string());
        let cap = self
            .cap
            .clone()
            .acquire_many_owned(units)
            .await
            .map_err(closed)?;
        let budget = self
            .budget
            .clone()
            .acquire_many_owned(units)
            .await
            .map_err(closed)?;
        Ok(Arc::new((cap, budget)))
    }
}

/// What every write operation of the mount needs.
#[derive(Clone)]
pub struct Writes {
    pub client: Arc<FileSystem>,
    pub handles: Handles,
    pub sizes: Sizes,
    /// The mode for every write of this mount (None: each mount's `write_mode` option).
    pub mode: Option<WriteMode>,
    pub replicas: usize,
    pub op_timeout: Duration,
    /// Mount id → its `write_mode` option (looked up once).
    mount_modes: Arc<Mutex<HashMap<u64, WriteMode>>>,
    pub memory: WriteMemory,
}

impl Writes {
    /// The writes of a mount with `config`, drawing on its memory `budget` (a semaphore of
    /// 4 KiB units, all of them free now).
    pub fn for_mount(
        client: Arc<FileSystem>,
        config: &crate::FuseConfig,
        budget: Arc<tokio::sync::Semaphore>,
    ) -> Self {
        let replicas = config.async_replicas.max(1);
        let units = budget.available_permits() as u64;
        let per_file = 2 * u64::from(crate::fs::MAX_IO) * replicas as u64;
        let memory = WriteMemory::new(budget, units, crate::fs::BUDGET_UNIT, per_file);
        Self::new(
            client,
            config.write_mode,
            replicas,
            config.op_timeout,
            memory,
        )
    }

    pub fn new(
        client: Arc<FileSystem>,
        mode: Option<WriteMode>,
        replicas: usize,
        op_timeout: Duration,
        memory: WriteMemory,
    ) -> Self {
        Self {
            memory,
            client,
            handles: Arc::new(Mutex::new(HashMap::new())),
            sizes: Arc::new(Mutex::new(HashMap::new())),
            mode,
            replicas,
            op_timeout,
            mount_modes: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// The write mode for a file of `mount_id`.
    async fn mode_for(&self, mount_id: Option<u64>) -> WriteMode {
        if let Some(m) = self.mode {
            return m;
        }
        let Some(id) = mount_id else {
            return WriteMode::MustCache;
        };
        if let Some(m) = lock(&self.mount_modes).get(&id) {
            return *m;
        }
        let mode = match self.client.master.list_mounts().await {
            Ok(mounts) => mounts
                .iter()
                .find(|m| m.mount_id == id)
                .and_then(|m| m.options.iter().find(|o| o.key == "write_mode"))
                .and_then(|o| o.value.parse().ok())
                .unwrap_or_default(),
            Err(_) => return WriteMode::default(),
        };
        lock(&self.mount_modes).insert(id, mode);
        mode
    }

    /// The path of `name` in directory `parent`.
    pub async fn child_path(&self, parent: u64, name: &str) -> Result<String, ClientError> {
        let dir = self.client.stat_inode(parent).await?;
        if dir.kind != pb::FileKind::Directory as i32 {
            return Err(ClientError::posix(
                libc::ENOTDIR,
                format!("{} is not a directory", dir.path),
            ));
        }
        Ok(granary_common::paths::join(&dir.path, name))
    }

    /// Opens `path` for writing (a new file, or `overwrite` an existing one); registers
    /// handle `fh`.
    pub async fn open(
        &self,
        fh: u64,
        path: &str,
        perm: u32,
        overwrite: bool,
        mount_id: Option<u64>,
    ) -> Result<pb::FileStatus, ClientError> {
        // Before anything changes: a file replaced by an open refused here keeps its bytes.
        let slot = self.memory.slots.clone().try_acquire_owned().map_err(|_| {
            ClientError::posix(
                libc::ENFILE,
                format!(
                    "{path}: this mount already writes {} files at once, the most its \
                     --max-memory allows; close one first",
                    self.memory.slots_total
                ),
            )
        })?;
        let mode = self.mode_for(mount_id).await;
        let w = self
            .client
            .create_writer(path, perm, overwrite, mode, self.replicas)
            .await?;
        let status = w.status.clone();
        let size = Arc::new(AtomicU64::new(0));
        lock(&self.sizes).insert(status.inode, size.clone());
        lock(&self.handles).insert(
            fh,
            Arc::new(tokio::sync::Mutex::new(WriteHandle {
                inode: status.inode,
                writer: Some(w),
                slot: Some(slot),
                done: None,
                size,
            })),
        );
        Ok(status)
    }

    pub fn handle(&self, fh: u64) -> Option<Arc<tokio::sync::Mutex<WriteHandle>>> {
        lock(&self.handles).get(&fh).cloned()
    }

    /// Files open for writing through this mount, or still being completed after their
    /// last close.
    pub fn open_count(&self) -> usize {
        lock(&self.handles).len().max(lock(&self.sizes).len())
    }

    /// Bytes written so far to `inode` through an open handle of this mount.
    pub fn size_of(&self, inode: u64) -> Option<u64> {
        lock(&self.sizes)
            .get(&inode)
            .map(|s| s.load(Ordering::Relaxed))
    }

    pub async fn write(
        &self,
        h: &tokio::sync::Mutex<WriteHandle>,
        offset: u64,
        data: bytes::Bytes,
    ) -> Result<u32, Errno> {
        let mut h = h.lock().await;
        let (n, inode) = (data.len() as u32, h.inode);
        let Some(w) = h.writer.as_mut() else {
            return Err(Errno::EBADF);
        };
        // Waiting for room sends nothing: a write that times out there fails alone.
        let until = tokio::time::Instant::now() + self.op_timeout;
        let held = match tokio::time::timeout_at(until, self.memory.room(data.len())).await {
            Ok(Ok(held)) => held,
            Ok(Err(e)) => return Err(errno(&e)),
            Err(_) => {
                tracing::warn!(
                    inode,
                    offset,
                    "a write found no room in --max-memory in time"
                );
                return Err(Errno::EIO);
            }
        };
        let r = tokio::time::timeout_at(until, w.write_held(offset, data, Some(held))).await;
        match r {
            Ok(Ok(())) => {
                let written = w.written();
                h.size.store(written, Ordering::Relaxed);
                Ok(n)
            }
            Ok(Err(e)) => {
                tracing::warn!(inode, offset, error = %e, "write failed");
                w.fail(e.clone());
                Err(errno(&e))
            }
            Err(_) => {
                // Its bytes may have reached some workers and not others: the file is given
                // up at close (a retried write would land twice on some).
                tracing::warn!(inode, offset, "write did not finish in time");
                w.fail(ClientError::timeout(
                    "a write did not finish in time".to_string(),
                ));
                Err(Errno::EIO)
            }
        }
    }

    pub async fn fsync(&self, h: &tokio::sync::Mutex<WriteHandle>) -> Result<(), Errno> {
        let mut h = h.lock().await;
        let inode = h.inode;
        let Some(w) = h.writer.as_mut() else {
            return h.done.unwrap_or(Ok(()));
        };
        match tokio::time::timeout(self.op_timeout, w.sync()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                tracing::warn!(inode, error = %e, "fsync failed");
                Err(errno(&e))
            }
            Err(_) => Err(Errno::EIO),
        }
    }

    /// A flush (every `close()` of a descriptor of the handle): commits the file once it
    /// has bytes. Before the first write it does nothing — shells and `dd` duplicate the
    /// descriptor and close the original before writing; an empty file is committed at
    /// release.
    pub async fn flush(&self, h: &tokio::sync::Mutex<WriteHandle>) -> Result<(), Errno> {
        {
            let g = h.lock().await;
            if g.done.is_none() && g.writer.as_ref().is_some_and(|w| w.written() == 0) {
                return Ok(());
            }
        }
        self.commit(h).await
    }

    /// Commits the file; later calls repeat the outcome.
    pub async fn commit(&self, h: &tokio::sync::Mutex<WriteHandle>) -> Result<(), Errno> {
        let mut h = h.lock().await;
        if let Some(done) = h.done {
            return done;
        }
        let Some(w) = h.writer.take() else {
            return Ok(());
        };
        // Every byte is queued or sent by now: the file's place among those written at once
        // goes to the next (a cache-through close may wait minutes for its upload).
        h.slot = None;
        let (path, written, mode) = (w.status.path.clone(), w.written(), w.mode());
        let limit = w.close_deadline(self.op_timeout);
        let out = match tokio::time::timeout(limit, w.close()).await {
            Ok(Ok(s)) => {
                tracing::debug!(%path, bytes = s.length, mode = mode.name(), "file written");
                Ok(())
            }
            Ok(Err(e)) => {
                tracing::error!(%path, bytes = written, mode = mode.name(), error = %e, "committing a written file failed");
                Err(errno(&e))
            }
            Err(_) => {
                tracing::error!(%path, bytes = written, ?limit, "committing a written file did not finish in time");
                Err(Errno::EIO)
            }
        };
        h.done = Some(out);
        lock(&self.sizes).remove(&h.inode);
        out
    }

    /// The handle is closed: commits it if no flush did (the kernel flushes on every
    /// close, so this is for abnormal ends), and forgets it.
    pub fn release(&self, fh: u64, rt: &tokio::runtime::Handle) {
        let Some(h) = lock(&self.handles).remove(&fh) else {
            return;
        };
        let me = self.clone();
        rt.spawn(async move {
            let _ = me.commit(&h).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[tokio::test]
    async fn queued_write_bytes_hold_the_budget_until_taken() {
        // 100 units of 4 KiB: writes may hold 25; a file costs 50 KiB outside the queues.
        let budget = Arc::new(tokio::sync::Semaphore::new(100));
        let m = WriteMemory::new(budget.clone(), 100, 4096, 50 << 10);
        assert_eq!(m.slots_total, 2);
        let a = m.room(8192).now_or_never().unwrap().unwrap();
        assert_eq!(
            (m.cap.available_permits(), budget.available_permits()),
            (23, 98)
        );
        // A write larger than the writes' share waits for all of it, then takes it all.
        let big = m.room(1 << 20);
        futures::pin_mut!(big);
        assert!(big.as_mut().now_or_never().is_none());
        drop(a);
        let b = big.now_or_never().unwrap().unwrap();
        assert_eq!(
            (m.cap.available_permits(), budget.available_permits()),
            (0, 75)
        );
        // Reads keep the rest.
        drop(b);
        assert_eq!(
            (m.cap.available_permits(), budget.available_permits()),
            (25, 100)
        );
    }
}
