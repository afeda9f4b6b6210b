//! Runs jobs on the leader. A load job enumerates the files below its path, hands their
//! blocks to the workers that own them (the same placement clients use, so a later read
//! finds each block where it looks first) in batched tasks — many small files per task, a
//! task per block for big files — a few tasks in flight per worker, retries failed blocks
//! with backoff (placing them again: a worker that died meanwhile is replaced) and records
//! its progress through Raft every half second. What is recorded is what the next leader
//! resumes from (see [`crate::state::jobs`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use granary_proto as pb;
use granary_proto::worker_service_client::WorkerServiceClient;

use crate::core::MasterCore;
use crate::error::MasterError;
use crate::state::jobs::{DoneFile, FailedFile, Job, JobState};
use crate::state::{ApplyOutput, Command, Inode, Kind};

/// Blocks one task carries at most.
const TASK_BLOCKS: usize = 64;
/// Bytes one task carries at most (a bigger block is a task of its own).
const TASK_BYTES: u64 = 256 << 20;
/// Tasks in flight per worker.
const TASKS_PER_WORKER: usize = 2;
/// Attempts per block before its file is reported failed.
const ATTEMPTS: u32 = 3;
/// Deadline of one task.
const TASK_TIMEOUT: Duration = Duration::from_secs(600);
/// How often progress is recorded (and cancellation noticed).
const REPORT_EVERY: Duration = Duration::from_millis(500);
/// Entries listed per directory page while enumerating.
const LIST_PAGE: usize = 1000;
/// Block copies queued at once: a job's further blocks are queued as the queue drains, so
/// what a load holds in memory follows its files, never the lengths they claim.
const QUEUE_TARGET: usize = 4096;

/// Jobs this master is running (leader only).
#[derive(Default)]
pub struct JobRunner {
    running: Mutex<HashSet<u64>>,
    /// Block loads tried again after a failure that may pass (an unreachable store or
    /// worker, a full cache); a gone, changed or refused object is not tried again.
    pub retries: prometheus_client::metrics::counter::Counter,
}

/// The kind of a worker's load failure; a value no version defines (a newer or hostile
/// worker) counts as unspecified, i.e. worth another try (bounded by the attempts).
fn load_error(code: i32) -> pb::LoadError {
    pb::LoadError::try_from(code).unwrap_or_default()
}

/// Whether a load that failed with `code` may succeed if tried again.
fn worth_retrying(code: pb::LoadError) -> bool {
    matches!(
        code,
        pb::LoadError::Unspecified | pb::LoadError::Unavailable
    )
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
        kind: &str,
        path: &str,
        replicas: u32,
        request_id: u64,
    ) -> Result<Job, MasterError> {
        if kind != "load" {
            return Err(MasterError::invalid(format!(
                "unknown job kind {kind:?} (known: load)"
            )));
        }
        if !(1..=8).contains(&replicas) {
            return Err(MasterError::invalid(format!(
                "replicas must be 1 to 8, not {replicas}"
            )));
        }
        self.ensure_leader()?;
        let path = granary_common::paths::normalize(path)?;
        // Refuse a path that does not exist now, rather than a job that fails at once.
        self.ns.resolve(&path).await?;
        let cmd = Command::CreateJob {
            kind: kind.to_string(),
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
        if self.ns.sm.job(id)?.is_none() {
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
        let job = self.ns.sm.job(id)?.ok_or(MasterError::NoSuchJob { id })?;
        let failed = self.ns.sm.job_failed(id, max_failed)?;
        Ok(to_info(&job, failed))
    }

    /// Every kept job (no failed lists).
    pub fn job_list(&self) -> Result<Vec<pb::JobInfo>, MasterError> {
        Ok(self
            .ns
            .sm
            .jobs()?
            .iter()
            .map(|j| to_info(j, Vec::new()))
            .collect())
    }

    /// Starts a runner for every unfinished job that has none (leader only; called every
    /// tick, so a new leader picks up the jobs of the last one).
    pub fn run_jobs(self: &Arc<Self>) {
        if !self.raft.status.is_leader() {
            return;
        }
        let Ok(jobs) = self.ns.sm.jobs() else {
            return;
        };
        for job in jobs.into_iter().filter(|j| !j.state.finished()) {
            if !lock(&self.jobs.running).insert(job.id) {
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
                lock(&core.jobs.running).remove(&id);
            });
        }
    }
}

