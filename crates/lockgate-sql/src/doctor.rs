//! `lockgate.doctor()`: the checks the database alone can answer (sessions holding lockgate's
//! rows, timeouts, connection headroom, dead tuples, archive size, orphaned leases, parked jobs
//! with room, stale processes), and the database's clock for the host's clock check. The CLI's
//! `lockgate doctor` adds the schema check (`check_schema`) and the clock offset.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::Row;

use crate::pooler::{on, query, query_scalar, Db};

use crate::DbError;

/// How bad a check's finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Ok,
    Warn,
    Fail,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "fail",
        }
    }
}

/// One finding: which check, its verdict, what it saw and, when not ok, what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DoctorCheck {
    pub check: String,
    pub verdict: Verdict,
    pub detail: String,
    pub advice: Option<String>,
}

/// The thresholds of `lockgate.doctor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoctorThresholds {
    /// An active transaction older than this holding locks on lockgate's tables is a warning.
    pub long_running: Duration,
    /// A transaction idle longer than this holding such locks is a failure (H28).
    pub idle_in_transaction: Duration,
    /// A process silent longer than this is stale (the runtime's `alive_threshold`).
    pub alive_threshold: Duration,
}

/// Runs `lockgate.doctor(...)`.
pub async fn doctor<'c>(db: impl Into<Db<'c>>, t: &DoctorThresholds) -> Result<Vec<DoctorCheck>, DbError> {
    on(db.into(), async |conn| {
        let rows = query("SELECT check_name, verdict, detail, advice FROM lockgate.doctor($1, $2, $3)")
            .bind(t.long_running.as_secs_f64())
            .bind(t.idle_in_transaction.as_secs_f64())
            .bind(t.alive_threshold.as_secs_f64())
            .fetch_all(conn)
            .await?;
        Ok(rows.iter().map(check_of).collect())
    })
    .await
}

/// Runs only the doctor's `sessions` check (`lockgate._doctor_sessions`), which reads the server's
/// activity and locks, never a table of lockgate's or PGMQ's: it answers while one is locked.
pub async fn doctor_sessions<'c>(db: impl Into<Db<'c>>, t: &DoctorThresholds) -> Result<Vec<DoctorCheck>, DbError> {
    on(db.into(), async |conn| {
        let rows = query(
            "SELECT check_name, verdict, detail, advice
               FROM lockgate._doctor_sessions(make_interval(secs => $1), make_interval(secs => $2))",
        )
        .bind(t.long_running.as_secs_f64())
        .bind(t.idle_in_transaction.as_secs_f64())
        .fetch_all(conn)
        .await?;
        Ok(rows.iter().map(check_of).collect())
    })
    .await
}

fn check_of(r: &sqlx::postgres::PgRow) -> DoctorCheck {
    DoctorCheck {
        check: r.get(0),
        // The function returns only these three; anything else would be a bug, shown as one.
        verdict: match r.get::<&str, _>(1) {
            "ok" => Verdict::Ok,
            "warn" => Verdict::Warn,
            _ => Verdict::Fail,
        },
        detail: r.get(2),
        advice: r.get(3),
    }
}

/// The database's clock at the moment it runs the statement (`clock_timestamp()`, not the
/// transaction's `now()`), for measuring the host's offset from it.
pub async fn database_clock<'c>(db: impl Into<Db<'c>>) -> Result<DateTime<Utc>, DbError> {
    on(db.into(), async |conn| Ok(query_scalar("SELECT clock_timestamp()").fetch_one(conn).await?)).await
}
