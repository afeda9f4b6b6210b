//! Serves a `prometheus_client` registry as `/metrics` in Prometheus text format.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::{routing::get, Router};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// A registry shared between the components of one process.
pub type SharedRegistry = Arc<Mutex<Registry>>;

pub fn new_registry() -> SharedRegistry {
    Arc::new(Mutex::new(Registry::default()))
}

/// Renders the registry in Prometheus text format.
pub fn render(registry: &SharedRegistry) -> String {
    let mut out = String::new();
    let guard = match registry.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    };
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &guard) {
        tracing::error!(error = %e, "encoding metrics failed");
    }
    out
}

/// Whether the process can do its job now (`Err`: why not), for `/ready`.
pub type Readiness = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Binds `addr` and serves `/metrics` until `shutdown` fires. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    registry: SharedRegistry,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    serve_with(addr, registry, shutdown, Arc::new(|| Ok(()))).await
}

/// [`serve`], plus `/healthz` (200 while the process serves HTTP: a liveness probe) and
/// `/ready` (200 `ready`, or 503 with the reason: a readiness probe).
pub async fn serve_with(
    addr: SocketAddr,
    registry: SharedRegistry,
    shutdown: CancellationToken,
    ready: Readiness,
) -> std::io::Result<SocketAddr> {
    use axum::http::StatusCode;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/ready",
            get(move || {
                let ready = ready.clone();
                async move {
                    match ready() {
                        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    (
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        render(&registry),
                    )
                }
            }),
        );
    tokio::spawn(accept(listener, app, shutdown));
    Ok(local)
}

/// Connections served at once, all peers together: the port takes no certificate, so
/// what anyone who reaches it may hold is bounded (at most 16 MiB of heads), and far
/// more than a few addresses' shares, so that probes and the scraper find room.
const MAX_CONNECTIONS: usize = 1024;
/// Connections served at once from one address: a peer that fills its share leaves
/// room for the kubelet's probes and the scraper.
const MAX_PER_PEER: usize = 8;
/// How long a request's head may take to arrive (a connection that sends nothing, or
/// sends slowly, is closed).
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection lives, however busy (a scraper connects again).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// The most a connection buffers of a request's head.
const MAX_HEAD_BYTES: usize = 16 << 10;

/// Serves connections until `shutdown` fires, within the bounds above: before, each
/// connection was held for as long as its peer liked with up to ~400 KiB buffered, and
/// thousands of idle ones ran the process out of memory or descriptors.
async fn accept(listener: tokio::net::TcpListener, app: Router, shutdown: CancellationToken) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let peers: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, for example: try again soon, never spin.
                    tracing::warn!(error = %e, "metrics server: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue; // closed at once: every slot is taken
        };
        let Some(share) = PeerShare::take(&peers, peer.ip()) else {
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let _held = (slot, share);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                _ = conn => {}
                _ = tokio::time::sleep(CONNECTION_LIFETIME) => {}
                _ = shutdown.cancelled() => {}
            }
        });
    }
}

/// One connection counted against its peer's share until dropped.
struct PeerShare {
    peers: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl PeerShare {
    fn take(peers: &Arc<Mutex<HashMap<IpAddr, usize>>>, ip: IpAddr) -> Option<Self> {
        let mut map = peers.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_default();
        if *n >= MAX_PER_PEER {
            return None;
        }
        *n += 1;
        Some(Self {
            peers: peers.clone(),
            ip,
        })
    }
}

impl Drop for PeerShare {
    fn drop(&mut self) {
        let mut map = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpSocket, TcpStream};

    /// A connection to `to` from the loopback address `src` (all of 127/8 is this host).
    async fn connect_from(src: &str, to: SocketAddr) -> TcpStream {
        let s = TcpSocket::new_v4().unwrap();
        s.bind(format!("{src}:0").parse().unwrap()).unwrap();
        s.connect(to).await.unwrap()
    }

    /// Whether the server ends `c` (closes it, resets it or answers and closes) within
    /// `within`.
    async fn ended(c: &mut TcpStream, within: Duration) -> bool {
        let mut buf = vec![0u8; 4096];
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, c.read(&mut buf)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => {}
            }
        }
    }

    /// Found by a review: the port takes no certificate, and each connection was held as
    /// long as its peer liked with ~400 KiB of head buffered: thousands of idle ones ran a
    /// master, a worker or a mount out of memory or descriptors. Now one peer's idle
    /// connections hold at most its share for at most the head timeout, a head past the
    /// buffer is refused, and another peer's probe is answered meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_peer_holds_the_metrics_port() {
        let shutdown = CancellationToken::new();
        let addr = serve(
            "127.0.0.1:0".parse().unwrap(),
            new_registry(),
            shutdown.clone(),
        )
        .await
        .unwrap();
        let mut idle = Vec::new();
        for _ in 0..100 {
            idle.push(connect_from("127.0.0.2", addr).await);
        }
        let mut probe = connect_from("127.0.0.1", addr).await;
        probe
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), probe.read_to_string(&mut answer))
            .await
            .expect("the probe is answered while another peer holds connections")
            .unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok\n"),
            "{answer}"
        );
        // Past its share at once, the rest once the head timeout passes.
        for (i, c) in idle.iter_mut().enumerate() {
            assert!(
                ended(c, HEAD_TIMEOUT + Duration::from_secs(5)).await,
                "connection {i}"
            );
        }
        let mut long = connect_from("127.0.0.3", addr).await;
        let _ = long.write_all(b"GET /metrics HTTP/1.1\r\nX-Long: ").await;
        let _ = long.write_all(&vec![b'a'; 4 * MAX_HEAD_BYTES]).await;
        assert!(
            ended(&mut long, Duration::from_secs(2)).await,
            "a head past the buffer"
        );
        shutdown.cancel();
    }
}
