//! Uniqueness (issue 11, G2, H14): a lock row per key, owned by one job, taken at enqueue
//! (until_executed) or when a run starts (while_executing), and released only by its owner's
//! fenced steps. Each test drives the public SQL API on its own database, the way psql would;
//! races are forced on two connections.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use lockgate_testkit::{wait_for, TestDb};
use sqlx::{Connection, PgConnection, PgPool, Row};

/// (msg_id, read_ct)
type Delivery = (i64, i32);

async fn db_with(types: &[&str]) -> TestDb {
    let db = TestDb::migrated().await.unwrap();
    for t in types {
        sqlx::query(&format!("SELECT lockgate.define_job_type({t})")).execute(&db.pool).await.unwrap();
    }
    db
}

/// Enqueues `job_type` with {"id": id}; returns (status, msg_id, job_id), or the error text.
async fn enqueue(db: impl sqlx::PgExecutor<'_>, job_type: &str, id: i64) -> Result<(String, Option<i64>, i64), String> {
    sqlx::query("SELECT status, msg_id, job_id FROM lockgate.enqueue($1, jsonb_build_object('id', $2::bigint))")
        .bind(job_type)
        .bind(id)
        .fetch_one(db)
        .await
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .map_err(|e| e.to_string())
}

async fn claim(db: &PgPool, qty: i32) -> Vec<Delivery> {
    sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', $1, 30)")
        .bind(qty)
        .fetch_all(db)
        .await
        .unwrap()
}

async fn retry(db: &PgPool, d: Delivery, delay: f64) -> bool {
    sqlx::query_scalar("SELECT lockgate.retry('default', $1, $2, $3, 'failed', $2)")
        .bind(d.0)
        .bind(d.1)
        .bind(delay)
        .fetch_one(db)
        .await
        .unwrap()
}

/// The lock rows: (key, job_id, msg_id).
async fn locks(db: &PgPool) -> Vec<(String, i64, Option<i64>)> {
    sqlx::query_as("SELECT key, job_id, msg_id FROM lockgate.unique_locks ORDER BY key").fetch_all(db).await.unwrap()
}

async fn make_visible(db: &PgPool, msg_id: i64) {
    sqlx::query("UPDATE pgmq.q_default SET vt = now() - interval '1 second' WHERE msg_id = $1")
        .bind(msg_id)
        .execute(db)
        .await
        .unwrap();
}

