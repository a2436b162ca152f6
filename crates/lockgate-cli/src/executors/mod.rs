//! Built-in executors: how the `lockgate` binary runs job types configured in TOML, so teams
//! that do not write Rust can use lockgate. Each is a [`RawHandler`] taking the job's JSON
//! arguments; its result decides the attempt (success, or an error kept with the attempt).

pub mod command;
mod http;
mod sql;

use std::sync::Arc;

use anyhow::{Context, Result};
use lockgate::{PgPool, RawHandler, Registry};

use crate::config::{Executor, JobTypeConfig};

/// Registers every configured job type with its executor.
pub fn registry(job_types: &[JobTypeConfig], db: &PgPool) -> Result<Registry> {
    let mut registry = Registry::new();
    for job_type in job_types {
        let handler: Arc<dyn RawHandler> = match &job_type.executor {
            Executor::Command(argv) => Arc::new(command::CommandExecutor::new(argv.clone())),
            Executor::Http { url, timeout } => Arc::new(http::HttpExecutor::new(url, *timeout)?),
            Executor::Sql(statement) => Arc::new(sql::SqlExecutor::new(db.clone(), statement.clone())),
        };
        registry.register_raw(job_type.name.clone(), job_type.policy.clone(), handler)?;
    }
    Ok(registry)
}

/// Checks, before `run` starts, that every job type's executor can work, and names the type when
/// one cannot: a program that is not found or not executable, a statement that does not prepare
/// against this database, an invalid URL. Such a type would otherwise start fine and then fail
/// every attempt until its jobs are dead-lettered.
pub async fn check(job_types: &[JobTypeConfig], db: &PgPool) -> Result<()> {
    for job_type in job_types {
        let checked = match &job_type.executor {
            Executor::Command(argv) => command::check(argv),
            Executor::Http { url, .. } => http::parse_url(url).map(drop),
            Executor::Sql(statement) => sql::check(db, statement).await,
        };
        checked.with_context(|| format!("job type {} cannot run", job_type.name))?;
    }
    if std::process::id() == 1 && job_types.iter().any(|t| matches!(t.executor, Executor::Command(_))) {
        // Review helper-84, F3: what a program leaves behind is killed with its group and then
        // reparented to PID 1, whose duty it is to reap it; lockgate reaps only its own children.
        tracing::warn!(
            "lockgate runs as PID 1: processes that command jobs' programs leave behind are killed but never reaped, \
             and their zombies fill the process table; run lockgate under an init (`docker run --init`, tini, dumb-init)"
        );
    }
    Ok(())
}
