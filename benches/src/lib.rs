//! lockgate-bench: lockgate against a raw-PGMQ baseline, measured side by side in one run, on
//! one PostgreSQL server, so that the ratios hold on a shared, noisy machine (SPEC.md §6).
//!
//! `run` executes a plan (a list of workloads with their sizes): each workload creates its own
//! database (`lg_bench_*`), migrates it with `lockgate::migrate`, runs its rounds and drops it.
//! The result is a [`report::Report`]: a table (median/min/max over rounds, the baseline's
//! median, the ratio, the target) plus diagnostics, also written as JSON by the binary.
//! See docs/benchmarks.md for how to run and read it.

pub mod bench_db;
pub mod drain;
pub mod machine;
pub mod plan;
pub mod probe;
pub mod progress;
pub mod queue;
pub mod report;
pub mod stats;
pub mod tables;
pub mod workloads;

use std::time::Instant;

use anyhow::{Context, Result};
use chrono::Utc;

use crate::machine::Machine;
use crate::plan::{Options, Workload};
use crate::progress::Progress;
use crate::report::{Report, WorkloadReport};
use crate::workloads::{
    burst, churn, depth, drain as drain_workload, enqueue, latency, latency_load, limited, memory, producers, queues,
    runtimes, sweep, workers, Ctx, Outcome,
};

/// Runs every workload of `plan` in order; `command` is recorded in the report as given.
pub async fn run(options: Options, plan: &[Workload], command: String) -> Result<Report> {
    let started_at = Utc::now();
    let machine = Machine::describe(&options.server_url).await.context("describing the machine")?;
    let ctx = Ctx { progress: Progress::new(options.progress), options };
    let mut workloads = Vec::new();
    for workload in plan {
        let started = Instant::now();
        let outcome = run_one(&ctx, workload).await.with_context(|| format!("workload {}", workload.name()))?;
        workloads.push(WorkloadReport {
            name: workload.name().into(),
            params: workload.params(),
            rows: outcome.rows,
            diagnostics: outcome.diagnostics,
            seconds: started.elapsed().as_secs_f64(),
        });
    }
    Ok(Report { command, started_at, finished_at: Utc::now(), rounds: ctx.options.rounds, machine, workloads })
}

async fn run_one(ctx: &Ctx, workload: &Workload) -> Result<Outcome> {
    match workload {
        Workload::Drain(args) => drain_workload::run(ctx, args).await,
        Workload::Enqueue(args) => enqueue::run_single(ctx, args).await,
        Workload::Bulk(args) => enqueue::run_bulk(ctx, args).await,
        Workload::Latency(args) => latency::run(ctx, args).await,
        Workload::LatencyLoad(args) => latency_load::run(ctx, args).await,
        Workload::Producers(args) => producers::run(ctx, args).await,
        Workload::Queues(args) => queues::run(ctx, args).await,
        Workload::Runtimes(args) => runtimes::run(ctx, args).await,
        Workload::Depth(args) => depth::run(ctx, args).await,
        Workload::Workers(args) => workers::run(ctx, args).await,
        Workload::Memory(args) => memory::run(ctx, args).await,
        Workload::Limited(args) => limited::run(ctx, args).await,
        Workload::Sweep(args) => sweep::run(ctx, args).await,
        Workload::Burst(args) => burst::run(ctx, args).await,
        Workload::Churn(args) => churn::run(ctx, args).await,
    }
}
