//! The FUSE mount under trouble: a hung under-store must cost one operation an `EIO` at its
//! deadline, never a hung mount.

use std::time::{Duration, Instant};

use granary_tests::stores::TestStore;
use granary_tests::*;

const MIB: u64 = 1024 * 1024;

#[test]
fn a_hung_under_store_fails_uncached_reads_with_eio_and_the_mount_lives() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-hang-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    random_file(&src.join("d/cached.bin"), 2 * MIB + 3).unwrap();
    random_file(&src.join("d/uncached.bin"), 2 * MIB + 7).unwrap();
    let s3 = TestStore::s3(root, "hang", "hang-access", "hang-secret-key-1").unwrap();
    s3.load(&src).unwrap();
    let master = Master::start(root).unwrap();
    let w = Worker::start(root, "w1", &master.addr, "1GiB").unwrap();
    wait_live_workers(&master.addr, 1).unwrap();
    let mut args = vec!["mount", "add", "/s3", "s3://hang"];
    for o in &s3.options {
        args.extend(["--option", o.as_str()]);
    }
    // Listings are not refreshed: `ls` must not depend on the store while it hangs.
    args.extend(["--option", "sync_interval=never", "--master", &master.addr]);
    granary_ok(&args).unwrap();
    let fuse = Fuse::start_opts(root, "mnt", &master.addr, &["--op-timeout", "3s"]).unwrap();
    let dir = fuse.mountpoint.join("s3/d");
    let sha = |p: &std::path::Path| sh(&format!("sha256sum < '{}'", p.display()));
    let want_cached = sha(&src.join("d/cached.bin")).unwrap();
    let want_uncached = sha(&src.join("d/uncached.bin")).unwrap();
    assert_eq!(sha(&dir.join("cached.bin")).unwrap(), want_cached);
    let listing = sh(&format!("ls '{}'", dir.display())).unwrap();

    // The store stops answering (its process is stopped, its socket still accepts).
    let resume = s3.pause().unwrap();

    let t = Instant::now();
    let out = std::process::Command::new("cat")
        .arg(dir.join("uncached.bin"))
        .output()
        .unwrap();
    let took = t.elapsed();
    assert!(
        !out.status.success(),
        "an uncached read succeeded with the store stopped"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Input/output error"), "cat said: {err}");
    assert!(
        took < Duration::from_secs(15),
        "EIO took {took:?} with a 3 s deadline"
    );
    assert!(fuse.metric("granary_client_op_timeouts_total{op=\"read\"}") >= 1.0);

    // The mount is alive: listings and cached data still work.
    assert!(is_mounted(&fuse.mountpoint));
    assert_eq!(sh(&format!("ls '{}'", dir.display())).unwrap(), listing);
    drop_page_cache(&dir.join("cached.bin")).unwrap();
    assert_eq!(sha(&dir.join("cached.bin")).unwrap(), want_cached);

    // The store comes back: the same read works again.
    drop(resume);
    poll(
        "the uncached read to work again",
        Duration::from_secs(90),
        || {
            sha(&dir.join("uncached.bin"))
                .ok()
                .filter(|s| *s == want_uncached)
        },
    )
    .unwrap();
    assert!(w.metric("granary_worker_cache_used_bytes") >= (4 * MIB) as f64);
}

#[test]
fn names_over_255_bytes_get_enametoolong_and_ioctls_get_enotty() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-names-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    let long = "n".repeat(255);
    random_file(&src.join(&long), 10).unwrap();
    let c = Cluster::start(root, 1, "64MiB", &src).unwrap();
    let errno_of = |name: &str| {
        sh(&format!(
            "python3 -c 'import os,sys\ntry:\n os.stat(sys.argv[1]); print(0)\nexcept OSError as e: print(e.errno)' '{}'",
            c.data().join(name).display()
        ))
        .unwrap()
        .trim()
        .to_string()
    };
    assert_eq!(errno_of(&long), "0", "a 255-byte name is fine");
    assert_eq!(errno_of(&"n".repeat(256)), "36", "ENAMETOOLONG");
    assert_eq!(errno_of("missing"), "2", "ENOENT");
    // Python's open() asks each file whether it is a terminal (an ioctl the kernel hands
    // to the daemon): a regular file's answer, quietly.
    let ioctl = sh(&format!(
        "python3 -c 'import fcntl,os,sys,termios\nf=open(sys.argv[1],\"rb\")\nprint(f.isatty())\ntry:\n fcntl.ioctl(f.fileno(), termios.TCGETS, bytes(64)); print(0)\nexcept OSError as e: print(e.errno)' '{}'",
        c.data().join(&long).display()
    ))
    .unwrap();
    assert_eq!(
        ioctl.split_whitespace().collect::<Vec<_>>(),
        ["False", "25"],
        "ENOTTY"
    );
    let log = c.fuse.proc.log_text();
    assert!(!log.contains("Not Implemented"), "{log}");
}

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

