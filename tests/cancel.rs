//! Cancel and search (issue 12): a job is cancelled in every state it can be in and kept as
//! cancelled; a running job's permit is given back in the cancelling transaction and its late
//! completion changes nothing; a cancel racing a completion on two connections has exactly one
//! winner and the permit is given back once; a running handler learns of the cancel from its
//! heartbeat. `lockgate.jobs` finds jobs by every filter, pages by id, and refuses bad filters.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::{queue, test_config, until_one_waits_for_a_lock, Counter, Running, WAIT};
use lockgate::{CancelReason, Client, DbError, Job, JobContext, JobError, JobFilter, JobId, JobPolicy, Registry};
use lockgate_testkit::{wait_for, TestDb};
use serde::{Deserialize, Serialize};

async fn enqueue(db: &TestDb, job_type: &str, args: &str, options: &str) -> i64 {
    sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue($1, $2::jsonb, $3::jsonb)")
        .bind(job_type)
        .bind(args)
        .bind(options)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn claim(db: &TestDb, n: i32) -> Vec<(i64, i32)> {
    sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', $1, 30)")
        .bind(n)
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

async fn cancel(db: impl sqlx::PgExecutor<'_>, id: i64) -> Option<(String, bool)> {
    sqlx::query_as("SELECT state, cancelled FROM lockgate.cancel($1)").bind(id).fetch_optional(db).await.unwrap()
}

async fn state_of(db: &TestDb, id: i64) -> String {
    lockgate::sql::job(&db.pool, JobId(id)).await.unwrap().expect("the job exists").state
}

/// (value, leases) of the one semaphore key, and the invariants' violations.
async fn permits(db: &TestDb) -> (i32, i64, Vec<String>) {
    let (value, leases): (i32, i64) =
        sqlx::query_as("SELECT s.value, (SELECT count(*) FROM lockgate.leases) FROM lockgate.semaphores s")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let problems: Vec<String> =
        sqlx::query_scalar("SELECT problem FROM lockgate.check_invariants()").fetch_all(&db.pool).await.unwrap();
    (value, leases, problems)
}

#[tokio::test]
async fn cancel_takes_a_job_out_of_every_waiting_state_and_keeps_it() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('plain')").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('one', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    let retrying = enqueue(&db, "plain", "{}", "{}").await;
    let claimed = claim(&db, 1).await;
    sqlx::query("SELECT lockgate.retry('default', $1, $2, 600, 'boom', 1)")
        .bind(claimed[0].0)
        .bind(claimed[0].1)
        .execute(&db.pool)
        .await
        .unwrap();
    let queued = enqueue(&db, "plain", "{}", "{}").await;
    let scheduled = enqueue(&db, "plain", "{}", r#"{"delay": 3600}"#).await;
    let holder = enqueue(&db, "one", r#"{"n": 1}"#, "{}").await;
    let parked = enqueue(&db, "one", r#"{"n": 2}"#, "{}").await;
    let last = enqueue(&db, "one", r#"{"n": 3}"#, "{}").await;
    for (id, was) in [(retrying, "retrying"), (queued, "queued"), (scheduled, "scheduled"), (parked, "parked")] {
        assert_eq!(state_of(&db, id).await, was);
        assert_eq!(cancel(&db.pool, id).await, Some((was.to_string(), true)), "job {id}");
        let job = lockgate::sql::job(&db.pool, JobId(id)).await.unwrap().unwrap();
        assert_eq!(job.state, "cancelled", "kept, and shown as cancelled: {job:?}");
        assert_eq!(job.headers.as_ref().unwrap()["cancelled_in"], was);
        assert_eq!(cancel(&db.pool, id).await, Some(("cancelled".to_string(), false)), "cancelled once");
    }
    assert_eq!(cancel(&db.pool, 999_999).await, None, "an unknown id: no row");
    // The cancelled parked job never runs; the one parked after it keeps its turn.
    assert_eq!(state_of(&db, last).await, "parked");
    let d = claim(&db, 5).await;
    assert_eq!(d.len(), 1, "only the key's holder is claimable: {d:?}");
    assert!(common::complete_default(&db.pool, d[0]).await);
    assert_eq!(state_of(&db, holder).await, "succeeded");
    assert_eq!(state_of(&db, last).await, "queued", "promoted in its turn");
    assert_eq!(state_of(&db, parked).await, "cancelled");
    assert_eq!(cancel(&db.pool, holder).await, Some(("succeeded".to_string(), false)), "a finished job stays as it is");
    assert_eq!(permits(&db).await, (1, 1, vec![]));
}

#[tokio::test]
async fn a_cancelled_running_job_gives_back_its_permit_once_and_its_late_outcome_changes_nothing() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('one', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    let running = enqueue(&db, "one", "{}", "{}").await;
    let next = enqueue(&db, "one", "{}", "{}").await;
    let d = claim(&db, 1).await[0];
    assert_eq!(state_of(&db, running).await, "running");
    assert_eq!(cancel(&db.pool, running).await, Some(("running".to_string(), true)));
    // The permit went back in the cancelling transaction: the parked job holds it now.
    assert_eq!(state_of(&db, next).await, "queued");
    assert_eq!(permits(&db).await, (1, 1, vec![]));
    // The cancelled delivery's late outcomes are fenced out and release nothing.
    assert!(!common::complete_default(&db.pool, d).await, "AlreadyArchived");
    let retried: bool = sqlx::query_scalar("SELECT lockgate.retry('default', $1, $2, 1, 'late', 1)")
        .bind(d.0)
        .bind(d.1)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(!retried);
    assert!(!common::dead_letter_default(&db.pool, d).await);
    assert_eq!(permits(&db).await, (1, 1, vec![]), "nothing released twice");
    let job = lockgate::sql::job(&db.pool, JobId(running)).await.unwrap().unwrap();
    assert_eq!(job.state, "cancelled");
    let attempts = job.attempts.as_array().unwrap();
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!((attempts[0]["outcome"].as_str(), attempts[0]["attempt"].as_i64()), (Some("cancelled"), Some(1)));
    let archived: i64 = sqlx::query_scalar("SELECT count(*) FROM pgmq.a_default").fetch_one(&db.pool).await.unwrap();
    assert_eq!(archived, 1);
}

/// One side of the race runs in an open transaction on its own connection; the other is sent on
/// a second connection, must wait for the first's row lock, and runs on once it commits.
#[tokio::test]
async fn a_cancel_racing_a_completion_has_exactly_one_winner_either_way() {
    for cancel_first in [false, true] {
        let db = TestDb::migrated().await.unwrap();
        sqlx::query("SELECT lockgate.define_job_type('one', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
        let id = enqueue(&db, "one", "{}", "{}").await;
        let next = enqueue(&db, "one", "{}", "{}").await;
        let d = claim(&db, 1).await[0];
        let mut first = db.pool.begin().await.unwrap();
        let second = if cancel_first {
            assert_eq!(cancel(&mut *first, id).await, Some(("running".to_string(), true)));
            let pool = db.pool.clone();
            tokio::spawn(async move { (common::complete_default(&pool, d).await, None) })
        } else {
            assert!(common::complete_default(&mut *first, d).await);
            let pool = db.pool.clone();
            tokio::spawn(async move { (false, cancel(&pool, id).await) })
        };
        until_one_waits_for_a_lock(&db.pool).await;
        first.commit().await.unwrap();
        let (completed, cancelled) = second.await.unwrap();
        if cancel_first {
            assert!(!completed, "the completion lost: AlreadyArchived");
            assert_eq!(state_of(&db, id).await, "cancelled");
        } else {
            assert_eq!(cancelled, Some(("succeeded".to_string(), false)), "the cancel lost");
            assert_eq!(state_of(&db, id).await, "succeeded");
        }
        assert_eq!(state_of(&db, next).await, "queued", "the next job promoted once");
        assert_eq!(permits(&db).await, (1, 1, vec![]), "the permit given back once (cancel first: {cancel_first})");
    }
}

#[derive(Serialize, Deserialize)]
struct Wait {}

impl Job for Wait {
    const TYPE: &'static str = "wait";
    fn policy() -> JobPolicy {
        let mut policy = JobPolicy::on_queue(queue("default"));
        policy.max_attempts = 1;
        policy
    }
}

#[tokio::test]
async fn a_running_handler_is_cancelled_through_its_heartbeat_and_writes_nothing() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Wait>().await.unwrap();
    let id = client.enqueue(&Wait {}, &Default::default()).await.unwrap().job_id;
    let (starts, reasons) = (Counter::default(), Arc::new(Mutex::new(Vec::new())));
    let mut registry = Registry::new();
    let (s, r) = (starts.clone(), Arc::clone(&reasons));
    registry
        .register::<Wait, _>(move |ctx: JobContext, _job: Wait| {
            let (s, r) = (s.clone(), Arc::clone(&r));
            async move {
                s.bump();
                ctx.cancelled().await;
                r.lock().unwrap().push(ctx.cancel_reason());
                Err(JobError::new("stopped"))
            }
        })
        .unwrap();
    let running = Running::start(&db, test_config(), registry, &["default"], 1).await;
    wait_for("the handler to start", WAIT, || async { Ok((starts.get() == 1).then_some(())) }).await.unwrap();
    let outcome = client.cancel(id).await.unwrap().unwrap();
    assert_eq!((outcome.state.as_str(), outcome.cancelled), ("running", true));
    wait_for("the handler to be cancelled", WAIT, || async {
        Ok((reasons.lock().unwrap().as_slice() == [Some(CancelReason::Cancelled)]).then_some(()))
    })
    .await
    .unwrap();
    running.stop().await;
    assert_eq!(state_of(&db, id.0).await, "cancelled", "its failed return wrote nothing");
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    assert_eq!((dead, starts.get()), (0, 1), "never dead-lettered, never run again");
}

#[tokio::test]
async fn jobs_are_found_by_every_filter_and_cancelled_by_query() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('a')").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('b', queue => 'other', concurrency_limit => 1, concurrency_key => ARRAY['acct'])")
        .execute(&db.pool)
        .await
        .unwrap();
    let a: Vec<i64> = [
        enqueue(&db, "a", r#"{"to": "Ada"}"#, "{}").await,
        enqueue(&db, "a", r#"{"to": "Bob"}"#, "{}").await,
        enqueue(&db, "a", r#"{"to": "Cy"}"#, r#"{"delay": 3600}"#).await,
    ]
    .to_vec();
    let b1 = enqueue(&db, "b", r#"{"acct": "x"}"#, "{}").await;
    let b2 = enqueue(&db, "b", r#"{"acct": "x"}"#, "{}").await;
    let client = Client::new(db.pool.clone());
    let ids = |jobs: Vec<lockgate::JobRecord>| jobs.into_iter().map(|j| j.id.0).collect::<Vec<_>>();
    let all = ids(client.jobs(&JobFilter::default(), 50, None).await.unwrap());
    assert_eq!(all, vec![b2, b1, a[2], a[1], a[0]], "newest first, every state");
    let page = ids(client.jobs(&JobFilter::default(), 2, Some(JobId(b1))).await.unwrap());
    assert_eq!(page, vec![a[2], a[1]], "the next page below the cursor");
    let filter = |f: fn(&mut JobFilter)| {
        let mut filter = JobFilter::default();
        f(&mut filter);
        filter
    };
    let by = |f: JobFilter| {
        let client = client.clone();
        async move { ids(client.jobs(&f, 50, None).await.unwrap()) }
    };
    assert_eq!(by(filter(|f| f.job_type = Some("a".into()))).await, vec![a[2], a[1], a[0]]);
    assert_eq!(by(filter(|f| f.states = vec!["parked".into()])).await, vec![b2]);
    assert_eq!(by(filter(|f| f.states = vec!["scheduled".into(), "parked".into()])).await, vec![b2, a[2]]);
    assert_eq!(by(filter(|f| f.queue = Some("other".into()))).await, vec![b2, b1]);
    assert_eq!(by(filter(|f| f.search = Some("bob".into()))).await, vec![a[1]], "case-insensitive text in args");
    assert_eq!(by(filter(|f| f.key = Some(r#"b:["x"]"#.into()))).await, vec![b2, b1]);
    assert_eq!(
        by(filter(|f| f.since = Some(chrono::Utc::now() + chrono::Duration::hours(1)))).await,
        Vec::<i64>::new()
    );
    assert_eq!(by(filter(|f| f.until = Some(chrono::Utc::now() + chrono::Duration::hours(1)))).await.len(), 5);
    // Bad filters are refused, naming the problem.
    let bad_state = client.jobs(&filter(|f| f.states = vec!["lost".into()]), 50, None).await.unwrap_err();
    assert!(
        matches!(&bad_state, DbError::InvalidArgument(m) if m.contains("invalid job state \"lost\"")),
        "{bad_state}"
    );
    let bad_queue = client.jobs(&filter(|f| f.queue = Some("nope".into())), 50, None).await.unwrap_err();
    assert!(matches!(bad_queue, DbError::UnknownQueue(_)), "{bad_queue}");
    let bad_limit = client.jobs(&JobFilter::default(), 0, None).await.unwrap_err();
    assert!(matches!(bad_limit, DbError::InvalidArgument(_)), "{bad_limit}");
    // Cancel by query: only the queued jobs of type a.
    let query = filter(|f| {
        f.job_type = Some("a".into());
        f.states = vec!["queued".into()];
    });
    let cancelled = client.cancel_jobs(&query, 100).await.unwrap();
    let done: Vec<(i64, bool)> = cancelled.iter().map(|c| (c.id.0, c.cancelled)).collect();
    assert_eq!(done, vec![(a[1], true), (a[0], true)]);
    assert_eq!(state_of(&db, a[2]).await, "scheduled");
    assert_eq!((state_of(&db, b1).await, state_of(&db, b2).await), ("queued".to_string(), "parked".to_string()));
    assert_eq!(by(filter(|f| f.states = vec!["cancelled".into()])).await, vec![a[1], a[0]]);
}
