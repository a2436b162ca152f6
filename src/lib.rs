//! # lockgate
//!
//! A job executor for PostgreSQL built on PGMQ. Producers enqueue jobs from Rust ([`Client`]),
//! from SQL (`SELECT lockgate.enqueue(...)`) or from the `lockgate` command; a [`Runtime`] claims
//! and runs them with fenced, exactly-once completion. See the README for the guarantees.
//!
//! ```no_run
//! use lockgate::{Client, EnqueueOptions, Job, JobContext, JobError, PoolConfig, QueueName, Registry, Runtime, RuntimeConfig};
//! use tokio_util::sync::CancellationToken;
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Greet { name: String }
//! impl Job for Greet { const TYPE: &'static str = "greet"; }
//!
//! # async fn example() -> anyhow::Result<()> {
//! let pool = lockgate::PgPool::connect("postgres://postgres@127.0.0.1/lockgate").await?;
//! lockgate::migrate(&pool).await?;
//! let mut registry = Registry::new();
//! registry.register::<Greet, _>(|_ctx: JobContext, job: Greet| async move {
//!     println!("hello, {}", job.name);
//!     Ok::<(), JobError>(())
//! })?;
//! let client = Client::new(pool.clone());
//! client.define::<Greet>().await?;
//! client.enqueue(&Greet { name: "world".into() }, &EnqueueOptions::default()).await?;
//! let pools = vec![PoolConfig::new("default", vec![QueueName::new("default")?], 10)];
//! let runtime = Runtime::new(pool, RuntimeConfig::default(), registry, pools)?;
//! let shutdown = CancellationToken::new();
//! runtime.run(shutdown).await?;
//! # Ok(()) }
//! ```

pub use lockgate_core::{
    ArchiveOutcome, Backoff, BatchId, Claim, ConcurrencyPolicy, EnqueueOptions, EnqueueStatus, EnqueuedJob, JobHeaders,
    JobId, JobPolicy, JobTypeName, OnConflict, QueueName, RecurringTask, Schedule, UniqueMode, UniqueOnConflict,
    UniquePolicy, ValidationError, DEFAULT_CONCURRENCY_DURATION, DEFAULT_TIMEZONE, MAX_PAYLOAD_BYTES, MAX_PRIORITY,
};
pub use lockgate_runtime::{
    config, health, heartbeat, maintenance, metrics, process_registry, scheduler, worker, CancelReason, Client,
    EnqueueError, Handler, Job, JobContext, JobError, Metrics, PoolConfig, RawHandler, Registry, Runtime,
    RuntimeConfig, RuntimeError,
};
pub use lockgate_sql::{
    check_schema, migrate, BatchCallbacks, BatchInfo, Cancelled, CancelledCount, DbError, JobFilter, JobRecord,
    MigrateReport, PgPool, PgPoolOptions, RecurringRow, JOB_STATES, LATEST_MIGRATION, SCHEMA_COMPAT,
};

/// The SQL layer, for tests and tools that need a statement the typed API does not expose.
pub mod sql {
    pub use lockgate_sql::*;
}
