//! Test harness: spawns the real `granary` binary as separate processes on loopback, mounts
//! real FUSE file systems, scrapes real `/metrics`, and cleans up what it started (by PID)
//! and mounted, even when a test fails.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub mod grpc;
pub mod inproc;
pub mod stores;

pub use grpc::*;

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

/// The test run's TLS material: one cluster CA per test process (made with the real
/// `granary cert init`/`cert issue`), with a `node`, an `admin` and a `user` identity, each
/// in a folder for `--tls-dir`. Every process the harness starts uses TLS, unless
/// `GRANARY_TEST_INSECURE=1` runs the whole suite plaintext (`--insecure`).
pub struct TestTls {
    pub dir: PathBuf,
}

impl TestTls {
    pub fn get() -> &'static TestTls {
        static TLS: std::sync::OnceLock<TestTls> = std::sync::OnceLock::new();
        TLS.get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("granary-test-tls-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let ca = dir.join("ca").to_string_lossy().to_string();
            let run = |args: &[&str]| {
                let out = Command::new(granary_bin())
                    .args(args)
                    .env("GRANARY_LOG", "warn")
                    .output()
                    .expect("running granary cert");
                assert!(
                    out.status.success(),
                    "granary {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            };
            run(&["cert", "init", "--ca-dir", &ca, "--days", "30"]);
            for role in ["node", "admin", "user"] {
                let name = format!("test-{role}");
                issue_identity(
                    &dir.join("ca"),
                    &name,
                    &dir.join(role),
                    &["--role", role, "--days", "30"],
                )
                .expect("issuing a test identity");
            }
            // The masters' key for credentials at rest.
            let key: String = (0..48)
                .map(|_| format!("{:x}", rand::random::<u8>() & 15))
                .collect();
            std::fs::write(dir.join("secrets.key"), key).expect("writing the secrets key");
            TestTls { dir }
        })
    }

    /// The `--tls-dir` of an identity (`node`, `admin`, `user`), or of another one issued
    /// by [`TestTls::issue`].
    pub fn identity(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The cluster CA's folder (ca.crt, ca.key).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca")
    }

    /// Issues another identity of the test CA (`granary cert issue NAME ARGS..`), once per
    /// test process for each name and arguments: tests running at once that ask for the
    /// same identity share it (issuing it again under their feet let one read a new
    /// certificate with the old key).
    pub fn issue(&self, name: &str, args: &[&str]) -> Result<PathBuf> {
        static ISSUED: std::sync::Mutex<BTreeMap<String, PathBuf>> =
            std::sync::Mutex::new(BTreeMap::new());
        let key = format!("{name} {}", args.join(" "));
        let mut issued = ISSUED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(dir) = issued.get(&key) {
            return Ok(dir.clone());
        }
        // The name's own folder (as `identity(name)` finds it), unless other arguments
        // took it.
        let folder = if issued.values().any(|d| *d == self.dir.join(name)) {
            format!("{name}-{}", issued.len())
        } else {
            name.to_string()
        };
        let dir = issue_identity(&self.ca(), name, &self.dir.join(folder), args)?;
        issued.insert(key, dir.clone());
        Ok(dir)
    }

    /// The `--tls-dir` of master `id` (`master-<id>`, `--role master --master-id <id>`),
    /// issued on first use: masters and workers are distinct identities, and a master's
    /// certificate speaks for its own id only.
    pub fn master(&self, id: u64) -> PathBuf {
        let id_s = id.to_string();
        self.issue(
            &format!("master-{id}"),
            &["--role", "master", "--master-id", &id_s, "--days", "30"],
        )
        .expect("issuing a master identity")
    }
}

/// `granary cert issue NAME --ca-dir CA --out OUT --force ARGS..`: an identity of any CA.
pub fn issue_identity(ca: &Path, name: &str, out: &Path, args: &[&str]) -> Result<PathBuf> {
    let (ca, o) = (ca.to_string_lossy(), out.to_string_lossy());
    let mut all = vec![
        "cert", "issue", name, "--ca-dir", &ca, "--out", &o, "--force",
    ];
    all.extend_from_slice(args);
    let r = Command::new(granary_bin())
        .args(&all)
        .env("GRANARY_LOG", "warn")
        .output()?;
    if !r.status.success() {
        bail!("granary {all:?}: {}", String::from_utf8_lossy(&r.stderr));
    }
    Ok(out.to_path_buf())
}

/// Whether the whole suite runs plaintext (`GRANARY_TEST_INSECURE=1`).
pub fn insecure_suite() -> bool {
    std::env::var("GRANARY_TEST_INSECURE").is_ok_and(|v| v == "1")
}