#[test]
fn sixty_four_files_read_at_once_stay_within_the_memory_budget() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-budget-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    for i in 0..64 {
        random_file(&src.join(format!("f{i:02}.bin")), 8 * MIB).unwrap();
    }
    let budget = 16 * MIB;
    // What the daemon holds besides read buffers: tokio and gRPC buffers, allocator slack
    // (one malloc arena per busy thread). Measured over the idle process for this load,
    // debug build, 16 request threads: 52-57 MiB alone, 68 MiB with another test running
    // beside it (2026-12-03; 28 MiB with 4 threads when this test was written). Without
    // the budget, 64 readers' read-ahead windows alone would take hundreds of MiB.
    let overhead = 64 * MIB;
    let c = Cluster::start_opts(root, 1, "2GiB", &src, &["--max-memory", "16MiB"]).unwrap();
    let dir = c.data();
    let pid = c.fuse.proc.pid();
    sh(&format!("ls '{}'", dir.display())).unwrap();
    let idle = rss(pid);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let peak = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut peak = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss(pid));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        });
        // 64 readers, each through its own open file, 1 MiB at a time.
        let readers: Vec<_> = (0..64)
            .map(|i| {
                let p = dir.join(format!("f{i:02}.bin"));
                let want = src.join(format!("f{i:02}.bin"));
                s.spawn(move || {
                    let got = std::fs::read(&p).unwrap();
                    assert!(
                        got == std::fs::read(&want).unwrap(),
                        "{} differs",
                        p.display()
                    );
                })
            })
            .collect();
        {
            // The sampler stops even when a reader fails (else the scope would wait on it).
            struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
            let _stop = Stop(&stop);
            for r in readers {
                r.join().unwrap();
            }
        }
        sampler.join().unwrap()
    });
    assert!(idle > 0 && peak >= idle);
    assert!(
        peak - idle <= budget + overhead,
        "the daemon grew by {} MiB reading 64 files (budget {} MiB + {} MiB overhead)",
        (peak - idle) / MIB,
        budget / MIB,
        overhead / MIB
    );
}

/// 20,000 files of 128 KiB plus a 96 MiB file and a fio-written file, built once per target
/// dir (2.6 GiB) and reused by later runs.
fn small_files() -> std::path::PathBuf {
    let base = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let dir = base.join("fuse-small-files-v1");
    let marker = base.join("fuse-small-files-v1.done");
    if marker.exists() {
        return dir;
    }
    let _ = std::fs::remove_dir_all(&dir);
    sh(&format!(
        "python3 -c 'import os,sys\nd=sys.argv[1]\nfor i in range(20000):\n p=os.path.join(d,\"s%02d\"%(i%40),\"f%05d.bin\"%i)\n os.makedirs(os.path.dirname(p),exist_ok=True)\n open(p,\"wb\").write(os.urandom(128*1024))' '{}'",
        dir.display()
    ))
    .unwrap();
    random_file(&dir.join("big/96mib.bin"), 96 * MIB).unwrap();
    // A file fio can verify later: every 1 MiB block carries its own checksum header.
    sh(&format!(
        "fio --name=make --filename='{}' --rw=write --bs=1M --size=64M --verify=crc32c --do_verify=0 --output=/dev/null",
        dir.join("fio/verify.bin").display()
    ))
    .unwrap();
    std::fs::write(&marker, "").unwrap();
    dir
}

/// The training-loader pattern (a DataLoader with num_workers=N): N processes each open,
/// read whole and close sample files in a new random order every epoch, in batches of 32;
/// prints the samples read, the distinct samples, and those whose SHA-256 differs.
const LOADER: &str = r#"
import hashlib, multiprocessing as mp, os, random, sys
root, want_file, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
want = dict(l.split() for l in open(want_file))
names = sorted(want)
random.Random(seed).shuffle(names)
def work(i, q):
    seen, bad = 0, []
    mine = names[i::n]
    for b in range(0, len(mine), 32):
        for rel in mine[b:b + 32]:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            seen += 1
            if hashlib.sha256(data).hexdigest() != want[rel]:
                bad.append(rel)
    q.put((seen, bad))
q = mp.Queue()
ps = [mp.Process(target=work, args=(i, q)) for i in range(n)]
for p in ps: p.start()
res = [q.get() for _ in ps]
for p in ps: p.join()
print(sum(r[0] for r in res), len(set(names)), " ".join(b for r in res for b in r[1]))
"#;

