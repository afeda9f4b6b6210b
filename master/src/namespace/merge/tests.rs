//! The page-by-page merge against a model of the namespace's apply: whatever the folder,
//! the listing and where its pages end, applying each page's changes as `SyncDir` batches
//! apply them leaves exactly what the whole listing says (a folder winning over a file of
//! the same name, names Granary cannot show left out), and every name below what a page
//! said it decided is final with that page; an unchanged listing changes nothing; a
//! listing stopped part-way leaves every known child past its last page as it was.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

/// Names that put folders out of name order (`-` and `.` sort before `/`, letters after).
fn name() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(vec!['a', 'b', '-', '.', '~']), 1..4)
        .prop_map(|c| c.into_iter().collect())
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::File), Just(Kind::Directory)]
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint {
        etag: format!("e{n}"),
        size: n as u64,
        ..Default::default()
    }
}

/// name → (kind, object; 0 for a folder), and the version the namespace gives it.
type Model = BTreeMap<String, (Kind, u8)>;

fn version(kind: Kind, object: u8) -> u64 {
    match kind {
        Kind::File => object as u64 + 1,
        Kind::Directory => 0,
    }
}

fn entry(name: &str, kind: Kind, object: u8) -> UfsEntry {
    UfsEntry {
        name: name.to_string(),
        kind,
        fingerprint: (kind == Kind::File).then(|| fp(object)),
    }
}

/// Reads the model's children after a name, in name order.
fn read(m: &Model, after: Option<&str>, n: usize) -> Vec<Known> {
    m.iter()
        .filter(|(k, _)| after.is_none_or(|a| k.as_str() > a))
        .take(n)
        .enumerate()
        .map(|(i, (name, (kind, object)))| Known {
            name: name.clone(),
            kind: *kind,
            fingerprint: (*kind == Kind::File).then(|| fp(*object)),
            version: version(*kind, *object),
            id: i as u64 + 2,
        })
        .collect()
}

/// What `Txn::sync_batch` does with a batch: upserts, then removals, each left alone when
/// the entry moved on since the merge saw it.
fn apply(m: &mut Model, c: &Changes) {
    let moved_on = |m: &Model, name: &str| {
        m.get(name)
            .is_some_and(|(k, o)| c.seen.get(name) != Some(&version(*k, *o)))
    };
    for e in &c.upserts {
        if moved_on(m, &e.name) {
            continue;
        }
        let object = e.fingerprint.as_ref().map_or(0, |f| f.size as u8);
        m.insert(e.name.clone(), (e.kind, object));
    }
    for name in &c.removed {
        if m.contains_key(name) && !moved_on(m, name) {
            m.remove(name);
        }
    }
}

/// What a whole listing says the folder holds.
fn expected(listing: &[(String, Kind, u8)]) -> Model {
    let mut m = Model::new();
    for (name, kind, object) in listing {
        if paths::validate_name(name).is_err() {
            continue;
        }
        match m.get(name) {
            Some((Kind::Directory, _)) => {}
            _ => {
                let object = if *kind == Kind::File { *object } else { 0 };
                m.insert(name.clone(), (*kind, object));
            }
        }
    }
    m
}

/// The listing in the store's key order, cut into pages of the given sizes (the rest in a
/// last page).
fn pages(listing: &[(String, Kind, u8)], sizes: &[usize]) -> Vec<Vec<UfsEntry>> {
    let mut sorted: Vec<UfsEntry> = listing.iter().map(|(n, k, o)| entry(n, *k, *o)).collect();
    sorted.sort_by(|a, b| Key::of(&a.name, a.kind).cmp(&Key::of(&b.name, b.kind)));
    sorted.dedup_by(|a, b| a.name == b.name && a.kind == b.kind);
    let mut out = Vec::new();
    let mut rest = sorted.as_slice();
    for &s in sizes {
        let (page, r) = rest.split_at(s.min(rest.len()));
        out.push(page.to_vec());
        rest = r;
    }
    out.push(rest.to_vec());
    out
}

