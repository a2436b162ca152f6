//! Processes that survive the real world, with the real binary: pruning a live worker that was
//! frozen (seed 000), TERM with a job that outlives `shutdown_timeout`, twenty times (seed 002),
//! TERM returning a command job only once every process it started has ended (H30), a partitioned
//! process killing its command's whole group before its lease can expire (H27),
//! kill -9 and pruning, backends terminated mid-run, a killed LISTEN connection, a process
//! whose row was deleted under it, health endpoints, and a PostgreSQL restart (run alone).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::{Child, Stdio};
use std::time::Duration;

use common::*;
use lockgate_testkit::{wait_for, wait_for_count, FaultProxy, TestDb};

/// Fast process heartbeats and pruning, for tests that exercise the registry.
const REGISTRY_RUNTIME: &str = "visibility_timeout = \"3s\"\nheartbeat_interval = \"300ms\"\n\
    shutdown_timeout = \"300ms\"\npoll_interval = \"200ms\"\nhealth_listen = \"off\"\n\
    process_heartbeat_interval = \"200ms\"\nalive_threshold = \"1s\"\nsweep_interval = \"200ms\"";

async fn supervisors(db: &TestDb) -> Vec<(i64, i32)> {
    sqlx::query_as("SELECT id, pid FROM lockgate.processes WHERE kind = 'supervisor' ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

async fn wait_registered(db: &TestDb, child: &Child) -> i64 {
    let pid = child.id() as i32;
    wait_for("the process to register", WAIT, || async {
        Ok(supervisors(db).await.into_iter().find(|(_, p)| *p == pid).map(|(id, _)| id))
    })
    .await
    .unwrap()
}

async fn stop(mut child: Child) {
    signal(&child, "TERM");
    let status = wait_exit(&mut child).await;
    assert!(status.success(), "graceful exit, got {status}");
}

async fn invariants(db: &TestDb) {
    lockgate::sql::sweep(&db.pool, 100, None).await.unwrap();
    let violations = lockgate::sql::check_invariants(&db.pool).await.unwrap();
    assert!(violations.is_empty(), "{violations:?}");
}

#[tokio::test]
async fn h01_seed_000_a_frozen_worker_pruned_as_dead_finishes_late_and_changes_nothing() {
    // The first start runs 3 s (in a child that keeps running while its parent is frozen).
    let script = "cat >/dev/null; echo start >> $DIR/starts; \
        if [ ! -f $DIR/first ]; then touch $DIR/first; sleep 3; fi";
    let setup = Setup::with_runtime(REGISTRY_RUNTIME, script, "concurrency = { limit = 1 }");
    let db = migrated_with_one_job(&setup).await;
    let o = output(&db, &["enqueue", "task", "{\"n\": 2}"]);
    assert!(text(&o).contains("parked"), "{}", text(&o));

    let frozen = setup.run(&db);
    let frozen_id = wait_registered(&db, &frozen).await;
    setup.wait_starts(1).await;
    signal(&frozen, "STOP"); // its heartbeats stop; its job's child keeps running
    let other = setup.run(&db);
    wait_for("the frozen process to be pruned", WAIT, || async {
        Ok((!supervisors(&db).await.iter().any(|(id, _)| *id == frozen_id)).then_some(()))
    })
    .await
    .unwrap();
    // Pruning leaves its job alone: it runs again only once its budget ran out (the process is
    // frozen, so nothing renews it), and the parked one is promoted only when that delivery's
    // completion releases the permit.
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 2, WAIT).await.unwrap();
    signal(&frozen, "CONT");
    // The late finisher's completion is fenced; it finds itself pruned and registers again.
    wait_for("the thawed process to register again", WAIT, || async {
        Ok(supervisors(&db).await.iter().any(|(_, pid)| *pid == frozen.id() as i32).then_some(()))
    })
    .await
    .unwrap();
    stop(frozen).await;
    stop(other).await;
    assert_eq!(db.count("SELECT 1 FROM pgmq.a_default").await.unwrap(), 2, "each job archived once");
    assert_eq!(setup.starts(), 3);
    let value: i32 = sqlx::query_scalar("SELECT value FROM lockgate.semaphores").fetch_one(&db.pool).await.unwrap();
    assert_eq!(value, 0, "no permit returned twice or left behind");
    assert_eq!(db.count("SELECT 1 FROM lockgate.processes").await.unwrap(), 0, "both deregistered");
    invariants(&db).await;
}

#[tokio::test]
async fn h03_seed_002_term_with_a_job_outliving_shutdown_timeout_returns_it_twenty_times_in_a_row() {
    // Seed 002 is about the return itself: no cap on free returns here (tests/control.rs has it).
    let setup = Setup::with_runtime(
        &format!("{REGISTRY_RUNTIME}\nmax_shutdown_returns = 1000"),
        "cat >/dev/null; echo start >> $DIR/starts; exec sleep 30",
        "concurrency = { limit = 1 }",
    );
    let db = migrated_with_one_job(&setup).await;
    for round in 1..=20 {
        let mut child = setup.run(&db);
        setup.wait_starts(round).await;
        signal(&child, "TERM");
        let status = wait_exit(&mut child).await;
        assert!(status.success(), "round {round}: exit {status}");
        let (ready, returns): (bool, i32) =
            sqlx::query_as("SELECT vt <= now(), (headers->>'returns')::int FROM pgmq.q_default")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert!(ready, "round {round}: the job is back in its queue, ready");
        assert_eq!(returns, round as i32, "round {round}: every return counted, none as an attempt");
        assert_eq!(db.count("SELECT 1 FROM lockgate.leases").await.unwrap(), 1, "round {round}: the permit is kept");
        assert_eq!(
            db.count("SELECT 1 FROM lockgate.processes").await.unwrap(),
            0,
            "round {round}: no process row left"
        );
        assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0, "round {round}: nothing failed");
    }
    invariants(&db).await;
}

