//! Transaction pooling (PgBouncer `pool_mode = transaction` and poolers like it): a pooler hands
//! each transaction, and each statement outside one, to whichever server connection is free.
//! sqlx runs a statement as two exchanges (Parse + Describe, then Bind + Execute), each ending
//! with a Sync, and caches named prepared statements per client connection. Through such a
//! pooler the Bind can reach a server that never saw the Parse, or one holding another
//! client's statement of the same name: a failed statement at best, the wrong statement run
//! with our values at worst.
//!
//! With [`set_transaction_pooling`] on, every statement lockgate runs is unnamed (never cached)
//! and runs inside a transaction, so both exchanges reach the one server the pooler pins for
//! that transaction. Off (the default), statements are prepared once per connection and cached
//! as sqlx does, and a statement given a pool runs on one of its connections as before.
//!
//! The setting is per process: a process that talks to a pooler and to a direct database pays
//! the pooled path's round trips on both (design §48).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{Connection, Executor, FromRow, PgConnection, PgPool, Postgres, Transaction};

use crate::DbError;

static TRANSACTION_POOLING: AtomicBool = AtomicBool::new(false);

/// Makes every statement lockgate runs in this process safe through a transaction-mode pooler
/// (see the module docs). Set it before the first statement; the CLI sets it from
/// `pooler=transaction` in the database URL.
pub fn set_transaction_pooling(on: bool) {
    TRANSACTION_POOLING.store(on, Ordering::Relaxed);
}

/// Whether [`set_transaction_pooling`] is on.
pub fn transaction_pooling() -> bool {
    TRANSACTION_POOLING.load(Ordering::Relaxed)
}

/// `sqlx::query`, unnamed under transaction pooling.
pub fn query(sql: &str) -> Query<'_, Postgres, PgArguments> {
    sqlx::query(sql).persistent(!transaction_pooling())
}

/// `sqlx::query_as`, unnamed under transaction pooling.
pub fn query_as<'q, O>(sql: &'q str) -> QueryAs<'q, Postgres, O, PgArguments>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_as(sql).persistent(!transaction_pooling())
}

/// `sqlx::query_scalar`, unnamed under transaction pooling.
pub fn query_scalar<'q, O>(sql: &'q str) -> QueryScalar<'q, Postgres, O, PgArguments>
where
    (O,): for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_scalar(sql).persistent(!transaction_pooling())
}

/// What a function of the SQL layer is given to run on: a pool (it takes one connection for the
/// call) or a connection, which may be a transaction's (`&mut *tx`).
pub enum Db<'c> {
    Pool(&'c PgPool),
    Conn(&'c mut PgConnection),
    /// A connection its owner keeps outside any transaction ([`Db::idle`]).
    Idle(&'c mut PgConnection),
}

impl<'c> Db<'c> {
    /// A connection its owner never leaves in a transaction (the runtime's loops, the client's
    /// lane): under transaction pooling it needs no probe for a transaction opened by a raw `BEGIN`.
    pub fn idle(conn: &'c mut PgConnection) -> Self {
        Self::Idle(conn)
    }

    /// The same pool or connection, for one more call.
    pub fn reborrow(&mut self) -> Db<'_> {
        match self {
            Self::Pool(pool) => Db::Pool(pool),
            Self::Conn(conn) => Db::Conn(conn),
            Self::Idle(conn) => Db::Idle(conn),
        }
    }
}

impl<'c> From<&'c PgPool> for Db<'c> {
    fn from(pool: &'c PgPool) -> Self {
        Self::Pool(pool)
    }
}

impl<'c> From<&'c mut PgConnection> for Db<'c> {
    fn from(conn: &'c mut PgConnection) -> Self {
        Self::Conn(conn)
    }
}

impl<'c> From<&'c mut PoolConnection<Postgres>> for Db<'c> {
    fn from(conn: &'c mut PoolConnection<Postgres>) -> Self {
        Self::Conn(conn)
    }
}

