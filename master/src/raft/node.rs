//! The Raft node: one raft-rs `RawNode` driven by a dedicated thread in the canonical
//! ready-loop order (send, apply committed, persist entries + hard state, send persisted
//! messages, advance, persist commit, apply light-ready commits, advance apply).
//!
//! RocksDB writes are blocking and synced; doing them on a plain thread keeps them off the
//! tokio runtime. Proposers talk to the thread through a channel and await a oneshot that
//! resolves when their command has been applied.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use raft::eraftpb::{Entry, EntryType, Message};
use raft::{RawNode, StateRole};
use tokio::sync::oneshot;

use super::storage::RocksLogStorage;
use crate::error::MasterError;
use crate::state::{ApplyOutput, Command, StateMachine};

/// Raft tick period; election timeout is 10 ticks.
pub const TICK: Duration = Duration::from_millis(100);

type Reply = oneshot::Sender<Result<ApplyOutput, MasterError>>;

enum Msg {
    Propose { data: Vec<u8>, reply: Reply },
    Shutdown,
}

/// Observable Raft status, updated by the node thread.
#[derive(Debug, Default)]
pub struct RaftStatus {
    pub term: AtomicU64,
    pub commit: AtomicU64,
    pub applied: AtomicU64,
    pub leader_id: AtomicU64,
    /// 0 follower, 1 candidate, 2 leader, 3 pre-candidate.
    pub role: AtomicU64,
}

impl RaftStatus {
    pub fn role_name(&self) -> &'static str {
        match self.role.load(Ordering::Relaxed) {
            2 => "leader",
            1 => "candidate",
            3 => "pre-candidate",
            _ => "follower",
        }
    }
    pub fn is_leader(&self) -> bool {
        self.role.load(Ordering::Relaxed) == 2
    }
}

/// Handle to the node thread.
#[derive(Clone)]
pub struct RaftHandle {
    tx: mpsc::Sender<Msg>,
    pub status: Arc<RaftStatus>,
}

impl RaftHandle {
    /// Proposes `cmd` and waits until it is applied (or rejected).
    pub async fn propose(&self, cmd: &Command) -> Result<ApplyOutput, MasterError> {
        let data = serde_json::to_vec(cmd)
            .map_err(|e| MasterError::corrupt(format!("encoding command: {e}")))?;
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Msg::Propose { data, reply })
            .map_err(|_| MasterError::ShuttingDown)?;
        rx.await.map_err(|_| MasterError::ShuttingDown)?
    }

    pub fn shutdown(&self) {
        let _ = self.tx.send(Msg::Shutdown);
    }
}

/// Starts the node thread for a single-voter group with id `id`.
pub fn start(
    id: u64,
    storage: RocksLogStorage,
    sm: StateMachine,
) -> Result<(RaftHandle, std::thread::JoinHandle<()>), MasterError> {
    let applied = sm.applied_index()?;
    storage.validate(applied)?;
    let config = raft::Config {
        id,
        election_tick: 10,
        heartbeat_tick: 2,
        applied,
        max_size_per_msg: 4 * 1024 * 1024,
        max_inflight_msgs: 256,
        check_quorum: true,
        pre_vote: true,
        ..Default::default()
    };
    config
        .validate()
        .map_err(|e| MasterError::corrupt(format!("raft config: {e}")))?;
    let mut node = RawNode::new(&config, storage.clone(), &super::logger::logger())
        .map_err(|e| MasterError::corrupt(format!("starting raft: {e}")))?;
    let voters = storage.conf_state()?.voters;
    if voters == [id] {
        // Sole voter: no need to wait out an election timeout.
        node.campaign()
            .map_err(|e| MasterError::corrupt(format!("campaign: {e}")))?;
    }
    let status = Arc::new(RaftStatus::default());
    status.applied.store(applied, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel();
    let mut driver = Driver {
        node,
        storage,
        sm,
        status: status.clone(),
        pending: HashMap::new(),
        nonce: rand_nonce(),
        next_seq: 1,
    };
    driver.publish_status();
    let join = std::thread::Builder::new()
        .name("granary-raft".into())
        .spawn(move || driver.run(rx))
        .map_err(|e| MasterError::Storage {
            message: format!("spawning the raft thread: {e}"),
        })?;
    Ok((RaftHandle { tx, status }, join))
}

fn rand_nonce() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    granary_common::ids::stable_hash(&[&t.to_le_bytes(), &std::process::id().to_le_bytes()])
}

struct Driver {
    node: RawNode<RocksLogStorage>,
    storage: RocksLogStorage,
    sm: StateMachine,
    status: Arc<RaftStatus>,
    /// Proposals awaiting apply, keyed by (process nonce, sequence) carried as entry context,
    /// so entries re-delivered after a restart never match a new proposal.
    pending: HashMap<(u64, u64), Reply>,
    nonce: u64,
    next_seq: u64,
}

