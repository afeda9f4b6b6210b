//! Adaptive prefetch per open file: a reader that keeps reading where it left off gets a
//! read-ahead window that doubles with every sequential read (up to [`MAX_WINDOW`]); a
//! jump elsewhere drops what was fetched ahead and closes the window. Every byte fetched
//! ahead holds its share of the mount's memory budget until it is read or dropped, and is
//! only fetched when the budget has room right now beyond a reserve of half of it
//! (prefetch never waits for memory, and never takes the half that reads waiting for
//! memory need: chunks held for readers that themselves wait cannot starve the mount), so
//! 1,000 open files cannot hold more than the budget.
//!
//! The kernel's own read-ahead (4 MiB) already keeps a few 1 MiB reads in flight; this
//! window goes further for readers of data that is not on this node (peer workers, the
//! under-store), where each read waits a round trip.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::future::{BoxFuture, FutureExt, Shared};
use granary_client::{ClientError, FileSystem};
use granary_proto as pb;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Unit of prefetch: chunks end at multiples of it in the file (the first may start anywhere).
pub const CHUNK: u64 = 1024 * 1024;
/// Smallest and largest window ahead of a sequential reader.
pub const MIN_WINDOW: u64 = 2 * CHUNK;
pub const MAX_WINDOW: u64 = 32 * CHUNK;
/// How far from where the last read ended a read still counts as sequential (the kernel
/// sends its read-ahead requests concurrently, so they arrive slightly out of order).
const SLACK: u64 = 8 * CHUNK;

type Fetch = Shared<BoxFuture<'static, Result<Bytes, ClientError>>>;

struct Chunk {
    len: u64,
    data: Fetch,
    _permit: OwnedSemaphorePermit,
}

/// What one read does to the window (kept apart from the fetching, to be testable).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Window {
    /// Where the last read ended.
    next: u64,
    /// Bytes to keep fetched ahead of the reader (0: not sequential).
    pub size: u64,
    reads: u64,
}

impl Window {
    /// Records a read of `[offset, offset + len)`; true when it continues a sequential run.
    pub fn on_read(&mut self, offset: u64, len: u64) -> bool {
        let sequential = self.reads > 0 && offset.abs_diff(self.next) <= SLACK.max(self.size);
        self.size = match (sequential, self.size) {
            (false, _) => 0,
            (true, 0) => MIN_WINDOW,
            (true, s) => (s * 2).min(MAX_WINDOW),
        };
        self.next = self.next.max(offset + len);
        if !sequential {
            self.next = offset + len;
        }
        self.reads += 1;
        sequential
    }
}

/// The prefetch state of one open file.
#[derive(Default)]
pub struct Readahead {
    window: Window,
    /// Chunks fetched or being fetched, by their offset in the file.
    ahead: BTreeMap<u64, Chunk>,
    /// The end of the furthest chunk fetched so far.
    fetched_to: u64,
}

/// Units of the memory budget (4 KiB each) for `bytes`.
fn units(bytes: u64, unit: u64) -> u32 {
    bytes.div_ceil(unit).max(1) as u32
}

/// The mount's memory budget as prefetch sees it.
#[derive(Clone)]
pub struct Budget {
    /// Permits of `unit` bytes each.
    pub memory: Arc<Semaphore>,
    pub unit: u64,
    /// Units prefetch always leaves to reads.
    pub reserve: u32,
}

impl Budget {
    /// Room for `bytes` fetched ahead, taken only when the budget has it now beyond the
    /// reserve: reads that wait for memory always find some, so what is held for readers
    /// that are themselves waiting cannot starve the mount. Never waits.
    pub fn try_take(&self, bytes: u64) -> Option<OwnedSemaphorePermit> {
        let n = units(bytes, self.unit);
        if self.memory.available_permits() < n as usize + self.reserve as usize {
            return None;
        }
        self.memory.clone().try_acquire_many_owned(n).ok()
    }
}

