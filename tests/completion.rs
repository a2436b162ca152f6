//! Fenced completion (G2) and completion through a broken commit (H13), driven through the
//! completer's own path (`worker::complete_deliveries`) against the real database.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use lockgate::sql::{claim, PgPoolOptions};
use lockgate::worker::complete_deliveries;
use lockgate::{ArchiveOutcome, Client, Job};
use lockgate_testkit::{FaultProxy, TestDb};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Noop {}

impl Job for Noop {
    const TYPE: &'static str = "noop";
}

async fn one_job(db: &TestDb) {
    let client = Client::new(db.pool.clone());
    client.define::<Noop>().await.unwrap();
    client.enqueue(&Noop {}).await.unwrap();
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

#[tokio::test]
async fn g2_stale_delivery_cannot_archive_after_redelivery() {
    let db = TestDb::migrated().await.unwrap();
    one_job(&db).await;
    let q = common::queue("default");
    let first = claim(&db.pool, &q, 1, Duration::from_secs(30)).await.unwrap().remove(0);
    db.expire_visibility("default", first.msg_id).await.unwrap();
    let second = claim(&db.pool, &q, 1, Duration::from_secs(30)).await.unwrap().remove(0);
    assert_eq!((second.msg_id, second.read_ct), (first.msg_id, first.read_ct + 1));

    let stale = complete_deliveries(&db.pool, &q, &[(first.msg_id, first.read_ct)], deadline()).await;
    assert_eq!(stale, vec![Ok(ArchiveOutcome::AlreadyArchived)]);
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 0, "the stale delivery archived nothing");
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 1, "the newer delivery still owns it");

    let owner = complete_deliveries(&db.pool, &q, &[(second.msg_id, second.read_ct)], deadline()).await;
    assert_eq!(owner, vec![Ok(ArchiveOutcome::Archived)]);
    let again = complete_deliveries(&db.pool, &q, &[(second.msg_id, second.read_ct)], deadline()).await;
    assert_eq!(again, vec![Ok(ArchiveOutcome::AlreadyArchived)], "a duplicate completion changes nothing");
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 1);
}

#[tokio::test]
async fn h13_reply_lost_after_commit_is_ambiguous_and_archives_once() {
    let db = TestDb::migrated().await.unwrap();
    one_job(&db).await;
    let q = common::queue("default");
    let delivery = claim(&db.pool, &q, 1, Duration::from_secs(30)).await.unwrap().remove(0);

    let proxy = FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let url = db.url.replace("127.0.0.1:5432", &format!("127.0.0.1:{}", proxy.port));
    assert_ne!(url, db.url, "the test database URL must go through the proxy");
    // One connection, with the statement already prepared on it: the next call's only reply
    // is the one the server sends after committing, and that is the one the proxy drops.
    let via_proxy = PgPoolOptions::new().max_connections(1).test_before_acquire(false).connect(&url).await.unwrap();
    let warm = complete_deliveries(&via_proxy, &q, &[(0, 0)], deadline()).await;
    assert_eq!(warm, vec![Ok(ArchiveOutcome::AlreadyArchived)]);

    proxy.cut_next_reply();
    let outcome = complete_deliveries(&via_proxy, &q, &[(delivery.msg_id, delivery.read_ct)], deadline()).await;
    assert!(proxy.has_cut(), "the fault was injected");
    assert_eq!(outcome, vec![Ok(ArchiveOutcome::Ambiguous)]);
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 1, "archived exactly once");
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 0);
}

#[tokio::test]
async fn h13_backend_terminated_before_commit_is_retried_and_archives_once() {
    let db = TestDb::migrated().await.unwrap();
    one_job(&db).await;
    let q = common::queue("default");
    let delivery = claim(&db.pool, &q, 1, Duration::from_secs(30)).await.unwrap().remove(0);

    // Hold the message row so the completion blocks inside its statement, then kill its backend.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM pgmq.q_default WHERE msg_id = $1 FOR UPDATE")
        .bind(delivery.msg_id)
        .execute(&mut *blocker)
        .await
        .unwrap();
    let completer_pool = db.new_pool(2).await.unwrap();
    let q2 = q.clone();
    let token = (delivery.msg_id, delivery.read_ct);
    let completion = tokio::spawn(async move { complete_deliveries(&completer_pool, &q2, &[token], deadline()).await });
    let pid: i32 = lockgate_testkit::wait_for("the completion to block on the row lock", common::WAIT, || async {
        Ok(sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE '%lockgate.complete%'",
        )
        .fetch_optional(&db.pool)
        .await?)
    })
    .await
    .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&db.pool).await.unwrap();
    blocker.rollback().await.unwrap();

    let outcome = completion.await.unwrap();
    assert!(matches!(outcome[..], [Ok(ArchiveOutcome::Archived)] | [Ok(ArchiveOutcome::Ambiguous)]), "{outcome:?}");
    assert_eq!(outcome, vec![Ok(ArchiveOutcome::Archived)], "nothing committed before the kill, so the retry archives");
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 1, "archived exactly once");
}

