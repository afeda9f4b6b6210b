//! The mount table's runtime side: validating new mounts and keeping opened under-stores.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use granary_common::ufs::{redact, Ufs, UfsSpec, GRANARY_OPTION_KEYS};
use granary_proto as pb;

use crate::error::MasterError;
use crate::secrets::SecretBox;
use crate::state::{Mount, StateMachine};

/// What under-stores this master lets admins mount (`--allow-local-root`,
/// `--allow-endpoint`). An admin must not be able to mount the master's own key folder
/// (`file:///etc/granary/tls`) or point masters and workers at internal addresses.
#[derive(Debug, Clone, Default)]
pub struct MountPolicy {
    /// `file://` mounts are accepted only at or below these folders (none when empty).
    pub local_roots: Vec<PathBuf>,
    /// When not empty, every address a store option names (`endpoint`, `base_url`,
    /// `proxy_url`, …; Azure's emulator) must be one of these `HOST` (any port) or
    /// `HOST:PORT` entries.
    pub endpoints: Vec<String>,
    /// What every store a mount opens goes through (tests: faults); None in production.
    pub wrap: Option<granary_common::ufs::StoreWrap>,
}

/// Option keys (without their `aws_`/`google_`/`azure_storage_`/`azure_` prefix) whose
/// value is an address a store client connects to.
const ADDRESS_KEYS: &[&str] = &[
    "endpoint",
    "endpoint_url",
    "endpoint_url_s3",
    "endpoint_url_sts",
    "metadata_endpoint",
    "container_credentials_full_uri",
    "base_url",
    "authority_host",
    "msi_endpoint",
    "identity_endpoint",
    "fabric_token_service_url",
    "fabric_workload_host",
    "proxy_url",
];

/// Option keys (without their prefix) whose value is a file on the machine that opens the
/// store, which the store client reads (and may send away: a web identity token goes to
/// the STS endpoint): an admin naming `/etc/granary/tls/tls.key` there would read a
/// master's key. Accepted only below `--allow-local-root`.
const FILE_KEYS: &[&str] = &[
    "web_identity_token_file",
    "container_authorization_token_file",
    "service_account",
    "service_account_path",
    "application_credentials",
    "federated_token_file",
];

fn base_key(key: &str) -> String {
    let k = key.trim().to_ascii_lowercase();
    for p in ["aws_", "google_", "azure_storage_", "azure_"] {
        if let Some(b) = k.strip_prefix(p) {
            if ADDRESS_KEYS.contains(&b) || FILE_KEYS.contains(&b) || b == "use_emulator" {
                return b.to_string();
            }
        }
    }
    k
}

/// The host (lower case, an IPv6 address in brackets) and port (the scheme's default when
/// none is written) of a URL.
fn host_port(url: &str) -> Option<(String, Option<u16>)> {
    // What HTTP clients read differently from this split (a backslash is a slash to them;
    // spaces and controls) is no address of an allowed store.
    if url
        .chars()
        .any(|c| c == '\\' || c.is_whitespace() || c.is_control())
    {
        return None;
    }
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let default = match scheme.to_ascii_lowercase().as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    };
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (h, after) = v6.split_once(']')?;
        (format!("[{h}]"), after.strip_prefix(':'))
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (hostport.to_string(), None),
        }
    };
    if host.is_empty() {
        return None;
    }
    let port = match port {
        Some(p) => Some(p.parse::<u16>().ok()?),
        None => default,
    };
    Some((host.to_ascii_lowercase(), port))
}

/// Does an `--allow-endpoint` entry (`HOST`, `HOST:PORT`, `[V6]:PORT`) allow this address?
fn endpoint_allows(entry: &str, host: &str, port: Option<u16>) -> bool {
    let e = entry.trim().to_ascii_lowercase();
    let (h, p) = match e.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') || h.ends_with(']') => match p.parse::<u16>() {
            Ok(p) => (h.to_string(), Some(p)),
            Err(_) => (e.clone(), None),
        },
        _ => (e.clone(), None),
    };
    h.trim_matches(['[', ']']) == host.trim_matches(['[', ']']) && (p.is_none() || p == port)
}

