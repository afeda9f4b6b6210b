//! Property test: the namespace state machine against a reference model (a map of paths).

use granary_common::paths::is_within;
use proptest::prelude::*;
use std::collections::BTreeMap;

use super::*;

#[derive(Debug, Clone)]
enum Op {
    Mkdir(String, bool),
    Create(String),
    Delete(String, bool),
    Rename(String, String),
}

fn path() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(vec!["a", "b", "c"]), 0..4)
        .prop_map(|v| format!("/{}", v.join("/")))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (path(), any::<bool>()).prop_map(|(p, r)| Op::Mkdir(p, r)),
        path().prop_map(Op::Create),
        (path(), any::<bool>()).prop_map(|(p, r)| Op::Delete(p, r)),
        (path(), path()).prop_map(|(a, b)| Op::Rename(a, b)),
    ]
}

/// The model: every path below the root and whether it is a directory.
#[derive(Default, Debug)]
struct Model(BTreeMap<String, bool>);

fn parent(p: &str) -> String {
    match p.rfind('/') {
        Some(0) => "/".into(),
        Some(i) => p[..i].into(),
        None => "/".into(),
    }
}

impl Model {
    fn is_dir(&self, p: &str) -> Option<bool> {
        if p == "/" {
            Some(true)
        } else {
            self.0.get(p).copied()
        }
    }

    fn has_children(&self, p: &str) -> bool {
        self.0.keys().any(|k| k != p && is_within(k, p))
    }

    /// Every proper ancestor of `p` (from the root down), excluding "/".
    fn ancestors(p: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut cur = parent(p);
        while cur != "/" {
            out.push(cur.clone());
            cur = parent(&cur);
        }
        out.reverse();
        out
    }

    fn apply(&mut self, op: &Op) -> bool {
        match op {
            Op::Mkdir(p, rec) => {
                if p == "/" {
                    return *rec;
                }
                if *rec {
                    let anc = Self::ancestors(p);
                    if anc.iter().any(|a| self.is_dir(a) == Some(false)) {
                        return false;
                    }
                    match self.is_dir(p) {
                        Some(true) => true,
                        Some(false) => false,
                        None => {
                            for a in anc {
                                self.0.insert(a, true);
                            }
                            self.0.insert(p.clone(), true);
                            true
                        }
                    }
                } else {
                    if self.is_dir(&parent(p)) != Some(true) || self.is_dir(p).is_some() {
                        return false;
                    }
                    self.0.insert(p.clone(), true);
                    true
                }
            }
            Op::Create(p) => {
                if p == "/" || self.is_dir(&parent(p)) != Some(true) || self.is_dir(p).is_some() {
                    return false;
                }
                self.0.insert(p.clone(), false);
                true
            }
            Op::Delete(p, rec) => {
                if p == "/" || self.is_dir(p).is_none() {
                    return false;
                }
                if self.is_dir(p) == Some(true) && !rec && self.has_children(p) {
                    return false;
                }
                self.0.retain(|k, _| !is_within(k, p));
                true
            }
            Op::Rename(src, dst) => {
                if src == "/" || dst == "/" || is_within(dst, src) {
                    return false;
                }
                let Some(src_dir) = self.is_dir(src) else {
                    return false;
                };
                if self.is_dir(&parent(dst)) != Some(true) {
                    return false;
                }
                // POSIX: a file replaces a file, a directory an empty directory.
                match self.is_dir(dst) {
                    None => {}
                    _ if src == dst => return true,
                    Some(d) if d != src_dir => return false,
                    Some(true) if self.has_children(dst) => return false,
                    Some(_) => {
                        self.0.remove(dst.as_str());
                    }
                }
                let moved: Vec<(String, bool)> = self
                    .0
                    .iter()
                    .filter(|(k, _)| is_within(k, src))
                    .map(|(k, v)| (k.clone(), *v))
                    .collect();
                for (k, v) in moved {
                    self.0.remove(&k);
                    self.0.insert(format!("{dst}{}", &k[src.len()..]), v);
                }
                true
            }
        }
    }
}

