//! Direct gRPC calls of the tests, with identities of their choice (the harness runs every
//! process with the identity its role needs; these talk to them as someone else).

use std::path::Path;
use std::time::Duration;

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A client identity for a direct gRPC call: trusted CA, certificate and key (PEM).
#[derive(Clone)]
pub struct Creds {
    pub ca: String,
    pub cert: String,
    pub key: String,
}

/// The identity in a `--tls-dir` folder (`ca.crt`, `tls.crt`, `tls.key`).
pub fn creds_in(dir: &Path) -> Creds {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    Creds {
        ca: read("ca.crt"),
        cert: read("tls.crt"),
        key: read("tls.key"),
    }
}

/// A channel to `addr`: plaintext without credentials, else mutual TLS with them,
/// verifying the server by `server_name` (what a client expecting a master, or a worker,
/// checks).
pub fn channel_to(addr: &str, creds: Option<&Creds>, server_name: &str) -> Channel {
    let endpoint = match creds {
        None => Endpoint::from_shared(format!("http://{addr}")).unwrap(),
        Some(c) => Endpoint::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&c.ca))
                    .identity(Identity::from_pem(&c.cert, &c.key))
                    .domain_name(server_name),
            )
            .unwrap(),
    };
    endpoint
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .connect_lazy()
}

/// [`channel_to`] a server verified as a node of the cluster (masters carry that name too).
pub fn channel(addr: &str, creds: Option<&Creds>) -> Channel {
    channel_to(addr, creds, granary_common::tls::NODE_SERVER_NAME)
}

/// A runtime for a test's direct calls.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Every regular file below `dir` whose bytes contain `needle` (unreadable entries are
/// skipped, links are not followed).
pub fn files_containing(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut hits = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(p);
            } else if ft.is_file() {
                if let Ok(bytes) = std::fs::read(&p) {
                    if bytes.windows(needle.len()).any(|w| w == needle) {
                        hits.push(p.display().to_string());
                    }
                }
            }
        }
    }
    hits
}

/// A temporary folder for one test, removed when dropped.
pub fn workdir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(prefix).tempdir().unwrap()
}
