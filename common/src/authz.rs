//! Who may call which RPC: one table for every gRPC method of the wire contract, enforced
//! by a tower layer in front of every server. A method missing from the table is refused
//! (deny by default); a test checks the table covers every `rpc` in the `.proto` files.
//! The table also bounds each method's request messages ([`request_limit`]): control
//! methods take small messages, the few that carry data or block lists larger ones.
//!
//! The layer reads the principal from the connection's verified client certificate (parsed
//! once per certificate, then cached), refuses a caller without an allowed role with
//! `PERMISSION_DENIED`, and hands the principal to the handlers in the request's
//! extensions ([`principal`]) for path checks. A handler reached without one refuses.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::future::{Either, Ready};
use tonic::body::Body;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::tls::{Principal, Role};

const ANY: &[Role] = &[Role::Admin, Role::Node, Role::User, Role::Master];
const ADMIN: &[Role] = &[Role::Admin];
/// Workers (and mounts on a GPU node holding a node certificate).
const NODE: &[Role] = &[Role::Node];
/// Masters only: a worker certificate is refused.
const MASTER: &[Role] = &[Role::Master];
const MASTER_OR_ADMIN: &[Role] = &[Role::Master, Role::Admin];

/// Largest request message of a control method (paths, ids, options, short lists).
pub const CONTROL_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Largest request message of `WriteFile` (a header or a chunk of file data: clients send
/// at most 4 MiB per message).
pub const WRITE_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// Largest request message of the cluster's own bulk methods (Raft batches and snapshot
/// chunks, a worker's full block report, load tasks): callers are masters or workers.
pub const BULK_MESSAGE_BYTES: usize = granary_proto::MAX_MESSAGE_BYTES;
/// The request limits in use, smallest first.
pub const REQUEST_LIMITS: [usize; 3] = [
    CONTROL_MESSAGE_BYTES,
    WRITE_MESSAGE_BYTES,
    BULK_MESSAGE_BYTES,
];

const CONTROL: usize = CONTROL_MESSAGE_BYTES;
const WRITE: usize = WRITE_MESSAGE_BYTES;
const BULK: usize = BULK_MESSAGE_BYTES;

/// `(gRPC path, roles allowed, largest request message)`.
#[rustfmt::skip]
const POLICY: &[(&str, &[Role], usize)] = &[
    // Namespace: any principal (the master checks paths against its subtree).
    ("/granary.v1.MasterService/GetStatus", ANY, CONTROL),
    ("/granary.v1.MasterService/Lookup", ANY, CONTROL),
    ("/granary.v1.MasterService/ListStatus", ANY, CONTROL),
    ("/granary.v1.MasterService/Mkdir", ANY, CONTROL),
    ("/granary.v1.MasterService/CreateFile", ANY, CONTROL),
    ("/granary.v1.MasterService/CompleteFile", ANY, CONTROL),
    ("/granary.v1.MasterService/Delete", ANY, CONTROL),
    ("/granary.v1.MasterService/Rename", ANY, CONTROL),
    ("/granary.v1.MasterService/SyncMetadata", ANY, CONTROL),
    // Inode numbers of changes, for clients' status caches (no names, no contents).
    ("/granary.v1.MasterService/WatchNamespace", ANY, CONTROL),
    ("/granary.v1.MasterService/GetBlockLocations", ANY, CONTROL),
    ("/granary.v1.MasterService/ListMounts", ANY, CONTROL),
    ("/granary.v1.MasterService/GetClusterInfo", ANY, CONTROL),
    ("/granary.v1.MasterService/GetJob", ANY, CONTROL),
    ("/granary.v1.MasterService/ListJobs", ANY, CONTROL),
    // A worker reports that a file written through it reached the under-store.
    ("/granary.v1.MasterService/FilePersisted", NODE, CONTROL),
    // Under-store credentials go to workers (and node mounts) only.
    ("/granary.v1.MasterService/GetMountAccess", NODE, CONTROL),
    // A registration lists every block the worker holds; a heartbeat the changes.
    ("/granary.v1.MasterService/RegisterWorker", NODE, BULK),
    ("/granary.v1.MasterService/WorkerHeartbeat", NODE, BULK),
    // Administration.
    ("/granary.v1.MasterService/AddMount", ADMIN, CONTROL),
    ("/granary.v1.MasterService/RemoveMount", ADMIN, CONTROL),
    ("/granary.v1.MasterService/DecommissionWorker", ADMIN, CONTROL),
    ("/granary.v1.MasterService/RecommissionWorker", ADMIN, CONTROL),
    ("/granary.v1.MasterService/AddMaster", ADMIN, CONTROL),
    ("/granary.v1.MasterService/RemoveMaster", ADMIN, CONTROL),
    ("/granary.v1.MasterService/StartJob", ADMIN, CONTROL),
    ("/granary.v1.MasterService/CancelJob", ADMIN, CONTROL),
    ("/granary.v1.MasterService/SetPin", ADMIN, CONTROL),
    ("/granary.v1.MasterService/Free", ADMIN, CONTROL),
    ("/granary.v1.MasterService/SetTtl", ADMIN, CONTROL),
    // Between masters (the sender must be the master its certificate names: checked by
    // the Raft service); `granary master list` asks each member for its status.
    ("/granary.v1.RaftService/Send", MASTER, BULK),
    ("/granary.v1.RaftService/SendStream", MASTER, BULK),
    ("/granary.v1.RaftService/InstallSnapshot", MASTER, BULK),
    ("/granary.v1.RaftService/MemberStatus", MASTER_OR_ADMIN, CONTROL),
    // The leader's grant key, for followers that sign grants with it.
    ("/granary.v1.RaftService/GrantKey", MASTER, CONTROL),
    // Workers serve clients and each other.
    ("/granary.v1.WorkerService/ReadBlock", ANY, CONTROL),
    ("/granary.v1.WorkerService/GetCacheInfo", ANY, CONTROL),
    ("/granary.v1.WorkerService/LeaseLocalBlock", ANY, CONTROL),
    // Whole blocks cached ahead of a client's readers, each under the caller's grant.
    ("/granary.v1.WorkerService/CacheBlocks", ANY, CONTROL),
    ("/granary.v1.WorkerService/WriteFile", ANY, WRITE),
    // Load tasks come from the masters.
    ("/granary.v1.WorkerService/LoadBlocks", MASTER, BULK),
];

/// The roles allowed to call a gRPC method (`None`: not in the table, refused).
pub fn allowed_roles(path: &str) -> Option<&'static [Role]> {
    POLICY.iter().find(|(p, ..)| *p == path).map(|(_, r, _)| *r)
}

