//! The runtime under the faults that broke it (issue 10): a producer transaction held open on a
//! key while a completion of that key blocks (H28), a worker partitioned from the database while
//! it holds a limit-1 job (H27), a process whose registry heartbeat stalls while its jobs renew
//! (H26), a queue whose claim fails beside healthy ones (H29), shutdown returning a job only
//! after its handler has ended (H30), and the recorded heartbeat interval lowered behind a running
//! process's back (H10).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::{install_permit_monitor, max_overlap, queue, test_config, Counter, Running, WAIT};
use lockgate::{
    CancelReason, Client, ConcurrencyPolicy, EnqueueOptions, JobContext, JobError, JobPolicy, JobTypeName, OnConflict,
    PgPool, PoolConfig, RawHandler, Registry, Runtime, RuntimeConfig,
};
use lockgate_testkit::{wait_for, wait_for_count, FaultProxy, TestDb};
use serde_json::{json, Value};
use sqlx::Connection;
use tokio_util::sync::CancellationToken;

fn limited(queue_name: &str, limit: u32, duration: Duration) -> JobPolicy {
    let mut policy = JobPolicy::on_queue(queue(queue_name));
    policy.concurrency =
        Some(ConcurrencyPolicy { limit, key: vec!["key".into()], duration, on_conflict: OnConflict::Block });
    policy
}

/// Records every start (in memory and in `runs`), sleeps `args.ms` unless cancelled, and records
/// its end, or, when cancelled, why and whether its visibility and lease were still live in the
/// database at that instant.
struct Probe {
    /// A direct pool: the handler's own writes never go through a worker's faulty network.
    pool: PgPool,
    worker: i32,
    starts: Counter,
    /// The first run of this worker sleeps this long instead of `args.ms`.
    first_ms: Option<u64>,
    /// Jobs with `"hold": true` run until the test notifies this.
    hold: Arc<tokio::sync::Notify>,
    cancels: Arc<Mutex<Vec<Cancelled>>>,
}

#[derive(Debug, Clone)]
struct Cancelled {
    reason: Option<CancelReason>,
    visible_later: bool,
    lease_live: Option<bool>,
}

impl RawHandler for Probe {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            let first = self.starts.bump() == 1;
            let key = args["key"].to_string();
            common::run_started(&self.pool, ctx.job_id.0, &key, self.worker).await;
            let ms = self.first_ms.filter(|_| first).unwrap_or_else(|| args["ms"].as_u64().unwrap_or(10));
            let hold = args["hold"].as_bool().unwrap_or(false);
            let work = async {
                if hold {
                    self.hold.notified().await;
                } else {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
            };
            tokio::select! {
                () = work => {}
                () = ctx.cancelled() => {
                    let (visible_later, lease_live): (bool, Option<bool>) = sqlx::query_as(&format!(
                        "SELECT (SELECT vt > clock_timestamp() FROM pgmq.q_{q} WHERE msg_id = $1),
                                (SELECT expires_at > clock_timestamp() FROM lockgate.leases WHERE msg_id = $1)",
                        q = ctx.queue
                    ))
                    .bind(ctx.msg_id)
                    .fetch_one(&self.pool)
                    .await
                    .unwrap();
                    let reason = ctx.cancel_reason();
                    self.cancels.lock().unwrap().push(Cancelled { reason, visible_later, lease_live });
                }
            }
            common::run_ended(&self.pool, ctx.job_id.0, self.worker).await;
            Ok(())
        })
    }
}

fn probe_registry(probe: Probe, types: &[(&str, JobPolicy)]) -> Registry {
    handled_by(Arc::new(probe), types)
}

/// A registry running every type of `types` with `handler`.
fn handled_by(handler: Arc<dyn RawHandler>, types: &[(&str, JobPolicy)]) -> Registry {
    let mut registry = Registry::new();
    for (name, policy) in types {
        registry.register_raw(JobTypeName::new(*name).unwrap(), policy.clone(), handler.clone()).unwrap();
    }
    registry
}

/// A `Runtime` serving queue `default` (one pool of concurrency 1) with `registry`, run on
/// `runtime` in a thread of its own, as an application with a tokio runtime of its own runs it.
/// Sending on the returned channel drops `run` and then `runtime`, without stopping `run` through
/// its token, as such an application's end does; join the thread to wait for that drop (which
/// waits for a handler blocking one of the runtime's threads).
fn on_own_runtime(
    runtime: tokio::runtime::Runtime,
    url: String,
    config: RuntimeConfig,
    registry: Registry,
) -> (tokio::sync::oneshot::Sender<()>, std::thread::JoinHandle<()>) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        runtime.block_on(async move {
            let pool = lockgate::PgPoolOptions::new().max_connections(2).connect(&url).await.unwrap();
            let pools = vec![PoolConfig::new("own", vec![queue("default")], 1)];
            let run = Runtime::new(pool, config, registry, pools).unwrap().run(CancellationToken::new());
            tokio::select! {
                _ = run => panic!("the runtime stopped on its own"),
                _ = stopped => {}
            }
        });
        drop(runtime);
    });
    (stop, thread)
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn two_threads() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn probe(db: &TestDb, worker: i32, starts: &Counter) -> Probe {
    Probe {
        pool: db.pool.clone(),
        worker,
        starts: starts.clone(),
        first_ms: None,
        hold: Arc::default(),
        cancels: Arc::default(),
    }
}

async fn define(db: &TestDb, types: &[(&str, JobPolicy)]) -> Client {
    let client = Client::new(db.pool.clone());
    for (name, policy) in types {
        client.define_job_type(&JobTypeName::new(*name).unwrap(), policy).await.unwrap();
    }
    client
}

