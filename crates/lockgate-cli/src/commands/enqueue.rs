//! `lockgate enqueue <type> '<json>'`: one job from the command line.

use anyhow::{Context, Result};
use lockgate::{BatchId, Client, EnqueueOptions, EnqueueStatus, QueueName};

use crate::db;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The job type (defined with `lockgate.define_job_type` or in lockgate.toml).
    job_type: String,
    /// The job's arguments: a JSON object.
    #[arg(default_value = "{}")]
    args: String,
    /// Run no earlier than this long from now, e.g. 30s, 5m.
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "run_at")]
    delay: Option<std::time::Duration>,
    /// Run no earlier than this instant (RFC 3339).
    #[arg(long)]
    run_at: Option<chrono::DateTime<chrono::Utc>>,
    /// 0 (first) to 9 (last); defaults to the job type's priority.
    #[arg(long)]
    priority: Option<i16>,
    /// Override the job type's queue.
    #[arg(long)]
    queue: Option<String>,
    /// An explicit concurrency key (job types with a concurrency limit only).
    #[arg(long)]
    concurrency_key: Option<String>,
    /// An explicit unique key (job types with uniqueness only).
    #[arg(long)]
    unique_key: Option<String>,
    /// Enqueue into this open batch (see `lockgate batch create`).
    #[arg(long)]
    batch: Option<i64>,
}

pub async fn run(url: Option<String>, args: Args) -> Result<()> {
    let value: serde_json::Value =
        serde_json::from_str(&args.args).with_context(|| format!("job arguments are not valid JSON: {}", args.args))?;
    let options = EnqueueOptions {
        delay: args.delay,
        run_at: args.run_at,
        priority: args.priority,
        queue: args.queue.map(QueueName::new).transpose()?,
        concurrency_key: args.concurrency_key,
        unique_key: args.unique_key,
        batch: args.batch.map(BatchId),
    };
    let pool = db::connect_checked(&db::resolve(url), 1).await?;
    let job = Client::new(pool).enqueue_raw(&args.job_type, &value, &options).await?;
    match (job.status, job.msg_id) {
        (_, Some(msg_id)) => println!("enqueued job {} on queue {} (msg_id {msg_id})", job.job_id, job.queue),
        (EnqueueStatus::Duplicate, None) => {
            println!("duplicate: job {} holds the unique key; nothing was enqueued", job.job_id)
        }
        (status, None) => println!("{} job {}: its concurrency key is full", status.as_str(), job.job_id),
    }
    Ok(())
}
