//! Concurrency limits with real runtimes: holders that outlive `duration` on a healthy
//! heartbeat (H5), a holder whose database traffic is frozen mid-job (its heartbeat cut; it
//! fences itself, H27), and
//! thousands of jobs over hundreds of keys — each ending with the permit monitor, the run
//! overlap check and the invariant check.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use common::{assert_invariants_after_sweep, install_permit_monitor, max_overlap, test_config, Running, WAIT};
use lockgate::{
    Client, ConcurrencyPolicy, EnqueueOptions, JobContext, JobError, JobPolicy, JobTypeName, OnConflict, PgPool,
    RawHandler, Registry, RuntimeConfig,
};
use lockgate_testkit::{wait_for, wait_for_count, FaultProxy, TestDb};
use serde_json::{json, Value};

/// Records each run in `runs` and sleeps `args.ms` (or `slow_ms` on the slow worker's first job);
/// a cancelled run (its lease lost or fenced) records its end as soon as it stops, so the overlap
/// check sees exactly when each handler ran.
struct Recorder {
    pool: PgPool,
    worker: i32,
    slow_first_ms: Option<u64>,
    started: std::sync::atomic::AtomicBool,
}

impl RawHandler for Recorder {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            let key = args["key"].to_string();
            common::run_started(&self.pool, ctx.job_id.0, &key, self.worker).await;
            let first = !self.started.swap(true, std::sync::atomic::Ordering::SeqCst);
            let ms = match self.slow_first_ms {
                Some(slow) if first => slow,
                _ => args["ms"].as_u64().unwrap_or(10),
            };
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(ms)) => {}
                () = ctx.cancelled() => {}
            }
            common::run_ended(&self.pool, ctx.job_id.0, self.worker).await;
            Ok(())
        })
    }
}

fn limited(limit: u32, duration: Duration) -> JobPolicy {
    let mut policy = JobPolicy::on_queue(common::queue("default"));
    policy.concurrency =
        Some(ConcurrencyPolicy { limit, key: vec!["key".into()], duration, on_conflict: OnConflict::Block });
    policy
}

fn registry(db: &TestDb, worker: i32, slow_first_ms: Option<u64>, types: &[(&str, JobPolicy)]) -> Registry {
    let recorder = Arc::new(Recorder { pool: db.pool.clone(), worker, slow_first_ms, started: Default::default() });
    let mut registry = Registry::new();
    for (name, policy) in types {
        registry.register_raw(JobTypeName::new(*name).unwrap(), policy.clone(), recorder.clone()).unwrap();
    }
    registry
}

/// These stress tests each run several runtimes; one at a time keeps the server's connection
/// count well under its limit while the rest of the suite runs beside them.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn fast_config() -> RuntimeConfig {
    RuntimeConfig { sweep_interval: Duration::from_millis(200), ..test_config() }
}

#[tokio::test]
async fn h05_a_holder_running_past_duration_with_a_healthy_heartbeat_keeps_its_permit() {
    let _heavy = HEAVY.lock().await;
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("serial", limited(1, Duration::from_secs(1)))];
    let client = Client::new(db.pool.clone());
    client.define_job_type(&JobTypeName::new("serial").unwrap(), &types[0].1).await.unwrap();
    // The first job runs 3 s, three times its 1 s duration; the second must wait for it.
    client.enqueue_raw("serial", &json!({"key": 1, "ms": 3000}), &EnqueueOptions::default()).await.unwrap();
    client.enqueue_raw("serial", &json!({"key": 1, "ms": 10}), &EnqueueOptions::default()).await.unwrap();
    let running = Running::start(&db, fast_config(), registry(&db, 1, None, &types), &["default"], 4).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 2, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(max_overlap(&db.pool, -1).await, vec![("1".to_string(), 1)], "never two runs of the key at once");
    let (first_end, second_start): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT (SELECT ended_at FROM runs ORDER BY started_at LIMIT 1), (SELECT max(started_at) FROM runs)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(second_start >= first_end, "the second job started only after the first ended");
    assert_invariants_after_sweep(&db).await;
}