/// Runs the merge over `pages` (the last one ends the listing unless `stop_after`), each
/// page's changes applied to the model before the next page. Also returns, after each page
/// but the last, what the merge said it decided and the model then.
fn run(
    m: &mut Model,
    pages: Vec<Vec<UfsEntry>>,
    known_page: usize,
    stop: Option<usize>,
) -> (Merge, Vec<(String, Model)>) {
    let mut merge = Merge::reading(known_page);
    let mut decided = Vec::new();
    let n = pages.len();
    for (i, p) in pages.into_iter().enumerate() {
        if stop.is_some_and(|s| i >= s) {
            break;
        }
        let snapshot = m.clone();
        let c = merge
            .page(p, i + 1 == n, &mut |after, k| {
                Ok::<_, ()>(read(&snapshot, after, k))
            })
            .unwrap();
        apply(m, &c);
        if let Some(t) = merge.decided_below().filter(|_| i + 1 < n) {
            decided.push((t, m.clone()));
        }
    }
    (merge, decided)
}

/// The entries of a model named below `t`.
fn below(m: &Model, t: &str) -> Model {
    m.iter()
        .filter(|(n, _)| n.as_str() < t)
        .map(|(n, v)| (n.clone(), *v))
        .collect()
}

/// A store lists a key once.
fn listing() -> impl Strategy<Value = Vec<(String, Kind, u8)>> {
    let kind = |dir: bool| if dir { Kind::Directory } else { Kind::File };
    prop::collection::btree_map((name(), any::<bool>()), 0u8..3, 0..24)
        .prop_map(move |m| m.into_iter().map(|((n, d), o)| (n, kind(d), o)).collect())
}

