//! Under-store credentials at rest: every secret mount option (`ufs::is_secret_key`: every
//! option but Granary's own and a list of store keys known not to be credentials) is
//! sealed with AES-256-GCM before its mount is proposed, so neither the Raft log nor the
//! state machine (both in RocksDB, both copied into snapshots) ever hold it in clear. The
//! key is given to every master at start (`--secrets-key-file` or `GRANARY_SECRETS_KEY`);
//! values are opened only where a store is opened (the master's own listings) or handed to
//! a worker (`GetMountAccess`, node identities over mutual TLS).
//!
//! A sealed value is `enc:v1:` + hex(nonce ‖ ciphertext ‖ tag); the option's name is the
//! associated data, so a sealed value cannot be moved to another option.

use std::collections::BTreeMap;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use granary_common::ufs::{is_secret_key, UfsSpec};
use sha2::{Digest, Sha256};

use crate::error::MasterError;

const PREFIX: &str = "enc:v1:";
/// Shortest key text accepted (bytes): a key is meant to be random, not a password.
pub const MIN_KEY_BYTES: usize = 32;

/// The masters' key for credentials at rest.
pub struct SecretBox {
    key: LessSafeKey,
    rng: SystemRandom,
}

impl std::fmt::Debug for SecretBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretBox(<key>)")
    }
}

impl SecretBox {
    /// A key from its text (a file's content or the variable's value): at least 32 bytes,
    /// hashed with SHA-256 into the AES-256 key.
    pub fn from_text(text: &[u8]) -> Result<SecretBox, String> {
        let trimmed = text.trim_ascii();
        if trimmed.len() < MIN_KEY_BYTES {
            return Err(format!(
                "the secrets key has {} bytes; it needs at least {MIN_KEY_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > key`)",
                trimmed.len()
            ));
        }
        let digest = Sha256::digest(trimmed);
        let key = UnboundKey::new(&AES_256_GCM, &digest)
            .map_err(|_| "the secrets key cannot be used".to_string())?;
        Ok(SecretBox {
            key: LessSafeKey::new(key),
            rng: SystemRandom::new(),
        })
    }

    pub fn seal(&self, name: &str, clear: &str) -> Result<String, MasterError> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .map_err(|_| MasterError::corrupt("no randomness for sealing a secret"))?;
        let mut data = clear.as_bytes().to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(name.as_bytes()),
                &mut data,
            )
            .map_err(|_| MasterError::corrupt("sealing a secret failed"))?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&data);
        Ok(format!("{PREFIX}{}", hex::encode(out)))
    }

    pub fn open(&self, name: &str, sealed: &str) -> Result<String, MasterError> {
        let wrong = || {
            MasterError::invalid(format!(
                "cannot decrypt the mount option {name}: this master's secrets key is not the one it was sealed with"
            ))
        };
        let body = sealed.strip_prefix(PREFIX).ok_or_else(wrong)?;
        let bytes = hex::decode(body).map_err(|_| wrong())?;
        if bytes.len() < NONCE_LEN {
            return Err(wrong());
        }
        let (nonce, rest) = bytes.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| wrong())?;
        let mut data = rest.to_vec();
        let clear = self
            .key
            .open_in_place(nonce, Aad::from(name.as_bytes()), &mut data)
            .map_err(|_| wrong())?;
        String::from_utf8(clear.to_vec()).map_err(|_| wrong())
    }
}

/// Is this option value sealed?
pub fn is_sealed(value: &str) -> bool {
    value.starts_with(PREFIX)
}

/// The spec with every secret option sealed. Without a key, a spec with secrets is
/// refused: they would be stored in clear.
pub fn seal_spec(secrets: Option<&SecretBox>, spec: UfsSpec) -> Result<UfsSpec, MasterError> {
    let mut options = BTreeMap::new();
    for (k, v) in spec.options {
        let v = if is_secret_key(&k) && !v.is_empty() {
            let Some(b) = secrets else {
                return Err(MasterError::FailedPrecondition {
                    message: format!(
                        "the mount option {k} is a credential and the masters have no secrets key to store it encrypted; start them with --secrets-key-file (see docs/security.md)"
                    ),
                });
            };
            b.seal(&k, &v)?
        } else {
            v
        };
        options.insert(k, v);
    }
    Ok(UfsSpec {
        uri: spec.uri,
        options,
    })
}

