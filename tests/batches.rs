//! Batches (issue 11, G2, H22): counted in the completion and dead-letter transactions, gated by
//! their fenced statements; callbacks enqueued exactly once, by the transaction that counts a
//! closed batch's last job. SQL-level tests race completions on two connections; the runtime
//! test runs a batch of 1,000 jobs with failures through real workers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use lockgate::{
    BatchCallbacks, BatchId, Client, EnqueueOptions, JobContext, JobError, JobPolicy, JobTypeName, RawHandler, Registry,
};
use lockgate_testkit::{wait_for, wait_for_count, TestDb};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection, PgPool, Row};

/// (msg_id, read_ct)
type Delivery = (i64, i32);

async fn setup() -> TestDb {
    let db = TestDb::migrated().await.unwrap();
    for t in ["work", "done", "ok", "bad"] {
        sqlx::query("SELECT lockgate.define_job_type($1)").bind(t).execute(&db.pool).await.unwrap();
    }
    db
}

async fn create_batch(db: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT lockgate.create_batch('done', 'ok', 'bad', '{\"report\": 7}')")
        .fetch_one(db)
        .await
        .unwrap()
}

async fn add_jobs(db: impl sqlx::PgExecutor<'_>, batch: i64, n: usize) {
    let args: Vec<Value> = (0..n).map(|i| json!({ "i": i })).collect();
    sqlx::query("SELECT * FROM lockgate.enqueue_many('work', $1, jsonb_build_object('batch', $2::bigint))")
        .bind(args)
        .bind(batch)
        .execute(db)
        .await
        .unwrap();
}

async fn close(db: impl sqlx::PgExecutor<'_>, batch: i64) -> Result<String, String> {
    sqlx::query_scalar("SELECT lockgate.close_batch($1)").bind(batch).fetch_one(db).await.map_err(|e| e.to_string())
}

/// Claims every visible job of type work.
async fn claim_work(db: &PgPool) -> Vec<Delivery> {
    sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 100, 30) WHERE headers->>'type' = 'work'")
        .fetch_all(db)
        .await
        .unwrap()
}

/// (state, total, succeeded, failed, pending)
async fn progress(db: &PgPool, batch: i64) -> (String, i64, i64, i64, i64) {
    sqlx::query_as("SELECT state, total, succeeded, failed, pending FROM lockgate.batch($1)")
        .bind(batch)
        .fetch_one(db)
        .await
        .unwrap()
}

/// The callback jobs enqueued, by type, in type order.
async fn callbacks(db: &PgPool) -> Vec<(String, Value)> {
    sqlx::query_as(
        "SELECT headers->>'type', message FROM pgmq.q_default WHERE headers->>'type' IN ('done', 'ok', 'bad')
          ORDER BY headers->>'type'",
    )
    .fetch_all(db)
    .await
    .unwrap()
}

/// Runs a batch sweep: what it returned, and then the batch's callbacks_pending and
/// callback_error.
async fn sweep_callbacks(db: &PgPool, batch: i64) -> (i32, bool, Option<String>) {
    let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(db).await.unwrap();
    let (pending, error) = sqlx::query_as("SELECT callbacks_pending, callback_error FROM lockgate.batch($1)")
        .bind(batch)
        .fetch_one(db)
        .await
        .unwrap();
    (swept, pending, error)
}

/// Which callback (`finish`, `success`, `failure`) each queued job of type `name` is.
async fn callback_kinds(db: &PgPool, name: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT message->>'callback' FROM pgmq.q_default WHERE headers->>'type' = $1 ORDER BY 1")
        .bind(name)
        .fetch_all(db)
        .await
        .unwrap()
}

#[tokio::test]
async fn h22_the_last_two_completions_racing_on_two_connections_enqueue_the_callbacks_once() {
    // With a limited callback type, the sweep that finishes the batch leaves its callbacks to its
    // own second step, and counts the batch once all the same (review helper-101).
    for (last_fails, limited) in [(false, false), (true, false), (false, true)] {
        let db = setup().await;
        if limited {
            sqlx::query("SELECT lockgate.define_job_type('done', concurrency_limit => 1)")
                .execute(&db.pool)
                .await
                .unwrap();
        }
        let batch = create_batch(&db.pool).await;
        add_jobs(&db.pool, batch, 2).await;
        assert_eq!(close(&db.pool, batch).await.unwrap(), "closed");
        let claimed = claim_work(&db.pool).await;
        assert_eq!(claimed.len(), 2);
        // The first completion is in, not committed, holding the batch's row; the second, on
        // another connection, does not wait for it: its count waits on its membership (design
        // §73). Neither finishes the batch; the batch sweep does, once.
        let mut first = PgConnection::connect(&db.url).await.unwrap();
        let mut tx = first.begin().await.unwrap();
        assert!(common::complete_default(&mut *tx, claimed[0]).await);
        let mut conn = PgConnection::connect(&db.url).await.unwrap();
        sqlx::query("SET lock_timeout = '1s'").execute(&mut conn).await.unwrap();
        let second = claimed[1];
        assert!(if last_fails {
            common::dead_letter_default(&mut conn, second).await
        } else {
            common::complete_default(&mut conn, second).await
        });
        assert!(callbacks(&db.pool).await.is_empty(), "nothing is finished before the first count commits");
        tx.commit().await.unwrap();
        assert!(callbacks(&db.pool).await.is_empty(), "the first count saw the second's membership");
        let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
        assert_eq!(swept, 1);
        let expected = if last_fails { vec!["bad", "done"] } else { vec!["done", "ok"] };
        let fired: Vec<String> = callbacks(&db.pool).await.into_iter().map(|c| c.0).collect();
        assert_eq!(fired, expected, "each callback exactly once");
        let failed = i64::from(last_fails);
        assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 2, 2 - failed, failed, 0));
        let args = &callbacks(&db.pool).await[1].1;
        assert_eq!(args["batch_id"], json!(batch));
        assert_eq!((args["succeeded"].clone(), args["failed"].clone()), (json!(2 - failed), json!(failed)));
        assert_eq!(args["properties"], json!({ "report": 7 }));
        // Which callback each job is (review helper-92: two callbacks of one type looked alike).
        let kinds: Vec<Value> = callbacks(&db.pool).await.into_iter().map(|c| c.1["callback"].clone()).collect();
        let expected =
            if last_fails { [json!("failure"), json!("finish")] } else { [json!("finish"), json!("success")] };
        assert_eq!(kinds, expected);
    }
}

/// A review of a wait like the batch's (helper-71, finding 4): a count waited its 300 ms for a
/// held batch row whatever the caller's budgets, so a completion under a `statement_timeout`
/// below that (the runtime sets a quarter of the visibility timeout) failed, where it should land
/// with its outcome on the membership. The wait now stays within half the statement timeout and
/// within the caller's `lock_timeout`.
#[tokio::test]
async fn a_completion_under_a_short_statement_timeout_never_times_out_on_a_held_batch_row() {
    // The settings, and whether the statement spends time of its own before the completion: the
    // wait ends half the statement timeout after the statement began (review, helper-73 F4).
    let cases: [(&[&str], bool); 3] = [
        (&["statement_timeout = '200ms'"], false),
        (&["statement_timeout = '200ms'", "lock_timeout = '1min'"], false),
        (&["statement_timeout = '400ms'"], true),
    ];
    for (setting, late) in cases {
        let db = setup().await;
        let batch = create_batch(&db.pool).await;
        add_jobs(&db.pool, batch, 2).await;
        assert_eq!(close(&db.pool, batch).await.unwrap(), "closed");
        let claimed = claim_work(&db.pool).await;
        let mut first = PgConnection::connect(&db.url).await.unwrap();
        let mut tx = first.begin().await.unwrap();
        assert!(common::complete_default(&mut *tx, claimed[0]).await);
        let mut conn = PgConnection::connect(&db.url).await.unwrap();
        for set in setting {
            sqlx::query(&format!("SET {set}")).execute(&mut conn).await.unwrap();
        }
        let statement = if late {
            "SELECT c FROM pg_sleep(0.25), lockgate.complete('default', $1, $2) c"
        } else {
            "SELECT c FROM lockgate.complete('default', $1, $2) c"
        };
        let archived: Vec<i64> = sqlx::query_scalar(statement)
            .bind(vec![claimed[1].0])
            .bind(vec![claimed[1].1])
            .fetch_all(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{setting:?}, late {late}: {e}"));
        assert_eq!(archived, vec![claimed[1].0]);
        tx.commit().await.unwrap();
        let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
        assert_eq!(swept, 1, "{setting:?}");
        assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 2, 2, 0, 0), "{setting:?}");
    }
}

