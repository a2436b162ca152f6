//! One job by id, in whatever state it is (`lockgate.job`).

use chrono::{DateTime, Utc};
use lockgate_core::JobId;
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgExecutor, Row};

use crate::DbError;

/// A job as `lockgate.job` finds it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobRecord {
    pub id: JobId,
    /// `queued`, `scheduled`, `running`, `retrying`, `parked`, `succeeded`, `discarded` or `dead`.
    pub state: String,
    pub queue: String,
    pub job_type: Option<String>,
    pub args: Option<Value>,
    pub priority: i32,
    /// Its current message (none while parked).
    pub msg_id: Option<i64>,
    /// The attempt its current (or last) delivery is; 0 before its first.
    pub attempt: i32,
    /// When it was first enqueued (kept across promotion and dead-letter retries).
    pub enqueued_at: Option<DateTime<Utc>>,
    /// When it becomes (or became) visible to claims; for a parked job, its scheduled time.
    pub visible_at: Option<DateTime<Utc>>,
    /// When it was archived or dead-lettered.
    pub finished_at: Option<DateTime<Utc>>,
    pub concurrency_key: Option<String>,
    /// Every failed attempt: `{"attempt", "at", "error"}`.
    pub errors: Value,
    /// For a dead job: why (`attempts_exhausted`, `undecodable`, `unknown_job_type`) and the last error.
    pub reason: Option<String>,
    pub error: Option<String>,
    pub headers: Option<Value>,
}

/// `lockgate.job(id)`: the job, or `None` when no job has that id (or it was pruned from the
/// archive by retention).
pub async fn job<'c>(db: impl PgExecutor<'c>, id: JobId) -> Result<Option<JobRecord>, DbError> {
    let row = sqlx::query(
        "SELECT id, state, queue, job_type, args, priority, msg_id, attempt, enqueued_at, visible_at, finished_at,
                concurrency_key, errors, reason, error, headers
           FROM lockgate.job($1)",
    )
    .bind(id.0)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|r| JobRecord {
        id: JobId(r.get(0)),
        state: r.get(1),
        queue: r.get(2),
        job_type: r.get(3),
        args: r.get(4),
        priority: r.get(5),
        msg_id: r.get(6),
        attempt: r.get(7),
        enqueued_at: r.get(8),
        visible_at: r.get(9),
        finished_at: r.get(10),
        concurrency_key: r.get(11),
        errors: r.get::<Option<Value>, _>(12).unwrap_or(Value::Array(Vec::new())),
        reason: r.get(13),
        error: r.get(14),
        headers: r.get(15),
    }))
}
