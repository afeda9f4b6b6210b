//! How a Granary process reaches the other servers' gRPC services: the one seam every
//! client of the wire contract goes through (the client library's master and worker
//! clients, the masters' Raft transport and job runner, the workers' peer fills).
//!
//! A [`Network`] turns an address into a [`GrpcChannel`], which every generated tonic
//! client takes. Two implementations:
//!
//! - [`Tcp`]: the real network, with the transport security it is given (mutual TLS with
//!   the given certificate, or plaintext) — never a process-wide setting, so two
//!   identities can live in one process (the in-process cluster of the tests).
//! - [`Faults`]: any network with faults injected by rule — a delay, an error of a given
//!   code, a request dropped before it is sent, an answer lost after the server applied
//!   the request, a call that never returns, or a call held until a later one has been
//!   answered — per method, per target address, from the N-th matching call on, at most
//!   M times, with a chance drawn from a seeded generator (the seed is printed, and
//!   `GRANARY_FAULT_SEED` replays it).
//!
//! The seam is the channel rather than a hand-written trait per service: the code under
//! test keeps the real codec, deadlines, metadata and authorization layer, and one fault
//! wrapper serves the master, worker and Raft services alike.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use tonic::body::Body;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

use crate::tls::TlsMaterial;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A channel's failure to carry a call (connection refused, reset, timed out). The error
/// it wraps is its `source`, which is where tonic looks for what status to report.
#[derive(Debug)]
pub struct NetError(BoxError);

impl std::fmt::Display for NetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for NetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

impl NetError {
    fn new(e: impl Into<BoxError>) -> NetError {
        NetError(e.into())
    }
}

/// A channel to one server, as every generated client takes it.
pub type GrpcChannel = BoxCloneSyncService<http::Request<Body>, http::Response<Body>, NetError>;

/// What the server at the other end must prove to be (with TLS): a master (Raft, the
/// client's master calls), or any node of the cluster (a worker).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerKind {
    Master,
    Node,
}

/// A way to reach the cluster's servers.
pub trait Network: Send + Sync + std::fmt::Debug {
    /// A lazily connecting channel to `addr` (`host:port`, or a URI).
    fn channel(&self, addr: &str, server: ServerKind) -> Result<GrpcChannel, String>;
    /// The TLS identity this network connects with (None: plaintext).
    fn tls(&self) -> Option<&Arc<TlsMaterial>>;
}

/// A network handle, as passed to the parts that make channels.
pub type Net = Arc<dyn Network>;

/// The real network: TCP, with mutual TLS when given an identity.
#[derive(Debug, Clone, Default)]
pub struct Tcp {
    tls: Option<Arc<TlsMaterial>>,
}

impl Tcp {
    pub fn net(tls: Option<Arc<TlsMaterial>>) -> Net {
        Arc::new(Tcp { tls })
    }

    /// Plaintext TCP: no identities (clusters run `--insecure`, and tests).
    pub fn plain() -> Net {
        Tcp::net(None)
    }
}

impl Network for Tcp {
    fn channel(&self, addr: &str, server: ServerKind) -> Result<GrpcChannel, String> {
        let ch = crate::grpc::channel_with(addr, server, self.tls.as_ref())
            .map_err(|e| format!("invalid address {addr:?}: {e}"))?;
        Ok(GrpcChannel::new(ch.map_err(NetError::new)))
    }

    fn tls(&self) -> Option<&Arc<TlsMaterial>> {
        self.tls.as_ref()
    }
}

/// What a rule does to a call it fires on.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// Sent after this long.
    Delay(Duration),
    /// Not sent; the caller gets this status code.
    Error(tonic::Code),
    /// Not sent; the caller gets UNAVAILABLE, as from a connection that broke before the
    /// request went out.
    Drop,
    /// Sent and applied by the server; its answer is lost and the caller gets UNAVAILABLE
    /// (what retries with request ids exist for).
    Lose,
    /// Never answered (the caller's own deadline is what ends it).
    Hang,
    /// Held until a later call matching the same rule has been answered (or this long
    /// has passed), then sent: the later call overtakes it.
    Reorder(Duration),
}

