//! The machine a run measured: cores, memory and load from `/proc`, and the PostgreSQL server's
//! version and the settings that decide commit-bound throughput (WAL flushing above all).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde::Serialize;
use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

/// Settings that move queue throughput: durability (each commit's WAL flush), WAL sizing and
/// group commit, memory, and autovacuum (dead tuples at the head of a queue table).
const SETTINGS: &[&str] = &[
    "shared_buffers",
    "synchronous_commit",
    "fsync",
    "full_page_writes",
    "wal_level",
    "wal_buffers",
    "wal_writer_delay",
    "wal_compression",
    "commit_delay",
    "commit_siblings",
    "max_wal_size",
    "checkpoint_timeout",
    "max_connections",
    "work_mem",
    "autovacuum",
    "jit",
];

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub cpu_model: Option<String>,
    pub memory_mib: Option<u64>,
    pub kernel: Option<String>,
    /// 1/5/15-minute load averages when the run started: other work on a shared machine.
    pub load_average: Option<String>,
    pub postgres_version: String,
    pub postgres_settings: BTreeMap<String, String>,
}

impl Machine {
    /// Reads `/proc` and asks the server (a read-only query on the server URL's database).
    pub async fn describe(server_url: &str) -> Result<Self> {
        let options: PgConnectOptions = server_url.parse().context("server URL")?;
        let mut conn = options.connect().await.with_context(|| format!("connecting to {server_url}"))?;
        let postgres_version: String = sqlx::query_scalar("SELECT version()").fetch_one(&mut conn).await?;
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT name, current_setting(name) FROM unnest($1::text[]) AS s(name)")
                .bind(SETTINGS)
                .fetch_all(&mut conn)
                .await?;
        Ok(Self {
            cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            cpu_model: proc_field("/proc/cpuinfo", "model name"),
            memory_mib: proc_field("/proc/meminfo", "MemTotal")
                .and_then(|v| v.trim_end_matches(" kB").trim().parse::<u64>().ok())
                .map(|kib| kib / 1024),
            kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            load_average: read_trimmed("/proc/loadavg")
                .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")),
            postgres_version,
            postgres_settings: rows.into_iter().collect(),
        })
    }

    /// One line for the table's header.
    pub fn line(&self) -> String {
        let version = self.postgres_version.split(" on ").next().unwrap_or(&self.postgres_version);
        let settings: Vec<String> = self.postgres_settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!(
            "{} cores ({}), {} MiB RAM, Linux {}, load {} | {version} | {}",
            self.cores,
            self.cpu_model.as_deref().unwrap_or("unknown CPU"),
            self.memory_mib.map_or("?".into(), |m| m.to_string()),
            self.kernel.as_deref().unwrap_or("?"),
            self.load_average.as_deref().unwrap_or("?"),
            settings.join(" "),
        )
    }
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// The value of the first `key: value` line of a `/proc` file.
fn proc_field(path: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .filter_map(|line| line.split_once(':'))
        .find(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.trim().to_string())
}
