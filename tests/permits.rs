//! The permit protocol under the schedules that broke it (issue 10): a claim after a lease
//! lapsed, a claim racing a sweep, a stale renewal, a prune of a process whose jobs are healthy,
//! message content that is not lockgate's, and a mixed load that must show no deadlock. Each
//! test drives the public SQL API the way psql would, and checks the database's own view of who
//! may run: `lockgate.check_invariants()` now covers deliveries as well as leases.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{lapse_visibility, violations};
use lockgate_testkit::{wait_for, TestDb};
use sqlx::{Connection, PgConnection, PgPool, Row};

/// A delivery as `lockgate.claim` returns it: (msg_id, read_ct, budget in seconds).
type Delivery = (i64, i32, f64);

async fn limited(limit: i32, duration_ms: i64) -> TestDb {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query(
        "SELECT lockgate.define_job_type('lim', concurrency_limit => $1, concurrency_key => array['k'],
                                         concurrency_duration_ms => $2)",
    )
    .bind(limit)
    .bind(duration_ms)
    .execute(&db.pool)
    .await
    .unwrap();
    db
}

async fn enqueue(db: &PgPool, k: i64) -> (Option<i64>, i64, String) {
    let row =
        sqlx::query("SELECT msg_id, job_id, status FROM lockgate.enqueue('lim', jsonb_build_object('k', $1::bigint))")
            .bind(k)
            .fetch_one(db)
            .await
            .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

async fn claim(db: impl sqlx::PgExecutor<'_>, qty: i32) -> Vec<Delivery> {
    sqlx::query_as("SELECT msg_id, read_ct, budget_seconds FROM lockgate.claim('default', $1, 30)")
        .bind(qty)
        .fetch_all(db)
        .await
        .unwrap()
}

async fn sweep(db: impl sqlx::PgExecutor<'_>) -> (i32, i32, i32) {
    sqlx::query_as("SELECT expired, orphaned, promoted FROM lockgate.sweep()").fetch_one(db).await.unwrap()
}

/// What a backlog longer than `duration` (or a silent holder) does to every lease: ends it.
async fn lapse_leases(db: &PgPool) {
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second'").execute(db).await.unwrap();
}

/// Runs `statement` with lockgate's guards of key rows switched off (migration 19), as only a
/// session allowed to disable triggers can: the one way left to make a lease or parked job that
/// no semaphore row counts.
async fn without_key_guards(db: &PgPool, statement: &str) {
    sqlx::raw_sql(&format!("SET session_replication_role = replica; {statement}; RESET session_replication_role"))
        .execute(db)
        .await
        .unwrap();
}

/// Deliveries the database lets run now: claimed, not waiting, still invisible, holding a lease
/// that lasts at least as long as their visibility.
async fn entitled(db: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pgmq.q_default m JOIN lockgate.leases l ON l.queue = 'default' AND l.msg_id = m.msg_id
          WHERE m.read_ct > 0 AND m.vt > now() AND NOT m.headers ? 'retry_at' AND l.expires_at >= m.vt",
    )
    .fetch_one(db)
    .await
    .unwrap()
}

#[tokio::test]
async fn h24_a_claim_after_the_lease_lapsed_takes_a_permit_again_and_the_sweep_admits_no_second() {
    // The reproduction of issue 10, defect 1, on one connection.
    let db = limited(1, 60_000).await;
    let (m, _, status) = enqueue(&db.pool, 1).await;
    assert_eq!(status, "enqueued");
    assert_eq!(enqueue(&db.pool, 1).await.2, "parked");
    lapse_leases(&db.pool).await;

    let first = claim(&db.pool, 10).await;
    assert_eq!(first.iter().map(|d| d.0).collect::<Vec<_>>(), vec![m.unwrap()], "M is claimed");
    let live: bool = sqlx::query_scalar(
        "SELECT expires_at >= (SELECT vt FROM pgmq.q_default WHERE msg_id = $1) FROM lockgate.leases WHERE msg_id = $1",
    )
    .bind(m)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(live, "the claim returned M holding a live lease that outlasts its visibility");
    assert_eq!(sweep(&db.pool).await, (0, 0, 0), "nothing expired: the claim renewed M's lease");
    assert!(claim(&db.pool, 10).await.is_empty(), "P stays parked while M holds the only permit");
    assert_eq!(entitled(&db.pool).await, 1);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn h24_a_delivery_whose_lease_was_swept_parks_behind_the_promoted_job() {
    let db = limited(1, 60_000).await;
    let (m, m_job, _) = enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 1).await;
    let first = claim(&db.pool, 10).await;
    assert_eq!(first.len(), 1);
    // M's holder goes silent past both budgets; the sweep gives the permit to P.
    lapse_leases(&db.pool).await;
    lapse_visibility(&db.pool).await;
    assert_eq!(sweep(&db.pool).await, (1, 0, 1));
    let second = claim(&db.pool, 10).await;
    assert_eq!(second.len(), 1, "only P runs: {second:?}");
    assert_ne!(Some(second[0].0), m, "M must not run beside P on a limit-1 key");
    let parked: Vec<i64> = sqlx::query_scalar("SELECT job_id FROM lockgate.parked").fetch_all(&db.pool).await.unwrap();
    assert_eq!(parked, vec![m_job], "M waits for the permit again, keeping its job id");
    assert_eq!(entitled(&db.pool).await, 1);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn h24_a_claim_racing_an_uncommitted_sweep_never_returns_the_delivery_it_is_expiring() {
    let db = limited(1, 60_000).await;
    let (m, _, _) = enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 1).await;
    claim(&db.pool, 10).await;
    lapse_leases(&db.pool).await;
    lapse_visibility(&db.pool).await;

    // The sweep expires M's lease and promotes P, and has not committed yet.
    let mut sweeper = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut sweeper).await.unwrap();
    assert_eq!(sweep(&mut sweeper).await, (1, 0, 1));
    let during = tokio::time::timeout(Duration::from_secs(10), claim(&db.pool, 10)).await.expect("claim never waits");
    assert!(during.is_empty(), "nothing may run while the sweep holds the key: {during:?}");
    sqlx::query("COMMIT").execute(&mut sweeper).await.unwrap();

    // M was put back for a second (its key was held); then it parks behind P.
    lapse_visibility(&db.pool).await;
    let after = claim(&db.pool, 10).await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(Some(after[0].0), m);
    assert_eq!(entitled(&db.pool).await, 1);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn h25_a_stale_delivery_renews_neither_the_message_nor_the_successors_lease() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    let stale = claim(&db.pool, 1).await.remove(0);
    lapse_visibility(&db.pool).await;
    let current = claim(&db.pool, 1).await.remove(0);
    assert_eq!(current.1, stale.1 + 1);
    let before: (f64, f64) = sqlx::query_as(
        "SELECT extract(epoch FROM l.expires_at)::float8, extract(epoch FROM m.vt)::float8
           FROM lockgate.leases l JOIN pgmq.q_default m ON m.msg_id = l.msg_id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let renewed: Vec<i64> = sqlx::query_scalar("SELECT msg_id FROM lockgate.extend('default', $1, $2, 300)")
        .bind(vec![stale.0])
        .bind(vec![stale.1])
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert!(renewed.is_empty(), "a stale token is not owned");
    let after: (f64, f64) = sqlx::query_as(
        "SELECT extract(epoch FROM l.expires_at)::float8, extract(epoch FROM m.vt)::float8
           FROM lockgate.leases l JOIN pgmq.q_default m ON m.msg_id = l.msg_id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(before, after, "the stale renewal changed nothing");

    // The current delivery renews both, and its visibility never outlives its lease.
    let budget: f64 = sqlx::query_scalar("SELECT budget_seconds FROM lockgate.extend('default', $1, $2, 300)")
        .bind(vec![current.0])
        .bind(vec![current.1])
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!((55.0..=60.5).contains(&budget), "budget capped by the 60 s lease, got {budget}");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn h25_a_heartbeat_never_waits_for_a_row_lock_and_reports_the_delivery_busy() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    let d = claim(&db.pool, 1).await.remove(0);
    // The delivery's own completion holds its message row (not committed yet).
    let mut completer = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut completer).await.unwrap();
    sqlx::query("SELECT lockgate.complete('default', $1, $2)")
        .bind(vec![d.0])
        .bind(vec![d.1])
        .execute(&mut completer)
        .await
        .unwrap();
    let renewal = sqlx::query_as("SELECT msg_id, budget_seconds FROM lockgate.extend('default', $1, $2, 30)")
        .bind(vec![d.0])
        .bind(vec![d.1])
        .fetch_all(&db.pool);
    let rows: Vec<(i64, Option<f64>)> = tokio::time::timeout(Duration::from_secs(3), renewal)
        .await
        .expect("the heartbeat waited for a row lock")
        .unwrap();
    assert_eq!(rows, vec![(d.0, None)], "busy: neither renewed nor lost");
    sqlx::query("COMMIT").execute(&mut completer).await.unwrap();
    let rows: Vec<i64> = sqlx::query_scalar("SELECT msg_id FROM lockgate.extend('default', $1, $2, 30)")
        .bind(vec![d.0])
        .bind(vec![d.1])
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert!(rows.is_empty(), "once completed, the delivery is no longer owned");
}

