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
            // Every start's construction notes are of no use at INFO.
            Level::Info if is_startup_chatter(&msg.to_string()) => {
                tracing::debug!(target: "granary::raft", "{msg}")
            }
            Level::Info => tracing::info!(target: "granary::raft", "{msg}"),
            Level::Debug | Level::Trace => tracing::debug!(target: "granary::raft", "{msg}"),
        }
        Ok(())
    }
}

/// raft-rs's notes on building a node, logged at INFO on every start.
fn is_startup_chatter(msg: &str) -> bool {
    msg.starts_with("newRaft") || msg.starts_with("RawNode created")
}

pub fn logger() -> slog::Logger {
    slog::Logger::root(TracingDrain.fuse(), slog::o!())
}

#[cfg(test)]
mod tests {
    #[test]
    fn startup_notes_are_chatter_and_elections_are_not() {
        assert!(super::is_startup_chatter("newRaft"));
        assert!(super::is_startup_chatter("RawNode created with id 1."));
        assert!(!super::is_startup_chatter("became leader at term 2"));
    }
}
