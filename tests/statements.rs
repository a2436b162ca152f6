//! `sql` jobs' statements fenced on the server (design §100): a statement runs in a database
//! backend, which a frozen or cut-off `lockgate run` cannot stop, so the backend carries its job's
//! mark (`lockgate.start_statement`) and whatever takes the job from a silent holder ends it
//! first: the sweep that expires the job's lease, the claim that delivers the job again. Each test
//! marks a connection of its own as the `sql` executor marks its statement's, runs a long
//! statement on it, and takes the job away through the public SQL API.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{lapse_visibility, violations};
use lockgate_testkit::TestDb;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::task::JoinHandle;

/// How long a statement runs unless it is ended: far longer than any test.
const LONG: &str = "SELECT pg_sleep(60)";

async fn define(db: &TestDb, limit: Option<i32>) {
    sqlx::query(
        "SELECT lockgate.define_job_type('job', concurrency_limit => $1,
                                         concurrency_key => CASE WHEN $1 IS NULL THEN NULL ELSE array['k'] END,
                                         concurrency_duration_ms => 60000)",
    )
    .bind(limit)
    .execute(&db.pool)
    .await
    .unwrap();
}

async fn enqueue(db: &PgPool) -> String {
    sqlx::query_scalar("SELECT status FROM lockgate.enqueue('job', '{\"k\": 1}')").fetch_one(db).await.unwrap()
}

/// The deliveries a claim returns, as (msg_id, read_ct).
async fn claim(db: impl sqlx::PgExecutor<'_>) -> Vec<(i64, i32)> {
    sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30)").fetch_all(db).await.unwrap()
}

/// A connection of its own, marked as running delivery (msg_id, read_ct)'s statement; its
/// backend's pid, or `None` when the delivery may not start one.
async fn start(db: &TestDb, msg_id: i64, read_ct: i32) -> (PgConnection, Option<i32>) {
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let pid = sqlx::query_scalar("SELECT lockgate.start_statement('default', $1, $2)")
        .bind(msg_id)
        .bind(read_ct)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    (conn, pid)
}

/// Runs the long statement on `conn` until it ends; the statement's result.
fn run_long(mut conn: PgConnection) -> JoinHandle<Result<(), sqlx::Error>> {
    tokio::spawn(async move { sqlx::query(LONG).execute(&mut conn).await.map(drop) })
}

/// The long statement of delivery (msg_id, read_ct), running on a marked connection of its own:
/// its backend's pid, and its result once it ends.
async fn running_statement(db: &TestDb, msg_id: i64, read_ct: i32) -> (i32, JoinHandle<Result<(), sqlx::Error>>) {
    let (conn, pid) = start(db, msg_id, read_ct).await;
    let pid = pid.expect("a delivery that holds its job starts its statement");
    let statement = run_long(conn);
    wait_running(&db.pool, pid).await;
    (pid, statement)
}

/// A connection of role `<database>_<name>`, which has the test role's rights but is no superuser:
/// it may not end the test role's (a superuser's) backends.
async fn not_superuser(db: &TestDb, name: &str) -> PgConnection {
    let owner: String = sqlx::query_scalar("SELECT current_user::text").fetch_one(&db.pool).await.unwrap();
    let role = format!("{}_{name}", db.name);
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql(&format!("CREATE ROLE {role}; GRANT \"{owner}\" TO {role}; SET ROLE {role}"))
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

/// Whether backend `pid` is running a statement now.
async fn running(db: &PgPool, pid: i32) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'active')")
        .bind(pid)
        .fetch_one(db)
        .await
        .unwrap()
}

async fn wait_running(db: &PgPool, pid: i32) {
    lockgate_testkit::wait_for("the marked statement to run", Duration::from_secs(10), || async {
        Ok(running(db, pid).await.then_some(()))
    })
    .await
    .unwrap();
}

