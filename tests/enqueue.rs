//! Enqueue from Rust and SQL: transactional (G8), batched, delayed, prioritised, and every bad
//! input refused with an error that names it, leaving nothing behind.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use lockgate::{Client, DbError, EnqueueError, EnqueueOptions, Job, JobPolicy};
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
