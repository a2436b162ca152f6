//! Plans that stay flat (issue 14; docs/design.md §60, §64, §65). A session keeps the plans of
//! lockgate's statements; planned while the tables were small, a plan that reaches a table other
//! than through the rows it was given reads the whole table at every later call once it has
//! grown. Each test plans every per-job path in one session on small tables (analysed with a few
//! rows, analysed empty, never analysed: the three states a table is in when a process starts),
//! grows every key table by thousands of rows from other sessions, then counts what one more call
//! of each path reads, sequentially or through any index.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use lockgate_testkit::TestDb;
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection, PgPool};

/// Rows each key table grows by.
const GROWN: usize = 5_000;

/// The tables a per-job path may read only at the rows of its own jobs.
const KEY_TABLES: &[&str] = &[
    "lockgate.semaphores",
    "lockgate.leases",
    "lockgate.parked",
    "lockgate.unique_locks",
    "lockgate.batches",
    "lockgate.batch_jobs",
];

/// What the tables' statistics say when the session plans.
#[derive(Clone, Copy, PartialEq)]
enum Stats {
    /// Analysed while they held a few rows each.
    Few,
    /// Analysed while empty (as autovacuum leaves them after a drain).
    Empty,
    /// Never analysed (estimated from their size).
    Never,
}

#[tokio::test]
async fn paths_planned_on_a_few_analysed_rows_read_only_their_own_once_the_tables_grow() {
    paths_stay_flat(Stats::Few).await;
}

#[tokio::test]
async fn paths_planned_on_tables_analysed_empty_read_only_their_own_once_the_tables_grow() {
    paths_stay_flat(Stats::Empty).await;
}

#[tokio::test]
async fn paths_planned_on_tables_never_analysed_read_only_their_own_once_the_tables_grow() {
    paths_stay_flat(Stats::Never).await;
}

async fn paths_stay_flat(stats: Stats) {
    let db = TestDb::migrated().await.unwrap();
    for t in [
        "'lim', concurrency_limit => 1, concurrency_key => array['k']",
        // A lease (the floor, 10 s) shorter than the claim's visibility: renewed at each claim.
        "'short', concurrency_limit => 1, concurrency_key => array['k'], concurrency_duration_ms => 1000",
        "'ulim', concurrency_limit => 1, concurrency_key => array['k'], unique_mode => 'until_executed', unique_key => array['u']",
        "'dulim', concurrency_limit => 1, concurrency_key => array['k'], concurrency_on_conflict => 'discard',
          unique_mode => 'until_executed', unique_key => array['u']",
        "'uq', unique_mode => 'until_executed', unique_key => array['u']",
        "'plain'",
    ] {
        sqlx::query(&format!("SELECT lockgate.define_job_type({t})")).execute(&db.pool).await.unwrap();
    }
    if stats == Stats::Few {
        grow_by(&db.pool, 3).await;
    }
    if stats != Stats::Never {
        analyse(&db.pool).await;
    }
    // One session plans every path, several times each (a PL/pgSQL statement keeps a generic
    // plan from its sixth run).
    let mut conn = db.pool.acquire().await.unwrap();
    for round in 0..8 {
        every_path(&mut conn, round, None).await;
    }
    grow_by(&db.pool, GROWN).await;
    let mut over = Vec::new();
    for round in 8..10 {
        every_path(&mut conn, round, Some(&mut over)).await;
    }
    assert!(over.is_empty(), "paths that read more than their own rows once the tables grew: {over:#?}");
    assert!(lockgate::sql::check_invariants(&db.pool).await.unwrap().is_empty(), "invariants hold");
}

async fn analyse(pool: &PgPool) {
    sqlx::query(&format!("ANALYZE {}", KEY_TABLES.join(", "))).execute(pool).await.unwrap();
}

/// From other sessions: n keys holding a permit, n jobs parked on one key, n uniqueness locks, n
/// batches and n batch memberships, all in the session's queue and none visible for an hour.
/// Not analysed afterwards (an ANALYZE would have the session plan again).
async fn grow_by(pool: &PgPool, n: usize) {
    let later = json!({ "delay": 3600 });
    let many = |f: &dyn Fn(usize) -> Value| (0..n).map(f).collect::<Vec<_>>();
    for (job_type, args, options) in [
        ("lim", many(&|i| json!({ "k": format!("grown{n}.{i}") })), later.clone()),
        ("lim", many(&|_| json!({ "k": format!("hot{n}") })), later.clone()),
        ("uq", many(&|i| json!({ "u": format!("{n}.{i}") })), later.clone()),
    ] {
        sqlx::query("SELECT count(*) FROM lockgate.enqueue_many($1, $2, $3)")
            .bind(job_type)
            .bind(&args)
            .bind(&options)
            .execute(pool)
            .await
            .unwrap();
    }
    let batch: i64 = sqlx::query_scalar("SELECT max(lockgate.create_batch()) FROM generate_series(1, $1)")
        .bind(n as i32)
        .fetch_one(pool)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM lockgate.enqueue_many('plain', $1, jsonb_build_object('delay', 3600, 'batch', $2::bigint))")
        .bind(many(&|i| json!({ "n": i })))
        .bind(batch)
        .execute(pool)
        .await
        .unwrap();
}

