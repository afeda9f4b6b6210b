//! gRPC channel and server settings shared by every hop, tuned for bulk block streams, with
//! bounded cost per request: request messages limited per method ([`per_method_limits`],
//! sizes in [`crate::authz`]), concurrent streams limited per connection.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::{Channel, Endpoint};
use tower::layer::util::{Identity, Stack};

use crate::authz::AuthLayer;
use crate::net::ServerKind;
use crate::tls::TlsMaterial;

/// Time allowed to establish a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Default deadline of a metadata RPC.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(30);
/// HTTP/2 windows sized for 1 MiB chunks in flight.
pub const STREAM_WINDOW: u32 = 8 * 1024 * 1024;
pub const CONNECTION_WINDOW: u32 = 32 * 1024 * 1024;
/// Largest HTTP/2 frame either side accepts: 1 MiB pages travel in a few frames instead of
/// 64 of the default 16 KiB (less framing work per byte on bulk streams).
pub const MAX_FRAME: u32 = 1024 * 1024;

/// Normalises `host:port` or a full URI into an endpoint URI. Always `http://`: with TLS
/// the handshake is made by [`TlsConnect`], not by tonic, so the URI's scheme only names
/// HTTP/2 over whatever the connector returns.
fn endpoint_uri_for(addr: &str) -> String {
    let host_port = addr
        .strip_prefix("http://")
        .or_else(|| addr.strip_prefix("https://"))
        .unwrap_or(addr);
    format!("http://{host_port}")
}

/// A lazily connecting channel to `addr` with Granary's transport settings: mutual TLS
/// with `tls` (the server must hold a certificate of the cluster CA for `server`; each new
/// connection takes the material in use at that moment, see [`TlsMaterial::reload`]), or
/// plaintext without.
pub fn channel_with(
    addr: &str,
    server: ServerKind,
    tls: Option<&Arc<TlsMaterial>>,
) -> Result<Channel, tonic::transport::Error> {
    let endpoint = Endpoint::from_shared(endpoint_uri_for(addr))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME);
    Ok(match tls {
        Some(m) => endpoint.connect_with_connector_lazy(TlsConnect {
            tls: m.clone(),
            name: match server {
                ServerKind::Master => crate::tls::MASTER_SERVER_NAME,
                ServerKind::Node => crate::tls::NODE_SERVER_NAME,
            },
        }),
        None => endpoint.connect_lazy(),
    })
}

/// Connects a channel over TCP and mutual TLS with the material in use now, verifying
/// the server by `name`.
#[derive(Clone)]
struct TlsConnect {
    tls: Arc<TlsMaterial>,
    name: &'static str,
}

impl tower::Service<http::Uri> for TlsConnect {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let config = self.tls.grpc_client();
        let name = self.name;
        Box::pin(async move {
            let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
            let host = uri
                .host()
                .ok_or_else(|| invalid(format!("no host in {uri}")))?;
            // An IPv6 literal keeps its brackets in a URI's host.
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri
                .port_u16()
                .ok_or_else(|| invalid(format!("no port in {uri}")))?;
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let server = crate::tls::server_name(name).map_err(|e| invalid(e.to_string()))?;
            let tls = tokio::time::timeout(
                crate::tls::handshake_timeout(),
                tokio_rustls::TlsConnector::from(config).connect(server, tcp),
            )
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")
            })??;
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

/// A server of Granary's services: the matching transport settings and the authorization
/// layer ([`crate::authz`]) in front of every method. TLS (a client certificate of the
/// cluster CA required) is [`serve`]'s, given the process's material.
pub type Server = tonic::transport::Server<Stack<AuthLayer, Identity>>;

/// Most concurrent streams one connection may open (a bound on what one peer can hold:
/// with the request limits, at most 256 × 4 MiB of control messages per connection).
/// A client past it waits for a stream to end; it does not fail.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;

/// A server of Granary's services; `tls` says whether its callers come over mutual TLS
/// (served by [`serve`] with the same material) or plaintext.
pub fn server_with(tls: Option<&TlsMaterial>) -> Result<Server, tonic::transport::Error> {
    let builder = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION);
    Ok(builder.layer(AuthLayer::new(tls.is_none())))
}

/// How long a server, asked to stop, waits for its connections to end before it stops
/// waiting (the process then ends, and with it what they still held): a client that has
/// stopped reading a stream (an HTTP/2 window of 0 keeps its answer's last bytes, and so
/// the stream and its connection, open) must not keep a process from stopping. Within a
/// Kubernetes pod's default 30 s of grace; streams still running then (a write, a read)
/// fail and their clients retry.
pub const STOP_GRACE: Duration = Duration::from_secs(20);

/// Runs a server (`serve`: `serve_with_incoming_shutdown` ending on `stop`) until it ends,
/// or until [`STOP_GRACE`] after `stop`, when it is dropped with the connections it still
/// holds.
pub async fn serve_until_stopped<E>(
    serve: impl std::future::Future<Output = Result<(), E>>,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(), E> {
    tokio::pin!(serve);
    tokio::select! {
        r = &mut serve => r,
        _ = async {
            stop.cancelled().await;
            tokio::time::sleep(STOP_GRACE).await;
        } => {
            tracing::warn!(
                grace = ?STOP_GRACE,
                "connections were still open after the stop was asked for; closing them"
            );
            Ok(())
        }
    }
}

/// Accepted connections of a bound listener, with Nagle off (a server given its own
/// listener does not apply `Server::tcp_nodelay`; small replies would wait ~40 ms for ACKs).
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)))
}

