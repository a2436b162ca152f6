//! churn: what big drains leave in the tables (issue 14). A side fills its queue with `jobs` no-op
//! jobs (`Client::enqueue_many`, calls of `batch`), drains them with one runtime at
//! `concurrency`, VACUUMs, and records the sizes of the queue table (heap and each index), of
//! the archive, and of the lockgate tables the claim, heartbeat and completion paths write
//! (`tables::LOCKGATE_TABLES`); then again on the same tables, `repeats` times in all. Also
//! recorded: the share of the queue table's updates during each drain that were HOT (heap-only
//! tuples: no index entry written). A vacuumed queue should give its space back for the next
//! fill to reuse; sizes that climb from one drain to the next would be bloat that grows with
//! every big drain.
//!
//! The baseline, in the same rounds (the order alternating): a plain PGMQ queue (`raw`: PGMQ's
//! own indexes, no lockgate headers) filled with `pgmq.send_batch` calls of `batch` and drained
//! by `concurrency` raw consumers looping `pgmq.read(raw, 30, 16)` + `pgmq.archive` (drain.rs),
//! with the same figures for its tables.
//!
//! Each side starts from emptied (TRUNCATEd) tables. The archive grows by design, a row per job:
//! its size after each drain is reported, then it is emptied (TRUNCATE) before the next fill,
//! since drains count their completions there. The server runs with autovacuum off, so the
//! harness vacuums the queue table during each drain as autovacuum would (`VACUUM_INTERVAL`), and
//! every fill ends with VACUUM ANALYZE, as in every drain workload. No target: the issue asks
//! what happens.

use anyhow::{bail, Result};
use lockgate::Client;
use tokio_util::sync::CancellationToken;

use super::drain::{BASELINE_FUNCTIONS, LOCKGATE_FUNCTIONS};
use super::{drain_diagnostics, note_drain, order, vacuum_every, Ctx, Outcome, Side, LARGE_POLL};
use crate::bench_db::BenchDb;
use crate::drain::{self as draining, Drained, Layout, Spec};
use crate::plan::ChurnArgs;
use crate::queue::{self, QUEUE, RAW_QUEUE};
use crate::report::Row;
use crate::stats::Summary;
use crate::tables::{self, kib, Counters, Sizes, LOCKGATE_TABLES};

