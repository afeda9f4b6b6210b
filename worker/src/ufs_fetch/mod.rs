//! Read-through fills: ranged GETs from the under-store, one fetch per page however many
//! readers miss it at once (single-flight), verified against the file's fingerprint.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use granary_client::mounts::MountStores;
use granary_client::MasterClient;
use granary_proto as pb;
use tokio::sync::OnceCell;

use crate::metrics::WorkerMetrics;
use crate::store::{PageKey, PageStore};

/// Read-ahead fetches in flight at most, across all readers of this worker.
pub const PREFETCH_IN_FLIGHT: usize = 8;

/// Deadline of one under-store GET.
pub const UFS_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    #[error("the file changed in the under-store (fingerprint mismatch): {0}")]
    Changed(String),
    #[error("not found in the under-store: {0}")]
    NotFound(String),
    #[error("the under-store refused access: {0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Unavailable(String),
}

impl From<FetchError> for tonic::Status {
    fn from(e: FetchError) -> Self {
        match &e {
            FetchError::Changed(_) => tonic::Status::aborted(e.to_string()),
            FetchError::NotFound(_) => tonic::Status::not_found(e.to_string()),
            FetchError::PermissionDenied(_) => tonic::Status::permission_denied(e.to_string()),
            FetchError::Unavailable(_) => tonic::Status::unavailable(e.to_string()),
        }
    }
}

type Flight = Arc<OnceCell<Result<Bytes, FetchError>>>;

pub struct Fetcher {
    /// Bounds the read-ahead fetches in flight across all readers.
    prefetch_slots: Arc<tokio::sync::Semaphore>,
    master: MasterClient,
    stores: MountStores,
    inflight: Mutex<HashMap<PageKey, Flight>>,
    pub store: Arc<PageStore>,
    metrics: WorkerMetrics,
}

/// Where a served page came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Cache,
    UnderStore,
}

impl Fetcher {
    pub fn new(master: MasterClient, store: Arc<PageStore>, metrics: WorkerMetrics) -> Self {
        Self {
            prefetch_slots: Arc::new(tokio::sync::Semaphore::new(PREFETCH_IN_FLIGHT)),
            master,
            stores: MountStores::default(),
            inflight: Mutex::new(HashMap::new()),
            store,
            metrics,
        }
    }

    /// Fetches and caches `pages` of a block in the background (read-ahead), each through
    /// the same single-flight path as reads, so a reader arriving meanwhile joins the fetch.
    /// Skipped when the cache is small (read-ahead would evict what is about to be read)
    /// and bounded by [`PREFETCH_IN_FLIGHT`]; pages already cached cost nothing.
    pub fn prefetch(
        self: Arc<Self>,
        desc: pb::BlockDescriptor,
        block: crate::store::BlockKey,
        block_start: u64,
        block_len: u64,
        pages: std::ops::RangeInclusive<u64>,
    ) {
        let ps = self.store.page_size;
        let window = (pages.end() - pages.start() + 1) * ps;
        if self.store.capacity < 16 * window {
            return;
        }
        tokio::spawn(async move {
            for page in pages {
                let key = (block, page as u32);
                if self.store.get(&key).is_some() {
                    continue;
                }
                let Ok(permit) = self.prefetch_slots.clone().try_acquire_owned() else {
                    return; // busy enough: readers will fetch what they need
                };
                let me = self.clone();
                let desc = desc.clone();
                tokio::spawn(async move {
                    let page_start = page * ps;
                    let len = ps.min(block_len - page_start);
                    if me
                        .page(&desc, key, block_start + page_start, len, true)
                        .await
                        .is_ok()
                    {
                        me.metrics.prefetched_pages.inc();
                    }
                    drop(permit);
                });
            }
        });
    }

