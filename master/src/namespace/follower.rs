//! What a follower answers itself (issue 31: reads served by every master).
//!
//! The leader lists folders from their stores and records what it found through Raft; a
//! follower never lists. It answers a namespace read from what is replicated while that
//! is as fresh as the leader would answer it without listing first: entries outside
//! mounts (they change only through the master), and folders listed — as recorded with
//! the listing, [`Inode::listed_ms`] — within their mount's `sync_interval`. Anything
//! else (a folder never listed or due again, a name never looked up, a validated open)
//! goes to the leader: `NotLeader`, with its address, and the client asks it there.

use std::collections::BTreeMap;
use std::time::Duration;

use granary_common::ufs::SyncPolicy;

use super::Namespace;
use crate::error::MasterError;
use crate::mounts::find_mount;
use crate::state::{Command, Inode, Kind, SyncBatch, ROOT_INODE};

impl Namespace {
    /// Whether this master leads the group (and lists folders itself).
    pub fn leads(&self) -> bool {
        self.raft.status.is_leader()
    }

    /// How long ago folder `dir` was last listed from its store, as recorded through Raft
    /// (none: never, or not since this record was kept).
    pub fn listed_ago(&self, dir: u64) -> Option<Duration> {
        ago(self.sm.inode(dir).ok()??.listed_ms)
    }

    /// Whether a loaded folder's replicated entries answer a read as the leader would
    /// without listing it first.
    pub(super) fn fresh_enough(&self, dir: &Inode, policy: SyncPolicy) -> bool {
        if !dir.children_loaded {
            return false;
        }
        match policy {
            SyncPolicy::Never => true,
            SyncPolicy::Always => false,
            SyncPolicy::Every(d) => ago(dir.listed_ms).is_some_and(|ago| ago < d),
        }
    }

    /// Tells followers that folder `dir` was listed and nothing changed (they answer its
    /// reads only while its listing is fresh): an empty last batch of a re-listing. A
    /// sole master has no one to tell.
    pub(super) async fn record_unchanged_listing(&self, dir: u64, mount_id: u64) {
        if self.raft.status.voters().len() < 2 {
            return;
        }
        let listed = Command::SyncDir {
            dir,
            mount_id,
            entries: Vec::new(),
            now_ms: granary_common::now_ms(),
            block_size: self.block_size,
            seen: Some(BTreeMap::new()),
            batch: Some(SyncBatch {
                removed: Vec::new(),
                last: true,
            }),
        };
        if let Err(e) = self.raft.propose(&listed).await {
            tracing::debug!(dir, error = %e, "recording an unchanged listing failed");
        }
    }

    /// A read this follower cannot answer, sent to the leader.
    pub fn to_leader(&self) -> MasterError {
        self.metrics.follower_redirects.inc();
        self.raft.not_leader()
    }

    /// On a follower, whether `inode` (asked for by id) may be answered here: outside a
    /// mount, a mount point, or in a folder fresh enough (a file found by a lookup in a
    /// folder never listed only under `sync_interval=never`). The leader answers anything.
    pub fn answerable_here(&self, inode: &Inode) -> Result<(), MasterError> {
        let Some(mount_id) = inode.mount_id else {
            return Ok(());
        };
        if self.leads() || inode.is_mount_point || inode.id == ROOT_INODE {
            return Ok(());
        }
        let policy = find_mount(&self.sm, mount_id)?.spec.sync_policy();
        let parent = self.inode(inode.parent)?;
        let fresh = if parent.children_loaded {
            parent.mount_id.is_none() || self.fresh_enough(&parent, policy)
        } else {
            needs_no_check(inode, policy)
        };
        if fresh {
            Ok(())
        } else {
            Err(self.to_leader())
        }
    }
}

/// Whether an entry found by name in a folder never listed may be answered without a
/// check of its own: folders always (the leader answers them as known too), files only
/// under `sync_interval=never` (the leader checks each when it is due).
pub(super) fn needs_no_check(entry: &Inode, policy: SyncPolicy) -> bool {
    entry.kind != Kind::File || policy == SyncPolicy::Never
}

/// Time since `listed_ms` (the leader's clock when it proposed the listing; masters'
/// clocks are taken to agree within well under a `sync_interval`, as for TTLs).
fn ago(listed_ms: i64) -> Option<Duration> {
    (listed_ms > 0)
        .then(|| Duration::from_millis((granary_common::now_ms() - listed_ms).max(0) as u64))
}