impl MountPolicy {
    /// Refuses a `file://` folder outside the allowed roots: first as written, then as
    /// resolved (a link inside an allowed root cannot lead out of it).
    pub fn check_local(&self, dir: &Path) -> Result<(), MasterError> {
        let shown = dir.display();
        let refuse = |detail: String| MasterError::PermissionDenied {
            message: if self.local_roots.is_empty() {
                format!(
                    "this master allows no file:// mounts ({shown} was asked); start the masters with --allow-local-root DIR to allow folders below DIR"
                )
            } else {
                format!(
                    "{shown} {detail} a folder the masters allow for file:// mounts ({}; --allow-local-root)",
                    self.local_roots
                        .iter()
                        .map(|r| r.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
        };
        // (A relative or empty root would be "below" anything: never a root.)
        let roots: Vec<(PathBuf, Option<PathBuf>)> = self
            .local_roots
            .iter()
            .filter(|r| r.is_absolute())
            .map(|r| (r.clone(), std::fs::canonicalize(r).ok()))
            .collect();
        let lexical = roots
            .iter()
            .any(|(r, c)| dir.starts_with(r) || c.as_ref().is_some_and(|c| dir.starts_with(c)));
        if !lexical {
            return Err(refuse("is not below".into()));
        }
        let Ok(real) = std::fs::canonicalize(dir) else {
            return Err(granary_common::ufs::UfsError::MissingDirectory {
                path: shown.to_string(),
            }
            .into());
        };
        if !roots
            .iter()
            .any(|(_, c)| c.as_ref().is_some_and(|c| real.starts_with(c)))
        {
            return Err(refuse(format!(
                "resolves to {}, which is not below",
                real.display()
            )));
        }
        Ok(())
    }

    /// Refuses store options naming an address outside `--allow-endpoint` (when given).
    pub fn check_endpoints(&self, spec: &UfsSpec) -> Result<(), MasterError> {
        if self.endpoints.is_empty() {
            return Ok(());
        }
        for (k, v) in &spec.options {
            let base = base_key(k);
            let address = if base == "use_emulator" {
                if !matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes") {
                    continue;
                }
                "http://127.0.0.1:10000".to_string()
            } else if ADDRESS_KEYS.contains(&base.as_str()) {
                if v.contains("://") {
                    v.clone()
                } else {
                    format!("https://{v}")
                }
            } else {
                continue;
            };
            let allowed = host_port(&address).is_some_and(|(host, port)| {
                self.endpoints
                    .iter()
                    .any(|e| endpoint_allows(e, &host, port))
            });
            if !allowed {
                return Err(MasterError::PermissionDenied {
                    message: format!(
                        "the mount option {k} names an address the masters do not allow ({}); allowed: {} (--allow-endpoint)",
                        spec.scrub(&address),
                        self.endpoints.join(", ")
                    ),
                });
            }
        }
        Ok(())
    }

    /// Refuses options naming a local file (credential files the store client reads)
    /// outside `--allow-local-root`.
    pub fn check_files(&self, spec: &UfsSpec) -> Result<(), MasterError> {
        for (k, v) in &spec.options {
            if FILE_KEYS.contains(&base_key(k).as_str()) {
                self.check_local(Path::new(v.trim())).map_err(|e| match e {
                    MasterError::PermissionDenied { message } => MasterError::PermissionDenied {
                        message: format!("the mount option {k}: {message}"),
                    },
                    e => e,
                })?;
            }
        }
        Ok(())
    }

    /// Checks a spec (its options in clear) against the policy (local folder, credential
    /// files, addresses).
    pub fn check(&self, spec: &UfsSpec) -> Result<(), MasterError> {
        if let Some(dir) = spec.local_dir() {
            self.check_local(&dir)?;
        }
        self.check_files(spec)?;
        self.check_endpoints(spec)
    }
}

/// Opened under-stores, by mount id (opening is cheap but not free: clients, credentials),
/// with the mount's options opened ([`crate::secrets`]).
#[derive(Default)]
pub struct UfsCache {
    stores: Mutex<HashMap<u64, (String, Ufs, UfsSpec)>>,
    secrets: Option<Arc<SecretBox>>,
    policy: MountPolicy,
}

impl UfsCache {
    pub fn new(secrets: Option<Arc<SecretBox>>) -> UfsCache {
        UfsCache {
            stores: Mutex::default(),
            secrets,
            policy: MountPolicy::default(),
        }
    }

    /// The cache with the masters' mount policy (checked for new mounts, and again before
    /// a stored mount is opened or handed to a worker).
    pub fn with_policy(mut self, policy: MountPolicy) -> UfsCache {
        self.policy = policy;
        self
    }

    pub fn policy(&self) -> &MountPolicy {
        &self.policy
    }

    /// The opened store of `mount`, reopened if the mount's URI changed.
    pub fn get(&self, mount: &Mount) -> Result<Ufs, MasterError> {
        self.get_with_spec(mount).map(|(ufs, _)| ufs)
    }

    /// The opened store and the mount's spec with its credentials in clear.
    fn get_with_spec(&self, mount: &Mount) -> Result<(Ufs, UfsSpec), MasterError> {
        let mut map = match self.stores.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some((uri, ufs, spec)) = map.get(&mount.id) {
            if *uri == mount.spec.uri {
                return Ok((ufs.clone(), spec.clone()));
            }
        }
        let spec = self.open_spec(mount)?;
        let mut ufs = spec.open()?;
        if let Some(wrap) = &self.policy.wrap {
            ufs.store = (wrap.0)(ufs.store);
            // Listings go through the wrapped store too.
            ufs.pager = None;
            // Reads as well (nobody opens the folder's files directly).
            ufs.local = None;
        }
        map.insert(
            mount.id,
            (mount.spec.uri.clone(), ufs.clone(), spec.clone()),
        );
        Ok((ufs, spec))
    }

    /// The mount's spec with its credentials in clear (for a worker, or to open it). A
    /// mount the policy no longer allows (added before it, or under other flags) is refused.
    pub fn open_spec(&self, mount: &Mount) -> Result<UfsSpec, MasterError> {
        // Checked in clear: a sealed value (a proxy URL holding a password) names no address.
        let spec = crate::secrets::open_spec(self.secrets.as_deref(), &mount.spec)?;
        self.policy.check(&spec).map_err(|e| match e {
            MasterError::PermissionDenied { message } => MasterError::PermissionDenied {
                message: format!("mount {}: {}", mount.path, spec.scrub(&message)),
            },
            e => e,
        })?;
        Ok(spec)
    }

    /// Validates a requested mount before it is proposed: the URI parses, the options are
    /// known, the policy allows its folder or addresses (checked before the store is
    /// contacted), the store opens, a local directory exists, and a remote store answers a
    /// listing of the prefix (bucket exists, credentials accepted).
    pub async fn validate_new(
        &self,
        uri: &str,
        options: &[pb::MountOptionEntry],
    ) -> Result<UfsSpec, MasterError> {
        let spec = parse_new(uri, options)?;
        self.policy.check(&spec)?;
        spec.open_and_probe().await?;
        Ok(spec)
    }

    /// The spec of a new mount with its credentials sealed, ready to be proposed.
    pub fn seal_spec(&self, spec: UfsSpec) -> Result<UfsSpec, MasterError> {
        crate::secrets::seal_spec(self.secrets.as_deref(), spec)
    }

    /// `text` with the mount's credentials replaced by `***`.
    pub fn scrub(&self, mount: &Mount, text: &str) -> String {
        match self.get_with_spec(mount) {
            Ok((_, spec)) => spec.scrub(text),
            Err(_) => mount.spec.scrub(text),
        }
    }

    pub fn forget(&self, mount_id: u64) {
        if let Ok(mut map) = self.stores.lock() {
            map.remove(&mount_id);
        }
    }
}

/// Validates a requested mount before it is proposed: the URI parses, the options are known,
/// the store opens, a local directory exists, and a remote store answers a listing of the
/// prefix (bucket exists, credentials accepted).
fn parse_new(uri: &str, options: &[pb::MountOptionEntry]) -> Result<UfsSpec, MasterError> {
    if uri.trim().is_empty() {
        return Err(MasterError::invalid("the under-store URI is empty"));
    }
    let mut opts = BTreeMap::new();
    for o in options {
        if o.key.is_empty() {
            return Err(MasterError::invalid("a mount option has an empty key"));
        }
        opts.insert(o.key.clone(), o.value.clone());
    }
    Ok(UfsSpec::new(uri, opts)?)
}

/// A mount as `ListMounts` shows it. An admin sees every option (credentials as `***`);
/// anyone else only Granary's own options (`write_mode`, `read_only`, modes…, which mounts
/// need to behave), never the store's configuration.
pub fn mount_info(m: &Mount, admin: bool) -> pb::MountInfo {
    pb::MountInfo {
        mount_id: m.id,
        path: m.path.clone(),
        uri: m.spec.uri.clone(),
        options: redact(&m.spec.options)
            .into_iter()
            .filter(|(key, _)| admin || GRANARY_OPTION_KEYS.contains(&key.as_str()))
            .map(|(key, value)| pb::MountOptionEntry { key, value })
            .collect(),
        read_only: m.spec.read_only(),
    }
}

pub fn find_mount(sm: &StateMachine, id: u64) -> Result<Mount, MasterError> {
    sm.mount(id)?
        .ok_or_else(|| MasterError::not_found(format!("mount {id}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(uri: &str, opts: &[(&str, &str)]) -> UfsSpec {
        UfsSpec {
            uri: uri.into(),
            options: opts
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn local_mounts_only_below_allowed_roots() {
        let tmp = std::env::temp_dir().join(format!("granary-policy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let allowed = tmp.join("allowed");
        std::fs::create_dir_all(allowed.join("data")).unwrap();
        std::fs::create_dir_all(tmp.join("other")).unwrap();
        std::os::unix::fs::symlink(tmp.join("other"), allowed.join("escape")).unwrap();
        let none = MountPolicy::default();
        let e = none.check_local(&allowed.join("data")).unwrap_err();
        assert!(matches!(e, MasterError::PermissionDenied { .. }), "{e}");
        assert!(e.to_string().contains("--allow-local-root"), "{e}");
        let p = MountPolicy {
            local_roots: vec![allowed.clone()],
            endpoints: vec![],
            ..MountPolicy::default()
        };
        p.check_local(&allowed).unwrap();
        p.check_local(&allowed.join("data")).unwrap();
        let e = p.check_local(&tmp.join("other")).unwrap_err();
        assert!(e.to_string().contains("--allow-local-root"), "{e}");
        // Lexically inside, really outside.
        let e = p.check_local(&allowed.join("escape")).unwrap_err();
        assert!(e.to_string().contains("resolves to"), "{e}");
        // `allowed-x` is not below `allowed`.
        std::fs::create_dir_all(tmp.join("allowed-x")).unwrap();
        assert!(p.check_local(&tmp.join("allowed-x")).is_err());
        // A missing folder below a root is the usual missing-folder error.
        let relative = MountPolicy {
            local_roots: vec![PathBuf::new(), PathBuf::from("tmp")],
            endpoints: vec![],
            ..MountPolicy::default()
        };
        assert!(relative.check_local(&allowed.join("data")).is_err());
        let e = p.check_local(&allowed.join("nope")).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        // Stored mounts are checked when opened too.
        let cache = UfsCache::new(None).with_policy(p);
        let m = Mount {
            id: 1,
            path: "/x".into(),
            spec: spec(&format!("file://{}", tmp.join("other").display()), &[]),
            inode: 2,
        };
        let e = cache.open_spec(&m).unwrap_err();
        assert!(e.to_string().starts_with("mount /x: "), "{e}");
        let _ = std::fs::remove_dir_all(&tmp);
    }

    /// Found by review: a credential-file option read (and sent to an STS endpoint) a file
    /// of the master's choosing; a backslash made an HTTP client connect elsewhere than the
    /// allow-list saw.
    #[test]
    fn credential_files_and_tricky_addresses_are_refused() {
        let none = MountPolicy::default();
        for k in [
            "aws_web_identity_token_file",
            "web_identity_token_file",
            "google_service_account",
            "service_account_path",
            "google_application_credentials",
            "azure_federated_token_file",
            "aws_container_authorization_token_file",
        ] {
            let e = none
                .check(&spec("s3://b", &[(k, "/etc/granary/tls/tls.key")]))
                .unwrap_err();
            assert!(
                matches!(e, MasterError::PermissionDenied { .. }),
                "{k}: {e}"
            );
            assert!(e.to_string().contains(k), "{k}: {e}");
        }
        let tmp = std::env::temp_dir().join(format!("granary-files-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        std::fs::write(tmp.join("token"), b"t").unwrap();
        let p = MountPolicy {
            local_roots: vec![tmp.clone()],
            endpoints: vec!["allowed.example".into()],
            ..MountPolicy::default()
        };
        let token = tmp.join("token").display().to_string();
        p.check(&spec("s3://b", &[("aws_web_identity_token_file", &token)]))
            .unwrap();
        for v in [
            "https://evil.internal\\@allowed.example",
            "https://evil.internal\\.allowed.example",
            "https://evil.internal/@allowed.example",
            "https://allowed.example\t",
        ] {
            assert!(
                p.check_endpoints(&spec("s3://b", &[("endpoint", v)]))
                    .is_err(),
                "{v:?} was allowed"
            );
        }
        for v in [
            "https://allowed.example/p",
            "http://user:pw@allowed.example:3128",
        ] {
            p.check_endpoints(&spec("s3://b", &[("proxy_url", v)]))
                .unwrap();
        }
        let _ = std::fs::remove_dir_all(&tmp);
    }

    #[test]
    fn store_addresses_only_from_the_allow_list() {
        let open = MountPolicy::default();
        open.check_endpoints(&spec("s3://b", &[("endpoint", "http://10.0.0.1:80")]))
            .unwrap();
        let p = MountPolicy {
            local_roots: vec![],
            endpoints: vec!["s3.internal:9000".into(), "storage.example".into()],
            ..MountPolicy::default()
        };
        p.check_endpoints(&spec("s3://b", &[("endpoint", "http://s3.internal:9000")]))
            .unwrap();
        p.check_endpoints(&spec(
            "s3://b",
            &[("aws_endpoint", "https://storage.example/x")],
        ))
        .unwrap();
        p.check_endpoints(&spec("s3://b", &[("region", "us-east-1")]))
            .unwrap();
        for (k, v) in [
            ("endpoint", "http://s3.internal:9001"),
            ("endpoint", "http://169.254.169.254"),
            ("aws_metadata_endpoint", "http://169.254.169.254"),
            ("proxy_url", "http://user:pw@proxy:3128"),
            ("google_base_url", "http://127.0.0.1:4443"),
            ("azure_storage_use_emulator", "true"),
            ("fabric_workload_host", "internal-host"),
        ] {
            let e = p.check_endpoints(&spec("s3://b", &[(k, v)])).unwrap_err();
            assert!(
                matches!(e, MasterError::PermissionDenied { .. })
                    && e.to_string().contains("--allow-endpoint"),
                "{k}={v}: {e}"
            );
            assert!(!e.to_string().contains("pw@"), "{e}");
        }
    }

    #[test]
    fn only_admins_see_store_options() {
        let m = Mount {
            id: 1,
            path: "/s3".into(),
            spec: spec(
                "s3://b",
                &[
                    ("region", "us-east-1"),
                    ("secret_access_key", "enc:v1:00"),
                    ("write_mode", "async-through"),
                ],
            ),
            inode: 2,
        };
        let keys = |i: &pb::MountInfo| {
            i.options
                .iter()
                .map(|o| format!("{}={}", o.key, o.value))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            keys(&mount_info(&m, true)),
            [
                "region=us-east-1",
                "secret_access_key=***",
                "write_mode=async-through"
            ]
        );
        assert_eq!(keys(&mount_info(&m, false)), ["write_mode=async-through"]);
    }
}
