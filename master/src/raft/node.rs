//! The Raft node: one raft-rs `RawNode` driven by a dedicated thread in the canonical
//! ready-loop order (send, install snapshot, apply committed, persist entries + hard state,
//! send persisted messages, advance, persist commit, apply light-ready commits, advance
//! apply).
//!
//! RocksDB writes are blocking and synced; doing them on a plain thread keeps them off the
//! tokio runtime. Proposers, readers and the transport talk to the thread through a channel;
//! callers await a oneshot that resolves when their command has been applied (or their read
//! index confirmed and applied).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use raft::eraftpb::{
    ConfChange, ConfChangeType, Entry, EntryType, Message, Snapshot, SnapshotMetadata,
};
use raft::{RawNode, SnapshotStatus, StateRole};
use rocksdb::WriteBatch;
use tokio::sync::oneshot;

use super::snapshot::{self, SnapshotDir};
use super::storage::RocksLogStorage;
use super::transport::{peer_address, Feedback, Peers, Transport};
use crate::error::MasterError;
use crate::state::{ApplyOutput, Command, Proposal, StateMachine};

/// Raft tick period; election timeout is 10 ticks (randomised up to 20), heartbeats every 2.
pub const TICK: Duration = Duration::from_millis(100);
const ELECTION_TICKS: usize = 10;
/// A member heard from within this long answers (see `RaftStatus::answering`).
const ANSWERING_WITHIN: Duration = Duration::from_secs(2);
/// How long a follower waits for the leader to confirm a read it forwarded.
const FORWARDED_READ_TIMEOUT: Duration = Duration::from_secs(2);

type Reply = oneshot::Sender<Result<ApplyOutput, MasterError>>;
type ReadReply = oneshot::Sender<Result<(), MasterError>>;

pub enum Msg {
    Propose {
        data: Vec<u8>,
        reply: Reply,
    },
    ConfChange {
        cc: ConfChange,
        reply: Reply,
    },
    ReadIndex {
        reply: ReadReply,
        /// A follower may answer too (after the leader confirms its commit index).
        anywhere: bool,
    },
    Raft(Box<Message>),
    Feedback(Feedback),
    SnapshotBuilt {
        meta: Box<SnapshotMetadata>,
        result: Result<u64, MasterError>,
        /// When the checkpoint began (the log line says how long the snapshot took).
        started: Instant,
    },
    Shutdown,
}

/// Observable Raft status, updated by the node thread.
#[derive(Debug, Default)]
pub struct RaftStatus {
    pub id: u64,
    pub term: AtomicU64,
    pub commit: AtomicU64,
    pub applied: AtomicU64,
    pub leader_id: AtomicU64,
    pub last_index: AtomicU64,
    pub snapshot_index: AtomicU64,
    /// 0 follower, 1 candidate, 2 leader, 3 pre-candidate.
    pub role: AtomicU64,
    /// Voters of the current configuration.
    pub voters: Mutex<Vec<u64>>,
    /// Synced writes of the Raft log made for ready rounds (new entries, term or vote).
    pub log_syncs: AtomicU64,
    /// On the leader: voters heard from within [`ANSWERING_WITHIN`], itself included (0
    /// elsewhere).
    pub answering: AtomicU64,
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
    pub fn voters(&self) -> Vec<u64> {
        match self.voters.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }
}

/// Handle to the node thread.
#[derive(Clone)]
pub struct RaftHandle {
    tx: mpsc::Sender<Msg>,
    pub status: Arc<RaftStatus>,
    pub peers: Peers,
    /// The format proposals are written in (the state machine's).
    pub entry_format: crate::state::format::EntryFormat,
}

/// How long a caller waits for its command to apply before giving up (the command may
/// still apply; request ids make the retry safe).
const PROPOSE_TIMEOUT: Duration = Duration::from_secs(10);

impl RaftHandle {
    /// Proposes `cmd` and waits until it is applied (or rejected).
    pub async fn propose(&self, cmd: &Command) -> Result<ApplyOutput, MasterError> {
        self.propose_request(cmd, 0).await
    }

    /// Proposes `cmd` under a client request id: a retry with the same id returns the first
    /// outcome instead of applying twice.
    pub async fn propose_request(
        &self,
        cmd: &Command,
        request_id: u64,
    ) -> Result<ApplyOutput, MasterError> {
        self.start(cmd, request_id)?.await
    }

    /// Proposes `cmd` now and returns what waits for it to apply: proposals started one
    /// after another enter the log in that order, and several can be in flight at once
    /// (Raft appends what is queued in one round).
    pub fn start_proposal(
        &self,
        cmd: &Command,
    ) -> Result<impl std::future::Future<Output = Result<ApplyOutput, MasterError>> + '_, MasterError>
    {
        self.start(cmd, 0)
    }

    fn start(
        &self,
        cmd: &Command,
        request_id: u64,
    ) -> Result<impl std::future::Future<Output = Result<ApplyOutput, MasterError>> + '_, MasterError>
    {
        let data = self
            .entry_format
            .encode(request_id, granary_common::now_ms(), cmd)?;
        let (reply, rx) = oneshot::channel();
        self.send(Msg::Propose { data, reply })?;
        Ok(async move { self.wait(rx).await? })
    }

    /// Waits until this master has applied everything committed before the call, as
    /// confirmed by a quorum (ReadIndex). Only the leader answers.
    pub async fn read_barrier(&self) -> Result<(), MasterError> {
        self.barrier(false).await
    }

    /// As [`RaftHandle::read_barrier`], on any member that knows the leader: a follower
    /// asks the leader for its commit index (ReadIndex, forwarded; the leader confirms it
    /// with a quorum) and waits until it has applied that far itself, so what it then
    /// reads includes every write acknowledged before the call.
    pub async fn read_barrier_here(&self) -> Result<(), MasterError> {
        self.barrier(true).await
    }

