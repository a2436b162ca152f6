//! A producer's role (README, "A producer's role"): the README's grants, run as written, let a role
//! that owns nothing enqueue every kind of job, from SQL and from the Rust client, and give it no
//! way to change permits, leases or messages by hand (design §83).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use lockgate::{BatchCallbacks, Client, ConcurrencyPolicy, EnqueueOptions, EnqueueStatus, Job, JobPolicy};
use lockgate_testkit::TestDb;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};

/// The README's grant block, for `role`.
fn readme_grants(role: &str) -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme.split("### A producer's role").nth(1).expect("the README's section");
    let block = section.split("```sql\n").nth(1).and_then(|b| b.split("```").next()).expect("its grant block");
    assert!(block.contains("app_producer"), "{block}");
    block.replace("app_producer", role)
}

#[tokio::test]
async fn the_readmes_producer_grants_let_a_role_that_owns_nothing_enqueue_every_kind_of_job() {
    let db = TestDb::migrated().await.unwrap();
    // Roles are the server's, not the database's: one of this test's own, named under its
    // database, which drops it with itself.
    let role = format!("{}_producer", db.name);
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN")).execute(&db.pool).await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('plain');
         SELECT lockgate.define_job_type('limited', concurrency_limit => 1, concurrency_key => ARRAY['k']);
         SELECT lockgate.define_job_type('unique', unique_mode => 'until_executed', unique_key => ARRAY['k']);
         SELECT lockgate.define_job_type('exclusive', unique_mode => 'while_executing', unique_key => ARRAY['k'])",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::raw_sql(&readme_grants(&role)).execute(&db.pool).await.unwrap();
    // A queue created after the grants, by the owner: covered by the default privileges.
    sqlx::query("SELECT lockgate.define_job_type('later', queue => 'later')").execute(&db.pool).await.unwrap();

    let options: PgConnectOptions = db.url.parse().unwrap();
    let mut producer = options.username(&role).connect().await.unwrap();
    let enqueued: Vec<String> = sqlx::query_scalar(
        "SELECT status FROM lockgate.enqueue('plain', '{}')
         UNION ALL SELECT status FROM lockgate.enqueue('limited', '{\"k\": 1}')
         UNION ALL SELECT status FROM lockgate.enqueue('limited', '{\"k\": 1}')
         UNION ALL SELECT status FROM lockgate.enqueue('unique', '{\"k\": 1}')
         UNION ALL SELECT status FROM lockgate.enqueue('exclusive', '{\"k\": 1}')
         UNION ALL SELECT status FROM lockgate.enqueue('plain', '{}', '{\"delay\": 60}')
         UNION ALL SELECT status FROM lockgate.enqueue('later', '{}')
         UNION ALL SELECT status FROM lockgate.enqueue_many('limited', ARRAY['{\"k\": 2}', '{\"k\": 2}']::jsonb[])",
    )
    .fetch_all(&mut producer)
    .await
    .unwrap();
    assert_eq!(
        enqueued,
        ["enqueued", "enqueued", "parked", "enqueued", "enqueued", "enqueued", "enqueued", "enqueued", "parked"]
    );
    let batch: i64 = sqlx::query_scalar("SELECT lockgate.create_batch()").fetch_one(&mut producer).await.unwrap();
    let status: String =
        sqlx::query_scalar("SELECT status FROM lockgate.enqueue('plain', '{}', jsonb_build_object('batch', $1))")
            .bind(batch)
            .fetch_one(&mut producer)
            .await
            .unwrap();
    assert_eq!(status, "enqueued");
    sqlx::query("SELECT lockgate.close_batch($1)").bind(batch).execute(&mut producer).await.unwrap();
    sqlx::query("SELECT lockgate.wake('default')").execute(&mut producer).await.unwrap();
    producer.close().await.unwrap();

    let violations: Vec<String> =
        sqlx::query_scalar("SELECT problem FROM lockgate.check_invariants()").fetch_all(&db.pool).await.unwrap();
    assert!(violations.is_empty(), "{violations:?}");
}

