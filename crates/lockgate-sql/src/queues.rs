//! Queue statements: create (idempotent, concurrency-safe), list, pause, resume and drop.

use crate::pooler::{on, query, query_scalar, Db};

use crate::DbError;

/// Creates the queue and its PGMQ tables if missing (`lockgate.create_queue`).
pub async fn create_queue<'c>(db: impl Into<Db<'c>>, queue: &str) -> Result<(), DbError> {
    on(db.into(), async |conn| {
        query("SELECT lockgate.create_queue($1)").bind(queue).execute(conn).await?;
        Ok(())
    })
    .await
}

/// Every queue lockgate manages, by name.
pub async fn list_queues<'c>(db: impl Into<Db<'c>>) -> Result<Vec<String>, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT name FROM lockgate.queues ORDER BY name").fetch_all(conn).await?)
    })
    .await
}

/// Pauses a queue (`lockgate.pause_queue`): claims skip it until it is resumed; running jobs
/// finish and producers still enqueue. False if it was paused already; `UnknownQueue` for a
/// queue that does not exist.
pub async fn pause_queue<'c>(db: impl Into<Db<'c>>, queue: &str) -> Result<bool, DbError> {
    on(db.into(), async |conn| Ok(query_scalar("SELECT lockgate.pause_queue($1)").bind(queue).fetch_one(conn).await?))
        .await
}

/// Resumes a paused queue (`lockgate.resume_queue`) and wakes idle workers. False if it was not
/// paused; `UnknownQueue` for a queue that does not exist.
pub async fn resume_queue<'c>(db: impl Into<Db<'c>>, queue: &str) -> Result<bool, DbError> {
    on(db.into(), async |conn| Ok(query_scalar("SELECT lockgate.resume_queue($1)").bind(queue).fetch_one(conn).await?))
        .await
}

/// Drops a queue no one uses any more (`lockgate.drop_queue`): its PGMQ tables, archive included,
/// its steps and its row. False if there was no such queue; refused, naming every use, while job
/// types are defined on it or it holds jobs, parked jobs, dead letters, leases, unique locks,
/// recurring tasks or a registered pool.
pub async fn drop_queue<'c>(db: impl Into<Db<'c>>, queue: &str) -> Result<bool, DbError> {
    on(db.into(), async |conn| Ok(query_scalar("SELECT lockgate.drop_queue($1)").bind(queue).fetch_one(conn).await?))
        .await
}
