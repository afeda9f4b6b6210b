//! Namespace reads with lazy loading of mounted under-store metadata.
//!
//! A directory inside a mount is listed from the under-store the first time it is looked
//! into; the listing is proposed through Raft (`Command::LoadDir`) so every replica holds the
//! same inodes. Later accesses list it again when the mount's `sync_interval` has passed
//! (`Command::SyncDir`). A failed listing changes nothing: a directory never listed reports
//! it; a loaded one keeps its metadata, and the failure is recorded, counted and retried
//! with backoff.

mod follower;
mod listing;
mod merge;
mod writes;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use granary_common::paths;
use granary_common::ufs::SyncPolicy;
use object_store::{ObjectStore as _, ObjectStoreExt as _};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::error::MasterError;
use crate::mounts::{find_mount, UfsCache};
use crate::raft::node::RaftHandle;
use crate::state::{Command, Fingerprint, Inode, Kind, Mount, StateMachine, UfsEntry, ROOT_INODE};

pub struct Namespace {
    pub sm: StateMachine,
    pub raft: RaftHandle,
    pub ufs: Arc<UfsCache>,
    pub block_size: u64,
    /// Where stale versions are noted for workers to drop.
    blocks: Arc<crate::blocks::BlockLocations>,
    /// One listing at a time per directory.
    loading: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<()>>>>,
    /// When each directory was last listed, and its failures (leader's soft state).
    sync_state: Mutex<HashMap<u64, DirSync>>,
    /// Names looked up in unlisted directories and not found, with when.
    missing: Mutex<HashMap<(u64, String), Instant>>,
    /// When `sync_state` was last pruned.
    last_prune: Mutex<Instant>,
    /// Entries being checked against their store in the background (see
    /// [`Namespace::check_due`]).
    checking: Mutex<HashSet<u64>>,
    /// Loaded folders being listed again in the background (see [`Namespace::relist`]).
    relisting: Mutex<HashSet<u64>>,
    /// How far the listings that readers wait on have come (see `listing.rs`).
    progress: listing::ProgressMap,
    /// Starts [`Namespace::relist`] of a folder on a task of its own; false when it cannot
    /// (then the request that found the folder due lists it itself). Unset in tests of the
    /// namespace alone.
    relister: std::sync::OnceLock<Relister>,
    pub metrics: NsMetrics,
}

/// See [`Namespace::set_relister`].
pub type Relister = Box<dyn Fn(u64) -> bool + Send + Sync>;

/// What [`Namespace::list_in_background`] did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Background {
    Started,
    /// A listing of the folder runs already.
    Running,
    /// As many listings run as may: none started.
    Full,
    NoRelister,
}

/// How [`Namespace::sync`] treats a loaded folder whose re-listing is due.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Due {
    /// A read: answered from what is known while the folder is listed again in the
    /// background (stale-while-revalidate). `sync_interval=always` still waits.
    Read,
    /// Listed before the answer (a write judging what the store holds; the background
    /// re-listing itself).
    Wait,
    /// Listed now, due or not (`granary fs sync`).
    Force,
}

impl Namespace {
    pub fn new(
        sm: StateMachine,
        raft: RaftHandle,
        ufs: Arc<UfsCache>,
        block_size: u64,
        blocks: Arc<crate::blocks::BlockLocations>,
    ) -> Self {
        Self {
            sm,
            raft,
            ufs,
            block_size,
            blocks,
            loading: Mutex::new(HashMap::new()),
            sync_state: Mutex::new(HashMap::new()),
            missing: Mutex::new(HashMap::new()),
            last_prune: Mutex::new(Instant::now()),
            checking: Mutex::new(HashSet::new()),
            relisting: Mutex::new(HashSet::new()),
            progress: Default::default(),
            relister: std::sync::OnceLock::new(),
            metrics: NsMetrics::default(),
        }
    }

    /// How due re-listings of loaded folders get a task of their own (the master sets it
    /// once its core exists; see [`Relister`]).
    pub fn set_relister(&self, relister: Relister) {
        let _ = self.relister.set(relister);
    }

