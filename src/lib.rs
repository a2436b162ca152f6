//! # lockgate
//!
//! A job executor for PostgreSQL built on PGMQ. Producers enqueue jobs from Rust ([`Client`]),
//! from SQL (`SELECT lockgate.enqueue(...)`) or from the `lockgate` command; a [`Runtime`] claims
//! and runs them with fenced, exactly-once completion. See the README for the guarantees.
//!
//! A typed job, a producer and a worker (`examples/quick_start.rs`, run by the test suite):
//!
#![doc = concat!("```no_run\n", include_str!("../examples/quick_start.rs"), "\n```")]
//!
//! [`testing`] runs handlers inline and lists what a transaction enqueued.

pub use lockgate_core::{
    ArchiveOutcome, Backoff, BatchId, Claim, ConcurrencyPolicy, EnqueueOptions, EnqueueStatus, EnqueuedJob, JobHeaders,
    JobId, JobPolicy, JobPolicyBuilder, JobTypeName, OnConflict, QueueName, RecurringTask, Schedule, UniqueMode,
    UniqueOnConflict, UniquePolicy, ValidationError, DEFAULT_CONCURRENCY_DURATION, DEFAULT_TIMEZONE, MAX_DURATION,
    MAX_PAYLOAD_BYTES, MAX_PRIORITY,
};
pub use lockgate_runtime::{
    testing, CancelReason, Client, EnqueueError, Handler, Job, JobContext, JobError, Metrics, PoolConfig, RawHandler,
    Registry, RunHold, Runtime, RuntimeBuilder, RuntimeConfig, RuntimeError,
};
pub use lockgate_sql::{
    check_schema, migrate, BatchCallbacks, BatchInfo, Cancelled, CancelledCount, DbError, JobFilter, JobRecord,
    MigrateReport, PgPool, PgPoolOptions, RecurringRow, JOB_STATES, LATEST_MIGRATION, SCHEMA_COMPAT,
};

/// Running through a transaction-mode pooler such as PgBouncer's `pool_mode = transaction`: call
/// [`pooler::set_transaction_pooling`]`(true)` before the first statement (README, "Poolers").
pub mod pooler {
    pub use lockgate_sql::pooler::{set_transaction_pooling, transaction_pooling};
}

// The runtime's and the SQL layer's internals, for lockgate's own CLI, tests and benchmarks: not
// part of the API (hidden from the docs, no stability promise). Their public items are reached
// through the re-exports above.
#[doc(hidden)]
pub use lockgate_runtime::{config, health, heartbeat, maintenance, metrics, process_registry, scheduler, worker};

/// The SQL layer, for lockgate's own CLI, tests and tools: not part of the API.
#[doc(hidden)]
pub mod sql {
    pub use lockgate_sql::*;
}
