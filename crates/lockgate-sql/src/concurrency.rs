//! Concurrency statements: the sweep, the runtime's heartbeat setting, and the operator views
//! (keys, parked jobs, explicit discard, the invariant check).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgExecutor, Row};

use crate::DbError;

/// What one sweep did (`lockgate.sweep`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Leases deleted because their silence budget ran out.
    pub expired: i32,
    /// Leases deleted because their message no longer exists.
    pub orphaned: i32,
    /// Parked jobs promoted to messages.
    pub promoted: i32,
}

/// Expires leases, repairs orphans and promotes parked jobs of keys with room (at most
/// `max_keys` keys). `now` pins the clock (tests); `None` uses the database's.
pub async fn sweep<'c>(
    db: impl PgExecutor<'c>,
    max_keys: i32,
    now: Option<DateTime<Utc>>,
) -> Result<SweepReport, DbError> {
    let row = sqlx::query("SELECT expired, orphaned, promoted FROM lockgate.sweep($1, $2)")
        .bind(max_keys)
        .bind(now)
        .fetch_one(db)
        .await?;
    Ok(SweepReport { expired: row.get(0), orphaned: row.get(1), promoted: row.get(2) })
}

/// Records this runtime's heartbeat interval; leases are floored at twice the largest recorded.
pub async fn record_heartbeat_interval<'c>(db: impl PgExecutor<'c>, interval: Duration) -> Result<(), DbError> {
    sqlx::query(
        "INSERT INTO lockgate.settings (heartbeat_interval_ms) VALUES ($1)
         ON CONFLICT (singleton) DO UPDATE SET heartbeat_interval_ms = GREATEST(lockgate.settings.heartbeat_interval_ms, $1)",
    )
    .bind(i64::try_from(interval.as_millis()).unwrap_or(i64::MAX))
    .execute(db)
    .await?;
    Ok(())
}

/// One key as `lockgate status` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyStats {
    pub key: String,
    pub limit: Option<i32>,
    pub held: i32,
    pub parked: i64,
    pub oldest_parked_seconds: Option<f64>,
}

pub async fn key_stats<'c>(db: impl PgExecutor<'c>) -> Result<Vec<KeyStats>, DbError> {
    let rows = sqlx::query("SELECT key, lim, held, parked, oldest_parked_seconds FROM lockgate.key_stats()")
        .fetch_all(db)
        .await?;
    Ok(rows
        .iter()
        .map(|r| KeyStats {
            key: r.get(0),
            limit: r.get(1),
            held: r.get(2),
            parked: r.get(3),
            oldest_parked_seconds: r.get(4),
        })
        .collect())
}

/// A job waiting for a permit.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ParkedJob {
    pub id: i64,
    pub key: String,
    pub queue: String,
    pub job_type: String,
    pub job_id: i64,
    pub args: Value,
    pub priority: i16,
    pub run_at: DateTime<Utc>,
    pub parked_at: DateTime<Utc>,
}

/// Parked jobs of one key (or all), in promotion order, at most `limit`.
pub async fn parked_jobs<'c>(
    db: impl PgExecutor<'c>,
    key: Option<&str>,
    limit: i32,
) -> Result<Vec<ParkedJob>, DbError> {
    let rows = sqlx::query(
        "SELECT id, key, queue, job_type, job_id, args, priority, run_at, parked_at FROM lockgate.parked_jobs($1, $2)",
    )
    .bind(key)
    .bind(limit)
    .fetch_all(db)
    .await?;
    Ok(rows
        .iter()
        .map(|r| ParkedJob {
            id: r.get(0),
            key: r.get(1),
            queue: r.get(2),
            job_type: r.get(3),
            job_id: r.get(4),
            args: r.get(5),
            priority: r.get(6),
            run_at: r.get(7),
            parked_at: r.get(8),
        })
        .collect())
}

/// An operator's explicit discard of one parked job; false when there was no such job.
pub async fn discard_parked<'c>(db: impl PgExecutor<'c>, parked_id: i64) -> Result<bool, DbError> {
    Ok(sqlx::query_scalar("SELECT lockgate.discard_parked($1)").bind(parked_id).fetch_one(db).await?)
}

/// Violations of the concurrency invariants as `(key, problem)`; empty when they all hold.
pub async fn check_invariants<'c>(db: impl PgExecutor<'c>) -> Result<Vec<(String, String)>, DbError> {
    Ok(sqlx::query_as("SELECT key, problem FROM lockgate.check_invariants()").fetch_all(db).await?)
}
