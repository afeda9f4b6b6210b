//! Writing files: create at the master, stream the bytes in order to workers (this node's
//! first), complete at the master once the workers answer for the mode.
//!
//! - `cache-through` (default): close returns after the under-store has the object.
//! - `async-through`: close returns once the file is journaled and cached (pinned) on
//!   `replicas` workers; the first uploads it in the background (resumed after restarts),
//!   the others keep their copy until the master records it persisted.
//! - `must-cache`: cached only, not durable. `through`: the under-store only.
//!
//! Only sequential writes from offset 0 are possible (objects are written whole): a write
//! at another offset fails, and nothing is committed.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use granary_proto as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::ClientError;
use crate::fs::FileSystem;
use crate::placement::order_workers;

/// Messages queued per worker stream (each at most one FUSE write, ≤ 1 MiB).
const QUEUE: usize = 8;
/// Slowest upload rate a close waits for before giving up (on top of the op deadline).
const MIN_UPLOAD_RATE: u64 = 8 * 1024 * 1024;

/// A mount's write mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteMode {
    #[default]
    CacheThrough,
    AsyncThrough,
    MustCache,
    Through,
}

impl WriteMode {
    pub fn to_proto(self) -> pb::WriteMode {
        match self {
            Self::CacheThrough => pb::WriteMode::CacheThrough,
            Self::AsyncThrough => pb::WriteMode::AsyncThrough,
            Self::MustCache => pb::WriteMode::MustCache,
            Self::Through => pb::WriteMode::Through,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::CacheThrough => "cache-through",
            Self::AsyncThrough => "async-through",
            Self::MustCache => "must-cache",
            Self::Through => "through",
        }
    }
}

impl FromStr for WriteMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "cache-through" => Ok(Self::CacheThrough),
            "async-through" => Ok(Self::AsyncThrough),
            "must-cache" => Ok(Self::MustCache),
            "through" => Ok(Self::Through),
            _ => Err(format!(
                "unknown write mode {s:?}: expected cache-through, async-through, must-cache or through"
            )),
        }
    }
}

/// What a caller holds while a message's bytes wait in a sink's queue (a share of a memory
/// budget): dropped when the stream takes the message from the queue.
pub type Held = Arc<dyn std::any::Any + Send + Sync>;

/// A sink's queue as its stream takes from it: what was held for a message is let go as
/// the message is taken.
struct Unheld(ReceiverStream<(pb::WriteFileRequest, Option<Held>)>);

impl futures::Stream for Unheld {
    type Item = pb::WriteFileRequest;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.0)
            .poll_next(cx)
            .map(|m| m.map(|(msg, _held)| msg))
    }
}

/// One worker receiving the file.
struct Sink {
    worker: pb::WorkerInfo,
    tx: Option<mpsc::Sender<(pb::WriteFileRequest, Option<Held>)>>,
    rx: tonic::Streaming<pb::WriteFileResponse>,
}

impl Sink {
    /// The worker's error after its stream broke.
    async fn failure(&mut self) -> ClientError {
        match self.rx.message().await {
            Err(s) => ClientError::from_status(s),
            _ => ClientError::unavailable(format!(
                "worker {} closed the write stream",
                self.worker.address
            )),
        }
    }

    async fn send(&mut self, msg: pb::WriteFileRequest) -> Result<(), ClientError> {
        self.send_held(msg, None).await
    }

    async fn send_held(
        &mut self,
        msg: pb::WriteFileRequest,
        held: Option<Held>,
    ) -> Result<(), ClientError> {
        let Some(tx) = &self.tx else {
            return Err(ClientError::internal("the file is already closed"));
        };
        if tx.send((msg, held)).await.is_err() {
            return Err(self.failure().await);
        }
        Ok(())
    }

    /// Waits for an answer with `done` (or `synced >= upto` when not finishing).
    async fn answer(
        &mut self,
        upto: u64,
        done: bool,
    ) -> Result<pb::WriteFileResponse, ClientError> {
        loop {
            match self.rx.message().await {
                Ok(Some(r)) if r.done || (!done && r.synced >= upto) => return Ok(r),
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Err(ClientError::unavailable(format!(
                        "worker {} ended the write without an answer",
                        self.worker.address
                    )))
                }
                Err(s) => return Err(ClientError::from_status(s)),
            }
        }
    }
}

