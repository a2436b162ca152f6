//! Recurring jobs at the SQL seam and through the scheduler service: two schedulers racing on one
//! tick enqueue it once (H23), a downtime enqueues one missed tick, enable/disable, the
//! configuration's sync, failures recorded once, a runtime scheduling a task defined through
//! SQL, shutdown and database blips, and every bad definition refused with its problem named.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};
use common::{Counter, Running, WAIT};
use lockgate::scheduler::Scheduler;
use lockgate::sql::{enqueue_recurring_tick, sync_config_recurring, TickOutcome};
use lockgate::{
    Client, ConcurrencyPolicy, DbError, EnqueueError, EnqueueOptions, Job, JobContext, JobError, JobPolicy,
    JobTypeName, OnConflict, RecurringTask, Registry,
};
use lockgate_testkit::{wait_for, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::json;

#[derive(Serialize, Deserialize)]
struct Report {
    kind: String,
}

impl Job for Report {
    const TYPE: &'static str = "report";
}

async fn setup() -> (TestDb, Client) {
    let db = TestDb::migrated().await.expect("db");
    let client = Client::new(db.pool.clone());
    client.define::<Report>().await.expect("define");
    (db, client)
}

async fn db_now(db: &TestDb) -> DateTime<Utc> {
    lockgate::sql::database_now(&db.pool).await.unwrap()
}

/// Makes the task look as if it had been defined `ago` before now and no scheduler had run since.
async fn defined_ago(db: &TestDb, task: &str, ago: &str) {
    sqlx::query("UPDATE lockgate.recurring_tasks SET active_since = now() - $2::interval WHERE name = $1")
        .bind(task)
        .bind(ago)
        .execute(&db.pool)
        .await
        .unwrap();
}

async fn jobs(db: &TestDb) -> i64 {
    db.count("SELECT 1 FROM pgmq.q_default").await.unwrap()
}

/// Two schedulers on one tick of the task `nightly`: the first enqueues it and holds its
/// transaction open, the second races on the same tick from another connection. Returns the
/// tick, the first's transaction and outcome, and the second's call.
async fn racing_schedulers(
    db: &TestDb,
    client: &Client,
) -> (
    DateTime<Utc>,
    sqlx::Transaction<'static, sqlx::Postgres>,
    TickOutcome,
    tokio::task::JoinHandle<Result<TickOutcome, DbError>>,
) {
    client.define_recurring(&every_minute("nightly")).await.unwrap();
    defined_ago(db, "nightly", "1 hour").await;
    let tick: DateTime<Utc> =
        sqlx::query_scalar("SELECT date_trunc('minute', now())").fetch_one(&db.pool).await.unwrap();
    let mut first = db.pool.begin().await.unwrap();
    let outcome = enqueue_recurring_tick(&mut *first, "nightly", tick, None).await.unwrap();
    assert_eq!(outcome.status, "enqueued");
    let second_pool = db.new_pool(1).await.unwrap();
    let second = tokio::spawn(async move { enqueue_recurring_tick(&second_pool, "nightly", tick, None).await });
    (tick, first, outcome, second)
}

fn every_minute(name: &str) -> RecurringTask {
    RecurringTask { args: json!({"kind": name}), ..RecurringTask::new(name, "* * * * *", "report") }
}

/// Two schedulers on one tick: the second, meeting the first's transaction on the task's row,
/// writes nothing and says so (`busy`); at its next pass, the first having committed, it finds
/// the tick taken. The tick is enqueued once.
#[tokio::test]
async fn h23_two_schedulers_racing_on_one_tick_enqueue_it_once() {
    let (db, client) = setup().await;
    let (tick, first, outcome, second) = racing_schedulers(&db, &client).await;
    assert_eq!(second.await.unwrap().unwrap().status, "busy", "the second met the first's transaction");
    first.commit().await.unwrap();
    let again = enqueue_recurring_tick(&db.pool, "nightly", tick, None).await.unwrap();

    assert_eq!(jobs(&db).await, 1, "the tick was enqueued twice");
    assert_eq!(again.status, "taken", "the second scheduler's next pass found the tick taken");
    assert_eq!(db.count("SELECT 1 FROM lockgate.recurring_ticks").await.unwrap(), 1);
    let last: (DateTime<Utc>, i64) = sqlx::query_as("SELECT last_tick_at, last_job_id FROM lockgate.recurring_tasks")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(last, (tick, outcome.job_id.unwrap()));
}

/// Review helper-134 F1: a task whose row an open transaction holds (an operator's uncommitted
/// `set_recurring_enabled`, here) holds up no other task's tick. A scheduler waited for that row
/// (up to 5 s, §101) at every pass, so every other task's ticks came late, and ticks of tasks
/// due more often than that were lost.
#[tokio::test]
async fn a_task_held_by_an_open_transaction_holds_up_no_other_tasks_tick() {
    let (db, client) = setup().await;
    for name in ["held", "other"] {
        client.define_recurring(&every_minute(name)).await.unwrap();
        defined_ago(&db, name, "1 hour").await;
    }
    let mut operator = db.pool.begin().await.unwrap();
    sqlx::query("SELECT lockgate.set_recurring_enabled('held', true)").execute(&mut *operator).await.unwrap();
    let now = db_now(&db).await;
    let mut scheduler = Scheduler::new(db.new_pool(2).await.unwrap());
    let report = tokio::time::timeout(Duration::from_secs(3), scheduler.run_once(now))
        .await
        .expect("the pass does not wait for the held task")
        .unwrap();
    assert_eq!((report.enqueued, report.busy, report.errors), (1, 1, 0), "{report:?}");
    let ticked: Vec<String> =
        sqlx::query_scalar("SELECT task FROM lockgate.recurring_ticks").fetch_all(&db.pool).await.unwrap();
    assert_eq!(ticked, vec!["other".to_string()]);
    operator.commit().await.unwrap();
    let report = scheduler.run_once(now).await.unwrap();
    assert_eq!((report.enqueued, report.busy), (1, 0), "the held task ticks at the next pass: {report:?}");
    assert_eq!(jobs(&db).await, 2);
}

/// A schedule changed after a scheduler read the task, and before its tick: the definition set
/// active_since when it ran, before its commit, so a tick of the old schedule due after that
/// passes the active_since check; the scheduler passes the schedule it computed the tick from,
/// and the database, comparing it under the row lock, finds it replaced and enqueues nothing
/// (inactive).
#[tokio::test]
async fn a_tick_of_a_schedule_replaced_since_the_scheduler_read_it_is_not_enqueued() {
    let (db, client) = setup().await;
    client.define_recurring(&RecurringTask::new("changing", "* * * * * *", "report")).await.unwrap();
    defined_ago(&db, "changing", "1 minute").await;
    let mut change = db.pool.begin().await.unwrap();
    sqlx::query("SELECT lockgate.define_recurring('changing', '0 3 * * *', 'report')")
        .execute(&mut *change)
        .await
        .unwrap();
    let changed_at: DateTime<Utc> =
        sqlx::query_scalar("SELECT active_since FROM lockgate.recurring_tasks WHERE name = 'changing'")
            .fetch_one(&mut *change)
            .await
            .unwrap();
    change.commit().await.unwrap();
    // The old schedule's next tick (every second) must come after the change's active_since.
    let tick = wait_for("the database clock to pass the next whole second after the change", WAIT, || async {
        let now = db_now(&db).await;
        Ok((now.timestamp() > changed_at.timestamp()).then_some(now))
    })
    .await
    .unwrap();
    let tick = DateTime::from_timestamp(tick.timestamp(), 0).unwrap();
    let outcome = enqueue_recurring_tick(&db.pool, "changing", tick, Some(("* * * * * *", "UTC"))).await.unwrap();
    assert_eq!(outcome.status, "inactive", "a tick of the replaced schedule was enqueued");
    assert_eq!(jobs(&db).await, 0);
}

#[tokio::test]
async fn h23_two_scheduler_services_on_the_same_clock_enqueue_each_due_tick_once() {
    let (db, client) = setup().await;
    for i in 0..10 {
        let task = RecurringTask::new(format!("every_second_{i}"), "* * * * * *", "report");
        client.define_recurring(&task).await.unwrap();
    }
    sqlx::query("UPDATE lockgate.recurring_tasks SET active_since = now() - interval '1 minute'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut a = Scheduler::new(db.new_pool(2).await.unwrap());
    let mut b = Scheduler::new(db.new_pool(2).await.unwrap());
    let base = db_now(&db).await - TimeDelta::seconds(5);
    for round in 0..5 {
        let now = base + TimeDelta::seconds(round);
        let (ra, rb) = tokio::join!(a.run_once(now), b.run_once(now));
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert_eq!(ra.enqueued + rb.enqueued, 10, "round {round}: each due tick enqueued once: {ra:?} {rb:?}");
    }
    assert_eq!(jobs(&db).await, 50);
    assert_eq!(db.count("SELECT DISTINCT task, tick_at FROM lockgate.recurring_ticks").await.unwrap(), 50);
}

#[tokio::test]
async fn a_missed_tick_after_downtime_is_enqueued_once_not_once_per_missed_tick() {
    let (db, client) = setup().await;
    client.define_recurring(&every_minute("minutely")).await.unwrap();
    defined_ago(&db, "minutely", "1 hour").await; // sixty ticks passed with no scheduler running
    let mut scheduler = Scheduler::new(db.pool.clone());
    let now = db_now(&db).await;
    let report = scheduler.run_once(now).await.unwrap();
    assert_eq!((report.enqueued, report.taken), (1, 0), "{report:?}");
    let latest = lockgate::Schedule::parse("* * * * *", "UTC").unwrap().latest_at_or_before(now).unwrap();
    let tick: DateTime<Utc> =
        sqlx::query_scalar("SELECT tick_at FROM lockgate.recurring_ticks").fetch_one(&db.pool).await.unwrap();
    assert_eq!(tick, latest, "the latest missed tick is the one enqueued");
    assert_eq!(report.next_tick_at, Some(latest + TimeDelta::minutes(1)));
    let again = scheduler.run_once(now).await.unwrap();
    assert_eq!((again.enqueued, again.taken), (0, 0), "nothing more is due: {again:?}");
    assert_eq!(jobs(&db).await, 1);

    // Defining the task again unchanged (as every `lockgate run` start does) keeps what is done
    // and what is due; a new schedule starts over from its definition.
    client.define_recurring(&every_minute("minutely")).await.unwrap();
    assert_eq!(scheduler.run_once(now).await.unwrap().enqueued, 0);
    let hourly = RecurringTask { cron: "0 * * * *".into(), ..every_minute("minutely") };
    client.define_recurring(&hourly).await.unwrap();
    let since: DateTime<Utc> =
        sqlx::query_scalar("SELECT active_since FROM lockgate.recurring_tasks").fetch_one(&db.pool).await.unwrap();
    assert!(since >= now, "a changed schedule is active from its change");
}

#[tokio::test]
async fn a_disabled_task_enqueues_nothing_and_enabling_it_skips_the_ticks_it_missed() {
    let (db, client) = setup().await;
    client.define_recurring(&every_minute("minutely")).await.unwrap();
    defined_ago(&db, "minutely", "1 hour").await;
    client.set_recurring_enabled("minutely", false).await.unwrap();
    let mut scheduler = Scheduler::new(db.pool.clone());
    let report = scheduler.run_once(db_now(&db).await).await.unwrap();
    assert_eq!((report.enqueued, report.next_tick_at), (0, None), "a disabled task is not scheduled");
    // Disabling again and defining without saying `enabled` keep it disabled.
    client.set_recurring_enabled("minutely", false).await.unwrap();
    client.define_recurring(&every_minute("minutely")).await.unwrap();
    assert_eq!(scheduler.run_once(db_now(&db).await).await.unwrap().enqueued, 0);

    client.set_recurring_enabled("minutely", true).await.unwrap();
    let report = scheduler.run_once(db_now(&db).await).await.unwrap();
    assert_eq!(report.enqueued, 0, "the ticks missed while disabled are not enqueued: {report:?}");
    assert!(report.next_tick_at.is_some());
    let rows = client.list_recurring().await.unwrap();
    assert!(rows[0].enabled && rows[0].last_tick_at.is_none(), "{rows:?}");
    assert!(client.remove_recurring("minutely").await.unwrap());
    assert!(!client.remove_recurring("minutely").await.unwrap(), "nothing left to remove");
    assert_eq!(jobs(&db).await, 0);
}

#[tokio::test]
async fn a_tick_whose_enqueue_fails_is_recorded_with_its_error_and_not_retried() {
    let (db, client) = setup().await;
    let mut policy = JobPolicy::on_queue(common::queue("default"));
    policy.concurrency = Some(ConcurrencyPolicy { on_conflict: OnConflict::Raise, ..ConcurrencyPolicy::new(1) });
    client.define_job_type(&JobTypeName::new("exclusive").unwrap(), &policy).await.unwrap();
    client.enqueue_raw("exclusive", &json!({}), &EnqueueOptions::default()).await.unwrap(); // holds the permit
    client.define_recurring(&RecurringTask::new("exclusive_tick", "* * * * *", "exclusive")).await.unwrap();
    defined_ago(&db, "exclusive_tick", "5 minutes").await;
    let mut scheduler = Scheduler::new(db.pool.clone());
    let now = db_now(&db).await;
    let report = scheduler.run_once(now).await.unwrap();
    assert_eq!((report.enqueued, report.failed), (0, 1), "{report:?}");
    let row = &client.list_recurring().await.unwrap()[0];
    assert_eq!(row.last_status.as_deref(), Some("failed"));
    assert!(row.last_error.as_deref().is_some_and(|e| e.contains("concurrency limit 1 reached")), "{row:?}");
    let again = scheduler.run_once(now).await.unwrap();
    assert_eq!((again.enqueued, again.taken, again.failed), (0, 0, 0), "the failed tick is not retried: {again:?}");
    assert_eq!(jobs(&db).await, 1, "only the job that held the permit");
}

#[tokio::test]
async fn the_configuration_sync_removes_the_config_tasks_it_no_longer_lists_and_keeps_sql_tasks() {
    let (db, client) = setup().await;
    client.define_recurring(&every_minute("from_sql")).await.unwrap();
    let removed = sync_config_recurring(&db.pool, &[every_minute("a"), every_minute("b")]).await.unwrap();
    assert!(removed.is_empty());
    let removed = sync_config_recurring(&db.pool, &[every_minute("b")]).await.unwrap();
    assert_eq!(removed, ["a"]);
    let names: Vec<(String, String)> =
        sqlx::query_as("SELECT name, source FROM lockgate.recurring_tasks ORDER BY name")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(names, [("b".into(), "config".into()), ("from_sql".into(), "sql".into())]);
    // A bad task fails the whole sync and changes nothing.
    let err = sync_config_recurring(&db.pool, &[RecurringTask::new("c", "* * * * *", "missing")]).await.unwrap_err();
    assert!(
        matches!(&err, DbError::UnknownJobType { job_type, message } if job_type == "missing"
            && message.contains("recurring task \"c\": unknown job type \"missing\"")),
        "{err:?}"
    );
    assert_eq!(db.count("SELECT 1 FROM lockgate.recurring_tasks").await.unwrap(), 2);
}

/// The configuration's sync is one statement (review helper-143 F1): as a transaction of one
/// statement per task, a process frozen or cut off between two of them held the rows of the tasks
/// it had defined, and no scheduler of any process could tick them until its session ended. Here
/// the sync's reply is swallowed, its connection left open: the sync is done and committed all the
/// same, and another scheduler ticks its task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_whose_process_goes_silent_holds_no_task_from_the_other_schedulers() {
    let (db, _client) = setup().await;
    let proxy = lockgate_testkit::FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let silent = lockgate::PgPoolOptions::new().max_connections(1).connect(&proxy.url_for(&db.url)).await.unwrap();
    // A first sync defines the task and prepares the statements on the one connection; the
    // second, of the same task and a new one, sends bound values only, and the first request
    // carrying the new task's name has its replies swallowed.
    let task = RecurringTask::new("every_second", "* * * * * *", "report");
    sync_config_recurring(&silent, std::slice::from_ref(&task)).await.unwrap();
    proxy.swallow_replies_to_request_containing("marker_task");
    let tasks = [task, RecurringTask::new("marker_task", "@yearly", "report")];
    let syncing = tokio::spawn(async move { sync_config_recurring(&silent, &tasks).await });
    let mut scheduler = Scheduler::new(db.pool.clone());
    let until = Instant::now() + WAIT;
    let mut report = Default::default();
    while Instant::now() < until {
        report = scheduler.run_once(db_now(&db).await).await.unwrap();
        if report.enqueued > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(proxy.met_marked_reply(), "the sync's reply was swallowed");
    assert_eq!(report.enqueued, 1, "another scheduler ticks the task: {report:?}");
    syncing.abort();
}

#[tokio::test]
async fn bad_recurring_definitions_from_sql_are_refused_with_the_problem_named() {
    let (db, _client) = setup().await;
    let cases = [
        ("SELECT lockgate.define_recurring('t', 'every day', 'report')", "invalid cron expression 'every day'"),
        ("SELECT lockgate.define_recurring('t', '* * * *', 'report')", "invalid cron expression"),
        (
            "SELECT lockgate.define_recurring('t', '* * * * *', 'report', timezone => 'Mars/Base')",
            "unknown time zone \"Mars/Base\"",
        ),
        (
            "SELECT lockgate.define_recurring('t', '* * * * *', 'nope')",
            "recurring task \"t\": unknown job type \"nope\"",
        ),
        ("SELECT lockgate.define_recurring('t', '* * * * *', 'report', '[1]')", "must be a JSON object, got array"),
        (
            "SELECT lockgate.define_recurring('t', '* * * * *', 'report', options => '{\"delay\": 1}')",
            "unknown option(s): delay",
        ),
        (
            "SELECT lockgate.define_recurring('t', '* * * * *', 'report', options => '{\"priority\": 12}')",
            "invalid priority 12",
        ),
        (
            "SELECT lockgate.define_recurring('t', '* * * * *', 'report', options => '{\"queue\": \"missing\"}')",
            "\"missing\"",
        ),
        ("SELECT lockgate.define_recurring('bad name', '* * * * *', 'report')", "invalid recurring task name"),
        ("SELECT lockgate.set_recurring_enabled('nope', true)", "unknown recurring task \"nope\""),
        ("SELECT lockgate.enqueue_recurring_tick('nope', now() + interval '1 hour')", "is in the future"),
        // Files of the zone database that name no zone: the scheduler cannot read them.
        (
            "SELECT lockgate.define_recurring('t', '* * * * *', 'report', timezone => 'localtime')",
            "unknown time zone \"localtime\"",
        ),
        (
            "SELECT lockgate.define_recurring('t', '* * * * *', 'report', timezone => 'posixrules')",
            "unknown time zone \"posixrules\"",
        ),
        ("SELECT lockgate.define_recurring('t', '* * * * *', 'report', timezone => 'Factory')", "unknown time zone"),
    ];
    for (sql, expected) in cases {
        let err = sqlx::query(sql).execute(&db.pool).await.expect_err(sql);
        let err = DbError::from(err).to_string();
        assert!(err.contains(expected), "{sql}: expected {expected:?} in {err:?}");
    }
    let err = DbError::from(sqlx::query(cases[9].0).execute(&db.pool).await.unwrap_err());
    assert!(matches!(err, DbError::UnknownRecurringTask(_)), "LG006: {err:?}");
    assert_eq!(db.count("SELECT 1 FROM lockgate.recurring_tasks").await.unwrap(), 0, "nothing was stored");
}

#[tokio::test]
async fn bad_recurring_definitions_from_rust_are_refused_with_the_problem_named() {
    let (db, client) = setup().await;
    let cases = [
        (RecurringTask::new("t", "61 * * * *", "report"), "cron"),
        (
            RecurringTask { timezone: "Europe/Atlantis".into(), ..RecurringTask::new("t", "@daily", "report") },
            "timezone",
        ),
        (RecurringTask { args: json!("text"), ..RecurringTask::new("t", "@daily", "report") }, "args"),
        (RecurringTask::new("t t", "@daily", "report"), "recurring task name"),
    ];
    for (task, field) in cases {
        match client.define_recurring(&task).await {
            Err(EnqueueError::Invalid(err)) => assert_eq!(err.field, field, "{err}"),
            other => panic!("{task:?}: {other:?}"),
        }
    }
    let err = client.define_recurring(&RecurringTask::new("t", "@daily", "nope")).await.unwrap_err();
    assert!(
        matches!(&err, EnqueueError::Database(DbError::UnknownJobType { job_type, message }) if job_type == "nope"
            && message.contains("recurring task \"t\"")),
        "{err:?}"
    );
    let err = client.set_recurring_enabled("nope", true).await.unwrap_err();
    assert!(matches!(&err, DbError::UnknownRecurringTask(m) if m.contains("\"nope\"")), "{err}");
    assert_eq!(db.count("SELECT 1 FROM lockgate.recurring_tasks").await.unwrap(), 0);
}

#[tokio::test]
async fn a_runtime_enqueues_and_runs_the_ticks_of_a_task_defined_through_sql() {
    let (db, _client) = setup().await;
    let runs = Counter::default();
    let counted = runs.clone();
    let mut registry = Registry::new();
    registry
        .register::<Report, _>(move |_ctx: JobContext, _job: Report| {
            counted.bump();
            async { Ok::<(), JobError>(()) }
        })
        .unwrap();
    let running = Running::start(&db, common::test_config(), registry, &["default"], 2).await;
    // Defined after the runtime started: its scheduler re-reads the tasks every second.
    sqlx::query("SELECT lockgate.define_recurring('heartbeat', '* * * * * *', 'report', '{\"kind\": \"beat\"}')")
        .execute(&db.pool)
        .await
        .unwrap();
    wait_for("three ticks to run", WAIT, || async { Ok((runs.get() >= 3).then_some(())) }).await.unwrap();
    running.stop().await;
    let ticks = db.count("SELECT 1 FROM lockgate.recurring_ticks WHERE status = 'enqueued'").await.unwrap();
    let archived = db.count("SELECT 1 FROM pgmq.a_default WHERE message->>'kind' = 'beat'").await.unwrap();
    assert!(ticks >= 3, "{ticks} ticks");
    assert!(archived + jobs(&db).await == ticks, "one job per tick: {ticks} ticks, {archived} archived");
}

#[tokio::test]
async fn the_scheduler_stops_at_once_on_shutdown_and_carries_on_after_its_connections_are_killed() {
    let (db, client) = setup().await;
    client.define_recurring(&RecurringTask::new("beat", "* * * * * *", "report")).await.unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let scheduler = tokio::spawn(Scheduler::new(db.new_pool(2).await.unwrap()).run(shutdown.clone()));
    let ticks = || db.count("SELECT 1 FROM lockgate.recurring_ticks");
    wait_for("a first tick", WAIT, || async { Ok((ticks().await? >= 1).then_some(())) }).await.unwrap();
    for round in 0..3 {
        db.terminate_backends().await.unwrap();
        let before = ticks().await.unwrap();
        wait_for(&format!("a tick after the kill of round {round}"), WAIT, || async {
            Ok((ticks().await? > before).then_some(()))
        })
        .await
        .unwrap();
    }
    let stopping = Instant::now();
    shutdown.cancel();
    scheduler.await.unwrap();
    assert!(stopping.elapsed() < Duration::from_millis(500), "stopped in {:?}", stopping.elapsed());
    assert_eq!(jobs(&db).await, db.count("SELECT 1 FROM lockgate.recurring_ticks").await.unwrap(), "a job per tick");
}

#[tokio::test]
async fn a_task_whose_tick_keeps_failing_never_holds_up_the_others() {
    let (db, client) = setup().await;
    // A task on a queue whose PGMQ table was dropped outside lockgate, one whose limited type's
    // key a producer holds in an open transaction, and a healthy one.
    sqlx::query("SELECT lockgate.create_queue('gone')").execute(&db.pool).await.unwrap();
    client
        .define_recurring(&RecurringTask {
            queue: Some(common::queue("gone")),
            ..RecurringTask::new("a_gone", "* * * * *", "report")
        })
        .await
        .unwrap();
    let mut policy = JobPolicy::on_queue(common::queue("default"));
    policy.concurrency = Some(ConcurrencyPolicy::new(5));
    client.define_job_type(&JobTypeName::new("limited").unwrap(), &policy).await.unwrap();
    client.define_recurring(&RecurringTask::new("b_held", "* * * * *", "limited")).await.unwrap();
    client.define_recurring(&every_minute("c_healthy")).await.unwrap();
    for task in ["a_gone", "b_held", "c_healthy"] {
        defined_ago(&db, task, "5 minutes").await;
    }
    sqlx::query("SELECT pgmq.drop_queue('gone')").execute(&db.pool).await.unwrap();
    let mut producer = db.pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('limited')").execute(&mut *producer).await.unwrap();
    let mut scheduler = Scheduler::new(db.pool.clone());
    let started = Instant::now();
    // Both passes at one instant: a second pass past a minute's turn found c_healthy's next
    // tick due too (a flaky count, seen in CI at 05:46:00).
    let now = db_now(&db).await;
    let report = scheduler.run_once(now).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(3), "the pass waited {:?}", started.elapsed());
    assert_eq!((report.enqueued, report.failed, report.errors), (1, 1, 1), "{report:?}");
    let rows = client.list_recurring().await.unwrap();
    let status = |name: &str| rows.iter().find(|r| r.name == name).and_then(|r| r.last_status.clone());
    assert_eq!(status("a_gone").as_deref(), Some("failed"), "a missing queue table is the tick's outcome");
    assert_eq!(status("b_held"), None, "a held key is tried again by the next pass");
    assert_eq!(status("c_healthy").as_deref(), Some("enqueued"));
    producer.rollback().await.unwrap();
    let report = scheduler.run_once(now).await.unwrap();
    assert_eq!((report.enqueued, report.errors), (1, 0), "b_held's tick, once the key is free: {report:?}");
}

#[tokio::test]
async fn a_configuration_never_takes_over_a_task_defined_through_sql() {
    let (db, client) = setup().await;
    client.define_recurring(&every_minute("shared_name")).await.unwrap();
    let err = sync_config_recurring(&db.pool, &[every_minute("shared_name")]).await.unwrap_err();
    assert!(err.to_string().contains("is already defined through SQL"), "{err}");
    sync_config_recurring(&db.pool, &[every_minute("from_config")]).await.unwrap();
    let err = client.define_recurring(&every_minute("from_config")).await.unwrap_err();
    assert!(err.to_string().contains("is already defined by a lockgate.toml [recurring] table"), "{err}");
    let sources: Vec<(String, String)> =
        sqlx::query_as("SELECT name, source FROM lockgate.recurring_tasks ORDER BY name")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(sources, [("from_config".into(), "config".into()), ("shared_name".into(), "sql".into())]);
}

/// The two maintenance functions that bound their lock waits (a tick at 500 ms, the batch
/// sweep at 100 ms) do so for their own call only: an operator running them inside a larger
/// transaction keeps that transaction's own lock_timeout for what comes after.
#[tokio::test]
async fn the_tick_and_the_batch_sweep_leave_the_callers_lock_timeout_as_it_was() {
    let (db, client) = setup().await;
    client.define_recurring(&every_minute("kept")).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '7s'").execute(&mut *tx).await.unwrap();
    for call in
        ["SELECT lockgate.batch_sweep()", "SELECT * FROM lockgate.enqueue_recurring_tick('kept', now(), NULL, NULL)"]
    {
        sqlx::query(call).execute(&mut *tx).await.unwrap();
        let after: String = sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut *tx).await.unwrap();
        assert_eq!(after, "7s", "after {call}");
    }
}

