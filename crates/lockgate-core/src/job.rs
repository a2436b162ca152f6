//! Jobs as lockgate stores them in PGMQ: the arguments are the message (a JSON object), and
//! lockgate's own fields (job id, type, priority, attempt history) live in the message headers.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::policy::validate_priority;
use crate::{QueueName, ValidationError};

/// Payloads above 1 MiB are refused: PGMQ rows are read in batches, and a job queue is not a blob
/// store. The SQL functions enforce the same bound for SQL producers.
pub const MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// A job's identity across deliveries, promotion and dead-letter retries: the `msg_id` of its
/// first message (every lockgate queue draws its msg_ids from one sequence, so they are unique
/// across queues). A job sent again as a new message keeps it in its headers' `job_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub i64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// What became of an enqueued job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnqueueStatus {
    /// A message exists in its queue.
    Enqueued,
    /// Its concurrency key was full: it waits in `lockgate.parked` and runs when promoted.
    Parked,
    /// Its concurrency key was full and its type discards on conflict: nothing was stored.
    Discarded,
    /// Its unique key is held by another job (whose id the result carries) and its type
    /// discards duplicates: nothing was stored.
    Duplicate,
}

impl EnqueueStatus {
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "enqueued" => Some(Self::Enqueued),
            "parked" => Some(Self::Parked),
            "discarded" => Some(Self::Discarded),
            "duplicate" => Some(Self::Duplicate),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enqueued => "enqueued",
            Self::Parked => "parked",
            Self::Discarded => "discarded",
            Self::Duplicate => "duplicate",
        }
    }
}

/// What an enqueue returns: where the job is, what it is called, and what became of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnqueuedJob {
    pub queue: String,
    /// The PGMQ message, when the job was enqueued (not parked or discarded).
    pub msg_id: Option<i64>,
    /// The job's id; for a `Duplicate`, the id of the job that holds the unique key.
    pub job_id: JobId,
    pub status: EnqueueStatus,
}

/// A batch's id, as `lockgate.create_batch` returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BatchId(pub i64);

impl std::fmt::Display for BatchId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Per-enqueue overrides of the job type's policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EnqueueOptions {
    /// Run no earlier than this long from now.
    pub delay: Option<Duration>,
    /// Run no earlier than this instant (exclusive with `delay`).
    pub run_at: Option<DateTime<Utc>>,
    pub priority: Option<i16>,
    pub queue: Option<QueueName>,
    /// An explicit concurrency key, replacing the one derived from the arguments.
    pub concurrency_key: Option<String>,
    /// An explicit unique key, replacing the one derived from the arguments.
    pub unique_key: Option<String>,
    /// Enqueue into this open batch.
    pub batch: Option<BatchId>,
}

impl EnqueueOptions {
    /// The `options` object `lockgate.enqueue` takes; validated here so Rust callers fail early.
    pub fn to_json(&self) -> Result<Value, ValidationError> {
        let mut map = Map::new();
        if self.delay.is_some() && self.run_at.is_some() {
            return Err(ValidationError::new("delay", "delay and run_at", "one of delay or run_at, not both"));
        }
        if let Some(delay) = self.delay {
            map.insert("delay".into(), json!(delay.as_secs_f64()));
        }
        if let Some(run_at) = self.run_at {
            map.insert("run_at".into(), json!(run_at.to_rfc3339()));
        }
        if let Some(priority) = self.priority {
            validate_priority(priority)?;
            map.insert("priority".into(), json!(priority));
        }
        if let Some(queue) = &self.queue {
            map.insert("queue".into(), json!(queue.as_str()));
        }
        if let Some(key) = &self.concurrency_key {
            map.insert("concurrency_key".into(), json!(key));
        }
        if let Some(key) = &self.unique_key {
            map.insert("unique_key".into(), json!(key));
        }
        if let Some(batch) = self.batch {
            map.insert("batch".into(), json!(batch.0));
        }
        Ok(Value::Object(map))
    }
}

