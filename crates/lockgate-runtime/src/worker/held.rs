//! A connection that a loop keeps between its statements.
//!
//! sqlx's pool tests every connection it takes back with a round trip (a `Sync` on release,
//! whatever `test_before_acquire` says) and hands it back through a spawned task. A loop that runs
//! one statement after another (the fetch loop's claims, the completer's completions) keeps its
//! connection instead, and pays neither. After a failed statement the connection is given back
//! (the pool tests it and closes it if it is broken) and the next statement takes a fresh one; a
//! connection whose session refused to write is closed instead.

use lockgate_sql::{DbError, PgPool};
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres};

pub(crate) struct HeldConnection {
    pool: PgPool,
    conn: Option<PoolConnection<Postgres>>,
}

impl HeldConnection {
    pub fn new(pool: PgPool) -> Self {
        Self { pool, conn: None }
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
            None => self.conn.insert(self.pool.acquire().await.map_err(DbError::from)?),
        };
        let result = statement(conn).await;
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
