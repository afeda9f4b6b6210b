//! Runs jobs on the leader. A load job enumerates the files below its path, hands their
//! blocks to the workers that own them (the same placement clients use, so a later read
//! finds each block where it looks first) in batched tasks — many small files per task, a
//! task per block for big files — a few tasks in flight per worker, retries failed blocks
//! with backoff (placing them again: a worker that died meanwhile is replaced) and records
//! its progress through Raft every half second. What is recorded is what the next leader
//! resumes from (see [`crate::state::jobs`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use granary_proto as pb;
use granary_proto::worker_service_client::WorkerServiceClient;

use crate::core::MasterCore;
use crate::error::MasterError;
use crate::state::jobs::{FailedFile, Job, JobState};
use crate::state::{ApplyOutput, Command, Inode};

mod files;
mod planner;
#[cfg(test)]
mod proptests;

use files::Files;

pub(crate) use planner::plan_blocks;
use planner::{Limits, Planner};

/// Deadline of one task.
const TASK_TIMEOUT: Duration = Duration::from_secs(600);
/// How often progress is recorded (and cancellation noticed).
const REPORT_EVERY: Duration = Duration::from_millis(500);

/// Jobs this master is running (leader only).
#[derive(Default)]
pub struct JobRunner {
    running: Mutex<HashSet<u64>>,
    /// Block loads tried again after a failure that may pass (an unreachable store or
    /// worker, a full cache); a gone, changed or refused object is not tried again.
    pub retries: prometheus_client::metrics::counter::Counter,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl MasterCore {
    /// Starts a job (replicated), run by the leader from the next tick on.
    pub async fn start_job(
        self: &Arc<Self>,
        kind: pb::JobKind,
        path: &str,
        replicas: u32,
        request_id: u64,
    ) -> Result<Job, MasterError> {
        if kind != pb::JobKind::Load {
            return Err(MasterError::invalid(
                "unknown job kind (known: load)".to_string(),
            ));
        }
        if !(1..=8).contains(&replicas) {
            return Err(MasterError::invalid(format!(
                "replicas must be 1 to 8, not {replicas}"
            )));
        }
        self.ensure_leader()?;
        let path = granary_common::paths::normalize(path)?;
        // Refuse a path that does not exist now, rather than a job that fails at once.
        self.namespace().resolve(&path).await?;
        let cmd = Command::CreateJob {
            kind: kind.text().to_string(),
            path,
            replicas,
            now_ms: granary_common::now_ms(),
        };
        let job = match self.propose_request(cmd, request_id).await? {
            ApplyOutput::Job(j) => j,
            _ => return Err(MasterError::corrupt("unexpected result of CreateJob")),
        };
        tracing::info!(id = job.id, path = %job.path, replicas, "load job started");
        self.run_jobs();
        Ok(job)
    }

    /// Cancels a job that has not finished (a finished one is returned as it is).
    pub async fn cancel_job(&self, id: u64) -> Result<Job, MasterError> {
        self.ensure_leader()?;
        self.read_barrier().await?;
        if self.namespace().sm.job(id)?.is_none() {
            return Err(MasterError::NoSuchJob { id });
        }
        let cmd = Command::FinishJob {
            id,
            state: JobState::Cancelled,
            error: String::new(),
            now_ms: granary_common::now_ms(),
        };
        match self.propose(cmd).await? {
            ApplyOutput::Job(j) => Ok(j),
            _ => Err(MasterError::corrupt("unexpected result of FinishJob")),
        }
    }

    /// A job as the CLI shows it, with up to `max_failed` failed files.
    pub fn job_info(&self, id: u64, max_failed: usize) -> Result<pb::JobInfo, MasterError> {
        let job = self
            .namespace()
            .sm
            .job(id)?
            .ok_or(MasterError::NoSuchJob { id })?;
        let failed = self.namespace().sm.job_failed(id, max_failed)?;
        Ok(to_info(&job, failed))
    }

    /// Every kept job (no failed lists).
    pub fn job_list(&self) -> Result<Vec<pb::JobInfo>, MasterError> {
        Ok(self
            .namespace()
            .sm
            .jobs()?
            .iter()
            .map(|j| to_info(j, Vec::new()))
            .collect())
    }

    /// Starts a runner for every unfinished job that has none (leader only; called every
    /// tick, so a new leader picks up the jobs of the last one).
    pub fn run_jobs(self: &Arc<Self>) {
        if !self.is_leader() {
            return;
        }
        let Ok(jobs) = self.namespace().sm.jobs() else {
            return;
        };
        for job in jobs.into_iter().filter(|j| !j.state.finished()) {
            if !lock(&self.job_runner().running).insert(job.id) {
                continue;
            }
            let core = self.clone();
            tokio::spawn(async move {
                let id = job.id;
                if let Err(e) = run(&core, job).await {
                    tracing::warn!(job = id, error = %e, "job runner stopped; resumed on a later tick");
                    // Not leader, shutting down, or a failure worth another try later.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                lock(&core.job_runner().running).remove(&id);
            });
        }
    }
}

fn to_info(job: &Job, failed: Vec<FailedFile>) -> pb::JobInfo {
    pb::JobInfo {
        id: job.id,
        kind: job.kind.clone(),
        kind_code: pb::JobKind::requested(0, &job.kind).unwrap_or_default() as i32,
        path: job.path.clone(),
        replicas: job.replicas,
        state: job.state.as_str().to_string(),
        state_code: job.state.code() as i32,
        created_ms: job.created_ms.max(0) as u64,
        finished_ms: job.finished_ms.max(0) as u64,
        total_files: job.total_files,
        total_bytes: job.total_bytes,
        done_files: job.done_files,
        done_bytes: job.done_bytes,
        failed_files: job.failed_files,
        failed: failed
            .into_iter()
            .map(|f| pb::FailedFile {
                path: f.path,
                reason: f.reason,
            })
            .collect(),
        fetched_bytes: job.fetched_bytes,
        error: job.error.clone(),
    }
}

async fn propose_job(core: &MasterCore, cmd: Command) -> Result<Job, MasterError> {
    match core.propose(cmd).await? {
        ApplyOutput::Job(j) => Ok(j),
        _ => Err(MasterError::corrupt("unexpected result of a job command")),
    }
}

/// The live workers, as clients see them (same order and weights).
fn live_workers(core: &MasterCore) -> Vec<pb::WorkerInfo> {
    let decommissioned = core.namespace().sm.decommissioned().unwrap_or_default();
    core.fleet().placement_targets(&decommissioned)
}

async fn run(core: &Arc<MasterCore>, job: Job) -> Result<(), MasterError> {
    let Some((job, root, root_path)) = plan(core, job).await? else {
        return Ok(());
    };
    let feed = Feed::start(core.clone(), job.id, root, root_path);
    let planner = Planner::new(
        job.replicas,
        granary_common::DEFAULT_BLOCK_SIZE,
        Limits::DEFAULT,
    );
    let Some((mut job, seen)) = drive(core, job, planner, feed).await? else {
        return Ok(()); // cancelled
    };
    // Files made or removed between the count and the load: the totals say what was loaded.
    if (job.total_files, job.total_bytes) != seen {
        let cmd = Command::JobPlanned {
            id: job.id,
            total_files: seen.0,
            total_bytes: seen.1,
        };
        job = propose_job(core, cmd).await?;
    }
    let state = if job.failed_files == 0 {
        JobState::Succeeded
    } else {
        JobState::Failed
    };
    let cmd = Command::FinishJob {
        id: job.id,
        state,
        error: String::new(),
        now_ms: granary_common::now_ms(),
    };
    let job = propose_job(core, cmd).await?;
    tracing::info!(
        job = job.id,
        state = job.state.as_str(),
        files = job.done_files,
        failed = job.failed_files,
        fetched_bytes = job.fetched_bytes,
        "load job finished"
    );
    Ok(())
}

/// Counts the job's files and records how many there are; the job with its root and the
/// root's path, or None when the job failed at once (its path is gone).
async fn plan(
    core: &Arc<MasterCore>,
    job: Job,
) -> Result<Option<(Job, Inode, String)>, MasterError> {
    let id = job.id;
    core.ensure_leader()?;
    core.read_barrier().await?;
    // A job resumed by a new leader: that leader knows no workers until they re-register,
    // and placing blocks on the few known so far would cache them away from their owners
    // (and fetch them again, as the last leader's tasks may already have).
    if job.state != JobState::Planning {
        while !core.fleet().settled() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let root = match core.namespace().resolve(&job.path).await {
        Ok(r) => r,
        Err(e @ MasterError::NotFound { .. }) => {
            let cmd = Command::FinishJob {
                id,
                state: JobState::Failed,
                error: e.to_string(),
                now_ms: granary_common::now_ms(),
            };
            propose_job(core, cmd).await?;
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let root_path = core.namespace().sm.path_of(&root)?;
    // A first walk counts (and lists what was never listed), holding no file: the
    // progress has its totals before the first block is loaded.
    let mut walk = Files::new(root.clone(), root_path.clone());
    while walk.next_page(core).await?.is_some() {}
    let (total_files, total_bytes) = walk.seen();
    let job = if job.state == JobState::Planning
        || job.total_files != total_files
        || job.total_bytes != total_bytes
    {
        let cmd = Command::JobPlanned {
            id,
            total_files,
            total_bytes,
        };
        propose_job(core, cmd).await?
    } else {
        job
    };
    tracing::info!(
        job = id,
        files = total_files,
        bytes = total_bytes,
        "load job planned"
    );
    Ok(Some((job, root, root_path)))
}

/// What the walk feeding a runner sends.
enum Fed {
    /// Files to load (those an earlier runner of the job settled are left out).
    Files(Vec<(Inode, String)>),
    /// The walk is over: the files and bytes it saw, settled ones included.
    End((u64, u64)),
}

/// The walk of a job's files, run beside the runner a few pages ahead of it (so a slow
/// store listing does not hold up the answers of tasks in flight); ended when dropped.
struct Feed {
    pages: tokio::sync::mpsc::Receiver<Result<Fed, MasterError>>,
    walk: tokio::task::JoinHandle<()>,
}

impl Feed {
    fn start(core: Arc<MasterCore>, id: u64, root: Inode, root_path: String) -> Feed {
        let (tx, pages) = tokio::sync::mpsc::channel(2);
        let walk = tokio::spawn(async move {
            let mut files = Files::new(root, root_path);
            let fed = loop {
                let page = match files.next_page(&core).await {
                    Ok(Some(page)) => page,
                    Ok(None) => break Ok(Fed::End(files.seen())),
                    Err(e) => break Err(e),
                };
                let mut todo = Vec::with_capacity(page.len());
                for (f, path) in page {
                    match core.namespace().sm.job_settled(id, f.id) {
                        Ok(true) => {}
                        Ok(false) => todo.push((f, path)),
                        Err(e) => {
                            let _ = tx.send(Err(e)).await;
                            return;
                        }
                    }
                }
                if tx.send(Ok(Fed::Files(todo))).await.is_err() {
                    return; // the runner stopped
                }
            };
            let _ = tx.send(fed).await;
        });
        Feed { pages, walk }
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.walk.abort();
    }
}

/// Gives the planner what the walk sent; the walk's totals once it is over.
fn take(
    planner: &mut Planner,
    fed: Option<Result<Fed, MasterError>>,
    seen: &mut Option<(u64, u64)>,
) -> Result<(), MasterError> {
    match fed {
        Some(Ok(Fed::Files(files))) => planner.add(files),
        Some(Ok(Fed::End(totals))) => {
            planner.all_added();
            *seen = Some(totals);
        }
        Some(Err(e)) => return Err(e),
        None => {
            return Err(MasterError::Unavailable {
                message: "the walk of the job's files stopped".into(),
            })
        }
    }
    Ok(())
}

/// Carries out the planner's decisions until every file is settled, recording progress
/// as it goes; the job as recorded at the end with the files and bytes the walk saw, None
/// when it was cancelled meanwhile.
async fn drive(
    core: &Arc<MasterCore>,
    mut job: Job,
    mut planner: Planner,
    mut feed: Feed,
) -> Result<Option<(Job, (u64, u64))>, MasterError> {
    let id = job.id;
    let mut in_flight = FuturesUnordered::new();
    let mut last_report = Instant::now();
    let mut workers_at: Option<Instant> = None;
    let mut seen = None;
    loop {
        if workers_at.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
            planner.set_workers(live_workers(core));
            workers_at = Some(Instant::now());
        }
        while planner.wants_files() {
            match feed.pages.try_recv() {
                Ok(fed) => take(&mut planner, Some(fed), &mut seen)?,
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                    take(&mut planner, None, &mut seen)?
                }
            }
        }
        for mut task in planner.tasks(Instant::now(), |b| core.fleet().holders_of(b)) {
            let files = task
                .request
                .blocks
                .iter()
                .filter_map(|d| d.id.map(|b| b.inode));
            task.request.pinned_inodes = core.pinned_among(files);
            let address = task.worker.address;
            let net = core.net().clone();
            in_flight.push(async move { (task.id, load_on(&net, &address, task.request).await) });
        }
        if planner.settled() {
            break;
        }
        tokio::select! {
            Some((task, res)) = in_flight.next(), if !in_flight.is_empty() => {
                let wid = planner.worker_of(task);
                let answered = planner.answer(task, res, Instant::now());
                core.job_runner().retries.inc_by(answered.retries);
                // The worker holds the blocks now: `fs stat` says so at once, not from its
                // next heartbeat on (which reports them too, or their eviction).
                if let Some(wid) = wid {
                    core.fleet().record_loaded(wid, &answered.loaded);
                }
            }
            fed = feed.pages.recv(), if planner.wants_files() => take(&mut planner, fed, &mut seen)?,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        if last_report.elapsed() >= REPORT_EVERY || planner.unreported() >= 4096 {
            job = flush(core, &mut planner, id).await?.unwrap_or(job);
            last_report = Instant::now();
            if job.state.finished() {
                tracing::info!(job = id, state = job.state.as_str(), "job stopped");
                return Ok(None);
            }
            if !core.is_leader() {
                return Err(core.raft().not_leader());
            }
        }
    }
    job = flush(core, &mut planner, id).await?.unwrap_or(job);
    let seen = seen.unwrap_or((job.total_files, job.total_bytes));
    Ok((!job.state.finished()).then_some((job, seen)))
}

/// Records the planner's progress, if there is any; returns the job as it now stands
/// (from the local state when nothing was recorded: a cancellation is seen either way).
async fn flush(
    core: &MasterCore,
    planner: &mut Planner,
    id: u64,
) -> Result<Option<Job>, MasterError> {
    let report = planner.take_report();
    if report.is_empty() {
        return core.namespace().sm.job(id);
    }
    let cmd = Command::JobProgress {
        id,
        done: report.done,
        failed: report.failed,
        fetched_bytes: report.fetched_bytes,
    };
    propose_job(core, cmd).await.map(Some)
}

/// Sends one task to a worker.
async fn load_on(
    net: &granary_common::net::Net,
    address: &str,
    task: pb::LoadBlocksRequest,
) -> Result<pb::LoadBlocksResponse, String> {
    let ch = net
        .channel(address, granary_common::net::ServerKind::Node)
        .map_err(|e| format!("bad worker address {address}: {e}"))?;
    let mut client = WorkerServiceClient::new(ch)
        .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(pb::MAX_MESSAGE_BYTES);
    let mut req = tonic::Request::new(task);
    req.set_timeout(TASK_TIMEOUT);
    match tokio::time::timeout(TASK_TIMEOUT, client.load_blocks(req)).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(format!("worker {address}: {}", s.message())),
        Err(_) => Err(format!("worker {address} did not finish the task in time")),
    }
}

#[cfg(test)]
mod tests {
    use super::planner::{load_error, plan_blocks, worth_retrying};
    use super::*;
    use crate::state::Kind;

    #[test]
    fn only_failures_that_may_pass_are_retried_and_unknown_codes_count_as_such() {
        assert!(worth_retrying(load_error(
            pb::LoadError::Unavailable as i32
        )));
        assert!(worth_retrying(load_error(0)));
        for permanent in [
            pb::LoadError::NotFound,
            pb::LoadError::Changed,
            pb::LoadError::Denied,
            pb::LoadError::Invalid,
        ] {
            assert!(
                !worth_retrying(load_error(permanent as i32)),
                "{permanent:?}"
            );
        }
        // A code no version defines (a newer or hostile worker): tried again, boundedly.
        for hostile in [i32::MAX, i32::MIN, -1, 99] {
            assert_eq!(load_error(hostile), pb::LoadError::Unspecified);
        }
    }

    fn file(length: u64, block_size: u64) -> Inode {
        let mut f = Inode::directory(9, 1, "f", 0o644, 0);
        f.kind = Kind::File;
        f.length = length;
        f.block_size = block_size;
        f
    }

    #[test]
    fn a_load_plans_real_files_and_refuses_impossible_lengths() {
        assert_eq!(plan_blocks(&file(0, 0), 64 << 20), Ok((64 << 20, 0)));
        assert_eq!(plan_blocks(&file(1, 0), 64 << 20), Ok((64 << 20, 1)));
        assert_eq!(
            plan_blocks(&file((64 << 20) + 1, 64 << 20), 1),
            Ok((64 << 20, 2))
        );
        // The largest file a load takes: 64 TiB in 1 MiB blocks, 2^26 blocks.
        assert_eq!(
            plan_blocks(&file(granary_common::MAX_FILE_LENGTH, 1 << 20), 1),
            Ok((1 << 20, 1 << 26))
        );
        // A file claiming 2^58 bytes (its block count would wrap a u32 to 0 at 64 MiB).
        let err = plan_blocks(&file(1 << 58, 64 << 20), 1).unwrap_err();
        assert!(err.contains("288230376151711744 bytes"), "{err}");
        // A block size of 1 byte would plan more blocks than an index can name.
        let err = plan_blocks(&file(1 << 40, 1), 1).unwrap_err();
        assert!(err.contains("more blocks"), "{err}");
        assert!(plan_blocks(&file(10, 0), 0).is_err());
    }
}
