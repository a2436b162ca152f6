//! `lockgate recurring list|enable|disable|add|remove`: the recurring tasks every `lockgate run`
//! schedules. `list` computes each task's next run from its schedule and the database's clock, so
//! it is right whether or not a scheduler is running (a next run in the past means none has
//! enqueued that tick yet).

use anyhow::{bail, Context, Result};
use chrono::{DateTime, Utc};
use lockgate::{Client, QueueName, RecurringRow, RecurringTask, Schedule, DEFAULT_TIMEZONE};
use serde::Serialize;
use serde_json::Value;

use crate::{db, table};

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// List every task: schedule, job type, whether it is enabled, its next and its last run.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Enable a task; the ticks it missed while disabled are not enqueued.
    Enable { name: String },
    /// Disable a task: none of its ticks is enqueued until it is enabled again.
    Disable { name: String },
    /// Define (or replace) a task: `lockgate recurring add <name> '<cron>' <job type> '<json>'`.
    Add(AddArgs),
    /// Delete a task and its tick history.
    Remove { name: String },
}

#[derive(Debug, clap::Args)]
pub struct AddArgs {
    /// The task's name.
    name: String,
    /// When it runs: 5 fields (minute hour day-of-month month day-of-week), 6 with seconds first,
    /// or @yearly, @monthly, @weekly, @daily, @hourly.
    cron: String,
    /// The job type each tick enqueues.
    job_type: String,
    /// The job's arguments: a JSON object.
    #[arg(default_value = "{}")]
    args: String,
    /// The IANA time zone the cron fields are read in.
    #[arg(long, default_value = DEFAULT_TIMEZONE)]
    timezone: String,
    /// Override the job type's queue.
    #[arg(long)]
    queue: Option<String>,
    /// 0 (first) to 9 (last); defaults to the job type's priority.
    #[arg(long)]
    priority: Option<i16>,
    /// Store the task disabled.
    #[arg(long)]
    disabled: bool,
}

pub async fn run(target: &db::Target, command: Command) -> Result<()> {
    // Each statement waits at most `db::READ_LOCK_TIMEOUT` for a task's row that another
    // transaction holds (an uncommitted definition, a `lockgate run` syncing its configuration,
    // a session gone silent mid-way): before, the command waited for as long as that transaction
    // lived, printing nothing (review helper-143 F5).
    let pool = db::connect_reading(target).await?;
    lockgate::check_schema(&pool).await?;
    let client = Client::new(pool);
    let name = match &command {
        Command::List { .. } => None,
        Command::Enable { name } | Command::Disable { name } | Command::Remove { name } => Some(name.clone()),
        Command::Add(args) => Some(args.name.clone()),
    };
    execute(&client, command).await.map_err(|err| {
        let held = err.chain().any(|e| {
            e.downcast_ref::<lockgate::sql::DbError>().is_some_and(db::lock_timed_out)
                || matches!(e.downcast_ref::<lockgate::EnqueueError>(), Some(lockgate::EnqueueError::Database(d)) if db::lock_timed_out(d))
        });
        match (held, name) {
            (true, Some(name)) => anyhow::anyhow!(
                "recurring task \"{name}\" is held by another transaction (an uncommitted definition, or a `lockgate \
                 run` syncing its configuration) for more than {}: `lockgate doctor` names the session under \
                 `sessions`; run the command again once it has ended",
                db::READ_LOCK_TIMEOUT
            ),
            _ => err,
        }
    })
}

async fn execute(client: &Client, command: Command) -> Result<()> {
    match command {
        Command::List { json } => list(client, json).await?,
        Command::Enable { name } => {
            client.set_recurring_enabled(&name, true).await?;
            println!("enabled recurring task {name}");
        }
        Command::Disable { name } => {
            client.set_recurring_enabled(&name, false).await?;
            println!("disabled recurring task {name}");
        }
        Command::Add(args) => add(client, args).await?,
        Command::Remove { name } => {
            if !client.remove_recurring(&name).await? {
                bail!("unknown recurring task \"{name}\"");
            }
            println!("removed recurring task {name}");
        }
    }
    Ok(())
}

