//! How a client reads a range of a block from a worker: [`BlockTransport`], with the gRPC
//! implementation every worker serves ([`GrpcTransport`], `ReadBlock`) and the block data
//! plane of workers started with `--data-listen` ([`DataPlane`]: framed streams, see
//! `pb::DataFrame` — mutual TLS with the cluster's identities where it has TLS, plain TCP
//! with whole cached pages sent by `sendfile` where it has not), used when a worker offers
//! it. Both carry the same request (descriptor, grant, range, flags)
//! and answer the same thing: the bytes, and whether every one came from the cache. An
//! RDMA transport would be a third implementation (docs/architecture.md).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use granary_common::net::{GrpcChannel as Channel, Net, ServerKind};
use granary_common::tls::TlsMaterial;
use granary_proto as pb;
use granary_proto::prost::Message;
use granary_proto::worker_service_client::WorkerServiceClient;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::ClientError;

/// Reads block ranges from workers.
pub trait BlockTransport: Send + Sync {
    /// Reads `req`'s range from the worker at `target` within `deadline`: the bytes (fewer
    /// than asked only at the block's end), and whether all came from its cache.
    fn read<'a>(
        &'a self,
        target: &'a str,
        req: pb::ReadBlockRequest,
        deadline: Duration,
    ) -> BoxFuture<'a, Result<(Bytes, bool), ClientError>>;
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Joins chunks received in order (one chunk is not copied).
pub(crate) fn join(mut parts: Vec<Bytes>, len: u64) -> Bytes {
    if parts.len() == 1 {
        return parts.pop().unwrap_or_default();
    }
    let mut out = BytesMut::with_capacity(len as usize);
    for p in parts {
        out.extend_from_slice(&p);
    }
    out.freeze()
}

/// `ReadBlock` over gRPC (TLS where the cluster has it), one cached channel per worker.
pub struct GrpcTransport {
    net: Net,
    clients: Mutex<HashMap<String, WorkerServiceClient<Channel>>>,
}

impl GrpcTransport {
    pub fn new(net: Net) -> Self {
        Self {
            net,
            clients: Mutex::default(),
        }
    }

    /// The gRPC client of the worker at `address`.
    pub fn client(&self, address: &str) -> Result<WorkerServiceClient<Channel>, ClientError> {
        let mut m = lock(&self.clients);
        if let Some(c) = m.get(address) {
            return Ok(c.clone());
        }
        let ch = self
            .net
            .channel(address, ServerKind::Node)
            .map_err(|e| ClientError::invalid(format!("bad worker address: {e}")))?;
        let c = WorkerServiceClient::new(ch)
            .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(pb::MAX_MESSAGE_BYTES);
        m.insert(address.to_string(), c.clone());
        Ok(c)
    }
}

impl BlockTransport for GrpcTransport {
    fn read<'a>(
        &'a self,
        target: &'a str,
        req: pb::ReadBlockRequest,
        deadline: Duration,
    ) -> BoxFuture<'a, Result<(Bytes, bool), ClientError>> {
        Box::pin(async move {
            let mut client = self.client(target)?;
            let offset = req.offset;
            let mut req = tonic::Request::new(req);
            req.set_timeout(deadline);
            let mut stream = client.read_block(req).await?.into_inner();
            // Chunks are kept as they arrive and joined once.
            let mut chunks: Vec<Bytes> = Vec::new();
            let (mut got, mut hit) = (0u64, true);
            while let Some(chunk) = stream.message().await? {
                hit &= chunk.hit;
                if chunk.offset != offset + got {
                    return Err(ClientError::internal(format!(
                        "worker {target} sent a chunk at {} where {} was expected",
                        chunk.offset,
                        offset + got
                    )));
                }
                got += chunk.data.len() as u64;
                chunks.push(chunk.data);
            }
            Ok((join(chunks, got), hit))
        })
    }
}

