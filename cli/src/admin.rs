//! Admin commands: mounts, namespace browsing, cluster report.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use granary_client::{FileSystem, MasterClient};
use granary_common::net::Net;
use granary_common::paths::printable;
use granary_common::size::format_size;
use granary_proto as pb;
use serde_json::json;

use crate::args::{
    BenchCommand, FsCommand, MasterAction, MasterAddr, MountCommand, ReportArgs, WorkerAction,
};

/// Admin commands retry long enough to ride out a leader election, then fail.
const ADMIN_RETRY: Duration = Duration::from_secs(8);

fn master(net: &Net, addr: &MasterAddr) -> anyhow::Result<MasterClient> {
    Ok(MasterClient::new(net.clone(), &addr.master)?.with_retry_window(ADMIN_RETRY))
}

fn kind_name(s: &pb::FileStatus) -> &'static str {
    if s.kind == pb::FileKind::Directory as i32 {
        "dir"
    } else {
        "file"
    }
}

fn mtime(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// `persisted` (the under-store has it), `pending` (written async-through, being
/// uploaded), `not-persisted` (must-cache: only in the cache), `writing` (not closed yet).
fn persist_name(s: &pb::FileStatus) -> &'static str {
    if s.kind == pb::FileKind::Directory as i32 {
        return "persisted";
    }
    if !s.complete {
        return "writing";
    }
    match pb::PersistState::try_from(s.persist_state) {
        Ok(pb::PersistState::Pending) => "pending",
        Ok(pb::PersistState::NotPersisted) => "not-persisted",
        _ => "persisted",
    }
}

fn status_json(s: &pb::FileStatus) -> serde_json::Value {
    json!({
        "path": s.path,
        "name": s.name,
        "inode": s.inode,
        "kind": kind_name(s),
        "length": s.length,
        "block_size": s.block_size,
        "mode": format!("{:o}", s.mode),
        "mtime_ms": s.mtime_ms,
        "mount_point": s.is_mount_point,
        "complete": s.complete,
        "persisted": persist_name(s),
        "persist_worker": s.persist_worker,
        "ufs": s.ufs.as_ref().map(|u| json!({"mount_id": u.mount_id, "path": u.path})),
        "fingerprint": s.fingerprint.as_ref().map(|f| json!({
            "etag": f.etag, "size": f.size, "mtime_ms": f.mtime_ms, "version_id": f.version_id,
        })),
        "version": format!("{:016x}", s.version),
        "pinned_replicas": s.pinned_replicas,
        "ttl": (s.ttl_expires_ms > 0).then(|| json!({"expires_ms": s.ttl_expires_ms, "action": s.ttl_action})),
        "sync": json!({
            "failures": s.sync_failures,
            "error": s.sync_error,
            "synced_ms_ago": s.synced_ms_ago,
        }),
    })
}

fn mount_json(m: &pb::MountInfo) -> serde_json::Value {
    let opts: serde_json::Map<String, serde_json::Value> = m
        .options
        .iter()
        .map(|o| (o.key.clone(), json!(o.value)))
        .collect();
    json!({"id": m.mount_id, "path": m.path, "uri": m.uri, "read_only": m.read_only, "options": opts})
}

/// The options of `mount add`: `-o key=value`, plus values read from files
/// (`--option-file key=FILE`) and environment variables (`--option-env key=VAR`), so
/// credentials need not appear on the command line. A key given twice is refused.
fn mount_options(
    options: &[String],
    files: &[String],
    envs: &[String],
) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let mut opts = granary_common::ufs::parse_option_args(options)?;
    let split = |a: &str, flag: &str| -> anyhow::Result<(String, String)> {
        match a.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() && !v.is_empty() => {
                Ok((k.trim().to_string(), v.to_string()))
            }
            _ => anyhow::bail!("{flag} expects KEY=VALUE, not {a:?}"),
        }
    };
    let mut more = Vec::new();
    for a in files {
        let (key, file) = split(a, "--option-file")?;
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("cannot read option {key} from {file}"))?;
        let value = text.strip_suffix('\n').unwrap_or(&text);
        let value = value.strip_suffix('\r').unwrap_or(value).to_string();
        anyhow::ensure!(!value.is_empty(), "option {key}: {file} is empty");
        more.push((key, value));
    }
    for a in envs {
        let (key, var) = split(a, "--option-env")?;
        let value = std::env::var(&var).map_err(|_| {
            anyhow::anyhow!("option {key}: environment variable {var} is not set (or not UTF-8)")
        })?;
        anyhow::ensure!(
            !value.is_empty(),
            "option {key}: environment variable {var} is empty"
        );
        more.push((key, value));
    }
    for (key, value) in more {
        anyhow::ensure!(
            opts.insert(key.clone(), value).is_none(),
            "option {key} is given twice"
        );
    }
    Ok(opts)
}

