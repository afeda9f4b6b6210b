//! Thin tonic handlers: decode, call the core, encode. Errors map to gRPC status in one place
//! (`impl From<MasterError> for tonic::Status`). Who may call which method is decided in
//! front of them (`granary_common::authz`); which paths a caller may touch, here
//! ([`access`]).

mod access;

use std::sync::Arc;

use access::{Caller, Reach};
use granary_common::authz::principal;
use granary_common::tls::Principal;

use granary_proto as pb;
use granary_proto::master_service_server::MasterService;
use tonic::{Request, Response, Status};

use crate::core::MasterCore;
use crate::error::MasterError;
use crate::state::{to_status, ApplyOutput, Command, Inode};

pub struct MasterRpc {
    pub core: Arc<MasterCore>,
    leadership: Arc<Leadership>,
    /// Fires when the master stops: open watches end (the server waits for every stream).
    shutdown: tokio_util::sync::CancellationToken,
}

impl MasterRpc {
    pub fn new(core: Arc<MasterCore>, shutdown: tokio_util::sync::CancellationToken) -> Self {
        Self {
            core,
            leadership: Arc::new(Leadership::default()),
            shutdown,
        }
    }
}

/// Leadership confirmed with a quorum, shared by the namespace watches: a watch tells its
/// client "nothing changed" only while this master is known to be the leader (a leader cut
/// off from the others stops confirming, and its watchers stop trusting their caches).
#[derive(Default)]
struct Leadership {
    /// When it was last confirmed (ms since the Unix epoch).
    confirmed_ms: std::sync::atomic::AtomicI64,
    confirming: tokio::sync::Mutex<()>,
}

impl Leadership {
    /// Whether this master was the leader within the last heartbeat period (one quorum
    /// round at most per period, however many watches ask).
    async fn confirm(&self, core: &MasterCore) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let fresh = |s: &Self| {
            granary_common::now_ms() - s.confirmed_ms.load(Relaxed)
                < WATCH_HEARTBEAT.as_millis() as i64
        };
        if fresh(self) {
            return true;
        }
        let _one = self.confirming.lock().await;
        if fresh(self) {
            return true;
        }
        let started = granary_common::now_ms();
        match tokio::time::timeout(WATCH_HEARTBEAT * 4, core.read_barrier()).await {
            Ok(Ok(())) => {
                self.confirmed_ms.store(started, Relaxed);
                true
            }
            _ => false,
        }
    }
}

/// Recursive `SyncMetadata` calls one principal may run at once.
pub const MAX_RECURSIVE_SYNCS: u32 = 2;
static RECURSIVE_SYNCS: granary_common::authz::CallLimit =
    granary_common::authz::CallLimit::new("recursive metadata syncs", MAX_RECURSIVE_SYNCS);

/// Namespace watches one principal may hold at once (a mount holds one; on a plaintext
/// cluster every client is the same principal).
pub const MAX_WATCHES: u32 = 4096;
static WATCHES: granary_common::authz::CallLimit =
    granary_common::authz::CallLimit::new("namespace watches", MAX_WATCHES);
/// A watch hears from the leader at least this often (a heartbeat when nothing changed).
const WATCH_HEARTBEAT: std::time::Duration = std::time::Duration::from_millis(500);
/// Longest address, host or data address a worker registers with.
const MAX_WORKER_NAME: usize = 256;
/// A watch whose next message has waited this long for room (its watcher reads none of
/// the 64 before it) ends: its task and its slot are not held by a watcher that stopped.
const WATCH_STALL: std::time::Duration = std::time::Duration::from_secs(30);

type WatchStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::NamespaceChanges, Status>> + Send>>;

const DEFAULT_PAGE: usize = 1000;
const MAX_PAGE: usize = 10_000;
/// Blocks one `GetBlockLocations` may ask about (a client asks for one file's at most).
pub const MAX_LOCATION_BLOCKS: usize = 4096;

/// The spec of mount `id` (None: not in a mount, or gone).
fn mount_spec(core: &MasterCore, id: Option<u64>) -> Option<granary_common::ufs::UfsSpec> {
    core.namespace()
        .sm
        .mount(id?)
        .ok()
        .flatten()
        .map(|m| m.spec)
}

/// Owner and mode as shown: the entry's own, else its mount's `uid`/`gid` and
/// `file_mode`/`dir_mode`, else no owner and 0644/0755.
fn fill_perms(s: &mut pb::FileStatus, spec: Option<&granary_common::ufs::UfsSpec>) {
    let dir = s.kind == pb::FileKind::Directory as i32;
    if let Some(spec) = spec {
        if !s.has_owner {
            if let Some((uid, gid)) = spec.owner() {
                (s.uid, s.gid, s.has_owner) = (uid, gid, true);
            }
        }
        if s.mode == 0 {
            s.mode = spec.default_mode(dir).unwrap_or(0);
        }
    }
    if s.mode == 0 {
        s.mode = if dir {
            crate::state::DEFAULT_DIR_MODE
        } else {
            crate::state::DEFAULT_FILE_MODE
        };
    }
}

/// Whether `who` may see job `j` (its path and its failed files': all below the path): a
/// caller confined to a subtree sees the jobs inside it.
fn job_shown(who: &Principal, j: &pb::JobInfo) -> bool {
    matches!(access::reach(who, &j.path), Ok(Reach::Full))
}

fn status_of(core: &MasterCore, inode: &Inode) -> Result<pb::FileStatus, MasterError> {
    status_at(core, inode, core.namespace().sm.path_of(inode)?)
}

/// [`status_of`] for an inode whose path the caller already walked.
fn status_at(
    core: &MasterCore,
    inode: &Inode,
    path: String,
) -> Result<pb::FileStatus, MasterError> {
    let mut s = to_status(inode, path);
    let spec = mount_spec(core, inode.mount_id);
    fill_perms(&mut s, spec.as_ref());
    // A file whose mount validates every open: clients never open it from a cached status.
    s.validate_on_open = inode.kind == crate::state::Kind::File
        && spec.as_ref().is_some_and(|m| m.validate_on_open());
    s.pinned_replicas = core
        .namespace()
        .sm
        .pin_covering(inode)?
        .map_or(0, |p| p.replicas);
    if let Some(t) = core.namespace().sm.ttl_of(inode.id)? {
        s.ttl_expires_ms = t.expires_ms.max(0) as u64;
        s.ttl_action = t.action.as_str().to_string();
    }
    s.cache_ms = cache_ms(core, inode, spec.as_ref());
    if let Some(sync) = core.namespace().sync_info(inode.id) {
        s.sync_failures = sync.failures;
        s.sync_error = sync.last_error.unwrap_or_default();
        s.synced_ms_ago = sync
            .synced_at
            .map(|t| t.elapsed().as_millis().max(1) as u64)
            .unwrap_or(0);
    }
    Ok(s)
}