/// A sweep as if two minutes had passed: every lease lapsed.
async fn sweep_later(db: impl sqlx::PgExecutor<'_>) -> (i32, i32, i32) {
    sqlx::query_as("SELECT expired, orphaned, promoted FROM lockgate.sweep(1000, now() + interval '2 minutes')")
        .fetch_one(db)
        .await
        .unwrap()
}

/// The sweep that expires a silent holder's lease ends its statement, and has waited for the
/// backend to exit, before the key's next job is promoted into the permit.
#[tokio::test]
async fn a_sweep_ends_the_statement_of_a_lapsed_lease_before_its_permit_passes_on() {
    let db = TestDb::migrated().await.unwrap();
    define(&db, Some(1)).await;
    assert_eq!(enqueue(&db.pool).await, "enqueued");
    assert_eq!(enqueue(&db.pool).await, "parked");
    let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
    let (pid, statement) = running_statement(&db, m, rc).await;

    lapse_visibility(&db.pool).await;
    assert_eq!(sweep_later(&db.pool).await, (1, 0, 1), "the lease expired and the parked job promoted");
    assert!(!running(&db.pool, pid).await, "the lapsed holder's statement ran on beside the promoted job");
    assert!(statement.await.unwrap().is_err(), "the statement was ended, not left to finish");
    assert!(violations(&db.pool).await.is_empty(), "{:?}", violations(&db.pool).await);
}

/// A claim that delivers a job again ends the earlier delivery's statement before it returns the
/// job; the earlier delivery can then start none.
#[tokio::test]
async fn a_claim_that_delivers_a_job_again_ends_its_earlier_statement() {
    for limit in [None, Some(1)] {
        let db = TestDb::migrated().await.unwrap();
        define(&db, limit).await;
        assert_eq!(enqueue(&db.pool).await, "enqueued");
        let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
        let (pid, statement) = running_statement(&db, m, rc).await;

        lapse_visibility(&db.pool).await;
        assert_eq!(claim(&db.pool).await, vec![(m, rc + 1)], "the job is delivered again ({limit:?})");
        assert!(!running(&db.pool, pid).await, "the earlier statement ran beside the new delivery ({limit:?})");
        assert!(statement.await.unwrap().is_err());
        assert_eq!(start(&db, m, rc).await.1, None, "the earlier delivery started another statement");
        assert!(start(&db, m, rc + 1).await.1.is_some(), "the new delivery may start its statement");
    }
}

