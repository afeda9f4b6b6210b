//! `granary csi`: the Kubernetes CSI node plugin (the spec's Identity and Node services over
//! a Unix socket). A pod's volume is a folder of this node's `granary fuse` mount, bound
//! into the pod's target path: pods depend on no host path layout, and as the node's mount
//! outlives its daemons (takeover, supervisor) so do the binds (docs/kubernetes.md,
//! "Volumes for pods"; decision 36 in docs/architecture.md).
//!
//! Every publish resolves the volume's folder beneath the node's mount with `openat2`
//! (no `..`, no symbolic link, no other mount crossed) as this process, whose reads the
//! mount answers with the node's identity: a folder that identity may not read is refused,
//! and a volume can never bind anything outside the Granary namespace.

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use granary_client::WriteMode;
use granary_common::paths::shown;
use granary_proto::csi::v1 as csi;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};
use tonic::{Request, Response, Status};

use crate::args::CsiArgs;

/// The driver's name when `--driver-name` is not given (the chart's CSIDriver object).
pub const DRIVER_NAME: &str = "csi.granary.io";
/// The mount source a Granary FUSE mount shows in /proc/self/mountinfo (its type is
/// `fuse`, or `fuse.granary` where the subtype is shown).
const FS_NAME: &str = "granary";
/// Prefix of the attributes Kubernetes adds to a volume's context (pod name, namespace,
/// ephemeral): passed through, never refused.
const K8S_ATTRIBUTE: &str = "csi.storage.k8s.io/";

/// Runs the plugin until SIGTERM or SIGINT.
pub async fn serve(args: CsiArgs) -> anyhow::Result<()> {
    let socket = endpoint_path(&args.endpoint)?;
    let node_id = match args.node_id.clone() {
        Some(n) if !n.is_empty() => n,
        _ => rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned(),
    };
    let plugin = Arc::new(Plugin {
        driver: args.driver_name.clone(),
        node_id,
        mount: std::path::absolute(&args.mount)
            .with_context(|| format!("the mount point {}", args.mount.display()))?,
        write_mode: args.write_mode,
        op_timeout: args.op_timeout,
        busy: Default::default(),
    });
    let listener = bind(&socket)?;
    tracing::info!(
        socket = %socket.display(),
        mount = %plugin.mount.display(),
        driver = %plugin.driver,
        node = %plugin.node_id,
        "granary csi serving"
    );
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let shutdown = async {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    let served = tonic::transport::Server::builder()
        .add_service(csi::identity_server::IdentityServer::from_arc(
            plugin.clone(),
        ))
        .add_service(csi::node_server::NodeServer::from_arc(plugin))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    let _ = std::fs::remove_file(&socket);
    served.context("serving the CSI socket")
}

/// The socket path of a CSI endpoint: `unix:///path`, `unix:/path` or a path.
fn endpoint_path(endpoint: &str) -> anyhow::Result<PathBuf> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if !path.starts_with('/') {
        anyhow::bail!("the CSI endpoint {endpoint:?} is not unix:///an/absolute/path");
    }
    Ok(PathBuf::from(path))
}

/// Listens on `socket`, owner-only (the kubelet and the registrar run as root); a socket
/// left by a plugin that is gone is replaced; one that answers, or anything else there, is
/// an error.
fn bind(socket: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::symlink_metadata(socket) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                anyhow::bail!("another plugin listens on {}", socket.display());
            }
            std::fs::remove_file(socket)
                .with_context(|| format!("removing the old socket {}", socket.display()))?
        }
        Ok(_) => anyhow::bail!("{} exists and is not a socket", socket.display()),
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(socket)
        .with_context(|| format!("listening on {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", socket.display()))?;
    Ok(listener)
}

struct Plugin {
    driver: String,
    node_id: String,
    /// The node's `granary fuse` mount point (absolute).
    mount: PathBuf,
    write_mode: Option<WriteMode>,
    op_timeout: Duration,
    /// Target paths with a publish or unpublish in progress.
    busy: Arc<Mutex<HashSet<PathBuf>>>,
}

