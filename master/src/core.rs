//! The master's core: what the gRPC handlers call.

use std::time::Duration;

use granary_proto as pb;

use crate::blocks::BlockLocations;
use crate::error::MasterError;
use crate::mounts::validate_new;
use crate::namespace::Namespace;
use crate::raft::node::RaftHandle;
use crate::state::{ApplyOutput, Command, Mount};
use crate::workers::WorkerRegistry;

pub struct MasterCore {
    pub id: u64,
    pub address: String,
    pub ns: Namespace,
    pub raft: RaftHandle,
    pub blocks: BlockLocations,
    pub workers: WorkerRegistry,
    pub heartbeat_interval: Duration,
}

impl MasterCore {
    pub fn ensure_leader(&self) -> Result<(), MasterError> {
        if self.raft.status.is_leader() {
            Ok(())
        } else {
            Err(MasterError::NotLeader { leader_hint: None })
        }
    }

    pub async fn propose(&self, cmd: Command) -> Result<ApplyOutput, MasterError> {
        self.raft.propose(&cmd).await
    }

    pub async fn add_mount(
        &self,
        path: &str,
        uri: &str,
        options: &[pb::MountOptionEntry],
    ) -> Result<Mount, MasterError> {
        let path = granary_common::paths::normalize(path)?;
        let spec = validate_new(uri, options)?;
        match self
            .propose(Command::AddMount {
                path,
                spec,
                now_ms: granary_common::now_ms(),
            })
            .await?
        {
            ApplyOutput::Mount(m) => {
                tracing::info!(path = %m.path, uri = %m.spec.uri, id = m.id, "mount added");
                Ok(m)
            }
            _ => Err(MasterError::corrupt("unexpected result of AddMount")),
        }
    }

    pub async fn remove_mount(&self, path: &str) -> Result<Mount, MasterError> {
        let path = granary_common::paths::normalize(path)?;
        match self.propose(Command::RemoveMount { path }).await? {
            ApplyOutput::Mount(m) => {
                self.ns.ufs.forget(m.id);
                tracing::info!(path = %m.path, id = m.id, "mount removed");
                Ok(m)
            }
            _ => Err(MasterError::corrupt("unexpected result of RemoveMount")),
        }
    }

    pub fn cluster_info(&self) -> Result<pb::GetClusterInfoResponse, MasterError> {
        let s = &self.raft.status;
        use std::sync::atomic::Ordering::Relaxed;
        let workers = self
            .workers
            .all()
            .into_iter()
            .map(|w| pb::WorkerInfo {
                worker_id: w.id,
                state: if self.workers.is_live(&w) {
                    "live"
                } else {
                    "lost"
                }
                .to_string(),
                last_heartbeat_ms_ago: w.last_heartbeat.elapsed().as_millis() as u64,
                block_count: self.blocks.block_count(w.id),
                address: w.address,
                host: w.host,
                stats: Some(w.stats),
            })
            .collect();
        Ok(pb::GetClusterInfoResponse {
            workers,
            masters: vec![pb::MasterInfo {
                id: self.id,
                address: self.address.clone(),
                role: s.role_name().to_string(),
                term: s.term.load(Relaxed),
                commit_index: s.commit.load(Relaxed),
                applied_index: s.applied.load(Relaxed),
            }],
            leader_id: s.leader_id.load(Relaxed),
            inode_count: self.ns.sm.inode_count()?,
            mount_count: self.ns.sm.mounts()?.len() as u64,
        })
    }

    /// Periodic housekeeping: declare silent workers lost and forget their blocks.
    pub fn sweep(&self) {
        for id in self.workers.expire() {
            tracing::warn!(
                worker = id,
                "worker lost (no heartbeat); dropping its block locations"
            );
            self.blocks.drop_worker(id);
        }
    }
}
