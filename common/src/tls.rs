//! Transport security for every gRPC hop: mutual TLS with a cluster CA (rustls, the
//! handshakes made by [`crate::grpc`] so that renewed certificates take effect without a restart),
//! and the principal each certificate names.
//!
//! A certificate says who is asking: its subject's common name is the principal's name, its
//! organizational unit lists the roles (`master`, `node`, `admin`, `user`, comma-separated),
//! a URI subject alternative name `granary:subtree:<path>` (percent-encoded) limits it to one
//! subtree of the namespace, and `granary:master:<id>` names the master a `master`
//! certificate belongs to. Masters and workers are different identities: a master's
//! certificate carries the DNS name [`MASTER_SERVER_NAME`], a worker's (`node`)
//! [`NODE_SERVER_NAME`]. Clients verify a server by the name of what they expect to reach —
//! masters by [`MASTER_SERVER_NAME`], so a worker certificate cannot pose as a master — an
//! address-independent check that works for pods whose IPs change. Master certificates
//! carry [`NODE_SERVER_NAME`] too (a master is trusted at least as much as a worker, and
//! tools that verify the generic name keep working).
//!
//! A process's identity is passed to what makes and serves connections ([`TlsMaterial`]);
//! without one (libraries, unit tests, `--insecure`) every hop is plaintext and every
//! caller is trusted. [`TlsMaterial::watch`] picks up renewed files.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;

/// The DNS name every worker (and master) certificate carries: clients verify workers by it.
pub const NODE_SERVER_NAME: &str = "granary-node";
/// The DNS name only master certificates carry: clients verify masters by it.
pub const MASTER_SERVER_NAME: &str = "granary-master";
/// Prefix of the URI subject alternative name that limits a certificate to a subtree.
const SUBTREE_URI: &str = "granary:subtree:";
/// Prefix of the URI subject alternative name naming a master certificate's master id.
const MASTER_URI: &str = "granary:master:";
/// Time a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
}

/// What a principal may do. Admin operations (mounts, jobs, membership) need `Admin`;
/// Raft and tasks for workers need `Master` (a master's certificate, naming its id);
/// worker registration, heartbeats and under-store credentials need `Node` (workers, and
/// mounts on a GPU node); namespace reads and writes need any role (and, for a subtree
/// principal, a path in it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Admin,
    Node,
    User,
    Master,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Admin, Role::Node, Role::User, Role::Master];

    pub fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Node => "node",
            Role::User => "user",
            Role::Master => "master",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == s.trim())
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Who is asking: from the verified client certificate, or the unauthenticated caller of a
/// plaintext (`--insecure`) server, who may do everything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    roles: u8,
    /// Namespace path the principal is limited to (`None`: the whole namespace).
    pub subtree: Option<String>,
    /// The master a `master` certificate belongs to (its `granary:master:<id>` name).
    pub master_id: Option<u64>,
    /// The caller of a plaintext server: no certificate, so no identity to check.
    unauthenticated: bool,
}

impl Principal {
    pub fn new(name: &str, roles: &[Role], subtree: Option<String>) -> Principal {
        Principal {
            name: name.to_string(),
            roles: roles.iter().fold(0, |acc, r| acc | r.bit()),
            subtree,
            master_id: None,
            unauthenticated: false,
        }
    }

    /// The principal of master `id`'s certificate.
    pub fn with_master_id(mut self, id: u64) -> Principal {
        self.master_id = Some(id);
        self
    }

    /// The caller of a server running without TLS (`--insecure`): no identity, every role.
    pub fn unauthenticated() -> Principal {
        Principal {
            unauthenticated: true,
            ..Principal::new("anonymous", &Role::ALL, None)
        }
    }

    /// Whether this is the caller of a plaintext server (nothing about it was verified).
    pub fn is_unauthenticated(&self) -> bool {
        self.unauthenticated
    }

    /// Whether this principal may speak as master `id` (send Raft messages from it): a
    /// `master` certificate naming that id, or anyone on a plaintext cluster.
    pub fn speaks_for_master(&self, id: u64) -> bool {
        self.unauthenticated || (self.has(Role::Master) && self.master_id == Some(id))
    }

    pub fn has(&self, role: Role) -> bool {
        self.roles & role.bit() != 0
    }

    pub fn roles(&self) -> Vec<Role> {
        Role::ALL.into_iter().filter(|r| self.has(*r)).collect()
    }

