//! The leader's side of namespace changes inside mounts: what the under-store must do before
//! the change is proposed (delete objects, move them), and the checks that make a refused
//! change change nothing (read-only mounts, cross-mount moves).
//!
//! The under-store goes first: a delete or move that fails there is not recorded, so the
//! namespace never claims what the store does not show. Both are idempotent, so a retried
//! request (same request id) that finds the work done succeeds.

use futures::StreamExt;
use granary_common::paths;
use object_store::{ObjectStore as _, ObjectStoreExt as _};

use super::Namespace;
use crate::error::MasterError;
use crate::mounts::find_mount;
use crate::state::{Inode, Kind, Mount, Persist};

/// Objects moved or deleted at once when a directory of an object store changes.
const OBJECT_OPS_IN_FLIGHT: usize = 16;

impl Namespace {
    /// The mount `inode` belongs to, refusing a change when it is read-only.
    fn writable_mount(&self, inode: &Inode, path: &str) -> Result<Option<Mount>, MasterError> {
        let Some(id) = inode.mount_id else {
            return Ok(None);
        };
        let mount = find_mount(&self.sm, id)?;
        if mount.spec.read_only() {
            return Err(MasterError::ReadOnly {
                path: path.to_string(),
                mount: mount.path.clone(),
            });
        }
        Ok(Some(mount))
    }

    /// The parent of `path`, loaded from its under-store, and the entry itself if it exists
    /// (looked up in the store too, so a create never shadows an object it did not list).
    async fn parent_and_entry(&self, path: &str) -> Result<(Inode, Option<Inode>), MasterError> {
        let path = paths::normalize(path)?;
        let comps = paths::components(&path)?;
        let Some((last, parents)) = comps.split_last() else {
            return Err(MasterError::AlreadyExists { path });
        };
        paths::validate_name(last)?;
        let parent_path = format!("/{}", parents.join("/"));
        let parent = self.resolve(&parent_path).await?;
        if parent.kind != Kind::Directory {
            return Err(MasterError::NotADirectory { path: parent_path });
        }
        let entry = self.child_of(parent.clone(), last).await?;
        Ok((parent, entry))
    }

    /// Checks before a file is created (or replaced) at `path`. Returns whether a file is
    /// there now (whose cached pages the create makes stale).
    pub async fn prepare_create(&self, path: &str, overwrite: bool) -> Result<bool, MasterError> {
        let (parent, entry) = self.parent_and_entry(path).await?;
        self.writable_mount(&parent, path)?;
        match entry {
            Some(_) if !overwrite => Err(MasterError::AlreadyExists {
                path: path.to_string(),
            }),
            Some(e) if e.kind == Kind::Directory => Err(MasterError::IsADirectory {
                path: path.to_string(),
            }),
            entry => Ok(entry.is_some()),
        }
    }

