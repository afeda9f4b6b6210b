//! The stored form of the state: records and Raft entries as the prost messages of
//! `proto/granary/state/v1/state.proto` (format version 1; decision 40 in
//! docs/architecture.md).
//!
//! - A record is its message, bare. The store says its format in the record `Mformat`; a
//!   store without one holds the JSON records of the releases before format 1, which
//!   [`StateMachine::upgrade_format`] rewrites once, when the master opens it or installs a
//!   snapshot made by such a release.
//! - A Raft entry is one byte, the format version, then a `Proposal`. Entries proposed by a
//!   release before format 1 are JSON and begin with `{`: they stay readable, because such
//!   a leader may still be proposing while the group is upgraded one master at a time. Any
//!   other entry stops the master (see `raft::node::undecodable`).
//!
//! Decoding checks what the message format cannot: enum values this version knows, and
//! the fields a record must have. A record that fails is reported as corrupt with the
//! record's kind, never read as something else.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use granary_proto::prost::Message;
use granary_proto::state::v1 as pb;
use rocksdb::WriteBatch;

use super::jobs::{FailedFile, Job};
use super::pins::Pin;
use super::ttl::Ttl;
use super::{keys, ApplyOutput, Command, Inode, Mount, Proposal, RequestOutcome, StateMachine};
use crate::error::MasterError;

/// The format this version writes.
pub const FORMAT_VERSION: u8 = 1;

/// Records rewritten per write while a JSON store is upgraded.
const UPGRADE_BATCH: usize = 10_000;

/// The format this master proposes Raft entries in, shared by its state machine and its
/// Raft handle: JSON (0) until the group records that every voter reads format 1
/// ([`Command::UseFormat`], proposed by the leader once every member says so). An older
/// master in the group would stop at the first entry it cannot read; the rolling upgrade
/// of a group never meets one.
#[derive(Clone, Debug, Default)]
pub struct EntryFormat(Arc<EntryFormatState>);

#[derive(Debug, Default)]
struct EntryFormatState {
    version: AtomicU8,
    /// A leader's check of the members' formats is under way.
    checking: AtomicBool,
}

impl EntryFormat {
    pub fn version(&self) -> u8 {
        self.0.version.load(Ordering::Acquire)
    }

    /// A Raft entry's data for this proposal, in the format in use.
    pub fn encode(
        &self,
        request_id: u64,
        at_ms: i64,
        cmd: &Command,
    ) -> Result<Vec<u8>, MasterError> {
        if self.version() >= FORMAT_VERSION {
            return Ok(Proposal::encode_of(request_id, at_ms, cmd));
        }
        #[derive(serde::Serialize)]
        struct Json<'a> {
            request_id: u64,
            at_ms: i64,
            cmd: &'a Command,
        }
        let p = Json {
            request_id,
            at_ms,
            cmd,
        };
        serde_json::to_vec(&p).map_err(|e| MasterError::corrupt(format!("encoding a command: {e}")))
    }

    /// Starts a check of the members' formats unless one is under way (false then).
    pub fn start_check(&self) -> bool {
        !self.0.checking.swap(true, Ordering::AcqRel)
    }

    pub fn check_done(&self) {
        self.0.checking.store(false, Ordering::Release);
    }
}

/// A record of the `state` column family.
pub trait Record: Sized {
    /// What the record holds, for errors ("inode", "job").
    const WHAT: &'static str;
    fn encode(&self) -> Vec<u8>;
    fn decode(bytes: &[u8]) -> Result<Self, MasterError>;
}

fn corrupt(what: &str, why: impl std::fmt::Display) -> MasterError {
    MasterError::corrupt(format!("decoding a stored {what}: {why}"))
}

