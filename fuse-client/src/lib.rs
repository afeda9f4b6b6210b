//! `granary fuse`: a `fuser` filesystem over the client library.
//!
//! Every callback hands its work to the tokio runtime and replies from the task, so no
//! kernel reader thread ever waits on the network; every network wait has a deadline
//! (client side), so an operation fails with an errno instead of hanging the mount.
//! Writes are sequential (checkpoints, outputs) in the mount's write mode; `--read-only`
//! answers every change with `EROFS`.

mod backing;
mod error;
mod fs;
mod pagecache;
mod prefetch;
mod write;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fuser::{Config, MountOption, SessionACL};
use granary_client::FileSystem;
use thiserror::Error;

pub use fs::GranaryFs;

#[derive(Debug, Error)]
pub enum FuseError {
    #[error("mount point {path} does not exist")]
    MissingMountPoint { path: String },
    #[error("mount point {path} is not a directory")]
    NotADirectory { path: String },
    #[error("cannot mount on {path}: {source}")]
    Mount {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Default budget of read buffers in flight.
pub const DEFAULT_MAX_MEMORY: u64 = 1 << 30;

/// Default deadline of a mount operation.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(60);

/// Default smallest file opened in passthrough mode.
pub const DEFAULT_PASSTHROUGH_MIN_SIZE: u64 = 1024 * 1024;

/// Default number of small files pushed into the kernel ahead of a folder's reader.
pub const DEFAULT_PUSH_AHEAD: usize = 8;

/// Default largest file pushed ahead.
pub const DEFAULT_PUSH_MAX_SIZE: u64 = 1024 * 1024;

/// Default kernel read-ahead of a mount.
pub const DEFAULT_READ_AHEAD: u64 = 4 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct FuseConfig {
    pub mountpoint: PathBuf,
    /// How long the kernel may cache attributes.
    pub attr_timeout: Duration,
    /// How long the kernel may cache name lookups.
    pub entry_timeout: Duration,
    /// How long the kernel may remember that a name does not exist (0: ask every time).
    pub negative_timeout: Duration,
    /// Kernel request reader threads.
    pub threads: usize,
    /// Let other users than the mounting one use the mount (`allow_other`).
    pub allow_other: bool,
    /// Kernel read-ahead of the mount (its `read_ahead_kb`), 0 to leave the kernel's
    /// 128 KiB. Larger windows keep several 1 MiB reads in flight for sequential readers.
    pub read_ahead: u64,
    /// Open files wholly cached on this node's worker in FUSE passthrough mode (when the
    /// kernel supports it).
    pub passthrough: bool,
    /// Files smaller than this are read through the daemon even when passthrough is
    /// possible: for them the open's cost (a lease and a backing file per open) outweighs
    /// the copy it saves, and the kernel page cache serves re-reads without any open cost.
    pub passthrough_min_size: u64,
    /// Small files pushed into the kernel's page cache ahead of a reader going through a
    /// folder in name order (0: none).
    pub push_ahead: usize,
    /// Largest file pushed ahead (files opened in passthrough never are).
    pub push_max_size: u64,
    /// Bytes warmed per folder ahead of readers going through it at random while it is
    /// not cached (0: no folder warming; see `granary_client::warm`).
    pub warm_folder_bytes: u64,
    /// Node locality: blocks other nodes' workers own are copied to this node's worker
    /// after a first read (see `granary_client::nodecopy`).
    pub node_local: bool,
    /// Deadline of every operation that waits on the network; on expiry it fails with EIO.
    pub op_timeout: Duration,
    /// Bytes that reads in flight may hold at once (their buffers); more reads wait.
    pub max_memory: u64,
    /// Refuse every change with EROFS.
    pub read_only: bool,
    /// Write mode of every file written through this mount (None: each mount's
    /// `write_mode` option, cache-through when unset).
    pub write_mode: Option<granary_client::WriteMode>,
    /// Workers holding an async-through file before close returns.
    pub async_replicas: usize,
}

impl FuseConfig {
    pub fn new(mountpoint: PathBuf) -> Self {
        Self {
            mountpoint,
            attr_timeout: Duration::from_secs(1),
            entry_timeout: Duration::from_secs(1),
            negative_timeout: Duration::from_secs(1),
            threads: 4,
            allow_other: false,
            read_ahead: DEFAULT_READ_AHEAD,
            passthrough: true,
            passthrough_min_size: DEFAULT_PASSTHROUGH_MIN_SIZE,
            push_ahead: DEFAULT_PUSH_AHEAD,
            push_max_size: DEFAULT_PUSH_MAX_SIZE,
            warm_folder_bytes: granary_client::warm::DEFAULT_WARM_FOLDER_BYTES,
            node_local: false,
            op_timeout: DEFAULT_OP_TIMEOUT,
            max_memory: DEFAULT_MAX_MEMORY,
            read_only: false,
            write_mode: None,
            async_replicas: 1,
        }
    }
}

/// Checks the mount point before mounting, for a clear error.
pub fn check_mountpoint(path: &Path) -> Result<(), FuseError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(FuseError::NotADirectory {
            path: path.display().to_string(),
        }),
        Err(_) => Err(FuseError::MissingMountPoint {
            path: path.display().to_string(),
        }),
    }
}

