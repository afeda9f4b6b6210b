//! Registration and heartbeats: a full block report on (re-)registration, deltas after.
//! Any failure makes the next round register again, so the master's soft state always
//! converges to what the worker holds (e.g. after a master restart).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use granary_client::MasterClient;
use granary_proto as pb;
use tokio_util::sync::CancellationToken;

use crate::metrics::WorkerMetrics;
use crate::store::BlockStore;

pub struct Heartbeat {
    pub master: MasterClient,
    pub store: Arc<dyn BlockStore>,
    pub metrics: WorkerMetrics,
    pub worker_id: u64,
    pub address: String,
    /// Where the block data plane serves (empty: it does not).
    pub data_address: String,
    pub host: String,
    pub interval: Duration,
    /// Where the leaders' grant-signing keys go.
    pub grant_keys: Arc<granary_common::grant::GrantKeys>,
    /// Where the number of workers the leader knows goes
    /// ([`note_workers`](crate::ufs_fetch::Fetcher::note_workers)).
    pub fetcher: Arc<crate::ufs_fetch::Fetcher>,
}

impl Heartbeat {
    fn stats(&self) -> pb::WorkerStats {
        let m = &self.metrics;
        pb::WorkerStats {
            capacity_bytes: self.store.capacity(),
            used_bytes: self.store.used(),
            cache_hit_bytes: m.cache_hit_bytes.get(),
            cache_miss_bytes: m.cache_miss_bytes.get(),
            ufs_read_bytes: m.ufs_read_bytes.get(),
            ufs_requests: m.ufs_requests.get(),
            evicted_bytes: m.evicted_bytes.get(),
            tiers: self
                .store
                .tiers()
                .into_iter()
                .map(|t| pb::TierUsage {
                    tier: t.tier,
                    capacity_bytes: t.capacity,
                    used_bytes: t.used,
                })
                .collect(),
            short_circuit_bytes: m.short_circuit_bytes.get(),
            peer_served_bytes: m.peer_served_bytes.get(),
            miss_latency_buckets: m.miss_latency.counts(),
            node_copy_bytes: m.node_copy_bytes.get(),
            peer_fill_bytes: m.peer_fill_bytes.get(),
        }
    }

    async fn register(&self) -> Result<Duration, granary_client::ClientError> {
        // Deltas are superseded by the full report.
        self.store.clear_deltas();
        let r = self
            .master
            .register_worker(pb::RegisterWorkerRequest {
                worker_id: self.worker_id,
                address: self.address.clone(),
                data_address: self.data_address.clone(),
                host: self.host.clone(),
                stats: Some(self.stats()),
                blocks: self.store.blocks(),
            })
            .await?;
        if let Some(k) = &r.grant_key {
            self.grant_keys.learn(k);
        }
        self.fetcher.note_workers(r.workers);
        Ok(Duration::from_millis(r.heartbeat_interval_ms).max(Duration::from_millis(100)))
    }

    /// Runs until `shutdown`.
    pub async fn run(
        self,
        shutdown: CancellationToken,
        registered: Arc<std::sync::atomic::AtomicBool>,
    ) {
        let mut interval = self.interval;
        let mut need_register = true;
        let mut logged_failure = false;
        let mut pins_generation = 0u64;
        loop {
            if need_register {
                match self.register().await {
                    Ok(i) => {
                        interval = i.min(self.interval.max(Duration::from_millis(100)));
                        need_register = false;
                        logged_failure = false;
                        registered.store(true, Relaxed);
                        tracing::info!(worker = self.worker_id, master = %self.master.address, "registered with the master");
                    }
                    Err(e) => {
                        if !logged_failure {
                            tracing::warn!(error = %e, "cannot register with the master; retrying");
                            logged_failure = true;
                        }
                    }
                }
            } else {
                // Leases end by time too: keep the gauge current.
                self.metrics
                    .active_leases
                    .set(self.store.lease_stats().0 as i64);
                let (added, removed) = self.store.take_deltas();
                match self
                    .master
                    .heartbeat(pb::WorkerHeartbeatRequest {
                        worker_id: self.worker_id,
                        stats: Some(self.stats()),
                        added_blocks: added,
                        removed_blocks: removed,
                        pins_generation,
                        pins_deltas: true,
                    })
                    .await
                {
                    Ok(r) if r.reregister => need_register = true,
                    Ok(r) => {
                        if let Some(k) = &r.grant_key {
                            self.grant_keys.learn(k);
                        }
                        self.fetcher.note_workers(r.workers);
                        if r.pins_changed {
                            let set: std::collections::HashSet<u64> =
                                r.pinned_inodes.iter().copied().collect();
                            tracing::info!(files = set.len(), "pinned files updated");
                            self.store.set_pinned(&set);
                            pins_generation = r.pins_generation;
                        } else if !r.pinned_added.is_empty() {
                            tracing::debug!(files = r.pinned_added.len(), "pinned files added");
                            self.store.add_pinned(&r.pinned_added);
                            pins_generation = r.pins_generation;
                        }
                        let files: Vec<(u64, u64)> =
                            r.stale.iter().map(|f| (f.inode, f.keep_version)).collect();
                        let freed = self.store.drop_stale_many(&files);
                        if freed > 0 {
                            tracing::info!(
                                files = files.len(),
                                freed,
                                "dropped cached pages of changed under-store objects"
                            );
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "heartbeat failed; will register again");
                        self.fetcher.note_workers(0);
                        need_register = true;
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}