#[test]
fn ordinary_programs_read_twenty_thousand_small_files_correctly() {
    let src = small_files();
    let tmp = tempfile::Builder::new()
        .prefix("granary-programs-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let c = Cluster::start(root, 1, "4GiB", &src).unwrap();
    let mnt = c.data();

    // The loader pattern first: 4 shuffled loader processes over 3,000 samples, cold (from
    // the under-store) then warm twice (the worker's disk, the kernel's pages dropped),
    // every sample against the source's SHA-256 (the first 3,000 samples by name). The
    // second epoch opens each sample in passthrough under a lease and parks its backing
    // file; the third opens every sample from its parked backing file: the kernel reads the
    // block files itself, the daemon reads nothing and asks no one.
    let want = root.join("want.txt");
    sh(&format!(
        "cd '{}' && ls s*/*.bin | sort | head -3000 | xargs sha256sum | awk '{{print $2, $1}}' > '{}'",
        src.display(),
        want.display()
    ))
    .unwrap();
    let script = root.join("loader.py");
    std::fs::write(&script, LOADER).unwrap();
    let m = |name: &str| c.fuse.metric(name);
    let mut third = (0.0, 0.0, 0.0, 0.0);
    for epoch in 1..=3 {
        if epoch == 3 {
            third = (
                m("granary_client_parked_opens_total"),
                m("granary_client_fuse_requests_total{op=\"read\"}"),
                m("granary_client_short_circuit_leases_total"),
                m("granary_client_op_seconds_count{op=\"open\"}"),
            );
        }
        // The kernel forgets these samples: later epochs read the worker's disk.
        sh(&format!(
            "cd '{}' && cut -d' ' -f1 '{}' | xargs -I{{}} dd if={{}} iflag=nocache count=0 status=none",
            mnt.display(),
            want.display()
        ))
        .unwrap();
        let out = sh(&format!(
            "python3 '{}' '{}' '{}' 4 {epoch}",
            script.display(),
            mnt.display(),
            want.display()
        ))
        .unwrap();
        let mut it = out.split_whitespace();
        assert_eq!(
            it.next(),
            Some("3000"),
            "epoch {epoch}: samples read: {out}"
        );
        if epoch == 1 {
            // The cold epoch: the samples are the whole of six folders of 500, read at
            // random, so each folder was warmed ahead of the loaders once its misses earned
            // it — and still every sample came from the store exactly once.
            assert_eq!(m("granary_client_warm_folders_total"), 6.0, "folder warms");
            assert!(
                m("granary_client_warm_files_total") > 0.0,
                "no file was warmed ahead of the loaders"
            );
            // Warmed samples are leased, checked and kept a group at a time, so most cold
            // opens need no lease request of their own.
            let kept = m("granary_client_warm_kept_total");
            assert!(
                kept >= 300.0 && kept <= m("granary_client_warm_files_total"),
                "warmed samples kept for their opens: {kept}"
            );
            assert_eq!(
                c.workers[0].metric("granary_worker_ufs_read_bytes_total"),
                3000.0 * 128.0 * 1024.0,
                "store bytes of the cold epoch (3,000 samples of 128 KiB, each once)"
            );
        }
        assert_eq!(
            it.next(),
            Some("3000"),
            "epoch {epoch}: distinct samples: {out}"
        );
        assert_eq!(it.next(), None, "epoch {epoch}: samples that differ: {out}");
    }
    // 6,000 opens: `dd` (dropping the pages) and the loader each open every sample once.
    // A sample opened right after its folder neighbour in name order (by chance, about 1
    // in 500 here) is read as name-order readers are: through the daemon, under a lease.
    let parked_opens = m("granary_client_parked_opens_total") - third.0;
    assert!(
        parked_opens >= 5940.0,
        "third epoch: {parked_opens} of 6,000 opens from parked backing files ({} parked now)",
        m("granary_client_parked_backings")
    );
    let (reads, leases) = (
        m("granary_client_fuse_requests_total{op=\"read\"}") - third.1,
        m("granary_client_short_circuit_leases_total") - third.2,
    );
    assert!(
        reads <= 30.0 && leases <= 30.0,
        "third epoch: {reads} reads through the daemon, {leases} short-circuit leases ({} opens went to the runtime); {}",
        m("granary_client_op_seconds_count{op=\"open\"}") - third.3,
        log_tail(&root.join("fuse.log"), 30)
    );

    // Every handle the loaders and `dd` opened is gone once they closed it: the mount keeps
    // no entry of its own for a handle the kernel released (one entered after its release
    // stayed forever; a daemon that took the mount over then refused the file passthrough).
    poll(
        "the mount's open files to be released",
        Duration::from_secs(10),
        || (m("granary_client_fuse_open_files") == 0.0).then_some(()),
    )
    .unwrap_or_else(|e| panic!("{e:#}: {} open", m("granary_client_fuse_open_files")));

    // Python, 8 readers: open().read() of every small file, SHA-256 against the source.
    let digests = |d: &std::path::Path| {
        sh(&format!(
            "cd '{}' && python3 -c 'import hashlib,glob\nfrom concurrent.futures import ThreadPoolExecutor\nfs=sorted(glob.glob(\"s*/*.bin\"))\ndef h(p):\n return p+\" \"+hashlib.sha256(open(p,\"rb\").read()).hexdigest()\nwith ThreadPoolExecutor(8) as ex:\n print(\"\\n\".join(ex.map(h,fs)))'",
            d.display()
        ))
        .unwrap()
    };
    let want = digests(&src);
    assert_eq!(want.lines().count(), 20_000);
    assert!(digests(&mnt) == want, "python read different bytes");

    // tar and cp -r copy the tree out; it matches the source.
    let expected = tree_sums(&src).unwrap();
    let out = root.join("untarred");
    std::fs::create_dir_all(&out).unwrap();
    sh(&format!(
        "tar cf - -C '{}' . | tar xf - -C '{}'",
        mnt.display(),
        out.display()
    ))
    .unwrap();
    assert!(
        tree_sums(&out).unwrap() == expected,
        "tar copied different bytes"
    );
    std::fs::remove_dir_all(&out).unwrap();
    let copied = root.join("copied");
    sh(&format!("cp -r '{}' '{}'", mnt.display(), copied.display())).unwrap();
    assert!(
        tree_sums(&copied).unwrap() == expected,
        "cp -r copied different bytes"
    );
    std::fs::remove_dir_all(&copied).unwrap();

    // dd with 1 MiB blocks.
    let big = "big/96mib.bin";
    assert_eq!(
        sh(&format!(
            "dd if='{}' bs=1M status=none | sha256sum",
            mnt.join(big).display()
        ))
        .unwrap(),
        sh(&format!("sha256sum < '{}'", src.join(big).display())).unwrap()
    );

    // fio checks every block of the file it wrote, read back through the mount.
    drop_page_cache(&mnt.join("fio")).unwrap();
    sh(&format!(
        "fio --name=check --filename='{}' --rw=read --bs=1M --size=64M --verify=crc32c --verify_only --verify_fatal=1 --output=/dev/null",
        mnt.join("fio/verify.bin").display()
    ))
    .unwrap();
}

/// A program reading a folder's small files one after another in name order (here `cat`
/// through `xargs`, as `tar` or a loader over sorted samples does) gets the next files
/// pushed into the kernel's page cache once its reads show the kernel lacks them; the
/// bytes are the source's, and a re-read the kernel can serve costs no push and no read.
#[test]
fn a_folder_read_in_name_order_is_pushed_into_the_page_cache_ahead_of_the_reader() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-push-")
        .tempdir()
        .unwrap();
    let src = tmp.path().join("ufs");
    let mut total = 0;
    for i in 0..300u64 {
        let len = 64 * 1024 + i * 7;
        random_file(&src.join(format!("d/f{i:04}.bin")), len).unwrap();
        total += len;
    }
    let c = Cluster::start(tmp.path(), 1, "1GiB", &src).unwrap();
    let read_in_order = |d: &std::path::Path| {
        sh(&format!(
            "cd '{}' && ls | xargs cat | sha256sum",
            d.display()
        ))
        .unwrap()
    };
    let want = read_in_order(&src.join("d"));
    let dir = c.data().join("d");
    // Cold: every file is fetched and cached on the (same-host) worker.
    assert_eq!(read_in_order(&dir), want);
    let pushed = || c.fuse.metric("granary_client_pushed_bytes_total");
    let daemon_read = || {
        c.fuse
            .metric("granary_client_read_bytes_total{source=\"short_circuit\"}")
    };

    // The kernel drops its pages; files it got in the last second count as still held (a
    // reader ahead in the folder), so that second passes before the next read.
    std::fs::write("/proc/sys/vm/drop_caches", "1").expect("dropping the page cache (root)");
    std::thread::sleep(Duration::from_millis(1100));
    let (p0, r0) = (pushed(), daemon_read());
    assert_eq!(read_in_order(&dir), want, "bytes differ after pushes");
    let (p1, r1) = (pushed(), daemon_read());
    eprintln!(
        "{total}-byte folder: {} bytes pushed, {} read by the daemon",
        p1 - p0,
        r1 - r0
    );
    assert!(
        p1 - p0 >= total as f64 / 4.0,
        "only {} of {total} bytes were pushed ahead",
        p1 - p0
    );
    assert!(
        r1 - r0 <= total as f64 * 1.5,
        "{} bytes read for a {total}-byte folder: pushes and reads did the same work",
        r1 - r0
    );

    // The kernel holds every file now: no push, and no read reaches the daemon — but for
    // pages this VM's kernel drops on its own now and then (seen without pushes too: a few
    // 128 KiB runs of a 1 GB folder per pass), hence the 1/16 allowance.
    let slack = total as f64 / 16.0;
    assert_eq!(read_in_order(&dir), want);
    assert_eq!(pushed(), p1, "files the kernel held were pushed");
    let r2 = daemon_read();
    assert!(
        r2 - r1 <= slack,
        "the daemon served {} bytes of a folder the kernel held",
        r2 - r1
    );

    // The kernel drops one file of the folder it holds: reading the folder again reads
    // that file and pushes nothing (one file read by the daemon is not a folder the
    // kernel lacks). Opened out of name order (by the drop itself), the file may instead
    // be opened in passthrough: the kernel reads its block file, the daemon nothing.
    std::thread::sleep(Duration::from_millis(1100));
    let pt_opens = || c.fuse.metric("granary_client_passthrough_opens_total");
    let pt0 = pt_opens();
    let dropped = dir.join("f0150.bin");
    let dropped_len = std::fs::metadata(&dropped).unwrap().len() as f64;
    sh(&format!(
        "python3 -c 'import os; fd = os.open(\"{}\", os.O_RDONLY); \
         os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)'",
        dropped.display()
    ))
    .unwrap();
    assert_eq!(read_in_order(&dir), want);
    assert_eq!(pushed(), p1, "one dropped file pushed the folder again");
    let r3 = daemon_read();
    assert!(
        (r3 - r2 >= dropped_len || pt_opens() > pt0) && r3 - r2 <= dropped_len + slack,
        "{} bytes read by the daemon after the kernel dropped one {dropped_len}-byte file ({} passthrough opens)",
        r3 - r2,
        pt_opens() - pt0
    );

    // Readers in parallel, each going through its share of the folder in name order (as a
    // loader's worker threads do): pushes race them, and a file a reader opens while its
    // push is reading it must not be read twice (the read waits for the push's bytes).
    std::fs::write("/proc/sys/vm/drop_caches", "1").expect("dropping the page cache (root)");
    std::thread::sleep(Duration::from_millis(1100));
    let (p4, r4) = (pushed(), daemon_read());
    sh(&format!(
        "cd '{}' && ls | xargs -P 4 -n 25 cat > /dev/null",
        dir.display()
    ))
    .unwrap();
    let (p5, r5) = (pushed(), daemon_read());
    let shared = c.fuse.metric("granary_client_push_shared_bytes_total");
    eprintln!(
        "4 readers: {} bytes pushed, {} read by the daemon, {shared} answered from pushes",
        p5 - p4,
        r5 - r4
    );
    // (Before, a push dropped the bytes it had read when the reader opened the file
    // meanwhile: 1.1–2.4 MB read twice here.)
    assert!(
        r5 - r4 <= total as f64 * (1.0 + 1.0 / 64.0),
        "{} bytes read for a {total}-byte folder by 4 readers: files were read twice",
        r5 - r4
    );
}

