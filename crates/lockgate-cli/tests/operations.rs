//! The operator's commands against a fresh database each: `lockgate doctor` (an idle transaction
//! holding a semaphore row, a healthy database, a missing schema, an unreachable database, the
//! permit and process checks), `lockgate status` (an empty database, throughput, paused queues,
//! processes) and `lockgate dlq list` (every attempt's error).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Output;

use common::*;
use lockgate_testkit::{wait_for, wait_for_count, TestDb};
use serde_json::Value;
use sqlx::Connection;

/// `lockgate doctor --json` with extra arguments: its exit status and its checks.
fn doctor(db: &TestDb, extra: &[&str]) -> (Option<i32>, Vec<Value>) {
    let o = output(db, &[&["doctor", "--json"], extra].concat());
    let checks: Vec<Value> = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("doctor --json printed no array ({e}): {}", text(&o)));
    (o.status.code(), checks)
}

/// The checks named `name`.
fn named<'a>(checks: &'a [Value], name: &str) -> Vec<&'a Value> {
    checks.iter().filter(|c| c["check"] == name).collect()
}

/// Fails on the checks whose verdict is fail, except connection headroom: the server is shared
/// by every test running at once, so its connections are not this test's to judge.
fn assert_no_failure_but_headroom(code: Option<i32>, checks: &[Value]) {
    let failed: Vec<_> = checks.iter().filter(|c| c["verdict"] == "fail").collect();
    assert!(failed.iter().all(|c| c["check"] == "connections"), "{failed:#?}");
    assert_eq!(code, Some(if failed.is_empty() { 0 } else { 1 }), "{checks:#?}");
}

#[tokio::test]
async fn doctor_fails_naming_an_idle_transaction_that_holds_a_semaphore_row_and_is_ok_after_its_rollback() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('sync', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.enqueue('sync', '{}')").execute(&db.pool).await.unwrap();
    // The hazard of H28: a transaction that locked a key's semaphore row and went quiet.
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut holder).await.unwrap();
    let holder_pid: i32 =
        sqlx::query_scalar("SELECT pg_backend_pid() FROM lockgate.semaphores WHERE key = 'sync' FOR UPDATE")
            .fetch_one(&mut holder)
            .await
            .unwrap();
    // Beside it, an idle transaction that holds nothing of lockgate's: not named.
    let mut bystander = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut bystander).await.unwrap();
    let bystander_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut bystander).await.unwrap();

    let args = ["--idle-in-transaction-threshold", "1s"];
    let (code, checks) = wait_for("doctor to name the idle holder", WAIT, || async {
        let (code, checks) = doctor(&db, &args);
        let named = named(&checks, "sessions").iter().any(|c| c["verdict"] == "fail");
        Ok(named.then_some((code, checks)))
    })
    .await
    .unwrap();
    assert_eq!(code, Some(1), "a failed check exits 1");
    let sessions = named(&checks, "sessions");
    assert_eq!(sessions.len(), 1, "only the holder: {sessions:#?}");
    let detail = sessions[0]["detail"].as_str().unwrap();
    assert!(detail.contains(&format!("pid {holder_pid} ")) && detail.contains("lockgate.semaphores"), "{detail}");
    assert!(!detail.contains(&format!("pid {bystander_pid} ")), "{detail}");
    let advice = sessions[0]["advice"].as_str().unwrap();
    assert!(advice.contains(&format!("pg_terminate_backend({holder_pid})")), "{advice}");
    let human = text(&output(&db, &["doctor", "--idle-in-transaction-threshold", "1s"]));
    assert!(human.lines().any(|l| l.starts_with("fail") && l.contains(&format!("pid {holder_pid} "))), "{human}");

    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
    wait_for("the sessions check to be ok", WAIT, || async {
        let (_, checks) = doctor(&db, &args);
        Ok(named(&checks, "sessions").iter().all(|c| c["verdict"] == "ok").then_some(()))
    })
    .await
    .unwrap();
    sqlx::raw_sql("ROLLBACK").execute(&mut bystander).await.unwrap();
}

