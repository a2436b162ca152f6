//! Job-type policies: where a job runs, in what order, how often it may fail and how long it may
//! take. Policies are stored in `lockgate.job_types`, so SQL producers get the same semantics as
//! Rust producers; this module holds their Rust form, defaults and validation.

use std::time::Duration;

use crate::{QueueName, ValidationError};

/// Priorities run from 0 (first) to `MAX_PRIORITY` (last), as in Oban: few levels are enough to
/// express "urgent before bulk", and a small range keeps the claim index compact.
pub const MAX_PRIORITY: i16 = 9;

/// Sidekiq and Oban both default to ~20–25 attempts, spreading retries over days; we keep 20.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 20;
/// The first retry waits about a second: long enough to ride out a blip, short enough to notice.
pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Exponential growth stops at an hour so a long outage does not push retries out by days.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(3600);
/// ±10% spreads retries of a burst of failures without making the schedule unpredictable.
pub const DEFAULT_BACKOFF_JITTER: f64 = 0.1;

/// The longest duration a policy or setting may hold: 100 years (36,525 days). Every duration
/// is added to the database's clock somewhere (a lease's end, a retry's time, a lock timeout),
/// and one past PostgreSQL's timestamps made that statement fail, for every job it touched.
pub const MAX_DURATION: Duration = Duration::from_secs(36_525 * 24 * 3600);

/// Refuses a duration longer than [`MAX_DURATION`], naming `field`.
pub fn validate_duration(field: &'static str, value: Duration) -> Result<(), ValidationError> {
    if value > MAX_DURATION {
        return Err(ValidationError::new(field, format!("{value:?}"), "a duration of at most 100 years (36525d)"));
    }
    Ok(())
}

/// Exponential backoff between attempts: `base * 2^(failures-1)`, capped at `max`, then spread by
/// `±jitter` (a fraction of the delay).
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { base: DEFAULT_BACKOFF_BASE, max: DEFAULT_BACKOFF_MAX, jitter: DEFAULT_BACKOFF_JITTER }
    }
}

impl Backoff {
    /// The delay before the attempt that follows `failures` failed attempts (`failures >= 1`).
    pub fn delay(&self, failures: u32) -> Duration {
        let exponent = failures.saturating_sub(1).min(32);
        let raw = self.base.saturating_mul(1u32 << exponent.min(31)).min(self.max);
        let spread = 1.0 + self.jitter * (fastrand::f64() * 2.0 - 1.0);
        raw.mul_f64(spread.max(0.0)).min(MAX_DURATION)
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(ValidationError::new("backoff.jitter", self.jitter, "a fraction between 0 and 1"));
        }
        validate_duration("backoff.base", self.base)?;
        validate_duration("backoff.max", self.max)?;
        if self.max < self.base {
            return Err(ValidationError::new(
                "backoff.max",
                format!("{:?}", self.max),
                format!("a duration at least backoff.base ({:?})", self.base),
            ));
        }
        Ok(())
    }
}

/// A holder may be silent this long before its permit is presumed dead: long enough to ride out
/// a database failover, short enough that a crashed holder's key is not blocked for long.
pub const DEFAULT_CONCURRENCY_DURATION: Duration = Duration::from_secs(15 * 60);

/// What an enqueue does when its key has no free permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnConflict {
    /// Park the job; it runs when a permit frees up (promotion). It is never lost.
    #[default]
    Block,
    /// Drop the job; the enqueue reports `discarded`.
    Discard,
    /// Refuse the enqueue with an error (SQLSTATE LG004).
    Raise,
}

impl OnConflict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Block => "block",
            Self::Discard => "discard",
            Self::Raise => "raise",
        }
    }

    pub fn parse(value: &str) -> Result<Self, ValidationError> {
        match value {
            "block" => Ok(Self::Block),
            "discard" => Ok(Self::Discard),
            "raise" => Ok(Self::Raise),
            other => Err(ValidationError::new("concurrency.on_conflict", other, "block, discard or raise")),
        }
    }
}

/// At most `limit` jobs of one key hold a permit at any instant (G3).
#[derive(Debug, Clone, PartialEq)]
pub struct ConcurrencyPolicy {
    pub limit: u32,
    /// Argument paths (dotted, e.g. `account.id`) whose values, after the job type's name, make
    /// the key. Empty: one key for the whole job type.
    pub key: Vec<String>,
    /// How long a holder may be silent (no heartbeat) before its permit is presumed dead. It
    /// bounds silence, not run time; it is floored at twice the heartbeat interval.
    pub duration: Duration,
    pub on_conflict: OnConflict,
}

