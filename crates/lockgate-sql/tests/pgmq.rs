//! PGMQ from the pgmq crate's embedded installer (docs/design.md section 47): a fresh install,
//! the adoption of the PGMQ an earlier lockgate installed from its vendored SQL (queues and
//! messages kept), PGMQ installed some other way left alone, and migrations racing each other
//! and an earlier lockgate's (H21).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use lockgate_sql::{check_schema, migrate, pending_migrations, PgmqStep, SchemaFit};
use lockgate_testkit::{wait_for, TestDb};
use sqlx::PgPool;

/// The SQL of PGMQ 1.11.1 that lockgate's migration 0001 vendored, and ran, before PGMQ came
/// from the pgmq crate.
const VENDORED_PGMQ: &str = include_str!("../../../tests/fixtures/pgmq_1.11.1.sql");

/// lockgate's migration advisory lock ("lockgate" in ASCII), as every build takes it.
const MIGRATE_LOCK_KEY: i64 = 0x6c6f_636b_6761_7465;

/// The pgmq crate's installer's own advisory lock (`pgmq::util::ADVISORY_LOCK_KEY`).
const PGMQ_INSTALLER_LOCK_KEY: i64 = i64::MIN + 4149;

/// An earlier lockgate's migrate as far as PGMQ goes, in a transaction left open: under
/// lockgate's lock, migration 0001 ran PGMQ's vendored SQL and was recorded without a note,
/// unless it was recorded already or PGMQ was present (then recorded with a note). Committing it
/// leaves what that build left of PGMQ.
async fn begin_earlier_lockgate_migrate(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(MIGRATE_LOCK_KEY).execute(&mut *tx).await.unwrap();
    sqlx::raw_sql(
        "CREATE SCHEMA IF NOT EXISTS lockgate;
         CREATE TABLE IF NOT EXISTS lockgate.schema_migrations (
             version    integer PRIMARY KEY,
             name       text NOT NULL,
             note       text,
             applied_at timestamptz NOT NULL DEFAULT now()
         );",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let (recorded, present): (bool, bool) = sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM lockgate.schema_migrations WHERE version = 1),
                EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pgmq') OR to_regclass('pgmq.meta') IS NOT NULL",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    if !recorded {
        let note = if present {
            Some("PGMQ was already installed; left as it was")
        } else {
            sqlx::raw_sql(VENDORED_PGMQ).execute(&mut *tx).await.unwrap();
            None
        };
        sqlx::query("INSERT INTO lockgate.schema_migrations (version, name, note) VALUES (1, 'pgmq_1.11.1', $1)")
            .bind(note)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx
}

/// Waits until `n` sessions of this database wait for an advisory lock.
async fn sessions_waiting_for_advisory_locks(db: &TestDb, n: i64) {
    wait_for(&format!("{n} sessions waiting for advisory locks"), Duration::from_secs(20), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
              WHERE d.datname = current_database() AND l.locktype = 'advisory' AND NOT l.granted",
        )
        .fetch_one(&db.pool)
        .await?;
        Ok((waiting == n).then_some(()))
    })
    .await
    .unwrap();
}

