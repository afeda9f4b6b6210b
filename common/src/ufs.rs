//! The under-store seam. A mount is a URI plus options; `object_store` does the talking.
//!
//! Options are split in two: Granary's own keys (see [`GRANARY_OPTION_KEYS`]) and everything
//! else, which goes unchanged to `object_store`'s own configuration parser so key names are
//! exactly the ones `object_store` documents.

use std::collections::BTreeMap;
use std::sync::Arc;

use object_store::list::PaginatedListStore;
use object_store::path::Path as StorePath;
use object_store::ObjectStore;
use thiserror::Error;
use url::Url;

pub mod faults;
mod list;
mod local;
use list::open_object_store;
pub use list::{ListFailure, LIST_MAX_PAGES, LIST_PAGE_KEYS};
pub use local::{ConfinedLocal, Symlinks};

/// A function from a store to the store used in its place.
pub type WrapFn = dyn Fn(Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore> + Send + Sync;

/// What the stores of mounts are opened through (tests put faults in front of them).
#[derive(Clone)]
pub struct StoreWrap(pub Arc<WrapFn>);

impl std::fmt::Debug for StoreWrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreWrap")
    }
}

impl StoreWrap {
    /// Every store opened through it has `faults` in front.
    pub fn faults(faults: Arc<faults::StoreFaults>) -> StoreWrap {
        StoreWrap(Arc::new(move |store| faults.wrap(store)))
    }
}

/// Option keys that Granary interprets itself (not passed to `object_store`). None of them
/// is a secret.
pub const GRANARY_OPTION_KEYS: &[&str] = &[
    "dir_mode",
    "file_mode",
    "gid",
    "list_page_keys",
    "part_concurrency",
    "part_size",
    "read_only",
    "symlinks",
    "sync_interval",
    "uid",
    "validate_on_open",
    "write_mode",
];

/// `object_store` option keys whose values are NOT secrets (names, places, switches, paths
/// of files holding credentials — never credentials themselves), as written without the
/// `aws_`, `google_`, `azure_storage_` or `azure_` prefix `object_store` also accepts.
/// Every other option value is a secret: sealed at rest, `***` in every output. A key
/// missing here is therefore hidden, never shown by mistake.
pub const PUBLIC_STORE_KEYS: &[&str] = &[
    // S3 (AmazonS3ConfigKey)
    "access_key_id",
    "default_region",
    "region",
    "bucket",
    "bucket_name",
    "endpoint",
    "endpoint_url",
    "endpoint_url_s3",
    "endpoint_url_sts",
    "virtual_hosted_style_request",
    "s3_express",
    "imdsv1_fallback",
    "metadata_endpoint",
    "unsigned_payload",
    "checksum_algorithm",
    "container_credentials_relative_uri",
    "container_credentials_full_uri",
    "container_authorization_token_file",
    "web_identity_token_file",
    "role_arn",
    "role_session_name",
    "skip_signature",
    "copy_if_not_exists",
    "conditional_put",
    "disable_tagging",
    "disable_bulk_delete",
    "request_payer",
    "server_side_encryption",
    "sse_kms_key_id",
    "sse_bucket_key_enabled",
    // GCS (GoogleConfigKey): service_account is the path of a key file.
    "service_account",
    "service_account_path",
    "base_url",
    "application_credentials",
    // Azure (AzureConfigKey)
    "account_name",
    "client_id",
    "tenant_id",
    "authority_id",
    "authority_host",
    "use_emulator",
    "msi_endpoint",
    "identity_endpoint",
    "object_id",
    "msi_resource_id",
    "federated_token_file",
    "use_fabric_endpoint",
    "use_azure_cli",
    "container_name",
    "fabric_token_service_url",
    "fabric_workload_host",
    "fabric_cluster_identifier",
    "credential_type",
    // HTTP client (ClientConfigKey); proxy_url may carry a password and stays secret.
    "allow_http",
    "allow_invalid_certificates",
    "disable_system_certificates",
    "connect_timeout",
    "default_content_type",
    "http1_only",
    "http2_only",
    "http2_keep_alive_interval",
    "http2_keep_alive_timeout",
    "http2_keep_alive_while_idle",
    "http2_max_frame_size",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_ca_certificate",
    "proxy_excludes",
    "randomize_addresses",
    "read_timeout",
    "timeout",
    "user_agent",
];

/// A POSIX mode given as octal text (`0644`, `755`): permission bits only.
fn parse_mode(v: &str) -> Option<u32> {
    u32::from_str_radix(v.trim(), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
}

/// How often a loaded directory of a mount is listed again from the under-store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPolicy {
    /// Immutable data: loaded once, never re-listed (`sync_interval=never`).
    Never,
    /// Re-listed on every access (`sync_interval=always`).
    Always,
    /// Re-listed on access once this long has passed since the last listing.
    Every(std::time::Duration),
}

/// A store URI as messages show it: the user information of its authority (`user:password@`,
/// which a URI of no scheme Granary knows may still carry) as `***@`, so that a refused
/// URI never echoes a secret to a terminal or a log.
pub fn shown_uri(uri: &str) -> String {
    let Some(start) = uri.find("://").map(|i| i + 3) else {
        return uri.to_string();
    };
    let end = uri[start..]
        .find(['/', '?', '#'])
        .map_or(uri.len(), |i| start + i);
    match uri[start..end].rfind('@') {
        Some(at) => format!("{}***{}", &uri[..start], &uri[start + at..]),
        None => uri.to_string(),
    }
}

