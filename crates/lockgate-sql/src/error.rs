//! The one error type of the SQL layer. lockgate's SQL functions raise their own SQLSTATEs
//! (`LG001` unknown queue, `LG002` unknown job type, `LG003` invalid argument, `LG004` concurrency
//! limit reached with on_conflict raise, `LG005` unique key held with on_conflict reject, `LG006`
//! unknown recurring task); they are mapped to variants here so callers match on meaning, never
//! on sqlx internals.

use lockgate_core::JobId;

/// An error from the database, classified.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("{0}")]
    UnknownQueue(String),
    /// A job type that is not in `lockgate.job_types` (`LG002`): the enqueued job's, a recurring
    /// task's or a batch callback's, as `message` (the server's) says.
    #[error("{message}")]
    UnknownJobType { job_type: String, message: String },
    #[error("{0}")]
    InvalidArgument(String),
    /// A full concurrency key whose job type raises on conflict (`LG004`).
    #[error("{message}")]
    LimitReached { key: String, message: String },
    /// A unique key held by job `holder` whose type rejects duplicates (`LG005`).
    #[error("{message}")]
    Duplicate { key: String, job_type: String, holder: JobId, message: String },
    /// A recurring task that is not in `lockgate.recurring_tasks` (`LG006`).
    #[error("{0}")]
    UnknownRecurringTask(String),
    #[error("lockgate is not installed in this database ({0}): run `lockgate migrate`")]
    NotInstalled(String),
    /// The session's search_path puts a schema ahead of pg_catalog, whose objects would then
    /// stand in for PostgreSQL's built-ins in lockgate's functions.
    #[error(
        "search_path ({search_path}) puts schema {first} ahead of pg_catalog: lockgate's functions would call its \
         objects in place of PostgreSQL's built-ins (now(), clock_timestamp(), ...); put pg_catalog first, e.g. \
         ALTER DATABASE ... SET search_path = pg_catalog, {first}, public, or leave it out (it is then searched first)"
    )]
    CatalogShadowed { first: String, search_path: String },
    #[error(
        "this database has lockgate schema version {found}, older than this build's {expected}: run `lockgate migrate`"
    )]
    SchemaOutdated { found: i32, expected: i32 },
    #[error("lockgate's SQL functions in this database differ from this build's: run `lockgate migrate`")]
    FunctionsOutdated,
    /// A lockgate function this build calls is not in the database (SQLSTATE 42883, the server's
    /// message kept): a database an older build migrated.
    #[error("{0}: this database's lockgate functions are older than this build's: run `lockgate migrate`")]
    MissingFunction(String),
    #[error(
        "this database has lockgate schema version {found} (compatibility version {found_compat}), which this build \
         (schema {expected}, compatibility version {expected_compat}) cannot run against: upgrade lockgate"
    )]
    SchemaIncompatible { found: i32, found_compat: i32, expected: i32, expected_compat: i32 },
    /// The pgmq crate's installer refused (a missing or unreadable upgrade script, a version it
    /// cannot parse); its database errors are `Sqlx`.
    #[error("installing PGMQ: {0}")]
    PgmqInstall(String),
    /// Any other error of the database or the driver. Transparent: sqlx's message already ends
    /// with its cause's, so a prefix of ours plus the cause chain would print it twice.
    #[error(transparent)]
    Sqlx(sqlx::Error),
    #[error(
        "lockgate migrate cannot run through a transaction-mode pooler (pooler=transaction): run it with a direct \
         database URL, or one through a session-mode pooler"
    )]
    MigrateThroughPooler,
    /// Migrate waited for a lock on lockgate's tables, `attempts` times, and another transaction
    /// held it each time.
    #[error(
        "lockgate migrate gave up after {attempts} attempts to lock lockgate's tables, each time held by another \
         transaction (an open transaction that enqueued, claimed or completed jobs?): run it again once that ends \
         (pg_stat_activity's xact_start shows long ones)"
    )]
    MigrateBlocked { attempts: u32 },
}

