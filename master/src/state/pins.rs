//! Pins (`granary pin`) in the replicated state: `P` + inode → replicas. A pinned file or
//! directory (everything below it) is loaded onto `replicas` workers and never evicted
//! there; the leader tells the workers which inodes are pinned.

use super::keys;
use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::{decode_record, encode_record, u64_of, StateMachine, Txn};
use crate::error::MasterError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    pub replicas: u32,
}

impl StateMachine {
    /// Every pin: (inode, pin).
    pub fn pins(&self) -> Result<Vec<(u64, Pin)>, MasterError> {
        let mut out = Vec::new();
        self.scan(&[keys::PIN], |k, v| {
            out.push((u64_of(&k[1..])?, decode_record(v)?));
            Ok(true)
        })?;
        Ok(out)
    }

    pub fn pin_of(&self, inode: u64) -> Result<Option<Pin>, MasterError> {
        self.get(&keys::pin(inode))?
            .map(|v| decode_record(&v))
            .transpose()
    }

    /// The pins among `ids` (a listing page's entries; usually none). Entries of one folder
    /// mostly have close inode numbers (a listing makes them together), so when they do
    /// this is one seek over the pin records between the smallest and the largest, instead
    /// of a point read per entry (7 % of a warm `find`'s CPU); scattered ones are read in
    /// one batched read.
    pub fn pins_among(&self, ids: &[u64]) -> Result<HashMap<u64, Pin>, MasterError> {
        let mut out = HashMap::new();
        let (Some(&lo), Some(&hi)) = (ids.iter().min(), ids.iter().max()) else {
            return Ok(out);
        };
        if hi - lo > 64 * ids.len() as u64 {
            let keys = ids.iter().map(|&id| (keys::pin(id), id)).collect();
            self.get_many(keys, |id, v| {
                out.insert(id, decode_record(v)?);
                Ok(())
            })?;
            return Ok(out);
        }
        let wanted: HashSet<u64> = ids.iter().copied().collect();
        self.scan_from(&keys::pin(lo), &[keys::PIN], |k, v| {
            let id = u64_of(&k[1..])?;
            if id > hi {
                return Ok(false);
            }
            if wanted.contains(&id) {
                out.insert(id, decode_record(v)?);
            }
            Ok(true)
        })?;
        Ok(out)
    }

    /// The pin that covers `inode`: its own, or its nearest pinned ancestor's.
    pub fn pin_covering(&self, inode: &super::Inode) -> Result<Option<Pin>, MasterError> {
        let mut cur = inode.clone();
        loop {
            if let Some(p) = self.pin_of(cur.id)? {
                return Ok(Some(p));
            }
            if cur.id == super::ROOT_INODE {
                return Ok(None);
            }
            cur = match self.inode(cur.parent)? {
                Some(p) => p,
                None => return Ok(None),
            };
        }
    }
}

impl Txn<'_> {
    /// Pins `path` with `replicas` (0: unpins it). Returns the inode.
    pub(super) fn set_pin(
        &mut self,
        path: &str,
        replicas: u32,
    ) -> Result<super::Inode, MasterError> {
        let inode = self.resolve(path)?;
        if replicas == 0 {
            self.delete(keys::pin(inode.id));
        } else {
            self.put(keys::pin(inode.id), encode_record(&Pin { replicas })?);
        }
        Ok(inode)
    }

    /// A deleted inode takes its pin with it.
    pub(super) fn drop_pin(&mut self, inode: u64) {
        self.delete(keys::pin(inode));
    }
}
