//! Handing a mount from one `granary fuse` daemon to the next without unmounting it
//! (docs/operations.md, "Restarting and upgrading a mount").
//!
//! The kernel keeps a FUSE mount alive for as long as some process holds its /dev/fuse
//! descriptor. A daemon hands that descriptor (SCM_RIGHTS over a Unix socket) and what the
//! kernel holds of its answers — open handles, passthrough backing files and their leases —
//! to its successor ([`pb::FuseHandover`]), and exits. Requests it had read but not answered
//! stay queued in the kernel on the shared descriptor; the successor asks the kernel to send
//! them again (`FUSE_NOTIFY_RESEND`, Linux 6.9+). A holder process ([`Holder`]) that keeps
//! a copy of the descriptor lets a successor do the same after the daemon crashed.
//!
//! Who may take a mount over: only a process of the daemon's own user (checked with the
//! socket's peer credentials), through a socket in a folder only that user may enter — the
//! descriptor serves every reader of the mount.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use granary_proto as pb;
use granary_proto::prost::Message;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use thiserror::Error;

/// The handover format this build speaks (`FuseHandover.format`, `FuseHello.format`).
pub const FORMAT: u32 = 1;

/// What a successor asks for; what a daemon asks its holder to keep; what it tells the
/// holder before it unmounts or hands over.
pub const TAKE: &str = "take";
pub const HOLD: &str = "hold";
pub const RELEASE: &str = "release";
pub const MIRROR: &str = "mirror";

/// First bytes of a message: with a descriptor beside it, or without.
const MARK_FD: [u8; 4] = *b"GFD1";
const MARK_NONE: [u8; 4] = *b"GMS1";
/// Largest handover message accepted (a million open handles fit).
const MAX_MESSAGE: u32 = 256 << 20;

/// The first Linux release whose FUSE can resend requests (`FUSE_NOTIFY_RESEND`).
pub const RESEND_SINCE: (u32, u32) = (6, 9);

#[derive(Debug, Error)]
pub enum HandoverError {
    #[error("no daemon serving this mount answers on {path}: {source}")]
    NoDonor {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the running daemon refused to hand the mount over: {0}")]
    Refused(String),
    #[error("the running daemon speaks handover format {theirs}, this build knows {FORMAT}: use a build that knows format {theirs}")]
    Format { theirs: u32 },
    #[error("the daemon on {socket} serves {theirs}, not {ours}")]
    OtherMount {
        socket: String,
        theirs: String,
        ours: String,
    },
    #[error("the handover sent no /dev/fuse descriptor")]
    NoDescriptor,
    #[error("{0}")]
    Kernel(String),
    #[error("handover socket: {0}")]
    Io(#[from] std::io::Error),
}

/// The mount point `p` as every daemon of the mount names it: absolute, its parent folders'
/// links resolved — never the mount point itself, which is the FUSE mount: a daemon taking
/// it over must not ask it anything before it serves it (nothing would answer).
pub fn mount_path(p: &Path) -> PathBuf {
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => std::fs::canonicalize(parent)
            .map(|d| d.join(name))
            .unwrap_or(abs.clone()),
        _ => abs,
    }
}

/// The handover socket of the mount at `mountpoint` when none is given: in
/// `/run/granary/fuse` (root) or `$XDG_RUNTIME_DIR/granary/fuse`, named by a hash of the
/// mount point (socket paths are short).
pub fn default_socket(mountpoint: &Path) -> PathBuf {
    use sha2::Digest;
    let canonical = mount_path(mountpoint);
    let digest = sha2::Sha256::digest(canonical.as_os_str().as_encoded_bytes());
    let name: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let base = if rustix::process::geteuid().is_root() {
        PathBuf::from("/run/granary/fuse")
    } else {
        std::env::var_os("XDG_RUNTIME_DIR")
            .map(|d| PathBuf::from(d).join("granary/fuse"))
            .unwrap_or_else(|| std::env::temp_dir().join("granary-fuse"))
    };
    base.join(format!("{name}.sock"))
}

/// Whether this kernel resends requests a daemon read but never answered (and `off`, the
/// operator's `--no-resend`, does not say to act as if it did not); `Err` says why not.
pub fn kernel_can_resend(off: bool) -> Result<(), String> {
    let uname = rustix::system::uname();
    let release = uname.release().to_string_lossy().into_owned();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse::<u32>().ok());
    let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    let consequence = "a crash of the daemon breaks the mount (no --supervise); a new daemon still takes it over gracefully (--takeover), the old one answering every request it read first";
    if off {
        Err(format!(
            "FUSE request resend is off (--no-resend): {consequence}"
        ))
    } else if version >= RESEND_SINCE {
        Ok(())
    } else {
        Err(format!(
            "Linux {release} cannot resend FUSE requests to a new daemon (Linux {}.{}+ can): {consequence}",
            RESEND_SINCE.0, RESEND_SINCE.1
        ))
    }
}