impl Driver {
    fn run(&mut self, rx: mpsc::Receiver<Msg>) {
        let mut last_tick = Instant::now();
        loop {
            let wait = TICK.saturating_sub(last_tick.elapsed());
            match rx.recv_timeout(wait) {
                Ok(Msg::Propose { data, reply }) => self.propose(data, reply),
                Ok(Msg::Shutdown) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            if last_tick.elapsed() >= TICK {
                self.node.tick();
                last_tick = Instant::now();
            }
            if let Err(e) = self.on_ready() {
                // Storage failed: stop serving rather than risk acknowledging lost writes.
                tracing::error!(error = %e, "raft storage failure; the master stops applying");
                for (_, reply) in self.pending.drain() {
                    let _ = reply.send(Err(e.clone()));
                }
                break;
            }
            self.publish_status();
        }
        for (_, reply) in self.pending.drain() {
            let _ = reply.send(Err(MasterError::ShuttingDown));
        }
    }

    fn propose(&mut self, data: Vec<u8>, reply: Reply) {
        if self.node.raft.state != StateRole::Leader {
            let _ = reply.send(Err(MasterError::NotLeader { leader_hint: None }));
            return;
        }
        let key = (self.nonce, self.next_seq);
        self.next_seq += 1;
        let mut ctx = Vec::with_capacity(16);
        ctx.extend_from_slice(&key.0.to_be_bytes());
        ctx.extend_from_slice(&key.1.to_be_bytes());
        match self.node.propose(ctx, data) {
            Ok(()) => {
                self.pending.insert(key, reply);
            }
            Err(e) => {
                let _ = reply.send(Err(MasterError::Unavailable {
                    message: format!("proposal dropped: {e}"),
                }));
            }
        }
    }

    fn publish_status(&self) {
        let r = &self.node.raft;
        self.status.term.store(r.term, Ordering::Relaxed);
        self.status
            .commit
            .store(r.raft_log.committed, Ordering::Relaxed);
        self.status.leader_id.store(r.leader_id, Ordering::Relaxed);
        let role = match r.state {
            StateRole::Follower => 0,
            StateRole::Candidate => 1,
            StateRole::Leader => 2,
            StateRole::PreCandidate => 3,
        };
        self.status.role.store(role, Ordering::Relaxed);
    }

    fn send(&self, _msgs: Vec<Message>) {
        // Single-voter group: there is nobody to send to. The multi-master transport plugs in
        // here.
    }

    fn on_ready(&mut self) -> Result<(), MasterError> {
        if !self.node.has_ready() {
            return Ok(());
        }
        let mut ready = self.node.ready();
        self.send(ready.take_messages());
        if !ready.snapshot().is_empty() {
            return Err(MasterError::corrupt(
                "received a snapshot, which a single-voter group never sends",
            ));
        }
        self.apply(ready.take_committed_entries())?;
        self.storage.persist(ready.entries(), ready.hs())?;
        self.send(ready.take_persisted_messages());
        let mut light = self.node.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.storage.persist_commit(commit)?;
        }
        self.send(light.take_messages());
        self.apply(light.take_committed_entries())?;
        self.node.advance_apply();
        Ok(())
    }

    fn apply(&mut self, entries: Vec<Entry>) -> Result<(), MasterError> {
        for entry in entries {
            let index = entry.index;
            if entry.get_entry_type() != EntryType::EntryNormal || entry.data.is_empty() {
                self.sm.mark_applied(index)?;
            } else {
                let result = match serde_json::from_slice::<Command>(&entry.data) {
                    Ok(cmd) => self.sm.apply(index, &cmd),
                    Err(e) => {
                        // A command this version cannot decode: record it applied (so the
                        // log moves on) and surface the problem loudly.
                        tracing::error!(index, error = %e, "undecodable raft command skipped");
                        self.sm.mark_applied(index)?;
                        Err(MasterError::corrupt(format!("undecodable command: {e}")))
                    }
                };
                // Storage failures while applying are fatal; command errors are results.
                if let Err(MasterError::Storage { .. }) = &result {
                    return result.map(|_| ());
                }
                if entry.context.len() == 16 {
                    let nonce =
                        u64::from_be_bytes(entry.context[..8].try_into().unwrap_or_default());
                    let seq = u64::from_be_bytes(entry.context[8..].try_into().unwrap_or_default());
                    if let Some(reply) = self.pending.remove(&(nonce, seq)) {
                        let _ = reply.send(result);
                    }
                }
            }
            self.status.applied.store(index, Ordering::Relaxed);
        }
        Ok(())
    }
}
