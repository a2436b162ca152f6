//! Cancel and search (issue 12): a job is cancelled in every state it can be in and kept as
//! cancelled; a running job keeps its permit until its handler has stopped (G3), its late outcome
//! changes nothing, and the permit is given back exactly once; a cancel racing a completion on two
//! connections has exactly one winner; a running handler learns of the cancel from its heartbeat
//! and the next job of its key starts only after it ended. `lockgate.jobs` finds jobs by every
//! filter, pages by id, and refuses bad filters.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::{queue, test_config, until_one_waits_for_a_lock, Running, WAIT};
use lockgate::{Client, DbError, Job, JobContext, JobError, JobFilter, JobId, JobPolicy, Registry};
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

async fn release_cancelled(db: &TestDb, d: (i64, i32)) -> bool {
    sqlx::query_scalar("SELECT lockgate.release_cancelled('default', $1, $2)")
        .bind(d.0)
        .bind(d.1)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_cancelled_running_job_keeps_its_permit_until_its_handler_stopped_and_gives_it_back_once() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('one', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    let running = enqueue(&db, "one", "{}", "{}").await;
    let next = enqueue(&db, "one", "{}", "{}").await;
    let d = claim(&db, 1).await[0];
    assert_eq!(state_of(&db, running).await, "running");
    assert_eq!(cancel(&db.pool, running).await, Some(("running".to_string(), true)));
    // Its handler may still run until its worker hears of the cancel: the permit stays held (G3).
    assert_eq!(state_of(&db, next).await, "parked");
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
    assert_eq!((state_of(&db, next).await, permits(&db).await), ("parked".to_string(), (1, 1, vec![])));
    // Its worker, its handler stopped, gives the permit back: only that delivery, only once.
    assert!(!release_cancelled(&db, (d.0, d.1 + 1)).await, "another delivery releases nothing");
    assert!(release_cancelled(&db, d).await);
    assert_eq!(state_of(&db, next).await, "queued", "the next job of the key promoted");
    assert!(!release_cancelled(&db, d).await, "a second call releases nothing");
    assert_eq!(permits(&db).await, (1, 1, vec![]), "nothing released twice");
    let job = lockgate::sql::job(&db.pool, JobId(running)).await.unwrap().unwrap();
    assert_eq!(job.state, "cancelled");
    let attempts = job.attempts.as_array().unwrap();
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!((attempts[0]["outcome"].as_str(), attempts[0]["attempt"].as_i64()), (Some("cancelled"), Some(1)));
    let archived: i64 = sqlx::query_scalar("SELECT count(*) FROM pgmq.a_default").fetch_one(&db.pool).await.unwrap();
    assert_eq!(archived, 1);
}

#[tokio::test]
async fn a_cancelled_running_job_whose_worker_died_frees_its_permit_when_its_lease_runs_out() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('one', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    let running = enqueue(&db, "one", "{}", "{}").await;
    let next = enqueue(&db, "one", "{}", "{}").await;
    claim(&db, 1).await;
    assert_eq!(cancel(&db.pool, running).await, Some(("running".to_string(), true)));
    sqlx::query("SELECT lockgate.sweep()").execute(&db.pool).await.unwrap();
    assert_eq!(state_of(&db, next).await, "parked", "not while the holder's budget may still run");
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second'").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.sweep()").execute(&db.pool).await.unwrap();
    assert_eq!(state_of(&db, next).await, "queued", "the sweep frees it once the lease ran out (G5)");
    assert_eq!(permits(&db).await, (1, 1, vec![]));
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
            // The losing delivery's handler has ended: its worker gives the permit back.
            assert!(release_cancelled(&db, d).await);
        } else {
            assert_eq!(cancelled, Some(("succeeded".to_string(), false)), "the cancel lost");
            assert_eq!(state_of(&db, id).await, "succeeded");
        }
        assert_eq!(state_of(&db, next).await, "queued", "the next job promoted once");
        assert_eq!(permits(&db).await, (1, 1, vec![]), "the permit given back once (cancel first: {cancel_first})");
    }
}

#[derive(Serialize, Deserialize)]
struct Wait {
    n: u32,
}

