//! burst: sustained load with a burst (issue 14). Producers enqueue on a schedule — `rate` jobs/s
//! for `warmup_s`, then `burst_factor` × `rate` for `burst_s`, then `rate` again for
//! `recovery_s` — while one runtime at `concurrency` runs the jobs, each handler sleeping
//! `handler_ms`. `producers` producers share the schedule, each on a connection of its own: each
//! takes the next job due, waits for its time and sends it with `Client::enqueue`, one job per
//! transaction. As in latency.rs, a job carries the instant just before its enqueue call and its
//! handler records how much later it started; a job belongs to the phase in which it was sent.
//! Every producer's transaction notifies, on both sides, and PostgreSQL lets notifying commits
//! through one at a time, each holding a cluster-wide lock through its WAL flush (design §1): the
//! rate producers can hold is about one job per WAL flush, whatever their number. Read the
//! producers' lag in the diagnostics before the latencies.
//!
//! Reported: p50 and p99 before the burst, during it and after it; the p99 of each `window_s`
//! window after the burst; the backlog (the queue table's rows, in flight included, as
//! `pgmq.metrics` counts them; sampled every 250 ms), median per phase. "Before" is the warm-up's
//! last whole windows, its first window left out (the runtime's start) when it has more than
//! one. Target (issue 14): p99 back to its pre-burst value within 60 s of the burst's end, read
//! as: the last window's p99 at most the highest p99 of the windows before the burst (their
//! spread is the steady state's own), and not met where the producers fell behind the schedule
//! (sent under 95% of a phase's jobs): the pre-burst figures are then the producers' own queue.
//!
//! The baseline, in the same rounds (the order alternating): raw PGMQ on the same schedule, with
//! latency.rs's raw producer (`pgmq.send` and `pg_notify` in one statement, on a held
//! connection) and `concurrency` consumers on a connection each, each looping `pgmq.read(raw,
//! 30, 1)`, the same sleep, and `pgmq.archive`: one job at a time, as one of lockgate's
//! concurrency slots runs one. A consumer that reads nothing waits for a notification (one
//! LISTEN connection wakes one waiting consumer per notification) or for 1 s, lockgate's poll
//! interval. Its latency runs to the read's return.
//!
//! What may degrade, in the diagnostics: per side and round, the dead rows, updates and HOT
//! updates of the queue table and of the lockgate tables (`tables::LOCKGATE_TABLES`) at each
//! phase's end (read while the sessions run, so up to about a second behind them), the
//! producers' lag behind the schedule, the backlog's peak, and the statements per job. The
//! server runs with autovacuum off: the harness vacuums the queue table every `VACUUM_INTERVAL`,
//! as autovacuum would.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lockgate::{Client, PgPool};
use serde_json::Value;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::latency::{self, Samples, Sender, CHANNEL};
use super::{order, vacuum_every, Ctx, Outcome, Side};
use crate::bench_db::{close, BenchDb};
use crate::plan::BurstArgs;
use crate::probe::FunctionStats;
use crate::queue::{self, QUEUE, RAW_QUEUE};
use crate::report::{Check, Row};
use crate::stats::{percentile, Summary};
use crate::tables::{self, Counters, LOCKGATE_TABLES};

/// How often the backlog is counted.
const BACKLOG_SAMPLE: Duration = Duration::from_millis(250);
/// A round fails when no job starts for this long while some are still waiting.
const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an idle baseline consumer waits for a notification before it reads again:
/// lockgate's default poll interval.
const IDLE_POLL: Duration = Duration::from_secs(1);
/// A phase whose producers sent less than this share of the jobs it scheduled did not get the
/// load it was meant to: its figures measure the producers' backlog, not the consumers'.
const HELD_SHARE: f64 = 0.95;
/// The baseline's visibility timeout: lockgate's default.
const BASELINE_VT_SECONDS: i32 = 30;
const LOCKGATE_FUNCTIONS: &[&str] = &["lockgate.enqueue", "lockgate.claim", "lockgate.complete", "lockgate.extend"];
const BASELINE_FUNCTIONS: &[&str] = &["pgmq.send", "pgmq.read", "pgmq.archive"];

/// When each job is due, in seconds from the schedule's start.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    rate: f64,
    burst_rate: f64,
    /// The ends of the warm-up, the burst and the recovery.
    ends: [f64; 3],
}