#[tokio::test]
async fn doctor_passes_a_fresh_database_and_sends_one_without_lockgate_to_migrate() {
    let db = TestDb::migrated().await.unwrap();
    let (code, checks) = doctor(&db, &[]);
    assert_no_failure_but_headroom(code, &checks);
    for name in [
        "schema",
        "clock",
        "sessions",
        "idle_in_transaction_timeout",
        "statement_timeout",
        "writable",
        "connections",
        "dead_tuples",
        "archive_size",
        "orphaned_leases",
        "finished_leases",
        "held_statements",
        "recurring_schedules",
        "parked_with_room",
        "shared_keys",
        "stale_processes",
        "process_builds",
        "queue_tables",
        "queue_steps",
        "claim_indexes",
        "key_guards",
        "table_writers",
    ] {
        assert_eq!(named(&checks, name).len(), 1, "one {name} check: {checks:#?}");
    }
    for name in [
        "schema",
        "clock",
        "sessions",
        "orphaned_leases",
        "finished_leases",
        "held_statements",
        "recurring_schedules",
        "parked_with_room",
        "shared_keys",
        "stale_processes",
        "process_builds",
        "queue_tables",
        "queue_steps",
        "claim_indexes",
        "key_guards",
        "table_writers",
        "writable",
    ] {
        assert_eq!(named(&checks, name)[0]["verdict"], "ok", "{checks:#?}");
    }
    // A schedule stored through SQL that no scheduler can follow is named; a disabled one is not
    // (review helper-116 F2: stored, never ticked, and doctor said nothing).
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('report');
         SELECT lockgate.define_recurring('never', '61 * * * *', 'report');
         SELECT lockgate.define_recurring('off', '* * 31 2 *', 'report', enabled => false);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (_, checks) = doctor(&db, &[]);
    let recurring = &named(&checks, "recurring_schedules")[0];
    assert_eq!(recurring["verdict"], "warn", "{recurring:#?}");
    let detail = recurring["detail"].as_str().unwrap();
    assert!(detail.starts_with("1 enabled recurring task(s) never tick: never (\"61 * * * *\" in UTC"), "{detail}");
    sqlx::query("SELECT lockgate.remove_recurring('never')").execute(&db.pool).await.unwrap();
    // The key tables' guards, one disabled and one dropped by hand, are named.
    sqlx::raw_sql(
        "ALTER TABLE lockgate.leases DISABLE TRIGGER leases_key_not_moved;
         DROP TRIGGER semaphores_key_not_renamed ON lockgate.semaphores;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (_, checks) = doctor(&db, &[]);
    let guards = named(&checks, "key_guards");
    let mut found: Vec<(&str, &str)> =
        guards.iter().map(|c| (c["detail"].as_str().unwrap(), c["advice"].as_str().unwrap())).collect();
    found.sort();
    assert_eq!(found.len(), 2, "{guards:#?}");
    assert_eq!(found[0].0, "trigger leases_key_not_moved on lockgate.leases is disabled");
    assert!(found[0].1.starts_with("ALTER TABLE lockgate.leases ENABLE TRIGGER leases_key_not_moved;"), "{found:?}");
    assert_eq!(found[1].0, "trigger semaphores_key_not_renamed on lockgate.semaphores is missing");
    assert!(found[1].1.starts_with("create it again as migrations/0020_key_changes_refused.sql does"), "{found:?}");
    assert!(guards.iter().all(|c| c["verdict"] == "warn"), "{guards:#?}");

    let bare = TestDb::empty().await.unwrap();
    let o = output(&bare, &["doctor"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).lines().any(|l| l.starts_with("fail") && l.contains("run `lockgate migrate`")), "{}", text(&o));

    // A database that does not exist: nothing can be checked.
    let name = format!("{}_missing", db.name);
    let missing = format!("{}/{name}", lockgate_testkit::server_url().rsplit_once('/').unwrap().0);
    let o = lockgate(&db, &["doctor"]).env("DATABASE_URL", &missing).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("fail  connection"), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("database \"{name}\" does not exist")),
        "a missing database, not a bad URL: {}",
        text(&o)
    );
}