/// A migrated database with the types every test here enqueues, and a role of the test's own
/// (the test database drops it with itself: its name starts with the database's) with the
/// README's grants.
async fn database_with_producer() -> (TestDb, String) {
    let db = TestDb::migrated().await.unwrap();
    let role = format!("{}_producer", db.name);
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN")).execute(&db.pool).await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('plain');
         SELECT lockgate.define_job_type('limited', concurrency_limit => 1, concurrency_key => ARRAY['k'])",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::raw_sql(&readme_grants(&role)).execute(&db.pool).await.unwrap();
    (db, role)
}

async fn connect_as(db: &TestDb, role: &str) -> PgConnection {
    let options: PgConnectOptions = db.url.parse().unwrap();
    options.username(role).connect().await.unwrap()
}

/// The SQLSTATE and message of a statement that must fail.
async fn refusal(conn: &mut PgConnection, sql: &str) -> (String, String) {
    match sqlx::raw_sql(sql).execute(conn).await {
        Err(sqlx::Error::Database(e)) => (e.code().unwrap_or_default().into_owned(), e.message().to_owned()),
        other => panic!("{sql}: expected a refusal, got {other:?}"),
    }
}

/// Each of `statements` refused for want of a privilege (42501).
async fn assert_refused_for_privilege(conn: &mut PgConnection, statements: &[&str]) {
    for sql in statements {
        let (code, message) = refusal(conn, sql).await;
        assert_eq!(code, "42501", "{sql}: {message}");
    }
}

#[tokio::test]
async fn a_producers_role_can_neither_write_permits_nor_run_lockgates_inner_functions() {
    let (db, role) = database_with_producer().await;
    let mut producer = connect_as(&db, &role).await;
    let status: String = sqlx::query_scalar("SELECT status FROM lockgate.enqueue('limited', '{\"k\": 1}')")
        .fetch_one(&mut producer)
        .await
        .unwrap();
    assert_eq!(status, "enqueued");
    // The one UPDATE that would let a second job of the key start, and the other ways around
    // the enqueue: each refused for want of a privilege (42501).
    assert_refused_for_privilege(
        &mut producer,
        &[
            "UPDATE lockgate.semaphores SET value = 0",
            "DELETE FROM lockgate.leases",
            "INSERT INTO lockgate.semaphores (key, lim, value) VALUES ('limited:[2]', 100, 0)",
            "DELETE FROM lockgate.parked",
            "SELECT lockgate._acquire('limited:[1]', 100, 'limited')",
            "SELECT lockgate._release_leases('default', ARRAY[1::bigint])",
            "SELECT pgmq.send('default', '{}')",
            "INSERT INTO pgmq.q_default (message) VALUES ('{}')",
        ],
    )
    .await;
    let status: String = sqlx::query_scalar("SELECT status FROM lockgate.enqueue('limited', '{\"k\": 1}')")
        .fetch_one(&mut producer)
        .await
        .unwrap();
    assert_eq!(status, "parked", "the key's permit is still taken");
    producer.close().await.unwrap();

    // A role with the schema but without the grants enqueues nothing: running as lockgate's
    // owner is for the roles granted it, not for every role that may read the schema.
    let reader = format!("{}_reader", db.name);
    sqlx::raw_sql(&format!("CREATE ROLE {reader} LOGIN; GRANT USAGE ON SCHEMA lockgate TO {reader}"))
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = connect_as(&db, &reader).await;
    assert_refused_for_privilege(
        &mut conn,
        &[
            "SELECT lockgate.enqueue('plain', '{}')",
            "SELECT lockgate.enqueue('plain', '{}', '{}', false)",
            "SELECT lockgate.enqueue_many('plain', ARRAY['{}'::jsonb])",
            "SELECT lockgate._enqueue_many_and_wake('plain', ARRAY['{}'::jsonb], '{}', true)",
            "SELECT lockgate.create_batch()",
            "SELECT lockgate.close_batch(1)",
        ],
    )
    .await;
    conn.close().await.unwrap();

    let violations: Vec<String> =
        sqlx::query_scalar("SELECT problem FROM lockgate.check_invariants()").fetch_all(&db.pool).await.unwrap();
    assert!(violations.is_empty(), "{violations:?}");
}

