//! A folder's re-listing merged with what is known, a page at a time: memory bounded by a
//! page of the listing and a page of known children, whatever the folder's size.
//!
//! Object stores list in key order, and a folder's key is its name followed by the
//! delimiter (`a/` comes after `a-b` and `a.txt`), while known children are read in name
//! order. Known children are put in key order as they are read (a folder waits on a stack
//! while names that extend it with a character below `/` go by; the stack holds a chain of
//! names, each a prefix of the next). A listed file whose folder twin (same name, `/`) may
//! still come in a later page waits for it: a folder of the same name wins, as in a whole
//! listing. Everything up to a page's last key is decided with that page; what is known
//! after it is left alone, so a listing that fails part-way changes nothing past the pages
//! that came.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashSet, VecDeque};

use granary_common::paths;

use crate::state::{Fingerprint, Inode, Kind, UfsEntry};

/// Known children read from the namespace at a time.
pub(super) const KNOWN_PAGE: usize = 1000;

/// A known child, as much of it as a listing is compared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Known {
    pub name: String,
    pub kind: Kind,
    pub fingerprint: Option<Fingerprint>,
    pub version: u64,
    pub id: u64,
}

impl From<Inode> for Known {
    fn from(i: Inode) -> Self {
        Known {
            name: i.name,
            kind: i.kind,
            fingerprint: i.fingerprint,
            version: i.version,
            id: i.id,
        }
    }
}

/// A position in a store's key order: a name, and whether it is a folder's (`name/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Key {
    name: String,
    dir: bool,
}

impl Key {
    fn of(name: &str, kind: Kind) -> Key {
        Key {
            name: name.to_string(),
            dir: kind == Kind::Directory,
        }
    }
}

fn key_cmp(a: &str, a_dir: bool, b: &str, b_dir: bool) -> Ordering {
    let a = a.bytes().chain(a_dir.then_some(b'/'));
    a.cmp(b.bytes().chain(b_dir.then_some(b'/')))
}

impl Ord for Key {
    fn cmp(&self, o: &Self) -> Ordering {
        key_cmp(&self.name, self.dir, &o.name, o.dir)
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

fn known_key(k: &Known) -> Key {
    Key::of(&k.name, k.kind)
}

/// How far a page decides: up to its last key, or everything (the listing's last page).
#[derive(Debug, PartialEq, Eq)]
enum Upto {
    Nothing,
    Key(Key),
    All,
}

impl Upto {
    fn covers(&self, k: &Key) -> bool {
        match self {
            Upto::Nothing => false,
            Upto::Key(b) => k <= b,
            Upto::All => true,
        }
    }
}

/// What one page of a listing changes: entries to add or update, names to remove, the
/// versions known of all of them when the page was merged (the apply leaves alone an entry
/// changed since), and the known files among them (their cached versions may go stale).
#[derive(Debug, Default, PartialEq)]
pub(super) struct Changes {
    pub upserts: Vec<UfsEntry>,
    pub removed: Vec<String>,
    /// Known folders the page lists as files now (their upserts replace them).
    pub retyped: Vec<String>,
    pub seen: BTreeMap<String, u64>,
    pub files: Vec<(String, u64, u64)>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.upserts.is_empty() && self.removed.is_empty()
    }
}

/// A page whose keys do not all come after the pages before it.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct OutOfOrder {
    pub key: String,
    pub after: String,
}

#[derive(Debug)]
pub(super) enum MergeError<E> {
    OutOfOrder(OutOfOrder),
    Known(E),
}

/// The merge of one folder's listing, fed a page at a time ([`Merge::page`]).
pub(super) struct Merge {
    /// Known children read (name order) and not yet put in key order.
    read: VecDeque<Known>,
    /// The last name read, and whether the folder has no more.
    cursor: Option<String>,
    exhausted: bool,
    /// Known folders waiting for their key (see the module's comment); deepest on top.
    held_dirs: Vec<Known>,
    /// The next known child in key order, taken and not yet merged.
    peeked: Option<Known>,
    /// Known files whose listed namesake waits in `held_files`.
    held_known: Vec<Known>,
    /// Listed files whose folder twin may come in a later page.
    held_files: Vec<UfsEntry>,
    /// The last key of the pages merged so far.
    passed: Option<Key>,
    /// Known children read at a time ([`KNOWN_PAGE`]; less in tests).
    known_page: usize,
}