#[tokio::test]
async fn h22_closing_a_batch_while_its_last_job_completes_finishes_it_once() {
    for close_first in [true, false] {
        let db = setup().await;
        let batch = create_batch(&db.pool).await;
        add_jobs(&db.pool, batch, 1).await;
        let claimed = claim_work(&db.pool).await;
        let mut first = PgConnection::connect(&db.url).await.unwrap();
        let mut tx = first.begin().await.unwrap();
        let url = db.url.clone();
        if close_first {
            // The completion does not wait for the close's row lock (its count waits on its
            // membership, design §73); the batch sweep finishes the batch once the close commits.
            sqlx::query("SELECT lockgate.close_batch($1)").bind(batch).execute(&mut *tx).await.unwrap();
            let mut conn = PgConnection::connect(&url).await.unwrap();
            sqlx::query("SET lock_timeout = '1s'").execute(&mut conn).await.unwrap();
            assert!(common::complete_default(&mut conn, claimed[0]).await);
            tx.commit().await.unwrap();
            let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
            assert_eq!(swept, 1);
        } else {
            assert!(common::complete_default(&mut *tx, claimed[0]).await);
            let racer = tokio::spawn(async move {
                let mut conn = PgConnection::connect(&url).await.unwrap();
                sqlx::query("SELECT lockgate.close_batch($1)").bind(batch).execute(&mut conn).await.unwrap();
            });
            common::until_one_waits_for_a_lock(&db.pool).await;
            tx.commit().await.unwrap();
            racer.await.unwrap();
        }
        let fired: Vec<String> = callbacks(&db.pool).await.into_iter().map(|c| c.0).collect();
        assert_eq!(fired, vec!["done", "ok"], "close_first {close_first}");
        assert_eq!(progress(&db.pool, batch).await.0, "finished");
    }
}

/// Review of §73 (helper-70, F1): with counts that waited only a few milliseconds for the batch's
/// row, the last completions of a closed batch, racing in autocommit, often all left their counts
/// on their memberships, and the batch was left closed, with nothing pending and no callbacks,
/// for the batch sweep. A count waits for another count's commit: the last one finishes the batch.
#[tokio::test]
async fn the_last_completions_of_a_batch_racing_in_autocommit_finish_it_without_the_sweep() {
    let db = setup().await;
    for _ in 0..4 {
        sqlx::query("DELETE FROM pgmq.q_default").execute(&db.pool).await.unwrap();
        let batch = create_batch(&db.pool).await;
        add_jobs(&db.pool, batch, 16).await;
        close(&db.pool, batch).await.unwrap();
        let claimed = claim_work(&db.pool).await;
        assert_eq!(claimed.len(), 16);
        let racers: Vec<_> = claimed
            .into_iter()
            .map(|d| {
                let url = db.url.clone();
                tokio::spawn(async move {
                    let mut conn = PgConnection::connect(&url).await.unwrap();
                    common::complete_default(&mut conn, d).await
                })
            })
            .collect();
        for r in racers {
            assert!(r.await.unwrap());
        }
        assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 16, 16, 0, 0));
        let fired: Vec<String> = callbacks(&db.pool).await.into_iter().map(|c| c.0).collect();
        assert_eq!(fired, vec!["done", "ok"], "each callback once, enqueued by the last count");
    }
}

#[tokio::test]
async fn a_duplicate_or_stale_delivery_and_a_retry_count_once() {
    let db = setup().await;
    let batch = create_batch(&db.pool).await;
    add_jobs(&db.pool, batch, 2).await;
    close(&db.pool, batch).await.unwrap();
    let first = claim_work(&db.pool).await;
    // Job 1 fails once and retries in place; job 2's lease is lost and it is delivered again.
    sqlx::query("SELECT lockgate.retry('default', $1, $2, 0, 'failed', 1)")
        .bind(first[0].0)
        .bind(first[0].1)
        .execute(&db.pool)
        .await
        .unwrap();
    db.expire_visibility("default", first[1].0).await.unwrap();
    let second = claim_work(&db.pool).await;
    assert_eq!(second.len(), 2);
    assert_eq!(progress(&db.pool, batch).await, ("closed".to_string(), 2, 0, 0, 2), "a retry counts nothing");
    for d in &second {
        assert!(common::complete_default(&db.pool, *d).await);
    }
    assert!(!common::complete_default(&db.pool, first[1]).await, "the stale delivery");
    assert!(!common::dead_letter_default(&db.pool, first[1]).await, "the stale delivery");
    assert!(!common::complete_default(&db.pool, second[1]).await, "the duplicate");
    assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 2, 2, 0, 0));
    assert_eq!(callbacks(&db.pool).await.len(), 2, "on_finish and on_success, once each");
}

