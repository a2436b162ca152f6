//! The CLI through a transaction-mode PgBouncer (issue 13): `?pooler=transaction` in the URL
//! makes enqueue, status and the dlq verbs work through it; without it they fail the way sqlx
//! does through such a pooler; a pooler mode lockgate does not know is refused, naming it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use lockgate_testkit::pgbouncer::{PgBouncer, PoolMode};
use lockgate_testkit::TestDb;

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

    let bogus = format!("{}&pooler=statement", bouncer.url(&db.name));
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", &bogus).output().unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("pooler=\"statement\"") && text(&o).contains("pooler=transaction"), "{}", text(&o));
}
