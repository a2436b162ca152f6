//! A producer's role (README, "A producer's role"): the README's grants, run as written, let a role
//! that owns nothing enqueue every kind of job, and nothing less than them is documented.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use lockgate_testkit::TestDb;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

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
    // Roles are the server's, not the database's: one of this test's own, dropped at the end.
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
    sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}")).execute(&db.pool).await.unwrap();
}