fn known() -> impl Strategy<Value = Model> {
    prop::collection::btree_map(name(), (kind(), 0u8..3), 0..24).prop_map(|m| {
        m.into_iter()
            .filter(|(n, _)| paths::validate_name(n).is_ok())
            .map(|(n, (k, o))| (n, (k, if k == Kind::File { o } else { 0 })))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn pages_merged_one_by_one_leave_what_the_whole_listing_says(
        mut m in known(),
        listing in listing(),
        sizes in prop::collection::vec(0usize..5, 0..8),
        known_page in 1usize..4,
    ) {
        let want = expected(&listing);
        let (_, decided) = run(&mut m, pages(&listing, &sizes), known_page, None);
        prop_assert_eq!(m, want.clone());
        // Every name below what a page decided was final with that page.
        for (t, then) in decided {
            prop_assert_eq!(below(&then, &t), below(&want, &t), "below {:?}", t);
        }
    }

    #[test]
    fn an_unchanged_listing_changes_nothing(
        m in known(),
        sizes in prop::collection::vec(0usize..5, 0..8),
        known_page in 1usize..4,
    ) {
        let listing: Vec<(String, Kind, u8)> =
            m.iter().map(|(n, (k, o))| (n.clone(), *k, *o)).collect();
        let pages = pages(&listing, &sizes);
        let mut merge = Merge::reading(known_page);
        let n = pages.len();
        for (i, p) in pages.into_iter().enumerate() {
            let c = merge.page(p, i + 1 == n, &mut |a, k| Ok::<_, ()>(read(&m, a, k))).unwrap();
            prop_assert!(c.is_empty(), "{:?}", c);
        }
    }

    #[test]
    fn a_listing_stopped_part_way_leaves_what_is_known_past_its_pages(
        m in known(),
        listing in listing(),
        sizes in prop::collection::vec(0usize..5, 1..8),
        stop in 1usize..8,
        known_page in 1usize..4,
    ) {
        let mut after = m.clone();
        let pages = pages(&listing, &sizes);
        if stop >= pages.len() {
            return Ok(()); // the whole listing came
        }
        let (merge, _) = run(&mut after, pages, known_page, Some(stop));
        let Some(passed) = merge.passed.clone() else { return Ok(()) };
        for (name, (kind, object)) in &m {
            if Key::of(name, *kind) > passed {
                prop_assert_eq!(after.get(name), Some(&(*kind, *object)), "{} went", name);
            }
        }
    }
}

#[test]
fn a_folder_comes_after_the_names_that_extend_it_below_the_delimiter() {
    let mut m = Model::new();
    for (n, k) in [
        ("a", Kind::Directory),
        ("a-b", Kind::Directory),
        ("a-b.c", Kind::File),
        ("a.txt", Kind::File),
        ("ab", Kind::File),
    ] {
        m.insert(n.to_string(), (k, 0));
    }
    let mut merge = Merge::reading(2);
    let mut order = Vec::new();
    while let Some(k) = merge
        .next_known(&mut |a, n| Ok::<_, ()>(read(&m, a, n)))
        .unwrap()
    {
        order.push(k.name);
    }
    assert_eq!(order, ["a-b.c", "a-b", "a.txt", "a", "ab"]);
}

#[test]
fn a_page_before_the_last_one_is_refused() {
    let mut merge = Merge::default();
    let none = &mut |_: Option<&str>, _| Ok::<_, ()>(Vec::new());
    merge
        .page(vec![entry("b", Kind::File, 1)], false, none)
        .unwrap();
    match merge.page(vec![entry("a", Kind::File, 1)], true, none) {
        Err(MergeError::OutOfOrder(o)) => assert_eq!(
            o,
            OutOfOrder {
                key: "a".into(),
                after: "b".into()
            }
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_file_waits_for_its_folder_twin_in_the_next_page() {
    // Known: a file `x`. The store now has a file `x` (page 1) and a folder `x/` (page 2):
    // the folder wins, and the file is never written over it and back.
    let mut m = Model::new();
    m.insert("x".into(), (Kind::File, 1));
    let mut merge = Merge::default();
    let snapshot = m.clone();
    let c = merge
        .page(vec![entry("x", Kind::File, 1)], false, &mut |a, n| {
            Ok::<_, ()>(read(&snapshot, a, n))
        })
        .unwrap();
    assert!(c.is_empty(), "{c:?}");
    let c = merge
        .page(vec![entry("x", Kind::Directory, 0)], true, &mut |a, n| {
            Ok::<_, ()>(read(&snapshot, a, n))
        })
        .unwrap();
    assert_eq!(c.upserts, vec![entry("x", Kind::Directory, 0)]);
    assert!(c.removed.is_empty());
    apply(&mut m, &c);
    assert_eq!(m.get("x"), Some(&(Kind::Directory, 0)));
}

#[test]
fn a_folder_named_again_on_a_later_page_is_passed_over() {
    let mut merge = Merge::default();
    let none = &mut |_: Option<&str>, _| Ok::<_, ()>(Vec::new());
    let c = merge
        .page(vec![entry("d", Kind::Directory, 0)], false, none)
        .unwrap();
    assert_eq!(c.upserts, vec![entry("d", Kind::Directory, 0)]);
    let c = merge
        .page(
            vec![entry("d", Kind::Directory, 0), entry("e", Kind::File, 1)],
            true,
            none,
        )
        .unwrap();
    assert_eq!(c.upserts, vec![entry("e", Kind::File, 1)]);
}

#[test]
fn a_store_naming_a_key_twice_or_going_back_changes_nothing_it_should_not() {
    // The same object twice on one page: one entry.
    let mut m = Model::new();
    let mut merge = Merge::default();
    let none = &mut |_: Option<&str>, _| Ok::<_, ()>(Vec::new());
    let twice = vec![
        entry("x", Kind::File, 1),
        entry("x", Kind::File, 1),
        entry("y", Kind::File, 2),
    ];
    apply(&mut m, &merge.page(twice, false, none).unwrap());
    // (`y` waits for the page that says whether a folder `y/` follows.)
    assert_eq!(m, Model::from([("x".to_string(), (Kind::File, 1))]));
    // A store looping back to a page it gave (tokens A, B, A …) is refused at once, before
    // anything past it is decided.
    assert!(matches!(
        merge.page(vec![entry("x", Kind::File, 1)], false, none),
        Err(MergeError::OutOfOrder(_))
    ));
}
