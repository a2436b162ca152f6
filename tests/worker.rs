//! The runtime end to end against the real database: jobs run and are archived; failures retry
//! in place and then dead-letter; undecodable and unknown messages are dead-lettered with their
//! reason; timeouts, heartbeats, lease loss, priorities and shutdown behave as documented.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{queue, test_config, Counter, Running, WAIT};
use lockgate::sql::{claim, dlq_retry, DlqFilter};
use lockgate::{CancelReason, Client, EnqueueOptions, Job, JobContext, JobError, JobPolicy, Registry, RuntimeConfig};
use lockgate_testkit::{wait_for, wait_for_count, TestDb};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Work {
    n: u32,
}

impl Job for Work {
    const TYPE: &'static str = "work";
    fn policy() -> JobPolicy {
        let mut policy = JobPolicy::on_queue(queue("default"));
        policy.max_attempts = 3;
        policy.backoff.base = Duration::from_millis(50);
        policy.backoff.max = Duration::from_millis(200);
        policy
    }
}

async fn setup() -> (TestDb, Client) {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Work>().await.unwrap();
    (db, client)
}

async fn enqueue(client: &Client, n: u32) {
    client.enqueue(&Work { n }).await.unwrap();
}

#[tokio::test]
async fn g1_enqueued_jobs_run_and_are_archived_once() {
    let (db, client) = setup().await;
    let works: Vec<Work> = (0..60).map(|n| Work { n }).collect();
    client.enqueue_many(&works).await.unwrap();
    let ran = Counter::default();
    let mut registry = Registry::new();
    let counter = ran.clone();
    registry
        .register::<Work, _>(move |_ctx: JobContext, _w: Work| {
            let counter = counter.clone();
            async move {
                counter.bump();
                Ok::<(), JobError>(())
            }
        })
        .unwrap();
    let running = Running::start(&db, test_config(), registry, &["default"], 8).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 60, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(ran.get(), 60);
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 0);
    assert_eq!(db.count("SELECT DISTINCT msg_id FROM pgmq.a_default").await.unwrap(), 60);
}

fn failing_registry(calls: Counter, fail_first: usize) -> Registry {
    let mut registry = Registry::new();
    registry
        .register::<Work, _>(move |ctx: JobContext, _w: Work| {
            let calls = calls.clone();
            async move {
                let call = calls.bump();
                if call <= fail_first {
                    return Err(JobError::new(format!("boom on attempt {}", ctx.attempt)));
                }
                Ok(())
            }
        })
        .unwrap();
    registry
}

#[tokio::test]
async fn failed_attempts_retry_in_place_and_then_succeed() {
    let (db, client) = setup().await;
    enqueue(&client, 1).await;
    let msg_id: i64 = sqlx::query_scalar("SELECT msg_id FROM pgmq.q_default").fetch_one(&db.pool).await.unwrap();
    let calls = Counter::default();
    let running = Running::start(&db, test_config(), failing_registry(calls.clone(), 2), &["default"], 2).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(calls.get(), 3);
    let (archived_id, read_ct, errors): (i64, i32, i64) =
        sqlx::query_as("SELECT msg_id, read_ct, jsonb_array_length(headers->'errors')::bigint FROM pgmq.a_default")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((archived_id, read_ct, errors), (msg_id, 3, 2), "same message, three deliveries, two recorded errors");
}

