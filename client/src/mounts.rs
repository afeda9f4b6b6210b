//! Opened under-stores of mounts, fetched from the master once per mount (workers and the
//! direct-read fallback of clients share this).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::ErrorCode;
use granary_common::ufs::{Ufs, UfsSpec};

use crate::error::ClientError;
use crate::master::MasterClient;

#[derive(Default)]
pub struct MountStores {
    stores: Mutex<HashMap<u64, Ufs>>,
}

impl MountStores {
    /// Seeds the opened store of a mount (tests; a process that already holds it).
    pub fn insert(&self, mount_id: u64, ufs: Ufs) {
        if let Ok(mut m) = self.stores.lock() {
            m.insert(mount_id, ufs);
        }
    }

    /// The opened store of mount `mount_id`, asking the master for its access on first use.
    pub async fn get(&self, master: &MasterClient, mount_id: u64) -> Result<Ufs, ClientError> {
        if let Some(u) = self
            .stores
            .lock()
            .ok()
            .and_then(|m| m.get(&mount_id).cloned())
        {
            return Ok(u);
        }
        let access = master.mount_access(mount_id).await.map_err(|e| match e {
            // Under-store credentials go to node identities only: a user's client reads
            // through workers, and with none able to serve, the read is unavailable.
            e if matches!(e.code(), ErrorCode::PermissionDenied | ErrorCode::GrantRefused) => {
                ClientError::unavailable(format!(
                    "no worker can serve mount {mount_id} and this client may not read its under-store directly ({e})"
                ))
                .caused_by(e)
            }
            e => e,
        })?;
        let options = access
            .options
            .into_iter()
            .map(|o| (o.key, o.value))
            .collect();
        let open = UfsSpec::new(&access.uri, options).and_then(|spec| spec.open());
        let ufs = open
            .map_err(|e| ClientError::unavailable(format!("cannot open mount {mount_id}: {e}")))?;
        if let Ok(mut m) = self.stores.lock() {
            m.insert(mount_id, ufs.clone());
        }
        Ok(ufs)
    }
}
