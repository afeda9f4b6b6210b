//! Removing a big subtree from the namespace in bounded steps. A recursive delete or a
//! mount removal used to drop every entry below its folder in one Raft entry: on every
//! master, one apply that held all of its changes in memory and took time in proportion
//! to a folder anyone allowed to create entries can make (a million files: seconds of
//! stall and a gigabyte per master, replayed at every restart until a snapshot). The
//! leader now proposes the subtree's removal bottom-up, each entry a file or a folder of
//! at most [`PURGE_PAGE`] entries, before the command that removes the folder itself
//! (and a re-listing that finds a big cached folder gone from its store does the same
//! before its batch removes the name).
//! The entries are the `Delete`s every release applies alike, so a group in the middle of
//! an upgrade stays the same on every member.

use futures::future::join_all;

use crate::error::MasterError;
use crate::namespace::Namespace;
use crate::state::{Command, Inode, Kind, Persist};

/// The most entries below a folder that one `Delete` or `RemoveMount` removes in one
/// apply, and the most removals in flight at once (about 50 ms of a master's Raft thread
/// in a release build, far below an election timeout).
pub const PURGE_PAGE: u64 = 2_000;

/// The most entries below a mounted folder that one move rewrites (each entry's store path
/// changes with it). Larger moves are refused (`EXDEV` through the mount: `mv` copies,
/// then deletes, a file at a time).
pub const MAX_MOVE_ENTRIES: u64 = 100_000;

/// Removals proposed before their outcomes are awaited.
const IN_FLIGHT: usize = 256;

/// Names read per page of a folder.
const NAMES: usize = 256;

/// A folder whose entries are being proposed for removal.
struct Frame {
    id: u64,
    path: String,
    /// The last name proposed or descended into.
    after: Option<String>,
    /// Something below was kept (a file only workers hold): the folder stays.
    kept: bool,
}

/// Whether `node` is a file of mount `mount` that only workers hold (written must-cache,
/// or waiting for its upload): what a mount removal without `--force` must not lose.
fn unsaved(node: &Inode, mount: u64) -> bool {
    node.kind == Kind::File
        && node.complete
        && node.persist != Persist::Persisted
        && node.mount_id == Some(mount)
}

impl Namespace {
    /// Removes what is below `dir` (at `path`) from the namespace, not `dir` itself, in
    /// entries of at most [`PURGE_PAGE`] removals, children before their folders; the
    /// store is the caller's business. Mount points below stay (the caller's own command
    /// refuses them as before). Nothing is proposed when the subtree is small enough for
    /// the caller's command alone. With `keep` (a mount's id), the files of that mount only
    /// workers hold stay, with the folders above them: a mount removal's check, made again
    /// after the purge, then finds those begun while it ran. Returns how many entries were
    /// proposed.
    pub async fn purge_below(
        &self,
        dir: &Inode,
        path: &str,
        keep: Option<u64>,
    ) -> Result<u64, MasterError> {
        let sm = &self.sm;
        if sm.count_below(dir.id, PURGE_PAGE)? <= PURGE_PAGE {
            return Ok(0);
        }
        let mut stack = vec![Frame {
            id: dir.id,
            path: path.to_string(),
            after: None,
            kept: false,
        }];
        let mut flight = Vec::new();
        let mut proposed = 0u64;
        while let Some(top) = stack.last_mut() {
            // Steps name paths: a folder moved meanwhile (and another made at its old
            // path) must not lose what the new one holds.
            if sm.resolve_loaded(&top.path)?.map(|i| i.id) != Some(top.id) {
                return Err(MasterError::precondition(format!(
                    "{} moved while the entries below it were being removed; ask again",
                    granary_common::paths::shown(&top.path)
                )));
            }
            let page = sm.children(top.id, top.after.as_deref(), NAMES)?;
            let mut descend = None;
            for child in &page {
                top.after = Some(child.name.clone());
                let child_path = join(&top.path, &child.name);
                if child.is_mount_point {
                    continue;
                }
                if keep.is_some_and(|m| unsaved(child, m)) {
                    top.kept = true;
                    continue;
                }
                if child.kind == Kind::Directory
                    && (sm.count_below(child.id, PURGE_PAGE)? > PURGE_PAGE
                        || keep.is_some_and(|m| self.holds_unsaved(child, &child_path, m)))
                {
                    descend = Some(Frame {
                        id: child.id,
                        path: child_path,
                        after: None,
                        kept: false,
                    });
                    break;
                }
                flight.push(self.raft.start_proposal(&Command::Delete {
                    path: child_path,
                    recursive: true,
                })?);
                proposed += 1;
                if flight.len() >= IN_FLIGHT {
                    settle(join_all(flight.drain(..)).await)?;
                }
            }
            if let Some(frame) = descend {
                stack.push(frame);
                continue;
            }
            if page.len() < NAMES {
                // Everything below this folder is proposed; it goes after them (entries
                // apply in the order they were proposed). The caller removes `dir`.
                let done = stack.pop();
                match (done, stack.last_mut()) {
                    (Some(done), Some(parent)) if done.kept => parent.kept = true,
                    (Some(done), Some(_)) => {
                        flight.push(self.raft.start_proposal(&Command::Delete {
                            path: done.path,
                            recursive: true,
                        })?);
                        proposed += 1;
                    }
                    _ => {}
                }
            }
        }
        settle(join_all(flight).await)?;
        tracing::info!(
            path,
            entries = proposed,
            "removed a big subtree in bounded steps"
        );
        Ok(proposed)
    }
}