    /// Reads the principal from a certificate (DER).
    pub fn from_certificate(der: &[u8]) -> Result<Principal, TlsError> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| TlsError::Invalid(format!("unparsable certificate: {e}")))?;
        let subject = cert.subject();
        let name = subject
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .unwrap_or("")
            .to_string();
        let mut roles = Vec::new();
        for ou in subject.iter_organizational_unit() {
            for part in ou.as_str().unwrap_or("").split(',') {
                if let Some(r) = Role::parse(part) {
                    roles.push(r);
                }
            }
        }
        let mut subtree = None;
        let mut master_ids = Vec::new();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for gn in &san.value.general_names {
                if let x509_parser::extensions::GeneralName::URI(uri) = gn {
                    if let Some(p) = uri.strip_prefix(SUBTREE_URI) {
                        // One subtree, written as Granary writes paths: an empty one, one
                        // with `..` or a trailing slash, or two, would otherwise reach more
                        // than it says (an empty one reached the whole namespace).
                        let p = percent_decode(p)?;
                        let normal = crate::paths::normalize(&p).is_ok_and(|n| n == p);
                        if !normal || subtree.is_some() {
                            return Err(TlsError::Invalid(format!(
                                "the certificate of {name} names a subtree that is not one normalised absolute path ({p:?})"
                            )));
                        }
                        subtree = Some(p);
                    } else if let Some(id) = uri.strip_prefix(MASTER_URI) {
                        master_ids.push(parse_master_id(id)?);
                    }
                }
            }
        }
        let mut p = Principal::new(&name, &roles, subtree);
        match master_ids.as_slice() {
            [] => {}
            [id] => p.master_id = Some(*id),
            _ => {
                return Err(TlsError::Invalid(format!(
                    "the certificate of {name} names several masters ({master_ids:?}); a master certificate names one"
                )))
            }
        }
        Ok(p)
    }
}

fn parse_master_id(s: &str) -> Result<u64, TlsError> {
    match s.parse::<u64>() {
        Ok(id) if id > 0 => Ok(id),
        _ => Err(TlsError::Invalid(format!(
            "bad master id {s:?} in a certificate (expected {MASTER_URI}<1, 2, ...>)"
        ))),
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let roles: Vec<&str> = self.roles().iter().map(|r| r.name()).collect();
        write!(f, "{} ({})", self.name, roles.join(","))?;
        if let Some(id) = self.master_id {
            write!(f, " of master {id}")?;
        }
        if let Some(s) = &self.subtree {
            write!(f, " limited to {s}")?;
        }
        Ok(())
    }
}

/// Bytes outside the URI-safe set are written `%XX`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn percent_decode(s: &str) -> Result<String, TlsError> {
    let bad = || TlsError::Invalid(format!("bad subtree {s:?} in a certificate"));
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or_else(bad)?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// What `granary cert show` prints about a certificate.
#[derive(Clone, Debug)]
pub struct CertInfo {
    pub principal: Principal,
    pub issuer: String,
    /// RFC 3339, UTC.
    pub not_before: String,
    pub not_after: String,
    pub valid_now: bool,
}

fn rfc3339(t: &x509_parser::time::ASN1Time) -> String {
    let secs = u64::try_from(t.timestamp()).unwrap_or(0);
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_secs(secs)).to_string()
}

/// Reads the first certificate of a PEM text.
pub fn describe(pem_text: &str) -> Result<CertInfo, TlsError> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem_text.as_bytes())
        .map_err(|e| TlsError::Invalid(format!("no PEM certificate ({e})")))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| TlsError::Invalid(format!("unparsable certificate: {e}")))?;
    let validity = cert.validity();
    Ok(CertInfo {
        principal: Principal::from_certificate(&pem.contents)?,
        issuer: cert.issuer().to_string(),
        not_before: rfc3339(&validity.not_before),
        not_after: rfc3339(&validity.not_after),
        valid_now: validity.is_valid(),
    })
}

/// A certificate and its private key, PEM.
#[derive(Clone)]
pub struct Pems {
    pub cert: String,
    pub key: String,
}

impl fmt::Debug for Pems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Pems { key: <redacted> }")
    }
}

