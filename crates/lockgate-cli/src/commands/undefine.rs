//! `lockgate undefine <TYPE>...`: removes stored job type definitions (the inverse of `define`),
//! each refused while anything still needs it.

use anyhow::{bail, Result};

use crate::db;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The job types to remove, in order; the first that cannot be removed stops the command.
    #[arg(required = true)]
    job_types: Vec<String>,
}

pub async fn run(target: &db::Target, args: Args) -> Result<()> {
    let pool = db::connect_checked(target, 1).await?;
    for name in &args.job_types {
        if !lockgate::sql::remove_job_type(&pool, name).await? {
            bail!("unknown job type \"{name}\": nothing to remove");
        }
        println!("removed job type {name}");
    }
    Ok(())
}
