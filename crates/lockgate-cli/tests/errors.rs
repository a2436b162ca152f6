//! Errors a person can act on, and the CLI of a team without Rust (issue 13, in part): an
//! unreachable server or a missing database named with its cause and what to do, each cause
//! printed once; `dlq` verbs that refuse what does not exist; `define --config`; arguments from
//! stdin or a file; `run` refusing executors that cannot work, naming the job type.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::Write;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use lockgate_testkit::{wait_for_count, TestDb};
use sqlx::Connection as _;

/// A local port nothing listens on (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn with_input(db: &TestDb, args: &[&str], input: &[u8]) -> Output {
    let mut child =
        lockgate(db, args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

#[tokio::test]
async fn a_wrong_port_is_reported_as_connection_refused_within_seconds() {
    let db = TestDb::migrated().await.unwrap();
    let port = free_port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/lockgate");
    let started = Instant::now();
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", &url).output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(6), "took {:?}: {}", started.elapsed(), text(&o));
    assert!(!o.status.success());
    let expected = format!(
        "could not connect to 127.0.0.1:{port}/lockgate: connection refused (is PostgreSQL running on 127.0.0.1:{port}?)"
    );
    assert!(text(&o).contains(&expected), "{}", text(&o));
}

/// Review (helper-77): another database's URL was read as PostgreSQL's, and failed later with
/// whatever that server answered.
#[tokio::test]
async fn a_url_of_another_scheme_is_refused_naming_it() {
    let db = TestDb::migrated().await.unwrap();
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", "mysql://root@127.0.0.1/app").output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("its scheme is mysql; lockgate needs postgres:// or postgresql://"), "{}", text(&o));
    // A value the driver refuses is named once, with what it may be, and the address without
    // its password (review helper-92: "(unparseable URL): error with configuration: error with
    // configuration: unknown value").
    let bad = "postgres://app:secret@127.0.0.1/app?sslmode=bogus";
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", bad).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(
        text(&o).trim(),
        "error: invalid database URL 127.0.0.1:5432/app: sslmode \"bogus\": one of disable, allow, prefer, require, \
         verify-ca, verify-full"
    );
    // A parameter the driver does not read is refused: the driver warned of a misspelt sslmode
    // and connected in plain text (review helper-92).
    for (url, said) in [
        ("postgres://app:secret@127.0.0.1/app?sslmod=require", "unknown parameter \"sslmod\"; did you mean sslmode?"),
        (
            "postgres://app@127.0.0.1/app?sslmode=require&connect_timeout=10",
            "connect_timeout is a libpq parameter that lockgate's driver (sqlx) does not support; remove it",
        ),
        ("postgres://app@127.0.0.1/app?colour=blue", "unknown parameter \"colour\"; lockgate reads sslmode, ssl-mode,"),
    ] {
        let o = lockgate(&db, &["status"]).env("DATABASE_URL", url).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains("error: invalid database URL 127.0.0.1:5432/app: "), "{}", text(&o));
        assert!(text(&o).contains(said), "{url}: {}", text(&o));
        assert!(!text(&o).contains("secret"), "{}", text(&o));
    }
    // The parameters it reads are taken, in either spelling.
    let url =
        format!("{}{}application_name=mine&ssl-mode=disable", db.url, if db.url.contains('?') { '&' } else { '?' });
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", &url).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

#[tokio::test]
async fn a_server_that_never_answers_is_reported_after_the_connect_timeout() {
    let db = TestDb::migrated().await.unwrap();
    // Accepts connections and never says a word.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/lockgate");
    let started = Instant::now();
    let o = lockgate(&db, &["--connect-timeout", "1s", "status"]).env("DATABASE_URL", &url).output().unwrap();
    let took = started.elapsed();
    assert!(!o.status.success() && text(&o).contains("no answer within 1s"), "{}", text(&o));
    assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(4), "took {took:?}");
    let o =
        lockgate(&db, &["status"]).env("DATABASE_URL", &url).env("LOCKGATE_CONNECT_TIMEOUT", "500ms").output().unwrap();
    assert!(text(&o).contains("no answer within 500ms"), "{}", text(&o));
    drop(listener);
}