    /// Checks before a directory is made at `path`.
    pub async fn prepare_mkdir(&self, path: &str, recursive: bool) -> Result<(), MasterError> {
        match self.parent_and_entry(path).await {
            Ok((parent, entry)) => {
                self.writable_mount(&parent, path)?;
                match entry {
                    Some(e) if !(recursive && e.kind == Kind::Directory) => {
                        Err(MasterError::AlreadyExists {
                            path: path.to_string(),
                        })
                    }
                    _ => Ok(()),
                }
            }
            // `mkdir -p` of a path whose parents are missing: they are made in the apply.
            Err(MasterError::NotFound { .. }) if recursive => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Removes `path` from its under-store (everything below it with `recursive`), before
    /// the removal is proposed. Returns the entry.
    pub async fn delete_in_store(&self, path: &str, recursive: bool) -> Result<Inode, MasterError> {
        let path = paths::normalize(path)?;
        let inode = self.resolve(&path).await?;
        if inode.is_mount_point {
            return Err(MasterError::Busy {
                path: path.clone(),
                mount: path,
            });
        }
        let Some(mount) = self.writable_mount(&inode, &path)? else {
            return Ok(inode);
        };
        if inode.kind == Kind::Directory {
            // Emptiness is judged on what the store holds, not only on what was listed.
            let dir = self.ensure_loaded(inode.clone()).await?;
            if !recursive && !self.sm.children(dir.id, None, 1)?.is_empty() {
                return Err(MasterError::NotEmpty { path });
            }
        }
        let ufs = self.ufs.get(&mount)?;
        // Scrubbed with the options in clear (the stored ones are sealed).
        let scrub = |e: object_store::Error| MasterError::Unavailable {
            message: self
                .ufs
                .scrub(&mount, &format!("deleting {path} in the under-store: {e}")),
        };
        match inode.kind {
            // An unfinished file has nothing in the store yet (a replaced file's old object
            // stays: it was never overwritten).
            Kind::File
                if inode.complete
                    && (inode.persist == Persist::Persisted || inode.persist_worker != 0) =>
            {
                match ufs.store.delete(&ufs.path_of(&inode.ufs_path)).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(scrub(e)),
                }
            }
            Kind::File => {}
            Kind::Directory => {
                let prefix = ufs.path_of(&inode.ufs_path);
                let store = ufs.store.clone();
                for_each_object(&ufs, &prefix, move |p| {
                    let store = store.clone();
                    async move { store.delete(&p).await }
                })
                .await
                .map_err(scrub)?;
                if let Some(local) = confined_path(&mount, &inode.ufs_path)? {
                    // A local store keeps directories of its own (a link is removed, never
                    // followed: `remove_dir_all` does not follow links).
                    match std::fs::remove_dir_all(&local) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => {
                            return Err(MasterError::Unavailable {
                                message: format!("removing {}: {e}", local.display()),
                            })
                        }
                    }
                }
            }
        }
        Ok(inode)
    }

