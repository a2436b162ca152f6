//! What to run: one value per workload with its sizes (the command line's flags), and the run's
//! options. Defaults are the sizes the benchmark issue specifies; `all --scale` shrinks them all
//! at once for a quicker run (concurrency levels are never scaled).

use std::time::Duration;

use clap::Args;
use serde::Serialize;

/// The server the harness creates its databases on, unless `--server-url` or
/// `LOCKGATE_BENCH_SERVER_URL` says otherwise.
/// Plain TCP, as in earlier runs: a TLS handshake and encryption would weigh on both sides alike
/// but make figures incomparable with those of earlier sessions (docs/benchmarks.md).
pub const DEFAULT_SERVER_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable";
/// Three rounds is the fewest that give a median with a min and a max around it.
pub const DEFAULT_ROUNDS: usize = 3;

// The sizes. Each is both a flag's default and what `all` runs at scale 1.
pub const DRAIN_JOBS: u64 = 20_000;
pub const DRAIN_CONCURRENCY: usize = 16;
pub const ENQUEUE_JOBS: u64 = 10_000;
/// Jobs per batch size: 100 calls of 1,000, or 1,000 calls of 100.
pub const BULK_JOBS: u64 = 100_000;
pub const BULK_BATCHES: [u64; 2] = [100, 1_000];
pub const LATENCY_INTERVAL_MS: u64 = 20;
pub const LATENCY_DURATION_S: f64 = 10.0;
/// lockgate's own default pool concurrency (DEFAULT_CONCURRENCY): the worker a user starts.
pub const LATENCY_CONCURRENCY: usize = 10;
pub const DEPTHS: [u64; 3] = [10_000, 100_000, 1_000_000];
/// Drained off the top of the queue at every depth: the smallest depth, so every depth is
/// measured over the same number of jobs.
pub const DEPTH_WINDOW: u64 = 10_000;
/// The issue gives no size for workers; 5,000 keeps concurrency 1 (the slowest) under ~15 s a round.
pub const WORKERS_JOBS: u64 = 5_000;
pub const WORKERS_LEVELS: [usize; 4] = [1, 4, 16, 64];
pub const MEMORY_JOBS: u64 = 1_000_000;
pub const LIMITED_JOBS: u64 = 20_000;
pub const LIMITED_KEYS: u64 = 1_000;
pub const HOT_JOBS: u64 = 5_000;
pub const SWEEP_PARKED: u64 = 1_000_000;
pub const SWEEP_KEYS: u64 = 100_000;
pub const SWEEP_PROMOTABLE: u64 = 10;
pub const IDLE_KEYS: u64 = 1_000_000;
/// The drain whose rate sets latency-load's load (half of it): the drain workload's size.
pub const LOAD_RATE_JOBS: u64 = DRAIN_JOBS;
pub const LOAD_SHARE: f64 = 0.5;
/// 16 concurrent producers, as the issue specifies; 10,000 jobs in all (625 each), as many as
/// the single-enqueue workload's, keeps lockgate's side under 30 s a round where its notifying
/// commits queue up one behind another (about 375 jobs/s on a loaded 2-core machine).
pub const PRODUCERS: usize = 16;
pub const PRODUCERS_JOBS: u64 = 10_000;
pub const QUEUES: usize = 50;
pub const QUEUE_JOBS: u64 = 1_000;
pub const RUNTIMES: usize = 4;
pub const RUNTIMES_JOBS: u64 = DRAIN_JOBS;
/// runtimes' second size: long enough (about 2.5 s a drain here) that the four processes'
/// start-up, 30-40 ms more than one process's, weighs little against their drain.
pub const RUNTIMES_STEADY_JOBS: u64 = 100_000;
/// burst: the steady rate, 1.5× that for a minute, a minute to recover, 30 s to warm up.
pub const BURST_RATE: f64 = 800.0;
pub const BURST_FACTOR: f64 = 1.5;
pub const BURST_WARMUP_S: f64 = 30.0;
pub const BURST_S: f64 = 60.0;
pub const BURST_RECOVERY_S: f64 = 60.0;
/// The recovery is read off the p99 of windows this long.
pub const BURST_WINDOW_S: f64 = 10.0;
pub const BURST_HANDLER_MS: u64 = 1;
/// Enough producers that the schedule holds at 1,200 jobs/s while each call waits its turn for
/// the notifying commit (design §1): every producer then has 6.7 ms per job.
pub const BURST_PRODUCERS: usize = 8;
pub const CHURN_JOBS: u64 = 1_000_000;
pub const CHURN_BATCH: u64 = 1_000;
pub const CHURN_REPEATS: usize = 3;

