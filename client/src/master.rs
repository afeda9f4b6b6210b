//! Client of the master group: finds the leader among the configured masters, follows
//! `NotLeader` hints, and retries with a deadline. Mutations carry a request id chosen once
//! per call, so a retry after a leader change never applies twice.

use crate::ErrorCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use granary_common::net::{GrpcChannel as Channel, Net, ServerKind};
use granary_proto as pb;
use granary_proto::master_service_client::MasterServiceClient;

use crate::error::ClientError;

/// How long calls keep retrying while no leader answers.
pub const DEFAULT_RETRY_WINDOW: Duration = Duration::from_secs(20);
/// Deadline of one attempt at one master (a stopped master must not stall a caller longer).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long `SyncMetadata` (`granary fs sync`) may take: listings of big folders.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(3600);
/// `leader` keeps every namespace read of this process at the leader (`spread`, the
/// default, spreads them: see [`MasterClient::read`]).
pub const READS_ENV: &str = "GRANARY_MASTER_READS";
/// How long a master that did not answer a read is passed over by reads.
const READER_REST: Duration = Duration::from_secs(5);
/// Metadata key carrying the leader's address on a `NotLeader` status (set by the master).
pub use granary_proto::LEADER_HINT_KEY;

struct Endpoint {
    address: String,
    client: MasterServiceClient<Channel>,
    /// Namespace reads this client has in flight at this master (see
    /// [`MasterClient::read`]).
    reading: Arc<AtomicUsize>,
}

/// One read in flight at a master, counted until dropped.
struct Reading(Arc<AtomicUsize>);

