//! `lockgate batch create|close|show`: batches of jobs counted as they finish, with callbacks
//! enqueued exactly once when the last one is counted.

use anyhow::{bail, Context, Result};
use lockgate::{BatchCallbacks, BatchId, Client, JobTypeName};

use crate::{db, table};

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Create an open batch and print its id; enqueue into it with `lockgate enqueue --batch ID`.
    Create {
        /// Job type enqueued when every job is counted.
        #[arg(long)]
        on_finish: Option<String>,
        /// Job type enqueued when every job is counted and none failed.
        #[arg(long)]
        on_success: Option<String>,
        /// Job type enqueued when every job is counted and some were dead-lettered.
        #[arg(long)]
        on_failure: Option<String>,
        /// A JSON object passed to the callbacks as `properties`.
        #[arg(long)]
        properties: Option<String>,
    },
    /// Close a batch: no more jobs; it finishes when its last job is counted.
    Close { id: i64 },
    /// Show a batch's progress: total, succeeded, failed, pending, callbacks.
    Show {
        id: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(target: &db::Target, command: Command) -> Result<()> {
    let client = Client::new(db::connect_checked(target, 1).await?);
    match command {
        Command::Create { on_finish, on_success, on_failure, properties } => {
            let properties = properties
                .map(|p| {
                    serde_json::from_str(&p)
                        .with_context(|| format!("--properties is not valid JSON: {}", table::shown(&p)))
                })
                .transpose()?;
            let callbacks = BatchCallbacks {
                on_finish: on_finish.map(JobTypeName::new).transpose()?,
                on_success: on_success.map(JobTypeName::new).transpose()?,
                on_failure: on_failure.map(JobTypeName::new).transpose()?,
                properties,
            };
            let id = client.create_batch(&callbacks).await?;
            println!("{id}");
        }
        Command::Close { id } => {
            let state = client.close_batch(BatchId(id)).await?;
            println!("batch {id} {state}");
        }
        Command::Show { id, json } => {
            let Some(b) = client.batch(BatchId(id)).await? else {
                bail!("batch {id} does not exist");
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&b)?);
                return Ok(());
            }
            println!("batch {}: {}", b.id, b.state);
            println!("  total {}  succeeded {}  failed {}  pending {}", b.total, b.succeeded, b.failed, b.pending);
            let name = |t: &Option<String>| t.clone().unwrap_or_else(|| "-".into());
            println!(
                "  callbacks: on_finish {}  on_success {}  on_failure {}",
                name(&b.on_finish),
                name(&b.on_success),
                name(&b.on_failure)
            );
            if b.callbacks_pending {
                let why = b.callback_error.as_deref().unwrap_or("not enqueued yet");
                println!("  callbacks pending (the sweep retries them): {why}");
            }
            println!("  properties {}", b.properties);
            let at = |t: Option<chrono::DateTime<chrono::Utc>>| {
                t.map_or("-".to_string(), |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
            };
            println!(
                "  created {}  closed {}  finished {}",
                at(Some(b.created_at)),
                at(b.closed_at),
                at(b.finished_at)
            );
        }
    }
    Ok(())
}
