//! Enqueue statements. Both take any executor, so they join the caller's transaction (G8).

use lockgate_core::{EnqueueStatus, EnqueuedJob, JobId};
use serde_json::Value;
use sqlx::Row;

use crate::pooler::{on, query, Db};

use crate::DbError;

/// `lockgate.enqueue(job_type, args, options)`: one job.
pub async fn enqueue<'c>(
    db: impl Into<Db<'c>>,
    job_type: &str,
    args: &Value,
    options: &Value,
) -> Result<EnqueuedJob, DbError> {
    on(db.into(), async |conn| {
        let row = query("SELECT queue, msg_id, job_id, status FROM lockgate.enqueue($1, $2, $3)")
            .bind(job_type)
            .bind(args)
            .bind(options)
            .fetch_one(conn)
            .await?;
        Ok(to_job(&row))
    })
    .await
}

/// `lockgate.enqueue_many(job_type, args[], options)`: many jobs of one type in one statement,
/// returned in the order of `args`.
pub async fn enqueue_many<'c>(
    db: impl Into<Db<'c>>,
    job_type: &str,
    args: &[Value],
    options: &Value,
) -> Result<Vec<EnqueuedJob>, DbError> {
    on(db.into(), async |conn| {
        let rows = query("SELECT queue, msg_id, job_id, status FROM lockgate.enqueue_many($1, $2, $3)")
            .bind(job_type)
            .bind(args)
            .bind(options)
            .fetch_all(conn)
            .await?;
        Ok(rows.iter().map(to_job).collect())
    })
    .await
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
