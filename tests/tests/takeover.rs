//! A mount outlives its daemon: a new `granary fuse --takeover` replaces a running one, and
//! under `--supervise` a daemon killed with SIGKILL is replaced by its supervisor, while
//! ordinary programs read through the mount and hold files open (docs/operations.md,
//! "Restarting and upgrading a mount"). Real processes, a real FUSE mount, Python readers;
//! every byte checked against the source's SHA-256. Also: one file opened by several
//! programs in the kernel's two I/O modes (through the daemon and in passthrough), which
//! the kernel lets an inode have only one at a time.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use granary_tests::*;

const MIB: u64 = 1024 * 1024;

/// Reads half of a file, says "half", waits for a line on its input, reads the rest and
/// prints the SHA-256 of the whole; the file stays open throughout.
const HOLD: &str = r#"
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb", buffering=0) as f:
    size = f.seek(0, 2)
    f.seek(0)
    done = 0
    while done < size // 2:
        b = f.read(min(1 << 20, size // 2 - done))
        if not b:
            break
        h.update(b)
        done += len(b)
    print("half", flush=True)
    sys.stdin.readline()
    while True:
        b = f.read(1 << 20)
        if not b:
            break
        h.update(b)
print("sha", h.hexdigest(), flush=True)
"#;

/// A training loader: reads every file of a manifest ("sha256 path" lines) whole, in a new
/// random order each pass, checks each against its SHA-256, until a line arrives on its
/// input; "pass N" after each pass, "ok FILES" at the end, "MISMATCH path" on a wrong byte.
const LOADER: &str = r#"
import hashlib, random, sys, threading
files = [l.split(" ", 1) for l in open(sys.argv[1]).read().splitlines()]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
n, k = 0, 0
while not stop.is_set():
    random.shuffle(files)
    for sha, p in files:
        with open(p, "rb") as f:
            d = f.read()
        if hashlib.sha256(d).hexdigest() != sha:
            print("MISMATCH", p, flush=True)
            sys.exit(2)
        n += 1
    print("pass", k, flush=True)
    k += 1
print("ok", n, flush=True)
"#;

/// Writes 1 MiB to a new file, says "wrote", waits for a line, writes 1 MiB more and
/// closes: "closed", or "ERR errno" when a write or the close fails.
const WRITER: &str = r#"
import os, sys
try:
    f = open(sys.argv[1], "wb", buffering=0)
    f.write(os.urandom(1 << 20))
    print("wrote", flush=True)
    sys.stdin.readline()
    f.write(os.urandom(1 << 20))
    f.close()
    print("closed", flush=True)
except OSError as e:
    print("ERR", e.errno, flush=True)
"#;

/// Hostile or confused peers on a handover socket: garbage, a format from the future, a
/// request the daemon does not serve; prints what each got back.
const PROBE: &str = r#"
import socket, struct, sys
def ask(payload):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(sys.argv[1])
    s.sendall(payload)
    data = b""
    while True:
        try:
            b = s.recv(65536)
        except ConnectionResetError:  # closed with our bytes unread
            break
        if not b:
            break
        data += b
    return data
hello = lambda body: b"GMS1" + struct.pack("<I", len(body)) + body
print("garbage", ask(b"GET / HTTP/1.1\r\n\r\n"), flush=True)
print("future", ask(hello(b"\x08\x63\x12\x04take")), flush=True)
print("hold", ask(hello(b"\x08\x01\x12\x04hold")), flush=True)
"#;

/// A Python program whose output lines are read as they come.
struct Script {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Script {
    fn start(name: &str, code: &str, args: &[&str]) -> Script {
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(code)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Script {
            name: name.into(),
            stdin: child.stdin.take(),
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// The next line starting with `prefix` (the rest of it), within `limit`.
    fn expect(&mut self, prefix: &str, limit: Duration) -> String {
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if let Some(rest) = l.strip_prefix(prefix) {
                        return rest.trim().to_string();
                    }
                    assert!(!l.starts_with("MISMATCH"), "{}: {l}", self.name);
                }
                Err(RecvTimeoutError::Timeout) => panic!(
                    "{} printed no {prefix:?} within {limit:?}; it printed {:?}",
                    self.name, self.seen
                ),
                Err(RecvTimeoutError::Disconnected) => panic!(
                    "{} ended ({:?}) without printing {prefix:?}; it printed {:?}",
                    self.name,
                    self.child.wait(),
                    self.seen
                ),
            }
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{line}").expect("writing to the script");
        stdin.flush().expect("flushing");
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        // Not waited for: a program stuck on a mount that no longer answers would hold the
        // test forever (the test has failed already then).
        let _ = self.child.kill();
    }
}

fn sha_of(p: &Path) -> String {
    sh(&format!("sha256sum < '{}'", p.display()))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Small samples in folders, one big file that will be cached (it opens in passthrough) and
/// one that will not (read through the daemon); the loader's manifest of the samples as
/// seen through the mount at `data`.
fn dataset(root: &Path, data: &Path) -> (PathBuf, PathBuf) {
    let src = root.join("ufs");
    for i in 0..300u64 {
        let p = src.join(format!("s{}/f{i:03}.bin", i % 6));
        random_file(&p, 16 * 1024 + i * 97).unwrap();
    }
    random_file(&src.join("big/cached.bin"), 48 * MIB + 3).unwrap();
    random_file(&src.join("big/cold.bin"), 24 * MIB + 5).unwrap();
    let sums = tree_sums(&src).unwrap();
    let manifest = root.join("manifest.txt");
    let lines: Vec<String> = sums
        .iter()
        .filter_map(|(p, sha)| Some((p.strip_prefix("./s")?, sha)))
        .map(|(p, sha)| format!("{sha} {}/s{p}", data.display()))
        .collect();
    assert_eq!(lines.len(), 300);
    std::fs::write(&manifest, lines.join("\n")).unwrap();
    (src, manifest)
}

/// A test's folder: the source tree, the mount point, the loader's manifest, the handover
/// socket.
struct Setup {
    root: tempfile::TempDir,
    mp: PathBuf,
    data: PathBuf,
    src: PathBuf,
    manifest: PathBuf,
    socket: String,
}

fn setup(prefix: &str) -> Setup {
    let root = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let mp = root.path().join("mnt");
    let data = mp.join("data");
    let (src, manifest) = dataset(root.path(), &data);
    let socket = root.path().join("handover.sock").display().to_string();
    Setup {
        root,
        mp,
        data,
        src,
        manifest,
        socket,
    }
}

fn inode_of(p: &Path) -> String {
    sh(&format!("stat -c %i '{}'", p.display()))
        .unwrap()
        .trim()
        .to_string()
}

/// Bytes of `p` in the kernel's page cache (`fincore`, which opens the file).
fn resident_bytes(p: &Path) -> u64 {
    let out = sh(&format!(
        "fincore --bytes --noheadings --output RES '{}'",
        p.display()
    ))
    .unwrap();
    out.trim()
        .parse()
        .unwrap_or_else(|e| panic!("fincore said {out:?}: {e}"))
}

/// The pid in a "(daemon pid N" log line.
fn daemon_pid(line: &str) -> u32 {
    let rest = line
        .split("daemon pid ")
        .nth(1)
        .unwrap_or_else(|| panic!("no daemon pid in {line:?}"));
    rest.split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no daemon pid in {line:?}"))
}

#[test]
fn a_new_daemon_takes_the_mount_over_while_programs_read_and_hold_files_open() {
    let Setup {
        root,
        mp,
        data,
        src,
        manifest,
        socket,
    } = setup("takeover");
    let rp = root.path();
    let mut c = Cluster::start_opts(rp, 1, "1GiB", &src, &["--handover-socket", &socket]).unwrap();
    let _unmount = UnmountOnDrop(mp.clone());
    // Cache the big file and the samples (they open in passthrough from now on), not the
    // cold file.
    assert_eq!(
        sha_of(&data.join("big/cached.bin")),
        sha_of(&src.join("big/cached.bin"))
    );
    sh(&format!("cat '{}'/s*/* > /dev/null", data.display())).unwrap();
    drop_page_cache(&data.join("big")).unwrap();

    let mut loader = Script::start("loader", LOADER, &[&manifest.display().to_string()]);
    loader.expect("pass", Duration::from_secs(120));
    let cached = data.join("big/cached.bin").display().to_string();
    let cold = data.join("big/cold.bin").display().to_string();
    let mut pt = Script::start("passthrough reader", HOLD, &[&cached]);
    pt.expect("half", Duration::from_secs(60));
    let mut daemon_read = Script::start("daemon reader", HOLD, &[&cold]);
    daemon_read.expect("half", Duration::from_secs(60));
    assert!(c.fuse.metric("granary_client_passthrough_opens_total") >= 1.0);
    // What the kernel holds: inode numbers, and the pages of the half of the uncached file
    // read through the daemon (in the kernel's page cache).
    let watched = [
        data.join("big/cached.bin"),
        data.join("big/cold.bin"),
        data.join("s1"),
        data.join("s1/f001.bin"),
    ];
    let inodes: Vec<String> = watched.iter().map(|p| inode_of(p)).collect();
    let resident = resident_bytes(&data.join("big/cold.bin"));
    assert!(
        resident >= 8 * MIB,
        "{resident} bytes of the file read are cached"
    );

    // Peers that are not a successor get a clear refusal or nothing, and change nothing.
    let mut probe = Script::start("probe", PROBE, &[&socket]);
    assert_eq!(probe.expect("garbage", Duration::from_secs(60)), "b''");
    let future = probe.expect("future", Duration::from_secs(60));
    assert!(
        future.contains("handover format 99 asked for, this daemon speaks 1"),
        "{future}"
    );
    let hold = probe.expect("hold", Duration::from_secs(60));
    assert!(
        hold.contains("is not a request this daemon serves"),
        "{hold}"
    );
    let other_user = Command::new("runuser")
        .args(["-u", "nobody", "--", "python3", "-c"])
        .arg("import socket,sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])")
        .arg(&socket)
        .output()
        .unwrap();
    assert!(
        !other_user.status.success(),
        "another user reached the handover socket"
    );
    assert!(is_mounted(&mp));
    assert!(
        c.fuse.proc.child.try_wait().unwrap().is_none(),
        "a probe stopped the daemon"
    );

    // The successor: same mount, its own metrics address.
    let metrics = format!("127.0.0.1:{}", free_port());
    let m = mp.display().to_string();
    let mut new = Proc::spawn(
        "fuse-new",
        rp,
        &[
            "fuse",
            "--master",
            &c.master.addr,
            "--mount",
            &m,
            "--metrics-listen",
            &metrics,
            "--handover-socket",
            &socket,
            "--takeover",
        ],
    )
    .unwrap();
    let line = new
        .wait_for_line("granary took over the mount", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}\nthe old daemon's log:\n{}", c.fuse.proc.log_text()));
    assert!(line.contains("generation 1"), "{line}");
    let mut old = c.fuse;
    let status = poll("the old daemon to exit", Duration::from_secs(30), || {
        old.proc.child.try_wait().ok().flatten()
    })
    .unwrap();
    assert!(status.success(), "the old daemon ended with {status}");
    assert!(old.proc.log_text().contains("handed the mount at"));
    assert!(is_mounted(&mp), "the mount is gone after the takeover");

    // Inode numbers and the kernel's pages stay: a new open of the file keeps them (the new
    // daemon knows their version from the old one).
    assert_eq!(
        watched.iter().map(|p| inode_of(p)).collect::<Vec<_>>(),
        inodes
    );
    // (The kernel may reclaim a few of them meanwhile; a takeover that lost them left none.)
    let after = resident_bytes(&data.join("big/cold.bin"));
    assert!(
        after >= resident / 2,
        "the kernel's pages of a file went with the takeover: {resident} bytes cached before, {after} after"
    );

    // The loader goes on through the new daemon: two more whole passes, every byte checked.
    loader.expect("pass", Duration::from_secs(120));
    loader.expect("pass", Duration::from_secs(120));
    // A file open in passthrough across the takeover opens again meanwhile (the kernel
    // requires the backing file the old daemon gave it).
    let opens_before = metric_at(&metrics, "granary_client_passthrough_opens_total");
    let again = sh(&format!(
        "sha256sum < '{}'",
        data.join("big/cached.bin").display()
    ))
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}\nthe new daemon's log:\n{}\nthe old daemon's log:\n{}",
            new.log_text(),
            old.proc.log_text()
        )
    });
    assert_eq!(
        again.split_whitespace().next(),
        Some(sha_of(&src.join("big/cached.bin")).as_str())
    );
    assert!(metric_at(&metrics, "granary_client_passthrough_opens_total") > opens_before);
    // The files held open read on, through handles the old daemon gave.
    pt.send("go");
    assert_eq!(
        pt.expect("sha", Duration::from_secs(60)),
        sha_of(&src.join("big/cached.bin"))
    );
    daemon_read.send("go");
    assert_eq!(
        daemon_read.expect("sha", Duration::from_secs(60)),
        sha_of(&src.join("big/cold.bin"))
    );
    loader.send("stop");
    let n: u64 = loader
        .expect("ok", Duration::from_secs(120))
        .parse()
        .unwrap();
    assert!(n >= 900, "the loader read {n} files");
    // Every handle opened, before the takeover or after, is released: none outlives its
    // program (a handle entered after the kernel released it was handed over as one still
    // open, and the file it named was then refused passthrough: EIO for a program holding
    // it open in passthrough).
    poll(
        "the mount's open files to be released",
        Duration::from_secs(10),
        || (metric_at(&metrics, "granary_client_fuse_open_files") == 0.0).then_some(()),
    )
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}: {} open",
            metric_at(&metrics, "granary_client_fuse_open_files")
        )
    });
    assert_eq!(
        metric_at(&metrics, "granary_client_fuse_takeovers_total"),
        1.0
    );
    assert_eq!(metric_at(&metrics, "granary_client_fuse_generation"), 1.0);

    // A second takeover refused cleanly when nothing listens; the new daemon unmounts on
    // SIGTERM like any other.
    assert_eq!(new.stop("TERM", Duration::from_secs(30)).unwrap(), Some(0));
    poll("the mount to go", Duration::from_secs(10), || {
        (!is_mounted(&mp)).then_some(())
    })
    .unwrap();
    let out = granary(&[
        "fuse",
        "--master",
        &c.master.addr,
        "--mount",
        &m,
        "--handover-socket",
        &socket,
        "--takeover",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no daemon serving this mount answers"),
        "{err}"
    );
    drop(old);
}

