//! Server modes. Each runs until SIGINT/SIGTERM, then shuts down cleanly (FUSE unmounted
//! first, so no process is left with a dead mount).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use granary_client::{FileSystem, MasterClient};
use granary_common::metrics::new_registry;
use granary_common::net::Net;
use granary_fuse::FuseConfig;
use granary_master::MasterConfig;
use granary_worker::WorkerConfig;
use tokio_util::sync::CancellationToken;

use crate::args::{FuseArgs, FuseOpts, LocalArgs, MasterArgs, WorkerArgs};

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

fn fuse_config(mount: PathBuf, o: &FuseOpts) -> FuseConfig {
    let mut c = FuseConfig::new(mount);
    c.attr_timeout = o.attr_timeout;
    c.entry_timeout = o.entry_timeout;
    c.negative_timeout = o.negative_timeout;
    c.threads = o.fuse_threads;
    c.allow_other = o.allow_other;
    c.read_ahead = o.read_ahead;
    c.passthrough = !o.no_passthrough && !o.no_short_circuit;
    c.passthrough_min_size = o.passthrough_min_size;
    c.push_ahead = o.push_ahead_files;
    c.push_max_size = o.push_max_size;
    c.warm_folder_bytes = o.warm_folder_bytes;
    c.node_local = o.locality == crate::args::Locality::Node;
    c.op_timeout = o.op_timeout;
    c.max_memory = o.max_memory;
    c.read_only = o.read_only;
    c.write_mode = o.write_mode;
    c.async_replicas = o.async_replicas as usize;
    c
}

pub async fn master(net: Net, a: MasterArgs) -> anyhow::Result<()> {
    let registry = new_registry();
    let shutdown = CancellationToken::new();
    let data_dir = a
        .data_dir
        .ok_or_else(|| anyhow::anyhow!("--data-dir is required to run a master"))?;
    let mut config = MasterConfig::new(data_dir, a.listen, net);
    config.id = a.id;
    config.peers = a.peers.unwrap_or_default();
    config.join = a.join;
    config.snapshot_entries = a.snapshot_entries;
    config.metrics_listen = a.metrics_listen;
    config.worker_timeout = a.worker_timeout;
    config.block_size = a.block_size;
    config.secrets = secrets_key(a.secrets_key_file.as_deref())?;
    config.mount_policy = granary_master::mounts::MountPolicy {
        local_roots: a.allow_local_roots,
        endpoints: a.allow_endpoints,
        wrap: None,
    };
    if let Some(r) = config
        .mount_policy
        .local_roots
        .iter()
        .find(|r| !r.is_absolute())
    {
        bail!(
            "--allow-local-root {:?} is not an absolute folder",
            r.display().to_string()
        );
    }
    if config.mount_policy.local_roots.is_empty() {
        tracing::info!("no --allow-local-root: file:// mounts will be refused");
    }
    let m = granary_master::start(config, registry, shutdown.clone()).await?;
    eprintln!("granary master listening on {}", m.addr);
    if let Some(ma) = m.metrics_addr {
        eprintln!("metrics on http://{ma}/metrics");
    }
    shutdown_signal().await;
    shutdown.cancel();
    m.done.await.context("master task")??;
    Ok(())
}

/// The masters' key for credentials at rest: from `--secrets-key-file`, else the
/// `GRANARY_SECRETS_KEY` variable, else none.
fn secrets_key(
    file: Option<&std::path::Path>,
) -> anyhow::Result<Option<Arc<granary_master::secrets::SecretBox>>> {
    let text = match file {
        Some(f) => {
            if std::env::var_os("GRANARY_SECRETS_KEY").is_some() {
                bail!("--secrets-key-file and GRANARY_SECRETS_KEY exclude each other");
            }
            std::fs::read(f).with_context(|| format!("reading the secrets key {}", f.display()))?
        }
        None => {
            match std::env::var("GRANARY_SECRETS_KEY") {
                Ok(v) => v.into_bytes(),
                Err(_) => {
                    tracing::warn!("no secrets key (--secrets-key-file): mounts with credentials will be refused");
                    return Ok(None);
                }
            }
        }
    };
    let key = granary_master::secrets::SecretBox::from_text(&text).map_err(anyhow::Error::msg)?;
    Ok(Some(Arc::new(key)))
}

