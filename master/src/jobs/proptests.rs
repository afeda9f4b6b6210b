//! Property test of the load planner: any order of worker changes, task answers (loaded,
//! failed for good, failed for now, not answered, the whole task lost) and time, then a
//! healthy cluster until the job settles. Checked after every step and at the end:
//!
//! - no worker ever has more than `tasks_per_worker` tasks in flight, nor a task more
//!   blocks or bytes than the limits (a block bigger than `task_bytes` goes alone);
//! - a block's copies loaded or in flight are never more than the replicas asked for, and
//!   never two on one worker (no block fetched twice);
//! - the job settles; every file is reported exactly once, done only when each of its
//!   blocks was loaded on `replicas` different workers, failed only with a reason;
//! - files arrive from the walk a few at a time, and the planner never holds more than
//!   `files_held` of them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use granary_proto as pb;
use proptest::prelude::*;

use super::planner::{Limits, Planner};
use crate::state::{Inode, Kind};

const WORKERS: u64 = 4;
const BLOCK: u64 = 10;

const LIMITS: Limits = Limits {
    task_blocks: 3,
    task_bytes: 25,
    tasks_per_worker: 2,
    attempts: 3,
    queue_target: 7,
    files_held: 3,
};

#[derive(Debug, Clone)]
enum Op {
    /// The live workers (a bit per worker).
    Workers(u8),
    /// Answer a task in flight (chosen by index), one outcome per block.
    Answer(usize, Vec<Outcome>),
    /// The whole task failed (worker unreachable, deadline).
    Lost(usize),
    /// Time passes (milliseconds).
    Tick(u64),
    /// The walk sends up to this many more files (while the planner wants them).
    Feed(usize),
}

#[derive(Debug, Clone, Copy)]
enum Outcome {
    Loaded,
    /// Unavailable: may pass when tried again.
    Transient,
    /// Gone from the store: never tried again.
    Permanent,
    /// Left out of the answer.
    Missing,
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        6 => Just(Outcome::Loaded),
        2 => Just(Outcome::Transient),
        1 => Just(Outcome::Permanent),
        1 => Just(Outcome::Missing),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0u8..16).prop_map(Op::Workers),
        6 => (0usize..8, prop::collection::vec(outcome(), 4)).prop_map(|(t, o)| Op::Answer(t, o)),
        1 => (0usize..8).prop_map(Op::Lost),
        2 => (0u64..3000).prop_map(Op::Tick),
        2 => (1usize..4).prop_map(Op::Feed),
    ]
}

fn worker(id: u64) -> pb::WorkerInfo {
    pb::WorkerInfo {
        worker_id: id,
        address: format!("w{id}"),
        state: "live".into(),
        ..Default::default()
    }
}

/// A file of `length` bytes in blocks of `BLOCK` (id from 10); `stored` false: written
/// through Granary and not in an under-store (a load refuses it).
fn file(id: u64, length: u64, stored: bool) -> (Inode, String) {
    let mut f = Inode::directory(id, 1, &format!("f{id}"), 0o644, 0);
    f.kind = Kind::File;
    f.length = length;
    f.block_size = BLOCK;
    f.version = id * 7;
    f.mount_id = stored.then_some(1);
    f.ufs_path = format!("f{id}");
    (f, format!("/m/f{id}"))
}

/// A block: (inode, index).
type Block = (u64, u32);

/// The test's record of what was sent and what it answered.
#[derive(Default)]
struct World {
    /// Tasks in flight, in the order sent: id, worker, blocks (inode, index) with bytes.
    in_flight: Vec<(u64, u64, Vec<Block>)>,
    /// Workers each block was loaded on (as answered).
    loaded: HashMap<(u64, u32), Vec<u64>>,
    done: BTreeMap<u64, u64>,
    failed: BTreeMap<u64, String>,
}