/// With the kernel keeping names longer than the attribute timeout (`--entry-timeout 60s`,
/// a common setting for datasets that do not change), a program opening a folder's files
/// in name order sends no lookups, and each open and `fstat` finds the file's status stale.
/// They must not each ask the master: the first fetches the folder's listing page ahead,
/// and the rest are answered from it (before, every open and every getattr went to the
/// master, making the longer timeout slower than the default).
#[test]
fn opens_past_the_attribute_timeout_fetch_the_folder_listing_ahead() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-entry-")
        .tempdir()
        .unwrap();
    let src = tmp.path().join("ufs");
    let n = 300;
    let names: Vec<String> = (0..n).map(|i| format!("f{i:04}.bin")).collect();
    for (i, name) in names.iter().enumerate() {
        random_file(&src.join("d").join(name), 4096 + i as u64).unwrap();
    }
    let list = tmp.path().join("names.txt");
    std::fs::write(&list, names.join("\n") + "\n").unwrap();
    let c = Cluster::start_opts(tmp.path(), 1, "1GiB", &src, &["--entry-timeout", "60s"]).unwrap();
    // Python's open() is an OPEN and an fstat (a GETATTR once the attributes are stale).
    // Run from outside the mount: Python looks for its modules in the working directory
    // first, and those lookups of missing names would fetch the listing themselves.
    let read_all = |d: &std::path::Path| {
        sh(&format!(
            "cd / && python3 -c 'import sys, hashlib, os\nh = hashlib.sha256()\n\
             for n in sys.stdin:\n    h.update(open(os.path.join(sys.argv[1], n.strip()), \"rb\").read())\n\
             print(h.hexdigest())' '{}' < '{}'",
            d.display(),
            list.display()
        ))
        .unwrap()
    };
    let want = read_all(&src.join("d"));
    let dir = c.data().join("d");
    // A loader lists its dataset once (its index of samples), then reads it epoch after
    // epoch from its own list of names.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), n);
    assert_eq!(read_all(&dir), want, "cold pass");
    let asked = |op: &str| {
        c.fuse
            .metric(&format!("granary_client_op_seconds_count{{op=\"{op}\"}}"))
    };
    // Past the attribute timeout (1 s); the kernel still holds the names (60 s).
    std::thread::sleep(Duration::from_millis(1500));
    let (o0, g0) = (asked("open"), asked("getattr"));
    assert_eq!(read_all(&dir), want, "second pass");
    let (opens, getattrs) = (asked("open") - o0, asked("getattr") - g0);
    eprintln!("{n} files: {opens} opens and {getattrs} getattrs asked the master");
    assert!(
        opens <= (n / 4) as f64,
        "{opens} of {n} opens asked the master"
    );
    assert!(
        getattrs <= (n / 4) as f64,
        "{getattrs} of {n} getattrs asked the master"
    );
}

