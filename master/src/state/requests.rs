//! The retention of remembered request outcomes (see [`StateMachine::apply_request`]).

use super::{keys, StateMachine, Txn, REQUEST_PRUNE_BATCH, REQUEST_RETENTION_MS};
use crate::error::MasterError;

impl StateMachine {
    /// Forgets (in `txn`) up to [`REQUEST_PRUNE_BATCH`] outcomes older than the retention
    /// before `at_ms`, oldest first — deterministic: it uses the entry's clock. The scan (a
    /// RocksDB iterator, once per request) is skipped while the oldest outcome kept is
    /// known to be within the retention, which is what a scan would find, and starts past
    /// the outcomes already forgotten (their tombstones would be stepped over each time).
    pub(super) fn prune_requests(&self, txn: &mut Txn, at_ms: i64) -> Result<(), MasterError> {
        use std::sync::atomic::Ordering::Relaxed;
        let horizon_ms = at_ms.saturating_sub(REQUEST_RETENTION_MS);
        let oldest = self.oldest_request.load(Relaxed);
        if oldest >= horizon_ms {
            self.oldest_request.fetch_min(at_ms, Relaxed);
            return Ok(());
        }
        let horizon = keys::request_age(horizon_ms, 0);
        let age = |k: &[u8]| i64::from_be_bytes(k[1..9].try_into().unwrap_or_default());
        let mut it = self.db.raw_iterator_cf(self.cf()?);
        if oldest == i64::MIN {
            it.seek([keys::REQUEST_AGE]);
        } else {
            it.seek(keys::request_age(oldest, 0));
        }
        let (mut pruned, mut lowest) = (0, i64::MAX);
        while it.valid() {
            let Some(k) = it.key() else { break };
            if k.first() != Some(&keys::REQUEST_AGE) {
                break;
            }
            if k.len() != 17 {
                lowest = i64::MIN; // not an age record: nothing is known
                break;
            }
            if k >= horizon.as_slice() || pruned == REQUEST_PRUNE_BATCH {
                lowest = age(k);
                break;
            }
            let id = u64::from_be_bytes(k[9..].try_into().unwrap_or_default());
            txn.delete(k.to_vec());
            txn.delete(keys::request(id));
            pruned += 1;
            it.next();
        }
        it.status()?;
        self.oldest_request.store(lowest.min(at_ms), Relaxed);
        Ok(())
    }
}
