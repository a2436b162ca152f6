//! Batch statements: create, close, show; and the maintenance that enqueues callbacks a finish
//! could not.

use chrono::{DateTime, Utc};
use lockgate_core::{BatchId, JobTypeName};
use serde::Serialize;
use serde_json::Value;
use sqlx::Row;

use crate::pooler::{on, query, query_scalar, Db};

use crate::DbError;

/// The job types a batch enqueues when it finishes, and the properties they receive.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchCallbacks {
    /// Enqueued when every job is counted, whatever the outcome.
    pub on_finish: Option<JobTypeName>,
    /// Enqueued when every job is counted and none failed.
    pub on_success: Option<JobTypeName>,
    /// Enqueued when every job is counted and some were dead-lettered.
    pub on_failure: Option<JobTypeName>,
    /// A JSON object passed to the callbacks as `properties`.
    pub properties: Option<Value>,
}

/// One batch's progress, exact as of the statement that read it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchInfo {
    pub id: BatchId,
    /// `open` (accepts jobs), `closed` (finishes when its last job is counted) or `finished`.
    pub state: String,
    pub total: i64,
    pub succeeded: i64,
    pub failed: i64,
    pub pending: i64,
    pub on_finish: Option<String>,
    pub on_success: Option<String>,
    pub on_failure: Option<String>,
    pub properties: Value,
    /// Finished, but its callbacks could not be enqueued yet (the sweep retries them).
    pub callbacks_pending: bool,
    pub callback_error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub closed_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// `lockgate.create_batch`: a new open batch. Callback types must exist (else `UnknownJobType`).
pub async fn create_batch<'c>(db: impl Into<Db<'c>>, callbacks: &BatchCallbacks) -> Result<BatchId, DbError> {
    on(db.into(), async |conn| {
        let id: i64 = query_scalar("SELECT lockgate.create_batch($1, $2, $3, COALESCE($4, '{}'::jsonb))")
            .bind(callbacks.on_finish.as_ref().map(JobTypeName::as_str))
            .bind(callbacks.on_success.as_ref().map(JobTypeName::as_str))
            .bind(callbacks.on_failure.as_ref().map(JobTypeName::as_str))
            .bind(callbacks.properties.as_ref())
            .fetch_one(conn)
            .await?;
        Ok(BatchId(id))
    })
    .await
}

/// `lockgate.close_batch`: no more jobs; returns the state after closing (`closed`, or
/// `finished` when nothing was pending). Closing twice or an unknown id is `InvalidArgument`.
pub async fn close_batch<'c>(db: impl Into<Db<'c>>, batch: BatchId) -> Result<String, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.close_batch($1)").bind(batch.0).fetch_one(conn).await?)
    })
    .await
}

/// `lockgate.batch`: one batch's progress, or `None` for an unknown id.
pub async fn batch_info<'c>(db: impl Into<Db<'c>>, batch: BatchId) -> Result<Option<BatchInfo>, DbError> {
    on(db.into(), async |conn| {
        let row = query("SELECT * FROM lockgate.batch($1)").bind(batch.0).fetch_optional(conn).await?;
        Ok(row.map(|r| to_info(&r)))
    })
    .await
}

/// Batches not finished yet (or whose callbacks are pending), oldest first.
pub async fn unfinished_batches<'c>(db: impl Into<Db<'c>>, max_rows: i32) -> Result<Vec<BatchInfo>, DbError> {
    on(db.into(), async |conn| {
        let rows = query(
            "SELECT b.id, b.state, b.total, b.succeeded, b.failed, b.total - b.succeeded - b.failed, b.on_finish,
                b.on_success, b.on_failure, b.properties, b.callbacks_pending, b.callback_error, b.created_at,
                b.closed_at, b.finished_at
           FROM lockgate.unfinished_batches($1) b",
        )
        .bind(max_rows)
        .fetch_all(conn)
        .await?;
        Ok(rows.iter().map(to_info).collect())
    })
    .await
}

/// `lockgate.batch_sweep`: enqueues the callbacks of finished batches that could not enqueue
/// them when they finished; returns how many batches it completed.
pub async fn batch_sweep<'c>(db: impl Into<Db<'c>>) -> Result<i32, DbError> {
    on(db.into(), async |conn| Ok(query_scalar("SELECT lockgate.batch_sweep()").fetch_one(conn).await?)).await
}

fn to_info(r: &sqlx::postgres::PgRow) -> BatchInfo {
    BatchInfo {
        id: BatchId(r.get(0)),
        state: r.get(1),
        total: r.get(2),
        succeeded: r.get(3),
        failed: r.get(4),
        pending: r.get(5),
        on_finish: r.get(6),
        on_success: r.get(7),
        on_failure: r.get(8),
        properties: r.get(9),
        callbacks_pending: r.get(10),
        callback_error: r.get(11),
        created_at: r.get(12),
        closed_at: r.get(13),
        finished_at: r.get(14),
    }
}