/// What one fill, drain and VACUUM left.
struct Repeat {
    drained: Drained,
    /// The queue table full, before the drain (after the fill's VACUUM ANALYZE).
    full: Sizes,
    /// The queue table drained and vacuumed.
    after: Sizes,
    archive: Sizes,
    /// The queue table's updates during the drain.
    updates: Counters,
    /// Each lockgate table's total size after the VACUUM (the lockgate side's only).
    lockgate_tables: Vec<(&'static str, i64)>,
    vacuums: u32,
}

pub async fn run(ctx: &Ctx, args: &ChurnArgs) -> Result<Outcome> {
    if args.jobs == 0 || args.batch == 0 || args.repeats == 0 {
        bail!("churn needs jobs, batch and repeats above 0 (got {args:?})");
    }
    let db = ctx.create_db("churn").await?;
    let client = queue::setup(&db).await?;
    let (mut lockgate, mut baseline) = (Vec::new(), Vec::new());
    for round in 0..ctx.options.rounds {
        for side in order(round) {
            queue::reset(&db).await?;
            let mut repeats = Vec::new();
            for r in 0..args.repeats {
                let label = format!("{} drain {}/{}", ctx.label("churn", round), r + 1, args.repeats);
                repeats.push(repeat(ctx, &db, &client, args, side, &label).await?);
            }
            match side {
                Side::Lockgate => lockgate.push(repeats),
                Side::Baseline => baseline.push(repeats),
            }
        }
    }
    db.close().await?;
    Ok(Outcome { rows: rows(args, &lockgate, &baseline), diagnostics: diagnostics(&lockgate, &baseline) })
}

/// Empties the side's archive, fills its queue, drains it (vacuuming meanwhile), vacuums, measures.
async fn repeat(ctx: &Ctx, db: &BenchDb, client: &Client, args: &ChurnArgs, side: Side, label: &str) -> Result<Repeat> {
    let queue = if side == Side::Lockgate { QUEUE } else { RAW_QUEUE };
    let (table, archive) = (format!("pgmq.q_{queue}"), format!("pgmq.a_{queue}"));
    sqlx::raw_sql(&format!("TRUNCATE {archive}")).execute(&db.pool).await?;
    let per_call = usize::try_from(args.batch)?;
    match side {
        Side::Lockgate => queue::fill_in_calls(db, client, args.jobs, per_call, &ctx.progress, label).await?,
        Side::Baseline => queue::fill_raw(db, args.jobs, per_call, &ctx.progress, label).await?,
    }
    let full = tables::sizes(&db.pool, &table).await?;
    let before = table_counters(db, &table).await?;
    let spec = Spec { jobs: args.jobs, concurrency: args.concurrency, poll: LARGE_POLL };
    let stop = CancellationToken::new();
    let vacuum = tokio::spawn(vacuum_every(db.pool.clone(), table.clone(), stop.clone()));
    let drained = match side {
        Side::Lockgate => draining::lockgate(db, spec, &ctx.progress, label).await,
        Side::Baseline => {
            let layout = Layout { queues: vec![RAW_QUEUE.to_string()], runtimes: 1 };
            draining::baseline_on(db, spec, &layout, &ctx.progress, label).await
        }
    };
    stop.cancel();
    let vacuums = vacuum.await.unwrap_or(0);
    let drained = drained?;
    note_drain(ctx, label, who(side), &drained);
    // A drain returns once its sessions are gone, so their counters are all in the view.
    let updates = table_counters(db, &table).await?.since(&before);
    let mut vacuumed = vec![table.as_str(), archive.as_str()];
    if side == Side::Lockgate {
        vacuumed.extend(LOCKGATE_TABLES);
    }
    sqlx::raw_sql(&format!("VACUUM {}", vacuumed.join(", "))).execute(&db.pool).await?;
    let mut lockgate_tables = Vec::new();
    if side == Side::Lockgate {
        for name in LOCKGATE_TABLES {
            lockgate_tables.push((name, tables::sizes(&db.pool, name).await?.total));
        }
    }
    Ok(Repeat {
        drained,
        full,
        after: tables::sizes(&db.pool, &table).await?,
        archive: tables::sizes(&db.pool, &archive).await?,
        updates,
        lockgate_tables,
        vacuums,
    })
}

async fn table_counters(db: &BenchDb, table: &str) -> Result<Counters> {
    Ok(tables::counters(&db.pool, &[table]).await?.remove(table).unwrap_or_default())
}

fn who(side: Side) -> &'static str {
    if side == Side::Lockgate {
        "lockgate"
    } else {
        "baseline"
    }
}

/// A figure of every round, in KiB.
fn kib_per_round(rounds: &[Vec<Repeat>], bytes: impl Fn(&[Repeat]) -> Option<i64>) -> Option<Summary> {
    Summary::of(&rounds.iter().filter_map(|r| bytes(r)).map(|b| b as f64 / 1024.0).collect::<Vec<_>>())
}

/// The HOT share of every round's updates of the queue table, all its drains together.
fn hot_per_round(rounds: &[Vec<Repeat>]) -> Option<Summary> {
    let shares = rounds.iter().filter_map(|repeats| {
        let (updates, hot) =
            repeats.iter().fold((0, 0), |(u, h), r| (u + r.updates.updates, h + r.updates.hot_updates));
        Counters { dead_rows: 0, updates, hot_updates: hot }.hot_percent()
    });
    Summary::of(&shares.collect::<Vec<_>>())
}

