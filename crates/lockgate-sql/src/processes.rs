//! Process registry statements: register, heartbeat, deregister, prune, list.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::Row;

use crate::pooler::{on, query, query_as, query_scalar, Db};

use crate::DbError;

/// One row of `lockgate.processes`.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessRow {
    pub id: i64,
    pub kind: String,
    pub name: String,
    pub host: String,
    pub pid: i32,
    pub supervisor_id: Option<i64>,
    pub started_at: DateTime<Utc>,
    pub heartbeat_age_seconds: f64,
    pub metadata: Value,
}

pub async fn register_process<'c>(
    db: impl Into<Db<'c>>,
    kind: &str,
    name: &str,
    host: &str,
    pid: i32,
    supervisor_id: Option<i64>,
    metadata: &Value,
) -> Result<i64, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.register_process($1, $2, $3, $4, $5, $6)")
            .bind(kind)
            .bind(name)
            .bind(host)
            .bind(pid)
            .bind(supervisor_id)
            .bind(metadata)
            .fetch_one(conn)
            .await?)
    })
    .await
}

/// Renews the given rows (with fresh metadata); returns the ids that still exist.
pub async fn heartbeat_processes<'c>(db: impl Into<Db<'c>>, rows: &[(i64, Value)]) -> Result<Vec<i64>, DbError> {
    on(db.into(), async |conn| {
        let (ids, metadata): (Vec<i64>, Vec<Value>) = rows.iter().cloned().unzip();
        Ok(query_scalar("SELECT lockgate.heartbeat_processes($1, $2)").bind(ids).bind(metadata).fetch_all(conn).await?)
    })
    .await
}

/// Deletes a supervisor's row and, with it, its services' rows.
pub async fn deregister_process<'c>(db: impl Into<Db<'c>>, supervisor_id: i64) -> Result<(), DbError> {
    on(db.into(), async |conn| {
        query("SELECT lockgate.deregister_process($1)").bind(supervisor_id).execute(conn).await?;
        Ok(())
    })
    .await
}

/// Prunes supervisors silent past `alive_threshold_seconds`; returns `(pruned id, jobs still in
/// flight)`. Their jobs are left alone: they come back when their visibility lapses (H26).
pub async fn prune_processes<'c>(
    db: impl Into<Db<'c>>,
    alive_threshold_seconds: f64,
) -> Result<Vec<(i64, i64)>, DbError> {
    on(db.into(), async |conn| {
        Ok(query_as("SELECT pruned_id, in_flight FROM lockgate.prune_processes($1)")
            .bind(alive_threshold_seconds)
            .fetch_all(conn)
            .await?)
    })
    .await
}

/// Every registered process, supervisors first, each followed by its services.
pub async fn list_processes<'c>(db: impl Into<Db<'c>>) -> Result<Vec<ProcessRow>, DbError> {
    on(db.into(), async |conn| {
        let rows = query(
            "SELECT id, kind, name, host, pid, supervisor_id, started_at,
                extract(epoch FROM now() - last_heartbeat_at)::float8, metadata
           FROM lockgate.processes ORDER BY COALESCE(supervisor_id, id), supervisor_id NULLS FIRST, id",
        )
        .fetch_all(conn)
        .await?;
        Ok(rows
            .iter()
            .map(|r| ProcessRow {
                id: r.get(0),
                kind: r.get(1),
                name: r.get(2),
                host: r.get(3),
                pid: r.get(4),
                supervisor_id: r.get(5),
                started_at: r.get(6),
                heartbeat_age_seconds: r.get(7),
                metadata: r.get(8),
            })
            .collect())
    })
    .await
}
