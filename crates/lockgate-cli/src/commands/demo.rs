//! `lockgate demo`: everything lockgate does, in half a minute, against the local database.
//! It migrates, defines four job types (one that always succeeds, one that fails twice then
//! succeeds, one that always fails, and a command job that reads its payload on stdin),
//! enqueues a few hundred jobs on the `demo` queue, runs them with a live progress bar, and
//! prints what ran, retried and was dead-lettered. The `demo` queue is emptied first, so runs
//! can be repeated.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use lockgate::{
    Client, EnqueueOptions, JobContext, JobError, JobPolicy, JobTypeName, PoolConfig, QueueName, RawHandler, Registry,
    Runtime, RuntimeConfig,
};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::db;
use crate::executors::command::CommandExecutor;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// How many jobs to enqueue.
    #[arg(long, default_value_t = 300)]
    jobs: usize,
}

const QUEUE: &str = "demo";

struct Handler(fn(&JobContext) -> Result<(), JobError>);

impl RawHandler for Handler {
    fn call(
        &self,
        ctx: JobContext,
        _args: Value,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(5 + ctx.msg_id.unsigned_abs() % 20)).await;
            (self.0)(&ctx)
        })
    }
}

fn policy(max_attempts: u32) -> Result<JobPolicy> {
    let mut policy = JobPolicy::on_queue(QueueName::new(QUEUE)?);
    policy.max_attempts = max_attempts;
    policy.backoff.base = Duration::from_millis(200);
    policy.backoff.max = Duration::from_secs(1);
    Ok(policy)
}

fn registry() -> Result<Registry> {
    let mut r = Registry::new();
    r.register_raw(JobTypeName::new("demo.greet")?, policy(3)?, Arc::new(Handler(|_| Ok(()))))?;
    let flaky = Handler(|ctx| match ctx.attempt {
        1 | 2 => Err(JobError::new(format!("transient failure on attempt {}", ctx.attempt))),
        _ => Ok(()),
    });
    r.register_raw(JobTypeName::new("demo.flaky")?, policy(5)?, Arc::new(flaky))?;
    let doomed = Handler(|_| Err(JobError::new("this job always fails")));
    r.register_raw(JobTypeName::new("demo.doomed")?, policy(3)?, Arc::new(doomed))?;
    // Reads the JSON payload on stdin and fails unless it mentions a name.
    let script =
        r#"payload=$(cat); case "$payload" in *name*) exit 0;; *) echo "no name in $payload" >&2; exit 1;; esac"#;
    let command = CommandExecutor::new(vec!["sh".into(), "-c".into(), script.into()]);
    r.register_raw(JobTypeName::new("demo.command")?, policy(3)?, Arc::new(command))?;
    Ok(r)
}

pub async fn run(target: &db::Target, args: Args) -> Result<()> {
    db::create_database_if_missing(target).await?;
    let pool = db::connect(target, 24).await?;
    lockgate::migrate(&pool).await?;
    println!("lockgate demo on {} — {} jobs on queue '{QUEUE}'", db::redact(&target.url()), args.jobs);
    let registry = registry()?;
    let client = Client::new(pool.clone());
    lockgate::sql::create_queue(&pool, QUEUE).await?;
    refuse_foreign_jobs(&pool).await?;
    sqlx::query("SELECT pgmq.purge_queue($1)").bind(QUEUE).execute(&pool).await?;
    sqlx::query("DELETE FROM pgmq.a_demo").execute(&pool).await?;
    lockgate::sql::dlq_purge(&pool, &lockgate::sql::DlqFilter { queue: Some(QUEUE.into()), job_ids: None }).await?;

    let runtime_config = RuntimeConfig { poll_interval: Duration::from_millis(200), ..RuntimeConfig::default() };
    let pools = vec![PoolConfig::new("demo", vec![QueueName::new(QUEUE)?], 16)];
    let runtime = Runtime::new(pool.clone(), runtime_config, registry.clone(), pools)?;
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let task = tokio::spawn(runtime.run(shutdown.clone()));
    enqueue_all(&client, &registry, args.jobs).await?;
    watch_progress(&pool, args.jobs as i64).await?;
    shutdown.cancel();
    task.await??;
    summarize(&pool, started.elapsed()).await
}

