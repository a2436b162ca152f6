//! lockgate's SQL layer: the migrations that install PGMQ and lockgate's schema, and one typed
//! function per statement lockgate runs. It is the only crate that talks to sqlx; the runtime
//! and the CLI call these functions and never write SQL of their own.
//!
//! Every statement calls a function from the `sql/` folder of the repository (the API that
//! producers in any language share), with values bound as parameters.

mod backends;
mod batches;
mod columns;
mod concurrency;
mod deliveries;
mod dlq;
mod doctor;
mod enqueue;
mod error;
mod job_types;
mod jobs;
mod maintenance;
mod migrate;
pub mod pooler;
mod processes;
mod queues;
mod recurring;
mod status;

pub use backends::{backend_listed, backend_runs_statement, backend_start, end_marked_backend, signal_backend};
pub use batches::{batch_info, batch_sweep, close_batch, create_batch, unfinished_batches, BatchCallbacks, BatchInfo};
pub use concurrency::{
    check_invariants, discard_parked, give_back_finished, key_stats, parked_jobs, record_heartbeat_interval, sweep,
    KeyStats, ParkedJob, SweepReport, FINISHED_CHANNEL,
};
pub use deliveries::{
    claim, claim_as, claim_queues, complete, dead_letter, extend, release, retry, DeadLetterReason, Renewal,
};
pub use dlq::{dlq_last, dlq_list, dlq_page, dlq_purge, dlq_retry, DeadLetter, DlqFilter, DlqRetried, DlqRetryOutcome};
pub use doctor::{database_clock, doctor, doctor_sessions, DoctorCheck, DoctorThresholds, Verdict};
pub use enqueue::{enqueue, enqueue_and_wake, enqueue_many, enqueue_many_and_wake, wake};
pub use error::DbError;
pub use job_types::{
    define_job_type, define_job_type_if_missing, define_job_types, job_type_exists, load_job_types, remove_job_type,
};
pub use jobs::{
    cancel, cancel_jobs, cancelled_messages, discard_job, extend_cancelled, job, jobs, release_cancelled,
    return_unstarted, Cancelled, CancelledCount, JobFilter, JobRecord, JOB_STATES,
};
pub use maintenance::{prune_archive, reap_batches, reap_unique_locks, reclaim_idle_keys};
pub use migrate::{
    check_schema, functions_checksum, migrate, pending_migrations, MigrateReport, PgmqStep, SchemaFit,
    FUNCTIONS_REVISION, LATEST_MIGRATION, SCHEMA_COMPAT,
};
pub use processes::{
    deregister_process, heartbeat_processes, list_processes, prune_processes, register_process, ProcessRow,
};
pub use queues::{create_queue, drop_queue, list_queues, pause_queue, resume_queue};
pub use recurring::{
    database_now, define_recurring, enqueue_recurring_tick, list_recurring, remove_recurring, scheduled_recurring,
    set_recurring_enabled, sync_config_recurring, RecurringRow, RecurringSource, ScheduledTask, TickOutcome,
};
pub use status::{
    metrics_snapshot, queue_stats, queue_throughput, unique_lock_stats, KeyMetrics, MetricsSnapshot, ProcessCount,
    QueueMetrics, QueueStats, QueueThroughput, UniqueLockStats,
};

pub use sqlx::postgres::{PgPool, PgPoolOptions};