pub async fn worker(net: Net, a: WorkerArgs) -> anyhow::Result<()> {
    let registry = new_registry();
    let shutdown = CancellationToken::new();
    let Some(cache_dir) = a.cache_dir else {
        anyhow::bail!("--cache-dir is required to run a worker");
    };
    if a.cache_size.is_none() && a.tier.is_empty() {
        anyhow::bail!("--cache-size (or --tier) is required to run a worker");
    }
    let mut config = WorkerConfig::new(
        a.master.master,
        a.listen,
        cache_dir,
        a.cache_size.unwrap_or(0),
        net,
    );
    config.tiers = a.tier;
    config.advertise = a.advertise;
    config.page_size = a.page_size;
    config.metrics_listen = a.metrics_listen;
    config.heartbeat_interval = a.heartbeat_interval;
    config.eviction = a.eviction;
    config.node_copies = a.locality == crate::args::Locality::Node;
    config.data_listen = a.data_listen;
    if let Some(n) = a.node_name {
        config.node_name = n;
    }
    let w = granary_worker::start(config, registry, shutdown.clone()).await?;
    eprintln!("granary worker {} listening on {}", w.worker_id, w.addr);
    if let Some(ma) = w.metrics_addr {
        eprintln!("metrics on http://{ma}/metrics");
    }
    shutdown_signal().await;
    shutdown.cancel();
    w.done.await.context("worker task")??;
    Ok(())
}

async fn serve_mount(client: Arc<FileSystem>, config: FuseConfig) -> anyhow::Result<()> {
    let mounted = granary_fuse::mount(client, &config, tokio::runtime::Handle::current())?;
    eprintln!(
        "granary mounted at {}; press Ctrl-C to unmount",
        config.mountpoint.display()
    );
    shutdown_signal().await;
    unmount(mounted).await
}

async fn unmount(mounted: granary_fuse::Mounted) -> anyhow::Result<()> {
    let mp = mounted.mountpoint.clone();
    eprintln!("unmounting {}", mp.display());
    tokio::task::spawn_blocking(move || mounted.unmount())
        .await
        .context("unmount task")?
        .with_context(|| format!("unmounting {}", mp.display()))?;
    Ok(())
}