/// The demo empties its queue, its archive and its dead letters with PGMQ's own calls, which
/// know nothing of lockgate's permits, locks and batches: it refuses a queue that holds, or
/// serves, anything but its own job types (an application's queue named `demo`).
async fn refuse_foreign_jobs(pool: &sqlx::PgPool) -> Result<()> {
    let foreign: Vec<String> = sqlx::query_scalar(
        "SELECT COALESCE(t, '(no type)') FROM (SELECT name AS t FROM lockgate.job_types WHERE queue = 'demo'
                        UNION SELECT job_type FROM lockgate.parked WHERE queue = 'demo'
                        UNION SELECT job_type FROM lockgate.dead_letters WHERE queue = 'demo'
                        UNION SELECT COALESCE(headers->>'type', '(no type)') FROM pgmq.q_demo
                        UNION SELECT COALESCE(headers->>'type', '(no type)') FROM pgmq.a_demo) x
          WHERE t IS NULL OR t NOT LIKE 'demo.%' ORDER BY 1 LIMIT 5",
    )
    .fetch_all(pool)
    .await?;
    if !foreign.is_empty() {
        anyhow::bail!(
            "queue '{QUEUE}' holds or serves job types that are not the demo's ({}): the demo empties that queue, \
             its archive and its dead letters, so it refuses to run here; run it against another database \
             (--database-url)",
            foreign.join(", ")
        );
    }
    Ok(())
}

async fn enqueue_all(client: &Client, registry: &Registry, jobs: usize) -> Result<()> {
    for (name, policy) in registry.job_types() {
        client.define_job_type(name, policy).await?;
    }
    for i in 0..jobs {
        let (job_type, args) = match i % 20 {
            0 => ("demo.doomed", json!({ "n": i })),
            1 | 2 => ("demo.flaky", json!({ "n": i })),
            3 if i % 40 == 3 => ("demo.command", json!({ "n": i })),
            3 => ("demo.command", json!({ "name": format!("user{i}") })),
            _ => ("demo.greet", json!({ "name": format!("user{i}") })),
        };
        client.enqueue_raw(job_type, &args, &EnqueueOptions::default()).await?;
    }
    Ok(())
}

async fn watch_progress(pool: &lockgate::PgPool, total: i64) -> Result<()> {
    let bar = ProgressBar::new(total as u64);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} finished · {msg}")?);
    loop {
        let (archived, dead, retrying): (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM pgmq.a_demo), (SELECT count(*) FROM lockgate.dead_letters WHERE queue = 'demo'),
                    (SELECT count(*) FROM pgmq.q_demo WHERE headers ? 'errors')",
        )
        .fetch_one(pool)
        .await?;
        bar.set_position((archived + dead) as u64);
        bar.set_message(format!("{archived} succeeded, {dead} dead-lettered, {retrying} waiting to retry"));
        if archived + dead >= total {
            bar.finish();
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn summarize(pool: &lockgate::PgPool, elapsed: Duration) -> Result<()> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT headers->>'type', count(*), count(*) FILTER (WHERE headers ? 'errors') FROM pgmq.a_demo GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await?;
    println!("\n{:<14} {:>9} {:>22}", "JOB TYPE", "SUCCEEDED", "AFTER A RETRY");
    for (job_type, ok, retried) in &rows {
        println!("{job_type:<14} {ok:>9} {retried:>22}");
    }
    let dead: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT job_type, min(error), count(*) FROM lockgate.dead_letters WHERE queue = 'demo' GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await?;
    println!("\nDEAD-LETTERED (see `lockgate dlq list --queue demo`)");
    for (job_type, error, n) in &dead {
        println!("  {n:>4} × {job_type} (e.g. \"{error}\")");
    }
    let total: i64 = rows.iter().map(|r| r.1).sum::<i64>() + dead.iter().map(|d| d.2).sum::<i64>();
    println!("\n{total} jobs finished in {:.1}s", elapsed.as_secs_f64());
    Ok(())
}