#[tokio::test]
async fn a_missing_database_is_named_once_with_the_command_that_creates_it() {
    let db = TestDb::migrated().await.unwrap();
    let name = format!("{}_missing", db.name);
    let url = format!("{}/{name}", lockgate_testkit::server_url().rsplit_once('/').unwrap().0);
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", &url).output().unwrap();
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert_eq!(out.matches("does not exist").count(), 1, "the cause, once: {out}");
    assert!(out.contains(&format!("database \"{name}\" does not exist")), "{out}");
    assert!(out.contains("`lockgate migrate --create-database`"), "{out}");
    assert_eq!(out.lines().count(), 1, "one message: {out}");

    let created = lockgate(&db, &["migrate", "--create-database"]).env("DATABASE_URL", &url).output().unwrap();
    let status = lockgate(&db, &["status"]).env("DATABASE_URL", &url).output().unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&db.pool).await.unwrap();
    assert!(created.status.success(), "{}", text(&created));
    assert!(status.status.success(), "{}", text(&status));
}

/// Three `migrate --create-database` started at once for one missing database all succeed:
/// those whose CREATE DATABASE met another's under way carry on with the database it made.
/// Before, two of three failed on the catalog's unique index (review helper-99).
#[tokio::test]
async fn migrates_creating_one_database_at_once_all_succeed() {
    let db = TestDb::migrated().await.unwrap();
    let name = format!("{}_together", db.name);
    let url = format!("{}/{name}", lockgate_testkit::server_url().rsplit_once('/').unwrap().0);
    let runs: Vec<_> = (0..3)
        .map(|_| {
            lockgate(&db, &["migrate", "--create-database"])
                .env("DATABASE_URL", &url)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = runs.into_iter().map(|r| r.wait_with_output().unwrap()).collect();
    sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&db.pool).await.unwrap();
    for o in &outputs {
        assert!(o.status.success(), "{}", text(o));
    }
}

#[tokio::test]
async fn dlq_verbs_refuse_an_unknown_job_id_or_queue() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('mail')").execute(&db.pool).await.unwrap();
    for (args, expected) in [
        (vec!["dlq", "retry", "--job-id", "999"], "no dead letter for job 999"),
        (vec!["dlq", "purge", "--job-id", "999"], "no dead letter for job 999"),
        (vec!["dlq", "list", "--job-id", "999"], "no dead letter for job 999"),
        (vec!["dlq", "retry", "--queue", "nosuchqueue"], "queue \"nosuchqueue\" does not exist"),
        (vec!["dlq", "purge", "--queue", "nosuchqueue"], "queue \"nosuchqueue\" does not exist"),
        (vec!["dlq", "list", "--queue", "nosuchqueue"], "queue \"nosuchqueue\" does not exist"),
    ] {
        let o = output(&db, &args);
        assert!(!o.status.success() && text(&o).contains(expected), "{args:?}: {}", text(&o));
    }
    // A queue that exists but has no dead letters: nothing to do, and no error.
    let o = output(&db, &["dlq", "retry", "--queue", "default"]);
    assert!(o.status.success() && text(&o).contains("nothing to retry"), "{}", text(&o));
    let o = output(&db, &["dlq", "purge", "--all"]);
    assert!(o.status.success() && text(&o).contains("purged 0"), "{}", text(&o));
}

/// Review of the README (helper-92, F2): `dlq retry --job-id` of a dead letter kept because
/// another job holds its unique key said "retried 0 dead letter(s)" and exited 0, where `job
/// retry` of the same one exits 1. A dead letter kept is named and fails the command.
#[tokio::test]
async fn dlq_retry_of_a_dead_letter_it_keeps_exits_1() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('uq', queue => 'uqq', unique_mode => 'until_executed', unique_key => ARRAY['k']);
         SELECT lockgate.enqueue('uq', '{\"k\": 2}');
         SELECT lockgate.dead_letter('uqq', msg_id, read_ct, 'attempts_exhausted', 'boom', 1) FROM lockgate.claim('uqq', 1, 30);
         SELECT lockgate.enqueue('uq', '{\"k\": 2}');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let dead: i64 = sqlx::query_scalar("SELECT job_id FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    let o = output(&db, &["dlq", "retry", "--job-id", &dead.to_string()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("its unique key is held by job")
            && text(&o).contains("1 of 1 dead letter(s) were not retried"),
        "{}",
        text(&o)
    );
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 1, "kept");
}