/// Run-wide options.
#[derive(Debug, Clone)]
pub struct Options {
    pub server_url: String,
    pub rounds: usize,
    /// Draw progress bars (they also hide themselves when stderr is not a terminal).
    pub progress: bool,
    /// Measured pools ping each connection before handing it out (sqlx's default, and what
    /// `lockgate run` does). Off shows what that extra round trip per statement costs.
    pub pool_ping: bool,
}

/// drain: pre-enqueued no-op jobs, lockgate's runtime against N raw read+archive consumers.
#[derive(Debug, Clone, Args, Serialize)]
pub struct DrainArgs {
    #[arg(long, default_value_t = DRAIN_JOBS)]
    pub jobs: u64,
    #[arg(long, default_value_t = DRAIN_CONCURRENCY)]
    pub concurrency: usize,
    /// Baseline consumers, when not `concurrency` (a diagnostic: the target then does not apply).
    #[arg(long)]
    pub baseline_consumers: Option<usize>,
}

/// enqueue: one job per transaction from one producer, against `pgmq.send`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct EnqueueArgs {
    #[arg(long, default_value_t = ENQUEUE_JOBS)]
    pub jobs: u64,
}

/// bulk: `jobs` jobs in calls of each batch size, against `pgmq.send_batch`; a row per size.
#[derive(Debug, Clone, Args, Serialize)]
pub struct BulkArgs {
    /// Jobs per batch size and producer, per round.
    #[arg(long, default_value_t = BULK_JOBS)]
    pub jobs: u64,
    /// Jobs per call (comma-separated sizes).
    #[arg(long, alias = "batch", value_delimiter = ',', default_values_t = BULK_BATCHES)]
    pub batches: Vec<u64>,
}

/// latency: an idle runtime, one job every `interval_ms` for `duration_s`; enqueue → handler start.
#[derive(Debug, Clone, Args, Serialize)]
pub struct LatencyArgs {
    #[arg(long, default_value_t = LATENCY_INTERVAL_MS)]
    pub interval_ms: u64,
    #[arg(long, default_value_t = LATENCY_DURATION_S)]
    pub duration_s: f64,
    #[arg(long, default_value_t = LATENCY_CONCURRENCY)]
    pub concurrency: usize,
}

/// latency-load: the latency probe while the runtime also drains no-op jobs arriving at a steady
/// rate, against the same probe on the idle runtime in the same run.
#[derive(Debug, Clone, Args, Serialize)]
pub struct LatencyLoadArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub probe: LatencyArgs,
    /// The load, in no-op jobs per second. Default: `load_share` × the rate at which the
    /// runtime drains `rate_jobs` jobs, measured first.
    #[arg(long)]
    pub load_rate: Option<f64>,
    #[arg(long, default_value_t = LOAD_SHARE)]
    pub load_share: f64,
    /// Jobs of the drain that measures the runtime's maximum rate (unused with --load-rate).
    #[arg(long, default_value_t = LOAD_RATE_JOBS)]
    pub rate_jobs: u64,
}

/// producers: concurrent producers, each on its own connection, one job per transaction;
/// `Client::enqueue` against `pgmq.send`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct ProducersArgs {
    /// Jobs in all per round and side, split evenly among the producers.
    #[arg(long, default_value_t = PRODUCERS_JOBS)]
    pub jobs: u64,
    #[arg(long, default_value_t = PRODUCERS)]
    pub producers: usize,
}