/// Sends `msg` on `s`, with `fd` beside it when given.
pub fn send<M: Message>(
    s: &UnixStream,
    msg: &M,
    fd: Option<BorrowedFd<'_>>,
) -> std::io::Result<()> {
    let body = msg.encode_to_vec();
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&n| n <= MAX_MESSAGE)
        .ok_or_else(|| std::io::Error::other("handover message too large"))?;
    let mut w = s;
    match fd {
        Some(fd) => {
            let fds = [fd];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Err(std::io::Error::other("descriptor does not fit the message"));
            }
            let n = rustix::net::sendmsg(
                s,
                &[IoSlice::new(&MARK_FD)],
                &mut control,
                SendFlags::empty(),
            )?;
            w.write_all(&MARK_FD[n..])?;
        }
        None => w.write_all(&MARK_NONE)?,
    }
    w.write_all(&len.to_le_bytes())?;
    w.write_all(&body)?;
    w.flush()
}

/// Sends `msg` on `s` in one write when it fits the socket's buffer (a sender killed
/// between two writes would leave a message cut short, which the receiver drops whole).
fn send_whole<M: Message>(s: &UnixStream, msg: &M) -> std::io::Result<()> {
    let body = msg.encode_to_vec();
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&n| n <= MAX_MESSAGE)
        .ok_or_else(|| std::io::Error::other("handover message too large"))?;
    let mut buf = Vec::with_capacity(8 + body.len());
    buf.extend_from_slice(&MARK_NONE);
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&body);
    let mut w = s;
    w.write_all(&buf)
}

/// A daemon's connection to its descriptor holder that mirrors its passthrough backing
/// files ([`pb::FuseMirror`]); see `crate::backing`. Each message is written before the
/// kernel is answered, so a holder knows every backing file the kernel may hand to a handle
/// of a daemon that died. A connection that fails is given up with a warning: the mount
/// goes on, and a successor after a crash registers new backing files (an inode still read
/// through a dead daemon's backing file then fails to open with EBUSY until its last such
/// handle closes).
pub struct Mirror {
    s: Mutex<Option<UnixStream>>,
}

impl Mirror {
    pub fn new(s: UnixStream) -> Self {
        // A holder that stops reading must not stall the mount: a send that cannot finish
        // gives the mirror up.
        if let Err(e) = s.set_write_timeout(Some(Duration::from_secs(5))) {
            tracing::warn!(error = %e, "cannot bound writes to the mount's supervisor");
        }
        Self {
            s: Mutex::new(Some(s)),
        }
    }

    pub fn send(&self, m: &pb::FuseMirror) {
        let mut g = lock(&self.s);
        let Some(s) = g.as_ref() else { return };
        if let Err(e) = send_whole(s, m) {
            tracing::warn!(error = %e, "the mount's supervisor no longer hears of passthrough backing files: after a crash, files open in passthrough may fail to open again until closed");
            *g = None;
        }
    }
}

