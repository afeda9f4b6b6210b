//! Which worker to ask for a block: weighted rendezvous hashing over the live workers, the
//! weight being the worker's cache capacity, so a worker with twice the cache owns twice
//! the blocks. Every client computes the same order from the same worker list, and a
//! membership change moves only the blocks of the workers that came or went.

use granary_common::ids::rendezvous_score;
use granary_proto as pb;

/// A worker's weight: its cache capacity in GiB (1 when it reports none, so equal
/// workers weigh the same whatever their size).
fn weight(w: &pb::WorkerInfo) -> f64 {
    match w.stats.as_ref().map(|s| s.capacity_bytes) {
        Some(c) if c > 0 => c as f64 / (1u64 << 30) as f64,
        _ => 1.0,
    }
}

/// Weighted rendezvous score: `-weight / ln(u)` with `u` the block/worker hash mapped into
/// (0, 1). A worker's share of the blocks is its weight over the sum of weights.
fn score(block: &pb::BlockId, w: &pb::WorkerInfo) -> f64 {
    let h = rendezvous_score(block, w.worker_id);
    // (h + 0.5) / 2^64: strictly inside (0, 1).
    let u = (h as f64 + 0.5) / 18_446_744_073_709_551_616.0;
    let u = u.clamp(f64::MIN_POSITIVE, 1.0 - f64::EPSILON);
    -weight(w) / u.ln()
}

/// Live workers in preference order for `block` (highest weighted score first).
pub fn order_workers(block: &pb::BlockId, workers: &[pb::WorkerInfo]) -> Vec<pb::WorkerInfo> {
    let mut v: Vec<(f64, &pb::WorkerInfo)> = workers.iter().map(|w| (score(block, w), w)).collect();
    v.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.worker_id.cmp(&b.1.worker_id)));
    v.into_iter().map(|(_, w)| w.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sized(id: u64, gib: u64) -> pb::WorkerInfo {
        pb::WorkerInfo {
            worker_id: id,
            stats: Some(pb::WorkerStats {
                capacity_bytes: gib << 30,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn blocks_spread_in_proportion_to_capacity() {
        let workers = vec![sized(1, 100), sized(2, 200), sized(3, 100)];
        let mut owners = [0u32; 4];
        let n = 8000;
        for i in 0..n {
            let b = pb::BlockId {
                inode: 11 + u64::from(i / 64),
                version: 1,
                index: i % 64,
            };
            owners[order_workers(&b, &workers)[0].worker_id as usize] += 1;
        }
        // Expected shares 1/4, 1/2, 1/4 (within 3 points).
        for (id, want) in [(1, 0.25), (2, 0.5), (3, 0.25)] {
            let got = f64::from(owners[id]) / f64::from(n);
            assert!(
                (got - want).abs() < 0.03,
                "worker {id}: {got:.3} of blocks, want {want}"
            );
        }
    }

    fn w(id: u64) -> pb::WorkerInfo {
        pb::WorkerInfo {
            worker_id: id,
            ..Default::default()
        }
    }

    #[test]
    fn stable_and_spread() {
        let workers = vec![w(1), w(2), w(3)];
        let mut owners = [0u32; 4];
        for i in 0..300 {
            let b = pb::BlockId {
                inode: 7,
                version: 1,
                index: i,
            };
            let a = order_workers(&b, &workers);
            let rev: Vec<_> = workers.iter().rev().cloned().collect();
            assert_eq!(a[0].worker_id, order_workers(&b, &rev)[0].worker_id);
            owners[a[0].worker_id as usize] += 1;
        }
        for o in &owners[1..] {
            assert!(*o > 60, "unbalanced placement: {owners:?}");
        }
    }

    #[test]
    fn removing_a_worker_moves_only_its_blocks() {
        let all = vec![w(1), w(2), w(3)];
        let without3 = vec![w(1), w(2)];
        for i in 0..200 {
            let b = pb::BlockId {
                inode: 9,
                version: 2,
                index: i,
            };
            let before = order_workers(&b, &all)[0].worker_id;
            let after = order_workers(&b, &without3)[0].worker_id;
            if before != 3 {
                assert_eq!(before, after);
            }
        }
    }
}
