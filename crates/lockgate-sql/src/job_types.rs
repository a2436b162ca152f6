//! Job-type statements: define (upsert the stored policy) and load every policy.

use std::time::Duration;

use lockgate_core::{
    Backoff, ConcurrencyPolicy, JobPolicy, JobTypeName, OnConflict, QueueName, UniqueMode, UniqueOnConflict,
    UniquePolicy,
};
use sqlx::Row;

use crate::pooler::{on, query, query_scalar, Db};

use crate::DbError;

/// Stores (or replaces) a job type's policy, creating its queue if missing.
pub async fn define_job_type<'c>(db: impl Into<Db<'c>>, name: &JobTypeName, policy: &JobPolicy) -> Result<(), DbError> {
    on(db.into(), async |conn| define_query(name, policy).execute(conn).await.map(drop).map_err(DbError::from)).await
}

/// Stores (or replaces) the policies of several job types in one transaction, in name order: a
/// runtime's start, whose definitions then cost one commit instead of one each (a definition
/// that finds its type stored as given still locks the row, and so commits a write). Processes
/// defining the same types take the rows' locks in the same order, so they wait for each other
/// but do not deadlock. Their queues are created first, each in a statement of its own (a queue
/// that exists costs a read): the transaction then holds no queue's creation lock while it
/// waits for a row or for the table lock of a Client defining a type on first use
/// (`define_job_type_if_missing`), which could wait for that creation lock in turn.
pub async fn define_job_types(pool: &sqlx::PgPool, types: &[(JobTypeName, JobPolicy)]) -> Result<(), DbError> {
    let mut sorted: Vec<&(JobTypeName, JobPolicy)> = types.iter().collect();
    sorted.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    if let [(name, policy)] = sorted[..] {
        return define_job_type(pool, name, policy).await;
    }
    let queues: std::collections::BTreeSet<&str> = sorted.iter().map(|(_, p)| p.queue.as_str()).collect();
    for queue in queues {
        crate::queues::create_queue(pool, queue).await?;
    }
    let mut tx = pool.begin().await?;
    for (name, policy) in sorted {
        define_query(name, policy).execute(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Stores a job type's policy only if the type is missing (creating its queue if missing too),
/// and says whether it did: a type already stored keeps its policy. A stored type is found with
/// one read (which needs no more privilege than an enqueue); a missing one is looked up again
/// and defined with the table locked against other definitions, so a definition committed
/// meanwhile is seen, never overwritten.
pub async fn define_job_type_if_missing(
    pool: &sqlx::PgPool,
    name: &JobTypeName,
    policy: &JobPolicy,
) -> Result<bool, DbError> {
    if job_type_exists(pool, name).await? {
        return Ok(false);
    }
    let mut tx = pool.begin().await?;
    // Conflicts with itself and with the ROW EXCLUSIVE lock of any INSERT or UPDATE (so with
    // every define_job_type in progress that writes; one that finds the type stored as given
    // holds only a row share lock, and the type then exists), not with the reads of enqueues
    // and claims.
    query("LOCK TABLE lockgate.job_types IN SHARE ROW EXCLUSIVE MODE").execute(&mut *tx).await?;
    let exists = job_type_exists(&mut *tx, name).await?;
    if !exists {
        define_query(name, policy).execute(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(!exists)
}

/// Whether `lockgate.job_types` has a row for `name` (as `db` sees it).
pub async fn job_type_exists<'c>(db: impl Into<Db<'c>>, name: &JobTypeName) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        query_scalar("SELECT EXISTS (SELECT 1 FROM lockgate.job_types WHERE name = $1)")
            .bind(name.as_str())
            .fetch_one(conn)
            .await
            .map_err(DbError::from)
    })
    .await
}

/// Removes a job type's definition (`lockgate.remove_job_type`); false if there was none.
/// Refused, naming every use, while it has jobs in any queue, parked jobs, dead letters,
/// recurring tasks or unfinished batches calling it back.
pub async fn remove_job_type<'c>(db: impl Into<Db<'c>>, name: &str) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.remove_job_type($1)").bind(name).fetch_one(conn).await?)
    })
    .await
}