impl ConcurrencyPolicy {
    pub fn new(limit: u32) -> Self {
        Self { limit, key: Vec::new(), duration: DEFAULT_CONCURRENCY_DURATION, on_conflict: OnConflict::Block }
    }

    /// The argument paths whose values make the key (default: one key for the job type).
    pub fn key<S: Into<String>>(mut self, paths: impl IntoIterator<Item = S>) -> Self {
        self.key = paths.into_iter().map(Into::into).collect();
        self
    }

    pub fn duration(mut self, duration: Duration) -> Self {
        self.duration = duration;
        self
    }

    pub fn on_conflict(mut self, on_conflict: OnConflict) -> Self {
        self.on_conflict = on_conflict;
        self
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.limit < 1 || i32::try_from(self.limit).is_err() {
            return Err(ValidationError::new("concurrency.limit", self.limit, "an integer of at least 1"));
        }
        if self.duration.is_zero() {
            return Err(ValidationError::new("concurrency.duration", "0s", "a positive duration"));
        }
        validate_duration("concurrency.duration", self.duration)?;
        validate_key_paths("concurrency.key", &self.key)
    }
}

/// When a job type's uniqueness lock is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UniqueMode {
    /// From enqueue until the job succeeds, is dead-lettered or discarded: at most one job per
    /// key is queued, parked or running. A retry keeps the lock.
    UntilExecuted,
    /// While a run is running: jobs of one key may queue up, but at most one runs at a time.
    WhileExecuting,
}

impl UniqueMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UntilExecuted => "until_executed",
            Self::WhileExecuting => "while_executing",
        }
    }

    pub fn parse(value: &str) -> Result<Self, ValidationError> {
        match value {
            "until_executed" => Ok(Self::UntilExecuted),
            "while_executing" => Ok(Self::WhileExecuting),
            other => Err(ValidationError::new("unique.mode", other, "until_executed or while_executing")),
        }
    }
}

/// What happens to a job whose unique key another job holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UniqueOnConflict {
    /// The enqueue fails with a matchable error (SQLSTATE LG005) naming the holder. For
    /// `while_executing`, the job waits (it is put back for a second) until the holder's run ends.
    #[default]
    Reject,
    /// The enqueue reports `duplicate` with the holder's job id and stores nothing. For
    /// `while_executing`, the job is archived as a duplicate when its run would start.
    Discard,
}

impl UniqueOnConflict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reject => "reject",
            Self::Discard => "discard",
        }
    }

    pub fn parse(value: &str) -> Result<Self, ValidationError> {
        match value {
            "reject" => Ok(Self::Reject),
            "discard" => Ok(Self::Discard),
            other => Err(ValidationError::new("unique.on_conflict", other, "reject or discard")),
        }
    }
}

/// At most one job per unique key holds its lock (G2, H14).
#[derive(Debug, Clone, PartialEq)]
pub struct UniquePolicy {
    pub mode: UniqueMode,
    /// Argument paths (dotted) whose values, after the job type's name, make the key. Empty: one
    /// key for the whole job type. An enqueue may give the key explicitly instead.
    pub key: Vec<String>,
    pub on_conflict: UniqueOnConflict,
}

impl UniquePolicy {
    pub fn new(mode: UniqueMode) -> Self {
        Self { mode, key: Vec::new(), on_conflict: UniqueOnConflict::Reject }
    }

    /// The argument paths whose values make the key (default: one key for the job type).
    pub fn key<S: Into<String>>(mut self, paths: impl IntoIterator<Item = S>) -> Self {
        self.key = paths.into_iter().map(Into::into).collect();
        self
    }

    pub fn on_conflict(mut self, on_conflict: UniqueOnConflict) -> Self {
        self.on_conflict = on_conflict;
        self
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_key_paths("unique.key", &self.key)
    }
}

fn validate_key_paths(field: &'static str, paths: &[String]) -> Result<(), ValidationError> {
    if let Some(bad) = paths.iter().find(|p| p.is_empty() || p.split('.').any(str::is_empty)) {
        return Err(ValidationError::new(field, bad, "argument paths such as \"account\" or \"account.id\""));
    }
    Ok(())
}

