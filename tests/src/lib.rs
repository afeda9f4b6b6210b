//! Test harness: spawns the real `granary` binary as separate processes on loopback, mounts
//! real FUSE file systems, scrapes real `/metrics`, and cleans up what it started (by PID)
//! and mounted, even when a test fails.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The `granary` binary under test: `$GRANARY_BIN`, or the one cargo built next to this test.
///
/// `cargo test` does not rebuild another package's binary: run the suite through
/// `scripts/test`, which builds the workspace first, or `cargo build` before `cargo test`.
pub fn granary_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("GRANARY_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> → target/<profile>/granary
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    dir.join("granary")
}

/// Polls `f` until it returns `Some`, failing after `timeout`.
pub fn poll<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A spawned `granary` process; killed (SIGKILL) on drop if still running.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, dir: &Path, args: &[&str]) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let log = dir.join(format!("{name}.log"));
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let child = Command::new(granary_bin())
            .args(args)
            .env("GRANARY_LOG", "info")
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("spawning {} {args:?}", granary_bin().display()))?;
        Ok(Self {
            name: name.to_string(),
            child,
            log,
        })
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for a log line containing `marker` and returns the rest of that line (trimmed).
    pub fn wait_for_line(&mut self, marker: &str, timeout: Duration) -> Result<String> {
        let res = poll(
            &format!("{} to print {marker:?}", self.name),
            timeout,
            || {
                if let Ok(Some(status)) = self.child.try_wait() {
                    return Some(Err(anyhow::anyhow!(
                        "{} exited with {status} before printing {marker:?}; log:\n{}",
                        self.name,
                        self.log_text()
                    )));
                }
                let text = self.log_text();
                text.lines()
                    .rev()
                    .find_map(|l| {
                        l.find(marker)
                            .map(|i| l[i + marker.len()..].trim().to_string())
                    })
                    .map(Ok)
            },
        );
        match res {
            Ok(r) => r,
            Err(e) => Err(e.context(format!("log of {}:\n{}", self.name, self.log_text()))),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: &str) -> Result<()> {
        let st = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()?;
        if !st.success() {
            bail!("kill -{sig} {} failed", self.pid());
        }
        Ok(())
    }

    pub fn kill9(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// Sends `sig` and waits for exit; returns the exit code.
    pub fn stop(&mut self, sig: &str, timeout: Duration) -> Result<Option<i32>> {
        self.signal(sig)?;
        let status = poll(&format!("{} to exit", self.name), timeout, || {
            self.child.try_wait().ok().flatten()
        })?;
        Ok(status.code())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs `granary ARGS` to completion.
pub fn granary(args: &[&str]) -> Output {
    Command::new(granary_bin())
        .args(args)
        .env("GRANARY_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("running granary")
}

/// Runs `granary ARGS`, failing with its stderr unless it exits 0; returns stdout.
pub fn granary_ok(args: &[&str]) -> Result<String> {
    let out = granary(args);
    if !out.status.success() {
        bail!(
            "granary {args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs a shell command line, failing unless it exits 0; returns stdout.
pub fn sh(cmd: &str) -> Result<String> {
    let out = Command::new("bash")
        .args(["-c", cmd])
        .env("LC_ALL", "C")
        .output()
        .context("running bash")?;
    if !out.status.success() {
        bail!(
            "`{cmd}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Fetches `/metrics` from `addr` (plain HTTP/1.0 over loopback).
pub fn scrape(addr: &str) -> Result<String> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    match body.split_once("\r\n\r\n") {
        Some((head, b)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
            Ok(b.to_string())
        }
        _ => bail!("bad metrics response from {addr}: {body:.200}"),
    }
}

/// The value of metric `name` (without labels) in a Prometheus text exposition.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Reads a metric from a live endpoint; panics with context if absent.
pub fn metric_at(addr: &str, name: &str) -> f64 {
    let text = scrape(addr).unwrap_or_else(|e| panic!("scraping {addr}: {e:#}"));
    metric(&text, name).unwrap_or_else(|| panic!("metric {name} missing at {addr}:\n{text}"))
}

/// Is `path` a mount point (per /proc/self/mountinfo)?
pub fn is_mounted(path: &Path) -> bool {
    let p = path.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| t.lines().any(|l| l.split(' ').nth(4) == Some(p.as_str())))
        .unwrap_or(false)
}

/// Lazily unmounts `path` if still mounted (after a killed FUSE daemon).
pub fn force_unmount(path: &Path) {
    if is_mounted(path) {
        let _ = Command::new("umount").arg("-l").arg(path).status();
    }
}

/// Creates a file of `len` random bytes.
pub fn random_file(path: &Path, len: u64) -> Result<()> {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p)?;
    }
    let mut src = std::fs::File::open("/dev/urandom")?.take(len);
    let mut dst = std::fs::File::create(path)?;
    std::io::copy(&mut src, &mut dst)?;
    Ok(())
}

/// SHA-256 of every file under `dir`, keyed by relative path, computed by `sha256sum`.
pub fn tree_sums(dir: &Path) -> Result<BTreeMap<String, String>> {
    let out = sh(&format!(
        "cd '{}' && find . -type f -print0 | sort -z | xargs -0 -r sha256sum",
        dir.display()
    ))?;
    Ok(out
        .lines()
        .filter_map(|l| {
            l.split_once("  ")
                .map(|(h, p)| (p.to_string(), h.to_string()))
        })
        .collect())
}

/// `path size type` of every entry under `dir` (sizes of regular files only).
pub fn tree_stats(dir: &Path) -> Result<String> {
    sh(&format!(
        "cd '{}' && find . -mindepth 1 \\( -type f -printf '%p %s f\\n' \\) -o \\( -type d -printf '%p - d\\n' \\) | sort",
        dir.display()
    ))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A running master process.
pub struct Master {
    pub proc: Proc,
    pub addr: String,
    pub metrics: String,
    pub data_dir: PathBuf,
    pub port: u16,
}

impl Master {
    pub fn start(root: &Path) -> Result<Self> {
        Self::start_on(root, &root.join("master-data"), free_port())
    }

    pub fn start_on(root: &Path, data_dir: &Path, port: u16) -> Result<Self> {
        let listen = format!("127.0.0.1:{port}");
        let d = data_dir.to_string_lossy().to_string();
        let mut proc = Proc::spawn(
            "master",
            root,
            &[
                "master",
                "--data-dir",
                &d,
                "--listen",
                &listen,
                "--metrics-listen",
                "127.0.0.1:0",
                "--worker-timeout",
                "3s",
            ],
        )?;
        let addr = proc.wait_for_line("granary master listening on", Duration::from_secs(60))?;
        let metrics = proc
            .wait_for_line("metrics on http://", Duration::from_secs(10))?
            .trim_end_matches("/metrics")
            .to_string();
        Ok(Self {
            proc,
            addr,
            metrics,
            data_dir: data_dir.to_path_buf(),
            port,
        })
    }
}

/// A running worker process.
pub struct Worker {
    pub proc: Proc,
    pub addr: String,
    pub metrics: String,
    pub cache_dir: PathBuf,
}

impl Worker {
    pub fn start(root: &Path, name: &str, master: &str, cache_size: &str) -> Result<Self> {
        Self::start_with(
            root,
            name,
            master,
            cache_size,
            &root.join(format!("{name}-cache")),
        )
    }

    pub fn start_with(
        root: &Path,
        name: &str,
        master: &str,
        cache_size: &str,
        cache_dir: &Path,
    ) -> Result<Self> {
        let c = cache_dir.to_string_lossy().to_string();
        let mut proc = Proc::spawn(
            name,
            root,
            &[
                "worker",
                "--master",
                master,
                "--listen",
                "127.0.0.1:0",
                "--cache-dir",
                &c,
                "--cache-size",
                cache_size,
                "--metrics-listen",
                "127.0.0.1:0",
                "--heartbeat-interval",
                "200ms",
            ],
        )?;
        let line = proc.wait_for_line("listening on", Duration::from_secs(60))?;
        let metrics = proc
            .wait_for_line("metrics on http://", Duration::from_secs(10))?
            .trim_end_matches("/metrics")
            .to_string();
        Ok(Self {
            proc,
            addr: line,
            metrics,
            cache_dir: cache_dir.to_path_buf(),
        })
    }

    pub fn metric(&self, name: &str) -> f64 {
        metric_at(&self.metrics, name)
    }
}

/// A running FUSE mount process; unmounted on drop.
pub struct Fuse {
    pub proc: Proc,
    pub mountpoint: PathBuf,
}

impl Fuse {
    pub fn start(root: &Path, master: &str) -> Result<Self> {
        let mp = root.join("mnt");
        std::fs::create_dir_all(&mp)?;
        let m = mp.to_string_lossy().to_string();
        let proc = Proc::spawn("fuse", root, &["fuse", "--master", master, "--mount", &m])?;
        let mut f = Self {
            proc,
            mountpoint: mp,
        };
        f.proc
            .wait_for_line("granary mounted at", Duration::from_secs(60))?;
        poll("the FUSE mount", Duration::from_secs(10), || {
            is_mounted(&f.mountpoint).then_some(())
        })?;
        Ok(f)
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        if let Ok(None) = self.proc.child.try_wait() {
            let _ = self.proc.stop("TERM", Duration::from_secs(10));
        }
        force_unmount(&self.mountpoint);
    }
}

/// Waits until the master reports `n` live workers (via `granary report --json`).
pub fn wait_live_workers(master: &str, n: usize) -> Result<serde_json::Value> {
    poll(
        &format!("{n} live workers"),
        Duration::from_secs(30),
        || {
            let out = granary(&["report", "--json", "--master", master]);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            let live = v["workers"]
                .as_array()?
                .iter()
                .filter(|w| w["state"] == "live")
                .count();
            (live == n).then_some(v)
        },
    )
}

/// Unmounts `0` on drop if something left it mounted (e.g. a killed daemon after a failed
/// assertion), so a failing test never leaves a dead mount behind.
pub struct UnmountOnDrop(pub PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        force_unmount(&self.0);
    }
}

/// The usual acceptance setup: a master, `n` workers, `src` mounted at `/data` and a FUSE
/// mount of the namespace. Fields drop in order, so the mount goes first.
pub struct Cluster {
    pub fuse: Fuse,
    pub workers: Vec<Worker>,
    pub master: Master,
}

impl Cluster {
    pub fn start(root: &Path, n: usize, cache_size: &str, src: &Path) -> Result<Self> {
        let master = Master::start(root)?;
        let workers = (1..=n)
            .map(|i| Worker::start(root, &format!("w{i}"), &master.addr, cache_size))
            .collect::<Result<Vec<_>>>()?;
        wait_live_workers(&master.addr, n)?;
        granary_ok(&[
            "mount",
            "add",
            "/data",
            &src.to_string_lossy(),
            "--master",
            &master.addr,
        ])?;
        let fuse = Fuse::start(root, &master.addr)?;
        Ok(Self {
            fuse,
            workers,
            master,
        })
    }

    /// Where `/data` appears in the FUSE mount.
    pub fn data(&self) -> PathBuf {
        self.fuse.mountpoint.join("data")
    }
}
