//! lockgate through PgBouncer (issue 13), started by the test on a free port in front of the test
//! server with two server connections per database, so that clients share them.
//!
//! Transaction mode with `pooler::set_transaction_pooling` (the CLI's `?pooler=transaction`):
//! producers from SQL (psql) and from the crate, and a runtime whose every statement goes through
//! the pooler, run limit-1 jobs exactly once each and never two of a key at once. LISTEN cannot
//! work there: with a direct `listen_database_url` a job starts long before the next poll.
//!
//! The switch is per process and this file is its own test binary. `migrate` refuses to run under
//! it (its lock is a session's), so the one test migrates its databases first, then turns the
//! switch on and goes through each case in turn.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{queue, test_config, Running, WAIT};
use lockgate::{
    Client, ConcurrencyPolicy, Job, JobContext, JobError, JobFilter, JobPolicy, OnConflict, PgPool, Registry,
    RuntimeConfig,
};
use lockgate_testkit::pgbouncer::{PgBouncer, PoolMode};
use lockgate_testkit::{wait_for, wait_for_count, TestDb};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::Executor;

#[derive(Serialize, Deserialize)]
struct Keyed {
    key: String,
}

impl Job for Keyed {
    const TYPE: &'static str = "keyed";
    fn policy() -> JobPolicy {
        let mut policy = JobPolicy::on_queue(queue("pooled"));
        policy.concurrency = Some(ConcurrencyPolicy {
            limit: 1,
            key: vec!["key".into()],
            duration: Duration::from_secs(60),
            on_conflict: OnConflict::Block,
        });
        policy
    }
}

/// A migrated database (migrated directly, before the switch is on) and a PgBouncer in
/// transaction mode in front of it.
async fn database() -> (TestDb, PgBouncer) {
    let db = TestDb::migrated().await.unwrap();
    common::install_permit_monitor(&db).await;
    (db, PgBouncer::start(PoolMode::Transaction, 2).await.unwrap())
}

/// A pool through the PgBouncer.
async fn through(db: &TestDb, bouncer: &PgBouncer) -> PgPool {
    PgPoolOptions::new().max_connections(16).connect_with(bouncer.options(&db.name)).await.unwrap()
}

// Multi-threaded, so that the Client's enqueues take the path they take in a service: the
// wake-up in the enqueue's transaction when no other one is notifying, else from the wake task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockgate_works_through_transaction_pooling() {
    let cases = [database().await, database().await, database().await, database().await];
    lockgate::pooler::set_transaction_pooling(true);
    let [a, b, c, d] = cases;
    producers_and_workers_run_every_job_once(&a.0, &a.1).await;
    listen_on_a_direct_url_wakes_workers(&b.0, &b.1).await;
    cancel_by_query_commits_job_by_job(&c.0, &c.1).await;
    a_callers_own_transaction_is_never_committed_by_lockgate(&d.0, &d.1).await;
    let error = lockgate::migrate(&through(&d.0, &d.1).await).await.unwrap_err();
    assert!(error.to_string().contains("direct database URL"), "{error}");
}

fn registry(direct: PgPool) -> Registry {
    let mut registry = Registry::new();
    registry
        .register::<Keyed, _>(move |ctx: JobContext, job: Keyed| {
            let direct = direct.clone();
            async move {
                common::run_started(&direct, ctx.job_id.0, &job.key, 1).await;
                tokio::time::sleep(Duration::from_millis(2)).await;
                common::run_ended(&direct, ctx.job_id.0, 1).await;
                Ok::<(), JobError>(())
            }
        })
        .unwrap();
    registry
}