impl Job for Wait {
    const TYPE: &'static str = "wait";
    fn policy() -> JobPolicy {
        let mut policy = JobPolicy::on_queue(queue("default"));
        policy.max_attempts = 1;
        policy.concurrency = Some(lockgate::ConcurrencyPolicy::new(1));
        policy
    }
}

/// As `Wait`, but unlimited: one run at a time only through its while_executing key (the soak's
/// overlap of seed 17377274692953123380: the cancel released the key while the handler ran).
#[derive(Serialize, Deserialize)]
struct WaitAlone {
    n: u32,
}

impl Job for WaitAlone {
    const TYPE: &'static str = "wait_alone";
    fn policy() -> JobPolicy {
        let mut policy = JobPolicy::on_queue(queue("default"));
        policy.max_attempts = 1;
        policy.unique = Some(lockgate::UniquePolicy::new(lockgate::UniqueMode::WhileExecuting));
        policy
    }
}

/// Registers a handler for `J` in which job 1 waits for its cancellation and job 2 records its
/// start; the events go to `seen`.
fn waiting_handler<J: Job + Send + 'static>(
    registry: &mut Registry,
    seen: Arc<Mutex<Vec<String>>>,
    n_of: fn(&J) -> u32,
) {
    registry
        .register::<J, _>(move |ctx: JobContext, job: J| {
            let seen = Arc::clone(&seen);
            let n = n_of(&job);
            async move {
                seen.lock().unwrap().push(format!("start {n}"));
                if n == 1 {
                    ctx.cancelled().await;
                    let reason = ctx.cancel_reason().map_or("none".to_string(), |r| r.to_string());
                    seen.lock().unwrap().push(format!("end 1: {reason}"));
                    return Err(JobError::new("stopped"));
                }
                Ok(())
            }
        })
        .unwrap();
}

