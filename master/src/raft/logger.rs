//! Bridges raft-rs's `slog` logging into `tracing` (target `granary::raft`).

use slog::{Drain, Level, OwnedKVList, Record};

struct TracingDrain;

impl Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &Record<'_>, _values: &OwnedKVList) -> Result<(), slog::Never> {
        let msg = record.msg();
        match record.level() {
            Level::Critical | Level::Error => tracing::error!(target: "granary::raft", "{msg}"),
            Level::Warning => tracing::warn!(target: "granary::raft", "{msg}"),
            Level::Info => tracing::info!(target: "granary::raft", "{msg}"),
            Level::Debug | Level::Trace => tracing::debug!(target: "granary::raft", "{msg}"),
        }
        Ok(())
    }
}

pub fn logger() -> slog::Logger {
    slog::Logger::root(TracingDrain.fuse(), slog::o!())
}
