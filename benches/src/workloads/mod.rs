//! The workloads. Each creates its own database, runs its rounds, drops the database and
//! returns its rows. Where lockgate and the baseline both run, each round runs both, in an order
//! that alternates from round to round so that drift on a shared machine hits both sides alike.

pub mod burst;
pub mod churn;
pub mod depth;
pub mod drain;
pub mod enqueue;
pub mod latency;
pub mod latency_load;
pub mod limited;
pub mod memory;
pub mod producers;
pub mod queues;
pub mod runtimes;
pub mod sweep;
pub mod workers;

use std::time::Duration;

use anyhow::Result;
use lockgate::{Client, PgPool};
use tokio_util::sync::CancellationToken;

use crate::bench_db::BenchDb;
use crate::drain::{self as draining, Drained, Spec};
use crate::plan::Options;
use crate::probe::FunctionStats;
use crate::progress::Progress;
use crate::queue;
use crate::report::Row;
use crate::stats::Summary;

/// How often drains poll the archive count: fine enough for a live bar and memory samples,
/// coarse enough to cost the server little (timing itself comes from `archived_at`).
pub const POLL: Duration = Duration::from_millis(20);
/// How often drains of a million jobs poll: counting a growing million-row archive costs the
/// server tens of milliseconds, and once a second is plenty for memory samples and for knowing
/// when to stop.
pub const LARGE_POLL: Duration = Duration::from_secs(1);

/// The test server runs with autovacuum off. Without vacuum, a long drain leaves its dead rows at
/// the head of the queue's indexes and every claim steps over all of them, so the drain slows
/// as it goes (for lockgate and `pgmq.read` alike); workloads that run long vacuum instead, about
/// as often as autovacuum would visit a table losing thousands of rows a second.
pub const VACUUM_INTERVAL: Duration = Duration::from_secs(15);

/// What a workload returns: its table rows, and what limits it (statement counts per job,
/// server time, client CPU, memory) as lines for the report.
#[derive(Debug, Default)]
pub struct Outcome {
    pub rows: Vec<Row>,
    pub diagnostics: Vec<String>,
}

/// What every workload gets.
pub struct Ctx {
    pub options: Options,
    pub progress: Progress,
}

impl Ctx {
    pub async fn create_db(&self, workload: &str) -> Result<BenchDb> {
        let spinner = self.progress.spinner(format!("{workload}: creating and migrating a database"));
        let db = BenchDb::create(&self.options.server_url, workload, self.options.pool_ping).await;
        spinner.finish_and_clear();
        db
    }

    pub fn label(&self, workload: &str, round: usize) -> String {
        format!("{workload} r{}/{}", round + 1, self.options.rounds)
    }
}

/// Which side runs first in `round`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Lockgate,
    Baseline,
}

pub fn order(round: usize) -> [Side; 2] {
    if round % 2 == 0 {
        [Side::Lockgate, Side::Baseline]
    } else {
        [Side::Baseline, Side::Lockgate]
    }
}

/// How the queue is prepared before a drain.
#[derive(Debug, Clone, Copy)]
pub enum Prep {
    /// Empty everything, then enqueue this many.
    Fresh(u64),
    /// Empty the archive and top the queue up to this many ready jobs.
    TopUp(u64),
}

/// Prepares the queue, then drains it with `side`.
pub async fn drain_once(
    ctx: &Ctx,
    db: &BenchDb,
    client: &Client,
    prep: Prep,
    side: Side,
    spec: Spec,
    label: &str,
) -> Result<Drained> {
    match prep {
        Prep::Fresh(n) => {
            queue::reset(db).await?;
            queue::fill(db, client, n, &ctx.progress, label).await?;
        }
        Prep::TopUp(n) => {
            queue::clear_archive(db).await?;
            let have = u64::try_from(queue::queued(db).await?).unwrap_or(0);
            if have < n {
                queue::fill(db, client, n - have, &ctx.progress, label).await?;
            } else {
                queue::vacuum(db).await?;
            }
        }
    }
    let drained = match side {
        Side::Lockgate => draining::lockgate(db, spec, &ctx.progress, label).await?,
        Side::Baseline => draining::baseline(db, spec, &ctx.progress, label).await?,
    };
    note_drain(ctx, label, if side == Side::Lockgate { "lockgate" } else { "baseline" }, &drained);
    Ok(drained)
}

/// The progress line of a finished drain.
pub fn note_drain(ctx: &Ctx, label: &str, who: &str, drained: &Drained) {
    ctx.progress.note(format!(
        "{label}: {who} {:.0} jobs/s ({} jobs in {:.2} s)",
        drained.rate(),
        drained.jobs,
        drained.seconds
    ));
}

pub fn rates(runs: &[Drained]) -> Option<Summary> {
    Summary::of(&runs.iter().map(Drained::rate).collect::<Vec<_>>())
}

/// How long the drains took to archive their first job (the runtimes' start-up and first
/// claim), median of rounds, against the whole drain's median.
pub fn first_job_line(who: &str, runs: &[Drained]) -> Option<String> {
    let first = Summary::of(&runs.iter().map(|r| r.first_seconds * 1000.0).collect::<Vec<_>>())?;
    let whole = Summary::of(&runs.iter().map(|r| r.seconds * 1000.0).collect::<Vec<_>>())?;
    Some(format!(
        "{who} first job archived {:.0} ms after the start, of {:.0} ms for the whole drain (medians of rounds)",
        first.median, whole.median
    ))
}

/// Diagnostic lines for a set of drains: statement counts and server time per job (all rounds
/// summed), and the client's CPU per job.
pub fn drain_diagnostics(who: &str, runs: &[Drained], functions: &[&str]) -> Vec<String> {
    let jobs: f64 = runs.iter().map(|r| r.jobs as f64).sum();
    let mut total = FunctionStats::default();
    runs.iter().for_each(|run| total.add(&run.functions));
    let mut lines: Vec<String> = total.describe(functions, jobs).into_iter().map(|l| format!("{who} {l}")).collect();
    let cpu: Option<f64> = runs.iter().map(|r| r.cpu_seconds).sum();
    let busy = Summary::of(&runs.iter().filter_map(|r| r.machine_busy_percent).collect::<Vec<_>>());
    if let (Some(cpu), Some(busy)) = (cpu, busy) {
        lines.push(format!(
            "{who} client CPU {:.1} µs/job (this process); machine CPU busy {:.0}% (median of rounds, all processes)",
            cpu * 1e6 / jobs,
            busy.median
        ));
    }
    lines
}

/// Vacuums `table` every `VACUUM_INTERVAL` until `stop`; returns how many times it did.
pub async fn vacuum_every(db: PgPool, table: String, stop: CancellationToken) -> u32 {
    let mut done = 0;
    loop {
        tokio::select! {
            () = stop.cancelled() => return done,
            () = tokio::time::sleep(VACUUM_INTERVAL) => {}
        }
        if sqlx::raw_sql(&format!("VACUUM {table}")).execute(&db).await.is_ok() {
            done += 1;
        }
    }
}