#[tokio::test]
async fn last_failed_attempt_dead_letters_with_every_error_and_dlq_retry_runs_it_again() {
    let (db, client) = setup().await;
    let job = client.enqueue(&Work { n: 1 }).await.unwrap();
    let calls = Counter::default();
    let running = Running::start(&db, test_config(), failing_registry(calls.clone(), 3), &["default"], 2).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 1, WAIT).await.unwrap();
    let dead_id: i64 =
        sqlx::query_scalar("SELECT job_id FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    assert_eq!(dead_id, job.job_id.0, "the dead letter keeps the job's id (its first msg_id)");
    let (reason, error, attempts, errors): (String, String, i32, serde_json::Value) =
        sqlx::query_as("SELECT reason, error, attempts, headers->'errors' FROM lockgate.dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((reason.as_str(), error.as_str(), attempts), ("attempts_exhausted", "boom on attempt 3", 3));
    let recorded: Vec<i64> = errors.as_array().unwrap().iter().map(|e| e["attempt"].as_i64().unwrap()).collect();
    assert_eq!(recorded, vec![1, 2, 3], "every attempt's error is kept, with its timestamp");
    assert!(errors[0]["at"].is_string());
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 0);

    let retried = dlq_retry(&db.pool, &DlqFilter::default()).await.unwrap();
    assert_eq!(retried.len(), 1);
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    let (msg_id, job_id): (i64, i64) =
        sqlx::query_as("SELECT msg_id, (headers->>'job_id')::bigint FROM pgmq.a_default")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_ne!(msg_id, job.job_id.0, "the retry is a new message");
    assert_eq!(job_id, job.job_id.0, "which carries the job's id");
    running.stop().await;
    assert_eq!(calls.get(), 4, "the retried dead letter ran again and succeeded");
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0);
}

#[tokio::test]
async fn undecodable_messages_are_dead_lettered_with_their_reason() {
    let (db, _client) = setup().await;
    // Sent with raw PGMQ: no lockgate headers; lockgate headers but arguments of the wrong shape.
    sqlx::query("SELECT pgmq.send('default', '{\"hello\": 1}')").execute(&db.pool).await.unwrap();
    sqlx::query(
        "SELECT pgmq.send('default', '{\"n\": \"not a number\"}', '{\"job_id\": 99, \"type\": \"work\"}'::jsonb)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let calls = Counter::default();
    let running = Running::start(&db, test_config(), failing_registry(calls.clone(), 0), &["default"], 2).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 2, WAIT).await.unwrap();
    running.stop().await;
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT reason, error FROM lockgate.dead_letters ORDER BY msg_id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows[0].0, "undecodable");
    assert!(rows[0].1.contains("headers are not a JSON object"), "{}", rows[0].1);
    assert_eq!(rows[1].0, "undecodable");
    assert!(rows[1].1.contains("arguments do not decode"), "{}", rows[1].1);
    assert_eq!(calls.get(), 0, "no handler ran");
}

#[tokio::test]
async fn h16_message_of_an_undefined_job_type_is_dead_lettered_not_retried() {
    let (db, _client) = setup().await;
    sqlx::query("SELECT pgmq.send('default', '{}', '{\"job_id\": 7, \"type\": \"ghost\"}'::jsonb)")
        .execute(&db.pool)
        .await
        .unwrap();
    let running = Running::start(&db, test_config(), failing_registry(Counter::default(), 0), &["default"], 2).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters WHERE reason = 'unknown_job_type'", 1, WAIT)
        .await
        .unwrap();
    running.stop().await;
    let error: String =
        sqlx::query_scalar("SELECT error FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(error.contains("\"ghost\" is not defined"), "{error}");
}

#[derive(Serialize, Deserialize)]
struct Slow {
    millis: u64,
}

impl Job for Slow {
    const TYPE: &'static str = "slow";
    fn policy() -> JobPolicy {
        let mut policy = JobPolicy::on_queue(queue("default"));
        policy.max_attempts = 1;
        policy.timeout = Some(Duration::from_millis(300));
        policy
    }
}

fn slow_registry(starts: Counter, reasons: Arc<Mutex<Vec<Option<CancelReason>>>>) -> Registry {
    let mut registry = Registry::new();
    registry
        .register::<Slow, _>(move |ctx: JobContext, job: Slow| {
            let (starts, reasons) = (starts.clone(), Arc::clone(&reasons));
            async move {
                starts.bump();
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(job.millis)) => Ok(()),
                    () = ctx.cancelled() => {
                        reasons.lock().unwrap().push(ctx.cancel_reason());
                        Err(JobError::new("cancelled"))
                    }
                }
            }
        })
        .unwrap();
    registry
}

