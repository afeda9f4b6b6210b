//! The replicated state machine: namespace (inode tree), mount table and counters, stored in
//! RocksDB column family `state`. Applying a command writes its changes and the new applied
//! index in one atomic batch, so after a crash the state is exactly "all entries up to
//! `applied`" and Raft re-delivers the rest.

mod batch;
mod cache;
pub mod format;
pub mod invariants;
pub mod jobs;
pub mod keys;
pub mod pins;
pub mod records;
mod requests;
mod sync;
pub mod ttl;
pub mod walk;

use std::collections::BTreeMap;
use std::sync::Arc;

use granary_common::ids::version_of;
use granary_common::paths;
use granary_proto as pb;
use rocksdb::{WriteBatch, DB};

use crate::error::MasterError;
pub use format::{Record, FORMAT_VERSION};
pub use records::*;

pub const CF_STATE: &str = "state";

/// How long the outcome of a request id is remembered for retries.
pub const REQUEST_RETENTION_MS: i64 = 15 * 60 * 1000;
/// At most this many expired outcomes are dropped per applied request (keeps applies cheap).
const REQUEST_PRUNE_BATCH: usize = 16;

pub const DEFAULT_DIR_MODE: u32 = 0o755;
pub const DEFAULT_FILE_MODE: u32 = 0o644;

fn u64_of(v: &[u8]) -> Result<u64, MasterError> {
    let arr: [u8; 8] = v
        .try_into()
        .map_err(|_| MasterError::corrupt("counter record has a bad length"))?;
    Ok(u64::from_be_bytes(arr))
}

fn encode_record<T: Record>(v: &T) -> Result<Vec<u8>, MasterError> {
    Ok(v.encode())
}

fn decode_record<T: Record>(v: &[u8]) -> Result<T, MasterError> {
    T::decode(v)
}

/// Read access to the state, and `apply`.
#[derive(Clone)]
pub struct StateMachine {
    db: Arc<DB>,
    /// Inodes and folder entries read or written lately, decoded (see [`cache`]).
    cache: Arc<cache::Cache>,
    /// Inodes changed by each applied entry, for namespace watchers (see [`Changes`]).
    changes: tokio::sync::broadcast::Sender<Changes>,
    /// Renames applied, and snapshots installed, since this master started: what can move
    /// files into or out of a pinned folder (see [`StateMachine::moves`]).
    moves: Arc<std::sync::atomic::AtomicU64>,
    /// A lower bound of the ages of the request outcomes kept (see
    /// [`StateMachine::prune_requests`]); `i64::MIN`: not known (at start, after a
    /// snapshot), `i64::MAX`: none kept.
    oldest_request: Arc<std::sync::atomic::AtomicI64>,
    /// The format Raft entries are proposed in (see [`format::EntryFormat`]).
    entry_format: format::EntryFormat,
}

/// Applied entries a namespace watcher may fall behind by before it is told to start over.
const CHANGES_BUFFERED: usize = 4096;

/// What one applied entry changed in the namespace: inodes whose record was written or
/// removed, and folders whose entries were (their child records). Sent to namespace
/// watchers (`WatchNamespace`); `reset`: what changed is not known (a snapshot installed).
#[derive(Debug, Clone)]
pub struct Changes {
    pub index: u64,
    pub reset: bool,
    pub inodes: Arc<[u64]>,
}

impl StateMachine {
    /// Opens the state in `db`, creating the root directory in a brand-new store.
    pub fn open(db: Arc<DB>) -> Result<Self, MasterError> {
        let sm = Self {
            db,
            cache: Arc::new(cache::Cache::new()),
            changes: tokio::sync::broadcast::channel(CHANGES_BUFFERED).0,
            moves: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            oldest_request: Arc::new(std::sync::atomic::AtomicI64::new(i64::MIN)),
            entry_format: format::EntryFormat::default(),
        };
        sm.upgrade_format()?;
        if sm.inode(ROOT_INODE)?.is_none() {
            let mut txn = Txn::new(&sm);
            txn.put_inode(&Inode::directory(
                ROOT_INODE,
                ROOT_INODE,
                "",
                DEFAULT_DIR_MODE,
                0,
            ))?;
            txn.put_u64(keys::NEXT_INODE, ROOT_INODE + 1);
            txn.put_u64(keys::INODE_COUNT, 1);
            txn.commit()?;
        }
        Ok(sm)
    }