#[tokio::test]
async fn doctor_warns_of_orphaned_leases_parked_jobs_with_room_and_stale_processes() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('sync', concurrency_limit => 1)").execute(&db.pool).await.unwrap();
    let held: i64 =
        sqlx::query_scalar("SELECT msg_id FROM lockgate.enqueue('sync', '{}')").fetch_one(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.enqueue('sync', '{\"n\": 2}')").execute(&db.pool).await.unwrap();
    let (_, checks) = doctor(&db, &[]);
    for name in ["orphaned_leases", "parked_with_room", "stale_processes", "process_builds"] {
        assert_eq!(named(&checks, name)[0]["verdict"], "ok", "a held key with a parked job is normal: {checks:#?}");
    }
    // The holder's message removed behind lockgate's back; room made for the parked job; a
    // process silent for five minutes.
    sqlx::query("SELECT pgmq.delete('default', $1)").bind(held).execute(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('sync', concurrency_limit => 2)").execute(&db.pool).await.unwrap();
    // And, heard from, one process of a build that records no functions revision (a rolling
    // deploy's older process, review helper-118) beside one of this build.
    sqlx::query(
        "INSERT INTO lockgate.processes (kind, name, host, pid, last_heartbeat_at, metadata)
         VALUES ('supervisor', 'gone', 'nowhere', 4242, now() - interval '5 minutes', '{}'),
                ('supervisor', 'old', 'here', 4343, now(), '{\"version\": \"0.1.0\"}'),
                ('supervisor', 'new', 'here', 4444, now(), jsonb_build_object('functions_revision', $1::integer))",
    )
    .bind(lockgate::sql::FUNCTIONS_REVISION)
    .execute(&db.pool)
    .await
    .unwrap();
    let (code, checks) = doctor(&db, &[]);
    assert_no_failure_but_headroom(code, &checks);
    let detail = |name: &str| {
        let found = named(&checks, name);
        assert_eq!((found.len(), &found[0]["verdict"]), (1, &Value::from("warn")), "{checks:#?}");
        found[0]["detail"].as_str().unwrap().to_string()
    };
    assert!(detail("orphaned_leases").starts_with("1 lease(s) whose message is gone (1 on queue default)"));
    assert!(detail("parked_with_room").contains("sync (1 parked, 1 of 2 held"), "{}", detail("parked_with_room"));
    assert!(detail("stale_processes").contains("(gone on nowhere, pid 4242)"), "{}", detail("stale_processes"));
    let builds = detail("process_builds");
    assert!(builds.contains("(old on here, pid 4343) runs an older build"), "{builds}");
    assert!(builds.ends_with("a build that records no revision (before 115)"), "{builds}");
}

/// Review helper-119 F1, F2: types of different limits that name one concurrency key are each
/// admitted by their own limit, and the key's parked jobs wait behind the stricter one's; the
/// doctor names such a key while jobs of both are parked, and not one shared by equal limits.
#[tokio::test]
async fn doctor_names_a_key_with_parked_jobs_or_holders_of_types_with_different_limits() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('one', concurrency_limit => 1);
         SELECT lockgate.define_job_type('three', concurrency_limit => 3);
         SELECT lockgate.define_job_type('also_three', concurrency_limit => 3);
         SELECT lockgate.enqueue(t, '{}', '{\"concurrency_key\": \"acct\"}')
           FROM unnest(ARRAY['three', 'three', 'three', 'one', 'three']) t;
         SELECT lockgate.enqueue(t, '{}', '{\"concurrency_key\": \"same\"}')
           FROM unnest(ARRAY['three', 'also_three', 'three', 'also_three', 'three']) t;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (_, checks) = doctor(&db, &[]);
    let shared = named(&checks, "shared_keys");
    assert_eq!((shared.len(), &shared[0]["verdict"]), (1, &Value::from("warn")), "{checks:#?}");
    assert_eq!(
        shared[0]["detail"],
        "1 key(s) have parked jobs, and parked jobs or holders of types with different limits: acct (2 parked: one \
         limited to 1, three limited to 3)"
    );
    // A job of the looser type parked behind the stricter type's holder alone (review helper-124
    // F4: only the parked jobs' types were compared).
    sqlx::raw_sql(
        "SELECT lockgate.enqueue(t, '{}', '{\"concurrency_key\": \"solo\"}') FROM unnest(ARRAY['one', 'three']) t;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (_, checks) = doctor(&db, &[]);
    let shared = named(&checks, "shared_keys");
    assert!(
        shared[0]["detail"].as_str().unwrap().starts_with("2 key(s)")
            && shared[0]["detail"].as_str().unwrap().contains("solo (1 parked: one limited to 1, three limited to 3)"),
        "{checks:#?}"
    );
    assert_eq!(named(&checks, "parked_with_room")[0]["verdict"], "ok", "{checks:#?}");
}

fn json(o: &Output) -> Value {
    assert!(o.status.success(), "{}", text(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(o)))
}

/// A job type `task` that fails (after one retry 10 ms later) when its arguments mention
/// "fail", with the arguments in its error, and succeeds otherwise.
const FAILS_ON_REQUEST: &str = "read -r a || true; case \"$a\" in *fail*) echo \"bad input $a\" >&2; exit 3;; esac";
const TWO_QUICK_ATTEMPTS: &str = "max_attempts = 2\nbackoff = { base = \"10ms\", max = \"10ms\" }";

/// Runs `lockgate run` until the jobs enqueued with `args` have all finished: three successes
/// and one dead letter.
async fn three_succeeded_and_one_dead(setup: &Setup, db: &TestDb) -> std::process::Child {
    let child = setup.run(db);
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.job_types", 1, WAIT).await.unwrap();
    for args in ["{\"n\": 1}", "{\"n\": 2}", "{\"n\": 3}", "{\"please\": \"fail\"}"] {
        let o = output(db, &["enqueue", "task", args]);
        assert!(o.status.success(), "{}", text(&o));
    }
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 3, WAIT).await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 1, WAIT).await.unwrap();
    child
}

