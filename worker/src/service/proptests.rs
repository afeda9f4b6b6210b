//! Property tests of the worker's service under hostile block descriptors, against a real
//! page store on a temp dir and an in-memory under-store: whatever a request names (block
//! size, file length, version, index, fingerprint, offset, length, cached-only, leases),
//! no worker thread panics; a `user` principal with an honest grant gets every tampered
//! descriptor refused (PERMISSION_DENIED, INVALID_ARGUMENT, OUT_OF_RANGE) and every page
//! cached for the file holds the source's bytes; and after any sequence of a node's
//! (trusted, shape-checked) descriptors an honest read still answers without a panic.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use granary_common::grant::GrantKey;
use granary_common::ufs::Ufs;
use granary_proto::worker_service_server::WorkerService;
use object_store::memory::InMemory;
use object_store::path::Path as StorePath;
use object_store::{ObjectStoreExt, PutPayload};
use proptest::prelude::*;

use super::*;
use crate::store::{PageStore, TieredStore};

const PS: u64 = 4096;
/// The honest block size: 4 pages.
const BS: u64 = 4 * PS;
/// The source file: three blocks and a short fourth (two pages and 100 bytes).
const LEN: u64 = 3 * BS + 2 * PS + 100;
const INODE: u64 = 5;
const VERSION: u64 = 0x77;

/// Panics anywhere in the process (worker tasks run on other threads; a panic there does
/// not fail the caller by itself).
static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            prev(info);
        }));
    });
}

fn source() -> Vec<u8> {
    (0..LEN).map(|i| (i * 7 % 253) as u8).collect()
}

struct Rig {
    _dir: tempfile::TempDir,
    rpc: WorkerRpc,
    honest: pb::BlockDescriptor,
    grant: pb::ReadGrant,
    /// Bob's grant for the same file (another user).
    bob: pb::ReadGrant,
}

async fn rig() -> Rig {
    rig_with(true).await
}

/// A worker of a cluster whose masters sign grants (`signed`), or of a plaintext one (no
/// grant keys: nodes are trusted with a block's geometry, and the worker's own checks
/// are all that stands between a descriptor and a panic).
async fn rig_with(signed: bool) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let metrics = WorkerMetrics::default();
    let pages = PageStore::open(
        &dir.path().join("cache"),
        1 << 30,
        PS,
        crate::evict::PolicyKind::default(),
        metrics.clone(),
    )
    .unwrap();
    let store = Arc::new(InMemory::new());
    store
        .put(&StorePath::from("f"), PutPayload::from(source()))
        .await
        .unwrap();
    let meta = store.head(&StorePath::from("f")).await.unwrap();
    let fingerprint = granary_common::ufs::fingerprint_of(&meta);
    let master =
        granary_client::MasterClient::new(granary_common::net::Tcp::plain(), "127.0.0.1:1")
            .unwrap();
    let fetcher = Arc::new(Fetcher::new(
        master.clone(),
        TieredStore::single(pages),
        metrics.clone(),
    ));
    fetcher.stores.insert(
        1,
        Ufs {
            store,
            pager: None,
            prefix: StorePath::default(),
            part_size: 2 * PS,
            part_concurrency: 2,
            local: None,
        },
    );
    let writes = crate::writes::Writes::open(
        &dir.path().join("cache"),
        fetcher.clone(),
        master,
        metrics.clone(),
        0,
    )
    .unwrap();
    let key = GrantKey::random().unwrap();
    let grant_keys = Arc::new(GrantKeys::default());
    if signed {
        grant_keys.learn(&key.to_proto());
    }
    let ufs = pb::UfsLocation {
        mount_id: 1,
        path: "f".into(),
    };
    let status = pb::FileStatus {
        inode: INODE,
        version: VERSION,
        block_size: BS,
        length: LEN,
        fingerprint: Some(fingerprint.clone()),
        ufs: Some(ufs.clone()),
        ..Default::default()
    };
    let until = granary_common::now_ms() as u64 + 600_000;
    let grant = key.sign("alice", &status, false, until);
    let bob = key.sign("bob", &status, false, until);
    let honest = pb::BlockDescriptor {
        id: Some(pb::BlockId {
            inode: INODE,
            version: VERSION,
            index: 0,
        }),
        ufs: Some(ufs),
        fingerprint: Some(fingerprint),
        file_length: LEN,
        block_size: BS,
    };
    Rig {
        _dir: dir,
        rpc: WorkerRpc {
            worker_id: 1,
            fetcher,
            metrics,
            writes,
            grant_keys,
            node_copies: true,
        },
        honest,
        grant,
        bob,
    }
}