/// queues: `queues` queues of `jobs_per_queue` jobs, drained by one worker pool serving them
/// all, against the same runtime draining as many jobs off one queue.
#[derive(Debug, Clone, Args, Serialize)]
pub struct QueuesArgs {
    #[arg(long, default_value_t = QUEUES)]
    pub queues: usize,
    #[arg(long, default_value_t = QUEUE_JOBS)]
    pub jobs_per_queue: u64,
    #[arg(long, default_value_t = DRAIN_CONCURRENCY)]
    pub concurrency: usize,
}

/// runtimes: `runtimes` runtimes at `concurrency` each on one queue, against one runtime at
/// `runtimes` × `concurrency`, draining `jobs` and then `steady_jobs` jobs (a row each).
#[derive(Debug, Clone, Args, Serialize)]
pub struct RuntimesArgs {
    #[arg(long, default_value_t = RUNTIMES_JOBS)]
    pub jobs: u64,
    /// The second, longer drain (0 leaves it out).
    #[arg(long, default_value_t = RUNTIMES_STEADY_JOBS)]
    pub steady_jobs: u64,
    #[arg(long, default_value_t = RUNTIMES)]
    pub runtimes: usize,
    /// Each runtime's concurrency.
    #[arg(long, default_value_t = DRAIN_CONCURRENCY)]
    pub concurrency: usize,
}

/// depth: drain rate of a `window` of jobs off the top of a queue holding each depth.
#[derive(Debug, Clone, Args, Serialize)]
pub struct DepthArgs {
    #[arg(long, value_delimiter = ',', default_values_t = DEPTHS)]
    pub depths: Vec<u64>,
    #[arg(long, default_value_t = DEPTH_WINDOW)]
    pub window: u64,
    #[arg(long, default_value_t = DRAIN_CONCURRENCY)]
    pub concurrency: usize,
}

/// workers: drain rate at each concurrency level.
#[derive(Debug, Clone, Args, Serialize)]
pub struct WorkersArgs {
    #[arg(long, default_value_t = WORKERS_JOBS)]
    pub jobs: u64,
    #[arg(long, value_delimiter = ',', default_values_t = WORKERS_LEVELS)]
    pub levels: Vec<usize>,
}

/// memory: the process's resident memory while one runtime drains a large queue.
#[derive(Debug, Clone, Args, Serialize)]
pub struct MemoryArgs {
    #[arg(long, default_value_t = MEMORY_JOBS)]
    pub jobs: u64,
    #[arg(long, default_value_t = DRAIN_CONCURRENCY)]
    pub concurrency: usize,
}

/// limited: jobs over keys limited to 1 against the unlimited drain of as many jobs, then a hot
/// key limited to 10; the invariant check must pass after each.
#[derive(Debug, Clone, Args, Serialize)]
pub struct LimitedArgs {
    #[arg(long, default_value_t = LIMITED_JOBS)]
    pub jobs: u64,
    #[arg(long, default_value_t = LIMITED_KEYS)]
    pub keys: u64,
    #[arg(long, default_value_t = HOT_JOBS)]
    pub hot_jobs: u64,
    #[arg(long, default_value_t = DRAIN_CONCURRENCY)]
    pub concurrency: usize,
}

/// sweep: one concurrency-sweep pass over a parked backlog, and idle-key reclamation.
#[derive(Debug, Clone, Args, Serialize)]
pub struct SweepArgs {
    #[arg(long, default_value_t = SWEEP_PARKED)]
    pub parked: u64,
    #[arg(long, default_value_t = SWEEP_KEYS)]
    pub keys: u64,
    /// Keys whose holder's lease has run out in the busy pass.
    #[arg(long, default_value_t = SWEEP_PROMOTABLE)]
    pub promotable: u64,
    /// Idle keys written for the reclamation measure (0: skip it).
    #[arg(long, default_value_t = IDLE_KEYS)]
    pub idle_keys: u64,
}