impl Namespace {
    /// Whether a folder of at most [`PURGE_PAGE`] entries holds a file of `mount` that only
    /// workers hold (a folder that cannot be walked is taken to hold one: it is kept).
    fn holds_unsaved(&self, dir: &Inode, path: &str, mount: u64) -> bool {
        self.sm
            .walk(dir.clone(), path.to_string())
            .any(|e| e.map_or(true, |(node, _)| unsaved(&node, mount)))
    }

    /// Before a re-listing's batches remove `removed` from folder `dir` (and replace the
    /// folders `retyped` by files): each of them that is a folder holding more cached
    /// entries than one apply may remove loses them in bounded steps first (a dataset
    /// folder deleted in the store by other means). Names the batch will keep (changed
    /// since the listing began; unlisted ones kept while unlisted) are left alone, as the
    /// batch (`state::sync`) leaves them.
    pub(crate) async fn purge_vanished(
        &self,
        dir: &Inode,
        removed: &[String],
        retyped: &[String],
        seen: &std::collections::BTreeMap<String, u64>,
    ) -> Result<(), MasterError> {
        let now_ms = granary_common::now_ms();
        let mut dir_path = None;
        let names = removed.iter().map(|n| (n, true));
        for (name, unlisted) in names.chain(retyped.iter().map(|n| (n, false))) {
            let Some(child) = self.sm.child(dir.id, name)? else {
                continue;
            };
            if child.kind != Kind::Directory
                || child.is_mount_point
                || seen.get(name) != Some(&child.version)
                || (unlisted && child.kept_when_unlisted(now_ms))
            {
                continue;
            }
            let dir_path = match &dir_path {
                Some(p) => p,
                None => dir_path.insert(self.sm.path_of(dir)?),
            };
            self.purge_below(&child, &join(dir_path, name), None)
                .await?;
        }
        Ok(())
    }
}

/// The first failure among removals that should have been applied. An entry already gone
/// (removed meanwhile by someone else) or one that holds a mount point (refused, as the
/// caller's own command will be) is no failure of the purge.
fn settle<T>(outcomes: Vec<Result<T, MasterError>>) -> Result<(), MasterError> {
    for outcome in outcomes {
        match outcome {
            Ok(_)
            | Err(MasterError::NotFound { .. })
            | Err(MasterError::Busy { .. })
            | Err(MasterError::NotADirectory { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}
