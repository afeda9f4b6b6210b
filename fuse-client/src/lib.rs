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
pub mod handover;
mod pagecache;
mod prefetch;
mod write;

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuser::{Config, MountOption, SessionACL};
use granary_client::FileSystem;
use thiserror::Error;

pub use fs::{Donor, GranaryFs};

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
    #[error("cannot take over the mount at {path}: {source}")]
    Takeover {
        path: String,
        #[source]
        source: handover::HandoverError,
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
    /// This daemon's place in the mount's line of daemons (0: it mounts; set by a
    /// takeover, see [`handover`]).
    pub generation: u32,
    /// Act as on a kernel that cannot resend requests to a new daemon (see
    /// [`handover::kernel_can_resend`]): handovers quiesce the old daemon first.
    pub no_resend: bool,
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
            no_resend: false,
            write_mode: None,
            async_replicas: 1,
            generation: 0,
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

/// A mount served by this process: its FUSE session, a copy of the mount's /dev/fuse
/// descriptor (for a successor or a holder) and what a handover needs.
pub struct Mounted {
    pub session: fuser::BackgroundSession,
    pub fuse: OwnedFd,
    pub donor: Donor,
    /// The mount point, resolved.
    pub mountpoint: PathBuf,
    /// Taken over from another daemon (this process did not mount it: it unmounts by path).
    took_over: bool,
}

impl Mounted {
    /// Unmounts and waits for the session to end.
    pub fn unmount(self) -> std::io::Result<()> {
        if self.took_over {
            unmount_path(&self.mountpoint)?;
            self.session.join()
        } else {
            self.session.umount_and_join()
        }
    }
}

/// Unmounts `path` (lazily when busy: it goes once its last user lets go).
pub fn unmount_path(path: &Path) -> std::io::Result<()> {
    match rustix::mount::unmount(path, rustix::mount::UnmountFlags::empty()) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::BUSY) => {
            rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH).map_err(Into::into)
        }
        Err(e) => Err(e.into()),
    }
}

fn session_config(config: &FuseConfig) -> Config {
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
    // Every reader thread reads the one descriptor a successor or holder shares: a request
    // read by a daemon that exits stays queued on it for the kernel to send again (a
    // cloned descriptor closing with its process would fail its requests instead).
    c.clone_fd = false;
    c
}

fn prepare(client: &FileSystem, config: &FuseConfig) {
    client.set_read_timeout(config.op_timeout);
    // An open may use the status a lookup or listing fetched within the attribute timeout.
    client.set_status_ttl(config.attr_timeout);
    client.set_warm_folder_bytes(config.warm_folder_bytes);
    client.set_node_local(config.node_local);
}

/// Mounts the namespace at `config.mountpoint` and serves it on background threads until
/// [`Mounted::unmount`] (or until the session is dropped).
pub fn mount(
    client: Arc<FileSystem>,
    config: &FuseConfig,
    runtime: tokio::runtime::Handle,
) -> Result<Mounted, FuseError> {
    check_mountpoint(&config.mountpoint)?;
    prepare(&client, config);
    let fs = GranaryFs::new(client.clone(), config, runtime.clone());
    let (page_cache, donor) = (fs.page_cache(), fs.donor());
    let failed = |source| FuseError::Mount {
        path: config.mountpoint.display().to_string(),
        source,
    };
    let session =
        fuser::Session::new(fs, &config.mountpoint, &session_config(config)).map_err(failed)?;
    let fuse = session.as_fd().try_clone_to_owned().map_err(failed)?;
    let session = session.spawn().map_err(failed)?;
    Ok(serving(
        client, config, runtime, page_cache, session, fuse, donor, false,
    ))
}

/// What a takeover did: the daemon it replaced, and how long the mount was not fully served.
#[derive(Debug)]
pub struct Takeover {
    pub generation: u32,
    pub donor_version: String,
    pub unserved: Duration,
    /// Whether the kernel resent what the previous daemon read and did not answer.
    pub resent: bool,
    /// The previous daemon answered every request it read before it handed over (nothing
    /// to resend: a kernel without resend, or `--no-resend`).
    pub quiesced: bool,
}

