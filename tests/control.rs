//! Steering queues and jobs (issue 12): a paused queue gives no claim to any process and stays
//! paused across restarts while producers still enqueue; shutdown returns of a started run stop
//! being free after `max_shutdown_returns`, so a job that always outlives `shutdown_timeout`
//! runs out of attempts instead of cycling across deploys forever.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{queue, test_config, Counter, Running};
use lockgate::{Client, DbError, Job, JobContext, JobError, JobPolicy, Registry};
use lockgate_testkit::{wait_for, wait_for_count, TestDb};
use serde::{Deserialize, Serialize};
use sqlx::Row;

#[derive(Serialize, Deserialize)]
struct Tick {
    n: u32,
}

impl Job for Tick {
    const TYPE: &'static str = "tick";
    fn policy() -> JobPolicy {
        JobPolicy::on_queue(queue("default"))
    }
}

fn counting(ran: Counter) -> Registry {
    let mut registry = Registry::new();
    registry
        .register::<Tick, _>(move |_ctx: JobContext, _t: Tick| {
            let ran = ran.clone();
            async move {
                ran.bump();
                Ok::<(), JobError>(())
            }
        })
        .unwrap();
    registry
}

#[tokio::test]
async fn a_paused_queue_gives_no_claim_to_any_process_and_stays_paused_across_a_restart() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Tick>().await.unwrap();
    assert!(client.pause_queue(&queue("default")).await.unwrap());
    assert!(!client.pause_queue(&queue("default")).await.unwrap(), "paused already");
    for n in 0..10 {
        client.enqueue(&Tick { n }).await.unwrap();
    }
    // Counts the claims each process makes (statistics of plpgsql functions, for new sessions).
    sqlx::raw_sql(&format!("ALTER DATABASE {} SET track_functions = 'pl'", db.name)).execute(&db.pool).await.unwrap();
    let ran = Counter::default();
    let first = Running::start(&db, test_config(), counting(ran.clone()), &["default"], 4).await;
    let second = Running::start(&db, test_config(), counting(ran.clone()), &["default"], 4).await;
    // Both processes poll (every 200 ms) and each claim finds the queue paused.
    wait_for("both processes to have claimed a few times", Duration::from_secs(15), || async {
        let calls: Option<i64> = sqlx::query_scalar(
            "SELECT sum(calls)::bigint FROM pg_stat_user_functions WHERE schemaname = 'lockgate' AND funcname = 'claim'",
        )
        .fetch_one(&db.pool)
        .await?;
        let _ = sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&db.pool).await;
        Ok((calls.unwrap_or(0) >= 10).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default WHERE read_ct > 0").await.unwrap(), 0, "nothing claimed");
    assert_eq!(ran.get(), 0);
    first.stop().await;
    second.stop().await;
    let stats = lockgate::sql::queue_stats(&db.pool).await.unwrap();
    assert!(stats.iter().any(|s| s.queue == "default" && s.paused && s.ready == 10), "{stats:?}");
    // A restarted process finds it paused; resuming wakes it.
    let again = Running::start(&db, test_config(), counting(ran.clone()), &["default"], 4).await;
    assert!(client.resume_queue(&queue("default")).await.unwrap());
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 10, common::WAIT).await.unwrap();
    again.stop().await;
    assert_eq!(ran.get(), 10);
    let err = client.pause_queue(&queue("nosuch")).await.unwrap_err();
    assert!(matches!(err, DbError::UnknownQueue(ref m) if m.contains("queue \"nosuch\" does not exist")), "{err}");
}