#[tokio::test]
async fn h14_a_stale_delivery_of_a_finished_job_never_releases_its_successors_lock() {
    let db = db_with(&["'w', unique_mode => 'while_executing', unique_key => array['id']"]).await;
    let (_, a, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    let (_, b, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    let a1 = claim(&db.pool, 1).await;
    assert_eq!(a1, vec![(a.unwrap(), 1)], "A runs first and takes the key");
    // A's lease is lost: its message is delivered again (A2) while A1 still runs.
    make_visible(&db.pool, a.unwrap()).await;
    let a2 = claim(&db.pool, 1).await;
    assert_eq!(a2, vec![(a.unwrap(), 2)], "A's redelivery is its own job: it takes the key back");
    assert!(common::complete_default(&db.pool, a2[0]).await, "A2 wins the completion and releases A's lock");
    // B, the successor, runs and holds the key.
    make_visible(&db.pool, b.unwrap()).await;
    let b1 = claim(&db.pool, 1).await;
    assert_eq!(b1, vec![(b.unwrap(), 1)]);
    assert_eq!(locks(&db.pool).await, vec![("w:[1]".to_string(), b.unwrap(), b)]);
    // The stale A1 finishes now: every one of its steps finds its message gone.
    assert!(!common::complete_default(&db.pool, a1[0]).await);
    assert!(!retry(&db.pool, a1[0], 1.0).await);
    assert!(!common::dead_letter_default(&db.pool, a1[0]).await);
    sqlx::query("SELECT lockgate.release('default', $1, $2)")
        .bind(vec![a1[0].0])
        .bind(vec![a1[0].1])
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(locks(&db.pool).await, vec![("w:[1]".to_string(), b.unwrap(), b)], "B still holds its key");
    // So a third job of the key waits for B instead of running beside it.
    let (_, c, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    assert!(claim(&db.pool, 5).await.is_empty(), "C is put back while B runs");
    assert!(common::complete_default(&db.pool, b1[0]).await);
    make_visible(&db.pool, c.unwrap()).await;
    assert_eq!(claim(&db.pool, 5).await, vec![(c.unwrap(), 2)], "C runs once B is done (its second delivery)");
}

#[tokio::test]
async fn h14_an_until_executed_lock_survives_every_step_of_a_stale_or_duplicate_delivery() {
    let db = db_with(&["'u', unique_mode => 'until_executed', unique_key => array['id']"]).await;
    let (_, a, _) = enqueue(&db.pool, "u", 7).await.unwrap();
    let a1 = claim(&db.pool, 1).await;
    make_visible(&db.pool, a.unwrap()).await;
    let a2 = claim(&db.pool, 1).await;
    assert!(common::complete_default(&db.pool, a2[0]).await);
    let (status, b, b_job) = enqueue(&db.pool, "u", 7).await.unwrap();
    assert_eq!(status, "enqueued", "A is done: its key is free");
    // A's duplicate completion (the completer retrying after a lost reply) and its stale
    // delivery change nothing.
    assert!(!common::complete_default(&db.pool, a2[0]).await);
    assert!(!common::complete_default(&db.pool, a1[0]).await);
    assert!(!common::dead_letter_default(&db.pool, a1[0]).await);
    assert_eq!(locks(&db.pool).await, vec![("u:[7]".to_string(), b_job, b)]);
    let err = enqueue(&db.pool, "u", 7).await.unwrap_err();
    assert!(err.contains(&format!("is held by job {b_job}")), "{err}");
}

#[tokio::test]
async fn until_executed_holds_across_retries_and_is_released_by_the_dead_letter() {
    let db = db_with(&["'u', unique_mode => 'until_executed', unique_key => array['id']"]).await;
    let (_, a, a_job) = enqueue(&db.pool, "u", 1).await.unwrap();
    let first = claim(&db.pool, 1).await;
    assert!(retry(&db.pool, first[0], 0.0).await);
    let err = enqueue(&db.pool, "u", 1).await.unwrap_err();
    assert!(err.contains(&format!("held by job {a_job}")), "a retrying job keeps its key: {err}");
    let second = claim(&db.pool, 1).await;
    assert_eq!(second, vec![(a.unwrap(), 2)], "the retry of its own job is never a duplicate of itself");
    assert!(common::dead_letter_default(&db.pool, second[0]).await);
    assert!(locks(&db.pool).await.is_empty(), "a dead-lettered job is terminal: its key is free");
    let (status, _, b_job) = enqueue(&db.pool, "u", 1).await.unwrap();
    assert_eq!(status, "enqueued");
    // Retrying A from the dead letters while B holds the key leaves A where it is.
    let row = sqlx::query("SELECT status, job_id FROM lockgate.dlq_retry()").fetch_one(&db.pool).await.unwrap();
    assert_eq!((row.get::<String, _>(0), row.get::<i64, _>(1)), ("duplicate".to_string(), b_job));
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 1);
    let b = claim(&db.pool, 1).await;
    assert!(common::complete_default(&db.pool, b[0]).await);
    let row = sqlx::query("SELECT status, job_id, msg_id FROM lockgate.dlq_retry()").fetch_one(&db.pool).await.unwrap();
    assert_eq!((row.get::<String, _>(0), row.get::<i64, _>(1)), ("enqueued".to_string(), a_job));
    let new_msg: i64 = row.get(2);
    assert_eq!(locks(&db.pool).await, vec![("u:[1]".to_string(), a_job, Some(new_msg))], "A holds its key again");
    let again = claim(&db.pool, 1).await;
    assert!(common::complete_default(&db.pool, again[0]).await);
    assert!(locks(&db.pool).await.is_empty());
}

#[tokio::test]
async fn an_enqueue_racing_an_uncommitted_enqueue_of_the_same_key_waits_for_its_outcome() {
    let db = db_with(&[
        "'u', unique_mode => 'until_executed', unique_key => array['id']",
        "'d', unique_mode => 'until_executed', unique_key => array['id'], unique_on_conflict => 'discard'",
    ])
    .await;
    for (commit, job_type) in [(true, "u"), (false, "u"), (true, "d")] {
        sqlx::query("DELETE FROM lockgate.unique_locks").execute(&db.pool).await.unwrap();
        let mut first = PgConnection::connect(&db.url).await.unwrap();
        let mut tx = first.begin().await.unwrap();
        let (_, _, first_job) = enqueue(&mut *tx, job_type, 5).await.unwrap();
        let url = db.url.clone();
        let job_type_owned = job_type.to_string();
        let second = tokio::spawn(async move {
            let mut conn = PgConnection::connect(&url).await.unwrap();
            enqueue(&mut conn, &job_type_owned, 5).await
        });
        common::until_one_waits_for_a_lock(&db.pool).await;
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        let outcome = second.await.unwrap();
        match (commit, job_type) {
            (true, "u") => assert!(outcome.unwrap_err().contains(&format!("held by job {first_job}"))),
            (true, _) => assert_eq!(outcome.unwrap(), ("duplicate".to_string(), None, first_job)),
            (false, _) => assert_eq!(outcome.unwrap().0, "enqueued", "the first enqueue never happened"),
        }
        assert_eq!(locks(&db.pool).await.len(), 1);
    }
}

#[tokio::test]
async fn while_executing_lets_duplicates_queue_and_runs_them_one_at_a_time_or_discards_them() {
    let db = db_with(&[
        "'w', unique_mode => 'while_executing', unique_key => array['id']",
        "'wd', unique_mode => 'while_executing', unique_key => array['id'], unique_on_conflict => 'discard'",
    ])
    .await;
    let (_, a, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    let (_, b, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    assert!(locks(&db.pool).await.is_empty(), "no run has started: no lock");
    let running = claim(&db.pool, 5).await;
    assert_eq!(running, vec![(a.unwrap(), 1)]);
    let returns: i32 = sqlx::query_scalar("SELECT (headers->>'returns')::int FROM pgmq.q_default WHERE msg_id = $1")
        .bind(b.unwrap())
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(returns, 1, "B waited for A's run: a return, not an attempt");
    let states: Vec<(i64, String, i32)> =
        sqlx::query_as("SELECT id, state, attempt FROM lockgate.jobs(job_type => 'w') ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        states,
        vec![(a.unwrap(), "running".to_string(), 1), (b.unwrap(), "queued".to_string(), 0)],
        "B waits for its key: queued, not retrying a failed attempt (review helper-79)"
    );
    let counts: (i64, i64, i64) =
        sqlx::query_as("SELECT ready, scheduled, running FROM lockgate.queue_stats() WHERE queue = 'default'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(counts, (1, 0, 1), "lockgate status counts it so too (review helper-83)");
    // A fails: its run ends and gives the key back while it waits for its retry.
    assert!(retry(&db.pool, running[0], 30.0).await);
    let a_state: String =
        sqlx::query_scalar("SELECT state FROM lockgate.job($1)").bind(a.unwrap()).fetch_one(&db.pool).await.unwrap();
    assert_eq!(a_state, "retrying");
    assert!(locks(&db.pool).await.is_empty());
    make_visible(&db.pool, b.unwrap()).await;
    assert_eq!(claim(&db.pool, 5).await, vec![(b.unwrap(), 2)], "B runs while A waits for its retry");

    let (_, c, _) = enqueue(&db.pool, "wd", 2).await.unwrap();
    let (_, d, _) = enqueue(&db.pool, "wd", 2).await.unwrap();
    let run: Vec<(i64, i32, Option<i64>)> = sqlx::query_as(
        "SELECT msg_id, read_ct, (headers->>'duplicate_of')::bigint FROM lockgate.claim('default', 5, 30)",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        run,
        vec![(c.unwrap(), 1, None), (d.unwrap(), 1, c)],
        "D is delivered marked as a duplicate of the running C, for its worker to archive without running it"
    );
    let wd: Vec<_> = locks(&db.pool).await.into_iter().filter(|l| l.0.starts_with("wd")).collect();
    assert_eq!(wd, vec![("wd:[2]".to_string(), c.unwrap(), c)], "D took nothing");
    assert!(common::complete_default(&db.pool, (d.unwrap(), 1)).await);
}

#[tokio::test]
async fn a_parked_job_keeps_its_lock_across_promotion_and_a_job_discarded_by_its_limit_gives_it_back() {
    let db = db_with(&[
        "'lu', concurrency_limit => 1, unique_mode => 'until_executed', unique_key => array['id']",
        "'ld', concurrency_limit => 1, concurrency_on_conflict => 'discard', unique_mode => 'until_executed',
               unique_key => array['id']",
    ])
    .await;
    let (_, x, _) = enqueue(&db.pool, "lu", 1).await.unwrap();
    let (status, _, y_job) = enqueue(&db.pool, "lu", 2).await.unwrap();
    assert_eq!(status, "parked");
    assert!(locks(&db.pool).await.contains(&("lu:[2]".to_string(), y_job, None)), "a parked job keeps its key");
    assert!(enqueue(&db.pool, "lu", 2).await.unwrap_err().contains(&format!("held by job {y_job}")));
    // X finishes and promotes Y to a new message; Y's lock moves with it.
    let xs = claim(&db.pool, 1).await;
    assert_eq!(xs[0].0, x.unwrap());
    assert!(common::complete_default(&db.pool, xs[0]).await);
    let y_msg: i64 = sqlx::query_scalar("SELECT msg_id FROM pgmq.q_default WHERE headers->>'job_id' = $1::text")
        .bind(y_job)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(locks(&db.pool).await, vec![("lu:[2]".to_string(), y_job, Some(y_msg))]);
    let reaped: i32 =
        sqlx::query_scalar("SELECT lockgate.reap_unique_locks('0 seconds')").fetch_one(&db.pool).await.unwrap();
    assert_eq!(reaped, 0, "the reaper finds the promoted job");
    let ys = claim(&db.pool, 1).await;
    assert!(common::complete_default(&db.pool, ys[0]).await);
    assert!(locks(&db.pool).await.is_empty());

    enqueue(&db.pool, "ld", 1).await.unwrap();
    let (status, _, _) = enqueue(&db.pool, "ld", 2).await.unwrap();
    assert_eq!(status, "discarded");
    assert_eq!(locks(&db.pool).await.len(), 1, "the job its limit discarded gave its unique key back");
}

#[tokio::test]
async fn the_reaper_removes_only_old_locks_whose_job_is_gone() {
    let db = db_with(&[
        "'u', unique_mode => 'until_executed', unique_key => array['id']",
        "'lu', concurrency_limit => 1, unique_mode => 'until_executed', unique_key => array['id']",
    ])
    .await;
    let (_, gone, _) = enqueue(&db.pool, "u", 1).await.unwrap();
    enqueue(&db.pool, "u", 2).await.unwrap();
    enqueue(&db.pool, "lu", 3).await.unwrap();
    enqueue(&db.pool, "lu", 4).await.unwrap(); // parked
    sqlx::query("SELECT pgmq.delete('default', $1)").bind(gone.unwrap()).execute(&db.pool).await.unwrap();
    let reap = |age: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i32>("SELECT lockgate.reap_unique_locks($1::interval)")
                .bind(age)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(reap("1 hour").await, 0, "a young lock is never judged");
    assert_eq!(reap("0 seconds").await, 1, "only the lock whose message was deleted outside lockgate");
    let keys: Vec<String> = locks(&db.pool).await.into_iter().map(|l| l.0).collect();
    assert_eq!(keys, vec!["lu:[3]", "lu:[4]", "u:[2]"]);
}

#[tokio::test]
async fn bad_uniqueness_input_is_refused_with_a_clear_error() {
    let db = db_with(&["'plain'", "'u', unique_mode => 'until_executed'"]).await;
    let err = |sql: &'static str| {
        let pool = db.pool.clone();
        async move { sqlx::query(sql).execute(&pool).await.unwrap_err().to_string() }
    };
    assert!(err("SELECT lockgate.define_job_type('x', unique_mode => 'forever')")
        .await
        .contains("invalid unique mode \"forever\""));
    assert!(err(
        "SELECT lockgate.define_job_type('x', unique_mode => 'until_executed', unique_on_conflict => 'raise')"
    )
    .await
    .contains("reject or discard"));
    assert!(err("SELECT lockgate.define_job_type('x', unique_mode => 'until_executed', unique_key => array['a..b'])")
        .await
        .contains("invalid key path"));
    assert!(err("SELECT * FROM lockgate.enqueue('plain', '{}', '{\"unique_key\": \"k\"}')")
        .await
        .contains("has no uniqueness"));
    assert!(err("SELECT * FROM lockgate.enqueue('u', '{}', '{\"unique_key\": 5}')")
        .await
        .contains("invalid unique_key"));
    // An explicit key: two jobs with different arguments share it.
    sqlx::query("SELECT * FROM lockgate.enqueue('u', '{\"a\": 1}', '{\"unique_key\": \"shared\"}')")
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(err("SELECT * FROM lockgate.enqueue('u', '{\"a\": 2}', '{\"unique_key\": \"shared\"}')")
        .await
        .contains("unique key \"shared\""));
    // A key derived too long: the single enqueue says so, a call of many names the job.
    sqlx::query("SELECT lockgate.define_job_type('k', unique_mode => 'while_executing', unique_key => array['a'])")
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(err("SELECT * FROM lockgate.enqueue('k', jsonb_build_object('a', repeat('x', 600)))")
        .await
        .contains("unique key derived from the arguments is 606 characters"));
    assert!(err(
        "SELECT * FROM lockgate.enqueue_many('k', ARRAY['{\"a\": 1}'::jsonb, '{}', jsonb_build_object('a', repeat('x', 600))])"
    )
    .await
    .contains("unique key derived from job arguments #3 is 606 characters"));
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 1);
}

#[tokio::test]
async fn the_rust_api_defines_uniqueness_and_reports_a_duplicate_as_a_status_or_a_matchable_error() {
    use lockgate::{
        Client, EnqueueError, EnqueueOptions, EnqueueStatus, JobPolicy, JobTypeName, QueueName, UniqueMode,
        UniqueOnConflict, UniquePolicy,
    };
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    let mut policy = JobPolicy::on_queue(QueueName::new("default").unwrap());
    policy.unique = Some(UniquePolicy { key: vec!["id".into()], ..UniquePolicy::new(UniqueMode::UntilExecuted) });
    client.define_job_type(&JobTypeName::new("reject").unwrap(), &policy).await.unwrap();
    policy.unique.as_mut().unwrap().on_conflict = UniqueOnConflict::Discard;
    client.define_job_type(&JobTypeName::new("discard").unwrap(), &policy).await.unwrap();
    let stored = lockgate::sql::load_job_types(&db.pool).await.unwrap();
    assert_eq!(stored[0].1.unique, Some(policy.unique.clone().unwrap()), "the policy round-trips");

    let none = EnqueueOptions::default();
    let first = client.enqueue_raw("discard", &serde_json::json!({"id": 1}), &none).await.unwrap();
    let second = client.enqueue_raw("discard", &serde_json::json!({"id": 1}), &none).await.unwrap();
    assert_eq!((second.status, second.job_id, second.msg_id), (EnqueueStatus::Duplicate, first.job_id, None));

    let held = client.enqueue_raw("reject", &serde_json::json!({"id": 1}), &none).await.unwrap();
    let err = client.enqueue_raw("reject", &serde_json::json!({"id": 1}), &none).await.unwrap_err();
    match err {
        EnqueueError::Duplicate { key, job_type, holder } => {
            assert_eq!((key.as_str(), job_type.as_str(), holder), ("reject:[1]", "reject", held.job_id))
        }
        other => panic!("expected a duplicate error, got {other:?}"),
    }
    let explicit = EnqueueOptions { unique_key: Some("mine".into()), ..Default::default() };
    let a = client.enqueue_raw("discard", &serde_json::json!({"id": 2}), &explicit).await.unwrap();
    let b = client.enqueue_raw("discard", &serde_json::json!({"id": 3}), &explicit).await.unwrap();
    assert_eq!((a.status, b.status, b.job_id), (EnqueueStatus::Enqueued, EnqueueStatus::Duplicate, a.job_id));
}

#[tokio::test]
async fn a_message_sent_outside_lockgate_that_copies_a_jobs_id_never_releases_its_lock() {
    let db = db_with(&["'u', unique_mode => 'until_executed', unique_key => array['id']"]).await;
    let (_, j, j_job) = enqueue(&db.pool, "u", 1).await.unwrap();
    sqlx::query("SELECT pgmq.send('default', '{\"id\": 1}'::jsonb, jsonb_build_object('type', 'u', 'ukey', 'u:[1]', 'job_id', $1::bigint))")
        .bind(j_job)
        .execute(&db.pool)
        .await
        .unwrap();
    let claimed = claim(&db.pool, 5).await;
    let forged = claimed.iter().find(|d| Some(d.0) != j).copied().unwrap();
    assert!(common::complete_default(&db.pool, forged).await);
    assert_eq!(locks(&db.pool).await, vec![("u:[1]".to_string(), j_job, j)], "the lock is J's, on J's message");
    assert!(enqueue(&db.pool, "u", 1).await.unwrap_err().contains(&format!("held by job {j_job}")));
}

#[tokio::test]
async fn h28_a_claim_that_meets_a_while_executing_duplicate_never_waits_for_a_producer() {
    let db =
        db_with(&["'wd', unique_mode => 'while_executing', unique_on_conflict => 'discard', concurrency_limit => 5"])
            .await;
    let batch: i64 = sqlx::query_scalar("SELECT lockgate.create_batch()").fetch_one(&db.pool).await.unwrap();
    let opts = serde_json::json!({ "batch": batch });
    for _ in 0..2 {
        sqlx::query("SELECT * FROM lockgate.enqueue('wd', '{}', $1)").bind(&opts).execute(&db.pool).await.unwrap();
    }
    let first = claim(&db.pool, 1).await;
    assert_eq!(first.len(), 1);
    // A producer holds the key's semaphore row and the batch's row in an open transaction.
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('wd', '{}', $1)").bind(&opts).execute(&mut *tx).await.unwrap();
    // A claim that waited for the producer would wait until its rollback: cut it off at 3 s.
    let mut worker = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("SET statement_timeout = '3s'").execute(&mut worker).await.unwrap();
    let started = std::time::Instant::now();
    let second: Vec<(i64, Option<i64>)> =
        sqlx::query_as("SELECT msg_id, (headers->>'duplicate_of')::bigint FROM lockgate.claim('default', 1, 30)")
            .fetch_all(&mut worker)
            .await
            .expect("the claim must not wait for the producer's transaction");
    assert!(started.elapsed() < Duration::from_secs(2), "the claim waited {:?}", started.elapsed());
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].1, Some(first[0].0), "delivered as a duplicate for its worker to archive");
    tx.rollback().await.unwrap();
}

#[tokio::test]
async fn dlq_retry_resends_a_malformed_dead_letter_without_failing_the_others() {
    let db = db_with(&["'u', unique_mode => 'until_executed', unique_key => array['id']"]).await;
    sqlx::query("SELECT pgmq.send('default', '{}'::jsonb, '{\"ukey\": \"k\"}'::jsonb)")
        .execute(&db.pool)
        .await
        .unwrap();
    let (_, _, job) = enqueue(&db.pool, "u", 1).await.unwrap();
    let claimed = claim(&db.pool, 5).await;
    assert_eq!(claimed.len(), 1, "the message without a type is dead-lettered by the claim");
    assert!(common::dead_letter_default(&db.pool, claimed[0]).await);
    let rows: Vec<(String, Option<i64>)> =
        sqlx::query_as("SELECT status, job_id FROM lockgate.dlq_retry() ORDER BY job_id NULLS FIRST")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(rows, vec![("enqueued".to_string(), None), ("enqueued".to_string(), Some(job))]);
    assert_eq!(locks(&db.pool).await.len(), 1, "the well-formed job took its key again");
}

/// A job of the runtime test: while_executing, duplicates discarded, key from `id`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Reindex {
    id: u32,
}