/// Sets the transport security of a `granary` command the harness runs: `--insecure` for
/// an insecure suite, else the TLS identity its role needs (servers `node`, mounts `user`,
/// admin commands `admin`; `local` and `cert` make or need none). A command that already
/// names its TLS setting is left alone.
pub fn secure_command(cmd: &mut Command, args: &[&str]) {
    // The command and its action, past `--config FILE`.
    let mut words = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if *a == "--config" {
            it.next();
        } else if !a.starts_with('-') {
            words.push(*a);
        }
    }
    let named = args
        .iter()
        .any(|a| a.starts_with("--tls-") || *a == "--insecure");
    if named || matches!(words.first(), Some(&"cert") | Some(&"local")) {
        return;
    }
    let actions = ["list", "add", "remove", "decommission", "recommission"];
    let server = !words.get(1).is_some_and(|w| actions.contains(w));
    if words.first() == Some(&"master") && server {
        cmd.env(
            "GRANARY_SECRETS_KEY_FILE",
            TestTls::get().dir.join("secrets.key"),
        );
        // The folders tests mount (`file://`): temporary folders and cargo's target tmp.
        if !args.iter().any(|a| a.starts_with("--allow-local-root")) {
            cmd.env("GRANARY_ALLOW_LOCAL_ROOTS", test_local_roots());
        }
    }
    if insecure_suite() {
        cmd.env("GRANARY_INSECURE", "1");
        return;
    }
    // A master runs with its own id's identity; a mount on a node with the node's (it may
    // read under-stores directly when no worker can serve); `user` identities are for the
    // security tests.
    if words.first() == Some(&"master") && server {
        cmd.env("GRANARY_TLS_DIR", TestTls::get().master(master_id_of(args)));
        return;
    }
    let role = match words.first() {
        Some(&"worker") if server => "node",
        Some(&"fuse") => "node",
        _ => "admin",
    };
    cmd.env("GRANARY_TLS_DIR", TestTls::get().identity(role));
}

/// The `--id` of a `granary master` command line (1 when not given).
fn master_id_of(args: &[&str]) -> u64 {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let v: Option<&str> = match a.strip_prefix("--id=") {
            Some(v) => Some(v),
            None if *a == "--id" => it.next().copied(),
            None => None,
        };
        if let Some(v) = v {
            return v.parse().expect("a numeric --id");
        }
    }
    1
}

/// The folders masters started by the harness allow `file://` mounts below
/// (`--allow-local-root`, comma-separated): the system's temporary folder, where tests make
/// their trees, and cargo's `target/tmp`, where the shared acceptance dataset lives.
pub fn test_local_roots() -> String {
    let mut roots = vec![std::env::temp_dir()];
    // target/<profile>/deps/<test> → target/tmp
    if let Some(target) = std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.parent()?.parent()?.to_path_buf()))
    {
        roots.push(target.join("tmp"));
    }
    roots
        .iter()
        .map(|r| r.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(",")
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
    /// Length of the log when this process started (a restarted process appends to the
    /// same log; its lines are the ones after this).
    log_start: usize,
}

impl Proc {
    pub fn spawn(name: &str, dir: &Path, args: &[&str]) -> Result<Self> {
        Self::spawn_with(name, dir, &granary_bin(), args, None)
    }

    /// Spawns another program (e.g. an under-store test server) in `dir`, with its output
    /// in `<name>.log` there.
    pub fn spawn_program(name: &str, dir: &Path, program: &Path, args: &[&str]) -> Result<Self> {
        Self::spawn_with(name, dir, program, args, Some(dir))
    }