pub async fn mount(net: &Net, cmd: MountCommand) -> anyhow::Result<()> {
    match cmd {
        MountCommand::Add {
            path,
            uri,
            options,
            option_files,
            option_envs,
            exist_ok,
            master: addr,
        } => {
            let opts = mount_options(&options, &option_files, &option_envs)?;
            if exist_ok {
                let norm = granary_common::paths::normalize(&path)?;
                let mounts = master(net, &addr)?.list_mounts().await?;
                if let Some(m) = mounts.iter().find(|m| m.path == norm) {
                    anyhow::ensure!(
                        m.uri == uri || m.uri == format!("file://{uri}"),
                        "{norm} is already mounted from {}, not {uri}",
                        m.uri
                    );
                    println!("{} is already mounted at {}", m.uri, m.path);
                    return Ok(());
                }
            }
            let m = master(net, &addr)?
                .add_mount(
                    &path,
                    &uri,
                    opts.into_iter()
                        .map(|(key, value)| pb::MountOptionEntry { key, value })
                        .collect(),
                )
                .await
                .with_context(|| {
                    format!(
                        "cannot mount {} at {path}",
                        granary_common::ufs::shown_uri(&uri)
                    )
                })?;
            println!("mounted {} at {}", m.uri, m.path);
        }
        MountCommand::List { json, master: addr } => {
            let mounts = master(net, &addr)?.list_mounts().await?;
            if json {
                let v: Vec<_> = mounts.iter().map(mount_json).collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for m in &mounts {
                    let opts: Vec<String> = m
                        .options
                        .iter()
                        .map(|o| format!("{}={}", o.key, o.value))
                        .collect();
                    println!(
                        "{}\t{}\t{}",
                        m.path,
                        m.uri,
                        if opts.is_empty() {
                            "-".to_string()
                        } else {
                            opts.join(",")
                        }
                    );
                }
            }
        }
        MountCommand::Remove {
            path,
            force,
            master: addr,
        } => {
            master(net, &addr)?
                .remove_mount(&path, force)
                .await
                .with_context(|| format!("cannot remove the mount at {path}"))?;
            println!("removed the mount at {path}");
        }
    }
    Ok(())
}

pub async fn fs(net: &Net, cmd: FsCommand) -> anyhow::Result<()> {
    match cmd {
        FsCommand::Mkdir {
            path,
            parents,
            master: addr,
        } => {
            let s = master(net, &addr)?
                .mkdir(&path, parents, 0o755)
                .await
                .with_context(|| format!("cannot create the directory {path}"))?;
            println!("{}", printable(&s.path));
        }
        FsCommand::Sync {
            path,
            recursive,
            master: addr,
        } => {
            let r = master(net, &addr)?
                .sync_metadata(&path, recursive)
                .await
                .with_context(|| format!("cannot sync {path}"))?;
            if !r.failures.is_empty() {
                anyhow::bail!(
                    "{} of {} directories could not be listed (their known entries were kept): {}",
                    r.failures.len(),
                    r.failures.len() as u64 + r.dirs_listed,
                    r.failures.join("; ")
                );
            }
            println!("listed {} directories", r.dirs_listed);
        }
        FsCommand::Ls {
            path,
            long,
            recursive,
            stale,
            json,
            master: addr,
        } => fs_ls(net, path, long, recursive, stale, json, addr).await?,
        FsCommand::Stat {
            path,
            json,
            master: addr,
        } => fs_stat(net, path, json, addr).await?,
        FsCommand::Rm {
            path,
            recursive,
            master: addr,
        } => {
            master(net, &addr)?
                .delete(&path, recursive)
                .await
                .with_context(|| format!("cannot remove {path}"))?;
        }
        FsCommand::Mv {
            src,
            dst,
            master: addr,
        } => {
            master(net, &addr)?
                .rename(&src, &dst)
                .await
                .with_context(|| format!("cannot move {src} to {dst}"))?;
        }
        FsCommand::Cp {
            src,
            dst,
            write_mode,
            force,
            master: addr,
        } => {
            let client = FileSystem::new(master(net, &addr)?);
            let n = copy(&client, &src, &dst, write_mode.as_deref(), force)
                .await
                .with_context(|| format!("cannot copy {src} to {dst}"))?;
            eprintln!("copied {n} bytes");
        }
        FsCommand::Du {
            path,
            summarize,
            json,
            master: addr,
        } => fs_du(net, path, summarize, json, addr).await?,
        FsCommand::Cat { path, master: addr } => fs_cat(net, path, addr).await?,
    }
    Ok(())
}

/// `granary fs ls`.
async fn fs_ls(
    net: &Net,
    path: String,
    long: bool,
    recursive: bool,
    stale: bool,
    json: bool,
    addr: MasterAddr,
) -> anyhow::Result<()> {
    let client = FileSystem::new(master(net, &addr)?);
    let entries = if recursive {
        walk(&client, &path, stale).await?
    } else {
        client
            .list_with(pb::path_or_id::Target::Path(path.clone()), stale)
            .await
            .with_context(|| format!("cannot list {path}"))?
    };
    // Recursive listings name entries by their full path.
    let entries: Vec<pb::FileStatus> = entries
        .into_iter()
        .map(|mut e| {
            if recursive {
                e.name = e.path.clone();
            }
            e
        })
        .collect();
    let mut out = std::io::stdout().lock();
    if json {
        let v: Vec<_> = entries.iter().map(status_json).collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        for e in &entries {
            // Pinned entries are marked (with their replicas in the long form).
            if long {
                let pin = match e.pinned_replicas {
                    0 => "-".to_string(),
                    n => format!("pinned:{n}"),
                };
                writeln!(
                    out,
                    "{}\t{:>12}\t{}\t{pin}\t{}",
                    kind_name(e),
                    e.length,
                    mtime(e.mtime_ms),
                    printable(&e.name)
                )?;
            } else if e.pinned_replicas > 0 {
                writeln!(out, "{} (pinned)", printable(&e.name))?;
            } else {
                writeln!(out, "{}", printable(&e.name))?;
            }
        }
    }
    Ok(())
}