impl lockgate::Job for Reindex {
    const TYPE: &'static str = "reindex";
    fn policy() -> lockgate::JobPolicy {
        let mut policy = lockgate::JobPolicy::on_queue(lockgate::QueueName::new("default").unwrap());
        policy.unique = Some(lockgate::UniquePolicy {
            key: vec!["id".into()],
            on_conflict: lockgate::UniqueOnConflict::Discard,
            ..lockgate::UniquePolicy::new(lockgate::UniqueMode::WhileExecuting)
        });
        policy
    }
}

#[tokio::test]
async fn a_worker_archives_a_while_executing_duplicate_without_running_it() {
    use lockgate_testkit::wait_for_count;
    let db = TestDb::migrated().await.unwrap();
    let client = lockgate::Client::new(db.pool.clone());
    client.define::<Reindex>().await.unwrap();
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut registry = lockgate::Registry::new();
    let (counter, gate) = (ran.clone(), release.clone());
    registry
        .register::<Reindex, _>(move |_ctx: lockgate::JobContext, _job: Reindex| {
            let (counter, gate) = (counter.clone(), gate.clone());
            async move {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                gate.notified().await;
                Ok::<(), lockgate::JobError>(())
            }
        })
        .unwrap();
    let none = lockgate::EnqueueOptions::default();
    client.enqueue_with(&Reindex { id: 1 }, &none).await.unwrap();
    let config = lockgate::RuntimeConfig { heartbeat_interval: Duration::from_millis(300), ..Default::default() };
    let pools = vec![lockgate::PoolConfig::new("test", vec![lockgate::QueueName::new("default").unwrap()], 4)];
    let runtime = lockgate::Runtime::new(db.new_pool(2).await.unwrap(), config, registry, pools).unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(runtime.run(shutdown.clone()));
    wait_for("the first job to run", Duration::from_secs(15), || async {
        Ok((ran.load(std::sync::atomic::Ordering::SeqCst) == 1).then_some(()))
    })
    .await
    .unwrap();
    client.enqueue_with(&Reindex { id: 1 }, &none).await.unwrap();
    wait_for_count(
        &db.pool,
        "SELECT count(*) FROM pgmq.a_default WHERE headers ? 'duplicate_of'",
        1,
        Duration::from_secs(15),
    )
    .await
    .unwrap();
    assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 1, "the duplicate never ran");
    release.notify_waiters();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 2, Duration::from_secs(15)).await.unwrap();
    shutdown.cancel();
    task.await.unwrap().unwrap();
    assert!(locks(&db.pool).await.is_empty());
}

