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
        // At READ COMMITTED whatever the role's default (a removal refuses an older snapshot).
        let mut tx = pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(&mut *tx).await?;
        if !lockgate::sql::remove_job_type(&mut *tx, name).await? {
            bail!("unknown job type \"{name}\": nothing to remove");
        }
        tx.commit().await?;
        println!("removed job type {name}");
    }
    Ok(())
}
