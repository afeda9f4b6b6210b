//! Carrying Raft messages between masters over gRPC (`granary.v1.RaftService`).
//!
//! Each peer gets one sender task fed by a bounded queue: messages are batched, encoded as
//! raft-rs protobuf bytes and sent in order on one long-lived `SendStream` call (a peer of
//! an older release that does not know it gets a `Send` call per batch). A batch that
//! cannot be sent, or a stream that breaks, reports the peer unreachable to Raft (which
//! then probes instead of streaming); what was lost Raft sends again.
//! `MsgSnapshot` is special: the snapshot file it names is streamed in 1 MiB chunks by a
//! separate task, and the outcome is reported back with `report_snapshot`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use granary_common::net::GrpcChannel as Channel;
use granary_proto as pb;
use granary_proto::raft_service_client::RaftServiceClient;
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};

use super::snapshot::SnapshotDir;

/// Member id → address, shared by the transport, the node and the service (leader hints).
pub type Peers = Arc<RwLock<BTreeMap<u64, String>>>;

pub fn peer_address(peers: &Peers, id: u64) -> Option<String> {
    match peers.read() {
        Ok(g) => g.get(&id).cloned(),
        Err(p) => p.into_inner().get(&id).cloned(),
    }
}

/// What the transport tells the Raft node about deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feedback {
    Unreachable(u64),
    Snapshot { to: u64, ok: bool },
}

pub type FeedbackFn = Arc<dyn Fn(Feedback) + Send + Sync>;

/// How the Raft node sends messages. Implementations must not block.
pub trait Transport: Send + 'static {
    fn send(&mut self, msgs: Vec<Message>);
    /// A member's address changed or became known.
    fn set_address(&mut self, id: u64, addr: &str);
}

const QUEUE: usize = 4096;
const BATCH: usize = 256;
const SEND_TIMEOUT: Duration = Duration::from_secs(3);
/// Batches waiting on a peer's stream at most: beyond it the peer is not keeping up, and
/// the batch is dropped as a failed send would be.
const STREAM_QUEUE: usize = 64;
/// How long a peer that refused `SendStream` gets a call per batch before a stream is
/// tried again (it may have been upgraded meanwhile).
const STREAM_RETRY: Duration = Duration::from_secs(60);
const SNAPSHOT_CHUNK: usize = 1 << 20;

pub struct GrpcTransport {
    self_id: u64,
    rt: tokio::runtime::Handle,
    peers: Peers,
    queues: HashMap<u64, tokio::sync::mpsc::Sender<Message>>,
    feedback: FeedbackFn,
    snapshots: SnapshotDir,
    net: granary_common::net::Net,
}

impl GrpcTransport {
    pub fn new(
        self_id: u64,
        rt: tokio::runtime::Handle,
        peers: Peers,
        feedback: FeedbackFn,
        snapshots: SnapshotDir,
        net: granary_common::net::Net,
    ) -> Self {
        Self {
            net,
            self_id,
            rt,
            peers,
            queues: HashMap::new(),
            feedback,
            snapshots,
        }
    }

    fn queue(&mut self, to: u64) -> Option<&tokio::sync::mpsc::Sender<Message>> {
        if !self.queues.contains_key(&to) {
            let addr = peer_address(&self.peers, to)?;
            // Channels need the runtime's reactor; this runs on the Raft thread.
            let _rt = self.rt.enter();
            let client = match self
                .net
                .channel(&addr, granary_common::net::ServerKind::Master)
            {
                Ok(ch) => RaftServiceClient::new(ch)
                    .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(pb::MAX_MESSAGE_BYTES),
                Err(e) => {
                    tracing::error!(peer = to, %addr, error = %e, "invalid master address");
                    return None;
                }
            };
            let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
            let sender = PeerSender {
                from: self.self_id,
                to,
                client,
                feedback: self.feedback.clone(),
                snapshots: self.snapshots.clone(),
                snapshot_busy: Arc::default(),
            };
            self.rt.spawn(sender.run(rx));
            self.queues.insert(to, tx);
        }
        self.queues.get(&to)
    }
}