/// The lockgate fields of a message's PGMQ headers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobHeaders {
    /// The job's id: the msg_id of its first message. A job sent again as a new message
    /// (promoted from the parked jobs, retried from the dead letters) carries it as `job_id`.
    pub job_id: JobId,
    #[serde(rename = "type")]
    pub job_type: String,
    pub priority: i16,
    /// How many times a shutdown returned this job to its queue; those deliveries are not
    /// attempts (G7: a job that was only being shut down is not failed).
    pub returns: i32,
    /// Attempts made by the job's earlier messages: a job parked again at claim (its lease
    /// lapsed and its key was full) is promoted as a new message whose `read_ct` starts over,
    /// so its count carries on here (H32).
    pub attempts_before: i32,
    /// Set by the claim on a job of a `while_executing` type that discards duplicates, when
    /// another job of its unique key is running: the job is completed without running.
    pub duplicate_of: Option<JobId>,
}

/// The headers as stored: `job_id` and `priority` may be absent.
#[derive(Deserialize)]
struct StoredHeaders {
    job_id: Option<JobId>,
    #[serde(rename = "type")]
    job_type: String,
    #[serde(default)]
    priority: i16,
    #[serde(default)]
    returns: i32,
    #[serde(default)]
    attempts_before: i32,
    duplicate_of: Option<JobId>,
}

impl JobHeaders {
    /// Decodes the headers of message `msg_id`, or says why they are not lockgate's (the message
    /// is then dead-lettered).
    pub fn decode(headers: Option<&Value>, msg_id: i64) -> Result<Self, String> {
        let headers = headers.ok_or("message has no lockgate headers")?;
        // Deserialized from the borrowed value: no copy of the headers per delivery.
        let stored =
            StoredHeaders::deserialize(headers).map_err(|e| format!("message headers are not lockgate's: {e}"))?;
        Ok(Self {
            job_id: stored.job_id.unwrap_or(JobId(msg_id)),
            job_type: stored.job_type,
            priority: stored.priority,
            returns: stored.returns,
            attempts_before: stored.attempts_before,
            duplicate_of: stored.duplicate_of,
        })
    }
}

/// One delivery of a message, as a worker claimed it. `(queue, msg_id, read_ct)` is the fencing
/// token: every later state change of this delivery matches on all three.
#[derive(Debug, Clone)]
pub struct Claim {
    pub queue: QueueName,
    pub msg_id: i64,
    pub read_ct: i32,
    pub enqueued_at: DateTime<Utc>,
    pub message: Option<Value>,
    pub headers: Option<Value>,
    /// How long this delivery's visibility (and, for a limited job, its lease, which the
    /// visibility never outlives) holds in the database, counted from before the claim was
    /// sent. A worker must have stopped the job's handler before this runs out (H27).
    pub budget: std::time::Duration,
    /// Claimed ahead of a free handler slot: its start must be recorded (`lockgate.complete`'s
    /// started arguments) for its run to count as an attempt (H32).
    pub claimed_ahead: bool,
    /// Why the row's arguments or headers could not be read (nested deeper than the JSON
    /// decoder goes): such a delivery is dead-lettered as undecodable with this reason, and
    /// nothing else claimed with it is affected.
    pub unreadable: Option<String>,
}

impl Claim {
    /// The attempt this delivery is: deliveries minus returns (shutdown returns, and deliveries
    /// claimed ahead whose worker died before starting them), plus the attempts of the job's
    /// earlier messages. A run lost to a crash counts as an attempt, so a job that kills its
    /// worker cannot loop forever (H32).
    pub fn attempt(&self, headers: &JobHeaders) -> u32 {
        let attempt = i64::from(self.read_ct) - i64::from(headers.returns) + i64::from(headers.attempts_before);
        u32::try_from(attempt.max(1)).unwrap_or(u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_reject_delay_with_run_at() {
        let opts =
            EnqueueOptions { delay: Some(Duration::from_secs(1)), run_at: Some(Utc::now()), ..Default::default() };
        assert_eq!(opts.to_json().unwrap_err().field, "delay");
    }

    #[test]
    fn headers_without_lockgate_fields_are_refused_with_a_reason() {
        let err = JobHeaders::decode(Some(&json!({"x": 1})), 1).unwrap_err();
        assert!(err.contains("not lockgate's"), "{err}");
        assert!(JobHeaders::decode(None, 1).is_err());
        let sent_again = JobHeaders::decode(Some(&json!({"job_id": 7, "type": "t", "priority": 3})), 9).unwrap();
        assert_eq!((sent_again.job_id, sent_again.priority), (JobId(7), 3));
        let first = JobHeaders::decode(Some(&json!({"type": "t"})), 9).unwrap();
        assert_eq!((first.job_id, first.priority), (JobId(9), 0), "a job on its first message has its msg_id as id");
    }
}
