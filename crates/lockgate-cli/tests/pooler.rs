//! The CLI through a transaction-mode PgBouncer (issue 13): `?pooler=transaction` in the URL
//! makes enqueue, status and the dlq verbs work through it; without it they fail the way sqlx
//! does through such a pooler; a pooler mode lockgate does not know is refused, naming it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use lockgate_testkit::pgbouncer::{PgBouncer, PoolMode};
use lockgate_testkit::TestDb;
use sqlx::Connection as _;

#[tokio::test]
async fn the_cli_works_through_transaction_pooling_when_the_url_says_so() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('resize')").execute(&db.pool).await.unwrap();
    // One server connection: every command's statements take turns on it.
    let bouncer = PgBouncer::start(PoolMode::Transaction, 1).await.unwrap();
    let pooled = format!("{}&pooler=transaction", bouncer.url(&db.name));
    for i in 0..5 {
        let o = lockgate(&db, &["enqueue", "resize", &format!("{{\"image\": {i}}}")])
            .env("DATABASE_URL", &pooled)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}\n{}", text(&o), bouncer.log());
    }
    for verb in [&["status"][..], &["jobs", "--queue", "default"], &["dlq", "list"]] {
        let o = lockgate(&db, verb).env("DATABASE_URL", &pooled).output().unwrap();
        assert!(o.status.success(), "{verb:?}: {}", text(&o));
    }
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_default").await.unwrap(), 5);

    let o = lockgate(&db, &["migrate"]).env("DATABASE_URL", &pooled).output().unwrap();
    assert!(!o.status.success() && text(&o).contains("with a direct database URL"), "{}", text(&o));
    assert!(!text(&o).contains("unrecognized connect parameter"), "{}", text(&o));

    // Review helper-136 F6: through the pooler, lockgate run's budgets are the role's; doctor
    // says so, and warns while they are off (the test role has none).
    let o = lockgate(&db, &["doctor", "--json"]).env("DATABASE_URL", &pooled).output().unwrap();
    let checks: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("{}", text(&o)));
    let budgets: Vec<&serde_json::Value> =
        checks.as_array().unwrap().iter().filter(|c| c["check"] == "statement_timeout").collect();
    assert_eq!(budgets.len(), 1, "{checks:#}");
    assert_eq!(budgets[0]["verdict"], "warn", "{checks:#}");
    assert!(budgets[0]["detail"].as_str().unwrap().contains("lock_timeout off (0)"), "{checks:#}");
    assert!(budgets[0]["advice"].as_str().unwrap().contains("ALTER ROLE"), "{checks:#}");

    let bogus = format!("{}&pooler=statement", bouncer.url(&db.name));
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", &bogus).output().unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("pooler=\"statement\"") && text(&o).contains("pooler=transaction"), "{}", text(&o));
}