#[tokio::test]
async fn status_on_a_database_without_queues_says_how_to_create_one() {
    let db = TestDb::migrated().await.unwrap();
    let o = output(&db, &["status"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("No queues yet") && text(&o).contains("lockgate enqueue"), "{}", text(&o));
    assert!(text(&o).contains("No process is registered"), "{}", text(&o));
    let all = json(&output(&db, &["status", "--json"]));
    assert_eq!(all["queues"], Value::Array(vec![]), "{all:#}");
}

#[tokio::test]
async fn status_counts_succeeded_and_failed_jobs_and_shows_paused_queues_and_processes() {
    let setup = Setup::new(FAILS_ON_REQUEST, TWO_QUICK_ATTEMPTS);
    let db = TestDb::migrated().await.unwrap();
    let mut child = three_succeeded_and_one_dead(&setup, &db).await;
    sqlx::query("SELECT lockgate.create_queue('mail')").execute(&db.pool).await.unwrap();
    assert!(output(&db, &["queue", "pause", "mail"]).status.success());
    // The windows: a job archived ten minutes ago counts in the hour only, one two hours ago in
    // neither; the dead letter moves out of the last minute.
    sqlx::raw_sql(
        "INSERT INTO pgmq.a_default (msg_id, vt, message, archived_at)
         VALUES (nextval('lockgate.job_id_seq'), now(), '{}', now() - interval '10 minutes'),
                (nextval('lockgate.job_id_seq'), now(), '{}', now() - interval '2 hours');
         UPDATE lockgate.dead_letters SET dead_at = now() - interval '10 minutes';",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let all = json(&output(&db, &["status", "--json"]));
    let queue = |name: &str| all["queues"].as_array().unwrap().iter().find(|q| q["queue"] == name).unwrap().clone();
    let default = queue("default");
    let counts = ["succeeded_last_minute", "succeeded_last_hour", "failed_last_minute", "failed_last_hour", "dead"]
        .map(|k| default[k].as_i64().unwrap());
    assert_eq!(counts, [3, 4, 0, 1, 1], "{default:#}");
    assert_eq!((&default["succeeded_capped"], &default["paused"]), (&Value::from(false), &Value::from(false)));
    assert_eq!(queue("mail")["paused"], true);
    let processes = all["processes"].as_array().unwrap();
    assert!(processes.iter().any(|p| p["kind"] == "supervisor" && p["heartbeat_age_seconds"].as_f64().unwrap() < 60.0));

    let human = text(&output(&db, &["status"]));
    let row =
        |name: &str| human.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{human}"));
    let cells: Vec<&str> = row("default").split_whitespace().collect();
    // QUEUE READY SCHEDULED RUNNING SUCCEEDED-1M SUCCEEDED-1H FAILED-1H DEAD OLDEST-READY
    assert_eq!(cells[4..8], ["3", "4", "1", "1"], "{human}");
    assert!(row("mail").ends_with("paused"), "{human}");
    assert!(human.contains("(paused: mail)") && human.contains("last hour: 4 succeeded, 1 failed"), "{human}");
    assert!(human.contains("LAST HEARTBEAT") && human.lines().any(|l| l.contains(" supervisor ")), "{human}");

    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success());
}

#[tokio::test]
async fn dlq_list_shows_the_arguments_and_every_attempts_error() {
    let setup = Setup::new(FAILS_ON_REQUEST, TWO_QUICK_ATTEMPTS);
    let db = TestDb::migrated().await.unwrap();
    let mut child = three_succeeded_and_one_dead(&setup, &db).await;
    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success());

    let listed = json(&output(&db, &["dlq", "list", "--json"]));
    let dead = &listed.as_array().unwrap()[..];
    assert_eq!(dead.len(), 1, "{listed:#}");
    assert_eq!(dead[0]["args"]["please"], "fail");
    assert_eq!((&dead[0]["reason"], &dead[0]["attempts"]), (&Value::from("attempts_exhausted"), &Value::from(2)));
    let errors = dead[0]["errors"].as_array().unwrap();
    assert_eq!(errors.iter().map(|e| e["attempt"].as_i64().unwrap()).collect::<Vec<_>>(), [1, 2], "{listed:#}");
    for e in errors {
        assert!(e["error"].as_str().unwrap().contains("bad input"), "{e}");
        assert!(e["at"].is_string(), "{e}");
    }
    assert!(dead[0]["headers"].is_object() && dead[0]["job_id"].is_i64(), "{listed:#}");

    let human = text(&output(&db, &["dlq", "list"]));
    assert!(
        human.contains("args       {\"please\":\"fail\"}") || human.contains("args       {\"please\": \"fail\"}"),
        "{human}"
    );
    let attempts: Vec<&str> = human.lines().filter(|l| l.trim_start().starts_with("attempt ")).collect();
    assert_eq!(attempts.len(), 2, "{human}");
    assert!(attempts[0].contains("attempt 1") && attempts[1].contains("attempt 2"), "{human}");
    assert!(attempts.iter().all(|l| l.contains("bad input")), "{human}");
}

