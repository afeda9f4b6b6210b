//! The rules the replicated state keeps, checked when a master starts (and after every step
//! of the adversarial model test). A state that breaks one was left by an older version or
//! by a damaged disk: the master names the key and the rule and keeps serving — commands
//! touching the broken part fail with `INTERNAL` ("the namespace is inconsistent"), the
//! same on every member, and `docs/operations.md` says how to repair each kind.

use std::fmt;

use super::{decode_record, keys, u64_of, Inode, Kind, Mount, StateMachine, ROOT_INODE};
use crate::error::MasterError;

/// One broken rule: the key (printable) and the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub key: String,
    pub rule: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.rule)
    }
}

/// Renders a key as tag + big-endian id + rest (names as text).
fn show_key(k: &[u8]) -> String {
    match k {
        [tag, rest @ ..] if rest.len() >= 8 => {
            let id = u64::from_be_bytes(rest[..8].try_into().unwrap_or_default());
            let tail = String::from_utf8_lossy(&rest[8..]);
            if tail.is_empty() {
                format!("{}{}", *tag as char, id)
            } else {
                format!("{}{}/{}", *tag as char, id, tail)
            }
        }
        _ => String::from_utf8_lossy(k).into_owned(),
    }
}

impl StateMachine {
    /// Checks the rules of the state; at most `limit` violations are returned. Without
    /// `full` (a master's start) it reads the mounts, pins and TTLs, and each directory
    /// entry's key once with one read per directory; `full` (the model tests) also reads
    /// every entry's inode and every inode (each linked from its parent under its name,
    /// and counted).
    pub fn check_invariants(
        &self,
        full: bool,
        limit: usize,
    ) -> Result<Vec<Violation>, MasterError> {
        let mut out = Vec::new();
        let mut note = |key: String, rule: String| {
            if out.len() < limit {
                out.push(Violation { key, rule });
            }
        };
        match self.inode(ROOT_INODE)? {
            Some(r) if r.kind == Kind::Directory => {}
            Some(_) => note(
                show_key(&keys::inode(ROOT_INODE)),
                "the root is not a directory".into(),
            ),
            None => note(
                show_key(&keys::inode(ROOT_INODE)),
                "the root inode is missing".into(),
            ),
        }
        // Mounts: an inode that is this mount's mount point, at the recorded path.
        for m in self.mounts()? {
            let key = show_key(&keys::mount(m.id));
            match self.inode(m.inode)? {
                None => note(
                    key,
                    format!(
                        "mount {} names inode {}, which does not exist",
                        m.path, m.inode
                    ),
                ),
                Some(i) if !i.is_mount_point || i.mount_id != Some(m.id) => note(
                    key,
                    format!(
                        "mount {} names inode {}, which is not its mount point",
                        m.path, m.inode
                    ),
                ),
                Some(i) => match self.path_of(&i) {
                    Ok(p) if p == m.path => {}
                    Ok(p) => note(key, format!("mount {} has its mount point at {p}", m.path)),
                    Err(e) => note(key, format!("mount {}: {e}", m.path)),
                },
            }
        }
        check_mount_overlaps(&self.mounts()?, &mut note);
        // Pins and TTLs name existing inodes.
        for (tag, what) in [(keys::PIN, "pin"), (keys::TTL, "TTL")] {
            let mut named = Vec::new();
            self.scan(&[tag], |k, _| {
                named.push((k.to_vec(), u64_of(&k[1..])?));
                Ok(true)
            })?;
            for (k, id) in named {
                if self.inode(id)?.is_none() {
                    note(
                        show_key(&k),
                        format!("a {what} names inode {id}, which does not exist"),
                    );
                }
            }
        }
        // Directory entries: the parent is a directory (one read per directory: entries
        // of one parent are adjacent); with `full`, the child exists and names it back.
        // Streamed: nothing proportional to the namespace is held, except `full`'s set.
        let mut last_parent: Option<(u64, bool)> = None;
        let mut linked = std::collections::HashSet::new();
        self.scan(b"c", |k, v| {
            if k.len() < 9 {
                note(show_key(k), "a directory entry key is too short".into());
                return Ok(true);
            }
            let child = u64_of(v)?;
            let parent = u64::from_be_bytes(k[1..9].try_into().unwrap_or_default());
            let parent_ok = match last_parent {
                Some((p, ok)) if p == parent => ok,
                _ => {
                    let ok = self
                        .inode(parent)?
                        .is_some_and(|p| p.kind == Kind::Directory);
                    last_parent = Some((parent, ok));
                    ok
                }
            };
            if !parent_ok {
                note(
                    show_key(k),
                    format!("an entry of inode {parent}, which is not an existing directory"),
                );
            }
            if full {
                linked.insert(child);
                let name = String::from_utf8_lossy(&k[9..]);
                match self.inode(child)? {
                    None => note(
                        show_key(k),
                        format!("entry {name} names inode {child}, which does not exist"),
                    ),
                    Some(c) if c.parent != parent || c.name != name => note(
                        show_key(k),
                        format!(
                            "entry {name} names inode {child}, whose parent and name are {} and {}",
                            c.parent, c.name
                        ),
                    ),
                    Some(_) => {}
                }
            }
            Ok(true)
        })?;
        if full {
            let mut count = 0u64;
            self.scan(&[keys::INODE], |_, v| {
                let i: Inode = decode_record(v)?;
                count += 1;
                if i.id != ROOT_INODE && !linked.contains(&i.id) {
                    note(
                        show_key(&keys::inode(i.id)),
                        format!("inode {} ({}) is in no directory", i.id, i.name),
                    );
                }
                Ok(true)
            })?;
            let recorded = self.inode_count()?;
            if recorded != count {
                note(
                    "Minodes".into(),
                    format!("the inode count is {recorded}, but {count} inodes exist"),
                );
            }
            self.check_cache(&mut note)?;
        }
        Ok(out)
    }

    /// What the state machine holds decoded is what the store holds.
    fn check_cache(&self, note: &mut impl FnMut(String, String)) -> Result<(), MasterError> {
        let (inodes, entries) = self.cache.held_items();
        for (id, cached) in inodes {
            let key = keys::inode(id);
            let stored: Option<Inode> = self.get(&key)?.map(|v| decode_record(&v)).transpose()?;
            if stored.as_ref() != Some(&cached) {
                note(
                    show_key(&key),
                    "the decoded cache differs from the store".into(),
                );
            }
        }
        for (key, cached) in entries {
            let stored = self.get(&key)?.map(|v| u64_of(&v)).transpose()?;
            if stored != Some(cached) {
                note(
                    show_key(&key),
                    "the decoded cache differs from the store".into(),
                );
            }
        }
        Ok(())
    }
}

/// No mount point is at or below another.
fn check_mount_overlaps(mounts: &[Mount], note: &mut impl FnMut(String, String)) {
    for (i, a) in mounts.iter().enumerate() {
        for b in &mounts[i + 1..] {
            if granary_common::paths::is_within(&a.path, &b.path)
                || granary_common::paths::is_within(&b.path, &a.path)
            {
                note(
                    show_key(&keys::mount(b.id)),
                    format!("mount {} overlaps mount {}", b.path, a.path),
                );
            }
        }
    }
}