async fn started(db: &TestDb, job_id: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM runs WHERE job_id = $1").bind(job_id).fetch_one(&db.pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h28_a_producer_transaction_held_open_on_a_key_never_delays_a_completion_or_other_renewals() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types =
        [("lim", limited("default", 2, Duration::from_secs(30))), ("long", JobPolicy::on_queue(queue("default")))];
    let client = define(&db, &types).await;
    let long =
        client.enqueue_raw("long", &json!({"key": "l", "ms": 60_000}), &EnqueueOptions::default()).await.unwrap();
    let held = client.enqueue_raw("lim", &json!({"key": 1, "hold": true}), &EnqueueOptions::default()).await.unwrap();
    let (starts, config) = (Counter::default(), fast_config());
    let probe = probe(&db, 0, &starts);
    let (hold, cancels) = (Arc::clone(&probe.hold), Arc::clone(&probe.cancels));
    let running = Running::start(&db, config.clone(), probe_registry(probe, &types), &["default"], 4).await;
    wait_for("both jobs to start", WAIT, || async {
        Ok((started(&db, long.job_id.0).await == 1 && started(&db, held.job_id.0).await == 1).then_some(()))
    })
    .await
    .unwrap();
    // A producer enqueues on key 1 in a transaction it keeps open: it holds the key's semaphore
    // row. Then key 1's running job finishes: its completion lands at once, the producer's
    // transaction still open, and leaves its permit to the sweep.
    let mut producer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    sqlx::query("SELECT lockgate.enqueue('lim', '{\"key\": 1, \"ms\": 10}')").execute(&mut *tx).await.unwrap();
    let opened = chrono::Utc::now();
    hold.notify_one();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    let finished: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.leases WHERE finished_at IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(finished, 1, "the completion left the lease whose key row the producer holds, marked finished");
    // Only the runtime's give-back of that permit may wait for the producer, in a statement that
    // holds nothing else (design §72).
    let waiting: i64 = sqlx::query_scalar(&format!(
        "{} AND query NOT LIKE '%lockgate._give_back_finished%'",
        common::WAITING_FOR_A_LOCK
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(waiting, 0, "nothing else waits for the producer");
    // While the transaction stays open, the long job keeps being renewed, past the point where
    // its visibility would have lapsed had renewals waited.
    let past_lapse = opened + config.visibility_timeout * 2;
    wait_for("the long job renewed past two visibility timeouts", WAIT, || async {
        let vt: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT vt FROM pgmq.q_default WHERE msg_id = $1")
            .bind(long.msg_id)
            .fetch_one(&db.pool)
            .await?;
        Ok((vt > past_lapse).then_some(()))
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    // The producer's job runs and ends; the sweep gives the finished lease's permit back.
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 2, WAIT).await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.leases", 0, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(started(&db, long.job_id.0).await, 1, "the long job was started exactly once");
    assert_eq!(started(&db, held.job_id.0).await, 1, "the completed job ran once");
    let reasons: Vec<_> = cancels.lock().unwrap().iter().map(|c| c.reason).collect();
    assert_eq!(reasons, vec![Some(CancelReason::Shutdown)], "only shutdown ever cancelled the long job");
    common::assert_invariants_after_sweep(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h28_a_job_that_finishes_while_a_producer_holds_its_key_past_its_lease_runs_once() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    // Limit 1 and a lease of 2 s: a completion waiting for the key's row would outlast it.
    let types = [("serial", limited("default", 1, Duration::from_secs(2)))];
    let client = define(&db, &types).await;
    let first =
        client.enqueue_raw("serial", &json!({"key": 1, "hold": true}), &EnqueueOptions::default()).await.unwrap();
    let (starts, config) = (Counter::default(), fast_config());
    let probe = probe(&db, 0, &starts);
    let hold = Arc::clone(&probe.hold);
    let running = Running::start(&db, config.clone(), probe_registry(probe, &types), &["default"], 2).await;
    wait_for("the first job to start", WAIT, || async { Ok((started(&db, first.job_id.0).await == 1).then_some(())) })
        .await
        .unwrap();
    // The producer parks a second job of the key and keeps its transaction open, holding the
    // key's row, while the first job finishes and well past the first job's lease.
    let mut producer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    let (second, status): (i64, String) =
        sqlx::query_as("SELECT job_id, status FROM lockgate.enqueue('serial', '{\"key\": 1, \"ms\": 10}')")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    assert_eq!(status, "parked");
    let lease_end: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT expires_at FROM lockgate.leases WHERE msg_id = $1")
            .bind(first.msg_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    hold.notify_one();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    let open_until = lease_end + config.visibility_timeout * 2;
    wait_for("the producer's transaction open past the first job's lease", WAIT, || async {
        Ok((chrono::Utc::now() > open_until).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(started(&db, first.job_id.0).await, 1, "the finished job did not run again");
    assert_eq!(started(&db, second).await, 0, "the parked job waits for the permit");
    tx.commit().await.unwrap();
    // The sweep frees the finished job's permit and promotes the parked job, which runs.
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 2, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(started(&db, first.job_id.0).await, 1, "the finished job ran once");
    assert_eq!(started(&db, second).await, 1, "the parked job ran once");
    assert!(max_overlap(&db.pool, -1).await.iter().all(|(_, n)| *n <= 1), "key 1 never ran two jobs at once");
    common::assert_invariants_after_sweep(&db).await;
}

/// Design §72: a permit that a completion left on its lease, marked finished, because a producer
/// held the key's row goes back as soon as the producer commits. The runtime hears the key on
/// `lockgate.finished` and gives it back from a statement of its own. No sweep runs here (its
/// interval is an hour) and no other enqueue of the key comes; before, the parked job waited for
/// one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h28_a_permit_left_finished_goes_back_once_the_producer_commits_without_a_sweep() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("serial", limited("default", 1, Duration::from_secs(30)))];
    let client = define(&db, &types).await;
    let first =
        client.enqueue_raw("serial", &json!({"key": 1, "hold": true}), &EnqueueOptions::default()).await.unwrap();
    let starts = Counter::default();
    let config = RuntimeConfig { sweep_interval: Duration::from_secs(3600), ..test_config() };
    let probe = probe(&db, 0, &starts);
    let hold = Arc::clone(&probe.hold);
    let running = Running::start(&db, config, probe_registry(probe, &types), &["default"], 2).await;
    wait_for("the first job to start", WAIT, || async { Ok((started(&db, first.job_id.0).await == 1).then_some(())) })
        .await
        .unwrap();
    let mut producer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    let (second, status): (i64, String) =
        sqlx::query_as("SELECT job_id, status FROM lockgate.enqueue('serial', '{\"key\": 1, \"ms\": 10}')")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    assert_eq!(status, "parked");
    hold.notify_one();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    let finished: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.leases WHERE finished_at IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(finished, 1, "the completion left its permit on the lease, marked finished");
    tx.commit().await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 2, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(started(&db, first.job_id.0).await, 1, "the finished job ran once");
    assert_eq!(started(&db, second).await, 1, "the parked job ran once");
    assert!(max_overlap(&db.pool, -1).await.iter().all(|(_, n)| *n <= 1), "key 1 never ran two jobs at once");
    common::assert_invariants_after_sweep(&db).await;
}

fn fast_config() -> RuntimeConfig {
    RuntimeConfig { sweep_interval: Duration::from_millis(200), ..test_config() }
}

async fn archived_jobs(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT COALESCE((headers->>'job_id')::bigint, msg_id)) FROM pgmq.a_default")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h27_a_partitioned_worker_cancels_its_handler_before_its_lease_can_expire() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("serial", limited("default", 1, Duration::from_secs(2)))];
    let client = define(&db, &types).await;
    for n in 0..2 {
        client.enqueue_raw("serial", &json!({"key": 1, "ms": 10, "n": n}), &EnqueueOptions::default()).await.unwrap();
    }
    // Worker 0 reaches the database only through a proxy; its first job would run a minute.
    let proxy = FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let proxied = lockgate::PgPoolOptions::new().max_connections(3).connect(&proxy.url_for(&db.url)).await.unwrap();
    let mut partitioned = probe(&db, 0, &Counter::default());
    partitioned.first_ms = Some(60_000);
    let cancels = Arc::clone(&partitioned.cancels);
    let w0 = Running::start_on(proxied, fast_config(), probe_registry(partitioned, &types), &["default"], 1);
    wait_for("worker 0 to start a job", WAIT, || async {
        db.count("SELECT 1 FROM runs WHERE worker = 0").await.map(|n| (n > 0).then_some(()))
    })
    .await
    .unwrap();
    // Partition it: its renewals (and everything else it says) stop reaching the database.
    proxy.freeze();
    let w1 =
        Running::start(&db, fast_config(), probe_registry(probe(&db, 1, &Counter::default()), &types), &["default"], 1)
            .await;
    let cancelled =
        wait_for("worker 0 to cancel its own handler", WAIT, || async { Ok(cancels.lock().unwrap().first().cloned()) })
            .await
            .unwrap();
    assert_eq!(cancelled.reason, Some(CancelReason::LeaseLost));
    assert!(cancelled.visible_later, "cancelled while its message was still invisible to everyone else");
    assert_eq!(cancelled.lease_live, Some(true), "cancelled while its lease was still live in the database");
    wait_for("both jobs archived by worker 1", WAIT, || async { Ok((archived_jobs(&db).await == 2).then_some(())) })
        .await
        .unwrap();
    proxy.thaw();
    w0.stop().await;
    w1.stop().await;
    assert_eq!(max_overlap(&db.pool, -1).await, vec![("1".to_string(), 1)], "no overlap, counting every worker");
    let (ended, next_start): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT (SELECT ended_at FROM runs WHERE worker = 0), (SELECT min(started_at) FROM runs WHERE worker = 1)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(ended < next_start, "worker 1 was admitted only after worker 0's handler ended");
    common::assert_invariants_after_sweep(&db).await;
}

/// A runtime of one pool (concurrency 1) on queue `default`, running `registry`, that reaches
/// the database only through a new fault proxy; returned once it has registered.
async fn worker_behind_a_proxy(db: &TestDb, registry: Registry) -> (FaultProxy, Running) {
    runtime_behind_a_proxy(db, test_config(), registry, |_| {}).await
}

/// A runtime as `worker_behind_a_proxy` starts one, under `config`, with `arm` called on the
/// proxy before the runtime's first statement.
async fn runtime_behind_a_proxy(
    db: &TestDb,
    config: RuntimeConfig,
    registry: Registry,
    arm: impl FnOnce(&FaultProxy),
) -> (FaultProxy, Running) {
    let proxy = FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let proxied = lockgate::PgPoolOptions::new().max_connections(4).connect(&proxy.url_for(&db.url)).await.unwrap();
    arm(&proxy);
    let worker = Running::start_on(proxied, config, registry, &["default"], 1);
    wait_for("the worker to register", WAIT, || async {
        db.count("SELECT 1 FROM lockgate.processes").await.map(|n| (n > 0).then_some(()))
    })
    .await
    .unwrap();
    (proxy, worker)
}

/// Review helper-135 F4 (docs/design.md §115, H32): a claim whose reply is lost after it
/// committed (the connection cut between the server's answer and the worker) spends no attempt
/// of the job it took: the job, allowed one attempt, runs once its visibility lapses, and
/// succeeds. When the claim recorded the deliveries it expected to start at once as started,
/// the job was dead-lettered `attempts_exhausted` without having run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h32_a_claim_whose_reply_is_lost_after_it_committed_spends_no_attempt() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let mut once = JobPolicy::on_queue(queue("default"));
    once.max_attempts = 1;
    let types = [("work", once)];
    let client = define(&db, &types).await;
    let (proxy, w0) = worker_behind_a_proxy(&db, probe_registry(probe(&db, 0, &Counter::default()), &types)).await;
    // Only the claim that takes this job carries its arguments back.
    proxy.cut_reply_containing("reply-to-lose");
    let job = client
        .enqueue_raw("work", &json!({"key": 1, "ms": 10, "tag": "reply-to-lose"}), &EnqueueOptions::default())
        .await
        .unwrap()
        .job_id
        .0;
    wait_for("the claim's reply to be cut", WAIT, || async { Ok(proxy.met_marked_reply().then_some(())) })
        .await
        .unwrap();
    wait_for("the job to finish", WAIT, || async {
        db.count("SELECT 1 FROM pgmq.a_default UNION ALL SELECT 1 FROM lockgate.dead_letters")
            .await
            .map(|n| (n > 0).then_some(()))
    })
    .await
    .unwrap();
    w0.stop().await;
    let dead: Vec<(String, String)> =
        sqlx::query_as("SELECT reason, error FROM lockgate.dead_letters").fetch_all(&db.pool).await.unwrap();
    assert!(dead.is_empty(), "dead-lettered although it never ran: {dead:?}");
    assert_eq!(started(&db, job).await, 1, "the job ran once");
    assert_eq!(archived_jobs(&db).await, 1, "and succeeded");
}

/// Review helper-135 F6 (docs/design.md §115): a claim whose reply never comes (the network
/// dropped the flow without a reset: the connection stays open, silent) is given up with its
/// connection after half the visibility timeout. The pool claims on, the job it took runs once
/// its visibility lapses, as attempt 1, and the runtime stops when asked. Before, the fetch loop
/// awaited that reply for good: nothing more was claimed, and shutdown never finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_never_comes_is_given_up_and_the_pool_claims_on() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let mut once = JobPolicy::on_queue(queue("default"));
    once.max_attempts = 1;
    let types = [("work", once)];
    let client = define(&db, &types).await;
    let (proxy, w0) = worker_behind_a_proxy(&db, probe_registry(probe(&db, 0, &Counter::default()), &types)).await;
    proxy.swallow_reply_containing("reply-never-comes");
    let enqueue = async |tag: &str| {
        client
            .enqueue_raw("work", &json!({"key": 1, "ms": 10, "tag": tag}), &EnqueueOptions::default())
            .await
            .unwrap()
            .job_id
            .0
    };
    let lost = enqueue("reply-never-comes").await;
    wait_for("the claim's reply to be swallowed", WAIT, || async { Ok(proxy.met_marked_reply().then_some(())) })
        .await
        .unwrap();
    let next = enqueue("next").await;
    wait_for("both jobs to run", WAIT, || async {
        Ok((started(&db, lost).await == 1 && started(&db, next).await == 1).then_some(()))
    })
    .await
    .unwrap();
    wait_for("both to be archived", WAIT, || async { Ok((archived_jobs(&db).await == 2).then_some(())) })
        .await
        .unwrap();
    tokio::time::timeout(WAIT, w0.stop()).await.expect("the runtime stops when asked");
    assert_eq!(
        db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(),
        0,
        "no attempt was spent by the lost claim"
    );
}

/// Fails a job's first attempt with an error carrying `marker` (so the retry statement that
/// writes it carries it too), and succeeds after.
struct FailFirst {
    marker: &'static str,
}

impl RawHandler for FailFirst {
    fn call(&self, ctx: JobContext, _args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            if ctx.attempt == 1 {
                return Err(JobError::new(format!("failing on purpose: {}", self.marker)));
            }
            Ok(())
        })
    }
}

/// Review helper-138 F1 (docs/design.md §115): a final statement (here a failed attempt's retry)
/// whose replies never come is given up with its connection closed. Given up by cutting its
/// future short instead, its connection went back to sqlx's pool, whose test of it waited for
/// the lost reply: one connection lost per given-up attempt, until the pool starved and nothing
/// more was claimed, swept or finished. The retry, sent again, finds its delivery retried (it
/// writes nothing twice); the job runs its second attempt and succeeds, and the jobs after it run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_statement_whose_replies_never_come_is_given_up_with_its_connection() {
    let db = TestDb::migrated().await.unwrap();
    let mut quick = JobPolicy::on_queue(queue("default"));
    quick.backoff = lockgate::Backoff { base: Duration::from_millis(10), max: Duration::from_millis(10), jitter: 0.0 };
    let types = [("work", quick)];
    let client = define(&db, &types).await;
    let marker = "retry-reply-never-comes";
    let (proxy, w0) = worker_behind_a_proxy(&db, handled_by(Arc::new(FailFirst { marker }), &types)).await;
    proxy.swallow_replies_to_request_containing(marker);
    let first = client.enqueue_raw("work", &json!({"n": 0}), &EnqueueOptions::default()).await.unwrap().job_id.0;
    wait_for("the retry's replies to be swallowed", WAIT, || async { Ok(proxy.met_marked_reply().then_some(())) })
        .await
        .unwrap();
    for n in 1..=6 {
        client.enqueue_raw("work", &json!({"n": n}), &EnqueueOptions::default()).await.unwrap();
    }
    wait_for("every job to succeed", WAIT, || async { Ok((archived_jobs(&db).await == 7).then_some(())) })
        .await
        .unwrap();
    tokio::time::timeout(WAIT, w0.stop()).await.expect("the runtime stops when asked");
    let errors: i64 = sqlx::query_scalar(
        "SELECT jsonb_array_length(headers->'errors')::bigint FROM pgmq.a_default
          WHERE COALESCE((headers->>'job_id')::bigint, msg_id) = $1",
    )
    .bind(first)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(errors, 1, "the failed attempt is recorded once");
}

/// A statement of a periodic service whose replies never come (a flow the network dropped
/// without a reset) is given up with its connection within half the visibility timeout, and the
/// service goes on (design §119). Awaited for good, the concurrency sweep never swept again in
/// this process: its later passes never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_whose_replies_never_come_is_given_up_and_the_sweep_goes_on() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query(&format!("ALTER DATABASE \"{}\" SET track_functions = 'pl'", db.name)).execute(&db.pool).await.unwrap();
    let types = [("work", JobPolicy::on_queue(queue("default")))];
    define(&db, &types).await;
    let config = RuntimeConfig { sweep_interval: Duration::from_millis(100), ..test_config() };
    let registry = probe_registry(probe(&db, 0, &Counter::default()), &types);
    // A statement's text reaches the server once per connection (then it is prepared): armed
    // before the runtime starts, the first sweep's Parse carries it.
    let (proxy, w0) = runtime_behind_a_proxy(&db, config, registry, |proxy| {
        proxy.swallow_replies_to_request_containing("FROM lockgate.sweep(");
    })
    .await;
    wait_for("a sweep's replies to be swallowed", WAIT, || async { Ok(proxy.met_marked_reply().then_some(())) })
        .await
        .unwrap();
    let sweeps = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_user_functions
              WHERE schemaname = 'lockgate' AND funcname = 'sweep'",
        )
        .fetch_one(&db.pool)
        .await
        .map_err(anyhow::Error::from)
    };
    // The swallowed pass ran on the server; two more mean the sweep went on.
    wait_for("the sweep to go on", WAIT, || async { sweeps().await.map(|n| (n >= 3).then_some(())) }).await.unwrap();
    tokio::time::timeout(WAIT, w0.stop()).await.expect("the runtime stops when asked");
}