/// Default `sync_interval`: short, so a changed dataset is seen soon (the safe choice);
/// immutable datasets should say `never`.
pub const DEFAULT_SYNC_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Default `part_size`: one ranged GET of a cold read fetches this much (rounded up to whole
/// cache pages), streamed to the reader page by page as it arrives.
pub const DEFAULT_PART_SIZE: u64 = 8 * 1024 * 1024;
/// Default `part_concurrency`: ranged GETs one sequential cold reader keeps in flight.
pub const DEFAULT_PART_CONCURRENCY: usize = 8;
/// Bounds of `part_size` and `part_concurrency`.
pub const PART_SIZE_RANGE: std::ops::RangeInclusive<u64> = 64 * 1024..=256 * 1024 * 1024;
pub const PART_CONCURRENCY_RANGE: std::ops::RangeInclusive<usize> = 1..=64;

/// Accepted `write_mode` values (writes arrive with the FUSE write path).
pub const WRITE_MODES: &[&str] = &["cache-through", "async-through", "must-cache", "through"];

fn parse_sync(v: &str) -> Option<SyncPolicy> {
    match v.trim().to_ascii_lowercase().as_str() {
        "never" => Some(SyncPolicy::Never),
        "always" | "0" | "0s" => Some(SyncPolicy::Always),
        other => humantime::parse_duration(other).ok().map(SyncPolicy::Every),
    }
}

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
    #[error("{message}")]
    Probe { message: String },
}

/// Did the store refuse the credentials or the access? object_store reports many HTTP
/// failures as `Generic`; the status line or the store's error code tells.
pub fn is_access_denied(e: &object_store::Error) -> bool {
    if matches!(
        e,
        object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }
    ) {
        return true;
    }
    let text = e.to_string();
    [
        "403 Forbidden",
        "401 Unauthorized",
        "AccessDenied",
        "SignatureDoesNotMatch",
        "InvalidAccessKeyId",
        "AuthenticationFailed",
    ]
    .iter()
    .any(|m| text.contains(m))
}

/// The kinds of under-store Granary mounts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Local,
    S3,
    Gcs,
    Azure,
}

impl Kind {
    fn of(url: &Url) -> Option<Self> {
        Some(match url.scheme() {
            "file" => Self::Local,
            "s3" | "s3a" => Self::S3,
            "gs" => Self::Gcs,
            "az" | "azure" | "abfs" | "abfss" => Self::Azure,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::S3 => "S3",
            Self::Gcs => "GCS",
            Self::Azure => "Azure Blob",
        }
    }

    /// Is `key` a configuration key object_store knows for this kind of store?
    fn knows(self, key: &str) -> bool {
        let key = key.to_ascii_lowercase();
        match self {
            Self::Local => false,
            Self::S3 => key.parse::<object_store::aws::AmazonS3ConfigKey>().is_ok(),
            Self::Gcs => key.parse::<object_store::gcp::GoogleConfigKey>().is_ok(),
            Self::Azure => key.parse::<object_store::azure::AzureConfigKey>().is_ok(),
        }
    }

    fn key_doc(self) -> &'static str {
        match self {
            Self::Local => "local mounts take only Granary's options",
            Self::S3 => "see object_store's AmazonS3ConfigKey, e.g. endpoint, region, access_key_id, secret_access_key, allow_http, skip_signature",
            Self::Gcs => "see object_store's GoogleConfigKey, e.g. service_account, service_account_key, bucket",
            Self::Azure => "see object_store's AzureConfigKey, e.g. account_name, access_key, use_emulator, sas_key",
        }
    }
}

/// Time allowed for the reachability check of a new mount.
pub const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// A mount's under-store as configured: URI and options (may hold credentials).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UfsSpec {
    pub uri: String,
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

/// The version of an object a read expects (from the listing that made the inode).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    pub etag: String,
    pub size: u64,
    pub mtime_ms: i64,
}

impl Expected {
    /// `Precondition` (a changed object, never served) when `meta` is not this version.
    pub fn check(&self, meta: &object_store::ObjectMeta) -> Result<(), object_store::Error> {
        match self.mismatch(meta) {
            None => Ok(()),
            Some(why) => Err(object_store::Error::Precondition {
                path: meta.location.to_string(),
                source: format!("the object changed since it was listed: {why}").into(),
            }),
        }
    }

    /// Why `meta` (from a read's response) is not this version, if it is not.
    pub fn mismatch(&self, meta: &object_store::ObjectMeta) -> Option<String> {
        if let Some(have) = &meta.e_tag {
            // Listings and reads may quote the same ETag differently (GCS does).
            if !self.etag.is_empty() && bare_etag(have) != bare_etag(&self.etag) {
                return Some(format!("ETag {have}, expected {}", self.etag));
            }
        }
        if meta.size != self.size {
            return Some(format!("{} bytes, expected {}", meta.size, self.size));
        }
        if self.etag.is_empty() && self.mtime_ms != 0 {
            let have = meta.last_modified.timestamp_millis();
            if have.div_euclid(1000) != self.mtime_ms.div_euclid(1000) {
                return Some(format!(
                    "modified at {have} ms, expected {} ms",
                    self.mtime_ms
                ));
            }
        }
        None
    }
}

/// An ETag without its weak marker and quotes (`W/"abc"` and `"abc"` → `abc`). Stores
/// quote the same ETag differently in listings and responses (GCS lists it bare and sends
/// it quoted), and a bare ETag may itself begin with `W/` (a base64 MD5 does one time in
/// 4,096): `W/` is a marker only in front of a quote.
pub fn bare_etag(e: &str) -> &str {
    let e = e.trim();
    if let Some(rest) = e.strip_prefix("W/\"") {
        return rest.strip_suffix('"').unwrap_or(rest);
    }
    e.strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .unwrap_or(e)
}

impl From<&granary_proto::Fingerprint> for Expected {
    fn from(f: &granary_proto::Fingerprint) -> Self {
        Self {
            etag: f.etag.clone(),
            size: f.size,
            mtime_ms: f.mtime_ms,
        }
    }
}

