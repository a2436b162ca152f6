//! Test tooling shared by every test suite: a fresh, migrated database per test (so tests run in
//! parallel against the real PostgreSQL), bounded waiters that fail with a message instead of
//! sleeping, and fault helpers (expire a lease, terminate backends).
//!
//! The server is taken from `LOCKGATE_TEST_DATABASE_URL`, else the local default
//! `postgres://postgres@127.0.0.1:5432/postgres`.

pub mod chaos;
pub mod pgbouncer;
mod proxy;

pub use proxy::FaultProxy;

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// Plain TCP unless a test is about TLS: the local server offers TLS, which every connection
/// would otherwise negotiate (doubling connect time), and the fault proxy reads the protocol's bytes.
const DEFAULT_SERVER_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable";

/// The server URL tests create their databases on.
pub fn server_url() -> String {
    std::env::var("LOCKGATE_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_SERVER_URL.to_string())
}

/// A database created for one test and dropped (forcibly) when the value is dropped.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl TestDb {
    /// A new, empty database (nothing installed).
    pub async fn empty() -> Result<Self> {
        let server: PgConnectOptions = server_url().parse().context("LOCKGATE_TEST_DATABASE_URL")?;
        let name = format!("lg_test_{}_{:08x}", std::process::id(), fastrand::u32(..));
        let mut admin = server.clone().connect().await.context("connecting to the test server")?;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}")).execute(&mut admin).await?;
        let options = server.database(&name);
        let url = options.to_url_lossy().to_string();
        let pool = PgPoolOptions::new().max_connections(8).connect_with(options).await?;
        Ok(Self { name, url, pool })
    }

    /// A new database with PGMQ and lockgate installed.
    pub async fn migrated() -> Result<Self> {
        let db = Self::empty().await?;
        lockgate_sql::migrate(&db.pool).await?;
        Ok(db)
    }

    /// A second, independent pool on the same database (another "process").
    pub async fn new_pool(&self, max_connections: u32) -> Result<PgPool> {
        Ok(PgPoolOptions::new().max_connections(max_connections).connect(&self.url).await?)
    }

    /// Makes a delivery visible now, as if its visibility had lapsed (the lease is lost).
    pub async fn expire_visibility(&self, queue: &str, msg_id: i64) -> Result<()> {
        sqlx::query("SELECT pgmq.set_vt($1, $2, 0)").bind(queue).bind(msg_id).execute(&self.pool).await?;
        Ok(())
    }

    /// Terminates every other backend connected to this database; returns how many.
    pub async fn terminate_backends(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// Waits until the session of backend `pid` has ended (the server ended it, or its client
    /// closed it), as seen from this database's pool.
    pub async fn wait_session_ended(&self, what: &str, pid: i32, timeout: Duration) -> Result<()> {
        wait_for(what, timeout, || async {
            let open: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                .bind(pid)
                .fetch_one(&self.pool)
                .await?;
            Ok((!open).then_some(()))
        })
        .await
    }

    /// Rows in a query's result, e.g. `count("SELECT 1 FROM pgmq.a_default")`.
    pub async fn count(&self, from: &str) -> Result<i64> {
        Ok(sqlx::query_scalar(&format!("SELECT count(*) FROM ({from}) t")).fetch_one(&self.pool).await?)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop is synchronous; the cleanup runs on a runtime of its own so it works whether or
        // not the test's runtime is still alive. FORCE ends the test's own connections (their
        // I/O belongs to the test's runtime, which is blocked here, so they cannot be closed).
        // Roles are the server's, not the database's: those a test made under its database's
        // name (`<name>_producer`) go too, once the database that held their grants is gone, so
        // a test that failed half-way leaves none behind.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            rt.block_on(async move {
                if let Ok(server) = server_url().parse::<PgConnectOptions>() {
                    if let Ok(mut admin) = server.connect().await {
                        let _ = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                            .execute(&mut admin)
                            .await;
                        let roles: Vec<String> =
                            sqlx::query_scalar("SELECT rolname::text FROM pg_roles WHERE starts_with(rolname, $1)")
                                .bind(format!("{name}_"))
                                .fetch_all(&mut admin)
                                .await
                                .unwrap_or_default();
                        for role in roles {
                            let _ = sqlx::raw_sql(&format!("DROP ROLE IF EXISTS \"{}\"", role.replace('"', "\"\"")))
                                .execute(&mut admin)
                                .await;
                        }
                    }
                }
            });
        })
        .join();
    }
}

/// Polls `check` until it returns `Some`, or fails after `timeout` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `sql` (a query returning one bigint) returns `expected`.
pub async fn wait_for_count(pool: &PgPool, sql: &str, expected: i64, timeout: Duration) -> Result<()> {
    let waited = wait_for(sql, timeout, || async {
        let n: i64 = sqlx::query_scalar(sql).fetch_one(pool).await?;
        Ok((n == expected).then_some(()))
    })
    .await;
    if waited.is_err() {
        let last: i64 = sqlx::query_scalar(sql).fetch_one(pool).await?;
        bail!("timed out after {timeout:?}: expected {expected} from `{sql}`, found {last}");
    }
    Ok(())
}