#[tonic::async_trait]
impl csi::identity_server::Identity for Plugin {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: self.driver.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        // No controller service: volumes are folders that already exist.
        Ok(Response::new(csi::GetPluginCapabilitiesResponse::default()))
    }

    async fn probe(
        &self,
        _: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        let ready = mounts()
            .and_then(|all| node_mount(&all, &self.mount))
            .is_ok();
        Ok(Response::new(csi::ProbeResponse {
            ready: Some(csi::BoolValue { value: ready }),
        }))
    }
}

#[tonic::async_trait]
impl csi::node_server::Node for Plugin {
    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let volume = Volume::from_request(request.get_ref(), self.write_mode)?;
        let target = target_path(&request.get_ref().target_path)?;
        if target.starts_with(&self.mount) || self.mount.starts_with(&target) {
            return Err(Status::invalid_argument(format!(
                "target path {} overlaps the node's mount {}",
                target.display(),
                self.mount.display()
            )));
        }
        let mount = self.mount.clone();
        let id = request.get_ref().volume_id.clone();
        let t = target.clone();
        self.run(&target, move || publish(&mount, &volume, &t))
            .await?;
        tracing::info!(volume = ?id, target = ?target, "volume published");
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let r = request.get_ref();
        if r.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        let target = target_path(&r.target_path)?;
        let t = target.clone();
        self.run(&target, move || unpublish(&t)).await?;
        tracing::info!(volume = ?r.volume_id, target = ?target, "volume unpublished");
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        // No staging: a publish binds a folder of the node's mount, nothing to prepare.
        Ok(Response::new(csi::NodeGetCapabilitiesResponse::default()))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

impl Plugin {
    /// Runs `work` (system calls that may wait on the FUSE mount) on a blocking thread,
    /// one at a time per target path, within `--op-timeout`.
    async fn run(
        &self,
        target: &Path,
        work: impl FnOnce() -> Result<(), Status> + Send + 'static,
    ) -> Result<(), Status> {
        let claim = Claim::take(self, target)?;
        let job = tokio::task::spawn_blocking(move || {
            let done = work();
            // Released when the work is over, not when the caller gave up waiting.
            drop(claim);
            done
        });
        match tokio::time::timeout(self.op_timeout, job).await {
            Ok(Ok(done)) => done,
            Ok(Err(e)) => Err(Status::internal(format!("the operation failed: {e}"))),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "{} did not finish within {:?} (the node's mount is not answering)",
                target.display(),
                self.op_timeout
            ))),
        }
    }
}

/// A target path's operation in progress; a second one is refused with ABORTED, as the
/// spec asks.
struct Claim {
    busy: Arc<Mutex<HashSet<PathBuf>>>,
    target: PathBuf,
}

impl Claim {
    fn take(plugin: &Plugin, target: &Path) -> Result<Claim, Status> {
        let busy = plugin.busy.clone();
        let mut set = busy.lock().unwrap_or_else(|e| e.into_inner());
        if !set.insert(target.to_path_buf()) {
            return Err(Status::aborted(format!(
                "an operation on {} is in progress",
                target.display()
            )));
        }
        drop(set);
        Ok(Claim {
            busy,
            target: target.to_path_buf(),
        })
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut set = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        set.remove(&self.target);
    }
}

/// What a publish asks for, checked.
#[derive(Debug, PartialEq)]
struct Volume {
    /// The Granary folder, normalised, without its leading `/` (`""` for the root).
    path: String,
    read_only: bool,
    no_exec: bool,
}

