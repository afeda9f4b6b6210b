//! The under-store seam. A mount is a URI plus options; `object_store` does the talking.
//!
//! Options are split in two: Granary's own keys (see [`GRANARY_OPTION_KEYS`]) and everything
//! else, which goes unchanged to `object_store`'s own configuration parser so key names are
//! exactly the ones `object_store` documents.

use std::collections::BTreeMap;
use std::sync::Arc;

use object_store::local::LocalFileSystem;
use object_store::path::Path as StorePath;
use object_store::ObjectStore;
use thiserror::Error;
use url::Url;

/// Option keys that Granary interprets itself (not passed to `object_store`).
pub const GRANARY_OPTION_KEYS: &[&str] = &["read_only"];

#[derive(Debug, Error)]
pub enum UfsError {
    #[error("invalid under-store URI {uri:?}: {reason}")]
    InvalidUri { uri: String, reason: String },
    #[error("under-store directory {path} does not exist or is not a directory")]
    MissingDirectory { path: String },
    #[error("invalid mount option {key}={value:?}: {reason}")]
    InvalidOption {
        key: String,
        value: String,
        reason: String,
    },
    #[error("cannot open under-store {uri}: {source}")]
    Open {
        uri: String,
        #[source]
        source: object_store::Error,
    },
}

/// A mount's under-store as configured: URI and options (may hold credentials).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UfsSpec {
    pub uri: String,
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

/// An opened under-store: the store and the path prefix of the mount inside it.
#[derive(Debug, Clone)]
pub struct Ufs {
    pub store: Arc<dyn ObjectStore>,
    pub prefix: StorePath,
}

impl Ufs {
    /// Reads `range` of the object at `rel`, failing with `Precondition` if its ETag is no
    /// longer `etag` (so bytes of two versions are never mixed).
    pub async fn read_range(
        &self,
        rel: &str,
        etag: Option<String>,
        range: std::ops::Range<u64>,
    ) -> Result<bytes::Bytes, object_store::Error> {
        let opts = object_store::GetOptions {
            if_match: etag.filter(|e| !e.is_empty()),
            range: Some(object_store::GetRange::Bounded(range)),
            ..Default::default()
        };
        self.store
            .get_opts(&self.path_of(rel), opts)
            .await?
            .bytes()
            .await
    }

    /// The store path of `rel` (a `/`-separated path relative to the mount root).
    pub fn path_of(&self, rel: &str) -> StorePath {
        let mut p = self.prefix.clone();
        for part in rel.split('/').filter(|s| !s.is_empty()) {
            p = p.clone().join(part);
        }
        p
    }
}

/// Is `key` a credential whose value must never be shown?
pub fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    [
        "secret",
        "token",
        "password",
        "sas",
        "credential",
        "private",
        "access_key",
    ]
    .iter()
    .any(|s| k.contains(s))
        && k != "access_key_id"
        && !k.ends_with("_key_id")
}

/// Options with secret values replaced by `***`.
pub fn redact(options: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    options
        .iter()
        .map(|(k, v)| {
            let v = if is_secret_key(k) {
                "***".to_string()
            } else {
                v.clone()
            };
            (k.clone(), v)
        })
        .collect()
}

impl UfsSpec {
    /// Normalises a user-given URI: a bare absolute directory becomes `file://DIR`.
    pub fn new(uri: &str, options: BTreeMap<String, String>) -> Result<Self, UfsError> {
        let uri = if uri.starts_with('/') {
            format!("file://{}", uri.trim_end_matches('/'))
        } else if !uri.contains("://") {
            return Err(UfsError::InvalidUri {
                uri: uri.to_string(),
                reason: "give an absolute local directory or a URI such as file:///data or s3://bucket/prefix".into(),
            });
        } else {
            uri.to_string()
        };
        let spec = Self { uri, options };
        spec.validate_options()?;
        Ok(spec)
    }

    fn validate_options(&self) -> Result<(), UfsError> {
        if let Some(v) = self.options.get("read_only") {
            if parse_bool(v).is_none() {
                return Err(UfsError::InvalidOption {
                    key: "read_only".into(),
                    value: v.clone(),
                    reason: "expected true or false".into(),
                });
            }
        }
        Ok(())
    }

    pub fn read_only(&self) -> bool {
        self.options
            .get("read_only")
            .and_then(|v| parse_bool(v))
            .unwrap_or(false)
    }

    /// Options for `object_store` (Granary's own keys removed).
    fn store_options(&self) -> impl Iterator<Item = (&String, &String)> {
        self.options
            .iter()
            .filter(|(k, _)| !GRANARY_OPTION_KEYS.contains(&k.as_str()))
    }

    /// Opens the store. For `file://` the directory must exist.
    pub fn open(&self) -> Result<Ufs, UfsError> {
        let url = Url::parse(&self.uri).map_err(|e| UfsError::InvalidUri {
            uri: self.uri.clone(),
            reason: e.to_string(),
        })?;
        if url.scheme() == "file" {
            let dir = url.to_file_path().map_err(|()| UfsError::InvalidUri {
                uri: self.uri.clone(),
                reason: "not a local path".into(),
            })?;
            if !dir.is_dir() {
                return Err(UfsError::MissingDirectory {
                    path: dir.display().to_string(),
                });
            }
            let store =
                LocalFileSystem::new_with_prefix(&dir).map_err(|source| UfsError::Open {
                    uri: self.uri.clone(),
                    source,
                })?;
            return Ok(Ufs {
                store: Arc::new(store),
                prefix: StorePath::default(),
            });
        }
        let (store, prefix) =
            object_store::parse_url_opts(&url, self.store_options()).map_err(|source| {
                UfsError::Open {
                    uri: self.uri.clone(),
                    source,
                }
            })?;
        Ok(Ufs {
            store: Arc::from(store),
            prefix,
        })
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Some(true),
        "false" | "0" | "no" => Some(false),
        _ => None,
    }
}

/// Parses `key=value` mount option arguments.
pub fn parse_option_args(args: &[String]) -> Result<BTreeMap<String, String>, UfsError> {
    let mut out = BTreeMap::new();
    for a in args {
        let Some((k, v)) = a.split_once('=') else {
            return Err(UfsError::InvalidOption {
                key: a.clone(),
                value: String::new(),
                reason: "expected key=value".into(),
            });
        };
        out.insert(k.trim().to_string(), v.to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_redacted() {
        let mut o = BTreeMap::new();
        o.insert("secret_access_key".to_string(), "s3cr3t".to_string());
        o.insert("access_key_id".to_string(), "AKIA".to_string());
        o.insert("region".to_string(), "us-east-1".to_string());
        let r = redact(&o);
        assert_eq!(r["secret_access_key"], "***");
        assert_eq!(r["access_key_id"], "AKIA");
        assert_eq!(r["region"], "us-east-1");
    }

    #[test]
    fn missing_directory_is_refused() {
        let spec = UfsSpec::new("/definitely/not/here", BTreeMap::new()).unwrap();
        assert!(matches!(
            spec.open(),
            Err(UfsError::MissingDirectory { .. })
        ));
    }

    #[test]
    fn relative_paths_are_refused() {
        assert!(matches!(
            UfsSpec::new("data/sets", BTreeMap::new()),
            Err(UfsError::InvalidUri { .. })
        ));
        assert_eq!(
            UfsSpec::new("/data/", BTreeMap::new()).unwrap().uri,
            "file:///data"
        );
    }

    #[test]
    fn bad_read_only_value() {
        let mut o = BTreeMap::new();
        o.insert("read_only".to_string(), "maybe".to_string());
        assert!(UfsSpec::new("/tmp", o).is_err());
    }
}