impl World {
    fn send(&mut self, planner: &mut Planner, now: Instant, replicas: usize) {
        for t in planner.tasks(now, |_| Vec::new()) {
            let wid = t.worker.worker_id;
            let blocks: Vec<(u64, u32)> = t
                .request
                .blocks
                .iter()
                .map(|d| {
                    let id = d.id.unwrap();
                    (id.inode, id.index)
                })
                .collect();
            assert_eq!(t.request.blocks.len(), t.request.holders.len());
            assert!(!blocks.is_empty(), "an empty task");
            assert!(blocks.len() <= LIMITS.task_blocks, "{blocks:?}");
            let bytes: u64 = t
                .request
                .blocks
                .iter()
                .map(|d| {
                    let i = u64::from(d.id.unwrap().index);
                    BLOCK.min(d.file_length - i * BLOCK)
                })
                .sum();
            assert!(
                blocks.len() == 1 || bytes <= LIMITS.task_bytes,
                "{bytes} bytes"
            );
            self.in_flight.push((t.id, wid, blocks));
        }
        let mut per_worker: HashMap<u64, usize> = HashMap::new();
        let mut copies: HashMap<(u64, u32), Vec<u64>> = self.loaded.clone();
        for (_, wid, blocks) in &self.in_flight {
            *per_worker.entry(*wid).or_default() += 1;
            for b in blocks {
                copies.entry(*b).or_default().push(*wid);
            }
        }
        assert!(
            per_worker.values().all(|n| *n <= LIMITS.tasks_per_worker),
            "{per_worker:?}"
        );
        for (block, on) in copies {
            let distinct: HashSet<u64> = on.iter().copied().collect();
            assert_eq!(
                distinct.len(),
                on.len(),
                "block {block:?} twice on a worker: {on:?}"
            );
            assert!(
                on.len() <= replicas,
                "block {block:?} on {on:?}, {replicas} replicas"
            );
        }
    }

    fn answer(
        &mut self,
        planner: &mut Planner,
        pick: usize,
        outcomes: Option<&[Outcome]>,
        now: Instant,
    ) {
        if self.in_flight.is_empty() {
            return;
        }
        let (task, wid, blocks) = self.in_flight.remove(pick % self.in_flight.len());
        let result = match outcomes {
            None => Err("worker w unreachable".to_string()),
            Some(outcomes) => {
                let mut results = Vec::new();
                for (i, (inode, index)) in blocks.iter().enumerate() {
                    let block = Some(pb::BlockId {
                        inode: *inode,
                        version: inode * 7,
                        index: *index,
                    });
                    let (error, code) = match outcomes[i % outcomes.len()] {
                        Outcome::Loaded => {
                            self.loaded.entry((*inode, *index)).or_default().push(wid);
                            (String::new(), pb::LoadError::Unspecified)
                        }
                        Outcome::Transient => {
                            ("store unreachable".into(), pb::LoadError::Unavailable)
                        }
                        Outcome::Permanent => ("object gone".into(), pb::LoadError::NotFound),
                        Outcome::Missing => continue,
                    };
                    results.push(pb::LoadResult {
                        block,
                        error,
                        code: code as i32,
                        // What a hostile worker could claim: the sums must not overflow.
                        fetched_bytes: u64::MAX,
                    });
                }
                Ok(pb::LoadBlocksResponse { results })
            }
        };
        assert_eq!(planner.worker_of(task), Some(wid));
        let answered = planner.answer(task, result, now);
        for b in answered.loaded {
            assert!(self.loaded[&(b.inode, b.index)].contains(&wid));
        }
        // An answer counts once.
        let again = planner.answer(task, Err("late".into()), now);
        assert!(again.loaded.is_empty() && again.retries == 0);
    }

