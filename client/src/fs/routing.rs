//! Read routing: which workers are live and in what order a block's readers try them
//! (its rendezvous owner first, suspects last, a bounded number of reads per worker), over
//! gRPC or a worker's block data plane, with a new grant when a worker refuses one; and the
//! under-store read when no worker can serve.

use super::*;
use crate::ErrorCode;

/// What read routing holds: the live workers as last seen, and the transports.
pub(super) struct Routes {
    pub(super) view: Mutex<WorkerView>,
    /// Block reads over gRPC (every worker), and over the block data plane of workers
    /// that offer one (with this client's TLS identity where it has one).
    pub(super) grpc: crate::transport::GrpcTransport,
    pub(super) data_plane: Option<crate::transport::DataPlane>,
    pub(super) data_plane_on: AtomicBool,
    /// Deadline of one read from one source, in ms (see [`FileSystem::set_read_timeout`]).
    pub(super) read_timeout_ms: std::sync::atomic::AtomicU64,
}

impl Routes {
    pub(super) fn new(net: &granary_common::net::Net) -> Self {
        Self {
            view: Mutex::new(WorkerView::default()),
            grpc: crate::transport::GrpcTransport::new(net.clone()),
            data_plane: Some(crate::transport::DataPlane::new(net.tls().cloned())),
            data_plane_on: AtomicBool::new(true),
            read_timeout_ms: std::sync::atomic::AtomicU64::new(
                DEFAULT_READ_TIMEOUT.as_millis() as u64
            ),
        }
    }
}

impl FileSystem {
    pub(crate) async fn live_workers(&self) -> Vec<pb::WorkerInfo> {
        {
            let v = lock(&self.routes.view);
            if v.fetched.is_some_and(|t| t.elapsed() < WORKERS_TTL) {
                return v.workers.clone();
            }
        }
        match self.master.cluster_info(false).await {
            Ok(info) => {
                let live: Vec<pb::WorkerInfo> =
                    info.workers.into_iter().filter(|w| w.is_live()).collect();
                let mut v = lock(&self.routes.view);
                v.workers = live.clone();
                v.fetched = Some(Instant::now());
                live
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot refresh the worker list; using the last one");
                lock(&self.routes.view).workers.clone()
            }
        }
    }

    pub(crate) fn worker_client(
        &self,
        address: &str,
    ) -> Result<WorkerServiceClient<Channel>, ClientError> {
        self.routes.grpc.client(address)
    }

    /// The block data plane of the worker at `address`, when it offers one and it has not
    /// failed lately (and data planes are not turned off).
    fn data_address_of(&self, address: &str) -> Option<String> {
        let dp = self.routes.data_plane.as_ref()?;
        if !self.routes.data_plane_on.load(Ordering::Relaxed) {
            return None;
        }
        let v = lock(&self.routes.view);
        let w = v.workers.iter().find(|w| w.address == address)?;
        (!w.data_address.is_empty() && !dp.is_down(&w.data_address)).then(|| w.data_address.clone())
    }

    /// `desc` as `grant` describes its file (the master's word on the version the grant is
    /// for): a file persisted since its status was read has a fingerprint now, and workers
    /// serve a block only under a grant that binds the descriptor's terms. A write grant
    /// (from the file's creation) binds no length: the descriptor stays as it is.
    pub(crate) fn with_grant_terms(desc: &mut pb::BlockDescriptor, grant: Option<&pb::ReadGrant>) {
        let Some(g) = grant else { return };
        let same = desc
            .id
            .as_ref()
            .is_some_and(|id| id.inode == g.inode && id.version == g.version);
        if same && !g.write {
            desc.fingerprint = g.fingerprint.clone();
            desc.file_length = g.file_length;
            desc.block_size = g.block_size;
        }
    }

    pub(crate) fn descriptor(
        file: &pb::FileStatus,
        index: u64,
    ) -> Result<pb::BlockDescriptor, ClientError> {
        let ufs = file.ufs.clone().ok_or_else(|| {
            ClientError::precondition(format!("{} has no under-store copy to read", file.path))
        })?;
        Ok(pb::BlockDescriptor {
            id: Some(pb::BlockId {
                inode: file.inode,
                version: file.version,
                index: index as u32,
            }),
            ufs: Some(ufs),
            fingerprint: file.fingerprint.clone(),
            file_length: file.length,
            block_size: block_size(file),
        })
    }