impl Schedule {
    fn of(args: &BurstArgs) -> Self {
        let burst_end = args.warmup_s + args.burst_s;
        Self {
            rate: args.rate,
            burst_rate: args.rate * args.burst_factor,
            ends: [args.warmup_s, burst_end, burst_end + args.recovery_s],
        }
    }

    /// The rates before, during and after the burst.
    fn rates(&self) -> [f64; 3] {
        [self.rate, self.burst_rate, self.rate]
    }

    /// Jobs in the whole schedule.
    fn jobs(&self) -> u64 {
        let [warmup, burst_end, end] = self.ends;
        (self.rate * warmup + self.burst_rate * (burst_end - warmup) + self.rate * (end - burst_end)).ceil() as u64
    }

    /// When job `k` (counted from 0) is due: where the schedule's running count reaches `k`.
    fn due(&self, k: u64) -> Option<f64> {
        if k >= self.jobs() {
            return None;
        }
        let [warmup, burst_end, _] = self.ends;
        let k = k as f64;
        let (before, during) = (self.rate * warmup, self.burst_rate * (burst_end - warmup));
        Some(if k < before {
            k / self.rate
        } else if k < before + during {
            warmup + (k - before) / self.burst_rate
        } else {
            burst_end + (k - before - during) / self.rate
        })
    }
}

/// The spans (seconds from the schedule's start) the figures are taken over.
#[derive(Debug, Clone)]
struct Spans {
    /// Before, during and after the burst.
    phases: [(f64, f64); 3],
    /// Whole windows ending at the burst's start, the latest first (one shorter window when the
    /// warm-up is shorter than a window).
    before: Vec<(f64, f64)>,
    /// Windows from the burst's end to the schedule's (the last one may be shorter).
    after: Vec<(f64, f64)>,
}

impl Spans {
    fn of(args: &BurstArgs, schedule: &Schedule) -> Self {
        let [warmup, burst_end, end] = schedule.ends;
        let w = args.window_s;
        // The warm-up's first window is left out when more whole windows follow it.
        let whole = (warmup / w).floor() as usize;
        let n = whole.saturating_sub(1).max(1);
        let before: Vec<(f64, f64)> =
            (0..n).map(|i| ((warmup - (i + 1) as f64 * w).max(0.0), warmup - i as f64 * w)).collect();
        let after_windows = ((end - burst_end) / w).ceil() as usize;
        let after =
            (0..after_windows).map(|i| (burst_end + i as f64 * w, (burst_end + (i + 1) as f64 * w).min(end))).collect();
        let before_start = before.last().map_or(0.0, |&(from, _)| from);
        Self { phases: [(before_start, warmup), (warmup, burst_end), (burst_end, end)], before, after }
    }
}

/// What one side did in one round, in seconds from the schedule's start.
struct Run {
    /// (sent at, latency in ms) per job.
    latencies: Vec<(f64, f64)>,
    /// (at, rows in the queue table).
    backlog: Vec<(f64, i64)>,
    /// (due at, how late its send started in ms) per job.
    lags: Vec<(f64, f64)>,
    /// The side's tables' counters at the start and at the end of each phase.
    counters: Vec<BTreeMap<String, Counters>>,
    vacuums: u32,
}

/// A run's figures.
struct Figures {
    /// p50 and p99 (ms) before, during and after the burst.
    phases: [[f64; 2]; 3],
    /// The p99 (ms) of each window after the burst.
    windows: Vec<f64>,
    /// The pre-burst p99: the highest of the windows before the burst (ms).
    reference: f64,
    /// The backlog's median and peak before, during and after the burst.
    backlog: [[f64; 2]; 3],
    /// Jobs sent in each phase, and the producers' lag behind the schedule then (p99, max; ms).
    sent: [usize; 3],
    lag: [[f64; 2]; 3],
    /// Whether the producers sent `HELD_SHARE` of what every phase scheduled.
    held: bool,
}

