//! A PgBouncer of the test's own, in front of the test server, on a free local port: Debian's
//! `pgbouncer` (or `LOCKGATE_PGBOUNCER`), started for one test and killed when dropped.
//!
//! It logs in to the server as `postgres` whoever the client says it is (`auth_type = any`), keeps
//! `server_pool_size` long-lived server connections per database (few, so that clients share them,
//! and whatever one client leaves on a server meets the next, as in production), and ignores the startup parameter sqlx sends that PgBouncer does not track
//! (`extra_float_digits`), as a deployment in front of sqlx must.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};
use tokio::process::{Child, Command};

use crate::{server_url, wait_for};

/// PgBouncer's pooling modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    Session,
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Transaction => "transaction",
        }
    }
}

/// A running PgBouncer; killed, and its files removed, when dropped.
pub struct PgBouncer {
    pub port: u16,
    child: Child,
    dir: PathBuf,
}

impl PgBouncer {
    /// Starts one in `mode` with `server_pool_size` server connections per database, and waits
    /// until it accepts connections.
    pub async fn start(mode: PoolMode, server_pool_size: u32) -> Result<Self> {
        let binary = std::env::var("LOCKGATE_PGBOUNCER").unwrap_or_else(|_| "/usr/sbin/pgbouncer".into());
        if !Path::new(&binary).is_file() {
            bail!(
                "{binary} not found: install Debian's pgbouncer package (scripts/test does) or set LOCKGATE_PGBOUNCER"
            );
        }
        let server: PgConnectOptions = server_url().parse().context("LOCKGATE_TEST_DATABASE_URL")?;
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("lockgate-pgbouncer-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host={host} port={server_port} user=postgres\n\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = any\npool_mode = {mode}\ndefault_pool_size = {server_pool_size}\n\
                 max_client_conn = 500\nignore_startup_parameters = extra_float_digits\n\
                 logfile = {log}\npidfile = {pid}\n",
                host = server.get_host(),
                server_port = server.get_port(),
                mode = mode.as_str(),
                log = dir.join("pgbouncer.log").display(),
                pid = dir.join("pgbouncer.pid").display(),
            ),
        )?;
        let mut command = Command::new(&binary);
        // PgBouncer refuses to run as root; -u makes it switch to the server's user.
        if is_root() {
            std::process::Command::new("chown").arg("-R").arg("postgres").arg(&dir).status()?;
            command.arg("-u").arg("postgres");
        }
        let child = command
            .arg(&ini)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {binary}"))?;
        let bouncer = Self { port, child, dir };
        let probe = bouncer.options("postgres");
        wait_for("PgBouncer to accept connections", Duration::from_secs(15), || {
            let probe = probe.clone();
            async move {
                match probe.connect().await {
                    Ok(conn) => {
                        conn.close().await.ok();
                        Ok(Some(()))
                    }
                    Err(_) => Ok(None),
                }
            }
        })
        .await
        .with_context(|| bouncer.log())?;
        Ok(bouncer)
    }

    /// Connect options for `database` through this PgBouncer.
    pub fn options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database(database)
            .ssl_mode(sqlx::postgres::PgSslMode::Disable)
    }

    /// A URL for `database` through this PgBouncer.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}?sslmode=disable", self.port)
    }

    /// PgBouncer's log so far, for a failure message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn is_root() -> bool {
    std::process::Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}
