//! The `granary` command: server modes (`master`, `worker`, `fuse`, `local`) and admin
//! commands. Exit codes: 0 ok, 1 error (one sentence on stderr), 2 usage (from clap).

pub mod admin;
pub mod args;
pub mod config;
pub mod csi;
pub mod jobs;
pub mod security;
pub mod servers;
pub mod supervise;

use std::process::ExitCode;

use args::{Cli, Command};
use granary_common::net::{Net, Tcp};

/// Runs a parsed command line and maps the outcome to an exit code.
/// Raises the soft limit on open files to the hard one: a worker keeps a block file open per
/// cached block in use and a client one per short-circuit lease, and the usual soft limit
/// (1,024) is far below what a busy node needs.
/// Where allowed (root, `CAP_SYS_RESOURCE`), the hard limit is raised first, up to
/// 1,048,576 or the kernel's `fs.nr_open`: a mount keeps small files' block files open
/// across a loader's epochs, one descriptor per sample file.
fn raise_open_files_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    const WANTED: u64 = 1 << 20;
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(hard);
        let want = WANTED.min(nr_open).max(hard);
        if want > hard && setrlimit(Resource::RLIMIT_NOFILE, want, want).is_ok() {
            return;
        }
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open files limit");
            }
        }
    }
}

pub fn main(cli: Cli) -> ExitCode {
    granary_common::logging::init();
    raise_open_files_limit();
    if !serves(&cli.command) {
        end_quietly_on_closed_output();
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("granary")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = rt.block_on(run(cli));
    // Don't wait for stray tasks (e.g. idle connections) at exit.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::from(1)
        }
    }
}

/// Whether the command runs a server (or a benchmark that serves): those keep Rust's
/// ignored SIGPIPE, so a peer that goes away is an error on one connection, not the end of
/// the process.
fn serves(c: &Command) -> bool {
    match c {
        Command::Local(_) | Command::Fuse(_) | Command::Csi(_) | Command::Bench(_) => true,
        Command::Master(a) => a.action.is_none(),
        Command::Worker(a) => a.action.is_none(),
        _ => false,
    }
}

/// A command whose output goes to a reader that stops early (`granary fs ls / | head`)
/// ends as `ls` does, by SIGPIPE, instead of panicking on the next write. A SIGPIPE from
/// a connection does not end it: a server that closes one (a TLS port spoken to in
/// plaintext) makes that write fail, and the command reports it in one line — the default
/// disposition killed it silently there.
#[allow(unsafe_code)]
fn end_quietly_on_closed_output() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: called before the runtime or any other thread starts; the handler only makes
    // async-signal-safe calls (poll, sigaction, raise).
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::Handler(on_sigpipe)) };
}

/// Ends the process by SIGPIPE if its standard output or error is a pipe with no reader
/// left; returns otherwise (the write that raised it fails with EPIPE).
#[allow(unsafe_code)]
extern "C" fn on_sigpipe(_: nix::libc::c_int) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use nix::sys::signal::{raise, signal, SigHandler, Signal};
    for fd in [1, 2] {
        // SAFETY: descriptors 1 and 2 stay open for the life of the process.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let mut fds = [PollFd::new(fd, PollFlags::POLLOUT)];
        let broken = poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0)
            && fds[0]
                .revents()
                .is_some_and(|r| r.contains(PollFlags::POLLERR));
        if broken {
            // SAFETY: restores the default disposition from a handler (sigaction is
            // async-signal-safe), then raises the signal to end as a killed `ls` does.
            let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
            let _ = raise(Signal::SIGPIPE);
        }
    }
}

/// The error and its causes on one line.
fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    // Messages carry names, which may hold control characters.
    granary_common::paths::printable(&parts.join(": ").replace('\n', " ")).into_owned()
}

/// The network the command runs with, holding its identity (see [`security`]).
fn secure(cli: &Cli) -> anyhow::Result<Net> {
    use security::Need;
    let (needs, daemon) = match &cli.command {
        Command::Cert(_) | Command::Csi(_) => return Ok(Tcp::plain()),
        Command::Local(_) => return security::local_net(&cli.tls),
        Command::Master(a) if a.action.is_none() => (vec![Need::Master(a.id)], true),
        Command::Worker(a) if a.action.is_none() => (vec![Need::Node], true),
        Command::Fuse(_) => (vec![], true),
        _ => (vec![], false),
    };
    security::net(&cli.tls, &needs, daemon)
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let net = secure(&cli)?;
    match cli.command {
        Command::Cert(c) => security::cert(c, &cli.tls),
        Command::Local(a) => servers::local(net, a).await,
        Command::Master(a) => match a.action {
            Some(action) => admin::masters(&net, action).await,
            None => servers::master(net, a).await,
        },
        Command::Bench(c) => admin::bench(&net, c).await,
        Command::Worker(a) => match a.action {
            Some(action) => admin::workers(&net, action).await,
            None => servers::worker(net, a).await,
        },
        Command::Fuse(a) => servers::fuse(net, a).await,
        Command::Csi(a) => csi::serve(a).await,
        Command::Mount(c) => admin::mount(&net, c).await,
        Command::Fs(c) => admin::fs(&net, c).await,
        Command::Report(a) => admin::report(&net, a).await,
        Command::Load(a) => jobs::load(&net, a).await,
        Command::Job(c) => jobs::job(&net, c).await,
        Command::Pin(a) => jobs::pin(&net, a).await,
        Command::Ttl(c) => jobs::ttl(&net, c).await,
        Command::Free {
            path,
            recursive,
            force,
            json,
            master,
        } => jobs::free(&net, &path, recursive, force, json, &master).await,
        Command::Unpin { path, master } => jobs::unpin(&net, &path, &master).await,
    }
}
