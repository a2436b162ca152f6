//! Core types of lockgate: validated names, job-type policies, enqueue options, completion
//! outcomes and the errors callers match on. This crate does no I/O; the SQL layer
//! (`lockgate-sql`) and the runtime (`lockgate-runtime`) build on it.

mod error;
mod job;
mod names;
mod outcome;
mod policy;
mod recurring;

pub use error::ValidationError;
pub use job::{BatchId, Claim, EnqueueOptions, EnqueueStatus, EnqueuedJob, JobHeaders, JobId, MAX_PAYLOAD_BYTES};
pub use names::{JobTypeName, QueueName};
pub use outcome::ArchiveOutcome;
pub use policy::{
    validate_duration, Backoff, ConcurrencyPolicy, JobPolicy, JobPolicyBuilder, OnConflict, UniqueMode,
    UniqueOnConflict, UniquePolicy, DEFAULT_CONCURRENCY_DURATION, MAX_DURATION, MAX_PRIORITY,
};
pub use recurring::{RecurringTask, Schedule, DEFAULT_TIMEZONE};