    fn collect(&mut self, planner: &mut Planner) {
        let r = planner.take_report();
        for d in r.done {
            assert!(
                self.done.insert(d.inode, d.length).is_none(),
                "{} reported twice",
                d.inode
            );
            assert!(!self.failed.contains_key(&d.inode));
        }
        for f in r.failed {
            assert!(!f.reason.is_empty());
            assert!(
                self.failed.insert(f.inode, f.reason).is_none(),
                "{} reported twice",
                f.inode
            );
            assert!(!self.done.contains_key(&f.inode));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn a_load_settles_with_every_block_on_its_replicas_or_its_file_failed(
        files in prop::collection::vec((0u64..60, prop::bool::weighted(0.9)), 1..12),
        replicas in 1u32..=3,
        skip in prop::collection::hash_set(10u64..18, 0..2),
        ops in prop::collection::vec(op(), 0..120),
    ) {
        let files: Vec<(Inode, String)> = files
            .iter()
            .enumerate()
            .map(|(i, (len, stored))| file(10 + i as u64, *len, *stored))
            .collect();
        let expected: Vec<(Inode, String)> =
            files.iter().filter(|(f, _)| !skip.contains(&f.id)).cloned().collect();
        // The walk leaves out what an earlier runner settled.
        let mut walk: std::collections::VecDeque<(Inode, String)> = expected.iter().cloned().collect();
        let mut planner = Planner::new(replicas, 64 << 20, LIMITS);
        let mut feed = |planner: &mut Planner, n: usize| {
            for _ in 0..n {
                if !planner.wants_files() {
                    break;
                }
                match walk.pop_front() {
                    Some(f) => planner.add(vec![f]),
                    None => planner.all_added(),
                }
            }
        };
        let mut world = World::default();
        let mut now = Instant::now();
        let all = (1..=WORKERS).map(worker).collect::<Vec<_>>();
        planner.set_workers(all.clone());
        let r = replicas as usize;
        for op in &ops {
            match op {
                Op::Workers(mask) => planner.set_workers(
                    all.iter().filter(|w| mask & (1 << (w.worker_id - 1)) != 0).cloned().collect(),
                ),
                Op::Answer(pick, outcomes) => world.answer(&mut planner, *pick, Some(outcomes), now),
                Op::Lost(pick) => world.answer(&mut planner, *pick, None, now),
                Op::Tick(ms) => now += Duration::from_millis(*ms),
                Op::Feed(n) => feed(&mut planner, *n),
            }
            prop_assert!(planner.held() <= LIMITS.files_held, "{} files held", planner.held());
            world.send(&mut planner, now, r);
            world.collect(&mut planner);
        }
        // A healthy cluster from here on: the job must settle.
        planner.set_workers(all);
        let mut steps = 0;
        while !planner.settled() {
            steps += 1;
            prop_assert!(steps < 10_000, "the job never settles");
            feed(&mut planner, 1);
            prop_assert!(planner.held() <= LIMITS.files_held, "{} files held", planner.held());
            world.send(&mut planner, now, r);
            if world.in_flight.is_empty() {
                now += Duration::from_secs(70);
            } else {
                world.answer(&mut planner, 0, Some(&[Outcome::Loaded]), now);
            }
            world.collect(&mut planner);
        }
        // What settled without a task (empty files, files a load refuses) is reported too.
        world.collect(&mut planner);
        prop_assert!(world.in_flight.is_empty());
        for (f, _) in &expected {
            let settled = world.done.contains_key(&f.id) as u8 + world.failed.contains_key(&f.id) as u8;
            prop_assert_eq!(settled, 1, "file {} reported {} times", f.id, settled);
            if world.done.contains_key(&f.id) {
                prop_assert_eq!(world.done[&f.id], f.length);
                prop_assert!(f.length == 0 || f.mount_id.is_some(), "file {} done outside a store", f.id);
                for index in 0..f.length.div_ceil(BLOCK) as u32 {
                    let on = world.loaded.get(&(f.id, index)).cloned().unwrap_or_default();
                    prop_assert_eq!(on.len(), r, "file {} block {} on {:?}", f.id, index, on);
                }
            }
        }
        for id in world.done.keys().chain(world.failed.keys()) {
            prop_assert!(!skip.contains(id), "{} was skipped", id);
        }
    }
}
