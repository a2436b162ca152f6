//! The small API's pieces not covered by the examples: the runtime builder's mistakes and
//! default pools, and `lockgate::testing::enqueued` on options, other types and bad arguments.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use lockgate::testing::{self, EnqueuedError};
use lockgate::{Client, EnqueueOptions, Job, JobContext, JobError, JobPolicy, QueueName, Runtime, RuntimeError};
use lockgate_testkit::TestDb;
use serde::{Deserialize, Serialize};
use serde_json::json;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Mail {
    to: String,
}

impl Job for Mail {
    const TYPE: &'static str = "mail";

    fn policy() -> JobPolicy {
        JobPolicy::builder().queue("mail").build().unwrap()
    }
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Other {
    n: u32,
}

impl Job for Other {
    const TYPE: &'static str = "other";
}

fn mistake(result: Result<Runtime, RuntimeError>) -> &'static str {
    match result {
        Err(RuntimeError::Config(err)) => err.field,
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

async fn noop(_ctx: JobContext, _job: Mail) -> Result<(), JobError> {
    Ok(())
}

#[tokio::test]
async fn the_builder_returns_its_first_mistake() {
    // Building touches no database.
    let pool = lockgate::PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/none").unwrap();
    assert_eq!(mistake(Runtime::builder(pool.clone()).queue("Not A Queue", 1).queue("mail", 0).build()), "queue");
    assert_eq!(mistake(Runtime::builder(pool.clone()).queue("mail", 0).build()), "concurrency");
    let short = Runtime::builder(pool.clone()).register::<Mail>(noop).visibility_timeout(Duration::from_millis(1));
    assert_eq!(mistake(short.build()), "visibility_timeout");
    // Two handlers under one name: the second replaced the first in silence (review helper-145 F4).
    let twice = Runtime::builder(pool.clone()).register::<Mail>(noop).register::<Mail>(noop).queue("mail", 2);
    assert_eq!(mistake(twice.build()), "job_type");
    Runtime::builder(pool).register::<Mail>(noop).queue("mail", 2).build().unwrap();
}

#[tokio::test]
async fn without_queues_the_builder_serves_the_queues_of_the_registered_policies() {
    let db = TestDb::migrated().await.unwrap();
    Client::new(db.pool.clone()).enqueue(&Mail { to: "a".into() }).await.unwrap();
    let (ran, mut done) = tokio::sync::mpsc::unbounded_channel();
    let runtime = Runtime::builder(db.new_pool(4).await.unwrap())
        .register::<Mail>(move |_ctx: JobContext, job: Mail| {
            let ran = ran.clone();
            async move { Ok::<(), JobError>(ran.send(job.to)?) }
        })
        .poll_interval(Duration::from_millis(100))
        .run_until(async move {
            done.recv().await;
        });
    tokio::time::timeout(Duration::from_secs(30), runtime).await.expect("ran the job and stopped").unwrap();
    let state: String =
        sqlx::query_scalar("SELECT state FROM lockgate.jobs(job_type => 'mail')").fetch_one(&db.pool).await.unwrap();
    assert_eq!(state, "succeeded");
}

#[tokio::test]
async fn enqueued_lists_what_the_transaction_sees_and_a_rollback_leaves_nothing() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.enqueue(&Mail { to: "committed".into() }).await.unwrap();
    client.define::<Other>().await.unwrap(); // creates the queue `default`
    let mut tx = db.pool.begin().await.unwrap();
    let options = EnqueueOptions {
        queue: Some(QueueName::new("default").unwrap()),
        priority: Some(1),
        delay: Some(Duration::from_secs(60)),
        ..Default::default()
    };
    client.enqueue_in_with(&mut tx, &Mail { to: "in tx".into() }, &options).await.unwrap();
    client.enqueue_in(&mut tx, &Other { n: 1 }).await.unwrap();

    let mails = testing::enqueued::<Mail>(&mut tx).await.unwrap();
    let seen: Vec<_> = mails.iter().map(|m| (m.job.to.as_str(), m.record.queue.as_str(), m.record.priority)).collect();
    assert_eq!(seen, [("committed", "mail", 0), ("in tx", "default", 1)], "oldest first, with its options");
    assert_eq!(mails[1].record.state, "scheduled");
    let others = testing::enqueued::<Other>(&mut tx).await.unwrap();
    assert_eq!(others.iter().map(|o| &o.job).collect::<Vec<_>>(), [&Other { n: 1 }]);
    tx.rollback().await.unwrap();

    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(testing::enqueued::<Mail>(&mut conn).await.unwrap().len(), 1);
    assert!(testing::enqueued::<Other>(&mut conn).await.unwrap().is_empty());

    // Arguments that do not decode into the type are an error naming the job.
    let bad = client.enqueue_raw("mail", &json!({"address": "x"}), &EnqueueOptions::default()).await.unwrap();
    match testing::enqueued::<Mail>(&mut conn).await {
        Err(EnqueuedError::Decode { id, job_type: "mail", .. }) => assert_eq!(id, bad.job_id),
        other => panic!("expected a decode error, got {other:?}"),
    }
}

/// Review helper-145 F1: `RuntimeBuilder::run` listened for ctrl-c and SIGTERM once; the
/// handlers it installed took their default action away for the life of the process, so while a
/// graceful shutdown waited for a handler that blocks its thread, a second ctrl-c or TERM did
/// nothing. A second signal, a second or more after the first, now exits at once with 130. The
/// test runs itself again as the program under test (`LOCKGATE_SIGNAL_CHILD`).
#[test]
fn a_second_signal_during_a_graceful_shutdown_exits_at_once() {
    const NAME: &str = "a_second_signal_during_a_graceful_shutdown_exits_at_once";
    let tokio = tokio::runtime::Runtime::new().unwrap();
    if let Ok(url) = std::env::var("LOCKGATE_SIGNAL_CHILD") {
        tokio.block_on(async {
            let pool = lockgate::PgPool::connect(&url).await.unwrap();
            let client = Client::new(pool.clone());
            client.define::<Mail>().await.unwrap();
            client.enqueue(&Mail { to: "a".into() }).await.unwrap();
            let stuck = |_ctx: JobContext, _job: Mail| async {
                std::thread::sleep(Duration::from_secs(60));
                Ok::<(), JobError>(())
            };
            Runtime::builder(pool).register::<Mail>(stuck).queue("mail", 1).run().await.unwrap();
        });
        return;
    }
    tokio.block_on(async {
        let db = TestDb::migrated().await.unwrap();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env("LOCKGATE_SIGNAL_CHILD", &db.url)
            .spawn()
            .unwrap();
        let started = lockgate_testkit::wait_for("the job to start", Duration::from_secs(30), || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pgmq.q_mail WHERE read_ct > 0")
                .fetch_one(&db.pool)
                .await
                .unwrap_or(0);
            Ok((n > 0).then_some(()))
        })
        .await;
        if started.is_err() {
            let _ = child.kill();
        }
        started.unwrap();
        lockgate_testkit::chaos::send_signal(&[child.id()], "INT");
        // The second signal must come a second or more after the first to count.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        lockgate_testkit::chaos::send_signal(&[child.id()], "INT");
        let until = std::time::Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if std::time::Instant::now() > until {
                let _ = child.kill();
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(status.and_then(|s| s.code()), Some(130), "the second signal ended the program at once");
    });
}
