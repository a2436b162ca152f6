//! Draining pre-enqueued jobs — the measurement behind the drain, depth, workers, memory, queues
//! and runtimes workloads — by lockgate's runtime or by the raw-PGMQ baseline consumers.
//!
//! A [`Layout`] says which queues are drained (`bench` alone, but for the queues workload's 50)
//! and how many runtimes share them (one, but for the runtimes workload's 4), each runtime with
//! its own pool of connections.
//!
//! Both sides are timed the same way, on the database's clock: from `clock_timestamp()` just
//! before the runtimes (or the consumers) start, to the `archived_at` of the `jobs`-th row
//! archived in the layout's archive tables (`pgmq.a_bench`; emptied before each drain).
//! lockgate is measured from runtime start, so its startup (schema check, job-type upsert,
//! LISTEN) is included; connections are opened beforehand on both sides. The harness polls the archive's row count at a short
//! interval only to know when to stop, to show progress and to sample memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use chrono::{DateTime, Utc};
use lockgate::{JobContext, JobError, PoolConfig, QueueName, Registry, Runtime, RuntimeConfig};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::bench_db::{close, BenchDb};
use crate::probe::{busy_percent, cpu_seconds, machine_cpu, rss_kib, FunctionStats};
use crate::progress::Progress;
use crate::queue::{Hot, Keyed, Noop, QUEUE};

/// Connections of the runtime's pool. The runtime uses a handful at once (one fetch loop and
/// one completer per worker pool, the heartbeat); more would sit idle.
const RUNTIME_CONNECTIONS: u32 = 8;
/// Messages per baseline `pgmq.read`, as the issue specifies.
const BASELINE_BATCH: i32 = 16;
/// The baseline's visibility timeout: lockgate's default.
const BASELINE_VT_SECONDS: i32 = 30;
/// A drain whose archive count does not move for this long has failed.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// One measured drain.
#[derive(Debug, Clone)]
pub struct Drained {
    pub jobs: u64,
    pub seconds: f64,
    /// From the start to the first job archived: the runtimes' start-up and first claim (or
    /// the consumers' first read and archive).
    pub first_seconds: f64,
    /// (jobs archived, this process's resident memory in KiB) at each poll of a lockgate drain.
    pub rss_samples: Vec<(u64, u64)>,
    /// This process's CPU time during the drain (the runtime's or the consumers' client side).
    pub cpu_seconds: Option<f64>,
    /// The machine's busy CPU share during the drain: well under 100% means the drain waits
    /// (on round trips and WAL flushes), not computes.
    pub machine_busy_percent: Option<f64>,
    pub functions: FunctionStats,
}

impl Drained {
    pub fn rate(&self) -> f64 {
        self.jobs as f64 / self.seconds
    }
}

/// What to drain: the first `jobs` completions, with `concurrency` jobs (or consumers) at once.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub jobs: u64,
    pub concurrency: usize,
    /// How often the archive count is polled.
    pub poll: Duration,
}

/// Where a drain runs: the queues (every runtime's one worker pool lists them all, in this
/// order; the baseline consumers go round them) and how many runtimes share them.
#[derive(Debug, Clone)]
pub struct Layout {
    pub queues: Vec<String>,
    pub runtimes: usize,
}

impl Layout {
    /// One runtime on `bench`: every drain but the queues and runtimes workloads.
    pub fn single() -> Self {
        Self { queues: vec![QUEUE.to_string()], runtimes: 1 }
    }

    /// The archived rows of every queue, counted.
    fn count_sql(&self) -> String {
        let counts: Vec<String> = self.queues.iter().map(|q| format!("(SELECT count(*) FROM pgmq.a_{q})")).collect();
        format!("SELECT ({})::bigint", counts.join(" + "))
    }

    /// The `archived_at` of the first row archived and of the ($1 + 1)-th, over every queue.
    fn archived_at_sql(&self) -> String {
        let all: Vec<String> = self.queues.iter().map(|q| format!("SELECT archived_at FROM pgmq.a_{q}")).collect();
        let all = all.join(" UNION ALL ");
        format!(
            "SELECT (SELECT min(archived_at) FROM ({all}) a),
                    (SELECT archived_at FROM ({all}) a ORDER BY archived_at OFFSET $1 LIMIT 1)"
        )
    }
}

/// lockgate's runtime with a no-op handler drains `spec.jobs` jobs of `bench`.
pub async fn lockgate(db: &BenchDb, spec: Spec, progress: &Progress, label: &str) -> Result<Drained> {
    lockgate_on(db, spec, &Layout::single(), progress, label).await
}

