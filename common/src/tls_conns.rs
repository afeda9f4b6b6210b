//! The TLS connections a server has accepted and not yet closed, each with the certificate
//! chain its peer presented, so that a change of the trusted CAs also reaches connections
//! already open: when [`crate::tls::TlsMaterial::reload`] takes a new CA file, every open
//! connection whose chain the new CAs do not verify is ended (its reads and writes fail,
//! the server drops it, and its client's next connection is verified anew). Dropping a
//! compromised CA from `ca.crt` so ends what it signed within one reload, without a
//! restart.
//!
//! A connection is judged at the time of its handshake: one whose certificate only
//! expired since is kept (ending it would fail the streams of every connection made before
//! a renewal, at the old certificate's end).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::rustls::pki_types::{CertificateDer, UnixTime};
use tokio_rustls::rustls::server::danger::ClientCertVerifier;

/// What ends one connection from outside its task.
#[derive(Default)]
struct EndSwitch {
    ended: AtomicBool,
    waker: AtomicWaker,
}

impl EndSwitch {
    fn end(&self) {
        self.ended.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Whether the connection was ended; if not, `cx` is woken when it is.
    fn ended(&self, cx: &Context<'_>) -> bool {
        if self.ended.load(Ordering::Acquire) {
            return true;
        }
        self.waker.register(cx.waker());
        self.ended.load(Ordering::Acquire)
    }
}

fn ended_error() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "the connection was ended: the CAs this server trusts no longer verify its peer's certificate",
    )
}

/// One open connection's peer chain and when its handshake was made.
struct Open {
    chain: Arc<Vec<CertificateDer<'static>>>,
    at: UnixTime,
    end: Arc<EndSwitch>,
}

type Verifier = Arc<dyn ClientCertVerifier>;

/// The open connections and the CAs they must verify against.
#[derive(Default)]
struct Table {
    open: HashMap<u64, Open>,
    /// Counts the CA changes [`OpenConnections::end_untrusted`] was told of.
    generation: u64,
    /// The verifier of the latest change (None: none since start).
    verifier: Option<Verifier>,
}

/// The open connections of the servers of one identity ([`crate::tls::TlsMaterial`]).
///
/// A handshake that began with the CAs of before a change and ends after the change judged
/// the open connections is judged when it is tracked: [`Tracked`] notes the generation it
/// began in, and [`OpenConnections::track`] verifies its chain against the latest CAs when
/// the generation moved since.
#[derive(Default)]
pub struct OpenConnections {
    next: AtomicU64,
    table: Mutex<Table>,
}

/// Removes its connection from [`OpenConnections`] when the connection is dropped.
struct Entry {
    conns: Arc<OpenConnections>,
    id: u64,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.conns.lock().open.remove(&self.id);
    }
}

