//! The command line. Every flag can also be set through a `GRANARY_*` environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

fn size(s: &str) -> Result<u64, String> {
    granary_common::size::parse_size(s).map_err(|e| e.to_string())
}

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("invalid duration {s:?} ({e}); use e.g. 500ms, 1s, 2m"))
}

/// Granary: a cluster-wide caching filesystem for AI training data.
#[derive(Debug, Parser)]
#[command(name = "granary", version, about, long_about = None, after_help = "\
Examples:
  granary local --ufs ~/datasets --mount /mnt/granary     one process over a folder
  granary master --data-dir /var/lib/granary --listen 0.0.0.0:19998
  granary master --id 1 --peers 1=m1:19998,2=m2:19998,3=m3:19998 --data-dir /var/lib/granary --listen 0.0.0.0:19998
  granary master list --master m1:19998,m2:19998,m3:19998
  granary worker --master m1:19998 --listen 0.0.0.0:29999 --cache-dir /nvme/granary --cache-size 500GiB
  granary fuse --master m1:19998 --mount /mnt/granary
  granary mount add /datasets/imagenet file:///data/imagenet
  granary fs ls /datasets
  granary report")]
pub struct Cli {
    /// TOML file with defaults for the flags ([master], [worker], [fuse], [local] tables;
    /// top-level keys apply to every command). Command line and GRANARY_* variables win.
    #[arg(long, global = true, env = "GRANARY_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// How this process secures its gRPC connections. Every command needs TLS material or an
/// explicit --insecure (except `granary local`, which makes its own, and `granary cert`).
#[derive(Debug, Args, Clone, Default)]
pub struct TlsArgs {
    /// Folder with this process's TLS material: ca.crt (the cluster CA), tls.crt and tls.key
    /// (its certificate and key) — the layout of `granary cert issue --out` and of a
    /// Kubernetes TLS Secret.
    #[arg(long, global = true, env = "GRANARY_TLS_DIR", value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// The cluster CA's certificate (PEM) [default: DIR/ca.crt].
    #[arg(long, global = true, env = "GRANARY_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM) [default: DIR/tls.crt].
    #[arg(long, global = true, env = "GRANARY_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// This process's private key (PEM) [default: DIR/tls.key].
    #[arg(long, global = true, env = "GRANARY_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Plaintext gRPC with no identities: anyone who reaches a port may do anything. Only
    /// for a trusted, isolated network.
    #[arg(
        long,
        global = true,
        env = "GRANARY_INSECURE",
        value_parser = clap::builder::FalseyValueParser::new()
    )]
    pub insecure: bool,
    /// How often a server (master, worker, mount) reads its TLS files again: a renewed
    /// certificate, key or CA written over them (cert-manager renewing a Secret) is used for
    /// every connection made or accepted after that, without a restart [default: 1m].
    #[arg(long, global = true, env = "GRANARY_TLS_RELOAD_EVERY", value_parser = reload_every, value_name = "DURATION")]
    pub tls_reload_every: Option<Duration>,
}