/// Review helper-121 F5: `dlq retry` of a dead letter whose job type is not defined (a message
/// of an unknown type, dead-lettered as the runtime does) said "retried", and the job was
/// dead-lettered again at its first claim. It is kept and named, and both commands exit 1; once
/// the type is defined, it is retried.
#[tokio::test]
async fn dlq_retry_of_a_dead_letter_whose_type_is_not_defined_keeps_it_and_says_what_to_do() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.create_queue('default');
         SELECT pgmq.send('default', '{\"a\": 1}'::jsonb, '{\"type\": \"ghost\"}'::jsonb);
         SELECT lockgate.dead_letter('default', msg_id, read_ct, 'unknown_job_type', 'job type \"ghost\" is not defined', 1)
           FROM lockgate.claim('default', 1, 30);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let dead: i64 = sqlx::query_scalar("SELECT job_id FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    let o = output(&db, &["dlq", "retry", "--all"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("retried 0 dead letter(s)")
            && text(&o).contains("its job type is not defined")
            && text(&o).contains("1 of 1 dead letter(s) were not retried"),
        "{}",
        text(&o)
    );
    let o = output(&db, &["job", "retry", &dead.to_string()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains(&format!("job {dead} stays dead: its job type is not defined")), "{}", text(&o));
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 1, "kept");
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 0, "nothing sent");

    sqlx::query("SELECT lockgate.define_job_type('ghost')").execute(&db.pool).await.unwrap();
    let o = output(&db, &["dlq", "retry", "--all"]);
    assert!(o.status.success() && text(&o).contains("retried 1 dead letter(s)"), "{}", text(&o));
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 1);
}

