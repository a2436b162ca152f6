//! Choosing and opening the database. Every command connects through [`connect`]: one direct
//! connection first, within the connect timeout, so that a failure names its cause (sqlx's pool
//! only says "pool timed out while waiting for an open connection", after 30 s), then the pool.

use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use lockgate::{PgPool, PgPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgSslMode};
use sqlx::{ConnectOptions as _, Connection as _};

/// The local server of this machine, database `lockgate`, as the `postgres` role.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/lockgate";

/// A reachable server answers in milliseconds, a distant or busy one within a second or two;
/// past 5 s a person at a terminal is better served by the cause than by waiting longer.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// SQLSTATE `invalid_catalog_name`: the URL's database does not exist.
const MISSING_DATABASE: &str = "3D000";

/// Where to connect and how long to wait, as the global flags give them; `run` fills what they
/// leave unset from its config file.
#[derive(Debug, Clone, Default)]
pub struct Target {
    pub url: Option<String>,
    pub connect_timeout: Option<Duration>,
}

impl Target {
    /// This target, with the config file's values where the flags (and environment) gave none.
    pub fn or(&self, url: Option<String>, connect_timeout: Option<Duration>) -> Self {
        Self { url: self.url.clone().or(url), connect_timeout: self.connect_timeout.or(connect_timeout) }
    }

    pub fn url(&self) -> String {
        self.url.clone().unwrap_or_else(|| DEFAULT_DATABASE_URL.to_string())
    }

    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT)
    }
}

/// How long `status` and `doctor` wait for a lock on a table they read: one another session holds
/// (an abandoned transaction, a migrate rebuilding an index) made them wait, silent, for as long
/// as it was held (review helper-140 F2).
pub const READ_LOCK_TIMEOUT: &str = "5s";

/// A pool for the operators' reads, `status` and `doctor`: each statement waits at most
/// `READ_LOCK_TIMEOUT` for a lock (55P03 past it). Not through a transaction-mode pooler, which
/// refuses startup options (there the role's `lock_timeout` holds).
pub async fn connect_reading(target: &Target) -> Result<PgPool> {
    let (url, timeout) = (target.url(), target.connect_timeout());
    let mut options = options(&url)?;
    if !lockgate::sql::pooler::transaction_pooling() {
        let bounded = options.clone().options([("lock_timeout", READ_LOCK_TIMEOUT)]);
        match connect_one(&url, &bounded, timeout).await {
            Ok(conn) => {
                let _ = conn.close().await;
                options = bounded;
            }
            // A pooler the URL does not name refuses startup options (PgBouncer: "unsupported
            // startup parameter"): the read goes on without its lock timeout.
            Err(err) if format!("{err:#}").contains("unsupported startup parameter") => {}
            Err(err) => return Err(err),
        }
    }
    let _ = connect_one(&url, &options, timeout).await?.close().await;
    PgPoolOptions::new().max_connections(1).connect_with(options).await.map_err(|err| connect_error(&url, err, timeout))
}

