//! A cache disk that fails on purpose: [`FaultyStore`] goes in front of any [`BlockStore`]
//! and, while a rule of its [`DiskFaults`] is on, fails page writes with an I/O error (a
//! full or dying disk) or loses pages at read (as a page whose read or checksum fails is
//! lost: dropped, not served). Rules can be turned on and off while the worker runs; what
//! they did is counted. In-process tests give each worker one (`WorkerConfig::disk_faults`).

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use granary_proto as pb;

use super::{BlockKey, BlockStore, Lease, PageKey, Reservation, StoreError, TierUsage};

/// The rules of one cache disk, shared between a test and the worker's store.
#[derive(Debug, Default)]
pub struct DiskFaults {
    /// Page writes fail with EIO (the reservation is released, nothing is recorded).
    pub fail_writes: AtomicBool,
    /// Page reads find nothing, and the page is dropped from the cache.
    pub lose_reads: AtomicBool,
    /// Writes failed and reads lost so far.
    pub writes_failed: AtomicU64,
    pub reads_lost: AtomicU64,
}

/// A [`BlockStore`] whose disk fails by [`DiskFaults`]' rules.
pub struct FaultyStore {
    inner: Arc<dyn BlockStore>,
    faults: Arc<DiskFaults>,
}

impl FaultyStore {
    pub fn wrap(inner: Arc<dyn BlockStore>, faults: Arc<DiskFaults>) -> Arc<dyn BlockStore> {
        Arc::new(Self { inner, faults })
    }

    fn write_fails(&self) -> Result<(), StoreError> {
        if !self.faults.fail_writes.load(Relaxed) {
            return Ok(());
        }
        self.faults.writes_failed.fetch_add(1, Relaxed);
        Err(StoreError::Io {
            path: "(injected disk fault)".into(),
            source: std::io::Error::from_raw_os_error(nix::libc::EIO),
        })
    }
}

impl BlockStore for FaultyStore {
    fn page_size(&self) -> u64 {
        self.inner.page_size()
    }
    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }
    fn tiers(&self) -> Vec<TierUsage> {
        self.inner.tiers()
    }
    fn reserve(&self, key: &PageKey, len: u64) -> Option<Reservation> {
        self.inner.reserve(key, len)
    }
    fn commit(
        &self,
        r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
    ) -> Result<(), StoreError> {
        self.write_fails()?;
        self.inner.commit(r, key, block_size, data)
    }
    fn reserve_node_copy(&self, key: &PageKey, len: u64) -> Option<Reservation> {
        self.inner.reserve_node_copy(key, len)
    }
    fn commit_node_copy(
        &self,
        r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
    ) -> Result<(), StoreError> {
        self.write_fails()?;
        self.inner.commit_node_copy(r, key, block_size, data)
    }
    fn reserve_room_in(&self, dir: &Path, len: u64) -> Option<Reservation> {
        self.inner.reserve_room_in(dir, len)
    }
    fn node_copy_bytes(&self) -> u64 {
        self.inner.node_copy_bytes()
    }
    fn get(&self, key: &PageKey) -> Option<Bytes> {
        if self.faults.lose_reads.load(Relaxed) && self.inner.contains(key) {
            self.faults.reads_lost.fetch_add(1, Relaxed);
            self.inner.drop_page(key, "injected read error");
            return None;
        }
        self.inner.get(key)
    }
    fn contains(&self, key: &PageKey) -> bool {
        self.inner.contains(key)
    }
    fn holds_version(&self, inode: u64, version: u64) -> bool {
        self.inner.holds_version(inode, version)
    }
    fn drop_page(&self, key: &PageKey, why: &str) {
        self.inner.drop_page(key, why)
    }
    fn would_admit(&self, key: &PageKey) -> bool {
        self.inner.would_admit(key)
    }
    fn used(&self) -> u64 {
        self.inner.used()
    }
    fn used_and_reserved(&self) -> u64 {
        self.inner.used_and_reserved()
    }
    fn page_count(&self) -> u64 {
        self.inner.page_count()
    }
    fn blocks(&self) -> Vec<pb::BlockId> {
        self.inner.blocks()
    }
    fn take_deltas(&self) -> (Vec<pb::BlockId>, Vec<pb::BlockId>) {
        self.inner.take_deltas()
    }
    fn clear_deltas(&self) {
        self.inner.clear_deltas()
    }
    fn drop_stale_many(&self, files: &[(u64, u64)]) -> u64 {
        self.inner.drop_stale_many(files)
    }
    fn drop_version(&self, inode: u64, version: u64) -> u64 {
        self.inner.drop_version(inode, version)
    }
    fn pin(&self, inode: u64) {
        self.inner.pin(inode)
    }
    fn unpin(&self, inode: u64) {
        self.inner.unpin(inode)
    }
    fn set_pinned(&self, inodes: &HashSet<u64>) {
        self.inner.set_pinned(inodes)
    }
    fn pinned(&self) -> HashSet<u64> {
        self.inner.pinned()
    }
    fn add_pinned(&self, inodes: &[u64]) {
        self.inner.add_pinned(inodes)
    }
    fn lease_pages(
        &self,
        b: &BlockKey,
        first: u32,
        max_pages: u32,
        until: Instant,
        replaces: Option<u64>,
    ) -> Option<Lease> {
        self.inner.lease_pages(b, first, max_pages, until, replaces)
    }
    fn release(&self, id: u64) {
        self.inner.release(id)
    }
    fn release_many(&self, ids: &[u64]) {
        self.inner.release_many(ids)
    }
    fn lease_stats(&self) -> (usize, u64) {
        self.inner.lease_stats()
    }
}
