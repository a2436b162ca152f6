//! The claim at the SQL seam: priority order across statements, and a claim's cost bounded by
//! what it takes, not by how many delayed or in-flight messages the queue holds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use lockgate::sql::claim;
use lockgate::{Client, EnqueueOptions, JobPolicy, JobTypeName};
use lockgate_testkit::TestDb;
use serde_json::json;

async fn setup() -> (TestDb, Client) {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client
        .define_job_type(&JobTypeName::new("noop").unwrap(), &JobPolicy::on_queue(common::queue("claims")))
        .await
        .unwrap();
    (db, client)
}

async fn enqueue(client: &Client, n: usize, options: &EnqueueOptions) {
    let args = vec![json!({}); n];
    client.enqueue_many_raw("noop", &args, options).await.unwrap();
}

fn priority(p: i16) -> EnqueueOptions {
    EnqueueOptions { priority: Some(p), ..Default::default() }
}

#[tokio::test]
async fn a_claim_takes_the_best_priority_first_and_fills_up_from_the_next_ones() {
    let (db, client) = setup().await;
    enqueue(&client, 10, &priority(3)).await;
    enqueue(&client, 10, &priority(1)).await;
    enqueue(&client, 5, &priority(0)).await;
    let queue = common::queue("claims");
    let priorities = |claims: &[lockgate::Claim]| {
        let mut p: Vec<i64> =
            claims.iter().map(|c| c.headers.as_ref().unwrap()["priority"].as_i64().unwrap_or(0)).collect();
        p.sort_unstable();
        p
    };
    let first = claim(&db.pool, &queue, 20, Duration::from_secs(30)).await.unwrap();
    let expected: Vec<i64> = [vec![0; 5], vec![1; 10], vec![3; 5]].concat();
    assert_eq!(priorities(&first), expected);
    let rest = claim(&db.pool, &queue, 20, Duration::from_secs(30)).await.unwrap();
    assert_eq!(priorities(&rest), vec![3; 5]);
    assert!(claim(&db.pool, &queue, 20, Duration::from_secs(30)).await.unwrap().is_empty());
}

/// H32: a claim that fills up from several priorities starts as many as there are free handler
/// slots, counted across its priorities in claim order; the rest are claimed ahead.
#[tokio::test]
async fn a_claim_across_priorities_starts_its_first_start_now_jobs_and_claims_the_rest_ahead() {
    let (db, client) = setup().await;
    enqueue(&client, 3, &priority(0)).await;
    enqueue(&client, 3, &priority(1)).await;
    let claims = lockgate::sql::claim_as(&db.pool, &common::queue("claims"), 6, Duration::from_secs(30), None, Some(4))
        .await
        .unwrap();
    let mut ahead: Vec<(i64, bool)> = claims
        .iter()
        .map(|c| (c.headers.as_ref().unwrap()["priority"].as_i64().unwrap_or(0), c.claimed_ahead))
        .collect();
    ahead.sort_unstable();
    assert_eq!(
        ahead,
        vec![(0, false), (0, false), (0, false), (1, false), (1, true), (1, true)],
        "4 start now, 3 of priority 0 and the first of priority 1"
    );
}

#[tokio::test]
async fn a_claim_whose_best_priority_another_claimer_holds_goes_on_to_the_next_one() {
    use sqlx::Connection;
    let (db, client) = setup().await;
    enqueue(&client, 2, &priority(0)).await;
    enqueue(&client, 3, &priority(1)).await;
    // Another claimer holds both priority-0 messages (its claim has not committed yet).
    let mut other = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query("SELECT 1 FROM pgmq.q_claims WHERE NOT headers ? 'priority' OR headers->>'priority' = '0' FOR UPDATE")
        .execute(&mut other)
        .await
        .unwrap();
    let claims = claim(&db.pool, &common::queue("claims"), 10, Duration::from_secs(30)).await.unwrap();
    let priorities: Vec<i64> =
        claims.iter().map(|c| c.headers.as_ref().unwrap()["priority"].as_i64().unwrap_or(0)).collect();
    assert_eq!(priorities, vec![1, 1, 1], "the visible work of the next priority, not an empty claim");
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
}