/// Takes the mount at `config.mountpoint` over from the daemon (or descriptor holder)
/// listening on `socket`: receives its descriptor and open handles, serves the mount with
/// them once that daemon has exited, and has the kernel send again what it had read and
/// not answered. Where the kernel cannot resend, the donor answers all it read before it
/// hands over (it quiesces) and this daemon serves at once.
pub fn take_over(
    client: Arc<FileSystem>,
    config: &FuseConfig,
    runtime: tokio::runtime::Handle,
    socket: &Path,
) -> Result<(Mounted, Takeover), FuseError> {
    let failed = |source| FuseError::Takeover {
        path: config.mountpoint.display().to_string(),
        source,
    };
    let resend = handover::kernel_can_resend(config.no_resend);
    if let Err(why) = &resend {
        tracing::info!("{why}");
    }
    // The mount point is not looked at: it is the mount taken over, which nothing may
    // serve yet (the donor checks that it names the same one).
    prepare(&client, config);
    let (h, fuse, stream, donor_pid) =
        handover::request(socket, &config.mountpoint, resend.is_err()).map_err(failed)?;
    let mut config = config.clone();
    config.generation = (h.generation + 1) & 0xfff;
    let fs = GranaryFs::new(client.clone(), &config, runtime.clone());
    fs.adopt(&h);
    let (page_cache, donor) = (fs.page_cache(), fs.donor());
    let session =
        handover::attach(fs, &fuse, &h, &session_config(&config)).map_err(|e| failed(e.into()))?;
    let gone = || {
        if !handover::wait_donor_gone(&stream, donor_pid, Duration::from_secs(30)) {
            tracing::warn!(
                "the previous daemon did not exit within 30 s of handing the mount over"
            );
        }
    };
    let unserved = || match h.paused_at_ms {
        0 => Duration::ZERO,
        at => Duration::from_millis(handover::now_ms().saturating_sub(at)),
    };
    let (session, resent, unserved) = if h.quiesced {
        // A quiesced donor holds no request and reads no more: this daemon serves at once,
        // and then waits for it to end (its handover socket is this daemon's next).
        let session = session.spawn().map_err(|e| failed(e.into()))?;
        let unserved = unserved();
        gone();
        (session, false, unserved)
    } else {
        if resend.is_err() {
            // A donor that does not quiesce (an older build, or a holder after a crash):
            // what it read and did not answer is lost unless the kernel resends it.
            tracing::warn!("the previous daemon did not answer all it had read before handing over: asking the kernel to resend it all the same");
        }
        // The previous daemon exits once it has sent the mount; only then may the kernel
        // send again what it read and did not answer (else it could read those once more).
        gone();
        // Before this daemon reads any request: a request of its own in progress would be
        // sent again too, and answered twice.
        let resent = match handover::resend(&fuse) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "the kernel did not resend the previous daemon's unanswered requests: those fail");
                false
            }
        };
        let session = session.spawn().map_err(|e| failed(e.into()))?;
        (session, resent, unserved())
    };
    client.metrics.fuse_takeovers.inc();
    client
        .metrics
        .fuse_unserved_seconds
        .inc_by(unserved.as_secs_f64());
    let report = Takeover {
        generation: config.generation,
        donor_version: h.donor_version,
        unserved,
        resent,
        quiesced: h.quiesced,
    };
    Ok((
        serving(
            client, &config, runtime, page_cache, session, fuse, donor, true,
        ),
        report,
    ))
}

/// The rest of serving a mount once its session runs.
#[allow(clippy::too_many_arguments)]
fn serving(
    client: Arc<FileSystem>,
    config: &FuseConfig,
    runtime: tokio::runtime::Handle,
    page_cache: Arc<pagecache::PageCache>,
    session: fuser::BackgroundSession,
    fuse: OwnedFd,
    donor: Donor,
    took_over: bool,
) -> Mounted {
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
    let mountpoint = handover::mount_path(&config.mountpoint);
    Mounted {
        session,
        fuse,
        donor,
        mountpoint,
        took_over,
    }
}

