//! `lockgate queue pause|resume|drop <NAME>`: stop and restart claims on a queue, for every
//! process, or drop a queue nothing uses any more.

use anyhow::{bail, Result};

use crate::db;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Stop claims on a queue: running jobs finish, producers still enqueue; survives restarts.
    Pause { queue: String },
    /// Let workers claim from a paused queue again.
    Resume { queue: String },
    /// Drop a queue, its tables (its archive too) and its steps; refused while job types are
    /// defined on it or it has jobs, dead letters, recurring tasks or a running pool.
    Drop { queue: String },
}

pub async fn run(target: &db::Target, command: Command) -> Result<()> {
    let pool = db::connect_checked(target, 1).await?;
    match command {
        Command::Pause { queue } => {
            let changed = lockgate::sql::pause_queue(&pool, &queue).await?;
            println!("queue {queue} {}", if changed { "paused" } else { "was paused already" });
        }
        Command::Resume { queue } => {
            let changed = lockgate::sql::resume_queue(&pool, &queue).await?;
            println!("queue {queue} {}", if changed { "resumed" } else { "was not paused" });
        }
        Command::Drop { queue } => {
            // At READ COMMITTED whatever the role's default (the drop refuses an older snapshot).
            let mut tx = pool.begin().await?;
            sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(&mut *tx).await?;
            if !lockgate::sql::drop_queue(&mut *tx, &queue).await? {
                bail!("queue \"{queue}\" does not exist: nothing to drop");
            }
            tx.commit().await?;
            println!("dropped queue {queue}");
        }
    }
    Ok(())
}
