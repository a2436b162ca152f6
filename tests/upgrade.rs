//! Rolling deploys (issue 13): a process of this build keeps working against a schema that a
//! newer build of the same compatibility version migrated (it only added a table column and a
//! function, and rewrote the functions, whose checksum is no longer this build's), and is refused,
//! with both versions named, by one of another compatibility version.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{queue, test_config, Counter, Running, WAIT};
use lockgate::sql::FUNCTIONS_REVISION;
use lockgate::{Client, DbError, Job, JobContext, JobError, JobPolicy, Registry, LATEST_MIGRATION, SCHEMA_COMPAT};
use lockgate_testkit::{wait_for_count, TestDb};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Ping {
    n: u32,
}

impl Job for Ping {
    const TYPE: &'static str = "ping";
    fn policy() -> JobPolicy {
        JobPolicy::on_queue(queue("default"))
    }
}

/// What a newer build's migrate leaves behind: one more migration that only adds, functions
/// whose checksum differs, and its compatibility version.
async fn migrate_as_a_newer_build(db: &TestDb, compat: i32) {
    sqlx::raw_sql(
        "ALTER TABLE lockgate.queues ADD COLUMN description text;
         CREATE FUNCTION lockgate.describe_queue(queue text, description text) RETURNS void LANGUAGE sql
             AS 'UPDATE lockgate.queues SET description = $2 WHERE name = $1';",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO lockgate.schema_migrations (version, name) VALUES ($1, 'queue_descriptions')")
        .bind(LATEST_MIGRATION + 1)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE lockgate.schema_state SET migration = $1, functions_checksum = 'a newer build', compat = $2")
        .bind(LATEST_MIGRATION + 1)
        .bind(compat)
        .execute(&db.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn an_older_process_runs_against_a_newer_compatible_schema() {
    let db = TestDb::migrated().await.unwrap();
    let client = Client::new(db.pool.clone());
    client.define::<Ping>().await.unwrap();
    migrate_as_a_newer_build(&db, SCHEMA_COMPAT).await;
    lockgate::check_schema(&db.pool).await.expect("compatible: this build runs on it");
    let report = lockgate::migrate(&db.pool).await.unwrap();
    assert_eq!(report.newer, Some(LATEST_MIGRATION + 1), "this build's migrate has nothing to do");
    let checksum: String =
        sqlx::query_scalar("SELECT functions_checksum FROM lockgate.schema_state").fetch_one(&db.pool).await.unwrap();
    assert_eq!(checksum, "a newer build", "and rewrote none of the newer functions");
    for n in 0..5 {
        client.enqueue(&Ping { n }).await.unwrap();
    }
    let ran = Counter::default();
    let mut registry = Registry::new();
    let counted = ran.clone();
    registry
        .register::<Ping, _>(move |_ctx: JobContext, _job: Ping| {
            let counted = counted.clone();
            async move {
                counted.bump();
                Ok::<(), JobError>(())
            }
        })
        .unwrap();
    let running = Running::start(&db, test_config(), registry, &["default"], 2).await;
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 5, WAIT).await.unwrap();
    running.stop().await;
    assert_eq!(ran.get(), 5);
}

#[tokio::test]
async fn a_process_is_refused_by_a_schema_of_another_compatibility_version() {
    let db = TestDb::migrated().await.unwrap();
    migrate_as_a_newer_build(&db, SCHEMA_COMPAT + 1).await;
    let refused = lockgate::check_schema(&db.pool).await.unwrap_err();
    assert!(matches!(refused, DbError::SchemaIncompatible { .. }), "{refused}");
    let text = refused.to_string();
    assert!(
        text.contains(&format!(
            "schema version {} (compatibility version {})",
            LATEST_MIGRATION + 1,
            SCHEMA_COMPAT + 1
        )) && text.contains(&format!("(schema {LATEST_MIGRATION}, compatibility version {SCHEMA_COMPAT})")),
        "{text}"
    );
    assert!(lockgate::migrate(&db.pool).await.is_err(), "nor may it migrate it");
    let config = test_config();
    let runtime = lockgate::Runtime::new(
        db.new_pool(2).await.unwrap(),
        config,
        Registry::new(),
        vec![lockgate::PoolConfig::new("test", vec![queue("default")], 1)],
    )
    .unwrap();
    let run = runtime.run(tokio_util::sync::CancellationToken::new()).await;
    assert!(run.is_err(), "the runtime refuses to start: {run:?}");
}

/// Most releases change only functions: a newer functions revision of the same schema version is
/// newer too (an older process runs on it, an older migrate does not put its functions back); the
/// same revision with other functions is a development build's, refused until migrated.
#[tokio::test]
async fn a_functions_only_release_rolls_and_a_development_build_is_refused() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("UPDATE lockgate.schema_state SET functions_revision = $1, functions_checksum = 'newer functions'")
        .bind(FUNCTIONS_REVISION + 1)
        .execute(&db.pool)
        .await
        .unwrap();
    let fit = lockgate::check_schema(&db.pool).await.unwrap();
    assert_eq!(fit, lockgate::sql::SchemaFit::NewerCompatible { found: LATEST_MIGRATION });
    assert!(lockgate::migrate(&db.pool).await.unwrap().newer.is_some(), "an older migrate has nothing to do");
    let checksum: String =
        sqlx::query_scalar("SELECT functions_checksum FROM lockgate.schema_state").fetch_one(&db.pool).await.unwrap();
    assert_eq!(checksum, "newer functions", "and left the newer functions alone");
    sqlx::query("UPDATE lockgate.schema_state SET functions_revision = $1, functions_checksum = 'a branch'")
        .bind(FUNCTIONS_REVISION)
        .execute(&db.pool)
        .await
        .unwrap();
    let refused = lockgate::check_schema(&db.pool).await.unwrap_err();
    assert!(matches!(refused, DbError::FunctionsOutdated), "{refused}");
    lockgate::migrate(&db.pool).await.unwrap();
    assert_eq!(
        lockgate::check_schema(&db.pool).await.unwrap(),
        lockgate::sql::SchemaFit::Exact,
        "migrated: this build's"
    );
}