/// `layout.runtimes` runtimes, each with its own pool of connections and one worker pool of
/// `spec.concurrency` serving every queue of the layout, drain `spec.jobs` jobs. They start
/// together, after every pool's connections are open.
pub async fn lockgate_on(
    db: &BenchDb,
    spec: Spec,
    layout: &Layout,
    progress: &Progress,
    label: &str,
) -> Result<Drained> {
    let queues = layout.queues.iter().map(QueueName::new).collect::<Result<Vec<_>, _>>()?;
    let mut runtimes = Vec::new();
    for _ in 0..layout.runtimes.max(1) {
        let pool = db.pool_warm(RUNTIME_CONNECTIONS, 3).await?;
        let mut registry = Registry::new();
        registry.register::<Noop, _>(|_ctx: JobContext, _job: Noop| async { Ok::<(), JobError>(()) })?;
        registry.register::<Keyed, _>(|_ctx: JobContext, _job: Keyed| async { Ok::<(), JobError>(()) })?;
        registry.register::<Hot, _>(|_ctx: JobContext, _job: Hot| async { Ok::<(), JobError>(()) })?;
        let pools = vec![PoolConfig::new("bench", queues.clone(), spec.concurrency)];
        runtimes.push((pool.clone(), Runtime::new(pool, RuntimeConfig::default(), registry, pools)?));
    }
    let bar = progress.bar(spec.jobs, format!("{label}: lockgate"));
    let stop = CancellationToken::new();
    let start = Start::now(db).await?;
    let (cpu0, machine0) = (cpu_seconds(), machine_cpu());
    let mut pools = Vec::new();
    let mut handles = Vec::new();
    for (pool, runtime) in runtimes {
        pools.push(pool);
        handles.push(tokio::spawn(runtime.run(stop.clone())));
    }
    let watched = watch(db, spec, layout, &bar, || handles.iter().any(|h| h.is_finished())).await;
    let usage = Usage::since(cpu0, machine0);
    stop.cancel();
    let mut ran = Ok(());
    for handle in handles {
        let result = handle.await;
        if ran.is_ok() {
            ran = result.context("a runtime panicked").and_then(|r| r.context("a runtime failed"));
        }
    }
    for pool in pools {
        close(pool).await;
    }
    bar.finish_and_clear();
    let rss_samples = watched?;
    ran?;
    finish(db, spec, layout, start, rss_samples, usage, progress).await
}

/// `spec.concurrency` consumers, each on its own connection, loop `pgmq.read(bench, 30, 16)`
/// then `pgmq.archive(bench, ids)` until the queue is empty or `spec.jobs` are archived.
pub async fn baseline(db: &BenchDb, spec: Spec, progress: &Progress, label: &str) -> Result<Drained> {
    baseline_on(db, spec, &Layout::single(), progress, label).await
}

/// As [`baseline`], over every queue of the layout: each consumer goes round the queues (the
/// consumers start at evenly spread queues), one `read` + `archive` per queue per turn, and
/// leaves out a queue once a read found it empty. With one queue this is [`baseline`]'s loop.
/// `layout.runtimes` does not apply: the consumers are the baseline's processes.
pub async fn baseline_on(
    db: &BenchDb,
    spec: Spec,
    layout: &Layout,
    progress: &Progress,
    label: &str,
) -> Result<Drained> {
    let conns = u32::try_from(spec.concurrency).unwrap_or(u32::MAX);
    let pool = db.pool_warm(conns, conns).await?;
    let bar = progress.bar(spec.jobs, format!("{label}: baseline"));
    let archived = Arc::new(AtomicU64::new(0));
    let start = Start::now(db).await?;
    let (cpu0, machine0) = (cpu_seconds(), machine_cpu());
    let mut consumers = JoinSet::new();
    for c in 0..spec.concurrency {
        let (pool, archived, bar) = (pool.clone(), Arc::clone(&archived), bar.clone());
        let mut queues = layout.queues.clone();
        queues.rotate_left(c * layout.queues.len() / spec.concurrency.max(1));
        consumers.spawn(async move {
            let mut conn = pool.acquire().await?;
            let mut at = 0;
            while !queues.is_empty() && archived.load(Ordering::Relaxed) < spec.jobs {
                at %= queues.len();
                let queue = &queues[at];
                let batch: Vec<(i64, serde_json::Value)> =
                    sqlx::query_as("SELECT msg_id, message FROM pgmq.read($1, $2, $3)")
                        .bind(queue)
                        .bind(BASELINE_VT_SECONDS)
                        .bind(BASELINE_BATCH)
                        .fetch_all(&mut *conn)
                        .await?;
                if batch.is_empty() {
                    queues.remove(at);
                    continue;
                }
                let ids: Vec<i64> = batch.iter().map(|(id, _)| *id).collect();
                sqlx::query("SELECT pgmq.archive($1, $2)").bind(queue).bind(&ids).execute(&mut *conn).await?;
                archived.fetch_add(ids.len() as u64, Ordering::Relaxed);
                bar.inc(ids.len() as u64);
                at += 1;
            }
            Ok::<(), sqlx::Error>(())
        });
    }
    while let Some(joined) = consumers.join_next().await {
        joined.context("a baseline consumer panicked")??;
    }
    let usage = Usage::since(cpu0, machine0);
    close(pool).await;
    bar.finish_and_clear();
    finish(db, spec, layout, start, Vec::new(), usage, progress).await
}

