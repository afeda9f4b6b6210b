//! The Raft driver against an in-memory network that drops, delays and partitions messages.
//! Real RocksDB stores in temp dirs, real snapshot files; only the wire is simulated.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use raft::eraftpb::{Message, MessageType};
use rand::{Rng, SeedableRng};

use super::node::{self, Msg, NodeConfig, RaftHandle};
use super::snapshot::SnapshotDir;
use super::storage::RocksLogStorage;
use super::transport::{Feedback, Transport};
use crate::error::MasterError;
use crate::state::{Command, StateMachine};

#[derive(Default)]
struct Rules {
    drop_rate: f64,
    max_delay_ms: u64,
    /// Nodes cut off from everyone.
    isolated: HashSet<u64>,
    /// Nodes whose incoming messages all take this many milliseconds more.
    slow_to: HashMap<u64, u64>,
    /// Nodes whose incoming log appends (only) take this many milliseconds more.
    slow_appends_to: HashMap<u64, u64>,
}

type Due = Reverse<(Instant, u64, u64, Vec<u8>)>;

/// The simulated wire: per-node inboxes, loss/delay/partition rules and a delivery thread.
struct Net {
    inboxes: Mutex<HashMap<u64, mpsc::Sender<Msg>>>,
    snapshots: Mutex<HashMap<u64, SnapshotDir>>,
    rules: Mutex<Rules>,
    queue: Mutex<BinaryHeap<Due>>,
    seq: std::sync::atomic::AtomicU64,
    stop: std::sync::atomic::AtomicBool,
    /// Messages delivered, by kind and receiver.
    delivered: Mutex<HashMap<(MessageType, u64), u64>>,
}

