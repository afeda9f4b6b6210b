//! Under-stores stay confined (issue 26, points 3, 5 and 6), on real processes:
//!
//! - GCS and Azure keys given to `mount add` never appear in `mount list`, `report`,
//!   errors, the processes' logs or any file of three masters' data folders (Raft log,
//!   state, snapshots), and only admins see a mount's store options at all;
//! - a symbolic link in a `file://` folder that leaves it is not listed, not read (ENOENT or
//!   EACCES through FUSE; its target's bytes are never served or cached), not followed by a
//!   recursive delete; `symlinks=inside` follows links that stay inside;
//! - masters accept `file://` mounts only below `--allow-local-root` folders, and store
//!   addresses only from `--allow-endpoint` when it is given.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use granary_tests::stores::TestStore;
use granary_tests::*;
use sha2::{Digest, Sha256};

/// Azurite's account key (public, well known): the Azure "secret" of the test. It must
/// not appear in clear anywhere either.
const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn gcs_and_azure_keys_never_appear_in_outputs_logs_or_the_masters_files() {
    let tmp = workdir("granary-confine-keys-");
    let root = tmp.path();
    let src = root.join("src");
    random_file(&src.join("d/a.bin"), 300_000).unwrap();
    let want = Sha256::digest(std::fs::read(src.join("d/a.bin")).unwrap());
    let tag = format!("{:016x}", rand::random::<u64>());
    let gcs_secret = format!("GcsKey{tag}Secret");
    // A public option with a unique value: found in clear, it shows the scans see text.
    let canary = format!("agent-{tag}-public");

    let gcs = TestStore::gcs(root, "confine-gcs").unwrap();
    let az = TestStore::azure(root, "confine-az").unwrap();
    gcs.load(&src).unwrap();
    az.load(&src).unwrap();
    // The GCS key is the service account's JSON itself (here one for the emulator).
    let key_file = root.join("gcs-key.json");
    std::fs::write(
        &key_file,
        format!(
            r#"{{"gcs_base_url": "{}", "disable_oauth": true, "client_email": "", "private_key": "", "private_key_id": "{gcs_secret}"}}"#,
            gcs.url()
        ),
    )
    .unwrap();
    let az_key_file = root.join("azure-key");
    std::fs::write(&az_key_file, AZURITE_KEY).unwrap();

    // Three masters snapshotting often: the mounts are in logs, state and snapshot files.
    let group = MasterGroup::start(root, 3, 5).unwrap();
    group.wait_leader(Duration::from_secs(30)).unwrap();
    let masters = group.addrs();
    let w = Worker::start(root, "w1", &masters, "64MiB").unwrap();
    wait_live_workers(&masters, 1).unwrap();
    let sa_opt = format!("service_account_key={}", key_file.display());
    let ua_opt = format!("user_agent={canary}");
    granary_ok(&[
        "mount",
        "add",
        "/gcs",
        &gcs.uri(),
        "--option-file",
        &sa_opt,
        "--option",
        "allow_http=true",
        "--option",
        &ua_opt,
        "--master",
        &masters,
    ])
    .unwrap();
    let az_opt = format!("account_key={}", az_key_file.display());
    let endpoint = format!("endpoint={}/devstoreaccount1", az.url());
    granary_ok(&[
        "mount",
        "add",
        "/az",
        &az.uri(),
        "--option",
        "account_name=devstoreaccount1",
        "--option-file",
        &az_opt,
        "--option",
        &endpoint,
        "--option",
        "allow_http=true",
        "--master",
        &masters,
    ])
    .unwrap();
    // Both stores serve through Granary: the keys reached them (via the worker).
    for f in ["/gcs/d/a.bin", "/az/d/a.bin"] {
        let out = granary(&["fs", "cat", f, "--master", &masters]);
        assert!(
            out.status.success(),
            "cat {f}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(Sha256::digest(&out.stdout), want, "{f}");
    }
    // Entries enough for snapshots and log compaction.
    for i in 0..12 {
        granary_ok(&[
            "fs",
            "mkdir",
            "-p",
            &format!("/plain/dir{i}"),
            "--master",
            &masters,
        ])
        .unwrap();
    }
    group.wait_caught_up(Duration::from_secs(30)).unwrap();

    let mut outputs = Vec::new();
    for args in [
        vec!["mount", "list"],
        vec!["mount", "list", "--json"],
        vec!["report"],
        vec!["report", "--json"],
        vec!["fs", "ls", "-l", "-R", "/gcs"],
        vec!["fs", "ls", "-l", "-R", "/az"],
        vec!["fs", "stat", "/az/d/a.bin"],
        vec!["fs", "cat", "/gcs/d/missing.bin"],
        vec!["master", "list"],
    ] {
        let mut a = args.clone();
        a.extend(["--master", &masters]);
        let out = granary(&a);
        outputs.push(String::from_utf8_lossy(&out.stdout).to_string());
        outputs.push(String::from_utf8_lossy(&out.stderr).to_string());
    }
    outputs.push(scrape(&w.metrics).unwrap());
    // An admin sees the options, credentials as ***.
    let listing: serde_json::Value = serde_json::from_str(&outputs[2]).unwrap();
    let opts_of = |l: &serde_json::Value, p: &str| {
        l.as_array()
            .unwrap()
            .iter()
            .find(|m| m["path"] == p)
            .unwrap_or_else(|| panic!("{p} not listed: {l}"))["options"]
            .clone()
    };
    assert_eq!(opts_of(&listing, "/gcs")["service_account_key"], "***");
    assert_eq!(opts_of(&listing, "/gcs")["user_agent"], canary.as_str());
    assert_eq!(opts_of(&listing, "/az")["account_key"], "***");
    assert_eq!(opts_of(&listing, "/az")["account_name"], "devstoreaccount1");
    // Anyone else sees paths and URIs, no store option at all.
    if !insecure_suite() {
        let user = TestTls::get().identity("user");
        let out = granary_ok(&[
            "mount",
            "list",
            "--json",
            "--tls-dir",
            &user.to_string_lossy(),
            "--master",
            &masters,
        ])
        .unwrap();
        let l: serde_json::Value = serde_json::from_str(&out).unwrap();
        for p in ["/gcs", "/az"] {
            assert_eq!(
                opts_of(&l, p),
                serde_json::json!({}),
                "a user sees options of {p}: {out}"
            );
        }
        outputs.push(out);
    }
    for (i, o) in outputs.iter().enumerate() {
        for s in [gcs_secret.as_str(), AZURITE_KEY] {
            assert!(!o.contains(s), "output {i} shows a key: {o}");
        }
    }
    // Every log of Granary's processes (the emulators' own logs are not ours).
    let mut logs = 0;
    for e in std::fs::read_dir(root).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.ends_with(".log") && !name.starts_with("fake-gcs") && !name.starts_with("azurite") {
            let text = std::fs::read(e.path()).unwrap();
            for s in [gcs_secret.as_str(), AZURITE_KEY] {
                assert!(!contains(&text, s.as_bytes()), "{name} shows a key");
            }
            logs += 1;
        }
    }
    assert!(logs >= 4, "{logs} logs scanned");
    // The masters' RocksDB files (Raft log, state) and snapshots: no key in clear, while
    // the public option next to them is found — the scan sees clear text.
    for id in 1..=3u64 {
        let dir = group.member(id).data_dir.clone();
        assert!(
            !files_containing(&dir, canary.as_bytes()).is_empty(),
            "the scan of {} found no clear option at all",
            dir.display()
        );
        assert!(
            std::fs::read_dir(dir.join("snapshots"))
                .map(|d| d.count())
                .unwrap_or(0)
                > 0,
            "master {id} took no snapshot"
        );
        for s in [gcs_secret.as_str(), AZURITE_KEY] {
            let hits = files_containing(&dir, s.as_bytes());
            assert!(hits.is_empty(), "a key in clear in {hits:?}");
        }
    }
}

