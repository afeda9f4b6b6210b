//! The leader's view of what is pinned, and what it tells each worker. A worker is told
//! the pinned files *it holds blocks of* (never the whole pinned namespace: a pinned corpus
//! of ten million files would not fit a heartbeat, nor belong in the leader's heap): in
//! full when what is pinned changed (a pin set or removed, or a rename that may have
//! moved files into or out of a pinned folder), else as the files newly pinned among the
//! blocks it just reported. A load task names the pinned files among its blocks, so a
//! worker holds a pinned block from the moment it caches it. Pinning a path also loads it
//! (a load job with the pin's replicas); when a worker is lost, the pins are loaded again,
//! which brings each pinned block back to its replica count on the workers left.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::core::MasterCore;
use crate::error::MasterError;
use crate::state::jobs::JobState;
use crate::state::walk::MAX_DEPTH;
use crate::state::{ApplyOutput, Command, Kind, StateMachine};

/// How often the pins are read again while entries are applied.
const REFRESH_EVERY: Duration = Duration::from_secs(3);

#[derive(Default)]
pub struct PinSet {
    inner: Mutex<Inner>,
    /// The term whose pins were loaded again once its workers had re-registered.
    reloaded_term: Mutex<u64>,
}

#[derive(Default)]
struct Inner {
    /// The inodes pinned (files, or folders: everything below them).
    roots: Arc<HashSet<u64>>,
    /// Counts changes of what is pinned: a worker told at an older epoch gets its set
    /// computed again.
    epoch: u64,
    refreshed: Option<Instant>,
    /// The state's count of moves (renames) when the pins were read.
    moves: u64,
    /// The term the generations count in (a new leader starts a new series).
    term: u64,
    /// The Raft index applied when the pins were read: every change of the namespace or
    /// of the pins is an applied entry, so while it stands still they do too.
    applied: u64,
    /// What each worker was told.
    told: HashMap<u64, Told>,
}

/// The pinned files a worker was told of.
struct Told {
    epoch: u64,
    generation: u64,
    set: HashSet<u64>,
}

impl Told {
    /// Brings what the worker was told up to date — its whole set computed again from the
    /// files it holds (`held`) when what is pinned changed since (`epoch`), else the pinned
    /// files among `added` (files it just reported blocks of) added — and answers a worker
    /// holding `generation`: nothing when it is current, the additions when it holds the
    /// set they follow and takes them (`deltas`), else its whole set.
    fn answer(
        &mut self,
        epoch: u64,
        generation: u64,
        deltas: bool,
        held: impl FnOnce() -> HashSet<u64>,
        added: impl Iterator<Item = u64>,
        mut pinned: impl FnMut(u64) -> bool,
    ) -> PinsAnswer {
        let before = self.generation;
        let recomputed = self.epoch != epoch;
        let mut new = Vec::new();
        if recomputed {
            let set: HashSet<u64> = held().into_iter().filter(|&i| pinned(i)).collect();
            self.epoch = epoch;
            if set != self.set {
                self.set = set;
                self.generation += 1;
            }
        } else {
            for inode in added {
                if !self.set.contains(&inode) && pinned(inode) {
                    self.set.insert(inode);
                    new.push(inode);
                }
            }
            if !new.is_empty() {
                self.generation += 1;
            }
        }
        if generation == self.generation {
            PinsAnswer {
                generation,
                ..PinsAnswer::default()
            }
        } else if deltas && !recomputed && generation == before {
            PinsAnswer {
                added: new,
                generation: self.generation,
                ..PinsAnswer::default()
            }
        } else {
            let mut set: Vec<u64> = self.set.iter().copied().collect();
            set.sort_unstable();
            PinsAnswer {
                full: true,
                set,
                generation: self.generation,
                ..PinsAnswer::default()
            }
        }
    }
}

/// The pin fields of a heartbeat answer.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PinsAnswer {
    /// `set` is the worker's whole pinned set.
    pub full: bool,
    pub set: Vec<u64>,
    /// Files to add to the worker's set (when not `full`).
    pub added: Vec<u64>,
    pub generation: u64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Which inodes are pinned: an inode is when it or a folder above it is a pin root.
/// Answers are remembered per inode on the way up, so checking every file of a folder
/// reads the folder's ancestors once.
struct Pinned<'a> {
    sm: &'a StateMachine,
    roots: &'a HashSet<u64>,
    known: HashMap<u64, bool>,
}