fn define_query<'q>(
    name: &'q JobTypeName,
    policy: &'q JobPolicy,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let concurrency = policy.concurrency.as_ref();
    let unique = policy.unique.as_ref();
    query("SELECT lockgate.define_job_type($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)")
        .bind(name.as_str())
        .bind(policy.queue.as_str())
        .bind(i32::from(policy.priority))
        .bind(i32::try_from(policy.max_attempts).unwrap_or(i32::MAX))
        .bind(millis(policy.backoff.base))
        .bind(millis(policy.backoff.max))
        .bind(policy.backoff.jitter)
        .bind(policy.timeout.map(millis))
        .bind(concurrency.map(|c| i32::try_from(c.limit).unwrap_or(i32::MAX)))
        .bind(concurrency.map(|c| c.key.clone()).filter(|k| !k.is_empty()))
        .bind(millis(concurrency.map_or(lockgate_core::DEFAULT_CONCURRENCY_DURATION, |c| c.duration)))
        .bind(concurrency.map_or(OnConflict::Block, |c| c.on_conflict).as_str())
        .bind(unique.map(|u| u.mode.as_str()))
        .bind(unique.map(|u| u.key.clone()).filter(|k| !k.is_empty()))
        .bind(unique.map_or(UniqueOnConflict::Reject, |u| u.on_conflict).as_str())
}

/// Every stored job type and its policy. Rows that no longer validate (edited by hand into
/// something this build cannot use) are skipped: their jobs are then dead-lettered as of an
/// unknown type, with the reason, rather than run under a guessed policy.
pub async fn load_job_types<'c>(db: impl Into<Db<'c>>) -> Result<Vec<(JobTypeName, JobPolicy)>, DbError> {
    on(db.into(), async |conn| {
        let rows = query(
            "SELECT name, queue, priority, max_attempts, backoff_base_ms, backoff_max_ms, backoff_jitter, timeout_ms,
                concurrency_limit, concurrency_key, concurrency_duration_ms, concurrency_on_conflict,
                unique_mode, unique_key, unique_on_conflict
           FROM lockgate.job_types ORDER BY name",
        )
        .fetch_all(conn)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let (Ok(name), Ok(queue)) =
                (JobTypeName::new(row.get::<String, _>(0)), QueueName::new(row.get::<String, _>(1)))
            else {
                continue;
            };
            let policy = JobPolicy {
                queue,
                priority: row.get(2),
                max_attempts: u32::try_from(row.get::<i32, _>(3)).unwrap_or(1),
                backoff: Backoff { base: from_millis(row.get(4)), max: from_millis(row.get(5)), jitter: row.get(6) },
                timeout: row.get::<Option<i64>, _>(7).map(from_millis),
                concurrency: concurrency_from(&row),
                unique: unique_from(&row),
            };
            out.push((name, policy));
        }
        Ok(out)
    })
    .await
}

fn concurrency_from(row: &sqlx::postgres::PgRow) -> Option<ConcurrencyPolicy> {
    let limit: i32 = row.get::<Option<i32>, _>(8)?;
    Some(ConcurrencyPolicy {
        limit: u32::try_from(limit).unwrap_or(1),
        key: row.get::<Option<Vec<String>>, _>(9).unwrap_or_default(),
        duration: from_millis(row.get(10)),
        on_conflict: OnConflict::parse(row.get(11)).unwrap_or_default(),
    })
}

fn unique_from(row: &sqlx::postgres::PgRow) -> Option<UniquePolicy> {
    let mode = UniqueMode::parse(&row.get::<Option<String>, _>(12)?).ok()?;
    Some(UniquePolicy {
        mode,
        key: row.get::<Option<Vec<String>>, _>(13).unwrap_or_default(),
        on_conflict: UniqueOnConflict::parse(row.get(14)).unwrap_or_default(),
    })
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn from_millis(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
