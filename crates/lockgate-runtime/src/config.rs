//! Runtime configuration with documented defaults. The TOML config of `lockgate run` maps onto
//! these types; Rust users build them directly.

use std::time::Duration;

use lockgate_core::{validate_duration, QueueName, ValidationError};

use crate::in_flight::FENCE_MARGIN;

/// How long a claimed job stays invisible without a heartbeat. A dead worker's jobs come back
/// after at most this long (G5); 30 s is SQS's default and keeps recovery quick.
pub const DEFAULT_VISIBILITY_TIMEOUT: Duration = Duration::from_secs(30);
/// Heartbeats every 5 s give six chances to renew within one visibility timeout.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);
/// 25 s leaves 5 s of a Kubernetes pod's default 30 s grace period to return jobs and exit.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(25);
/// The polling fallback: correct on its own when notifications are lost; 1 s as in Oban.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Ten concurrent jobs per pool is a modest default for I/O-bound work on a small machine.
pub const DEFAULT_CONCURRENCY: usize = 10;
/// Archived jobs are kept a week, long enough to investigate last week's incident.
pub const DEFAULT_ARCHIVE_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Maintenance sweeps run every 30 s: retention is not urgent.
pub const DEFAULT_MAINTENANCE_INTERVAL: Duration = Duration::from_secs(30);
/// The concurrency sweep runs every 5 s: a dead holder's free permit is used within this long.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(5);
/// Process rows are renewed every 5 s, on their own timer and connection.
pub const DEFAULT_PROCESS_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);
/// A process silent for a minute is pruned. Recovery of its jobs never rests on this: they come
/// back when their visibility lapses, and pruning only cleans the registry (H26).
pub const DEFAULT_ALIVE_THRESHOLD: Duration = Duration::from_secs(60);

/// The gauges of `/metrics` are read from the database this often: 15 s is Prometheus's usual
/// scrape interval, and one cheap statement per process per 15 s costs the database nothing.
pub const DEFAULT_METRICS_INTERVAL: Duration = Duration::from_secs(15);
/// Concurrency keys that keep a label of their own in `/metrics` (the busiest by held + parked);
/// the rest are summed as `key="other"`. Fifty series per gauge is a fraction of what one
/// Prometheus target usually exports.
pub const DEFAULT_METRICS_MAX_KEYS: u32 = 50;

/// A job whose runs a shutdown cut short this many times is charged an attempt for each later
/// one: five deploys in a row is no accident, and a job that always outlives `shutdown_timeout`
/// must not cycle across deploys forever.
pub const DEFAULT_MAX_SHUTDOWN_RETURNS: u32 = 5;

/// Each pool holds at most this many bytes of claimed-ahead job arguments (jobs claimed for
/// handler slots that are not free yet), by the average size of the arguments it has claimed:
/// 16 MiB keeps a pool of 1 MiB payloads to 16 jobs ahead, and leaves small jobs (a few hundred
/// bytes) the full claim-ahead of five times the concurrency.
pub const DEFAULT_MAX_CLAIM_AHEAD_BYTES: usize = 16 * 1024 * 1024;

/// Process-wide settings of the runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeConfig {
    pub visibility_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub shutdown_timeout: Duration,
    pub poll_interval: Duration,
    pub archive_retention: Duration,
    pub maintenance_interval: Duration,
    /// How often the concurrency sweep expires leases and promotes parked jobs.
    pub sweep_interval: Duration,
    /// How often this process renews its rows in `lockgate.processes`.
    pub process_heartbeat_interval: Duration,
    /// How long a process may be silent before any other process prunes it.
    pub alive_threshold: Duration,
    /// Where `/livez` and `/readyz` are served; `None` serves nothing.
    pub health_listen: Option<std::net::SocketAddr>,
    /// When `health_listen` cannot be bound: `false` (the default) fails the start naming the
    /// address; `true` logs a warning and runs without the endpoints (the CLI's default address).
    pub health_listen_optional: bool,
    /// Shutdown returns of a started run that are not counted as attempts, per job; the next
    /// ones are (0: every shutdown return of a started run is an attempt).
    pub max_shutdown_returns: u32,
    /// How often the gauges of `/metrics` are read from the database (one statement per process).
    pub metrics_interval: Duration,
    /// Concurrency keys with a label of their own in `/metrics`; the rest are summed as `other`.
    pub metrics_max_keys: u32,
    /// A direct (or session-mode pooler) URL for the LISTEN connection, for a process whose pool
    /// goes through a transaction-mode pooler, where LISTEN cannot work. `None`: LISTEN on the
    /// pool's own server, or, under transaction pooling, no LISTEN (fetch loops poll every
    /// `poll_interval`).
    pub listen_database_url: Option<String>,
    /// Claimed-ahead job arguments a pool may hold in memory, in bytes (0: claim only for free
    /// handler slots). Judged by the average size of the arguments the pool has claimed.
    pub max_claim_ahead_bytes: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            visibility_timeout: DEFAULT_VISIBILITY_TIMEOUT,
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            poll_interval: DEFAULT_POLL_INTERVAL,
            archive_retention: DEFAULT_ARCHIVE_RETENTION,
            maintenance_interval: DEFAULT_MAINTENANCE_INTERVAL,
            sweep_interval: DEFAULT_SWEEP_INTERVAL,
            process_heartbeat_interval: DEFAULT_PROCESS_HEARTBEAT_INTERVAL,
            alive_threshold: DEFAULT_ALIVE_THRESHOLD,
            health_listen: None,
            health_listen_optional: false,
            max_shutdown_returns: DEFAULT_MAX_SHUTDOWN_RETURNS,
            metrics_interval: DEFAULT_METRICS_INTERVAL,
            metrics_max_keys: DEFAULT_METRICS_MAX_KEYS,
            listen_database_url: None,
            max_claim_ahead_bytes: DEFAULT_MAX_CLAIM_AHEAD_BYTES,
        }
    }
}

