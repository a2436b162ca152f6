//! Enqueue from Rust and SQL: transactional (G8), batched, delayed, prioritised, and every bad
//! input refused with an error that names it, leaving nothing behind.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use lockgate::{Client, DbError, EnqueueError, EnqueueOptions, EnqueueStatus, Job, JobPolicy, JobTypeName};
use lockgate_testkit::TestDb;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::postgres::PgListener;

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Note {
    text: String,
}

impl Job for Note {
    const TYPE: &'static str = "note";
}

#[derive(Serialize, Deserialize)]
struct NotAnObject(u32);

impl Job for NotAnObject {
    const TYPE: &'static str = "note";
}

async fn setup() -> (TestDb, Client) {
    let db = TestDb::migrated().await.expect("db");
    let client = Client::new(db.pool.clone());
    client.define::<Note>().await.expect("define");
    (db, client)
}

async fn queued(db: &TestDb) -> i64 {
    db.count("SELECT 1 FROM pgmq.q_default").await.expect("count")
}

#[tokio::test]
async fn g8_rust_enqueue_in_rolled_back_transaction_leaves_nothing() {
    let (db, client) = setup().await;
    let mut tx = db.pool.begin().await.unwrap();
    client.enqueue_in(&mut tx, &Note { text: "x".into() }).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(queued(&db).await, 0);
}

#[tokio::test]
async fn g8_rust_enqueue_in_committed_transaction_exists_only_after_commit() {
    let (db, client) = setup().await;
    let mut tx = db.pool.begin().await.unwrap();
    let job = client.enqueue_in(&mut tx, &Note { text: "x".into() }).await.unwrap();
    assert_eq!(queued(&db).await, 0, "invisible to others before commit");
    tx.commit().await.unwrap();
    assert_eq!(queued(&db).await, 1);
    assert_eq!(job.queue, "default");
}

#[tokio::test]
async fn g8_sql_enqueue_follows_the_callers_transaction() {
    let (db, _client) = setup().await;
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('note', '{\"text\": \"a\"}')").execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(queued(&db).await, 0);
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('note', '{\"text\": \"b\"}')").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(queued(&db).await, 1);
}

#[tokio::test]
async fn enqueue_many_returns_jobs_in_input_order() {
    let (db, client) = setup().await;
    let notes: Vec<Note> = (0..500).map(|i| Note { text: i.to_string() }).collect();
    let jobs = client.enqueue_many(&notes).await.unwrap();
    assert_eq!(jobs.len(), 500);
    for (i, job) in jobs.iter().enumerate() {
        let text: String = sqlx::query_scalar("SELECT message->>'text' FROM pgmq.q_default WHERE msg_id = $1")
            .bind(job.msg_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(text, i.to_string());
    }
}

/// The client's bulk enqueue takes its jobs back as one row of arrays
/// (`lockgate._enqueue_many_and_wake`), not a row per job: each job's outcome must still come
/// back in the order of the input, for every kind of outcome. A type limited to one per key and
/// unique per key, enqueued as [a/1, a/2, b/1, b/3] (key/unique key): the first takes key a, the
/// second finds a full and parks, the third duplicates the first, the fourth takes key b. A
/// bulk enqueue of parked jobs only wakes no one; an empty one returns nothing; SQL's call of the
/// function refuses a bad argument by its position and leaves nothing enqueued; without the
/// function (a database migrated by an older build), the client says to run migrate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_bulk_enqueue_returns_each_jobs_outcome_in_the_order_given() {
    let db = TestDb::migrated().await.unwrap();
    let (pool, client) = shadowed_notify(&db).await;
    sqlx::query(
        "SELECT lockgate.define_job_type('pair', concurrency_limit => 1, concurrency_key => ARRAY['k'],
                                         unique_mode => 'until_executed', unique_key => ARRAY['u'], unique_on_conflict => 'discard')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let args =
        [json!({"k": "a", "u": 1}), json!({"k": "a", "u": 2}), json!({"k": "b", "u": 1}), json!({"k": "b", "u": 3})];
    let jobs = client.enqueue_many_raw("pair", &args, &EnqueueOptions::default()).await.unwrap();
    client.wakes_sent().await;
    let statuses: Vec<EnqueueStatus> = jobs.iter().map(|j| j.status).collect();
    use EnqueueStatus::{Duplicate, Enqueued, Parked};
    assert_eq!(statuses, [Enqueued, Parked, Duplicate, Enqueued]);
    assert!(jobs.iter().all(|j| j.queue == "default"), "{jobs:?}");
    for i in [0, 3] {
        assert_eq!(jobs[i].msg_id, Some(jobs[i].job_id.0));
        let message: serde_json::Value = sqlx::query_scalar("SELECT message FROM pgmq.q_default WHERE msg_id = $1")
            .bind(jobs[i].msg_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(message, args[i]);
    }
    assert_eq!((jobs[1].msg_id, jobs[2].msg_id), (None, None));
    let parked: serde_json::Value = sqlx::query_scalar("SELECT args FROM lockgate.parked WHERE job_id = $1")
        .bind(jobs[1].job_id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(parked, args[1]);
    assert_eq!(jobs[2].job_id, jobs[0].job_id, "a duplicate names the job holding its unique key");
    assert_eq!(notified(&pool).await, [("lockgate_default".to_string(), true)], "one wake-up, with the commit");

    let parked_only = [json!({"k": "a", "u": 4}), json!({"k": "b", "u": 5})];
    let jobs = client.enqueue_many_raw("pair", &parked_only, &EnqueueOptions::default()).await.unwrap();
    client.wakes_sent().await;
    assert!(jobs.iter().all(|j| j.status == Parked && j.msg_id.is_none()), "{jobs:?}");
    assert_eq!(notified(&pool).await, [], "nothing can run: nobody is woken");
    assert!(client.enqueue_many::<Note>(&[]).await.unwrap().is_empty());
    assert!(client.enqueue_many_raw("pair", &[], &EnqueueOptions::default()).await.unwrap().is_empty());

    let before = queued(&db).await;
    let err =
        sqlx::query("SELECT * FROM lockgate._enqueue_many_and_wake('note', ARRAY['{}', '7']::jsonb[], '{}', true)")
            .execute(&db.pool)
            .await
            .unwrap_err();
    assert!(err.to_string().contains("arguments #2 must be a JSON object"), "{err}");
    assert_eq!(queued(&db).await, before);

    // A database migrated by a build without the function: the error says what to do.
    sqlx::query("DROP FUNCTION lockgate._enqueue_many_and_wake").execute(&db.pool).await.unwrap();
    let err = client.enqueue_many(&[Note { text: "x".into() }]).await.unwrap_err();
    assert!(matches!(err, EnqueueError::Database(DbError::MissingFunction(_))), "{err:?}");
    assert!(err.to_string().starts_with("function lockgate._enqueue_many_and_wake("), "{err}");
    assert!(err.to_string().ends_with("run `lockgate migrate`"), "{err}");
    assert_eq!(queued(&db).await, before);
}

/// The client's bulk enqueue resolves the job type and its options once: the queue it reports,
/// and the one its wake-up goes to, is the queue its jobs went to. Another connection moves a
/// unique type between two queues in a loop while the client enqueues one job at a time. With
/// the type looked up twice (a first version called `enqueue_many`, which looked it up again in
/// a newer snapshot), about one call in forty reported the other queue, and its wake-up went
/// there: the workers of the real queue waited for their next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_enqueue_reports_the_queue_its_jobs_went_to_while_its_type_moves_between_queues() {
    let (db, client) = setup().await;
    let define = |queue: &str| {
        format!(
            "SELECT lockgate.define_job_type('moving', '{queue}', unique_mode => 'while_executing', unique_key => ARRAY['u'])"
        )
    };
    sqlx::raw_sql(&format!("SELECT lockgate.create_queue('qa'); SELECT lockgate.create_queue('qb'); {}", define("qa")))
        .execute(&db.pool)
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mover = {
        let (pool, stop) = (db.pool.clone(), stop.clone());
        let (to_a, to_b) = (define("qa"), define("qb"));
        tokio::spawn(async move {
            let mut moves = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for statement in [&to_b, &to_a] {
                    sqlx::query(statement).execute(&pool).await.unwrap();
                    moves += 1;
                }
            }
            moves
        })
    };
    let mut seen = std::collections::HashSet::new();
    for i in 0..400 {
        let jobs = client.enqueue_many_raw("moving", &[json!({"u": i})], &EnqueueOptions::default()).await.unwrap();
        assert_eq!(jobs.len(), 1);
        let job = &jobs[0];
        assert_eq!(job.status, EnqueueStatus::Enqueued);
        let found: Option<String> = sqlx::query_scalar(
            "SELECT q FROM (VALUES ('qa'), ('qb')) v(q)
              WHERE EXISTS (SELECT 1 FROM pgmq.q_qa WHERE msg_id = $1 AND v.q = 'qa')
                 OR EXISTS (SELECT 1 FROM pgmq.q_qb WHERE msg_id = $1 AND v.q = 'qb')",
        )
        .bind(job.msg_id)
        .fetch_optional(&db.pool)
        .await
        .unwrap();
        assert_eq!(found.as_deref(), Some(job.queue.as_str()), "call {i}: reported {job:?}");
        seen.insert(job.queue.clone());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let moves = mover.await.unwrap();
    assert!(moves > 0 && seen.len() == 2, "the type moved {moves} times; jobs went to {seen:?}");
}

#[tokio::test]
async fn delayed_jobs_are_invisible_until_their_time() {
    let (db, client) = setup().await;
    let options = EnqueueOptions { delay: Some(Duration::from_secs(3600)), ..Default::default() };
    client.enqueue_with(&Note { text: "later".into() }, &options).await.unwrap();
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default WHERE vt > now() + interval '59 minutes'").await.unwrap(), 1);
}

#[tokio::test]
async fn bad_sql_inputs_are_refused_with_errors_that_name_them() {
    let (db, _client) = setup().await;
    let cases = [
        ("SELECT lockgate.enqueue('nope', '{}')", "unknown job type \"nope\""),
        ("SELECT lockgate.enqueue('note', '[1, 2]')", "must be a JSON object, got array"),
        ("SELECT lockgate.enqueue('note', '\"text\"')", "must be a JSON object, got string"),
        ("SELECT lockgate.enqueue('note', '{}', '{\"delay\": -5}')", "invalid delay -5"),
        ("SELECT lockgate.enqueue('note', '{}', '{\"priority\": 12}')", "invalid priority 12"),
        ("SELECT lockgate.enqueue('note', '{}', '{\"queue\": \"missing\"}')", "queue \"missing\" does not exist"),
        ("SELECT lockgate.enqueue('note', '{}', '{\"colour\": 1}')", "unknown enqueue option(s): colour"),
        ("SELECT lockgate.enqueue('note', '{}', '{\"run_at\": \"soon\"}')", "invalid run_at \"soon\""),
        ("SELECT lockgate.enqueue('note', '{}', '{\"delay\": 1, \"run_at\": \"2030-01-01T00:00:00Z\"}')", "not both"),
        // Review (helper-77, #5, #9): times no client could read, and raw 22003/22008 errors.
        ("SELECT lockgate.enqueue('note', '{}', '{\"delay\": 1e400}')", "invalid delay"),
        ("SELECT lockgate.enqueue('note', '{}', '{\"delay\": 8.8e12}')", "invalid delay 8800000000000"),
        ("SELECT lockgate.enqueue('note', '{}', '{\"delay\": 3155760001}')", "(100 years)"),
        ("SELECT lockgate.enqueue('note', '{}', '{\"run_at\": \"2030-13-45T99:99\"}')", "not a date and time"),
        (
            "SELECT lockgate.define_job_type('far', concurrency_limit => 1, concurrency_duration_ms => 9223372036854775807)",
            "invalid concurrency_duration_ms 9223372036854775807 ms",
        ),
        ("SELECT lockgate.define_job_type('far', backoff_max_ms => 3155760000001)", "invalid backoff_max_ms"),
        ("SELECT lockgate.define_job_type('far', timeout_ms => 3155760000001)", "invalid timeout_ms"),
        // Review (helper-116, F5): NULL policies failed on the table's NOT NULL constraints (23502).
        ("SELECT lockgate.define_job_type('far', backoff_base_ms => NULL)", "invalid backoff"),
        ("SELECT lockgate.define_job_type('far', backoff_jitter => NULL)", "invalid backoff"),
        ("SELECT lockgate.define_job_type('far', concurrency_duration_ms => NULL)", "invalid concurrency_duration_ms"),
        ("SELECT lockgate.define_job_type('far', concurrency_duration_ms => 0)", "invalid concurrency_duration_ms 0"),
        ("SELECT lockgate.define_job_type('far', concurrency_on_conflict => NULL)", "invalid concurrency on_conflict"),
        // Review (helper-136, F13): a key without its limit or mode was stored and did nothing.
        (
            "SELECT lockgate.define_job_type('far', concurrency_key => '{account}')",
            "concurrency_key account without a concurrency_limit",
        ),
        (
            "SELECT lockgate.define_job_type('far', unique_key => '{image}', unique_on_conflict => 'discard')",
            "unique_key image without a unique_mode",
        ),
        ("SELECT lockgate.enqueue_many('note', ARRAY['{}', '7']::jsonb[])", "arguments #2 must be a JSON object"),
        ("SELECT lockgate.create_queue('Bad Name')", "invalid queue name \"Bad Name\""),
        ("SELECT lockgate.create_queue(repeat('q', 48))", "invalid queue name"),
        (
            "SELECT lockgate.enqueue('note', jsonb_build_object('blob', repeat('x', 1100000)))",
            "more than the 1048576 allowed",
        ),
    ];
    for (sql, expected) in cases {
        let err = sqlx::query(sql).execute(&db.pool).await.expect_err(sql);
        let code = err.as_database_error().and_then(|e| e.code()).unwrap_or_default().to_string();
        let err = DbError::from(err).to_string();
        assert!(err.contains(expected), "{sql}: expected {expected:?} in {err:?}");
        assert!(code.starts_with("LG"), "{sql}: {code} {err}");
    }
    assert_eq!(queued(&db).await, 0, "nothing was enqueued by a refused call");
}

/// Review (helper-77, #3): a concurrency duration stored before define_job_type bounded it (10
/// million years, as the config once accepted) made every claim of its queue, and every enqueue
/// of its type, fail with `timestamp out of range`. A lease is now at most 100 years.
#[tokio::test]
async fn a_duration_stored_past_the_bound_fails_no_enqueue_or_claim() {
    let (db, _client) = setup().await;
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('far', concurrency_limit => 1);
         UPDATE lockgate.job_types SET concurrency_duration_ms = 9223372036854775807 WHERE name = 'far';",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for _ in 0..2 {
        sqlx::query("SELECT lockgate.enqueue('far', '{}')").execute(&db.pool).await.unwrap();
    }
    sqlx::query("SELECT lockgate.enqueue('note', '{\"text\": \"x\"}')").execute(&db.pool).await.unwrap();
    let claimed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM lockgate.claim('default', 10, 30)").fetch_one(&db.pool).await.unwrap();
    assert_eq!(claimed, 2, "the limited job and the other type's job");
    let expires: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT expires_at FROM lockgate.leases").fetch_one(&db.pool).await.unwrap();
    assert!(expires < chrono::Utc::now() + chrono::Duration::days(36_526), "{expires}");
}