#[tokio::test]
async fn timeout_tells_the_handler_cancels_the_attempt_and_counts_as_a_failure() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Slow>().await.unwrap();
    client.enqueue(&Slow { millis: 60_000 }).await.unwrap();
    let reasons = Arc::new(Mutex::new(Vec::new()));
    let running =
        Running::start(&db, test_config(), slow_registry(Counter::default(), Arc::clone(&reasons)), &["default"], 1)
            .await;
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 1, WAIT).await.unwrap();
    running.stop().await;
    let error: String =
        sqlx::query_scalar("SELECT error FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    assert_eq!(error, "timed out after 300ms");
    // Told, not dropped: a handler may stop what it started outside the process (design §76).
    assert_eq!(*reasons.lock().unwrap(), [Some(CancelReason::Timeout)], "the handler saw its timeout");
}

#[derive(Serialize, Deserialize)]
struct Long {
    millis: u64,
}

impl Job for Long {
    const TYPE: &'static str = "long";
}

fn long_registry(starts: Counter, reasons: Arc<Mutex<Vec<Option<CancelReason>>>>) -> Registry {
    let mut registry = Registry::new();
    registry
        .register::<Long, _>(move |ctx: JobContext, job: Long| {
            let (starts, reasons) = (starts.clone(), Arc::clone(&reasons));
            async move {
                starts.bump();
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(job.millis)) => Ok(()),
                    () = ctx.cancelled() => {
                        reasons.lock().unwrap().push(ctx.cancel_reason());
                        std::future::pending::<()>().await;
                        Ok(())
                    }
                }
            }
        })
        .unwrap();
    registry
}

async fn long_setup(millis: u64) -> TestDb {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Long>().await.unwrap();
    client.enqueue(&Long { millis }).await.unwrap();
    db
}

#[tokio::test]
async fn g6_heartbeat_keeps_a_job_owned_past_its_visibility_timeout() {
    // Runs 3x the 2 s visibility timeout while a second runtime polls the same queue.
    let db = long_setup(6_000).await;
    let starts = Counter::default();
    let reasons = Arc::new(Mutex::new(Vec::new()));
    let first =
        Running::start(&db, test_config(), long_registry(starts.clone(), Arc::clone(&reasons)), &["default"], 1).await;
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    let second =
        Running::start(&db, test_config(), long_registry(starts.clone(), Arc::clone(&reasons)), &["default"], 1).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    first.stop().await;
    second.stop().await;
    assert_eq!(starts.get(), 1, "no second delivery while the heartbeat renewed the lease");
    assert!(reasons.lock().unwrap().is_empty());
}

#[tokio::test]
async fn lost_lease_cancels_the_handler_and_its_delivery_writes_nothing() {
    let db = long_setup(60_000).await;
    let starts = Counter::default();
    let reasons = Arc::new(Mutex::new(Vec::new()));
    let running =
        Running::start(&db, test_config(), long_registry(starts.clone(), Arc::clone(&reasons)), &["default"], 1).await;
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    // Another delivery takes the message over, as if this worker's lease had lapsed.
    let msg_id: i64 = sqlx::query_scalar("SELECT msg_id FROM pgmq.q_default").fetch_one(&db.pool).await.unwrap();
    db.expire_visibility("default", msg_id).await.unwrap();
    let thief = claim(&db.pool, &queue("default"), 1, Duration::from_secs(600)).await.unwrap();
    assert_eq!(thief.len(), 1);
    wait_for("the heartbeat to cancel the stale handler", WAIT, || async {
        Ok((!reasons.lock().unwrap().is_empty()).then_some(()))
    })
    .await
    .unwrap();
    running.stop().await;
    assert_eq!(reasons.lock().unwrap().as_slice(), &[Some(CancelReason::LeaseLost)]);
    let read_ct: i32 = sqlx::query_scalar("SELECT read_ct FROM pgmq.q_default").fetch_one(&db.pool).await.unwrap();
    assert_eq!(read_ct, thief[0].read_ct, "the newer delivery still owns the message, untouched");
    let returns: Option<i32> =
        sqlx::query_scalar("SELECT (headers->>'returns')::int FROM pgmq.q_default").fetch_one(&db.pool).await.unwrap();
    assert_eq!(returns, None, "shutdown did not release a delivery it no longer owned");
}