/// Receives a message from `s`, and the descriptor sent beside it.
pub fn recv<M: Message + Default>(s: &UnixStream) -> std::io::Result<(M, Option<OwnedFd>)> {
    let mut mark = [0u8; 4];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        s,
        &mut [IoSliceMut::new(&mut mark)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    if got.bytes == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let mut fd = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                // One descriptor is expected; any other is closed here.
                fd.get_or_insert(f);
            }
        }
    }
    let mut r = s;
    r.read_exact(&mut mark[got.bytes..])?;
    if mark != MARK_FD && mark != MARK_NONE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a Granary handover message",
        ));
    }
    if mark == MARK_NONE {
        fd = None;
    }
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len);
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("handover message of {len} bytes refused (at most {MAX_MESSAGE})"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    let msg = M::decode(body.as_slice())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    Ok((msg, fd))
}

/// Checks that the peer of `s` runs as this process's user (or root).
pub fn check_peer(s: &UnixStream) -> std::io::Result<u32> {
    let cred = rustix::net::sockopt::socket_peercred(s)?;
    let me = rustix::process::geteuid();
    if cred.uid != me && !cred.uid.is_root() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "a process of uid {} asked for the mount; only uid {} may",
                cred.uid.as_raw(),
                me.as_raw()
            ),
        ));
    }
    Ok(cred.pid.as_raw_nonzero().get() as u32)
}

/// Listens on `path` for successors: its folder is created for this user alone (0700); a
/// socket file left by a daemon that is gone is replaced, one that answers is not.
pub fn listen(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
        // A folder another user made (or a link to one) would let that user reach the
        // socket, or swap it.
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(dir)?;
        let me = rustix::process::geteuid().as_raw();
        if !m.is_dir() || m.uid() != me {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "{} is not a folder of uid {me}: the handover socket is not put there",
                    dir.display()
                ),
            ));
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!(
                    "another daemon listens on {} (take its mount over with --takeover)",
                    path.display()
                ),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Connects to the daemon (or holder) on `path` and asks for the mount at `mountpoint`;
/// `without_resend`: this side will not have the kernel resend what the donor read and did
/// not answer, so the donor answers all it read first ([`Quiesce`]).
pub fn request(
    path: &Path,
    mountpoint: &Path,
    without_resend: bool,
) -> Result<(pb::FuseHandover, OwnedFd, UnixStream, u32), HandoverError> {
    let s = UnixStream::connect(path).map_err(|source| HandoverError::NoDonor {
        path: path.display().to_string(),
        source,
    })?;
    let donor = check_peer(&s)?;
    let hello = pb::FuseHello {
        format: FORMAT,
        purpose: TAKE.into(),
        pid: std::process::id(),
        session: None,
        handed_over: false,
        without_resend,
    };
    send(&s, &hello, None)?;
    let (h, fd): (pb::FuseHandover, _) = recv(&s)?;
    if h.format != FORMAT {
        return Err(HandoverError::Format { theirs: h.format });
    }
    if !h.refused.is_empty() {
        return Err(HandoverError::Refused(h.refused));
    }
    let ours = mount_path(mountpoint);
    if Path::new(&h.mountpoint) != ours {
        return Err(HandoverError::OtherMount {
            socket: path.display().to_string(),
            theirs: h.mountpoint,
            ours: ours.display().to_string(),
        });
    }
    let fd = fd.ok_or(HandoverError::NoDescriptor)?;
    Ok((h, fd, s, donor))
}

/// Waits until the peer of `s` has closed it (the donor exits after handing over), at most
/// `limit`; returns whether it did.
pub fn wait_closed(s: &UnixStream, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    let mut buf = [0u8; 64];
    let mut r = s;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            return false;
        }
        match r.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// Whether process `pid` has ended as far as its mount is concerned: gone, or exiting with
/// every thread left stuck in the kernel (state D: none of them can read a request any
/// more). A dying FUSE daemon can keep a thread in an uninterruptible wait on its own mount
/// — a kernel invalidation waiting for a folder's lock held by a lookup that waits for an
/// answer — and such a process only ends once a successor answers.
pub fn exited(pid: u32) -> bool {
    let state = |stat: &str| stat.rsplit_once(") ").and_then(|(_, r)| r.chars().next());
    let Ok(leader) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    if !matches!(state(&leader), Some('Z' | 'X')) {
        return false;
    }
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .map(|s| matches!(state(&s), Some('Z' | 'X' | 'D')))
            .unwrap_or(true)
    })
}

