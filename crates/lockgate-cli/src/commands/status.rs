//! `lockgate status`: per-queue counts and throughput (succeeded and failed in the last minute
//! and hour), paused queues, the registered processes with the age of their last heartbeat and
//! their jobs in flight, every concurrency key that is held or has parked jobs, the uniqueness
//! locks held per job type, and the batches not finished yet.

use anyhow::Result;
use lockgate::sql::{KeyStats, ProcessRow, QueueStats, QueueThroughput, UniqueLockStats};
use serde_json::{json, Value};

use crate::db;
use crate::table::{Align, Table};

/// Archive index entries read per queue for the throughput: some tens of milliseconds at most,
/// and exact up to about 28 jobs a second over the hour (above, the counts read as "at least").
const THROUGHPUT_MAX_ROWS: i32 = 100_000;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(target: &db::Target, args: Args) -> Result<()> {
    let pool = db::connect_reading(target).await?;
    lockgate::check_schema(&pool).await?;
    let stats = lockgate::sql::queue_stats(&pool).await?;
    let throughput = lockgate::sql::queue_throughput(&pool, THROUGHPUT_MAX_ROWS).await?;
    let keys = lockgate::sql::key_stats(&pool).await?;
    let processes = lockgate::sql::list_processes(&pool).await?;
    let unique = lockgate::sql::unique_lock_stats(&pool).await?;
    // One more than is shown, to tell whether there are more (review helper-139 F5).
    let mut batches = lockgate::sql::unfinished_batches(&pool, BATCHES_SHOWN + 1).await?;
    let more_batches = batches.len() > BATCHES_SHOWN as usize;
    batches.truncate(BATCHES_SHOWN as usize);
    if args.json {
        let all = json!({
            "queues": stats.iter().map(|s| queue_json(s, find(&throughput, &s.queue))).collect::<Vec<_>>(),
            "keys": keys.iter().map(key_json).collect::<Vec<_>>(),
            "processes": processes.iter().map(process_json).collect::<Vec<_>>(),
            "unique_locks": unique.iter().map(unique_json).collect::<Vec<_>>(),
            "batches": batches,
            "more_batches": more_batches,
        });
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    if stats.is_empty() {
        print_empty();
    } else {
        print_summary(&stats, &throughput, &processes);
        print_queues(&stats, &throughput);
    }
    print_processes(&processes);
    print_keys(&keys);
    print_unique(&unique);
    if !batches.is_empty() {
        let mut t = Table::new(&[
            ("BATCH", Align::Left),
            ("STATE", Align::Left),
            ("TOTAL", Align::Right),
            ("SUCCEEDED", Align::Right),
            ("FAILED", Align::Right),
            ("PENDING", Align::Right),
            ("CALLBACKS", Align::Left),
        ]);
        for b in batches {
            let callbacks = if b.callbacks_pending { "pending" } else { "-" };
            t.row(vec![
                b.id.to_string(),
                b.state,
                b.total.to_string(),
                b.succeeded.to_string(),
                b.failed.to_string(),
                b.pending.to_string(),
                callbacks.into(),
            ]);
        }
        println!();
        t.print();
        if more_batches {
            println!(
                "(the {BATCHES_SHOWN} oldest unfinished batches; more are not shown: `lockgate batch show ID` shows any one)"
            );
        }
    }
    Ok(())
}

/// Unfinished batches `status` shows, the oldest first.
const BATCHES_SHOWN: i32 = 20;

fn find<'a>(throughput: &'a [QueueThroughput], queue: &str) -> Option<&'a QueueThroughput> {
    throughput.iter().find(|t| t.queue == queue)
}

fn queue_json(s: &QueueStats, t: Option<&QueueThroughput>) -> Value {
    json!({
        "queue": s.queue, "ready": s.ready, "scheduled": s.scheduled, "running": s.running,
        "dead": s.dead, "oldest_ready_seconds": s.oldest_ready_seconds, "paused": s.paused,
        "succeeded_last_minute": t.map(|t| t.succeeded_last_minute),
        "succeeded_last_hour": t.map(|t| t.succeeded_last_hour),
        "succeeded_capped": t.map(|t| t.succeeded_capped),
        "failed_last_minute": t.map(|t| t.failed_last_minute),
        "failed_last_hour": t.map(|t| t.failed_last_hour),
    })
}

fn key_json(k: &KeyStats) -> Value {
    json!({
        "key": k.key, "limit": k.limit, "held": k.held, "parked": k.parked,
        "oldest_parked_seconds": k.oldest_parked_seconds,
    })
}

fn process_json(p: &ProcessRow) -> Value {
    json!({
        "id": p.id, "kind": p.kind, "name": p.name, "host": p.host, "pid": p.pid,
        "supervisor_id": p.supervisor_id, "started_at": p.started_at.to_rfc3339(),
        "heartbeat_age_seconds": p.heartbeat_age_seconds, "metadata": p.metadata,
    })
}

fn unique_json(u: &UniqueLockStats) -> Value {
    json!({ "job_type": u.job_type, "mode": u.mode, "held": u.held, "oldest_seconds": u.oldest_seconds })
}