#[tokio::test]
async fn a_job_marked_a_duplicate_by_an_earlier_delivery_runs_once_the_holder_is_done() {
    let db = db_with(&["'wd', unique_mode => 'while_executing', unique_on_conflict => 'discard'"]).await;
    let (_, a, _) = enqueue(&db.pool, "wd", 1).await.unwrap();
    let (_, b, _) = enqueue(&db.pool, "wd", 1).await.unwrap();
    let first: Vec<(i64, Option<i64>)> =
        sqlx::query_as("SELECT msg_id, (headers->>'duplicate_of')::bigint FROM lockgate.claim('default', 5, 30)")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(first, vec![(a.unwrap(), None), (b.unwrap(), a)]);
    // B's worker died before archiving it; A finishes; B is delivered again.
    assert!(common::complete_default(&db.pool, (a.unwrap(), 1)).await);
    make_visible(&db.pool, b.unwrap()).await;
    let again: Vec<(i64, Option<i64>)> =
        sqlx::query_as("SELECT msg_id, (headers->>'duplicate_of')::bigint FROM lockgate.claim('default', 5, 30)")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(again, vec![(b.unwrap(), None)], "B holds the key now: it runs, not discarded");
    assert_eq!(locks(&db.pool).await, vec![("wd".to_string(), b.unwrap(), b)]);
}