/// A master and a worker, the folder `src` mounted at `/data` and never listed again
/// (`sync_interval=never`: only the namespace watch tells a mount of changes), and two
/// FUSE mounts, a reader (its watch started) and a writer.
fn reader_and_writer(
    root: &std::path::Path,
    src: &std::path::Path,
) -> (Master, Worker, Fuse, Fuse) {
    let master = Master::start(root).unwrap();
    let w = Worker::start(root, "w1", &master.addr, "1GiB").unwrap();
    wait_live_workers(&master.addr, 1).unwrap();
    mount_local_opts("/data", src, &master.addr, &["sync_interval=never"]).unwrap();
    let reader = Fuse::start_opts(root, "reader", &master.addr, &[]).unwrap();
    let writer = Fuse::start_opts(root, "writer", &master.addr, &[]).unwrap();
    poll(
        "the reader's namespace watch",
        Duration::from_secs(20),
        || (reader.metric("granary_client_namespace_watch_starts_total") >= 1.0).then_some(()),
    )
    .unwrap();
    (master, w, reader, writer)
}

/// A mount answers lookups, opens and `stat`s of files it has seen from what it holds —
/// past the attribute timeout, without asking the master — and small files' reads from
/// their block files kept open; yet a change made elsewhere (another mount, the CLI)
/// reaches it at once, because the master announces every change on the namespace watch.
/// The dataset's mount never lists its store again (`sync_interval=never`), so nothing
/// but the announcements can tell this mount about the changes.
#[test]
fn a_mount_serves_from_its_caches_until_the_master_announces_a_change() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-watch-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("ufs");
    let n = 50;
    for i in 0..n {
        random_file(&src.join(format!("d/f{i:02}.bin")), 20_000 + i).unwrap();
    }
    std::fs::write(src.join("d/note.txt"), "one\n").unwrap();
    let (master, _w, reader, writer) = reader_and_writer(root, &src);
    let dir = reader.mountpoint.join("data/d");
    let sums = |d: &std::path::Path| {
        sh(&format!(
            "cd / && python3 -c 'import sys, hashlib, os\nh = hashlib.sha256()\n\
             for i in range({n}):\n    h.update(open(os.path.join(sys.argv[1], \"f%02d.bin\" % i), \"rb\").read())\n\
             print(h.hexdigest())' '{}'",
            d.display()
        ))
        .unwrap()
    };
    // The kernel drops its pages of the files (by name: a listing would refresh the
    // kernel's names by itself, and the point is that the kernel asks the daemon).
    let drop_pages = |d: &std::path::Path| {
        sh(&format!(
            "cd / && python3 -c 'import sys, os\n\
             for i in range({n}):\n    fd = os.open(os.path.join(sys.argv[1], \"f%02d.bin\" % i), os.O_RDONLY)\n    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\n    os.close(fd)' '{}'",
            d.display()
        ))
        .unwrap()
    };
    let want = sums(&src.join("d"));
    assert_eq!(sums(&dir), want, "first pass (from the store)");
    // The worker's disk now: read under short-circuit leases, kept open at close.
    drop_pages(&dir);
    assert_eq!(sums(&dir), want, "second pass");
    let asked =
        |op: &str| reader.metric(&format!("granary_client_op_seconds_count{{op=\"{op}\"}}"));
    let requests = |op: &str| {
        reader.metric(&format!(
            "granary_client_fuse_requests_total{{op=\"{op}\"}}"
        ))
    };
    // Past the attribute and entry timeouts (1 s): the kernel asks the daemon again, the
    // daemon answers from what it holds. (The wait is the condition under test.)
    // Statuses fetched while the first pass loaded the folder (its entries were being
    // created: announced changes) are trusted only within the timeouts; once past them
    // they are asked for again, once.
    std::thread::sleep(Duration::from_millis(2500));
    drop_pages(&dir);
    assert_eq!(sums(&dir), want, "third pass");
    std::thread::sleep(Duration::from_millis(2500));
    let before: Vec<f64> = ["lookup", "open", "getattr", "read"]
        .iter()
        .map(|o| asked(o))
        .collect();
    // Each file is read from its block file kept open since the second pass: by the
    // daemon, or by the kernel itself in passthrough (the third pass checked it whole).
    let local = || {
        reader.metric("granary_client_kept_reads_total")
            + reader.metric("granary_client_passthrough_opens_total")
    };
    let (lookups0, local0) = (requests("lookup"), local());
    drop_pages(&dir);
    assert_eq!(sums(&dir), want, "fourth pass");
    let after: Vec<f64> = ["lookup", "open", "getattr", "read"]
        .iter()
        .map(|o| asked(o))
        .collect();
    assert!(
        requests("lookup") - lookups0 >= n as f64,
        "the kernel did not ask again: {} lookups before, {} after",
        lookups0,
        requests("lookup")
    );
    assert_eq!(
        after,
        before,
        "lookups, opens, getattrs and reads that waited on the network (in that order); {}",
        log_tail(&root.join("fuse-reader.log"), 40)
    );
    assert!(
        local() - local0 >= n as f64,
        "files not read from kept block files: {} of {n}",
        local() - local0
    );

    // Changes through the other mount: the reader sees each one at once (a poll with a
    // deadline well under any timeout that could otherwise explain it).
    let note = dir.join("note.txt");
    assert_eq!(std::fs::read_to_string(&note).unwrap(), "one\n");
    std::thread::sleep(Duration::from_millis(2500)); // past the timeouts again
    assert_eq!(std::fs::read_to_string(&note).unwrap(), "one\n");
    let wdir = writer.mountpoint.join("data/d");
    std::fs::write(wdir.join("note.txt"), "two, longer\n").unwrap();
    poll(
        "the reader to see the new bytes",
        Duration::from_secs(5),
        || (std::fs::read_to_string(&note).ok()? == "two, longer\n").then_some(()),
    )
    .unwrap();
    std::fs::remove_file(wdir.join("f07.bin")).unwrap();
    poll(
        "the reader to see the removal",
        Duration::from_secs(5),
        || (!dir.join("f07.bin").exists()).then_some(()),
    )
    .unwrap();
    std::fs::write(wdir.join("new.txt"), "new\n").unwrap();
    poll(
        "the reader to see the new file",
        Duration::from_secs(5),
        || (std::fs::read_to_string(dir.join("new.txt")).ok()? == "new\n").then_some(()),
    )
    .unwrap();
    granary_ok(&["fs", "rm", "/data/d/f08.bin", "--master", &master.addr]).unwrap();
    poll(
        "the reader to see the CLI's removal",
        Duration::from_secs(5),
        || (!dir.join("f08.bin").exists()).then_some(()),
    )
    .unwrap();
    assert!(reader.metric("granary_client_namespace_watch_changes_total") > 0.0);
}

