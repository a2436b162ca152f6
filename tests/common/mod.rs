//! Shared arrangements for the root test suites: a runtime running in the background against a
//! fresh database, with timings short enough for tests and long enough to stay deterministic.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockgate::{PgPool, PoolConfig, QueueName, Registry, Runtime, RuntimeConfig};
use lockgate_testkit::TestDb;
use sqlx::Connection;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Timings for tests: leases lapse in 2 s, heartbeats every 300 ms, polling every 200 ms.
pub fn test_config() -> RuntimeConfig {
    RuntimeConfig {
        visibility_timeout: Duration::from_secs(2),
        heartbeat_interval: Duration::from_millis(300),
        shutdown_timeout: Duration::from_secs(1),
        poll_interval: Duration::from_millis(200),
        ..RuntimeConfig::default()
    }
}

pub fn queue(name: &str) -> QueueName {
    QueueName::new(name).expect("valid queue name")
}

/// A runtime running in a background task until `stop`.
pub struct Running {
    pub shutdown: CancellationToken,
    pub task: JoinHandle<Result<(), lockgate::RuntimeError>>,
}

impl Running {
    pub async fn start(
        db: &TestDb,
        config: RuntimeConfig,
        registry: Registry,
        queues: &[&str],
        concurrency: usize,
    ) -> Self {
        // Startup only: the runtime runs its loops on a pool of its own.
        let pool = db.new_pool(2).await.expect("pool");
        Self::start_on(pool, config, registry, queues, concurrency)
    }

    /// Starts a runtime on a pool of the caller's (e.g. one that goes through a FaultProxy).
    pub fn start_on(
        pool: PgPool,
        config: RuntimeConfig,
        registry: Registry,
        queues: &[&str],
        concurrency: usize,
    ) -> Self {
        let pools = vec![PoolConfig::new("test", queues.iter().map(|q| queue(q)).collect(), concurrency)];
        Self::spawn(Runtime::new(pool, config, registry, pools).expect("valid runtime"))
    }

    /// Runs a runtime the caller built (e.g. one with a name of its own).
    pub fn spawn(runtime: Runtime) -> Self {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(runtime.run(shutdown.clone()));
        Self { shutdown, task }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.expect("runtime task").expect("runtime ran cleanly");
    }
}

/// Counts handler starts.
#[derive(Clone, Default)]
pub struct Counter(Arc<AtomicUsize>);

impl Counter {
    pub fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

pub const WAIT: Duration = Duration::from_secs(15);

/// Records, at every commit that touches a lease, any key holding more leases than its limit.
/// A deferred constraint trigger sees each transaction's final state, so "no row in
/// permit_violations" means no commit ever left a key over its limit.
pub async fn install_permit_monitor(db: &TestDb) {
    sqlx::raw_sql(
        "CREATE TABLE permit_violations (key text, leases bigint, lim integer, at timestamptz DEFAULT clock_timestamp());
         CREATE FUNCTION check_permits() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO permit_violations (key, leases, lim)
             SELECT s.key, (SELECT count(*) FROM lockgate.leases l WHERE l.key = s.key), s.lim
               FROM lockgate.semaphores s
              WHERE s.key = NEW.key AND (SELECT count(*) FROM lockgate.leases l WHERE l.key = s.key) > s.lim;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER check_permits AFTER INSERT OR UPDATE ON lockgate.leases
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION check_permits();
         CREATE TABLE runs (job_id bigint, key text, worker integer, started_at timestamptz DEFAULT clock_timestamp(), ended_at timestamptz);",
    )
    .execute(&db.pool)
    .await
    .expect("monitor installed");
}

/// Records a handler's start in `runs`, stamped when called: under load the insert may wait for a
/// connection, and a start recorded late would shorten the run and hide an overlap.
pub async fn run_started(pool: &PgPool, job_id: i64, key: &str, worker: i32) {
    let at = chrono::Utc::now();
    record_run(pool, || {
        sqlx::query("INSERT INTO runs (job_id, key, worker, started_at) VALUES ($1, $2, $3, $4)")
            .bind(job_id)
            .bind(key)
            .bind(worker)
            .bind(at)
    })
    .await;
}

/// Records a handler's end, stamped when called (a late record would lengthen the run). Only the
/// latest open run of the job on that worker ends: an earlier run whose handler was cancelled
/// (no end) may be followed by a redelivery to the same worker, and ending both would stretch
/// the cancelled run over every run of its key in between (a false overlap).
pub async fn run_ended(pool: &PgPool, job_id: i64, worker: i32) {
    let at = chrono::Utc::now();
    record_run(pool, || {
        sqlx::query(
            "UPDATE runs SET ended_at = $3
              WHERE ctid = (SELECT ctid FROM runs WHERE job_id = $1 AND worker = $2 AND ended_at IS NULL
                             ORDER BY started_at DESC LIMIT 1)",
        )
        .bind(job_id)
        .bind(worker)
        .bind(at)
    })
    .await;
}

/// Runs one bookkeeping statement, again while the pool is exhausted or the server is slow: a
/// handler that panicked here would leave a run without its end.
async fn record_run<'q>(
    pool: &PgPool,
    statement: impl Fn() -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        match statement().execute(pool).await {
            Ok(_) => return,
            Err(error) if std::time::Instant::now() < deadline => eprintln!("recording a run again after: {error}"),
            Err(error) => panic!("run not recorded: {error}"),
        }
    }
}