impl RuntimeConfig {
    /// G6: every lease is at least twice the heartbeat interval, so one late tick never loses it;
    /// and, since a handler is cancelled `FENCE_MARGIN` before its budget runs out (H27), the
    /// visibility timeout also covers that margin, or every handler would be fenced between two
    /// healthy renewals.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let durations = [
            ("visibility_timeout", self.visibility_timeout),
            ("heartbeat_interval", self.heartbeat_interval),
            ("shutdown_timeout", self.shutdown_timeout),
            ("poll_interval", self.poll_interval),
            ("archive_retention", self.archive_retention),
            ("maintenance_interval", self.maintenance_interval),
            ("sweep_interval", self.sweep_interval),
            ("process_heartbeat_interval", self.process_heartbeat_interval),
            ("alive_threshold", self.alive_threshold),
            ("metrics_interval", self.metrics_interval),
        ];
        for (field, value) in durations {
            validate_duration(field, value)?;
        }
        if self.heartbeat_interval.is_zero() {
            return Err(ValidationError::new("heartbeat_interval", "0s", "a positive duration"));
        }
        if self.visibility_timeout < self.heartbeat_interval * 2 + FENCE_MARGIN {
            return Err(ValidationError::new(
                "visibility_timeout",
                format!("{:?}", self.visibility_timeout),
                format!(
                    "at least twice heartbeat_interval ({:?}) plus the {FENCE_MARGIN:?} self-fencing margin",
                    self.heartbeat_interval
                ),
            ));
        }
        let intervals = [
            ("poll_interval", self.poll_interval),
            ("maintenance_interval", self.maintenance_interval),
            ("sweep_interval", self.sweep_interval),
            ("process_heartbeat_interval", self.process_heartbeat_interval),
            ("metrics_interval", self.metrics_interval),
        ];
        for (field, value) in intervals {
            if value.is_zero() {
                return Err(ValidationError::new(field, "0s", "a positive duration"));
            }
        }
        // Three missed process heartbeats before anyone may prune: one late tick is not death.
        if self.alive_threshold < self.process_heartbeat_interval * 3 {
            return Err(ValidationError::new(
                "alive_threshold",
                format!("{:?}", self.alive_threshold),
                format!("at least three process_heartbeat_interval ({:?})", self.process_heartbeat_interval),
            ));
        }
        Ok(())
    }
}

/// The most jobs one pool runs at once. Far above what a process's handlers and connections can
/// serve; a larger figure (a typo, or a unit mistaken) sized the runtime's connection pool by it
/// and aborted the start on an allocation of tens of gigabytes (review helper-116 F3).
pub const MAX_POOL_CONCURRENCY: usize = 10_000;

/// One worker pool: the queues it serves, in strict priority order, and how many jobs it runs
/// at once.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    pub name: String,
    /// Claimed in this order: a later queue gets only the capacity earlier queues left.
    pub queues: Vec<QueueName>,
    pub concurrency: usize,
}

impl PoolConfig {
    pub fn new(name: impl Into<String>, queues: Vec<QueueName>, concurrency: usize) -> Self {
        Self { name: name.into(), queues, concurrency }
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        let pool = &self.name;
        if self.queues.is_empty() {
            return Err(ValidationError::new("queues", "[]", format!("at least one queue in pool {pool}")));
        }
        if self.concurrency == 0 || self.concurrency > MAX_POOL_CONCURRENCY {
            return Err(ValidationError::new(
                "concurrency",
                self.concurrency,
                format!("an integer from 1 to {MAX_POOL_CONCURRENCY} in pool {pool}"),
            ));
        }
        // Named twice, a queue would be claimed from twice per claim (review helper-92: accepted
        // in silence).
        for (i, queue) in self.queues.iter().enumerate() {
            if self.queues[..i].contains(queue) {
                return Err(ValidationError::new("queues", queue, format!("each queue once in pool {pool}")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visibility_must_cover_two_heartbeats() {
        let cfg = RuntimeConfig { visibility_timeout: Duration::from_secs(5), ..Default::default() };
        assert_eq!(cfg.validate().unwrap_err().field, "visibility_timeout");
        // Twice the interval is not enough: a handler is fenced 300 ms before its budget ends.
        let cfg = RuntimeConfig {
            visibility_timeout: Duration::from_millis(200),
            heartbeat_interval: Duration::from_millis(100),
            ..Default::default()
        };
        assert_eq!(cfg.validate().unwrap_err().field, "visibility_timeout");
        let cfg = RuntimeConfig { sweep_interval: Duration::ZERO, ..Default::default() };
        assert_eq!(cfg.validate().unwrap_err().field, "sweep_interval");
        assert!(RuntimeConfig::default().validate().is_ok());
    }
}
