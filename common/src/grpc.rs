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

/// Normalises `host:port` or a full URI into an endpoint URI: `https://` with TLS, else
/// `http://`.
fn endpoint_uri_for(addr: &str, tls: bool) -> String {
    let host_port = addr
        .strip_prefix("http://")
        .or_else(|| addr.strip_prefix("https://"))
        .unwrap_or(addr);
    if tls {
        format!("https://{host_port}")
    } else {
        format!("http://{host_port}")
    }
}

/// A lazily connecting channel to `addr` with Granary's transport settings: mutual TLS
/// with `tls` (the server must hold a certificate of the cluster CA for `server`), or
/// plaintext without.
pub fn channel_with(
    addr: &str,
    server: ServerKind,
    tls: Option<&TlsMaterial>,
) -> Result<Channel, tonic::transport::Error> {
    let mut endpoint = Endpoint::from_shared(endpoint_uri_for(addr, tls.is_some()))?;
    if let Some(m) = tls {
        endpoint = endpoint.tls_config(match server {
            ServerKind::Master => m.master_client_config(),
            ServerKind::Node => m.client_config(),
        })?;
    }
    Ok(endpoint
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .connect_lazy())
}

/// A server of Granary's services: the matching transport settings, TLS requiring a client
/// certificate of the cluster CA when this process has TLS material, and the authorization
/// layer ([`crate::authz`]) in front of every method.
pub type Server = tonic::transport::Server<Stack<AuthLayer, Identity>>;

/// Most concurrent streams one connection may open (a bound on what one peer can hold:
/// with the request limits, at most 256 × 4 MiB of control messages per connection).
/// A client past it waits for a stream to end; it does not fail.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;

/// A server with mutual TLS as `tls` (a client certificate of its CA required), or
/// plaintext without.
pub fn server_with(tls: Option<&TlsMaterial>) -> Result<Server, tonic::transport::Error> {
    let mut builder = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION);
    if let Some(m) = tls {
        builder = builder.tls_config(m.server_config())?;
    }
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
