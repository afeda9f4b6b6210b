//! The receiving side of the master-to-master transport (`granary.v1.RaftService`).

use std::sync::atomic::Ordering::Relaxed;

use granary_common::authz::{check_master_sender, principal};
use granary_proto as pb;
use granary_proto::raft_service_server::RaftService;
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};
use tokio::io::AsyncWriteExt;
use tonic::{Request, Response, Status, Streaming};

use super::node::RaftHandle;
use super::snapshot::{self, SnapshotDir};

pub struct RaftRpc {
    pub raft: RaftHandle,
    pub snapshots: SnapshotDir,
    pub address: String,
    /// This master's grant keys (TLS clusters).
    pub grants: Option<std::sync::Arc<crate::grants::Grants>>,
    /// Cancelled when this master stops: ends the peers' streams (a server stops only
    /// once every call has ended).
    pub shutdown: tokio_util::sync::CancellationToken,
}

/// This member's own view, as `MasterInfo`.
pub fn member_info(raft: &RaftHandle, address: &str) -> pb::MasterInfo {
    let status = &raft.status;
    pb::MasterInfo {
        id: status.id,
        address: address.to_string(),
        role: status.role_name().to_string(),
        term: status.term.load(Relaxed),
        commit_index: status.commit.load(Relaxed),
        applied_index: status.applied.load(Relaxed),
        state_format: crate::state::FORMAT_VERSION.into(),
        entry_format: raft.entry_format.version().into(),
    }
}

fn decode(bytes: &[u8]) -> Result<Message, Status> {
    Message::parse_from_bytes(bytes)
        .map_err(|e| Status::invalid_argument(format!("undecodable raft message: {e}")))
}

/// Terms and indexes past this are no real group's (and `+ 1` on them must not overflow).
const MAX_SANE: u64 = 1 << 62;

/// Refuses what no master sends another: kinds raft-rs keeps local or that Granary never
/// forwards (a proposal — the leader proposes itself — would be appended unchecked, and
/// an empty one or an empty read request panics raft-rs), a term of 0 on a kind that
/// carries one (raft-rs takes it for a local message), and terms or indexes near 2^64.
fn check_wire(m: &Message) -> Result<(), Status> {
    use MessageType as T;
    let kind = m.get_msg_type();
    let refuse = |why: String| Err(Status::invalid_argument(format!("raft {kind:?}: {why}")));
    let carries_term = matches!(
        kind,
        T::MsgAppend
            | T::MsgAppendResponse
            | T::MsgRequestVote
            | T::MsgRequestVoteResponse
            | T::MsgRequestPreVote
            | T::MsgRequestPreVoteResponse
            | T::MsgHeartbeat
            | T::MsgHeartbeatResponse
            | T::MsgReadIndexResp
            | T::MsgTimeoutNow
    );
    if carries_term && m.term == 0 {
        return refuse("term 0".into());
    }
    // A follower's read is forwarded with term 0 and exactly its one context entry.
    if kind == T::MsgReadIndex && m.entries.len() != 1 {
        return refuse(format!("{} entries, not 1", m.entries.len()));
    }
    if !carries_term && kind != T::MsgReadIndex {
        return refuse("not a kind masters send each other".into());
    }
    let numbers = [m.term, m.index, m.log_term, m.commit, m.reject_hint];
    let entries = m.entries.iter().flat_map(|e| [e.index, e.term]);
    if numbers.into_iter().chain(entries).any(|n| n > MAX_SANE) {
        return refuse("a term or index beyond 2^62".into());
    }
    Ok(())
}