    fn cf(&self) -> Result<&rocksdb::ColumnFamily, MasterError> {
        self.db
            .cf_handle(CF_STATE)
            .ok_or_else(|| MasterError::corrupt("column family 'state' is missing"))
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, MasterError> {
        Ok(self.db.get_cf(self.cf()?, key)?)
    }

    fn get_u64(&self, key: &[u8]) -> Result<u64, MasterError> {
        match self.get(key)? {
            Some(v) => u64_of(&v),
            None => Ok(0),
        }
    }

    /// Changes of the entries applied from now on, one message per entry that changed the
    /// namespace (a receiver that falls more than [`CHANGES_BUFFERED`] behind is told so).
    pub fn watch(&self) -> tokio::sync::broadcast::Receiver<Changes> {
        self.changes.subscribe()
    }

    /// Tells watchers that the state was replaced wholesale (a snapshot was installed).
    pub fn announce_reset(&self, index: u64) {
        let _ = self.changes.send(Changes {
            index,
            reset: true,
            inodes: Arc::from(Vec::new()),
        });
    }

    /// What `txn` changes, when anyone watches (nothing to gather otherwise).
    fn watched(&self, txn: &Txn) -> Vec<u64> {
        if self.changes.receiver_count() > 0 {
            txn.changed_inodes()
        } else {
            Vec::new()
        }
    }

    fn announce(&self, index: u64, inodes: Vec<u64>) {
        if !inodes.is_empty() {
            let _ = self.changes.send(Changes {
                index,
                reset: false,
                inodes: Arc::from(inodes),
            });
        }
    }

    pub fn applied_index(&self) -> Result<u64, MasterError> {
        self.get_u64(keys::APPLIED)
    }

    pub fn inode_count(&self) -> Result<u64, MasterError> {
        self.get_u64(keys::INODE_COUNT)
    }

    pub fn inode(&self, id: u64) -> Result<Option<Inode>, MasterError> {
        self.inode_kept(id, true)
    }

    /// An inode, from the cache when it holds it; read from the store otherwise, and kept
    /// if `keep` (not for scans: a listing of a big folder would push out every folder
    /// that paths are resolved through, then be pushed out itself).
    fn inode_kept(&self, id: u64, keep: bool) -> Result<Option<Inode>, MasterError> {
        let generation = match self.cache.inode(id) {
            Ok(inode) => return Ok(Some(inode)),
            Err(generation) => generation,
        };
        let inode: Option<Inode> = self
            .get(&keys::inode(id))?
            .map(|v| decode_record(&v))
            .transpose()?;
        if let (Some(i), true) = (&inode, keep) {
            self.cache.offer_inode(generation, i);
        }
        Ok(inode)
    }

    pub fn child(&self, parent: u64, name: &str) -> Result<Option<Inode>, MasterError> {
        match self.child_id(&keys::child(parent, name))? {
            Some(id) => self.inode(id),
            None => Ok(None),
        }
    }

    /// The inode id of the folder entry with record key `key`.
    fn child_id(&self, key: &[u8]) -> Result<Option<u64>, MasterError> {
        let generation = match self.cache.entry(key) {
            Ok(id) => return Ok(Some(id)),
            Err(generation) => generation,
        };
        let id = self.get(key)?.map(|v| u64_of(&v)).transpose()?;
        if let Some(id) = id {
            self.cache.offer_entry(generation, key, id);
        }
        Ok(id)
    }

    /// Forgets every decoded record kept: the store was replaced under this state machine
    /// (a snapshot was installed). Call before anyone can read at the new applied index.
    pub fn forget_cached(&self) {
        self.cache.clear();
        self.oldest_request
            .store(i64::MIN, std::sync::atomic::Ordering::Relaxed);
        self.moves
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// A count that changes whenever files may have moved between folders (a rename was
    /// applied, a snapshot installed): the pins' holders compare it (local to this master;
    /// not replicated).
    pub fn moves(&self) -> u64 {
        self.moves.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Children of `parent` in name order, starting after `after`, at most `limit`.
    pub fn children(
        &self,
        parent: u64,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Inode>, MasterError> {
        let prefix = keys::children(parent);
        let mut it = self.db.raw_iterator_cf(self.cf()?);
        match after {
            Some(name) => {
                let mut k = keys::child(parent, name);
                k.push(0);
                it.seek(&k);
            }
            None => it.seek(&prefix),
        }
        let mut ids = Vec::new();
        while it.valid() && ids.len() < limit {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            if !k.starts_with(&prefix) {
                break;
            }
            ids.push(u64_of(v)?);
            it.next();
        }
        it.status()?;
        self.inodes_of_entries(parent, &ids)
    }

    /// Absolute path of an inode, built by walking parents.
    pub fn path_of(&self, inode: &Inode) -> Result<String, MasterError> {
        let mut names = Vec::new();
        let mut cur = inode.clone();
        let mut guard = 0;
        while cur.id != ROOT_INODE {
            names.push(cur.name.clone());
            cur = self.inode(cur.parent)?.ok_or_else(|| {
                MasterError::inconsistent(format!("inode {} has no parent", cur.id))
            })?;
            guard += 1;
            if guard > 4096 {
                return Err(MasterError::inconsistent(format!(
                    "the parent chain of inode {} loops",
                    inode.id
                )));
            }
        }
        names.reverse();
        Ok(format!("/{}", names.join("/")))
    }

    pub fn mounts(&self) -> Result<Vec<Mount>, MasterError> {
        let mut it = self.db.raw_iterator_cf(self.cf()?);
        it.seek([keys::MOUNT]);
        let mut out = Vec::new();
        while it.valid() {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            if k.first() != Some(&b'm') {
                break;
            }
            out.push(decode_record(v)?);
            it.next();
        }
        it.status()?;
        Ok(out)
    }

    pub fn mount(&self, id: u64) -> Result<Option<Mount>, MasterError> {
        self.get(&keys::mount(id))?
            .map(|v| decode_record(&v))
            .transpose()
    }

    /// Walks `path` through entries already in the state (no under-store loading).
    pub fn resolve_loaded(&self, path: &str) -> Result<Option<Inode>, MasterError> {
        let mut cur = self
            .inode(ROOT_INODE)?
            .ok_or_else(|| MasterError::inconsistent("the root inode is missing"))?;
        for comp in paths::components(path)? {
            match self.child(cur.id, comp)? {
                Some(c) => cur = c,
                None => return Ok(None),
            }
        }
        Ok(Some(cur))
    }

    /// Applies one committed command at log `index`. Errors are deterministic results (the
    /// command changed nothing); the applied index advances either way.
    pub fn apply(&self, index: u64, cmd: &Command) -> Result<ApplyOutput, MasterError> {
        let mut txn = Txn::new(self);
        let result = txn.apply(cmd);
        if result.as_ref().is_err_and(MasterError::is_local_failure) {
            // This replica could not read its own state: nothing may be recorded as
            // applied, or it would silently diverge from the others.
            return result;
        }
        let mut txn = match result {
            Ok(_) => txn,
            Err(_) => Txn::new(self), // discard partial changes
        };
        let changed = self.watched(&txn);
        txn.put_u64(keys::APPLIED, index);
        txn.commit()?;
        self.announce(index, changed);
        result
    }

    /// The first outcome of request `request_id`, if it was applied (and not forgotten
    /// yet: outcomes are kept for the retention).
    pub fn request_outcome(
        &self,
        request_id: u64,
    ) -> Result<Option<Result<ApplyOutput, MasterError>>, MasterError> {
        if request_id == 0 {
            return Ok(None);
        }
        match self.get(&keys::request(request_id))? {
            Some(v) => Ok(Some(decode_record::<RequestOutcome>(&v)?.result)),
            None => Ok(None),
        }
    }

    /// Applies a proposal: a request id seen before returns its first outcome and changes
    /// nothing, so a client retrying after a leader change never applies twice.
    pub fn apply_request(&self, index: u64, p: &Proposal) -> Result<ApplyOutput, MasterError> {
        if p.request_id == 0 {
            return self.apply(index, &p.cmd);
        }
        if let Some(v) = self.get(&keys::request(p.request_id))? {
            let outcome: RequestOutcome = decode_record(&v)?;
            self.mark_applied(index)?;
            return outcome.result;
        }
        let mut txn = Txn::new(self);
        let result = txn.apply(&p.cmd);
        if result.as_ref().is_err_and(MasterError::is_local_failure) {
            return result; // see `apply`
        }
        let mut txn = match result {
            Ok(_) => txn,
            Err(_) => Txn::new(self),
        };
        let changed = self.watched(&txn);
        let outcome = RequestOutcome {
            at_ms: p.at_ms,
            result: result.clone(),
        };
        txn.put(keys::request(p.request_id), encode_record(&outcome)?);
        txn.put(keys::request_age(p.at_ms, p.request_id), Vec::new());
        self.prune_requests(&mut txn, p.at_ms)?;
        txn.put_u64(keys::APPLIED, index);
        txn.commit()?;
        self.announce(index, changed);
        result
    }

    /// Marks `index` applied without a command (empty entries, conf changes).
    pub fn mark_applied(&self, index: u64) -> Result<(), MasterError> {
        let mut txn = Txn::new(self);
        txn.put_u64(keys::APPLIED, index);
        txn.commit()
    }

    /// Addresses of masters added to the group (`AddMaster`), kept in the state so that a
    /// member that catches up from a snapshot learns them too.
    pub fn member_addresses(&self) -> Result<Vec<(u64, String)>, MasterError> {
        let mut it = self.db.raw_iterator_cf(self.cf()?);
        it.seek(keys::member(0));
        let mut out = Vec::new();
        while it.valid() {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            if k.len() != 9 || k[0] != b'A' {
                break;
            }
            out.push((u64_of(&k[1..])?, String::from_utf8_lossy(v).into_owned()));
            it.next();
        }
        it.status()?;
        Ok(out)
    }

    /// Workers decommissioned (`DecommissionWorker`).
    pub fn decommissioned(&self) -> Result<std::collections::BTreeSet<u64>, MasterError> {
        let mut it = self.db.raw_iterator_cf(self.cf()?);
        it.seek(keys::decommissioned(0));
        let mut out = std::collections::BTreeSet::new();
        while it.valid() {
            let Some(k) = it.key() else {
                break;
            };
            if k.len() != 9 || k[0] != b'D' {
                break;
            }
            out.insert(u64_of(&k[1..])?);
            it.next();
        }
        it.status()?;
        Ok(out)
    }

    /// Adds a member's address to `batch` (written with the configuration change).
    pub fn member_address_into(
        &self,
        id: u64,
        address: &str,
        batch: &mut WriteBatch,
    ) -> Result<(), MasterError> {
        batch.put_cf(self.cf()?, keys::member(id), address.as_bytes());
        Ok(())
    }

    /// Marks `index` applied together with the writes already in `batch` (one atomic,
    /// synced write), e.g. a configuration change of the Raft log.
    pub fn mark_applied_with(&self, index: u64, mut batch: WriteBatch) -> Result<(), MasterError> {
        batch.put_cf(self.cf()?, keys::APPLIED, index.to_be_bytes());
        let mut wo = rocksdb::WriteOptions::default();
        wo.set_sync(true);
        Ok(self.db.write_opt(batch, &wo)?)
    }
}

/// The first key after every key that starts with `prefix` (None: there is none).
fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// A write transaction: reads see its own pending writes.
struct Txn<'a> {
    sm: &'a StateMachine,
    pending: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    /// Owner of the entries the command being applied creates.
    owner: Option<Owner>,
    /// The principal creating the file the command being applied creates.
    creator: Option<String>,
    /// Inodes written with `put_inode`, decoded, for the cache at commit.
    written: BTreeMap<u64, Inode>,
    /// Inodes written with `put_inode_quietly`: not announced to watchers.
    quiet: Vec<u64>,
    /// Key prefixes deleted whole (one range tombstone each, written before `pending`,
    /// which holds only writes made after the deletion).
    deleted_prefixes: Vec<Vec<u8>>,
    /// Whether what the command writes is kept in the state cache at commit (else only
    /// dropped from it): a listing's batch writes thousands of inodes no request asked
    /// for, and keeping them evicted the folders paths resolve through.
    fill_cache: bool,
}

impl<'a> Txn<'a> {
    fn new(sm: &'a StateMachine) -> Self {
        Self {
            sm,
            pending: BTreeMap::new(),
            owner: None,
            creator: None,
            written: BTreeMap::new(),
            quiet: Vec::new(),
            deleted_prefixes: Vec::new(),
            fill_cache: true,
        }
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, MasterError> {
        match self.pending.get(key) {
            Some(v) => Ok(v.clone()),
            None if self.deleted_prefixes.iter().any(|p| key.starts_with(p)) => Ok(None),
            None => self.sm.get(key),
        }
    }

    /// Deletes every record whose key starts with `prefix`, however many there are, as one
    /// range tombstone: a job's million done markers are not read, listed and deleted one
    /// by one inside an apply. Only for records the state cache does not hold (inodes and
    /// folder entries are removed one by one, so the cache follows).
    fn delete_prefix(&mut self, prefix: &[u8]) -> Result<(), MasterError> {
        if prefix.is_empty() || matches!(prefix[0], b'i' | b'c') {
            return Err(MasterError::corrupt(
                "a prefix deletion of cached records was asked for",
            ));
        }
        let gone: Vec<Vec<u8>> = self
            .pending
            .range(prefix.to_vec()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.pending.remove(&k);
        }
        self.deleted_prefixes.push(prefix.to_vec());
        Ok(())
    }

    fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.forget_written(&key);
        self.pending.insert(key, Some(value));
    }

    fn delete(&mut self, key: Vec<u8>) {
        self.forget_written(&key);
        self.pending.insert(key, None);
    }

    /// A raw write of an inode record replaces what `put_inode` decoded for it.
    fn forget_written(&mut self, key: &[u8]) {
        if let Some(id) = keys::inode_id_of(key) {
            self.written.remove(&id);
        }
    }

    fn put_u64(&mut self, key: &[u8], v: u64) {
        self.put(key.to_vec(), v.to_be_bytes().to_vec());
    }

    fn get_u64(&self, key: &[u8]) -> Result<u64, MasterError> {
        match self.get(key)? {
            Some(v) => u64_of(&v),
            None => Ok(0),
        }
    }

    /// Inodes whose record (or pin, or TTL: both shown in its status) this transaction
    /// writes or removes, and folders whose entries it changes (sorted, once each). A pin
    /// of a folder changes what its files show too; their cached statuses keep the old
    /// count until they are fetched again.
    fn changed_inodes(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .pending
            .keys()
            .filter(|k| match k.first() {
                Some(&(keys::INODE | keys::PIN | keys::TTL)) => k.len() == 9,
                Some(&keys::CHILD) => k.len() > 9,
                _ => false,
            })
            .filter_map(|k| {
                let id = u64::from_be_bytes(k[1..9].try_into().ok()?);
                let quiet = k[0] == keys::INODE && self.quiet.contains(&id);
                (!quiet).then_some(id)
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    fn commit(mut self) -> Result<(), MasterError> {
        let cf = self.sm.cf()?;
        let mut batch = WriteBatch::default();
        for prefix in &self.deleted_prefixes {
            match prefix_end(prefix) {
                Some(end) => batch.delete_range_cf(cf, prefix.as_slice(), end.as_slice()),
                None => return Err(MasterError::corrupt("a prefix of 0xff bytes")),
            }
        }
        let mut cached = cache::Written::default();
        for (k, v) in self.pending {
            if let Some(id) = keys::inode_id_of(&k) {
                // Written by `put_inode` (decoded at hand), or raw: then forgotten.
                let inode = v
                    .as_ref()
                    .filter(|_| self.fill_cache)
                    .and_then(|_| self.written.remove(&id));
                cached.inodes.push((id, inode));
            } else if k.len() > 9 && k[0] == b'c' {
                // A value that is not an id is written as before, and not cached.
                let id = v
                    .as_deref()
                    .filter(|_| self.fill_cache)
                    .and_then(|v| u64_of(v).ok());
                cached.entries.push((k.clone(), id));
            }
            match v {
                Some(v) => batch.put_cf(cf, k, v),
                None => batch.delete_cf(cf, k),
            }
        }
        self.sm.db.write(batch)?;
        self.sm.cache.committed(cached);
        Ok(())
    }

    fn inode(&self, id: u64) -> Result<Option<Inode>, MasterError> {
        // `written` holds only inodes whose pending record is the one `put_inode` wrote.
        if let Some(inode) = self.written.get(&id) {
            return Ok(Some(inode.clone()));
        }
        match self.pending.get(&keys::inode(id)) {
            Some(v) => v.as_deref().map(decode_record).transpose(),
            None => self.sm.inode(id),
        }
    }

    fn put_inode(&mut self, inode: &Inode) -> Result<(), MasterError> {
        let v = encode_record(inode)?;
        self.put(keys::inode(inode.id), v);
        self.written.insert(inode.id, inode.clone());
        Ok(())
    }

    /// [`Txn::put_inode`] of a change no watcher needs to hear of (its entries' statuses
    /// and names are as they were).
    fn put_inode_quietly(&mut self, inode: &Inode) -> Result<(), MasterError> {
        self.quiet.push(inode.id);
        self.put_inode(inode)
    }

    fn child(&self, parent: u64, name: &str) -> Result<Option<Inode>, MasterError> {
        let key = keys::child(parent, name);
        let id = match self.pending.get(&key) {
            Some(v) => v.as_deref().map(u64_of).transpose()?,
            None => self.sm.child_id(&key)?,
        };
        match id {
            Some(id) => self.inode(id),
            None => Ok(None),
        }
    }

    /// Child ids of `parent`, merging the store with pending writes.
    fn child_ids(&self, parent: u64) -> Result<Vec<u64>, MasterError> {
        let prefix = keys::children(parent);
        let mut merged: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        let mut it = self.sm.db.raw_iterator_cf(self.sm.cf()?);
        it.seek(&prefix);
        while it.valid() {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            if !k.starts_with(&prefix) {
                break;
            }
            merged.insert(k.to_vec(), Some(v.to_vec()));
            it.next();
        }
        it.status()?;
        for (k, v) in self.pending.range(prefix.clone()..) {
            if !k.starts_with(&prefix) {
                break;
            }
            merged.insert(k.clone(), v.clone());
        }
        merged.into_values().flatten().map(|v| u64_of(&v)).collect()
    }

    /// Whether `parent` has a child, with this command's changes: what `child_ids` says
    /// is not empty, without reading a folder of a million names into memory (an `rmdir`
    /// of such a folder is refused on every master at the cost of one name).
    fn has_children(&self, parent: u64) -> Result<bool, MasterError> {
        let prefix = keys::children(parent);
        let mut pending = self.pending.range(prefix.clone()..);
        if pending
            .by_ref()
            .take_while(|(k, _)| k.starts_with(&prefix))
            .any(|(_, v)| v.is_some())
        {
            return Ok(true);
        }
        let mut it = self.sm.db.raw_iterator_cf(self.sm.cf()?);
        it.seek(&prefix);
        while it.valid() {
            let Some(k) = it.key() else {
                break;
            };
            if !k.starts_with(&prefix) {
                break;
            }
            // A stored name this command did not delete (one it wrote was found above).
            if !self.pending.contains_key(k) {
                return Ok(true);
            }
            it.next();
        }
        it.status()?;
        Ok(false)
    }

    fn alloc_inode(&mut self) -> Result<u64, MasterError> {
        let id = self.get_u64(keys::NEXT_INODE)?.max(ROOT_INODE + 1);
        self.put_u64(keys::NEXT_INODE, id + 1);
        let count = self.get_u64(keys::INODE_COUNT)?;
        self.put_u64(keys::INODE_COUNT, count + 1);
        Ok(id)
    }

    fn link(&mut self, inode: &Inode) -> Result<(), MasterError> {
        self.put_inode(inode)?;
        self.put(
            keys::child(inode.parent, &inode.name),
            inode.id.to_be_bytes().to_vec(),
        );
        Ok(())
    }

    fn mounts(&self) -> Result<Vec<Mount>, MasterError> {
        // Mount changes are never batched with other mount changes, so the store is current.
        self.sm.mounts()
    }

    /// Refuses to delete or move `path` when it is a mount point or holds one: the mount
    /// record names its path, and a record naming no inode (or the wrong one) would be
    /// left behind.
    fn refuse_if_holds_mount(&self, path: &str) -> Result<(), MasterError> {
        match self
            .mounts()?
            .into_iter()
            .find(|m| paths::is_within(&m.path, path))
        {
            Some(m) => Err(MasterError::Busy {
                path: path.to_string(),
                mount: m.path,
            }),
            None => Ok(()),
        }
    }

    fn root(&self) -> Result<Inode, MasterError> {
        self.inode(ROOT_INODE)?
            .ok_or_else(|| MasterError::inconsistent("the root inode is missing"))
    }

    /// Resolves `path` to an existing inode.
    fn resolve(&self, path: &str) -> Result<Inode, MasterError> {
        let mut cur = self.root()?;
        for comp in paths::components(path)? {
            if cur.kind != Kind::Directory {
                return Err(MasterError::NotADirectory {
                    path: path.to_string(),
                });
            }
            cur = self
                .child(cur.id, comp)?
                .ok_or_else(|| MasterError::not_found(path))?;
        }
        Ok(cur)
    }

    /// A new directory under `parent`; inside a mount it belongs to the mount (made here,
    /// so kept while the under-store shows nothing under it).
    fn new_dir(
        &mut self,
        parent: &Inode,
        name: &str,
        mode: u32,
        now_ms: i64,
    ) -> Result<Inode, MasterError> {
        let mut inode = Inode::directory(self.alloc_inode()?, parent.id, name, mode, now_ms);
        inode.owner = self.owner;
        if let Some(m) = parent.mount_id {
            inode.mount_id = Some(m);
            inode.ufs_path = child_ufs_path(parent, name);
            inode.created = true;
        }
        self.link(&inode)?;
        Ok(inode)
    }

    /// Creates every missing directory of `comps`; returns the last one.
    fn mkdirs(&mut self, comps: &[&str], mode: u32, now_ms: i64) -> Result<Inode, MasterError> {
        let mut cur = self.root()?;
        let mut walked = String::new();
        for comp in comps {
            walked = paths::join(if walked.is_empty() { "/" } else { &walked }, comp);
            cur = match self.child(cur.id, comp)? {
                Some(c) if c.kind == Kind::Directory => c,
                Some(_) => return Err(MasterError::NotADirectory { path: walked }),
                None => self.new_dir(&cur, comp, mode, now_ms)?,
            };
        }
        Ok(cur)
    }

    /// Removes `inode` and everything below it.
    fn remove_subtree(&mut self, inode: &Inode, unlink: bool) -> Result<(), MasterError> {
        let mut stack = vec![inode.id];
        let mut removed = 0u64;
        while let Some(id) = stack.pop() {
            for child in self.child_ids(id)? {
                stack.push(child);
            }
            if let Some(node) = self.inode(id)? {
                self.delete(keys::child(node.parent, &node.name));
            }
            if id != inode.id || unlink {
                self.delete(keys::inode(id));
                self.drop_pin(id);
                self.drop_ttl(id);
                removed += 1;
            }
        }
        if !unlink {
            // Keep the inode itself but drop its link-free children keys above.
            self.put_inode(inode)?;
            if inode.id != ROOT_INODE {
                self.put(
                    keys::child(inode.parent, &inode.name),
                    inode.id.to_be_bytes().to_vec(),
                );
            }
        }
        let count = self.get_u64(keys::INODE_COUNT)?;
        self.put_u64(keys::INODE_COUNT, count.saturating_sub(removed));
        Ok(())
    }

    /// Marks worker `id` decommissioned (no new blocks go to it), or not.
    fn decommission(&mut self, id: u64, decommissioned: bool) -> Result<ApplyOutput, MasterError> {
        match decommissioned {
            true => self.put(keys::decommissioned(id), Vec::new()),
            false => self.delete(keys::decommissioned(id)),
        }
        Ok(ApplyOutput::None)
    }

    fn apply(&mut self, cmd: &Command) -> Result<ApplyOutput, MasterError> {
        if matches!(cmd, Command::SyncDir { .. } | Command::LoadDir { .. }) {
            self.fill_cache = false;
        }
        match cmd {
            Command::AddMount { path, spec, now_ms } => self.add_mount(path, spec, *now_ms),
            Command::RemoveMount { path } => self.remove_mount(path),
            Command::SetTtl { path, ttl } => Ok(ApplyOutput::Inode(self.set_ttl(path, *ttl)?)),
            Command::EndTtl { inode, was } => {
                self.end_ttl(*inode, was)?;
                Ok(ApplyOutput::None)
            }
            Command::SetPin { path, replicas } => {
                Ok(ApplyOutput::Inode(self.set_pin(path, *replicas)?))
            }
            Command::CreateJob {
                kind,
                path,
                replicas,
                now_ms,
            } => Ok(ApplyOutput::Job(
                self.create_job(kind, path, *replicas, *now_ms)?,
            )),
            Command::JobPlanned {
                id,
                total_files,
                total_bytes,
            } => Ok(ApplyOutput::Job(self.job_planned(
                *id,
                *total_files,
                *total_bytes,
            )?)),
            Command::JobProgress {
                id,
                done,
                failed,
                fetched_bytes,
            } => Ok(ApplyOutput::Job(self.job_progress(
                *id,
                done,
                failed,
                *fetched_bytes,
            )?)),
            Command::FinishJob {
                id,
                state,
                error,
                now_ms,
            } => Ok(ApplyOutput::Job(
                self.finish_job(*id, *state, error, *now_ms)?,
            )),
            Command::DecommissionWorker { worker_id } => self.decommission(*worker_id, true),
            Command::RecommissionWorker { worker_id } => self.decommission(*worker_id, false),
            Command::UseFormat { version } => self.use_format(*version),
            Command::LoadDir {
                dir,
                mount_id,
                entries,
                now_ms,
                block_size,
            } => self.load_dir(*dir, *mount_id, entries, *now_ms, *block_size),
            Command::SyncDir {
                dir,
                mount_id,
                entries,
                now_ms,
                block_size,
                seen,
                batch,
            } => match batch {
                None => self.sync_dir(
                    *dir,
                    *mount_id,
                    entries,
                    *now_ms,
                    *block_size,
                    seen.as_ref(),
                ),
                Some(b) => self.sync_batch(
                    *dir,
                    *mount_id,
                    entries,
                    b,
                    *now_ms,
                    *block_size,
                    seen.as_ref(),
                ),
            },
            Command::AddUfsChild {
                dir,
                mount_id,
                entry,
                now_ms,
                block_size,
            } => self.add_probed_child(*dir, *mount_id, entry, *now_ms, *block_size),
            Command::RefreshFile {
                inode,
                fingerprint,
                seen_version,
            } => self.refresh_file(*inode, fingerprint, *seen_version),
            Command::Mkdir {
                path,
                recursive,
                mode,
                now_ms,
                owner,
            } => {
                self.owner = *owner;
                self.mkdir(path, *recursive, *mode, *now_ms)
            }
            Command::CreateFile {
                path,
                mode,
                block_size,
                now_ms,
                overwrite,
                owner,
                creator,
            } => {
                self.owner = *owner;
                self.creator = creator.clone();
                self.create_file(path, *mode, *block_size, *now_ms, *overwrite)
            }
            Command::CompleteFile {
                inode,
                length,
                fingerprint,
                now_ms,
                version,
                persist,
                persist_worker,
            } => self.complete_file(
                *inode,
                *length,
                fingerprint.clone(),
                *now_ms,
                (*version, *persist, *persist_worker),
            ),
            Command::FilePersisted {
                inode,
                version,
                fingerprint,
                ufs_path,
            } => self.file_persisted(*inode, *version, fingerprint, ufs_path),
            Command::Delete { path, recursive } => self.delete_path(path, *recursive),
            Command::Rename { src, dst, now_ms } => self.rename(src, dst, *now_ms),
        }
    }

    fn add_mount(
        &mut self,
        path: &str,
        spec: &granary_common::ufs::UfsSpec,
        now_ms: i64,
    ) -> Result<ApplyOutput, MasterError> {
        let path = paths::normalize(path)?;
        for m in self.mounts()? {
            if m.path == path {
                return Err(MasterError::AlreadyExists {
                    path: format!("{path} (already a mount point of {})", m.spec.uri),
                });
            }
            if paths::is_within(&path, &m.path) || paths::is_within(&m.path, &path) {
                return Err(MasterError::precondition(format!(
                    "nested mount points are not allowed: {path} overlaps the mount at {}",
                    m.path
                )));
            }
        }
        let comps = paths::components(&path)?;
        let mut target = match comps.split_last() {
            None => self.root()?,
            Some((last, parents)) => {
                let parent = self.mkdirs(parents, DEFAULT_DIR_MODE, now_ms)?;
                match self.child(parent.id, last)? {
                    Some(existing) if existing.kind != Kind::Directory => {
                        return Err(MasterError::AlreadyExists {
                            path: format!("{path} (a file)"),
                        })
                    }
                    Some(existing) => existing,
                    None => self.new_dir(&parent, last, DEFAULT_DIR_MODE, now_ms)?,
                }
            }
        };
        if self.has_children(target.id)? {
            return Err(MasterError::precondition(format!(
                "cannot mount on {path}: the directory is not empty"
            )));
        }
        let id = self.get_u64(keys::NEXT_MOUNT)?.max(1);
        self.put_u64(keys::NEXT_MOUNT, id + 1);
        target.mount_id = Some(id);
        target.ufs_path = String::new();
        target.is_mount_point = true;
        target.children_loaded = false;
        target.mtime_ms = now_ms;
        self.put_inode(&target)?;
        let mount = Mount {
            id,
            path,
            inode: target.id,
            spec: spec.clone(),
        };
        let v = encode_record(&mount)?;
        self.put(keys::mount(id), v);
        Ok(ApplyOutput::Mount(mount))
    }

    fn remove_mount(&mut self, path: &str) -> Result<ApplyOutput, MasterError> {
        let path = paths::normalize(path)?;
        let mount = self
            .mounts()?
            .into_iter()
            .find(|m| m.path == path)
            .ok_or_else(|| MasterError::NotFound {
                path: format!("{path} (no mount there)"),
            })?;
        // A mount whose inode is gone or no longer its mount point (state left by an older
        // version that let a folder above it be deleted or renamed): only the record goes.
        let inode = match self.inode(mount.inode)? {
            Some(i) if i.is_mount_point && i.mount_id == Some(mount.id) => i,
            _ => {
                self.delete(keys::mount(mount.id));
                return Ok(ApplyOutput::Mount(mount));
            }
        };
        if inode.id == ROOT_INODE {
            let mut root = inode.clone();
            root.mount_id = None;
            root.is_mount_point = false;
            root.children_loaded = true;
            self.remove_subtree(&root, false)?;
        } else {
            self.remove_subtree(&inode, true)?;
        }
        self.delete(keys::mount(mount.id));
        Ok(ApplyOutput::Mount(mount))
    }

    fn mkdir(
        &mut self,
        path: &str,
        recursive: bool,
        mode: u32,
        now_ms: i64,
    ) -> Result<ApplyOutput, MasterError> {
        let path = paths::normalize(path)?;
        let comps = paths::components(&path)?;
        let Some((last, parents)) = comps.split_last() else {
            return if recursive {
                Ok(ApplyOutput::Inode(self.root()?))
            } else {
                Err(MasterError::AlreadyExists { path })
            };
        };
        let mode = if mode == 0 {
            DEFAULT_DIR_MODE
        } else {
            mode & 0o7777
        };
        let parent = if recursive {
            self.mkdirs(parents, mode, now_ms)?
        } else {
            let parent_path = format!("/{}", parents.join("/"));
            let p = self.resolve(&parent_path)?;
            if p.kind != Kind::Directory {
                return Err(MasterError::NotADirectory { path: parent_path });
            }
            p
        };
        match self.child(parent.id, last)? {
            Some(c) if recursive && c.kind == Kind::Directory => Ok(ApplyOutput::Inode(c)),
            Some(_) => Err(MasterError::AlreadyExists { path }),
            None => Ok(ApplyOutput::Inode(
                self.new_dir(&parent, last, mode, now_ms)?,
            )),
        }
    }

    fn create_file(
        &mut self,
        path: &str,
        mode: u32,
        block_size: u64,
        now_ms: i64,
        overwrite: bool,
    ) -> Result<ApplyOutput, MasterError> {
        let path = paths::normalize(path)?;
        let comps = paths::components(&path)?;
        let Some((last, parents)) = comps.split_last() else {
            return Err(MasterError::AlreadyExists { path });
        };
        let parent_path = format!("/{}", parents.join("/"));
        let parent = self.resolve(&parent_path)?;
        if parent.kind != Kind::Directory {
            return Err(MasterError::NotADirectory { path: parent_path });
        }
        let mode = if mode == 0 {
            DEFAULT_FILE_MODE
        } else {
            mode & 0o7777
        };
        if let Some(mut old) = self.child(parent.id, last)? {
            if !overwrite {
                return Err(MasterError::AlreadyExists { path });
            }
            if old.kind != Kind::File {
                return Err(MasterError::IsADirectory { path });
            }
            // Same inode (an open file handle keeps naming it), a new version.
            old.version = write_version(old.id, old.version, now_ms);
            old.length = 0;
            old.mtime_ms = now_ms;
            old.complete = false;
            old.created = true;
            old.persist = Persist::Persisted;
            old.persist_worker = 0;
            old.creator = self.creator.clone();
            self.put_inode(&old)?;
            return Ok(ApplyOutput::Inode(old));
        }
        let id = self.alloc_inode()?;
        let inode = Inode {
            id,
            parent: parent.id,
            name: last.to_string(),
            kind: Kind::File,
            mode,
            mtime_ms: now_ms,
            length: 0,
            block_size: if block_size == 0 {
                granary_common::DEFAULT_BLOCK_SIZE
            } else {
                block_size
            },
            fingerprint: None,
            version: write_version(id, 0, now_ms),
            mount_id: parent.mount_id,
            ufs_path: if parent.mount_id.is_some() {
                child_ufs_path(&parent, last)
            } else {
                String::new()
            },
            is_mount_point: false,
            children_loaded: true,
            complete: false,
            persist: Persist::Persisted,
            persist_worker: 0,
            created: true,
            owner: self.owner,
            creator: self.creator.clone(),
            listed_ms: 0,
        };
        self.link(&inode)?;
        Ok(ApplyOutput::Inode(inode))
    }

    fn complete_file(
        &mut self,
        id: u64,
        length: u64,
        fp: Option<Fingerprint>,
        now_ms: i64,
        (version, persist, persist_worker): (Option<u64>, Persist, u64),
    ) -> Result<ApplyOutput, MasterError> {
        let mut inode = self
            .inode(id)?
            .ok_or_else(|| MasterError::not_found(format!("inode {id}")))?;
        if inode.kind != Kind::File {
            return Err(MasterError::invalid(format!("inode {id} is not a file")));
        }
        if version.is_some_and(|v| v != inode.version) {
            return Err(MasterError::precondition(format!(
                "{} was replaced while it was being written",
                inode.name
            )));
        }
        if inode.complete {
            return Err(MasterError::precondition(format!(
                "inode {id} is already complete"
            )));
        }
        inode.length = length;
        inode.mtime_ms = now_ms;
        if let Some(fp) = fp {
            if version.is_none() {
                inode.version = version_of(&fp.to_proto());
            }
            inode.fingerprint = Some(fp);
        } else if version.is_some() {
            inode.fingerprint = None;
        }
        // A file outside any mount has nowhere to be persisted.
        inode.persist = if inode.mount_id.is_none() && persist == Persist::Persisted {
            Persist::NotPersisted
        } else {
            persist
        };
        inode.persist_worker = if persist != Persist::Persisted {
            persist_worker
        } else {
            0
        };
        inode.complete = true;
        inode.creator = None;
        self.put_inode(&inode)?;
        Ok(ApplyOutput::Inode(inode))
    }

    fn file_persisted(
        &mut self,
        id: u64,
        version: u64,
        fp: &Fingerprint,
        ufs_path: &str,
    ) -> Result<ApplyOutput, MasterError> {
        let Some(mut inode) = self.inode(id)? else {
            return Ok(ApplyOutput::None);
        };
        if inode.kind != Kind::File
            || inode.version != version
            || !inode.complete
            || inode.persist != Persist::Pending
            || inode.ufs_path != ufs_path
        {
            return Ok(ApplyOutput::None);
        }
        inode.fingerprint = Some(fp.clone());
        inode.persist = Persist::Persisted;
        inode.persist_worker = 0;
        self.put_inode(&inode)?;
        Ok(ApplyOutput::Inode(inode))
    }

    fn delete_path(&mut self, path: &str, recursive: bool) -> Result<ApplyOutput, MasterError> {
        let path = paths::normalize(path)?;
        if path == "/" {
            return Err(MasterError::invalid("the root directory cannot be deleted"));
        }
        let inode = self.resolve(&path)?;
        self.refuse_if_holds_mount(&path)?;
        if inode.kind == Kind::Directory && !recursive && self.has_children(inode.id)? {
            return Err(MasterError::NotEmpty { path });
        }
        self.remove_subtree(&inode, true)?;
        Ok(ApplyOutput::Inode(inode))
    }

    fn rename(&mut self, src: &str, dst: &str, now_ms: i64) -> Result<ApplyOutput, MasterError> {
        // Files may move into or out of a pinned folder (see `StateMachine::moves`).
        self.sm
            .moves
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let src = paths::normalize(src)?;
        let dst = paths::normalize(dst)?;
        if src == "/" || dst == "/" {
            return Err(MasterError::invalid("the root directory cannot be renamed"));
        }
        if paths::is_within(&dst, &src) {
            return Err(MasterError::invalid(format!(
                "cannot move {src} into itself ({dst})"
            )));
        }
        let mut inode = self.resolve(&src)?;
        self.refuse_if_holds_mount(&src)?;
        let dcomps = paths::components(&dst)?;
        let Some((last, parents)) = dcomps.split_last() else {
            return Err(MasterError::invalid("bad destination"));
        };
        let parent_path = format!("/{}", parents.join("/"));
        let parent = self.resolve(&parent_path)?;
        if parent.kind != Kind::Directory {
            return Err(MasterError::NotADirectory { path: parent_path });
        }
        if parent.mount_id != inode.mount_id {
            return Err(MasterError::CrossMount { src, dst });
        }
        if inode.kind == Kind::Directory && dst.len() > src.len() {
            self.refuse_paths_too_long(&inode, &src, &dst)?;
        }
        if let Some(existing) = self.child(parent.id, last)? {
            // POSIX rename: a file replaces a file, a directory an empty directory.
            match (inode.kind, existing.kind) {
                _ if existing.id == inode.id => return Ok(ApplyOutput::Inode(inode)),
                (Kind::File, Kind::File) => {}
                (Kind::Directory, Kind::Directory) if existing.is_mount_point => {
                    return Err(MasterError::Busy {
                        path: dst.clone(),
                        mount: dst,
                    })
                }
                (Kind::Directory, Kind::Directory) if !self.has_children(existing.id)? => {}
                (Kind::Directory, Kind::Directory) => {
                    return Err(MasterError::NotEmpty { path: dst })
                }
                (Kind::File, Kind::Directory) => {
                    return Err(MasterError::IsADirectory { path: dst })
                }
                (Kind::Directory, Kind::File) => {
                    return Err(MasterError::NotADirectory { path: dst })
                }
            }
            self.remove_subtree(&existing, true)?;
        }
        self.delete(keys::child(inode.parent, &inode.name));
        inode.parent = parent.id;
        inode.name = last.to_string();
        inode.mtime_ms = now_ms;
        if inode.mount_id.is_some() {
            inode.ufs_path = child_ufs_path(&parent, last);
            inode.created = true;
        }
        self.link(&inode)?;
        if inode.kind == Kind::Directory && inode.mount_id.is_some() {
            self.rebase_ufs_paths(&inode)?;
        }
        Ok(ApplyOutput::Inode(inode))
    }

    /// Refuses moving directory `dir` from `src` to the longer `dst` when a path below it
    /// would then pass `MAX_PATH_LEN`: such entries could no longer be named (their
    /// parent chains outgrow every walk), and renames that each deepen a tree made every
    /// later one rewrite ever longer store paths in one apply on every master.
    fn refuse_paths_too_long(&self, dir: &Inode, src: &str, dst: &str) -> Result<(), MasterError> {
        let mut stack = vec![(dir.id, dst.len())];
        while let Some((id, len)) = stack.pop() {
            for cid in self.child_ids(id)? {
                let Some(c) = self.inode(cid)? else {
                    continue;
                };
                let below = len + 1 + c.name.len();
                if below > paths::MAX_PATH_LEN {
                    return Err(MasterError::invalid(format!(
                        "moving {} to {} would make paths below it longer than {} bytes",
                        paths::shown(src),
                        paths::shown(dst),
                        paths::MAX_PATH_LEN
                    )));
                }
                if c.kind == Kind::Directory {
                    stack.push((c.id, below));
                }
            }
        }
        Ok(())
    }

    /// After a directory of a mount moved: every entry below takes its new store path.
    fn rebase_ufs_paths(&mut self, dir: &Inode) -> Result<(), MasterError> {
        let mut stack = vec![dir.clone()];
        while let Some(d) = stack.pop() {
            for id in self.child_ids(d.id)? {
                let Some(mut c) = self.inode(id)? else {
                    continue;
                };
                c.ufs_path = child_ufs_path(&d, &c.name);
                self.put_inode(&c)?;
                if c.kind == Kind::Directory {
                    stack.push(c);
                }
            }
        }
        Ok(())
    }
}

/// The store path of `name` inside directory `dir` of a mount.
fn child_ufs_path(dir: &Inode, name: &str) -> String {
    if dir.ufs_path.is_empty() {
        name.to_string()
    } else {
        format!("{}/{}", dir.ufs_path, name)
    }
}

/// The version of a file written through Granary: unique per write (inode, the version it
/// replaces, the proposer's clock), fixed at create so pages are cached while it is written.
fn write_version(inode: u64, previous: u64, now_ms: i64) -> u64 {
    granary_common::ids::stable_hash(&[
        b"granary-write",
        &inode.to_le_bytes(),
        &previous.to_le_bytes(),
        &now_ms.to_le_bytes(),
    ])
}

/// Converts a stored inode to its wire form.
pub fn to_status(inode: &Inode, path: String) -> pb::FileStatus {
    pb::FileStatus {
        inode: inode.id,
        parent: inode.parent,
        name: inode.name.clone(),
        path,
        kind: match inode.kind {
            Kind::File => pb::FileKind::File as i32,
            Kind::Directory => pb::FileKind::Directory as i32,
        },
        length: inode.length,
        block_size: inode.block_size,
        mode: inode.mode,
        mtime_ms: inode.mtime_ms,
        fingerprint: inode.fingerprint.as_ref().map(Fingerprint::to_proto),
        ufs: inode.mount_id.map(|m| pb::UfsLocation {
            mount_id: m,
            path: inode.ufs_path.clone(),
        }),
        is_mount_point: inode.is_mount_point,
        complete: inode.complete,
        version: inode.version,
        persist_state: inode.persist.to_proto() as i32,
        persist_worker: inode.persist_worker,
        uid: inode.owner.map_or(0, |o| o.uid),
        gid: inode.owner.map_or(0, |o| o.gid),
        has_owner: inode.owner.is_some(),
        ..Default::default()
    }
}

#[cfg(test)]
mod adversarial;
#[cfg(test)]
mod proptests;
#[cfg(test)]
pub(crate) mod tests;