#[tokio::test]
async fn batches_count_jobs_added_in_several_calls_parked_jobs_and_skip_duplicates() {
    let db = setup().await;
    sqlx::query("SELECT lockgate.define_job_type('lim', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    sqlx::query(
        "SELECT lockgate.define_job_type('uniq', unique_mode => 'until_executed', unique_on_conflict => 'discard')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let batch = create_batch(&db.pool).await;
    let opts = json!({ "batch": batch });
    for t in ["lim", "lim", "uniq", "uniq"] {
        sqlx::query("SELECT * FROM lockgate.enqueue($1, '{}', $2)")
            .bind(t)
            .bind(&opts)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    assert_eq!(progress(&db.pool, batch).await, ("open".to_string(), 3, 0, 0, 3), "the duplicate is not counted");
    let empty = create_batch(&db.pool).await;
    assert_eq!(close(&db.pool, empty).await.unwrap(), "finished", "an empty batch finishes when closed");
    close(&db.pool, batch).await.unwrap();
    // Drain: the parked lim job is promoted by the first one's completion, then counted.
    wait_for("every job of the batch to be counted", Duration::from_secs(10), || async {
        let claimed: Vec<Delivery> = sqlx::query_as(
            "SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30) WHERE headers->>'type' IN ('lim', 'uniq')",
        )
        .fetch_all(&db.pool)
        .await?;
        for d in claimed {
            common::complete_default(&db.pool, d).await;
        }
        Ok((progress(&db.pool, batch).await.0 == "finished").then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 3, 3, 0, 0));
    assert_eq!(callbacks(&db.pool).await.len(), 4, "two callbacks for each batch");
}

#[tokio::test]
async fn callbacks_that_cannot_be_enqueued_stay_pending_until_the_sweep_enqueues_them() {
    let db = setup().await;
    let batch = create_batch(&db.pool).await;
    add_jobs(&db.pool, batch, 1).await;
    close(&db.pool, batch).await.unwrap();
    // An operator removed the callback type meanwhile: the completion must still land.
    sqlx::query("DELETE FROM lockgate.job_types WHERE name = 'done'").execute(&db.pool).await.unwrap();
    let claimed = claim_work(&db.pool).await;
    assert!(common::complete_default(&db.pool, claimed[0]).await);
    let pending = |pool: PgPool| async move {
        let row = sqlx::query("SELECT state, callbacks_pending, callback_error FROM lockgate.batch($1)")
            .bind(batch)
            .fetch_one(&pool)
            .await
            .unwrap();
        (row.get::<String, _>(0), row.get::<bool, _>(1), row.get::<Option<String>, _>(2))
    };
    assert_eq!(pending(db.pool.clone()).await, ("finished".to_string(), true, None), "left to the sweep");
    assert!(callbacks(&db.pool).await.is_empty(), "all of them or none");
    let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(swept, 0, "still not enqueueable");
    let (_, still, error) = pending(db.pool.clone()).await;
    assert!(still && error.unwrap().contains("unknown job type \"done\""));
    assert!(callbacks(&db.pool).await.is_empty(), "all of them or none");
    sqlx::query("SELECT lockgate.define_job_type('done')").execute(&db.pool).await.unwrap();
    let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(swept, 1);
    let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(swept, 0, "and never twice");
    assert_eq!(callbacks(&db.pool).await.len(), 2);
}

#[tokio::test]
async fn bad_batch_input_is_refused_with_a_clear_error() {
    let db = setup().await;
    let err = |sql: String| {
        let pool = db.pool.clone();
        async move { sqlx::query(&sql).execute(&pool).await.unwrap_err().to_string() }
    };
    assert!(err("SELECT lockgate.create_batch(on_finish => 'nope')".into())
        .await
        .contains("unknown job type \"nope\" for the batch callback on_finish"));
    assert!(err("SELECT lockgate.create_batch(properties => '[1]')".into()).await.contains("must be a JSON object"));
    let batch = create_batch(&db.pool).await;
    assert!(err("SELECT lockgate.close_batch(999)".into()).await.contains("batch 999 does not exist"));
    // Review helper-131 F4: a NULL id, and negative bounds of the operators' passes, named.
    assert!(err("SELECT lockgate.close_batch(NULL)".into()).await.contains("the batch id is NULL"));
    assert!(err("SELECT lockgate.batch_sweep(-1)".into()).await.contains("max_rows must not be negative (got -1)"));
    for sql in ["SELECT lockgate.reap_batches('-1 hour', 10)", "SELECT lockgate.reap_unique_locks('-1 hour', 10)"] {
        let e = err(sql.into()).await;
        assert!(e.contains("must not be negative (got -01:00:00, 10)"), "{e}");
    }
    assert!(err("SELECT * FROM lockgate.enqueue('work', '{}', '{\"batch\": 999}')".into())
        .await
        .contains("batch 999 does not exist"));
    assert!(err("SELECT * FROM lockgate.enqueue('work', '{}', '{\"batch\": \"x\"}')".into())
        .await
        .contains("invalid batch"));
    close(&db.pool, batch).await.unwrap();
    assert!(close(&db.pool, batch).await.unwrap_err().contains("is already finished"));
    let closed = create_batch(&db.pool).await;
    add_jobs(&db.pool, closed, 1).await;
    close(&db.pool, closed).await.unwrap();
    assert!(close(&db.pool, closed).await.unwrap_err().contains("is already closed"));
    for b in [batch, closed] {
        let e = err(format!("SELECT * FROM lockgate.enqueue_many('work', array['{{}}'::jsonb], '{{\"batch\": {b}}}')"))
            .await;
        assert!(e.contains("no job can be added to it"), "{e}");
    }
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default WHERE headers->>'type' = 'work'").await.unwrap(), 1);
}

/// The runtime test's handler: work jobs fail when their i is a multiple of 20; callbacks
/// record themselves in the table fired.
struct Handlers {
    pool: PgPool,
}

impl RawHandler for Handlers {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(async move {
            if ctx.job_type == "work" {
                if args["i"].as_u64().unwrap_or(0) % 20 == 0 {
                    return Err(JobError::new("every twentieth job fails"));
                }
                return Ok(());
            }
            sqlx::query("INSERT INTO fired VALUES ($1, $2)")
                .bind(&ctx.job_type)
                .bind(args)
                .execute(&self.pool)
                .await
                .map_err(|e| JobError::new(e.to_string()))?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn a_batch_of_1000_jobs_run_by_8_workers_with_50_failures_fires_on_finish_and_on_failure_once() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql("CREATE TABLE fired (job_type text, args jsonb)").execute(&db.pool).await.unwrap();
    let client = Client::new(db.pool.clone());
    let handlers = Arc::new(Handlers { pool: db.pool.clone() });
    let mut registry = Registry::new();
    for name in ["work", "done", "ok", "bad"] {
        let mut policy = JobPolicy::on_queue(common::queue("default"));
        policy.max_attempts = 1;
        client.define_job_type(&JobTypeName::new(name).unwrap(), &policy).await.unwrap();
        registry.register_raw(JobTypeName::new(name).unwrap(), policy, handlers.clone()).unwrap();
    }
    let callbacks = BatchCallbacks {
        on_finish: Some(JobTypeName::new("done").unwrap()),
        on_success: Some(JobTypeName::new("ok").unwrap()),
        on_failure: Some(JobTypeName::new("bad").unwrap()),
        properties: Some(json!({ "import": "march" })),
    };
    let batch: BatchId = client.create_batch(&callbacks).await.unwrap();
    let options = EnqueueOptions { batch: Some(batch), ..Default::default() };
    // Added in two calls, the second while the workers already run.
    let args: Vec<Value> = (0..1000).map(|i| json!({ "i": i })).collect();
    client.enqueue_many_raw("work", &args[..500], &options).await.unwrap();
    let running = common::Running::start(&db, common::test_config(), registry, &["default"], 8).await;
    client.enqueue_many_raw("work", &args[500..], &options).await.unwrap();
    assert_eq!(client.close_batch(batch).await.unwrap(), "closed");
    wait_for_count(&db.pool, "SELECT count(*) FROM fired", 2, common::WAIT).await.unwrap();
    running.stop().await;
    let info = client.batch(batch).await.unwrap().unwrap();
    assert_eq!(
        (info.state.as_str(), info.total, info.succeeded, info.failed, info.pending),
        ("finished", 1000, 950, 50, 0)
    );
    let fired: Vec<(String, Value)> =
        sqlx::query_as("SELECT job_type, args FROM fired ORDER BY job_type").fetch_all(&db.pool).await.unwrap();
    assert_eq!(fired.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(), vec!["bad", "done"]);
    assert_eq!(fired[0].1["properties"], json!({ "import": "march" }));
    assert_eq!((fired[0].1["succeeded"].clone(), fired[0].1["failed"].clone()), (json!(950), json!(50)));
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 50);
}

#[tokio::test]
async fn h29_a_message_that_only_carries_a_batch_header_neither_fails_a_claim_nor_counts() {
    let db = setup().await;
    let open = create_batch(&db.pool).await;
    let closed = create_batch(&db.pool).await;
    add_jobs(&db.pool, closed, 1).await;
    close(&db.pool, closed).await.unwrap();
    // Sent outside lockgate: a job of a defined type naming both batches, and a malformed one.
    for headers in [
        json!({ "type": "work", "batch": open }),
        json!({ "type": "work", "batch": closed }),
        json!({ "type": "work", "batch": "x" }),
    ] {
        sqlx::query("SELECT pgmq.send('default', '{}'::jsonb, $1)").bind(headers).execute(&db.pool).await.unwrap();
    }
    let claimed = claim_work(&db.pool).await;
    assert_eq!(claimed.len(), 3, "the member and the two well-formed strangers; the malformed one is dead-lettered");
    for d in &claimed[1..] {
        assert!(common::complete_default(&db.pool, *d).await);
    }
    assert_eq!(progress(&db.pool, open).await, ("open".to_string(), 0, 0, 0, 0));
    assert_eq!(progress(&db.pool, closed).await, ("closed".to_string(), 1, 0, 0, 1), "only its member counts");
    assert!(common::complete_default(&db.pool, claimed[0]).await);
    assert_eq!(progress(&db.pool, closed).await.0, "finished");
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters WHERE reason = 'undecodable'").await.unwrap(), 1);
}

/// Sends a message outside lockgate, with these headers, into queue default; its msg_id.
async fn send_raw(db: &PgPool, headers: Value) -> i64 {
    sqlx::query_scalar("SELECT pgmq.send('default', '{\"forged\": true}'::jsonb, $1)")
        .bind(headers)
        .fetch_one(db)
        .await
        .unwrap()
}

/// Review helper-131 F1 (design §111): a message written outside lockgate that copies a batched
/// job's id and its batch header counts nothing, whether it completes (a numeric id) or is
/// dead-lettered at its claim (an id written as a string, which the claim refuses but the dead
/// letter read as the job's); the jobs themselves count once. A membership written before
/// migration 28 (no message named) still counts from its job's message.
#[tokio::test]
async fn a_message_written_outside_lockgate_copying_a_batched_jobs_id_counts_nothing() {
    let db = setup().await;
    let batch = create_batch(&db.pool).await;
    let jobs: Vec<i64> = sqlx::query_scalar(
        "SELECT job_id FROM lockgate.enqueue_many('work', ARRAY['{}', '{}', '{}']::jsonb[], jsonb_build_object('batch', $1::bigint))",
    )
    .bind(batch)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    close(&db.pool, batch).await.unwrap();
    let forged = send_raw(&db.pool, json!({ "type": "work", "batch": batch, "job_id": jobs[0] })).await;
    send_raw(&db.pool, json!({ "type": "work", "batch": batch, "job_id": jobs[1].to_string() })).await;
    // What migration 28 leaves: a membership naming no message.
    sqlx::query("UPDATE lockgate.batch_jobs SET msg_id = NULL WHERE job_id = $1")
        .bind(jobs[2])
        .execute(&db.pool)
        .await
        .unwrap();
    let claimed = claim_work(&db.pool).await;
    assert_eq!(claimed.len(), 4, "the three jobs and the forged copy; the string id is dead-lettered");
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters WHERE reason = 'undecodable'").await.unwrap(), 1);
    let copy = claimed.iter().find(|d| d.0 == forged).copied().unwrap();
    assert!(common::complete_default(&db.pool, copy).await);
    assert_eq!(
        progress(&db.pool, batch).await,
        ("closed".to_string(), 3, 0, 0, 3),
        "neither the completed copy nor the dead-lettered one counted a job"
    );
    for d in claimed.iter().filter(|d| d.0 != forged) {
        assert!(common::complete_default(&db.pool, *d).await);
    }
    assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 3, 3, 0, 0));
}

/// Design §111: a parked job's membership names no message until its promotion writes the new
/// one in, so a copy of its id counts nothing while it waits, and it counts once from the message
/// it is promoted onto (which is not its id).
#[tokio::test]
async fn a_parked_batched_job_counts_from_the_message_its_promotion_sends_and_nothing_else() {
    let db = setup().await;
    define_lim(&db.pool).await;
    let batch = create_batch(&db.pool).await;
    assert_eq!(enqueue_lim(&db.pool, "a", batch).await.unwrap(), "enqueued");
    assert_eq!(enqueue_lim(&db.pool, "a", batch).await.unwrap(), "parked");
    close(&db.pool, batch).await.unwrap();
    let parked: i64 = sqlx::query_scalar("SELECT job_id FROM lockgate.parked").fetch_one(&db.pool).await.unwrap();
    let forged = send_raw(&db.pool, json!({ "type": "work", "batch": batch, "job_id": parked })).await;
    let claimed: Vec<Delivery> = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30)")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 2, "the first job and the copy");
    let (copy, first): (Vec<Delivery>, Vec<Delivery>) = claimed.into_iter().partition(|d| d.0 == forged);
    complete_all(&db.pool, &copy).await;
    assert_eq!(progress(&db.pool, batch).await, ("closed".to_string(), 2, 0, 0, 2), "the copy counted nothing");
    complete_all(&db.pool, &first).await;
    assert_eq!(progress(&db.pool, batch).await, ("closed".to_string(), 2, 1, 0, 1));
    let promoted: Vec<Delivery> = sqlx::query_as(
        "SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30) WHERE (headers->>'job_id')::bigint = $1",
    )
    .bind(parked)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(promoted.len(), 1, "the parked job, promoted by the first one's completion");
    assert_ne!(promoted[0].0, parked, "on a message whose id is not its job's");
    complete_all(&db.pool, &promoted).await;
    assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 2, 2, 0, 0));
}

