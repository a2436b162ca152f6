//! enqueue and bulk: one producer enqueues no-op jobs, one per transaction
//! (`Client::enqueue` against `pgmq.send`) or in calls of `batch` (`Client::enqueue_many` against
//! `pgmq.send_batch`). Targets: ≥ 0.8× the baseline. Timed on the client, from the first call to
//! the last call's return; each producer gets a fresh pool, warmed before the clock starts.
//!
//! The single-enqueue workload also runs `Client::enqueue_in` on one held connection, as the
//! baseline holds its connection. `Client::enqueue` keeps a connection of its own between calls
//! (see `Client`), so the two should match: a gap is what the client adds per call.

use std::time::Instant;

use anyhow::{bail, Result};
use indicatif::ProgressBar;
use lockgate::{Client, EnqueueOptions};
use serde_json::{json, Value};
use sqlx::PgConnection;

use super::{Ctx, Outcome};
use crate::bench_db::{close, BenchDb};
use crate::plan::{BulkArgs, EnqueueArgs};
use crate::probe::{cpu_seconds, FunctionStats};
use crate::queue::{self, Noop, RAW_QUEUE};
use crate::report::Row;
use crate::stats::Summary;

/// Who enqueues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Producer {
    /// `Client::enqueue` / `Client::enqueue_many` on the client's pool: the target's subject.
    Client,
    /// `Client::enqueue_in` on one held connection (single enqueue only; a diagnostic).
    HeldConnection,
    /// `pgmq.send` / `pgmq.send_batch` on one held connection: the baseline.
    Raw,
}

impl Producer {
    fn name(self) -> &'static str {
        match self {
            Self::Client => "lockgate",
            Self::HeldConnection => "lockgate enqueue_in",
            Self::Raw => "baseline",
        }
    }
}

/// One measured enqueue run.
struct Enqueued {
    rate: f64,
    cpu_seconds: Option<f64>,
    functions: FunctionStats,
}

pub async fn run_single(ctx: &Ctx, args: &EnqueueArgs) -> Result<Outcome> {
    let producers = [Producer::Client, Producer::Raw, Producer::HeldConnection];
    let runs = rounds(ctx, "enqueue", args.jobs, 1, &producers).await?;
    let rate = |p: usize| Summary::of(&runs[p].iter().map(|r| r.rate).collect::<Vec<_>>());
    let (Some(client), Some(held)) = (rate(0), rate(2)) else { bail!("enqueue ran no rounds") };
    let measure = format!("{} jobs, 1 per transaction", args.jobs);
    let rows = vec![
        Row::new("enqueue", measure.clone(), "jobs/s", client).baseline("pgmq.send", rate(1)).ratio_target(0.8),
        Row::new("enqueue", format!("{measure}, enqueue_in on a held connection"), "jobs/s", held)
            .baseline("pgmq.send", rate(1)),
    ];
    let functions = [&["lockgate.enqueue"][..], &["pgmq.send"], &["lockgate.enqueue"]];
    Ok(Outcome { rows, diagnostics: diagnostics(&producers, &runs, &functions, args.jobs) })
}

pub async fn run_bulk(ctx: &Ctx, args: &BulkArgs) -> Result<Outcome> {
    let producers = [Producer::Client, Producer::Raw];
    let runs = rounds(ctx, "bulk", args.jobs, args.batch.max(1), &producers).await?;
    let rate = |p: usize| Summary::of(&runs[p].iter().map(|r| r.rate).collect::<Vec<_>>());
    let Some(client) = rate(0) else { bail!("bulk ran no rounds") };
    let measure = format!("{} jobs in calls of {}", args.jobs, args.batch);
    let rows = vec![Row::new("bulk", measure, "jobs/s", client).baseline("pgmq.send_batch", rate(1)).ratio_target(0.8)];
    let functions = [&["lockgate.enqueue_many"][..], &["pgmq.send_batch"]];
    Ok(Outcome { rows, diagnostics: diagnostics(&producers, &runs, &functions, args.jobs) })
}

/// Every round runs every producer, starting with a different one each round.
async fn rounds(
    ctx: &Ctx,
    workload: &str,
    jobs: u64,
    batch: u64,
    producers: &[Producer],
) -> Result<Vec<Vec<Enqueued>>> {
    let db = ctx.create_db(workload).await?;
    queue::setup(&db).await?;
    let mut runs: Vec<Vec<Enqueued>> = producers.iter().map(|_| Vec::new()).collect();
    for round in 0..ctx.options.rounds {
        let label = ctx.label(workload, round);
        for k in 0..producers.len() {
            let i = (round + k) % producers.len();
            queue::reset(&db).await?;
            let run = measure(ctx, &db, producers[i], jobs, batch, &label).await?;
            ctx.progress.note(format!("{label}: {} {:.0} jobs/s", producers[i].name(), run.rate));
            runs[i].push(run);
        }
    }
    db.close().await?;
    Ok(runs)
}

async fn measure(ctx: &Ctx, db: &BenchDb, producer: Producer, jobs: u64, batch: u64, label: &str) -> Result<Enqueued> {
    let pool = db.pool_warm(1, 1).await?;
    let before = FunctionStats::read(&db.pool).await?;
    let bar = ctx.progress.bar(jobs, format!("{label}: {}", producer.name()));
    let cpu0 = cpu_seconds();
    let started = Instant::now();
    match producer {
        Producer::Client => client_loop(&Client::new(pool.clone()), jobs, batch, &bar).await?,
        Producer::HeldConnection => held_loop(&mut *pool.acquire().await?, jobs, &bar).await?,
        Producer::Raw => raw_loop(&mut *pool.acquire().await?, jobs, batch, &bar).await?,
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu_seconds = cpu_seconds().zip(cpu0).map(|(b, a)| b - a);
    close(pool).await;
    bar.finish_and_clear();
    db.settle(&ctx.progress).await?;
    let functions = FunctionStats::read(&db.pool).await?.since(&before);
    Ok(Enqueued { rate: jobs as f64 / seconds, cpu_seconds, functions })
}

/// `Client::enqueue` per job, or `Client::enqueue_many` per `batch` jobs.
async fn client_loop(client: &Client, jobs: u64, batch: u64, bar: &ProgressBar) -> Result<()> {
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

/// `Client::enqueue_in` per job on one held connection.
async fn held_loop(conn: &mut PgConnection, jobs: u64, bar: &ProgressBar) -> Result<()> {
    let options = EnqueueOptions::default();
    for _ in 0..jobs {
        Client::enqueue_in(&mut *conn, &Noop {}, &options).await?;
        bar.inc(1);
    }
    Ok(())
}

/// `pgmq.send` per job, or `pgmq.send_batch` per `batch` jobs, on one held connection.
async fn raw_loop(conn: &mut PgConnection, jobs: u64, batch: u64, bar: &ProgressBar) -> Result<()> {
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

/// Per producer, its last round's function calls and server time, and its client CPU.
fn diagnostics(producers: &[Producer], runs: &[Vec<Enqueued>], functions: &[&[&str]], jobs: u64) -> Vec<String> {
    let mut lines = Vec::new();
    for ((producer, runs), names) in producers.iter().zip(runs).zip(functions) {
        let Some(last) = runs.last() else { continue };
        let who = producer.name();
        lines
            .extend(last.functions.describe(names, jobs as f64).into_iter().map(|l| format!("{who} (last round) {l}")));
        if let Some(cpu) = last.cpu_seconds {
            lines.push(format!("{who} (last round) client CPU: {:.1} µs/job", cpu * 1e6 / jobs as f64));
        }
    }
    lines
}