/// The recurring scheduler's tick whose replies never come is given up, and the next ticks are
/// enqueued (design §119). Awaited for good, no tick of any task came again in this process, and
/// its shutdown never finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recurring_tick_whose_replies_never_come_is_given_up_and_the_next_ticks_come() {
    let db = TestDb::migrated().await.unwrap();
    let types = [("work", JobPolicy::on_queue(queue("default"))), ("tick", JobPolicy::on_queue(queue("ticks")))];
    let client = define(&db, &types).await;
    // A name only the tick's request carries (a bound value, sent with every execution).
    let task = "tick-whose-reply-is-swallowed";
    client.define_recurring(&lockgate::RecurringTask::new(task, "* * * * * *", "tick")).await.unwrap();
    let registry = probe_registry(probe(&db, 0, &Counter::default()), &types[..1]);
    let (proxy, w0) = runtime_behind_a_proxy(&db, test_config(), registry, |proxy| {
        proxy.swallow_replies_to_request_containing(task);
    })
    .await;
    wait_for("a tick's replies to be swallowed", WAIT, || async { Ok(proxy.met_marked_reply().then_some(())) })
        .await
        .unwrap();
    let swallowed = db.count("SELECT 1 FROM pgmq.q_ticks").await.unwrap();
    wait_for("two more ticks", WAIT, || async {
        db.count("SELECT 1 FROM pgmq.q_ticks").await.map(|n| (n >= swallowed + 2).then_some(()))
    })
    .await
    .unwrap();
    tokio::time::timeout(WAIT, w0.stop()).await.expect("the runtime stops when asked");
}

/// A deregistration whose replies never come is given up, and the shutdown it ends finishes
/// (design §119); the row is pruned later, as a crashed process's is. Awaited for good, the
/// process never exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deregistration_whose_replies_never_come_holds_up_no_shutdown() {
    let db = TestDb::migrated().await.unwrap();
    let types = [("work", JobPolicy::on_queue(queue("default")))];
    define(&db, &types).await;
    let config = RuntimeConfig { process_heartbeat_interval: Duration::from_secs(1), ..test_config() };
    let registry = probe_registry(probe(&db, 0, &Counter::default()), &types);
    let (proxy, w0) = runtime_behind_a_proxy(&db, config, registry, |_| {}).await;
    proxy.swallow_replies_to_request_containing("lockgate.deregister_process(");
    tokio::time::timeout(WAIT, w0.stop()).await.expect("the runtime stops when asked");
    assert!(proxy.met_marked_reply(), "the deregistration's replies were swallowed");
}

/// A claim that reaches the worker with too little of its budget left to start a handler (its
/// reply held up by a stalled network, a paused process) is returned unstarted: it runs again at
/// once, as attempt 1, and spends no shutdown return. Before, it was forgotten until its
/// visibility lapsed, and its one run counted as attempt 2 (review helper-80); then returned as a
/// shutdown return, which used the free ones up (helper-82).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h32_a_claim_answered_too_late_to_start_is_returned_and_counts_no_attempt() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("work", JobPolicy::on_queue(queue("default")))];
    let client = define(&db, &types).await;
    let proxy = FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let proxied = lockgate::PgPoolOptions::new().max_connections(4).connect(&proxy.url_for(&db.url)).await.unwrap();
    // No free shutdown returns: a return of this kind must not be one.
    let config = RuntimeConfig { max_shutdown_returns: 0, ..test_config() };
    let w0 =
        Running::start_on(proxied, config, probe_registry(probe(&db, 0, &Counter::default()), &types), &["default"], 1);
    wait_for("the worker to register", WAIT, || async {
        db.count("SELECT 1 FROM lockgate.processes").await.map(|n| (n > 0).then_some(()))
    })
    .await
    .unwrap();
    // Which of the worker's exchanges the freeze catches is up to timing: its claim's request
    // (held past its 2 s budget: the case under test) or an earlier reply (its next claim then
    // comes in time). Rounds until one was late, each with a job of its own.
    let mut late = 0;
    for round in 1..=8 {
        proxy.freeze();
        // A claim that passed the proxy before the freeze has ended before the job exists.
        wait_for("the worker's statements before the freeze to end", WAIT, || async {
            let busy: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'",
            )
            .fetch_one(&db.pool)
            .await?;
            Ok((busy == 0).then_some(()))
        })
        .await
        .unwrap();
        client.enqueue_raw("work", &json!({"key": round, "ms": 10}), &EnqueueOptions::default()).await.unwrap();
        let frozen_at = std::time::Instant::now();
        wait_for("a claim's budget to pass in the proxy", WAIT, || async {
            Ok((frozen_at.elapsed() > Duration::from_millis(2500)).then_some(()))
        })
        .await
        .unwrap();
        proxy.thaw();
        wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", round, WAIT).await.unwrap();
        let (read_ct, headers): (i32, serde_json::Value) =
            sqlx::query_as("SELECT read_ct, headers FROM pgmq.a_default WHERE message->>'key' = $1::text")
                .bind(round.to_string())
                .fetch_one(&db.pool)
                .await
                .unwrap();
        let returns = headers.get("returns").and_then(serde_json::Value::as_i64).unwrap_or(0);
        assert_eq!(
            i64::from(read_ct) - returns,
            1,
            "round {round}: its one run is attempt 1 ({headers}, read_ct {read_ct})"
        );
        assert!(headers.get("shutdown_returns").is_none(), "round {round}: a shutdown return was spent: {headers}");
        if returns > 0 {
            late += 1;
            if late == 2 {
                break;
            }
        }
    }
    w0.stop().await;
    assert!(late > 0, "no round held a claim's request past its budget");
    assert_eq!(db.count("SELECT 1 FROM runs").await.unwrap(), db.count("SELECT 1 FROM pgmq.a_default").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h26_a_process_pruned_while_its_jobs_renew_keeps_running_them() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("work", JobPolicy::on_queue(queue("default")))];
    let client = define(&db, &types).await;
    let job = client.enqueue_raw("work", &json!({"key": 1, "ms": 4000}), &EnqueueOptions::default()).await.unwrap();
    let config = RuntimeConfig {
        process_heartbeat_interval: Duration::from_millis(200),
        alive_threshold: Duration::from_secs(1),
        ..test_config()
    };
    let starts = Counter::default();
    let victim_probe = probe(&db, 0, &starts);
    let cancels = Arc::clone(&victim_probe.cancels);
    let pools = vec![PoolConfig::new("test", vec![queue("default")], 1)];
    let runtime =
        Runtime::new(db.new_pool(2).await.unwrap(), config.clone(), probe_registry(victim_probe, &types), pools)
            .unwrap()
            .with_name("victim");
    let victim = Running::spawn(runtime);
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    let first_id: i64 = sqlx::query_scalar("SELECT id FROM lockgate.processes WHERE name = 'victim'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // The victim's registry heartbeat stalls (its statements land, but its row's heartbeat time
    // stays put), while its job heartbeat carries on.
    sqlx::raw_sql(
        "CREATE FUNCTION public.stall_victim() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN NEW.last_heartbeat_at := OLD.last_heartbeat_at; RETURN NEW; END $$;
         CREATE TRIGGER stall_victim BEFORE UPDATE ON lockgate.processes
             FOR EACH ROW WHEN (OLD.name = 'victim') EXECUTE FUNCTION public.stall_victim();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Another process on the same queue prunes it, and would run the job if it were given up.
    let other = Running::start(&db, config, probe_registry(probe(&db, 1, &starts), &types), &["default"], 1).await;
    let second_id: i64 = wait_for("the victim to be pruned and to register again", WAIT, || async {
        Ok(sqlx::query_scalar("SELECT id FROM lockgate.processes WHERE name = 'victim' AND id <> $1")
            .bind(first_id)
            .fetch_optional(&db.pool)
            .await?)
    })
    .await
    .unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    other.stop().await;
    victim.stop().await;
    assert_eq!(starts.get(), 1, "the job ran once, by the pruned process");
    assert_eq!(started(&db, job.job_id.0).await, 1);
    assert!(cancels.lock().unwrap().is_empty(), "the pruned process never cancelled its healthy job");
    let (read_ct, owner): (i32, i64) =
        sqlx::query_as("SELECT read_ct, (headers->>'owner')::bigint FROM pgmq.a_default")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(read_ct, 1, "delivered once");
    assert!(owner >= second_id, "renewals re-tagged the message with the new registration ({owner} < {second_id})");
    common::assert_invariants_after_sweep(&db).await;
}

#[tokio::test]
async fn h29_a_queue_whose_claim_fails_never_stops_the_pools_other_queues() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("good_work", JobPolicy::on_queue(queue("good")))];
    let client = define(&db, &types).await;
    let starts = Counter::default();
    // "bad" comes first in the pool's order, so its failing claim runs before every claim of "good".
    let running =
        Running::start(&db, test_config(), probe_registry(probe(&db, 0, &starts), &types), &["bad", "good"], 2).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.processes WHERE kind = 'supervisor'", 1, WAIT)
        .await
        .unwrap();
    sqlx::query("DROP TABLE pgmq.q_bad").execute(&db.pool).await.unwrap();
    for n in 0..5 {
        client.enqueue_raw("good_work", &json!({"n": n}), &EnqueueOptions::default()).await.unwrap();
    }
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_good", 5, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(starts.get(), 5);
}