impl Volume {
    fn from_request(
        r: &csi::NodePublishVolumeRequest,
        node_mode: Option<WriteMode>,
    ) -> Result<Volume, Status> {
        let bad = |m: String| Err(Status::invalid_argument(m));
        if r.volume_id.is_empty() {
            return bad("volume_id is required".into());
        }
        let Some(cap) = &r.volume_capability else {
            return bad("volume_capability is required".into());
        };
        use csi::volume_capability::{access_mode::Mode, AccessType};
        let mount = match &cap.access_type {
            Some(AccessType::Mount(m)) => m,
            Some(AccessType::Block(_)) => {
                return bad("Granary volumes are folders, not block devices".into())
            }
            None => return bad("volume_capability names no access type".into()),
        };
        let mode = cap.access_mode.as_ref().map(|a| a.mode());
        let mut read_only = r.readonly
            || matches!(
                mode,
                Some(Mode::SingleNodeReaderOnly) | Some(Mode::MultiNodeReaderOnly)
            );
        let mut no_exec = false;
        for flag in &mount.mount_flags {
            match flag.as_str() {
                "ro" => read_only = true,
                "rw" | "nosuid" | "nodev" => {}
                "noexec" => no_exec = true,
                other => {
                    return bad(format!(
                        "mount option {:?} is not supported (ro, rw, noexec, nosuid, nodev)",
                        shown(other)
                    ))
                }
            }
        }
        let mut path = None;
        for (key, value) in &r.volume_context {
            match key.as_str() {
                "path" => path = Some(value.as_str()),
                "readOnly" => match value.as_str() {
                    "true" => read_only = true,
                    "false" => {}
                    v => {
                        return bad(format!(
                            "readOnly must be true or false, not {:?}",
                            shown(v)
                        ))
                    }
                },
                "writeMode" => check_write_mode(value, node_mode)?,
                k if k.starts_with(K8S_ATTRIBUTE) => {}
                k => {
                    return bad(format!(
                        "unknown volume attribute {:?} (path, readOnly, writeMode)",
                        shown(k)
                    ))
                }
            }
        }
        let Some(path) = path else {
            return bad("the volume attribute path (a Granary folder) is required".into());
        };
        let parts = granary_common::paths::components(path)
            .map_err(|e| Status::invalid_argument(format!("volume attribute path: {e}")))?;
        Ok(Volume {
            path: parts.join("/"),
            read_only,
            no_exec,
        })
    }
}

fn check_write_mode(value: &str, node_mode: Option<WriteMode>) -> Result<(), Status> {
    let wanted: WriteMode = value.parse().map_err(|_| {
        Status::invalid_argument(format!(
            "writeMode {:?} is not cache-through, async-through, must-cache or through",
            shown(value)
        ))
    })?;
    match node_mode {
        Some(m) if m == wanted => Ok(()),
        Some(m) => Err(Status::failed_precondition(format!(
            "the volume asks for write mode {}, and this node's mount writes with {} \
             (granary fuse --write-mode)",
            wanted.name(),
            m.name()
        ))),
        None => Err(Status::failed_precondition(format!(
            "the volume asks for write mode {}, and this node's plugin was not told its \
             mount's (granary csi --write-mode)",
            wanted.name()
        ))),
    }
}

/// A target path as the kubelet gives it: absolute, without `.`, `..` or NUL.
fn target_path(path: &str) -> Result<PathBuf, Status> {
    let bad = |why: &str| {
        Err(Status::invalid_argument(format!(
            "target_path {:?} {why}",
            shown(path)
        )))
    };
    if path.is_empty() {
        return bad("is required");
    }
    if !path.starts_with('/') || path.contains('\0') {
        return bad("must be an absolute path");
    }
    if path.len() > granary_common::paths::MAX_PATH_LEN {
        return bad("is longer than 4096 bytes");
    }
    let p = Path::new(path);
    if p.components()
        .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
        || path.split('/').any(|c| c == "." || c == "..")
    {
        return bad("must not contain . or ..");
    }
    if p.parent().is_none() {
        return bad("must not be /");
    }
    Ok(p.components().collect())
}

/// One line of /proc/self/mountinfo.
#[derive(Debug, Clone, PartialEq)]
struct MountEntry {
    /// major:minor of the mounted file system.
    device: String,
    /// The folder of the file system mounted here (`/` unless a bind of a folder).
    root: String,
    point: PathBuf,
    read_only: bool,
    fs_type: String,
    source: String,
}

impl MountEntry {
    /// A Granary FUSE mount (the node's, or a bind of one of its folders).
    fn is_granary(&self) -> bool {
        (self.fs_type == "fuse" || self.fs_type == "fuse.granary") && self.source == FS_NAME
    }
}

