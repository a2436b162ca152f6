//! workers: the drain rate at each concurrency level (1, 4, 16, 64), lockgate only. Levels are
//! interleaved within each round so drift spreads over all of them. Target: no anti-scaling —
//! every level ≥ 0.9× the best lower level.

use anyhow::Result;

use super::drain::LOCKGATE_FUNCTIONS;
use super::{drain_diagnostics, drain_once, rates, Ctx, Outcome, Prep, Side, POLL};
use crate::drain::{Drained, Spec};
use crate::plan::WorkersArgs;
use crate::queue;
use crate::report::{Check, Row};
use crate::stats::Summary;

pub async fn run(ctx: &Ctx, args: &WorkersArgs) -> Result<Outcome> {
    let db = ctx.create_db("workers").await?;
    let client = queue::setup(&db).await?;
    let mut levels = args.levels.clone();
    levels.sort_unstable();
    levels.dedup();
    let mut runs: Vec<Vec<Drained>> = vec![Vec::new(); levels.len()];
    for round in 0..ctx.options.rounds {
        for (i, &concurrency) in levels.iter().enumerate() {
            let label = format!("{} c={concurrency}", ctx.label("workers", round));
            let spec = Spec { jobs: args.jobs, concurrency, poll: POLL };
            runs[i].push(drain_once(ctx, &db, &client, Prep::Fresh(args.jobs), Side::Lockgate, spec, &label).await?);
        }
    }
    db.close().await?;
    let mut outcome = Outcome::default();
    let mut best: Option<(usize, Summary)> = None;
    for (&concurrency, runs) in levels.iter().zip(&runs) {
        let Some(summary) = rates(runs) else { continue };
        let row =
            Row::new("workers", format!("{} jobs, concurrency {concurrency}", args.jobs), "jobs/s", summary.clone());
        let row = match &best {
            None => row,
            Some((at, reference)) => {
                let row = row.baseline(format!("lockgate c={at}"), Some(reference.clone()));
                let r = row.ratio.unwrap_or(0.0);
                let check = Check { value: r, met: r >= 0.9, shown: format!("{r:.2}× of c={at}") };
                row.target("≥ 0.9× best lower concurrency", Some(check))
            }
        };
        outcome.rows.push(row);
        if best.as_ref().is_none_or(|(_, b)| summary.median > b.median) {
            best = Some((concurrency, summary));
        }
        outcome.diagnostics.extend(drain_diagnostics(&format!("c={concurrency} lockgate"), runs, LOCKGATE_FUNCTIONS));
    }
    Ok(outcome)
}
