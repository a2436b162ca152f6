//! Archive retention: deletes archived jobs older than the retention period, in every queue,
//! in bounded batches.

use std::sync::Arc;
use std::time::Duration;

use lockgate_sql::pooler::Db;
use lockgate_sql::{DbError, PgPool};
use tokio_util::sync::CancellationToken;

use crate::config::RuntimeConfig;
use crate::held::{answer_within, on_pool};
use crate::metrics::Metrics;

/// Rows deleted per statement: bounded so that pruning a large backlog never holds long locks.
const PRUNE_BATCH: i32 = 10_000;

/// Deletes archived jobs older than the retention period, in every queue.
pub struct ArchiveRetention {
    db: PgPool,
    retention: Duration,
    interval: Duration,
    within: Duration,
    metrics: Option<Arc<Metrics>>,
}

impl ArchiveRetention {
    pub fn new(db: PgPool, retention: Duration, interval: Duration) -> Self {
        Self { db, retention, interval, within: answer_within(&RuntimeConfig::default()), metrics: None }
    }

    /// Gives up a statement not answered within `within`, with its connection (default: the
    /// default configuration's bound, `held::answer_within`).
    pub fn answer_within(mut self, within: Duration) -> Self {
        self.within = within;
        self
    }

    /// Counts every pass of `run` and the rows it deleted in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub async fn run(self, shutdown: CancellationToken) {
        crate::ticker::every(self.interval, crate::ticker::phase(self.interval), &shutdown, || async {
            let result = self.run_once().await;
            match (&self.metrics, &result) {
                (Some(m), Ok(deleted)) => m.sweep_ran("archive_retention", &[("deleted", *deleted as u64)]),
                (Some(m), Err(_)) => m.sweep_failed("archive_retention"),
                (None, _) => {}
            }
            match result {
                Ok(0) => {}
                Ok(deleted) => tracing::info!(deleted, "pruned archived jobs"),
                Err(error) => tracing::warn!(%error, "archive retention failed"),
            }
        })
        .await;
    }

    /// Prunes every queue's archive; returns how many rows it deleted.
    pub async fn run_once(&self) -> Result<i64, DbError> {
        let mut total = 0;
        let (db, within) = (&self.db, self.within);
        for queue in on_pool(db, within, async |c| lockgate_sql::list_queues(Db::idle(c)).await).await? {
            loop {
                let deleted = on_pool(db, within, async |c| {
                    lockgate_sql::prune_archive(Db::idle(c), &queue, self.retention, PRUNE_BATCH).await
                })
                .await?;
                total += deleted;
                if deleted < i64::from(PRUNE_BATCH) {
                    break;
                }
            }
        }
        Ok(total)
    }
}
