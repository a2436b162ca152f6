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

/// [`enqueue`] with `notify` false, then, in the same statement and transaction, the wake-up
/// when the job was enqueued, `runs_now` (the caller's reading of its options) and no other
/// transaction is notifying through `lockgate._notify_unless_busy` at this moment. Returns the
/// job and whether it was woken; when it was not, the caller sends [`wake`] after the commit.
/// Run it outside a transaction block: inside one, the lock that says "notifying" is held until
/// the caller commits, and every other client enqueue leaves its wake-up to after its commit.
pub async fn enqueue_and_wake<'c>(
    db: impl Into<Db<'c>>,
    job_type: &str,
    args: &Value,
    options: &Value,
    runs_now: bool,
) -> Result<(EnqueuedJob, bool), DbError> {
    on(db.into(), async |conn| {
        let row = query(
            "SELECT e.queue, e.msg_id, e.job_id, e.status,
                    CASE WHEN $4 AND e.status = 'enqueued' THEN lockgate._notify_unless_busy(e.queue) ELSE false END
               FROM lockgate.enqueue($1, $2, $3, false) e",
        )
        .bind(job_type)
        .bind(args)
        .bind(options)
        .bind(runs_now)
        .fetch_one(conn)
        .await?;
        Ok((to_job(&row), row.get(4)))
    })
    .await
}

/// [`enqueue_many`] with `notify` false and the wake-up of [`enqueue_and_wake`], sent at most
/// once, when any job was enqueued (they share one queue): `lockgate._enqueue_many_and_wake`,
/// which returns the jobs as one row of arrays.
pub async fn enqueue_many_and_wake<'c>(
    db: impl Into<Db<'c>>,
    job_type: &str,
    args: &[Value],
    options: &Value,
    runs_now: bool,
) -> Result<(Vec<EnqueuedJob>, bool), DbError> {
    on(db.into(), async |conn| {
        let row = query(
            "SELECT queue, msg_ids, job_ids, statuses, woken FROM lockgate._enqueue_many_and_wake($1, $2, $3, $4)",
        )
        .bind(job_type)
        .bind(args)
        .bind(options)
        .bind(runs_now)
        .fetch_one(conn)
        .await?;
        let queue: String = row.try_get(0)?;
        let job_ids: Option<Vec<i64>> = row.try_get(2)?;
        let statuses: Option<Vec<String>> = row.try_get(3)?;
        let jobs: Vec<EnqueuedJob> = match (job_ids, statuses) {
            (Some(job_ids), Some(statuses)) => {
                let msg_ids: Vec<Option<i64>> = row.try_get(1)?;
                if msg_ids.len() != job_ids.len() || msg_ids.len() != statuses.len() {
                    return Err(DbError::FunctionsOutdated);
                }
                msg_ids
                    .into_iter()
                    .zip(job_ids)
                    .zip(&statuses)
                    .map(|((msg_id, job_id), status)| EnqueuedJob {
                        queue: queue.clone(),
                        msg_id,
                        job_id: JobId(job_id),
                        status: to_status(status),
                    })
                    .collect()
            }
            // An unlimited type without uniqueness or batch: every job enqueued, its id its msg_id.
            (None, None) => {
                let msg_ids: Vec<i64> = row.try_get(1)?;
                msg_ids
                    .into_iter()
                    .map(|id| EnqueuedJob {
                        queue: queue.clone(),
                        msg_id: Some(id),
                        job_id: JobId(id),
                        status: EnqueueStatus::Enqueued,
                    })
                    .collect()
            }
            _ => return Err(DbError::FunctionsOutdated),
        };
        // One job per argument, or the function is not the one this build speaks to.
        if jobs.len() != args.len() {
            return Err(DbError::FunctionsOutdated);
        }
        Ok((jobs, row.try_get(4)?))
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
    EnqueuedJob { queue: row.get(0), msg_id: row.get(1), job_id: JobId(row.get(2)), status: to_status(row.get(3)) }
}

fn to_status(status: &str) -> EnqueueStatus {
    // The SQL functions return only these statuses.
    EnqueueStatus::parse(status).unwrap_or(EnqueueStatus::Enqueued)
}