/// Each per-job path once, on jobs of its own (nothing stays visible between paths). Measured
/// (when `over` is given): the paths that read more than a handful of a key table's rows, with
/// what they read.
async fn every_path(conn: &mut PgConnection, round: usize, mut over: Option<&mut Vec<(String, Reads)>>) {
    let r = round;
    // A completion that gives a permit back and promotes the key's next job.
    enqueue(conn, "lim", json!({ "k": format!("a{r}") })).await;
    enqueue(conn, "lim", json!({ "k": format!("a{r}") })).await;
    let d = claim(conn, 30.0).await;
    step(
        conn,
        &mut over,
        "a limited completion that promotes",
        &format!("SELECT * FROM lockgate.complete('default', ARRAY[{}], ARRAY[{}])", d.0, d.1),
    )
    .await;
    finish(conn).await;
    // A dead letter.
    enqueue(conn, "plain", json!({})).await;
    let d = claim(conn, 30.0).await;
    step(
        conn,
        &mut over,
        "a dead letter",
        &format!("SELECT lockgate.dead_letter('default', {}, {}, 'attempts_exhausted', 'boom', 1)", d.0, d.1),
    )
    .await;
    // A retry of a limited job (its lease renewed) and of an unlimited one.
    for (job_type, what) in [("lim", "a retry of a limited job"), ("plain", "a retry")] {
        enqueue(conn, job_type, json!({ "k": format!("c{r}") })).await;
        let d = claim(conn, 30.0).await;
        step(conn, &mut over, what, &format!("SELECT lockgate.retry('default', {}, {}, 3600, 'boom', 1)", d.0, d.1))
            .await;
    }
    // A batch closed, then its job completed: counted, and the batch finished.
    let batch: i64 = sqlx::query_scalar("SELECT lockgate.create_batch()").fetch_one(&mut *conn).await.unwrap();
    step(
        conn,
        &mut over,
        "an enqueue into a batch",
        &format!("SELECT * FROM lockgate.enqueue('plain', '{{}}', '{{\"batch\": {batch}}}')"),
    )
    .await;
    step(conn, &mut over, "closing a batch", &format!("SELECT lockgate.close_batch({batch})")).await;
    let d = claim(conn, 30.0).await;
    step(
        conn,
        &mut over,
        "a batch job's completion",
        &format!("SELECT * FROM lockgate.complete('default', ARRAY[{}], ARRAY[{}])", d.0, d.1),
    )
    .await;
    // A claim that renews a lease ending before the visibility.
    enqueue(conn, "short", json!({ "k": format!("f{r}") })).await;
    step(conn, &mut over, "a claim renewing a lease", "SELECT * FROM lockgate.claim('default', 1, 60)").await;
    sqlx::query("SELECT * FROM lockgate.complete('default', ARRAY(SELECT l.msg_id FROM lockgate.leases l WHERE l.key = $1), ARRAY[1])")
        .bind(format!("short:[\"f{r}\"]"))
        .execute(&mut *conn)
        .await
        .unwrap();
    // A claim of a job whose lease lapsed: it gives the old lease back and takes a permit again.
    enqueue(conn, "lim", json!({ "k": format!("g{r}") })).await;
    let lapsed = claim(conn, 30.0).await;
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second' WHERE key = $1")
        .bind(format!("lim:[\"g{r}\"]"))
        .execute(&mut *conn)
        .await
        .unwrap();
    // Its visibility lapsed too (its worker gone): the next claim takes it again.
    sqlx::query("UPDATE pgmq.q_default SET vt = now() - interval '1 second' WHERE msg_id = $1")
        .bind(lapsed.0)
        .execute(&mut *conn)
        .await
        .unwrap();
    step(
        conn,
        &mut over,
        "a claim taking a lapsed lease's permit again",
        "SELECT * FROM lockgate.claim('default', 1, 30)",
    )
    .await;
    let held: (i64, i32) = sqlx::query_as("SELECT msg_id, read_ct FROM pgmq.q_default WHERE message->>'k' = $1")
        .bind(format!("g{r}"))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(held.1, 2, "the lapsed job was claimed again");
    assert!(common::complete_default(&mut *conn, held).await);
    // A unique job that parks behind its key's permit, and one its limit discards.
    for (job_type, what) in [("ulim", "a unique job parking"), ("dulim", "a unique job discarded by its limit")] {
        enqueue(conn, job_type, json!({ "k": format!("h{r}"), "u": format!("h{r}a") })).await;
        let second = format!("SELECT * FROM lockgate.enqueue('{job_type}', '{{\"k\": \"h{r}\", \"u\": \"h{r}b\"}}')");
        step(conn, &mut over, what, &second).await;
        finish(conn).await;
    }
    // A parked job cancelled.
    enqueue(conn, "lim", json!({ "k": format!("j{r}") })).await;
    let parked = enqueue(conn, "lim", json!({ "k": format!("j{r}") })).await;
    step(conn, &mut over, "cancelling a parked job", &format!("SELECT * FROM lockgate.cancel({parked})")).await;
    finish(conn).await;
}