    async fn barrier(&self, anywhere: bool) -> Result<(), MasterError> {
        let (reply, rx) = oneshot::channel();
        self.send(Msg::ReadIndex { reply, anywhere })?;
        self.wait(rx).await?
    }

    pub async fn change_members(&self, cc: ConfChange) -> Result<ApplyOutput, MasterError> {
        let (reply, rx) = oneshot::channel();
        self.send(Msg::ConfChange { cc, reply })?;
        self.wait(rx).await?
    }

    /// Hands a message received from a peer to the node.
    pub fn step(&self, m: Message) -> Result<(), MasterError> {
        self.send(Msg::Raft(Box::new(m)))
    }

    fn send(&self, m: Msg) -> Result<(), MasterError> {
        self.tx.send(m).map_err(|_| MasterError::ShuttingDown)
    }

    async fn wait<T>(&self, rx: oneshot::Receiver<T>) -> Result<T, MasterError> {
        match tokio::time::timeout(PROPOSE_TIMEOUT, rx).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(_)) => Err(MasterError::ShuttingDown),
            Err(_) => Err(MasterError::Unavailable {
                message: format!(
                    "the master group did not confirm within {PROPOSE_TIMEOUT:?} (no quorum?)"
                ),
            }),
        }
    }

    /// `NotLeader` with the leader's address when known.
    pub fn not_leader(&self) -> MasterError {
        not_leader(&self.status, &self.peers)
    }

    pub fn shutdown(&self) {
        let _ = self.tx.send(Msg::Shutdown);
    }
}

fn not_leader(status: &RaftStatus, peers: &Peers) -> MasterError {
    let leader = status.leader_id.load(Ordering::Relaxed);
    MasterError::NotLeader {
        leader_hint: (leader != 0 && leader != status.id)
            .then(|| peer_address(peers, leader))
            .flatten(),
    }
}

/// Static settings of a node.
pub struct NodeConfig {
    pub id: u64,
    /// Take a snapshot and compact the log after this many applied entries.
    pub snapshot_entries: u64,
    pub snapshots: SnapshotDir,
    /// Entries kept behind a snapshot so briefly lagging followers need no snapshot.
    pub keep_entries: u64,
}

/// The channel a node listens on; created first so the transport can report back into it.
pub fn channel() -> (mpsc::Sender<Msg>, mpsc::Receiver<Msg>) {
    mpsc::channel()
}

/// Feedback callback for a transport, posting into the node's channel.
pub fn feedback_fn(tx: &mpsc::Sender<Msg>) -> super::transport::FeedbackFn {
    let tx = Mutex::new(tx.clone());
    Arc::new(move |f| {
        if let Ok(tx) = tx.lock() {
            let _ = tx.send(Msg::Feedback(f));
        }
    })
}

/// Starts the node thread.
pub fn start(
    config: NodeConfig,
    storage: RocksLogStorage,
    sm: StateMachine,
    peers: Peers,
    transport: Box<dyn Transport>,
    (tx, rx): (mpsc::Sender<Msg>, mpsc::Receiver<Msg>),
) -> Result<(RaftHandle, std::thread::JoinHandle<()>), MasterError> {
    let id = config.id;
    let applied = sm.applied_index()?;
    storage.validate(applied)?;
    let entry_format = sm.entry_format();
    let raft_config = raft::Config {
        id,
        election_tick: ELECTION_TICKS,
        heartbeat_tick: 2,
        applied,
        max_size_per_msg: 4 * 1024 * 1024,
        max_inflight_msgs: 256,
        check_quorum: true,
        pre_vote: true,
        // A new commit index rides on the next append or heartbeat (and on the heartbeats
        // of every read round, which a follower's read waits for anyway) instead of an
        // append of its own to every follower after each commit: that was half the
        // messages of a lone caller's create, and a third of a follower's context switches.
        skip_bcast_commit: true,
        // Proposals of one turn go to each follower as one append.
        batch_append: true,
        ..Default::default()
    };
    raft_config
        .validate()
        .map_err(|e| MasterError::corrupt(format!("raft config: {e}")))?;
    let mut node = RawNode::new(&raft_config, storage.clone(), &super::logger::logger())
        .map_err(|e| MasterError::corrupt(format!("starting raft: {e}")))?;
    let voters = storage.conf_state()?.voters;
    let fresh = storage.hard_state()?.term == 0
        && storage.last() == 0
        && storage.snapshot_meta()?.is_none();
    if voters == [id] {
        // Sole voter: no need to wait out an election timeout.
        node.campaign()
            .map_err(|e| MasterError::corrupt(format!("campaign: {e}")))?;
    }
    // A member starting with an empty store may be one whose data was lost, and may have
    // voted in the current term before: it neither votes nor campaigns until any election
    // that could have been running has timed out, so it can never vote twice in a term.
    let quiet_until =
        (fresh && voters != [id]).then(|| Instant::now() + TICK * (2 * ELECTION_TICKS as u32));
    let status = Arc::new(RaftStatus {
        id,
        ..Default::default()
    });
    status.applied.store(applied, Ordering::Relaxed);
    let last_snapshot = storage.snapshot_meta()?.map(|m| m.index).unwrap_or(0);
    let mut driver = Driver {
        node,
        storage,
        sm,
        status: status.clone(),
        peers: peers.clone(),
        transport,
        self_tx: tx.clone(),
        pending: HashMap::new(),
        reads: HashMap::new(),
        forwarded: HashMap::new(),
        read_batch: Vec::new(),
        follower_batch: Vec::new(),
        forwarded_in: Vec::new(),
        answer_to: HashMap::new(),
        deferred_reads: Vec::new(),
        confirmed_reads: Vec::new(),
        nonce: rand::random(),
        next_seq: 1,
        config,
        last_snapshot,
        building_snapshot: false,
        was_leader_in: None,
        quiet_until,
        warned_lost_log: false,
        snapshot_requested_at: None,
        heard: HashMap::new(),
        led_since: None,
    };
    driver.publish_status();
    let join = std::thread::Builder::new()
        .name("granary-raft".into())
        .spawn(move || {
            // A master whose Raft loop died must not linger as a zombie that answers RPCs:
            // exit so the supervisor restarts it (storage is consistent after any crash).
            let id = driver.config.id;
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| driver.run(rx))) {
                Ok(true) => {}
                Ok(false) => {
                    eprintln!("raft: node {id} stopped after a storage failure; exiting");
                    std::process::exit(70);
                }
                Err(_) => {
                    eprintln!("raft: node {id} crashed; exiting");
                    std::process::exit(70);
                }
            }
        })
        .map_err(|e| MasterError::Storage {
            message: format!("spawning the raft thread: {e}"),
        })?;
    let handle = RaftHandle {
        tx,
        status,
        peers,
        entry_format,
    };
    Ok((handle, join))
}