fn as_who<T>(msg: T, node: bool) -> Request<T> {
    let mut req = Request::new(msg);
    let who = if node {
        Principal::new("worker-2", &[Role::Node], None)
    } else {
        Principal::new("alice", &[Role::User], None)
    };
    req.extensions_mut().insert(Arc::new(who));
    req
}

/// One hostile change of the honest descriptor.
#[derive(Debug, Clone)]
enum Tamper {
    None,
    Index(u32),
    Version(u64),
    BlockSize(u64),
    FileLength(u64),
    NoFingerprint,
    OtherFingerprint,
    NoUfs,
    OtherObject,
}

fn tamper() -> impl Strategy<Value = Tamper> {
    let sizes = prop_oneof![
        Just(0u64),
        Just(1u64),
        Just(PS - 1),
        Just(PS),
        Just(BS - 100),
        Just(BS + PS),
        Just(granary_common::MAX_BLOCK_SIZE),
        Just(granary_common::MAX_BLOCK_SIZE + 1),
        Just(u64::MAX),
        any::<u64>(),
        1..=3 * BS,
    ];
    let lengths = prop_oneof![
        Just(0u64),
        Just(1u64),
        Just(LEN - 1),
        Just(LEN + 1),
        Just(BS),
        Just(granary_common::MAX_FILE_LENGTH),
        Just(u64::MAX),
        any::<u64>(),
        0..=2 * LEN,
    ];
    prop_oneof![
        2 => Just(Tamper::None),
        2 => prop_oneof![0..6u32, Just(u32::MAX), any::<u32>()].prop_map(Tamper::Index),
        1 => prop_oneof![Just(VERSION + 1), Just(0u64), any::<u64>()].prop_map(Tamper::Version),
        3 => sizes.prop_map(Tamper::BlockSize),
        3 => lengths.prop_map(Tamper::FileLength),
        1 => Just(Tamper::NoFingerprint),
        1 => Just(Tamper::OtherFingerprint),
        1 => Just(Tamper::NoUfs),
        1 => Just(Tamper::OtherObject),
    ]
}

#[derive(Debug, Clone)]
struct Op {
    tampers: Vec<Tamper>,
    index: u32,
    offset: u64,
    length: u64,
    cache: bool,
    cached_only: bool,
    /// A node copy (filled from peers only).
    from_peers: bool,
    /// A short-circuit lease of the block from this page instead of a read.
    lease: Option<(u32, bool)>,
    /// A `CacheBlocks` request for the block instead of a read (a client's warm).
    cache_blocks: bool,
}

fn op() -> impl Strategy<Value = Op> {
    (
        prop::collection::vec(tamper(), 0..3),
        0..4u32,
        prop_oneof![0..2 * BS, Just(u64::MAX), any::<u64>()],
        prop_oneof![1..2 * BS, Just(0u64), Just(u64::MAX), Just(MAX_READ_LENGTH)],
        any::<bool>(),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.2),
        prop::option::weighted(0.15, (any::<u32>(), any::<bool>())),
        prop::bool::weighted(0.15),
    )
        .prop_map(|t| Op {
            tampers: t.0,
            index: t.1,
            offset: t.2,
            length: t.3,
            cache: t.4,
            cached_only: t.5,
            from_peers: t.6,
            lease: t.7,
            cache_blocks: t.8,
        })
}

fn describe(honest: &pb::BlockDescriptor, op: &Op) -> pb::BlockDescriptor {
    let mut d = honest.clone();
    if let Some(id) = d.id.as_mut() {
        id.index = op.index;
    }
    for t in &op.tampers {
        match t {
            Tamper::None => {}
            Tamper::Index(i) => d.id.as_mut().unwrap().index = *i,
            Tamper::Version(v) => d.id.as_mut().unwrap().version = *v,
            Tamper::BlockSize(b) => d.block_size = *b,
            Tamper::FileLength(l) => d.file_length = *l,
            Tamper::NoFingerprint => d.fingerprint = None,
            Tamper::OtherFingerprint => {
                if let Some(f) = d.fingerprint.as_mut() {
                    f.etag.push('x');
                }
            }
            Tamper::NoUfs => d.ufs = None,
            Tamper::OtherObject => {
                if let Some(u) = d.ufs.as_mut() {
                    u.path = "g".into();
                }
            }
        }
    }
    d
}

