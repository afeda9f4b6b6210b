//! Namespace reads with lazy loading of mounted under-store metadata.
//!
//! A directory inside a mount is listed from the under-store the first time it is looked
//! into; the listing is proposed through Raft (`Command::LoadDir`) so every replica holds the
//! same inodes. A failed listing changes nothing and is reported to the caller.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use granary_common::paths;
use object_store::ObjectStore as _;

use crate::error::MasterError;
use crate::mounts::{find_mount, UfsCache};
use crate::raft::node::RaftHandle;
use crate::state::{Command, Fingerprint, Inode, Kind, StateMachine, UfsEntry, ROOT_INODE};

pub struct Namespace {
    pub sm: StateMachine,
    pub raft: RaftHandle,
    pub ufs: Arc<UfsCache>,
    pub block_size: u64,
    /// One listing at a time per directory.
    loading: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<()>>>>,
}

impl Namespace {
    pub fn new(sm: StateMachine, raft: RaftHandle, ufs: Arc<UfsCache>, block_size: u64) -> Self {
        Self {
            sm,
            raft,
            ufs,
            block_size,
            loading: Mutex::new(HashMap::new()),
        }
    }

    pub fn root(&self) -> Result<Inode, MasterError> {
        self.sm
            .inode(ROOT_INODE)?
            .ok_or_else(|| MasterError::corrupt("root inode is missing"))
    }

    /// Resolves an absolute path, loading mounted directories on the way.
    pub async fn resolve(&self, path: &str) -> Result<Inode, MasterError> {
        let path = paths::normalize(path)?;
        let mut cur = self.root()?;
        for comp in paths::components(&path)? {
            if cur.kind != Kind::Directory {
                return Err(MasterError::NotADirectory { path: path.clone() });
            }
            cur = self.ensure_loaded(cur).await?;
            cur = self
                .sm
                .child(cur.id, comp)?
                .ok_or_else(|| MasterError::not_found(&path))?;
        }
        Ok(cur)
    }

    pub fn inode(&self, id: u64) -> Result<Inode, MasterError> {
        self.sm
            .inode(id)?
            .ok_or_else(|| MasterError::not_found(format!("inode {id}")))
    }

    pub async fn lookup(&self, parent: u64, name: &str) -> Result<Inode, MasterError> {
        paths::validate_name(name)?;
        let dir = self.inode(parent)?;
        if dir.kind != Kind::Directory {
            return Err(MasterError::NotADirectory {
                path: self.sm.path_of(&dir)?,
            });
        }
        let dir = self.ensure_loaded(dir).await?;
        match self.sm.child(dir.id, name)? {
            Some(c) => Ok(c),
            None => Err(MasterError::not_found(paths::join(
                &self.sm.path_of(&dir)?,
                name,
            ))),
        }
    }

    pub async fn list(
        &self,
        dir: Inode,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Inode>, MasterError> {
        if dir.kind != Kind::Directory {
            return Ok(vec![dir]);
        }
        let dir = self.ensure_loaded(dir).await?;
        self.sm.children(dir.id, after, limit)
    }

    /// Makes sure a mounted directory's children are in the namespace.
    pub async fn ensure_loaded(&self, dir: Inode) -> Result<Inode, MasterError> {
        let Some(mount_id) = dir.mount_id else {
            return Ok(dir);
        };
        if dir.kind != Kind::Directory || dir.children_loaded {
            return Ok(dir);
        }
        let lock = {
            let mut map = match self.loading.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            map.entry(dir.id).or_default().clone()
        };
        let _guard = lock.lock().await;
        // Someone else may have loaded it while we waited.
        let dir = self.inode(dir.id)?;
        if dir.children_loaded {
            return Ok(dir);
        }
        let mount = find_mount(&self.sm, mount_id)?;
        let ufs = self.ufs.get(&mount)?;
        let location = ufs.path_of(&dir.ufs_path);
        let listing = ufs
            .store
            .list_with_delimiter(Some(&location))
            .await
            .map_err(|e| {
                tracing::warn!(mount = %mount.path, dir = %dir.ufs_path, error = %e, "under-store listing failed");
                MasterError::Unavailable {
                    message: format!(
                        "listing {} in the under-store {} failed: {e}",
                        if dir.ufs_path.is_empty() { "/" } else { &dir.ufs_path },
                        mount.spec.uri
                    ),
                }
            })?;
        let mut entries = Vec::with_capacity(listing.objects.len() + listing.common_prefixes.len());
        for p in &listing.common_prefixes {
            if let Some(name) = p.filename() {
                entries.push(UfsEntry {
                    name: name.to_string(),
                    kind: Kind::Directory,
                    fingerprint: None,
                });
            }
        }
        for o in &listing.objects {
            let Some(name) = o.location.filename() else {
                continue;
            };
            if entries.iter().any(|e| e.name == name) {
                continue; // a directory of the same name wins
            }
            entries.push(UfsEntry {
                name: name.to_string(),
                kind: Kind::File,
                fingerprint: Some(Fingerprint {
                    etag: o.e_tag.clone().unwrap_or_default(),
                    size: o.size,
                    mtime_ms: o.last_modified.timestamp_millis(),
                    version_id: o.version.clone().unwrap_or_default(),
                }),
            });
        }
        let out = self
            .raft
            .propose(&Command::LoadDir {
                dir: dir.id,
                mount_id,
                entries,
                now_ms: granary_common::now_ms(),
                block_size: self.block_size,
            })
            .await?;
        if let Ok(mut map) = self.loading.lock() {
            map.remove(&dir.id);
        }
        match out {
            crate::state::ApplyOutput::Inode(i) => Ok(i),
            _ => self.inode(dir.id),
        }
    }
}