/// Review (helper-77, #1, #2, #4, #7): rows a producer or an operator can write stopped a whole
/// pool. Arguments nested deeper than the JSON decoder goes (accepted by `lockgate.enqueue`) and
/// an `enqueued_at` of `infinity` made the claim's decoding panic: the pool restarted at each
/// claim, and the jobs claimed with the row never ran. A `read_ct` at the integer's end failed
/// every claim of the queue, and a `returns` header past the deliveries made every delivery
/// attempt 1, retried for ever. Each such row now goes its own way, and the rest run.
#[tokio::test]
async fn h29_no_row_written_by_hand_stops_a_pool_or_the_jobs_claimed_with_it() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("good_work", JobPolicy::on_queue(queue("good")))];
    let client = define(&db, &types).await;
    let deep = (0..200).fold(json!({"bottom": true}), |inner, _| json!({ "a": inner }));
    sqlx::query("SELECT lockgate.enqueue('good_work', $1)").bind(&deep).execute(&db.pool).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO pgmq.q_good (enqueued_at, vt, message, headers)
         VALUES ('infinity', now(), '{\"n\": \"infinity\"}', '{\"type\": \"good_work\"}');
         INSERT INTO pgmq.q_good (read_ct, vt, message, headers)
         VALUES (2147483647, now(), '{\"n\": \"read_ct\"}', '{\"type\": \"good_work\"}');
         SELECT pgmq.send('good', '{\"n\": \"returns\"}'::jsonb, '{\"type\": \"good_work\", \"returns\": 999999999}'::jsonb);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for n in 0..5 {
        client.enqueue_raw("good_work", &json!({"n": n}), &EnqueueOptions::default()).await.unwrap();
    }
    let starts = Counter::default();
    let running =
        Running::start(&db, test_config(), probe_registry(probe(&db, 0, &starts), &types), &["good"], 16).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 3, WAIT).await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_good", 6, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(starts.get(), 6, "the five jobs and the one enqueued at infinity ran, once each");
    let dead: Vec<(String, String)> =
        sqlx::query_as("SELECT reason, error FROM lockgate.dead_letters ORDER BY COALESCE(args->>'n', 'deep')")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert!(dead[0].0 == "undecodable" && dead[0].1.contains("arguments cannot be read"), "{dead:?}");
    assert!(dead[1].0 == "attempts_exhausted" && dead[1].1.contains("would be attempt 21474836"), "{dead:?}");
    assert!(dead[2].0 == "undecodable" && dead[2].1.contains("returns 999999999"), "{dead:?}");
}

/// Review (helper-76, finding 3): the runtime's statements ran at the database's default
/// isolation, and at REPEATABLE READ a completion's snapshot may miss a job parked behind its key
/// since; such a completion now leaves its permit finished, for a give-back. The runtime's own
/// connections run at READ COMMITTED whatever the default, so its completions give permits back
/// themselves: nothing is left finished, and nothing is announced on `lockgate.finished`.
#[tokio::test]
async fn a_runtime_on_a_repeatable_read_database_completes_at_read_committed() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    sqlx::query(&format!("ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let mut policy = JobPolicy::on_queue(queue("default"));
    policy.concurrency = Some(ConcurrencyPolicy::new(1));
    let types = [("one_at_a_time", policy)];
    let client = define(&db, &types).await;
    for n in 0..3 {
        client.enqueue_raw("one_at_a_time", &json!({"n": n}), &EnqueueOptions::default()).await.unwrap();
    }
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener.listen(lockgate::sql::FINISHED_CHANNEL).await.unwrap();
    let starts = Counter::default();
    let running =
        Running::start(&db, test_config(), probe_registry(probe(&db, 0, &starts), &types), &["default"], 2).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 3, WAIT).await.unwrap();
    running.stop().await;
    let announced = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(announced.is_err(), "a completion left its permit finished: {announced:?}");
    assert!(max_overlap(&db.pool, -1).await.iter().all(|(_, n)| *n <= 1), "one job at a time");
}

/// Counts its starts and returns once released.
struct Held {
    starts: Counter,
    release: Arc<tokio::sync::Notify>,
}

impl RawHandler for Held {
    fn call(&self, _ctx: JobContext, _args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            self.starts.bump();
            self.release.notified().await;
            Ok(())
        })
    }
}

/// A server that turns read-only (a failover's demoted primary, or a managed database's
/// `default_transaction_read_only` when its disk fills) refuses a completion with SQLSTATE 25006:
/// nothing was written. The completion used to fail for good ("the job will run again"), and the
/// job that had succeeded ran again; with one attempt, it was dead-lettered. It is retried, and
/// lands once the server takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_refused_by_a_read_only_server_lands_once_it_is_writable_and_the_job_runs_once() {
    let db = TestDb::migrated().await.unwrap();
    let mut policy = JobPolicy::on_queue(queue("default"));
    policy.max_attempts = 1;
    let client = define(&db, &[("held", policy.clone())]).await;
    let (starts, release) = (Counter::default(), Arc::new(tokio::sync::Notify::new()));
    let mut registry = Registry::new();
    let handler = Held { starts: starts.clone(), release: Arc::clone(&release) };
    registry.register_raw(JobTypeName::new("held").unwrap(), policy, Arc::new(handler)).unwrap();
    let running = Running::start(&db, test_config(), registry, &["default"], 1).await;
    client.enqueue_raw("held", &json!({}), &EnqueueOptions::default()).await.unwrap();
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();

    // A session opened before the change keeps taking writes: it turns the server back.
    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let reconnect_all = format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = '{}' AND pid <> pg_backend_pid()",
        db.name
    );
    sqlx::query(&format!("ALTER DATABASE {} SET default_transaction_read_only = on", db.name))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query(&reconnect_all).execute(&mut admin).await.unwrap();
    // The completion is held at the queue's table, where it is seen, then let through to be
    // refused: its session, which refused, is closed.
    sqlx::raw_sql("BEGIN; LOCK TABLE pgmq.q_default IN ACCESS EXCLUSIVE MODE").execute(&mut admin).await.unwrap();
    release.notify_one();
    let completing = wait_for("the completion to wait at the queue's table", WAIT, || async {
        Ok(sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND state = 'active'
                AND wait_event_type = 'Lock' AND query LIKE '%lockgate.' || 'complete(%' LIMIT 1",
        )
        .fetch_optional(&db.pool)
        .await?)
    })
    .await
    .unwrap();
    sqlx::raw_sql("COMMIT").execute(&mut admin).await.unwrap();
    db.wait_session_ended("the refusing session to be closed", completing, WAIT).await.unwrap();
    // Writable again for new sessions only: the runtime's read-only ones are closed when they
    // refuse a write, not kept (review helper-89: it stayed stuck until they were ended).
    sqlx::query(&format!("ALTER DATABASE {} RESET default_transaction_read_only", db.name))
        .execute(&mut admin)
        .await
        .unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0);
    assert_eq!(starts.get(), 1, "the job ran again");
}

/// `/readyz` said ready while the server refused every write (review helper-89): a process that
/// can neither renew nor complete is not ready, and the reason names the refusal; it is ready
/// again once a heartbeat lands.
#[tokio::test]
async fn readiness_is_lost_while_the_server_refuses_writes_and_comes_back_with_them() {
    let db = TestDb::migrated().await.unwrap();
    define(&db, &[("noop", JobPolicy::on_queue(queue("default")))]).await;
    let config = RuntimeConfig { process_heartbeat_interval: Duration::from_millis(200), ..test_config() };
    let pools = vec![PoolConfig::new("test", vec![queue("default")], 1)];
    let runtime = Runtime::new(db.new_pool(2).await.unwrap(), config, Registry::new(), pools).unwrap();
    let health = runtime.health();
    let running = Running::spawn(runtime);
    let ready = || {
        let health = Arc::clone(&health);
        async move { Ok(health.readiness().is_ok().then_some(())) }
    };
    wait_for("the runtime to be ready", WAIT, ready).await.unwrap();

    // A session opened before the change keeps taking writes: it turns the server back.
    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query(&format!("ALTER DATABASE {} SET default_transaction_read_only = on", db.name))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(&db.name)
    .execute(&mut admin)
    .await
    .unwrap();
    let reasons = wait_for("the runtime to say it is not ready", WAIT, || {
        let health = Arc::clone(&health);
        async move { Ok(health.readiness().err()) }
    })
    .await
    .unwrap();
    assert!(
        reasons.iter().any(|r| r.starts_with("process heartbeat failing") && r.contains("refuses writes (read-only)")),
        "{reasons:?}"
    );
    sqlx::query(&format!("ALTER DATABASE {} RESET default_transaction_read_only", db.name))
        .execute(&mut admin)
        .await
        .unwrap();
    wait_for("the runtime to be ready again", WAIT, ready).await.unwrap();
    running.stop().await;
}

/// Review of §89 (helper-91, F2): readiness followed the registry's whole tick, prune included. A
/// prune of a silent process fails while a queue's table is locked (it counts the dead process's
/// messages there), and every live process went not ready, blaming a heartbeat that landed. The
/// process's own beat decides; the prune's failure is only logged.
#[tokio::test]
async fn a_failing_prune_of_another_process_keeps_a_beating_process_ready() {
    let db = TestDb::migrated().await.unwrap();
    define(&db, &[("noop", JobPolicy::on_queue(queue("default")))]).await;
    let config = RuntimeConfig {
        process_heartbeat_interval: Duration::from_millis(200),
        alive_threshold: Duration::from_millis(600),
        ..test_config()
    };
    let pools = vec![PoolConfig::new("test", vec![queue("default")], 1)];
    let runtime = Runtime::new(db.new_pool(2).await.unwrap(), config, Registry::new(), pools).unwrap();
    let health = runtime.health();
    let running = Running::spawn(runtime);
    wait_for("the runtime to be ready", WAIT, || {
        let health = Arc::clone(&health);
        async move { Ok(health.readiness().is_ok().then_some(())) }
    })
    .await
    .unwrap();
    let mut locker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE pgmq.q_default IN ACCESS EXCLUSIVE MODE").execute(&mut locker).await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.register_process('supervisor', 'ghost', 'elsewhere', 1);
         UPDATE lockgate.processes SET last_heartbeat_at = now() - interval '1 hour' WHERE name = 'ghost';",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    wait_for("a prune to wait for the queue's table", WAIT, || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                AND wait_event_type = 'Lock' AND query LIKE '%prune' || '_processes%'",
        )
        .fetch_one(&db.pool)
        .await?;
        Ok((waiting > 0).then_some(()))
    })
    .await
    .unwrap();
    // Several ticks, each prune giving up at its lock timeout (100 ms): ready throughout.
    let until = std::time::Instant::now() + Duration::from_millis(1500);
    while std::time::Instant::now() < until {
        assert!(health.readiness().is_ok(), "{:?}", health.readiness());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(db.count("SELECT 1 FROM lockgate.processes WHERE name = 'ghost'").await.unwrap(), 1, "never pruned");
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
    running.stop().await;
}

