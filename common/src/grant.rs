//! Read grants: a worker serves a file's blocks to a client only with a short-lived grant
//! the master signed for that client, that file and its under-store location.
//!
//! The leader makes a random key when it starts ([`GrantKey::random`]) and hands it to the
//! workers in every registration and heartbeat answer (node-only RPCs, over mutual TLS); a
//! worker keeps the last few keys it was given ([`GrantKeys`]), so grants signed before a
//! failover stay good until they expire. The key is never written to disk. Followers that
//! answer namespace reads sign with the leader's key, which they ask the leader for over
//! the masters' mutual TLS (`RaftService/GrantKey`, master certificates only).
//!
//! A grant is an HMAC-SHA256 over (key id, inode, expiry, write, principal name,
//! under-store location, version, block size, file length, fingerprint). Binding the
//! location matters: a block request names the object the worker fetches on a miss, so a
//! grant for one file cannot be used to make a worker read another object with its
//! credentials. Binding the rest matters as much: the worker takes a block's first byte
//! and length from the descriptor's block size and file length, and caches the bytes under
//! (inode, version, index) for every later reader — a descriptor that disagreed with the
//! master about any of them would cache other bytes under that name (cache poisoning), so
//! a worker serves or fills a block only when the descriptor is the one the master signed
//! ([`Terms`]). A `write` grant (from `CreateFile`) binds the version and block size of the
//! file being written; it covers reads of what the master signed (a length of 0: none).
//! Node principals (workers reading from peers) need no grant; neither does anyone on a
//! plaintext (`--insecure`) cluster, where there are no principals.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use aws_lc_rs::hmac;
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use granary_proto as pb;

/// How long a grant is good for.
pub const GRANT_LIFETIME: Duration = Duration::from_secs(600);
/// A client asks for a new grant when the one it holds ends within this margin.
pub const GRANT_REFRESH_MARGIN: Duration = Duration::from_secs(60);
/// Keys a worker keeps (the current leader's and the previous ones').
const KEPT_KEYS: usize = 4;

/// One signing key of a leader.
pub struct GrantKey {
    pub id: u64,
    key: hmac::Key,
    raw: [u8; 32],
}

impl GrantKey {
    /// A fresh random key (the leader's, made at start).
    pub fn random() -> Result<GrantKey, String> {
        let rng = SystemRandom::new();
        let mut raw = [0u8; 32];
        let mut id = [0u8; 8];
        rng.fill(&mut raw)
            .and_then(|()| rng.fill(&mut id))
            .map_err(|_| "the system random generator failed".to_string())?;
        Ok(GrantKey::new(u64::from_le_bytes(id).max(1), raw))
    }

    fn new(id: u64, raw: [u8; 32]) -> GrantKey {
        GrantKey {
            id,
            key: hmac::Key::new(hmac::HMAC_SHA256, &raw),
            raw,
        }
    }

    /// The key as the wire carries it to workers.
    pub fn to_proto(&self) -> pb::GrantKey {
        pb::GrantKey {
            id: self.id,
            key: bytes::Bytes::copy_from_slice(&self.raw),
        }
    }

    pub fn from_proto(k: &pb::GrantKey) -> Option<GrantKey> {
        let raw: [u8; 32] = k.key.as_ref().try_into().ok()?;
        (k.id != 0).then(|| GrantKey::new(k.id, raw))
    }

    /// Signs a grant for `principal` on `file` as its status says it is (inode, under-store
    /// object, version, block size, length, fingerprint), good until `expires_ms`.
    pub fn sign(
        &self,
        principal: &str,
        file: &pb::FileStatus,
        write: bool,
        expires_ms: u64,
    ) -> pb::ReadGrant {
        let mut g = pb::ReadGrant {
            inode: file.inode,
            principal: principal.to_string(),
            expires_ms,
            key_id: self.id,
            mac: bytes::Bytes::new(),
            write,
            ufs: file.ufs.clone(),
            version: file.version,
            block_size: effective_block_size(file.block_size),
            file_length: file.length,
            fingerprint: file.fingerprint.clone(),
        };
        g.mac = bytes::Bytes::copy_from_slice(hmac::sign(&self.key, &signed_bytes(&g)).as_ref());
        g
    }
}

/// A block size as a file's status carries it (0: the default) made explicit.
pub fn effective_block_size(block_size: u64) -> u64 {
    if block_size == 0 {
        crate::DEFAULT_BLOCK_SIZE
    } else {
        block_size
    }
}

