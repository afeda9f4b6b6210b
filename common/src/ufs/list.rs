//! Folder listings of under-stores, a page per request where the store pages (S3, GCS,
//! Azure), and the opening of object stores that keeps their paged listing.

use std::sync::Arc;

use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::path::Path as StorePath;
use object_store::{ListResult, ObjectStore};
use url::Url;

use super::Ufs;

/// Default `list_page_keys`: entries one page of a folder listing asks for (the most S3,
/// GCS and Azure return).
pub const LIST_PAGE_KEYS: usize = 1000;

/// Pages one folder listing may take (20 million entries): a store that never ends its
/// listing is refused rather than followed until memory runs out.
pub const LIST_MAX_PAGES: usize = 20_000;

/// Why a folder listing failed.
#[derive(Debug)]
pub enum ListFailure {
    /// A request (a page; the whole listing where the store does not page) took longer
    /// than the deadline; `pages` had come before it.
    TimedOut { pages: usize },
    /// The store refused or failed a request; `pages` had come before it.
    Store {
        pages: usize,
        error: object_store::Error,
    },
    /// The store's listing did not end (the same page token twice, or more than
    /// [`LIST_MAX_PAGES`] pages).
    Endless { pages: usize },
}

/// One folder's listing, a page at a time (see [`Ufs::folder_pages`]).
pub struct FolderPages<'a> {
    ufs: &'a Ufs,
    location: StorePath,
    page_keys: usize,
    deadline: std::time::Duration,
    token: Option<String>,
    requests: usize,
    done: bool,
}

impl FolderPages<'_> {
    /// The next page and whether it is the last; `None` once the last came. A store that
    /// does not page answers the whole folder as its one page.
    pub async fn next(&mut self) -> Result<Option<(ListResult, bool)>, ListFailure> {
        if self.done {
            return Ok(None);
        }
        let pages = self.requests;
        if pages >= LIST_MAX_PAGES {
            return Err(ListFailure::Endless { pages });
        }
        self.requests += 1;
        let Some(pager) = &self.ufs.pager else {
            let listing = self.ufs.store.list_with_delimiter(Some(&self.location));
            self.done = true;
            return match tokio::time::timeout(self.deadline, listing).await {
                Ok(Ok(l)) => Ok(Some((l, true))),
                Ok(Err(error)) => Err(ListFailure::Store { pages, error }),
                Err(_) => Err(ListFailure::TimedOut { pages }),
            };
        };
        // A paged listing takes its prefix as given: a folder's ends with the delimiter.
        let prefix = Some(self.location.as_ref())
            .filter(|p| !p.is_empty())
            .map(|p| format!("{p}/"));
        let opts = PaginatedListOptions {
            delimiter: Some("/".into()),
            max_keys: Some(self.page_keys.clamp(1, LIST_PAGE_KEYS)),
            page_token: self.token.clone(),
            ..Default::default()
        };
        let page =
            tokio::time::timeout(self.deadline, pager.list_paginated(prefix.as_deref(), opts))
                .await
                .map_err(|_| ListFailure::TimedOut { pages })?
                .map_err(|error| ListFailure::Store { pages, error })?;
        match page.page_token.filter(|t| !t.is_empty()) {
            None => self.done = true,
            Some(next) if self.token.as_ref() == Some(&next) => {
                return Err(ListFailure::Endless { pages: pages + 1 })
            }
            next => self.token = next,
        }
        Ok(Some((page.result, self.done)))
    }

    /// Requests sent so far (pages asked for, the failed one included).
    pub fn requests(&self) -> usize {
        self.requests
    }
}