/// The attempt a delivery is, as the worker computes it: read_ct - returns + attempts_before.
async fn attempt_of(db: &TestDb, msg_id: i64) -> i64 {
    let row = sqlx::query(
        "SELECT read_ct - COALESCE((headers->>'returns')::int, 0) + COALESCE((headers->>'attempts_before')::int, 0)
           FROM pgmq.q_default WHERE msg_id = $1",
    )
    .bind(msg_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    row.get::<i32, _>(0).into()
}

#[tokio::test]
async fn shutdown_returns_of_a_started_run_count_as_attempts_after_the_cap() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('long')").execute(&db.pool).await.unwrap();
    let msg_id: i64 =
        sqlx::query_scalar("SELECT msg_id FROM lockgate.enqueue('long')").fetch_one(&db.pool).await.unwrap();
    let mut attempts = Vec::new();
    for _ in 0..4 {
        let (id, ct): (i64, i32) = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        attempts.push(attempt_of(&db, id).await);
        // Cap 2: the first two returns are free, the next ones are attempts.
        sqlx::query("SELECT lockgate.release('default', ARRAY[$1::bigint], ARRAY[$2::int], 2)")
            .bind(id)
            .bind(ct)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    assert_eq!(attempts, vec![1, 1, 1, 2], "the third return was the first one charged");
    assert_eq!(attempt_of(&db, msg_id).await + 1, 3, "and so was the fourth: the next run is attempt 3");
    // The charged returns are in the job's history, as interrupted attempts 1 and 2.
    let (_, _, outcomes) = job_state(&db, msg_id).await;
    assert_eq!(outcomes, "interrupted interrupted");
    let job = lockgate::sql::job(&db.pool, lockgate::JobId(msg_id)).await.unwrap().unwrap();
    let numbers: Vec<i64> = job.attempts.as_array().unwrap().iter().filter_map(|a| a["attempt"].as_i64()).collect();
    assert_eq!(numbers, vec![1, 2]);
    // A delivery claimed ahead and never started is always a free return.
    let (id, ct): (i64, i32) =
        sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30, start_now => 0)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    sqlx::query("SELECT lockgate.release('default', ARRAY[$1::bigint], ARRAY[$2::int], 2)")
        .bind(id)
        .bind(ct)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempt_of(&db, msg_id).await + 1, 3, "unchanged by a return of a run that never started");
}

#[tokio::test]
async fn a_release_retried_after_a_lost_reply_counts_the_return_once() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('long')").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('long')").execute(&db.pool).await.unwrap();
    let (id, ct): (i64, i32) = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let release = || {
        sqlx::query_scalar::<_, i64>("SELECT * FROM lockgate.release('default', ARRAY[$1::bigint], ARRAY[$2::int], 5)")
            .bind(id)
            .bind(ct)
            .fetch_all(&db.pool)
    };
    assert_eq!(release().await.unwrap(), vec![id]);
    assert!(release().await.unwrap().is_empty(), "released already");
    let (returns, shutdown_returns): (i32, i32) =
        sqlx::query_as("SELECT (headers->>'returns')::int, (headers->>'shutdown_returns')::int FROM pgmq.q_default")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((returns, shutdown_returns), (1, 1));
    let err = sqlx::query("SELECT lockgate.release('default', ARRAY[1::bigint], ARRAY[1], -1)")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("invalid max_returns -1"), "{err}");
}

/// (state, attempt, the outcomes of its attempts) of a job as `lockgate.job` reports it.
async fn job_state(db: &TestDb, id: i64) -> (String, i32, String) {
    let job = lockgate::sql::job(&db.pool, lockgate::JobId(id)).await.unwrap().expect("the job exists");
    let outcomes: Vec<&str> =
        job.attempts.as_array().into_iter().flatten().map(|a| a["outcome"].as_str().unwrap_or("?")).collect();
    (job.state, job.attempt, outcomes.join(" "))
}

fn state(state: &str, attempt: i32, outcomes: &str) -> (String, i32, String) {
    (state.to_string(), attempt, outcomes.to_string())
}