/// Appends a length-prefixed string.
fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// The bytes a grant's MAC covers (every field but the MAC, each length-prefixed). The
/// domain tag names the layout: a grant of another layout never verifies.
fn signed_bytes(g: &pb::ReadGrant) -> Vec<u8> {
    let mut b = Vec::with_capacity(160 + g.principal.len());
    b.extend_from_slice(b"granary-grant-v2");
    b.extend_from_slice(&g.key_id.to_le_bytes());
    b.extend_from_slice(&g.inode.to_le_bytes());
    b.extend_from_slice(&g.expires_ms.to_le_bytes());
    b.push(u8::from(g.write));
    b.extend_from_slice(&(g.principal.len() as u64).to_le_bytes());
    b.extend_from_slice(g.principal.as_bytes());
    match &g.ufs {
        Some(u) => {
            b.push(1);
            b.extend_from_slice(&u.mount_id.to_le_bytes());
            b.extend_from_slice(&(u.path.len() as u64).to_le_bytes());
            b.extend_from_slice(u.path.as_bytes());
        }
        None => b.push(0),
    }
    b.extend_from_slice(&g.version.to_le_bytes());
    b.extend_from_slice(&g.block_size.to_le_bytes());
    b.extend_from_slice(&g.file_length.to_le_bytes());
    match &g.fingerprint {
        Some(f) => {
            b.push(1);
            put_str(&mut b, &f.etag);
            b.extend_from_slice(&f.size.to_le_bytes());
            b.extend_from_slice(&f.mtime_ms.to_le_bytes());
            put_str(&mut b, &f.version_id);
        }
        None => b.push(0),
    }
    b
}

/// What a request says about the bytes of the file it uses.
#[derive(Clone, Copy)]
pub enum Terms<'a> {
    /// Pages of the file's `version` already cached (short-circuit leases: they fetch
    /// nothing): the grant must be for that version, as a grant for a file's new contents
    /// does not reach pages of its old ones still cached.
    Cached { version: u64 },
    /// A block read: the descriptor's version, block size, file length and fingerprint
    /// must be those the grant binds (they decide which bytes the block holds).
    Read(&'a pb::BlockDescriptor),
    /// A write of the file's `version` in blocks of `block_size` (0: the default): a
    /// write grant of that version and block size.
    Write { version: u64, block_size: u64 },
}

/// What a request wants to do with a file.
pub struct Use<'a> {
    pub principal: &'a str,
    pub inode: u64,
    /// The under-store location the request names (reads through it on a miss, or writes
    /// to it); `None` when it names none (short-circuit leases of cached pages).
    pub ufs: Option<&'a pb::UfsLocation>,
    pub terms: Terms<'a>,
}

impl Use<'_> {
    fn write(&self) -> bool {
        matches!(self.terms, Terms::Write { .. })
    }
}

/// Why the request's terms are not the grant's (`None`: they are). Each reason names the
/// grant, so a client takes it as a grant refusal (a new grant, and a descriptor built from
/// it, may help: the file changed since the client looked).
fn terms_mismatch(g: &pb::ReadGrant, terms: &Terms) -> Option<String> {
    let (version, block_size) = match terms {
        Terms::Cached { version } => {
            return (*version != g.version).then(|| {
                format!(
                    "the grant for file {} is for version {:x}, not {version:x}",
                    g.inode, g.version
                )
            });
        }
        Terms::Read(d) => (d.id.as_ref().map_or(0, |id| id.version), d.block_size),
        Terms::Write {
            version,
            block_size,
        } => (*version, effective_block_size(*block_size)),
    };
    let inode = g.inode;
    if version != g.version {
        return Some(format!(
            "the grant for file {inode} is for version {:x}, not {version:x}",
            g.version
        ));
    }
    if block_size != g.block_size {
        return Some(format!(
            "the grant for file {inode} binds block size {}, not {block_size}",
            g.block_size
        ));
    }
    if let Terms::Read(d) = terms {
        if d.file_length != g.file_length {
            return Some(format!(
                "the grant for file {inode} binds length {}, not {}",
                g.file_length, d.file_length
            ));
        }
        if d.fingerprint != g.fingerprint {
            return Some(format!(
                "the grant for file {inode} binds another fingerprint of its under-store object"
            ));
        }
    }
    None
}

/// The keys a worker accepts grants of.
#[derive(Default)]
pub struct GrantKeys(Mutex<VecDeque<GrantKey>>, std::sync::atomic::AtomicBool);