async fn add(client: &Client, args: AddArgs) -> Result<()> {
    let value: Value = serde_json::from_str(&args.args)
        .with_context(|| format!("job arguments are not valid JSON: {}", table::shown(&args.args)))?;
    let task = RecurringTask {
        timezone: args.timezone,
        args: value,
        queue: args.queue.map(QueueName::new).transpose()?,
        priority: args.priority,
        enabled: args.disabled.then_some(false),
        ..RecurringTask::new(args.name, args.cron, args.job_type)
    };
    client.define_recurring(&task).await?;
    println!("defined recurring task {}", task.name);
    Ok(())
}

/// One task as `list` shows it, in the table and as JSON.
#[derive(Debug, Serialize)]
struct Listed {
    name: String,
    cron: String,
    timezone: String,
    job_type: String,
    args: Value,
    options: Value,
    enabled: bool,
    source: String,
    /// The due tick no scheduler has enqueued yet (in the past), else the next tick; none while
    /// disabled or when the schedule is invalid.
    next_run_at: Option<DateTime<Utc>>,
    last_tick_at: Option<DateTime<Utc>>,
    last_job_id: Option<i64>,
    last_status: Option<String>,
    last_error: Option<String>,
    /// Why the stored schedule cannot be scheduled (one defined through SQL, which checks only
    /// the expression's shape).
    schedule_error: Option<String>,
}

impl Listed {
    fn new(row: RecurringRow, now: DateTime<Utc>) -> Self {
        let schedule = Schedule::parse(&row.cron, &row.timezone);
        let since = row.ticks_done_until();
        let next_run_at = match &schedule {
            Ok(schedule) if row.enabled => schedule.next_run(since, now),
            _ => None,
        };
        Self {
            next_run_at,
            schedule_error: schedule.err().map(|e| e.to_string()),
            name: row.name,
            cron: row.cron,
            timezone: row.timezone,
            job_type: row.job_type,
            args: row.args,
            options: row.options,
            enabled: row.enabled,
            source: row.source,
            last_tick_at: row.last_tick_at,
            last_job_id: row.last_job_id,
            last_status: row.last_status,
            last_error: row.last_error,
        }
    }

    fn next_run(&self) -> String {
        match (&self.schedule_error, self.next_run_at) {
            (Some(_), _) => "invalid schedule".into(),
            (None, Some(at)) => time(at),
            (None, None) => "-".into(),
        }
    }

    fn last_run(&self) -> String {
        let Some(at) = self.last_tick_at else { return "-".into() };
        match (self.last_status.as_deref(), self.last_job_id) {
            (Some("failed"), _) => format!("{} failed", time(at)),
            (Some("enqueued") | None, Some(job)) => format!("{} job {job}", time(at)),
            (Some(status), Some(job)) => format!("{} job {job} {status}", time(at)),
            (_, None) => time(at),
        }
    }
}

fn time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

async fn list(client: &Client, json: bool) -> Result<()> {
    let now = lockgate::sql::database_now(client.pool()).await?;
    let tasks: Vec<Listed> = client.list_recurring().await?.into_iter().map(|row| Listed::new(row, now)).collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&tasks)?);
        return Ok(());
    }
    println!(
        "{:<24} {:<18} {:<16} {:<20} {:<8} {:<24} LAST RUN",
        "NAME", "CRON", "TIMEZONE", "JOB TYPE", "ENABLED", "NEXT RUN"
    );
    for t in &tasks {
        let enabled = if t.enabled { "yes" } else { "no" };
        println!(
            "{:<24} {:<18} {:<16} {:<20} {enabled:<8} {:<24} {}",
            t.name,
            t.cron,
            t.timezone,
            t.job_type,
            t.next_run(),
            t.last_run()
        );
    }
    Ok(())
}