impl Drop for Reading {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

tokio::task_local! {
    /// The local user a request is made for (see [`as_caller`]).
    static CALLER: (u32, u32);
}

/// Runs `fut` on behalf of local user `uid`/`gid` (a FUSE request's caller): the master
/// requests it makes carry them, and the master records them as the owner of what it
/// creates and checks the entries' modes against them.
pub async fn as_caller<F: std::future::Future>(uid: u32, gid: u32, fut: F) -> F::Output {
    CALLER.scope((uid, gid), fut).await
}

fn endpoint(net: &Net, address: &str) -> Result<Endpoint, ClientError> {
    let channel = net
        .channel(address, ServerKind::Master)
        .map_err(ClientError::invalid)?;
    Ok(Endpoint {
        reading: Arc::default(),
        address: address.to_string(),
        client: MasterServiceClient::new(channel)
            .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(pb::MAX_MESSAGE_BYTES),
    })
}

#[derive(Clone)]
pub struct MasterClient {
    endpoints: Arc<RwLock<Vec<Endpoint>>>,
    current: Arc<AtomicUsize>,
    /// Where ties between masters start (see [`MasterClient::next_reader`]).
    next_read: Arc<AtomicUsize>,
    /// Masters that did not answer a read lately, and until when they are passed over.
    resting: Arc<std::sync::Mutex<Vec<(String, tokio::time::Instant)>>>,
    /// Namespace reads go to every master in turn (true, the default), or to the leader.
    pub spread_reads: bool,
    /// The configured masters, comma-separated (for messages).
    pub address: String,
    pub rpc_timeout: Duration,
    pub retry_window: Duration,
    /// How the masters (and, for the client library, the workers) are reached.
    net: Net,
}

impl MasterClient {
    /// `addresses`: one `host:port`, or several separated by commas, reached over `net`
    /// (TCP with this caller's identity, or plaintext; a test's network with faults).
    pub fn new(net: Net, addresses: &str) -> Result<Self, ClientError> {
        let list: Vec<&str> = addresses
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .collect();
        if list.is_empty() {
            return Err(ClientError::invalid("no master address given"));
        }
        let endpoints = list
            .iter()
            .map(|a| endpoint(&net, a))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            endpoints: Arc::new(RwLock::new(endpoints)),
            current: Arc::default(),
            next_read: Arc::default(),
            resting: Arc::default(),
            spread_reads: std::env::var(READS_ENV).map_or(true, |v| v.trim() != "leader"),
            address: list.join(","),
            rpc_timeout: ATTEMPT_TIMEOUT,
            retry_window: DEFAULT_RETRY_WINDOW,
            net,
        })
    }

    /// The network this client reaches the cluster over.
    pub fn net(&self) -> &Net {
        &self.net
    }

    /// Sets how long calls retry while no leader answers (0 = one attempt).
    pub fn with_retry_window(mut self, window: Duration) -> Self {
        self.retry_window = window;
        self
    }

    /// Sends every namespace read to the leader (`false`) or spreads them over the group.
    pub fn with_spread_reads(mut self, spread: bool) -> Self {
        self.spread_reads = spread;
        self
    }

    /// The master calls currently go to.
    pub fn current_address(&self) -> String {
        self.pick().0
    }

    fn pick(&self) -> (String, MasterServiceClient<Channel>, usize) {
        let eps = match self.endpoints.read() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let i = self.current.load(Ordering::Relaxed) % eps.len().max(1);
        let e = &eps[i];
        (e.address.clone(), e.client.clone(), i)
    }

    /// Points calls at `address` (a leader hint), adding it if it is not configured.
    fn follow(&self, address: &str) {
        let mut eps = match self.endpoints.write() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let i = match eps.iter().position(|e| e.address == address) {
            Some(i) => i,
            None => match endpoint(&self.net, address) {
                Ok(e) => {
                    eps.push(e);
                    eps.len() - 1
                }
                Err(_) => return,
            },
        };
        self.current.store(i, Ordering::Relaxed);
    }

    fn rotate(&self, from: usize) {
        let n = match self.endpoints.read() {
            Ok(g) => g.len(),
            Err(p) => p.into_inner().len(),
        };
        let _ = self.current.compare_exchange(
            from,
            (from + 1) % n.max(1),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.set_timeout(self.rpc_timeout);
        if let Ok((uid, gid)) = CALLER.try_with(|c| *c) {
            let md = r.metadata_mut();
            md.insert(granary_proto::CALLER_UID_KEY, uid.into());
            md.insert(granary_proto::CALLER_GID_KEY, gid.into());
        }
        r
    }

    /// Runs a call against the leader, following hints and trying the other masters while
    /// they are unreachable or electing, until `window` has passed.
    async fn call_within<T, F, Fut>(&self, window: Duration, mut call: F) -> Result<T, ClientError>
    where
        F: FnMut(MasterServiceClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let start = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(20);
        let mut redirects = 0u32;
        loop {
            let (address, client, idx) = self.pick();
            let attempt = tokio::time::timeout(self.rpc_timeout, call(client)).await;
            let (err, hint) = match attempt {
                Ok(Ok(resp)) => return Ok(resp.into_inner()),
                Ok(Err(status)) => {
                    let hint = status
                        .metadata()
                        .get(LEADER_HINT_KEY)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    (
                        ClientError::from_status_with(status, Some(self.net.tls().is_some())),
                        hint,
                    )
                }
                Err(_) => (
                    ClientError::timeout(format!(
                        "master {address} did not answer within {:?}",
                        self.rpc_timeout
                    )),
                    None,
                ),
            };
            let retry = err.is_unreachable();
            if !retry {
                return Err(err);
            }
            let redirected = match hint {
                Some(h) if h != address => {
                    self.follow(&h);
                    true
                }
                _ => {
                    self.rotate(idx);
                    false
                }
            };
            if start.elapsed() + backoff > window {
                return Err(match err.code() {
                    ErrorCode::Unavailable => {
                        let m = format!("no master of {} answered as leader: {err}", self.address);
                        err.context(m)
                    }
                    _ => err,
                });
            }
            // Follow a fresh hint at once, but never spin: masters that point at each
            // other (mid-election) get the backoff too.
            redirects = if redirected { redirects + 1 } else { 0 };
            if !redirected || redirects > 2 {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }

    /// The master the next namespace read goes to: the one with the fewest reads of this
    /// client in flight, the master calls go to (the leader, as far as this client knows)
    /// among equals, then the others in turn; passing over those resting. A lone caller
    /// thus reads at the leader (a follower's answer costs one more round trip, to the
    /// leader for its commit index), and concurrent callers spread over the group as the
    /// leader gets busier. None: a single master, or reads kept at the leader.
    fn next_reader(&self) -> Option<(String, MasterServiceClient<Channel>, Reading)> {
        if !self.spread_reads {
            return None;
        }
        let eps = match self.endpoints.read() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if eps.len() < 2 {
            return None;
        }
        let now = tokio::time::Instant::now();
        let mut resting = match self.resting.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        resting.retain(|(_, until)| *until > now);
        let n = eps.len();
        let (lead, turn) = (
            self.current.load(Ordering::Relaxed) % n,
            self.next_read.fetch_add(1, Ordering::Relaxed),
        );
        let e = std::iter::once(lead)
            .chain((0..n).map(|i| (turn + i) % n))
            .map(|i| &eps[i])
            .filter(|e| !resting.iter().any(|(a, _)| *a == e.address))
            .min_by_key(|e| e.reading.load(Ordering::Relaxed))?;
        e.reading.fetch_add(1, Ordering::Relaxed);
        let guard = Reading(e.reading.clone());
        Some((e.address.clone(), e.client.clone(), guard))
    }

    /// Runs a namespace read (status, lookup, listing page) at the master
    /// [`MasterClient::next_reader`] picks: every master answers them linearizably (a
    /// follower once the leader has confirmed its commit index), so reads spread over the
    /// group. One a master cannot answer (a
    /// follower sends a folder due to be listed to the leader) or a master that does not
    /// answer passes the read to [`MasterClient::call`], which goes to the leader; a
    /// master that did not answer at all is passed over for a while.
    async fn read<T, F, Fut>(&self, mut call: F) -> Result<T, ClientError>
    where
        F: FnMut(MasterServiceClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        if let Some((address, client, reading)) = self.next_reader() {
            let attempt = tokio::time::timeout(self.rpc_timeout, call(client)).await;
            drop(reading);
            let silent = match attempt {
                Ok(Ok(resp)) => return Ok(resp.into_inner()),
                Ok(Err(status)) => {
                    // A follower sending the read on names the leader.
                    let redirected = status.metadata().get(LEADER_HINT_KEY).is_some();
                    match ClientError::from_status_with(status, Some(self.net.tls().is_some())) {
                        e if e.code() == ErrorCode::Unavailable => !redirected,
                        e => return Err(e),
                    }
                }
                Err(_) => true,
            };
            if silent {
                let until = tokio::time::Instant::now() + READER_REST;
                if let Ok(mut r) = self.resting.lock() {
                    r.push((address, until));
                }
            }
        }
        self.call(&mut call).await
    }

    async fn call<T, F, Fut>(&self, call: F) -> Result<T, ClientError>
    where
        F: FnMut(MasterServiceClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.call_within(self.retry_window, call).await
    }

    /// A fresh id for one logical mutation (kept across its retries).
    fn request_id() -> u64 {
        rand::random::<u64>() | 1
    }

    pub async fn get_status(
        &self,
        target: pb::path_or_id::Target,
    ) -> Result<pb::FileStatus, ClientError> {
        self.get_status_opts(target, false).await
    }

    /// `validate`: the caller opens the file — in a validate-on-open mount the master checks
    /// the object's fingerprint first.
    pub async fn get_status_opts(
        &self,
        target: pb::path_or_id::Target,
        validate: bool,
    ) -> Result<pb::FileStatus, ClientError> {
        let r = self
            .read(|mut c| {
                let req = self.request(pb::GetStatusRequest {
                    target: Some(pb::PathOrId {
                        target: Some(target.clone()),
                    }),
                    allow_stale: false,
                    validate,
                });
                async move { c.get_status(req).await }
            })
            .await
            .map_err(|e| at_target(e, &target))?;
        r.status
            .ok_or_else(|| ClientError::internal("master returned no status"))
    }

    /// Lists mounted directories from their under-stores now. Waits up to
    /// [`SYNC_TIMEOUT`]: a folder of millions of objects lists for minutes, and a call cut
    /// short would cancel its listing (and a retry start it again).
    /// This client, waiting up to [`SYNC_TIMEOUT`] per attempt when `long`.
    fn long_if(&self, long: bool) -> MasterClient {
        let mut c = self.clone();
        if long {
            c.rpc_timeout = self.rpc_timeout.max(SYNC_TIMEOUT);
        }
        c
    }

    pub async fn sync_metadata(
        &self,
        path: &str,
        recursive: bool,
    ) -> Result<pb::SyncMetadataResponse, ClientError> {
        let long = self.long_if(true);
        long.call(|mut c| {
            let req = long.request(pb::SyncMetadataRequest {
                path: path.to_string(),
                recursive,
            });
            async move { c.sync_metadata(req).await }
        })
        .await
        .map_err(|e| e.at(path))
    }

    /// Opens a namespace watch on the leader (`WatchNamespace`): a stream with no deadline
    /// (only its opening is bounded by the call timeout).
    pub async fn watch_namespace(
        &self,
    ) -> Result<tonic::Streaming<pb::NamespaceChanges>, ClientError> {
        self.call(|mut c| async move {
            c.watch_namespace(tonic::Request::new(pb::WatchNamespaceRequest {}))
                .await
        })
        .await
    }

    pub async fn lookup(&self, parent: u64, name: &str) -> Result<pb::FileStatus, ClientError> {
        let r = self
            .read(|mut c| {
                let req = self.request(pb::LookupRequest {
                    parent,
                    name: name.to_string(),
                });
                async move { c.lookup(req).await }
            })
            .await?;
        r.status
            .ok_or_else(|| ClientError::internal("master returned no status"))
    }

    /// One page of a directory listing. `stale`: read the first configured master's own
    /// state without involving the leader (diagnostics).
    pub async fn list_page(
        &self,
        target: pb::path_or_id::Target,
        page_token: String,
        page_size: u32,
        stale: bool,
    ) -> Result<pb::ListStatusResponse, ClientError> {
        let make = |c: MasterServiceClient<Channel>| {
            let req = self.request(pb::ListStatusRequest {
                target: Some(pb::PathOrId {
                    target: Some(target.clone()),
                }),
                page_token: page_token.clone(),
                page_size,
                allow_stale: stale,
            });
            let mut c = c;
            async move { c.list_status(req).await }
        };
        if stale {
            let (_, client, _) = self.pick();
            return make(client)
                .await
                .map(|r| r.into_inner())
                .map_err(|s| at_target(ClientError::from_status(s), &target));
        }
        self.read(make).await.map_err(|e| at_target(e, &target))
    }

    pub async fn mkdir(
        &self,
        path: &str,
        recursive: bool,
        mode: u32,
    ) -> Result<pb::FileStatus, ClientError> {
        let request_id = Self::request_id();
        let r = self
            .call(|mut c| {
                let req = self.request(pb::MkdirRequest {
                    path: path.to_string(),
                    recursive,
                    mode,
                    request_id,
                });
                async move { c.mkdir(req).await }
            })
            .await
            .map_err(|e| e.at(path))?;
        r.status
            .ok_or_else(|| ClientError::internal("master returned no status"))
    }

    /// Creates a file to write (`overwrite`: replace an existing one, same inode, new
    /// version). The answer carries the version the written pages are cached under.
    pub async fn create_file(
        &self,
        path: &str,
        mode: u32,
        overwrite: bool,
    ) -> Result<pb::FileStatus, ClientError> {
        let request_id = Self::request_id();
        let r = self
            .call(|mut c| {
                let req = self.request(pb::CreateFileRequest {
                    path: path.to_string(),
                    mode,
                    block_size: 0,
                    request_id,
                    overwrite,
                });
                async move { c.create_file(req).await }
            })
            .await
            .map_err(|e| e.at(path))?;
        r.status
            .ok_or_else(|| ClientError::internal("master returned no status"))
    }

    /// Completes a written file (the request's `request_id` is filled in here).
    pub async fn complete_file(
        &self,
        mut req: pb::CompleteFileRequest,
    ) -> Result<pb::FileStatus, ClientError> {
        req.request_id = Self::request_id();
        let r = self
            .call(|mut c| {
                let req = self.request(req.clone());
                async move { c.complete_file(req).await }
            })
            .await?;
        r.status
            .ok_or_else(|| ClientError::internal("master returned no status"))
    }

    /// Records that a pending file was uploaded; false when the upload is stale.
    pub async fn file_persisted(&self, req: pb::FilePersistedRequest) -> Result<bool, ClientError> {
        let r = self
            .call(|mut c| {
                let req = self.request(req.clone());
                async move { c.file_persisted(req).await }
            })
            .await?;
        Ok(r.recorded)
    }

    /// Deletes `path`. A recursive delete waits up to [`SYNC_TIMEOUT`]: the master removes a
    /// big folder's objects one by one and its entries in bounded steps (minutes for
    /// millions), and a call cut short would stop it part-way.
    pub async fn delete(&self, path: &str, recursive: bool) -> Result<(), ClientError> {
        let request_id = Self::request_id();
        let this = self.long_if(recursive);
        this.call(|mut c| {
            let req = this.request(pb::DeleteRequest {
                path: path.to_string(),
                recursive,
                request_id,
            });
            async move { c.delete(req).await }
        })
        .await
        .map_err(|e| e.at(path))?;
        Ok(())
    }

    pub async fn rename(&self, src: &str, dst: &str) -> Result<pb::FileStatus, ClientError> {
        let request_id = Self::request_id();
        let r = self
            .call(|mut c| {
                let req = self.request(pb::RenameRequest {
                    src: src.to_string(),
                    dst: dst.to_string(),
                    request_id,
                });
                async move { c.rename(req).await }
            })
            .await
            .map_err(|e| e.at(src))?;
        r.status
            .ok_or_else(|| ClientError::internal("master returned no status"))
    }

    pub async fn add_mount(
        &self,
        path: &str,
        uri: &str,
        options: Vec<pb::MountOptionEntry>,
    ) -> Result<pb::MountInfo, ClientError> {
        let request_id = Self::request_id();
        let r = self
            .call(|mut c| {
                let req = self.request(pb::AddMountRequest {
                    path: path.to_string(),
                    uri: uri.to_string(),
                    options: options.clone(),
                    request_id,
                });
                async move { c.add_mount(req).await }
            })
            .await
            .map_err(|e| e.at(path))?;
        r.mount
            .ok_or_else(|| ClientError::internal("master returned no mount"))
    }

    /// Removes the mount at `path` (`force`: even with files not in its store yet).
    /// Removes the mount at `path`; waits as a recursive delete does (the entries cached
    /// below it go in bounded steps).
    pub async fn remove_mount(&self, path: &str, force: bool) -> Result<(), ClientError> {
        let request_id = Self::request_id();
        let this = self.long_if(true);
        this.call(|mut c| {
            let req = this.request(pb::RemoveMountRequest {
                path: path.to_string(),
                request_id,
                force,
            });
            async move { c.remove_mount(req).await }
        })
        .await
        .map_err(|e| e.at(path))
        .map(|_| ())
    }

    pub async fn list_mounts(&self) -> Result<Vec<pb::MountInfo>, ClientError> {
        let r = self
            .call(|mut c| {
                let req = self.request(pb::ListMountsRequest {});
                async move { c.list_mounts(req).await }
            })
            .await?;
        Ok(r.mounts)
    }

    pub async fn mount_access(
        &self,
        mount_id: u64,
    ) -> Result<pb::GetMountAccessResponse, ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::GetMountAccessRequest { mount_id });
            async move { c.get_mount_access(req).await }
        })
        .await
    }

    /// The cluster as the leader sees it. `any_master`: the first master that answers,
    /// leader or not (to inspect a group without quorum; no workers then).
    pub async fn cluster_info(
        &self,
        any_master: bool,
    ) -> Result<pb::GetClusterInfoResponse, ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::GetClusterInfoRequest {
                allow_stale: any_master,
            });
            async move { c.get_cluster_info(req).await }
        })
        .await
    }

    pub async fn add_master(
        &self,
        id: u64,
        address: &str,
    ) -> Result<Vec<pb::MasterInfo>, ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::AddMasterRequest {
                id,
                address: address.to_string(),
            });
            async move { c.add_master(req).await }
        })
        .await
        .map(|r| r.masters)
    }

    pub async fn remove_master(&self, id: u64) -> Result<Vec<pb::MasterInfo>, ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::RemoveMasterRequest { id });
            async move { c.remove_master(req).await }
        })
        .await
        .map(|r| r.masters)
    }

    /// Worker registration: a short window, so a worker moves on to the new leader quickly.
    pub async fn register_worker(
        &self,
        req: pb::RegisterWorkerRequest,
    ) -> Result<pb::RegisterWorkerResponse, ClientError> {
        self.call_within(Duration::from_secs(3), |mut c| {
            let r = self.request(req.clone());
            async move { c.register_worker(r).await }
        })
        .await
    }

    pub async fn heartbeat(
        &self,
        req: pb::WorkerHeartbeatRequest,
    ) -> Result<pb::WorkerHeartbeatResponse, ClientError> {
        self.call_within(Duration::from_secs(3), |mut c| {
            let r = self.request(req.clone());
            async move { c.worker_heartbeat(r).await }
        })
        .await
    }

    /// Stops placing blocks on worker `worker_id` (it keeps serving peers until stopped).
    /// Starts a job (`kind` "load") on `path`; retried with one request id across leader
    /// changes, so it starts once.
    pub async fn start_job(
        &self,
        kind: pb::JobKind,
        path: &str,
        replicas: u32,
    ) -> Result<pb::JobInfo, ClientError> {
        let request_id = Self::request_id();
        self.call(|mut c| {
            let req = self.request(pb::StartJobRequest {
                // The text too: an older master reads only that.
                kind: kind.text().to_string(),
                kind_code: kind as i32,
                path: path.to_string(),
                replicas,
                request_id,
            });
            async move { c.start_job(req).await }
        })
        .await
        .map_err(|e| e.at(path))
    }

    /// Pins `path` on `replicas` workers (0: unpins it); pinning returns the load job it
    /// started, unpinning a job with id 0.
    pub async fn set_pin(&self, path: &str, replicas: u32) -> Result<pb::JobInfo, ClientError> {
        let request_id = Self::request_id();
        self.call(|mut c| {
            let req = self.request(pb::SetPinRequest {
                path: path.to_string(),
                replicas,
                request_id,
            });
            async move { c.set_pin(req).await }
        })
        .await
        .map_err(|e| e.at(path))
    }

    /// Sets the TTL of `path` (`ttl_ms` 0: removes it); returns when it is due (ms since
    /// the Unix epoch, 0 when removed).
    pub async fn set_ttl(
        &self,
        path: &str,
        ttl_ms: u64,
        action: pb::TtlAction,
    ) -> Result<u64, ClientError> {
        let request_id = Self::request_id();
        self.call(|mut c| {
            let req = self.request(pb::SetTtlRequest {
                path: path.to_string(),
                ttl_ms,
                action: action.text().to_string(),
                action_code: action as i32,
                request_id,
            });
            async move { c.set_ttl(req).await }
        })
        .await
        .map_err(|e| e.at(path))
        .map(|r| r.expires_ms)
    }

    /// Drops the cached copies of `path` on every worker (see the master's `Free`).
    pub async fn free(
        &self,
        path: &str,
        recursive: bool,
        force: bool,
    ) -> Result<pb::FreeResponse, ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::FreeRequest {
                path: path.to_string(),
                recursive,
                force,
            });
            async move { c.free(req).await }
        })
        .await
        .map_err(|e| e.at(path))
    }

    /// A job with up to `max_failed` of its failed files (0: 1,000).
    pub async fn get_job(&self, id: u64, max_failed: u32) -> Result<pb::JobInfo, ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::GetJobRequest { id, max_failed });
            async move { c.get_job(req).await }
        })
        .await
    }

    pub async fn list_jobs(&self) -> Result<Vec<pb::JobInfo>, ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::ListJobsRequest {});
            async move { c.list_jobs(req).await }
        })
        .await
        .map(|r| r.jobs)
    }

    pub async fn cancel_job(&self, id: u64) -> Result<pb::JobInfo, ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::GetJobRequest { id, max_failed: 0 });
            async move { c.cancel_job(req).await }
        })
        .await
    }

    /// Decommissions a worker (`force`: even the last one in service).
    pub async fn decommission_worker(
        &self,
        worker_id: u64,
        force: bool,
    ) -> Result<(), ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::DecommissionWorkerRequest { worker_id, force });
            async move { c.decommission_worker(req).await }
        })
        .await
        .map(|_| ())
    }

    /// Undoes [`MasterClient::decommission_worker`].
    pub async fn recommission_worker(&self, worker_id: u64) -> Result<(), ClientError> {
        self.call(|mut c| {
            let req = self.request(pb::RecommissionWorkerRequest { worker_id });
            async move { c.recommission_worker(req).await }
        })
        .await
        .map(|_| ())
    }

    /// Workers the master knows to hold (pages of) each of `blocks`.
    pub async fn block_locations(
        &self,
        blocks: Vec<pb::BlockId>,
    ) -> Result<Vec<pb::BlockLocations>, ClientError> {
        self.call_within(Duration::from_millis(300), |mut c| {
            let req = self.request(pb::GetBlockLocationsRequest {
                blocks: blocks.clone(),
            });
            async move { c.get_block_locations(req).await }
        })
        .await
        .map(|r| r.locations)
    }
}