/// A lost attempt in a dead letter's history has no time and says it was lost.
#[tokio::test]
async fn dlq_list_shows_a_lost_attempt_as_lost() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('flaky', max_attempts => 2); SELECT lockgate.enqueue('flaky', '{}'); \
         SELECT lockgate.claim('default', 1, 30); UPDATE pgmq.q_default SET vt = now() - interval '1 second'; \
         SELECT lockgate.dead_letter('default', c.msg_id, c.read_ct, 'attempts_exhausted', 'bad input', 2) \
           FROM lockgate.claim('default', 1, 30) c;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let human = text(&output(&db, &["dlq", "list"]));
    let attempts: Vec<&str> = human.lines().filter(|l| l.trim_start().starts_with("attempt ")).collect();
    assert_eq!(attempts.len(), 2, "{human}");
    assert!(attempts[0].contains(" -  ") && attempts[0].contains("lost: no outcome was recorded"), "{human}");
    assert!(attempts[1].contains(" UTC  bad input"), "{human}");
}

/// `lockgate demo` empties the queue `demo` with PGMQ's own calls: on a database where an
/// application's jobs use a queue of that name, it refuses, naming their type, and leaves them.
#[tokio::test]
async fn demo_refuses_a_demo_queue_that_holds_an_applications_jobs() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql("SELECT lockgate.define_job_type('app', queue => 'demo'); SELECT lockgate.enqueue('app', '{}');")
        .execute(&db.pool)
        .await
        .unwrap();
    let o = output(&db, &["demo", "--jobs", "1"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("queue 'demo' holds or serves job types that are not the demo's (app)"), "{}", text(&o));
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_demo").await.unwrap(), 1, "the application's job is left");
}

