//! The master's core: what the gRPC handlers call.

use std::sync::Arc;
use std::time::Duration;

use granary_common::net::Net;
use granary_proto as pb;

use crate::error::MasterError;
use crate::fleet::Fleet;
use crate::namespace::Namespace;
use crate::raft::node::RaftHandle;
use crate::state::{ApplyOutput, Command, Mount};

pub struct MasterCore {
    id: u64,
    address: String,
    ns: Namespace,
    raft: RaftHandle,
    fleet: Fleet,
    jobs: crate::jobs::JobRunner,
    pins: crate::pins::PinSet,
    ttl: crate::ttl::TtlRunner,
    /// Signs read grants (TLS clusters only: without principals there is no one to grant).
    grants: Option<Arc<crate::grants::Grants>>,
    /// How this master reaches workers and the other masters.
    net: Net,
}

/// What a master's core is made of (see [`MasterCore::new`]).
pub struct Parts {
    pub id: u64,
    pub address: String,
    pub ns: Namespace,
    pub raft: RaftHandle,
    pub fleet: Fleet,
    pub grants: Option<Arc<crate::grants::Grants>>,
    pub net: Net,
}

/// The core's parts are private: each subsystem reaches what it needs through a handle
/// named for it (the namespace, the fleet of workers, leadership), never by a field.
impl MasterCore {
    pub fn new(p: Parts) -> Self {
        MasterCore {
            id: p.id,
            address: p.address,
            ns: p.ns,
            raft: p.raft,
            fleet: p.fleet,
            jobs: Default::default(),
            pins: Default::default(),
            ttl: Default::default(),
            grants: p.grants,
            net: p.net,
        }
    }

    /// This master's id in the group.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The address this master is reached at.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The namespace: the replicated tree, its mounts and their under-stores.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// The workers and the blocks they hold (leader only).
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// This master's Raft node: proposals, reads, membership.
    pub fn raft(&self) -> &RaftHandle {
        &self.raft
    }

    /// Whether this master leads now (without asking a quorum).
    pub fn is_leader(&self) -> bool {
        self.raft.status.is_leader()
    }