/// Whether `err` is a statement that gave up waiting for a lock (`lock_timeout`, 55P03).
pub fn lock_timed_out(err: &lockgate::sql::DbError) -> bool {
    matches!(err, lockgate::sql::DbError::Sqlx(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03"))
}

/// Connects, and fails with a message naming `lockgate migrate` if the schema is not current.
pub async fn connect_checked(target: &Target, max_connections: u32) -> Result<PgPool> {
    let pool = connect(target, max_connections).await?;
    lockgate::check_schema(&pool).await?;
    Ok(pool)
}

/// For `run`, a long-lived process started by a supervisor that may start it before the
/// database is up (a restart, a failover, a partition): a server that refuses, does not answer or
/// is still starting is waited for, each attempt logged with its cause, until it answers or
/// `shutdown` fires (then `None`). Anything else (a missing database, a refused role, a bad URL,
/// a schema to migrate) ends it at once.
pub async fn connect_checked_waiting(
    target: &Target,
    max_connections: u32,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Result<Option<PgPool>> {
    let (url, timeout) = (target.url(), target.connect_timeout());
    let options = options(&url)?;
    let mut pause = Duration::from_millis(500);
    loop {
        let attempt = async {
            let conn = match tokio::time::timeout(timeout, PgConnection::connect_with(&options)).await {
                Ok(Ok(conn)) => conn,
                Ok(Err(err)) => return Err((unreachable(&err), connect_error(&url, err, timeout))),
                Err(_) => return Err((true, connect_error(&url, sqlx::Error::PoolTimedOut, timeout))),
            };
            let _ = conn.close().await;
            let pool = PgPoolOptions::new()
                .max_connections(max_connections)
                .connect_with(options.clone())
                .await
                .map_err(|err| (unreachable(&err), connect_error(&url, err, timeout)))?;
            match lockgate::check_schema(&pool).await {
                Ok(_) => Ok(pool),
                // Transient to the runtime's statements, these at the start mean a URL through a
                // transaction-mode pooler that does not say so: waited for, they never end (review
                // helper-136 F5). Ended at once; `main` adds the hint naming pooler=transaction.
                Err(err) if pooler_mismatch(&err) => Err((false, anyhow::Error::from(err))),
                Err(err) => Err((err.is_transient(), anyhow::Error::from(err))),
            }
        };
        let outcome = tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            outcome = attempt => outcome,
        };
        match outcome {
            Ok(pool) => return Ok(Some(pool)),
            Err((true, error)) => tracing::warn!("waiting for the database: {error:#}"),
            Err((false, error)) => return Err(error),
        }
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// A connect error worth waiting out: the server refused, did not answer, or is starting or
/// shutting down.
fn unreachable(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => matches!(db.code().as_deref(), Some("57P01" | "57P02" | "57P03")),
        _ => false,
    }
}

/// A pool of `max_connections`, after one direct connection proved the server reachable.
pub async fn connect(target: &Target, max_connections: u32) -> Result<PgPool> {
    let (url, timeout) = (target.url(), target.connect_timeout());
    let options = options(&url)?;
    let _ = connect_one(&url, &options, timeout).await?.close().await;
    // The connect timeout is for reaching the server; the pool keeps sqlx's wait for a free
    // connection (30 s), which claims, completions and `sql` jobs rely on under contention.
    PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .map_err(|err| connect_error(&url, err, timeout))
}

/// `pooler=transaction` in a database URL: the URL goes through a transaction-mode pooler
/// (PgBouncer's `pool_mode = transaction`), so every statement is run unnamed, inside a
/// transaction (lockgate_sql::pooler). `pooler=session` (or none) changes nothing. The parameter
/// is lockgate's, so it is taken out of the URL the driver sees.
fn take_pooler_mode(url: &str) -> Result<String> {
    let Ok(parsed) = reqwest::Url::parse(url) else { return Ok(url.to_string()) };
    let pairs: Vec<(String, String)> = parsed.query_pairs().map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
    let modes: Vec<&String> = pairs.iter().filter(|(k, _)| k == "pooler").map(|(_, v)| v).collect();
    let mode = match modes.as_slice() {
        [] => return Ok(url.to_string()),
        [mode] => *mode,
        _ => anyhow::bail!("invalid database URL {}: pooler is given more than once", redact(url)),
    };
    match mode.as_str() {
        "transaction" => lockgate::sql::pooler::set_transaction_pooling(true),
        "session" => {}
        other => anyhow::bail!(
            "invalid database URL {}: pooler={other:?}; use pooler=transaction behind a transaction-mode pooler \
             such as PgBouncer's pool_mode = transaction (or pooler=session)",
            redact(url)
        ),
    }
    Ok(without_pooler(url))
}

/// Whether a database URL says `pooler=transaction`.
pub fn says_transaction_pooling(url: &str) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| u.query_pairs().any(|(k, v)| k == "pooler" && v == "transaction"))
}

/// The LISTEN URL of `run` must be a direct one: through a transaction-mode pooler LISTEN
/// would subscribe a server connection that is lent to others. Returns it as the driver is to
/// see it, without lockgate's `pooler` parameter.
pub fn check_listen_url(url: &str) -> Result<String> {
    if says_transaction_pooling(url) {
        anyhow::bail!(
            "listen_database_url {} goes through a transaction-mode pooler: LISTEN needs a direct connection \
             (or a session-mode pooler)",
            redact(url)
        );
    }
    options(url)?;
    Ok(without_pooler(url))
}

/// `url` without lockgate's `pooler` parameter, which the driver does not know (it warns of it).
fn without_pooler(url: &str) -> String {
    let Ok(mut parsed) = reqwest::Url::parse(url) else { return url.to_string() };
    if !parsed.query_pairs().any(|(k, _)| k == "pooler") {
        return url.to_string();
    }
    let rest: Vec<(String, String)> =
        parsed.query_pairs().filter(|(k, _)| k != "pooler").map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
    if rest.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(rest);
    }
    parsed.to_string()
}

/// The URL parameters the driver reads (sqlx's names and their aliases), and lockgate's own
/// `pooler`: taken out before the others are looked at, and listed here for the message that names
/// what is read.
const DRIVER_PARAMETERS: [&str; 19] = [
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
    "pooler",
];

