//! drain: N pre-enqueued no-op jobs, lockgate's runtime at concurrency C against C raw consumers
//! looping `pgmq.read(…, 16)` + `pgmq.archive(ids)`. Target: ≥ 1.0× the baseline (issue 14; issue 5 asked 0.8×).

use anyhow::Result;

use super::{drain_diagnostics, drain_once, order, rates, Ctx, Outcome, Prep, Side, POLL};
use crate::drain::Spec;
use crate::plan::DrainArgs;
use crate::queue;
use crate::report::Row;

pub const LOCKGATE_FUNCTIONS: &[&str] = &["lockgate.claim", "lockgate.complete", "lockgate.extend"];
pub const BASELINE_FUNCTIONS: &[&str] = &["pgmq.read", "pgmq.archive"];

pub async fn run(ctx: &Ctx, args: &DrainArgs) -> Result<Outcome> {
    let db = ctx.create_db("drain").await?;
    let client = queue::setup(&db).await?;
    let spec = Spec { jobs: args.jobs, concurrency: args.concurrency, poll: POLL };
    let consumers = args.baseline_consumers.unwrap_or(args.concurrency);
    let (mut lockgate, mut baseline) = (Vec::new(), Vec::new());
    for round in 0..ctx.options.rounds {
        let label = ctx.label("drain", round);
        for side in order(round) {
            let spec = match side {
                Side::Lockgate => spec,
                Side::Baseline => Spec { concurrency: consumers, ..spec },
            };
            let drained = drain_once(ctx, &db, &client, Prep::Fresh(args.jobs), side, spec, &label).await?;
            match side {
                Side::Lockgate => lockgate.push(drained),
                Side::Baseline => baseline.push(drained),
            }
        }
    }
    db.close().await?;
    let Some(summary) = rates(&lockgate) else { anyhow::bail!("drain ran no rounds") };
    let row = Row::new("drain", format!("{} jobs, concurrency {}", args.jobs, args.concurrency), "jobs/s", summary)
        .baseline(format!("read+archive ×{consumers}"), rates(&baseline));
    // The target compares like with like: as many consumers as lockgate's concurrency.
    let row = if consumers == args.concurrency { row.ratio_target(1.0) } else { row };
    let mut diagnostics = drain_diagnostics("lockgate", &lockgate, LOCKGATE_FUNCTIONS);
    diagnostics.extend(drain_diagnostics("baseline", &baseline, BASELINE_FUNCTIONS));
    Ok(Outcome { rows: vec![row], diagnostics })
}
