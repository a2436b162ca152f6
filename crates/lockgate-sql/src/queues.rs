//! Queue statements: create (idempotent, concurrency-safe), list, pause and resume.

use sqlx::PgExecutor;

use crate::DbError;

/// Creates the queue and its PGMQ tables if missing (`lockgate.create_queue`).
pub async fn create_queue<'c>(db: impl PgExecutor<'c>, queue: &str) -> Result<(), DbError> {
    sqlx::query("SELECT lockgate.create_queue($1)").bind(queue).execute(db).await?;
    Ok(())
}

/// Every queue lockgate manages, by name.
pub async fn list_queues<'c>(db: impl PgExecutor<'c>) -> Result<Vec<String>, DbError> {
    Ok(sqlx::query_scalar("SELECT name FROM lockgate.queues ORDER BY name").fetch_all(db).await?)
}

/// Pauses a queue (`lockgate.pause_queue`): claims skip it until it is resumed; running jobs
/// finish and producers still enqueue. False if it was paused already; `UnknownQueue` for a
/// queue that does not exist.
pub async fn pause_queue<'c>(db: impl PgExecutor<'c>, queue: &str) -> Result<bool, DbError> {
    Ok(sqlx::query_scalar("SELECT lockgate.pause_queue($1)").bind(queue).fetch_one(db).await?)
}

/// Resumes a paused queue (`lockgate.resume_queue`) and wakes idle workers. False if it was not
/// paused; `UnknownQueue` for a queue that does not exist.
pub async fn resume_queue<'c>(db: impl PgExecutor<'c>, queue: &str) -> Result<bool, DbError> {
    Ok(sqlx::query_scalar("SELECT lockgate.resume_queue($1)").bind(queue).fetch_one(db).await?)
}