#[tokio::test]
async fn callbacks_of_types_that_take_locks_are_enqueued_by_the_sweep_and_a_discarded_one_stays_pending() {
    let db = setup().await;
    sqlx::query(
        "SELECT lockgate.define_job_type('limited_cb', concurrency_limit => 1, concurrency_on_conflict => 'discard')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let batch: i64 = sqlx::query_scalar("SELECT lockgate.create_batch(on_finish => 'limited_cb')")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    add_jobs(&db.pool, batch, 1).await;
    close(&db.pool, batch).await.unwrap();
    // The callback type's only permit is held: its enqueue would be discarded.
    sqlx::query("SELECT * FROM lockgate.enqueue('limited_cb')").execute(&db.pool).await.unwrap();
    let claimed = claim_work(&db.pool).await;
    assert!(common::complete_default(&db.pool, claimed[0]).await);
    let limited = || db.count("SELECT 1 FROM pgmq.q_default WHERE headers->>'type' = 'limited_cb'");
    assert_eq!(limited().await.unwrap(), 1, "the completion enqueued nothing of a type that takes a lock");
    let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(swept, 0);
    let error: Option<String> = sqlx::query_scalar("SELECT callback_error FROM lockgate.batch($1)")
        .bind(batch)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // Named by its key: the job id its enqueue drew was never stored (review helper-115 F2).
    assert_eq!(
        error.as_deref(),
        Some("lockgate: callback limited_cb was discarded: its concurrency key \"limited_cb\" is full"),
        "a discarded callback is not a fired one"
    );
    // The permit frees up: the next pass enqueues it, once.
    // (claim_work claimed it too, with the batch's job.)
    let holder: Delivery =
        sqlx::query_as("SELECT msg_id, read_ct FROM pgmq.q_default WHERE headers->>'type' = 'limited_cb'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(common::complete_default(&db.pool, holder).await);
    for expected in [1, 0] {
        let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
        assert_eq!(swept, expected);
    }
    assert_eq!(limited().await.unwrap(), 1);
}

/// One type named for on_finish and on_success, whose own policy refuses the second callback
/// behind the first (a unique key without the callback in it, rejecting or discarding; a limit of
/// 1 that discards or raises): the callbacks count as enqueued with the one job. Before, every
/// sweep rolled both back, and the batch stayed pending for good, naming a job that never existed
/// (review helper-98).
/// Review helper-131 F2: two batches' callbacks of a type that discards while_executing
/// duplicates, finishing together: the second waits for the first to finish and then runs,
/// where it was delivered as the first's duplicate and archived unrun, its batch counting it as
/// fired.
#[tokio::test]
async fn a_callback_of_a_type_discarding_while_executing_duplicates_waits_and_runs() {
    let db = setup().await;
    sqlx::query(
        "SELECT lockgate.define_job_type('wcb', unique_mode => 'while_executing', unique_on_conflict => 'discard')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for _ in 0..2 {
        let b: i64 =
            sqlx::query_scalar("SELECT lockgate.create_batch(on_finish => 'wcb')").fetch_one(&db.pool).await.unwrap();
        assert_eq!(close(&db.pool, b).await.unwrap(), "finished");
    }
    let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(swept, 2, "both batches' callbacks enqueued");
    let claim = || async {
        sqlx::query_as::<_, (i64, i32, bool)>(
            "SELECT msg_id, read_ct, headers ? 'duplicate_of' FROM lockgate.claim('default', 10, 30)",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let first = claim().await;
    assert_eq!(first.len(), 1, "one callback runs, the other waits: {first:?}");
    assert!(!first[0].2);
    assert!(common::complete_default(&db.pool, (first[0].0, first[0].1)).await);
    sqlx::query("UPDATE pgmq.q_default SET vt = now() - interval '1 second', headers = headers - 'retry_at'")
        .execute(&db.pool)
        .await
        .unwrap();
    let second = claim().await;
    assert_eq!(second.len(), 1, "{second:?}");
    assert!(!second[0].2, "the second callback runs, not as the first's duplicate");
}

/// The same for a callback parked by its type's limit: the mark is written on the parked job and
/// travels with it to the message its promotion sends.
#[tokio::test]
async fn a_parked_callback_of_a_type_discarding_while_executing_duplicates_keeps_its_mark() {
    let db = setup().await;
    sqlx::query(
        "SELECT lockgate.define_job_type('wcbl', concurrency_limit => 1, unique_mode => 'while_executing',
                                         unique_key => array['batch_id'], unique_on_conflict => 'discard')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for _ in 0..2 {
        let b: i64 =
            sqlx::query_scalar("SELECT lockgate.create_batch(on_finish => 'wcbl')").fetch_one(&db.pool).await.unwrap();
        assert_eq!(close(&db.pool, b).await.unwrap(), "finished");
    }
    let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(swept, 2);
    assert_eq!(db.count("SELECT 1 FROM lockgate.parked WHERE headers ? 'batch_callback'").await.unwrap(), 1);
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default WHERE headers ? 'batch_callback'").await.unwrap(), 1);
    let first: Vec<Delivery> = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30)")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    complete_all(&db.pool, &first).await;
    assert_eq!(
        db.count("SELECT 1 FROM pgmq.q_default WHERE headers ? 'batch_callback'").await.unwrap(),
        1,
        "the promoted callback keeps its mark"
    );
}

#[tokio::test]
async fn one_type_named_for_two_callbacks_that_its_policy_merges_fires_once() {
    let db = setup().await;
    let policies = [
        ("u_reject", "unique_mode => 'until_executed', unique_key => ARRAY['batch_id']"),
        (
            "u_discard",
            "unique_mode => 'until_executed', unique_key => ARRAY['batch_id'], unique_on_conflict => 'discard'",
        ),
        ("l_discard", "concurrency_limit => 1, concurrency_on_conflict => 'discard'"),
        ("l_raise", "concurrency_limit => 1, concurrency_on_conflict => 'raise'"),
    ];
    for (name, policy) in policies {
        sqlx::query(&format!("SELECT lockgate.define_job_type('{name}', {policy})")).execute(&db.pool).await.unwrap();
        let batch: i64 = sqlx::query_scalar("SELECT lockgate.create_batch(on_finish => $1, on_success => $1)")
            .bind(name)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        add_jobs(&db.pool, batch, 1).await;
        close(&db.pool, batch).await.unwrap();
        let claimed = claim_work(&db.pool).await;
        assert!(common::complete_default(&db.pool, claimed[0]).await);
        let done = sweep_callbacks(&db.pool, batch).await;
        assert_eq!(done, (1, false, None), "{name}: the callbacks are done with one job");
        assert_eq!(callback_kinds(&db.pool, name).await, vec!["finish"], "{name}: the first callback's job, once");
    }
}

/// A callback refused by another job, not by the callback of its type stored before it, is not
/// merged: the pass stays pending, and a later one enqueues both (review helper-101: merged on
/// the type alone, the success callback was lost while the batch said its callbacks were done).
#[tokio::test]
async fn a_callback_refused_by_an_unrelated_job_is_not_merged_into_its_sibling() {
    let db = setup().await;
    let policies = [
        ("u_cb", "unique_mode => 'until_executed', unique_key => ARRAY['callback']", r#"{"callback": "success"}"#),
        ("l_cb", "concurrency_limit => 2, concurrency_on_conflict => 'discard'", "{}"),
    ];
    for (name, policy, other) in policies {
        sqlx::query(&format!("SELECT lockgate.define_job_type('{name}', {policy})")).execute(&db.pool).await.unwrap();
        // Another job holds the success callback's unique key, or one of the type's two permits.
        let unrelated: Delivery = sqlx::query_as("SELECT msg_id, 0 FROM lockgate.enqueue($1, $2::jsonb)")
            .bind(name)
            .bind(other)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let batch: i64 = sqlx::query_scalar("SELECT lockgate.create_batch(on_finish => $1, on_success => $1)")
            .bind(name)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        close(&db.pool, batch).await.unwrap();
        let (swept, pending, error) = sweep_callbacks(&db.pool, batch).await;
        assert!(swept == 0 && pending && error.is_some(), "{name}: stays pending ({swept}, {pending}, {error:?})");
        // The other job finishes: the next pass enqueues both callbacks.
        let claimed: Delivery =
            sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30) WHERE msg_id = $1")
                .bind(unrelated.0)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert!(common::complete_default(&db.pool, claimed).await);
        let (swept, pending, _) = sweep_callbacks(&db.pool, batch).await;
        let kinds = callback_kinds(&db.pool, name).await;
        assert_eq!((swept, pending, kinds), (1, false, vec!["finish".into(), "success".into()]), "{name}: both, once");
    }
}

/// Batches whose callbacks keep failing do not starve a newer one: the sweep takes those it tried
/// longest ago first (review helper-101: ordered by id, two failing batches filled every pass of
/// two).
#[tokio::test]
async fn batches_whose_callbacks_keep_failing_leave_the_sweep_to_newer_ones() {
    let db = setup().await;
    for name in ["held_cb", "free_cb"] {
        sqlx::query(
            "SELECT lockgate.define_job_type($1, concurrency_limit => 1, concurrency_on_conflict => 'discard')",
        )
        .bind(name)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    // held_cb's only permit is taken: its callbacks are discarded at every pass.
    sqlx::query("SELECT * FROM lockgate.enqueue('held_cb')").execute(&db.pool).await.unwrap();
    let mut batches = Vec::new();
    for callback in ["held_cb", "held_cb", "free_cb"] {
        let batch: i64 = sqlx::query_scalar("SELECT lockgate.create_batch(on_finish => $1)")
            .bind(callback)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        close(&db.pool, batch).await.unwrap();
        batches.push(batch);
    }
    for _ in 0..2 {
        sqlx::query("SELECT lockgate.batch_sweep(2)").execute(&db.pool).await.unwrap();
    }
    let pending: bool = sqlx::query_scalar("SELECT callbacks_pending FROM lockgate.batch($1)")
        .bind(batches[2])
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(!pending, "the newest batch had its turn in the second pass");
}

#[tokio::test]
async fn the_batch_reaper_counts_a_member_deleted_outside_lockgate_as_failed() {
    let db = setup().await;
    let batch = create_batch(&db.pool).await;
    add_jobs(&db.pool, batch, 2).await;
    close(&db.pool, batch).await.unwrap();
    let claimed = claim_work(&db.pool).await;
    assert!(common::complete_default(&db.pool, claimed[0]).await);
    sqlx::query("SELECT pgmq.delete('default', $1)").bind(claimed[1].0).execute(&db.pool).await.unwrap();
    let reap = |idle: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i32>("SELECT lockgate.reap_batches($1::interval)")
                .bind(idle)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(reap("1 hour").await, 0, "a batch that changed recently is not judged");
    assert_eq!(reap("0 seconds").await, 1);
    assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 2, 1, 1, 0));
    let fired: Vec<String> = callbacks(&db.pool).await.into_iter().map(|c| c.0).collect();
    assert_eq!(fired, vec!["bad", "done"]);
    assert_eq!(reap("0 seconds").await, 0);
}

#[tokio::test]
async fn the_properties_of_a_batch_are_bounded_so_its_callbacks_can_always_be_enqueued() {
    let db = setup().await;
    let big = json!({ "blob": "x".repeat(1_100_000) });
    let err = sqlx::query("SELECT lockgate.create_batch(properties => $1)")
        .bind(&big)
        .execute(&db.pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("more than the 1000000 allowed"), "{err}");
    // The same read from a table, where it is stored compressed (a few kB): measured as the
    // callbacks' arguments will carry it. Before, it was taken, and every callback was refused.
    sqlx::query("CREATE TABLE props AS SELECT jsonb_build_object('blob', repeat('x', 3000000)) AS p")
        .execute(&db.pool)
        .await
        .unwrap();
    let stored: i32 = sqlx::query_scalar("SELECT pg_column_size(p) FROM props").fetch_one(&db.pool).await.unwrap();
    assert!(stored < 1_000_000, "stored compressed: {stored} bytes");
    let err = sqlx::query("SELECT lockgate.create_batch(properties => (SELECT p FROM props))")
        .execute(&db.pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("more than the 1000000 allowed"), "{err}");
}

#[tokio::test]
async fn a_parked_job_bound_for_a_queue_dropped_outside_lockgate_is_dead_lettered_not_a_stuck_completion() {
    let db = setup().await;
    sqlx::query("SELECT lockgate.define_job_type('one', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('elsewhere')").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('one')").execute(&db.pool).await.unwrap();
    let parked: String =
        sqlx::query_scalar("SELECT status FROM lockgate.enqueue('one', '{}', '{\"queue\": \"elsewhere\"}')")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(parked, "parked");
    sqlx::query("SELECT pgmq.drop_queue('elsewhere')").execute(&db.pool).await.unwrap();
    let holder: Vec<Delivery> = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30)")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert!(common::complete_default(&db.pool, holder[0]).await, "the holder's completion lands");
    let reason: String =
        sqlx::query_scalar("SELECT error FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(reason.contains("queue \"elsewhere\" no longer exists"), "{reason}");
    let retried: Vec<(String, Option<i64>)> =
        sqlx::query_as("SELECT status, msg_id FROM lockgate.dlq_retry()").fetch_all(&db.pool).await.unwrap();
    assert_eq!(retried, vec![("queue_missing".to_string(), None)], "kept, and named");
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 1);
}