/// The entries of a mountinfo text, in mount order.
fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let f: Vec<&str> = left.split(' ').collect();
            let mut r = right.split(' ');
            let fs_type = r.next()?;
            let source = r.next().unwrap_or("");
            let options = f.get(5)?;
            Some(MountEntry {
                device: f.get(2)?.to_string(),
                root: unescape(f.get(3)?),
                point: PathBuf::from(unescape(f.get(4)?)),
                read_only: options.split(',').any(|o| o == "ro"),
                fs_type: unescape(fs_type),
                source: unescape(source),
            })
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let code = b.get(i + 1..i + 4).and_then(|d| {
            d.iter().try_fold(0u32, |n, c| {
                (b'0'..=b'7')
                    .contains(c)
                    .then(|| n * 8 + u32::from(c - b'0'))
            })
        });
        if let (b'\\', Some(c)) = (b[i], code.and_then(|c| u8::try_from(c).ok())) {
            out.push(c);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn mounts() -> Result<Vec<MountEntry>, Status> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| parse_mountinfo(&t))
        .map_err(|e| Status::internal(format!("reading /proc/self/mountinfo: {e}")))
}

/// The mount on top at `point`, if any.
fn mounted_at<'a>(all: &'a [MountEntry], point: &Path) -> Option<&'a MountEntry> {
    all.iter().rev().find(|m| m.point == point)
}

/// The node's Granary mount among `all`, or UNAVAILABLE (the kubelet retries the publish).
fn node_mount(all: &[MountEntry], mount: &Path) -> Result<MountEntry, Status> {
    match mounted_at(all, mount) {
        Some(m) if m.is_granary() => Ok(m.clone()),
        _ => Err(Status::unavailable(format!(
            "{} is not a Granary mount (is this node's granary fuse running?)",
            mount.display()
        ))),
    }
}

/// Binds the volume's folder of the node's mount at `target`; done already is success,
/// another volume there is ALREADY_EXISTS.
fn publish(mount: &Path, volume: &Volume, target: &Path) -> Result<(), Status> {
    let all = mounts()?;
    let node = node_mount(&all, mount)?;
    let wanted_root = format!("/{}", volume.path);
    if let Some(there) = mounted_at(&all, target) {
        if there.device == node.device && there.root == wanted_root {
            if there.read_only == volume.read_only {
                return Ok(());
            }
            return Err(Status::already_exists(format!(
                "{} holds this volume {}",
                target.display(),
                if there.read_only {
                    "read-only"
                } else {
                    "writable"
                }
            )));
        }
        return Err(Status::already_exists(format!(
            "{} holds another mount ({} {})",
            target.display(),
            there.fs_type,
            there.root
        )));
    }
    // Refusals (missing, unreadable, not a folder) before anything is made.
    let folder = open_beneath(mount, &volume.path)?;
    // The mount found above may have gone since (its daemon stopped): a folder opened on
    // the host folder beneath it would bind what the host (or a pod with that hostPath)
    // put there.
    let st =
        rustix::fs::fstat(&folder).map_err(|e| errno_status("checking the volume's folder", e))?;
    let dev = format!(
        "{}:{}",
        rustix::fs::major(st.st_dev),
        rustix::fs::minor(st.st_dev)
    );
    if dev != node.device {
        return Err(Status::unavailable(format!(
            "{} stopped being a Granary mount while the volume was published (is this \
             node's granary fuse running?)",
            mount.display()
        )));
    }
    match std::fs::create_dir(target) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_status(&format!("creating {}", target.display()), e)),
    }
    bind_folder(mount, &volume.path, folder, target)?;
    let mut flags = MountFlags::BIND | MountFlags::NOSUID | MountFlags::NODEV;
    if volume.read_only {
        flags |= MountFlags::RDONLY;
    }
    if volume.no_exec {
        flags |= MountFlags::NOEXEC;
    }
    if let Err(e) = rustix::mount::mount_remount(target, flags, "") {
        let _ = rustix::mount::unmount(target, UnmountFlags::DETACH);
        return Err(errno_status(
            &format!("setting the flags of {}", target.display()),
            e,
        ));
    }
    Ok(())
}