#[tokio::test]
async fn g7_shutdown_returns_running_jobs_to_their_queue_visible_at_once() {
    let db = long_setup(60_000).await;
    let starts = Counter::default();
    let reasons = Arc::new(Mutex::new(Vec::new()));
    let running =
        Running::start(&db, test_config(), long_registry(starts.clone(), Arc::clone(&reasons)), &["default"], 1).await;
    wait_for("the job to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    running.stop().await;
    assert_eq!(reasons.lock().unwrap().as_slice(), &[Some(CancelReason::Shutdown)]);
    let (visible, returns): (bool, i32) =
        sqlx::query_as("SELECT vt <= now(), (headers->>'returns')::int FROM pgmq.q_default")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(visible, "returned jobs are visible at once");
    assert_eq!(returns, 1);
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0, "nothing failed");
    let claims = claim(&db.pool, &queue("default"), 1, Duration::from_secs(30)).await.unwrap();
    let headers = lockgate::JobHeaders::decode(claims[0].headers.as_ref(), claims[0].msg_id).unwrap();
    assert_eq!(claims[0].attempt(&headers), 1, "the returned delivery is not counted as an attempt");
}

#[derive(Serialize, Deserialize)]
struct Tagged {
    tag: String,
}

impl Job for Tagged {
    const TYPE: &'static str = "tagged";
}

#[tokio::test]
async fn claims_follow_queue_order_then_priority_then_age() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Tagged>().await.unwrap();
    for q in ["high", "low"] {
        lockgate::sql::create_queue(&db.pool, q).await.unwrap();
    }
    let plan = [
        ("low", 0, "low-a"),
        ("high", 5, "high-p5"),
        ("low", 0, "low-b"),
        ("high", 0, "high-p0-a"),
        ("high", 0, "high-p0-b"),
    ];
    for (q, priority, tag) in plan {
        let options = EnqueueOptions { queue: Some(queue(q)), priority: Some(priority), ..Default::default() };
        client.enqueue_with(&Tagged { tag: tag.into() }, &options).await.unwrap();
    }
    let order = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&order);
    let mut registry = Registry::new();
    registry
        .register::<Tagged, _>(move |_ctx: JobContext, job: Tagged| {
            let seen = Arc::clone(&seen);
            async move {
                seen.lock().unwrap().push(job.tag);
                Ok::<(), JobError>(())
            }
        })
        .unwrap();
    let running = Running::start(&db, test_config(), registry, &["high", "low"], 1).await;
    wait_for("all five jobs", WAIT, || async { Ok((order.lock().unwrap().len() == 5).then_some(())) }).await.unwrap();
    running.stop().await;
    assert_eq!(order.lock().unwrap().as_slice(), &["high-p0-a", "high-p0-b", "high-p5", "low-a", "low-b"]);
}

#[derive(Serialize, Deserialize)]
struct Panics {}

impl Job for Panics {
    const TYPE: &'static str = "panics";
    fn policy() -> JobPolicy {
        let mut policy = JobPolicy::on_queue(queue("default"));
        policy.max_attempts = 1;
        policy
    }
}