/// Most TLS handshakes one server runs at once (connections past it wait in the listen
/// backlog), and from one address (a connection past that is closed at once: its client
/// fails fast and tries again, and other addresses keep being served): peers that open
/// connections and send nothing hold at most this many, each for at most
/// [`SERVER_HANDSHAKE_TIMEOUT`].
const MAX_HANDSHAKES: usize = 1024;
const MAX_HANDSHAKES_PER_ADDRESS: usize = 256;

/// How long a server waits for a connection's TLS handshake (clients give up connecting
/// after [`CONNECT_TIMEOUT`]; what is longer serves only a peer that sends nothing).
const SERVER_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshakes running per peer address.
#[derive(Default)]
struct PerAddress(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// A handshake slot of one address, given back when dropped.
struct AddressSlot(Arc<PerAddress>, std::net::IpAddr);

impl PerAddress {
    fn take(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<AddressSlot> {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_default();
        if *n >= MAX_HANDSHAKES_PER_ADDRESS {
            return None;
        }
        *n += 1;
        Some(AddressSlot(self.clone(), ip))
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut map = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.1);
            }
        }
    }
}

/// Accepted connections of a bound listener over mutual TLS: each handshake runs on a
/// task of its own with the material in use when the connection arrived (a renewed
/// certificate serves the next connection, see [`TlsMaterial::reload`]), and connections
/// whose handshake fails or times out are dropped. Each connection is tracked with its
/// peer's chain ([`crate::tls_conns`]): a CA file that no longer verifies it ends it.
/// Ends when the server drops it.
fn tls_incoming(
    listener: tokio::net::TcpListener,
    tls: Arc<TlsMaterial>,
) -> impl futures::Stream<
    Item = Result<
        tokio_rustls::server::TlsStream<crate::tls_conns::Tracked<tokio::net::TcpStream>>,
        std::io::Error,
    >,
> {
    use futures::StreamExt;
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let mut tcp = incoming(listener);
    tokio::spawn(async move {
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let per_address = Arc::new(PerAddress::default());
        let mut refused_at: Option<std::time::Instant> = None;
        loop {
            let slot = tokio::select! {
                _ = tx.closed() => return,
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => return,
                },
            };
            let sock = tokio::select! {
                _ = tx.closed() => return,
                next = tcp.next() => match next {
                    Some(Ok(sock)) => sock,
                    Some(Err(e)) => {
                        // Out of descriptors, say: try again shortly rather than spin.
                        tracing::debug!(error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    None => return,
                },
            };
            let ip = sock.peer_addr().map(|a| a.ip()).ok();
            let Some(by_address) = ip.and_then(|ip| per_address.take(ip)) else {
                // Closed at once (dropped).
                if refused_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(
                        peer = ?ip,
                        "too many TLS handshakes at once from one address; closing its new \
                         connections until some finish"
                    );
                    refused_at = Some(std::time::Instant::now());
                }
                continue;
            };
            let (tx, tls) = (tx.clone(), tls.clone());
            tokio::spawn(async move {
                let held = (slot, by_address);
                let wait = SERVER_HANDSHAKE_TIMEOUT;
                match tokio::time::timeout(wait, tls.grpc_accept(sock)).await {
                    Ok(Ok(mut stream)) => {
                        drop(held);
                        tls.open_connections().track(&mut stream);
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!("TLS handshake timed out"),
                }
            });
        }
    });
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// Serves `router` on `listener` until `stop` (see [`serve_until_stopped`]): over mutual
/// TLS with `tls` (the material [`server_with`] was given), else plaintext.
pub async fn serve(
    router: tonic::transport::server::Router<Stack<AuthLayer, Identity>>,
    listener: tokio::net::TcpListener,
    tls: Option<Arc<TlsMaterial>>,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let sd = stop.clone();
    let signal = async move { sd.cancelled().await };
    match tls {
        Some(m) => {
            let incoming = tls_incoming(listener, m);
            serve_until_stopped(router.serve_with_incoming_shutdown(incoming, signal), stop).await
        }
        None => {
            let incoming = incoming(listener);
            serve_until_stopped(router.serve_with_incoming_shutdown(incoming, signal), stop).await
        }
    }
}

/// One gRPC service with a request-size limit per method: an instance of the service per
/// limit of [`crate::authz::REQUEST_LIMITS`] (the generated servers take one decoding limit
/// each), and each request routed to the instance of its method's limit
/// ([`crate::authz::request_limit`]). A message over it is refused with `OUT_OF_RANGE`
/// ("decoded message length too large") from its 5-byte header, before any of it is
/// buffered.
#[derive(Clone)]
pub struct PerMethodLimits<S> {
    by_limit: Arc<[(usize, S)]>,
}

/// Builds [`PerMethodLimits`] from `make(limit)`, which returns the service decoding
/// messages of at most `limit` bytes, e.g.
/// `|l| FooServer::from_arc(svc.clone()).max_decoding_message_size(l)`.
pub fn per_method_limits<S>(make: impl Fn(usize) -> S) -> PerMethodLimits<S> {
    PerMethodLimits {
        by_limit: crate::authz::REQUEST_LIMITS
            .iter()
            .map(|&l| (l, make(l)))
            .collect(),
    }
}

impl<S: NamedService> NamedService for PerMethodLimits<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tower::Service<http::Request<Body>> for PerMethodLimits<S>
where
    S: tower::Service<http::Request<Body>, Error = Infallible> + Clone,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = S::Future;

    /// Always ready: the generated gRPC servers are (they do their work in `call`).
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let limit = crate::authz::request_limit(req.uri().path());
        let (_, svc) = self
            .by_limit
            .iter()
            .find(|(l, _)| *l == limit)
            .unwrap_or(&self.by_limit[0]);
        svc.clone().call(req)
    }
}