fn rows(args: &ChurnArgs, lockgate: &[Vec<Repeat>], baseline: &[Vec<Repeat>]) -> Vec<Row> {
    // A round's rate is the median of its drains'.
    let rate_per_round = |rounds: &[Vec<Repeat>]| {
        let medians = rounds.iter().filter_map(|repeats| {
            Summary::of(&repeats.iter().map(|r| r.drained.rate()).collect::<Vec<_>>()).map(|s| s.median)
        });
        Summary::of(&medians.collect::<Vec<_>>())
    };
    let raw = "plain PGMQ queue";
    let mut rows = Vec::new();
    let measure =
        format!("drain rate, {} jobs, concurrency {} (median of {} drains)", args.jobs, args.concurrency, args.repeats);
    if let Some(rate) = rate_per_round(lockgate) {
        rows.push(
            Row::new("churn", measure, "jobs/s", rate)
                .baseline(format!("read+archive ×{}", args.concurrency), rate_per_round(baseline)),
        );
    }
    let last = args.repeats;
    let mut after = vec![(1, 0)];
    if last > 1 {
        after.push((last, last - 1));
    }
    for (n, i) in after {
        let total = |repeats: &[Repeat]| repeats.get(i).map(|r| r.after.total);
        if let Some(size) = kib_per_round(lockgate, total) {
            let measure = format!("queue table with its indexes after drain {n} of {last} + VACUUM");
            rows.push(Row::new("churn", measure, "KiB", size).baseline(raw, kib_per_round(baseline, total)));
        }
    }
    if let Some(hot) = hot_per_round(lockgate) {
        let measure = "HOT share of the queue table's updates during the drains";
        rows.push(Row::new("churn", measure, "%", hot).baseline(raw, hot_per_round(baseline)));
    }
    let archive = |repeats: &[Repeat]| repeats.last().map(|r| r.archive.total);
    if let Some(size) = kib_per_round(lockgate, archive) {
        let measure = format!("archive after a drain of {} jobs (emptied before each fill)", args.jobs);
        rows.push(Row::new("churn", measure, "KiB", size).baseline(raw, kib_per_round(baseline, archive)));
    }
    let lockgate_tables = |repeats: &[Repeat]| repeats.last().map(|r| r.lockgate_tables.iter().map(|(_, b)| b).sum());
    if let Some(size) = kib_per_round(lockgate, lockgate_tables) {
        let measure = format!("the {} lockgate tables after drain {last} + VACUUM", LOCKGATE_TABLES.len());
        rows.push(Row::new("churn", measure, "KiB", size));
    }
    rows
}

fn diagnostics(lockgate: &[Vec<Repeat>], baseline: &[Vec<Repeat>]) -> Vec<String> {
    let mut lines = Vec::new();
    for (side, rounds) in [(Side::Lockgate, lockgate), (Side::Baseline, baseline)] {
        for (round, repeats) in rounds.iter().enumerate() {
            let at = format!("r{} {}", round + 1, who(side));
            for (n, r) in repeats.iter().enumerate() {
                lines.push(format!(
                    "{at} drain {}: {:.0} jobs/s, {} vacuums meanwhile; {} updates of the queue table, {:.1}% HOT; \
                     full: {}; drained + VACUUM: {}; archive {} KiB",
                    n + 1,
                    r.drained.rate(),
                    r.vacuums,
                    r.updates.updates,
                    r.updates.hot_percent().unwrap_or(0.0),
                    r.full.describe(),
                    r.after.describe(),
                    kib(r.archive.total)
                ));
            }
            lines.push(format!("{at}: {}", growth(repeats)));
            if let Some(last) = repeats.last().filter(|r| !r.lockgate_tables.is_empty()) {
                let sizes: Vec<String> =
                    last.lockgate_tables.iter().map(|(name, bytes)| format!("{name} {}", kib(*bytes))).collect();
                lines.push(format!("{at} lockgate tables after the last drain + VACUUM (KiB): {}", sizes.join(", ")));
            }
        }
    }
    let drains = |rounds: &[Vec<Repeat>]| rounds.iter().flatten().map(|r| r.drained.clone()).collect::<Vec<_>>();
    lines.extend(drain_diagnostics("lockgate", &drains(lockgate), LOCKGATE_FUNCTIONS));
    lines.extend(drain_diagnostics("baseline", &drains(baseline), BASELINE_FUNCTIONS));
    lines
}

/// "queue table after each drain + VACUUM (KiB): 2,232, 2,232, 2,240; +8 KiB (+0.4%) from the
/// first to the last"
fn growth(repeats: &[Repeat]) -> String {
    let totals: Vec<String> = repeats.iter().map(|r| kib(r.after.total)).collect();
    let line = format!("queue table after each drain + VACUUM (KiB): {}", totals.join(", "));
    match (repeats.first(), repeats.last()) {
        (Some(first), Some(last)) if repeats.len() > 1 && first.after.total > 0 => {
            let grown = last.after.total - first.after.total;
            let percent = 100.0 * grown as f64 / first.after.total as f64;
            let sign = if grown < 0 { "-" } else { "+" };
            format!("{line}; {sign}{} KiB ({percent:+.1}%) from the first to the last", kib(grown.abs()))
        }
        _ => line,
    }
}
