//! Worker membership: soft state kept by the leader from registrations and heartbeats.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use granary_proto as pb;

#[derive(Debug, Clone)]
pub struct WorkerEntry {
    pub id: u64,
    pub address: String,
    pub host: String,
    pub stats: pb::WorkerStats,
    /// The worker's block data plane, if it serves one (see `pb::WorkerInfo`).
    pub data_address: String,
    pub last_heartbeat: Instant,
    /// Marked lost by the expiry sweep; its block locations were dropped.
    pub lost: bool,
}

pub struct WorkerRegistry {
    workers: Mutex<HashMap<u64, WorkerEntry>>,
    /// The leader term this registry was built in, and since when.
    term: Mutex<u64>,
    term_started: Mutex<Instant>,
    /// A worker silent for this long is lost: not offered to clients, its blocks forgotten.
    pub timeout: Duration,
}

impl WorkerRegistry {
    pub fn new(timeout: Duration) -> Self {
        Self {
            workers: Mutex::new(HashMap::new()),
            term: Mutex::new(0),
            term_started: Mutex::new(Instant::now()),
            timeout,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, WorkerEntry>> {
        match self.workers.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Starts over when this master leads a new term: what it knew from an earlier term
    /// may be stale, so every worker must re-register with a full report. True when the
    /// registry was cleared (the caller clears block locations too).
    pub fn begin_term(&self, term: u64) -> bool {
        let mut t = match self.term.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if *t == term {
            return false;
        }
        *t = term;
        self.lock().clear();
        match self.term_started.lock() {
            Ok(mut g) => *g = Instant::now(),
            Err(p) => *p.into_inner() = Instant::now(),
        }
        true
    }

    /// How long this registry has been rebuilt for the current term (workers re-register
    /// within a heartbeat or two of a new leader).
    pub fn term_age(&self) -> Duration {
        match self.term_started.lock() {
            Ok(g) => g.elapsed(),
            Err(p) => p.into_inner().elapsed(),
        }
    }

    pub fn register(&self, id: u64, address: String, host: String, stats: pb::WorkerStats) {
        self.lock().insert(
            id,
            WorkerEntry {
                id,
                address,
                host,
                stats,
                data_address: String::new(),
                last_heartbeat: Instant::now(),
                lost: false,
            },
        );
    }

    /// Records where worker `id` serves its block data plane (empty: nowhere).
    pub fn set_data_address(&self, id: u64, data_address: String) {
        if let Some(w) = self.lock().get_mut(&id) {
            w.data_address = data_address;
        }
    }

    /// The state clients see: live, draining (decommissioned, per the replicated state)
    /// or lost.
    pub fn state_of(&self, w: &WorkerEntry, decommissioned: bool) -> pb::WorkerState {
        match (self.is_live(w), decommissioned) {
            (true, false) => pb::WorkerState::Live,
            (true, true) => pb::WorkerState::Draining,
            (false, _) => pb::WorkerState::Lost,
        }
    }

    /// Records a heartbeat; false when the worker is unknown or was declared lost (it must
    /// re-register with a full block report).
    pub fn heartbeat(&self, id: u64, stats: Option<pb::WorkerStats>) -> bool {
        match self.lock().get_mut(&id) {
            Some(w) if !w.lost => {
                w.last_heartbeat = Instant::now();
                if let Some(s) = stats {
                    w.stats = s;
                }
                true
            }
            _ => false,
        }
    }

    pub fn is_live(&self, w: &WorkerEntry) -> bool {
        !w.lost && w.last_heartbeat.elapsed() < self.timeout
    }

    /// How many workers this leader knows (live or not), or 0 while its term is younger than
    /// `settle` (workers of the last leader may not have registered again yet).
    pub fn known(&self, settle: Duration) -> u32 {
        if self.term_age() < settle {
            return 0;
        }
        u32::try_from(self.lock().len()).unwrap_or(u32::MAX)
    }

    pub fn all(&self) -> Vec<WorkerEntry> {
        let mut v: Vec<WorkerEntry> = self.lock().values().cloned().collect();
        v.sort_by_key(|w| w.id);
        v
    }

    pub fn get(&self, id: u64) -> Option<WorkerEntry> {
        self.lock().get(&id).cloned()
    }

    /// Marks workers silent for longer than the timeout as lost; returns the newly lost ids.
    pub fn expire(&self) -> Vec<u64> {
        let mut map = self.lock();
        let mut lost = Vec::new();
        for w in map.values_mut() {
            if !w.lost && w.last_heartbeat.elapsed() >= self.timeout {
                w.lost = true;
                lost.push(w.id);
            }
        }
        lost
    }
}