    pub(super) async fn read_block_range(
        self: &Arc<Self>,
        file: &pb::FileStatus,
        index: u64,
        block_start: u64,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, ClientError> {
        let mut desc = Self::descriptor(file, index)?;
        let block_id = desc.id.unwrap_or_default();
        let mut grant = self.grant_for(file, false).await?;
        Self::with_grant_terms(&mut desc, grant.as_ref());
        // Two rounds: the cached worker list, then (if every worker in it failed) a fresh
        // list from the master, which may know a restarted worker's new address.
        let mut tried: Vec<String> = Vec::new();
        for round in 0..2 {
            if round == 1 {
                if tried.is_empty() {
                    break;
                }
                lock(&self.routes.view).fetched = None;
            }
            let mut candidates = order_workers(&block_id, &self.live_workers().await);
            // The placement owner (the worker a node copy is made from).
            let owner = candidates.first().map_or(0, |w| w.worker_id);
            candidates.retain(|w| !tried.contains(&w.address));
            {
                // Workers that failed recently go last.
                let v = lock(&self.routes.view);
                candidates.sort_by_key(|w| {
                    v.suspects
                        .get(&w.worker_id)
                        .is_some_and(|t| t.elapsed() < SUSPECT_FOR)
                });
            }
            let node_local = self.node_local() && file.persist_worker == 0;
            if node_local {
                // This node's worker first: it may hold a node copy (see crate::nodecopy).
                candidates.sort_by_key(|w| !self.short_circuit.same_node(w));
            }
            if file.persist_worker != 0 {
                // A file not in the under-store (yet): the worker that wrote it has it.
                candidates.sort_by_key(|w| w.worker_id != file.persist_worker);
            }
            for w in candidates {
                if self.short_circuit.applies_to(&w) {
                    if let Some(data) = self.read_local(&w, &block_id, offset, len).await {
                        self.metrics.add_read("short_circuit", data.len() as u64);
                        return Ok(data);
                    }
                }
                let same_node = self.short_circuit.same_node(&w);
                let node_copy = node_local && same_node && w.worker_id != owner;
                if node_copy && self.short_circuit.applies_to(&w) {
                    // Not cached on this node: read from the owner, then copy it here.
                    continue;
                }
                let mut res = self
                    .read_from_worker_opts(&w.address, &desc, offset, len, grant.clone(), node_copy)
                    .await;
                if matches!(&res, Err(e) if e.code() == ErrorCode::GrantRefused) {
                    // Expired on the way, or signed by a new leader whose key this worker
                    // gets with its next heartbeat: once more with a new grant.
                    tokio::time::sleep(GRANT_RETRY_PAUSE).await;
                    grant = self.grant_for(file, true).await?;
                    Self::with_grant_terms(&mut desc, grant.as_ref());
                    res = self
                        .read_from_worker_opts(
                            &w.address,
                            &desc,
                            offset,
                            len,
                            grant.clone(),
                            node_copy,
                        )
                        .await;
                }
                match res {
                    Ok((data, hit)) => {
                        self.metrics.add_read("worker", data.len() as u64);
                        if !same_node {
                            self.metrics.peer_read_bytes.inc_by(data.len() as u64);
                            if node_local {
                                self.copy_to_node(file, index);
                            }
                        }
                        if !hit && index == 0 && file.length <= block_size(file) {
                            self.note_cold_read(file);
                        }
                        return Ok(data);
                    }
                    // No peer has it yet: the owner reads it (from the store if need be).
                    Err(e) if node_copy && e.code() == ErrorCode::NotFound => {}
                    Err(e) if e.is_retryable() => {
                        tracing::warn!(worker = w.worker_id, address = %w.address, error = %e, "worker read failed; trying the next source");
                        self.metrics.worker_failures.inc();
                        lock(&self.routes.view)
                            .suspects
                            .insert(w.worker_id, Instant::now());
                        tried.push(w.address.clone());
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        let data = self.read_direct(file, block_start + offset, len).await?;
        self.metrics.add_read("under_store", data.len() as u64);
        Ok(data)
    }

    /// Reads a range of a block from a worker over gRPC: the bytes, and whether the worker
    /// had them all cached.
    pub(crate) async fn read_from_worker(
        &self,
        address: &str,
        desc: &pb::BlockDescriptor,
        offset: u64,
        len: u64,
        grant: Option<pb::ReadGrant>,
    ) -> Result<(Bytes, bool), ClientError> {
        self.read_from_worker_opts(address, desc, offset, len, grant, false)
            .await
    }

    /// [`read_from_worker`](Self::read_from_worker); `from_peers`: the worker is on this
    /// node but does not own the block, and is asked for its node copy (filled from peers
    /// only, never from the under-store; see `crate::nodecopy`).
    pub(crate) async fn read_from_worker_opts(
        &self,
        address: &str,
        desc: &pb::BlockDescriptor,
        offset: u64,
        len: u64,
        grant: Option<pb::ReadGrant>,
        from_peers: bool,
    ) -> Result<(Bytes, bool), ClientError> {
        let slots = lock(&self.routes.view)
            .slots
            .entry(address.to_string())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(MAX_READS_PER_WORKER)))
            .clone();
        let req = pb::ReadBlockRequest {
            block: Some(desc.clone()),
            offset,
            length: len,
            cache: true,
            cached_only: false,
            grant,
            from_peers,
        };
        let deadline = self.read_timeout();
        let data = self.data_address_of(address);
        let fut = async move {
            use crate::transport::{BlockTransport, DataPlaneError};
            // Waiting for a slot counts against the read's deadline.
            let _slot = slots
                .acquire_owned()
                .await
                .map_err(|e| ClientError::internal(e.to_string()))?;
            if let (Some(dp), Some(data)) = (&self.routes.data_plane, data) {
                match dp.read_from(&data, &req, deadline).await {
                    Ok(r) => return Ok(r),
                    Err(DataPlaneError::Refused(e)) => return Err(e),
                    Err(DataPlaneError::Stream(why)) => {
                        self.metrics.data_plane_failures.inc();
                        tracing::warn!(worker = %address, data_plane = %data, error = %why, "the block data plane failed; reading over gRPC (and leaving it alone for 30 s)");
                    }
                }
            }
            self.routes.grpc.read(address, req, deadline).await
        };
        match tokio::time::timeout(self.read_timeout(), fut).await {
            // A stream that ended cleanly but short (a worker's page task that died) is a
            // failed read of this source: the next one is tried, never short bytes served.
            Ok(Ok((got, _))) if got.len() as u64 != len => Err(ClientError::unavailable(format!(
                "worker {address} answered {} of the {len} bytes asked for",
                got.len()
            ))),
            Ok(r) => r,
            Err(_) => Err(ClientError::timeout(format!(
                "worker {address} did not finish a read within {:?}",
                self.read_timeout()
            ))),
        }
    }

    /// Reads straight from the under-store (no worker could serve), checking the object is
    /// still the version the namespace knows.
    pub async fn read_direct(
        &self,
        file: &pb::FileStatus,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, ClientError> {
        let loc = file.ufs.clone().ok_or_else(|| {
            ClientError::unavailable(format!(
                "no worker can serve {} and it has no under-store copy",
                file.path
            ))
        })?;
        // A version without a fingerprint is not in the under-store (yet): an async-through
        // or must-cache file whose cached copies are gone. What lies at its path is another
        // version (the object it replaced), never to be served for this one.
        let Some(fingerprint) = file.fingerprint.as_ref() else {
            return Err(ClientError::unavailable(format!(
                "no worker can serve {} (version {}) and the under-store does not have this \
                 version yet",
                file.path, file.version
            )));
        };
        let ufs = self.ufs.get(&self.master, loc.mount_id).await?;
        let expect = Some(granary_common::ufs::Expected::from(fingerprint));
        let fut = async {
            Ok::<_, ClientError>(
                ufs.read_range(&loc.path, expect.as_ref(), offset..offset + len)
                    .await?,
            )
        };
        match tokio::time::timeout(self.read_timeout(), fut).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::timeout(format!(
                "under-store read of {} timed out after {:?}",
                file.path,
                self.read_timeout()
            ))),
        }
    }
}
