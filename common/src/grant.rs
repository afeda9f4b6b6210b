//! Read grants: a worker serves a file's blocks to a client only with a short-lived grant
//! the master signed for that client, that file and its under-store location.
//!
//! The leader makes a random key when it starts ([`GrantKey::random`]) and hands it to the
//! workers in every registration and heartbeat answer (node-only RPCs, over mutual TLS); a
//! worker keeps the last few keys it was given ([`GrantKeys`]), so grants signed before a
//! failover stay good until they expire. The key is never written to disk.
//!
//! A grant is an HMAC-SHA256 over (key id, inode, expiry, write, principal name,
//! under-store location). Binding the location matters: a block request names the object
//! the worker fetches on a miss, so a grant for one file cannot be used to make a worker
//! read another object with its credentials. A `write` grant (from `CreateFile`) also
//! covers reads of that file. Node principals (workers reading from peers) need no grant;
//! neither does anyone on a plaintext (`--insecure`) cluster, where there are no principals.

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

    /// Signs a grant for `principal` on file `inode` at `ufs`, good until `expires_ms`.
    pub fn sign(
        &self,
        principal: &str,
        inode: u64,
        ufs: Option<&pb::UfsLocation>,
        write: bool,
        expires_ms: u64,
    ) -> pb::ReadGrant {
        let mut g = pb::ReadGrant {
            inode,
            principal: principal.to_string(),
            expires_ms,
            key_id: self.id,
            mac: bytes::Bytes::new(),
            write,
            ufs: ufs.cloned(),
        };
        g.mac = bytes::Bytes::copy_from_slice(hmac::sign(&self.key, &signed_bytes(&g)).as_ref());
        g
    }
}

/// The bytes a grant's MAC covers (every field but the MAC, each length-prefixed).
fn signed_bytes(g: &pb::ReadGrant) -> Vec<u8> {
    let mut b = Vec::with_capacity(96 + g.principal.len());
    b.extend_from_slice(b"granary-grant-v1");
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
    b
}

/// What a request wants to do with a file.
pub struct Use<'a> {
    pub principal: &'a str,
    pub inode: u64,
    /// The under-store location the request names (reads through it on a miss, or writes
    /// to it); `None` when it names none (short-circuit leases of cached pages).
    pub ufs: Option<&'a pb::UfsLocation>,
    pub write: bool,
}

/// The keys a worker accepts grants of.
#[derive(Default)]
pub struct GrantKeys(Mutex<VecDeque<GrantKey>>);

impl GrantKeys {
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
        if want.write && !g.write {
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
        Ok(())
    }
}

/// Is `grant` still good for at least the refresh margin (client side)?
pub fn fresh(grant: &pb::ReadGrant, now_ms: u64) -> bool {
    grant.expires_ms > now_ms + GRANT_REFRESH_MARGIN.as_millis() as u64
}

/// Is this status a denial of a grant (so a new grant may help)?
pub fn is_grant_denial(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::PermissionDenied && status.message().contains("grant")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(path: &str) -> pb::UfsLocation {
        pb::UfsLocation {
            mount_id: 3,
            path: path.into(),
        }
    }

    fn want<'a>(inode: u64, ufs: Option<&'a pb::UfsLocation>, write: bool) -> Use<'a> {
        Use {
            principal: "alice",
            inode,
            ufs,
            write,
        }
    }

    #[test]
    fn a_signed_grant_allows_exactly_what_it_names() {
        let key = GrantKey::random().unwrap();
        let keys = GrantKeys::default();
        keys.learn(&key.to_proto());
        let a = loc("a.bin");
        let g = key.sign("alice", 7, Some(&a), false, 10_000);
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
        // A write grant covers reads too.
        let w = key.sign("alice", 7, Some(&a), true, 10_000);
        assert_eq!(keys.check(Some(&w), &want(7, Some(&a), true), 1), Ok(()));
        assert_eq!(keys.check(Some(&w), &want(7, Some(&a), false), 1), Ok(()));
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
            let g = k.sign("alice", 1, None, false, 100);
            keys.check(Some(&g), &want(1, None, false), 1)
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