fn print_empty() {
    println!(
        "No queues yet. A queue is created with the first job type defined on it: by `lockgate run` from the\n\
         [job_types] of its config, or with SELECT lockgate.define_job_type('my_type', queue => 'default').\n\
         Then enqueue a job: lockgate enqueue my_type '{{\"id\": 1}}'"
    );
}

/// One line for the whole database: queues, paused ones, processes, and the last hour's outcome.
fn print_summary(stats: &[QueueStats], throughput: &[QueueThroughput], processes: &[ProcessRow]) {
    let paused: Vec<&str> = stats.iter().filter(|s| s.paused).map(|s| s.queue.as_str()).collect();
    let paused = if paused.is_empty() { String::new() } else { format!(" (paused: {})", paused.join(", ")) };
    let supervisors = processes.iter().filter(|p| p.supervisor_id.is_none()).count();
    let succeeded: i64 = throughput.iter().map(|t| t.succeeded_last_hour).sum();
    let at_least = if throughput.iter().any(|t| t.succeeded_capped) { "at least " } else { "" };
    let failed: i64 = throughput.iter().map(|t| t.failed_last_hour).sum();
    println!(
        "{} queue(s){paused}, {supervisors} process(es); last hour: {at_least}{succeeded} succeeded, {failed} failed\n",
        stats.len()
    );
}

fn print_queues(stats: &[QueueStats], throughput: &[QueueThroughput]) {
    let mut t = Table::new(&[
        ("QUEUE", Align::Left),
        ("READY", Align::Right),
        ("SCHEDULED", Align::Right),
        ("RUNNING", Align::Right),
        ("SUCCEEDED 1M", Align::Right),
        ("SUCCEEDED 1H", Align::Right),
        ("FAILED 1H", Align::Right),
        ("DEAD", Align::Right),
        ("OLDEST READY", Align::Right),
        ("STATE", Align::Left),
    ]);
    for s in stats {
        let tp = find(throughput, &s.queue);
        // The newest rows are read first: the minute's count is exact unless it used every row read.
        let capped_hour = tp.is_some_and(|t| t.succeeded_capped);
        let capped_minute = capped_hour && tp.is_some_and(|t| t.succeeded_last_minute == t.succeeded_last_hour);
        let plus = |capped: bool| if capped { "+" } else { "" };
        let count =
            |f: fn(&QueueThroughput) -> i64, suffix: &str| tp.map_or("-".into(), |t| format!("{}{suffix}", f(t)));
        t.row(vec![
            s.queue.clone(),
            s.ready.to_string(),
            s.scheduled.to_string(),
            s.running.to_string(),
            count(|t| t.succeeded_last_minute, plus(capped_minute)),
            count(|t| t.succeeded_last_hour, plus(capped_hour)),
            count(|t| t.failed_last_hour, ""),
            s.dead.to_string(),
            s.oldest_ready_seconds.map_or("-".into(), |secs| format!("{secs:.1}s")),
            if s.paused { "paused".into() } else { String::new() },
        ]);
    }
    t.print();
}

fn print_processes(processes: &[ProcessRow]) {
    if processes.is_empty() {
        println!("\nNo process is registered: no `lockgate run` is up, so nothing claims jobs.");
        return;
    }
    let mut t = Table::new(&[
        ("ID", Align::Left),
        ("KIND", Align::Left),
        ("NAME", Align::Left),
        ("HOST", Align::Left),
        ("PID", Align::Right),
        ("STARTED", Align::Left),
        ("LAST HEARTBEAT", Align::Right),
        ("IN FLIGHT", Align::Right),
    ]);
    for p in processes {
        let kind = if p.supervisor_id.is_some() { format!("  {}", p.kind) } else { p.kind.clone() };
        t.row(vec![
            p.id.to_string(),
            kind,
            p.name.clone(),
            p.host.clone(),
            p.pid.to_string(),
            p.started_at.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
            format!("{:.1}s ago", p.heartbeat_age_seconds),
            p.metadata.get("in_flight").map_or("-".to_string(), |v| v.to_string()),
        ]);
    }
    println!();
    t.print();
}

fn print_keys(keys: &[KeyStats]) {
    if keys.is_empty() {
        return;
    }
    let mut t = Table::new(&[
        ("KEY", Align::Left),
        ("LIMIT", Align::Right),
        ("HELD", Align::Right),
        ("PARKED", Align::Right),
        ("OLDEST PARKED", Align::Right),
    ]);
    for k in keys {
        t.row(vec![
            k.key.clone(),
            k.limit.map_or("-".to_string(), |l| l.to_string()),
            k.held.to_string(),
            k.parked.to_string(),
            k.oldest_parked_seconds.map_or("-".to_string(), |secs| format!("{secs:.1}s")),
        ]);
    }
    println!();
    t.print();
}

fn print_unique(unique: &[UniqueLockStats]) {
    if unique.is_empty() {
        return;
    }
    let mut t = Table::new(&[
        ("UNIQUE TYPE", Align::Left),
        ("MODE", Align::Left),
        ("HELD", Align::Right),
        ("OLDEST", Align::Right),
    ]);
    for u in unique {
        t.row(vec![u.job_type.clone(), u.mode.clone(), u.held.to_string(), format!("{:.1}s", u.oldest_seconds)]);
    }
    println!();
    t.print();
}