impl GrantKeys {
    /// Keys for a worker of a cluster whose masters sign grants (one with TLS): until the
    /// first key arrives, [`signed`](Self::signed) already says so.
    pub fn expected() -> Self {
        Self(Mutex::default(), std::sync::atomic::AtomicBool::new(true))
    }

    /// Does this worker's cluster sign grants: a key has come, or keys are expected (a
    /// worker with TLS that has not registered yet must not take a node's grant-less fill
    /// for one of a plaintext cluster).
    pub fn signed(&self) -> bool {
        self.1.load(std::sync::atomic::Ordering::Relaxed) || self.any()
    }

    /// Has the master sent any key (a cluster whose masters sign grants)?
    pub fn any(&self) -> bool {
        !self.0.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// Adds a key the master sent (a known one is ignored); the oldest beyond the last few go.
    pub fn learn(&self, k: &pb::GrantKey) {
        let mut keys = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if keys.iter().any(|have| have.id == k.id) {
            return;
        }
        if let Some(key) = GrantKey::from_proto(k) {
            keys.push_front(key);
            keys.truncate(KEPT_KEYS);
        }
    }

    /// Checks a grant allows `want` now; the error says why not (for `PERMISSION_DENIED`).
    pub fn check(
        &self,
        grant: Option<&pb::ReadGrant>,
        want: &Use,
        now_ms: u64,
    ) -> Result<(), String> {
        let Some(g) = grant else {
            return Err(format!(
                "no read grant for file {} (ask the master for the file's status first)",
                want.inode
            ));
        };
        {
            let keys = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let Some(key) = keys.iter().find(|k| k.id == g.key_id) else {
                return Err(format!(
                    "the read grant for file {} is signed by a key this worker does not know (yet)",
                    want.inode
                ));
            };
            hmac::verify(&key.key, &signed_bytes(g), &g.mac).map_err(|_| {
                format!(
                    "the read grant for file {} is forged or altered",
                    want.inode
                )
            })?;
        }
        if g.inode != want.inode {
            return Err(format!(
                "the read grant is for file {}, not file {}",
                g.inode, want.inode
            ));
        }
        if g.principal != want.principal {
            return Err(format!(
                "the read grant for file {} was given to {}, not {}",
                want.inode, g.principal, want.principal
            ));
        }
        if g.expires_ms <= now_ms {
            return Err(format!(
                "the read grant for file {} has expired",
                want.inode
            ));
        }
        if want.write() && !g.write {
            return Err(format!(
                "the grant for file {} allows reading it, not writing it",
                want.inode
            ));
        }
        if let Some(u) = want.ufs {
            if g.ufs.as_ref() != Some(u) {
                return Err(format!(
                    "the read grant for file {} does not cover under-store object {} of mount {}",
                    want.inode, u.path, u.mount_id
                ));
            }
        }
        if let Some(why) = terms_mismatch(g, &want.terms) {
            return Err(why);
        }
        Ok(())
    }
}

/// Is `grant` still good for at least the refresh margin (client side)?
pub fn fresh(grant: &pb::ReadGrant, now_ms: u64) -> bool {
    grant.expires_ms > now_ms + GRANT_REFRESH_MARGIN.as_millis() as u64
}

/// A `PERMISSION_DENIED` refusing a request's read grant (missing, expired, for another
/// caller, version or object), marked as such for the caller (see [`is_grant_denial`]).
pub fn grant_denial(why: String) -> tonic::Status {
    let mut s = tonic::Status::permission_denied(why);
    s.metadata_mut().insert(
        granary_proto::REFUSAL_KEY,
        tonic::metadata::MetadataValue::from_static(granary_proto::GRANT_REFUSAL),
    );
    s
}

/// Is this status a refusal of the request's grant (so a new grant may help)? Told by its
/// metadata, never by its text.
pub fn is_grant_denial(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::PermissionDenied
        && status
            .metadata()
            .get(granary_proto::REFUSAL_KEY)
            .is_some_and(|v| v == granary_proto::GRANT_REFUSAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_refusal_is_told_by_its_metadata_not_its_text() {
        assert!(is_grant_denial(&grant_denial(
            "the read grant expired".into()
        )));
        // Another refusal that mentions grants is not one.
        assert!(!is_grant_denial(&tonic::Status::permission_denied(
            "role user may not call this method (grants do not help)"
        )));
        let mut other = tonic::Status::unavailable("x");
        other.metadata_mut().insert(
            granary_proto::REFUSAL_KEY,
            tonic::metadata::MetadataValue::from_static(granary_proto::GRANT_REFUSAL),
        );
        assert!(
            !is_grant_denial(&other),
            "only PERMISSION_DENIED refuses a grant"
        );
    }

    fn loc(path: &str) -> pb::UfsLocation {
        pb::UfsLocation {
            mount_id: 3,
            path: path.into(),
        }
    }

    fn fp() -> pb::Fingerprint {
        pb::Fingerprint {
            etag: "e1".into(),
            size: 10_000,
            mtime_ms: 5,
            version_id: String::new(),
        }
    }

    /// File 7 at `ufs`: version 0x77, blocks of 4096, 10,000 bytes.
    fn file(ufs: Option<&pb::UfsLocation>) -> pb::FileStatus {
        pb::FileStatus {
            inode: 7,
            ufs: ufs.cloned(),
            version: 0x77,
            block_size: 4096,
            length: 10_000,
            fingerprint: Some(fp()),
            ..Default::default()
        }
    }

    /// The honest descriptor of block `index` of [`file`].
    fn desc(ufs: &pb::UfsLocation, index: u32) -> pb::BlockDescriptor {
        pb::BlockDescriptor {
            id: Some(pb::BlockId {
                inode: 7,
                version: 0x77,
                index,
            }),
            ufs: Some(ufs.clone()),
            fingerprint: Some(fp()),
            file_length: 10_000,
            block_size: 4096,
        }
    }

    fn want<'a>(inode: u64, ufs: Option<&'a pb::UfsLocation>, write: bool) -> Use<'a> {
        Use {
            principal: "alice",
            inode,
            ufs,
            terms: if write {
                Terms::Write {
                    version: 0x77,
                    block_size: 4096,
                }
            } else {
                Terms::Cached { version: 0x77 }
            },
        }
    }

