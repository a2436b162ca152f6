//! `lockgate status`: per-queue counts, the registered processes with the age of their last
//! heartbeat and their jobs in flight, every concurrency key that is held or has parked jobs,
//! the uniqueness locks held per job type, and the batches not finished yet.

use anyhow::Result;

use crate::db;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(url: Option<String>, args: Args) -> Result<()> {
    let pool = db::connect_checked(&db::resolve(url), 1).await?;
    let stats = lockgate::sql::queue_stats(&pool).await?;
    let keys = lockgate::sql::key_stats(&pool).await?;
    let processes = lockgate::sql::list_processes(&pool).await?;
    let unique = lockgate::sql::unique_lock_stats(&pool).await?;
    let batches = lockgate::sql::unfinished_batches(&pool, 20).await?;
    if args.json {
        let rows: Vec<_> = stats
            .iter()
            .map(|s| {
                serde_json::json!({
                    "queue": s.queue, "ready": s.ready, "scheduled": s.scheduled, "running": s.running,
                    "dead": s.dead, "oldest_ready_seconds": s.oldest_ready_seconds, "paused": s.paused,
                })
            })
            .collect();
        let keys: Vec<_> = keys
            .iter()
            .map(|k| {
                serde_json::json!({
                    "key": k.key, "limit": k.limit, "held": k.held, "parked": k.parked,
                    "oldest_parked_seconds": k.oldest_parked_seconds,
                })
            })
            .collect();
        let processes: Vec<_> = processes
            .iter()
            .map(|p| {
                serde_json::json!({
                    "id": p.id, "kind": p.kind, "name": p.name, "host": p.host, "pid": p.pid,
                    "supervisor_id": p.supervisor_id, "started_at": p.started_at.to_rfc3339(),
                    "heartbeat_age_seconds": p.heartbeat_age_seconds, "metadata": p.metadata,
                })
            })
            .collect();
        let unique: Vec<_> = unique
            .iter()
            .map(|u| {
                serde_json::json!({
                    "job_type": u.job_type, "mode": u.mode, "held": u.held, "oldest_seconds": u.oldest_seconds,
                })
            })
            .collect();
        let all = serde_json::json!({
            "queues": rows, "keys": keys, "processes": processes, "unique_locks": unique, "batches": batches,
        });
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    println!("{:<24} {:>9} {:>9} {:>9} {:>9} {:>12}", "QUEUE", "READY", "SCHEDULED", "RUNNING", "DEAD", "OLDEST READY");
    for s in stats {
        let age = s.oldest_ready_seconds.map_or("-".to_string(), |secs| format!("{secs:.1}s"));
        let paused = if s.paused { "  paused" } else { "" };
        println!(
            "{:<24} {:>9} {:>9} {:>9} {:>9} {:>12}{paused}",
            s.queue, s.ready, s.scheduled, s.running, s.dead, age
        );
    }
    if !processes.is_empty() {
        println!(
            "\n{:<6} {:<11} {:<16} {:<20} {:>8} {:>10} {:>10}",
            "ID", "KIND", "NAME", "HOST", "PID", "HEARTBEAT", "IN FLIGHT"
        );
        for p in &processes {
            let in_flight = p.metadata.get("in_flight").map_or("-".to_string(), |v| v.to_string());
            let kind = if p.supervisor_id.is_some() { format!("  {}", p.kind) } else { p.kind.clone() };
            let age = format!("{:.1}s ago", p.heartbeat_age_seconds);
            println!("{:<6} {kind:<11} {:<16} {:<20} {:>8} {age:>10} {in_flight:>10}", p.id, p.name, p.host, p.pid);
        }
    }
    if !keys.is_empty() {
        println!("\n{:<40} {:>6} {:>6} {:>8} {:>13}", "KEY", "LIMIT", "HELD", "PARKED", "OLDEST PARKED");
        for k in keys {
            let limit = k.limit.map_or("-".to_string(), |l| l.to_string());
            let age = k.oldest_parked_seconds.map_or("-".to_string(), |secs| format!("{secs:.1}s"));
            println!("{:<40} {limit:>6} {:>6} {:>8} {age:>13}", k.key, k.held, k.parked);
        }
    }
    if !unique.is_empty() {
        println!("\n{:<40} {:<16} {:>8} {:>13}", "UNIQUE TYPE", "MODE", "HELD", "OLDEST");
        for u in unique {
            println!("{:<40} {:<16} {:>8} {:>12.1}s", u.job_type, u.mode, u.held, u.oldest_seconds);
        }
    }
    if !batches.is_empty() {
        println!(
            "\n{:<10} {:<9} {:>9} {:>10} {:>8} {:>9}  CALLBACKS",
            "BATCH", "STATE", "TOTAL", "SUCCEEDED", "FAILED", "PENDING"
        );
        for b in batches {
            let callbacks = if b.callbacks_pending { "pending" } else { "-" };
            println!(
                "{:<10} {:<9} {:>9} {:>10} {:>8} {:>9}  {callbacks}",
                b.id, b.state, b.total, b.succeeded, b.failed, b.pending
            );
        }
    }
    Ok(())
}
