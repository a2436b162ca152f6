//! The `lockgate` command: install lockgate into a database, run workers, enqueue jobs, and
//! operate queues and dead letters. The only crate that uses `anyhow`: errors end here, printed
//! once with their causes.

mod commands;
mod config;
mod db;
mod executors;
mod table;

use clap::{Parser, Subcommand};

/// A job executor for PostgreSQL, built on PGMQ.
#[derive(Debug, Parser)]
#[command(name = "lockgate", version, about)]
struct Cli {
    /// Database to use. Defaults to $DATABASE_URL, then the `database_url` of the config file
    /// (for `run`), then postgres://postgres@127.0.0.1:5432/lockgate.
    #[arg(long, global = true, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// How logs are written to stderr: `text` for people, `json` (one object per line, the
    /// event's and its job's fields included) for log pipelines.
    #[arg(long, global = true, env = "LOCKGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install or upgrade PGMQ and lockgate in the database (creating the database if missing).
    Migrate,
    /// Run the worker pools and maintenance configured in a TOML file until TERM/INT.
    Run(commands::run::Args),
    /// Enqueue one job: `lockgate enqueue <type> '<json object>'`.
    Enqueue(commands::enqueue::Args),
    /// Show every queue (ready, scheduled, running, succeeded and failed in the last minute and
    /// hour, dead-lettered, oldest ready age, paused), the processes with their last heartbeat, and
    /// every concurrency key that is held or has parked jobs.
    Status(commands::status::Args),
    /// Check what stalls or endangers lockgate in this database (schema, sessions holding its rows,
    /// timeouts, connections, dead tuples, leases, parked jobs, processes, clock), each with what
    /// to do. Exits 1 when a check fails, 2 when the database cannot be reached.
    Doctor(commands::doctor::Args),
    /// List, retry or purge dead-lettered jobs.
    #[command(subcommand)]
    Dlq(commands::dlq::Command),
    /// Show one job by id in whatever state it is, cancel jobs, retry or discard a dead one.
    #[command(subcommand)]
    Job(commands::job::Command),
    /// Find jobs in every state by queue, type, state, key, time and text.
    Jobs(commands::jobs::Args),
    /// Pause or resume claims on a queue.
    #[command(subcommand)]
    Queue(commands::queue::Command),
    /// Create, close and show batches of jobs (progress and callbacks).
    #[command(subcommand)]
    Batch(commands::batch::Command),
    /// List jobs waiting for a concurrency permit, or discard one explicitly.
    #[command(subcommand)]
    Parked(commands::parked::Command),
    /// List recurring tasks with their next and last run; enable, disable, add or remove one.
    #[command(subcommand)]
    Recurring(commands::recurring::Command),
    /// Migrate, define demo job types, enqueue a few hundred jobs, run them with live progress
    /// and print what ran, retried and was dead-lettered.
    Demo(commands::demo::Args),
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    // The demo draws a progress bar; routine logs would tear it.
    init_logging(cli.log_format, if matches!(cli.command, Command::Demo(_)) { "error" } else { "info,sqlx=warn" });
    if let Err(err) = dispatch(cli).await {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let url = cli.database_url;
    match cli.command {
        Command::Migrate => commands::migrate::run(url).await,
        Command::Run(args) => commands::run::run(url, args).await,
        Command::Enqueue(args) => commands::enqueue::run(url, args).await,
        Command::Status(args) => commands::status::run(url, args).await,
        Command::Doctor(args) => {
            let status = commands::doctor::run(url, args).await?;
            if status != 0 {
                std::process::exit(status);
            }
            Ok(())
        }
        Command::Dlq(command) => commands::dlq::run(url, command).await,
        Command::Parked(command) => commands::parked::run(url, command).await,
        Command::Batch(command) => commands::batch::run(url, command).await,
        Command::Queue(command) => commands::queue::run(url, command).await,
        Command::Job(command) => commands::job::run(url, command).await,
        Command::Jobs(args) => commands::jobs::run(url, args).await,
        Command::Recurring(command) => commands::recurring::run(url, command).await,
        Command::Demo(args) => commands::demo::run(url, args).await,
    }
}

/// Logs go to stderr; `LOCKGATE_LOG` (or `RUST_LOG`) takes tracing filter directives. In JSON,
/// an event's fields sit at the top level beside `message`, and the fields of the span it ran in
/// (a job's `job_id`, `job_type`, `queue`, `attempt`) under `span`.
fn init_logging(format: LogFormat, default: &str) {
    let filter =
        std::env::var("LOCKGATE_LOG").or_else(|_| std::env::var("RUST_LOG")).unwrap_or_else(|_| default.to_string());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
        LogFormat::Json => logs.json().flatten_event(true).with_current_span(true).with_span_list(false).init(),
    }
}