/// How long a watching client may answer from this status and its name (see
/// `FileStatus.cache_ms`): until its folder is due to be listed again from the under-store.
/// Entries outside mounts (and mount points, in folders outside them) change only through
/// the master, which announces every change.
fn cache_ms(core: &MasterCore, inode: &Inode, spec: Option<&granary_common::ufs::UfsSpec>) -> u64 {
    use granary_common::ufs::SyncPolicy;
    let Some(spec) = spec.filter(|_| !inode.is_mount_point && inode.id != crate::state::ROOT_INODE)
    else {
        return u64::MAX;
    };
    match spec.sync_policy() {
        SyncPolicy::Never => u64::MAX,
        SyncPolicy::Always => 0,
        // The folder's last listing; for a file looked up by name in a folder never
        // listed, its own last check (it is checked by itself when due).
        // A follower (or a new leader) knows the folder's last listing as recorded with it.
        SyncPolicy::Every(d) => core
            .namespace()
            .sync_info(inode.parent)
            .and_then(|s| s.synced_at)
            .or_else(|| {
                core.namespace()
                    .sync_info(inode.id)
                    .and_then(|s| s.synced_at)
            })
            .map(|t| t.elapsed())
            .or_else(|| core.namespace().listed_ago(inode.parent))
            .map_or(0, |ago| d.saturating_sub(ago).as_millis() as u64),
    }
}

/// The longest ETag or object version id a fingerprint may name (stores use a few dozen
/// bytes; each is kept in the file's record and sent with every status of it).
const MAX_FINGERPRINT_FIELD: usize = 1024;

/// Refuses a fingerprint whose ETag or version id is longer than any store's: a caller
/// completing files with megabyte ETags made every listing of their folder cost gigabytes.
fn check_fingerprint(f: &pb::Fingerprint) -> Result<(), Status> {
    for (what, v) in [("etag", &f.etag), ("version_id", &f.version_id)] {
        if v.len() > MAX_FINGERPRINT_FIELD {
            return Err(Status::invalid_argument(format!(
                "the fingerprint's {what} is {} bytes long, at most {MAX_FINGERPRINT_FIELD} are allowed",
                v.len()
            )));
        }
    }
    Ok(())
}

fn fingerprint_of(f: pb::Fingerprint) -> crate::state::Fingerprint {
    crate::state::Fingerprint {
        etag: f.etag,
        size: f.size,
        mtime_ms: f.mtime_ms,
        version_id: f.version_id,
    }
}

/// Signs `who` a grant for a file's blocks (a `write` grant for a file being created) when
/// the master signs grants (TLS clusters). The grant binds what the status says decides
/// the blocks' bytes (version, block size, length, fingerprint), so workers cache only
/// blocks as the master describes them. A follower that does not hold the leader's key
/// yet (see `crate::grants`) sends the read to the leader.
fn grant(
    core: &MasterCore,
    who: &Principal,
    s: &mut pb::FileStatus,
    write: bool,
) -> Result<(), MasterError> {
    if let (Some(keys), true) = (core.grants(), s.kind == pb::FileKind::File as i32) {
        let expires = granary_common::now_ms().max(0) as u64
            + granary_common::grant::GRANT_LIFETIME.as_millis() as u64;
        match keys.sign(&core.raft().status, &who.name, s, write, expires) {
            Some(g) => s.grant = Some(g),
            None => return Err(core.namespace().to_leader()),
        }
    }
    Ok(())
}

/// A request id as the state machine remembers it: per principal and per request, so
/// that another caller reusing an id (by chance or on purpose) never gets the first
/// caller's outcome — and a grant on the file that outcome names — and an id reused for
/// another request (another kind, path or argument) is that request's own, never the
/// first one's replay. A client retries with the same message, so a retry still replays.
/// SHA-256: a caller who picks ids and paths cannot aim at another request's id.
fn scoped<M: granary_proto::prost::Message>(
    who: &Principal,
    method: &str,
    request_id: u64,
    r: &M,
) -> u64 {
    use sha2::Digest;
    if request_id == 0 {
        return 0;
    }
    let mut h = sha2::Sha256::new();
    for part in [b"granary-request", who.name.as_bytes(), method.as_bytes()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update(r.encode_to_vec());
    let d = h.finalize();
    let mut id = [0u8; 8];
    id.copy_from_slice(&d[..8]);
    u64::from_le_bytes(id).max(1)
}

/// A block size a file may be created with (0: the master's).
fn check_block_size(bs: u64) -> Result<(), Status> {
    if bs == 0 || (granary_common::MIN_BLOCK_SIZE..=granary_common::MAX_BLOCK_SIZE).contains(&bs) {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "a block size must be between {} KiB and {} MiB, not {bs} bytes",
            granary_common::MIN_BLOCK_SIZE >> 10,
            granary_common::MAX_BLOCK_SIZE >> 20
        )))
    }
}

/// Only the principal writing a file (or an admin) completes it, naming the version it
/// created: the version check at apply then covers a replace by someone else meanwhile.
fn may_complete(who: &Principal, inode: &Inode, version: u64) -> Result<(), Status> {
    if who.has(granary_common::tls::Role::Admin) {
        return Ok(());
    }
    if version == 0 {
        return Err(Status::invalid_argument(
            "CompleteFile must name the version the file was created with",
        ));
    }
    match &inode.creator {
        Some(c) if *c != who.name => Err(Status::permission_denied(format!(
            "{} is being written by {c}; only it (or an admin) may complete it",
            inode.name
        ))),
        _ => Ok(()),
    }
}

/// The status of `inode` as `who` gets it (with its grant).
fn status_for(
    core: &MasterCore,
    who: &Principal,
    inode: &Inode,
) -> Result<pb::FileStatus, MasterError> {
    status_for_at(core, who, inode, core.namespace().sm.path_of(inode)?)
}