/// H31: an enqueue of several limited jobs into a batch holds the batch row FOR KEY SHARE (its
/// first membership row's foreign key) while it waits for the semaphore row of a later job; a
/// completion or a cancel of a job of that key holds the semaphore row and then counts the batch.
/// Counting must not need a lock that waits for the share. A third session holds the batch row
/// first, so that each of the two locks its semaphore row before the counting waits: with
/// FOR UPDATE on the batch row the two deadlocked (found by the chaos soak).
#[tokio::test]
async fn h31_counting_a_batch_while_an_enqueue_into_it_waits_for_a_key_is_no_deadlock() {
    for cancel in [true, false] {
        let db = setup().await;
        sqlx::query("SELECT lockgate.define_job_type('lim', concurrency_limit => 1, concurrency_key => '{k}')")
            .execute(&db.pool)
            .await
            .unwrap();
        let batch = create_batch(&db.pool).await;
        let enqueue_many = |conn_url: String, args: Vec<Value>| async move {
            let mut conn = PgConnection::connect(&conn_url).await?;
            sqlx::query("SELECT * FROM lockgate.enqueue_many('lim', $1, jsonb_build_object('batch', $2::bigint))")
                .bind(args)
                .bind(batch)
                .execute(&mut conn)
                .await
        };
        // X holds key b's permit: queued, to be cancelled (which gives the permit back at once),
        // or running, to be completed.
        enqueue_many(db.url.clone(), vec![json!({"k": "b"})]).await.unwrap();
        let x: Delivery = if cancel {
            sqlx::query_as("SELECT msg_id, 0 FROM pgmq.q_default").fetch_one(&db.pool).await.unwrap()
        } else {
            sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30)")
                .fetch_one(&db.pool)
                .await
                .unwrap()
        };
        let mut held = hold_batch_row(&db.url, batch).await;
        // X's end: it gives key b back, and its count, finding the batch row held, waits on X's
        // membership instead of for the row (design §73): it lands at once.
        let ender = if cancel {
            let url = db.url.clone();
            tokio::spawn(async move {
                let mut conn = PgConnection::connect(&url).await?;
                sqlx::query("SELECT * FROM lockgate.cancel($1)").bind(x.0).execute(&mut conn).await.map(|_| ())
            })
        } else {
            common::complete_apart(&db.url, vec![x])
        };
        tokio::time::timeout(Duration::from_secs(10), ender)
            .await
            .expect("X's end waits for nothing")
            .unwrap()
            .expect("the cancel or completion lands");
        // The enqueue adds a's member (sharing the batch row) and takes key b, which X gave back.
        tokio::time::timeout(
            Duration::from_secs(10),
            enqueue_many(db.url.clone(), vec![json!({"k": "a"}), json!({"k": "b"})]),
        )
        .await
        .expect("the enqueue waits for nothing")
        .expect("the enqueue lands");
        sqlx::query("COMMIT").execute(&mut held).await.unwrap();
        assert_eq!(common::deadlocks(&db.pool).await, 0, "cancel {cancel}");
        let (state, total, succeeded, failed, pending) = progress(&db.pool, batch).await;
        assert_eq!(
            (state.as_str(), total, succeeded, failed, pending),
            ("open", 3, i64::from(!cancel), i64::from(cancel), 2),
            "cancel {cancel}"
        );
        let statuses: Vec<String> = sqlx::query_scalar("SELECT headers->>'ckey' FROM pgmq.q_default ORDER BY msg_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
        assert_eq!(statuses.len(), 2, "a's and b's jobs are queued, b's with the permit X gave back: {statuses:?}");
    }
}