/// Runs one request; for a read, the chunks it served as (block offset, bytes) and how it
/// ended.
async fn run(r: &Rig, op: &Op, node: bool) -> (Vec<(u64, bytes::Bytes)>, Result<(), Status>) {
    let desc = describe(&r.honest, op);
    let grant = (!node).then(|| r.grant.clone());
    if let Some((first_page, whole_block)) = op.lease {
        let req = pb::LeaseLocalBlockRequest {
            block: desc.id,
            first_page,
            whole_block,
            hold_ms: 50,
            grants: grant.into_iter().collect(),
            ..Default::default()
        };
        let res = r.rpc.lease_local_block(as_who(req, node)).await;
        return (Vec::new(), res.map(|_| ()));
    }
    if op.cache_blocks {
        let asked = vec![pb::CacheBlock {
            block: Some(desc),
            grant,
        }];
        return (Vec::new(), cached(warm(r, asked, node)).await);
    }
    let req = pb::ReadBlockRequest {
        block: Some(desc),
        offset: op.offset,
        length: op.length,
        cache: op.cache,
        cached_only: op.cached_only,
        grant,
        from_peers: op.from_peers,
    };
    let mut stream = match r.rpc.read_block(as_who(req, node)).await {
        Ok(s) => s.into_inner(),
        Err(e) => return (Vec::new(), Err(e)),
    };
    let mut got = Vec::new();
    let drained = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(m) = stream.next().await {
            match m {
                Ok(m) => got.push((m.offset, m.data)),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })
    .await
    .expect("a read did not end within 20 s");
    (got, drained)
}

/// A `CacheBlocks` stream asking for `asked`, as alice (or a node).
fn warm(r: &Rig, asked: Vec<pb::CacheBlock>, node: bool) -> CacheStream {
    let who = as_who((), node)
        .extensions()
        .get::<Arc<Principal>>()
        .cloned()
        .unwrap();
    r.rpc
        .cache_stream(who, futures::stream::iter(asked.into_iter().map(Ok)))
}

/// How a `CacheBlocks` stream of one block ended, as the status a read would have ended
/// with.
async fn cached(answer: CacheStream) -> Result<(), Status> {
    let results = results_of(answer).await?;
    assert_eq!(results.len(), 1, "one result per block asked");
    let r = &results[0];
    if r.error.is_empty() {
        return Ok(());
    }
    Err(match pb::LoadError::try_from(r.code) {
        Ok(pb::LoadError::Denied) => Status::permission_denied(r.error.clone()),
        Ok(pb::LoadError::Invalid) => Status::invalid_argument(r.error.clone()),
        Ok(pb::LoadError::NotFound) => Status::not_found(r.error.clone()),
        _ => Status::unavailable(r.error.clone()),
    })
}

/// Every result of a `CacheBlocks` answer (which ends within 20 s), or how it failed.
async fn results_of(answer: CacheStream) -> Result<Vec<pb::LoadResult>, Status> {
    let all = tokio::time::timeout(Duration::from_secs(20), answer.collect::<Vec<_>>())
        .await
        .expect("a CacheBlocks answer did not end within 20 s");
    all.into_iter().collect()
}

/// An honest user's read of block `index` whole, caching it.
fn read_whole(index: u32) -> Op {
    Op {
        tampers: Vec::new(),
        index,
        offset: 0,
        length: BS,
        cache: true,
        cached_only: false,
        from_peers: false,
        lease: None,
        cache_blocks: false,
    }
}

/// Reads block `index` whole as an honest user and waits until all its pages are cached
/// (a fetched page reaches its reader before the cache).
async fn cache_whole(r: &Rig, index: u32) {
    let (_, end) = run(r, &read_whole(index), false).await;
    assert!(end.is_ok(), "{end:?}");
    let store = &r.rpc.fetcher.store;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !(0..4).all(|p| store.contains(&((INODE, VERSION, index), p))) {
        assert!(
            std::time::Instant::now() < deadline,
            "block {index} was never cached"
        );
        tokio::task::yield_now().await;
    }
}

