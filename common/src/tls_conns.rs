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
    chain: Vec<CertificateDer<'static>>,
    at: UnixTime,
    end: Arc<EndSwitch>,
}

/// The open connections of the servers of one identity ([`crate::tls::TlsMaterial`]).
#[derive(Default)]
pub struct OpenConnections {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Open>>,
}

/// Removes its connection from [`OpenConnections`] when the connection is dropped.
struct Entry {
    conns: Arc<OpenConnections>,
    id: u64,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.id);
    }
}

impl OpenConnections {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Open>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tracks `stream`, whose handshake is done, with the chain its peer presented (a
    /// connection without one is not tracked: servers here require client certificates).
    pub fn track<T>(self: &Arc<Self>, stream: &mut tokio_rustls::server::TlsStream<Tracked<T>>) {
        let (io, session) = stream.get_mut();
        let Some(chain) = session.peer_certificates() else {
            return;
        };
        let chain = chain.iter().map(|c| c.clone().into_owned()).collect();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(
            id,
            Open {
                chain,
                at: UnixTime::now(),
                end: io.end.clone(),
            },
        );
        io.entry = Some(Entry {
            conns: self.clone(),
            id,
        });
    }

    /// Ends every open connection whose peer chain `verifier` does not verify at the time
    /// of its handshake; how many it ended.
    pub fn end_untrusted(&self, verifier: &dyn ClientCertVerifier) -> usize {
        let open = self.lock();
        let mut ended = 0;
        for o in open.values() {
            let Some((leaf, intermediates)) = o.chain.split_first() else {
                continue;
            };
            if verifier
                .verify_client_cert(leaf, intermediates, o.at)
                .is_err()
            {
                o.end.end();
                ended += 1;
            }
        }
        ended
    }

    /// How many connections are open.
    pub fn len(&self) -> usize {
        self.lock().len()
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
    io: T,
}

impl<T> Tracked<T> {
    pub fn new(io: T) -> Tracked<T> {
        Tracked {
            entry: None,
            end: Arc::default(),
            io,
        }
    }

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

    /// A connection accepted with the material of `server`, from a client of `client`.
    async fn connect(
        server: &TlsMaterial,
        client: &TlsMaterial,
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
                server.stream_acceptor().accept(Tracked::new(s)).await
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

    #[tokio::test]
    async fn a_dropped_ca_ends_the_open_connections_it_signed_and_only_those() {
        let (a, b) = (new_ca("a", 1).unwrap(), new_ca("b", 1).unwrap());
        let dir = std::env::temp_dir().join(format!("granary-tls-conns-{}", std::process::id()));
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
        let (mut sa, mut ca) = connect(&server, &of_a).await;
        let (mut sb, mut cb) = connect(&server, &of_b).await;
        assert_eq!(server.open_connections().len(), 2);

        // The server reads on both while the CA file changes.
        let read_b = tokio::spawn(async move {
            let mut byte = [0u8; 1];
            sb.read(&mut byte).await
        });
        files.write(&a.cert, &node).unwrap();
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
        let _ = std::fs::remove_dir_all(&dir);
    }
}