/// H31: a producer transaction adds jobs of limited keys to a batch statement after statement,
/// while a completion of a job of a later key counts the batch. The enqueue used to add to the
/// batch's total, holding the batch row until its commit: the completion, holding the key's
/// semaphore row, waited for the batch row, and the producer's next enqueue waited for the
/// semaphore row. Now the enqueue only shares the batch row, a close does not wait for it, and
/// the batch cannot finish before it commits.
#[tokio::test]
async fn h31_a_producer_transaction_filling_a_batch_and_a_completion_counting_it_never_deadlock() {
    let db = setup().await;
    define_lim(&db.pool).await;
    let batch = create_batch(&db.pool).await;
    assert_eq!(enqueue_lim(&db.pool, "b", batch).await.unwrap(), "enqueued");
    let x: Delivery = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    assert_eq!(enqueue_lim(&mut *tx, "a", batch).await.unwrap(), "enqueued");
    // X's completion locks key b's semaphore row and counts the batch: it must not wait.
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("SET lock_timeout = '5s'").execute(&mut conn).await.unwrap();
    assert!(common::complete_default(&mut conn, x).await, "the completion counts the batch beside the open producer");
    assert_eq!(enqueue_lim(&mut *tx, "b", batch).await.unwrap(), "enqueued", "key b's permit came back with X");
    // Before the producer commits, the total counts what is committed.
    assert_eq!(progress(&db.pool, batch).await, ("open".to_string(), 1, 1, 0, 0));
    // A close does not wait for the producer, and the batch has nothing pending it can see: it
    // must not finish while the producer is still adding to it.
    assert_eq!(close(&mut conn, batch).await.unwrap(), "closed");
    assert_eq!(lockgate::sql::batch_sweep(&db.pool).await.unwrap(), 0, "nor does the sweep finish it");
    tx.commit().await.unwrap();
    assert_eq!(progress(&db.pool, batch).await, ("closed".to_string(), 3, 1, 0, 2));
    let refused = enqueue_lim(&db.pool, "c", batch).await.unwrap_err();
    assert!(refused.contains(&format!("batch {batch} is closed")), "{refused}");
    // Its two jobs finish it, once.
    let claimed: Vec<Delivery> = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30)")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 2);
    complete_all(&db.pool, &claimed).await;
    assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 3, 3, 0, 0));
    assert_eq!(callbacks(&db.pool).await.into_iter().map(|c| c.0).collect::<Vec<_>>(), vec!["done", "ok"]);
}