    fn sign(
        key: &GrantKey,
        inode: u64,
        ufs: Option<&pb::UfsLocation>,
        write: bool,
    ) -> pb::ReadGrant {
        key.sign(
            "alice",
            &pb::FileStatus { inode, ..file(ufs) },
            write,
            10_000,
        )
    }

    #[test]
    fn a_signed_grant_allows_exactly_what_it_names() {
        let key = GrantKey::random().unwrap();
        let keys = GrantKeys::default();
        keys.learn(&key.to_proto());
        let a = loc("a.bin");
        let g = sign(&key, 7, Some(&a), false);
        assert_eq!(
            (
                g.version,
                g.block_size,
                g.file_length,
                g.fingerprint.clone()
            ),
            (0x77, 4096, 10_000, Some(fp()))
        );
        assert_eq!(
            keys.check(Some(&g), &want(7, Some(&a), false), 9_999),
            Ok(())
        );
        assert_eq!(keys.check(Some(&g), &want(7, None, false), 9_999), Ok(()));
        let refused =
            |g: &pb::ReadGrant, w: &Use, now: u64| keys.check(Some(g), w, now).unwrap_err();
        assert!(refused(&g, &want(7, Some(&a), false), 10_000).contains("expired"));
        assert!(refused(&g, &want(8, Some(&a), false), 1).contains("not file 8"));
        assert!(refused(&g, &want(7, Some(&loc("b.bin")), false), 1).contains("does not cover"));
        assert!(refused(&g, &want(7, Some(&a), true), 1).contains("not writing"));
        let bob = Use {
            principal: "bob",
            ..want(7, Some(&a), false)
        };
        assert!(refused(&g, &bob, 1).contains("not bob"));
        assert!(keys
            .check(None, &want(7, None, false), 1)
            .unwrap_err()
            .contains("no read grant"));
        // Any altered field breaks the MAC.
        for alter in [
            |g: &mut pb::ReadGrant| g.inode += 1,
            |g: &mut pb::ReadGrant| g.expires_ms += 1,
            |g: &mut pb::ReadGrant| g.write = true,
            |g: &mut pb::ReadGrant| g.principal.push('x'),
            |g: &mut pb::ReadGrant| g.ufs = None,
            |g: &mut pb::ReadGrant| g.version += 1,
            |g: &mut pb::ReadGrant| g.block_size *= 2,
            |g: &mut pb::ReadGrant| g.file_length -= 1,
            |g: &mut pb::ReadGrant| g.fingerprint = None,
            |g: &mut pb::ReadGrant| {
                if let Some(f) = g.fingerprint.as_mut() {
                    f.etag.push('x');
                }
            },
            |g: &mut pb::ReadGrant| {
                if let Some(f) = g.fingerprint.as_mut() {
                    f.size += 1;
                }
            },
            |g: &mut pb::ReadGrant| {
                let mut mac = g.mac.to_vec();
                mac[0] ^= 1;
                g.mac = mac.into();
            },
        ] {
            let mut bad = g.clone();
            alter(&mut bad);
            assert!(refused(&bad, &want(bad.inode, None, false), 1).contains("forged"));
        }
        // A write grant covers writes of its version and block size.
        let w = sign(&key, 7, Some(&a), true);
        assert_eq!(keys.check(Some(&w), &want(7, Some(&a), true), 1), Ok(()));
        assert_eq!(keys.check(Some(&w), &want(7, Some(&a), false), 1), Ok(()));
        let write = |version, block_size| Use {
            terms: Terms::Write {
                version,
                block_size,
            },
            ..want(7, Some(&a), true)
        };
        assert!(refused(&w, &write(0x78, 4096), 1).contains("not 78"));
        assert!(refused(&w, &write(0x77, 8192), 1).contains("not 8192"));
        // 0 is the default block size, which this file does not have.
        assert!(refused(&w, &write(0x77, 0), 1).contains("block size"));
    }