impl Readahead {
    /// Bytes `[offset, offset + len)` if chunks fetched ahead hold all of them (awaiting
    /// those still in flight); None otherwise. Also moves the window and starts the
    /// fetches it now wants.
    pub fn read(
        &mut self,
        client: &Arc<FileSystem>,
        file: &Arc<pb::FileStatus>,
        budget: &Budget,
        offset: u64,
        len: u64,
    ) -> Option<Vec<(Fetch, u64, u64)>> {
        let len = len.min(file.length.saturating_sub(offset));
        if !self.window.on_read(offset, len) {
            self.ahead.clear();
            self.fetched_to = 0;
            return None;
        }
        // Chunks well behind the reader are done with (the kernel's concurrent requests
        // arrive slightly out of order: a chunk just behind may still be asked for).
        let behind = offset.saturating_sub(SLACK);
        self.ahead.retain(|start, c| start + c.len > behind);
        let served = self.covering(client, file, offset, len);
        // Fill the window, from the furthest byte read or fetched so far (never a byte
        // twice: the kernel's concurrent read-ahead may already have read up to there).
        let end = (offset + len + self.window.size).min(file.length);
        let mut at = self.window.next.max(self.fetched_to);
        while at < end {
            // Up to the next chunk boundary (the first chunk may be partial).
            let n = (CHUNK - at % CHUNK).min(file.length - at);
            if client.leased(file, at) {
                // Read from this node's cache by the mount's fast path: nothing to fetch.
                at += n;
                self.fetched_to = at;
                continue;
            }
            // Prefetch never takes the last `reserve` units (see `Budget::try_take`).
            let Some(permit) = budget.try_take(n) else {
                break; // no room right now: fetch nothing more ahead
            };
            let (c, f) = (client.clone(), file.clone());
            let fut: BoxFuture<'static, Result<Bytes, ClientError>> =
                async move { c.read(&f, at, n).await }.boxed();
            let data = fut.shared();
            tokio::spawn(data.clone()); // runs whether or not a reader waits yet
            client.metrics.prefetched_bytes.inc_by(n);
            self.ahead.insert(
                at,
                Chunk {
                    len: n,
                    data,
                    _permit: permit,
                },
            );
            at += n;
            self.fetched_to = at;
        }
        served
    }

    /// Drops everything fetched ahead (after a failed fetch: a retried read starts afresh).
    pub fn forget(&mut self) {
        self.ahead.clear();
        self.window = Window::default();
        self.fetched_to = 0;
    }

    /// `[offset, offset + len)` as (fetch, from, to) slices: of the chunks fetched ahead
    /// where they hold it, of direct reads for the gaps between them (so a read that
    /// overlaps a chunk never fetches those bytes again). None when no chunk overlaps it.
    fn covering(
        &self,
        client: &Arc<FileSystem>,
        file: &Arc<pb::FileStatus>,
        offset: u64,
        len: u64,
    ) -> Option<Vec<(Fetch, u64, u64)>> {
        let end = offset + len;
        if len == 0 || !self.ahead.range(..end).any(|(s, c)| s + c.len > offset) {
            return None;
        }
        let direct = |at: u64, n: u64| -> (Fetch, u64, u64) {
            let (c, f) = (client.clone(), file.clone());
            let fut: BoxFuture<'static, Result<Bytes, ClientError>> =
                async move { c.read(&f, at, n).await }.boxed();
            (fut.shared(), 0, n)
        };
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end {
            match self.ahead.range(..=pos).next_back() {
                Some((&start, c)) if pos < start + c.len => {
                    let to = end.min(start + c.len);
                    out.push((c.data.clone(), pos - start, to - start));
                    pos = to;
                }
                _ => {
                    // A gap: up to the next chunk (or the end of the read).
                    let to = self.ahead.range(pos..end).next().map_or(end, |(&s, _)| s);
                    out.push(direct(pos, to - pos));
                    pos = to;
                }
            }
        }
        Some(out)
    }
}

/// Joins the slices of prefetched chunks (awaiting those in flight).
pub async fn assemble(parts: Vec<(Fetch, u64, u64)>) -> Result<Bytes, ClientError> {
    if parts.len() == 1 {
        let (f, a, b) = parts.into_iter().next().unwrap_or_else(|| unreachable!());
        return Ok(f.await?.slice(a as usize..b as usize));
    }
    let mut out = BytesMut::new();
    for (f, a, b) in parts {
        out.extend_from_slice(&f.await?[a as usize..b as usize]);
    }
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_grows_while_sequential_and_closes_on_a_jump() {
        let mut w = Window::default();
        let m = CHUNK;
        assert!(!w.on_read(0, m)); // the first read proves nothing
        assert_eq!(w.size, 0);
        assert!(w.on_read(m, m));
        assert_eq!(w.size, MIN_WINDOW);
        // The kernel's read-ahead arrives a little out of order: still sequential.
        assert!(w.on_read(3 * m, m));
        assert!(w.on_read(2 * m, m));
        assert_eq!(w.size, 4 * MIN_WINDOW);
        for i in 4..20 {
            w.on_read(i * m, m);
        }
        assert_eq!(w.size, MAX_WINDOW);
        // A jump far away: random access, no window.
        assert!(!w.on_read(900 * m, 4096));
        assert_eq!(w.size, 0);
        // Random 4 KiB reads stay without one.
        assert!(!w.on_read(100 * m, 4096));
        assert!(!w.on_read(500 * m, 4096));
        assert_eq!(w.size, 0);
    }
}