/// The installer's record: (script, version) in the order they ran.
async fn pgmq_record(db: &TestDb) -> Vec<(String, String)> {
    sqlx::query_as("SELECT name, version FROM pgmq.__pgmq_migrations ORDER BY run_at, name")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_fresh_database_gets_pgmq_from_the_crate_once() {
    let db = TestDb::empty().await.unwrap();
    let report = migrate(&db.pool).await.unwrap();
    let record = pgmq_record(&db).await;
    assert_eq!(record.len(), 1, "one fresh install: {record:?}");
    assert_eq!(record[0].0, "pgmq.sql");
    // lockgate rewrites parts of PGMQ's queue tables (msg_id from its own sequence, its claim
    // index for PGMQ's vt index): a pgmq crate carrying another PGMQ needs that reviewed against
    // the new version and its upgrade scripts (docs/design.md section 47) before this changes.
    assert_eq!(record[0].1, "1.11.1", "the PGMQ version lockgate was reviewed against");
    assert_eq!(report.pgmq, PgmqStep::Installed { version: record[0].1.clone() });
    assert_eq!(report.applied.first().map(String::as_str), Some("pgmq"));
    let note: String = sqlx::query_scalar("SELECT note FROM lockgate.schema_migrations WHERE version = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(note, format!("PGMQ {} installed by the pgmq crate", record[0].1));
    assert_eq!(check_schema(&db.pool).await.unwrap(), SchemaFit::Exact);
    assert!(pending_migrations(&db.pool).await.unwrap().is_empty());

    let again = migrate(&db.pool).await.unwrap();
    assert_eq!(again.pgmq, PgmqStep::Current { version: record[0].1.clone() });
    assert!(again.applied.is_empty());
    assert_eq!(pgmq_record(&db).await, record, "nothing ran twice");
}

#[tokio::test]
async fn pgmq_installed_by_an_earlier_lockgate_is_adopted_with_its_queues_and_messages() {
    let db = TestDb::empty().await.unwrap();
    begin_earlier_lockgate_migrate(&db.pool).await.commit().await.unwrap();
    // A queue of PGMQ's own with messages, one of them read once.
    sqlx::raw_sql(
        "SELECT pgmq.create('legacy');
         SELECT pgmq.send('legacy', jsonb_build_object('n', n)) FROM generate_series(1, 3) n;
         SELECT pgmq.read('legacy', 30, 1);",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let report = migrate(&db.pool).await.unwrap();
    assert_eq!(report.pgmq, PgmqStep::Current { version: "1.11.1".into() }, "adopted as 1.11.1, not reinstalled");
    assert!(!report.applied.iter().any(|m| m == "pgmq"), "0001 stays as the earlier build recorded it");
    assert_eq!(pgmq_record(&db).await, vec![("pgmq.sql".to_string(), "1.11.1".to_string())]);
    let messages: Vec<(i64, i32)> =
        sqlx::query_as("SELECT (message->>'n')::bigint, read_ct FROM pgmq.q_legacy ORDER BY msg_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(messages, vec![(1, 1), (2, 0), (3, 0)]);
    assert_eq!(check_schema(&db.pool).await.unwrap(), SchemaFit::Exact);

    // The same database as the earlier build would have left it after migrating it completely,
    // with lockgate's own jobs in it: all this build adds is the installer's record.
    sqlx::raw_sql(
        "SELECT lockgate.create_queue('legacy');
         SELECT lockgate.define_job_type('ping', 'legacy');
         SELECT * FROM lockgate.enqueue('ping', '{\"n\": 4}');
         DROP TABLE pgmq.__pgmq_migrations;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = migrate(&db.pool).await.unwrap();
    assert_eq!(report.pgmq, PgmqStep::Current { version: "1.11.1".into() });
    assert_eq!(pgmq_record(&db).await, vec![("pgmq.sql".to_string(), "1.11.1".to_string())]);
    let ns: Vec<i64> = sqlx::query_scalar("SELECT (message->>'n')::bigint FROM pgmq.q_legacy ORDER BY msg_id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(ns, vec![1, 2, 3, 4]);
    assert_eq!(check_schema(&db.pool).await.unwrap(), SchemaFit::Exact);
}

#[tokio::test]
async fn pgmq_installed_as_sql_by_something_else_is_left_as_it_was() {
    let db = TestDb::empty().await.unwrap();
    sqlx::raw_sql(VENDORED_PGMQ).execute(&db.pool).await.unwrap();
    let report = migrate(&db.pool).await.unwrap();
    assert_eq!(report.pgmq, PgmqStep::LeftAsFound { how: "as SQL that no installer recorded" });
    let recorded: bool = sqlx::query_scalar("SELECT to_regclass('pgmq.__pgmq_migrations') IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(!recorded, "no version guessed for it");
    let note: String = sqlx::query_scalar("SELECT note FROM lockgate.schema_migrations WHERE version = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(note.contains("left as it was"), "{note}");
    assert_eq!(check_schema(&db.pool).await.unwrap(), SchemaFit::Exact);
}

#[tokio::test]
async fn h21_migrations_racing_on_an_empty_database_all_succeed_and_install_pgmq_once() {
    let db = TestDb::empty().await.unwrap();
    let mut pools = Vec::new();
    for _ in 0..6 {
        pools.push(db.new_pool(1).await.unwrap());
    }
    // Polled together on this task (migrate's future is not Send, so not spawned); each runs on
    // connections of its own.
    let (a, b, c, d, e, f) = tokio::join!(
        migrate(&pools[0]),
        migrate(&pools[1]),
        migrate(&pools[2]),
        migrate(&pools[3]),
        migrate(&pools[4]),
        migrate(&pools[5])
    );
    let mut installed = 0;
    for report in [a, b, c, d, e, f] {
        match report.unwrap().pgmq {
            PgmqStep::Installed { .. } => installed += 1,
            PgmqStep::Current { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(installed, 1);
    assert_eq!(pgmq_record(&db).await.len(), 1);
    assert!(pending_migrations(&db.pool).await.unwrap().is_empty());
    assert_eq!(check_schema(&db.pool).await.unwrap(), SchemaFit::Exact);
}

/// During a rolling deploy an earlier build's migrate (PGMQ from its vendored SQL, under
/// lockgate's lock) may race this build's (PGMQ from the crate's installer): the installer must
/// wait for lockgate's lock, then adopt what the earlier build installed.
#[tokio::test]
async fn h21_a_migrate_of_an_earlier_lockgate_and_one_of_this_build_install_pgmq_once() {
    let db = TestDb::empty().await.unwrap();
    let earlier = begin_earlier_lockgate_migrate(&db.pool).await;
    let pool = db.new_pool(1).await.unwrap();
    let (report, ()) = tokio::join!(migrate(&pool), async {
        sessions_waiting_for_advisory_locks(&db, 1).await;
        earlier.commit().await.unwrap();
    });
    let report = report.unwrap();
    assert_eq!(report.pgmq, PgmqStep::Current { version: "1.11.1".into() });
    assert_eq!(pgmq_record(&db).await, vec![("pgmq.sql".to_string(), "1.11.1".to_string())]);
    assert_eq!(check_schema(&db.pool).await.unwrap(), SchemaFit::Exact);
}

/// The other way round: an earlier build's migrate starting while this build's installer runs
/// must wait for lockgate's lock (held by the installer's connection), not run PGMQ's SQL beside
/// it. The test holds the installer's own lock to keep this build's migrate inside the installer.
#[tokio::test]
async fn h21_an_earlier_lockgate_migrate_waits_while_this_build_installs_pgmq() {
    let db = TestDb::empty().await.unwrap();
    let mut installer_lock = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(PGMQ_INSTALLER_LOCK_KEY)
        .execute(&mut *installer_lock)
        .await
        .unwrap();
    let pool = db.new_pool(1).await.unwrap();
    let (this, earlier) = tokio::join!(migrate(&pool), async {
        // This build's migrate, in the installer.
        sessions_waiting_for_advisory_locks(&db, 1).await;
        let (earlier, ()) =
            tokio::join!(async { begin_earlier_lockgate_migrate(&db.pool).await.commit().await }, async {
                // And the earlier build's, for lockgate's lock.
                sessions_waiting_for_advisory_locks(&db, 2).await;
                sqlx::query("SELECT pg_advisory_unlock($1)")
                    .bind(PGMQ_INSTALLER_LOCK_KEY)
                    .execute(&mut *installer_lock)
                    .await
                    .unwrap();
            });
        earlier
    });
    let report = this.unwrap();
    earlier.unwrap();
    let record = pgmq_record(&db).await;
    assert_eq!(record.len(), 1, "PGMQ installed once: {record:?}");
    assert_eq!(report.pgmq, PgmqStep::Installed { version: record[0].1.clone() });
    let note: String = sqlx::query_scalar("SELECT note FROM lockgate.schema_migrations WHERE version = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(note.contains("installed by the pgmq crate"), "the earlier build found it recorded: {note}");
    assert_eq!(check_schema(&db.pool).await.unwrap(), SchemaFit::Exact);
}

/// The upgrade path, on a database holding lockgate's queues and jobs. The pgmq crate carries no
/// PGMQ newer than 1.11.1, so the record says 1.11.0 for a 1.11.1 install: upstream's
/// 1.11.0--1.11.1 script only replaces functions, and runs as it would on a real 1.11.0.
#[tokio::test]
async fn a_recorded_older_pgmq_is_upgraded_with_its_queues_and_jobs() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('ping');
         SELECT lockgate.enqueue('ping', jsonb_build_object('n', n)) FROM generate_series(1, 3) n;
         UPDATE pgmq.__pgmq_migrations SET version = '1.11.0';",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = migrate(&db.pool).await.unwrap();
    assert_eq!(report.pgmq, PgmqStep::Upgraded { from: "1.11.0".into(), to: "1.11.1".into() });
    let record = pgmq_record(&db).await;
    assert_eq!(record.last(), Some(&("pgmq--1.11.0--1.11.1.sql".to_string(), "1.11.1".to_string())));
    let ns: Vec<i64> = sqlx::query_scalar("SELECT (message->>'n')::bigint FROM pgmq.q_default ORDER BY msg_id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(ns, vec![1, 2, 3]);
    let claimed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM lockgate.claim('default', 10, 30)").fetch_one(&db.pool).await.unwrap();
    assert_eq!(claimed, 3, "lockgate's claim runs on the upgraded PGMQ");
    assert_eq!(check_schema(&db.pool).await.unwrap(), SchemaFit::Exact);
}