/// Folders opened in their parent's order (`find`, `du`, a training script listing every
/// class folder) get each next folder's first page asked for ahead, and every listing is
/// still exact: `find` through the mount names exactly the store's files. A page asked for
/// ahead is not used once the master announced a change of its folder: a file made in
/// the next folder meanwhile (through another mount) is listed.
#[test]
fn a_walk_of_folders_in_order_lists_each_next_one_ahead_and_exactly() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-walk-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("ufs");
    let (folders, per) = (30, 20);
    for d in 0..folders {
        for f in 0..per {
            let p = src.join(format!("d{d:02}/f{f:02}"));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, format!("{d}-{f}")).unwrap();
        }
    }
    let (_master, _w, reader, writer) = reader_and_writer(root, &src);
    let files = |top: &std::path::Path| {
        sh(&format!("cd '{}' && find . -type f | sort", top.display())).unwrap()
    };
    let data = reader.mountpoint.join("data");
    let want = files(&src);
    assert_eq!(want.lines().count(), folders * per);
    let ahead =
        |what: &str| reader.metric(&format!("granary_client_fuse_dir_pages_ahead{what}_total"));
    // The first find loads each folder from the store as it gets there: that is a change
    // the master announces, so those pages asked for ahead are mostly not used.
    assert_eq!(files(&data), want, "the first find");
    let (asked0, used0) = (ahead(""), ahead("_used"));
    assert_eq!(files(&data), want, "the second find");
    let (asked, used) = (ahead("") - asked0, ahead("_used") - used0);
    eprintln!("pages asked for ahead: {asked0} and {asked}, used: {used0} and {used}");
    // Every folder after the second is asked for ahead (d00 starts the walk, d01 shows it
    // goes in order), and each is used: a `find` opens them within the attribute timeout.
    assert!(
        asked0 >= (folders - 2) as f64
            && asked >= (folders - 2) as f64
            && used >= (folders - 3) as f64,
        "asked {asked0} and {asked}, used {used}"
    );

    // Two walks at once (as two loader processes scanning halves of a dataset): each
    // gets its own pages ahead.
    let used0 = ahead("_used");
    let half = folders / 2;
    sh(&format!(
        "cd / && python3 -c 'import os, sys\nfor i in range({half}):\n    for d in (i, i + {half}):\n        os.listdir(os.path.join(sys.argv[1], \"d%02d\" % d))' '{}'",
        data.display()
    ))
    .unwrap();
    let used = ahead("_used") - used0;
    assert!(
        used >= (folders - 4) as f64,
        "two walks at once used {used} pages ahead"
    );

    // d00 and d01 opened in order: d02's first page is asked for (and d03's). Then a file
    // is made in d02 elsewhere; once the reader heard of it, d02's listing names it.
    let listdir = |d: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(data.join(d))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let asked0 = ahead("");
    assert_eq!(listdir("d00").len(), per);
    assert_eq!(listdir("d01").len(), per);
    assert!(
        ahead("") > asked0,
        "d02's first page was not asked for ahead"
    );
    let heard = reader.metric("granary_client_namespace_watch_changes_total");
    std::fs::write(writer.mountpoint.join("data/d02/new"), b"made elsewhere").unwrap();
    poll(
        "the reader to hear of the change",
        Duration::from_secs(10),
        || (reader.metric("granary_client_namespace_watch_changes_total") > heard).then_some(()),
    )
    .unwrap();
    let d02 = listdir("d02");
    assert!(
        d02.len() == per + 1 && d02.iter().any(|n| n == "new"),
        "d02 listed as {d02:?}"
    );
    assert_eq!(
        std::fs::read(data.join("d02/new")).unwrap(),
        b"made elsewhere"
    );
}