/// A migration's DDL on a table lockgate's paths write (migration 20's triggers on the semaphores
/// and the leases) waits for every transaction that has written it, and every later statement on
/// the table queues behind that wait: one open producer transaction stalled every enqueue, claim
/// and completion of a limited job for as long as it stayed open, and the two tables locked in
/// the opposite order of a completion's could deadlock with it (the review of migration 20). Now
/// migrate waits at most 500 ms for a lock, then undoes the attempt and tries again: the other
/// sessions go on between its attempts, and it finishes once the transaction ends. Without the
/// timeout, no enqueue gets through while the producer's transaction is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_waits_for_an_open_transaction_without_stalling_the_paths_behind_it() {
    let db = TestDb::migrated().await.unwrap();
    let producer = at_migration_19_with_a_producer_open(&db).await;
    let finished = std::sync::atomic::AtomicBool::new(false);
    let migrating = async {
        let report = lockgate::migrate(&db.pool).await;
        finished.store(true, std::sync::atomic::Ordering::SeqCst);
        report
    };
    // Once migrate waits for a lock on the tables, other producers go on, each enqueue a permit
    // of a key of its own; then the open transaction ends.
    let others = async {
        let waiting = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted
                                       AND relation IN ('lockgate.semaphores'::regclass, 'lockgate.leases'::regclass))";
        let until = std::time::Instant::now() + WAIT;
        while !sqlx::query_scalar::<_, bool>(waiting).fetch_one(&db.pool).await.unwrap() {
            assert!(std::time::Instant::now() < until, "migrate never waited for the producer's locks");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        let mut enqueued = 0;
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            let enqueue = sqlx::query("SELECT * FROM lockgate.enqueue('solo', jsonb_build_object('k', $1::integer))")
                .bind(enqueued + 1)
                .execute(&db.pool);
            match tokio::time::timeout(left, enqueue).await {
                Ok(done) => {
                    done.unwrap();
                    enqueued += 1;
                }
                Err(_) => break,
            }
        }
        assert!(!finished.load(std::sync::atomic::Ordering::SeqCst), "migrate waits for the producer's transaction");
        assert!(enqueued >= 3, "{enqueued} enqueues in 3 s while migrate waited");
        producer.commit().await.unwrap();
    };
    let (report, ()) =
        tokio::time::timeout(WAIT, async { tokio::join!(migrating, others) }).await.expect("migrate finishes");
    let report = report.unwrap();
    assert_eq!(report.applied, ["key_changes_refused"]);
    let triggers: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_trigger WHERE tgname IN ('semaphores_key_not_renamed', 'leases_key_not_moved')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(triggers, 2);
}

/// A lock held past every attempt: migrate gives up with `MigrateBlocked`, naming its attempts,
/// and leaves the database as it found it; once the transaction ends, migrate applies the
/// migration. Runs for about 40 s, the 30 attempts' waits.
#[tokio::test]
async fn migrate_gives_up_on_a_lock_held_past_its_attempts_and_changes_nothing() {
    let db = TestDb::migrated().await.unwrap();
    let producer = at_migration_19_with_a_producer_open(&db).await;
    let blocked = tokio::time::timeout(std::time::Duration::from_secs(120), lockgate::migrate(&db.pool))
        .await
        .expect("migrate gives up within its attempts");
    assert!(matches!(blocked, Err(DbError::MigrateBlocked { attempts: 30 })), "{blocked:?}");
    let message = blocked.unwrap_err().to_string();
    assert!(message.contains("30 attempts") && message.contains("pg_stat_activity"), "{message}");
    let state: (i32, i64) = sqlx::query_as(
        "SELECT (SELECT migration FROM lockgate.schema_state),
                (SELECT count(*) FROM pg_trigger WHERE tgname IN ('semaphores_key_not_renamed', 'leases_key_not_moved'))",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(state, (19, 0), "nothing of the migration is left behind");
    producer.commit().await.unwrap();
    let report = lockgate::migrate(&db.pool).await.unwrap();
    assert_eq!(report.applied, ["key_changes_refused"]);
}

/// Migration 27 alters the leases, then the semaphores, and lockgate's paths lock the two in both
/// orders: a producer holding a key's row that then adds its lease waited behind the migration's
/// lock on the leases while the migration waited for the producer's row (review helper-141 F2;
/// under a steady stream of limited enqueues every attempt ended so, until migrate gave up).
/// Migrate now takes both tables at once, with tries that queue for nothing: the producer's lease
/// goes in at once, and the migration after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_takes_the_key_tables_together_and_closes_no_cycle_with_a_producer() {
    // A producer's transaction between its two steps: the key's row taken, its lease not yet added.
    no_cycle_with_a_producer(&[27], "SELECT lockgate._acquire('k', 1)", &["shared_key_holders"]).await;
}

/// The same for migrations 27 and 28 pending together: 28 alters the batch memberships, which a
/// producer enqueuing into a batch writes before it adds its lease. Locking only the key tables
/// together, migrate held the leases while it waited for the memberships, and gave up after its
/// 30 attempts in two upgrades of three under such producers (review helper-146 F2): every table
/// a pending migration alters is taken at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_takes_every_table_its_migrations_alter_together() {
    no_cycle_with_a_producer(
        &[27, 28],
        "UPDATE lockgate.batch_jobs SET outcome = outcome WHERE false",
        &["shared_key_holders", "batch_membership_messages"],
    )
    .await;
}