/// Whether `pid` is a live process (not a zombie awaiting its reaper).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()) != Some("Z"))
}

/// The first run starts a child and a grandchild (each records its pid, as does the script) and
/// waits for them; every run first records which processes of an earlier run are still alive.
const FORKING_FIRST_RUN: &str = "cat >/dev/null; \
    for p in $(cat $DIR/pids 2>/dev/null); do \
      if [ -r /proc/$p/stat ] && [ \"$(cut -d' ' -f3 /proc/$p/stat)\" != Z ]; then echo $p >> $DIR/alive_at_start; fi; \
    done; \
    echo start >> $DIR/starts; \
    if [ ! -f $DIR/first ]; then touch $DIR/first; \
      sleep 30 & echo $! >> $DIR/pids; \
      ( sh -c 'echo $$ >> $DIR/pids; exec sleep 30'; true ) & echo $! >> $DIR/pids; \
      echo $$ >> $DIR/pids; wait; \
    fi";

/// The pids the first run of `FORKING_FIRST_RUN` recorded, once all four are there.
async fn first_run_pids(setup: &Setup) -> Vec<u32> {
    wait_for("the first run's four processes", WAIT, || async {
        let pids: Vec<u32> = std::fs::read_to_string(setup.dir.join("pids"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        Ok((pids.len() == 4).then_some(pids))
    })
    .await
    .unwrap()
}

/// What the later runs found still alive of the first one when they started.
fn alive_at_next_start(setup: &Setup) -> String {
    std::fs::read_to_string(setup.dir.join("alive_at_start")).unwrap_or_default()
}

#[tokio::test]
async fn h30_term_returns_a_command_job_only_after_every_process_it_started_has_ended() {
    let setup = Setup::with_runtime(REGISTRY_RUNTIME, FORKING_FIRST_RUN, "concurrency = { limit = 1 }");
    let db = migrated_with_one_job(&setup).await;
    let mut first = setup.run(&db);
    wait_registered(&db, &first).await;
    setup.wait_starts(1).await;
    let pids = first_run_pids(&setup).await;
    // A second process waits on the same queue: it is woken the moment the job is returned.
    let second = setup.run(&db);
    wait_registered(&db, &second).await;
    signal(&first, "TERM");
    let status = wait_exit(&mut first).await;
    assert!(status.success(), "graceful exit, got {status}");
    let survivors: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(survivors.is_empty(), "processes of the returned run still alive after exit: {survivors:?}");
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    stop(second).await;
    assert_eq!(setup.starts(), 2, "returned once, run again once");
    let overlapping = alive_at_next_start(&setup);
    assert!(overlapping.is_empty(), "the next run started while these old processes were alive: {overlapping}");
    invariants(&db).await;
}

#[tokio::test]
async fn h27_a_partitioned_process_kills_its_commands_whole_group_before_its_lease_can_expire() {
    let runtime = format!("{DEFAULT_RUNTIME}\nsweep_interval = \"200ms\"");
    let setup = Setup::with_runtime(&runtime, FORKING_FIRST_RUN, "concurrency = { limit = 1 }");
    let db = migrated_with_one_job(&setup).await;
    // The first process reaches the database only through a proxy.
    let proxy = FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    let mut partitioned = lockgate(&db, &["run", "--config", setup.config.to_str().unwrap()])
        .env("DATABASE_URL", proxy.url_for(&db.url))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    setup.wait_starts(1).await;
    let pids = first_run_pids(&setup).await;
    // Partition it mid-job; a second process, connected directly, waits for the job.
    proxy.freeze();
    let other = setup.run(&db);
    wait_registered(&db, &other).await;
    // The job comes back to the second process once the first one's lease is over; by then the
    // first process has killed its command's whole group, on its own clock.
    setup.wait_starts(2).await;
    let overlapping = alive_at_next_start(&setup);
    assert!(overlapping.is_empty(), "the next run started while these old processes were alive: {overlapping}");
    assert!(pids.iter().all(|p| !alive(*p)), "every process of the partitioned run has ended");
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    proxy.thaw();
    signal(&partitioned, "TERM");
    assert!(wait_exit(&mut partitioned).await.success());
    stop(other).await;
    assert_eq!(setup.starts(), 2);
    invariants(&db).await;
}

#[tokio::test]
async fn h17_kill_9_worker_is_pruned_and_its_job_runs_again_once_its_budget_ends() {
    let setup = Setup::with_runtime(REGISTRY_RUNTIME, LONG_FIRST_RUN, "");
    let db = migrated_with_one_job(&setup).await;
    let mut victim = setup.run(&db);
    let victim_id = wait_registered(&db, &victim).await;
    setup.wait_starts(1).await;
    victim.kill().unwrap();
    victim.wait().unwrap();
    let other = setup.run(&db);
    wait_for("the dead process to be pruned", WAIT, || async {
        Ok((!supervisors(&db).await.iter().any(|(id, _)| *id == victim_id)).then_some(()))
    })
    .await
    .unwrap();
    // Pruned after 1 s of silence, while its job's 3 s budget still runs: a prune cannot tell a
    // dead process from a partitioned one, so it hands nothing over (H26). The job comes back
    // when its visibility lapses.
    assert_eq!(setup.starts(), 1, "not run again while the first delivery's budget lasts");
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    stop(other).await;
    assert_eq!(setup.starts(), 2);
}

#[tokio::test]
async fn h19_a_backend_terminated_while_the_process_starts_up_is_retried_not_fatal() {
    use sqlx::Connection;
    let setup = Setup::with_runtime(REGISTRY_RUNTIME, "cat >/dev/null", "");
    let db = TestDb::migrated().await.unwrap();
    // Start-up defines the job types: hold that table so the process waits there.
    let mut blocker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query("LOCK TABLE lockgate.job_types IN ACCESS EXCLUSIVE MODE").execute(&mut blocker).await.unwrap();
    let child = setup.run(&db);
    let waiting = "SELECT count(*) FROM pg_stat_activity
                    WHERE datname = current_database() AND application_name = 'lockgate' AND wait_event_type = 'Lock'";
    wait_for_count(&db.pool, waiting, 1, WAIT).await.unwrap();
    let killed = lockgate_testkit::chaos::terminate_backends_named(&db.pool, "lockgate").await.unwrap();
    assert!(killed >= 1);
    sqlx::query("COMMIT").execute(&mut blocker).await.unwrap();
    wait_registered(&db, &child).await;
    let o = output(&db, &["enqueue", "task", "{}"]);
    assert!(o.status.success(), "{}", text(&o));
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    stop(child).await;
}

#[tokio::test]
async fn h32_kill_9_counts_the_runs_that_started_and_not_the_jobs_claimed_ahead() {
    // Job 1 succeeds at once; the other first starts run long, later ones succeed at once. One
    // attempt each.
    let script = "args=$(cat); echo start >> $DIR/starts; \
        case \"$args\" in *'\"n\":1}'*|*'\"n\": 1}'*) exit 0;; esac; \
        if [ $(wc -l < $DIR/starts) -le 3 ]; then exec sleep 30; fi";
    let setup = Setup::with_runtime(REGISTRY_RUNTIME, script, "max_attempts = 1");
    let db = migrated_with_one_job(&setup).await;
    for n in 2..=4 {
        let o = output(&db, &["enqueue", "task", &format!("{{\"n\": {n}}}")]);
        assert!(o.status.success(), "{}", text(&o));
    }
    let mut victim = setup.run(&db);
    // One claim of four: two start at once (concurrency 2), two are claimed ahead. The first
    // job finishes at once and the third starts in its slot: its start is recorded, so only the
    // fourth, still waiting in memory, has no start time.
    setup.wait_starts(3).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.q_default WHERE read_ct = 1", 3, WAIT).await.unwrap();
    let waiting = "SELECT count(*) FROM pgmq.q_default WHERE read_ct = 1 AND last_read_at IS NULL";
    wait_for_count(&db.pool, waiting, 1, WAIT).await.unwrap();
    victim.kill().unwrap();
    victim.wait().unwrap();
    let other = setup.run(&db);
    // The two that were running used their one attempt; the one that never started runs now.
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 2, WAIT).await.unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 2, WAIT).await.unwrap();
    stop(other).await;
    assert_eq!(setup.starts(), 4, "each job started once");
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM lockgate.dead_letters").fetch_all(&db.pool).await.unwrap();
    assert!(reasons.iter().all(|r| r == "attempts_exhausted"), "{reasons:?}");
}