#[tokio::test]
async fn enqueue_reads_arguments_from_stdin_and_from_a_file() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('resize')").execute(&db.pool).await.unwrap();
    let o = with_input(&db, &["enqueue", "resize", "-"], b"{\"image\": 7}\n");
    assert!(o.status.success() && text(&o).contains("enqueued job"), "{}", text(&o));
    let image: i64 =
        sqlx::query_scalar("SELECT (message->>'image')::bigint FROM pgmq.q_default").fetch_one(&db.pool).await.unwrap();
    assert_eq!(image, 7);

    // Far beyond what one command-line argument may hold (128 KiB on Linux), within the 1 MiB a
    // job may carry.
    let dir = std::env::temp_dir().join(format!("lockgate-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (fits, too_big) = (dir.join("fits.json"), dir.join("too_big.json"));
    std::fs::write(&fits, serde_json::json!({ "data": "x".repeat(1_000_000) }).to_string()).unwrap();
    std::fs::write(&too_big, serde_json::json!({ "data": "x".repeat(1_100_000) }).to_string()).unwrap();
    let o = output(&db, &["enqueue", "resize", &format!("@{}", fits.display())]);
    let refused = output(&db, &["enqueue", "resize", &format!("@{}", too_big.display())]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(o.status.success(), "{}", text(&o));
    let sizes: Vec<i32> =
        sqlx::query_scalar("SELECT length(message->>'data') FROM pgmq.q_default WHERE message ? 'data'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(sizes, [1_000_000]);
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(text(&refused).contains("more than the 1048576 allowed"), "{}", text(&refused));
    let o = with_input(&db, &["enqueue", "resize", "-"], b"not json");
    assert!(!o.status.success() && text(&o).contains("job arguments from stdin are not valid JSON"), "{}", text(&o));
}

#[tokio::test]
async fn define_stores_the_config_job_types_so_the_cli_can_enqueue_before_any_run() {
    let db = TestDb::migrated().await.unwrap();
    let setup = Setup::new("cat >/dev/null", "queue = \"images\"\nmax_attempts = 3");
    let config = setup.config.to_str().unwrap();
    let o = output(&db, &["enqueue", "task", "{}"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("unknown job type \"task\"") && text(&o).contains("lockgate define --config"),
        "{}",
        text(&o)
    );

    let o = output(&db, &["define", "--config", config]);
    assert!(o.status.success() && text(&o).contains("defined job type task on queue images"), "{}", text(&o));
    let max_attempts: i32 = sqlx::query_scalar("SELECT max_attempts FROM lockgate.job_types WHERE name = 'task'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(max_attempts, 3);
    let o = output(&db, &["enqueue", "task", "{}"]);
    assert!(o.status.success() && text(&o).contains("on queue images"), "{}", text(&o));
    assert_eq!(db.count("SELECT 1 FROM lockgate.processes").await.unwrap(), 0, "nothing ran");
}

#[tokio::test]
async fn a_database_error_is_printed_once() {
    let db = TestDb::migrated().await.unwrap();
    // Behind lockgate's back: the schema check passes (versions and functions), the read fails.
    sqlx::query("DROP TABLE lockgate.dead_letters CASCADE").execute(&db.pool).await.unwrap();
    let o = output(&db, &["dlq", "list"]);
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert_eq!(out.matches("relation \"lockgate.dead_letters\" does not exist").count(), 1, "{out}");
}

/// A config with one pool on `default` and the given `[job_types.*]` tables, in a scratch
/// directory removed when the returned guard drops.
struct Config {
    dir: std::path::PathBuf,
    path: String,
}

impl Config {
    fn new(job_types: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("lockgate-errors-{}-{:08x}", std::process::id(), fastrand::u32(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lockgate.toml");
        let text = format!(
            "[runtime]\n{DEFAULT_RUNTIME}\n\n[[pool]]\nqueues = [\"default\"]\nconcurrency = 1\n\n{job_types}\n"
        );
        std::fs::write(&path, text).unwrap();
        Self { path: path.to_str().unwrap().to_string(), dir }
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `lockgate run` and expects it to exit by itself within a few seconds; kills it otherwise.
async fn run_until_exit(db: &TestDb, config: &Config) -> (std::process::ExitStatus, String) {
    let mut child =
        lockgate(db, &["run", "--config", &config.path]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            let o = child.wait_with_output().unwrap();
            panic!("run did not refuse to start within 10 s: {}", text(&o));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let o = child.wait_with_output().unwrap();
    (o.status, text(&o))
}

#[tokio::test]
async fn run_refuses_executors_that_cannot_work_naming_the_job_type() {
    let db = TestDb::migrated().await.unwrap();
    let not_executable = Config::new("[job_types.plain]\ncommand = [\"$DIR/plain.sh\"]");
    let script = not_executable.dir.join("plain.sh");
    std::fs::write(&script, "#!/bin/sh\n").unwrap();
    std::fs::write(
        &not_executable.path,
        std::fs::read_to_string(&not_executable.path).unwrap().replace("$DIR", not_executable.dir.to_str().unwrap()),
    )
    .unwrap();
    for (config, expected) in [
        (
            Config::new("[job_types.resize]\ncommand = [\"lockgate-no-such-program\", \"--fast\"]"),
            "job type resize cannot run: its command \"lockgate-no-such-program\" was not found in PATH",
        ),
        (
            Config::new("[job_types.resize]\ncommand = [\"./no-such-script.sh\"]"),
            // Where it was looked for (review helper-92: not the configuration file's directory).
            "the directory lockgate runs in (a relative path is not read from the configuration file's directory",
        ),
        (not_executable, "job type plain cannot run: its command"),
        (
            Config::new("[job_types.audit]\nsql = \"INSERT INTO no_such_table (args) VALUES ($1)\""),
            "job type audit cannot run: its sql statement does not prepare: relation \"no_such_table\" does not exist",
        ),
        (
            Config::new("[job_types.hook]\nhttp = \"http//missing-colon\""),
            "job type hook cannot run: invalid http executor URL",
        ),
        // Review helper-110: each prepared, and every job of the type succeeded doing nothing
        // (the empty one) or left its session in a transaction that swallowed later jobs' writes.
        (
            Config::new("[job_types.audit]\nsql = \"-- TODO write the statement $1\""),
            "job type audit cannot run: its sql statement is empty (white space and comments only)",
        ),
        (
            Config::new("[job_types.audit]\nsql = \" begin\""),
            "job type audit cannot run: its sql statement is transaction control (BEGIN)",
        ),
    ] {
        let (status, out) = run_until_exit(&db, &config).await;
        assert!(!status.success(), "{out}");
        assert!(out.contains(expected), "expected {expected:?} in: {out}");
        // `define` refuses it too: it never stores what `run` would not start.
        let o = output(&db, &["define", "--config", &config.path]);
        assert!(o.status.code() == Some(1) && text(&o).contains(expected), "define: {}", text(&o));
    }
    assert_eq!(db.count("SELECT 1 FROM lockgate.processes").await.unwrap(), 0, "nothing started");
    assert_eq!(db.count("SELECT 1 FROM lockgate.job_types").await.unwrap(), 0, "nothing defined");
    // A table the statement names, locked by a transaction left open: the check gives up after
    // its wait and names the lock, rather than hanging with nothing said.
    sqlx::query("CREATE TABLE held (args jsonb)").execute(&db.pool).await.unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE held IN ACCESS EXCLUSIVE MODE").execute(&mut *holder).await.unwrap();
    let config = Config::new("[job_types.audit]\nsql = \"INSERT INTO held (args) VALUES ($1)\"");
    let (status, out) = run_until_exit(&db, &config).await;
    assert!(!status.success(), "{out}");
    assert!(out.contains("a table it uses stayed locked by another transaction for 5 s"), "{out}");
    holder.rollback().await.unwrap();
    // The same statement prepares once its table exists, with $1 as jsonb. Dropped behind the
    // running process's back, its error is kept once, not "…: relation … does not exist" twice.
    sqlx::query("CREATE TABLE audit (args jsonb)").execute(&db.pool).await.unwrap();
    // A second parameter is never bound: refused at start, not failed at every run (review
    // helper-82). A procedure call is taken, as the executor runs it.
    let two = Config::new("[job_types.audit]\nsql = \"INSERT INTO audit (args) VALUES ($2)\"");
    let (status, out) = run_until_exit(&db, &two).await;
    assert!(!status.success() && out.contains("has 2 parameters: only $1 is bound"), "{out}");
    sqlx::raw_sql("CREATE PROCEDURE note_it(a jsonb) LANGUAGE sql AS $$ INSERT INTO audit VALUES (a) $$")
        .execute(&db.pool)
        .await
        .unwrap();
    let call = Config::new("[job_types.noted]\nsql = \"CALL note_it($1)\"");
    let o = output(&db, &["define", "--config", &call.path]);
    assert!(o.status.success(), "a CALL is refused: {}", text(&o));
    let config = Config::new("[job_types.audit]\nsql = \"INSERT INTO audit (args) VALUES ($1)\"\nmax_attempts = 1");
    let mut child =
        lockgate(&db, &["run", "--config", &config.path]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let supervisor = "SELECT count(*) FROM lockgate.processes WHERE kind = 'supervisor'";
    let started = wait_for_count(&db.pool, supervisor, 1, WAIT).await;
    sqlx::query("DROP TABLE audit").execute(&db.pool).await.unwrap();
    let o = output(&db, &["enqueue", "audit", "{}"]);
    let dead = wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 1, WAIT).await;
    signal(&child, "TERM");
    let status = wait_exit(&mut child).await;
    started.unwrap();
    dead.unwrap();
    assert!(status.success() && o.status.success(), "{}", text(&o));
    let error: String =
        sqlx::query_scalar("SELECT error FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    assert_eq!(error.matches("relation \"audit\" does not exist").count(), 1, "{error}");
}

#[tokio::test]
async fn an_http_endpoint_that_never_answers_fails_the_attempt_after_the_executor_timeout() {
    let db = TestDb::migrated().await.unwrap();
    // Accepts connections and reads, but never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let config = Config::new(&format!(
        "[job_types.hook]\nhttp = {{ url = \"http://alice:s3cret@127.0.0.1:{port}/jobs?token=t0ken\", timeout = \"1s\" }}\nmax_attempts = 1"
    ));
    let error = one_hook_job_dead_lettered(&db, &config).await;
    silent.abort();
    assert_eq!(error, format!("no response from http://127.0.0.1:{port}/jobs within 1s"), "no credentials, no query");
}

/// Enqueues one `hook` job (one attempt), runs `config` until it is dead-lettered, and returns its
/// error.
async fn one_hook_job_dead_lettered(db: &TestDb, config: &Config) -> String {
    sqlx::query("SELECT lockgate.define_job_type('hook', max_attempts => 1)").execute(&db.pool).await.unwrap();
    let o = output(db, &["enqueue", "hook", "{}"]);
    assert!(o.status.success(), "{}", text(&o));
    let mut child =
        lockgate(db, &["run", "--config", &config.path]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let dead = wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 1, WAIT).await;
    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success());
    dead.unwrap();
    sqlx::query_scalar("SELECT error FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap()
}

/// A redirect is not followed (it would turn the POST into a GET without the job's arguments, and
/// count the job done): a 3xx fails the attempt.
#[tokio::test]
async fn an_http_redirect_fails_the_attempt_instead_of_dropping_the_body() {
    let db = TestDb::migrated().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = std::sync::Arc::clone(&requests);
    let server = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buf = vec![0u8; 8192];
            let n = socket.read(&mut buf).await.unwrap_or(0);
            let head = String::from_utf8_lossy(&buf[..n]).lines().next().unwrap_or("").to_string();
            seen.lock().unwrap().push(head.clone());
            let reply = if head.starts_with("POST") {
                "HTTP/1.1 302 Found\r\nlocation: /landing\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            } else {
                "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            };
            let _ = socket.write_all(reply.as_bytes()).await;
        }
    });
    let config = Config::new(&format!("[job_types.hook]\nhttp = \"http://127.0.0.1:{port}/jobs\"\nmax_attempts = 1"));
    let error = one_hook_job_dead_lettered(&db, &config).await;
    server.abort();
    assert!(error.starts_with("HTTP 302 Found (redirects are not followed; location: /landing)"), "{error}");
    assert_eq!(requests.lock().unwrap().len(), 1, "no GET after the redirect: {:?}", requests.lock().unwrap());
}

/// A failing response's body is read only as far as the error keeps it (its first 1 KiB): an
/// endless error page was read whole, until the request's deadline, and a large one was held in
/// memory (review helper-121 F2: 400 MiB took `lockgate run` from 20 to 840 MB).
#[tokio::test]
async fn an_http_error_page_is_read_only_as_far_as_the_error_keeps_it() {
    let db = TestDb::migrated().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let _ = socket.read(&mut buf).await;
                let head = "HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n";
                if socket.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                // An endless body, in chunks of 4 KiB, until the client hangs up.
                let chunk = format!("1000\r\n{}\r\n", "x".repeat(4096));
                while socket.write_all(chunk.as_bytes()).await.is_ok() {}
            });
        }
    });
    let config = Config::new(&format!(
        "[job_types.hook]\nhttp = {{ url = \"http://127.0.0.1:{port}/jobs\", timeout = \"20s\" }}\nmax_attempts = 1"
    ));
    let started = Instant::now();
    let error = one_hook_job_dead_lettered(&db, &config).await;
    server.abort();
    assert_eq!(error, format!("HTTP 500 Internal Server Error: {}", "x".repeat(1024)));
    assert!(started.elapsed() < Duration::from_secs(15), "the body was read until the deadline");
}