/// Migrate from before `versions`, while a producer's transaction that has run `first` waits to
/// add its lease until migrate is at the tables: the lease goes in at once, and migrate applies
/// `applied` after the producer's commit.
async fn no_cycle_with_a_producer(versions: &[i32], first: &str, applied: &[&str]) {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("DELETE FROM lockgate.schema_migrations WHERE version = ANY ($1)")
        .bind(versions)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE lockgate.schema_state SET migration = $1")
        .bind(versions[0] - 1)
        .execute(&db.pool)
        .await
        .unwrap();
    let mut producer = db.pool.begin().await.unwrap();
    sqlx::query(first).execute(&mut *producer).await.unwrap();
    let migrating = lockgate::migrate(&db.pool);
    // Once migrate is at the tables (queued for one of them, or still trying to take them all
    // 50 ms after its first try was seen), the producer adds its lease and commits.
    let producing = async {
        let at_the_tables = "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                                             WHERE NOT l.granted AND c.relnamespace = 'lockgate'::regnamespace),
                                    EXISTS (SELECT 1 FROM pg_stat_activity WHERE query LIKE '%SAVEPOINT lock_together%'
                                                                             AND pid <> pg_backend_pid())";
        let until = std::time::Instant::now() + WAIT;
        let mut trying_since = None;
        loop {
            let (queued, trying): (bool, bool) = sqlx::query_as(at_the_tables).fetch_one(&db.pool).await.unwrap();
            let since = *trying_since.get_or_insert_with(std::time::Instant::now);
            if !trying {
                trying_since = None;
            }
            if queued || (trying && since.elapsed() > std::time::Duration::from_millis(50)) {
                break;
            }
            assert!(std::time::Instant::now() < until, "migrate never came to the tables");
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        let started = std::time::Instant::now();
        sqlx::query("SELECT lockgate._add_lease('k', 'default', 42, now(), 60000)")
            .execute(&mut *producer)
            .await
            .unwrap();
        let waited = started.elapsed();
        producer.commit().await.unwrap();
        waited
    };
    let (report, waited) =
        tokio::time::timeout(WAIT, async { tokio::join!(migrating, producing) }).await.expect("migrate finishes");
    assert_eq!(report.unwrap().applied, applied);
    assert!(waited < std::time::Duration::from_millis(250), "the producer's lease waited {waited:?} behind migrate");
}

/// The database as the previous build left it (before migration 20, whose triggers lock the key
/// tables), with a producer's transaction that enqueued a limited job left open: it holds the
/// locks migration 20 waits for until the caller ends it.
async fn at_migration_19_with_a_producer_open(db: &TestDb) -> sqlx::Transaction<'static, sqlx::Postgres> {
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('solo', concurrency_limit => 1, concurrency_key => ARRAY['k']);
         -- As the previous build left the database: before migration 20.
         DROP TRIGGER semaphores_key_not_renamed ON lockgate.semaphores;
         DROP TRIGGER leases_key_not_moved ON lockgate.leases;
         DROP FUNCTION lockgate._refuse_key_change();
         DELETE FROM lockgate.schema_migrations WHERE version = 20;
         UPDATE lockgate.schema_state SET migration = 19;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut producer = db.pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM lockgate.enqueue('solo', '{\"k\": 0}')").execute(&mut *producer).await.unwrap();
    producer
}

/// Migration 21 (docs/design.md §67): every queue's claim index, built on the cast of the
/// priority header, is built again on the rank that never raises, the very index a queue created
/// now gets; the jobs waiting keep their order; and a queue whose table was dropped behind
/// lockgate's back does not stop the migration.
#[tokio::test]
async fn migration_21_gives_every_queue_the_claim_index_a_new_queue_gets() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('ranked', queue => 'ranked');
         SELECT lockgate.enqueue('ranked', jsonb_build_object('p', p), jsonb_build_object('priority', p))
           FROM unnest(ARRAY[3, 0, 7, 0, 3]) p;
         SELECT lockgate.create_queue('gone');
         SELECT pgmq.drop_queue('gone');
         -- As the previous build left the database: before migration 21.
         DROP INDEX pgmq.q_ranked_lg_claim;
         CREATE INDEX q_ranked_lg_claim ON pgmq.q_ranked ((COALESCE((headers->>'priority')::smallint, 0)), vt, msg_id);
         DELETE FROM lockgate.schema_migrations WHERE version = 21;
         UPDATE lockgate.schema_state SET migration = 20;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = lockgate::migrate(&db.pool).await.unwrap();
    assert_eq!(report.applied, ["claim_rank"]);

    sqlx::query("SELECT lockgate.create_queue('fresh')").execute(&db.pool).await.unwrap();
    let (migrated, fresh): (String, String) = sqlx::query_as(
        "SELECT pg_get_indexdef('pgmq.q_ranked_lg_claim'::regclass),
                replace(pg_get_indexdef('pgmq.q_fresh_lg_claim'::regclass), 'q_fresh', 'q_ranked')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(migrated, fresh);
    assert!(migrated.contains("array_position"), "{migrated}");
    let indexes: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_indexes WHERE tablename = 'q_ranked'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(indexes, 3, "the primary key, the job-id index and one claim index");

    let order: Vec<i64> = sqlx::query_scalar("SELECT (message->>'p')::bigint FROM lockgate.claim('ranked', 10, 30) c")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(order, sorted, "claimed best priority first");
    assert_eq!(order.len(), 5);
}