fn reload_every(s: &str) -> Result<Duration, String> {
    let d = duration(s)?;
    if d < Duration::from_millis(100) {
        return Err(format!(
            "{s:?} is too short; read the TLS files again every 100ms or more"
        ));
    }
    Ok(d)
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run master, worker and FUSE mount in one process over a folder or URI.
    #[command(
        after_help = "Examples:\n  granary local --ufs ./data --mount /tmp/granary\n  granary local --ufs /data --mount /mnt/g --cache-dir /nvme/g --cache-size 200GiB --metrics-listen 127.0.0.1:9464"
    )]
    Local(LocalArgs),
    /// Run a master, or manage the master group (list, add, remove).
    #[command(
        args_conflicts_with_subcommands = true,
        subcommand_negates_reqs = true,
        after_help = "Examples:\n  granary master --data-dir /var/lib/granary/master --listen 0.0.0.0:19998 --metrics-listen 0.0.0.0:9464\n  granary master --id 2 --peers 1=10.0.0.1:19998,2=10.0.0.2:19998,3=10.0.0.3:19998 \\\n      --data-dir /var/lib/granary/master --listen 0.0.0.0:19998\n  granary master list --master 10.0.0.1:19998,10.0.0.2:19998,10.0.0.3:19998\n  granary master add 4 10.0.0.4:19998 --master 10.0.0.1:19998"
    )]
    Master(MasterArgs),
    /// Benchmarks against a running cluster.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Run a caching worker, or manage workers (decommission, recommission).
    #[command(
        args_conflicts_with_subcommands = true,
        subcommand_negates_reqs = true,
        after_help = "Examples:\n  granary worker --master 10.0.0.1:19998 --listen 0.0.0.0:29999 --advertise 10.0.0.7:29999 \\\n      --cache-dir /nvme/granary --cache-size 500GiB\n  granary worker decommission 7 --master 10.0.0.1:19998\n  granary worker recommission 7 --master 10.0.0.1:19998"
    )]
    Worker(WorkerArgs),
    /// Mount the namespace with FUSE (reads, and sequential writes of new files).
    #[command(
        after_help = "Examples:\n  granary fuse --master 10.0.0.1:19998 --mount /mnt/granary\n  granary fuse --master 10.0.0.1:19998 --mount /mnt/ckpt --write-mode async-through --async-replicas 2\n  granary fuse --master 10.0.0.1:19998 --mount /mnt/data --read-only"
    )]
    Fuse(FuseArgs),
    /// Serve the Kubernetes CSI node plugin: pods' volumes are folders of this node's
    /// `granary fuse` mount, bound into each pod (docs/kubernetes.md, "Volumes for pods").
    #[command(
        after_help = "Volume attributes: path (the Granary folder, required), readOnly (true|false),\nwriteMode (must be the node mount's, see --write-mode).\n\nExamples:\n  granary csi --endpoint unix:///csi/csi.sock --mount /mnt/granary\n  CSI_ENDPOINT=unix:///csi/csi.sock granary csi --mount /mnt/granary --write-mode async-through"
    )]
    Csi(CsiArgs),
    /// Manage under-store mounts.
    #[command(subcommand)]
    Mount(MountCommand),
    /// Browse the namespace.
    #[command(subcommand)]
    Fs(FsCommand),
    /// Show the cluster: masters, workers, capacity, cache hits and misses.
    #[command(after_help = "Examples:\n  granary report\n  granary report --json | jq .hit_ratio")]
    Report(ReportArgs),
    /// Cache a file or a folder cluster-wide before it is read (a job run by the masters).
    #[command(
        after_help = "The masters split the work into tasks for the workers that own the blocks, retry\nfailures and keep the job's state replicated: it survives a master failover. Without\n--detach the progress is shown until every byte is cached (Ctrl-C detaches; the job\nkeeps running). Exit status 0 only when every file was cached.\n\nExamples:\n  granary load /datasets/imagenet\n  granary load /datasets/imagenet/train --replicas 2\n  granary load /datasets/laion --detach && granary job status 1 --watch"
    )]
    Load(LoadArgs),
    /// Follow, list and cancel jobs (granary load).
    #[command(subcommand)]
    Job(JobCommand),
    /// Keep a file or folder cached: loaded onto N workers, never evicted, re-replicated
    /// when a worker is lost.
    #[command(
        after_help = "Pinning starts a load of the path (followed like granary load unless --detach). Files\nadded later under a pinned folder are pinned once listed. `granary fs ls` marks\npinned entries; `granary unpin` makes them evictable again (nothing is dropped).\n\nExamples:\n  granary pin /datasets/imagenet/val\n  granary pin /models/llama --replicas 3 --detach\n  granary unpin /datasets/imagenet/val"
    )]
    Pin(LoadArgs),
    /// Drop the cached copies of a file or folder on every worker (the under-store keeps
    /// the data; the next read fetches it again).
    #[command(
        after_help = "Refuses pinned data (unpin it first) and files not in the under-store yet (written\nthrough Granary, upload pending) unless --force, which loses them. Workers drop the\npages at their next heartbeat.\n\nExamples:\n  granary free /datasets/old-run/shard-0001.tar\n  granary free -R /datasets/old-run"
    )]
    Free {
        /// File or folder (Granary path).
        path: String,
        /// Free everything below a folder.
        #[arg(short = 'R', long)]
        recursive: bool,
        /// Also free files whose only copies are cached (they are lost).
        #[arg(long)]
        force: bool,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Expire a file or folder after a while: free its cached copies, or delete it.
    #[command(subcommand)]
    Ttl(TtlCommand),
    /// Create the cluster CA and issue certificates for masters, workers, mounts and admins.
    #[command(subcommand)]
    Cert(CertCommand),
    /// Undo granary pin: the path's pages become evictable again (nothing is dropped).
    #[command(after_help = "Examples:\n  granary unpin /datasets/imagenet/val")]
    Unpin {
        /// The pinned file or folder.
        path: String,
        #[command(flatten)]
        master: MasterAddr,
    },
}

#[derive(Debug, Subcommand)]
pub enum CertCommand {
    /// Create a cluster CA: CA-DIR/ca.crt and CA-DIR/ca.key (keep the key offline or in a
    /// Secret only `granary cert issue` reads).
    #[command(
        after_help = "Examples:\n  granary cert init --ca-dir /etc/granary/ca\n  granary cert init --ca-dir ./ca --days 1825 --name \"ml-cluster CA\""
    )]
    Init {
        /// Where to write ca.crt and ca.key.
        #[arg(long, value_name = "DIR")]
        ca_dir: PathBuf,
        /// Validity of the CA in days.
        #[arg(long, default_value_t = 3650, value_parser = clap::value_parser!(u32).range(1..=36500))]
        days: u32,
        /// The CA's common name.
        #[arg(long, default_value = "Granary cluster CA")]
        name: String,
        /// Replace an existing CA (every certificate it issued stops working).
        #[arg(long)]
        force: bool,
    },
    /// Issue a certificate and key signed by the cluster CA into OUT (ca.crt, tls.crt,
    /// tls.key), ready for --tls-dir.
    #[command(
        after_help = "Roles: master (a master; --master-id names which, its --id), node (workers, and\nmounts on a GPU node that may read under-stores themselves), admin (mounts, jobs,\nmembership), user (namespace reads and writes; --subtree limits it to one folder).\nMasters and workers are distinct identities: a worker certificate cannot speak Raft or\nserve as a master.\n\nExamples:\n  granary cert issue master-1 --role master --master-id 1 --ca-dir ./ca --out ./tls/master-1\n  granary cert issue worker-7 --role node --ca-dir ./ca --out ./tls/worker-7\n  granary cert issue ops --role admin --ca-dir ./ca --out ~/.granary/tls\n  granary cert issue team-a-mount --role user --subtree /datasets/team-a --ca-dir ./ca --out ./tls/team-a"
    )]
    Issue {
        /// The principal's name (the certificate's common name; shown in logs and errors).
        name: String,
        /// Role(s): master, node, admin, user (repeat or separate with commas).
        #[arg(long = "role", required = true, value_delimiter = ',', value_parser = role)]
        roles: Vec<granary_common::tls::Role>,
        /// With --role master: the id of the master this certificate belongs to (its
        /// `granary master --id`); it may send Raft messages as that master only.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        master_id: Option<u64>,
        /// The CA folder of `granary cert init`.
        #[arg(long, value_name = "DIR")]
        ca_dir: PathBuf,
        /// Where to write ca.crt, tls.crt and tls.key.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Validity in days.
        #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=36500))]
        days: u32,
        /// Limit the principal to this namespace folder (and what is below it).
        #[arg(long, value_name = "PATH")]
        subtree: Option<String>,
        /// Extra DNS name or IP address in the certificate (repeatable), for tools that
        /// verify servers by address; Granary itself verifies servers by role.
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// Overwrite existing files in OUT.
        #[arg(long)]
        force: bool,
    },
    /// Show what a certificate says: principal, roles, subtree, validity.
    #[command(
        after_help = "Examples:\n  granary cert show ./tls/worker-7/tls.crt\n  granary cert show --tls-dir ~/.granary/tls"
    )]
    Show {
        /// Certificate file (PEM) [default: the --tls-dir's tls.crt].
        file: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

fn role(s: &str) -> Result<granary_common::tls::Role, String> {
    granary_common::tls::Role::parse(s)
        .ok_or_else(|| format!("unknown role {s:?}; expected master, node, admin or user"))
}

#[derive(Debug, Args)]
pub struct LoadArgs {
    /// File or folder (Granary path) to cache.
    pub path: String,
    /// Workers that cache each block: its owner, then the next ones in placement order.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub replicas: u32,
    /// Start the job and return at once (its id is printed).
    #[arg(long)]
    pub detach: bool,
    /// Print the job as JSON at the end (or at once with --detach); no progress output.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub master: MasterAddr,
}

#[derive(Debug, Subcommand)]
pub enum JobCommand {
    /// List the jobs the masters keep (the last 200).
    #[command(after_help = "Examples:\n  granary job list\n  granary job list --json")]
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Show a job: progress, bytes read from under-stores, failed files with their reason.
    #[command(
        after_help = "With --watch, follows the job until it ends; the exit status is then 0 only when it\nsucceeded.\n\nExamples:\n  granary job status 3\n  granary job status 3 --watch\n  granary job status 3 --json | jq .failed"
    )]
    Status {
        id: u64,
        #[arg(long)]
        json: bool,
        /// Follow the job until it ends.
        #[arg(long)]
        watch: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Stop a running job (what it cached stays cached).
    #[command(after_help = "Examples:\n  granary job cancel 3")]
    Cancel {
        id: u64,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
}

#[derive(Debug, Args, Clone)]
pub struct MasterAddr {
    /// Master address (host:port), or all masters of the group separated by commas.
    #[arg(
        long = "master",
        visible_alias = "masters",
        env = "GRANARY_MASTER",
        default_value = "127.0.0.1:19998"
    )]
    pub master: String,
}

