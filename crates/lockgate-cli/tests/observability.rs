//! What an operator sees of a running process, with the real binary: `/metrics` scraped during a
//! drain agrees with the database at its end, and `--log-format json` writes one JSON object per
//! line whose job events carry the job's id, type, queue and attempt.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::{Child, Stdio};

use common::*;
use lockgate_testkit::{wait_for, wait_for_count, TestDb};
use serde_json::Value;

/// Jobs whose arguments mention `fail` fail; the rest succeed.
const FAIL_ON_REQUEST: &str = "input=$(cat); case \"$input\" in *fail*) exit 1;; esac";
/// Two attempts, retried within milliseconds.
const TWO_FAST_ATTEMPTS: &str = "max_attempts = 2\nbackoff = { base = \"10ms\", max = \"20ms\" }";

async fn wait_registered(db: &TestDb) {
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.processes WHERE kind = 'supervisor'", 1, WAIT)
        .await
        .unwrap();
}

async fn stop(mut child: Child) {
    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success(), "the process exits 0 after TERM");
}

/// Enqueues `ok` jobs that succeed and `failing` ones that fail both attempts.
async fn enqueue(db: &TestDb, ok: i32, failing: i32) {
    let sql = "SELECT count(*) FROM lockgate.enqueue_many('task',
                 ARRAY(SELECT jsonb_build_object('n', g) || CASE WHEN g > $1 THEN '{\"fail\": 1}'::jsonb ELSE '{}' END
                         FROM generate_series(1, $1 + $2) g))";
    sqlx::query(sql).bind(ok).bind(failing).execute(&db.pool).await.unwrap();
}

async fn scrape(port: u16) -> Option<String> {
    let response = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await.ok()?;
    if response.status() != 200 {
        return None;
    }
    response.text().await.ok()
}

/// The value of one series (`name{labels}`) in a scrape, if it is there.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.split(' ').next()?.parse().ok())
}

const SUCCEEDED: &str = "lockgate_jobs_succeeded_total{queue=\"default\",job_type=\"task\"}";
const RETRIED: &str = "lockgate_jobs_retried_total{queue=\"default\",job_type=\"task\"}";
const DEAD_LETTERED: &str = "lockgate_jobs_dead_lettered_total{queue=\"default\",job_type=\"task\"}";

#[tokio::test]
async fn metrics_scraped_during_a_drain_match_the_database_at_the_end() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let runtime = DEFAULT_RUNTIME.replace("health_listen = \"off\"", &format!("health_listen = \"127.0.0.1:{port}\""))
        + "\nmetrics_interval = \"200ms\"";
    let setup = Setup::with_runtime(&runtime, FAIL_ON_REQUEST, TWO_FAST_ATTEMPTS);
    let db = TestDb::migrated().await.unwrap();
    let child = setup.run(&db);
    wait_registered(&db).await;
    enqueue(&db, 40, 10).await;

    // Scraped while the drain runs: every scrape answers, and the counters only go up.
    let mut last_succeeded = 0.0;
    let mut scrapes = 0;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let text = scrape(port).await.expect("/metrics answers during the drain");
        let succeeded = sample(&text, SUCCEEDED).unwrap_or(0.0);
        assert!(succeeded >= last_succeeded, "a counter went down: {last_succeeded} then {succeeded}");
        (last_succeeded, scrapes) = (succeeded, scrapes + 1);
        let archived = db.count("SELECT 1 FROM pgmq.a_default").await.unwrap();
        let dead = db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap();
        if archived == 40 && dead == 10 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the drain did not end: {archived} archived, {dead} dead");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(scrapes > 1, "scraped during the drain, not only after it");

    // At the end, this process's counters are the database's counts, and the gauges, read once
    // per interval, show what lockgate.queue_stats shows.
    let text = wait_for("the counters and gauges to match the database", WAIT, || async {
        let text = scrape(port).await;
        Ok(text.filter(|t| {
            sample(t, SUCCEEDED) == Some(40.0)
                && sample(t, "lockgate_queue_jobs{queue=\"default\",state=\"dead\"}") == Some(10.0)
        }))
    })
    .await
    .unwrap();
    assert_eq!(sample(&text, DEAD_LETTERED), Some(10.0), "{text}");
    assert_eq!(sample(&text, RETRIED), Some(10.0), "each failing job retried once: {text}");
    let stats = lockgate::sql::queue_stats(&db.pool).await.unwrap();
    let default = stats.iter().find(|s| s.queue == "default").unwrap();
    for (state, n) in [("ready", default.ready), ("scheduled", default.scheduled), ("running", default.running)] {
        let series = format!("lockgate_queue_jobs{{queue=\"default\",state=\"{state}\"}}");
        assert_eq!(sample(&text, &series), Some(n as f64), "{series}: {text}");
    }
    assert_eq!(sample(&text, "lockgate_processes{kind=\"supervisor\"}"), Some(1.0), "{text}");
    let runs = "lockgate_job_duration_seconds_count{job_type=\"task\"}";
    assert_eq!(sample(&text, runs), Some(60.0), "40 runs that succeeded, 2 × 10 that failed: {text}");
    let first_starts = "lockgate_job_start_latency_seconds_count{job_type=\"task\"}";
    assert_eq!(sample(&text, first_starts), Some(50.0), "one per message's first delivery: {text}");
    stop(child).await;
}

