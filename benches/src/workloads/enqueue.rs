//! enqueue and bulk: producers enqueue no-op jobs, one per transaction (`Client::enqueue` against
//! `pgmq.send`) or in calls of each batch size, 100 and 1,000 (`Client::enqueue_many` against
//! `pgmq.send_batch`). Targets: single enqueue ≥ 0.8× the baseline (issue 5), bulk ≥ 0.9× at
//! each size (issue 14). Each round interleaves the producers in short turns (20 single
//! enqueues, or one call of a batch, then the next producer; who goes first rotates) and times
//! every call on the client; a producer's rate is its jobs over the sum of its calls' times. A burst from the machine's other tenants then falls on every producer alike, where
//! back-to-back one-second runs let it fall on one of them. Each producer has its own pool, warmed
//! before the first call.
//!
//! The single-enqueue workload also runs `Client::enqueue_in` on one held connection, as the
//! baseline holds its connection. `Client::enqueue` keeps a connection of its own between calls
//! (see `Client`), so the two should match: a gap is what the client adds per call.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use lockgate::{Client, EnqueueOptions};
use serde_json::{json, Value};
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

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
    let mut runs = rounds(ctx, "enqueue", args.jobs, &[1], &producers).await?;
    let runs = runs.pop().unwrap_or_default();
    let rate = |p: usize| Summary::of(&runs[p].iter().map(|r| r.rate).collect::<Vec<_>>());
    let (Some(client), Some(held)) = (rate(0), rate(2)) else { bail!("enqueue ran no rounds") };
    let measure = format!("{} jobs, 1 per transaction", args.jobs);
    let rows = vec![
        Row::new("enqueue", measure.clone(), "jobs/s", client).baseline("pgmq.send", rate(1)).ratio_target(0.8),
        Row::new("enqueue", format!("{measure}, enqueue_in on a held connection"), "jobs/s", held)
            .baseline("pgmq.send", rate(1)),
    ];
    // Both lockgate producers call lockgate.enqueue in the same round: its figures cover both.
    let functions = [(&["lockgate.enqueue"][..], 2 * args.jobs), (&["pgmq.send"], args.jobs), (&[], args.jobs)];
    Ok(Outcome { rows, diagnostics: diagnostics("", &producers, &runs, &functions, args.jobs) })
}

/// bulk: a row per batch size. Target (issue 14): ≥ 0.9× `pgmq.send_batch` at each size.
pub async fn run_bulk(ctx: &Ctx, args: &BulkArgs) -> Result<Outcome> {
    let mut batches: Vec<u64> = args.batches.iter().map(|&b| b.max(1)).collect();
    batches.sort_unstable();
    batches.dedup();
    let producers = [Producer::Client, Producer::Raw];
    let runs = rounds(ctx, "bulk", args.jobs, &batches, &producers).await?;
    let mut outcome = Outcome::default();
    for (batch, runs) in batches.iter().zip(&runs) {
        let rate = |p: usize| Summary::of(&runs[p].iter().map(|r| r.rate).collect::<Vec<_>>());
        let Some(client) = rate(0) else { bail!("bulk ran no rounds") };
        let measure = format!("{} jobs in calls of {batch}", args.jobs);
        outcome
            .rows
            .push(Row::new("bulk", measure, "jobs/s", client).baseline("pgmq.send_batch", rate(1)).ratio_target(0.9));
        let functions = [(&["lockgate._enqueue_many_and_wake"][..], args.jobs), (&["pgmq.send_batch"], args.jobs)];
        let prefix = format!("calls of {batch}: ");
        outcome.diagnostics.extend(diagnostics(&prefix, &producers, runs, &functions, args.jobs));
    }
    Ok(outcome)
}

/// Every round runs every producer at each batch size (sizes one after the other), interleaved
/// in turns, on freshly emptied queues. Indexed by batch size, then producer, then round.
async fn rounds(
    ctx: &Ctx,
    workload: &str,
    jobs: u64,
    batches: &[u64],
    producers: &[Producer],
) -> Result<Vec<Vec<Vec<Enqueued>>>> {
    let db = ctx.create_db(workload).await?;
    queue::setup(&db).await?;
    let mut runs: Vec<Vec<Vec<Enqueued>>> =
        batches.iter().map(|_| producers.iter().map(|_| Vec::new()).collect()).collect();
    for round in 0..ctx.options.rounds {
        for (b, &batch) in batches.iter().enumerate() {
            let label = match batches.len() {
                1 => ctx.label(workload, round),
                _ => format!("{} ×{batch}", ctx.label(workload, round)),
            };
            queue::reset(&db).await?;
            for (i, run) in interleaved(ctx, &db, producers, jobs, batch, &label).await?.into_iter().enumerate() {
                ctx.progress.note(format!("{label}: {} {:.0} jobs/s", producers[i].name(), run.rate));
                runs[b][i].push(run);
            }
        }
    }
    db.close().await?;
    Ok(runs)
}

/// What a producer enqueues through.
enum Handle {
    /// `Client::enqueue` / `enqueue_many` (the client keeps a connection of its own).
    Client(Client),
    /// `Client::enqueue_in` on a held connection.
    Held(Client, PoolConnection<Postgres>),
    /// `pgmq.send` / `send_batch` on a held connection.
    Raw(PoolConnection<Postgres>),
}

/// One producer's pool, handle and running totals within a round.
struct Lane {
    pool: PgPool,
    handle: Handle,
    elapsed: Duration,
    cpu_seconds: Option<f64>,
}

