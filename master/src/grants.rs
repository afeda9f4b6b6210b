//! The keys a master signs read grants with (see `granary_common::grant`).
//!
//! Every master makes a random key at start and never writes it down; workers learn the
//! leader's from its registration and heartbeat answers and accept no other. A follower
//! answering namespace reads (issue 31) signs the grants of the statuses it returns with
//! the leader's key, which it asks the leader for over the masters' mutual TLS
//! (`RaftService/GrantKey`, master certificates only) whenever the leader or its term
//! changes. Until it holds the current leader's key, a follower signs nothing: the read
//! goes to the leader (`NotLeader`).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use granary_common::grant::GrantKey;
use granary_proto as pb;
use granary_proto::raft_service_client::RaftServiceClient;

use crate::error::MasterError;
use crate::raft::node::{RaftHandle, RaftStatus};
use crate::raft::transport::peer_address;

/// How often a follower checks that it holds the current leader's key.
const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// A leader's key as a follower holds it: the leader's id and term when fetched.
struct Borrowed {
    leader: u64,
    term: u64,
    key: Arc<GrantKey>,
}

pub struct Grants {
    own: GrantKey,
    leader: RwLock<Option<Borrowed>>,
}

impl Grants {
    pub fn new() -> Result<Self, MasterError> {
        Ok(Self {
            own: GrantKey::random().map_err(|message| MasterError::Unavailable { message })?,
            leader: RwLock::new(None),
        })
    }

    /// This master's own key (the one workers learn while it leads).
    pub fn own(&self) -> &GrantKey {
        &self.own
    }

    /// Signs a grant as this master may now: with its own key while it leads, else with
    /// the current leader's key if it holds it; none when it cannot.
    pub fn sign(
        &self,
        status: &RaftStatus,
        principal: &str,
        file: &pb::FileStatus,
        write: bool,
        expires_ms: u64,
    ) -> Option<pb::ReadGrant> {
        if status.is_leader() {
            return Some(self.own.sign(principal, file, write, expires_ms));
        }
        let (leader, term) = (status.leader_id.load(Relaxed), status.term.load(Relaxed));
        let held = self.leader.read().ok()?;
        let b = held.as_ref()?;
        (b.leader == leader && b.term == term && leader != 0)
            .then(|| b.key.sign(principal, file, write, expires_ms))
    }

    /// The leader and term whose key a follower should fetch now, if it does not hold it.
    fn wanted(&self, status: &RaftStatus) -> Option<(u64, u64)> {
        let (leader, term) = (status.leader_id.load(Relaxed), status.term.load(Relaxed));
        if status.is_leader() || leader == 0 || leader == status.id {
            return None;
        }
        let held = self.leader.read().ok()?;
        match held.as_ref() {
            Some(b) if b.leader == leader && b.term == term => None,
            _ => Some((leader, term)),
        }
    }

    fn learn(&self, leader: u64, term: u64, key: GrantKey) {
        if let Ok(mut held) = self.leader.write() {
            *held = Some(Borrowed {
                leader,
                term,
                key: Arc::new(key),
            });
        }
    }
}

/// Starts [`follow_leader_keys`] on a master that signs grants.
pub fn keep_leader_key(
    core: &crate::core::MasterCore,
    shutdown: tokio_util::sync::CancellationToken,
) {
    if let Some(g) = core.grants() {
        tokio::spawn(follow_leader_keys(
            g.clone(),
            core.raft().clone(),
            core.net().clone(),
            shutdown,
        ));
    }
}

/// While this master follows, keeps the current leader's key (see the module docs). Ends
/// when `shutdown` is cancelled.
pub async fn follow_leader_keys(
    grants: Arc<Grants>,
    raft: RaftHandle,
    net: granary_common::net::Net,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut tick = tokio::time::interval(FOLLOW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Some((leader, term)) = grants.wanted(&raft.status) else {
            continue;
        };
        match fetch(&raft, &net, leader).await {
            // A key the leader gave in another term than the one we follow is refetched.
            Ok((key, at_term)) if at_term == term => grants.learn(leader, term, key),
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(leader, error = %e, "fetching the leader's grant key failed; retrying")
            }
        }
    }
}

async fn fetch(
    raft: &RaftHandle,
    net: &granary_common::net::Net,
    leader: u64,
) -> Result<(GrantKey, u64), String> {
    let addr = peer_address(&raft.peers, leader).ok_or("the leader's address is not known")?;
    let channel = net
        .channel(&addr, granary_common::net::ServerKind::Master)
        .map_err(|e| e.to_string())?;
    let mut client = RaftServiceClient::new(channel);
    let mut req = tonic::Request::new(pb::GrantKeyRequest {
        from: raft.status.id,
    });
    req.set_timeout(Duration::from_secs(5));
    let reply = client
        .grant_key(req)
        .await
        .map_err(|s| s.message().to_string())?
        .into_inner();
    let key = reply
        .key
        .as_ref()
        .and_then(GrantKey::from_proto)
        .ok_or("the leader sent no usable key")?;
    Ok((key, reply.term))
}
