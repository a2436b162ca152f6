//! The harness still works: every workload runs at a tiny size and produces numbers, and the
//! binary writes its JSON. Benchmarks are not tests — nothing here asserts anything about speed.

use std::process::Command;

use lockgate_bench::plan::{
    BulkArgs, BurstArgs, ChurnArgs, DepthArgs, DrainArgs, EnqueueArgs, LatencyArgs, LatencyLoadArgs, LimitedArgs,
    MemoryArgs, Options, ProducersArgs, QueuesArgs, RuntimesArgs, SweepArgs, WorkersArgs, Workload, DEFAULT_SERVER_URL,
};
use lockgate_bench::report::Report;

/// The bench server, else the server the rest of the test suite uses, else the local default.
fn server_url() -> String {
    ["LOCKGATE_BENCH_SERVER_URL", "LOCKGATE_TEST_DATABASE_URL"]
        .iter()
        .find_map(|var| std::env::var(var).ok())
        .unwrap_or_else(|| DEFAULT_SERVER_URL.to_string())
}

fn tiny_plan() -> Vec<Workload> {
    let probe = LatencyArgs { interval_ms: 20, duration_s: 0.3, concurrency: 2 };
    vec![
        Workload::Enqueue(EnqueueArgs { jobs: 30 }),
        Workload::Bulk(BulkArgs { jobs: 250, batches: vec![10, 100] }),
        Workload::Producers(ProducersArgs { jobs: 40, producers: 4 }),
        Workload::Drain(DrainArgs { jobs: 100, concurrency: 4, baseline_consumers: None }),
        Workload::Latency(probe.clone()),
        // The measured maximum rate sets the load, as in a real run.
        Workload::LatencyLoad(LatencyLoadArgs {
            probe: LatencyArgs { duration_s: 0.2, ..probe },
            load_rate: None,
            load_share: 0.5,
            rate_jobs: 100,
        }),
        Workload::Queues(QueuesArgs { queues: 3, jobs_per_queue: 30, concurrency: 4 }),
        Workload::Runtimes(RuntimesArgs { jobs: 100, steady_jobs: 200, runtimes: 2, concurrency: 2 }),
        Workload::Depth(DepthArgs { depths: vec![60, 300], window: 40, concurrency: 4 }),
        Workload::Workers(WorkersArgs { jobs: 40, levels: vec![1, 4] }),
        Workload::Limited(LimitedArgs { jobs: 120, keys: 10, hot_jobs: 60, concurrency: 4 }),
        Workload::Sweep(SweepArgs { parked: 200, keys: 20, promotable: 2, idle_keys: 100 }),
        Workload::Memory(MemoryArgs { jobs: 100, concurrency: 4 }),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_workload_runs_at_a_tiny_size_and_reports_numbers() {
    let options = Options { server_url: server_url(), rounds: 2, progress: false, pool_ping: true };
    let report = lockgate_bench::run(options, &tiny_plan(), "smoke".into()).await.expect("the tiny plan runs");
    let names: Vec<&str> = report.workloads.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "enqueue",
            "bulk",
            "producers",
            "drain",
            "latency",
            "latency-load",
            "queues",
            "runtimes",
            "depth",
            "workers",
            "limited",
            "sweep",
            "memory"
        ]
    );
    assert_numbers(&report);
    assert!(report.table().contains("| drain"), "the table lists the drain row:\n{}", report.table());
}

/// The long workloads, kept out of `all`, once each at a tiny size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_long_workloads_run_once_at_a_tiny_size_and_report_numbers() {
    let burst = BurstArgs {
        rate: 100.0,
        burst_factor: 1.5,
        warmup_s: 2.0,
        burst_s: 1.0,
        recovery_s: 2.0,
        window_s: 1.0,
        handler_ms: 1,
        concurrency: 4,
        producers: 2,
    };
    let plan =
        [Workload::Burst(burst), Workload::Churn(ChurnArgs { jobs: 2_000, batch: 1_000, repeats: 2, concurrency: 4 })];
    let options = Options { server_url: server_url(), rounds: 1, progress: false, pool_ping: true };
    let report = lockgate_bench::run(options, &plan, "smoke".into()).await.expect("the long workloads run");
    let names: Vec<&str> = report.workloads.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["burst", "churn"]);
    assert_numbers(&report);
}

/// Every workload has rows, every figure is a number, and every baseline named has figures: a
/// positive one, but for counts and shares, which an idle queue or a table without HOT updates
/// leave at zero.
fn assert_numbers(report: &Report) {
    for workload in &report.workloads {
        assert!(!workload.rows.is_empty(), "{} produced no rows", workload.name);
        for row in &workload.rows {
            assert!(row.lockgate.median.is_finite(), "{}: {} is not a number", row.workload, row.measure);
            assert!(
                row.baseline_name.is_none() || row.baseline.is_some(),
                "{}: {} has no baseline figures",
                row.workload,
                row.measure
            );
            if let Some(baseline) = &row.baseline {
                let may_be_zero = matches!(row.unit.as_str(), "jobs" | "%");
                assert!(
                    baseline.median.is_finite() && (baseline.median > 0.0 || may_be_zero && baseline.median == 0.0),
                    "{}: baseline {baseline:?}",
                    row.workload
                );
            }
        }
    }
}

#[test]
fn the_binary_runs_one_workload_from_flags_and_writes_json() {
    let json = std::env::temp_dir().join(format!("lockgate-bench-smoke-{}.json", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_lockgate-bench"))
        .args(["--rounds", "1", "--no-progress", "--server-url", &server_url(), "--json"])
        .arg(&json)
        .args(["drain", "--jobs", "50", "--concurrency", "2"])
        .output()
        .expect("the binary starts");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(String::from_utf8_lossy(&output.stdout).contains("| drain"));
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON was written")).expect("valid JSON");
    let _ = std::fs::remove_file(&json);
    let rate = &written["workloads"][0]["rows"][0]["lockgate"]["median"];
    assert!(rate.as_f64().is_some_and(|r| r > 0.0), "a drain rate in {written}");
    assert!(written["machine"]["postgres_version"].is_string());
}
