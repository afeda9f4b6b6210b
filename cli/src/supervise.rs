//! `granary fuse --supervise`: a small process that runs the mount's daemon as its child and
//! holds a copy of the mount's /dev/fuse descriptor, so the mount outlives the daemon. When
//! the daemon dies without unmounting (a crash, an OOM kill, kill -9), a new one takes the
//! mount over from this holder (see `granary_fuse::handover`): programs using the mount wait
//! for it instead of failing, and the kernel sends it the requests the dead one had read.
//!
//! The holder does no I/O for the mount and keeps no cache, so what kills a daemon (memory,
//! a bug on a request path) does not reach it. A daemon that keeps dying right after its
//! start is given up after [`MAX_QUICK_DEATHS`]: the holder then lets the descriptor go, the
//! kernel fails what waits on the mount, and the holder unmounts it and exits with an error.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use granary_fuse::handover;
use granary_proto as pb;

use crate::args::FuseArgs;

/// A daemon that dies within this long of its start died quickly.
const QUICK: Duration = Duration::from_secs(10);
/// Quick deaths in a row after which the holder gives up.
pub const MAX_QUICK_DEATHS: u32 = 5;

/// What the holder keeps for the mount.
#[derive(Default)]
struct Held {
    fd: Option<OwnedFd>,
    session: Option<pb::FuseHandover>,
    /// The daemon unmounted or handed the mount to a successor outside this holder.
    released: bool,
    /// It handed the mount over (not unmounted).
    handed_over: bool,
    /// When the last daemon died (ms since the epoch), for its successor's report.
    died_at_ms: u64,
    /// The serving daemon's passthrough backing files as it mirrors them (kernel id →
    /// backing): a successor after a crash is given them.
    backings: HashMap<u32, pb::FuseBacking>,
    /// Its read handles open through the daemon (fh → inode).
    cached: HashMap<u64, u64>,
    /// The latest mirror connection, until its end was read, and its number.
    mirror: Option<UnixStream>,
    mirror_conn: u64,
}