/// The largest request message a gRPC method accepts (a method not in the table: the
/// control limit; it is refused anyway).
pub fn request_limit(path: &str) -> usize {
    POLICY
        .iter()
        .find(|(p, ..)| *p == path)
        .map_or(CONTROL_MESSAGE_BYTES, |(_, _, l)| *l)
}

/// The principal the layer attached to a request (the unauthenticated one on a plaintext
/// server). A request without one did not pass the layer (a server built without
/// [`crate::grpc::server`], a handler called directly): it is refused, never trusted.
pub fn principal<T>(req: &tonic::Request<T>) -> Result<Arc<Principal>, tonic::Status> {
    req.extensions()
        .get::<Arc<Principal>>()
        .cloned()
        .ok_or_else(|| {
            tracing::error!("a request reached a handler without a principal; refused");
            tonic::Status::unauthenticated(
                "no principal is attached to this request (it did not pass the authorization layer)",
            )
        })
}

/// Refuses a Raft message unless its sender is the master the caller's certificate names
/// (any sender on a plaintext cluster): a master certificate speaks for its own id only.
pub fn check_master_sender(who: &Principal, from: u64) -> Result<(), tonic::Status> {
    if who.speaks_for_master(from) {
        return Ok(());
    }
    let cert = match who.master_id {
        Some(id) => format!("master {id}"),
        None => "no master".to_string(),
    };
    tracing::warn!(caller = %who, from, "raft message refused: the sender is not the caller's master id");
    Err(tonic::Status::permission_denied(format!(
        "a raft message from master {from} refused: the certificate of {} names {cert}",
        who.name
    )))
}

