//! Enqueue statements. Both take any executor, so they join the caller's transaction (G8).

use lockgate_core::{EnqueueStatus, EnqueuedJob, JobId};
use serde_json::Value;
use sqlx::Row;

use crate::pooler::{on, query, Db};

use crate::DbError;

/// `lockgate.enqueue(job_type, args, options, notify)`: one job. With `notify` false the
/// statement sends no wake-up; the caller sends one with [`wake`] once it has committed.
pub async fn enqueue<'c>(
    db: impl Into<Db<'c>>,
    job_type: &str,
    args: &Value,
    options: &Value,
    notify: bool,
) -> Result<EnqueuedJob, DbError> {
    on(db.into(), async |conn| {
        let row = query("SELECT queue, msg_id, job_id, status FROM lockgate.enqueue($1, $2, $3, $4)")
            .bind(job_type)
            .bind(args)
            .bind(options)
            .bind(notify)
            .fetch_one(conn)
            .await?;
        Ok(to_job(&row))
    })
    .await
}

/// `lockgate.enqueue_many(job_type, args[], options, notify)`: many jobs of one type in one
/// statement, returned in the order of `args`; `notify` as for [`enqueue`].
pub async fn enqueue_many<'c>(
    db: impl Into<Db<'c>>,
    job_type: &str,
    args: &[Value],
    options: &Value,
    notify: bool,
) -> Result<Vec<EnqueuedJob>, DbError> {
    on(db.into(), async |conn| {
        let rows = query("SELECT queue, msg_id, job_id, status FROM lockgate.enqueue_many($1, $2, $3, $4)")
            .bind(job_type)
            .bind(args)
            .bind(options)
            .bind(notify)
            .fetch_all(conn)
            .await?;
        Ok(rows.iter().map(to_job).collect())
    })
    .await
}

/// `lockgate.wake` for each of `queues`, in one statement: wakes the workers idle on them after
/// an enqueue with `notify` false has committed, so that a woken worker finds the jobs. Outside a
/// transaction block, its transaction writes nothing but the commit record PostgreSQL gives a
/// notifying transaction, which its commit does not wait to flush.
pub async fn wake<'c>(db: impl Into<Db<'c>>, queues: &[String]) -> Result<(), DbError> {
    on(db.into(), async |conn| {
        query("SELECT lockgate.wake(q) FROM unnest($1::text[]) q").bind(queues).execute(conn).await?;
        Ok(())
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
