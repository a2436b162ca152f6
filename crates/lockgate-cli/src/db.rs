//! Choosing and opening the database.

use std::time::Duration;

use anyhow::{Context, Result};
use lockgate::{PgPool, PgPoolOptions};
use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

/// The local server of this machine, database `lockgate`, as the `postgres` role.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/lockgate";

pub fn resolve(url: Option<String>) -> String {
    url.unwrap_or_else(|| DEFAULT_DATABASE_URL.to_string())
}

/// Connects, and fails with a message naming `lockgate migrate` if the schema is not current.
pub async fn connect_checked(url: &str, max_connections: u32) -> Result<PgPool> {
    let pool = connect(url, max_connections).await?;
    lockgate::check_schema(&pool).await?;
    Ok(pool)
}

pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool> {
    connect_with(url, PgPoolOptions::new().max_connections(max_connections)).await
}

/// One connection that gives up after `timeout` (sqlx's pool keeps retrying a refused
/// connection for 30 s by default), for commands that report an unreachable database.
pub async fn connect_within(url: &str, timeout: Duration) -> Result<PgPool> {
    connect_with(url, PgPoolOptions::new().max_connections(1).acquire_timeout(timeout)).await
}

async fn connect_with(url: &str, pool: PgPoolOptions) -> Result<PgPool> {
    let options: PgConnectOptions = url.parse().with_context(|| format!("invalid database URL {}", redact(url)))?;
    // Named, so operators (and fault-injection tests) can find lockgate's backends.
    let options = options.application_name("lockgate");
    pool.connect_with(options).await.with_context(|| format!("could not connect to {}", redact(url)))
}

/// Creates the URL's database when it does not exist (for `migrate` and `demo`).
pub async fn create_database_if_missing(url: &str) -> Result<()> {
    let options: PgConnectOptions = url.parse().with_context(|| format!("invalid database URL {}", redact(url)))?;
    let Some(name) = options.get_database().map(str::to_string) else { return Ok(()) };
    let mut admin = options
        .clone()
        .database("postgres")
        .connect()
        .await
        .with_context(|| format!("could not connect to {}", redact(url)))?;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(&name)
        .fetch_one(&mut admin)
        .await?;
    if !exists {
        // CREATE DATABASE takes no parameters; quote_ident makes the name safe as an identifier.
        let quoted: String = sqlx::query_scalar("SELECT quote_ident($1)").bind(&name).fetch_one(&mut admin).await?;
        match sqlx::raw_sql(&format!("CREATE DATABASE {quoted}")).execute(&mut admin).await {
            Ok(_) => tracing::info!(database = %name, "created database"),
            // Another process created it at the same moment: that is what we wanted.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
            Err(e) => return Err(e).context(format!("could not create database {name}")),
        }
    }
    Ok(())
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match url.parse::<PgConnectOptions>() {
        Ok(o) => format!("{}:{}/{}", o.get_host(), o.get_port(), o.get_database().unwrap_or("")),
        Err(_) => "(unparseable URL)".to_string(),
    }
}