/// A managed database's `idle_session_timeout` ends sessions idle past it. The runtime's
/// connections idle between uses by design (the heartbeat's between renewals, the pool's between
/// completions): each renewal and completion met a connection the server had ended, failed for
/// good, and every job ran again and was dead-lettered (review helper-80).
#[tokio::test]
async fn g5_a_database_idle_session_timeout_never_fails_a_renewal_or_a_completion() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    sqlx::query(&format!("ALTER DATABASE {} SET idle_session_timeout = '100ms'", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let mut policy = JobPolicy::on_queue(queue("default"));
    policy.max_attempts = 1;
    let types = [("patient", policy)];
    let client = define(&db, &types).await;
    let starts = Counter::default();
    // Heartbeats every 300 ms, each job running 800 ms: every renewal and every completion comes
    // after its connection idled past the timeout.
    let running =
        Running::start(&db, test_config(), probe_registry(probe(&db, 0, &starts), &types), &["default"], 2).await;
    for n in 0..4 {
        client.enqueue_raw("patient", &json!({"n": n, "ms": 800}), &EnqueueOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 4, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0);
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default WHERE read_ct > 1").await.unwrap(), 0, "a job ran again");
    assert_eq!(starts.get(), 4);
}

/// A pooled session that refused to write is closed, not given back: its read-only default,
/// set for its database when it began, outlives the database's RESET, and the pool would lend it
/// again and again (review helper-89).
#[tokio::test]
async fn a_pooled_session_that_refused_to_write_is_closed_not_lent_again() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('plain')").execute(&db.pool).await.unwrap();
    sqlx::query(&format!("ALTER DATABASE {} SET default_transaction_read_only = on", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let one = db.new_pool(1).await.unwrap();
    let refused = lockgate::sql::pause_queue(&one, "default").await.unwrap_err();
    assert!(refused.is_read_only() && refused.is_transient(), "{refused}");
    let mut admin = sqlx::PgConnection::connect(&lockgate_testkit::server_url()).await.unwrap();
    sqlx::query(&format!("ALTER DATABASE {} RESET default_transaction_read_only", db.name))
        .execute(&mut admin)
        .await
        .unwrap();
    assert!(lockgate::sql::pause_queue(&one, "default").await.unwrap(), "paused on a new session");
}

/// The LISTEN connection of `listen_database_url` (a direct URL beside a pooled one, where
/// startup options may be refused) idles by design as well: it turns `idle_session_timeout` off
/// once connected, and the server never ends it.
#[tokio::test]
async fn g5_the_listen_connection_of_a_listen_url_outlives_a_database_idle_session_timeout() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query(&format!("ALTER DATABASE {} SET idle_session_timeout = '100ms'", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let types = [("patient", JobPolicy::on_queue(queue("default")))];
    define(&db, &types).await;
    let config = RuntimeConfig { listen_database_url: Some(db.url.clone()), ..test_config() };
    let starts = Counter::default();
    let running = Running::start(&db, config, probe_registry(probe(&db, 0, &starts), &types), &["default"], 1).await;
    let listener = || async {
        sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%'",
        )
        .fetch_optional(&db.pool)
        .await
    };
    let first = wait_for("the LISTEN connection", WAIT, || async { Ok(listener().await?) }).await.unwrap();
    // Twice the server's timeout, on its own clock: a session of the database's, left idle, ends.
    for _ in 0..2 {
        let mut idle = sqlx::PgConnection::connect(&db.url).await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut idle).await.unwrap();
        db.wait_session_ended("the server to end an idle session", pid, WAIT).await.unwrap();
    }
    assert_eq!(listener().await.unwrap(), Some(first), "the LISTEN connection was ended and made again");
    running.stop().await;
}

/// What the server ends for idling has run nothing: a completion or renewal meeting it on a
/// pooled connection (a handler's pool, or any under transaction pooling, which sets no startup
/// options) retries on a new connection rather than failing for good.
#[tokio::test]
async fn a_session_or_transaction_the_server_ended_for_idling_is_a_transient_error() {
    let db = TestDb::migrated().await.unwrap();
    for (setup, what) in [
        ("SET idle_session_timeout = '50ms'", "idle session"),
        ("BEGIN; SET LOCAL idle_in_transaction_session_timeout = '50ms'; SELECT 1", "idle transaction"),
    ] {
        let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut conn).await.unwrap();
        sqlx::raw_sql(setup).execute(&mut conn).await.unwrap();
        db.wait_session_ended("the server to end the idle connection", pid, WAIT).await.unwrap();
        let error = sqlx::query("SELECT 1").execute(&mut conn).await.unwrap_err();
        let error = lockgate::sql::DbError::from(error);
        assert!(error.is_transient(), "{what}: {error} is final");
    }
}

/// Runs until cancelled; then takes `wind_down` to return, awaiting, and
/// records the wall-clock instant it ended, however it ended (returned or dropped).
struct Stubborn {
    starts: Counter,
    wind_down: Duration,
    ended: Arc<Mutex<Option<SystemTime>>>,
}

struct RecordEnd(Arc<Mutex<Option<SystemTime>>>);

impl Drop for RecordEnd {
    fn drop(&mut self) {
        *self.0.lock().unwrap() = Some(SystemTime::now());
    }
}

impl RawHandler for Stubborn {
    fn call(&self, ctx: JobContext, _args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            let _end = RecordEnd(Arc::clone(&self.ended));
            self.starts.bump();
            ctx.cancelled().await;
            tokio::time::sleep(self.wind_down).await;
            Ok(())
        })
    }
}

async fn stubborn_run(wind_down: Duration) -> (TestDb, Option<SystemTime>) {
    let db = TestDb::migrated().await.unwrap();
    let types = [("stubborn", JobPolicy::on_queue(queue("default")))];
    let client = define(&db, &types).await;
    client.enqueue_raw("stubborn", &json!({}), &EnqueueOptions::default()).await.unwrap();
    let (starts, ended) = (Counter::default(), Arc::new(Mutex::new(None)));
    let handler = Arc::new(Stubborn { starts: starts.clone(), wind_down, ended: Arc::clone(&ended) });
    let mut registry = Registry::new();
    registry.register_raw(JobTypeName::new("stubborn").unwrap(), types[0].1.clone(), handler).unwrap();
    let config = RuntimeConfig { shutdown_timeout: Duration::from_millis(200), ..test_config() };
    let running = Running::start(&db, config, registry, &["default"], 1).await;
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    running.stop().await;
    let ended = *ended.lock().unwrap();
    (db, ended)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h30_shutdown_returns_a_job_only_after_its_handler_has_ended() {
    // The handler takes 50 ms to wind down after shutdown cancels it, within its grace.
    let (db, ended) = stubborn_run(Duration::from_millis(50)).await;
    let ended: chrono::DateTime<chrono::Utc> = ended.expect("the handler ended before the runtime stopped").into();
    let (returned_at, returns): (chrono::DateTime<chrono::Utc>, Option<i32>) =
        sqlx::query_as("SELECT vt, (headers->>'returns')::int FROM pgmq.q_default").fetch_one(&db.pool).await.unwrap();
    assert_eq!(returns, Some(1), "returned to its queue");
    assert!(returned_at >= ended, "returned at {returned_at}, before its handler ended at {ended}");
}

/// Records its runs in `runs` as worker 0's. The first attempt of a job with `"obstinate": true`
/// then waits until it is told to stop (a cancel, its timeout, a shutdown) and blocks its thread
/// for `block` before it ends: a synchronous call nothing can interrupt. Other runs take 10 ms.
/// The blocked run's end is kept in `ended` at once: its task, aborted meanwhile, is dropped at
/// its next await, before it could record it in `runs`. With `offload`, the blocking call runs in
/// `spawn_blocking` under a hold of the attempt (`JobContext::hold`), and the handler returns
/// without waiting for it.
struct Obstinate {
    pool: PgPool,
    block: Duration,
    offload: bool,
    /// Counts the runs told to stop (they then block).
    told: Counter,
    /// Awaits once between being told and blocking.
    yields: bool,
    ended: Arc<Mutex<Option<chrono::DateTime<chrono::Utc>>>>,
}

impl RawHandler for Obstinate {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            common::run_started(&self.pool, ctx.job_id.0, &args["key"].to_string(), 0).await;
            if args["obstinate"] == json!(true) && ctx.attempt == 1 {
                ctx.cancelled().await;
                self.told.bump();
                let (block, ended) = (self.block, Arc::clone(&self.ended));
                let blocking = move || {
                    std::thread::sleep(block);
                    *ended.lock().unwrap() = Some(chrono::Utc::now());
                };
                if self.offload {
                    let hold = ctx.hold();
                    tokio::task::spawn_blocking(move || {
                        blocking();
                        drop(hold);
                    });
                    return Ok(());
                }
                if self.yields {
                    // An await first (as cleanup that awaits does): the executor, woken by a
                    // timeout fired on this thread, runs elsewhere rather than wait behind the block.
                    tokio::task::yield_now().await;
                }
                blocking();
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            common::run_ended(&self.pool, ctx.job_id.0, 0).await;
            Ok(())
        })
    }
}

