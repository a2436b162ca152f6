//! latency: an idle runtime; one producer enqueues a job every `interval_ms` for `duration_s`.
//! Each job carries the instant just before its `Client::enqueue` call (microseconds since a
//! base instant shared with the handler, in this process); the handler records how long after
//! that it started. So the latency includes the enqueue's own round trip and commit, the
//! notification, the claim and the dispatch to the handler.
//!
//! The baseline, in the same rounds (the order alternating), is raw PGMQ woken by LISTEN: a
//! producer on a held connection sends each message and notifies in one statement and one
//! transaction (`SELECT pgmq.send('raw', msg) FROM pg_notify('bench_raw', '')`); a consumer
//! connection LISTENs on that channel and, on each notification (those already buffered are
//! taken together), runs `pgmq.read('raw', 30, 16)` until a read returns fewer than 16, and
//! archives what it read. Its latency runs from just before the send to the moment the read
//! returned the message (the consumer has it). PGMQ 1.11's own `enable_notify_insert` trigger
//! was not used: it updates a throttle row on every insert, one more write than the explicit
//! `pg_notify`, which is what a producer writing for speed would do.
//!
//! Targets (issue 14): p50 ≤ 1.15× and p99 ≤ 1.3× the baseline's. The p50 ≤ 5 ms and p99 ≤ 25 ms
//! bounds of issue 5 are reported among the diagnostics, with each side's statements (calls and
//! server time, `pg_stat_user_functions`, warm-up jobs included) and, per round, the send call's
//! p50 and the part of the latency after the call returned (wake-up, claim or read, dispatch).
//!
//! The lockgate round is also latency-load's probe (`latency_load.rs`), there with a steady
//! load of no-op jobs on the same queue. The burst workload (`burst.rs`) sends the same jobs
//! through the same producers, on a schedule, to handlers that take some time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lockgate::{Client, Job, JobContext, JobError, JobPolicy, PoolConfig, QueueName, Registry, Runtime, RuntimeConfig};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::postgres::PgListener;
use sqlx::PgConnection;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::{order, Ctx, Outcome, Side};
use crate::bench_db::{close, BenchDb};
use crate::plan::LatencyArgs;
use crate::probe::FunctionStats;
use crate::queue::{self, Noop, QUEUE, RAW_QUEUE};
use crate::report::Row;
use crate::stats::{percentile, Summary};

/// Jobs run (and discarded) before each round: the runtime (or consumer) is listening and warm.
const WARMUP_JOBS: u64 = 5;
/// How long the last job of a round may take to start before the round fails.
const ROUND_TIMEOUT: Duration = Duration::from_secs(30);
/// The baseline's notification channel, and the payload that stops its consumer.
pub const CHANNEL: &str = "bench_raw";
const STOP: &str = "stop";
/// The statements each side runs per job, for the diagnostics (server time per call).
const LOCKGATE_FUNCTIONS: &[&str] = &["lockgate.enqueue", "lockgate.claim", "lockgate.complete"];
const BASELINE_FUNCTIONS: &[&str] = &["pgmq.send", "pgmq.read", "pgmq.archive"];
/// The baseline consumer's read: PGMQ's usual batch, lockgate's visibility timeout.
const BASELINE_BATCH: i32 = 16;
const BASELINE_VT_SECONDS: i32 = 30;

#[derive(Debug, Serialize, Deserialize)]
pub struct Ping {
    /// Microseconds from the shared base instant to just before the enqueue call.
    sent_us: u64,
}

impl Job for Ping {
    const TYPE: &'static str = "bench_ping";

    fn policy() -> JobPolicy {
        JobPolicy::on_queue(QueueName::new(QUEUE).expect("\"bench\" is a valid queue name"))
    }
}

/// Each job's send instant (its `sent_us`) and its latency, enqueue → handler start (or → read)
/// in milliseconds, as handlers (or the consumer) record them.
pub type Samples = Arc<Mutex<Vec<(u64, f64)>>>;

/// The percentiles reported, with their targets as a maximum ratio to the baseline, and the
/// absolute bounds of issue 5 (ms).
pub const PERCENTILES: [(&str, f64, Option<f64>, Option<f64>); 3] =
    [("p50", 50.0, Some(1.15), Some(5.0)), ("p95", 95.0, None, None), ("p99", 99.0, Some(1.3), Some(25.0))];