/// Design §67: a claim statement uses the claim index only when both write the same rank, and
/// where they differ every claim reads the whole queue. Each install of the functions builds
/// again any queue's claim index that differs from the one a new queue gets (here: the CASE form
/// an earlier text of migration 21 built, an index dropped by hand, and one whose build failed
/// halfway: right in text, not valid), and leaves the others. Between installs, `lockgate doctor`
/// names each wrong index and what is wrong with it (claim_indexes), and the reference index it
/// compares with when that is missing.
#[tokio::test]
async fn every_install_rebuilds_a_claim_index_that_differs_from_a_new_queues() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.create_queue(q) FROM unnest(ARRAY['cased', 'dropped', 'invalid', 'right']) q;
         -- As a CREATE INDEX CONCURRENTLY cancelled halfway leaves it (the test runs as a superuser).
         UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'pgmq.q_invalid_lg_claim'::regclass;
         DROP INDEX pgmq.q_cased_lg_claim;
         CREATE INDEX q_cased_lg_claim ON pgmq.q_cased ((CASE COALESCE(headers->>'priority', '0') WHEN '0' THEN 0
             WHEN '1' THEN 1 WHEN '2' THEN 2 WHEN '3' THEN 3 WHEN '4' THEN 4 WHEN '5' THEN 5 WHEN '6' THEN 6
             WHEN '7' THEN 7 WHEN '8' THEN 8 WHEN '9' THEN 9 ELSE -1 END), vt, msg_id);
         DROP INDEX pgmq.q_dropped_lg_claim;
         UPDATE lockgate.schema_state SET functions_revision = functions_revision - 1;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let oid = "SELECT 'pgmq.q_right_lg_claim'::regclass::oid::bigint";
    let right_before: i64 = sqlx::query_scalar(oid).fetch_one(&db.pool).await.unwrap();
    let probe = "SELECT 'lockgate.claim_index_probe_rank'::regclass::oid::bigint";
    let probe_before: i64 = sqlx::query_scalar(probe).fetch_one(&db.pool).await.unwrap();
    let doctor = "SELECT verdict, detail FROM lockgate.doctor() WHERE check_name = 'claim_indexes' ORDER BY detail";
    let found: Vec<(String, String)> = sqlx::query_as(doctor).fetch_all(&db.pool).await.unwrap();
    let verdicts: Vec<&str> = found.iter().map(|(verdict, _)| verdict.as_str()).collect();
    assert_eq!(verdicts, ["warn"; 3], "doctor names the three wrong indexes between installs: {found:?}");
    assert!(found[0].1.starts_with("queue cased: its claim index pgmq.q_cased_lg_claim is of another definition (btree (( CASE COALESCE((headers ->> 'priority'::text), '0'::text) WHEN '0'::text THEN 0 WHEN"), "{found:?}");
    assert_eq!(found[1].1, "queue dropped: its claim index pgmq.q_dropped_lg_claim is missing");
    assert_eq!(found[2].1, "queue invalid: its claim index pgmq.q_invalid_lg_claim is not valid");
    lockgate::migrate(&db.pool).await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('fresh')").execute(&db.pool).await.unwrap();
    for queue in ["cased", "dropped", "invalid", "right"] {
        let (index, fresh): (Option<String>, String) = sqlx::query_as(
            "SELECT pg_get_indexdef(to_regclass(format('pgmq.%I', 'q_' || $1 || '_lg_claim'))),
                    replace(pg_get_indexdef('pgmq.q_fresh_lg_claim'::regclass), 'q_fresh', 'q_' || $1)",
        )
        .bind(queue)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(index.as_deref(), Some(fresh.as_str()), "queue {queue}");
    }
    let invalid: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_index WHERE NOT indisvalid AND indrelid = ANY (ARRAY['pgmq.q_invalid'::regclass])",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(invalid, 0, "the index that was not valid was built again");
    let right_after: i64 = sqlx::query_scalar(oid).fetch_one(&db.pool).await.unwrap();
    assert_eq!(right_after, right_before, "an index that was right is left as it was");
    let probe_after: i64 = sqlx::query_scalar(probe).fetch_one(&db.pool).await.unwrap();
    assert_eq!(
        probe_after, probe_before,
        "the reference index, unchanged, is not built again (a doctor may be reading it)"
    );
    let found: Vec<(String, String)> = sqlx::query_as(doctor).fetch_all(&db.pool).await.unwrap();
    assert_eq!(found, [("ok".into(), "5 queue(s), each with the claim index lockgate builds".into())]);
    sqlx::query("DROP INDEX lockgate.claim_index_probe_rank").execute(&db.pool).await.unwrap();
    let found: Vec<(String, String)> = sqlx::query_as(doctor).fetch_all(&db.pool).await.unwrap();
    assert_eq!(
        found,
        [(
            "warn".into(),
            "lockgate.claim_index_probe_rank, the index each queue's claim index is compared with, is missing".into()
        )]
    );
}

