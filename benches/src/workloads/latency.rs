//! latency: an idle runtime; one producer enqueues a job every `interval_ms` for `duration_s`.
//! Each job carries the instant just before its `Client::enqueue` call (microseconds since a
//! base instant shared with the handler, in this process); the handler records how long after
//! that it started. So the latency includes the enqueue's own round trip and commit, the
//! notification, the claim and the dispatch to the handler. Targets: p50 ≤ 5 ms, p99 ≤ 25 ms.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lockgate::{Client, Job, JobContext, JobError, JobPolicy, PoolConfig, QueueName, Registry, Runtime, RuntimeConfig};
use serde::{Deserialize, Serialize};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::{Ctx, Outcome};
use crate::bench_db::{close, BenchDb};
use crate::plan::LatencyArgs;
use crate::queue::{self, QUEUE};
use crate::report::{Check, Row};
use crate::stats::{percentile, Summary};

/// Jobs run (and discarded) before each round: the runtime is listening and warm.
const WARMUP_JOBS: u64 = 5;
/// How long the last job of a round may take to start before the round fails.
const ROUND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Serialize, Deserialize)]
struct Ping {
    /// Microseconds from the shared base instant to just before the enqueue call.
    sent_us: u64,
}

impl Job for Ping {
    const TYPE: &'static str = "bench_ping";

    fn policy() -> JobPolicy {
        JobPolicy::on_queue(QueueName::new(QUEUE).expect("\"bench\" is a valid queue name"))
    }
}

/// Enqueue → handler start, in milliseconds, as handlers record them.
type Samples = Arc<Mutex<Vec<f64>>>;

/// The percentiles reported, with their targets (ms).
const PERCENTILES: [(&str, Option<f64>); 3] = [("p50", Some(5.0)), ("p95", None), ("p99", Some(25.0))];

/// One round: the latency at each of PERCENTILES and its max (ms), and the producer's enqueue
/// call time p50 (ms).
struct RoundResult {
    percentiles: [f64; 3],
    max: f64,
    enqueue_p50: f64,
}

pub async fn run(ctx: &Ctx, args: &LatencyArgs) -> Result<Outcome> {
    let db = ctx.create_db("latency").await?;
    // Defined up front: the producer must not race the runtime's own start-up definition.
    queue::setup(&db).await?.define::<Ping>().await?;
    let mut results = Vec::new();
    for round in 0..ctx.options.rounds {
        queue::reset(&db).await?;
        let r = round_once(ctx, &db, args, &ctx.label("latency", round)).await?;
        ctx.progress.note(format!(
            "{}: p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            ctx.label("latency", round),
            r.percentiles[0],
            r.percentiles[1],
            r.percentiles[2],
            r.max
        ));
        results.push(r);
    }
    db.close().await?;
    let mut rows = Vec::new();
    for (i, (name, max_ms)) in PERCENTILES.iter().enumerate() {
        let Some(summary) = Summary::of(&results.iter().map(|r| r.percentiles[i]).collect::<Vec<_>>()) else {
            continue;
        };
        let measure = format!("{name}, 1 job / {} ms for {} s", args.interval_ms, args.duration_s);
        let row = Row::new("latency", measure, "ms", summary);
        rows.push(match max_ms {
            Some(max) => {
                let median = row.lockgate.median;
                let check = Check { value: median, met: median <= *max, shown: format!("{median:.2} ms") };
                row.target(format!("≤ {max} ms"), Some(check))
            }
            None => row,
        });
    }
    let mut diagnostics: Vec<String> =
        results.iter().map(|r| format!("max {:.2} ms; enqueue call p50 {:.2} ms", r.max, r.enqueue_p50)).collect();
    diagnostics.insert(0, "per round (the enqueue call's own time is part of the latency):".into());
    Ok(Outcome { rows, diagnostics })
}

async fn round_once(ctx: &Ctx, db: &BenchDb, args: &LatencyArgs, label: &str) -> Result<RoundResult> {
    let base = Instant::now();
    let samples: Samples = Arc::default();
    let pool = db.pool_warm(8, 3).await?;
    let runtime = runtime(pool.clone(), args.concurrency, base, Arc::clone(&samples))?;
    let stop = CancellationToken::new();
    let handle = tokio::spawn(runtime.run(stop.clone()));
    let produced = produce(ctx, db, args, base, &samples, label).await;
    stop.cancel();
    let ran = handle.await;
    close(pool).await;
    let mut enqueue_ms = produced?;
    ran.context("the runtime panicked")?.context("the runtime failed")?;
    let mut lat = samples.lock().unwrap_or_else(|e| e.into_inner()).clone();
    lat.sort_by(f64::total_cmp);
    enqueue_ms.sort_by(f64::total_cmp);
    let p = |v: &[f64], q: f64| percentile(v, q).unwrap_or(f64::NAN);
    Ok(RoundResult {
        percentiles: [p(&lat, 50.0), p(&lat, 95.0), p(&lat, 99.0)],
        max: p(&lat, 100.0),
        enqueue_p50: p(&enqueue_ms, 50.0),
    })
}

fn runtime(pool: lockgate::PgPool, concurrency: usize, base: Instant, samples: Samples) -> Result<Runtime> {
    let mut registry = Registry::new();
    registry.register::<Ping, _>(move |_ctx: JobContext, job: Ping| {
        // Recorded when the handler is called, before its future is first awaited.
        let started_us = base.elapsed().as_micros() as u64;
        let ms = started_us.saturating_sub(job.sent_us) as f64 / 1000.0;
        samples.lock().unwrap_or_else(|e| e.into_inner()).push(ms);
        async { Ok::<(), JobError>(()) }
    })?;
    let pools = vec![PoolConfig::new("bench", vec![QueueName::new(QUEUE)?], concurrency)];
    Ok(Runtime::new(pool, RuntimeConfig::default(), registry, pools)?)
}

/// Warms up, then sends one job per interval; returns each enqueue call's duration (ms) once
/// every job of the round has started.
async fn produce(
    ctx: &Ctx,
    db: &BenchDb,
    args: &LatencyArgs,
    base: Instant,
    samples: &Samples,
    label: &str,
) -> Result<Vec<f64>> {
    let client = Client::new(db.pool_warm(2, 1).await?);
    let send = |client: &Client| {
        let job = Ping { sent_us: base.elapsed().as_micros() as u64 };
        let client = client.clone();
        async move { client.enqueue(&job).await }
    };
    for _ in 0..WARMUP_JOBS {
        send(&client).await?;
    }
    wait_for(samples, WARMUP_JOBS as usize).await.context("warm-up jobs did not run")?;
    samples.lock().unwrap_or_else(|e| e.into_inner()).clear();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let jobs = args.jobs();
    let bar = ctx.progress.bar(jobs, format!("{label}: lockgate"));
    let mut ticker = tokio::time::interval(args.interval());
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut enqueue_ms = Vec::with_capacity(jobs as usize);
    for _ in 0..jobs {
        ticker.tick().await;
        let started = Instant::now();
        send(&client).await?;
        enqueue_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        bar.inc(1);
    }
    let waited = wait_for(samples, jobs as usize).await;
    bar.finish_and_clear();
    client.pool().close().await;
    waited?;
    Ok(enqueue_ms)
}

async fn wait_for(samples: &Samples, n: usize) -> Result<()> {
    let deadline = Instant::now() + ROUND_TIMEOUT;
    loop {
        let have = samples.lock().unwrap_or_else(|e| e.into_inner()).len();
        if have >= n {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("only {have} of {n} jobs started within {ROUND_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
