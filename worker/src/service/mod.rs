//! The worker's gRPC service: streaming block reads and cache info.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use granary_proto as pb;
use granary_proto::worker_service_server::WorkerService;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use granary_common::authz::principal;
use granary_common::grant::{GrantKeys, Terms};
use granary_common::tls::{Principal, Role};

use crate::error::RpcError;
use crate::metrics::WorkerMetrics;
use crate::store::block_key;
use crate::ufs_fetch::{BlockRef, FetchError, Fetcher, Source, CACHE_BLOCK_PERMITS};

/// Largest single read request (one block at the default block size).
pub const MAX_READ_LENGTH: u64 = 256 * 1024 * 1024;
/// Pages of one request fetched concurrently on a miss.
const PAGE_PARALLELISM: usize = 4;
/// Blocks one `LoadBlocks` task may carry.
const MAX_LOAD_BLOCKS: usize = 256;
/// Blocks of one load task fetched at once.
const LOAD_PARALLELISM: usize = 8;
/// Blocks one `CacheBlocks` stream may ask for (a client's warm asks for 65 at most).
pub const MAX_CACHE_BLOCKS: usize = 128;
/// Blocks of one `CacheBlocks` stream fetched at once: what a client's warm keeps in
/// flight (a store's round trip, not the bytes, sets a small file's pace).
const CACHE_PARALLELISM: usize = 16;

/// Where a described block lies in its file: (first byte, length). Refuses, as
/// INVALID_ARGUMENT, a descriptor without an id or an under-store location, with a block
/// size of 0 or above [`granary_common::MAX_BLOCK_SIZE`], a file length above
/// [`granary_common::MAX_FILE_LENGTH`], or a block index past the end of the file. Whether
/// the geometry is the file's is the grant's to say ([`check_grant`]); nodes (masters'
/// load tasks, peers) are trusted with it, but not with its shape.
pub(crate) fn block_extent(desc: &pb::BlockDescriptor) -> Result<(u64, u64), RpcError> {
    let id = desc
        .id
        .as_ref()
        .ok_or_else(|| RpcError::Invalid("the block id is missing".into()))?;
    if desc.ufs.is_none() {
        return Err(RpcError::Invalid(
            "the block has no under-store location".into(),
        ));
    }
    let bs = desc.block_size;
    if bs == 0 || bs > granary_common::MAX_BLOCK_SIZE {
        return Err(RpcError::Invalid(format!(
            "block size {bs} must be between 1 and {} bytes",
            granary_common::MAX_BLOCK_SIZE
        )));
    }
    if desc.file_length > granary_common::MAX_FILE_LENGTH {
        return Err(RpcError::Invalid(format!(
            "file length {} is above the largest a file may have ({} bytes)",
            desc.file_length,
            granary_common::MAX_FILE_LENGTH
        )));
    }
    let blocks = desc.file_length.div_ceil(bs);
    if u64::from(id.index) >= blocks {
        return Err(RpcError::Invalid(format!(
            "block {} is past the end of the file ({blocks} blocks of {bs} bytes in {})",
            id.index, desc.file_length
        )));
    }
    // index < blocks <= file_length / bs + 1: no overflow, and start < file_length.
    let start = u64::from(id.index) * bs;
    Ok((start, bs.min(desc.file_length - start)))
}