#[tokio::test]
async fn a_process_whose_row_was_deleted_registers_again_and_claims_under_its_new_id() {
    let setup = Setup::with_runtime(REGISTRY_RUNTIME, "cat >/dev/null; echo start >> $DIR/starts", "");
    let db = TestDb::migrated().await.unwrap();
    let child = setup.run(&db);
    let old_id = wait_registered(&db, &child).await;
    sqlx::query("DELETE FROM lockgate.processes").execute(&db.pool).await.unwrap();
    let new_id = wait_registered(&db, &child).await;
    assert_ne!(old_id, new_id);
    let o = output(&db, &["enqueue", "task", "{}"]);
    assert!(o.status.success(), "{}", text(&o));
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    let owner: String =
        sqlx::query_scalar("SELECT headers->>'owner' FROM pgmq.a_default").fetch_one(&db.pool).await.unwrap();
    assert_eq!(owner, new_id.to_string(), "claims carry the new registration");
    let status = text(&output(&db, &["status"]));
    assert!(status.contains("supervisor") && status.contains(&child.id().to_string()), "{status}");
    stop(child).await;
}

#[tokio::test]
async fn h19_backends_terminated_repeatedly_during_two_thousand_jobs_lose_nothing() {
    let setup = Setup::with_runtime(DEFAULT_RUNTIME, "true", "");
    let db = TestDb::migrated().await.unwrap();
    let child = setup.run(&db);
    wait_registered(&db, &child).await;
    sqlx::query("SELECT count(*) FROM lockgate.enqueue_many('task', ARRAY(SELECT jsonb_build_object('n', g) FROM generate_series(1, 2000) g))")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut kills = 0;
    while kills < 5 {
        let done = db.count("SELECT 1 FROM pgmq.a_default").await.unwrap();
        if done >= 2000 {
            break;
        }
        if done >= 200 * (kills + 1) {
            let n = lockgate_testkit::chaos::terminate_backends_named(&db.pool, "lockgate").await.unwrap();
            assert!(n > 0, "there were lockgate backends to terminate");
            kills += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 2000, Duration::from_secs(120)).await.unwrap();
    stop(child).await;
    assert!(kills >= 3, "the run outlived only {kills} rounds of terminations");
    assert_eq!(
        db.count("SELECT DISTINCT COALESCE((headers->>'job_id')::bigint, msg_id) FROM pgmq.a_default").await.unwrap(),
        2000,
        "each job archived once"
    );
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 0);
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0, "nothing dead-lettered for it");
}

