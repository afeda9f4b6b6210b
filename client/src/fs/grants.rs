//! The read grants this client holds (TLS clusters: workers serve a file's blocks only with
//! one, for the version it names; see `granary_common::grant`): the newest seen for each
//! version of each file. No I/O: `FileSystem::grant_for` asks the master for new ones.

use std::collections::HashMap;
use std::sync::Mutex;

use granary_proto as pb;

use super::lock;

/// Grants kept (expired ones are dropped first when the map is full).
const MAX_GRANTS: usize = 100_000;

#[derive(Default)]
pub(crate) struct Grants {
    /// By (inode, version).
    map: Mutex<HashMap<(u64, u64), pb::ReadGrant>>,
}

impl Grants {
    /// Keeps the grant a status carries when it is the newest seen for its file version.
    pub(crate) fn note(&self, s: &pb::FileStatus) {
        let Some(g) = &s.grant else { return };
        let key = (s.inode, g.version);
        let mut m = lock(&self.map);
        if m.get(&key)
            .is_some_and(|old| old.expires_ms >= g.expires_ms)
        {
            return;
        }
        if m.len() >= MAX_GRANTS {
            let now = granary_common::now_ms().max(0) as u64;
            m.retain(|_, g| g.expires_ms > now);
            if m.len() >= MAX_GRANTS {
                m.clear();
            }
        }
        m.insert(key, g.clone());
    }

    /// The grant held for a file version, if any.
    pub(crate) fn get(&self, inode: u64, version: u64) -> Option<pb::ReadGrant> {
        lock(&self.map).get(&(inode, version)).cloned()
    }

    /// The grant held for a file version while it is not within the refresh margin of its
    /// end at `now_ms`.
    pub(crate) fn fresh(&self, inode: u64, version: u64, now_ms: u64) -> Option<pb::ReadGrant> {
        self.get(inode, version)
            .filter(|g| granary_common::grant::fresh(g, now_ms))
    }

    /// The unexpired grants held for these file versions (sent with lease requests).
    pub(crate) fn held(&self, files: impl IntoIterator<Item = (u64, u64)>) -> Vec<pb::ReadGrant> {
        let now = granary_common::now_ms().max(0) as u64;
        let m = lock(&self.map);
        files
            .into_iter()
            .filter_map(|k| m.get(&k).filter(|g| g.expires_ms > now).cloned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(inode: u64, version: u64, expires_ms: u64) -> pb::FileStatus {
        pb::FileStatus {
            inode,
            version,
            grant: Some(pb::ReadGrant {
                inode,
                version,
                expires_ms,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_newest_grant_of_each_version_is_kept_and_expired_ones_are_not_shown() {
        let g = Grants::default();
        let later = granary_common::now_ms() as u64 + 3_600_000;
        g.note(&status(1, 1, later));
        g.note(&status(1, 1, later - 10)); // older: ignored
        g.note(&status(1, 2, 5)); // another version, long expired
        g.note(&pb::FileStatus::default()); // no grant: nothing
        assert_eq!(g.get(1, 1).map(|x| x.expires_ms), Some(later));
        assert_eq!(g.get(1, 2).map(|x| x.expires_ms), Some(5));
        assert_eq!(g.get(2, 1), None);
        let held = g.held([(1, 1), (1, 2), (3, 3)]);
        assert_eq!(held.len(), 1, "{held:?}");
        assert_eq!(held[0].version, 1);
        assert!(g.fresh(1, 2, later).is_none());
    }
}