#[tokio::test]
async fn h28_a_completion_and_a_dead_letter_never_wait_for_a_producers_key_row_and_the_sweep_gives_their_permits_back()
{
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 2).await;
    assert_eq!(claim(&db.pool, 2).await.len(), 2);
    // A producer parks a job of each key in a transaction it keeps open: it holds both keys' rows.
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut producer).await.unwrap();
    for k in [1, 2] {
        let status: String =
            sqlx::query_scalar("SELECT status FROM lockgate.enqueue('lim', jsonb_build_object('k', $1::bigint))")
                .bind(k)
                .fetch_one(&mut producer)
                .await
                .unwrap();
        assert_eq!(status, "parked");
    }
    // The first job completes and the second is dead-lettered, on a session that may not wait a
    // second for any lock: both land, and leave their leases, marked finished, to the sweep.
    let mut worker = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("SET lock_timeout = '1s'").execute(&mut worker).await.unwrap();
    // The deliveries, in key order.
    let keyed: Vec<(i64, i32, String)> = sqlx::query_as(
        "SELECT l.msg_id, m.read_ct, l.key FROM lockgate.leases l JOIN pgmq.q_default m ON m.msg_id = l.msg_id
          ORDER BY l.key",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let archived: Vec<i64> = sqlx::query_scalar("SELECT lockgate.complete('default', $1, $2)")
        .bind(vec![keyed[0].0])
        .bind(vec![keyed[0].1])
        .fetch_all(&mut worker)
        .await
        .expect("the completion waited for the producer's key row");
    assert_eq!(archived, vec![keyed[0].0]);
    let dead: bool =
        sqlx::query_scalar("SELECT lockgate.dead_letter('default', $1, $2, 'attempts_exhausted', 'boom', 1)")
            .bind(keyed[1].0)
            .bind(keyed[1].1)
            .fetch_one(&mut worker)
            .await
            .expect("the dead letter waited for the producer's key row");
    assert!(dead);
    let finished: Vec<String> = sqlx::query_scalar(
        "SELECT key FROM lockgate.leases WHERE finished_at IS NOT NULL AND expires_at <= now() ORDER BY key",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(finished, vec![keyed[0].2.clone(), keyed[1].2.clone()]);
    // Not a violation, nor an orphaned lease: the sweep frees them once it can.
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
    let verdict: String =
        sqlx::query_scalar("SELECT verdict FROM lockgate._doctor_leases() WHERE check_name = 'orphaned_leases'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(verdict, "ok");
    // One finished over a minute ago, never given back, is a warning.
    let finished_check = "SELECT verdict FROM lockgate._doctor_leases() WHERE check_name = 'finished_leases'";
    let verdict: String = sqlx::query_scalar(finished_check).fetch_one(&db.pool).await.unwrap();
    assert_eq!(verdict, "ok");
    sqlx::query("UPDATE lockgate.leases SET finished_at = now() - interval '2 minutes' WHERE key = $1")
        .bind(&keyed[0].2)
        .execute(&db.pool)
        .await
        .unwrap();
    let verdict: String = sqlx::query_scalar(finished_check).fetch_one(&db.pool).await.unwrap();
    assert_eq!(verdict, "warn");
    // The sweep skips the keys the producer holds, then frees both permits and promotes both
    // parked jobs once it has committed, counting none as expired or orphaned.
    assert_eq!(sweep(&db.pool).await, (0, 0, 0));
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    assert_eq!(sweep(&db.pool).await, (0, 0, 2));
    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.leases WHERE finished_at IS NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(live, 2, "each key's permit went to its promoted job");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Completes delivery `d` on a session that may not wait a second for any lock.
async fn complete_without_waiting(db: &TestDb, d: Delivery) {
    let mut worker = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("SET lock_timeout = '1s'").execute(&mut worker).await.unwrap();
    let archived: Vec<i64> = sqlx::query_scalar("SELECT lockgate.complete('default', $1, $2)")
        .bind(vec![d.0])
        .bind(vec![d.1])
        .fetch_all(&mut worker)
        .await
        .expect("the completion waited for a lock");
    assert_eq!(archived, vec![d.0]);
}

async fn finished_leases(db: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM lockgate.leases WHERE finished_at IS NOT NULL")
        .fetch_one(db)
        .await
        .unwrap()
}

/// Parks a job of key `k` in a transaction left open on a connection of its own, which it returns.
async fn park_and_hold(db: &TestDb, k: i64) -> PgConnection {
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut producer).await.unwrap();
    let status: String =
        sqlx::query_scalar("SELECT status FROM lockgate.enqueue('lim', jsonb_build_object('k', $1::bigint))")
            .bind(k)
            .fetch_one(&mut producer)
            .await
            .unwrap();
    assert_eq!(status, "parked");
    producer
}

/// Key 1, limited to 1: its running job completes while a producer, on the connection returned,
/// holds the key's row in an open transaction that parked a second job; the completion leaves its
/// permit on its lease, marked finished.
async fn finished_behind_a_producer() -> (TestDb, PgConnection) {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    let d = claim(&db.pool, 1).await.remove(0);
    let producer = park_and_hold(&db, 1).await;
    complete_without_waiting(&db, d).await;
    assert_eq!(finished_leases(&db.pool).await, 1);
    (db, producer)
}

/// Review of §72 (helper-68, finding 1): with a permit left to the sweep alone, producers holding
/// a key's row for a few tens of milliseconds at a time left most of its permits idle between
/// sweeps. The next transaction to hold the row gives them back: an enqueue of the key, to the
/// key's parked jobs first.
#[tokio::test]
async fn h28_a_finished_jobs_permit_goes_back_at_the_next_enqueue_of_its_key_to_the_oldest_parked_job() {
    let (db, mut producer) = finished_behind_a_producer().await;
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    // No sweep: the next enqueue of the key gives the permit back, promotes the parked job into
    // it, and parks behind it.
    let (_, _, status) = enqueue(&db.pool, 1).await;
    assert_eq!(status, "parked");
    assert_eq!(finished_leases(&db.pool).await, 0);
    let promoted: Vec<Delivery> = claim(&db.pool, 5).await;
    assert_eq!(promoted.len(), 1, "the job parked first runs");
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.parked").fetch_one(&db.pool).await.unwrap();
    assert_eq!(parked, 1, "the one enqueued last waits");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// The same, through the key's next completion: it gives back its own permit and the finished
/// one, and promotes into both.
#[tokio::test]
async fn h28_a_finished_jobs_permit_goes_back_at_the_next_completion_of_its_key() {
    let db = limited(2, 60_000).await;
    enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 1).await;
    let ds = claim(&db.pool, 2).await;
    assert_eq!(ds.len(), 2);
    let mut producer = park_and_hold(&db, 1).await;
    complete_without_waiting(&db, ds[0]).await;
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    enqueue(&db.pool, 1).await;
    assert_eq!(finished_leases(&db.pool).await, 0, "the enqueue gave the permit back, to the parked job");
    // Hold the row again, finish the second job behind it, and let a third completion find it.
    let promoted = claim(&db.pool, 5).await;
    assert_eq!(promoted.len(), 1);
    let mut producer = park_and_hold(&db, 1).await;
    complete_without_waiting(&db, ds[1]).await;
    assert_eq!(finished_leases(&db.pool).await, 1);
    sqlx::query("ROLLBACK").execute(&mut producer).await.unwrap();
    complete_without_waiting(&db, promoted[0]).await;
    assert_eq!(finished_leases(&db.pool).await, 0, "the completion gave the finished permit back too");
    let (value, parked): (i32, i64) =
        sqlx::query_as("SELECT (SELECT value FROM lockgate.semaphores), (SELECT count(*) FROM lockgate.parked)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((value, parked), (1, 0), "both permits back, one taken by the last parked job");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Review of §72 (helper-74): the runtime's give-back of a finished permit waits for the key's row
/// behind the producer that holds it. On a connection whose default isolation is REPEATABLE READ
/// its snapshot predated the producer's commit, so the promotion did not see the job the producer
/// parked: the permit went back with the job still parked, for a later enqueue to take ahead of
/// it. And under the pool's short statement_timeout (a quarter of the visibility timeout) the wait
/// failed. It runs in READ COMMITTED, with a statement timeout of its own.
#[tokio::test]
async fn h28_the_runtimes_give_back_promotes_the_job_parked_by_the_producer_it_waited_for() {
    let (db, mut producer) = finished_behind_a_producer().await;
    let options: sqlx::postgres::PgConnectOptions = db.url.parse().unwrap();
    let options =
        options.options([("default_transaction_isolation", "repeatable\\ read"), ("statement_timeout", "200ms")]);
    let runtime_pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options).await.unwrap();
    let key: String = sqlx::query_scalar("SELECT key FROM lockgate.leases").fetch_one(&db.pool).await.unwrap();
    let give_back = tokio::spawn(async move {
        let mut conn = runtime_pool.acquire().await.unwrap();
        lockgate::sql::give_back_finished(&mut conn, &key, Duration::from_secs(5)).await
    });
    common::until_one_waits_for_a_lock(&db.pool).await;
    // Held past the pool's statement timeout, then committed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    assert!(give_back.await.unwrap().expect("the give-back failed"), "the give-back got the key's row");
    assert_eq!(finished_leases(&db.pool).await, 0);
    let (value, parked): (i32, i64) =
        sqlx::query_as("SELECT (SELECT value FROM lockgate.semaphores), (SELECT count(*) FROM lockgate.parked)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((value, parked), (1, 0), "the parked job took the permit");
    assert_eq!(claim(&db.pool, 5).await.len(), 1, "and runs");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Review of §72 (helper-74): an enqueue gives a finished permit back before it takes one
/// (`_give_back_finished`), waiting for the key's row behind the producer that holds it. In a
/// REPEATABLE READ transaction its snapshot predated that producer's commit, so the promotion did
/// not see the job the producer had parked, and the enqueue took the permit ahead of it. Outside
/// READ COMMITTED it leaves the permit to the next holder: the later job parks behind the older.
#[tokio::test]
async fn h28_an_enqueue_at_repeatable_read_never_takes_a_finished_permit_ahead_of_a_parked_job() {
    let (db, mut producer) = finished_behind_a_producer().await;
    let mut late = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut late).await.unwrap();
    sqlx::query("SELECT 1").execute(&mut late).await.unwrap();
    let enqueue_late = tokio::spawn(async move {
        let status: String = sqlx::query_scalar("SELECT status FROM lockgate.enqueue('lim', '{\"k\": 1}')")
            .fetch_one(&mut late)
            .await
            .unwrap();
        sqlx::query("COMMIT").execute(&mut late).await.unwrap();
        status
    });
    common::until_one_waits_for_a_lock(&db.pool).await;
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    assert_eq!(enqueue_late.await.unwrap(), "parked", "the later job waits behind the one parked first");
    sweep(&db.pool).await;
    let promoted: Vec<i64> = sqlx::query_scalar("SELECT (headers->>'job_id')::bigint FROM pgmq.q_default")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let oldest: i64 = sqlx::query_scalar("SELECT min(job_id) FROM lockgate.parked").fetch_one(&db.pool).await.unwrap();
    assert_eq!(promoted.len(), 1);
    assert!(promoted[0] < oldest, "the job parked first runs first");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Review (helper-76, finding 3): a completion at REPEATABLE READ whose snapshot predates a job
/// parked behind its key (parking locks the key's row without changing it, so locking it raises
/// no serialization failure) gave the permit back without promoting that job, and the next enqueue
/// took the permit ahead of it. Outside READ COMMITTED a completion now leaves its permit
/// finished, for a READ COMMITTED give-back that sees every parked job.
#[tokio::test]
async fn h28_a_completion_at_repeatable_read_never_gives_a_permit_past_a_job_parked_after_its_snapshot() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    let d = claim(&db.pool, 1).await.remove(0);
    let mut worker = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut worker).await.unwrap();
    sqlx::query("SELECT count(*) FROM lockgate.parked").execute(&mut worker).await.unwrap();
    let (_, parked_first, status) = enqueue(&db.pool, 1).await;
    assert_eq!(status, "parked");
    sqlx::query("SELECT lockgate.complete('default', $1, $2)")
        .bind(vec![d.0])
        .bind(vec![d.1])
        .execute(&mut worker)
        .await
        .unwrap();
    sqlx::query("COMMIT").execute(&mut worker).await.unwrap();
    let (_, _, later) = enqueue(&db.pool, 1).await;
    assert_eq!(later, "parked", "the later job waits behind the one parked first");
    let running: Vec<i64> = sqlx::query_scalar("SELECT (headers->>'job_id')::bigint FROM pgmq.q_default")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(running, vec![parked_first], "the job parked first was promoted into the permit");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Review (helper-76, finding 4): an enqueue at REPEATABLE READ cannot give a finished job's
/// permit back (its snapshot may miss a job parked behind the key), and so discarded its job, or
/// raised LG004, on a key where nothing may be running. It fails with a serialization failure
/// instead, which such a transaction retries; at READ COMMITTED the same enqueue is admitted.
#[tokio::test]
async fn h28_an_enqueue_at_repeatable_read_never_discards_behind_a_finished_permit() {
    let db = limited(1, 60_000).await;
    sqlx::query("SELECT lockgate.define_job_type('lim', concurrency_limit => 1, concurrency_key => array['k'], concurrency_on_conflict => 'discard')")
        .execute(&db.pool)
        .await
        .unwrap();
    enqueue(&db.pool, 1).await;
    let d = claim(&db.pool, 1).await.remove(0);
    let mut holder = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    assert_eq!(enqueue_args_on(&mut holder, serde_json::json!({"k": 1})).await, "discarded");
    complete_without_waiting(&db, d).await;
    assert_eq!(finished_leases(&db.pool).await, 1);
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    let mut late = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut late).await.unwrap();
    let err =
        sqlx::query("SELECT status FROM lockgate.enqueue('lim', '{\"k\": 1}')").execute(&mut late).await.unwrap_err();
    let code = err.as_database_error().and_then(|e| e.code()).unwrap_or_default().to_string();
    assert_eq!(code, "40001", "{err}");
    sqlx::query("ROLLBACK").execute(&mut late).await.unwrap();
    assert_eq!(
        enqueue_args(&db.pool, serde_json::json!({"k": 1})).await,
        "enqueued",
        "at READ COMMITTED the permit goes back first"
    );
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Review of §72 (helper-69, finding 2): an enqueue that waited for the key's row looked for
/// finished permits before the wait, and a job of the key that finished meanwhile left its permit
/// where the enqueue did not look again: both parked jobs waited for the sweep while nothing ran.
#[tokio::test]
async fn h28_an_enqueue_that_waited_for_the_key_gives_back_a_permit_finished_meanwhile() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    let d = claim(&db.pool, 1).await.remove(0);
    let mut producer = park_and_hold(&db, 1).await;
    let url = db.url.clone();
    let waiting = tokio::spawn(async move {
        let mut conn = PgConnection::connect(&url).await.unwrap();
        sqlx::query_scalar::<_, String>("SELECT status FROM lockgate.enqueue('lim', '{\"k\": 1}')")
            .fetch_one(&mut conn)
            .await
            .unwrap()
    });
    wait_for("the second enqueue to wait for the key's row", Duration::from_secs(15), || async {
        Ok((sqlx::query_scalar::<_, i64>(common::WAITING_FOR_A_LOCK).fetch_one(&db.pool).await? > 0).then_some(()))
    })
    .await
    .unwrap();
    complete_without_waiting(&db, d).await;
    assert_eq!(finished_leases(&db.pool).await, 1);
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    assert_eq!(waiting.await.unwrap(), "parked", "the key is full again: the first parked job took the permit");
    assert_eq!(finished_leases(&db.pool).await, 0);
    assert_eq!(claim(&db.pool, 5).await.len(), 1, "the job parked first runs, without a sweep");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Review of §72 (helper-69, finding 3): giving finished permits back deletes leases and parked
/// jobs and writes queues, which a role that may only enqueue may not do; it runs as lockgate's
/// installer, as the sweep that would otherwise do it (and, since §83, so does the whole enqueue:
/// the role has the README's producer grants, none on a table).
#[tokio::test]
async fn h28_a_producer_role_that_may_only_enqueue_gives_back_a_finished_permit() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    let d = claim(&db.pool, 1).await.remove(0);
    let mut producer = park_and_hold(&db, 1).await;
    complete_without_waiting(&db, d).await;
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    let role = format!("{}_producer", db.name);
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    sqlx::raw_sql(&format!(
        "CREATE ROLE {role} NOLOGIN;
         GRANT USAGE ON SCHEMA lockgate TO {role};
         GRANT EXECUTE ON FUNCTION lockgate.enqueue(text, jsonb, jsonb, boolean) TO {role};
         SET LOCAL ROLE {role};"
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    let status: String = sqlx::query_scalar("SELECT status FROM lockgate.enqueue('lim', '{\"k\": 1}')")
        .fetch_one(&mut *tx)
        .await
        .expect("the producer role enqueues where a permit finished");
    assert_eq!(status, "parked");
    sqlx::query("RESET ROLE").execute(&mut *tx).await.unwrap();
    let (finished, sent): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM lockgate.leases WHERE finished_at IS NOT NULL),
                (SELECT count(*) FROM pgmq.q_default)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!((finished, sent), (0, 1), "the permit went back, to the job parked first");
    tx.rollback().await.unwrap();
}

#[tokio::test]
async fn g7_a_heartbeat_that_raced_a_shutdown_return_does_not_hide_the_job_again() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    let d = claim(&db.pool, 1).await.remove(0);
    let released: Vec<i64> = sqlx::query_scalar("SELECT lockgate.release('default', $1, $2)")
        .bind(vec![d.0])
        .bind(vec![d.1])
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(released, vec![d.0]);
    // The heartbeat read its deliveries before the return and renews after it.
    let renewed: Vec<i64> = sqlx::query_scalar("SELECT msg_id FROM lockgate.extend('default', $1, $2, 30)")
        .bind(vec![d.0])
        .bind(vec![d.1])
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert!(renewed.is_empty(), "a returned job is not renewed");
    assert_eq!(claim(&db.pool, 1).await.len(), 1, "the returned job is visible at once");
}

/// Issue 14: a prune counts the pruned process's jobs in flight by reading only the messages
/// invisible now (in flight, delayed, waiting to retry), through the claim index priority by
/// priority, however long the visible backlog behind them.
#[tokio::test]
async fn a_prune_reads_the_invisible_messages_only_not_the_backlog() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('plain')").execute(&db.pool).await.unwrap();
    let owner: i64 = sqlx::query_scalar("SELECT lockgate.register_process('supervisor', 'p', 'h', 1)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    for priority in [0, 5, 9] {
        sqlx::query("SELECT * FROM lockgate.enqueue('plain', '{}', jsonb_build_object('priority', $1::int))")
            .bind(priority)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let claimed: Vec<i64> = sqlx::query_scalar("SELECT msg_id FROM lockgate.claim('default', 3, 300, $1)")
        .bind(owner)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 3);
    sqlx::query("SELECT * FROM lockgate.enqueue('plain', '{}', '{\"delay\": 600}')").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue_many('plain', array_fill('{}'::jsonb, ARRAY[2000]))")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE pgmq.q_default").execute(&db.pool).await.unwrap();
    sqlx::query("UPDATE lockgate.processes SET last_heartbeat_at = now() - interval '60 seconds'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    // A delta inside the transaction: the connection's counters may still hold reads of earlier
    // transactions the server has not flushed yet (the claim's, here).
    let before = common::rows_read(&mut tx, "pgmq.q_default").await;
    let pruned: Vec<(i64, i64)> = sqlx::query_as("SELECT pruned_id, in_flight FROM lockgate.prune_processes(30)")
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(pruned, vec![(owner, 3)], "its three claimed jobs are in flight; the delayed one is no one's");
    let read = common::rows_read(&mut tx, "pgmq.q_default").await - before;
    assert!(read <= 4, "the prune read {read} messages of 2,004 (4 invisible)");
}

#[tokio::test]
async fn h26_a_prune_never_returns_a_delivery_before_its_budget_ends() {
    let db = limited(2, 60_000).await;
    enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 1).await;
    let owner: i64 = sqlx::query_scalar("SELECT lockgate.register_process('supervisor', 'p', 'h', 1)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let claimed: Vec<Delivery> =
        sqlx::query_as("SELECT msg_id, read_ct, budget_seconds FROM lockgate.claim('default', 2, 300, $1)")
            .bind(owner)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let (healthy, silent) = (claimed[0], claimed[1]);
    // The process's registry heartbeat stalled for a minute. One of its deliveries kept renewing;
    // the other went silent as long, but its holder (partitioned, say) still has budget left and
    // will stop its handler by its own clock only when that runs out.
    sqlx::query("UPDATE pgmq.q_default SET last_read_at = now() - interval '60 seconds'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE lockgate.processes SET last_heartbeat_at = now() - interval '60 seconds'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("SELECT * FROM lockgate.extend('default', $1, $2, 300, $3)")
        .bind(vec![healthy.0])
        .bind(vec![healthy.1])
        .bind(owner)
        .execute(&db.pool)
        .await
        .unwrap();
    let pruned: Vec<(i64, i64)> = sqlx::query_as("SELECT pruned_id, in_flight FROM lockgate.prune_processes(30)")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(pruned, vec![(owner, 2)], "the process is pruned; both its jobs are still in flight");
    assert!(claim(&db.pool, 10).await.is_empty(), "neither job is handed to another worker");
    let still_owned: Vec<i64> = sqlx::query_scalar("SELECT msg_id FROM lockgate.extend('default', $1, $2, 300)")
        .bind(vec![healthy.0, silent.0])
        .bind(vec![healthy.1, silent.1])
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(still_owned.len(), 2, "both deliveries are still their holder's");
    // Once the silent one's budget has run out, it comes back as any lapsed delivery does.
    sqlx::query("UPDATE pgmq.q_default SET vt = now() - interval '1 second' WHERE msg_id = $1")
        .bind(silent.0)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(claim(&db.pool, 10).await.iter().map(|d| d.0).collect::<Vec<_>>(), vec![silent.0]);
}

#[tokio::test]
async fn h29_no_message_content_makes_a_claim_fail_each_is_dead_lettered_with_its_reason() {
    let db = limited(1, 60_000).await;
    let bad = [
        (r#"{"k":1}"#, r#"{"type":"lim","ckey":"lim","job_id":"abc"}"#, "job_id"),
        (r#"{"k":1}"#, r#"{"type":"lim","ckey":null}"#, "concurrency key"),
        (r#"{"k":1}"#, r#"{"type":"lim","ckey":""}"#, "concurrency key"),
        (r#"{"k":1}"#, r#"[1,2]"#, "headers are not a JSON object"),
        (r#"{"k":1}"#, r#""ckey""#, "headers are not a JSON object"),
        (r#"{"k":1}"#, r#"{"type":7}"#, "job type"),
        (r#"{"k":1}"#, r#"{"type":"lim","returns":"x"}"#, "returns"),
        (r#"[1]"#, r#"{"type":"lim"}"#, "arguments"),
        (r#"null"#, r#"{"type":"lim"}"#, "arguments"),
    ];
    for (body, headers, _) in &bad {
        sqlx::query("SELECT pgmq.send('default', $1::jsonb, $2::jsonb)")
            .bind(body)
            .bind(headers)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    sqlx::query("SELECT pgmq.send('default', NULL::jsonb, NULL::jsonb)").execute(&db.pool).await.unwrap();
    let (good, _, _) = enqueue(&db.pool, 1).await;

    let claimed = claim(&db.pool, 20).await;
    assert_eq!(claimed.iter().map(|d| d.0).collect::<Vec<_>>(), vec![good.unwrap()], "only the job runs");
    let errors: Vec<String> =
        sqlx::query_scalar("SELECT error FROM lockgate.dead_letters WHERE reason = 'undecodable' ORDER BY msg_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(errors.len(), bad.len() + 1, "{errors:?}");
    for ((_, _, what), error) in bad.iter().zip(&errors) {
        assert!(error.contains(what), "{error:?} should name {what:?}");
    }
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// A limit of 1 per key: key 1 held by a running job with a second parked behind it, key 2 held
/// by a running job; the two running deliveries.
async fn two_keys_held() -> (TestDb, Vec<Delivery>) {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 2).await;
    let holders = claim(&db.pool, 10).await;
    assert_eq!(holders.len(), 2);
    (db, holders)
}

/// The SQLSTATE and message of `statement`, which the database must refuse.
async fn refused(db: &PgPool, statement: &str) -> (String, String) {
    let err = sqlx::query(statement).execute(db).await.expect_err(statement);
    let db_err = err.as_database_error().expect("a database error");
    (db_err.code().unwrap_or_default().to_string(), db_err.message().to_string())
}

/// Migration 19 (docs/design.md §61): deleting or truncating a key's row while a lease or a
/// parked job names the key is refused, as the leases' foreign key refused it before migration
/// 18 dropped it; idle-key reclamation and an idle row's deletion go on.
#[tokio::test]
async fn g3_a_key_row_still_counted_cannot_be_deleted_or_truncated() {
    let (db, holders) = two_keys_held().await;
    for statement in [
        "DELETE FROM lockgate.semaphores WHERE key = 'lim:[1]'",
        "DELETE FROM lockgate.semaphores",
        "TRUNCATE lockgate.semaphores",
    ] {
        let (code, message) = refused(&db.pool, statement).await;
        assert_eq!(code, "23001", "{statement}: {message}");
        assert!(message.contains("still counted by leases or waited for by parked jobs"), "{statement}: {message}");
    }
    // Together with what names the keys, the rows go.
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("TRUNCATE lockgate.semaphores, lockgate.leases, lockgate.parked").execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    // Key 2's job finishes: its row, idle, may go, by reclamation or by hand; key 1 still has a
    // job parked behind its running one.
    let key_2: i64 = sqlx::query_scalar("SELECT msg_id FROM lockgate.leases WHERE key = 'lim:[2]'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let (of_2, of_1): (Vec<Delivery>, Vec<Delivery>) = holders.into_iter().partition(|d| d.0 == key_2);
    complete_all(&db.pool, &of_2).await;
    sqlx::query("DELETE FROM lockgate.semaphores WHERE key = 'lim:[2]'").execute(&db.pool).await.unwrap();
    complete_all(&db.pool, &of_1).await;
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
    let (code, _) = refused(&db.pool, "DELETE FROM lockgate.semaphores WHERE key = 'lim:[1]'").await;
    assert_eq!(code, "23001", "the promoted job holds key 1 now");
    let promoted = claim(&db.pool, 10).await;
    complete_all(&db.pool, &promoted).await;
    let reclaimed: i32 =
        sqlx::query_scalar("SELECT lockgate.reclaim_idle_keys('0 seconds')").fetch_one(&db.pool).await.unwrap();
    assert_eq!(reclaimed, 1, "key 1's row, idle now");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Migration 20 (docs/design.md §61): a key is not changed in place, a semaphore row's nor a
/// lease's. Renamed, key 1's row would count a permit no lease gives back, and its lease would
/// give one to whichever row key 1 got next: one permit too many, then a value below zero that
/// fails every sweep pass. Every lockgate path that updates these rows (a claim's permit and
/// renewal, a completion's give-back and promotion, the sweep) goes on: none names the key.
#[tokio::test]
async fn g3_a_key_is_not_renamed_in_a_semaphore_row_nor_moved_in_a_lease() {
    let (db, holders) = two_keys_held().await;
    for (statement, names) in [
        (
            "UPDATE lockgate.semaphores SET key = 'lim:[3]' WHERE key = 'lim:[1]'",
            "a semaphore row's key is not changed",
        ),
        ("UPDATE lockgate.semaphores SET key = key, value = value", "a semaphore row's key is not changed"),
        ("UPDATE lockgate.leases SET key = 'lim:[2]' WHERE key = 'lim:[1]'", "a lease's key is not changed"),
    ] {
        let (code, message) = refused(&db.pool, statement).await;
        assert_eq!(code, "23001", "{statement}: {message}");
        assert!(message.contains(names), "{statement}: {message}");
    }
    // Updates of everything but the key go through, by hand as on lockgate's paths.
    sqlx::query("UPDATE lockgate.semaphores SET updated_at = now() WHERE key = 'lim:[2]'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE lockgate.leases SET expires_at = expires_at + interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    complete_all(&db.pool, &holders).await;
    let promoted = claim(&db.pool, 10).await;
    assert_eq!(promoted.len(), 1, "key 1's parked job");
    complete_all(&db.pool, &promoted).await;
    sweep(&db.pool).await;
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn g3_check_invariants_sees_a_delivery_without_its_lease_a_key_over_its_limit_and_a_lease_without_its_key() {
    // The check every concurrency test ends with must be able to fail.
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 2).await;
    let claimed = claim(&db.pool, 2).await;
    assert_eq!(claimed.len(), 2);
    assert!(violations(&db.pool).await.is_empty());
    // Key 2's job runs on, and its lease is gone (what the old claim allowed).
    sqlx::query("DELETE FROM lockgate.leases WHERE key = 'lim:[2]'").execute(&db.pool).await.unwrap();
    sqlx::query("UPDATE lockgate.semaphores SET value = 0 WHERE key = 'lim:[2]'").execute(&db.pool).await.unwrap();
    let found = violations(&db.pool).await;
    assert!(found.iter().any(|v| v.contains("without a lease")), "{found:?}");
    // Two deliveries of key 1 in flight, each with a lease, on a limit of 1.
    sqlx::query("UPDATE pgmq.q_default SET headers = headers || '{\"ckey\": \"lim:[1]\"}'")
        .execute(&db.pool)
        .await
        .unwrap();
    without_key_guards(&db.pool, "UPDATE lockgate.leases SET key = 'lim:[1]'").await;
    sqlx::query(
        "INSERT INTO lockgate.leases (queue, msg_id, key, duration_ms, expires_at)
         SELECT 'default', msg_id, 'lim:[1]', 60000, vt + interval '1 minute' FROM pgmq.q_default
          WHERE msg_id NOT IN (SELECT msg_id FROM lockgate.leases)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let found = violations(&db.pool).await;
    assert!(found.iter().any(|v| v.contains("2 deliveries in flight holding leases, limit 1")), "{found:?}");
    // A lease whose key has no semaphore row (every path adding a lease holds its key's row).
    without_key_guards(
        &db.pool,
        &format!("UPDATE lockgate.leases SET key = 'lim:[9]' WHERE msg_id = {}", claimed[0].0),
    )
    .await;
    let found = violations(&db.pool).await;
    assert!(found.iter().any(|v| v.contains("lim:[9]") && v.contains("1 leases but no semaphore row")), "{found:?}");
}

/// One worker of the mixed load: loops over claims, renewals, completions, retries, returns,
/// sweeps, prunes and enqueues for `run_for`, counting deadlocks (SQLSTATE 40P01) it is told of.
async fn mixed_load_worker(url: String, seed: u64, run_for: Duration) -> anyhow::Result<(u64, u64)> {
    let mut conn = PgConnection::connect(&url).await?;
    // Never heartbeated: pruned within the run, with its deliveries.
    let owner: i64 = sqlx::query_scalar("SELECT lockgate.register_process('supervisor', 'load', 'h', 1)")
        .fetch_one(&mut conn)
        .await?;
    let mut rng = fastrand::Rng::with_seed(seed);
    let deadline = Instant::now() + run_for;
    let (mut statements, mut deadlocks) = (0, 0);
    let mut held: Vec<(i64, i32)> = Vec::new();
    while Instant::now() < deadline {
        let result = match rng.u8(..10) {
            0..=2 => {
                let keys: Vec<i64> = (0..rng.usize(1..20)).map(|_| rng.i64(0..15)).collect();
                sqlx::query(
                    "SELECT lockgate.enqueue_many('lim', array_agg(jsonb_build_object('k', k))) FROM unnest($1::bigint[]) k",
                )
                .bind(keys)
                .execute(&mut conn)
                .await
                .map(|_| ())
            }
            3 | 4 => match sqlx::query_as::<_, Delivery>(
                "SELECT msg_id, read_ct, budget_seconds FROM lockgate.claim('default', 8, 1, $1)",
            )
            .bind(owner)
            .fetch_all(&mut conn)
            .await
            {
                Ok(claimed) => {
                    held.extend(claimed.iter().map(|d| (d.0, d.1)));
                    Ok(())
                }
                Err(e) => Err(e),
            },
            5 => {
                let (ids, cts): (Vec<i64>, Vec<i32>) = held.iter().copied().unzip();
                sqlx::query("SELECT * FROM lockgate.extend('default', $1, $2, 1)")
                    .bind(ids)
                    .bind(cts)
                    .execute(&mut conn)
                    .await
                    .map(|_| ())
            }
            6 => {
                let n = rng.usize(..=held.len());
                let (ids, cts): (Vec<i64>, Vec<i32>) = held.drain(..n).unzip();
                sqlx::query("SELECT lockgate.complete('default', $1, $2)")
                    .bind(ids)
                    .bind(cts)
                    .execute(&mut conn)
                    .await
                    .map(|_| ())
            }
            7 => match held.pop() {
                Some((id, ct)) if rng.bool() => sqlx::query("SELECT lockgate.retry('default', $1, $2, 0.05, 'x', 1)")
                    .bind(id)
                    .bind(ct)
                    .execute(&mut conn)
                    .await
                    .map(|_| ()),
                Some((id, ct)) => sqlx::query("SELECT lockgate.release('default', $1, $2)")
                    .bind(vec![id])
                    .bind(vec![ct])
                    .execute(&mut conn)
                    .await
                    .map(|_| ()),
                None => Ok(()),
            },
            8 => sqlx::query("SELECT lockgate.sweep()").execute(&mut conn).await.map(|_| ()),
            _ => {
                // Holders go silent under load (visibility and lease lapse together); the sweep,
                // later claims and prunes must sort it out.
                sqlx::query(
                    "WITH x AS (SELECT msg_id FROM pgmq.q_default WHERE vt > now() ORDER BY random() LIMIT 3
                                   FOR UPDATE SKIP LOCKED),
                          m AS (UPDATE pgmq.q_default q SET vt = now() FROM x WHERE q.msg_id = x.msg_id RETURNING q.msg_id)
                     UPDATE lockgate.leases l SET expires_at = now() FROM m WHERE l.queue = 'default' AND l.msg_id = m.msg_id",
                )
                .execute(&mut conn)
                .await
                .map(|_| ())
                .and(sqlx::query("SELECT * FROM lockgate.prune_processes(0.1)").execute(&mut conn).await.map(|_| ()))
            }
        };
        statements += 1;
        if let Err(e) = result {
            match e.as_database_error().and_then(|d| d.code()) {
                Some(code) if code == "40P01" => deadlocks += 1,
                _ => return Err(e.into()),
            }
        }
    }
    Ok((statements, deadlocks))
}

#[tokio::test]
async fn h31_a_mixed_load_of_every_path_shows_no_deadlock() {
    let db = limited(2, 500).await;
    let run_for = Duration::from_secs(8);
    let workers: Vec<_> =
        (0..6).map(|i| tokio::spawn(mixed_load_worker(db.url.clone(), 0x5eed + i, run_for))).collect();
    let (mut statements, mut deadlocks) = (0, 0);
    for w in workers {
        let (s, d) = w.await.unwrap().unwrap();
        statements += s;
        deadlocks += d;
    }
    assert!(statements > 500, "the load ran: {statements} statements");
    // The server's own count, once its statistics are flushed, must agree.
    let server: i64 = wait_for("deadlock statistics", Duration::from_secs(5), || async {
        let n: i64 = sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(&db.pool)
            .await?;
        Ok(Some(n))
    })
    .await
    .unwrap();
    assert_eq!((deadlocks, server), (0, 0), "deadlocks seen by clients and by the server over {statements} statements");
    sweep(&db.pool).await;
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn h32_a_job_parked_again_at_claim_keeps_counting_its_attempts() {
    let db = limited(1, 60_000).await;
    let (m, m_job, _) = enqueue(&db.pool, 1).await;
    assert_eq!(claim(&db.pool, 1).await.len(), 1, "M's first attempt starts (and its worker dies)");
    // M's holder went silent; the sweep frees the permit and a new job Q takes it.
    lapse_leases(&db.pool).await;
    lapse_visibility(&db.pool).await;
    assert_eq!(sweep(&db.pool).await.0, 1);
    let (q, _, status) = enqueue(&db.pool, 1).await;
    assert_eq!(status, "enqueued");
    // M's next delivery finds the key full and parks: it never ran, and its first run counts.
    let claimed = claim(&db.pool, 10).await;
    assert_eq!(claimed.iter().map(|d| d.0).collect::<Vec<_>>(), vec![q.unwrap()]);
    let q = claimed[0];
    sqlx::query("SELECT lockgate.complete('default', $1, $2)")
        .bind(vec![q.0])
        .bind(vec![q.1])
        .execute(&db.pool)
        .await
        .unwrap();
    let promoted: (i64, i32, serde_json::Value) =
        sqlx::query_as("SELECT msg_id, read_ct, headers FROM lockgate.claim('default', 1, 30)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_ne!(Some(promoted.0), m, "promoted as a new message");
    let headers = lockgate::JobHeaders::decode(Some(&promoted.2), promoted.0).unwrap();
    assert_eq!(headers.job_id.0, m_job);
    let claim = lockgate::Claim {
        queue: lockgate::QueueName::new("default").unwrap(),
        msg_id: promoted.0,
        read_ct: promoted.1,
        enqueued_at: chrono::Utc::now(),
        message: None,
        headers: Some(promoted.2.clone()),
        budget: Duration::from_secs(30),
        claimed_ahead: false,
        unreadable: None,
    };
    assert_eq!(claim.attempt(&headers), 2, "the run before parking counts: {}", promoted.2);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Claims with `start_now` (None: every delivery starts at once) and returns each delivery's
/// (msg_id, read_ct, attempt as the worker counts it, claimed ahead).
async fn claim_attempts(db: &PgPool, qty: i32, start_now: Option<i32>) -> Vec<(i64, i32, u32, bool)> {
    let queue = lockgate::QueueName::new("default").unwrap();
    let claims = lockgate::sql::claim_as(db, &queue, qty, Duration::from_secs(30), None, start_now).await.unwrap();
    let mut claimed: Vec<_> = claims
        .into_iter()
        .map(|c| {
            let headers = lockgate::JobHeaders::decode(c.headers.as_ref(), c.msg_id).unwrap();
            (c.msg_id, c.read_ct, c.attempt(&headers), c.claimed_ahead)
        })
        .collect();
    claimed.sort();
    claimed
}

#[tokio::test]
async fn h32_a_delivery_claimed_ahead_counts_as_an_attempt_only_once_its_start_is_recorded() {
    let db = limited(1, 60_000).await;
    for k in 1..=3 {
        enqueue(&db.pool, k).await;
    }
    // One handler slot is free: the first starts at once, the other two are claimed ahead.
    let first = claim_attempts(&db.pool, 3, Some(1)).await;
    assert_eq!(first.iter().map(|d| d.3).collect::<Vec<_>>(), vec![false, true, true], "{first:?}");
    assert!(first.iter().all(|d| d.2 == 1));
    // The second starts (its start rides on a completion statement); then the worker is killed.
    let default = lockgate::QueueName::new("default").unwrap();
    let started = lockgate::sql::complete(&db.pool, &default, &[], &[(first[1].0, first[1].1)]).await.unwrap();
    assert!(started.is_empty(), "recording a start archives nothing");
    lapse_visibility(&db.pool).await;
    let next = claim_attempts(&db.pool, 3, None).await;
    let attempts: Vec<(i64, u32)> = next.iter().map(|d| (d.0, d.2)).collect();
    assert_eq!(
        attempts,
        vec![(first[0].0, 2), (first[1].0, 2), (first[2].0, 1)],
        "the two runs that started count; the one that never started does not"
    );
    // All three claimed ahead; the third is returned by a shutdown, the other two are lost to a
    // crash before they start: each of these deliveries is one return, none an attempt.
    lapse_visibility(&db.pool).await;
    let ahead = claim_attempts(&db.pool, 3, Some(0)).await;
    assert!(ahead.iter().all(|d| d.3));
    assert_eq!(lockgate::sql::release(&db.pool, &default, &[(ahead[2].0, ahead[2].1)], None).await.unwrap().len(), 1);
    lapse_visibility(&db.pool).await;
    let again: Vec<u32> = claim_attempts(&db.pool, 3, None).await.iter().map(|d| d.2).collect();
    assert_eq!(again, vec![3, 3, 2]);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn h32_a_job_whose_worker_keeps_dying_before_its_start_is_recorded_still_runs_out_of_attempts() {
    let db = limited(1, 60_000).await;
    let (m, _, _) = enqueue(&db.pool, 1).await;
    // Claimed ahead five times, and each time its worker died before the start was recorded:
    // the first three count as returns, the next two as attempts (the run may have started and
    // killed the process within a round trip).
    for _ in 0..5 {
        assert!(claim_attempts(&db.pool, 1, Some(0)).await[0].3);
        lapse_visibility(&db.pool).await;
    }
    let last = claim_attempts(&db.pool, 1, None).await;
    assert_eq!((Some(last[0].0), last[0].1, last[0].2), (m, 6, 3));
}

#[tokio::test]
async fn h24_no_step_moves_a_lease_end_earlier_so_a_claim_may_trust_the_end_it_read() {
    // A claim reads a lease's end from its statement's snapshot; a release or retry of the last
    // delivery may commit after that snapshot. That is safe only if no step ever moves an end
    // earlier: each renewal keeps the later of the old end and the new one.
    let db = limited(1, 20_000).await;
    enqueue(&db.pool, 1).await;
    let default = lockgate::QueueName::new("default").unwrap();
    let far = "UPDATE lockgate.leases SET expires_at = now() + interval '1 hour'";
    let end = "SELECT expires_at > now() + interval '50 minutes' FROM lockgate.leases";
    let d = claim(&db.pool, 1).await.remove(0);
    sqlx::query(far).execute(&db.pool).await.unwrap();
    sqlx::query("SELECT * FROM lockgate.extend('default', $1, $2, 30)")
        .bind(vec![d.0])
        .bind(vec![d.1])
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(sqlx::query_scalar::<_, bool>(end).fetch_one(&db.pool).await.unwrap(), "renewal kept the later end");
    sqlx::query("SELECT lockgate.retry('default', $1, $2, 0, 'boom', 1)")
        .bind(d.0)
        .bind(d.1)
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(sqlx::query_scalar::<_, bool>(end).fetch_one(&db.pool).await.unwrap(), "retry kept the later end");
    let d = claim(&db.pool, 1).await.remove(0);
    assert_eq!(lockgate::sql::release(&db.pool, &default, &[(d.0, d.1)], None).await.unwrap().len(), 1);
    assert!(sqlx::query_scalar::<_, bool>(end).fetch_one(&db.pool).await.unwrap(), "release kept the later end");
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() + interval '1 second'").execute(&db.pool).await.unwrap();
    let d = claim(&db.pool, 1).await.remove(0);
    assert!(d.2 <= 20.5, "a lease ending sooner than the visibility is renewed and caps the budget: {}", d.2);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn h31_start_records_and_a_shutdown_return_lock_their_rows_in_one_order() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('plain')").execute(&db.pool).await.unwrap();
    // Enough rows that each statement finds its own rows through the index, in the order given.
    sqlx::query(
        "SELECT count(*) FROM lockgate.enqueue_many('plain', ARRAY(SELECT '{}'::jsonb FROM generate_series(1, 5000)))",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE pgmq.q_default").execute(&db.pool).await.unwrap();
    let default = lockgate::QueueName::new("default").unwrap();
    let both = lockgate::sql::claim_as(&db.pool, &default, 2, Duration::from_secs(30), None, Some(0)).await.unwrap();
    let (x, y) = ((both[0].msg_id, both[0].read_ct), (both[1].msg_id, both[1].read_ct));
    // Another statement holds X: the start records of X and Y, and a release of Y and X, queue
    // behind it. Locking in different orders, they would deadlock once it lets go.
    let mut holder = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT 1 FROM pgmq.q_default WHERE msg_id = $1 FOR UPDATE")
        .bind(x.0)
        .execute(&mut holder)
        .await
        .unwrap();
    let waiting =
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let records = tokio::spawn({
        let (pool, q) = (db.pool.clone(), default.clone());
        async move { lockgate::sql::complete(&pool, &q, &[], &[x, y]).await }
    });
    lockgate_testkit::wait_for_count(&db.pool, waiting, 1, Duration::from_secs(10)).await.unwrap();
    let release = tokio::spawn({
        let (pool, q) = (db.pool.clone(), default.clone());
        async move { lockgate::sql::release(&pool, &q, &[y, x], None).await }
    });
    lockgate_testkit::wait_for_count(&db.pool, waiting, 2, Duration::from_secs(10)).await.unwrap();
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    records.await.unwrap().expect("start records land");
    assert_eq!(release.await.unwrap().expect("the release lands, no deadlock").len(), 2);
}

async fn define(db: &PgPool, limit: Option<i32>, key: &[&str]) {
    sqlx::query("SELECT lockgate.define_job_type('lim', concurrency_limit => $1, concurrency_key => $2)")
        .bind(limit)
        .bind(key.iter().map(|k| k.to_string()).collect::<Vec<_>>())
        .execute(db)
        .await
        .unwrap();
}

async fn enqueue_args(db: &PgPool, args: serde_json::Value) -> String {
    sqlx::query_scalar("SELECT status FROM lockgate.enqueue('lim', $1)").bind(args).fetch_one(db).await.unwrap()
}

async fn complete_all(db: &PgPool, deliveries: &[Delivery]) {
    let (ids, cts): (Vec<i64>, Vec<i32>) = deliveries.iter().map(|d| (d.0, d.1)).unzip();
    sqlx::query("SELECT lockgate.complete('default', $1, $2)").bind(ids).bind(cts).execute(db).await.unwrap();
}

#[tokio::test]
async fn h33_a_limit_added_to_a_type_applies_to_the_jobs_already_queued() {
    let db = TestDb::migrated().await.unwrap();
    define(&db.pool, None, &[]).await;
    for b in 0..3 {
        assert_eq!(enqueue_args(&db.pool, serde_json::json!({"k": 1, "b": b})).await, "enqueued");
    }
    define(&db.pool, Some(1), &["k"]).await;
    let first = claim(&db.pool, 10).await;
    assert_eq!(first.len(), 1, "queued before the limit, they still take its permits: {first:?}");
    assert_eq!(entitled(&db.pool).await, 1);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
    complete_all(&db.pool, &first).await;
    let second = claim(&db.pool, 10).await;
    assert_eq!(second.len(), 1, "the next one was parked and is promoted by the completion");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn h33_changed_key_paths_give_queued_and_parked_jobs_their_new_keys_without_over_admitting() {
    let db = TestDb::migrated().await.unwrap();
    define(&db.pool, Some(1), &["k"]).await;
    assert_eq!(enqueue_args(&db.pool, serde_json::json!({"k": 1, "b": 1})).await, "enqueued");
    assert_eq!(enqueue_args(&db.pool, serde_json::json!({"k": 1, "b": 2})).await, "parked");
    define(&db.pool, Some(1), &["k", "b"]).await;
    assert_eq!(enqueue_args(&db.pool, serde_json::json!({"k": 1, "b": 1})).await, "enqueued");
    // The queued job of the old key takes a permit of its new key ("lim:[1, 1]"), which the job
    // enqueued since holds: it parks, giving the old key's permit back; that promotes the job
    // parked under the old key, whose claim moves it to its own new key.
    let mut ran = 0;
    for _ in 0..10 {
        let claimed = claim(&db.pool, 10).await;
        assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
        let per_key: Vec<(String, i64)> = sqlx::query_as(
            // Grouped by the key the current policy derives, whatever key a message carries.
            "SELECT message::text, count(*) FROM pgmq.q_default WHERE read_ct > 0 AND vt > now()
              AND NOT headers ? 'retry_at' GROUP BY 1 HAVING count(*) > 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert!(per_key.is_empty(), "a key ran twice: {per_key:?}");
        ran += claimed.len();
        complete_all(&db.pool, &claimed).await;
        sweep(&db.pool).await;
        lapse_visibility(&db.pool).await;
    }
    assert_eq!(ran, 3, "every job ran once");
    let left: i64 = db.count("SELECT 1 FROM pgmq.q_default UNION ALL SELECT 1 FROM lockgate.parked").await.unwrap();
    assert_eq!(left, 0);
    let held: i64 = sqlx::query_scalar("SELECT COALESCE(sum(value), 0) FROM lockgate.semaphores")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(held, 0, "every permit given back");
}

#[tokio::test]
async fn h33_a_lowered_limit_admits_no_new_job_until_the_running_ones_are_below_it() {
    let db = limited(3, 60_000).await;
    for _ in 0..3 {
        enqueue(&db.pool, 1).await;
    }
    let running = claim(&db.pool, 10).await;
    assert_eq!(running.len(), 3);
    define(&db.pool, Some(1), &["k"]).await;
    assert_eq!(enqueue(&db.pool, 1).await.2, "parked", "three hold the key; the limit is now one");
    complete_all(&db.pool, &running[..2]).await;
    assert!(claim(&db.pool, 10).await.is_empty(), "one still runs: nothing is promoted");
    complete_all(&db.pool, &running[2..]).await;
    assert_eq!(claim(&db.pool, 10).await.len(), 1, "promoted once the key is free");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// Jobs that took their permits under the old limit and have not started (queued, delayed,
/// waiting out a backoff, or delivered again after their worker died) start under the new one:
/// a review (helper-79) ran three queued holders of a key lowered to 1 at once.
#[tokio::test]
async fn h33_a_lowered_limit_holds_back_queued_jobs_that_took_their_permits_under_the_old_one() {
    let db = limited(3, 60_000).await;
    for _ in 0..3 {
        assert_eq!(enqueue(&db.pool, 1).await.2, "enqueued");
    }
    assert_eq!(enqueue(&db.pool, 1).await.2, "parked");
    define(&db.pool, Some(1), &["k"]).await;
    let ran = drain_one_at_a_time(&db.pool, 6).await;
    assert_eq!(ran, 4, "every job ran once, one at a time");
    let left = db.count("SELECT 1 FROM pgmq.q_default UNION ALL SELECT 1 FROM lockgate.parked").await.unwrap();
    assert_eq!(left, 0);
}

/// Claims, completes and sweeps for `rounds` rounds, checking that no claim delivers more than
/// one job (a limit of 1) and that the invariants hold; returns how many jobs ran.
async fn drain_one_at_a_time(db: &PgPool, rounds: usize) -> usize {
    let mut ran = 0;
    for round in 0..rounds {
        let claimed = claim(db, 10).await;
        assert!(claimed.len() <= 1, "round {round}: {} ran at once under a limit of 1", claimed.len());
        assert!(violations(db).await.is_empty(), "{:?}", violations(db).await);
        ran += claimed.len();
        complete_all(db, &claimed).await;
        sweep(db).await;
        lapse_visibility(db).await;
    }
    ran
}

/// The same with a key given explicitly at enqueue, which no change of key paths moves: its
/// queued holders are admitted again under the lowered limit too.
#[tokio::test]
async fn h33_a_lowered_limit_holds_back_queued_jobs_of_an_explicit_key() {
    let db = limited(3, 60_000).await;
    let enqueue_explicit = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT status FROM lockgate.enqueue('lim', '{\"k\": 1}', '{\"concurrency_key\": \"tenant-9\"}')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    for _ in 0..3 {
        assert_eq!(enqueue_explicit().await, "enqueued");
    }
    define(&db.pool, Some(1), &["k"]).await;
    let ran = drain_one_at_a_time(&db.pool, 6).await;
    assert_eq!(ran, 3, "every job ran once, one at a time");
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT headers->>'ckey' FROM pgmq.a_default").fetch_all(&db.pool).await.unwrap();
    assert_eq!(keys, ["tenant-9"], "the explicit key stayed the jobs' key");
}

#[tokio::test]
async fn h28_a_claim_never_waits_for_a_producer_creating_the_key_it_needs() {
    // A job queued before its type gained a limit needs a permit of a key no row exists for yet;
    // an open producer transaction is inserting that very row.
    let db = TestDb::migrated().await.unwrap();
    define(&db.pool, None, &[]).await;
    enqueue_args(&db.pool, serde_json::json!({"k": 1})).await;
    define(&db.pool, Some(1), &["k"]).await;
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut producer).await.unwrap();
    assert_eq!(enqueue_args_on(&mut producer, serde_json::json!({"k": 1})).await, "enqueued");
    let during = tokio::time::timeout(Duration::from_secs(3), claim(&db.pool, 10)).await.expect("the claim waited");
    assert!(during.is_empty(), "the job is put back, not run: {during:?}");
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    // The producer's job took the permit; the old job, visible again, parks behind it.
    lapse_visibility(&db.pool).await;
    let after = claim(&db.pool, 10).await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert!(after[0].2 <= 30.5, "the budget never exceeds the visibility: {}", after[0].2);
    assert_eq!(db.count("SELECT 1 FROM lockgate.parked").await.unwrap(), 1);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

async fn enqueue_args_on(conn: &mut PgConnection, args: serde_json::Value) -> String {
    sqlx::query_scalar("SELECT status FROM lockgate.enqueue('lim', $1)").bind(args).fetch_one(conn).await.unwrap()
}

#[tokio::test]
async fn h29_a_key_too_long_for_the_index_is_refused_at_enqueue_and_dead_lettered_at_claim() {
    let db = limited(1, 60_000).await;
    let long = "x".repeat(6000);
    let refused = sqlx::query("SELECT * FROM lockgate.enqueue('lim', jsonb_build_object('k', $1::text))")
        .bind(&long)
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("more than the 512 allowed"), "{refused}");
    // In a call of many, the error names the job whose key is too long, and nothing is enqueued.
    let refused = sqlx::query(
        "SELECT * FROM lockgate.enqueue_many('lim', ARRAY['{\"k\": 1}'::jsonb, jsonb_build_object('k', $1::text)])",
    )
    .bind(&long)
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert!(refused.to_string().contains("derived from job arguments #2 is"), "{refused}");
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 0);
    // Sent behind lockgate's back, with an explicit key and with a key its type derives.
    sqlx::query(
        "SELECT pgmq.send('default', '{}'::jsonb, jsonb_build_object('type', 'lim', 'ckey', $1::text, 'ckey_explicit', true))",
    )
    .bind(&long)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("SELECT pgmq.send('default', jsonb_build_object('k', $1::text), '{\"type\": \"lim\"}'::jsonb)")
        .bind(&long)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("SELECT pgmq.send('default', '{}'::jsonb, '{\"type\": \"lim\", \"priority\": 10}'::jsonb)")
        .execute(&db.pool)
        .await
        .unwrap();
    let (good, _, _) = enqueue(&db.pool, 1).await;
    let claimed = claim(&db.pool, 10).await;
    assert_eq!(claimed.iter().map(|d| d.0).collect::<Vec<_>>(), vec![good.unwrap()], "the queue is not stalled");
    // A priority outside 0-9 is looked for once nothing else is there to claim.
    assert!(claim(&db.pool, 10).await.is_empty());
    let errors: Vec<String> = sqlx::query_scalar("SELECT error FROM lockgate.dead_letters ORDER BY msg_id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(errors[0].contains("1 to 512 characters"), "{}", errors[0]);
    assert!(errors[1].contains("more than the 512 allowed"), "{}", errors[1]);
    assert!(errors[2].contains("priority 10"), "{}", errors[2]);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn g3_a_lease_whose_message_was_removed_behind_lockgates_back_is_freed_only_when_it_expires() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 1).await;
    let holder = claim(&db.pool, 1).await.remove(0);
    // Archived by plain PGMQ while its holder may still be running.
    sqlx::query("SELECT pgmq.archive('default', $1)").bind(holder.0).execute(&db.pool).await.unwrap();
    assert_eq!(sweep(&db.pool).await, (0, 0, 0), "the holder's budget is not over: nothing is freed");
    assert!(claim(&db.pool, 10).await.is_empty());
    lapse_leases(&db.pool).await;
    assert_eq!(sweep(&db.pool).await, (0, 1, 1), "freed once expired, and the parked job promoted");
    assert_eq!(claim(&db.pool, 10).await.len(), 1);
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// H28: a sweep never waits for a key's row or a lease another transaction holds (an open
/// producer transaction on the key, a heartbeat renewing the lease): it leaves them and frees
/// them at its next pass.
#[tokio::test]
async fn h28_a_sweep_passes_over_a_held_key_row_and_a_held_lease_and_frees_them_at_its_next_pass() {
    let db = limited(1, 60_000).await;
    for k in [1, 1, 2, 2] {
        enqueue(&db.pool, k).await;
    }
    assert_eq!(claim(&db.pool, 10).await.len(), 2, "one holder per key, one job parked behind each");
    lapse_leases(&db.pool).await;
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    let mut on_key = producer.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM lockgate.semaphores WHERE key = 'lim:[1]' FOR UPDATE")
        .execute(&mut *on_key)
        .await
        .unwrap();
    let mut renewer = PgConnection::connect(&db.url).await.unwrap();
    let mut on_lease = renewer.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM lockgate.leases WHERE key = 'lim:[2]' FOR UPDATE")
        .execute(&mut *on_lease)
        .await
        .unwrap();
    let passed = tokio::time::timeout(Duration::from_secs(10), sweep(&db.pool)).await;
    assert_eq!(passed.expect("the sweep waited for a lock"), (0, 0, 0), "both left for the next pass");
    on_key.rollback().await.unwrap();
    on_lease.rollback().await.unwrap();
    assert_eq!(sweep(&db.pool).await, (2, 0, 2), "both freed, and the jobs behind them promoted");
    // The dead holders' deliveries come back; each parks behind the job promoted in its place.
    lapse_visibility(&db.pool).await;
    assert_eq!(claim(&db.pool, 10).await.len(), 2, "the promoted jobs, and no holder beside them");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// An expired lease whose key has no semaphore row (docs/design.md §61) is deleted by the sweep,
/// with no permit given back, and the job's next delivery takes a permit of a row of its own.
/// The sweep found expired leases through their keys' rows, so it never saw this one.
#[tokio::test]
async fn g5_an_expired_lease_whose_key_has_no_row_is_swept_and_its_job_runs_again() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    let first = claim(&db.pool, 1).await.remove(0);
    without_key_guards(&db.pool, "DELETE FROM lockgate.semaphores WHERE key = 'lim:[1]'").await;
    assert_eq!(sweep(&db.pool).await, (0, 0, 0), "the holder's budget is not over: nothing is freed");
    lapse_leases(&db.pool).await;
    assert_eq!(sweep(&db.pool).await, (1, 0, 0), "the lease is freed once expired");
    assert_eq!(db.count("SELECT 1 FROM lockgate.leases").await.unwrap(), 0);
    lapse_visibility(&db.pool).await;
    let again = claim(&db.pool, 1).await;
    assert_eq!(again.iter().map(|d| d.0).collect::<Vec<_>>(), vec![first.0], "the job runs again");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// A lease whose key has no semaphore row (only a bug, or a hand edit past migration 19's
/// guards, makes one; docs/design.md §61), expired, met by a
/// claim of its delivery before any sweep: the claim deletes it and takes a permit of its key's
/// new row, where it put the delivery back at every claim, because it could not lock a row that
/// does not exist.
#[tokio::test]
async fn h24_a_claim_drops_an_expired_lease_whose_key_has_no_row_and_takes_a_permit_of_its_own() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    let first = claim(&db.pool, 1).await.remove(0);
    without_key_guards(&db.pool, "DELETE FROM lockgate.semaphores WHERE key = 'lim:[1]'").await;
    lapse_leases(&db.pool).await;
    lapse_visibility(&db.pool).await;
    let again = claim(&db.pool, 1).await;
    assert_eq!(again.iter().map(|d| d.0).collect::<Vec<_>>(), vec![first.0], "the job runs again");
    let held: Vec<(String, i32)> =
        sqlx::query_as("SELECT key, value FROM lockgate.semaphores").fetch_all(&db.pool).await.unwrap();
    assert_eq!(held, vec![("lim:[1]".to_string(), 1)], "one permit, of a new row");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

#[tokio::test]
async fn g5_a_queue_dropped_behind_lockgates_back_stops_no_sweep_and_is_reported() {
    let db = limited(1, 60_000).await;
    sqlx::query("SELECT lockgate.define_job_type('other', queue => 'other', concurrency_limit => 1)")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('other', '{}')").execute(&db.pool).await.unwrap();
    enqueue(&db.pool, 1).await;
    enqueue(&db.pool, 1).await;
    let holder = claim(&db.pool, 1).await.remove(0);
    sqlx::query("SELECT pgmq.drop_queue('other')").execute(&db.pool).await.unwrap();
    complete_all(&db.pool, &[holder]).await;
    lapse_leases(&db.pool).await;
    sweep(&db.pool).await;
    assert_eq!(claim(&db.pool, 10).await.len(), 1, "the default queue carries on");
    let found = violations(&db.pool).await;
    assert!(found.iter().any(|v| v.contains("queue other has no PGMQ table")), "{found:?}");
    sqlx::query("SELECT * FROM lockgate.prune_processes(1)").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT * FROM lockgate.queue_stats()").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.metrics_snapshot(50)").execute(&db.pool).await.unwrap();
}

#[tokio::test]
async fn a_claim_or_renewal_with_a_visibility_that_is_not_positive_is_refused() {
    let db = limited(1, 60_000).await;
    enqueue(&db.pool, 1).await;
    for vt in ["0", "-5", "'NaN'", "'infinity'", "NULL"] {
        let err = sqlx::query(&format!("SELECT * FROM lockgate.claim('default', 1, {vt})")).execute(&db.pool).await;
        assert!(err.unwrap_err().to_string().contains("invalid visibility timeout"), "claim with {vt}");
        let err = sqlx::query(&format!("SELECT * FROM lockgate.extend('default', '{{1}}', '{{1}}', {vt})"))
            .execute(&db.pool)
            .await;
        assert!(err.unwrap_err().to_string().contains("invalid visibility timeout"), "extend with {vt}");
    }
    let untouched: i32 = sqlx::query_scalar("SELECT read_ct FROM pgmq.q_default").fetch_one(&db.pool).await.unwrap();
    assert_eq!(untouched, 0);
}