#[tokio::test]
async fn a_panicking_handler_is_a_failed_attempt_not_a_job_stuck_in_flight() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Panics>().await.unwrap();
    client.enqueue(&Panics {}).await.unwrap();
    let mut registry = Registry::new();
    registry
        .register::<Panics, _>(|_ctx: JobContext, _job: Panics| async move {
            if true {
                panic!("boom in the handler");
            }
            Ok::<(), JobError>(())
        })
        .unwrap();
    // The panic hook prints a backtrace (RUST_BACKTRACE=1 here), which on a loaded machine can
    // hold this test's one-thread runtime, heartbeat included, past a 2 s lease: that is not
    // what this test is about.
    let config = RuntimeConfig { visibility_timeout: Duration::from_secs(15), ..test_config() };
    let running = Running::start(&db, config, registry, &["default"], 1).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 1, WAIT).await.unwrap();
    running.stop().await;
    let error: String =
        sqlx::query_scalar("SELECT error FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    assert_eq!(error, "handler panicked: boom in the handler");
}

#[tokio::test]
async fn archive_retention_prunes_archived_jobs_older_than_the_retention() {
    let (db, client) = setup().await;
    for n in 0..3 {
        enqueue(&client, n).await;
    }
    let claims = claim(&db.pool, &queue("default"), 3, Duration::from_secs(30)).await.unwrap();
    let tokens: Vec<(i64, i32)> = claims.iter().map(|c| (c.msg_id, c.read_ct)).collect();
    lockgate::sql::complete(&db.pool, &queue("default"), &tokens, &[]).await.unwrap();
    sqlx::query("UPDATE pgmq.a_default SET archived_at = now() - interval '8 days' WHERE msg_id = $1")
        .bind(tokens[0].0)
        .execute(&db.pool)
        .await
        .unwrap();
    let retention = lockgate::maintenance::ArchiveRetention::new(
        db.pool.clone(),
        Duration::from_secs(7 * 24 * 3600),
        Duration::from_secs(60),
    );
    assert_eq!(retention.run_once().await.unwrap(), 1, "only the job archived 8 days ago is pruned");
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 2);
}

#[tokio::test]
async fn queue_stats_count_ready_scheduled_running_and_dead_jobs() {
    let (db, client) = setup().await;
    for n in 0..4 {
        enqueue(&client, n).await;
    }
    let later = EnqueueOptions { delay: Some(Duration::from_secs(600)), ..Default::default() };
    client.enqueue_with(&Work { n: 9 }, &later).await.unwrap();
    let claims = claim(&db.pool, &queue("default"), 3, Duration::from_secs(30)).await.unwrap();
    lockgate::sql::retry(&db.pool, &claims[0], Duration::from_secs(600), "boom", 1).await.unwrap();
    lockgate::sql::dead_letter(&db.pool, &claims[1], lockgate::sql::DeadLetterReason::AttemptsExhausted, "x", 3)
        .await
        .unwrap();
    let stats = lockgate::sql::queue_stats(&db.pool).await.unwrap();
    let s = stats.iter().find(|s| s.queue == "default").unwrap();
    // 1 never claimed; 1 delayed + 1 waiting for its retry; 1 claimed; 1 dead-lettered.
    assert_eq!((s.ready, s.scheduled, s.running, s.dead), (1, 2, 1, 1));
    assert!(s.oldest_ready_seconds.is_some());
}

