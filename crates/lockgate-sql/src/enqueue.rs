//! Enqueue statements. Both take any executor, so they join the caller's transaction (G8).

use lockgate_core::{EnqueueStatus, EnqueuedJob, JobId};
use serde_json::Value;
use sqlx::{PgExecutor, Row};

use crate::DbError;

/// `lockgate.enqueue(job_type, args, options)`: one job.
pub async fn enqueue<'c>(
    db: impl PgExecutor<'c>,
    job_type: &str,
    args: &Value,
    options: &Value,
) -> Result<EnqueuedJob, DbError> {
    let row = sqlx::query("SELECT queue, msg_id, job_id, status FROM lockgate.enqueue($1, $2, $3)")
        .bind(job_type)
        .bind(args)
        .bind(options)
        .fetch_one(db)
        .await?;
    Ok(to_job(&row))
}

/// `lockgate.enqueue_many(job_type, args[], options)`: many jobs of one type in one statement,
/// returned in the order of `args`.
pub async fn enqueue_many<'c>(
    db: impl PgExecutor<'c>,
    job_type: &str,
    args: &[Value],
    options: &Value,
) -> Result<Vec<EnqueuedJob>, DbError> {
    let rows = sqlx::query("SELECT queue, msg_id, job_id, status FROM lockgate.enqueue_many($1, $2, $3)")
        .bind(job_type)
        .bind(args)
        .bind(options)
        .fetch_all(db)
        .await?;
    Ok(rows.iter().map(to_job).collect())
}

fn to_job(row: &sqlx::postgres::PgRow) -> EnqueuedJob {
    EnqueuedJob {
        queue: row.get(0),
        msg_id: row.get(1),
        job_id: JobId(row.get(2)),
        // The SQL function returns only these three statuses.
        status: EnqueueStatus::parse(row.get(3)).unwrap_or(EnqueueStatus::Enqueued),
    }
}