    fn spawn_with(
        name: &str,
        dir: &Path,
        program: &Path,
        args: &[&str],
        cwd: Option<&Path>,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let log = dir.join(format!("{name}.log"));
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let log_start = f.metadata()?.len() as usize;
        let mut cmd = Command::new(program);
        if let Some(d) = cwd {
            cmd.current_dir(d);
        } else {
            secure_command(&mut cmd, args);
        }
        let child = cmd
            .args(args)
            .env(
                "GRANARY_LOG",
                std::env::var("GRANARY_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("spawning {} {args:?}", program.display()))?;
        Ok(Self {
            name: name.to_string(),
            child,
            log,
            log_start,
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
                let text = text.get(self.log_start..).unwrap_or_default();
                // Complete lines only: the process may be writing the last one now (an
                // address read half-written, "127.0.", failed a CI run).
                let complete = text.rfind('\n').map_or("", |end| &text[..end]);
                complete
                    .lines()
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
    let mut cmd = Command::new(granary_bin());
    secure_command(&mut cmd, args);
    cmd.args(args)
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

/// `GET path` on `addr` (plain HTTP/1.0 over loopback): the status code and the body.
pub fn http_get(addr: &str, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("bad HTTP response from {addr}{path}: {text:.200}"))?;
    let code = head
        .strip_prefix("HTTP/1.")
        .and_then(|h| h.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad HTTP status line from {addr}{path}: {head:.200}"))?;
    Ok((code, body.to_string()))
}

/// Fetches `/metrics` from `addr`.
pub fn scrape(addr: &str) -> Result<String> {
    match http_get(addr, "/metrics")? {
        (200, body) => Ok(body),
        (code, body) => bail!("metrics of {addr} answered {code}: {body:.200}"),
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
    tree_sums_except(dir, "")
}

/// [`tree_sums`] without the files named `skip` (nothing skipped when empty).
pub fn tree_sums_except(dir: &Path, skip: &str) -> Result<BTreeMap<String, String>> {
    let filter = if skip.is_empty() {
        String::new()
    } else {
        format!("! -name '{skip}'")
    };
    let out = sh(&format!(
        "cd '{}' && find . -type f {filter} -print0 | sort -z | xargs -0 -r sha256sum",
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
        Self::start_opts(root, data_dir, port, &[])
    }

    /// A master with more flags (e.g. `--block-size 1MiB`).
    pub fn start_with(root: &Path, extra: &[&str]) -> Result<Self> {
        Self::start_opts(root, &root.join("master-data"), free_port(), extra)
    }

    fn start_opts(root: &Path, data_dir: &Path, port: u16, extra: &[&str]) -> Result<Self> {
        let listen = format!("127.0.0.1:{port}");
        let d = data_dir.to_string_lossy().to_string();
        let mut args = vec![
            "master",
            "--data-dir",
            &d,
            "--listen",
            &listen,
            "--metrics-listen",
            "127.0.0.1:0",
            "--worker-timeout",
            "3s",
        ];
        args.extend_from_slice(extra);
        let mut proc = Proc::spawn("master", root, &args)?;
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
        Self::start_opts(root, name, master, cache_size, cache_dir, &[])
    }

    /// [`Worker::start_with`] with more flags (e.g. `--eviction lru`).
    pub fn start_opts(
        root: &Path,
        name: &str,
        master: &str,
        cache_size: &str,
        cache_dir: &Path,
        extra: &[&str],
    ) -> Result<Self> {
        let c = cache_dir.to_string_lossy().to_string();
        let mut args = vec![
            "worker",
            "--master",
            master,
            "--listen",
            "127.0.0.1:0",
            "--cache-dir",
            &c,
        ];
        // An empty size: the tiers come in `extra` (--tier).
        if !cache_size.is_empty() {
            args.extend(["--cache-size", cache_size]);
        }
        args.extend(["--metrics-listen", "127.0.0.1:0"]);
        // Heartbeats every 200 ms unless `extra` says otherwise.
        if !extra.contains(&"--heartbeat-interval") {
            args.extend(["--heartbeat-interval", "200ms"]);
        }
        args.extend_from_slice(extra);
        let mut proc = Proc::spawn(name, root, &args)?;
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
    /// The mount's /metrics address, when started with one.
    pub metrics: Option<String>,
}

impl Fuse {
    pub fn start(root: &Path, master: &str) -> Result<Self> {
        Self::start_named(root, "mnt", master)
    }

    /// A mount at `root/<name>`, its daemon's log in `root/fuse-<name>.log` (several mounts,
    /// as on several nodes).
    pub fn start_named(root: &Path, name: &str, master: &str) -> Result<Self> {
        Self::start_opts(root, name, master, &[])
    }

    /// [`Fuse::start_named`] with extra flags, serving its metrics on a free port.
    pub fn start_opts(root: &Path, name: &str, master: &str, extra: &[&str]) -> Result<Self> {
        let mp = root.join(name);
        std::fs::create_dir_all(&mp)?;
        let m = mp.to_string_lossy().to_string();
        let log = if name == "mnt" {
            "fuse".to_string()
        } else {
            format!("fuse-{name}")
        };
        let metrics = format!("127.0.0.1:{}", free_port());
        let mut args = vec![
            "fuse",
            "--master",
            master,
            "--mount",
            &m,
            "--metrics-listen",
            &metrics,
        ];
        args.extend_from_slice(extra);
        let proc = Proc::spawn(&log, root, &args)?;
        let mut f = Self {
            proc,
            mountpoint: mp,
            metrics: Some(metrics),
        };
        f.proc
            .wait_for_line("granary mounted at", Duration::from_secs(60))?;
        poll("the FUSE mount", Duration::from_secs(10), || {
            is_mounted(&f.mountpoint).then_some(())
        })?;
        Ok(f)
    }
}

impl Fuse {
    /// A sample of the mount's metrics (0 when absent).
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.metrics.as_deref().and_then(|a| scrape(a).ok());
        text.and_then(|t| metric(&t, name)).unwrap_or(0.0)
    }
}

/// Drops the kernel's page cache of every file under `dir` (so the next read reaches the
/// FUSE daemon again, as on a node that did not read the files before).
pub fn drop_page_cache(dir: &Path) -> Result<()> {
    sh(&format!(
        "find '{}' -type f -exec dd if={{}} iflag=nocache count=0 status=none \\;",
        dir.display()
    ))
    .map(|_| ())
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
        Self::start_opts(root, n, cache_size, src, &[])
    }

    /// [`Cluster::start`] with extra flags for the FUSE mount.
    pub fn start_opts(
        root: &Path,
        n: usize,
        cache_size: &str,
        src: &Path,
        fuse_flags: &[&str],
    ) -> Result<Self> {
        let master = Master::start(root)?;
        let workers = (1..=n)
            .map(|i| Worker::start(root, &format!("w{i}"), &master.addr, cache_size))
            .collect::<Result<Vec<_>>>()?;
        wait_live_workers(&master.addr, n)?;
        mount_local("/data", src, &master.addr)?;
        let fuse = Fuse::start_opts(root, "mnt", &master.addr, fuse_flags)?;
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

// ---------------------------------------------------------------------------------------------
// Multi-master (Raft) harness.
// ---------------------------------------------------------------------------------------------

/// How many lines of the file at `path` contain `marker` (0 if it cannot be read).
pub fn count_in_log(path: &Path, marker: &str) -> usize {
    std::fs::read_to_string(path)
        .map(|t| t.lines().filter(|l| l.contains(marker)).count())
        .unwrap_or(0)
}

/// The WARN and ERROR lines of the logs named `names` (`<root>/<name>.log`), colour codes
/// stripped: what a failed assertion prints so a run on another machine can be diagnosed.
pub fn warnings_in_logs(root: &Path, names: &[&str]) -> String {
    let mut out = String::new();
    for name in names {
        let text = std::fs::read_to_string(root.join(format!("{name}.log"))).unwrap_or_default();
        for line in text.lines() {
            let plain = strip_ansi(line);
            if plain.contains(" WARN ") || plain.contains(" ERROR ") {
                out.push_str(&format!("[{name}] {plain}\n"));
            }
        }
    }
    out
}

/// `s` without terminal colour sequences (`ESC [ ... m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The last `n` lines of the file at `path`.
pub fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The acknowledged paths in an ack log written by `granary bench metadata --ack-log`, one
/// per line; a trailing line without its newline (being written) is ignored.
pub fn read_acks(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = match text.rfind('\n') {
        Some(i) => &text[..i],
        None => "",
    };
    complete
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// The names (last path components) of acknowledged paths, checking each is `dir/<name>`.
pub fn ack_names(acks: &BTreeSet<String>, dir: &str) -> BTreeSet<String> {
    let prefix = format!("{}/", dir.trim_end_matches('/'));
    acks.iter()
        .map(|p| {
            let name = p
                .strip_prefix(&prefix)
                .unwrap_or_else(|| panic!("acknowledged path {p:?} is not under {dir}"));
            assert!(
                !name.is_empty() && !name.contains('/'),
                "acknowledged path {p:?} is not a child of {dir}"
            );
            name.to_string()
        })
        .collect()
}

/// The number at the start of `w` (ignoring what follows, e.g. colour codes).
fn leading_number(w: &str) -> Option<u64> {
    let d: String = w.chars().take_while(char::is_ascii_digit).collect();
    d.parse().ok()
}

/// One member of a [`MasterGroup`].
pub struct MasterMember {
    pub id: u64,
    pub port: u16,
    pub addr: String,
    pub data_dir: PathBuf,
    pub log: PathBuf,
    /// The `--peers` list it is started with.
    pub peers: String,
    /// Started with `--join` (a member added to a running group).
    pub joining: bool,
    /// `None` while stopped.
    pub proc: Option<Proc>,
}

/// A static group of `granary master` processes on loopback, members `1..=n`.
pub struct MasterGroup {
    pub root: PathBuf,
    pub snapshot_entries: u64,
    pub members: Vec<MasterMember>,
}

const LISTENING: &str = "granary master listening on";

impl MasterGroup {
    /// Starts members `1..=n` (`master-{i}.log`, data in `master-{i}-data`) and waits until
    /// each one serves (a leader need not be elected yet).
    pub fn start(root: &Path, n: usize, snapshot_entries: u64) -> Result<Self> {
        let mut ports: Vec<u16> = Vec::new();
        while ports.len() < n {
            let p = free_port();
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        let peers = ports
            .iter()
            .enumerate()
            .map(|(i, p)| format!("{}=127.0.0.1:{p}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let members = ports
            .iter()
            .enumerate()
            .map(|(i, &port)| {
                let id = i as u64 + 1;
                MasterMember {
                    id,
                    port,
                    addr: format!("127.0.0.1:{port}"),
                    data_dir: root.join(format!("master-{id}-data")),
                    log: root.join(format!("master-{id}.log")),
                    peers: peers.clone(),
                    joining: false,
                    proc: None,
                }
            })
            .collect();
        let mut g = Self {
            root: root.to_path_buf(),
            snapshot_entries,
            members,
        };
        // Spawn them all first: a member may wait for its peers before it serves.
        for i in 0..n {
            let p = g.spawn_member(i)?;
            g.members[i].proc = Some(p);
        }
        for i in 0..n {
            let m = &mut g.members[i];
            m.proc
                .as_mut()
                .expect("just spawned")
                .wait_for_line(LISTENING, Duration::from_secs(60))?;
        }
        Ok(g)
    }

    fn idx(&self, id: u64) -> usize {
        self.members
            .iter()
            .position(|m| m.id == id)
            .unwrap_or_else(|| panic!("no master with id {id}"))
    }

    pub fn member(&self, id: u64) -> &MasterMember {
        &self.members[self.idx(id)]
    }

    fn spawn_member(&self, i: usize) -> Result<Proc> {
        let m = &self.members[i];
        let id = m.id.to_string();
        let data = m.data_dir.to_string_lossy().to_string();
        let snap = self.snapshot_entries.to_string();
        let mut args: Vec<&str> = vec![
            "master",
            "--id",
            &id,
            "--peers",
            &m.peers,
            "--data-dir",
            &data,
            "--listen",
            &m.addr,
            "--metrics-listen",
            "127.0.0.1:0",
            "--worker-timeout",
            "3s",
            "--snapshot-entries",
            &snap,
        ];
        if m.joining {
            args.push("--join");
        }
        Proc::spawn(&format!("master-{}", m.id), &self.root, &args)
    }

    /// Every member's address, comma-separated (stopped members included).
    pub fn addrs(&self) -> String {
        self.members
            .iter()
            .map(|m| m.addr.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn addr(&self, id: u64) -> String {
        self.member(id).addr.clone()
    }

    /// Ids of the members whose process is (supposed to be) running.
    pub fn running_ids(&self) -> Vec<u64> {
        self.members
            .iter()
            .filter(|m| m.proc.is_some())
            .map(|m| m.id)
            .collect()
    }

    /// Is member `id`'s process alive (not exited)?
    pub fn is_running(&mut self, id: u64) -> bool {
        let i = self.idx(id);
        match self.members[i].proc.as_mut() {
            Some(p) => matches!(p.child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The full log of member `id` (all its lives).
    pub fn log_text(&self, id: u64) -> String {
        std::fs::read_to_string(&self.member(id).log).unwrap_or_default()
    }

    /// The last lines of every member's log, for assertion messages.
    pub fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                format!(
                    "==== master-{} log (tail) ====\n{}\n",
                    m.id,
                    log_tail(&m.log, 80)
                )
            })
            .collect()
    }

    /// `granary master list --json --master VIA`.
    pub fn list(&self, via: &str) -> Result<Vec<serde_json::Value>> {
        let out = granary_ok(&["master", "list", "--json", "--master", via])?;
        let v: Vec<serde_json::Value> = serde_json::from_str(&out)
            .with_context(|| format!("master list --json printed {out:?}"))?;
        Ok(v)
    }

    /// Member `id`'s own entry in its own view of the group.
    pub fn self_entry(&self, id: u64) -> Result<serde_json::Value> {
        let v = self.list(&self.addr(id))?;
        v.into_iter()
            .find(|e| e["id"].as_u64() == Some(id))
            .with_context(|| format!("master {id} does not list itself"))
    }

    /// The leader's entry once the group (asked through every address) names exactly one.
    pub fn leader_entry(&self, timeout: Duration) -> Result<serde_json::Value> {
        let addrs = self.addrs();
        let mut last = String::new();
        poll("a single leader", timeout, || {
            let v = match self.list(&addrs) {
                Ok(v) => v,
                Err(e) => {
                    last = format!("{e:#}");
                    return None;
                }
            };
            last = serde_json::to_string(&v).unwrap_or_default();
            let leaders: Vec<&serde_json::Value> =
                v.iter().filter(|e| e["role"] == "leader").collect();
            (leaders.len() == 1).then(|| leaders[0].clone())
        })
        .with_context(|| format!("last master list: {last}\n{}", self.logs()))
    }

    /// Waits until exactly one member is leader; returns its id.
    pub fn wait_leader(&self, timeout: Duration) -> Result<u64> {
        let e = self.leader_entry(timeout)?;
        e["id"].as_u64().context("leader entry without an id")
    }

    /// The leader's commit index now.
    pub fn leader_commit(&self, timeout: Duration) -> Result<u64> {
        let e = self.leader_entry(timeout)?;
        e["commit_index"]
            .as_u64()
            .with_context(|| format!("leader entry without commit_index: {e}"))
    }

    /// Waits until member `id` (asked directly) has applied the leader's commit index as
    /// measured at the start of the call.
    pub fn wait_member_caught_up(&self, id: u64, timeout: Duration) -> Result<()> {
        let target = self.leader_commit(timeout)?;
        let mut last = String::new();
        poll(
            &format!("master {id} to apply index {target}"),
            timeout,
            || match self.self_entry(id) {
                Ok(e) => {
                    last = e.to_string();
                    (e["applied_index"].as_u64()? >= target).then_some(())
                }
                Err(e) => {
                    last = format!("{e:#}");
                    None
                }
            },
        )
        .with_context(|| format!("last self entry of master {id}: {last}\n{}", self.logs()))
    }

    /// Waits until every running member (asked directly) has applied the leader's commit
    /// index as measured at the start of the call, all are in the same term, and all that
    /// name a leader name the same one.
    pub fn wait_caught_up(&self, timeout: Duration) -> Result<()> {
        // A new leader's commit index can lag what the old one applied and acknowledged;
        // the highest applied index of any member bounds every acknowledged write.
        let ids = self.running_ids();
        let mut target = self.leader_commit(timeout)?;
        for &id in &ids {
            if let Ok(e) = self.self_entry(id) {
                target = target.max(e["applied_index"].as_u64().unwrap_or(0));
            }
        }
        let mut last = String::new();
        poll(
            &format!("masters {ids:?} to apply index {target} and agree"),
            timeout,
            || {
                let mut terms = BTreeSet::new();
                let mut leaders = BTreeSet::new();
                let mut views = Vec::new();
                let mut ok = true;
                for &id in &ids {
                    let v = match self.list(&self.addr(id)) {
                        Ok(v) => v,
                        Err(e) => {
                            last = format!("master {id}: {e:#}");
                            return None;
                        }
                    };
                    views.push(format!("master {id}: {}", serde_json::to_string(&v).ok()?));
                    let me = v.iter().find(|e| e["id"].as_u64() == Some(id))?;
                    if me["applied_index"].as_u64()? < target {
                        ok = false;
                    }
                    terms.insert(me["term"].as_u64()?);
                    for e in v.iter().filter(|e| e["role"] == "leader") {
                        leaders.insert(e["id"].as_u64()?);
                    }
                }
                last = views.join("\n");
                (ok && terms.len() == 1 && leaders.len() == 1).then_some(())
            },
        )
        .with_context(|| format!("last views:\n{last}\n{}", self.logs()))
    }

    /// SIGKILLs member `id` and waits for it to die.
    pub fn kill9(&mut self, id: u64) -> Result<()> {
        let i = self.idx(id);
        let mut p = self.members[i]
            .proc
            .take()
            .with_context(|| format!("master {id} is not running"))?;
        p.kill9()
    }

    /// SIGTERMs member `id` and waits for it to exit (SIGKILL after 20 s).
    pub fn stop(&mut self, id: u64) -> Result<()> {
        let i = self.idx(id);
        let mut p = self.members[i]
            .proc
            .take()
            .with_context(|| format!("master {id} is not running"))?;
        if p.stop("TERM", Duration::from_secs(20)).is_err() {
            p.kill9()?;
        }
        Ok(())
    }

    /// Sends `sig` (e.g. "STOP", "CONT") to member `id`.
    pub fn signal(&self, id: u64, sig: &str) -> Result<()> {
        self.member(id)
            .proc
            .as_ref()
            .with_context(|| format!("master {id} is not running"))?
            .signal(sig)
    }

    /// Removes the data directory of stopped member `id`.
    pub fn wipe(&mut self, id: u64) -> Result<()> {
        let m = self.member(id);
        if m.proc.is_some() {
            bail!("master {id} is running; stop it before wiping its data");
        }
        match std::fs::remove_dir_all(&m.data_dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("removing {}", m.data_dir.display())),
        }
    }

    /// Starts stopped member `id` again with the same arguments (appending to its log) and
    /// waits until this new life prints that it listens.
    pub fn restart(&mut self, id: u64) -> Result<()> {
        let i = self.idx(id);
        if self.members[i].proc.is_some() {
            bail!("master {id} is already running");
        }
        let log = self.members[i].log.clone();
        let before = count_in_log(&log, LISTENING);
        let p = self.spawn_member(i)?;
        self.members[i].proc = Some(p);
        let proc = self.members[i].proc.as_mut().expect("just spawned");
        let res = poll(
            &format!("restarted master {id} to listen"),
            Duration::from_secs(60),
            || {
                if let Ok(Some(st)) = proc.child.try_wait() {
                    return Some(Err(anyhow::anyhow!(
                        "restarted master {id} exited with {st}"
                    )));
                }
                (count_in_log(&log, LISTENING) > before).then_some(Ok(()))
            },
        );
        match res {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) | Err(e) => Err(e.context(format!("log:\n{}", log_tail(&log, 200)))),
        }
    }

    /// Starts a new member `id` (the next id) with `--join`, its `--peers` listing every
    /// member and itself; it serves but is not part of the group until `master add`.
    pub fn start_joining(&mut self, id: u64) -> Result<()> {
        if self.members.iter().any(|m| m.id == id) {
            bail!("master {id} already exists");
        }
        let port = loop {
            let p = free_port();
            if !self.members.iter().any(|m| m.port == p) {
                break p;
            }
        };
        let addr = format!("127.0.0.1:{port}");
        let mut peers: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.id, m.addr))
            .collect();
        peers.push(format!("{id}={addr}"));
        self.members.push(MasterMember {
            id,
            port,
            addr,
            data_dir: self.root.join(format!("master-{id}-data")),
            log: self.root.join(format!("master-{id}.log")),
            peers: peers.join(","),
            joining: true,
            proc: None,
        });
        let i = self.members.len() - 1;
        let mut p = self.spawn_member(i)?;
        p.wait_for_line(LISTENING, Duration::from_secs(60))?;
        self.members[i].proc = Some(p);
        Ok(())
    }

    /// The names in directory `path` as member `id` alone has applied them
    /// (`fs ls --stale --json`).
    pub fn stale_ls(&self, id: u64, path: &str) -> Result<BTreeSet<String>> {
        let addr = self.addr(id);
        let out = granary_ok(&["fs", "ls", path, "--json", "--master", &addr, "--stale"])?;
        let v: Vec<serde_json::Value> =
            serde_json::from_str(&out).with_context(|| format!("fs ls --json printed {out:?}"))?;
        v.iter()
            .map(|e| {
                e["name"]
                    .as_str()
                    .map(str::to_string)
                    .with_context(|| format!("entry without a name: {e}"))
            })
            .collect()
    }

    /// Term → ids of the members that logged `raft: node {id} became leader at term {term}`
    /// in that term (over every life of every member).
    pub fn leader_terms(&self) -> Result<BTreeMap<u64, BTreeSet<u64>>> {
        const MARK: &str = "raft: node ";
        let mut terms: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
        for m in &self.members {
            let text = std::fs::read_to_string(&m.log)
                .with_context(|| format!("reading {}", m.log.display()))?;
            for line in text.lines() {
                let Some(i) = line.find(MARK) else { continue };
                let rest = &line[i + MARK.len()..];
                if !rest.contains(" became leader at term ") {
                    continue;
                }
                let words: Vec<&str> = rest.split_whitespace().collect();
                // "{id} became leader at term {term}"
                let (Some(id), Some(term)) = (
                    words.first().copied().and_then(leading_number),
                    words.get(5).copied().and_then(leading_number),
                ) else {
                    bail!("unparsable leader line in {}: {line}", m.log.display());
                };
                if id != m.id {
                    bail!("master-{}.log says node {id} became leader: {line}", m.id);
                }
                terms.entry(term).or_default().insert(id);
            }
        }
        Ok(terms)
    }

    /// Asserts that some leader was elected and no term ever had two leaders; returns the
    /// term → leader map.
    pub fn assert_one_leader_per_term(&self) -> BTreeMap<u64, BTreeSet<u64>> {
        let terms = self
            .leader_terms()
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.logs()));
        assert!(
            !terms.is_empty(),
            "no leader was ever logged\n{}",
            self.logs()
        );
        for (term, ids) in &terms {
            assert_eq!(
                ids.len(),
                1,
                "term {term} had leaders {ids:?} (all terms: {terms:?})\n{}",
                self.logs()
            );
        }
        terms
    }
}

/// A `granary bench metadata` run in the background: stdout (its JSON) goes to `<name>.out`,
/// stderr to `<name>.log`, acknowledged paths to `<name>.acks`. Killed on drop.
pub struct Bench {
    pub proc: Proc,
    pub out: PathBuf,
    pub acks: PathBuf,
}

impl Bench {
    /// `granary bench metadata --master MASTER --dir DIR --ack-log <name>.acks --json EXTRA..`
    pub fn spawn(root: &Path, name: &str, master: &str, dir: &str, extra: &[&str]) -> Result<Self> {
        std::fs::create_dir_all(root)?;
        let log = root.join(format!("{name}.log"));
        let out = root.join(format!("{name}.out"));
        let acks = root.join(format!("{name}.acks"));
        let ack_arg = acks.to_string_lossy().to_string();
        let mut args: Vec<&str> = vec![
            "bench",
            "metadata",
            "--master",
            master,
            "--dir",
            dir,
            "--ack-log",
            &ack_arg,
            "--json",
        ];
        args.extend_from_slice(extra);
        let err = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let log_start = err.metadata()?.len() as usize;
        let stdout = std::fs::File::create(&out)?;
        let mut cmd = Command::new(granary_bin());
        secure_command(&mut cmd, &args);
        let child = cmd
            .args(&args)
            .env("GRANARY_LOG", "info")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(err)
            .spawn()
            .with_context(|| format!("spawning {} {args:?}", granary_bin().display()))?;
        Ok(Self {
            proc: Proc {
                name: name.to_string(),
                child,
                log,
                log_start,
            },
            out,
            acks,
        })
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.proc.child.try_wait(), Ok(None))
    }

    /// The paths acknowledged so far.
    pub fn acked(&self) -> BTreeSet<String> {
        read_acks(&self.acks)
    }

    pub fn ack_count(&self) -> usize {
        self.acked().len()
    }

    /// Waits until at least `n` paths are acknowledged; fails early if the bench exits.
    pub fn wait_acks(&mut self, n: usize, timeout: Duration) -> Result<usize> {
        let acks = self.acks.clone();
        let res = poll(&format!("{n} acknowledged creates"), timeout, || {
            let c = read_acks(&acks).len();
            if c >= n {
                return Some(Ok(c));
            }
            if let Ok(Some(st)) = self.proc.child.try_wait() {
                return Some(Err(anyhow::anyhow!(
                    "the bench exited ({st}) after {c} acknowledged creates"
                )));
            }
            None
        });
        match res {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) | Err(e) => Err(e.context(format!(
                "{} acks; bench log:\n{}",
                self.ack_count(),
                log_tail(&self.proc.log, 100)
            ))),
        }
    }

    /// Waits for the bench to exit 0 and returns the JSON object it printed.
    pub fn wait(&mut self, timeout: Duration) -> Result<serde_json::Value> {
        let st = poll("the bench to exit", timeout, || {
            self.proc.child.try_wait().ok().flatten()
        })
        .with_context(|| format!("bench log:\n{}", log_tail(&self.proc.log, 100)))?;
        let out = std::fs::read_to_string(&self.out)?;
        if !st.success() {
            bail!(
                "the bench failed ({st}); stdout: {out}\nlog:\n{}",
                log_tail(&self.proc.log, 100)
            );
        }
        serde_json::from_str(out.trim())
            .with_context(|| format!("bench stdout is not one JSON object: {out:?}"))
    }

    /// SIGKILLs the bench (acknowledged lines are already flushed).
    pub fn kill9(&mut self) -> Result<()> {
        if let Ok(None) = self.proc.child.try_wait() {
            self.proc.kill9()?;
        }
        Ok(())
    }
}

/// Asserts a failed CLI call the way users see it: exit 1 and one line `error: …` on stderr.
pub fn assert_one_sentence_error(out: &Output, what: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{what}: exit {:?}, stderr {err}",
        out.status
    );
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{what}: stderr is not one line: {err}"
    );
    assert!(err.starts_with("error: "), "{what}: {err}");
}

/// `granary mount add PATH DIR --master MASTER` for a local folder.
pub fn mount_local(path: &str, dir: &Path, master: &str) -> Result<String> {
    mount_local_opts(path, dir, master, &[])
}

/// [`mount_local`] with mount options (`key=value`, each passed as `--option`).
pub fn mount_local_opts(path: &str, dir: &Path, master: &str, options: &[&str]) -> Result<String> {
    let dir = dir.to_string_lossy();
    let mut args = vec!["mount", "add", path, &dir];
    for o in options {
        args.extend(["--option", o]);
    }
    args.extend(["--master", master]);
    granary_ok(&args)
}