impl<'a> Pinned<'a> {
    fn new(sm: &'a StateMachine, roots: &'a HashSet<u64>) -> Self {
        Pinned {
            sm,
            roots,
            known: HashMap::new(),
        }
    }

    fn check(&mut self, inode: u64) -> bool {
        if self.roots.is_empty() {
            return false;
        }
        let mut chain = Vec::new();
        let mut id = inode;
        let answer = loop {
            if self.roots.contains(&id) {
                break true;
            }
            if let Some(&known) = self.known.get(&id) {
                break known;
            }
            chain.push(id);
            if chain.len() > MAX_DEPTH {
                break false; // a looping parent chain (a damaged state) pins nothing
            }
            match self.sm.inode(id) {
                Ok(Some(node)) if node.parent != id && id != crate::state::ROOT_INODE => {
                    id = node.parent
                }
                // The root, a removed inode, or a failed read: not pinned (a failed read
                // is checked again when what is pinned next changes).
                _ => break false,
            }
        };
        for id in chain {
            self.known.insert(id, answer);
        }
        answer
    }
}

impl MasterCore {
    /// Reads the pins again when due (leader only; every tick).
    pub fn refresh_pins(&self) {
        if !self.is_leader() {
            return;
        }
        let term = self
            .raft()
            .status
            .term
            .load(std::sync::atomic::Ordering::Relaxed);
        let applied = self
            .raft()
            .status
            .applied
            .load(std::sync::atomic::Ordering::Relaxed);
        {
            let g = lock(&self.pin_set().inner);
            if g.term == term
                && g.refreshed
                    .is_some_and(|t| t.elapsed() < REFRESH_EVERY || g.applied == applied)
            {
                return;
            }
        }
        let moves = self.namespace().sm.moves();
        let roots: HashSet<u64> = match self.namespace().sm.pins() {
            Ok(pins) => pins
                .into_iter()
                .filter(|(_, p)| p.replicas > 0)
                .map(|(inode, _)| inode)
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the pins");
                return;
            }
        };
        let mut g = lock(&self.pin_set().inner);
        if g.term != term {
            g.term = term;
            g.told.clear();
            g.epoch += 1;
        }
        // A pin set or removed, or a file moved (into or out of a pinned folder, maybe):
        // every worker's set is computed again. Files listed or written into a pinned
        // folder need no such round: they are pinned as a worker reports their blocks.
        if *g.roots != roots || (!roots.is_empty() && g.moves != moves) {
            g.roots = Arc::new(roots);
            g.epoch += 1;
        }
        g.moves = moves;
        g.refreshed = Some(Instant::now());
        g.applied = applied;
    }

    /// The pinned files among `inodes` (what a load task names, so that its worker holds
    /// those blocks from the moment it caches them).
    pub fn pinned_among(&self, inodes: impl IntoIterator<Item = u64>) -> Vec<u64> {
        let roots = lock(&self.pin_set().inner).roots.clone();
        let mut pinned = Pinned::new(&self.namespace().sm, &roots);
        let mut out: Vec<u64> = inodes.into_iter().filter(|&i| pinned.check(i)).collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The pin fields of a heartbeat answer for `worker`, which holds the set of
    /// `generation` and just reported `added` blocks; `deltas`: it takes additions (an
    /// older worker takes only whole sets).
    pub fn heartbeat_pins(
        &self,
        worker: u64,
        generation: u64,
        added: &[granary_proto::BlockId],
        deltas: bool,
    ) -> PinsAnswer {
        let (roots, epoch, first, mut told) = {
            let mut g = lock(&self.pin_set().inner);
            if g.refreshed.is_none() {
                return PinsAnswer {
                    generation,
                    ..PinsAnswer::default()
                };
            }
            let first = g.term << 32;
            let told = g.told.remove(&worker).unwrap_or(Told {
                epoch: g.epoch.wrapping_sub(1),
                generation: first,
                set: HashSet::new(),
            });
            (g.roots.clone(), g.epoch, first, told)
        };
        let mut pinned = Pinned::new(&self.namespace().sm, &roots);
        let answer = told.answer(
            epoch,
            generation,
            deltas,
            // Computed from what the worker holds, never from the pinned namespace (and
            // not at all while nothing is pinned).
            || match roots.is_empty() {
                true => HashSet::new(),
                false => self.fleet().inodes_of(worker),
            },
            added.iter().map(|b| b.inode),
            |i| pinned.check(i),
        );
        let mut g = lock(&self.pin_set().inner);
        if g.term << 32 == first {
            g.told.insert(worker, told);
        }
        answer
    }

    /// Calls `f(pin's inode, pin, file)` for every file at or below every pin; a pin's
    /// remaining files are skipped once `f` returns false for one of them.
    fn for_each_pinned_file(
        &self,
        mut f: impl FnMut(u64, &crate::state::pins::Pin, &crate::state::Inode) -> bool,
    ) -> Result<(), MasterError> {
        for (inode, pin) in self.namespace().sm.pins()? {
            let Some(node) = self.namespace().sm.inode(inode)? else {
                continue;
            };
            for entry in self.namespace().sm.walk(node, String::new()) {
                let (node, _) = entry?;
                if node.kind != Kind::Directory && !f(inode, &pin, &node) {
                    break;
                }
            }
        }
        Ok(())
    }

    /// `granary pin PATH --replicas N` (N = 0: unpin). Pinning starts a load job of the
    /// path with N replicas, returned.
    pub async fn set_pin(
        self: &Arc<Self>,
        path: &str,
        replicas: u32,
        request_id: u64,
    ) -> Result<Option<crate::state::jobs::Job>, MasterError> {
        if replicas > 8 {
            return Err(MasterError::invalid(format!(
                "replicas must be 1 to 8, not {replicas}"
            )));
        }
        self.ensure_leader()?;
        let path = granary_common::paths::normalize(path)?;
        self.namespace().resolve(&path).await?;
        let cmd = Command::SetPin {
            path: path.clone(),
            replicas,
        };
        match self.propose_request(cmd, request_id).await? {
            ApplyOutput::Inode(_) => {}
            _ => return Err(MasterError::corrupt("unexpected result of SetPin")),
        }
        // The workers learn the new set at their next heartbeat.
        lock(&self.pin_set().inner).refreshed = None;
        self.refresh_pins();
        if replicas == 0 {
            tracing::info!(path = %path, "unpinned");
            return Ok(None);
        }
        tracing::info!(path = %path, replicas, "pinned");
        // The load is a request of its own, derived from the pin's: a client retrying a
        // pin whose answer was lost gets the same job, not a second one.
        let load_request = match request_id {
            0 => 0,
            id => (id ^ 0x7069_6e2d_6c6f_6164).rotate_left(17).max(1),
        };
        let job = self
            .start_job(granary_proto::JobKind::Load, &path, replicas, load_request)
            .await?;
        Ok(Some(job))
    }

    /// Once per term, when the workers have had a worker timeout to re-register with this
    /// leader: loads again the pins with a block on fewer live workers than its replicas.
    /// A worker that died while leadership changed hands never registers with the new
    /// leader, so it is never declared lost and its replicas would never be replaced (the
    /// in-process test found it).
    pub fn reload_pins_once_per_term(self: &Arc<Self>) {
        if !self.is_leader() || self.fleet().term_age() < self.fleet().worker_timeout() {
            return;
        }
        let term = self
            .raft()
            .status
            .term
            .load(std::sync::atomic::Ordering::Relaxed);
        {
            let mut reloaded = lock(&self.pin_set().reloaded_term);
            if *reloaded == term {
                return;
            }
            *reloaded = term;
        }
        // A walk of every pinned file's blocks: off the housekeeping tick.
        let core = self.clone();
        tokio::task::spawn_blocking(move || match core.short_pins() {
            Ok(short) if !short.is_empty() => {
                tracing::info!(
                    term,
                    pins = short.len(),
                    "pins short of their replicas under a new leader: loading them again"
                );
                core.repin(Some(short));
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot check the pins' replicas"),
        });
    }

    /// The pins with a block of a loadable file on fewer live workers than they ask for.
    fn short_pins(&self) -> Result<HashSet<u64>, MasterError> {
        let mut short = HashSet::new();
        self.for_each_pinned_file(|inode, pin, f| {
            if f.mount_id.is_none() || !f.complete {
                return true;
            }
            let Ok((_, blocks)) = crate::jobs::plan_blocks(f, granary_common::DEFAULT_BLOCK_SIZE)
            else {
                return true;
            };
            let under = (0..blocks).any(|index| {
                let id = granary_proto::BlockId {
                    inode: f.id,
                    version: f.version,
                    index,
                };
                self.fleet().holders_of(&id).len() < pin.replicas as usize
            });
            if under {
                short.insert(inode);
            }
            !under
        })?;
        Ok(short)
    }

    /// After a worker is lost: load every pin again (unless a load of it runs already),
    /// so pinned blocks get back to their replica count on the workers left.
    pub fn repin_after_loss(self: &Arc<Self>) {
        self.repin(None);
    }

    /// Loads the pins (`only` these, by inode) again, unless a load of one runs already.
    fn repin(self: &Arc<Self>, only: Option<HashSet<u64>>) {
        let core = self.clone();
        tokio::spawn(async move {
            let (Ok(pins), Ok(jobs)) = (core.namespace().sm.pins(), core.namespace().sm.jobs())
            else {
                return;
            };
            for (inode, pin) in pins {
                if only.as_ref().is_some_and(|o| !o.contains(&inode)) {
                    continue;
                }
                let Ok(Some(node)) = core.namespace().sm.inode(inode) else {
                    continue;
                };
                let Ok(path) = core.namespace().sm.path_of(&node) else {
                    continue;
                };
                let running = jobs.iter().any(|j| {
                    j.path == path && j.replicas >= pin.replicas && j.state == JobState::Running
                });
                if running {
                    continue;
                }
                match core
                    .start_job(granary_proto::JobKind::Load, &path, pin.replicas, 0)
                    .await
                {
                    Ok(j) => {
                        tracing::info!(path = %path, job = j.id, replicas = pin.replicas, "re-replicating a pin after a worker loss")
                    }
                    Err(e) => tracing::warn!(path = %path, error = %e, "cannot re-replicate a pin"),
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn told(generation: u64) -> Told {
        Told {
            epoch: 0,
            generation,
            set: HashSet::new(),
        }
    }

    #[test]
    fn a_worker_gets_its_whole_set_once_then_only_additions_and_the_whole_set_again_after_a_loss() {
        let pinned = |i: u64| i.is_multiple_of(2);
        let held = |v: &[u64]| {
            let v = v.to_vec();
            move || v.into_iter().collect::<HashSet<u64>>()
        };
        let first = 7 << 32;
        let mut t = told(first);
        // A worker new to this leader (an older leader's generation): its whole set, of
        // the pinned files it holds.
        let a = t.answer(1, 3, true, held(&[2, 3, 4]), [].into_iter(), pinned);
        assert_eq!(
            (a.full, a.set.clone(), a.generation),
            (true, vec![2, 4], first + 1)
        );
        // Current: nothing; blocks of unpinned or known files: nothing.
        let a = t.answer(1, first + 1, true, held(&[]), [3, 4].into_iter(), pinned);
        assert_eq!(
            a,
            PinsAnswer {
                generation: first + 1,
                ..PinsAnswer::default()
            }
        );
        // A pinned file newly reported: only it.
        let a = t.answer(1, first + 1, true, held(&[]), [6, 7, 6].into_iter(), pinned);
        assert_eq!(
            (a.full, a.added.clone(), a.generation),
            (false, vec![6], first + 2)
        );
        // The answer was lost (the worker is still a generation behind) and another file
        // comes: the whole set, not an addition the worker could not place.
        let a = t.answer(1, first + 1, true, held(&[]), [8].into_iter(), pinned);
        assert_eq!(
            (a.full, a.set.clone(), a.generation),
            (true, vec![2, 4, 6, 8], first + 3)
        );
        // A worker that takes no additions gets the whole set whenever it changes.
        let a = t.answer(1, first + 3, false, held(&[]), [10].into_iter(), pinned);
        assert_eq!((a.full, a.set.len(), a.generation), (true, 5, first + 4));
        // What is pinned changed (an unpin): computed again from what the worker holds.
        let a = t.answer(2, first + 4, true, held(&[2, 5]), [].into_iter(), pinned);
        assert_eq!(
            (a.full, a.set.clone(), a.generation),
            (true, vec![2], first + 5)
        );
        // Checked again with nothing changed: no message.
        let a = t.answer(3, first + 5, true, held(&[2]), [].into_iter(), pinned);
        assert_eq!(
            a,
            PinsAnswer {
                generation: first + 5,
                ..PinsAnswer::default()
            }
        );
    }
}