struct Driver {
    node: RawNode<RocksLogStorage>,
    storage: RocksLogStorage,
    sm: StateMachine,
    status: Arc<RaftStatus>,
    peers: Peers,
    transport: Box<dyn Transport>,
    self_tx: mpsc::Sender<Msg>,
    /// Proposals awaiting apply, keyed by (process nonce, sequence) carried as entry context,
    /// so entries re-delivered after a restart never match a new proposal.
    pending: HashMap<(u64, u64), Reply>,
    /// Read requests awaiting quorum confirmation, by request context (one context per
    /// batch: the reads that arrived in one turn of the loop).
    reads: HashMap<Vec<u8>, Vec<ReadReply>>,
    /// Contexts of the reads this follower forwarded to the leader, with when and to which
    /// leader: the leader drops them silently in some states (before it committed in its
    /// term, or when it has just lost leadership), so they expire (see
    /// `expire_forwarded_reads`).
    forwarded: HashMap<Vec<u8>, (Instant, u64)>,
    /// Reads that arrived in this turn of the loop, confirmed together (see `submit_reads`).
    read_batch: Vec<ReadReply>,
    /// Reads a follower may answer that arrived in this turn of the loop.
    follower_batch: Vec<ReadReply>,
    /// On the leader: reads the followers forwarded in this turn of the loop (sender, and
    /// the request's context as raft-rs carries it), confirmed with the leader's own.
    forwarded_in: Vec<(u64, Vec<Entry>)>,
    /// On the leader: the followers' reads confirmed by each of its read contexts.
    answer_to: HashMap<Vec<u8>, Vec<(u64, Vec<Entry>)>>,
    /// Reads held until a new leader has committed in its term.
    deferred_reads: Vec<ReadReply>,
    /// Confirmed reads waiting for the apply index to reach theirs.
    confirmed_reads: Vec<(u64, ReadReply)>,
    nonce: u64,
    next_seq: u64,
    config: NodeConfig,
    last_snapshot: u64,
    building_snapshot: bool,
    /// The term this node last led, to notice leadership changes.
    was_leader_in: Option<u64>,
    /// Until then this (fresh) member neither votes nor campaigns.
    quiet_until: Option<Instant>,
    warned_lost_log: bool,
    snapshot_requested_at: Option<Instant>,
    /// When each member's last message arrived (to judge who answers before a removal).
    heard: HashMap<u64, Instant>,
    /// Since when this master leads (None: it does not).
    led_since: Option<Instant>,
}