    /// Lists the folder `dir` if it is still due (a loaded one) or was never listed: what a
    /// relister's task runs. Failures are recorded and retried with backoff like any
    /// listing's.
    pub async fn relist(&self, dir: u64) {
        struct Done<'a>(&'a Namespace, u64);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                lock(&self.0.relisting).remove(&self.1);
                // Readers waiting on it (it may have found nothing to list).
                self.0.listing_over(self.1);
            }
        }
        let _done = Done(self, dir);
        let Ok(inode) = self.inode(dir) else {
            return;
        };
        if let Err(e) = self.sync(inode, Due::Wait).await {
            tracing::debug!(dir, error = %e, "background re-listing failed");
        }
    }

    /// Hands the due re-listing of `dir` to a task of its own (or finds one running);
    /// false when there is no relister. At most [`RELISTS_AT_ONCE`] run at once: past that
    /// the folder stays due and a later access starts its listing (a caller touching many
    /// folders quickly cannot have the leader list them all from the store at once).
    fn relist_in_background(&self, dir: u64) -> bool {
        match self.list_in_background(dir) {
            Background::Started | Background::Running => true,
            Background::Full => {
                self.metrics.relists_deferred.inc();
                true
            }
            Background::NoRelister => false,
        }
    }

    /// Starts a listing of `dir` on a task of its own (see [`Namespace::relist`]).
    fn list_in_background(&self, dir: u64) -> Background {
        let Some(relister) = self.relister.get() else {
            return Background::NoRelister;
        };
        {
            let mut running = lock(&self.relisting);
            if running.contains(&dir) {
                return Background::Running;
            }
            if running.len() >= RELISTS_AT_ONCE {
                return Background::Full;
            }
            running.insert(dir);
        }
        if relister(dir) {
            return Background::Started;
        }
        lock(&self.relisting).remove(&dir);
        Background::NoRelister
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
            cur = self
                .child_of(cur, comp)
                .await?
                .ok_or_else(|| MasterError::not_found(&path))?;
        }
        Ok(cur)
    }

    /// The child `name` of `dir`. In a mounted directory not listed yet, the child is
    /// looked up in the under-store by itself (a HEAD of the object, else a one-page
    /// prefixed list for a directory), so opening a known deep path never lists the
    /// directories above it; `ls` lists them when asked.
    async fn child_of(&self, dir: Inode, name: &str) -> Result<Option<Inode>, MasterError> {
        if let (Some(mount_id), false) = (dir.mount_id, dir.children_loaded) {
            if !self.leads() {
                // A follower answers a name known here that needs no check of its own.
                let policy = find_mount(&self.sm, mount_id)?.spec.sync_policy();
                return match self.sm.child(dir.id, name)? {
                    Some(c) if follower::needs_no_check(&c, policy) => Ok(Some(c)),
                    _ => Err(self.to_leader()),
                };
            }
            if let Some(c) = self.sm.child(dir.id, name)? {
                // A file found by an earlier lookup: its directory is never re-listed, so
                // it is checked by itself when the mount's sync interval says so.
                let mount = find_mount(&self.sm, mount_id)?;
                if c.kind != Kind::File || !self.due(&c, mount.spec.sync_policy()) {
                    return Ok(Some(c));
                }
                return match self.check_object(&mount, c.clone()).await {
                    Ok(fresh) => {
                        self.record_success(c.id, Instant::now());
                        Ok(Some(fresh))
                    }
                    Err(MasterError::NotFound { .. }) => Ok(None),
                    Err(e) => {
                        // Keep what is known; retried after the backoff.
                        self.record_failure(c.id, &e);
                        Ok(Some(c))
                    }
                };
            }
            let policy = find_mount(&self.sm, mount_id)?.spec.sync_policy();
            if self.known_missing(dir.id, name, policy) {
                return Ok(None);
            }
            let found = tokio::time::timeout(UFS_DEADLINE, self.probe(&dir, name))
                .await
                .map_err(|_| MasterError::Unavailable {
                    message: format!("looking up {name} did not finish within {UFS_DEADLINE:?}"),
                })??;
            match &found {
                Some(c) => self.record_success(c.id, Instant::now()),
                None => self.note_missing(dir.id, name),
            }
            return Ok(found);
        }
        let dir = self.sync(dir, Due::Read).await?;
        self.sm.child(dir.id, name)
    }

    async fn probe(&self, dir: &Inode, name: &str) -> Result<Option<Inode>, MasterError> {
        use futures::StreamExt;
        let Some(mount_id) = dir.mount_id else {
            return Ok(None);
        };
        let mount = find_mount(&self.sm, mount_id)?;
        let ufs = self.ufs.get(&mount)?;
        let rel = if dir.ufs_path.is_empty() {
            name.to_string()
        } else {
            format!("{}/{name}", dir.ufs_path)
        };
        let location = ufs.path_of(&rel);
        let label = MountLabel {
            mount: mount.path.clone(),
        };
        let failed = |e: object_store::Error| {
            let message = self.ufs.scrub(
                &mount,
                &format!(
                    "looking up {rel} in the under-store {} failed: {e}",
                    mount.spec.uri
                ),
            );
            if granary_common::ufs::is_access_denied(&e) {
                MasterError::PermissionDenied { message }
            } else {
                MasterError::Unavailable { message }
            }
        };
        // The object (HEAD) and a directory of that name (a one-page prefixed list) are
        // asked at once; whichever is found first wins. (Some stores answer a HEAD of a
        // "directory" with an error after retries rather than 404.)
        self.metrics.heads.get_or_create(&label).inc();
        self.metrics.prefix_lists.get_or_create(&label).inc();
        let head = ufs.store.head(&location);
        let below = async { ufs.store.list(Some(&location)).next().await };
        tokio::pin!(head, below);
        let (mut head_done, mut below_done) = (false, false);
        let (mut file, mut head_err, mut below_err) = (None, None, None);
        let entry = loop {
            tokio::select! {
                r = &mut head, if !head_done => {
                    head_done = true;
                    match r {
                        Ok(meta) => file = Some(UfsEntry {
                            name: name.to_string(),
                            kind: Kind::File,
                            fingerprint: Some(fingerprint_of(&meta)),
                        }),
                        Err(e) => head_err = Some(e),
                    }
                },
                r = &mut below, if !below_done => {
                    below_done = true;
                    match r {
                        // A directory of that name wins, as in listings.
                        Some(Ok(_)) => break Some(UfsEntry {
                            name: name.to_string(),
                            kind: Kind::Directory,
                            fingerprint: None,
                        }),
                        Some(Err(object_store::Error::NotFound { .. })) | None => {}
                        Some(Err(e)) => below_err = Some(e),
                    }
                }
            }
            if below_done && (head_done || file.is_some()) {
                break file.take();
            }
        };
        let Some(entry) = entry else {
            return match (head_err, below_err) {
                (Some(object_store::Error::NotFound { .. }), None) => Ok(None),
                (_, Some(e)) => Err(failed(e)),
                (Some(e), None) => Err(failed(e)),
                (None, None) => Ok(None),
            };
        };
        match self
            .raft
            .propose(&Command::AddUfsChild {
                dir: dir.id,
                mount_id,
                entry,
                now_ms: granary_common::now_ms(),
                block_size: self.block_size,
            })
            .await?
        {
            crate::state::ApplyOutput::Inode(i) => Ok(Some(i)),
            _ => Ok(None),
        }
    }

    /// The inode `id`, as fresh as a lookup of its name would give it: an entry inside a
    /// mount whose folder is due to be listed again (in a folder never listed: a file whose
    /// own check is due) is checked against the under-store first. A mount opens files by
    /// inode, and the statuses its opens fetch answer the kernel's lookups of their names:
    /// without this, a file read over and over was never checked again, and an object
    /// replaced in the store was served in its old version for as long as it was read. A
    /// failed check answers what is known, as a failed re-listing does.
    pub async fn current(&self, id: u64) -> Result<Inode, MasterError> {
        let inode = self.inode(id)?;
        if inode.mount_id.is_none() || inode.is_mount_point || inode.id == ROOT_INODE {
            return Ok(inode);
        }
        let parent = self.inode(inode.parent)?;
        if let Err(e) = self.child_of(parent, &inode.name).await {
            tracing::debug!(inode = id, error = %e, "checking an entry against its under-store failed; answering what is known");
        }
        self.inode(id)
    }

    /// Whether `inode` is due for the check [`Self::current`] makes (its folder due to be
    /// listed again, or, in a folder never listed, the file's own check due) and no check of
    /// the same thing runs now: then the key of what is checked (the folder, or the file) is
    /// marked and returned, and the caller runs `current` and [`Self::checked`] with the key
    /// after it. One check per folder however many of its entries are asked for. Cheap
    /// (state reads, no store).
    pub fn check_due(&self, inode: &Inode) -> Option<u64> {
        let (Some(mount_id), false) = (inode.mount_id, inode.is_mount_point) else {
            return None;
        };
        let parent = self.inode(inode.parent).ok()?;
        let policy = find_mount(&self.sm, mount_id).ok()?.spec.sync_policy();
        let key = if parent.children_loaded {
            (parent.mount_id.is_some() && self.due(&parent, policy)).then_some(parent.id)
        } else {
            (inode.kind == Kind::File && self.due(inode, policy)).then_some(inode.id)
        }?;
        let mut checking = lock(&self.checking);
        if checking.len() >= CHECKS_AT_ONCE && !checking.contains(&key) {
            // Callers asking about many entries at once cannot have the leader check them
            // all at once: this one stays due, and a later request starts its check.
            self.metrics.relists_deferred.inc();
            return None;
        }
        checking.insert(key).then_some(key)
    }

    /// The background check marked by [`Self::check_due`] ended.
    pub fn checked(&self, key: u64) {
        lock(&self.checking).remove(&key);
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
        // The path is walked for the error only: a found name costs no walk to the root.
        match self.child_of(dir.clone(), name).await? {
            Some(child) => Ok(child),
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
        // A first page lists a folder never listed; every page re-lists a listed one whose
        // sync interval passed (the statuses a page returns are then good for a whole
        // interval, see `FileStatus.cache_ms`; a re-listing between two pages is like any
        // change made during a listing: later pages show it). A later page of a folder
        // never listed lists it once [`LIST_AFTER_LOOKUPS`] of its names were looked up one
        // by one (a client listing ahead of a reader going through the folder: one listing
        // costs less than the probes to come); a path walked to a known deep name lists
        // nothing.
        let load = after.is_none()
            || dir.children_loaded
            || (dir.mount_id.is_some()
                && self.sm.children(dir.id, None, LIST_AFTER_LOOKUPS)?.len() >= LIST_AFTER_LOOKUPS);
        // A folder never listed streams: pages are answered as its listing decides them.
        if load && !dir.children_loaded {
            if let Some(page) = self.list_while_listing(&dir, after, limit).await? {
                return Ok(page);
            }
        }
        let dir = if load {
            self.sync(dir, Due::Read).await?
        } else {
            dir
        };
        self.sm.children(dir.id, after, limit)
    }

    /// Makes sure a mounted directory's children are in the namespace, and re-lists a
    /// loaded one when its mount's `sync_interval` says so, before answering (what a write
    /// judging the store's content needs; reads answer from what is known while a due
    /// re-listing runs in the background). A failed re-listing keeps the metadata already
    /// known (it is recorded, counted and retried with backoff); only a directory never
    /// listed successfully reports the failure.
    pub async fn ensure_loaded(&self, dir: Inode) -> Result<Inode, MasterError> {
        self.sync(dir, Due::Wait).await
    }

    /// Lists `dir` again now, whatever the mount's policy (`granary fs sync`).
    pub async fn force_sync(&self, dir: Inode) -> Result<Inode, MasterError> {
        self.sync(dir, Due::Force).await
    }

    /// `granary fs sync`: lists `start` (a file: its directory) again now and, with
    /// `recursive`, every directory below it that was already loaded. Returns how many were
    /// listed and the failures (whose known entries were kept).
    pub async fn sync_tree(
        &self,
        start: Inode,
        recursive: bool,
    ) -> Result<(u64, Vec<String>), MasterError> {
        let first = if start.kind == Kind::File {
            self.inode(start.parent)?
        } else {
            start
        };
        if first.mount_id.is_none() && !recursive {
            return Err(MasterError::precondition(format!(
                "{} is not inside a mount; nothing to sync (use -R to sync the mounts below it)",
                self.sm.path_of(&first)?
            )));
        }
        let mut queue = std::collections::VecDeque::from([first]);
        let (mut listed, mut failures) = (0u64, Vec::new());
        while let Some(dir) = queue.pop_front() {
            if dir.mount_id.is_some() {
                let before = self.sync_info(dir.id).map(|s| s.failures).unwrap_or(0);
                match self.force_sync(dir.clone()).await {
                    Ok(_) => {
                        let after = self.sync_info(dir.id).map(|s| s.failures).unwrap_or(0);
                        if after > before {
                            let err = self
                                .sync_info(dir.id)
                                .and_then(|s| s.last_error)
                                .unwrap_or_default();
                            failures.push(format!("{}: {err}", self.sm.path_of(&dir)?));
                        } else {
                            listed += 1;
                        }
                    }
                    Err(e) => failures.push(format!("{}: {e}", self.sm.path_of(&dir)?)),
                }
            }
            if recursive {
                for c in self.sm.children_of(dir.id) {
                    let c = c?;
                    // Unloaded directories stay lazy; mount points below start a mount.
                    if c.kind == Kind::Directory && (c.children_loaded || c.is_mount_point) {
                        queue.push_back(c);
                    }
                }
            }
        }
        Ok((listed, failures))
    }

    /// Is a re-listing of this loaded directory due?
    fn due(&self, dir: &Inode, policy: SyncPolicy) -> bool {
        let state = lock(&self.sync_state);
        let s = state.get(&dir.id);
        if s.and_then(|s| s.retry_at)
            .is_some_and(|t| Instant::now() < t)
        {
            return false; // backing off after a failure
        }
        match policy {
            SyncPolicy::Never => false,
            SyncPolicy::Always => true,
            // Unknown (e.g. this master just became leader): list again to be safe. Not
            // sooner than the last listing took (see `DirSync::took`).
            SyncPolicy::Every(d) => s
                .and_then(|s| s.synced_at.map(|t| (t, d.max(s.took))))
                .is_none_or(|(t, d)| t.elapsed() >= d),
        }
    }

    async fn sync(&self, dir: Inode, due: Due) -> Result<Inode, MasterError> {
        let asked = Instant::now();
        let Some(mount_id) = dir.mount_id else {
            return Ok(dir);
        };
        if dir.kind != Kind::Directory {
            return Ok(dir);
        }
        let force = due == Due::Force;
        let mount = find_mount(&self.sm, mount_id)?;
        let policy = mount.spec.sync_policy();
        if !self.leads() {
            // Only the leader lists (see `follower`).
            return if due == Due::Read && self.fresh_enough(&dir, policy) {
                Ok(dir)
            } else {
                Err(self.to_leader())
            };
        }
        if dir.children_loaded && !force && !self.due(&dir, policy) {
            return Ok(dir);
        }
        // A loaded folder due again: a read answers what is known now and the listing runs
        // on its own task — lookups never wait for a folder of a million objects to list.
        if dir.children_loaded
            && due == Due::Read
            && matches!(policy, SyncPolicy::Every(_))
            && self.relist_in_background(dir.id)
        {
            return Ok(dir);
        }
        if !dir.children_loaded && !force {
            // A directory never listed: during backoff, answer with the last failure.
            if let Some(err) = self.backing_off(dir.id) {
                return Err(err);
            }
        }
        let _guard = DirGuard::acquire(&self.loading, dir.id).await;
        // Someone else may have listed it while we waited.
        let dir = self.inode(dir.id)?;
        if dir.children_loaded && !force && !self.due(&dir, policy) {
            return Ok(dir);
        }
        // A forced listing asked for while others of the folder waited or ran: one that
        // started after it was asked for, and succeeded, is its listing (callers asking at
        // once cost one listing, not one each, and a write to the folder waits behind
        // that one only).
        if force && dir.children_loaded && self.listed_since(dir.id, asked) {
            return Ok(dir);
        }
        let label = MountLabel {
            mount: mount.path.clone(),
        };
        self.metrics.listings.get_or_create(&label).inc();
        let started = Instant::now();
        let merged = self.merge_listing(&mount, &dir, mount_id).await;
        self.listing_over(dir.id);
        match merged {
            Ok(true) => {}
            // Nothing changed: the usual outcome of a periodic re-listing.
            Ok(false) => {
                self.record_success(dir.id, started);
                self.record_unchanged_listing(dir.id, mount_id).await;
                return Ok(dir);
            }
            Err(e) => {
                self.metrics.listing_failures.get_or_create(&label).inc();
                let failures = self.record_failure(dir.id, &e);
                tracing::warn!(
                    mount = %mount.path,
                    dir = %dir.ufs_path,
                    failures,
                    error = %e,
                    "under-store listing failed; keeping the metadata known so far and retrying with backoff"
                );
                return if dir.children_loaded { Ok(dir) } else { Err(e) };
            }
        }
        self.record_success(dir.id, started);
        self.inode(dir.id)
    }

    /// validate-on-open: compares a file's fingerprint with the object's (one HEAD) and
    /// records a change, so the open reads the new version. A vanished object is removed
    /// from its directory and reported as not found.
    pub async fn validate(&self, file: Inode) -> Result<Inode, MasterError> {
        let Some(mount_id) = file.mount_id else {
            return Ok(file);
        };
        if file.kind != Kind::File {
            return Ok(file);
        }
        let mount = find_mount(&self.sm, mount_id)?;
        if !mount.spec.validate_on_open() {
            return Ok(file);
        }
        if !self.leads() {
            return Err(self.to_leader());
        }
        self.check_object(&mount, file).await
    }

    /// HEADs a file's object: a changed one gets its new fingerprint (and version, noted
    /// stale for workers); a vanished one makes its directory list again and is not found.
    async fn check_object(&self, mount: &Mount, file: Inode) -> Result<Inode, MasterError> {
        if file.not_in_store() {
            // Written through Granary and not (yet) in the store: nothing to compare.
            return Ok(file);
        }
        let path = file.ufs_path.clone();
        tokio::time::timeout(UFS_DEADLINE, self.check_object_now(mount, file))
            .await
            .map_err(|_| MasterError::Unavailable {
                message: format!("checking {path} did not finish within {UFS_DEADLINE:?}"),
            })?
    }

    async fn check_object_now(&self, mount: &Mount, file: Inode) -> Result<Inode, MasterError> {
        let ufs = self.ufs.get(mount)?;
        self.metrics
            .heads
            .get_or_create(&MountLabel {
                mount: mount.path.clone(),
            })
            .inc();
        match ufs.store.head(&ufs.path_of(&file.ufs_path)).await {
            Ok(meta) => {
                let fp = fingerprint_of(&meta);
                if file
                    .fingerprint
                    .as_ref()
                    .is_some_and(|known| known.same_object(&fp))
                {
                    return Ok(file);
                }
                tracing::info!(path = %file.ufs_path, mount = %mount.path, "object changed in the under-store; new version recorded");
                let fresh = match self
                    .raft
                    .propose(&Command::RefreshFile {
                        inode: file.id,
                        fingerprint: fp,
                        seen_version: Some(file.version),
                    })
                    .await?
                {
                    crate::state::ApplyOutput::Inode(i) => i,
                    _ => self.inode(file.id)?,
                };
                self.blocks.note_stale(fresh.id, fresh.version);
                Ok(fresh)
            }
            Err(object_store::Error::NotFound { .. }) => {
                let parent = self.inode(file.parent)?;
                let _ = self.force_sync(parent).await;
                Err(MasterError::not_found(
                    self.sm.path_of(&file).unwrap_or(file.ufs_path),
                ))
            }
            Err(e) => {
                let message = self.ufs.scrub(
                    mount,
                    &format!(
                        "checking {} in the under-store {} failed: {e}",
                        file.ufs_path, mount.spec.uri
                    ),
                );
                Err(if granary_common::ufs::is_access_denied(&e) {
                    MasterError::PermissionDenied { message }
                } else {
                    MasterError::Unavailable { message }
                })
            }
        }
    }

    fn backing_off(&self, dir: u64) -> Option<MasterError> {
        let state = lock(&self.sync_state);
        let s = state.get(&dir)?;
        (s.retry_at? > Instant::now()).then(|| MasterError::Unavailable {
            message: s.last_error.clone().unwrap_or_default(),
        })
    }

    fn record_failure(&self, dir: u64, e: &MasterError) -> u32 {
        let mut state = lock(&self.sync_state);
        let s = state.entry(dir).or_default();
        if s.failures == 0 {
            // Counted as it changes: a recount per failure made an outage's retries of n
            // folders cost n² under the lock every lookup's `due` check takes.
            self.metrics.failing_dirs.inc();
        }
        s.failures += 1;
        s.last_error = Some(e.to_string());
        let backoff = SYNC_RETRY_MIN
            .saturating_mul(1 << s.failures.min(10).saturating_sub(1))
            .min(SYNC_RETRY_MAX);
        s.retry_at = Some(Instant::now() + backoff);
        s.failures
    }

    /// Whether a listing of `dir` that started at `t` or later has succeeded.
    fn listed_since(&self, dir: u64, t: Instant) -> bool {
        lock(&self.sync_state)
            .get(&dir)
            .and_then(|s| s.started_at)
            .is_some_and(|started| started >= t)
    }

    /// A successful listing (or check) of `dir` that started at `started`.
    fn record_success(&self, dir: u64, started: Instant) {
        let took = started.elapsed();
        let mut state = lock(&self.sync_state);
        let s = state.entry(dir).or_default();
        let was_failing = s.failures > 0;
        if was_failing {
            tracing::info!(
                dir,
                failures = s.failures,
                "under-store listing succeeded again"
            );
        }
        *s = DirSync {
            synced_at: Some(Instant::now()),
            started_at: Some(started),
            took,
            ..Default::default()
        };
        if was_failing {
            self.metrics.failing_dirs.dec();
        }
    }

    /// The leader's view of a directory's metadata sync.
    pub fn sync_info(&self, dir: u64) -> Option<DirSync> {
        lock(&self.sync_state).get(&dir).cloned()
    }

    /// Directories whose last listing failed and whose backoff has passed (retried by the
    /// master's housekeeping, so a failure heals without anyone looking).
    pub fn due_retries(&self) -> Vec<u64> {
        let now = Instant::now();
        let mut state = lock(&self.sync_state);
        let mut due = Vec::new();
        for (id, s) in state.iter_mut() {
            if s.failures > 0 && s.retry_at.is_some_and(|t| t <= now) {
                // Claimed: not handed out again while this retry runs (its outcome resets it).
                s.retry_at = Some(now + SYNC_RETRY_MAX);
                due.push(*id);
            }
        }
        due
    }

    /// Was `name` looked up in `dir` and not found recently enough to trust it (within the
    /// mount's sync interval, at most [`MISSING_TTL`])? Spares a HEAD and a list per repeated
    /// miss (module imports, globbing scans).
    fn known_missing(&self, dir: u64, name: &str, policy: SyncPolicy) -> bool {
        let ttl = match policy {
            SyncPolicy::Never => MISSING_TTL,
            SyncPolicy::Always => return false,
            SyncPolicy::Every(d) => d.min(MISSING_TTL),
        };
        lock(&self.missing)
            .get(&(dir, name.to_string()))
            .is_some_and(|t| t.elapsed() < ttl)
    }

    fn note_missing(&self, dir: u64, name: &str) {
        let mut m = lock(&self.missing);
        if m.len() >= MISSING_CAP {
            m.retain(|_, t| t.elapsed() < MISSING_TTL);
            if m.len() >= MISSING_CAP {
                m.clear();
            }
        }
        m.insert((dir, name.to_string()), Instant::now());
    }

    /// Forgets one entry's sync state.
    pub fn forget_sync(&self, id: u64) {
        let mut state = lock(&self.sync_state);
        if state.remove(&id).is_some_and(|s| s.failures > 0) {
            self.metrics.failing_dirs.dec();
        }
    }

    /// Forgets the sync state of directories listed successfully more than
    /// [`SYNC_STATE_TTL`] ago, so the leader's soft state is bounded by the directories
    /// synced recently (and those failing) rather than growing with every directory ever
    /// listed. A directory forgotten this way is listed again on its next access (at most
    /// one early listing for mounts whose `sync_interval` is longer than the TTL).
    /// Runs at most once a minute.
    pub fn prune_sync_state(&self) -> usize {
        {
            let mut last = lock(&self.last_prune);
            if last.elapsed() < SYNC_STATE_PRUNE_EVERY {
                return 0;
            }
            *last = Instant::now();
        }
        let mut state = lock(&self.sync_state);
        let before = state.len();
        state.retain(|_, s| {
            s.failures > 0 || s.synced_at.is_some_and(|t| t.elapsed() < SYNC_STATE_TTL)
        });
        let forgotten = before - state.len();
        if forgotten > 0 {
            tracing::debug!(forgotten, "forgot old directory sync state");
        }
        forgotten
    }

    /// Forgets sync state (a new leader lists again on first access).
    pub fn forget_sync_state(&self) {
        let mut state = lock(&self.sync_state);
        state.clear();
        self.metrics.failing_dirs.set(0);
        drop(state);
        lock(&self.missing).clear();
    }
}