#[tokio::test]
async fn run_with_sql_job_types_through_transaction_pooling() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE hits (kind text, n integer);
         CREATE PROCEDURE hit(a jsonb) LANGUAGE sql AS $$ INSERT INTO hits SELECT 'call', (a->>'n')::int $$",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Two servers shared by everything; two statements taking the same jsonb: a statement bound
    // on the wrong server would write the other kind.
    let bouncer = PgBouncer::start(PoolMode::Transaction, 2).await.unwrap();
    let pooled = format!("{}&pooler=transaction", bouncer.url(&db.name));
    let dir = std::env::temp_dir().join(format!("lockgate-pooler-{}-{:08x}", std::process::id(), fastrand::u32(..)));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("lockgate.toml");
    std::fs::write(
        &config,
        format!(
            "[runtime]\n{DEFAULT_RUNTIME}\n\n\
             [job_types.left]\nsql = \"INSERT INTO hits SELECT 'left', ($1->>'n')::int\"\n\n\
             [job_types.right]\nsql = \"INSERT INTO hits SELECT 'right', ($1->>'n')::int\"\n\n\
             [job_types.call]\nsql = \"CALL hit($1)\"\n"
        ),
    )
    .unwrap();
    // Both servers hold named statements of another client that did not say pooler=transaction
    // (sqlx names its own sqlx_s_1, sqlx_s_2, ...): nothing lockgate prepares may collide with
    // them — the start-up check of the sql statements did (review helper-81).
    let mut others = Vec::new();
    for _ in 0..2 {
        let mut other = sqlx::PgConnection::connect(&bouncer.url(&db.name)).await.unwrap();
        sqlx::raw_sql("BEGIN").execute(&mut other).await.unwrap();
        others.push(other);
    }
    for other in &mut others {
        for n in 1..=8 {
            sqlx::raw_sql(&format!("PREPARE sqlx_s_{n} AS SELECT {n}")).execute(&mut *other).await.unwrap();
        }
        sqlx::raw_sql("COMMIT").execute(&mut *other).await.unwrap();
    }
    // Without pooler=transaction, the CLI's own statements meet them, and it says what to do.
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", bouncer.url(&db.name)).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("already exists")
            && text(&o).contains("hint: if the database URL goes through a transaction-mode pooler"),
        "{}",
        text(&o)
    );
    // And `run`, which waits for a database that is not up yet, does not wait for this one
    // (review helper-136 F5: it waited for good, logging the prepared statement).
    let mut child = lockgate(&db, &["run", "--config", config.to_str().unwrap()])
        .env("DATABASE_URL", bouncer.url(&db.name))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut child).await;
    let o = child.wait_with_output().unwrap();
    assert_eq!(status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("hint: if the database URL goes through a transaction-mode pooler"), "{}", text(&o));
    let o =
        lockgate(&db, &["define", "--config", config.to_str().unwrap()]).env("DATABASE_URL", &pooled).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    // A CALL, which only the protocol's prepare takes: run unchecked through the pooler, and run.
    let o = lockgate(&db, &["enqueue", "call", "{\"n\": 0}"]).env("DATABASE_URL", &pooled).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    for n in 0..20 {
        for kind in ["left", "right"] {
            let o = lockgate(&db, &["enqueue", kind, &format!("{{\"n\": {n}}}")])
                .env("DATABASE_URL", &pooled)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", text(&o));
        }
    }
    // LISTEN on a direct URL, which may name its mode too: lockgate's parameter, kept from the
    // driver (which warned of it).
    let direct = format!("{}{}pooler=session", db.url, if db.url.contains('?') { '&' } else { '?' });
    let mut child = lockgate(&db, &["run", "--config", config.to_str().unwrap(), "--listen-database-url", &direct])
        .env("DATABASE_URL", &pooled)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let done = lockgate_testkit::wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 41, WAIT).await;
    signal(&child, "TERM");
    let status = wait_exit(&mut child).await;
    let o = child.wait_with_output().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    done.unwrap_or_else(|e| panic!("{e}\n{}", text(&o)));
    assert!(status.success(), "{}", text(&o));
    // Each kind's statement ran once for each of its jobs, and never for the other kind's.
    let kinds: Vec<(String, i64)> =
        sqlx::query_as("SELECT kind, count(DISTINCT n) FROM hits GROUP BY kind ORDER BY kind")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(kinds, [("call".to_string(), 1), ("left".to_string(), 20), ("right".to_string(), 20)]);
    assert_eq!(db.count("SELECT 1 FROM hits").await.unwrap(), 41);
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 0);
    let retried: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgmq.a_default WHERE read_ct > 1").fetch_one(&db.pool).await.unwrap();
    assert_eq!(retried, 0, "attempts failed through the pooler: {}", text(&o));
    assert!(!text(&o).contains("unrecognized connect parameter"), "{}", text(&o));
}

/// Review helper-106 (A1): through a transaction-mode pooler, the sql executor's cancel of a
/// timed-out statement, and the terminate after it, were sent outside a transaction, as two
/// exchanges a pooler may give to two servers: about one in four failed ("unnamed prepared
/// statement does not exist"), and the statement, held by its attempt, ran on to its end. Each now
/// runs in a transaction of its own. Eight statements that catch their cancel and would run a
/// minute, timed out two at a time: all end within seconds.
#[tokio::test]
async fn an_sql_job_is_stopped_on_the_server_through_transaction_pooling() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(STUBBORN_SLEEP).execute(&db.pool).await.unwrap();
    let bouncer = PgBouncer::start(PoolMode::Transaction, 6).await.unwrap();
    let pooled = format!("{}&pooler=transaction", bouncer.url(&db.name));
    let setup = Setup::with_job_type(
        DEFAULT_RUNTIME,
        "sql = \"SELECT stubborn_sleep($1)\"\ntimeout = \"300ms\"\nmax_attempts = 1\n",
    );
    let config = &setup.config;
    let o =
        lockgate(&db, &["define", "--config", config.to_str().unwrap()]).env("DATABASE_URL", &pooled).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    for n in 0..8 {
        let o = lockgate(&db, &["enqueue", "task", &format!("{{\"n\": {n}}}")]).output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
    let child = lockgate(&db, &["run", "--config", config.to_str().unwrap()])
        .env("DATABASE_URL", &pooled)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A statement still running holds its attempt, and the graceful shutdown would wait for it.
    let dead = "SELECT count(*) FROM lockgate.dead_letters";
    stopped_once_counted(&db, child, dead, 8, "a timed-out statement was not stopped on the server").await;
    let running = db.count("SELECT 1 FROM pg_stat_activity WHERE query LIKE '%stubborn_sleep(%' AND state = 'active' AND pid <> pg_backend_pid()");
    assert_eq!(running.await.unwrap(), 0);
}
