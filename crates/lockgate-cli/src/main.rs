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
///
/// lockgate keeps jobs in your PostgreSQL database, in PGMQ queues: producers enqueue them from
/// SQL (`SELECT lockgate.enqueue(...)`), from Rust or with `lockgate enqueue`, and `lockgate run`
/// runs them with the commands, HTTP calls or SQL statements a TOML file configures, with
/// retries, dead letters, concurrency limits, uniqueness, batches and recurring schedules. Start
/// with `lockgate migrate --create-database`, then `lockgate define --config lockgate.toml` and
/// `lockgate run --config lockgate.toml`.
#[derive(Debug, Parser)]
#[command(name = "lockgate", version)]
struct Cli {
    /// Database to use. Defaults to $DATABASE_URL, then the `database_url` of the config file
    /// (for `run` and `define`), then postgres://postgres@127.0.0.1:5432/lockgate.
    #[arg(long, global = true, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// How long to wait for the database to accept a connection before reporting why it did not
    /// (refused, no answer, missing database), e.g. 5s, 30s. For `run`, the config file's
    /// `connect_timeout` applies when this is not given.
    #[arg(long, global = true, env = "LOCKGATE_CONNECT_TIMEOUT", value_parser = positive_duration)]
    connect_timeout: Option<std::time::Duration>,
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
    Migrate(commands::migrate::Args),
    /// Store the job types of a config file (their queues and policies) without running them, so
    /// producers can enqueue before the first `lockgate run`.
    Define(commands::define::Args),
    /// Remove stored job types no job, dead letter, recurring task or batch still needs (the
    /// inverse of `define`).
    Undefine(commands::undefine::Args),
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
    /// Pause or resume claims on a queue, or drop one nothing uses any more.
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

fn main() {
    quiet_on_closed_stdout();
    // The command executor's watchdog (`lockgate command-watchdog`, started by lockgate run, never
    // by hand) runs before any of the CLI: no async runtime, no logging, no argument parsing.
    if std::env::args_os().nth(1).is_some_and(|a| a == "command-watchdog") {
        executors::command::watchdog();
    }
    cli();
}

#[tokio::main]
async fn cli() {
    let cli = Cli::parse();
    // The demo draws a progress bar; routine logs would tear it.
    init_logging(cli.log_format, if matches!(cli.command, Command::Demo(_)) { "error" } else { "info,sqlx=warn" });
    if let Err(err) = dispatch(cli).await {
        // lockgate's SQL errors start with "lockgate: " for psql users; here "error: " says it,
        // and the driver's "error returned from database" says nothing more.
        let text = causes_once(&err).replace("error returned from database: lockgate: ", "lockgate: ");
        let text = text.replace(": lockgate: ", ": ");
        eprintln!("error: {}", text.strip_prefix("lockgate: ").unwrap_or(&text));
        // An enqueue whose connection broke after it was sent may have committed: said, and
        // told apart by its status, so that a script does not enqueue the job again blindly
        // (review helper-141 F3).
        let unknown = err.downcast_ref::<lockgate::EnqueueError>().is_some_and(|e| e.may_have_committed());
        if unknown {
            eprintln!(
                "hint: the connection broke after the enqueue was sent, so the job may have been enqueued: look for \
                 it (`lockgate jobs --type TYPE`) before enqueueing it again; a unique key makes a retry safe"
            );
        } else if let Some(hint) = hint(&err) {
            eprintln!("hint: {hint}");
        }
        std::process::exit(if unknown { 3 } else { 1 });
    }
}

/// What to do about a database error whose cause lies outside lockgate: an error that a
/// transaction-mode pooler causes when the URL does not say so (sqlx's named statements then
/// meet another client's on the server, 42P05, or are bound on a server that never prepared
/// them, 26000), and a privilege the role lacks (42501).
fn hint(err: &anyhow::Error) -> Option<&'static str> {
    // The server's error, wherever the chain holds it: a wrapper that forwards its source
    // (`#[error(transparent)]`) leaves the driver's error out and shows the server's directly.
    let code = err.chain().find_map(|cause| {
        match cause.downcast_ref::<lockgate::sql::DbError>() {
            Some(lockgate::sql::DbError::Sqlx(e)) => Some(e),
            _ => cause.downcast_ref::<sqlx::Error>(),
        }
        .and_then(|e| e.as_database_error())
        .and_then(|e| e.code())
        .map(|code| code.into_owned())
        .or_else(|| {
            cause.downcast_ref::<Box<dyn sqlx::error::DatabaseError>>().and_then(|e| e.code()).map(|c| c.into_owned())
        })
    })?;
    match code.as_str() {
        "42P05" | "26000" if !lockgate::sql::pooler::transaction_pooling() => Some(
            "if the database URL goes through a transaction-mode pooler (PgBouncer pool_mode = transaction), \
             add pooler=transaction to it, e.g. postgres://host:6432/app?pooler=transaction",
        ),
        "42501" => Some(
            "the URL's role lacks a privilege: `lockgate migrate`, `run` and the operators' commands need the role \
             that ran lockgate migrate (or its grants); a role that only enqueues needs the grants of the README's \
             \"A producer's role\"",
        ),
        "55P03" => Some(
            "another session holds a lock on a table this command reads, past its lock_timeout: `lockgate doctor` \
             names the sessions holding lockgate's and PGMQ's tables (sessions)",
        ),
        "25006" => Some(
            "the database is read-only: the URL reaches a standby (a replica, or a primary demoted by a failover), \
             or default_transaction_read_only is on for its role or database; point the URL at the writable primary",
        ),
        _ => None,
    }
}

/// A listing piped into a reader that stops early (`lockgate jobs | head -1`) finds stdout closed:
/// Rust ignores SIGPIPE and `println!` panics instead. That ends the command as the shell
/// expects a writer to a closed pipe to end, without a panic message: exit 141 (128 + SIGPIPE).
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

/// The error and its causes, each said once. Many errors (sqlx's among them) include their
/// source in their own message, which `{:#}` would print a second time.
fn causes_once(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain().map(ToString::to_string) {
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

fn positive_duration(text: &str) -> Result<std::time::Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("a positive duration such as 5s".into()),
        Err(e) => Err(e.to_string()),
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let target = db::Target { url: cli.database_url, connect_timeout: cli.connect_timeout };
    match cli.command {
        Command::Migrate(args) => commands::migrate::run(&target, args).await,
        Command::Define(args) => commands::define::run(&target, args).await,
        Command::Undefine(args) => commands::undefine::run(&target, args).await,
        Command::Run(args) => commands::run::run(&target, args).await,
        Command::Enqueue(args) => commands::enqueue::run(&target, args).await,
        Command::Status(args) => commands::status::run(&target, args).await,
        Command::Doctor(args) => {
            let status = commands::doctor::run(&target, args).await?;
            if status != 0 {
                std::process::exit(status);
            }
            Ok(())
        }
        Command::Dlq(command) => commands::dlq::run(&target, command).await,
        Command::Parked(command) => commands::parked::run(&target, command).await,
        Command::Batch(command) => commands::batch::run(&target, command).await,
        Command::Queue(command) => commands::queue::run(&target, command).await,
        Command::Job(command) => commands::job::run(&target, command).await,
        Command::Jobs(args) => commands::jobs::run(&target, args).await,
        Command::Recurring(command) => commands::recurring::run(&target, command).await,
        Command::Demo(args) => commands::demo::run(&target, args).await,
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