/// Every cached page of the file holds the source's bytes where the honest geometry puts
/// it.
fn cached_pages_are_the_source(r: &Rig, src: &[u8]) -> Result<(), TestCaseError> {
    let store = &r.rpc.fetcher.store;
    for index in 0..4u32 {
        for page in 0..(BS / PS) as u32 {
            let Some(bytes) = store.get(&((INODE, VERSION, index), page)) else {
                continue;
            };
            let at = (u64::from(index) * BS + u64::from(page) * PS) as usize;
            let end = (at + PS as usize).min(src.len());
            prop_assert!(
                at < src.len(),
                "page {page} of block {index} is past the end"
            );
            prop_assert_eq!(
                &bytes[..],
                &src[at..end],
                "page {} of block {} holds other bytes",
                page,
                index
            );
        }
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A user with an honest grant: any tampered descriptor is refused; what is served and
    /// cached is the source's bytes; nothing panics.
    #[test]
    fn a_user_cannot_make_a_worker_cache_or_serve_other_bytes(ops in prop::collection::vec(op(), 1..8)) {
        count_panics();
        let before = PANICS.load(Ordering::SeqCst);
        let src = source();
        runtime().block_on(async {
            let r = rig().await;
            for op in &ops {
                let desc = describe(&r.honest, op);
                let (got, end) = run(&r, op, false).await;
                let honest_terms = desc.block_size == BS
                    && desc.file_length == LEN
                    && desc.fingerprint == r.honest.fingerprint
                    && desc.ufs == r.honest.ufs
                    && desc.id.map(|id| (id.inode, id.version)) == Some((INODE, VERSION));
                if op.lease.is_some() && desc.id.map(|id| id.version) != Some(VERSION) {
                    let e = end.as_ref().expect_err("a lease of another version was granted");
                    prop_assert_eq!(e.code(), tonic::Code::PermissionDenied, "{:?}", e);
                }
                if !honest_terms && op.lease.is_none() {
                    let e = end.as_ref().expect_err("a tampered descriptor was served");
                    prop_assert!(
                        matches!(
                            e.code(),
                            tonic::Code::PermissionDenied
                                | tonic::Code::InvalidArgument
                                | tonic::Code::OutOfRange
                        ),
                        "{:?}",
                        e
                    );
                    prop_assert!(got.is_empty());
                }
                let index = u64::from(desc.id.map_or(0, |id| id.index));
                for (offset, bytes) in &got {
                    let at = (index * BS + offset) as usize;
                    prop_assert_eq!(&bytes[..], &src[at..at + bytes.len()], "served other bytes");
                }
                // Whatever of it has reached the cache so far.
                cached_pages_are_the_source(&r, &src)?;
            }
            Ok(())
        })?;
        prop_assert_eq!(PANICS.load(Ordering::SeqCst), before, "a worker thread panicked");
    }

    /// A node of a plaintext cluster (trusted with geometry, not with its shape) sends
    /// arbitrary descriptors; no request panics the worker, and an honest read afterwards answers (bytes or an error,
    /// never a panic or a hang).
    #[test]
    fn no_descriptor_panics_a_worker(ops in prop::collection::vec(op(), 1..8)) {
        count_panics();
        let before = PANICS.load(Ordering::SeqCst);
        runtime().block_on(async {
            let r = rig_with(false).await;
            for op in &ops {
                let _ = run(&r, op, true).await;
            }
            for index in 0..4u32 {
                let block_len = if index == 3 { LEN - 3 * BS } else { BS };
                // The whole block, and one byte near the start and at the end of each
                // page (past the end of a page cached short).
                let ends = (0..block_len.div_ceil(PS)).flat_map(|p| [p * PS + 60, p * PS + PS - 1]);
                let reads = std::iter::once((0, block_len))
                    .chain(ends.filter(|o| *o < block_len).map(|o| (o, 1)));
                for (offset, length) in reads {
                    for cached_only in [true, false] {
                        let honest = Op {
                            tampers: Vec::new(),
                            index,
                            offset,
                            length,
                            cache: true,
                            cached_only,
                            from_peers: false,
                            lease: None,
                            cache_blocks: false,
                        };
                        let _ = run(&r, &honest, true).await;
                    }
                }
            }
        });
        prop_assert_eq!(PANICS.load(Ordering::SeqCst), before, "a worker thread panicked");
    }
}

/// In a cluster whose masters sign grants, a node's read without a grant gets cached pages
/// only: one that may fill the cache (and so name its bytes) is refused, as a user's is.
#[test]
fn a_node_without_a_grant_fills_nothing_where_grants_are_signed() {
    runtime().block_on(async {
        let r = rig().await;
        let fill = Op {
            tampers: vec![Tamper::BlockSize(BS - 100)],
            index: 0,
            offset: 0,
            length: PS,
            cache: true,
            cached_only: false,
            from_peers: false,
            lease: None,
            cache_blocks: false,
        };
        let (got, end) = run(&r, &fill, true).await;
        let e = end.expect_err("a node's grant-less fill was served");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(got.is_empty());
        assert!(!r.rpc.fetcher.store.contains(&((INODE, VERSION, 0), 0)));
        // Reading cached pages only (a peer filling its own cache) needs none.
        let peek = Op {
            cached_only: true,
            ..fill.clone()
        };
        let (_, end) = run(&r, &peek, true).await;
        if let Err(e) = end {
            assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}"); // not cached: not refused
        }
        // A worker with TLS that has not registered yet (no key has come): the same.
        let mut r = rig_with(false).await;
        r.rpc.grant_keys = Arc::new(GrantKeys::expected());
        let (got, end) = run(&r, &fill, true).await;
        let e = end.expect_err("a node's grant-less fill was served before the first key");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(got.is_empty());
        assert!(!r.rpc.fetcher.store.contains(&((INODE, VERSION, 0), 0)));
    });
}