/// The spec with its sealed options opened (values stored before sealing existed are
/// taken as they are).
pub fn open_spec(secrets: Option<&SecretBox>, spec: &UfsSpec) -> Result<UfsSpec, MasterError> {
    let mut options = BTreeMap::new();
    for (k, v) in &spec.options {
        let v = if is_sealed(v) {
            let b = secrets.ok_or_else(|| MasterError::FailedPrecondition {
                message: format!(
                    "the mount option {k} is stored encrypted and this master has no secrets key (--secrets-key-file)"
                ),
            })?;
            b.open(k, v)?
        } else {
            v.clone()
        };
        options.insert(k.clone(), v);
    }
    Ok(UfsSpec {
        uri: spec.uri.clone(),
        options,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> UfsSpec {
        let mut o = BTreeMap::new();
        o.insert("access_key_id".to_string(), "AKIDEXAMPLE".to_string());
        o.insert(
            "secret_access_key".to_string(),
            "s3cr3t-value-1234".to_string(),
        );
        UfsSpec {
            uri: "s3://bucket/prefix".into(),
            options: o,
        }
    }

    #[test]
    fn secrets_round_trip_and_never_appear_sealed() {
        let b = SecretBox::from_text(&[7u8; 40]).unwrap();
        let sealed = seal_spec(Some(&b), spec()).unwrap();
        let s = &sealed.options["secret_access_key"];
        assert!(is_sealed(s) && !s.contains("s3cr3t"));
        assert_eq!(sealed.options["access_key_id"], "AKIDEXAMPLE");
        // Two seals of one value differ (fresh nonce).
        assert_ne!(
            seal_spec(Some(&b), spec()).unwrap().options["secret_access_key"],
            *s
        );
        assert_eq!(open_spec(Some(&b), &sealed).unwrap(), spec());
    }

    #[test]
    fn every_credential_key_of_every_store_is_sealed_and_opened_again() {
        use granary_common::ufs::known_keys::all_store_keys;
        let b = SecretBox::from_text(&[7u8; 40]).unwrap();
        let mut sealed_keys = 0;
        for (kind, key, secret) in all_store_keys() {
            let value = format!("clear-{key}-0123456789");
            let spec = UfsSpec {
                uri: "s3://bucket".into(),
                options: [(key.clone(), value.clone())].into(),
            };
            let sealed = seal_spec(Some(&b), spec.clone()).unwrap();
            // What the Raft log and the state machine hold.
            let stored = serde_json::to_string(&sealed).unwrap();
            assert_eq!(
                !stored.contains(&value),
                secret,
                "{} key {key}: {stored}",
                kind.name()
            );
            assert_eq!(is_sealed(&sealed.options[&key]), secret, "{key}");
            assert_eq!(open_spec(Some(&b), &sealed).unwrap(), spec, "{key}");
            // Without a key a credential is refused, never stored in clear.
            assert_eq!(seal_spec(None, spec.clone()).is_err(), secret, "{key}");
            // A record stored in clear before (an older version) still opens as it is.
            assert_eq!(open_spec(Some(&b), &spec).unwrap(), spec, "{key}");
            sealed_keys += usize::from(secret);
        }
        assert!(sealed_keys >= 30, "{sealed_keys}");
    }

    #[test]
    fn a_wrong_key_a_moved_value_or_no_key_is_refused() {
        let b = SecretBox::from_text(&[7u8; 40]).unwrap();
        let other = SecretBox::from_text(&[8u8; 40]).unwrap();
        let sealed = seal_spec(Some(&b), spec()).unwrap();
        let e = open_spec(Some(&other), &sealed).unwrap_err();
        assert!(
            e.to_string().contains("not the one it was sealed with"),
            "{e}"
        );
        let v = &sealed.options["secret_access_key"];
        assert!(
            b.open("session_token", v).is_err(),
            "a value opened under another name"
        );
        assert!(open_spec(None, &sealed).is_err());
        assert!(seal_spec(None, spec()).is_err());
        assert!(SecretBox::from_text(b"short").is_err());
        let mut cut = v.clone();
        cut.truncate(20);
        assert!(b.open("secret_access_key", &cut).is_err());
    }
}