/// Serves successors on `listener` (see [`handover`]) on a thread of its own; returns once
/// the mount was handed over (the process must then exit at once, without unmounting).
/// A successor is refused while files are open for writing through this mount for longer
/// than `limit`. Without `resend` (the kernel cannot send a successor what this daemon read
/// and did not answer), this daemon answers all it has read before it hands over.
pub fn serve_handovers(
    listener: UnixListener,
    m: &Mounted,
    runtime: tokio::runtime::Handle,
    limit: Duration,
    resend: bool,
) -> std::io::Result<tokio::sync::oneshot::Receiver<u32>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let donor = m.donor.clone();
    let fuse = m.fuse.try_clone()?;
    let mountpoint = m.mountpoint.display().to_string();
    std::thread::Builder::new()
        .name("granary-handover".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(s) = conn else { continue };
                match hand_over(&s, &donor, &fuse, &mountpoint, &runtime, limit, resend) {
                    Ok(Some(pid)) => {
                        let _ = tx.send(pid);
                        // The connection stays open until this process has exited: the
                        // successor takes its end as the sign that no thread of this
                        // daemon reads requests any more (it then has the kernel send
                        // again those read here and never answered; a quiesced daemon's
                        // threads read no more already).
                        loop {
                            std::thread::park();
                        }
                    }
                    Ok(None) => {}
                    // A peer that only checked whether a daemon listens (`--takeover auto`).
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        tracing::debug!("a handover connection closed without a request")
                    }
                    Err(e) => tracing::warn!(error = %e, "a handover request failed"),
                }
            }
        })?;
    Ok(rx)
}

/// One successor's request: `Some(its pid)` once the mount is handed over.
fn hand_over(
    s: &UnixStream,
    donor: &Donor,
    fuse: &OwnedFd,
    mountpoint: &str,
    runtime: &tokio::runtime::Handle,
    limit: Duration,
    resend: bool,
) -> std::io::Result<Option<u32>> {
    use granary_proto as pb;
    let refuse = |why: String| {
        tracing::warn!(%why, "a takeover of this mount was refused");
        let r = pb::FuseHandover {
            format: handover::FORMAT,
            refused: why,
            ..Default::default()
        };
        handover::send(s, &r, None).map(|()| None)
    };
    let pid = match handover::check_peer(s) {
        Ok(pid) => pid,
        Err(e) => return refuse(e.to_string()),
    };
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let (hello, _): (pb::FuseHello, _) = handover::recv(s)?;
    if hello.format != handover::FORMAT {
        return refuse(format!(
            "handover format {} asked for, this daemon speaks {}",
            hello.format,
            handover::FORMAT
        ));
    }
    if hello.purpose != handover::TAKE {
        return refuse(format!(
            "{:?} is not a request this daemon serves",
            hello.purpose
        ));
    }
    // Without the kernel's resend, every request this daemon read is answered here first.
    let quiesce = hello.without_resend || !resend;
    tracing::info!(pid, quiesce, "a successor asks for this mount");
    let paused_at = handover::now_ms();
    // Files being written live in this process: they must be closed first.
    let end = Instant::now() + limit;
    while donor.writing() > 0 {
        if Instant::now() >= end {
            return refuse(format!(
                "{} files are open for writing through this mount; try again once they are closed",
                donor.writing()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let reopen = || match quiesce {
        true => donor.quiesce.resume(),
        false => donor.gate.open(),
    };
    let quiet = if quiesce {
        // Each reader thread parks after its next request (a lookup of a name nobody has
        // brings one to a thread still waiting); what the kernel sends meanwhile waits for
        // the successor.
        donor.quiesce.stop();
        let (mp, me, n) = (
            mountpoint.to_string(),
            std::process::id(),
            AtomicU64::new(0),
        );
        donor.quiesce.wait_quiet(Instant::now() + limit, move || {
            let k = n.fetch_add(1, Ordering::Relaxed);
            let _ = std::fs::symlink_metadata(format!("{mp}/.granary-quiesce-{me}-{k}"));
        })
    } else {
        // No open, release or change passes from now on; those in progress finish.
        donor.gate.close();
        runtime
            .block_on(async { tokio::time::timeout(limit, donor.gate.drained()).await })
            .is_ok()
    };
    if !quiet || donor.writing() > 0 {
        reopen();
        return refuse(match quiet {
            false => "requests in progress did not finish in time".into(),
            true => format!(
                "{} files were opened for writing meanwhile; try again once they are closed",
                donor.writing()
            ),
        });
    }
    let Some(mut h) = donor.hand_over(mountpoint) else {
        reopen();
        return refuse("the mount is not initialised yet".into());
    };
    h.paused_at_ms = paused_at;
    h.quiesced = quiesce;
    if let Err(e) = handover::send(s, &h, Some(fuse.as_fd())) {
        // The successor is gone: this daemon takes back what it gave up and serves on.
        donor.take_back(&h);
        reopen();
        return Err(e);
    }
    tracing::info!(
        pid,
        files = h.files.len(),
        backings = h.backings.len(),
        "the mount was handed over; exiting without unmounting"
    );
    Ok(Some(pid))
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
