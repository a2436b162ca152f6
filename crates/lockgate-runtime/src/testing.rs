//! Testing handlers and producers without a worker: run a job inline with a [`JobContext`], and
//! list the jobs a transaction enqueued (before it commits, or instead of committing).
//!
//! ```
//! use lockgate_runtime::{testing, CancelReason, Job, JobContext, JobError};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Greet { name: String }
//! impl Job for Greet { const TYPE: &'static str = "greet"; }
//!
//! async fn greet(ctx: JobContext, job: Greet) -> Result<(), JobError> {
//!     if ctx.is_cancelled() {
//!         return Err(JobError::new("cancelled"));
//!     }
//!     println!("hello, {} (attempt {})", job.name, ctx.attempt);
//!     Ok(())
//! }
//!
//! # tokio_test_block_on(async {
//! let job = Greet { name: "world".into() };
//! assert!(testing::run(&greet, &job).await.is_ok());
//! let ctx = testing::context::<Greet>();
//! testing::cancel(&ctx, CancelReason::Shutdown);
//! assert!(testing::run_with(&greet, ctx, &job).await.is_err());
//! # });
//! # fn tokio_test_block_on(f: impl std::future::Future<Output = ()>) {
//! #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
//! # }
//! ```

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockgate_core::JobId;
use lockgate_sql::{DbError, JobFilter, JobRecord};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

use crate::{CancelReason, Handler, Job, JobContext, JobError};

/// The liveness of the attempts of test contexts: they never end.
static NEVER_ENDS: std::sync::LazyLock<Arc<()>> = std::sync::LazyLock::new(|| Arc::new(()));

/// The context a worker gives the first attempt of a job of type `J` (job id 0, `J::policy()`'s
/// queue and attempts). Its fields are public: set `attempt` to test a retry.
pub fn context<J: Job>() -> JobContext {
    let policy = J::policy();
    JobContext {
        // An attempt that never ends (one shared by every test context, never dropped): a hold
        // the handler under test takes holds, as it would in a worker, and is not warned about.
        run: Arc::downgrade(&NEVER_ENDS),
        held: Default::default(),
        job_id: JobId(0),
        job_type: J::TYPE.to_string(),
        queue: policy.queue.as_str().to_string(),
        msg_id: 0,
        read_ct: 1,
        attempt: 1,
        max_attempts: policy.max_attempts,
        cancel: CancellationToken::new(),
        reason: Arc::new(Mutex::new(None)),
        lease: Arc::new(tokio::sync::watch::channel(Instant::now() + Duration::from_secs(3600)).0),
    }
}

/// Fires `ctx`'s cancellation with `reason`, as the runtime does at a shutdown deadline, a lost
/// lease, a timeout or a cancel: `ctx.cancelled()` resolves and `ctx.cancel_reason()` says why.
pub fn cancel(ctx: &JobContext, reason: CancelReason) {
    ctx.fire(reason);
}

/// Runs `handler` on `job` with [`context::<J>()`](context), inline.
pub async fn run<J: Job, H: Handler<J>>(handler: &H, job: &J) -> Result<(), JobError> {
    run_with(handler, context::<J>(), job).await
}

/// Runs `handler` on `job` with `ctx`, inline. As in a worker, the handler gets the job decoded
/// from its JSON arguments, so a type that does not round-trip through serde fails here too.
pub async fn run_with<J: Job, H: Handler<J>>(handler: &H, ctx: JobContext, job: &J) -> Result<(), JobError> {
    let args = serde_json::to_value(job)?;
    let job: J = serde_json::from_value(args).map_err(|e| JobError::new(format!("arguments do not decode: {e}")))?;
    handler.handle(ctx, job).await
}

/// A job found by [`enqueued`]: its arguments decoded, and its row (id, state, queue, priority,
/// visibility, ...).
#[derive(Debug, Clone)]
pub struct Enqueued<J> {
    pub job: J,
    pub record: JobRecord,
}

/// Why [`enqueued`] could not list the jobs.
#[derive(Debug, thiserror::Error)]
pub enum EnqueuedError {
    #[error(transparent)]
    Database(#[from] DbError),
    #[error("the arguments of job {id} do not decode into {job_type}")]
    Decode {
        id: JobId,
        job_type: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// The jobs of type `J` that `conn` sees, in every state, oldest first (at most 1000): inside a
/// transaction, the ones it enqueued too. Pass `&mut *tx` for a `sqlx::Transaction`, assert,
/// and roll back.
pub async fn enqueued<J: Job>(conn: &mut PgConnection) -> Result<Vec<Enqueued<J>>, EnqueuedError> {
    let filter = JobFilter { job_type: Some(J::TYPE.to_string()), ..JobFilter::default() };
    let mut records = lockgate_sql::jobs(conn, &filter, 1000, None).await?;
    records.reverse();
    records
        .into_iter()
        .map(|record| {
            let args = record.args.clone().unwrap_or_default();
            match serde_json::from_value(args) {
                Ok(job) => Ok(Enqueued { job, record }),
                Err(source) => Err(EnqueuedError::Decode { id: record.id, job_type: J::TYPE, source }),
            }
        })
        .collect()
}