#[derive(Debug, Args, Clone)]
pub struct FuseOpts {
    /// How long the kernel caches file attributes.
    #[arg(long, env = "GRANARY_ATTR_TIMEOUT", value_parser = duration, default_value = "1s")]
    pub attr_timeout: Duration,
    /// How long the kernel caches name lookups.
    #[arg(long, env = "GRANARY_ENTRY_TIMEOUT", value_parser = duration, default_value = "1s")]
    pub entry_timeout: Duration,
    /// How long the kernel remembers that a name does not exist (0s: ask every time).
    /// Objects added to the under-store by others show up after at most this long (plus
    /// the mount's sync_interval); files created through this mount show up at once.
    #[arg(long, env = "GRANARY_NEGATIVE_TIMEOUT", value_parser = duration, default_value = "1s")]
    pub negative_timeout: Duration,
    /// Kernel request threads: how many requests the mount works on at once (reads of
    /// block files block one each; 16 random readers of a big file with 4 threads got
    /// 0.5-0.7x of the disk, with 16 threads 1.0x).
    #[arg(long, env = "GRANARY_FUSE_THREADS", default_value_t = 16)]
    pub fuse_threads: usize,
    /// Let users other than the mounting one access the mount.
    #[arg(long, env = "GRANARY_ALLOW_OTHER")]
    pub allow_other: bool,
    /// Never read a same-host worker's block files directly (short-circuit); stream every
    /// read over gRPC instead. Short-circuit needs the worker's cache directory visible at
    /// the same path and the same node name (GRANARY_NODE_NAME, else the hostname).
    #[arg(long, env = "GRANARY_NO_SHORT_CIRCUIT")]
    pub no_short_circuit: bool,
    /// Never read over workers' block data planes (`granary worker --data-listen`, plain
    /// TCP; clusters without TLS): read over gRPC instead. By default a worker's data
    /// plane is used when it offers one.
    #[arg(long, env = "GRANARY_NO_DATA_PLANE")]
    pub no_data_plane: bool,
    /// Never open files in FUSE passthrough mode. By default a file that is one block,
    /// wholly cached on this node's worker, is opened in passthrough (Linux 6.9+, root): the
    /// kernel reads the worker's block file directly and the daemon sees no reads.
    #[arg(long, env = "GRANARY_NO_PASSTHROUGH")]
    pub no_passthrough: bool,
    /// Smallest file opened in passthrough mode; smaller ones are read through the daemon
    /// (their open cost outweighs the copy passthrough saves, and re-reads come from the
    /// kernel page cache).
    #[arg(long, env = "GRANARY_PASSTHROUGH_MIN_SIZE", value_parser = size, default_value = "1MiB")]
    pub passthrough_min_size: u64,
    /// Small files pushed into the kernel's page cache ahead of a program reading a folder's
    /// files in name order (tar, cp -r, a loader over sorted samples), once the kernel is
    /// seen not to hold them: read from this node's worker, so the program's reads need no
    /// round trip to the daemon. 0 turns it off; random-order readers never trigger it.
    #[arg(long, env = "GRANARY_PUSH_AHEAD_FILES", default_value_t = granary_fuse::DEFAULT_PUSH_AHEAD)]
    pub push_ahead_files: usize,
    /// Largest file pushed ahead (see --push-ahead-files).
    #[arg(long, env = "GRANARY_PUSH_MAX_SIZE", value_parser = size, default_value = "1MiB")]
    pub push_max_size: u64,
    /// Folder warming: once 8 files of a folder were read uncached, out of name order (a
    /// training job's first epoch), the folder's other files of one block are fetched into
    /// the cache ahead of the readers, 16 at a time, at most 100 files per uncached read
    /// seen there and at most this many bytes per folder (and half the cluster's cache).
    /// 0 turns it off.
    #[arg(long, env = "GRANARY_WARM_FOLDER_BYTES", value_parser = size, default_value = "4GiB")]
    pub warm_folder_bytes: u64,
    /// Where warm blocks that another node's worker owns are read from: `cluster` reads
    /// each from its owner (the cluster caches one copy; on N nodes about (N-1)/N of the
    /// bytes cross the network every epoch); `node` reads them from the owner once, has
    /// this node's worker copy them from it in the background (never from the under-store),
    /// and reads them from this node's disk afterwards (short-circuit, passthrough) — more
    /// cache per node, less network. Node copies only take room this node's worker does not
    /// need for blocks it owns. Needs a worker with this node's name.
    #[arg(long, env = "GRANARY_LOCALITY", value_enum, default_value_t = Locality::Cluster)]
    pub locality: Locality,
    /// Deadline of every mount operation that waits on the network (a read, a lookup): on
    /// expiry it fails with EIO, is logged and counted, and the mount carries on.
    #[arg(long, env = "GRANARY_OP_TIMEOUT", value_parser = duration, default_value = "60s")]
    pub op_timeout: Duration,
    /// Memory that reads in flight may hold at once, all open files together (their
    /// buffers); further reads wait for room. Written bytes not yet sent hold up to a
    /// quarter of it, and at most a quarter of it ÷ 2 MiB files are written at once (ENFILE
    /// past that).
    /// At least 1 MiB.
    #[arg(long, env = "GRANARY_MAX_MEMORY", value_parser = size, default_value = "1GiB")]
    pub max_memory: u64,
    /// The node this client runs on: it reads block files directly only from workers that
    /// report the same node name [default: the hostname].
    #[arg(long, env = "GRANARY_NODE_NAME")]
    pub node_name: Option<String>,
    /// Kernel read-ahead of the mount for sequential readers (its bdi read_ahead_kb; needs
    /// root), e.g. 4MiB; 0 keeps the kernel's 128 KiB.
    #[arg(long, env = "GRANARY_READ_AHEAD", value_parser = size, default_value = "4MiB")]
    pub read_ahead: u64,
    /// Refuse every change through this mount (EROFS).
    #[arg(long, env = "GRANARY_READ_ONLY")]
    pub read_only: bool,
    /// How files written through this mount reach the under-store: cache-through (close
    /// returns once the store has the file), async-through (close returns once it is cached
    /// on --async-replicas workers; uploaded in the background, pinned until then),
    /// must-cache (cached only, not durable) or through (store only). Default: each
    /// mount's write_mode option, else cache-through.
    #[arg(long, env = "GRANARY_WRITE_MODE", value_parser = write_mode)]
    pub write_mode: Option<granary_client::WriteMode>,
    /// Workers that hold an async-through file before close returns.
    #[arg(long, env = "GRANARY_ASYNC_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub async_replicas: u32,
}