#[tokio::test]
async fn a_claim_never_walks_the_delayed_or_in_flight_messages_of_its_priority() {
    let (db, client) = setup().await;
    // Five thousand scheduled jobs at the head of the queue, a thousand in flight, ten visible.
    enqueue(&client, 5_000, &EnqueueOptions { delay: Some(Duration::from_secs(3600)), ..Default::default() }).await;
    enqueue(&client, 1_000, &EnqueueOptions::default()).await;
    let queue = common::queue("claims");
    assert_eq!(claim(&db.pool, &queue, 1_000, Duration::from_secs(600)).await.unwrap().len(), 1_000);
    enqueue(&client, 10, &EnqueueOptions::default()).await;
    sqlx::query("ANALYZE pgmq.q_claims").execute(&db.pool).await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let before = common::rows_read(&mut tx, "pgmq.q_claims").await;
    assert_eq!(claim(&mut *tx, &queue, 20, Duration::from_secs(30)).await.unwrap().len(), 10);
    assert!(claim(&mut *tx, &queue, 20, Duration::from_secs(30)).await.unwrap().is_empty());
    let walked = common::rows_read(&mut tx, "pgmq.q_claims").await - before;
    // The claim index puts a priority's visible messages first; claims stop at the first that is not.
    assert!(walked < 100, "two claims fetched {walked} rows of a queue with 6,000 invisible messages");
    tx.rollback().await.unwrap();
}

#[tokio::test]
async fn a_claim_reads_about_what_it_takes_from_a_deep_queue_of_visible_messages() {
    let (db, client) = setup().await;
    for _ in 0..10 {
        enqueue(&client, 1_000, &EnqueueOptions::default()).await;
    }
    sqlx::query("ANALYZE pgmq.q_claims").execute(&db.pool).await.unwrap();
    let queue = common::queue("claims");
    let mut tx = db.pool.begin().await.unwrap();
    let before = common::rows_read(&mut tx, "pgmq.q_claims").await;
    assert_eq!(claim(&mut *tx, &queue, 20, Duration::from_secs(30)).await.unwrap().len(), 20);
    let read = common::rows_read(&mut tx, "pgmq.q_claims").await - before;
    // With nearly every message visible the planner may prefer one pass over the whole table to
    // a probe per priority; the claim must not let it.
    assert!(read < 100, "a claim of 20 read {read} rows of a queue of 10,000");
    tx.rollback().await.unwrap();
}

/// Statistics that say nearly every message is visible at priority 0 (taken during a burst) while
/// nearly every one is now in flight: the probe for the next priority holding a visible message,
/// estimated to find one at once, was planned as a sequential scan per priority, and read the
/// whole queue ten times on every claim (200,000 rows here) until the next ANALYZE.
#[tokio::test]
async fn a_claim_reads_what_it_takes_when_the_statistics_say_the_backlog_is_visible() {
    let (db, client) = setup().await;
    for _ in 0..20 {
        enqueue(&client, 1_000, &EnqueueOptions::default()).await;
    }
    sqlx::query("ANALYZE pgmq.q_claims").execute(&db.pool).await.unwrap();
    let queue = common::queue("claims");
    assert_eq!(claim(&db.pool, &queue, 20_000, Duration::from_secs(600)).await.unwrap().len(), 20_000);
    enqueue(&client, 1, &EnqueueOptions::default()).await;
    let mut tx = db.pool.begin().await.unwrap();
    let before = common::rows_read(&mut tx, "pgmq.q_claims").await;
    assert_eq!(claim(&mut *tx, &queue, 20, Duration::from_secs(30)).await.unwrap().len(), 1);
    assert!(claim(&mut *tx, &queue, 20, Duration::from_secs(30)).await.unwrap().is_empty());
    let read = common::rows_read(&mut tx, "pgmq.q_claims").await - before;
    assert!(read < 100, "two claims read {read} rows of a queue of 20,001, one of them visible");
    tx.rollback().await.unwrap();
}

