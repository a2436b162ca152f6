//! Status statements: per-queue counts for `lockgate status`, and the gauges of `/metrics`.

use sqlx::Row;

use crate::pooler::{on, query, query_scalar, Db};

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
    /// Claims skip the queue (`lockgate.pause_queue`).
    pub paused: bool,
}

pub async fn queue_stats<'c>(db: impl Into<Db<'c>>) -> Result<Vec<QueueStats>, DbError> {
    on(db.into(), async |conn| {
        let rows = query(
            "SELECT queue, ready, scheduled, running, dead, oldest_ready_seconds, paused FROM lockgate.queue_stats()",
        )
        .fetch_all(conn)
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
                paused: r.get(6),
            })
            .collect())
    })
    .await
}

/// Uniqueness locks held, per job type and mode (`lockgate.unique_lock_stats`).
#[derive(Debug, Clone, PartialEq)]
pub struct UniqueLockStats {
    pub job_type: String,
    pub mode: String,
    pub held: i64,
    /// Seconds since the oldest of them was taken (or moved to a new message).
    pub oldest_seconds: f64,
}

pub async fn unique_lock_stats<'c>(db: impl Into<Db<'c>>) -> Result<Vec<UniqueLockStats>, DbError> {
    on(db.into(), async |conn| {
        let rows = query("SELECT job_type, mode, held, oldest_seconds FROM lockgate.unique_lock_stats()")
            .fetch_all(conn)
            .await?;
        Ok(rows
            .iter()
            .map(|r| UniqueLockStats { job_type: r.get(0), mode: r.get(1), held: r.get(2), oldest_seconds: r.get(3) })
            .collect())
    })
    .await
}

/// One queue's jobs finished in the last minute and hour (`lockgate.queue_throughput`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueThroughput {
    pub queue: String,
    pub succeeded_last_minute: i64,
    pub succeeded_last_hour: i64,
    /// The archive count stopped at its bound: the succeeded counts are lower bounds.
    pub succeeded_capped: bool,
    /// Dead-lettered in the window, and still in the dead letters.
    pub failed_last_minute: i64,
    pub failed_last_hour: i64,
}

/// The throughput of every queue, reading at most `max_rows` archive index entries per queue.
pub async fn queue_throughput<'c>(db: impl Into<Db<'c>>, max_rows: i32) -> Result<Vec<QueueThroughput>, DbError> {
    on(db.into(), async |conn| {
        let rows = query(
            "SELECT queue, succeeded_last_minute, succeeded_last_hour, succeeded_capped, failed_last_minute, failed_last_hour
               FROM lockgate.queue_throughput($1)",
        )
        .bind(max_rows)
        .fetch_all(conn)
        .await?;
        Ok(rows
            .iter()
            .map(|r| QueueThroughput {
                queue: r.get(0),
                succeeded_last_minute: r.get(1),
                succeeded_last_hour: r.get(2),
                succeeded_capped: r.get(3),
                failed_last_minute: r.get(4),
                failed_last_hour: r.get(5),
            })
            .collect())
    })
    .await
}

/// What `/metrics` reports from the database, read once per interval
/// (`lockgate.metrics_snapshot`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MetricsSnapshot {
    pub queues: Vec<QueueMetrics>,
    /// The `max_keys` busiest keys, then the rest summed as key `other`.
    pub keys: Vec<KeyMetrics>,
    pub processes: Vec<ProcessCount>,
}

/// One queue's gauges: `lockgate.queue_stats` plus its parked jobs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QueueMetrics {
    pub queue: String,
    pub ready: i64,
    pub scheduled: i64,
    pub running: i64,
    pub parked: i64,
    pub dead: i64,
    pub oldest_ready_seconds: Option<f64>,
    pub paused: bool,
}

/// Permits held and jobs parked under one concurrency key (or under every key past the cap).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KeyMetrics {
    pub key: String,
    pub held: i64,
    pub parked: i64,
}

/// Rows of `lockgate.processes` of one kind (supervisor, worker, dispatcher).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProcessCount {
    pub kind: String,
    pub count: i64,
}

/// Every gauge of `/metrics` in one statement; keys past the `max_keys` busiest are summed.
pub async fn metrics_snapshot<'c>(db: impl Into<Db<'c>>, max_keys: i32) -> Result<MetricsSnapshot, DbError> {
    on(db.into(), async |conn| {
        let snapshot: sqlx::types::Json<MetricsSnapshot> =
            query_scalar("SELECT lockgate.metrics_snapshot($1)").bind(max_keys).fetch_one(conn).await?;
        Ok(snapshot.0)
    })
    .await
}
