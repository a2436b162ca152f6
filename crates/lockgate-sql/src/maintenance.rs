//! Maintenance statements, one per sweep.

use std::time::Duration;

use crate::pooler::{on, query_scalar, Db};

use crate::DbError;

/// Deletes up to `max_rows` archived messages of `queue` older than `retention`.
pub async fn prune_archive<'c>(
    db: impl Into<Db<'c>>,
    queue: &str,
    retention: Duration,
    max_rows: i32,
) -> Result<i64, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.prune_archive($1, $2, $3)")
            .bind(queue)
            .bind(retention.as_secs_f64())
            .bind(max_rows)
            .fetch_one(conn)
            .await?)
    })
    .await
}

/// `lockgate.reap_batches`: counts as failed the members of closed batches idle for `min_idle`
/// whose job no longer exists (deleted outside lockgate); returns how many.
pub async fn reap_batches<'c>(db: impl Into<Db<'c>>, min_idle: Duration) -> Result<i32, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.reap_batches(make_interval(secs => $1))")
            .bind(min_idle.as_secs_f64())
            .fetch_one(conn)
            .await?)
    })
    .await
}

/// `lockgate.reclaim_idle_keys`: deletes the semaphore rows of keys with no permit held and
/// nothing parked, unchanged for longer than `idle`, at most `max_rows`; returns how many.
pub async fn reclaim_idle_keys<'c>(db: impl Into<Db<'c>>, idle: Duration, max_rows: i32) -> Result<i32, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.reclaim_idle_keys(make_interval(secs => $1), $2)")
            .bind(idle.as_secs_f64())
            .bind(max_rows)
            .fetch_one(conn)
            .await?)
    })
    .await
}

/// `lockgate.reap_unique_locks`: deletes uniqueness locks older than `min_age` whose job no
/// longer exists (deleted outside lockgate); returns how many.
pub async fn reap_unique_locks<'c>(db: impl Into<Db<'c>>, min_age: Duration) -> Result<i32, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.reap_unique_locks(make_interval(secs => $1))")
            .bind(min_age.as_secs_f64())
            .fetch_one(conn)
            .await?)
    })
    .await
}
