//! producers: `producers` (16) producers at once, each on its own connection and each enqueueing
//! one job per transaction, `jobs / producers` jobs apiece: `Client::enqueue` (one `Client` per
//! producer, on a pool of its own: the client keeps one connection for its enqueues) against
//! `pgmq.send` on a held connection. The sides run one after the other, in an order that
//! alternates from round to round. A side's rate is its jobs over the wall time from the moment
//! every producer is released (connections open, job type known) to the last producer's last
//! commit. Target (issue 14): ≥ 0.8× the baseline.
//!
//! Every `lockgate.enqueue` notifies the queue's channel; PostgreSQL serialises notifying
//! commits on one lock, so this is where that shows. The diagnostics give the server time per
//! call (`pg_stat_user_functions`, which does not include the commit), the call times the
//! producers saw, p50 and p99, and what their sessions waited on (`pg_stat_activity`, sampled
//! every 20 ms while they ran).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lockgate::Client;
use serde_json::json;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::sync::Barrier;

use super::{order, Ctx, Outcome, Side, POLL};
use crate::bench_db::{close, BenchDb};
use crate::plan::ProducersArgs;
use crate::probe::{busy_percent, cpu_seconds, machine_cpu, FunctionStats, WaitProfile, WaitSampler};
use crate::queue::{self, Noop, RAW_QUEUE};
use crate::report::Row;
use crate::stats::{percentile, Summary};

/// One side's round.
struct Run {
    rate: f64,
    cpu_seconds: Option<f64>,
    machine_busy_percent: Option<f64>,
    functions: FunctionStats,
    /// Every call's duration (ms), sorted.
    calls_ms: Vec<f64>,
    /// What the producers' sessions waited on while they ran.
    waits: WaitProfile,
}

/// What one producer enqueues through.
enum Handle {
    Client(Client),
    Raw(PoolConnection<Postgres>),
}

pub async fn run(ctx: &Ctx, args: &ProducersArgs) -> Result<Outcome> {
    if args.producers == 0 || args.jobs < args.producers as u64 {
        bail!("producers: at least one producer, and at least one job per producer");
    }
    let db = ctx.create_db("producers").await?;
    queue::setup(&db).await?;
    let (mut lockgate, mut baseline) = (Vec::new(), Vec::new());
    for round in 0..ctx.options.rounds {
        let label = ctx.label("producers", round);
        for side in order(round) {
            queue::reset(&db).await?;
            let run = concurrent(ctx, &db, side, args, &label).await?;
            let who = if side == Side::Lockgate { "lockgate" } else { "baseline" };
            ctx.progress.note(format!("{label}: {who} {:.0} jobs/s", run.rate));
            match side {
                Side::Lockgate => lockgate.push(run),
                Side::Baseline => baseline.push(run),
            }
        }
    }
    db.close().await?;
    let rate = |runs: &[Run]| Summary::of(&runs.iter().map(|r| r.rate).collect::<Vec<_>>());
    let Some(summary) = rate(&lockgate) else { bail!("producers ran no rounds") };
    let measure = format!("{} jobs from {} producers, 1 per transaction", args.jobs, args.producers);
    let row = Row::new("producers", measure, "jobs/s", summary)
        .baseline(format!("pgmq.send ×{}", args.producers), rate(&baseline))
        .ratio_target(0.8);
    let mut diagnostics = diagnostics("lockgate", &lockgate, "lockgate.enqueue", args.jobs);
    diagnostics.extend(self::diagnostics("baseline", &baseline, "pgmq.send", args.jobs));
    Ok(Outcome { rows: vec![row], diagnostics })
}