/// The CSI node plugin (`granary csi`).
#[derive(Debug, Args)]
pub struct CsiArgs {
    /// The Unix socket the kubelet and the node-driver-registrar call: `unix:///PATH` or a
    /// path (an existing socket there is replaced).
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,
    /// This node's `granary fuse` mount point: published volumes are its folders.
    #[arg(long, env = "GRANARY_MOUNT")]
    pub mount: PathBuf,
    /// The node's id reported to Kubernetes [default: GRANARY_NODE_NAME, else the hostname].
    #[arg(long, env = "GRANARY_NODE_NAME")]
    pub node_id: Option<String>,
    /// The driver's name, as in the cluster's CSIDriver object.
    #[arg(long, default_value = crate::csi::DRIVER_NAME)]
    pub driver_name: String,
    /// The write mode of the node's mount (its `granary fuse --write-mode`): a volume whose
    /// writeMode attribute names another is refused. Unset: volumes may not name one.
    #[arg(long, env = "GRANARY_WRITE_MODE", value_parser = write_mode)]
    pub write_mode: Option<granary_client::WriteMode>,
    /// How long a publish or unpublish may wait on the mount before it fails
    /// (DEADLINE_EXCEEDED; the kubelet retries).
    #[arg(long, value_parser = duration, default_value = "60s")]
    pub op_timeout: Duration,
}

pub(crate) fn write_mode(s: &str) -> Result<granary_client::WriteMode, String> {
    s.parse()
}

#[derive(Debug, Args)]
pub struct LocalArgs {
    /// Under-store to serve: a local directory or a URI (file:///path).
    #[arg(long, env = "GRANARY_UFS")]
    pub ufs: String,
    /// Where to mount (an existing empty directory).
    #[arg(long, env = "GRANARY_MOUNT")]
    pub mount: PathBuf,
    /// Cache and metadata directory [default: $XDG_CACHE_HOME/granary/local or ~/.cache/granary/local].
    #[arg(long, env = "GRANARY_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Cache capacity, e.g. 10GiB, 512MiB or plain bytes.
    #[arg(long, env = "GRANARY_CACHE_SIZE", value_parser = size, default_value = "10GiB")]
    pub cache_size: u64,
    /// Serve Prometheus metrics on this address (/metrics).
    #[arg(long, env = "GRANARY_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Eviction policy: lfu-admission or lru (see `granary worker --help`).
    #[arg(long, env = "GRANARY_EVICTION", value_parser = eviction, default_value = "lfu-admission")]
    pub eviction: granary_worker::evict::PolicyKind,
    /// Symbolic links in a local folder: `inside` shows links whose target stays inside the
    /// folder (links leaving it are never listed nor followed), `none` hides every link.
    #[arg(long, env = "GRANARY_SYMLINKS", default_value = "inside", value_parser = ["inside", "none"])]
    pub symlinks: String,
    #[command(flatten)]
    pub fuse: FuseOpts,
}

fn tier(s: &str) -> Result<granary_worker::store::TierSpec, String> {
    granary_worker::store::TierSpec::parse(s)
}