#[tokio::test]
async fn json_logs_carry_the_job_id_type_queue_and_attempt_of_each_job_event() {
    let setup = Setup::with_runtime(DEFAULT_RUNTIME, FAIL_ON_REQUEST, TWO_FAST_ATTEMPTS);
    let db = TestDb::migrated().await.unwrap();
    let log = setup.dir.join("stderr.log");
    let child = setup.run_with(&db, &["--log-format", "json"], Stdio::from(std::fs::File::create(&log).unwrap()));
    wait_registered(&db).await;
    enqueue(&db, 1, 1).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 1, WAIT).await.unwrap();
    stop(child).await;

    let text = std::fs::read_to_string(&log).unwrap();
    let events: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    let find = |message: &str| {
        events.iter().find(|e| e["message"] == message).unwrap_or_else(|| panic!("no {message:?} in {text}")).clone()
    };
    // Logged by the completer, outside the job's span: the fields are the event's own.
    let succeeded = find("job succeeded");
    assert!(succeeded["job_id"].as_i64().is_some_and(|id| id > 0), "{succeeded}");
    assert_eq!(
        (&succeeded["job_type"], &succeeded["queue"], &succeeded["attempt"]),
        (&"task".into(), &"default".into(), &1.into())
    );
    assert!(succeeded["duration_ms"].as_f64().is_some(), "a completion logs its duration: {succeeded}");
    // Logged inside the job's span: its fields are the span's.
    let retrying = find("attempt failed; retrying");
    let span = &retrying["span"];
    assert!(span["job_id"].as_i64().is_some_and(|id| id > 0), "{retrying}");
    assert_eq!((&span["job_type"], &span["queue"], &span["attempt"]), (&"task".into(), &"default".into(), &1.into()));
    assert!(retrying["duration_ms"].as_f64().is_some(), "{retrying}");
    let pool = find("pool started");
    assert_eq!((&pool["queues"], &pool["concurrency"]), (&"default".into(), &2.into()), "{pool}");
}

/// The descriptors `lockgate run` holds (its sockets, pipes and files).
fn open_descriptors(child: &Child) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", child.id())).unwrap().count()
}