/// [`status_for`] for an inode whose path the caller already walked.
fn status_for_at(
    core: &MasterCore,
    who: &Principal,
    inode: &Inode,
    path: String,
) -> Result<pb::FileStatus, MasterError> {
    let above = matches!(access::reach(who, &path), Ok(Reach::Ancestor));
    let mut s = status_at(core, inode, path)?;
    if above {
        // A folder above the caller's subtree is only its way down: its listing's last
        // error may name entries beside the subtree.
        s.sync_error.clear();
        (s.sync_failures, s.synced_ms_ago) = (0, 0);
    }
    grant(core, who, &mut s, false)?;
    Ok(s)
}

fn one(
    core: &MasterCore,
    who: &Principal,
    out: ApplyOutput,
) -> Result<Response<pb::GetStatusResponse>, Status> {
    match out {
        ApplyOutput::Inode(i) => Ok(Response::new(pb::GetStatusResponse {
            status: Some(status_for(core, who, &current(core, &i)?)?),
        })),
        _ => Err(Status::internal("unexpected apply result")),
    }
}

/// The entry an outcome names, as it is now: a replayed outcome (a retry whose first
/// answer was lost) may name an entry removed since, which is NOT_FOUND.
fn current(core: &MasterCore, i: &Inode) -> Result<Inode, Status> {
    core.namespace().sm.inode(i.id)?.ok_or_else(|| {
        Status::not_found(format!(
            "{} (inode {}) was removed after the request was applied",
            i.name, i.id
        ))
    })
}

/// Ends a background check of the namespace (see `Namespace::check_due`) however its task
/// ends.
struct Checked(Arc<MasterCore>, u64);

impl Drop for Checked {
    fn drop(&mut self) {
        self.0.namespace().checked(self.1);
    }
}

impl MasterRpc {
    /// Counts a namespace read answered here while following (see `namespace::follower`).
    fn answered(&self) {
        if !self.core.namespace().leads() {
            self.core.namespace().metrics.follower_reads.inc();
        }
    }

    /// The inode a caller named by id. A caller confined to a subtree gets one refusal for
    /// an inode outside it and for a missing one ([`access::denied_id`]): it learns neither
    /// the path nor whether the inode exists. With the inode comes its path when the check
    /// walked it (a confined caller), so that the request need not walk it again.
    fn named_inode(&self, who: &Principal, id: u64) -> Result<(Inode, Option<String>), Status> {
        let found = self.core.namespace().inode(id);
        if who.subtree.is_none() {
            return Ok((found?, None));
        }
        let checked = found.and_then(|inode| {
            let path = self.core.namespace().sm.path_of(&inode)?;
            Ok((inode, path))
        });
        match checked {
            Ok((inode, path)) if access::reach(who, &path).is_ok() => Ok((inode, Some(path))),
            _ => Err(access::denied_id(who, id)),
        }
    }

    /// A mutation whose checks failed with `err`: when the same request was applied
    /// before (its answer was lost and the client retries), its first outcome; else `err`.
    /// `path`: the entry the request makes or moves to; a first outcome recorded for
    /// another path (the id reused for another request) is not replayed.
    async fn replayed_or(
        &self,
        request_id: u64,
        err: Status,
        path: Option<&str>,
    ) -> Result<ApplyOutput, Status> {
        let first = match self.core.replayed(request_id).await {
            Ok(Some(first)) => first?,
            Ok(None) | Err(_) => return Err(err),
        };
        if let (Some(path), ApplyOutput::Inode(i)) = (path, &first) {
            // Replayed only while `path` still names that entry, and as it is now.
            let sm = &self.core.namespace().sm;
            let now = granary_common::paths::normalize(path)
                .ok()
                .and_then(|p| sm.resolve_loaded(&p).ok().flatten());
            return match now {
                Some(now) if now.id == i.id => Ok(ApplyOutput::Inode(now)),
                _ => Err(err),
            };
        }
        Ok(first)
    }

    /// Checks a mount's caller may change the folder that holds `path` (write and search
    /// permission, as for creating, removing or renaming an entry in it).
    async fn may_change_parent(&self, caller: Option<Caller>, path: &str) -> Result<(), Status> {
        if caller.is_none() {
            return Ok(());
        }
        let path = granary_common::paths::normalize(path).map_err(MasterError::from)?;
        let parent = match path.rfind('/') {
            Some(0) | None => "/",
            Some(i) => &path[..i],
        };
        // A missing parent is the operation's own error to report.
        if let Ok(dir) = self.core.namespace().resolve(parent).await {
            let s = status_of(&self.core, &dir)?;
            access::posix(
                caller,
                &s,
                access::WRITE | access::EXEC,
                "change entries of",
            )?;
        }
        Ok(())
    }

    /// Decommissions (`on`) or recommissions a worker through the replicated state: an
    /// unknown worker, or recommissioning one in service, is refused with nothing changed.
    async fn set_decommissioned(&self, id: u64, on: bool) -> Result<(), Status> {
        self.core.ensure_leader()?;
        let cmd = if on {
            if self.core.fleet().get(id).is_none() {
                return Err(Status::not_found(format!(
                    "no worker {id} is registered (see granary report)"
                )));
            }
            crate::state::Command::DecommissionWorker { worker_id: id }
        } else {
            if !self.core.namespace().sm.decommissioned()?.contains(&id) {
                return Err(Status::failed_precondition(format!(
                    "worker {id} is not decommissioned"
                )));
            }
            crate::state::Command::RecommissionWorker { worker_id: id }
        };
        self.core.propose(cmd).await?;
        tracing::info!(
            worker = id,
            decommissioned = on,
            "worker placement changed (decommissioned workers get no new blocks)"
        );
        Ok(())
    }

