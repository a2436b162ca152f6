//! The bookkeeping sweep: every `sweep_interval`, enqueue the callbacks of finished batches
//! that their finish did not enqueue (`lockgate.batch_sweep`); every `maintenance_interval`,
//! reap uniqueness locks whose job no longer exists (`lockgate.reap_unique_locks`: only locks
//! older than `REAP_AGE_FLOOR`, so it never judges a lock whose job is being moved) and count as
//! failed the members of batches idle that long whose job no longer exists
//! (`lockgate.reap_batches`), and delete the semaphore rows of keys idle that long, with no
//! permit held and nothing parked (`lockgate.reclaim_idle_keys`, up to `RECLAIM_BATCH` per
//! pass). Several processes may sweep at once: each step skips rows another transaction holds,
//! and each runs even when another failed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockgate_sql::pooler::Db;
use lockgate_sql::{DbError, PgPool};
use tokio_util::sync::CancellationToken;

use crate::config::RuntimeConfig;
use crate::held::{answer_within, on_pool};
use crate::metrics::Metrics;

/// A lock younger than this (or a batch with a change this recent) is never reaped: far longer
/// than any transaction that takes or moves a lock or a job, so the reapers never race one.
pub const REAP_AGE_FLOOR: Duration = Duration::from_secs(600);

/// Idle keys deleted per pass at most: a million keys enqueued once each are gone within a
/// hundred passes, each a bounded statement.
pub const RECLAIM_BATCH: i32 = 10_000;

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BookkeepingReport {
    /// Finished batches whose pending callbacks were enqueued.
    pub callbacks_enqueued: i32,
    /// Uniqueness locks deleted because their job no longer exists.
    pub locks_reaped: i32,
    /// Batch members counted as failed because their job no longer exists.
    pub batch_jobs_reaped: i32,
    /// Semaphore rows of idle keys deleted.
    pub keys_reclaimed: i32,
}

pub struct BookkeepingSweep {
    db: PgPool,
    interval: Duration,
    reap_interval: Duration,
    within: Duration,
    metrics: Option<Arc<Metrics>>,
}

impl BookkeepingSweep {
    pub fn new(db: PgPool, interval: Duration, reap_interval: Duration) -> Self {
        Self { db, interval, reap_interval, within: answer_within(&RuntimeConfig::default()), metrics: None }
    }

    /// Gives up a statement not answered within `within`, with its connection (default: the
    /// default configuration's bound, `held::answer_within`).
    pub fn answer_within(mut self, within: Duration) -> Self {
        self.within = within;
        self
    }

    /// Counts every pass of `run` and what it did in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub async fn run(self, shutdown: CancellationToken) {
        // The reapers' first pass, like the sweep's, at a random moment within their own interval.
        let mut next_reap = Instant::now() + crate::ticker::phase(self.reap_interval);
        let this = &self;
        crate::ticker::every(self.interval, crate::ticker::phase(self.interval), &shutdown, || {
            let now = Instant::now();
            let reap = now >= next_reap;
            if reap {
                // Every reap_interval from the first reap, not from when this pass woke (a
                // late wake-up would otherwise push every later reap back by one pass).
                next_reap += self.reap_interval;
                if next_reap <= now {
                    next_reap = now + self.reap_interval;
                }
            }
            async move {
                let result = this.run_once(reap).await;
                if let Some(metrics) = &this.metrics {
                    record(metrics, &result);
                }
                match result {
                    Ok(report) if report == BookkeepingReport::default() => {}
                    Ok(report) => tracing::info!(
                        callbacks_enqueued = report.callbacks_enqueued,
                        locks_reaped = report.locks_reaped,
                        batch_jobs_reaped = report.batch_jobs_reaped,
                        keys_reclaimed = report.keys_reclaimed,
                        "bookkeeping sweep"
                    ),
                    Err(error) => tracing::warn!(%error, "bookkeeping sweep failed"),
                }
            }
        })
        .await;
    }

    /// One pass; reaps uniqueness locks, lost batch members and idle keys too when `reap`. Each
    /// step runs whatever the others did; the first error is returned after all of them.
    pub async fn run_once(&self, reap: bool) -> Result<BookkeepingReport, DbError> {
        let (db, within) = (&self.db, self.within);
        let callbacks = on_pool(db, within, async |c| lockgate_sql::batch_sweep(Db::idle(c)).await).await;
        let (locks, members, keys) = if reap {
            (
                on_pool(db, within, async |c| lockgate_sql::reap_unique_locks(Db::idle(c), REAP_AGE_FLOOR).await).await,
                on_pool(db, within, async |c| lockgate_sql::reap_batches(Db::idle(c), REAP_AGE_FLOOR).await).await,
                on_pool(db, within, async |c| {
                    lockgate_sql::reclaim_idle_keys(Db::idle(c), REAP_AGE_FLOOR, RECLAIM_BATCH).await
                })
                .await,
            )
        } else {
            (Ok(0), Ok(0), Ok(0))
        };
        Ok(BookkeepingReport {
            callbacks_enqueued: callbacks?,
            locks_reaped: locks?,
            batch_jobs_reaped: members?,
            keys_reclaimed: keys?,
        })
    }
}

fn record(metrics: &Metrics, result: &Result<BookkeepingReport, DbError>) {
    match result {
        Ok(r) => metrics.sweep_ran(
            "bookkeeping",
            &[
                ("callbacks_enqueued", r.callbacks_enqueued as u64),
                ("locks_reaped", r.locks_reaped as u64),
                ("batch_jobs_reaped", r.batch_jobs_reaped as u64),
                ("keys_reclaimed", r.keys_reclaimed as u64),
            ],
        ),
        Err(_) => metrics.sweep_failed("bookkeeping"),
    }
}