#[tokio::test]
async fn an_invalid_job_type_name_is_refused_as_such_not_suggested_for_definition() {
    let db = TestDb::migrated().await.unwrap();
    let o = output(&db, &["enqueue", "x'); DROP TABLE y; --", "{}"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("invalid job_type") && !text(&o).contains("define_job_type"), "{}", text(&o));
}

#[tokio::test]
async fn dlq_all_with_a_narrower_selection_is_a_usage_error() {
    let db = TestDb::migrated().await.unwrap();
    let o = output(&db, &["dlq", "retry", "--all", "--job-id", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("cannot be used with"), "{}", text(&o));
}

/// `run` started while the database does not answer (a restart, a partition) waits for it,
/// saying why, instead of exiting after the connect timeout; a TERM during the wait exits 0.
#[tokio::test]
async fn run_waits_for_an_unreachable_database_and_a_term_ends_the_wait() {
    let db = TestDb::migrated().await.unwrap();
    let proxy = lockgate_testkit::FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    proxy.freeze();
    let config = Config::new("[job_types.task]\ncommand = [\"true\"]");
    sqlx::query("SELECT lockgate.define_job_type('task')").execute(&db.pool).await.unwrap();
    let log = std::path::Path::new(&config.path).with_file_name("run.log");
    let spawn = || {
        lockgate(&db, &["--connect-timeout", "1s", "run", "--config", &config.path])
            .env("DATABASE_URL", proxy.url_for(&db.url))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap()
    };
    let waiting = || async {
        lockgate_testkit::wait_for("run to say it waits for the database", WAIT, || async {
            Ok(std::fs::read_to_string(&log).unwrap_or_default().contains("waiting for the database").then_some(()))
        })
        .await
        .unwrap();
    };
    let mut child = spawn();
    waiting().await;
    proxy.thaw();
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.processes WHERE kind = 'supervisor'", 1, WAIT)
        .await
        .unwrap();
    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success());
    // A TERM while it waits: a clean exit.
    proxy.freeze();
    let mut child = spawn();
    waiting().await;
    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success(), "{}", std::fs::read_to_string(&log).unwrap_or_default());
    proxy.thaw();
}

