//! The server backend an `sql` job's statement runs in, as its executor stops it: cancel or
//! terminate it, and watch it go. Safe through a transaction-mode pooler (each call runs in a
//! transaction of its own there, so its two exchanges reach one server: review helper-106), and
//! the backend named by pid and start, so that a new backend given the same pid is not taken for
//! it.

use chrono::{DateTime, Utc};

use crate::pooler::{on, query_scalar, Db};
use crate::DbError;

/// `pg_cancel_backend(pid)`, or `pg_terminate_backend(pid)` when `terminate`: whether the signal
/// was sent.
pub async fn signal_backend<'c>(db: impl Into<Db<'c>>, pid: i32, terminate: bool) -> Result<bool, DbError> {
    // Qualified: a function of the role's own put ahead of `pg_catalog` in its `search_path` is not
    // run in their place.
    let sql = if terminate {
        "SELECT pg_catalog.pg_terminate_backend($1)"
    } else {
        "SELECT pg_catalog.pg_cancel_backend($1)"
    };
    on(db.into(), async |conn| Ok(query_scalar(sql).bind(pid).fetch_one(conn).await?)).await
}

/// When backend `pid` started, if it is there.
pub async fn backend_start<'c>(db: impl Into<Db<'c>>, pid: i32) -> Result<Option<DateTime<Utc>>, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT backend_start FROM pg_catalog.pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_optional(conn)
            .await?
            .flatten())
    })
    .await
}

/// Whether the backend `pid` that started at `started` is still there.
pub async fn backend_listed<'c>(db: impl Into<Db<'c>>, pid: i32, started: DateTime<Utc>) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid = $1 AND backend_start = $2)",
        )
        .bind(pid)
        .bind(started)
        .fetch_one(conn)
        .await?)
    })
    .await
}
