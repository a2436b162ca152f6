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

/// Whether backend `pid` no longer carries the statement mark of job message (queue, msg_id)
/// (`lockgate.start_statement`); while it does, it is terminated (the caller asks again). For an
/// executor whose statement's connection gives no answer: the server tells whether the statement
/// still runs. Only that backend: another carrying the same mark may be the job's next delivery's.
pub async fn end_marked_backend<'c>(
    db: impl Into<Db<'c>>,
    pid: i32,
    queue: &str,
    msg_id: i64,
) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar(
            "WITH marked AS (SELECT a.pid FROM pg_catalog.pg_stat_activity a
                              WHERE a.pid = $1 AND a.application_name = lockgate._statement_tag($2, $3)),
                  ended AS (SELECT pg_catalog.pg_terminate_backend(m.pid) FROM marked m)
             SELECT NOT EXISTS (SELECT 1 FROM ended)",
        )
        .bind(pid)
        .bind(queue)
        .bind(msg_id)
        .fetch_one(conn)
        .await?)
    })
    .await
}

/// Whether backend `pid` is running the statement of job message (queue, msg_id): active, and
/// carrying its mark (`lockgate.start_statement`).
pub async fn backend_runs_statement<'c>(
    db: impl Into<Db<'c>>,
    pid: i32,
    queue: &str,
    msg_id: i64,
) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a
                             WHERE a.pid = $1 AND a.application_name = lockgate._statement_tag($2, $3)
                               AND a.state = 'active')",
        )
        .bind(pid)
        .bind(queue)
        .bind(msg_id)
        .fetch_one(conn)
        .await?)
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