/// A client's warm (`CacheBlocks`): every block whose grant holds is cached whole with the
/// source's bytes; a block of another file under the caller's grant for this one, or one
/// without a grant, is refused and fetches nothing, and the others are cached all the
/// same; a request of too many blocks is refused whole, and a node needs grants too where
/// they are signed.
#[test]
fn a_warm_request_caches_only_the_blocks_its_grants_cover() {
    let src = source();
    runtime().block_on(async {
        let r = rig().await;
        let block = |inode: u64, index: u32| {
            let mut d = r.honest.clone();
            let id = d.id.as_mut().unwrap();
            id.inode = inode;
            id.index = index;
            d
        };
        let ask = |inode, index, grant: Option<&pb::ReadGrant>| pb::CacheBlock {
            block: Some(block(inode, index)),
            grant: grant.cloned(),
        };
        let g = Some(&r.grant);
        let asked = vec![
            ask(INODE, 0, g),
            ask(INODE, 1, g),
            ask(INODE + 1, 2, g),
            ask(INODE, 3, None),
        ];
        let results = results_of(warm(&r, asked, false)).await.unwrap();
        assert_eq!(results.len(), 4, "{results:?}");
        for res in &results {
            let id = res.block.unwrap();
            if id.inode == INODE && id.index < 2 {
                assert!(res.error.is_empty(), "{res:?}");
                assert_eq!(res.fetched_bytes, BS, "{res:?}");
            } else {
                assert_eq!(res.code, pb::LoadError::Denied as i32, "{res:?}");
                assert!(res.error.contains("grant"), "{res:?}");
                assert_eq!(res.fetched_bytes, 0, "{res:?}");
            }
        }
        let store = &r.rpc.fetcher.store;
        for (inode, index) in [(INODE, 0), (INODE, 1), (INODE + 1, 2), (INODE, 3)] {
            for page in 0..(BS / PS) as u32 {
                let cached = store.contains(&((inode, VERSION, index), page));
                assert_eq!(
                    cached,
                    inode == INODE && index < 2,
                    "block {inode}/{index} page {page}"
                );
            }
        }
        cached_pages_are_the_source(&r, &src).unwrap();
        assert_eq!(r.rpc.metrics.cache_blocks_asked.get(), 4);

        // Asked again: already cached, nothing fetched.
        let results = results_of(warm(&r, vec![ask(INODE, 0, g)], false))
            .await
            .unwrap();
        let res = &results[0];
        assert!(res.error.is_empty() && res.fetched_bytes == 0, "{res:?}");

        // Past the most a stream may ask for: the stream ends INVALID_ARGUMENT, and the
        // blocks after the limit are neither counted nor fetched.
        let mut many = vec![ask(INODE, 0, g); MAX_CACHE_BLOCKS];
        many.push(ask(INODE, 3, g));
        let e = results_of(warm(&r, many, false)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("at most 128"), "{e:?}");
        assert!(!store.contains(&((INODE, VERSION, 3), 0)));

        // A node's warm without a grant fills nothing where grants are signed.
        let results = results_of(warm(&r, vec![ask(INODE, 3, None)], true))
            .await
            .unwrap();
        let res = &results[0];
        assert_eq!(res.code, pb::LoadError::Denied as i32, "{res:?}");
        assert!(!store.contains(&((INODE, VERSION, 3), 0)));
        assert_eq!(
            r.rpc.metrics.cache_blocks_asked.get(),
            4 + 1 + MAX_CACHE_BLOCKS as u64 + 1
        );
    });
}

/// A node's descriptor with another block size caches a short last page for block 0; an
/// honest reader of that page's end gets the source's byte (the short page is dropped and
/// fetched again), not a panic or a short answer.
#[test]
fn a_page_cached_short_is_dropped_not_sliced() {
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let src = source();
    runtime().block_on(async {
        let r = rig_with(false).await;
        let short = Op {
            tampers: vec![Tamper::BlockSize(BS - 100)],
            index: 0,
            offset: 3 * PS,
            length: PS - 100,
            cache: true,
            cached_only: false,
            from_peers: false,
            lease: None,
            cache_blocks: false,
        };
        let (got, end) = run(&r, &short, true).await;
        assert!(end.is_ok(), "{end:?}");
        assert_eq!(
            got.iter().map(|(_, b)| b.len()).sum::<usize>(),
            (PS - 100) as usize
        );
        let key = ((INODE, VERSION, 0), 3);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !r.rpc.fetcher.store.contains(&key) {
            assert!(
                std::time::Instant::now() < deadline,
                "the short page was never cached"
            );
            tokio::task::yield_now().await;
        }
        for cached_only in [true, false] {
            let honest = Op {
                tampers: Vec::new(),
                index: 0,
                offset: BS - 1,
                length: 1,
                cache: true,
                cached_only,
                from_peers: false,
                lease: None,
                cache_blocks: false,
            };
            let (got, end) = run(&r, &honest, true).await;
            if cached_only {
                // Dropped, not served short.
                assert_eq!(end.unwrap_err().code(), tonic::Code::NotFound);
            } else {
                assert!(end.is_ok(), "{end:?}");
                assert_eq!(got.len(), 1);
                assert_eq!(got[0].1[..], src[(BS - 1) as usize..BS as usize]);
            }
        }
    });
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        before,
        "a worker thread panicked"
    );
}