/// An attempt whose worker died (kill -9) records no outcome; the job's history still has one
/// entry per attempt, that one shown as lost (review helper-81: `job show` left it out).
#[tokio::test]
async fn an_attempt_whose_worker_died_shows_in_the_history_as_lost() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('work')").execute(&db.pool).await.unwrap();
    let id: i64 =
        sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue('work', '{}')").fetch_one(&db.pool).await.unwrap();
    let claim = "SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30)";
    let first: (i64, i32) = sqlx::query_as(claim).fetch_one(&db.pool).await.unwrap();
    // Its worker dies: nothing more is written, and its visibility lapses.
    sqlx::query("UPDATE pgmq.q_default SET vt = now() - interval '1 second'").execute(&db.pool).await.unwrap();
    assert_eq!(job_state(&db, id).await, state("queued", 1, "lost"));
    let second: (i64, i32) = sqlx::query_as(claim).fetch_one(&db.pool).await.unwrap();
    assert_eq!((second.0, second.1), (first.0, 2));
    assert_eq!(job_state(&db, id).await, state("running", 2, "lost running"));
    sqlx::query("SELECT lockgate.complete('default', ARRAY[$1::bigint], ARRAY[2])")
        .bind(second.0)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(job_state(&db, id).await, state("succeeded", 2, "lost succeeded"));
    let job = lockgate::sql::job(&db.pool, lockgate::JobId(id)).await.unwrap().unwrap();
    assert_eq!(job.attempts[0]["attempt"], 1);
    assert!(job.attempts[0]["error"].as_str().unwrap().contains("its worker stopped"), "{}", job.attempts);

    // A delivery claimed ahead and never started is no attempt, lost or otherwise (review
    // helper-83: shown lost until the next claim counted it as a return).
    let ahead: i64 =
        sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue('work', '{}')").fetch_one(&db.pool).await.unwrap();
    let claimed: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.claim('default', 1, 30, start_now => 0)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(claimed, 1);
    sqlx::query("UPDATE pgmq.q_default SET vt = now() - interval '1 second'").execute(&db.pool).await.unwrap();
    assert_eq!(job_state(&db, ahead).await, state("queued", 1, ""));

    // A count written by hand bounds the entries shown, and never fails or stalls the listing
    // (review helper-83: attempts_before 999999999 hung it).
    sqlx::query(
        "SELECT pgmq.send('default', '{}'::jsonb, '{\"type\": \"work\", \"attempts_before\": 999999999}'::jsonb)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("SELECT count(*) FROM lockgate.claim('default', 5, 30)").execute(&db.pool).await.unwrap();
    let listed = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        lockgate::sql::jobs(&db.pool, &lockgate::JobFilter::default(), 10, None),
    )
    .await
    .expect("the listing answered")
    .unwrap();
    assert!(listed.iter().all(|j| j.attempts.as_array().is_some_and(|a| a.len() <= 101)), "{listed:?}");
}

/// The attempt numbers of a job's history, in the order shown.
async fn attempt_numbers(db: &TestDb, id: i64) -> Vec<i64> {
    let job = lockgate::sql::job(&db.pool, lockgate::JobId(id)).await.unwrap().expect("the job exists");
    job.attempts.as_array().into_iter().flatten().map(|a| a["attempt"].as_i64().unwrap_or(-1)).collect()
}