#[tokio::test]
async fn bad_rust_inputs_are_refused_before_or_by_the_database() {
    let (db, client) = setup().await;
    let err = client.enqueue(&NotAnObject(3)).await.unwrap_err();
    assert!(matches!(err, EnqueueError::NotAnObject { .. }), "{err}");
    // Said as the user sees it (review helper-92: "must serialize to a JSON object").
    assert_eq!(err.to_string(), "the arguments of a note job must be a JSON object, not a number");
    let err = client.enqueue_raw("missing_type", &json!({}), &EnqueueOptions::default()).await.unwrap_err();
    assert!(matches!(&err, EnqueueError::UnknownJobType { job_type } if job_type == "missing_type"), "{err:?}");
    assert_eq!(err.to_string(), "unknown job type \"missing_type\"");
    let err = client.enqueue_many_raw("missing_type", &[json!({})], &EnqueueOptions::default()).await.unwrap_err();
    assert!(matches!(&err, EnqueueError::UnknownJobType { job_type } if job_type == "missing_type"), "{err:?}");
    let options = EnqueueOptions { priority: Some(42), ..Default::default() };
    let err = client.enqueue_with(&Note { text: "x".into() }, &options).await.unwrap_err();
    assert!(err.to_string().contains("priority"), "{err}");
    let mut policy = JobPolicy::on_queue(common::queue("default"));
    policy.max_attempts = 0;
    let err = client.define_job_type(&lockgate::JobTypeName::new("z").unwrap(), &policy).await.unwrap_err();
    assert!(err.to_string().contains("max_attempts"), "{err}");
    assert_eq!(queued(&db).await, 0);
}

