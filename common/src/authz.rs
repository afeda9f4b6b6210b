//! Who may call which RPC: one table for every gRPC method of the wire contract, enforced
//! by a tower layer in front of every server. A method missing from the table is refused
//! (deny by default); a test checks the table covers every `rpc` in the `.proto` files.
//!
//! The layer reads the principal from the connection's verified client certificate (parsed
//! once per certificate, then cached), refuses a caller without an allowed role with
//! `PERMISSION_DENIED`, and hands the principal to the handlers in the request's
//! extensions ([`principal`]) for path checks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::future::{Either, Ready};
use tonic::body::Body;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::tls::{Principal, Role};

const ANY: &[Role] = &[Role::Admin, Role::Node, Role::User];
const ADMIN: &[Role] = &[Role::Admin];
const NODE: &[Role] = &[Role::Node];
const NODE_OR_ADMIN: &[Role] = &[Role::Node, Role::Admin];

/// `(gRPC path, roles allowed)`.
const POLICY: &[(&str, &[Role])] = &[
    // Namespace: any principal (the master checks paths against its subtree).
    ("/granary.v1.MasterService/GetStatus", ANY),
    ("/granary.v1.MasterService/Lookup", ANY),
    ("/granary.v1.MasterService/ListStatus", ANY),
    ("/granary.v1.MasterService/Mkdir", ANY),
    ("/granary.v1.MasterService/CreateFile", ANY),
    ("/granary.v1.MasterService/CompleteFile", ANY),
    ("/granary.v1.MasterService/Delete", ANY),
    ("/granary.v1.MasterService/Rename", ANY),
    ("/granary.v1.MasterService/SyncMetadata", ANY),
    ("/granary.v1.MasterService/GetBlockLocations", ANY),
    ("/granary.v1.MasterService/ListMounts", ANY),
    ("/granary.v1.MasterService/GetClusterInfo", ANY),
    ("/granary.v1.MasterService/GetJob", ANY),
    ("/granary.v1.MasterService/ListJobs", ANY),
    // A worker reports that a file written through it reached the under-store.
    ("/granary.v1.MasterService/FilePersisted", NODE),
    // Under-store credentials go to workers only.
    ("/granary.v1.MasterService/GetMountAccess", NODE),
    ("/granary.v1.MasterService/RegisterWorker", NODE),
    ("/granary.v1.MasterService/WorkerHeartbeat", NODE),
    // Administration.
    ("/granary.v1.MasterService/AddMount", ADMIN),
    ("/granary.v1.MasterService/RemoveMount", ADMIN),
    ("/granary.v1.MasterService/DecommissionWorker", ADMIN),
    ("/granary.v1.MasterService/RecommissionWorker", ADMIN),
    ("/granary.v1.MasterService/AddMaster", ADMIN),
    ("/granary.v1.MasterService/RemoveMaster", ADMIN),
    ("/granary.v1.MasterService/StartJob", ADMIN),
    ("/granary.v1.MasterService/CancelJob", ADMIN),
    ("/granary.v1.MasterService/SetPin", ADMIN),
    ("/granary.v1.MasterService/Free", ADMIN),
    ("/granary.v1.MasterService/SetTtl", ADMIN),
    // Between masters; `granary master list` asks each member for its status.
    ("/granary.v1.RaftService/Send", NODE),
    ("/granary.v1.RaftService/InstallSnapshot", NODE),
    ("/granary.v1.RaftService/MemberStatus", NODE_OR_ADMIN),
    // Workers serve clients and each other.
    ("/granary.v1.WorkerService/ReadBlock", ANY),
    ("/granary.v1.WorkerService/GetCacheInfo", ANY),
    ("/granary.v1.WorkerService/LeaseLocalBlock", ANY),
    ("/granary.v1.WorkerService/WriteFile", ANY),
    // Load tasks come from the masters.
    ("/granary.v1.WorkerService/LoadBlocks", NODE),
];

/// The roles allowed to call a gRPC method (`None`: not in the table, refused).
pub fn allowed_roles(path: &str) -> Option<&'static [Role]> {
    POLICY.iter().find(|(p, _)| *p == path).map(|(_, r)| *r)
}

/// The principal the layer attached to a request (the unauthenticated one on a plaintext
/// server, or when a handler is called without the layer, as in unit tests).
pub fn principal<T>(req: &tonic::Request<T>) -> Arc<Principal> {
    req.extensions()
        .get::<Arc<Principal>>()
        .cloned()
        .unwrap_or_else(|| Arc::new(Principal::unauthenticated()))
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
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            principals: self.principals.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    principals: Arc<Principals>,
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
            None if crate::tls::material().is_none() => Arc::new(Principal::unauthenticated()),
            None => {
                return Err(tonic::Status::unauthenticated(
                    "a client certificate of the cluster CA is required",
                ))
            }
        };
        let Some(roles) = allowed_roles(path) else {
            return Err(tonic::Status::permission_denied(format!(
                "{path} is not a known operation"
            )));
        };
        if roles.iter().any(|r| principal.has(*r)) {
            return Ok(principal);
        }
        let need: Vec<&str> = roles.iter().map(|r| r.name()).collect();
        let method = path.rsplit('/').next().unwrap_or(path);
        Err(tonic::Status::permission_denied(format!(
            "{method} needs the {} role; {principal} does not have it",
            need.join(" or ")
        )))
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
                tracing::warn!(
                    method = req.uri().path(),
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
        assert_eq!(allowed_roles("/granary.v1.RaftService/Send"), Some(NODE));
        assert_eq!(allowed_roles("/granary.v1.Nope/X"), None);
    }
}
