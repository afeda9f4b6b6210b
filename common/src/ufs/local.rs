//! A `file://` under-store that stays inside its root folder.
//!
//! `object_store`'s `LocalFileSystem` follows symbolic links wherever they point: a link in
//! a mounted folder to `/etc/granary/tls/tls.key` would be read by the worker (often root)
//! and served to any reader of the mount, and a recursive delete would walk into linked
//! folders. [`ConfinedLocal`] wraps it and checks every path first, component by component
//! from the (canonical) root:
//!
//! - `symlinks=none` (the default): no symbolic link is followed. A link is not listed, a
//!   read or a lookup of it finds nothing (`NotFound`), a path through a linked folder is
//!   refused.
//! - `symlinks=inside`: links whose target (fully resolved) stays inside the root are
//!   followed for reads and listings; links leaving it are treated as with `none`.
//!   Recursive listings (and so recursive deletes) never descend into a linked folder.
//!
//! Reads are checked twice: the path is walked before the file is opened, and the file that
//! was opened must be the very file (device and inode) the walk ended on, so swapping a
//! folder for a link between the check and the open gets `NotFound`, never the link's
//! target. Writes, deletes and renames check the folders above their target (the target
//! itself may be a link: replacing or deleting a link changes only the link).
//! Not covered: hard links (a hard link inside the root to a file outside it is that file).

use std::collections::VecDeque;
use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::{self, BoxStream, StreamExt, TryStreamExt};
use object_store::local::LocalFileSystem;
use object_store::path::Path as StorePath;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result,
};

const STORE: &str = "LocalFileSystem";

/// Which symbolic links a `file://` mount follows (the `symlinks` mount option).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Symlinks {
    /// None: links are not listed, and reading one finds nothing.
    #[default]
    None,
    /// Those whose resolved target stays inside the mount's root.
    Inside,
}

impl Symlinks {
    pub fn parse(v: &str) -> Option<Symlinks> {
        match v.trim().to_ascii_lowercase().as_str() {
            "none" => Some(Symlinks::None),
            "inside" => Some(Symlinks::Inside),
            _ => None,
        }
    }
}

/// What the last component of a checked path may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Last {
    /// The object itself (read, listed, copied from): a link there is followed only when
    /// the policy allows it.
    Object,
    /// An entry to replace or remove: it may be a link (only the link changes); the
    /// folders above it are checked.
    Entry,
}

/// Why a path was refused.
#[derive(Debug)]
struct Refused {
    path: PathBuf,
    why: String,
    /// An I/O error (not a refusal by the policy): nothing can be said of what is there.
    failed: bool,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.path.display(), self.why)
    }
}

impl std::error::Error for Refused {}

#[derive(Debug)]
struct Root {
    /// Canonical (no links, absolute).
    dir: PathBuf,
    links: Symlinks,
}

impl Root {
    /// The file-system path of a store location (as `LocalFileSystem` maps it: one folder
    /// per path part, names as they are).
    fn fs_path(&self, loc: &StorePath) -> std::result::Result<PathBuf, Refused> {
        let mut p = self.dir.clone();
        for part in loc.parts() {
            let s = part.as_ref();
            if s.is_empty() || s == "." || s == ".." || s.contains('/') || s.contains('\0') {
                return Err(Refused {
                    failed: false,
                    path: p.join(s),
                    why: "is not a plain name".into(),
                });
            }
            p.push(s);
        }
        Ok(p)
    }

    /// Walks `path` from the root without following links the policy refuses. `Ok(None)`:
    /// some component does not exist (or is a dangling link). Otherwise the metadata of
    /// what the path names (of the link's target for a followed link; of the link itself
    /// for an [`Last::Entry`] that is a link).
    fn check(&self, path: &Path, last: Last) -> std::result::Result<Option<Metadata>, Refused> {
        let md = self.check_links(path, last)?;
        // A FIFO, socket or device is no object: opening a FIFO blocks for good (a local
        // user's `mkfifo` and a few lookups would hold the master's blocking threads).
        match &md {
            Some(m) if last == Last::Object && !m.is_file() && !m.is_dir() => Err(Refused {
                failed: false,
                path: path.to_path_buf(),
                why: "is not a regular file or a folder".into(),
            }),
            _ => Ok(md),
        }
    }