#[tokio::test]
async fn metrics_snapshot_reports_queues_and_keeps_the_busiest_keys_summing_the_rest_as_other() {
    let metrics = Arc::new(lockgate::Metrics::new());
    let (db, client) = setup().await;
    let client = client.with_metrics(Arc::clone(&metrics));
    for n in 0..3 {
        enqueue(&client, n).await;
    }
    let enqueued = "lockgate_jobs_enqueued_total{queue=\"default\",job_type=\"work\"} 3";
    assert!(metrics.encode().contains(enqueued), "the client counts its enqueues: {}", metrics.encode());
    // Keys by held + parked: b (1 + 4), a (3), c (2), d (1); with a cap of two, c and d are summed.
    sqlx::query(
        "INSERT INTO lockgate.semaphores (key, lim, value) VALUES ('a', 5, 3), ('b', 5, 1), ('c', 5, 2), ('d', 5, 1)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO lockgate.parked (key, queue, job_type, job_id, args, headers, priority, run_at)
         SELECT 'b', 'default', 'work', g, '{}', '{}', 0, now() FROM generate_series(100, 103) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let snapshot = lockgate::sql::metrics_snapshot(&db.pool, 2).await.unwrap();
    let keys: Vec<(&str, i64, i64)> = snapshot.keys.iter().map(|k| (k.key.as_str(), k.held, k.parked)).collect();
    assert_eq!(keys, vec![("a", 3, 0), ("b", 1, 4), ("other", 3, 0)]);
    let default = snapshot.queues.iter().find(|q| q.queue == "default").unwrap();
    assert_eq!((default.ready, default.parked, default.dead), (3, 4, 0));
    let none = lockgate::sql::metrics_snapshot(&db.pool, 0).await.unwrap();
    assert_eq!(none.keys.len(), 1, "a cap of 0 sums every key: {:?}", none.keys);
    assert_eq!((none.keys[0].held, none.keys[0].parked), (7, 4));
}

#[tokio::test]
async fn a_prune_in_the_middle_of_registration_cannot_fail_the_start() {
    let (db, client) = setup().await;
    // Worker rows wait for an advisory lock the test holds, so registration stops between the
    // supervisor's row and its children's, where a prune can strike.
    sqlx::raw_sql(
        "CREATE FUNCTION public.hold_worker_rows() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NEW; END $$;
         CREATE TRIGGER hold_worker_rows BEFORE INSERT ON lockgate.processes
             FOR EACH ROW WHEN (NEW.kind = 'worker') EXECUTE FUNCTION public.hold_worker_rows();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(4242)").execute(&mut *holder).await.unwrap();
    let running = Running::start(&db, test_config(), failing_registry(Counter::default(), 0), &["default"], 2).await;
    wait_for_count(
        &db.pool,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242 AND NOT granted",
        1,
        WAIT,
    )
    .await
    .unwrap();
    // The prune: every row it can see goes. A supervisor row committed on its own would go here,
    // and its worker row would then fail on the foreign key, failing the start.
    sqlx::query("DELETE FROM lockgate.processes").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT pg_advisory_unlock(4242)").execute(&mut *holder).await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.processes WHERE kind = 'worker'", 1, WAIT).await.unwrap();
    assert!(!running.task.is_finished(), "the runtime is still running");
    enqueue(&client, 1).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    running.stop().await;
}

#[tokio::test]
async fn a_started_process_row_says_it_runs_before_its_first_heartbeat_interval_ends() {
    let (db, _client) = setup().await;
    // Registration records the booting phase; the next beat would be a minute away.
    let config = RuntimeConfig {
        process_heartbeat_interval: Duration::from_secs(60),
        alive_threshold: Duration::from_secs(180),
        ..test_config()
    };
    let running = Running::start(&db, config, failing_registry(Counter::default(), 0), &["default"], 2).await;
    wait_for_count(
        &db.pool,
        "SELECT count(*) FROM lockgate.processes WHERE kind = 'supervisor' AND metadata->'health'->>'phase' = 'running'",
        1,
        WAIT,
    )
    .await
    .unwrap();
    // Its build, which `lockgate doctor` compares with the database's (process_builds), in every
    // beat as in the registration.
    let revision: Option<String> =
        sqlx::query_scalar("SELECT metadata->>'functions_revision' FROM lockgate.processes WHERE kind = 'supervisor'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(revision, Some(lockgate::sql::FUNCTIONS_REVISION.to_string()));
    running.stop().await;
}

#[tokio::test]
async fn a_runtime_starts_and_stops_twenty_times_leaving_nothing_behind() {
    let (db, client) = setup().await;
    for round in 0..20 {
        enqueue(&client, round).await;
        let calls = Counter::default();
        let running = Running::start(&db, test_config(), failing_registry(calls, 0), &["default"], 2).await;
        wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", i64::from(round) + 1, WAIT).await.unwrap();
        running.stop().await;
        assert_eq!(db.count("SELECT 1 FROM lockgate.processes").await.unwrap(), 0, "round {round}: deregistered");
    }
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 0);
}

#[tokio::test]
async fn g7_shutdown_returns_jobs_claimed_ahead_at_once_and_running_ones_after_the_timeout() {
    let db = long_setup(60_000).await;
    Client::new(db.pool.clone()).enqueue(&Long { millis: 60_000 }).await.unwrap();
    let starts = Counter::default();
    let reasons = Arc::new(Mutex::new(Vec::new()));
    // One handler slot: the second job is claimed ahead and waits in memory.
    let running =
        Running::start(&db, test_config(), long_registry(starts.clone(), Arc::clone(&reasons)), &["default"], 1).await;
    wait_for("one job running and one claimed ahead", WAIT, || async {
        let claimed = db.count("SELECT 1 FROM pgmq.q_default WHERE read_ct = 1").await?;
        Ok((starts.get() == 1 && claimed == 2).then_some(()))
    })
    .await
    .unwrap();
    running.stop().await;
    assert_eq!(starts.get(), 1, "the job claimed ahead never started");
    let rows: Vec<(bool, i32)> = sqlx::query_as("SELECT vt <= now(), (headers->>'returns')::int FROM pgmq.q_default")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, vec![(true, 1), (true, 1)], "both back in the queue, ready, neither counted as an attempt");
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0);
}

