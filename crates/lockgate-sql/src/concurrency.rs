//! Concurrency statements: the sweep, the runtime's heartbeat setting, and the operator views
//! (keys, parked jobs, explicit discard, the invariant check).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Connection, PgConnection, Row};

use crate::pooler::{on, query, query_as, query_scalar, Db};

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
    db: impl Into<Db<'c>>,
    max_keys: i32,
    now: Option<DateTime<Utc>>,
) -> Result<SweepReport, DbError> {
    on(db.into(), async |conn| {
        let row = query("SELECT expired, orphaned, promoted FROM lockgate.sweep($1, $2)")
            .bind(max_keys)
            .bind(now)
            .fetch_one(conn)
            .await?;
        Ok(SweepReport { expired: row.get(0), orphaned: row.get(1), promoted: row.get(2) })
    })
    .await
}

/// The channel on which `lockgate._release_leases` names, once its transaction commits, each key
/// whose finished job's permit it left on the lease, marked finished, because another transaction
/// held the key's row (design §72).
pub const FINISHED_CHANNEL: &str = "lockgate.finished";

/// Gives back the permits of `key`'s jobs that finished while another transaction held its row,
/// promoting the key's parked jobs into them, in a transaction of its own that waits at most
/// `wait` for the key's row and holds nothing else meanwhile (so it closes no cycle). Returns
/// false when the row was still held after `wait`: the next holder of the row or the sweep gives
/// them back. READ COMMITTED whatever the connection's default: with an older snapshot, the
/// promotion would not see a job the row's holder parked, and a later enqueue would take the
/// permit ahead of it (review of §72, helper-74). Its own statement timeout, a second past the
/// wait: the pool's budget is a renewal's, not this one's. On a connection outside any transaction.
pub async fn give_back_finished(conn: &mut PgConnection, key: &str, wait: Duration) -> Result<bool, DbError> {
    let mut tx = conn.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED").await?;
    query("SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)")
        .bind(format!("{}ms", wait.as_millis().max(1)))
        .bind(format!("{}ms", wait.as_millis() + 1000))
        .execute(&mut *tx)
        .await?;
    match query("SELECT lockgate._give_back_finished($1)").bind(key).execute(&mut *tx).await {
        Ok(_) => {
            tx.commit().await?;
            Ok(true)
        }
        Err(e) if e.as_database_error().and_then(|d| d.code()).is_some_and(|c| c == "55P03") => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Records this runtime's heartbeat interval; leases are floored at twice the largest recorded.
/// An interval no longer than the one recorded changes nothing, and the statement then neither
/// writes nor locks the row: processes started together do not wait for each other's commits
/// here (the upsert locked the row even when it kept the larger value, so each start waited for
/// the one before it to flush). Nothing lowers the recorded interval, so one seen at least as
/// long stays so.
pub async fn record_heartbeat_interval<'c>(db: impl Into<Db<'c>>, interval: Duration) -> Result<(), DbError> {
    on(db.into(), async |conn| {
        query(
            "INSERT INTO lockgate.settings (heartbeat_interval_ms)
             SELECT $1 WHERE NOT EXISTS (SELECT 1 FROM lockgate.settings s WHERE s.heartbeat_interval_ms >= $1)
             ON CONFLICT (singleton) DO UPDATE SET heartbeat_interval_ms = GREATEST(lockgate.settings.heartbeat_interval_ms, $1)",
        )
        .bind(i64::try_from(interval.as_millis()).unwrap_or(i64::MAX))
        .execute(conn)
        .await?;
        Ok(())
    })
    .await
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

pub async fn key_stats<'c>(db: impl Into<Db<'c>>) -> Result<Vec<KeyStats>, DbError> {
    on(db.into(), async |conn| {
        let rows = query("SELECT key, lim, held, parked, oldest_parked_seconds FROM lockgate.key_stats()")
            .fetch_all(conn)
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
    })
    .await
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
pub async fn parked_jobs<'c>(db: impl Into<Db<'c>>, key: Option<&str>, limit: i32) -> Result<Vec<ParkedJob>, DbError> {
    on(db.into(), async |conn| {
        let rows = query(
        "SELECT id, key, queue, job_type, job_id, args, priority, run_at, parked_at FROM lockgate.parked_jobs($1, $2)",
    )
    .bind(key)
    .bind(limit)
    .fetch_all(conn)
    .await?;
        Ok(rows
            .iter()
            .map(|r| ParkedJob {
                id: r.get(0),
                key: r.get(1),
                queue: r.get(2),
                job_type: r.get(3),
                job_id: r.get(4),
                args: crate::columns::shown_json(r, 5).unwrap_or_default(),
                priority: r.get(6),
                run_at: r.get(7),
                parked_at: r.get(8),
            })
            .collect())
    })
    .await
}

/// An operator's explicit discard of one parked job; false when there was no such job.
pub async fn discard_parked<'c>(db: impl Into<Db<'c>>, parked_id: i64) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.discard_parked($1)").bind(parked_id).fetch_one(conn).await?)
    })
    .await
}

/// Violations of the concurrency invariants as `(key, problem)`; empty when they all hold.
pub async fn check_invariants<'c>(db: impl Into<Db<'c>>) -> Result<Vec<(String, String)>, DbError> {
    on(db.into(), async |conn| {
        Ok(query_as("SELECT key, problem FROM lockgate.check_invariants()").fetch_all(conn).await?)
    })
    .await
}