#[tokio::test]
async fn an_enqueue_runs_none_of_its_callers_functions_whatever_its_search_path() {
    let (db, role) = database_with_producer().await;
    // A schema the producer may write, with functions and an operator shadowing built-ins the
    // enqueue calls: put ahead of pg_catalog, they would run as lockgate's owner. Each does what
    // the built-in does when run as the producer (the functions that run as their caller may
    // run them: that is the caller's own code, with its own rights), and raises otherwise.
    sqlx::raw_sql(&format!("CREATE SCHEMA {role}_own AUTHORIZATION {role}")).execute(&db.pool).await.unwrap();
    let mut producer = connect_as(&db, &role).await;
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {role}_own.guard() RETURNS void LANGUAGE plpgsql AS $$
         BEGIN
             IF current_user::text <> '{role}' THEN
                 RAISE EXCEPTION 'a function of the producer''s ran as %', current_user;
             END IF;
         END $$;
         CREATE FUNCTION {role}_own.jsonb_typeof(j jsonb) RETURNS text LANGUAGE plpgsql AS $$
         BEGIN PERFORM {role}_own.guard(); RETURN pg_catalog.jsonb_typeof(j); END $$;
         CREATE FUNCTION {role}_own.clock_timestamp() RETURNS timestamptz LANGUAGE plpgsql AS $$
         BEGIN PERFORM {role}_own.guard(); RETURN pg_catalog.clock_timestamp(); END $$;
         CREATE FUNCTION {role}_own.cardinality(a anyarray) RETURNS integer LANGUAGE plpgsql AS $$
         BEGIN PERFORM {role}_own.guard(); RETURN pg_catalog.cardinality(a); END $$;
         CREATE FUNCTION {role}_own.eq(a text, b text) RETURNS boolean LANGUAGE plpgsql AS $$
         BEGIN PERFORM {role}_own.guard(); RETURN pg_catalog.texteq(a, b); END $$;
         CREATE OPERATOR {role}_own.= (LEFTARG = text, RIGHTARG = text, FUNCTION = {role}_own.eq);
         SET search_path = {role}_own, pg_catalog"
    ))
    .execute(&mut producer)
    .await
    .unwrap();
    let statuses: Vec<String> = sqlx::query_scalar(
        "SELECT status FROM lockgate.enqueue('plain', '{}')
         UNION ALL SELECT status FROM lockgate.enqueue('limited', '{\"k\": 1}', '{\"delay\": 1}')
         UNION ALL SELECT status FROM lockgate.enqueue_many('limited', ARRAY['{\"k\": 2}', '{\"k\": 2}']::jsonb[])
         UNION ALL SELECT unnest(statuses) FROM lockgate._enqueue_many_and_wake('plain', ARRAY['{}'::jsonb], '{}', false)",
    )
    .fetch_all(&mut producer)
    .await
    .unwrap();
    assert_eq!(statuses, ["enqueued", "enqueued", "enqueued", "parked"]);
    producer.close().await.unwrap();
}

#[derive(Serialize, Deserialize)]
struct Plain {}

impl Job for Plain {
    const TYPE: &'static str = "plain";
}

#[derive(Serialize, Deserialize)]
struct Limited {
    k: u32,
}

impl Job for Limited {
    const TYPE: &'static str = "limited";

    fn policy() -> JobPolicy {
        JobPolicy::builder().concurrency(ConcurrencyPolicy::new(1).key(["k"])).build().unwrap()
    }
}