impl Lane {
    async fn open(db: &BenchDb, producer: Producer) -> Result<Self> {
        let pool = db.pool_warm(1, 1).await?;
        let handle = match producer {
            Producer::Client => Handle::Client(Client::new(pool.clone())),
            Producer::HeldConnection => Handle::Held(Client::new(pool.clone()), pool.acquire().await?),
            Producer::Raw => Handle::Raw(pool.acquire().await?),
        };
        Ok(Self { pool, handle, elapsed: Duration::ZERO, cpu_seconds: Some(0.0) })
    }

    /// One call of `n` jobs (one job when `batch` is 1). Times it, and adds the process's CPU
    /// time meanwhile.
    async fn call(&mut self, n: usize, batch: u64, noops: &[Noop], raw: &[Value]) -> Result<()> {
        let options = EnqueueOptions::default();
        let cpu0 = cpu_seconds();
        let started = Instant::now();
        match &mut self.handle {
            Handle::Client(client) if batch == 1 => drop(client.enqueue_with(&noops[0], &options).await?),
            Handle::Client(client) => drop(client.enqueue_many_with(&noops[..n], &options).await?),
            Handle::Held(client, conn) => drop(client.enqueue_in_with(conn, &noops[0], &options).await?),
            Handle::Raw(conn) if batch == 1 => raw_send(conn, &raw[0]).await?,
            Handle::Raw(conn) => raw_send_batch(conn, &raw[..n]).await?,
        }
        self.elapsed += started.elapsed();
        self.cpu_seconds = match (self.cpu_seconds, cpu0, cpu_seconds()) {
            (Some(total), Some(a), Some(b)) => Some(total + b - a),
            _ => None,
        };
        Ok(())
    }
}

/// Calls a producer makes in a row before the next producer's turn: 20 single enqueues, or one
/// call of a batch, some 5–10 ms of work here. Short, so that drift on the machine falls on every
/// producer alike (the per-round ratios of single enqueue now agree within ±0.01, where one-second
/// runs back to back disagreed by ±0.05); more than one single enqueue, so that the call which
/// wakes a backend that sat idle through the other producers' turns is one call in twenty.
fn calls_per_turn(batch: u64) -> u64 {
    (20 / batch.max(1)).max(1)
}

/// One round: `jobs` jobs from every producer, taking turns of `calls_per_turn` calls.
async fn interleaved(
    ctx: &Ctx,
    db: &BenchDb,
    producers: &[Producer],
    jobs: u64,
    batch: u64,
    label: &str,
) -> Result<Vec<Enqueued>> {
    let mut lanes = Vec::new();
    for &producer in producers {
        lanes.push(Lane::open(db, producer).await?);
    }
    let (noops, raw) = (vec![Noop {}; batch as usize], vec![json!({}); batch as usize]);
    let before = FunctionStats::read(&db.pool).await?;
    let bar = ctx.progress.bar(jobs * producers.len() as u64, format!("{label}: interleaved"));
    let (mut left, mut turn) = (jobs, 0);
    while left > 0 {
        let turn_jobs = left.min(batch * calls_per_turn(batch));
        for k in 0..lanes.len() {
            let at = (turn + k) % lanes.len();
            let lane = &mut lanes[at];
            let mut lane_left = turn_jobs;
            while lane_left > 0 {
                let n = lane_left.min(batch);
                lane.call(n as usize, batch, &noops, &raw).await?;
                lane_left -= n;
            }
        }
        left -= turn_jobs;
        turn += 1;
        bar.inc(turn_jobs * lanes.len() as u64);
    }
    bar.finish_and_clear();
    let mut runs = Vec::new();
    for lane in lanes {
        drop(lane.handle);
        close(lane.pool).await;
        runs.push((lane.elapsed, lane.cpu_seconds));
    }
    db.settle(&ctx.progress).await?;
    let functions = FunctionStats::read(&db.pool).await?.since(&before);
    Ok(runs
        .into_iter()
        .map(|(elapsed, cpu_seconds)| Enqueued {
            rate: jobs as f64 / elapsed.as_secs_f64(),
            cpu_seconds,
            functions: functions.clone(),
        })
        .collect())
}

async fn raw_send(conn: &mut PgConnection, args: &Value) -> Result<()> {
    sqlx::query_scalar::<_, i64>("SELECT pgmq.send($1, $2)").bind(RAW_QUEUE).bind(args).fetch_one(conn).await?;
    Ok(())
}

async fn raw_send_batch(conn: &mut PgConnection, args: &[Value]) -> Result<()> {
    sqlx::query_scalar::<_, i64>("SELECT pgmq.send_batch($1, $2)").bind(RAW_QUEUE).bind(args).fetch_all(conn).await?;
    Ok(())
}

/// Per producer, its last round's client CPU, and the server time of the functions it calls
/// (with the jobs those calls carried, which for a function two producers call is both's).
fn diagnostics(
    prefix: &str,
    producers: &[Producer],
    runs: &[Vec<Enqueued>],
    functions: &[(&[&str], u64)],
    jobs: u64,
) -> Vec<String> {
    let mut lines = Vec::new();
    for ((producer, runs), (names, calls_jobs)) in producers.iter().zip(runs).zip(functions) {
        let Some(last) = runs.last() else { continue };
        let who = format!("{prefix}{}", producer.name());
        lines.extend(
            last.functions.describe(names, *calls_jobs as f64).into_iter().map(|l| format!("{who} (last round) {l}")),
        );
        if let Some(cpu) = last.cpu_seconds {
            lines.push(format!("{who} (last round) client CPU: {:.1} µs/job", cpu * 1e6 / jobs as f64));
        }
    }
    lines
}