/// Largest frame header a worker sends (a `DataFrame`: an error message at most).
const MAX_FRAME_HEADER: usize = 64 << 10;
/// Idle connections kept per worker.
const IDLE_PER_WORKER: usize = 16;
/// A worker whose data plane failed is read over gRPC for this long.
const DOWN_FOR: Duration = Duration::from_secs(30);
/// Time to connect to a data plane.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A data plane connection, plain or TLS.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// The block data plane of workers started with `--data-listen`. Every frame's data is
/// checked against its CRC32C before it is used: a torn or altered stream fails the read
/// (the caller reads over gRPC or from the next worker), it never delivers wrong bytes.
#[derive(Default)]
pub struct DataPlane {
    /// The process's identity for mutual TLS, each connection made with the material in
    /// use then (None: plain TCP, a cluster without TLS).
    tls: Option<Arc<TlsMaterial>>,
    idle: Mutex<HashMap<String, Vec<Box<dyn Stream>>>>,
    down: Mutex<HashMap<String, Instant>>,
    buffers: Arc<BufferPool>,
}

/// Idle receive buffers kept for reuse, at most (bytes).
const POOLED_BYTES: usize = 128 << 20;

/// Receive buffers handed out as `Bytes` and taken back when the last of those is
/// dropped: a new buffer costs the kernel a fault and a zeroed page per 4 KiB, a quarter
/// of a peer read's CPU at 64 MiB per read.
#[derive(Default)]
struct BufferPool(Mutex<Vec<Vec<u8>>>);