/// What `start_statement` refuses: a delivery that no longer holds its job (delivered again,
/// past its visibility, waiting out a retry, gone), leaving the session's name as it was; and a
/// mark made for the transaction only ends with it.
#[tokio::test]
async fn a_delivery_that_no_longer_holds_its_job_starts_no_statement() {
    let db = TestDb::migrated().await.unwrap();
    define(&db, None).await;
    enqueue(&db.pool).await;
    let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let name = "SELECT current_setting('application_name')";
    let before: String = sqlx::query_scalar(name).fetch_one(&mut conn).await.unwrap();
    let refused = |read_ct: i32| {
        sqlx::query_scalar::<_, Option<i32>>("SELECT lockgate.start_statement('default', $1, $2)").bind(m).bind(read_ct)
    };
    assert_eq!(refused(rc + 1).fetch_one(&mut conn).await.unwrap(), None, "another read_ct");
    assert_eq!(refused(rc - 1).fetch_one(&mut conn).await.unwrap(), None, "another read_ct");
    sqlx::query("UPDATE pgmq.q_default SET headers = headers || '{\"retry_at\": \"x\"}'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(refused(rc).fetch_one(&mut conn).await.unwrap(), None, "a delivery waiting out a retry");
    sqlx::query("UPDATE pgmq.q_default SET headers = headers - 'retry_at'").execute(&db.pool).await.unwrap();
    lapse_visibility(&db.pool).await;
    assert_eq!(refused(rc).fetch_one(&mut conn).await.unwrap(), None, "a delivery past its visibility");
    assert_eq!(sqlx::query_scalar::<_, String>(name).fetch_one(&mut conn).await.unwrap(), before);

    let [(m, rc)] = claim(&db.pool).await[..] else { panic!("delivered again") };
    let mut tx = conn.begin().await.unwrap();
    let pid: Option<i32> = sqlx::query_scalar("SELECT lockgate.start_statement('default', $1, $2, true)")
        .bind(m)
        .bind(rc)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert!(pid.is_some());
    let marked: String = sqlx::query_scalar(name).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(marked, format!("lockgate job {m} default"));
    tx.commit().await.unwrap();
    assert_eq!(sqlx::query_scalar::<_, String>(name).fetch_one(&mut conn).await.unwrap(), before);

    sqlx::query("SELECT pgmq.archive('default', $1)").bind(m).execute(&db.pool).await.unwrap();
    assert_eq!(refused(rc).fetch_one(&mut conn).await.unwrap(), None, "a job gone from its queue");
}

/// A statement lockgate may not end (here a superuser's, seen from a role that is not one) keeps
/// its job: the sweep keeps the lease and its permit, the claim puts the job back; both hand it
/// on once the statement has ended and its mark is gone.
#[tokio::test]
async fn a_statement_that_cannot_be_ended_keeps_its_lease_and_its_job() {
    let db = TestDb::migrated().await.unwrap();
    define(&db, Some(1)).await;
    assert_eq!(enqueue(&db.pool).await, "enqueued");
    assert_eq!(enqueue(&db.pool).await, "parked");
    let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
    let (pid, statement) = running_statement(&db, m, rc).await;

    let mut sweeper = not_superuser(&db, "sweeper").await;
    assert_eq!(sweep_later(&mut sweeper).await, (0, 0, 0), "the lease was expired under a running statement");
    assert_eq!(db.count("SELECT 1 FROM lockgate.parked").await.unwrap(), 1, "the parked job was promoted");
    lapse_visibility(&db.pool).await;
    assert!(claim(&mut sweeper).await.is_empty(), "the job was delivered again beside its statement");
    assert!(running(&db.pool, pid).await);

    // The operator is told which backend keeps the permit.
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 minute'").execute(&db.pool).await.unwrap();
    let (verdict, detail) = held_statements(&db.pool, 60.0).await;
    assert_eq!(verdict, "warn", "{detail}");
    assert!(detail.contains(&format!("backend {pid} of role")), "{detail}");

    // The statement ends, and its session with it: then both go on.
    sqlx::query("SELECT pg_terminate_backend($1, 5000)").bind(pid).execute(&db.pool).await.unwrap();
    assert!(statement.await.unwrap().is_err());
    assert_eq!(sweep_later(&mut sweeper).await.0, 1, "the lease expired once the statement had ended");
    assert_eq!(db.count("SELECT 1 FROM lockgate.parked").await.unwrap(), 0);
}

/// The doctor's check of `held_statements` at the given long-running threshold: its verdict and
/// detail.
async fn held_statements(db: &PgPool, long_running_seconds: f64) -> (String, String) {
    sqlx::query_as("SELECT verdict, detail FROM lockgate.doctor($1) WHERE check_name = 'held_statements'")
        .bind(long_running_seconds)
        .fetch_one(db)
        .await
        .unwrap()
}

/// The doctor names a statement that runs on for a job its delivery no longer holds, whatever
/// holds the job back for it (review helper-113 F6: only kept leases were named): a delivery lapsed
/// with nothing taking the job yet, an unlimited job a claim puts back because it may not end the
/// statement, and a job gone from its queue while the statement ran on; not a statement whose
/// delivery holds its job.
#[tokio::test]
async fn the_doctor_names_a_statement_that_runs_on_for_a_job_its_delivery_no_longer_holds() {
    let db = TestDb::migrated().await.unwrap();
    define(&db, None).await;
    enqueue(&db.pool).await;
    let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
    let (pid, statement) = running_statement(&db, m, rc).await;
    let named = |(verdict, detail): (String, String), why: &str| {
        assert_eq!(verdict, "warn", "{detail}");
        assert!(detail.contains(&format!("backend {pid} of role")) && detail.contains(why), "{detail}");
    };
    assert_eq!(held_statements(&db.pool, 0.0).await.0, "ok", "a running delivery's statement");

    sqlx::query("UPDATE pgmq.q_default SET vt = now() - interval '1 minute'").execute(&db.pool).await.unwrap();
    named(held_statements(&db.pool, 60.0).await, &format!("job {m} of queue default: its delivery lapsed"));

    let mut claimer = not_superuser(&db, "claimer").await;
    assert!(claim(&mut claimer).await.is_empty(), "the job was delivered again beside its statement");
    named(held_statements(&db.pool, 60.0).await, "put back until it ends");

    sqlx::query("SELECT pgmq.archive('default', $1)").bind(m).execute(&db.pool).await.unwrap();
    assert_eq!(held_statements(&db.pool, 60.0).await.0, "ok", "a statement younger than the threshold");
    named(held_statements(&db.pool, 0.0).await, "no longer in its queue");

    sqlx::query("SELECT pg_terminate_backend($1, 5000)").bind(pid).execute(&db.pool).await.unwrap();
    assert!(statement.await.unwrap().is_err());
    assert_eq!(held_statements(&db.pool, 0.0).await.0, "ok");
}

/// Marks are a database's own: another database's lockgate, whose jobs have the same ids, ends
/// none of them.
#[tokio::test]
async fn another_databases_claim_leaves_a_statement_of_the_same_job_id_alone() {
    let (one, other) = (TestDb::migrated().await.unwrap(), TestDb::migrated().await.unwrap());
    for db in [&one, &other] {
        define(db, None).await;
        enqueue(&db.pool).await;
    }
    let [(m, rc)] = claim(&one.pool).await[..] else { panic!("one delivery") };
    let (pid, _statement) = running_statement(&one, m, rc).await;
    assert_eq!(claim(&other.pool).await, vec![(m, 1)], "the same job id in the other database");
    lapse_visibility(&other.pool).await;
    assert_eq!(claim(&other.pool).await, vec![(m, 2)]);
    assert_eq!(sweep_later(&other.pool).await.0, 0);
    assert!(running(&one.pool, pid).await, "another database's claim ended this one's statement");
}

/// A start waits for a claim or a sweep that is taking its job (each holds the job's rows until it
/// commits) and then starts nothing, whatever the clock says: here the job is taken while its
/// visibility still runs, as after the server's clock stepped back.
#[tokio::test]
async fn a_start_waits_for_a_claim_or_sweep_that_takes_its_job_and_then_starts_nothing() {
    for taking in [
        "UPDATE pgmq.q_default SET read_ct = read_ct + 1",
        "DELETE FROM lockgate.leases WHERE ctid = (SELECT ctid FROM lockgate.leases FOR UPDATE)",
    ] {
        let db = TestDb::migrated().await.unwrap();
        define(&db, Some(1)).await;
        enqueue(&db.pool).await;
        let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
        let mut taker = PgConnection::connect(&db.url).await.unwrap();
        let mut tx = taker.begin().await.unwrap();
        sqlx::query(taking).execute(&mut *tx).await.unwrap();
        let url = db.url.clone();
        let starting = tokio::spawn(async move {
            let mut conn = PgConnection::connect(&url).await.unwrap();
            sqlx::query_scalar::<_, Option<i32>>("SELECT lockgate.start_statement('default', $1, $2)")
                .bind(m)
                .bind(rc)
                .fetch_one(&mut conn)
                .await
                .unwrap()
        });
        lockgate_testkit::wait_for("the start to wait for the taker's lock", Duration::from_secs(10), || async {
            let waiting = db
                .count(
                    "SELECT 1 FROM pg_stat_activity WHERE query LIKE '%start_statement%' AND wait_event_type = 'Lock' \
                      AND datname = current_database()",
                )
                .await?;
            Ok((waiting == 1 || starting.is_finished()).then_some(()))
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(starting.await.unwrap(), None, "a statement started after `{taking}` took its job");
    }
}

/// A start holds no lock once it has returned, even in the transaction its statement runs in (as
/// under a transaction-mode pooler): the job's heartbeat renews its visibility and lease, rather
/// than finding them held, all the while the statement runs.
#[tokio::test]
async fn a_started_statement_holds_nothing_its_heartbeat_renews() {
    let db = TestDb::migrated().await.unwrap();
    define(&db, Some(1)).await;
    enqueue(&db.pool).await;
    let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let pid: Option<i32> = sqlx::query_scalar("SELECT lockgate.start_statement('default', $1, $2, true)")
        .bind(m)
        .bind(rc)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert!(pid.is_some());
    let budget: Option<f64> =
        sqlx::query_scalar("SELECT budget_seconds FROM lockgate.extend('default', ARRAY[$1], ARRAY[$2], 30)")
            .bind(m)
            .bind(rc)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(budget.is_some(), "the heartbeat found the job's rows held by its statement's transaction");
    tx.rollback().await.unwrap();
}

/// A role without lockgate's rights that wears a job's mark (any role that may connect may set its
/// application_name) holds nothing: the sweep and the claim hand the job on as if it were not
/// there, and leave its session alone.
#[tokio::test]
async fn a_mark_worn_by_a_role_without_lockgates_rights_holds_nothing() {
    let db = TestDb::migrated().await.unwrap();
    define(&db, Some(1)).await;
    let role = format!("{}_forger", db.name);
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN")).execute(&db.pool).await.unwrap();
    assert_eq!(enqueue(&db.pool).await, "enqueued");
    assert_eq!(enqueue(&db.pool).await, "parked");
    let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
    let options: sqlx::postgres::PgConnectOptions = db.url.parse().unwrap();
    let mut forger = PgConnection::connect_with(&options.username(&role)).await.unwrap();
    sqlx::raw_sql(&format!("SET application_name = 'lockgate job {m} default'")).execute(&mut forger).await.unwrap();
    let forger_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut forger).await.unwrap();

    lapse_visibility(&db.pool).await;
    assert_eq!(claim(&db.pool).await, vec![(m, rc + 1)], "the job was kept for a forged mark");
    lapse_visibility(&db.pool).await;
    assert_eq!(sweep_later(&db.pool).await, (1, 0, 1), "the lease was kept for a forged mark");
    let alive: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
        .bind(forger_pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(alive, "a session lockgate has nothing to do with was ended");
}

/// A cancelled running job of a `while_executing` type keeps its unique key only until its
/// visibility ends (by then its worker has stopped it); a worker frozen or cut off stopped
/// nothing, so the cancel ends its statement, and, where the cancel's role may not, the claim
/// that takes the key for the next job, and the reaper, end it first.
#[tokio::test]
async fn a_cancelled_jobs_statement_is_ended_before_its_unique_key_passes_on() {
    // (by the reaper, as a role that may end the statement)
    for (reaper, may_end) in [(false, true), (true, true), (false, false), (true, false)] {
        let db = TestDb::migrated().await.unwrap();
        sqlx::query(
            "SELECT lockgate.define_job_type('job', unique_mode => 'while_executing', unique_key => array['k'])",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        enqueue(&db.pool).await;
        let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
        let (pid, statement) = running_statement(&db, m, rc).await;
        // Cancelled by the same role as takes the key: one that may end the statement ends it at
        // the cancel (design §120), one that may not leaves it to whoever takes the key next.
        let mut taker =
            if may_end { PgConnection::connect(&db.url).await.unwrap() } else { not_superuser(&db, "taker").await };
        sqlx::query("SELECT lockgate.cancel($1)").bind(m).execute(&mut taker).await.unwrap();
        // The cancelled run's visibility over: the lock it kept for its handler is free to take.
        sqlx::query("UPDATE lockgate.unique_locks SET held_until = now() - interval '1 second'")
            .execute(&db.pool)
            .await
            .unwrap();
        let handed_on = if reaper {
            let reaped: i32 = sqlx::query_scalar("SELECT lockgate.reap_unique_locks('0 seconds')")
                .fetch_one(&mut taker)
                .await
                .unwrap();
            reaped == 1
        } else {
            assert_eq!(enqueue(&db.pool).await, "enqueued");
            claim(&mut taker).await.len() == 1
        };
        if !may_end {
            assert!(!handed_on, "the key went on while its cancelled job's statement ran (reaper: {reaper})");
            assert!(running(&db.pool, pid).await);
            continue;
        }
        assert!(handed_on, "the key stayed with its cancelled job (reaper: {reaper})");
        assert!(!running(&db.pool, pid).await, "the cancelled job's statement ran on (reaper: {reaper})");
        assert!(statement.await.unwrap().is_err());
    }
}

/// An operator's cancel of a job whose delivery lapsed (queued again, its worker frozen or cut
/// off) gave its permit to the key's next job while its statement ran on (review helper-113 F1).
/// The cancel ends the statement first; one it may not end keeps the permit, as a running job's.
#[tokio::test]
async fn a_cancel_of_a_lapsed_delivery_ends_its_statement_before_its_permit_passes_on() {
    for may_end in [true, false] {
        let db = TestDb::migrated().await.unwrap();
        define(&db, Some(1)).await;
        assert_eq!(enqueue(&db.pool).await, "enqueued");
        assert_eq!(enqueue(&db.pool).await, "parked");
        let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
        let (pid, statement) = running_statement(&db, m, rc).await;
        lapse_visibility(&db.pool).await;

        let mut operator =
            if may_end { PgConnection::connect(&db.url).await.unwrap() } else { not_superuser(&db, "operator").await };
        let (state, cancelled): (String, bool) = sqlx::query_as("SELECT state, cancelled FROM lockgate.cancel($1)")
            .bind(m)
            .fetch_one(&mut operator)
            .await
            .unwrap();
        assert_eq!((state.as_str(), cancelled), ("queued", true));
        let next = claim(&db.pool).await;
        if may_end {
            assert_eq!(next.len(), 1, "the key's next job runs");
            assert!(!running(&db.pool, pid).await, "the cancelled job's statement ran beside the key's next job");
            assert!(statement.await.unwrap().is_err());
        } else {
            assert!(next.is_empty(), "the key's next job ran beside the cancelled job's statement");
            assert!(running(&db.pool, pid).await);
        }
    }
}

/// An operator's cancel of an unlimited job whose `sql` statement runs on while its worker is
/// frozen or cut off ends that statement, whether the job was still running or its delivery had
/// lapsed: nothing else would (no claim delivers a cancelled job again, and an unlimited job has
/// no lease for the sweep to expire). Before, the statement committed its work after the cancel
/// (review helper-139 F2: 18 s later, the job shown cancelled and its batch finished).
#[tokio::test]
async fn a_cancel_ends_the_statement_of_an_unlimited_job_whose_worker_is_silent() {
    for lapsed in [false, true] {
        let db = TestDb::migrated().await.unwrap();
        define(&db, None).await;
        assert_eq!(enqueue(&db.pool).await, "enqueued");
        let [(m, rc)] = claim(&db.pool).await[..] else { panic!("one delivery") };
        let (pid, statement) = running_statement(&db, m, rc).await;
        if lapsed {
            lapse_visibility(&db.pool).await;
        }
        let (state, cancelled): (String, bool) = sqlx::query_as("SELECT state, cancelled FROM lockgate.cancel($1)")
            .bind(m)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let was = if lapsed { "queued" } else { "running" };
        assert_eq!((state.as_str(), cancelled), (was, true));
        assert!(!running(&db.pool, pid).await, "the cancelled {was} job's statement ran on");
        let ended = tokio::time::timeout(Duration::from_secs(10), statement).await.expect("the statement ended");
        assert!(ended.unwrap().is_err(), "the cancelled {was} job's statement was ended, not left to finish");
    }
}
