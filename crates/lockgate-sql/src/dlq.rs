//! Dead-letter statements: list, retry (back to the queue as a new message), purge.

use crate::columns::{readable_time, shown_json};
use chrono::{DateTime, Utc};
use lockgate_core::JobId;
use serde::Serialize;
use serde_json::Value;
use sqlx::Row;

use crate::pooler::{on, query, query_as, query_scalar, Db};

use crate::DbError;

/// Which dead letters an operation applies to: `None` fields match everything.
#[derive(Debug, Clone, Default)]
pub struct DlqFilter {
    pub queue: Option<String>,
    pub job_ids: Option<Vec<i64>>,
}

/// One row of `lockgate.dead_letters`.
#[derive(Debug, Clone, Serialize)]
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
    /// `None` for a time no client can read (`infinity`, written by hand).
    pub enqueued_at: Option<DateTime<Utc>>,
    pub dead_at: DateTime<Utc>,
    /// Every failed attempt, the last one included: `{"attempt", "at", "error"}` (the headers'
    /// `errors`; empty for a message that was not lockgate's).
    pub errors: Value,
}

/// Dead letters matching `filter`, oldest first, at most `limit`.
pub async fn dlq_list<'c>(db: impl Into<Db<'c>>, filter: &DlqFilter, limit: i64) -> Result<Vec<DeadLetter>, DbError> {
    on(db.into(), async |conn| {
        static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
            format!(
                "SELECT id, queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, {}, dead_at,
                        COALESCE(headers->'errors', '[]')
                   FROM lockgate.dead_letters
                  WHERE ($1::text IS NULL OR queue = $1)
                    AND ($2::bigint[] IS NULL OR job_id = ANY ($2) OR (job_id IS NULL AND msg_id = ANY ($2)))
                  ORDER BY id LIMIT $3",
                readable_time("enqueued_at")
            )
        });
        let rows = query(&SQL)
            .bind(filter.queue.as_deref())
            .bind(filter.job_ids.as_deref())
            .bind(limit)
            .fetch_all(conn)
            .await?;
        Ok(rows
            .iter()
            .map(|r| DeadLetter {
                id: r.get(0),
                queue: r.get(1),
                msg_id: r.get(2),
                job_id: r.get::<Option<i64>, _>(3).map(JobId),
                job_type: r.get(4),
                args: shown_json(r, 5),
                headers: shown_json(r, 6),
                reason: r.get(7),
                error: r.get(8),
                attempts: r.get(9),
                enqueued_at: r.get(10),
                dead_at: r.get(11),
                errors: shown_json(r, 12).unwrap_or(Value::Array(Vec::new())),
            })
            .collect())
    })
    .await
}

/// What `dlq_retry` did with one dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DlqRetryOutcome {
    /// Sent back to its queue as the new message `msg_id`.
    Retried { msg_id: i64 },
    /// Kept: another job (this one) holds its unique key.
    Duplicate { holder: JobId },
    /// Kept: its queue, or the queue's PGMQ table, no longer exists.
    QueueMissing,
    /// Kept: its job type is not defined (removed since, or never defined: a dead letter of
    /// reason `unknown_job_type`). Define it again, or purge the dead letter.
    TypeMissing,
    /// Kept: another transaction holds the dead letter (a retry or purge under way), or is taking
    /// or giving up its unique key (a producer's enqueue not yet committed, waited for 1 s).
    /// Nothing was done with it; try again.
    Busy,
}

/// One dead letter `dlq_retry` matched: its queue, its job id (none for a message that was not
/// lockgate's) and what became of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DlqRetried {
    pub queue: String,
    pub job_id: Option<JobId>,
    pub outcome: DlqRetryOutcome,
}

/// Sends matching dead letters back to their queues, keeping those whose unique key another job
/// holds, whose queue or job type is gone, or that another transaction holds; one row per dead
/// letter matched.
pub async fn dlq_retry<'c>(db: impl Into<Db<'c>>, filter: &DlqFilter) -> Result<Vec<DlqRetried>, DbError> {
    on(db.into(), async |conn| {
        let rows = query("SELECT queue, msg_id, job_id, status FROM lockgate.dlq_retry($1, $2, true)")
            .bind(filter.queue.as_deref())
            .bind(filter.job_ids.as_deref())
            .fetch_all(conn)
            .await?;
        Ok(rows
            .iter()
            .map(|r| {
                let job_id = r.get::<Option<i64>, _>(2).map(JobId);
                let outcome = match (r.get::<&str, _>(3), r.get::<Option<i64>, _>(1), job_id) {
                    ("duplicate", _, Some(holder)) => DlqRetryOutcome::Duplicate { holder },
                    ("busy", _, _) => DlqRetryOutcome::Busy,
                    ("type_missing", _, _) => DlqRetryOutcome::TypeMissing,
                    (_, Some(msg_id), _) => DlqRetryOutcome::Retried { msg_id },
                    _ => DlqRetryOutcome::QueueMissing,
                };
                // For a duplicate, the row's job_id is the holder's; the dead letter's own is not returned.
                let job_id = if matches!(outcome, DlqRetryOutcome::Duplicate { .. }) { None } else { job_id };
                DlqRetried { queue: r.get(0), job_id, outcome }
            })
            .collect())
    })
    .await
}

/// The dead letters `filter` matches whose id (`lockgate.dead_letters.id`) is above `after` and
/// at most `upto`, the first `limit` by id: each as (its id,
/// the id `DlqFilter::job_ids` selects it by, its job id or, for a message that was not lockgate's,
/// its message id). For an operator's command that works through many dead letters a statement
/// at a time (`lockgate dlq retry`).
pub async fn dlq_page<'c>(
    db: impl Into<Db<'c>>,
    filter: &DlqFilter,
    after: i64,
    upto: i64,
    limit: i64,
) -> Result<Vec<(i64, i64)>, DbError> {
    on(db.into(), async |conn| {
        Ok(query_as(
            "SELECT id, COALESCE(job_id, msg_id) FROM lockgate.dead_letters
              WHERE ($1::text IS NULL OR queue = $1)
                AND ($2::bigint[] IS NULL OR job_id = ANY ($2) OR (job_id IS NULL AND msg_id = ANY ($2)))
                AND id > $3 AND id <= $4 AND COALESCE(job_id, msg_id) IS NOT NULL
              ORDER BY id LIMIT $5",
        )
        .bind(filter.queue.as_deref())
        .bind(filter.job_ids.as_deref())
        .bind(after)
        .bind(upto)
        .bind(limit)
        .fetch_all(conn)
        .await?)
    })
    .await
}

/// The id (`lockgate.dead_letters.id`) of the last dead letter `filter` matches, if any.
pub async fn dlq_last<'c>(db: impl Into<Db<'c>>, filter: &DlqFilter) -> Result<Option<i64>, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar(
            "SELECT max(id) FROM lockgate.dead_letters
              WHERE ($1::text IS NULL OR queue = $1)
                AND ($2::bigint[] IS NULL OR job_id = ANY ($2) OR (job_id IS NULL AND msg_id = ANY ($2)))",
        )
        .bind(filter.queue.as_deref())
        .bind(filter.job_ids.as_deref())
        .fetch_one(conn)
        .await?)
    })
    .await
}

/// Deletes matching dead letters for good; returns how many.
pub async fn dlq_purge<'c>(db: impl Into<Db<'c>>, filter: &DlqFilter) -> Result<i64, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.dlq_purge($1, $2)")
            .bind(filter.queue.as_deref())
            .bind(filter.job_ids.as_deref())
            .fetch_one(conn)
            .await?)
    })
    .await
}
