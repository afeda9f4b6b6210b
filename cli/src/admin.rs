//! Admin commands: mounts, namespace browsing, cluster report.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use granary_client::{FileSystem, MasterClient};
use granary_common::size::format_size;
use granary_proto as pb;
use serde_json::json;

use crate::args::{FsCommand, MasterAddr, MountCommand, ReportArgs};

/// Admin commands fail fast when the master is down.
const ADMIN_RETRY: Duration = Duration::from_secs(3);

fn master(addr: &MasterAddr) -> anyhow::Result<MasterClient> {
    Ok(MasterClient::new(&addr.master)?.with_retry_window(ADMIN_RETRY))
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
        "ufs": s.ufs.as_ref().map(|u| json!({"mount_id": u.mount_id, "path": u.path})),
        "fingerprint": s.fingerprint.as_ref().map(|f| json!({
            "etag": f.etag, "size": f.size, "mtime_ms": f.mtime_ms, "version_id": f.version_id,
        })),
        "version": format!("{:016x}", s.version),
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

pub async fn mount(cmd: MountCommand) -> anyhow::Result<()> {
    match cmd {
        MountCommand::Add {
            path,
            uri,
            options,
            master: addr,
        } => {
            let opts = granary_common::ufs::parse_option_args(&options)?;
            let m = master(&addr)?
                .add_mount(
                    &path,
                    &uri,
                    opts.into_iter()
                        .map(|(key, value)| pb::MountOptionEntry { key, value })
                        .collect(),
                )
                .await
                .with_context(|| format!("cannot mount {uri} at {path}"))?;
            println!("mounted {} at {}", m.uri, m.path);
        }
        MountCommand::List { json, master: addr } => {
            let mounts = master(&addr)?.list_mounts().await?;
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
        MountCommand::Remove { path, master: addr } => {
            master(&addr)?
                .remove_mount(&path)
                .await
                .with_context(|| format!("cannot remove the mount at {path}"))?;
            println!("removed the mount at {path}");
        }
    }
    Ok(())
}

pub async fn fs(cmd: FsCommand) -> anyhow::Result<()> {
    match cmd {
        FsCommand::Ls {
            path,
            long,
            json,
            master: addr,
        } => {
            let client = FileSystem::new(master(&addr)?);
            let entries = client
                .list(pb::path_or_id::Target::Path(path.clone()))
                .await
                .with_context(|| format!("cannot list {path}"))?;
            let mut out = std::io::stdout().lock();
            if json {
                let v: Vec<_> = entries.iter().map(status_json).collect();
                writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
            } else {
                for e in &entries {
                    if long {
                        writeln!(
                            out,
                            "{}\t{:>12}\t{}\t{}",
                            kind_name(e),
                            e.length,
                            mtime(e.mtime_ms),
                            e.name
                        )?;
                    } else {
                        writeln!(out, "{}", e.name)?;
                    }
                }
            }
        }
        FsCommand::Stat {
            path,
            json,
            master: addr,
        } => {
            let client = FileSystem::new(master(&addr)?);
            let s = client
                .stat(&path)
                .await
                .with_context(|| format!("cannot stat {path}"))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status_json(&s))?);
            } else {
                println!("path:        {}", s.path);
                println!("kind:        {}", kind_name(&s));
                println!("inode:       {}", s.inode);
                println!("size:        {} ({})", s.length, format_size(s.length));
                println!("block size:  {}", format_size(s.block_size));
                println!("mode:        {:o}", s.mode);
                println!("modified:    {}", mtime(s.mtime_ms));
                if let Some(u) = &s.ufs {
                    println!(
                        "under-store: mount {} path {}",
                        u.mount_id,
                        if u.path.is_empty() { "/" } else { &u.path }
                    );
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
        }
        FsCommand::Cat { path, master: addr } => {
            let client = FileSystem::new(master(&addr)?);
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
        }
    }
    Ok(())
}

pub async fn report(a: ReportArgs) -> anyhow::Result<()> {
    let info = master(&a.master)?.cluster_info().await?;
    let stats: Vec<pb::WorkerStats> = info
        .workers
        .iter()
        .filter(|w| w.state == "live")
        .map(|w| w.stats.clone().unwrap_or_default())
        .collect();
    let cap: u64 = stats.iter().map(|s| s.capacity_bytes).sum();
    let used: u64 = stats.iter().map(|s| s.used_bytes).sum();
    let hit: u64 = stats.iter().map(|s| s.cache_hit_bytes).sum();
    let miss: u64 = stats.iter().map(|s| s.cache_miss_bytes).sum();
    let ufs: u64 = stats.iter().map(|s| s.ufs_read_bytes).sum();
    let ratio = if hit + miss > 0 {
        hit as f64 / (hit + miss) as f64
    } else {
        0.0
    };
    if a.json {
        let v = json!({
            "leader_id": info.leader_id,
            "inodes": info.inode_count,
            "mounts": info.mount_count,
            "masters": info.masters.iter().map(|m| json!({
                "id": m.id, "address": m.address, "role": m.role, "term": m.term,
                "commit_index": m.commit_index, "applied_index": m.applied_index,
            })).collect::<Vec<_>>(),
            "workers": info.workers.iter().map(|w| {
                let s = w.stats.clone().unwrap_or_default();
                json!({
                    "id": w.worker_id, "address": w.address, "host": w.host, "state": w.state,
                    "last_heartbeat_ms_ago": w.last_heartbeat_ms_ago, "blocks": w.block_count,
                    "capacity_bytes": s.capacity_bytes, "used_bytes": s.used_bytes,
                    "cache_hit_bytes": s.cache_hit_bytes, "cache_miss_bytes": s.cache_miss_bytes,
                    "ufs_read_bytes": s.ufs_read_bytes, "ufs_requests": s.ufs_requests,
                    "evicted_bytes": s.evicted_bytes,
                })
            }).collect::<Vec<_>>(),
            "capacity_bytes": cap,
            "used_bytes": used,
            "cache_hit_bytes": hit,
            "cache_miss_bytes": miss,
            "ufs_read_bytes": ufs,
            "hit_ratio": ratio,
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
    }
    println!(
        "Capacity: {} used of {}",
        format_size(used),
        format_size(cap)
    );
    println!(
        "Reads: {} from cache, {} missed, hit ratio {:.1}%; {} read from under-stores",
        format_size(hit),
        format_size(miss),
        ratio * 100.0,
        format_size(ufs)
    );
    Ok(())
}
