//! What a run cost, besides its duration: server-side function calls and time (from
//! `pg_stat_user_functions`; each bench database sets `track_functions = 'pl'`), what the
//! measured sessions wait on (sampled from `pg_stat_activity`), and the harness process's
//! resident memory and CPU time from `/proc/self`.
//!
//! Statistics reach the shared view when a backend exits, so `after` is read once the measured
//! pools are closed and their sessions gone (`BenchDb::settle`).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use lockgate::PgPool;
use serde::Serialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::bench_db::MEASURED_APP;

/// Calls and total milliseconds per function (`schema.name`, overloads summed).
#[derive(Debug, Clone, Default, Serialize)]
pub struct FunctionStats(pub BTreeMap<String, (i64, f64)>);

impl FunctionStats {
    pub async fn read(pool: &PgPool) -> Result<Self> {
        let mut conn = pool.acquire().await?;
        sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&mut *conn).await?;
        let rows: Vec<(String, i64, f64)> = sqlx::query_as(
            "SELECT schemaname || '.' || funcname, sum(calls)::bigint, sum(total_time)::float8
               FROM pg_stat_user_functions WHERE schemaname IN ('lockgate', 'pgmq')
              GROUP BY 1",
        )
        .fetch_all(&mut *conn)
        .await?;
        Ok(Self(rows.into_iter().map(|(name, calls, ms)| (name, (calls, ms))).collect()))
    }

    /// Adds `other`'s calls and times to these (summing rounds).
    pub fn add(&mut self, other: &Self) {
        for (name, (calls, ms)) in &other.0 {
            let entry = self.0.entry(name.clone()).or_default();
            entry.0 += calls;
            entry.1 += ms;
        }
    }

    /// What happened between `before` and `self`: functions called at least once.
    pub fn since(&self, before: &Self) -> Self {
        let delta = self.0.iter().filter_map(|(name, &(calls, ms))| {
            let (c0, m0) = before.0.get(name).copied().unwrap_or_default();
            (calls > c0).then(|| (name.clone(), (calls - c0, ms - m0)))
        });
        Self(delta.collect())
    }

    /// "lockgate.claim 1,250 calls (16.0 jobs/call, 0.42 ms/call)" for each of `names` called.
    pub fn describe(&self, names: &[&str], jobs: f64) -> Vec<String> {
        names
            .iter()
            .filter_map(|name| {
                let &(calls, ms) = self.0.get(*name)?;
                Some(format!(
                    "{name}: {calls} calls, {:.1} jobs/call, {:.3} ms/call, {:.1} µs/job",
                    jobs / calls as f64,
                    ms / calls as f64,
                    ms * 1000.0 / jobs
                ))
            })
            .collect()
    }
}

/// Samples, every `every`, what the measured sessions of the database that are running a
/// statement (`state = 'active'`) wait on: `wait_event_type:wait_event` (`Lock:object` is a
/// heavyweight lock on a database object, such as the one every notifying commit takes), or
/// `running` when they wait on nothing. Idle sessions (waiting for their client) are not
/// counted. The sampling statement runs on the harness's own pool.
pub struct WaitSampler {
    stop: CancellationToken,
    task: JoinHandle<Result<WaitProfile>>,
}

/// Active-session samples per wait, and how many samples were taken.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WaitProfile {
    pub waits: BTreeMap<String, u64>,
    pub samples: u64,
}

impl WaitSampler {
    pub fn start(pool: PgPool, every: Duration) -> Self {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut profile = WaitProfile::default();
            let mut ticker = tokio::time::interval(every);
            loop {
                tokio::select! {
                    () = token.cancelled() => return Ok(profile),
                    _ = ticker.tick() => {}
                }
                let waits: Vec<String> = sqlx::query_scalar(
                    "SELECT coalesce(wait_event_type || ':' || wait_event, 'running') FROM pg_stat_activity
                      WHERE datname = current_database() AND application_name = $1 AND state = 'active'",
                )
                .bind(MEASURED_APP)
                .fetch_all(&pool)
                .await?;
                profile.samples += 1;
                for wait in waits {
                    *profile.waits.entry(wait).or_default() += 1;
                }
            }
        });
        Self { stop, task }
    }

    pub async fn finish(self) -> Result<WaitProfile> {
        self.stop.cancel();
        self.task.await.context("the wait sampler panicked")?
    }
}

impl WaitProfile {
    pub fn add(&mut self, other: &Self) {
        self.samples += other.samples;
        for (wait, n) in &other.waits {
            *self.waits.entry(wait.clone()).or_default() += n;
        }
    }

    /// "14.2 active sessions on average: Lock:object 81%, running 9%, IO:WALSync 6%, …" (the
    /// five most frequent).
    pub fn describe(&self) -> Option<String> {
        let total: u64 = self.waits.values().sum();
        if self.samples == 0 || total == 0 {
            return None;
        }
        let mut waits: Vec<(&String, &u64)> = self.waits.iter().collect();
        waits.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let shares: Vec<String> =
            waits.iter().take(5).map(|(w, n)| format!("{w} {:.0}%", **n as f64 * 100.0 / total as f64)).collect();
        Some(format!("{:.1} active sessions on average: {}", total as f64 / self.samples as f64, shares.join(", ")))
    }
}

/// This process's resident set, in KiB (`VmRSS` of `/proc/self/status`).
pub fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// This process's user + system CPU time in seconds, every thread included
/// (`CLOCK_PROCESS_CPUTIME_ID`: nanosecond resolution, and cheap enough to read around every
/// enqueue call, where `/proc/self/stat` counts 10 ms ticks and costs about 10 µs a read).
pub fn cpu_seconds() -> Option<f64> {
    cpu_time::ProcessTime::try_now().ok().map(|t| t.as_duration().as_secs_f64())
}

/// The whole machine's CPU counters from the first line of `/proc/stat`: (busy, total) jiffies.
/// Every process counts (PostgreSQL, this harness, and anything else running on the machine).
pub fn machine_cpu() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3)? + fields.get(4).unwrap_or(&0);
    Some((total - idle, total))
}

/// The busy share of the machine's CPU between two `machine_cpu` readings, in percent.
pub fn busy_percent(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((b0, t0), (b1, t1)) = (before?, after?);
    (t1 > t0).then(|| 100.0 * (b1 - b0) as f64 / (t1 - t0) as f64)
}
