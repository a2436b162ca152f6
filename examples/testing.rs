//! Testing a handler and a producer with `lockgate::testing`: run a job inline with a context,
//! and list what a transaction enqueued before rolling it back. In a project these are
//! `#[tokio::test]` functions; `DATABASE_URL` names the database for the second.

use lockgate::{testing, CancelReason, Client, Job, JobContext, JobError, PgPool};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SendEmail {
    to: String,
}

impl Job for SendEmail {
    const TYPE: &'static str = "send_email";
}

/// The handler under test: gives up on the last attempt's cancellation, refuses empty addresses.
async fn send_email(ctx: JobContext, job: SendEmail) -> Result<(), JobError> {
    if job.to.is_empty() {
        return Err(JobError::new(format!("no address (attempt {} of {})", ctx.attempt, ctx.max_attempts)));
    }
    if let Some(reason) = ctx.cancel_reason() {
        return Err(JobError::new(format!("stopped: {reason}")));
    }
    Ok(())
}

/// The producer under test: an application write and its job, in the caller's transaction.
async fn sign_up(client: &Client, tx: &mut PgConnection, email: &str) -> anyhow::Result<()> {
    sqlx::query("CREATE TEMP TABLE IF NOT EXISTS users (email text)").execute(&mut *tx).await?;
    sqlx::query("INSERT INTO users VALUES ($1)").bind(email).execute(&mut *tx).await?;
    client.enqueue_in(tx, &SendEmail { to: email.into() }).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/lockgate".into());
    run(&url).await
}

pub async fn run(url: &str) -> anyhow::Result<()> {
    // A handler, inline: no database, no worker.
    assert!(testing::run(&send_email, &SendEmail { to: "ada@example.com".into() }).await.is_ok());
    let mut ctx = testing::context::<SendEmail>();
    ctx.attempt = 3;
    let err =
        testing::run_with(&send_email, ctx, &SendEmail { to: String::new() }).await.expect_err("the handler fails");
    assert_eq!(err.message(), "no address (attempt 3 of 20)");
    let ctx = testing::context::<SendEmail>();
    // The test context's attempt never ends: a hold the handler takes holds, as in a worker.
    assert!(ctx.hold().is_held());
    testing::cancel(&ctx, CancelReason::Timeout);
    let err = testing::run_with(&send_email, ctx, &SendEmail { to: "ada@example.com".into() })
        .await
        .expect_err("the handler fails");
    assert_eq!(err.message(), "stopped: timeout");

    // What a transaction enqueued, read back as typed jobs; nothing is left behind.
    let pool = PgPool::connect(url).await?;
    lockgate::migrate(&pool).await?;
    let client = Client::new(pool.clone());
    let mut tx = pool.begin().await?;
    sign_up(&client, &mut tx, "bob@example.com").await?;
    let enqueued = testing::enqueued::<SendEmail>(&mut tx).await?;
    assert_eq!(enqueued.len(), 1);
    assert_eq!(enqueued[0].job, SendEmail { to: "bob@example.com".into() });
    assert_eq!(enqueued[0].record.queue, "default");
    tx.rollback().await?;
    println!("send_email and sign_up behave");
    Ok(())
}
