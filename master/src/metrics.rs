//! Master metrics (`granary_master_*`), refreshed by the housekeeping loop.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use granary_common::metrics::SharedRegistry;
use prometheus_client::metrics::gauge::Gauge;

use crate::core::MasterCore;

#[derive(Clone, Default)]
pub struct MasterMetrics {
    inodes: Gauge<i64, AtomicI64>,
    mounts: Gauge<i64, AtomicI64>,
    workers_live: Gauge<i64, AtomicI64>,
    workers_lost: Gauge<i64, AtomicI64>,
    raft_term: Gauge<i64, AtomicI64>,
    raft_commit: Gauge<i64, AtomicI64>,
    raft_applied: Gauge<i64, AtomicI64>,
    raft_is_leader: Gauge<i64, AtomicI64>,
    raft_leader_id: Gauge<i64, AtomicI64>,
    raft_last_index: Gauge<i64, AtomicI64>,
    raft_snapshot_index: Gauge<i64, AtomicI64>,
    raft_voters: Gauge<i64, AtomicI64>,
    raft_log_syncs: Gauge<i64, AtomicI64>,
    raft_voters_answering: Gauge<i64, AtomicI64>,
}

impl MasterMetrics {
    pub fn register(registry: &SharedRegistry) -> Self {
        let m = Self::default();
        if let Ok(mut r) = registry.lock() {
            r.register(
                "granary_master_inodes",
                "Inodes in the namespace",
                m.inodes.clone(),
            );
            r.register(
                "granary_master_mounts",
                "Mounted under-stores",
                m.mounts.clone(),
            );
            r.register(
                "granary_master_workers_live",
                "Workers heartbeating",
                m.workers_live.clone(),
            );
            r.register(
                "granary_master_workers_lost",
                "Workers that stopped heartbeating",
                m.workers_lost.clone(),
            );
            r.register(
                "granary_master_raft_term",
                "Current Raft term",
                m.raft_term.clone(),
            );
            r.register(
                "granary_master_raft_commit_index",
                "Raft commit index",
                m.raft_commit.clone(),
            );
            r.register(
                "granary_master_raft_applied_index",
                "Raft applied index",
                m.raft_applied.clone(),
            );
            r.register(
                "granary_master_raft_is_leader",
                "1 when this master leads",
                m.raft_is_leader.clone(),
            );
            r.register(
                "granary_master_raft_leader_id",
                "Id of the master this one follows (0 when no leader is known)",
                m.raft_leader_id.clone(),
            );
            r.register(
                "granary_master_raft_last_index",
                "Index of the last entry in this master's Raft log",
                m.raft_last_index.clone(),
            );
            r.register(
                "granary_master_raft_snapshot_index",
                "Applied index of this master's newest state snapshot (the log is compacted behind it)",
                m.raft_snapshot_index.clone(),
            );
            r.register(
                "granary_master_raft_voters",
                "Voting members in the current configuration",
                m.raft_voters.clone(),
            );
            r.register(
                "granary_master_raft_log_syncs",
                "Synced writes of this master's Raft log since it started (new entries, a new term or vote; a round of the Raft loop makes at most one)",
                m.raft_log_syncs.clone(),
            );
            r.register(
                "granary_master_raft_voters_answering",
                "On the leader: voting members heard from within the last 2 s, itself included (0 on followers); a removal that would leave fewer than a majority answering is refused",
                m.raft_voters_answering.clone(),
            );
        }
        m
    }

    pub fn refresh(&self, core: &MasterCore) {
        if let Ok(n) = core.namespace().sm.inode_count() {
            self.inodes.set(n as i64);
        }
        if let Ok(m) = core.namespace().sm.mounts() {
            self.mounts.set(m.len() as i64);
        }
        let all = core.fleet().all();
        let live = all.iter().filter(|w| core.fleet().is_live(w)).count() as i64;
        self.workers_live.set(live);
        self.workers_lost.set(all.len() as i64 - live);
        let s = &core.raft().status;
        self.raft_term.set(s.term.load(Relaxed) as i64);
        self.raft_commit.set(s.commit.load(Relaxed) as i64);
        self.raft_applied.set(s.applied.load(Relaxed) as i64);
        self.raft_is_leader.set(i64::from(s.is_leader()));
        self.raft_leader_id.set(s.leader_id.load(Relaxed) as i64);
        self.raft_last_index.set(s.last_index.load(Relaxed) as i64);
        self.raft_snapshot_index
            .set(s.snapshot_index.load(Relaxed) as i64);
        self.raft_voters.set(s.voters().len() as i64);
        self.raft_log_syncs.set(s.log_syncs.load(Relaxed) as i64);
        self.raft_voters_answering
            .set(s.answering.load(Relaxed) as i64);
    }
}
