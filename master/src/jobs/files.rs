//! The files a job covers, a page at a time: a depth-first walk of the namespace below
//! the job's path that lists folders from their under-store where they were not listed
//! yet (as `ls` through a mount would) and holds at most a page of names per folder level,
//! whatever the folders' sizes. A load of ten million files streams through it; nothing
//! the walk holds grows with the number of files.

use crate::core::MasterCore;
use crate::error::MasterError;
use crate::state::walk::MAX_DEPTH;
use crate::state::{Inode, Kind};

/// Entries listed per folder page.
pub(super) const PAGE: usize = 1000;

/// One folder being walked.
struct Open {
    dir: Inode,
    path: String,
    /// The last name listed (the next page starts after it).
    after: Option<String>,
    /// Whether the last page listed was the folder's last.
    listed: bool,
    /// Folders of the pages listed so far not entered yet, the next one last.
    folders: Vec<(Inode, String)>,
}

/// The files at or below a root, each with its path.
pub(super) struct Files {
    /// A root that is a file: the only one.
    file: Option<(Inode, String)>,
    /// The folders being walked, innermost last.
    open: Vec<Open>,
    /// Files and bytes returned so far.
    seen: (u64, u64),
}

impl Files {
    pub(super) fn new(root: Inode, root_path: String) -> Files {
        if root.kind == Kind::Directory {
            Files {
                file: None,
                open: vec![Open::new(root, root_path)],
                seen: (0, 0),
            }
        } else {
            Files {
                file: Some((root, root_path)),
                open: Vec::new(),
                seen: (0, 0),
            }
        }
    }

    /// The files and bytes the walk has returned so far.
    pub(super) fn seen(&self) -> (u64, u64) {
        self.seen
    }

    /// The next files (at most a page, never none), or None when the walk is over.
    pub(super) async fn next_page(
        &mut self,
        core: &MasterCore,
    ) -> Result<Option<Vec<(Inode, String)>>, MasterError> {
        let page = self.next_files(core).await?;
        if let Some(files) = &page {
            self.seen.0 += files.len() as u64;
            self.seen.1 = files
                .iter()
                .fold(self.seen.1, |sum, (f, _)| sum.saturating_add(f.length));
        }
        Ok(page)
    }

    async fn next_files(
        &mut self,
        core: &MasterCore,
    ) -> Result<Option<Vec<(Inode, String)>>, MasterError> {
        if let Some(f) = self.file.take() {
            return Ok(Some(vec![f]));
        }
        loop {
            let depth = self.open.len();
            let Some(top) = self.open.last_mut() else {
                return Ok(None);
            };
            if let Some((dir, path)) = top.folders.pop() {
                if depth >= MAX_DEPTH {
                    self.open.clear();
                    return Err(MasterError::inconsistent(format!(
                        "{path} is more than {MAX_DEPTH} folders deep: the namespace loops"
                    )));
                }
                self.open.push(Open::new(dir, path));
                continue;
            }
            if top.listed {
                self.open.pop();
                continue;
            }
            let page = core
                .namespace()
                .list(top.dir.clone(), top.after.as_deref(), PAGE)
                .await?;
            top.listed = page.len() < PAGE;
            top.after = page.last().map(|c| c.name.clone());
            let mut files = Vec::new();
            for child in page {
                let path = granary_common::paths::join(&top.path, &child.name);
                match child.kind {
                    Kind::Directory => top.folders.push((child, path)),
                    _ => files.push((child, path)),
                }
            }
            // Entered in name order: the next one is the last.
            top.folders.reverse();
            if !files.is_empty() {
                return Ok(Some(files));
            }
        }
    }
}

impl Open {
    fn new(dir: Inode, path: String) -> Open {
        Open {
            dir,
            path,
            after: None,
            listed: false,
            folders: Vec::new(),
        }
    }
}
