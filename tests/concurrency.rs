//! Concurrency limits at the SQL seam, hazard by hazard (SPEC §5, H1–H16). Races are forced
//! with two connections and row locks, never with sleeps; every test ends with the invariant
//! check (value = live leases <= limit, no lease on a missing message).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use lockgate::sql::{check_invariants, claim, sweep};
use lockgate::worker::complete_deliveries;
use lockgate::{
    ArchiveOutcome, Claim, Client, ConcurrencyPolicy, EnqueueError, EnqueueOptions, EnqueueStatus, EnqueuedJob,
    JobPolicy, JobTypeName, OnConflict,
};
use lockgate_testkit::{wait_for, FaultProxy, TestDb};
use serde_json::json;

const TYPE: &str = "limited";

async fn setup_with(limit: u32, on_conflict: OnConflict, duration: Duration) -> (TestDb, Client) {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    let mut policy = JobPolicy::on_queue(common::queue("default"));
    policy.concurrency = Some(ConcurrencyPolicy { limit, key: vec!["account".into()], duration, on_conflict });
    client.define_job_type(&JobTypeName::new(TYPE).unwrap(), &policy).await.unwrap();
    (db, client)
}

async fn setup(limit: u32) -> (TestDb, Client) {
    setup_with(limit, OnConflict::Block, Duration::from_secs(600)).await
}

fn key(account: i64) -> String {
    format!("{TYPE}:[{account}]")
}

async fn enqueue(client: &Client, account: i64, n: i64) -> EnqueuedJob {
    client.enqueue_raw(TYPE, &json!({ "account": account, "n": n }), &EnqueueOptions::default()).await.unwrap()
}

async fn value(db: &TestDb, account: i64) -> i32 {
    sqlx::query_scalar("SELECT value FROM lockgate.semaphores WHERE key = $1")
        .bind(key(account))
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn parked(db: &TestDb) -> i64 {
    db.count("SELECT 1 FROM lockgate.parked").await.unwrap()
}

async fn claim_one(db: &TestDb) -> Claim {
    let mut claims = claim(&db.pool, &common::queue("default"), 1, Duration::from_secs(30)).await.unwrap();
    assert_eq!(claims.len(), 1, "one message to claim");
    claims.remove(0)
}

async fn complete(db: &TestDb, c: &Claim) -> ArchiveOutcome {
    let deadline = Instant::now() + Duration::from_secs(10);
    complete_deliveries(&db.pool, &c.queue, &[(c.msg_id, c.read_ct)], deadline).await.remove(0).unwrap()
}

/// For each account: a job holding its key's permit and one parked behind it, in two batches.
async fn running_and_parked(client: &Client, accounts: std::ops::Range<i64>) {
    for n in [1, 2] {
        let args: Vec<serde_json::Value> =
            accounts.clone().map(|account| json!({ "account": account, "n": n })).collect();
        client.enqueue_many_raw(TYPE, &args, &EnqueueOptions::default()).await.unwrap();
    }
}

/// Claims the next job of `default` on `conn` (its start recorded) and completes it there, in SQL;
/// returns its msg_id.
async fn claim_and_complete_on(conn: &mut sqlx::PgConnection) -> i64 {
    let (msg_id, read_ct): (i64, i32) =
        sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30, NULL, 1)")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    let archived: Vec<i64> = sqlx::query_scalar("SELECT c FROM lockgate.complete('default', ARRAY[$1], ARRAY[$2]) c")
        .bind(msg_id)
        .bind(read_ct)
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    assert_eq!(archived, vec![msg_id], "the holder's completion archives it");
    msg_id
}

/// The message of `job_id`, if it exists: (msg_id, visible_at - now in seconds).
async fn message_of(db: &TestDb, job_id: i64) -> Option<(i64, f64)> {
    sqlx::query_as(
        "SELECT msg_id, extract(epoch FROM vt - now())::float8 FROM pgmq.q_default WHERE COALESCE((headers->>'job_id')::bigint, msg_id) = $1",
    )
    .bind(job_id)
    .fetch_optional(&db.pool)
    .await
    .unwrap()
}

/// Completes `c` on a pool of its own, in the background, once that completion is waiting on a
/// row lock another transaction of the test holds.
async fn complete_behind_a_lock(db: &TestDb, c: &Claim) -> tokio::task::JoinHandle<Vec<lockgate::worker::Completion>> {
    let pool = db.new_pool(2).await.unwrap();
    let c = c.clone();
    let completion = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        complete_deliveries(&pool, &c.queue, &[(c.msg_id, c.read_ct)], deadline).await
    });
    wait_for("the completion to wait on the key's lock", common::WAIT, || async {
        Ok(sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_optional(&db.pool)
        .await?)
    })
    .await
    .unwrap();
    completion
}

/// Completes `c` on a session that may not wait a second for any lock.
async fn complete_without_waiting(db: &TestDb, c: &Claim) -> ArchiveOutcome {
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '1s'").execute(&mut *conn).await.unwrap();
    let archived: Vec<i64> = sqlx::query_scalar("SELECT c FROM lockgate.complete($1, ARRAY[$2], ARRAY[$3]) c")
        .bind(c.queue.as_str())
        .bind(c.msg_id)
        .bind(c.read_ct)
        .fetch_all(&mut *conn)
        .await
        .expect("the completion waited for a lock");
    sqlx::query("RESET lock_timeout").execute(&mut *conn).await.unwrap();
    if archived == vec![c.msg_id] {
        ArchiveOutcome::Archived
    } else {
        ArchiveOutcome::AlreadyArchived
    }
}

/// Leases whose job finished while another transaction held their key's row.
async fn finished_leases(db: &TestDb) -> i64 {
    db.count("SELECT 1 FROM lockgate.leases WHERE finished_at IS NOT NULL").await.unwrap()
}

async fn assert_invariants(db: &TestDb) {
    sweep(&db.pool, 1000, None).await.unwrap();
    let violations = check_invariants(&db.pool).await.unwrap();
    assert!(violations.is_empty(), "invariants violated: {violations:?}");
}