#[tokio::test]
async fn h18_a_completion_stalled_by_a_database_blip_lands_once_the_database_is_back() {
    use lockgate::{JobContext, JobError, Registry};
    use std::sync::Arc;

    let db = TestDb::migrated().await.unwrap();
    one_job(&db).await;
    let proxy = Arc::new(FaultProxy::start("127.0.0.1:5432".into()).await.unwrap());
    let pool = PgPoolOptions::new().max_connections(6).connect(&proxy.url_for(&db.url)).await.unwrap();
    let starts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut registry = Registry::new();
    let (handler_proxy, handler_starts) = (Arc::clone(&proxy), Arc::clone(&starts));
    registry
        .register::<Noop, _>(move |_ctx: JobContext, _job: Noop| {
            let (proxy, starts) = (Arc::clone(&handler_proxy), Arc::clone(&handler_starts));
            async move {
                starts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // The database goes away just as the job finishes: its completion must wait.
                proxy.freeze();
                Ok::<(), JobError>(())
            }
        })
        .unwrap();
    let running = common::Running::start_on(pool, common::test_config(), registry, &["default"], 1);
    lockgate_testkit::wait_for("the job to finish and the blip to begin", common::WAIT, || async {
        Ok((starts.load(std::sync::atomic::Ordering::SeqCst) == 1).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 0, "not completed during the blip");
    proxy.thaw();
    lockgate_testkit::wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, common::WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(starts.load(std::sync::atomic::Ordering::SeqCst), 1, "the job ran once: its completion was retried");
    let read_ct: i32 = sqlx::query_scalar("SELECT read_ct FROM pgmq.a_default").fetch_one(&db.pool).await.unwrap();
    assert_eq!(read_ct, 1);
}

/// Issue 14 (docs/design.md §58): a completion runs the queue's completion step only as lockgate
/// wrote it. With the step dropped and another role's function planted under its name and
/// arguments, the completion plans its own statements: a stale delivery still archives nothing
/// (G2), the current one archives, the start of a delivery claimed ahead is recorded, and the
/// planted function never runs. The role lives in one transaction, rolled back.
#[tokio::test]
async fn g2_a_completion_runs_no_completion_step_but_lockgates() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Noop>().await.unwrap();
    client.enqueue_many(&[Noop {}, Noop {}]).await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let claimed: Vec<(i64, i32)> =
        sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 2, 30, NULL, 1) ORDER BY msg_id")
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    let ((done, done_ct), (ahead, ahead_ct)) = (claimed[0], claimed[1]);
    let other = format!("{}_other", db.name);
    sqlx::raw_sql(&format!(
        "DROP FUNCTION lockgate._complete_into_default(bigint[], integer[], bigint[], integer[]);
         CREATE ROLE {other} NOLOGIN; GRANT USAGE, CREATE ON SCHEMA lockgate TO {other};
         CREATE TABLE public.planted_ran (n integer); GRANT INSERT ON public.planted_ran TO PUBLIC;
         SET LOCAL ROLE {other};
         CREATE FUNCTION lockgate._complete_into_default(bigint[], integer[], bigint[], integer[])
             RETURNS TABLE (archived bigint[], limited bigint[], kept jsonb)
             LANGUAGE sql AS 'INSERT INTO public.planted_ran VALUES (1) RETURNING ARRAY[-1::bigint], NULL::bigint[], NULL::jsonb';
         RESET ROLE;"
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    let complete = "SELECT c FROM lockgate.complete('default', ARRAY[$1]::bigint[], ARRAY[$2]::integer[],
                                                   ARRAY[$3]::bigint[], ARRAY[$4]::integer[]) c";
    let stale: Vec<i64> = sqlx::query_scalar(complete)
        .bind(done)
        .bind(done_ct + 1)
        .bind(ahead)
        .bind(ahead_ct)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(stale, Vec::<i64>::new(), "a stale delivery archives nothing");
    let archived: Vec<i64> = sqlx::query_scalar(complete)
        .bind(done)
        .bind(done_ct)
        .bind(ahead)
        .bind(ahead_ct)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(archived, vec![done], "the current delivery archives");
    let started: bool = sqlx::query_scalar("SELECT last_read_at IS NOT NULL FROM pgmq.q_default WHERE msg_id = $1")
        .bind(ahead)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert!(started, "the start of the delivery claimed ahead is recorded");
    let ran: i64 = sqlx::query_scalar("SELECT count(*) FROM public.planted_ran").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(ran, 0, "the planted function never ran");
    tx.rollback().await.unwrap();
}

/// Issue 14 (docs/design.md §58, from a review): a queue's completion step keeps one plan for
/// its session, so that plan must suit the queue at any size. One made while the queue was small
/// and freshly analysed joined the completed ids to a sequential scan of the queue table, and
/// kept doing so once the queue held 200,000 jobs (tens of milliseconds for a completion of one
/// job). A session completes ten times on a small analysed queue; another fills the queue; the
/// first session's next completion reads the queue table by index only: no sequential scan in
/// its transaction.
#[tokio::test]
async fn a_completion_plan_made_on_a_small_queue_scans_no_table() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Noop>().await.unwrap();
    client.enqueue_many(&(0..40).map(|_| Noop {}).collect::<Vec<_>>()).await.unwrap();
    sqlx::query("VACUUM ANALYZE pgmq.q_default").execute(&db.pool).await.unwrap();
    let mut completer = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
    let claim_some = "SELECT msg_id, read_ct FROM lockgate.claim('default', $1, 30, NULL, $2) ORDER BY msg_id";
    let complete = "SELECT count(*) FROM lockgate.complete('default', $1, $2, $3, $4)";
    let round = async |conn: &mut sqlx::PgConnection, n: i32| -> i64 {
        let got: Vec<(i64, i32)> = sqlx::query_as(claim_some).bind(2 * n).bind(n).fetch_all(&db.pool).await.unwrap();
        let (done, ahead) = got.split_at(got.len().min(n as usize));
        let ids = |d: &[(i64, i32)]| d.iter().map(|x| x.0).collect::<Vec<_>>();
        let cts = |d: &[(i64, i32)]| d.iter().map(|x| x.1).collect::<Vec<_>>();
        sqlx::query_scalar(complete)
            .bind(ids(done))
            .bind(cts(done))
            .bind(ids(ahead))
            .bind(cts(ahead))
            .fetch_one(&mut *conn)
            .await
            .unwrap()
    };
    for _ in 0..10 {
        round(&mut completer, 1).await;
    }
    client.enqueue_many(&(0..5000).map(|_| Noop {}).collect::<Vec<_>>()).await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut completer).await.unwrap();
    assert_eq!(round(&mut tx, 1).await, 1, "the completion archives its job");
    let scans: i64 = sqlx::query_scalar("SELECT pg_stat_get_xact_numscans('pgmq.q_default'::regclass)")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(scans, 0, "the completion read the queue table by index only");
    tx.commit().await.unwrap();
}

