//! Process and server faults for the chaos soak: signals by pid, killing a process together with
//! every process it started (as a host or container crash would), terminating one application's
//! backends, and restarting the local PostgreSQL server.
//!
//! Signals go through `kill(1)`: the workspace forbids `unsafe`, and a few milliseconds per
//! signal do not matter to a fault injector.

use std::collections::HashMap;
use std::process::Command;

use anyhow::{bail, Context, Result};
use sqlx::PgPool;

/// Sends signal `name` (`STOP`, `CONT`, `KILL`, `TERM`, ...) to each pid; true if `kill` succeeded
/// for all of them (it fails for a pid that is already gone).
pub fn send_signal(pids: &[u32], name: &str) -> bool {
    if pids.is_empty() {
        return true;
    }
    Command::new("kill")
        .arg("-s")
        .arg(name)
        .args(pids.iter().map(u32::to_string))
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The parent pid of every process in /proc.
fn parents() -> HashMap<u32, u32> {
    let mut map = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return map };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses; it ends at the last ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { continue };
        if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|s| s.parse::<u32>().ok()) {
            map.insert(pid, ppid);
        }
    }
    map
}

/// Every live descendant of `pid` (children, grandchildren, ...), whatever their process group.
pub fn descendants(pid: u32) -> Vec<u32> {
    let parents = parents();
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    // Bounded: a process tree cannot be deeper than the number of processes.
    for _ in 0..=parents.len() {
        let Some(p) = frontier.pop() else { break };
        for (&child, &parent) in &parents {
            if parent == p && !found.contains(&child) {
                found.push(child);
                frontier.push(child);
            }
        }
    }
    found
}

/// Kills `pid` and every process it started with SIGKILL, as a crash of its host would: the
/// whole tree is stopped first, so that none of it can start another child while it is
/// collected (a shell of a command job forking its program between the collection and the kill
/// left that program running, an orphan no crash of a host would leave). Returns the
/// descendants that were killed with it. The caller still reaps `pid`.
pub fn kill_tree(pid: u32) -> Vec<u32> {
    send_signal(&[pid], "STOP");
    let mut tree = descendants(pid);
    loop {
        send_signal(&tree, "STOP");
        let again = descendants(pid);
        if again.iter().all(|p| tree.contains(p)) {
            break;
        }
        tree = again;
    }
    // Descendants first, so none is reparented before it is hit; each kill is independent.
    for chunk in tree.chunks(64) {
        send_signal(chunk, "KILL");
    }
    send_signal(&[pid], "KILL");
    tree
}

/// Terminates every backend of the pool's database whose `application_name` is `name`;
/// returns how many were terminated.
pub async fn terminate_backends_named(pool: &PgPool, name: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
          WHERE datname = current_database() AND application_name = $1 AND pid <> pg_backend_pid()",
    )
    .bind(name)
    .fetch_one(pool)
    .await?)
}

/// Restarts the local PostgreSQL cluster (`pg_ctlcluster --skip-systemctl-redirect <version>
/// main restart`). Only for tests that run alone: every other test's connections break.
/// pg_ctl waits up to 180 s for the shutdown, not its default 60: a connection attempted while the
/// server shuts down gets a child that waits `authentication_timeout` (60 s) for a startup packet,
/// which a frozen or partitioned client never sends, and the server exits only after it.
pub fn restart_postgres() -> Result<()> {
    let cluster = std::fs::read_dir("/etc/postgresql")
        .context("no /etc/postgresql: not a Debian-style PostgreSQL install")?
        .flatten()
        .next()
        .context("no cluster under /etc/postgresql")?
        .file_name();
    let status = Command::new("pg_ctlcluster")
        .arg("--skip-systemctl-redirect")
        .arg(&cluster)
        .args(["main", "restart", "--", "-t", "180"])
        .status()
        .context("running pg_ctlcluster")?;
    if !status.success() {
        bail!("pg_ctlcluster {} main restart failed: {status}", cluster.to_string_lossy());
    }
    Ok(())
}
