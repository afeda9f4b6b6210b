//! The Granary worker: caches pages of blocks on local disk, fills misses read-through from
//! the under-store (one fetch per page however many readers miss it), serves reads over gRPC,
//! and reports what it holds to the master.
//!
//! Invariants: cached bytes never exceed `--cache-size` (space is reserved before a page is
//! admitted; a full cache serves without caching); a page failing its CRC32C is never served;
//! the cache survives a restart (the index is reloaded at start).

pub mod dataplane;
pub mod error;
pub mod evict;
pub mod heartbeat;
pub mod metrics;
pub mod service;
pub mod store;
pub mod ufs_fetch;
pub mod writes;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use granary_client::MasterClient;
use granary_common::metrics::SharedRegistry;
use granary_proto::worker_service_server::WorkerServiceServer;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("worker server failed: {0}")]
    Serve(String),
}

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub master: String,
    pub listen: SocketAddr,
    /// Address given to the master for clients to reach (defaults to the bound address).
    pub advertise: Option<String>,
    /// The worker's id file, and its cache when no tiers are given.
    pub cache_dir: PathBuf,
    /// Capacity of the single tier in `cache_dir` (ignored when `tiers` are given).
    pub cache_size: u64,
    /// Cache tiers (`--tier`); empty: one `ssd` tier in `cache_dir` of `cache_size`.
    pub tiers: Vec<store::TierSpec>,
    pub page_size: u64,
    pub metrics_listen: Option<SocketAddr>,
    pub heartbeat_interval: Duration,
    /// Eviction policy of the page cache.
    pub eviction: evict::PolicyKind,
    /// The node reported to the master (clients on the same node read block files
    /// directly).
    pub node_name: String,
    /// Keep node copies of blocks other workers own for clients on this node that ask
    /// (`--locality node`, the default; `cluster` refuses them).
    pub node_copies: bool,
    /// Serve the block data plane here (`--data-listen`; mutual TLS where the worker has
    /// TLS, plain TCP where it has not).
    pub data_listen: Option<SocketAddr>,
    /// How the worker reaches the masters and its peers, and the identity it serves with.
    pub net: granary_common::net::Net,
    /// Faults of the cache disk, for in-process tests (`None`: the disk as it is).
    pub disk_faults: Option<Arc<store::faults::DiskFaults>>,
}

impl WorkerConfig {
    /// `net`: how the worker reaches the masters and its peers, and the identity it serves
    /// with.
    pub fn new(
        master: String,
        listen: SocketAddr,
        cache_dir: PathBuf,
        cache_size: u64,
        net: granary_common::net::Net,
    ) -> Self {
        Self {
            master,
            listen,
            advertise: None,
            cache_dir,
            cache_size,
            tiers: Vec::new(),
            page_size: granary_common::DEFAULT_PAGE_SIZE,
            metrics_listen: None,
            heartbeat_interval: Duration::from_secs(1),
            eviction: evict::PolicyKind::default(),
            node_name: granary_common::node_name(),
            node_copies: true,
            data_listen: None,
            net,
            disk_faults: None,
        }
    }

    pub fn validate(&self) -> Result<(), WorkerError> {
        if self.page_size == 0 || self.page_size > 64 * 1024 * 1024 {
            return Err(WorkerError::Config(format!(
                "page size {} must be between 1 byte and 64 MiB",
                self.page_size
            )));
        }
        if !self.tiers.is_empty() {
            return store::tiers::validate_tiers(&self.tiers, self.page_size)
                .map_err(WorkerError::Config);
        }
        if self.cache_size < self.page_size {
            return Err(WorkerError::Config(format!(
                "cache size {} is smaller than one page ({} bytes)",
                self.cache_size, self.page_size
            )));
        }
        Ok(())
    }

    /// The tiers this configuration asks for.
    pub fn tier_specs(&self) -> Vec<store::TierSpec> {
        if self.tiers.is_empty() {
            vec![store::TierSpec {
                kind: store::TierKind::Ssd,
                dir: Some(self.cache_dir.clone()),
                size: self.cache_size,
            }]
        } else {
            self.tiers.clone()
        }
    }
}

pub struct RunningWorker {
    pub addr: SocketAddr,
    pub worker_id: u64,
    pub metrics_addr: Option<SocketAddr>,
    pub store: Arc<dyn store::BlockStore>,
    pub metrics: metrics::WorkerMetrics,
    pub registered: Arc<AtomicBool>,
    pub done: tokio::task::JoinHandle<Result<(), WorkerError>>,
}

/// The block data plane's listener (`--data-listen`) and the address it is advertised at:
/// the host clients reach the worker at, with the data port (empty: no data plane).
async fn bind_data_plane(
    config: &WorkerConfig,
    addr: SocketAddr,
    advertise: &str,
) -> Result<(Option<tokio::net::TcpListener>, String), WorkerError> {
    let Some(a) = config.data_listen else {
        return Ok((None, String::new()));
    };
    let l = tokio::net::TcpListener::bind(a)
        .await
        .map_err(|source| WorkerError::Listen { addr: a, source })?;
    let port = l
        .local_addr()
        .map_err(|source| WorkerError::Listen { addr, source })?
        .port();
    let host = advertise.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
    Ok((Some(l), format!("{host}:{port}")))
}

/// Serves the block data plane on `l` (mutual TLS when the worker has an identity).
fn serve_data_plane(
    config: &WorkerConfig,
    l: tokio::net::TcpListener,
    data_address: &str,
    rpc: Arc<service::WorkerRpc>,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let tls = config.net.tls().cloned();
    let how = if tls.is_some() {
        "mutual TLS"
    } else {
        "plain TCP"
    };
    tracing::info!(address = %data_address, "block data plane serving ({how})");
    tokio::spawn(dataplane::serve(l, rpc, tls, shutdown));
    Ok(())
}