    /// Moves `src` to `dst` in the under-store (copy + delete where the store has no
    /// rename), before the move is proposed. Both must be in the same mount.
    pub async fn rename_in_store(&self, src: &str, dst: &str) -> Result<(), MasterError> {
        let src = paths::normalize(src)?;
        let dst = paths::normalize(dst)?;
        if paths::is_within(&dst, &src) {
            return Err(MasterError::invalid(format!(
                "cannot move {src} into itself ({dst})"
            )));
        }
        let inode = self.resolve(&src).await?;
        let (parent, existing) = self.parent_and_entry(&dst).await?;
        if parent.mount_id != inode.mount_id {
            return Err(MasterError::CrossMount { src, dst });
        }
        let Some(mount) = self.writable_mount(&inode, &src)? else {
            return Ok(());
        };
        if inode.is_mount_point {
            return Err(MasterError::Busy {
                path: src.clone(),
                mount: src,
            });
        }
        // A mounted folder's move rewrites the store path of every entry below it in one
        // apply on every master: bounded here, before the store is touched.
        if inode.kind == Kind::Directory && inode.mount_id.is_some() {
            let limit = crate::purge::MAX_MOVE_ENTRIES;
            // Up to 100,000 reads: off the runtime's threads.
            let (sm, id) = (self.sm.clone(), inode.id);
            let below = tokio::task::spawn_blocking(move || sm.count_below(id, limit))
                .await
                .map_err(|e| MasterError::Unavailable {
                    message: format!("counting the entries below {src}: {e}"),
                })??;
            if below > limit {
                return Err(MasterError::MoveTooBig { path: src, limit });
            }
        }
        if let Some(e) = &existing {
            if e.kind == Kind::Directory && inode.kind == Kind::File {
                return Err(MasterError::IsADirectory { path: dst });
            }
            if e.kind == Kind::File && inode.kind == Kind::Directory {
                return Err(MasterError::NotADirectory { path: dst });
            }
            if e.kind == Kind::Directory {
                let d = self.ensure_loaded(e.clone()).await?;
                if !self.sm.children(d.id, None, 1)?.is_empty() {
                    return Err(MasterError::NotEmpty { path: dst });
                }
            }
        }
        let to_rel = if parent.ufs_path.is_empty() {
            paths::components(&dst)?
                .last()
                .copied()
                .unwrap_or("")
                .to_string()
        } else {
            format!(
                "{}/{}",
                parent.ufs_path,
                paths::components(&dst)?.last().copied().unwrap_or("")
            )
        };
        let ufs = self.ufs.get(&mount)?;
        // Scrubbed with the options in clear (the stored ones are sealed).
        let scrub = |e: object_store::Error| MasterError::Unavailable {
            message: self.ufs.scrub(
                &mount,
                &format!("moving {src} to {dst} in the under-store: {e}"),
            ),
        };
        let from = ufs.path_of(&inode.ufs_path);
        let to = ufs.path_of(&to_rel);
        if let (Some(a), Some(b)) = (
            confined_path(&mount, &inode.ufs_path)?,
            confined_path(&mount, &to_rel)?,
        ) {
            // A local store renames in one step (files and whole directories).
            if inode.kind == Kind::File && inode.persist != Persist::Persisted && !a.exists() {
                return Ok(());
            }
            if let Some(p) = b.parent() {
                let _ = std::fs::create_dir_all(p);
            }
            if b.is_dir() {
                let _ = std::fs::remove_dir(&b);
            }
            return match std::fs::rename(&a, &b) {
                Ok(()) => Ok(()),
                // A directory made here with nothing in it yet, or a retried move.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(MasterError::Unavailable {
                    message: format!("moving {} to {}: {e}", a.display(), b.display()),
                }),
            };
        }
        match inode.kind {
            Kind::File => {
                if inode.persist != Persist::Persisted {
                    // Not in the store yet: its upload goes to the new path.
                    return Ok(());
                }
                match ufs.store.rename(&from, &to).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(scrub(e)),
                }
            }
            Kind::Directory => {
                let (from_s, to_s) = (from.as_ref().to_string(), to.as_ref().to_string());
                let store = ufs.store.clone();
                for_each_object(&ufs, &from, move |p| {
                    let store = store.clone();
                    let rest = p.as_ref()[from_s.len()..].to_string();
                    let target = object_store::path::Path::parse(format!("{to_s}{rest}"));
                    async move {
                        let target = target.map_err(|e| object_store::Error::Generic {
                            store: "granary",
                            source: Box::new(e),
                        })?;
                        store.rename(&p, &target).await
                    }
                })
                .await
                .map_err(scrub)?;
                Ok(())
            }
        }
    }
}

/// Runs `op` on every object under `prefix`, [`OBJECT_OPS_IN_FLIGHT`] at a time; an object
/// already gone counts as done (a retried request), any other failure is returned.
async fn for_each_object<F, Fut>(
    ufs: &granary_common::ufs::Ufs,
    prefix: &object_store::path::Path,
    op: F,
) -> Result<(), object_store::Error>
where
    F: Fn(object_store::path::Path) -> Fut,
    Fut: std::future::Future<Output = Result<(), object_store::Error>>,
{
    let objects: Vec<_> = ufs
        .store
        .list(Some(prefix))
        .map(|m| m.map(|m| m.location))
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let results: Vec<_> = futures::stream::iter(objects)
        .map(op)
        .buffer_unordered(OBJECT_OPS_IN_FLIGHT)
        .collect()
        .await;
    for r in results {
        match r {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The file-system path of `rel` in a local mount, checked against the mount's link policy
/// (no folder on the way may be a link leaving the root, even one swapped in after the
/// listing); `None` for other stores.
fn confined_path(mount: &Mount, rel: &str) -> Result<Option<std::path::PathBuf>, MasterError> {
    let Some(store) = mount.spec.open_local() else {
        return Ok(None);
    };
    let unavailable = |e: std::io::Error| MasterError::Unavailable {
        message: format!("the local under-store of {}: {e}", mount.path),
    };
    let store = store.map_err(unavailable)?;
    match store.checked_path(rel, true) {
        Ok(p) => Ok(Some(p)),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            Err(MasterError::PermissionDenied {
                message: format!("{rel} in {}: {e}", mount.path),
            })
        }
        Err(e) => Err(unavailable(e)),
    }
}
