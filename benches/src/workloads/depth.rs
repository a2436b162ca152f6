//! depth: the drain rate of a `window` of jobs taken off the top of a queue that holds each
//! depth (10k, 100k, 1M). Before every drain the queue is topped up to the depth, the archive
//! emptied and the table vacuumed, so each measurement starts from the same state. The raw
//! consumers drain the same window at the same depth for reference. Target: the rate at the
//! largest depth ≥ 0.8× the rate at the smallest.

use anyhow::{bail, Result};

use super::drain::{BASELINE_FUNCTIONS, LOCKGATE_FUNCTIONS};
use super::{drain_diagnostics, drain_once, order, rates, Ctx, Outcome, Prep, Side, POLL};
use crate::drain::{Drained, Spec};
use crate::plan::DepthArgs;
use crate::queue;
use crate::report::{Check, Row};

pub async fn run(ctx: &Ctx, args: &DepthArgs) -> Result<Outcome> {
    let mut depths = args.depths.clone();
    depths.sort_unstable();
    depths.dedup();
    if depths.first().is_some_and(|&d| d < args.window) {
        bail!("the window ({}) must not exceed the smallest depth ({:?})", args.window, depths.first());
    }
    let db = ctx.create_db("depth").await?;
    let client = queue::setup(&db).await?;
    let spec = Spec { jobs: args.window, concurrency: args.concurrency, poll: POLL };
    let mut outcome = Outcome::default();
    let mut smallest: Option<(u64, f64)> = None;
    for &depth in &depths {
        queue::reset(&db).await?;
        let (mut lockgate, mut baseline) = (Vec::<Drained>::new(), Vec::<Drained>::new());
        for round in 0..ctx.options.rounds {
            let label = format!("{} @{depth}", ctx.label("depth", round));
            for side in order(round) {
                let drained = drain_once(ctx, &db, &client, Prep::TopUp(depth), side, spec, &label).await?;
                match side {
                    Side::Lockgate => lockgate.push(drained),
                    Side::Baseline => baseline.push(drained),
                }
            }
        }
        let Some(summary) = rates(&lockgate) else { bail!("depth ran no rounds") };
        let measure = format!("{} of {depth} queued, concurrency {}", args.window, args.concurrency);
        let row = Row::new("depth", measure, "jobs/s", summary)
            .baseline(format!("read+archive ×{}", args.concurrency), rates(&baseline));
        let median = row.lockgate.median;
        outcome.rows.push(match smallest {
            None => {
                smallest = Some((depth, median));
                row
            }
            Some((at, reference)) => {
                let r = median / reference;
                let check = Check { value: r, met: r >= 0.8, shown: format!("{r:.2}× of @{at}") };
                row.target(format!("≥ 0.8× rate @{at}"), Some(check))
            }
        });
        let who = format!("@{depth} lockgate");
        outcome.diagnostics.extend(drain_diagnostics(&who, &lockgate, LOCKGATE_FUNCTIONS));
        outcome.diagnostics.extend(drain_diagnostics(&format!("@{depth} baseline"), &baseline, BASELINE_FUNCTIONS));
    }
    db.close().await?;
    Ok(outcome)
}