/// Waits until the donor `pid` has ended (its end of `s` closed, or [`exited`]), at most
/// `limit`; returns whether it did.
pub fn wait_donor_gone(s: &UnixStream, pid: u32, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if wait_closed(s, Duration::from_millis(20)) || exited(pid) {
            return true;
        }
    }
    false
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The INIT request a kernel sends a new mount, as the first daemon of this mount received
/// it: the FUSE library of a successor reads it before any other request.
pub fn synthetic_init(h: &pb::FuseHandover) -> Vec<u8> {
    const FUSE_INIT: u32 = 26;
    const FUSE_INIT_EXT: u64 = 1 << 30;
    const LEN: u32 = 40 + 64; // fuse_in_header + fuse_init_in
    let flags = h.kernel_flags | FUSE_INIT_EXT;
    let mut b = Vec::with_capacity(LEN as usize);
    b.extend_from_slice(&LEN.to_le_bytes());
    b.extend_from_slice(&FUSE_INIT.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes()); // unique
    b.extend_from_slice(&0u64.to_le_bytes()); // nodeid
    b.extend_from_slice(&[0u8; 16]); // uid, gid, pid, padding
    b.extend_from_slice(&h.kernel_major.to_le_bytes());
    b.extend_from_slice(&h.kernel_minor.to_le_bytes());
    b.extend_from_slice(&h.max_readahead.to_le_bytes());
    b.extend_from_slice(&(flags as u32).to_le_bytes());
    b.extend_from_slice(&((flags >> 32) as u32).to_le_bytes());
    b.extend_from_slice(&[0u8; 44]); // unused
    b
}

