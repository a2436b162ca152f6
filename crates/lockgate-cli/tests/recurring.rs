//! Recurring jobs with the real binary: two `lockgate run` processes with the same schedule
//! enqueue each of ten ticks once (H23), a tick missed while no process was up is enqueued once,
//! and the `lockgate recurring` commands and `[recurring]` tables refuse bad input naming it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Child;

use chrono::{DateTime, DurationRound, TimeDelta, Timelike, Utc};
use common::*;
use lockgate_testkit::{wait_for, TestDb};

/// Runs `sh -c` jobs that record each start.
const RECORD_START: &str = "cat >/dev/null; echo start >> $DIR/starts";

async fn db_now(db: &TestDb) -> DateTime<Utc> {
    lockgate::sql::database_now(&db.pool).await.unwrap()
}

async fn ticks(db: &TestDb) -> Vec<DateTime<Utc>> {
    sqlx::query_scalar("SELECT tick_at FROM lockgate.recurring_ticks ORDER BY tick_at")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

async fn wait_supervisors(db: &TestDb, n: i64) {
    wait_for(&format!("{n} registered process(es)"), WAIT, || async {
        let found = db.count("SELECT 1 FROM lockgate.processes WHERE kind = 'supervisor'").await?;
        Ok((found == n).then_some(()))
    })
    .await
    .unwrap();
}

async fn stop(mut child: Child) {
    signal(&child, "TERM");
    let status = wait_exit(&mut child).await;
    assert!(status.success(), "graceful exit, got {status}");
}

/// A cron expression that fires on the ten whole seconds from `first` (all in one minute), once.
fn ten_seconds_from(first: DateTime<Utc>) -> String {
    let s = first.second();
    format!("{s}-{} {} {} {} {} *", s + 9, first.minute(), first.hour(), first.format("%-d"), first.format("%-m"))
}

#[tokio::test]
async fn h23_two_lockgate_run_processes_with_the_same_schedule_enqueue_each_of_ten_ticks_once() {
    let db = TestDb::migrated().await.unwrap();
    // Ten ticks in one minute, starting late enough for both processes to be up.
    let mut first = (db_now(&db).await + TimeDelta::seconds(8)).duration_trunc(TimeDelta::seconds(1)).unwrap();
    if first.second() > 50 {
        first = first.duration_trunc(TimeDelta::minutes(1)).unwrap() + TimeDelta::minutes(1);
    }
    let cron = ten_seconds_from(first);
    let setup = Setup::new(RECORD_START, &format!("\n[recurring.ten]\ncron = {cron:?}\njob_type = \"task\"\n"));
    let (a, b) = (setup.run(&db), setup.run(&db));
    wait_supervisors(&db, 2).await;
    assert!(db_now(&db).await < first, "both processes were up before the first tick at {first}");

    let last = first + TimeDelta::seconds(9);
    let until_last = (last - db_now(&db).await).to_std().unwrap_or_default();
    wait_for("the tenth tick", until_last + WAIT, || async {
        let latest: Option<DateTime<Utc>> =
            sqlx::query_scalar("SELECT last_tick_at FROM lockgate.recurring_tasks").fetch_one(&db.pool).await?;
        Ok((latest == Some(last)).then_some(()))
    })
    .await
    .unwrap();
    setup.wait_starts(10).await;
    stop(a).await;
    stop(b).await;

    let expected: Vec<_> = (0..10).map(|i| first + TimeDelta::seconds(i)).collect();
    assert_eq!(ticks(&db).await, expected, "each tick recorded once");
    let jobs = db.count("SELECT 1 FROM pgmq.a_default UNION ALL SELECT 1 FROM pgmq.q_default").await.unwrap();
    assert_eq!(jobs, 10, "ten ticks, two schedulers: ten enqueues");
    let distinct = db.count("SELECT DISTINCT job_id FROM lockgate.recurring_ticks WHERE status = 'enqueued'").await;
    assert_eq!(distinct.unwrap(), 10, "each tick has its own job");
    assert_eq!(setup.starts(), 10, "each job ran once");
}

#[tokio::test]
async fn a_tick_missed_while_no_lockgate_run_was_up_is_enqueued_once_when_one_starts() {
    let db = TestDb::migrated().await.unwrap();
    let setup = Setup::new(RECORD_START, "\n[recurring.beat]\ncron = \"* * * * * *\"\njob_type = \"task\"\n");
    let child = setup.run(&db);
    wait_for("two ticks", WAIT, || async { Ok((ticks(&db).await.len() >= 2).then_some(())) }).await.unwrap();
    stop(child).await;
    let before_downtime = *ticks(&db).await.last().unwrap();
    // The downtime: at least three ticks pass with no process up.
    let downtime = before_downtime + TimeDelta::milliseconds(3500);
    wait_for("three ticks of downtime", WAIT, || async { Ok((db_now(&db).await >= downtime).then_some(())) })
        .await
        .unwrap();
    let child = setup.run(&db);
    wait_for("a tick after the downtime", WAIT, || async {
        Ok(ticks(&db).await.iter().any(|t| *t > before_downtime).then_some(()))
    })
    .await
    .unwrap();
    stop(child).await;

    let after: Vec<_> = ticks(&db).await.into_iter().filter(|t| *t > before_downtime).collect();
    assert!(
        after[0] >= before_downtime + TimeDelta::seconds(3),
        "the ticks missed during the downtime were enqueued one by one: {before_downtime} then {after:?}"
    );
    let jobs = db.count("SELECT 1 FROM pgmq.a_default UNION ALL SELECT 1 FROM pgmq.q_default").await.unwrap();
    assert_eq!(jobs, ticks(&db).await.len() as i64, "one job per recorded tick");
}

#[tokio::test]
async fn recurring_commands_list_enable_disable_and_refuse_bad_input_naming_it() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('task')").execute(&db.pool).await.unwrap();
    let ok = |args: &[&str]| {
        let o = output(&db, args);
        assert!(o.status.success(), "{args:?}: {}", text(&o));
        text(&o)
    };
    let fails = |args: &[&str], expected: &str| {
        let o = output(&db, args);
        assert!(!o.status.success() && text(&o).contains(expected), "{args:?}: expected {expected:?} in {}", text(&o));
    };
    ok(&["recurring", "add", "nightly", "30 2 * * *", "task", "{\"n\": 1}", "--timezone", "Europe/Berlin"]);
    let listed = ok(&["recurring", "list"]);
    let line = listed.lines().find(|l| l.starts_with("nightly")).unwrap_or_else(|| panic!("{listed}"));
    assert!(line.contains("Europe/Berlin") && line.contains(" yes ") && line.contains(":30:00 UTC"), "{line}");
    ok(&["recurring", "disable", "nightly"]);
    let json: serde_json::Value = serde_json::from_str(&ok(&["recurring", "list", "--json"])).unwrap();
    assert_eq!((json[0]["enabled"].as_bool(), json[0]["next_run_at"].is_null()), (Some(false), true), "{json}");
    ok(&["recurring", "enable", "nightly"]);
    let json: serde_json::Value = serde_json::from_str(&ok(&["recurring", "list", "--json"])).unwrap();
    assert!(json[0]["next_run_at"].is_string(), "{json}");

    fails(&["recurring", "disable", "nope"], "unknown recurring task \"nope\"");
    fails(&["recurring", "enable", "nope"], "unknown recurring task \"nope\"");
    fails(&["recurring", "remove", "nope"], "unknown recurring task \"nope\"");
    fails(&["recurring", "add", "t", "every day", "task"], "invalid cron \"every day\"");
    fails(&["recurring", "add", "t", "@daily", "task", "--timezone", "Mars/Base"], "invalid timezone \"Mars/Base\"");
    fails(&["recurring", "add", "t", "@daily", "nope"], "recurring task \"t\": unknown job type \"nope\"");
    fails(&["recurring", "add", "t", "@daily", "task", "[1, 2]"], "invalid args \"[1,2]\": a JSON object");
    fails(&["recurring", "add", "t", "@daily", "task", "{oops"], "not valid JSON");
    ok(&["recurring", "remove", "nightly"]);
    assert_eq!(db.count("SELECT 1 FROM lockgate.recurring_tasks").await.unwrap(), 0, "nothing bad was stored");

    let cases = [
        ("cron = \"every day\"\njob_type = \"task\"", "invalid cron \"every day\""),
        ("cron = \"@daily\"\ntimezone = \"Mars/Base\"\njob_type = \"task\"", "invalid timezone \"Mars/Base\""),
        ("cron = \"@daily\"\njob_type = \"nope\"", "recurring task \"nightly\": unknown job type \"nope\""),
        ("cron = \"@daily\"\njob_type = \"task\"\nargs = [1]", "invalid args \"[1]\": a JSON object"),
        ("cron = \"@daily\"\njob_type = \"task\"\nevery = \"day\"", "unknown field `every`"),
    ];
    for (section, expected) in cases {
        let setup = Setup::new(RECORD_START, &format!("\n[recurring.nightly]\n{section}\n"));
        let o = output(&db, &["run", "--config", setup.config.to_str().unwrap()]);
        assert!(!o.status.success() && text(&o).contains(expected), "{section}: expected {expected:?} in {}", text(&o));
    }
    assert_eq!(db.count("SELECT 1 FROM lockgate.recurring_tasks").await.unwrap(), 0);
    assert_eq!(db.count("SELECT 1 FROM lockgate.processes").await.unwrap(), 0, "no process registered");
}