/// A read-only server (a standby the URL reaches, or `default_transaction_read_only`) is named,
/// with what to do: for a command, for `lockgate run`, whose start ends at once instead of
/// retrying as it would for a server that is restarting, and by `doctor`.
#[tokio::test]
async fn a_read_only_database_is_named_and_ends_the_start_of_run() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('plain')").execute(&db.pool).await.unwrap();
    sqlx::query(&format!("ALTER DATABASE {} SET default_transaction_read_only = on", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let o = output(&db, &["enqueue", "plain", "{}"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("read-only transaction"), "{}", text(&o));
    assert!(text(&o).contains("hint: the database is read-only"), "{}", text(&o));
    let config = Config::new("[job_types.plain]\ncommand = [\"true\"]");
    let (status, out) = run_until_exit(&db, &config).await;
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("hint: the database is read-only"), "{out}");
    // And doctor fails it, saying where to turn it off (review helper-89: it passed it).
    let o = output(&db, &["doctor"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("default_transaction_read_only is on"), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("ALTER DATABASE {} RESET default_transaction_read_only", db.name)),
        "{}",
        text(&o)
    );
    // Set for the role in this database instead: doctor names that (review helper-90).
    let mut admin = sqlx::PgConnection::connect(&lockgate_testkit::server_url()).await.unwrap();
    let role: String = sqlx::query_scalar("SELECT current_user::text").fetch_one(&mut admin).await.unwrap();
    sqlx::raw_sql(&format!(
        "ALTER DATABASE {0} RESET default_transaction_read_only; \
         ALTER ROLE {1} IN DATABASE {0} SET default_transaction_read_only = on",
        db.name, role
    ))
    .execute(&mut admin)
    .await
    .unwrap();
    let o = output(&db, &["doctor"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let advice = format!("ALTER ROLE {role} IN DATABASE {} RESET default_transaction_read_only", db.name);
    assert!(text(&o).contains(&advice), "{}", text(&o));
}

/// `lockgate enqueue` whose connection breaks after the server committed the job (the reply cut
/// on its way back) exits 3, saying the job may have been enqueued and to look for it before
/// enqueueing it again; it was. Before, it exited 1 like any refusal, and a script retrying on
/// failure enqueued the job twice (review helper-141 F3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_whose_reply_is_lost_after_its_commit_exits_3_and_says_so() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('note')").execute(&db.pool).await.unwrap();
    let proxy = lockgate_testkit::FaultProxy::start("127.0.0.1:5432".into()).await.unwrap();
    proxy.cut_reply_to_request_containing("reply-to-lose");
    let url = proxy.url_for(&db.url);
    let mut cmd = lockgate(&db, &["enqueue", "note", r#"{"tag": "reply-to-lose"}"#]);
    cmd.env("DATABASE_URL", url);
    let o = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
    assert!(proxy.met_marked_reply(), "the enqueue's reply was cut: {}", text(&o));
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("the job may have been enqueued"), "{}", text(&o));
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default WHERE message->>'tag' = 'reply-to-lose'").await.unwrap(), 1);
}

/// Review helper-144 F6: `dlq purge --job-id X` racing a retry of X waited for it, printed
/// "purged 0" and exited 0 while X ran again: a script that purges a poison job and checks the
/// exit status was told it was gone. It exits 1 now, saying the dead letter left meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_purge_of_a_dead_letter_retried_meanwhile_exits_1() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('mail');
         INSERT INTO lockgate.dead_letters (queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at)
         VALUES ('default', 77, 77, 'mail', '{}', '{\"type\": \"mail\", \"job_id\": 77}', 'attempts_exhausted', 'failed', 1, now());",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut retrier = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT * FROM lockgate.dlq_retry(NULL, ARRAY[77]::bigint[], true);")
        .execute(&mut retrier)
        .await
        .unwrap();
    let purge = lockgate(&db, &["dlq", "purge", "--job-id", "77"]);
    let purging = tokio::task::spawn_blocking(move || {
        let mut purge = purge;
        purge.output().expect("lockgate runs")
    });
    wait_for_count(
        &db.pool,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        1,
        WAIT,
    )
    .await
    .unwrap();
    sqlx::query("COMMIT").execute(&mut retrier).await.unwrap();
    let o = purging.await.unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("1 of the 1 named dead letter(s) left the dead letters"), "{}", text(&o));
}
