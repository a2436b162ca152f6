//! Queue statements: create (idempotent, concurrency-safe) and list.

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