/// Review (helper-77, #2, #5, #6): the listings panicked (exit 101) for every user on one row
/// written by hand: a time past what chrono holds (`infinity`) in `jobs`, `job show` and
/// `dlq list --json`, and a job type of 100,000 characters in `dlq list`'s table.
#[tokio::test]
async fn listings_show_rows_written_by_hand_whatever_their_times_and_lengths() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.create_queue('odd');
         INSERT INTO pgmq.q_odd (enqueued_at, vt, message, headers)
         VALUES ('infinity', 'infinity', '{}', '{\"type\": \"t\", \"job_id\": 4242}'),
                ('-infinity', '-infinity', '{}', '{\"type\": \"t\"}');
         INSERT INTO lockgate.dead_letters (queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at)
         VALUES ('odd', 7, 4343, repeat('x', 100000), '{}', '{}', 'undecodable', 'by hand', 1, 'infinity');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Arguments nested deeper than the client decodes (review helper-78, F2): queued, parked,
    // and dead-lettered.
    let deep = (0..200).fold(serde_json::json!({}), |inner, _| serde_json::json!({ "a": inner }));
    sqlx::query("SELECT lockgate.define_job_type('deep', queue => 'odd', concurrency_limit => 1)")
        .execute(&db.pool)
        .await
        .unwrap();
    for _ in 0..2 {
        sqlx::query("SELECT lockgate.enqueue('deep', $1)").bind(&deep).execute(&db.pool).await.unwrap();
    }
    sqlx::query(
        "INSERT INTO lockgate.dead_letters (queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at)
         VALUES ('odd', 8, 4444, 'deep', $1, jsonb_build_object('errors', jsonb_build_array($1)), 'undecodable', 'deep', 1, now())",
    )
    .bind(&deep)
    .execute(&db.pool)
    .await
    .unwrap();
    // A key and an error with an escape sequence and a newline (review helper-119 F3, helper-120
    // F3): every listing shows them escaped, none writes them to the terminal.
    let marked: i64 = sqlx::query_scalar(
        "SELECT max(job_id) FROM lockgate.enqueue('deep', '{}', jsonb_build_object('concurrency_key', E'red\\x1b[31m\\n'))",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO lockgate.dead_letters (queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at)
         VALUES ('odd', 9, 4545, E'\\x1b]0;title\\x07', '{}', '{\"errors\": [{\"attempt\": 1, \"error\": \"\\u001b[2J\"}]}',
                 'undecodable', E'\\x1b[2J', 1, now())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let marked = marked.to_string();
    for args in [
        &["jobs", "--queue", "odd"][..],
        &["jobs", "--queue", "odd", "--json"],
        &["job", "show", "4242"],
        &["job", "show", &marked],
        &["job", "show", "4545"],
        &["dlq", "list"],
        &["dlq", "list", "--json"],
        &["parked", "list"],
        &["status"],
        &["doctor"],
    ] {
        let out = output(&db, args);
        assert!(out.status.success() || args[0] == "doctor", "{args:?}: {}", text(&out));
        assert!(!text(&out).contains('\u{1b}'), "{args:?} wrote an escape sequence raw: {}", text(&out));
    }
    assert!(text(&output(&db, &["job", "show", &marked])).contains("key       red\\x1B[31m\\x0A"));
    let listed = text(&output(&db, &["dlq", "list"]));
    assert!(listed.contains(&format!("{}…", "x".repeat(199))) && !listed.contains(&"x".repeat(201)), "{listed}");
}

