//! The in-process cluster: the middle tier between unit tests and spawned binaries.
//! Masters (the real state machine, Raft and RocksDB), workers (real page stores in a
//! temporary folder) and the client library run in the test's own process and talk gRPC
//! over loopback, each node through its own [`Faults`] network, so a test places a fault
//! exactly where it hurts: a worker's heartbeats dropped, one master's answers lost after
//! it applied them, a load task to one worker refused from its third call on. The masters'
//! under-store goes through [`StoreFaults`], each worker's cache disk through its own
//! [`DiskFaults`] (page writes failing, pages lost at read).
//!
//! Faults drawn by chance follow one seed, printed at start; `GRANARY_FAULT_SEED=N` replays
//! it (the calls' order still depends on the scheduler). What only processes show — FUSE,
//! `kill -9`, TLS between processes, the store emulators — stays in the real-process tier.
//!
//! ```ignore
//! let mut c = Cluster::start(Shape { masters: 3, workers: 2, ..Shape::default() }).await?;
//! c.faults(Node::Client).add(Rule::new(Fault::Lose).method("CreateFile").times(1));
//! let fs = c.client()?;
//! ```

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use granary_client::{FileSystem, MasterClient};
use granary_common::net::{Faults, Tcp};
use granary_common::ufs::faults::StoreFaults;
use granary_common::ufs::StoreWrap;
use granary_master::{MasterConfig, RunningMaster};
use granary_worker::store::faults::DiskFaults;
use granary_worker::{RunningWorker, WorkerConfig};
use tokio_util::sync::CancellationToken;

/// A node of the cluster, to name whose calls a fault applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    Master(usize),
    Worker(usize),
    /// The client library ([`Cluster::client`]).
    Client,
}

/// How big a cluster to start, and its timings.
#[derive(Clone, Debug)]
pub struct Shape {
    pub masters: usize,
    pub workers: usize,
    /// How often workers heartbeat.
    pub heartbeat: Duration,
    /// How long a silent worker stays live.
    pub worker_timeout: Duration,
    pub cache_size: u64,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            masters: 1,
            workers: 1,
            heartbeat: Duration::from_millis(200),
            worker_timeout: Duration::from_secs(2),
            cache_size: 256 << 20,
        }
    }
}

struct Running<T> {
    node: T,
    shutdown: CancellationToken,
}

struct MasterSlot {
    id: u64,
    addr: String,
    config: MasterConfig,
    faults: Faults,
    running: Option<Running<RunningMaster>>,
}

struct WorkerSlot {
    faults: Faults,
    /// Faults of its cache disk.
    disk: Arc<DiskFaults>,
    running: Option<Running<RunningWorker>>,
}

pub struct Cluster {
    pub shape: Shape,
    /// Everything the cluster writes: `store/` (the under-store folder, mounted at
    /// `/data` by [`Cluster::mount_store`]), `m<id>/`, `w<i>/`.
    pub dir: tempfile::TempDir,
    pub store: PathBuf,
    /// Faults of the under-store as the masters see it (listings, reads, writes).
    pub store_faults: Arc<StoreFaults>,
    masters: Vec<MasterSlot>,
    workers: Vec<WorkerSlot>,
    client_faults: Faults,
}

/// Polls `f` until it returns `Some`, failing after `timeout` (no sleeps as
/// synchronisation: a deadline).
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn free_addr() -> Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.to_string())
}

impl Cluster {
    /// Starts the masters (a group when more than one) and the workers, and waits for a
    /// leader and for every worker to be registered.
    pub async fn start(shape: Shape) -> Result<Cluster> {
        let seed = Faults::from_env(Tcp::net(None)).seed();
        let dir = tempfile::tempdir()?;
        let store = dir.path().join("store");
        std::fs::create_dir_all(&store)?;
        let faults = |n: u64| Faults::new(Tcp::net(None), seed ^ n.wrapping_mul(0x9e37_79b9));
        let mut peers = BTreeMap::new();
        for id in 1..=shape.masters as u64 {
            peers.insert(id, free_addr()?);
        }
        let store_faults = Arc::new(StoreFaults::default());
        let mut masters = Vec::new();
        for (&id, addr) in &peers {
            let f = faults(id);
            let mut config =
                MasterConfig::new(dir.path().join(format!("m{id}")), addr.parse()?, f.net());
            config.id = id;
            if shape.masters > 1 {
                config.peers = peers.clone();
            }
            config.heartbeat_interval = shape.heartbeat;
            config.worker_timeout = shape.worker_timeout;
            config.mount_policy.local_roots = vec![store.clone()];
            config.mount_policy.wrap = Some(StoreWrap::faults(store_faults.clone()));
            masters.push(MasterSlot {
                id,
                addr: addr.clone(),
                config,
                faults: f,
                running: None,
            });
        }
        let mut cluster = Cluster {
            workers: (0..shape.workers)
                .map(|i| WorkerSlot {
                    faults: faults(1000 + i as u64),
                    disk: Arc::default(),
                    running: None,
                })
                .collect(),
            client_faults: faults(u64::MAX),
            shape,
            dir,
            store,
            store_faults,
            masters,
        };
        for i in 0..cluster.masters.len() {
            cluster.start_master(i).await?;
        }
        cluster.leader().await?;
        for i in 0..cluster.workers.len() {
            cluster.start_worker(i).await?;
        }
        Ok(cluster)
    }

