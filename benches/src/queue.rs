//! The benchmark's jobs and queues: a typed no-op job on lockgate's queue `bench`, a plain PGMQ
//! queue `raw` for the baseline's enqueues, and the unmeasured steps around each measurement —
//! filling a queue through lockgate's public API, and resetting the tables between rounds.
//!
//! Drains use the same queue for both sides: the baseline consumers read the very messages
//! lockgate enqueued (they are PGMQ messages with lockgate's headers), so both drain identical
//! rows from an identical table.

use anyhow::Result;
use lockgate::{Client, ConcurrencyPolicy, EnqueueOptions, Job, JobPolicy, QueueName};
use serde::{Deserialize, Serialize};

use crate::bench_db::BenchDb;
use crate::progress::Progress;

/// lockgate's queue in every bench database.
pub const QUEUE: &str = "bench";
/// The baseline's own PGMQ queue for enqueue workloads (no lockgate index, no headers).
pub const RAW_QUEUE: &str = "raw";
/// Jobs per `enqueue_many` call when filling a queue (not measured).
const FILL_CHUNK: usize = 5_000;

/// A job that does nothing: the runtime's own overhead is all that is measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Noop {}

impl Job for Noop {
    const TYPE: &'static str = "bench_noop";

    fn policy() -> JobPolicy {
        JobPolicy::on_queue(QueueName::new(QUEUE).expect("\"bench\" is a valid queue name"))
    }
}

/// A no-op job limited to one running per key `k` (the limited-drain workload).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Keyed {
    pub k: u64,
}

impl Job for Keyed {
    const TYPE: &'static str = "bench_keyed";

    fn policy() -> JobPolicy {
        let mut policy = Noop::policy();
        policy.concurrency = Some(ConcurrencyPolicy { key: vec!["k".into()], ..ConcurrencyPolicy::new(1) });
        policy
    }
}

/// A no-op job whose whole type is one key limited to ten (the hot-key workload).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hot {}

impl Job for Hot {
    const TYPE: &'static str = "bench_hot";

    fn policy() -> JobPolicy {
        let mut policy = Noop::policy();
        policy.concurrency = Some(ConcurrencyPolicy::new(HOT_LIMIT));
        policy
    }
}

/// The hot key's limit, as the issue specifies.
pub const HOT_LIMIT: u32 = 10;

/// Enqueues `n` limited jobs spread round-robin over `keys` keys (or `n` hot-key jobs with
/// `keys` = 0); most of them park. Not measured.
pub async fn fill_limited(
    db: &BenchDb,
    client: &Client,
    n: u64,
    keys: u64,
    progress: &Progress,
    label: &str,
) -> Result<()> {
    let bar = progress.bar(n, format!("{label}: fill"));
    let mut next = 0;
    while next < n {
        let chunk = (n - next).min(FILL_CHUNK as u64);
        if keys == 0 {
            client.enqueue_many(&vec![Hot {}; chunk as usize]).await?;
        } else {
            let jobs: Vec<Keyed> = (next..next + chunk).map(|i| Keyed { k: i % keys }).collect();
            client.enqueue_many(&jobs).await?;
        }
        next += chunk;
        bar.inc(chunk);
    }
    bar.finish_and_clear();
    vacuum(db).await
}

/// Defines the job types (creating queue `bench`) and creates the baseline's queue `raw`.
pub async fn setup(db: &BenchDb) -> Result<Client> {
    let client = Client::new(db.pool.clone());
    client.define::<Noop>().await?;
    client.define::<Keyed>().await?;
    client.define::<Hot>().await?;
    sqlx::query("SELECT pgmq.create($1)").bind(RAW_QUEUE).execute(&db.pool).await?;
    Ok(client)
}

/// Enqueues `n` no-op jobs on `bench` with `enqueue_many`, then vacuums and analyzes the queue
/// table as autovacuum would (the test server runs with autovacuum off), so that every drain
/// starts from the same clean table with planner statistics.
pub async fn fill(db: &BenchDb, client: &Client, n: u64, progress: &Progress, label: &str) -> Result<()> {
    fill_in_calls(db, client, n, FILL_CHUNK, progress, label).await
}

/// [`fill`] in `enqueue_many` calls of `per_call` jobs.
pub async fn fill_in_calls(
    db: &BenchDb,
    client: &Client,
    n: u64,
    per_call: usize,
    progress: &Progress,
    label: &str,
) -> Result<()> {
    let bar = progress.bar(n, format!("{label}: fill"));
    let jobs = vec![Noop {}; per_call.max(1)];
    let mut left = n as usize;
    while left > 0 {
        let chunk = left.min(jobs.len());
        client.enqueue_many(&jobs[..chunk]).await?;
        left -= chunk;
        bar.inc(chunk as u64);
    }
    bar.finish_and_clear();
    vacuum(db).await
}