/// Opens the cache, binds the listeners, starts heartbeating and serves until `shutdown`.
pub async fn start(
    config: WorkerConfig,
    registry: SharedRegistry,
    shutdown: CancellationToken,
) -> Result<RunningWorker, WorkerError> {
    config.validate()?;
    let metrics = metrics::WorkerMetrics::register(&registry);
    let worker_id = store::worker_id(&config.cache_dir)?;
    let store = tokio::task::spawn_blocking({
        let specs = config.tier_specs();
        let mem_dir = PathBuf::from(format!("/dev/shm/granary-{worker_id}"));
        let m = metrics.clone();
        let (ps, policy) = (config.page_size, config.eviction);
        move || store::TieredStore::open(&specs, &mem_dir, ps, policy, m)
    })
    .await
    .map_err(|e| WorkerError::Config(format!("opening the cache panicked: {e}")))??;
    let store: Arc<dyn store::BlockStore> = match &config.disk_faults {
        Some(f) => store::faults::FaultyStore::wrap(store, f.clone()),
        None => store,
    };
    metrics.cache_capacity_bytes.set(store.capacity() as i64);

    let master = MasterClient::new(config.net.clone(), &config.master)
        .map_err(|e| WorkerError::Config(e.to_string()))?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| WorkerError::Listen {
            addr: config.listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| WorkerError::Listen {
            addr: config.listen,
            source,
        })?;
    let advertise = config.advertise.clone().unwrap_or_else(|| {
        if addr.ip().is_unspecified() {
            format!("127.0.0.1:{}", addr.port())
        } else {
            addr.to_string()
        }
    });
    let registered = Arc::new(AtomicBool::new(false));
    let metrics_addr = match config.metrics_listen {
        Some(a) => Some(
            granary_common::metrics::serve_with(a, registry.clone(), shutdown.clone(), {
                // Ready once registered with the leader (clients are then sent here).
                let registered = registered.clone();
                Arc::new(
                    move || match registered.load(std::sync::atomic::Ordering::Relaxed) {
                        true => Ok(()),
                        false => Err("not registered with a master (yet)".into()),
                    },
                )
            })
            .await
            .map_err(|source| WorkerError::Listen { addr: a, source })?,
        ),
        None => None,
    };

    let fetcher = Arc::new(
        ufs_fetch::Fetcher::new(master.clone(), store.clone(), metrics.clone())
            .with_worker_id(worker_id),
    );
    let writes = writes::Writes::open(
        &config.cache_dir,
        fetcher.clone(),
        master.clone(),
        metrics.clone(),
        worker_id,
    )
    .map_err(|e| WorkerError::Config(format!("cannot open the write journal: {e}")))?;
    let resumed = writes.resume();
    if resumed > 0 {
        tracing::info!(
            files = resumed,
            "resuming uploads of files written async-through"
        );
    }
    let (data_listener, data_address) = bind_data_plane(&config, addr, &advertise).await?;
    // With TLS the masters sign grants: a node's grant-less fill or write is refused from
    // the start, not only once the first key has come with a registration.
    let grant_keys = Arc::new(if config.net.tls().is_some() {
        granary_common::grant::GrantKeys::expected()
    } else {
        granary_common::grant::GrantKeys::default()
    });
    let hb = heartbeat::Heartbeat {
        master,
        store: store.clone(),
        metrics: metrics.clone(),
        worker_id,
        address: advertise.clone(),
        data_address: data_address.clone(),
        host: config.node_name.clone(),
        interval: config.heartbeat_interval,
        grant_keys: grant_keys.clone(),
        fetcher: fetcher.clone(),
    };
    tokio::spawn(hb.run(shutdown.clone(), registered.clone()));

    // Request messages limited per method (granary_common::authz: control methods small).
    let rpc = Arc::new(service::WorkerRpc {
        worker_id,
        fetcher,
        metrics: metrics.clone(),
        writes,
        grant_keys,
        node_copies: config.node_copies,
    });
    if let Some(l) = data_listener {
        serve_data_plane(&config, l, &data_address, rpc.clone(), shutdown.clone())?;
    }
    let svc = granary_common::grpc::per_method_limits(|limit| {
        WorkerServiceServer::from_arc(rpc.clone())
            .max_decoding_message_size(limit)
            .max_encoding_message_size(granary_proto::MAX_MESSAGE_BYTES)
    });
    let mut server = granary_common::grpc::server_with(config.net.tls().map(|m| &**m))
        .map_err(|e| WorkerError::Serve(format!("TLS setup of the worker server: {e}")))?;
    let (sd, tls) = (shutdown.clone(), config.net.tls().cloned());
    let done = tokio::spawn(async move {
        granary_common::grpc::serve(server.add_service(svc), listener, tls, sd)
            .await
            .map_err(|e| WorkerError::Serve(e.to_string()))
    });
    let tiers: Vec<String> = store
        .tiers()
        .iter()
        .map(|t| format!("{}={}", t.tier, t.capacity))
        .collect();
    tracing::info!(%addr, worker = worker_id, cache_dir = %config.cache_dir.display(), capacity = store.capacity(), tiers = %tiers.join(","), "worker serving");
    Ok(RunningWorker {
        addr,
        worker_id,
        metrics_addr,
        store,
        metrics,
        registered,
        done,
    })
}