/// A peer that opens many connections to the health port and sends half a request, or nothing,
/// takes no more of the process's descriptors than the server's connection cap, keeps no probe
/// from being answered, and holds up no shutdown: `TERM` ends the process while they are still
/// open. Before, 20,000 idle connections
/// took every descriptor (every job then failed: "Too many open files"), and one half-sent
/// request kept the process from exiting until its peer closed it (review helper-140 F12, F3).
#[tokio::test]
async fn a_peer_holding_health_connections_open_takes_no_descriptors_past_the_cap_nor_the_shutdown() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let runtime = DEFAULT_RUNTIME.replace("health_listen = \"off\"", &format!("health_listen = \"127.0.0.1:{port}\""));
    let setup = Setup::with_runtime(&runtime, "true", "");
    let db = TestDb::migrated().await.unwrap();
    let mut child = setup.run(&db);
    wait_registered(&db).await;
    let before = open_descriptors(&child);
    // Opened at once; those beyond the server's cap may wait in the kernel's queue, and are
    // given up after a second.
    let mut opening = tokio::task::JoinSet::new();
    for n in 0..200 {
        opening.spawn(async move {
            let second = std::time::Duration::from_secs(1);
            let mut conn =
                tokio::time::timeout(second, tokio::net::TcpStream::connect(("127.0.0.1", port))).await.ok()?.ok()?;
            if n % 2 == 0 {
                tokio::io::AsyncWriteExt::write_all(&mut conn, b"GET /livez HTTP/1.1\r\nHost: x\r\n").await.ok()?;
            }
            Some(conn)
        });
    }
    let held: Vec<_> = opening.join_all().await.into_iter().flatten().collect();
    assert!(held.len() >= 64, "only {} connections opened", held.len());
    // Absence over a while: the server has taken what it will.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let during = open_descriptors(&child);
    assert!(during <= before + 64 + 4, "{before} descriptors before, {during} with 200 connections held");
    // A probe is answered meanwhile: a connection that sends no request within a second gives
    // its slot back (review helper-142 F6: with every slot held for 10 s, no probe was).
    let http = reqwest::Client::builder().timeout(std::time::Duration::from_secs(2)).build().unwrap();
    let probed = wait_for("a probe to be answered", std::time::Duration::from_secs(6), || async {
        Ok(http.get(format!("http://127.0.0.1:{port}/livez")).send().await.ok().map(|r| r.status()))
    })
    .await
    .unwrap();
    assert_eq!(probed, 200);
    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success(), "the process exits 0 after TERM, connections held");
    drop(held);
}

/// While `lockgate run` waits for a database that refuses connections at its start, its health
/// endpoints answer: `/livez` 200, `/readyz` 503 saying it is booting; TERM then ends the wait
/// (exit 0). Before, both refused connections until the database answered (review helper-140
/// F11): an orchestrator's liveness probe restarted the process in a loop while it waited, as
/// designed, for the database.
#[tokio::test]
async fn the_health_endpoints_answer_while_run_waits_for_the_database() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let runtime = DEFAULT_RUNTIME.replace("health_listen = \"off\"", &format!("health_listen = \"127.0.0.1:{port}\""));
    let setup = Setup::with_runtime(&runtime, "true", "");
    let db = TestDb::migrated().await.unwrap();
    let mut run = lockgate(&db, &["run", "--config", setup.config.to_str().unwrap()]);
    run.env("DATABASE_URL", format!("postgres://postgres@127.0.0.1:{nobody}/lockgate"));
    let mut child = setup.start(run, Stdio::null());
    // Each request given up after a second: a port bound but not served never answers.
    let http = reqwest::Client::builder().timeout(std::time::Duration::from_secs(1)).build().unwrap();
    let livez = wait_for("/livez to answer", WAIT, || async {
        Ok(http.get(format!("http://127.0.0.1:{port}/livez")).send().await.ok().map(|r| r.status()))
    })
    .await
    .unwrap();
    assert_eq!(livez, 200);
    let readyz = http.get(format!("http://127.0.0.1:{port}/readyz")).send().await.unwrap();
    assert_eq!(readyz.status(), 503);
    assert!(readyz.text().await.unwrap().contains("booting"));
    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success(), "TERM ends the wait for the database");
}
