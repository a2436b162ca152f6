//! Statements on deliveries: claim, heartbeat extension, fenced completion, retry in place,
//! dead-lettering and shutdown release. Every one after the claim is fenced on the delivery's
//! `(msg_id, read_ct)`: a stale delivery finds nothing and changes nothing (G2).

use std::time::Duration;

use lockgate_core::{Claim, QueueName};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::columns::readable_time;
use crate::pooler::{on, query, query_scalar, Db};

use crate::DbError;

/// Why a message is dead-lettered; stored in `lockgate.dead_letters.reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterReason {
    /// The last allowed attempt failed.
    AttemptsExhausted,
    /// The message is not a lockgate job (no or malformed headers, or arguments not an object).
    Undecodable,
    /// The job type does not resolve to a stored policy (a type without a handler in this
    /// process is a failed attempt instead, retried: another process may have the handler).
    UnknownJobType,
}

impl DeadLetterReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AttemptsExhausted => "attempts_exhausted",
            Self::Undecodable => "undecodable",
            Self::UnknownJobType => "unknown_job_type",
        }
    }
}

/// Claims up to `qty` visible messages of `queue`, invisible for `visibility` from now.
pub async fn claim<'c>(
    db: impl Into<Db<'c>>,
    queue: &QueueName,
    qty: i32,
    visibility: Duration,
) -> Result<Vec<Claim>, DbError> {
    claim_as(db, queue, qty, visibility, None, None).await
}

/// The columns of a claimed row, in the order `claim_row` reads them.
static CLAIM_COLUMNS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!("msg_id, read_ct, {}, message, headers, budget_seconds, claimed_ahead", readable_time("enqueued_at"))
});

/// One claimed row, from column `at` on: `CLAIM_COLUMNS`. Never fails: a column that cannot be read makes the claim
/// unreadable (it is dead-lettered), not the whole claim an error, which would leave every
/// delivery it took to lapse unrun.
fn claim_row(row: &PgRow, at: usize, queue: &QueueName) -> Claim {
    let mut unreadable = None;
    let mut json = |i: usize, what: &str| match row.try_get::<Option<serde_json::Value>, _>(at + i) {
        Ok(value) => value,
        Err(e) => {
            let cause = match e {
                sqlx::Error::ColumnDecode { source, .. } => source.to_string(),
                other => other.to_string(),
            };
            unreadable.get_or_insert_with(|| format!("the message's {what} cannot be read: {cause}"));
            None
        }
    };
    let message = json(3, "arguments");
    let headers = json(4, "headers");
    Claim {
        queue: queue.clone(),
        msg_id: row.get(at),
        read_ct: row.get(at + 1),
        // Only a metric reads it (the wait before the first start): an unreadable one reads as now.
        enqueued_at: row.get::<Option<chrono::DateTime<chrono::Utc>>, _>(at + 2).unwrap_or_else(chrono::Utc::now),
        message,
        headers,
        budget: seconds(row.get(at + 5)),
        claimed_ahead: row.get(at + 6),
        unreadable,
    }
}

/// Claims as `owner` (a registered supervisor's id, recorded on each message). With
/// `start_now`, only that many of the claimed deliveries (in claim order) start at once; the
/// others are claimed ahead ([`Claim::claimed_ahead`]), and each one's start must be recorded
/// ([`complete`]'s `started`) for its run to count as an attempt (H32).
pub async fn claim_as<'c>(
    db: impl Into<Db<'c>>,
    queue: &QueueName,
    qty: i32,
    visibility: Duration,
    owner: Option<i64>,
    start_now: Option<i32>,
) -> Result<Vec<Claim>, DbError> {
    static SQL: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| format!("SELECT {} FROM lockgate.claim($1, $2, $3, $4, $5)", *CLAIM_COLUMNS));
    on(db.into(), async |conn| {
        let rows = query(&SQL)
            .bind(queue.as_str())
            .bind(qty)
            .bind(visibility.as_secs_f64())
            .bind(owner)
            .bind(start_now)
            .fetch_all(conn)
            .await?;
        Ok(rows.iter().map(|row| claim_row(row, 0, queue)).collect())
    })
    .await
}

/// Claims as [`claim_as`] does from each of `queues` in order, for what the earlier ones left,
/// in one statement (`lockgate.claim_queues`): one round trip and one commit for a pool of many
/// queues. An error on any queue fails the call; claim queue by queue then to isolate it.
pub async fn claim_queues<'c>(
    db: impl Into<Db<'c>>,
    queues: &[QueueName],
    qty: i32,
    visibility: Duration,
    owner: Option<i64>,
    start_now: Option<i32>,
) -> Result<Vec<Claim>, DbError> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!("SELECT queue, {} FROM lockgate.claim_queues($1, $2, $3, $4, $5)", *CLAIM_COLUMNS)
    });
    on(db.into(), async |conn| {
        let names: Vec<&str> = queues.iter().map(QueueName::as_str).collect();
        let rows = query(&SQL)
            .bind(&names)
            .bind(qty)
            .bind(visibility.as_secs_f64())
            .bind(owner)
            .bind(start_now)
            .fetch_all(conn)
            .await?;
        let mut claims = Vec::with_capacity(rows.len());
        for row in rows {
            let name: String = row.get(0);
            // One of the names sent, so no new validation: the caller's own QueueName.
            let Some(queue) = queues.iter().find(|q| q.as_str() == name) else {
                let problem = format!("lockgate.claim_queues returned queue {name:?}, not one asked for");
                return Err(DbError::Sqlx(sqlx::Error::Protocol(problem)));
            };
            claims.push(claim_row(&row, 1, queue));
        }
        Ok(claims)
    })
    .await
}

