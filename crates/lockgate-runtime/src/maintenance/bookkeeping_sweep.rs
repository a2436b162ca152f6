//! The bookkeeping sweep: every `sweep_interval`, enqueue the callbacks of finished batches
//! whose finish could not enqueue them (`lockgate.batch_sweep`); every `maintenance_interval`,
//! reap uniqueness locks whose job no longer exists (`lockgate.reap_unique_locks`: only locks
//! older than `UNIQUE_LOCK_AGE_FLOOR`, so it never judges a lock whose job is being moved).
//! Several processes may sweep at once: both skip rows another transaction holds.

use std::time::{Duration, Instant};

use lockgate_sql::{DbError, PgPool};
use tokio_util::sync::CancellationToken;

/// A lock younger than this is never reaped: far longer than any transaction that takes or moves
/// a lock, so the reaper never races one.
pub const UNIQUE_LOCK_AGE_FLOOR: Duration = Duration::from_secs(600);

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BookkeepingReport {
    /// Finished batches whose pending callbacks were enqueued.
    pub callbacks_enqueued: i32,
    /// Uniqueness locks deleted because their job no longer exists.
    pub locks_reaped: i32,
}

pub struct BookkeepingSweep {
    db: PgPool,
    interval: Duration,
    reap_interval: Duration,
}

impl BookkeepingSweep {
    pub fn new(db: PgPool, interval: Duration, reap_interval: Duration) -> Self {
        Self { db, interval, reap_interval }
    }

    pub async fn run(self, shutdown: CancellationToken) {
        let mut last_reap: Option<Instant> = None;
        let this = &self;
        crate::ticker::every(self.interval, &shutdown, || {
            let reap = last_reap.is_none_or(|at| at.elapsed() >= self.reap_interval);
            if reap {
                last_reap = Some(Instant::now());
            }
            async move {
                match this.run_once(reap).await {
                    Ok(report) if report == BookkeepingReport::default() => {}
                    Ok(report) => tracing::info!(
                        callbacks_enqueued = report.callbacks_enqueued,
                        locks_reaped = report.locks_reaped,
                        "bookkeeping sweep"
                    ),
                    Err(error) => tracing::warn!(%error, "bookkeeping sweep failed"),
                }
            }
        })
        .await;
    }

    /// One pass; reaps uniqueness locks too when `reap`.
    pub async fn run_once(&self, reap: bool) -> Result<BookkeepingReport, DbError> {
        let callbacks_enqueued = lockgate_sql::batch_sweep(&self.db).await?;
        let locks_reaped =
            if reap { lockgate_sql::reap_unique_locks(&self.db, UNIQUE_LOCK_AGE_FLOOR).await? } else { 0 };
        Ok(BookkeepingReport { callbacks_enqueued, locks_reaped })
    }
}
