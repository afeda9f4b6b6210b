//! The mount table's runtime side: validating new mounts and keeping opened under-stores.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use granary_common::ufs::{redact, Ufs, UfsSpec};
use granary_proto as pb;

use crate::error::MasterError;
use crate::secrets::SecretBox;
use crate::state::{Mount, StateMachine};

/// Opened under-stores, by mount id (opening is cheap but not free: clients, credentials),
/// with the mount's options opened ([`crate::secrets`]).
#[derive(Default)]
pub struct UfsCache {
    stores: Mutex<HashMap<u64, (String, Ufs, UfsSpec)>>,
    secrets: Option<Arc<SecretBox>>,
}

impl UfsCache {
    pub fn new(secrets: Option<Arc<SecretBox>>) -> UfsCache {
        UfsCache {
            stores: Mutex::default(),
            secrets,
        }
    }

    /// The opened store of `mount`, reopened if the mount's URI changed.
    pub fn get(&self, mount: &Mount) -> Result<Ufs, MasterError> {
        self.get_with_spec(mount).map(|(ufs, _)| ufs)
    }

    /// The opened store and the mount's spec with its credentials in clear.
    fn get_with_spec(&self, mount: &Mount) -> Result<(Ufs, UfsSpec), MasterError> {
        let mut map = match self.stores.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some((uri, ufs, spec)) = map.get(&mount.id) {
            if *uri == mount.spec.uri {
                return Ok((ufs.clone(), spec.clone()));
            }
        }
        let spec = self.open_spec(mount)?;
        let ufs = spec.open()?;
        map.insert(
            mount.id,
            (mount.spec.uri.clone(), ufs.clone(), spec.clone()),
        );
        Ok((ufs, spec))
    }

    /// The mount's spec with its credentials in clear (for a worker, or to open it).
    pub fn open_spec(&self, mount: &Mount) -> Result<UfsSpec, MasterError> {
        crate::secrets::open_spec(self.secrets.as_deref(), &mount.spec)
    }

    /// The spec of a new mount with its credentials sealed, ready to be proposed.
    pub fn seal_spec(&self, spec: UfsSpec) -> Result<UfsSpec, MasterError> {
        crate::secrets::seal_spec(self.secrets.as_deref(), spec)
    }

    /// `text` with the mount's credentials replaced by `***`.
    pub fn scrub(&self, mount: &Mount, text: &str) -> String {
        match self.get_with_spec(mount) {
            Ok((_, spec)) => spec.scrub(text),
            Err(_) => mount.spec.scrub(text),
        }
    }

    pub fn forget(&self, mount_id: u64) {
        if let Ok(mut map) = self.stores.lock() {
            map.remove(&mount_id);
        }
    }
}

/// Validates a requested mount before it is proposed: the URI parses, the options are known,
/// the store opens, a local directory exists, and a remote store answers a listing of the
/// prefix (bucket exists, credentials accepted).
pub async fn validate_new(
    uri: &str,
    options: &[pb::MountOptionEntry],
) -> Result<UfsSpec, MasterError> {
    if uri.trim().is_empty() {
        return Err(MasterError::invalid("the under-store URI is empty"));
    }
    let mut opts = BTreeMap::new();
    for o in options {
        if o.key.is_empty() {
            return Err(MasterError::invalid("a mount option has an empty key"));
        }
        opts.insert(o.key.clone(), o.value.clone());
    }
    let spec = UfsSpec::new(uri, opts)?;
    spec.open_and_probe().await?;
    Ok(spec)
}

pub fn mount_info(m: &Mount) -> pb::MountInfo {
    pb::MountInfo {
        mount_id: m.id,
        path: m.path.clone(),
        uri: m.spec.uri.clone(),
        options: redact(&m.spec.options)
            .into_iter()
            .map(|(key, value)| pb::MountOptionEntry { key, value })
            .collect(),
        read_only: m.spec.read_only(),
    }
}

pub fn find_mount(sm: &StateMachine, id: u64) -> Result<Mount, MasterError> {
    sm.mount(id)?
        .ok_or_else(|| MasterError::not_found(format!("mount {id}")))
}
