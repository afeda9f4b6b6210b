//! Which worker to ask for a block: rendezvous hashing over the live workers.

use granary_common::ids::rendezvous_score;
use granary_proto as pb;

/// Live workers in preference order for `block` (highest rendezvous score first).
pub fn order_workers(block: &pb::BlockId, workers: &[pb::WorkerInfo]) -> Vec<pb::WorkerInfo> {
    let mut v: Vec<(u64, &pb::WorkerInfo)> = workers
        .iter()
        .map(|w| (rendezvous_score(block, w.worker_id), w))
        .collect();
    v.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.worker_id.cmp(&b.1.worker_id)));
    v.into_iter().map(|(_, w)| w.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