    /// The inode a request names. A path outside the caller's reach is refused before it is
    /// resolved: whether it exists is not the caller's to learn. An inode is checked against
    /// its under-store as a lookup of its name would be (`Namespace::current`, in the
    /// background) unless the request takes stale answers — and only once it is within the
    /// caller's reach, so no caller makes the master ask a store about entries it may not
    /// see. With the inode comes its path, walked once for the whole request, and how far
    /// the caller reaches it.
    async fn target(
        &self,
        who: &Principal,
        t: Option<pb::PathOrId>,
        stale: bool,
    ) -> Result<(Inode, String, Reach), Status> {
        match t.and_then(|t| t.target) {
            Some(pb::path_or_id::Target::Path(p)) => {
                if who.subtree.is_some() {
                    let n = granary_common::paths::normalize(&p)
                        .map_err(|e| Status::invalid_argument(e.to_string()))?;
                    access::reach(who, &n)?;
                }
                let inode = self.core.namespace().resolve(&p).await?;
                let path = self.core.namespace().sm.path_of(&inode)?;
                let reach = access::reach(who, &path)?;
                Ok((inode, path, reach))
            }
            Some(pb::path_or_id::Target::Inode(id)) => {
                let (inode, walked) = self.named_inode(who, id)?;
                let path = match walked {
                    Some(path) => path,
                    None => self.core.namespace().sm.path_of(&inode)?,
                };
                let reach = access::reach(who, &path)?;
                if !stale {
                    self.core.namespace().answerable_here(&inode)?;
                }
                // Checked against its store when due, in the background: the answer is what
                // is known now, and the next request sees what the check found — an open
                // never waits for a folder's re-listing (stale-while-revalidate). Only the
                // leader checks.
                let due = if stale || !self.core.namespace().leads() {
                    None
                } else {
                    self.core.namespace().check_due(&inode)
                };
                if let Some(key) = due {
                    let core = self.core.clone();
                    tokio::spawn(async move {
                        let _ended = Checked(core.clone(), key);
                        let _ = core.namespace().current(id).await;
                    });
                }
                Ok((inode, path, reach))
            }
            None => Err(MasterError::invalid("a path or inode id is required").into()),
        }
    }
}

#[tonic::async_trait]
impl MasterService for MasterRpc {
    type WatchNamespaceStream = WatchStream;