/// A job of `Step` on whichever queue its enqueue names; records its start in the order list.
#[derive(Serialize, Deserialize)]
struct Step {
    n: u32,
}

impl Job for Step {
    const TYPE: &'static str = "step";
    fn policy() -> JobPolicy {
        JobPolicy::on_queue(queue("low"))
    }
}

/// A registry running `Step` jobs, each recording its n when it starts and then sleeping
/// `run_ms(n)` milliseconds; and the list of the ns started, in order.
fn step_registry(run_ms: fn(u32) -> u64) -> (Registry, Arc<Mutex<Vec<u32>>>) {
    let started = Arc::new(Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    let seen = Arc::clone(&started);
    registry
        .register::<Step, _>(move |_ctx: JobContext, step: Step| {
            let seen = Arc::clone(&seen);
            async move {
                seen.lock().unwrap().push(step.n);
                tokio::time::sleep(Duration::from_millis(run_ms(step.n))).await;
                Ok::<(), JobError>(())
            }
        })
        .unwrap();
    (registry, started)
}

/// Issue 14: a pool of several queues leaves the ones a claim found empty out of its next claims,
/// but a job enqueued on one of them (its wake-up) is claimed at the next claim, even while the
/// pool is busy with its other queues and long before `poll_interval` would look again.
#[tokio::test]
async fn a_job_on_a_queue_found_empty_is_claimed_at_once_while_the_pool_is_busy() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Step>().await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('high')").execute(&db.pool).await.unwrap();
    let backlog: Vec<Step> = (1..=400).map(|n| Step { n }).collect();
    client.enqueue_many(&backlog).await.unwrap();
    let (registry, started) = step_registry(|_| 10);
    let config = RuntimeConfig { poll_interval: Duration::from_secs(30), ..test_config() };
    let running = Running::start(&db, config, registry, &["high", "low"], 2).await;
    let count = || started.lock().unwrap().len();
    wait_for("the backlog to be running", WAIT, || async { Ok((count() >= 20).then_some(())) }).await.unwrap();
    let on_high = EnqueueOptions { queue: Some(queue("high")), ..Default::default() };
    client.enqueue_with(&Step { n: 0 }, &on_high).await.unwrap();
    let before = count();
    wait_for("the job on high to start", Duration::from_secs(5), || async {
        Ok(started.lock().unwrap().contains(&0).then_some(()))
    })
    .await
    .unwrap();
    let order = started.lock().unwrap().clone();
    let after = order.iter().position(|&n| n == 0).unwrap() - before;
    // Claimed ahead before the enqueue, at most 5 × concurrency jobs of low may start first.
    assert!(after <= 12, "{after} jobs of low started after the enqueue on high, before it");
    running.stop().await;
}

