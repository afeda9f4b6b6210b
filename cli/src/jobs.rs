//! `granary load` and `granary job`: start a job, follow its progress (a live bar on a
//! terminal, plain lines otherwise), list, show and cancel jobs.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use granary_client::MasterClient;
use granary_common::net::Net;
use granary_common::paths::printable;
use granary_common::size::format_size;
use granary_proto as pb;

use crate::args::{JobCommand, LoadArgs, MasterAddr, TtlActionArg, TtlCommand};

/// How often a followed job is polled.
const POLL: Duration = Duration::from_millis(500);
/// How often plain (non-terminal) progress lines are printed.
const PLAIN_EVERY: Duration = Duration::from_secs(2);

fn master(net: &Net, addr: &MasterAddr) -> anyhow::Result<MasterClient> {
    Ok(MasterClient::new(net.clone(), &addr.master)?)
}

fn finished(j: &pb::JobInfo) -> bool {
    j.job_state().finished()
}

fn percent(done: u64, total: u64) -> f64 {
    if total == 0 {
        100.0
    } else {
        done as f64 * 100.0 / total as f64
    }
}

/// The job as `--json` prints it (the schema is in docs/cli.md).
pub fn job_json(j: &pb::JobInfo) -> serde_json::Value {
    serde_json::json!({
        "id": j.id,
        "kind": j.kind,
        "path": j.path,
        "replicas": j.replicas,
        "state": j.state,
        "created_ms": j.created_ms,
        "finished_ms": if j.finished_ms == 0 { serde_json::Value::Null } else { j.finished_ms.into() },
        "total_files": j.total_files,
        "total_bytes": j.total_bytes,
        "done_files": j.done_files,
        "done_bytes": j.done_bytes,
        "failed_files": j.failed_files,
        "cached_percent": (percent(j.done_bytes, j.total_bytes) * 100.0).round() / 100.0,
        "fetched_bytes": j.fetched_bytes,
        "error": if j.error.is_empty() { serde_json::Value::Null } else { j.error.clone().into() },
        "failed": j.failed.iter().map(|f| serde_json::json!({"path": f.path, "reason": f.reason})).collect::<Vec<_>>(),
    })
}

fn print_job(j: &pb::JobInfo) {
    println!(
        "job {}  {}  {}  {}",
        j.id,
        j.kind,
        printable(&j.path),
        j.state
    );
    if j.job_state() == pb::JobState::Planning {
        println!("listing the files to load…");
    } else {
        println!(
            "files  {} / {} cached ({:.1}%), {} failed",
            j.done_files,
            j.total_files,
            percent(j.done_files, j.total_files),
            j.failed_files
        );
        println!(
            "bytes  {} / {} ({:.1}%; exact: {} / {})",
            format_size(j.done_bytes),
            format_size(j.total_bytes),
            percent(j.done_bytes, j.total_bytes),
            j.done_bytes,
            j.total_bytes
        );
    }
    println!(
        "fetched (not cached before)  {} ({} bytes)",
        format_size(j.fetched_bytes),
        j.fetched_bytes
    );
    println!("replicas  {}", j.replicas);
    if !j.error.is_empty() {
        println!("error  {}", printable(&j.error));
    }
    for f in &j.failed {
        println!("failed  {}  {}", printable(&f.path), printable(&f.reason));
    }
    if (j.failed.len() as u64) < j.failed_files {
        println!(
            "… and {} more failed files (--json lists up to 1,000)",
            j.failed_files - j.failed.len() as u64
        );
    }
}

/// The outcome of a followed job as the exit status: ok only when it succeeded.
fn outcome(j: &pb::JobInfo) -> anyhow::Result<()> {
    match j.job_state() {
        pb::JobState::Succeeded => Ok(()),
        pb::JobState::Cancelled => anyhow::bail!("job {} was cancelled", j.id),
        _ if !j.error.is_empty() => anyhow::bail!("job {} failed: {}", j.id, j.error),
        _ => anyhow::bail!(
            "job {} finished with {} files not cached (granary job status {} lists them)",
            j.id,
            j.failed_files,
            j.id
        ),
    }
}

/// Follows a job until it finishes (progress bar on a terminal, plain lines otherwise).
/// Ctrl-C detaches: the job keeps running.
async fn follow(m: &MasterClient, id: u64, json: bool) -> anyhow::Result<pb::JobInfo> {
    let tty = std::io::stderr().is_terminal() && !json;
    let bar = tty.then(|| {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.enable_steady_tick(Duration::from_millis(200));
        b
    });
    let mut last_line = Instant::now() - PLAIN_EVERY;
    let started = Instant::now();
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let j = m.get_job(id, 0).await?;
        if let Some(b) = &bar {
            b.set_length(j.total_bytes);
            b.set_position(j.done_bytes);
            b.set_message(format!(
                "files {}/{} failed {}",
                j.done_files, j.total_files, j.failed_files
            ));
        } else if !json && (last_line.elapsed() >= PLAIN_EVERY || finished(&j)) {
            let secs = started.elapsed().as_secs_f64().max(0.001);
            eprintln!(
                "job {}: {} {:.1}% cached, files {}/{}, {} / {}, {}/s, {} failed",
                j.id,
                j.state,
                percent(j.done_bytes, j.total_bytes),
                j.done_files,
                j.total_files,
                format_size(j.done_bytes),
                format_size(j.total_bytes),
                format_size((j.done_bytes as f64 / secs) as u64),
                j.failed_files
            );
            last_line = Instant::now();
        }
        if finished(&j) {
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
            return Ok(j);
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = &mut ctrl_c => {
                if let Some(b) = &bar {
                    b.abandon();
                }
                eprintln!("detached from job {id}; it keeps running (granary job status {id} --watch follows it, granary job cancel {id} stops it)");
                std::process::exit(130);
            }
        }
    }
}