/// A key a job's type no longer takes while it runs is not waited for: a type redefined without
/// uniqueness after its jobs were enqueued runs them beside the key's holder, as a type whose
/// limit was removed runs unlimited, and a key written by hand into a raw message of a type that
/// never took one does not hold it back. Both were put back every second for as long as the key
/// was held, and for good behind a key nothing gave back (review helper-116 F1).
#[tokio::test]
async fn a_key_its_type_no_longer_takes_while_it_runs_does_not_hold_a_job_back() {
    let db = db_with(&["'we', unique_mode => 'while_executing', unique_key => ARRAY['id']", "'plain'"]).await;
    let (_, a, _) = enqueue(&db.pool, "we", 1).await.unwrap();
    let (_, b, _) = enqueue(&db.pool, "we", 1).await.unwrap();
    assert_eq!(claim(&db.pool, 5).await.len(), 1, "B waits while A holds the key");
    assert_eq!(locks(&db.pool).await, vec![("we:[1]".to_string(), a.unwrap(), a)]);

    let forged: i64 = sqlx::query_scalar(
        "SELECT pgmq.send('default', '{}'::jsonb, '{\"type\": \"plain\", \"wkey\": \"we:[1]\"}'::jsonb)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let delivered: Vec<(i64, bool)> =
        sqlx::query_as("SELECT msg_id, headers ? 'wkey' FROM lockgate.claim('default', 5, 30)")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(delivered, vec![(forged, false)], "the raw message ran, without the key it named");

    sqlx::query("SELECT lockgate.define_job_type('we')").execute(&db.pool).await.unwrap();
    make_visible(&db.pool, b.unwrap()).await;
    let delivered: Vec<(i64, bool)> =
        sqlx::query_as("SELECT msg_id, headers ? 'wkey' FROM lockgate.claim('default', 5, 30)")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(delivered, vec![(b.unwrap(), false)], "B runs once its type takes no key");
    assert_eq!(locks(&db.pool).await, vec![("we:[1]".to_string(), a.unwrap(), a)], "A's lock is A's");
    assert!(common::complete_default(&db.pool, (b.unwrap(), 2)).await);
    assert!(common::complete_default(&db.pool, (a.unwrap(), 1)).await);
    assert!(locks(&db.pool).await.is_empty());
}

/// The msg_ids a claim of queue `other` returns.
async fn claim_other(db: &PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT msg_id FROM lockgate.claim('other', 5, 30)").fetch_all(db).await.unwrap()
}

/// Ends the second that a claim put job `msg_id` of `queue` back for.
async fn put_back_over(db: &PgPool, queue: &str, msg_id: i64) {
    sqlx::query(&format!(
        "UPDATE pgmq.q_{queue} SET vt = now() - interval '1 second', headers = headers - 'retry_at' WHERE msg_id = $1"
    ))
    .bind(msg_id)
    .execute(db)
    .await
    .unwrap();
}

/// The heartbeat's renewal of queue `default`'s first delivery of msg_id: whether it was renewed.
async fn renewed(db: &PgPool, msg_id: i64) -> Vec<i64> {
    sqlx::query_scalar("SELECT msg_id FROM lockgate.extend('default', $1, ARRAY[1], 30)")
        .bind(vec![msg_id])
        .fetch_all(db)
        .await
        .unwrap()
}

/// A `while_executing` key whose holder's delivery lapsed (its worker died mid-run) goes to a
/// duplicate that asks for it, even while the holder waits in a queue no one serves; and the
/// lapsed delivery, if its worker is only late, is lost rather than renewed beside the duplicate.
/// The lock waited for the holder's own next delivery, for good in a paused queue (review
/// helper-115 F1).
#[tokio::test]
async fn a_while_executing_key_whose_holders_delivery_lapsed_goes_to_a_duplicate() {
    let db = db_with(&["'w', unique_mode => 'while_executing', unique_key => array['id']"]).await;
    sqlx::query("SELECT lockgate.create_queue('other')").execute(&db.pool).await.unwrap();
    let (_, x, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    let y: i64 =
        sqlx::query_scalar("SELECT msg_id FROM lockgate.enqueue('w', '{\"id\": 1}', '{\"queue\": \"other\"}')")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(claim(&db.pool, 1).await.len(), 1, "X runs, holding the key");
    assert!(claim_other(&db.pool).await.is_empty(), "Y waits while X's run holds the key");
    // A running holder's renewal keeps it: Y still waits.
    assert_eq!(renewed(&db.pool, x.unwrap()).await, vec![x.unwrap()]);
    put_back_over(&db.pool, "other", y).await;
    assert!(claim_other(&db.pool).await.is_empty(), "Y took the key of a live holder");

    // X's worker dies; its queue is paused, so X is not delivered again.
    sqlx::query("SELECT lockgate.pause_queue('default')").execute(&db.pool).await.unwrap();
    make_visible(&db.pool, x.unwrap()).await;
    put_back_over(&db.pool, "other", y).await;
    assert_eq!(claim_other(&db.pool).await, vec![y], "Y waited for a holder whose run had lapsed");
    assert_eq!(locks(&db.pool).await, vec![("w:[1]".to_string(), y, Some(y))]);
    assert!(renewed(&db.pool, x.unwrap()).await.is_empty(), "X's lapsed delivery was renewed beside Y's run");
}

/// What meets a running `while_executing` holder holds nothing of it (H28): neither a claim of
/// its duplicate nor a producer enqueueing an `until_executed` job under the same key, each left
/// open, keeps the holder's renewal busy or its completion waiting; and a producer never takes
/// over a lapsed holder's key (only a claim does, ending its statement with the claim's rights).
/// Judging the lapse held the holder's message until the caller's commit: a healthy holder's
/// renewals came back busy until it was lost and ran again (review helper-117 F1, F2).
#[tokio::test]
async fn what_meets_a_running_while_executing_holder_holds_nothing_of_it() {
    let db = db_with(&[
        "'w', unique_mode => 'while_executing', unique_key => array['id']",
        "'ud', unique_mode => 'until_executed', unique_on_conflict => 'discard'",
        "'ur', unique_mode => 'until_executed'",
    ])
    .await;
    let (_, x, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    let (_, y, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    let produce = "SELECT status FROM lockgate.enqueue('ud', '{}', '{\"unique_key\": \"w:[1]\"}')";
    assert_eq!(claim(&db.pool, 5).await.len(), 1, "X runs, holding the key; Y is put back");
    // Y's put-back second passes; its claim meets X and is left open.
    put_back_over(&db.pool, "default", y.unwrap()).await;
    let mut claimer = db.pool.begin().await.unwrap();
    let claimed: Vec<i64> = sqlx::query_scalar("SELECT msg_id FROM lockgate.claim('default', 5, 30)")
        .fetch_all(&mut *claimer)
        .await
        .unwrap();
    assert!(claimed.is_empty(), "the duplicate ran beside X");
    let mut producer = db.pool.begin().await.unwrap();
    let status: String = sqlx::query_scalar(produce).fetch_one(&mut *producer).await.unwrap();
    assert_eq!(status, "duplicate");
    // Both open: the holder renews and completes as if they were not there.
    let budget: Option<f64> =
        sqlx::query_scalar("SELECT budget_seconds FROM lockgate.extend('default', $1, ARRAY[1], 30)")
            .bind(vec![x.unwrap()])
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(budget.is_some(), "the holder's renewal was busy behind what met it");
    let mut worker = db.pool.acquire().await.unwrap();
    sqlx::query("SET statement_timeout = '2s'").execute(&mut *worker).await.unwrap();
    // Lapsed now, a producer still only meets a duplicate: it takes no key over (its transaction,
    // which may stay open, would hold the lapsed run's lock row, and with it that run's
    // completion and every completion batched with it: review helper-120 F1). The error of a
    // type that rejects says the holder is running.
    make_visible(&db.pool, x.unwrap()).await;
    let mut other = db.pool.begin().await.unwrap();
    assert_eq!(sqlx::query_scalar::<_, String>(produce).fetch_one(&mut *other).await.unwrap(), "duplicate");
    other.rollback().await.unwrap();
    let refused = sqlx::query("SELECT lockgate.enqueue('ur', '{}', '{\"unique_key\": \"w:[1]\"}')")
        .execute(&db.pool)
        .await
        .unwrap_err();
    let refused = refused.as_database_error().unwrap().try_downcast_ref::<sqlx::postgres::PgDatabaseError>().unwrap();
    assert_eq!(refused.code(), "LG005");
    assert!(refused.detail().is_some_and(|d| d.contains("running with the key")), "{:?}", refused.detail());
    assert_eq!(locks(&db.pool).await, vec![("w:[1]".to_string(), x.unwrap(), x)]);
    assert!(common::complete_default(&mut *worker, (x.unwrap(), 1)).await, "the completion waited");
    producer.rollback().await.unwrap();
    claimer.rollback().await.unwrap();
}

/// Review helper-120 F2 (HIGH): a duplicate's claim that judged a holder's run lapsed deleted the
/// key's lock row by its columns, and the lapsed job, delivered again meanwhile, had taken that
/// row back on the same message: its new run lost its lock and the duplicate ran beside it. The
/// window (between the judgment and the delete) is widened here by a `_end_statements` that
/// sleeps for the judging session only; the delete now goes by the row's address as judged.
#[tokio::test]
async fn a_lapsed_runs_key_taken_back_by_its_redelivery_is_not_deleted_by_a_duplicate_judging_it() {
    let db = db_with(&[
        "'w', unique_mode => 'while_executing', unique_key => array['id']",
        "'w2', queue => 'other', unique_mode => 'while_executing'",
    ])
    .await;
    let (_, x, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    let x = x.unwrap();
    assert_eq!(claim(&db.pool, 5).await.len(), 1, "X runs, holding w:[1]");
    make_visible(&db.pool, x).await;
    let y: i64 = sqlx::query_scalar("SELECT msg_id FROM lockgate.enqueue('w2', '{}', '{\"unique_key\": \"w:[1]\"}')")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    sqlx::raw_sql(
        "ALTER FUNCTION lockgate._end_statements(text[], timestamptz) RENAME TO _end_statements_at_once;
         CREATE FUNCTION lockgate._end_statements(tags text[], until timestamptz DEFAULT NULL)
         RETURNS text[] LANGUAGE plpgsql AS $$
         BEGIN
             IF current_setting('application_name') = 'slow judge' THEN
                 PERFORM pg_sleep(2);
             END IF;
             RETURN lockgate._end_statements_at_once(tags, until);
         END $$;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Y's claim judges X's run lapsed, and sleeps before it would delete X's lock row.
    let judge = tokio::spawn({
        let pool = db.pool.clone();
        async move {
            let mut conn = pool.acquire().await.unwrap();
            sqlx::query("SET application_name = 'slow judge'").execute(&mut *conn).await.unwrap();
            let claimed: Vec<i64> = sqlx::query_scalar("SELECT msg_id FROM lockgate.claim('other', 5, 30)")
                .fetch_all(&mut *conn)
                .await
                .unwrap();
            sqlx::query("RESET application_name").execute(&mut *conn).await.unwrap();
            claimed
        }
    });
    wait_for("the duplicate's claim to sleep in its judgment", common::WAIT, || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'slow judge' AND wait_event = 'PgSleep'",
        )
        .fetch_one(&db.pool)
        .await?;
        Ok((n == 1).then_some(()))
    })
    .await
    .unwrap();
    // Meanwhile X is delivered again, and its run takes its key back.
    let again = claim(&db.pool, 5).await;
    assert_eq!(again.len(), 1, "X delivered again");
    assert_eq!(judge.await.unwrap(), Vec::<i64>::new(), "Y ran beside X's second run");
    assert_eq!(locks(&db.pool).await, vec![("w:[1]".to_string(), x, Some(x))], "X's second run lost its lock");
    let put_back: bool = sqlx::query_scalar("SELECT vt > now() FROM pgmq.q_other WHERE msg_id = $1")
        .bind(y)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(put_back, "Y is put back while X runs");
}

/// Review helper-119 F4: a `while_executing` run whose worker died holds its key until its
/// visibility runs out; a producer naming that key (an `until_executed` job) judges no lapse
/// (design §105), and met a duplicate for good while the lapsed job waited in a paused queue. The
/// sweep now gives such a key back, and only such a key: a run under way, or one whose message
/// another transaction holds, keeps it.
#[tokio::test]
async fn the_sweep_gives_back_the_key_of_a_lapsed_while_executing_run_and_only_that() {
    let db = db_with(&[
        "'w', unique_mode => 'while_executing', unique_key => array['id']",
        "'ur', unique_mode => 'until_executed'",
    ])
    .await;
    let produce = |id: i64| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT status FROM lockgate.enqueue('ur', '{}', jsonb_build_object('unique_key', 'w:[' || $1 || ']'))",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
        }
    };
    let (_, x, _) = enqueue(&db.pool, "w", 1).await.unwrap();
    let (_, z, _) = enqueue(&db.pool, "w", 2).await.unwrap();
    assert_eq!(claim(&db.pool, 5).await.len(), 2, "X and Z run, holding w:[1] and w:[2]");
    sqlx::query("SELECT lockgate.pause_queue('default')").execute(&db.pool).await.unwrap();
    // X's worker died: its visibility runs out. Z is healthy.
    make_visible(&db.pool, x.unwrap()).await;
    assert!(produce(1).await.unwrap_err().to_string().contains("is held by job"), "a producer judges no lapse");
    // A sweep while X's message is held by another transaction (its completion under way) keeps
    // the key; the next gives it back.
    let mut holding = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM pgmq.q_default WHERE msg_id = $1 FOR UPDATE")
        .bind(x.unwrap())
        .execute(&mut *holding)
        .await
        .unwrap();
    sqlx::query("SELECT lockgate.sweep()").execute(&db.pool).await.unwrap();
    assert_eq!(locks(&db.pool).await.len(), 2, "the sweep took a key whose message another transaction held");
    holding.rollback().await.unwrap();
    // Nor does it wait for a queue's table locked whole (a VACUUM FULL, a purge): that queue is
    // left for a later pass (review helper-123 F1), and the rest of the sweep goes on.
    let mut locking = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE pgmq.q_default IN ACCESS EXCLUSIVE MODE").execute(&mut *locking).await.unwrap();
    let mut sweeper = db.pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '3s'").execute(&mut *sweeper).await.unwrap();
    sqlx::query("SELECT lockgate.sweep()")
        .execute(&mut *sweeper)
        .await
        .expect("the sweep waited for the queue's table");
    locking.rollback().await.unwrap();
    assert_eq!(locks(&db.pool).await.len(), 2, "a key released past a locked table");
    sqlx::query("SELECT lockgate.sweep()").execute(&db.pool).await.unwrap();
    assert_eq!(locks(&db.pool).await, vec![("w:[2]".to_string(), z.unwrap(), z)], "only the lapsed run's key goes");
    assert_eq!(produce(1).await.unwrap(), "enqueued");
    assert!(produce(2).await.is_err(), "the key of a run under way stays held");
    // X, delivered again once its queue resumes, waits for the key the producer's job holds now.
    sqlx::query("SELECT lockgate.resume_queue('default')").execute(&db.pool).await.unwrap();
    let delivered: Vec<i64> = claim(&db.pool, 5).await.iter().map(|d| d.0).collect();
    assert!(!delivered.contains(&x.unwrap()), "X ran while an until_executed job held its key: {delivered:?}");
}

/// A dead letter an operator retries is run, not discarded: of a type that discards
/// `while_executing` duplicates, it waits while another job of its key runs, where it was
/// archived unrun as that job's duplicate, its dead letter gone (review helper-115 F3).
#[tokio::test]
async fn a_retried_dead_letter_waits_for_its_key_rather_than_being_discarded() {
    let db = db_with(&[
        "'wd', unique_mode => 'while_executing', unique_key => array['id'], unique_on_conflict => 'discard'",
    ])
    .await;
    let (_, a, _) = enqueue(&db.pool, "wd", 1).await.unwrap();
    assert_eq!(claim(&db.pool, 5).await.len(), 1);
    assert!(common::dead_letter_default(&db.pool, (a.unwrap(), 1)).await);
    let (_, c, _) = enqueue(&db.pool, "wd", 1).await.unwrap();
    assert_eq!(claim(&db.pool, 5).await.len(), 1, "C runs, holding the key");
    let status: String =
        sqlx::query_scalar("SELECT status FROM lockgate.dlq_retry()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(status, "enqueued");
    let retried: i64 = sqlx::query_scalar("SELECT msg_id FROM pgmq.q_default WHERE msg_id <> $1")
        .bind(c.unwrap())
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(claim(&db.pool, 5).await.is_empty(), "the retried job was delivered as C's duplicate");

    assert!(common::complete_default(&db.pool, (c.unwrap(), 1)).await);
    put_back_over(&db.pool, "default", retried).await;
    let delivered: Vec<(i64, bool)> =
        sqlx::query_as("SELECT msg_id, headers ? 'duplicate_of' FROM lockgate.claim('default', 5, 30)")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(delivered, vec![(retried, false)], "the retried job runs once the key is free");
}

/// Review helper-131 F5 (H33): a job of a type redefined from until_executed to while_executing
/// with discard meets the lock an earlier job of the type took at its enqueue, which is still
/// queued: it waits for that job rather than being archived unrun as its duplicate (nothing of
/// its key runs), and runs once that job is terminal (here, cancelled).
#[tokio::test]
async fn a_while_executing_job_waits_for_an_until_executed_holder_rather_than_being_discarded() {
    let db = db_with(&["'m', unique_mode => 'until_executed', unique_key => array['id']"]).await;
    let (_, _, held) = enqueue(&db.pool, "m", 1).await.unwrap();
    sqlx::query("UPDATE pgmq.q_default SET vt = now() + interval '1 hour' WHERE msg_id = $1")
        .bind(held)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "SELECT lockgate.define_job_type('m', unique_mode => 'while_executing', unique_key => array['id'],
                                         unique_on_conflict => 'discard')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (_, new, _) = enqueue(&db.pool, "m", 1).await.unwrap();
    let new = new.unwrap();
    assert!(claim(&db.pool, 5).await.is_empty(), "the new job was delivered as a duplicate of one that has not run");
    let cancelled: bool =
        sqlx::query_scalar("SELECT cancelled FROM lockgate.cancel($1)").bind(held).fetch_one(&db.pool).await.unwrap();
    assert!(cancelled);
    put_back_over(&db.pool, "default", new).await;
    let delivered: Vec<(i64, bool)> =
        sqlx::query_as("SELECT msg_id, headers ? 'duplicate_of' FROM lockgate.claim('default', 5, 30)")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(delivered, vec![(new, false)], "the new job runs once the holder is gone");
}

/// Review helper-132 F1 (docs/design.md §114): a job put back to wait for a unique key's holder
/// gives back its concurrency permit while it waits. Here the holder, an `until_executed` job
/// naming the same concurrency key (limit 1), was parked behind the waiting job's permit: each
/// waited for the other, and nothing of the key ran until the waiting job's lease lapsed (an
/// hour here). For both ways of meeting the key: a type that rejects duplicates, and one that
/// discards them (which waits for a holder that has not run).
#[tokio::test]
async fn a_job_waiting_for_a_unique_key_gives_its_concurrency_permit_to_the_holder_parked_for_it() {
    for on_conflict in ["reject", "discard"] {
        let db = db_with(&[
            &format!(
                "'w', concurrency_limit => 1, concurrency_duration_ms => 3600000, unique_mode => 'while_executing',
                 unique_on_conflict => '{on_conflict}'"
            ),
            "'u', concurrency_limit => 1, concurrency_duration_ms => 3600000, unique_mode => 'until_executed'",
        ])
        .await;
        let keys = "jsonb_build_object('concurrency_key', 'k', 'unique_key', 'x')";
        let waiting: i64 = sqlx::query_scalar(&format!("SELECT msg_id FROM lockgate.enqueue('w', '{{}}', {keys})"))
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let status: String = sqlx::query_scalar(&format!("SELECT status FROM lockgate.enqueue('u', '{{}}', {keys})"))
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(status, "parked", "{on_conflict}: the holder waits for the permit w holds");
        // w's claim meets u's lock and puts w back; u takes the permit w gave back.
        assert!(claim(&db.pool, 5).await.is_empty(), "{on_conflict}: w does not run beside u's lock");
        let holder: Vec<(i64, String)> = sqlx::query_as(
            "SELECT l.msg_id, q.headers->>'type' FROM lockgate.leases l JOIN pgmq.q_default q USING (msg_id)
              WHERE l.key = 'k'",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(holder.len(), 1, "{on_conflict}: one permit of k is held: {holder:?}");
        assert_eq!(holder[0].1, "u", "{on_conflict}: the parked holder took the permit w waits without");
        let d = claim(&db.pool, 5).await;
        assert_eq!(d, vec![(holder[0].0, 1)], "{on_conflict}: u runs at once, not after w's lease");
        assert!(common::complete_default(&db.pool, d[0]).await);
        put_back_over(&db.pool, "default", waiting).await;
        let d = claim(&db.pool, 5).await;
        assert_eq!(d, vec![(waiting, 2)], "{on_conflict}: w takes the permit again and runs once u is done");
        let value: i32 = sqlx::query_scalar("SELECT value FROM lockgate.semaphores WHERE key = 'k'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(value, 1, "{on_conflict}: k counts w's run alone");
    }
}

/// Issue 14 (docs/design.md §60): finishing a job that holds a uniqueness lock and belongs to a
/// batch reads its own lock and membership, not the queue's, and a promotion moves the promoted
/// job's lock without reading the others. With the queue compared with a constant, each read
/// every lock or membership of the queue (12,000 rows, index and table, to finish one job with
/// 6,000 held).
#[tokio::test]
async fn finishing_a_unique_batch_job_reads_its_own_lock_and_membership_not_the_queues() {
    let db = db_with(&[
        "'u', unique_mode => 'until_executed', unique_key => array['id']",
        "'lu', concurrency_limit => 1, unique_mode => 'until_executed', unique_key => array['id']",
        "'done'",
    ])
    .await;
    // lu 1 runs first; lu 2 and 3 wait for its permit, parked.
    for id in [1, 2, 3] {
        enqueue(&db.pool, "lu", id).await.unwrap();
    }
    let mut conn = db.pool.acquire().await.unwrap();
    let finish = async |conn: &mut PgConnection, dead_letter: bool| {
        let d: Delivery = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30)")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        let done = if dead_letter {
            common::dead_letter_default(&mut *tx, d).await
        } else {
            common::complete_default(&mut *tx, d).await
        };
        assert!(done, "the holder finishes its job");
        let reads = common::reads(&mut tx, &["lockgate.unique_locks", "lockgate.batch_jobs"]).await;
        tx.commit().await.unwrap();
        assert!(reads.iter().all(|(_, _, rows)| *rows < 20), "rows read to finish one job: {reads:?}");
    };
    // lu 1's completion promotes lu 2, whose lock moves to its new message: the session plans
    // its release and promotion statements on three locks.
    finish(&mut conn, false).await;
    let batch: i64 = sqlx::query_scalar("SELECT lockgate.create_batch('done')").fetch_one(&db.pool).await.unwrap();
    let args: Vec<serde_json::Value> = (0..6_000).map(|id| serde_json::json!({ "id": id })).collect();
    sqlx::query("SELECT * FROM lockgate.enqueue_many('u', $1, jsonb_build_object('batch', $2::bigint))")
        .bind(&args)
        .bind(batch)
        .execute(&db.pool)
        .await
        .unwrap();
    // Not analysed (autovacuum has not run yet): the planner guesses a queue holds a small share
    // of the locks, and read all of them to release one when the queue was a constant.
    // lu 2's completion promotes lu 3.
    finish(&mut conn, false).await;
    let moved: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM lockgate.unique_locks u JOIN pgmq.q_default q ON q.msg_id = u.msg_id
          WHERE u.key = 'lu:[3]'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(moved, 1, "the promoted job's lock names its new message");
    // Completed (the release of its lock and membership), then dead-lettered, several times
    // each, so that plans kept by the session are the ones measured too.
    for dead_letter in [false, false, false, true, true, true, false, true] {
        finish(&mut conn, dead_letter).await;
    }
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.unique_locks").fetch_one(&db.pool).await.unwrap();
    assert_eq!(held, 5_993, "each finished job gave its own lock back, and only it");
    let counted: (i64, i64) = sqlx::query_as("SELECT succeeded, failed FROM lockgate.batches WHERE id = $1")
        .bind(batch)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(counted, (4, 4), "each finished job counted once in its batch");
}

/// A promotion moves the uniqueness locks of the jobs it promotes, and reads no other: the
/// promotion step found them by the queue as a constant, and a session that planned it while the
/// locks had been analysed empty (as autovacuum leaves them after a drain) read every lock of the
/// queue, and compared each with every promoted job, at every completion that promoted one.
#[tokio::test]
async fn a_promotion_reads_only_the_locks_of_the_jobs_it_promotes() {
    let db =
        db_with(&["'lim', concurrency_limit => 1", "'u', unique_mode => 'until_executed', unique_key => array['id']"])
            .await;
    for id in 1..=4 {
        enqueue(&db.pool, "lim", id).await.unwrap();
    }
    sqlx::query("ANALYZE lockgate.unique_locks").execute(&db.pool).await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let finish = async |conn: &mut PgConnection| {
        let d: Delivery = sqlx::query_as(
            "SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30) WHERE headers->>'type' = 'lim'",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        assert!(common::complete_default(&mut *tx, d).await, "the holder finishes its job");
        let reads = common::reads(&mut tx, &["lockgate.unique_locks"]).await;
        tx.commit().await.unwrap();
        reads[0].2
    };
    // The session plans its promotion step here, on no locks at all.
    assert_eq!(finish(&mut conn).await, 0, "nothing to read yet");
    let args: Vec<serde_json::Value> = (0..6_000).map(|id| serde_json::json!({ "id": id })).collect();
    sqlx::query("SELECT * FROM lockgate.enqueue_many('u', $1, jsonb_build_object('priority', 9))")
        .bind(&args)
        .execute(&db.pool)
        .await
        .unwrap();
    for _ in 0..2 {
        let read = finish(&mut conn).await;
        assert!(read < 20, "lock rows read by a completion promoting a job that holds none: {read}");
    }
    let promoted: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.leases").fetch_one(&db.pool).await.unwrap();
    assert_eq!(promoted, 1, "the last parked job runs under the permit");
}

/// A type both unique and limited, enqueued many at a time on two connections (review F7): each
/// call took a job's unique key and then its concurrency key before the next job's, so one call
/// could wait for a unique key while holding a key's row the other call waited for, while the
/// other held a key's row the first wanted next: PostgreSQL failed one of them as a deadlock. Every
/// call now takes all its unique keys, in order, before any concurrency key, the order a single
/// enqueue takes them in. The schedule is forced: a producer holds unique key 3 uncommitted; call
/// A (unique 1 with key 2, unique 3 with key 1) waits for it; call B (unique 2 with key 1, unique
/// 4 with key 2) runs meanwhile; then the producer rolls back.
#[tokio::test]
async fn a_unique_and_limited_type_enqueued_many_at_a_time_on_two_connections_never_deadlocks() {
    let db =
        db_with(&["'uk', unique_mode => 'until_executed', unique_key => array['u'], unique_on_conflict => 'discard',
                        concurrency_limit => 1, concurrency_key => array['c']"])
        .await;
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut producer).await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('uk', '{\"u\": 3, \"c\": 9}')").execute(&mut producer).await.unwrap();
    let call = |args: serde_json::Value| {
        let url = db.url.clone();
        tokio::spawn(async move {
            let mut conn = PgConnection::connect(&url).await.unwrap();
            let args: Vec<serde_json::Value> = serde_json::from_value(args).unwrap();
            sqlx::query_scalar::<_, String>("SELECT status FROM lockgate.enqueue_many('uk', $1)")
                .bind(&args)
                .fetch_all(&mut conn)
                .await
                .map_err(|e| e.to_string())
        })
    };
    let waiting = |n: i64| {
        let pool = db.pool.clone();
        async move {
            lockgate_testkit::wait_for_count(&pool, common::WAITING_FOR_A_LOCK, n, common::WAIT).await.unwrap();
        }
    };
    let a = call(serde_json::json!([{"u": 1, "c": 2}, {"u": 3, "c": 1}]));
    waiting(1).await;
    let b = call(serde_json::json!([{"u": 2, "c": 1}, {"u": 4, "c": 2}]));
    // B either lands at once or waits behind A: both are fine so far.
    wait_for("call B to land or wait", common::WAIT, || async {
        let waiters: i64 = sqlx::query_scalar(common::WAITING_FOR_A_LOCK).fetch_one(&db.pool).await?;
        Ok((b.is_finished() || waiters == 2).then_some(()))
    })
    .await
    .unwrap();
    sqlx::query("ROLLBACK").execute(&mut producer).await.unwrap();
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    assert!(a.is_ok() && b.is_ok(), "a call failed: A {a:?}, B {b:?}");
    assert_eq!(common::deadlocks(&db.pool).await, 0);
    let statuses: Vec<String> = a.unwrap().into_iter().chain(b.unwrap()).collect();
    assert_eq!(statuses.iter().filter(|s| *s == "enqueued").count(), 2, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| *s == "parked").count(), 2, "{statuses:?}");
}

/// Taking a call's unique keys first keeps what a call of a unique and limited type answers: of
/// two jobs with one unique key, the first is discarded by its concurrency key's limit and gives
/// the unique key back, and the second takes it and runs, as two single enqueues would.
#[tokio::test]
async fn a_job_whose_unique_key_an_earlier_job_of_the_call_gave_back_takes_it() {
    let db =
        db_with(&["'ud', unique_mode => 'until_executed', unique_key => array['u'], unique_on_conflict => 'discard',
                        concurrency_limit => 1, concurrency_key => array['c'], concurrency_on_conflict => 'discard'"])
        .await;
    sqlx::query("SELECT * FROM lockgate.enqueue('ud', '{\"u\": 0, \"c\": 1}')").execute(&db.pool).await.unwrap();
    let args = vec![serde_json::json!({"u": 5, "c": 1}), serde_json::json!({"u": 5, "c": 2})];
    let rows: Vec<(Option<i64>, i64, String)> =
        sqlx::query_as("SELECT msg_id, job_id, status FROM lockgate.enqueue_many('ud', $1)")
            .bind(&args)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let statuses: Vec<&str> = rows.iter().map(|r| r.2.as_str()).collect();
    assert_eq!(statuses, ["discarded", "enqueued"]);
    let held: Vec<(String, i64)> = sqlx::query_as("SELECT key, job_id FROM lockgate.unique_locks WHERE key LIKE '%5%'")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].1, rows[1].1, "the enqueued job holds the unique key");
}

/// Review of §74 (helper-73): the call's permits go to each concurrency key's jobs in the order a
/// call took them before (unique key, then position), not in the order of the arguments; and a
/// type that rejects duplicates fails with LG005 at once when a job of another call holds a key,
/// before it waits for anything else.
#[tokio::test]
async fn a_unique_and_limited_call_gives_each_keys_permits_in_unique_key_order_and_rejects_at_once() {
    let db = db_with(&[
        "'dd', unique_mode => 'until_executed', unique_key => array['u'], unique_on_conflict => 'discard',
         concurrency_limit => 1, concurrency_key => array['c'], concurrency_on_conflict => 'discard'",
        "'rr', unique_mode => 'until_executed', unique_key => array['u'], unique_on_conflict => 'reject',
         concurrency_limit => 1, concurrency_key => array['c'], concurrency_on_conflict => 'raise'",
    ])
    .await;
    let statuses = |job_type: &'static str, args: serde_json::Value| {
        let pool = db.pool.clone();
        async move {
            let args: Vec<serde_json::Value> = serde_json::from_value(args).unwrap();
            sqlx::query_scalar::<_, String>("SELECT status FROM lockgate.enqueue_many($1, $2)")
                .bind(job_type)
                .bind(&args)
                .fetch_all(&pool)
                .await
                .map_err(|e| e.as_database_error().and_then(|d| d.code()).unwrap_or_default().to_string())
        }
    };
    // Key x's one permit goes to the job with the lowest unique key, a.
    let got = statuses("dd", serde_json::json!([{"u": "b", "c": "x"}, {"u": "a", "c": "x"}])).await;
    assert_eq!(got, Ok(vec!["discarded".to_string(), "enqueued".to_string()]));
    // Unique key a is held by a job of another call (committed), which also fills key y: LG005,
    // though the job of key y comes first in the order permits are taken in.
    sqlx::query("SELECT lockgate.enqueue('rr', '{\"u\": \"a\", \"c\": \"y\"}')").execute(&db.pool).await.unwrap();
    let got = statuses("rr", serde_json::json!([{"u": "b", "c": "y"}, {"u": "a", "c": "z"}])).await;
    assert_eq!(got, Err("LG005".to_string()));
    // ... and with unique key z held by an uncommitted job, it does not wait for it.
    let mut other = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query("SELECT lockgate.enqueue('rr', '{\"u\": \"z\", \"c\": \"z\"}')").execute(&mut other).await.unwrap();
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("SET lock_timeout = '2s'").execute(&mut conn).await.unwrap();
    let args = vec![serde_json::json!({"u": "a", "c": "q"}), serde_json::json!({"u": "z", "c": "q"})];
    let err =
        sqlx::query("SELECT * FROM lockgate.enqueue_many('rr', $1)").bind(&args).execute(&mut conn).await.unwrap_err();
    assert_eq!(err.as_database_error().and_then(|d| d.code()).as_deref(), Some("LG005"), "{err}");
}

/// A call that gives one unique key to two of its jobs, of a type that rejects duplicates, is
/// refused as bad input naming the key. Before, its later job met the earlier one as the key's
/// holder and the error named that job, an id the failed call never enqueued (review helper-141
/// F7). Both paths: a limited type's and a plain one's.
#[tokio::test]
async fn a_call_repeating_a_unique_key_of_a_rejecting_type_is_refused_naming_the_key() {
    let db = db_with(&[
        "'rr', unique_mode => 'until_executed', unique_key => array['u'], unique_on_conflict => 'reject',
         concurrency_limit => 1, concurrency_key => array['c']",
        "'r', unique_mode => 'until_executed', unique_key => array['u'], unique_on_conflict => 'reject'",
    ])
    .await;
    for job_type in ["rr", "r"] {
        let args = vec![
            serde_json::json!({"u": "other", "c": "p"}),
            serde_json::json!({"u": "twice", "c": "p"}),
            serde_json::json!({"u": "twice", "c": "q"}),
        ];
        let err = sqlx::query("SELECT * FROM lockgate.enqueue_many($1, $2)")
            .bind(job_type)
            .bind(&args)
            .execute(&db.pool)
            .await
            .unwrap_err();
        let db_err = err.as_database_error().unwrap();
        assert_eq!(db_err.code().as_deref(), Some("LG003"), "{err}");
        assert!(db_err.message().contains(&format!("unique key \"{job_type}:[\"twice\"]\"")), "{err}");
        assert!(db_err.message().contains("more than one job of this call"), "{err}");
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.unique_locks").fetch_one(&db.pool).await.unwrap();
    assert_eq!(left, 0, "nothing of either call was kept");
}
