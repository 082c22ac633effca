//! Who may hold the HTTP port, and for how long. Answers cost the node nothing (they come
//! from memory), but each open connection is a socket and a task: a client that opens
//! many, or opens one and never finishes a request (slowloris), must not be able to
//! hold them without end — the process's file descriptors are the firing's too.
//!
//! - One remote address holds at most `max_per_client` connections at once; more are
//!   closed as soon as they are accepted. Loopback peers (the pod's own containers, the
//!   host) are not limited with `http.exempt_loopback` (the default): they share the
//!   node's trust. Behind a mesh sidecar every client comes from loopback, and the
//!   setting off holds them to the same share.
//! - Every connection is closed `lifetime` after it was accepted, whatever it is doing.
//!   Scrapers and probes reconnect; a held connection does not outlive the limit.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;

/// What the guard allows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_per_client: usize,
    pub(crate) lifetime: Duration,
    /// Loopback peers are not limited (`http.exempt_loopback`).
    pub(crate) exempt_loopback: bool,
}

/// Open connections per remote address (loopback ones not counted).
type Open = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// The listener the server accepts from.
pub(crate) struct Guarded {
    listener: TcpListener,
    lifetime: Duration,
    clients: Clients,
}

impl Guarded {
    pub(crate) fn new(listener: TcpListener, limits: Limits) -> Self {
        Self {
            listener,
            lifetime: limits.lifetime,
            clients: Clients {
                max: limits.max_per_client,
                exempt_loopback: limits.exempt_loopback,
                open: Arc::default(),
            },
        }
    }
}

/// The connections each remote address holds.
struct Clients {
    max: usize,
    exempt_loopback: bool,
    open: Open,
}

impl Clients {
    /// A slot for `peer`, unless it holds its share already.
    fn admit(&self, peer: IpAddr) -> Option<Slot> {
        let peer = peer.to_canonical();
        if self.exempt_loopback && peer.is_loopback() {
            return Some(Slot { peer: None });
        }
        let mut open = lock(&self.open);
        let held = open.entry(peer).or_default();
        if *held >= self.max {
            return None;
        }
        *held += 1;
        Some(Slot {
            peer: Some((peer, self.open.clone())),
        })
    }
}

impl axum::serve::Listener for Guarded {
    type Io = Connection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.listener.accept().await {
                Ok((stream, addr)) => {
                    // Refused: dropped, so closed at once.
                    let Some(slot) = self.clients.admit(addr.ip()) else {
                        continue;
                    };
                    let deadline = Box::pin(tokio::time::sleep(self.lifetime));
                    return (
                        Connection {
                            stream,
                            deadline,
                            _slot: slot,
                        },
                        addr,
                    );
                }
                // Out of file descriptors and the like: as axum does, wait a little
                // rather than spin.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// The peer of a request, for the handlers (`ConnectInfo<Peer>`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Peer(pub(crate) SocketAddr);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, Guarded>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, Guarded>) -> Self {
        Peer(*stream.remote_addr())
    }
}

/// A remote address's hold on one of its connections, given back on drop.
struct Slot {
    peer: Option<(IpAddr, Open)>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some((peer, open)) = self.peer.take() {
            let mut open = lock(&open);
            if let Some(held) = open.get_mut(&peer) {
                *held -= 1;
                if *held == 0 {
                    open.remove(&peer);
                }
            }
        }
    }
}

/// An accepted connection that ends at its deadline: past it, reads and writes fail,
/// and the server drops it.
pub(crate) struct Connection {
    stream: TcpStream,
    deadline: Pin<Box<Sleep>>,
    _slot: Slot,
}

impl Connection {
    /// `Err` once the deadline has passed; otherwise registers to be woken at it, so an
    /// idle connection is closed then too.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "http.connection_lifetime reached",
            )),
            Poll::Pending => Ok(()),
        }
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Err(e) = self.check(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Err(e) = self.check(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The counts are plain numbers: a panicking holder cannot leave them inconsistent.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(max: usize) -> Clients {
        Clients {
            max,
            exempt_loopback: true,
            open: Arc::default(),
        }
    }

    #[test]
    fn a_remote_address_holds_its_share_and_gets_it_back() {
        let g = guard(2);
        let remote: IpAddr = "10.1.2.3".parse().expect("ip");
        let other: IpAddr = "10.1.2.4".parse().expect("ip");
        let a = g.admit(remote).expect("first");
        let _b = g.admit(remote).expect("second");
        assert!(g.admit(remote).is_none(), "a third is refused");
        assert!(
            g.admit(other).is_some(),
            "another address has its own share"
        );
        drop(a);
        assert!(g.admit(remote).is_some(), "a slot given back is free again");
    }

    #[test]
    fn loopback_peers_are_not_limited() {
        let g = guard(1);
        let slots: Vec<Slot> = ["127.0.0.1", "::1", "::ffff:127.0.0.1"]
            .iter()
            .flat_map(|ip| {
                let ip: IpAddr = ip.parse().expect("ip");
                (0..5).map(move |_| ip)
            })
            .map(|ip| g.admit(ip).expect("loopback"))
            .collect();
        assert_eq!(slots.len(), 15);
        assert!(lock(&g.open).is_empty());
    }

    /// `http.exempt_loopback = false` (behind a mesh sidecar proxying from 127.0.0.6):
    /// loopback peers hold their share like any other, an IPv4-mapped one the same.
    #[test]
    fn loopback_peers_are_limited_when_not_exempt() {
        let g = Clients {
            exempt_loopback: false,
            ..guard(2)
        };
        let mesh: IpAddr = "127.0.0.6".parse().expect("ip");
        let mapped: IpAddr = "::ffff:127.0.0.6".parse().expect("ip");
        let _a = g.admit(mesh).expect("first");
        let _b = g.admit(mapped).expect("second, the same address");
        assert!(g.admit(mesh).is_none(), "a third is refused");
        assert!(g.admit(mapped).is_none(), "mapped or not");
        assert!(g.admit("::1".parse().expect("ip")).is_some());
    }
}
