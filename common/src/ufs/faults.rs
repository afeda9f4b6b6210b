//! An under-store with faults injected by rule, for tests of what Granary does when its
//! store fails: any `ObjectStore` wrapped ([`StoreFaults::wrap`]) answers an operation
//! with an error, late, never, or — for listings — part of the way and then an error, per
//! operation, per path prefix, from the N-th matching call on, at most M times. A master
//! opens its mounts' stores through such a wrapper when its mount policy carries one
//! (`MountPolicy::wrap`, the in-process cluster's `Cluster::store_faults`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{self, BoxStream, StreamExt};
use object_store::path::Path as StorePath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// Which operations a rule applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreOp {
    /// Reads of an object (whole or ranged, and `head`).
    Get,
    /// Writes (simple and multipart).
    Put,
    Delete,
    /// Listings, flat or by folder.
    List,
    Copy,
    Any,
}

/// What a rule does to an operation it fires on.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreFault {
    /// Fails as an unreachable store does (a generic error).
    Unavailable,
    /// Fails with "not found".
    NotFound,
    /// Answers after this long.
    Delay(Duration),
    /// Never answers.
    Hang,
    /// A listing yields this many entries (objects, then folders for a folder listing),
    /// then fails; other operations fail at once.
    FailAfter(usize),
}

#[derive(Clone, Debug)]
pub struct StoreRule {
    pub op: StoreOp,
    /// Paths the rule applies to (None: all).
    pub prefix: Option<String>,
    pub from_step: u64,
    pub times: Option<u64>,
    pub fault: StoreFault,
}

impl StoreRule {
    pub fn new(op: StoreOp, fault: StoreFault) -> StoreRule {
        StoreRule {
            op,
            prefix: None,
            from_step: 0,
            times: None,
            fault,
        }
    }

    pub fn prefix(mut self, prefix: &str) -> StoreRule {
        self.prefix = Some(prefix.to_string());
        self
    }

    pub fn from_step(mut self, n: u64) -> StoreRule {
        self.from_step = n;
        self
    }