impl RaftRpc {
    /// Checks a batch whole — the sender is the master its certificate names (the batch
    /// and each of its messages), it is for this master, and holds no snapshot — then
    /// steps its messages in order.
    pub(super) fn accept(
        &self,
        who: &granary_common::tls::Principal,
        batch: pb::RaftBatch,
    ) -> Result<(), Status> {
        check_master_sender(who, batch.from)?;
        if batch.to != self.raft.status.id {
            return Err(Status::failed_precondition(format!(
                "this is master {}, not {}: check the --peers addresses",
                self.raft.status.id, batch.to
            )));
        }
        let mut msgs = Vec::with_capacity(batch.messages.len());
        for m in &batch.messages {
            let m = decode(m)?;
            check_master_sender(who, m.from)?;
            if m.to != batch.to {
                return Err(Status::invalid_argument(format!(
                    "a raft message for master {} in a batch for master {}",
                    m.to, batch.to
                )));
            }
            if m.get_msg_type() == MessageType::MsgSnapshot {
                return Err(Status::invalid_argument(
                    "snapshots travel through InstallSnapshot",
                ));
            }
            check_wire(&m)?;
            msgs.push(m);
        }
        // Checked whole before any is stepped: a batch is refused, never half-applied.
        for m in msgs {
            self.raft.step(m).map_err(Status::from)?;
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl RaftService for RaftRpc {
    async fn send(&self, req: Request<pb::RaftBatch>) -> Result<Response<pb::RaftAck>, Status> {
        let who = principal(&req)?;
        self.accept(&who, req.into_inner())?;
        Ok(Response::new(pb::RaftAck {}))
    }

    /// Batches on one stream, each checked and stepped as `Send` does; the first refused
    /// ends the stream with its status (the sender opens another for what follows).
    async fn send_stream(
        &self,
        req: Request<Streaming<pb::RaftBatch>>,
    ) -> Result<Response<pb::RaftAck>, Status> {
        let who = principal(&req)?;
        let mut stream = req.into_inner();
        loop {
            let next = tokio::select! {
                next = stream.message() => next?,
                _ = self.shutdown.cancelled() => {
                    return Err(Status::unavailable("this master is stopping"));
                }
            };
            match next {
                Some(batch) => self.accept(&who, batch)?,
                None => return Ok(Response::new(pb::RaftAck {})),
            }
        }
    }

    async fn install_snapshot(
        &self,
        req: Request<Streaming<pb::SnapshotChunk>>,
    ) -> Result<Response<pb::RaftAck>, Status> {
        let who = principal(&req)?;
        let mut stream = req.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("empty snapshot stream"))?;
        let m = decode(&first.message)?;
        check_master_sender(&who, m.from)?;
        if m.get_msg_type() != MessageType::MsgSnapshot || m.to != self.raft.status.id {
            return Err(Status::invalid_argument(
                "the first chunk must carry a snapshot message for this master",
            ));
        }
        let meta = m.get_snapshot().get_metadata().clone();
        if [m.term, meta.index, meta.term]
            .iter()
            .any(|&n| n == 0 || n > MAX_SANE)
        {
            return Err(Status::invalid_argument(
                "a snapshot's term and index must be between 1 and 2^62",
            ));
        }
        // Only a member sends snapshots (a removed master's certificate stays valid).
        let voters = self.raft.status.voters();
        if !voters.is_empty() && !voters.contains(&m.from) {
            return Err(Status::permission_denied(format!(
                "master {} is not a member of this group",
                m.from
            )));
        }
        let tmp = self.snapshots.temp_path(meta.index, meta.term);
        let fin = self.snapshots.path_for(meta.index, meta.term);
        let io = |e: std::io::Error| Status::internal(format!("writing the snapshot: {e}"));
        let mut file = tokio::fs::File::create(&tmp).await.map_err(io)?;
        let mut crc = 0u32;
        let mut total = 0u64;
        let mut chunk = first;
        let result: Result<(), Status> = async {
            loop {
                crc = crc32c::crc32c_append(crc, &chunk.data);
                total += chunk.data.len() as u64;
                file.write_all(&chunk.data).await.map_err(io)?;
                if chunk.last {
                    if chunk.crc32c != crc || chunk.total_bytes != total {
                        return Err(Status::data_loss(format!(
                            "snapshot transfer corrupted: {total} bytes, crc {crc:#x}, expected {} bytes, crc {:#x}",
                            chunk.total_bytes, chunk.crc32c
                        )));
                    }
                    break;
                }
                chunk = stream
                    .message()
                    .await?
                    .ok_or_else(|| Status::aborted("snapshot stream ended early"))?;
            }
            file.sync_all().await.map_err(io)?;
            Ok(())
        }
        .await;
        drop(file);
        if let Err(e) = result {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e);
        }
        let checked = tmp.clone();
        tokio::task::spawn_blocking(move || snapshot::verify(&checked))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                Status::data_loss(e.to_string())
            })?;
        tokio::fs::rename(&tmp, &fin).await.map_err(io)?;
        snapshot::sync_dir(&fin);
        tracing::info!(
            index = meta.index,
            term = meta.term,
            bytes = total,
            from = m.from,
            "snapshot received"
        );
        self.raft.step(m).map_err(Status::from)?;
        Ok(Response::new(pb::RaftAck {}))
    }

    async fn member_status(
        &self,
        _req: Request<pb::MemberStatusRequest>,
    ) -> Result<Response<pb::MasterInfo>, Status> {
        Ok(Response::new(member_info(&self.raft, &self.address)))
    }

    async fn grant_key(
        &self,
        req: Request<pb::GrantKeyRequest>,
    ) -> Result<Response<pb::GrantKeyReply>, Status> {
        // A master certificate, speaking for the member it names (the method is masters'
        // only; this also refuses a master claiming another's id).
        let who = principal(&req)?;
        let from = req.into_inner().from;
        check_master_sender(&who, from)?;
        if !self.raft.status.voters().contains(&from) {
            return Err(Status::permission_denied(format!(
                "master {from} is not a member of this group"
            )));
        }
        let Some(grants) = &self.grants else {
            return Err(Status::failed_precondition(
                "this group signs no grants (it runs without TLS)",
            ));
        };
        // Read the term first: a follower keeps the key for the term it asked in only if
        // this master still led in it.
        let term = self.raft.status.term.load(Relaxed);
        if !self.raft.status.is_leader() {
            return Err(Status::from(self.raft.not_leader()));
        }
        Ok(Response::new(pb::GrantKeyReply {
            key: Some(grants.own().to_proto()),
            term,
        }))
    }
}