/// Design §69: queue x's relations take names made from x's (pgmq.q_x_lg_claim, q_x_lg_job,
/// q_x_pkey, ...), so a queue named x_lg_claim would hold, as its table, the name of x's claim
/// index. A new queue may not end in such a suffix, and a queue whose index name another relation
/// holds already (a PGMQ queue made by pgmq.create) is refused with both named, instead of being
/// made without its index. A database holding such a pair from before (made by an earlier
/// create_queue, which skipped the index with a NOTICE) still migrates: the install leaves the
/// queue whose name is taken to the doctor, which names it, and rebuilds the others.
#[tokio::test]
async fn a_queue_name_that_would_take_another_queues_index_name_is_refused_and_an_old_pair_still_migrates() {
    let db = TestDb::migrated().await.unwrap();
    for name in ["x_lg_claim", "x_lg_job", "x_pkey", "x_vt_idx", "x_msg_id_seq"] {
        let err = lockgate::sql::create_queue(&db.pool, name).await.unwrap_err();
        assert!(
            matches!(&err, DbError::InvalidArgument(m) if m.contains(&format!("invalid queue name \"{name}\""))
                && m.contains("may not end in _pkey, _vt_idx, _msg_id_seq, _lg_claim or _lg_job")),
            "{name}: {err}"
        );
    }
    sqlx::query("SELECT pgmq.create('held_lg_claim')").execute(&db.pool).await.unwrap();
    let err = lockgate::sql::create_queue(&db.pool, "held").await.unwrap_err();
    assert!(
        matches!(&err, DbError::InvalidArgument(m)
            if m.contains("queue \"held\" cannot be created: the name of its index pgmq.q_held_lg_claim is taken")
                && m.contains("pgmq.q_held_lg_claim is a table, not an index of pgmq.q_held")),
        "{err}"
    );
    let made: i64 = sqlx::query_scalar("SELECT count(*) FROM lockgate.queues WHERE name = 'held'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(made, 0, "nothing of the refused queue is left");

    // As an earlier create_queue left them: queue x made after x_lg_claim, without its claim
    // index; queue y_lg_rank, whose table holds the name earlier installs rebuilt y's index under.
    // Each with its ids from lockgate's sequence, as create_queue made them.
    sqlx::raw_sql(
        "SELECT pgmq.create('x_lg_claim'); INSERT INTO lockgate.queues (name) VALUES ('x_lg_claim');
         SELECT pgmq.create('x'); INSERT INTO lockgate.queues (name) VALUES ('x');
         SELECT lockgate.create_queue('y');
         SELECT pgmq.create('y_lg_rank'); INSERT INTO lockgate.queues (name) VALUES ('y_lg_rank');
         ALTER TABLE pgmq.q_x_lg_claim ALTER COLUMN msg_id DROP IDENTITY;
         ALTER TABLE pgmq.q_x ALTER COLUMN msg_id DROP IDENTITY;
         ALTER TABLE pgmq.q_y_lg_rank ALTER COLUMN msg_id DROP IDENTITY;
         DROP INDEX pgmq.q_y_lg_claim;
         UPDATE lockgate.schema_state SET functions_revision = functions_revision - 1;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    lockgate::migrate(&db.pool).await.unwrap();
    let y_index: Option<String> = sqlx::query_scalar(
        "SELECT indrelid::regclass::text FROM pg_index WHERE indexrelid = 'pgmq.q_y_lg_claim'::regclass",
    )
    .fetch_optional(&db.pool)
    .await
    .unwrap();
    assert_eq!(y_index.as_deref(), Some("pgmq.q_y"), "y's claim index is built again");
    let doctor = "SELECT verdict, detail FROM lockgate.doctor() WHERE check_name = 'claim_indexes' ORDER BY detail";
    let found: Vec<(String, String)> = sqlx::query_as(doctor).fetch_all(&db.pool).await.unwrap();
    assert_eq!(
        found,
        [("warn".into(), "queue x has no claim index: its name is taken by the table pgmq.q_x_lg_claim".into())]
    );
    let again = lockgate::sql::create_queue(&db.pool, "x_lg_claim").await;
    assert!(again.is_ok(), "a queue that exists is left alone whatever its name: {again:?}");
}

/// A queue's claim index writes its rank with `array_position`, resolved when the index is built.
/// create_queue fixes its search path, so a session whose search path puts a function of that
/// name before PostgreSQL's own (here `public.array_position(text[], text)`, which the rank's
/// call matches exactly) still gets the index every claim matches, not one calling that function.
#[tokio::test]
async fn a_queue_made_under_a_search_path_that_shadows_the_ranks_function_gets_lockgates_claim_index() {
    let db = TestDb::migrated().await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::raw_sql(
        "CREATE FUNCTION public.array_position(a text[], e text) RETURNS integer LANGUAGE sql IMMUTABLE
             AS 'SELECT 1';
         SET search_path = public, pg_catalog;
         SELECT lockgate.create_queue('shadowed');",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let index: String = sqlx::query_scalar("SELECT pg_get_indexdef('pgmq.q_shadowed_lg_claim'::regclass)")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert!(!index.contains("public."), "{index}");
    let found: Vec<(String, String)> =
        sqlx::query_as("SELECT verdict, detail FROM lockgate.doctor() WHERE check_name = 'claim_indexes'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(found, [("ok".into(), "1 queue(s), each with the claim index lockgate builds".into())]);
}

/// A role that may read lockgate's tables but not name PGMQ's (no USAGE on schema pgmq) still
/// gets every check the doctor can answer for it; the two that read the queues' relations say
/// they were not checked, and why, instead of failing the whole doctor. One transaction, rolled
/// back: the role never outlives the test.
#[tokio::test]
async fn the_doctor_answers_a_role_without_usage_on_pgmq_and_says_what_it_did_not_check() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('watched')").execute(&db.pool).await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let watcher = format!("{}_watch", db.name);
    sqlx::raw_sql(&format!(
        "CREATE ROLE {watcher} NOLOGIN;
         GRANT USAGE ON SCHEMA lockgate TO {watcher}; GRANT SELECT ON ALL TABLES IN SCHEMA lockgate TO {watcher};
         SET LOCAL ROLE {watcher};"
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    let rows: Vec<(String, String, String)> =
        sqlx::query_as("SELECT check_name, verdict, detail FROM lockgate.doctor()").fetch_all(&mut *tx).await.unwrap();
    let not_checked = format!("not checked: role {watcher} has no USAGE on schema pgmq, where the queues' tables are");
    for check in ["queue_tables", "queue_steps", "claim_indexes"] {
        let found: Vec<_> = rows.iter().filter(|(name, _, _)| name == check).collect();
        assert_eq!(found, [&(check.to_string(), "warn".to_string(), not_checked.clone())], "{rows:?}");
    }
    assert!(rows.iter().any(|(name, verdict, _)| name == "key_guards" && verdict == "ok"), "{rows:?}");
}

/// An install that changes nothing (a migrate of the same revision, forced here) drops and makes
/// again no function of lockgate's and no index of its or PGMQ's schema: each would have a new
/// oid, and a session running the old one while the install commits (a doctor, a claim, an
/// enqueue) would fail with "cache lookup failed". (Revision 48 dropped and made again
/// `_stale_claim_indexes` at every install: a doctor looped beside forced installs failed in 7
/// of 69 runs.) Revision 47's form of that function, of another result type, is replaced.
#[tokio::test]
async fn an_install_that_changes_nothing_makes_no_function_or_index_again() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.create_queue('kept')").execute(&db.pool).await.unwrap();
    let objects = "SELECT p.oid::regprocedure::text, p.oid::bigint FROM pg_proc p
                    WHERE p.pronamespace = 'lockgate'::regnamespace
                   UNION ALL
                   SELECT c.oid::regclass::text, c.oid::bigint FROM pg_class c
                    WHERE c.relkind = 'i' AND c.relnamespace IN ('lockgate'::regnamespace, 'pgmq'::regnamespace)
                   ORDER BY 1";
    let before: Vec<(String, i64)> = sqlx::query_as(objects).fetch_all(&db.pool).await.unwrap();
    assert!(before.len() > 100, "{before:?}");
    sqlx::query("UPDATE lockgate.schema_state SET functions_revision = functions_revision - 1")
        .execute(&db.pool)
        .await
        .unwrap();
    lockgate::migrate(&db.pool).await.unwrap();
    let after: Vec<(String, i64)> = sqlx::query_as(objects).fetch_all(&db.pool).await.unwrap();
    let changed: Vec<&(String, i64)> = after.iter().filter(|o| !before.contains(o)).collect();
    assert!(changed.is_empty() && after.len() == before.len(), "made again: {changed:?}");

    // Revision 47's _stale_claim_indexes returned no taken_by: that one is replaced.
    sqlx::raw_sql(
        "DROP FUNCTION lockgate._stale_claim_indexes();
         CREATE FUNCTION lockgate._stale_claim_indexes() RETURNS TABLE (queue text, why text)
             LANGUAGE sql STABLE AS 'SELECT NULL::text, NULL::text WHERE false';
         UPDATE lockgate.schema_state SET functions_revision = functions_revision - 1;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    lockgate::migrate(&db.pool).await.unwrap();
    let result: String =
        sqlx::query_scalar("SELECT pg_get_function_result('lockgate._stale_claim_indexes()'::regprocedure)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(result, "TABLE(queue text, why text, taken_by text)");
}

/// A queue's table dropped and made again behind lockgate's back (`pgmq.drop_queue`, then
/// `pgmq.create`) numbers its messages from 1 again: its jobs would take the ids of other jobs,
/// and a delivery of the dropped table, whose worker still runs, would complete a new message
/// that took its id. Until lockgate adopts the table, no lockgate enqueue goes into it,
/// check_invariants names it, and a sweep leaves its parked jobs parked and goes on with the
/// other queues; a migrate adopts it, and the parked job then runs under an id of lockgate's.
/// A queue whose table is only dropped does not stop archive retention for the others.
#[tokio::test]
async fn a_queue_table_made_again_outside_lockgate_takes_no_job_ids_until_a_migrate_adopts_it() {
    let db = TestDb::migrated().await.unwrap();
    let one = |sql: &'static str| {
        let pool = db.pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap() }
    };
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('lim', queue => 'qa', concurrency_limit => 1, concurrency_key => ARRAY['k'],
                                         concurrency_duration_ms => 1000);
         SELECT lockgate.define_job_type('lim2', queue => 'qc', concurrency_limit => 1, concurrency_key => ARRAY['k'],
                                         concurrency_duration_ms => 1000);
         SELECT lockgate.define_job_type('free', queue => 'qa');
         SELECT lockgate.create_queue('qd');
         SELECT lockgate.enqueue('lim', '{\"k\": \"x\"}'); SELECT lockgate.enqueue('lim', '{\"k\": \"x\"}');
         SELECT lockgate.enqueue('lim2', '{\"k\": \"w\"}'); SELECT lockgate.enqueue('lim2', '{\"k\": \"w\"}');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // The workers of qa's and qc's first jobs stop answering; qa's keeps its delivery's token.
    let (stale_id, stale_ct): (i64, i32) =
        sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('qa', 1, 300)").fetch_one(&db.pool).await.unwrap();
    one("SELECT count(*) FROM lockgate.claim('qc', 1, 300)").await;
    sqlx::raw_sql("SELECT pgmq.drop_queue('qa'); SELECT pgmq.create('qa'); SELECT pgmq.drop_queue('qd');")
        .execute(&db.pool)
        .await
        .unwrap();
    // A message sent into the new table with PGMQ's own call takes PGMQ's id: the stale token's.
    let raw: i64 = sqlx::query_scalar("SELECT * FROM pgmq.send('qa', '{}'::jsonb, '{\"type\": \"free\"}'::jsonb)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(raw, stale_id);
    assert_eq!(one("SELECT count(*) FROM lockgate.claim('qa', 5, 300)").await, 0, "no claim before adoption");

    let problems: Vec<String> =
        sqlx::query_scalar("SELECT problem FROM lockgate.check_invariants() WHERE key IS NULL ORDER BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        problems,
        [
            "queue qa has a PGMQ table made again outside lockgate (pgmq.create), numbering its messages from 1: run lockgate migrate to adopt it",
            "queue qd has no PGMQ table (dropped outside lockgate)",
        ]
    );
    let (verdict, detail): (String, String) =
        sqlx::query_as("SELECT verdict, detail FROM lockgate.doctor() WHERE check_name = 'queue_tables'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(verdict, "fail");
    assert!(
        detail.starts_with("queue qa: its table was made again outside lockgate (pgmq.create)")
            && detail.contains("; queue qd: its table was dropped outside lockgate"),
        "{detail}"
    );
    let refused = sqlx::query("SELECT * FROM lockgate.enqueue('lim', '{\"k\": \"y\"}')").execute(&db.pool).await;
    assert!(
        matches!(&refused, Err(e) if e.to_string().contains("cannot insert a non-DEFAULT value into column \"msg_id\"")),
        "an enqueue into the table made again is refused: {refused:?}"
    );
    assert_eq!(one("SELECT count(*) FROM pgmq.q_qa").await, 1, "only the message sent with pgmq.send");

    // Both leases end; the sweep frees them, promotes qc's parked job and leaves qa's parked.
    sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second'").execute(&db.pool).await.unwrap();
    let (expired, promoted): (i32, i32) =
        sqlx::query_as("SELECT expired, promoted FROM lockgate.sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!((expired, promoted), (2, 1));
    assert_eq!(one("SELECT count(*) FROM pgmq.q_qc").await, 2, "qc's parked job is sent");
    assert_eq!(one("SELECT count(*) FROM lockgate.parked WHERE queue = 'qa'").await, 1, "qa's waits, parked");
    assert_eq!(one("SELECT count(*) FROM lockgate.dead_letters").await, 0);
    assert_eq!(one("SELECT lockgate.prune_archive('qd', 0, 100)").await, 0, "nothing to prune where no table is");

    // A migrate adopts the table; the parked job runs under an id above every earlier one, and
    // the stale delivery's completion finds nothing of its own.
    sqlx::query("UPDATE lockgate.schema_state SET functions_revision = functions_revision - 1")
        .execute(&db.pool)
        .await
        .unwrap();
    lockgate::migrate(&db.pool).await.unwrap();
    let problems: i64 =
        sqlx::query_scalar("SELECT count(*) FROM lockgate.check_invariants() WHERE problem LIKE 'queue qa%'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(problems, 0);
    let (_, promoted): (i32, i32) =
        sqlx::query_as("SELECT expired, promoted FROM lockgate.sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(promoted, 1);
    let sent: i64 =
        sqlx::query_scalar("SELECT msg_id FROM pgmq.q_qa WHERE headers ? 'job_id'").fetch_one(&db.pool).await.unwrap();
    assert!(sent > 4, "the promoted job's message id {sent} is lockgate's, above every earlier id");
    // The message sent with pgmq.send took a new id too; claimed now, its delivery's token is
    // not the stale one, which completes nothing.
    let claimed: Vec<(i64, i32)> =
        sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('qa', 5, 300) ORDER BY msg_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(claimed.len(), 2, "{claimed:?}");
    assert!(
        claimed.iter().all(|(id, _)| *id > 4),
        "every message of the adopted table has an id of lockgate's: {claimed:?}"
    );
    let completed: Vec<i64> = sqlx::query_scalar("SELECT * FROM lockgate.complete('qa', $1, $2)")
        .bind(vec![stale_id])
        .bind(vec![stale_ct])
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert!(completed.is_empty());
    let enqueued: i64 = sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue('lim', '{\"k\": \"z\"}')")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(enqueued > sent);
    let claim_index: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_indexes WHERE indexname = 'q_qa_lg_claim'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(claim_index, 1);
}

/// Review of §71 (helper-69, finding 1): a claim looked at the table before its take waited for
/// it, so a claim that waited behind the transaction that dropped the table and made it again took
/// that new table's messages, whose PGMQ ids were tokens of the dropped table's deliveries. It
/// looks again once the take holds the table, and keeps nothing.
#[tokio::test]
async fn a_claim_waiting_behind_a_table_made_again_takes_nothing_from_it() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('free', queue => 'qa');
         SELECT lockgate.enqueue('free', '{}');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut dropper = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
    sqlx::raw_sql(
        "BEGIN; SELECT pgmq.drop_queue('qa'); SELECT pgmq.create('qa');
         SELECT pgmq.send('qa', '{}'::jsonb, '{\"type\": \"free\"}'::jsonb);",
    )
    .execute(&mut dropper)
    .await
    .unwrap();
    let url = db.url.clone();
    let claim = tokio::spawn(async move {
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
        sqlx::query_as::<_, (i64, i32)>("SELECT msg_id, read_ct FROM lockgate.claim('qa', 5, 300)")
            .fetch_all(&mut conn)
            .await
    });
    lockgate_testkit::wait_for("the claim to wait for the table", std::time::Duration::from_secs(15), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db.pool)
        .await?;
        Ok((waiting > 0).then_some(()))
    })
    .await
    .unwrap();
    sqlx::query("COMMIT").execute(&mut dropper).await.unwrap();
    let claimed = claim.await.unwrap();
    assert!(
        matches!(&claimed, Err(e) if e.to_string().contains("has a table made again outside lockgate")),
        "the claim takes nothing from the new table: {claimed:?}"
    );
    let read: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgmq.q_qa WHERE read_ct > 0").fetch_one(&db.pool).await.unwrap();
    assert_eq!(read, 0, "no message of the new table was read");
}

/// Review of §88 (helper-91, F1): `_made_again` remembered for the session a table it found "not
/// made again" by its oid. Under REPEATABLE READ the catalog lookup (the latest table) and the
/// column query (the transaction's older snapshot) disagree about a table made again after the
/// snapshot: the query saw no column, and the new table was remembered as lockgate's. The
/// session's next claims then took the new table's messages, and a stale token of the dropped
/// table completed one. Only a column seen, and no identity, is remembered.
#[tokio::test]
async fn a_table_made_again_after_a_repeatable_read_snapshot_is_not_remembered_as_lockgates() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql("SELECT lockgate.define_job_type('free', queue => 'qa'); SELECT lockgate.enqueue('free', '{}');")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut session = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
    let claimed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM lockgate.claim('qa', 1, 300)").fetch_one(&mut session).await.unwrap();
    assert_eq!(claimed, 1);
    // The snapshot, taken by a statement that locks no table: the claim's first lock then reads
    // the catalog's changes, so its lookup of the table finds the new one.
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT txid_current_snapshot()")
        .execute(&mut session)
        .await
        .unwrap();
    sqlx::raw_sql(
        "SELECT pgmq.drop_queue('qa'); SELECT pgmq.create('qa');
         SELECT pgmq.send('qa', '{}'::jsonb, '{\"type\": \"free\"}'::jsonb);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let in_snapshot: i64 =
        sqlx::query_scalar("SELECT count(*) FROM lockgate.claim('qa', 1, 300)").fetch_one(&mut session).await.unwrap();
    assert_eq!(in_snapshot, 0);
    sqlx::query("COMMIT").execute(&mut session).await.unwrap();
    let (made_again, after): (bool, i64) =
        sqlx::query_as("SELECT lockgate._made_again('qa'), (SELECT count(*) FROM lockgate.claim('qa', 1, 300))")
            .fetch_one(&mut session)
            .await
            .unwrap();
    assert_eq!((made_again, after), (true, 0), "the session still sees the table made again, and claims nothing");
}

/// Adopting a table made again alters it, which only its owner may: a worker's role that does not
/// own it starts, and defines its types, as before (review of §71, F3), leaving the table to a
/// migrate by its owner; the queue stays out of claims until then.
#[tokio::test]
async fn a_role_that_does_not_own_a_table_made_again_leaves_it_to_the_owners_migrate() {
    let db = TestDb::migrated().await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let app = format!("{}_app", db.name);
    sqlx::raw_sql(&format!(
        "SELECT lockgate.create_queue('qa');
         SELECT pgmq.drop_queue('qa'); SELECT pgmq.create('qa');
         CREATE ROLE {app} NOLOGIN;
         GRANT USAGE ON SCHEMA lockgate TO {app}; GRANT USAGE, CREATE ON SCHEMA pgmq TO {app};
         GRANT ALL ON ALL TABLES IN SCHEMA lockgate, pgmq TO {app};
         GRANT ALL ON ALL SEQUENCES IN SCHEMA lockgate, pgmq TO {app};
         SET LOCAL ROLE {app};
         SELECT lockgate.create_queue('qa');
         SELECT lockgate.define_job_type('t', queue => 'qa');"
    ))
    .execute(&mut *tx)
    .await
    .expect("a role that does not own the table creates its queue and defines its type");
    let (made_again, claimed): (bool, i64) =
        sqlx::query_as("SELECT lockgate._made_again('qa'), (SELECT count(*) FROM lockgate.claim('qa', 5, 30))")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    assert_eq!((made_again, claimed), (true, 0), "left for the owner, and out of claims");
    sqlx::raw_sql("RESET ROLE; SELECT lockgate.create_queue('qa');").execute(&mut *tx).await.unwrap();
    let made_again: bool = sqlx::query_scalar("SELECT lockgate._made_again('qa')").fetch_one(&mut *tx).await.unwrap();
    assert!(!made_again, "the owner adopts it");
    tx.rollback().await.unwrap();
}

/// Revision 116 dropped `_acquire(text, integer)` and `_add_lease(text, text, bigint,
/// timestamptz, bigint)` when it gave both the job's type: an enqueue, claim or promotion of
/// revision 115 in progress when a migrate to 116 or later committed called them after it, and
/// failed with 42883, "function lockgate._acquire(text, integer) does not exist" (review
/// helper-141 F1, three of three rolling upgrades under a producer). They are there again, as
/// forms that name no type, and the limit holds for what they take.
#[tokio::test]
async fn the_permit_functions_an_older_revisions_paths_call_are_still_there() {
    let db = TestDb::migrated().await.unwrap();
    let take = || async { sqlx::query_scalar::<_, bool>("SELECT lockgate._acquire('k', 1)").fetch_one(&db.pool).await };
    assert!(take().await.unwrap(), "a free permit is taken");
    assert!(!take().await.unwrap(), "the key's limit holds");
    sqlx::query("SELECT lockgate._add_lease('k', 'default', 42, now(), 60000)").execute(&db.pool).await.unwrap();
    let lease: (String, Option<String>) = sqlx::query_as("SELECT key, job_type FROM lockgate.leases WHERE msg_id = 42")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(lease, ("k".to_string(), None));
}
