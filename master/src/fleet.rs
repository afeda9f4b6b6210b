//! The fleet: what the leader knows of its workers — who is registered and live
//! ([`WorkerRegistry`]) and which blocks each holds ([`BlockLocations`]) — as one handle.
//! Soft state, rebuilt each term from registrations and heartbeats; nothing here goes
//! through Raft (decommissions do, and are passed in where they matter).

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use granary_proto as pb;

use crate::blocks::{BlockLocations, TooManyWorkers};
use crate::workers::{WorkerEntry, WorkerRegistry};

pub struct Fleet {
    workers: WorkerRegistry,
    blocks: Arc<BlockLocations>,
    heartbeat_interval: Duration,
}

impl Fleet {
    /// `blocks` is shared with the namespace, which marks versions stale as files change.
    pub fn new(
        blocks: Arc<BlockLocations>,
        worker_timeout: Duration,
        heartbeat_interval: Duration,
    ) -> Self {
        Fleet {
            workers: WorkerRegistry::new(worker_timeout),
            blocks,
            heartbeat_interval,
        }
    }

    /// How often workers are told to heartbeat.
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval
    }

    /// How long a silent worker stays live.
    pub fn worker_timeout(&self) -> Duration {
        self.workers.timeout
    }

    /// How long this master has led with the registry it holds now.
    pub fn term_age(&self) -> Duration {
        self.workers.term_age()
    }

    /// Three heartbeats into the term: every live worker has registered again, so what the
    /// registry lacks is really absent.
    pub fn settled(&self) -> bool {
        self.term_age() >= self.heartbeat_interval * 3
    }

    /// Starts over for a new leader term (see [`WorkerRegistry::begin_term`]); true when
    /// what was known was dropped.
    pub fn begin_term(&self, term: u64) -> bool {
        if self.workers.begin_term(term) {
            self.blocks.clear();
            return true;
        }
        false
    }

    /// A worker (re)registers with a full report of the blocks it holds.
    pub fn register(&self, r: pb::RegisterWorkerRequest) -> Result<(), TooManyWorkers> {
        self.blocks.replace_worker(r.worker_id, &r.blocks)?;
        self.workers
            .register(r.worker_id, r.address, r.host, r.stats.unwrap_or_default());
        self.workers.set_data_address(r.worker_id, r.data_address);
        Ok(())
    }

    /// A heartbeat with the blocks added and removed since the last one. `None`: the worker
    /// is not known (this term) and must register again; else the files whose versions it
    /// should drop (`keep_version` 0: every version, as a free asks).
    pub fn heartbeat(
        &self,
        worker: u64,
        stats: Option<pb::WorkerStats>,
        added: &[pb::BlockId],
        removed: &[pb::BlockId],
    ) -> Option<Vec<pb::StaleFile>> {
        if !self.workers.heartbeat(worker, stats) {
            return None;
        }
        self.blocks.update(worker, added, removed);
        let stale = self.blocks.stale_for(worker).into_iter();
        let freed = self.blocks.take_freed(worker).into_iter();
        Some(
            stale
                .map(|(inode, keep_version)| pb::StaleFile {
                    inode,
                    keep_version,
                })
                .chain(freed.map(|inode| pb::StaleFile {
                    inode,
                    keep_version: 0,
                }))
                .collect(),
        )
    }

    /// Blocks a worker said it loaded (a load task's answer), known before its next
    /// heartbeat reports them.
    pub fn record_loaded(&self, worker: u64, blocks: &[pb::BlockId]) {
        if !blocks.is_empty() {
            self.blocks.update(worker, blocks, &[]);
        }
    }

    /// Versions of `inode` other than `keep` (0: all) are stale: workers drop them.
    pub fn note_stale(&self, inode: u64, keep: u64) {
        self.blocks.note_stale(inode, keep);
    }

    /// Asks every worker holding a block of `inodes` to drop it; (files, workers) touched.
    pub fn free(&self, inodes: &HashSet<u64>) -> (usize, usize) {
        self.blocks.free(inodes)
    }

    /// The files worker `worker` holds a block of.
    pub fn inodes_of(&self, worker: u64) -> HashSet<u64> {
        self.blocks.inodes_of(worker)
    }

    /// Declares workers silent past the timeout lost and forgets their blocks; true when
    /// one was.
    pub fn expire_silent(&self) -> bool {
        let lost = self.workers.expire();
        for &id in &lost {
            tracing::warn!(
                worker = id,
                "worker lost (no heartbeat); dropping its block locations"
            );
            self.blocks.drop_worker(id);
        }
        !lost.is_empty()
    }

    /// How many workers this term knows (what workers are told, to decide whether they are
    /// alone).
    pub fn known(&self) -> u32 {
        self.workers.known(self.heartbeat_interval * 3)
    }

    pub fn get(&self, id: u64) -> Option<WorkerEntry> {
        self.workers.get(id)
    }

    pub fn is_live(&self, w: &WorkerEntry) -> bool {
        self.workers.is_live(w)
    }

    /// Worker `id` is registered and live.
    pub fn is_live_id(&self, id: u64) -> bool {
        self.get(id).is_some_and(|w| self.is_live(&w))
    }

    /// Every registered worker, live or not.
    pub fn all(&self) -> Vec<WorkerEntry> {
        self.workers.all()
    }

    /// The workers as `report` shows them, `decommissioned` by the replicated state.
    pub fn infos(&self, decommissioned: &BTreeSet<u64>) -> Vec<pb::WorkerInfo> {
        self.all()
            .into_iter()
            .map(|w| {
                let state = self.workers.state_of(&w, decommissioned.contains(&w.id));
                pb::WorkerInfo {
                    worker_id: w.id,
                    state: state.text().to_string(),
                    state_code: state as i32,
                    last_heartbeat_ms_ago: w.last_heartbeat.elapsed().as_millis() as u64,
                    block_count: self.blocks.block_count(w.id),
                    address: w.address,
                    host: w.host,
                    stats: Some(w.stats),
                    data_address: w.data_address,
                }
            })
            .collect()
    }

    /// The workers new blocks go to, as clients see them (same order and weights): live
    /// and not `decommissioned`.
    pub fn placement_targets(&self, decommissioned: &BTreeSet<u64>) -> Vec<pb::WorkerInfo> {
        let live = pb::WorkerState::Live as i32;
        self.infos(decommissioned)
            .into_iter()
            .filter(|w| w.state_code == live)
            .collect()
    }

    /// The live workers holding block `b`.
    pub fn holders_of(&self, b: &pb::BlockId) -> Vec<pb::WorkerAddress> {
        self.blocks
            .workers_of(b)
            .into_iter()
            .filter_map(|id| self.workers.get(id))
            .filter(|w| self.workers.is_live(w))
            .map(|w| pb::WorkerAddress {
                worker_id: w.id,
                address: w.address,
                host: w.host,
            })
            .collect()
    }
}