/// When a fault fires. Built with [`Rule::new`] and the methods that narrow it.
#[derive(Clone, Debug)]
pub struct Rule {
    /// The gRPC method (`LoadBlocks`, or a full path `/granary.v1.WorkerService/LoadBlocks`);
    /// None: every method.
    pub method: Option<String>,
    /// The address the channel was made for; None: every target.
    pub target: Option<String>,
    /// Matching calls let through before the rule fires (0: from the first).
    pub from_step: u64,
    /// Fires at most this often (None: every matching call from `from_step` on).
    pub times: Option<u64>,
    /// Chance that a matching call past `from_step` fires (drawn from the seeded generator).
    pub chance: f64,
    pub fault: Fault,
}

impl Rule {
    pub fn new(fault: Fault) -> Rule {
        Rule {
            method: None,
            target: None,
            from_step: 0,
            times: None,
            chance: 1.0,
            fault,
        }
    }

    pub fn method(mut self, method: &str) -> Rule {
        self.method = Some(method.to_string());
        self
    }

    pub fn target(mut self, addr: &str) -> Rule {
        self.target = Some(bare(addr).to_string());
        self
    }

    pub fn from_step(mut self, n: u64) -> Rule {
        self.from_step = n;
        self
    }

    pub fn times(mut self, n: u64) -> Rule {
        self.times = Some(n);
        self
    }

    pub fn chance(mut self, p: f64) -> Rule {
        self.chance = p;
        self
    }

    fn matches(&self, path: &str, target: &str) -> bool {
        let method = self.method.as_deref().is_none_or(|m| {
            if m.starts_with('/') {
                path == m
            } else {
                path.rsplit('/').next() == Some(m)
            }
        });
        method && self.target.as_deref().is_none_or(|t| t == target)
    }
}

/// `host:port` of an address given with or without a scheme.
fn bare(addr: &str) -> &str {
    addr.strip_prefix("http://")
        .or_else(|| addr.strip_prefix("https://"))
        .unwrap_or(addr)
        .trim_end_matches('/')
}

/// A rule added to a [`Faults`] network, to look it up or remove it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleId(u64);

struct Active {
    id: RuleId,
    rule: Rule,
    /// Matching calls seen.
    seen: u64,
    fired: u64,
    /// Woken when a matching call that did not fire is answered (for `Reorder`).
    answered: Arc<tokio::sync::Notify>,
}

struct FaultState {
    rules: Mutex<Vec<Active>>,
    next_id: AtomicU64,
    seed: u64,
    rng: Mutex<u64>,
}

impl FaultState {
    /// The fault for one call, if a rule fires (with that rule's notifier); the notifiers
    /// of the rules it matched without firing (woken when it is answered).
    #[allow(clippy::type_complexity)]
    fn decide(
        &self,
        path: &str,
        target: &str,
    ) -> (
        Option<(Fault, Arc<tokio::sync::Notify>)>,
        Vec<Arc<tokio::sync::Notify>>,
    ) {
        let mut rules = lock(&self.rules);
        let mut fault = None;
        let mut matched = Vec::new();
        for a in rules.iter_mut().filter(|a| a.rule.matches(path, target)) {
            a.seen += 1;
            let due = a.seen > a.rule.from_step && a.rule.times.is_none_or(|n| a.fired < n);
            if fault.is_none() && due && self.draw() < a.rule.chance {
                a.fired += 1;
                fault = Some((a.rule.fault.clone(), a.answered.clone()));
            } else {
                matched.push(a.answered.clone());
            }
        }
        (fault, matched)
    }

