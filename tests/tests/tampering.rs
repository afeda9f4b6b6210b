//! Cache poisoning through the block descriptor, on real processes: a `user` holding an
//! honest read grant sends `ReadBlock` with a tampered block size, file length, version,
//! fingerprint or index (or alters the grant to match): every one is refused
//! (PERMISSION_DENIED or INVALID_ARGUMENT) and nothing is cached; the honest read of the
//! block then returns the source's bytes, and so does a second, cached read. A node
//! without a grant cannot fill the cache with a descriptor of its own either. Block files
//! are the worker user's alone.

use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use granary_proto as pb;
use granary_proto::master_service_client::MasterServiceClient;
use granary_proto::worker_service_client::WorkerServiceClient;
use granary_tests::*;
use sha2::{Digest, Sha256};
use tonic::Code;

const MIB: u64 = 1 << 20;
/// The master's block size here: a 2.5 MiB file has three blocks.
const BLOCK: u64 = MIB;
const LEN: u64 = 5 * MIB / 2;

/// A master whose files loaded from under-stores have blocks of [`BLOCK`] bytes.
fn master(root: &Path) -> Master {
    Master::start_with(root, &["--block-size", "1MiB"]).unwrap()
}

/// Reads `[offset, offset+length)` of the block `desc` names as `creds`, showing `grant`:
/// the bytes, in order, and whether they all came from the worker's cache.
async fn read(
    worker: &str,
    creds: &Creds,
    desc: &pb::BlockDescriptor,
    offset: u64,
    length: u64,
    grant: Option<pb::ReadGrant>,
) -> Result<(Vec<u8>, bool), tonic::Status> {
    let mut wc = WorkerServiceClient::new(channel(worker, Some(creds)));
    let req = pb::ReadBlockRequest {
        block: Some(desc.clone()),
        offset,
        length,
        cache: true,
        cached_only: false,
        grant,
        from_peers: false,
    };
    let mut stream = wc.read_block(req).await?.into_inner();
    let (mut out, mut hits) = (Vec::new(), true);
    while let Some(m) = stream.message().await? {
        assert_eq!(m.offset, offset + out.len() as u64, "chunks out of order");
        out.extend_from_slice(&m.data);
        hits &= m.hit;
    }
    Ok((out, hits))
}

async fn cached_pages(worker: &str, creds: &Creds) -> u64 {
    WorkerServiceClient::new(channel(worker, Some(creds)))
        .get_cache_info(pb::GetCacheInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .cached_pages
}

/// Permission bits of every entry under `dir` that is not as wanted (files 0600, folders
/// 0700).
fn open_modes(dir: &Path) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let mut bad = Vec::new();
    if std::fs::metadata(dir).unwrap().permissions().mode() & 0o777 != 0o700 {
        bad.push(dir.display().to_string());
    }
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let meta = e.metadata().unwrap();
            let mode = meta.permissions().mode() & 0o777;
            let want = if meta.is_dir() { 0o700 } else { 0o600 };
            if mode != want {
                bad.push(format!("{} {mode:o}", e.path().display()));
            }
            if meta.is_dir() {
                stack.push(e.path());
            }
        }
    }
    bad
}