/// Reads a folder with libc's `readdir` through ctypes: every name in order, then
/// `seekdir` back to where entry 10 was and every name from there again, then a seek
/// far past the end (which must read as the end). Prints one line per pass: the count
/// and a checksum of the names.
const SEEKDIR: &str = r#"
import ctypes, hashlib, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.opendir.restype = ctypes.c_void_p
libc.readdir.restype = ctypes.c_void_p
libc.readdir.argtypes = [ctypes.c_void_p]
libc.telldir.restype = ctypes.c_long
libc.telldir.argtypes = [ctypes.c_void_p]
libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]
d = libc.opendir(sys.argv[1].encode())
assert d, ctypes.get_errno()
def rest():
    names = []
    while True:
        ctypes.set_errno(0)
        e = libc.readdir(d)
        if not e:
            assert ctypes.get_errno() == 0, ctypes.get_errno()
            return names
        names.append(ctypes.string_at(e + 19).decode())
def line(names):
    return "%d %s" % (len(names), hashlib.sha256("\n".join(names).encode()).hexdigest())
first, at = [], None
while True:
    if len(first) == 10:
        at = libc.telldir(d)
    e = libc.readdir(d)
    if not e:
        break
    first.append(ctypes.string_at(e + 19).decode())
print(line(first))
libc.seekdir(d, at)
print(line(rest()))
print(line(first[10:]))
libc.seekdir(d, 1 << 40)
print(line(rest()))
"#;