/// A listing read only in part (`lockgate jobs | head -1`) ends as a writer to a closed pipe does,
/// exit 141, with no panic on stderr (it panicked, exit 101, when `println!` met the closed pipe).
#[tokio::test]
async fn a_listing_piped_into_a_reader_that_stops_early_exits_quietly() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('t')").execute(&db.pool).await.unwrap();
    sqlx::query(
        "SELECT count(*) FROM lockgate.enqueue_many('t', ARRAY(SELECT jsonb_build_object('n', g, 'pad', repeat('x', 100))
                                                                FROM generate_series(1, 1000) g))",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut child = lockgate(&db, &["jobs", "--limit", "1000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut first).unwrap();
    assert!(first.starts_with("  ID"), "{first}");
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(141), "{}", text(&o));
    assert!(!text(&o).contains("panicked"), "{}", text(&o));
}

/// Review of the README (helper-92, F5): nothing retired a job type or a queue; the only way was a
/// hand DELETE on lockgate's tables. `lockgate undefine` and `lockgate queue drop` refuse while
/// anything needs what they remove, naming it, and exit 1 for what does not exist.
#[tokio::test]
async fn undefine_and_queue_drop_retire_what_nothing_needs_and_refuse_the_rest() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql("SELECT lockgate.define_job_type('old', queue => 'legacy'); SELECT lockgate.enqueue('old', '{}');")
        .execute(&db.pool)
        .await
        .unwrap();
    // Sessions that start at REPEATABLE READ, which the SQL functions refuse: the commands run
    // their own READ COMMITTED transaction (review helper-94).
    sqlx::query(&format!("ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let o = output(&db, &["undefine", "old"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("error: job type \"old\" is still in use: 1 queued, scheduled, retrying or running job(s)"),
        "{}",
        text(&o)
    );
    let o = output(&db, &["queue", "drop", "legacy"]);
    assert!(o.status.code() == Some(1) && text(&o).contains("job type(s) old defined on it"), "{}", text(&o));
    let cancelled = output(&db, &["job", "cancel", "--type", "old"]);
    assert!(cancelled.status.success(), "{}", text(&cancelled));
    let o = output(&db, &["undefine", "old"]);
    assert!(o.status.success() && text(&o).contains("removed job type old"), "{}", text(&o));
    let o = output(&db, &["queue", "drop", "legacy"]);
    assert!(o.status.success() && text(&o).contains("dropped queue legacy"), "{}", text(&o));
    for (args, expected) in [
        (vec!["undefine", "old"], "unknown job type \"old\": nothing to remove"),
        (vec!["queue", "drop", "legacy"], "queue \"legacy\" does not exist: nothing to drop"),
    ] {
        let o = output(&db, &args);
        assert!(o.status.code() == Some(1) && text(&o).contains(expected), "{args:?}: {}", text(&o));
    }
    let doctor = output(&db, &["doctor"]);
    assert!(doctor.status.success(), "nothing left behind: {}", text(&doctor));
}

/// Review helper-136 F4: a session that keeps lockgate's migrate lock (a pooler's server
/// connection, after a migrate through a pooler URL that did not say so) is named to the next
/// migrate, which waited for it in silence; once it ends, the migrate completes.
#[tokio::test]
async fn migrate_names_the_session_that_keeps_its_lock_and_completes_once_it_ends() {
    let db = TestDb::migrated().await.unwrap();
    let mut keeper = sqlx::PgConnection::connect(&db.url).await.unwrap();
    // lockgate's migrate lock key (crates/lockgate-sql/src/migrate.rs, MIGRATE_LOCK_KEY).
    sqlx::query("SELECT pg_advisory_lock(7813573191458190437)").execute(&mut keeper).await.unwrap();
    let keeper_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut keeper).await.unwrap();
    let mut child = lockgate(&db, &["migrate"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Named in the log after 5 s of waiting; the keeper is then ended, as the log advises.
    wait_for("migrate to wait for its lock past 5 s", WAIT, || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid
              WHERE a.datname = current_database() AND a.application_name = 'lockgate' AND l.locktype = 'advisory'
                AND NOT l.granted AND a.backend_start < now() - interval '6 seconds'",
        )
        .fetch_one(&db.pool)
        .await?;
        Ok((waiting > 0).then_some(()))
    })
    .await
    .unwrap();
    keeper.close().await.unwrap();
    let status = wait_exit(&mut child).await;
    let o = child.wait_with_output().unwrap();
    assert!(status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("which backend {keeper_pid} holds"))
            && text(&o).contains(&format!("pg_terminate_backend({keeper_pid})")),
        "{}",
        text(&o)
    );
}

