//! limited: a drain under concurrency limits, against the unlimited drain of as many jobs in the
//! same run — `jobs` jobs spread over `keys` keys limited to 1 (target ≥ 0.8× unlimited, issue 14; issue 9 asked 0.5×) — and a
//! hot key: `hot_jobs` jobs on one key limited to 10 (reported). Most jobs start parked and run
//! by promotion. After every limited drain the invariant check (`lockgate.check_invariants`) must
//! find nothing: a violation fails the workload, whatever the speed.

use anyhow::{bail, Result};

use super::{drain_diagnostics, rates, Ctx, Outcome, POLL};
use crate::bench_db::BenchDb;
use crate::drain::{self as draining, Drained, Spec};
use crate::plan::LimitedArgs;
use crate::queue::{self, HOT_LIMIT};
use crate::report::Row;
use crate::workloads::drain::LOCKGATE_FUNCTIONS;

/// The drain's functions, and where a limited completion spends its time: releasing leases and
/// promoting parked jobs (`_release_leases`, of which `_promote_keys` picks the jobs and
/// `_send_promotions` sends them through the queue's promotion step), beside the archive itself.
const LIMITED_FUNCTIONS: &[&str] = &[
    "lockgate.claim",
    "lockgate.complete",
    "lockgate.extend",
    "lockgate._complete_into_bench",
    "lockgate._release_leases",
    "lockgate._promote_keys",
    "lockgate._send_promotions",
    "lockgate._promote_into_bench",
];

pub async fn run(ctx: &Ctx, args: &LimitedArgs) -> Result<Outcome> {
    let db = ctx.create_db("limited").await?;
    let client = queue::setup(&db).await?;
    let spec = Spec { jobs: args.jobs, concurrency: args.concurrency, poll: POLL };
    let hot_spec = Spec { jobs: args.hot_jobs, ..spec };
    let (mut unlimited, mut limited, mut hot) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ctx.options.rounds {
        let label = ctx.label("limited", round);
        // Alternate which drain goes first, as the other workloads do.
        for first_unlimited in [round % 2 == 0, round % 2 != 0] {
            queue::reset(&db).await?;
            if first_unlimited {
                queue::fill(&db, &client, args.jobs, &ctx.progress, &label).await?;
                unlimited.push(draining::lockgate(&db, spec, &ctx.progress, &label).await?);
            } else {
                queue::fill_limited(&db, &client, args.jobs, args.keys, &ctx.progress, &label).await?;
                limited.push(checked(&db, draining::lockgate(&db, spec, &ctx.progress, &label).await?).await?);
            }
        }
        queue::reset(&db).await?;
        queue::fill_limited(&db, &client, args.hot_jobs, 0, &ctx.progress, &label).await?;
        hot.push(checked(&db, draining::lockgate(&db, hot_spec, &ctx.progress, &label).await?).await?);
    }
    db.close().await?;
    let (Some(limited_rate), Some(hot_rate)) = (rates(&limited), rates(&hot)) else { bail!("limited ran no rounds") };
    let rows = vec![
        Row::new(
            "limited",
            format!("{} jobs over {} keys limited to 1, concurrency {}", args.jobs, args.keys, args.concurrency),
            "jobs/s",
            limited_rate,
        )
        .baseline("unlimited drain", rates(&unlimited))
        .ratio_target(0.8),
        Row::new(
            "limited",
            format!("{} jobs on one key limited to {HOT_LIMIT}; invariants hold", args.hot_jobs),
            "jobs/s",
            hot_rate,
        ),
    ];
    let mut diagnostics = drain_diagnostics("limited", &limited, LIMITED_FUNCTIONS);
    diagnostics.extend(drain_diagnostics("hot key", &hot, LIMITED_FUNCTIONS));
    diagnostics.extend(drain_diagnostics("unlimited", &unlimited, LOCKGATE_FUNCTIONS));
    Ok(Outcome { rows, diagnostics })
}

/// Runs the sweep and the invariant check after a limited drain; any violation is an error.
async fn checked(db: &BenchDb, drained: Drained) -> Result<Drained> {
    lockgate::sql::sweep(&db.pool, 1000, None).await?;
    let violations = lockgate::sql::check_invariants(&db.pool).await?;
    if !violations.is_empty() {
        bail!("concurrency invariants violated after a limited drain: {violations:?}");
    }
    Ok(drained)
}
