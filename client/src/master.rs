//! Client of the master service: deadlines, and retries of idempotent calls while the
//! master is unreachable (restarting, electing).

use std::time::Duration;

use granary_common::grpc;
use granary_proto as pb;
use granary_proto::master_service_client::MasterServiceClient;
use tonic::transport::Channel;

use crate::error::ClientError;

/// How long idempotent calls keep retrying an unreachable master.
pub const DEFAULT_RETRY_WINDOW: Duration = Duration::from_secs(20);

#[derive(Clone)]
pub struct MasterClient {
    client: MasterServiceClient<Channel>,
    pub address: String,
    pub rpc_timeout: Duration,
    pub retry_window: Duration,
}

impl MasterClient {
    pub fn new(address: &str) -> Result<Self, ClientError> {
        let channel = grpc::channel(address).map_err(|e| {
            ClientError::InvalidArgument(format!("invalid master address {address:?}: {e}"))
        })?;
        Ok(Self {
            client: MasterServiceClient::new(channel)
                .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(pb::MAX_MESSAGE_BYTES),
            address: address.to_string(),
            rpc_timeout: grpc::RPC_TIMEOUT,
            retry_window: DEFAULT_RETRY_WINDOW,
        })
    }

    /// Sets how long idempotent calls retry an unreachable master (0 = no retry).
    pub fn with_retry_window(mut self, window: Duration) -> Self {
        self.retry_window = window;
        self
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.set_timeout(self.rpc_timeout);
        r
    }

    /// Runs an idempotent call, retrying transport failures with backoff within the window.
    async fn idempotent<T, F, Fut>(&self, mut call: F) -> Result<T, ClientError>
    where
        F: FnMut(MasterServiceClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let start = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(50);
        loop {
            let attempt = tokio::time::timeout(self.rpc_timeout, call(self.client.clone())).await;
            let err = match attempt {
                Ok(Ok(resp)) => return Ok(resp.into_inner()),
                Ok(Err(status)) => ClientError::from_status(status),
                Err(_) => ClientError::Timeout(format!(
                    "master {} did not answer within {:?}",
                    self.address, self.rpc_timeout
                )),
            };
            let retry = matches!(err, ClientError::Unavailable(_));
            if !retry || start.elapsed() + backoff > self.retry_window {
                return Err(match err {
                    ClientError::Unavailable(m) => ClientError::Unavailable(format!(
                        "master {} is unavailable: {m}",
                        self.address
                    )),
                    e => e,
                });
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    async fn once<T, Fut>(&self, fut: Fut) -> Result<T, ClientError>
    where
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(self.rpc_timeout, fut).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(match ClientError::from_status(s) {
                ClientError::Unavailable(m) => {
                    ClientError::Unavailable(format!("master {} is unavailable: {m}", self.address))
                }
                e => e,
            }),
            Err(_) => Err(ClientError::Timeout(format!(
                "master {} did not answer within {:?}",
                self.address, self.rpc_timeout
            ))),
        }
    }

    pub async fn get_status(
        &self,
        target: pb::path_or_id::Target,
    ) -> Result<pb::FileStatus, ClientError> {
        let r = self
            .idempotent(|mut c| {
                let req = self.request(pb::GetStatusRequest {
                    target: Some(pb::PathOrId {
                        target: Some(target.clone()),
                    }),
                });
                async move { c.get_status(req).await }
            })
            .await?;
        r.status
            .ok_or_else(|| ClientError::Internal("master returned no status".into()))
    }

    pub async fn lookup(&self, parent: u64, name: &str) -> Result<pb::FileStatus, ClientError> {
        let r = self
            .idempotent(|mut c| {
                let req = self.request(pb::LookupRequest {
                    parent,
                    name: name.to_string(),
                });
                async move { c.lookup(req).await }
            })
            .await?;
        r.status
            .ok_or_else(|| ClientError::Internal("master returned no status".into()))
    }

    pub async fn list_page(
        &self,
        target: pb::path_or_id::Target,
        page_token: String,
        page_size: u32,
    ) -> Result<pb::ListStatusResponse, ClientError> {
        self.idempotent(|mut c| {
            let req = self.request(pb::ListStatusRequest {
                target: Some(pb::PathOrId {
                    target: Some(target.clone()),
                }),
                page_token: page_token.clone(),
                page_size,
            });
            async move { c.list_status(req).await }
        })
        .await
    }

    pub async fn add_mount(
        &self,
        path: &str,
        uri: &str,
        options: Vec<pb::MountOptionEntry>,
    ) -> Result<pb::MountInfo, ClientError> {
        let mut c = self.client.clone();
        let req = self.request(pb::AddMountRequest {
            path: path.to_string(),
            uri: uri.to_string(),
            options,
            request_id: 0,
        });
        let r = self.once(c.add_mount(req)).await?;
        r.mount
            .ok_or_else(|| ClientError::Internal("master returned no mount".into()))
    }

    pub async fn remove_mount(&self, path: &str) -> Result<(), ClientError> {
        let mut c = self.client.clone();
        let req = self.request(pb::RemoveMountRequest {
            path: path.to_string(),
            request_id: 0,
        });
        self.once(c.remove_mount(req)).await.map(|_| ())
    }

    pub async fn list_mounts(&self) -> Result<Vec<pb::MountInfo>, ClientError> {
        let r = self
            .idempotent(|mut c| {
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
        self.idempotent(|mut c| {
            let req = self.request(pb::GetMountAccessRequest { mount_id });
            async move { c.get_mount_access(req).await }
        })
        .await
    }

    pub async fn cluster_info(&self) -> Result<pb::GetClusterInfoResponse, ClientError> {
        self.idempotent(|mut c| {
            let req = self.request(pb::GetClusterInfoRequest {});
            async move { c.get_cluster_info(req).await }
        })
        .await
    }

    pub async fn register_worker(
        &self,
        req: pb::RegisterWorkerRequest,
    ) -> Result<pb::RegisterWorkerResponse, ClientError> {
        let mut c = self.client.clone();
        self.once(c.register_worker(self.request(req))).await
    }

    pub async fn heartbeat(
        &self,
        req: pb::WorkerHeartbeatRequest,
    ) -> Result<pb::WorkerHeartbeatResponse, ClientError> {
        let mut c = self.client.clone();
        self.once(c.worker_heartbeat(self.request(req))).await
    }
}
