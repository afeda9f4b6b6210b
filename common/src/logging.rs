//! Logging setup: `tracing` to stderr, filtered by `GRANARY_LOG` (default `info`).

/// Installs the global subscriber once; later calls are no-ops.
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GRANARY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