    /// The fault rules of one node's outgoing calls.
    pub fn faults(&self, node: Node) -> &Faults {
        match node {
            Node::Master(i) => &self.masters[i].faults,
            Node::Worker(i) => &self.workers[i].faults,
            Node::Client => &self.client_faults,
        }
    }

    /// The masters' addresses, comma-separated (as clients are configured).
    pub fn master_addrs(&self) -> String {
        self.masters
            .iter()
            .map(|m| m.addr.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The fault rules of worker `i`'s cache disk (they hold across its restarts).
    pub fn disk(&self, i: usize) -> &DiskFaults {
        &self.workers[i].disk
    }

    pub fn master_addr(&self, i: usize) -> &str {
        &self.masters[i].addr
    }

    pub fn master(&self, i: usize) -> Option<&RunningMaster> {
        self.masters[i].running.as_ref().map(|r| &r.node)
    }

    pub fn worker(&self, i: usize) -> Option<&RunningWorker> {
        self.workers[i].running.as_ref().map(|r| &r.node)
    }

    /// The client library, over [`Node::Client`]'s faults.
    pub fn client(&self) -> Result<Arc<FileSystem>> {
        let master = MasterClient::new(self.client_faults.net(), &self.master_addrs())?;
        Ok(FileSystem::new(master))
    }

    /// Mounts the store folder at `/data`.
    pub async fn mount_store(&self) -> Result<()> {
        self.mount_store_with(&[]).await
    }

    /// [`Self::mount_store`] with mount options (`("sync_interval", "1s")`).
    pub async fn mount_store_with(&self, options: &[(&str, &str)]) -> Result<()> {
        let fs = self.client()?;
        let uri = format!("file://{}", self.store.display());
        let options = options
            .iter()
            .map(|(k, v)| granary_proto::MountOptionEntry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect();
        fs.master.add_mount("/data", &uri, options).await?;
        Ok(())
    }

    /// The index of the master that leads now (waits for one, up to 20 s).
    pub async fn leader(&self) -> Result<usize> {
        let masters = &self.masters;
        eventually("a leader", Duration::from_secs(20), || async move {
            masters
                .iter()
                .position(|m| m.running.as_ref().is_some_and(|r| r.node.core.is_leader()))
        })
        .await
    }

    pub async fn start_master(&mut self, i: usize) -> Result<()> {
        let slot = &mut self.masters[i];
        if slot.running.is_some() {
            return Ok(());
        }
        let shutdown = CancellationToken::new();
        let registry = granary_common::metrics::new_registry();
        let node = granary_master::start(slot.config.clone(), registry, shutdown.clone())
            .await
            .with_context(|| format!("starting master {}", slot.id))?;
        slot.running = Some(Running { node, shutdown });
        Ok(())
    }

    /// Stops a master as a clean shutdown does (its data stays; [`Cluster::start_master`]
    /// brings it back).
    pub async fn stop_master(&mut self, i: usize) -> Result<()> {
        if let Some(r) = self.masters[i].running.take() {
            r.shutdown.cancel();
            tokio::time::timeout(Duration::from_secs(20), r.node.done)
                .await
                .context("a master did not stop within 20 s")???;
        }
        Ok(())
    }

    pub async fn start_worker(&mut self, i: usize) -> Result<()> {
        let slot = &mut self.workers[i];
        if slot.running.is_some() {
            return Ok(());
        }
        let addrs: Vec<&str> = self.masters.iter().map(|m| m.addr.as_str()).collect();
        let mut config = WorkerConfig::new(
            addrs.join(","),
            "127.0.0.1:0".parse()?,
            self.dir.path().join(format!("w{i}")),
            self.shape.cache_size,
            slot.faults.net(),
        );
        config.heartbeat_interval = self.shape.heartbeat;
        config.node_name = format!("n{}", i + 1);
        config.disk_faults = Some(slot.disk.clone());
        let shutdown = CancellationToken::new();
        let registry = granary_common::metrics::new_registry();
        let node = granary_worker::start(config, registry, shutdown.clone())
            .await
            .with_context(|| format!("starting worker {i}"))?;
        let registered = node.registered.clone();
        slot.running = Some(Running { node, shutdown });
        eventually("the worker to register", Duration::from_secs(20), || {
            let r = registered.clone();
            async move { r.load(std::sync::atomic::Ordering::Relaxed).then_some(()) }
        })
        .await
    }

    pub async fn stop_worker(&mut self, i: usize) -> Result<()> {
        if let Some(r) = self.workers[i].running.take() {
            r.shutdown.cancel();
            tokio::time::timeout(Duration::from_secs(20), r.node.done)
                .await
                .context("a worker did not stop within 20 s")???;
        }
        Ok(())
    }

    /// Stops every node (workers first).
    pub async fn stop(mut self) -> Result<()> {
        for i in 0..self.workers.len() {
            self.stop_worker(i).await?;
        }
        for i in 0..self.masters.len() {
            self.stop_master(i).await?;
        }
        Ok(())
    }
}