/// Worker 0 runs `types` with `Obstinate` (blocking twice the visibility timeout) on queue
/// `default`, worker 1 with a probe on `default` and `other`, both at concurrency 1. Enqueues an
/// obstinate job of key 1 and then a plain one of the same key into `other` (so that worker 0,
/// its slot taken by the blocked run, cannot claim it ahead and hold it until that run ends,
/// which would hide an early permit), waits for worker 0 to start the first, applies `stop_it` to it, and waits until
/// the plain one has completed. Then: no two runs of key 1 overlapped,
/// counting the blocked run until it ended, and the second job started only after it; the
/// permits held throughout (the monitor) and the invariants hold. `stop_it` returns worker 0
/// when it did not stop it; when it did, the stop returned only after the blocked run ended.
/// Returns the database, for more checks.
async fn obstinate_then_next(
    types: &[(&str, JobPolicy)],
    config: RuntimeConfig,
    offload: bool,
    stop_it: impl AsyncFnOnce(&TestDb, &Client, i64, Running) -> Option<Running>,
) -> TestDb {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let client = define(&db, types).await;
    lockgate::sql::create_queue(&db.pool, "other").await.unwrap();
    // The runtimes' interval, recorded before the enqueue: the first job's lease then lasts its
    // second, not the ten of the default interval's floor, and would run out during the block.
    lockgate::sql::record_heartbeat_interval(&db.pool, config.heartbeat_interval).await.unwrap();
    let first =
        client.enqueue_raw("serial", &json!({"key": 1, "obstinate": true}), &EnqueueOptions::default()).await.unwrap();
    let elsewhere = EnqueueOptions { queue: Some(queue("other")), ..EnqueueOptions::default() };
    let next = client.enqueue_raw("serial", &json!({"key": 1}), &elsewhere).await.unwrap();
    let ended = Arc::new(Mutex::new(None));
    let block = config.visibility_timeout * 2;
    let pool = db.new_pool(2).await.unwrap();
    let told = Counter::default();
    let obstinate = Arc::new(Obstinate { pool, block, offload, told, yields: true, ended: Arc::clone(&ended) });
    let worker0 = Running::start(&db, config.clone(), handled_by(obstinate, types), &["default"], 1).await;
    wait_for("worker 0 to start the obstinate job", WAIT, || async {
        Ok((started(&db, first.job_id.0).await == 1).then_some(()))
    })
    .await
    .unwrap();
    let worker1 = Running::start(
        &db,
        config,
        probe_registry(probe(&db, 1, &Counter::default()), types),
        &["default", "other"],
        1,
    )
    .await;
    let worker0 = stop_it(&db, &client, first.job_id.0, worker0).await;
    let stop_returned = chrono::Utc::now();
    wait_for("the next job of key 1 to complete", Duration::from_secs(30), || async {
        let done = format!("SELECT 1 FROM runs WHERE job_id = {} AND ended_at IS NOT NULL", next.job_id.0);
        Ok((db.count(&done).await? == 1).then_some(()))
    })
    .await
    .unwrap();
    wait_for("the blocked run to end", WAIT, || async { Ok(ended.lock().unwrap().map(|_| ())) }).await.unwrap();
    worker1.stop().await;
    let stopped = worker0.is_none();
    if let Some(worker0) = worker0 {
        worker0.stop().await;
    }
    let blocked_end = ended.lock().unwrap().expect("the blocked run ended");
    if stopped {
        assert!(
            stop_returned >= blocked_end,
            "run returned at {stop_returned}, before its handler ended at {blocked_end}"
        );
    }
    sqlx::query(
        "UPDATE runs SET ended_at = $2
          WHERE ctid = (SELECT ctid FROM runs WHERE job_id = $1 AND worker = 0 ORDER BY started_at LIMIT 1)",
    )
    .bind(first.job_id.0)
    .bind(blocked_end)
    .execute(&db.pool)
    .await
    .unwrap();
    let next_start: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT started_at FROM runs WHERE job_id = $1")
        .bind(next.job_id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        next_start >= blocked_end,
        "the next job of key 1 started at {next_start}, while the blocked run went on until {blocked_end}"
    );
    let overlap = max_overlap(&db.pool, -1).await.into_iter().find(|(key, _)| key == "1");
    assert_eq!(overlap, Some(("1".to_string(), 1)), "no overlap on key 1");
    common::assert_invariants_after_sweep(&db).await;
    db
}

/// Design §95: a job cancelled while its handler blocks its thread keeps its permit until that
/// handler has ended. The handler is told, cannot be aborted, and blocks for twice the
/// visibility timeout, far past the lease of one second it held at the cancel: its heartbeat
/// renews that lease (`lockgate.extend_cancelled`) while the handler's task exists, and gives it
/// back once it has ended; only then does the next job of its key start, on the other worker.
/// Before, the permit ran out with the lease, and the next job ran beside the blocked one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn g3_a_cancelled_job_whose_handler_will_not_stop_keeps_its_permit_until_the_handler_ends() {
    cancel_obstinate_then_next(false).await;
}

/// `obstinate_then_next` on a limit of 1 with a lease of one second, the obstinate job cancelled
/// through the client once it runs.
async fn cancel_obstinate_then_next(offload: bool) {
    let types = [("serial", limited("default", 1, Duration::from_secs(1)))];
    obstinate_then_next(&types, fast_config(), offload, async |_db, client, job_id, worker0| {
        let outcome = client.cancel(lockgate::JobId(job_id)).await.unwrap().unwrap();
        assert!(outcome.cancelled, "cancelled while running: {outcome:?}");
        Some(worker0)
    })
    .await;
}

/// Design §95: work a handler hands to `spawn_blocking` under a hold of its attempt
/// (`JobContext::hold`) keeps the job leased after the handler has returned: cancelled, the job
/// keeps its permit until that work drops the hold, and the next job of its key starts only then.
/// Before, nothing in the runtime saw such work: once the handler returned, the permit went back
/// and the next job ran beside it (review helper-103).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn g3_work_a_cancelled_handler_left_holding_keeps_its_permit_until_it_ends() {
    cancel_obstinate_then_next(true).await;
}

/// Review helper-105 (F1): the heartbeat that finds a cancelled job's message gone asks the
/// archive whether it was cancelled. When that question cannot be answered in time (the archive
/// locked, here just after the cancel committed), the delivery was taken for a lost lease, its
/// kept permit was never renewed, and the next job of its key ran beside the blocked handler
/// (3.3 s). Not knowing, the heartbeat now keeps what a cancel may have kept for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn g3_a_cancel_seen_while_the_archive_cannot_be_read_still_keeps_the_permit() {
    let types = [("serial", limited("default", 1, Duration::from_secs(1)))];
    obstinate_then_next(&types, fast_config(), false, async |db, _, job_id, worker0| {
        let mut cancel = db.pool.begin().await.unwrap();
        sqlx::query("SELECT * FROM lockgate.cancel($1)").bind(job_id).execute(&mut *cancel).await.unwrap();
        let mut locker = sqlx::PgConnection::connect(&db.url).await.unwrap();
        // The archive's lock is queued behind the cancel, and taken the moment it commits: the
        // heartbeat then sees the message gone, and cannot read the archive for 1.5 intervals.
        let lock = sqlx::raw_sql("BEGIN; LOCK TABLE pgmq.a_default IN ACCESS EXCLUSIVE MODE").execute(&mut locker);
        let commit = async {
            let queued = "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'pgmq.a_default'::regclass";
            wait_for_count(&db.pool, queued, 1, WAIT).await.unwrap();
            cancel.commit().await.unwrap();
        };
        let (locked, ()) = tokio::join!(lock, commit);
        locked.unwrap();
        tokio::time::sleep(Duration::from_millis(450)).await;
        sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
        Some(worker0)
    })
    .await;
}

/// Review helper-107 (F2): while the archive cannot be read (a `VACUUM FULL`, a `CLUSTER`), a
/// delivery whose lease was really lost (its message made visible and claimed by another worker)
/// was taken for "busy" and its handler ran on beside the new delivery until the watchdog fenced
/// it at its budget (5.7 s). Not knowing whether it was cancelled, the heartbeat now tells its
/// handler at once that its lease is lost, and keeps only what a cancel may have kept for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h27_a_lease_lost_while_the_archive_cannot_be_read_stops_its_handler_at_once() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("held", JobPolicy::on_queue(queue("default")))];
    let client = define(&db, &types).await;
    let job = client.enqueue_raw("held", &json!({"hold": true}), &EnqueueOptions::default()).await.unwrap();
    let (starts, own) = (Counter::default(), probe(&db, 0, &Counter::default()));
    let (cancels, probe0) = (Arc::clone(&own.cancels), Probe { starts: starts.clone(), ..own });
    // A budget of 6 s: the watchdog would fence the handler only then.
    let config = RuntimeConfig { visibility_timeout: Duration::from_secs(6), ..fast_config() };
    let running = Running::start(&db, config, probe_registry(probe0, &types), &["default"], 1).await;
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    let mut locker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE pgmq.a_default IN ACCESS EXCLUSIVE MODE").execute(&mut locker).await.unwrap();
    // Another worker takes the message over behind the first one's back.
    sqlx::query("SELECT pgmq.set_vt('default', $1, 0)").bind(job.msg_id).execute(&db.pool).await.unwrap();
    let taken = db.count("SELECT 1 FROM lockgate.claim('default', 1, 30)").await.unwrap();
    assert_eq!(taken, 1);
    let since = std::time::Instant::now();
    let told = wait_for("the first handler to be told its lease is lost", WAIT, || async {
        Ok(cancels.lock().unwrap().first().cloned())
    })
    .await
    .unwrap();
    let waited = since.elapsed();
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
    running.stop().await;
    assert_eq!(told.reason, Some(CancelReason::LeaseLost));
    assert!(waited < Duration::from_secs(2), "told after {waited:?}, not at once (its budget was 6 s)");
}

/// Returns at once, leaving its work to `spawn_blocking` under a hold of the attempt for `work`;
/// records its starts, and whether the work was told to stop.
struct Lingering {
    work: Duration,
    starts: Counter,
    told: Arc<Mutex<Option<bool>>>,
}

impl RawHandler for Lingering {
    fn call(&self, ctx: JobContext, _args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            let hold = ctx.hold();
            let (work, told) = (self.work, Arc::clone(&self.told));
            if self.starts.bump() == 1 {
                tokio::task::spawn_blocking(move || {
                    std::thread::sleep(work);
                    *told.lock().unwrap() = Some(ctx.is_cancelled());
                    drop(hold);
                });
            }
            Ok(())
        })
    }
}

/// Review helper-105 (F2): a handler that returned `Ok` while work it held went on past
/// `shutdown_timeout` had its outcome dropped: shutdown took it for a running job, returned it,
/// and it ran again. Its outcome is decided once the handler returns: shutdown tells the held work
/// to stop, and the job is completed once that work has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn g7_a_handler_that_returned_while_its_held_work_outlives_shutdown_timeout_is_completed() {
    let db = TestDb::migrated().await.unwrap();
    let types = [("work", JobPolicy::on_queue(queue("default")))];
    let client = define(&db, &types).await;
    client.enqueue_raw("work", &json!({}), &EnqueueOptions::default()).await.unwrap();
    let (starts, told) = (Counter::default(), Arc::new(Mutex::new(None)));
    let handler = Arc::new(Lingering { work: Duration::from_millis(1500), starts: starts.clone(), told: told.clone() });
    let config = RuntimeConfig { shutdown_timeout: Duration::from_millis(200), ..fast_config() };
    let running = Running::start(&db, config, handled_by(handler, &types), &["default"], 1).await;
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    running.stop().await;
    assert_eq!(*told.lock().unwrap(), Some(true), "the held work was told to stop, and ended before run returned");
    let (queued, archived) = (db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), archived_jobs(&db).await);
    assert_eq!((queued, archived), (0, 1), "completed, not returned to run again");
}

