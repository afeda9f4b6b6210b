//! Batched reads of the state: a listing page's records in one RocksDB read.

use super::{decode_record, keys, Inode, StateMachine};
use crate::error::MasterError;

impl StateMachine {
    /// The inodes `ids` (a folder's entries, in order): those in the cache from it, the
    /// others in one batched read in key order (a point read each was most of a listing's
    /// cost), none of them kept (see [`StateMachine::inode_kept`]).
    pub(super) fn inodes_of_entries(
        &self,
        parent: u64,
        ids: &[u64],
    ) -> Result<Vec<Inode>, MasterError> {
        let mut out: Vec<Option<Inode>> = ids.iter().map(|&id| self.cache.inode(id).ok()).collect();
        let missing: Vec<(Vec<u8>, usize)> = out
            .iter()
            .enumerate()
            .filter(|(_, i)| i.is_none())
            .map(|(at, _)| (keys::inode(ids[at]), at))
            .collect();
        self.get_many(missing, |at, v| {
            out[at] = Some(decode_record(v)?);
            Ok(())
        })?;
        out.into_iter()
            .zip(ids)
            .map(|(inode, id)| {
                inode.ok_or_else(|| {
                    MasterError::inconsistent(format!(
                        "directory {parent} lists inode {id}, which does not exist"
                    ))
                })
            })
            .collect()
    }

    /// The records of `keys` in one batched read (in key order, the order RocksDB reads
    /// fastest): `found` gets each present one with its tag.
    pub(super) fn get_many<T: Copy>(
        &self,
        mut keys: Vec<(Vec<u8>, T)>,
        mut found: impl FnMut(T, &[u8]) -> Result<(), MasterError>,
    ) -> Result<(), MasterError> {
        keys.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let got = self
            .db
            .batched_multi_get_cf(self.cf()?, keys.iter().map(|(k, _)| k), true);
        for ((_, tag), value) in keys.iter().zip(got) {
            if let Some(v) = value? {
                found(*tag, v.as_ref())?;
            }
        }
        Ok(())
    }
}