/// A job of `job_type` on key "a"; its id.
async fn enqueue_on_a(db: &TestDb, job_type: &str) -> i64 {
    sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue($1, '{\"k\": \"a\"}')")
        .bind(job_type)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// One delivery of the default queue, if any is visible.
async fn claim_one(db: &TestDb) -> Option<(i64, i32)> {
    sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30)")
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

/// Its worker dies: the visibility of the default queue's messages lapses (leases stay live).
async fn lapse(db: &TestDb) {
    sqlx::query("UPDATE pgmq.q_default SET vt = now() - interval '1 second'").execute(&db.pool).await.unwrap();
}

/// Delivery `d` fails attempt `attempt` with `error`, retried at once.
async fn fail_and_retry(db: &TestDb, d: (i64, i32), error: &str, attempt: i32) {
    sqlx::query("SELECT lockgate.retry('default', $1, $2, 0, $3, $4)")
        .bind(d.0)
        .bind(d.1)
        .bind(error)
        .bind(attempt)
        .execute(&db.pool)
        .await
        .unwrap();
}

/// Delivery `d` is dead-lettered as the worker does when attempts run out, naming `attempts`.
async fn dead_letter_exhausted(db: &TestDb, d: (i64, i32), error: &str, attempts: i32) {
    sqlx::query("SELECT lockgate.dead_letter('default', $1, $2, 'attempts_exhausted', $3, $4)")
        .bind(d.0)
        .bind(d.1)
        .bind(error)
        .bind(attempts)
        .execute(&db.pool)
        .await
        .unwrap();
}

/// A lost attempt (its worker killed) is told by its message's read_ct. It stays in the history
/// when the job leaves its queue table: dead-lettered with its attempts exhausted, parked again
/// at claim behind its key (review helper-84, F4). After a dead-letter retry the attempts are
/// numbered from 1 again: the new life's lost attempt 1 is not taken for the old life's, on its
/// message or once parked, and each life's entries keep their order (review helper-87).
#[tokio::test]
async fn lost_attempts_stay_in_the_history_through_dead_letter_dlq_retry_and_parking() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query(
        "SELECT lockgate.define_job_type('lim', concurrency_limit => 1, concurrency_key => array['k'], max_attempts => 3)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let id = enqueue_on_a(&db, "lim").await;

    // The first life: attempt 1 fails, 2 is lost, 3 fails and is the last.
    let (m, ct) = claim_one(&db).await.unwrap();
    fail_and_retry(&db, (m, ct), "first failure", 1).await;
    claim_one(&db).await.unwrap();
    lapse(&db).await;
    assert_eq!(job_state(&db, id).await, state("queued", 2, "failed lost"));
    let (m, ct) = claim_one(&db).await.unwrap();
    dead_letter_exhausted(&db, (m, ct), "third failure", 3).await;
    assert_eq!(job_state(&db, id).await, state("dead", 3, "failed lost failed"));

    // The second life: attempt 1 is lost.
    sqlx::query("SELECT * FROM lockgate.dlq_retry()").execute(&db.pool).await.unwrap();
    claim_one(&db).await.unwrap();
    lapse(&db).await;
    assert_eq!(job_state(&db, id).await, state("queued", 1, "failed lost failed lost"));
    assert_eq!(attempt_numbers(&db, id).await, [1, 2, 3, 1]);

    // Its lease lapses too, and the sweep gives its permit to another job of the key: its next
    // claim parks it behind that job, and the lost attempt goes with it.
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second'").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.sweep()").execute(&db.pool).await.unwrap();
    let other = enqueue_on_a(&db, "lim").await;
    assert_eq!(job_state(&db, other).await.0, "queued", "the other job took the key's permit");
    let _ = claim_one(&db).await;
    assert_eq!(job_state(&db, id).await.0, "parked");
    assert_eq!(job_state(&db, id).await.2, "failed lost failed lost");
    assert_eq!(attempt_numbers(&db, id).await, [1, 2, 3, 1]);

    // Promoted when the other job ends, it runs attempt 2 and succeeds: one entry per attempt.
    let delivered: Option<(i64, i32)> =
        sqlx::query_as("SELECT msg_id, read_ct FROM pgmq.q_default WHERE msg_id = $1 AND read_ct > 0")
            .bind(other)
            .fetch_optional(&db.pool)
            .await
            .unwrap();
    let delivery = match delivered {
        Some(delivery) => delivery,
        None => claim_one(&db).await.unwrap(),
    };
    assert_eq!(delivery.0, other);
    assert!(common::complete_default(&db.pool, delivery).await);
    let (m, ct) = claim_one(&db).await.expect("the parked job was promoted");
    assert!(common::complete_default(&db.pool, (m, ct)).await);
    assert_eq!(job_state(&db, id).await, state("succeeded", 2, "failed lost failed lost succeeded"));
    assert_eq!(attempt_numbers(&db, id).await, [1, 2, 3, 1, 2]);
}

/// Review of §86 (helper-88): one entry per attempt, whichever way the job leaves its queue
/// table. A last attempt lost and written down at a park is not written again by the dead letter
/// of the delivery past it, which never ran; a cancel writes down the lost attempts of its
/// message; and a history a build before the mark retried from the dead letters, whose two
/// lives cannot be told apart, is stored in its order, never sorted together.
#[tokio::test]
async fn each_attempt_has_one_entry_after_a_park_a_dead_letter_past_the_last_attempt_or_a_cancel() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query(
        "SELECT lockgate.define_job_type('lim', concurrency_limit => 1, concurrency_key => array['k'], max_attempts => 2)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("SELECT lockgate.define_job_type('free', max_attempts => 3)").execute(&db.pool).await.unwrap();

    // Attempt 1 fails, attempt 2 (the last) is lost, the job is parked again behind another.
    let id = enqueue_on_a(&db, "lim").await;
    let (m, ct) = claim_one(&db).await.unwrap();
    fail_and_retry(&db, (m, ct), "first failure", 1).await;
    claim_one(&db).await.unwrap();
    lapse(&db).await;
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second'").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.sweep()").execute(&db.pool).await.unwrap();
    let other = enqueue_on_a(&db, "lim").await;
    let first = claim_one(&db).await;
    assert_eq!(job_state(&db, id).await.0, "parked");
    let other_delivery = match first {
        Some(delivery) if delivery.0 == other => delivery,
        _ => claim_one(&db).await.unwrap(),
    };
    assert!(common::complete_default(&db.pool, other_delivery).await);
    // Promoted, its next delivery would be attempt 3 of 2: the worker dead-letters it unrun.
    let past = claim_one(&db).await.expect("the parked job was promoted");
    let error = "delivery would be attempt 3 of 2: the previous attempt was lost (worker crash or lease loss)";
    dead_letter_exhausted(&db, past, error, 2).await;
    assert_eq!(job_state(&db, id).await, state("dead", 2, "failed lost"));
    let dead = lockgate::sql::job(&db.pool, lockgate::JobId(id)).await.unwrap().unwrap();
    assert!(dead.attempts[1]["error"].as_str().unwrap().contains("would be attempt 3 of 2"), "{}", dead.attempts);
    assert!(dead.attempts[1]["started_at"].is_null(), "the unrun delivery started nothing: {}", dead.attempts);

    // Without a park: the dead letter's entry tells of the lost last attempt, once.
    let id = enqueue_on_a(&db, "free").await;
    claim_one(&db).await.unwrap();
    lapse(&db).await;
    let (m, ct) = claim_one(&db).await.unwrap();
    fail_and_retry(&db, (m, ct), "second failure", 2).await;
    claim_one(&db).await.unwrap();
    lapse(&db).await;
    let (m, ct) = claim_one(&db).await.unwrap();
    dead_letter_exhausted(&db, (m, ct), "would be attempt 4 of 3", 3).await;
    assert_eq!(job_state(&db, id).await, state("dead", 3, "lost failed lost"));
    assert_eq!(attempt_numbers(&db, id).await, [1, 2, 3]);

    // max_attempts lowered below the attempts made: the delivery past it is dead-lettered unrun,
    // and the lost attempt before it is still written down (review helper-89).
    sqlx::query("SELECT lockgate.define_job_type('lowered', max_attempts => 3)").execute(&db.pool).await.unwrap();
    let id = enqueue_on_a(&db, "lowered").await;
    let (m, ct) = claim_one(&db).await.unwrap();
    fail_and_retry(&db, (m, ct), "first failure", 1).await;
    claim_one(&db).await.unwrap();
    lapse(&db).await;
    sqlx::query("SELECT lockgate.define_job_type('lowered', max_attempts => 1)").execute(&db.pool).await.unwrap();
    let (m, ct) = claim_one(&db).await.unwrap();
    // As a worker before this build says it: attempts => max_attempts, below those made.
    dead_letter_exhausted(&db, (m, ct), "would be attempt 3 of 1", 1).await;
    assert_eq!(job_state(&db, id).await, state("dead", 2, "failed lost"));
    assert_eq!(attempt_numbers(&db, id).await, [1, 2]);

    // A caller that names an attempt past the delivery's own records the delivery's, not
    // phantom attempts (review helper-90).
    let id = enqueue_on_a(&db, "free").await;
    let (m, ct) = claim_one(&db).await.unwrap();
    dead_letter_exhausted(&db, (m, ct), "named too high", 5).await;
    assert_eq!(job_state(&db, id).await, state("dead", 1, "failed"));

    // A cancel, queued after two lost attempts, and running after one.
    let queued = enqueue_on_a(&db, "free").await;
    for _ in 0..2 {
        claim_one(&db).await.unwrap();
        lapse(&db).await;
    }
    sqlx::query("SELECT * FROM lockgate.cancel($1)").bind(queued).execute(&db.pool).await.unwrap();
    assert_eq!(job_state(&db, queued).await, state("cancelled", 2, "lost lost"));
    let running = enqueue_on_a(&db, "free").await;
    claim_one(&db).await.unwrap();
    lapse(&db).await;
    claim_one(&db).await.unwrap();
    sqlx::query("SELECT * FROM lockgate.cancel($1)").bind(running).execute(&db.pool).await.unwrap();
    assert_eq!(job_state(&db, running).await, state("cancelled", 2, "lost cancelled"));

    // A job an earlier build retried from the dead letters: two lives, no mark.
    let old = enqueue_on_a(&db, "free").await;
    sqlx::query(
        "UPDATE pgmq.q_default SET headers = headers || jsonb_build_object('errors', \
         '[{\"attempt\": 1, \"error\": \"L1 a1\"}, {\"attempt\": 2, \"error\": \"L1 a2\"}, \
           {\"attempt\": 3, \"error\": \"L1 a3\"}]'::jsonb) WHERE msg_id = $1",
    )
    .bind(old)
    .execute(&db.pool)
    .await
    .unwrap();
    let (m, ct) = claim_one(&db).await.unwrap();
    fail_and_retry(&db, (m, ct), "L2 a1", 1).await;
    claim_one(&db).await.unwrap();
    lapse(&db).await;
    let (m, ct) = claim_one(&db).await.unwrap();
    dead_letter_exhausted(&db, (m, ct), "L2 a3", 3).await;
    let errors: Vec<String> = lockgate::sql::job(&db.pool, lockgate::JobId(old))
        .await
        .unwrap()
        .unwrap()
        .attempts
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["error"].as_str().unwrap_or("?").to_string())
        .collect();
    assert_eq!(errors, ["L1 a1", "L1 a2", "L1 a3", "L2 a1", "L2 a3"], "stored in its order");
}

