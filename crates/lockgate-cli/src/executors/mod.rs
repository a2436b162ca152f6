//! Built-in executors: how the `lockgate` binary runs job types configured in TOML, so teams
//! that do not write Rust can use lockgate. Each is a [`RawHandler`] taking the job's JSON
//! arguments; its result decides the attempt (success, or an error kept with the attempt).

pub mod command;
mod http;
mod sql;

use std::sync::Arc;

use anyhow::Result;
use lockgate::{PgPool, RawHandler, Registry};

use crate::config::{Executor, JobTypeConfig};

/// Registers every configured job type with its executor.
pub fn registry(job_types: &[JobTypeConfig], db: &PgPool) -> Result<Registry> {
    let mut registry = Registry::new();
    for job_type in job_types {
        let handler: Arc<dyn RawHandler> = match &job_type.executor {
            Executor::Command(argv) => Arc::new(command::CommandExecutor::new(argv.clone())),
            Executor::Http(url) => Arc::new(http::HttpExecutor::new(url.clone())?),
            Executor::Sql(statement) => Arc::new(sql::SqlExecutor::new(db.clone(), statement.clone())),
        };
        registry.register_raw(job_type.name.clone(), job_type.policy.clone(), handler)?;
    }
    Ok(registry)
}