/// Creates a self-signed cluster CA valid for `days`.
pub fn new_ca(name: &str, days: u32) -> Result<Pems, TlsError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "granary");
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(i64::from(days));
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok(Pems {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// What a certificate issued by [`issue`] says.
#[derive(Clone, Debug)]
pub struct LeafSpec {
    pub name: String,
    pub roles: Vec<Role>,
    pub subtree: Option<String>,
    /// The master id a `master` certificate belongs to (required with that role only).
    pub master_id: Option<u64>,
    /// Extra DNS names or IP addresses (for tools that verify servers by address).
    pub hosts: Vec<String>,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl LeafSpec {
    /// Valid from an hour ago (clock skew) for `days`.
    pub fn new(name: &str, roles: &[Role], days: u32) -> LeafSpec {
        let now = OffsetDateTime::now_utc();
        LeafSpec {
            name: name.to_string(),
            roles: roles.to_vec(),
            subtree: None,
            master_id: None,
            hosts: Vec::new(),
            not_before: now - time::Duration::hours(1),
            not_after: now + time::Duration::days(i64::from(days)),
        }
    }
}

/// Issues a certificate signed by the CA. Master and node certificates may serve (they
/// carry [`MASTER_SERVER_NAME`] or [`NODE_SERVER_NAME`] and the server-auth usage); others
/// are client certificates only. A `master` certificate names its master id.
pub fn issue(ca: &Pems, spec: &LeafSpec) -> Result<Pems, TlsError> {
    if spec.roles.is_empty() {
        return Err(TlsError::Invalid(
            "a certificate needs at least one role".into(),
        ));
    }
    let master = spec.roles.contains(&Role::Master);
    match spec.master_id {
        None if master => {
            return Err(TlsError::Invalid(
                "a master certificate names its master id (--master-id N, the master's --id)"
                    .into(),
            ))
        }
        Some(_) if !master => {
            return Err(TlsError::Invalid(
                "a master id goes with the master role only".into(),
            ))
        }
        Some(0) => return Err(TlsError::Invalid("master ids start at 1".into())),
        _ => {}
    }
    let ca_key = KeyPair::from_pem(&ca.key)
        .map_err(|e| TlsError::Invalid(format!("the CA key is not usable: {e}")))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)
        .map_err(|e| TlsError::Invalid(format!("the CA certificate is not usable: {e}")))?;
    let node = spec.roles.contains(&Role::Node);
    let mut names = Vec::new();
    if master {
        names.push(MASTER_SERVER_NAME.to_string());
    }
    if node || master {
        names.push(NODE_SERVER_NAME.to_string());
    }
    names.extend(spec.hosts.iter().cloned());
    let mut params = CertificateParams::new(names)?;
    if let Some(s) = &spec.subtree {
        let uri = format!("{SUBTREE_URI}{}", percent_encode(s));
        params
            .subject_alt_names
            .push(SanType::URI(uri.as_str().try_into()?));
    }
    if let Some(id) = spec.master_id {
        let uri = format!("{MASTER_URI}{id}");
        params
            .subject_alt_names
            .push(SanType::URI(uri.as_str().try_into()?));
    }
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "granary");
    let roles: Vec<&str> = spec.roles.iter().map(|r| r.name()).collect();
    dn.push(DnType::OrganizationalUnitName, roles.join(","));
    dn.push(DnType::CommonName, spec.name.as_str());
    params.distinguished_name = dn;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    if node || master {
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ServerAuth);
    }
    params.use_authority_key_identifier_extension = true;
    params.not_before = spec.not_before;
    params.not_after = spec.not_after;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Pems {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// Where a process finds its TLS material: the cluster CA's certificate, its own
/// certificate (optionally followed by intermediates) and its private key.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// The layout of a Kubernetes TLS Secret (and of `granary cert issue --out`):
    /// `ca.crt`, `tls.crt`, `tls.key`.
    pub fn in_dir(dir: &Path) -> TlsFiles {
        TlsFiles {
            ca: dir.join("ca.crt"),
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        }
    }

    /// Writes a CA certificate and a certificate with its key (mode 0600) to these paths,
    /// each file replaced whole ([`replace_file`]): a server reading them again sees
    /// the old file or the new one, never part of one.
    pub fn write(&self, ca: &str, own: &Pems) -> std::io::Result<()> {
        replace_file(&self.key, own.key.as_bytes(), 0o600)?;
        replace_file(&self.cert, own.cert.as_bytes(), 0o644)?;
        replace_file(&self.ca, ca.as_bytes(), 0o644)
    }
}

/// Writes `data` to `.NAME.part` beside `path` (created with `mode`, or the owner and mode
/// of the file it replaces; synced), then renames it over `path`: a reader sees the old
/// file or the new one whole.
pub fn replace_file(path: &Path, data: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "a file path needs a name")
    })?;
    let part = path.with_file_name(format!(".{}.part", name.to_string_lossy()));
    let _ = std::fs::remove_file(&part);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&part)?;
    // A replaced file keeps its owner and group (a root-run rotation of a daemon's folder
    // must leave files the daemon can still read), as far as this user may, and its mode
    // without any bit for others that `mode` does not give (a key copied in world-readable
    // becomes private). Only a regular file is copied from: a link is replaced, not read.
    if let Ok(old) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if old.file_type().is_file() {
            let _ = std::os::unix::fs::fchown(&f, Some(old.uid()), Some(old.gid()));
            let kept = old.mode() & 0o777 & (mode | 0o070);
            f.set_permissions(std::fs::Permissions::from_mode(kept))?;
        }
    }
    f.write_all(data).and_then(|_| f.sync_all())?;
    std::fs::rename(&part, path)?;
    if let Some(dir) = path.parent().and_then(|d| std::fs::File::open(d).ok()) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// A process's verified TLS material and the principal its certificate names.