/// Review of the README (helper-92, F1): `define` stored a configuration whose recurring task
/// named an unknown job type or queue, which `run` then refused, and `run` refused it only after
/// it had stored the configuration's job types. Both now check every task's type and queue
/// against the configuration and the database before they store anything; a queue that only a
/// pool of the configuration serves is created before the tasks are stored.
#[tokio::test]
async fn a_recurring_task_naming_what_does_not_exist_is_refused_before_anything_is_stored() {
    let db = TestDb::migrated().await.unwrap();
    let cases = [
        ("job_type = \"nope\"", "recurring task \"nightly\": unknown job type \"nope\""),
        ("job_type = \"task\"\nqueue = \"reports\"", "recurring task \"nightly\": queue \"reports\" does not exist"),
    ];
    for (keys, expected) in cases {
        let setup = Setup::new(RECORD_START, &format!("\n[recurring.nightly]\ncron = \"@daily\"\n{keys}\n"));
        for command in ["define", "run"] {
            let o = output(&db, &[command, "--config", setup.config.to_str().unwrap()]);
            assert_eq!(o.status.code(), Some(1), "{command} {keys}: {}", text(&o));
            assert!(text(&o).contains(expected), "{command}: expected {expected:?} in {}", text(&o));
            assert_eq!(db.count("SELECT 1 FROM lockgate.job_types").await.unwrap(), 0, "{command} stored a type");
        }
    }
    let pool = "\n[[pool]]\nqueues = [\"reports\"]\nconcurrency = 1\n";
    let setup = Setup::new(
        RECORD_START,
        &format!("\n[recurring.nightly]\ncron = \"@daily\"\njob_type = \"task\"\nqueue = \"reports\"\n{pool}"),
    );
    let child = setup.run(&db);
    wait_supervisors(&db, 1).await;
    assert_eq!(db.count("SELECT 1 FROM lockgate.recurring_tasks WHERE name = 'nightly'").await.unwrap(), 1);
    stop(child).await;
}