/// Successful listings remembered this long (see [`Namespace::prune_sync_state`]).
pub const SYNC_STATE_TTL: Duration = Duration::from_secs(3600);
const SYNC_STATE_PRUNE_EVERY: Duration = Duration::from_secs(60);

/// How long a lookup that found nothing is trusted (bounded by the mount's sync interval).
pub const MISSING_TTL: Duration = Duration::from_secs(10);
/// Names of a folder never listed looked up one by one after which a listing page (after a
/// name) lists the folder whole.
pub const LIST_AFTER_LOOKUPS: usize = 64;
/// Remembered misses at most.
const MISSING_CAP: usize = 100_000;

/// Deadline of one under-store listing (a hung store must not hold a directory's lock, and
/// its callers, forever; object_store's own retries fit well within it).
pub const UFS_DEADLINE: Duration = Duration::from_secs(120);

/// Background re-listings of due folders running at once (see
/// [`Namespace::relist_in_background`]).
const RELISTS_AT_ONCE: usize = 16;

/// Background checks of due entries (a folder's re-listing, or a file's own check in a
/// folder never listed) started by status requests by inode, running at once (see
/// [`Namespace::check_due`]).
const CHECKS_AT_ONCE: usize = 64;

/// First retry of a failed listing after this long, doubling up to [`SYNC_RETRY_MAX`].
pub const SYNC_RETRY_MIN: Duration = Duration::from_millis(500);
pub const SYNC_RETRY_MAX: Duration = Duration::from_secs(60);