pub async fn load(net: &Net, a: LoadArgs) -> anyhow::Result<()> {
    let m = master(net, &a.master)?;
    let j = m.start_job(pb::JobKind::Load, &a.path, a.replicas).await?;
    started(&m, a, j).await
}

pub async fn pin(net: &Net, a: LoadArgs) -> anyhow::Result<()> {
    let m = master(net, &a.master)?;
    let j = m.set_pin(&a.path, a.replicas).await?;
    if !a.json {
        eprintln!("{} pinned on {} workers", a.path, a.replicas);
    }
    started(&m, a, j).await
}

pub async fn free(
    net: &Net,
    path: &str,
    recursive: bool,
    force: bool,
    json: bool,
    addr: &MasterAddr,
) -> anyhow::Result<()> {
    let r = master(net, addr)?.free(path, recursive, force).await?;
    if json {
        let v = serde_json::json!({
            "path": path,
            "files": r.files,
            "cached_files": r.cached_files,
            "workers": r.workers,
            "unpersisted_files": r.unpersisted_files,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "freeing {path}: {} files, {} of them cached on {} workers (dropped at their next heartbeat)",
            r.files, r.cached_files, r.workers
        );
        if r.unpersisted_files > 0 {
            println!(
                "{} files were not in the under-store: their data is gone",
                r.unpersisted_files
            );
        }
    }
    Ok(())
}

pub async fn ttl(net: &Net, cmd: TtlCommand) -> anyhow::Result<()> {
    match cmd {
        TtlCommand::Set {
            path,
            ttl,
            action,
            master: addr,
        } => {
            if ttl.is_zero() {
                anyhow::bail!("a TTL must be longer than 0s (granary ttl unset removes one)");
            }
            let action = match action {
                TtlActionArg::Free => pb::TtlAction::Free,
                TtlActionArg::Delete => pb::TtlAction::Delete,
            };
            let due = master(net, &addr)?
                .set_ttl(&path, ttl.as_millis().max(1) as u64, action)
                .await?;
            println!(
                "{path}: {} in {} (at {} ms since the epoch)",
                action.text(),
                humantime::format_duration(ttl),
                due
            );
        }
        TtlCommand::Unset { path, master: addr } => {
            master(net, &addr)?
                .set_ttl(&path, 0, pb::TtlAction::Free)
                .await?;
            println!("{path}: no TTL");
        }
    }
    Ok(())
}

pub async fn unpin(net: &Net, path: &str, addr: &MasterAddr) -> anyhow::Result<()> {
    master(net, addr)?.set_pin(path, 0).await?;
    println!("{path} unpinned");
    Ok(())
}

/// Prints or follows a load job just started (`load`, `pin`).
async fn started(m: &MasterClient, a: LoadArgs, j: pb::JobInfo) -> anyhow::Result<()> {
    if a.detach {
        if a.json {
            println!("{}", serde_json::to_string_pretty(&job_json(&j))?);
        } else {
            println!("job {} started: granary job status {} --watch", j.id, j.id);
        }
        return Ok(());
    }
    if !a.json {
        eprintln!(
            "job {} loads {} (Ctrl-C detaches; the job keeps running)",
            j.id, j.path
        );
    }
    follow(m, j.id, a.json).await?;
    let j = m.get_job(j.id, 1000).await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&job_json(&j))?);
    } else {
        print_job(&j);
    }
    outcome(&j)
}

pub async fn job(net: &Net, cmd: JobCommand) -> anyhow::Result<()> {
    match cmd {
        JobCommand::List { json, master: addr } => {
            let jobs = master(net, &addr)?.list_jobs().await?;
            if json {
                let v: Vec<_> = jobs.iter().map(job_json).collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            println!(
                "{:>5}  {:<5}  {:<10}  {:>7}  {:>15}  {:>7}  PATH",
                "ID", "KIND", "STATE", "CACHED", "FILES", "FAILED"
            );
            for j in jobs {
                println!(
                    "{:>5}  {:<5}  {:<10}  {:>6.1}%  {:>15}  {:>7}  {}",
                    j.id,
                    j.kind,
                    j.state,
                    percent(j.done_bytes, j.total_bytes),
                    format!("{}/{}", j.done_files, j.total_files),
                    j.failed_files,
                    j.path
                );
            }
            Ok(())
        }
        JobCommand::Status {
            id,
            json,
            watch,
            master: addr,
        } => {
            let m = master(net, &addr)?;
            if watch {
                follow(&m, id, json).await?;
            }
            let j = m.get_job(id, 1000).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&job_json(&j))?);
            } else {
                print_job(&j);
            }
            if watch {
                outcome(&j)
            } else {
                Ok(())
            }
        }
        JobCommand::Cancel {
            id,
            json,
            master: addr,
        } => {
            let j = master(net, &addr)?.cancel_job(id).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&job_json(&j))?);
            } else {
                println!("job {} {}", j.id, j.state);
            }
            Ok(())
        }
    }
}