/// The stored policy of one job type.
#[derive(Debug, Clone, PartialEq)]
pub struct JobPolicy {
    /// The queue jobs of this type go to unless an enqueue overrides it.
    pub queue: QueueName,
    /// 0 runs first, `MAX_PRIORITY` last; an enqueue may override it.
    pub priority: i16,
    /// Attempts before the job is dead-lettered, counting the first (at least 1).
    pub max_attempts: u32,
    pub backoff: Backoff,
    /// How long one attempt may run before it is cancelled and counted as failed.
    pub timeout: Option<Duration>,
    /// A limit on how many jobs of one key run at once; `None` is unlimited.
    pub concurrency: Option<ConcurrencyPolicy>,
    /// At most one job per key enqueued (until_executed) or running (while_executing).
    pub unique: Option<UniquePolicy>,
}

impl JobPolicy {
    /// A policy with lockgate's defaults on the given queue.
    pub fn on_queue(queue: QueueName) -> Self {
        Self {
            queue,
            priority: 0,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff: Backoff::default(),
            timeout: None,
            concurrency: None,
            unique: None,
        }
    }

    /// A policy built from lockgate's defaults on the queue `default`; see [`JobPolicyBuilder`].
    pub fn builder() -> JobPolicyBuilder {
        let queue = QueueName::new("default").expect("\"default\" is a valid queue name");
        JobPolicyBuilder { queue: queue.as_str().to_string(), policy: Self::on_queue(queue) }
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_priority(self.priority)?;
        if self.max_attempts < 1 {
            return Err(ValidationError::new("max_attempts", self.max_attempts, "an integer of at least 1"));
        }
        // Stored in whole milliseconds: a timeout under one was stored as 0 and refused by the
        // database, naming a value the user never wrote (review helper-145 F9).
        if let Some(t) = self.timeout.filter(|t| *t < std::time::Duration::from_millis(1)) {
            return Err(ValidationError::new("timeout", format!("{t:?}"), "a duration of at least 1ms, or none"));
        }
        if let Some(timeout) = self.timeout {
            validate_duration("timeout", timeout)?;
        }
        if let Some(concurrency) = &self.concurrency {
            concurrency.validate()?;
        }
        if let Some(unique) = &self.unique {
            unique.validate()?;
        }
        self.backoff.validate()
    }
}

/// Builds a [`JobPolicy`] from lockgate's defaults, checking it as [`JobPolicy::validate`] does
/// (and the queue's name as [`QueueName::new`] does) when built:
///
/// ```
/// use std::time::Duration;
/// use lockgate_core::{ConcurrencyPolicy, JobPolicy};
///
/// let policy = JobPolicy::builder()
///     .queue("mail")
///     .max_attempts(5)
///     .timeout(Duration::from_secs(60))
///     .concurrency(ConcurrencyPolicy::new(2).key(["account_id"]))
///     .build()
///     .expect("a valid policy");
/// assert_eq!(policy.queue.as_str(), "mail");
/// assert!(JobPolicy::builder().max_attempts(0).build().is_err());
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until built"]
pub struct JobPolicyBuilder {
    queue: String,
    policy: JobPolicy,
}

impl JobPolicyBuilder {
    /// The queue jobs of this type go to (default `default`).
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = queue.into();
        self
    }

    /// 0 runs first, `MAX_PRIORITY` last (default 0).
    pub fn priority(mut self, priority: i16) -> Self {
        self.policy.priority = priority;
        self
    }

    /// Attempts before the job is dead-lettered, counting the first (default 20).
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.policy.max_attempts = max_attempts;
        self
    }

    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.policy.backoff = backoff;
        self
    }

    /// How long one attempt may run before it is cancelled and counted as failed (default none).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.policy.timeout = Some(timeout);
        self
    }

    pub fn concurrency(mut self, concurrency: ConcurrencyPolicy) -> Self {
        self.policy.concurrency = Some(concurrency);
        self
    }

    pub fn unique(mut self, unique: UniquePolicy) -> Self {
        self.policy.unique = Some(unique);
        self
    }

    /// The policy, or the first field that does not validate.
    pub fn build(self) -> Result<JobPolicy, ValidationError> {
        let policy = JobPolicy { queue: QueueName::new(self.queue)?, ..self.policy };
        policy.validate()?;
        Ok(policy)
    }
}

