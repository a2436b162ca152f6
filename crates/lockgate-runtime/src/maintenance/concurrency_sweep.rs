//! The concurrency sweep: every `sweep_interval`, expire leases whose silence budget ran out
//! (a dead holder's permit comes back, G5), repair leases whose message is gone, and promote
//! parked jobs of keys that can take a permit now (`lockgate.sweep`). Several processes may
//! sweep at once: every step is guarded by the keys' row locks.

use std::sync::Arc;
use std::time::Duration;

use lockgate_sql::pooler::Db;
use lockgate_sql::{DbError, PgPool, SweepReport};
use tokio_util::sync::CancellationToken;

use crate::config::RuntimeConfig;
use crate::held::{answer_within, on_pool};
use crate::metrics::Metrics;

/// Keys promoted per pass: enough to drain a backlog of dead holders quickly, bounded so one
/// pass stays a short transaction.
const MAX_KEYS_PER_PASS: i32 = 1000;

pub struct ConcurrencySweep {
    db: PgPool,
    interval: Duration,
    within: Duration,
    metrics: Option<Arc<Metrics>>,
}

impl ConcurrencySweep {
    pub fn new(db: PgPool, interval: Duration) -> Self {
        Self { db, interval, within: answer_within(&RuntimeConfig::default()), metrics: None }
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
        crate::ticker::every(self.interval, crate::ticker::phase(self.interval), &shutdown, || async {
            let result = self.run_once().await;
            if let Some(metrics) = &self.metrics {
                record(metrics, &result);
            }
            match result {
                Ok(report) if report == SweepReport::default() => {}
                Ok(report) => tracing::info!(
                    expired = report.expired,
                    orphaned = report.orphaned,
                    promoted = report.promoted,
                    "concurrency sweep"
                ),
                Err(error) => tracing::warn!(%error, "concurrency sweep failed"),
            }
        })
        .await;
    }

    pub async fn run_once(&self) -> Result<SweepReport, DbError> {
        on_pool(&self.db, self.within, async |c| lockgate_sql::sweep(Db::idle(c), MAX_KEYS_PER_PASS, None).await).await
    }
}

fn record(metrics: &Metrics, result: &Result<SweepReport, DbError>) {
    match result {
        Ok(r) => metrics.sweep_ran(
            "concurrency",
            &[("expired", r.expired as u64), ("orphaned", r.orphaned as u64), ("promoted", r.promoted as u64)],
        ),
        Err(_) => metrics.sweep_failed("concurrency"),
    }
}