impl Ufs {
    /// Lists one folder (`location`; its objects and the folders below it, one level), a
    /// page at a time. A store that pages is listed a page per request, and `deadline`
    /// bounds each request, not the whole listing: a flat folder of millions of objects
    /// lists as long as every page comes in time, and a store that stops answering is
    /// noticed within one deadline. A store that does not page is listed in one call
    /// under `deadline`. `page_keys`: entries asked for per page (`list_page_keys`).
    pub fn folder_pages(
        &self,
        location: &StorePath,
        page_keys: usize,
        deadline: std::time::Duration,
    ) -> FolderPages<'_> {
        FolderPages {
            ufs: self,
            location: location.clone(),
            page_keys,
            deadline,
            token: None,
            requests: 0,
            done: false,
        }
    }

    /// Whether the mount's folder can be listed: one page of it at most (a mount of a
    /// bucket of millions of objects is probed with one request, not listed whole).
    pub async fn list_one_page(&self) -> Result<(), object_store::Error> {
        match &self.pager {
            Some(pager) => {
                let prefix = Some(self.prefix.as_ref())
                    .filter(|p| !p.is_empty())
                    .map(|p| format!("{p}/"));
                let opts = PaginatedListOptions {
                    delimiter: Some("/".into()),
                    max_keys: Some(1),
                    ..Default::default()
                };
                pager
                    .list_paginated(prefix.as_deref(), opts)
                    .await
                    .map(|_| ())
            }
            None => self
                .store
                .list_with_delimiter(Some(&self.prefix))
                .await
                .map(|_| ()),
        }
    }
}

/// An opened object store, its paged listing where it has one (S3, GCS, Azure), and the
/// path inside it the URL names. Options are applied as `object_store::parse_url_opts`
/// applies them (keys it does not know are ignored), which cannot return the store's
/// concrete type, and so not its paged listing.
#[allow(clippy::type_complexity)]
pub(super) fn open_object_store<'a>(
    url: &Url,
    options: impl Iterator<Item = (&'a String, &'a String)>,
) -> Result<
    (
        Arc<dyn ObjectStore>,
        Option<Arc<dyn PaginatedListStore>>,
        StorePath,
    ),
    object_store::Error,