/// An opened under-store: the store and the path prefix of the mount inside it.
#[derive(Clone)]
pub struct Ufs {
    pub store: Arc<dyn ObjectStore>,
    /// The same store's one-request-per-page listing (S3, GCS, Azure): a folder is listed
    /// page by page, each page under its own deadline (see [`Ufs::folder_pages`]). `None`
    /// for stores listed in one call (folders, memory) and for stores wrapped by tests,
    /// whose faults must see every listing.
    pub pager: Option<Arc<dyn PaginatedListStore>>,
    pub prefix: StorePath,
    /// Bytes one ranged GET of a cold read asks for (`part_size`).
    pub part_size: u64,
    /// Ranged GETs one sequential cold reader keeps in flight (`part_concurrency`).
    pub part_concurrency: usize,
    /// The same store when it is a local folder (`file://`), for readers that open its
    /// files themselves ([`ConfinedLocal::open_blocking`]). `None` for every other store
    /// and for a folder wrapped by tests, whose faults must see every read.
    pub local: Option<ConfinedLocal>,
}

impl std::fmt::Debug for Ufs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ufs")
            .field("store", &self.store)
            .field("paged", &self.pager.is_some())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Ufs {
    /// Reads `range` of the object at `rel`, failing with `Precondition` if the object is
    /// no longer the version `expect` describes (so bytes of two versions are never mixed):
    /// `If-Match` on its ETag, and the response checked too — its ETag, its size and, for a
    /// store that lists no ETag, its modification time (to the second, the precision of
    /// `Last-Modified`).
    pub async fn read_range(
        &self,
        rel: &str,
        expect: Option<&Expected>,
        range: std::ops::Range<u64>,
    ) -> Result<bytes::Bytes, object_store::Error> {
        self.get_range(rel, expect, range).await?.bytes().await
    }

    /// Starts a ranged GET like [`Ufs::read_range`] (same version checks on the response
    /// head) and returns it unread, so the body can be streamed.
    pub async fn get_range(
        &self,
        rel: &str,
        expect: Option<&Expected>,
        range: std::ops::Range<u64>,
    ) -> Result<object_store::GetResult, object_store::Error> {
        let etag = expect.map(|e| e.etag.clone()).filter(|e| !e.is_empty());
        let opts = object_store::GetOptions {
            if_match: etag.clone(),
            range: Some(object_store::GetRange::Bounded(range)),
            ..Default::default()
        };
        let path = self.path_of(rel);
        let got = self.store.get_opts(&path, opts).await?;
        if let Some(want) = expect {
            want.check(&got.meta)?;
        }
        Ok(got)
    }

    /// The store path of `rel` (a `/`-separated path relative to the mount root), naming
    /// the object exactly as the store listed it. (`Path::join` would percent-encode
    /// non-ASCII and some ASCII characters, which then name a different key.)
    pub fn path_of(&self, rel: &str) -> StorePath {
        let parts: Vec<&str> = self
            .prefix
            .as_ref()
            .split('/')
            .chain(rel.split('/'))
            .filter(|s| !s.is_empty())
            .collect();
        match StorePath::parse(parts.join("/")) {
            Ok(p) => p,
            Err(_) => {
                // A name object_store refuses raw (e.g. `..`): fall back to its encoding.
                let mut p = self.prefix.clone();
                for part in rel.split('/').filter(|s| !s.is_empty()) {
                    p = p.clone().join(part);
                }
                p
            }
        }
    }
}

/// The fingerprint of an object as its metadata (a listing, a HEAD) describes it.
pub fn fingerprint_of(o: &object_store::ObjectMeta) -> granary_proto::Fingerprint {
    granary_proto::Fingerprint {
        etag: o.e_tag.clone().unwrap_or_default(),
        size: o.size,
        mtime_ms: o.last_modified.timestamp_millis(),
        version_id: o.version.clone().unwrap_or_default(),
    }
}