///
/// Material read from files is read again by [`TlsMaterial::reload`] (and every
/// [`RELOAD_EVERY`] by [`TlsMaterial::watch`]): a renewed certificate, key or CA (what
/// cert-manager writes into a Kubernetes Secret before the old certificate expires) is used
/// by every connection made or accepted from then on, without a restart. Connections
/// already open keep the session they have, except accepted ones whose peer's chain a new
/// CA file no longer verifies: those are ended ([`crate::tls_conns`]). The principal never
/// changes: a replacement naming another principal is refused and the current material
/// kept.
pub struct TlsMaterial {
    /// Where the material was read from (None: made in memory, never reloaded).
    files: Option<TlsFiles>,
    current: std::sync::RwLock<Arc<Loaded>>,
    pub principal: Principal,
    /// The connections servers of this identity accepted and still hold.
    open: Arc<crate::tls_conns::OpenConnections>,
}

/// One verified set of PEMs and the rustls configurations made from them.
struct Loaded {
    ca: String,
    own: Pems,
    /// End of the certificate's validity (seconds since the epoch).
    not_after: i64,
    /// gRPC (HTTP/2, ALPN `h2`), mutual TLS.
    grpc_server: Arc<tokio_rustls::rustls::ServerConfig>,
    grpc_client: Arc<tokio_rustls::rustls::ClientConfig>,
    /// TLS streams outside gRPC (the block data plane).
    stream_server: Arc<tokio_rustls::rustls::ServerConfig>,
    stream_client: Arc<tokio_rustls::rustls::ClientConfig>,
    /// What the servers verify client certificates with.
    verifier: Arc<dyn tokio_rustls::rustls::server::danger::ClientCertVerifier>,
}

/// How often [`TlsMaterial::watch`] reads the files again.
pub const RELOAD_EVERY: Duration = Duration::from_secs(60);

impl fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("principal", &self.principal)
            .field("not_after", &self.not_after())
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The three files' texts (CA, certificate, key).
fn read_files(files: &TlsFiles) -> Result<(String, Pems), TlsError> {
    Ok((
        read(&files.ca)?,
        Pems {
            cert: read(&files.cert)?,
            key: read(&files.key)?,
        },
    ))
}

impl TlsMaterial {
    pub fn load(files: &TlsFiles) -> Result<TlsMaterial, TlsError> {
        let (ca, own) = read_files(files)?;
        let mut m = TlsMaterial::from_pems(ca, own)
            .map_err(|e| TlsError::Invalid(format!("{}: {e}", files.cert.display())))?;
        m.files = Some(files.clone());
        Ok(m)
    }

    /// Checks that the certificate parses, is within its validity and matches the key.
    pub fn from_pems(ca: String, own: Pems) -> Result<TlsMaterial, TlsError> {
        let (loaded, principal) = Loaded::verify(ca, own)?;
        Ok(TlsMaterial {
            files: None,
            current: std::sync::RwLock::new(Arc::new(loaded)),
            principal,
            open: Arc::default(),
        })
    }

    fn current(&self) -> Arc<Loaded> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// End of the current certificate's validity (seconds since the epoch).
    pub fn not_after(&self) -> i64 {
        self.current().not_after
    }