/// The most runs of each key that were ever running at the same instant, from `runs`, leaving
/// out the first run of `excluded_worker` (a holder whose lease was provably lost; -1: none).
/// A run whose handler was cancelled (dropped) has no end: it counts until the same job's next
/// run started (a redelivery: that run's lease had lapsed, and the job's permit went with the new
/// delivery, which the permit monitor checks), else until the last recorded instant.
pub async fn max_overlap(pool: &PgPool, excluded_worker: i32) -> Vec<(String, i64)> {
    sqlx::query_as(
        "WITH x AS (SELECT ctid FROM runs WHERE worker = $1 ORDER BY started_at LIMIT 1),
              r AS (SELECT key, started_at,
                           COALESCE(ended_at,
                                    (SELECT min(n.started_at) FROM runs n
                                      WHERE n.job_id = runs.job_id AND n.started_at > runs.started_at),
                                    (SELECT max(GREATEST(started_at, ended_at)) FROM runs)) AS ended_at
                      FROM runs WHERE ctid NOT IN (SELECT ctid FROM x)),
              ev AS (SELECT key, started_at AS t, 1 AS d FROM r UNION ALL SELECT key, ended_at, -1 FROM r),
              c AS (SELECT key, sum(d) OVER (PARTITION BY key ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS n FROM ev)
         SELECT key, max(n)::bigint FROM c GROUP BY key ORDER BY key",
    )
    .bind(excluded_worker)
    .fetch_all(pool)
    .await
    .expect("overlap computed")
}

pub async fn assert_invariants_after_sweep(db: &TestDb) {
    lockgate::sql::sweep(&db.pool, 1000, None).await.expect("sweep");
    let violations = lockgate::sql::check_invariants(&db.pool).await.expect("check");
    assert!(violations.is_empty(), "invariants violated: {violations:?}");
    let over: i64 =
        sqlx::query_scalar("SELECT count(*) FROM permit_violations").fetch_one(&db.pool).await.expect("monitor");
    assert_eq!(over, 0, "a commit left a key with more leases than its limit");
}

/// Rows of `table` read in the current transaction, by scans and through indexes: what a
/// statement costs, independent of the machine's speed.
pub async fn rows_read(conn: &mut sqlx::PgConnection, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT seq_tup_read + COALESCE(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables WHERE relid = $1::regclass",
    )
    .bind(table)
    .fetch_one(conn)
    .await
    .expect("table statistics of this transaction")
}

/// For each of `tables`, in the current transaction: (table, sequential scans, rows read by any
/// scan — the table's rows and its indexes' entries and fetches, since an index scan counts its
/// rows on the index). Flush the session's statistics (`SELECT pg_stat_force_next_flush()`, in
/// a statement before the transaction) first: PostgreSQL 15 counts unflushed reads of earlier
/// transactions in a transaction's own.
pub async fn reads(conn: &mut sqlx::PgConnection, tables: &[&str]) -> Vec<(String, i64, i64)> {
    sqlx::query_as(
        "SELECT t, pg_stat_get_xact_numscans(r),
                pg_stat_get_xact_tuples_returned(r) + pg_stat_get_xact_tuples_fetched(r)
                + COALESCE((SELECT sum(pg_stat_get_xact_tuples_returned(i.indexrelid)
                                       + pg_stat_get_xact_tuples_fetched(i.indexrelid))::bigint
                              FROM pg_index i WHERE i.indrelid = r), 0)
           FROM unnest($1::text[]) t, LATERAL (SELECT t::regclass AS r) c",
    )
    .bind(tables)
    .fetch_all(conn)
    .await
    .expect("table statistics of this transaction")
}

/// How many sessions of the test's database wait for a lock (for `wait_for_count`).
pub const WAITING_FOR_A_LOCK: &str =
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'";

/// The deadlocks the server counted in the test's database, once its statistics are flushed.
pub async fn deadlocks(db: &PgPool) -> i64 {
    lockgate_testkit::wait_for("deadlock statistics", Duration::from_secs(5), || async {
        let n: i64 = sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(db)
            .await?;
        Ok(Some(n))
    })
    .await
    .expect("deadlock statistics")
}

/// `lockgate.complete` of `deliveries` of queue `default`, on a connection of its own, in a task:
/// for a completion that is to wait for a lock while the test goes on.
pub fn complete_apart(url: &str, deliveries: Vec<(i64, i32)>) -> JoinHandle<Result<(), sqlx::Error>> {
    let url = url.to_string();
    tokio::spawn(async move {
        let mut conn = sqlx::PgConnection::connect(&url).await?;
        let (ids, cts): (Vec<i64>, Vec<i32>) = deliveries.into_iter().unzip();
        sqlx::query("SELECT * FROM lockgate.complete('default', $1, $2)")
            .bind(ids)
            .bind(cts)
            .execute(&mut conn)
            .await?;
        Ok(())
    })
}

/// `lockgate.complete` of one delivery `(msg_id, read_ct)` of queue `default`; whether it
/// archived the message.
pub async fn complete_default(db: impl sqlx::PgExecutor<'_>, d: (i64, i32)) -> bool {
    sqlx::query_scalar::<_, i64>("SELECT * FROM lockgate.complete('default', $1, $2)")
        .bind(vec![d.0])
        .bind(vec![d.1])
        .fetch_optional(db)
        .await
        .unwrap()
        .is_some()
}

/// `lockgate.dead_letter` of one delivery of queue `default` (attempts exhausted); whether it
/// removed the message.
pub async fn dead_letter_default(db: impl sqlx::PgExecutor<'_>, d: (i64, i32)) -> bool {
    sqlx::query_scalar("SELECT lockgate.dead_letter('default', $1, $2, 'attempts_exhausted', 'boom', $2)")
        .bind(d.0)
        .bind(d.1)
        .fetch_one(db)
        .await
        .unwrap()
}

/// Waits until another session of this database waits for a lock (a race forced on two
/// connections has reached its blocking statement).
pub async fn until_one_waits_for_a_lock(db: &PgPool) {
    lockgate_testkit::wait_for("a session to wait for a row lock", Duration::from_secs(10), || async {
        let waiting: i64 = sqlx::query_scalar(WAITING_FOR_A_LOCK).fetch_one(db).await?;
        Ok((waiting == 1).then_some(()))
    })
    .await
    .unwrap();
}

/// What a delivery silent past its visibility leaves on queue `default`: every message visible.
pub async fn lapse_visibility(db: &PgPool) {
    sqlx::query("UPDATE pgmq.q_default SET vt = now() - interval '1 second'").execute(db).await.unwrap();
}

/// What `lockgate.check_invariants()` finds wrong, each prefixed with its key when it has one.
pub async fn violations(db: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT COALESCE(key || ': ', '') || problem FROM lockgate.check_invariants()")
        .fetch_all(db)
        .await
        .unwrap()
}
