//! The load planner: which copy of which block goes to which worker, in what batches, what
//! is tried again and when, and when a file is done. Pure and synchronous: the runner
//! (`super::run`) feeds it the live workers, each task's answer and the time, and carries
//! out what it decides (sends the tasks, records the progress through Raft). The split is
//! what lets a property test drive it through any order of events (see `proptests`).
//!
//! Invariants (checked there): a copy of a block is in at most one place at a time (queued,
//! waiting out a backoff, or in one task) and is never sent again once loaded; no worker
//! has more than `tasks_per_worker` tasks at once, nor a task more than its limits; every
//! file ends done (every block on `replicas` workers) or failed with a reason, once.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use granary_proto as pb;

use crate::state::jobs::{DoneFile, FailedFile};
use crate::state::Inode;

/// What the planner may put in flight.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Blocks one task carries at most.
    pub task_blocks: usize,
    /// Bytes one task carries at most (a bigger block is a task of its own).
    pub task_bytes: u64,
    /// Tasks in flight per worker.
    pub tasks_per_worker: usize,
    /// Attempts per block copy before its file is reported failed.
    pub attempts: u32,
    /// Block copies queued at once: further blocks are queued as the queue drains, so what
    /// a load holds in memory follows its files, never the lengths they claim.
    pub queue_target: usize,
    /// Files held at once (being loaded, or waiting for their blocks to be queued): the
    /// runner adds more as they settle, so a load of ten million files holds no more
    /// than this many.
    pub files_held: usize,
}

impl Limits {
    pub const DEFAULT: Limits = Limits {
        task_blocks: 64,
        task_bytes: 256 << 20,
        tasks_per_worker: 2,
        attempts: 3,
        queue_target: 4096,
        files_held: 8192,
    };
}

/// Progress not recorded yet.
#[derive(Default, Debug)]
pub struct Report {
    pub done: Vec<DoneFile>,
    pub failed: Vec<FailedFile>,
    pub fetched_bytes: u64,
}

impl Report {
    pub fn is_empty(&self) -> bool {
        self.done.is_empty() && self.failed.is_empty() && self.fetched_bytes == 0
    }
}

/// One task to send: `request` to `worker`; its answer goes back through
/// [`Planner::answer`] with `id`.
pub struct Task {
    pub id: u64,
    pub worker: pb::WorkerInfo,
    pub request: pb::LoadBlocksRequest,
}

/// What a task's answer settled.
#[derive(Default, Debug)]
pub struct Answered {
    /// Blocks the task's worker holds now.
    pub loaded: Vec<pb::BlockId>,
    /// Copies that failed and will be tried again.
    pub retries: u64,
}

/// One file being loaded.
struct Loading {
    inode: Inode,
    path: String,
    /// Block copies not settled yet (queued, waiting, in flight, or not queued yet).
    remaining: usize,
    error: Option<String>,
    block_size: u64,
    blocks: u32,
    /// The next block to queue.
    next: u32,
    /// Per block with copies sent and not all loaded: the workers sent one, and whether
    /// each loaded it (so no two copies of a block go to one worker, even as the live
    /// workers change).
    claims: HashMap<u32, Vec<(u64, bool)>>,
}

/// One copy of one block to cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Item {
    pub inode: u64,
    pub index: u32,
    /// 0: the block's owner; n: the (n+1)-th worker in placement order.
    pub rank: usize,
    pub attempt: u32,
    pub len: u64,
}

/// A failed copy: whether it may pass when tried again, and why it failed.
type Failure = (bool, String);