    /// Reads the files again; true when they changed and the new material is in use (and
    /// when the CA file changed, the open connections it does not verify are ended). A
    /// replacement that does not verify (unreadable, expired, a key of another
    /// certificate, a CA that does not parse) or that names another principal is an
    /// error, and the current material stays in use. Material made in memory: Ok(false).
    pub fn reload(&self) -> Result<bool, TlsError> {
        let Some(files) = &self.files else {
            return Ok(false);
        };
        let (ca, own) = read_files(files)?;
        let now = self.current();
        if now.ca == ca && now.own.cert == own.cert && now.own.key == own.key {
            return Ok(false);
        }
        let (loaded, principal) = Loaded::verify(ca, own)
            .map_err(|e| TlsError::Invalid(format!("{}: {e}", files.cert.display())))?;
        if principal != self.principal {
            return Err(TlsError::Invalid(format!(
                "{} now names {principal}, not {}: a process keeps its identity (restart it \
                 to take another)",
                files.cert.display(),
                self.principal
            )));
        }
        let loaded = Arc::new(loaded);
        match self.current.write() {
            Ok(mut g) => *g = loaded.clone(),
            Err(p) => *p.into_inner() = loaded.clone(),
        }
        if loaded.ca != now.ca {
            let ended = self.open.end_untrusted(loaded.verifier.clone());
            if ended > 0 {
                tracing::warn!(
                    ended,
                    ca = %files.ca.display(),
                    "ended open connections whose certificates the new CA file does not verify"
                );
            }
        }
        Ok(true)
    }

    /// The connections servers of this identity accepted over TLS and still hold (see
    /// [`crate::tls_conns`]): a server tracks each one once its handshake is done.
    pub fn open_connections(&self) -> &Arc<crate::tls_conns::OpenConnections> {
        &self.open
    }

    /// Reloads the material every `every` on a thread of its own ([`reload`](Self::reload)),
    /// logging each change and each refused replacement (once until it changes), for as
    /// long as the material is in use. Material made in memory is not watched.
    pub fn watch(self: &Arc<Self>, every: Duration) {
        let Some(files) = self.files.clone() else {
            return;
        };
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("tls-reload".into())
            .spawn(move || {
                let mut last_error: Option<String> = None;
                loop {
                    std::thread::sleep(every);
                    let Some(m) = weak.upgrade() else { return };
                    match m.reload() {
                        Ok(true) => {
                            last_error = None;
                            tracing::info!(
                                cert = %files.cert.display(),
                                not_after = m.not_after(),
                                "TLS material reloaded: new connections use the new certificate and CA"
                            );
                        }
                        Ok(false) => last_error = None,
                        Err(e) => {
                            let e = e.to_string();
                            if last_error.as_deref() != Some(&e) {
                                tracing::warn!(error = %e, "the TLS files changed but cannot be used; keeping the current material");
                                last_error = Some(e);
                            }
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot watch the TLS files; certificates are read at start only");
        }
    }

    /// The client side of a gRPC connection (HTTP/2): the cluster CA as the only root, this
    /// identity. The server is verified by the name given at connect.
    pub fn grpc_client(&self) -> Arc<tokio_rustls::rustls::ClientConfig> {
        self.current().grpc_client.clone()
    }

    /// Accepts a gRPC connection on `io` (HTTP/2): this identity, client certificates of
    /// the cluster CA required; the socket can be ended by a CA change
    /// ([`crate::tls_conns`]) once [`OpenConnections::track`](crate::tls_conns::OpenConnections::track)ed.
    pub fn grpc_accept<T>(&self, io: T) -> tokio_rustls::Accept<crate::tls_conns::Tracked<T>>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        // The generation first, then the CAs: a change between the two is caught at track.
        let io = self.open.wrap(io);
        tokio_rustls::TlsAcceptor::from(self.current().grpc_server.clone()).accept(io)
    }

    /// Accepts a TLS stream outside gRPC (the block data plane) on `io`, as
    /// [`grpc_accept`](Self::grpc_accept) does.
    pub fn stream_accept<T>(&self, io: T) -> tokio_rustls::Accept<crate::tls_conns::Tracked<T>>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let io = self.open.wrap(io);
        self.stream_acceptor().accept(io)
    }

    /// The server side of a TLS stream outside gRPC (the block data plane): the same
    /// identity, and client certificates of the cluster CA required, as gRPC servers. Its
    /// connections are not tracked: servers use [`stream_accept`](Self::stream_accept).
    pub fn stream_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current().stream_server.clone())
    }

    /// The client side of a TLS stream to a worker outside gRPC, verifying it by
    /// [`NODE_SERVER_NAME`] as gRPC clients do, presenting this identity.
    pub fn stream_connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(self.current().stream_client.clone())
    }

    /// The certificate (PEM) in use now.
    pub fn cert_pem(&self) -> String {
        self.current().own.cert.clone()
    }
}

