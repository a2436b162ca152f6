//! `lockgate enqueue <type> '<json>'`: one job from the command line.

use std::io::Read;

use anyhow::{bail, Context, Result};
use lockgate::{BatchId, Client, EnqueueError, EnqueueOptions, EnqueueStatus, QueueName, MAX_PAYLOAD_BYTES};

use crate::{db, table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The job type (defined with `lockgate define --config lockgate.toml`, `lockgate run`, or
    /// `lockgate.define_job_type` in SQL).
    job_type: String,
    /// The job's arguments: a JSON object; `-` reads it from stdin, `@PATH` from a file (for
    /// arguments too long for a command line).
    #[arg(default_value = "{}")]
    args: String,
    /// Run no earlier than this long from now, e.g. 30s, 5m (at most 100 years).
    #[arg(long, value_parser = delay, conflicts_with = "run_at")]
    delay: Option<std::time::Duration>,
    /// Run no earlier than this instant (RFC 3339, with its offset: 2030-01-01T02:00:00Z).
    #[arg(long, value_parser = instant)]
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

/// Arguments are read up to this many bytes from stdin or a file: four times the most a job may
/// carry (`MAX_PAYLOAD_BYTES`, which the database enforces on the stored size) leaves room for
/// indentation, and stops a wrong file from being read whole into memory.
const ARGS_READ_LIMIT: usize = 4 * MAX_PAYLOAD_BYTES;

pub async fn run(target: &db::Target, args: Args) -> Result<()> {
    let (text, from) = read_args(&args.args)?;
    let value: serde_json::Value = serde_json::from_str(&text).with_context(|| match from {
        Some(from) => format!("job arguments from {from} are not valid JSON"),
        None => format!("job arguments are not valid JSON: {}", table::shown(&text)),
    })?;
    let options = EnqueueOptions {
        delay: args.delay,
        run_at: args.run_at,
        priority: args.priority,
        queue: args.queue.map(QueueName::new).transpose()?,
        concurrency_key: args.concurrency_key,
        unique_key: args.unique_key,
        batch: args.batch.map(BatchId),
    };
    // An invalid name is said to be invalid, not suggested as a type to define (nor pasted into SQL).
    lockgate::JobTypeName::new(args.job_type.as_str())?;
    let pool = db::connect_checked(target, 1).await?;
    let client = Client::new(pool);
    let job = match client.enqueue_raw(&args.job_type, &value, &options).await {
        Err(EnqueueError::UnknownJobType { job_type }) => bail!(
            "unknown job type \"{job_type}\": define it first, with `lockgate define --config lockgate.toml` \
             (from its [job_types.{job_type}] table) or in SQL with `SELECT lockgate.define_job_type('{job_type}')`"
        ),
        result => result?,
    };
    // Said first: a wake-up that takes its time must not hide a committed job from a caller
    // that gives up waiting (review helper-142 F7).
    match (job.status, job.msg_id) {
        (_, Some(msg_id)) => println!("enqueued job {} on queue {} (msg_id {msg_id})", job.job_id, job.queue),
        (EnqueueStatus::Duplicate, None) => {
            println!("duplicate: job {} holds the unique key; nothing was enqueued", job.job_id)
        }
        (status, None) => println!("{} job {}: its concurrency key is full", status.as_str(), job.job_id),
    }
    // The job's wake-up, before the process exits: idle workers start it now, not at their poll.
    client.wakes_sent().await;
    Ok(())
}

/// The arguments' text, and where it came from when not the command line: `-` is stdin,
/// `@PATH` a file, anything else the JSON itself.
fn read_args(arg: &str) -> Result<(String, Option<String>)> {
    let (reader, from): (Box<dyn Read>, String) = match arg {
        "-" => (Box::new(std::io::stdin().lock()), "stdin".to_string()),
        _ => match arg.strip_prefix('@') {
            Some(path) => {
                let file = std::fs::File::open(path).with_context(|| format!("could not read job arguments {path}"))?;
                (Box::new(file), path.to_string())
            }
            None => return Ok((arg.to_string(), None)),
        },
    };
    let mut text = String::new();
    reader
        .take(ARGS_READ_LIMIT as u64 + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("could not read job arguments from {from}"))?;
    if text.len() > ARGS_READ_LIMIT {
        bail!("job arguments from {from} are more than {ARGS_READ_LIMIT} bytes; a job carries at most {MAX_PAYLOAD_BYTES}");
    }
    Ok((text, Some(from)))
}

/// `--delay`: a duration no longer than the longest lockgate stores (100 years).
fn delay(text: &str) -> Result<std::time::Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d > lockgate::MAX_DURATION {
        return Err("at most 100 years (36525d)".to_string());
    }
    Ok(d)
}

/// `--run-at`: an RFC 3339 instant; one without an offset is refused, never read in some zone.
fn instant(text: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    chrono::DateTime::parse_from_rfc3339(text).map(|t| t.with_timezone(&chrono::Utc)).map_err(|e| {
        format!("{e}: an RFC 3339 time with its offset, such as 2030-01-01T02:00:00Z or 2030-01-01T03:00:00+01:00")
    })
}
