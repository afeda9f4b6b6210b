//! The leader's view of what is pinned: the pinned files (every file at or below a pin),
//! recomputed from the replicated pins every few seconds, with a generation the workers
//! compare in their heartbeats to learn a new set. Pinning a path also loads it (a load
//! job with the pin's replicas); when a worker is lost, the pins are loaded again, which
//! brings each pinned block back to its replica count on the workers left.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::core::MasterCore;
use crate::error::MasterError;
use crate::state::jobs::JobState;
use crate::state::{ApplyOutput, Command, Kind};

/// How often the pinned files are recomputed (new files in pinned folders are pinned
/// within this long of being listed).
const REFRESH_EVERY: Duration = Duration::from_secs(3);

#[derive(Default)]
pub struct PinSet {
    inner: Mutex<Inner>,
    /// The term whose pins were loaded again once its workers had re-registered.
    reloaded_term: Mutex<u64>,
}

#[derive(Default)]
struct Inner {
    generation: u64,
    inodes: Arc<HashSet<u64>>,
    refreshed: Option<Instant>,
    /// The term the generation counts in (a new leader starts a new series).
    term: u64,
    /// The Raft index applied when the set was computed: every change of the namespace or
    /// of the pins is an applied entry, so while it stands still the set does too.
    applied: u64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl PinSet {
    /// What a worker at `generation` must be told: `Some((generation, set))` when its set
    /// is out of date.
    pub fn update_for(&self, generation: u64) -> Option<(u64, Arc<HashSet<u64>>)> {
        let g = lock(&self.inner);
        (g.refreshed.is_some() && g.generation != generation)
            .then(|| (g.generation, g.inodes.clone()))
    }

    pub fn contains(&self, inode: u64) -> bool {
        lock(&self.inner).inodes.contains(&inode)
    }
}

impl MasterCore {
    /// Recomputes the pinned files when due (leader only; every tick).
    pub fn refresh_pins(&self) {
        if !self.raft.status.is_leader() {
            return;
        }
        let term = self
            .raft
            .status
            .term
            .load(std::sync::atomic::Ordering::Relaxed);
        // Read before the walk: a change applied during it makes the next refresh walk again.
        let applied = self
            .raft
            .status
            .applied
            .load(std::sync::atomic::Ordering::Relaxed);
        {
            let g = lock(&self.pins.inner);
            // A walk reads every file under every pin (a pinned dataset of a million files:
            // seconds of reads), so it is not repeated while nothing was applied.
            if g.term == term
                && g.refreshed
                    .is_some_and(|t| t.elapsed() < REFRESH_EVERY || g.applied == applied)
            {
                return;
            }
        }
        let set = match self.pinned_files() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot compute the pinned files");
                return;
            }
        };
        let mut g = lock(&self.pins.inner);
        if g.term != term {
            g.term = term;
            g.generation = term << 32;
        }
        if g.refreshed.is_none() || *g.inodes != set {
            g.generation += 1;
            g.inodes = Arc::new(set);
        }
        g.refreshed = Some(Instant::now());
        g.applied = applied;
    }

    /// Every file at or below a pin (as far as the namespace is listed).
    fn pinned_files(&self) -> Result<HashSet<u64>, MasterError> {
        let mut out = HashSet::new();
        self.for_each_pinned_file(|_, _, f| {
            out.insert(f.id);
            true
        })?;
        Ok(out)
    }

    /// Calls `f(pin's inode, pin, file)` for every file at or below every pin; a pin's
    /// remaining files are skipped once `f` returns false for one of them.
    fn for_each_pinned_file(
        &self,
        mut f: impl FnMut(u64, &crate::state::pins::Pin, &crate::state::Inode) -> bool,
    ) -> Result<(), MasterError> {
        for (inode, pin) in self.ns.sm.pins()? {
            let Some(node) = self.ns.sm.inode(inode)? else {
                continue;
            };
            for entry in self.ns.sm.walk(node, String::new()) {
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
        self.ns.resolve(&path).await?;
        let cmd = Command::SetPin {
            path: path.clone(),
            replicas,
        };
        match self.propose_request(cmd, request_id).await? {
            ApplyOutput::Inode(_) => {}
            _ => return Err(MasterError::corrupt("unexpected result of SetPin")),
        }
        // The workers learn the new set at their next heartbeat.
        lock(&self.pins.inner).refreshed = None;
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
        if !self.raft.status.is_leader() || self.workers.term_age() < self.workers.timeout {
            return;
        }
        let term = self
            .raft
            .status
            .term
            .load(std::sync::atomic::Ordering::Relaxed);
        {
            let mut reloaded = lock(&self.pins.reloaded_term);
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
                self.holders_of(&id).len() < pin.replicas as usize
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
            let (Ok(pins), Ok(jobs)) = (core.ns.sm.pins(), core.ns.sm.jobs()) else {
                return;
            };
            for (inode, pin) in pins {
                if only.as_ref().is_some_and(|o| !o.contains(&inode)) {
                    continue;
                }
                let Ok(Some(node)) = core.ns.sm.inode(inode) else {
                    continue;
                };
                let Ok(path) = core.ns.sm.path_of(&node) else {
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

/// The pin fields of a heartbeat answer for a worker at `generation`.
pub fn heartbeat_pins(core: &MasterCore, generation: u64) -> (bool, Vec<u64>, u64) {
    match core.pins.update_for(generation) {
        Some((g, set)) => (true, set.iter().copied().collect(), g),
        None => (false, Vec::new(), generation),
    }
}
