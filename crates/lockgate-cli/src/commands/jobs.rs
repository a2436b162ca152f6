//! `lockgate jobs`: find jobs in every state by queue, type, state, key, time and text.

use anyhow::{bail, Context, Result};
use chrono::{DateTime, Utc};
use lockgate::{Client, JobFilter, JobId, JobRecord, JOB_STATES};

use crate::db;
use crate::table::{Align, Table};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub filter: Filter,
    /// At most this many jobs (1 to 1000).
    #[arg(long, default_value_t = 50)]
    pub limit: i32,
    /// The next page: jobs with ids below this one (the last id of the previous page).
    #[arg(long)]
    pub before: Option<i64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Which jobs a command selects; every filter given must match.
#[derive(Debug, Clone, clap::Args)]
pub struct Filter {
    /// Only this queue.
    #[arg(long)]
    pub queue: Option<String>,
    /// Only this job type.
    #[arg(long = "type")]
    pub job_type: Option<String>,
    /// Only jobs in this state (repeatable): scheduled, queued, running, retrying, parked,
    /// succeeded, discarded, cancelled, dead.
    #[arg(long = "state")]
    pub states: Vec<String>,
    /// Only jobs of this concurrency or unique key.
    #[arg(long)]
    pub key: Option<String>,
    /// First enqueued at or after: a time (2026-12-01T10:00:00Z) or an age (90s, 15m, 2h, 1d).
    #[arg(long)]
    pub since: Option<String>,
    /// First enqueued before: a time or an age, as --since.
    #[arg(long)]
    pub until: Option<String>,
    /// Text in the arguments or in an attempt's error (case-insensitive).
    #[arg(long)]
    pub search: Option<String>,
}

impl Filter {
    /// True when no filter is given (a cancel must then say --all).
    pub fn is_empty(&self) -> bool {
        self.queue.is_none()
            && self.job_type.is_none()
            && self.states.is_empty()
            && self.key.is_none()
            && self.since.is_none()
            && self.until.is_none()
            && self.search.is_none()
    }

    pub fn to_sql(&self) -> Result<JobFilter> {
        for state in &self.states {
            if !JOB_STATES.contains(&state.as_str()) {
                bail!("invalid --state {state:?}: one of {}", JOB_STATES.join(", "));
            }
        }
        Ok(JobFilter {
            queue: self.queue.clone(),
            job_type: self.job_type.clone(),
            states: self.states.clone(),
            key: self.key.clone(),
            since: self.since.as_deref().map(|t| time_arg("--since", t)).transpose()?,
            until: self.until.as_deref().map(|t| time_arg("--until", t)).transpose()?,
            search: self.search.clone(),
        })
    }
}

/// A point in time given as RFC 3339 or as an age before now.
fn time_arg(flag: &str, value: &str) -> Result<DateTime<Utc>> {
    if let Ok(at) = DateTime::parse_from_rfc3339(value) {
        return Ok(at.with_timezone(&Utc));
    }
    let age = humantime::parse_duration(value).with_context(|| {
        format!("invalid {flag} {value:?}: a time such as 2026-12-01T10:00:00Z or an age such as 15m, 2h, 1d")
    })?;
    let age = chrono::Duration::from_std(age).with_context(|| format!("invalid {flag} {value:?}: too long ago"))?;
    Ok(Utc::now() - age)
}

pub async fn run(target: &db::Target, args: Args) -> Result<()> {
    let client = Client::new(db::connect_checked(target, 1).await?);
    let filter = args.filter.to_sql()?;
    if !(1..=1000).contains(&args.limit) {
        bail!("invalid --limit {}: 1 to 1000", args.limit);
    }
    let jobs = client.jobs(&filter, args.limit, args.before.map(JobId)).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&jobs)?);
        return Ok(());
    }
    if jobs.is_empty() {
        println!("no job matches");
        return Ok(());
    }
    print_table(&jobs);
    if jobs.len() == args.limit as usize {
        if let Some(last) = jobs.last() {
            println!("(more may match: --before {})", last.id);
        }
    }
    Ok(())
}

fn print_table(jobs: &[JobRecord]) {
    let mut t = Table::new(&[
        ("ID", Align::Right),
        ("STATE", Align::Left),
        ("QUEUE", Align::Left),
        ("TYPE", Align::Left),
        ("ATTEMPT", Align::Right),
        ("ENQUEUED", Align::Left),
        ("KEY", Align::Left),
        ("ARGS", Align::Left),
    ]);
    for job in jobs {
        t.row(vec![
            job.id.to_string(),
            job.state.to_string(),
            job.queue.clone(),
            job.job_type.clone().unwrap_or_else(|| "-".to_string()),
            job.attempt.to_string(),
            job.enqueued_at.map_or("-".to_string(), |t| t.format("%Y-%m-%d %H:%M:%S").to_string()),
            job.concurrency_key.clone().unwrap_or_else(|| "-".to_string()),
            job.args.as_ref().map_or("-".to_string(), |a| a.to_string()),
        ]);
    }
    t.print();
}
