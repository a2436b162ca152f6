//! The `lockgate-bench` command: `all` runs every workload; each workload also runs alone with
//! its sizes as flags. Prints the results table and writes the same results as JSON.

use std::path::PathBuf;

use anyhow::{anyhow, Result};
use clap::{Parser, Subcommand};
use lockgate_bench::plan::{
    self, BulkArgs, BurstArgs, ChurnArgs, DepthArgs, DrainArgs, EnqueueArgs, LatencyArgs, LatencyLoadArgs, LimitedArgs,
    MemoryArgs, Options, ProducersArgs, QueuesArgs, RuntimesArgs, SweepArgs, WorkersArgs, Workload,
};

#[derive(Debug, Parser)]
#[command(name = "lockgate-bench", about = "lockgate against a raw-PGMQ baseline, side by side on one server")]
struct Cli {
    /// The server to create the bench databases on (lg_bench_*; dropped afterwards).
    #[arg(long, env = "LOCKGATE_BENCH_SERVER_URL", default_value = plan::DEFAULT_SERVER_URL, global = true)]
    server_url: String,
    /// Rounds per measurement (median, min and max are over rounds).
    #[arg(long, default_value_t = plan::DEFAULT_ROUNDS, global = true)]
    rounds: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/lockgate-bench.json", global = true)]
    json: PathBuf,
    /// No progress bars.
    #[arg(long, global = true)]
    no_progress: bool,
    /// Measured pools skip sqlx's ping before each acquire (on by default, as in `lockgate run`).
    #[arg(long, global = true)]
    no_pool_ping: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every workload at the sizes (times --scale), but burst and churn (long; run them alone).
    All {
        /// Multiply every size (jobs, depths, durations) by this; concurrency is never scaled.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Leave these workloads out (comma-separated names, e.g. `--skip memory`).
        #[arg(long, value_delimiter = ',')]
        skip: Vec<String>,
    },
    /// Drain pre-enqueued no-op jobs: the runtime vs raw read+archive consumers.
    Drain(DrainArgs),
    /// Enqueue one job per transaction: Client::enqueue vs pgmq.send.
    Enqueue(EnqueueArgs),
    /// Enqueue in batches of each size: Client::enqueue_many vs pgmq.send_batch.
    Bulk(BulkArgs),
    /// Concurrent producers, one job per transaction each: Client::enqueue vs pgmq.send.
    Producers(ProducersArgs),
    /// Enqueue → handler start with an idle runtime, vs a raw consumer on LISTEN.
    Latency(LatencyArgs),
    /// Enqueue → handler start while the runtime drains a steady load, vs the idle runtime.
    LatencyLoad(LatencyLoadArgs),
    /// 50 queues drained by one pool vs the same jobs on one queue.
    Queues(QueuesArgs),
    /// 4 runtimes × concurrency 16 on one queue vs 1 runtime × 64.
    Runtimes(RuntimesArgs),
    /// Drain rate as the queue's depth grows.
    Depth(DepthArgs),
    /// Drain rate as concurrency grows.
    Workers(WorkersArgs),
    /// Resident memory while the runtime drains a large queue.
    Memory(MemoryArgs),
    /// Drain with concurrency limits: 1,000 keys limited to 1 vs unlimited; a hot key limited to 10.
    Limited(LimitedArgs),
    /// One concurrency-sweep pass over a big parked backlog, and idle-key reclamation.
    Sweep(SweepArgs),
    /// Steady load, a burst at 1.5× and the recovery: latency per phase vs raw PGMQ on the same schedule.
    Burst(BurstArgs),
    /// Table and index sizes after repeated big drains, each vacuumed, vs a plain PGMQ queue.
    Churn(ChurnArgs),
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    if cli.rounds == 0 {
        return Err(anyhow!("--rounds must be at least 1"));
    }
    let plan = match cli.command {
        Command::All { scale, .. } if scale <= 0.0 => return Err(anyhow!("--scale must be positive")),
        Command::All { scale, skip } => {
            let mut all = plan::all(scale);
            if let Some(unknown) = skip.iter().find(|name| !all.iter().any(|w| w.name() == name.as_str())) {
                return Err(anyhow!("--skip {unknown}: not a workload"));
            }
            all.retain(|w| !skip.iter().any(|name| name == w.name()));
            all
        }
        Command::Drain(a) => vec![Workload::Drain(a)],
        Command::Enqueue(a) => vec![Workload::Enqueue(a)],
        Command::Bulk(a) => vec![Workload::Bulk(a)],
        Command::Latency(a) => vec![Workload::Latency(a)],
        Command::LatencyLoad(a) => vec![Workload::LatencyLoad(a)],
        Command::Producers(a) => vec![Workload::Producers(a)],
        Command::Queues(a) => vec![Workload::Queues(a)],
        Command::Runtimes(a) => vec![Workload::Runtimes(a)],
        Command::Depth(a) => vec![Workload::Depth(a)],
        Command::Workers(a) => vec![Workload::Workers(a)],
        Command::Memory(a) => vec![Workload::Memory(a)],
        Command::Limited(a) => vec![Workload::Limited(a)],
        Command::Sweep(a) => vec![Workload::Sweep(a)],
        Command::Burst(a) => vec![Workload::Burst(a)],
        Command::Churn(a) => vec![Workload::Churn(a)],
    };
    let options = Options {
        server_url: cli.server_url,
        rounds: cli.rounds,
        progress: !cli.no_progress,
        pool_ping: !cli.no_pool_ping,
    };
    let command = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
    // Ctrl-C drops the running workload: its database is dropped on the way out (BenchDb's Drop).
    let report = tokio::select! {
        report = lockgate_bench::run(options, &plan, command) => report?,
        _ = tokio::signal::ctrl_c() => return Err(anyhow!("interrupted; the bench databases were dropped")),
    };
    println!("{}", report.table());
    report.write_json(&cli.json)?;
    eprintln!("results written to {}", cli.json.display());
    Ok(())
}