pub async fn run(ctx: &Ctx, args: &BurstArgs) -> Result<Outcome> {
    let positive = [args.rate, args.burst_factor, args.warmup_s, args.burst_s, args.recovery_s, args.window_s];
    if !positive.iter().all(|x| x.is_finite() && *x > 0.0) || args.concurrency == 0 || args.producers == 0 {
        bail!("burst needs positive rates, durations, concurrency and producers (got {args:?})");
    }
    let db = ctx.create_db("burst").await?;
    latency::setup(&db).await?;
    let before = FunctionStats::read(&db.pool).await?;
    let schedule = Schedule::of(args);
    let spans = Spans::of(args, &schedule);
    let (mut lockgate, mut baseline) = (Vec::new(), Vec::new());
    for round in 0..ctx.options.rounds {
        let label = ctx.label("burst", round);
        for side in order(round) {
            let run = round_of(ctx, &db, args, side, &label).await?;
            let figures = figures(&run, &spans, &schedule);
            ctx.progress.note(format!(
                "{label}: {} p99 before / during / after {:.2} / {:.2} / {:.2} ms",
                who(side),
                figures.phases[0][1],
                figures.phases[1][1],
                figures.phases[2][1]
            ));
            match side {
                Side::Lockgate => lockgate.push((run, figures)),
                Side::Baseline => baseline.push((run, figures)),
            }
        }
    }
    db.settle(&ctx.progress).await?;
    let functions = FunctionStats::read(&db.pool).await?.since(&before);
    db.close().await?;
    let lockgate_figures: Vec<&Figures> = lockgate.iter().map(|(_, f)| f).collect();
    let baseline_figures: Vec<&Figures> = baseline.iter().map(|(_, f)| f).collect();
    let rows = rows(args, &spans, &lockgate_figures, &baseline_figures);
    let mut diagnostics = Vec::new();
    for (side, runs) in [(Side::Lockgate, &lockgate), (Side::Baseline, &baseline)] {
        for (round, (run, figures)) in runs.iter().enumerate() {
            diagnostics.extend(round_lines(&format!("r{} {}", round + 1, who(side)), args, &spans, run, figures));
        }
    }
    let jobs = (ctx.options.rounds as u64 * schedule.jobs()) as f64;
    diagnostics.extend(functions.describe(LOCKGATE_FUNCTIONS, jobs).into_iter().map(|l| format!("lockgate {l}")));
    diagnostics.extend(functions.describe(BASELINE_FUNCTIONS, jobs).into_iter().map(|l| format!("baseline {l}")));
    Ok(Outcome { rows, diagnostics })
}

fn who(side: Side) -> &'static str {
    if side == Side::Lockgate {
        "lockgate"
    } else {
        "baseline"
    }
}

/// One side's round: its consumers start, the producers run the schedule, and the round ends
/// once every job sent has started.
async fn round_of(ctx: &Ctx, db: &BenchDb, args: &BurstArgs, side: Side, label: &str) -> Result<Run> {
    queue::reset(db).await?;
    let base = Instant::now();
    let samples: Samples = Arc::default();
    let consumers = Consumers::start(db, args, side, base, Arc::clone(&samples)).await?;
    let measured = measure(ctx, db, args, side, base, &samples, label).await;
    let stopped = consumers.stop().await;
    let run = measured?;
    stopped?;
    Ok(run)
}

/// Runs the schedule with the side's producers while the backlog and the tables' counters are
/// sampled and the queue table vacuumed; waits for every job sent to start.
async fn measure(
    ctx: &Ctx,
    db: &BenchDb,
    args: &BurstArgs,
    side: Side,
    base: Instant,
    samples: &Samples,
    label: &str,
) -> Result<Run> {
    let schedule = Schedule::of(args);
    let queue_table = format!("pgmq.q_{}", if side == Side::Lockgate { QUEUE } else { RAW_QUEUE });
    let mut watched = vec![queue_table.clone()];
    if side == Side::Lockgate {
        watched.extend(LOCKGATE_TABLES.map(String::from));
    }
    let mut pools = Vec::new();
    for _ in 0..args.producers {
        pools.push(db.pool_warm(if side == Side::Lockgate { 2 } else { 1 }, 1).await?);
    }
    let bar = ctx.progress.bar(schedule.jobs(), format!("{label}: {}", who(side)));
    let stop = CancellationToken::new();
    let start = Instant::now();
    let start_us = start.duration_since(base).as_micros() as f64;
    let monitor =
        tokio::spawn(monitor(db.pool.clone(), queue_table.clone(), watched.clone(), start, schedule, stop.clone()));
    let vacuum = tokio::spawn(vacuum_every(db.pool.clone(), queue_table, stop.clone()));
    let produced = produce_all(&pools, side, schedule, start, base, &bar).await;
    for pool in pools {
        close(pool).await;
    }
    let started = match &produced {
        Ok(lags) => wait_started(samples, lags.len()).await,
        Err(_) => Ok(()),
    };
    bar.finish_and_clear();
    let at_end = tables::counters(&db.pool, &watched.iter().map(String::as_str).collect::<Vec<_>>()).await;
    stop.cancel();
    let monitored = monitor.await.context("the monitor panicked")?;
    let vacuums = vacuum.await.unwrap_or(0);
    let lags = produced?;
    started?;
    let (backlog, mut counters) = monitored?;
    counters.push(at_end?);
    let latencies = samples.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let latencies = latencies.into_iter().map(|(sent_us, ms)| ((sent_us as f64 - start_us) / 1e6, ms)).collect();
    Ok(Run { latencies, backlog, lags, counters, vacuums })
}