#[tokio::test]
async fn every_enqueue_path_writes_the_same_headers() {
    let (db, client) = setup().await;
    let one = client.enqueue(&Note { text: "a".into() }).await.unwrap();
    let with_options = EnqueueOptions { priority: Some(3), ..Default::default() };
    let two = client.enqueue_with(&Note { text: "b".into() }, &with_options).await.unwrap();
    let many =
        client.enqueue_many_with(&[Note { text: "c".into() }, Note { text: "d".into() }], &with_options).await.unwrap();
    let sql: (i64, i64) =
        sqlx::query_as("SELECT msg_id, job_id FROM lockgate.enqueue_many('note', ARRAY['{}']::jsonb[])")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    // A job on its first message: its id is its msg_id, and priority 0 is left out.
    let expected = [
        (&one, json!({"type": "note"})),
        (&two, json!({"type": "note", "priority": 3})),
        (&many[0], json!({"type": "note", "priority": 3})),
        (&many[1], json!({"type": "note", "priority": 3})),
    ];
    for (job, want) in expected {
        assert_eq!(Some(job.job_id.0), job.msg_id, "the job id is the first msg_id");
        let headers: serde_json::Value = sqlx::query_scalar("SELECT headers FROM pgmq.q_default WHERE msg_id = $1")
            .bind(job.msg_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(headers, want);
    }
    let headers: serde_json::Value = sqlx::query_scalar("SELECT headers FROM pgmq.q_default WHERE msg_id = $1")
        .bind(sql.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!((headers, sql.1), (json!({"type": "note"}), sql.0));
    let ids: Vec<i64> = vec![one.job_id.0, two.job_id.0, many[0].job_id.0, many[1].job_id.0, sql.1];
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "job ids are distinct and increasing: {ids:?}");
}

#[tokio::test]
async fn a_client_enqueues_concurrently_and_recovers_when_its_connection_is_killed() {
    let (db, client) = setup().await;
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move { client.enqueue(&Note { text: i.to_string() }).await })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(queued(&db).await, 20);
    // Kill every other session of the database: the client's own connection among them.
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // The first enqueue may report the broken connection; the next ones go through.
    let _ = client.enqueue(&Note { text: "after".into() }).await;
    client.enqueue(&Note { text: "after".into() }).await.unwrap();
    client.enqueue_many(&[Note { text: "x".into() }]).await.unwrap();
    assert!(queued(&db).await >= 22);
}

#[tokio::test]
async fn a_pgmq_queue_adopted_with_messages_in_it_takes_new_ids_above_them() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT pgmq.create('adopted')").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT pgmq.send_batch('adopted', array_fill('{}'::jsonb, ARRAY[500]))")
        .execute(&db.pool)
        .await
        .unwrap();
    let client = Client::new(db.pool.clone());
    client
        .define_job_type(&JobTypeName::new("noop").unwrap(), &JobPolicy::on_queue(common::queue("adopted")))
        .await
        .unwrap();
    // Without moving the shared sequence above the queue's own ids, this enqueue would collide
    // with message 1 of the queue.
    let job = client.enqueue_raw("noop", &json!({}), &EnqueueOptions::default()).await.unwrap();
    assert!(job.msg_id.unwrap() > 500, "{job:?}");
}

/// A type with a policy of its own, which nobody defines before its first enqueue.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Mail {
    to: String,
}

impl Job for Mail {
    const TYPE: &'static str = "mail";

    fn policy() -> JobPolicy {
        JobPolicy::builder().queue("mail").max_attempts(5).priority(2).build().unwrap()
    }
}

async fn stored_policy(db: &TestDb, name: &str) -> Option<JobPolicy> {
    let stored = lockgate::sql::load_job_types(&db.pool).await.unwrap();
    stored.into_iter().find(|(n, _)| n.as_str() == name).map(|(_, p)| p)
}

#[tokio::test]
async fn a_producer_enqueues_types_nobody_defined() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    assert_eq!(stored_policy(&db, "mail").await, None);
    let job = client.enqueue(&Mail { to: "a".into() }).await.unwrap();
    assert_eq!(job.queue, "mail", "the type's policy applies from the first job");
    assert_eq!(stored_policy(&db, "mail").await, Some(Mail::policy()));
    // The other typed verbs define on first use too (here through a clone, which shares what
    // its original knows).
    let clone = client.clone();
    clone.enqueue_many(&[Mail { to: "b".into() }]).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    client.enqueue_in(&mut tx, &Note { text: "in a transaction".into() }).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(stored_policy(&db, "note").await, Some(Note::policy()), "defined outside the rolled-back transaction");
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_mail").await.unwrap(), 2);
}

#[tokio::test]
async fn first_use_keeps_the_policy_a_worker_stored() {
    let db = TestDb::migrated().await.unwrap();
    // What a worker (or `lockgate define`) stored: another queue and attempts.
    let mut worker_policy = JobPolicy::on_queue(common::queue("default"));
    worker_policy.max_attempts = 3;
    Client::new(db.pool.clone()).define_job_type(&JobTypeName::new("mail").unwrap(), &worker_policy).await.unwrap();

    let producer = Client::new(db.pool.clone());
    let job = producer.enqueue(&Mail { to: "a".into() }).await.unwrap();
    assert_eq!(job.queue, "default", "the stored policy routes the job");
    assert_eq!(stored_policy(&db, "mail").await, Some(worker_policy), "first use replaced nothing");
    // An explicit define is the way to replace it.
    producer.define::<Mail>().await.unwrap();
    assert_eq!(stored_policy(&db, "mail").await, Some(Mail::policy()));
}

/// Whether `sql` fails with a lock timeout on `conn` (its `lock_timeout` is short): it needed a
/// lock another session holds.
async fn times_out_on_a_lock(conn: &mut sqlx::PgConnection, sql: &str) -> bool {
    match sqlx::query(sql).execute(&mut *conn).await {
        Ok(_) => false,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => true,
        Err(e) => panic!("{sql}: {e}"),
    }
}

/// A limited type with uniqueness: a definition with arrays and NULLs to compare.
const SYNC: &str = "SELECT lockgate.define_job_type('sync', 'accounts', 2, 5, concurrency_limit => 1,
                          concurrency_key => ARRAY['account'], unique_mode => 'until_executed',
                          unique_key => ARRAY['account', 'day'])";

#[tokio::test]
async fn a_definition_or_queue_that_exists_as_given_waits_for_no_other_definer_and_a_change_still_does() {
    let db = TestDb::migrated().await.unwrap();
    let limited = SYNC;
    let plain = "SELECT lockgate.define_job_type('mail', 'mail')";
    for sql in [limited, plain] {
        sqlx::query(sql).execute(&db.pool).await.unwrap();
    }
    let stamp = "SELECT updated_at::text FROM lockgate.job_types WHERE name = 'sync'";
    let defined_at: String = sqlx::query_scalar(stamp).fetch_one(&db.pool).await.unwrap();

    // Another session holds both types' rows as a process defining them as they are would
    // (shared), and both queues' creation locks, as a process creating them would until its
    // commit.
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM lockgate.job_types FOR SHARE").execute(&mut *holder).await.unwrap();
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtext('lockgate.queue:' || q)) FROM unnest(ARRAY['accounts', 'mail']) q",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let mut other = db.pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '300ms'").execute(&mut *other).await.unwrap();
    for sql in [limited, plain, "SELECT lockgate.create_queue('accounts')", "SELECT lockgate.create_queue('mail')"] {
        assert!(!times_out_on_a_lock(&mut other, sql).await, "{sql} is stored as given: it waits for nothing");
    }
    // A change, and a queue not created yet, still take their locks (and wait for the holder).
    let changed = "SELECT lockgate.define_job_type('sync', 'accounts', 2, 6, concurrency_limit => 1,
                          concurrency_key => ARRAY['account'], unique_mode => 'until_executed',
                          unique_key => ARRAY['account', 'day'])";
    assert!(times_out_on_a_lock(&mut other, changed).await, "a change to max_attempts writes the row");
    let rekeyed = "SELECT lockgate.define_job_type('sync', 'accounts', 2, 5, concurrency_limit => 1,
                          concurrency_key => ARRAY['account', 'region'], unique_mode => 'until_executed',
                          unique_key => ARRAY['account', 'day'])";
    assert!(times_out_on_a_lock(&mut other, rekeyed).await, "a change to a key path writes the row");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('lockgate.queue:fresh'))").execute(&mut *holder).await.unwrap();
    assert!(times_out_on_a_lock(&mut other, "SELECT lockgate.create_queue('fresh')").await, "creating waits (H21)");
    holder.rollback().await.unwrap();

    let unchanged: String = sqlx::query_scalar(stamp).fetch_one(&db.pool).await.unwrap();
    assert_eq!(unchanged, defined_at, "defining it as it was wrote nothing");
    sqlx::query(changed).execute(&mut *other).await.unwrap();
    let attempts: i32 = sqlx::query_scalar("SELECT max_attempts FROM lockgate.job_types WHERE name = 'sync'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempts, 6, "the change is stored once nothing holds the row");
    sqlx::query("SELECT lockgate.create_queue('fresh')").execute(&mut *other).await.unwrap();
    assert_eq!(db.count("SELECT 1 FROM lockgate.queues WHERE name = 'fresh'").await.unwrap(), 1);

    // A change or a delete not committed yet: a definition as the row stands waits for it, then
    // finds it and writes its own values, so the last definition to commit is the one stored.
    for writer_sql in [
        "UPDATE lockgate.job_types SET max_attempts = 9 WHERE name = 'mail'",
        "DELETE FROM lockgate.job_types WHERE name = 'mail'",
    ] {
        let mut writer = db.pool.begin().await.unwrap();
        sqlx::query(writer_sql).execute(&mut *writer).await.unwrap();
        assert!(times_out_on_a_lock(&mut other, plain).await, "{writer_sql}, uncommitted: the definition waits");
        let pool = db.pool.clone();
        let define = tokio::spawn(async move { sqlx::query(plain).execute(&pool).await });
        lockgate_testkit::wait_for_count(&db.pool, common::WAITING_FOR_A_LOCK, 1, common::WAIT).await.unwrap();
        writer.commit().await.unwrap();
        define.await.unwrap().unwrap();
        let attempts: Option<i32> =
            sqlx::query_scalar("SELECT max_attempts FROM lockgate.job_types WHERE name = 'mail'")
                .fetch_optional(&db.pool)
                .await
                .unwrap();
        assert_eq!(attempts, Some(20), "after {writer_sql}: the definition committed last holds");
    }
}