pub struct Planner {
    limits: Limits,
    replicas: usize,
    default_block_size: u64,
    loading: HashMap<u64, Loading>,
    /// Files with blocks not queued yet, in order.
    to_queue: VecDeque<u64>,
    queue: VecDeque<Item>,
    /// Copies waiting out a backoff before they are queued again.
    delayed: Vec<(Instant, Item)>,
    workers: Vec<pb::WorkerInfo>,
    /// Each queued copy's worker (a position in `workers`), placed once per worker set:
    /// a turn may scan the whole queue, and placing every copy again each turn cost a
    /// score and a clone per worker per copy.
    placed: HashMap<(u64, u32, usize), usize>,
    /// Tasks in flight: their worker and copies.
    tasks: HashMap<u64, (u64, Vec<Item>)>,
    per_worker: HashMap<u64, usize>,
    next_task: u64,
    report: Report,
    /// Whether the runner has added every file of the job.
    all_added: bool,
}

impl Planner {
    /// A plan with no files yet: the runner adds them (see [`Planner::add`]) while
    /// [`Planner::wants_files`], then says it added all (see [`Planner::all_added`]).
    pub fn new(replicas: u32, default_block_size: u64, limits: Limits) -> Planner {
        Planner {
            limits,
            replicas: replicas.max(1) as usize,
            default_block_size,
            loading: HashMap::new(),
            to_queue: VecDeque::new(),
            queue: VecDeque::new(),
            delayed: Vec::new(),
            workers: Vec::new(),
            placed: HashMap::new(),
            tasks: HashMap::new(),
            per_worker: HashMap::new(),
            next_task: 1,
            report: Report::default(),
            all_added: false,
        }
    }

    /// Whether the plan has room for more files (and the runner has not said it added
    /// all of them).
    pub fn wants_files(&self) -> bool {
        !self.all_added && self.loading.len() < self.limits.files_held
    }

