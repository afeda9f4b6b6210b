//! Transport security of a command (the network it reaches the cluster over: TLS material,
//! or an explicit `--insecure`) and the `granary cert` commands that make a cluster's TLS material.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use granary_common::net::{Net, Tcp};
use granary_common::tls::{self, LeafSpec, Pems, Role, TlsFiles, TlsMaterial};

use crate::args::{CertCommand, TlsArgs};

/// Certificates expiring sooner than this get a warning at start.
const EXPIRY_WARNING_DAYS: i64 = 14;

impl TlsArgs {
    fn given(&self) -> bool {
        self.tls_dir.is_some()
            || self.tls_ca.is_some()
            || self.tls_cert.is_some()
            || self.tls_key.is_some()
    }

    /// The three files, from `--tls-dir` and the per-file overrides.
    fn files(&self) -> anyhow::Result<TlsFiles> {
        let dir = self.tls_dir.as_deref();
        let pick = |own: &Option<PathBuf>, name: &str, flag: &str| -> anyhow::Result<PathBuf> {
            match (own, dir) {
                (Some(p), _) => Ok(p.clone()),
                (None, Some(d)) => Ok(d.join(name)),
                (None, None) => bail!("--{flag} (or --tls-dir) is needed with the other TLS flags"),
            }
        };
        Ok(TlsFiles {
            ca: pick(&self.tls_ca, "ca.crt", "tls-ca")?,
            cert: pick(&self.tls_cert, "tls.crt", "tls-cert")?,
            key: pick(&self.tls_key, "tls.key", "tls-key")?,
        })
    }
}

/// What a server mode needs its certificate to be.
#[derive(Clone, Copy, Debug)]
pub enum Need {
    /// `granary master --id N`: a `master` certificate naming master N.
    Master(u64),
    /// `granary worker`: a `node` certificate.
    Node,
}

/// The network the command reaches the cluster over: TCP with the TLS material the flags
/// name, or plaintext with `--insecure`. `needs` says what a server mode needs its
/// certificate to be, `daemon` whether the command runs until stopped (it then logs its
/// security at start). The identity is passed on explicitly, never held by the process.
pub fn net(args: &TlsArgs, needs: &[Need], daemon: bool) -> anyhow::Result<Net> {
    if args.insecure && args.given() {
        bail!("--insecure and the TLS flags (--tls-dir, --tls-ca, --tls-cert, --tls-key) exclude each other");
    }
    if args.insecure {
        // Servers say so loudly; a client command stays quiet (its stderr is its error).
        if daemon {
            tracing::warn!(
                "--insecure: gRPC is plaintext and unauthenticated; anyone who reaches a port may read data and administer the cluster"
            );
        }
        return Ok(Tcp::plain());
    }
    if !args.given() {
        bail!(
            "no TLS material: pass --tls-dir DIR (made with `granary cert issue`) or --insecure for a plaintext cluster on a trusted network"
        );
    }
    let files = args.files()?;
    let material = TlsMaterial::load(&files).context("loading the TLS material")?;
    for need in needs {
        check_identity(&files.cert, &material.principal, *need)?;
    }
    let left_days = (material.not_after() - granary_common::now_ms() / 1000) / 86_400;
    if left_days < EXPIRY_WARNING_DAYS {
        tracing::warn!(cert = %files.cert.display(), days = left_days, "the certificate expires soon; write a renewed one over it (it is read again every minute)");
    }
    let material = Arc::new(material);
    if daemon {
        tracing::info!(principal = %material.principal, "mutual TLS on");
        // A server runs for months: renewed files (cert-manager's, or `granary cert issue`
        // written over them) are taken up without a restart.
        material.watch(args.tls_reload_every.unwrap_or(tls::RELOAD_EVERY));
    }
    Ok(Tcp::net(Some(material)))
}

/// `granary local`: its own CA and one identity for the embedded master, worker and mount,
/// made in memory at each start (nothing else can reach its ports), unless TLS material
/// or `--insecure` is given.
pub fn local_net(args: &TlsArgs) -> anyhow::Result<Net> {
    // The embedded master is master 1 (a group of one).
    if args.insecure || args.given() {
        return net(args, &[Need::Master(1), Need::Node], true);
    }
    let ca = tls::new_ca("granary local CA", 2)?;
    let mut spec = LeafSpec::new(
        "local",
        &[Role::Master, Role::Node, Role::Admin, Role::User],
        2,
    );
    spec.master_id = Some(1);
    let own = tls::issue(&ca, &spec)?;
    Ok(Tcp::net(Some(Arc::new(TlsMaterial::from_pems(
        ca.cert, own,
    )?))))
}