/// A file being written. Call [`FileWriter::close`] to commit it; dropping it abandons the
/// write (the file stays incomplete; the workers, whose streams end without the finish
/// `close` sends, neither cache nor upload what they received and remove its journal).
pub struct FileWriter {
    fs: Arc<FileSystem>,
    pub status: pb::FileStatus,
    mode: WriteMode,
    sinks: Vec<Sink>,
    written: u64,
    failed: Option<ClientError>,
}

impl FileSystem {
    /// Creates (or, with `overwrite`, replaces) the file at `path` and opens it for a
    /// sequential write in `mode`; `replicas` workers hold an async-through file.
    pub async fn create_writer(
        self: &Arc<Self>,
        path: &str,
        mode_bits: u32,
        overwrite: bool,
        mode: WriteMode,
        replicas: usize,
    ) -> Result<FileWriter, ClientError> {
        let status = self.master.create_file(path, mode_bits, overwrite).await?;
        let mode = if status.ufs.is_none() {
            // Outside any mount there is nowhere to persist to.
            WriteMode::MustCache
        } else {
            mode
        };
        let copies = if mode == WriteMode::AsyncThrough {
            replicas.max(1)
        } else {
            1
        };
        let workers = self.writer_workers(&status, copies).await?;
        let mut sinks = Vec::with_capacity(workers.len());
        for (i, w) in workers.into_iter().enumerate() {
            let header = pb::WriteFileHeader {
                inode: status.inode,
                version: status.version,
                block_size: status.block_size,
                ufs: status.ufs.clone(),
                mode: mode.to_proto() as i32,
                persist: i == 0,
                grant: status.grant.clone(),
                finishes: true,
            };
            let (tx, rx) = mpsc::channel(QUEUE);
            tx.send((
                pb::WriteFileRequest {
                    header: Some(header),
                    ..Default::default()
                },
                None,
            ))
            .await
            .map_err(|_| ClientError::internal("write queue closed"))?;
            let mut client = self.worker_client(&w.address)?;
            let rx = client
                .write_file(Unheld(ReceiverStream::new(rx)))
                .await
                .map_err(ClientError::from_status)?
                .into_inner();
            sinks.push(Sink {
                worker: w,
                tx: Some(tx),
                rx,
            });
        }
        Ok(FileWriter {
            fs: self.clone(),
            status,
            mode,
            sinks,
            written: 0,
            failed: None,
        })
    }

    /// The workers that receive a new file: this node's worker first, then the owners of
    /// its first block.
    async fn writer_workers(
        &self,
        status: &pb::FileStatus,
        n: usize,
    ) -> Result<Vec<pb::WorkerInfo>, ClientError> {
        let block = pb::BlockId {
            inode: status.inode,
            version: status.version,
            index: 0,
        };
        let mut ws = order_workers(&block, &self.live_workers().await);
        if let Some(i) = ws.iter().position(|w| self.short_circuit.applies_to(w)) {
            let local = ws.remove(i);
            ws.insert(0, local);
        }
        if ws.is_empty() {
            return Err(ClientError::unavailable(
                "no live worker to write the file to",
            ));
        }
        if ws.len() < n {
            return Err(ClientError::unavailable(format!(
                "async-through needs {n} workers for the file's copies; {} are live",
                ws.len()
            )));
        }
        ws.truncate(n);
        Ok(ws)
    }
}

impl FileWriter {
    pub fn written(&self) -> u64 {
        self.written
    }

    pub fn mode(&self) -> WriteMode {
        self.mode
    }

    /// Marks the write failed (a write that did not finish in time may have reached some
    /// workers and not others): later writes fail, `close` gives the file up.
    pub fn fail(&mut self, e: ClientError) {
        self.failed.get_or_insert(e);
    }

    /// Appends `data` at `offset`, which must be where the file ends now.
    pub async fn write(&mut self, offset: u64, data: Bytes) -> Result<(), ClientError> {
        self.write_held(offset, data, None).await
    }