/// Caches every page of one block (a load task): pages already cached cost nothing, the
/// others are fetched as a read would fetch them (from a peer holding them, else the
/// under-store, in parts). Returns the bytes of the pages that were not cached, or why the block is not all cached.
async fn load_block(
    fetcher: &Arc<Fetcher>,
    desc: pb::BlockDescriptor,
    holders: Option<Vec<pb::WorkerAddress>>,
) -> Result<u64, (pb::LoadError, String)> {
    let (start, len) = block_extent(&desc).map_err(|e| (pb::LoadError::Invalid, e.to_string()))?;
    let block = Arc::new(BlockRef {
        len,
        start,
        key: block_key(&desc.id.unwrap_or_default()),
        desc,
        holders,
        peers_only: false,
    });
    let ps = fetcher.store.page_size();
    let pages = block.len.div_ceil(ps);
    let missing: Vec<u64> = (0..pages)
        .filter(|&p| !fetcher.store.contains(&(block.key, p as u32)))
        .collect();
    if !missing.is_empty() && fetcher.sequential(&block, missing[0] * ps, block.len) {
        fetcher.read_ahead(&block, missing[0]);
    }
    let mut fetched = 0u64;
    let mut results = futures::stream::iter(missing)
        .map(|p| {
            let block = &block;
            async move { (p, fetcher.page(block, p, true).await) }
        })
        .buffered(PAGE_PARALLELISM);
    while let Some((p, r)) = results.next().await {
        match r {
            Ok((data, _)) => {
                // Not cached when the task looked: fetched by it (or by a reader meanwhile).
                fetched += data.len() as u64;
                if !fetcher.cached_after_fetch(&(block.key, p as u32)).await {
                    return Err((pb::LoadError::Unavailable, format!(
                        "page {p} was fetched but not cached (the cache is full of pinned or leased pages, or refused it)"
                    )));
                }
            }
            Err(e) => {
                let code = match &e {
                    FetchError::NotFound(_) => pb::LoadError::NotFound,
                    FetchError::Changed(_) => pb::LoadError::Changed,
                    FetchError::PermissionDenied(_) => pb::LoadError::Denied,
                    FetchError::Unavailable(_) | FetchError::NoPeer(_) => {
                        pb::LoadError::Unavailable
                    }
                };
                return Err((code, e.to_string()));
            }
        }
    }
    Ok(fetched)
}
/// One block of a client's `CacheBlocks`, admitted: its descriptor's shape and its grant
/// checked as a read's that fills the cache (the caller, the file, the under-store object
/// and the descriptor's terms), and the worker's [`CACHE_BLOCK_PERMITS`] it holds while it
/// is cached (one per started MiB of the block, at most all of them). A refused block
/// fetches nothing and takes no share.
fn admit_cache_block(
    keys: &GrantKeys,
    who: &Principal,
    b: pb::CacheBlock,
) -> Result<(pb::BlockDescriptor, u32), (pb::LoadError, String)> {
    let desc = b.block.ok_or_else(|| {
        (
            pb::LoadError::Invalid,
            "the block descriptor is missing".to_string(),
        )
    })?;
    let (_, len) = block_extent(&desc).map_err(|e| (pb::LoadError::Invalid, e.to_string()))?;
    check_read_grant(keys, who, b.grant.as_ref(), &desc, true)
        .map_err(|e| (pb::LoadError::Denied, e.to_string()))?;
    let permits = len
        .div_ceil(1 << 20)
        .clamp(1, u64::from(CACHE_BLOCK_PERMITS)) as u32;
    Ok((desc, permits))
}

/// A load's outcome for one block, as the worker answers it.
fn load_result(id: pb::BlockId, r: Result<u64, (pb::LoadError, String)>) -> pb::LoadResult {
    let (code, error, fetched_bytes) = match r {
        Ok(n) => (pb::LoadError::Unspecified, String::new(), n),
        Err((code, e)) => (code, e, 0),
    };
    pb::LoadResult {
        block: Some(id),
        error,
        fetched_bytes,
        code: code as i32,
    }
}

/// The result of a block whose task ended without one (it panicked).
fn lost(id: pb::BlockId, e: &tokio::task::JoinError) -> pb::LoadResult {
    load_result(
        id,
        Err((
            pb::LoadError::Unavailable,
            format!("the block's task failed: {e}"),
        )),
    )
}

type CacheStream = Pin<Box<dyn Stream<Item = Result<pb::LoadResult, Status>> + Send>>;

/// How long a short-circuit lease holds a block's pages.
pub const LEASE_DURATION: std::time::Duration = std::time::Duration::from_secs(5);
/// Extra blocks one lease request may ask for (`more`).
const MAX_MORE_LEASES: usize = 64;
/// Leases one request may release (`release_leases`).
const MAX_RELEASED: usize = 4096;
/// Longest lease a client may ask for (`hold_ms`).
pub const MAX_LEASE_DURATION: std::time::Duration = std::time::Duration::from_secs(60);

