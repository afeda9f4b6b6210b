//! Open directories, listed page by page as `readdir` gets to them.

use std::collections::VecDeque;

use granary_client::watch::Since;

use super::*;

/// Entries fetched per page of a directory listing.
const DIR_PAGE: u32 = 1000;
/// Entries an open directory holds before it lets go of those the kernel has passed: a
/// listing of millions of names, or a seek far ahead, holds a few pages, not the folder.
const KEPT_ENTRIES: usize = 4 * DIR_PAGE as usize;

/// An open directory: its entries fetched so far, page by page as `readdir` gets to them
/// (a directory of millions of names shows its first entries at once and never needs all
/// of them in memory before the first reply).
pub(super) struct DirHandle {
    /// ".", ".." and the entries listed so far, in order, from offset `base` (offset
    /// `base + i + 1` follows entry i); those before the kernel's position go once more
    /// than [`KEPT_ENTRIES`] are held.
    entries: Vec<Entry>,
    /// The offset of `entries[0]`.
    base: u64,
    /// The statuses of "." and "..", for a listing started again.
    dots: [Arc<pb::FileStatus>; 2],
    /// Where the next page starts ("" once every page is fetched).
    pub(super) next: String,
    pub(super) done: bool,
    /// The next page, asked for as soon as this one came: the master lists it while the
    /// kernel takes the entries already here (a `find` waited for each page in turn).
    pub(super) ahead: Option<Ahead>,
    /// Told the order of the folders in each page.
    walk: Arc<DirWalk>,
}

type Page = Result<(Vec<Arc<pb::FileStatus>>, String), granary_client::ClientError>;

/// An entry of an open directory: "." or "..", or a listed status (shared with the
/// client's metadata cache, named by its own name).
pub(super) struct Entry {
    dots: Option<&'static str>,
    pub(super) status: Arc<pb::FileStatus>,
}

impl Entry {
    pub(super) fn name(&self) -> &str {
        self.dots.unwrap_or(&self.status.name)
    }
}

/// A page being fetched ahead; stopped when the directory is closed first.
pub(super) struct Ahead(tokio::task::JoinHandle<Page>);

impl Drop for Ahead {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(super) type Dirs = Arc<Mutex<DirTable>>;

/// Open directories at most, all users together (past it: `ENFILE`), and per uid (past
/// it: `EMFILE`). Each holds up to a few pages of entries outside `--max-memory`: a local
/// user opening a big folder again and again held the daemon's memory until it ran out.
pub(super) const MAX_DIRS: usize = 4096;
pub(super) const MAX_DIRS_PER_UID: usize = 1024;

/// The open directories by handle, and how many each uid holds.
#[derive(Default)]
pub(super) struct DirTable {
    open: HashMap<u64, Arc<tokio::sync::Mutex<DirHandle>>>,
    /// Every handle with its place taken (opened or being opened), and whose it is.
    places: HashMap<u64, u32>,
    by_uid: HashMap<u32, usize>,
}

impl DirTable {
    /// Takes a place for handle `fh` of `uid`, before its directory is listed.
    pub(super) fn take(&mut self, fh: u64, uid: u32) -> Result<(), Errno> {
        if self.places.len() >= MAX_DIRS {
            return Err(Errno::ENFILE);
        }
        let held = self.by_uid.entry(uid).or_default();
        if *held >= MAX_DIRS_PER_UID {
            return Err(Errno::EMFILE);
        }
        *held += 1;
        self.places.insert(fh, uid);
        Ok(())
    }

    pub(super) fn insert(&mut self, fh: u64, h: Arc<tokio::sync::Mutex<DirHandle>>) {
        self.open.insert(fh, h);
    }

    pub(super) fn get(&self, fh: &u64) -> Option<&Arc<tokio::sync::Mutex<DirHandle>>> {
        self.open.get(fh)
    }

    /// A handle an earlier daemon gave, opened again (its place counted, never refused:
    /// the earlier daemon's own places bounded them).
    pub(super) fn get_or_insert(
        &mut self,
        fh: u64,
        h: Arc<tokio::sync::Mutex<DirHandle>>,
    ) -> Arc<tokio::sync::Mutex<DirHandle>> {
        if let std::collections::hash_map::Entry::Vacant(place) = self.places.entry(fh) {
            place.insert(u32::MAX);
            *self.by_uid.entry(u32::MAX).or_default() += 1;
        }
        self.open.entry(fh).or_insert(h).clone()
    }