/// Refuses to start a server whose certificate is not what it needs: a master needs a
/// `master` certificate of its own id (a worker's cannot speak Raft), a worker a `node` one.
fn check_identity(cert: &Path, p: &tls::Principal, need: Need) -> anyhow::Result<()> {
    match need {
        Need::Node if !p.has(Role::Node) => bail!(
            "the certificate {} is for {p}, not a node; issue one with `granary cert issue NAME --role node`",
            cert.display()
        ),
        Need::Master(id) if !p.has(Role::Master) => bail!(
            "the certificate {} is for {p}, not a master; issue one with `granary cert issue NAME --role master --master-id {id}` (masters and workers have distinct identities)",
            cert.display()
        ),
        Need::Master(id) if p.master_id != Some(id) => bail!(
            "the certificate {} is for {p}, but this is master {id} (--id); issue one with `granary cert issue NAME --role master --master-id {id}`",
            cert.display()
        ),
        _ => Ok(()),
    }
}

/// Writes `(name, data, mode)` files into `dir`; unless `force`, refuses (before writing
/// any: a half-replaced set is useless) when one exists, saying what replacing it means.
fn write_set(
    dir: &Path,
    files: &[(&str, &str, u32)],
    force: bool,
    replacing: &str,
) -> anyhow::Result<()> {
    if !force {
        if let Some((name, _, _)) = files.iter().find(|(n, _, _)| dir.join(n).exists()) {
            bail!(
                "{} exists; pass --force to {replacing}",
                dir.join(name).display()
            );
        }
    }
    // Each file is written beside its place and renamed over it: a server reading the
    // folder again (it does every minute) sees the old file or the new one, never part.
    for (name, data, mode) in files {
        let path = dir.join(name);
        tls::replace_file(&path, data.as_bytes(), *mode)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

pub fn cert(c: CertCommand, tls_args: &TlsArgs) -> anyhow::Result<()> {
    match c {
        CertCommand::Init {
            ca_dir,
            days,
            name,
            force,
        } => {
            std::fs::create_dir_all(&ca_dir)
                .with_context(|| format!("creating {}", ca_dir.display()))?;
            let ca = tls::new_ca(&name, days)?;
            write_set(
                &ca_dir,
                &[("ca.key", &ca.key, 0o600), ("ca.crt", &ca.cert, 0o644)],
                force,
                "replace the CA (every certificate it issued stops working)",
            )?;
            println!(
                "cluster CA written to {} (ca.crt, ca.key; valid {days} days)",
                ca_dir.display()
            );
            Ok(())
        }
        CertCommand::Issue {
            name,
            roles,
            master_id,
            ca_dir,
            out,
            days,
            subtree,
            hosts,
            force,
        } => {
            if name.trim().is_empty() {
                bail!("the certificate's name must not be empty");
            }
            let subtree = subtree
                .map(|s| granary_common::paths::normalize(&s))
                .transpose()
                .context("--subtree")?;
            let ca = Pems {
                cert: read(&ca_dir.join("ca.crt"))?,
                key: read(&ca_dir.join("ca.key"))?,
            };
            if roles.contains(&Role::Master) && master_id.is_none() {
                bail!("--role master needs --master-id N (the master's --id): a master certificate speaks for one master");
            }
            if master_id.is_some() && !roles.contains(&Role::Master) {
                bail!("--master-id goes with --role master only");
            }
            let mut spec = LeafSpec::new(&name, &roles, days);
            spec.subtree = subtree;
            spec.master_id = master_id;
            spec.hosts = hosts;
            let own = tls::issue(&ca, &spec)?;
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            write_set(
                &out,
                &[
                    ("tls.key", &own.key, 0o600),
                    ("tls.crt", &own.cert, 0o644),
                    ("ca.crt", &ca.cert, 0o644),
                ],
                force,
                "replace it",
            )?;
            let m = TlsMaterial::from_pems(ca.cert, own)?;
            println!(
                "certificate for {} written to {} (ca.crt, tls.crt, tls.key; valid {days} days); use it with --tls-dir {}",
                m.principal,
                out.display(),
                out.display()
            );
            Ok(())
        }
        CertCommand::Show { file, json } => {
            let path = match (file, &tls_args.tls_cert, &tls_args.tls_dir) {
                (Some(f), _, _) => f,
                (None, Some(f), _) => f.clone(),
                (None, None, Some(d)) => d.join("tls.crt"),
                (None, None, None) => bail!("name a certificate file or pass --tls-dir"),
            };
            show(&path, json)
        }
    }
}

fn show(path: &Path, json: bool) -> anyhow::Result<()> {
    let text = read(path)?;
    let info = tls::describe(&text).with_context(|| format!("{}", path.display()))?;
    if json {
        let v = serde_json::json!({
            "name": info.principal.name,
            "roles": info.principal.roles().iter().map(|r| r.name()).collect::<Vec<_>>(),
            "subtree": info.principal.subtree,
            "master_id": info.principal.master_id,
            "issuer": info.issuer,
            "not_before": info.not_before,
            "not_after": info.not_after,
            "valid_now": info.valid_now,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("principal: {}", info.principal);
        println!("issuer:    {}", info.issuer);
        println!(
            "valid:     {} to {}{}",
            info.not_before,
            info.not_after,
            if info.valid_now {
                ""
            } else {
                " (NOT VALID NOW)"
            }
        );
    }
    Ok(())
}
