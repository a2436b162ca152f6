//! runtimes: `runtimes` (4) runtimes at concurrency `concurrency` (16) each, each with its own
//! pool of connections, draining `jobs` pre-enqueued no-op jobs off one queue, against one
//! runtime at `runtimes` × `concurrency` (64) draining the same jobs. All in this process, as
//! separate processes would run them but for sharing its threads. Target (issue 14): ≥ 0.9×.
//! Each round runs both, in an order that alternates from round to round; drains are timed as
//! the drain workload times them, from before the runtimes start. Two sizes, a row each: the
//! drain workload's 20,000 jobs, half a second here, of which the four processes' start-up
//! (connections, definitions, registration: 30-40 ms more than one process's) is a tenth; and
//! 100,000 jobs, where the drain itself dominates.

use anyhow::{bail, Result};

use super::drain::LOCKGATE_FUNCTIONS;
use super::{drain_diagnostics, first_job_line, note_drain, order, rates, Ctx, Outcome, Side, POLL};
use crate::bench_db::BenchDb;
use crate::drain::{self as draining, Layout, Spec};
use crate::plan::RuntimesArgs;
use crate::queue;
use crate::report::Row;
use lockgate::Client;

pub async fn run(ctx: &Ctx, args: &RuntimesArgs) -> Result<Outcome> {
    if args.runtimes == 0 || args.concurrency == 0 {
        bail!("runtimes: at least one runtime of concurrency at least 1");
    }
    let db = ctx.create_db("runtimes").await?;
    let client = queue::setup(&db).await?;
    let mut outcome = Outcome::default();
    let sizes = [(args.jobs, "start-up included"), (args.steady_jobs, "steady")];
    for (jobs, what) in sizes.into_iter().filter(|(jobs, _)| *jobs > 0) {
        let sized = run_size(ctx, args, &db, &client, jobs, what).await?;
        outcome.rows.extend(sized.rows);
        outcome.diagnostics.extend(sized.diagnostics);
    }
    db.close().await?;
    Ok(outcome)
}

/// One row: both sides drain `jobs` jobs in every round.
async fn run_size(
    ctx: &Ctx,
    args: &RuntimesArgs,
    db: &BenchDb,
    client: &Client,
    jobs: u64,
    what: &str,
) -> Result<Outcome> {
    let split = Layout { runtimes: args.runtimes, ..Layout::single() };
    let split_spec = Spec { jobs, concurrency: args.concurrency, poll: POLL };
    let whole = args.runtimes * args.concurrency;
    let whole_spec = Spec { concurrency: whole, ..split_spec };
    let (mut many, mut one) = (Vec::new(), Vec::new());
    for round in 0..ctx.options.rounds {
        let label = ctx.label("runtimes", round);
        for side in order(round) {
            queue::reset(db).await?;
            queue::fill(db, client, jobs, &ctx.progress, &label).await?;
            if side == Side::Lockgate {
                let drained = draining::lockgate_on(db, split_spec, &split, &ctx.progress, &label).await?;
                note_drain(ctx, &label, &format!("{} × {}", args.runtimes, args.concurrency), &drained);
                many.push(drained);
            } else {
                let drained = draining::lockgate_on(db, whole_spec, &Layout::single(), &ctx.progress, &label).await?;
                note_drain(ctx, &label, &format!("1 × {whole}"), &drained);
                one.push(drained);
            }
        }
    }
    let Some(summary) = rates(&many) else { bail!("runtimes ran no rounds") };
    let measure = format!("{jobs} jobs ({what}), {} runtimes × concurrency {}", args.runtimes, args.concurrency);
    let row = Row::new("runtimes", measure, "jobs/s", summary)
        .baseline(format!("1 runtime × {whole}"), rates(&one))
        .ratio_target(0.9);
    let (split_who, whole_who) =
        (format!("{jobs} jobs, {} × {}", args.runtimes, args.concurrency), format!("{jobs} jobs, 1 × {whole}"));
    let mut diagnostics = drain_diagnostics(&split_who, &many, LOCKGATE_FUNCTIONS);
    diagnostics.extend(drain_diagnostics(&whole_who, &one, LOCKGATE_FUNCTIONS));
    diagnostics.extend(first_job_line(&split_who, &many));
    diagnostics.extend(first_job_line(&whole_who, &one));
    Ok(Outcome { rows: vec![row], diagnostics })
}