/// Implements [`Record`] for a state type through its message and conversions.
macro_rules! record {
    ($ty:ty, $msg:ty, $what:literal) => {
        impl Record for $ty {
            const WHAT: &'static str = $what;
            fn encode(&self) -> Vec<u8> {
                <$msg>::from(self).encode_to_vec()
            }
            fn decode(bytes: &[u8]) -> Result<Self, MasterError> {
                let m = <$msg>::decode(bytes).map_err(|e| corrupt($what, e))?;
                Self::try_from(m).map_err(|why| corrupt($what, why))
            }
        }
    };
}

record!(Inode, pb::Inode, "inode");
record!(Mount, pb::Mount, "mount");
record!(Job, pb::Job, "job");
record!(FailedFile, pb::FailedFile, "failed file of a job");
record!(Pin, pb::Pin, "pin");
record!(Ttl, pb::Ttl, "TTL");
record!(RequestOutcome, pb::RequestOutcome, "request outcome");

// ----- snapshots for a group of several releases

/// Whether a snapshot of this store is written as JSON: while its Raft entries are (a
/// member may run a release before format 1).
pub fn snapshot_in_json(db: &rocksdb::DB, cf: &rocksdb::ColumnFamily) -> Result<bool, MasterError> {
    let entries = match db.get_cf(cf, keys::ENTRY_FORMAT)? {
        Some(v) => super::u64_of(&v)?,
        None => 0,
    };
    Ok(entries < u64::from(FORMAT_VERSION))
}

/// A record as a snapshot carries it: as stored, or in `json` the JSON of the releases
/// before format 1 (and no `Mformat`, so that a master of this release that installs it
/// upgrades it again). None: left out.
pub fn snapshot_value<'a>(
    key: &[u8],
    value: &'a [u8],
    json: bool,
) -> Result<Option<std::borrow::Cow<'a, [u8]>>, MasterError> {
    struct ToJson;
    impl Rewrite for ToJson {
        fn rewrite<T: Stored>(&self, v: &[u8]) -> Result<Vec<u8>, MasterError> {
            serde_json::to_vec(&T::decode(v)?)
                .map_err(|e| MasterError::corrupt(format!("encoding a {} as JSON: {e}", T::WHAT)))
        }
    }
    use std::borrow::Cow;
    if !json {
        return Ok(Some(Cow::Borrowed(value)));
    }
    if key == keys::FORMAT {
        return Ok(None);
    }
    Ok(Some(match keys::message_of(key) {
        Some(kind) => Cow::Owned(rewrite(kind, value, &ToJson)?),
        None => Cow::Borrowed(value),
    }))
}

/// A record type of the store, with the JSON of the releases before format 1.
trait Stored: Record + serde::Serialize + serde::de::DeserializeOwned {}
impl<T: Record + serde::Serialize + serde::de::DeserializeOwned> Stored for T {}

/// A change of a record's encoding, whatever its type.
trait Rewrite {
    fn rewrite<T: Stored>(&self, value: &[u8]) -> Result<Vec<u8>, MasterError>;
}

/// `how` applied to a record holding a message of `kind`.
fn rewrite(kind: keys::Message, value: &[u8], how: &impl Rewrite) -> Result<Vec<u8>, MasterError> {
    use keys::Message as M;
    match kind {
        M::Inode => how.rewrite::<Inode>(value),
        M::Mount => how.rewrite::<Mount>(value),
        M::RequestOutcome => how.rewrite::<RequestOutcome>(value),
        M::Job => how.rewrite::<Job>(value),
        M::FailedFile => how.rewrite::<FailedFile>(value),
        M::Pin => how.rewrite::<Pin>(value),
        M::Ttl => how.rewrite::<Ttl>(value),
    }
}

// ----- the upgrade of a JSON store

