//! A TCP proxy between lockgate and PostgreSQL that injects network faults without mocking the
//! database: it can cut a connection at the worst moment — after the server has answered (so a
//! statement has committed) but before the client hears it (the ambiguous commit of H13) — and
//! it can freeze all traffic, so a process behind it goes silent (a cut heartbeat) while its
//! connections stay open, then thaw it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; dropping it stops accepting new connections.
pub struct FaultProxy {
    pub port: u16,
    cut_next_reply: Arc<AtomicBool>,
    frozen: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Proxies 127.0.0.1:<port> to `upstream` (host:port).
    pub async fn start(upstream: String) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut = Arc::new(AtomicBool::new(false));
        let cut_for_task = Arc::clone(&cut);
        let (frozen, frozen_rx) = watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(pump(client, server, Arc::clone(&cut_for_task), frozen_rx.clone()));
            }
        });
        Ok(Self { port, cut_next_reply: cut, frozen, accept })
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
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn wait_thawed(frozen: &mut watch::Receiver<bool>) {
    let _ = frozen.wait_for(|f| !*f).await;
}

async fn pump(client: TcpStream, server: TcpStream, cut: Arc<AtomicBool>, frozen: watch::Receiver<bool>) {
    let (mut frozen_up, mut frozen_down) = (frozen.clone(), frozen);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = client_read.read(&mut buf).await {
            wait_thawed(&mut frozen_up).await;
            if n == 0 || server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = server_read.read(&mut buf).await {
            wait_thawed(&mut frozen_down).await;
            // A lone ReadyForQuery is the tail of an earlier reply (sqlx reads it lazily), not
            // the answer to the statement under test: let it through.
            let lone_ready = n == 6 && buf[0] == b'Z';
            if n == 0 || (!lone_ready && cut.swap(false, Ordering::SeqCst)) {
                break;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    // Whichever direction ends first ends both: the client sees the connection drop.
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}