/// Binds the folder `path` of the mount at `target`, through the descriptor that opened
/// it (`folder`). A bind that finds the folder gone (ENOENT: the mount invalidated its name
/// after a change seen in the namespace, between the open and the bind) opens it again, at
/// most three times.
fn bind_folder(mount: &Path, path: &str, folder: OwnedFd, target: &Path) -> Result<(), Status> {
    let mut tries = 0;
    let mut folder = folder;
    loop {
        let source = PathBuf::from(format!("/proc/self/fd/{}", fd_number(&folder)));
        match rustix::mount::mount_bind(&source, target) {
            Ok(()) => return Ok(()),
            Err(Errno::NOENT) if tries < 3 => {
                tries += 1;
                tracing::debug!(path, tries, "the folder went between its open and its bind");
                std::thread::sleep(Duration::from_millis(20 << tries));
                folder = open_beneath(mount, path)?;
            }
            Err(e) => {
                return Err(errno_status(
                    &format!("binding /{path} at {}", target.display()),
                    e,
                ))
            }
        }
    }
}

/// Unbinds what a publish bound at `target` and removes the folder; nothing there is
/// success. A mount there that is not Granary's is left alone (FAILED_PRECONDITION).
fn unpublish(target: &Path) -> Result<(), Status> {
    // At most a few stacked binds (a publish never stacks one, but a crash may have).
    for _ in 0..8 {
        let all = mounts()?;
        let Some(there) = mounted_at(&all, target) else {
            break;
        };
        if !there.is_granary() {
            return Err(Status::failed_precondition(format!(
                "{} holds a {} mount, not a Granary volume; left alone",
                target.display(),
                there.fs_type
            )));
        }
        // Lazily when busy: a pod's process still in the folder lets go when it exits.
        granary_fuse::unmount_path(target)
            .map_err(|e| io_status(&format!("unmounting {}", target.display()), e))?;
    }
    match std::fs::remove_dir(target) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_status(&format!("removing {}", target.display()), e)),
    }
}

/// Opens `path` (relative, `/`-separated) beneath `mount` as a folder: no `..`, no
/// symbolic link, no other mount crossed; the mount answers with the node's identity.
fn open_beneath(mount: &Path, path: &str) -> Result<OwnedFd, Status> {
    let root = rustix::fs::open(
        mount,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| errno_status(&format!("opening the node's mount {}", mount.display()), e))?;
    let relative = if path.is_empty() { "." } else { path };
    let shown = format!("/{path}");
    rustix::fs::openat2(
        root.as_fd(),
        relative,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH
            | ResolveFlags::NO_SYMLINKS
            | ResolveFlags::NO_MAGICLINKS
            | ResolveFlags::NO_XDEV,
    )
    .map_err(|e| match e {
        Errno::NOENT => Status::not_found(format!("no folder {shown} in the Granary namespace")),
        Errno::ACCESS | Errno::PERM => {
            Status::permission_denied(format!("this node's Granary identity may not read {shown}"))
        }
        Errno::NOTDIR => Status::invalid_argument(format!("{shown} is not a folder")),
        Errno::LOOP => Status::invalid_argument(format!(
            "{shown} passes through a symbolic link (volumes must name a real folder)"
        )),
        Errno::XDEV => Status::invalid_argument(format!(
            "{shown} crosses another mount beneath the node's mount"
        )),
        e => errno_status(&format!("opening {shown}"), e),
    })
}

fn fd_number(fd: &OwnedFd) -> i32 {
    use std::os::fd::AsRawFd;
    fd.as_raw_fd()
}

fn errno_status(what: &str, e: Errno) -> Status {
    io_status(what, io::Error::from(e))
}