#[tokio::test]
async fn a_job_keeps_its_id_and_history_through_retry_dead_letter_dlq_retry_and_success() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('flaky', max_attempts => 2)").execute(&db.pool).await.unwrap();
    let id: i64 = sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue('flaky', '{\"n\": 1}')")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let enqueued_at = lockgate::sql::job(&db.pool, lockgate::JobId(id)).await.unwrap().unwrap().enqueued_at;
    assert_eq!(job_state(&db, id).await, state("queued", 0, ""));
    let claim = |db: &TestDb| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (i64, i32)>("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30)")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let (m, ct) = claim(&db).await;
    assert_eq!(job_state(&db, id).await, state("running", 1, "running"));
    sqlx::query("SELECT lockgate.retry('default', $1, $2, 60, 'first failure', 1)")
        .bind(m)
        .bind(ct)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(job_state(&db, id).await, state("retrying", 1, "failed"));
    sqlx::query("UPDATE pgmq.q_default SET vt = now()").execute(&db.pool).await.unwrap();
    let (m, ct) = claim(&db).await;
    sqlx::query("SELECT lockgate.dead_letter('default', $1, $2, 'attempts_exhausted', 'second failure', 2)")
        .bind(m)
        .bind(ct)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(job_state(&db, id).await, state("dead", 2, "failed failed"));
    sqlx::query("SELECT * FROM lockgate.dlq_retry()").execute(&db.pool).await.unwrap();
    let again = lockgate::sql::job(&db.pool, lockgate::JobId(id)).await.unwrap().unwrap();
    assert_eq!((again.state.as_str(), again.enqueued_at), ("queued", enqueued_at), "same id, first enqueue time");
    assert_ne!(again.msg_id, Some(id), "a new message");
    let (m, ct) = claim(&db).await;
    assert!(common::complete_default(&db.pool, (m, ct)).await);
    assert_eq!(
        job_state(&db, id).await,
        state("succeeded", 1, "failed failed succeeded"),
        "its history travels with it"
    );
    let done = lockgate::sql::job(&db.pool, lockgate::JobId(id)).await.unwrap().unwrap();
    for a in done.attempts.as_array().unwrap() {
        assert!(a["started_at"].is_string() && a["ended_at"].is_string(), "every attempt has its start and end: {a}");
    }
    assert_eq!(done.attempts[0]["error"], "first failure");
    assert!(lockgate::sql::job(&db.pool, lockgate::JobId(id + 1000)).await.unwrap().is_none());
}

#[tokio::test]
async fn a_parked_job_is_found_by_its_id_before_and_after_its_promotion() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('one', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue_many('one', ARRAY['{}', '{}']::jsonb[])")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(job_state(&db, ids[1]).await.0, "parked");
    let parked_since = lockgate::sql::job(&db.pool, lockgate::JobId(ids[1])).await.unwrap().unwrap().enqueued_at;
    let (m, ct): (i64, i32) = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 5, 30)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(common::complete_default(&db.pool, (m, ct)).await);
    let promoted = lockgate::sql::job(&db.pool, lockgate::JobId(ids[1])).await.unwrap().unwrap();
    assert_eq!((promoted.state.as_str(), promoted.enqueued_at), ("queued", parked_since));
    assert!(promoted.msg_id.is_some_and(|msg| msg != ids[1]), "promoted as a new message, found by its id");
    assert_eq!(job_state(&db, ids[0]).await.0, "succeeded");
}