/// A node copy is filled from other workers only: on a worker no peer can help (here: not
/// registered), a user's `from_peers` read with an honest grant gets NOT_FOUND, and the
/// store is never read nor anything cached. Contradictory flags are refused, and so is
/// every node copy on a worker that keeps none.
#[test]
fn a_node_copy_never_reads_the_store() {
    runtime().block_on(async {
        let r = rig().await;
        let copy = Op {
            from_peers: true,
            ..read_whole(0)
        };
        let (got, end) = run(&r, &copy, false).await;
        let e = end.expect_err("a node copy with no peer was served");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
        assert!(got.is_empty());
        assert_eq!(
            r.rpc.metrics.ufs_requests.get(),
            0,
            "a node copy read the store"
        );
        assert!(!r.rpc.fetcher.store.contains(&((INODE, VERSION, 0), 0)));
        for bad in [
            Op {
                cached_only: true,
                ..copy.clone()
            },
            Op {
                cache: false,
                ..copy.clone()
            },
        ] {
            let (_, end) = run(&r, &bad, false).await;
            let e = end.expect_err("contradictory flags were served");
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        }
        // The same read without `from_peers` fills from the store, as any read.
        let (got, end) = run(
            &r,
            &Op {
                from_peers: false,
                ..copy.clone()
            },
            false,
        )
        .await;
        end.expect("an honest read failed");
        assert_eq!(got.iter().map(|(_, b)| b.len() as u64).sum::<u64>(), BS);
        // A worker that keeps no node copies refuses them all.
        let mut r = rig().await;
        r.rpc.node_copies = false;
        let (_, end) = run(&r, &copy, false).await;
        let e = end.expect_err("a node copy was made on a --locality cluster worker");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert_eq!(r.rpc.metrics.ufs_requests.get(), 0);
    });
}

/// A lease names where its block lies in the file version's cache file; a client that
/// does not say it reads there (an older one, reading pages from the file's start) is
/// leased nothing but first blocks, and the lease it was refused holds no page.
#[test]
fn a_lease_names_its_blocks_offset_and_older_clients_get_first_blocks_only() {
    use std::os::unix::fs::FileExt;
    let src = source();
    runtime().block_on(async {
        let r = rig().await;
        for index in [0, 1] {
            cache_whole(&r, index).await;
        }
        let store = &r.rpc.fetcher.store;
        let lease = |index: u32, reads_block_offset: bool| {
            let req = pb::LeaseLocalBlockRequest {
                block: Some(pb::BlockId {
                    inode: INODE,
                    version: VERSION,
                    index,
                }),
                whole_block: true,
                grants: vec![r.grant.clone()],
                reads_block_offset,
                ..Default::default()
            };
            r.rpc.lease_local_block(as_who(req, false))
        };
        let old = lease(1, false).await.unwrap_err();
        assert_eq!(old.code(), tonic::Code::NotFound, "{old:?}");
        assert_eq!(store.lease_stats(), (0, 0), "a refused lease holds pages");
        let first = lease(0, false).await.unwrap().into_inner();
        assert_eq!((first.block_offset, first.pages.len()), (0, 4));
        let second = lease(1, true).await.unwrap().into_inner();
        assert_eq!((second.block_offset, second.pages.len()), (BS, 4));
        assert_eq!(second.path, first.path, "one cache file per file version");
        // The cache file holds block 1 where the file does.
        let mut got = vec![0u8; BS as usize];
        std::fs::File::open(&second.path)
            .unwrap()
            .read_exact_at(&mut got, second.block_offset)
            .unwrap();
        assert_eq!(got, src[BS as usize..2 * BS as usize]);
    });
}

