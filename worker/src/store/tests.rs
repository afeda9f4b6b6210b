use super::*;

fn open(dir: &Path, cap: u64) -> Arc<PageStore> {
    PageStore::open(dir, cap, 4096, PolicyKind::Lru, WorkerMetrics::default()).unwrap()
}

fn key(block: u32, page: u32) -> PageKey {
    ((7, 9, block), page)
}

fn fill(s: &Arc<PageStore>, k: PageKey, byte: u8) -> bool {
    match s.reserve(&k, 4096) {
        Some(r) => {
            s.commit(r, k, &[byte; 4096]).unwrap();
            true
        }
        None => false,
    }
}

#[test]
fn never_exceeds_capacity_and_evicts_lru() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 3 * 4096);
    for p in 0..3 {
        assert!(fill(&s, key(0, p), p as u8));
    }
    assert!(s.get(&key(0, 0)).is_some()); // page 0 becomes most recent
    assert!(fill(&s, key(0, 3), 3));
    assert_eq!(s.used(), 3 * 4096);
    assert!(s.get(&key(0, 1)).is_none(), "LRU page 1 should be gone");
    assert_eq!(s.get(&key(0, 0)).unwrap()[0], 0);
    assert_eq!(s.get(&key(0, 3)).unwrap()[0], 3);
}

#[test]
fn reservations_count_against_capacity() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 2 * 4096);
    let r1 = s.reserve(&key(9, 9), 4096).unwrap();
    let r2 = s.reserve(&key(9, 9), 4096).unwrap();
    assert!(
        s.reserve(&key(9, 9), 4096).is_none(),
        "both slots are in flight"
    );
    assert_eq!(s.used_and_reserved(), 2 * 4096);
    drop(r1);
    s.commit(r2, key(1, 0), &[1; 4096]).unwrap();
    assert_eq!(s.used_and_reserved(), 4096);
}

#[test]
fn corrupt_page_is_dropped() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 8 * 4096);
    assert!(fill(&s, key(2, 1), 0xaa));
    let path = s.block_path(&key(2, 1).0);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0x55], 4096 + 17).unwrap();
    assert!(s.get(&key(2, 1)).is_none());
    assert_eq!(s.used(), 0);
}

#[test]
fn survives_reopen_and_reports_blocks() {
    let d = tempfile::tempdir().unwrap();
    {
        let s = open(d.path(), 8 * 4096);
        assert!(fill(&s, key(3, 0), 1));
        assert!(fill(&s, key(4, 2), 2));
        let (added, removed) = s.take_deltas();
        assert_eq!(added.len(), 2);
        assert!(removed.is_empty());
    }
    let s = open(d.path(), 8 * 4096);
    assert_eq!(s.used(), 2 * 4096);
    assert_eq!(s.get(&key(4, 2)).unwrap()[0], 2);
    let mut blocks: Vec<u32> = s.blocks().iter().map(|b| b.index).collect();
    blocks.sort();
    assert_eq!(blocks, [3, 4]);
    // Reopen with a smaller capacity evicts down to it.
    drop(s);
    let s = open(d.path(), 4096);
    assert_eq!(s.used(), 4096);
}

#[test]
fn worker_id_is_persistent() {
    let d = tempfile::tempdir().unwrap();
    let a = worker_id(d.path()).unwrap();
    assert_eq!(a, worker_id(d.path()).unwrap());
    assert_ne!(a, 0);
}

#[test]
fn stale_drops_touch_only_other_versions_of_the_named_inodes() {
    let d = tempfile::tempdir().unwrap();
    let m = WorkerMetrics::default();
    let s = PageStore::open(d.path(), 64 * 4096, 4096, PolicyKind::Lru, m.clone()).unwrap();
    let page = |inode: u64, version: u64, block: u32, p: u32| ((inode, version, block), p);
    let keys = [
        page(6, 9, 0, 0),
        page(7, 9, 0, 0),
        page(7, 9, 1, 3),
        page(7, 10, 0, 0),
        page(8, 9, 0, 0),
        page(u64::MAX, 1, 0, 0),
        page(u64::MAX, 2, 0, 0),
    ];
    for (i, k) in keys.iter().enumerate() {
        assert!(fill(&s, *k, i as u8));
    }
    assert_eq!(s.drop_stale_many(&[(7, 10), (u64::MAX, 2)]), 3 * 4096);
    let left: Vec<bool> = keys.iter().map(|k| s.contains(k)).collect();
    assert_eq!(left, [true, false, false, true, true, false, true]);
    // Keep 0: nothing of the inode stays.
    assert_eq!(s.drop_stale(8, 0), 4096);
    assert!(!s.contains(&page(8, 9, 0, 0)));
    assert_eq!(s.used(), 3 * 4096);
    let dropped = |reason: &str| {
        m.dropped_pages
            .get_or_create(&crate::metrics::DropReason {
                reason: reason.into(),
            })
            .get()
    };
    assert_eq!((dropped("stale"), dropped("capacity")), (4, 0));
    assert_eq!(m.evicted_bytes.get(), 0, "a stale drop is not an eviction");
}