/// Where one of the SQL layer's functions runs its statements: the connection it was given or
/// one taken from the pool it was given, or, under transaction pooling, a transaction on it (a
/// savepoint if it is already in one) that [`Scope::finish`] commits.
enum Scope<'c> {
    Owned(PoolConnection<Postgres>),
    Borrowed(&'c mut PgConnection),
    Pooled(Transaction<'c, Postgres>),
    /// A savepoint in a transaction the caller opened with a `BEGIN` of its own, which sqlx does
    /// not count: committing "our" transaction there would commit the caller's.
    Savepoint(&'c mut PgConnection),
}

const SAVEPOINT: &str = "SAVEPOINT lockgate_scope";

impl<'c> Scope<'c> {
    async fn open(db: Db<'c>) -> Result<Self, DbError> {
        Ok(match (db, transaction_pooling()) {
            (Db::Pool(pool), false) => Self::Owned(pool.acquire().await?),
            (Db::Conn(conn) | Db::Idle(conn), false) => Self::Borrowed(conn),
            (Db::Pool(pool), true) => Self::Pooled(pool.begin().await?),
            (Db::Idle(conn), true) => Self::Pooled(conn.begin().await?),
            (Db::Conn(conn), true) if conn.is_in_transaction() => Self::Pooled(conn.begin().await?),
            (Db::Conn(conn), true) => match simple_query(conn, SAVEPOINT).await {
                Ok(_) => Self::Savepoint(conn),
                // 25P01: no transaction block, so ours is the only one.
                Err(err) if err.as_database_error().and_then(|e| e.code()).as_deref() == Some("25P01") => {
                    Self::Pooled(conn.begin().await?)
                }
                Err(err) => return Err(err.into()),
            },
        })
    }

    fn conn(&mut self) -> &mut PgConnection {
        match self {
            Self::Owned(conn) => conn,
            Self::Borrowed(conn) | Self::Savepoint(conn) => conn,
            Self::Pooled(tx) => tx,
        }
    }

    /// Commits a pooled scope whose work succeeded; one that failed rolls back (a transaction
    /// when dropped, a savepoint here).
    async fn finish<T>(self, out: Result<T, DbError>) -> Result<T, DbError> {
        match (self, out) {
            (Self::Pooled(tx), Ok(value)) => {
                tx.commit().await?;
                Ok(value)
            }
            // A session that refused to write keeps its read-only default (set for its database
            // or role when it began) whatever the server does since: closed rather than given
            // back to the pool, so that the next statement takes a session that sees the server
            // as it is now (review helper-89: a runtime stayed read-only after the RESET).
            (Self::Owned(conn), Err(err)) if err.is_read_only() => {
                let _ = conn.close().await;
                Err(err)
            }
            (Self::Savepoint(conn), out) => {
                let end = if out.is_ok() {
                    "RELEASE SAVEPOINT lockgate_scope"
                } else {
                    "ROLLBACK TO SAVEPOINT lockgate_scope; RELEASE SAVEPOINT lockgate_scope"
                };
                simple_query(conn, end).await?;
                out
            }
            (_, out) => out,
        }
    }
}

/// Runs `statements` on `db` in a [`Scope`]: committed (under transaction pooling) when they
/// succeed, rolled back when they fail.
pub(crate) async fn on<T>(
    db: Db<'_>,
    statements: impl AsyncFnOnce(&mut PgConnection) -> Result<T, DbError>,
) -> Result<T, DbError> {
    let mut scope = Scope::open(db).await?;
    let out = statements(scope.conn()).await;
    scope.finish(out).await
}

/// One statement without arguments (the simple protocol: one exchange, safe through a pooler),
/// boxed so that the futures of the functions using it stay provably `Send`.
fn simple_query<'a>(
    conn: &'a mut PgConnection,
    sql: &'static str,
) -> Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + 'a>> {
    Box::pin(async move { conn.execute(sql).await.map(drop) })
}

/// This session's `lock_timeout` and `statement_timeout`, in milliseconds (0: off). Through a
/// transaction-mode pooler, lockgate cannot set them per connection (the pooler refuses startup
/// options, and a session setting would follow the server connection to other clients): the
/// role's and database's settings are then every statement's budgets (H28).
pub async fn session_budgets<'c>(db: impl Into<Db<'c>>) -> Result<(i64, i64), DbError> {
    on(db.into(), async |conn| {
        Ok(sqlx::query_as(
            "SELECT (SELECT setting::bigint FROM pg_settings WHERE name = 'lock_timeout'),
                    (SELECT setting::bigint FROM pg_settings WHERE name = 'statement_timeout')",
        )
        .persistent(!transaction_pooling())
        .fetch_one(conn)
        .await?)
    })
    .await
}
