//! gRPC channel and server settings shared by every hop, tuned for bulk block streams.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use tower::layer::util::{Identity, Stack};

use crate::authz::AuthLayer;

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

/// Normalises `host:port` or a full URI into an endpoint URI: `https://` when this process
/// uses TLS ([`crate::tls::install`]), else `http://`.
pub fn endpoint_uri(addr: &str) -> String {
    let host_port = addr
        .strip_prefix("http://")
        .or_else(|| addr.strip_prefix("https://"))
        .unwrap_or(addr);
    match crate::tls::material() {
        Some(_) => format!("https://{host_port}"),
        None => format!("http://{host_port}"),
    }
}

/// A lazily connecting channel to `addr` with Granary's transport settings (mutual TLS
/// when this process has TLS material).
pub fn channel(addr: &str) -> Result<Channel, tonic::transport::Error> {
    let mut endpoint = Endpoint::from_shared(endpoint_uri(addr))?;
    if let Some(m) = crate::tls::material() {
        endpoint = endpoint.tls_config(m.client_config())?;
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

/// Most concurrent streams one connection may open (a bound on what one peer can hold).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;

pub fn server() -> Result<Server, tonic::transport::Error> {
    let mut builder = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION);
    if let Some(m) = crate::tls::material() {
        builder = builder.tls_config(m.server_config())?;
    }
    Ok(builder.layer(AuthLayer::default()))
}

/// Accepted connections of a bound listener, with Nagle off (a server given its own
/// listener does not apply `Server::tcp_nodelay`; small replies would wait ~40 ms for ACKs).
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)))
}