/// A JSON record of the releases before format 1, in format 1; None: not a JSON record
/// (a record that is binary already, or was never JSON: counters, folder entries, marks).
fn upgraded(key: &[u8], value: &[u8]) -> Result<Option<Vec<u8>>, MasterError> {
    struct FromJson;
    impl Rewrite for FromJson {
        fn rewrite<T: Stored>(&self, v: &[u8]) -> Result<Vec<u8>, MasterError> {
            let r: T = serde_json::from_slice(v).map_err(|e| corrupt(T::WHAT, e))?;
            Ok(r.encode())
        }
    }
    if value.first() != Some(&b'{') {
        // A prost message never begins with `{` (field 15 as a group, which it never
        // writes): an upgrade stopped part-way leaves these, and they are done.
        return Ok(None);
    }
    keys::message_of(key)
        .map(|kind| rewrite(kind, value, &FromJson))
        .transpose()
}

impl StateMachine {
    /// Brings the store to [`FORMAT_VERSION`]: a store of JSON records (made before format
    /// 1, or installed from such a leader's snapshot) is rewritten, [`UPGRADE_BATCH`]
    /// records per write, then marked. Stopped part-way, it goes on where it stopped.
    /// Returns how many records were rewritten; a store of a newer format is refused.
    pub fn upgrade_format(&self) -> Result<u64, MasterError> {
        let entries = self.get_u64(keys::ENTRY_FORMAT)?;
        self.entry_format
            .0
            .version
            .store(entries.min(u8::MAX.into()) as u8, Ordering::Release);
        match self.get(keys::FORMAT)?.as_deref() {
            Some([FORMAT_VERSION]) => return Ok(0),
            Some(v) => {
                return Err(MasterError::corrupt(format!(
                    "the state is in format {v:?}, and this master reads format \
                     {FORMAT_VERSION}: start the release that wrote it, or a newer one"
                )))
            }
            None => {}
        }
        let cf = self.cf()?;
        let mut it = self.db.raw_iterator_cf(cf);
        it.seek_to_first();
        let (mut batch, mut rewritten) = (WriteBatch::default(), 0u64);
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            if let Some(new) = upgraded(k, v)? {
                batch.put_cf(cf, k, new);
                rewritten += 1;
                if batch.len() >= UPGRADE_BATCH {
                    self.db.write(std::mem::take(&mut batch))?;
                }
            }
            it.next();
        }
        it.status()?;
        batch.put_cf(cf, keys::FORMAT, [FORMAT_VERSION]);
        let mut wo = rocksdb::WriteOptions::default();
        wo.set_sync(true);
        self.db.write_opt(batch, &wo)?;
        self.forget_cached();
        if rewritten > 0 {
            tracing::info!(
                rewritten,
                format = FORMAT_VERSION,
                "rewrote the state's JSON records in the binary format"
            );
        }
        Ok(rewritten)
    }
}

impl StateMachine {
    /// After a snapshot replaced the store: forgets what was decoded from the old one and
    /// brings the new one to this release's format (a leader of an older release, or a
    /// group not switched yet, sends JSON). Call before anyone reads at the new index.
    pub fn snapshot_installed(&self) -> Result<(), MasterError> {
        self.forget_cached();
        self.upgrade_format()?;
        Ok(())
    }

    /// The format this master proposes Raft entries in.
    pub fn entry_format(&self) -> EntryFormat {
        self.entry_format.clone()
    }
}

impl super::Txn<'_> {
    /// [`Command::UseFormat`]: a format this master cannot read is refused (a leader
    /// proposes one only when every member says it reads it).
    pub(super) fn use_format(&mut self, version: u32) -> Result<ApplyOutput, MasterError> {
        if version > u32::from(FORMAT_VERSION) {
            return Err(MasterError::invalid(format!(
                "Raft entry format {version} is newer than this master's ({FORMAT_VERSION})"
            )));
        }
        if u64::from(version) > self.get_u64(keys::ENTRY_FORMAT)? {
            self.put_u64(keys::ENTRY_FORMAT, version.into());
            // Only a failure of this master's storage can stop the commit, and it stops
            // the master.
            self.sm
                .entry_format
                .0
                .version
                .store(version as u8, Ordering::Release);
        }
        Ok(ApplyOutput::None)
    }
}

mod convert;
#[cfg(test)]
mod tests;