/// Job 1 waits for its cancellation; job 2, of the same key (a limit-1 concurrency key, then a
/// while_executing key of an unlimited type), records its start: it must not start before job 1's
/// handler ended.
#[tokio::test]
async fn a_running_handler_is_cancelled_through_its_heartbeat_and_the_next_job_starts_only_after_it_ended() {
    for limited in [true, false] {
        let db = TestDb::migrated().await.unwrap();
        let client = Client::new(db.pool.clone());
        let events = Arc::new(Mutex::new(Vec::<String>::new()));
        let mut registry = Registry::new();
        let (id, job_type) = if limited {
            client.define::<Wait>().await.unwrap();
            let id = client.enqueue(&Wait { n: 1 }).await.unwrap().job_id;
            client.enqueue(&Wait { n: 2 }).await.unwrap();
            waiting_handler::<Wait>(&mut registry, Arc::clone(&events), |j| j.n);
            (id, Wait::TYPE)
        } else {
            client.define::<WaitAlone>().await.unwrap();
            let id = client.enqueue(&WaitAlone { n: 1 }).await.unwrap().job_id;
            client.enqueue(&WaitAlone { n: 2 }).await.unwrap();
            waiting_handler::<WaitAlone>(&mut registry, Arc::clone(&events), |j| j.n);
            (id, WaitAlone::TYPE)
        };
        // The heartbeat tells job 1 of its cancel up to a second later; claims come every 50 ms.
        // The visibility is long, so that a lock left to run out with it (held_until) would
        // start job 2 far later than a lock the worker gave back.
        let config = lockgate::RuntimeConfig {
            visibility_timeout: std::time::Duration::from_secs(10),
            heartbeat_interval: std::time::Duration::from_secs(1),
            poll_interval: std::time::Duration::from_millis(50),
            ..test_config()
        };
        let pools = vec![lockgate::PoolConfig::new("test", vec![queue("default")], 2)];
        let runtime = lockgate::Runtime::new(db.new_pool(2).await.unwrap(), config, registry, pools).unwrap();
        let metrics = runtime.metrics();
        let running = Running::spawn(runtime);
        let events_now = || events.lock().unwrap().clone();
        wait_for("job 1 to start", WAIT, || async { Ok((events_now() == ["start 1"]).then_some(())) }).await.unwrap();
        let mut held_until = None;
        if limited {
            let outcome = client.cancel(id).await.unwrap().unwrap();
            assert_eq!((outcome.state.as_str(), outcome.cancelled), ("running", true));
        } else {
            // Job 2, put back while job 1 holds the key, is visible again the instant the cancel
            // commits: the next claim must still not start it beside job 1's handler.
            let mut tx = db.pool.begin().await.unwrap();
            assert_eq!(cancel(&mut *tx, id.0).await, Some(("running".to_string(), true)));
            sqlx::query("UPDATE pgmq.q_default SET vt = clock_timestamp() WHERE msg_id <> $1")
                .bind(id.0)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            let until: chrono::DateTime<chrono::Utc> =
                sqlx::query_scalar("SELECT held_until FROM lockgate.unique_locks WHERE job_id = $1")
                    .bind(id.0)
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
            held_until = Some(until);
        }
        wait_for("job 2 to run", WAIT, || async { Ok((events_now().len() == 3).then_some(())) }).await.unwrap();
        assert_eq!(
            events_now(),
            ["start 1", "end 1: cancelled", "start 2"],
            "never both at once (G3; limited: {limited})"
        );
        if let Some(until) = held_until {
            assert!(chrono::Utc::now() < until, "the worker gave the key back once job 1 ended, before {until}");
        }
        running.stop().await;
        let text = metrics.encode();
        let line = format!(r#"lockgate_jobs_cancelled_total{{queue="default",job_type="{job_type}"}} 1"#);
        assert!(text.lines().any(|l| l == line), "the stopped handler is counted once:\n{text}");
        assert_eq!(state_of(&db, id.0).await, "cancelled", "its failed return wrote nothing");
        let dead: i64 =
            sqlx::query_scalar("SELECT count(*) FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
        assert_eq!(dead, 0, "never dead-lettered");
        if limited {
            assert_eq!(permits(&db).await, (0, 0, vec![]));
        }
        let locks: i64 =
            sqlx::query_scalar("SELECT count(*) FROM lockgate.unique_locks").fetch_one(&db.pool).await.unwrap();
        assert_eq!(locks, 0, "every lock given back");
    }
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
    let count = client.cancel_jobs(&query, 100).await.unwrap();
    assert_eq!((count.matched, count.cancelled), (2, 2));
    assert_eq!(state_of(&db, a[2]).await, "scheduled");
    assert_eq!((state_of(&db, b1).await, state_of(&db, b2).await), ("queued".to_string(), "parked".to_string()));
    assert_eq!(by(filter(|f| f.states = vec!["cancelled".into()])).await, vec![a[1], a[0]]);
}

/// A cancelled running job's while_executing lock is kept while its handler may run: a job of
/// the same key is not started beside it (the soak's overlap of seed 17377274692953123380), and
/// its worker gives the lock back once the handler ended; a dead worker's lock is free once the
/// cancelled delivery's visibility has passed (and the reaper takes it then), so it never leaks.
#[tokio::test]
async fn a_cancelled_running_job_keeps_its_while_executing_key_until_its_handler_stopped() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('w', unique_mode => 'while_executing', unique_key => ARRAY['u'])")
        .execute(&db.pool)
        .await
        .unwrap();
    let lock = || async {
        sqlx::query_as::<_, (i64, bool)>("SELECT job_id, held_until IS NOT NULL FROM lockgate.unique_locks")
            .fetch_all(&db.pool)
            .await
            .unwrap()
    };
    // Put-back jobs are visible again at once, as a second later.
    let visible_now = || async {
        sqlx::query(
            "UPDATE pgmq.q_default SET vt = clock_timestamp() WHERE vt > clock_timestamp() AND headers ? 'retry_at'",
        )
        .execute(&db.pool)
        .await
        .unwrap();
    };
    for worker_alive in [true, false] {
        let first = enqueue(&db, "w", r#"{"u": 1}"#, "{}").await;
        let second = enqueue(&db, "w", r#"{"u": 1}"#, "{}").await;
        let d = claim(&db, 5).await;
        assert_eq!(d.len(), 1, "one run of the key at a time: {d:?}");
        assert_eq!(cancel(&db.pool, first).await, Some(("running".to_string(), true)));
        assert_eq!(lock().await, vec![(first, true)], "kept for the handler that may still run");
        visible_now().await;
        assert_eq!(
            claim(&db, 5).await,
            vec![],
            "not started beside the cancelled handler (worker alive: {worker_alive})"
        );
        assert_eq!(state_of(&db, second).await, "queued", "put back for its busy key: a return");
        // From review: a lock as old as a long run is still judged by held_until alone.
        sqlx::query("UPDATE lockgate.unique_locks SET acquired_at = now() - interval '1 hour'")
            .execute(&db.pool)
            .await
            .unwrap();
        let reaped: i32 = sqlx::query_scalar("SELECT lockgate.reap_unique_locks()").fetch_one(&db.pool).await.unwrap();
        assert_eq!(reaped, 0, "not reaped while the handler may run");
        if worker_alive {
            assert!(release_cancelled(&db, d[0]).await, "its worker gives the key back");
            assert!(!release_cancelled(&db, d[0]).await, "once");
        } else {
            // The worker died: its watchdog stopped the handler by the end of the visibility it
            // had when it was cancelled.
            sqlx::query("UPDATE lockgate.unique_locks SET held_until = clock_timestamp() - interval '1 second'")
                .execute(&db.pool)
                .await
                .unwrap();
        }
        visible_now().await;
        let next = claim(&db, 5).await;
        assert_eq!(next.len(), 1, "the next job of the key runs (worker alive: {worker_alive})");
        assert_eq!(lock().await, vec![(second, false)]);
        assert!(common::complete_default(&db.pool, next[0]).await);
        assert_eq!(lock().await, vec![]);
    }
    // A dead worker's lock with no job waiting for the key: the reaper takes it once it is free.
    let alone = enqueue(&db, "w", r#"{"u": 2}"#, "{}").await;
    claim(&db, 1).await;
    assert_eq!(cancel(&db.pool, alone).await, Some(("running".to_string(), true)));
    sqlx::query("UPDATE lockgate.unique_locks SET held_until = clock_timestamp() - interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    let reaped: i32 = sqlx::query_scalar("SELECT lockgate.reap_unique_locks()").fetch_one(&db.pool).await.unwrap();
    assert_eq!((reaped, lock().await), (1, vec![]));
}

/// Design §95: `lockgate.extend_cancelled` keeps what a cancelled running delivery kept (its
/// permit lease and its while_executing lock) for a handler that has not stopped, fenced on that
/// delivery: another read_ct, a job that was not running when cancelled, or one not cancelled
/// renews nothing; a row another transaction holds is skipped and reported busy without a wait
/// (H28); a lease already run out is not taken back, and the sweep frees it.
#[tokio::test]
async fn a_cancelled_delivery_renews_what_it_kept_only_for_itself_and_never_waits() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query(
        "SELECT lockgate.define_job_type('w', concurrency_limit => 1, concurrency_duration_ms => 1000,
                                          unique_mode => 'while_executing', unique_key => ARRAY['u'])",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let extend = |d: (i64, i32)| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (i64, bool)>(
                "SELECT msg_id, busy FROM lockgate.extend_cancelled('default', $1, $2, 30)",
            )
            .bind(vec![d.0])
            .bind(vec![d.1])
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    // (lease left, lock left) in seconds.
    let held = || async {
        sqlx::query_as::<_, (Option<f64>, Option<f64>)>(
            "SELECT (SELECT extract(epoch FROM max(expires_at) - clock_timestamp())::float8 FROM lockgate.leases),
                    (SELECT extract(epoch FROM max(held_until) - clock_timestamp())::float8 FROM lockgate.unique_locks)",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    let first = enqueue(&db, "w", r#"{"u": 1}"#, "{}").await;
    let next = enqueue(&db, "w", r#"{"u": 1}"#, "{}").await;
    let d = claim(&db, 5).await[0];
    assert_eq!(extend(d).await, vec![], "a running job not cancelled: extend's business, not this");
    assert_eq!(cancel(&db.pool, first).await, Some(("running".to_string(), true)));
    let invalid = sqlx::query("SELECT * FROM lockgate.extend_cancelled('default', '{1}', '{1}', 0)")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(invalid.to_string().contains("invalid visibility timeout"), "{invalid}");
    assert_eq!(extend((d.0, d.1 + 1)).await, vec![], "another delivery of the message renews nothing");
    sqlx::query("UPDATE lockgate.leases SET expires_at = clock_timestamp() + interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE lockgate.unique_locks SET held_until = clock_timestamp() + interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(extend(d).await, vec![(d.0, false)]);
    let (lease, lock) = held().await;
    assert!(lease.unwrap() > 1.5 && lock.unwrap() > 25.0, "both pushed out: lease {lease:?}, lock {lock:?}");
    // Rows held by another transaction (a sweep, its own release) are skipped, not waited for.
    for row in ["SELECT 1 FROM lockgate.leases FOR UPDATE", "SELECT 1 FROM lockgate.unique_locks FOR UPDATE"] {
        let mut other = db.pool.begin().await.unwrap();
        sqlx::query(row).execute(&mut *other).await.unwrap();
        assert_eq!(extend(d).await, vec![(d.0, true)], "busy behind {row}");
        other.rollback().await.unwrap();
    }
    assert_eq!(state_of(&db, next).await, "parked", "the next job of the key waits all along");
    // Run out (its worker was silent past its budget): not taken back; the sweep frees it.
    sqlx::query("UPDATE lockgate.leases SET expires_at = clock_timestamp() - interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE lockgate.unique_locks SET held_until = clock_timestamp() - interval '1 second'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(extend(d).await, vec![], "nothing held any more");
    sqlx::query("SELECT lockgate.sweep()").execute(&db.pool).await.unwrap();
    assert_eq!(state_of(&db, next).await, "queued");
    assert_eq!(permits(&db).await, (1, 1, vec![]));
    // Once given back, nothing is left to renew.
    let d2 = claim(&db, 5).await[0];
    assert_eq!(cancel(&db.pool, next).await, Some(("running".to_string(), true)));
    assert!(release_cancelled(&db, d2).await);
    assert_eq!(extend(d2).await, vec![]);
    // A queue dropped meanwhile answers nothing rather than an error.
    let gone: i64 =
        sqlx::query_scalar("SELECT count(*) FROM lockgate.extend_cancelled('nosuchqueue', '{1}', '{1}', 30)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(gone, 0);
}

/// From review: a type that discards duplicates does not discard the job that replaces a
/// cancelled one whose handler may still run: it waits for the key, then runs.
#[tokio::test]
async fn a_job_enqueued_after_a_cancel_is_no_duplicate_of_the_cancelled_one() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query(
        "SELECT lockgate.define_job_type('wd', unique_mode => 'while_executing', unique_on_conflict => 'discard')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let cancelled = enqueue(&db, "wd", "{}", "{}").await;
    let d = claim(&db, 1).await[0];
    assert_eq!(cancel(&db.pool, cancelled).await, Some(("running".to_string(), true)));
    let replacement = enqueue(&db, "wd", "{}", "{}").await;
    assert_eq!(claim(&db, 5).await, vec![], "waits while the cancelled handler may run");
    assert_eq!(state_of(&db, replacement).await, "queued", "put back for its busy key, not discarded");
    assert!(release_cancelled(&db, d).await);
    sqlx::query("UPDATE pgmq.q_default SET vt = clock_timestamp()").execute(&db.pool).await.unwrap();
    let headers: Vec<serde_json::Value> =
        sqlx::query_scalar("SELECT headers FROM lockgate.claim('default', 5, 30)").fetch_all(&db.pool).await.unwrap();
    assert_eq!(headers.len(), 1);
    assert!(headers[0].get("duplicate_of").is_none(), "it runs: {}", headers[0]);
}

/// From the second review: a cancelled running job's live lease is no doctor alarm, it is no
/// success in the throughput, and a parked job of a queue dropped behind lockgate's back can
/// still be cancelled, kept with the dead letters.
#[tokio::test]
async fn cancel_leaves_no_lock_behind_raises_no_alarm_and_counts_no_success() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query(
        "SELECT lockgate.define_job_type('w', concurrency_limit => 1, unique_mode => 'while_executing',
                                         unique_key => ARRAY['u'])",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let running = enqueue(&db, "w", r#"{"u": 1}"#, "{}").await;
    let d = claim(&db, 1).await[0];
    let locks = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM lockgate.unique_locks").fetch_one(&db.pool).await.unwrap()
    };
    assert_eq!(locks().await, 1, "taken by the claim");
    assert_eq!(cancel(&db.pool, running).await, Some(("running".to_string(), true)));
    let verdict: String =
        sqlx::query_scalar("SELECT verdict FROM lockgate.doctor() WHERE check_name = 'orphaned_leases'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(verdict, "ok", "a cancelled job's lease waiting for its handler is expected");
    let succeeded: i64 = sqlx::query_scalar("SELECT succeeded_last_hour FROM lockgate.queue_throughput()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(succeeded, 0, "a cancelled job is archived, not succeeded");
    assert!(release_cancelled(&db, d).await);
    assert_eq!(locks().await, 0, "given back with the permit");
    // A parked job whose queue was dropped behind lockgate's back.
    sqlx::query("SELECT lockgate.define_job_type('gone', queue => 'doomed', concurrency_limit => 1)")
        .execute(&db.pool)
        .await
        .unwrap();
    enqueue(&db, "gone", "{}", "{}").await;
    let parked = enqueue(&db, "gone", "{}", "{}").await;
    sqlx::query("SELECT pgmq.drop_queue('doomed')").execute(&db.pool).await.unwrap();
    assert_eq!(cancel(&db.pool, parked).await, Some(("parked".to_string(), true)));
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.dead_letters WHERE job_id = $1")
        .bind(parked)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(kept, 1, "kept with the dead letters, not lost");
}

/// A message sent without lockgate's headers is dead-lettered by the claim with no job id;
/// `lockgate.job()` shows it under its msg_id, and every verb that takes a job id finds it by
/// that id: retried, discarded, purged (review helper-81: "job 2: dead", then "no dead letter
/// for job 2").
#[tokio::test]
async fn a_dead_letter_without_lockgates_headers_is_found_by_the_id_it_is_shown_under() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('default')").execute(&db.pool).await.unwrap();
    let send = "SELECT pgmq.send('default', '{\"h\": 0}'::jsonb)";
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(sqlx::query_scalar::<_, i64>(send).fetch_one(&db.pool).await.unwrap());
    }
    assert!(claim(&db, 10).await.is_empty(), "all three are dead-lettered as undecodable");
    for id in &ids {
        assert_eq!(state_of(&db, *id).await, "dead");
    }
    let retried: Vec<i64> = sqlx::query_scalar("SELECT msg_id FROM lockgate.dlq_retry(NULL, ARRAY[$1::bigint])")
        .bind(ids[0])
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(retried.len(), 1, "retried by its id");
    let discarded: (String, bool) = sqlx::query_as("SELECT state, discarded FROM lockgate.discard_job($1)")
        .bind(ids[1])
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(discarded, ("dead".to_string(), true));
    let purged: i64 = sqlx::query_scalar("SELECT lockgate.dlq_purge(NULL, ARRAY[$1::bigint])")
        .bind(ids[2])
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(purged, 1);
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0);
}

/// Review helper-144 F2: a discard of a dead job that waited for a retry of it (the retry held
/// its dead letter) found nothing to delete once the retry committed, and returned the state it had
/// read: ("dead", false), which the CLI printed as "job 77 is dead: only a dead or parked job can be
/// discarded". It looks the job up again: ("queued", false).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discard_that_waited_for_a_retry_says_the_state_the_job_is_in() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('mail');
         INSERT INTO lockgate.dead_letters (queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at)
         VALUES ('default', 77, 77, 'mail', '{}', '{\"type\": \"mail\", \"job_id\": 77}', 'attempts_exhausted', 'failed', 1, now());",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut retrier = db.pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM lockgate.dlq_retry(NULL, ARRAY[77]::bigint[], true)")
        .execute(&mut *retrier)
        .await
        .unwrap();
    let discarding = tokio::spawn({
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (String, bool)>("SELECT state, discarded FROM lockgate.discard_job(77)")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    });
    until_one_waits_for_a_lock(&db.pool).await;
    retrier.commit().await.unwrap();
    let answered = tokio::time::timeout(WAIT, discarding).await.expect("the discard returns").unwrap();
    assert_eq!(answered, ("queued".to_string(), false));
}