/// `granary fuse`'s mount: mounted or taken over, served until a signal unmounts it or a
/// successor takes it over (this process then exits at once, leaving it mounted).
async fn serve_fuse_mount(
    client: Arc<FileSystem>,
    config: FuseConfig,
    h: &crate::args::HandoverOpts,
) -> anyhow::Result<()> {
    use granary_fuse::handover;
    let rt = tokio::runtime::Handle::current();
    let socket = h
        .handover_socket
        .clone()
        .unwrap_or_else(|| handover::default_socket(&config.mountpoint));
    let from = h.take_from.clone().or(h.takeover.map(|_| socket.clone()));
    // `--takeover auto` with no daemon answering: mount.
    let from = from.filter(|f| {
        h.takeover != Some(crate::args::TakeoverMode::Auto)
            || h.take_from.is_some()
            || std::os::unix::net::UnixStream::connect(f).is_ok()
    });
    let from_taken = from.is_some();
    let mounted = match from {
        Some(from) => {
            let (c, rt2) = (config.clone(), rt.clone());
            let (m, t) = tokio::task::spawn_blocking(move || {
                granary_fuse::take_over(client, &c, rt2, &from)
            })
            .await
            .context("takeover task")??;
            eprintln!(
                "granary took over the mount at {} (daemon pid {}, generation {}, after build {}; not fully served for {} ms{})",
                config.mountpoint.display(),
                std::process::id(),
                t.generation,
                t.donor_version,
                t.unserved.as_millis(),
                match (t.quiesced, t.resent) {
                    (true, _) => "; it answered every request it had read first",
                    (false, true) => "",
                    (false, false) => "; requests it had not answered failed",
                }
            );
            m
        }
        None => {
            let m = granary_fuse::mount(client, &config, rt.clone())?;
            eprintln!(
                "granary mounted at {} (daemon pid {}); press Ctrl-C to unmount",
                config.mountpoint.display(),
                std::process::id()
            );
            m
        }
    };
    if let Some(holder) = &h.holder_socket {
        crate::supervise::hold(holder, &mounted)
            .with_context(|| format!("giving the mount's descriptor to {}", holder.display()))?;
        if let Err(e) = crate::supervise::mirror(holder, &mounted) {
            tracing::warn!(holder = %holder.display(), error = %e, "cannot tell the supervisor about passthrough backing files: after a crash, files open in passthrough may fail to open again until closed");
        }
    }
    // A successor may take the mount over (where the kernel cannot resend, once this
    // daemon has answered every request it read).
    let resend = handover::kernel_can_resend(h.no_resend);
    if let Err(why) = &resend {
        eprintln!("{why}");
    }
    // The daemon taken over may still be ending (its socket live) for a moment.
    let end = std::time::Instant::now() + Duration::from_secs(10);
    let listened = loop {
        match handover::listen(&socket) {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && from_taken
                    && std::time::Instant::now() < end =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            r => break r,
        }
    };
    let handed = match listened {
        Ok(l) => Some(granary_fuse::serve_handovers(
            l,
            &mounted,
            rt,
            h.handover_timeout,
            resend.is_ok(),
        )?),
        Err(e) => {
            tracing::warn!(socket = %socket.display(), error = %e, "no handover socket: this mount cannot be taken over");
            None
        }
    };
    let handed = async {
        match handed {
            Some(rx) => rx.await.ok(),
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = shutdown_signal() => {
            if let Some(holder) = &h.holder_socket {
                crate::supervise::release(holder, false);
            }
            let _ = std::fs::remove_file(&socket);
            unmount(mounted).await
        }
        Some(pid) = handed => {
            if let Some(holder) = &h.holder_socket {
                crate::supervise::release(holder, true);
            }
            eprintln!("handed the mount at {} over to pid {pid}; exiting", config.mountpoint.display());
            // Without unmounting, and at once: the successor serves the mount from now on.
            std::process::exit(0)
        }
    }
}

pub async fn fuse(net: Net, a: FuseArgs) -> anyhow::Result<()> {
    if a.handover.supervise {
        // Recovering from a crash needs the kernel to resend what the dead daemon read.
        match granary_fuse::handover::kernel_can_resend(a.handover.no_resend) {
            Ok(()) => return crate::supervise::run(&a).await,
            Err(why) => eprintln!("--supervise is ignored: {why}"),
        }
    }
    let mut config = fuse_config(a.mount, &a.fuse);
    config.no_resend = a.handover.no_resend;
    // A mount point taken over is the FUSE mount itself, which nothing may serve yet (after
    // a crash): not looked at.
    if a.handover.takeover.is_none() && a.handover.take_from.is_none() {
        granary_fuse::check_mountpoint(&config.mountpoint)?;
    }
    let client = FileSystem::connect(net, &a.master.master)?;
    client.set_short_circuit(!a.fuse.no_short_circuit);
    client.set_data_plane(!a.fuse.no_data_plane);
    if let Some(n) = &a.fuse.node_name {
        client.short_circuit.set_node(n);
    }
    let shutdown = CancellationToken::new();
    if let Some(addr) = a.metrics_listen {
        let registry = new_registry();
        client.metrics.register(&registry);
        match granary_common::metrics::serve(addr, registry.clone(), shutdown.clone()).await {
            Ok(bound) => eprintln!("metrics on http://{bound}/metrics"),
            // The daemon this one replaces may still hold the port while it ends, and it ends
            // only once this one serves the mount: the metrics come up when it is free.
            Err(e) if a.handover.take_from.is_some() || a.handover.takeover.is_some() => {
                tracing::info!(%addr, error = %e, "metrics address busy; serving metrics once it is free");
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                    for _ in 0..600 {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        let served = granary_common::metrics::serve(
                            addr,
                            registry.clone(),
                            shutdown.clone(),
                        );
                        if let Ok(bound) = served.await {
                            eprintln!("metrics on http://{bound}/metrics");
                            return;
                        }
                    }
                    tracing::warn!(%addr, "metrics address still busy after 60 s: no metrics");
                });
            }
            Err(e) => return Err(e).with_context(|| format!("serving metrics on {addr}")),
        }
    }
    let served = serve_fuse_mount(client, config, &a.handover).await;
    shutdown.cancel();
    served
}

fn default_local_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"));
    base.join("granary").join("local")
}