/// A bound on the concurrent calls of one kind per principal (an expensive call such as a
/// recursive `SyncMetadata`): beyond it, `RESOURCE_EXHAUSTED` with a message.
pub struct CallLimit {
    what: &'static str,
    max: u32,
    running: Mutex<BTreeMap<String, u32>>,
}

/// A slot of a [`CallLimit`], given back on drop.
pub struct CallSlot<'a> {
    limit: &'a CallLimit,
    who: String,
}

impl CallLimit {
    /// `max` concurrent calls of `what` per principal.
    pub const fn new(what: &'static str, max: u32) -> CallLimit {
        CallLimit {
            what,
            max,
            running: Mutex::new(BTreeMap::new()),
        }
    }

    /// Takes a slot for `who`, or refuses when it already holds `max`.
    pub fn enter(&self, who: &Principal) -> Result<CallSlot<'_>, tonic::Status> {
        let mut m = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(who.name.clone()).or_insert(0);
        if *n >= self.max {
            return Err(tonic::Status::resource_exhausted(format!(
                "{} already runs {} {} at once (the most one principal may); retry when one ends",
                who.name, n, self.what
            )));
        }
        *n += 1;
        Ok(CallSlot {
            limit: self,
            who: who.name.clone(),
        })
    }
}

impl Drop for CallSlot<'_> {
    fn drop(&mut self) {
        let mut m = self.limit.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.who) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.who);
            }
        }
    }
}

/// Whether `principal` may call the method at `path` (`PERMISSION_DENIED` naming the
/// method, the roles it needs and the caller when not).
pub fn authorize_method(path: &str, principal: &Principal) -> Result<(), tonic::Status> {
    let Some(roles) = allowed_roles(path) else {
        return Err(tonic::Status::permission_denied(format!(
            "{path} is not a known operation"
        )));
    };
    if roles.iter().any(|r| principal.has(*r)) {
        return Ok(());
    }
    let need: Vec<&str> = roles.iter().map(|r| r.name()).collect();
    let method = path.rsplit('/').next().unwrap_or(path);
    Err(tonic::Status::permission_denied(format!(
        "{method} needs the {} role; {principal} does not have it",
        need.join(" or ")
    )))
}

/// Certificates seen → their principal (a handful per process; cleared if it grows).
#[derive(Default)]
struct Principals(Mutex<HashMap<Vec<u8>, Arc<Principal>>>);

impl Principals {
    fn of(&self, der: &[u8]) -> Result<Arc<Principal>, String> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = map.get(der) {
            return Ok(p.clone());
        }
        let p = Arc::new(Principal::from_certificate(der).map_err(|e| e.to_string())?);
        if map.len() >= 4096 {
            map.clear();
        }
        map.insert(der.to_vec(), p.clone());
        Ok(p)
    }
}

/// The authorization layer of every server ([`crate::grpc::server`]).
#[derive(Clone, Default)]
pub struct AuthLayer {
    principals: Arc<Principals>,
    /// The server has no TLS: callers are unauthenticated principals (`--insecure`).
    plaintext: bool,
}

