//! Serves a `prometheus_client` registry as `/metrics` in Prometheus text format.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

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
    tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "metrics server failed");
        }
    });
    Ok(local)
}