/// One side's round: every producer opens its connection, then all start at once.
async fn concurrent(ctx: &Ctx, db: &BenchDb, side: Side, args: &ProducersArgs, label: &str) -> Result<Run> {
    let mut pools: Vec<PgPool> = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..args.producers {
        let pool = db.pool_warm(1, 1).await?;
        pools.push(pool.clone());
        handles.push(match side {
            Side::Lockgate => {
                let client = Client::new(pool);
                // Marks the type as known to this client: its first enqueue does not look it up.
                client.define::<Noop>().await?;
                Handle::Client(client)
            }
            Side::Baseline => Handle::Raw(pool.acquire().await?),
        });
    }
    let who = if side == Side::Lockgate { "lockgate" } else { "baseline" };
    let bar = ctx.progress.bar(args.jobs, format!("{label}: {who}"));
    let before = FunctionStats::read(&db.pool).await?;
    let barrier = Arc::new(Barrier::new(args.producers + 1));
    let mut tasks = Vec::new();
    for (i, handle) in handles.into_iter().enumerate() {
        // The first `jobs % producers` producers take one more.
        let n = args.jobs / args.producers as u64 + u64::from((i as u64) < args.jobs % args.producers as u64);
        let (barrier, bar) = (Arc::clone(&barrier), bar.clone());
        tasks.push(tokio::spawn(async move {
            let mut handle = handle;
            let mut calls = Vec::with_capacity(n as usize);
            barrier.wait().await;
            let started = Instant::now();
            for _ in 0..n {
                let t = Instant::now();
                match &mut handle {
                    Handle::Client(client) => drop(client.enqueue(&Noop {}).await?),
                    Handle::Raw(conn) => {
                        sqlx::query_scalar::<_, i64>("SELECT pgmq.send($1, $2)")
                            .bind(RAW_QUEUE)
                            .bind(json!({}))
                            .fetch_one(&mut **conn)
                            .await?;
                    }
                }
                calls.push(t.elapsed());
                bar.inc(1);
            }
            Ok::<_, anyhow::Error>((started, Instant::now(), calls))
        }));
    }
    barrier.wait().await;
    let (cpu0, machine0) = (cpu_seconds(), machine_cpu());
    let sampler = WaitSampler::start(db.pool.clone(), POLL);
    let mut first_start: Option<Instant> = None;
    let mut last_end: Option<Instant> = None;
    let mut calls_ms = Vec::new();
    let mut failed = None;
    for task in tasks {
        match task.await.context("a producer panicked").and_then(|r| r) {
            Ok((started, ended, calls)) => {
                first_start = Some(first_start.map_or(started, |f| f.min(started)));
                last_end = Some(last_end.map_or(ended, |l| l.max(ended)));
                calls_ms.extend(calls.iter().map(|d: &Duration| d.as_secs_f64() * 1000.0));
            }
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    let cpu_seconds = cpu_seconds().zip(cpu0).map(|(b, a)| b - a);
    let machine_busy_percent = busy_percent(machine0, machine_cpu());
    let waits = sampler.finish().await;
    bar.finish_and_clear();
    for pool in pools {
        close(pool).await;
    }
    if let Some(e) = failed {
        return Err(e);
    }
    let waits = waits?;
    db.settle(&ctx.progress).await?;
    let functions = FunctionStats::read(&db.pool).await?.since(&before);
    let (Some(first), Some(last)) = (first_start, last_end) else { bail!("no producer ran") };
    calls_ms.sort_by(f64::total_cmp);
    Ok(Run {
        rate: args.jobs as f64 / (last - first).as_secs_f64(),
        cpu_seconds,
        machine_busy_percent,
        functions,
        calls_ms,
        waits,
    })
}

/// Server time per call (all rounds), call times as the producers saw them (median over rounds
/// of each round's p50 and p99), the sessions' waits (all rounds), client CPU per job and the
/// machine's busy share.
fn diagnostics(who: &str, runs: &[Run], function: &str, jobs: u64) -> Vec<String> {
    let mut total = FunctionStats::default();
    runs.iter().for_each(|r| total.add(&r.functions));
    let all_jobs = (jobs * runs.len() as u64) as f64;
    let mut lines: Vec<String> =
        total.describe(&[function], all_jobs).into_iter().map(|l| format!("{who} {l}")).collect();
    let p = |q: f64| Summary::of(&runs.iter().filter_map(|r| percentile(&r.calls_ms, q)).collect::<Vec<_>>());
    if let (Some(p50), Some(p99)) = (p(50.0), p(99.0)) {
        lines.push(format!(
            "{who} call time (client, commit included) p50 {:.2} ms, p99 {:.2} ms",
            p50.median, p99.median
        ));
    }
    let mut waits = WaitProfile::default();
    runs.iter().for_each(|r| waits.add(&r.waits));
    if let Some(line) = waits.describe() {
        lines.push(format!("{who} sessions (pg_stat_activity every {} ms): {line}", POLL.as_millis()));
    }
    let cpu: Option<f64> = runs.iter().map(|r| r.cpu_seconds).sum();
    let busy = Summary::of(&runs.iter().filter_map(|r| r.machine_busy_percent).collect::<Vec<_>>());
    if let (Some(cpu), Some(busy)) = (cpu, busy) {
        lines.push(format!(
            "{who} client CPU {:.1} µs/job (this process); machine CPU busy {:.0}% (median of rounds, all processes)",
            cpu * 1e6 / all_jobs,
            busy.median
        ));
    }
    lines
}