#[test]
fn a_tampered_descriptor_is_refused_and_the_block_keeps_the_source_bytes() {
    if std::env::var("GRANARY_TEST_INSECURE").is_ok_and(|v| v == "1") {
        eprintln!("skipped: grants exist only on TLS clusters");
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("granary-tamper-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    random_file(&src.join("a.bin"), LEN).unwrap();
    let bytes = std::fs::read(src.join("a.bin")).unwrap();
    let block_sum = |i: u64| {
        let end = ((i + 1) * BLOCK).min(LEN) as usize;
        Sha256::digest(&bytes[(i * BLOCK) as usize..end])
    };
    let m = master(root);
    let w = Worker::start(root, "w1", &m.addr, "64MiB").unwrap();
    wait_live_workers(&m.addr, 1).unwrap();
    mount_local("/d", &src, &m.addr).unwrap();
    let tls = TestTls::get();
    let mallory = creds_in(&tls.issue("mallory", &["--role", "user"]).unwrap());
    let node = creds_in(&tls.identity("node"));

    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let status = MasterServiceClient::new(channel(&m.addr, Some(&mallory)))
                .get_status(pb::GetStatusRequest {
                    target: Some(pb::PathOrId {
                        target: Some(pb::path_or_id::Target::Path("/d/a.bin".into())),
                    }),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .status
                .unwrap();
            assert_eq!((status.length, status.block_size), (LEN, BLOCK));
            let grant = status.grant.clone().expect("a grant with the status");
            // The grant binds what decides the blocks' bytes.
            assert_eq!(
                (
                    grant.version,
                    grant.block_size,
                    grant.file_length,
                    grant.fingerprint.clone()
                ),
                (status.version, BLOCK, LEN, status.fingerprint.clone())
            );
            let honest = |index: u32| pb::BlockDescriptor {
                id: Some(pb::BlockId {
                    inode: status.inode,
                    version: status.version,
                    index,
                }),
                ufs: status.ufs.clone(),
                fingerprint: status.fingerprint.clone(),
                file_length: LEN,
                block_size: BLOCK,
            };

            // Block 1 as the attacker would have it: from byte B' (another block size),
            // short, of another version or fingerprint, past the end; each refused.
            type Tamper = fn(&mut pb::BlockDescriptor);
            let cases: [(&str, Tamper, Code, &str); 8] = [
                (
                    "block size",
                    |d| d.block_size = BLOCK / 2,
                    Code::PermissionDenied,
                    "block size",
                ),
                (
                    "short length",
                    |d| d.file_length = BLOCK + 4096,
                    Code::PermissionDenied,
                    "length",
                ),
                (
                    "long length",
                    |d| d.file_length = 3 * BLOCK,
                    Code::PermissionDenied,
                    "length",
                ),
                (
                    "version",
                    |d| d.id.as_mut().unwrap().version ^= 1,
                    Code::PermissionDenied,
                    "version",
                ),
                (
                    "no fingerprint",
                    |d| d.fingerprint = None,
                    Code::PermissionDenied,
                    "fingerprint",
                ),
                (
                    "block size 0",
                    |d| d.block_size = 0,
                    Code::InvalidArgument,
                    "block size 0",
                ),
                (
                    "index past the end",
                    |d| d.id.as_mut().unwrap().index = 3,
                    Code::InvalidArgument,
                    "past the end",
                ),
                (
                    "overflowing length",
                    |d| d.file_length = u64::MAX,
                    Code::InvalidArgument,
                    "length",
                ),
            ];
            for (what, tamper, code, why) in cases {
                let mut d = honest(1);
                tamper(&mut d);
                let e = read(&w.addr, &mallory, &d, 0, 4096, Some(grant.clone()))
                    .await
                    .expect_err(what);
                assert_eq!(e.code(), code, "{what}: {e:?}");
                assert!(e.message().contains(why), "{what}: {e:?}");
            }
            // A grant altered to match the tampered descriptor no longer verifies.
            let mut d = honest(1);
            d.block_size = BLOCK / 2;
            let mut forged = grant.clone();
            forged.block_size = BLOCK / 2;
            let e = read(&w.addr, &mallory, &d, 0, 4096, Some(forged))
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
            assert!(e.message().contains("forged or altered"), "{e:?}");
            // Nothing was fetched for any of them.
            assert_eq!(cached_pages(&w.addr, &mallory).await, 0);

            // The honest read of block 1: the source's bytes, then again from the cache
            // (once its page is in: pages reach the cache after their readers).
            for cached in [false, true] {
                if cached {
                    let deadline = std::time::Instant::now() + Duration::from_secs(10);
                    while cached_pages(&w.addr, &mallory).await < 1 {
                        assert!(std::time::Instant::now() < deadline, "block 1 never cached");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                let (got, hits) =
                    read(&w.addr, &mallory, &honest(1), 0, BLOCK, Some(grant.clone()))
                        .await
                        .unwrap();
                assert_eq!(Sha256::digest(&got), block_sum(1), "cached: {cached}");
                assert_eq!(hits, cached);
            }

            // A node without a grant (a worker's or a node mount's certificate) cannot fill
            // the cache with a descriptor of its own either (a short block 2 here); an
            // honest reader of block 2 gets the source's bytes.
            let mut short = honest(2);
            short.file_length = 2 * BLOCK + 1000;
            let e = read(&w.addr, &node, &short, 0, 1000, None)
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
            let last = LEN - 2 * BLOCK;
            let (got, _) = read(
                &w.addr,
                &mallory,
                &honest(2),
                last - 10,
                10,
                Some(grant.clone()),
            )
            .await
            .unwrap();
            assert_eq!(got, bytes[(LEN - 10) as usize..]);
            let (got, _) = read(&w.addr, &mallory, &honest(2), 0, last, Some(grant.clone()))
                .await
                .unwrap();
            assert_eq!(Sha256::digest(&got), block_sum(2));
        });
    // Block files and their folders: the worker's user only.
    let bad = open_modes(&w.cache_dir.join("files"));
    assert!(bad.is_empty(), "readable by others: {bad:?}");
    // The source was never written.
    assert_eq!(std::fs::read(src.join("a.bin")).unwrap(), bytes);
}

/// The header of a cache-through write of `status`'s file at its version, with its grant.
fn write_header(status: &pb::FileStatus) -> pb::WriteFileHeader {
    pb::WriteFileHeader {
        inode: status.inode,
        version: status.version,
        block_size: status.block_size,
        ufs: status.ufs.clone(),
        mode: pb::WriteMode::CacheThrough as i32,
        persist: true,
        grant: status.grant.clone(),
        finishes: true,
    }
}

/// The messages of a write of `data` as `status`'s file: the header, then the bytes, with
/// the finish naming their length when `finish`.
fn write_msgs(status: &pb::FileStatus, data: &[u8], finish: bool) -> Vec<pb::WriteFileRequest> {
    let header = pb::WriteFileRequest {
        header: Some(write_header(status)),
        ..Default::default()
    };
    let bytes = pb::WriteFileRequest {
        data: data.to_vec().into(),
        finish,
        length: if finish { data.len() as u64 } else { 0 },
        ..Default::default()
    };
    vec![header, bytes]
}

/// Writes `data` as version `status.version` of `status`'s file to `worker` as `creds`
/// (cache-through), answering the last message or the refusal.
async fn write_file(
    worker: &str,
    creds: &Creds,
    status: &pb::FileStatus,
    data: &[u8],
) -> Result<pb::WriteFileResponse, tonic::Status> {
    let mut wc = WorkerServiceClient::new(channel(worker, Some(creds)));
    let mut answers = wc
        .write_file(futures::stream::iter(write_msgs(status, data, true)))
        .await?
        .into_inner();
    let mut last = None;
    while let Some(a) = answers.message().await? {
        last = Some(a);
    }
    last.ok_or_else(|| tonic::Status::internal("no answer"))
}

/// Opens a write stream of `status`'s file to `worker` as `creds`, sends `data` and keeps
/// the stream open (no finish); its answers.
async fn open_write(
    worker: &str,
    creds: &Creds,
    status: &pb::FileStatus,
    data: &[u8],
) -> Result<tonic::Streaming<pb::WriteFileResponse>, tonic::Status> {
    let mut wc = WorkerServiceClient::new(channel(worker, Some(creds)));
    let open =
        futures::stream::iter(write_msgs(status, data, false)).chain(futures::stream::pending());
    Ok(wc.write_file(open).await?.into_inner())
}

#[test]
fn a_write_grant_does_not_rewrite_a_completed_file_on_any_worker() {
    if std::env::var("GRANARY_TEST_INSECURE").is_ok_and(|v| v == "1") {
        eprintln!("skipped: grants exist only on TLS clusters");
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("granary-rewrite-")
        .tempdir()
        .unwrap();
    let root = tmp.path();
    let src = root.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let m = master(root);
    let w1 = Worker::start(root, "w1", &m.addr, "64MiB").unwrap();
    let w2 = Worker::start(root, "w2", &m.addr, "64MiB").unwrap();
    let w3 = Worker::start(root, "w3", &m.addr, "64MiB").unwrap();
    wait_live_workers(&m.addr, 3).unwrap();
    mount_local("/d", &src, &m.addr).unwrap();
    let mallory = creds_in(
        &TestTls::get()
            .issue("mallory", &["--role", "user"])
            .unwrap(),
    );
    let honest: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let other = vec![0x5a; honest.len()];

    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let mut mc = MasterServiceClient::new(channel(&m.addr, Some(&mallory)));
            let created = mc
                .create_file(pb::CreateFileRequest {
                    path: "/d/new.bin".into(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .status
                .unwrap();
            let grant = created.grant.clone().expect("a write grant");
            assert!(grant.write);
            assert_eq!(
                (grant.version, grant.block_size, grant.file_length),
                (created.version, created.block_size, 0)
            );
            // Another version or block size than the one created: refused.
            for (what, version, block_size) in [
                ("version", created.version ^ 1, created.block_size),
                ("block size", created.version, created.block_size / 2),
            ] {
                let bad = pb::FileStatus {
                    version,
                    block_size,
                    ..created.clone()
                };
                let e = write_file(&w1.addr, &mallory, &bad, &other)
                    .await
                    .expect_err(what);
                assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
                assert!(e.message().contains(what), "{what}: {e:?}");
            }
            // A stream to a third worker, opened while the file is being written and
            // kept open: its bytes are cached as they arrive.
            let mut rogue = open_write(&w3.addr, &mallory, &created, &vec![0xa5; 2 << 20])
                .await
                .unwrap();
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while cached_pages(&w3.addr, &mallory).await == 0 {
                assert!(std::time::Instant::now() < deadline, "no page cached");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // The honest write, completed.
            let done = write_file(&w1.addr, &mallory, &created, &honest)
                .await
                .unwrap();
            // A fingerprint naming a megabyte ETag (kept in the record, sent with every
            // listing of the folder): refused, the file stays incomplete.
            let mut huge = done.fingerprint.clone().unwrap();
            huge.etag = "e".repeat(1 << 20);
            let e = mc
                .complete_file(pb::CompleteFileRequest {
                    inode: created.inode,
                    length: honest.len() as u64,
                    fingerprint: Some(huge),
                    version: created.version,
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains("at most 1024"), "{e:?}");
            let complete = mc
                .complete_file(pb::CompleteFileRequest {
                    inode: created.inode,
                    length: honest.len() as u64,
                    fingerprint: done.fingerprint.clone(),
                    version: created.version,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .status
                .unwrap();
            assert!(complete.complete);
            // The open stream learns of the completion and ends, and what it cached goes:
            // its pages were named as the completed version's.
            let e = tokio::time::timeout(Duration::from_secs(30), async {
                loop {
                    match rogue.message().await {
                        Ok(Some(_)) => continue,
                        Ok(None) => panic!("the stream ended without an error"),
                        Err(e) => return e,
                    }
                }
            })
            .await
            .expect("the stream open past the completion was not ended");
            assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
            assert!(e.message().contains("complete"), "{e:?}");
            assert_eq!(cached_pages(&w3.addr, &mallory).await, 0);
            // The same write grant, other bytes: refused by the worker that took the file
            // and by one that never saw it.
            for w in [&w1, &w2] {
                let e = write_file(&w.addr, &mallory, &created, &other)
                    .await
                    .unwrap_err();
                assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
                assert!(e.message().contains("complete"), "{e:?}");
            }
            // Both workers serve the written bytes.
            let read_grant = complete.grant.clone().unwrap();
            let desc = pb::BlockDescriptor {
                id: Some(pb::BlockId {
                    inode: complete.inode,
                    version: complete.version,
                    index: 0,
                }),
                ufs: complete.ufs.clone(),
                fingerprint: complete.fingerprint.clone(),
                file_length: complete.length,
                block_size: complete.block_size,
            };
            for w in [&w1, &w2] {
                let (got, _) = read(
                    &w.addr,
                    &mallory,
                    &desc,
                    0,
                    complete.length,
                    Some(read_grant.clone()),
                )
                .await
                .unwrap();
                assert_eq!(got, honest);
            }
        });
    assert_eq!(std::fs::read(src.join("new.bin")).unwrap(), honest);
}