#[test]
fn held_pages_stay_until_unpinned_or_the_lease_ends() {
    use std::time::{Duration, Instant};
    let d = tempfile::tempdir().unwrap();
    // 8 pages: leases may hold 2 of them.
    let s = open(d.path(), 8 * 4096);
    let later = Instant::now() + Duration::from_secs(60);
    for b in 0..8 {
        assert!(fill(&s, key(b, 0), b as u8));
    }
    assert!(s.pin(7));
    // Everything cached is pinned: a new page is served uncached, nothing is evicted.
    assert!(s.reserve(&key(8, 0), 4096).is_none());
    assert_eq!(s.page_count(), 8);
    s.unpin(7);
    let l0 = s.lease(&key(0, 0).0, 0, later, None).unwrap();
    assert_eq!(l0.pages, vec![(0, 4096, crc32c::crc32c(&[0u8; 4096]))]);
    assert_eq!(l0.path, s.block_path(&key(0, 0).0));
    let l1 = s.lease(&key(1, 0).0, 0, later, None).unwrap();
    assert!(
        s.lease(&key(2, 0).0, 0, later, None).is_none(),
        "over the leased share"
    );
    assert_eq!(s.lease_stats(), (2, 2 * 4096));
    for b in 8..14 {
        assert!(fill(&s, key(b, 0), b as u8));
    }
    assert!(
        s.contains(&key(0, 0)) && s.contains(&key(1, 0)),
        "leased pages stay"
    );
    assert!(!s.contains(&key(2, 0)));
    // Replacing a lease releases the old one; an expired lease holds nothing.
    let l1b = s
        .lease(&key(1, 0).0, 0, Instant::now(), Some(l1.id))
        .unwrap();
    assert_ne!(l1b.id, l1.id);
    s.release(l0.id);
    for b in 14..22 {
        assert!(fill(&s, key(b, 0), b as u8));
    }
    assert!(!s.contains(&key(0, 0)) && !s.contains(&key(1, 0)));
    assert_eq!(s.lease_stats(), (0, 0));
    assert!(
        s.lease(&key(0, 0).0, 0, later, None).is_none(),
        "nothing cached, no lease"
    );
}

#[test]
fn master_pins_and_write_pins_do_not_undo_each_other() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 4 * 4096);
    // One single-page file per inode.
    let k = |inode: u64| ((inode, 1, 0), 0);
    for i in 0..4 {
        assert!(fill(&s, k(i), i as u8));
    }
    // Inode 0 pinned by a write and by the master; inode 1 by the master.
    s.pin(0);
    s.set_pinned(&[0, 1].into_iter().collect());
    s.unpin(0); // the write is persisted: the master's pin still holds it
    for i in 4..12 {
        fill(&s, k(i), i as u8);
    }
    assert!(s.contains(&k(0)) && s.contains(&k(1)));
    assert!(!s.contains(&k(2)) && !s.contains(&k(3)));
    // Unpinned by the master: evictable again.
    s.set_pinned(&Default::default());
    for i in 12..20 {
        fill(&s, k(i), i as u8);
    }
    assert!(!s.contains(&k(0)) && !s.contains(&k(1)));
}

/// Permission bits of `p`.
fn mode_of(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn block_files_and_their_folders_are_the_workers_alone() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    // A cache folder left by an older version, open to everyone.
    std::fs::create_dir_all(d.path().join("blocks")).unwrap();
    std::fs::set_permissions(
        d.path().join("blocks"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let s = open(d.path(), 8 * 4096);
    assert!(fill(&s, key(3, 0), 1));
    let file = s.block_path(&key(3, 0).0);
    assert_eq!(mode_of(&file), 0o600, "block file {}", file.display());
    assert_eq!(mode_of(file.parent().unwrap()), 0o700);
    assert_eq!(mode_of(&d.path().join("blocks")), 0o700);
    // What the worker wrote reads back (the worker's own user still can).
    assert_eq!(s.get(&key(3, 0)).unwrap()[..], [1; 4096]);
}

#[test]
fn room_reserved_for_other_bytes_evicts_pages_and_is_held_until_dropped() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 4 * 4096);
    for p in 0..4 {
        assert!(fill(&s, key(0, p), 1));
    }
    // Two pages' worth of journal: two pages go.
    let mut room = s.reserve_room(4096).unwrap();
    room.absorb(s.reserve_room(4096).unwrap()).ok().unwrap();
    assert_eq!(room.len(), 2 * 4096);
    assert_eq!((s.used(), s.used_and_reserved()), (2 * 4096, 4 * 4096));
    // Pinned pages are not evicted for it: no room beyond them.
    s.pin(7);
    assert!(s.reserve_room(3 * 4096).is_none());
    drop(room);
    assert_eq!(s.used_and_reserved(), 2 * 4096);
    // Another store's room is given back, not merged.
    let d2 = tempfile::tempdir().unwrap();
    let other = open(d2.path(), 4096);
    let mut mine = s.reserve_room(1).unwrap();
    assert!(mine.absorb(other.reserve_room(4096).unwrap()).is_err());
    assert_eq!(mine.len(), 1);
}

