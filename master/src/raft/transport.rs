//! Carrying Raft messages between masters over gRPC (`granary.v1.RaftService`).
//!
//! The Raft thread encodes each round's messages to a peer as raft-rs protobuf bytes in one
//! batch and hands it to the peer's long-lived `SendStream` call, in order (a peer of an
//! older release that does not know it gets a `Send` call per batch, from a task). A batch that
//! cannot be sent, or a stream that breaks, reports the peer unreachable to Raft (which
//! then probes instead of streaming); what was lost Raft sends again.
//! `MsgSnapshot` is special: the snapshot file it names is streamed in 1 MiB chunks by a
//! separate task, and the outcome is reported back with `report_snapshot`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

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

/// Messages per batch at most, and bytes (a batch is one gRPC message).
const BATCH: usize = 256;
const BATCH_BYTES: usize = 16 << 20;
const SEND_TIMEOUT: Duration = Duration::from_secs(3);
/// Batches waiting on a peer's stream (or its calls) at most: beyond it the peer is not
/// keeping up, and the batch is dropped as a failed send would be.
const STREAM_QUEUE: usize = 1024;
/// How long a peer that refused `SendStream` gets a call per batch before a stream is
/// tried again (it may have been upgraded meanwhile).
const STREAM_RETRY: Duration = Duration::from_secs(60);
const SNAPSHOT_CHUNK: usize = 1 << 20;

pub struct GrpcTransport {
    self_id: u64,
    rt: tokio::runtime::Handle,
    peers: Peers,
    links: HashMap<u64, PeerLink>,
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
            links: HashMap::new(),
            feedback,
            snapshots,
        }
    }

    /// The peer's link, made on first use. Runs inside the runtime's context (channels
    /// and tasks need its reactor; this runs on the Raft thread).
    fn link(&mut self, to: u64) -> Option<&mut PeerLink> {
        if !self.links.contains_key(&to) {
            let addr = peer_address(&self.peers, to)?;
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
            let link = PeerLink {
                from: self.self_id,
                to,
                client,
                feedback: self.feedback.clone(),
                snapshots: self.snapshots.clone(),
                snapshot_busy: Arc::default(),
                stream: None,
                unary: None,
            };
            self.links.insert(to, link);
        }
        self.links.get_mut(&to)
    }
}

impl Transport for GrpcTransport {
    /// Encodes each peer's messages into batches on the Raft thread and hands them
    /// straight to the peer's stream: no task in between, so a message costs no wake-up
    /// of its own before HTTP/2 writes it.
    fn send(&mut self, msgs: Vec<Message>) {
        if msgs.is_empty() {
            return;
        }
        let rt = self.rt.clone();
        let _rt = rt.enter();
        // Per peer, in order.
        let mut by_peer: Vec<(u64, Vec<Message>)> = Vec::new();
        for m in msgs {
            match by_peer.iter_mut().find(|(to, _)| *to == m.to) {
                Some((_, v)) => v.push(m),
                None => by_peer.push((m.to, vec![m])),
            }
        }
        for (to, msgs) in by_peer {
            let feedback = self.feedback.clone();
            let Some(link) = self.link(to) else {
                tracing::debug!(peer = to, "no address for raft peer; messages dropped");
                for m in &msgs {
                    // A dropped snapshot must be reported as such: raft-rs keeps a peer in
                    // snapshot state (sending nothing else) until `report_snapshot`.
                    feedback(if m.get_msg_type() == MessageType::MsgSnapshot {
                        Feedback::Snapshot { to, ok: false }
                    } else {
                        Feedback::Unreachable(to)
                    });
                }
                continue;
            };
            let mut messages = Vec::new();
            let mut bytes = 0;
            for m in msgs {
                if m.get_msg_type() == MessageType::MsgSnapshot {
                    link.spawn_snapshot(m);
                    continue;
                }
                let b = match m.write_to_bytes() {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::error!(error = %e, "encoding a raft message");
                        continue;
                    }
                };
                if !messages.is_empty()
                    && (messages.len() >= BATCH || bytes + b.len() > BATCH_BYTES)
                {
                    link.deliver(std::mem::take(&mut messages));
                    bytes = 0;
                }
                bytes += b.len();
                messages.push(bytes::Bytes::from(b));
            }
            if !messages.is_empty() {
                link.deliver(messages);
            }
        }
    }

    fn set_address(&mut self, id: u64, addr: &str) {
        if let Ok(mut g) = self.peers.write() {
            if g.get(&id).map(String::as_str) != Some(addr) {
                g.insert(id, addr.to_string());
                // Dropping the link ends its stream; the next send makes a new one.
                self.links.remove(&id);
            }
        }
    }
}