/// A batch closed while a producer was adding to it, whose producer then added nothing (here it
/// rolled back), has nothing left to count: no completion will finish it, so the sweep does.
#[tokio::test]
async fn a_closed_batch_left_with_nothing_by_a_producer_that_rolled_back_is_finished_by_the_sweep() {
    let db = setup().await;
    let batch = create_batch(&db.pool).await;
    add_jobs(&db.pool, batch, 1).await;
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    add_jobs(&mut *tx, batch, 1).await;
    assert_eq!(close(&db.pool, batch).await.unwrap(), "closed");
    let claimed = claim_work(&db.pool).await;
    complete_all(&db.pool, &claimed).await;
    assert_eq!(progress(&db.pool, batch).await.0, "closed", "the producer may still add jobs");
    tx.rollback().await.unwrap();
    assert_eq!(lockgate::sql::batch_sweep(&db.pool).await.unwrap(), 1);
    assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 1, 1, 0, 0));
    assert_eq!(callbacks(&db.pool).await.into_iter().map(|c| c.0).collect::<Vec<_>>(), vec!["done", "ok"]);
}

/// H31, from a review: three completions of one batch, one holding the batch row, two waiting for
/// it, while a producer shares the row. Locking the row in a subquery of the counting UPDATE
/// made the two waiters deadlock once the first committed.
#[tokio::test]
async fn h31_completions_of_one_batch_queued_behind_each_other_beside_a_producer_never_deadlock() {
    let db = setup().await;
    let batch = create_batch(&db.pool).await;
    add_jobs(&db.pool, batch, 3).await;
    let claimed = claim_work(&db.pool).await;
    assert_eq!(claimed.len(), 3);
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    let mut producing = producer.begin().await.unwrap();
    add_jobs(&mut *producing, batch, 1).await;
    let mut first = PgConnection::connect(&db.url).await.unwrap();
    let mut tx = first.begin().await.unwrap();
    assert!(common::complete_default(&mut *tx, claimed[0]).await);
    // The other two do not wait for the row the first holds: their counts wait on their
    // memberships (design §73), and are shown as counted at once.
    for d in claimed[1..].iter().copied() {
        tokio::time::timeout(Duration::from_secs(10), common::complete_apart(&db.url, vec![d]))
            .await
            .expect("the completion waits for nothing")
            .unwrap()
            .expect("each completion lands");
    }
    tx.commit().await.unwrap();
    producing.commit().await.unwrap();
    assert_eq!(progress(&db.pool, batch).await, ("open".to_string(), 4, 3, 0, 1));
    // The next holder of the row moves those counts onto it.
    close(&db.pool, batch).await.unwrap();
    let waiting: i64 = db.count("SELECT 1 FROM lockgate.batch_jobs WHERE outcome IS NOT NULL").await.unwrap();
    assert_eq!(waiting, 0);
    assert_eq!(progress(&db.pool, batch).await, ("closed".to_string(), 4, 3, 0, 1));
}

/// H31, from a review: a close that waits for a completion holding the batch row, while a
/// producer shares the row and a completion of a limited job of the batch holds its key. The
/// close used to wait for the producer too (FOR UPDATE), and the completion queued behind the
/// close; the producer's next enqueue of that key closed the cycle. And a close in a producer
/// transaction holding a key, beside a second producer about to take that key, deadlocked too.
#[tokio::test]
async fn h31_a_close_beside_producers_and_completions_never_deadlocks() {
    let db = setup().await;
    define_lim(&db.pool).await;
    let batch = create_batch(&db.pool).await;
    add_jobs(&db.pool, batch, 1).await;
    assert_eq!(enqueue_lim(&db.pool, "zz", batch).await.unwrap(), "enqueued");
    let claimed: Vec<Delivery> =
        sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30) ORDER BY headers ? 'ckey'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let (x, y) = (claimed[0], claimed[1]);
    let mut holder = PgConnection::connect(&db.url).await.unwrap();
    let mut holding = holder.begin().await.unwrap();
    assert!(common::complete_default(&mut *holding, x).await);
    let mut producing = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut producing).await.unwrap();
    add_jobs(&mut producing, batch, 1).await;
    let url = db.url.clone();
    let closer = tokio::spawn(async move {
        let mut conn = PgConnection::connect(&url).await.unwrap();
        close(&mut conn, batch).await
    });
    wait_for_count(&db.pool, WAITING, 1, Duration::from_secs(10)).await.unwrap();
    // The completion of the limited job does not wait for the batch's row the holder holds (its
    // count waits on its membership, design §73), and gives its key back.
    common::complete_apart(&db.url, vec![y]).await.unwrap().expect("the completion lands at once");
    // The producer's next enqueue of the key, while the close still waits: it joins the batch
    // (still open) and takes the key the completion gave back.
    let (committed, status) = tokio::time::timeout(Duration::from_secs(10), async {
        let status = enqueue_lim(&mut producing, "zz", batch).await;
        (sqlx::query("COMMIT").execute(&mut producing).await, status)
    })
    .await
    .expect("the producer waits for nothing");
    committed.unwrap();
    assert_eq!(status.unwrap(), "enqueued", "the producer had joined before the close");
    holding.commit().await.unwrap();
    assert_eq!(closer.await.unwrap().unwrap(), "closed");
    assert_eq!(progress(&db.pool, batch).await, ("closed".to_string(), 4, 2, 0, 2));

    // A close in a producer transaction that holds a key, beside a second producer.
    let batch = create_batch(&db.pool).await;
    let mut first = PgConnection::connect(&db.url).await.unwrap();
    let mut p1 = first.begin().await.unwrap();
    assert_eq!(enqueue_lim(&mut *p1, "a", batch).await.unwrap(), "enqueued");
    let mut p2 = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut p2).await.unwrap();
    add_jobs(&mut p2, batch, 1).await;
    assert_eq!(close(&mut *p1, batch).await.unwrap(), "closed");
    let next = tokio::spawn(async move {
        let status = enqueue_lim(&mut p2, "a", batch).await;
        (sqlx::query("COMMIT").execute(&mut p2).await, status)
    });
    wait_for_count(&db.pool, WAITING, 1, Duration::from_secs(10)).await.unwrap();
    p1.commit().await.unwrap();
    let (committed, status) = next.await.unwrap();
    committed.unwrap();
    assert_eq!(status.unwrap(), "parked", "joined before the close; key a is full");
    assert_eq!(common::deadlocks(&db.pool).await, 0);
}

