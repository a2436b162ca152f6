//! `lockgate define --config lockgate.toml`: stores the config file's job types (queue and
//! policy, creating missing queues) as `lockgate run` does when it starts, without running
//! anything, so a team without Rust can enqueue before its first worker is up.

use std::path::PathBuf;

use anyhow::{Context, Result};
use lockgate::Client;

use crate::commands::run;
use crate::config::Config;
use crate::db;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The TOML configuration whose `[job_types.<name>]` tables are stored.
    #[arg(long, short, default_value = "lockgate.toml")]
    config: PathBuf,
}

pub async fn run(target: &db::Target, args: Args) -> Result<()> {
    let config = Config::load(&args.config)?;
    let runtime_config = config.runtime()?;
    let job_types = config.job_types()?;
    if job_types.is_empty() {
        anyhow::bail!("{} configures no [job_types.<name>]: nothing to define", args.config.display());
    }
    let recurring = config.recurring()?;
    let pools = config.pools(&job_types)?;
    let target = target.or(config.database_url.clone(), config.connect_timeout()?);
    let db = db::connect_checked(&target, 1).await?;
    // Nothing is stored of a configuration `lockgate run` would refuse.
    let runtime = run::checked_runtime(db.clone(), runtime_config, job_types.clone(), pools, recurring).await?;
    runtime.check_recurring().await?;
    let client = Client::new(db);
    for job_type in &job_types {
        let (name, queue) = (&job_type.name, &job_type.policy.queue);
        client.define_job_type(name, &job_type.policy).await.with_context(|| format!("could not define {name}"))?;
        println!("defined job type {name} on queue {queue}");
    }
    Ok(())
}
