//! A TCP proxy that gives every connection the shape of a real object store's: its
//! downstream bytes paced to a fixed rate per connection, and a round trip added before the
//! server sees each request. Benchmarks put it between Granary (or a direct GET) and an
//! emulator on loopback, where one stream is otherwise limited only by the CPU.
//!
//!   flow-shaper LISTEN UPSTREAM MBIT_PER_CONNECTION RTT_MS
//!
//! Prints the bound address on the first line of stdout, then serves until killed.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

const CHUNK: usize = 64 * 1024;
/// A pause this long behind schedule means the connection was idle, not slow to be read.
const IDLE: Duration = Duration::from_millis(100);

fn usage() -> ! {
    eprintln!("usage: flow-shaper LISTEN UPSTREAM MBIT_PER_CONNECTION RTT_MS");
    std::process::exit(2)
}

/// Client → server: each chunk is forwarded one round trip after it arrived.
async fn delayed(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, rtt: Duration) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send((Instant::now() + rtt, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    });
    while let Some((at, data)) = rx.recv().await {
        tokio::time::sleep_until(at).await;
        if to.write_all(&data).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
    reader.abort();
}

/// Server → client: paced to `bytes_per_sec`. An idle connection banks no credit: a
/// response after a pause is paced from its own first byte.
async fn paced(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, bytes_per_sec: f64) {
    let mut buf = vec![0u8; CHUNK];
    let mut start = Instant::now();
    let mut sent = 0f64;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let now = Instant::now();
        if now > start + Duration::from_secs_f64(sent / bytes_per_sec) + IDLE {
            start = now;
            sent = 0.0;
        }
        sent += n as f64;
        tokio::time::sleep_until(start + Duration::from_secs_f64(sent / bytes_per_sec)).await;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

async fn serve(client: TcpStream, upstream: SocketAddr, rate: f64, rtt: Duration) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::join!(delayed(cr, sw, rtt), paced(sr, cw, rate));
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 4 {
        usage();
    }
    let upstream: SocketAddr = args[1].parse().unwrap_or_else(|_| usage());
    let mbit: f64 = args[2].parse().unwrap_or_else(|_| usage());
    let rtt_ms: u64 = args[3].parse().unwrap_or_else(|_| usage());
    let listener = match TcpListener::bind(&args[0]).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("flow-shaper: cannot listen on {}: {e}", args[0]);
            std::process::exit(1)
        }
    };
    match listener.local_addr() {
        Ok(a) => println!("{a}"),
        Err(e) => {
            eprintln!("flow-shaper: {e}");
            std::process::exit(1)
        }
    }
    let rate = mbit * 1e6 / 8.0;
    let rtt = Duration::from_millis(rtt_ms);
    loop {
        if let Ok((c, _)) = listener.accept().await {
            tokio::spawn(serve(c, upstream, rate, rtt));
        }
    }
}