const WAITING: &str = common::WAITING_FOR_A_LOCK;

/// A session holding the batch row as a counting completion does, its transaction left open.
async fn hold_batch_row(url: &str, batch: i64) -> PgConnection {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    sqlx::query("SELECT 1 FROM lockgate.batches WHERE id = $1 FOR NO KEY UPDATE")
        .bind(batch)
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

async fn define_lim(db: &PgPool) {
    sqlx::query("SELECT lockgate.define_job_type('lim', concurrency_limit => 1, concurrency_key => '{k}')")
        .execute(db)
        .await
        .unwrap();
}

async fn enqueue_lim(db: impl sqlx::PgExecutor<'_>, key: &str, batch: i64) -> Result<String, String> {
    sqlx::query_scalar("SELECT status FROM lockgate.enqueue('lim', jsonb_build_object('k', $1::text), jsonb_build_object('batch', $2::bigint))")
        .bind(key)
        .bind(batch)
        .fetch_one(db)
        .await
        .map_err(|e| e.to_string())
}

async fn complete_all(db: &PgPool, deliveries: &[Delivery]) {
    let (ids, cts): (Vec<i64>, Vec<i32>) = deliveries.iter().map(|d| (d.0, d.1)).unzip();
    sqlx::query("SELECT lockgate.complete('default', $1, $2)").bind(ids).bind(cts).execute(db).await.unwrap();
}

/// H31, from a review: the reaper counted lost members queue by queue, locking one queue's
/// batches before another's, while a completion counting two batches locks them in id order.
/// Batch hi has a lost member in queue default, batch lo one in queue q2; a completion of a job of
/// each waits behind a session holding lo. The reaper must lock lo before hi, as the completion
/// does.
#[tokio::test]
async fn h31_the_reaper_and_a_completion_of_several_batches_lock_them_in_one_order() {
    let db = setup().await;
    sqlx::query("SELECT lockgate.create_queue('q2')").execute(&db.pool).await.unwrap();
    let (lo, hi) = (create_batch(&db.pool).await, create_batch(&db.pool).await);
    for b in [lo, hi] {
        add_jobs(&db.pool, b, 1).await;
    }
    sqlx::query("INSERT INTO lockgate.batch_jobs (queue, job_id, batch_id) VALUES ('default', -1, $1), ('q2', -2, $2)")
        .bind(hi)
        .bind(lo)
        .execute(&db.pool)
        .await
        .unwrap();
    for b in [lo, hi] {
        close(&db.pool, b).await.unwrap();
    }
    let claimed = claim_work(&db.pool).await;
    let mut holding = hold_batch_row(&db.url, lo).await;
    // The completion counts hi and leaves lo's count on its job's membership (design §73).
    tokio::time::timeout(Duration::from_secs(10), common::complete_apart(&db.url, claimed))
        .await
        .expect("the completion waits for nothing")
        .unwrap()
        .expect("the completion lands");
    let url = db.url.clone();
    let reaper = tokio::spawn(async move {
        let mut conn = PgConnection::connect(&url).await?;
        sqlx::query_scalar::<_, i32>("SELECT lockgate.reap_batches('0 seconds')").fetch_one(&mut conn).await
    });
    wait_for_count(&db.pool, WAITING, 1, Duration::from_secs(10)).await.unwrap();
    sqlx::query("COMMIT").execute(&mut holding).await.unwrap();
    assert_eq!(reaper.await.unwrap().expect("the reaper lands, no deadlock"), 2);
    for b in [lo, hi] {
        assert_eq!(progress(&db.pool, b).await, ("finished".to_string(), 2, 1, 1, 0));
    }
}

/// From a review: the batch sweep takes at most max_rows closed batches with nothing left per
/// pass. Batches a producer is still adding to cannot finish yet; they must not fill the pass
/// and keep a batch that can finish waiting for as long as that producer stays open.
#[tokio::test]
async fn the_batch_sweep_passes_over_batches_a_producer_still_adds_to() {
    let db = setup().await;
    let (a, b, victim) = (create_batch(&db.pool).await, create_batch(&db.pool).await, create_batch(&db.pool).await);
    let mut producer = PgConnection::connect(&db.url).await.unwrap();
    let mut adding = producer.begin().await.unwrap();
    for x in [a, b] {
        add_jobs(&mut *adding, x, 1).await;
    }
    // The victim's producer joined it and rolled back after the close: nothing left, not finished.
    let mut other = PgConnection::connect(&db.url).await.unwrap();
    let mut joined = other.begin().await.unwrap();
    add_jobs(&mut *joined, victim, 1).await;
    for x in [a, b, victim] {
        assert_eq!(close(&db.pool, x).await.unwrap(), "closed");
    }
    joined.rollback().await.unwrap();
    let swept: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep(2)").fetch_one(&db.pool).await.unwrap();
    assert_eq!(swept, 1, "the victim finished in the first pass");
    assert_eq!(progress(&db.pool, victim).await, ("finished".to_string(), 0, 0, 0, 0));
    assert_eq!(progress(&db.pool, a).await.0, "closed");
    adding.commit().await.unwrap();
}

/// From a review: a finish reads the memberships after its locks, in statements that must see what
/// committed before them. In a repeatable read transaction they read its first snapshot: a
/// producer committing since was missed, and the batch finished with a job still in it. Such a
/// transaction leaves the finish to the batch sweep.
#[tokio::test]
async fn a_repeatable_read_transaction_never_finishes_a_batch_and_the_sweep_does() {
    let db = setup().await;
    let batch = create_batch(&db.pool).await;
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut conn).await.unwrap();
    sqlx::query("SELECT 1").execute(&mut conn).await.unwrap();
    // A producer adds a job after the snapshot was taken.
    add_jobs(&db.pool, batch, 1).await;
    assert_eq!(close(&mut conn, batch).await.unwrap(), "closed", "nothing pending as its snapshot sees it");
    sqlx::query("COMMIT").execute(&mut conn).await.unwrap();
    assert_eq!(progress(&db.pool, batch).await, ("closed".to_string(), 1, 0, 0, 1));
    let claimed = claim_work(&db.pool).await;
    complete_all(&db.pool, &claimed).await;
    assert_eq!(progress(&db.pool, batch).await, ("finished".to_string(), 1, 1, 0, 0));

    // With nothing pending at all, the sweep finishes what the repeatable read close left.
    let empty = create_batch(&db.pool).await;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut conn).await.unwrap();
    assert_eq!(close(&mut conn, empty).await.unwrap(), "closed");
    sqlx::query("COMMIT").execute(&mut conn).await.unwrap();
    assert_eq!(lockgate::sql::batch_sweep(&db.pool).await.unwrap(), 1);
    assert_eq!(progress(&db.pool, empty).await.0, "finished");
}