/// What processes started together store at start (§57): their job types in one transaction
/// each, and their heartbeat interval without a write unless it raises the recorded one.
#[tokio::test]
async fn a_start_defines_its_types_in_one_transaction_and_records_a_heartbeat_interval_it_does_not_raise_without_waiting(
) {
    let db = TestDb::migrated().await.unwrap();
    let named = |name: &str| JobTypeName::new(name).unwrap();
    let types = [
        (named("c_three"), JobPolicy::on_queue(common::queue("default"))),
        (named("a_one"), JobPolicy::on_queue(common::queue("default"))),
        (named("b_two"), JobPolicy::on_queue(common::queue("default"))),
    ];
    let transactions = |column: &'static str| {
        let pool = db.pool.clone();
        async move {
            let sql = format!("SELECT count(DISTINCT {column}::text) FROM lockgate.job_types WHERE name IN ('a_one', 'b_two', 'c_three')");
            sqlx::query_scalar::<_, i64>(&sql).fetch_one(&pool).await.unwrap()
        }
    };
    lockgate::sql::define_job_types(&db.pool, &types).await.unwrap();
    assert_eq!(transactions("xmin").await, 1, "the three types were inserted by one transaction");
    // Defined again as stored: each row is locked (shared) by the definition, all by one.
    lockgate::sql::define_job_types(&db.pool, &types).await.unwrap();
    assert_eq!(transactions("xmax").await, 1, "the three rows were locked by one transaction");
    assert_eq!(
        db.count("SELECT 1 FROM lockgate.job_types WHERE name IN ('a_one', 'b_two', 'c_three') AND xmax::text = '0'")
            .await
            .unwrap(),
        0
    );

    lockgate::sql::record_heartbeat_interval(&db.pool, Duration::from_secs(5)).await.unwrap();
    let row = "SELECT xmin::text || '/' || heartbeat_interval_ms FROM lockgate.settings";
    let recorded: String = sqlx::query_scalar(row).fetch_one(&db.pool).await.unwrap();
    // Another process is raising the interval and has not committed yet.
    let mut raising = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM lockgate.settings FOR UPDATE").execute(&mut *raising).await.unwrap();
    let mut other = db.pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '300ms'").execute(&mut *other).await.unwrap();
    for interval in [Duration::from_secs(5), Duration::from_secs(1)] {
        lockgate::sql::record_heartbeat_interval(&mut other, interval)
            .await
            .unwrap_or_else(|e| panic!("recording {interval:?} (not above 5 s) waited for the other process: {e}"));
    }
    let longer = lockgate::sql::record_heartbeat_interval(&mut other, Duration::from_secs(10)).await;
    assert!(longer.is_err(), "raising the interval takes the row's lock: it waits for the other process");
    raising.rollback().await.unwrap();
    let unchanged: String = sqlx::query_scalar(row).fetch_one(&db.pool).await.unwrap();
    assert_eq!(unchanged, recorded, "recording an interval no longer than the one stored wrote nothing");
    lockgate::sql::record_heartbeat_interval(&mut other, Duration::from_secs(10)).await.unwrap();
    lockgate::sql::record_heartbeat_interval(&mut other, Duration::from_secs(2)).await.unwrap();
    let raised: i64 =
        sqlx::query_scalar("SELECT heartbeat_interval_ms FROM lockgate.settings").fetch_one(&db.pool).await.unwrap();
    assert_eq!(raised, 10_000, "the longest interval recorded holds");
}

/// Each column a definition sets, changed behind define_job_type's back: defining the type as it
/// was stored writes it back, so no column is missing from the "stored as given" comparison.
#[tokio::test]
async fn a_definition_restores_any_one_column_changed_since() {
    let db = TestDb::migrated().await.unwrap();
    let define = SYNC;
    sqlx::query(define).execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('other')").execute(&db.pool).await.unwrap();
    let changes = [
        ("queue", "'other'"),
        ("priority", "3"),
        ("max_attempts", "7"),
        ("backoff_base_ms", "5"),
        ("backoff_max_ms", "99999"),
        ("backoff_jitter", "0.5"),
        ("timeout_ms", "1234"),
        ("concurrency_limit", "2"),
        ("concurrency_key", "ARRAY['region']"),
        ("concurrency_duration_ms", "12345"),
        ("concurrency_on_conflict", "'discard'"),
        ("unique_mode", "'while_executing'"),
        ("unique_key", "ARRAY['account']"),
        ("unique_on_conflict", "'discard'"),
    ];
    // A column added to the table must be added here (or to the exceptions, with a reason).
    let set_by_definition: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns
          WHERE table_schema = 'lockgate' AND table_name = 'job_types'
            AND column_name NOT IN ('name',                     -- the key
                                    'updated_at',               -- when it last changed
                                    'concurrency_key_version')  -- derived from the key paths
          ORDER BY ordinal_position",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(set_by_definition, changes.iter().map(|(c, _)| c.to_string()).collect::<Vec<_>>());
    let row =
        "SELECT to_jsonb(t) - 'updated_at' - 'concurrency_key_version' FROM lockgate.job_types t WHERE name = 'sync'";
    let stored: serde_json::Value = sqlx::query_scalar(row).fetch_one(&db.pool).await.unwrap();
    for (column, value) in changes {
        sqlx::query(&format!("UPDATE lockgate.job_types SET {column} = {value} WHERE name = 'sync'"))
            .execute(&db.pool)
            .await
            .unwrap();
        sqlx::query(define).execute(&db.pool).await.unwrap();
        let now: serde_json::Value = sqlx::query_scalar(row).fetch_one(&db.pool).await.unwrap();
        assert_eq!(now, stored, "{column} changed since: the definition writes it back");
    }
}

#[tokio::test]
async fn a_failed_definition_is_returned_and_not_remembered() {
    let db = TestDb::empty().await.unwrap();
    let client = Client::new(db.pool.clone());
    let err = client.enqueue(&Mail { to: "a".into() }).await.unwrap_err();
    assert!(matches!(err, EnqueueError::Database(_)), "lockgate is not installed yet: {err:?}");
    lockgate::migrate(&db.pool).await.unwrap();
    let job = client.clone().enqueue(&Mail { to: "a".into() }).await.unwrap();
    assert_eq!(job.queue, "mail");
}

#[tokio::test]
async fn a_type_deleted_since_first_use_is_defined_again() {
    let (db, client) = setup().await;
    client.enqueue(&Mail { to: "a".into() }).await.unwrap();
    sqlx::query("DELETE FROM lockgate.job_types WHERE name = 'mail'").execute(&db.pool).await.unwrap();
    let err = client.enqueue(&Mail { to: "b".into() }).await.unwrap_err();
    assert!(matches!(&err, EnqueueError::UnknownJobType { job_type } if job_type == "mail"), "{err:?}");
    client.enqueue(&Mail { to: "c".into() }).await.unwrap();
    assert_eq!(stored_policy(&db, "mail").await, Some(Mail::policy()));
}

#[tokio::test]
async fn enqueue_in_needs_no_second_connection_for_a_stored_type() {
    let db = TestDb::migrated().await.unwrap();
    Client::new(db.pool.clone()).define::<Mail>().await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&db.url)
        .await
        .unwrap();
    let client = Client::new(pool.clone());
    let mut tx = pool.begin().await.unwrap(); // the pool's only connection
    let job = client.enqueue_in(&mut tx, &Mail { to: "a".into() }).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(job.queue, "mail");
}

#[tokio::test]
async fn enqueue_in_a_repeatable_read_transaction_says_to_define_the_type_first() {
    let (db, client) = setup().await;
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *tx).await.unwrap();
    // The lookup takes the snapshot; the definition commits on another connection after it.
    let err = client.enqueue_in(&mut tx, &Mail { to: "a".into() }).await.unwrap_err();
    assert!(matches!(&err, EnqueueError::DefinedAfterSnapshot { job_type } if job_type == "mail"), "{err:?}");
    assert!(err.to_string().contains("define it before the transaction begins"), "{err}");
    tx.rollback().await.unwrap();
    // Defined now: the next transaction enqueues.
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *tx).await.unwrap();
    client.enqueue_in(&mut tx, &Mail { to: "b".into() }).await.unwrap();
    tx.commit().await.unwrap();
}

/// The next notification on the listener's channels, within `common::WAIT`.
async fn next_payload(listener: &mut PgListener) -> String {
    let n = tokio::time::timeout(common::WAIT, listener.recv())
        .await
        .expect("a notification within WAIT")
        .expect("the listener's connection");
    n.payload().to_string()
}

