//! `lockgate run --config lockgate.toml`: the worker process.
//!
//! Signals: the first TERM or INT starts the graceful shutdown documented in the runtime's
//! supervisor (stop claiming, `shutdown_timeout` for running jobs, return the rest to their
//! queue, exit 0 once that is committed). A second TERM/INT, or QUIT at any time, exits at
//! once with status 130/131; visibility expiry then returns the jobs.

use std::path::PathBuf;

use anyhow::{Context, Result};
use lockgate::{PoolConfig, RecurringTask, Runtime, RuntimeConfig};
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, JobTypeConfig};
use crate::{db, executors};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The TOML configuration: pools, job types and their executors, recurring tasks, runtime
    /// settings.
    #[arg(long, short, default_value = "lockgate.toml")]
    config: PathBuf,
    /// A direct URL (or one through a session-mode pooler) for the LISTEN connection, when the
    /// database URL goes through a transaction-mode pooler. Overrides `listen_database_url`.
    #[arg(long, env = "LOCKGATE_LISTEN_DATABASE_URL")]
    listen_database_url: Option<String>,
}

pub async fn run(target: &db::Target, args: Args) -> Result<()> {
    let config = Config::load(&args.config)?;
    let mut runtime_config = config.runtime()?;
    if let Some(url) = args.listen_database_url {
        runtime_config.listen_database_url = Some(url);
    }
    if let Some(url) = &runtime_config.listen_database_url {
        runtime_config.listen_database_url = Some(db::check_listen_url(url)?);
    }
    let job_types = config.job_types()?;
    let recurring = config.recurring()?;
    let pools = config.pools(&job_types)?;
    let target = target.or(config.database_url.clone(), config.connect_timeout()?);
    let connections = pools.iter().map(|p| p.concurrency as u32).sum::<u32>() + 4;
    // Signals first: a TERM while the database is still being waited for ends the wait (exit 0:
    // nothing was claimed yet).
    let shutdown = CancellationToken::new();
    watch_signals(shutdown.clone())?;
    // The health endpoints answer while the database is waited for: `/livez` 200, `/readyz`
    // booting; the runtime then serves them on the same socket (review helper-140 F11).
    let health = lockgate::health::bind(&runtime_config)?;
    let booting = CancellationToken::new();
    if let Some(listener) = &health {
        tokio::spawn(lockgate::health::serve_booting(listener.try_clone()?, booting.clone()));
    }
    let Some(db) = db::connect_checked_waiting(&target, connections, &shutdown).await? else {
        return Ok(());
    };
    booting.cancel();
    let mut runtime = checked_runtime(db, runtime_config, job_types, pools, recurring).await?;
    if let Some(listener) = health {
        runtime = runtime.with_health_listener(listener);
    }
    runtime.run(shutdown).await?;
    Ok(())
}

/// The runtime `run` starts, after every check that needs the database: each executor can run
/// (a command on the PATH, a URL, an sql statement that prepares) and the runtime accepts the
/// types, pools and recurring tasks. `define` makes the same checks, so that it never stores a
/// configuration `run` would refuse.
pub(crate) async fn checked_runtime(
    db: sqlx::PgPool,
    runtime_config: RuntimeConfig,
    job_types: Vec<JobTypeConfig>,
    pools: Vec<PoolConfig>,
    recurring: Option<Vec<RecurringTask>>,
) -> Result<Runtime> {
    executors::check(&job_types, &db).await?;
    let registry = executors::registry(&job_types, &db)?;
    let mut runtime = Runtime::new(db, runtime_config, registry, pools).context("invalid configuration")?;
    if let Some(tasks) = recurring {
        runtime = runtime.with_recurring(tasks).context("invalid configuration")?;
    }
    Ok(runtime)
}

/// How long after the first TERM or INT a repeat is taken as the same request, not as a second.
const SAME_REQUEST: std::time::Duration = std::time::Duration::from_secs(1);

fn watch_signals(shutdown: CancellationToken) -> Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut quit = signal(SignalKind::quit())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("TERM received: shutting down gracefully"),
            _ = int.recv() => tracing::info!("INT received: shutting down gracefully"),
            _ = quit.recv() => quit_now(),
        }
        shutdown.cancel();
        let first = std::time::Instant::now();
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
                _ = quit.recv() => quit_now(),
            }
            if first.elapsed() >= SAME_REQUEST {
                break;
            }
            // GNU `timeout`, and a supervisor that signals the process and then its group, deliver
            // one request twice within microseconds; taken as a second signal, it dropped the
            // graceful shutdown (review helper-110).
            tracing::info!(
                "a repeat within {SAME_REQUEST:?} of the first signal is the same request; send it again later \
                 (or QUIT) to exit at once"
            );
        }
        tracing::warn!("second signal: exiting at once; unfinished jobs return when their visibility lapses");
        executors::command::kill_children();
        std::process::exit(130);
    });
    Ok(())
}

fn quit_now() -> ! {
    tracing::warn!("QUIT received: exiting at once; unfinished jobs return when their visibility lapses");
    executors::command::kill_children();
    std::process::exit(131);
}
