//! queues: `queues` (50) queues of `jobs_per_queue` (1,000) no-op jobs each, drained by one
//! runtime whose one worker pool (concurrency 16) lists all of them, against the same runtime
//! draining as many jobs off the one queue `bench`. Target (issue 14): ≥ 0.8× the single-queue
//! drain. For reference, the raw consumers (16, each going round the 50 queues with
//! `pgmq.read(q, 30, 16)` + `pgmq.archive`, leaving out a queue once it reads empty) drain the
//! same 50 queues; that row's ratio is reported, not targeted.
//!
//! Each round runs the three drains, the order rotating from round to round; each starts from
//! freshly filled, vacuumed queues. Drains are timed as the drain workload times them (the
//! database's clock, to the last of the jobs archived over all queues).

use anyhow::{bail, Result};

use super::drain::{BASELINE_FUNCTIONS, LOCKGATE_FUNCTIONS};
use super::{drain_diagnostics, drain_once, first_job_line, note_drain, rates, Ctx, Outcome, Prep, Side, POLL};
use crate::drain::{self as draining, Drained, Layout, Spec};
use crate::plan::QueuesArgs;
use crate::queue;
use crate::report::Row;

/// The three drains of a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drain {
    /// lockgate, one pool serving every queue.
    Many,
    /// lockgate, the same number of jobs on one queue.
    Single,
    /// Raw consumers over every queue.
    Raw,
}

const DRAINS: [Drain; 3] = [Drain::Many, Drain::Single, Drain::Raw];

pub async fn run(ctx: &Ctx, args: &QueuesArgs) -> Result<Outcome> {
    if args.queues == 0 || args.jobs_per_queue == 0 {
        bail!("queues: at least one queue and one job per queue");
    }
    let db = ctx.create_db("queues").await?;
    let client = queue::setup(&db).await?;
    let names = queue::create_queues(&db, args.queues).await?;
    let many = Layout { queues: names.clone(), runtimes: 1 };
    let total = args.jobs_per_queue * args.queues as u64;
    let spec = Spec { jobs: total, concurrency: args.concurrency, poll: POLL };
    let mut runs: [Vec<Drained>; 3] = Default::default();
    for round in 0..ctx.options.rounds {
        let label = ctx.label("queues", round);
        for k in 0..DRAINS.len() {
            let at = (round + k) % DRAINS.len();
            let drained = match DRAINS[at] {
                Drain::Single => {
                    drain_once(ctx, &db, &client, Prep::Fresh(total), Side::Lockgate, spec, &label).await?
                }
                Drain::Many | Drain::Raw => {
                    queue::reset(&db).await?;
                    queue::fill_queues(&db, &client, &names, args.jobs_per_queue, &ctx.progress, &label).await?;
                    let drained = if DRAINS[at] == Drain::Many {
                        draining::lockgate_on(&db, spec, &many, &ctx.progress, &label).await?
                    } else {
                        draining::baseline_on(&db, spec, &many, &ctx.progress, &label).await?
                    };
                    let who = if DRAINS[at] == Drain::Many { "lockgate" } else { "baseline" };
                    note_drain(ctx, &format!("{label} ×{} queues", args.queues), who, &drained);
                    drained
                }
            };
            runs[at].push(drained);
        }
    }
    db.close().await?;
    let [many_runs, single_runs, raw_runs] = &runs;
    let Some(summary) = rates(many_runs) else { bail!("queues ran no rounds") };
    let measure = format!(
        "{total} jobs over {} queues of {}, one pool, concurrency {}",
        args.queues, args.jobs_per_queue, args.concurrency
    );
    let rows = vec![
        Row::new("queues", measure.clone(), "jobs/s", summary.clone())
            .baseline("lockgate, 1 queue", rates(single_runs))
            .ratio_target(0.8),
        Row::new("queues", format!("{measure}, against raw consumers"), "jobs/s", summary)
            .baseline(format!("read+archive ×{} over {} queues", args.concurrency, args.queues), rates(raw_runs)),
    ];
    let mut diagnostics = drain_diagnostics(&format!("{} queues lockgate", args.queues), many_runs, LOCKGATE_FUNCTIONS);
    diagnostics.extend(drain_diagnostics("1 queue lockgate", single_runs, LOCKGATE_FUNCTIONS));
    diagnostics.extend(drain_diagnostics(&format!("{} queues baseline", args.queues), raw_runs, BASELINE_FUNCTIONS));
    diagnostics.extend(first_job_line(&format!("{} queues lockgate", args.queues), many_runs));
    diagnostics.extend(first_job_line("1 queue lockgate", single_runs));
    Ok(Outcome { rows, diagnostics })
}