/// A grant for one version of a file leases none of another version's cached pages (the
/// file's earlier contents may have been written where the caller could not read them),
/// neither as the block asked for nor among the `more` blocks.
#[test]
fn a_lease_needs_a_grant_for_the_version_it_names() {
    runtime().block_on(async {
        let r = rig().await;
        cache_whole(&r, 0).await;
        let store = &r.rpc.fetcher.store;
        // A page of another version of the file, cached.
        let other = VERSION + 1;
        let key = ((INODE, other, 0), 0);
        let room = store.reserve(&key, PS).expect("room for a page");
        store.commit(room, key, BS, &[7u8; PS as usize]).unwrap();
        let id = |version| pb::BlockId {
            inode: INODE,
            version,
            index: 0,
        };
        let lease = |block: pb::BlockId, more: Vec<pb::BlockId>| {
            let req = pb::LeaseLocalBlockRequest {
                block: Some(block),
                more,
                grants: vec![r.grant.clone()],
                reads_block_offset: true,
                ..Default::default()
            };
            r.rpc.lease_local_block(as_who(req, false))
        };
        let e = lease(id(other), Vec::new()).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("version"), "{e:?}");
        assert_eq!(store.lease_stats(), (0, 0), "a refused lease holds pages");
        let granted = lease(id(VERSION), vec![id(other)])
            .await
            .unwrap()
            .into_inner();
        assert_eq!(granted.pages.len(), 4, "{granted:?}");
        assert!(granted.more.is_empty(), "{:?}", granted.more);
    });
}

/// A `CacheBlocks` block waits for its share of the worker's bytes in flight before it
/// starts; a caller that goes away meanwhile starts nothing; a cached block gives its
/// share back.
#[test]
fn a_warm_waits_for_its_share_of_the_worker_and_a_caller_gone_starts_nothing() {
    runtime().block_on(async {
        let r = rig().await;
        let slots = r.rpc.fetcher.cache_slots.clone();
        let held = slots
            .clone()
            .acquire_many_owned(CACHE_BLOCK_PERMITS)
            .await
            .unwrap();
        let who = as_who((), false)
            .extensions()
            .get::<Arc<Principal>>()
            .cloned()
            .unwrap();
        let asked = pb::CacheBlock {
            block: Some(r.honest.clone()),
            grant: Some(r.grant.clone()),
        };
        let idle = Arc::strong_count(&r.rpc.fetcher);
        // The caller keeps its request stream open (a warm still asking).
        let answer = r.rpc.cache_stream(
            who.clone(),
            futures::stream::iter([Ok(asked.clone())]).chain(futures::stream::pending()),
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while r.rpc.metrics.cache_blocks_asked.get() < 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the block was never taken"
            );
            tokio::task::yield_now().await;
        }
        // Gone while its block waits: the stream's task ends without starting it.
        drop(answer);
        while Arc::strong_count(&r.rpc.fetcher) > idle {
            assert!(
                std::time::Instant::now() < deadline,
                "the stream's task did not end when its caller went away"
            );
            tokio::task::yield_now().await;
        }
        drop(held);
        let store = &r.rpc.fetcher.store;
        assert!(
            (0..4).all(|p| !store.contains(&((INODE, VERSION, 0), p))),
            "a block was fetched for a caller that had gone"
        );
        assert_eq!(slots.available_permits(), CACHE_BLOCK_PERMITS as usize);
        // With room, the same block is cached, and its share comes back.
        let results = results_of(warm(&r, vec![asked], false)).await.unwrap();
        assert!(results[0].error.is_empty(), "{results:?}");
        assert_eq!(results[0].fetched_bytes, BS);
        assert_eq!(slots.available_permits(), CACHE_BLOCK_PERMITS as usize);
    });
}

/// A stream that, like TLS, keeps what is written until it is flushed: what the peer can
/// read is `shown`.
struct HeldUntilFlush {
    input: std::io::Cursor<Vec<u8>>,
    pending: Vec<u8>,
    shown: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl tokio::io::AsyncRead for HeldUntilFlush {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.input).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for HeldUntilFlush {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.pending.extend_from_slice(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let held = std::mem::take(&mut self.pending);
        self.shown.lock().unwrap().extend_from_slice(&held);
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.poll_flush(cx)
    }
}

impl crate::dataplane::Wire for HeldUntilFlush {
    async fn send_file(
        &mut self,
        file: &std::fs::File,
        offset: u64,
        len: usize,
    ) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, offset)?;
        self.pending.extend_from_slice(&buf);
        Ok(())
    }
}

