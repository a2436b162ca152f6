//! A producer-only process: typed enqueues (each type defined on first use, no worker needed),
//! options, a batch of jobs, an enqueue inside the caller's transaction, and a refusal matched
//! by its data. `DATABASE_URL` names the database; `cargo run --example producer`.

use std::time::Duration;

use lockgate::{Client, ConcurrencyPolicy, EnqueueError, EnqueueOptions, Job, JobPolicy, OnConflict, PgPool};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct SendEmail {
    to: String,
}

impl Job for SendEmail {
    const TYPE: &'static str = "send_email";

    fn policy() -> JobPolicy {
        JobPolicy::builder().queue("mail").max_attempts(5).build().expect("a valid policy")
    }
}

/// One sync per account at a time; a second one while the first holds the permit is refused
/// (`OnConflict::Block`, the default, would park it until the permit frees up).
#[derive(Serialize, Deserialize)]
struct SyncAccount {
    account_id: i64,
}

impl Job for SyncAccount {
    const TYPE: &'static str = "sync_account";

    fn policy() -> JobPolicy {
        JobPolicy::builder()
            .queue("sync")
            .concurrency(ConcurrencyPolicy::new(1).key(["account_id"]).on_conflict(OnConflict::Raise))
            .build()
            .expect("a valid policy")
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/lockgate".into());
    run(&url).await
}

pub async fn run(url: &str) -> anyhow::Result<()> {
    let pool = PgPool::connect(url).await?;
    lockgate::migrate(&pool).await?;
    let client = Client::new(pool.clone());

    let job = client.enqueue(&SendEmail { to: "ada@example.com".into() }).await?;
    println!("job {} is {} on queue {}", job.job_id, job.status.as_str(), job.queue);

    let later = EnqueueOptions { delay: Some(Duration::from_secs(10)), priority: Some(5), ..Default::default() };
    client.enqueue_with(&SendEmail { to: "bob@example.com".into() }, &later).await?;
    let batch = [SendEmail { to: "a@example.com".into() }, SendEmail { to: "b@example.com".into() }];
    client.enqueue_many(&batch).await?;

    // The job exists if and only if the transaction commits.
    let mut tx = pool.begin().await?;
    // ... the caller's own writes on &mut *tx ...
    client.enqueue_in(&mut tx, &SendEmail { to: "eve@example.com".into() }).await?;
    tx.commit().await?;

    for attempt in ["first", "second"] {
        match client.enqueue(&SyncAccount { account_id: 42 }).await {
            Ok(job) => println!("{attempt} sync: job {}", job.job_id),
            Err(EnqueueError::LimitReached { key }) => println!("{attempt} sync refused: {key} is busy"),
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}