/// On a kernel that cannot resend (Linux < 6.9; `--no-resend` acts so here, and the kernel
/// is never asked to), the old daemon answers every request it read before it hands over:
/// a request left unanswered would leave its program waiting forever.
#[test]
fn without_resend_the_old_daemon_answers_all_it_read_and_then_hands_the_mount_over() {
    let Setup {
        root,
        mp,
        data,
        src,
        manifest,
        socket,
    } = setup("quiesce");
    let rp = root.path();
    // No passthrough either: kernels without resend have none.
    let opts = [
        "--handover-socket",
        &socket,
        "--no-resend",
        "--no-passthrough",
    ];
    let mut c = Cluster::start_opts(rp, 1, "1GiB", &src, &opts).unwrap();
    let _unmount = UnmountOnDrop(mp.clone());
    c.fuse
        .proc
        .wait_for_line("FUSE request resend is off", Duration::from_secs(10))
        .unwrap();
    sh(&format!("cat '{}'/s*/* > /dev/null", data.display())).unwrap();
    let mut loader = Script::start("loader", LOADER, &[&manifest.display().to_string()]);
    loader.expect("pass", Duration::from_secs(120));
    // A second loader: more requests in flight at any moment of the handovers.
    let mut loader2 = Script::start("loader 2", LOADER, &[&manifest.display().to_string()]);
    loader2.expect("pass", Duration::from_secs(120));
    let cold = data.join("big/cold.bin");
    let mut daemon_read = Script::start("daemon reader", HOLD, &[&cold.display().to_string()]);
    daemon_read.expect("half", Duration::from_secs(60));
    let inodes: Vec<String> = [&cold, &data.join("s1"), &data.join("s1/f001.bin")]
        .iter()
        .map(|p| inode_of(p))
        .collect();
    // A file read from the store while the first takeover happens: its reads are answered
    // from tasks, which the old daemon waits for.
    let big = data.join("big/cached.bin").display().to_string();
    let mut streaming = Script::start("streaming reader", HOLD, &[&big]);
    streaming.expect("half", Duration::from_secs(60));
    streaming.send("go");

    // Two takeovers in a row, the second asking for --supervise (which cannot recover
    // from a crash without resend, says so and serves unsupervised).
    let m = mp.display().to_string();
    let mut first = c.fuse;
    let mut news: Vec<Proc> = Vec::new();
    let mut metrics = String::new();
    for (generation, extra) in [(1, None), (2, Some("--supervise"))] {
        metrics = format!("127.0.0.1:{}", free_port());
        let mut args = vec![
            "fuse",
            "--master",
            &c.master.addr,
            "--mount",
            &m,
            "--metrics-listen",
            &metrics,
        ];
        args.extend(opts);
        args.push("--takeover");
        args.extend(extra);
        let mut new = Proc::spawn(&format!("fuse-{generation}"), rp, &args).unwrap();
        let old = news.last_mut().unwrap_or(&mut first.proc);
        if extra.is_some() {
            new.wait_for_line("--supervise is ignored", Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("{e:#}\nthe old daemon's log:\n{}", old.log_text()));
        }
        let line = new
            .wait_for_line("granary took over the mount", Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e:#}\nthe old daemon's log:\n{}", old.log_text()));
        assert!(line.contains(&format!("generation {generation}")), "{line}");
        assert!(
            line.contains("it answered every request it had read first"),
            "{line}"
        );
        let status = poll("the old daemon to exit", Duration::from_secs(30), || {
            old.child.try_wait().ok().flatten()
        })
        .unwrap();
        assert!(status.success(), "the old daemon ended with {status}");
        assert!(is_mounted(&mp), "the mount is gone after the takeover");
        // Both loaders read on: whole passes, every byte checked.
        for l in [&mut loader, &mut loader2] {
            l.expect("pass", Duration::from_secs(120));
        }
        news.push(new);
    }
    assert_eq!(
        [&cold, &data.join("s1"), &data.join("s1/f001.bin")]
            .iter()
            .map(|p| inode_of(p))
            .collect::<Vec<_>>(),
        inodes
    );
    daemon_read.send("go");
    assert_eq!(
        daemon_read.expect("sha", Duration::from_secs(60)),
        sha_of(&src.join("big/cold.bin"))
    );
    assert_eq!(
        streaming.expect("sha", Duration::from_secs(60)),
        sha_of(&src.join("big/cached.bin"))
    );
    for l in [&mut loader, &mut loader2] {
        l.send("stop");
        let n: u64 = l.expect("ok", Duration::from_secs(120)).parse().unwrap();
        assert!(n >= 900, "a loader read {n} files");
    }
    // The kernel was never asked to resend; the last daemon took over once.
    assert_eq!(
        metric_at(&metrics, "granary_client_fuse_resent_requests_total"),
        0.0
    );
    assert_eq!(metric_at(&metrics, "granary_client_fuse_generation"), 2.0);
    let last = news.last_mut().unwrap();
    assert_eq!(last.stop("TERM", Duration::from_secs(30)).unwrap(), Some(0));
    poll("the mount to go", Duration::from_secs(10), || {
        (!is_mounted(&mp)).then_some(())
    })
    .unwrap();
    drop(first);
}

#[test]
fn a_supervised_daemon_killed_with_sigkill_costs_readers_a_pause_and_writers_a_clear_error() {
    let Setup {
        root,
        mp,
        data,
        src,
        manifest,
        socket,
    } = setup("supervise");
    let rp = root.path();
    let c = Cluster::start_opts(
        rp,
        1,
        "1GiB",
        &src,
        &["--supervise", "--handover-socket", &socket],
    )
    .unwrap();
    let _unmount = UnmountOnDrop(mp.clone());
    let mut fuse = c.fuse;
    let first = daemon_pid(
        &fuse
            .proc
            .wait_for_line("granary mounted at", Duration::from_secs(5))
            .unwrap(),
    );
    assert_ne!(
        first,
        fuse.proc.pid(),
        "the daemon runs as the supervisor's child"
    );
    sh(&format!("cat '{}'/s*/* > /dev/null", data.display())).unwrap();
    // The big file cached: it opens in passthrough from now on.
    assert_eq!(
        sha_of(&data.join("big/cached.bin")),
        sha_of(&src.join("big/cached.bin"))
    );
    let metrics = fuse.metrics.clone().unwrap();

    let mut loader = Script::start("loader", LOADER, &[&manifest.display().to_string()]);
    loader.expect("pass", Duration::from_secs(120));
    let cold = data.join("big/cold.bin").display().to_string();
    let mut reader = Script::start("reader", HOLD, &[&cold]);
    reader.expect("half", Duration::from_secs(60));
    // Files open in passthrough across the crash: the big one (under leases) and a sample
    // (its backing file parked between opens).
    let opens = metric_at(&metrics, "granary_client_passthrough_opens_total");
    let cached = data.join("big/cached.bin").display().to_string();
    let mut pt = Script::start("passthrough reader", HOLD, &[&cached]);
    pt.expect("half", Duration::from_secs(60));
    let sample = data.join("s1/f001.bin");
    let mut pt_small = Script::start(
        "passthrough sample reader",
        HOLD,
        &[&sample.display().to_string()],
    );
    pt_small.expect("half", Duration::from_secs(60));
    assert!(
        metric_at(&metrics, "granary_client_passthrough_opens_total") >= opens + 2.0,
        "the held files did not open in passthrough"
    );
    let out = data.join("out.bin").display().to_string();
    let mut writer = Script::start("writer", WRITER, &[&out]);
    writer.expect("wrote", Duration::from_secs(60));

    sh(&format!("kill -9 {first}")).unwrap();
    let line = fuse
        .proc
        .wait_for_line("granary took over the mount", Duration::from_secs(60))
        .unwrap_or_else(|e| {
            // Where the killed daemon's threads are (a thread stuck in the kernel keeps a
            // process from ending).
            let threads = sh(&format!(
                "grep -H . /proc/{first}/task/*/wchan /proc/{first}/task/*/stat 2>&1 | head -80"
            ));
            panic!("{e:#}\nthe killed daemon's threads:\n{threads:?}")
        });
    assert!(line.contains("generation 1"), "{line}");
    assert_ne!(daemon_pid(&line), first);
    assert!(fuse
        .proc
        .log_text()
        .contains("starting another that takes the mount over"));

    for l in fuse
        .proc
        .log_text()
        .lines()
        .filter(|l| l.contains("granary supervisor:"))
    {
        eprintln!("{l}");
    }
    // Readers: a pause, then the right bytes.
    loader.expect("pass", Duration::from_secs(120));
    loader.expect("pass", Duration::from_secs(120));
    // The file a reader holds open through the killed daemon, cached whole now: the new
    // daemon knows that handle from the supervisor and does not answer another open of it
    // in passthrough (the kernel would fail it with EIO).
    granary_ok(&["load", "/data/big", "--master", &c.master.addr]).unwrap();
    assert_eq!(
        sha_of(&data.join("big/cold.bin")),
        sha_of(&src.join("big/cold.bin"))
    );
    reader.send("go");
    assert_eq!(
        reader.expect("sha", Duration::from_secs(60)),
        sha_of(&src.join("big/cold.bin"))
    );
    // Files a handle of the killed daemon still reads in passthrough open again (the
    // kernel takes only the backing file it already has for them: the supervisor kept
    // track of it), and those handles read on.
    let text = fuse.proc.log_text();
    let handed = text
        .lines()
        .find(|l| l.contains("handing the mount to a new daemon"))
        .unwrap_or_else(|| panic!("no handover in the supervisor's log:\n{text}"));
    assert!(!handed.contains("backings=0"), "{handed}");
    assert_eq!(sha_of(&sample), sha_of(&src.join("s1/f001.bin")));
    assert_eq!(
        sha_of(&data.join("big/cached.bin")),
        sha_of(&src.join("big/cached.bin"))
    );
    // A second crash: the new daemon told the supervisor what it took on, so the next one
    // has it too.
    sh(&format!("kill -9 {}", daemon_pid(&line))).unwrap();
    poll("a second takeover", Duration::from_secs(60), || {
        let text = fuse.proc.log_text();
        text.lines()
            .any(|l| l.contains("granary took over the mount") && l.contains("generation 2"))
            .then_some(())
    })
    .unwrap();
    assert_eq!(sha_of(&sample), sha_of(&src.join("s1/f001.bin")));
    assert_eq!(
        sha_of(&data.join("big/cached.bin")),
        sha_of(&src.join("big/cached.bin"))
    );
    pt.send("go");
    assert_eq!(
        pt.expect("sha", Duration::from_secs(60)),
        sha_of(&src.join("big/cached.bin"))
    );
    pt_small.send("go");
    assert_eq!(
        pt_small.expect("sha", Duration::from_secs(60)),
        sha_of(&src.join("s1/f001.bin"))
    );
    assert_eq!(
        sha_of(&data.join("big/cached.bin")),
        sha_of(&src.join("big/cached.bin"))
    );
    loader.send("stop");
    loader.expect("ok", Duration::from_secs(120));
    // The writer's bytes died with the daemon: its next write fails with EIO, and the file
    // never shows as a complete file of what it wrote.
    writer.send("go");
    assert_eq!(writer.expect("ERR", Duration::from_secs(60)), "5");
    let shown = std::fs::metadata(data.join("out.bin")).map(|m| m.len());
    assert!(
        !matches!(shown, Ok(n) if n == 2 * MIB),
        "a file written only in part shows as complete: {shown:?}"
    );
    // The new daemon serves metrics on the same address once the killed one has let it go.
    poll("the new daemon's metrics", Duration::from_secs(30), || {
        let text = scrape(&metrics).ok()?;
        (metric(&text, "granary_client_fuse_takeovers_total") == Some(1.0)).then_some(())
    })
    .unwrap();
    assert_eq!(metric_at(&metrics, "granary_client_fuse_generation"), 2.0);
    // The samples' parked backing files the killed daemons left stay theirs.
    assert!(metric_at(&metrics, "granary_client_fuse_orphan_backings") >= 1.0);

    // SIGTERM to the supervisor unmounts and ends both.
    assert_eq!(
        fuse.proc.stop("TERM", Duration::from_secs(30)).unwrap(),
        Some(0)
    );
    poll("the mount to go", Duration::from_secs(10), || {
        (!is_mounted(&mp)).then_some(())
    })
    .unwrap();
}

/// What the Helm chart's FUSE rollout does on a node (docs/kubernetes.md, "Upgrading the FUSE
/// pods"): every pod runs `--supervise --takeover auto --wait-after-handover`; the first
/// mounts, the next takes the mount over while the first still runs, the first then waits
/// without serving, and its end (SIGTERM, the pod deleted) leaves the mount to the second.
#[test]
fn a_rolling_update_of_supervised_daemons_passes_the_mount_on_without_unmounting() {
    let Setup {
        root,
        mp,
        data: _,
        src,
        manifest,
        socket,
    } = setup("rollout");
    let rp = root.path();
    let flags = [
        "--supervise",
        "--takeover",
        "auto",
        "--wait-after-handover",
        "--handover-socket",
        &socket,
    ];
    // No daemon serves the mount yet: `--takeover auto` mounts.
    let c = Cluster::start_opts(rp, 1, "1GiB", &src, &flags).unwrap();
    let _unmount = UnmountOnDrop(mp.clone());
    let mut old = c.fuse;
    let mut loader = Script::start("loader", LOADER, &[&manifest.display().to_string()]);
    loader.expect("pass", Duration::from_secs(120));

    let metrics = format!("127.0.0.1:{}", free_port());
    let m = mp.display().to_string();
    let mut args = vec!["fuse", "--master", &c.master.addr, "--mount", &m];
    args.extend(["--metrics-listen", &metrics]);
    args.extend(flags);
    let mut new = Proc::spawn("fuse-new", rp, &args).unwrap();
    new.wait_for_line("granary took over the mount", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}\nthe old pod's log:\n{}", old.proc.log_text()));
    old.proc
        .wait_for_line(
            "the mount was handed to another daemon",
            Duration::from_secs(30),
        )
        .unwrap();
    loader.expect("pass", Duration::from_secs(120));
    loader.expect("pass", Duration::from_secs(120));
    // The old pod is deleted: its supervisor ends and leaves the mount alone.
    assert!(
        old.proc.child.try_wait().unwrap().is_none(),
        "the old supervisor did not wait"
    );
    assert_eq!(
        old.proc.stop("TERM", Duration::from_secs(30)).unwrap(),
        Some(0)
    );
    assert!(
        is_mounted(&mp),
        "the old pod's end unmounted the new pod's mount"
    );
    loader.expect("pass", Duration::from_secs(120));
    loader.send("stop");
    loader.expect("ok", Duration::from_secs(120));
    assert_eq!(
        metric_at(&metrics, "granary_client_fuse_takeovers_total"),
        1.0
    );
    assert_eq!(new.stop("TERM", Duration::from_secs(30)).unwrap(), Some(0));
    poll("the mount to go", Duration::from_secs(10), || {
        (!is_mounted(&mp)).then_some(())
    })
    .unwrap();
}

/// The kernel allows an inode one I/O mode at a time: while a handle reads a file through
/// the daemon, an open answered in passthrough fails with EIO, and the other way round. A
/// file held open through the daemon becomes wholly cached meanwhile (its next open would
/// be in passthrough: EIO before the daemon counted such handles), and a sample held open
/// in passthrough is read again by `sha256sum` of its folder in name order: every open
/// succeeds with the right bytes.
#[test]
fn a_file_open_in_one_io_mode_opens_again_while_held() {
    let Setup {
        root,
        mp,
        data,
        src,
        manifest: _,
        socket: _,
    } = setup("iomode");
    let c = Cluster::start_opts(root.path(), 1, "1GiB", &src, &[]).unwrap();
    let _unmount = UnmountOnDrop(mp.clone());
    // Held open through the daemon (not cached yet), then cached whole by another reader.
    let cold = data.join("big/cold.bin");
    let want = sha_of(&src.join("big/cold.bin"));
    let mut held = Script::start("daemon reader", HOLD, &[&cold.display().to_string()]);
    held.expect("half", Duration::from_secs(60));
    granary_ok(&["load", "/data/big", "--master", &c.master.addr]).unwrap();
    // Cached whole now: an open would be in passthrough but for the handle reading through
    // the daemon; each must succeed (EIO before) with the right bytes.
    let opens = c.fuse.metric("granary_client_passthrough_opens_total");
    for _ in 0..3 {
        assert_eq!(sha_of(&cold), want);
    }
    assert_eq!(
        c.fuse.metric("granary_client_passthrough_opens_total"),
        opens,
        "an open went to passthrough while a handle read the file through the daemon"
    );
    held.send("go");
    assert_eq!(held.expect("sha", Duration::from_secs(60)), want);
    // With no handle open, the next open is in passthrough.
    assert_eq!(sha_of(&cold), want);
    assert!(c.fuse.metric("granary_client_passthrough_opens_total") > opens);

    // Held in passthrough while the file gets a new version in the store: opens of the new
    // version are refused with EBUSY (not EIO, never the old bytes) until it is closed.
    let mut held = Script::start("passthrough reader", HOLD, &[&cold.display().to_string()]);
    held.expect("half", Duration::from_secs(60));
    random_file(&src.join("big/cold.bin"), 3 * MIB + 11).unwrap();
    let new = sha_of(&src.join("big/cold.bin"));
    let refused = poll("the new version seen", Duration::from_secs(120), || {
        match sh(&format!("sha256sum < '{}'", cold.display())) {
            Ok(out) if out.starts_with(&want) => None, // not seen yet: the old version
            Ok(out) => Some(Ok(out)),
            Err(e) => Some(Err(format!("{e:#}"))),
        }
    })
    .unwrap();
    let err =
        refused.expect_err("the new version opened while the old one was held in passthrough");
    assert!(err.contains("Device or resource busy"), "{err}");
    held.send("go");
    assert_eq!(held.expect("sha", Duration::from_secs(60)), want);
    poll("the new version", Duration::from_secs(60), || {
        sh(&format!("sha256sum < '{}'", cold.display()))
            .ok()
            .filter(|o| o.starts_with(&new))
    })
    .unwrap();

    // A sample held open in passthrough, read again with its folder in name order (any
    // open of it must name the same backing file).
    sh(&format!("cat '{}'/s1/* > /dev/null", data.display())).unwrap();
    let sample = data.join("s1/f001.bin");
    let opens = c.fuse.metric("granary_client_passthrough_opens_total");
    let mut pt = Script::start("sample reader", HOLD, &[&sample.display().to_string()]);
    pt.expect("half", Duration::from_secs(60));
    assert!(c.fuse.metric("granary_client_passthrough_opens_total") > opens);
    for _ in 0..3 {
        let sums = sh(&format!("cd '{}' && sha256sum s1/*", data.display())).unwrap();
        let want = sh(&format!("cd '{}' && sha256sum s1/*", src.display())).unwrap();
        assert_eq!(sums, want);
    }
    // A write's open (O_TRUNC) while the sample is read in passthrough: refused with
    // EBUSY before anything changes (the kernel failed it with EIO once it was answered,
    // and by then the file was an empty new version).
    let before = sha_of(&src.join("s1/f001.bin"));
    let err = sh(&format!("printf x > '{}'", sample.display()))
        .expect_err("a write opened a file held open in passthrough");
    assert!(
        format!("{err:#}").contains("Device or resource busy"),
        "{err:#}"
    );
    pt.send("go");
    assert_eq!(pt.expect("sha", Duration::from_secs(60)), before);
    assert_eq!(sha_of(&src.join("s1/f001.bin")), before);
    assert_eq!(sha_of(&sample), before);
}