    /// A number in [0, 1) from the seeded generator (splitmix64).
    fn draw(&self) -> f64 {
        let mut s = lock(&self.rng);
        *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// A network with faults injected by rule (see the module's documentation). Clones share
/// the rules.
#[derive(Clone)]
pub struct Faults {
    inner: Net,
    state: Arc<FaultState>,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults")
            .field("inner", &self.inner)
            .field("seed", &self.state.seed)
            .finish()
    }
}

/// The variable that replays a run's fault draws.
pub const SEED_VAR: &str = "GRANARY_FAULT_SEED";

impl Faults {
    pub fn new(inner: Net, seed: u64) -> Faults {
        Faults {
            inner,
            state: Arc::new(FaultState {
                rules: Mutex::new(Vec::new()),
                next_id: AtomicU64::new(1),
                seed,
                rng: Mutex::new(seed),
            }),
        }
    }

    /// Seeded from `GRANARY_FAULT_SEED` when set, else from the clock; the seed is printed
    /// so that a failing run can be replayed.
    pub fn from_env(inner: Net) -> Faults {
        let seed = std::env::var(SEED_VAR)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            });
        eprintln!("fault seed: {seed} (replay with {SEED_VAR}={seed})");
        Faults::new(inner, seed)
    }

    pub fn seed(&self) -> u64 {
        self.state.seed
    }

    pub fn add(&self, rule: Rule) -> RuleId {
        let id = RuleId(self.state.next_id.fetch_add(1, Ordering::Relaxed));
        lock(&self.state.rules).push(Active {
            id,
            rule,
            seen: 0,
            fired: 0,
            answered: Arc::new(tokio::sync::Notify::new()),
        });
        id
    }

    pub fn remove(&self, id: RuleId) {
        lock(&self.state.rules).retain(|a| a.id != id);
    }

    pub fn clear(&self) {
        lock(&self.state.rules).clear();
    }

    /// How often a rule has fired (0 once removed).
    pub fn fired(&self, id: RuleId) -> u64 {
        lock(&self.state.rules)
            .iter()
            .find(|a| a.id == id)
            .map_or(0, |a| a.fired)
    }

    /// Wraps one channel to `target` (how a channel of another network gets the rules).
    pub fn wrap(&self, channel: GrpcChannel, target: &str) -> GrpcChannel {
        GrpcChannel::new(Faulty {
            inner: channel,
            target: Arc::from(bare(target)),
            state: self.state.clone(),
        })
    }

    pub fn net(&self) -> Net {
        Arc::new(self.clone())
    }
}

impl Network for Faults {
    fn channel(&self, addr: &str, server: ServerKind) -> Result<GrpcChannel, String> {
        Ok(self.wrap(self.inner.channel(addr, server)?, addr))
    }

    fn tls(&self) -> Option<&Arc<TlsMaterial>> {
        self.inner.tls()
    }
}

#[derive(Clone)]
struct Faulty {
    inner: GrpcChannel,
    target: Arc<str>,
    state: Arc<FaultState>,
}

fn injected(code: tonic::Code, what: &str) -> http::Response<Body> {
    tonic::Status::new(code, format!("injected fault: {what}")).into_http()
}

