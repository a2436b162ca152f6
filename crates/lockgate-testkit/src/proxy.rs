//! A TCP proxy between lockgate and PostgreSQL that can cut a connection at the worst moment:
//! after the server has answered (so a statement has committed) but before the client hears
//! it. This is how tests produce the ambiguous commit of H13 without mocking the database.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy; dropping it stops accepting new connections.
pub struct FaultProxy {
    pub port: u16,
    cut_next_reply: Arc<AtomicBool>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Proxies 127.0.0.1:<port> to `upstream` (host:port).
    pub async fn start(upstream: String) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut = Arc::new(AtomicBool::new(false));
        let cut_for_task = Arc::clone(&cut);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(pump(client, server, Arc::clone(&cut_for_task)));
            }
        });
        Ok(Self { port, cut_next_reply: cut, accept })
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

async fn pump(client: TcpStream, server: TcpStream, cut: Arc<AtomicBool>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = client_read.read(&mut buf).await {
            if n == 0 || server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = server_read.read(&mut buf).await {
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