fn io_status(what: &str, e: io::Error) -> Status {
    let message = format!("{what}: {e}");
    match e.raw_os_error().map(Errno::from_raw_os_error) {
        Some(Errno::NOTCONN) | Some(Errno::NODEV) => Status::unavailable(message),
        Some(Errno::ACCESS) | Some(Errno::PERM) => Status::permission_denied(message),
        Some(Errno::NOENT) => Status::not_found(message),
        _ => Status::internal(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi::volume_capability::{access_mode::Mode, AccessMode, AccessType, MountVolume};
    use tonic::Code;

    fn request(attrs: &[(&str, &str)]) -> csi::NodePublishVolumeRequest {
        csi::NodePublishVolumeRequest {
            volume_id: "v1".into(),
            target_path: "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/v1/mount".into(),
            volume_capability: Some(csi::VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: Some(AccessMode {
                    mode: Mode::MultiNodeMultiWriter as i32,
                }),
            }),
            volume_context: attrs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    fn code(r: &csi::NodePublishVolumeRequest, mode: Option<WriteMode>) -> Code {
        Volume::from_request(r, mode).map_or_else(|s| s.code(), |_| Code::Ok)
    }

    #[test]
    fn a_volume_is_a_normalised_granary_folder() {
        let v = Volume::from_request(&request(&[("path", "//data//imagenet/")]), None).unwrap();
        assert_eq!(
            v,
            Volume {
                path: "data/imagenet".into(),
                read_only: false,
                no_exec: false
            }
        );
        let root = Volume::from_request(&request(&[("path", "/")]), None).unwrap();
        assert_eq!(root.path, "");
        // Kubernetes' own attributes pass.
        let r = request(&[
            ("path", "/d"),
            ("csi.storage.k8s.io/pod.name", "p"),
            ("csi.storage.k8s.io/ephemeral", "true"),
        ]);
        assert_eq!(code(&r, None), Code::Ok);
    }

    #[test]
    fn bad_volumes_are_refused_with_invalid_argument() {
        for attrs in [
            &[][..],
            &[("path", "data")][..],
            &[("path", "/data/../etc")][..],
            &[("path", "/data/\0x")][..],
            &[("path", "/d"), ("readOnly", "yes")][..],
            &[("path", "/d"), ("redOnly", "true")][..],
            &[("path", "/d"), ("writeMode", "sometimes")][..],
        ] {
            assert_eq!(
                code(&request(attrs), None),
                Code::InvalidArgument,
                "{attrs:?}"
            );
        }
        let mut r = request(&[("path", "/d")]);
        r.volume_id.clear();
        assert_eq!(code(&r, None), Code::InvalidArgument);
        let mut r = request(&[("path", "/d")]);
        r.volume_capability.as_mut().unwrap().access_type =
            Some(AccessType::Block(Default::default()));
        assert_eq!(code(&r, None), Code::InvalidArgument);
        let mut r = request(&[("path", "/d")]);
        r.volume_capability = None;
        assert_eq!(code(&r, None), Code::InvalidArgument);
        let mut r = request(&[("path", "/d")]);
        if let Some(AccessType::Mount(m)) = &mut r.volume_capability.as_mut().unwrap().access_type {
            m.mount_flags = vec!["suid".into()];
        }
        assert_eq!(code(&r, None), Code::InvalidArgument);
    }

    #[test]
    fn refusals_echo_at_most_a_short_part_of_what_was_sent() {
        let huge = "x".repeat(1 << 20);
        for attrs in [
            vec![("path", "/d"), ("readOnly", huge.as_str())],
            vec![("path", "/d"), ("writeMode", huge.as_str())],
            vec![("path", "/d"), (huge.as_str(), "1")],
            vec![("path", huge.as_str())],
        ] {
            let e = Volume::from_request(&request(&attrs), None).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(e.message().len() < 1024, "{} bytes", e.message().len());
        }
        let mut r = request(&[("path", "/d")]);
        if let Some(AccessType::Mount(m)) = &mut r.volume_capability.as_mut().unwrap().access_type {
            m.mount_flags = vec![huge.clone()];
        }
        let e = Volume::from_request(&r, None).unwrap_err();
        assert!(e.message().len() < 1024);
        let e = target_path(&format!("/{huge}")).unwrap_err();
        assert!(e.message().len() < 1024);
    }

    #[test]
    fn a_second_operation_on_a_target_in_progress_is_aborted() {
        let plugin = Plugin {
            driver: DRIVER_NAME.into(),
            node_id: "n".into(),
            mount: "/mnt/g".into(),
            write_mode: None,
            op_timeout: Duration::from_secs(1),
            busy: Default::default(),
        };
        let t = Path::new("/k/pods/p/mount");
        let first = Claim::take(&plugin, t).unwrap();
        assert_eq!(
            Claim::take(&plugin, t).err().map(|s| s.code()),
            Some(Code::Aborted)
        );
        let other = Claim::take(&plugin, Path::new("/k/pods/q/mount")).unwrap();
        drop(first);
        drop(other);
        drop(Claim::take(&plugin, t).unwrap());
        assert!(plugin.busy.lock().unwrap().is_empty());
    }

    #[test]
    fn read_only_comes_from_the_request_the_mode_the_flags_or_the_attribute() {
        let ro =
            |r: &csi::NodePublishVolumeRequest| Volume::from_request(r, None).unwrap().read_only;
        assert!(!ro(&request(&[("path", "/d")])));
        assert!(ro(&request(&[("path", "/d"), ("readOnly", "true")])));
        let mut r = request(&[("path", "/d")]);
        r.readonly = true;
        assert!(ro(&r));
        let mut r = request(&[("path", "/d")]);
        r.volume_capability.as_mut().unwrap().access_mode = Some(AccessMode {
            mode: Mode::MultiNodeReaderOnly as i32,
        });
        assert!(ro(&r));
        let mut r = request(&[("path", "/d")]);
        if let Some(AccessType::Mount(m)) = &mut r.volume_capability.as_mut().unwrap().access_type {
            m.mount_flags = vec!["ro".into(), "noexec".into()];
        }
        let v = Volume::from_request(&r, None).unwrap();
        assert!(v.read_only && v.no_exec);
    }

    #[test]
    fn a_write_mode_must_be_the_node_mounts() {
        let r = request(&[("path", "/d"), ("writeMode", "async-through")]);
        assert_eq!(code(&r, Some(WriteMode::AsyncThrough)), Code::Ok);
        assert_eq!(
            code(&r, Some(WriteMode::CacheThrough)),
            Code::FailedPrecondition
        );
        assert_eq!(code(&r, None), Code::FailedPrecondition);
    }

    #[test]
    fn target_paths_are_absolute_and_plain() {
        assert_eq!(
            target_path("/var/lib/kubelet/x/mount/").unwrap(),
            PathBuf::from("/var/lib/kubelet/x/mount")
        );
        let long = format!("/{}", "x/".repeat(2100));
        for bad in ["", "relative/x", "/a/../b", "/a/./b", "/", "/a\0b", &long] {
            assert_eq!(
                target_path(bad).unwrap_err().code(),
                Code::InvalidArgument,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn endpoints_name_a_unix_socket() {
        assert_eq!(
            endpoint_path("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            endpoint_path("unix:/csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            endpoint_path("/csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert!(endpoint_path("tcp://127.0.0.1:1").is_err());
    }

    #[test]
    fn mountinfo_lines_are_read_with_their_escapes() {
        let text = "\
22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
90 22 0:55 / /mnt/g\\040ranary rw,nosuid,nodev,noatime shared:40 - fuse granary rw,user_id=0
91 22 0:55 /data/team-a /var/lib/kubelet/pods/x/mount ro,nosuid,nodev master:40 - fuse granary rw
92 22 0:56 / /var/lib/kubelet/pods/x/mount rw - tmpfs tmpfs rw
junk
";
        let all = parse_mountinfo(text);
        assert_eq!(all.len(), 4);
        assert_eq!(all[1].point, PathBuf::from("/mnt/g ranary"));
        assert!(all[1].is_granary() && all[2].is_granary());
        assert!(!all[0].is_granary() && !all[3].is_granary());
        assert_eq!(all[2].root, "/data/team-a");
        assert!(all[2].read_only && !all[1].read_only);
        let top = mounted_at(&all, Path::new("/var/lib/kubelet/pods/x/mount")).unwrap();
        assert_eq!(top.fs_type, "tmpfs");
        assert_eq!(unescape("a\\134b\\012\\7"), "a\\b\n\\7");
        assert_eq!(unescape("\\777"), "\\777");
    }
}
