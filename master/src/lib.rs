//! The Granary master: unified namespace, mount table, block locations and worker
//! membership. Every namespace mutation is a command replicated through raft-rs and applied
//! to a RocksDB state machine; block locations and worker membership are soft state rebuilt
//! from worker reports.
//!
//! Invariants:
//! - a mutation is acknowledged only after its log entry is synced and it has been applied;
//! - the state machine's applied index is written atomically with each apply;
//! - metadata of mounted under-stores is loaded lazily and a failed listing changes nothing.

pub mod blocks;
pub mod core;
pub mod error;
pub mod fleet;
pub mod free;
pub mod grants;
pub mod jobs;
pub mod metrics;
pub mod mounts;
pub mod namespace;
pub mod pins;
pub mod purge;
pub mod raft;
pub mod secrets;
pub mod service;
pub mod state;
pub mod ttl;
pub mod workers;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use granary_common::metrics::SharedRegistry;
use granary_proto::master_service_server::MasterServiceServer;
use tokio_util::sync::CancellationToken;

pub use error::MasterError;

/// This master's Raft id in a single-voter group.
pub const SINGLE_NODE_ID: u64 = 1;

/// Default number of applied entries between snapshots.
pub const DEFAULT_SNAPSHOT_ENTRIES: u64 = 100_000;

#[derive(Debug, Clone)]
pub struct MasterConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// Address advertised to clients (defaults to the bound address).
    pub advertise: Option<String>,
    pub metrics_listen: Option<SocketAddr>,
    /// A worker silent this long is declared lost.
    pub worker_timeout: Duration,
    /// Interval workers are asked to heartbeat at.
    pub heartbeat_interval: Duration,
    /// Block size of files loaded from under-stores.
    pub block_size: u64,
    /// This master's Raft id.
    pub id: u64,
    /// Members of the initial group (id → address, this master included). Empty: a group of
    /// one.
    pub peers: std::collections::BTreeMap<u64, String>,
    /// Start outside the group and wait to be added (`granary master add`).
    pub join: bool,
    /// Snapshot the state and compact the log after this many applied entries.
    pub snapshot_entries: u64,
    /// Key sealing under-store credentials in the replicated state (`None`: mounts with
    /// credentials are refused).
    pub secrets: Option<Arc<secrets::SecretBox>>,
    /// Folders `file://` mounts may use and addresses store options may name
    /// (`--allow-local-root`, `--allow-endpoint`).
    pub mount_policy: mounts::MountPolicy,
    /// How this master reaches workers and the other masters (and with which identity).
    pub net: granary_common::net::Net,
}

impl MasterConfig {
    /// `net`: how this master reaches workers and the other masters, and the identity it
    /// serves with (TLS material is passed here, never held by the process).
    pub fn new(data_dir: PathBuf, listen: SocketAddr, net: granary_common::net::Net) -> Self {
        Self {
            data_dir,
            listen,
            advertise: None,
            metrics_listen: None,
            worker_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(1),
            block_size: granary_common::DEFAULT_BLOCK_SIZE,
            id: SINGLE_NODE_ID,
            peers: Default::default(),
            join: false,
            snapshot_entries: DEFAULT_SNAPSHOT_ENTRIES,
            secrets: None,
            mount_policy: mounts::MountPolicy::default(),
            net,
        }
    }
}

/// A started master.
pub struct RunningMaster {
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    pub core: Arc<core::MasterCore>,
    /// Resolves when the server has stopped (after `shutdown` fires).
    pub done: tokio::task::JoinHandle<Result<(), MasterError>>,
}

/// Creates the data directory if missing and makes it this user's alone (0700): it holds
/// the whole namespace (names, owners, mount URIs), and RocksDB writes its files readable
/// by all. A directory this user may not change (a volume owned by another) is left as
/// it is, with a warning.
fn private_data_dir(dir: &std::path::Path) -> Result<(), MasterError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|e| MasterError::Storage {
        message: format!("cannot create data directory {}: {e}", dir.display()),
    })?;
    let mode = std::fs::metadata(dir)
        .map(|m| m.permissions().mode())
        .unwrap_or(0);
    if mode & 0o077 != 0 {
        if let Err(e) = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)) {
            tracing::warn!(dir = %dir.display(), error = %e,
                "the data directory stays readable by other users (it could not be made 0700)");
        }
    }
    Ok(())
}

