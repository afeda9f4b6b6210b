//! What the rest of the worker asks of its cache: one trait, [`BlockStore`], over one tier
//! ([`PageStore`]) and over the tiers together ([`TieredStore`](super::TieredStore)); a
//! wrapper that injects disk faults ([`super::faults::FaultyStore`]) goes in front of
//! either.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use granary_proto as pb;

use super::{BlockKey, Lease, PageKey, PageStore, Reservation, StoreError, LEASE_WINDOW_PAGES};

/// One tier's name, size and use, as reports show them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierUsage {
    pub tier: String,
    pub capacity: u64,
    pub used: u64,
}

/// A worker's page cache: pages of blocks reserved, committed, read back (checked),
/// held by pins and short-circuit leases, and reported to the master.
pub trait BlockStore: Send + Sync {
    /// Bytes per page.
    fn page_size(&self) -> u64;
    /// Bytes the cache may hold, all tiers together.
    fn capacity(&self) -> u64;
    /// Each tier, fastest first.
    fn tiers(&self) -> Vec<TierUsage>;

    /// Room for a new page (evicting first), or `None`: the page is served uncached.
    fn reserve(&self, key: &PageKey, len: u64) -> Option<Reservation>;
    /// Writes a page into its reservation; `block_size` is its file's.
    fn commit(
        &self,
        r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
    ) -> Result<(), StoreError>;
    /// Room for a node copy (a page another worker owns), evicting only node copies.
    fn reserve_node_copy(&self, key: &PageKey, len: u64) -> Option<Reservation>;
    /// Writes a node copy into its reservation.
    fn commit_node_copy(
        &self,
        r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
    ) -> Result<(), StoreError>;
    /// Room for something that is not a page (a write's journal) on the tier whose
    /// folder is `dir`, else on the last tier.
    fn reserve_room_in(&self, dir: &Path, len: u64) -> Option<Reservation>;
    /// Bytes of node copies held.
    fn node_copy_bytes(&self) -> u64;

    /// A cached page whose bytes match their checksum (a page that fails it is dropped).
    fn get(&self, key: &PageKey) -> Option<Bytes>;
    fn contains(&self, key: &PageKey) -> bool;
    /// Whether a page of version `version` of file `inode` is cached.
    fn holds_version(&self, inode: u64, version: u64) -> bool;
    fn drop_page(&self, key: &PageKey, why: &str);
    /// Whether the admission filter would let this page in now.
    fn would_admit(&self, key: &PageKey) -> bool;
    fn used(&self) -> u64;
    fn used_and_reserved(&self) -> u64;
    fn page_count(&self) -> u64;

    /// Every block with a cached page.
    fn blocks(&self) -> Vec<pb::BlockId>;
    /// Blocks added and removed since the last call (the heartbeat's report).
    fn take_deltas(&self) -> (Vec<pb::BlockId>, Vec<pb::BlockId>);
    fn clear_deltas(&self);
    /// Drops every cached version of each `(inode, keep)` but `keep`; bytes dropped.
    fn drop_stale_many(&self, files: &[(u64, u64)]) -> u64;
    fn drop_stale(&self, inode: u64, keep: u64) -> u64 {
        self.drop_stale_many(&[(inode, keep)])
    }
    /// Drops every cached page of version `version` of `inode`; bytes dropped.
    fn drop_version(&self, inode: u64, version: u64) -> u64;

    /// Pins: pages of these inodes are never evicted.
    fn pin(&self, inode: u64);
    fn unpin(&self, inode: u64);
    fn set_pinned(&self, inodes: &HashSet<u64>);
    fn pinned(&self) -> HashSet<u64>;
    fn add_pinned(&self, inodes: &[u64]);

    /// A short-circuit lease of the window of pages from `first` of block `b`.
    fn lease(
        &self,
        b: &BlockKey,
        first: u32,
        until: Instant,
        replaces: Option<u64>,
    ) -> Option<Lease> {
        self.lease_pages(b, first, LEASE_WINDOW_PAGES, until, replaces)
    }
    /// A lease of up to `max_pages` pages; `replaces` is released first.
    fn lease_pages(
        &self,
        b: &BlockKey,
        first: u32,
        max_pages: u32,
        until: Instant,
        replaces: Option<u64>,
    ) -> Option<Lease>;
    fn release(&self, id: u64);
    fn release_many(&self, ids: &[u64]);
    /// Leases in force and the bytes they hold.
    fn lease_stats(&self) -> (usize, u64);
}

