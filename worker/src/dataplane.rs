//! The block data plane (`--data-listen`): reads of blocks as framed streams (see
//! `pb::DataFrame` for the wire format) — plain TCP on clusters without TLS, mutual TLS
//! with the cluster's identities (as gRPC) on clusters with it.
//!
//! A caller is who its client certificate says (the unauthenticated caller on plain TCP)
//! and may read only if its roles may call `ReadBlock`; a request is checked exactly as a
//! gRPC `ReadBlock` is ([`WorkerRpc::admit_read`]: geometry, flags, the caller's grant).
//! Whole cached pages are then sent from the cache file under a short lease (the page is
//! neither evicted nor punched out while it is sent) — by `sendfile` on plain TCP, read
//! and encrypted on TLS — with the CRC32C the store recorded for it: the client checks it,
//! so a torn stream or a page that rotted on this disk is never delivered as good. Parts
//! of pages are read, checked and sent with the CRC32C of the part; pages not cached (and
//! node copies) go through the `ReadBlock` path, which fetches them. Requests on one
//! connection are answered in order.

use std::future::Future;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use futures::StreamExt;
use granary_proto as pb;
use granary_proto::prost::Message;
use granary_proto::worker_service_server::WorkerService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use granary_common::tls::{Principal, TlsMaterial};

use crate::error::RpcError;
use crate::service::{Plan, WorkerRpc};
use crate::store::block_key;

/// Largest request frame (a `ReadBlockRequest` with its descriptor and grant).
pub const MAX_REQUEST_BYTES: usize = 64 << 10;
/// How long the pages of one request stay leased while they are sent.
const SEND_LEASE: Duration = Duration::from_secs(30);
/// Time a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection with no request for this long is closed (clients open a new one).
const IDLE_CLOSE: Duration = Duration::from_secs(300);
/// Data plane connections served at once (each a task, and the pages of its answer in
/// flight).
pub const MAX_CONNECTIONS: usize = 512;
/// Time a request's body may take to arrive once its length has.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// The method whose roles may use the data plane.
const READ_METHOD: &str = "/granary.v1.WorkerService/ReadBlock";

/// A data plane connection: how a cached page's bytes get onto it.
pub(crate) trait Wire: AsyncRead + AsyncWrite + Unpin + Send {
    /// Sends `len` bytes of `file` from `offset`.
    fn send_file(
        &mut self,
        file: &std::fs::File,
        offset: u64,
        len: usize,
    ) -> impl Future<Output = std::io::Result<()>> + Send;
}

impl Wire for TcpStream {
    async fn send_file(
        &mut self,
        file: &std::fs::File,
        offset: u64,
        len: usize,
    ) -> std::io::Result<()> {
        send_file(self, file, offset, len).await
    }
}

impl Wire for tokio_rustls::server::TlsStream<granary_common::tls_conns::Tracked<TcpStream>> {
    /// Read (off the async threads) and written through the TLS stream: no `sendfile`
    /// into a stream the process encrypts.
    async fn send_file(
        &mut self,
        file: &std::fs::File,
        offset: u64,
        len: usize,
    ) -> std::io::Result<()> {
        let file = file.try_clone()?;
        let buf = tokio::task::spawn_blocking(move || {
            use std::os::unix::fs::FileExt;
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, offset).map(|_| buf)
        })
        .await
        .map_err(std::io::Error::other)??;
        self.write_all(&buf).await
    }
}

/// Accepts data plane connections until `shutdown`: mutual TLS with `tls` (each handshake
/// with the material in use when the connection arrives), else plain TCP (a cluster
/// without TLS).
pub async fn serve(
    listener: TcpListener,
    rpc: Arc<WorkerRpc>,
    tls: Option<Arc<TlsMaterial>>,
    shutdown: CancellationToken,
) {
    serve_at_most(listener, rpc, tls, shutdown, MAX_CONNECTIONS).await;
}

/// [`serve`] with at most `max` connections at once.
pub(crate) async fn serve_at_most(
    listener: TcpListener,
    rpc: Arc<WorkerRpc>,
    tls: Option<Arc<TlsMaterial>>,
    shutdown: CancellationToken,
    max: usize,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    let mut refused_logged: Option<Instant> = None;
    loop {
        let sock = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "data plane: cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Callers holding connections (idle, or not reading their answers) take no more
        // than MAX_CONNECTIONS tasks and their pages: one past that is closed at once, and
        // its client reads over gRPC for a while.
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            rpc.metrics.data_plane_refused.inc();
            if refused_logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                tracing::warn!(
                    max,
                    "data plane: as many connections as it serves are open; closing new ones (their clients read over gRPC)"
                );
                refused_logged = Some(Instant::now());
            }
            drop(sock);
            continue;
        };
        let _ = sock.set_nodelay(true);
        let (rpc, sd, tls) = (rpc.clone(), shutdown.clone(), tls.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let served = async {
                match tls {
                    None => connection(sock, &rpc, Principal::unauthenticated()).await,
                    Some(tls) => {
                        let accept = tls.stream_accept(sock);
                        let mut stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, accept)
                            .await
                            .map_err(|_| {
                            std::io::Error::from(std::io::ErrorKind::TimedOut)
                        })??;
                        tls.open_connections().track(&mut stream);
                        let who = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .map(|c| Principal::from_certificate(c.as_ref()));
                        match who {
                            Some(Ok(who)) => connection(stream, &rpc, who).await,
                            _ => Err(std::io::Error::other("no usable client certificate")),
                        }
                    }
                }
            };
            tokio::select! {
                _ = sd.cancelled() => {}
                r = served => if let Err(e) = r {
                    tracing::debug!(error = %e, "data plane connection ended");
                },
            }
        });
    }
}