impl Driver {
    /// Runs until shutdown (true) or a storage failure (false).
    fn run(&mut self, rx: mpsc::Receiver<Msg>) -> bool {
        let mut last_tick = Instant::now();
        let mut clean = true;
        'outer: loop {
            let wait = TICK.saturating_sub(last_tick.elapsed());
            let first = match rx.recv_timeout(wait) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            // Drain what else is queued so one ready round covers a burst.
            let mut next = first;
            let mut handled = 0;
            while let Some(m) = next.take() {
                if let Msg::Shutdown = m {
                    break 'outer;
                }
                self.handle(m);
                handled += 1;
                if handled >= 1024 {
                    break;
                }
                next = rx.try_recv().ok();
            }
            if last_tick.elapsed() >= TICK {
                if !self.quiet() {
                    self.node.tick();
                }
                last_tick = Instant::now();
            }
            self.retry_deferred_reads();
            self.submit_reads();
            self.expire_forwarded_reads();
            if let Err(e) = self.on_ready() {
                // Storage failed, or a committed entry cannot be applied: stop serving
                // rather than risk acknowledging lost writes or diverging from the others.
                tracing::error!(error = %e, "the master stops applying the raft log");
                eprintln!("raft: node {} stopped: {e}", self.config.id);
                for (_, reply) in self.pending.drain() {
                    let _ = reply.send(Err(e.clone()));
                }
                clean = false;
                break;
            }
            self.on_role();
            self.maybe_snapshot();
            self.publish_status();
        }
        for (_, reply) in self.pending.drain() {
            let _ = reply.send(Err(MasterError::ShuttingDown));
        }
        let mut batched = std::mem::take(&mut self.read_batch);
        batched.append(&mut self.follower_batch);
        for reply in self.reads.drain().flat_map(|(_, r)| r).chain(batched) {
            let _ = reply.send(Err(MasterError::ShuttingDown));
        }
        clean
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Propose { data, reply } => self.propose(data, reply),
            Msg::ConfChange { cc, reply } => self.propose_conf_change(cc, reply),
            Msg::ReadIndex { reply, anywhere } => self.read_index(reply, anywhere),
            Msg::Raft(m) => self.step(*m),
            Msg::Feedback(Feedback::Unreachable(to)) => self.node.report_unreachable(to),
            Msg::Feedback(Feedback::Snapshot { to, ok }) => self.node.report_snapshot(
                to,
                if ok {
                    SnapshotStatus::Finish
                } else {
                    SnapshotStatus::Failure
                },
            ),
            Msg::SnapshotBuilt {
                meta,
                result,
                started,
            } => self.snapshot_built(*meta, result, started),
            Msg::Shutdown => {}
        }
    }

    fn not_leader(&self) -> MasterError {
        not_leader(&self.status, &self.peers)
    }

    fn quiet(&mut self) -> bool {
        match self.quiet_until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                self.quiet_until = None;
                false
            }
            None => false,
        }
    }

    fn step(&mut self, mut m: Message) {
        // A master that is not (or no longer) a member speaks for nobody: its certificate
        // stays valid after its removal, and a vote or a higher term from it could take the
        // group over. (A master still joining knows no members yet and hears everyone.)
        let members = self.node.raft.prs();
        if members.iter().next().is_some() && members.get(m.from).is_none() {
            tracing::debug!(from = m.from, "raft message from a non-member ignored");
            return;
        }
        self.heard.insert(m.from, Instant::now());
        use raft::eraftpb::MessageType as T;
        let mut lost_log_at = None;
        if matches!(m.get_msg_type(), T::MsgRequestVote | T::MsgRequestPreVote) && self.quiet() {
            tracing::debug!(from = m.from, "vote request ignored while starting fresh");
            return;
        }
        if m.get_msg_type() == T::MsgReadIndex && self.joins_read_batch(&m) {
            // A follower's read: confirmed with this turn's other reads (see `submit_reads`)
            // rather than with a heartbeat round of its own, as raft-rs would.
            self.forwarded_in.push((m.from, m.take_entries().into()));
            return;
        }
        if m.get_msg_type() == T::MsgHeartbeat {
            // The leader sends min(what it believes we hold, its commit). If this member lost
            // its data (a wiped directory), that belief is stale and raft-rs would panic on a
            // commit beyond our log; keep our commit index and ask for a snapshot.
            let last = self.node.raft.raft_log.last_index();
            let committed = self.node.raft.raft_log.committed;
            if m.commit > last {
                if !self.warned_lost_log {
                    tracing::warn!(
                        leader = m.from,
                        leader_commit = m.commit,
                        last,
                        "the leader believes this master holds entries it does not (was its data directory lost?); catching up"
                    );
                    self.warned_lost_log = true;
                }
                lost_log_at = Some((m.from, m.commit));
                // Not our last index: a tail we hold may not be the leader's (it could come
                // from a stale leader); our own commit index is safe and avoids raft-rs'
                // panic on a commit beyond the log.
                m.commit = committed;
            }
        }
        if let Err(e) = self.node.step(m) {
            tracing::debug!(error = %e, "raft message ignored");
        }
        if let Some((leader, believed)) = lost_log_at {
            // Tell the leader: a rejection that asks for a snapshot, which it honours
            // whatever state it keeps for us (raft-rs' own request_snapshot refuses here).
            let due = self
                .snapshot_requested_at
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(2));
            if due && self.node.raft.leader_id == leader {
                self.snapshot_requested_at = Some(Instant::now());
                let last = self.node.raft.raft_log.last_index();
                let mut r = Message::default();
                r.set_msg_type(T::MsgAppendResponse);
                r.from = self.config.id;
                r.to = leader;
                r.term = self.node.raft.term;
                r.reject = true;
                r.index = believed;
                r.reject_hint = last;
                r.request_snapshot = believed;
                self.transport.send(vec![r]);
            }
        }
    }

    /// Whether a read forwarded by a follower joins the leader's batch: this node leads and
    /// has committed in its term (raft-rs drops reads before that), and the sender is a
    /// member. Anything else goes to raft-rs as it is.
    fn joins_read_batch(&self, m: &Message) -> bool {
        let r = &self.node.raft;
        r.state == StateRole::Leader
            && r.commit_to_current_term()
            && m.from != self.config.id
            && m.entries.len() == 1
            && r.prs().get(m.from).is_some()
    }

    fn next_key(&mut self) -> ((u64, u64), Vec<u8>) {
        let key = (self.nonce, self.next_seq);
        self.next_seq += 1;
        let mut ctx = Vec::with_capacity(16);
        ctx.extend_from_slice(&key.0.to_be_bytes());
        ctx.extend_from_slice(&key.1.to_be_bytes());
        (key, ctx)
    }

    fn propose(&mut self, data: Vec<u8>, reply: Reply) {
        if self.node.raft.state != StateRole::Leader {
            let _ = reply.send(Err(self.not_leader()));
            return;
        }
        let (key, ctx) = self.next_key();
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

    fn propose_conf_change(&mut self, cc: ConfChange, reply: Reply) {
        if self.node.raft.state != StateRole::Leader {
            let _ = reply.send(Err(self.not_leader()));
            return;
        }
        if self.node.raft.has_pending_conf() {
            let _ = reply.send(Err(MasterError::precondition(
                "another membership change is still being applied; retry when it is done",
            )));
            return;
        }
        let voters = self.status.voters();
        match cc.get_change_type() {
            ConfChangeType::AddNode | ConfChangeType::AddLearnerNode => {
                if voters.contains(&cc.node_id) {
                    let known = peer_address(&self.peers, cc.node_id);
                    let asked = String::from_utf8_lossy(&cc.context).into_owned();
                    // The same id at the same address: a retry of a change that already
                    // happened, so it succeeds without changing anything.
                    let result = if known.as_deref() == Some(asked.as_str()) {
                        Ok(ApplyOutput::None)
                    } else {
                        Err(MasterError::AlreadyExists {
                            path: format!(
                                "master {} (already a member at {})",
                                cc.node_id,
                                known.unwrap_or_else(|| "an unknown address".into())
                            ),
                        })
                    };
                    let _ = reply.send(result);
                    return;
                }
                // A new member must start from a snapshot, never replay the log from index
                // 1 (which predates the initial configuration).
                if self.storage.first() <= 1 {
                    if let Err(e) = self.snapshot_now() {
                        let _ = reply.send(Err(e));
                        return;
                    }
                }
            }
            ConfChangeType::RemoveNode => {
                if !voters.contains(&cc.node_id) {
                    let _ = reply.send(Err(MasterError::not_found(format!(
                        "master {} (not a member)",
                        cc.node_id
                    ))));
                    return;
                }
                if voters.len() <= 1 {
                    let _ = reply.send(Err(MasterError::precondition(
                        "cannot remove the last master of the group",
                    )));
                    return;
                }
                // The group left must still have a majority that answers (here: heard from
                // within two election timeouts), or nothing could be decided again until
                // the silent ones come back.
                let remaining: Vec<u64> = voters
                    .iter()
                    .copied()
                    .filter(|v| *v != cc.node_id)
                    .collect();
                let answering = self.answering(&remaining);
                let settled = self
                    .led_since
                    .is_some_and(|t| t.elapsed() >= ANSWERING_WITHIN);
                if answering < remaining.len() / 2 + 1 && !settled {
                    // A new leader has not heard from everyone yet: the client retries.
                    let _ = reply.send(Err(MasterError::Unavailable {
                        message: "this master leads for less than 2 s and cannot yet tell which masters answer; retry".into(),
                    }));
                    return;
                }
                if answering < remaining.len() / 2 + 1 {
                    let _ = reply.send(Err(MasterError::precondition(format!(
                        "removing master {} would leave {answering} of the {} other masters \
                         answering, not a majority: the group could decide nothing more; \
                         bring the silent ones back (or remove them) first",
                        cc.node_id,
                        remaining.len()
                    ))));
                    return;
                }
                if cc.node_id == self.config.id {
                    // Hand leadership to the most caught-up follower first; the caller
                    // retries against the new leader, which removes this one.
                    let best = self
                        .node
                        .raft
                        .prs()
                        .iter()
                        .filter(|(id, _)| **id != self.config.id && voters.contains(id))
                        .max_by_key(|(_, pr)| pr.matched)
                        .map(|(id, _)| *id);
                    if let Some(to) = best {
                        self.node.transfer_leader(to);
                    }
                    let _ = reply.send(Err(MasterError::Unavailable {
                        message: format!(
                            "master {} is the leader; leadership is moving to {} before it is removed, retry",
                            cc.node_id,
                            best.unwrap_or(0)
                        ),
                    }));
                    return;
                }
            }
        }
        let (key, ctx) = self.next_key();
        match self.node.propose_conf_change(ctx, cc) {
            Ok(()) => {
                self.pending.insert(key, reply);
            }
            Err(e) => {
                let _ = reply.send(Err(MasterError::Unavailable {
                    message: format!("membership change dropped: {e}"),
                }));
            }
        }
    }

    fn read_index(&mut self, reply: ReadReply, anywhere: bool) {
        if self.node.raft.state != StateRole::Leader {
            if anywhere
                && self.node.raft.state == StateRole::Follower
                && self.node.raft.leader_id != 0
            {
                self.follower_batch.push(reply);
            } else {
                let _ = reply.send(Err(self.not_leader()));
            }
            return;
        }
        if !self.node.raft.commit_to_current_term() {
            // raft-rs drops read requests until a new leader has committed an entry of its
            // own term; hold them until then.
            self.deferred_reads.push(reply);
            return;
        }
        self.read_batch.push(reply);
    }

    /// Asks the group to confirm leadership once for every read that arrived in this turn
    /// of the loop: each was received before the confirmation is asked for, so the read
    /// index it gets covers every write acknowledged before it arrived. One heartbeat round
    /// serves a burst of reads instead of one round each.
    ///
    /// The reads followers forwarded in the turn join the same round (the leader answers
    /// each with the index that round confirms): a follower's read costs the leader a
    /// message in and one out, not a heartbeat round to every follower and their answers.
    fn submit_reads(&mut self) {
        if self.read_batch.is_empty()
            && self.follower_batch.is_empty()
            && self.forwarded_in.is_empty()
        {
            return;
        }
        let role = self.node.raft.state;
        if role == StateRole::Leader {
            let mut batch = std::mem::take(&mut self.read_batch);
            // Became leader in this same turn: held until it commits in its term.
            if !self.node.raft.commit_to_current_term() {
                self.deferred_reads.append(&mut self.follower_batch);
            }
            batch.append(&mut self.follower_batch);
            let asks = std::mem::take(&mut self.forwarded_in);
            if batch.is_empty() && asks.is_empty() {
                return;
            }
            let (_, ctx) = self.next_key();
            self.node.read_index(ctx.clone());
            if !asks.is_empty() {
                self.answer_to.insert(ctx.clone(), asks);
            }
            self.reads.insert(ctx, batch);
            return;
        }
        // Lost leadership in this turn: the followers' forwarded reads expire there and
        // are retried.
        self.forwarded_in.clear();
        // Lost leadership to a message handled in this same turn.
        let err = self.not_leader();
        for reply in std::mem::take(&mut self.read_batch) {
            let _ = reply.send(Err(err.clone()));
        }
        if self.follower_batch.is_empty() {
            return;
        }
        if role != StateRole::Follower || self.node.raft.leader_id == 0 {
            for reply in std::mem::take(&mut self.follower_batch) {
                let _ = reply.send(Err(err.clone()));
            }
            return;
        }
        // raft-rs forwards the request to the leader; its answer comes back as a read
        // state of this node, as the leader's own do.
        let (_, ctx) = self.next_key();
        self.node.read_index(ctx.clone());
        self.forwarded
            .insert(ctx.clone(), (Instant::now(), self.node.raft.leader_id));
        self.reads
            .insert(ctx, std::mem::take(&mut self.follower_batch));
    }

    /// Fails the forwarded reads the leader has not answered in time (it drops some
    /// silently), or that went to a leader this follower no longer follows (its answer
    /// would be ignored); their callers retry, at another master if need be.
    fn expire_forwarded_reads(&mut self) {
        if self.forwarded.is_empty() {
            return;
        }
        let leader = self.node.raft.leader_id;
        let late: Vec<Vec<u8>> = self
            .forwarded
            .iter()
            .filter(|(_, (at, to))| at.elapsed() >= FORWARDED_READ_TIMEOUT || *to != leader)
            .map(|(ctx, _)| ctx.clone())
            .collect();
        for ctx in late {
            self.forwarded.remove(&ctx);
            for reply in self.reads.remove(&ctx).unwrap_or_default() {
                let _ = reply.send(Err(MasterError::Unavailable {
                    message: format!(
                        "the leader did not confirm a read within {FORWARDED_READ_TIMEOUT:?}, or leadership moved; retry"
                    ),
                }));
            }
        }
    }

    fn retry_deferred_reads(&mut self) {
        if self.deferred_reads.is_empty() || !self.node.raft.commit_to_current_term() {
            return;
        }
        for reply in std::mem::take(&mut self.deferred_reads) {
            self.read_index(reply, false);
        }
    }

    /// How many of `ids` answer: this master, and those heard from within
    /// [`ANSWERING_WITHIN`].
    fn answering(&self, ids: &[u64]) -> usize {
        ids.iter()
            .filter(|v| {
                **v == self.config.id
                    || self
                        .heard
                        .get(*v)
                        .is_some_and(|t| t.elapsed() < ANSWERING_WITHIN)
            })
            .count()
    }

    fn publish_status(&self) {
        let r = &self.node.raft;
        self.status.term.store(r.term, Ordering::Relaxed);
        self.status
            .commit
            .store(r.raft_log.committed, Ordering::Relaxed);
        self.status.leader_id.store(r.leader_id, Ordering::Relaxed);
        self.status
            .last_index
            .store(self.storage.last(), Ordering::Relaxed);
        self.status
            .snapshot_index
            .store(self.last_snapshot, Ordering::Relaxed);
        let role = match r.state {
            StateRole::Follower => 0,
            StateRole::Candidate => 1,
            StateRole::Leader => 2,
            StateRole::PreCandidate => 3,
        };
        self.status.role.store(role, Ordering::Relaxed);
        let voters: Vec<u64> = r.prs().conf().voters().ids().iter().collect();
        let answering = if role == 2 {
            self.answering(&voters)
        } else {
            0
        };
        self.status
            .answering
            .store(answering as u64, Ordering::Relaxed);
        if let Ok(mut g) = self.status.voters.lock() {
            if *g != voters {
                let mut v = voters;
                v.sort_unstable();
                *g = v;
            }
        }
    }

    /// Notices leadership changes: logs them (one line per term, for operators and the
    /// chaos checker) and fails what only the old leader could have completed.
    fn on_role(&mut self) {
        let r = &self.node.raft;
        let leading = r.state == StateRole::Leader;
        match (self.was_leader_in, leading) {
            (None, true) | (Some(_), true) if self.was_leader_in != Some(r.term) => {
                eprintln!(
                    "raft: node {} became leader at term {}",
                    self.config.id, r.term
                );
                tracing::info!(term = r.term, "this master is now the leader");
                self.was_leader_in = Some(r.term);
                self.led_since = Some(Instant::now());
            }
            (Some(term), false) => {
                tracing::info!(
                    term,
                    new_term = r.term,
                    leader = r.leader_id,
                    "this master is no longer the leader"
                );
                self.was_leader_in = None;
                self.led_since = None;
                let err = MasterError::Unavailable {
                    message: "leadership changed before the request was confirmed; retry".into(),
                };
                for (_, reply) in self.pending.drain() {
                    let _ = reply.send(Err(err.clone()));
                }
                for reply in self.reads.drain().flat_map(|(_, r)| r) {
                    let _ = reply.send(Err(err.clone()));
                }
                // Followers' reads this leader can no longer confirm expire there.
                self.answer_to.clear();
                self.forwarded_in.clear();
                for reply in self.deferred_reads.drain(..) {
                    let _ = reply.send(Err(err.clone()));
                }
            }
            _ => {}
        }
    }

    fn on_ready(&mut self) -> Result<(), MasterError> {
        if !self.node.has_ready() {
            return Ok(());
        }
        let mut ready = self.node.ready();
        self.transport.send(ready.take_messages());
        if !ready.snapshot().is_empty() {
            self.install_snapshot(ready.snapshot())?;
        }
        for rs in ready.take_read_states() {
            self.forwarded.remove(&rs.request_ctx);
            if let Some(replies) = self.reads.remove(&rs.request_ctx) {
                self.confirmed_reads
                    .extend(replies.into_iter().map(|reply| (rs.index, reply)));
            }
            if let Some(asks) = self.answer_to.remove(&rs.request_ctx) {
                self.answer_forwarded(rs.index, asks);
            }
        }
        // The leader answers clients as it applies, so it applies before its own fsync of
        // new entries; a follower acknowledges new entries first and applies after (the
        // leader waits on that acknowledgement, nobody waits on the follower's apply).
        let mut committed = ready.take_committed_entries();
        let leads = self.node.raft.state == StateRole::Leader;
        if leads {
            self.apply(std::mem::take(&mut committed))?;
        }
        if ready.must_sync() {
            // New entries, a new term or a new vote: synced before any message that
            // depends on them is sent.
            if !ready.entries().is_empty() || ready.hs().is_some() {
                self.storage.persist(ready.entries(), ready.hs())?;
                self.status.log_syncs.fetch_add(1, Ordering::Relaxed);
            }
        } else if let Some(hs) = ready.hs() {
            // Only the commit index moved (decision 9): not synced. Followers learn a new
            // commit index from every append and heartbeat, and the leader from every
            // acknowledgement, so a synced write here was an fsync per commit on each.
            self.storage.persist_commit_of(hs)?;
        }
        self.transport.send(ready.take_persisted_messages());
        self.apply(committed)?;
        let mut light = self.node.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.storage.persist_commit(commit)?;
        }
        self.transport.send(light.take_messages());
        self.apply(light.take_committed_entries())?;
        self.storage.flush_wal()?;
        self.node.advance_apply();
        self.release_reads();
        Ok(())
    }

    /// Answers reads forwarded by followers with the read index the leader confirmed for
    /// them, as raft-rs does (`MsgReadIndexResp`, the leader's term): each follower then
    /// serves its reads once it has applied that far.
    fn answer_forwarded(&mut self, index: u64, asks: Vec<(u64, Vec<Entry>)>) {
        if self.node.raft.state != StateRole::Leader {
            return; // stepped down in this turn: the followers' reads expire and are retried
        }
        let term = self.node.raft.term;
        let msgs = asks
            .into_iter()
            .map(|(to, entries)| {
                let mut m = Message::default();
                m.set_msg_type(raft::eraftpb::MessageType::MsgReadIndexResp);
                m.from = self.config.id;
                m.to = to;
                m.term = term;
                m.index = index;
                m.entries = entries.into();
                m
            })
            .collect();
        self.transport.send(msgs);
    }

    fn release_reads(&mut self) {
        if self.confirmed_reads.is_empty() {
            return;
        }
        let applied = self.status.applied.load(Ordering::Relaxed);
        let mut i = 0;
        while i < self.confirmed_reads.len() {
            if self.confirmed_reads[i].0 <= applied {
                let (_, reply) = self.confirmed_reads.swap_remove(i);
                let _ = reply.send(Ok(()));
            } else {
                i += 1;
            }
        }
    }

    fn reply_to(&mut self, context: &[u8], result: Result<ApplyOutput, MasterError>) {
        if context.len() == 16 {
            let nonce = u64::from_be_bytes(context[..8].try_into().unwrap_or_default());
            let seq = u64::from_be_bytes(context[8..].try_into().unwrap_or_default());
            if let Some(reply) = self.pending.remove(&(nonce, seq)) {
                let _ = reply.send(result);
            }
        }
    }

    /// Applies committed entries in order. An entry this version cannot decode stops the
    /// master (see [`undecodable`]): it is never skipped.
    fn apply(&mut self, entries: Vec<Entry>) -> Result<(), MasterError> {
        for entry in entries {
            let index = entry.index;
            match entry.get_entry_type() {
                EntryType::EntryConfChange => self.apply_conf_change(&entry)?,
                EntryType::EntryConfChangeV2 => {
                    // Granary proposes only simple (v1) changes.
                    return Err(undecodable(index, "a joint configuration change"));
                }
                EntryType::EntryNormal if entry.data.is_empty() => self.sm.mark_applied(index)?,
                EntryType::EntryNormal => {
                    let result = match Proposal::decode(&entry.data) {
                        Ok(p) => {
                            let r = self.sm.apply_request(index, &p);
                            // Failures of this replica's storage are fatal (nothing was
                            // recorded as applied); command errors are results.
                            if let Err(e) = &r {
                                if e.is_local_failure() {
                                    return Err(e.clone());
                                }
                            }
                            r
                        }
                        // A command this version cannot decode: applying the rest without it
                        // would make this replica's state differ from the others' for good.
                        // Stop instead (nothing recorded applied; a restart meets it again).
                        Err(e) => return Err(undecodable(index, &format!("a command ({e})"))),
                    };
                    // Published before the reply: whoever saw the acknowledgement sees an
                    // applied index that covers it.
                    self.status.applied.store(index, Ordering::Relaxed);
                    self.reply_to(&entry.context, result);
                }
            }
            self.status.applied.store(index, Ordering::Relaxed);
        }
        Ok(())
    }

    fn apply_conf_change(&mut self, entry: &Entry) -> Result<(), MasterError> {
        use protobuf::Message as _;
        let index = entry.index;
        let cc = ConfChange::parse_from_bytes(&entry.data)
            .map_err(|e| undecodable(index, &format!("a membership change ({e})")))?;
        let cs = match self.node.apply_conf_change(&cc) {
            Ok(cs) => cs,
            Err(e) => {
                tracing::error!(index, error = %e, "membership change rejected");
                self.sm.mark_applied(index)?;
                self.reply_to(
                    &entry.context,
                    Err(MasterError::precondition(format!(
                        "membership change rejected: {e}"
                    ))),
                );
                return Ok(());
            }
        };
        let address = String::from_utf8_lossy(&cc.context).into_owned();
        let adds = matches!(
            cc.get_change_type(),
            ConfChangeType::AddNode | ConfChangeType::AddLearnerNode
        ) && !address.is_empty();
        let mut batch = WriteBatch::default();
        self.storage.conf_state_into(&cs, &mut batch)?;
        if adds {
            self.sm
                .member_address_into(cc.node_id, &address, &mut batch)?;
        }
        self.sm.mark_applied_with(index, batch)?;
        self.status.applied.store(index, Ordering::Relaxed);
        if adds {
            self.transport.set_address(cc.node_id, &address);
            if let Ok(mut g) = self.peers.write() {
                g.insert(cc.node_id, address.clone());
            }
        }
        tracing::info!(
            index,
            change = ?cc.get_change_type(),
            node = cc.node_id,
            voters = ?cs.voters,
            "master group configuration changed"
        );
        eprintln!(
            "raft: node {} applied membership change {:?} {} -> voters {:?}",
            self.config.id,
            cc.get_change_type(),
            cc.node_id,
            cs.voters
        );
        self.reply_to(&entry.context, Ok(ApplyOutput::None));
        Ok(())
    }

    fn install_snapshot(&mut self, snap: &Snapshot) -> Result<(), MasterError> {
        let meta = snap.get_metadata().clone();
        let started = std::time::Instant::now();
        snapshot::install(&self.storage, &self.config.snapshots, &meta)?;
        self.sm.snapshot_installed()?;
        self.last_snapshot = meta.index;
        // Configuration first, then the applied index: whoever sees the new applied index
        // sees the members that go with it.
        self.publish_status();
        self.status.applied.store(meta.index, Ordering::Relaxed);
        self.sm.announce_reset(meta.index);
        self.config.snapshots.prune(meta.index);
        // Addresses of members added after the initial configuration travel in the state.
        for (id, addr) in self.sm.member_addresses().unwrap_or_default() {
            self.transport.set_address(id, &addr);
        }
        tracing::info!(
            index = meta.index,
            term = meta.term,
            ms = started.elapsed().as_millis() as u64,
            "installed a snapshot from the leader"
        );
        eprintln!(
            "raft: node {} installed snapshot at index {}",
            self.config.id, meta.index
        );
        Ok(())
    }

    fn snapshot_meta_now(&self) -> Result<SnapshotMetadata, MasterError> {
        let index = self.status.applied.load(Ordering::Relaxed);
        let term = self
            .storage
            .term_of(index)
            .map_err(|e| MasterError::Storage {
                message: format!("term of applied index {index}: {e}"),
            })?;
        let mut meta = SnapshotMetadata {
            index,
            term,
            ..Default::default()
        };
        meta.set_conf_state(self.storage.conf_state()?);
        Ok(meta)
    }

    /// Starts a snapshot when enough entries were applied since the last one (or raft-rs
    /// asked for a newer one to send).
    fn maybe_snapshot(&mut self) {
        let applied = self.status.applied.load(Ordering::Relaxed);
        let wanted = self.storage.take_snapshot_wanted();
        if self.building_snapshot || applied <= self.last_snapshot {
            return;
        }
        if !wanted && applied - self.last_snapshot < self.config.snapshot_entries {
            return;
        }
        let meta = match self.snapshot_meta_now() {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(error = %e, "cannot start a snapshot");
                return;
            }
        };
        let cp = self.config.snapshots.checkpoint_path(meta.index);
        let started = Instant::now();
        if let Err(e) = snapshot::checkpoint(self.storage.db(), &cp) {
            tracing::error!(error = %e, "cannot start a snapshot");
            return;
        }
        self.building_snapshot = true;
        let dir = self.config.snapshots.clone();
        let tx = self.self_tx.clone();
        let spawned = std::thread::Builder::new()
            .name("granary-snapshot".into())
            .spawn(move || {
                let result = snapshot::write_from_checkpoint(
                    &cp,
                    &dir.temp_path(meta.index, meta.term),
                    &dir.path_for(meta.index, meta.term),
                );
                let _ = tx.send(Msg::SnapshotBuilt {
                    meta: Box::new(meta),
                    result,
                    started,
                });
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot spawn the snapshot thread");
            self.building_snapshot = false;
        }
    }

    /// Takes a snapshot synchronously (used once, before the first member is added).
    fn snapshot_now(&mut self) -> Result<(), MasterError> {
        let meta = self.snapshot_meta_now()?;
        let dir = &self.config.snapshots;
        let cp = dir.checkpoint_path(meta.index);
        let started = Instant::now();
        snapshot::checkpoint(self.storage.db(), &cp)?;
        let result = snapshot::write_from_checkpoint(
            &cp,
            &dir.temp_path(meta.index, meta.term),
            &dir.path_for(meta.index, meta.term),
        );
        self.finish_snapshot(meta, result, true, started)
    }

    fn snapshot_built(
        &mut self,
        meta: SnapshotMetadata,
        result: Result<u64, MasterError>,
        started: Instant,
    ) {
        self.building_snapshot = false;
        if let Err(e) = self.finish_snapshot(meta, result, false, started) {
            tracing::error!(error = %e, "snapshot failed");
        }
    }

    fn finish_snapshot(
        &mut self,
        meta: SnapshotMetadata,
        result: Result<u64, MasterError>,
        compact_fully: bool,
        started: Instant,
    ) -> Result<(), MasterError> {
        let bytes = result?;
        if meta.index <= self.last_snapshot {
            // A newer snapshot was installed meanwhile.
            let _ = std::fs::remove_file(self.config.snapshots.path_for(meta.index, meta.term));
            return Ok(());
        }
        let keep = if compact_fully {
            0
        } else {
            self.config.keep_entries
        };
        let compact_to = meta.index.saturating_sub(keep).max(1);
        self.storage.snapshot_written(&meta, compact_to)?;
        self.last_snapshot = meta.index;
        self.config.snapshots.prune(meta.index);
        tracing::info!(
            index = meta.index,
            bytes,
            ms = started.elapsed().as_millis() as u64,
            compacted_to = compact_to,
            "snapshot taken; log compacted"
        );
        Ok(())
    }
}

/// The error that stops a master at a committed entry it cannot decode (written by a newer
/// version, or damaged): the log position, and what to do.
fn undecodable(index: u64, what: &str) -> MasterError {
    let e = MasterError::corrupt(format!(
        "raft entry {index} is {what} this version cannot apply; it stops here rather than skip it (its state would differ from the other masters' for good). Run the version of granary that wrote it (after a partial upgrade: upgrade this master too), or wipe this master's data directory and let it rejoin from the others (granary master add)"
    ));
    tracing::error!(index, error = %e, "undecodable raft entry; the master stops");
    e
}

#[cfg(test)]
mod undecodable_tests {
    #[test]
    fn an_undecodable_entry_stops_the_master_and_says_where_and_what_to_do() {
        assert!(super::Proposal::decode(&[0xff, 0x00, 0x13]).is_err());
        let e = super::undecodable(42, "a command (bad bytes)");
        // A local failure: the raft loop stops (and the process exits) instead of
        // recording the entry applied.
        assert!(e.is_local_failure());
        let m = e.to_string();
        assert!(
            m.contains("raft entry 42") && m.contains("wipe this master's data directory"),
            "{m}"
        );
    }
}
