//! The fill path against an in-memory object store: parts, single flight, read-ahead and
//! version checks, counted by the fetcher's own request metrics.

use super::*;
use crate::store::{PageStore, TieredStore};
use futures::TryStreamExt;
use object_store::memory::InMemory;
use object_store::path::Path as StorePath;
use object_store::{ObjectStoreExt, PutPayload};

const PS: u64 = 4096;

struct Rig {
    _dir: tempfile::TempDir,
    fetcher: Arc<Fetcher>,
    store: Arc<InMemory>,
    metrics: WorkerMetrics,
}

/// A fetcher over an in-memory store with `object` at "f", parts of `part_pages` pages and
/// `concurrency` parts of read-ahead.
async fn rig(object: &[u8], part_pages: u64, concurrency: usize) -> Rig {
    rig_with(object, part_pages, concurrency, "127.0.0.1:1", 0).await
}

/// [`rig`] with the fetcher's master address and worker id (0: an unregistered worker,
/// which never looks for peers).
async fn rig_with(
    object: &[u8],
    part_pages: u64,
    concurrency: usize,
    master: &str,
    worker_id: u64,
) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let metrics = WorkerMetrics::default();
    let pages = PageStore::open(
        dir.path(),
        1 << 30,
        PS,
        crate::evict::PolicyKind::default(),
        metrics.clone(),
    )
    .unwrap();
    let store = Arc::new(InMemory::new());
    store
        .put(&StorePath::from("f"), PutPayload::from(object.to_vec()))
        .await
        .unwrap();
    let fetcher = Arc::new(
        Fetcher::new(
            MasterClient::new(granary_common::net::Tcp::plain(), master).unwrap(),
            TieredStore::single(pages),
            metrics.clone(),
        )
        .with_worker_id(worker_id),
    );
    fetcher.stores.insert(
        1,
        Ufs {
            store: store.clone(),
            pager: None,
            prefix: StorePath::default(),
            part_size: part_pages * PS,
            part_concurrency: concurrency,
            local: None,
        },
    );
    Rig {
        _dir: dir,
        fetcher,
        store,
        metrics,
    }
}

async fn fingerprint<S: object_store::ObjectStore>(store: &S) -> pb::Fingerprint {
    let meta = store.head(&StorePath::from("f")).await.unwrap();
    pb::Fingerprint {
        etag: meta.e_tag.unwrap_or_default(),
        size: meta.size,
        mtime_ms: meta.last_modified.timestamp_millis(),
        ..Default::default()
    }
}

async fn block(r: &Rig, len: u64) -> Arc<BlockRef> {
    block_of_f(0, 0, len, len, fingerprint(r.store.as_ref()).await)
}

/// Block `index` of object "f" of inode 5 (`block_size` bytes per block), `len` bytes from
/// byte `start`.
fn block_of_f(
    index: u32,
    start: u64,
    len: u64,
    block_size: u64,
    fingerprint: pb::Fingerprint,
) -> Arc<BlockRef> {
    Arc::new(BlockRef {
        desc: pb::BlockDescriptor {
            id: Some(pb::BlockId {
                inode: 5,
                version: 1,
                index,
            }),
            ufs: Some(pb::UfsLocation {
                mount_id: 1,
                path: "f".into(),
            }),
            fingerprint: Some(fingerprint),
            file_length: start + len,
            block_size,
        },
        key: (5, 1, index),
        start,
        len,
        holders: None,
        peers_only: false,
    })
}

fn object(pages: u64) -> Vec<u8> {
    (0..pages * PS - 100).map(|i| (i % 251) as u8).collect()
}