pub async fn local(net: Net, a: LocalArgs) -> anyhow::Result<()> {
    let config = fuse_config(a.mount.clone(), &a.fuse);
    granary_fuse::check_mountpoint(&config.mountpoint)?;
    // A local folder may be given relative to the current directory.
    let ufs = if a.ufs.contains("://") {
        a.ufs.clone()
    } else {
        std::fs::canonicalize(&a.ufs)
            .with_context(|| format!("under-store directory {}", a.ufs))?
            .to_string_lossy()
            .into_owned()
    };
    let spec = granary_common::ufs::UfsSpec::new(&ufs, Default::default())?;
    spec.open()?;
    let dir = a.cache_dir.unwrap_or_else(default_local_dir);
    let registry = new_registry();
    let shutdown = CancellationToken::new();

    let mut mc = MasterConfig::new(dir.join("master"), "127.0.0.1:0".parse()?, net.clone());
    mc.metrics_listen = None;
    // The one folder this process serves is the one local root it allows.
    if let Some(d) = spec.local_dir() {
        mc.mount_policy.local_roots.push(d);
    }
    let m = granary_master::start(mc, registry.clone(), shutdown.clone()).await?;
    let master_addr = m.addr.to_string();

    let mut wc = WorkerConfig::new(
        master_addr.clone(),
        "127.0.0.1:0".parse()?,
        dir.join("worker"),
        a.cache_size,
        net.clone(),
    );
    wc.heartbeat_interval = Duration::from_millis(500);
    wc.eviction = a.eviction;
    if let Some(n) = &a.fuse.node_name {
        wc.node_name = n.clone();
    }
    let w = granary_worker::start(wc, registry.clone(), shutdown.clone()).await?;
    let client = FileSystem::connect(net.clone(), &master_addr)?;
    client.set_short_circuit(!a.fuse.no_short_circuit);
    client.set_data_plane(!a.fuse.no_data_plane);
    if let Some(n) = &a.fuse.node_name {
        client.short_circuit.set_node(n);
    }
    client.metrics.register(&registry);
    if let Some(addr) = a.metrics_listen {
        let bound = granary_common::metrics::serve(addr, registry.clone(), shutdown.clone())
            .await
            .with_context(|| format!("serving metrics on {addr}"))?;
        eprintln!("metrics on http://{bound}/metrics");
    }

    // The folder is mounted at the namespace root; a previous run over another folder is
    // replaced.
    let admin = MasterClient::new(net, &master_addr)?;
    let mounts = admin.list_mounts().await?;
    // A local folder's links that stay inside it are shown (`--symlinks`); links leaving it
    // never are.
    let options: Vec<granary_proto::MountOptionEntry> = match spec.local_dir() {
        Some(_) => vec![granary_proto::MountOptionEntry {
            key: "symlinks".into(),
            value: a.symlinks.clone(),
        }],
        None => Vec::new(),
    };
    let already = mounts.len() == 1
        && mounts[0].path == "/"
        && mounts[0].uri == spec.uri
        && options.iter().all(|o| {
            mounts[0]
                .options
                .iter()
                .any(|m| m.key == o.key && m.value == o.value)
        });
    if !already {
        for mnt in &mounts {
            // Refused while files of the old mount are only on the worker.
            admin.remove_mount(&mnt.path, false).await.with_context(|| {
                format!(
                    "cannot switch this cache to {}: run again with the earlier --ufs ({}) until its files are uploaded (or delete them through the mount), or use another --cache-dir",
                    spec.uri, mnt.uri
                )
            })?;
        }
        admin
            .add_mount("/", &spec.uri, options)
            .await
            .with_context(|| {
                format!(
                    "mounting {} at / (use another --cache-dir if this one holds other data)",
                    spec.uri
                )
            })?;
    }
    // Give the worker a moment to register so the first reads are cached.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !w.registered.load(Ordering::Relaxed) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !w.registered.load(Ordering::Relaxed) {
        bail!("the embedded worker did not register with the embedded master");
    }
    eprintln!(
        "granary local: serving {} (cache {} in {})",
        spec.uri,
        granary_common::size::format_size(a.cache_size),
        dir.display()
    );
    let served = serve_mount(client, config).await;
    shutdown.cancel();
    let _ = w.done.await;
    let _ = m.done.await;
    served
}
