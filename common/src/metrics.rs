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

/// Binds `addr` and serves `/metrics` until `shutdown` fires. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    registry: SharedRegistry,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = Router::new().route(
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
