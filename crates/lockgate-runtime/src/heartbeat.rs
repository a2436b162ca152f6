//! The heartbeat: one task per process that, every `heartbeat_interval`, extends the visibility
//! of every delivery the process holds — one fenced statement per queue per tick (G6). A
//! delivery the statement does not return has lost its lease: its handler's cancellation fires
//! and it can write nothing more.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockgate_sql::PgPool;
use tokio_util::sync::CancellationToken;

use crate::in_flight::InFlight;

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeartbeatReport {
    pub renewed: usize,
    pub lost: usize,
    pub failed_queues: usize,
}

pub struct Heartbeat {
    db: PgPool,
    sets: Vec<Arc<InFlight>>,
    interval: Duration,
    visibility: Duration,
}

impl Heartbeat {
    pub(crate) fn new(db: PgPool, sets: Vec<Arc<InFlight>>, interval: Duration, visibility: Duration) -> Self {
        Self { db, sets, interval, visibility }
    }

    pub async fn run(self, shutdown: CancellationToken) {
        crate::ticker::every(self.interval, &shutdown, || async {
            let report = self.run_once().await;
            if report.lost > 0 || report.failed_queues > 0 {
                tracing::warn!(
                    renewed = report.renewed,
                    lost = report.lost,
                    failed_queues = report.failed_queues,
                    "heartbeat"
                );
            }
        })
        .await;
    }

    pub async fn run_once(&self) -> HeartbeatReport {
        let mut report = HeartbeatReport::default();
        for set in &self.sets {
            let _gate = set.gate.write().await;
            for (queue, asked) in set.renewable() {
                // The lease end is measured from before the statement: the database's own
                // clock starts the new visibility no earlier than this.
                let until = Instant::now() + self.visibility;
                match lockgate_sql::extend(&self.db, &queue, &asked, self.visibility).await {
                    Ok(renewed) => {
                        report.renewed += renewed.len();
                        report.lost += set.renewed(&queue, &asked, &renewed, until);
                    }
                    Err(error) => {
                        tracing::warn!(%queue, %error, "heartbeat failed");
                        report.failed_queues += 1;
                    }
                }
            }
        }
        report
    }
}
