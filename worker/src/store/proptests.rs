//! Property test: the page store under random fills, abandoned fills, reads, corruption-free
//! stale drops, pins, short-circuit leases and reopen, against a reference model of what was
//! committed — for every eviction policy. Checked after every step: used + reserved never
//! exceeds the quota, the accounting equals the pages present, every page read back is the
//! bytes committed, and no held page (pinned inode, leased block) was evicted.

use std::collections::{HashMap, HashSet};

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

const PAGE: u64 = 512;
const CAPACITY: u64 = 6 * PAGE;

#[derive(Debug, Clone)]
enum Op {
    /// Reserve and commit page (inode, page) of `len` bytes filled with `byte`.
    Fill(u64, u32, u64, u8),
    /// Reserve and drop the reservation (a fill that failed).
    Abandon(u64, u32),
    Read(u64, u32),
    /// Drop every version of `inode` other than `keep`.
    DropStale(u64, u64),
    Pin(u64),
    Unpin(u64),
    /// Lease the block of `inode` (all test pages live in block 0) from a page on.
    Lease(u64, u32),
    /// Release the n-th live lease (modulo their number).
    Release(usize),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4u64, 0..6u32, 1..=PAGE, any::<u8>()).prop_map(|(i, p, l, b)| Op::Fill(i, p, l, b)),
        1 => (0..4u64, 0..6u32).prop_map(|(i, p)| Op::Abandon(i, p)),
        4 => (0..4u64, 0..6u32).prop_map(|(i, p)| Op::Read(i, p)),
        1 => (0..4u64, 0..3u64).prop_map(|(i, k)| Op::DropStale(i, k)),
        1 => (0..4u64).prop_map(Op::Pin),
        1 => (0..4u64).prop_map(Op::Unpin),
        1 => (0..4u64, 0..6u32).prop_map(|(i, p)| Op::Lease(i, p)),
        1 => (0..8usize).prop_map(Op::Release),
        1 => Just(Op::Reopen),
    ]
}

/// Pages live at version `inode % 3` so stale drops have something to find.
fn key(inode: u64, page: u32) -> PageKey {
    ((inode, inode % 3, 0), page)
}

fn check(s: &Arc<PageStore>, model: &HashMap<PageKey, Vec<u8>>) -> Result<(), TestCaseError> {
    prop_assert!(s.used_and_reserved() <= CAPACITY, "over quota");
    prop_assert!(
        s.lease_stats().1 as f64 <= CAPACITY as f64 * LEASED_SHARE,
        "leases hold more than their share"
    );
    let present: Vec<PageKey> = model.keys().filter(|k| s.contains(k)).copied().collect();
    let used: u64 = present.iter().map(|k| model[k].len() as u64).sum();
    prop_assert_eq!(s.used(), used);
    prop_assert_eq!(s.page_count(), present.len() as u64);
    for k in present {
        let got = s.get(&k);
        prop_assert_eq!(got.as_deref(), Some(model[&k].as_slice()), "page {:?}", k);
    }
    Ok(())
}

fn run(policy: PolicyKind, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let d = tempfile::tempdir().unwrap();
    let open =
        || PageStore::open(d.path(), CAPACITY, PAGE, policy, WorkerMetrics::default()).unwrap();
    let mut s = open();
    let mut model: HashMap<PageKey, Vec<u8>> = HashMap::new();
    // What the store was told to hold (forgotten on reopen: pins come back from the master,
    // leases from clients).
    let mut pinned: HashSet<u64> = HashSet::new();
    let mut leases: Vec<(u64, Vec<PageKey>)> = Vec::new();
    for op in ops {
        // Held pages present before this step must still be there after it (unless the
        // step drops their version as stale).
        let held_before: Vec<PageKey> = model
            .keys()
            .filter(|k| {
                let leased = leases.iter().any(|(_, ks)| ks.contains(k));
                (pinned.contains(&k.0 .0) || leased) && s.contains(k)
            })
            .copied()
            .collect();
        let mut stale_dropped: Option<u64> = None;
        match op {
            Op::Fill(i, p, len, byte) => {
                let k = key(i, p);
                if s.contains(&k) {
                    continue; // the fetcher never refills a cached page
                }
                if let Some(r) = s.reserve(&k, len) {
                    let data = vec![byte; len as usize];
                    s.commit(r, k, 1 << 20, &data).unwrap();
                    model.insert(k, data);
                }
            }
            Op::Abandon(i, p) => {
                drop(s.reserve(&key(i, p), PAGE));
            }
            Op::Read(i, p) => {
                let k = key(i, p);
                if let Some(b) = s.get(&k) {
                    prop_assert_eq!(Some(&b[..]), model.get(&k).map(Vec::as_slice));
                }
            }
            Op::DropStale(i, keep) => {
                s.drop_stale(i, keep);
                if i % 3 != keep {
                    stale_dropped = Some(i);
                }
                if i % 3 != keep {
                    prop_assert!((0..6).all(|p| !s.contains(&key(i, p))));
                }
            }
            Op::Pin(i) => {
                s.pin(i);
                pinned.insert(i);
            }
            Op::Unpin(i) => {
                s.unpin(i);
                pinned.remove(&i);
            }
            Op::Lease(i, first) => {
                let b = key(i, 0).0;
                if let Some(l) =
                    s.lease(&b, first, Instant::now() + Duration::from_secs(3600), None)
                {
                    // A consecutive run of cached pages from `first`, at most a window.
                    let pages: Vec<u32> = l.pages.iter().map(|p| p.0).collect();
                    let run: Vec<u32> = (first..first + pages.len() as u32).collect();
                    prop_assert_eq!(&pages, &run);
                    prop_assert!(pages.len() as u32 <= LEASE_WINDOW_PAGES);
                    for p in &l.pages {
                        let k = key(i, p.0);
                        prop_assert!(s.contains(&k));
                        prop_assert_eq!(p.1 as usize, model[&k].len());
                    }
                    leases.push((l.id, pages.iter().map(|p| key(i, *p)).collect()));
                } else {
                    prop_assert!(!s.contains(&key(i, first)) || s.lease_stats().1 > 0);
                }
            }
            Op::Release(n) => {
                if !leases.is_empty() {
                    let (id, _) = leases.remove(n % leases.len());
                    s.release(id);
                }
            }
            Op::Reopen => {
                drop(s);
                s = open();
                pinned.clear();
                leases.clear();
            }
        }
        for k in held_before {
            if stale_dropped != Some(k.0 .0) {
                prop_assert!(s.contains(&k), "held page {:?} was evicted", k);
            }
        }
        check(&s, &model)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn lru_store_matches_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run(PolicyKind::Lru, ops)?;
    }

    #[test]
    fn lfu_admission_store_matches_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run(PolicyKind::LfuAdmission, ops)?;
    }
}