/// Why a URL parameter the driver does not read is refused: the driver only warns of it and
/// goes on without it, so a misspelt `sslmode` connected in plain text (review helper-92). A
/// parameter of libpq's that the driver lacks is named as such; another is taken for a typo of
/// the nearest one the driver reads.
fn unknown_parameter(key: &str) -> String {
    const LIBPQ_ONLY: [&str; 22] = [
        "connect_timeout",
        "target_session_attrs",
        "load_balance_hosts",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
        "fallback_application_name",
        "client_encoding",
        "gssencmode",
        "channel_binding",
        "sslcompression",
        "sslcrl",
        "sslcrldir",
        "sslpassword",
        "sslsni",
        "ssl_min_protocol_version",
        "ssl_max_protocol_version",
        "requirepeer",
        "service",
        "passfile",
    ];
    if LIBPQ_ONLY.contains(&key) {
        return format!(
            "{key} is a libpq parameter that lockgate's driver (sqlx) does not support; remove it \
             (lockgate has --connect-timeout for connect_timeout)"
        );
    }
    let nearest = DRIVER_PARAMETERS.iter().min_by_key(|known| strsim::levenshtein(key, known)).copied();
    match nearest.filter(|known| strsim::levenshtein(key, known) <= 2) {
        Some(known) => format!("unknown parameter {key:?}; did you mean {known}?"),
        None => format!("unknown parameter {key:?}; lockgate reads {}", DRIVER_PARAMETERS.join(", ")),
    }
}

fn options(url: &str) -> Result<PgConnectOptions> {
    // The driver reads any scheme as PostgreSQL's: another database's URL is a mistake to name.
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        let scheme = url.split_once("://").map_or("none", |(scheme, _)| scheme);
        anyhow::bail!(
            "invalid database URL {}: its scheme is {scheme}; lockgate needs postgres:// or postgresql://",
            redact(url)
        );
    }
    let url = &take_pooler_mode(url)?;
    let named: Vec<(String, String)> = reqwest::Url::parse(url)
        .map(|u| u.query_pairs().map(|(k, v)| (k.into_owned(), v.into_owned())).collect())
        .unwrap_or_default();
    if let Some((key, _)) = named.iter().find(|(k, _)| !DRIVER_PARAMETERS.contains(&k.as_str())) {
        anyhow::bail!("invalid database URL {}: {}", redact(url), unknown_parameter(key));
    }
    // Named with what it may be: the driver said "unparseable URL: error with configuration: error
    // with configuration: unknown value" (review helper-92).
    const SSL_MODES: [&str; 6] = ["disable", "allow", "prefer", "require", "verify-ca", "verify-full"];
    if let Some((_, mode)) = named.iter().find(|(k, v)| k == "sslmode" && !SSL_MODES.contains(&v.as_str())) {
        anyhow::bail!("invalid database URL {}: sslmode {mode:?}: one of {}", redact(url), SSL_MODES.join(", "));
    }
    let mut options: PgConnectOptions = url.parse().with_context(|| format!("invalid database URL {}", redact(url)))?;
    // The TLS files the URL names must exist: the driver would report only "No such file or
    // directory", or, in the modes that do not verify, ignore a missing root certificate.
    for (key, path) in named.iter().filter(|(k, _)| matches!(k.as_str(), "sslrootcert" | "sslcert" | "sslkey")) {
        if !std::path::Path::new(path).is_file() {
            anyhow::bail!("invalid database URL {}: {key} {path:?} is not a readable file", redact(url));
        }
    }
    // As libpq does: require with a root certificate named verifies the server against it.
    if named.iter().any(|(k, _)| k == "sslrootcert") && matches!(options.get_ssl_mode(), PgSslMode::Require) {
        options = options.ssl_mode(PgSslMode::VerifyCa);
    }
    // sqlx warns of every statement slower than a second; an `sql` job's statement runs as long
    // as its job does, so that was a warning per long job (review helper-92). At debug it is still
    // there for whoever looks.
    let options = options.log_slow_statements(log::LevelFilter::Debug, Duration::from_secs(1));
    // Named, so operators (and fault-injection tests) can find lockgate's backends.
    Ok(options.application_name("lockgate"))
}

/// One direct connection within `timeout`: its error, unlike the pool's, is the one to report.
async fn connect_one(url: &str, options: &PgConnectOptions, timeout: Duration) -> Result<PgConnection> {
    match tokio::time::timeout(timeout, PgConnection::connect_with(options)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(err)) => Err(connect_error(url, err, timeout)),
        Err(_) => Err(connect_error(url, sqlx::Error::PoolTimedOut, timeout)),
    }
}