/// Is `key` a credential whose value must never be shown? Every key is, except Granary's
/// own ([`GRANARY_OPTION_KEYS`]) and the store keys known not to be
/// ([`PUBLIC_STORE_KEYS`]): secret by default.
pub fn is_secret_key(key: &str) -> bool {
    let k = key.trim().to_ascii_lowercase();
    if GRANARY_OPTION_KEYS.contains(&k.as_str()) || PUBLIC_STORE_KEYS.contains(&k.as_str()) {
        return false;
    }
    let base = ["aws_", "google_", "azure_storage_", "azure_"]
        .iter()
        .find_map(|p| k.strip_prefix(p));
    !base.is_some_and(|b| PUBLIC_STORE_KEYS.contains(&b))
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

    /// The kind of store the URI names; unknown schemes and URIs without a bucket are
    /// refused.
    pub fn kind(&self) -> Result<Kind, UfsError> {
        let url = Url::parse(&self.uri).map_err(|e| UfsError::InvalidUri {
            uri: shown_uri(&self.uri),
            reason: e.to_string(),
        })?;
        let kind = Kind::of(&url).ok_or_else(|| UfsError::InvalidUri {
            uri: shown_uri(&self.uri),
            reason: format!(
                "unsupported scheme {:?}; use s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or file:///dir",
                url.scheme()
            ),
        })?;
        if url.password().is_some() {
            return Err(UfsError::InvalidUri {
                uri: "(not shown: it holds a password)".into(),
                reason: "give credentials as mount options (--option-file, --option-env), not in the URI".into(),
            });
        }
        if kind != Kind::Local && url.host_str().is_none_or(str::is_empty) {
            return Err(UfsError::InvalidUri {
                uri: self.uri.clone(),
                reason: format!("no {} bucket or container named", kind.name()),
            });
        }
        Ok(kind)
    }

    fn validate_options(&self) -> Result<(), UfsError> {
        let kind = self.kind()?;
        for (k, v) in self.store_options() {
            if !kind.knows(k) {
                return Err(UfsError::InvalidOption {
                    key: k.clone(),
                    value: if is_secret_key(k) {
                        "***".into()
                    } else {
                        v.clone()
                    },
                    reason: format!(
                        "not a Granary option ({}) nor a {} option ({})",
                        GRANARY_OPTION_KEYS.join(", "),
                        kind.name(),
                        kind.key_doc()
                    ),
                });
            }
        }
        for key in ["read_only", "validate_on_open"] {
            if let Some(v) = self.options.get(key) {
                if parse_bool(v).is_none() {
                    return Err(UfsError::InvalidOption {
                        key: key.into(),
                        value: v.clone(),
                        reason: "expected true or false".into(),
                    });
                }
            }
        }
        if let Some(v) = self.options.get("sync_interval") {
            if parse_sync(v).is_none() {
                return Err(UfsError::InvalidOption {
                    key: "sync_interval".into(),
                    value: v.clone(),
                    reason: "expected never, always or a duration such as 30s or 5m".into(),
                });
            }
        }
        if let Some(v) = self.options.get("part_size") {
            let ok = crate::size::parse_size(v)
                .ok()
                .filter(|n| PART_SIZE_RANGE.contains(n));
            if ok.is_none() {
                return Err(UfsError::InvalidOption {
                    key: "part_size".into(),
                    value: v.clone(),
                    reason: "expected a size from 64KiB to 256MiB, such as 8MiB".into(),
                });
            }
        }
        if let Some(v) = self.options.get("list_page_keys") {
            let ok = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=LIST_PAGE_KEYS).contains(n));
            if ok.is_none() {
                return Err(UfsError::InvalidOption {
                    key: "list_page_keys".into(),
                    value: v.clone(),
                    reason: "expected a whole number from 1 to 1000".into(),
                });
            }
        }
        if let Some(v) = self.options.get("part_concurrency") {
            let ok = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| PART_CONCURRENCY_RANGE.contains(n));
            if ok.is_none() {
                return Err(UfsError::InvalidOption {
                    key: "part_concurrency".into(),
                    value: v.clone(),
                    reason: "expected a whole number from 1 to 64".into(),
                });
            }
        }
        for key in ["uid", "gid"] {
            if let Some(v) = self.options.get(key) {
                if v.trim().parse::<u32>().is_err() {
                    return Err(UfsError::InvalidOption {
                        key: key.into(),
                        value: v.clone(),
                        reason: "expected a numeric id such as 1000".into(),
                    });
                }
            }
        }
        for key in ["file_mode", "dir_mode"] {
            if let Some(v) = self.options.get(key) {
                if parse_mode(v).is_none() {
                    return Err(UfsError::InvalidOption {
                        key: key.into(),
                        value: v.clone(),
                        reason: "expected octal permission bits such as 0644".into(),
                    });
                }
            }
        }
        if let Some(v) = self.options.get("symlinks") {
            if Symlinks::parse(v).is_none() {
                return Err(UfsError::InvalidOption {
                    key: "symlinks".into(),
                    value: v.clone(),
                    reason: "expected none (follow no symbolic link) or inside (follow links that stay inside the mount's folder)".into(),
                });
            }
            if kind != Kind::Local {
                return Err(UfsError::InvalidOption {
                    key: "symlinks".into(),
                    value: v.clone(),
                    reason: "only file:// mounts have symbolic links".into(),
                });
            }
        }
        if let Some(v) = self.options.get("write_mode") {
            if !WRITE_MODES.contains(&v.as_str()) {
                return Err(UfsError::InvalidOption {
                    key: "write_mode".into(),
                    value: v.clone(),
                    reason: format!("expected one of {}", WRITE_MODES.join(", ")),
                });
            }
        }
        Ok(())
    }

    /// The mount's `sync_interval` ([`DEFAULT_SYNC_INTERVAL`] when unset).
    pub fn sync_policy(&self) -> SyncPolicy {
        self.options
            .get("sync_interval")
            .and_then(|v| parse_sync(v))
            .unwrap_or(SyncPolicy::Every(DEFAULT_SYNC_INTERVAL))
    }

    /// The owner shown for the mount's entries that have none of their own (`uid`, `gid`;
    /// a missing one of the two is 0).
    pub fn owner(&self) -> Option<(u32, u32)> {
        let id = |k: &str| {
            self.options
                .get(k)
                .and_then(|v| v.trim().parse::<u32>().ok())
        };
        match (id("uid"), id("gid")) {
            (None, None) => None,
            (u, g) => Some((u.unwrap_or(0), g.unwrap_or(0))),
        }
    }

    /// Permission bits shown for the mount's files (`file_mode`) or directories
    /// (`dir_mode`) that have none of their own.
    pub fn default_mode(&self, dir: bool) -> Option<u32> {
        let key = if dir { "dir_mode" } else { "file_mode" };
        self.options.get(key).and_then(|v| parse_mode(v))
    }

    /// `validate_on_open`: check the object's fingerprint at every open.
    pub fn validate_on_open(&self) -> bool {
        self.options
            .get("validate_on_open")
            .and_then(|v| parse_bool(v))
            .unwrap_or(false)
    }

    /// `part_size` ([`DEFAULT_PART_SIZE`] when unset).
    pub fn part_size(&self) -> u64 {
        self.options
            .get("part_size")
            .and_then(|v| crate::size::parse_size(v).ok())
            .unwrap_or(DEFAULT_PART_SIZE)
    }

    /// `list_page_keys` ([`LIST_PAGE_KEYS`] when unset).
    pub fn list_page_keys(&self) -> usize {
        self.options
            .get("list_page_keys")
            .and_then(|v| v.trim().parse().ok())
            .filter(|n| (1..=LIST_PAGE_KEYS).contains(n))
            .unwrap_or(LIST_PAGE_KEYS)
    }

    /// `part_concurrency` ([`DEFAULT_PART_CONCURRENCY`] when unset).
    pub fn part_concurrency(&self) -> usize {
        self.options
            .get("part_concurrency")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_PART_CONCURRENCY)
    }

    /// The directory of a `file://` mount (None for object stores).
    pub fn local_dir(&self) -> Option<std::path::PathBuf> {
        let url = Url::parse(&self.uri).ok()?;
        if url.scheme() != "file" {
            return None;
        }
        url.to_file_path().ok()
    }

    /// The `symlinks` option of a `file://` mount ([`Symlinks::None`] when unset).
    pub fn symlinks(&self) -> Symlinks {
        self.options
            .get("symlinks")
            .and_then(|v| Symlinks::parse(v))
            .unwrap_or_default()
    }

    /// The `file://` store of this spec, confined to its folder (None for object stores).
    pub fn open_local(&self) -> Option<std::io::Result<ConfinedLocal>> {
        let dir = self.local_dir()?;
        Some(
            ConfinedLocal::new(&dir, self.symlinks())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::NotFound, e)),
        )
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
            // Confined to the folder: symbolic links leaving it are never followed.
            let store =
                ConfinedLocal::new(&dir, self.symlinks()).map_err(|source| UfsError::Open {
                    uri: self.uri.clone(),
                    source,
                })?;
            return Ok(Ufs {
                store: Arc::new(store.clone()),
                pager: None,
                prefix: StorePath::default(),
                part_size: self.part_size(),
                part_concurrency: self.part_concurrency(),
                local: Some(store),
            });
        }
        let (store, pager, prefix) =
            open_object_store(&url, self.store_options()).map_err(|source| UfsError::Open {
                uri: self.uri.clone(),
                source,
            })?;
        Ok(Ufs {
            store,
            pager,
            prefix,
            part_size: self.part_size(),
            part_concurrency: self.part_concurrency(),
            local: None,
        })
    }
}