/// Asks every member for its own status (unreachable ones are reported as such).
/// What the master at `addr` says of itself (`None`: it did not answer within a second).
pub async fn ask_member(net: &granary_common::net::Net, addr: &str) -> Option<pb::MasterInfo> {
    let ch = net
        .channel(addr, granary_common::net::ServerKind::Master)
        .ok()?;
    let mut c = granary_proto::raft_service_client::RaftServiceClient::new(ch);
    let mut req = Request::new(pb::MemberStatusRequest {});
    req.set_timeout(std::time::Duration::from_millis(800));
    tokio::time::timeout(std::time::Duration::from_secs(1), c.member_status(req))
        .await
        .ok()?
        .ok()
        .map(|r| r.into_inner())
}

pub async fn group_status(
    raft: &RaftHandle,
    self_address: &str,
    net: &granary_common::net::Net,
) -> Vec<pb::MasterInfo> {
    let voters = raft.status.voters();
    let mut out = Vec::with_capacity(voters.len());
    let mut asks = Vec::new();
    for id in voters {
        if id == raft.status.id {
            out.push(member_info(raft, self_address));
            continue;
        }
        let addr = super::transport::peer_address(&raft.peers, id).unwrap_or_default();
        let net = net.clone();
        asks.push(async move {
            ask_member(&net, &addr).await.unwrap_or(pb::MasterInfo {
                id,
                address: addr,
                role: "unreachable".into(),
                ..Default::default()
            })
        });
    }
    out.extend(futures::future::join_all(asks).await);
    out.sort_by_key(|m| m.id);
    out
}
