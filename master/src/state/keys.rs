//! Every key of the `state` column family, in one place: what each prefix holds and how
//! its value is encoded. A key is a one-byte tag, then big-endian ids (so a prefix scan
//! walks them in id order) or a name. Values are the messages of
//! `proto/granary/state/v1/state.proto` (see [`super::format`]) unless said otherwise.
//!
//! | tag | key | value |
//! |---|---|---|
//! | `i` | inode id | `Inode` |
//! | `c` | parent inode id, then the child's name | the child's inode id (u64) |
//! | `m` | mount id | `Mount` |
//! | `P` | inode id | `Pin` |
//! | `T` | inode id | `Ttl` |
//! | `J` | job id | `Job` |
//! | `j` | job id, inode id | the file's length (u64): done by the job |
//! | `f` | job id, inode id | `FailedFile` |
//! | `q` | request id | `RequestOutcome` |
//! | `Q` | the outcome's time (ms, u64), request id | empty: the age index of `q` |
//! | `A` | master id | the member's address (UTF-8) |
//! | `D` | worker id | empty: the worker is decommissioned |
//! | `M` | a name (`Mapplied`, `Mnext_inode`, …) | a counter (u64), or the format (one byte) |
//!
//! Every tag is an ASCII letter (a snapshot's range deletion relies on it, see
//! `raft::snapshot`). The Raft log has a column family of its own (`raft::storage`).

pub const INODE: u8 = b'i';
pub const CHILD: u8 = b'c';
pub const MOUNT: u8 = b'm';
pub const PIN: u8 = b'P';
pub const TTL: u8 = b'T';
pub const JOB: u8 = b'J';
pub const JOB_DONE: u8 = b'j';
pub const JOB_FAILED: u8 = b'f';
pub const REQUEST: u8 = b'q';
pub const REQUEST_AGE: u8 = b'Q';
pub const MEMBER: u8 = b'A';
pub const DECOMMISSIONED: u8 = b'D';
pub const META: u8 = b'M';

pub const APPLIED: &[u8] = b"Mapplied";
pub const NEXT_INODE: &[u8] = b"Mnext_inode";
pub const NEXT_MOUNT: &[u8] = b"Mnext_mount";
pub const NEXT_JOB: &[u8] = b"Mnext_job";
pub const INODE_COUNT: &[u8] = b"Minodes";
/// The format of the records (absent: the JSON of the releases before format 1).
pub const FORMAT: &[u8] = b"Mformat";
/// The format Raft entries are proposed in (absent: 0, JSON).
pub const ENTRY_FORMAT: &[u8] = b"Mentry_format";

/// `tag` + `id` (big-endian): the key of a record kept per id.
pub fn tagged(tag: u8, id: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(9);
    k.push(tag);
    k.extend_from_slice(&id.to_be_bytes());
    k
}

pub fn inode(id: u64) -> Vec<u8> {
    tagged(INODE, id)
}

/// The inode id of an inode record's key, None for any other key.
pub fn inode_id_of(key: &[u8]) -> Option<u64> {
    match key {
        [INODE, id @ ..] => id.try_into().ok().map(u64::from_be_bytes),
        _ => None,
    }
}

/// The prefix of `parent`'s folder entries.
pub fn children(parent: u64) -> Vec<u8> {
    tagged(CHILD, parent)
}

pub fn child(parent: u64, name: &str) -> Vec<u8> {
    let mut k = children(parent);
    k.extend_from_slice(name.as_bytes());
    k
}

pub fn mount(id: u64) -> Vec<u8> {
    tagged(MOUNT, id)
}

pub fn pin(inode: u64) -> Vec<u8> {
    tagged(PIN, inode)
}

pub fn ttl(inode: u64) -> Vec<u8> {
    tagged(TTL, inode)
}

pub fn job(id: u64) -> Vec<u8> {
    tagged(JOB, id)
}

/// A file of a job: `tag` ([`JOB_DONE`] or [`JOB_FAILED`]) + job id + inode id.
pub fn job_file(tag: u8, job: u64, inode: u64) -> Vec<u8> {
    let mut k = tagged(tag, job);
    k.extend_from_slice(&inode.to_be_bytes());
    k
}

pub fn request(id: u64) -> Vec<u8> {
    tagged(REQUEST, id)
}

/// The age index of remembered outcomes: time (ms, negative as 0) + request id.
pub fn request_age(at_ms: i64, id: u64) -> Vec<u8> {
    let mut k = tagged(REQUEST_AGE, at_ms.max(0) as u64);
    k.extend_from_slice(&id.to_be_bytes());
    k
}

pub fn member(id: u64) -> Vec<u8> {
    tagged(MEMBER, id)
}

pub fn decommissioned(id: u64) -> Vec<u8> {
    tagged(DECOMMISSIONED, id)
}

/// The records whose value is a message of the state format (the others are ids,
/// counters, addresses or empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    Inode,
    Mount,
    Pin,
    Ttl,
    Job,
    FailedFile,
    RequestOutcome,
}

/// Which message a key's value is, if any.
pub fn message_of(key: &[u8]) -> Option<Message> {
    Some(match *key.first()? {
        INODE => Message::Inode,
        MOUNT => Message::Mount,
        PIN => Message::Pin,
        TTL => Message::Ttl,
        JOB => Message::Job,
        JOB_FAILED => Message::FailedFile,
        REQUEST => Message::RequestOutcome,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_prefix_is_its_own_and_an_ascii_letter() {
        let tags = [
            INODE,
            CHILD,
            MOUNT,
            PIN,
            TTL,
            JOB,
            JOB_DONE,
            JOB_FAILED,
            REQUEST,
            REQUEST_AGE,
            MEMBER,
            DECOMMISSIONED,
            META,
        ];
        let distinct: std::collections::BTreeSet<u8> = tags.iter().copied().collect();
        assert_eq!(distinct.len(), tags.len());
        assert!(tags.iter().all(u8::is_ascii_alphabetic));
        for meta in [
            APPLIED,
            NEXT_INODE,
            NEXT_MOUNT,
            NEXT_JOB,
            INODE_COUNT,
            FORMAT,
            ENTRY_FORMAT,
        ] {
            assert_eq!(meta[0], META);
            assert_eq!(message_of(meta), None);
        }
        // Ids sort as numbers; a folder's entries sort by name, after the folder's prefix.
        assert!(inode(255) < inode(256) && request_age(-5, 9) == request_age(0, 9));
        assert!(
            child(7, "a").starts_with(&children(7)) && !child(8, "a").starts_with(&children(7))
        );
        assert_eq!(inode_id_of(&inode(42)), Some(42));
        assert_eq!(inode_id_of(&mount(42)), None);
        assert_eq!(
            message_of(&job_file(JOB_FAILED, 1, 2)),
            Some(Message::FailedFile)
        );
        assert_eq!(message_of(&job_file(JOB_DONE, 1, 2)), None);
    }
}