async fn wait_idle(f: &Fetcher) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lock(&f.inflight).is_empty() {
        assert!(Instant::now() < deadline, "fetches still in flight");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miss_fetches_its_part_with_one_get_and_every_page_is_right() {
    let data = object(8);
    let r = rig(&data, 4, 1).await;
    let b = block(&r, data.len() as u64).await;
    // Page 1 is in part 0 (pages 0..=3): one GET of pages 1..=3.
    let (p1, src) = r.fetcher.page(&b, 1, true).await.unwrap();
    assert_eq!(src, Source::UnderStore);
    assert_eq!(&p1[..], &data[PS as usize..2 * PS as usize]);
    wait_idle(&r.fetcher).await;
    assert_eq!(r.metrics.ufs_requests.get(), 1);
    for page in 2..=3 {
        let (bytes, src) = r.fetcher.page(&b, page, true).await.unwrap();
        assert_eq!(src, Source::Cache, "page {page}");
        let at = (page * PS) as usize;
        assert_eq!(&bytes[..], &data[at..at + PS as usize]);
    }
    // Page 0 was before the miss: fetched on its own. The last, short page too.
    r.fetcher.page(&b, 0, true).await.unwrap();
    let (last, _) = r.fetcher.page(&b, 7, true).await.unwrap();
    assert_eq!(&last[..], &data[7 * PS as usize..]);
    assert_eq!(r.metrics.ufs_requests.get(), 3);
    assert_eq!(r.metrics.ufs_read_bytes.get(), data.len() as u64 - 3 * PS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_readers_of_a_page_share_one_get() {
    let data = object(4);
    let r = rig(&data, 4, 1).await;
    let b = block(&r, data.len() as u64).await;
    let reads = (0..16).map(|i| {
        let f = r.fetcher.clone();
        let b = b.clone();
        tokio::spawn(async move { f.page(&b, i % 4, true).await.map(|x| x.0) })
    });
    for (i, h) in reads.enumerate() {
        let page = (i % 4) as u64;
        let bytes = h.await.unwrap().unwrap();
        let at = (page * PS) as usize;
        assert_eq!(&bytes[..], &data[at..(at + PS as usize).min(data.len())]);
    }
    wait_idle(&r.fetcher).await;
    // However the reads interleave, every page came from the store once.
    assert_eq!(r.metrics.ufs_read_bytes.get(), data.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_ahead_keeps_parts_in_flight_and_pages_are_fetched_once() {
    let data = object(64);
    let r = rig(&data, 4, 3).await;
    let b = block(&r, data.len() as u64).await;
    assert!(r.fetcher.sequential(&b, 0, PS));
    r.fetcher.read_ahead(&b, 0);
    r.fetcher.page(&b, 0, true).await.unwrap();
    wait_idle(&r.fetcher).await;
    // Read-ahead claims pages 1..=12 (3 parts of 4 pages): page 1..=3, 4..=7, 8..=11, 12.
    for page in 1..=12 {
        assert!(r.fetcher.store.contains(&(b.key, page)), "page {page}");
    }
    assert!(!r.fetcher.store.contains(&(b.key, 13)));
    // A reader that does not continue the last read gets no read-ahead.
    assert!(!r.fetcher.sequential(&b, 40 * PS, 41 * PS));
    assert!(r.fetcher.sequential(&b, 41 * PS, 42 * PS));
    let fetched = r.metrics.ufs_read_bytes.get();
    assert_eq!(fetched, 13 * PS);
    for page in 0..=12 {
        let (_, src) = r.fetcher.page(&b, page, true).await.unwrap();
        assert_eq!(src, Source::Cache);
    }
    assert_eq!(r.metrics.ufs_read_bytes.get(), fetched);
}

/// Readers of pages 0..4 of `b` at once all fail as changed, and nothing is cached.
async fn every_reader_sees_it_changed(r: &Rig, b: &Arc<BlockRef>) {
    let reads: Vec<_> = (0..4)
        .map(|page| {
            let f = r.fetcher.clone();
            let b = b.clone();
            tokio::spawn(async move { f.page(&b, page, true).await })
        })
        .collect();
    for h in reads {
        let e = h.await.unwrap().unwrap_err();
        assert!(matches!(e, FetchError::Changed(_)), "{e}");
    }
    wait_idle(&r.fetcher).await;
    assert_eq!(
        r.fetcher.store.page_count(),
        0,
        "no page of either version cached"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_object_fails_every_waiter_and_leaves_nothing_in_flight() {
    let data = object(8);
    let r = rig(&data, 8, 1).await;
    let b = block(&r, data.len() as u64).await;
    // Same size, other bytes: a new version under the same name.
    let other: Vec<u8> = data.iter().map(|x| x.wrapping_add(1)).collect();
    r.store
        .put(&StorePath::from("f"), PutPayload::from(other))
        .await
        .unwrap();
    every_reader_sees_it_changed(&r, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_object_is_not_found() {
    let data = object(2);
    let r = rig(&data, 2, 1).await;
    let b = block(&r, data.len() as u64).await;
    r.store.delete(&StorePath::from("f")).await.unwrap();
    let e = r.fetcher.page(&b, 0, true).await.unwrap_err();
    assert!(matches!(e, FetchError::NotFound(_)), "{e}");
    wait_idle(&r.fetcher).await;
}

/// A store whose next GET body breaks off after `cut` bytes (a dropped connection).
#[derive(Debug)]
struct BreaksOnce {
    inner: Arc<InMemory>,
    cut: Mutex<Option<usize>>,
}

impl std::fmt::Display for BreaksOnce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BreaksOnce({})", self.inner)
    }
}

#[async_trait::async_trait]
impl object_store::ObjectStore for BreaksOnce {
    async fn put_opts(
        &self,
        location: &StorePath,
        payload: PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &StorePath,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &StorePath,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        let mut got = self.inner.get_opts(location, options).await?;
        let Some(cut) = lock(&self.cut).take() else {
            return Ok(got);
        };
        let object_store::GetResultPayload::Stream(body) = got.payload else {
            unreachable!("the in-memory store streams");
        };
        let bytes: Vec<Bytes> = body.try_collect().await?;
        let all = Bytes::from(bytes.concat());
        let broken = futures::stream::iter([
            Ok(all.slice(..cut)),
            Err(object_store::Error::Generic {
                store: "test",
                source: "connection reset mid-body".into(),
            }),
        ]);
        got.payload = object_store::GetResultPayload::Stream(Box::pin(broken));
        Ok(got)
    }

    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<'static, object_store::Result<StorePath>>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<StorePath>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&StorePath>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&StorePath>,
    ) -> object_store::Result<object_store::ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &StorePath,
        to: &StorePath,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_breaks_off_mid_page_is_resumed_at_the_byte_where_it_stopped() {
    let data = object(8);
    let r = rig(&data, 8, 1).await;
    // The part's GET breaks 1,000 bytes into page 2.
    let cut = 2 * PS as usize + 1000;
    r.fetcher.stores.insert(
        1,
        Ufs {
            store: Arc::new(BreaksOnce {
                inner: r.store.clone(),
                cut: Mutex::new(Some(cut)),
            }),
            pager: None,
            prefix: StorePath::default(),
            part_size: 8 * PS,
            part_concurrency: 1,
            local: None,
        },
    );
    let b = block(&r, data.len() as u64).await;
    let (p0, _) = r.fetcher.page(&b, 0, true).await.unwrap();
    assert_eq!(&p0[..], &data[..PS as usize]);
    wait_idle(&r.fetcher).await;
    for page in 0..8u64 {
        let (bytes, src) = r.fetcher.page(&b, page, true).await.unwrap();
        assert_eq!(src, Source::Cache, "page {page}");
        let at = (page * PS) as usize;
        assert_eq!(
            &bytes[..],
            &data[at..data.len().min(at + PS as usize)],
            "page {page}"
        );
    }
    assert_eq!(
        r.metrics.ufs_requests.get(),
        2,
        "the GET and its resumption"
    );
    assert_eq!(
        r.metrics.ufs_read_bytes.get(),
        data.len() as u64,
        "no byte was fetched twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_store_serves_the_second_block_of_a_file_byte_for_byte() {
    // A folder under-store answers with a local file, which the fetcher reads itself a page
    // at a time; block 1 of the file starts 8 pages in and ends 100 bytes short of a page.
    let data = object(12);
    let r = rig(&[], 8, 1).await;
    let folder = tempfile::tempdir().unwrap();
    std::fs::write(folder.path().join("f"), &data).unwrap();
    let local =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(folder.path()).unwrap());
    r.fetcher.stores.insert(
        1,
        Ufs {
            store: local.clone(),
            pager: None,
            prefix: StorePath::default(),
            part_size: 8 * PS,
            part_concurrency: 1,
            local: None,
        },
    );
    let start = 8 * PS;
    let len = data.len() as u64 - start;
    let b = block_of_f(1, start, len, start, fingerprint(local.as_ref()).await);
    second_block_part_is_read_once(&r, &b, &data).await;
}

/// `b` is block 1 of `data` (from 8 pages in, ending 100 bytes short of a page): a miss of
/// its page 1 reads pages 1..=3 (the rest of its part of 8 pages) with one GET, and each
/// is then a cache hit with the file's bytes.
async fn second_block_part_is_read_once(r: &Rig, b: &Arc<BlockRef>, data: &[u8]) {
    let (start, len) = (b.start, b.len);
    let (p1, src) = r.fetcher.page(b, 1, true).await.unwrap();
    assert_eq!(src, Source::UnderStore);
    let at = (start + PS) as usize;
    assert_eq!(&p1[..], &data[at..at + PS as usize]);
    wait_idle(&r.fetcher).await;
    for page in 1..4u64 {
        let (bytes, src) = r.fetcher.page(b, page, true).await.unwrap();
        assert_eq!(src, Source::Cache, "page {page}");
        let at = (start + page * PS) as usize;
        assert_eq!(
            &bytes[..],
            &data[at..data.len().min(at + PS as usize)],
            "page {page}"
        );
    }
    assert_eq!(r.metrics.ufs_requests.get(), 1, "one GET for pages 1..=3");
    assert_eq!(
        r.metrics.ufs_read_bytes.get(),
        len - PS,
        "each byte read once"
    );
}

/// A fetcher whose mount 1 is the folder `folder` as `granary local` opens it (a
/// [`granary_common::ufs::ConfinedLocal`], read in place), parts of 8 pages; the
/// fingerprint of "f" as its listing records it.
async fn folder_rig(folder: &std::path::Path) -> (Rig, pb::Fingerprint) {
    let r = rig(&[], 8, 1).await;
    let spec = granary_common::ufs::UfsSpec::new(&folder.display().to_string(), Default::default())
        .unwrap();
    let ufs = spec.open().unwrap();
    assert!(ufs.local.is_some(), "a folder is read in place");
    let meta = ufs.store.head(&StorePath::from("f")).await.unwrap();
    let print = pb::Fingerprint {
        etag: meta.e_tag.unwrap_or_default(),
        size: meta.size,
        mtime_ms: meta.last_modified.timestamp_millis(),
        ..Default::default()
    };
    r.fetcher.stores.insert(
        1,
        Ufs {
            part_size: 8 * PS,
            part_concurrency: 1,
            ..ufs
        },
    );
    (r, print)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_read_in_place_serves_and_caches_every_page_of_its_part_once() {
    // Block 1 of the file starts 8 pages in and ends 100 bytes short of a page; a miss of
    // its page 1 reads pages 1..=3 (the rest of its part), each read, handed out and
    // cached by the blocking step that read it.
    let data = object(12);
    let folder = tempfile::tempdir().unwrap();
    std::fs::write(folder.path().join("f"), &data).unwrap();
    let (r, print) = folder_rig(folder.path()).await;
    let start = 8 * PS;
    let len = data.len() as u64 - start;
    let b = block_of_f(1, start, len, start, print);
    second_block_part_is_read_once(&r, &b, &data).await;
    // Page 0, read last, is its own GET; every page is cached once.
    let (p0, _) = r.fetcher.page(&b, 0, true).await.unwrap();
    assert_eq!(&p0[..], &data[start as usize..(start + PS) as usize]);
    wait_idle(&r.fetcher).await;
    assert_eq!(r.fetcher.store.page_count(), 4);
    assert_eq!(r.metrics.ufs_read_bytes.get(), len);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_file_changed_since_its_listing_fails_every_waiter_and_caches_nothing() {
    let data = object(4);
    let folder = tempfile::tempdir().unwrap();
    let path = folder.path().join("f");
    std::fs::write(&path, &data).unwrap();
    let (r, print) = folder_rig(folder.path()).await;
    let b = block_of_f(0, 0, data.len() as u64, 8 * PS, print);
    // Replaced under the same name (another inode, the size of the listed one).
    let other: Vec<u8> = data.iter().map(|x| x.wrapping_add(1)).collect();
    std::fs::write(folder.path().join("g"), &other).unwrap();
    std::fs::rename(folder.path().join("g"), &path).unwrap();
    every_reader_sees_it_changed(&r, &b).await;
    // Gone altogether: not found, and again nothing left in flight.
    std::fs::remove_file(&path).unwrap();
    let e = r.fetcher.page(&b, 0, true).await.unwrap_err();
    assert!(matches!(e, FetchError::NotFound(_)), "{e}");
    wait_idle(&r.fetcher).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_longer_than_its_folder_file_caches_only_the_bytes_the_file_has() {
    // A descriptor (a plaintext cluster's caller may send any) whose block runs two pages
    // past the file's end, with the file's true fingerprint: pages the file fills are
    // served; a page it fills in part or not at all fails as changed, and is not cached.
    let data = object(2);
    let folder = tempfile::tempdir().unwrap();
    std::fs::write(folder.path().join("f"), &data).unwrap();
    let (r, print) = folder_rig(folder.path()).await;
    let b = block_of_f(0, 0, 4 * PS, 8 * PS, print);
    let (p0, _) = r.fetcher.page(&b, 0, true).await.unwrap();
    assert_eq!(&p0[..], &data[..PS as usize]);
    for page in [1, 3] {
        let e = r.fetcher.page(&b, page, true).await.unwrap_err();
        assert!(matches!(e, FetchError::Changed(_)), "page {page}: {e}");
    }
    wait_idle(&r.fetcher).await;
    assert_eq!(
        r.fetcher.store.page_count(),
        1,
        "only the whole page cached"
    );
    assert!(r.fetcher.store.contains(&(b.key, 0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_file_that_is_a_link_leaving_the_folder_is_not_read() {
    let data = object(2);
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), &data).unwrap();
    let folder = tempfile::tempdir().unwrap();
    std::fs::write(folder.path().join("f"), &data).unwrap();
    let (r, print) = folder_rig(folder.path()).await;
    let b = block_of_f(0, 0, data.len() as u64, 8 * PS, print);
    // Swapped for a link to a file of the same bytes outside the folder after the listing.
    std::fs::remove_file(folder.path().join("f")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), folder.path().join("f")).unwrap();
    let e = r.fetcher.page(&b, 0, true).await.unwrap_err();
    assert!(matches!(e, FetchError::NotFound(_)), "{e}");
    wait_idle(&r.fetcher).await;
    assert_eq!(r.fetcher.store.page_count(), 0);
    assert_eq!(r.metrics.ufs_read_bytes.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_told_it_is_alone_asks_no_one_for_peers() {
    // A "master" that takes connections and never answers: a lookup of peers is seen as a
    // connection, and ends at its deadline (the store then serves the page).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let master = listener.local_addr().unwrap().to_string();
    let asked = Arc::new(AtomicUsize::new(0));
    let counter = asked.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            held.push(conn);
        }
    });
    let data = object(2);
    let r = rig_with(&data, 2, 1, &master, 7).await;
    let b = block(&r, data.len() as u64).await;
    let other = |inode: u64, holders: Option<Vec<pb::WorkerAddress>>| {
        let mut desc = b.desc.clone();
        desc.id = Some(pb::BlockId {
            inode,
            version: 1,
            index: 0,
        });
        Arc::new(BlockRef {
            desc,
            key: (inode, 1, 0),
            start: 0,
            len: b.len,
            holders,
            peers_only: false,
        })
    };
    r.fetcher.note_workers(1);
    let (p0, src) = r.fetcher.page(&b, 0, true).await.unwrap();
    assert_eq!(src, Source::UnderStore);
    assert_eq!(&p0[..], &data[..PS as usize]);
    assert_eq!(
        asked.load(Ordering::SeqCst),
        0,
        "the only worker asked for peers"
    );
    // Told of another worker: the next fill asks first.
    r.fetcher.note_workers(2);
    let (p0, _) = r.fetcher.page(&other(6, None), 0, true).await.unwrap();
    assert_eq!(&p0[..], &data[..PS as usize]);
    assert!(asked.load(Ordering::SeqCst) >= 1, "no lookup of peers");
    // Holders named by a load task are used as they are, alone or not.
    r.fetcher.note_workers(0);
    let before = asked.load(Ordering::SeqCst);
    r.fetcher
        .page(&other(8, Some(Vec::new())), 0, true)
        .await
        .unwrap();
    assert_eq!(
        asked.load(Ordering::SeqCst),
        before,
        "asked despite known holders"
    );
}