/// One peer as the Raft thread sends to it: its open stream, or (a peer of an older
/// release) the queue of a task making a call per batch.
struct PeerLink {
    from: u64,
    to: u64,
    client: RaftServiceClient<Channel>,
    feedback: FeedbackFn,
    snapshots: SnapshotDir,
    snapshot_busy: Arc<std::sync::atomic::AtomicBool>,
    stream: Option<OpenStream>,
    /// Since when the peer gets a call per batch (it refused the stream), and the queue
    /// of the task making the calls.
    unary: Option<(Instant, tokio::sync::mpsc::Sender<pb::RaftBatch>)>,
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

impl PeerLink {
    fn deliver(&mut self, messages: Vec<bytes::Bytes>) {
        let mut batch = pb::RaftBatch {
            from: self.from,
            to: self.to,
            messages,
        };
        let retry = self
            .unary
            .as_ref()
            .is_none_or(|(since, _)| since.elapsed() >= STREAM_RETRY);
        if retry {
            match self.stream(batch) {
                Streamed::Sent | Streamed::Dropped => {
                    self.unary = None;
                    return;
                }
                Streamed::Unsupported(b) => {
                    if self.unary.is_none() {
                        tracing::info!(
                            peer = self.to,
                            "the peer does not take a stream of raft messages (an older release); sending a call per batch"
                        );
                    }
                    let queue = match self.unary.take() {
                        Some((_, q)) if !q.is_closed() => q,
                        _ => self.start_calls(),
                    };
                    self.unary = Some((Instant::now(), queue));
                    batch = b;
                }
            }
        }
        if let Some((_, q)) = &self.unary {
            if q.try_send(batch).is_err() {
                (self.feedback)(Feedback::Unreachable(self.to));
            }
        }
    }

    /// Hands `batch` to the peer's stream, opening one when there is none or the last
    /// ended (its end was reported unreachable then, unless the peer refused the method).
    fn stream(&mut self, batch: pb::RaftBatch) -> Streamed {
        if let Some(ended) = self.stream.take_if(|s| s.call.is_finished()) {
            use futures::FutureExt;
            if let Some(Ok(Err(status))) = ended.call.now_or_never() {
                if refused_method(&status) {
                    return Streamed::Unsupported(batch);
                }
            }
        }
        if self.stream.is_none() {
            self.stream = Some(self.open_stream());
        }
        let Some(s) = &self.stream else {
            return Streamed::Dropped;
        };
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

    /// Starts the task that sends a peer of an older release a `Send` call per batch,
    /// one at a time and in order.
    fn start_calls(&self) -> tokio::sync::mpsc::Sender<pb::RaftBatch> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<pb::RaftBatch>(STREAM_QUEUE);
        let client = self.client.clone();
        let (feedback, to) = (self.feedback.clone(), self.to);
        tokio::spawn(async move {
            let mut reported = false;
            while let Some(batch) = rx.recv().await {
                let mut req = tonic::Request::new(batch);
                req.set_timeout(SEND_TIMEOUT);
                let mut client = client.clone();
                match tokio::time::timeout(SEND_TIMEOUT, client.send(req)).await {
                    Ok(Ok(_)) => reported = false,
                    Ok(Err(e)) => {
                        if !reported {
                            tracing::debug!(peer = to, error = %e.message(), "raft send failed");
                            reported = true;
                        }
                        feedback(Feedback::Unreachable(to));
                    }
                    Err(_) => feedback(Feedback::Unreachable(to)),
                }
            }
        });
        tx
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