/// burst: producers at a steady rate, then `burst_factor` × that rate for `burst_s`, then the
/// steady rate again for `recovery_s` (after `warmup_s` of it); enqueue → handler start per
/// phase, against raw PGMQ on the same schedule.
#[derive(Debug, Clone, Args, Serialize)]
pub struct BurstArgs {
    /// The steady rate, jobs/s.
    #[arg(long, default_value_t = BURST_RATE)]
    pub rate: f64,
    /// The burst's rate, as a multiple of the steady rate.
    #[arg(long, default_value_t = BURST_FACTOR)]
    pub burst_factor: f64,
    #[arg(long, default_value_t = BURST_WARMUP_S)]
    pub warmup_s: f64,
    #[arg(long, default_value_t = BURST_S)]
    pub burst_s: f64,
    #[arg(long, default_value_t = BURST_RECOVERY_S)]
    pub recovery_s: f64,
    /// The windows whose p99 shows the recovery.
    #[arg(long, default_value_t = BURST_WINDOW_S)]
    pub window_s: f64,
    /// How long each handler sleeps.
    #[arg(long, default_value_t = BURST_HANDLER_MS)]
    pub handler_ms: u64,
    /// The runtime's concurrency, and the baseline's concurrent consumers.
    #[arg(long, default_value_t = DRAIN_CONCURRENCY)]
    pub concurrency: usize,
    /// Producers sharing the schedule, each on its own connection.
    #[arg(long, default_value_t = BURST_PRODUCERS)]
    pub producers: usize,
}

/// churn: `jobs` jobs enqueued in calls of `batch` and drained by one runtime, `repeats` times;
/// the tables' sizes after each drain and VACUUM, against a plain PGMQ queue drained by raw
/// consumers.
#[derive(Debug, Clone, Args, Serialize)]
pub struct ChurnArgs {
    #[arg(long, default_value_t = CHURN_JOBS)]
    pub jobs: u64,
    /// Jobs per `enqueue_many` (and `pgmq.send_batch`) call.
    #[arg(long, default_value_t = CHURN_BATCH)]
    pub batch: u64,
    /// Fill, drain and VACUUM this many times per side and round, on the same tables.
    #[arg(long, default_value_t = CHURN_REPEATS)]
    pub repeats: usize,
    #[arg(long, default_value_t = DRAIN_CONCURRENCY)]
    pub concurrency: usize,
}

/// One workload with its sizes.
#[derive(Debug, Clone)]
pub enum Workload {
    Drain(DrainArgs),
    Enqueue(EnqueueArgs),
    Bulk(BulkArgs),
    Latency(LatencyArgs),
    LatencyLoad(LatencyLoadArgs),
    Producers(ProducersArgs),
    Queues(QueuesArgs),
    Runtimes(RuntimesArgs),
    Depth(DepthArgs),
    Workers(WorkersArgs),
    Memory(MemoryArgs),
    Limited(LimitedArgs),
    Sweep(SweepArgs),
    Burst(BurstArgs),
    Churn(ChurnArgs),
}

impl Workload {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Drain(_) => "drain",
            Self::Enqueue(_) => "enqueue",
            Self::Bulk(_) => "bulk",
            Self::Latency(_) => "latency",
            Self::LatencyLoad(_) => "latency-load",
            Self::Producers(_) => "producers",
            Self::Queues(_) => "queues",
            Self::Runtimes(_) => "runtimes",
            Self::Depth(_) => "depth",
            Self::Workers(_) => "workers",
            Self::Memory(_) => "memory",
            Self::Limited(_) => "limited",
            Self::Sweep(_) => "sweep",
            Self::Burst(_) => "burst",
            Self::Churn(_) => "churn",
        }
    }

    pub fn params(&self) -> serde_json::Value {
        let value = match self {
            Self::Drain(a) => serde_json::to_value(a),
            Self::Enqueue(a) => serde_json::to_value(a),
            Self::Bulk(a) => serde_json::to_value(a),
            Self::Latency(a) => serde_json::to_value(a),
            Self::LatencyLoad(a) => serde_json::to_value(a),
            Self::Producers(a) => serde_json::to_value(a),
            Self::Queues(a) => serde_json::to_value(a),
            Self::Runtimes(a) => serde_json::to_value(a),
            Self::Depth(a) => serde_json::to_value(a),
            Self::Workers(a) => serde_json::to_value(a),
            Self::Memory(a) => serde_json::to_value(a),
            Self::Limited(a) => serde_json::to_value(a),
            Self::Sweep(a) => serde_json::to_value(a),
            Self::Burst(a) => serde_json::to_value(a),
            Self::Churn(a) => serde_json::to_value(a),
        };
        value.unwrap_or_default()
    }
}

