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
use granary_client::{ClientError, FileSystem, FileWriter, WriteMode};
use granary_proto as pb;

use crate::error::errno;

/// One open handle of a file being written.
pub struct WriteHandle {
    pub inode: u64,
    writer: Option<FileWriter>,
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
}

impl Writes {
    pub fn new(
        client: Arc<FileSystem>,
        mode: Option<WriteMode>,
        replicas: usize,
        op_timeout: Duration,
    ) -> Self {
        Self {
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
        let n = data.len() as u32;
        let Some(w) = h.writer.as_mut() else {
            return Err(Errno::EBADF);
        };
        let r = tokio::time::timeout(self.op_timeout, w.write(offset, data)).await;
        match r {
            Ok(Ok(())) => {
                let written = w.written();
                h.size.store(written, Ordering::Relaxed);
                Ok(n)
            }
            Ok(Err(e)) => {
                tracing::warn!(inode = h.inode, offset, error = %e, "write failed");
                Err(errno(&e))
            }
            Err(_) => {
                tracing::warn!(inode = h.inode, offset, "write did not finish in time");
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