    #[test]
    fn a_block_read_must_name_the_signed_version_geometry_and_fingerprint() {
        let key = GrantKey::random().unwrap();
        let keys = GrantKeys::default();
        keys.learn(&key.to_proto());
        let a = loc("a.bin");
        let g = sign(&key, 7, Some(&a), false);
        let check = |d: &pb::BlockDescriptor, g: &pb::ReadGrant| {
            keys.check(
                Some(g),
                &Use {
                    principal: "alice",
                    inode: 7,
                    ufs: d.ufs.as_ref(),
                    terms: Terms::Read(d),
                },
                1,
            )
        };
        for index in 0..3 {
            assert_eq!(check(&desc(&a, index), &g), Ok(()));
        }
        type Tamper = fn(&mut pb::BlockDescriptor);
        let cases: [(Tamper, &str); 6] = [
            (|d| d.block_size = 8192, "block size 4096, not 8192"),
            (|d| d.block_size = 0, "block size 4096, not 0"),
            (|d| d.file_length = 4096, "length 10000, not 4096"),
            (
                |d| {
                    if let Some(id) = d.id.as_mut() {
                        id.version = 0x76;
                    }
                },
                "version 77, not 76",
            ),
            (|d| d.fingerprint = None, "another fingerprint"),
            (
                |d| {
                    if let Some(f) = d.fingerprint.as_mut() {
                        f.mtime_ms += 1;
                    }
                },
                "another fingerprint",
            ),
        ];
        for (tamper, why) in cases {
            let mut d = desc(&a, 1);
            tamper(&mut d);
            let e = check(&d, &g).unwrap_err();
            assert!(e.contains(why), "{why}: {e}");
            // Named as a grant refusal (the client asks for a new grant).
            assert!(e.contains("grant"), "{e}");
        }
        // A write grant signed at creation (length 0) lets nobody read blocks of a length.
        let created = key.sign(
            "alice",
            &pb::FileStatus {
                length: 0,
                fingerprint: None,
                ..file(Some(&a))
            },
            true,
            10_000,
        );
        assert!(check(&desc(&a, 0), &created)
            .unwrap_err()
            .contains("length 0"));
        // A status without a block size signs the default one.
        let default = key.sign(
            "alice",
            &pb::FileStatus {
                block_size: 0,
                ..file(Some(&a))
            },
            false,
            10_000,
        );
        assert_eq!(default.block_size, crate::DEFAULT_BLOCK_SIZE);
    }

    #[test]
    fn workers_keep_the_last_few_keys() {
        let keys = GrantKeys::default();
        let all: Vec<GrantKey> = (0..6).map(|_| GrantKey::random().unwrap()).collect();
        for k in &all {
            keys.learn(&k.to_proto());
            keys.learn(&k.to_proto()); // known: ignored
        }
        let ok = |k: &GrantKey| {
            let g = k.sign("alice", &file(None), false, 100);
            keys.check(Some(&g), &want(7, None, false), 1)
        };
        assert!(ok(&all[5]).is_ok() && ok(&all[2]).is_ok());
        assert!(ok(&all[1]).unwrap_err().contains("does not know"));
        // Another leader's key of the same id is not this one.
        let other = GrantKey::new(all[5].id, [9; 32]);
        assert!(ok(&other).unwrap_err().contains("forged"));
        assert!(GrantKey::from_proto(&pb::GrantKey {
            id: 1,
            key: vec![0; 31].into()
        })
        .is_none());
    }
}
