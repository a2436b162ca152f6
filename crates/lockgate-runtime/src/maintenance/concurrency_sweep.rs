//! The concurrency sweep: every `sweep_interval`, expire leases whose silence budget ran out
//! (a dead holder's permit comes back, G5), repair leases whose message is gone, and promote
//! parked jobs of keys that can take a permit now (`lockgate.sweep`). Several processes may
//! sweep at once: every step is guarded by the keys' row locks.

use std::time::Duration;

use lockgate_sql::{DbError, PgPool, SweepReport};
use tokio_util::sync::CancellationToken;

/// Keys promoted per pass: enough to drain a backlog of dead holders quickly, bounded so one
/// pass stays a short transaction.
const MAX_KEYS_PER_PASS: i32 = 1000;

pub struct ConcurrencySweep {
    db: PgPool,
    interval: Duration,
}

impl ConcurrencySweep {
    pub fn new(db: PgPool, interval: Duration) -> Self {
        Self { db, interval }
    }

    pub async fn run(self, shutdown: CancellationToken) {
        crate::ticker::every(self.interval, &shutdown, || async {
            match self.run_once().await {
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
        lockgate_sql::sweep(&self.db, MAX_KEYS_PER_PASS, None).await
    }
}
