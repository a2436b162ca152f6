//! `lockgate job show <ID>`: one job by id, in whatever state it is.

use anyhow::{bail, Result};
use lockgate::{Client, JobId};

use crate::db;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// A job's state, queue, type, attempt, times, errors and arguments.
    Show {
        id: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(url: Option<String>, command: Command) -> Result<()> {
    let client = Client::new(db::connect_checked(&db::resolve(url), 1).await?);
    let Command::Show { id, json } = command;
    let Some(job) = client.job(JobId(id)).await? else {
        bail!("no job {id}: it never existed, or archive retention has deleted it");
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&job)?);
        return Ok(());
    }
    let at = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map_or("-".to_string(), |t| t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string())
    };
    println!("job {}: {} on queue {}", job.id, job.state, job.queue);
    println!("  type      {}", job.job_type.as_deref().unwrap_or("-"));
    println!("  attempt   {}   priority {}", job.attempt, job.priority);
    if let Some(key) = &job.concurrency_key {
        println!("  key       {key}");
    }
    println!("  enqueued  {}", at(job.enqueued_at));
    if job.finished_at.is_none() {
        println!("  visible   {}", at(job.visible_at));
    } else {
        println!("  finished  {}", at(job.finished_at));
    }
    if let Some(reason) = &job.reason {
        println!("  dead      {reason}: {}", job.error.as_deref().unwrap_or(""));
    }
    for e in job.errors.as_array().into_iter().flatten() {
        println!(
            "  error     attempt {} at {}: {}",
            e["attempt"],
            e["at"].as_str().unwrap_or("?"),
            e["error"].as_str().unwrap_or("")
        );
    }
    println!("  args      {}", job.args.map_or("-".to_string(), |a| a.to_string()));
    Ok(())
}
