//! Statements held to a bound: a connection that a loop keeps between its statements, and a
//! statement run on a connection taken for it.
//!
//! sqlx's pool tests every connection it takes back with a round trip (a `Sync` on release,
//! whatever `test_before_acquire` says) and hands it back through a spawned task. A loop that runs
//! one statement after another (the fetch loop's claims, the completer's completions) keeps its
//! connection instead, and pays neither. After a failed statement the connection is given back
//! (the pool tests it and closes it if it is broken) and the next statement takes a fresh one; a
//! connection whose session refused to write is closed instead. A statement not answered within
//! the connection's bound (a flow the network dropped without a reset, a server that hangs) is
//! given up and its connection closed: a claim awaited for good stalled its pool, and the
//! process's shutdown with it (review helper-135 F6). The maintenance services, the recurring
//! scheduler and the process registry run each statement through [`on_pool`] under the same
//! bound: a sweep awaited for good stopped sweeping for the process's life, a registry's beat
//! left it ready while its row went silent, and either held its shutdown for good (design §119).

use std::time::Duration;

use lockgate_sql::{DbError, PgPool};
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres};

use crate::config::RuntimeConfig;

/// How long one of the runtime's statements may go unanswered before it is given up with its
/// connection: half the visibility timeout, twice the server's own budget for it
/// (`budgets::Budget::runtime`, which ends the statement there first, except under transaction
/// pooling, where the role's settings apply). A claim answered later than that has spent half its
/// deliveries' budget; given up, they cost no attempt (§115) and run once their visibility lapses.
/// The maintenance services, the scheduler and the registry are held to it too (§119).
pub(crate) fn answer_within(config: &RuntimeConfig) -> Duration {
    (config.visibility_timeout / 2).max(Duration::from_millis(1))
}

pub(crate) struct HeldConnection {
    pool: PgPool,
    conn: Option<PoolConnection<Postgres>>,
    /// How long a statement may go unanswered.
    answer_within: Duration,
}

impl HeldConnection {
    pub fn new(pool: PgPool, answer_within: Duration) -> Self {
        Self { pool, conn: None, answer_within }
    }

    /// The pool it takes connections from.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs one statement on the held connection, taking one from the pool first if none is held.
    pub async fn run<T>(
        &mut self,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        let conn = match &mut self.conn {
            Some(conn) => conn,
            // The wait for a connection held to the same bound (the pool's own is 30 s): a claim
            // waiting on a connect that a partition swallowed claimed nothing for 30 s after the
            // network came back, and held the shutdown as long (review helper-142 F2).
            None => match tokio::time::timeout(self.answer_within, self.pool.acquire()).await {
                Ok(conn) => self.conn.insert(conn.map_err(DbError::from)?),
                Err(_) => return Err(no_answer(self.answer_within)),
            },
        };
        let Ok(result) = tokio::time::timeout(self.answer_within, statement(conn)).await else {
            // Its reply may still come, to a statement nobody reads: the connection is closed
            // (within sqlx's close timeout), not handed back, where the pool's test of it would
            // wait for that reply too. What the statement did is for the caller to judge, as after
            // any connection lost mid-statement.
            if let Some(mut conn) = self.conn.take() {
                conn.close_on_drop();
            }
            return Err(no_answer(self.answer_within));
        };
        match &result {
            // A session that refused to write (its database or role defaulted it to read-only)
            // stays so however the server changes since: closed, not given back (review helper-89).
            Err(err) if err.is_read_only() => {
                if let Some(conn) = self.conn.take() {
                    let _ = conn.close().await;
                }
            }
            Err(_) => self.conn = None,
            Ok(_) => {}
        }
        result
    }
}

/// Runs one statement on a connection of `pool` taken for it, given up (and the connection
/// closed, not handed back) when it is not answered within `within`, the wait for a connection
/// included. A final statement's path (`persist`) for the statements that need no held
/// connection (retry, dead letter, release), and every statement of the periodic services.
pub(crate) async fn on_pool<T>(
    pool: &PgPool,
    within: Duration,
    statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, DbError>,
) -> Result<T, DbError> {
    let started = tokio::time::Instant::now();
    let mut conn = match tokio::time::timeout(within, pool.acquire()).await {
        Ok(conn) => conn.map_err(DbError::from)?,
        Err(_) => return Err(no_answer(within)),
    };
    let Ok(result) = tokio::time::timeout_at(started + within, statement(&mut conn)).await else {
        conn.close_on_drop();
        return Err(no_answer(within));
    };
    // A session that refused to write stays so: closed, not given back, as a held connection's is.
    if result.as_ref().is_err_and(DbError::is_read_only) {
        let _ = conn.close().await;
    }
    result
}

/// The error of a statement given up for want of an answer: transient, as a lost connection is.
pub(crate) fn no_answer(within: Duration) -> DbError {
    let what = format!("no answer from the database within {} ms", within.as_millis());
    DbError::from(sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, what)))
}
