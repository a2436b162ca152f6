//! latency-load: latency's probe (one job every `interval_ms`, enqueue → handler start) while
//! the same runtime, on the same queue, drains a steady load of no-op jobs at about half its
//! maximum rate, against the same probe on the idle runtime in the same run (the order
//! alternating from round to round). Target (issue 14): p99 under load ≤ 3× the idle p99.
//!
//! The maximum rate is measured first, once: the runtime (at the probe's concurrency) drains
//! `rate_jobs` pre-enqueued no-op jobs, timed as the drain workload times it. The load is then
//! `load_share` (0.5) of that rate, or `--load-rate` jobs/s when given. A producer of its own
//! enqueues it with `Client::enqueue_many` every 5 ms, as many jobs as are due by then, from
//! before the runtime starts until the probe's last job has started; the probe's warm-up and
//! a 200 ms pause come before its first measured job, so the drain is steady by then.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lockgate::{Client, PgPool};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::latency::{self, RoundResult, PERCENTILES};
use super::{drain_diagnostics, note_drain, Ctx, Outcome, POLL};
use crate::bench_db::{close, BenchDb};
use crate::drain::{self as draining, Spec};
use crate::plan::LatencyLoadArgs;
use crate::queue::{self, Noop, QUEUE};
use crate::report::Row;
use crate::workloads::drain::LOCKGATE_FUNCTIONS;

/// How often the load producer enqueues what is due.
const LOAD_TICK: Duration = Duration::from_millis(5);
/// The most jobs one load call carries (a late tick catches up in several calls).
const LOAD_MAX_CALL: u64 = 1_000;

/// What the load did during one loaded round.
struct Loaded {
    /// Jobs/s the producer enqueued.
    offered: f64,
    /// Jobs/s the runtime archived meanwhile (probe jobs included; they are a few per second).
    completed: f64,
    /// Jobs on the queue when the probe's round ended (the runtime stopped, the load not yet).
    queued_at_end: i64,
}

pub async fn run(ctx: &Ctx, args: &LatencyLoadArgs) -> Result<Outcome> {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if !args.load_rate.map_or(positive(args.load_share), positive) {
        bail!("the load must be positive (--load-rate, --load-share)");
    }
    let db = ctx.create_db("latency_load").await?;
    let client = latency::setup(&db).await?;
    let mut diagnostics = Vec::new();
    let rate = match args.load_rate {
        Some(rate) => {
            diagnostics.push(format!("load set by --load-rate: {rate:.0} jobs/s (no maximum-rate drain)"));
            rate
        }
        None => {
            let label = "latency-load max rate";
            queue::reset(&db).await?;
            queue::fill(&db, &client, args.rate_jobs, &ctx.progress, label).await?;
            let spec = Spec { jobs: args.rate_jobs, concurrency: args.probe.concurrency, poll: POLL };
            let drained = draining::lockgate(&db, spec, &ctx.progress, label).await?;
            note_drain(ctx, label, "lockgate", &drained);
            diagnostics.push(format!(
                "maximum rate, measured first: {:.0} jobs/s ({} jobs, concurrency {}); load = {} × that",
                drained.rate(),
                args.rate_jobs,
                args.probe.concurrency,
                args.load_share
            ));
            diagnostics.extend(drain_diagnostics("max-rate drain", std::slice::from_ref(&drained), LOCKGATE_FUNCTIONS));
            drained.rate() * args.load_share
        }
    };
    let (mut idle, mut loaded, mut loads) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ctx.options.rounds {
        let label = ctx.label("latency-load", round);
        for with_load in [round % 2 != 0, round % 2 == 0] {
            queue::reset(&db).await?;
            if with_load {
                let (r, load) = loaded_round(ctx, &db, args, rate, &label).await?;
                ctx.progress.note(format!(
                    "{label}: under load {} (load {:.0} jobs/s offered, {:.0} completed)",
                    r.line(),
                    load.offered,
                    load.completed
                ));
                loaded.push(r);
                loads.push(load);
            } else {
                let r = latency::lockgate_round(ctx, &db, &args.probe, &label).await?;
                ctx.progress.note(format!("{label}: idle {}", r.line()));
                idle.push(r);
            }
        }
    }
    db.close().await?;
    let mut rows = Vec::new();
    for (i, (name, _, _, _)) in PERCENTILES.iter().enumerate() {
        let Some(summary) = latency::summary(&loaded, i) else { continue };
        let measure = format!("{name} under a load of {rate:.0} jobs/s, 1 probe / {} ms", args.probe.interval_ms);
        let row = Row::new("latency-load", measure, "ms", summary).baseline("idle runtime", latency::summary(&idle, i));
        rows.push(if *name == "p99" { row.max_ratio_target(3.0) } else { row });
    }
    diagnostics
        .push("per round (\"after\" is what came after the enqueue call returned: wake-up, claim, dispatch):".into());
    for (round, (load, (l, i))) in loads.iter().zip(loaded.iter().zip(&idle)).enumerate() {
        diagnostics.push(format!(
            "r{}: load offered {:.0} jobs/s, runtime completed {:.0} jobs/s, {} queued at the round's end; \
             loaded {}; idle {}",
            round + 1,
            load.offered,
            load.completed,
            load.queued_at_end,
            l.parts(),
            i.parts()
        ));
    }
    Ok(Outcome { rows, diagnostics })
}

/// The probe with the load running: the load starts first and stops once the probe is done.
async fn loaded_round(
    ctx: &Ctx,
    db: &BenchDb,
    args: &LatencyLoadArgs,
    rate: f64,
    label: &str,
) -> Result<(RoundResult, Loaded)> {
    let load_pool = db.pool_warm(2, 1).await?;
    let archived0 = archived(db).await?;
    let started = Instant::now();
    let stop = CancellationToken::new();
    let load = tokio::spawn(load(load_pool.clone(), rate, stop.clone()));
    let probed = latency::lockgate_round(ctx, db, &args.probe, label).await;
    let elapsed = started.elapsed().as_secs_f64();
    // Read before the load stops: the runtime has stopped already (the probe's round ends it).
    let counts = match (archived(db).await, queue::queued(db).await) {
        (Ok(a), Ok(q)) => Ok((a, q)),
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    stop.cancel();
    let sent = load.await;
    close(load_pool).await;
    let probe = probed?;
    let sent = sent.context("the load producer panicked")?.context("the load producer failed")?;
    let (archived1, queued_at_end) = counts?;
    let loaded =
        Loaded { offered: sent as f64 / elapsed, completed: (archived1 - archived0) as f64 / elapsed, queued_at_end };
    Ok((probe, loaded))
}

/// Enqueues no-op jobs at `rate` jobs/s until stopped: every tick, as many as are due by then.
/// Returns how many it enqueued.
async fn load(pool: PgPool, rate: f64, stop: CancellationToken) -> Result<u64> {
    let client = Client::new(pool);
    let jobs = vec![Noop {}; LOAD_MAX_CALL as usize];
    let started = Instant::now();
    let mut ticker = tokio::time::interval(LOAD_TICK);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut sent = 0u64;
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(sent),
            _ = ticker.tick() => {}
        }
        let due = (rate * started.elapsed().as_secs_f64()) as u64;
        let n = due.saturating_sub(sent).min(LOAD_MAX_CALL);
        if n > 0 {
            client.enqueue_many(&jobs[..n as usize]).await?;
            sent += n;
        }
    }
}

async fn archived(db: &BenchDb) -> Result<i64> {
    Ok(sqlx::query_scalar(&format!("SELECT count(*) FROM pgmq.a_{QUEUE}")).fetch_one(&db.pool).await?)
}