impl UfsSpec {
    /// `text` with every secret option value replaced by `***` (error messages of stores
    /// can echo request URLs, which carry SAS tokens and the like).
    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.replace('\n', " ");
        for (k, v) in &self.options {
            if is_secret_key(k) && v.len() >= 4 {
                out = out.replace(v.as_str(), "***");
            }
        }
        out
    }

    /// Opens the store and checks that it answers: the bucket exists and the credentials
    /// are accepted (one listing of the mount's prefix, bounded by [`PROBE_TIMEOUT`]).
    pub async fn open_and_probe(&self) -> Result<Ufs, UfsError> {
        let ufs = self.open()?;
        if self.kind()? == Kind::Local {
            return Ok(ufs);
        }
        let kind = self.kind()?.name();
        let listing = tokio::time::timeout(PROBE_TIMEOUT, ufs.list_one_page()).await;
        let message = match listing {
            Ok(Ok(_)) => return Ok(ufs),
            Ok(Err(e)) => {
                let text = e.to_string();
                let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
                // object_store reports most HTTP failures as `Generic`; the store's own error
                // code tells them apart.
                let what = match &e {
                    object_store::Error::NotFound { .. } => {
                        "the bucket or container does not exist"
                    }
                    _ if has(&["NoSuchBucket", "ContainerNotFound", "404 Not Found"]) => {
                        "the bucket or container does not exist"
                    }
                    _ if is_access_denied(&e) => "the credentials were refused",
                    _ => "the store could not be listed",
                };
                format!(
                    "{kind} under-store {} is not usable: {what} ({e})",
                    self.uri
                )
            }
            Err(_) => format!(
                "{kind} under-store {} did not answer within {PROBE_TIMEOUT:?}",
                self.uri
            ),
        };
        Err(UfsError::Probe {
            message: self.scrub(&message),
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

/// Every option key `object_store` accepts for S3, GCS and Azure, with whether it is a
/// credential: the table the secrecy tests run over (checked against `object_store`'s own
/// key parsers, so it cannot drift from the crate).
pub mod known_keys {
    use super::Kind;

    /// Every key string object_store 0.14 accepts (its `FromStr` of AmazonS3ConfigKey,
    /// GoogleConfigKey, AzureConfigKey and ClientConfigKey), with the ones that are
    /// credentials marked.
    pub const S3_KEYS: &[(&str, bool)] = &[
        ("aws_access_key_id", false),
        ("access_key_id", false),
        ("aws_secret_access_key", true),
        ("secret_access_key", true),
        ("aws_default_region", false),
        ("default_region", false),
        ("aws_region", false),
        ("region", false),
        ("aws_bucket", false),
        ("aws_bucket_name", false),
        ("bucket_name", false),
        ("bucket", false),
        ("aws_endpoint_url", false),
        ("aws_endpoint", false),
        ("endpoint_url", false),
        ("endpoint", false),
        ("aws_endpoint_url_s3", false),
        ("aws_session_token", true),
        ("aws_token", true),
        ("session_token", true),
        ("token", true),
        ("aws_virtual_hosted_style_request", false),
        ("virtual_hosted_style_request", false),
        ("aws_s3_express", false),
        ("s3_express", false),
        ("aws_imdsv1_fallback", false),
        ("imdsv1_fallback", false),
        ("aws_metadata_endpoint", false),
        ("metadata_endpoint", false),
        ("aws_unsigned_payload", false),
        ("unsigned_payload", false),
        ("aws_checksum_algorithm", false),
        ("checksum_algorithm", false),
        ("aws_container_credentials_relative_uri", false),
        ("container_credentials_relative_uri", false),
        ("aws_container_credentials_full_uri", false),
        ("container_credentials_full_uri", false),
        ("aws_container_authorization_token_file", false),
        ("container_authorization_token_file", false),
        ("aws_web_identity_token_file", false),
        ("web_identity_token_file", false),
        ("aws_role_arn", false),
        ("role_arn", false),
        ("aws_role_session_name", false),
        ("role_session_name", false),
        ("aws_endpoint_url_sts", false),
        ("endpoint_url_sts", false),
        ("aws_skip_signature", false),
        ("skip_signature", false),
        ("aws_copy_if_not_exists", false),
        ("copy_if_not_exists", false),
        ("aws_conditional_put", false),
        ("conditional_put", false),
        ("aws_disable_tagging", false),
        ("disable_tagging", false),
        ("aws_disable_bulk_delete", false),
        ("disable_bulk_delete", false),
        ("aws_request_payer", false),
        ("request_payer", false),
        ("aws_allow_http", false),
        ("aws_server_side_encryption", false),
        ("server_side_encryption", false),
        ("aws_sse_kms_key_id", false),
        ("sse_kms_key_id", false),
        ("aws_sse_bucket_key_enabled", false),
        ("sse_bucket_key_enabled", false),
        ("aws_sse_customer_key_base64", true),
        ("sse_customer_key_base64", true),
    ];
    pub const GCS_KEYS: &[(&str, bool)] = &[
        ("google_service_account", false),
        ("service_account", false),
        ("google_service_account_path", false),
        ("service_account_path", false),
        ("google_service_account_key", true),
        ("service_account_key", true),
        ("google_bucket", false),
        ("google_bucket_name", false),
        ("bucket", false),
        ("bucket_name", false),
        ("google_base_url", false),
        ("base_url", false),
        ("google_application_credentials", false),
        ("application_credentials", false),
        ("google_bearer_token", true),
        ("bearer_token", true),
        ("google_skip_signature", false),
        ("skip_signature", false),
    ];
    pub const AZURE_KEYS: &[(&str, bool)] = &[
        ("azure_storage_account_key", true),
        ("azure_storage_access_key", true),
        ("azure_storage_master_key", true),
        ("master_key", true),
        ("account_key", true),
        ("access_key", true),
        ("azure_storage_account_name", false),
        ("account_name", false),
        ("azure_storage_client_id", false),
        ("azure_client_id", false),
        ("client_id", false),
        ("azure_storage_client_secret", true),
        ("azure_client_secret", true),
        ("client_secret", true),
        ("azure_storage_tenant_id", false),
        ("azure_storage_authority_id", false),
        ("azure_tenant_id", false),
        ("azure_authority_id", false),
        ("tenant_id", false),
        ("authority_id", false),
        ("azure_storage_authority_host", false),
        ("azure_authority_host", false),
        ("authority_host", false),
        ("azure_storage_sas_key", true),
        ("azure_storage_sas_token", true),
        ("sas_key", true),
        ("sas_token", true),
        ("azure_storage_token", true),
        ("bearer_token", true),
        ("token", true),
        ("azure_storage_use_emulator", false),
        ("use_emulator", false),
        ("azure_storage_endpoint", false),
        ("azure_endpoint", false),
        ("endpoint", false),
        ("azure_msi_endpoint", false),
        ("azure_identity_endpoint", false),
        ("identity_endpoint", false),
        ("msi_endpoint", false),
        ("azure_object_id", false),
        ("object_id", false),
        ("azure_msi_resource_id", false),
        ("msi_resource_id", false),
        ("azure_federated_token_file", false),
        ("federated_token_file", false),
        ("azure_use_fabric_endpoint", false),
        ("use_fabric_endpoint", false),
        ("azure_use_azure_cli", false),
        ("use_azure_cli", false),
        ("azure_skip_signature", false),
        ("skip_signature", false),
        ("azure_container_name", false),
        ("container_name", false),
        ("azure_disable_tagging", false),
        ("disable_tagging", false),
        ("azure_fabric_token_service_url", false),
        ("fabric_token_service_url", false),
        ("azure_fabric_workload_host", false),
        ("fabric_workload_host", false),
        ("azure_fabric_session_token", true),
        ("fabric_session_token", true),
        ("azure_fabric_cluster_identifier", false),
        ("fabric_cluster_identifier", false),
        ("azure_credential_type", false),
        ("credential_type", false),
        ("azure_storage_encryption_key", true),
        ("encryption_key", true),
        ("azure_allow_http", false),
    ];
    /// ClientConfigKey, accepted bare and with each store's prefix.
    pub const CLIENT_KEYS: &[(&str, bool)] = &[
        ("allow_http", false),
        ("allow_invalid_certificates", false),
        ("disable_system_certificates", false),
        ("connect_timeout", false),
        ("default_content_type", false),
        ("http1_only", false),
        ("http2_only", false),
        ("http2_keep_alive_interval", false),
        ("http2_keep_alive_timeout", false),
        ("http2_keep_alive_while_idle", false),
        ("http2_max_frame_size", false),
        ("pool_idle_timeout", false),
        ("pool_max_idle_per_host", false),
        ("proxy_url", true),
        ("proxy_ca_certificate", false),
        ("proxy_excludes", false),
        ("randomize_addresses", false),
        ("read_timeout", false),
        ("timeout", false),
        ("user_agent", false),
    ];

    /// Every key of every kind with its expected verdict, each checked to be a key
    /// object_store accepts for that kind (so this list cannot drift from the crate).
    pub fn all_store_keys() -> Vec<(Kind, String, bool)> {
        let mut out = Vec::new();
        for (kind, keys, prefix) in [
            (Kind::S3, S3_KEYS, "aws_"),
            (Kind::Gcs, GCS_KEYS, "google_"),
            (Kind::Azure, AZURE_KEYS, "azure_"),
        ] {
            for (k, secret) in keys {
                out.push((kind, k.to_string(), *secret));
            }
            for (k, secret) in CLIENT_KEYS {
                out.push((kind, k.to_string(), *secret));
                out.push((kind, format!("{prefix}{k}"), *secret));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by a review: a URI with a password and a scheme Granary does not know was
    /// echoed whole in the refusal (the password check came after the scheme's).
    #[test]
    fn a_refused_uri_never_shows_its_password() {
        for uri in ["https://k:s3cr3t@h/b", "s3:/x", "weird://u:s3cr3t@host?q=1"] {
            let e = UfsSpec {
                uri: uri.into(),
                options: BTreeMap::new(),
            }
            .kind()
            .unwrap_err()
            .to_string();
            assert!(!e.contains("s3cr3t"), "{e}");
        }
        assert_eq!(shown_uri("gs://bucket/p@x"), "gs://bucket/p@x");
        assert_eq!(shown_uri("az://a:b@c/d"), "az://***@c/d");
    }

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
    fn every_credential_key_of_every_store_is_secret_and_nothing_else_is() {
        let keys = known_keys::all_store_keys();
        assert!(keys.len() > 200, "{}", keys.len());
        for (kind, key, secret) in keys {
            assert!(kind.knows(&key), "{key} is not a {} key", kind.name());
            assert_eq!(is_secret_key(&key), secret, "{} key {key}", kind.name());
            // Upper case is accepted by the key check too.
            assert_eq!(is_secret_key(&key.to_ascii_uppercase()), secret, "{key}");
            let value = format!("VALUE-OF-{key}-1234");
            let mut o = BTreeMap::new();
            o.insert(key.clone(), value.clone());
            let shown = redact(&o);
            assert_eq!(shown[&key] == "***", secret, "{key}");
            let spec = UfsSpec {
                uri: "s3://b".into(),
                options: o,
            };
            let scrubbed = spec.scrub(&format!("error near {value}"));
            assert_eq!(!scrubbed.contains(&value), secret, "{key}: {scrubbed}");
        }
        // Granary's own keys are shown; a key nobody listed is a secret.
        for k in GRANARY_OPTION_KEYS {
            assert!(!is_secret_key(k), "{k}");
        }
        assert!(is_secret_key("some_future_key"));
        assert!(is_secret_key("azure_storage_some_future_key"));
    }

    #[test]
    fn symlinks_option_and_uri_passwords() {
        let opts = |k: &str, v: &str| {
            let mut o = BTreeMap::new();
            o.insert(k.to_string(), v.to_string());
            o
        };
        assert_eq!(
            UfsSpec::new("/tmp", BTreeMap::new()).unwrap().symlinks(),
            Symlinks::None
        );
        assert_eq!(
            UfsSpec::new("/tmp", opts("symlinks", "inside"))
                .unwrap()
                .symlinks(),
            Symlinks::Inside
        );
        assert!(UfsSpec::new("/tmp", opts("symlinks", "all")).is_err());
        let e = UfsSpec::new("s3://b", opts("symlinks", "inside")).unwrap_err();
        assert!(e.to_string().contains("only file://"), "{e}");
        let e = UfsSpec::new("s3://AKIA:hunter22@bucket/p", BTreeMap::new()).unwrap_err();
        assert!(!e.to_string().contains("hunter22"), "{e}");
        assert!(e.to_string().contains("not in the URI"), "{e}");
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
    fn schemes_buckets_and_option_keys_are_checked() {
        let opts = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let e = UfsSpec::new("ftp://host/x", BTreeMap::new()).unwrap_err();
        assert!(e.to_string().contains("unsupported scheme \"ftp\""), "{e}");
        let e = UfsSpec::new("s3:///prefix", BTreeMap::new()).unwrap_err();
        assert!(e.to_string().contains("no S3 bucket"), "{e}");
        // object_store's own key names (and their aliases) pass through.
        UfsSpec::new(
            "s3://b/p",
            opts(&[
                ("endpoint", "http://127.0.0.1:9000"),
                ("access_key_id", "k"),
                ("secret_access_key", "s"),
                ("allow_http", "true"),
                ("read_only", "true"),
            ]),
        )
        .unwrap();
        UfsSpec::new("gs://b", opts(&[("service_account", "/sa.json")])).unwrap();
        UfsSpec::new("az://c", opts(&[("use_emulator", "true")])).unwrap();
        // A misspelt key is refused, and a secret value is not echoed.
        let e = UfsSpec::new("s3://b", opts(&[("secret_acess_key", "hunter22")])).unwrap_err();
        assert!(e.to_string().contains("secret_acess_key"), "{e}");
        let e = UfsSpec::new("s3://b", opts(&[("secret_key_typo", "hunter22")])).unwrap_err();
        assert!(!e.to_string().contains("hunter22"), "{e}");
        assert!(UfsSpec::new("/tmp", opts(&[("region", "x")])).is_err());
    }

    #[test]
    fn store_paths_keep_names_as_listed() {
        let ufs = Ufs {
            store: Arc::new(object_store::memory::InMemory::new()),
            pager: None,
            prefix: StorePath::from("data"),
            part_size: DEFAULT_PART_SIZE,
            part_concurrency: DEFAULT_PART_CONCURRENCY,
            local: None,
        };
        assert_eq!(
            ufs.path_of("unicodé/naïve ✓ 数据.bin").as_ref(),
            "data/unicodé/naïve ✓ 数据.bin"
        );
        assert_eq!(
            ufs.path_of("with space/a b").as_ref(),
            "data/with space/a b"
        );
        assert_eq!(ufs.path_of("").as_ref(), "data");
    }

    #[test]
    fn a_response_of_another_version_is_detected() {
        let meta = |etag: Option<&str>, size: u64, secs: i64| object_store::ObjectMeta {
            location: StorePath::from("x"),
            last_modified: chrono::DateTime::from_timestamp(secs, 0).unwrap(),
            size,
            e_tag: etag.map(str::to_string),
            version: None,
        };
        let e = Expected {
            etag: "abc".into(),
            size: 10,
            mtime_ms: 5_250,
        };
        assert_eq!(e.mismatch(&meta(Some("\"abc\""), 10, 99)), None);
        assert!(e.mismatch(&meta(Some("\"abd\""), 10, 5)).is_some());
        assert!(e.mismatch(&meta(Some("abc"), 11, 5)).is_some());
        // A bare base64 MD5 that begins with `W/` (GCS lists it so, and sends it quoted):
        // the same object, not a weak tag. (It once failed a CI run with ESTALE.)
        let e = Expected {
            etag: "W/Jgw/R5W7gtUNfkgH5Wrw==".into(),
            size: 10,
            mtime_ms: 0,
        };
        assert_eq!(
            e.mismatch(&meta(Some("\"W/Jgw/R5W7gtUNfkgH5Wrw==\""), 10, 5)),
            None
        );
        assert!(e
            .mismatch(&meta(Some("\"Jgw/R5W7gtUNfkgH5Wrw==\""), 10, 5))
            .is_some());
        // A weak tag and the strong one of the same value.
        assert_eq!(bare_etag("W/\"abc\""), "abc");
        assert_eq!(bare_etag("\"abc\""), "abc");
        assert_eq!(bare_etag("W/abc"), "W/abc");
        // Without an ETag, the modification time decides (to the second).
        let e = Expected {
            etag: String::new(),
            size: 10,
            mtime_ms: 5_250,
        };
        assert_eq!(e.mismatch(&meta(None, 10, 5)), None);
        assert!(e.mismatch(&meta(None, 10, 6)).is_some());
    }

    #[test]
    fn scrub_hides_secret_values() {
        let mut o = BTreeMap::new();
        o.insert("sas_key".to_string(), "sig=abcdef".to_string());
        o.insert("account_name".to_string(), "acct".to_string());
        let spec = UfsSpec {
            uri: "az://c".into(),
            options: o,
        };
        assert_eq!(
            spec.scrub("GET https://acct/c?sig=abcdef failed\nline"),
            "GET https://acct/c?*** failed line"
        );
    }

    #[test]
    fn sync_and_validation_options() {
        let spec = |k: &str, v: &str| {
            let mut o = BTreeMap::new();
            o.insert(k.to_string(), v.to_string());
            UfsSpec::new("/tmp", o)
        };
        assert_eq!(
            UfsSpec::new("/tmp", BTreeMap::new()).unwrap().sync_policy(),
            SyncPolicy::Every(DEFAULT_SYNC_INTERVAL)
        );
        assert_eq!(
            spec("sync_interval", "never").unwrap().sync_policy(),
            SyncPolicy::Never
        );
        assert_eq!(
            spec("sync_interval", "always").unwrap().sync_policy(),
            SyncPolicy::Always
        );
        assert_eq!(
            spec("sync_interval", "2m").unwrap().sync_policy(),
            SyncPolicy::Every(std::time::Duration::from_secs(120))
        );
        assert!(spec("sync_interval", "soon").is_err());
        assert!(spec("validate_on_open", "true").unwrap().validate_on_open());
        assert!(spec("validate_on_open", "perhaps").is_err());
        assert!(spec("write_mode", "async-through").is_ok());
        assert!(spec("write_mode", "write-back").is_err());
        // Owners and modes shown for a mount's entries.
        assert_eq!(spec("uid", "1000").unwrap().owner(), Some((1000, 0)));
        assert!(spec("uid", "alice").is_err() && spec("gid", "-1").is_err());
        assert_eq!(
            spec("dir_mode", "0750").unwrap().default_mode(true),
            Some(0o750)
        );
        assert_eq!(spec("dir_mode", "0750").unwrap().default_mode(false), None);
        assert!(spec("file_mode", "0888").is_err() && spec("file_mode", "17777").is_err());
        assert_eq!(spec("part_size", "16MiB").unwrap().part_size(), 16 << 20);
        assert_eq!(
            UfsSpec::new("/tmp", BTreeMap::new()).unwrap().part_size(),
            DEFAULT_PART_SIZE
        );
        assert!(spec("part_size", "1KiB").is_err());
        assert!(spec("part_size", "1GiB").is_err());
        assert!(spec("part_size", "big").is_err());
        assert_eq!(
            spec("part_concurrency", "16").unwrap().part_concurrency(),
            16
        );
        assert!(spec("part_concurrency", "0").is_err());
        assert_eq!(spec("list_page_keys", "7").unwrap().list_page_keys(), 7);
        assert_eq!(
            spec("list_page_keys", "1000").unwrap().list_page_keys(),
            1000
        );
        for bad in ["0", "1001", "many", "-1"] {
            assert!(spec("list_page_keys", bad).is_err(), "{bad}");
        }
        assert!(spec("part_concurrency", "65").is_err());
    }

    #[test]
    fn bad_read_only_value() {
        let mut o = BTreeMap::new();
        o.insert("read_only".to_string(), "maybe".to_string());
        assert!(UfsSpec::new("/tmp", o).is_err());
    }
}