/// Metadata sync state of one directory (soft state of the leader).
#[derive(Debug, Clone, Default)]
pub struct DirSync {
    pub synced_at: Option<Instant>,
    /// When the last successful listing started.
    pub started_at: Option<Instant>,
    /// How long the last successful listing took: the next one is not due sooner (a folder
    /// slower to list than its interval would be listed all the time).
    pub took: Duration,
    pub failures: u32,
    pub last_error: Option<String>,
    pub retry_at: Option<Instant>,
}

/// Label of per-mount metadata metrics: the mount's path.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct MountLabel {
    pub mount: String,
}

/// Under-store metadata metrics, per mount.
#[derive(Clone, Default)]
pub struct NsMetrics {
    pub listings: Family<MountLabel, Counter>,
    pub listing_failures: Family<MountLabel, Counter>,
    pub heads: Family<MountLabel, Counter>,
    pub prefix_lists: Family<MountLabel, Counter>,
    pub list_requests: Family<MountLabel, Counter>,
    pub failing_dirs: Gauge<i64, AtomicI64>,
    pub relists_deferred: Counter,
    pub follower_reads: Counter,
    pub follower_redirects: Counter,
}

impl NsMetrics {
    pub fn register(&self, registry: &granary_common::metrics::SharedRegistry) {
        if let Ok(mut r) = registry.lock() {
            r.register(
                "granary_master_ufs_listings",
                "Directory listings requested from under-stores, per mount",
                self.listings.clone(),
            );
            r.register(
                "granary_master_ufs_listing_failures",
                "Under-store directory listings that failed (the known metadata was kept), per mount",
                self.listing_failures.clone(),
            );
            r.register(
                "granary_master_ufs_heads",
                "Object HEAD requests (lookups of known paths, validate-on-open), per mount",
                self.heads.clone(),
            );
            r.register(
                "granary_master_ufs_prefix_lists",
                "One-page prefixed listings that look up a directory by name, per mount",
                self.prefix_lists.clone(),
            );
            r.register(
                "granary_master_ufs_list_requests",
                "Listing requests sent to under-stores for folder listings (one per page of up to list_page_keys entries), per mount",
                self.list_requests.clone(),
            );
            r.register(
                "granary_master_dirs_sync_failing",
                "Directories whose last under-store listing failed (being retried)",
                self.failing_dirs.clone(),
            );
            r.register(
                "granary_master_relists_deferred",
                "Due re-listings and entry checks not started because as many were running already (the folder or file stays due; a later access starts it)",
                self.relists_deferred.clone(),
            );
            r.register(
                "granary_master_follower_reads",
                "Namespace reads (statuses, lookups, listing pages) this master answered as a follower",
                self.follower_reads.clone(),
            );
            r.register(
                "granary_master_follower_redirects",
                "Namespace reads this master, a follower, sent to the leader (a folder to list, or its listing older than the sync interval)",
                self.follower_redirects.clone(),
            );
        }
    }
}