    /// Closes `fh` (or gives back the place of an open that failed).
    pub(super) fn remove(&mut self, fh: &u64) {
        self.open.remove(fh);
        if let Some(uid) = self.places.remove(fh) {
            if let Some(held) = self.by_uid.get_mut(&uid) {
                *held -= 1;
                if *held == 0 {
                    self.by_uid.remove(&uid);
                }
            }
        }
    }
}

/// Folders remembered by [`DirWalk`] (everything is forgotten past this many).
const WALK_FOLDERS: usize = 100_000;
/// Folders opened lately that [`DirWalk`] looks back on.
const WALK_RECENT: usize = 16;
/// Folders a walk in order has asked for ahead of the one it opens.
const WALK_DEPTH: usize = 2;
/// First pages held ahead at most (for walks going on at once; the oldest goes first).
const WALK_AHEAD: usize = 8;

/// Folders opened one after another in their parent's order — `find`, `du`, `ls -R`, a
/// training script listing every class folder of its dataset: once a folder opened is the
/// one after a folder opened just before, the first pages of the two folders after it are
/// asked for at once, and the master lists them while the kernel takes this one's entries
/// (a `find` otherwise waits for each folder's first page in turn).
///
/// A page fetched ahead is used only within the mount's attribute timeout and while the
/// namespace watch announced no change of its folder since it was asked for: no older
/// than the statuses and names the mount answers from its cache.
#[derive(Default)]
pub(super) struct DirWalk(Mutex<WalkState>);

#[derive(Default)]
struct WalkState {
    /// Each listed folder's next folder in its parent's listing.
    next: HashMap<u64, u64>,
    /// Folders opened lately, newest last.
    recent: VecDeque<u64>,
    /// First pages asked for ahead, oldest first: folder, when, and as the watch saw it.
    ahead: VecDeque<(u64, std::time::Instant, Since, Ahead)>,
}

impl DirWalk {
    /// Notes the order of the folders in a listing page.
    pub(super) fn listed(&self, entries: &[Arc<pb::FileStatus>]) {
        let dir = pb::FileKind::Directory as i32;
        let mut folders = entries.iter().filter(|e| e.kind == dir).map(|e| e.inode);
        let Some(mut prev) = folders.next() else {
            return;
        };
        let mut s = lock(&self.0);
        for f in folders {
            if s.next.len() >= WALK_FOLDERS {
                s.next.clear();
            }
            s.next.insert(prev, f);
            prev = f;
        }
    }

    /// Folder `dir` is being opened: its first page when it was asked for ahead (and may
    /// still be used), and the next folder's first page asked for when the walk goes in
    /// order.
    pub(super) fn opened(&self, client: &Arc<FileSystem>, dir: u64) -> Option<Ahead> {
        let ttl = std::time::Duration::from_millis(client.meta.ttl());
        let mut s = lock(&self.0);
        let taken = match s.ahead.iter().position(|a| a.0 == dir) {
            Some(i) => s.ahead.remove(i).and_then(|(_, at, since, page)| {
                let fresh = at.elapsed() < ttl && client.meta.watch.unchanged_since(dir, since);
                if fresh {
                    client.metrics.fuse_dir_pages_ahead_used.inc();
                }
                fresh.then_some(page)
            }),
            None => None,
        };
        let in_order = s.recent.iter().any(|r| s.next.get(r) == Some(&dir));
        if s.recent.len() >= WALK_RECENT {
            s.recent.pop_front();
        }
        s.recent.push_back(dir);
        if !in_order || ttl.is_zero() {
            return taken;
        }
        let mut cur = dir;
        for _ in 0..WALK_DEPTH {
            let Some(next) = s.next.get(&cur).copied() else {
                break;
            };
            cur = next;
            if s.ahead.iter().any(|a| a.0 == next) {
                continue;
            }
            let since = client.meta.watch.since();
            client.metrics.fuse_dir_pages_ahead.inc();
            let c = client.clone();
            let page = Ahead(tokio::spawn(async move {
                c.list_page(pb::path_or_id::Target::Inode(next), "", DIR_PAGE)
                    .await
            }));
            if s.ahead.len() >= WALK_AHEAD {
                s.ahead.pop_front();
            }
            s.ahead
                .push_back((next, std::time::Instant::now(), since, page));
        }
        taken
    }
}

impl DirHandle {
    /// A listing of `dir` with "." and ".." and no page fetched yet.
    pub(super) fn new(dir: pb::FileStatus, walk: Arc<DirWalk>) -> Self {
        let parent = pb::FileStatus {
            inode: dir.parent.max(1),
            kind: pb::FileKind::Directory as i32,
            ..Default::default()
        };
        let dots = [Arc::new(dir), Arc::new(parent)];
        DirHandle {
            entries: Self::dot_entries(&dots),
            base: 0,
            dots,
            next: String::new(),
            done: false,
            ahead: None,
            walk,
        }
    }