/// One round of one side: the latency at each of PERCENTILES and its max (ms), the producer's
/// enqueue call time p50 (ms), and the part of the latency after the call returned (from the
/// commit's acknowledgement to the handler's start, or to the read's return), p50 and p99 (ms).
#[derive(Debug, Clone)]
pub struct RoundResult {
    pub percentiles: [f64; 3],
    pub max: f64,
    pub enqueue_p50: f64,
    pub after_call: [f64; 2],
}

impl RoundResult {
    /// "max 12.3 ms, call p50 2.1 ms, after p50 1.9 / p99 4.2 ms"
    pub fn parts(&self) -> String {
        format!(
            "max {:.2} ms, call p50 {:.2} ms, after p50 {:.2} / p99 {:.2} ms",
            self.max, self.enqueue_p50, self.after_call[0], self.after_call[1]
        )
    }

    pub fn line(&self) -> String {
        format!(
            "p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            self.percentiles[0], self.percentiles[1], self.percentiles[2], self.max
        )
    }
}

pub async fn run(ctx: &Ctx, args: &LatencyArgs) -> Result<Outcome> {
    let db = ctx.create_db("latency").await?;
    setup(&db).await?;
    let before = FunctionStats::read(&db.pool).await?;
    let (mut lockgate, mut baseline) = (Vec::new(), Vec::new());
    for round in 0..ctx.options.rounds {
        let label = ctx.label("latency", round);
        for side in order(round) {
            queue::reset(&db).await?;
            let r = match side {
                Side::Lockgate => lockgate_round(ctx, &db, args, &label).await?,
                Side::Baseline => listen_round(ctx, &db, args, &label).await?,
            };
            let who = if side == Side::Lockgate { "lockgate" } else { "baseline" };
            ctx.progress.note(format!("{label}: {who} {}", r.line()));
            match side {
                Side::Lockgate => lockgate.push(r),
                Side::Baseline => baseline.push(r),
            }
        }
    }
    db.settle(&ctx.progress).await?;
    let functions = FunctionStats::read(&db.pool).await?.since(&before);
    db.close().await?;
    let mut rows = Vec::new();
    // Every round of a side sends the warm-up jobs and the measured ones.
    let jobs = (ctx.options.rounds as u64 * (args.jobs() + WARMUP_JOBS)) as f64;
    let mut diagnostics: Vec<String> =
        functions.describe(LOCKGATE_FUNCTIONS, jobs).into_iter().map(|l| format!("lockgate {l}")).collect();
    diagnostics.extend(functions.describe(BASELINE_FUNCTIONS, jobs).into_iter().map(|l| format!("baseline {l}")));
    for (i, (name, _, max_ratio, bound)) in PERCENTILES.iter().enumerate() {
        let Some(summary) = summary(&lockgate, i) else { continue };
        let measure = format!("{name}, 1 job / {} ms for {} s", args.interval_ms, args.duration_s);
        let row =
            Row::new("latency", measure, "ms", summary).baseline("pgmq LISTEN + read", self::summary(&baseline, i));
        if let Some(max) = bound {
            let median = row.lockgate.median;
            let met = if median <= *max { "met" } else { "MISSED" };
            diagnostics.push(format!("issue 5 bound: lockgate {name} {median:.2} ms ≤ {max} ms: {met}"));
        }
        rows.push(match max_ratio {
            Some(max) => row.max_ratio_target(*max),
            None => row,
        });
    }
    diagnostics.push(
        "per round (the enqueue call's own time is part of the latency; \"after\" is what came after the call \
         returned: wake-up, claim or read, dispatch):"
            .into(),
    );
    for (round, (l, b)) in lockgate.iter().zip(&baseline).enumerate() {
        diagnostics.push(format!("r{}: lockgate {}; baseline {}", round + 1, l.parts(), b.parts()));
    }
    Ok(Outcome { rows, diagnostics })
}

/// The `i`-th percentile of every round.
pub fn summary(rounds: &[RoundResult], i: usize) -> Option<Summary> {
    Summary::of(&rounds.iter().map(|r| r.percentiles[i]).collect::<Vec<_>>())
}

/// Defines the probe's job type (and `bench_noop`, the load), creating queues `bench` and `raw`.
/// Defined up front: the producer must not race the runtime's own start-up definition.
pub async fn setup(db: &BenchDb) -> Result<Client> {
    let client = queue::setup(db).await?;
    client.define::<Ping>().await?;
    Ok(client)
}