/// Review helper-135 F1: a retry sent again after its reply was lost (the worker re-sends its
/// final statement after a connection error) finds the delivery retried already: it reports the
/// delivery as its own and writes nothing, where it recorded the attempt's error a second time
/// and pushed the backoff again. The next delivery's retry is written as usual.
#[tokio::test]
async fn a_retry_sent_again_for_the_same_delivery_writes_nothing_more() {
    let db = TestDb::migrated().await.unwrap();
    one_job(&db).await;
    let q = common::queue("default");
    let delivery = claim(&db.pool, &q, 1, Duration::from_secs(30)).await.unwrap().remove(0);
    let retry = async |read_ct: i32, delay: f64| -> bool {
        sqlx::query_scalar("SELECT lockgate.retry('default', $1, $2, $3, 'boom', $2)")
            .bind(delivery.msg_id)
            .bind(read_ct)
            .bind(delay)
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let state = async || -> (i64, chrono::DateTime<chrono::Utc>) {
        sqlx::query_as("SELECT jsonb_array_length(headers->'errors')::bigint, vt FROM pgmq.q_default")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    assert!(retry(delivery.read_ct, 0.2).await);
    let first = state().await;
    assert_eq!(first.0, 1);
    assert!(retry(delivery.read_ct, 60.0).await, "the same delivery's retry, sent again, reports it as its own");
    assert_eq!(state().await, first, "and writes neither a second error nor a new backoff");
    let next = lockgate_testkit::wait_for("the retried job to be delivered again", common::WAIT, || async {
        Ok(claim(&db.pool, &q, 1, Duration::from_secs(30)).await?.pop())
    })
    .await
    .unwrap();
    assert_eq!(next.read_ct, delivery.read_ct + 1);
    assert!(retry(next.read_ct, 60.0).await);
    assert_eq!(state().await.0, 2, "the next delivery's failure is recorded");
    assert!(!retry(delivery.read_ct, 60.0).await, "a stale delivery's retry is still refused");
}