impl Loaded {
    /// Verifies `own` against the rules of [`TlsMaterial::from_pems`] and builds the
    /// configurations; with the principal it names.
    fn verify(ca: String, own: Pems) -> Result<(Loaded, Principal), TlsError> {
        let (_, pem) = x509_parser::pem::parse_x509_pem(own.cert.as_bytes())
            .map_err(|e| TlsError::Invalid(format!("no PEM certificate ({e})")))?;
        let cert = pem
            .parse_x509()
            .map_err(|e| TlsError::Invalid(format!("unparsable certificate: {e}")))?;
        let validity = cert.validity();
        if !validity.is_valid() {
            return Err(TlsError::Invalid(format!(
                "the certificate is not valid now (valid from {} to {})",
                validity.not_before, validity.not_after
            )));
        }
        let key = KeyPair::from_pem(&own.key)
            .map_err(|e| TlsError::Invalid(format!("the private key is not usable: {e}")))?;
        if key.public_key_raw() != cert.public_key().subject_public_key.data.as_ref() {
            return Err(TlsError::Invalid(
                "the private key does not belong to the certificate".into(),
            ));
        }
        x509_parser::pem::parse_x509_pem(ca.as_bytes())
            .map_err(|e| TlsError::Invalid(format!("no PEM CA certificate ({e})")))?;
        let principal = Principal::from_certificate(&pem.contents)?;
        let not_after = validity.not_after.timestamp();
        let (grpc_server, grpc_client, verifier) = configs(&ca, &own, &[b"h2"])?;
        let (stream_server, stream_client, _) = configs(&ca, &own, &[])?;
        Ok((
            Loaded {
                ca,
                own,
                not_after,
                grpc_server,
                grpc_client,
                stream_server,
                stream_client,
                verifier,
            },
            principal,
        ))
    }
}

/// The rustls server and client configurations of one identity: the provider gRPC uses
/// (aws-lc-rs), the cluster CA as the only root (client certificates of it required by the
/// server), this identity's chain and key, and the ALPN protocols `alpn`; with the client
/// certificate verifier of the server's.
#[allow(clippy::type_complexity)]
fn configs(
    ca: &str,
    own: &Pems,
    alpn: &[&[u8]],
) -> Result<
    (
        Arc<tokio_rustls::rustls::ServerConfig>,
        Arc<tokio_rustls::rustls::ClientConfig>,
        Arc<dyn tokio_rustls::rustls::server::danger::ClientCertVerifier>,
    ),
    TlsError,
> {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |what: &str, e: &dyn fmt::Display| TlsError::Invalid(format!("{what}: {e}"));
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        let c = c.map_err(|e| bad("the CA certificate", &e))?;
        roots.add(c).map_err(|e| bad("the CA certificate", &e))?;
    }
    let roots = Arc::new(roots);
    let chain = CertificateDer::pem_slice_iter(own.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad("the certificate", &e))?;
    let key = PrivateKeyDer::from_pem_slice(own.key.as_bytes())
        .map_err(|e| bad("the private key", &e))?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|e| bad("TLS server", &e))?;
    // This process's own certificate must be one its peers accept: issued by the CA it
    // trusts (a wrong ca.crt, or a half-renewed folder read between its files, is refused
    // rather than taken and every peer then refused).
    {
        let (leaf, intermediates) = chain
            .split_first()
            .ok_or_else(|| TlsError::Invalid("no PEM certificate".into()))?;
        verifier
            .verify_client_cert(
                leaf,
                intermediates,
                tokio_rustls::rustls::pki_types::UnixTime::now(),
            )
            .map_err(|e| {
                bad(
                    "the certificate does not verify against the CA certificate",
                    &e,
                )
            })?;
    }
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("TLS server", &e))?
        .with_client_cert_verifier(verifier.clone())
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| bad("TLS server", &e))?;
    server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("TLS client", &e))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| bad("TLS client", &e))?;
    client.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok((Arc::new(server), Arc::new(client), verifier))
}

/// Time a TLS handshake may take before the connection is dropped.
pub fn handshake_timeout() -> Duration {
    HANDSHAKE_TIMEOUT
}

/// A server name clients verify a server by.
pub fn server_name(
    name: &'static str,
) -> Result<tokio_rustls::rustls::pki_types::ServerName<'static>, TlsError> {
    tokio_rustls::rustls::pki_types::ServerName::try_from(name)
        .map_err(|e| TlsError::Invalid(format!("{name}: {e}")))
}