impl From<sqlx::Error> for DbError {
    fn from(err: sqlx::Error) -> Self {
        let Some(db) = err.as_database_error() else {
            return Self::Sqlx(err);
        };
        let message = match db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
            Some(pg) => match pg.detail() {
                Some(detail) => format!("{} ({detail})", pg.message()),
                None => pg.message().to_string(),
            },
            None => db.message().to_string(),
        };
        // The data of LG002, LG004 and LG005 is read back from their messages, whose wording is
        // pinned by sql/ (and by the tests of each error); a message that no longer parses is
        // reported as the database's error rather than with made-up data.
        let text = db.message();
        let parsed = match db.code().as_deref() {
            Some("LG001") => Some(Self::UnknownQueue(message)),
            Some("LG002") => quoted_after(text, "unknown job type \"")
                .map(|job_type| Self::UnknownJobType { job_type: job_type.to_string(), message }),
            Some("LG003") => Some(Self::InvalidArgument(message)),
            Some("LG004") => text
                .split_once(" reached for key \"")
                .and_then(|(_, rest)| rest.strip_suffix('"'))
                .map(|key| Self::LimitReached { key: key.to_string(), message }),
            Some("LG005") => duplicate(text, message),
            Some("LG006") => Some(Self::UnknownRecurringTask(message)),
            // A lockgate function this build calls and the database lacks (or has with other
            // arguments): migrated by an older build. The schema itself exists (else 3F000).
            Some("42883") if text.starts_with("function lockgate.") => Some(Self::MissingFunction(message)),
            _ => None,
        };
        parsed.unwrap_or(Self::Sqlx(err))
    }
}

impl From<pgmq::PgmqError> for DbError {
    fn from(err: pgmq::PgmqError) -> Self {
        match err {
            pgmq::PgmqError::DatabaseError(err) => err.into(),
            other => Self::PgmqInstall(other.to_string()),
        }
    }
}

/// The text between `prefix` and the next `"` (job type names hold no quotes).
fn quoted_after<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let (_, rest) = text.split_once(prefix)?;
    rest.split_once('"').map(|(quoted, _)| quoted)
}

/// `lockgate: unique key "<key>" of job type "<type>" is held by job <id>`; the key comes from
/// the arguments and may hold anything, so it is cut from the right.
fn duplicate(text: &str, message: String) -> Option<DbError> {
    let (head, holder) = text.rsplit_once("\" is held by job ")?;
    let (head, job_type) = head.rsplit_once("\" of job type \"")?;
    let (_, key) = head.split_once("unique key \"")?;
    let holder = JobId(holder.trim().parse().ok()?);
    Some(DbError::Duplicate { key: key.to_string(), job_type: job_type.to_string(), holder, message })
}

impl DbError {
    /// Whether the server refused to write: it is read-only (SQLSTATE 25006). Transient for a
    /// statement under way; at a process's start it is more often a URL that reaches a standby.
    pub fn is_read_only(&self) -> bool {
        matches!(self, Self::Sqlx(sqlx::Error::Database(db)) if db.code().is_some_and(|code| code == "25006"))
    }

    /// Whether retrying the same call may succeed: connection loss, a terminated backend, a
    /// restarting server, pool exhaustion. Callers retry these; everything else is final.
    pub fn is_transient(&self) -> bool {
        let Self::Sqlx(err) = self else { return false };
        match err {
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Protocol(_) => true,
            sqlx::Error::Database(db) => db.code().is_some_and(|code| {
                // 08: connection exception; 57P01..03: admin shutdown, crash shutdown, cannot
                // connect now; 40001/40P01: serialization failure and deadlock (retry is the fix);
                // 55P03/57014: the runtime's lock_timeout or statement_timeout gave up waiting
                // (a producer's open transaction, say) while the delivery still had budget (H28).
                // 26000/42P05: a prepared statement the server lacks or already has, as through a
                // transaction-mode pooler whose URL does not say `pooler=transaction`: the
                // statement did not run, so running it again is safe. 57P05/25P03: the server
                // ended a session idle past `idle_session_timeout` or a transaction idle past
                // `idle_in_transaction_session_timeout` (a pooled connection that waited too
                // long): nothing of the statement ran, and a new connection runs it (review
                // helper-80: a completion failed for good on a pool's stale connection). 25006:
                // the server is read-only (a standby the URL reached during a failover, or
                // default_transaction_read_only turned on, as managed databases do when their disk
                // fills): the statement wrote nothing, and the writable server runs it; a job that
                // succeeded meanwhile is completed then, not run again.
                code.starts_with("08")
                    || matches!(
                        code.as_ref(),
                        "57P01"
                            | "57P02"
                            | "57P03"
                            | "57P05"
                            | "25P03"
                            | "25006"
                            | "40001"
                            | "40P01"
                            | "55P03"
                            | "57014"
                            | "26000"
                            | "42P05"
                    )
            }),
            _ => false,
        }
    }
}