impl BufferPool {
    /// An empty buffer with room for `len` bytes (a pooled one at most twice as large).
    fn take(&self, len: usize) -> Vec<u8> {
        let mut free = lock(&self.0);
        match free
            .iter()
            .position(|b| b.capacity() >= len && b.capacity() <= 2 * len.max(1 << 20))
        {
            Some(i) => free.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    fn give(&self, mut b: Vec<u8>) {
        b.clear();
        let mut free = lock(&self.0);
        let held: usize = free.iter().map(Vec::capacity).sum();
        if held + b.capacity() <= POOLED_BYTES {
            free.push(b);
        }
    }
}

/// A pooled buffer behind `Bytes`: back to its pool when the last `Bytes` goes.
struct Pooled {
    buf: Vec<u8>,
    pool: Arc<BufferPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

/// Why a data plane read failed: the worker's answer (a status, final), or the stream
/// (try gRPC).
#[derive(Debug)]
pub enum DataPlaneError {
    Refused(ClientError),
    Stream(String),
}

impl DataPlane {
    /// Data plane streams with `tls` (the process's identity), or plain TCP.
    pub fn new(tls: Option<Arc<TlsMaterial>>) -> Self {
        Self {
            tls,
            ..Default::default()
        }
    }

    /// Whether the data plane at `address` failed lately (read over gRPC meanwhile).
    pub fn is_down(&self, address: &str) -> bool {
        lock(&self.down)
            .get(address)
            .is_some_and(|t| t.elapsed() < DOWN_FOR)
    }

    fn mark_down(&self, address: &str) {
        let mut m = lock(&self.down);
        if m.len() >= 1024 {
            m.retain(|_, t| t.elapsed() < DOWN_FOR);
        }
        m.insert(address.to_string(), Instant::now());
        lock(&self.idle).remove(address);
    }

    /// A connection to `address`: an idle one (`true`) unless `fresh`, else a new one.
    async fn connection(
        &self,
        address: &str,
        fresh: bool,
    ) -> Result<(Box<dyn Stream>, bool), String> {
        if !fresh {
            if let Some(s) = lock(&self.idle).get_mut(address).and_then(|v| v.pop()) {
                return Ok((s, true));
            }
        }
        let connect = async {
            let s = TcpStream::connect(address)
                .await
                .map_err(|e| format!("cannot connect to {address}: {e}"))?;
            let _ = s.set_nodelay(true);
            let Some(tls) = &self.tls else {
                return Ok(Box::new(s) as Box<dyn Stream>);
            };
            let name = granary_common::tls::node_server_name().map_err(|e| e.to_string())?;
            let s = tls
                .stream_connector()
                .connect(name, s)
                .await
                .map_err(|e| format!("TLS with {address}: {e}"))?;
            Ok::<_, String>(Box::new(s) as Box<dyn Stream>)
        };
        let s = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| format!("no connection to {address} within {CONNECT_TIMEOUT:?}"))??;
        Ok((s, false))
    }

    /// Reads `req`'s range from the data plane at `address`.
    pub async fn read_from(
        &self,
        address: &str,
        req: &pb::ReadBlockRequest,
        deadline: Duration,
    ) -> Result<(Bytes, bool), DataPlaneError> {
        let run = async {
            let mut fresh = false;
            loop {
                let (mut sock, reused) = self.connection(address, fresh).await?;
                let buf = self.buffers.take(req.length as usize);
                let out = match exchange(&mut *sock, req, buf).await {
                    Ok(out) => out,
                    // An idle connection the worker closed meanwhile (idle for 5 minutes, or
                    // the worker restarted): once more on a new one.
                    Err(_) if reused => {
                        fresh = true;
                        continue;
                    }
                    Err(why) => return Err(why),
                };
                let out = out.map(|(buf, hit)| {
                    let pool = self.buffers.clone();
                    (Bytes::from_owner(Pooled { buf, pool }), hit)
                });
                if out.is_ok() {
                    let mut idle = lock(&self.idle);
                    let v = idle.entry(address.to_string()).or_default();
                    if v.len() < IDLE_PER_WORKER {
                        v.push(sock); // in step: the answer was read to its end
                    }
                }
                return Ok::<_, String>(out);
            }
        };
        match tokio::time::timeout(deadline, run).await {
            Ok(Ok(Ok(r))) => Ok(r),
            Ok(Ok(Err(status))) => Err(DataPlaneError::Refused(status.into())),
            Ok(Err(why)) => {
                self.mark_down(address);
                Err(DataPlaneError::Stream(why))
            }
            Err(_) => {
                self.mark_down(address);
                Err(DataPlaneError::Stream(format!(
                    "no answer from {address} within {deadline:?}"
                )))
            }
        }
    }
}

impl BlockTransport for DataPlane {
    fn read<'a>(
        &'a self,
        target: &'a str,
        req: pb::ReadBlockRequest,
        deadline: Duration,
    ) -> BoxFuture<'a, Result<(Bytes, bool), ClientError>> {
        Box::pin(async move {
            match self.read_from(target, &req, deadline).await {
                Ok(r) => Ok(r),
                Err(DataPlaneError::Refused(e)) => Err(e),
                Err(DataPlaneError::Stream(why)) => Err(ClientError::unavailable(why)),
            }
        })
    }
}

/// A worker's refusal as the status gRPC would have carried, metadata included (a grant
/// refusal is told by it, not by its text).
fn refusal(f: pb::DataFrame) -> tonic::Status {
    let code = tonic::Code::from(i32::try_from(f.code).unwrap_or(i32::MAX));
    let mut s = tonic::Status::new(code, f.message);
    if f.refusal == pb::GRANT_REFUSAL {
        s.metadata_mut().insert(
            pb::REFUSAL_KEY,
            tonic::metadata::MetadataValue::from_static(pb::GRANT_REFUSAL),
        );
    }
    if f.errno != 0 {
        s.metadata_mut()
            .insert(pb::ERRNO_KEY, tonic::metadata::MetadataValue::from(f.errno));
    }
    s
}