/// Sends `n` empty messages to the baseline's queue `raw` in `pgmq.send_batch` calls of
/// `per_call`, then vacuums and analyzes its table, as [`fill_in_calls`] does for `bench`.
pub async fn fill_raw(db: &BenchDb, n: u64, per_call: usize, progress: &Progress, label: &str) -> Result<()> {
    let bar = progress.bar(n, format!("{label}: fill"));
    let messages = vec![serde_json::json!({}); per_call.max(1)];
    let mut left = n as usize;
    while left > 0 {
        let chunk = left.min(messages.len());
        sqlx::query("SELECT pgmq.send_batch($1, $2)")
            .bind(RAW_QUEUE)
            .bind(&messages[..chunk])
            .execute(&db.pool)
            .await?;
        left -= chunk;
        bar.inc(chunk as u64);
    }
    bar.finish_and_clear();
    sqlx::raw_sql(&format!("VACUUM (ANALYZE) pgmq.q_{RAW_QUEUE}")).execute(&db.pool).await?;
    Ok(())
}

/// Ready jobs on `bench` (a full count: only between measurements).
pub async fn queued(db: &BenchDb) -> Result<i64> {
    Ok(sqlx::query_scalar(&format!("SELECT count(*) FROM pgmq.q_{QUEUE}")).fetch_one(&db.pool).await?)
}

/// Empties the archive of `bench` (drains count completions there).
pub async fn clear_archive(db: &BenchDb) -> Result<()> {
    sqlx::raw_sql(&format!("TRUNCATE pgmq.a_{QUEUE}")).execute(&db.pool).await?;
    Ok(())
}

/// Empties both queues, their archives, and the concurrency tables.
pub async fn reset(db: &BenchDb) -> Result<()> {
    sqlx::raw_sql(&format!(
        "TRUNCATE pgmq.q_{QUEUE}, pgmq.a_{QUEUE}, pgmq.q_{RAW_QUEUE}, pgmq.a_{RAW_QUEUE},
                  lockgate.parked, lockgate.leases, lockgate.semaphores"
    ))
    .execute(&db.pool)
    .await?;
    Ok(())
}

pub async fn vacuum(db: &BenchDb) -> Result<()> {
    sqlx::raw_sql(&format!("VACUUM (ANALYZE) pgmq.q_{QUEUE}")).execute(&db.pool).await?;
    Ok(())
}

/// The queues workload's queues, `bench_00`, `bench_01`, …, created with `lockgate.create_queue`
/// (PGMQ's pair of tables and lockgate's claim index, as for `bench`).
pub async fn create_queues(db: &BenchDb, n: usize) -> Result<Vec<String>> {
    let names: Vec<String> = (0..n).map(|i| format!("{QUEUE}_{i:02}")).collect();
    for name in &names {
        lockgate::sql::create_queue(&db.pool, name).await?;
    }
    Ok(names)
}

/// Empties `queues` and their archives, then enqueues `per_queue` no-op jobs on each with
/// `enqueue_many` (the job type's queue overridden per call), and vacuums and analyzes each
/// queue table, as [`fill`] does for `bench`. Not measured.
pub async fn fill_queues(
    db: &BenchDb,
    client: &Client,
    queues: &[String],
    per_queue: u64,
    progress: &Progress,
    label: &str,
) -> Result<()> {
    let tables: Vec<String> = queues.iter().flat_map(|q| [format!("pgmq.q_{q}"), format!("pgmq.a_{q}")]).collect();
    sqlx::raw_sql(&format!("TRUNCATE {}", tables.join(", "))).execute(&db.pool).await?;
    let bar = progress.bar(per_queue * queues.len() as u64, format!("{label}: fill"));
    for queue in queues {
        let options = EnqueueOptions { queue: Some(QueueName::new(queue.as_str())?), ..EnqueueOptions::default() };
        let mut left = per_queue as usize;
        while left > 0 {
            let chunk = left.min(FILL_CHUNK);
            client.enqueue_many_with(&vec![Noop {}; chunk], &options).await?;
            left -= chunk;
            bar.inc(chunk as u64);
        }
    }
    bar.finish_and_clear();
    let tables: Vec<String> = queues.iter().map(|q| format!("pgmq.q_{q}")).collect();
    sqlx::raw_sql(&format!("VACUUM (ANALYZE) {}", tables.join(", "))).execute(&db.pool).await?;
    Ok(())
}