impl AuthLayer {
    /// For a server with TLS (`plaintext` false: a caller without a certificate is
    /// refused) or without.
    pub fn new(plaintext: bool) -> AuthLayer {
        AuthLayer {
            principals: Arc::default(),
            plaintext,
        }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            principals: self.principals.clone(),
            plaintext: self.plaintext,
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    principals: Arc<Principals>,
    plaintext: bool,
}

impl<S> Auth<S> {
    fn authorize(&self, req: &http::Request<Body>) -> Result<Arc<Principal>, tonic::Status> {
        let path = req.uri().path();
        let tls = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>();
        let principal = match tls.and_then(|t| t.peer_certs()) {
            Some(certs) => {
                let leaf = certs.first().ok_or_else(|| {
                    tonic::Status::unauthenticated("no client certificate was presented")
                })?;
                self.principals
                    .of(leaf.as_ref())
                    .map_err(tonic::Status::unauthenticated)?
            }
            None if self.plaintext => Arc::new(Principal::unauthenticated()),
            None => {
                return Err(tonic::Status::unauthenticated(
                    "a client certificate of the cluster CA is required",
                ))
            }
        };
        authorize_method(path, &principal)?;
        Ok(principal)
    }
}

impl<S> tower::Service<http::Request<Body>> for Auth<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<http::Response<Body>, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        match self.authorize(&req) {
            Ok(principal) => {
                req.extensions_mut().insert(principal);
                Either::Left(self.inner.call(req))
            }
            Err(status) => {
                let ext = req.extensions();
                let caller = ext
                    .get::<TlsConnectInfo<TcpConnectInfo>>()
                    .map(|t| t.get_ref())
                    .or_else(|| ext.get::<TcpConnectInfo>())
                    .and_then(|t| t.remote_addr());
                tracing::warn!(
                    method = req.uri().path(),
                    peer = ?caller,
                    code = ?status.code(),
                    reason = status.message(),
                    "request refused"
                );
                Either::Right(futures::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `rpc` of the wire contract has an entry (else it would be refused to all).
    #[test]
    fn the_policy_covers_every_rpc_of_the_proto_files() {
        // The crate's folder as cargo runs the test (a test binary reused from a checkout
        // at another path would carry that path in `env!`).
        let crate_dir = std::env::var("CARGO_MANIFEST_DIR")
            .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
        let dir = std::path::Path::new(&crate_dir).join("../proto/proto/granary/v1");
        let mut methods = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            let mut service = String::new();
            for line in text.lines() {
                let words: Vec<&str> = line.split_whitespace().collect();
                match words.as_slice() {
                    ["service", name, ..] => service = name.to_string(),
                    ["rpc", rest, ..] => {
                        let name = rest.split('(').next().unwrap();
                        methods.push(format!("/granary.v1.{service}/{name}"));
                    }
                    _ => {}
                }
            }
        }
        assert!(methods.len() > 30, "{methods:?}");
        for m in &methods {
            assert!(allowed_roles(m).is_some(), "no policy for {m}");
        }
        assert_eq!(
            methods.len(),
            POLICY.len(),
            "the policy names methods that do not exist"
        );
    }

    #[test]
    fn admin_operations_need_the_admin_role() {
        assert_eq!(
            allowed_roles("/granary.v1.MasterService/AddMount"),
            Some(ADMIN)
        );
        assert_eq!(
            allowed_roles("/granary.v1.MasterService/StartJob"),
            Some(ADMIN)
        );
        assert_eq!(allowed_roles("/granary.v1.RaftService/Send"), Some(MASTER));
        assert_eq!(allowed_roles("/granary.v1.Nope/X"), None);
    }

    fn worker() -> Principal {
        Principal::new("worker-7", &[Role::Node], None)
    }

    fn master(id: u64) -> Principal {
        Principal::new(&format!("master-{id}"), &[Role::Master], None).with_master_id(id)
    }

    #[test]
    fn a_worker_certificate_cannot_speak_raft_or_send_load_tasks() {
        for m in [
            "/granary.v1.RaftService/Send",
            "/granary.v1.RaftService/SendStream",
            "/granary.v1.RaftService/InstallSnapshot",
            "/granary.v1.RaftService/MemberStatus",
            "/granary.v1.RaftService/GrantKey",
            "/granary.v1.WorkerService/LoadBlocks",
        ] {
            let e = authorize_method(m, &worker()).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{m}");
            assert!(e.message().contains("needs the master"), "{m}: {e:?}");
            assert!(e.message().contains("worker-7 (node)"), "{m}: {e:?}");
            authorize_method(m, &master(1)).unwrap();
        }
        // What a worker needs of a master stays open to it, and closed to masters.
        for m in [
            "/granary.v1.MasterService/RegisterWorker",
            "/granary.v1.MasterService/WorkerHeartbeat",
            "/granary.v1.MasterService/FilePersisted",
            "/granary.v1.MasterService/GetMountAccess",
        ] {
            authorize_method(m, &worker()).unwrap();
            let e = authorize_method(m, &master(1)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{m}");
        }
        // Users and admins speak no Raft; an admin may ask a member's status.
        let user = Principal::new("alice", &[Role::User], None);
        let admin = Principal::new("ops", &[Role::Admin], None);
        assert!(authorize_method("/granary.v1.RaftService/Send", &user).is_err());
        assert!(authorize_method("/granary.v1.RaftService/Send", &admin).is_err());
        // The grant key signs what workers cache: masters only, not even admins.
        assert!(authorize_method("/granary.v1.RaftService/GrantKey", &user).is_err());
        assert!(authorize_method("/granary.v1.RaftService/GrantKey", &admin).is_err());
        authorize_method("/granary.v1.RaftService/MemberStatus", &admin).unwrap();
        // The plaintext caller may do everything.
        for (m, ..) in POLICY {
            authorize_method(m, &Principal::unauthenticated()).unwrap();
        }
    }

    #[test]
    fn a_raft_sender_must_be_the_certificates_master() {
        check_master_sender(&master(2), 2).unwrap();
        let e = check_master_sender(&master(2), 1).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            e.message(),
            "a raft message from master 1 refused: the certificate of master-2 names master 2"
        );
        let e = check_master_sender(&worker(), 1).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("names no master"), "{e:?}");
        // A master id without the master role speaks for nobody.
        let odd = Principal::new("odd", &[Role::Node], None).with_master_id(1);
        assert!(check_master_sender(&odd, 1).is_err());
        check_master_sender(&Principal::unauthenticated(), 9).unwrap();
    }

