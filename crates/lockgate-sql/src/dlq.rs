//! Dead-letter statements: list, retry (back to the queue as a new message), purge.

use chrono::{DateTime, Utc};
use lockgate_core::{EnqueueStatus, EnqueuedJob, JobId};
use serde_json::Value;
use sqlx::{PgExecutor, Row};

use crate::DbError;

/// Which dead letters an operation applies to: `None` fields match everything.
#[derive(Debug, Clone, Default)]
pub struct DlqFilter {
    pub queue: Option<String>,
    pub job_ids: Option<Vec<i64>>,
}

/// One row of `lockgate.dead_letters`.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub id: i64,
    pub queue: String,
    /// `None` for a parked job dead-lettered before it ever became a message.
    pub msg_id: Option<i64>,
    pub job_id: Option<JobId>,
    pub job_type: Option<String>,
    pub args: Option<Value>,
    pub headers: Option<Value>,
    pub reason: String,
    pub error: Option<String>,
    pub attempts: i32,
    pub enqueued_at: DateTime<Utc>,
    pub dead_at: DateTime<Utc>,
}

/// Dead letters matching `filter`, oldest first, at most `limit`.
pub async fn dlq_list<'c>(db: impl PgExecutor<'c>, filter: &DlqFilter, limit: i64) -> Result<Vec<DeadLetter>, DbError> {
    let rows = sqlx::query(
        "SELECT id, queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at, dead_at
           FROM lockgate.dead_letters
          WHERE ($1::text IS NULL OR queue = $1) AND ($2::bigint[] IS NULL OR job_id = ANY ($2))
          ORDER BY id LIMIT $3",
    )
    .bind(filter.queue.as_deref())
    .bind(filter.job_ids.as_deref())
    .bind(limit)
    .fetch_all(db)
    .await?;
    Ok(rows
        .iter()
        .map(|r| DeadLetter {
            id: r.get(0),
            queue: r.get(1),
            msg_id: r.get(2),
            job_id: r.get::<Option<i64>, _>(3).map(JobId),
            job_type: r.get(4),
            args: r.get(5),
            headers: r.get(6),
            reason: r.get(7),
            error: r.get(8),
            attempts: r.get(9),
            enqueued_at: r.get(10),
            dead_at: r.get(11),
        })
        .collect())
}

/// Sends matching dead letters back to their queues; returns the new messages (`Enqueued`), and
/// the dead letters left where they are because another job holds their unique key
/// (`Duplicate`, with the holder's job id).
pub async fn dlq_retry<'c>(db: impl PgExecutor<'c>, filter: &DlqFilter) -> Result<Vec<EnqueuedJob>, DbError> {
    let rows = sqlx::query("SELECT queue, msg_id, job_id, status FROM lockgate.dlq_retry($1, $2)")
        .bind(filter.queue.as_deref())
        .bind(filter.job_ids.as_deref())
        .fetch_all(db)
        .await?;
    Ok(rows
        .iter()
        .map(|r| EnqueuedJob {
            queue: r.get(0),
            msg_id: r.get(1),
            job_id: JobId(r.get::<Option<i64>, _>(2).unwrap_or_default()),
            // The SQL function returns only these two statuses.
            status: EnqueueStatus::parse(r.get(3)).unwrap_or(EnqueueStatus::Enqueued),
        })
        .collect())
}

/// Deletes matching dead letters for good; returns how many.
pub async fn dlq_purge<'c>(db: impl PgExecutor<'c>, filter: &DlqFilter) -> Result<i64, DbError> {
    Ok(sqlx::query_scalar("SELECT lockgate.dlq_purge($1, $2)")
        .bind(filter.queue.as_deref())
        .bind(filter.job_ids.as_deref())
        .fetch_one(db)
        .await?)
}
