//! Ids derived from content identity.

use granary_proto::{BlockId, Fingerprint};

/// FNV-1a, 64 bit: a stable hash (unlike `std`'s `DefaultHasher`, which may change between
/// Rust releases) for ids that are persisted or compared across processes.
pub fn stable_hash(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.iter().chain(&[0xff]) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The version of a file: a hash of its under-store fingerprint. Pages of a file are cached
/// under `(inode, version)`, so a changed object can never be served from old pages.
pub fn version_of(fp: &Fingerprint) -> u64 {
    stable_hash(&[
        fp.etag.as_bytes(),
        &fp.size.to_le_bytes(),
        &fp.mtime_ms.to_le_bytes(),
        fp.version_id.as_bytes(),
    ])
}

/// Text form of a block id, used in file names and logs: `inode-version-index` in hex.
pub fn block_name(id: &BlockId) -> String {
    format!("{:016x}-{:016x}-{:08x}", id.inode, id.version, id.index)
}

/// Parses [`block_name`]'s output.
pub fn parse_block_name(name: &str) -> Option<BlockId> {
    let mut it = name.split('-');
    let inode = u64::from_str_radix(it.next()?, 16).ok()?;
    let version = u64::from_str_radix(it.next()?, 16).ok()?;
    let index = u32::from_str_radix(it.next()?, 16).ok()?;
    if it.next().is_some() {
        return None;
    }
    Some(BlockId {
        inode,
        version,
        index,
    })
}

/// Rendezvous (highest-random-weight) score of `worker` for `block`: the live worker with the
/// highest score owns the block. Adding or removing a worker moves only its own share.
pub fn rendezvous_score(block: &BlockId, worker_id: u64) -> u64 {
    // FNV's low-entropy inputs (small ids) need a finaliser to spread evenly.
    mix64(stable_hash(&[
        &block.inode.to_le_bytes(),
        &block.version.to_le_bytes(),
        &block.index.to_le_bytes(),
        &worker_id.to_le_bytes(),
    ]))
}

/// The 64-bit finaliser of MurmurHash3: every input bit affects every output bit.
pub fn mix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_names_round_trip() {
        let id = BlockId {
            inode: 42,
            version: u64::MAX,
            index: 7,
        };
        assert_eq!(parse_block_name(&block_name(&id)), Some(id));
        assert_eq!(parse_block_name("zz-1-2"), None);
    }

    #[test]
    fn version_changes_with_fingerprint() {
        let a = Fingerprint {
            etag: "e1".into(),
            size: 10,
            mtime_ms: 5,
            version_id: String::new(),
        };
        let mut b = a.clone();
        assert_eq!(version_of(&a), version_of(&b));
        b.etag = "e2".into();
        assert_ne!(version_of(&a), version_of(&b));
    }
}