    /// [`FileWriter::write`], `held` kept until every worker's stream has taken the bytes
    /// from its queue (a caller's share of a memory budget for them).
    pub async fn write_held(
        &mut self,
        offset: u64,
        data: Bytes,
        held: Option<Held>,
    ) -> Result<(), ClientError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if offset != self.written {
            let e = ClientError::posix(
                95, // EOPNOTSUPP
                format!(
                    "{}: only sequential writes are supported (write at {offset}, the file ends at {})",
                    self.status.path, self.written
                ),
            );
            self.failed = Some(e.clone());
            return Err(e);
        }
        for s in &mut self.sinks {
            let r = s
                .send_held(
                    pb::WriteFileRequest {
                        data: data.clone(),
                        ..Default::default()
                    },
                    held.clone(),
                )
                .await;
            if let Err(e) = r {
                self.failed = Some(e.clone());
                return Err(e);
            }
        }
        self.written += data.len() as u64;
        Ok(())
    }

    /// Waits until every byte written so far is on the workers' disks.
    pub async fn sync(&mut self) -> Result<(), ClientError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let upto = self.written;
        for s in &mut self.sinks {
            let r = async {
                s.send(pb::WriteFileRequest {
                    sync: true,
                    ..Default::default()
                })
                .await?;
                s.answer(upto, false).await
            }
            .await;
            if let Err(e) = r {
                self.failed = Some(e.clone());
                return Err(e);
            }
        }
        Ok(())
    }

    /// How long a close may take: the op deadline plus an upload at a slow rate.
    pub fn close_deadline(&self, op: Duration) -> Duration {
        match self.mode {
            WriteMode::CacheThrough | WriteMode::Through => {
                op + Duration::from_secs(self.written / MIN_UPLOAD_RATE)
            }
            _ => op,
        }
    }

    /// Gives the write up: the workers drop what they received and the unfinished entry
    /// is removed (a replaced file's old object stays in the under-store).
    pub async fn abort(mut self) {
        for s in &mut self.sinks {
            if let Some(tx) = s.tx.take() {
                let _ = tx
                    .send((
                        pb::WriteFileRequest {
                            abort: true,
                            ..Default::default()
                        },
                        None,
                    ))
                    .await;
            }
        }
        self.fs.forget_status(self.status.inode);
        if let Err(e) = self.fs.master.delete(&self.status.path, false).await {
            tracing::warn!(path = %self.status.path, error = %e, "cannot remove an abandoned file");
        }
    }

    /// Finishes the file: the workers answer per the mode, then the master records it. A
    /// write that failed before is given up instead (the error is returned again).
    pub async fn close(mut self) -> Result<pb::FileStatus, ClientError> {
        if let Some(e) = self.failed.take() {
            self.abort().await;
            return Err(e);
        }
        let mut answers = Vec::with_capacity(self.sinks.len());
        for i in 0..self.sinks.len() {
            let finish = pb::WriteFileRequest {
                finish: true,
                length: self.written,
                ..Default::default()
            };
            if let Err(e) = self.sinks[i].send(finish).await {
                // The workers told to finish before it are told to give up too (nothing
                // may follow a finish: they refuse the file).
                self.abort().await;
                return Err(e);
            }
        }
        for s in &mut self.sinks {
            s.tx = None; // ends the stream after the finish: the worker finishes the file
        }
        for s in &mut self.sinks {
            answers.push(s.answer(self.written, true).await?);
        }
        if let Some(a) = answers.iter().find(|a| a.synced != self.written) {
            // A worker holds another length than was written: the file is not committed.
            let e = ClientError::internal(format!(
                "{}: a worker finished the file with {} bytes, {} were written",
                self.status.path, a.synced, self.written
            ));
            self.abort().await;
            return Err(e);
        }
        let first = &answers[0];
        let primary = self.sinks[0].worker.worker_id;
        let (persist, fingerprint, worker) = match self.mode {
            _ if first.persisted => (pb::PersistState::Persisted, first.fingerprint.clone(), 0),
            WriteMode::AsyncThrough => (pb::PersistState::Pending, None, primary),
            WriteMode::MustCache => (pb::PersistState::NotPersisted, None, primary),
            _ => return Err(ClientError::internal("the worker did not upload the file")),
        };
        self.fs.forget_status(self.status.inode);
        let since = self.fs.meta.watch.since();
        let done = self
            .fs
            .master
            .complete_file(pb::CompleteFileRequest {
                inode: self.status.inode,
                length: self.written,
                fingerprint,
                request_id: 0,
                version: self.status.version,
                persist_state: persist as i32,
                persist_worker: worker,
            })
            .await?;
        self.fs.remember(&done, since);
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::WriteMode;

    #[test]
    fn write_modes_parse_in_both_spellings() {
        assert_eq!("cache-through".parse(), Ok(WriteMode::CacheThrough));
        assert_eq!("ASYNC_THROUGH".parse(), Ok(WriteMode::AsyncThrough));
        assert_eq!("must-cache".parse(), Ok(WriteMode::MustCache));
        assert_eq!("through".parse(), Ok(WriteMode::Through));
        assert!("write-back".parse::<WriteMode>().is_err());
    }
}