/// Issue 14: an enqueue in its own transaction wakes idle workers after its commit (concurrent
/// producers then do not queue on PostgreSQL's notify lock behind each other's commit flushes),
/// and only for a job that can run now; `notify => false` sends no wake-up at all. Each silent case is followed by a sentinel notification, so the listener's
/// next one tells whether anything came before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wake_ups_follow_the_commit_and_only_for_jobs_that_can_run_now() {
    let (db, client) = setup().await;
    let mut listener = PgListener::connect_with(&db.pool).await.unwrap();
    listener.listen("lockgate_default").await.unwrap();
    let sentinel = || async {
        sqlx::query("SELECT pg_notify('lockgate_default', 'sentinel')").execute(&db.pool).await.unwrap();
    };

    sqlx::query("SELECT * FROM lockgate.enqueue('note', '{\"text\": \"a\"}', '{}', notify => false)")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "SELECT * FROM lockgate.enqueue_many('note', ARRAY['{\"text\": \"b\"}'::jsonb], '{}', notify => false)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('note', '{\"text\": \"c\"}', '{\"delay\": 60}')")
        .execute(&db.pool)
        .await
        .unwrap();
    sentinel().await;
    assert_eq!(next_payload(&mut listener).await, "sentinel", "an enqueue sent a wake-up it should not have");

    sqlx::query("SELECT * FROM lockgate.enqueue('note', '{\"text\": \"d\"}')").execute(&db.pool).await.unwrap();
    assert_eq!(next_payload(&mut listener).await, "", "SQL's enqueue wakes in its transaction by default");

    client.enqueue(&Note { text: "e".into() }).await.unwrap();
    assert_eq!(next_payload(&mut listener).await, "");
    client.enqueue_many(&[Note { text: "f".into() }, Note { text: "g".into() }]).await.unwrap();
    assert_eq!(next_payload(&mut listener).await, "");
    client.enqueue_raw("note", &json!({"text": "h"}), &EnqueueOptions::default()).await.unwrap();
    assert_eq!(next_payload(&mut listener).await, "");

    let later = EnqueueOptions { delay: Some(Duration::from_secs(60)), ..Default::default() };
    client.enqueue_with(&Note { text: "i".into() }, &later).await.unwrap();
    let at = EnqueueOptions { run_at: Some(chrono::Utc::now() + chrono::Duration::minutes(5)), ..Default::default() };
    client.enqueue_many_with(&[Note { text: "j".into() }], &at).await.unwrap();
    client.wakes_sent().await;
    sentinel().await;
    assert_eq!(next_payload(&mut listener).await, "sentinel", "a delayed job woke the workers");
    assert_eq!(queued(&db).await, 10);
}

/// A pool on which `pg_notify` is shadowed (a function of the same name in `public`, put before
/// `pg_catalog` in the search path) to record, for each notification, whether the transaction
/// sending it had written anything, and the session that sent it; and a client on that pool.
/// The enqueue functions that notify run with a search_path of their own (design §83), which
/// would hide the shadow from them: on this database theirs puts `public` first too.
async fn shadowed_notify(db: &TestDb) -> (sqlx::PgPool, Client) {
    sqlx::raw_sql(
        "CREATE TABLE public.notified (channel text, had_written boolean, backend integer DEFAULT pg_backend_pid());
         CREATE FUNCTION public.pg_notify(channel text, payload text) RETURNS void LANGUAGE plpgsql AS $$
         DECLARE written boolean := pg_current_xact_id_if_assigned() IS NOT NULL;
         BEGIN
             INSERT INTO public.notified VALUES (channel, written);
             PERFORM pg_catalog.pg_notify(channel, payload);
         END $$;
         ALTER FUNCTION lockgate.enqueue(text, jsonb, jsonb, boolean) SET search_path = public, pg_catalog, pg_temp;
         ALTER FUNCTION lockgate.enqueue_many(text, jsonb[], jsonb, boolean) SET search_path = public, pg_catalog, pg_temp;
         ALTER FUNCTION lockgate._enqueue_many_and_wake(text, jsonb[], jsonb, boolean)
             SET search_path = public, pg_catalog, pg_temp;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let name: String = sqlx::query_scalar("SELECT current_database()").fetch_one(&db.pool).await.unwrap();
    sqlx::raw_sql(&format!("ALTER DATABASE \"{name}\" SET search_path = public, pg_catalog"))
        .execute(&db.pool)
        .await
        .unwrap();
    // New connections take the setting.
    let pool = db.new_pool(4).await.unwrap();
    let client = Client::new(pool.clone());
    client.define::<Note>().await.unwrap();
    (pool, client)
}

async fn notified(pool: &sqlx::PgPool) -> Vec<(String, bool)> {
    sqlx::query_as("DELETE FROM public.notified RETURNING channel, had_written").fetch_all(pool).await.unwrap()
}

/// Another transaction notifying through `lockgate._notify_unless_busy`, as a concurrent
/// producer's enqueue would be while it commits: until the returned connection's transaction
/// ends, every client enqueue leaves its wake-up to the wake task.
async fn busy_notifier(pool: &sqlx::PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('lockgate'), 1)").execute(&mut *tx).await.unwrap();
    tx
}

/// The sessions that sent a wake-up after a commit (in a transaction that wrote nothing).
async fn wake_sessions(pool: &sqlx::PgPool) -> Vec<i32> {
    sqlx::query_scalar("SELECT DISTINCT backend FROM public.notified WHERE NOT had_written")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Enqueues a note through `client` and waits until its wake-up, if any is left, is sent.
async fn enqueue_woken(client: &Client, text: &str) {
    client.enqueue(&Note { text: text.into() }).await.unwrap();
    client.wakes_sent().await;
}

/// Issue 14: what the client's wake-up is, seen from inside. SQL's enqueue notifies in its
/// writing transaction, as it must. So does the client's when no other enqueue is notifying at
/// that moment: its wake-up comes with its commit, and nothing follows it. When another one is
/// (it holds PostgreSQL's notify lock until its commit is flushed), the client does not queue
/// behind it: it commits without notifying, and its wake task notifies after the commit, in a
/// transaction that has written nothing (its commit record is then not waited for: PostgreSQL
/// flushes at commit only a transaction that wrote other WAL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_wake_up_comes_with_its_commit_unless_another_enqueue_is_notifying() {
    let db = TestDb::migrated().await.unwrap();
    let (pool, client) = shadowed_notify(&db).await;
    let with_commit = || vec![("lockgate_default".to_string(), true)];
    let after_commit = || vec![("lockgate_default".to_string(), false)];

    sqlx::query("SELECT * FROM lockgate.enqueue('note', '{}')").execute(&pool).await.unwrap();
    assert_eq!(notified(&pool).await, with_commit());

    enqueue_woken(&client, "a").await;
    assert_eq!(notified(&pool).await, with_commit(), "one wake-up, in the enqueue's transaction");
    client.enqueue_many(&[Note { text: "b".into() }, Note { text: "c".into() }]).await.unwrap();
    client.wakes_sent().await;
    assert_eq!(notified(&pool).await, with_commit());
    // A delayed job wakes no one, in its transaction or after.
    let later = EnqueueOptions { delay: Some(Duration::from_secs(60)), ..Default::default() };
    client.enqueue_with(&Note { text: "d".into() }, &later).await.unwrap();
    client.wakes_sent().await;
    assert_eq!(notified(&pool).await, []);

    let busy = busy_notifier(&db.pool).await;
    client.enqueue(&Note { text: "e".into() }).await.unwrap();
    client.enqueue_many(&[Note { text: "f".into() }, Note { text: "g".into() }]).await.unwrap();
    client.wakes_sent().await;
    let sent = notified(&pool).await;
    assert!(!sent.is_empty() && sent.iter().all(|n| *n == after_commit()[0]), "{sent:?}");
    // Through the pool, while another task holds the client's lane.
    let (h, i) = (Note { text: "h".into() }, Note { text: "i".into() });
    let (a, b) = tokio::join!(client.enqueue(&h), client.enqueue(&i));
    a.unwrap();
    b.unwrap();
    client.wakes_sent().await;
    let sent = notified(&pool).await;
    assert!(!sent.is_empty() && sent.iter().all(|n| *n == after_commit()[0]), "{sent:?}");
    busy.rollback().await.unwrap();
    assert_eq!(queued(&db).await, 10);
}

