use super::*;

fn open(dir: &Path, cap: u64) -> Arc<PageStore> {
    PageStore::open(dir, cap, 4096, PolicyKind::Lru, WorkerMetrics::default()).unwrap()
}

/// The block size of the test file (pages of 4 KiB: room for 256 per block).
const STRIDE: u64 = 1 << 20;

fn key(block: u32, page: u32) -> PageKey {
    ((7, 9, block), page)
}

fn fill(s: &Arc<PageStore>, k: PageKey, byte: u8) -> bool {
    match s.reserve(&k, 4096) {
        Some(r) => {
            s.commit(r, k, STRIDE, &[byte; 4096]).unwrap();
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
    s.commit(r2, key(1, 0), STRIDE, &[1; 4096]).unwrap();
    assert_eq!(s.used_and_reserved(), 4096);
}

#[test]
fn corrupt_page_is_dropped() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 8 * 4096);
    assert!(fill(&s, key(2, 1), 0xaa));
    let path = s.block_path(&key(2, 1).0);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0x55], 2 * STRIDE + 4096 + 17).unwrap();
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
    assert!(PageStore::pin(&s, 7));
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
    // A cache folder made by hand (or an older version), open to everyone.
    std::fs::create_dir_all(d.path().join("files")).unwrap();
    std::fs::set_permissions(
        d.path().join("files"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let s = open(d.path(), 8 * 4096);
    assert!(fill(&s, key(3, 0), 1));
    let file = s.block_path(&key(3, 0).0);
    assert_eq!(mode_of(&file), 0o600, "block file {}", file.display());
    assert_eq!(mode_of(file.parent().unwrap()), 0o700);
    assert_eq!(mode_of(&d.path().join("files")), 0o700);
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
            s.commit_with(r, k, STRIDE, &[byte; 4096], true).unwrap();
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

/// Reads `len` bytes at `at` of a cache file.
fn bytes_at(path: &Path, at: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, at)
        .unwrap();
    buf
}

#[test]
fn a_files_blocks_lie_at_their_offsets_in_one_cache_file_that_goes_with_its_last_page() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 64 * 4096);
    // Blocks of 2.5 pages: 10,240 bytes, the last page of each 2,048 bytes.
    const BS: u64 = 10_240;
    let commit = |k: PageKey, len: usize, byte: u8| {
        let r = s.reserve(&k, len as u64).unwrap();
        s.commit(r, k, BS, &vec![byte; len]).unwrap();
    };
    for b in 0..3u32 {
        commit(key(b, 0), 4096, 10 * b as u8);
        commit(key(b, 1), 4096, 10 * b as u8 + 1);
        commit(key(b, 2), 2048, 10 * b as u8 + 2);
    }
    let path = s.block_path(&key(0, 0).0);
    assert_eq!(path, s.block_path(&key(2, 1).0), "one file per version");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 3 * BS);
    for b in 0..3u64 {
        let base = b * BS;
        assert_eq!(bytes_at(&path, base, 4096), vec![10 * b as u8; 4096]);
        assert_eq!(
            bytes_at(&path, base + 4096, 4096),
            vec![10 * b as u8 + 1; 4096]
        );
        assert_eq!(
            bytes_at(&path, base + 8192, 2048),
            vec![10 * b as u8 + 2; 2048]
        );
    }
    // A lease says where its block starts.
    let l = s.lease(
        &key(1, 0).0,
        0,
        Instant::now() + std::time::Duration::from_secs(5),
        None,
    );
    let l = l.unwrap();
    assert_eq!(
        (l.path.clone(), l.offset, l.pages.len()),
        (path.clone(), BS, 3)
    );
    s.release(l.id);
    // A corrupt page of block 1 goes alone: the blocks around it stay readable.
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .write_all_at(&[0xff], BS + 4096 + 5)
        .unwrap();
    assert!(s.get(&key(1, 1)).is_none());
    assert_eq!(s.get(&key(0, 2)).unwrap()[..], [2; 2048]);
    assert_eq!(s.get(&key(2, 0)).unwrap()[..], [20; 4096]);
    assert_eq!(
        bytes_at(&path, BS + 4096, 4096),
        vec![0; 4096],
        "punched out"
    );
    // After a restart the pages are found where they were.
    drop(s);
    let s = open(d.path(), 64 * 4096);
    assert_eq!(s.get(&key(2, 2)).unwrap()[..], [22; 2048]);
    assert_eq!(s.get(&key(1, 0)).unwrap()[..], [10; 4096]);
    // The version's last page takes its file with it.
    assert_eq!(s.drop_stale(7, 0), 3 * BS - 4096);
    assert!(!path.exists());
}