/// One lockgate round: a runtime serving `bench` (the probe's `Ping` jobs, and the no-op jobs of
/// latency-load's load if one runs) at `args.concurrency`, and the probe.
pub async fn lockgate_round(ctx: &Ctx, db: &BenchDb, args: &LatencyArgs, label: &str) -> Result<RoundResult> {
    let base = Instant::now();
    let samples: Samples = Arc::default();
    let pool = db.pool_warm(8, 3).await?;
    let runtime = runtime(pool.clone(), args.concurrency, base, Arc::clone(&samples), Duration::ZERO)?;
    let stop = CancellationToken::new();
    let handle = tokio::spawn(runtime.run(stop.clone()));
    let produced = match db.pool_warm(2, 1).await {
        Ok(client_pool) => {
            let mut sender = Sender::Client(Client::new(client_pool.clone()));
            let produced = produce(ctx, args, base, &samples, &mut sender, label).await;
            drop(sender);
            close(client_pool).await;
            produced
        }
        Err(e) => Err(e),
    };
    stop.cancel();
    let ran = handle.await;
    close(pool).await;
    let calls = produced?;
    ran.context("the runtime panicked")?.context("the runtime failed")?;
    Ok(result(&samples, &calls))
}

/// One baseline round: a consumer on LISTEN reads and archives what a producer sends and
/// notifies (see the module's doc).
async fn listen_round(ctx: &Ctx, db: &BenchDb, args: &LatencyArgs, label: &str) -> Result<RoundResult> {
    let base = Instant::now();
    let samples: Samples = Arc::default();
    let consumer_pool = db.pool_warm(1, 1).await?;
    let mut listener = PgListener::connect_with(&consumer_pool).await?;
    listener.listen(CHANNEL).await?;
    let consumer = tokio::spawn(consume(listener, base, Arc::clone(&samples)));
    let producer_pool = db.pool_warm(1, 1).await?;
    let produced = match producer_pool.acquire().await {
        Ok(mut conn) => produce(ctx, args, base, &samples, &mut Sender::Raw(&mut conn), label).await,
        Err(e) => Err(e.into()),
    };
    close(producer_pool).await;
    let stopped = sqlx::query("SELECT pg_notify($1, $2)").bind(CHANNEL).bind(STOP).execute(&db.pool).await;
    let consumed = consumer.await;
    close(consumer_pool).await;
    let calls = produced?;
    stopped?;
    consumed.context("the baseline consumer panicked")?.context("the baseline consumer failed")?;
    Ok(result(&samples, &calls))
}

/// The baseline's consumer: on each notification, reads (and archives) until a read comes back
/// short, recording each message's latency when its read returns. Ends on the stop payload.
async fn consume(mut listener: PgListener, base: Instant, samples: Samples) -> Result<()> {
    loop {
        let first = listener.recv().await?;
        let mut stop = first.payload() == STOP;
        while let Some(more) = listener.next_buffered() {
            stop |= more.payload() == STOP;
        }
        if stop {
            return Ok(());
        }
        loop {
            let batch: Vec<(i64, Value)> = sqlx::query_as("SELECT msg_id, message FROM pgmq.read($1, $2, $3)")
                .bind(RAW_QUEUE)
                .bind(BASELINE_VT_SECONDS)
                .bind(BASELINE_BATCH)
                .fetch_all(&mut listener)
                .await?;
            let read_us = base.elapsed().as_micros() as u64;
            if batch.is_empty() {
                break;
            }
            {
                let mut samples = samples.lock().unwrap_or_else(|e| e.into_inner());
                for (_, message) in &batch {
                    let sent_us =
                        message.get("sent_us").and_then(Value::as_u64).context("a message without sent_us")?;
                    samples.push((sent_us, read_us.saturating_sub(sent_us) as f64 / 1000.0));
                }
            }
            let ids: Vec<i64> = batch.iter().map(|(id, _)| *id).collect();
            sqlx::query("SELECT pgmq.archive($1, $2)").bind(RAW_QUEUE).bind(&ids).execute(&mut listener).await?;
            if batch.len() < BASELINE_BATCH as usize {
                break;
            }
        }
    }
}