    async fn watch_namespace(
        &self,
        req: Request<pb::WatchNamespaceRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let who = principal(&req)?;
        let slot = WATCHES.enter(&who)?;
        // Subscribed before the barrier: every change applied after the state the barrier
        // covers is heard.
        let mut changes = self.core.namespace().sm.watch();
        self.core.read_barrier().await?;
        let core = self.core.clone();
        let leadership = self.leadership.clone();
        let shutdown = self.shutdown.clone();
        let start = core
            .raft()
            .status
            .applied
            .load(std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<pb::NamespaceChanges, Status>>(64);
        tokio::spawn(async move {
            let _slot = slot;
            let mut last = start;
            let mut msg = pb::NamespaceChanges {
                applied_index: start,
                reset: true,
                inodes: Vec::new(),
            };
            loop {
                // A watcher that has stopped reading (its messages waiting a whole
                // WATCH_STALL) is ended, as is every watch when the master stops: a send
                // never waits on the watcher beyond that.
                let sent = tokio::select! {
                    r = tokio::time::timeout(WATCH_STALL, tx.send(Ok(msg))) => matches!(r, Ok(Ok(()))),
                    _ = shutdown.cancelled() => false,
                };
                if !sent {
                    return; // the watcher went away or stopped reading
                }
                if !core.is_leader() || !leadership.confirm(&core).await {
                    let _ = tx.try_send(Err(Status::unavailable(
                        "this master is no longer the leader; watch the new one",
                    )));
                    return;
                }
                let next = tokio::select! {
                    _ = shutdown.cancelled() => {
                        let _ = tx.try_send(Err(Status::unavailable("the master is stopping")));
                        return;
                    }
                    next = tokio::time::timeout(WATCH_HEARTBEAT, changes.recv()) => next,
                };
                msg = match next {
                    Ok(Ok(c)) => {
                        last = last.max(c.index);
                        let mut m = pb::NamespaceChanges {
                            applied_index: last,
                            reset: c.reset,
                            inodes: c.inodes.to_vec(),
                        };
                        // What is already waiting goes in the same message.
                        while m.inodes.len() < 10_000 {
                            match changes.try_recv() {
                                Ok(c) => {
                                    last = last.max(c.index);
                                    m.applied_index = last;
                                    m.reset |= c.reset;
                                    m.inodes.extend_from_slice(&c.inodes);
                                }
                                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => {
                                    m.reset = true;
                                }
                                Err(_) => break,
                            }
                        }
                        m
                    }
                    // Fell behind: what it missed is not known.
                    Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {
                        pb::NamespaceChanges {
                            applied_index: last,
                            reset: true,
                            inodes: Vec::new(),
                        }
                    }
                    Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => return,
                    Err(_) => pb::NamespaceChanges {
                        applied_index: last,
                        reset: false,
                        inodes: Vec::new(),
                    },
                };
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_status(
        &self,
        req: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        if !r.allow_stale {
            self.core.read_here().await?;
        }
        let (mut inode, mut path, _) = self.target(&who, r.target, r.allow_stale).await?;
        if r.validate && !r.allow_stale {
            let before = (inode.parent, inode.name.clone());
            inode = self.core.namespace().validate(inode).await?;
            if (inode.parent, &inode.name) != (before.0, &before.1) {
                path = self.core.namespace().sm.path_of(&inode)?;
                access::reach(&who, &path)?;
            }
        }
        self.answered();
        Ok(Response::new(pb::GetStatusResponse {
            status: Some(status_for_at(&self.core, &who, &inode, path)?),
        }))
    }

    async fn lookup(
        &self,
        req: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let who = principal(&req)?;
        let caller = Caller::of(&req);
        let r = req.into_inner();
        self.core.read_here().await?;
        let (parent, walked) = self.named_inode(&who, r.parent)?;
        // The parent's path is walked once; the entry's is the parent's and its name.
        let parent_path = match walked {
            Some(p) => p,
            None => self.core.namespace().sm.path_of(&parent)?,
        };
        let path = granary_common::paths::join(&parent_path, &r.name);
        access::reach(&who, &path)?;
        if caller.is_some() {
            let parent = status_at(&self.core, &parent, parent_path)?;
            access::posix(caller, &parent, access::EXEC, "look up entries of")?;
        }
        let inode = self.core.namespace().lookup(r.parent, &r.name).await?;
        self.answered();
        Ok(Response::new(pb::GetStatusResponse {
            status: Some(status_for_at(&self.core, &who, &inode, path)?),
        }))
    }

    async fn list_status(
        &self,
        req: Request<pb::ListStatusRequest>,
    ) -> Result<Response<pb::ListStatusResponse>, Status> {
        let who = principal(&req)?;
        let caller = Caller::of(&req);
        let r = req.into_inner();
        if !r.allow_stale {
            self.core.read_here().await?;
        }
        let (dir, dir_path, reach) = self.target(&who, r.target, r.allow_stale).await?;
        let limit = match r.page_size as usize {
            0 => DEFAULT_PAGE,
            n => n.min(MAX_PAGE),
        };
        let after = (!r.page_token.is_empty()).then_some(r.page_token.as_str());
        let is_dir = dir.kind == crate::state::Kind::Directory;
        // The pin covering the directory covers its children (unless they have their own).
        let dir_pin = self
            .core
            .namespace()
            .sm
            .pin_covering(&dir)?
            .map_or(0, |p| p.replicas);
        if dir.kind == crate::state::Kind::Directory {
            let shown = status_of(&self.core, &dir)?;
            access::posix(caller, &shown, access::READ, "list")?;
        }
        let children = if is_dir && reach == Reach::Ancestor {
            // Above the caller's subtree only the way down is shown, and nothing else is
            // read: no entry, and no page token, names a sibling.
            match access::way_down(&who, &dir_path).filter(|n| after.is_none_or(|a| a < n.as_str()))
            {
                Some(name) => match self.core.namespace().lookup(dir.id, &name).await {
                    Ok(child) => vec![child],
                    Err(MasterError::NotFound { .. }) => Vec::new(),
                    Err(e) => return Err(e.into()),
                },
                None => Vec::new(),
            }
        } else {
            self.core.namespace().list(dir, after, limit).await?
        };
        let page_mount = children.first().and_then(|c| c.mount_id);
        let spec = mount_spec(&self.core, page_mount);
        // One mount for the whole page: does it validate every open?
        let validated = spec.as_ref().is_some_and(|m| m.validate_on_open());
        let next_page_token = if is_dir && reach == Reach::Full && children.len() == limit {
            children.last().map(|c| c.name.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        // Above a principal's subtree, a listing shows only the way down.
        let shown = |c: &&Inode| {
            reach == Reach::Full
                || access::reach(&who, &granary_common::paths::join(&dir_path, &c.name)).is_ok()
        };
        let ids: Vec<u64> = children.iter().map(|c| c.id).collect();
        let pins = self.core.namespace().sm.pins_among(&ids)?;
        let entries = children
            .iter()
            .filter(shown)
            .map(|c| {
                let p = if is_dir {
                    granary_common::paths::join(&dir_path, &c.name)
                } else {
                    dir_path.clone()
                };
                let mut s = to_status(c, p);
                fill_perms(&mut s, spec.as_ref());
                s.validate_on_open = validated && c.kind == crate::state::Kind::File;
                s.cache_ms = if c.mount_id == page_mount {
                    cache_ms(&self.core, c, spec.as_ref())
                } else {
                    cache_ms(&self.core, c, mount_spec(&self.core, c.mount_id).as_ref())
                };
                s.pinned_replicas = match pins.get(&c.id) {
                    Some(pin) => pin.replicas,
                    None => dir_pin,
                };
                grant(&self.core, &who, &mut s, false)?;
                Ok(s)
            })
            .collect::<Result<Vec<_>, MasterError>>()?;
        self.answered();
        Ok(Response::new(pb::ListStatusResponse {
            entries,
            next_page_token,
        }))
    }

    async fn mkdir(
        &self,
        req: Request<pb::MkdirRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let who = principal(&req)?;
        let caller = Caller::of(&req);
        let r = req.into_inner();
        access::full_raw(&who, &r.path)?;
        self.core.ensure_leader()?;
        let id = scoped(&who, "Mkdir", r.request_id, &r);
        let checked = async {
            self.may_change_parent(caller, &r.path).await?;
            self.core
                .namespace()
                .prepare_mkdir(&r.path, r.recursive)
                .await?;
            Ok(())
        };
        if let Err(e) = checked.await {
            let out = self.replayed_or(id, e, Some(&r.path)).await?;
            return one(&self.core, &who, out);
        }
        let out = self
            .core
            .propose_request(
                Command::Mkdir {
                    path: r.path,
                    recursive: r.recursive,
                    mode: r.mode,
                    now_ms: granary_common::now_ms(),
                    owner: caller.map(Caller::owner),
                },
                id,
            )
            .await?;
        one(&self.core, &who, out)
    }

    async fn create_file(
        &self,
        req: Request<pb::CreateFileRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let who = principal(&req)?;
        let caller = Caller::of(&req);
        let r = req.into_inner();
        access::full_raw(&who, &r.path)?;
        check_block_size(r.block_size)?;
        self.core.ensure_leader()?;
        let id = scoped(&who, "CreateFile", r.request_id, &r);
        let checked = async {
            self.may_change_parent(caller, &r.path).await?;
            Ok(self
                .core
                .namespace()
                .prepare_create(&r.path, r.overwrite)
                .await?)
        };
        let (replaces, out) = match checked.await {
            Ok(replaces) => (replaces, None),
            Err(e) => (false, Some(self.replayed_or(id, e, Some(&r.path)).await?)),
        };
        let out = match out {
            Some(out) => out,
            None => {
                self.core
                    .propose_request(
                        Command::CreateFile {
                            path: r.path,
                            mode: r.mode,
                            block_size: r.block_size,
                            now_ms: granary_common::now_ms(),
                            overwrite: r.overwrite,
                            owner: caller.map(Caller::owner),
                            creator: Some(who.name.clone()),
                        },
                        id,
                    )
                    .await?
            }
        };
        match &out {
            // A replaced file's old pages are of no use any more. A new file has none: noting
            // every create would fill the table each heartbeat goes through (5 minutes of a
            // checkpoint writer's files). A file made by someone else between the check and
            // the apply is missed; its old pages are never read again and age out.
            ApplyOutput::Inode(i) if replaces => self.core.fleet().note_stale(i.id, i.version),
            _ => {}
        }
        match out {
            ApplyOutput::Inode(i) => {
                let mut s = status_of(&self.core, &current(&self.core, &i)?)?;
                grant(&self.core, &who, &mut s, true)?;
                Ok(Response::new(pb::GetStatusResponse { status: Some(s) }))
            }
            _ => Err(Status::internal("unexpected apply result")),
        }
    }

    async fn complete_file(
        &self,
        req: Request<pb::CompleteFileRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        let id = scoped(&who, "CompleteFile", r.request_id, &r);
        if r.length > granary_common::MAX_FILE_LENGTH {
            return Err(Status::invalid_argument(format!(
                "a file may be at most {} TiB long, not {} bytes",
                granary_common::MAX_FILE_LENGTH >> 40,
                r.length
            )));
        }
        let (inode, walked) = self.named_inode(&who, r.inode)?;
        if let Some(path) = walked {
            access::full(&who, &path)?;
        }
        may_complete(&who, &inode, r.version)?;
        // The store's object of a persisted file has the file's length (readers check their
        // fills against this fingerprint).
        if let Some(fp) = &r.fingerprint {
            check_fingerprint(fp)?;
            if fp.size != r.length {
                return Err(Status::invalid_argument(format!(
                    "the fingerprint names an object of {} bytes, the file has {}",
                    fp.size, r.length
                )));
            }
        }
        // A file not in the store is kept (and pinned) by the worker it names: one that is
        // not registered would leave it pending, and its replicas pinned, for good. (A new
        // leader knows the workers after a few heartbeats; until then it believes the writer.)
        let fleet = self.core.fleet();
        if r.persist_state != pb::PersistState::Persisted as i32
            && fleet.settled()
            && !fleet.is_live_id(r.persist_worker)
        {
            return Err(Status::invalid_argument(format!(
                "persist_worker {} is not a live worker of this cluster",
                r.persist_worker
            )));
        }
        let out = self
            .core
            .propose_request(
                Command::CompleteFile {
                    inode: r.inode,
                    length: r.length,
                    fingerprint: r.fingerprint.map(fingerprint_of),
                    now_ms: granary_common::now_ms(),
                    version: (r.version != 0).then_some(r.version),
                    persist: crate::state::Persist::from_proto(r.persist_state),
                    persist_worker: r.persist_worker,
                },
                id,
            )
            .await?;
        one(&self.core, &who, out)
    }

    async fn file_persisted(
        &self,
        req: Request<pb::FilePersistedRequest>,
    ) -> Result<Response<pb::FilePersistedResponse>, Status> {
        let r = req.into_inner();
        let fp = r.fingerprint.ok_or_else(|| {
            Status::invalid_argument("the uploaded object's fingerprint is missing")
        })?;
        check_fingerprint(&fp)?;
        // The object a worker uploaded holds the whole file: a fingerprint of another
        // size (or of nothing a reader could check a fill against) is not that upload.
        // (A file rewritten since has another version: the apply ignores such a report.)
        if let Some(file) = self.core.namespace().sm.inode(r.inode)? {
            let this_version = file.version == r.version;
            if this_version && (fp.size != file.length || (fp.etag.is_empty() && fp.mtime_ms == 0))
            {
                return Err(Status::invalid_argument(format!(
                    "the fingerprint of file {}'s upload ({} bytes) is not one of its {} bytes",
                    r.inode, fp.size, file.length
                )));
            }
        }
        let out = self
            .core
            .propose(Command::FilePersisted {
                inode: r.inode,
                version: r.version,
                fingerprint: fingerprint_of(fp),
                ufs_path: r.ufs_path,
            })
            .await?;
        Ok(Response::new(pb::FilePersistedResponse {
            recorded: matches!(out, ApplyOutput::Inode(_)),
        }))
    }

    async fn delete(
        &self,
        req: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let who = principal(&req)?;
        let caller = Caller::of(&req);
        let r = req.into_inner();
        access::full_raw(&who, &r.path)?;
        let id = scoped(&who, "Delete", r.request_id, &r);
        let deleted = async {
            self.may_change_parent(caller, &r.path).await?;
            self.core.delete_path(&r.path, r.recursive, id).await?;
            Ok(())
        };
        if let Err(e) = deleted.await {
            self.replayed_or(id, e, None).await?;
        }
        Ok(Response::new(pb::DeleteResponse {}))
    }

    async fn rename(
        &self,
        req: Request<pb::RenameRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let who = principal(&req)?;
        let caller = Caller::of(&req);
        let r = req.into_inner();
        access::full_raw(&who, &r.src)?;
        access::full_raw(&who, &r.dst)?;
        self.core.ensure_leader()?;
        let id = scoped(&who, "Rename", r.request_id, &r);
        let checked = async {
            self.may_change_parent(caller, &r.src).await?;
            self.may_change_parent(caller, &r.dst).await?;
            self.core
                .namespace()
                .rename_in_store(&r.src, &r.dst)
                .await?;
            Ok(())
        };
        if let Err(e) = checked.await {
            let out = self.replayed_or(id, e, Some(&r.dst)).await?;
            return one(&self.core, &who, out);
        }
        let out = self
            .core
            .propose_request(
                Command::Rename {
                    src: r.src,
                    dst: r.dst,
                    now_ms: granary_common::now_ms(),
                },
                id,
            )
            .await?;
        one(&self.core, &who, out)
    }

    async fn sync_metadata(
        &self,
        req: Request<pb::SyncMetadataRequest>,
    ) -> Result<Response<pb::SyncMetadataResponse>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        access::full_raw(&who, &r.path)?;
        // A recursive sync lists every loaded folder below the path from the under-store:
        // a few at once per principal (RESOURCE_EXHAUSTED beyond).
        let _slot = if r.recursive {
            Some(RECURSIVE_SYNCS.enter(&who)?)
        } else {
            None
        };
        self.core.read_barrier().await?;
        let start = self.core.namespace().resolve(&r.path).await?;
        let (dirs_listed, failures) = self.core.namespace().sync_tree(start, r.recursive).await?;
        Ok(Response::new(pb::SyncMetadataResponse {
            dirs_listed,
            failures,
        }))
    }

    async fn add_mount(
        &self,
        req: Request<pb::AddMountRequest>,
    ) -> Result<Response<pb::AddMountResponse>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        // Not for a confined admin even inside its subtree: a mount's store is read and
        // written with the cluster's credentials (or its local root), so a mount of
        // another team's bucket would hand its data to the subtree.
        access::whole_cluster(
            &who,
            "adding a mount (its store is read with the cluster's credentials)",
        )?;
        let id = scoped(&who, "AddMount", r.request_id, &r);
        let mount = self.core.add_mount(&r.path, &r.uri, &r.options, id).await?;
        Ok(Response::new(pb::AddMountResponse {
            mount: Some(crate::mounts::mount_info(&mount, true)),
        }))
    }

    async fn remove_mount(
        &self,
        req: Request<pb::RemoveMountRequest>,
    ) -> Result<Response<pb::RemoveMountResponse>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        access::full_raw(&who, &r.path)?;
        let id = scoped(&who, "RemoveMount", r.request_id, &r);
        self.core.remove_mount(&r.path, r.force, id).await?;
        Ok(Response::new(pb::RemoveMountResponse {}))
    }

    async fn list_mounts(
        &self,
        req: Request<pb::ListMountsRequest>,
    ) -> Result<Response<pb::ListMountsResponse>, Status> {
        let who = principal(&req)?;
        // Only admins see a mount's store options (credentials as `***` even then).
        let admin = who.has(granary_common::tls::Role::Admin);
        self.core.read_barrier().await?;
        let mounts = self
            .core
            .namespace()
            .sm
            .mounts()?
            .iter()
            .filter(|m| access::reach(&who, &m.path).is_ok())
            .map(|m| crate::mounts::mount_info(m, admin))
            .collect();
        Ok(Response::new(pb::ListMountsResponse { mounts }))
    }

    async fn get_mount_access(
        &self,
        req: Request<pb::GetMountAccessRequest>,
    ) -> Result<Response<pb::GetMountAccessResponse>, Status> {
        let id = req.into_inner().mount_id;
        self.core.read_barrier().await?;
        let m = crate::mounts::find_mount(&self.core.namespace().sm, id)?;
        let spec = self.core.namespace().ufs.open_spec(&m)?;
        Ok(Response::new(pb::GetMountAccessResponse {
            mount_id: m.id,
            uri: spec.uri.clone(),
            options: spec
                .options
                .iter()
                .map(|(k, v)| pb::MountOptionEntry {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
        }))
    }

    async fn get_block_locations(
        &self,
        req: Request<pb::GetBlockLocationsRequest>,
    ) -> Result<Response<pb::GetBlockLocationsResponse>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        if r.blocks.len() > MAX_LOCATION_BLOCKS {
            return Err(Status::invalid_argument(format!(
                "at most {MAX_LOCATION_BLOCKS} blocks per GetBlockLocations, not {}",
                r.blocks.len()
            )));
        }
        self.core.ensure_leader()?;
        if who.subtree.is_some() {
            // A caller confined to a subtree learns where its subtree's blocks are, and
            // nothing of other inodes (not even whether they exist).
            let mut checked = std::collections::HashSet::new();
            for b in &r.blocks {
                if checked.insert(b.inode) {
                    self.named_inode(&who, b.inode)?;
                }
            }
        }
        let locations = r
            .blocks
            .into_iter()
            .map(|b| {
                let workers = self.core.fleet().holders_of(&b);
                pb::BlockLocations {
                    block: Some(b),
                    workers,
                }
            })
            .collect();
        Ok(Response::new(pb::GetBlockLocationsResponse { locations }))
    }

    async fn register_worker(
        &self,
        req: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerResponse>, Status> {
        let r = req.into_inner();
        if r.worker_id == 0 || r.address.is_empty() {
            return Err(Status::invalid_argument(
                "worker id and address are required to register",
            ));
        }
        // Kept for every worker and sent to every client: names, not payloads.
        if [&r.address, &r.host, &r.data_address]
            .iter()
            .any(|s| s.len() > MAX_WORKER_NAME)
        {
            return Err(Status::invalid_argument(format!(
                "a worker's address, host and data address are at most {MAX_WORKER_NAME} bytes each"
            )));
        }
        self.core.ensure_leader()?;
        tracing::info!(worker = r.worker_id, address = %r.address, blocks = r.blocks.len(), "worker registered");
        self.core.fleet().register(r).map_err(|_| {
            Status::resource_exhausted(
                "the master tracks the blocks of at most 65,535 workers; this one cannot register until another is gone",
            )
        })?;
        Ok(Response::new(pb::RegisterWorkerResponse {
            heartbeat_interval_ms: self.core.fleet().heartbeat_interval().as_millis() as u64,
            grant_key: self.core.grants().map(|k| k.own().to_proto()),
            workers: self.core.fleet().known(),
        }))
    }

    async fn worker_heartbeat(
        &self,
        req: Request<pb::WorkerHeartbeatRequest>,
    ) -> Result<Response<pb::WorkerHeartbeatResponse>, Status> {
        let mut r = req.into_inner();
        self.core.ensure_leader()?;
        let stats = r.stats.take();
        let fleet = self.core.fleet();
        let Some(stale) = fleet.heartbeat(r.worker_id, stats, &r.added_blocks, &r.removed_blocks)
        else {
            return Ok(Response::new(pb::WorkerHeartbeatResponse {
                reregister: true,
                ..Default::default()
            }));
        };
        let pins = self.core.heartbeat_pins(
            r.worker_id,
            r.pins_generation,
            &r.added_blocks,
            r.pins_deltas,
        );
        Ok(Response::new(pb::WorkerHeartbeatResponse {
            reregister: false,
            stale,
            pins_changed: pins.full,
            pinned_inodes: pins.set,
            pinned_added: pins.added,
            pins_generation: pins.generation,
            grant_key: self.core.grants().map(|k| k.own().to_proto()),
            workers: self.core.fleet().known(),
        }))
    }

    async fn get_cluster_info(
        &self,
        req: Request<pb::GetClusterInfoRequest>,
    ) -> Result<Response<pb::GetClusterInfoResponse>, Status> {
        if !req.into_inner().allow_stale {
            self.core.ensure_leader()?;
        }
        Ok(Response::new(self.core.cluster_info().await?))
    }

    async fn set_ttl(
        &self,
        req: Request<pb::SetTtlRequest>,
    ) -> Result<Response<pb::SetTtlResponse>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        access::full_raw(&who, &r.path)?;
        let action = pb::TtlAction::requested(r.action_code, &r.action).ok_or_else(|| {
            Status::invalid_argument(format!(
                "unknown TTL action {:?} (code {}; free or delete)",
                r.action, r.action_code
            ))
        })?;
        let (_, ttl) = self
            .core
            .set_ttl(
                &r.path,
                r.ttl_ms,
                action,
                scoped(&who, "SetTtl", r.request_id, &r),
            )
            .await?;
        Ok(Response::new(pb::SetTtlResponse {
            expires_ms: ttl.map_or(0, |t| t.expires_ms.max(0) as u64),
        }))
    }

    async fn free(
        &self,
        req: Request<pb::FreeRequest>,
    ) -> Result<Response<pb::FreeResponse>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        access::full_raw(&who, &r.path)?;
        Ok(Response::new(
            self.core.free(&r.path, r.recursive, r.force).await?,
        ))
    }

    async fn set_pin(
        &self,
        req: Request<pb::SetPinRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        access::full_raw(&who, &r.path)?;
        let job = self
            .core
            .set_pin(
                &r.path,
                r.replicas,
                scoped(&who, "SetPin", r.request_id, &r),
            )
            .await?;
        Ok(Response::new(match job {
            Some(j) => self.core.job_info(j.id, 0)?,
            None => pb::JobInfo::default(),
        }))
    }

    async fn start_job(
        &self,
        req: Request<pb::StartJobRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        access::full_raw(&who, &r.path)?;
        let kind = pb::JobKind::requested(r.kind_code, &r.kind).ok_or_else(|| {
            Status::invalid_argument(format!(
                "unknown job kind {:?} (code {}; known: load)",
                r.kind, r.kind_code
            ))
        })?;
        let id = scoped(&who, "StartJob", r.request_id, &r);
        let job = self
            .core
            .start_job(kind, &r.path, r.replicas.max(1), id)
            .await?;
        Ok(Response::new(self.core.job_info(job.id, 0)?))
    }

    async fn get_job(
        &self,
        req: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        self.core.ensure_leader()?;
        self.core.read_barrier().await?;
        // At most this many failed files per answer (each up to a 4 KiB path): a job with
        // millions of failures made every GetJob asking for all of them cost gigabytes.
        const MOST_FAILED: usize = 10_000;
        let max = match r.max_failed {
            0 => 1000,
            n => (n as usize).min(MOST_FAILED),
        };
        // Whether the caller may see the job at all, before reading its failed list.
        if !job_shown(&who, &self.core.job_info(r.id, 0)?) {
            // As if there were none: a job's path (and its failed files') outside the
            // caller's subtree is not the caller's to learn.
            return Err(MasterError::NoSuchJob { id: r.id }.into());
        }
        Ok(Response::new(self.core.job_info(r.id, max)?))
    }

    async fn list_jobs(
        &self,
        req: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        let who = principal(&req)?;
        self.core.ensure_leader()?;
        self.core.read_barrier().await?;
        let mut jobs = self.core.job_list()?;
        jobs.retain(|j| job_shown(&who, j));
        Ok(Response::new(pb::ListJobsResponse { jobs }))
    }

    async fn cancel_job(
        &self,
        req: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        // An admin confined to a subtree cancels the jobs inside it only (others are as
        // if there were none, as for GetJob).
        self.core.ensure_leader()?;
        self.core.read_barrier().await?;
        if !job_shown(&who, &self.core.job_info(r.id, 0)?) {
            return Err(MasterError::NoSuchJob { id: r.id }.into());
        }
        let job = self.core.cancel_job(r.id).await?;
        Ok(Response::new(self.core.job_info(job.id, 1000)?))
    }

    async fn decommission_worker(
        &self,
        req: Request<pb::DecommissionWorkerRequest>,
    ) -> Result<Response<pb::DecommissionWorkerResponse>, Status> {
        access::whole_cluster(&*principal(&req)?, "decommissioning a worker")?;
        let r = req.into_inner();
        if !r.force {
            self.core.ensure_leader()?;
            if !self.core.fleet().settled() {
                return Err(Status::unavailable(
                    "a new leader is still hearing from its workers; retry",
                ));
            }
            let decommissioned = self.core.namespace().sm.decommissioned()?;
            let targets = self.core.fleet().placement_targets(&decommissioned);
            let others = targets
                .iter()
                .filter(|w| w.worker_id != r.worker_id)
                .count();
            if others == 0 && targets.iter().any(|w| w.worker_id == r.worker_id) {
                return Err(Status::failed_precondition(format!(
                    "worker {} is the last live worker in service: with it decommissioned \
                     nothing could take new blocks, writes or loads; start another first, or \
                     use --force",
                    r.worker_id
                )));
            }
        }
        self.set_decommissioned(r.worker_id, true).await?;
        Ok(Response::new(pb::DecommissionWorkerResponse {}))
    }

    async fn recommission_worker(
        &self,
        req: Request<pb::RecommissionWorkerRequest>,
    ) -> Result<Response<pb::RecommissionWorkerResponse>, Status> {
        access::whole_cluster(&*principal(&req)?, "recommissioning a worker")?;
        self.set_decommissioned(req.into_inner().worker_id, false)
            .await?;
        Ok(Response::new(pb::RecommissionWorkerResponse {}))
    }

    async fn add_master(
        &self,
        req: Request<pb::AddMasterRequest>,
    ) -> Result<Response<pb::ChangeMastersResponse>, Status> {
        access::whole_cluster(&*principal(&req)?, "adding a master")?;
        let r = req.into_inner();
        self.core.add_master(r.id, &r.address).await?;
        Ok(Response::new(pb::ChangeMastersResponse {
            masters: crate::raft::service::group_status(
                self.core.raft(),
                self.core.address(),
                self.core.net(),
            )
            .await,
        }))
    }

    async fn remove_master(
        &self,
        req: Request<pb::RemoveMasterRequest>,
    ) -> Result<Response<pb::ChangeMastersResponse>, Status> {
        access::whole_cluster(&*principal(&req)?, "removing a master")?;
        let r = req.into_inner();
        self.core.remove_master(r.id).await?;
        Ok(Response::new(pb::ChangeMastersResponse {
            masters: crate::raft::service::group_status(
                self.core.raft(),
                self.core.address(),
                self.core.net(),
            )
            .await,
        }))
    }
}