/// Mounts the namespace at `config.mountpoint` and serves it on background threads until the
/// returned session is unmounted (`umount_and_join`) or dropped.
pub fn mount(
    client: Arc<FileSystem>,
    config: &FuseConfig,
    runtime: tokio::runtime::Handle,
) -> Result<fuser::BackgroundSession, FuseError> {
    check_mountpoint(&config.mountpoint)?;
    client.set_read_timeout(config.op_timeout);
    // An open may use the status a lookup or listing fetched within the attribute timeout.
    client.set_status_ttl(config.attr_timeout);
    client.set_warm_folder_bytes(config.warm_folder_bytes);
    client.set_node_local(config.node_local);
    let fs = GranaryFs::new(client.clone(), config, runtime.clone());
    let page_cache = fs.page_cache();
    let mut c = Config::default();
    c.mount_options = vec![
        MountOption::FSName("granary".into()),
        MountOption::Subtype("granary".into()),
        MountOption::NoAtime,
        // The kernel checks every access against the owner and mode the mount shows.
        MountOption::DefaultPermissions,
    ];
    if config.read_only {
        c.mount_options.push(MountOption::RO);
    }
    if config.allow_other {
        c.acl = SessionACL::All;
    }
    c.n_threads = Some(config.threads.max(1));
    c.clone_fd = true;
    let session =
        fuser::spawn_mount(fs, &config.mountpoint, &c).map_err(|source| FuseError::Mount {
            path: config.mountpoint.display().to_string(),
            source,
        })?;
    page_cache.set_notifier(session.notifier());
    // Changes the master announces drop the kernel's caches of the inodes concerned (off
    // the runtime's threads: a kernel invalidation may wait on the file's pages).
    let (pc, rt) = (page_cache.clone(), runtime.clone());
    client.meta.watch.on_change(Box::new(
        move |inodes: &[u64], entries: &[(u64, String)]| {
            let (pc, inodes, entries) = (pc.clone(), inodes.to_vec(), entries.to_vec());
            rt.spawn_blocking(move || pc.changed(&inodes, &entries));
        },
    ));
    {
        let _rt = runtime.enter();
        client.start_watch();
    }
    if config.read_ahead > 0 {
        set_read_ahead(&config.mountpoint, config.read_ahead);
    }
    Ok(session)
}

/// Sets the kernel read-ahead of the mount at `mountpoint` (FUSE caps it at 128 KiB in the
/// mount handshake; the mount's backing device in sysfs can raise it). Best effort: without
/// a writable sysfs (not root, some containers) the kernel default stays, with a log line.
fn set_read_ahead(mountpoint: &Path, bytes: u64) {
    use std::os::unix::fs::MetadataExt;
    let dev = match std::fs::metadata(mountpoint) {
        Ok(m) => m.dev(),
        Err(e) => {
            tracing::warn!(mountpoint = %mountpoint.display(), error = %e, "cannot stat the mount to set its read-ahead");
            return;
        }
    };
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let path = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    let kb = bytes.div_ceil(1024);
    match std::fs::write(&path, kb.to_string()) {
        Ok(()) => tracing::debug!(%path, kb, "mount read-ahead set"),
        Err(e) => {
            tracing::info!(%path, error = %e, "cannot raise the mount's read-ahead; the kernel's 128 KiB stays")
        }
    }
}
