//! Status statements: per-queue counts for `lockgate status`.

use sqlx::{PgExecutor, Row};

use crate::DbError;

/// One queue's counts (`lockgate.queue_stats`).
#[derive(Debug, Clone, PartialEq)]
pub struct QueueStats {
    pub queue: String,
    pub ready: i64,
    pub scheduled: i64,
    pub running: i64,
    pub dead: i64,
    /// Seconds the oldest ready job has waited since it became ready.
    pub oldest_ready_seconds: Option<f64>,
}

pub async fn queue_stats<'c>(db: impl PgExecutor<'c>) -> Result<Vec<QueueStats>, DbError> {
    let rows =
        sqlx::query("SELECT queue, ready, scheduled, running, dead, oldest_ready_seconds FROM lockgate.queue_stats()")
            .fetch_all(db)
            .await?;
    Ok(rows
        .iter()
        .map(|r| QueueStats {
            queue: r.get(0),
            ready: r.get(1),
            scheduled: r.get(2),
            running: r.get(3),
            dead: r.get(4),
            oldest_ready_seconds: r.get(5),
        })
        .collect())
}