pub(crate) fn open_db(dir: &std::path::Path) -> Result<rocksdb::DB, MasterError> {
    std::fs::create_dir_all(dir).map_err(|e| MasterError::Storage {
        message: format!("cannot create data directory {}: {e}", dir.display()),
    })?;
    let mut opts = rocksdb::Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    // Unsynced writes (each applied entry, the commit index) stay in RocksDB's WAL buffer
    // until the Raft loop's next synced write or the end of its round
    // (`RocksLogStorage::flush_wal`): one write to the log file per round, not one per
    // applied entry. What an unsynced write may lose is as before (decision 9): a suffix,
    // which the Raft log applies again.
    opts.set_manual_wal_flush(true);
    let cfs = [
        (raft::storage::CF_RAFT, rocksdb::Options::default()),
        (state::CF_STATE, state_options()),
    ];
    rocksdb::DB::open_cf_with_opts(&opts, dir, cfs).map_err(|e| MasterError::Storage {
        message: format!("cannot open master store in {}: {e}", dir.display()),
    })
}

/// The options of the `state` column family, also those of the table files a snapshot
/// is installed from.
pub(crate) fn state_options() -> rocksdb::Options {
    // Most point reads of the state miss (is this request id applied already? does this
    // name exist yet? is this folder pinned?): whole-key Bloom filters answer those
    // without searching the memtable's skip list or reading a table's blocks. Existing
    // stores take the table filters on as they compact.
    let mut state = rocksdb::Options::default();
    let mut table = rocksdb::BlockBasedOptions::default();
    table.set_bloom_filter(10.0, false);
    table.set_whole_key_filtering(true);
    state.set_block_based_table_factory(&table);
    state.set_memtable_whole_key_filtering(true);
    state.set_memtable_prefix_bloom_ratio(0.05);
    state
}

/// Refuses a configuration no master can run with.
fn check(config: &MasterConfig) -> Result<(), MasterError> {
    if config.id == 0 {
        return Err(MasterError::invalid("master ids start at 1"));
    }
    if !config.peers.is_empty() && !config.peers.contains_key(&config.id) {
        return Err(MasterError::invalid(format!(
            "--peers must list this master's own id {} with its address",
            config.id
        )));
    }
    if !(granary_common::MIN_BLOCK_SIZE..=granary_common::MAX_BLOCK_SIZE)
        .contains(&config.block_size)
    {
        return Err(MasterError::invalid(format!(
            "--block-size must be between {} KiB and {} MiB",
            granary_common::MIN_BLOCK_SIZE >> 10,
            granary_common::MAX_BLOCK_SIZE >> 20
        )));
    }
    Ok(())
}

/// A state left broken (by an older version, or a damaged disk) is named, not fatal:
/// commands touching the broken part fail, the rest is served.
///
/// Checked on a thread of its own while the master serves: the check reads every folder
/// entry, seconds at ten million files (the restart of a 3-master group took 20 s there).
/// The state changes meanwhile, and a change between two reads of one check (a folder
/// removed while its entries were read) looks like a broken rule once; ids are never
/// reused, so a record that truly breaks a rule does so in a second check too: what is
/// reported is what both checks found. Returns the check's thread (its result: the rules
/// found broken).
fn report_broken_state(
    sm: state::StateMachine,
) -> Option<std::thread::JoinHandle<Vec<state::invariants::Violation>>> {
    let check = move || {
        let started = std::time::Instant::now();
        let twice = sm.check_invariants(false, 100).and_then(|first| {
            if first.is_empty() {
                return Ok(first);
            }
            let again = sm.check_invariants(false, 100)?;
            Ok(again.into_iter().filter(|v| first.contains(v)).collect())
        });
        let broken = match twice {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "cannot check the state's rules");
                return Vec::new();
            }
        };
        let ms = started.elapsed().as_millis() as u64;
        tracing::info!(ms, broken = broken.len(), "the state's rules were checked");
        for v in &broken {
            tracing::error!(key = %v.key, rule = %v.rule, "the master's state breaks a rule; see docs/operations.md, \"Inconsistent state\"");
        }
        if let Some(first) = broken.first() {
            eprintln!(
                "granary master: the state breaks {} rule(s) (first: {first}); serving anyway, see docs/operations.md",
                broken.len(),
            );
        }
        broken
    };
    std::thread::Builder::new()
        .name("state-check".into())
        .spawn(check)
        .map_err(|e| tracing::warn!(error = %e, "cannot start the check of the state's rules"))
        .ok()
}

/// The leader's periodic work (every half second until `shutdown`): worker expiry,
/// metrics, failed listings, jobs, pins, TTLs and the Raft entry format.
fn housekeeping(
    core: Arc<core::MasterCore>,
    master_metrics: metrics::MasterMetrics,
    shutdown: CancellationToken,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => {
                    core.sweep();
                    master_metrics.refresh(&core);
                    core.retry_failed_listings();
                    core.run_jobs();
                    core.refresh_pins();
                    core.reload_pins_once_per_term();
                    core.expire_ttls();
                    core.adopt_entry_format();
                }
            }
        }
    });
}

