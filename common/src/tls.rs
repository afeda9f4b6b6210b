//! Transport security for every gRPC hop: mutual TLS with a cluster CA (rustls via tonic),
//! and the principal each certificate names.
//!
//! A certificate says who is asking: its subject's common name is the principal's name, its
//! organizational unit lists the roles (`admin`, `node`, `user`, comma-separated), and a URI
//! subject alternative name `granary:subtree:<path>` (percent-encoded) limits it to one
//! subtree of the namespace. Node certificates (masters and workers) also carry the DNS
//! name [`NODE_SERVER_NAME`]: clients verify a server by that name, so only a node
//! certificate of the cluster CA can serve — an address-independent check that works for
//! pods whose IPs change.
//!
//! The process's choice is made once at start ([`install`]); until then (libraries, unit
//! tests) every hop is plaintext and every caller is trusted.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The DNS name every node certificate carries and every client verifies servers by.
pub const NODE_SERVER_NAME: &str = "granary-node";
/// Prefix of the URI subject alternative name that limits a certificate to a subtree.
const SUBTREE_URI: &str = "granary:subtree:";
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
/// cluster-internal ones (Raft, worker registration, tasks for workers) need `Node`;
/// namespace reads and writes need any role (and, for a subtree principal, a path in it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Admin,
    Node,
    User,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Admin, Role::Node, Role::User];

    pub fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Node => "node",
            Role::User => "user",
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
}

impl Principal {
    pub fn new(name: &str, roles: &[Role], subtree: Option<String>) -> Principal {
        Principal {
            name: name.to_string(),
            roles: roles.iter().fold(0, |acc, r| acc | r.bit()),
            subtree,
        }
    }

    /// The caller of a server running without TLS: no identity, every role.
    pub fn unauthenticated() -> Principal {
        Principal::new("anonymous", &Role::ALL, None)
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
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for gn in &san.value.general_names {
                if let x509_parser::extensions::GeneralName::URI(uri) = gn {
                    if let Some(p) = uri.strip_prefix(SUBTREE_URI) {
                        subtree = Some(percent_decode(p)?);
                    }
                }
            }
        }
        Ok(Principal::new(&name, &roles, subtree))
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let roles: Vec<&str> = self.roles().iter().map(|r| r.name()).collect();
        write!(f, "{} ({})", self.name, roles.join(","))?;
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
            hosts: Vec::new(),
            not_before: now - time::Duration::hours(1),
            not_after: now + time::Duration::days(i64::from(days)),
        }
    }
}

/// Issues a certificate signed by the CA. Node certificates may serve (they carry
/// [`NODE_SERVER_NAME`] and the server-auth usage); others are client certificates only.
pub fn issue(ca: &Pems, spec: &LeafSpec) -> Result<Pems, TlsError> {
    if spec.roles.is_empty() {
        return Err(TlsError::Invalid(
            "a certificate needs at least one role".into(),
        ));
    }
    let ca_key = KeyPair::from_pem(&ca.key)
        .map_err(|e| TlsError::Invalid(format!("the CA key is not usable: {e}")))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)
        .map_err(|e| TlsError::Invalid(format!("the CA certificate is not usable: {e}")))?;
    let node = spec.roles.contains(&Role::Node);
    let mut names = Vec::new();
    if node {
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
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "granary");
    let roles: Vec<&str> = spec.roles.iter().map(|r| r.name()).collect();
    dn.push(DnType::OrganizationalUnitName, roles.join(","));
    dn.push(DnType::CommonName, spec.name.as_str());
    params.distinguished_name = dn;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    if node {
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
}

/// A process's verified TLS material and the principal its certificate names.
pub struct TlsMaterial {
    ca: String,
    own: Pems,
    pub principal: Principal,
    /// End of the certificate's validity (seconds since the epoch).
    pub not_after: i64,
}

impl fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("principal", &self.principal)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

impl TlsMaterial {
    pub fn load(files: &TlsFiles) -> Result<TlsMaterial, TlsError> {
        let m = TlsMaterial::from_pems(
            read(&files.ca)?,
            Pems {
                cert: read(&files.cert)?,
                key: read(&files.key)?,
            },
        )
        .map_err(|e| TlsError::Invalid(format!("{}: {e}", files.cert.display())))?;
        Ok(m)
    }

    /// Checks that the certificate parses, is within its validity and matches the key.
    pub fn from_pems(ca: String, own: Pems) -> Result<TlsMaterial, TlsError> {
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
        Ok(TlsMaterial {
            ca,
            own,
            principal,
            not_after,
        })
    }

    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(Identity::from_pem(&self.own.cert, &self.own.key))
            .domain_name(NODE_SERVER_NAME)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.own.cert, &self.own.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
            .timeout(HANDSHAKE_TIMEOUT)
    }
}

/// How this process talks to the others.
#[derive(Debug)]
pub enum Security {
    /// Plaintext, no identities (explicit `--insecure`).
    Insecure,
    Tls(Arc<TlsMaterial>),
}

static SECURITY: OnceLock<Security> = OnceLock::new();

/// Sets the process's transport security; once, before the first connection.
pub fn install(security: Security) -> Result<(), TlsError> {
    SECURITY
        .set(security)
        .map_err(|_| TlsError::Invalid("transport security is already set".into()))
}

/// The process's transport security (plaintext when never installed).
pub fn security() -> &'static Security {
    SECURITY.get_or_init(|| Security::Insecure)
}

/// The TLS material when TLS is on.
pub fn material() -> Option<&'static Arc<TlsMaterial>> {
    match security() {
        Security::Tls(m) => Some(m),
        Security::Insecure => None,
    }
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
    fn percent_encoding_round_trips() {
        for s in ["/a/b", "/x y/%z", "/ü/\u{1F600}", ""] {
            assert_eq!(percent_decode(&percent_encode(s)).unwrap(), s);
        }
        assert!(percent_decode("%G1").is_err());
        assert!(percent_decode("%F").is_err());
    }
}
