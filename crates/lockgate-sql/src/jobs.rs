//! Jobs in every state: one by id (`lockgate.job`), a search (`lockgate.jobs`), and cancel
//! (`lockgate.cancel`, `lockgate.cancel_jobs`).

use crate::columns::{readable_time, shown_json};
use chrono::{DateTime, Utc};
use lockgate_core::JobId;
use serde::Serialize;
use serde_json::Value;
use sqlx::Row;

use crate::pooler::{on, query, query_as, query_scalar, transaction_pooling, Db};

use crate::DbError;

/// A job as `lockgate.job` finds it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobRecord {
    pub id: JobId,
    /// `scheduled`, `queued`, `running`, `retrying`, `parked`, `succeeded`, `discarded`,
    /// `cancelled` or `dead` (see [`JOB_STATES`]).
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
    /// Every attempt known: `{"attempt", "started_at", "ended_at", "process", "outcome", "error"}`,
    /// outcome `failed`, `cancelled`, `succeeded` or `running`. Failed and cancelled attempts are
    /// recorded when they end; a succeeded or running one is read from the job's message.
    pub attempts: Value,
    /// For a dead job: why (`attempts_exhausted`, `undecodable`, `unknown_job_type`, `cancelled`)
    /// and the last error.
    pub reason: Option<String>,
    pub error: Option<String>,
    pub headers: Option<Value>,
}

/// Every state [`JobRecord::state`] can take, as `lockgate.job_states()` lists them.
pub const JOB_STATES: &[&str] =
    &["scheduled", "queued", "running", "retrying", "parked", "succeeded", "discarded", "cancelled", "dead"];

static JOB_COLUMNS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "id, state, queue, job_type, args, priority, msg_id, attempt, {}, {}, {}, concurrency_key, attempts, reason, \
         error, headers",
        readable_time("enqueued_at"),
        readable_time("visible_at"),
        readable_time("finished_at")
    )
});

/// Which jobs a search (or a cancel by query) selects; `None` (or empty) matches anything.
#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    pub queue: Option<String>,
    pub job_type: Option<String>,
    /// Any of these states ([`JOB_STATES`]).
    pub states: Vec<String>,
    /// A concurrency or unique key.
    pub key: Option<String>,
    /// First enqueued at or after.
    pub since: Option<DateTime<Utc>>,
    /// First enqueued before.
    pub until: Option<DateTime<Utc>>,
    /// Text in the arguments or in an attempt's error, case-insensitive.
    pub search: Option<String>,
}

/// Binds a filter as $1 to $7 (queue, type, states, key, since, until, search), the leading
/// parameters of `lockgate.jobs` and `lockgate.cancel_jobs`.
fn bind_filter<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    filter: &'q JobFilter,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    query
        .bind(&filter.queue)
        .bind(&filter.job_type)
        .bind((!filter.states.is_empty()).then_some(&filter.states))
        .bind(&filter.key)
        .bind(filter.since)
        .bind(filter.until)
        .bind(&filter.search)
}

/// What `lockgate.cancel` did with one job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cancelled {
    pub id: JobId,
    /// The job's state when the cancel found it.
    pub state: String,
    pub queue: String,
    /// False when the job had finished already (succeeded, discarded, cancelled, dead).
    pub cancelled: bool,
}

fn job_record(r: &sqlx::postgres::PgRow) -> JobRecord {
    JobRecord {
        id: JobId(r.get(0)),
        state: r.get(1),
        queue: r.get(2),
        job_type: r.get(3),
        args: shown_json(r, 4),
        priority: r.get(5),
        msg_id: r.get(6),
        attempt: r.get(7),
        enqueued_at: r.get(8),
        visible_at: r.get(9),
        finished_at: r.get(10),
        concurrency_key: r.get(11),
        attempts: shown_json(r, 12).unwrap_or(Value::Array(Vec::new())),
        reason: r.get(13),
        error: r.get(14),
        headers: shown_json(r, 15),
    }
}

fn cancelled(r: &sqlx::postgres::PgRow) -> Cancelled {
    Cancelled { id: JobId(r.get(0)), state: r.get(1), queue: r.get(2), cancelled: r.get(3) }
}