async fn producers_and_workers_run_every_job_once(db: &TestDb, bouncer: &PgBouncer) {
    let pool = through(db, bouncer).await;
    let client = Client::new(pool.clone());
    client.define::<Keyed>().await.unwrap();
    // Producers from the crate, concurrently, sharing two server connections.
    let producers: Vec<_> = (0..8)
        .map(|p| {
            let client = client.clone();
            tokio::spawn(async move {
                for i in 0..40 {
                    let job = Keyed { key: format!("k{}", (p + i) % 4) };
                    client.enqueue(&job).await.expect("enqueue through the pooler");
                }
            })
        })
        .collect();
    // A producer from SQL: psql through the pooler.
    let sql: String =
        (0..80).map(|i| format!("SELECT lockgate.enqueue('keyed', '{{\"key\": \"k{}\"}}');\n", i % 4)).collect();
    let psql = tokio::process::Command::new("psql")
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", &bouncer.url(&db.name), "-c", &sql])
        .output()
        .await
        .unwrap();
    assert!(psql.status.success(), "psql: {}", String::from_utf8_lossy(&psql.stderr));
    for producer in producers {
        producer.await.unwrap();
    }
    // A runtime whose pool, startup and heartbeat go through the pooler; no LISTEN (polling).
    let config = RuntimeConfig { poll_interval: Duration::from_millis(50), ..test_config() };
    let running = Running::start_on(pool.clone(), config, registry(db.pool.clone()), &["pooled"], 8);
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_pooled", 400, Duration::from_secs(60)).await.unwrap();
    running.stop().await;
    assert_eq!(db.count("SELECT 1 FROM runs").await.unwrap(), 400, "every job ran exactly once");
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_pooled").await.unwrap(), 0);
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0);
    assert_eq!(db.count("SELECT 1 FROM permit_violations").await.unwrap(), 0, "a key held more leases than its limit");
    for (key, most) in common::max_overlap(&db.pool, -1).await {
        assert_eq!(most, 1, "key {key} ran {most} jobs at once");
    }
}

async fn listen_on_a_direct_url_wakes_workers(db: &TestDb, bouncer: &PgBouncer) {
    let pool = through(db, bouncer).await;
    let client = Client::new(pool.clone());
    client.define::<Keyed>().await.unwrap();
    // Polling alone would take a minute: the start within WAIT is the notification's.
    let config = RuntimeConfig {
        poll_interval: Duration::from_secs(60),
        listen_database_url: Some(db.url.clone()),
        ..test_config()
    };
    let running = Running::start_on(pool.clone(), config, registry(db.pool.clone()), &["pooled"], 2);
    wait_for("the LISTEN connection", WAIT, || async {
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%'",
        )
        .fetch_one(&db.pool)
        .await?;
        Ok((listening > 0).then_some(()))
    })
    .await
    .unwrap();
    client.enqueue(&Keyed { key: "a".into() }).await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_pooled", 1, WAIT).await.unwrap();
    running.stop().await;
}

async fn cancel_by_query_commits_job_by_job(db: &TestDb, bouncer: &PgBouncer) {
    let pool = through(db, bouncer).await;
    let client = Client::new(pool.clone());
    client.define::<Keyed>().await.unwrap();
    for i in 0..5 {
        client.enqueue(&Keyed { key: format!("c{i}") }).await.unwrap();
    }
    // The procedure commits per job, which no statement inside a transaction may do.
    let filter = JobFilter { queue: Some("pooled".into()), ..JobFilter::default() };
    let count = client.cancel_jobs(&filter, 100).await.unwrap();
    assert_eq!((count.matched, count.cancelled), (5, 5));
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_pooled").await.unwrap(), 0);
    let bad = JobFilter { states: vec!["nonsense".into()], ..filter };
    let error = client.cancel_jobs(&bad, 100).await.unwrap_err();
    assert!(error.to_string().contains("nonsense"), "{error}");
}

/// A caller that opened its transaction with a `BEGIN` of its own (which sqlx does not count)
/// and enqueues in it: lockgate works in a savepoint, and the caller's rollback undoes the job.
async fn a_callers_own_transaction_is_never_committed_by_lockgate(db: &TestDb, bouncer: &PgBouncer) {
    let pool = through(db, bouncer).await;
    let client = Client::new(pool.clone());
    client.define::<Keyed>().await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    conn.execute("BEGIN").await.unwrap();
    client.enqueue_in(&mut conn, &Keyed { key: "rolled back".into() }).await.unwrap();
    conn.execute("ROLLBACK").await.unwrap();
    assert_eq!(
        db.count("SELECT 1 FROM pgmq.q_pooled").await.unwrap(),
        0,
        "lockgate committed the caller's transaction"
    );
    // A failed call leaves the caller's transaction usable (rolled back to the savepoint).
    conn.execute("BEGIN").await.unwrap();
    let error =
        lockgate::sql::enqueue(&mut *conn, "no_such_type", &serde_json::json!({}), &serde_json::json!({}), true)
            .await
            .unwrap_err();
    assert!(error.to_string().contains("no_such_type"), "{error}");
    client.enqueue_in(&mut conn, &Keyed { key: "kept".into() }).await.unwrap();
    conn.execute("COMMIT").await.unwrap();
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_pooled").await.unwrap(), 1);
}