pub(crate) fn validate_priority(priority: i16) -> Result<(), ValidationError> {
    if !(0..=MAX_PRIORITY).contains(&priority) {
        return Err(ValidationError::new("priority", priority, format!("an integer from 0 to {MAX_PRIORITY}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_until_capped() {
        let b = Backoff { base: Duration::from_secs(1), max: Duration::from_secs(10), jitter: 0.0 };
        assert_eq!(b.delay(1), Duration::from_secs(1));
        assert_eq!(b.delay(3), Duration::from_secs(4));
        assert_eq!(b.delay(40), Duration::from_secs(10));
    }

    #[test]
    fn backoff_jitter_stays_within_its_fraction() {
        let b = Backoff { base: Duration::from_secs(10), max: Duration::from_secs(10), jitter: 0.5 };
        for _ in 0..100 {
            let d = b.delay(1);
            assert!(d >= Duration::from_secs(5) && d <= Duration::from_secs(15), "{d:?}");
        }
    }

    #[test]
    fn invalid_policies_name_their_field() {
        let q = QueueName::new("default").unwrap();
        let mut p = JobPolicy::on_queue(q);
        p.max_attempts = 0;
        assert_eq!(p.validate().unwrap_err().field, "max_attempts");
        p.max_attempts = 1;
        p.priority = 10;
        assert_eq!(p.validate().unwrap_err().field, "priority");
        p.priority = 0;
        p.backoff.jitter = 2.0;
        assert_eq!(p.validate().unwrap_err().field, "backoff.jitter");
        p.backoff.jitter = 0.0;
        p.concurrency = Some(ConcurrencyPolicy::new(0));
        assert_eq!(p.validate().unwrap_err().field, "concurrency.limit");
        let mut c = ConcurrencyPolicy::new(1);
        c.key = vec!["account..id".into()];
        p.concurrency = Some(c);
        assert_eq!(p.validate().unwrap_err().field, "concurrency.key");
        p.concurrency = None;
        // Stored in milliseconds: under one is refused here, naming what was given.
        p.timeout = Some(Duration::from_micros(500));
        let err = p.validate().unwrap_err();
        assert_eq!((err.field, err.value.as_str()), ("timeout", "500µs"));
        p.timeout = Some(Duration::from_millis(1));
        p.validate().unwrap();
    }

    #[test]
    fn the_builder_validates_as_the_fields_do() {
        let built = JobPolicy::builder()
            .queue("mail")
            .priority(3)
            .max_attempts(5)
            .timeout(Duration::from_secs(60))
            .concurrency(ConcurrencyPolicy::new(2).key(["account.id"]).on_conflict(OnConflict::Raise))
            .unique(UniquePolicy::new(UniqueMode::UntilExecuted).key(["order"]))
            .build()
            .unwrap();
        let mut expected = JobPolicy::on_queue(QueueName::new("mail").unwrap());
        expected.priority = 3;
        expected.max_attempts = 5;
        expected.timeout = Some(Duration::from_secs(60));
        expected.concurrency = Some(ConcurrencyPolicy {
            limit: 2,
            key: vec!["account.id".into()],
            duration: DEFAULT_CONCURRENCY_DURATION,
            on_conflict: OnConflict::Raise,
        });
        expected.unique = Some(UniquePolicy {
            mode: UniqueMode::UntilExecuted,
            key: vec!["order".into()],
            on_conflict: UniqueOnConflict::Reject,
        });
        assert_eq!(built, expected);
        assert_eq!(JobPolicy::builder().build().unwrap().queue.as_str(), "default");
        let field = |b: JobPolicyBuilder| b.build().unwrap_err().field;
        assert_eq!(field(JobPolicy::builder().queue("Bad Name")), "queue");
        assert_eq!(field(JobPolicy::builder().max_attempts(0)), "max_attempts");
        assert_eq!(field(JobPolicy::builder().priority(10)), "priority");
        assert_eq!(field(JobPolicy::builder().timeout(Duration::ZERO)), "timeout");
        assert_eq!(field(JobPolicy::builder().concurrency(ConcurrencyPolicy::new(0))), "concurrency.limit");
        assert_eq!(
            field(JobPolicy::builder().unique(UniquePolicy::new(UniqueMode::UntilExecuted).key([""]))),
            "unique.key"
        );
    }
}