pub struct WorkerRpc {
    pub worker_id: u64,
    pub fetcher: Arc<Fetcher>,
    pub metrics: WorkerMetrics,
    pub writes: Arc<crate::writes::Writes>,
    /// The leaders' grant keys (from registration and heartbeats).
    pub grant_keys: Arc<GrantKeys>,
    /// Whether node copies are kept (`from_peers` reads; `--locality node`).
    pub node_copies: bool,
}

/// How long a write stream may take to send its header.
const HEADER_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a peer's cached-only read waits for a page this worker is fetching.
const ARRIVING_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Refuses a request of a non-node principal without a grant for `want` (nodes, and
/// everyone on a plaintext cluster, need none): the grant must name the caller, the file,
/// the under-store object and the terms (a read's descriptor: version, block size, file
/// length, fingerprint; a write's version and block size).
fn check_grant(
    keys: &GrantKeys,
    who: &Principal,
    grant: Option<&pb::ReadGrant>,
    inode: u64,
    ufs: Option<&pb::UfsLocation>,
    terms: Terms,
    fills: bool,
) -> Result<(), RpcError> {
    // A node's request without a grant: another worker reading cached pages only, a
    // lease, or any request of a cluster whose masters sign no grants (plaintext). One
    // that may fill the cache or write needs a grant like anyone's, and a grant a node
    // shows is checked like anyone's: a node's descriptor cannot put other bytes under a
    // block's name either.
    if who.has(Role::Node) && grant.is_none() {
        if !fills || !keys.signed() {
            return Ok(());
        }
        return Err(RpcError::GrantRefused(format!(
            "no read grant for file {inode}: a node's request that may fill the cache or write needs one too (ask the master for the file's status first)"
        )));
    }
    let want = granary_common::grant::Use {
        principal: &who.name,
        inode,
        ufs,
        terms,
    };
    keys.check(grant, &want, granary_common::now_ms().max(0) as u64)
        .map_err(RpcError::GrantRefused)
}

/// [`check_grant`] for reading the block `desc` describes (its file, its under-store
/// object, its terms); `fills`: the read may fill the cache.
fn check_read_grant(
    keys: &GrantKeys,
    who: &Principal,
    grant: Option<&pb::ReadGrant>,
    desc: &pb::BlockDescriptor,
    fills: bool,
) -> Result<(), RpcError> {
    let inode = desc.id.as_ref().map_or(0, |id| id.inode);
    check_grant(
        keys,
        who,
        grant,
        inode,
        desc.ufs.as_ref(),
        Terms::Read(desc),
        fills,
    )
}

type WriteStream = Pin<Box<dyn Stream<Item = Result<pb::WriteFileResponse, Status>> + Send>>;

/// Byte geometry of one read request, validated.
#[derive(Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) block_start: u64,
    pub(crate) block_len: u64,
    pub(crate) offset: u64,
    pub(crate) end: u64,
}

fn plan(r: &pb::ReadBlockRequest) -> Result<(pb::BlockDescriptor, Plan), RpcError> {
    let desc = r
        .block
        .clone()
        .ok_or_else(|| RpcError::Invalid("the block descriptor is missing".into()))?;
    let (block_start, block_len) = block_extent(&desc)?;
    if r.length == 0 || r.length > MAX_READ_LENGTH {
        return Err(RpcError::Invalid(format!(
            "read length {} must be between 1 and {MAX_READ_LENGTH}",
            r.length
        )));
    }
    let end = r
        .offset
        .checked_add(r.length)
        .filter(|e| *e <= block_len)
        .ok_or_else(|| {
            RpcError::OutOfRange(format!(
                "range {}+{} is outside the block ({block_len} bytes)",
                r.offset, r.length
            ))
        })?;
    Ok((
        desc,
        Plan {
            block_start,
            block_len,
            offset: r.offset,
            end,
        },
    ))
}

type ReadStream = Pin<Box<dyn Stream<Item = Result<pb::ReadBlockResponse, Status>> + Send>>;