#[test]
fn a_symlink_leaving_a_file_mount_is_never_listed_read_or_followed() {
    let tmp = workdir("granary-confine-links-");
    let root = tmp.path();
    let tag = format!("{:016x}", rand::random::<u64>());
    // What a worker running as root could read: a node's key, outside the mounted folder.
    let outside = root.join("etc-granary-tls");
    std::fs::create_dir_all(&outside).unwrap();
    let secret = format!("-----BEGIN PRIVATE KEY----- {tag} -----END PRIVATE KEY-----\n");
    std::fs::write(outside.join("tls.key"), &secret).unwrap();
    let ufs = root.join("ufs");
    std::fs::create_dir_all(ufs.join("sub")).unwrap();
    std::fs::create_dir_all(ufs.join("trash/real")).unwrap();
    random_file(&ufs.join("plain.bin"), 100_000).unwrap();
    let plain = std::fs::read(ufs.join("plain.bin")).unwrap();
    std::fs::write(ufs.join("sub/x.txt"), b"inside").unwrap();
    std::fs::write(ufs.join("swapped.bin"), vec![7u8; secret.len()]).unwrap();
    std::fs::write(ufs.join("trash/f.txt"), b"to delete").unwrap();
    symlink(outside.join("tls.key"), ufs.join("key-link")).unwrap();
    symlink(&outside, ufs.join("dir-link")).unwrap();
    symlink("plain.bin", ufs.join("in-link")).unwrap();
    symlink(&outside, ufs.join("trash/linked-dir")).unwrap();

    let master = Master::start(root).unwrap();
    let w = Worker::start(root, "w1", &master.addr, "256MiB").unwrap();
    wait_live_workers(&master.addr, 1).unwrap();
    mount_local("/data", &ufs, &master.addr).unwrap();
    granary_ok(&[
        "mount",
        "add",
        "/inside",
        &ufs.to_string_lossy(),
        "--option",
        "symlinks=inside",
        "--master",
        &master.addr,
    ])
    .unwrap();
    let fuse = Fuse::start(root, &master.addr).unwrap();
    let data = fuse.mountpoint.join("data");
    let inside = fuse.mountpoint.join("inside");
    let names = |dir: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        v.sort();
        v
    };
    // Listings: no link by default; with symlinks=inside, the link that stays inside.
    assert_eq!(
        names(&data),
        ["plain.bin", "sub", "swapped.bin", "trash"],
        "links listed"
    );
    assert_eq!(
        names(&inside),
        ["in-link", "plain.bin", "sub", "swapped.bin", "trash"]
    );
    let refused = |p: &PathBuf| {
        let e = std::fs::read(p).expect_err(&format!("{} was read", p.display()));
        assert!(
            matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::EACCES)),
            "{}: {e}",
            p.display()
        );
    };
    for p in [
        data.join("key-link"),
        data.join("dir-link/tls.key"),
        data.join("in-link"),
        inside.join("key-link"),
        inside.join("dir-link/tls.key"),
    ] {
        refused(&p);
    }
    assert_eq!(std::fs::read(inside.join("in-link")).unwrap(), plain);
    assert_eq!(std::fs::read(data.join("plain.bin")).unwrap(), plain);
    // The CLI (straight gRPC through a worker) gets nothing either.
    for p in ["/data/key-link", "/inside/dir-link/tls.key"] {
        let out = granary(&["fs", "cat", p, "--master", &master.addr]);
        assert!(!out.status.success(), "cat {p} succeeded");
        assert!(!contains(&out.stdout, secret.as_bytes()));
        assert!(!contains(&out.stderr, secret.as_bytes()));
    }
    // A file listed as a plain file, then replaced by a link out of the folder: its read
    // fails; the link's target is not read.
    std::fs::remove_file(ufs.join("swapped.bin")).unwrap();
    symlink(outside.join("tls.key"), ufs.join("swapped.bin")).unwrap();
    match std::fs::read(data.join("swapped.bin")) {
        Ok(got) => panic!(
            "a replaced file read through a link ({} bytes; secret: {})",
            got.len(),
            contains(&got, secret.as_bytes())
        ),
        Err(e) => assert!(e.raw_os_error().is_some(), "{e}"),
    }
    // A recursive delete removes the link to a folder, not what it points to.
    granary_ok(&["fs", "rm", "-R", "/data/trash", "--master", &master.addr]).unwrap();
    assert!(!ufs.join("trash").exists(), "trash left");
    assert_eq!(
        std::fs::read(outside.join("tls.key")).unwrap(),
        secret.as_bytes(),
        "the delete went through the link"
    );
    // The worker never cached the key's bytes.
    let hits = files_containing(&w.cache_dir, tag.as_bytes());
    assert!(hits.is_empty(), "the key's bytes cached in {hits:?}");
}