/// `lockgate.job(id)`: the job, or `None` when no job has that id (or it was pruned from the
/// archive by retention).
pub async fn job<'c>(db: impl Into<Db<'c>>, id: JobId) -> Result<Option<JobRecord>, DbError> {
    on(db.into(), async |conn| {
        let sql = format!("SELECT {} FROM lockgate.job($1)", *JOB_COLUMNS);
        let row = query(&sql).bind(id.0).fetch_optional(conn).await?;
        Ok(row.as_ref().map(job_record))
    })
    .await
}

/// `lockgate.jobs(...)`: jobs matching `filter`, newest id first, at most `limit` (1 to 1000),
/// with ids below `before` (the last id of the previous page) when given. An unknown queue is
/// `DbError::UnknownQueue`; an invalid state, limit or time range `DbError::InvalidArgument`.
pub async fn jobs<'c>(
    db: impl Into<Db<'c>>,
    filter: &JobFilter,
    limit: i32,
    before: Option<JobId>,
) -> Result<Vec<JobRecord>, DbError> {
    on(db.into(), async |conn| {
        let sql = format!(
            "SELECT {} FROM lockgate.jobs(queue => $1, job_type => $2, states => $3, key => $4, since => $5,
                                          until => $6, search => $7, max_rows => $8, before_id => $9)",
            *JOB_COLUMNS
        );
        let rows = bind_filter(query(&sql), filter).bind(limit).bind(before.map(|b| b.0)).fetch_all(conn).await?;
        Ok(rows.iter().map(job_record).collect())
    })
    .await
}

/// `lockgate.cancel(id)`: cancels one job in whatever state it is; `None` when no job has that id.
pub async fn cancel<'c>(db: impl Into<Db<'c>>, id: JobId) -> Result<Option<Cancelled>, DbError> {
    on(db.into(), async |conn| {
        let row = query("SELECT id, state, queue, cancelled FROM lockgate.cancel($1)")
            .bind(id.0)
            .fetch_optional(conn)
            .await?;
        Ok(row.as_ref().map(cancelled))
    })
    .await
}

/// How many jobs a cancel by query found and cancelled (`lockgate.cancel_jobs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CancelledCount {
    /// Jobs the filter selected that could still be cancelled.
    pub matched: i32,
    /// Of those, the ones cancelled (the others finished in between).
    pub cancelled: i32,
}

/// `CALL lockgate.cancel_jobs(...)`: cancels up to `limit` jobs matching `filter` that can still
/// be cancelled, newest first, each in a transaction of its own (so it cannot run inside the
/// caller's transaction: give it a pool or a connection outside one).
pub async fn cancel_jobs<'c>(db: impl Into<Db<'c>>, filter: &JobFilter, limit: i32) -> Result<CancelledCount, DbError> {
    if transaction_pooling() {
        return cancel_jobs_one_by_one(db.into(), filter, limit).await;
    }
    on(db.into(), async |conn| {
        let row = bind_filter(
            query(
                "CALL lockgate.cancel_jobs(queue => $1, job_type => $2, states => $3, key => $4, since => $5,
                                       until => $6, search => $7, max_rows => $8)",
            ),
            filter,
        )
        .bind(limit)
        .fetch_one(conn)
        .await?;
        Ok(CancelledCount { matched: row.get(0), cancelled: row.get(1) })
    })
    .await
}

/// `cancel_jobs` under transaction pooling, where every statement runs in a transaction and so
/// a procedure cannot commit: the procedure's selection, then one `lockgate.cancel` per job, each
/// in a transaction of its own.
async fn cancel_jobs_one_by_one(mut db: Db<'_>, filter: &JobFilter, limit: i32) -> Result<CancelledCount, DbError> {
    // As lockgate.cancel_jobs: the states that can still be cancelled, narrowed by the filter's.
    const CANCELLABLE: [&str; 5] = ["queued", "scheduled", "retrying", "running", "parked"];
    let ids = on(db.reborrow(), async |conn| {
        query("SELECT lockgate._check_states($1)")
            .bind((!filter.states.is_empty()).then_some(&filter.states))
            .execute(&mut *conn)
            .await?;
        let states: Vec<String> = CANCELLABLE
            .iter()
            .filter(|s| filter.states.is_empty() || filter.states.iter().any(|f| f == *s))
            .map(|s| s.to_string())
            .collect();
        let narrowed = JobFilter { states, ..filter.clone() };
        let ids: Vec<i64> = bind_filter(
            query(
                "SELECT j.id FROM lockgate.jobs(queue => $1, job_type => $2, states => $3, key => $4, since => $5,
                                             until => $6, search => $7, max_rows => $8) j",
            ),
            &narrowed,
        )
        .bind(limit)
        .fetch_all(conn)
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
        Ok(ids)
    })
    .await?;
    let mut cancelled = 0;
    for id in &ids {
        if cancel(db.reborrow(), JobId(*id)).await?.is_some_and(|c| c.cancelled) {
            cancelled += 1;
        }
    }
    Ok(CancelledCount { matched: i32::try_from(ids.len()).unwrap_or(i32::MAX), cancelled })
}