impl Default for Merge {
    fn default() -> Self {
        Merge::reading(KNOWN_PAGE)
    }
}

impl Merge {
    /// A merge that reads known children `known_page` at a time.
    pub fn reading(known_page: usize) -> Merge {
        Merge {
            read: VecDeque::new(),
            cursor: None,
            exhausted: false,
            held_dirs: Vec::new(),
            peeked: None,
            held_known: Vec::new(),
            held_files: Vec::new(),
            passed: None,
            known_page: known_page.max(1),
        }
    }

    /// Merges one page of the listing (`last`: the listing's end); `known` reads the
    /// folder's known children in name order after a name, at most so many.
    pub fn page<E>(
        &mut self,
        entries: Vec<UfsEntry>,
        last: bool,
        known: &mut impl FnMut(Option<&str>, usize) -> Result<Vec<Known>, E>,
    ) -> Result<Changes, MergeError<E>> {
        let passed = self.passed.clone();
        let behind = |e: &UfsEntry| {
            passed.as_ref().is_some_and(|p| {
                key_cmp(&e.name, e.kind == Kind::Directory, &p.name, p.dir).is_le()
            })
        };
        if let (Some(e), Some(p)) = (
            entries.iter().find(|e| e.kind == Kind::File && behind(e)),
            &passed,
        ) {
            return Err(MergeError::OutOfOrder(OutOfOrder {
                key: e.name.clone(),
                after: p.name.clone(),
            }));
        }
        // A folder named again on a later page (some stores repeat their common prefixes).
        let mut entries = entries;
        entries.retain(|e| !behind(e));
        let top = entries
            .iter()
            .map(|e| Key::of(&e.name, e.kind))
            .max()
            .or(passed);
        let upto = match (last, top) {
            (true, _) => Upto::All,
            (false, Some(k)) => Upto::Key(k),
            (false, None) => Upto::Nothing,
        };
        let listed = self.listed(entries, &upto);
        let known_now = self.known_until(&upto, known).map_err(MergeError::Known)?;
        if let Upto::Key(k) = upto {
            self.passed = Some(k);
        }
        Ok(changes(listed, known_now))
    }

    /// Names below which every child is decided by the pages merged so far (`None`: none
    /// yet): the last key passed, cut before its first byte below `/` — a name that such a
    /// byte extends may still be a folder, whose key comes later.
    pub fn decided_below(&self) -> Option<String> {
        let p = self.passed.as_ref()?;
        let mut below = p.name.clone();
        if p.dir {
            below.push('/');
        }
        let cut = below.bytes().position(|b| b < b'/').unwrap_or(below.len());
        below.truncate(cut);
        Some(below)
    }

    /// The page's entries (and files held from before) decided with this page, in key
    /// order; files whose folder twin may still come are held.
    fn listed(&mut self, entries: Vec<UfsEntry>, upto: &Upto) -> Vec<UfsEntry> {
        let mut listed: Vec<UfsEntry> = std::mem::take(&mut self.held_files);
        listed.extend(
            entries
                .into_iter()
                .filter(|e| paths::validate_name(&e.name).is_ok()),
        );
        let dirs: HashSet<String> = listed
            .iter()
            .filter(|e| e.kind == Kind::Directory)
            .map(|e| e.name.clone())
            .collect();
        // A folder of the same name wins.
        listed.retain(|e| e.kind == Kind::Directory || !dirs.contains(&e.name));
        if *upto != Upto::All {
            let (held, rest): (Vec<_>, Vec<_>) = listed.into_iter().partition(|e| {
                e.kind == Kind::File && !upto.covers(&Key::of(&e.name, Kind::Directory))
            });
            self.held_files = held;
            listed = rest;
        }
        listed.sort_by(|a, b| {
            key_cmp(
                &a.name,
                a.kind == Kind::Directory,
                &b.name,
                b.kind == Kind::Directory,
            )
        });
        listed
    }

