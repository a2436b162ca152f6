//! The quick start: a typed job, enqueued by a producer and run by a worker, which stops once
//! both jobs ran. `DATABASE_URL` names the database (default
//! `postgres://postgres@127.0.0.1:5432/lockgate`); `cargo run --example quick_start`.

use std::time::Duration;

use lockgate::{Client, Job, JobContext, JobError, JobPolicy, PgPool, Runtime};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

#[derive(Serialize, Deserialize)]
struct SendEmail {
    to: String,
}

impl Job for SendEmail {
    const TYPE: &'static str = "send_email";

    fn policy() -> JobPolicy {
        JobPolicy::builder()
            .queue("mail")
            .max_attempts(5)
            .timeout(Duration::from_secs(60))
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
    lockgate::migrate(&pool).await?; // or run `lockgate migrate` once

    // A producer: the job type is defined on first use.
    let client = Client::new(pool.clone());
    for to in ["ada@example.com", "bob@example.com"] {
        client.enqueue(&SendEmail { to: to.into() }).await?;
    }

    // A worker, until both jobs ran; `.run()` instead runs until ctrl-c or SIGTERM.
    let (sent, mut done) = mpsc::unbounded_channel();
    Runtime::builder(pool)
        .register::<SendEmail>(move |ctx: JobContext, job: SendEmail| {
            let sent = sent.clone();
            async move {
                println!("job {} (attempt {}/{}): mail to {}", ctx.job_id, ctx.attempt, ctx.max_attempts, job.to);
                sent.send(job.to)?;
                Ok::<(), JobError>(())
            }
        })
        .queue("mail", 10)
        .run_until(async move {
            for _ in 0..2 {
                done.recv().await;
            }
        })
        .await?;
    Ok(())
}