    fn check_links(
        &self,
        path: &Path,
        last: Last,
    ) -> std::result::Result<Option<Metadata>, Refused> {
        // Only an error that may clear up says nothing of what is there; any other is
        // the path's answer (refused, as before: a folder of it lists empty).
        let io = |p: &Path, e: std::io::Error| Refused {
            failed: passing(&e),
            path: p.to_path_buf(),
            why: format!("cannot be checked: {e}"),
        };
        let rel = path.strip_prefix(&self.dir).map_err(|_| Refused {
            failed: false,
            path: path.to_path_buf(),
            why: "is outside the mount's root".into(),
        })?;
        let parts: Vec<_> = rel.components().collect();
        let mut cur = self.dir.clone();
        for (i, c) in parts.iter().enumerate() {
            let std::path::Component::Normal(name) = c else {
                return Err(Refused {
                    failed: false,
                    path: path.to_path_buf(),
                    why: "is not a plain path".into(),
                });
            };
            cur.push(name);
            let is_last = i + 1 == parts.len();
            let md = match std::fs::symlink_metadata(&cur) {
                Ok(m) => m,
                Err(e) if absent(&e) => return Ok(None),
                Err(e) => return Err(io(&cur, e)),
            };
            if !md.file_type().is_symlink() {
                if is_last {
                    return Ok(Some(md));
                }
                continue;
            }
            if is_last && last == Last::Entry {
                return Ok(Some(md));
            }
            if self.links == Symlinks::None {
                return Err(Refused {
                    failed: false,
                    path: cur,
                    why: "is a symbolic link, and this mount follows none (the mount option symlinks=inside follows links that stay inside its root)".into(),
                });
            }
            let target = match std::fs::canonicalize(&cur) {
                Ok(t) => t,
                Err(e) if absent(&e) => return Ok(None),
                Err(e) => return Err(io(&cur, e)),
            };
            if !target.starts_with(&self.dir) {
                return Err(Refused {
                    failed: false,
                    path: cur,
                    why: "is a symbolic link leaving the mount's root".into(),
                });
            }
            cur = target;
            if is_last {
                break;
            }
        }
        match std::fs::metadata(&cur) {
            Ok(md) => Ok(Some(md)),
            Err(e) if absent(&e) => Ok(None),
            Err(e) => Err(io(&cur, e)),
        }
    }

    /// Is the entry at `path` (whose folder was checked) one the policy lets through?
    fn entry_ok(&self, path: &Path) -> bool {
        match std::fs::symlink_metadata(path) {
            Ok(md) if md.file_type().is_symlink() => {
                self.links == Symlinks::Inside
                    && std::fs::canonicalize(path).is_ok_and(|t| t.starts_with(&self.dir))
            }
            Ok(md) => md.is_file() || md.is_dir(),
            // Gone meanwhile: the listing's own answer stands.
            Err(_) => true,
        }
    }
}

fn not_found(loc: &StorePath, e: Refused) -> object_store::Error {
    object_store::Error::NotFound {
        path: loc.to_string(),
        source: Box::new(e),
    }
}

fn denied(loc: &StorePath, e: Refused) -> object_store::Error {
    object_store::Error::PermissionDenied {
        path: loc.to_string(),
        source: Box::new(e),
    }
}

fn join_error(e: tokio::task::JoinError) -> object_store::Error {
    object_store::Error::Generic {
        store: STORE,
        source: Box::new(e),
    }
}

/// Runs `f` on a blocking thread (inline outside a Tokio runtime).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, object_store::Error> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Ok(f());
    }
    tokio::task::spawn_blocking(f).await.map_err(join_error)
}

/// A local folder as an object store that stays inside that folder (see the module docs).
#[derive(Debug, Clone)]
pub struct ConfinedLocal {
    inner: Arc<LocalFileSystem>,
    root: Arc<Root>,
}

impl std::fmt::Display for ConfinedLocal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConfinedLocal({})", self.root.dir.display())
    }
}

impl ConfinedLocal {
    /// The folder `dir` (which must exist) as a store following `links`.
    pub fn new(dir: &Path, links: Symlinks) -> Result<ConfinedLocal> {
        let canonical = std::fs::canonicalize(dir).map_err(|e| object_store::Error::NotFound {
            path: dir.display().to_string(),
            source: Box::new(e),
        })?;
        let inner = LocalFileSystem::new_with_prefix(&canonical)?;
        Ok(ConfinedLocal {
            inner: Arc::new(inner),
            root: Arc::new(Root {
                dir: canonical,
                links,
            }),
        })
    }

