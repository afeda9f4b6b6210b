//! TTLs (`granary ttl`) in the replicated state: `T` + inode → [`Ttl`]. The leader acts on
//! the ones due (see `crate::ttl`) and then removes them.

use super::keys;
use serde::{Deserialize, Serialize};

use super::{decode_record, encode_record, u64_of, StateMachine, Txn};
use crate::error::MasterError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TtlAction {
    /// Drop the cached copies (the under-store keeps the data).
    Free,
    /// Delete the entry, in the under-store too for mounted paths.
    Delete,
}

impl TtlAction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Delete => "delete",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ttl {
    /// When it is due, ms since the Unix epoch (the leader's clock when it was set).
    pub expires_ms: i64,
    pub action: TtlAction,
}

impl StateMachine {
    /// Every TTL: (inode, ttl).
    pub fn ttls(&self) -> Result<Vec<(u64, Ttl)>, MasterError> {
        let mut out = Vec::new();
        self.scan(&[keys::TTL], |k, v| {
            out.push((u64_of(&k[1..])?, decode_record(v)?));
            Ok(true)
        })?;
        Ok(out)
    }

    pub fn ttl_of(&self, inode: u64) -> Result<Option<Ttl>, MasterError> {
        self.get(&keys::ttl(inode))?
            .map(|v| decode_record(&v))
            .transpose()
    }
}

impl Txn<'_> {
    /// Sets (`Some`) or removes the TTL of `path`. Returns the inode.
    pub(super) fn set_ttl(
        &mut self,
        path: &str,
        ttl: Option<Ttl>,
    ) -> Result<super::Inode, MasterError> {
        let inode = self.resolve(path)?;
        match ttl {
            Some(t) => self.put(keys::ttl(inode.id), encode_record(&t)?),
            None => self.delete(keys::ttl(inode.id)),
        }
        Ok(inode)
    }

    /// Removes the TTL of `inode` if it is still the one given (an expired TTL that was
    /// replaced meanwhile stays).
    pub(super) fn end_ttl(&mut self, inode: u64, was: &Ttl) -> Result<(), MasterError> {
        if let Some(v) = self.get(&keys::ttl(inode))? {
            let cur: Ttl = decode_record(&v)?;
            if cur == *was {
                self.delete(keys::ttl(inode));
            }
        }
        Ok(())
    }

    /// A deleted inode takes its TTL with it.
    pub(super) fn drop_ttl(&mut self, inode: u64) {
        self.delete(keys::ttl(inode));
    }
}