/// "could not connect to HOST:PORT/DB: CAUSE", the cause said once and with what to do about it.
fn connect_error(url: &str, err: sqlx::Error, timeout: Duration) -> anyhow::Error {
    let at = without_pooler(url)
        .parse::<PgConnectOptions>()
        .map_or_else(|_| "?".into(), |o| format!("{}:{}", o.get_host(), o.get_port()));
    let cause = match &err {
        sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            format!("connection refused (is PostgreSQL running on {at}?)")
        }
        sqlx::Error::Io(io) => io.to_string(),
        // Also the direct connection's timeout: the pool's own error would hide the cause.
        sqlx::Error::PoolTimedOut => format!(
            "no answer within {} (is {at} reachable from this host? --connect-timeout waits longer)",
            humantime::format_duration(timeout)
        ),
        sqlx::Error::Database(db) if db.code().as_deref() == Some(MISSING_DATABASE) => {
            format!("{}: create it and install lockgate with `lockgate migrate --create-database`", db.message())
        }
        sqlx::Error::Database(db) => db.message().to_string(),
        other => other.to_string(),
    };
    anyhow!("could not connect to {}: {cause}", redact(url))
}

/// Creates the URL's database when it does not exist (for `migrate` and `demo`).
pub async fn create_database_if_missing(target: &Target) -> Result<()> {
    let url = target.url();
    let options = options(&url)?;
    let Some(name) = options.get_database().map(str::to_string) else { return Ok(()) };
    let timeout = target.connect_timeout();
    // The database itself first: most often it exists, and a role may not be allowed into
    // `postgres` (managed servers); only a missing database sends us there to create it.
    match tokio::time::timeout(timeout, PgConnection::connect_with(&options)).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            return Ok(());
        }
        Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some(MISSING_DATABASE) => {}
        Ok(Err(err)) => return Err(connect_error(&url, err, timeout)),
        Err(_) => return Err(connect_error(&url, sqlx::Error::PoolTimedOut, timeout)),
    }
    let admin_options = options.clone().database("postgres");
    let cannot = |cause: String| {
        anyhow!(
            "database {name:?} does not exist, and creating it needs a connection to the `postgres` database, \
             which failed: {cause}; create it yourself (CREATE DATABASE), then run `lockgate migrate` again"
        )
    };
    let mut admin = match tokio::time::timeout(timeout, PgConnection::connect_with(&admin_options)).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(err)) => return Err(cannot(err.to_string())),
        Err(_) => return Err(cannot(format!("no answer within {}", humantime::format_duration(timeout)))),
    };
    // CREATE DATABASE takes no parameters; quote_ident makes the name safe as an identifier.
    let quoted: String = sqlx::query_scalar("SELECT quote_ident($1)").bind(&name).fetch_one(&mut admin).await?;
    match sqlx::raw_sql(&format!("CREATE DATABASE {quoted}")).execute(&mut admin).await {
        Ok(_) => tracing::info!(database = %name, "created database"),
        // Another process created it at the same moment: that is what we wanted. Seen as the
        // catalog's unique index when both creations were under way at once (review helper-99).
        Err(sqlx::Error::Database(e))
            if e.code().as_deref() == Some("42P04")
                || (e.code().as_deref() == Some("23505") && e.constraint() == Some("pg_database_datname_index")) => {}
        Err(e) => return Err(e).context(format!("could not create database {name}")),
    }
    Ok(())
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match without_pooler(url).parse::<PgConnectOptions>() {
        Ok(o) => format!("{}:{}/{}", o.get_host(), o.get_port(), o.get_database().unwrap_or("")),
        // A value the driver refuses (sslmode=bogus) still leaves the address to name.
        Err(_) => match reqwest::Url::parse(url) {
            Ok(u) if u.host_str().is_some() => format!(
                "{}:{}/{}",
                u.host_str().unwrap_or_default(),
                u.port().unwrap_or(5432),
                u.path().trim_start_matches('/')
            ),
            _ => "(unparseable URL)".to_string(),
        },
    }
}

/// A statement that met another client's prepared statement on the server (42P05), or was bound
/// on a server that never prepared it (26000), on a URL that does not say `pooler=transaction`.
fn pooler_mismatch(err: &lockgate::sql::DbError) -> bool {
    let lockgate::sql::DbError::Sqlx(err) = err else { return false };
    !lockgate::sql::pooler::transaction_pooling()
        && matches!(err.as_database_error().and_then(|e| e.code()).as_deref(), Some("42P05" | "26000"))
}