/// The enqueue that notifies in its own transaction waits for PostgreSQL's notify lock at its
/// commit, behind whichever transaction is committing a notification (an SQL producer's, a
/// promotion's, another database's): no `lock_timeout` of the producer's session may turn that
/// wait into a failed enqueue (a review measured every such enqueue failing under 1 ms). The
/// function sets it to 0 for the rest of its transaction, and only when it notifies.
#[tokio::test]
async fn the_enqueue_that_notifies_waits_for_the_notify_lock_whatever_its_lock_timeout() {
    let db = TestDb::migrated().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '1ms'").execute(&mut *tx).await.unwrap();
    let woken: bool =
        sqlx::query_scalar("SELECT lockgate._notify_unless_busy('default')").fetch_one(&mut *tx).await.unwrap();
    let timeout: String = sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut *tx).await.unwrap();
    assert_eq!((woken, timeout.as_str()), (true, "0"));
    tx.rollback().await.unwrap();
    // Called from the client's bulk enqueue, which runs as lockgate's owner with a search_path
    // of its own (design §83): the setting still lasts to the commit (a function's SET clause
    // restores only the settings it names).
    sqlx::query("SELECT lockgate.define_job_type('plain')").execute(&db.pool).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '1ms'").execute(&mut *tx).await.unwrap();
    let woken: bool = sqlx::query_scalar(
        "SELECT woken FROM lockgate._enqueue_many_and_wake('plain', ARRAY['{}'::jsonb], '{}', true)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let timeout: String = sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut *tx).await.unwrap();
    assert_eq!((woken, timeout.as_str()), (true, "0"));
    tx.rollback().await.unwrap();
    // Busy: nothing sent, and the session's setting left alone.
    let busy = busy_notifier(&db.pool).await;
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '1ms'").execute(&mut *tx).await.unwrap();
    let woken: bool =
        sqlx::query_scalar("SELECT lockgate._notify_unless_busy('default')").fetch_one(&mut *tx).await.unwrap();
    let timeout: String = sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut *tx).await.unwrap();
    assert_eq!((woken, timeout.as_str()), (false, "1ms"));
    tx.rollback().await.unwrap();
    busy.rollback().await.unwrap();
}

/// Issue 14: producers that each have a client of their own (web workers with one client
/// apiece, the 16-producer benchmark) share one wake task per runtime, database and login, so
/// enqueues that commit while a wake-up is in flight share the next one, whichever client made them:
/// every client's wake-up comes from the same session. With a task per client, each enqueue
/// cost a wake-up transaction of its own, about 15% of the 16-producer benchmark's rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_of_one_runtime_share_one_wake_task_per_database_and_role() {
    let db = TestDb::migrated().await.unwrap();
    let (pool, first) = shadowed_notify(&db).await;
    let second = Client::new(db.new_pool(2).await.unwrap());
    second.define::<Note>().await.unwrap();
    let busy = busy_notifier(&db.pool).await;

    enqueue_woken(&first, "a").await;
    second.enqueue(&Note { text: "b".into() }).await.unwrap();
    // The second client's flush waits for the shared task, which sent the first one's already.
    second.wakes_sent().await;
    let (c, d) = (Note { text: "c".into() }, Note { text: "d".into() });
    let (a, b) = tokio::join!(first.enqueue(&c), second.enqueue(&d));
    a.unwrap();
    b.unwrap();
    first.wakes_sent().await;
    second.wakes_sent().await;
    let sessions = wake_sessions(&pool).await;
    assert_eq!(sessions.len(), 1, "wake-ups came from several sessions: {sessions:?}");
    // Dropping one client leaves the task to the other.
    drop(first);
    enqueue_woken(&second, "e").await;
    let last: Vec<i32> =
        sqlx::query_scalar("SELECT backend FROM public.notified WHERE NOT had_written AND backend <> $1")
            .bind(sessions[0])
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(last.is_empty(), "the wake task was replaced although a client still held it: {last:?}");
    busy.rollback().await.unwrap();
    assert_eq!(queued(&db).await, 5);
}

/// A shared wake task keeps no client's pool: a new connection comes from the pools of the
/// requests it is sending, the latest first, closed ones skipped, and none is kept after. A
/// client dropped with its pool takes the pool's connections with it (the task kept the pool of
/// the latest request, and with it that pool's connections, until another client's wake-up
/// replaced it), and after the task's session is lost the next wake-up connects through the
/// pool that came with it. Found by a review. (Skipping a pool closed between its request and
/// the task's reconnect is a race this test does not force.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_wake_task_holds_no_clients_pool() {
    let db = TestDb::migrated().await.unwrap();
    let (pool, keeper) = shadowed_notify(&db).await;
    let busy = busy_notifier(&db.pool).await;
    enqueue_woken(&keeper, "a").await;
    let options = pool.connect_options().as_ref().clone().application_name("dropped_client");
    let dropped_pool = sqlx::postgres::PgPoolOptions::new().connect_with(options).await.unwrap();
    // Three idle connections in the pool.
    let (c1, c2, c3) = tokio::join!(dropped_pool.acquire(), dropped_pool.acquire(), dropped_pool.acquire());
    drop((c1.unwrap(), c2.unwrap(), c3.unwrap()));
    let dropped = Client::new(dropped_pool.clone());
    dropped.define::<Note>().await.unwrap();
    // The latest request the task has seen is the dropped client's.
    enqueue_woken(&dropped, "b").await;
    drop((dropped, dropped_pool));
    let named = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'dropped_client'";
    lockgate_testkit::wait_for_count(&db.pool, named, 0, Duration::from_secs(10)).await.unwrap();
    // The task's session ends; the next wake-up reconnects, through the pool that came with it.
    let task: i32 = sqlx::query_scalar("SELECT backend FROM public.notified WHERE NOT had_written LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)").bind(task).execute(&db.pool).await.unwrap();
    notified(&pool).await;
    enqueue_woken(&keeper, "c").await;
    assert_eq!(notified(&pool).await, [("lockgate_default".to_string(), false)], "the keeper's wake-up was lost");
    busy.rollback().await.unwrap();
}

/// Clients that log in as the same user but with other startup options (where a role or a
/// search path may be set) never share a wake task: `lockgate.wake` runs with its session's role
/// and settings, and one client's wake-ups must not run with another's. Found by a review (a
/// client whose options set another role shared the task of a plain one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_with_other_startup_options_never_share_a_wake_task() {
    let db = TestDb::migrated().await.unwrap();
    let (pool, first) = shadowed_notify(&db).await;
    let options = pool.connect_options().as_ref().clone().options([("search_path", "public,pg_catalog")]);
    let second = Client::new(sqlx::postgres::PgPoolOptions::new().connect_with(options).await.unwrap());
    second.define::<Note>().await.unwrap();
    let busy = busy_notifier(&db.pool).await;
    enqueue_woken(&first, "a").await;
    enqueue_woken(&second, "b").await;
    let sessions = wake_sessions(&pool).await;
    assert_eq!(sessions.len(), 2, "clients with other startup options shared a wake task: {sessions:?}");
    busy.rollback().await.unwrap();
}

/// A wake task runs on one Tokio runtime and dies with it, taking along whatever it was asked and
/// had not sent: clients on different runtimes (two runtimes in one process, each test of a
/// suite on its own) never share one, so a runtime shutting down loses no other runtime's
/// wake-ups. Each runtime's clients send theirs from a session of their own.
#[test]
fn clients_on_different_runtimes_never_share_a_wake_task() {
    let runtime = || tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (first_rt, second_rt) = (runtime(), runtime());
    let db = first_rt.block_on(TestDb::migrated()).unwrap();
    let (pool, first) = first_rt.block_on(shadowed_notify(&db));
    let second = second_rt.block_on(async {
        let second = Client::new(db.new_pool(2).await.unwrap());
        second.define::<Note>().await.unwrap();
        second
    });
    // On a pool of the second runtime, whose connections outlive the first.
    let busy = second_rt.block_on(async { busy_notifier(&db.new_pool(1).await.unwrap()).await });
    first_rt.block_on(async {
        enqueue_woken(&first, "a").await;
    });
    second_rt.block_on(async {
        enqueue_woken(&second, "b").await;
    });
    let sessions: Vec<i32> = first_rt
        .block_on(
            sqlx::query_scalar("SELECT DISTINCT backend FROM public.notified WHERE NOT had_written").fetch_all(&pool),
        )
        .unwrap();
    assert_eq!(sessions.len(), 2, "clients on two runtimes shared a wake task: {sessions:?}");
    // The first runtime goes, and its task with it; the second runtime's clients still wake.
    drop(first);
    drop(first_rt);
    second_rt.block_on(async {
        enqueue_woken(&second, "c").await;
        let woken: i64 = sqlx::query_scalar("SELECT count(*) FROM public.notified WHERE NOT had_written")
            .fetch_one(second.pool())
            .await
            .unwrap();
        assert_eq!(woken, 3);
        busy.rollback().await.unwrap();
    });
}

/// On a current-thread runtime the wake task would run only while the runtime is driven (a
/// synchronous wrapper's `block_on` per call would send wake-ups late, or never): the client
/// notifies in the enqueue's transaction there, as SQL does.
#[tokio::test(flavor = "current_thread")]
async fn on_a_current_thread_runtime_the_client_notifies_in_its_transaction() {
    let db = TestDb::migrated().await.unwrap();
    let (pool, client) = shadowed_notify(&db).await;
    client.enqueue(&Note { text: "a".into() }).await.unwrap();
    assert_eq!(notified(&pool).await, [("lockgate_default".to_string(), true)]);
}

/// The enqueue steps of a queue, with their arguments.
async fn enqueue_steps(db: &TestDb, queue: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT proname::text || '(' || pg_get_function_identity_arguments(oid) || ')' FROM pg_proc
          WHERE pronamespace = 'lockgate'::regnamespace AND proname IN ('_enqueue1_into_' || $1, '_enqueue_into_' || $1)
          ORDER BY 1",
    )
    .bind(queue)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// The queue_steps rows of `lockgate.doctor()`: verdict and detail.