impl Net {
    fn new() -> Arc<Self> {
        let net = Arc::new(Self {
            inboxes: Mutex::default(),
            snapshots: Mutex::default(),
            rules: Mutex::default(),
            queue: Mutex::default(),
            seq: Default::default(),
            stop: Default::default(),
            delivered: Mutex::default(),
        });
        let pump = net.clone();
        std::thread::spawn(move || {
            use protobuf::Message as _;
            while !pump.stop.load(Relaxed) {
                let now = Instant::now();
                let mut due = Vec::new();
                {
                    let mut q = pump.queue.lock().unwrap();
                    while q.peek().is_some_and(|Reverse((t, ..))| *t <= now) {
                        due.push(q.pop().unwrap().0);
                    }
                }
                for (_, _, to, bytes) in due {
                    let m = Message::parse_from_bytes(&bytes).unwrap();
                    pump.deliver(to, m);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        net
    }

    fn blocked(&self, from: u64, to: u64) -> bool {
        let r = self.rules.lock().unwrap();
        r.isolated.contains(&from) || r.isolated.contains(&to)
    }

    fn deliver(&self, to: u64, m: Message) {
        if self.blocked(m.from, to) {
            return;
        }
        if let Some(tx) = self.inboxes.lock().unwrap().get(&to) {
            *self
                .delivered
                .lock()
                .unwrap()
                .entry((m.get_msg_type(), to))
                .or_default() += 1;
            let _ = tx.send(Msg::Raft(Box::new(m)));
        }
    }

    fn delivered(&self, kind: MessageType, to: u64) -> u64 {
        self.delivered
            .lock()
            .unwrap()
            .get(&(kind, to))
            .copied()
            .unwrap_or(0)
    }

    fn feedback(&self, to_node: u64, f: Feedback) {
        if let Some(tx) = self.inboxes.lock().unwrap().get(&to_node) {
            let _ = tx.send(Msg::Feedback(f));
        }
    }

    fn set_rules(&self, f: impl FnOnce(&mut Rules)) {
        f(&mut self.rules.lock().unwrap());
    }
}

struct MemTransport {
    from: u64,
    net: Arc<Net>,
    rng: rand::rngs::StdRng,
}

impl Transport for MemTransport {
    fn send(&mut self, msgs: Vec<Message>) {
        use protobuf::Message as _;
        for m in msgs {
            let to = m.to;
            let (drop_rate, max_delay, slow) = {
                let r = self.net.rules.lock().unwrap();
                let append = (m.get_msg_type() == MessageType::MsgAppend)
                    .then(|| r.slow_appends_to.get(&to).copied())
                    .flatten();
                (
                    r.drop_rate,
                    r.max_delay_ms,
                    r.slow_to.get(&to).copied().or(append),
                )
            };
            let snapshot = m.get_msg_type() == MessageType::MsgSnapshot;
            if self.net.blocked(self.from, to) || self.rng.gen_bool(drop_rate) {
                let f = if snapshot {
                    Feedback::Snapshot { to, ok: false }
                } else {
                    Feedback::Unreachable(to)
                };
                self.net.feedback(self.from, f);
                continue;
            }
            if snapshot {
                // The file travels first, as over gRPC.
                let meta = m.get_snapshot().get_metadata();
                let dirs = self.net.snapshots.lock().unwrap();
                let ok = match (dirs.get(&self.from), dirs.get(&to)) {
                    (Some(a), Some(b)) => std::fs::copy(
                        a.path_for(meta.index, meta.term),
                        b.path_for(meta.index, meta.term),
                    )
                    .is_ok(),
                    _ => false,
                };
                drop(dirs);
                if ok {
                    self.net.deliver(to, m);
                }
                self.net.feedback(self.from, Feedback::Snapshot { to, ok });
                continue;
            }
            let delay = if max_delay == 0 {
                0
            } else {
                self.rng.gen_range(0..=max_delay)
            } + slow.unwrap_or(0);
            let seq = self.net.seq.fetch_add(1, Relaxed);
            self.net.queue.lock().unwrap().push(Reverse((
                Instant::now() + Duration::from_millis(delay),
                seq,
                to,
                m.write_to_bytes().unwrap(),
            )));
        }
    }

    fn set_address(&mut self, _id: u64, _addr: &str) {}
}

struct TestNode {
    handle: RaftHandle,
    sm: StateMachine,
    join: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

struct Group {
    net: Arc<Net>,
    nodes: BTreeMap<u64, TestNode>,
    /// term → ids seen leading it (sampled).
    leaders: Arc<Mutex<BTreeMap<u64, BTreeSet<u64>>>>,
    sampling: Arc<std::sync::atomic::AtomicBool>,
}

fn start_node(
    net: &Arc<Net>,
    id: u64,
    voters: &[u64],
    snapshot_entries: u64,
    seed: u64,
) -> TestNode {
    let dir = tempfile::tempdir().unwrap();
    let db = Arc::new(crate::open_db(&dir.path().join("meta")).unwrap());
    let sm = StateMachine::open(db.clone()).unwrap();
    let log = RocksLogStorage::open(db, voters).unwrap();
    let snaps = SnapshotDir::open(dir.path().join("snapshots")).unwrap();
    let chan = node::channel();
    net.inboxes.lock().unwrap().insert(id, chan.0.clone());
    net.snapshots.lock().unwrap().insert(id, snaps.clone());
    let transport = MemTransport {
        from: id,
        net: net.clone(),
        rng: rand::rngs::StdRng::seed_from_u64(seed ^ id),
    };
    let (handle, join) = node::start(
        NodeConfig {
            id,
            snapshot_entries,
            snapshots: snaps,
            keep_entries: snapshot_entries / 4,
        },
        log,
        sm.clone(),
        Arc::default(),
        Box::new(transport),
        chan,
    )
    .unwrap();
    TestNode {
        handle,
        sm,
        join: Some(join),
        _dir: dir,
    }
}

impl Group {
    fn start(n: u64, snapshot_entries: u64, seed: u64) -> Self {
        let net = Net::new();
        let voters: Vec<u64> = (1..=n).collect();
        let mut nodes = BTreeMap::new();
        for id in 1..=n {
            nodes.insert(id, start_node(&net, id, &voters, snapshot_entries, seed));
        }
        let g = Self {
            net,
            nodes,
            leaders: Arc::default(),
            sampling: Arc::new(true.into()),
        };
        let statuses: Vec<_> = g.nodes.values().map(|n| n.handle.status.clone()).collect();
        let (leaders, sampling) = (g.leaders.clone(), g.sampling.clone());
        std::thread::spawn(move || {
            while sampling.load(Relaxed) {
                for s in &statuses {
                    if s.is_leader() {
                        let term = s.term.load(Relaxed);
                        leaders
                            .lock()
                            .unwrap()
                            .entry(term)
                            .or_default()
                            .insert(s.id);
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        g
    }

    fn leader(&self) -> Option<u64> {
        self.nodes
            .values()
            .filter(|n| n.handle.status.is_leader())
            .filter(|n| {
                !self
                    .net
                    .rules
                    .lock()
                    .unwrap()
                    .isolated
                    .contains(&n.handle.status.id)
            })
            .max_by_key(|n| n.handle.status.term.load(Relaxed))
            .map(|n| n.handle.status.id)
    }

    fn wait_leader(&self, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self.leader() {
                return l;
            }
            assert!(
                Instant::now() < deadline,
                "no leader elected within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Creates `path` through whichever node leads, retrying with one request id; true when
    /// acknowledged.
    async fn mkdir(&self, path: &str, timeout: Duration) -> bool {
        let rid = rand::random::<u64>() | 1;
        let cmd = Command::Mkdir {
            path: path.to_string(),
            recursive: false,
            mode: 0o755,
            now_ms: 0,
            owner: None,
        };
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let Some(l) = self.leader() else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let h = &self.nodes[&l].handle;
            match tokio::time::timeout(Duration::from_secs(2), h.propose_request(&cmd, rid)).await {
                Ok(Ok(_)) => return true,
                Ok(Err(MasterError::NotLeader { .. } | MasterError::Unavailable { .. }))
                | Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                Ok(Err(e)) => panic!("mkdir {path}: {e}"),
            }
        }
        false
    }

    fn names(&self, id: u64, dir: &str) -> BTreeSet<String> {
        let sm = &self.nodes[&id].sm;
        match sm.resolve_loaded(dir).unwrap() {
            Some(d) => sm
                .children(d.id, None, usize::MAX)
                .unwrap()
                .into_iter()
                .map(|i| i.name)
                .collect(),
            None => BTreeSet::new(),
        }
    }

    /// Waits until every node has applied the same index, at least the highest index any
    /// node had applied when called (every acknowledged write is at or below it; a new
    /// leader's own commit index may still lag behind it).
    fn wait_converged(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let target = self
            .nodes
            .values()
            .map(|n| n.handle.status.applied.load(Relaxed))
            .max()
            .unwrap_or(0);
        loop {
            let applied: Vec<u64> = self
                .nodes
                .values()
                .map(|n| n.handle.status.applied.load(Relaxed))
                .collect();
            let commit = target;
            if applied.iter().all(|a| *a == applied[0] && *a >= commit) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "nodes did not converge: applied {applied:?}, leader commit {commit}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn assert_one_leader_per_term(&self) {
        for (term, ids) in self.leaders.lock().unwrap().iter() {
            assert!(ids.len() <= 1, "term {term} had leaders {ids:?}");
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.sampling.store(false, Relaxed);
        for n in self.nodes.values_mut() {
            n.handle.shutdown();
            if let Some(j) = n.join.take() {
                let _ = j.join();
            }
        }
        self.net.stop.store(true, Relaxed);
    }
}

fn seed() -> u64 {
    let s = std::env::var("GRANARY_RAFT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("raft test seed {s} (rerun with GRANARY_RAFT_SEED={s})");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lossy_slow_network_loses_no_acknowledged_write() {
    let g = Group::start(3, 1_000_000, seed());
    g.net.set_rules(|r| {
        r.drop_rate = 0.2;
        r.max_delay_ms = 30;
    });
    g.wait_leader(Duration::from_secs(30));
    assert!(g.mkdir("/w", Duration::from_secs(30)).await);
    let mut acked = BTreeSet::new();
    for i in 0..60 {
        if g.mkdir(&format!("/w/d{i}"), Duration::from_secs(30)).await {
            acked.insert(format!("d{i}"));
        }
    }
    assert_eq!(acked.len(), 60, "every create is acknowledged eventually");
    g.net.set_rules(|r| *r = Rules::default());
    g.wait_converged(Duration::from_secs(30));
    for id in 1..=3 {
        assert_eq!(g.names(id, "/w"), acked, "node {id}");
    }
    g.assert_one_leader_per_term();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_leader_acknowledges_nothing_and_rejoins() {
    let g = Group::start(3, 1_000_000, seed());
    let old = g.wait_leader(Duration::from_secs(30));
    assert!(g.mkdir("/p", Duration::from_secs(10)).await);
    g.net.set_rules(|r| {
        r.isolated.insert(old);
    });
    // The cut-off leader cannot commit: its proposal is never acknowledged.
    let h = g.nodes[&old].handle.clone();
    let lost = tokio::time::timeout(
        Duration::from_secs(3),
        h.propose_request(
            &Command::Mkdir {
                path: "/p/orphan".into(),
                recursive: false,
                mode: 0o755,
                now_ms: 0,
                owner: None,
            },
            7,
        ),
    )
    .await;
    assert!(
        !matches!(lost, Ok(Ok(_))),
        "an isolated leader acknowledged a write"
    );
    // The majority elects another leader and keeps accepting writes.
    let deadline = Instant::now() + Duration::from_secs(30);
    let new = loop {
        if let Some(l) = g.leader().filter(|l| *l != old) {
            break l;
        }
        assert!(Instant::now() < deadline, "no new leader");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_ne!(new, old);
    for i in 0..20 {
        assert!(g.mkdir(&format!("/p/n{i}"), Duration::from_secs(10)).await);
    }
    g.net.set_rules(|r| r.isolated.clear());
    g.wait_converged(Duration::from_secs(30));
    let want: BTreeSet<String> = (0..20).map(|i| format!("n{i}")).collect();
    for id in 1..=3 {
        assert_eq!(g.names(id, "/p"), want, "node {id} (orphan must be gone)");
    }
    assert!(!g.nodes[&old].handle.status.is_leader() || g.leader() == Some(old));
    g.assert_one_leader_per_term();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_follower_catches_up_from_a_snapshot() {
    let g = Group::start(3, 20, seed());
    let leader = g.wait_leader(Duration::from_secs(30));
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    assert!(g.mkdir("/s", Duration::from_secs(10)).await);
    g.net.set_rules(|r| {
        r.isolated.insert(follower);
    });
    for i in 0..100 {
        assert!(g.mkdir(&format!("/s/e{i}"), Duration::from_secs(10)).await);
    }
    // The leader has compacted past what the follower holds.
    let lead = &g.nodes[&g.leader().unwrap()].handle.status;
    assert!(lead.snapshot_index.load(Relaxed) > 20, "no snapshot taken");
    g.net.set_rules(|r| {
        r.isolated.clear();
        r.max_delay_ms = 5;
    });
    g.wait_converged(Duration::from_secs(30));
    let want: BTreeSet<String> = (0..100).map(|i| format!("e{i}")).collect();
    for id in 1..=3 {
        assert_eq!(g.names(id, "/s"), want, "node {id}");
    }
    assert!(
        g.nodes[&follower]
            .handle
            .status
            .snapshot_index
            .load(Relaxed)
            > 0,
        "the follower caught up without installing a snapshot"
    );
    g.assert_one_leader_per_term();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_member_gets_a_snapshot_that_includes_it() {
    // No periodic snapshots: the only ones are those the join itself needs.
    let seed = seed();
    let mut g = Group::start(3, 1_000_000, seed);
    let leader = g.wait_leader(Duration::from_secs(30));
    assert!(g.mkdir("/j", Duration::from_secs(10)).await);
    for i in 0..5 {
        assert!(
            g.mkdir(&format!("/j/before{i}"), Duration::from_secs(10))
                .await
        );
    }
    let joiner = start_node(&g.net, 4, &[], 1_000_000, seed);
    g.nodes.insert(4, joiner);
    let mut cc = raft::eraftpb::ConfChange::default();
    cc.set_change_type(raft::eraftpb::ConfChangeType::AddNode);
    cc.node_id = 4;
    cc.context = b"node-4:1".to_vec().into();
    let h = g.nodes[&leader].handle.clone();
    tokio::time::timeout(Duration::from_secs(10), h.change_members(cc.clone()))
        .await
        .expect("conf change timed out")
        .unwrap();
    // The same change again (a client retry) succeeds without changing anything; the id at
    // another address is refused with a clear error.
    h.change_members(cc.clone()).await.unwrap();
    cc.context = b"elsewhere:1".to_vec().into();
    let again = h.change_members(cc).await.unwrap_err();
    assert!(
        matches!(again, MasterError::AlreadyExists { .. }),
        "{again}"
    );
    // No further writes: the join alone must bring the new member up to date.
    g.wait_converged(Duration::from_secs(30));
    let want: BTreeSet<String> = (0..5).map(|i| format!("before{i}")).collect();
    assert_eq!(g.names(4, "/j"), want);
    let deadline = Instant::now() + Duration::from_secs(10);
    while g.nodes[&4].handle.status.voters() != vec![1, 2, 3, 4] {
        assert!(
            Instant::now() < deadline,
            "member 4 sees voters {:?}",
            g.nodes[&4].handle.status.voters()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        g.nodes[&4].sm.member_addresses().unwrap(),
        vec![(4, "node-4:1".to_string())]
    );
    // The group of four keeps committing.
    assert!(g.mkdir("/j/after", Duration::from_secs(10)).await);
    g.wait_converged(Duration::from_secs(30));
    assert!(g.names(4, "/j").contains("after"));
    g.assert_one_leader_per_term();
}

/// A follower answers a read once the leader has confirmed its commit index and the
/// follower has applied that far (ReadIndex, forwarded): every write acknowledged before
/// the read is seen, even by a follower that hears of writes 300 ms after the others (of
/// everything, or of the log only, so that the read's answer comes first). Cut
/// off from the leader, it fails the read soon rather than answer from what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_read_sees_every_write_acknowledged_before_it() {
    let g = Group::start(3, 1000, seed());
    let leader = g.wait_leader(Duration::from_secs(30));
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let handle = &g.nodes[&follower].handle;
    assert!(
        matches!(
            handle.read_barrier().await,
            Err(MasterError::NotLeader { .. })
        ),
        "the leader-only barrier answered on a follower"
    );
    // First everything reaches it late, then only the log, not the read's answer: the
    // answer must make it wait for the write.
    for (first, everything) in [(0, true), (5, false)] {
        g.net.set_rules(|r| {
            r.slow_to.clear();
            if everything {
                r.slow_to.insert(follower, 300);
            } else {
                r.slow_appends_to.insert(follower, 300);
            }
        });
        for i in first..first + 5 {
            let name = format!("r{i}");
            assert!(g.mkdir(&format!("/{name}"), Duration::from_secs(10)).await);
            handle.read_barrier_here().await.unwrap();
            assert!(
                g.names(follower, "/").contains(&name),
                "a read on follower {follower} missed {name}, acknowledged before it"
            );
        }
    }
    g.net.set_rules(|r| {
        r.slow_appends_to.clear();
        r.isolated.insert(follower);
    });
    let started = Instant::now();
    let cut_off = handle.read_barrier_here().await;
    assert!(
        matches!(
            cut_off,
            Err(MasterError::Unavailable { .. } | MasterError::NotLeader { .. })
        ),
        "{cut_off:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// Many concurrent reads at both followers while messages to the leader take 20 ms: each
/// read sees the write its caller had acknowledged just before, and the leader confirms
/// the followers' forwarded requests of one turn with one heartbeat round (raft-rs alone
/// makes one round per request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_follower_reads_share_heartbeat_rounds_and_see_every_acknowledged_write() {
    let g = Arc::new(Group::start(3, 100_000, seed()));
    let leader = g.wait_leader(Duration::from_secs(30));
    assert!(g.mkdir("/first", Duration::from_secs(10)).await);
    g.net.set_rules(|r| {
        r.slow_to.insert(leader, 20);
    });
    let followers: Vec<u64> = (1..=3).filter(|i| *i != leader).collect();
    let counts = |g: &Group| {
        (
            g.net.delivered(MessageType::MsgReadIndex, leader),
            g.net.delivered(MessageType::MsgHeartbeat, followers[0]),
        )
    };
    let (asked_before, beats_before) = counts(&g);
    let started = Instant::now();
    let (tasks, rounds) = (16, 10);
    let mut callers = Vec::new();
    for &f in &followers {
        for t in 0..tasks {
            let g = g.clone();
            callers.push(tokio::spawn(async move {
                for k in 0..rounds {
                    let name = format!("f{f}-{t}-{k}");
                    assert!(g.mkdir(&format!("/{name}"), Duration::from_secs(10)).await);
                    g.nodes[&f].handle.read_barrier_here().await.unwrap();
                    assert!(
                        g.names(f, "/").contains(&name),
                        "a read on follower {f} missed {name}, acknowledged before it"
                    );
                }
            }));
        }
    }
    for c in callers {
        c.await.unwrap();
    }
    let (asked, beats) = counts(&g);
    let (asked, beats) = (asked - asked_before, beats - beats_before);
    // Heartbeats the ticks send (one per 2 ticks) besides the read rounds.
    let ticking = started.elapsed().as_millis() as u64 / (2 * node::TICK.as_millis() as u64) + 2;
    assert!(
        beats * 20 <= asked * 17 + ticking * 20,
        "{asked} forwarded read requests took {beats} heartbeats to follower {}",
        followers[0]
    );
    g.assert_one_leader_per_term();
}

/// One create costs each member one synced write of its log, the entry's: the commit
/// index that follows it (in the next append or heartbeat, on the leader in the
/// acknowledgement) is recorded without an fsync (decision 9). Before, each member synced
/// the commit index too, doubling the fsyncs on a lone caller's path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_costs_each_member_one_synced_log_write() {
    let g = Group::start(3, 100_000, seed());
    g.wait_leader(Duration::from_secs(30));
    assert!(g.mkdir("/first", Duration::from_secs(10)).await);
    g.wait_converged(Duration::from_secs(10));
    let syncs = |g: &Group| -> Vec<u64> {
        g.nodes
            .values()
            .map(|n| n.handle.status.log_syncs.load(Relaxed))
            .collect()
    };
    let before = syncs(&g);
    let creates = 40;
    for i in 0..creates {
        assert!(g.mkdir(&format!("/d{i}"), Duration::from_secs(10)).await);
    }
    g.wait_converged(Duration::from_secs(10));
    let after = syncs(&g);
    for (id, (b, a)) in g.nodes.keys().zip(before.iter().zip(&after)) {
        let n = a - b;
        // An election in between would add a few (a new term and vote, a leader's entry).
        assert!(
            (creates..=creates + 4).contains(&n),
            "member {id} made {n} synced log writes for {creates} creates"
        );
    }
    for id in g.nodes.keys() {
        assert_eq!(g.names(*id, "/").len(), creates as usize + 1);
    }
    g.assert_one_leader_per_term();
}

/// What `Send` and `SendStream` accept, batch by batch: a member's certificate speaks only
/// for that member, in the batch and in each message; a batch for another master, with
/// undecodable bytes or a snapshot inside is refused; and a refused batch is refused
/// whole: none of its messages is stepped (the term a forged vote request carries, placed
/// after a valid message, never reaches the node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_batch_is_checked_whole_against_its_senders_certificate() {
    use granary_common::tls::{Principal, Role};
    use granary_proto as pb;
    use protobuf::Message as _;
    let g = Group::start(3, 100_000, seed());
    g.wait_leader(Duration::from_secs(30));
    let node = &g.nodes[&1];
    let dir = tempfile::tempdir().unwrap();
    let rpc = super::service::RaftRpc {
        raft: node.handle.clone(),
        snapshots: SnapshotDir::open(dir.path().to_path_buf()).unwrap(),
        address: "127.0.0.1:1".into(),
        grants: None,
        shutdown: tokio_util::sync::CancellationToken::new(),
    };
    let msg = |from: u64, to: u64, kind: MessageType, term: u64| -> bytes::Bytes {
        let mut m = Message::default();
        m.set_msg_type(kind);
        m.from = from;
        m.to = to;
        m.term = term;
        m.write_to_bytes().unwrap().into()
    };
    let master2 = Principal::new("master-2", &[Role::Master], None).with_master_id(2);
    let user = Principal::new("alice", &[Role::User], None);
    let term = node.handle.status.term.load(Relaxed);
    let huge = u64::MAX / 2;
    let valid = msg(2, 1, MessageType::MsgHeartbeatResponse, term);
    let batch = |from, to, messages| pb::RaftBatch { from, to, messages };
    let cases: Vec<(&Principal, pb::RaftBatch, tonic::Code)> = vec![
        // Another member's id in a message, after a valid one.
        (
            &master2,
            batch(
                2,
                1,
                vec![valid.clone(), msg(3, 1, MessageType::MsgRequestVote, huge)],
            ),
            tonic::Code::PermissionDenied,
        ),
        // Another member's id on the batch.
        (
            &master2,
            batch(3, 1, vec![msg(3, 1, MessageType::MsgRequestVote, huge)]),
            tonic::Code::PermissionDenied,
        ),
        // A certificate that names no master.
        (
            &user,
            batch(2, 1, vec![valid.clone()]),
            tonic::Code::PermissionDenied,
        ),
        // For another master; a message for another master inside.
        (
            &master2,
            batch(2, 7, vec![valid.clone()]),
            tonic::Code::FailedPrecondition,
        ),
        (
            &master2,
            batch(
                2,
                1,
                vec![valid.clone(), msg(2, 3, MessageType::MsgRequestVote, huge)],
            ),
            tonic::Code::InvalidArgument,
        ),
        // Undecodable bytes, and a snapshot, after a forged term.
        (
            &master2,
            batch(
                2,
                1,
                vec![
                    msg(2, 1, MessageType::MsgRequestVote, huge),
                    bytes::Bytes::from_static(&[0xff; 9]),
                ],
            ),
            tonic::Code::InvalidArgument,
        ),
        (
            &master2,
            batch(
                2,
                1,
                vec![
                    msg(2, 1, MessageType::MsgRequestVote, huge),
                    msg(2, 1, MessageType::MsgSnapshot, huge),
                ],
            ),
            tonic::Code::InvalidArgument,
        ),
    ];
    // Kinds no master sends another (a proposal would be appended unchecked; an empty
    // one, or a read request without its entry, panicked raft-rs), a term of 0 (a local
    // message to raft-rs) and a term near 2^64.
    let mut cases = cases;
    for forged in [
        msg(2, 1, MessageType::MsgPropose, term),
        msg(2, 1, MessageType::MsgReadIndex, 0),
        msg(2, 1, MessageType::MsgHeartbeat, 0),
        msg(2, 1, MessageType::MsgHeartbeat, u64::MAX),
        msg(2, 1, MessageType::MsgTransferLeader, term),
    ] {
        cases.push((
            &master2,
            batch(2, 1, vec![valid.clone(), forged]),
            tonic::Code::InvalidArgument,
        ));
    }
    for (i, (who, batch, code)) in cases.into_iter().enumerate() {
        let e = rpc.accept(who, batch).unwrap_err();
        assert_eq!(e.code(), code, "case {i}: {e:?}");
    }
    // The same valid batch twice is stepped twice, harmlessly.
    for _ in 0..2 {
        rpc.accept(
            &master2,
            pb::RaftBatch {
                from: 2,
                to: 1,
                messages: vec![valid.clone()],
            },
        )
        .unwrap();
    }
    // A master that is no member (a removed master's certificate stays valid) passes the
    // certificate checks, and its messages are ignored: a far higher term from it would
    // have taken the group to that term.
    let master4 = Principal::new("master-4", &[Role::Master], None).with_master_id(4);
    rpc.accept(
        &master4,
        pb::RaftBatch {
            from: 4,
            to: 1,
            messages: vec![msg(4, 1, MessageType::MsgHeartbeat, term + 2000)],
        },
    )
    .unwrap();
    // No forged term reached any node: the group still writes in a sane term.
    assert!(g.mkdir("/after", Duration::from_secs(10)).await);
    for n in g.nodes.values() {
        assert!(
            n.handle.status.term.load(Relaxed) < 1000,
            "a forged term was stepped"
        );
    }
    g.assert_one_leader_per_term();
}