/// `granary fs stat`.
async fn fs_stat(net: &Net, path: String, json: bool, addr: MasterAddr) -> anyhow::Result<()> {
    let client = FileSystem::new(master(net, &addr)?);
    let s = client
        .stat(&path)
        .await
        .with_context(|| format!("cannot stat {path}"))?;
    let cache = cache_state(&client, &s).await?;
    if json {
        let mut v = status_json(&s);
        if let (Some(c), Some(obj)) = (&cache, v.as_object_mut()) {
            obj.insert("cached_bytes".into(), c.cached_bytes.into());
            obj.insert("cached_percent".into(), json!(c.percent()));
            obj.insert("replicas".into(), c.min_replicas.into());
            obj.insert(
                "locations".into(),
                json!(c
                    .locations
                    .iter()
                    .map(|(b, w)| json!({"block": b, "workers": w}))
                    .collect::<Vec<_>>()),
            );
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if let Some(c) = &cache {
            println!(
                "cached:      {:.1}% ({} of {} bytes), {} replica(s) of every block",
                c.percent(),
                c.cached_bytes,
                s.length,
                c.min_replicas
            );
            for (b, w) in &c.locations {
                let ws: Vec<String> = w.iter().map(u64::to_string).collect();
                println!("  block {b}: workers {}", ws.join(", "));
            }
        }
        if s.pinned_replicas > 0 {
            println!("pinned:      {} replicas", s.pinned_replicas);
        }
        if s.ttl_expires_ms > 0 {
            println!(
                "ttl:         {} at {} ms since the epoch",
                s.ttl_action, s.ttl_expires_ms
            );
        }
        println!("path:        {}", printable(&s.path));
        println!("kind:        {}", kind_name(&s));
        println!("inode:       {}", s.inode);
        println!("size:        {} ({})", s.length, format_size(s.length));
        println!("block size:  {}", format_size(s.block_size));
        println!("mode:        {:o}", s.mode);
        println!("modified:    {}", mtime(s.mtime_ms));
        if s.kind != pb::FileKind::Directory as i32 {
            let by = if s.persist_worker != 0 {
                format!(" (on worker {})", s.persist_worker)
            } else {
                String::new()
            };
            println!("persisted:   {}{by}", persist_name(&s));
        }
        if let Some(u) = &s.ufs {
            println!(
                "under-store: mount {} path {}",
                u.mount_id,
                if u.path.is_empty() { "/" } else { &u.path }
            );
        }
        if s.sync_failures > 0 {
            println!(
                "sync:        FAILING ({} listings in a row; known entries kept): {}",
                s.sync_failures, s.sync_error
            );
        } else if s.synced_ms_ago > 0 {
            println!("sync:        listed {} ms ago", s.synced_ms_ago);
        }
        if let Some(f) = &s.fingerprint {
            println!(
                "fingerprint: etag={} size={} mtime_ms={}",
                f.etag, f.size, f.mtime_ms
            );
        }
        if s.is_mount_point {
            println!("mount point: yes");
        }
    }
    Ok(())
}

/// `granary fs du`.
async fn fs_du(
    net: &Net,
    path: String,
    summarize: bool,
    json: bool,
    addr: MasterAddr,
) -> anyhow::Result<()> {
    let client = FileSystem::new(master(net, &addr)?);
    let top = client
        .list_with(pb::path_or_id::Target::Path(path.clone()), false)
        .await
        .with_context(|| format!("cannot list {path}"))?;
    let mut rows: Vec<(String, u64, u64)> = Vec::new();
    let (mut bytes, mut files) = (0u64, 0u64);
    for e in top {
        let (b, f) = if e.kind == pb::FileKind::Directory as i32 {
            let below = walk(&client, &e.path, false).await?;
            let fs: Vec<_> = below
                .iter()
                .filter(|x| x.kind != pb::FileKind::Directory as i32)
                .collect();
            (fs.iter().map(|x| x.length).sum(), fs.len() as u64)
        } else {
            (e.length, 1)
        };
        bytes += b;
        files += f;
        rows.push((e.path, b, f));
    }
    if json {
        let v = json!({
            "path": path,
            "bytes": bytes,
            "files": files,
            "entries": if summarize { Vec::new() } else {
                rows.iter().map(|(p, b, f)| json!({"path": p, "bytes": b, "files": f})).collect()
            },
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if !summarize {
            for (p, b, f) in &rows {
                println!(
                    "{:>10}  {b:>15}  {f:>9} files  {}",
                    format_size(*b),
                    printable(p)
                );
            }
        }
        println!(
            "{:>10}  {bytes:>15}  {files:>9} files  {path}",
            format_size(bytes)
        );
    }
    Ok(())
}

/// `granary fs cat`.
async fn fs_cat(net: &Net, path: String, addr: MasterAddr) -> anyhow::Result<()> {
    let client = FileSystem::new(master(net, &addr)?);
    let s = client
        .stat(&path)
        .await
        .with_context(|| format!("cannot read {path}"))?;
    if s.kind == pb::FileKind::Directory as i32 {
        anyhow::bail!("cannot read {path}: it is a directory");
    }
    const CHUNK: u64 = 4 * 1024 * 1024;
    let mut out = std::io::stdout().lock();
    let mut off = 0;
    while off < s.length {
        let data = client
            .read(&s, off, CHUNK)
            .await
            .with_context(|| format!("cannot read {path} at offset {off}"))?;
        if data.is_empty() {
            anyhow::bail!("cannot read {path}: unexpected end of data at offset {off}");
        }
        if let Err(e) = out.write_all(&data) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return Ok(());
            }
            return Err(e.into());
        }
        off += data.len() as u64;
    }
    out.flush().ok();
    Ok(())
}

/// `granary fs cp`: one file, Granary or local (`file:`) on either side. Returns the bytes
/// copied.
async fn copy(
    client: &std::sync::Arc<FileSystem>,
    src: &str,
    dst: &str,
    write_mode: Option<&str>,
    force: bool,
) -> anyhow::Result<u64> {
    use granary_client::WriteMode;
    const CHUNK: u64 = 4 * 1024 * 1024;
    let local = |p: &str| p.strip_prefix("file:").map(std::path::PathBuf::from);
    // The source: a reader of chunks.
    enum Source {
        Local(std::fs::File, u64),
        Granary(Box<pb::FileStatus>),
    }
    let source = match local(src) {
        Some(p) => {
            let f = std::fs::File::open(&p).with_context(|| format!("{}", p.display()))?;
            let len = f.metadata()?.len();
            if f.metadata()?.is_dir() {
                anyhow::bail!("{} is a directory (fs cp copies files)", p.display());
            }
            Source::Local(f, len)
        }
        None => {
            let s = client.stat(src).await?;
            if s.kind == pb::FileKind::Directory as i32 {
                anyhow::bail!("{src} is a directory (fs cp copies files)");
            }
            Source::Granary(Box::new(s))
        }
    };
    let len = match &source {
        Source::Local(_, l) => *l,
        Source::Granary(s) => s.length,
    };
    let source = &source;
    let read = |off: u64| {
        let n = CHUNK.min(len - off);
        async move {
            match &source {
                Source::Local(f, _) => {
                    let mut buf = vec![0u8; n as usize];
                    std::os::unix::fs::FileExt::read_exact_at(f, &mut buf, off)?;
                    Ok::<bytes::Bytes, anyhow::Error>(buf.into())
                }
                Source::Granary(s) => Ok(client.read(s, off, n).await?),
            }
        }
    };
    match local(dst) {
        Some(p) => {
            if p.exists() && !force {
                anyhow::bail!("{} exists (--force replaces it)", p.display());
            }
            let mut out = std::fs::File::create(&p).with_context(|| format!("{}", p.display()))?;
            let mut off = 0;
            while off < len {
                let data = read(off).await?;
                if data.is_empty() {
                    anyhow::bail!("unexpected end of data at offset {off}");
                }
                out.write_all(&data)?;
                off += data.len() as u64;
            }
            out.sync_all()?;
        }
        None => {
            let mode: WriteMode = match write_mode {
                Some(m) => m.parse().map_err(anyhow::Error::msg)?,
                None => mount_write_mode(client, dst).await,
            };
            let mut w = client.create_writer(dst, 0o644, force, mode, 1).await?;
            let mut off = 0;
            while off < len {
                let data = read(off).await?;
                if data.is_empty() {
                    anyhow::bail!("unexpected end of data at offset {off}");
                }
                let n = data.len() as u64;
                w.write(off, data).await?;
                off += n;
            }
            w.close().await?;
        }
    }
    Ok(len)
}

/// The `write_mode` option of the mount `path` would be written in (cache-through when
/// none is set or the path is outside mounts' options).
async fn mount_write_mode(client: &FileSystem, path: &str) -> granary_client::WriteMode {
    let Ok(mounts) = client.master.list_mounts().await else {
        return Default::default();
    };
    mounts
        .iter()
        .filter(|m| {
            path == m.path || path.starts_with(&format!("{}/", m.path.trim_end_matches('/')))
        })
        .max_by_key(|m| m.path.len())
        .and_then(|m| m.options.iter().find(|o| o.key == "write_mode"))
        .and_then(|o| o.value.parse().ok())
        .unwrap_or_default()
}

/// Where a file's blocks are cached, as the leader knows from the workers' reports.
struct CacheState {
    cached_bytes: u64,
    min_replicas: usize,
    /// (block index, workers holding pages of it)
    locations: Vec<(u32, Vec<u64>)>,
    length: u64,
}

impl CacheState {
    fn percent(&self) -> f64 {
        if self.length == 0 {
            100.0
        } else {
            (self.cached_bytes as f64 * 10000.0 / self.length as f64).round() / 100.0
        }
    }
}

/// The cache state of a file (None for directories).
async fn cache_state(
    client: &FileSystem,
    s: &pb::FileStatus,
) -> anyhow::Result<Option<CacheState>> {
    if s.kind == pb::FileKind::Directory as i32 {
        return Ok(None);
    }
    let bs = if s.block_size == 0 {
        granary_common::DEFAULT_BLOCK_SIZE
    } else {
        s.block_size
    };
    let n = s.length.div_ceil(bs) as u32;
    let mut st = CacheState {
        cached_bytes: 0,
        min_replicas: usize::MAX,
        locations: Vec::new(),
        length: s.length,
    };
    let ids: Vec<pb::BlockId> = (0..n)
        .map(|index| pb::BlockId {
            inode: s.inode,
            version: s.version,
            index,
        })
        .collect();
    for chunk in ids.chunks(1000) {
        for l in client.master.block_locations(chunk.to_vec()).await? {
            let Some(b) = l.block else { continue };
            let workers: Vec<u64> = l.workers.iter().map(|w| w.worker_id).collect();
            let len = bs.min(s.length - u64::from(b.index) * bs);
            if !workers.is_empty() {
                st.cached_bytes += len;
            }
            st.min_replicas = st.min_replicas.min(workers.len());
            st.locations.push((b.index, workers));
        }
    }
    if st.min_replicas == usize::MAX {
        st.min_replicas = 0;
    }
    Ok(Some(st))
}

/// Every entry below `path` (not the path itself), directories first-level before deeper
/// ones, each directory's entries in name order.
async fn walk(client: &FileSystem, path: &str, stale: bool) -> anyhow::Result<Vec<pb::FileStatus>> {
    let mut out = Vec::new();
    let mut dirs = std::collections::VecDeque::from([path.to_string()]);
    while let Some(d) = dirs.pop_front() {
        let entries = client
            .list_with(pb::path_or_id::Target::Path(d.clone()), stale)
            .await
            .with_context(|| format!("cannot list {d}"))?;
        for e in entries {
            if e.kind == pb::FileKind::Directory as i32 && e.path != d {
                dirs.push_back(e.path.clone());
            }
            out.push(e);
        }
    }
    Ok(out)
}

pub async fn report(net: &Net, a: ReportArgs) -> anyhow::Result<()> {
    let m = master(net, &a.master)?;
    let info = m.cluster_info(false).await?;
    let running: Vec<pb::JobInfo> = m
        .list_jobs()
        .await?
        .into_iter()
        .filter(|j| !j.job_state().finished())
        .collect();
    let stats: Vec<pb::WorkerStats> = info
        .workers
        .iter()
        .filter(|w| w.is_live())
        .map(|w| w.stats.clone().unwrap_or_default())
        .collect();
    // Workers report these counters: sums saturate, so no reported value can overflow them.
    let total =
        |f: fn(&pb::WorkerStats) -> u64| stats.iter().map(f).fold(0u64, |a, b| a.saturating_add(b));
    let cap = total(|s| s.capacity_bytes);
    let used = total(|s| s.used_bytes);
    // Short-circuit reads are cache hits that bypassed the workers' gRPC service.
    let hit = total(|s| s.cache_hit_bytes.saturating_add(s.short_circuit_bytes));
    let miss = total(|s| s.cache_miss_bytes);
    let ufs = total(|s| s.ufs_read_bytes);
    let ratio = if hit.saturating_add(miss) > 0 {
        hit as f64 / (hit as f64 + miss as f64)
    } else {
        0.0
    };
    // Every byte served from a cache (to a client, or to a worker filling its cache) is a
    // byte the under-stores did not serve.
    let peer = total(|s| s.peer_served_bytes);
    let saved = hit.saturating_add(peer);
    use granary_worker::metrics::{MissLatency, MISS_BUCKETS};
    let mut buckets = vec![0u64; MISS_BUCKETS];
    for s in &stats {
        for (i, c) in s.miss_latency_buckets.iter().enumerate().take(MISS_BUCKETS) {
            buckets[i] += c;
        }
    }
    let misses: u64 = buckets.iter().sum();
    let p50 = MissLatency::quantile_us(&buckets, 0.5).map(|us| us / 1000.0);
    let p99 = MissLatency::quantile_us(&buckets, 0.99).map(|us| us / 1000.0);
    if a.json {
        let v = json!({
            "leader_id": info.leader_id,
            "inodes": info.inode_count,
            "mounts": info.mount_count,
            "masters": info.masters.iter().map(master_json).collect::<Vec<_>>(),
            "workers": info.workers.iter().map(|w| {
                let s = w.stats.clone().unwrap_or_default();
                json!({
                    "id": w.worker_id, "address": w.address, "data_address": w.data_address,
                    "host": w.host, "state": w.state,
                    "last_heartbeat_ms_ago": w.last_heartbeat_ms_ago, "blocks": w.block_count,
                    "capacity_bytes": s.capacity_bytes, "used_bytes": s.used_bytes,
                    "cache_hit_bytes": s.cache_hit_bytes, "cache_miss_bytes": s.cache_miss_bytes,
                    "ufs_read_bytes": s.ufs_read_bytes, "ufs_requests": s.ufs_requests,
                    "evicted_bytes": s.evicted_bytes,
                    "short_circuit_bytes": s.short_circuit_bytes,
                    "peer_served_bytes": s.peer_served_bytes,
                    "node_copy_bytes": s.node_copy_bytes,
                    "peer_fill_bytes": s.peer_fill_bytes,
                    "tiers": s.tiers.iter().map(|t| json!({
                        "tier": t.tier, "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                    })).collect::<Vec<_>>(),
                })
            }).collect::<Vec<_>>(),
            "capacity_bytes": cap,
            "used_bytes": used,
            "cache_hit_bytes": hit,
            "cache_miss_bytes": miss,
            "ufs_read_bytes": ufs,
            "ufs_bytes_saved": saved,
            "hit_ratio": ratio,
            "miss_penalty_ms": json!({"p50": p50, "p99": p99, "samples": misses}),
            "jobs_running": running.iter().map(crate::jobs::job_json).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("Masters");
    for m in &info.masters {
        println!(
            "  {}  {}  {}  term {}  commit {}  applied {}",
            m.id, m.address, m.role, m.term, m.commit_index, m.applied_index
        );
    }
    println!(
        "Namespace: {} inodes, {} mounts",
        info.inode_count, info.mount_count
    );
    println!("Workers ({} live of {})", stats.len(), info.workers.len());
    for w in &info.workers {
        print_worker(w);
    }
    println!(
        "Capacity: {} used of {}",
        format_size(used),
        format_size(cap)
    );
    println!(
        "Reads: {} from cache, {} missed, hit ratio {:.1}%; {} read from under-stores, {} saved",
        format_size(hit),
        format_size(miss),
        ratio * 100.0,
        format_size(ufs),
        format_size(saved)
    );
    match (p50, p99) {
        (Some(p50), Some(p99)) => {
            println!("Miss penalty: p50 {p50:.1} ms, p99 {p99:.1} ms ({misses} page misses)")
        }
        _ => println!("Miss penalty: no misses yet"),
    }
    if running.is_empty() {
        println!("Jobs: none running");
    } else {
        println!("Jobs running");
        for j in &running {
            println!(
                "  {}  {}  {}  {} of {} files, {} failed",
                j.id, j.kind, j.path, j.done_files, j.total_files, j.failed_files
            );
        }
    }
    Ok(())
}

/// One worker's lines of `granary report`.
fn print_worker(w: &pb::WorkerInfo) {
    let s = w.stats.clone().unwrap_or_default();
    println!(
        "  {:<20} {:<22} {:<5} used {} of {}  blocks {}  heartbeat {} ms ago",
        w.worker_id,
        w.address,
        w.state,
        format_size(s.used_bytes),
        format_size(s.capacity_bytes),
        w.block_count,
        w.last_heartbeat_ms_ago
    );
    if s.tiers.len() > 1 {
        let tiers: Vec<String> = s
            .tiers
            .iter()
            .map(|t| {
                format!(
                    "{} {} of {}",
                    t.tier,
                    format_size(t.used_bytes),
                    format_size(t.capacity_bytes)
                )
            })
            .collect();
        println!("  {:<20} tiers: {}", "", tiers.join(", "));
    }
    // Where this node's bytes went: read from its disk by clients of its node, served
    // over gRPC, copied from peers (node copies, hand-overs), fetched from stores.
    println!(
        "  {:<20} node {}: {} read locally, {} served over gRPC ({} to peers), {} copied from peers ({} node copies), {} from under-stores",
        "",
        if w.host.is_empty() { "?" } else { &w.host },
        format_size(s.short_circuit_bytes),
        format_size(s.cache_hit_bytes.saturating_add(s.cache_miss_bytes)),
        format_size(s.peer_served_bytes),
        format_size(s.peer_fill_bytes),
        format_size(s.node_copy_bytes),
        format_size(s.ufs_read_bytes)
    );
}

fn master_json(m: &pb::MasterInfo) -> serde_json::Value {
    json!({
        "id": m.id, "address": m.address, "role": m.role, "term": m.term,
        "commit_index": m.commit_index, "applied_index": m.applied_index,
        "state_format": m.state_format, "entry_format": m.entry_format,
    })
}

fn print_masters(masters: &[pb::MasterInfo], as_json: bool) -> anyhow::Result<()> {
    if as_json {
        let v: Vec<_> = masters.iter().map(master_json).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    // FORMAT: the newest state format the master reads / the one its entries are in
    // ("json" before format 1; see docs/operations.md, "Upgrading the masters").
    let format = |v: u32| match v {
        0 => "json".to_string(),
        v => v.to_string(),
    };
    println!(
        "{:<4} {:<24} {:<13} {:>8} {:>12} {:>12}  FORMAT",
        "ID", "ADDRESS", "ROLE", "TERM", "COMMIT", "APPLIED"
    );
    for m in masters {
        let formats = match m.role.as_str() {
            "unreachable" => "-".to_string(),
            _ => format!("{}/{}", format(m.state_format), format(m.entry_format)),
        };
        println!(
            "{:<4} {:<24} {:<13} {:>8} {:>12} {:>12}  {formats}",
            m.id, m.address, m.role, m.term, m.commit_index, m.applied_index
        );
    }
    Ok(())
}

/// `granary master list|add|remove`.
pub async fn workers(net: &Net, action: WorkerAction) -> anyhow::Result<()> {
    match action {
        WorkerAction::Decommission {
            id,
            force,
            master: addr,
        } => {
            master(net, &addr)?
                .decommission_worker(id, force)
                .await
                .with_context(|| format!("cannot decommission worker {id}"))?;
            eprintln!(
                "worker {id} decommissioned: no new blocks go to it; its cached pages are copied by the workers taking its blocks over; stop it when `granary report` shows it idle"
            );
            Ok(())
        }
        WorkerAction::Recommission { id, master: addr } => {
            master(net, &addr)?
                .recommission_worker(id)
                .await
                .with_context(|| format!("cannot recommission worker {id}"))?;
            eprintln!("worker {id} recommissioned: blocks are placed on it again");
            Ok(())
        }
    }
}

pub async fn masters(net: &Net, action: MasterAction) -> anyhow::Result<()> {
    match action {
        MasterAction::List { json, master: addr } => {
            let info = master(net, &addr)?
                .cluster_info(true)
                .await
                .context("cannot list the masters")?;
            print_masters(&info.masters, json)
        }
        MasterAction::Add {
            id,
            address,
            master: addr,
        } => {
            let masters = master(net, &addr)?
                .add_master(id, &address)
                .await
                .with_context(|| format!("cannot add master {id} at {address}"))?;
            eprintln!("added master {id} at {address}");
            print_masters(&masters, false)
        }
        MasterAction::Remove { id, master: addr } => {
            let masters = master(net, &addr)?
                .remove_master(id)
                .await
                .with_context(|| format!("cannot remove master {id}"))?;
            eprintln!("removed master {id}");
            print_masters(&masters, false)
        }
    }
}

/// `granary bench metadata`: creates/s and stats/s against a running cluster.
pub async fn bench(net: &Net, cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Get {
            uri,
            options,
            each,
            json,
        } => bench_get(&uri, &options, each, json).await,
        BenchCommand::Tcp { size, json } => bench_tcp(size, json),
        BenchCommand::Tls { size, json } => bench_tls(size, json).await,
        BenchCommand::Read {
            path,
            passes,
            concurrency,
            short_circuit,
            no_data_plane,
            json,
            master: addr,
        } => {
            let how = ReadPath {
                short_circuit,
                data_plane: !no_data_plane,
            };
            bench_read(net, &path, passes, concurrency, how, json, &addr).await
        }
        BenchCommand::Metadata {
            dir,
            duration,
            ops,
            concurrency,
            ack_log,
            reads_at_leader,
            stat_existing,
            json,
            master: addr,
        } => {
            let load = MetadataLoad {
                dir,
                duration,
                ops,
                concurrency,
                ack_log,
                reads_at_leader,
                stat_existing,
            };
            bench_metadata(net, load, json, &addr).await
        }
    }
}

/// What `granary bench metadata` runs.
struct MetadataLoad {
    dir: String,
    duration: std::time::Duration,
    ops: Option<u64>,
    concurrency: usize,
    ack_log: Option<std::path::PathBuf>,
    reads_at_leader: bool,
    stat_existing: Option<u64>,
}

/// `granary bench metadata`: creates then stats through the master group.
async fn bench_metadata(
    net: &Net,
    load: MetadataLoad,
    json: bool,
    addr: &MasterAddr,
) -> anyhow::Result<()> {
    let MetadataLoad {
        dir,
        duration,
        ops,
        concurrency,
        ack_log,
        reads_at_leader,
        stat_existing,
    } = load;
    let client = MasterClient::new(net.clone(), &addr.master)?.with_spread_reads(!reads_at_leader);
    client
        .mkdir(&dir, true, 0o755)
        .await
        .with_context(|| format!("cannot create {dir}"))?;
    let ack = match &ack_log {
        Some(p) => Some(std::sync::Arc::new(std::sync::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("cannot open {}", p.display()))?,
        ))),
        None => None,
    };
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let limit = match stat_existing {
        Some(_) => 0,
        None => ops.unwrap_or(u64::MAX),
    };
    let start = std::time::Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (client, dir, next, ack) = (client.clone(), dir.clone(), next.clone(), ack.clone());
        tasks.push(tokio::spawn(async move {
            let (mut made, mut errors) = (Vec::new(), 0u64);
            let mut acked_at = Vec::new();
            loop {
                if std::time::Instant::now() >= deadline {
                    break;
                }
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= limit {
                    break;
                }
                let path = granary_common::paths::join(&dir, &format!("d{n}"));
                match client.mkdir(&path, false, 0o755).await {
                    Ok(_) => {
                        acked_at.push(std::time::Instant::now());
                        if let Some(f) = &ack {
                            if let Ok(mut f) = f.lock() {
                                let _ = writeln!(f, "{path}").and_then(|_| f.flush());
                            }
                        }
                        made.push(path);
                    }
                    Err(e) => {
                        errors += 1;
                        tracing::warn!(%path, error = %e, "create failed");
                    }
                }
            }
            (made, errors, acked_at)
        }));
    }
    let (mut made, mut errors, mut acked_at) = (Vec::new(), 0u64, Vec::new());
    for t in tasks {
        let (m, e, a) = t.await?;
        made.extend(m);
        errors += e;
        acked_at.extend(a);
    }
    let create_secs = start.elapsed().as_secs_f64();
    acked_at.sort();
    let mut last = start;
    let mut max_gap = std::time::Duration::ZERO;
    for t in &acked_at {
        max_gap = max_gap.max(t.duration_since(last));
        last = *t;
    }
    let created = made.len() as u64;
    // Stats, spread over the same number of callers: of what was made, or of DIR/d0 …
    // DIR/d{N-1} (each path made when its stat is sent: N may be large).
    let stat_start = std::time::Instant::now();
    let total = stat_existing.unwrap_or(created);
    let (made, dir) = (std::sync::Arc::new(made), std::sync::Arc::new(dir));
    let mut tasks = Vec::new();
    let workers = concurrency.max(1);
    for w in 0..workers {
        let (client, made, dir) = (client.clone(), made.clone(), dir.clone());
        tasks.push(tokio::spawn(async move {
            let mut ok = 0u64;
            for i in (w as u64..total).step_by(workers) {
                let p = match stat_existing {
                    Some(_) => granary_common::paths::join(&dir, &format!("d{i}")),
                    None => made[i as usize].clone(),
                };
                if client
                    .get_status(pb::path_or_id::Target::Path(p))
                    .await
                    .is_ok()
                {
                    ok += 1;
                }
            }
            ok
        }));
    }
    let mut stats = 0u64;
    for t in tasks {
        stats += t.await?;
    }
    let stat_secs = stat_start.elapsed().as_secs_f64();
    let per_s = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let v = json!({
        "creates": created,
        "create_errors": errors,
        "creates_per_s": per_s(created, create_secs),
        "stats": stats,
        "stats_per_s": per_s(stats, stat_secs),
        "max_create_gap_ms": max_gap.as_millis() as u64,
        "concurrency": workers,
    });
    if json {
        println!("{v}");
    } else {
        println!(
            "{} creates in {:.1}s ({:.0}/s, {} failed), {} stats ({:.0}/s), longest pause between creates {} ms",
            created,
            create_secs,
            per_s(created, create_secs),
            errors,
            stats,
            per_s(stats, stat_secs),
            max_gap.as_millis()
        );
    }
    Ok(())
}

/// `granary bench tls`: bytes through one loopback mutual-TLS stream (the rustls provider
/// and configuration of Granary's TLS streams, certificates of a throwaway CA), 1 MiB
/// writes and reads; timed from the end of the handshake.
async fn bench_tls(size: u64, json: bool) -> anyhow::Result<()> {
    use granary_common::tls::{issue, new_ca, LeafSpec, Role, TlsMaterial};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ca = new_ca("granary bench tls", 1)?;
    let leaf = |name: &str| -> anyhow::Result<TlsMaterial> {
        let pems = issue(&ca, &LeafSpec::new(name, &[Role::Node], 1))?;
        Ok(TlsMaterial::from_pems(ca.cert.clone(), pems)?)
    };
    let acceptor = leaf("bench-server")?.stream_acceptor();
    let connector = leaf("bench-client")?.stream_connector();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let sender = tokio::spawn(async move {
        let (s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let mut s = acceptor.accept(s).await?;
        let buf = vec![0x5au8; 1 << 20];
        let mut left = size;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            s.write_all(&buf[..n]).await?;
            left -= n as u64;
        }
        s.shutdown().await?;
        Ok::<_, std::io::Error>(())
    });
    let s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let mut conn = connector
        .connect(granary_common::tls::node_server_name()?, s)
        .await?;
    let start = std::time::Instant::now();
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    sender.await??;
    print_throughput(got, secs, json, " (mutual TLS)");
    Ok(())
}

/// Prints what a `granary bench tcp|tls` run moved, as JSON or a line.
fn print_throughput(got: u64, secs: f64, json: bool, what: &str) {
    let mbps = got as f64 / secs / 1e6;
    if json {
        println!(
            "{}",
            json!({"bytes": got, "seconds": secs, "mb_per_s": mbps})
        );
    } else {
        println!("{got} bytes in {secs:.2}s: {mbps:.0} MB/s{what}");
    }
}

/// `granary bench tcp`: bytes through one loopback TCP connection, 1 MiB writes and reads.
fn bench_tcp(size: u64, json: bool) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        let mut s = std::net::TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let buf = vec![0x5au8; 1 << 20];
        let mut left = size;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            s.write_all(&buf[..n])?;
            left -= n as u64;
        }
        Ok(())
    });
    let (mut conn, _) = listener.accept()?;
    let start = std::time::Instant::now();
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    loop {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    sender
        .join()
        .map_err(|_| anyhow::anyhow!("the sending thread panicked"))??;
    print_throughput(got, secs, json, "");
    Ok(())
}

/// How `granary bench read` reaches the bytes.
struct ReadPath {
    short_circuit: bool,
    data_plane: bool,
}

/// `granary bench read`: a file read through the client library, several passes.
async fn bench_read(
    net: &Net,
    path: &str,
    passes: u32,
    concurrency: usize,
    how: ReadPath,
    json: bool,
    addr: &MasterAddr,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    let fs = granary_client::FileSystem::new(master(net, addr)?);
    fs.set_short_circuit(how.short_circuit);
    fs.set_data_plane(how.data_plane);
    let st = fs
        .stat(path)
        .await
        .with_context(|| format!("cannot stat {path}"))?;
    let bs = if st.block_size == 0 {
        granary_common::DEFAULT_BLOCK_SIZE
    } else {
        st.block_size
    };
    let mut results = Vec::new();
    for pass in 1..=passes.max(1) {
        let start = std::time::Instant::now();
        let chunks = (0..st.length.div_ceil(bs)).map(|i| (i * bs, bs.min(st.length - i * bs)));
        let mut reads = futures::stream::iter(chunks)
            .map(|(off, len)| {
                let fs = fs.clone();
                let st = st.clone();
                async move { fs.read(&st, off, len).await.map(|b| b.len() as u64) }
            })
            .buffer_unordered(concurrency.max(1));
        let mut bytes = 0u64;
        while let Some(r) = reads.next().await {
            bytes += r.with_context(|| format!("reading {path}"))?;
        }
        let secs = start.elapsed().as_secs_f64();
        results.push(json!({"pass": pass, "bytes": bytes, "seconds": secs, "mb_per_s": bytes as f64 / secs / 1e6}));
    }
    if json {
        println!("{}", json!({"path": path, "passes": results}));
    } else {
        for r in &results {
            println!(
                "pass {}: {} bytes in {:.2}s: {:.0} MB/s",
                r["pass"],
                r["bytes"],
                r["seconds"].as_f64().unwrap_or(0.0),
                r["mb_per_s"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

/// `granary bench get`: one single-stream GET of an object through object_store.
async fn bench_get(uri: &str, options: &[String], each: bool, json: bool) -> anyhow::Result<()> {
    use futures::{StreamExt, TryStreamExt};
    use object_store::ObjectStoreExt;
    let opts = granary_common::ufs::parse_option_args(options)?;
    let spec = granary_common::ufs::UfsSpec::new(uri, opts)?;
    let ufs = spec.open()?;
    let keys = if each {
        let mut keys: Vec<object_store::path::Path> = ufs
            .store
            .list(Some(&ufs.prefix))
            .map_ok(|m| m.location)
            .try_collect()
            .await
            .with_context(|| format!("cannot list {uri}"))?;
        keys.sort();
        anyhow::ensure!(!keys.is_empty(), "no object below {uri}");
        keys
    } else {
        vec![ufs.prefix.clone()]
    };
    let start = std::time::Instant::now();
    let mut bytes = 0u64;
    for key in &keys {
        let mut stream = ufs
            .store
            .get(key)
            .await
            .with_context(|| format!("cannot GET {key}"))?
            .into_stream();
        while let Some(chunk) = stream.next().await {
            bytes += chunk.with_context(|| format!("reading {key}"))?.len() as u64;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let mbps = bytes as f64 / secs / 1e6;
    let per_s = keys.len() as f64 / secs;
    if json {
        println!(
            "{}",
            json!({"objects": keys.len(), "bytes": bytes, "seconds": secs, "mb_per_s": mbps, "objects_per_s": per_s})
        );
    } else if each {
        println!(
            "{} objects, {bytes} bytes in {secs:.2}s: {per_s:.0} objects/s, {mbps:.0} MB/s",
            keys.len()
        );
    } else {
        println!("{bytes} bytes in {secs:.2}s: {mbps:.0} MB/s");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::mount_options;

    #[test]
    fn mount_options_come_from_flags_files_and_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret");
        std::fs::write(&file, "s3cr3t\n").unwrap();
        std::env::set_var("GRANARY_TEST_MOUNT_OPTION", "tok");
        let o = |a: &[&str], f: &[String], e: &[&str]| {
            let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
            mount_options(&s(a), f, &s(e))
        };
        let opts = o(
            &["region=eu"],
            &[format!("secret_access_key={}", file.display())],
            &["session_token=GRANARY_TEST_MOUNT_OPTION"],
        )
        .unwrap();
        assert_eq!(opts["region"], "eu");
        assert_eq!(opts["secret_access_key"], "s3cr3t");
        assert_eq!(opts["session_token"], "tok");
        let err = |r: anyhow::Result<_>| format!("{:#}", r.unwrap_err());
        let twice = o(
            &["secret_access_key=x"],
            &[format!("secret_access_key={}", file.display())],
            &[],
        );
        assert!(err(twice).contains("given twice"));
        assert!(err(o(&[], &["k=/no/such/file".into()], &[])).contains("cannot read option k"));
        assert!(err(o(&[], &[], &["k=GRANARY_TEST_NO_SUCH_VAR"])).contains("is not set"));
        assert!(err(o(&[], &["novalue".into()], &[])).contains("expects KEY=VALUE"));
    }
}