/// Enqueues one job now; returns its job id.
async fn enqueue(conn: &mut PgConnection, job_type: &str, args: Value) -> i64 {
    sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue($1, $2)")
        .bind(job_type)
        .bind(args)
        .fetch_one(&mut *conn)
        .await
        .unwrap()
}

async fn claim(conn: &mut PgConnection, vt: f64) -> (i64, i32) {
    sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, $1)")
        .bind(vt)
        .fetch_one(&mut *conn)
        .await
        .unwrap()
}

/// Claims and completes whatever is visible, until nothing is.
async fn finish(conn: &mut PgConnection) {
    loop {
        let claimed: Vec<(i64, i32)> = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30)")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        if claimed.is_empty() {
            return;
        }
        for d in claimed {
            assert!(common::complete_default(&mut *conn, d).await);
        }
    }
}

/// (table, sequential scans, rows read sequentially or through any index) of each key table.
type Reads = Vec<(String, i64, i64)>;

/// Runs one statement in a transaction of its own; when measuring, notes it in `over` if it read
/// more than a handful of any key table's rows.
async fn step(conn: &mut PgConnection, over: &mut Option<&mut Vec<(String, Reads)>>, what: &str, statement: &str) {
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::raw_sql(statement).execute(&mut *tx).await.unwrap_or_else(|e| panic!("{what}: {e}"));
    let reads = common::reads(&mut tx, KEY_TABLES).await;
    tx.commit().await.unwrap();
    if let Some(over) = over.as_deref_mut() {
        if reads.iter().any(|(_, _, rows)| *rows >= 50) {
            over.push((what.to_owned(), reads.into_iter().filter(|(_, _, rows)| *rows > 0).collect()));
        }
    }
}

/// A helper's plan is made under the settings of whichever path calls it first in a session. The
/// uniqueness check (`_take_unique`) is called by enqueues and claims, which hold their own
/// settings, and by `dlq_retry`, which did not: planned there on a few analysed locks, it read the
/// grown locks whole at every later duplicate enqueue of the session (the second review of §65).
#[tokio::test]
async fn a_helper_planned_first_by_an_operator_path_reads_only_its_own_rows_for_the_hot_paths() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query(
        "SELECT lockgate.define_job_type('uq', unique_mode => 'until_executed', unique_key => array['u'],
                                         unique_on_conflict => 'discard')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    grow_unique(&db.pool, 3).await;
    analyse(&db.pool).await;
    // A dead job whose key another job holds now: each retry of it is a duplicate.
    let mut conn = db.pool.acquire().await.unwrap();
    let dead = enqueue(&mut conn, "uq", json!({ "u": "held" })).await;
    let d = claim(&mut conn, 30.0).await;
    sqlx::query("SELECT lockgate.dead_letter('default', $1, $2, 'attempts_exhausted', 'boom', 1)")
        .bind(d.0)
        .bind(d.1)
        .execute(&mut *conn)
        .await
        .unwrap();
    enqueue(&mut conn, "uq", json!({ "u": "held" })).await;
    for _ in 0..8 {
        let status: String = sqlx::query_scalar("SELECT status FROM lockgate.dlq_retry(NULL, ARRAY[$1::bigint])")
            .bind(dead)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(status, "duplicate");
    }
    grow_unique(&db.pool, GROWN).await;
    let mut over = Vec::new();
    for round in 0..2 {
        let duplicate = format!("SELECT * FROM lockgate.enqueue('uq', '{{\"u\": \"{GROWN}.{}\"}}')", GROWN - 1 - round);
        step(&mut conn, &mut Some(&mut over), "a duplicate enqueue", &duplicate).await;
    }
    assert!(over.is_empty(), "paths that read more than their own rows once the locks grew: {over:#?}");
}

/// n uniqueness locks, held by jobs not visible for an hour (from another session).
async fn grow_unique(pool: &PgPool, n: usize) {
    let args: Vec<Value> = (0..n).map(|i| json!({ "u": format!("{n}.{i}") })).collect();
    sqlx::query("SELECT count(*) FROM lockgate.enqueue_many('uq', $1, '{\"delay\": 3600}')")
        .bind(&args)
        .execute(pool)
        .await
        .unwrap();
}