/// One tier alone is a cache too.
impl BlockStore for Arc<PageStore> {
    fn page_size(&self) -> u64 {
        self.page_size
    }
    fn capacity(&self) -> u64 {
        self.capacity
    }
    fn tiers(&self) -> Vec<TierUsage> {
        vec![TierUsage {
            tier: self.tier.clone(),
            capacity: self.capacity,
            used: PageStore::used(self),
        }]
    }
    fn reserve(&self, key: &PageKey, len: u64) -> Option<Reservation> {
        PageStore::reserve(self, key, len)
    }
    fn commit(
        &self,
        r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
    ) -> Result<(), StoreError> {
        PageStore::commit(self, r, key, block_size, data)
    }
    fn reserve_node_copy(&self, key: &PageKey, len: u64) -> Option<Reservation> {
        PageStore::reserve_node_copy(self, key, len)
    }
    fn commit_node_copy(
        &self,
        r: Reservation,
        key: PageKey,
        block_size: u64,
        data: &[u8],
    ) -> Result<(), StoreError> {
        PageStore::commit_with(self, r, key, block_size, data, true)
    }
    fn reserve_room_in(&self, _dir: &Path, len: u64) -> Option<Reservation> {
        PageStore::reserve_room(self, len)
    }
    fn node_copy_bytes(&self) -> u64 {
        PageStore::node_copy_bytes(self)
    }
    fn get(&self, key: &PageKey) -> Option<Bytes> {
        PageStore::get(self, key)
    }
    fn contains(&self, key: &PageKey) -> bool {
        PageStore::contains(self, key)
    }
    fn holds_version(&self, inode: u64, version: u64) -> bool {
        PageStore::holds_version(self, inode, version)
    }
    fn drop_page(&self, key: &PageKey, why: &str) {
        PageStore::drop_page(self, key, why)
    }
    fn would_admit(&self, key: &PageKey) -> bool {
        PageStore::would_admit(self, key)
    }
    fn used(&self) -> u64 {
        PageStore::used(self)
    }
    fn used_and_reserved(&self) -> u64 {
        PageStore::used_and_reserved(self)
    }
    fn page_count(&self) -> u64 {
        PageStore::page_count(self)
    }
    fn blocks(&self) -> Vec<pb::BlockId> {
        PageStore::blocks(self)
    }
    fn take_deltas(&self) -> (Vec<pb::BlockId>, Vec<pb::BlockId>) {
        PageStore::take_deltas(self)
    }
    fn clear_deltas(&self) {
        PageStore::clear_deltas(self)
    }
    fn drop_stale_many(&self, files: &[(u64, u64)]) -> u64 {
        PageStore::drop_stale_many(self, files)
    }
    fn drop_version(&self, inode: u64, version: u64) -> u64 {
        PageStore::drop_version(self, inode, version)
    }
    fn pin(&self, inode: u64) {
        PageStore::pin(self, inode);
    }
    fn unpin(&self, inode: u64) {
        PageStore::unpin(self, inode);
    }
    fn set_pinned(&self, inodes: &HashSet<u64>) {
        PageStore::set_pinned(self, inodes)
    }
    fn pinned(&self) -> HashSet<u64> {
        PageStore::pinned(self)
    }
    fn add_pinned(&self, inodes: &[u64]) {
        PageStore::add_pinned(self, inodes)
    }
    fn lease_pages(
        &self,
        b: &BlockKey,
        first: u32,
        max_pages: u32,
        until: Instant,
        replaces: Option<u64>,
    ) -> Option<Lease> {
        PageStore::lease_pages(self, b, first, max_pages, until, replaces)
    }
    fn release(&self, id: u64) {
        PageStore::release(self, id)
    }
    fn release_many(&self, ids: &[u64]) {
        PageStore::release_many(self, ids)
    }
    fn lease_stats(&self) -> (usize, u64) {
        PageStore::lease_stats(self)
    }
}
