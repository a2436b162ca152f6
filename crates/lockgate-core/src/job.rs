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

/// A job's identity across deliveries and dead-letter retries (a PGMQ `msg_id` changes when a
/// dead-lettered job is retried; the job id does not).
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
}

impl EnqueueStatus {
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "enqueued" => Some(Self::Enqueued),
            "parked" => Some(Self::Parked),
            "discarded" => Some(Self::Discarded),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enqueued => "enqueued",
            Self::Parked => "parked",
            Self::Discarded => "discarded",
        }
    }
}

/// What an enqueue returns: where the job is, what it is called, and what became of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnqueuedJob {
    pub queue: String,
    /// The PGMQ message, when the job was enqueued (not parked or discarded).
    pub msg_id: Option<i64>,
    pub job_id: JobId,
    pub status: EnqueueStatus,
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
        Ok(Value::Object(map))
    }
}

/// The lockgate fields of a message's PGMQ headers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobHeaders {
    pub job_id: JobId,
    #[serde(rename = "type")]
    pub job_type: String,
    #[serde(default)]
    pub priority: i16,
    /// How many times a shutdown returned this job to its queue; those deliveries are not
    /// attempts (G7: a job that was only being shut down is not failed).
    #[serde(default)]
    pub returns: i32,
}

impl JobHeaders {
    /// Decodes headers, or says why they are not lockgate's (the message is then dead-lettered).
    pub fn decode(headers: Option<&Value>) -> Result<Self, String> {
        let headers = headers.ok_or("message has no lockgate headers")?;
        // Deserialized from the borrowed value: no copy of the headers per delivery.
        JobHeaders::deserialize(headers).map_err(|e| format!("message headers are not lockgate's: {e}"))
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
}

impl Claim {
    /// The attempt this delivery is: deliveries minus shutdown returns. A delivery lost to a
    /// crash counts as an attempt, so a job that kills its worker cannot loop forever.
    pub fn attempt(&self, headers: &JobHeaders) -> u32 {
        u32::try_from(self.read_ct - headers.returns).unwrap_or(1).max(1)
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
        let err = JobHeaders::decode(Some(&json!({"x": 1}))).unwrap_err();
        assert!(err.contains("not lockgate's"), "{err}");
        assert!(JobHeaders::decode(None).is_err());
        let ok = JobHeaders::decode(Some(&json!({"job_id": 7, "type": "t"}))).unwrap();
        assert_eq!(ok.job_id, JobId(7));
    }
}