    #[test]
    fn a_request_without_a_principal_is_refused() {
        let req = tonic::Request::new(());
        let e = principal(&req).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let mut req = tonic::Request::new(());
        req.extensions_mut()
            .insert(Arc::new(Principal::unauthenticated()));
        assert!(principal(&req).unwrap().is_unauthenticated());
    }

    #[test]
    fn request_limits_are_small_for_control_methods() {
        assert_eq!(
            request_limit("/granary.v1.MasterService/GetStatus"),
            4 << 20
        );
        assert_eq!(
            request_limit("/granary.v1.WorkerService/ReadBlock"),
            4 << 20
        );
        assert_eq!(
            request_limit("/granary.v1.WorkerService/WriteFile"),
            16 << 20
        );
        assert_eq!(request_limit("/granary.v1.RaftService/Send"), 64 << 20);
        // Every bulk method is closed to users.
        let user = Principal::new("alice", &[Role::User], None);
        for (m, _, l) in POLICY {
            assert!(REQUEST_LIMITS.contains(l), "{m}");
            if *l == BULK {
                assert!(authorize_method(m, &user).is_err(), "{m}");
            }
        }
    }

    #[test]
    fn expensive_calls_are_limited_per_principal() {
        static LIMIT: CallLimit = CallLimit::new("recursive syncs", 2);
        let alice = Principal::new("alice", &[Role::User], None);
        let bob = Principal::new("bob", &[Role::User], None);
        let a1 = LIMIT.enter(&alice).unwrap();
        let _a2 = LIMIT.enter(&alice).unwrap();
        let e = LIMIT.enter(&alice).err().unwrap();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            e.message(),
            "alice already runs 2 recursive syncs at once (the most one principal may); retry when one ends"
        );
        // Others are not held up; a slot ended is free again.
        let _b = LIMIT.enter(&bob).unwrap();
        drop(a1);
        let _a3 = LIMIT.enter(&alice).unwrap();
    }
}