    /// The term this master knows of.
    pub fn term(&self) -> u64 {
        self.raft
            .status
            .term
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How this master reaches workers and the other masters.
    pub fn net(&self) -> &Net {
        &self.net
    }

    /// Signs read grants (TLS clusters only).
    pub fn grants(&self) -> Option<&Arc<crate::grants::Grants>> {
        self.grants.as_ref()
    }

    pub(crate) fn job_runner(&self) -> &crate::jobs::JobRunner {
        &self.jobs
    }

    pub(crate) fn pin_set(&self) -> &crate::pins::PinSet {
        &self.pins
    }

    pub(crate) fn ttl_runner(&self) -> &crate::ttl::TtlRunner {
        &self.ttl
    }

    /// Fails with `NotLeader` (and the leader's address) unless this master leads. Worker
    /// membership and block locations live on the leader only; when it starts a new term it
    /// forgets what it knew before, so workers re-register with full reports.
    pub fn ensure_leader(&self) -> Result<(), MasterError> {
        if !self.is_leader() {
            return Err(self.raft.not_leader());
        }
        if self.fleet.begin_term(self.term()) {
            self.ns.forget_sync_state();
        }
        Ok(())
    }

    /// Linearizable reads: confirms leadership with a quorum and waits until everything
    /// committed before the read is applied here (ReadIndex).
    pub async fn read_barrier(&self) -> Result<(), MasterError> {
        self.raft.read_barrier().await
    }

    /// A linearizable read any master may answer (the namespace reads: statuses, lookups,
    /// listings): on a follower, the leader confirms its commit index and this master
    /// waits until it has applied that far. What only the leader can answer (a folder to
    /// list from its store, worker state) still fails with `NotLeader` further on.
    pub async fn read_here(&self) -> Result<(), MasterError> {
        self.raft.read_barrier_here().await
    }

    /// Proposes a client mutation under its request id (0 = none).
    pub async fn propose_request(
        &self,
        cmd: Command,
        request_id: u64,
    ) -> Result<ApplyOutput, MasterError> {
        self.raft.propose_request(&cmd, request_id).await
    }

    /// The first outcome of a request applied before, after everything committed is
    /// applied here. A client that lost an answer retries with the same request id, and
    /// the retry's checks (an entry that now exists, a store object already removed) must
    /// not turn what was done into an error: mutations ask this when their checks fail.
    pub async fn replayed(
        &self,
        request_id: u64,
    ) -> Result<Option<Result<ApplyOutput, MasterError>>, MasterError> {
        if request_id == 0 {
            return Ok(None);
        }
        self.read_barrier().await?;
        self.ns.sm.request_outcome(request_id)
    }

    /// As [`replayed`](Self::replayed), without its quorum round when this leader has
    /// applied every entry of its log: a leader's log holds every committed entry, so a
    /// request applied anywhere is then known here.
    pub async fn replayed_cheaply(
        &self,
        request_id: u64,
    ) -> Result<Option<Result<ApplyOutput, MasterError>>, MasterError> {
        let s = &self.raft.status;
        // `applied` first: `last_index` only grows, so this holds at the first read.
        let applied = s.applied.load(std::sync::atomic::Ordering::Acquire);
        if s.is_leader() && applied >= s.last_index.load(std::sync::atomic::Ordering::Acquire) {
            return self.ns.sm.request_outcome(request_id);
        }
        self.replayed(request_id).await
    }

    pub async fn propose(&self, cmd: Command) -> Result<ApplyOutput, MasterError> {
        self.raft.propose(&cmd).await
    }

    /// Adds a master to the group (a Raft configuration change).
    pub async fn add_master(&self, id: u64, address: &str) -> Result<(), MasterError> {
        if id == 0 {
            return Err(MasterError::invalid("master ids start at 1"));
        }
        let address = address.trim();
        if address.is_empty() || !address.contains(':') {
            return Err(MasterError::invalid(format!(
                "invalid master address {:?}: expected host:port",
                granary_common::paths::shown(address)
            )));
        }
        // The joining master must answer before it is added (it is started with --join
        // first): a voter that never answers can cost the group its quorum (a group of one
        // stops taking writes at once); one that is another master, or that cannot read the
        // group's Raft entries, would never serve as this one.
        let joiner = self.ask_joiner(address).await;
        if let Some(why) = joiner_refusal(
            id,
            address,
            joiner.as_ref(),
            self.raft.entry_format.version(),
        ) {
            return Err(MasterError::precondition(why));
        }
        let mut cc = raft::eraftpb::ConfChange::default();
        cc.set_change_type(raft::eraftpb::ConfChangeType::AddNode);
        cc.node_id = id;
        cc.context = address.as_bytes().to_vec().into();
        self.raft.change_members(cc).await?;
        tracing::info!(id, address, "master added to the group");
        Ok(())
    }

    /// What the master at `address` says of itself, asked for a few seconds (it may be
    /// starting); `None`: it did not answer.
    async fn ask_joiner(&self, address: &str) -> Option<pb::MasterInfo> {
        let deadline = tokio::time::Instant::now() + JOINER_PATIENCE;
        loop {
            if let Some(info) = crate::raft::service::ask_member(&self.net, address).await {
                return Some(info);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Removes a master from the group.
    pub async fn remove_master(&self, id: u64) -> Result<(), MasterError> {
        let mut cc = raft::eraftpb::ConfChange::default();
        cc.set_change_type(raft::eraftpb::ConfChangeType::RemoveNode);
        cc.node_id = id;
        self.raft.change_members(cc).await?;
        tracing::info!(id, "master removed from the group");
        Ok(())
    }

    pub async fn add_mount(
        &self,
        path: &str,
        uri: &str,
        options: &[pb::MountOptionEntry],
        request_id: u64,
    ) -> Result<Mount, MasterError> {
        let path = granary_common::paths::normalize(path)?;
        let spec = self.ns.ufs.validate_new(uri, options).await?;
        let spec = self.ns.ufs.seal_spec(spec)?;
        match self
            .propose_request(
                Command::AddMount {
                    path,
                    spec,
                    now_ms: granary_common::now_ms(),
                },
                request_id,
            )
            .await?
        {
            ApplyOutput::Mount(m) => {
                tracing::info!(path = %m.path, uri = %m.spec.uri, id = m.id, "mount added");
                Ok(m)
            }
            _ => Err(MasterError::corrupt("unexpected result of AddMount")),
        }
    }

    pub async fn remove_mount(
        &self,
        path: &str,
        force: bool,
        request_id: u64,
    ) -> Result<Mount, MasterError> {
        let path = granary_common::paths::normalize(path)?;
        if !force {
            self.refuse_losing_writes(&path).await?;
        }
        // The entries a store's listings cached below the mount point go in bounded steps
        // (the store keeps its objects); the mount's own command then removes the rest.
        // A retry of a removal that was done must not purge a mount made there since.
        if let Some(point) = self.ns.sm.resolve_loaded(&path)? {
            let mounts = self.ns.sm.mounts()?;
            if mounts.iter().any(|m| m.path == path && m.inode == point.id) {
                if let Some(first) = self.replayed(request_id).await? {
                    return match first? {
                        ApplyOutput::Mount(m) => Ok(m),
                        _ => Err(MasterError::corrupt("unexpected result of RemoveMount")),
                    };
                }
                let mount = mounts.iter().find(|m| m.path == path).map(|m| m.id);
                let keep = mount.filter(|_| !force);
                self.ns.purge_below(&point, &path, keep).await?;
                if !force {
                    // Files finished while the purge ran (the purge kept them).
                    self.refuse_losing_writes(&path).await?;
                }
            }
        }
        match self
            .propose_request(Command::RemoveMount { path }, request_id)
            .await?
        {
            ApplyOutput::Mount(m) => {
                self.ns.ufs.forget(m.id);
                tracing::info!(path = %m.path, id = m.id, "mount removed");
                Ok(m)
            }
            _ => Err(MasterError::corrupt("unexpected result of RemoveMount")),
        }
    }

    /// The cluster as this master sees it. Workers are known to the leader only.
    pub async fn cluster_info(&self) -> Result<pb::GetClusterInfoResponse, MasterError> {
        let s = &self.raft.status;
        use std::sync::atomic::Ordering::Relaxed;
        if s.is_leader() {
            self.ensure_leader()?;
        }
        let decommissioned = self.ns.sm.decommissioned()?;
        let workers = if s.is_leader() {
            self.fleet.infos(&decommissioned)
        } else {
            Vec::new()
        };
        Ok(pb::GetClusterInfoResponse {
            workers,
            masters: crate::raft::service::group_status(&self.raft, &self.address, &self.net).await,
            leader_id: s.leader_id.load(Relaxed),
            inode_count: self.ns.sm.inode_count()?,
            mount_count: self.ns.sm.mounts()?.len() as u64,
        })
    }

    /// Lists again the directories whose last listing failed, once their backoff passed
    /// (leader only), so a failure heals without anyone looking.
    pub fn retry_failed_listings(self: &std::sync::Arc<Self>) {
        if !self.raft.status.is_leader() {
            return;
        }
        self.ns.prune_sync_state();
        for id in self.ns.due_retries() {
            let core = self.clone();
            tokio::spawn(async move {
                match core.ns.inode(id) {
                    Ok(dir) if dir.kind == crate::state::Kind::Directory => {
                        let _ = core.ns.force_sync(dir).await;
                    }
                    // A file checked on lookup (re-checked on the next one), or gone.
                    _ => core.ns.forget_sync(id),
                }
            });
        }
    }

    /// The leader's move to this release's Raft entry format (see `state::format`): once
    /// every member says it reads it, the group records so and entries are proposed in it
    /// from then on. Until then (a group being upgraded one master at a time) they stay
    /// JSON, which every release reads. One check at a time, at most one per 5 s.
    pub fn adopt_entry_format(self: &std::sync::Arc<Self>) {
        let format = &self.raft.entry_format;
        let newest = crate::state::FORMAT_VERSION;
        if !self.raft.status.is_leader() || format.version() >= newest || !format.start_check() {
            return;
        }
        let core = self.clone();
        tokio::spawn(async move {
            let members = crate::raft::service::group_status(&core.raft, &core.address, &core.net);
            let older: Vec<u64> = members
                .await
                .iter()
                .filter(|m| m.state_format < u32::from(newest))
                .map(|m| m.id)
                .collect();
            if older.is_empty() {
                let cmd = Command::UseFormat {
                    version: newest.into(),
                };
                match core.raft.propose(&cmd).await {
                    Ok(_) => tracing::info!(
                        format = newest,
                        "every master reads this release's Raft entry format: proposing in it"
                    ),
                    Err(e) => tracing::warn!(error = %e, "cannot record the Raft entry format"),
                }
            } else {
                tracing::debug!(
                    ?older,
                    "masters of an older release (or unreachable): Raft entries stay JSON"
                );
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            core.raft.entry_format.check_done();
        });
    }

    /// Periodic housekeeping: declare silent workers lost and forget their blocks.
    pub fn sweep(self: &std::sync::Arc<Self>) {
        if self.fleet.expire_silent() && self.is_leader() {
            self.repin_after_loss();
        }
    }
}

/// How long `master add` waits for the joining master to answer.
const JOINER_PATIENCE: Duration = Duration::from_secs(4);

/// Why master `id` at `address` may not join a group whose Raft entries are in format
/// `group_format`, given what it said of itself (`None`: it did not answer).
fn joiner_refusal(
    id: u64,
    address: &str,
    joiner: Option<&pb::MasterInfo>,
    group_format: u8,
) -> Option<String> {
    // An address of any length may come in: at most 256 bytes of it go back.
    let address = granary_common::paths::shown(address);
    let Some(info) = joiner else {
        return Some(format!(
            "no master answers at {address}: start master {id} there with --join first (a member that never answers can cost the group its quorum)"
        ));
    };
    if info.id != id {
        return Some(format!(
            "the master at {address} is master {}, not {id}: add it with its own --id, or start master {id} there",
            info.id
        ));
    }
    if info.state_format < u32::from(group_format) {
        return Some(format!(
            "master {id} at {address} reads Raft entries up to format {} and the group's are in format {group_format}: start it with this release (it would stop at the first entry it cannot read)",
            info.state_format
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_joiner_of_another_id_or_an_older_format_is_refused() {
        let info = |id, state_format| pb::MasterInfo {
            id,
            state_format,
            ..Default::default()
        };
        // Not answering: refused (a group of one would stop taking writes).
        let e = joiner_refusal(4, "m4:1", None, 1).unwrap_or_default();
        assert!(e.contains("no master answers at m4:1"), "{e}");
        // This release joining a group of either format.
        assert_eq!(joiner_refusal(4, "m4:1", Some(&info(4, 1)), 1), None);
        assert_eq!(joiner_refusal(4, "m4:1", Some(&info(4, 1)), 0), None);
        // An older release (no format in its answer) joining a group still on JSON entries.
        assert_eq!(joiner_refusal(4, "m4:1", Some(&info(4, 0)), 0), None);
        // The same older release once the group has switched.
        let e = joiner_refusal(4, "m4:1", Some(&info(4, 0)), 1).unwrap_or_default();
        assert!(
            e.contains("up to format 0") && e.contains("in format 1"),
            "{e}"
        );
        // Another master at that address.
        let e = joiner_refusal(5, "m4:1", Some(&info(4, 1)), 1).unwrap_or_default();
        assert!(e.contains("is master 4, not 5"), "{e}");
        // A huge address is not echoed whole.
        let huge = format!("{}:1", "h".repeat(1 << 20));
        let e = joiner_refusal(5, &huge, None, 1).unwrap_or_default();
        assert!(e.len() < 1024, "{} bytes", e.len());
    }
}