fn eviction(s: &str) -> Result<granary_worker::evict::PolicyKind, String> {
    granary_worker::evict::PolicyKind::parse(s).ok_or_else(|| {
        format!(
            "unknown eviction policy {s:?}; expected one of {}",
            granary_worker::evict::PolicyKind::NAMES.join(", ")
        )
    })
}

fn peers(s: &str) -> Result<std::collections::BTreeMap<u64, String>, String> {
    let mut out = std::collections::BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not ID=HOST:PORT"))?;
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| format!("{id:?} in {part:?} is not a master id (1, 2, ...)"))?;
        if id == 0 {
            return Err("master ids start at 1".into());
        }
        let addr = addr.trim();
        if !addr.contains(':') {
            return Err(format!("{addr:?} in {part:?} is not HOST:PORT"));
        }
        if out.insert(id, addr.to_string()).is_some() {
            return Err(format!("master id {id} is listed twice"));
        }
    }
    Ok(out)
}

#[derive(Debug, Args)]
pub struct MasterArgs {
    #[command(subcommand)]
    pub action: Option<MasterAction>,
    /// Directory for the Raft log and the namespace (RocksDB).
    #[arg(long, env = "GRANARY_DATA_DIR", required = true)]
    pub data_dir: Option<PathBuf>,
    /// This master's id in the group (1, 2, ...).
    #[arg(long, env = "GRANARY_MASTER_ID", default_value_t = 1)]
    pub id: u64,
    /// Members of the group: ID=HOST:PORT,... including this one. Omit for a single master.
    #[arg(long, env = "GRANARY_PEERS", value_parser = peers)]
    pub peers: Option<std::collections::BTreeMap<u64, String>>,
    /// Start outside the group and wait for `granary master add ID ADDR`.
    #[arg(long, env = "GRANARY_JOIN")]
    pub join: bool,
    /// Snapshot the namespace and compact the Raft log every this many applied entries.
    #[arg(long, env = "GRANARY_SNAPSHOT_ENTRIES", default_value_t = granary_master::DEFAULT_SNAPSHOT_ENTRIES)]
    pub snapshot_entries: u64,
    /// gRPC listen address.
    #[arg(long, env = "GRANARY_LISTEN", default_value = "127.0.0.1:19998")]
    pub listen: SocketAddr,
    /// Serve Prometheus metrics on this address (/metrics).
    #[arg(long, env = "GRANARY_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// A worker silent this long is declared lost.
    #[arg(long, env = "GRANARY_WORKER_TIMEOUT", value_parser = duration, default_value = "10s")]
    pub worker_timeout: Duration,
    /// Block size of files loaded from under-stores.
    #[arg(long, env = "GRANARY_BLOCK_SIZE", value_parser = size, default_value = "64MiB")]
    pub block_size: u64,
    /// File holding the key that encrypts under-store credentials in the masters' state (at
    /// least 32 random bytes, the same on every master; e.g. `head -c 32 /dev/urandom |
    /// base64 > key`). The key itself may instead be in GRANARY_SECRETS_KEY. Without one,
    /// mounts with credentials are refused.
    #[arg(long, env = "GRANARY_SECRETS_KEY_FILE", value_name = "FILE")]
    pub secrets_key_file: Option<PathBuf>,
    /// Allow `file://` mounts of this folder and the folders below it (repeatable; in
    /// GRANARY_ALLOW_LOCAL_ROOTS comma-separated). Without it no local folder can be
    /// mounted, so an admin cannot mount the masters' own keys or any other host folder.
    ///
    /// Example: --allow-local-root /data --allow-local-root /srv/datasets
    #[arg(
        long = "allow-local-root",
        env = "GRANARY_ALLOW_LOCAL_ROOTS",
        value_name = "DIR",
        value_delimiter = ','
    )]
    pub allow_local_roots: Vec<PathBuf>,
    /// Only these store addresses may be named by mount options (`endpoint`, `base_url`,
    /// `proxy_url`, Azure's emulator, …): HOST (any port) or HOST:PORT, repeatable (in
    /// GRANARY_ALLOW_ENDPOINTS comma-separated). Without it any address is accepted.
    ///
    /// Example: --allow-endpoint minio.storage.svc:9000
    #[arg(
        long = "allow-endpoint",
        env = "GRANARY_ALLOW_ENDPOINTS",
        value_name = "HOST[:PORT]",
        value_delimiter = ','
    )]
    pub allow_endpoints: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum MasterAction {
    /// Show the masters: id, address, role, term, commit and applied index, and the state
    /// formats (the newest each reads / the one the group's Raft entries are in).
    ///
    /// Example: granary master list --master m1:19998,m2:19998,m3:19998
    #[command(verbatim_doc_comment)]
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Add a master to the group. Start it first with --join and the same --peers plus itself.
    ///
    /// The group asks it first: a master that does not answer there, answers as another
    /// id, or is of a release that cannot read the group's Raft entries, is refused.
    ///
    /// Example: granary master add 4 10.0.0.4:19998 --master m1:19998
    #[command(verbatim_doc_comment)]
    Add {
        /// The new master's id (unused in the group).
        id: u64,
        /// Its address (host:port), as other masters and clients reach it.
        address: String,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Remove a master from the group (leadership moves away first if it leads).
    ///
    /// Example: granary master remove 4 --master m1:19998
    #[command(verbatim_doc_comment)]
    Remove {
        id: u64,
        #[command(flatten)]
        master: MasterAddr,
    },
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Single-stream GET of one object straight from its under-store (no Granary in the
    /// path): the limit cold reads are compared with.
    ///
    /// Example: granary bench get s3://bucket/big.bin -o region=us-east-1 --json
    ///          granary bench get s3://bucket/train/ --each -o region=us-east-1
    #[command(verbatim_doc_comment)]
    Get {
        /// The object's URI (with --each: a prefix).
        uri: String,
        /// key=value store option (repeatable), as for `mount add`.
        #[arg(long = "option", short = 'o')]
        options: Vec<String>,
        /// List every object below the URI, then GET each whole, one after another, in
        /// name order: the per-file GET loop of a program reading samples straight from the
        /// store (the limit cold loader epochs are compared with). Reports objects/s too.
        #[arg(long)]
        each: bool,
        #[arg(long)]
        json: bool,
    },
    /// Read one file through the cluster (client library → workers over gRPC, no FUSE),
    /// PASSES times; the first pass warms the cache. The peer-read path; with
    /// --short-circuit, same-node workers' block files are read directly instead.
    ///
    /// Example: granary bench read /data/big.bin --passes 3 --json --master m1:19998
    #[command(verbatim_doc_comment)]
    Read {
        /// The file's path in the namespace.
        path: String,
        #[arg(long, default_value_t = 3)]
        passes: u32,
        /// Blocks read at once.
        #[arg(long, default_value_t = 2)]
        concurrency: usize,
        /// Read same-node workers' block files directly (off: measure gRPC peer reads).
        #[arg(long)]
        short_circuit: bool,
        /// Read over gRPC even from workers that offer a block data plane.
        #[arg(long)]
        no_data_plane: bool,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Raw TCP throughput on loopback (one connection, 1 MiB writes): the limit peer reads
    /// are compared with.
    ///
    /// Example: granary bench tcp --size 4GiB --json
    #[command(verbatim_doc_comment)]
    Tcp {
        #[arg(long, value_parser = size, default_value = "2GiB")]
        size: u64,
        #[arg(long)]
        json: bool,
    },
    /// Raw mutual-TLS throughput on loopback (one rustls stream with the provider and
    /// settings Granary uses, throwaway certificates, 1 MiB writes): the limit peer reads
    /// with TLS on are compared with.
    ///
    /// Example: granary bench tls --size 2GiB --json
    #[command(verbatim_doc_comment)]
    Tls {
        #[arg(long, value_parser = size, default_value = "2GiB")]
        size: u64,
        #[arg(long)]
        json: bool,
    },
    /// Metadata throughput: mkdir under DIR as fast as possible, then stat what was made.
    ///
    /// Example: granary bench metadata --dir /bench --duration 10s --concurrency 8 --json
    #[command(verbatim_doc_comment)]
    Metadata {
        /// Directory to create entries in (created if missing).
        #[arg(long, default_value = "/bench")]
        dir: String,
        /// Stop creating after this long.
        #[arg(long, value_parser = duration, default_value = "10s")]
        duration: Duration,
        /// Stop creating after this many entries.
        #[arg(long)]
        ops: Option<u64>,
        /// Concurrent callers.
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        /// Append each acknowledged path to this file (one per line, flushed at once).
        #[arg(long)]
        ack_log: Option<PathBuf>,
        /// Send every stat to the leader instead of spreading them over the masters (to
        /// compare the two).
        #[arg(long)]
        reads_at_leader: bool,
        /// Create nothing: stat DIR/d0 … DIR/d{N-1}, made by an earlier run, to time and
        /// profile reads alone.
        #[arg(long, value_name = "N")]
        stat_existing: Option<u64>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[command(subcommand)]
    pub action: Option<WorkerAction>,
    #[command(flatten)]
    pub master: MasterAddr,
    /// gRPC listen address.
    #[arg(long, env = "GRANARY_LISTEN", default_value = "127.0.0.1:29999")]
    pub listen: SocketAddr,
    /// Address clients use to reach this worker [default: the listen address].
    #[arg(long, env = "GRANARY_ADVERTISE")]
    pub advertise: Option<String>,
    /// Cache directory: the worker's id, and its cache (block files and index) unless
    /// --tier gives the tiers.
    #[arg(long, env = "GRANARY_CACHE_DIR", required = true)]
    pub cache_dir: Option<PathBuf>,
    /// Cache capacity, e.g. 10GiB, 512MiB or plain bytes (one tier in --cache-dir).
    #[arg(long, env = "GRANARY_CACHE_SIZE", value_parser = size, required_unless_present = "tier", conflicts_with = "tier")]
    pub cache_size: Option<u64>,
    /// A cache tier, repeatable, fastest first whatever the order: mem:SIZE (tmpfs, in
    /// /dev/shm/granary-<worker id>; mem:DIR:SIZE for another tmpfs), ssd:DIR:SIZE,
    /// hdd:DIR:SIZE. New pages enter the fastest tier that admits them, evicted pages move
    /// one tier down, pages read often move up. Instead of --cache-size.
    ///
    /// Example: --tier mem:8GiB --tier ssd:/nvme/granary:1TiB
    #[arg(long, env = "GRANARY_TIERS", value_delimiter = ',', value_parser = tier)]
    pub tier: Vec<granary_worker::store::TierSpec>,
    /// Page size: the unit fetched, checksummed and evicted.
    #[arg(long, env = "GRANARY_PAGE_SIZE", value_parser = size, default_value = "1MiB")]
    pub page_size: u64,
    /// Serve Prometheus metrics on this address (/metrics).
    #[arg(long, env = "GRANARY_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Heartbeat interval.
    #[arg(long, env = "GRANARY_HEARTBEAT_INTERVAL", value_parser = duration, default_value = "1s")]
    pub heartbeat_interval: Duration,
    /// Eviction policy: lfu-admission (LRU plus a frequency admission filter: scans and
    /// epochs over datasets larger than the cache do not flush it) or lru.
    #[arg(long, env = "GRANARY_EVICTION", value_parser = eviction, default_value = "lfu-admission")]
    pub eviction: granary_worker::evict::PolicyKind,
    /// The node this worker runs on, as clients compare it for short-circuit reads
    /// [default: the hostname]. On Kubernetes, set it from spec.nodeName.
    #[arg(long, env = "GRANARY_NODE_NAME")]
    pub node_name: Option<String>,
    /// Node copies for mounts on this node that ask for them (their --locality node):
    /// `node` keeps copies of blocks other workers own, filled from those workers only
    /// (never the under-store), evicted before any page this worker owns and never
    /// evicting one; `cluster` refuses them (mounts then read such blocks from their
    /// owners).
    #[arg(long, env = "GRANARY_WORKER_LOCALITY", value_enum, default_value_t = Locality::Node)]
    pub locality: Locality,
    /// Serve the block data plane on this address: reads of cached pages as framed plain
    /// TCP, whole pages sent from the cache file by sendfile (0.2x of raw TCP over gRPC,
    /// see docs/benchmarks.md). Clusters without TLS only: unauthenticated and in clear,
    /// so for trusted networks (a worker with TLS refuses to start with it). Advertised to
    /// clients with the listen address's port on --advertise's host. [default: off]
    #[arg(long, env = "GRANARY_DATA_LISTEN")]
    pub data_listen: Option<SocketAddr>,
}

/// Where a node reads the warm blocks other nodes' workers own (see `--locality`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Locality {
    /// From their owner: the cluster caches one copy of each block.
    Cluster,
    /// From this node's worker, which copies them from their owners after a first read.
    Node,
}

#[derive(Debug, Subcommand)]
pub enum WorkerAction {
    /// Stop placing blocks on a worker. Clients move its blocks to the next owners, which
    /// copy its cached pages from it instead of the under-store; stop it once `granary
    /// report` shows its reads have moved (state `draining`).
    ///
    /// Example: granary worker decommission 7 --master m1:19998
    #[command(verbatim_doc_comment)]
    Decommission {
        /// The worker's id (see `granary report`).
        id: u64,
        /// Even when it is the last live worker in service (nothing could then take new
        /// blocks, writes or loads).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Undo a decommission: blocks are placed on the worker again.
    ///
    /// Example: granary worker recommission 7 --master m1:19998
    #[command(verbatim_doc_comment)]
    Recommission {
        id: u64,
        #[command(flatten)]
        master: MasterAddr,
    },
}

#[derive(Debug, Args)]
pub struct FuseArgs {
    #[command(flatten)]
    pub master: MasterAddr,
    /// Where to mount (an existing directory).
    #[arg(long, env = "GRANARY_MOUNT")]
    pub mount: PathBuf,
    /// Serve Prometheus metrics on this address (/metrics).
    #[arg(long, env = "GRANARY_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    #[command(flatten)]
    pub fuse: FuseOpts,
    #[command(flatten)]
    pub handover: HandoverOpts,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TakeoverMode {
    /// Take the mount over; fail when no daemon serves it.
    Always,
    /// Take the mount over when a daemon serves it, else mount.
    Auto,
}

/// Replacing the daemon of a mount without unmounting it (docs/operations.md, "Restarting
/// and upgrading a mount"). Crash recovery needs Linux 6.9+.
#[derive(Debug, Args, Clone)]
pub struct HandoverOpts {
    /// Take the mount at --mount over from the `granary fuse` serving it now (an upgrade, or
    /// new flags) without unmounting: that daemon hands over the mount's descriptor and open
    /// handles on --handover-socket and exits; programs using the mount see a pause, no
    /// error. `--takeover auto`: take it over when a daemon answers, else mount.
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "always")]
    pub takeover: Option<TakeoverMode>,
    /// After handing the mount to a successor, keep the supervisor running (serving and
    /// unmounting nothing) until SIGTERM: for a Kubernetes pod whose replacement took the
    /// mount over, so that the pod is not restarted before it is deleted.
    #[arg(long)]
    pub wait_after_handover: bool,
    /// Unix socket on which this daemon hands its mount to a successor, and where
    /// --takeover asks for it [default: /run/granary/fuse/<hash of the mount point>.sock as
    /// root, else under $XDG_RUNTIME_DIR].
    #[arg(long, env = "GRANARY_HANDOVER_SOCKET")]
    pub handover_socket: Option<PathBuf>,
    /// How long a successor's request waits for files open for writing through the mount
    /// to be closed before it is refused (their bytes live in this daemon).
    #[arg(long, value_parser = duration, default_value = "30s")]
    pub handover_timeout: Duration,
    /// Run the daemon under a small supervisor that holds the mount's descriptor: when the
    /// daemon dies (a crash, an OOM kill, kill -9) a new one takes the mount over and the
    /// kernel sends it what the old one had not answered; programs reading see a pause, no
    /// error.
    #[arg(long)]
    pub supervise: bool,
    /// Act as on a kernel that cannot send a new daemon the requests the old one read and
    /// did not answer (FUSE_NOTIFY_RESEND, Linux < 6.9, where this is how it works anyway):
    /// no crash recovery (--supervise serves unsupervised), and a successor takes the
    /// mount over only once the old daemon has answered every request it read.
    #[arg(long, env = "GRANARY_FUSE_NO_RESEND")]
    pub no_resend: bool,
    /// The supervisor's socket, given by the supervisor to its daemon.
    #[arg(long, hide = true)]
    pub holder_socket: Option<PathBuf>,
    /// Take the mount over from this socket (the supervisor's, after a crash).
    #[arg(long, hide = true)]
    pub take_from: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum MountCommand {
    /// Mount an under-store at a Granary path.
    ///
    /// Examples:
    ///   granary mount add /datasets/local file:///data/sets
    ///   granary mount add /scratch /mnt/nfs/scratch --option read_only=true
    ///   granary mount add /s3 s3://bucket/prefix -o region=us-east-1 -o access_key_id=AKIA.. \
    ///       --option-file secret_access_key=/run/secrets/s3-key
    ///   AWS_SECRET=.. granary mount add /s3 s3://bucket -o access_key_id=AKIA.. \
    ///       --option-env secret_access_key=AWS_SECRET
    #[command(verbatim_doc_comment)]
    Add {
        /// Granary path (created if missing; must not overlap another mount).
        path: String,
        /// Under-store URI, or an absolute local directory.
        uri: String,
        /// key=value option (repeatable), e.g. read_only=true. Credentials given here are
        /// visible to other users of this machine (ps): use --option-file or --option-env.
        #[arg(long = "option", short = 'o')]
        options: Vec<String>,
        /// key=FILE: the option's value is the file's content (a trailing newline is
        /// dropped), e.g. secret_access_key=/run/secrets/s3-key (repeatable).
        #[arg(long = "option-file", value_name = "KEY=FILE")]
        option_files: Vec<String>,
        /// key=VAR: the option's value is environment variable VAR's (repeatable).
        #[arg(long = "option-env", value_name = "KEY=VAR")]
        option_envs: Vec<String>,
        /// Succeed without changes when PATH is already mounted from URI (scripts and
        /// Kubernetes Jobs that run again); a mount of another URI there is still an error.
        #[arg(long)]
        exist_ok: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// List mounts (credentials shown as ***).
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Remove a mount (cached metadata under it is dropped; the under-store is untouched).
    /// Refused while files under it are not in the under-store yet (written through
    /// Granary and not uploaded, or still being written).
    Remove {
        path: String,
        /// Remove it anyway: files not in the under-store yet lose their only copies.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
}

#[derive(Debug, Subcommand)]
pub enum FsCommand {
    /// List a directory.
    ///
    /// Example: granary fs ls -l /datasets
    #[command(verbatim_doc_comment)]
    Ls {
        path: String,
        /// Long format: kind, size, mtime, pin, name.
        #[arg(short = 'l')]
        long: bool,
        /// Every entry below the path (full paths), directories included.
        #[arg(short = 'R', long)]
        recursive: bool,
        /// Read the first given master's own state, even if it is a follower (may lag).
        #[arg(long)]
        stale: bool,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Create a directory.
    ///
    /// Example: granary fs mkdir -p /scratch/run-42/checkpoints
    #[command(verbatim_doc_comment)]
    Mkdir {
        path: String,
        /// Create missing parents; an existing directory is not an error.
        #[arg(short = 'p', long)]
        parents: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// List mounted directories from their under-stores now (new, changed and removed objects).
    ///
    /// Examples:
    ///   granary fs sync /datasets/imagenet/train
    ///   granary fs sync -R /datasets
    #[command(verbatim_doc_comment)]
    Sync {
        path: String,
        /// Also every directory below it that was already loaded.
        #[arg(short = 'R', long)]
        recursive: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Show an entry's metadata.
    ///
    /// Example: granary fs stat /datasets/train/part-0001.tar
    #[command(verbatim_doc_comment)]
    Stat {
        path: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Write a file's bytes to stdout (through the cache).
    ///
    /// Example: granary fs cat /datasets/labels.csv | head
    #[command(verbatim_doc_comment)]
    Cat {
        path: String,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Remove a file, or a directory with -R (in the under-store too, for mounted paths).
    ///
    /// Examples:
    ///   granary fs rm /scratch/run-42/ckpt-0001.pt
    ///   granary fs rm -R /scratch/run-41
    #[command(verbatim_doc_comment)]
    Rm {
        path: String,
        /// Remove a directory and everything below it.
        #[arg(short = 'R', short_alias = 'r', long)]
        recursive: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Rename a file or directory (within one mount; copy + delete where the under-store
    /// has no rename).
    ///
    /// Example: granary fs mv /scratch/run-42/tmp.pt /scratch/run-42/final.pt
    #[command(verbatim_doc_comment)]
    Mv {
        src: String,
        dst: String,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Copy a file: within Granary, or from/to the local disk with a `file:` prefix. The
    /// copy is written with the mount's write mode (or --write-mode) like a write through
    /// the mount; an existing destination is replaced only with --force.
    ///
    /// Examples:
    ///   granary fs cp /datasets/a/labels.csv /scratch/labels.csv
    ///   granary fs cp file:/tmp/model.pt /checkpoints/run-42/model.pt --write-mode async-through
    ///   granary fs cp /datasets/a/labels.csv file:/tmp/labels.csv
    #[command(verbatim_doc_comment)]
    Cp {
        src: String,
        dst: String,
        /// cache-through, async-through, must-cache or through (default: the mount's
        /// write_mode option, else cache-through).
        #[arg(long)]
        write_mode: Option<String>,
        /// Replace an existing destination.
        #[arg(short = 'f', long)]
        force: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Bytes and files below a path (as far as it is listed: directories are listed from
    /// their under-stores on the way).
    ///
    /// Examples:
    ///   granary fs du /datasets
    ///   granary fs du -s /datasets/imagenet --json
    #[command(verbatim_doc_comment)]
    Du {
        path: String,
        /// Only the total.
        #[arg(short = 's', long)]
        summarize: bool,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        master: MasterAddr,
    },
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub master: MasterAddr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TtlActionArg {
    /// Drop the cached copies (the under-store keeps the data).
    Free,
    /// Delete the entry — in the under-store too, for mounted paths.
    Delete,
}

#[derive(Debug, Subcommand)]
pub enum TtlCommand {
    /// Set (or replace) the TTL of a path, counted from now.
    #[command(
        after_help = "When the TTL is due the leader master frees the path's cached copies (free) or deletes\nit, everything below it included, from Granary and, for mounted paths, from the\nunder-store (delete). A free refused (pinned data, files not persisted yet) is retried\nuntil it succeeds. The TTL survives master failovers; `granary fs stat` shows it.\n\nExamples:\n  granary ttl set /scratch/run-42 7d --action delete\n  granary ttl set /datasets/old 12h --action free"
    )]
    Set {
        path: String,
        /// How long from now (e.g. 90s, 30m, 12h, 7d).
        #[arg(value_parser = duration)]
        ttl: Duration,
        #[arg(long, value_enum, default_value = "free")]
        action: TtlActionArg,
        #[command(flatten)]
        master: MasterAddr,
    },
    /// Remove the TTL of a path.
    #[command(after_help = "Examples:\n  granary ttl unset /scratch/run-42")]
    Unset {
        path: String,
        #[command(flatten)]
        master: MasterAddr,
    },
}
