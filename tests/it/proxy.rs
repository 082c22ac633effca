//! A TCP proxy the tests control: pass traffic, delay what flows back to the client or
//! both ways, stall everything (a black hole), refuse new connections, or cut the open
//! ones.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    /// Bytes from the server reach the client this much later.
    Delay(Duration),
    /// Bytes in either direction arrive this much later: a slow link, where a round trip
    /// takes twice as long.
    Latency(Duration),
    /// Nothing flows in either direction; connections stay open.
    Stall,
    /// New connections are closed at once.
    Refuse,
}

pub struct Proxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    cut: Arc<Mutex<CancellationToken>>,
    stop: CancellationToken,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("addr");
        let (mode, _) = watch::channel(Mode::Pass);
        let cut = Arc::new(Mutex::new(CancellationToken::new()));
        let stop = CancellationToken::new();
        tokio::spawn(accept_loop(
            listener,
            upstream,
            mode.clone(),
            cut.clone(),
            stop.clone(),
        ));
        Self {
            addr,
            mode,
            cut,
            stop,
        }
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Close every open connection (both sides see a reset/EOF).
    pub fn cut(&self) {
        let mut token = self.cut.lock().expect("lock");
        token.cancel();
        *token = CancellationToken::new();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.cut();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    mode: watch::Sender<Mode>,
    cut: Arc<Mutex<CancellationToken>>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((client, _)) = accepted else { continue };
        if *mode.borrow() == Mode::Refuse {
            drop(client);
            continue;
        }
        let Ok(server) = TcpStream::connect(upstream).await else {
            continue;
        };
        let token = cut.lock().expect("lock").clone();
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        tokio::spawn(pump(cr, sw, mode.subscribe(), token.clone(), false));
        tokio::spawn(pump(sr, cw, mode.subscribe(), token, true));
    }
}

/// Copy one direction, honouring the mode; `to_client` is the direction delays apply to.
async fn pump(
    mut from: OwnedReadHalf,
    to: OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    cut: CancellationToken,
    to_client: bool,
) {
    let (tx, rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    tokio::spawn(deliver(to, rx, cut.clone()));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        while *mode.borrow_and_update() == Mode::Stall {
            tokio::select! {
                _ = cut.cancelled() => return,
                r = mode.changed() => if r.is_err() { return },
            }
        }
        let n = tokio::select! {
            _ = cut.cancelled() => return,
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => return, Ok(n) => n },
        };
        let due = match *mode.borrow() {
            Mode::Delay(d) if to_client => Instant::now() + d,
            Mode::Latency(d) => Instant::now() + d,
            _ => Instant::now(),
        };
        if tx.send((due, buf[..n].to_vec())).is_err() {
            return;
        }
    }
}

async fn deliver(
    mut to: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>,
    cut: CancellationToken,
) {
    loop {
        let (due, bytes) = tokio::select! {
            _ = cut.cancelled() => return,
            m = rx.recv() => match m { Some(m) => m, None => return },
        };
        tokio::select! {
            _ = cut.cancelled() => return,
            _ = tokio::time::sleep_until(due.into()) => {},
        }
        if to.write_all(&bytes).await.is_err() {
            return;
        }
    }
}