/// The group a new master's log starts with: none when it joins a running group (it is
/// added), itself alone, or the configured peers.
fn initial_voters(config: &MasterConfig) -> Vec<u64> {
    if config.join {
        Vec::new()
    } else if config.peers.is_empty() {
        vec![config.id]
    } else {
        config.peers.keys().copied().collect()
    }
}

/// The masters' addresses by id: the configured peers, those the state records, and this
/// master at `address`.
fn peers_of(
    config: &MasterConfig,
    sm: &state::StateMachine,
    address: &str,
) -> Result<raft::transport::Peers, MasterError> {
    let mut peer_map = config.peers.clone();
    for (id, a) in sm.member_addresses()? {
        peer_map.entry(id).or_insert(a);
    }
    peer_map
        .entry(config.id)
        .or_insert_with(|| address.to_string());
    Ok(Arc::new(std::sync::RwLock::new(peer_map)))
}

/// Serves `/metrics` and readiness on `a`: ready while this master is part of a group
/// with a known leader (a quorum answered).
async fn serve_metrics(
    a: SocketAddr,
    registry: SharedRegistry,
    raft: &raft::node::RaftHandle,
    shutdown: CancellationToken,
) -> Result<SocketAddr, MasterError> {
    let status = raft.status.clone();
    let ready = std::sync::Arc::new(move || {
        match status.leader_id.load(std::sync::atomic::Ordering::Relaxed) {
            0 => Err("no leader known: this master is not in a quorum (yet)".into()),
            _ => Ok(()),
        }
    });
    granary_common::metrics::serve_with(a, registry, shutdown, ready)
        .await
        .map_err(|e| MasterError::Unavailable {
            message: format!("cannot serve metrics on {a}: {e}"),
        })
}

/// Opens the store, starts Raft, binds the gRPC (and metrics) listeners and serves until
/// `shutdown` is cancelled.
pub async fn start(
    config: MasterConfig,
    registry: SharedRegistry,
    shutdown: CancellationToken,
) -> Result<RunningMaster, MasterError> {
    check(&config)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| MasterError::Unavailable {
            message: format!("cannot listen on {}: {e}", config.listen),
        })?;
    let addr = listener
        .local_addr()
        .map_err(|e| MasterError::Unavailable {
            message: e.to_string(),
        })?;
    let address = config
        .advertise
        .clone()
        .or_else(|| config.peers.get(&config.id).cloned())
        .unwrap_or_else(|| addr.to_string());

    private_data_dir(&config.data_dir)?;
    let db = Arc::new(open_db(&config.data_dir.join("meta"))?);
    let log = raft::storage::RocksLogStorage::open(db.clone(), &initial_voters(&config))?;
    let snapshots = raft::snapshot::SnapshotDir::open(config.data_dir.join("snapshots"))?;
    // A snapshot install that a stop interrupted left the state part old, part new.
    raft::snapshot::finish_install(&log, &snapshots)?;
    let sm = state::StateMachine::open(db.clone())?;
    report_broken_state(sm.clone());
    let peers = peers_of(&config, &sm, &address)?;
    let chan = raft::node::channel();
    let transport = raft::transport::GrpcTransport::new(
        config.id,
        tokio::runtime::Handle::current(),
        peers.clone(),
        raft::node::feedback_fn(&chan.0),
        snapshots.clone(),
        config.net.clone(),
    );
    let (raft_handle, raft_join) = raft::node::start(
        raft::node::NodeConfig {
            id: config.id,
            snapshot_entries: config.snapshot_entries.max(1),
            snapshots: snapshots.clone(),
            keep_entries: (config.snapshot_entries / 4).min(10_000),
        },
        log,
        sm.clone(),
        peers,
        Box::new(transport),
        chan,
    )?;

    let ufs = Arc::new(
        mounts::UfsCache::new(config.secrets.clone()).with_policy(config.mount_policy.clone()),
    );
    let blocks = Arc::new(blocks::BlockLocations::default());
    let core = Arc::new(core::MasterCore::new(core::Parts {
        id: config.id,
        address: address.clone(),
        ns: namespace::Namespace::new(
            sm,
            raft_handle.clone(),
            ufs,
            config.block_size,
            blocks.clone(),
        ),
        raft: raft_handle.clone(),
        fleet: fleet::Fleet::new(blocks, config.worker_timeout, config.heartbeat_interval),
        net: config.net.clone(),
        grants: match config.net.tls() {
            Some(_) => Some(Arc::new(grants::Grants::new()?)),
            None => None,
        },
    }));

    hook_relister(&core);
    let master_metrics = metrics::MasterMetrics::register(&registry);
    core.namespace().metrics.register(&registry);
    if let Ok(mut r) = registry.lock() {
        r.register(
            "granary_master_load_retries",
            "Block loads of jobs tried again after a failure that may pass (store or worker unreachable, cache full); gone, changed or refused objects are not tried again",
            core.job_runner().retries.clone(),
        );
    }
    let metrics_addr = match config.metrics_listen {
        Some(a) => Some(serve_metrics(a, registry, &raft_handle, shutdown.clone()).await?),
        None => None,
    };

    housekeeping(core.clone(), master_metrics, shutdown.clone());
    grants::keep_leader_key(&core, shutdown.clone());

    // Request messages limited per method (granary_common::authz: control methods small).
    let rpc = Arc::new(service::MasterRpc::new(core.clone(), shutdown.clone()));
    let svc = granary_common::grpc::per_method_limits(|limit| {
        MasterServiceServer::from_arc(rpc.clone())
            .max_decoding_message_size(limit)
            .max_encoding_message_size(granary_proto::MAX_MESSAGE_BYTES)
    });
    let raft_rpc = Arc::new(raft::service::RaftRpc {
        raft: raft_handle.clone(),
        snapshots,
        address,
        grants: core.grants().cloned(),
        shutdown: shutdown.clone(),
    });
    let raft_svc = granary_common::grpc::per_method_limits(|limit| {
        granary_proto::raft_service_server::RaftServiceServer::from_arc(raft_rpc.clone())
            .max_decoding_message_size(limit)
            .max_encoding_message_size(granary_proto::MAX_MESSAGE_BYTES)
    });
    let mut server =
        granary_common::grpc::server_with(config.net.tls().map(|m| &**m)).map_err(|e| {
            MasterError::Unavailable {
                message: format!("TLS setup of the master server: {e}"),
            }
        })?;
    let (sd, tls) = (shutdown.clone(), config.net.tls().cloned());
    let done = tokio::spawn(async move {
        let router = server.add_service(svc).add_service(raft_svc);
        let served = granary_common::grpc::serve(router, listener, tls, sd).await;
        raft_handle.shutdown();
        let _ = tokio::task::spawn_blocking(move || raft_join.join()).await;
        drop(db);
        served.map_err(|e| MasterError::Unavailable {
            message: format!("master server failed: {e}"),
        })
    });
    tracing::info!(%addr, id = config.id, data_dir = %config.data_dir.display(), "master serving");
    Ok(RunningMaster {
        addr,
        metrics_addr,
        core,
        done,
    })
}