fn to_info(job: &Job, failed: Vec<FailedFile>) -> pb::JobInfo {
    pb::JobInfo {
        id: job.id,
        kind: job.kind.clone(),
        path: job.path.clone(),
        replicas: job.replicas,
        state: job.state.as_str().to_string(),
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

/// One file being loaded.
struct Loading {
    inode: Inode,
    path: String,
    /// Block copies not settled yet.
    remaining: usize,
    error: Option<String>,
    block_size: u64,
    blocks: u32,
    /// The next block to queue.
    next: u32,
}

/// One copy of one block to cache.
#[derive(Clone)]
struct Item {
    inode: u64,
    index: u32,
    /// 0: the block's owner; n: the (n+1)-th worker in placement order.
    rank: usize,
    attempt: u32,
    len: u64,
}

async fn propose_job(core: &MasterCore, cmd: Command) -> Result<Job, MasterError> {
    match core.propose(cmd).await? {
        ApplyOutput::Job(j) => Ok(j),
        _ => Err(MasterError::corrupt("unexpected result of a job command")),
    }
}

/// Every file at or below `root`, with its path (directories listed from the under-store
/// where they were not yet).
async fn enumerate(core: &MasterCore, root: Inode) -> Result<Vec<(Inode, String)>, MasterError> {
    let root_path = core.ns.sm.path_of(&root)?;
    if root.kind != Kind::Directory {
        return Ok(vec![(root, root_path)]);
    }
    let mut files = Vec::new();
    let mut dirs = VecDeque::from([(root, root_path)]);
    while let Some((dir, path)) = dirs.pop_front() {
        let mut after: Option<String> = None;
        loop {
            let page = core
                .ns
                .list(dir.clone(), after.as_deref(), LIST_PAGE)
                .await?;
            let full = page.len() == LIST_PAGE;
            after = page.last().map(|i| i.name.clone());
            for child in page {
                let p = granary_common::paths::join(&path, &child.name);
                match child.kind {
                    Kind::Directory => dirs.push_back((child, p)),
                    _ => files.push((child, p)),
                }
            }
            if !full {
                break;
            }
        }
    }
    Ok(files)
}

/// A file's block size and number of blocks as a load plans them; the error says why the
/// file cannot be loaded (a length no real file has: it would plan billions of blocks).
fn plan_blocks(inode: &Inode, default_bs: u64) -> Result<(u64, u32), String> {
    let bs = if inode.block_size == 0 {
        default_bs
    } else {
        inode.block_size
    };
    if inode.length > granary_common::MAX_FILE_LENGTH {
        return Err(format!(
            "the file claims {} bytes, more than the {} TiB a file may hold",
            inode.length,
            granary_common::MAX_FILE_LENGTH >> 40
        ));
    }
    if bs == 0 {
        return Err("the file has no block size".into());
    }
    u32::try_from(inode.length.div_ceil(bs))
        .map(|n| (bs, n))
        .map_err(|_| {
            format!(
                "the file claims {} bytes, more blocks of {bs} bytes than a file may have",
                inode.length
            )
        })
}

fn descriptor(inode: &Inode, path: &str, index: u32) -> Option<pb::BlockDescriptor> {
    let st = crate::state::to_status(inode, path.to_string());
    Some(pb::BlockDescriptor {
        id: Some(pb::BlockId {
            inode: inode.id,
            version: inode.version,
            index,
        }),
        ufs: Some(st.ufs?),
        fingerprint: st.fingerprint,
        file_length: st.length,
        // What clients and grants take a 0 for (files of states from older versions).
        block_size: granary_common::grant::effective_block_size(st.block_size),
    })
}

/// The live workers, as clients see them (same order and weights).
/// What placement depends on: the live workers and their weights (capacities), in the
/// order of `live_workers`' list (placements are kept as positions in it).
fn placement_key(workers: &[pb::WorkerInfo]) -> Vec<(u64, u64)> {
    workers
        .iter()
        .map(|w| {
            (
                w.worker_id,
                w.stats.as_ref().map_or(0, |s| s.capacity_bytes),
            )
        })
        .collect()
}

fn live_workers(core: &MasterCore) -> Vec<pb::WorkerInfo> {
    let decommissioned = core.ns.sm.decommissioned().unwrap_or_default();
    core.workers
        .all()
        .into_iter()
        .filter(|w| core.workers.state_of(w, decommissioned.contains(&w.id)) == "live")
        .map(|w| pb::WorkerInfo {
            worker_id: w.id,
            address: w.address,
            host: w.host,
            state: "live".into(),
            stats: Some(w.stats),
            data_address: w.data_address,
            ..Default::default()
        })
        .collect()
}

async fn run(core: &Arc<MasterCore>, job: Job) -> Result<(), MasterError> {
    let id = job.id;
    core.ensure_leader()?;
    core.read_barrier().await?;
    // A job resumed by a new leader: that leader knows no workers until they re-register,
    // and placing blocks on the few known so far would cache them away from their owners
    // (and fetch them again, as the last leader's tasks may already have).
    if job.state != JobState::Planning {
        while core.workers.term_age() < core.heartbeat_interval * 3 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let root = match core.ns.resolve(&job.path).await {
        Ok(r) => r,
        Err(e @ MasterError::NotFound { .. }) => {
            let cmd = Command::FinishJob {
                id,
                state: JobState::Failed,
                error: e.to_string(),
                now_ms: granary_common::now_ms(),
            };
            propose_job(core, cmd).await?;
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let files = enumerate(core, root).await?;
    let total_bytes = files
        .iter()
        .fold(0u64, |sum, (f, _)| sum.saturating_add(f.length));
    let mut job = if job.state == JobState::Planning
        || job.total_files != files.len() as u64
        || job.total_bytes != total_bytes
    {
        let cmd = Command::JobPlanned {
            id,
            total_files: files.len() as u64,
            total_bytes,
        };
        propose_job(core, cmd).await?
    } else {
        job
    };
    tracing::info!(
        job = id,
        files = files.len(),
        bytes = total_bytes,
        "load job planned"
    );
    let done = core.ns.sm.job_done(id)?;
    let failed_before: HashSet<u64> = core
        .ns
        .sm
        .job_failed(id, usize::MAX)?
        .into_iter()
        .map(|f| f.inode)
        .collect();

    let replicas = job.replicas.max(1) as usize;
    let mut loading: HashMap<u64, Loading> = HashMap::new();
    let mut queue: VecDeque<Item> = VecDeque::new();
    // Files with blocks not queued yet, in order.
    let mut to_queue: VecDeque<u64> = VecDeque::new();
    let mut report = Report::default();
    for (inode, path) in files {
        if done.contains(&inode.id) || failed_before.contains(&inode.id) {
            continue;
        }
        if inode.length == 0 {
            report.done.push(DoneFile {
                inode: inode.id,
                length: 0,
            });
            continue;
        }
        if inode.mount_id.is_none() || !inode.complete {
            report.failed.push(FailedFile {
                inode: inode.id,
                path,
                reason: "not in an under-store (written through Granary and not persisted, or still being written)".into(),
            });
            continue;
        }
        let (bs, blocks) = match plan_blocks(&inode, granary_common::DEFAULT_BLOCK_SIZE) {
            Ok(p) => p,
            Err(reason) => {
                report.failed.push(FailedFile {
                    inode: inode.id,
                    path,
                    reason,
                });
                continue;
            }
        };
        to_queue.push_back(inode.id);
        loading.insert(
            inode.id,
            Loading {
                remaining: blocks as usize * replicas,
                inode,
                path,
                error: None,
                block_size: bs,
                blocks,
                next: 0,
            },
        );
    }

    let mut delayed: Vec<(Instant, Item)> = Vec::new();
    let mut per_worker: HashMap<u64, usize> = HashMap::new();
    let mut in_flight = FuturesUnordered::new();
    let mut last_report = Instant::now();
    let mut workers = live_workers(core);
    let mut workers_at = Instant::now();
    // Each item's worker, placed once per worker set: the scan below may go through the
    // whole queue on a turn (a worker with a free slot and nothing queued for it), and
    // placing every item again each turn cost a score and a clone per worker per item.
    let mut placed: HashMap<(u64, u64, u32, usize), usize> = HashMap::new();
    let mut placed_for = placement_key(&workers);
    loop {
        // The next blocks, while the queue is short.
        while queue.len() < QUEUE_TARGET {
            let Some(&id) = to_queue.front() else {
                break;
            };
            let Some(f) = loading.get_mut(&id) else {
                to_queue.pop_front();
                continue;
            };
            while f.next < f.blocks && queue.len() < QUEUE_TARGET {
                let index = f.next;
                let len = f
                    .block_size
                    .min(f.inode.length - u64::from(index) * f.block_size);
                for rank in 0..replicas {
                    queue.push_back(Item {
                        inode: id,
                        index,
                        rank,
                        attempt: 0,
                        len,
                    });
                }
                f.next += 1;
            }
            if f.next >= f.blocks {
                to_queue.pop_front();
            }
        }
        // Retries whose backoff is over go back in the queue.
        let now = Instant::now();
        delayed.retain(|(at, item)| {
            if *at <= now {
                queue.push_back(item.clone());
                false
            } else {
                true
            }
        });
        if workers_at.elapsed() > Duration::from_secs(1) {
            workers = live_workers(core);
            workers_at = Instant::now();
            let key = placement_key(&workers);
            if key != placed_for {
                placed.clear();
                placed_for = key;
            }
        }
        // Fill every worker's free task slots from the queue, in queue order.
        if !queue.is_empty() && !workers.is_empty() {
            let mut batches: HashMap<u64, (pb::WorkerInfo, Vec<Item>, u64)> = HashMap::new();
            let mut rest = VecDeque::new();
            // Workers with a free task slot; the scan stops once each has a full batch, so
            // a long queue is not placed item by item again on every turn of this loop.
            let free = workers
                .iter()
                .filter(|w| per_worker.get(&w.worker_id).copied().unwrap_or(0) < TASKS_PER_WORKER)
                .count();
            let mut filled = std::collections::HashSet::new();
            while let Some(item) = queue.pop_front() {
                if filled.len() >= free {
                    queue.push_front(item);
                    break;
                }
                let Some(f) = loading.get(&item.inode) else {
                    continue;
                };
                let memo = (item.inode, f.inode.version, item.index, item.rank);
                let at = *placed.entry(memo).or_insert_with(|| {
                    let block = pb::BlockId {
                        inode: item.inode,
                        version: f.inode.version,
                        index: item.index,
                    };
                    let order = granary_client::placement::order_workers(&block, &workers);
                    order
                        .get(item.rank.min(order.len().saturating_sub(1)))
                        .and_then(|w| workers.iter().position(|x| x.worker_id == w.worker_id))
                        .unwrap_or(usize::MAX)
                });
                let Some(w) = workers.get(at) else {
                    rest.push_back(item);
                    continue;
                };
                let busy = per_worker.get(&w.worker_id).copied().unwrap_or(0);
                let b = batches
                    .entry(w.worker_id)
                    .or_insert_with(|| (w.clone(), Vec::new(), 0));
                let full = b.1.len() >= TASK_BLOCKS || (b.2 > 0 && b.2 + item.len > TASK_BYTES);
                if busy >= TASKS_PER_WORKER || full {
                    if full {
                        filled.insert(w.worker_id);
                    }
                    rest.push_back(item);
                    continue;
                }
                placed.remove(&memo); // kept only while queued (a retry places it again)
                b.2 += item.len;
                b.1.push(item);
                if b.1.len() >= TASK_BLOCKS || b.2 >= TASK_BYTES {
                    filled.insert(w.worker_id);
                }
            }
            // Skipped items keep their place at the front of the queue.
            while let Some(item) = rest.pop_back() {
                queue.push_front(item);
            }
            for (wid, (w, items, _)) in batches {
                if items.is_empty() {
                    continue;
                }
                *per_worker.entry(wid).or_default() += 1;
                // Each block with the other workers holding it now (peers to copy from).
                // A further replica's first copy is usually still on its way, so its
                // worker asks when it gets to the block rather than fetching it again.
                let (blocks, holders) = items
                    .iter()
                    .filter_map(|i| {
                        let f = loading.get(&i.inode)?;
                        let d = descriptor(&f.inode, &f.path, i.index)?;
                        let known = i.rank == 0;
                        let workers = match (known, d.id) {
                            (true, Some(id)) => core
                                .holders_of(&id)
                                .into_iter()
                                .filter(|h| h.worker_id != wid)
                                .collect(),
                            _ => Vec::new(),
                        };
                        Some((d, pb::BlockHolders { known, workers }))
                    })
                    .unzip();
                let task = pb::LoadBlocksRequest { blocks, holders };
                in_flight.push(async move {
                    let res = load_on(&w.address, task).await;
                    (wid, items, res)
                });
            }
        }
        let settled =
            loading.is_empty() && queue.is_empty() && delayed.is_empty() && to_queue.is_empty();
        if settled && in_flight.is_empty() {
            break;
        }
        tokio::select! {
            Some((wid, items, res)) = in_flight.next(), if !in_flight.is_empty() => {
                if let Some(n) = per_worker.get_mut(&wid) {
                    *n = n.saturating_sub(1);
                }
                type Outcome = Result<u64, (pb::LoadError, String)>;
                let results: HashMap<(u64, u32), Outcome> = match res {
                    Ok(r) => r
                        .results
                        .into_iter()
                        .filter_map(|r| {
                            let b = r.block?;
                            let code = load_error(r.code);
                            let v = if r.error.is_empty() { Ok(r.fetched_bytes) } else { Err((code, r.error)) };
                            Some(((b.inode, b.index), v))
                        })
                        .collect(),
                    Err(e) => items
                        .iter()
                        .map(|i| ((i.inode, i.index), Err((pb::LoadError::Unavailable, e.clone()))))
                        .collect(),
                };
                for mut item in items {
                    let outcome = results
                        .get(&(item.inode, item.index))
                        .cloned()
                        .unwrap_or_else(|| Err((pb::LoadError::Unavailable, "the worker did not answer for this block".into())));
                    let error = match outcome {
                        Ok(fetched) => {
                            report.fetched_bytes += fetched;
                            // The worker holds the block now: `fs stat` says so at once,
                            // not from its next heartbeat on (which reports it too, or its
                            // eviction).
                            if let Some(f) = loading.get(&item.inode) {
                                let block = pb::BlockId {
                                    inode: item.inode,
                                    version: f.inode.version,
                                    index: item.index,
                                };
                                core.blocks.update(wid, &[block], &[]);
                            }
                            None
                        }
                        Err((code, e)) if worth_retrying(code) && item.attempt + 1 < ATTEMPTS => {
                            core.jobs.retries.inc();
                            tracing::debug!(job = id, inode = item.inode, block = item.index, error = %e, "load of a block failed; retrying");
                            let backoff = Duration::from_secs(1 << item.attempt);
                            item.attempt += 1;
                            delayed.push((Instant::now() + backoff, item));
                            continue;
                        }
                        Err((_, e)) => Some(e),
                    };
                    let Some(f) = loading.get_mut(&item.inode) else {
                        continue;
                    };
                    if let Some(e) = error {
                        f.error.get_or_insert(e);
                        // A failed file's blocks not queued yet are not tried.
                        f.remaining -= (f.blocks - f.next) as usize * replicas;
                        f.next = f.blocks;
                    }
                    f.remaining -= 1;
                    if f.remaining == 0 {
                        if let Some(f) = loading.remove(&item.inode) {
                            match f.error {
                                None => report.done.push(DoneFile { inode: f.inode.id, length: f.inode.length }),
                                Some(reason) => report.failed.push(FailedFile { inode: f.inode.id, path: f.path, reason }),
                            }
                        }
                    }
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        if last_report.elapsed() >= REPORT_EVERY || report.done.len() >= 4096 {
            job = report.flush(core, id).await?.unwrap_or(job);
            last_report = Instant::now();
            if job.state.finished() {
                tracing::info!(job = id, state = job.state.as_str(), "job stopped");
                return Ok(()); // cancelled
            }
            if !core.raft.status.is_leader() {
                return Err(core.raft.not_leader());
            }
        }
    }
    job = report.flush(core, id).await?.unwrap_or(job);
    if job.state.finished() {
        return Ok(());
    }
    let state = if job.failed_files == 0 {
        JobState::Succeeded
    } else {
        JobState::Failed
    };
    let cmd = Command::FinishJob {
        id,
        state,
        error: String::new(),
        now_ms: granary_common::now_ms(),
    };
    let job = propose_job(core, cmd).await?;
    tracing::info!(
        job = id,
        state = job.state.as_str(),
        files = job.done_files,
        failed = job.failed_files,
        fetched_bytes = job.fetched_bytes,
        "load job finished"
    );
    Ok(())
}

/// Progress not recorded yet.
#[derive(Default)]
struct Report {
    done: Vec<DoneFile>,
    failed: Vec<FailedFile>,
    fetched_bytes: u64,
}

impl Report {
    /// Records the progress, if there is any; returns the job as it now stands (from the
    /// local state when nothing was recorded: a cancellation is seen either way).
    async fn flush(&mut self, core: &MasterCore, id: u64) -> Result<Option<Job>, MasterError> {
        if self.done.is_empty() && self.failed.is_empty() && self.fetched_bytes == 0 {
            return core.ns.sm.job(id);
        }
        let cmd = Command::JobProgress {
            id,
            done: std::mem::take(&mut self.done),
            failed: std::mem::take(&mut self.failed),
            fetched_bytes: std::mem::take(&mut self.fetched_bytes),
        };
        propose_job(core, cmd).await.map(Some)
    }
}

/// Sends one task to a worker.
async fn load_on(
    address: &str,
    task: pb::LoadBlocksRequest,
) -> Result<pb::LoadBlocksResponse, String> {
    let ch = granary_common::grpc::channel(address)
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
    use super::*;

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