/// A folder of 9,000 files (more than an open directory holds: it lets go of the entries
/// the kernel has passed) lists whole and in order with `ls -f` and with `readdir`; a
/// `seekdir` back lists the rest again exactly, and a seek far past the end reads as the
/// end, not as a listing of the whole folder held in the daemon.
#[test]
fn a_big_folder_lists_whole_and_seeks_back_exactly() {
    let tmp = tempfile::Builder::new()
        .prefix("granary-seekdir-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("ufs");
    std::fs::create_dir_all(src.join("big")).unwrap();
    for f in 0..9_000 {
        std::fs::write(src.join(format!("big/f{f:05}")), b"").unwrap();
    }
    let (_master, _w, reader, _writer) = reader_and_writer(root, &src);
    let big = reader.mountpoint.join("data/big");
    let want = sh(&format!("ls -f '{}' | sort", src.join("big").display())).unwrap();
    assert_eq!(want.lines().count(), 9_002); // with . and ..
    assert_eq!(
        sh(&format!("ls -f '{}' | sort", big.display())).unwrap(),
        want
    );
    let script = root.join("seekdir.py");
    std::fs::write(&script, SEEKDIR).unwrap();
    let out = sh(&format!(
        "python3 '{}' '{}'",
        script.display(),
        big.display()
    ))
    .unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert!(lines[0].starts_with("9002 "), "{out}");
    assert_eq!(lines[1], lines[2], "the names after a seek back differ");
    assert!(lines[1].starts_with("8992 "), "{out}");
    assert!(
        lines[3].starts_with("0 "),
        "a seek past the end read entries: {out}"
    );
}