// Two threads, as an application's runtime has: on the test's one thread, worker 0's fence timer
// waited behind the start-up of the seven runtimes started at the freeze, and on a machine
// loaded past its cores (CI beside two cold builds) fired past its 300 ms margin: its handler saw
// its cancel after the next job of its key had started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_fifty_jobs_on_a_limit_one_key_with_a_holders_heartbeat_cut_never_admit_two() {
    let _heavy = HEAVY.lock().await;
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("serial", limited(1, Duration::from_secs(1)))];
    let client = Client::new(db.pool.clone());
    client.define_job_type(&JobTypeName::new("serial").unwrap(), &types[0].1).await.unwrap();
    let jobs: Vec<Value> = (0..50).map(|n| json!({"key": 1, "ms": 20, "n": n})).collect();
    client.enqueue_many_raw("serial", &jobs, &EnqueueOptions::default()).await.unwrap();

    // Worker 0 reaches the database through a proxy; its first job runs 4 s.
    let proxy = FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let proxied = lockgate::PgPoolOptions::new().max_connections(3).connect(&proxy.url_for(&db.url)).await.unwrap();
    let mut workers =
        vec![Running::start_on(proxied, fast_config(), registry(&db, 0, Some(4000), &types), &["default"], 1)];
    wait_for("worker 0 to start a job", WAIT, || async {
        db.count("SELECT 1 FROM runs WHERE worker = 0").await.map(|n| (n > 0).then_some(()))
    })
    .await
    .unwrap();
    // Cut worker 0's heartbeat (and everything else it says) while its job runs, then start
    // seven more workers. Worker 0 cancels its own handler before its lease can end in the
    // database (H27), so none of them can be admitted while it runs.
    proxy.freeze();
    for w in 1..8 {
        workers.push(Running::start(&db, fast_config(), registry(&db, w, None, &types), &["default"], 1).await);
    }
    // The others carry on: the sweep expires its lease, its message comes back and re-parks.
    // Another job can start only once the frozen holder's lease expired and the sweep freed it.
    wait_for("jobs to start past the frozen holder", WAIT, || async {
        let sql =
            "SELECT 1 FROM runs WHERE worker <> 0 AND started_at > (SELECT min(started_at) FROM runs WHERE worker = 0)";
        db.count(sql).await.map(|n| (n >= 3).then_some(()))
    })
    .await
    .unwrap();
    proxy.thaw();
    wait_for("all 50 jobs archived", Duration::from_secs(60), || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT COALESCE((headers->>'job_id')::bigint, msg_id)) FROM pgmq.a_default",
        )
        .fetch_one(&db.pool)
        .await?;
        Ok((n == 50).then_some(()))
    })
    .await
    .unwrap();
    for w in workers {
        w.stop().await;
    }
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 50, "each job archived exactly once");
    assert_eq!(
        db.count("SELECT 1 FROM pgmq.q_default").await.unwrap()
            + db.count("SELECT 1 FROM lockgate.parked").await.unwrap(),
        0
    );
    assert_eq!(max_overlap(&db.pool, -1).await, vec![("1".to_string(), 1)], "one run at a time, counting every worker");
    // The fault really happened and was fenced: no other job started while the frozen holder's
    // job was still running (it cancelled itself before its lease could end), and that job was
    // admitted again and ran to completion.
    let (overlapped, runs_of_it): (i64, i64) = sqlx::query_as(
        "WITH first AS (SELECT * FROM runs WHERE worker = 0 ORDER BY started_at LIMIT 1)
         SELECT (SELECT count(*) FROM runs r, first f
                  WHERE r.worker <> 0 AND r.started_at > f.started_at AND r.started_at < COALESCE(f.ended_at, 'infinity')),
                (SELECT count(*) FROM runs r, first f WHERE r.job_id = f.job_id)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(overlapped == 0 && runs_of_it >= 2, "overlapped {overlapped}, runs of the frozen job {runs_of_it}");
    assert_invariants_after_sweep(&db).await;
}

#[tokio::test]
async fn g3_two_thousand_jobs_over_two_hundred_keys_never_exceed_their_limits() {
    let _heavy = HEAVY.lock().await;
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types: Vec<(String, JobPolicy)> =
        (1..=3).map(|limit| (format!("limit{limit}"), limited(limit, Duration::from_secs(30)))).collect();
    let type_refs: Vec<(&str, JobPolicy)> = types.iter().map(|(n, p)| (n.as_str(), p.clone())).collect();
    let client = Client::new(db.pool.clone());
    for (name, policy) in &type_refs {
        client.define_job_type(&JobTypeName::new(*name).unwrap(), policy).await.unwrap();
    }
    // Key k belongs to the type with limit (k % 3) + 1; ten jobs per key.
    for (i, (name, _)) in type_refs.iter().enumerate() {
        let jobs: Vec<Value> = (0..200)
            .filter(|k| k % 3 == i)
            .flat_map(|k| (0..10).map(move |n| json!({"key": k, "ms": (k * 7 + n) % 6, "n": n})))
            .collect();
        client.enqueue_many_raw(name, &jobs, &EnqueueOptions::default()).await.unwrap();
    }
    let mut workers = Vec::new();
    for w in 0..4 {
        workers.push(Running::start(&db, fast_config(), registry(&db, w, None, &type_refs), &["default"], 8).await);
    }
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 2000, Duration::from_secs(120)).await.unwrap();
    for w in workers {
        w.stop().await;
    }
    for (key, overlap) in max_overlap(&db.pool, -1).await {
        let k: i64 = key.parse().unwrap();
        assert!(overlap <= k % 3 + 1, "key {k} ran {overlap} at once, above its limit {}", k % 3 + 1);
    }
    assert_invariants_after_sweep(&db).await;
}