    pub fn times(mut self, n: u64) -> StoreRule {
        self.times = Some(n);
        self
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreRuleId(u64);

struct Active {
    id: StoreRuleId,
    rule: StoreRule,
    seen: u64,
    fired: u64,
}

/// Rules shared by every store wrapped with them.
#[derive(Default)]
pub struct StoreFaults {
    rules: Mutex<Vec<Active>>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for StoreFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreFaults")
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl StoreFaults {
    pub fn add(&self, rule: StoreRule) -> StoreRuleId {
        let id = StoreRuleId(self.next_id.fetch_add(1, Ordering::Relaxed));
        lock(&self.rules).push(Active {
            id,
            rule,
            seen: 0,
            fired: 0,
        });
        id
    }

    pub fn remove(&self, id: StoreRuleId) {
        lock(&self.rules).retain(|a| a.id != id);
    }

    pub fn clear(&self) {
        lock(&self.rules).clear();
    }

    /// How often a rule fired (0 once removed).
    pub fn fired(&self, id: StoreRuleId) -> u64 {
        lock(&self.rules)
            .iter()
            .find(|a| a.id == id)
            .map_or(0, |a| a.fired)
    }

    /// `store` with these rules in front of it.
    pub fn wrap(self: &Arc<Self>, store: Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore> {
        Arc::new(FaultyStore {
            inner: store,
            faults: self.clone(),
        })
    }

    fn decide(&self, op: StoreOp, path: &str) -> Option<StoreFault> {
        let mut rules = lock(&self.rules);
        let mut fault = None;
        for a in rules.iter_mut() {
            let r = &a.rule;
            let op_matches = r.op == StoreOp::Any || r.op == op;
            if !op_matches || r.prefix.as_deref().is_some_and(|p| !path.starts_with(p)) {
                continue;
            }
            a.seen += 1;
            let due = a.seen > r.from_step && r.times.is_none_or(|n| a.fired < n);
            if fault.is_none() && due {
                a.fired += 1;
                fault = Some(r.fault.clone());
            }
        }
        fault
    }
}

#[derive(Debug)]
struct FaultyStore {
    inner: Arc<dyn ObjectStore>,
    faults: Arc<StoreFaults>,
}

impl std::fmt::Display for FaultyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Faults({})", self.inner)
    }
}

fn injected(path: &str, fault: &StoreFault) -> object_store::Error {
    match fault {
        StoreFault::NotFound => object_store::Error::NotFound {
            path: path.to_string(),
            source: "injected fault: not found".into(),
        },
        _ => object_store::Error::Generic {
            store: "faults",
            source: format!("injected fault: the store is unavailable ({path})").into(),
        },
    }
}

impl FaultyStore {
    /// Runs `op` on `path` with the rules' fault, if one fires.
    async fn guarded<T>(
        &self,
        op: StoreOp,
        path: &str,
        run: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        match self.faults.decide(op, path) {
            None => run.await,
            Some(StoreFault::Delay(d)) => {
                tokio::time::sleep(d).await;
                run.await
            }
            Some(StoreFault::Hang) => futures::future::pending().await,
            Some(f) => Err(injected(path, &f)),
        }
    }

    fn guarded_stream(
        &self,
        path: &str,
        inner: BoxStream<'static, Result<ObjectMeta>>,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        let path = path.to_string();
        match self.faults.decide(StoreOp::List, &path) {
            None => inner,
            Some(StoreFault::Delay(d)) => stream::once(tokio::time::sleep(d))
                .flat_map(move |()| stream::empty())
                .chain(inner)
                .boxed(),
            Some(StoreFault::Hang) => stream::pending().boxed(),
            Some(StoreFault::FailAfter(n)) => {
                let err = injected(&path, &StoreFault::Unavailable);
                inner
                    .take(n)
                    .chain(stream::once(async move { Err(err) }))
                    .boxed()
            }
            Some(f) => stream::once(async move { Err(injected(&path, &f)) }).boxed(),
        }
    }
}

impl ObjectStore for FaultyStore {
    fn put_opts<'a, 'b, 'c>(
        &'a self,
        location: &'b StorePath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> BoxFuture<'c, Result<PutResult>>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        Box::pin(self.guarded(
            StoreOp::Put,
            location.as_ref(),
            self.inner.put_opts(location, payload, opts),
        ))
    }

    fn put_multipart_opts<'a, 'b, 'c>(
        &'a self,
        location: &'b StorePath,
        opts: PutMultipartOptions,
    ) -> BoxFuture<'c, Result<Box<dyn MultipartUpload>>>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        Box::pin(self.guarded(
            StoreOp::Put,
            location.as_ref(),
            self.inner.put_multipart_opts(location, opts),
        ))
    }

    fn get_opts<'a, 'b, 'c>(
        &'a self,
        location: &'b StorePath,
        options: GetOptions,
    ) -> BoxFuture<'c, Result<GetResult>>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        Box::pin(self.guarded(
            StoreOp::Get,
            location.as_ref(),
            self.inner.get_opts(location, options),
        ))
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<StorePath>>,
    ) -> BoxStream<'static, Result<StorePath>> {
        let faults = self.faults.clone();
        let checked = locations
            .map(move |loc| {
                let loc = loc?;
                match faults.decide(StoreOp::Delete, loc.as_ref()) {
                    Some(f @ (StoreFault::Unavailable | StoreFault::NotFound)) => {
                        Err(injected(loc.as_ref(), &f))
                    }
                    _ => Ok(loc),
                }
            })
            .boxed();
        self.inner.delete_stream(checked)
    }

    fn list(&self, prefix: Option<&StorePath>) -> BoxStream<'static, Result<ObjectMeta>> {
        let path = prefix.map(|p| p.to_string()).unwrap_or_default();
        self.guarded_stream(&path, self.inner.list(prefix))
    }

    fn list_with_delimiter<'a, 'b, 'c>(
        &'a self,
        prefix: Option<&'b StorePath>,
    ) -> BoxFuture<'c, Result<ListResult>>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        let path = prefix.map(|p| p.to_string()).unwrap_or_default();
        Box::pin(async move {
            let fault = self.faults.decide(StoreOp::List, &path);
            match fault {
                None => self.inner.list_with_delimiter(prefix).await,
                Some(StoreFault::Delay(d)) => {
                    tokio::time::sleep(d).await;
                    self.inner.list_with_delimiter(prefix).await
                }
                Some(StoreFault::Hang) => futures::future::pending().await,
                // A folder listing is one answer: part of it is none of it.
                Some(f) => Err(injected(&path, &f)),
            }
        })
    }

    fn copy_opts<'a, 'b, 'c, 'd>(
        &'a self,
        from: &'b StorePath,
        to: &'c StorePath,
        options: CopyOptions,
    ) -> BoxFuture<'d, Result<()>>
    where
        'a: 'd,
        'b: 'd,
        'c: 'd,
        Self: 'd,
    {
        Box::pin(self.guarded(
            StoreOp::Copy,
            from.as_ref(),
            self.inner.copy_opts(from, to, options),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::TryStreamExt;
    use object_store::memory::InMemory;
    use object_store::ObjectStoreExt as _;

    #[tokio::test]
    async fn rules_fail_the_operations_and_paths_they_name_and_listings_part_way() {
        let mem: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        for name in ["a/1", "a/2", "a/3", "b/1"] {
            mem.put(&StorePath::from(name), PutPayload::from_static(b"x"))
                .await
                .unwrap();
        }
        let faults = Arc::new(StoreFaults::default());
        let store = faults.wrap(mem);
        let get = faults.add(
            StoreRule::new(StoreOp::Get, StoreFault::NotFound)
                .prefix("a/")
                .from_step(1)
                .times(1),
        );
        assert!(store.get(&StorePath::from("a/1")).await.is_ok()); // step 0
        let err = store.get(&StorePath::from("a/2")).await.unwrap_err();
        assert!(matches!(err, object_store::Error::NotFound { .. }), "{err}");
        assert!(store.get(&StorePath::from("a/3")).await.is_ok()); // spent
        assert!(store.get(&StorePath::from("b/1")).await.is_ok());
        assert_eq!(faults.fired(get), 1);

        let part = faults.add(StoreRule::new(StoreOp::List, StoreFault::FailAfter(2)).times(1));
        let mut listed = store.list(Some(&StorePath::from("a")));
        let mut got = 0;
        let mut failed = false;
        while let Some(item) = listed.next().await {
            match item {
                Ok(_) => got += 1,
                Err(e) => {
                    failed = true;
                    assert!(e.to_string().contains("injected"), "{e}");
                }
            }
        }
        assert_eq!((got, failed, faults.fired(part)), (2, true, 1));
        let whole: Vec<ObjectMeta> = store.list(None).try_collect().await.unwrap();
        assert_eq!(whole.len(), 4);

        faults.add(StoreRule::new(StoreOp::List, StoreFault::Unavailable).times(1));
        assert!(store.list_with_delimiter(None).await.is_err());
        assert_eq!(
            store
                .list_with_delimiter(None)
                .await
                .unwrap()
                .common_prefixes
                .len(),
            2
        );

        faults.add(StoreRule::new(StoreOp::Put, StoreFault::Unavailable).times(1));
        assert!(store
            .put(&StorePath::from("c"), PutPayload::from_static(b"y"))
            .await
            .is_err());
        assert!(
            store.head(&StorePath::from("c")).await.is_err(),
            "a failed put wrote"
        );
    }
}