/// The error, naming the path it concerns when the target is one.
fn at_target(e: ClientError, target: &pb::path_or_id::Target) -> ClientError {
    match target {
        pb::path_or_id::Target::Path(p) => e.at(p.as_str()),
        _ => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lone reader reads at the master calls go to; concurrent reads go where fewest of
    /// this client's reads are in flight; a resting master is passed over; reads kept at
    /// the leader pick none.
    #[tokio::test]
    async fn reads_go_where_fewest_are_in_flight_the_leader_among_equals() {
        let c = MasterClient::new(
            granary_common::net::Tcp::plain(),
            "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
        )
        .unwrap();
        c.follow("127.0.0.1:2");
        let one = c.next_reader().unwrap();
        assert_eq!(one.0, "127.0.0.1:2");
        drop(one);
        assert_eq!(
            c.next_reader().unwrap().0,
            "127.0.0.1:2",
            "a lone reader moved"
        );
        let mut held = vec![c.next_reader().unwrap()];
        held.push(c.next_reader().unwrap());
        held.push(c.next_reader().unwrap());
        let mut got: Vec<String> = held.iter().map(|(a, ..)| a.clone()).collect();
        got.sort();
        assert_eq!(got, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]);
        held.push(c.next_reader().unwrap());
        assert_eq!(held[3].0, "127.0.0.1:2", "the leader among equals");
        drop(held);
        c.resting.lock().unwrap().push((
            "127.0.0.1:2".into(),
            tokio::time::Instant::now() + READER_REST,
        ));
        assert_ne!(
            c.next_reader().unwrap().0,
            "127.0.0.1:2",
            "a resting master was picked"
        );
        assert!(c.clone().with_spread_reads(false).next_reader().is_none());
    }
}