/// Review helper-134 F2: the tick of a task that does not exist (removed since the caller read
/// it) is `inactive`. The check read `FOUND` after a statement that reset it, so the two-argument
/// form went on and failed on the tick row's foreign key instead.
#[tokio::test]
async fn a_tick_of_a_task_that_does_not_exist_is_inactive() {
    let (db, _client) = setup().await;
    let outcome = enqueue_recurring_tick(&db.pool, "never_defined", db_now(&db).await, None).await.unwrap();
    assert_eq!(outcome.status, "inactive");
}

/// Defines an every-second task `held_<k>` of type `limited` for each k, whose key k the
/// `producer`'s open transaction takes with an enqueue.
async fn hold_tasks(client: &Client, producer: &mut sqlx::PgConnection, keys: std::ops::Range<i32>) {
    for k in keys {
        let task = RecurringTask {
            args: serde_json::json!({"k": k}),
            ..RecurringTask::new(format!("held_{k}"), "* * * * * *", "limited")
        };
        client.define_recurring(&task).await.unwrap();
        sqlx::query("SELECT * FROM lockgate.enqueue('limited', jsonb_build_object('k', $1::integer))")
            .bind(k)
            .execute(&mut *producer)
            .await
            .unwrap();
    }
}

/// Tasks whose limited type's keys a producer holds each wait the tick's 500 ms `lock_timeout`:
/// one after the other, four of them made every pass last 2 s, and an every-second task lost
/// every other tick (review helper-143 F3). After a task's tick failed, a pass tries it after the
/// others and spends at most `FAILING_BUDGET` on such tasks (at least one of them each pass). And
/// a shutdown stops a pass before its next task: thirty held tasks held a TERM for 15 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_whose_keys_are_held_cost_the_others_one_budget_per_pass_and_no_shutdown() {
    let (db, client) = setup().await;
    let mut policy = JobPolicy::on_queue(common::queue("default"));
    policy.concurrency = Some(ConcurrencyPolicy::new(1).key(["k"]));
    client.define_job_type(&JobTypeName::new("limited").unwrap(), &policy).await.unwrap();
    let mut producer = db.pool.begin().await.unwrap();
    hold_tasks(&client, &mut producer, 0..4).await;
    client.define_recurring(&RecurringTask::new("healthy", "* * * * * *", "report")).await.unwrap();
    sqlx::query("UPDATE lockgate.recurring_tasks SET active_since = now() - interval '1 minute'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut scheduler = Scheduler::new(db.new_pool(2).await.unwrap());
    let then = db_now(&db).await;
    let first = scheduler.run_once(then).await.unwrap();
    assert_eq!((first.enqueued, first.errors), (1, 4), "{first:?}");
    // A later second's pass: the healthy task first, then one held task, the rest deferred.
    let until = Instant::now() + WAIT;
    let mut now = db_now(&db).await;
    while now.timestamp() == then.timestamp() {
        assert!(Instant::now() < until, "the database's clock stands still");
        tokio::time::sleep(Duration::from_millis(20)).await;
        now = db_now(&db).await;
    }
    let started = Instant::now();
    let second = scheduler.run_once(now).await.unwrap();
    let took = started.elapsed();
    assert_eq!((second.enqueued, second.errors, second.deferred), (1, 1, 3), "{second:?}");
    assert!(took < Duration::from_millis(1500), "the pass took {took:?}");

    // Thirty held tasks, none known yet to a new scheduler: its shutdown stops the first pass.
    hold_tasks(&client, &mut producer, 4..30).await;
    sqlx::query(
        "UPDATE lockgate.recurring_tasks SET active_since = now() - interval '1 minute' WHERE last_tick_at IS NULL",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(Scheduler::new(db.new_pool(2).await.unwrap()).run(shutdown.clone()));
    lockgate_testkit::wait_for_count(&db.pool, common::WAITING_FOR_A_LOCK, 1, WAIT).await.unwrap();
    let stopping = Instant::now();
    shutdown.cancel();
    tokio::time::timeout(WAIT, running).await.expect("the scheduler stopped").unwrap();
    assert!(stopping.elapsed() < Duration::from_millis(1500), "stopped in {:?}", stopping.elapsed());
    producer.rollback().await.unwrap();
}