/// Runs the schedule with a producer on each pool; returns every job's due time and how late
/// its send started (ms). On a failure, the other producers are stopped and the first failure
/// is returned.
async fn produce_all(
    pools: &[PgPool],
    side: Side,
    schedule: Schedule,
    start: Instant,
    base: Instant,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<(f64, f64)>> {
    let next = Arc::new(AtomicU64::new(0));
    let mut producers = JoinSet::new();
    for pool in pools {
        let (pool, next, bar) = (pool.clone(), Arc::clone(&next), bar.clone());
        producers.spawn(async move {
            match side {
                Side::Lockgate => produce(Sender::Client(Client::new(pool)), schedule, &next, start, base, &bar).await,
                Side::Baseline => {
                    let mut conn = pool.acquire().await?;
                    produce(Sender::Raw(&mut conn), schedule, &next, start, base, &bar).await
                }
            }
        });
    }
    let (mut lags, mut failed) = (Vec::new(), None);
    while let Some(joined) = producers.join_next().await {
        match joined.context("a producer panicked").and_then(|r| r) {
            Ok(more) => lags.extend(more),
            Err(e) => {
                producers.abort_all();
                failed.get_or_insert(e);
            }
        }
    }
    failed.map_or(Ok(lags), Err)
}

/// One producer: takes the next job due, waits for its time, sends it; returns each job's due
/// time and how late its send started (ms).
async fn produce(
    mut sender: Sender<'_>,
    schedule: Schedule,
    next: &AtomicU64,
    start: Instant,
    base: Instant,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<(f64, f64)>> {
    let mut lags = Vec::new();
    while let Some(due) = schedule.due(next.fetch_add(1, Ordering::Relaxed)) {
        let at = start + Duration::from_secs_f64(due);
        tokio::time::sleep_until(at.into()).await;
        let late = at.elapsed().as_secs_f64() * 1000.0;
        sender.send(base).await?;
        lags.push((due, late));
        bar.inc(1);
    }
    Ok(lags)
}

/// Counts the queue table's rows every `BACKLOG_SAMPLE`, and reads the watched tables' counters
/// at the start and at the ends of the warm-up and of the burst, until `stop`.
async fn monitor(
    pool: PgPool,
    queue_table: String,
    watched: Vec<String>,
    start: Instant,
    schedule: Schedule,
    stop: CancellationToken,
) -> Result<(Vec<(f64, i64)>, Vec<BTreeMap<String, Counters>>)> {
    let watched: Vec<&str> = watched.iter().map(String::as_str).collect();
    let bounds = [0.0, schedule.ends[0], schedule.ends[1]];
    let (mut backlog, mut counters) = (Vec::new(), Vec::new());
    let mut ticker = tokio::time::interval(BACKLOG_SAMPLE);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok((backlog, counters)),
            _ = ticker.tick() => {}
        }
        let at = start.elapsed().as_secs_f64();
        if bounds.get(counters.len()).is_some_and(|&bound| at >= bound) {
            counters.push(tables::counters(&pool, &watched).await?);
        }
        let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {queue_table}")).fetch_one(&pool).await?;
        backlog.push((at, rows));
    }
}