#[test]
fn a_page_that_does_not_fit_its_block_or_the_files_block_size_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 16 * 4096);
    let try_commit = |k: PageKey, bs: u64, len: usize| {
        let r = s.reserve(&k, len as u64).unwrap();
        s.commit(r, k, bs, &vec![1; len])
    };
    try_commit(key(1, 0), 8192, 4096).unwrap();
    // Another block size for the same file version: refused, nothing written.
    let e = try_commit(key(2, 0), 16_384, 4096).unwrap_err();
    assert!(matches!(e, StoreError::Layout { .. }), "{e}");
    assert!(!s.contains(&key(2, 0)));
    // A page past its block's end, or a block past any file offset.
    assert!(try_commit(key(1, 2), 8192, 4096).is_err());
    assert!(try_commit(((8, 1, u32::MAX), 0), 1 << 40, 4096).is_err());
    assert_eq!(s.used(), 4096);
    assert_eq!(
        s.used_and_reserved(),
        4096,
        "refused pages give their room back"
    );
}

#[test]
fn a_cache_of_the_older_layout_is_dropped_never_misread() {
    let d = tempfile::tempdir().unwrap();
    {
        // The layout before: a file per block, records of (length, CRC32C[, node copy]).
        let old = d.path().join("blocks").join("07");
        std::fs::create_dir_all(&old).unwrap();
        std::fs::write(
            old.join("0000000000000007-0000000000000009-00000001"),
            [5; 4096],
        )
        .unwrap();
        let db = DB::open_default(d.path().join("index")).unwrap();
        let mut v = 4096u32.to_be_bytes().to_vec();
        v.extend_from_slice(&crc32c::crc32c(&[5; 4096]).to_be_bytes());
        db.put(index_key(&key(1, 0)), &v).unwrap();
        v.push(1);
        db.put(index_key(&key(1, 1)), &v).unwrap();
    }
    let s = open(d.path(), 8 * 4096);
    assert_eq!((s.used(), s.page_count()), (0, 0));
    assert!(s.get(&key(1, 0)).is_none());
    assert!(!d.path().join("blocks").exists());
    // Cached again in the new layout, it reads back (and the old records are gone).
    assert!(fill(&s, key(1, 0), 6));
    drop(s);
    let s = open(d.path(), 8 * 4096);
    assert_eq!((s.used(), s.get(&key(1, 0)).unwrap()[0]), (4096, 6));
}

#[test]
fn leases_of_the_same_pages_again_and_again_stop_at_the_reference_bound() {
    use std::time::{Duration, Instant};
    let d = tempfile::tempdir().unwrap();
    // 8 pages: the leased share is 2 pages, so the bound is the base plus 8 references.
    let s = open(d.path(), 8 * 4096);
    let later = Instant::now() + Duration::from_secs(60);
    assert!(fill(&s, key(0, 0), 1));
    let bound = MAX_LEASE_REFS_BASE + 8;
    let mut ids = Vec::new();
    for _ in 0..bound {
        ids.push(
            s.lease(&key(0, 0).0, 0, later, None)
                .expect("inside the bound")
                .id,
        );
    }
    // Leasing the page again takes no bytes of the share, but no more references.
    assert!(s.lease(&key(0, 0).0, 0, later, None).is_none());
    assert_eq!(s.lease_stats(), (bound, 4096));
    // Ending one makes room for one.
    s.release(ids.pop().unwrap());
    assert!(s.lease(&key(0, 0).0, 0, later, None).is_some());
    assert!(s.lease(&key(0, 0).0, 0, later, None).is_none());
    s.release_many(&ids);
    assert_eq!(s.lease_stats().0, 1);
}
