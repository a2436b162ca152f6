//! `lockgate job show|cancel|retry|discard`: one job by id, in whatever state it is, and what an
//! operator can do with it.

use anyhow::{bail, Result};
use lockgate::sql::{discard_job, dlq_retry, DlqFilter, DlqRetryOutcome};
use lockgate::{Client, JobId};

use crate::commands::jobs::Filter;
use crate::db;
use crate::table;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// A job's state, queue, type, times, every attempt (start, end, process, outcome, error)
    /// and its arguments.
    Show {
        id: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a job by id, or every job the filters select (queued, scheduled, retrying, running
    /// or parked; a running job's handler stops at its next heartbeat). Cancelled jobs are kept
    /// and shown like archived ones.
    Cancel {
        /// The job to cancel; without it, the filters select the jobs.
        id: Option<i64>,
        #[command(flatten)]
        filter: Filter,
        /// Cancel every cancellable job (required when neither an id nor a filter is given).
        #[arg(long)]
        all: bool,
        /// At most this many jobs, newest first.
        #[arg(long, default_value_t = 1000)]
        limit: i32,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run a dead job again (as `lockgate dlq retry --job-id ID`).
    Retry { id: i64 },
    /// Delete a dead or parked job for good (as `dlq purge --job-id` or `parked discard`).
    Discard { id: i64 },
}

pub async fn run(target: &db::Target, command: Command) -> Result<()> {
    let pool = db::connect_checked(target, 1).await?;
    let client = Client::new(pool.clone());
    match command {
        Command::Show { id, json } => show(&client, id, json).await,
        Command::Cancel { id: Some(id), filter, json, .. } => {
            if !filter.is_empty() {
                bail!("give a job id or filters, not both");
            }
            let Some(outcome) = client.cancel(JobId(id)).await? else {
                bail!("no job {id}: it never existed, an operator discarded or purged it, or archive retention has deleted it");
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&outcome)?);
            }
            if !outcome.cancelled {
                if ["succeeded", "discarded", "cancelled", "dead"].contains(&outcome.state.as_str()) {
                    bail!("job {id} was not cancelled: it is {} already", outcome.state);
                }
                bail!("job {id} was not cancelled: it kept changing state (now {}); try again", outcome.state);
            }
            if !json {
                println!("job {id} cancelled (it was {} on queue {})", outcome.state, outcome.queue);
            }
            Ok(())
        }
        Command::Cancel { id: None, filter, all, limit, json } => {
            if filter.is_empty() && !all {
                bail!("name what to cancel: a job id, filters (--queue, --type, --state, --key, --since, --until, --search), or --all");
            }
            if !(1..=1000).contains(&limit) {
                bail!("invalid --limit {limit}: 1 to 1000");
            }
            let count = client.cancel_jobs(&filter.to_sql()?, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&count)?);
            } else if count.matched == 0 {
                println!("no cancellable job matches");
            } else {
                let finished = count.matched - count.cancelled;
                let note = if finished > 0 { format!(" ({finished} finished first)") } else { String::new() };
                println!("{} of {} cancelled{note}", count.cancelled, count.matched);
                if count.matched >= limit {
                    // The limit was reached: more may match (review helper-77, #11).
                    println!("stopped at --limit {limit}: more jobs may match; run the same command again");
                }
            }
            Ok(())
        }
        Command::Retry { id } => {
            let Some(job) = client.job(JobId(id)).await? else {
                bail!("no job {id}: it never existed, an operator discarded or purged it, or archive retention has deleted it");
            };
            if job.state != "dead" {
                bail!("job {id} is {}: only a dead job can be retried", job.state);
            }
            let filter = DlqFilter { queue: None, job_ids: Some(vec![id]) };
            let rows = dlq_retry(&pool, &filter).await?;
            if rows.is_empty() {
                bail!("job {id} was not retried: it left the dead letters meanwhile (retried, purged or discarded by another operation)");
            }
            for retried in rows {
                match retried.outcome {
                    DlqRetryOutcome::Retried { msg_id } => {
                        println!("job {id} sent back to queue {} (message {msg_id})", retried.queue)
                    }
                    DlqRetryOutcome::Duplicate { holder } => {
                        bail!("job {id} stays dead: job {holder} holds its unique key")
                    }
                    DlqRetryOutcome::QueueMissing => {
                        bail!(
                            "job {id} stays dead: queue {q} no longer exists (its table was dropped): \
                             `SELECT lockgate.create_queue('{q}')` makes it again",
                            q = retried.queue
                        )
                    }
                    DlqRetryOutcome::TypeMissing => bail!("job {id} stays dead: {}", super::dlq::TYPE_MISSING),
                    DlqRetryOutcome::Busy => bail!("job {id} stays dead for now: {}; try again", super::dlq::BUSY),
                }
            }
            Ok(())
        }
        Command::Discard { id } => {
            match discard_job(&pool, JobId(id)).await? {
                None => bail!("no job {id}: it never existed, an operator discarded or purged it, or archive retention has deleted it"),
                Some((state, true)) => {
                    println!("job {id} discarded (it was {state})");
                    Ok(())
                }
                Some((state, false)) => {
                    bail!("job {id} is {state}: only a dead or parked job can be discarded (cancel a waiting or running one)")
                }
            }
        }
    }
}

async fn show(client: &Client, id: i64, json: bool) -> Result<()> {
    let Some(job) = client.job(JobId(id)).await? else {
        bail!("no job {id}: it never existed, an operator discarded or purged it, or archive retention has deleted it");
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&job)?);
        return Ok(());
    }
    let at = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map_or("-".to_string(), |t| t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string())
    };
    // What others wrote (a key, an error, a type or queue name) is shown with its control
    // characters escaped (review helper-120 F3).
    let shown = |t: &str| table::escaped(t).into_owned();
    println!("job {}: {} on queue {}", job.id, job.state, shown(&job.queue));
    println!("  type      {}", shown(job.job_type.as_deref().unwrap_or("-")));
    println!("  attempt   {}   priority {}", job.attempt, job.priority);
    if let Some(key) = &job.concurrency_key {
        println!("  key       {}", shown(key));
    }
    println!("  enqueued  {}", at(job.enqueued_at));
    if job.finished_at.is_none() {
        println!("  visible   {}", at(job.visible_at));
    } else {
        println!("  finished  {}", at(job.finished_at));
    }
    if let Some(reason) = &job.reason {
        println!("  dead      {}: {}", shown(reason), shown(job.error.as_deref().unwrap_or("")));
    }
    // Deliveries that were no attempt: given back by a shutdown, or claimed ahead and never
    // started (review helper-92: a job a shutdown returned showed no trace of it).
    let returns = job.headers.as_ref().and_then(|h| h.get("returns")).and_then(serde_json::Value::as_i64);
    if let Some(returns) = returns.filter(|n| *n > 0) {
        println!("  returns   {returns} (deliveries given back by a shutdown or never started: not attempts)");
    }
    let text = |v: &serde_json::Value| v.as_str().map_or_else(|| "-".to_string(), shown);
    for a in job.attempts.as_array().into_iter().flatten() {
        let process = if a["process"].is_null() { String::new() } else { format!(" process {}", a["process"]) };
        let error = a["error"].as_str().map_or_else(String::new, |e| format!(": {}", shown(e)));
        println!(
            "  attempt {} {} (started {}, ended {}{process}){error}",
            a["attempt"],
            text(&a["outcome"]),
            text(&a["started_at"]),
            text(&a["ended_at"]),
        );
    }
    println!("  args      {}", job.args.map_or("-".to_string(), |a| a.to_string()));
    Ok(())
}
