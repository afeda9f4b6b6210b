//! Under-stores of every kind in one namespace: S3 (s3s-fs), GCS (fake-gcs-server), Azure
//! Blob (Azurite) and a local folder, each started by the harness on 127.0.0.1 and loaded
//! by its own kind of client, mounted side by side and read through one FUSE mount.
//!
//! One test in this binary on purpose: it sets `AZURITE_BLOB_STORAGE_URL` for the Granary
//! processes it starts, which must not race with other tests spawning processes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use std::time::Duration;

use granary_tests::stores::{FaultProxy, TestStore};
use granary_tests::*;

const MIB: u64 = 1024 * 1024;
const S3_ACCESS: &str = "granary-test-access";
const S3_SECRET: &str = "Gr4nary-S3cret-never-shown-9f2c";

/// The conformance tree: empty object, multi-page objects, deep paths, spaces, unicode.
fn conformance_tree(root: &Path) -> PathBuf {
    let dir = root.join("tree");
    for (name, len) in [
        ("empty", 0),
        ("one-byte", 1),
        ("plain/a.bin", MIB + 3),
        ("plain/b.bin", 4096),
        ("big.bin", 5 * MIB + 11),
        ("deep/1/2/3/4/5/6/7/leaf.txt", 77),
        ("with space/file name.txt", 1234),
        ("unicodé/naïve ✓ 数据.bin", 4321),
        ("changing.bin", 64 * 1024),
    ] {
        random_file(&dir.join(name), len).unwrap();
    }
    for i in 0..20 {
        random_file(&dir.join(format!("many/f{i:02}.bin")), 10 + i * 100).unwrap();
    }
    // Bytes whose base64 MD5 (GCS's ETag, listed bare and sent quoted) begins with `W/`:
    // such a file once read as "changed" (ESTALE), the `W/` taken for a weak-tag marker.
    std::fs::write(dir.join("many/w-etag.txt"), b"granary etag 854\n").unwrap();
    dir
}

fn sha_of(path: &Path) -> Option<String> {
    sh(&format!("sha256sum < '{}'", path.display()))
        .ok()
        .map(|s| s.split_whitespace().next().unwrap_or_default().to_string())
}

/// SHA-256 of `len` bytes at `offset` of a file (a ranged read through the mount).
fn range_sha(path: &Path, offset: u64, len: u64) -> String {
    sh(&format!(
        "python3 -c \"import hashlib,sys; f=open(sys.argv[1],'rb'); f.seek({offset}); print(hashlib.sha256(f.read({len})).hexdigest())\" '{}'",
        path.display()
    ))
    .unwrap()
}

/// The store's mount options plus `extra`.
fn with_opts(store: &TestStore, extra: &[&str]) -> Vec<String> {
    store
        .options
        .iter()
        .cloned()
        .chain(extra.iter().map(|s| s.to_string()))
        .collect()
}