    /// Files held (added and not settled).
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.loading.len()
    }

    /// Every file of the job has been added.
    pub fn all_added(&mut self) {
        self.all_added = true;
    }

    /// Adds `files` (each with its path) to the plan. A file being loaded already is not
    /// added twice; files that cannot be loaded are in the next report as failed, with the
    /// reason.
    pub fn add(&mut self, files: Vec<(Inode, String)>) {
        let replicas = self.replicas;
        for (inode, path) in files {
            if self.loading.contains_key(&inode.id) {
                continue;
            }
            if inode.length == 0 {
                self.report.done.push(DoneFile {
                    inode: inode.id,
                    length: 0,
                });
                continue;
            }
            if inode.mount_id.is_none() || !inode.complete {
                self.report.failed.push(FailedFile {
                    inode: inode.id,
                    path,
                    reason: "not in an under-store (written through Granary and not persisted, or still being written)".into(),
                });
                continue;
            }
            let (block_size, blocks) = match plan_blocks(&inode, self.default_block_size) {
                Ok(plan) => plan,
                Err(reason) => {
                    self.report.failed.push(FailedFile {
                        inode: inode.id,
                        path,
                        reason,
                    });
                    continue;
                }
            };
            self.to_queue.push_back(inode.id);
            self.loading.insert(
                inode.id,
                Loading {
                    remaining: blocks as usize * replicas,
                    inode,
                    path,
                    error: None,
                    block_size,
                    blocks,
                    next: 0,
                    claims: HashMap::new(),
                },
            );
        }
    }

    /// The live workers (their order is what placement positions refer to).
    pub fn set_workers(&mut self, workers: Vec<pb::WorkerInfo>) {
        if placement_key(&workers) != placement_key(&self.workers) {
            self.placed.clear();
        }
        self.workers = workers;
    }

    /// Whether every file was added and is done or failed, and no task is in flight.
    pub fn settled(&self) -> bool {
        self.all_added
            && self.loading.is_empty()
            && self.queue.is_empty()
            && self.delayed.is_empty()
            && self.to_queue.is_empty()
            && self.tasks.is_empty()
    }

    /// Files settled since the last report.
    pub fn unreported(&self) -> usize {
        self.report.done.len() + self.report.failed.len()
    }

    pub fn take_report(&mut self) -> Report {
        std::mem::take(&mut self.report)
    }

    /// The tasks to send now: queued copies, in queue order, batched per worker into every
    /// free task slot. `holders` names the workers known to hold a block (peers its owner
    /// may copy it from).
    pub fn tasks(
        &mut self,
        now: Instant,
        holders: impl Fn(&pb::BlockId) -> Vec<pb::WorkerAddress>,
    ) -> Vec<Task> {
        self.refill();
        let mut i = 0;
        while i < self.delayed.len() {
            if self.delayed[i].0 <= now {
                let (_, item) = self.delayed.swap_remove(i);
                self.queue.push_back(item);
            } else {
                i += 1;
            }
        }
        if self.queue.is_empty() || self.workers.is_empty() {
            return Vec::new();
        }
        let batches = self.batch(now);
        let mut tasks = Vec::new();
        for (at, items) in batches {
            let worker = self.workers[at].clone();
            let wid = worker.worker_id;
            let (blocks, holders) = items
                .iter()
                .filter_map(|item| {
                    let f = self.loading.get(&item.inode)?;
                    let d = descriptor(&f.inode, &f.path, item.index)?;
                    // A further replica's first copy is usually still on its way, so its
                    // worker asks when it gets to the block rather than fetching it again.
                    let known = item.rank == 0;
                    let workers = match (known, d.id) {
                        (true, Some(id)) => holders(&id)
                            .into_iter()
                            .filter(|h| h.worker_id != wid)
                            .collect(),
                        _ => Vec::new(),
                    };
                    Some((d, pb::BlockHolders { known, workers }))
                })
                .unzip();
            let id = self.next_task;
            self.next_task += 1;
            *self.per_worker.entry(wid).or_default() += 1;
            self.tasks.insert(id, (wid, items));
            tasks.push(Task {
                id,
                worker,
                request: pb::LoadBlocksRequest {
                    blocks,
                    holders,
                    pinned_inodes: Vec::new(),
                },
            });
        }
        tasks
    }

    /// Queues the next blocks while the queue is short.
    fn refill(&mut self) {
        while self.queue.len() < self.limits.queue_target {
            let Some(&id) = self.to_queue.front() else {
                return;
            };
            let Some(f) = self.loading.get_mut(&id) else {
                self.to_queue.pop_front();
                continue;
            };
            while f.next < f.blocks && self.queue.len() < self.limits.queue_target {
                let index = f.next;
                let len = f
                    .block_size
                    .min(f.inode.length - u64::from(index) * f.block_size);
                for rank in 0..self.replicas {
                    self.queue.push_back(Item {
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
                self.to_queue.pop_front();
            }
        }
    }

    /// Takes queued copies into batches per worker (by position in `workers`), as many as
    /// the workers' free task slots and the task limits allow; the rest keep their place.
    fn batch(&mut self, now: Instant) -> Vec<(usize, Vec<Item>)> {
        let limits = self.limits;
        let busy = |p: &Planner, wid: u64| p.per_worker.get(&wid).copied().unwrap_or(0);
        let free = self
            .workers
            .iter()
            .filter(|w| busy(self, w.worker_id) < limits.tasks_per_worker)
            .count();
        let mut batches: HashMap<usize, (Vec<Item>, u64)> = HashMap::new();
        let mut filled = HashSet::new();
        let mut rest = VecDeque::new();
        let mut unplaceable = Vec::new();
        // The scan stops once each free worker has a full batch, so a long queue is not
        // placed copy by copy again on every turn.
        while filled.len() < free {
            let Some(item) = self.queue.pop_front() else {
                break;
            };
            let Some(at) = self.place(&item) else {
                unplaceable.push(item);
                continue;
            };
            let wid = self.workers[at].worker_id;
            let b = batches.entry(at).or_default();
            let full =
                b.0.len() >= limits.task_blocks || (b.1 > 0 && b.1 + item.len > limits.task_bytes);
            if busy(self, wid) >= limits.tasks_per_worker || full {
                if full {
                    filled.insert(at);
                }
                rest.push_back(item);
                continue;
            }
            // Placed only while queued: a retry is placed again.
            self.placed.remove(&(item.inode, item.index, item.rank));
            if let Some(f) = self.loading.get_mut(&item.inode) {
                f.claims.entry(item.index).or_default().push((wid, false));
            }
            b.1 += item.len;
            b.0.push(item);
            if b.0.len() >= limits.task_blocks || b.1 >= limits.task_bytes {
                filled.insert(at);
            }
        }
        while let Some(item) = rest.pop_back() {
            self.queue.push_front(item);
        }
        let live = self.workers.len();
        for item in unplaceable {
            let why = format!(
                "{} replicas asked for, but only {live} workers are live",
                self.replicas
            );
            self.settle(item, None, Err((true, why)), now);
        }
        let mut out: Vec<(usize, Vec<Item>)> = batches
            .into_iter()
            .filter(|(_, b)| !b.0.is_empty())
            .map(|(at, b)| (at, b.0))
            .collect();
        out.sort_by_key(|(at, _)| *at);
        out
    }

    /// The position in `workers` of the worker that holds this copy: the block's owner
    /// for rank 0, the next in placement order for each further replica, or the first in
    /// that order that no other copy of the block went to; None when every live worker
    /// has one (fewer live workers than replicas).
    fn place(&mut self, item: &Item) -> Option<usize> {
        let f = self.loading.get(&item.inode)?;
        let claims = f.claims.get(&item.index);
        let claimed = |wid: u64| claims.is_some_and(|c| c.iter().any(|(w, _)| *w == wid));
        let key = (item.inode, item.index, item.rank);
        if let Some(&at) = self.placed.get(&key) {
            if self.workers.get(at).is_some_and(|w| !claimed(w.worker_id)) {
                return Some(at);
            }
        }
        let block = pb::BlockId {
            inode: item.inode,
            version: f.inode.version,
            index: item.index,
        };
        let order = granary_client::placement::order_workers(&block, &self.workers);
        let w = order
            .get(item.rank)
            .filter(|w| !claimed(w.worker_id))
            .or_else(|| order.iter().find(|w| !claimed(w.worker_id)))?;
        let at = self
            .workers
            .iter()
            .position(|x| x.worker_id == w.worker_id)?;
        self.placed.insert(key, at);
        Some(at)
    }

    /// The worker a task in flight was sent to.
    pub fn worker_of(&self, task: u64) -> Option<u64> {
        self.tasks.get(&task).map(|t| t.0)
    }

    /// A task's answer (an error: the task failed as a whole). An unknown task id (already
    /// answered) changes nothing.
    pub fn answer(
        &mut self,
        task: u64,
        result: Result<pb::LoadBlocksResponse, String>,
        now: Instant,
    ) -> Answered {
        let mut out = Answered::default();
        let Some((wid, items)) = self.tasks.remove(&task) else {
            return out;
        };
        if let Some(n) = self.per_worker.get_mut(&wid) {
            *n = n.saturating_sub(1);
        }
        let results: HashMap<(u64, u32), Result<u64, Failure>> = match result {
            Ok(r) => r
                .results
                .into_iter()
                .filter_map(|r| {
                    let b = r.block?;
                    let v = if r.error.is_empty() {
                        Ok(r.fetched_bytes)
                    } else {
                        Err((worth_retrying(load_error(r.code)), r.error))
                    };
                    Some(((b.inode, b.index), v))
                })
                .collect(),
            Err(e) => items
                .iter()
                .map(|i| ((i.inode, i.index), Err((true, e.clone()))))
                .collect(),
        };
        for item in items {
            let outcome = results
                .get(&(item.inode, item.index))
                .cloned()
                .unwrap_or_else(|| Err((true, "the worker did not answer for this block".into())));
            if let (Ok(_), Some(f)) = (&outcome, self.loading.get(&item.inode)) {
                out.loaded.push(pb::BlockId {
                    inode: item.inode,
                    version: f.inode.version,
                    index: item.index,
                });
            }
            if self.settle(item, Some(wid), outcome, now) {
                out.retries += 1;
            }
        }
        out
    }

    /// Settles one copy (sent to `worker`, if it was sent): loaded, to be tried again
    /// after a backoff (returns true), or failed, which fails its file (whose copies not
    /// sent yet are dropped).
    fn settle(
        &mut self,
        mut item: Item,
        worker: Option<u64>,
        outcome: Result<u64, Failure>,
        now: Instant,
    ) -> bool {
        if let (Some(wid), Some(f)) = (worker, self.loading.get_mut(&item.inode)) {
            if let Some(claims) = f.claims.get_mut(&item.index) {
                match outcome {
                    Ok(_) => {
                        if let Some(c) = claims.iter_mut().find(|(w, done)| *w == wid && !done) {
                            c.1 = true;
                        }
                    }
                    Err(_) => claims.retain(|(w, done)| *w != wid || *done),
                }
                if claims.is_empty()
                    || claims.iter().filter(|(_, done)| *done).count() >= self.replicas
                {
                    f.claims.remove(&item.index);
                }
            }
        }
        let error = match outcome {
            Ok(fetched) => {
                self.report.fetched_bytes = self.report.fetched_bytes.saturating_add(fetched);
                None
            }
            Err((true, _)) if item.attempt + 1 < self.limits.attempts => {
                let backoff = Duration::from_secs(1 << item.attempt.min(6));
                item.attempt += 1;
                self.delayed.push((now + backoff, item));
                return true;
            }
            Err((_, e)) => Some(e),
        };
        let inode = item.inode;
        let Some(f) = self.loading.get_mut(&inode) else {
            return false;
        };
        f.remaining -= 1;
        if let Some(e) = error {
            f.error.get_or_insert(e);
            // Its blocks not queued yet, and its copies queued or waiting, are not tried.
            f.remaining -= (f.blocks - f.next) as usize * self.replicas;
            f.next = f.blocks;
            let mut dropped = Vec::new();
            self.queue.retain(|i| {
                let keep = i.inode != inode;
                if !keep {
                    dropped.push((i.inode, i.index, i.rank));
                }
                keep
            });
            self.delayed.retain(|(_, i)| {
                let keep = i.inode != inode;
                if !keep {
                    dropped.push((i.inode, i.index, i.rank));
                }
                keep
            });
            f.remaining -= dropped.len();
            for key in dropped {
                self.placed.remove(&key);
            }
        }
        if f.remaining == 0 {
            if let Some(f) = self.loading.remove(&inode) {
                match f.error {
                    None => self.report.done.push(DoneFile {
                        inode,
                        length: f.inode.length,
                    }),
                    Some(reason) => self.report.failed.push(FailedFile {
                        inode,
                        path: f.path,
                        reason,
                    }),
                }
            }
        }
        false
    }
}

/// The kind of a worker's load failure; a value no version defines (a newer or hostile
/// worker) counts as unspecified, i.e. worth another try (bounded by the attempts).
pub(super) fn load_error(code: i32) -> pb::LoadError {
    pb::LoadError::try_from(code).unwrap_or_default()
}

/// Whether a load that failed with `code` may succeed if tried again.
pub(super) fn worth_retrying(code: pb::LoadError) -> bool {
    matches!(
        code,
        pb::LoadError::Unspecified | pb::LoadError::Unavailable
    )
}

/// A file's block size and number of blocks as a load plans them; the error says why the
/// file cannot be loaded (a length no real file has: it would plan billions of blocks).
pub(crate) fn plan_blocks(inode: &Inode, default_bs: u64) -> Result<(u64, u32), String> {
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

/// What placement depends on: the live workers and their weights (capacities), in the
/// order of the list (placements are kept as positions in it).
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