pub(crate) async fn connection<S: Wire>(
    mut sock: S,
    rpc: &WorkerRpc,
    who: Principal,
) -> std::io::Result<()> {
    if let Err(s) = granary_common::authz::authorize_method(READ_METHOD, &who) {
        tracing::warn!(caller = %who, "data plane connection refused: {}", s.message());
        return end(&mut sock, Some(&s)).await;
    }
    loop {
        let n = match tokio::time::timeout(IDLE_CLOSE, sock.read_u32()).await {
            Err(_) => return Ok(()), // idle
            Ok(Ok(n)) => n as usize,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e),
        };
        if n > MAX_REQUEST_BYTES {
            let s = RpcError::Invalid(format!(
                "a data plane request of {n} bytes (at most {MAX_REQUEST_BYTES})"
            ))
            .into();
            return end(&mut sock, Some(&s)).await; // the stream is out of step: close it
        }
        let mut buf = vec![0u8; n];
        // A request's body follows its length at once: a caller that stops part-way is
        // not waited for (its connection would hold a task for as long as it liked).
        tokio::time::timeout(BODY_TIMEOUT, sock.read_exact(&mut buf))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        match pb::ReadBlockRequest::decode(&buf[..]) {
            Ok(r) => serve_one(&mut sock, rpc, &who, r).await?,
            Err(e) => {
                let s = RpcError::Invalid(format!("undecodable read request: {e}")).into();
                end(&mut sock, Some(&s)).await?;
            }
        }
    }
}

async fn frame<S: Wire>(sock: &mut S, f: &pb::DataFrame) -> std::io::Result<()> {
    let mut out = BytesMut::with_capacity(4 + f.encoded_len());
    out.put_u32(f.encoded_len() as u32);
    f.encode(&mut out).map_err(std::io::Error::other)?;
    sock.write_all(&out).await
}

/// The last frame of an answer: success, or the status it failed with. Flushed: a TLS
/// stream keeps what the socket did not take yet until then (the caller would wait for
/// the end of an answer sitting in the worker's buffer).
async fn end<S: Wire>(sock: &mut S, err: Option<&Status>) -> std::io::Result<()> {
    frame(sock, &end_frame(err)).await?;
    sock.flush().await
}