/// Runs `lockgate <args>` to its end, within the tests' deadline (a hung command fails the test
/// instead of hanging it).
async fn output_within_deadline(db: &TestDb, args: &[&str]) -> Output {
    let mut child =
        lockgate(db, args).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    wait_exit(&mut child).await;
    child.wait_with_output().unwrap()
}

/// `lockgate status` and `lockgate doctor` while another session holds a queue's table locked (an
/// abandoned transaction; a migrate rebuilding a claim index): each waits at most its 5 s lock
/// timeout. Status fails naming the way to find the holder; doctor runs its sessions check, which
/// names it, and says the other checks did not run. Before, both waited, silent, for as long as
/// the lock was held (review helper-140 F2).
#[tokio::test]
async fn status_and_doctor_answer_while_a_queue_table_is_locked() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('default')").execute(&db.pool).await.unwrap();
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE pgmq.q_default IN ACCESS EXCLUSIVE MODE").execute(&mut holder).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut holder).await.unwrap();

    let o = output_within_deadline(&db, &["status"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("lockgate doctor"), "{}", text(&o));

    let o = output_within_deadline(&db, &["doctor", "--idle-in-transaction-threshold", "0s"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains(&format!("pid {pid} (idle in transaction")), "{}", text(&o));
    assert!(text(&o).contains("the other checks did not run"), "{}", text(&o));
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
}

/// Review helper-143 F5: `lockgate recurring enable|disable|add|remove` waited, printing nothing,
/// for as long as another transaction held the task's row. Each waits at most 5 s now, and says
/// what holds the task and where to look.
#[tokio::test]
async fn recurring_commands_give_up_on_a_task_another_transaction_holds() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('noop');
         SELECT lockgate.define_recurring('nightly', '0 3 * * *', 'noop');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.define_recurring('nightly', '0 3 * * *', 'noop')")
        .execute(&mut holder)
        .await
        .unwrap();
    for args in [
        &["recurring", "disable", "nightly"][..],
        &["recurring", "remove", "nightly"],
        &["recurring", "add", "nightly", "0 4 * * *", "noop"],
    ] {
        let o = output_within_deadline(&db, args).await;
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", text(&o));
        assert!(
            text(&o).contains("recurring task \"nightly\" is held by another transaction"),
            "{args:?}: {}",
            text(&o)
        );
    }
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let o = output_within_deadline(&db, &["recurring", "disable", "nightly"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

/// Review helper-144 F8: `dlq retry --queue` of many dead letters was one statement, which a
/// `statement_timeout` shorter than its run (common on managed PostgreSQL) undid every time:
/// nothing was ever retried. It runs a statement per thousand now, each of its own.
#[tokio::test]
async fn dlq_retry_of_many_dead_letters_gets_through_a_short_statement_timeout() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('noop', queue => 'bulk');
         INSERT INTO lockgate.dead_letters (queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at)
         SELECT 'bulk', n, n, 'noop', jsonb_build_object('n', n), jsonb_build_object('type', 'noop', 'job_id', n),
                'attempts_exhausted', 'failed', 1, now()
           FROM generate_series(1, 20000) n;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Time enough for a thousand at once, far too little for twenty thousand.
    sqlx::query(&format!("ALTER DATABASE {} SET statement_timeout = '1s'", db.name)).execute(&db.pool).await.unwrap();
    let o = output_within_deadline(&db, &["dlq", "retry", "--queue", "bulk"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("retried 20000 dead letter(s)"), "{}", text(&o));
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0);
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_bulk").await.unwrap(), 20000);
}