/// Backing files a holder keeps track of, at most (a daemon parks at most 65,536, and has
/// as many more as files are open in passthrough); beyond it new ones are not recorded.
const MAX_MIRRORED: usize = 1 << 20;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Connects to the holder on `holder` and says `purpose`, with `hello`'s other fields and
/// `fd` beside it.
fn tell(
    holder: &Path,
    purpose: &str,
    hello: pb::FuseHello,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> std::io::Result<UnixStream> {
    let s = UnixStream::connect(holder)?;
    handover::check_peer(&s)?;
    let hello = pb::FuseHello {
        format: handover::FORMAT,
        purpose: purpose.into(),
        pid: std::process::id(),
        ..hello
    };
    handover::send(&s, &hello, fd)?;
    Ok(s)
}

/// Gives the mount's descriptor to the holder on `holder` (a supervised daemon, once it
/// serves the mount).
pub fn hold(holder: &Path, m: &granary_fuse::Mounted) -> anyhow::Result<()> {
    let hello = pb::FuseHello {
        session: m.donor.session(),
        ..Default::default()
    };
    tell(holder, handover::HOLD, hello, Some(m.fuse.as_fd()))?;
    Ok(())
}

/// Mirrors the daemon's passthrough backing files to the holder on `holder` from now on
/// (see `granary_fuse::backing`): after a crash its successor uses the same ones.
pub fn mirror(holder: &Path, m: &granary_fuse::Mounted) -> anyhow::Result<()> {
    let s = tell(holder, handover::MIRROR, pb::FuseHello::default(), None)?;
    m.donor.mirror_to(s);
    Ok(())
}

/// Tells the holder on `holder` that the daemon unmounts or `handed_over` the mount: it
/// lets the descriptor go and ends with the daemon (best effort: logged when it fails).
pub fn release(holder: &Path, handed_over: bool) {
    let hello = pb::FuseHello {
        handed_over,
        ..Default::default()
    };
    let told = tell(holder, handover::RELEASE, hello, None).map(|s| {
        // Wait for the holder's word that it let go (it closes the connection).
        handover::wait_closed(&s, Duration::from_secs(5));
    });
    if let Err(e) = told {
        tracing::warn!(holder = %holder.display(), error = %e, "could not tell the supervisor that the mount is released");
    }
}

/// Serves the holder's socket: daemons give it the descriptor, or release it; a new daemon
/// takes it.
fn serve(listener: std::os::unix::net::UnixListener, held: Arc<Mutex<Held>>, mountpoint: String) {
    for conn in listener.incoming() {
        let Ok(s) = conn else { continue };
        if let Err(e) = serve_one(&s, &held, &mountpoint) {
            tracing::warn!(error = %e, "a request to the mount's supervisor failed");
        }
    }
}

/// Reads a daemon's mirror connection `s` (number `conn`) until it ends or a newer one
/// replaces it.
fn mirror_loop(s: UnixStream, held: Arc<Mutex<Held>>, conn: u64, pid: u32) {
    let mut one = [0u8; 1];
    loop {
        let _ = s.set_read_timeout(None);
        // Waits for bytes without taking them: they are read with the state locked, so a
        // successor's "take" (which drains the connection first) sees all of them.
        match rustix::net::recv(&s, &mut one, rustix::net::RecvFlags::PEEK) {
            Ok((_, n)) if n > 0 => {}
            Err(rustix::io::Errno::INTR) => continue,
            _ => break,
        }
        let mut h = lock(&held);
        if h.mirror_conn != conn {
            return;
        }
        if let Err(e) = drain_mirror(&s, &mut h) {
            tracing::warn!(error = %e, "the daemon's mirror of passthrough backing files broke off");
            break;
        }
    }
    // The end of a daemon that died: what it wrote is what a successor needs (a message cut
    // short by its death was never acted on). The end of one that still runs: the holder
    // no longer hears of its changes, and what it knows would go stale.
    let end = Instant::now() + Duration::from_secs(1);
    while !handover::exited(pid) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let alive = !handover::exited(pid);
    let mut h = lock(&held);
    if h.mirror_conn == conn {
        h.mirror = None;
        if alive {
            tracing::warn!(
                pid,
                "the daemon's mirror of passthrough backing files ended while it runs: after a crash, files open in passthrough may fail to open again until closed"
            );
            h.backings.clear();
            h.cached.clear();
        }
    }
}

/// Applies what waits on mirror connection `s` (with the state locked).
fn drain_mirror(s: &UnixStream, h: &mut Held) -> std::io::Result<()> {
    while rustix::io::ioctl_fionread(s)? > 0 {
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let (m, _): (pb::FuseMirror, _) = handover::recv(s)?;
        apply_mirror(&mut h.backings, &mut h.cached, m);
    }
    Ok(())
}

fn apply_mirror(
    backings: &mut HashMap<u32, pb::FuseBacking>,
    cached: &mut HashMap<u64, u64>,
    m: pb::FuseMirror,
) {
    if m.snapshot {
        backings.clear();
        cached.clear();
    }
    for e in m.cached_opened {
        if cached.len() < MAX_MIRRORED {
            cached.insert(e.fh, e.inode);
        }
    }
    for e in m.cached_released {
        cached.remove(&e.fh);
    }
    for b in m.registered {
        if backings.len() < MAX_MIRRORED || backings.contains_key(&b.backing_id) {
            backings.insert(b.backing_id, b);
        }
    }
    for e in m.opened {
        if let Some(b) = backings.get_mut(&e.backing_id) {
            if b.handles.len() < MAX_MIRRORED {
                b.handles.push(e.fh);
                b.leases.extend(e.leases);
            }
        }
    }
    for e in m.released {
        if let Some(b) = backings.get_mut(&e.backing_id) {
            b.handles.retain(|h| *h != e.fh);
        }
    }
    for id in m.closed {
        backings.remove(&id);
    }
}

/// The backing files a successor after a crash takes on: those whose handles are counted
/// with their handles, the others as orphans (`FuseBacking::opens_unknown`).
fn crashed_backings(backings: &HashMap<u32, pb::FuseBacking>) -> Vec<pb::FuseBacking> {
    backings
        .values()
        .map(|b| {
            let mut b = b.clone();
            b.opens = if b.opens_unknown {
                0
            } else {
                u32::try_from(b.handles.len()).unwrap_or(u32::MAX)
            };
            b
        })
        .collect()
}

fn serve_one(s: &UnixStream, held: &Arc<Mutex<Held>>, mountpoint: &str) -> anyhow::Result<()> {
    let peer = handover::check_peer(s)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let (hello, fd): (pb::FuseHello, _) = handover::recv(s)?;
    if hello.format != handover::FORMAT {
        bail!(
            "handover format {} is not {}",
            hello.format,
            handover::FORMAT
        );
    }
    match hello.purpose.as_str() {
        handover::HOLD => {
            let (Some(fd), Some(session)) = (fd, hello.session) else {
                bail!("a daemon asked to hold its mount without its descriptor or session");
            };
            tracing::info!(
                pid = hello.pid,
                generation = session.generation,
                "holding the mount's descriptor"
            );
            let mut h = lock(held);
            h.fd = Some(fd);
            h.session = Some(session);
            h.released = false;
        }
        handover::RELEASE => {
            tracing::info!(pid = hello.pid, "the daemon released the mount");
            let mut h = lock(held);
            h.fd = None;
            h.released = true;
            h.handed_over = hello.handed_over;
        }
        handover::MIRROR => {
            let mut h = lock(held);
            h.mirror_conn += 1;
            let conn = h.mirror_conn;
            let (a, b) = (s.try_clone()?, s.try_clone()?);
            h.mirror = Some(a);
            drop(h);
            let held = held.clone();
            std::thread::Builder::new()
                .name("granary-mirror".into())
                .spawn(move || mirror_loop(b, held, conn, peer))?;
        }
        handover::TAKE => {
            let mut h = lock(held);
            // Everything the dead daemon wrote before it died is read first.
            if let Some(m) = h.mirror.take() {
                if let Err(e) = drain_mirror(&m, &mut h) {
                    tracing::warn!(error = %e, "the dead daemon's mirror of passthrough backing files ends in a broken message");
                }
                h.mirror_conn += 1;
            }
            let answer = match (&h.fd, &h.session) {
                (Some(fd), Some(session)) if !h.released => {
                    let mut a = session.clone();
                    a.format = handover::FORMAT;
                    a.mountpoint = mountpoint.to_string();
                    a.paused_at_ms = h.died_at_ms;
                    a.backings = crashed_backings(&h.backings);
                    a.cached = h
                        .cached
                        .iter()
                        .map(|(fh, inode)| pb::FuseHandleEvent {
                            fh: *fh,
                            inode: *inode,
                            ..Default::default()
                        })
                        .collect();
                    tracing::info!(
                        backings = a.backings.len(),
                        "handing the mount to a new daemon"
                    );
                    handover::send(s, &a, Some(fd.as_fd()))
                }
                _ => handover::send(
                    s,
                    &pb::FuseHandover {
                        format: handover::FORMAT,
                        refused: "the supervisor holds no mount".into(),
                        ..Default::default()
                    },
                    None,
                ),
            };
            answer?;
        }
        other => bail!("{other:?} is not a request the supervisor serves"),
    }
    Ok(())
}

/// The daemon's arguments: this process's, less `--supervise`.
fn daemon_args() -> Vec<String> {
    std::env::args()
        .skip(1)
        .filter(|a| a != "--supervise")
        .collect()
}

pub async fn run(a: &FuseArgs) -> anyhow::Result<()> {
    handover::kernel_can_resend(a.handover.no_resend).map_err(anyhow::Error::msg)?;
    if a.handover.takeover.is_none() {
        granary_fuse::check_mountpoint(&a.mount)?;
    }
    let socket = a
        .handover
        .handover_socket
        .clone()
        .unwrap_or_else(|| handover::default_socket(&a.mount));
    // One per supervisor: during a rolling update two run side by side for one mount.
    let holder_path: PathBuf = socket.with_extension(format!("holder.{}", std::process::id()));
    let listener = handover::listen(&holder_path)
        .with_context(|| format!("listening on {}", holder_path.display()))?;
    let mountpoint = handover::mount_path(&a.mount).display().to_string();
    let held = Arc::new(Mutex::new(Held::default()));
    {
        let (held, mp) = (held.clone(), mountpoint.clone());
        std::thread::Builder::new()
            .name("granary-holder".into())
            .spawn(move || serve(listener, held, mp))?;
    }
    let exe = std::env::current_exe().context("finding this program")?;
    let args = daemon_args();
    let mut quick_deaths = 0u32;
    let mut restart = false;
    eprintln!(
        "granary supervisor (pid {}) runs the mount's daemon",
        std::process::id()
    );
    loop {
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.args(&args).arg("--holder-socket").arg(&holder_path);
        if restart {
            cmd.arg("--take-from").arg(&holder_path);
        }
        let started = Instant::now();
        let mut child = cmd.spawn().context("starting the mount's daemon")?;
        let pid = child.id().unwrap_or(0);
        // A dying daemon may keep a thread stuck on its own mount until a successor answers
        // (see `handover::exited`): it counts as ended once only such threads are left.
        let dying = async {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if handover::exited(pid) {
                    break;
                }
            }
        };
        let status = tokio::select! {
            s = child.wait() => Some(s?),
            _ = dying => None,
            _ = crate::servers::shutdown_signal() => {
                // The daemon unmounts (and releases the descriptor) on SIGTERM.
                if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                    let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
                }
                let s = child.wait().await?;
                let _ = std::fs::remove_file(&holder_path);
                std::process::exit(s.code().unwrap_or(1));
            }
        };
        let (released, handed_over, holding) = {
            let h = lock(&held);
            (h.released, h.handed_over, h.fd.is_some())
        };
        let status = match status {
            Some(s) => s,
            // An orderly end leaves no thread stuck: its status comes at once.
            None if released || !holding => child.wait().await?,
            None => {
                tokio::spawn(async move { child.wait().await }); // reaped once it ends
                lock(&held).died_at_ms = handover::now_ms();
                eprintln!(
                    "granary supervisor: the mount's daemon (pid {pid}) is exiting with a thread stuck on its mount; starting another that takes the mount over"
                );
                restart = true;
                quick_deaths += u32::from(started.elapsed() < QUICK);
                continue;
            }
        };
        if handed_over && a.handover.wait_after_handover {
            eprintln!("granary supervisor: the mount was handed to another daemon; waiting for SIGTERM (this supervisor serves and unmounts nothing)");
            let _ = std::fs::remove_file(&holder_path);
            crate::servers::shutdown_signal().await;
            std::process::exit(0);
        }
        if released || !holding {
            // Unmounted, handed over to a successor, or never mounted: nothing to keep.
            let _ = std::fs::remove_file(&holder_path);
            if !status.success() && !holding && !released {
                bail!("the mount's daemon ended ({status}) before serving the mount");
            }
            std::process::exit(status.code().unwrap_or(0));
        }
        lock(&held).died_at_ms = handover::now_ms();
        if started.elapsed() < QUICK {
            quick_deaths += 1;
        } else {
            quick_deaths = 0;
        }
        if quick_deaths >= MAX_QUICK_DEATHS {
            lock(&held).fd = None; // the kernel fails what waits on the mount
            let _ = granary_fuse::unmount_path(&a.mount);
            let _ = std::fs::remove_file(&holder_path);
            bail!(
                "the mount's daemon died {quick_deaths} times within {QUICK:?} of its start ({status}); the mount at {} is given up",
                a.mount.display()
            );
        }
        eprintln!(
            "granary supervisor: the mount's daemon (pid {pid}) ended ({status}) without unmounting; starting another that takes the mount over"
        );
        // Back off a little when it keeps dying at once.
        if quick_deaths > 1 {
            tokio::time::sleep(Duration::from_millis(200 << quick_deaths.min(5))).await;
        }
        restart = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backing(id: u32, inode: u64, handles: &[u64], unknown: bool) -> pb::FuseBacking {
        pb::FuseBacking {
            inode,
            version: 1,
            backing_id: id,
            opens: handles.len() as u32,
            opens_unknown: unknown,
            handles: handles.to_vec(),
            ..Default::default()
        }
    }

    fn leases(id: u64) -> pb::FuseLeases {
        pb::FuseLeases {
            worker: Some(pb::WorkerInfo::default()),
            blocks: vec![pb::BlockId::default()],
            lease_ids: vec![id],
        }
    }

    #[test]
    fn the_mirror_follows_a_daemons_backing_files_and_a_crash_successor_gets_them() {
        let (mut m, mut c) = (HashMap::new(), HashMap::new());
        apply_mirror(
            &mut m,
            &mut c,
            pb::FuseMirror {
                snapshot: true,
                registered: vec![backing(1, 10, &[100], false), backing(2, 20, &[], true)],
                cached_opened: [(500, 50), (501, 51)]
                    .map(|(fh, inode)| pb::FuseHandleEvent {
                        fh,
                        inode,
                        ..Default::default()
                    })
                    .to_vec(),
                ..Default::default()
            },
        );
        // A second handle on 1 with its lease, a third that is released, 2 closed.
        for (opened, released) in [(Some(101), None), (Some(102), None), (None, Some(100))] {
            apply_mirror(
                &mut m,
                &mut c,
                pb::FuseMirror {
                    opened: opened
                        .map(|fh| pb::FuseHandleEvent {
                            backing_id: 1,
                            fh,
                            leases: Some(leases(fh)),
                            ..Default::default()
                        })
                        .into_iter()
                        .collect(),
                    released: released
                        .map(|fh| pb::FuseHandleEvent {
                            backing_id: 1,
                            fh,
                            leases: None,
                            ..Default::default()
                        })
                        .into_iter()
                        .collect(),
                    ..Default::default()
                },
            );
        }
        apply_mirror(
            &mut m,
            &mut c,
            pb::FuseMirror {
                registered: vec![backing(3, 30, &[], true)],
                closed: vec![2],
                cached_released: vec![pb::FuseHandleEvent {
                    fh: 500,
                    inode: 50,
                    ..Default::default()
                }],
                ..Default::default()
            },
        );
        // Events of ids it does not know change nothing.
        apply_mirror(
            &mut m,
            &mut c,
            pb::FuseMirror {
                opened: vec![pb::FuseHandleEvent {
                    backing_id: 9,
                    fh: 5,
                    leases: None,
                    ..Default::default()
                }],
                closed: vec![8],
                ..Default::default()
            },
        );
        let mut got = crashed_backings(&m);
        got.sort_by_key(|b| b.backing_id);
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].backing_id, got[0].opens), (1, 2));
        assert_eq!(got[0].handles, vec![101, 102]);
        assert_eq!(got[0].leases.len(), 2);
        assert!(!got[0].opens_unknown);
        // A parked kind: its handles are not counted; the successor keeps it as an orphan.
        assert_eq!((got[1].backing_id, got[1].opens), (3, 0));
        assert!(got[1].opens_unknown);
        assert_eq!(c, HashMap::from([(501, 51)]));
        // A new daemon's snapshot replaces all of it.
        apply_mirror(
            &mut m,
            &mut c,
            pb::FuseMirror {
                snapshot: true,
                registered: vec![backing(7, 70, &[1], false)],
                ..Default::default()
            },
        );
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), vec![7]);
        assert!(c.is_empty());
    }
}
