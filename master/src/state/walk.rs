//! Walks of the namespace as the state machine holds it (what was listed; nothing is
//! listed from an under-store here), a page of names at a time so that a walk holds at
//! most a page per level in memory whatever the folders' sizes. Pins, `free` and the
//! recursive re-listing of `granary fs sync` walk with these.

use super::{keys, Inode, Kind, StateMachine};
use crate::error::MasterError;

/// Names read from the state per page.
pub const PAGE: usize = 1000;

/// Folders deeper than this mean a namespace that loops (a damaged state): the walk ends
/// with an error instead of going round for ever (as `path_of` bounds a parent chain).
pub const MAX_DEPTH: usize = 4096;

/// The children of one directory in name order.
pub struct Children<'a> {
    sm: &'a StateMachine,
    dir: u64,
    after: Option<String>,
    page: std::vec::IntoIter<Inode>,
    done: bool,
}

impl Iterator for Children<'_> {
    type Item = Result<Inode, MasterError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(child) = self.page.next() {
                return Some(Ok(child));
            }
            if self.done {
                return None;
            }
            match self.sm.children(self.dir, self.after.as_deref(), PAGE) {
                Ok(page) => {
                    self.done = page.len() < PAGE;
                    self.after = page.last().map(|c| c.name.clone());
                    self.page = page.into_iter();
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

/// Every node at or below a root, the root first, then depth first in name order, each
/// with its path. After an error the walk ends.
pub struct Walk<'a> {
    sm: &'a StateMachine,
    root: Option<(Inode, String)>,
    /// The folders being walked, innermost last, each with its path.
    open: Vec<(Children<'a>, String)>,
}

impl Walk<'_> {
    fn enter(&mut self, node: &Inode, path: &str) -> Result<(), MasterError> {
        if node.kind != Kind::Directory {
            return Ok(());
        }
        if self.open.len() >= MAX_DEPTH {
            self.open.clear();
            return Err(MasterError::inconsistent(format!(
                "{path} is more than {MAX_DEPTH} folders deep: the namespace loops"
            )));
        }
        self.open
            .push((self.sm.children_of(node.id), path.to_string()));
        Ok(())
    }
}

impl Iterator for Walk<'_> {
    type Item = Result<(Inode, String), MasterError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some((root, path)) = self.root.take() {
            return Some(self.enter(&root, &path).map(|()| (root, path)));
        }
        loop {
            let (children, parent) = self.open.last_mut()?;
            match children.next() {
                None => {
                    self.open.pop();
                }
                Some(Err(e)) => {
                    self.open.clear();
                    return Some(Err(e));
                }
                Some(Ok(child)) => {
                    let path = granary_common::paths::join(parent, &child.name);
                    return Some(self.enter(&child, &path).map(|()| (child, path)));
                }
            }
        }
    }
}