    /// Known children up to `upto` in key order, less those whose
    /// listed namesake is held; children that appeared behind the merge are left alone.
    fn known_until<E>(
        &mut self,
        upto: &Upto,
        known: &mut impl FnMut(Option<&str>, usize) -> Result<Vec<Known>, E>,
    ) -> Result<Vec<Known>, E> {
        let mut now = std::mem::take(&mut self.held_known);
        loop {
            if self.peeked.is_none() {
                self.peeked = self.next_known(known)?;
            }
            let Some(k) = self.peeked.take() else { break };
            let key = known_key(&k);
            if !upto.covers(&key) {
                self.peeked = Some(k);
                break;
            }
            // Added behind the merge (by this listing's own batches, or a lookup): newer
            // than the pages that passed its key.
            if self.passed.as_ref().is_some_and(|p| key <= *p) {
                continue;
            }
            now.push(k);
        }
        let held: HashSet<&str> = self.held_files.iter().map(|e| e.name.as_str()).collect();
        let (held, now): (Vec<_>, Vec<_>) = now
            .into_iter()
            .partition(|k| k.kind == Kind::File && held.contains(k.name.as_str()));
        self.held_known = held;
        let mut now = now;
        now.sort_by_cached_key(known_key);
        Ok(now)
    }

    /// The next known child in key order.
    fn next_known<E>(
        &mut self,
        known: &mut impl FnMut(Option<&str>, usize) -> Result<Vec<Known>, E>,
    ) -> Result<Option<Known>, E> {
        loop {
            if self.read.is_empty() && !self.exhausted {
                let got = known(self.cursor.as_deref(), self.known_page)?;
                self.exhausted = got.len() < self.known_page;
                if let Some(l) = got.last() {
                    self.cursor = Some(l.name.clone());
                }
                self.read.extend(got);
            }
            // A held folder goes first when its key comes before the next name's.
            let dir_first = match (self.held_dirs.last(), self.read.front()) {
                (Some(d), Some(n)) => known_key(d) < known_key(n),
                (held, _) => held.is_some(),
            };
            if dir_first {
                return Ok(self.held_dirs.pop());
            }
            match self.read.pop_front() {
                Some(n) if n.kind == Kind::Directory => self.held_dirs.push(n),
                next => return Ok(next),
            }
        }
    }
}

/// Whether a listed entry says something other than the known child of its key.
fn differs(k: &Known, e: &UfsEntry) -> bool {
    match (&k.fingerprint, &e.fingerprint) {
        (Some(a), Some(b)) => !a.same_object(b),
        (None, None) => false,
        _ => true,
    }
}

/// The changes of listed entries and known children of the same key range (both in key
/// order).
fn changes(listed: Vec<UfsEntry>, known: Vec<Known>) -> Changes {
    let mut c = Changes::default();
    let mut gone: Vec<Known> = Vec::new();
    let mut known = known.into_iter().peekable();
    for e in listed {
        let key = Key::of(&e.name, e.kind);
        while let Some(k) = known.next_if(|k| known_key(k) < key) {
            gone.push(k);
        }
        match known.next_if(|k| known_key(k) == key) {
            Some(k) if !differs(&k, &e) => {}
            Some(k) => {
                c.seen.insert(k.name.clone(), k.version);
                if k.kind == Kind::File {
                    c.files.push((k.name, k.id, k.version));
                }
                c.upserts.push(e);
            }
            None => c.upserts.push(e),
        }
    }
    gone.extend(known);
    let upserted: HashSet<&str> = c.upserts.iter().map(|e| e.name.as_str()).collect();
    let mut removed = Vec::new();
    for k in gone {
        // Listed under the other kind: the upsert replaces it.
        if !upserted.contains(k.name.as_str()) {
            removed.push(k.name.clone());
        } else if k.kind == Kind::Directory {
            c.retyped.push(k.name.clone());
        }
        c.seen.insert(k.name.clone(), k.version);
        if k.kind == Kind::File {
            c.files.push((k.name, k.id, k.version));
        }
    }
    c.removed = removed;
    c
}

#[cfg(test)]
mod tests;