/// One statement claims across a pool's queues (issue 14): queues in the order given, each for
/// what the earlier ones left, a paused queue skipped, and only `start_now` of them to start at
/// once; an unknown queue fails the whole call (the worker then claims queue by queue).
#[tokio::test]
async fn a_claim_across_queues_takes_them_in_order_for_what_is_left() {
    let (db, client) = setup().await;
    for name in ["first", "paused", "second", "third"] {
        sqlx::query("SELECT lockgate.create_queue($1)").bind(name).execute(&db.pool).await.unwrap();
        let on = EnqueueOptions { queue: Some(common::queue(name)), ..Default::default() };
        enqueue(&client, 3, &on).await;
    }
    sqlx::query("SELECT lockgate.pause_queue('paused')").execute(&db.pool).await.unwrap();
    let queues: Vec<_> = ["first", "paused", "second", "third"].into_iter().map(common::queue).collect();
    let claims =
        lockgate::sql::claim_queues(&db.pool, &queues, 5, Duration::from_secs(30), None, Some(4)).await.unwrap();
    let got: Vec<(&str, bool)> = claims.iter().map(|c| (c.queue.as_str(), c.claimed_ahead)).collect();
    assert_eq!(
        got,
        [("first", false), ("first", false), ("first", false), ("second", false), ("second", true)],
        "queues in order, the paused one skipped, the fifth claimed ahead"
    );
    let rest = lockgate::sql::claim_queues(&db.pool, &queues, 10, Duration::from_secs(30), None, None).await.unwrap();
    let got: Vec<(&str, bool)> = rest.iter().map(|c| (c.queue.as_str(), c.claimed_ahead)).collect();
    // Without start_now every delivery starts, as claim's own default says (review helper-138 F4:
    // every one came back claimed ahead).
    assert_eq!(got, [("second", false), ("third", false), ("third", false), ("third", false)]);
    let missing = vec![common::queue("first"), common::queue("nowhere")];
    assert!(lockgate::sql::claim_queues(&db.pool, &missing, 10, Duration::from_secs(30), None, None).await.is_err());
}