#[tokio::test]
async fn the_rust_client_enqueues_as_a_producers_role() {
    let (db, role) = database_with_producer().await;
    let options: PgConnectOptions = db.url.parse().unwrap();
    let pool = PgPoolOptions::new().max_connections(2).connect_with(options.username(&role)).await.unwrap();
    let client = Client::new(pool.clone());
    client.check_schema().await.unwrap();
    assert_eq!(client.enqueue(&Plain {}).await.unwrap().status, EnqueueStatus::Enqueued);
    let jobs = client.enqueue_many(&[Limited { k: 7 }, Limited { k: 7 }, Limited { k: 8 }]).await.unwrap();
    let statuses: Vec<_> = jobs.iter().map(|j| j.status).collect();
    assert_eq!(statuses, [EnqueueStatus::Enqueued, EnqueueStatus::Parked, EnqueueStatus::Enqueued]);
    assert_eq!(client.enqueue_many(&[Plain {}, Plain {}]).await.unwrap().len(), 2);
    let batch = client.create_batch(&BatchCallbacks::default()).await.unwrap();
    let options = EnqueueOptions { batch: Some(batch), ..Default::default() };
    assert_eq!(client.enqueue_with(&Plain {}, &options).await.unwrap().status, EnqueueStatus::Enqueued);
    assert_eq!(client.close_batch(batch).await.unwrap(), "closed");
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(client.enqueue_in(&mut tx, &Limited { k: 8 }).await.unwrap().status, EnqueueStatus::Parked);
    tx.commit().await.unwrap();
    pool.close().await;

    let counts: (i64, i64) =
        sqlx::query_as("SELECT (SELECT count(*) FROM pgmq.q_default), (SELECT count(*) FROM lockgate.parked)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(counts, (6, 2), "plain 1 + 2 + 1 in the batch, limited 7 and 8; 7 and 8 parked once each");
}

/// The grants the README gave a producer's role before functions revision 83: write grants on
/// lockgate's and PGMQ's tables, with which it ran the enqueue functions as itself.
const OLD_GRANTS: &str = "GRANT USAGE ON SCHEMA lockgate, pgmq TO {role};
GRANT USAGE ON ALL SEQUENCES IN SCHEMA lockgate, pgmq TO {role};
GRANT SELECT ON lockgate.job_types, lockgate.settings, lockgate.queues TO {role};
GRANT SELECT, INSERT, UPDATE ON lockgate.semaphores, lockgate.leases, lockgate.unique_locks,
                                lockgate.batches, lockgate.batch_jobs TO {role};
GRANT SELECT, INSERT ON lockgate.parked TO {role};
GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA pgmq TO {role};";

/// Review helper-85: upgrading to the revision whose functions run as the owner, a producer
/// given the old README's grants lost its enqueues, saying only `permission denied for function
/// enqueue`, until the owner ran the new grants. The migrate now grants it the functions, once,
/// and `lockgate doctor` names its write grants with the REVOKE that removes them.
#[tokio::test]
async fn upgrading_keeps_an_old_producer_role_enqueueing_and_doctor_names_its_write_grants() {
    let db = TestDb::migrated().await.unwrap();
    let role = format!("{}_old", db.name);
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN; {}", OLD_GRANTS.replace("{role}", &role)))
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("SELECT lockgate.define_job_type('limited', concurrency_limit => 1, concurrency_key => ARRAY['k'])")
        .execute(&db.pool)
        .await
        .unwrap();
    // The database as an earlier revision left it: its functions then run again by the migrate.
    sqlx::raw_sql("UPDATE lockgate.schema_state SET functions_revision = 81").execute(&db.pool).await.unwrap();
    let mut producer = connect_as(&db, &role).await;
    let (code, _) = refusal(&mut producer, "SELECT lockgate.enqueue('limited', '{\"k\": 1}')").await;
    assert_eq!(code, "42501", "before the migrate, the role has not been granted the functions");
    lockgate::migrate(&db.pool).await.unwrap();
    let statuses: Vec<String> = sqlx::query_scalar(
        "SELECT status FROM lockgate.enqueue('limited', '{\"k\": 1}')
         UNION ALL SELECT unnest(statuses) FROM lockgate._enqueue_many_and_wake('limited', ARRAY['{\"k\": 1}'::jsonb], '{}', true)",
    )
    .fetch_all(&mut producer)
    .await
    .unwrap();
    assert_eq!(statuses, ["enqueued", "parked"]);
    producer.close().await.unwrap();
    // With the reads of the README's grants too: the Rust client's schema check.
    let options: PgConnectOptions = db.url.parse().unwrap();
    let pool = PgPoolOptions::new().max_connections(1).connect_with(options.username(&role)).await.unwrap();
    Client::new(pool.clone()).check_schema().await.unwrap();
    pool.close().await;

    // Once only: a grant the owner revokes afterwards is not given again by the next migrate,
    // though the role still holds the old write grants.
    sqlx::raw_sql(&format!("REVOKE EXECUTE ON FUNCTION lockgate.enqueue(text, jsonb, jsonb, boolean) FROM {role}"))
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::raw_sql("UPDATE lockgate.schema_state SET functions_checksum = 'another build'")
        .execute(&db.pool)
        .await
        .unwrap();
    lockgate::migrate(&db.pool).await.unwrap();
    let granted: bool = sqlx::query_scalar(&format!(
        "SELECT has_function_privilege('{role}', 'lockgate.enqueue(text, jsonb, jsonb, boolean)', 'EXECUTE')"
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(!granted);

    let writers = |db: &TestDb| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (String, String, Option<String>)>(
                "SELECT verdict, detail, advice FROM lockgate.doctor() WHERE check_name = 'table_writers'",
            )
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    let found = writers(&db).await;
    assert_eq!(found.len(), 1, "{found:?}");
    let (verdict, detail, advice) = &found[0];
    assert_eq!(verdict, "warn");
    assert!(detail.starts_with(&format!("{role} may write lockgate.")), "{detail}");
    let revoke = advice.as_deref().unwrap().split(", unless").next().unwrap().to_owned();
    sqlx::raw_sql(&revoke).execute(&db.pool).await.unwrap();
    assert_eq!(writers(&db).await[0].0, "ok", "the advice's REVOKE removes every write grant it named");
    // A column's grant is enough to free a permit by hand, and is named too (review helper-86).
    sqlx::raw_sql(&format!("GRANT UPDATE (value) ON lockgate.semaphores TO {role}")).execute(&db.pool).await.unwrap();
    let found = writers(&db).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        found[0].1,
        format!("{role} may write lockgate.semaphores: it can change permits, leases and parked jobs by hand")
    );
    let revoke = found[0].2.as_deref().unwrap().split(", unless").next().unwrap().to_owned();
    sqlx::raw_sql(&revoke).execute(&db.pool).await.unwrap();
    assert_eq!(writers(&db).await[0].0, "ok");
}

/// Review helper-86: the upgrade's grant looked only at roles holding INSERT on `lockgate.parked`,
/// so a producer that enqueued through a grant to PUBLIC, or with only the grants an unlimited
/// type needed (a queue table's INSERT), lost its enqueues at the migrate's commit.
#[tokio::test]
async fn upgrading_keeps_enqueueing_whoever_could_write_a_queue_table_public_included() {
    let db = TestDb::migrated().await.unwrap();
    let (least, anyone) = (format!("{}_least", db.name), format!("{}_anyone", db.name));
    sqlx::raw_sql(&format!(
        "SELECT lockgate.define_job_type('plain');
         CREATE ROLE {least} LOGIN;
         GRANT USAGE ON SCHEMA lockgate, pgmq TO {least};
         GRANT USAGE ON ALL SEQUENCES IN SCHEMA lockgate, pgmq TO {least};
         GRANT SELECT ON lockgate.job_types, lockgate.settings, lockgate.queues TO {least};
         GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA pgmq TO {least};
         CREATE ROLE {anyone} LOGIN;
         {}
         UPDATE lockgate.schema_state SET functions_revision = 81;",
        OLD_GRANTS.replace("{role}", "PUBLIC")
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    lockgate::migrate(&db.pool).await.unwrap();
    for role in [&least, &anyone] {
        let mut conn = connect_as(&db, role).await;
        let status: String = sqlx::query_scalar("SELECT status FROM lockgate.enqueue('plain', '{}')")
            .fetch_one(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{role} no longer enqueues: {e}"));
        assert_eq!(status, "enqueued");
        conn.close().await.unwrap();
    }
    let writers: Vec<String> = sqlx::query_scalar(
        "SELECT detail FROM lockgate.doctor() WHERE check_name = 'table_writers' AND verdict = 'warn'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(writers.iter().any(|d| d.starts_with("PUBLIC may write lockgate.")), "{writers:?}");
}
