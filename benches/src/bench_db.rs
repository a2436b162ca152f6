//! The databases the harness creates for itself: one per workload, named
//! `lg_bench_<pid>_<workload>_<n>`, migrated with `lockgate::migrate`, and dropped when the
//! workload ends — by `close` normally, and by `Drop` when a workload fails, panics or is
//! interrupted (Ctrl-C drops the running future). The harness never touches a database it did
//! not create: it connects to the server's URL only to create and drop its own.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use lockgate::{PgPool, PgPoolOptions};
use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

use crate::progress::Progress;

/// Connections of the harness's own pool (fills, polls, resets); workloads open their own.
const CONTROL_CONNECTIONS: u32 = 4;

/// Sessions of the harness's own pool, and of the pools it measures (lockgate's runtime and
/// client, the baseline's consumers), told apart in `pg_stat_activity`.
const CONTROL_APP: &str = "lockgate-bench-control";
pub const MEASURED_APP: &str = "lockgate-bench";

/// How long closed pools' sessions may take to leave before the harness goes on without them.
const SESSIONS_CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

static CREATED: AtomicU32 = AtomicU32::new(0);

pub struct BenchDb {
    pub name: String,
    server: PgConnectOptions,
    /// The harness's pool: fills, polling and resets. Never the pool being measured.
    pub pool: PgPool,
    /// Whether measured pools keep sqlx's ping before every acquire (`test_before_acquire`).
    pool_ping: bool,
    dropped: bool,
}

impl BenchDb {
    /// Creates and migrates a fresh database for `workload` on the server of `server_url`.
    pub async fn create(server_url: &str, workload: &str, pool_ping: bool) -> Result<Self> {
        let server: PgConnectOptions = server_url.parse().with_context(|| format!("server URL {server_url:?}"))?;
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let n = CREATED.fetch_add(1, Ordering::Relaxed);
        let name = format!("lg_bench_{}_{workload}_{n}_{nanos:x}", std::process::id());
        let mut admin = server.connect().await.with_context(|| format!("connecting to {server_url}"))?;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}")).execute(&mut admin).await?;
        let options = server.clone().database(&name).application_name(CONTROL_APP);
        // Lazy: nothing connects before the ALTER below. From here on, dropping `db` drops the
        // database, whatever fails next.
        let pool = PgPoolOptions::new().max_connections(CONTROL_CONNECTIONS).connect_lazy_with(options);
        let db = Self { name, server, pool, pool_ping, dropped: false };
        // Function statistics give the report its per-job call counts and server times; every
        // session of the database gets the setting. It needs a superuser: without one the
        // measurements still run, and the diagnostics lack the function lines.
        let track = format!("ALTER DATABASE {} SET track_functions = 'pl'", db.name);
        let _ = sqlx::raw_sql(&track).execute(&mut admin).await;
        lockgate::migrate(&db.pool).await.context("migrating the bench database")?;
        Ok(db)
    }

    /// A new pool on this database with `max` connections, `warm` of them opened now so that
    /// connecting is never part of a measured interval.
    pub async fn pool_warm(&self, max: u32, warm: u32) -> Result<PgPool> {
        let pool = self.new_pool(max).await?;
        let mut held = Vec::new();
        for _ in 0..warm.min(max) {
            held.push(pool.acquire().await?);
        }
        drop(held);
        Ok(pool)
    }

    async fn new_pool(&self, max: u32) -> Result<PgPool> {
        let options = self.server.clone().database(&self.name).application_name(MEASURED_APP);
        Ok(PgPoolOptions::new()
            .max_connections(max)
            .test_before_acquire(self.pool_ping)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(options)
            .await?)
    }

    /// Waits until no session but the harness's own is connected: measured pools are closed and
    /// their backends have exited (and so flushed their statistics). Returns the sessions still
    /// there after the wait, described, when they do not go (an empty list when all is well).
    async fn wait_sessions_closed(&self) -> Result<Vec<String>> {
        let deadline = Instant::now() + SESSIONS_CLOSE_TIMEOUT;
        loop {
            let others: Vec<String> = sqlx::query_scalar(
                "SELECT format('pid %s, %s, %s since %s: %s', pid, state, backend_type, state_change, left(query, 80))
                   FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1",
            )
            .bind(MEASURED_APP)
            .fetch_all(&self.pool)
            .await?;
            if others.is_empty() || Instant::now() >= deadline {
                return Ok(others);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the measured sessions to leave (so that their statistics are flushed), and
    /// warns about any that do not: the statistics read next may then be incomplete.
    pub async fn settle(&self, progress: &Progress) -> Result<()> {
        for session in self.wait_sessions_closed().await? {
            progress.warn(format!("session still open after its pool closed (statistics may be missing): {session}"));
        }
        Ok(())
    }

    /// Closes the harness's pool and drops the database.
    pub async fn close(mut self) -> Result<()> {
        self.pool.close().await;
        self.dropped = true;
        let mut admin = self.server.connect().await?;
        sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)).execute(&mut admin).await?;
        Ok(())
    }
}

impl Drop for BenchDb {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (name, server) = (self.name.clone(), self.server.clone());
        // Drop is synchronous and may run inside the harness's runtime: the cleanup gets a
        // runtime of its own on a thread. FORCE ends sessions still open on the database.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            rt.block_on(async move {
                if let Ok(mut admin) = server.connect().await {
                    let _ = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut admin)
                        .await;
                }
            });
        })
        .join();
    }
}

/// Closes a measured pool and drops this handle on it. `PgPool::close` can miss a connection
/// that is being returned at that very moment (it stays idle and open in the closed pool until
/// the pool itself is dropped), so the handle must not outlive the close.
pub async fn close(pool: PgPool) {
    pool.close().await;
    drop(pool);
}
