//! `lockgate parked list|discard`: the jobs waiting for a concurrency permit. Discard is the
//! only way besides promotion that a parked job leaves (G4), so it takes an explicit id.

use anyhow::{bail, Result};
use lockgate::sql::{discard_parked, parked_jobs};

use crate::db;
use crate::table;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// List parked jobs in promotion order (priority, then age).
    List {
        /// Only this concurrency key.
        #[arg(long)]
        key: Option<String>,
        /// At most this many rows (at least 1).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i32).range(1..))]
        limit: i32,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Delete one parked job for good, by the id `parked list` shows.
    Discard {
        /// The parked job's id (the ID column, not the job id).
        id: i64,
    },
}

pub async fn run(target: &db::Target, command: Command) -> Result<()> {
    let pool = db::connect_checked(target, 1).await?;
    match command {
        Command::List { key, limit, json } => {
            let rows = parked_jobs(&pool, key.as_deref(), limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(());
            }
            println!(
                "{:<8} {:<8} {:<32} {:<16} {:<20} {:>4}  {:<25} ARGS",
                "ID", "JOB", "KEY", "QUEUE", "TYPE", "PRIO", "PARKED AT"
            );
            for p in rows {
                let parked_at = p.parked_at.format("%Y-%m-%d %H:%M:%S UTC");
                println!(
                    "{:<8} {:<8} {:<32} {:<16} {:<20} {:>4}  {parked_at:<25} {}",
                    p.id,
                    p.job_id,
                    table::shown(&p.key),
                    table::escaped(&p.queue),
                    table::escaped(&p.job_type),
                    p.priority,
                    table::escaped(&p.args.to_string())
                );
            }
        }
        Command::Discard { id } => {
            if !discard_parked(&pool, id).await? {
                bail!("no parked job with id {id} (it may have been promoted already)");
            }
            println!("discarded parked job {id}");
        }
    }
    Ok(())
}
