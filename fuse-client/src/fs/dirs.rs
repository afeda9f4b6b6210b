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
    /// The next page, asked for as soon as this one came: the master lists it while the
    /// kernel takes the entries already here (a `find` waited for each page in turn).
    ahead: Option<Ahead>,
}

type Page = Result<(Vec<pb::FileStatus>, String), granary_client::ClientError>;

/// A page being fetched ahead; stopped when the directory is closed first.
struct Ahead(tokio::task::JoinHandle<Page>);

impl Drop for Ahead {
    fn drop(&mut self) {
        self.0.abort();
    }
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
            ahead: None,
        }
    }

    /// Fetches the next page of the listing.
    pub(super) async fn fetch_page(
        &mut self,
        client: &Arc<FileSystem>,
        dir: u64,
    ) -> Result<(), granary_client::ClientError> {
        if self.done {
            return Ok(());
        }
        let page = match self.ahead.take() {
            Some(mut ahead) => (&mut ahead.0).await.unwrap_or_else(|e| {
                Err(granary_client::ClientError::internal(format!(
                    "fetching a listing page ahead: {e}"
                )))
            }),
            None => {
                client
                    .list_page(pb::path_or_id::Target::Inode(dir), &self.next, DIR_PAGE)
                    .await
            }
        };
        let (entries, next) = page?;
        self.entries
            .extend(entries.into_iter().map(|e| (e.name.clone(), e)));
        self.done = next.is_empty();
        self.next = next;
        if !self.done {
            let (client, after) = (client.clone(), self.next.clone());
            self.ahead = Some(Ahead(tokio::spawn(async move {
                client
                    .list_page(pb::path_or_id::Target::Inode(dir), &after, DIR_PAGE)
                    .await
            })));
        }
        Ok(())
    }

    /// Fetches pages until entry `offset` is known (or the listing ends).
    pub(super) async fn fetch_past(
        &mut self,
        client: &Arc<FileSystem>,
        dir: u64,
        offset: u64,
    ) -> Result<(), granary_client::ClientError> {
        while !self.done && self.entries.len() as u64 <= offset {
            self.fetch_page(client, dir).await?;
        }
        Ok(())
    }
}