/// Polls the archive until `spec.jobs` rows are in it; returns (archived, RSS KiB) samples.
async fn watch(
    db: &BenchDb,
    spec: Spec,
    layout: &Layout,
    bar: &indicatif::ProgressBar,
    stopped: impl Fn() -> bool,
) -> Result<Vec<(u64, u64)>> {
    let sql = layout.count_sql();
    let (mut last, mut moved_at) = (0, Instant::now());
    let mut rss = Vec::new();
    loop {
        let count: i64 = sqlx::query_scalar(&sql).fetch_one(&db.pool).await?;
        let count = u64::try_from(count).unwrap_or(0);
        bar.set_position(count.min(spec.jobs));
        if let Some(kib) = rss_kib() {
            rss.push((count, kib));
        }
        if count >= spec.jobs {
            return Ok(rss);
        }
        if count != last {
            (last, moved_at) = (count, Instant::now());
        } else if moved_at.elapsed() > STALL_TIMEOUT {
            bail!("no job archived for {STALL_TIMEOUT:?} ({count} of {} archived)", spec.jobs);
        }
        if stopped() {
            return Err(anyhow!("the runtime stopped before draining ({count} of {} archived)", spec.jobs));
        }
        tokio::time::sleep(spec.poll).await;
    }
}

/// Times the drain on the database's clock and collects what it cost.
async fn finish(
    db: &BenchDb,
    spec: Spec,
    layout: &Layout,
    start: Start,
    rss_samples: Vec<(u64, u64)>,
    usage: Usage,
    progress: &Progress,
) -> Result<Drained> {
    let (first, end): (Option<DateTime<Utc>>, Option<DateTime<Utc>>) = sqlx::query_as(&layout.archived_at_sql())
        .bind(i64::try_from(spec.jobs).unwrap_or(i64::MAX) - 1)
        .fetch_one(&db.pool)
        .await?;
    let (Some(first), Some(end)) = (first, end) else { bail!("fewer than {} jobs were archived", spec.jobs) };
    let micros = (end - start.at).num_microseconds().unwrap_or(0).max(1);
    let first_micros = (first - start.at).num_microseconds().unwrap_or(0).max(0);
    db.settle(progress).await?;
    let functions = FunctionStats::read(&db.pool).await?.since(&start.functions);
    Ok(Drained {
        jobs: spec.jobs,
        seconds: micros as f64 / 1e6,
        first_seconds: first_micros as f64 / 1e6,
        rss_samples,
        cpu_seconds: usage.process,
        machine_busy_percent: usage.machine,
        functions,
    })
}

/// CPU used while a drain ran: this process's seconds, the machine's busy percent.
struct Usage {
    process: Option<f64>,
    machine: Option<f64>,
}

impl Usage {
    fn since(process_before: Option<f64>, machine_before: Option<(u64, u64)>) -> Self {
        Self {
            process: cpu_seconds().zip(process_before).map(|(b, a)| b - a),
            machine: busy_percent(machine_before, machine_cpu()),
        }
    }
}

/// Where a drain starts: the database's clock, and the function statistics then.
struct Start {
    at: DateTime<Utc>,
    functions: FunctionStats,
}

impl Start {
    async fn now(db: &BenchDb) -> Result<Self> {
        let functions = FunctionStats::read(&db.pool).await?;
        let at = sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(&db.pool).await?;
        Ok(Self { at, functions })
    }
}