fn snapshot(sm: &StateMachine) -> BTreeMap<String, bool> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(ROOT_INODE, "/".to_string())];
    while let Some((id, p)) = stack.pop() {
        for c in sm.children(id, None, usize::MAX).unwrap() {
            let cp = granary_common::paths::join(&p, &c.name);
            let is_dir = c.kind == Kind::Directory;
            if is_dir {
                stack.push((c.id, cp.clone()));
            }
            out.insert(cp, is_dir);
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn namespace_matches_the_model(ops in prop::collection::vec(op(), 1..40)) {
        let (_dir, sm) = super::tests::open();
        let mut model = Model::default();
        for (i, op) in ops.iter().enumerate() {
            let cmd = match op {
                Op::Mkdir(p, r) => Command::Mkdir { path: p.clone(), recursive: *r, mode: 0, now_ms: 1, owner: None },
                Op::Create(p) => Command::CreateFile { path: p.clone(), mode: 0, block_size: 0, now_ms: 1, overwrite: false, owner: None, creator: None },
                Op::Delete(p, r) => Command::Delete { path: p.clone(), recursive: *r },
                Op::Rename(a, b) => Command::Rename { src: a.clone(), dst: b.clone(), now_ms: 1 },
            };
            let got = sm.apply(i as u64 + 1, &cmd).is_ok();
            let want = model.apply(op);
            prop_assert_eq!(got, want, "op {:?} disagreed (sm ok = {})", op, got);
            prop_assert_eq!(snapshot(&sm), model.0.clone(), "state after {:?}", op);
            prop_assert_eq!(sm.inode_count().unwrap(), model.0.len() as u64 + 1);
            prop_assert_eq!(sm.applied_index().unwrap(), i as u64 + 1);
        }
    }
}

/// Hostile Raft entries: a state machine fed arbitrary bytes, and valid commands with
/// mutated fields, decodes or refuses each entry and never panics; what it refuses changes
/// nothing.
mod hostile_entries {
    use super::*;

    /// Texts a hostile client might put in a path: traversal, NUL, separators, huge or
    /// deep paths, non-ASCII, empty.
    fn nasty_path() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("/../etc/passwd".to_string()),
            Just("/a/\0/b".to_string()),
            Just("".to_string()),
            Just("relative/x".to_string()),
            Just(format!("/{}", "d/".repeat(3000))),
            Just(format!("/{}", "x".repeat(300))),
            "[/a-c.\\\\\u{0}\u{202e}é]{0,40}",
            path(),
        ]
    }

    fn command() -> impl Strategy<Value = Command> {
        prop_oneof![
            (nasty_path(), any::<bool>(), any::<u32>()).prop_map(|(p, r, m)| Command::Mkdir {
                path: p,
                recursive: r,
                mode: m,
                now_ms: 1,
                owner: None
            }),
            (nasty_path(), any::<u64>(), any::<bool>()).prop_map(|(p, b, o)| Command::CreateFile {
                path: p,
                mode: 0,
                block_size: b,
                now_ms: 1,
                overwrite: o,
                owner: None,
                creator: None
            }),
            (nasty_path(), any::<bool>()).prop_map(|(p, r)| Command::Delete {
                path: p,
                recursive: r
            }),
            (nasty_path(), nasty_path()).prop_map(|(a, b)| Command::Rename {
                src: a,
                dst: b,
                now_ms: 1
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = Proposal::decode(&bytes);
        }

        #[test]
        fn mutated_encodings_decode_or_fail_cleanly(cmd in command(), cut in any::<usize>(), flip in any::<(usize, u8)>()) {
            let p = Proposal { request_id: 7, at_ms: 1, cmd };
            // This release's entries, and the JSON ones of the releases before format 1.
            for mut bytes in [p.encode(), serde_json::to_vec(&p).unwrap()] {
                prop_assert_eq!(Proposal::decode(&bytes).unwrap(), p.clone());
                let i = flip.0 % bytes.len();
                bytes[i] ^= flip.1;
                let _ = Proposal::decode(&bytes);
                bytes.truncate(cut % (bytes.len() + 1));
                let _ = Proposal::decode(&bytes);
            }
        }

        #[test]
        fn hostile_commands_are_applied_or_refused_without_a_trace(cmds in prop::collection::vec(command(), 1..24)) {
            let (_dir, sm) = super::super::tests::open();
            for (i, cmd) in cmds.iter().enumerate() {
                let before = snapshot(&sm);
                if sm.apply(i as u64 + 1, cmd).is_err() {
                    prop_assert_eq!(snapshot(&sm), before, "a refused {:?} changed the state", cmd);
                }
                // Whatever was accepted is a valid, normalised path.
                for p in snapshot(&sm).keys() {
                    let n = granary_common::paths::normalize(p).ok();
                    prop_assert_eq!(n.as_deref(), Some(p.as_str()));
                }
            }
        }
    }
}