    /// The checked file-system path of `rel` (a `/`-separated path below the root): an
    /// error when a folder on the way (or, unless `entry`, the path itself) is a link the
    /// policy refuses. For code that works on the folder directly (renames, removals of
    /// whole folders).
    pub fn checked_path(&self, rel: &str, entry: bool) -> std::io::Result<PathBuf> {
        let mut p = self.root.dir.clone();
        for s in rel.split('/').filter(|s| !s.is_empty()) {
            if s == "." || s == ".." {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{rel} is not a plain path"),
                ));
            }
            p.push(s);
        }
        let last = if entry { Last::Entry } else { Last::Object };
        self.root
            .check(&p, last)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, e))?;
        Ok(p)
    }

    /// Opens the object at `loc` for reading, in the calling thread (it blocks): the checks
    /// of a GET (links only as the policy allows, a regular file, and the file opened is
    /// the one checked), and the object's metadata as a GET reports it. For callers
    /// already on a blocking thread (the worker's cold reads of a folder store), which
    /// would otherwise hand a thread each check, open and read.
    pub fn open_blocking(&self, loc: &StorePath) -> Result<(std::fs::File, ObjectMeta)> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.root.fs_path(loc).map_err(|e| not_found(loc, e))?;
        let gone = |why: &str| object_store::Error::NotFound {
            path: loc.to_string(),
            source: why.to_string().into(),
        };
        let Some(md) = self.root.check(&path, Last::Object).map_err(|e| {
            if e.failed {
                refused_error(e)
            } else {
                not_found(loc, e)
            }
        })?
        else {
            return Err(gone("no such file"));
        };
        if !md.is_file() {
            return Err(gone("is not a file"));
        }
        // Non-blocking: a FIFO swapped in after the check must not hold this thread (for a
        // regular file the flag changes nothing).
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => gone("no such file"),
                _ => object_store::Error::Generic {
                    store: STORE,
                    source: Box::new(e),
                },
            })?;
        let opened = file.metadata().map_err(|e| object_store::Error::Generic {
            store: STORE,
            source: Box::new(e),
        })?;
        if opened.dev() != md.dev() || opened.ino() != md.ino() || !opened.is_file() {
            return Err(gone(
                "the file changed while it was opened (a folder on its path was replaced)",
            ));
        }
        Ok((file, object_meta(loc.clone(), &opened)))
    }

    async fn check(&self, loc: &StorePath, last: Last) -> Result<Option<Metadata>> {
        let root = self.root.clone();
        let path = root.fs_path(loc).map_err(|e| not_found(loc, e))?;
        let loc2 = loc.clone();
        blocking(move || {
            root.check(&path, last).map_err(|e| match last {
                // An I/O error is no answer: not "not found" (a master would drop the
                // file) and not a refusal.
                _ if e.failed => refused_error(e),
                Last::Object => not_found(&loc2, e),
                Last::Entry => denied(&loc2, e),
            })
        })
        .await?
    }

    /// One level of `prefix`, without what the policy hides. Read here rather than by
    /// `LocalFileSystem`, whose listing stats every entry three times (its walk follows
    /// links, then checks for broken ones, then reads the metadata) and turns each path
    /// into a URL and back; a re-listing of a folder under a `find` spent a third of the
    /// process's CPU there. Here: a directory entry's own type, and one `lstat` per file.
    /// The same entries and metadata as `LocalFileSystem` where no link is involved.
    async fn list_level(&self, prefix: Option<&StorePath>) -> Result<ListResult> {
        let top = prefix.cloned().unwrap_or_default();
        let dir = match self.root.fs_path(&top) {
            Ok(d) => d,
            Err(_) => return Ok(empty_listing()),
        };
        let root = self.root.clone();
        blocking(move || root.list_folder(&dir, &top)).await?
    }
}

impl Root {
    /// One folder's entries (blocking): see [`ConfinedLocal::list_level`].
    fn list_folder(&self, dir: &Path, top: &StorePath) -> Result<ListResult> {
        match self.check(dir, Last::Object) {
            Ok(Some(md)) if md.is_dir() => {}
            // An I/O error says nothing of what is there: the listing fails, and what the
            // master knows of the folder stays (an empty answer would remove it all).
            Err(e) if e.failed => return Err(refused_error(e)),
            // Missing, a file, or behind a refused link: nothing to list.
            _ => return Ok(empty_listing()),
        }
        let entries = match std::fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(empty_listing()),
            Err(e) => return Err(walk_error(dir, e)),
        };
        let mut listing = empty_listing();
        for entry in entries {
            let entry = entry.map_err(|e| walk_error(dir, e))?;
            // Names that are not UTF-8 have no store path (as in the recursive walk).
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            let Some(what) = self.entry_of(&entry).map_err(|e| walk_error(dir, e))? else {
                continue;
            };
            // As `LocalFileSystem` names it: the name as it is, not percent-encoded. One
            // that is no valid store path is left out (as in the recursive walk).
            let location = if top.as_ref().is_empty() {
                StorePath::parse(&name)
            } else {
                StorePath::parse(format!("{top}/{name}"))
            };
            let Ok(location) = location else {
                continue;
            };
            match what {
                Entry::Folder { .. } => listing.common_prefixes.push(location),
                Entry::Object { md, .. } if !staging_name(&name) => {
                    listing.objects.push(object_meta(location, &md))
                }
                Entry::Object { .. } => {}
            }
        }
        listing.common_prefixes.sort();
        Ok(listing)
    }

    /// What a folder's entry is to a listing, as the policy lets it through (blocking):
    /// `None` for a link the policy does not follow or that dangles (or loops), for what
    /// is neither a file nor a folder, and for an entry gone or replaced since the folder
    /// was read (a file swapped for a link is never described by the link's own
    /// metadata). An error reading an entry of its own (EIO, a stale handle) fails the
    /// listing: leaving the entry out would remove the file from the namespace.
    fn entry_of(&self, entry: &std::fs::DirEntry) -> std::io::Result<Option<Entry>> {
        let Some(ft) = present(entry.file_type())? else {
            return Ok(None);
        };
        if ft.is_symlink() {
            let path = entry.path();
            if !self.entry_ok(&path) {
                return Ok(None);
            }
            let Ok(md) = std::fs::metadata(&path) else {
                return Ok(None);
            };
            return Ok(if md.is_dir() {
                Some(Entry::Folder { linked: true })
            } else {
                md.is_file().then_some(Entry::Object { md, linked: true })
            });
        }
        if ft.is_dir() {
            return Ok(Some(Entry::Folder { linked: false }));
        }
        if !ft.is_file() {
            return Ok(None);
        }
        let md = present(entry.metadata())?.filter(Metadata::is_file);
        Ok(md.map(|md| Entry::Object { md, linked: false }))
    }
}