/// The name a worker's certificate is verified by, for TLS streams outside gRPC.
pub fn node_server_name() -> Result<tokio_rustls::rustls::pki_types::ServerName<'static>, TlsError>
{
    server_name(NODE_SERVER_NAME)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_issued_certificate_names_its_principal() {
        let ca = new_ca("test CA", 1).unwrap();
        let mut spec = LeafSpec::new("team-a", &[Role::User], 1);
        spec.subtree = Some("/datasets/team a/ü".into());
        let leaf = issue(&ca, &spec).unwrap();
        let m = TlsMaterial::from_pems(ca.cert.clone(), leaf).unwrap();
        assert_eq!(m.principal.name, "team-a");
        assert_eq!(m.principal.roles(), vec![Role::User]);
        assert_eq!(m.principal.subtree.as_deref(), Some("/datasets/team a/ü"));

        let node = issue(&ca, &LeafSpec::new("m1", &[Role::Node, Role::Admin], 1)).unwrap();
        let m = TlsMaterial::from_pems(ca.cert.clone(), node).unwrap();
        assert!(m.principal.has(Role::Node) && m.principal.has(Role::Admin));
        assert!(!m.principal.has(Role::User));
        assert_eq!(m.principal.subtree, None);

        // A subtree that is not one normalised absolute path is refused, never widened.
        for bad in ["", "data", "/data/", "/data/../etc", "/data//x"] {
            let mut spec = LeafSpec::new("team-b", &[Role::User], 1);
            spec.subtree = Some(bad.into());
            let leaf = issue(&ca, &spec).unwrap();
            assert!(
                TlsMaterial::from_pems(ca.cert.clone(), leaf).is_err(),
                "subtree {bad:?} was taken"
            );
        }
    }

    #[test]
    fn expired_certificates_and_foreign_keys_are_refused_at_load() {
        let ca = new_ca("test CA", 1).unwrap();
        let mut spec = LeafSpec::new("old", &[Role::User], 1);
        spec.not_before = OffsetDateTime::now_utc() - time::Duration::days(10);
        spec.not_after = OffsetDateTime::now_utc() - time::Duration::days(1);
        let old = issue(&ca, &spec).unwrap();
        let e = TlsMaterial::from_pems(ca.cert.clone(), old).unwrap_err();
        assert!(e.to_string().contains("not valid now"), "{e}");

        let a = issue(&ca, &LeafSpec::new("a", &[Role::User], 1)).unwrap();
        let b = issue(&ca, &LeafSpec::new("b", &[Role::User], 1)).unwrap();
        let mixed = Pems {
            cert: a.cert,
            key: b.key,
        };
        let e = TlsMaterial::from_pems(ca.cert.clone(), mixed).unwrap_err();
        assert!(e.to_string().contains("does not belong"), "{e}");
    }

    #[test]
    fn master_certificates_name_their_master_and_workers_do_not() {
        let ca = new_ca("test CA", 1).unwrap();
        let mut spec = LeafSpec::new("master-2", &[Role::Master], 1);
        spec.master_id = Some(2);
        let m = TlsMaterial::from_pems(ca.cert.clone(), issue(&ca, &spec).unwrap()).unwrap();
        assert_eq!(m.principal.roles(), vec![Role::Master]);
        assert_eq!(m.principal.master_id, Some(2));
        assert!(m.principal.speaks_for_master(2));
        assert!(!m.principal.speaks_for_master(1));
        assert_eq!(m.principal.to_string(), "master-2 (master) of master 2");

        let w = issue(&ca, &LeafSpec::new("worker-7", &[Role::Node], 1)).unwrap();
        let w = TlsMaterial::from_pems(ca.cert.clone(), w).unwrap();
        assert_eq!(w.principal.master_id, None);
        assert!(!w.principal.speaks_for_master(1));
        // Only the plaintext caller speaks for any master without a certificate.
        assert!(Principal::unauthenticated().speaks_for_master(3));
        assert!(!Principal::new("x", &Role::ALL, None).speaks_for_master(3));

        // The master role and the id go together.
        let e = issue(&ca, &LeafSpec::new("m", &[Role::Master], 1)).unwrap_err();
        assert!(e.to_string().contains("--master-id"), "{e}");
        let mut spec = LeafSpec::new("w", &[Role::Node], 1);
        spec.master_id = Some(1);
        assert!(issue(&ca, &spec).is_err());
        let mut spec = LeafSpec::new("m", &[Role::Master], 1);
        spec.master_id = Some(0);
        assert!(issue(&ca, &spec).is_err());

        // Server names: a master serves as a master (and a node); a worker only as a node.
        let names = |pems: &Pems| {
            let (_, pem) = x509_parser::pem::parse_x509_pem(pems.cert.as_bytes()).unwrap();
            let cert = pem.parse_x509().unwrap();
            let mut dns = Vec::new();
            for gn in &cert
                .subject_alternative_name()
                .unwrap()
                .unwrap()
                .value
                .general_names
            {
                if let x509_parser::extensions::GeneralName::DNSName(d) = gn {
                    dns.push(d.to_string());
                }
            }
            dns
        };
        let mut spec = LeafSpec::new("m3", &[Role::Master], 1);
        spec.master_id = Some(3);
        assert_eq!(
            names(&issue(&ca, &spec).unwrap()),
            vec![MASTER_SERVER_NAME, NODE_SERVER_NAME]
        );
        assert_eq!(
            names(&issue(&ca, &LeafSpec::new("w", &[Role::Node], 1)).unwrap()),
            vec![NODE_SERVER_NAME]
        );
    }

    #[test]
    fn percent_encoding_round_trips() {
        for s in ["/a/b", "/x y/%z", "/ü/\u{1F600}", ""] {
            assert_eq!(percent_decode(&percent_encode(s)).unwrap(), s);
        }
        assert!(percent_decode("%G1").is_err());
        assert!(percent_decode("%F").is_err());
    }

    fn write_dir(dir: &Path, ca: &str, own: &Pems) {
        std::fs::create_dir_all(dir).unwrap();
        TlsFiles::in_dir(dir).write(ca, own).unwrap();
    }

    #[test]
    fn reloaded_files_take_effect_and_a_bad_replacement_keeps_the_current_material() {
        let dir = std::env::temp_dir().join(format!("granary-tls-reload-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = new_ca("test CA", 1).unwrap();
        let spec = LeafSpec::new("w1", &[Role::Node], 1);
        let first = issue(&ca, &spec).unwrap();
        write_dir(&dir, &ca.cert, &first);
        let m = TlsMaterial::load(&TlsFiles::in_dir(&dir)).unwrap();
        assert!(!m.reload().unwrap(), "nothing changed");
        assert_eq!(m.cert_pem(), first.cert);

        // A renewed certificate of the same principal (a new key, a later end).
        let mut later = spec.clone();
        later.not_after = OffsetDateTime::now_utc() + time::Duration::days(3);
        let renewed = issue(&ca, &later).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let group_readable = std::fs::Permissions::from_mode(0o640);
        std::fs::set_permissions(dir.join("tls.crt"), group_readable).unwrap();
        let world_readable = std::fs::Permissions::from_mode(0o644);
        std::fs::set_permissions(dir.join("tls.key"), world_readable).unwrap();
        write_dir(&dir, &ca.cert, &renewed);
        assert!(m.reload().unwrap());
        assert_eq!(m.cert_pem(), renewed.cert);
        // Each file was replaced whole, keeping the mode of the file it replaced, less what
        // it gave others beyond what was asked (a key is never world-readable).
        let mode = |name: &str| {
            std::fs::metadata(dir.join(name))
                .unwrap()
                .permissions()
                .mode()
        };
        assert_eq!(
            (mode("tls.key") & 0o777, mode("tls.crt") & 0o777),
            (0o640, 0o640)
        );
        assert!(m.not_after() > OffsetDateTime::now_utc().unix_timestamp() + 2 * 86_400);

        // Another principal, a key of another certificate, an expired certificate, a CA
        // that is no PEM: each refused, and the renewed material stays in use.
        let other = issue(
            &ca,
            &LeafSpec::new("intruder", &[Role::Node, Role::Admin], 1),
        )
        .unwrap();
        let foreign_key = Pems {
            cert: renewed.cert.clone(),
            key: first.key.clone(),
        };
        let mut old = spec.clone();
        old.not_before = OffsetDateTime::now_utc() - time::Duration::days(10);
        old.not_after = OffsetDateTime::now_utc() - time::Duration::days(1);
        let expired = issue(&ca, &old).unwrap();
        let other_ca = new_ca("another CA", 1).unwrap();
        for (what, ca_text, own) in [
            (
                "a CA that did not issue the certificate",
                other_ca.cert.as_str(),
                &renewed,
            ),
            ("another principal", ca.cert.as_str(), &other),
            ("a foreign key", ca.cert.as_str(), &foreign_key),
            ("an expired certificate", ca.cert.as_str(), &expired),
            ("a CA that is no PEM", "garbage", &renewed),
        ] {
            write_dir(&dir, ca_text, own);
            assert!(m.reload().is_err(), "{what} was taken");
            assert_eq!(m.cert_pem(), renewed.cert, "{what} replaced the material");
        }
        // Files gone for a moment (a Secret being rewritten): an error, nothing changes.
        std::fs::remove_file(dir.join("tls.key")).unwrap();
        assert!(m.reload().is_err());
        assert_eq!(m.cert_pem(), renewed.cert);

        // Material made in memory is never reloaded.
        let mem = TlsMaterial::from_pems(ca.cert.clone(), first).unwrap();
        assert!(!mem.reload().unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