#[tokio::test]
async fn h20_a_killed_listen_connection_comes_back_and_wakeups_resume() {
    // Polling every 60 s: a job that starts promptly was woken by a notification.
    let runtime =
        "visibility_timeout = \"30s\"\nheartbeat_interval = \"1s\"\npoll_interval = \"60s\"\nhealth_listen = \"off\"";
    let setup = Setup::with_runtime(runtime, "cat >/dev/null; echo start >> $DIR/starts", "");
    let db = TestDb::migrated().await.unwrap();
    let child = setup.run(&db);
    wait_registered(&db, &child).await;
    let listeners = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()
                       AND application_name = 'lockgate' AND query LIKE 'LISTEN%'";
    let first: i32 = wait_for("the LISTEN connection", WAIT, || async {
        Ok(sqlx::query_scalar(listeners).fetch_optional(&db.pool).await?)
    })
    .await
    .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)").bind(first).execute(&db.pool).await.unwrap();
    wait_for("a new LISTEN connection", WAIT, || async {
        let pid: Option<i32> = sqlx::query_scalar(listeners).fetch_optional(&db.pool).await?;
        Ok(pid.filter(|p| *p != first))
    })
    .await
    .unwrap();
    let o = output(&db, &["enqueue", "task", "{}"]);
    assert!(o.status.success());
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, Duration::from_secs(10)).await.unwrap();
    stop(child).await;
}