/// A folder entry a listing may show (see [`Root::entry_of`]); `linked`: reached through
/// a symbolic link the policy follows.
enum Entry {
    Folder { linked: bool },
    Object { md: Metadata, linked: bool },
}

/// Is the file `got` holds open the one whose metadata the walk returned (same device and
/// inode)?
fn opened_what_was_checked(md: &Metadata, got: &GetResult) -> bool {
    match &got.payload {
        GetResultPayload::File(file, _) => file
            .metadata()
            .is_ok_and(|f| f.dev() == md.dev() && f.ino() == md.ino()),
        GetResultPayload::Stream(_) => false,
    }
}

/// The state of a recursive listing ([`ConfinedLocal::list`]).
struct Walk {
    root: Arc<Root>,
    top: StorePath,
    started: bool,
    /// Folders still to read: file-system path and store prefix.
    dirs: VecDeque<(PathBuf, String)>,
    current: Option<(std::fs::ReadDir, String)>,
    ready: VecDeque<ObjectMeta>,
}

impl Walk {
    /// Reads up to `n` more entries (blocking).
    fn step(&mut self, n: usize) -> Result<()> {
        if !self.started {
            self.started = true;
            let Ok(top) = self.root.fs_path(&self.top) else {
                return Ok(());
            };
            // Missing, a file, or behind a refused link: nothing below it. An I/O error
            // fails the listing.
            match self.root.check(&top, Last::Object) {
                Ok(Some(md)) if md.is_dir() => {
                    self.dirs.push_back((top, self.top.as_ref().to_string()));
                }
                Err(e) if e.failed => return Err(refused_error(e)),
                _ => {}
            }
        }
        let mut budget = n;
        while budget > 0 {
            let Some((dir, prefix)) = &mut self.current else {
                let Some((path, prefix)) = self.dirs.pop_front() else {
                    return Ok(());
                };
                match std::fs::read_dir(&path) {
                    Ok(rd) => self.current = Some((rd, prefix)),
                    // One folder below that can never be read (gone, EACCES) is left out,
                    // as an entry is; one that may clear up fails the walk.
                    Err(e) if passing(&e) => return Err(walk_error(&path, e)),
                    Err(_) => {}
                }
                continue;
            };
            budget -= 1;
            let entry = match dir.next() {
                None => {
                    self.current = None;
                    continue;
                }
                Some(Err(e)) => {
                    return Err(walk_error(Path::new(prefix.as_str()), e));
                }
                Some(Ok(e)) => e,
            };
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let loc = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            let what = self
                .root
                .entry_of(&entry)
                .map_err(|e| walk_error(&entry.path(), e))?;
            let md = match what {
                Some(Entry::Folder { linked: false }) => {
                    self.dirs.push_back((entry.path(), loc));
                    continue;
                }
                // Linked folders are not entered.
                Some(Entry::Folder { linked: true }) | None => continue,
                Some(Entry::Object { md, linked: true }) => md,
                Some(Entry::Object { md, linked: false }) if !staging_name(&name) => md,
                Some(Entry::Object { .. }) => continue,
            };
            let Ok(location) = StorePath::parse(&loc) else {
                continue;
            };
            self.ready.push_back(object_meta(location, &md));
        }
        Ok(())
    }
}

/// Nothing is there: no such entry, a file where a folder was expected (ENOTDIR), a link
/// that loops.
fn absent(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
        || matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP))
}

/// An error that may clear up (a disk's or a network file system's: EIO, a stale NFS
/// handle, a timeout, a FUSE mount whose daemon is gone): it says nothing of what is
/// there, so a listing that meets it fails rather than leaving the entry out.
fn passing(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EIO
                | libc::ESTALE
                | libc::ETIMEDOUT
                | libc::ENOMEM
                | libc::EAGAIN
                | libc::EINTR
                | libc::ENOTCONN
                | libc::ENOBUFS
                | libc::EHOSTDOWN
                | libc::EHOSTUNREACH
                | libc::ECONNRESET
                | libc::ECONNABORTED
        )
    )
}

/// An entry's metadata: `Ok(None)` for one not there (gone since its folder was read) or
/// unreadable for good (EACCES, ELOOP, ENAMETOOLONG: left out, as the listing always did,
/// so that one such entry cannot keep its folder from being listed); `Err` only for an
/// error that may clear up ([`passing`]).
fn present<T>(r: std::io::Result<T>) -> std::io::Result<Option<T>> {
    match r {
        Ok(t) => Ok(Some(t)),
        Err(e) if passing(&e) => Err(e),
        Err(_) => Ok(None),
    }
}

/// A listing that cannot say what is at `e.path` (an I/O error checking it).
fn refused_error(e: Refused) -> object_store::Error {
    object_store::Error::Generic {
        store: STORE,
        source: Box::new(e),
    }
}