/// Issue 14: a pool of one queue, with `poll_interval` far away, claims every job enqueued into it
/// at the job's wake-up: one at a time into an idle pool, and while the pool is busy with the one
/// before (the wake-up arriving during a claim or a run, where a wake-up lost would leave the job
/// for the poll).
#[tokio::test]
async fn a_pool_of_one_queue_claims_each_new_job_at_its_wake_up() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Step>().await.unwrap();
    // Odd jobs run a while, so the next one's wake-up finds the pool busy.
    let (registry, started) = step_registry(|n| if n % 2 == 1 { 30 } else { 0 });
    let config = RuntimeConfig { poll_interval: Duration::from_secs(60), ..test_config() };
    let running = Running::start(&db, config, registry, &["low"], 4).await;
    for n in 1..=40 {
        client.enqueue(&Step { n }).await.unwrap();
        if n % 4 == 0 {
            // Every fourth job waits for its start; the others land during claims and runs.
            wait_for("the job to start at its wake-up", Duration::from_secs(5), || async {
                Ok(started.lock().unwrap().contains(&n).then_some(()))
            })
            .await
            .unwrap();
        }
    }
    wait_for("every job to start", Duration::from_secs(5), || async {
        Ok((started.lock().unwrap().len() == 40).then_some(()))
    })
    .await
    .unwrap();
    running.stop().await;
    let mut order = started.lock().unwrap().clone();
    order.sort_unstable();
    assert_eq!(order, (1..=40).collect::<Vec<_>>(), "every job started once");
}

/// Issue 14, from a review: a claim that takes messages it does not return (here messages no
/// worker can decode, dead-lettered by the claim) runs short though more jobs are visible behind
/// it. The pool must not read that as an empty queue and wait for `poll_interval`: the claim wakes
/// it. For a pool of one queue and for a pool of several.
#[tokio::test]
async fn a_claim_that_dead_letters_part_of_what_it_took_leaves_nothing_waiting_for_a_poll() {
    for queues in [&["low"][..], &["high", "low"][..]] {
        let db = TestDb::migrated().await.unwrap();
        let client = Client::new(db.pool.clone());
        client.define::<Step>().await.unwrap();
        sqlx::query("SELECT lockgate.create_queue('high')").execute(&db.pool).await.unwrap();
        // Twenty of them among the jobs, so that claims run short again and again.
        for batch in 0..20 {
            sqlx::query("SELECT pgmq.send('low', '{\"not\": \"a lockgate job\"}')").execute(&db.pool).await.unwrap();
            let jobs: Vec<Step> = (1..=10).map(|n| Step { n: batch * 10 + n }).collect();
            client.enqueue_many(&jobs).await.unwrap();
        }
        let (registry, started) = step_registry(|_| 0);
        let config = RuntimeConfig { poll_interval: Duration::from_secs(60), ..test_config() };
        let running = Running::start(&db, config, registry, queues, 2).await;
        wait_for("every job to start, well before the poll", WAIT, || async {
            Ok((started.lock().unwrap().len() == 200).then_some(()))
        })
        .await
        .unwrap_or_else(|e| panic!("pool of {queues:?}: {e}"));
        running.stop().await;
        assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 20, "the undecodable messages");
    }
}