impl StateMachine {
    /// The children of `dir`, read a page at a time.
    pub fn children_of(&self, dir: u64) -> Children<'_> {
        Children {
            sm: self,
            dir,
            after: None,
            page: Vec::new().into_iter(),
            done: false,
        }
    }

    /// How many entries are below `dir` (`dir` itself not counted), counting no further
    /// than `limit + 1`: the check before work that grows with a subtree (a move that
    /// rewrites every entry below, a delete in one apply), bounded whatever the subtree
    /// (a namespace that loops only reaches the limit).
    pub fn count_below(&self, dir: u64, limit: u64) -> Result<u64, MasterError> {
        let cf = self.cf()?;
        let mut stack = vec![dir];
        let mut n = 0u64;
        while let Some(id) = stack.pop() {
            let prefix = keys::children(id);
            let mut it = self.db.raw_iterator_cf(cf);
            it.seek(&prefix);
            while it.valid() {
                let (Some(k), Some(v)) = (it.key(), it.value()) else {
                    break;
                };
                if !k.starts_with(&prefix) {
                    break;
                }
                n += 1;
                if n > limit {
                    return Ok(n);
                }
                stack.push(super::u64_of(v)?);
                it.next();
            }
            it.status()?;
        }
        Ok(n)
    }

    /// Every node at or below `root` (whose path is `path`).
    pub fn walk(&self, root: Inode, path: String) -> Walk<'_> {
        Walk {
            sm: self,
            root: Some((root, path)),
            open: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ApplyOutput, Command, ROOT_INODE};
    use super::*;

    #[test]
    fn a_walk_visits_every_node_once_root_first_in_name_order_across_pages() {
        let (_d, sm) = super::super::tests::open();
        let mut index = 0;
        let mut apply = |cmd: Command| {
            index += 1;
            sm.apply(index, &cmd).unwrap()
        };
        apply(Command::Mkdir {
            path: "/t/b/deep".into(),
            recursive: true,
            mode: 0,
            now_ms: 1,
            owner: None,
        });
        apply(Command::Mkdir {
            path: "/t/a".into(),
            recursive: false,
            mode: 0,
            now_ms: 1,
            owner: None,
        });
        // More names than a page in one folder, and a file below the nested one.
        let many = PAGE * 2 + 7;
        let mut files: Vec<String> = (0..many).map(|i| format!("/t/a/f{i:05}")).collect();
        files.push("/t/b/deep/z".into());
        for path in &files {
            let out = apply(Command::CreateFile {
                path: path.clone(),
                mode: 0,
                block_size: 0,
                now_ms: 1,
                overwrite: false,
                owner: None,
                creator: None,
            });
            assert!(matches!(out, ApplyOutput::Inode(_)));
        }
        let root = sm.resolve_loaded("/t").unwrap().unwrap();
        let seen: Vec<String> = sm.walk(root, "/t".into()).map(|e| e.unwrap().1).collect();
        let mut expected = vec!["/t".to_string(), "/t/a".into()];
        expected.extend(files[..many].iter().cloned());
        expected.extend(["/t/b".into(), "/t/b/deep".into(), "/t/b/deep/z".into()]);
        assert_eq!(seen, expected);
        assert_eq!(sm.children_of(ROOT_INODE).count(), 1);
        let a = sm.resolve_loaded("/t/a").unwrap().unwrap();
        assert_eq!(sm.children_of(a.id).count(), many);
        // Counts stop past their limit; a folder counts what is below it, not itself.
        let t = sm.resolve_loaded("/t").unwrap().unwrap();
        let below = many as u64 + 4; // a, b, b/deep, b/deep/z and the files
        assert_eq!(sm.count_below(t.id, u64::MAX).unwrap(), below);
        assert_eq!(sm.count_below(t.id, below).unwrap(), below);
        assert_eq!(sm.count_below(t.id, 10).unwrap(), 11);
        assert_eq!(sm.count_below(a.id, 0).unwrap(), 1);
        // A file is a walk of itself.
        let f = sm.resolve_loaded("/t/b/deep/z").unwrap().unwrap();
        assert_eq!(sm.walk(f, "/z".into()).count(), 1);
    }

    #[test]
    fn a_walk_of_a_namespace_that_loops_ends_with_an_error() {
        // A damaged state whose folders loop (/x/y/loop is /x).
        let (_d, sm) = super::super::tests::open();
        sm.apply(
            1,
            &Command::Mkdir {
                path: "/x/y".into(),
                recursive: true,
                mode: 0,
                now_ms: 1,
                owner: None,
            },
        )
        .unwrap();
        let x = sm.resolve_loaded("/x").unwrap().unwrap();
        let y = sm.resolve_loaded("/x/y").unwrap().unwrap();
        let cf = sm.cf().unwrap();
        sm.db
            .put_cf(
                cf,
                super::super::keys::child(y.id, "loop"),
                x.id.to_be_bytes(),
            )
            .unwrap();
        let mut n = 0;
        let mut last = None;
        let x_id = x.id;
        for entry in sm.walk(x, "/x".into()) {
            n += 1;
            last = Some(entry);
            assert!(n <= 2 * MAX_DEPTH + 2, "the walk does not end");
        }
        let err = last.unwrap().unwrap_err();
        assert!(err.to_string().contains("loops"), "{err}");
        // A count of a namespace that loops ends at its limit.
        assert_eq!(sm.count_below(x_id, 10_000).unwrap(), 10_001);
    }
}