impl Transport for GrpcTransport {
    fn send(&mut self, msgs: Vec<Message>) {
        for m in msgs {
            let to = m.to;
            let feedback = self.feedback.clone();
            // A dropped snapshot must be reported as such: raft-rs keeps a peer in snapshot
            // state (sending nothing else) until `report_snapshot`.
            let dropped = if m.get_msg_type() == MessageType::MsgSnapshot {
                Feedback::Snapshot { to, ok: false }
            } else {
                Feedback::Unreachable(to)
            };
            match self.queue(to) {
                Some(q) => {
                    if q.try_send(m).is_err() {
                        feedback(dropped);
                    }
                }
                None => {
                    tracing::debug!(peer = to, "no address for raft peer; message dropped");
                    feedback(dropped);
                }
            }
        }
    }

    fn set_address(&mut self, id: u64, addr: &str) {
        if let Ok(mut g) = self.peers.write() {
            if g.get(&id).map(String::as_str) != Some(addr) {
                g.insert(id, addr.to_string());
                // Dropping the queue ends the old sender task; the next send starts a new one.
                self.queues.remove(&id);
            }
        }
    }
}

struct PeerSender {
    from: u64,
    to: u64,
    client: RaftServiceClient<Channel>,
    feedback: FeedbackFn,
    snapshots: SnapshotDir,
    snapshot_busy: Arc<std::sync::atomic::AtomicBool>,
}

/// A peer's open `SendStream` call: batches go into `tx`; `call` ends with the call.
struct OpenStream {
    tx: tokio::sync::mpsc::Sender<pb::RaftBatch>,
    call: tokio::task::JoinHandle<Result<(), tonic::Status>>,
}

/// What became of a batch handed to a peer's stream.
enum Streamed {
    Sent,
    /// Not sent (the peer was reported unreachable).
    Dropped,
    /// The peer refused `SendStream` (a release before it): the batch, for `Send`.
    Unsupported(pb::RaftBatch),
}

impl PeerSender {
    async fn run(self, mut rx: tokio::sync::mpsc::Receiver<Message>) {
        let mut reported = false;
        let mut stream: Option<OpenStream> = None;
        // Since when the peer gets a call per batch (it refused the stream).
        let mut unary: Option<std::time::Instant> = None;
        while let Some(first) = rx.recv().await {
            let mut batch = vec![first];
            while batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            let mut messages = Vec::with_capacity(batch.len());
            for m in batch {
                if m.get_msg_type() == MessageType::MsgSnapshot {
                    self.spawn_snapshot(m);
                    continue;
                }
                match m.write_to_bytes() {
                    Ok(b) => messages.push(bytes::Bytes::from(b)),
                    Err(e) => tracing::error!(error = %e, "encoding a raft message"),
                }
            }
            if messages.is_empty() {
                continue;
            }
            let mut batch = pb::RaftBatch {
                from: self.from,
                to: self.to,
                messages,
            };
            if unary.is_none_or(|since| since.elapsed() >= STREAM_RETRY) {
                match self.stream(&mut stream, batch) {
                    Streamed::Sent | Streamed::Dropped => {
                        unary = None;
                        continue;
                    }
                    Streamed::Unsupported(b) => {
                        if unary.is_none() {
                            tracing::info!(
                                peer = self.to,
                                "the peer does not take a stream of raft messages (an older release); sending a call per batch"
                            );
                        }
                        unary = Some(std::time::Instant::now());
                        batch = b;
                    }
                }
            }
            let mut req = tonic::Request::new(batch);
            req.set_timeout(SEND_TIMEOUT);
            let mut client = self.client.clone();
            match tokio::time::timeout(SEND_TIMEOUT, client.send(req)).await {
                Ok(Ok(_)) => reported = false,
                Ok(Err(e)) => {
                    if !reported {
                        tracing::debug!(peer = self.to, error = %e.message(), "raft send failed");
                        reported = true;
                    }
                    (self.feedback)(Feedback::Unreachable(self.to));
                }
                Err(_) => (self.feedback)(Feedback::Unreachable(self.to)),
            }
        }
    }

    /// Hands `batch` to the peer's stream, opening one when there is none or the last
    /// ended (its end was reported unreachable then, unless the peer refused the method).
    fn stream(&self, open: &mut Option<OpenStream>, batch: pb::RaftBatch) -> Streamed {
        if let Some(ended) = open.take_if(|s| s.call.is_finished()) {
            use futures::FutureExt;
            if let Some(Ok(Err(status))) = ended.call.now_or_never() {
                if refused_method(&status) {
                    return Streamed::Unsupported(batch);
                }
            }
        }
        let s = open.get_or_insert_with(|| self.open_stream());
        match s.tx.try_send(batch) {
            Ok(()) => Streamed::Sent,
            Err(e) => {
                if let tokio::sync::mpsc::error::TrySendError::Closed(_) = e {
                    // Ended between the check and the send: its end is reported by it.
                } else {
                    (self.feedback)(Feedback::Unreachable(self.to));
                }
                Streamed::Dropped
            }
        }
    }