/// Review helper-105 (F3): an attempt whose timeout passed, and whose handler then blocked on
/// into a shutdown, was returned by the shutdown: no attempt counted, its timeout not recorded,
/// and a job that always does so gained an attempt from every deploy. Its outcome is decided when
/// its timeout passes: with `max_attempts` 1, it is dead-lettered once the handler has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn g7_a_timed_out_attempt_that_blocks_into_a_shutdown_still_counts() {
    let db = TestDb::migrated().await.unwrap();
    let mut policy = JobPolicy::on_queue(queue("default"));
    policy.timeout = Some(Duration::from_millis(200));
    policy.max_attempts = 1;
    let types = [("serial", policy)];
    let client = define(&db, &types).await;
    install_permit_monitor(&db).await;
    let job = client.enqueue_raw("serial", &json!({"key": 1, "obstinate": true}), &EnqueueOptions::default()).await;
    let job = job.unwrap().job_id.0;
    let pool = db.new_pool(2).await.unwrap();
    let (ended, told) = (Arc::new(Mutex::new(None)), Counter::default());
    let block = Duration::from_millis(1500);
    // It blocks at once: the executor, woken on the blocked thread by the timeout, cannot mark the
    // attempt failed before the shutdown comes (review helper-107).
    let obstinate =
        Arc::new(Obstinate { pool, block, offload: false, told: told.clone(), yields: false, ended: ended.clone() });
    let config = RuntimeConfig { shutdown_timeout: Duration::from_millis(100), ..fast_config() };
    let running = Running::start(&db, config, handled_by(obstinate, &types), &["default"], 1).await;
    // Timed out at 200 ms, it blocks for 1.5 s: the shutdown lands in between.
    wait_for("the job to time out", WAIT, || async { Ok((told.get() == 1).then_some(())) }).await.unwrap();
    running.stop().await;
    assert!(ended.lock().unwrap().is_some(), "run returned before the blocked attempt ended");
    assert_eq!(db.count(&format!("SELECT 1 FROM runs WHERE job_id = {job}")).await.unwrap(), 1);
    let dead = db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap();
    assert_eq!(dead, 1, "max_attempts 1: the timed-out attempt dead-letters the job");
}

/// Design §95: a handler that blocks its thread when its timeout tells it to stop keeps its job
/// leased until it has ended: its retry is written only then. Before, the executor gave up on it
/// after 100 ms and wrote the retry at once, and the retry ran on the other worker beside the
/// blocked attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn g3_a_timed_out_handler_that_will_not_stop_holds_its_permit_until_it_ends() {
    let mut policy = limited("default", 1, Duration::from_secs(1));
    policy.timeout = Some(Duration::from_millis(300));
    policy.max_attempts = 2;
    // Retried at once: the retry keeps the job's permit through its backoff (G6), and a retry
    // written too early would run on worker 1 beside the blocked attempt.
    policy.backoff = lockgate::Backoff { base: Duration::from_millis(1), max: Duration::from_millis(1), jitter: 0.0 };
    let db =
        obstinate_then_next(&[("serial", policy)], fast_config(), false, async |_, _, _, worker0| Some(worker0)).await;
    let attempts: i64 =
        sqlx::query_scalar("SELECT count(*) FROM runs WHERE key = '1'").fetch_one(&db.pool).await.unwrap();
    assert_eq!(attempts, 3, "the timed-out job ran again after its retry, and the next job once");
}

/// H30 and G7 together, for a handler that will not stop: shutdown cancels it, cannot abort it
/// (it blocks its thread for twice the visibility timeout), and waits for it, renewing its job
/// and permit meanwhile; once it has ended, the job is returned to its queue, visible at once,
/// and `run` returns. The other worker runs it, and the next job of its key, only then. Before, shutdown gave up on the handler after
/// 100 ms and let the job's visibility lapse: the other worker ran it again beside the blocked
/// run, and `run` returned while that run went on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn h30_shutdown_waits_for_a_handler_that_will_not_stop_renewing_its_job_and_returns_it_when_it_ends() {
    let types = [("serial", limited("default", 1, Duration::from_secs(1)))];
    let config = RuntimeConfig { shutdown_timeout: Duration::from_millis(200), ..fast_config() };
    let db = obstinate_then_next(&types, config, false, async |_, _, _, worker0| {
        worker0.stop().await;
        None
    })
    .await;
    let returns: Vec<Option<i32>> =
        sqlx::query_scalar("SELECT (headers->>'returns')::int FROM pgmq.a_default ORDER BY msg_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(returns, vec![Some(1)], "the blocked job was returned once, then completed");
}

/// The lease floor (twice the longest recorded heartbeat interval, H10) comes back within a
/// process beat when `lockgate.settings` is lowered or its row deleted while a process runs (an
/// operator's edit, a restore of an old copy): each beat records the process's interval again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_or_deleted_heartbeat_interval_is_recorded_again_by_the_next_process_beat() {
    let db = TestDb::migrated().await.unwrap();
    let types = [("work", JobPolicy::on_queue(queue("default")))];
    define(&db, &types).await;
    let config = RuntimeConfig { process_heartbeat_interval: Duration::from_millis(200), ..test_config() };
    let expected = i64::try_from(config.heartbeat_interval.as_millis()).unwrap();
    let registry = probe_registry(probe(&db, 0, &Counter::default()), &types);
    let running = Running::start(&db, config, registry, &["default"], 1).await;
    let recorded = || async {
        let ms: Option<i64> =
            sqlx::query_scalar("SELECT heartbeat_interval_ms FROM lockgate.settings").fetch_optional(&db.pool).await?;
        Ok((ms == Some(expected)).then_some(()))
    };
    wait_for("the start to record the interval", WAIT, recorded).await.unwrap();
    for edit in ["UPDATE lockgate.settings SET heartbeat_interval_ms = 1", "DELETE FROM lockgate.settings"] {
        sqlx::query(edit).execute(&db.pool).await.unwrap();
        wait_for(&format!("a beat to record the interval again after {edit}"), Duration::from_secs(5), recorded)
            .await
            .unwrap();
    }
    running.stop().await;
}

/// Runs its first job with its thread blocked for `block` (a synchronous call, CPU work without
/// `spawn_blocking`), once the next job is claimed; its runs are recorded as worker 0's.
struct Blocking {
    pool: PgPool,
    block: Duration,
    starts: Counter,
}

impl RawHandler for Blocking {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            common::run_started(&self.pool, ctx.job_id.0, &args["key"].to_string(), 0).await;
            if self.starts.bump() == 1 {
                // Blocks only once the pool holds the next job claimed ahead (its claim answered,
                // and the pool's loop, woken before this handler, has taken it in).
                wait_for_count(&self.pool, "SELECT count(*) FROM pgmq.q_default WHERE read_ct > 0", 2, WAIT)
                    .await
                    .unwrap();
                std::thread::sleep(self.block);
            }
            common::run_ended(&self.pool, ctx.job_id.0, 0).await;
            Ok(())
        })
    }
}

/// A handler that blocks every thread of the runtime it runs on (here the only one, as under
/// `#[tokio::main(flavor = "current_thread")]`) for twice the visibility timeout stops no renewal
/// of a running job: the heartbeat runs on a thread of its own, so the job keeps its message and
/// its permit, and no other worker runs a job of its key beside it. Before, the heartbeat was a
/// task of that runtime; the job's visibility and lease lapsed, and a second worker ran it again
/// beside the first run. A job claimed ahead behind the blocked one is not kept waiting for the
/// stall to end: the runtime answers no probe, so the heartbeat leaves it to lapse, and the
/// second worker runs it meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_a_handler_that_blocks_every_thread_of_its_runtime_keeps_its_lease_and_runs_alone() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types =
        [("serial", limited("default", 1, Duration::from_secs(2))), ("free", JobPolicy::on_queue(queue("default")))];
    let client = define(&db, &types).await;
    let first = client.enqueue_raw("serial", &json!({"key": 1}), &EnqueueOptions::default()).await.unwrap();
    let ahead = client.enqueue_raw("free", &json!({"key": "f"}), &EnqueueOptions::default()).await.unwrap();
    client.enqueue_raw("serial", &json!({"key": 1}), &EnqueueOptions::default()).await.unwrap();
    let config = fast_config();
    let blocking =
        // A pool of its own: its connections are opened on the runtime the test drops.
        Arc::new(Blocking { pool: db.new_pool(2).await.unwrap(), block: config.visibility_timeout * 2, starts: Counter::default() });
    let (stop, worker0) =
        on_own_runtime(current_thread(), db.url.clone(), config.clone(), handled_by(blocking, &types));
    // Worker 0 starts the first job, which blocks its thread, and holds the free one claimed ahead.
    wait_for("worker 0 to start the first job and claim the next ahead", WAIT, || async {
        let claimed = db.count("SELECT 1 FROM pgmq.q_default WHERE read_ct > 0").await?;
        let started = db.count("SELECT 1 FROM runs WHERE worker = 0").await?;
        Ok((claimed == 2 && started == 1).then_some(()))
    })
    .await
    .unwrap();
    let worker1 =
        Running::start(&db, config, probe_registry(probe(&db, 1, &Counter::default()), &types), &["default"], 1).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 3, WAIT).await.unwrap();
    stop.send(()).unwrap();
    tokio::task::spawn_blocking(move || worker0.join()).await.unwrap().unwrap();
    worker1.stop().await;
    assert_eq!(started(&db, first.job_id.0).await, 1, "the blocked job ran once");
    let overlap = max_overlap(&db.pool, -1).await.into_iter().find(|(key, _)| key == "1");
    assert_eq!(overlap, Some(("1".to_string(), 1)), "no overlap on key 1, counting every worker");
    let (by, during): (i32, bool) = sqlx::query_as(
        "SELECT a.worker, a.started_at < (SELECT ended_at FROM runs WHERE job_id = $2)
           FROM runs a WHERE a.job_id = $1",
    )
    .bind(ahead.job_id.0)
    .bind(first.job_id.0)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        by == 1 && during,
        "the job claimed ahead ran on worker 1 while worker 0 was blocked (by {by}, during {during})"
    );
    common::assert_invariants_after_sweep(&db).await;
}

/// The heartbeat's thread ends with the runtime's `run`, however it ends: a tokio runtime shut
/// down under a running `run` (its future dropped) leaves no thread renewing the leases of jobs
/// that no handler runs any more; they lapse and come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_with_its_tokio_runtime_leaves_nothing_renewing_its_jobs() {
    let db = TestDb::migrated().await.unwrap();
    let types = [("held", JobPolicy::on_queue(queue("default")))];
    let client = define(&db, &types).await;
    client.enqueue_raw("held", &json!({"hold": true}), &EnqueueOptions::default()).await.unwrap();
    install_permit_monitor(&db).await;
    let (url, config, starts) = (db.url.clone(), fast_config(), Counter::default());
    // The handler's writes go through a pool of its own: a connection opened on the runtime
    // about to be dropped is dead once it is, and must not be lent to the test afterwards.
    let own = Probe { pool: db.new_pool(1).await.unwrap(), ..probe(&db, 0, &starts) };
    let registry = probe_registry(own, &types);
    // Dropping the runtime drops every task of it, handlers included.
    let (stop, worker) = on_own_runtime(current_thread(), url, config, registry);
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    stop.send(()).unwrap();
    tokio::task::spawn_blocking(move || worker.join()).await.unwrap().unwrap();
    wait_for("the job's visibility to lapse, renewed by no one", WAIT, || async {
        let lapsed: bool =
            sqlx::query_scalar("SELECT vt < clock_timestamp() FROM pgmq.q_default").fetch_one(&db.pool).await?;
        Ok(lapsed.then_some(()))
    })
    .await
    .unwrap();
}