fn fill_node_copy(s: &Arc<PageStore>, k: PageKey, byte: u8) -> bool {
    match s.reserve_node_copy(&k, 4096) {
        Some(r) => {
            s.commit_with(r, k, &[byte; 4096], true).unwrap();
            true
        }
        None => false,
    }
}

#[test]
fn node_copies_go_first_and_never_push_out_an_owned_page() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 4 * 4096);
    assert!(fill(&s, key(0, 0), 0));
    assert!(fill_node_copy(&s, key(1, 0), 1));
    assert!(fill_node_copy(&s, key(1, 1), 2));
    assert!(fill(&s, key(0, 1), 3));
    assert_eq!(s.node_copy_bytes(), 2 * 4096);
    // Full. An owned page evicts the oldest node copy, not the least recent owned page.
    assert!(fill(&s, key(0, 2), 4));
    assert!(
        s.get(&key(1, 0)).is_none(),
        "the oldest node copy goes first"
    );
    assert!(s.get(&key(0, 0)).is_some() && s.get(&key(1, 1)).is_some());
    // A node copy may replace another node copy...
    assert!(fill_node_copy(&s, key(2, 0), 5));
    assert!(s.get(&key(1, 1)).is_none());
    assert_eq!(s.node_copy_bytes(), 4096);
    // ...but not an owned page: with only owned pages left to evict, it is not cached.
    assert!(fill(&s, key(0, 3), 6)); // evicts the last node copy
    assert_eq!(s.node_copy_bytes(), 0);
    assert!(!fill_node_copy(&s, key(3, 0), 7));
    for p in 0..4 {
        assert!(s.get(&key(0, p)).is_some(), "owned page {p} was evicted");
    }
}

#[test]
fn node_copies_stay_node_copies_after_a_restart() {
    let d = tempfile::tempdir().unwrap();
    {
        let s = open(d.path(), 4 * 4096);
        assert!(fill(&s, key(0, 0), 0));
        assert!(fill_node_copy(&s, key(1, 0), 1));
        // A node copy of a page owned already leaves it owned.
        assert!(fill_node_copy(&s, key(0, 0), 0));
        assert_eq!(s.node_copy_bytes(), 4096);
    }
    let s = open(d.path(), 4 * 4096);
    assert_eq!(s.node_copy_bytes(), 4096);
    assert!(fill(&s, key(0, 1), 2));
    assert!(fill(&s, key(0, 2), 3));
    assert!(fill(&s, key(0, 3), 4)); // full: the node copy goes, every owned page stays
    assert!(s.get(&key(1, 0)).is_none());
    for p in 0..4 {
        assert!(s.get(&key(0, p)).is_some(), "owned page {p} was evicted");
    }
    // An owned fill of a node-copy page makes it owned.
    let s2d = tempfile::tempdir().unwrap();
    let s2 = open(s2d.path(), 4 * 4096);
    assert!(fill_node_copy(&s2, key(5, 0), 1));
    assert!(fill(&s2, key(5, 0), 1));
    assert_eq!(s2.node_copy_bytes(), 0);
}

#[test]
fn a_leased_node_copy_is_passed_over_and_goes_first_again_once_let_go() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 4 * 4096);
    let later = Instant::now() + std::time::Duration::from_secs(60);
    assert!(fill_node_copy(&s, key(1, 0), 1));
    assert!(fill_node_copy(&s, key(2, 0), 2));
    assert!(fill(&s, key(0, 0), 0));
    assert!(fill(&s, key(0, 1), 3));
    let lease = s.lease(&key(1, 0).0, 0, later, None).unwrap();
    // Full: the oldest node copy is leased, so the next one goes.
    assert!(fill(&s, key(0, 2), 4));
    assert!(s.contains(&key(1, 0)) && !s.contains(&key(2, 0)));
    // Let go, it is first in line again, before any owned page.
    s.release(lease.id);
    assert!(fill(&s, key(0, 3), 5));
    assert!(!s.contains(&key(1, 0)));
    for p in 0..4 {
        assert!(s.contains(&key(0, p)), "owned page {p} was evicted");
    }
    assert_eq!(s.node_copy_bytes(), 0);
}
