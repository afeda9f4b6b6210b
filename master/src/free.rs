//! `granary free`: drops the cached copies of a file, or of everything below a folder, on
//! every worker. Refuses what a free would lose or undo: pinned data, and files whose only
//! copies are cached (written through Granary, not in the under-store yet) unless forced.

use std::collections::HashSet;

use granary_proto as pb;

use crate::core::MasterCore;
use crate::error::MasterError;
use crate::state::{Kind, Persist};

/// Examples of unpersisted files named in a refusal.
const EXAMPLES: usize = 3;

impl MasterCore {
    /// Refuses removing the mount at `path` while files of it are readable only from
    /// workers: complete, and not in its under-store (an async-through file whose upload
    /// is pending, a must-cache file). A file still being written (or left unfinished by
    /// a writer that died) holds nothing readable and does not count; a path that is no
    /// mount is left to the removal's own error.
    pub async fn refuse_losing_writes(&self, path: &str) -> Result<(), MasterError> {
        self.ensure_leader()?;
        self.read_barrier().await?;
        let sm = &self.namespace().sm;
        let Some(mount) = sm.mounts()?.into_iter().find(|m| m.path == path) else {
            return Ok(());
        };
        let Ok(root) = self.namespace().resolve(path).await else {
            return Ok(());
        };
        let (mut pending, mut cached_only, mut examples) = (0u64, 0u64, Vec::new());
        for entry in sm.walk(root, path.to_string()) {
            // A namespace that cannot be walked (a record left broken) is not checked:
            // removing its mount is the repair.
            let (node, p) = match entry {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(%path, error = %e, "cannot check for unpersisted files below");
                    return Ok(());
                }
            };
            if node.kind == Kind::Directory
                || !node.complete
                || node.persist == Persist::Persisted
                || node.mount_id != Some(mount.id)
            {
                continue;
            }
            if node.persist == Persist::Pending {
                pending += 1;
            } else {
                cached_only += 1;
            }
            if examples.len() < EXAMPLES {
                examples.push(p);
            }
        }
        if pending + cached_only > 0 {
            return Err(MasterError::precondition(format!(
                "{} file(s) of the mount at {path} are only on workers (e.g. {}; {pending} waiting for their upload, {cached_only} written must-cache): removing the mount would lose them; wait for the uploads (granary fs stat shows persisted), delete the others (granary fs rm), or use --force",
                pending + cached_only,
                examples.join(", ")
            )));
        }
        Ok(())
    }

    pub async fn free(
        &self,
        path: &str,
        recursive: bool,
        force: bool,
    ) -> Result<pb::FreeResponse, MasterError> {
        self.ensure_leader()?;
        self.read_barrier().await?;
        let path = granary_common::paths::normalize(path)?;
        let root = self.namespace().resolve(&path).await?;
        if root.kind == Kind::Directory && !recursive {
            return Err(MasterError::precondition(format!(
                "{path} is a directory: use -R to free everything below it"
            )));
        }
        if self.namespace().sm.pin_covering(&root)?.is_some() {
            return Err(MasterError::precondition(format!(
                "{path} is pinned: unpin it first (granary unpin)"
            )));
        }
        // Files below it, as far as the namespace is listed (what was never listed was
        // never cached), and any pin among them.
        let pinned: HashSet<u64> = self
            .namespace()
            .sm
            .pins()?
            .into_iter()
            .map(|(i, _)| i)
            .collect();
        let mut files = HashSet::new();
        let mut unpersisted: Vec<String> = Vec::new();
        let mut unpersisted_count = 0u64;
        for entry in self.namespace().sm.walk(root, path.clone()) {
            let (node, p) = entry?;
            if pinned.contains(&node.id) {
                return Err(MasterError::precondition(format!(
                    "{p} (below {path}) is pinned: unpin it first (granary unpin)"
                )));
            }
            if node.kind != Kind::Directory {
                if node.persist != Persist::Persisted {
                    unpersisted_count += 1;
                    if unpersisted.len() < EXAMPLES {
                        unpersisted.push(p);
                    }
                }
                files.insert(node.id);
            }
        }
        if unpersisted_count > 0 && !force {
            return Err(MasterError::precondition(format!(
                "{unpersisted_count} file(s) under {path} are not in the under-store yet (e.g. {}): freeing would lose their only copies; wait until they are persisted (granary fs stat shows it) or use --force",
                unpersisted.join(", ")
            )));
        }
        let (cached_files, workers) = self.fleet().free(&files);
        tracing::info!(path = %path, files = files.len(), cached_files, workers, forced_unpersisted = unpersisted_count, "freeing cached copies");
        Ok(pb::FreeResponse {
            files: files.len() as u64,
            cached_files: cached_files as u64,
            workers: workers as u64,
            unpersisted_files: unpersisted_count,
        })
    }
}