/// Shutdown's deregistration rides out a moment when its row is locked past the statement's
/// budget (another session reading `lockgate.processes` FOR UPDATE): it tries again, and the
/// process is gone from the registry when `run` returns. Before, one failure left its row to be
/// pruned a minute later (review helper-99).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g7_a_deregistration_that_meets_a_locked_row_tries_again_before_run_returns() {
    let db = TestDb::migrated().await.unwrap();
    let types = [("work", JobPolicy::on_queue(queue("default")))];
    define(&db, &types).await;
    let config = RuntimeConfig { process_heartbeat_interval: Duration::from_millis(400), ..test_config() };
    let registry = probe_registry(probe(&db, 0, &Counter::default()), &types);
    let running = Running::start(&db, config, registry, &["default"], 1).await;
    wait_for_count(&db.pool, "SELECT least(count(*), 1) FROM lockgate.processes", 1, WAIT).await.unwrap();
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut tx = holder.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM lockgate.processes FOR UPDATE").execute(&mut *tx).await.unwrap();
    let stopping = tokio::spawn(running.stop());
    // The deregistration waits for the row, gives up at its lock budget and waits again.
    let waiting = "SELECT query_start FROM pg_stat_activity
                    WHERE datname = current_database() AND wait_event_type = 'Lock'
                      AND query LIKE '%deregister_process%'";
    let first: chrono::DateTime<chrono::Utc> = wait_for("the deregistration to wait", WAIT, || async {
        Ok(sqlx::query_scalar(waiting).fetch_optional(&db.pool).await?)
    })
    .await
    .unwrap();
    wait_for("the deregistration to wait again, or run to return", WAIT, || async {
        let again: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(waiting).fetch_optional(&db.pool).await?;
        Ok((again.is_some_and(|t| t > first) || stopping.is_finished()).then_some(()))
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    stopping.await.unwrap();
    assert_eq!(db.count("SELECT 1 FROM lockgate.processes").await.unwrap(), 0, "deregistered before run returned");
}

/// A `run` dropped while its tokio runtime lives (one arm of a `select!`, a timeout) stops none of
/// its services, the heartbeat included: its running job is renewed past the visibility timeout
/// and succeeds once. An earlier version stopped the heartbeat alone on such a drop, and the job,
/// its lease lost, was cancelled and run again until dead-lettered (review helper-100).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_while_its_tokio_runtime_lives_stops_nothing_by_halves() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("long", JobPolicy::on_queue(queue("default")))];
    let client = define(&db, &types).await;
    let config = fast_config();
    let ms = u64::try_from((config.visibility_timeout * 3).as_millis()).unwrap();
    let long = client.enqueue_raw("long", &json!({ "ms": ms }), &EnqueueOptions::default()).await.unwrap();
    let starts = Counter::default();
    let probe = probe(&db, 0, &starts);
    let cancels = Arc::clone(&probe.cancels);
    let registry = probe_registry(probe, &types);
    let pools = vec![PoolConfig::new("dropped", vec![queue("default")], 1)];
    let run =
        Runtime::new(db.new_pool(2).await.unwrap(), config, registry, pools).unwrap().run(CancellationToken::new());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        tokio::select! {
            _ = run => panic!("the runtime stopped on its own"),
            _ = stopped => {}
        }
    });
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    stop.send(()).unwrap();
    task.await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    let state = client.job(long.job_id).await.unwrap().map(|job| (job.state, job.attempt));
    assert_eq!(state, Some(("succeeded".to_string(), 1)));
    assert_eq!(starts.get(), 1, "run once");
    assert!(cancels.lock().unwrap().is_empty(), "never cancelled");
}

/// Blocks its thread for `block`, then records when it ended, before any await (an await after a
/// runtime's shutdown never returns).
struct BlockThenRecord {
    block: Duration,
    starts: Counter,
    ended: Arc<Mutex<Option<chrono::DateTime<chrono::Utc>>>>,
}

impl RawHandler for BlockThenRecord {
    fn call(&self, _ctx: JobContext, _args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            self.starts.bump();
            std::thread::sleep(self.block);
            *self.ended.lock().unwrap() = Some(chrono::Utc::now());
            Ok(())
        })
    }
}

/// The caller's tokio runtime shut down under a running `run` (dropped, its token never
/// cancelled) while a handler blocks one of its threads: the handler's task runs on past the
/// shutdown, and the heartbeat renews its job until it ends, so no other worker runs the job
/// beside it. An earlier version stopped the heartbeat at the shutdown, and a second worker ran
/// the job two seconds later, six before the first run ended (review helper-102).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_a_runtime_shut_down_under_a_blocked_handler_renews_its_job_until_the_handler_ends() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("serial", limited("default", 1, Duration::from_secs(2)))];
    let client = define(&db, &types).await;
    let job = client.enqueue_raw("serial", &json!({"key": 1}), &EnqueueOptions::default()).await.unwrap();
    let config = fast_config();
    let (starts, ended) = (Counter::default(), Arc::new(Mutex::new(None)));
    let handler = Arc::new(BlockThenRecord {
        block: config.visibility_timeout * 3,
        starts: starts.clone(),
        ended: Arc::clone(&ended),
    });
    // Dropping the runtime waits for the blocked handler's thread.
    let (stop, worker0) = on_own_runtime(two_threads(), db.url.clone(), config.clone(), handled_by(handler, &types));
    wait_for("worker 0 to start the job", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    stop.send(()).unwrap();
    let worker1 =
        Running::start(&db, config, probe_registry(probe(&db, 1, &Counter::default()), &types), &["default"], 1).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    worker1.stop().await;
    tokio::task::spawn_blocking(move || worker0.join()).await.unwrap().unwrap();
    let ended = ended.lock().unwrap().expect("worker 0's handler ended");
    let again: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT started_at FROM runs WHERE job_id = $1 AND worker = 1")
            .bind(job.job_id.0)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(again > ended, "worker 1 ran the job at {again}, before worker 0's run of it ended at {ended}");
}

/// When offloaded work ended, and whether it was told to stop.
type WorkEnded = Arc<Mutex<Option<(chrono::DateTime<chrono::Utc>, bool)>>>;

/// Hands `block` of blocking work to `spawn_blocking` and awaits it, the work checking its job's
/// cancellation every 50 ms; records when the work ended and whether it was told to stop.
struct Offloaded {
    block: Duration,
    starts: Counter,
    ended: WorkEnded,
}

impl RawHandler for Offloaded {
    fn call(&self, ctx: JobContext, _args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            self.starts.bump();
            let (block, ended) = (self.block, Arc::clone(&self.ended));
            tokio::task::spawn_blocking(move || {
                let until = std::time::Instant::now() + block;
                let mut told = false;
                while std::time::Instant::now() < until && !told {
                    told = ctx.is_cancelled();
                    std::thread::sleep(Duration::from_millis(50));
                }
                *ended.lock().unwrap() = Some((chrono::Utc::now(), told));
            })
            .await
            .unwrap();
            Ok(())
        })
    }
}

/// The same shutdown of the caller's runtime while a handler awaits blocking work it handed to
/// `spawn_blocking`, as the README advises: the handler's task is dropped with the runtime, but
/// the work runs on. The heartbeat tells every handler to stop, as a shutdown does, so work that
/// checks its cancellation ends before its job can be run again. Before, it was never told, and
/// a second worker ran the job 3.7 s before the work ended (review helper-103).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_a_runtime_shut_down_under_offloaded_work_tells_it_to_stop_before_its_job_runs_again() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("serial", limited("default", 1, Duration::from_secs(2)))];
    let client = define(&db, &types).await;
    let job = client.enqueue_raw("serial", &json!({"key": 1}), &EnqueueOptions::default()).await.unwrap();
    let config = fast_config();
    let (starts, ended) = (Counter::default(), Arc::new(Mutex::new(None)));
    let handler =
        Arc::new(Offloaded { block: config.visibility_timeout * 3, starts: starts.clone(), ended: Arc::clone(&ended) });
    // Dropping the runtime waits for the blocked handler's thread.
    let (stop, worker0) = on_own_runtime(two_threads(), db.url.clone(), config.clone(), handled_by(handler, &types));
    wait_for("worker 0 to start the job", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    stop.send(()).unwrap();
    let worker1 =
        Running::start(&db, config, probe_registry(probe(&db, 1, &Counter::default()), &types), &["default"], 1).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    worker1.stop().await;
    tokio::task::spawn_blocking(move || worker0.join()).await.unwrap().unwrap();
    let (ended, told) = ended.lock().unwrap().expect("worker 0's work ended");
    let again: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT started_at FROM runs WHERE job_id = $1 AND worker = 1")
            .bind(job.job_id.0)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(told && again > ended, "worker 1 ran the job at {again}; worker 0's work ended at {ended}, told: {told}");
}

/// Review helper-145 F10, F2: the server ending the heartbeat's connection once (an operator's
/// `pg_terminate_backend`, a pooler's reset) fails the next renewal at once. Left to the next
/// tick, a lease floored at twice the heartbeat interval was fenced: the handler cancelled and an
/// attempt spent, and a handler that blocks its thread ran on beside its job's next run. The
/// renewal is now tried again at once on a fresh connection: the job runs once, uncancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_connection_ended_once_costs_no_lease() {
    let db = TestDb::migrated().await.unwrap();
    install_permit_monitor(&db).await;
    let types = [("serial", limited("default", 1, Duration::from_secs(1)))];
    let client = define(&db, &types).await;
    let config = RuntimeConfig {
        heartbeat_interval: Duration::from_secs(1),
        visibility_timeout: Duration::from_secs(3),
        ..fast_config()
    };
    // The lease is then the floor, twice the interval: one renewal missed fences it.
    lockgate::sql::record_heartbeat_interval(&db.pool, config.heartbeat_interval).await.unwrap();
    let job = client.enqueue_raw("serial", &json!({"key": 1, "ms": 4000}), &EnqueueOptions::default()).await.unwrap();
    let worker = probe(&db, 0, &Counter::default());
    let cancels = Arc::clone(&worker.cancels);
    let running = Running::start(&db, config, probe_registry(worker, &types), &["default"], 1).await;
    let heartbeat = "SELECT pid FROM pg_stat_activity
                      WHERE datname = current_database() AND query LIKE 'SELECT msg_id, budget_seconds FROM lockgate.extend(%'";
    let pid: i32 = wait_for("the job's first renewal", WAIT, || async {
        Ok(sqlx::query_scalar::<_, i32>(heartbeat).fetch_optional(&db.pool).await?)
    })
    .await
    .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&db.pool).await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    running.stop().await;
    let cancels = cancels.lock().unwrap().clone();
    assert!(cancels.is_empty(), "the handler was cancelled: {cancels:?}");
    assert_eq!(started(&db, job.job_id.0).await, 1, "the job ran once");
}