/// Every data plane answer reaches the caller whole, also over a stream that holds what it
/// is given until flushed (TLS): a TLS worker once kept an answer's end in its buffer and
/// the reader waited out its deadline. Two requests, one uncached and one cached: both
/// answers, exact and ended, are visible when the worker waits for the next request.
#[test]
fn data_plane_answers_are_flushed_to_their_end() {
    use granary_proto::prost::Message;
    let src = source();
    runtime().block_on(async {
        let r = rig().await;
        let req = pb::ReadBlockRequest {
            block: Some(r.honest.clone()),
            offset: 0,
            length: BS,
            cache: true,
            grant: Some(r.grant.clone()),
            ..Default::default()
        };
        let mut input = Vec::new();
        for _ in 0..2 {
            input.extend_from_slice(&(req.encoded_len() as u32).to_be_bytes());
            req.encode(&mut input).unwrap();
        }
        let shown = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stream = HeldUntilFlush {
            input: std::io::Cursor::new(input),
            pending: Vec::new(),
            shown: shown.clone(),
        };
        let who = Principal::new("alice", &[Role::User], None);
        crate::dataplane::connection(stream, &r.rpc, who)
            .await
            .unwrap();
        let shown = shown.lock().unwrap().clone();
        let mut at = &shown[..];
        for answer in 0..2 {
            let mut got = Vec::new();
            loop {
                assert!(at.len() >= 4, "answer {answer} was not flushed to its end");
                let n = u32::from_be_bytes(at[..4].try_into().unwrap()) as usize;
                let f = pb::DataFrame::decode(&at[4..4 + n]).unwrap();
                at = &at[4 + n..];
                if f.end {
                    assert_eq!(f.code, 0, "{}", f.message);
                    break;
                }
                let data = &at[..f.length as usize];
                assert_eq!(crc32c::crc32c(data), f.crc32c);
                got.extend_from_slice(data);
                at = &at[f.length as usize..];
            }
            assert_eq!(got, src[..BS as usize], "answer {answer}");
        }
    });
}

/// A data plane serves so many connections at once and closes the next one at once (its
/// client reads over gRPC): callers holding connections idle cannot make the worker hold
/// a task and pages for each of as many as they like.
#[test]
fn a_data_plane_closes_connections_past_its_limit_at_once() {
    use tokio::io::AsyncReadExt;
    runtime().block_on(async {
        let r = rig_with(false).await;
        let metrics = r.rpc.metrics.clone();
        let rpc = Arc::new(r.rpc);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(crate::dataplane::serve_at_most(
            listener,
            rpc,
            None,
            stop.clone(),
            4,
        ));
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let mut past = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut b = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), past.read(&mut b))
            .await
            .expect("a connection past the limit was kept open");
        assert!(matches!(read, Ok(0)) || read.is_err(), "{read:?}");
        assert_eq!(metrics.data_plane_refused.get(), 1);
        stop.cancel();
    });
}

/// Readers that never take what they asked for hold at most their caller's share of the
/// worker's read budget: another caller still reads, and all of it comes back once they
/// go away.
#[test]
fn readers_that_never_read_hold_at_most_their_callers_share() {
    use crate::ufs_fetch::{READ_BLOCK_PERMITS, READ_BLOCK_PERMITS_PER_CALLER};
    runtime().block_on(async {
        let r = rig().await;
        let slots = r.rpc.fetcher.read_slots.clone();
        let (total, share) = (
            READ_BLOCK_PERMITS as usize,
            READ_BLOCK_PERMITS_PER_CALLER as usize,
        );
        let ask = |bob: bool| {
            let mut req = Request::new(pb::ReadBlockRequest {
                block: Some(r.honest.clone()),
                offset: 0,
                length: BS,
                cache: true,
                grant: Some(if bob { &r.bob } else { &r.grant }.clone()),
                ..Default::default()
            });
            let name = if bob { "bob" } else { "alice" };
            let who = Principal::new(name, &[Role::User], None);
            req.extensions_mut().insert(Arc::new(who));
            r.rpc.read_block(req)
        };
        // 100 streams of alice's, 4 pages each (400 permits of 4 KiB pages), none read.
        let mut idle = Vec::new();
        for _ in 0..100 {
            idle.push(ask(false).await.unwrap().into_inner());
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while slots.available_permits() > total - share {
            assert!(
                std::time::Instant::now() < deadline,
                "the readers took no room"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(slots.available_permits(), total - share);
        // Another caller reads the whole block meanwhile.
        let mut other = ask(true).await.unwrap().into_inner();
        let mut got = 0;
        while let Some(m) = tokio::time::timeout(Duration::from_secs(20), other.next())
            .await
            .expect("another caller's read waited for alice's")
        {
            got += m.unwrap().data.len() as u64;
        }
        assert_eq!(got, BS);
        drop(idle);
        while slots.available_permits() < total {
            assert!(
                std::time::Instant::now() < deadline,
                "room held by readers that went away"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
}