/// The last frame of an answer: the status's code and message, and the metadata a caller
/// acts on (a grant refusal, an errno), so a refusal reads the same as over gRPC.
fn end_frame(err: Option<&Status>) -> pb::DataFrame {
    let meta = |key: &str| {
        err.and_then(|s| s.metadata().get(key))
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    pb::DataFrame {
        end: true,
        code: err.map_or(0, |s| s.code() as u32),
        message: err.map(|s| s.message().to_string()).unwrap_or_default(),
        refusal: meta(pb::REFUSAL_KEY).unwrap_or_default(),
        errno: meta(pb::ERRNO_KEY)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        ..Default::default()
    }
}

/// Sends `len` bytes of `file` from `offset` (the socket is non-blocking: waits for room).
async fn send_file(
    sock: &TcpStream,
    file: &std::fs::File,
    mut offset: u64,
    mut len: usize,
) -> std::io::Result<()> {
    while len > 0 {
        sock.writable().await?;
        let sent = sock.try_io(Interest::WRITABLE, || {
            let mut off = offset as i64;
            nix::sys::sendfile::sendfile(sock.as_fd(), file.as_fd(), Some(&mut off), len)
                .map_err(std::io::Error::from)
        });
        match sent {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                offset += n as u64;
                len -= n;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn serve_one<S: Wire>(
    sock: &mut S,
    rpc: &WorkerRpc,
    who: &Principal,
    r: pb::ReadBlockRequest,
) -> std::io::Result<()> {
    let (desc, p) = match rpc.admit_read(who, &r) {
        Ok(x) => x,
        Err(e) => return end(sock, Some(&e.into())).await,
    };
    rpc.metrics.read_requests.inc();
    let mut at = p.offset;
    if !r.from_peers && !r.cached_only {
        let key = block_key(desc.id.as_ref().unwrap_or(&pb::BlockId::default()));
        at = send_cached(sock, rpc, key, p).await?;
    }
    if at < p.end {
        // The rest (not cached, or a node copy): the ReadBlock path fetches it.
        let mut rest = r.clone();
        rest.offset = at;
        rest.length = p.end - at;
        let mut req = tonic::Request::new(rest);
        req.extensions_mut().insert(Arc::new(who.clone()));
        let mut stream = match rpc.read_block(req).await {
            Ok(s) => s.into_inner(),
            Err(s) => return end(sock, Some(&s)).await,
        };
        while let Some(m) = stream.next().await {
            let m = match m {
                Ok(m) => m,
                Err(s) => return end(sock, Some(&s)).await,
            };
            let f = pb::DataFrame {
                offset: m.offset,
                length: m.data.len() as u32,
                crc32c: crc32c::crc32c(&m.data),
                hit: m.hit,
                ..Default::default()
            };
            frame(sock, &f).await?;
            sock.write_all(&m.data).await?;
            rpc.metrics.data_plane_bytes.inc_by(m.data.len() as u64);
        }
    }
    end(sock, None).await
}

/// Sends the cached pages of `p` from its start while they are cached; returns the block
/// offset up to which it sent.
async fn send_cached<S: Wire>(
    sock: &mut S,
    rpc: &WorkerRpc,
    key: crate::store::BlockKey,
    p: Plan,
) -> std::io::Result<u64> {
    let store = &rpc.fetcher.store;
    let ps = store.page_size();
    let (first, last) = (p.offset / ps, (p.end - 1) / ps);
    let (Ok(first), Ok(n)) = (u32::try_from(first), u32::try_from(last - first + 1)) else {
        return Ok(p.offset);
    };
    let Some(lease) = store.lease_pages(&key, first, n, Instant::now() + SEND_LEASE, None) else {
        return Ok(p.offset);
    };
    let sent = send_leased(sock, rpc, &lease, p).await;
    store.release(lease.id);
    sent
}

async fn send_leased<S: Wire>(
    sock: &mut S,
    rpc: &WorkerRpc,
    lease: &crate::store::Lease,
    p: Plan,
) -> std::io::Result<u64> {
    let ps = rpc.fetcher.store.page_size();
    let mut at = p.offset;
    let Ok(file) = std::fs::File::open(&lease.path) else {
        return Ok(at);
    };
    for &(index, plen, crc) in &lease.pages {
        let page_start = u64::from(index) * ps;
        let want = ps.min(p.block_len - page_start);
        if u64::from(plen) != want || page_start > at {
            break; // not this block's geometry (the ReadBlock path sorts it out)
        }
        let to = p.end.min(page_start + want);
        let whole = at == page_start && to == page_start + want;
        let n = (to - at) as usize;
        if whole {
            let f = pb::DataFrame {
                offset: at,
                length: plen,
                crc32c: crc,
                hit: true,
                ..Default::default()
            };
            frame(sock, &f).await?;
            sock.send_file(&file, lease.offset + page_start, n).await?;
        } else {
            // Part of a page: check the whole page, send the part with its own CRC32C.
            let mut page = vec![0u8; plen as usize];
            let read = {
                use std::os::unix::fs::FileExt;
                file.read_exact_at(&mut page, lease.offset + page_start)
            };
            if read.is_err() || crc32c::crc32c(&page) != crc {
                break; // the ReadBlock path drops the page and fetches it again
            }
            let part = &page[(at - page_start) as usize..(to - page_start) as usize];
            let f = pb::DataFrame {
                offset: at,
                length: part.len() as u32,
                crc32c: crc32c::crc32c(part),
                hit: true,
                ..Default::default()
            };
            frame(sock, &f).await?;
            sock.write_all(part).await?;
        }
        rpc.metrics.cache_hit_bytes.inc_by(n as u64);
        rpc.metrics.data_plane_bytes.inc_by(n as u64);
        at = to;
        if at >= p.end {
            break;
        }
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_keeps_what_the_caller_acts_on() {
        let ok = end_frame(None);
        assert!(ok.end && ok.code == 0 && ok.refusal.is_empty() && ok.errno == 0);
        let grant: Status = RpcError::GrantRefused("the read grant expired".into()).into();
        let f = end_frame(Some(&grant));
        assert_eq!(f.code, tonic::Code::PermissionDenied as u32);
        assert_eq!(f.refusal, pb::GRANT_REFUSAL);
        assert_eq!(f.message, "the read grant expired");
        let full: Status = RpcError::NoSpace("the disk is full".into()).into();
        assert_eq!(end_frame(Some(&full)).errno, pb::errno::ENOSPC);
        let plain: Status = RpcError::Invalid("bad".into()).into();
        let f = end_frame(Some(&plain));
        assert!(f.refusal.is_empty() && f.errno == 0);
    }
}