/// Issue 14 (docs/design.md §54): a session keeps the plan of its claim statements, and after
/// five calls that may be the generic plan, made without knowing how many a claim asks for.
/// Guessing a large claim, it joined the taken rows back to the queue through a sequential scan,
/// and every later claim of that session read the whole queue, even one that takes ten.
#[tokio::test]
async fn a_session_whose_claims_were_large_still_reads_only_what_a_small_claim_takes() {
    let (db, client) = setup().await;
    for _ in 0..30 {
        enqueue(&client, 1_000, &EnqueueOptions::default()).await;
    }
    sqlx::query("VACUUM ANALYZE pgmq.q_claims").execute(&db.pool).await.unwrap();
    let queue = common::queue("claims");
    let mut conn = db.pool.acquire().await.unwrap();
    for _ in 0..6 {
        assert_eq!(claim(&mut *conn, &queue, 4_000, Duration::from_secs(600)).await.unwrap().len(), 4_000);
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let before = common::rows_read(&mut tx, "pgmq.q_claims").await;
    assert_eq!(claim(&mut *tx, &queue, 10, Duration::from_secs(600)).await.unwrap().len(), 10);
    let read = common::rows_read(&mut tx, "pgmq.q_claims").await - before;
    assert!(read < 100, "a claim of 10 read {read} rows of a queue of 30,000 after six claims of 4,000");
    tx.rollback().await.unwrap();
}

/// The claim's plan, like the completion's, may be made while the queue is small: after five
/// claims on a freshly analysed queue of 40 jobs the session kept a generic plan that read the
/// queue table sequentially (the join back of the taken rows, and the take itself), which is
/// cheapest on one page. Once producers filled the queue every claim of that session read the
/// whole table, until the next ANALYZE. The claim step runs with sequential scans off.
#[tokio::test]
async fn a_claim_plan_made_on_a_small_queue_scans_no_table() {
    let (db, client) = setup().await;
    enqueue(&client, 40, &EnqueueOptions::default()).await;
    sqlx::query("VACUUM ANALYZE pgmq.q_claims").execute(&db.pool).await.unwrap();
    let queue = common::queue("claims");
    let mut conn = db.pool.acquire().await.unwrap();
    for _ in 0..6 {
        assert_eq!(claim(&mut *conn, &queue, 2, Duration::from_secs(600)).await.unwrap().len(), 2);
    }
    enqueue(&client, 5_000, &EnqueueOptions::default()).await;
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    assert_eq!(claim(&mut *tx, &queue, 16, Duration::from_secs(600)).await.unwrap().len(), 16);
    let scans: i64 = sqlx::query_scalar("SELECT pg_stat_get_xact_numscans('pgmq.q_claims'::regclass)")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(scans, 0, "the claim read the queue table by index only");
    tx.rollback().await.unwrap();
}

/// The priority headers a raw PGMQ producer may write that are not 0..9, and the headers that
/// are not an object at all. None may fail its send, and none may wait behind the jobs (H29).
const ODD_PRIORITIES: [&str; 9] = ["\"high\"", "1.5", "99999", "12", "-1", "true", "{}", "[]", "\"\""];

async fn send_raw(db: &TestDb, queue: &str, headers: serde_json::Value) -> i64 {
    sqlx::query_scalar("SELECT pgmq.send($1, '{}'::jsonb, $2)")
        .bind(queue)
        .bind(headers)
        .fetch_one(&db.pool)
        .await
        .unwrap_or_else(|e| panic!("raw send with headers failed: {e}"))
}

async fn dead_reasons(db: &TestDb) -> Vec<(i64, String)> {
    sqlx::query_as("SELECT msg_id, error FROM lockgate.dead_letters WHERE reason = 'undecodable' ORDER BY msg_id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// H29, docs/design.md §67: a raw PGMQ message whose priority header the claim index cannot
/// rank is sent like any other, and the next claim of its queue dead-letters it, naming the
/// priority, although a backlog of jobs is waiting: it is not left until the queue is idle. The
/// index once cast the header, which failed the send of "high", 1.5 or 99999, and put 12 or -1
/// outside the priorities a claim probes, where only a claim that found nothing else looked.
#[tokio::test]
async fn h29_a_raw_message_with_an_odd_priority_is_sent_and_dead_lettered_by_the_next_claim_of_a_busy_queue() {
    let (db, client) = setup().await;
    enqueue(&client, 20, &EnqueueOptions::default()).await;
    let mut odd = Vec::new();
    for p in ODD_PRIORITIES {
        let priority: serde_json::Value = serde_json::from_str(p).unwrap();
        odd.push(send_raw(&db, "claims", json!({"type": "noop", "priority": priority})).await);
    }
    // Headers that are not an object hold no priority: ranked 0, dead-lettered for their shape.
    let shapes = [send_raw(&db, "claims", json!([1, 2])).await, send_raw(&db, "claims", json!("x")).await];
    let queue = common::queue("claims");

    let got = claim(&db.pool, &queue, ODD_PRIORITIES.len() as i32, Duration::from_secs(30)).await.unwrap();
    assert!(got.is_empty(), "the claim took the odd messages first, and returned none of them: {got:?}");
    let dead = dead_reasons(&db).await;
    assert_eq!(dead.iter().map(|d| d.0).collect::<Vec<_>>(), odd, "every odd priority, at the first claim");
    for (msg_id, error) in &dead {
        assert!(error.contains("is not an integer from 0 to 9"), "message {msg_id}: {error}");
    }

    // The jobs come next, in their order; the odd shapes among them are dead-lettered for it.
    let got = claim(&db.pool, &queue, 30, Duration::from_secs(30)).await.unwrap();
    assert_eq!(got.len(), 20, "every job runs");
    let dead = dead_reasons(&db).await;
    assert_eq!(dead.len(), ODD_PRIORITIES.len() + shapes.len());
    for msg_id in shapes {
        let error = &dead.iter().find(|d| d.0 == msg_id).unwrap().1;
        assert!(error.contains("headers are not a JSON object"), "message {msg_id}: {error}");
    }
}

/// H29: lockgate adopts a PGMQ queue whatever priority headers its messages carry (building the
/// claim index over them once failed on "high"), and its first claim dead-letters those.
/// lockgate.job() shows their priority as -1, queued and dead, where it once showed 0.
#[tokio::test]
async fn h29_a_pgmq_queue_holding_odd_priorities_is_adopted_and_its_first_claim_dead_letters_them() {
    let (db, _client) = setup().await;
    sqlx::query("SELECT pgmq.create('adopted')").execute(&db.pool).await.unwrap();
    let mut odd = Vec::new();
    for p in ODD_PRIORITIES {
        let priority: serde_json::Value = serde_json::from_str(p).unwrap();
        odd.push(send_raw(&db, "adopted", json!({"type": "noop", "priority": priority})).await);
    }
    let fine = send_raw(&db, "adopted", json!({"type": "noop", "priority": 4})).await;
    let none = send_raw(&db, "adopted", json!({"type": "noop", "priority": null})).await;
    sqlx::query("SELECT lockgate.create_queue('adopted')").execute(&db.pool).await.unwrap();
    // lockgate.job() shows each priority as the claim ranks it: -1 for every odd one.
    let shown = async |state: &str| {
        for (id, expected) in odd.iter().map(|id| (*id, -1)).chain([(fine, 4), (none, 0)]) {
            let (got, priority): (String, i32) = sqlx::query_as("SELECT state, priority FROM lockgate.job($1)")
                .bind(id)
                .fetch_one(&db.pool)
                .await
                .unwrap();
            assert_eq!(priority, expected, "message {id}, {got}");
            if expected == -1 {
                assert_eq!(got, state, "message {id}");
            }
        }
    };
    shown("queued").await;

    let got = claim(&db.pool, &common::queue("adopted"), 20, Duration::from_secs(30)).await.unwrap();
    assert_eq!(got.iter().map(|c| c.msg_id).collect::<Vec<_>>(), [none, fine], "only the jobs at 0 and 4 run");
    assert_eq!(dead_reasons(&db).await.iter().map(|d| d.0).collect::<Vec<_>>(), odd);
    shown("dead").await;
}

/// A claim on no queue at all (NULL, from SQL) is refused as an unknown queue (LG001), as any
/// unknown name is, before anything else is looked at. A review found it failing instead inside
/// format() with "null values cannot be formatted as an SQL identifier", which names nothing.
#[tokio::test]
async fn a_claim_on_a_null_queue_is_refused_as_an_unknown_queue() {
    let (db, _client) = setup().await;
    for sql in [
        "SELECT * FROM lockgate.claim(NULL, 1, 30)",
        "SELECT * FROM lockgate.claim(NULL, 1, 'NaN')",
        "SELECT * FROM lockgate.claim_queues(ARRAY['claims', NULL], 2, 30)",
    ] {
        let err = sqlx::query(sql).fetch_all(&db.pool).await.unwrap_err();
        let code = err.as_database_error().and_then(|e| e.code()).map(|c| c.to_string());
        assert_eq!(code.as_deref(), Some("LG001"), "{sql}: {err}");
    }
}

/// Issue 14 (docs/design.md §54): a queue's claim statements live in functions generated for
/// it. A queue with the longest name allowed gets functions of its own (no identifier cut short
/// into another queue's), and a claim on a queue whose functions are gone writes them again.
#[tokio::test]
async fn each_queue_claims_through_steps_of_its_own_written_again_when_missing() {
    let db = TestDb::migrated().await.unwrap();
    // Two names of the longest length a queue may have, alike but for their last letter.
    let (long, twin) = (format!("q{}a", "x".repeat(45)), format!("q{}b", "x".repeat(45)));
    assert_eq!((long.len(), twin.len()), (47, 47));
    for (ty, queue) in [("on_long", &long), ("on_twin", &twin)] {
        sqlx::query("SELECT lockgate.define_job_type($1, queue => $2)")
            .bind(ty)
            .bind(queue)
            .execute(&db.pool)
            .await
            .unwrap();
        sqlx::query("SELECT * FROM lockgate.enqueue($1, '{}')").bind(ty).execute(&db.pool).await.unwrap();
    }
    let steps: Vec<String> = sqlx::query_scalar(
        "SELECT proname::text FROM pg_proc WHERE pronamespace = 'lockgate'::regnamespace
            AND proname LIKE '\\_claim\\_%' AND (proname LIKE '%' || $1 OR proname LIKE '%' || $2) ORDER BY 1",
    )
    .bind(&long)
    .bind(&twin)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(steps.len(), 2, "a step per queue, named in full: {steps:?}");
    sqlx::raw_sql(&format!("DROP FUNCTION lockgate._claim_take_{long}")).execute(&db.pool).await.unwrap();
    for (ty, queue) in [("on_long", &long), ("on_twin", &twin)] {
        let types: Vec<String> = sqlx::query_scalar("SELECT headers->>'type' FROM lockgate.claim($1, 10, 30)")
            .bind(queue)
            .fetch_all(&db.pool)
            .await
            .unwrap();
        assert_eq!(types, vec![ty.to_string()], "queue {queue} claims its own job");
    }
}

/// Issue 14 (docs/design.md §54, §58): the claim and enqueue steps belong to the role that
/// installed lockgate's functions, whoever creates the queue. A role with no CREATE on schema
/// lockgate creates a queue, enqueues into it and claims from it; the steps are the installer's,
/// so the next migrate may write them again; and a function a role planted in advance under a
/// step's name is replaced, not kept (it would have run, with its owner's choice of code, inside
/// every claim or enqueue). One transaction, rolled back: the roles never outlive the test.
#[tokio::test]
async fn queue_steps_belong_to_the_installer_whoever_creates_the_queue() {
    let db = TestDb::migrated().await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let (app, other) = (format!("{}_app", db.name), format!("{}_other", db.name));
    let installer: String = sqlx::query_scalar("SELECT current_user::text").fetch_one(&mut *tx).await.unwrap();
    sqlx::raw_sql(&format!(
        "CREATE ROLE {app} NOLOGIN;
         GRANT USAGE ON SCHEMA lockgate TO {app}; GRANT USAGE, CREATE ON SCHEMA pgmq TO {app};
         GRANT ALL ON ALL TABLES IN SCHEMA lockgate, pgmq TO {app};
         GRANT ALL ON ALL SEQUENCES IN SCHEMA lockgate, pgmq TO {app};
         GRANT EXECUTE ON FUNCTION lockgate.enqueue(text, jsonb, jsonb, boolean) TO {app};
         CREATE ROLE {other} NOLOGIN; GRANT USAGE, CREATE ON SCHEMA lockgate TO {other};
         SET LOCAL ROLE {other};
         CREATE FUNCTION lockgate._claim_take_planted(integer, double precision, bigint, timestamptz, integer, text)
             RETURNS SETOF integer LANGUAGE sql AS 'SELECT NULL::integer WHERE false';
         CREATE FUNCTION lockgate._enqueue1_into_planted(timestamptz, jsonb, jsonb)
             RETURNS bigint LANGUAGE sql AS 'SELECT -1::bigint';
         SET LOCAL ROLE {app};
         SELECT lockgate.define_job_type('app_job', queue => 'planted');
         SELECT * FROM lockgate.enqueue('app_job', '{{}}');"
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    let claimed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM lockgate.claim('planted', 10, 30)").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(claimed, 1, "the app role claims through the steps");
    sqlx::query("RESET ROLE").execute(&mut *tx).await.unwrap();
    let expected: Vec<(String, String)> =
        ["_claim_take_planted", "_complete_into_planted", "_enqueue1_into_planted", "_enqueue_into_planted"]
            .iter()
            .map(|step| (step.to_string(), installer.clone()))
            .collect();
    assert_eq!(
        step_owners(&mut tx, "planted").await,
        expected,
        "the planted steps are gone; the steps are the installer's"
    );
    // What migrate does for every queue. Steps as they would be written are left alone: no
    // rewrite (a concurrent claim would find its step replaced) and no lock.
    let versions = "SELECT string_agg(ctid::text, ',' ORDER BY proname) FROM pg_proc
                     WHERE proname = '_claim_take_planted'";
    let before: String = sqlx::query_scalar(versions).fetch_one(&mut *tx).await.unwrap();
    sqlx::query("SELECT lockgate._install_claim_steps('planted')").execute(&mut *tx).await.unwrap();
    let after: String = sqlx::query_scalar(versions).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(before, after, "steps already current are not written again");
    // A step that differs is written in place: a view some role built on it does not stop it.
    sqlx::raw_sql(
        "CREATE OR REPLACE FUNCTION lockgate._claim_take_planted(integer, double precision, bigint, timestamptz, integer, text)
             RETURNS TABLE (msg_id bigint, read_ct integer, enqueued_at timestamptz, message jsonb, headers jsonb,
                            vt timestamptz, ahead boolean, limited boolean, unconfirmed boolean, lease_end timestamptz)
             LANGUAGE sql AS 'SELECT NULL::bigint, 0, now(), NULL::jsonb, NULL::jsonb, now(), false, false, false, now() WHERE false';
         CREATE TEMP VIEW pinned AS SELECT * FROM lockgate._claim_take_planted(0, 1, NULL, now(), NULL, 'planted');
         SELECT lockgate._install_claim_steps('planted');",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_eq!(step_owners(&mut tx, "planted").await, expected);
    let language: String = sqlx::query_scalar(
        "SELECT l.lanname::text FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang WHERE p.proname = '_claim_take_planted'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(language, "plpgsql", "the step is written again, as lockgate's");
    // A step altered in place (STRICT: every claim without an owner would return nothing) is
    // written again too.
    sqlx::raw_sql(
        "ALTER FUNCTION lockgate._claim_take_planted(integer, double precision, bigint, timestamptz, integer, text) STRICT;
         SELECT lockgate._install_claim_steps('planted');",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let strict: bool = sqlx::query_scalar("SELECT proisstrict FROM pg_proc WHERE proname = '_claim_take_planted'")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert!(!strict, "the altered step is written again as lockgate's");
    // The step dropped after the queue exists, and another one planted in its place by the
    // other role: the app role's claim does not run it; it writes the step again and claims.
    sqlx::raw_sql(&format!(
        "DROP VIEW pinned;
         DROP FUNCTION lockgate._claim_take_planted(integer, double precision, bigint, timestamptz, integer, text);
         SET LOCAL ROLE {other};
         CREATE FUNCTION lockgate._claim_take_planted(integer, double precision, bigint, timestamptz, integer, text)
             RETURNS TABLE (msg_id bigint, read_ct integer, enqueued_at timestamptz, message jsonb, headers jsonb,
                            vt timestamptz, ahead boolean, limited boolean, unconfirmed boolean, lease_end timestamptz)
             LANGUAGE sql AS 'SELECT -1::bigint, 1, now(), ''{{}}''::jsonb, ''{{\"type\": \"app_job\"}}''::jsonb, now(),
                                     false, false, false, NULL::timestamptz';
         SET LOCAL ROLE {app};
         SELECT * FROM lockgate.enqueue('app_job', '{{}}');"
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT msg_id FROM lockgate.claim('planted', 10, 30)").fetch_all(&mut *tx).await.unwrap();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert!(ids[0] > 0, "the planted step did not run: {ids:?}");
    sqlx::query("RESET ROLE").execute(&mut *tx).await.unwrap();
    assert_eq!(step_owners(&mut tx, "planted").await, expected, "the step is the installer's again");
    tx.rollback().await.unwrap();
}

/// Issue 14 (docs/design.md §56): functions revisions 11 to 18 gave each queue two steps, a
/// probe and a take with seven arguments, called in turn. Installing this revision's functions
/// over them leaves the one step of this revision and drops both earlier ones, and any other
/// overload of the step's name (one with a defaulted extra argument made every claim on the queue
/// fail as ambiguous); the queue claims through it. An earlier step something depends on (a view
/// some role built on it) is kept with a warning: it does not stop the install.
#[tokio::test]
async fn installing_the_functions_drops_the_claim_steps_of_earlier_revisions() {
    let (db, client) = setup().await;
    enqueue(&client, 1, &EnqueueOptions::default()).await;
    client
        .define_job_type(&JobTypeName::new("kept_job").unwrap(), &JobPolicy::on_queue(common::queue("kept")))
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE FUNCTION lockgate._claim_probe_claims(integer, timestamptz) RETURNS integer
             LANGUAGE sql AS 'SELECT NULL::integer';
         CREATE FUNCTION lockgate._claim_take_claims(integer, double precision, bigint, timestamptz, integer, text, integer)
             RETURNS SETOF integer LANGUAGE sql AS 'SELECT NULL::integer WHERE false';
         CREATE FUNCTION lockgate._claim_probe_kept(integer, timestamptz) RETURNS integer
             LANGUAGE sql AS 'SELECT NULL::integer';
         CREATE VIEW public.on_old_probe AS SELECT lockgate._claim_probe_kept(-1, now());",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let steps = async |queue: &str| -> Vec<String> {
        sqlx::query_scalar(
            "SELECT proname::text || '(' || pg_get_function_identity_arguments(oid) || ')' FROM pg_proc
              WHERE pronamespace = 'lockgate'::regnamespace
                AND proname IN ('_claim_probe_' || $1, '_claim_take_' || $1) ORDER BY 1",
        )
        .bind(queue)
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let step = "_claim_take_claims(integer, double precision, bigint, timestamp with time zone, integer, text)";
    assert_eq!(steps("claims").await.len(), 3, "the earlier steps are there");
    sqlx::query("UPDATE lockgate.schema_state SET functions_revision = functions_revision - 1")
        .execute(&db.pool)
        .await
        .unwrap();
    lockgate::migrate(&db.pool).await.unwrap();
    assert_eq!(steps("claims").await, vec![step.to_string()], "one step, of this revision");
    assert_eq!(
        steps("kept").await,
        vec!["_claim_probe_kept(integer, timestamp with time zone)".to_string(), step.replace("claims", "kept")],
        "the probe a view depends on is kept; the install went on"
    );
    let claimed = claim(&db.pool, &common::queue("claims"), 10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(claimed.len(), 1, "the queue claims through it");
    // An overload planted under the step's name, its extra argument defaulted: the claim's call
    // is ambiguous until the next install drops it (the claim trusts its step by signature, and
    // does not write it again for an overload beside it).
    sqlx::raw_sql(
        "CREATE FUNCTION lockgate._claim_take_claims(integer, double precision, bigint, timestamptz, integer, text,
                                                     integer DEFAULT 0)
             RETURNS SETOF integer LANGUAGE sql AS 'SELECT 1 WHERE false';",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert!(claim(&db.pool, &common::queue("claims"), 10, Duration::from_secs(30)).await.is_err());
    sqlx::query("SELECT lockgate._install_claim_steps('claims')").execute(&db.pool).await.unwrap();
    assert_eq!(steps("claims").await, vec![step.to_string()], "the overload is gone");
    claim(&db.pool, &common::queue("claims"), 10, Duration::from_secs(30)).await.unwrap();
}

/// A queue's claim and enqueue steps, and a probe left from an earlier revision, and their
/// owners, by name.
async fn step_owners(conn: &mut sqlx::PgConnection, queue: &str) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT proname::text, proowner::regrole::text FROM pg_proc
          WHERE pronamespace = 'lockgate'::regnamespace
            AND proname IN ('_claim_probe_' || $1, '_claim_take_' || $1, '_enqueue1_into_' || $1, '_enqueue_into_' || $1,
                            '_complete_into_' || $1)
          ORDER BY 1",
    )
    .bind(queue)
    .fetch_all(conn)
    .await
    .unwrap()
}

/// Issue 14 (docs/design.md §58): a queue's steps are named by a prefix and the queue's name, and
/// no other lockgate function starts with one of the prefixes, so no queue name can make a step
/// that overwrites one of lockgate's own functions or another queue's step (nor one whose
/// install drops them as "other overloads" of its name). Fails when a function is added under a
/// step prefix, or a prefix chosen that one of lockgate's functions starts with.
#[tokio::test]
async fn no_lockgate_function_but_a_queues_step_starts_with_a_step_prefix() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('one')").execute(&db.pool).await.unwrap();
    let strays: Vec<String> = sqlx::query_scalar(
        "SELECT p.proname::text FROM pg_proc p, lockgate._steps() s
          WHERE p.pronamespace = 'lockgate'::regnamespace AND starts_with(p.proname, s.prefix)
            AND NOT EXISTS (SELECT 1 FROM lockgate.queues q WHERE p.proname = s.prefix || q.name)",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(strays, Vec::<String>::new(), "functions under a step prefix that are no queue's step");
    let (steps, listed): (i64, i64) = sqlx::query_as(
        "SELECT count(p.oid), count(*) FROM lockgate._steps() s
           LEFT JOIN pg_proc p ON p.pronamespace = 'lockgate'::regnamespace AND p.proname = s.prefix || 'one'
                              AND p.proargtypes = array_to_string(s.args::oid[], ' ')::oidvector",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((steps, listed), (5, 5), "the queue has each listed step, of its listed arguments");
}

/// Issue 14 (docs/design.md §58, from a review): a function beside a queue's claim step under its
/// name, which the install may not drop (a view depends on it), does not make every claim write
/// the step again: a claim trusts its step by signature, so it takes no lock on the queue's name
/// and a second claim does not wait for the first one's transaction.
#[tokio::test]
async fn an_overload_beside_the_claim_step_makes_no_claim_wait_for_another() {
    let (db, client) = setup().await;
    enqueue(&client, 2, &EnqueueOptions::default()).await;
    sqlx::raw_sql(
        "CREATE FUNCTION lockgate._claim_take_claims(integer) RETURNS integer LANGUAGE sql AS 'SELECT 1';
         CREATE VIEW public.on_overload AS SELECT lockgate._claim_take_claims(1);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut first = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
    let mut holding = sqlx::Connection::begin(&mut first).await.unwrap();
    let one: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.claim('claims', 1, 30)")
        .fetch_one(&mut *holding)
        .await
        .unwrap();
    assert_eq!(one, 1);
    let mut second = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
    sqlx::query("SET lock_timeout = '2s'").execute(&mut second).await.unwrap();
    let other: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.claim('claims', 1, 30)")
        .fetch_one(&mut second)
        .await
        .expect("the second claim waits for no lock the first one holds");
    assert_eq!(other, 1);
    holding.rollback().await.unwrap();
}

/// A review of functions revision 28: sessions still running revision 26's functions while a
/// migrate replaces them (a claim or completion that began before its commit) call revision 26's
/// trust check, with the step's whole name, arguments and installer. That check is kept, asking
/// the new one, so those calls answer as before instead of failing for a missing function.
#[tokio::test]
async fn the_previous_revisions_trust_check_still_answers_during_an_upgrade() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('one')").execute(&db.pool).await.unwrap();
    let (claim_step, completion_step, unknown): (bool, bool, bool) = sqlx::query_as(
        "SELECT lockgate._trusted_step('_claim_take_one', '{integer,double precision,bigint,timestamptz,integer,text}'::regtype[],
                                       'lockgate._install_claim_steps(text)'::regprocedure, false),
                lockgate._trusted_step('_complete_into_one', '{bigint[],integer[],bigint[],integer[]}'::regtype[],
                                       'lockgate._install_complete_steps(text)'::regprocedure),
                lockgate._trusted_step('_complete_into_nowhere', '{bigint[],integer[],bigint[],integer[]}'::regtype[],
                                       'lockgate._install_complete_steps(text)'::regprocedure)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((claim_step, completion_step, unknown), (true, true, false));
}