impl LatencyArgs {
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms.max(1))
    }

    /// How many jobs one round sends.
    pub fn jobs(&self) -> u64 {
        ((self.duration_s * 1000.0) / self.interval_ms.max(1) as f64).round().max(1.0) as u64
    }
}

/// Every workload at the sizes, each multiplied by `scale`, but burst and churn: at their
/// sizes they run for a quarter of an hour and most of an hour, and run alone. Floors keep tiny
/// scales meaningful (a few jobs at least), and the depth window never exceeds the smallest depth.
pub fn all(scale: f64) -> Vec<Workload> {
    let n = |v: u64| ((v as f64 * scale).round() as u64).max(20);
    let depths: Vec<u64> = DEPTHS.iter().map(|&d| n(d)).collect();
    let bulk_jobs = n(BULK_JOBS);
    let latency = LatencyArgs {
        interval_ms: LATENCY_INTERVAL_MS,
        duration_s: (LATENCY_DURATION_S * scale).max(0.2),
        concurrency: LATENCY_CONCURRENCY,
    };
    vec![
        Workload::Enqueue(EnqueueArgs { jobs: n(ENQUEUE_JOBS) }),
        Workload::Bulk(BulkArgs { jobs: bulk_jobs, batches: BULK_BATCHES.iter().map(|&b| b.min(bulk_jobs)).collect() }),
        Workload::Producers(ProducersArgs { jobs: n(PRODUCERS_JOBS), producers: PRODUCERS }),
        Workload::Drain(DrainArgs { jobs: n(DRAIN_JOBS), concurrency: DRAIN_CONCURRENCY, baseline_consumers: None }),
        Workload::Latency(latency.clone()),
        Workload::LatencyLoad(LatencyLoadArgs {
            probe: latency,
            load_rate: None,
            load_share: LOAD_SHARE,
            rate_jobs: n(LOAD_RATE_JOBS),
        }),
        Workload::Depth(DepthArgs { window: n(DEPTH_WINDOW).min(depths[0]), depths, concurrency: DRAIN_CONCURRENCY }),
        Workload::Workers(WorkersArgs { jobs: n(WORKERS_JOBS), levels: WORKERS_LEVELS.to_vec() }),
        Workload::Queues(QueuesArgs { queues: QUEUES, jobs_per_queue: n(QUEUE_JOBS), concurrency: DRAIN_CONCURRENCY }),
        Workload::Runtimes(RuntimesArgs {
            jobs: n(RUNTIMES_JOBS),
            steady_jobs: n(RUNTIMES_STEADY_JOBS),
            runtimes: RUNTIMES,
            concurrency: DRAIN_CONCURRENCY,
        }),
        Workload::Limited(LimitedArgs {
            jobs: n(LIMITED_JOBS),
            keys: n(LIMITED_KEYS).min(n(LIMITED_JOBS)),
            hot_jobs: n(HOT_JOBS),
            concurrency: DRAIN_CONCURRENCY,
        }),
        Workload::Sweep(SweepArgs {
            parked: n(SWEEP_PARKED),
            keys: n(SWEEP_KEYS).min(n(SWEEP_PARKED)),
            promotable: SWEEP_PROMOTABLE.min(n(SWEEP_KEYS)),
            idle_keys: n(IDLE_KEYS),
        }),
        Workload::Memory(MemoryArgs { jobs: n(MEMORY_JOBS), concurrency: DRAIN_CONCURRENCY }),
    ]
}
