//! enqueue and bulk: one producer enqueues no-op jobs, one per transaction
//! (`Client::enqueue` against `pgmq.send`) or in calls of `batch` (`Client::enqueue_many` against
//! `pgmq.send_batch`). Targets: ≥ 0.8× the baseline. Timed on the client, from the first call to
//! the last call's return; each side gets a fresh pool, warmed before the clock starts.

use std::time::Instant;

use anyhow::Result;
use indicatif::ProgressBar;
use lockgate::{Client, EnqueueOptions};
use serde_json::{json, Value};
use sqlx::PgConnection;

use super::{order, Ctx, Outcome, Side};
use crate::bench_db::{close, BenchDb};
use crate::plan::{BulkArgs, EnqueueArgs};
use crate::probe::{cpu_seconds, FunctionStats};
use crate::queue::{self, Noop, RAW_QUEUE};
use crate::report::Row;
use crate::stats::Summary;

/// One measured enqueue run.
struct Enqueued {
    rate: f64,
    cpu_seconds: Option<f64>,
    functions: FunctionStats,
}

/// Per side, the rates of every round and the last round's costs.
#[derive(Default)]
struct Sides {
    lockgate: Vec<Enqueued>,
    baseline: Vec<Enqueued>,
}

pub async fn run_single(ctx: &Ctx, args: &EnqueueArgs) -> Result<Outcome> {
    let sides = rounds(ctx, "enqueue", args.jobs, 1).await?;
    let measure = format!("{} jobs, 1 per transaction", args.jobs);
    Ok(outcome(&sides, "enqueue", measure, "pgmq.send", &["lockgate.enqueue"], &["pgmq.send"], args.jobs))
}

pub async fn run_bulk(ctx: &Ctx, args: &BulkArgs) -> Result<Outcome> {
    let sides = rounds(ctx, "bulk", args.jobs, args.batch.max(1)).await?;
    let measure = format!("{} jobs in calls of {}", args.jobs, args.batch);
    Ok(outcome(&sides, "bulk", measure, "pgmq.send_batch", &["lockgate.enqueue_many"], &["pgmq.send_batch"], args.jobs))
}

async fn rounds(ctx: &Ctx, workload: &str, jobs: u64, batch: u64) -> Result<Sides> {
    let db = ctx.create_db(workload).await?;
    queue::setup(&db).await?;
    let mut sides = Sides::default();
    for round in 0..ctx.options.rounds {
        let label = ctx.label(workload, round);
        for side in order(round) {
            queue::reset(&db).await?;
            let run = measure(ctx, &db, side, jobs, batch, &label).await?;
            let who = if side == Side::Lockgate { "lockgate" } else { "baseline" };
            ctx.progress.note(format!("{label}: {who} {:.0} jobs/s", run.rate));
            match side {
                Side::Lockgate => sides.lockgate.push(run),
                Side::Baseline => sides.baseline.push(run),
            }
        }
    }
    db.close().await?;
    Ok(sides)
}

async fn measure(ctx: &Ctx, db: &BenchDb, side: Side, jobs: u64, batch: u64, label: &str) -> Result<Enqueued> {
    let pool = db.pool_warm(1, 1).await?;
    let before = FunctionStats::read(&db.pool).await?;
    let who = if side == Side::Lockgate { "lockgate" } else { "baseline" };
    let bar = ctx.progress.bar(jobs, format!("{label}: {who}"));
    let cpu0 = cpu_seconds();
    let started = Instant::now();
    match side {
        Side::Lockgate => lockgate_loop(&Client::new(pool.clone()), jobs, batch, &bar).await?,
        Side::Baseline => baseline_loop(&mut *pool.acquire().await?, jobs, batch, &bar).await?,
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu_seconds = cpu_seconds().zip(cpu0).map(|(b, a)| b - a);
    close(pool).await;
    bar.finish_and_clear();
    for session in db.wait_sessions_closed().await? {
        ctx.progress
            .warn(format!("session still open after its pool closed (its statistics may be missing): {session}"));
    }
    let functions = FunctionStats::read(&db.pool).await?.since(&before);
    Ok(Enqueued { rate: jobs as f64 / seconds, cpu_seconds, functions })
}

/// `Client::enqueue` per job, or `Client::enqueue_many` per `batch` jobs.
async fn lockgate_loop(client: &Client, jobs: u64, batch: u64, bar: &ProgressBar) -> Result<()> {
    let (options, noops) = (EnqueueOptions::default(), vec![Noop {}; batch as usize]);
    let mut left = jobs;
    while left > 0 {
        let n = left.min(batch) as usize;
        if batch == 1 {
            client.enqueue(&noops[0], &options).await?;
        } else {
            client.enqueue_many(&noops[..n], &options).await?;
        }
        left -= n as u64;
        bar.inc(n as u64);
    }
    Ok(())
}

/// `pgmq.send` per job, or `pgmq.send_batch` per `batch` jobs, on one held connection.
async fn baseline_loop(conn: &mut PgConnection, jobs: u64, batch: u64, bar: &ProgressBar) -> Result<()> {
    let raw: Vec<Value> = vec![json!({}); batch as usize];
    let mut left = jobs;
    while left > 0 {
        let n = left.min(batch) as usize;
        if batch == 1 {
            sqlx::query_scalar::<_, i64>("SELECT pgmq.send($1, $2)")
                .bind(RAW_QUEUE)
                .bind(&raw[0])
                .fetch_one(&mut *conn)
                .await?;
        } else {
            sqlx::query_scalar::<_, i64>("SELECT pgmq.send_batch($1, $2)")
                .bind(RAW_QUEUE)
                .bind(&raw[..n])
                .fetch_all(&mut *conn)
                .await?;
        }
        left -= n as u64;
        bar.inc(n as u64);
    }
    Ok(())
}

fn outcome(
    sides: &Sides,
    workload: &str,
    measure: String,
    baseline_name: &str,
    lockgate_functions: &[&str],
    baseline_functions: &[&str],
    jobs: u64,
) -> Outcome {
    let rates = |runs: &[Enqueued]| Summary::of(&runs.iter().map(|r| r.rate).collect::<Vec<_>>());
    let mut diagnostics = Vec::new();
    for (who, runs, names) in
        [("lockgate", &sides.lockgate, lockgate_functions), ("baseline", &sides.baseline, baseline_functions)]
    {
        let Some(last) = runs.last() else { continue };
        let lines = last.functions.describe(names, jobs as f64);
        diagnostics.extend(lines.into_iter().map(|l| format!("{who} (last round) {l}")));
        if let Some(cpu) = last.cpu_seconds {
            diagnostics.push(format!("{who} (last round) client CPU: {:.1} µs/job", cpu * 1e6 / jobs as f64));
        }
    }
    let rows = rates(&sides.lockgate)
        .map(|summary| {
            Row::new(workload, measure, "jobs/s", summary)
                .baseline(baseline_name, rates(&sides.baseline))
                .ratio_target(0.8)
        })
        .into_iter()
        .collect();
    Outcome { rows, diagnostics }
}
