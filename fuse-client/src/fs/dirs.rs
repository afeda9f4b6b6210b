//! Open directories, listed page by page as `readdir` gets to them.

use super::*;

/// Entries fetched per page of a directory listing.
const DIR_PAGE: u32 = 1000;

/// An open directory: its entries fetched so far, page by page as `readdir` gets to them
/// (a directory of millions of names shows its first entries at once and never needs all
/// of them in memory before the first reply).
pub(super) struct DirHandle {
    /// ".", ".." and the entries listed so far, in order (offset i+1 follows entry i).
    pub(super) entries: Vec<(String, pb::FileStatus)>,
    /// Where the next page starts ("" once every page is fetched).
    pub(super) next: String,
    pub(super) done: bool,
}

pub(super) type Dirs = Arc<Mutex<HashMap<u64, Arc<tokio::sync::Mutex<DirHandle>>>>>;

impl DirHandle {
    /// A listing of `dir` with "." and ".." and no page fetched yet.
    pub(super) fn new(dir: pb::FileStatus) -> Self {
        let parent = pb::FileStatus {
            inode: dir.parent.max(1),
            kind: pb::FileKind::Directory as i32,
            ..Default::default()
        };
        DirHandle {
            entries: vec![(".".into(), dir), ("..".into(), parent)],
            next: String::new(),
            done: false,
        }
    }

    /// Fetches the next page of the listing.
    pub(super) async fn fetch_page(
        &mut self,
        client: &FileSystem,
        dir: u64,
    ) -> Result<(), granary_client::ClientError> {
        if self.done {
            return Ok(());
        }
        let (entries, next) = client
            .list_page(pb::path_or_id::Target::Inode(dir), &self.next, DIR_PAGE)
            .await?;
        self.entries
            .extend(entries.into_iter().map(|e| (e.name.clone(), e)));
        self.done = next.is_empty();
        self.next = next;
        Ok(())
    }

    /// Fetches pages until entry `offset` is known (or the listing ends).
    pub(super) async fn fetch_past(
        &mut self,
        client: &FileSystem,
        dir: u64,
        offset: u64,
    ) -> Result<(), granary_client::ClientError> {
        while !self.done && self.entries.len() as u64 <= offset {
            self.fetch_page(client, dir).await?;
        }
        Ok(())
    }
}