/// A folder of several pages (7 keys a request) changed in the store and listed again
/// (`fs sync`): the listing is merged into the namespace a page at a time. Names put
/// folders out of name order (`a/` lists after `a-b` and `a.txt`); a file becomes a folder
/// of the same name, files go and come, and what did not change keeps its inode number.
fn a_relisting_merges_page_by_page(s3: &TestStore, dir: &Path, at: &str, addr: &str) {
    let object = |key: &str| s3.object_file(&format!("relist/{key}")).unwrap();
    let write = |key: &str| random_file(&object(key), 100).unwrap();
    let mut keys: Vec<String> = ["a", "a-b", "a.txt", "x", "c/d.bin"]
        .iter()
        .map(|k| k.to_string())
        .collect();
    keys.extend((0..20).map(|i| format!("b{i:02}")));
    keys.extend((0..5).map(|i| format!("gone-{i}")));
    for k in &keys {
        write(k);
    }
    let names = |p: &Path| -> Vec<(String, bool)> {
        let mut v: Vec<(String, bool)> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    e.file_type().unwrap().is_dir(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let store_dir = s3.object_file("relist").unwrap();
    // The mount's root was listed before the folder was made: listed again now.
    granary_ok(&["fs", "sync", at, "--master", addr]).unwrap();
    assert_eq!(names(&dir.join("relist")), names(&store_dir));
    let inodes = |names: &[&str]| -> Vec<String> {
        names
            .iter()
            .map(|n| {
                sh(&format!(
                    "stat -c %i '{}'",
                    dir.join("relist").join(n).display()
                ))
                .unwrap()
            })
            .collect()
    };
    let kept = ["a-b", "a.txt", "b07", "b19", "c"];
    let before = inodes(&kept);
    // The store changes: a file becomes a folder of the same name (twice), files go and come.
    for k in ["a", "x"] {
        std::fs::remove_file(object(k)).unwrap();
        write(&format!("{k}/inside.bin"));
    }
    for i in 0..5 {
        std::fs::remove_file(object(&format!("gone-{i}"))).unwrap();
    }
    for i in 0..10 {
        write(&format!("n{i}"));
    }
    granary_ok(&["fs", "sync", &format!("{at}/relist"), "--master", addr]).unwrap();
    let want = names(&store_dir);
    poll(
        "the mount to show the folder as listed again",
        Duration::from_secs(30),
        || (names(&dir.join("relist")) == want).then_some(()),
    )
    .unwrap_or_else(|e| panic!("{e:#}: {:?} against {want:?}", names(&dir.join("relist"))));
    assert_eq!(inodes(&kept), before, "unchanged entries were made again");
    for k in ["a/inside.bin", "x/inside.bin", "n9"] {
        assert_eq!(
            sha_of(&dir.join("relist").join(k)),
            sha_of(&object(k)),
            "{k}"
        );
    }
    // Known now: the folder `a`, which a listing passes after `a-b` and `a.txt`; changes
    // on both sides of it keep it.
    let kept = ["a", "a.txt", "b07", "x"];
    let before = inodes(&kept);
    // Seven keys before `a/` (a page's worth): the first page ends at `a.txt`.
    std::fs::remove_file(object("a-b")).unwrap();
    for k in ["a-0", "a-1", "a-2", "a-3", "a-4", "a-5", "a~"] {
        write(k);
    }
    granary_ok(&["fs", "sync", &format!("{at}/relist"), "--master", addr]).unwrap();
    let want = names(&store_dir);
    poll("the second change to show", Duration::from_secs(30), || {
        (names(&dir.join("relist")) == want).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e:#}: {:?} against {want:?}", names(&dir.join("relist"))));
    assert_eq!(inodes(&kept), before, "unchanged entries were made again");
    // Gone from the store: gone from the namespace at the next listing.
    std::fs::remove_dir_all(&store_dir).unwrap();
    granary_ok(&["fs", "sync", at, "--master", addr]).unwrap();
    poll("the folder to go", Duration::from_secs(30), || {
        (!dir.join("relist").exists()).then_some(())
    })
    .unwrap();
}

/// Reads a folder with `os.scandir`: "first NAME" once the first entry came, then, after a
/// line on its input, "all COUNT".
const SCAN: &str = r#"
import os, sys
it = os.scandir(sys.argv[1])
first = next(it).name
print("first", first, flush=True)
sys.stdin.readline()
print("all", 1 + sum(1 for _ in it), flush=True)
"#;

/// A folder never listed streams to its reader: with the store's listing held at its 13th
/// request (100 keys each), `os.scandir` through the mount gets its first entries, and
/// the whole folder once the store answers again.
fn a_first_listing_streams(root: &Path, s3: &TestStore, fs_root: &Path, addr: &str) {
    use std::io::{BufRead, Write};
    let n = 3000;
    for i in 0..n {
        random_file(&s3.object_file(&format!("stream/f{i:07}")).unwrap(), 0).unwrap();
    }
    let proxy = FaultProxy::start(root, &s3.url(), 1_000_000).unwrap();
    let mut opts = s3.options_through(&proxy.url());
    opts.push("list_page_keys=100".into());
    granary_ok(&mount_args("/streamed", &s3.uri(), &opts, addr)).unwrap();
    let top = fs_root.join("streamed");
    assert!(top.join("stream").is_dir());
    let lists = |c: &serde_json::Value| c["lists"].as_u64().unwrap();
    let before = lists(&proxy.counts().unwrap());
    // 12 pages (1,200 names) may come, the whole folder takes 30.
    proxy.hold_lists_after(12).unwrap();
    let mut scan = std::process::Command::new("python3")
        .args(["-c", SCAN])
        .arg(top.join("stream"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let out = scan.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(60));
    // The listing goes on to the held request, and no further.
    let held = poll(
        "the listing to reach the held request",
        Duration::from_secs(60),
        || {
            let c = proxy.counts().unwrap();
            (c["waiting"].as_u64() == Some(1)).then_some(c)
        },
    );
    proxy.release().unwrap();
    let first = first.expect("no entry came while the listing was held");
    assert_eq!(first, "first f0000000");
    let held = held.unwrap();
    assert_eq!(lists(&held) - before, 13, "{held}");
    writeln!(scan.stdin.as_mut().unwrap()).unwrap();
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(120)).unwrap(),
        format!("all {n}")
    );
    assert!(scan.wait().unwrap().success());
    let mut names: Vec<String> = std::fs::read_dir(top.join("stream"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        (0..n).map(|i| format!("f{i:07}")).collect::<Vec<_>>()
    );
    granary_ok(&["mount", "remove", "/streamed", "--master", addr]).unwrap();
    std::fs::remove_dir_all(s3.object_file("stream").unwrap()).unwrap();
    granary_ok(&["fs", "sync", "/stores/s3", "--master", addr]).unwrap();
}

fn mount_args<'a>(
    path: &'a str,
    uri: &'a str,
    options: &'a [String],
    master: &'a str,
) -> Vec<&'a str> {
    let mut a = vec!["mount", "add", path, uri];
    for o in options {
        a.push("--option");
        a.push(o);
    }
    a.extend(["--master", master]);
    a
}

#[test]
fn every_kind_of_under_store_reads_correctly_through_one_namespace() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-ufs-")
        .tempdir()
        .unwrap();
    // GRANARY_KEEP_TEST_DIR=1 keeps the servers' and processes' files for a post-mortem.
    let (_tmp, root) = if std::env::var_os("GRANARY_KEEP_TEST_DIR").is_some() {
        let p = tmp.keep();
        eprintln!("test dir kept: {}", p.display());
        (None, p)
    } else {
        let p = tmp.path().to_path_buf();
        (Some(tmp), p)
    };
    let root = root.as_path();
    let src = conformance_tree(root);
    let expected = tree_sums(&src).unwrap();

    let mut s3 = TestStore::s3(root, "bucket-one", S3_ACCESS, S3_SECRET).unwrap();
    let gcs = TestStore::gcs(root, "gcs-bucket").unwrap();
    let az = TestStore::azure(root, "container").unwrap();
    for s in [&s3, &gcs, &az] {
        s.load(&src)
            .unwrap_or_else(|e| panic!("loading {:?}: {e:#}", s.kind));
    }
    // Granary processes started from here inherit it (see the module comment).
    let (k, v) = az.env().unwrap();
    std::env::set_var(k, v);

    let master = Master::start(root).unwrap();
    let addr = master.addr.clone();
    let w = Worker::start(root, "w1", &addr, "512MiB").unwrap();
    wait_live_workers(&addr, 1).unwrap();
    let local = src.to_string_lossy().to_string();
    let mounts: Vec<(&str, String, Vec<String>)> = vec![
        // Listed 7 entries per request: every folder of the tree takes pages (folders
        // on several of them), joined into one listing.
        (
            "/stores/s3",
            s3.uri(),
            with_opts(&s3, &["list_page_keys=7"]),
        ),
        (
            "/stores/gcs",
            gcs.uri(),
            with_opts(&gcs, &["list_page_keys=7"]),
        ),
        (
            "/stores/azure",
            az.uri(),
            with_opts(&az, &["list_page_keys=7"]),
        ),
        ("/stores/local", local.clone(), vec![]),
    ];
    for (path, uri, opts) in &mounts {
        granary_ok(&mount_args(path, uri, opts, &addr))
            .unwrap_or_else(|e| panic!("mount {path} {uri}: {e:#}"));
    }
    let fuse = Fuse::start(root, &addr).unwrap();
    let mnt = fuse.mountpoint.join("stores");
    assert_eq!(
        sh(&format!("ls '{}'", mnt.display())).unwrap(),
        "azure\ngcs\nlocal\ns3\n"
    );

    // An object replaced (same size, new bytes) after its listing was loaded but before it
    // was read: the listing's fingerprint no longer matches, so the read fails (ESTALE)
    // rather than serve bytes under a fingerprint they do not belong to. (Test servers that
    // ignore If-Match are caught by the ETag check on the response.)
    let other = root.join("changed.bin");
    random_file(&other, 64 * 1024).unwrap();
    let old = sha_of(&src.join("changing.bin")).unwrap();
    let new = sha_of(&other).unwrap();
    let mut outcomes = BTreeMap::new();
    for (kind, store) in [("s3", &s3), ("gcs", &gcs), ("azure", &az)] {
        sh(&format!("ls -l '{}'", mnt.join(kind).display())).unwrap();
        store.put("changing.bin", &other).unwrap();
        let outcome = match sha_of(&mnt.join(kind).join("changing.bin")) {
            None => "error",
            Some(g) if g == old => "old",
            Some(g) if g == new => "new",
            Some(_) => "mixed",
        };
        outcomes.insert(kind, outcome);
    }
    eprintln!("changed-object outcomes: {outcomes:?}");
    assert!(
        outcomes.values().all(|o| *o == "error"),
        "a changed object was served: {outcomes:?}"
    );
    let expected_rest: BTreeMap<String, String> = expected
        .iter()
        .filter(|(k, _)| !k.ends_with("/changing.bin"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();

    // Every file of every kind, byte for byte; listings (names, sizes) equal the source.
    for kind in ["s3", "gcs", "azure", "local"] {
        let dir = mnt.join(kind);
        let sums = tree_sums_except(&dir, "changing.bin").unwrap_or_else(|e| {
            panic!(
                "{kind}: {e:#}\nwarnings of the processes:\n{}",
                warnings_in_logs(root, &["w1", "fuse", "master"])
            )
        });
        assert_eq!(sums, expected_rest, "{kind}: bytes differ");
        // Names and sizes (the replaced object kept its size).
        assert_eq!(
            tree_stats(&dir).unwrap(),
            tree_stats(&src).unwrap(),
            "{kind}: listing differs"
        );
        // Ranged reads inside a page, across a page boundary and at the end.
        for (off, len) in [(5, 100), (MIB - 10, 20), (5 * MIB, 11)] {
            assert_eq!(
                range_sha(&dir.join("big.bin"), off, len),
                range_sha(&src.join("big.bin"), off, len),
                "{kind}: range {off}+{len}"
            );
        }
    }
    a_relisting_merges_page_by_page(&s3, &mnt.join("s3"), "/stores/s3", &addr);
    a_first_listing_streams(root, &s3, &fuse.mountpoint, &addr);
    // Listed 7 entries per request, the object stores' folders took more requests than
    // listings; a folder store lists in one. fake-gcs-server ignores the page size (it
    // answers every listing whole, with no next page), so GCS is held to no fewer.
    let scraped = scrape(&master.metrics).unwrap();
    for kind in ["s3", "gcs", "azure", "local"] {
        let of = |name: &str| {
            let labels = format!("{{mount=\"/stores/{kind}\"}}");
            metric(&scraped, &format!("granary_master_{name}_total{labels}")).unwrap_or(0.0)
        };
        let (listings, requests) = (of("ufs_listings"), of("ufs_list_requests"));
        let paged = match kind {
            "local" => requests == listings,
            "gcs" => requests >= listings,
            _ => requests > listings,
        };
        assert!(
            listings > 0.0 && paged,
            "{kind}: {listings} listings took {requests} requests"
        );
    }
    // Per-mount under-store metrics: every mount's reads are counted and timed.
    let mounts_json: serde_json::Value =
        serde_json::from_str(&granary_ok(&["mount", "list", "--json", "--master", &addr]).unwrap())
            .unwrap();
    let scraped = scrape(&w.metrics).unwrap();
    for m in mounts_json.as_array().unwrap() {
        let id = m["id"].as_u64().unwrap();
        let labels = format!("{{mount_id=\"{id}\",op=\"get\"}}");
        let bytes = metric(
            &scraped,
            &format!("granary_worker_ufs_op_bytes_total{labels}"),
        );
        assert!(
            bytes.unwrap_or(0.0) > 0.0,
            "no bytes counted for mount {m}:\n{scraped}"
        );
        let timed = metric(
            &scraped,
            &format!("granary_worker_ufs_op_seconds_count{labels}"),
        );
        assert!(
            timed.unwrap_or(0.0) > 0.0,
            "no latency recorded for mount {m}"
        );
    }

    // Cold sequential reads ran ahead (big.bin spans six pages).
    assert!(w.metric("granary_worker_prefetched_pages_total") > 0.0);

    // Second pass from the cache: still exact, no new under-store bytes.
    let ufs_before = w.metric("granary_worker_ufs_read_bytes_total");
    for kind in ["s3", "gcs", "azure"] {
        assert_eq!(
            tree_sums_except(&mnt.join(kind), "changing.bin").unwrap(),
            expected_rest,
            "{kind} (cached)"
        );
    }
    assert_eq!(w.metric("granary_worker_ufs_read_bytes_total"), ufs_before);

    // A throttling store: every third object request is refused with 503 SlowDown or 429.
    // Requests are retried with backoff and every byte still arrives right; no read fails.
    let proxy = FaultProxy::start(root, &s3.url(), 3).unwrap();
    let throttled_opts = s3.options_through(&proxy.url());
    granary_ok(&mount_args("/throttled", &s3.uri(), &throttled_opts, &addr)).unwrap();
    let errors_before = w.metric("granary_worker_ufs_errors_total");
    assert_eq!(
        tree_sums_except(&fuse.mountpoint.join("throttled"), "changing.bin").unwrap(),
        expected_rest,
        "bytes differ through a throttling store"
    );
    let injected = proxy.injected().unwrap();
    assert!(injected >= 3, "the proxy refused only {injected} requests");
    assert_eq!(
        w.metric("granary_worker_ufs_errors_total"),
        errors_before,
        "a throttled request surfaced as an error instead of being retried"
    );
    granary_ok(&["mount", "remove", "/throttled", "--master", &addr]).unwrap();
    drop(proxy);

    // Credentials never show: mount list, report, and every process log.
    let list = granary_ok(&["mount", "list", "--master", &addr]).unwrap();
    assert!(list.contains("secret_access_key=***"), "{list}");
    let report = granary_ok(&["report", "--json", "--master", &addr]).unwrap();
    let json_list = granary_ok(&["mount", "list", "--json", "--master", &addr]).unwrap();
    for (what, text) in [
        ("mount list", list.clone()),
        ("mount list --json", json_list),
        ("report", report),
        ("master log", master.proc.log_text()),
        ("worker log", w.proc.log_text()),
        ("fuse log", fuse.proc.log_text()),
    ] {
        assert!(!text.contains(S3_SECRET), "{what} shows the S3 secret");
    }

    // Bad input: one sentence each, nothing added.
    let bad_creds: Vec<String> = s3
        .options
        .iter()
        .map(|o| {
            if o.starts_with("secret_access_key=") {
                "secret_access_key=wrong-secret".to_string()
            } else {
                o.clone()
            }
        })
        .collect();
    let cases: Vec<(&str, String, Vec<String>, &str)> = vec![
        (
            "unknown scheme",
            "ftp://host/data".into(),
            vec![],
            "unsupported scheme",
        ),
        (
            "malformed URI",
            "s3://bad bucket/x".into(),
            vec![],
            "invalid under-store URI",
        ),
        (
            "missing bucket",
            "s3://no-such-bucket".into(),
            s3.options.clone(),
            "does not exist",
        ),
        (
            "wrong credentials",
            s3.uri(),
            bad_creds,
            "credentials were refused",
        ),
        (
            "unknown option",
            s3.uri(),
            vec!["secret_acess_key=x".into()],
            "invalid mount option",
        ),
    ];
    for (what, uri, opts, says) in &cases {
        let out = granary(&mount_args("/stores/bad", uri, opts, &addr));
        assert_one_sentence_error(&out, what);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{what}: {err}");
        assert!(!err.contains("wrong-secret"), "{what}: {err}");
        eprintln!("{what}: {}", err.trim_end());
    }
    assert_eq!(
        granary_ok(&["mount", "list", "--master", &addr]).unwrap(),
        list
    );

    // A known deep path is found without listing the directories above it: HEADs and
    // one-page prefixed lookups only; `ls` lists when asked.
    granary_ok(&mount_args(
        "/probed",
        &s3.uri(),
        &with_opts(&s3, &["sync_interval=never"]),
        &addr,
    ))
    .unwrap();
    let listings = |m: &str| {
        metric(
            &scrape(&master.metrics).unwrap(),
            &format!("granary_master_ufs_listings_total{{mount=\"{m}\"}}"),
        )
        .unwrap_or(0.0)
    };
    let deep = "deep/1/2/3/4/5/6/7/leaf.txt";
    assert_eq!(
        sha_of(&fuse.mountpoint.join("probed").join(deep)),
        sha_of(&src.join(deep))
    );
    let st = granary_ok(&["fs", "stat", &format!("/probed/{deep}"), "--master", &addr]).unwrap();
    assert!(st.contains("size:        77"), "{st}");
    assert_eq!(listings("/probed"), 0.0, "a lookup listed a directory");
    let heads = || {
        metric(
            &scrape(&master.metrics).unwrap(),
            "granary_master_ufs_heads_total{mount=\"/probed\"}",
        )
        .unwrap_or(0.0)
    };
    let missing = ["fs", "stat", "/probed/deep/nope", "--master", &addr];
    assert_eq!(granary(&missing).status.code(), Some(1));
    let after_first_miss = heads();
    assert_eq!(granary(&missing).status.code(), Some(1));
    assert_eq!(
        heads(),
        after_first_miss,
        "a repeated miss asked the store again"
    );
    assert_eq!(
        sh(&format!(
            "ls '{}'",
            fuse.mountpoint.join("probed/deep").display()
        ))
        .unwrap(),
        "1\n"
    );
    assert_eq!(listings("/probed"), 1.0);

    // Metadata sync: a mount re-listed every second sees a replaced object, and the old
    // version's cached pages are dropped from the worker.
    let with = |extra: &[&str]| -> Vec<String> {
        s3.options
            .iter()
            .cloned()
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    granary_ok(&mount_args(
        "/synced",
        &s3.uri(),
        &with(&["sync_interval=1s"]),
        &addr,
    ))
    .unwrap();
    let synced = fuse.mountpoint.join("synced");
    let target = synced.join("plain/b.bin");
    assert_eq!(sha_of(&target), sha_of(&src.join("plain/b.bin")));
    let fresh = root.join("fresh-b.bin");
    random_file(&fresh, 4096).unwrap();
    let fresh_sha = sha_of(&fresh).unwrap();
    s3.put("plain/b.bin", &fresh).unwrap();
    if let Err(e) = poll(
        "the re-listed mount to serve the new bytes",
        Duration::from_secs(30),
        || (sha_of(&target).as_deref() == Some(fresh_sha.as_str())).then_some(()),
    ) {
        let st = granary(&["fs", "stat", "/synced/plain/b.bin", "--master", &addr]);
        let m = scrape(&master.metrics).unwrap_or_default();
        let m: Vec<&str> = m.lines().filter(|l| l.contains("synced")).collect();
        panic!(
            "{e:#}\nstat: {}{}\nmaster metrics: {m:#?}\nmount log:\n{}",
            String::from_utf8_lossy(&st.stdout),
            String::from_utf8_lossy(&st.stderr),
            fuse.proc.log_text()
        );
    }
    poll(
        "the old version's pages to be dropped",
        Duration::from_secs(15),
        || (w.metric("granary_worker_stale_dropped_bytes_total") >= 4096.0).then_some(()),
    )
    .unwrap();

    // validate_on_open: the next open after a change reads the new bytes, without waiting.
    granary_ok(&mount_args(
        "/validated",
        &s3.uri(),
        &with(&["validate_on_open=true", "sync_interval=never"]),
        &addr,
    ))
    .unwrap();
    let vt = fuse.mountpoint.join("validated/plain/a.bin");
    assert_eq!(sha_of(&vt), sha_of(&src.join("plain/a.bin")));
    let fresh_a = root.join("fresh-a.bin");
    random_file(&fresh_a, MIB + 3).unwrap();
    s3.put("plain/a.bin", &fresh_a).unwrap();
    assert_eq!(
        sha_of(&vt),
        sha_of(&fresh_a),
        "validate-on-open served the old bytes"
    );

    // A failing under-store: listings fail, the failure shows in `fs sync`, `fs stat` and
    // metrics, known entries stay listed and cached bytes readable; once the store is back
    // the master's own retry heals it.
    let known = sh(&format!("ls '{}'", synced.join("plain").display())).unwrap();
    assert_eq!(known, "a.bin\nb.bin\n");
    s3.stop().unwrap();
    let out = granary(&["fs", "sync", "/synced", "--master", &addr]);
    assert_one_sentence_error(&out, "fs sync with the store down");
    let stat = || -> serde_json::Value {
        serde_json::from_str(
            &granary_ok(&["fs", "stat", "/synced", "--json", "--master", &addr]).unwrap(),
        )
        .unwrap()
    };
    let st = stat();
    assert!(st["sync"]["failures"].as_u64().unwrap() >= 1, "{st}");
    assert!(
        st["sync"]["error"].as_str().unwrap().contains("failed"),
        "{st}"
    );
    assert!(
        metric_at(
            &master.metrics,
            "granary_master_ufs_listing_failures_total{mount=\"/synced\"}"
        ) >= 1.0
    );
    assert!(metric_at(&master.metrics, "granary_master_dirs_sync_failing") >= 1.0);
    std::thread::sleep(Duration::from_millis(1100)); // let the 1 s sync interval pass
    assert_eq!(
        sh(&format!("ls '{}'", synced.join("plain").display())).unwrap(),
        "a.bin\nb.bin\n",
        "a failed listing emptied a directory"
    );
    assert_eq!(sha_of(&target).as_deref(), Some(fresh_sha.as_str()));
    s3.restart().unwrap();
    poll(
        "the failed listing to be retried and succeed",
        Duration::from_secs(60),
        || (stat()["sync"]["failures"].as_u64() == Some(0)).then_some(()),
    )
    .unwrap();
    granary_ok(&["fs", "sync", "-R", "/synced", "--master", &addr]).unwrap();
    poll(
        "every failing directory to be retried and counted healed",
        Duration::from_secs(60),
        || (metric_at(&master.metrics, "granary_master_dirs_sync_failing") == 0.0).then_some(()),
    )
    .unwrap();

    // The store starts refusing our credentials: a lookup of a new name is EACCES (not a
    // generic I/O error), and the cause is in the master's log.
    s3.stop().unwrap();
    s3.restart_with_secret("rotated-secret-1234").unwrap();
    let out = sh(&format!(
        "cat '{}' 2>&1 || true",
        fuse.mountpoint.join("probed/many/f19.bin").display()
    ))
    .unwrap();
    assert!(out.contains("Permission denied"), "{out}");
    drop(fuse);
}