#[tokio::test]
async fn health_endpoints_report_live_and_ready() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let runtime = format!("{DEFAULT_RUNTIME}\n")
        .replace("health_listen = \"off\"", &format!("health_listen = \"127.0.0.1:{port}\""));
    let setup = Setup::with_runtime(&runtime, "true", "");
    let db = TestDb::migrated().await.unwrap();
    let child = setup.run(&db);
    wait_registered(&db, &child).await;
    let ready = wait_for("/readyz to answer 200", WAIT, || async {
        let response = reqwest::get(format!("http://127.0.0.1:{port}/readyz")).await;
        Ok(match response {
            Ok(r) if r.status() == 200 => Some(r.text().await?),
            _ => None,
        })
    })
    .await
    .unwrap();
    assert!(ready.contains("\"ready\":true"), "{ready}");
    let live = reqwest::get(format!("http://127.0.0.1:{port}/livez")).await.unwrap();
    assert_eq!(live.status(), 200);
    stop(child).await;
}

#[tokio::test]
async fn a_configured_health_address_that_cannot_be_bound_fails_the_start_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let runtime = DEFAULT_RUNTIME.replace("health_listen = \"off\"", &format!("health_listen = \"127.0.0.1:{port}\""));
    let setup = Setup::with_runtime(&runtime, "true", "");
    let db = TestDb::migrated().await.unwrap();
    let mut child = setup.run_with(&db, &[], Stdio::piped());
    let status = tokio::time::timeout(WAIT, wait_exit(&mut child)).await.expect("lockgate run did not exit");
    assert_eq!(status.code(), Some(1));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(
        stderr.contains(&format!("cannot serve the health endpoints on health_listen 127.0.0.1:{port}")),
        "{stderr}"
    );
    assert_eq!(db.count("SELECT 1 FROM lockgate.processes").await.unwrap(), 0, "nothing was registered");
}