fn walk_error(path: &Path, e: std::io::Error) -> object_store::Error {
    object_store::Error::Generic {
        store: STORE,
        source: format!("listing {}: {e}", path.display()).into(),
    }
}

/// `LocalFileSystem`'s in-progress upload files (`name#123`), never listed.
fn staging_name(name: &str) -> bool {
    match name.split_once('#') {
        Some((_, suffix)) => !suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// An object's metadata as `LocalFileSystem` reports it (the same ETag scheme, so a listing
/// and a HEAD of one file agree).
fn object_meta(location: StorePath, md: &Metadata) -> ObjectMeta {
    let modified = md.modified().unwrap_or(std::time::SystemTime::UNIX_EPOCH);
    let mtime = modified
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros();
    ObjectMeta {
        location,
        last_modified: modified.into(),
        size: md.len(),
        e_tag: Some(format!("\"{:x}-{mtime:x}-{:x}\"", md.ino(), md.len())),
        version: None,
    }
}

fn empty_listing() -> ListResult {
    ListResult {
        common_prefixes: Vec::new(),
        objects: Vec::new(),
        extensions: Default::default(),
    }
}

impl ObjectStore for ConfinedLocal {
    fn put_opts<'a, 'b, 'c>(
        &'a self,
        location: &'b StorePath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> BoxFuture<'c, Result<PutResult>>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        Box::pin(async move {
            self.check(location, Last::Entry).await?;
            self.inner.put_opts(location, payload, opts).await
        })
    }

    fn put_multipart_opts<'a, 'b, 'c>(
        &'a self,
        location: &'b StorePath,
        opts: PutMultipartOptions,
    ) -> BoxFuture<'c, Result<Box<dyn MultipartUpload>>>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        Box::pin(async move {
            self.check(location, Last::Entry).await?;
            self.inner.put_multipart_opts(location, opts).await
        })
    }

    fn get_opts<'a, 'b, 'c>(
        &'a self,
        location: &'b StorePath,
        options: GetOptions,
    ) -> BoxFuture<'c, Result<GetResult>>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        Box::pin(async move {
            let Some(md) = self.check(location, Last::Object).await? else {
                return Err(object_store::Error::NotFound {
                    path: location.to_string(),
                    source: "no such file".into(),
                });
            };
            let got = self.inner.get_opts(location, options).await?;
            // The file opened must be the one the walk ended on (not a link swapped in).
            if !opened_what_was_checked(&md, &got) {
                return Err(object_store::Error::NotFound {
                    path: location.to_string(),
                    source:
                        "the file changed while it was opened (a folder on its path was replaced)"
                            .into(),
                });
            }
            Ok(got)
        })
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<StorePath>>,
    ) -> BoxStream<'static, Result<StorePath>> {
        let me = self.clone();
        let checked = locations
            .and_then(move |loc| {
                let me = me.clone();
                async move {
                    me.check(&loc, Last::Entry).await?;
                    Ok(loc)
                }
            })
            .boxed();
        self.inner.delete_stream(checked)
    }

    fn list(&self, prefix: Option<&StorePath>) -> BoxStream<'static, Result<ObjectMeta>> {
        // A walk of its own, folder by folder and lazily (the first object comes without
        // reading a whole folder), that never enters a linked folder: the inner store's
        // walk follows every link wherever it goes.
        let walk = Walk {
            root: self.root.clone(),
            top: prefix.cloned().unwrap_or_default(),
            started: false,
            dirs: VecDeque::new(),
            current: None,
            ready: VecDeque::new(),
        };
        stream::try_unfold(walk, |mut w| async move {
            loop {
                if let Some(o) = w.ready.pop_front() {
                    return Ok(Some((o, w)));
                }
                if w.started && w.current.is_none() && w.dirs.is_empty() {
                    return Ok(None);
                }
                w = blocking(move || {
                    let r = w.step(1024);
                    r.map(|()| w)
                })
                .await??;
            }
        })
        .boxed()
    }

    fn list_with_delimiter<'a, 'b, 'c>(
        &'a self,
        prefix: Option<&'b StorePath>,
    ) -> BoxFuture<'c, Result<ListResult>>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        Box::pin(self.list_level(prefix))
    }

    fn copy_opts<'a, 'b, 'c, 'd>(
        &'a self,
        from: &'b StorePath,
        to: &'c StorePath,
        options: CopyOptions,
    ) -> BoxFuture<'d, Result<()>>
    where
        'a: 'd,
        'b: 'd,
        'c: 'd,
        Self: 'd,
    {
        Box::pin(async move {
            if self.check(from, Last::Object).await?.is_none() {
                return Err(object_store::Error::NotFound {
                    path: from.to_string(),
                    source: "no such file".into(),
                });
            }
            self.check(to, Last::Entry).await?;
            self.inner.copy_opts(from, to, options).await
        })
    }

    fn rename_opts<'a, 'b, 'c, 'd>(
        &'a self,
        from: &'b StorePath,
        to: &'c StorePath,
        options: RenameOptions,
    ) -> BoxFuture<'d, Result<()>>
    where
        'a: 'd,
        'b: 'd,
        'c: 'd,
        Self: 'd,
    {
        Box::pin(async move {
            self.check(from, Last::Entry).await?;
            self.check(to, Last::Entry).await?;
            self.inner.rename_opts(from, to, options).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt as _;
    use std::os::unix::fs::symlink;

    struct Setup {
        _tmp: PathBuf,
        root: PathBuf,
        outside: PathBuf,
    }

    impl Drop for Setup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self._tmp);
        }
    }

    /// root/{a.txt, sub/b.txt, in-link → a.txt, dir-in → sub, out-link → ../outside/secret,
    /// dir-out → ../outside}, outside/secret.
    fn setup(name: &str) -> Setup {
        let tmp =
            std::env::temp_dir().join(format!("granary-confined-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let root = tmp.join("root");
        let outside = tmp.join("outside");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(root.join("a.txt"), b"inside-a").unwrap();
        std::fs::write(root.join("sub/b.txt"), b"inside-b").unwrap();
        std::fs::write(outside.join("secret"), b"TOP-SECRET-BYTES").unwrap();
        symlink(root.join("a.txt"), root.join("in-link")).unwrap();
        symlink("sub", root.join("dir-in")).unwrap();
        symlink(outside.join("secret"), root.join("out-link")).unwrap();
        symlink("../outside", root.join("dir-out")).unwrap();
        Setup {
            _tmp: tmp,
            root,
            outside,
        }
    }

    async fn read(s: &ConfinedLocal, p: &str) -> Result<Vec<u8>> {
        Ok(s.get(&StorePath::from(p)).await?.bytes().await?.to_vec())
    }

    async fn names(s: &ConfinedLocal, prefix: Option<&str>) -> (Vec<String>, Vec<String>) {
        let p = prefix.map(StorePath::from);
        let l = s.list_with_delimiter(p.as_ref()).await.unwrap();
        let mut dirs: Vec<String> = l.common_prefixes.iter().map(|p| p.to_string()).collect();
        let mut files: Vec<String> = l.objects.iter().map(|o| o.location.to_string()).collect();
        dirs.sort();
        files.sort();
        (dirs, files)
    }

    async fn all(s: &ConfinedLocal, prefix: Option<&str>) -> Vec<String> {
        let p = prefix.map(StorePath::from);
        let mut v: Vec<String> = s
            .list(p.as_ref())
            .map_ok(|o| o.location.to_string())
            .try_collect()
            .await
            .unwrap();
        v.sort();
        v
    }

    /// A FIFO in the folder is neither listed nor opened (opening one blocks for good).
    #[tokio::test]
    async fn a_fifo_is_neither_listed_nor_opened() {
        let t = setup("fifo");
        let fifo = t.root.join("pipe");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        let s = ConfinedLocal::new(&t.root, Symlinks::Inside).unwrap();
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), read(&s, "pipe"))
            .await
            .expect("reading a FIFO blocked");
        assert!(
            matches!(got, Err(object_store::Error::NotFound { .. })),
            "{got:?}"
        );
        let head = s.head(&StorePath::from("pipe")).await;
        assert!(
            matches!(head, Err(object_store::Error::NotFound { .. })),
            "{head:?}"
        );
        let (_, files) = names(&s, None).await;
        assert!(!files.iter().any(|f| f == "pipe"), "{files:?}");
        assert!(!all(&s, None).await.iter().any(|f| f == "pipe"));
    }

    /// What is simply not there stays "not found" and never fails a listing: a path
    /// through a file (ENOTDIR), a link that loops, a name too long; the folder's other
    /// entries are listed.
    #[tokio::test]
    async fn what_is_not_there_is_not_found_and_lists_nothing() {
        let t = setup("absent");
        symlink("loop", t.root.join("loop")).unwrap();
        let s = ConfinedLocal::new(&t.root, Symlinks::Inside).unwrap();
        let long = "x".repeat(300);
        for p in ["a.txt/below", "loop", "loop/below", long.as_str()] {
            let head = s.head(&StorePath::from(p)).await;
            assert!(
                matches!(head, Err(object_store::Error::NotFound { .. })),
                "{p}: {head:?}"
            );
            let (dirs, files) = names(&s, Some(p)).await;
            assert!(
                dirs.is_empty() && files.is_empty(),
                "{p}: {dirs:?} {files:?}"
            );
        }
        assert_eq!(names(&s, None).await.1, vec!["a.txt", "in-link"]);
        assert_eq!(all(&s, None).await, vec!["a.txt", "in-link", "sub/b.txt"]);
    }

    /// Opening in place checks what a GET checks and reports the metadata a GET reports
    /// (so a version recorded from a listing or a HEAD matches).
    #[tokio::test]
    async fn an_open_in_place_checks_what_a_get_checks() {
        let t = setup("open-blocking");
        assert!(std::process::Command::new("mkfifo")
            .arg(t.root.join("pipe"))
            .status()
            .unwrap()
            .success());
        let inside = ConfinedLocal::new(&t.root, Symlinks::Inside).unwrap();
        let none = ConfinedLocal::new(&t.root, Symlinks::None).unwrap();
        let open = |s: &ConfinedLocal, p: &str| s.open_blocking(&StorePath::from(p));
        let (file, meta) = open(&none, "sub/b.txt").unwrap();
        let mut got = String::new();
        std::io::Read::read_to_string(&mut &file, &mut got).unwrap();
        assert_eq!(got, "inside-b");
        let head = none.head(&StorePath::from("sub/b.txt")).await.unwrap();
        assert_eq!(meta.e_tag, head.e_tag);
        assert_eq!(
            (meta.size, meta.last_modified),
            (head.size, head.last_modified)
        );
        // Links: none followed by default; inside ones when allowed; leaving ones never.
        for p in ["in-link", "dir-in/b.txt", "out-link", "dir-out/secret"] {
            let e = open(&none, p).unwrap_err();
            assert!(
                matches!(e, object_store::Error::NotFound { .. }),
                "{p}: {e:?}"
            );
        }
        assert!(open(&inside, "in-link").is_ok());
        assert!(open(&inside, "dir-in/b.txt").is_ok());
        for p in [
            "out-link",
            "dir-out/secret",
            "pipe",
            "sub",
            "missing",
            "../outside/secret",
        ] {
            let e = open(&inside, p).unwrap_err();
            assert!(
                matches!(e, object_store::Error::NotFound { .. }),
                "{p}: {e:?}"
            );
        }
        assert!(t.outside.join("secret").exists());
    }

    #[tokio::test]
    async fn no_link_is_followed_by_default() {
        let t = setup("none");
        let s = ConfinedLocal::new(&t.root, Symlinks::None).unwrap();
        assert_eq!(read(&s, "a.txt").await.unwrap(), b"inside-a");
        assert_eq!(read(&s, "sub/b.txt").await.unwrap(), b"inside-b");
        for p in ["out-link", "in-link", "dir-out/secret", "dir-in/b.txt"] {
            let e = read(&s, p).await.unwrap_err();
            assert!(
                matches!(e, object_store::Error::NotFound { .. }),
                "{p}: {e}"
            );
            assert!(!e.to_string().contains("TOP-SECRET"), "{e}");
            let e = s.head(&StorePath::from(p)).await.unwrap_err();
            assert!(matches!(e, object_store::Error::NotFound { .. }), "{p}");
        }
        assert_eq!(
            names(&s, None).await,
            (vec!["sub".to_string()], vec!["a.txt".to_string()])
        );
        assert_eq!(names(&s, Some("dir-out")).await, (vec![], vec![]));
        assert_eq!(all(&s, None).await, vec!["a.txt", "sub/b.txt"]);
        assert!(all(&s, Some("dir-out")).await.is_empty());
        // A write or a delete through a linked folder is refused; the target is untouched.
        let e = s
            .put(&StorePath::from("dir-out/new"), b"x".to_vec().into())
            .await
            .unwrap_err();
        assert!(
            matches!(e, object_store::Error::PermissionDenied { .. }),
            "{e}"
        );
        assert!(!t.outside.join("new").exists());
        let e = s
            .delete(&StorePath::from("dir-out/secret"))
            .await
            .unwrap_err();
        assert!(
            matches!(e, object_store::Error::PermissionDenied { .. }),
            "{e}"
        );
        assert!(t.outside.join("secret").exists());
        let e = s
            .copy(&StorePath::from("out-link"), &StorePath::from("copy"))
            .await
            .unwrap_err();
        assert!(matches!(e, object_store::Error::NotFound { .. }), "{e}");
        assert!(!t.root.join("copy").exists());
        // Deleting the link itself removes only the link.
        s.delete(&StorePath::from("out-link")).await.unwrap();
        assert!(!t.root.join("out-link").exists() && t.outside.join("secret").exists());
        assert!(s.checked_path("dir-out/x", true).is_err());
        assert_eq!(
            s.checked_path("sub/b.txt", false).unwrap(),
            t.root.join("sub/b.txt").canonicalize().unwrap()
        );
    }

    #[tokio::test]
    async fn a_recursive_listing_agrees_with_heads_and_the_inner_listing() {
        let t = setup("agree");
        std::fs::write(t.root.join("sub/upload#12"), b"partial").unwrap();
        std::fs::write(t.root.join("sub/name#tag"), b"kept").unwrap();
        let s = ConfinedLocal::new(&t.root, Symlinks::None).unwrap();
        let listed: Vec<ObjectMeta> = s.list(None).try_collect().await.unwrap();
        let mut names: Vec<String> = listed.iter().map(|o| o.location.to_string()).collect();
        names.sort();
        assert_eq!(names, ["a.txt", "sub/b.txt", "sub/name#tag"]);
        for o in &listed {
            let head = s.head(&o.location).await.unwrap();
            assert_eq!(head.e_tag, o.e_tag, "{}", o.location);
            assert_eq!(head.size, o.size);
            assert_eq!(head.last_modified, o.last_modified);
        }
        // Where no link is involved, exactly what LocalFileSystem itself lists.
        let sub = StorePath::from("sub");
        let mut mine: Vec<ObjectMeta> = s.list(Some(&sub)).try_collect().await.unwrap();
        let mut theirs: Vec<ObjectMeta> = s.inner.list(Some(&sub)).try_collect().await.unwrap();
        mine.sort_by(|a, b| a.location.cmp(&b.location));
        theirs.sort_by(|a, b| a.location.cmp(&b.location));
        assert_eq!(mine, theirs);
        // One level too: the same folders and the same objects with the same metadata.
        std::fs::create_dir(t.root.join("sub/inner")).unwrap();
        std::fs::write(t.root.join("sub/with space %41 ü"), b"odd name").unwrap();
        for level in [None, Some(&sub)] {
            let mine = s.list_with_delimiter(level).await.unwrap();
            let mut theirs = s.inner.list_with_delimiter(level).await.unwrap();
            // The inner store lists what the policy hides too (the links), and in its order.
            let hidden = |p: &StorePath| p.as_ref().contains("link") || p.as_ref().contains("dir-");
            theirs.common_prefixes.retain(|p| !hidden(p));
            theirs.objects.retain(|o| !hidden(&o.location));
            let mut objects = mine.objects.clone();
            objects.sort_by(|a, b| a.location.cmp(&b.location));
            theirs.objects.sort_by(|a, b| a.location.cmp(&b.location));
            assert_eq!(mine.common_prefixes, theirs.common_prefixes, "{level:?}");
            assert_eq!(objects, theirs.objects, "{level:?}");
        }
        // The first object of a big folder comes without reading all of it.
        for i in 0..3000 {
            std::fs::write(t.root.join(format!("sub/f{i:04}")), b"x").unwrap();
        }
        let first = s
            .list(Some(&StorePath::from("sub")))
            .next()
            .await
            .unwrap()
            .unwrap();
        assert!(first.location.as_ref().starts_with("sub/"));
        assert_eq!(all(&s, Some("sub")).await.len(), 3003);
        assert!(all(&s, Some("a.txt")).await.is_empty());
        assert!(all(&s, Some("missing")).await.is_empty());
    }

    #[tokio::test]
    async fn links_inside_the_root_are_followed_when_allowed() {
        let t = setup("inside");
        let s = ConfinedLocal::new(&t.root, Symlinks::Inside).unwrap();
        assert_eq!(read(&s, "in-link").await.unwrap(), b"inside-a");
        assert_eq!(read(&s, "dir-in/b.txt").await.unwrap(), b"inside-b");
        for p in ["out-link", "dir-out/secret"] {
            let e = read(&s, p).await.unwrap_err();
            assert!(
                matches!(e, object_store::Error::NotFound { .. }),
                "{p}: {e}"
            );
        }
        assert_eq!(
            names(&s, None).await,
            (
                vec!["dir-in".to_string(), "sub".to_string()],
                vec!["a.txt".to_string(), "in-link".to_string()]
            )
        );
        assert_eq!(
            names(&s, Some("dir-in")).await.1,
            vec!["dir-in/b.txt".to_string()]
        );
        // A recursive listing does not descend into linked folders (a recursive delete of
        // the tree removes the link, not what it points to).
        assert_eq!(all(&s, None).await, vec!["a.txt", "in-link", "sub/b.txt"]);
        // A link to a folder above the root.
        symlink(&t.outside, t.root.join("sub/up")).unwrap();
        assert!(read(&s, "sub/up/secret").await.is_err());
        assert_eq!(all(&s, Some("sub")).await, vec!["sub/b.txt"]);
    }

    #[tokio::test]
    async fn a_folder_swapped_for_a_link_after_the_check_is_not_served() {
        let t = setup("swap");
        let s = ConfinedLocal::new(&t.root, Symlinks::None).unwrap();
        std::fs::create_dir(t.root.join("d")).unwrap();
        std::fs::write(t.root.join("d/secret"), b"harmless").unwrap();
        let loc = StorePath::from("d/secret");
        // The walk sees d/secret; then d is swapped for a link out of the folder before
        // the file is opened (what an attacker racing the worker would do).
        let md = s.check(&loc, Last::Object).await.unwrap().unwrap();
        std::fs::rename(t.root.join("d"), t.root.join("d-old")).unwrap();
        symlink(&t.outside, t.root.join("d")).unwrap();
        std::fs::write(t.outside.join("secret"), b"TOP-SECRET-BYTES").unwrap();
        let opened = s.inner.get_opts(&loc, GetOptions::default()).await.unwrap();
        assert!(
            !opened_what_was_checked(&md, &opened),
            "the swapped-in file passes the check"
        );
        // Without a swap the check passes, and the store itself refuses the path now.
        let md = s
            .check(&StorePath::from("a.txt"), Last::Object)
            .await
            .unwrap()
            .unwrap();
        let opened = s
            .inner
            .get_opts(&StorePath::from("a.txt"), GetOptions::default())
            .await
            .unwrap();
        assert!(opened_what_was_checked(&md, &opened));
        assert!(read(&s, "d/secret").await.is_err());
    }
}
