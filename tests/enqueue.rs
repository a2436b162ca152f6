//! Enqueue from Rust and SQL: transactional (G8), batched, delayed, prioritised, and every bad
//! input refused with an error that names it, leaving nothing behind.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use lockgate::{Client, DbError, EnqueueError, EnqueueOptions, Job, JobPolicy, JobTypeName};
use lockgate_testkit::TestDb;
use serde::{Deserialize, Serialize};
use serde_json::json;

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
    let (db, _client) = setup().await;
    let mut tx = db.pool.begin().await.unwrap();
    Client::enqueue_in(&mut tx, &Note { text: "x".into() }, &EnqueueOptions::default()).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(queued(&db).await, 0);
}

#[tokio::test]
async fn g8_rust_enqueue_in_committed_transaction_exists_only_after_commit() {
    let (db, _client) = setup().await;
    let mut tx = db.pool.begin().await.unwrap();
    let job = Client::enqueue_in(&mut tx, &Note { text: "x".into() }, &EnqueueOptions::default()).await.unwrap();
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
    let jobs = client.enqueue_many(&notes, &EnqueueOptions::default()).await.unwrap();
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

#[tokio::test]
async fn delayed_jobs_are_invisible_until_their_time() {
    let (db, client) = setup().await;
    let options = EnqueueOptions { delay: Some(Duration::from_secs(3600)), ..Default::default() };
    client.enqueue(&Note { text: "later".into() }, &options).await.unwrap();
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
        let err = DbError::from(err).to_string();
        assert!(err.contains(expected), "{sql}: expected {expected:?} in {err:?}");
    }
    assert_eq!(queued(&db).await, 0, "nothing was enqueued by a refused call");
}

#[tokio::test]
async fn bad_rust_inputs_are_refused_before_or_by_the_database() {
    let (db, client) = setup().await;
    let err = client.enqueue(&NotAnObject(3), &EnqueueOptions::default()).await.unwrap_err();
    assert!(matches!(err, EnqueueError::NotAnObject { .. }), "{err}");
    let err = client.enqueue_raw("missing_type", &json!({}), &EnqueueOptions::default()).await.unwrap_err();
    assert!(matches!(err, EnqueueError::Database(DbError::UnknownJobType(_))), "{err}");
    let options = EnqueueOptions { priority: Some(42), ..Default::default() };
    let err = client.enqueue(&Note { text: "x".into() }, &options).await.unwrap_err();
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
    let one = client.enqueue(&Note { text: "a".into() }, &EnqueueOptions::default()).await.unwrap();
    let with_options = EnqueueOptions { priority: Some(3), ..Default::default() };
    let two = client.enqueue(&Note { text: "b".into() }, &with_options).await.unwrap();
    let many =
        client.enqueue_many(&[Note { text: "c".into() }, Note { text: "d".into() }], &with_options).await.unwrap();
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
            tokio::spawn(async move { client.enqueue(&Note { text: i.to_string() }, &EnqueueOptions::default()).await })
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
    let _ = client.enqueue(&Note { text: "after".into() }, &EnqueueOptions::default()).await;
    client.enqueue(&Note { text: "after".into() }, &EnqueueOptions::default()).await.unwrap();
    client.enqueue_many(&[Note { text: "x".into() }], &EnqueueOptions::default()).await.unwrap();
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