/// A session serving the existing mount behind `fuse` with `fs`, not yet reading
/// requests. The FUSE library expects the kernel's INIT first, which the kernel sends once
/// per mount: it is given the one this mount began with over a socket pair, and the mount's
/// descriptor then takes the socket's place under the same descriptor number (dup3).
pub fn attach<FS: fuser::Filesystem>(
    fs: FS,
    fuse: &OwnedFd,
    h: &pb::FuseHandover,
    config: &fuser::Config,
) -> std::io::Result<fuser::Session<FS>> {
    let (mut ours, theirs) = UnixStream::pair()?;
    ours.write_all(&synthetic_init(h))?;
    let session = fuser::Session::from_fd(fs, OwnedFd::from(theirs), config.acl, config.clone())?;
    let slot = session.as_fd().as_raw_fd();
    nix::unistd::dup3(fuse.as_raw_fd(), slot, nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(std::io::Error::from)?;
    drop(ours); // held the INIT reply, which no kernel needs
    Ok(session)
}

/// Asks the kernel to send again every request of this mount that was read but not
/// answered (by a daemon that has exited): `FUSE_NOTIFY_RESEND`.
pub fn resend(fuse: &OwnedFd) -> std::io::Result<()> {
    const FUSE_NOTIFY_RESEND: i32 = 7;
    let mut msg = [0u8; 16];
    msg[..4].copy_from_slice(&16u32.to_le_bytes());
    msg[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_le_bytes());
    let n = rustix::io::write(fuse, &msg)?;
    if n != msg.len() {
        return Err(std::io::Error::other("short write of the resend notice"));
    }
    Ok(())
}

/// Lets requests that change what a successor would have to know (opens, releases,
/// creates, removals, renames) through, and counts those in progress; once closed for a
/// handover it holds new ones on their kernel thread until it opens again (a refused
/// handover) or the process exits (the kernel then sends them again to the successor).
#[derive(Default)]
pub struct Gate {
    closed: Mutex<bool>,
    opened: Condvar,
    in_progress: AtomicUsize,
    idle: tokio::sync::Notify,
}

/// A request let through the gate: in progress until dropped.
pub struct Pass(Arc<Gate>);

impl Drop for Pass {
    fn drop(&mut self) {
        if self.0.in_progress.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Gate {
    /// A pass for a request; waits while the gate is closed.
    pub fn pass(self: &Arc<Self>) -> Pass {
        let mut closed = lock(&self.closed);
        while *closed {
            closed = self.opened.wait(closed).unwrap_or_else(|e| e.into_inner());
        }
        self.in_progress.fetch_add(1, Ordering::SeqCst);
        Pass(self.clone())
    }

    /// Closes the gate: no request passes from now on (those in progress go on).
    pub fn close(&self) {
        *lock(&self.closed) = true;
    }

    pub fn open(&self) {
        *lock(&self.closed) = false;
        self.opened.notify_all();
    }

    /// Waits until no request let through is in progress.
    pub async fn drained(&self) {
        loop {
            let idle = self.idle.notified();
            if self.in_progress.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }
}

/// How a daemon stops reading requests without leaving one unanswered, for a handover the
/// kernel cannot resend to the successor (Linux < 6.9, or `--no-resend`).
///
/// Every request handler begins with [`Quiesce::enter`]: once [`Quiesce::stop`] was
/// called, the reader thread handles the request it has read and then parks inside the
/// handler, before it could read another. Requests answered from a task are counted until
/// their reply is sent ([`Quiesce::track`]). When every reader thread is parked and no
/// reply is in flight, this daemon holds no request: what the kernel sends meanwhile waits
/// in its queue for the successor. Reversible: [`Quiesce::resume`] lets the threads read
/// again (a refused handover).
pub struct Quiesce {
    threads: usize,
    stopping: AtomicBool,
    parked: AtomicUsize,
    replies: AtomicUsize,
    state: Mutex<()>,
    changed: Condvar,
}

thread_local! {
    /// This thread handles a request after which it parks.
    static PARKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Held by a reader thread while it handles its last request before parking; parks the
/// thread when dropped (until [`Quiesce::resume`]).
pub struct Parking(Arc<Quiesce>);

impl Drop for Parking {
    fn drop(&mut self) {
        let q = &self.0;
        let mut g = lock(&q.state);
        q.parked.fetch_add(1, Ordering::SeqCst);
        q.changed.notify_all();
        while q.stopping.load(Ordering::SeqCst) {
            g = q.changed.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        q.parked.fetch_sub(1, Ordering::SeqCst);
        drop(g);
        PARKING.with(|p| p.set(false));
    }
}

/// A reply in flight, counted until dropped.
struct InFlight(Arc<Quiesce>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.replies.fetch_sub(1, Ordering::SeqCst) == 1
            && self.0.stopping.load(Ordering::SeqCst)
        {
            let _g = lock(&self.0.state);
            self.0.changed.notify_all();
        }
    }
}

impl Quiesce {
    /// For a session read by `threads` reader threads.
    pub fn new(threads: usize) -> Arc<Self> {
        Arc::new(Quiesce {
            threads: threads.max(1),
            stopping: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
            replies: AtomicUsize::new(0),
            state: Mutex::new(()),
            changed: Condvar::new(),
        })
    }

    /// First thing in every request handler: `Some` when this thread is to park after the
    /// request; the handler then calls itself again (which gets `None`) and returns,
    /// dropping what this returned.
    pub fn enter(self: &Arc<Self>) -> Option<Parking> {
        if !self.stopping.load(Ordering::Relaxed) || PARKING.with(|p| p.get()) {
            return None;
        }
        PARKING.with(|p| p.set(true));
        Some(Parking(self.clone()))
    }

    /// `reply`, counted as a reply in flight until it ends.
    pub fn track<F: std::future::Future>(
        self: &Arc<Self>,
        reply: F,
    ) -> impl std::future::Future<Output = F::Output> {
        self.replies.fetch_add(1, Ordering::SeqCst);
        let counted = InFlight(self.clone());
        async move {
            let _counted = counted;
            reply.await
        }
    }

    /// Each reader thread parks after the next request it reads.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// The reader threads read again.
    pub fn resume(&self) {
        let _g = lock(&self.state);
        self.stopping.store(false, Ordering::SeqCst);
        self.changed.notify_all();
    }

    /// Reader threads parked now.
    pub fn parked(&self) -> usize {
        self.parked.load(Ordering::SeqCst)
    }

    /// Waits until every reader thread is parked and no reply is in flight, at most until
    /// `end`; calls `nudge` on another thread meanwhile (a request for a thread still
    /// waiting for one). Returns whether it got there.
    pub fn wait_quiet(&self, end: Instant, nudge: impl Fn() + Send + 'static) -> bool {
        let done = Arc::new(AtomicBool::new(false));
        {
            let done = done.clone();
            // May stay blocked in the kernel once every thread is parked: its request
            // waits for the successor; the process ends it on exit.
            let _ = std::thread::Builder::new()
                .name("granary-quiesce".into())
                .spawn(move || {
                    while !done.load(Ordering::SeqCst) && Instant::now() < end {
                        nudge();
                    }
                });
        }
        let mut g = lock(&self.state);
        let quiet = loop {
            if self.parked() >= self.threads && self.replies.load(Ordering::SeqCst) == 0 {
                break true;
            }
            let now = Instant::now();
            if now >= end {
                break false;
            }
            // Bounded: a reply that ends between the check and the wait is seen next turn.
            let step = (end - now).min(Duration::from_millis(50));
            g = self
                .changed
                .wait_timeout(g, step)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        done.store(true, Ordering::SeqCst);
        quiet
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_init_has_the_kernels_layout() {
        let h = pb::FuseHandover {
            kernel_major: 7,
            kernel_minor: 41,
            kernel_flags: (1 << 41) | 1,
            max_readahead: 1 << 20,
            ..Default::default()
        };
        let b = synthetic_init(&h);
        assert_eq!(b.len(), 104);
        assert_eq!(u32::from_le_bytes(b[0..4].try_into().unwrap()), 104);
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 26);
        assert_eq!(u32::from_le_bytes(b[40..44].try_into().unwrap()), 7);
        assert_eq!(u32::from_le_bytes(b[44..48].try_into().unwrap()), 41);
        assert_eq!(u32::from_le_bytes(b[48..52].try_into().unwrap()), 1 << 20);
        // The low word carries FUSE_INIT_EXT, the high word flags2.
        assert_eq!(
            u32::from_le_bytes(b[52..56].try_into().unwrap()),
            1 | (1 << 30)
        );
        assert_eq!(u32::from_le_bytes(b[56..60].try_into().unwrap()), 1 << 9);
    }

    #[test]
    fn messages_and_descriptors_cross_a_socket_and_garbage_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        let h = pb::FuseHandover {
            format: FORMAT,
            generation: 3,
            mountpoint: "/mnt/x".into(),
            ..Default::default()
        };
        send(&a, &h, Some(file.as_fd())).unwrap();
        let (got, fd): (pb::FuseHandover, _) = recv(&b).unwrap();
        assert_eq!(got, h);
        assert!(fd.is_some());
        send(&a, &h, None).unwrap();
        let (_, fd): (pb::FuseHandover, _) = recv(&b).unwrap();
        assert!(fd.is_none());
        // Not a handover message; an oversized length.
        (&a).write_all(b"HTTP/1.1 200 OK\r\n").unwrap();
        assert!(recv::<pb::FuseHandover>(&b).is_err());
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&MARK_NONE).unwrap();
        (&a).write_all(&u32::MAX.to_le_bytes()).unwrap();
        let e = recv::<pb::FuseHandover>(&b).unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        // The peer is this process's user.
        assert_eq!(check_peer(&a).unwrap(), std::process::id());
    }

    #[test]
    fn a_handover_socket_replaces_a_stale_one_never_a_live_one_nor_in_another_users_folder() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s/h.sock");
        let live = listen(&path).unwrap();
        let e = listen(&path).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
        drop(live); // its socket file stays, nobody listens
        let _l = listen(&path).unwrap();
        let mode = std::fs::metadata(dir.path().join("s"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        if rustix::process::geteuid().is_root() {
            let other = dir.path().join("other");
            std::fs::create_dir(&other).unwrap();
            std::os::unix::fs::chown(&other, Some(65534), Some(65534)).unwrap();
            let e = listen(&other.join("h.sock")).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
            let link = dir.path().join("link");
            std::os::unix::fs::symlink(dir.path().join("s"), &link).unwrap();
            let e = listen(&link.join("h.sock")).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        }
    }

    fn poll_until(f: impl Fn() -> bool) {
        let end = Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(Instant::now() < end, "not within 5 s");
            std::thread::yield_now();
        }
    }

    /// Reader threads as fuser runs them: each takes the next request from a shared queue
    /// and answers it, from a task for odd requests.
    #[test]
    fn quiesced_readers_answer_what_they_took_and_take_no_more_until_resumed() {
        use std::sync::mpsc;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_time()
            .build()
            .unwrap();
        let q = Quiesce::new(3);
        let (requests, queue) = mpsc::channel::<u64>();
        let queue = Arc::new(Mutex::new(queue));
        let (answers, answered) = mpsc::channel::<u64>();
        fn handle(
            q: &Arc<Quiesce>,
            rt: &tokio::runtime::Handle,
            n: u64,
            answers: &mpsc::Sender<u64>,
        ) {
            if let Some(_parking) = q.enter() {
                return handle(q, rt, n, answers);
            }
            if n % 2 == 1 {
                let answers = answers.clone();
                rt.spawn(q.track(async move {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    answers.send(n).unwrap();
                }));
            } else {
                answers.send(n).unwrap();
            }
        }
        for _ in 0..3 {
            let (q, queue, answers, rt) = (
                q.clone(),
                queue.clone(),
                answers.clone(),
                rt.handle().clone(),
            );
            std::thread::spawn(move || loop {
                let n = lock(&queue).recv();
                match n {
                    Ok(n) => handle(&q, &rt, n, &answers),
                    Err(_) => return,
                }
            });
        }
        for n in 0..10 {
            requests.send(n).unwrap();
        }
        let mut got: Vec<u64> = (0..10)
            .map(|_| answered.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        got.sort();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        // Stopped: the nudges are the requests each thread handles before it parks; the
        // slow replies from tasks are waited for.
        q.stop();
        // One request per reader thread is all it takes.
        let nudges = Arc::new(AtomicUsize::new(0));
        let (r, n) = (Mutex::new(requests.clone()), nudges.clone());
        let quiet = q.wait_quiet(Instant::now() + Duration::from_secs(10), move || {
            let k = n.fetch_add(1, Ordering::SeqCst);
            if k < 3 {
                let _ = lock(&r).send(101 + 2 * k as u64);
            } else {
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        assert!(quiet);
        assert_eq!(q.parked(), 3);
        // Every request a thread took is answered, the slow ones from tasks included.
        let mut late: Vec<u64> = std::iter::from_fn(|| answered.try_recv().ok()).collect();
        late.sort();
        assert_eq!(late, vec![101, 103, 105]);
        // What comes now waits in the queue until the threads read again.
        requests.send(1000).unwrap();
        assert!(answered.recv_timeout(Duration::from_millis(300)).is_err());
        q.resume();
        assert_eq!(answered.recv_timeout(Duration::from_secs(5)).unwrap(), 1000);
        poll_until(|| q.parked() == 0);
        drop(requests);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_closed_gate_holds_requests_and_waits_for_those_in_progress() {
        let gate = Arc::new(Gate::default());
        let p = gate.pass();
        gate.close();
        let g = gate.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let held = std::thread::spawn(move || {
            let _p = g.pass();
            tx.send(()).unwrap();
        });
        let g = gate.clone();
        let waiter = tokio::spawn(async move { g.drained().await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(p);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("drained once the last pass is gone")
            .unwrap();
        // The request that came while closed is still held, and passes once it opens.
        assert!(rx.try_recv().is_err());
        gate.open();
        rx.recv_timeout(Duration::from_secs(5))
            .expect("passes once open");
        held.join().unwrap();
    }
}