/// Due re-listings of loaded folders run on tasks of their own, holding the core only while
/// they list (a stopped master's core is not kept alive by this hook).
fn hook_relister(core: &Arc<core::MasterCore>) {
    let weak = Arc::downgrade(core);
    core.namespace().set_relister(Box::new(move |dir| {
        let Some(core) = weak.upgrade() else {
            return false;
        };
        tokio::spawn(async move { core.namespace().relist(dir).await });
        true
    }));
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// Found by a review: the data directory was made with the umask (0755) and RocksDB's
    /// files are 0644, so any local user read the whole namespace.
    #[test]
    fn the_data_directory_is_this_users_alone() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let fresh = d.path().join("new/data");
        private_data_dir(&fresh).unwrap();
        assert_eq!(mode(&fresh), 0o700);
        let old = d.path().join("old");
        std::fs::create_dir(&old).unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_data_dir(&old).unwrap();
        assert_eq!(mode(&old), 0o700);
    }

    #[test]
    fn a_broken_state_is_reported_from_a_thread_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(open_db(dir.path()).unwrap());
        let sm = state::StateMachine::open(db.clone()).unwrap();
        state::tests::mkdir_at(&sm, 1, "/a/b");
        let check = |sm: &state::StateMachine| report_broken_state(sm.clone()).unwrap().join();
        assert!(check(&sm).unwrap().is_empty());
        // The folder above `b` lost its record (a damaged disk): `b`'s entry names a
        // parent that does not exist.
        let a = sm.resolve_loaded("/a").unwrap().unwrap();
        let cf = db.cf_handle(state::CF_STATE).unwrap();
        db.delete_cf(cf, state::keys::inode(a.id)).unwrap();
        let sm = state::StateMachine::open(db.clone()).unwrap();
        let broken = check(&sm).unwrap();
        assert_eq!(broken.len(), 1, "{broken:?}");
        assert!(
            broken[0]
                .rule
                .contains(&format!("an entry of inode {}", a.id)),
            "{broken:?}"
        );
    }
}
