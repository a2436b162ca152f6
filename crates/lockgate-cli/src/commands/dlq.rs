//! `lockgate dlq list|retry|purge`: operate the dead letters, by queue, by job id, or all.

use anyhow::{bail, Result};
use lockgate::sql::{dlq_list, dlq_purge, dlq_retry, DlqFilter, DlqRetryOutcome};

use crate::db;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// List dead letters, oldest first.
    List {
        #[command(flatten)]
        select: Select,
        /// At most this many rows.
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Send dead letters back to their queue to run again (same job id, attempts start over).
    Retry {
        #[command(flatten)]
        select: Select,
    },
    /// Delete dead letters for good.
    Purge {
        #[command(flatten)]
        select: Select,
    },
}

#[derive(Debug, clap::Args)]
pub struct Select {
    /// Only this queue.
    #[arg(long)]
    queue: Option<String>,
    /// Only these job ids (repeatable).
    #[arg(long = "job-id")]
    job_ids: Vec<i64>,
    /// Every dead letter (required for retry and purge without --queue or --job-id).
    #[arg(long)]
    all: bool,
}

impl Select {
    fn filter(&self, destructive: bool) -> Result<DlqFilter> {
        let narrowed = self.queue.is_some() || !self.job_ids.is_empty();
        if destructive && !narrowed && !self.all {
            bail!("name what to act on: --queue NAME, --job-id ID (repeatable), or --all");
        }
        Ok(DlqFilter { queue: self.queue.clone(), job_ids: (!self.job_ids.is_empty()).then(|| self.job_ids.clone()) })
    }
}

pub async fn run(url: Option<String>, command: Command) -> Result<()> {
    let pool = db::connect_checked(&db::resolve(url), 1).await?;
    match command {
        Command::List { select, limit } => {
            let rows = dlq_list(&pool, &select.filter(false)?, limit).await?;
            println!(
                "{:<8} {:<16} {:<24} {:<20} {:>8}  {:<25} ERROR",
                "JOB", "QUEUE", "TYPE", "REASON", "ATTEMPTS", "DEAD AT"
            );
            for r in rows {
                let job = r.job_id.map_or("-".to_string(), |j| j.to_string());
                let error = r.error.unwrap_or_default().replace('\n', " ");
                let dead_at = r.dead_at.format("%Y-%m-%d %H:%M:%S UTC");
                let job_type = r.job_type.unwrap_or_else(|| "-".into());
                println!(
                    "{job:<8} {:<16} {job_type:<24} {:<20} {:>8}  {dead_at:<25} {error}",
                    r.queue, r.reason, r.attempts
                );
            }
        }
        Command::Retry { select } => {
            let rows = dlq_retry(&pool, &select.filter(true)?).await?;
            let retried = rows.iter().filter(|r| matches!(r.outcome, DlqRetryOutcome::Retried { .. })).count();
            println!("retried {retried} dead letter(s)");
            for r in &rows {
                let job =
                    r.job_id.map_or("of a message that was not lockgate's".to_string(), |j| format!("of job {j}"));
                match r.outcome {
                    DlqRetryOutcome::Retried { .. } => {}
                    DlqRetryOutcome::Duplicate { holder } => {
                        println!("kept a dead letter of queue {}: its unique key is held by job {holder}", r.queue)
                    }
                    DlqRetryOutcome::QueueMissing => {
                        println!("kept the dead letter {job}: its queue {} no longer exists", r.queue)
                    }
                }
            }
        }
        Command::Purge { select } => {
            let n = dlq_purge(&pool, &select.filter(true)?).await?;
            println!("purged {n} dead letter(s)");
        }
    }
    Ok(())
}