#[tokio::test]
async fn enqueue_takes_a_permit_or_parks_under_the_key_lock() {
    let (db, client) = setup(2).await;
    let statuses: Vec<EnqueueStatus> = [
        enqueue(&client, 1, 1).await,
        enqueue(&client, 1, 2).await,
        enqueue(&client, 1, 3).await,
        enqueue(&client, 2, 4).await,
    ]
    .iter()
    .map(|j| j.status)
    .collect();
    use EnqueueStatus::*;
    assert_eq!(statuses, vec![Enqueued, Enqueued, Parked, Enqueued]);
    assert_eq!((value(&db, 1).await, value(&db, 2).await), (2, 1));
    assert_eq!(db.count("SELECT 1 FROM lockgate.leases").await.unwrap(), 3, "one lease per message");
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h01_stale_performer_returns_no_permit_promotes_nothing_and_keeps_the_outcome() {
    let (db, client) = setup(1).await;
    enqueue(&client, 1, 1).await;
    let waiting = enqueue(&client, 1, 2).await;
    let stale = claim_one(&db).await;
    db.expire_visibility("default", stale.msg_id).await.unwrap();
    let owner = claim_one(&db).await;
    assert_eq!(owner.read_ct, stale.read_ct + 1);

    assert_eq!(complete(&db, &stale).await, ArchiveOutcome::AlreadyArchived);
    assert_eq!(value(&db, 1).await, 1, "the stale completion returned no permit");
    assert_eq!(parked(&db).await, 1, "and promoted nothing");
    assert!(message_of(&db, waiting.job_id.0).await.is_none());
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 0, "nor recorded an outcome");

    assert_eq!(complete(&db, &owner).await, ArchiveOutcome::Archived);
    assert!(message_of(&db, waiting.job_id.0).await.is_some(), "the owner's completion promoted the next job");
    assert_eq!(value(&db, 1).await, 1);
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h02_bulk_release_never_pushes_a_key_past_its_limit_or_below_zero() {
    let (db, client) = setup(3).await;
    for n in 0..13 {
        enqueue(&client, 1, n).await;
    }
    assert_eq!(parked(&db).await, 10);
    let claims = claim(&db.pool, &common::queue("default"), 10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(claims.len(), 3);
    let tokens: Vec<(i64, i32)> = claims.iter().map(|c| (c.msg_id, c.read_ct)).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = complete_deliveries(&db.pool, &claims[0].queue, &tokens, deadline).await;
    assert!(first.iter().all(|o| *o == Ok(ArchiveOutcome::Archived)));
    assert_eq!((value(&db, 1).await, parked(&db).await), (3, 7), "three released, exactly three promoted");
    let again = complete_deliveries(&db.pool, &claims[0].queue, &tokens, deadline).await;
    assert!(again.iter().all(|o| *o == Ok(ArchiveOutcome::AlreadyArchived)));
    assert_eq!((value(&db, 1).await, parked(&db).await), (3, 7), "a repeated bulk release changes nothing");
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h04_a_parked_job_older_than_duration_is_still_there_and_still_promotable() {
    let (db, client) = setup_with(1, OnConflict::Block, Duration::from_secs(1)).await;
    lockgate::sql::record_heartbeat_interval(&db.pool, Duration::from_millis(100)).await.unwrap();
    enqueue(&client, 1, 1).await;
    let waiting = enqueue(&client, 1, 2).await;
    let holder = claim_one(&db).await;
    // The holder is alive: its heartbeat keeps renewing its lease while the parked job ages.
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() + interval '2 days'").execute(&db.pool).await.unwrap();
    let report = sweep(&db.pool, 1000, Some(chrono::Utc::now() + chrono::Duration::days(1))).await.unwrap();
    assert_eq!(report.promoted, 0);
    assert_eq!(parked(&db).await, 1, "a day past its duration, the parked job is still there");
    assert_eq!(complete(&db, &holder).await, ArchiveOutcome::Archived);
    assert!(message_of(&db, waiting.job_id.0).await.is_some(), "and it is promoted when the permit frees");
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h06_park_racing_a_completion_is_promoted_once_the_sweep_has_its_permit_back() {
    let (db, client) = setup(1).await;
    enqueue(&client, 1, 1).await;
    let holder = claim_one(&db).await;
    // The park: the enqueue holds the key's semaphore row lock until it commits.
    let mut parking = db.pool.begin().await.unwrap();
    let row: (Option<i64>, i64, String) =
        sqlx::query_as("SELECT msg_id, job_id, status FROM lockgate.enqueue($1, '{\"account\": 1, \"n\": 2}')")
            .bind(TYPE)
            .fetch_one(&mut *parking)
            .await
            .unwrap();
    assert_eq!(row.2, "parked");
    // The completion runs meanwhile: it does not wait for that lock (a wait past the job's lease
    // ran the finished job again, H28), and leaves the permit, on a lease marked finished, to the
    // sweep.
    assert_eq!(complete_without_waiting(&db, &holder).await, ArchiveOutcome::Archived);
    assert_eq!(finished_leases(&db).await, 1);
    parking.commit().await.unwrap();
    assert!(message_of(&db, row.1).await.is_none(), "the park committed after the completion");
    assert_eq!(sweep(&db.pool, 1000, None).await.unwrap().promoted, 1, "the sweep promotes it");
    assert!(message_of(&db, row.1).await.is_some());
    assert_eq!((parked(&db).await, finished_leases(&db).await, value(&db, 1).await), (0, 0, 1));
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h07_a_duplicate_delivery_releases_the_permit_once() {
    let (db, client) = setup(2).await;
    enqueue(&client, 1, 1).await;
    enqueue(&client, 1, 2).await;
    let third = enqueue(&client, 1, 3).await;
    let first = claim_one(&db).await;
    db.expire_visibility("default", first.msg_id).await.unwrap();
    let duplicate = claim(&db.pool, &first.queue, 2, Duration::from_secs(30)).await.unwrap();
    let redelivered = duplicate.iter().find(|c| c.msg_id == first.msg_id).unwrap().clone();
    assert_eq!(complete(&db, &redelivered).await, ArchiveOutcome::Archived);
    assert_eq!(complete(&db, &first).await, ArchiveOutcome::AlreadyArchived);
    assert_eq!(complete(&db, &redelivered).await, ArchiveOutcome::AlreadyArchived);
    assert_eq!(value(&db, 1).await, 2, "one release, and the third job took that permit");
    assert!(message_of(&db, third.job_id.0).await.is_some());
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h08_parked_payloads_are_json_objects_readable_from_sql() {
    let (db, client) = setup(1).await;
    enqueue(&client, 7, 1).await;
    enqueue(&client, 7, 2).await;
    let (kind, n, account): (String, String, String) =
        sqlx::query_as("SELECT jsonb_typeof(args), args->>'n', args->>'account' FROM lockgate.parked")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((kind.as_str(), n.as_str(), account.as_str()), ("object", "2", "7"));
    let err = sqlx::query(
        "INSERT INTO lockgate.parked (key, queue, job_type, job_id, args, headers, priority, run_at)
         VALUES ('k', 'default', 'limited', 1, '\"{}\"', '{}', 0, now())",
    )
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert!(err.to_string().contains("parked_args_check"), "a double-encoded payload is refused: {err}");
}

#[tokio::test]
async fn h09_a_scheduled_jobs_lease_covers_its_delay_and_promotion_keeps_the_remaining_delay() {
    let (db, client) = setup_with(1, OnConflict::Block, Duration::from_secs(60)).await;
    let in_an_hour = EnqueueOptions { delay: Some(Duration::from_secs(3600)), ..Default::default() };
    let scheduled = client.enqueue_raw(TYPE, &json!({"account": 1}), &in_an_hour).await.unwrap();
    let lease_left: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM expires_at - now())::float8 FROM lockgate.leases")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(lease_left >= 3600.0 + 59.0, "the lease covers the delay and then the duration: {lease_left}");
    let half_an_hour = chrono::Utc::now() + chrono::Duration::minutes(30);
    assert_eq!(sweep(&db.pool, 100, Some(half_an_hour)).await.unwrap().expired, 0, "not expired while waiting");

    // A second scheduled job parks; the first is completed early (after being made visible).
    let promoted = client.enqueue_raw(TYPE, &json!({"account": 1, "n": 2}), &in_an_hour).await.unwrap();
    assert_eq!(promoted.status, EnqueueStatus::Parked);
    db.expire_visibility("default", scheduled.msg_id.unwrap()).await.unwrap();
    let holder = claim_one(&db).await;
    assert_eq!(complete(&db, &holder).await, ArchiveOutcome::Archived);
    let (_, visible_in) = message_of(&db, promoted.job_id.0).await.expect("promoted");
    assert!(visible_in > 3500.0, "the promoted job keeps its remaining delay: {visible_in}");
    let lease_left: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM expires_at - now())::float8 FROM lockgate.leases")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(lease_left > visible_in + 59.0, "and its lease covers that delay: {lease_left}");
    assert_invariants(&db).await;
}

async fn lease_seconds(db: &TestDb) -> f64 {
    sqlx::query_scalar("SELECT min(extract(epoch FROM expires_at - now()))::float8 FROM lockgate.leases")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn h10_a_duration_below_the_heartbeat_is_floored_at_acquire_promotion_and_renewal() {
    let (db, client) = setup_with(1, OnConflict::Block, Duration::from_millis(100)).await;
    lockgate::sql::record_heartbeat_interval(&db.pool, Duration::from_secs(5)).await.unwrap();
    enqueue(&client, 1, 1).await;
    assert!(lease_seconds(&db).await > 9.0, "floored at twice the 5 s heartbeat when acquired");
    let waiting = enqueue(&client, 1, 2).await;
    let holder = claim_one(&db).await;
    let renewed = lockgate::sql::extend(
        &db.pool,
        &holder.queue,
        &[(holder.msg_id, holder.read_ct)],
        Duration::from_secs(30),
        None,
    )
    .await
    .unwrap();
    assert_eq!(renewed.renewed.iter().map(|r| r.0).collect::<Vec<_>>(), vec![holder.msg_id]);
    assert!(lease_seconds(&db).await > 9.0, "floored when renewed");
    assert_eq!(complete(&db, &holder).await, ArchiveOutcome::Archived);
    assert!(message_of(&db, waiting.job_id.0).await.is_some());
    assert!(lease_seconds(&db).await > 9.0, "floored when promoted");
    assert_invariants(&db).await;
}

async fn nothing_changed(db: &TestDb) {
    assert_eq!(value(db, 1).await, 1, "the permit count is as before");
    assert_eq!(db.count("SELECT 1 FROM lockgate.leases").await.unwrap(), 1);
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 1);
    assert_eq!(parked(db).await, 0);
}

#[tokio::test]
async fn h11_a_failed_or_killed_enqueue_leaves_everything_or_nothing() {
    let (db, client) = setup(2).await;
    enqueue(&client, 1, 1).await;

    // A failure after the permit was taken (the lease insert fails): nothing remains.
    sqlx::raw_sql(
        "CREATE FUNCTION fail_lease() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'injected'; END $$;
         CREATE TRIGGER fail_lease BEFORE INSERT ON lockgate.leases FOR EACH ROW EXECUTE FUNCTION fail_lease();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let err = client.enqueue_raw(TYPE, &json!({"account": 1}), &EnqueueOptions::default()).await.unwrap_err();
    assert!(err.to_string().contains("injected"), "{err}");
    nothing_changed(&db).await;
    sqlx::raw_sql("DROP TRIGGER fail_lease ON lockgate.leases").execute(&db.pool).await.unwrap();

    // The caller's transaction fails after the enqueue: nothing remains.
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue($1, '{\"account\": 1}')").bind(TYPE).execute(&mut *tx).await.unwrap();
    assert!(sqlx::query("SELECT 1/0").execute(&mut *tx).await.is_err());
    tx.rollback().await.unwrap();
    nothing_changed(&db).await;

    // The enqueue's backend is killed while it waits inside the acquire: nothing remains.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM lockgate.semaphores FOR UPDATE").execute(&mut *blocker).await.unwrap();
    let pool = db.new_pool(1).await.unwrap();
    let victim = tokio::spawn(async move {
        sqlx::query("SELECT * FROM lockgate.enqueue('limited', '{\"account\": 1}')").execute(&pool).await
    });
    let pid: i32 = wait_for("the enqueue to wait on the key's lock", common::WAIT, || async {
        Ok(sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_optional(&db.pool)
        .await?)
    })
    .await
    .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&db.pool).await.unwrap();
    blocker.commit().await.unwrap();
    assert!(victim.await.unwrap().is_err(), "the killed enqueue reports an error");
    nothing_changed(&db).await;
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h12_a_failing_bookkeeping_step_cannot_undo_a_promotion_whose_message_is_live() {
    let (db, client) = setup(1).await;
    enqueue(&client, 1, 1).await;
    let waiting = enqueue(&client, 1, 2).await;
    let holder = claim_one(&db).await;
    // The promotion's lease insert fails: the whole completion, promotion included, rolls back.
    sqlx::raw_sql(
        "CREATE FUNCTION fail_lease() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'injected'; END $$;
         CREATE TRIGGER fail_lease BEFORE INSERT ON lockgate.leases FOR EACH ROW EXECUTE FUNCTION fail_lease();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let outcome =
        complete_deliveries(&db.pool, &holder.queue, &[(holder.msg_id, holder.read_ct)], Instant::now()).await;
    assert!(outcome[0].as_ref().is_err_and(|e| e.contains("injected")), "{outcome:?}");
    assert!(message_of(&db, waiting.job_id.0).await.is_none(), "no promoted message is live without its permit");
    assert_eq!(
        (parked(&db).await, value(&db, 1).await),
        (1, 1),
        "the job is still parked; the holder keeps its permit"
    );
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 0);
    sqlx::raw_sql("DROP TRIGGER fail_lease ON lockgate.leases").execute(&db.pool).await.unwrap();
    assert_eq!(complete(&db, &holder).await, ArchiveOutcome::Archived);
    assert!(message_of(&db, waiting.job_id.0).await.is_some());
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h13_a_completion_whose_reply_is_lost_never_strands_a_permit() {
    let (db, client) = setup(1).await;
    enqueue(&client, 1, 1).await;
    let waiting = enqueue(&client, 1, 2).await;
    let holder = claim_one(&db).await;
    let proxy = FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let via_proxy = lockgate::PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect(&proxy.url_for(&db.url))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    complete_deliveries(&via_proxy, &holder.queue, &[(0, 0)], deadline).await;
    proxy.cut_next_reply();
    let outcome = complete_deliveries(&via_proxy, &holder.queue, &[(holder.msg_id, holder.read_ct)], deadline).await;
    assert_eq!(outcome, vec![Ok(ArchiveOutcome::Ambiguous)]);
    assert!(message_of(&db, waiting.job_id.0).await.is_some(), "the committed completion promoted, once");
    assert_eq!(value(&db, 1).await, 1);
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h15_thousands_of_held_keys_cannot_starve_a_key_whose_holder_died() {
    let (db, client) = setup(1).await;
    // 2,000 keys, each held by a live holder and with a job parked behind it.
    let holders: Vec<serde_json::Value> = (0..2000).map(|a| json!({ "account": a })).collect();
    client.enqueue_many_raw(TYPE, &holders, &EnqueueOptions::default()).await.unwrap();
    client.enqueue_many_raw(TYPE, &holders, &EnqueueOptions::default()).await.unwrap();
    // The key whose holder died: parked last, so it is the youngest of all parked keys.
    enqueue(&client, 99_999, 1).await;
    let orphan = enqueue(&client, 99_999, 2).await;
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second' WHERE key = $1")
        .bind(key(99_999))
        .execute(&db.pool)
        .await
        .unwrap();
    let report = sweep(&db.pool, 10, None).await.unwrap();
    assert_eq!((report.expired, report.promoted), (1, 1), "one pass of 10 keys reaches the one that can move");
    assert!(message_of(&db, orphan.job_id.0).await.is_some());
    assert_eq!(parked(&db).await, 2000);
    let violations = check_invariants(&db.pool).await.unwrap();
    // The dead holder's message still exists without a lease: its next delivery re-acquires or parks.
    assert!(violations.is_empty(), "{violations:?}");
}

/// The sweep's repair costs the same with any backlog (issue 14): a key with room and parked
/// jobs that nothing released (here: a permit given back outside any release, as a claim that
/// re-keys its job does) is found by the round-robin, at most 256 keys per pass, within one round
/// over every key with parked jobs; the passes before it promote nothing and move the cursor on.
#[tokio::test]
async fn the_sweeps_repair_looks_at_a_bounded_window_per_pass_and_reaches_every_key_in_a_round() {
    let (db, client) = setup(1).await;
    // 600 keys, each held and with a job parked behind it.
    let jobs: Vec<serde_json::Value> = (0..600).map(|a| json!({ "account": a })).collect();
    client.enqueue_many_raw(TYPE, &jobs, &EnqueueOptions::default()).await.unwrap();
    client.enqueue_many_raw(TYPE, &jobs, &EnqueueOptions::default()).await.unwrap();
    // The first pass after the migration looks at every key (nothing to do here).
    assert_eq!(sweep(&db.pool, 1000, None).await.unwrap().promoted, 0);
    let full: bool =
        sqlx::query_scalar("SELECT full_scan FROM lockgate.sweep_state").fetch_one(&db.pool).await.unwrap();
    assert!(!full, "a pass that found fewer than max_keys ends the full scan");
    // Keys sort as text: "limited:[599]" is the 557th of 600, so the third window of 256 reaches it.
    sqlx::query(
        "WITH gone AS (DELETE FROM lockgate.leases WHERE key = $1 RETURNING key)
         UPDATE lockgate.semaphores s SET value = s.value - 1 FROM gone WHERE s.key = gone.key",
    )
    .bind(key(599))
    .execute(&db.pool)
    .await
    .unwrap();
    let mut cursors = Vec::new();
    for pass in 1..=3 {
        let promoted = sweep(&db.pool, 1000, None).await.unwrap().promoted;
        let cursor: Option<String> =
            sqlx::query_scalar("SELECT cursor_key FROM lockgate.sweep_state").fetch_one(&db.pool).await.unwrap();
        cursors.push(cursor);
        assert_eq!(promoted, i32::from(pass == 3), "pass {pass}: cursors {cursors:?}");
    }
    assert_eq!(cursors[2], None, "the round wraps around after the last key");
    assert_eq!((parked(&db).await, value(&db, 599).await), (599, 1));
    // A policy change (here a raised limit) makes the next pass look at every key at once.
    let raised = ConcurrencyPolicy { key: vec!["account".into()], ..ConcurrencyPolicy::new(2) };
    redefine(&client, Some(raised)).await;
    assert_eq!(sweep(&db.pool, 1000, None).await.unwrap().promoted, 599);
    assert_invariants(&db).await;
}

/// Idle keys are reclaimed (issue 14): a key with no permit held and nothing parked, unchanged
/// past the threshold, loses its semaphore row; a held, parked, recent or locked key keeps it;
/// the reclaimer never waits for an open producer transaction; a reclaimed key used again takes
/// a permit as a new key does.
#[tokio::test]
async fn idle_keys_are_reclaimed_under_their_row_lock_and_nothing_else_is() {
    let (db, client) = setup(1).await;
    let reclaim = || async {
        sqlx::query_scalar::<_, i32>("SELECT lockgate.reclaim_idle_keys(interval '1 minute')")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let keys = || async {
        sqlx::query_scalar::<_, String>("SELECT key FROM lockgate.semaphores ORDER BY key")
            .fetch_all(&db.pool)
            .await
            .unwrap()
    };
    // Keys 2, 3 and 4 used once and finished; key 1 held with a job parked behind it.
    for account in [2, 3, 4] {
        enqueue(&client, account, 1).await;
    }
    assert_eq!(complete_all_visible(&db).await, 3);
    enqueue(&client, 1, 1).await;
    enqueue(&client, 1, 2).await;
    assert_eq!((value(&db, 1).await, value(&db, 2).await, parked(&db).await), (1, 0, 1));
    assert_eq!(reclaim().await, 0, "nothing idle for a minute yet");
    // Keys 2 and 3 idle for an hour; key 4 too, but an open producer transaction is taking it.
    sqlx::query("UPDATE lockgate.semaphores SET updated_at = now() - interval '1 hour'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut producer = db.pool.begin().await.unwrap();
    sqlx::query("SELECT lockgate.enqueue($1, $2::jsonb, '{}')")
        .bind(TYPE)
        .bind(json!({ "account": 4, "n": 2 }))
        .execute(&mut *producer)
        .await
        .unwrap();
    assert_eq!(reclaim().await, 2, "keys 2 and 3, without waiting for the producer");
    assert_eq!(keys().await, vec![key(1), key(4)], "the held key and the key being taken stay");
    producer.commit().await.unwrap();
    assert_eq!(value(&db, 4).await, 1);
    // A reclaimed key is a new key again.
    let again = enqueue(&client, 2, 2).await;
    assert!(message_of(&db, again.job_id.0).await.is_some(), "it took a permit at once");
    assert_eq!(value(&db, 2).await, 1);
    assert_invariants(&db).await;
}

/// Migration 19 (docs/design.md §61): the guard that refuses deleting a key's row while leases or
/// parked jobs name it probes those keys only, in a session whose first reclamation deleted many
/// rows. Its check, planned on that first large delete, had made each EXISTS a hash of the whole
/// table, kept for every later reclamation of the session: one idle key deleted read every lease
/// and every parked job.
#[tokio::test]
async fn reclaiming_one_idle_key_after_a_large_reclamation_reads_only_that_keys_leases_and_parked_jobs() {
    let (db, client) = setup(1).await;
    running_and_parked(&client, 0..2_000).await;
    let idle = async |from: i64, to: i64| {
        sqlx::query(
            "INSERT INTO lockgate.semaphores (key, lim, value, updated_at)
             SELECT 'idle:' || g, 1, 0, now() - interval '1 day' FROM generate_series($1::bigint, $2::bigint) g",
        )
        .bind(from)
        .bind(to)
        .execute(&db.pool)
        .await
        .unwrap();
    };
    idle(1, 500).await;
    sqlx::query("ANALYZE lockgate.semaphores, lockgate.leases, lockgate.parked").execute(&db.pool).await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let reclaim_on = async |conn: &mut sqlx::PgConnection| -> i32 {
        sqlx::query_scalar("SELECT lockgate.reclaim_idle_keys('0 seconds')").fetch_one(conn).await.unwrap()
    };
    assert_eq!(reclaim_on(&mut conn).await, 500);
    idle(501, 501).await;
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    assert_eq!(reclaim_on(&mut tx).await, 1);
    let reads = common::reads(&mut tx, &["lockgate.leases", "lockgate.parked"]).await;
    tx.commit().await.unwrap();
    assert!(reads.iter().all(|(_, scans, rows)| *scans == 0 && *rows < 50), "rows read: {reads:?}");
    assert_invariants(&db).await;
}

#[tokio::test]
async fn h16_a_parked_job_whose_type_no_longer_resolves_is_dead_lettered_not_promoted() {
    let (db, client) = setup(1).await;
    enqueue(&client, 1, 1).await;
    let waiting = enqueue(&client, 1, 2).await;
    let holder = claim_one(&db).await;
    sqlx::query("DELETE FROM lockgate.job_types WHERE name = $1").bind(TYPE).execute(&db.pool).await.unwrap();
    assert_eq!(complete(&db, &holder).await, ArchiveOutcome::Archived);
    assert!(message_of(&db, waiting.job_id.0).await.is_none(), "not promoted under a guessed limit");
    let (reason, error): (String, String) =
        sqlx::query_as("SELECT reason, error FROM lockgate.dead_letters WHERE job_id = $1")
            .bind(waiting.job_id.0)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reason, "unknown_job_type");
    assert!(error.contains("never promoted under a guessed limit"), "{error}");
    assert_eq!(value(&db, 1).await, 0);
    assert_invariants(&db).await;
}

#[tokio::test]
async fn g3_a_delivery_whose_lease_lapsed_takes_a_permit_again_or_parks_instead_of_running() {
    let (db, client) = setup(1).await;
    let first = enqueue(&client, 1, 1).await;
    let stale = claim_one(&db).await;
    // The holder went silent: its lease expires and the sweep frees the permit for another job.
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second'").execute(&db.pool).await.unwrap();
    assert_eq!(sweep(&db.pool, 10, None).await.unwrap().expired, 1);
    let second = enqueue(&client, 1, 2).await;
    assert_eq!(second.status, EnqueueStatus::Enqueued, "the freed permit went to a new job");
    // The silent holder's heartbeat can no longer renew it.
    let renewed =
        lockgate::sql::extend(&db.pool, &stale.queue, &[(stale.msg_id, stale.read_ct)], Duration::from_secs(30), None)
            .await
            .unwrap();
    assert_eq!(renewed, lockgate::sql::Renewal::default(), "a delivery without its lease is reported lost");
    // Its message is redelivered: the key is full, so it parks instead of running.
    db.expire_visibility("default", stale.msg_id).await.unwrap();
    let claims = claim(&db.pool, &stale.queue, 10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(claims.iter().map(|c| c.msg_id).collect::<Vec<_>>(), vec![second.msg_id.unwrap()]);
    assert_eq!(parked(&db).await, 1, "the lapsed job waits for a permit");
    assert!(message_of(&db, first.job_id.0).await.is_none());
    assert_eq!(complete(&db, &stale).await, ArchiveOutcome::AlreadyArchived, "the stale holder changes nothing");
    assert_invariants(&db).await;
}

#[tokio::test]
async fn discard_and_raise_keys_refuse_from_sql_and_from_rust() {
    let (db, client) = setup_with(1, OnConflict::Discard, Duration::from_secs(60)).await;
    enqueue(&client, 1, 1).await;
    let discarded = enqueue(&client, 1, 2).await;
    assert_eq!((discarded.status, discarded.msg_id), (EnqueueStatus::Discarded, None));
    let status: String = sqlx::query_scalar("SELECT status FROM lockgate.enqueue('limited', '{\"account\": 1}')")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "discarded");
    assert_eq!((parked(&db).await, value(&db, 1).await), (0, 1));

    let mut policy = JobPolicy::on_queue(common::queue("default"));
    policy.concurrency = Some(ConcurrencyPolicy { on_conflict: OnConflict::Raise, ..ConcurrencyPolicy::new(1) });
    client.define_job_type(&JobTypeName::new("strict").unwrap(), &policy).await.unwrap();
    client.enqueue_raw("strict", &json!({}), &EnqueueOptions::default()).await.unwrap();
    let err = client.enqueue_raw("strict", &json!({}), &EnqueueOptions::default()).await.unwrap_err();
    assert!(matches!(&err, EnqueueError::LimitReached { key } if key == "strict"), "{err:?}");
    assert_eq!(err.to_string(), "concurrency limit reached for key \"strict\"");
    let err = sqlx::query("SELECT * FROM lockgate.enqueue('strict', '{}')").execute(&db.pool).await.unwrap_err();
    assert_eq!(err.as_database_error().and_then(|e| e.code()).as_deref(), Some("LG004"));
    assert_eq!(db.count("SELECT 1 FROM lockgate.leases WHERE key = 'strict'").await.unwrap(), 1);
    assert_invariants(&db).await;
}

async fn redefine(client: &Client, concurrency: Option<ConcurrencyPolicy>) {
    let mut policy = JobPolicy::on_queue(common::queue("default"));
    policy.concurrency = concurrency;
    client.define_job_type(&JobTypeName::new(TYPE).unwrap(), &policy).await.unwrap();
}

#[tokio::test]
async fn a_raised_limit_frees_room_for_parked_jobs_at_the_next_sweep() {
    let (db, client) = setup(1).await;
    enqueue(&client, 1, 1).await;
    let waiting = enqueue(&client, 1, 2).await;
    let raised = ConcurrencyPolicy { key: vec!["account".into()], ..ConcurrencyPolicy::new(2) };
    redefine(&client, Some(raised)).await;
    assert_eq!(sweep(&db.pool, 10, None).await.unwrap().promoted, 1);
    assert!(message_of(&db, waiting.job_id.0).await.is_some());
    assert_eq!(value(&db, 1).await, 2);
    assert_invariants(&db).await;
}

#[tokio::test]
async fn a_removed_limit_lets_parked_jobs_run_unlimited_and_their_heartbeat_holds() {
    let (db, client) = setup(1).await;
    enqueue(&client, 1, 1).await;
    let waiting = enqueue(&client, 1, 2).await;
    redefine(&client, None).await;
    assert_eq!(sweep(&db.pool, 10, None).await.unwrap().promoted, 1);
    let (msg_id, _) = message_of(&db, waiting.job_id.0).await.expect("promoted");
    let claims = claim(&db.pool, &common::queue("default"), 10, Duration::from_secs(30)).await.unwrap();
    let c = claims.iter().find(|c| c.msg_id == msg_id).expect("claimed");
    let renewed = lockgate::sql::extend(&db.pool, &c.queue, &[(c.msg_id, c.read_ct)], Duration::from_secs(30), None)
        .await
        .unwrap();
    assert_eq!(
        renewed.renewed.iter().map(|r| r.0).collect::<Vec<_>>(),
        vec![msg_id],
        "an unlimited job is not reported lost for lack of a lease"
    );
    assert_invariants(&db).await;
}

/// Completes every message of the default queue that is visible now, in one fenced statement.
async fn complete_all_visible(db: &TestDb) -> usize {
    let claims = claim(&db.pool, &common::queue("default"), 1000, Duration::from_secs(30)).await.unwrap();
    let tokens: Vec<(i64, i32)> = claims.iter().map(|c| (c.msg_id, c.read_ct)).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let outcomes = complete_deliveries(&db.pool, &common::queue("default"), &tokens, deadline).await;
    assert!(outcomes.iter().all(|o| *o == Ok(ArchiveOutcome::Archived)), "{outcomes:?}");
    claims.len()
}

#[tokio::test]
async fn one_completion_promotes_each_released_key_in_priority_order_up_to_its_current_limit() {
    let (db, client) = setup(1).await;
    // Ten keys, each with a holder and three parked jobs; key 0's parked jobs come in reverse
    // priority, so its best-priority one (enqueued last) must be promoted first.
    for account in 0..10 {
        for n in 0..4 {
            let options =
                EnqueueOptions { priority: Some(if account == 0 { 3 - n } else { 0 } as i16), ..Default::default() };
            client.enqueue_raw(TYPE, &json!({ "account": account, "n": n }), &options).await.unwrap();
        }
    }
    assert_eq!(parked(&db).await, 30);
    // Key 1's limit rises to 3 before its holder finishes: its release promotes three at once.
    sqlx::query("UPDATE lockgate.job_types SET concurrency_limit = 3 WHERE name = $1")
        .bind(TYPE)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(complete_all_visible(&db).await, 10, "one holder per key");
    // Every key had room for three now: all thirty parked jobs were promoted by that completion.
    assert_eq!(parked(&db).await, 0);
    for account in 0..10 {
        assert_eq!(value(&db, account).await, 3, "key {account}");
    }
    let first_of_key0: i64 = sqlx::query_scalar(
        "SELECT (message->>'n')::bigint FROM pgmq.q_default WHERE message->>'account' = '0' ORDER BY msg_id LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(first_of_key0, 3, "the best priority is sent first");
    assert_invariants(&db).await;
}

/// Issue 14: a completion that hands its permit to the key's next parked job gives one back and
/// takes one, so the key's semaphore row is left as it is (it stays locked by the completion,
/// which is what orders every other path): one write less per limited job in a drain. The
/// completion that leaves the key idle writes it, value 0 and a fresh updated_at, which is what
/// idle-key reclamation reads.
#[tokio::test]
async fn a_key_handing_its_permit_to_its_next_parked_job_leaves_its_semaphore_row_unwritten() {
    let (db, client) = setup(1).await;
    enqueue(&client, 1, 1).await;
    assert_eq!(enqueue(&client, 1, 2).await.status, EnqueueStatus::Parked);
    let version = || async {
        sqlx::query_as::<_, (String, i32, chrono::DateTime<chrono::Utc>)>(
            "SELECT xmin::text, value, updated_at FROM lockgate.semaphores WHERE key = $1",
        )
        .bind(key(1))
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    let before = version().await;
    let first = claim_one(&db).await;
    assert_eq!(complete(&db, &first).await, ArchiveOutcome::Archived);
    assert_eq!(parked(&db).await, 0, "the parked job was promoted");
    assert_eq!(version().await, before, "the row was written although nothing in it changed");
    assert_invariants(&db).await;

    let second = claim_one(&db).await;
    assert_eq!(complete(&db, &second).await, ArchiveOutcome::Archived);
    let after = version().await;
    assert_ne!(after.0, before.0, "the key's last permit was given back without writing its row");
    assert_eq!(after.1, 0);
    assert!(after.2 > before.2, "updated_at did not move when the key went idle");
    assert_invariants(&db).await;
}

/// Types that share a key: a job is admitted under the strictest limit among the key's
/// holders, not only its own type's (design §109; before it, a limit-2 job started beside a
/// limit-1 holder). tests/shared_keys.rs takes every path that admits one.
#[tokio::test]
async fn a_key_shared_by_two_types_admits_no_job_beside_a_holder_of_the_stricter_type() {
    let (db, client) = setup(1).await;
    let mut policy = JobPolicy::on_queue(common::queue("default"));
    policy.concurrency = Some(ConcurrencyPolicy::new(2));
    client.define_job_type(&JobTypeName::new("wide").unwrap(), &policy).await.unwrap();
    let shared = EnqueueOptions { concurrency_key: Some("shared".into()), ..Default::default() };
    let holder = client.enqueue_raw(TYPE, &json!({ "account": 1 }), &shared).await.unwrap();
    let narrow = client.enqueue_raw(TYPE, &json!({ "account": 1 }), &shared).await.unwrap();
    let wide = client.enqueue_raw("wide", &json!({}), &shared).await.unwrap();
    assert_eq!((holder.status, narrow.status), (EnqueueStatus::Enqueued, EnqueueStatus::Parked));
    // The key has 1 of the limit-2 type's permits taken, but its holder's limit is 1.
    assert_eq!(wide.status, EnqueueStatus::Parked);
    complete_all_visible(&db).await;
    // The holder released; the limit-1 job is promoted, alone: the limit-2 job still waits.
    assert_eq!(parked(&db).await, 1);
    assert!(message_of(&db, narrow.job_id.0).await.is_some());
    assert!(message_of(&db, wide.job_id.0).await.is_none());
    let value: i32 = sqlx::query_scalar("SELECT value FROM lockgate.semaphores WHERE key = 'shared'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(value, 1);
    assert_invariants(&db).await;
    complete_all_visible(&db).await;
    assert_eq!(parked(&db).await, 0);
    assert!(message_of(&db, wide.job_id.0).await.is_some());
    assert_invariants(&db).await;
}

/// A completion that fills its key's room with jobs of the next job's type looks again when the
/// job behind them is of another type with a higher limit: the closing pass of `_promote_keys`
/// promotes it (a test of that pass; design §61 measured skipping it for keys that cannot need
/// it, and did not keep it), under the limit of the job just promoted, whose lease is not
/// written yet (design §109).
#[tokio::test]
async fn room_left_by_a_promotion_goes_to_the_next_job_of_another_type_sharing_the_key() {
    let (db, client) = setup(1).await;
    for (name, limit) in [("wide", 2), ("wider", 3)] {
        let mut policy = JobPolicy::on_queue(common::queue("default"));
        policy.concurrency = Some(ConcurrencyPolicy::new(limit));
        client.define_job_type(&JobTypeName::new(name).unwrap(), &policy).await.unwrap();
    }
    let shared = EnqueueOptions { concurrency_key: Some("shared".into()), ..Default::default() };
    let statuses = [
        client.enqueue_raw("wide", &json!({}), &shared).await.unwrap().status,
        client.enqueue_raw("wide", &json!({}), &shared).await.unwrap().status,
    ];
    assert_eq!(statuses, [EnqueueStatus::Enqueued, EnqueueStatus::Enqueued]);
    let next = client.enqueue_raw("wide", &json!({}), &shared).await.unwrap();
    let wider = client.enqueue_raw("wider", &json!({}), &shared).await.unwrap();
    assert_eq!((next.status, wider.status), (EnqueueStatus::Parked, EnqueueStatus::Parked));
    // Both holders finish in one completion: the limit-2 job takes one permit, and the limit-3
    // job behind it the second (2 of the limit-2 job's 2).
    assert_eq!(complete_all_visible(&db).await, 2);
    assert_eq!(parked(&db).await, 0, "both parked jobs promoted");
    assert!(message_of(&db, next.job_id.0).await.is_some());
    assert!(message_of(&db, wider.job_id.0).await.is_some());
    let value: i32 = sqlx::query_scalar("SELECT value FROM lockgate.semaphores WHERE key = 'shared'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(value, 2);
    assert_invariants(&db).await;
}

#[tokio::test]
async fn a_parked_job_whose_queue_is_gone_is_dead_lettered_and_the_next_one_promoted() {
    let (db, client) = setup(1).await;
    sqlx::query("SELECT lockgate.create_queue('doomed')").execute(&db.pool).await.unwrap();
    enqueue(&client, 1, 1).await;
    let to_doomed = EnqueueOptions { queue: Some(common::queue("doomed")), ..Default::default() };
    let lost = client.enqueue_raw(TYPE, &json!({ "account": 1, "n": 2 }), &to_doomed).await.unwrap();
    let next = enqueue(&client, 1, 3).await;
    assert_eq!(parked(&db).await, 2);
    sqlx::query("DELETE FROM lockgate.queues WHERE name = 'doomed'").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT pgmq.drop_queue('doomed')").execute(&db.pool).await.unwrap();
    assert_eq!(complete_all_visible(&db).await, 1);
    let reason: String = sqlx::query_scalar("SELECT error FROM lockgate.dead_letters WHERE job_id = $1")
        .bind(lost.job_id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(reason.contains("queue \"doomed\" no longer exists"), "{reason}");
    assert!(message_of(&db, next.job_id.0).await.is_some(), "the next parked job runs");
    assert_eq!((parked(&db).await, value(&db, 1).await), (0, 1));
    assert_invariants(&db).await;
}

#[tokio::test]
async fn two_completions_racing_on_one_key_each_promote_against_the_others_commit() {
    // Two holders of a limit-2 key and two parked jobs; the completer may run two statements at
    // once, so both holders can finish in racing transactions.
    let (db, client) = setup(2).await;
    for n in 0..4 {
        enqueue(&client, 1, n).await;
    }
    let holders = claim(&db.pool, &common::queue("default"), 10, Duration::from_secs(30)).await.unwrap();
    assert_eq!((holders.len(), parked(&db).await), (2, 2));
    // The first completion promotes a job and holds the key's row until it commits.
    let mut first = db.pool.begin().await.unwrap();
    sqlx::query("SELECT lockgate.complete('default', ARRAY[$1::bigint], ARRAY[$2::integer])")
        .bind(holders[0].msg_id)
        .bind(holders[0].read_ct)
        .execute(&mut *first)
        .await
        .unwrap();
    // The second one finds the row held past its retries: it archives its job without waiting,
    // and leaves the permit, on a lease marked finished, to the sweep.
    assert_eq!(complete_without_waiting(&db, &holders[1]).await, ArchiveOutcome::Archived);
    first.commit().await.unwrap();
    assert_eq!((value(&db, 1).await, parked(&db).await, finished_leases(&db).await), (2, 1, 1));
    // The sweep judges room on the first one's committed take: one more promotion, no more.
    assert_eq!(sweep(&db.pool, 1000, None).await.unwrap().promoted, 1);
    assert_eq!((value(&db, 1).await, parked(&db).await, finished_leases(&db).await), (2, 0, 0));
    assert_invariants(&db).await;
}

#[tokio::test]
async fn a_completion_promotes_from_the_head_of_each_key_even_without_planner_statistics() {
    let (db, client) = setup(1).await;
    // 100 keys with 40 jobs each: one holder and 39 parked per key. Nothing is analyzed, as on a
    // fresh database before autovacuum has looked at the tables.
    for round in 0..40 {
        let args: Vec<_> = (0..100).map(|account| json!({ "account": account, "n": round })).collect();
        client.enqueue_many_raw(TYPE, &args, &EnqueueOptions::default()).await.unwrap();
    }
    assert_eq!(parked(&db).await, 3_900);
    let claims = claim(&db.pool, &common::queue("default"), 1000, Duration::from_secs(30)).await.unwrap();
    assert_eq!(claims.len(), 100);
    let ids: Vec<i64> = claims.iter().map(|c| c.msg_id).collect();
    let cts: Vec<i32> = claims.iter().map(|c| c.read_ct).collect();

    let mut tx = db.pool.begin().await.unwrap();
    let before = common::rows_read(&mut tx, "lockgate.parked").await;
    let archived: Vec<i64> = sqlx::query_scalar("SELECT lockgate.complete('default', $1, $2)")
        .bind(&ids)
        .bind(&cts)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let read = common::rows_read(&mut tx, "lockgate.parked").await - before;
    tx.commit().await.unwrap();
    assert_eq!(archived.len(), 100);
    assert_eq!(parked(&db).await, 3_800, "one promotion per key");
    // The next parked job of a key is its first in the key's index. A plan that reads all 39 of
    // them and sorts would read about 4,000 rows here.
    assert!(read < 1_000, "promoting 100 jobs read {read} parked rows");
    assert_invariants(&db).await;
}

/// Issue 14 (docs/design.md §59): a completion sends the jobs it promotes through the queue's
/// promotion step, planned once per session, only when lockgate wrote that step. With the step
/// dropped and a function of another role planted under its name, a completion promotes the next
/// parked job by planning the statement itself, and the planted function never runs; with the
/// step written again, the next completion promotes through it.
#[tokio::test]
async fn a_promotion_runs_no_promotion_step_but_lockgates() {
    let (db, client) = setup(1).await;
    let first = enqueue(&client, 1, 1).await;
    let second = enqueue(&client, 1, 2).await;
    let third = enqueue(&client, 1, 3).await;
    assert_eq!((second.status, third.status), (EnqueueStatus::Parked, EnqueueStatus::Parked));
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let other = format!("{}_other", db.name);
    sqlx::raw_sql(&format!(
        "DROP FUNCTION lockgate._promote_into_default(lockgate.promotion[], text);
         CREATE ROLE {other} NOLOGIN; GRANT USAGE, CREATE ON SCHEMA lockgate TO {other};
         CREATE TABLE public.planted_ran (n integer); GRANT INSERT ON public.planted_ran TO PUBLIC;
         SET LOCAL ROLE {other};
         CREATE FUNCTION lockgate._promote_into_default(lockgate.promotion[], text) RETURNS void
             LANGUAGE sql AS 'INSERT INTO public.planted_ran VALUES (1)';
         RESET ROLE;"
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    let leased =
        "SELECT count(*) FROM pgmq.q_default m JOIN lockgate.leases l ON l.queue = 'default' AND l.msg_id = m.msg_id
                   WHERE (m.headers->>'job_id')::bigint = $1";
    assert_eq!(claim_and_complete_on(&mut tx).await, first.msg_id.unwrap());
    let sent: i64 = sqlx::query_scalar(leased).bind(second.job_id.0).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(sent, 1, "the second job is promoted, holding a lease, without the step");
    let ran: i64 = sqlx::query_scalar("SELECT count(*) FROM public.planted_ran").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(ran, 0, "the planted function never ran");

    sqlx::query("SELECT lockgate._install_promote_steps('default')").execute(&mut *tx).await.unwrap();
    claim_and_complete_on(&mut tx).await;
    let sent: i64 = sqlx::query_scalar(leased).bind(third.job_id.0).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(sent, 1, "the third job is promoted, holding a lease");
    let through_step: Option<String> =
        sqlx::query_scalar("SELECT current_setting('lockgate.trusted_promote_into_default', true)")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    assert!(through_step.is_some_and(|oid| !oid.is_empty()), "the promotion went through the step written again");
    let ran: i64 = sqlx::query_scalar("SELECT count(*) FROM public.planted_ran").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(ran, 0, "the planted function never ran");
    tx.rollback().await.unwrap();
}

/// Issue 14 (docs/design.md §60): a completion's release and promotion statements keep one
/// generic plan per session. Made while the keys' tables were small and freshly analysed, that
/// plan read the semaphores, leases and parked jobs whole, sequentially (once per key, for the
/// parked jobs, in one run) or through an index from end to end (every semaphore, with a probe
/// of the parked jobs and job types for each); kept after they grew to thousands of keys, it did
/// so at every completion of the session. Now each table is read only at the keys and ids the
/// completion names.
#[tokio::test]
async fn a_completion_plan_made_on_few_keys_reads_only_the_keys_it_releases() {
    let (db, client) = setup(1).await;
    // Four keys, analysed; then 600 more whose leases are not (a table never analysed is
    // estimated from its size: the plan then expects a handful of leases per queue).
    running_and_parked(&client, 0..4).await;
    sqlx::query("ANALYZE lockgate.semaphores, lockgate.parked").execute(&db.pool).await.unwrap();
    running_and_parked(&client, 100..700).await;
    // This session plans the completion's statements now.
    let mut conn = db.pool.acquire().await.unwrap();
    for _ in 0..3 {
        claim_and_complete_on(&mut conn).await;
    }
    // 3,000 more keys, each with a job holding its permit and one parked behind it.
    running_and_parked(&client, 1_000..4_000).await;
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    // The oldest visible job is account 3's first: its completion promotes its second.
    claim_and_complete_on(&mut tx).await;
    // One lease deleted and one parked job moved, a few rows looked at.
    let reads =
        common::reads(&mut tx, &["lockgate.semaphores", "lockgate.leases", "lockgate.parked", "lockgate.job_types"])
            .await;
    // The job types, a handful of rows, may be read whole.
    assert!(
        reads.iter().all(|(t, scans, _)| *scans == 0 || t == "lockgate.job_types"),
        "sequential scans by the completion: {reads:?}"
    );
    assert!(reads.iter().all(|(_, _, rows)| *rows < 50), "rows read by the completion: {reads:?}");
    tx.commit().await.unwrap();
    assert_eq!(parked(&db).await, 3_600, "account 3's second job was promoted");
    assert_invariants(&db).await;
}

/// Issue 14 (docs/design.md §61): a sweep whose plans a session made while the keys were few
/// reads, once they are thousands, only the expired leases, their keys and the few keys its
/// repair looks at. Planned on four keys, one pass at 3,600 keys read every semaphore (a
/// review counted 8,322 semaphore, 14,436 lease and 1,033 parked rows in its own run): the
/// expired leases' keys, sorted for their locks, were a walk of a whole table or index. And a
/// lease probed by key or by primary key was planned, on few leases, as a read of every expired
/// lease through the expiry index, once per lease.
#[tokio::test]
async fn a_sweep_planned_on_few_keys_reads_only_the_expired_leases_and_the_keys_it_looks_at() {
    let (db, client) = setup(1).await;
    let lapse = async |account: i64| {
        sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second' WHERE key = $1")
            .bind(key(account))
            .execute(&db.pool)
            .await
            .unwrap();
    };
    let sweep_on = async |conn: &mut sqlx::PgConnection| -> (i32, i32, i32) {
        sqlx::query_as("SELECT expired, orphaned, promoted FROM lockgate.sweep(4)").fetch_one(conn).await.unwrap()
    };
    running_and_parked(&client, 0..4).await;
    sqlx::query("ANALYZE lockgate.semaphores, lockgate.leases, lockgate.parked").execute(&db.pool).await.unwrap();
    // This session plans every statement of the sweep now: passes that expire a lease and
    // promote the job behind it, the repair's first pass over every key, then its cursor.
    let mut conn = db.pool.acquire().await.unwrap();
    for account in 0..3 {
        lapse(account).await;
        assert_eq!(sweep_on(&mut conn).await, (1, 0, 1), "account {account}'s lease expired");
    }
    // 3,600 more keys, each with a job holding its permit and one parked behind it.
    running_and_parked(&client, 1_000..4_600).await;
    // 100 holders die: accounts 3 and 1,000 to 1,098.
    for account in std::iter::once(3).chain(1_000..1_099) {
        lapse(account).await;
    }
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    assert_eq!(sweep_on(&mut tx).await, (100, 0, 100), "100 leases expired and the jobs behind them promoted");
    let reads =
        common::reads(&mut tx, &["lockgate.semaphores", "lockgate.leases", "lockgate.parked", "lockgate.job_types"])
            .await;
    tx.commit().await.unwrap();
    assert!(
        reads.iter().all(|(t, scans, _)| *scans == 0 || t == "lockgate.job_types"),
        "sequential scans by the sweep: {reads:?}"
    );
    // A few rows per expired lease and per key looked at; each table holds over 3,500.
    assert!(
        reads.iter().all(|(t, _, rows)| *rows < 1_500 || t == "lockgate.job_types"),
        "rows read by the sweep: {reads:?}"
    );
    assert_eq!(parked(&db).await, 3_501, "the jobs behind the expired leases were promoted");
    assert_invariants(&db).await;
}

/// Issue 14 (docs/design.md §60, migration 18): a lease inserted in a session whose first leases
/// went in while the keys were few reads only its own key. The lease's foreign key to its
/// semaphore row was checked by a query the server plans once per session, outside the
/// settings of lockgate's statements: planned on four analysed keys it was a sequential scan,
/// which read every semaphore at every lease inserted once there were thousands.
#[tokio::test]
async fn a_lease_inserted_after_the_keys_grew_reads_only_its_own_key() {
    let (db, client) = setup(1).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let enqueue_on = async |conn: &mut sqlx::PgConnection, account: i64, n: i64| {
        let status: String = sqlx::query_scalar(
            "SELECT status FROM lockgate.enqueue($1, jsonb_build_object('account', $2::bigint, 'n', $3::bigint))",
        )
        .bind(TYPE)
        .bind(account)
        .bind(n)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        status
    };
    for account in 0..4 {
        assert_eq!(enqueue_on(&mut conn, account, 1).await, "enqueued");
    }
    sqlx::query("ANALYZE lockgate.semaphores").execute(&db.pool).await.unwrap();
    // This session adds leases on few keys, more than five times (a statement's plan turns
    // generic after five).
    for account in 4..12 {
        assert_eq!(enqueue_on(&mut conn, account, 1).await, "enqueued");
    }
    // Account 0's next job waits behind its first.
    assert_eq!(enqueue_on(&mut conn, 0, 2).await, "parked");
    // 3,900 more keys, each with a job holding its permit, from other sessions.
    let args: Vec<serde_json::Value> = (100..4_000).map(|account| json!({ "account": account, "n": 1 })).collect();
    client.enqueue_many_raw(TYPE, &args, &EnqueueOptions::default()).await.unwrap();
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    // A lease for a new key, at enqueue; then account 0's first job completes and promotes its
    // second, with a lease of its own.
    assert_eq!(enqueue_on(&mut tx, 9_999, 1).await, "enqueued");
    claim_and_complete_on(&mut tx).await;
    let reads = common::reads(&mut tx, &["lockgate.semaphores"]).await;
    tx.commit().await.unwrap();
    assert!(reads.iter().all(|(_, scans, rows)| *scans == 0 && *rows < 50), "semaphores read: {reads:?}");
    assert_eq!(parked(&db).await, 0, "account 0's second job was promoted");
    assert_invariants(&db).await;
}

/// A completion releases its lease even when another transaction renews that lease while the
/// completion waits for it: the lease is locked at its latest version, then deleted in a statement
/// whose snapshot sees that version. Deleted by its row address in the statement that locked it,
/// the lease was passed over (the statement's snapshot predates the renewal): the job archived,
/// its permit kept until the lease ran out, and the key's next job parked behind it all that time
/// (docs/design.md §65). No lockgate path renews a lease without the message's lock, which the
/// completion holds; the renewal here is by hand, as a future path's would be.
#[tokio::test]
async fn g2_a_lease_renewed_while_its_completion_waits_for_it_is_still_released() {
    let (db, client) = setup(1).await;
    enqueue(&client, 1, 1).await;
    enqueue(&client, 1, 2).await;
    let holder = claim_one(&db).await;
    let mut renewal = db.pool.begin().await.unwrap();
    sqlx::query("UPDATE lockgate.leases SET expires_at = expires_at + interval '1 second' WHERE msg_id = $1")
        .bind(holder.msg_id)
        .execute(&mut *renewal)
        .await
        .unwrap();
    let completion = complete_behind_a_lock(&db, &holder).await;
    renewal.commit().await.unwrap();
    let done = completion.await.unwrap();
    assert!(matches!(done[..], [Ok(ArchiveOutcome::Archived)]), "the holder's completion: {done:?}");
    let leases: Vec<i64> = sqlx::query_scalar("SELECT msg_id FROM lockgate.leases").fetch_all(&db.pool).await.unwrap();
    assert!(!leases.contains(&holder.msg_id), "the finished job's lease is released: {leases:?}");
    assert_eq!(parked(&db).await, 0, "the key's next job was promoted");
    assert_eq!(value(&db, 1).await, 1, "its permit is the promoted job's");
    assert_invariants(&db).await;
}
