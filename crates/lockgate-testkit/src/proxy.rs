//! A TCP proxy between lockgate and PostgreSQL that injects network faults without mocking the
//! database: it can cut a connection at the worst moment — after the server has answered (so a
//! statement has committed) but before the client hears it (the ambiguous commit of H13) — and
//! it can freeze all traffic, so a process behind it goes silent (a cut heartbeat) while its
//! connections stay open, then thaw it. A reply carrying given bytes (a marker in a job's
//! arguments, so that only the claim that takes that job matches) can be cut the same way, or
//! swallowed with its connection left open, as a network that drops a flow without a reset does.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; dropping it stops accepting new connections.
pub struct FaultProxy {
    pub port: u16,
    cut_next_reply: Arc<AtomicBool>,
    marked: Arc<Mutex<Option<Marked>>>,
    frozen: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

/// What happens to the first reply that carries `needle` (or answers a request that does).
#[derive(Clone)]
struct Marked {
    needle: Vec<u8>,
    /// Dropped with its connection closed both ways (else: dropped, and every later byte the
    /// server sends on that connection too, the connection left open).
    close: bool,
    /// Matched in what the client sends: the replies to it are swallowed.
    in_request: bool,
    /// Whether that reply has been met.
    met: bool,
}

impl FaultProxy {
    /// Proxies 127.0.0.1:<port> to `upstream` (host:port).
    pub async fn start(upstream: String) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut = Arc::new(AtomicBool::new(false));
        let cut_for_task = Arc::clone(&cut);
        let marked = Arc::new(Mutex::new(None));
        let marked_for_task = Arc::clone(&marked);
        let (frozen, frozen_rx) = watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let faults = Faults { cut: Arc::clone(&cut_for_task), marked: Arc::clone(&marked_for_task) };
                tokio::spawn(pump(client, server, faults, frozen_rx.clone()));
            }
        });
        Ok(Self { port, cut_next_reply: cut, marked, frozen, accept })
    }

    /// Holds every byte in both directions (connections stay open) until `thaw`.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Forwards what was held and resumes traffic.
    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }

    /// The URL of `url`'s database reached through this proxy.
    pub fn url_for(&self, url: &str) -> String {
        url.replace("127.0.0.1:5432", &format!("127.0.0.1:{}", self.port))
    }

    /// The next bytes any server sends are dropped and that connection is closed both ways.
    pub fn cut_next_reply(&self) {
        self.cut_next_reply.store(true, Ordering::SeqCst);
    }

    /// Whether an armed cut has happened.
    pub fn has_cut(&self) -> bool {
        !self.cut_next_reply.load(Ordering::SeqCst)
    }

    /// The first reply the server sends that carries `needle` is dropped and its connection
    /// closed both ways: the statement it answers has run (and committed), and its client hears
    /// only that the connection broke.
    pub fn cut_reply_containing(&self, needle: &str) {
        self.arm(needle, true);
    }

    /// The first reply the server sends that carries `needle`, and everything the server sends
    /// on that connection after it, is dropped, the connection left open: its client waits for
    /// a reply that never comes.
    pub fn swallow_reply_containing(&self, needle: &str) {
        self.arm(needle, false);
    }

    /// Whether the reply armed by `cut_reply_containing` or `swallow_reply_containing` was met.
    pub fn met_marked_reply(&self) -> bool {
        self.marked.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|m| m.met)
    }

    /// Every reply to the first request the client sends that carries `needle` (a statement's
    /// text or a bound value), and everything the server sends on that connection after it, is
    /// dropped, the connection left open: the statement runs, and its client never hears.
    pub fn swallow_replies_to_request_containing(&self, needle: &str) {
        let marked = Marked { needle: needle.as_bytes().to_vec(), close: false, in_request: true, met: false };
        *self.marked.lock().unwrap_or_else(|e| e.into_inner()) = Some(marked);
    }

    /// The first reply to the first request the client sends that carries `needle` is dropped
    /// and its connection closed both ways: the statement has run (and, outside a transaction,
    /// committed), and its client hears only that the connection broke.
    pub fn cut_reply_to_request_containing(&self, needle: &str) {
        let marked = Marked { needle: needle.as_bytes().to_vec(), close: true, in_request: true, met: false };
        *self.marked.lock().unwrap_or_else(|e| e.into_inner()) = Some(marked);
    }

    /// Takes back a cut or swallow armed and not met yet (one met stays met).
    pub fn disarm(&self) {
        let mut marked = self.marked.lock().unwrap_or_else(|e| e.into_inner());
        if marked.as_ref().is_some_and(|m| !m.met) {
            *marked = None;
        }
    }

    fn arm(&self, needle: &str, close: bool) {
        let marked = Marked { needle: needle.as_bytes().to_vec(), close, in_request: false, met: false };
        *self.marked.lock().unwrap_or_else(|e| e.into_inner()) = Some(marked);
    }
}

/// The faults armed on a proxy, shared by its connections.
struct Faults {
    cut: Arc<AtomicBool>,
    marked: Arc<Mutex<Option<Marked>>>,
}

impl Faults {
    /// Whether `bytes` (a request when `request`, else a reply) are the armed marked ones:
    /// whether to close the connection. Met once.
    fn marked(&self, bytes: &[u8], request: bool) -> Option<bool> {
        let mut marked = self.marked.lock().unwrap_or_else(|e| e.into_inner());
        let m = marked.as_mut().filter(|m| !m.met && m.in_request == request)?;
        let reply = bytes;
        if !reply.windows(m.needle.len()).any(|w| w == m.needle.as_slice()) {
            return None;
        }
        m.met = true;
        Some(m.close)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn wait_thawed(frozen: &mut watch::Receiver<bool>) {
    let _ = frozen.wait_for(|f| !*f).await;
}

async fn pump(client: TcpStream, server: TcpStream, faults: Faults, frozen: watch::Receiver<bool>) {
    let (mut frozen_up, mut frozen_down) = (frozen.clone(), frozen);
    // Set by the upstream half when a request matches: the downstream half swallows from then on,
    // or closes the connection at the next reply.
    let (swallow, cut) = (AtomicBool::new(false), AtomicBool::new(false));
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = client_read.read(&mut buf).await {
            wait_thawed(&mut frozen_up).await;
            match faults.marked(&buf[..n], true) {
                Some(true) => cut.store(true, Ordering::SeqCst),
                Some(false) => swallow.store(true, Ordering::SeqCst),
                None => {}
            }
            if n == 0 || server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut swallowing = false;
        while let Ok(n) = server_read.read(&mut buf).await {
            wait_thawed(&mut frozen_down).await;
            // A lone ReadyForQuery is the tail of an earlier reply (sqlx reads it lazily), not
            // the answer to the statement under test: let it through.
            let lone_ready = n == 6 && buf[0] == b'Z';
            if n == 0 || (!lone_ready && (faults.cut.swap(false, Ordering::SeqCst) || cut.load(Ordering::SeqCst))) {
                break;
            }
            match faults.marked(&buf[..n], false) {
                Some(true) => break,
                Some(false) => swallowing = true,
                None => swallowing |= swallow.load(Ordering::SeqCst),
            }
            if swallowing {
                continue;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        // The server closed a swallowed connection: its client still hears nothing.
        if swallowing {
            std::future::pending::<()>().await;
        }
    };
    // Whichever direction ends first ends both: the client sees the connection drop.
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}