/// `lockgate.release_cancelled`: gives back the permit (and `while_executing` lock) of the
/// delivery `(msg_id, read_ct)` that was running when its job was cancelled, once its handler has
/// stopped. True when it released something; any other delivery, or a second call, releases
/// nothing.
pub async fn release_cancelled<'c>(
    db: impl Into<Db<'c>>,
    queue: &str,
    msg_id: i64,
    read_ct: i32,
) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.release_cancelled($1, $2, $3)")
            .bind(queue)
            .bind(msg_id)
            .bind(read_ct)
            .fetch_one(conn)
            .await?)
    })
    .await
}

/// Returns a delivery its worker never started (`lockgate.return_unstarted`): visible at once,
/// keeping its permit, counted neither as an attempt nor as a shutdown return. True when returned.
pub async fn return_unstarted<'c>(
    db: impl Into<Db<'c>>,
    queue: &str,
    msg_id: i64,
    read_ct: i32,
) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.return_unstarted($1, $2, $3)")
            .bind(queue)
            .bind(msg_id)
            .bind(read_ct)
            .fetch_one(conn)
            .await?)
    })
    .await
}

/// Which of the deliveries `(msg_id, read_ct)` of `queue`, no longer there, were cancelled while
/// they held their job (archived by `lockgate.cancel` with that read_ct): the heartbeat asks about
/// the deliveries it lost, to tell a cancel from a lapsed lease.
pub async fn cancelled_messages<'c>(
    db: impl Into<Db<'c>>,
    queue: &str,
    lost: &[(i64, i32)],
) -> Result<Vec<i64>, DbError> {
    on(db.into(), async |conn| {
        let (ids, cts): (Vec<i64>, Vec<i32>) = lost.iter().copied().unzip();
        Ok(query_scalar("SELECT lockgate.cancelled_messages($1, $2, $3)")
            .bind(queue)
            .bind(ids)
            .bind(cts)
            .fetch_all(conn)
            .await?)
    })
    .await
}

/// `lockgate.extend_cancelled`: renews the permit lease and while_executing lock that cancelled
/// running deliveries `(msg_id, read_ct)` of `queue` kept for their handlers, which have not
/// ended yet. Returns the deliveries that still hold something, each with whether it was skipped
/// (busy: another statement held its rows); the others hold nothing any more.
pub async fn extend_cancelled<'c>(
    db: impl Into<Db<'c>>,
    queue: &str,
    held: &[(i64, i32)],
    visibility: std::time::Duration,
) -> Result<Vec<(i64, bool)>, DbError> {
    on(db.into(), async |conn| {
        let (ids, cts): (Vec<i64>, Vec<i32>) = held.iter().copied().unzip();
        Ok(query_as("SELECT msg_id, busy FROM lockgate.extend_cancelled($1, $2, $3, $4)")
            .bind(queue)
            .bind(ids)
            .bind(cts)
            .bind(visibility.as_secs_f64())
            .fetch_all(conn)
            .await?)
    })
    .await
}

/// `lockgate.discard_job(id)`: deletes a dead or parked job for good. `None` for an unknown id;
/// otherwise the state the job was in and whether it was discarded (only dead and parked jobs are).
pub async fn discard_job<'c>(db: impl Into<Db<'c>>, id: JobId) -> Result<Option<(String, bool)>, DbError> {
    on(db.into(), async |conn| {
        let row: (Option<String>, bool) =
            query_as("SELECT state, discarded FROM lockgate.discard_job($1)").bind(id.0).fetch_one(conn).await?;
        Ok(row.0.map(|state| (state, row.1)))
    })
    .await
}