/// The part of page `page` (its bytes `data`) that the read `p` wants, as (offset in the
/// block, bytes). A page whose length is not the one the block's geometry gives it (a
/// fetch for other geometry joined in a race) is refused as UNAVAILABLE — the reader tries
/// again or elsewhere — and never sliced out of its bounds.
fn piece(
    data: &bytes::Bytes,
    page: u64,
    ps: u64,
    p: Plan,
) -> Result<(u64, bytes::Bytes), RpcError> {
    let page_start = page * ps;
    let want_len = ps.min(p.block_len.saturating_sub(page_start));
    let from = p.offset.max(page_start) - page_start;
    let to = p.end.min(page_start + want_len) - page_start;
    if data.len() as u64 != want_len || from >= to {
        return Err(RpcError::Unavailable(format!(
            "page {page} holds {} bytes where the block has {want_len}",
            data.len()
        )));
    }
    Ok((page_start + from, data.slice(from as usize..to as usize)))
}

impl WorkerRpc {
    /// Checks a read request (its geometry, its flags, the caller's grant) as every path
    /// that serves one does; the descriptor and the byte range it covers.
    /// `CacheBlocks`: the blocks `asked` names, each cached under its grant, answered as
    /// each is done; at most [`CACHE_PARALLELISM`] at once and [`MAX_CACHE_BLOCKS`] in all.
    /// Each block also holds its share of the worker's [`CACHE_BLOCK_PERMITS`] until it is
    /// cached (or failed), whether or not its caller is still there: a block waits for its
    /// share before it starts, so no number of streams, or callers going away and coming
    /// back, makes the worker fetch and hold more at once. A caller that goes away starts
    /// nothing more.
    pub(crate) fn cache_stream<S>(&self, who: Arc<Principal>, mut asked: S) -> CacheStream
    where
        S: Stream<Item = Result<pb::CacheBlock, Status>> + Send + Unpin + 'static,
    {
        let fetcher = self.fetcher.clone();
        let keys = self.grant_keys.clone();
        let metrics = self.metrics.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(CACHE_PARALLELISM);
        tokio::spawn(async move {
            let mut running = futures::stream::FuturesUnordered::new();
            let (mut taken, mut open) = (0usize, true);
            loop {
                if !open && running.is_empty() {
                    return;
                }
                tokio::select! {
                    m = asked.next(), if open && running.len() < CACHE_PARALLELISM => {
                        let Some(Ok(b)) = m else {
                            // The caller is done asking (or its stream broke): what runs is
                            // still answered.
                            open = false;
                            continue;
                        };
                        taken += 1;
                        if taken > MAX_CACHE_BLOCKS {
                            let _ = tx.send(Err(RpcError::Invalid(format!(
                                "a stream may ask for at most {MAX_CACHE_BLOCKS} blocks to be cached"
                            )).into())).await;
                            return;
                        }
                        metrics.cache_blocks_asked.inc();
                        // Checked before it waits for its share: a block refused takes
                        // none (nor the turn of those asking after it).
                        let id = b.block.as_ref().and_then(|d| d.id).unwrap_or_default();
                        let admitted = admit_cache_block(&keys, &who, b);
                        let permit = match &admitted {
                            Err(_) => None,
                            Ok((_, n)) => tokio::select! {
                                p = fetcher.cache_slots.clone().acquire_many_owned(*n) => match p {
                                    Ok(p) => Some(p),
                                    Err(_) => return, // closed: the worker is stopping
                                },
                                // Gone while the block waited for its share: it never starts.
                                _ = tx.closed() => return,
                            },
                        };
                        // A task per block: the fetches' work spreads over the runtime's
                        // threads. It runs to its end even if the caller goes away (its
                        // pages may be half fetched), holding its share until then.
                        let fetcher = fetcher.clone();
                        let task = tokio::spawn(async move {
                            let r = match admitted {
                                Ok((desc, _)) => load_block(&fetcher, desc, None).await,
                                Err(e) => Err(e),
                            };
                            drop(permit);
                            load_result(id, r)
                        });
                        running.push(async move { task.await.unwrap_or_else(|e| lost(id, &e)) });
                    }
                    Some(r) = running.next(), if !running.is_empty() => {
                        if tx.send(Ok(r)).await.is_err() {
                            return; // the caller went away
                        }
                    }
                    // The caller went away: nothing more starts (what runs finishes).
                    _ = tx.closed() => return,
                }
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }

    pub(crate) fn admit_read(
        &self,
        who: &Principal,
        r: &pb::ReadBlockRequest,
    ) -> Result<(pb::BlockDescriptor, Plan), RpcError> {
        let (desc, p) = plan(r)?;
        if r.from_peers && (r.cached_only || !r.cache) {
            return Err(RpcError::Invalid("a node copy (from_peers) caches what it reads: it needs `cache` and excludes `cached_only`".into()));
        }
        if r.from_peers && !self.node_copies {
            return Err(RpcError::Precondition("this worker keeps no node copies of blocks it does not own (--locality cluster): read the block from its owner".into()));
        }
        check_read_grant(
            &self.grant_keys,
            who,
            r.grant.as_ref(),
            &desc,
            !r.cached_only,
        )?;
        Ok((desc, p))
    }

    /// A `cached_only` read (another worker filling its cache): the cached pages of the
    /// range in order, ending with NOT_FOUND at the first page that is not cached.
    fn cached_pages(
        &self,
        block: Arc<BlockRef>,
        pages: std::ops::RangeInclusive<u64>,
        p: Plan,
    ) -> ReadStream {
        let fetcher = self.fetcher.clone();
        let metrics = self.metrics.clone();
        let ps = fetcher.store.page_size();
        let (tx, rx) = tokio::sync::mpsc::channel(PAGE_PARALLELISM);
        tokio::spawn(async move {
            for page in pages {
                let cached = match fetcher.cached_page(&block, page) {
                    Some(data) => Some(data),
                    None => fetcher.arriving_page(&block, page, ARRIVING_WAIT).await,
                };
                let msg: Result<_, Status> = match cached {
                    Some(data) => piece(&data, page, ps, p)
                        .map(|(offset, slice)| {
                            metrics.peer_served_bytes.inc_by(slice.len() as u64);
                            pb::ReadBlockResponse {
                                data: slice,
                                offset,
                                hit: true,
                            }
                        })
                        .map_err(Status::from),
                    None => {
                        Err(RpcError::NotCached(format!("page {page} is not cached here")).into())
                    }
                };
                let failed = msg.is_err();
                if tx.send(msg).await.is_err() || failed {
                    break;
                }
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }
}

#[tonic::async_trait]
impl WorkerService for WorkerRpc {
    type ReadBlockStream = ReadStream;
    type WriteFileStream = WriteStream;

    async fn write_file(
        &self,
        req: Request<tonic::Streaming<pb::WriteFileRequest>>,
    ) -> Result<Response<WriteStream>, Status> {
        let who = principal(&req)?;
        let mut inbound = req.into_inner();
        // A caller that opens streams and never names their file holds nothing for long.
        let first = tokio::time::timeout(HEADER_WAIT, inbound.next())
            .await
            .map_err(|_| RpcError::Invalid("no header within 30 s of the stream's start".into()))?;
        let header = match first {
            Some(Ok(m)) => m
                .header
                .ok_or_else(|| RpcError::Invalid("the first message needs the header".into()))?,
            Some(Err(e)) => {
                return Err(
                    RpcError::Aborted(format!("the client went away: {}", e.message())).into(),
                )
            }
            None => return Err(RpcError::Invalid("an empty write stream".into()).into()),
        };
        check_grant(
            &self.grant_keys,
            &who,
            header.grant.as_ref(),
            header.inode,
            header.ufs.as_ref(),
            Terms::Write {
                version: header.version,
                block_size: header.block_size,
            },
            true,
        )?;
        let slot = self.writes.stream_slot(&who.name)?;
        let recheck = !who.has(Role::Node) || header.grant.is_some();
        if recheck {
            // Only a file the master still has being written at this version (asked
            // again while the stream lasts and at its finish).
            self.writes
                .being_written(header.inode, header.version)
                .await?;
        }
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let writes = self.writes.clone();
        tokio::spawn(async move {
            let _slot = slot;
            writes.receive_as(header, recheck, inbound, tx).await
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn read_block(
        &self,
        req: Request<pb::ReadBlockRequest>,
    ) -> Result<Response<Self::ReadBlockStream>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        let ps = self.fetcher.store.page_size();
        let (desc, p) = self.admit_read(&who, &r)?;
        self.metrics.read_requests.inc();
        let key = block_key(desc.id.as_ref().unwrap_or(&pb::BlockId::default()));
        let block = Arc::new(BlockRef {
            len: p.block_len,
            start: p.block_start,
            key,
            desc,
            holders: None,
            peers_only: r.from_peers,
        });
        let first = p.offset / ps;
        let last = (p.end - 1) / ps;
        let cache = r.cache;
        if r.cached_only {
            return Ok(Response::new(self.cached_pages(block, first..=last, p)));
        }
        // A sequential reader: keep the parts after this read in flight, so it finds them
        // cached or arriving instead of waiting a round trip per part.
        if cache && self.fetcher.sequential(&block, p.offset, p.end) {
            self.fetcher.read_ahead(&block, last);
        }
        let fetcher = self.fetcher.clone();
        let metrics = self.metrics.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(PAGE_PARALLELISM);
        tokio::spawn(async move {
            let block = &block;
            let fetcher = &fetcher;
            let share = &fetcher.read_share(&who.name);
            // Each page holds room of the caller's and the worker's read budget from
            // before it is fetched until it leaves for the connection.
            let mut pages = futures::stream::iter(first..=last)
                .map(|page| async move {
                    let room = fetcher.read_room(share).await;
                    (page, fetcher.page(block, page, cache).await, room)
                })
                .buffered(PAGE_PARALLELISM);
            while let Some((page, res, room)) = pages.next().await {
                let msg = match res {
                    Ok((data, source)) => piece(&data, page, ps, p)
                        .map(|(offset, slice)| {
                            let n = slice.len() as u64;
                            let hit = source == Source::Cache;
                            if hit {
                                metrics.cache_hit_bytes.inc_by(n);
                            } else {
                                metrics.cache_miss_bytes.inc_by(n);
                            }
                            pb::ReadBlockResponse {
                                data: slice,
                                offset,
                                hit,
                            }
                        })
                        .map_err(Status::from),
                    Err(e) => Err(Status::from(e)),
                };
                let failed = msg.is_err();
                if tx.send((msg, room)).await.is_err() || failed {
                    break; // reader went away, or the error was delivered
                }
            }
        });
        let taken = ReceiverStream::new(rx).map(|(msg, _room)| msg);
        Ok(Response::new(Box::pin(taken)))
    }

    async fn load_blocks(
        &self,
        req: Request<pb::LoadBlocksRequest>,
    ) -> Result<Response<pb::LoadBlocksResponse>, Status> {
        let task = req.into_inner();
        let blocks = task.blocks;
        if blocks.len() > MAX_LOAD_BLOCKS {
            return Err(RpcError::Invalid(format!(
                "a load task may carry at most {MAX_LOAD_BLOCKS} blocks, not {}",
                blocks.len()
            ))
            .into());
        }
        let holders: Vec<Option<Vec<pb::WorkerAddress>>> = match task.holders.len() {
            0 => vec![None; blocks.len()],
            n if n == blocks.len() => task
                .holders
                .into_iter()
                .map(|h| h.known.then_some(h.workers))
                .collect(),
            n => {
                return Err(RpcError::Invalid(format!(
                    "a load task names the holders of each of its {} blocks or of none, not of {n}",
                    blocks.len()
                ))
                .into())
            }
        };
        // Pinned files of this task are held from the moment they are cached (only files
        // the task loads: a task cannot pin anything else).
        let files: std::collections::HashSet<u64> = blocks
            .iter()
            .filter_map(|d| d.id.as_ref().map(|b| b.inode))
            .collect();
        let pinned: Vec<u64> = task
            .pinned_inodes
            .iter()
            .copied()
            .filter(|i| files.contains(i))
            .collect();
        if !pinned.is_empty() {
            self.fetcher.store.add_pinned(&pinned);
        }
        let fetcher = self.fetcher.clone();
        let results = futures::stream::iter(blocks.into_iter().zip(holders))
            .map(|(desc, holders)| {
                let fetcher = fetcher.clone();
                async move {
                    let id = desc.id.unwrap_or_default();
                    load_result(id, load_block(&fetcher, desc, holders).await)
                }
            })
            .buffer_unordered(LOAD_PARALLELISM)
            .collect()
            .await;
        Ok(Response::new(pb::LoadBlocksResponse { results }))
    }

    type CacheBlocksStream = CacheStream;

    async fn cache_blocks(
        &self,
        req: Request<tonic::Streaming<pb::CacheBlock>>,
    ) -> Result<Response<CacheStream>, Status> {
        let who = principal(&req)?;
        Ok(Response::new(self.cache_stream(who, req.into_inner())))
    }

    async fn lease_local_block(
        &self,
        req: Request<pb::LeaseLocalBlockRequest>,
    ) -> Result<Response<pb::LeaseLocalBlockResponse>, Status> {
        let who = principal(&req)?;
        let r = req.into_inner();
        // Leases of cached pages name no under-store object: a grant for the file's version
        // will do (each block's own: a grant for other contents of the file is not one for
        // these).
        let granted = |id: &pb::BlockId| {
            let grant = r
                .grants
                .iter()
                .find(|g| g.inode == id.inode && g.version == id.version)
                .or_else(|| r.grants.iter().find(|g| g.inode == id.inode));
            check_grant(
                &self.grant_keys,
                &who,
                grant,
                id.inode,
                None,
                Terms::Cached {
                    version: id.version,
                },
                false,
            )
        };
        if let Some(id) = &r.block {
            granted(id)?;
        }
        self.metrics.short_circuit_bytes.inc_by(r.bytes_read);
        let store = &self.fetcher.store;
        let replaces = (r.release_lease != 0).then_some(r.release_lease);
        if !r.release_leases.is_empty() {
            store.release_many(&r.release_leases[..r.release_leases.len().min(MAX_RELEASED)]);
            self.metrics.active_leases.set(store.lease_stats().0 as i64);
        }
        let Some(id) = r.block else {
            // A report of bytes read, and/or the end of a lease.
            if let Some(old) = replaces {
                store.release(old);
                self.metrics.active_leases.set(store.lease_stats().0 as i64);
            }
            return Ok(Response::new(pb::LeaseLocalBlockResponse::default()));
        };
        let hold = match r.hold_ms {
            0 => LEASE_DURATION,
            ms => std::time::Duration::from_millis(ms).min(MAX_LEASE_DURATION),
        };
        let max_pages = if r.whole_block {
            u32::MAX
        } else {
            crate::store::LEASE_WINDOW_PAGES
        };
        let lease = store.lease_pages(
            &block_key(&id),
            r.first_page,
            max_pages,
            std::time::Instant::now() + hold,
            replaces,
        );
        let (leases, _) = store.lease_stats();
        self.metrics.active_leases.set(leases as i64);
        // An older client reads pages from the start of `path`: only a file's first block
        // lies there.
        let readable = |l: &crate::store::Lease| {
            if r.reads_block_offset || l.offset == 0 {
                return true;
            }
            store.release(l.id);
            false
        };
        let lease = lease.filter(readable).ok_or_else(|| {
            RpcError::NotCached("the page is not cached here (or leases hold their share)".into())
        })?;
        self.metrics.short_circuit_leases.inc();
        let answer = |lease: crate::store::Lease, block: pb::BlockId, window: u32| {
            let path = std::path::absolute(&lease.path)
                .map_err(|e| RpcError::Internal(format!("block file path: {e}")))?;
            Ok::<_, RpcError>(pb::LeaseLocalBlockResponse {
                path: path.to_string_lossy().into_owned(),
                page_size: store.page_size(),
                pages: lease
                    .pages
                    .iter()
                    .map(|&(index, length, crc32c)| pb::LocalPage {
                        index,
                        length,
                        crc32c,
                    })
                    .collect(),
                lease_ms: hold.as_millis() as u64,
                lease_id: lease.id,
                window_pages: window,
                more: Vec::new(),
                block: Some(block),
                block_offset: lease.offset,
            })
        };
        let mut out = answer(lease, id, max_pages)?;
        // The blocks the client expects to read next: leased now when cached, each its own
        // lease (no cached page: simply left out).
        let mut seen = vec![id];
        for more in r.more.iter().take(MAX_MORE_LEASES) {
            // Each block once: the same block named 64 times held 64 leases of it.
            if seen.contains(more) || granted(more).is_err() {
                continue;
            }
            seen.push(*more);
            let until = std::time::Instant::now() + hold;
            let window = crate::store::LEASE_WINDOW_PAGES;
            let l = store.lease_pages(&block_key(more), 0, window, until, None);
            if let Some(l) = l.filter(readable) {
                self.metrics.short_circuit_leases.inc();
                out.more.push(answer(l, *more, window)?);
            }
        }
        self.metrics.active_leases.set(store.lease_stats().0 as i64);
        Ok(Response::new(out))
    }

    async fn get_cache_info(
        &self,
        _req: Request<pb::GetCacheInfoRequest>,
    ) -> Result<Response<pb::GetCacheInfoResponse>, Status> {
        let s = &self.fetcher.store;
        Ok(Response::new(pb::GetCacheInfoResponse {
            worker_id: self.worker_id,
            capacity_bytes: s.capacity(),
            used_bytes: s.used(),
            page_size: s.page_size(),
            cached_pages: s.page_count(),
            cached_blocks: s.blocks().len() as u64,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(index: u32, file_length: u64, offset: u64, length: u64) -> pb::ReadBlockRequest {
        pb::ReadBlockRequest {
            block: Some(pb::BlockDescriptor {
                id: Some(pb::BlockId {
                    inode: 2,
                    version: 3,
                    index,
                }),
                ufs: Some(pb::UfsLocation {
                    mount_id: 1,
                    path: "f".into(),
                }),
                fingerprint: None,
                file_length,
                block_size: 4096,
            }),
            offset,
            length,
            cache: true,
            cached_only: false,
            grant: None,
            from_peers: false,
        }
    }

    #[test]
    fn valid_ranges_are_planned() {
        let (_, p) = plan(&req(1, 10_000, 100, 50)).unwrap();
        assert_eq!((p.block_start, p.offset, p.end), (4096, 100, 150));
        // The last, short block: 10_000 - 8192 = 1808 bytes.
        assert!(plan(&req(2, 10_000, 0, 1808)).is_ok());
    }

    #[test]
    fn hostile_ranges_are_refused() {
        use tonic::Code;
        let code = |r: pb::ReadBlockRequest| plan(&r).err().map(|e| Status::from(e).code());
        assert_eq!(code(req(2, 10_000, 0, 1809)), Some(Code::OutOfRange));
        assert_eq!(code(req(3, 10_000, 0, 1)), Some(Code::InvalidArgument));
        assert_eq!(code(req(0, 10_000, 0, 0)), Some(Code::InvalidArgument));
        assert_eq!(code(req(0, 10_000, u64::MAX, 2)), Some(Code::OutOfRange));
        assert_eq!(
            code(req(u32::MAX, 10_000, 0, 1)),
            Some(Code::InvalidArgument)
        );
        // Malformed geometry: no block size, one above the limit, a length above the
        // largest file (each would make the worker size or place the block from it).
        let with = |f: fn(&mut pb::BlockDescriptor)| {
            let mut r = req(0, 10_000, 0, 1);
            if let Some(b) = r.block.as_mut() {
                f(b);
            }
            code(r)
        };
        assert_eq!(with(|b| b.block_size = 0), Some(Code::InvalidArgument));
        assert_eq!(
            with(|b| b.block_size = granary_common::MAX_BLOCK_SIZE + 1),
            Some(Code::InvalidArgument)
        );
        assert_eq!(
            with(|b| b.file_length = u64::MAX),
            Some(Code::InvalidArgument)
        );
        assert_eq!(
            with(|b| {
                b.block_size = 1;
                b.file_length = granary_common::MAX_FILE_LENGTH;
                b.id.as_mut().unwrap().index = u32::MAX;
            }),
            None // the last block of a file of 1-byte blocks: no overflow on the way
        );
        let mut r = req(0, 10, 0, 1);
        r.block = None;
        assert_eq!(code(r), Some(Code::InvalidArgument));
        let mut r = req(0, 10, 0, 1);
        if let Some(b) = r.block.as_mut() {
            b.ufs = None;
        }
        assert_eq!(code(r), Some(Code::InvalidArgument));
    }
}

#[cfg(test)]
mod proptests;