/// A master started without `--allow-local-root` (the harness gives one to every other
/// master), its log in `root/<name>.log`; killed on drop.
struct BareMaster {
    child: Child,
    addr: String,
}

impl BareMaster {
    fn start(root: &Path, name: &str) -> BareMaster {
        let data = root.join(format!("{name}-data"));
        let listen = format!("127.0.0.1:{}", free_port());
        let d = data.to_string_lossy().to_string();
        let args = ["master", "--data-dir", &d, "--listen", &listen];
        let log = root.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(granary_bin());
        secure_command(&mut cmd, &args);
        cmd.env_remove("GRANARY_ALLOW_LOCAL_ROOTS");
        let child = cmd
            .args(args)
            .env("GRANARY_LOG", "info")
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        let mut m = BareMaster {
            child,
            addr: listen,
        };
        poll("the bare master to listen", Duration::from_secs(60), || {
            if let Ok(Some(st)) = m.child.try_wait() {
                panic!(
                    "{name} exited with {st}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("granary master listening on")
                .then_some(())
        })
        .unwrap();
        m
    }
}

impl Drop for BareMaster {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn masters_mount_local_folders_only_below_allowed_roots() {
    let tmp = workdir("granary-confine-roots-");
    let root = tmp.path();
    let allowed = root.join("allowed");
    std::fs::create_dir_all(allowed.join("data")).unwrap();
    std::fs::write(allowed.join("data/a.txt"), b"a").unwrap();
    let other = root.join("other");
    std::fs::create_dir_all(&other).unwrap();
    symlink(&other, allowed.join("escape")).unwrap();

    // A master allowing one folder: below it yes, elsewhere (also through a link) no.
    let a = allowed.to_string_lossy().to_string();
    let data_dir = root.join("m1-data").to_string_lossy().to_string();
    let listen = format!("127.0.0.1:{}", free_port());
    let mut m = Proc::spawn(
        "m1",
        root,
        &[
            "master",
            "--data-dir",
            &data_dir,
            "--listen",
            &listen,
            "--allow-local-root",
            &a,
            "--allow-endpoint",
            "s3.internal.example:9000",
        ],
    )
    .unwrap();
    m.wait_for_line("granary master listening on", Duration::from_secs(60))
        .unwrap();
    mount_local("/ok", &allowed.join("data"), &listen).unwrap();
    for (at, dir, says) in [
        (
            "/other",
            other.clone(),
            "not below a folder the masters allow",
        ),
        ("/escape", allowed.join("escape"), "resolves to"),
        (
            "/etc",
            PathBuf::from("/etc"),
            "not below a folder the masters allow",
        ),
    ] {
        let d = dir.to_string_lossy().to_string();
        let out = granary(&["mount", "add", at, &d, "--master", &listen]);
        assert_one_sentence_error(&out, &format!("mount add {at} {d}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--allow-local-root") && err.contains(says),
            "{at}: {err}"
        );
    }
    // Store addresses outside --allow-endpoint are refused before anything is contacted.
    for endpoint in [
        "endpoint=http://169.254.169.254",
        "endpoint=http://s3.internal.example:9001",
    ] {
        let out = granary(&[
            "mount",
            "add",
            "/s3",
            "s3://bucket",
            "--option",
            endpoint,
            "--option",
            "region=us-east-1",
            "--master",
            &listen,
        ]);
        assert_one_sentence_error(&out, &format!("mount add with {endpoint}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--allow-endpoint"), "{endpoint}: {err}");
    }
    let list = granary_ok(&["mount", "list", "--json", "--master", &listen]).unwrap();
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    let paths: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, ["/ok"]);

    // A master without the flag refuses every local folder, with the flag's name.
    let bare = BareMaster::start(root, "bare");
    let d = allowed.join("data").to_string_lossy().to_string();
    let uri = format!("file://{d}");
    let out = granary(&["mount", "add", "/x", &uri, "--master", &bare.addr]);
    assert_one_sentence_error(&out, "mount add on a master without --allow-local-root");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("allows no file:// mounts") && err.contains("--allow-local-root"),
        "{err}"
    );
    assert_eq!(
        granary_ok(&["mount", "list", "--master", &bare.addr])
            .unwrap()
            .trim(),
        ""
    );
}

/// A `file://` folder the master cannot read (here a FUSE mount inside the store folder
/// whose daemon died: ENOTCONN, as a network file system's stale handle answers EIO or
/// ESTALE) fails its listing: the master keeps what it knew of the folder instead of
/// taking it for empty and removing every file in it from the namespace.
#[test]
fn a_folder_the_store_cannot_read_keeps_what_the_master_knew() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-unreadable-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let (src, other) = (root.join("src"), root.join("other"));
    random_file(&other.join("a.bin"), 1000).unwrap();
    random_file(&other.join("b.bin"), 2000).unwrap();
    let inner_mp = src.join("nfs");
    std::fs::create_dir_all(&inner_mp).unwrap();
    let mut inner = Proc::spawn(
        "inner",
        root,
        &[
            "local",
            "--ufs",
            &other.to_string_lossy(),
            "--mount",
            &inner_mp.to_string_lossy(),
        ],
    )
    .unwrap();
    poll("the inner mount", Duration::from_secs(60), || {
        inner_mp.join("a.bin").exists().then_some(())
    })
    .unwrap();
    let master = Master::start(root).unwrap();
    mount_local("/data", &src, &master.addr).unwrap();
    let ls = || granary_ok(&["fs", "ls", "/data/nfs", "--master", &master.addr]).unwrap();
    let known = ls();
    assert!(
        known.contains("a.bin") && known.contains("b.bin"),
        "{known}"
    );

    inner.kill9().unwrap();
    let gone = std::fs::metadata(&inner_mp).unwrap_err();
    assert_eq!(gone.raw_os_error(), Some(libc::ENOTCONN), "{gone}");
    let out = granary(&["fs", "sync", "/data/nfs", "--master", &master.addr]);
    let _ = Command::new("umount").arg("-l").arg(&inner_mp).status();
    assert!(
        !out.status.success(),
        "a sync of an unreadable folder succeeded"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not connected"), "{err}");
    assert_eq!(ls(), known);
}