fn fingerprint_of(o: &object_store::ObjectMeta) -> Fingerprint {
    Fingerprint {
        etag: o.e_tag.clone().unwrap_or_default(),
        size: o.size,
        mtime_ms: o.last_modified.timestamp_millis(),
        version_id: o.version.clone().unwrap_or_default(),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Entries per `SyncDir` batch.
const SYNC_BATCH: usize = 2000;
/// A listing's batches proposed at once (see `propose_changes`).
const SYNC_IN_FLIGHT: usize = 4;

type DirLocks = Mutex<HashMap<u64, Arc<tokio::sync::Mutex<()>>>>;

/// One listing of a directory at a time. The map entry is removed by the last holder only
/// (after its guard is released), so a waiter and a newcomer never get different locks.
struct DirGuard<'a> {
    map: &'a DirLocks,
    id: u64,
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl<'a> DirGuard<'a> {
    async fn acquire(map: &'a DirLocks, id: u64) -> DirGuard<'a> {
        let lock = lock(map).entry(id).or_default().clone();
        let guard = lock.clone().lock_owned().await;
        DirGuard {
            map,
            id,
            lock,
            guard: Some(guard),
        }
    }
}

impl Drop for DirGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = lock(self.map);
        // Held by the map and by us only: nobody waits.
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(&self.id);
        }
    }
}