/// What one renewal did, per delivery asked about. A delivery in neither list is lost: its
/// message was completed or re-claimed, or (for a limited job) its lease is gone.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Renewal {
    /// Renewed deliveries, each with its new budget: how long its visibility and lease now hold,
    /// counted from before the statement was sent.
    pub renewed: Vec<(i64, Duration)>,
    /// Deliveries whose rows another statement held locked (their own completion, retry or
    /// release, or a sweep expiring the lease): not renewed and not lost; ask again next tick.
    pub busy: Vec<i64>,
    /// Lost deliveries whose job was cancelled (filled in by the heartbeat from
    /// [`crate::cancelled_messages`], not by `extend`).
    pub cancelled: Vec<i64>,
}

/// Renews the visibility and leases of the given deliveries (fenced on their tokens; never
/// waits for a row lock). `owner` re-tags the messages with this process's registry id.
pub async fn extend<'c>(
    db: impl Into<Db<'c>>,
    queue: &QueueName,
    deliveries: &[(i64, i32)],
    visibility: Duration,
    owner: Option<i64>,
) -> Result<Renewal, DbError> {
    on(db.into(), async |conn| {
        let (ids, cts) = split(deliveries);
        let rows = query("SELECT msg_id, budget_seconds FROM lockgate.extend($1, $2, $3, $4, $5)")
            .bind(queue.as_str())
            .bind(ids)
            .bind(cts)
            .bind(visibility.as_secs_f64())
            .bind(owner)
            .fetch_all(conn)
            .await?;
        let mut renewal = Renewal::default();
        for row in rows {
            let msg_id: i64 = row.get(0);
            match row.get::<Option<f64>, _>(1) {
                Some(budget) => renewal.renewed.push((msg_id, seconds(budget))),
                None => renewal.busy.push(msg_id),
            }
        }
        Ok(renewal)
    })
    .await
}

/// Fenced archive of finished deliveries; returns the msg_ids this call archived. In the same
/// statement, records the start of the deliveries in `started` that were claimed ahead (H32).
pub async fn complete<'c>(
    db: impl Into<Db<'c>>,
    queue: &QueueName,
    deliveries: &[(i64, i32)],
    started: &[(i64, i32)],
) -> Result<Vec<i64>, DbError> {
    on(db.into(), async |conn| {
        let (ids, cts) = split(deliveries);
        let (started_ids, started_cts) = split(started);
        Ok(query_scalar("SELECT lockgate.complete($1, $2, $3, $4, $5)")
            .bind(queue.as_str())
            .bind(ids)
            .bind(cts)
            .bind(started_ids)
            .bind(started_cts)
            .fetch_all(conn)
            .await?)
    })
    .await
}

/// Retries a failed delivery in place after `delay`; false when this delivery no longer owns it.
pub async fn retry<'c>(
    db: impl Into<Db<'c>>,
    claim: &Claim,
    delay: Duration,
    error: &str,
    attempt: u32,
) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.retry($1, $2, $3, $4, $5, $6)")
            .bind(claim.queue.as_str())
            .bind(claim.msg_id)
            .bind(claim.read_ct)
            .bind(delay.as_secs_f64())
            .bind(error)
            .bind(i32::try_from(attempt).unwrap_or(i32::MAX))
            .fetch_one(conn)
            .await?)
    })
    .await
}

/// Moves a delivery's message to the dead letters; false when this delivery no longer owns it.
pub async fn dead_letter<'c>(
    db: impl Into<Db<'c>>,
    claim: &Claim,
    reason: DeadLetterReason,
    error: &str,
    attempts: u32,
) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.dead_letter($1, $2, $3, $4, $5, $6)")
            .bind(claim.queue.as_str())
            .bind(claim.msg_id)
            .bind(claim.read_ct)
            .bind(reason.as_str())
            .bind(error)
            .bind(i32::try_from(attempts).unwrap_or(i32::MAX))
            .fetch_one(conn)
            .await?)
    })
    .await
}

/// Returns unfinished deliveries to their queue, visible at once; returns the msg_ids released.
pub async fn release<'c>(
    db: impl Into<Db<'c>>,
    queue: &QueueName,
    deliveries: &[(i64, i32)],
    max_returns: Option<u32>,
) -> Result<Vec<i64>, DbError> {
    on(db.into(), async |conn| {
        let (ids, cts) = split(deliveries);
        Ok(query_scalar("SELECT lockgate.release($1, $2, $3, $4)")
            .bind(queue.as_str())
            .bind(ids)
            .bind(cts)
            .bind(max_returns.map(|m| i32::try_from(m).unwrap_or(i32::MAX)))
            .fetch_all(conn)
            .await?)
    })
    .await
}

/// A budget in seconds from SQL as a Duration (negative or non-finite reads as none left).
fn seconds(budget: f64) -> Duration {
    Duration::try_from_secs_f64(budget).unwrap_or(Duration::ZERO)
}

fn split(deliveries: &[(i64, i32)]) -> (Vec<i64>, Vec<i32>) {
    deliveries.iter().copied().unzip()
}