/// A process whose configured type sits on a queue none of its pools serves, or that serves a
/// queue holding a type it has no handler for, says so when it starts (review helper-81: such a
/// process silently failed the other type's jobs, "no handler").
#[tokio::test]
async fn run_warns_of_types_on_unserved_queues_and_of_served_queues_holding_foreign_types() {
    let setup = Setup::with_runtime(DEFAULT_RUNTIME, "true", "queue = \"side\"");
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('stranger')").execute(&db.pool).await.unwrap();
    let mut child = setup.run_with(&db, &[], Stdio::piped());
    wait_registered(&db, &child).await;
    signal(&child, "TERM");
    let status = wait_exit(&mut child).await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    let unserved = stderr.lines().find(|l| l.contains("no pool of this process serves the queue"));
    assert!(unserved.is_some_and(|l| l.contains("job_type=task") && l.contains("queue=side")), "{stderr}");
    let foreign = stderr.lines().find(|l| l.contains("has no handler for"));
    assert!(foreign.is_some_and(|l| l.contains("job_type=stranger") && l.contains("queue=default")), "{stderr}");
}

/// Review helper-84, F3: as PID 1 (a container without an init), the processes a program leaves
/// behind become lockgate's to reap once killed, and lockgate reaps only its own children; it
/// says so at start. Needs a PID namespace (`unshare`, as root, as the suite runs here).
#[tokio::test]
async fn command_types_as_pid_1_are_warned_of_the_zombies_they_would_leave() {
    let setup = Setup::with_runtime(DEFAULT_RUNTIME, "true", "");
    let db = TestDb::migrated().await.unwrap();
    let o = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", env!("CARGO_BIN_EXE_lockgate")])
        .args(["define", "--config", setup.config.to_str().unwrap()])
        .env("DATABASE_URL", &db.url)
        .output()
        .expect("unshare runs");
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("lockgate runs as PID 1"), "{}", text(&o));
    // Not as any other pid.
    let o = output(&db, &["define", "--config", setup.config.to_str().unwrap()]);
    assert!(o.status.success() && !text(&o).contains("PID 1"), "{}", text(&o));
}

/// Restarts the shared PostgreSQL server: run alone (`scripts/test` runs it after the suite).
#[tokio::test]
#[ignore = "restarts the shared PostgreSQL server; run alone with --ignored"]
async fn h19_postgres_restarted_during_a_run_loses_nothing() {
    let setup = Setup::with_runtime(DEFAULT_RUNTIME, "true", "");
    let db = TestDb::migrated().await.unwrap();
    let child = setup.run(&db);
    wait_registered(&db, &child).await;
    sqlx::query("SELECT count(*) FROM lockgate.enqueue_many('task', ARRAY(SELECT jsonb_build_object('n', g) FROM generate_series(1, 1000) g))")
        .execute(&db.pool)
        .await
        .unwrap();
    wait_for("some jobs done", WAIT, || async {
        db.count("SELECT 1 FROM pgmq.a_default").await.map(|n| (n >= 100).then_some(()))
    })
    .await
    .unwrap();
    lockgate_testkit::chaos::restart_postgres().unwrap();
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1000, Duration::from_secs(120)).await.unwrap();
    stop(child).await;
    assert_eq!(
        db.count("SELECT DISTINCT COALESCE((headers->>'job_id')::bigint, msg_id) FROM pgmq.a_default").await.unwrap(),
        1000
    );
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0);
}
