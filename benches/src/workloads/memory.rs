//! memory: one runtime drains a large queue (1M jobs) to the end while the harness samples this
//! process's resident memory (the runtime runs in it). One run: it is an observation of
//! flatness, not a rate to compare. Growth is measured from the sample at 10% of the drain (after
//! start-up allocations: pools, buffers, task slabs) to the end. Target: within 16 MiB. The queue
//! table is vacuumed periodically during the drain (see VACUUM_INTERVAL).

use anyhow::{bail, Result};
use tokio_util::sync::CancellationToken;

use super::drain::LOCKGATE_FUNCTIONS;
use super::{drain_diagnostics, drain_once, vacuum_every, Ctx, Outcome, Prep, Side, LARGE_POLL, VACUUM_INTERVAL};
use crate::drain::Spec;
use crate::plan::MemoryArgs;
use crate::queue::{self, QUEUE};
use crate::report::{Check, Row};
use crate::stats::Summary;

/// Memory growth that still counts as flat: allocator noise, not a leak that grows with jobs.
const FLAT_MIB: f64 = 16.0;
pub async fn run(ctx: &Ctx, args: &MemoryArgs) -> Result<Outcome> {
    let db = ctx.create_db("memory").await?;
    let client = queue::setup(&db).await?;
    let spec = Spec { jobs: args.jobs, concurrency: args.concurrency, poll: LARGE_POLL };
    let stop = CancellationToken::new();
    let vacuum = tokio::spawn(vacuum_every(db.pool.clone(), format!("pgmq.q_{QUEUE}"), stop.clone()));
    let drained = drain_once(ctx, &db, &client, Prep::Fresh(args.jobs), Side::Lockgate, spec, "memory").await;
    stop.cancel();
    let vacuums = vacuum.await.unwrap_or(0);
    let drained = drained?;
    db.close().await?;
    let samples = &drained.rss_samples;
    let at = |fraction: f64| samples.iter().find(|(n, _)| *n as f64 >= fraction * args.jobs as f64).or(samples.last());
    let (Some(&(_, from)), Some(&(_, to))) = (at(0.1), samples.last()) else {
        bail!("no memory samples (is /proc/self/status readable?)")
    };
    let mib = |kib: u64| kib as f64 / 1024.0;
    let growth = mib(to) - mib(from);
    let mut outcome = Outcome::default();
    if let (Some(rate), Some(grown)) = (Summary::of(&[drained.rate()]), Summary::of(&[growth])) {
        outcome.rows.push(Row::new("memory", format!("drain rate, {} jobs (1 run)", args.jobs), "jobs/s", rate));
        let check = Check { value: growth, met: growth <= FLAT_MIB, shown: format!("{growth:+.1} MiB") };
        let measure = format!("RSS growth, 10%→100% of {} jobs", args.jobs);
        outcome.rows.push(Row::new("memory", measure, "MiB", grown).target(format!("≤ {FLAT_MIB} MiB"), Some(check)));
    }
    let series: Vec<String> = [0.0, 0.1, 0.25, 0.5, 0.75, 1.0]
        .iter()
        .filter_map(|&f| at(f).map(|&(_, kib)| format!("{:.0}%: {:.1}", f * 100.0, mib(kib))))
        .collect();
    let peak = samples.iter().map(|&(_, kib)| kib).max().unwrap_or(0);
    outcome.diagnostics.push(format!(
        "resident memory (MiB) by progress: {}; peak {:.1}",
        series.join(", "),
        mib(peak)
    ));
    outcome.diagnostics.extend(drain_diagnostics("lockgate", std::slice::from_ref(&drained), LOCKGATE_FUNCTIONS));
    outcome.diagnostics.push(format!(
        "the harness vacuumed the queue table every {VACUUM_INTERVAL:?} during the drain ({vacuums} times), standing in for autovacuum"
    ));
    Ok(outcome)
}