/// One request and its answer on `sock`: the bytes, or the worker's refusal; `Err`: the
/// stream failed (the connection is not reusable).
async fn exchange<S: AsyncRead + AsyncWrite + Unpin + ?Sized>(
    sock: &mut S,
    req: &pb::ReadBlockRequest,
    mut out: Vec<u8>,
) -> Result<Result<(Vec<u8>, bool), tonic::Status>, String> {
    let io = |e: std::io::Error| format!("data plane stream: {e}");
    let mut head = BytesMut::with_capacity(4 + req.encoded_len());
    head.put_u32(req.encoded_len() as u32);
    req.encode(&mut head).map_err(|e| e.to_string())?;
    sock.write_all(&head).await.map_err(io)?;
    // A TLS stream holds what the socket did not take until flushed.
    sock.flush().await.map_err(io)?;
    let mut hit = true;
    let mut header = Vec::new();
    loop {
        let n = sock.read_u32().await.map_err(io)? as usize;
        if n > MAX_FRAME_HEADER {
            return Err(format!("a frame header of {n} bytes"));
        }
        header.resize(n, 0);
        sock.read_exact(&mut header).await.map_err(io)?;
        let f = pb::DataFrame::decode(&header[..]).map_err(|e| format!("bad frame: {e}"))?;
        if f.end {
            if f.code != 0 {
                return Ok(Err(refusal(f)));
            }
            return Ok(Ok((out, hit)));
        }
        let len = f.length as usize;
        if f.offset != req.offset + out.len() as u64 || out.len() + len > req.length as usize {
            return Err(format!(
                "a frame of {len} bytes at {} where {} was expected",
                f.offset,
                req.offset + out.len() as u64
            ));
        }
        let start = out.len();
        out.reserve(len);
        while out.len() < start + len {
            let want = start + len - out.len();
            let got = (&mut *sock)
                .take(want as u64)
                .read_buf(&mut out)
                .await
                .map_err(io)?;
            if got == 0 {
                return Err("the stream ended inside a frame".into());
            }
        }
        if crc32c::crc32c(&out[start..]) != f.crc32c {
            return Err(format!(
                "the data at {} failed its checksum (a torn or altered stream)",
                f.offset
            ));
        }
        hit &= f.hit;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers one request with `frames` (header, data) as written.
    async fn server(frames: Vec<(pb::DataFrame, Vec<u8>)>) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            answer(&mut s, frames).await;
        });
        addr
    }

    /// Reads one request from `s` and writes `frames` (header, data) as given.
    async fn answer(s: &mut TcpStream, frames: Vec<(pb::DataFrame, Vec<u8>)>) {
        let n = s.read_u32().await.unwrap();
        let mut buf = vec![0u8; n as usize];
        s.read_exact(&mut buf).await.unwrap();
        for (f, data) in frames {
            let mut out = BytesMut::new();
            out.put_u32(f.encoded_len() as u32);
            f.encode(&mut out).unwrap();
            out.extend_from_slice(&data);
            if s.write_all(&out).await.is_err() {
                return;
            }
        }
    }

    fn data(offset: u64, bytes: &[u8], crc: u32) -> (pb::DataFrame, Vec<u8>) {
        let f = pb::DataFrame {
            offset,
            length: bytes.len() as u32,
            crc32c: crc,
            hit: true,
            ..Default::default()
        };
        (f, bytes.to_vec())
    }

    fn end(code: u32, message: &str) -> (pb::DataFrame, Vec<u8>) {
        let f = pb::DataFrame {
            end: true,
            code,
            message: message.into(),
            ..Default::default()
        };
        (f, Vec::new())
    }

    fn req(length: u64) -> pb::ReadBlockRequest {
        pb::ReadBlockRequest {
            offset: 10,
            length,
            ..Default::default()
        }
    }

    const T: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn frames_are_joined_in_order_and_each_checked() {
        let (a, b) = (vec![1u8; 3000], vec![2u8; 1000]);
        let addr = server(vec![
            data(10, &a, crc32c::crc32c(&a)),
            data(3010, &b, crc32c::crc32c(&b)),
            end(0, ""),
        ])
        .await;
        let dp = DataPlane::default();
        let (got, hit) = dp.read_from(&addr, &req(4000), T).await.unwrap();
        assert!(hit);
        assert_eq!(got[..3000], a[..]);
        assert_eq!(got[3000..], b[..]);
        // Read to its end: the connection is kept for the next request.
        assert_eq!(lock(&dp.idle).get(&addr).map(Vec::len), Some(1));
    }

    #[tokio::test]
    async fn a_torn_or_altered_stream_never_delivers_its_bytes() {
        let a = vec![7u8; 4096];
        let mut bad = a.clone();
        bad[100] ^= 1;
        let cases = [
            // Altered on the way: the page's CRC32C no longer matches.
            vec![data(10, &bad, crc32c::crc32c(&a)), end(0, "")],
            // Torn: the stream ends inside a frame.
            vec![(data(10, &a, crc32c::crc32c(&a)).0, a[..1000].to_vec())],
            // Out of place, or more than asked.
            vec![data(11, &a, crc32c::crc32c(&a)), end(0, "")],
            vec![
                data(10, &[0u8; 5000], crc32c::crc32c(&[0u8; 5000])),
                end(0, ""),
            ],
        ];
        for frames in cases {
            let addr = server(frames).await;
            let dp = DataPlane::default();
            match dp.read_from(&addr, &req(4096), T).await {
                Err(DataPlaneError::Stream(_)) => {}
                other => panic!("{other:?}"),
            }
            assert!(
                dp.is_down(&addr),
                "a failed data plane is left alone a while"
            );
        }
    }

    #[tokio::test]
    async fn an_idle_connection_the_worker_closed_is_replaced_not_failed() {
        let a = vec![3u8; 2048];
        let frames = || vec![data(10, &a, crc32c::crc32c(&a)), end(0, "")];
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (f1, f2) = (frames(), frames());
        tokio::spawn(async move {
            // Each connection answers one request, then the worker closes it.
            for frames in [f1, f2] {
                let (mut s, _) = l.accept().await.unwrap();
                answer(&mut s, frames).await;
            }
        });
        let dp = DataPlane::default();
        for _ in 0..2 {
            let (got, _) = dp.read_from(&addr, &req(2048), T).await.unwrap();
            assert_eq!(got[..], a[..]);
        }
        assert!(!dp.is_down(&addr));
    }

    #[tokio::test]
    async fn a_workers_refusal_comes_back_as_its_status() {
        let addr = server(vec![end(
            tonic::Code::PermissionDenied as u32,
            "no read grant",
        )])
        .await;
        let dp = DataPlane::default();
        match dp.read_from(&addr, &req(10), T).await {
            Err(DataPlaneError::Refused(e)) => {
                assert!(e.to_string().contains("no read grant"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert!(!dp.is_down(&addr));
    }

    /// A refused grant is told by the frame's marker, as over gRPC by the status metadata:
    /// the reader asks the master for a new grant instead of failing the read.
    #[tokio::test]
    async fn a_grant_refusal_and_an_errno_survive_the_data_plane() {
        let (mut grant, _) = end(tonic::Code::PermissionDenied as u32, "the grant expired");
        grant.refusal = pb::GRANT_REFUSAL.into();
        let (mut full, _) = end(tonic::Code::ResourceExhausted as u32, "the disk is full");
        full.errno = 28;
        let dp = DataPlane::default();
        let addr = server(vec![(grant, Vec::new())]).await;
        match dp.read_from(&addr, &req(10), T).await {
            Err(DataPlaneError::Refused(e)) => assert_eq!(
                e,
                crate::error::ClientError::new(crate::ErrorCode::GrantRefused, "the grant expired")
            ),
            other => panic!("{other:?}"),
        }
        let addr = server(vec![(full, Vec::new())]).await;
        match dp.read_from(&addr, &req(10), T).await {
            Err(DataPlaneError::Refused(e)) => {
                assert_eq!(e, crate::error::ClientError::posix(28, "the disk is full"))
            }
            other => panic!("{other:?}"),
        }
    }
}