async fn doctor_steps(conn: &mut sqlx::PgConnection) -> Vec<(String, String)> {
    sqlx::query_as("SELECT verdict, detail FROM lockgate.doctor() WHERE check_name = 'queue_steps' ORDER BY detail")
        .fetch_all(conn)
        .await
        .unwrap()
}

/// Issue 14 (docs/design.md §58): every queue has two generated enqueue steps, its table named
/// in their INSERTs. An enqueue runs a step only as lockgate wrote it: one that is missing
/// (dropped by hand), planted by another role under the step's name and arguments, or shadowed
/// by an overload is not run; the enqueue inserts with a statement of its own instead, on each
/// path (one job, many jobs, a job with options), and writes no step and takes no lock in the
/// producer's transaction. `lockgate doctor` names each such step; the next migrate writes them
/// again. The roles live in one transaction, rolled back.
#[tokio::test]
async fn an_enqueue_runs_only_its_queues_own_steps_and_enqueues_without_them() {
    let (db, _client) = setup().await;
    let steps = vec![
        "_enqueue1_into_default(timestamp with time zone, jsonb, jsonb)".to_string(),
        "_enqueue_into_default(timestamp with time zone, jsonb[], jsonb)".to_string(),
    ];
    assert_eq!(enqueue_steps(&db, "default").await, steps, "written with the queue");
    let paths = [
        ("SELECT count(*) FROM lockgate.enqueue('note', '{\"text\": \"one\"}')", 1),
        ("SELECT count(*) FROM lockgate.enqueue_many('note', ARRAY['{\"text\": \"a\"}', '{\"text\": \"b\"}']::jsonb[])", 2),
        ("SELECT * FROM lockgate._enqueue_many_and_wake('note', ARRAY['{\"text\": \"c\"}', '{}']::jsonb[], '{}', false)", 2),
        ("SELECT count(*) FROM lockgate.enqueue('note', '{\"text\": \"later\"}', '{\"delay\": 60}')", 1),
    ];
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let mut expected = 0;
    let enqueue_each = async |tx: &mut sqlx::PgConnection, expected: &mut i64, what: &str| {
        for (path, jobs) in paths {
            sqlx::query(path).execute(&mut *tx).await.expect(path);
            *expected += jobs;
            let queued: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pgmq.q_default").fetch_one(&mut *tx).await.unwrap();
            assert_eq!(queued, *expected, "{what}: {path} enqueued");
        }
    };
    // Through the steps, so that this session has checked them and kept their oids.
    enqueue_each(&mut tx, &mut expected, "as written").await;
    // Missing.
    sqlx::raw_sql(
        "DROP FUNCTION lockgate._enqueue1_into_default(timestamptz, jsonb, jsonb);
         DROP FUNCTION lockgate._enqueue_into_default(timestamptz, jsonb[], jsonb);",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    enqueue_each(&mut tx, &mut expected, "missing").await;
    assert_eq!(
        doctor_steps(&mut tx).await,
        vec![
            ("warn".to_string(), "queue default: lockgate._enqueue1_into_default is missing".to_string()),
            ("warn".to_string(), "queue default: lockgate._enqueue_into_default is missing".to_string()),
        ]
    );
    // Planted by another role, under the names and arguments of the steps; and an overload.
    let other = format!("{}_other", db.name);
    sqlx::raw_sql(&format!(
        "CREATE ROLE {other} NOLOGIN; GRANT USAGE, CREATE ON SCHEMA lockgate TO {other};
         SET LOCAL ROLE {other};
         CREATE FUNCTION lockgate._enqueue1_into_default(timestamptz, jsonb, jsonb)
             RETURNS bigint LANGUAGE sql AS 'SELECT -1::bigint';
         CREATE FUNCTION lockgate._enqueue_into_default(timestamptz, jsonb[], jsonb)
             RETURNS SETOF bigint LANGUAGE sql AS 'SELECT -1::bigint';
         RESET ROLE;"
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    enqueue_each(&mut tx, &mut expected, "planted").await;
    let doctor = doctor_steps(&mut tx).await;
    assert!(
        doctor.iter().all(|(verdict, detail)| verdict == "warn" && detail.contains(&format!("owned by {other}"))),
        "{doctor:?}"
    );
    sqlx::raw_sql(
        "DROP FUNCTION lockgate._enqueue1_into_default(timestamptz, jsonb, jsonb);
         DROP FUNCTION lockgate._enqueue_into_default(timestamptz, jsonb[], jsonb);
         SELECT lockgate._install_enqueue_steps('default');
         CREATE FUNCTION lockgate._enqueue1_into_default(timestamptz, jsonb, jsonb, integer DEFAULT 0)
             RETURNS bigint LANGUAGE sql AS 'SELECT -1::bigint';
         CREATE FUNCTION lockgate._enqueue_into_default(timestamptz, jsonb[], jsonb, integer DEFAULT 0)
             RETURNS SETOF bigint LANGUAGE sql AS 'SELECT -1::bigint';",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    enqueue_each(&mut tx, &mut expected, "overloaded").await;
    let negative: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgmq.q_default WHERE msg_id < 0").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(negative, 0, "no planted function ran");
    // What migrate does for every queue: the overloads go, the steps are lockgate's again.
    sqlx::query("SELECT lockgate._install_enqueue_steps('default')").execute(&mut *tx).await.unwrap();
    assert_eq!(doctor_steps(&mut tx).await.len(), 1);
    assert_eq!(doctor_steps(&mut tx).await[0].0, "ok");
    tx.rollback().await.unwrap();
    assert_eq!(enqueue_steps(&db, "default").await, steps);
}

/// Bad input: a job enqueued for a queue that does not exist is refused with LG001 naming it,
/// also when its key is full and it would otherwise wait parked for a queue that never comes.
#[tokio::test]
async fn a_limited_job_for_a_missing_queue_is_refused_even_when_it_would_park() {
    let (db, _client) = setup().await;
    sqlx::query("SELECT lockgate.define_job_type('solo', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('solo', '{}')").execute(&db.pool).await.unwrap();
    let err = sqlx::query("SELECT * FROM lockgate.enqueue('solo', '{}', '{\"queue\": \"missing\"}')")
        .execute(&db.pool)
        .await
        .expect_err("an unknown queue");
    let err = DbError::from(err).to_string();
    assert!(err.contains("queue \"missing\" does not exist"), "{err}");
    assert_eq!(db.count("SELECT 1 FROM lockgate.parked").await.unwrap(), 0, "nothing parked");
}

/// Issue 14 (docs/design.md §59): an enqueue calls no SQL-language function that PostgreSQL runs
/// as a function, planned again in every transaction, rather than inlining it. `_headers` was
/// declared IMMUTABLE around the STABLE `jsonb_build_object`, which made PostgreSQL refuse to
/// inline it: a quarter of a single enqueue's server time. Counted with `track_functions`, which
/// sees only the functions that ran as functions, over a single, a bulk, a limited and a unique
/// enqueue.
#[tokio::test]
async fn an_enqueue_runs_no_sql_function_that_could_have_been_inlined() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client
        .define_job_type(&JobTypeName::new("plain").unwrap(), &JobPolicy::on_queue(common::queue("default")))
        .await
        .unwrap();
    let mut limited = JobPolicy::on_queue(common::queue("default"));
    limited.concurrency = Some(lockgate::ConcurrencyPolicy {
        limit: 5,
        key: vec!["k".into()],
        duration: Duration::from_secs(60),
        on_conflict: lockgate::OnConflict::Block,
    });
    client.define_job_type(&JobTypeName::new("limited").unwrap(), &limited).await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('unique', 'default', unique_mode => 'until_executed', unique_key => ARRAY['u'])")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    sqlx::query("SET LOCAL track_functions = 'all'").execute(&mut *tx).await.unwrap();
    for statement in [
        "SELECT * FROM lockgate.enqueue('plain', '{}')",
        "SELECT * FROM lockgate.enqueue('plain', '{}', '{\"priority\": 3}')",
        "SELECT * FROM lockgate.enqueue_many('plain', ARRAY['{}', '{}']::jsonb[])",
        "SELECT * FROM lockgate._enqueue_many_and_wake('plain', ARRAY['{}', '{}']::jsonb[], '{}', false)",
        "SELECT * FROM lockgate._enqueue_many_and_wake('limited', ARRAY['{\"k\": 2}']::jsonb[], '{}', false)",
        "SELECT * FROM lockgate.enqueue('limited', '{\"k\": 1}')",
        "SELECT * FROM lockgate.enqueue('unique', '{\"u\": 1}')",
    ] {
        sqlx::query(statement).execute(&mut *tx).await.unwrap();
    }
    let ran: Vec<String> = sqlx::query_scalar(
        "SELECT f.funcname::text FROM pg_stat_xact_user_functions f JOIN pg_proc p ON p.oid = f.funcid
          WHERE f.schemaname = 'lockgate' AND p.prolang = (SELECT oid FROM pg_language WHERE lanname = 'sql')
          ORDER BY 1",
    )
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    assert_eq!(ran, Vec::<String>::new(), "SQL functions that ran as functions, not inlined");
    tx.rollback().await.unwrap();
}

/// Functions revision 44 (docs/design.md §68) had the bulk enqueue step return its ids as one
/// array; every other revision's returns a set. Migrate replaces a step of that revision, whose
/// result type no CREATE OR REPLACE may change, and bulk enqueues go through the new one, in order.
#[tokio::test]
async fn migrate_replaces_a_bulk_enqueue_step_of_another_result_type() {
    let (db, client) = setup().await;
    sqlx::raw_sql(
        "DROP FUNCTION lockgate._enqueue_into_default(timestamptz, jsonb[], jsonb);
         CREATE FUNCTION lockgate._enqueue_into_default(timestamptz, jsonb[], jsonb) RETURNS bigint[]
         LANGUAGE plpgsql AS $$
         DECLARE
             ids bigint[];
         BEGIN
             WITH e AS (INSERT INTO pgmq.q_default (vt, message, headers) SELECT $1, a.v, $3 FROM unnest($2) a(v)
                        RETURNING msg_id)
             SELECT COALESCE(array_agg(e.msg_id), '{}') INTO ids FROM e;
             RETURN ids;
         END $$;
         UPDATE lockgate.schema_state SET functions_revision = functions_revision - 1;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    lockgate::migrate(&db.pool).await.expect("migrate writes the step again");
    let result: String = sqlx::query_scalar(
        "SELECT pg_get_function_result('lockgate._enqueue_into_default(timestamptz, jsonb[], jsonb)'::regprocedure)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(result, "SETOF bigint");
    let notes: Vec<Note> = (0..50).map(|i| Note { text: i.to_string() }).collect();
    let jobs = client.enqueue_many(&notes).await.unwrap();
    let texts: Vec<String> = sqlx::query_scalar(
        "SELECT m.message->>'text' FROM unnest($1::bigint[]) WITH ORDINALITY j(id, i)
           JOIN pgmq.q_default m ON m.msg_id = j.id ORDER BY j.i",
    )
    .bind(jobs.iter().map(|j| j.msg_id.expect("enqueued")).collect::<Vec<i64>>())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(texts, (0..50).map(|i| i.to_string()).collect::<Vec<_>>());
}

/// A step of another result type that something depends on cannot be replaced: migrate fails,
/// says why and names the dependent in the detail, and changes nothing; once the dependent is
/// gone, it replaces the step.
#[tokio::test]
async fn migrate_names_what_depends_on_a_step_it_must_replace() {
    let (db, _client) = setup().await;
    sqlx::raw_sql(
        "DROP FUNCTION lockgate._enqueue_into_default(timestamptz, jsonb[], jsonb);
         CREATE FUNCTION lockgate._enqueue_into_default(timestamptz, jsonb[], jsonb) RETURNS bigint[]
         LANGUAGE sql AS 'SELECT ARRAY[]::bigint[]';
         CREATE FUNCTION public.my_enqueue(a jsonb[]) RETURNS bigint[] LANGUAGE sql
         BEGIN ATOMIC SELECT lockgate._enqueue_into_default(now(), a, '{}'); END;
         UPDATE lockgate.schema_state SET functions_revision = functions_revision - 1;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let err = lockgate::migrate(&db.pool).await.expect_err("a dependent blocks the replacement");
    let db_err = match &err {
        DbError::Sqlx(sqlx::Error::Database(e)) => e.downcast_ref::<sqlx::postgres::PgDatabaseError>(),
        other => panic!("unexpected error {other:?}"),
    };
    assert!(db_err.message().contains("must be replaced"), "{}", db_err.message());
    assert!(db_err.detail().unwrap_or_default().contains("my_enqueue"), "{:?}", db_err.detail());
    assert!(!db_err.hint().unwrap_or_default().contains("CASCADE"), "{:?}", db_err.hint());
    sqlx::query("DROP FUNCTION public.my_enqueue(jsonb[])").execute(&db.pool).await.unwrap();
    lockgate::migrate(&db.pool).await.expect("nothing depends on it now");
}

/// Review (helper-77, #13): a queue whose table name another application's table holds failed
/// with `column "vt" does not exist` (PGMQ skips a table that exists), naming neither.
#[tokio::test]
async fn a_queue_whose_table_name_is_another_tables_is_refused_naming_it() {
    let (db, _client) = setup().await;
    sqlx::raw_sql("CREATE TABLE pgmq.q_clash (x integer); CREATE TABLE pgmq.a_clash2 (x integer);")
        .execute(&db.pool)
        .await
        .unwrap();
    for (queue, table) in [("clash", "pgmq.q_clash"), ("clash2", "pgmq.a_clash2")] {
        let err = sqlx::query("SELECT lockgate.create_queue($1)").bind(queue).execute(&db.pool).await.unwrap_err();
        let db_err = err.as_database_error().unwrap();
        assert_eq!(db_err.code().as_deref(), Some("LG003"), "{db_err}");
        assert!(db_err.message().contains(&format!("{table} exists and is not a PGMQ queue's table")), "{db_err}");
    }
}

/// A wake-up whose replies never come (a flow the network dropped without a reset) is given up
/// with its connection, and tried again on a new one: `Client::wakes_sent` returns, and the
/// wake-up is sent. Awaited for good, `wakes_sent` (so `lockgate enqueue`, which awaits it before
/// it prints the job) and every later wake-up of the task hung (review helper-141 F8).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_whose_replies_never_come_is_given_up_and_sent_again() {
    let (db, _) = setup().await;
    let proxy = lockgate_testkit::FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&proxy.url_for(&db.url)).await.unwrap();
    let client = Client::new(pool);
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener.listen("lockgate_default").await.unwrap();
    // The enqueue leaves its wake-up to the wake task, whose first statement's replies vanish.
    let busy = busy_notifier(&db.pool).await;
    proxy.swallow_replies_to_request_containing("lockgate.wake(");
    client.enqueue(&Note { text: "a".into() }).await.unwrap();
    tokio::time::timeout(Duration::from_secs(15), client.wakes_sent()).await.expect("wakes_sent returned");
    assert!(proxy.met_marked_reply(), "the wake-up's replies were swallowed");
    busy.rollback().await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a wake-up was sent after the one given up")
        .unwrap();
}

/// An enqueue whose reply is lost after its commit (the connection cut between the server's
/// answer and the client) returns an error that says the job may have been enqueued, as it was;
/// a refusal says nothing was. Before, the error said only "transient", and the type's docs
/// "nothing is enqueued": retried as told, the job was enqueued twice (review helper-141 F3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_whose_reply_is_lost_after_its_commit_says_it_may_have_committed() {
    let (db, _) = setup().await;
    let proxy = lockgate_testkit::FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&proxy.url_for(&db.url)).await.unwrap();
    let client = Client::new(pool);
    // The client's own connection taken and used: the next reply through the proxy is the enqueue's.
    client.enqueue(&Note { text: "first".into() }).await.unwrap();
    proxy.cut_next_reply();
    let err = client.enqueue(&Note { text: "lost".into() }).await.unwrap_err();
    assert!(proxy.has_cut(), "the reply was cut");
    assert!(err.may_have_committed() && err.is_transient(), "{err:?}");
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default WHERE message->>'text' = 'lost'").await.unwrap(), 1);
    let refused = client.enqueue_raw("missing", &json!({}), &EnqueueOptions::default()).await.unwrap_err();
    assert!(!refused.may_have_committed(), "{refused:?}");
}

/// An enqueue whose backend the server ends under it (an administrator's `pg_terminate_backend`,
/// a server shutting down: SQLSTATE 57P01, which is also what PgBouncer says when a server
/// connection it pooled goes away) may have committed as far as the client can tell: it says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_whose_backend_is_terminated_says_it_may_have_committed() {
    let (db, client) = setup().await;
    // The enqueue waits for the job types' table, which a migration-like transaction holds.
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE lockgate.job_types IN ACCESS EXCLUSIVE MODE").execute(&mut *holder).await.unwrap();
    let enqueue = tokio::spawn(async move { client.enqueue(&Note { text: "cut".into() }).await });
    let waiting =
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' LIMIT 1";
    let until = std::time::Instant::now() + common::WAIT;
    let pid = loop {
        if let Some(pid) = sqlx::query_scalar::<_, i32>(waiting).fetch_optional(&db.pool).await.unwrap() {
            break pid;
        }
        assert!(std::time::Instant::now() < until, "the enqueue never waited for the lock");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&db.pool).await.unwrap();
    let err = tokio::time::timeout(common::WAIT, enqueue).await.expect("the enqueue returned").unwrap().unwrap_err();
    holder.rollback().await.unwrap();
    assert!(
        matches!(&err, EnqueueError::Database(DbError::Sqlx(sqlx::Error::Database(e))) if e.code().as_deref() == Some("57P01")),
        "{err:?}"
    );
    assert!(err.may_have_committed(), "{err:?}");
}
