//! Raft: the RocksDB log storage and the node's ready loop.

pub mod logger;
pub mod node;
pub mod storage;