> {
    use object_store::aws::AmazonS3Builder;
    use object_store::azure::MicrosoftAzureBuilder;
    use object_store::gcp::GoogleCloudStorageBuilder;
    use object_store::ObjectStoreScheme;
    macro_rules! paged {
        ($builder:ty) => {{
            let mut b = <$builder>::new().with_url(url.to_string());
            for (k, v) in options {
                if let Ok(key) = k.to_ascii_lowercase().parse() {
                    b = b.with_config(key, v.clone());
                }
            }
            let store = Arc::new(b.build()?);
            (
                store.clone() as Arc<dyn ObjectStore>,
                Some(store as Arc<dyn PaginatedListStore>),
            )
        }};
    }
    let (scheme, path) = ObjectStoreScheme::parse(url)?;
    let path = StorePath::parse(path)?;
    let (store, pager) = match scheme {
        ObjectStoreScheme::AmazonS3 => paged!(AmazonS3Builder),
        ObjectStoreScheme::GoogleCloudStorage => paged!(GoogleCloudStorageBuilder),
        ObjectStoreScheme::MicrosoftAzure => paged!(MicrosoftAzureBuilder),
        _ => {
            let (store, _) = object_store::parse_url_opts(url, options)?;
            (Arc::from(store), None)
        }
    };
    Ok((store, pager, path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ufs::DEFAULT_PART_SIZE;

    /// A store whose folder `data/dir` holds `total` objects and one folder (`sub`, named
    /// on every page), listed `max_keys` at a time by page-number tokens. `repeat`: every
    /// page names page 1 next; `hang_at`: that page never comes.
    struct Pages {
        total: usize,
        repeat: bool,
        hang_at: Option<usize>,
        asked: std::sync::Mutex<usize>,
    }

    #[async_trait::async_trait]
    impl PaginatedListStore for Pages {
        async fn list_paginated(
            &self,
            prefix: Option<&str>,
            opts: PaginatedListOptions,
        ) -> object_store::Result<object_store::list::PaginatedListResult> {
            assert_eq!(prefix, Some("data/dir/"));
            assert_eq!(opts.delimiter.as_deref(), Some("/"));
            *self.asked.lock().unwrap() += 1;
            let page: usize = opts.page_token.as_deref().map_or(0, |t| t.parse().unwrap());
            if self.hang_at == Some(page) {
                futures::future::pending::<()>().await;
            }
            let per = opts.max_keys.unwrap();
            let objects = (page * per..((page + 1) * per).min(self.total))
                .map(|i| object_store::ObjectMeta {
                    location: StorePath::from(format!("data/dir/o{i:05}")),
                    last_modified: chrono::DateTime::from_timestamp(0, 0).unwrap(),
                    size: 1,
                    e_tag: None,
                    version: None,
                })
                .collect();
            let more = (page + 1) * per < self.total;
            let next = if self.repeat { 1 } else { page + 1 };
            Ok(object_store::list::PaginatedListResult {
                result: ListResult {
                    common_prefixes: vec![StorePath::from("data/dir/sub")],
                    objects,
                    extensions: Default::default(),
                },
                page_token: more.then(|| next.to_string()),
            })
        }
    }

    fn paged(pages: Pages) -> (Ufs, Arc<Pages>) {
        let pages = Arc::new(pages);
        let ufs = Ufs {
            store: Arc::new(object_store::memory::InMemory::new()),
            pager: Some(pages.clone()),
            prefix: StorePath::from("data"),
            part_size: DEFAULT_PART_SIZE,
            part_concurrency: 1,
            local: None,
        };
        (ufs, pages)
    }

    #[tokio::test]
    async fn a_paged_folder_is_listed_whole_and_a_stuck_or_endless_one_fails() {
        let dir = StorePath::from("data/dir");
        let pages = |total, repeat, hang_at| Pages {
            total,
            repeat,
            hang_at,
            asked: Default::default(),
        };
        // 2,500 objects: three requests, every object once, the last page said so.
        let (ufs, store) = paged(pages(2_500, false, None));
        let mut l = ufs.folder_pages(&dir, LIST_PAGE_KEYS, std::time::Duration::from_secs(5));
        let (mut names, mut lasts) = (std::collections::BTreeSet::new(), Vec::new());
        while let Some((page, last)) = l.next().await.unwrap() {
            names.extend(page.objects.iter().map(|o| o.location.to_string()));
            assert_eq!(page.common_prefixes, vec![StorePath::from("data/dir/sub")]);
            lasts.push(last);
        }
        assert_eq!((*store.asked.lock().unwrap(), l.requests()), (3, 3));
        assert_eq!(lasts, [false, false, true]);
        assert_eq!(names.len(), 2_500);
        // Page 2 never comes: the listing fails after one deadline, saying how far it got.
        let (ufs, _) = paged(pages(2_500, false, Some(1)));
        let mut l = ufs.folder_pages(&dir, 700, std::time::Duration::from_millis(200));
        assert!(l.next().await.unwrap().is_some());
        let failed = l.next().await;
        assert!(
            matches!(failed, Err(ListFailure::TimedOut { pages: 1 })),
            "{failed:?}"
        );
        // A store that names the same next page forever is not followed.
        let (ufs, store) = paged(pages(2_500, true, None));
        let mut l = ufs.folder_pages(&dir, LIST_PAGE_KEYS, std::time::Duration::from_secs(5));
        let failed = loop {
            match l.next().await {
                Ok(Some(_)) => {}
                other => break other,
            }
        };
        assert!(
            matches!(failed, Err(ListFailure::Endless { pages: 2 })),
            "{failed:?}"
        );
        assert_eq!(*store.asked.lock().unwrap(), 2);
        // The probe asks for one page of one key.
        let (ufs, store) = paged(pages(2_500, false, None));
        let p = Ufs {
            prefix: dir.clone(),
            ..ufs
        };
        p.list_one_page().await.unwrap();
        assert_eq!(*store.asked.lock().unwrap(), 1);
    }
}