/// The round's percentiles from the samples, and the producer's call times (send instant, ms).
fn result(samples: &Samples, calls: &[(u64, f64)]) -> RoundResult {
    let samples = samples.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let call_of: HashMap<u64, f64> = calls.iter().copied().collect();
    let mut after: Vec<f64> =
        samples.iter().filter_map(|(sent, ms)| call_of.get(sent).map(|call| (ms - call).max(0.0))).collect();
    let mut lat: Vec<f64> = samples.iter().map(|(_, ms)| *ms).collect();
    let mut enqueue_ms: Vec<f64> = calls.iter().map(|(_, ms)| *ms).collect();
    for v in [&mut lat, &mut after, &mut enqueue_ms] {
        v.sort_by(f64::total_cmp);
    }
    let p = |v: &[f64], q: f64| percentile(v, q).unwrap_or(f64::NAN);
    RoundResult {
        percentiles: PERCENTILES.map(|(_, q, _, _)| p(&lat, q)),
        max: p(&lat, 100.0),
        enqueue_p50: p(&enqueue_ms, 50.0),
        after_call: [p(&after, 50.0), p(&after, 99.0)],
    }
}

/// A runtime serving `bench` at `concurrency`, whose `Ping` handler records its latency and then
/// sleeps for `handler_time` (returns at once when it is zero).
pub fn runtime(
    pool: lockgate::PgPool,
    concurrency: usize,
    base: Instant,
    samples: Samples,
    handler_time: Duration,
) -> Result<Runtime> {
    let mut registry = Registry::new();
    registry.register::<Ping, _>(move |_ctx: JobContext, job: Ping| {
        // Recorded when the handler is called, before its future is first awaited.
        let started_us = base.elapsed().as_micros() as u64;
        let ms = started_us.saturating_sub(job.sent_us) as f64 / 1000.0;
        samples.lock().unwrap_or_else(|e| e.into_inner()).push((job.sent_us, ms));
        async move {
            if !handler_time.is_zero() {
                tokio::time::sleep(handler_time).await;
            }
            Ok::<(), JobError>(())
        }
    })?;
    // The load of latency-load; never enqueued by latency itself.
    registry.register::<Noop, _>(|_ctx: JobContext, _job: Noop| async { Ok::<(), JobError>(()) })?;
    let pools = vec![PoolConfig::new("bench", vec![QueueName::new(QUEUE)?], concurrency)];
    Ok(Runtime::new(pool, RuntimeConfig::default(), registry, pools)?)
}

/// How the probe's producer sends.
pub enum Sender<'c> {
    /// `Client::enqueue` of a `Ping` (the client keeps a connection of its own).
    Client(Client),
    /// `pgmq.send` + `pg_notify` in one statement, on a held connection.
    Raw(&'c mut PgConnection),
}

impl Sender<'_> {
    /// Sends one job; returns its `sent_us`.
    pub async fn send(&mut self, base: Instant) -> Result<u64> {
        let sent_us = base.elapsed().as_micros() as u64;
        match self {
            Self::Client(client) => drop(client.enqueue(&Ping { sent_us }).await?),
            Self::Raw(conn) => {
                sqlx::query("SELECT pgmq.send($1, $2) FROM pg_notify($3, '')")
                    .bind(RAW_QUEUE)
                    .bind(json!({ "sent_us": sent_us }))
                    .bind(CHANNEL)
                    .execute(&mut **conn)
                    .await?;
            }
        }
        Ok(sent_us)
    }
}

/// Warms up, then sends one job per interval; returns each job's send instant (`sent_us`) and
/// call duration (ms) once every job of the round has been received.
async fn produce(
    ctx: &Ctx,
    args: &LatencyArgs,
    base: Instant,
    samples: &Samples,
    sender: &mut Sender<'_>,
    label: &str,
) -> Result<Vec<(u64, f64)>> {
    for _ in 0..WARMUP_JOBS {
        sender.send(base).await?;
    }
    wait_for(samples, WARMUP_JOBS as usize).await.context("warm-up jobs did not run")?;
    samples.lock().unwrap_or_else(|e| e.into_inner()).clear();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let jobs = args.jobs();
    let who = if matches!(sender, Sender::Client(_)) { "lockgate" } else { "baseline" };
    let bar = ctx.progress.bar(jobs, format!("{label}: {who}"));
    let mut ticker = tokio::time::interval(args.interval());
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut enqueue_ms = Vec::with_capacity(jobs as usize);
    for _ in 0..jobs {
        ticker.tick().await;
        let started = Instant::now();
        let sent_us = sender.send(base).await?;
        enqueue_ms.push((sent_us, started.elapsed().as_secs_f64() * 1000.0));
        bar.inc(1);
    }
    let waited = wait_for(samples, jobs as usize).await;
    bar.finish_and_clear();
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