fn verifies(verifier: &dyn ClientCertVerifier, chain: &[CertificateDer<'_>], at: UnixTime) -> bool {
    let Some((leaf, intermediates)) = chain.split_first() else {
        return true;
    };
    verifier.verify_client_cert(leaf, intermediates, at).is_ok()
}

impl OpenConnections {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `io` as a socket these connections can end, noting the CA generation now: take it
    /// before the acceptor its handshake is made with (as [`crate::tls::TlsMaterial`]'s
    /// `*_accept` do).
    pub(crate) fn wrap<T>(&self, io: T) -> Tracked<T> {
        Tracked {
            entry: None,
            end: Arc::default(),
            began: self.lock().generation,
            io,
        }
    }

    /// Tracks `stream`, whose handshake is done, with the chain its peer presented (a
    /// connection without one is not tracked: servers here require client certificates).
    /// When the CAs changed since its handshake began, it is verified against the new ones
    /// now, and ended when they do not verify it.
    pub fn track<T>(self: &Arc<Self>, stream: &mut tokio_rustls::server::TlsStream<Tracked<T>>) {
        let (io, session) = stream.get_mut();
        let Some(chain) = session.peer_certificates() else {
            return;
        };
        let chain: Arc<Vec<_>> = Arc::new(chain.iter().map(|c| c.clone().into_owned()).collect());
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let at = UnixTime::now();
        let changed = {
            let mut table = self.lock();
            table.open.insert(
                id,
                Open {
                    chain: chain.clone(),
                    at,
                    end: io.end.clone(),
                },
            );
            // Inserted before this look: a change after it judges the entry itself.
            (table.generation != io.began)
                .then(|| table.verifier.clone())
                .flatten()
        };
        io.entry = Some(Entry {
            conns: self.clone(),
            id,
        });
        if let Some(verifier) = changed {
            if !verifies(verifier.as_ref(), &chain, at) {
                io.end.end();
                tracing::warn!(
                    "ended a connection whose handshake began before a CA change and whose \
                     certificate the new CA file does not verify"
                );
            }
        }
    }

    /// Takes `verifier` as the CAs' from now on and ends every open connection whose peer
    /// chain it does not verify at the time of its handshake; how many it ended.
    pub fn end_untrusted(&self, verifier: Verifier) -> usize {
        let open: Vec<_> = {
            let mut table = self.lock();
            table.generation += 1;
            table.verifier = Some(verifier.clone());
            table
                .open
                .values()
                .map(|o| (o.chain.clone(), o.at, o.end.clone()))
                .collect()
        };
        // Verified outside the lock: connections come and go meanwhile.
        let mut ended = 0;
        for (chain, at, end) in open {
            if !verifies(verifier.as_ref(), &chain, at) {
                end.end();
                ended += 1;
            }
        }
        ended
    }

    /// How many connections are open.
    pub fn len(&self) -> usize {
        self.lock().open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A server's socket under TLS that [`OpenConnections`] can end: once ended, its reads and
/// writes fail at once (a task waiting on it is woken).
pub struct Tracked<T> {
    /// Dropped before `io`, so that the entry goes before the socket does.
    entry: Option<Entry>,
    end: Arc<EndSwitch>,
    /// The CA generation when the handshake began.
    began: u64,
    io: T,
}

impl<T> Tracked<T> {
    pub fn get_ref(&self) -> &T {
        &self.io
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Tracked<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.end.ended(cx) {
            return Poll::Ready(Err(ended_error()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tracked<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.end.ended(cx) {
            return Poll::Ready(Err(ended_error()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.end.ended(cx) {
            return Poll::Ready(Err(ended_error()));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.end.ended(cx) {
            return Poll::Ready(Err(ended_error()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Tracked<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{issue, new_ca, LeafSpec, Role, TlsMaterial};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A connection accepted with the material of `server`, from a client of `client`;
    /// `between` runs after the server took its CAs and before the handshake.
    async fn connect_with(
        server: &TlsMaterial,
        client: &TlsMaterial,
        between: impl FnOnce(),
    ) -> (
        tokio_rustls::server::TlsStream<Tracked<tokio::net::TcpStream>>,
        tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    ) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let connector = client.stream_connector();
        let (accepted, connected) = tokio::join!(
            async {
                let (s, _) = l.accept().await.unwrap();
                let handshake = server.stream_accept(s);
                between();
                handshake.await
            },
            async {
                let s = tokio::net::TcpStream::connect(addr).await.unwrap();
                connector
                    .connect(crate::tls::node_server_name().unwrap(), s)
                    .await
            }
        );
        let mut accepted = accepted.unwrap();
        server.open_connections().track(&mut accepted);
        (accepted, connected.unwrap())
    }

    async fn connect(
        server: &TlsMaterial,
        client: &TlsMaterial,
    ) -> (
        tokio_rustls::server::TlsStream<Tracked<tokio::net::TcpStream>>,
        tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    ) {
        connect_with(server, client, || {}).await
    }

    /// A server trusting CAs a and b from its files, clients of a and of b, and how to
    /// rewrite the server's CA file to a alone.
    struct Fixture {
        dir: std::path::PathBuf,
        server: TlsMaterial,
        of_a: TlsMaterial,
        of_b: TlsMaterial,
        drop_b: Box<dyn Fn()>,
    }

    impl Fixture {
        fn new(name: &str) -> Fixture {
            let (a, b) = (new_ca("a", 1).unwrap(), new_ca("b", 1).unwrap());
            let dir = std::env::temp_dir()
                .join(format!("granary-tls-conns-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let files = crate::tls::TlsFiles::in_dir(&dir);
            let node = issue(&a, &LeafSpec::new("w", &[Role::Node], 1)).unwrap();
            files
                .write(&format!("{}{}", a.cert, b.cert), &node)
                .unwrap();
            let server = TlsMaterial::load(&files).unwrap();
            let client_of = |ca: &crate::tls::Pems, name: &str| {
                // Trusts the server's CA (a), presents a certificate of `ca`.
                let own = issue(ca, &LeafSpec::new(name, &[Role::Admin], 1)).unwrap();
                let chain = format!("{}{}", a.cert, ca.cert);
                TlsMaterial::from_pems(chain, own).unwrap()
            };
            let (of_a, of_b) = (client_of(&a, "ca"), client_of(&b, "cb"));
            let a_cert = a.cert.clone();
            let drop_b = Box::new(move || files.write(&a_cert, &node).unwrap());
            Fixture {
                dir,
                server,
                of_a,
                of_b,
                drop_b,
            }
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[tokio::test]
    async fn a_dropped_ca_ends_the_open_connections_it_signed_and_only_those() {
        let f = Fixture::new("open");
        let server = &f.server;
        let (mut sa, mut ca) = connect(server, &f.of_a).await;
        let (mut sb, mut cb) = connect(server, &f.of_b).await;
        assert_eq!(server.open_connections().len(), 2);

        // The server reads on both while the CA file changes.
        let read_b = tokio::spawn(async move {
            let mut byte = [0u8; 1];
            sb.read(&mut byte).await
        });
        (f.drop_b)();
        assert!(server.reload().unwrap());
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), read_b)
            .await
            .expect("the waiting read was woken")
            .unwrap();
        assert_eq!(
            ended.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionAborted
        );
        // The connection of a's certificate is kept and works.
        ca.write_all(b"x").await.unwrap();
        ca.flush().await.unwrap();
        let mut byte = [0u8; 1];
        sa.read_exact(&mut byte).await.unwrap();
        assert_eq!(&byte, b"x");
        // b's went from the table when its stream was dropped; its client sees the end.
        assert_eq!(server.open_connections().len(), 1);
        let mut rest = Vec::new();
        let _ = cb.read_to_end(&mut rest).await;
        drop(sa);
        assert!(server.open_connections().is_empty());
    }

    #[tokio::test]
    async fn a_handshake_begun_before_a_ca_change_is_judged_by_the_new_cas() {
        let f = Fixture::new("race");
        let server = &f.server;
        // Both handshakes use the CAs of before the change (a and b) and end after it.
        let change = || {
            (f.drop_b)();
            server.reload().unwrap();
        };
        let (mut sb, _cb) = connect_with(server, &f.of_b, change).await;
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), sb.read(&mut byte))
            .await
            .expect("the connection was ended, not left waiting");
        assert_eq!(
            read.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionAborted
        );
        let (mut sa, mut ca) = connect_with(server, &f.of_a, || {}).await;
        ca.write_all(b"y").await.unwrap();
        ca.flush().await.unwrap();
        sa.read_exact(&mut byte).await.unwrap();
        assert_eq!(&byte, b"y");
    }
}