async fn wait_started(samples: &Samples, n: usize) -> Result<()> {
    let (mut last, mut moved_at) = (0, Instant::now());
    loop {
        let have = samples.lock().unwrap_or_else(|e| e.into_inner()).len();
        if have >= n {
            return Ok(());
        }
        if have != last {
            (last, moved_at) = (have, Instant::now());
        } else if moved_at.elapsed() > STALL_TIMEOUT {
            bail!("no job started for {STALL_TIMEOUT:?} ({have} of {n} started)");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What runs the jobs: lockgate's runtime, or the baseline's listener and consumers.
enum Consumers {
    Runtime { pool: PgPool, stop: CancellationToken, handle: JoinHandle<Result<(), lockgate::RuntimeError>> },
    Raw { pools: [PgPool; 2], stop: CancellationToken, tasks: JoinSet<Result<()>> },
}

impl Consumers {
    async fn start(db: &BenchDb, args: &BurstArgs, side: Side, base: Instant, samples: Samples) -> Result<Self> {
        let handler_time = Duration::from_millis(args.handler_ms);
        let stop = CancellationToken::new();
        if side == Side::Lockgate {
            let pool = db.pool_warm(8, 3).await?;
            let runtime = latency::runtime(pool.clone(), args.concurrency, base, samples, handler_time)?;
            let handle = tokio::spawn(runtime.run(stop.clone()));
            return Ok(Self::Runtime { pool, stop, handle });
        }
        let listener_pool = db.pool_warm(1, 1).await?;
        let mut listener = PgListener::connect_with(&listener_pool).await?;
        listener.listen(CHANNEL).await?;
        let conns = u32::try_from(args.concurrency)?;
        let pool = db.pool_warm(conns, conns).await?;
        let wake = Arc::new(Notify::new());
        let mut tasks = JoinSet::new();
        tasks.spawn(wake_on_notify(listener, Arc::clone(&wake), stop.clone()));
        for _ in 0..args.concurrency {
            let (pool, wake, samples, stop) = (pool.clone(), Arc::clone(&wake), Arc::clone(&samples), stop.clone());
            tasks.spawn(consume(pool, base, samples, wake, handler_time, stop));
        }
        Ok(Self::Raw { pools: [listener_pool, pool], stop, tasks })
    }

    async fn stop(self) -> Result<()> {
        match self {
            Self::Runtime { pool, stop, handle } => {
                stop.cancel();
                let ran = handle.await;
                close(pool).await;
                ran.context("the runtime panicked")?.context("the runtime failed")?;
            }
            Self::Raw { pools, stop, mut tasks } => {
                stop.cancel();
                let mut ran = Ok(());
                while let Some(joined) = tasks.join_next().await {
                    if ran.is_ok() {
                        ran = joined.context("a baseline consumer panicked").and_then(|r| r);
                    }
                }
                for pool in pools {
                    close(pool).await;
                }
                ran?;
            }
        }
        Ok(())
    }
}

/// Wakes one waiting consumer per notification, until `stop`.
async fn wake_on_notify(mut listener: PgListener, wake: Arc<Notify>, stop: CancellationToken) -> Result<()> {
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            notification = listener.recv() => {
                notification?;
                wake.notify_one();
            }
        }
    }
}

/// A baseline consumer: reads one message, records its latency, sleeps `handler_time`, archives
/// it; when a read finds nothing, waits for a wake-up or `IDLE_POLL`.
async fn consume(
    pool: PgPool,
    base: Instant,
    samples: Samples,
    wake: Arc<Notify>,
    handler_time: Duration,
    stop: CancellationToken,
) -> Result<()> {
    let mut conn = pool.acquire().await?;
    while !stop.is_cancelled() {
        let read: Option<(i64, Value)> = sqlx::query_as("SELECT msg_id, message FROM pgmq.read($1, $2, 1)")
            .bind(RAW_QUEUE)
            .bind(BASELINE_VT_SECONDS)
            .fetch_optional(&mut *conn)
            .await?;
        let Some((msg_id, message)) = read else {
            tokio::select! {
                () = stop.cancelled() => {}
                () = wake.notified() => {}
                () = tokio::time::sleep(IDLE_POLL) => {}
            }
            continue;
        };
        let read_us = base.elapsed().as_micros() as u64;
        let sent_us = message.get("sent_us").and_then(Value::as_u64).context("a message without sent_us")?;
        samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((sent_us, read_us.saturating_sub(sent_us) as f64 / 1000.0));
        if !handler_time.is_zero() {
            tokio::time::sleep(handler_time).await;
        }
        sqlx::query("SELECT pgmq.archive($1, $2::bigint)").bind(RAW_QUEUE).bind(msg_id).execute(&mut *conn).await?;
    }
    Ok(())
}

/// The `q`-th percentile of the values whose time falls in `span` (NaN when none does).
fn percentile_in(values: &[(f64, f64)], span: (f64, f64), q: f64) -> f64 {
    let mut inside: Vec<f64> = values.iter().filter(|(at, _)| *at >= span.0 && *at < span.1).map(|(_, v)| *v).collect();
    inside.sort_by(f64::total_cmp);
    percentile(&inside, q).unwrap_or(f64::NAN)
}

fn figures(run: &Run, spans: &Spans, schedule: &Schedule) -> Figures {
    let p99 = |span| percentile_in(&run.latencies, span, 99.0);
    let backlog: Vec<(f64, f64)> = run.backlog.iter().map(|&(at, rows)| (at, rows as f64)).collect();
    let sent = spans.phases.map(|(from, to)| run.latencies.iter().filter(|(at, _)| *at >= from && *at < to).count());
    let held = (0..3).all(|i| {
        let (from, to) = spans.phases[i];
        sent[i] as f64 >= HELD_SHARE * schedule.rates()[i] * (to - from)
    });
    Figures {
        phases: spans.phases.map(|span| [percentile_in(&run.latencies, span, 50.0), p99(span)]),
        windows: spans.after.iter().map(|&span| p99(span)).collect(),
        reference: spans.before.iter().map(|&span| p99(span)).fold(f64::NAN, f64::max),
        backlog: spans.phases.map(|span| [percentile_in(&backlog, span, 50.0), percentile_in(&backlog, span, 100.0)]),
        sent,
        held,
        lag: spans.phases.map(|span| [percentile_in(&run.lags, span, 99.0), percentile_in(&run.lags, span, 100.0)]),
    }
}

/// A figure over rounds, leaving out rounds where it is not a number (a span without samples).
fn over_rounds(runs: &[&Figures], figure: impl Fn(&Figures) -> f64) -> Option<Summary> {
    Summary::of(&runs.iter().map(|f| figure(f)).filter(|v| v.is_finite()).collect::<Vec<_>>())
}

fn rows(args: &BurstArgs, spans: &Spans, lockgate: &[&Figures], baseline: &[&Figures]) -> Vec<Row> {
    let raw = format!("raw PGMQ ×{}", args.concurrency);
    let phase_names = [
        format!("before the burst ({:.0} jobs/s)", args.rate),
        format!("during the burst ({:.0} jobs/s, {} s)", args.rate * args.burst_factor, args.burst_s),
        format!("after the burst ({:.0} jobs/s, {} s)", args.rate, args.recovery_s),
    ];
    let row = |measure: String, unit: &str, figure: &dyn Fn(&Figures) -> f64| {
        let summary = over_rounds(lockgate, figure)?;
        Some(Row::new("burst", measure, unit, summary).baseline(raw.clone(), over_rounds(baseline, figure)))
    };
    let mut rows = Vec::new();
    for (i, phase) in phase_names.iter().enumerate() {
        for (j, name) in ["p50", "p99"].iter().enumerate() {
            rows.extend(row(format!("{name}, {phase}"), "ms", &|f| f.phases[i][j]));
        }
    }
    let burst_end = spans.phases[2].0;
    for (i, (from, to)) in spans.after.iter().enumerate() {
        let measure = format!("p99, {:.0}–{:.0} s after the burst", from - burst_end, to - burst_end);
        let Some(window) = row(measure, "ms", &|f| f.windows[i]) else { continue };
        if i + 1 < spans.after.len() {
            rows.push(window);
            continue;
        }
        // The target: the last window back at the pre-burst p99, round by round; not met where
        // the producers fell behind the schedule (the pre-burst p99 is then theirs).
        let ratios: Vec<f64> = lockgate.iter().map(|f| f.windows[i] / f.reference).filter(|r| r.is_finite()).collect();
        let held = lockgate.iter().all(|f| f.held);
        let check = Summary::of(&ratios).map(|r| Check {
            value: r.median,
            met: held && r.median <= 1.0,
            shown: if held {
                format!("{:.2}× the pre-burst p99", r.median)
            } else {
                format!("{:.2}×, but the producers fell behind", r.median)
            },
        });
        rows.push(window.target(format!("≤ pre-burst p99 ({} s windows)", args.window_s), check));
    }
    for (i, phase) in phase_names.iter().enumerate() {
        rows.extend(row(format!("backlog median, {phase}"), "jobs", &|f| f.backlog[i][0]));
    }
    rows
}

/// A side's round, as diagnostics: what it sent against the schedule, its backlog's peaks, its
/// windows against the pre-burst p99, and its tables' counters at each phase's end.
fn round_lines(at: &str, args: &BurstArgs, spans: &Spans, run: &Run, f: &Figures) -> Vec<String> {
    let per_phase = |v: [String; 3]| v.join(" / ");
    let lengths = spans.phases.map(|(from, to)| to - from);
    let scheduled = Schedule::of(args).rates();
    let mut lines = vec![format!(
        "{at}: sent {} jobs before / during / after the burst ({} jobs/s, scheduled {}); producers' lag behind the \
         schedule p99 {} ms, max {} ms ({}); backlog peak {} jobs; {} vacuums",
        per_phase(f.sent.map(|n| n.to_string())),
        per_phase([0, 1, 2].map(|i| format!("{:.0}", f.sent[i] as f64 / lengths[i]))),
        per_phase(scheduled.map(|r| format!("{r:.0}"))),
        per_phase(f.lag.map(|l| format!("{:.1}", l[0]))),
        per_phase(f.lag.map(|l| format!("{:.1}", l[1]))),
        if f.held { "they held it" } else { "they fell behind it: the latencies include their queue" },
        per_phase(f.backlog.map(|b| format!("{:.0}", b[1]))),
        run.vacuums
    )];
    let windows: Vec<String> = f.windows.iter().map(|p| format!("{p:.2}")).collect();
    let back_from = (0..f.windows.len()).find(|&i| f.windows[i..].iter().all(|p| *p <= f.reference));
    let verdict = match back_from {
        Some(0) => "at or under it in every window after the burst".to_string(),
        Some(i) => format!("at or under it from {:.0} s after the burst's end on", i as f64 * args.window_s),
        None => "above it in the last window".to_string(),
    };
    lines.push(format!(
        "{at}: pre-burst p99 {:.2} ms (the highest of the last {} windows of {} s before the burst); p99 after the \
         burst, window by window: {} ms; {verdict}",
        f.reference,
        spans.before.len(),
        args.window_s,
        windows.join(", ")
    ));
    lines.extend(counter_lines(at, &run.counters));
    lines
}

/// Per watched table: its dead rows at the start and at each phase's end, and the updates in
/// each phase with their HOT share; tables with neither listed together.
fn counter_lines(at: &str, counters: &[BTreeMap<String, Counters>]) -> Vec<String> {
    let Some(first) = counters.first() else { return Vec::new() };
    let mut lines = Vec::new();
    let mut untouched = Vec::new();
    for name in first.keys() {
        let series: Vec<Counters> = counters.iter().map(|c| c.get(name).copied().unwrap_or_default()).collect();
        if series.iter().all(|c| *c == series[0]) && series[0].dead_rows == 0 {
            untouched.push(name.as_str());
            continue;
        }
        let dead: Vec<String> = series.iter().map(|c| c.dead_rows.to_string()).collect();
        let updates: Vec<String> = series
            .windows(2)
            .map(|w| {
                let phase = w[1].since(&w[0]);
                let hot = phase.hot_percent().map_or("–".to_string(), |p| format!("{p:.1}% HOT"));
                format!("{} ({hot})", phase.updates)
            })
            .collect();
        lines.push(format!(
            "{at} {name}: dead rows at the start and the end of each phase {}; updates per phase {}",
            dead.join(" / "),
            updates.join(" / ")
        ));
    }
    if !untouched.is_empty() {
        lines.push(format!("{at}: no updates and no dead rows in {}", untouched.join(", ")));
    }
    lines
}