    /// Fetches the next page of the listing.
    pub(super) async fn fetch_page(
        &mut self,
        client: &Arc<FileSystem>,
        dir: u64,
    ) -> Result<(), granary_client::ClientError> {
        if self.done {
            return Ok(());
        }
        let page = match self.ahead.take() {
            Some(mut ahead) => (&mut ahead.0).await.unwrap_or_else(|e| {
                Err(granary_client::ClientError::internal(format!(
                    "fetching a listing page ahead: {e}"
                )))
            }),
            None => {
                client
                    .list_page(pb::path_or_id::Target::Inode(dir), &self.next, DIR_PAGE)
                    .await
            }
        };
        let (entries, next) = page?;
        self.walk.listed(&entries);
        self.entries.extend(
            entries
                .into_iter()
                .map(|status| Entry { dots: None, status }),
        );
        self.done = next.is_empty();
        self.next = next;
        if !self.done {
            let (client, after) = (client.clone(), self.next.clone());
            self.ahead = Some(Ahead(tokio::spawn(async move {
                client
                    .list_page(pb::path_or_id::Target::Inode(dir), &after, DIR_PAGE)
                    .await
            })));
        }
        Ok(())
    }

    fn dot_entries(dots: &[Arc<pb::FileStatus>; 2]) -> Vec<Entry> {
        vec![
            Entry {
                dots: Some("."),
                status: dots[0].clone(),
            },
            Entry {
                dots: Some(".."),
                status: dots[1].clone(),
            },
        ]
    }

    /// Fetches pages until entry `offset` is known (or the listing ends). An offset before
    /// the entries held (a program gone back with `seekdir` or `rewinddir`) lists the
    /// folder again from its start.
    pub(super) async fn fetch_past(
        &mut self,
        client: &Arc<FileSystem>,
        dir: u64,
        offset: u64,
    ) -> Result<(), granary_client::ClientError> {
        if offset < self.base {
            self.entries = Self::dot_entries(&self.dots);
            self.base = 0;
            self.next.clear();
            self.done = false;
            self.ahead = None;
        }
        while !self.done && self.base + self.entries.len() as u64 <= offset {
            self.fetch_page(client, dir).await?;
            if self.entries.len() > KEPT_ENTRIES {
                // Entries before the kernel's position are not asked for again (but
                // after a seek back, which starts over).
                let passed = (offset - self.base).min(self.entries.len() as u64);
                self.entries.drain(..passed as usize);
                self.base += passed;
            }
        }
        Ok(())
    }

    /// The entries from `offset` on (after [`fetch_past`](Self::fetch_past) of it), each
    /// with the offset that follows it.
    pub(super) fn from(&self, offset: u64) -> impl Iterator<Item = (u64, &Entry)> {
        let skip = offset.saturating_sub(self.base) as usize;
        let base = self.base;
        self.entries
            .iter()
            .enumerate()
            .skip(skip)
            .map(move |(i, e)| (base + i as u64 + 1, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One uid opens at most `MAX_DIRS_PER_UID` directories (`EMFILE` past it, others
    /// still open theirs), all users together `MAX_DIRS` (`ENFILE`); a closed one, or an
    /// open that failed, gives its place back; handles an earlier daemon gave are counted.
    #[test]
    fn open_directories_are_capped_per_uid_and_in_all() {
        let mut t = DirTable::default();
        for fh in 0..MAX_DIRS_PER_UID as u64 {
            t.take(fh, 1000).unwrap();
        }
        assert_eq!(t.take(1 << 40, 1000), Err(Errno::EMFILE));
        t.take(1 << 41, 1001).unwrap();
        t.remove(&0);
        t.take(1 << 40, 1000).unwrap();
        assert_eq!(t.take(1 << 39, 1000), Err(Errno::EMFILE));
        // Other users fill what is left.
        let mut fh = 1 << 42;
        while t.places.len() < MAX_DIRS {
            t.take(fh, 2000 + (fh % 4) as u32).unwrap();
            fh += 1;
        }
        assert_eq!(t.take(fh, 3000), Err(Errno::ENFILE));
        // A handle of an earlier daemon is taken in anyway, and counted.
        let walk = Arc::new(DirWalk::default());
        let h = DirHandle::new(pb::FileStatus::default(), walk);
        let h = Arc::new(tokio::sync::Mutex::new(h));
        t.get_or_insert(7 << 50, h);
        assert_eq!(t.places.len(), MAX_DIRS + 1);
        t.remove(&(7 << 50));
        t.remove(&(1 << 41));
        t.take(fh, 3000).unwrap();
    }
}