    /// Starts a `SendStream` call fed by a queue. When it ends with an error the peer is
    /// reported unreachable (a refused method is not: the sender falls back to `Send`).
    fn open_stream(&self) -> OpenStream {
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_QUEUE);
        let mut client = self.client.clone();
        let (feedback, to) = (self.feedback.clone(), self.to);
        let call = tokio::spawn(async move {
            let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
            let result = client.send_stream(stream).await.map(|_| ());
            if let Err(e) = &result {
                if !refused_method(e) {
                    tracing::debug!(peer = to, error = %e.message(), "raft stream ended");
                    feedback(Feedback::Unreachable(to));
                }
            }
            result
        });
        OpenStream { tx, call }
    }

    fn spawn_snapshot(&self, m: Message) {
        use std::sync::atomic::Ordering;
        if self.snapshot_busy.swap(true, Ordering::AcqRel) {
            // One transfer at a time per peer; Raft asks again after the failure report.
            (self.feedback)(Feedback::Snapshot {
                to: self.to,
                ok: false,
            });
            return;
        }
        let client = self.client.clone();
        let feedback = self.feedback.clone();
        let snapshots = self.snapshots.clone();
        let busy = self.snapshot_busy.clone();
        let to = self.to;
        tokio::spawn(async move {
            let meta = m.get_snapshot().get_metadata().clone();
            let result = send_snapshot(client, &snapshots, m).await;
            match &result {
                Ok(bytes) => tracing::info!(peer = to, index = meta.index, bytes, "snapshot sent"),
                Err(e) => {
                    tracing::warn!(peer = to, index = meta.index, error = %e, "snapshot transfer failed")
                }
            }
            busy.store(false, Ordering::Release);
            feedback(Feedback::Snapshot {
                to,
                ok: result.is_ok(),
            });
        });
    }
}

/// Whether a peer refused the `SendStream` method itself: an older release's servers
/// answer PERMISSION_DENIED for a method missing from their authorization table
/// ("… is not a known operation"), and a server without the method UNIMPLEMENTED. A
/// refusal of this master's certificate is PERMISSION_DENIED too; `Send` needs the same
/// role, so falling back to it changes nothing there.
fn refused_method(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unimplemented | tonic::Code::PermissionDenied
    )
}

async fn send_snapshot(
    mut client: RaftServiceClient<Channel>,
    snapshots: &SnapshotDir,
    m: Message,
) -> Result<u64, String> {
    let meta = m.get_snapshot().get_metadata();
    let path = snapshots.path_for(meta.index, meta.term);
    let message = m.write_to_bytes().map_err(|e| e.to_string())?;
    let total = std::fs::metadata(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::SnapshotChunk>(4);
    let reader = tokio::task::spawn_blocking(move || -> Result<(), String> {
        use std::io::Read;
        let mut f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut crc = 0u32;
        let mut first = Some(message);
        let mut sent = 0u64;
        loop {
            let mut buf = vec![0u8; SNAPSHOT_CHUNK];
            let mut n = 0;
            while n < buf.len() {
                match f.read(&mut buf[n..]) {
                    Ok(0) => break,
                    Ok(k) => n += k,
                    Err(e) => return Err(e.to_string()),
                }
            }
            buf.truncate(n);
            crc = crc32c::crc32c_append(crc, &buf);
            sent += n as u64;
            let last = n == 0 || sent >= total;
            let chunk = pb::SnapshotChunk {
                message: first.take().map(bytes::Bytes::from).unwrap_or_default(),
                data: bytes::Bytes::from(buf),
                last,
                crc32c: if last { crc } else { 0 },
                total_bytes: total,
            };
            if tx.blocking_send(chunk).is_err() {
                return Err("the transfer was aborted".into());
            }
            if last {
                return Ok(());
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    let res = client.install_snapshot(stream).await;
    let read = reader.await.map_err(|e| e.to_string())?;
    res.map_err(|e| e.message().to_string())?;
    read?;
    Ok(total)
}