impl Service<http::Request<Body>> for Faulty {
    type Response = http::Response<Body>;
    type Error = NetError;
    type Future = BoxFuture<'static, Result<http::Response<Body>, NetError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), NetError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // The service made ready goes with the call; this one keeps a fresh clone.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let (fault, matched) = self.state.decide(req.uri().path(), &self.target);
        let notify = move || matched.iter().for_each(|n| n.notify_waiters());
        // Created now, so that a later call answered before this one is polled still
        // wakes it.
        let overtaken = match &fault {
            Some((Fault::Reorder(_), n)) => Some(n.clone().notified_owned()),
            _ => None,
        };
        Box::pin(async move {
            let out = match fault.map(|f| f.0) {
                None => inner.call(req).await,
                Some(Fault::Delay(d)) => {
                    tokio::time::sleep(d).await;
                    inner.call(req).await
                }
                Some(Fault::Error(code)) => Ok(injected(code, "error")),
                Some(Fault::Drop) => Ok(injected(tonic::Code::Unavailable, "request dropped")),
                Some(Fault::Lose) => {
                    // Headers come once the handler returned: the server has applied it.
                    let _ = inner.call(req).await;
                    Ok(injected(tonic::Code::Unavailable, "answer lost"))
                }
                Some(Fault::Hang) => futures::future::pending().await,
                Some(Fault::Reorder(at_most)) => {
                    if let Some(overtaken) = overtaken {
                        let _ = tokio::time::timeout(at_most, overtaken).await;
                    }
                    inner.call(req).await
                }
            };
            notify();
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A network whose every server answers at once and counts what it received, per
    /// path and target.
    #[derive(Debug, Default)]
    struct Counting {
        received: Arc<Mutex<Vec<(String, String)>>>,
    }

    impl Network for Counting {
        fn channel(&self, addr: &str, _: ServerKind) -> Result<GrpcChannel, String> {
            let received = self.received.clone();
            let addr = addr.to_string();
            Ok(GrpcChannel::new(tower::service_fn(
                move |req: http::Request<Body>| {
                    let received = received.clone();
                    let addr = addr.clone();
                    async move {
                        lock(&received).push((req.uri().path().to_string(), addr));
                        Ok::<_, NetError>(http::Response::new(Body::empty()))
                    }
                },
            )))
        }

        fn tls(&self) -> Option<&Arc<TlsMaterial>> {
            None
        }
    }

    fn request(method: &str) -> http::Request<Body> {
        http::Request::builder()
            .uri(format!("http://w1/granary.v1.WorkerService/{method}"))
            .body(Body::empty())
            .unwrap()
    }

    /// The status a call ends with (OK when the server answered).
    async fn call(ch: &mut GrpcChannel, method: &str) -> tonic::Code {
        let resp = ch
            .ready()
            .await
            .unwrap()
            .call(request(method))
            .await
            .unwrap();
        tonic::Status::from_header_map(resp.headers()).map_or(tonic::Code::Ok, |s| s.code())
    }

    /// What the servers received: (path, target).
    type Received = Arc<Mutex<Vec<(String, String)>>>;

    fn setup() -> (Faults, Received) {
        let counting = Counting::default();
        let received = counting.received.clone();
        (Faults::new(Arc::new(counting), 7), received)
    }

    #[tokio::test]
    async fn a_rule_fires_on_its_method_and_target_from_its_step_for_its_times() {
        let (faults, received) = setup();
        let id = faults.add(
            Rule::new(Fault::Error(tonic::Code::ResourceExhausted))
                .method("LoadBlocks")
                .target("http://w1:1")
                .from_step(1)
                .times(2),
        );
        let mut w1 = faults.channel("w1:1", ServerKind::Node).unwrap();
        let mut w2 = faults.channel("w2:1", ServerKind::Node).unwrap();
        let codes = [
            call(&mut w1, "LoadBlocks").await, // step 0: let through
            call(&mut w1, "ReadBlock").await,  // another method
            call(&mut w2, "LoadBlocks").await, // another target
            call(&mut w1, "LoadBlocks").await, // fires
            call(&mut w1, "LoadBlocks").await, // fires
            call(&mut w1, "LoadBlocks").await, // spent
        ];
        use tonic::Code::{Ok as Passed, ResourceExhausted as Refused};
        assert_eq!(codes, [Passed, Passed, Passed, Refused, Refused, Passed]);
        assert_eq!(faults.fired(id), 2);
        assert_eq!(lock(&received).len(), 4, "refused calls reach no server");
        faults.remove(id);
        assert_eq!(faults.fired(id), 0);
    }

    #[tokio::test]
    async fn drop_never_reaches_the_server_and_lose_does() {
        let (faults, received) = setup();
        let mut ch = faults.channel("w1:1", ServerKind::Node).unwrap();
        let drop = faults.add(Rule::new(Fault::Drop).times(1));
        assert_eq!(call(&mut ch, "Heartbeat").await, tonic::Code::Unavailable);
        assert!(lock(&received).is_empty());
        faults.remove(drop);
        faults.add(Rule::new(Fault::Lose).times(1));
        assert_eq!(call(&mut ch, "Heartbeat").await, tonic::Code::Unavailable);
        assert_eq!(lock(&received).len(), 1, "a lost answer was applied");
        assert_eq!(call(&mut ch, "Heartbeat").await, tonic::Code::Ok);
    }

    #[tokio::test]
    async fn delay_hang_and_reorder_hold_calls_as_told() {
        let (faults, received) = setup();
        let ch = faults.channel("w1:1", ServerKind::Node).unwrap();
        faults.add(
            Rule::new(Fault::Delay(Duration::from_millis(300)))
                .method("A")
                .times(1),
        );
        let t0 = tokio::time::Instant::now();
        assert_eq!(call(&mut ch.clone(), "A").await, tonic::Code::Ok);
        assert!(t0.elapsed() >= Duration::from_millis(300));

        faults.add(Rule::new(Fault::Hang).method("H"));
        let hung =
            tokio::time::timeout(Duration::from_millis(300), call(&mut ch.clone(), "H")).await;
        assert!(hung.is_err(), "a hung call returned");

        // The first R is held until the second has been answered: the server sees the
        // second first.
        let t0 = tokio::time::Instant::now();
        faults.add(
            Rule::new(Fault::Reorder(Duration::from_secs(30)))
                .method("R")
                .times(1),
        );
        lock(&received).clear();
        let (mut a, mut b) = (ch.clone(), ch.clone());
        let order = Arc::new(AtomicUsize::new(0));
        let first = {
            let order = order.clone();
            tokio::spawn(async move {
                let code = call(&mut a, "R").await;
                (code, order.fetch_add(1, Ordering::SeqCst))
            })
        };
        tokio::task::yield_now().await;
        let second = call(&mut b, "R").await;
        let second_at = order.fetch_add(1, Ordering::SeqCst);
        let (first_code, first_at) = first.await.unwrap();
        assert_eq!((first_code, second), (tonic::Code::Ok, tonic::Code::Ok));
        assert!(second_at < first_at, "the held call finished first");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "it waited out its cap"
        );
    }

    #[tokio::test]
    async fn a_server_that_is_not_there_is_unavailable_through_every_wrapper() {
        // What clients retry on: the wrapped transport error keeps its status.
        let refused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = refused.local_addr().unwrap().to_string();
        drop(refused);
        let faults = Faults::new(Tcp::net(None), 1);
        for net in [Tcp::net(None), faults.net()] {
            let ch = net.channel(&addr, ServerKind::Node).unwrap();
            let mut c = granary_proto::worker_service_client::WorkerServiceClient::new(ch);
            let err = c
                .get_cache_info(granary_proto::GetCacheInfoRequest::default())
                .await
                .unwrap_err();
            assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        }
        assert!(net_error_is_a_source_chain());
    }

    fn net_error_is_a_source_chain() -> bool {
        let e = NetError::new(std::io::Error::other("x"));
        std::error::Error::source(&e).is_some_and(|s| s.to_string() == "x")
    }

    #[test]
    fn chances_follow_the_seed() {
        let draws = |seed| {
            let (faults, _) = setup();
            let f = Faults::new(faults.inner.clone(), seed);
            (0..64).map(|_| f.state.draw()).collect::<Vec<f64>>()
        };
        assert_eq!(draws(1), draws(1));
        assert_ne!(draws(1), draws(2));
        assert!(draws(3).iter().all(|d| (0.0..1.0).contains(d)));
        let rule = Rule::new(Fault::Drop).method("/granary.v1.WorkerService/X");
        assert!(rule.matches("/granary.v1.WorkerService/X", "a"));
        assert!(!rule.matches("/granary.v1.MasterService/X", "a"));
        assert!(Rule::new(Fault::Drop)
            .method("X")
            .matches("/granary.v1.MasterService/X", "a"));
    }
}
