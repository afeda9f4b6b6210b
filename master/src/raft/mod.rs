//! Raft: the RocksDB log storage, state-machine snapshots, the gRPC transport between
//! masters and the node's ready loop.

pub mod logger;
pub mod node;
pub mod service;
pub mod snapshot;
pub mod storage;
pub mod transport;

#[cfg(test)]
mod tests;