    /// Returns page `key` of the block described by `desc`: from the cache, or fetched once
    /// from the under-store and (if `cache`) admitted.
    pub async fn page(
        &self,
        desc: &pb::BlockDescriptor,
        key: PageKey,
        file_offset: u64,
        len: u64,
        cache: bool,
    ) -> Result<(Bytes, Source), FetchError> {
        if let Some(b) = self.store.get(&key) {
            return Ok((b, Source::Cache));
        }
        let flight = {
            let mut m = match self.inflight.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            m.entry(key).or_default().clone()
        };
        let result = flight
            .get_or_init(|| async {
                // Filled while we queued for the flight?
                if let Some(b) = self.store.get(&key) {
                    return Ok(b);
                }
                let data = self.fetch(desc, file_offset, len).await?;
                if cache {
                    match self.store.reserve(data.len() as u64) {
                        Some(r) => {
                            if let Err(e) = self.store.commit(r, key, &data) {
                                tracing::warn!(error = %e, "cannot cache a page; serving it uncached");
                            }
                        }
                        None => {
                            self.metrics.uncached_fills.inc();
                        }
                    }
                }
                Ok(data)
            })
            .await
            .clone();
        if let Ok(mut m) = self.inflight.lock() {
            if m.get(&key).is_some_and(|f| Arc::ptr_eq(f, &flight)) {
                m.remove(&key);
            }
        }
        result.map(|b| (b, Source::UnderStore))
    }

    async fn fetch(
        &self,
        desc: &pb::BlockDescriptor,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, FetchError> {
        let loc = desc
            .ufs
            .as_ref()
            .ok_or_else(|| FetchError::Unavailable("block has no under-store location".into()))?;
        let ufs = self
            .stores
            .get(&self.master, loc.mount_id)
            .await
            .map_err(|e| FetchError::Unavailable(e.to_string()))?;
        let expect = desc
            .fingerprint
            .as_ref()
            .map(granary_common::ufs::Expected::from);
        self.metrics.ufs_requests.inc();
        let op = crate::metrics::UfsMetrics::op(loc.mount_id, "get");
        self.metrics.ufs.requests.get_or_create(&op).inc();
        let started = std::time::Instant::now();
        let fut = ufs.read_range(&loc.path, expect.as_ref(), offset..offset + len);
        let res = tokio::time::timeout(UFS_TIMEOUT, fut).await;
        self.metrics
            .ufs
            .seconds
            .get_or_create(&op)
            .observe(started.elapsed().as_secs_f64());
        let data = match res {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                self.metrics.ufs_errors.inc();
                let (kind, err) = match e {
                    object_store::Error::Precondition { source, .. } => {
                        tracing::warn!(path = %loc.path, reason = %source, "under-store object changed; not served");
                        (
                            "changed",
                            FetchError::Changed(format!("{} ({source})", loc.path)),
                        )
                    }
                    object_store::Error::NotFound { .. } => {
                        ("not_found", FetchError::NotFound(loc.path.clone()))
                    }
                    e if granary_common::ufs::is_access_denied(&e) => {
                        tracing::warn!(path = %loc.path, error = %e, "under-store refused access");
                        ("denied", FetchError::PermissionDenied(loc.path.clone()))
                    }
                    e => {
                        let message = format!("under-store read of {} failed: {e}", loc.path);
                        tracing::warn!(error = %message, "under-store read failed");
                        ("failed", FetchError::Unavailable(message))
                    }
                };
                self.metrics.ufs.error(loc.mount_id, "get", kind);
                return Err(err);
            }
            Err(_) => {
                self.metrics.ufs_errors.inc();
                self.metrics.ufs.error(loc.mount_id, "get", "timeout");
                return Err(FetchError::Unavailable(format!(
                    "under-store read of {} timed out after {UFS_TIMEOUT:?}",
                    loc.path
                )));
            }
        };
        self.metrics.ufs_read_bytes.inc_by(data.len() as u64);
        self.metrics
            .ufs
            .bytes
            .get_or_create(&op)
            .inc_by(data.len() as u64);
        if data.len() as u64 != len {
            return Err(FetchError::Changed(format!(
                "{}: expected {len} bytes at {offset}, the under-store returned {}",
                loc.path,
                data.len()
            )));
        }
        Ok(data)
    }
}
