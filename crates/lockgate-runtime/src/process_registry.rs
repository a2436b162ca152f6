//! The process registry service: registers this process (a supervisor row, one row per worker
//! pool, one for the dispatcher) in `lockgate.processes`, renews the rows on its own timer and
//! its own connection, prunes processes silent past the alive threshold, and deregisters on
//! shutdown.
//!
//! A process that finds its own row gone was pruned as dead while it was alive (seed 000, H26):
//! its registry heartbeat stalled while its job heartbeats may well have kept renewing. It
//! never carries on unregistered: it registers again under a new id before its next claim is
//! tagged. It does not give up the deliveries it holds: a prune returns only the deliveries that
//! were not renewed within the alive threshold, so the healthy ones are still owned by their
//! delivery tokens and keep running; the job heartbeat re-tags them with the new id at its next
//! tick, and finds out which ones, if any, were lost (their handlers are cancelled then).
//!
//! Each statement not answered within twice the registry's budget is given up with its
//! connection (`held::on_pool`): a beat awaited for good left the process ready while its row
//! went silent, and a deregistration awaited for good held its shutdown (design §119).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockgate_sql::pooler::Db;
use lockgate_sql::{DbError, PgPool};
use serde_json::{json, Value};
use sqlx::Connection;
use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::held::on_pool;
use crate::in_flight::InFlight;
use crate::metrics::Metrics;
use crate::PoolConfig;

/// One worker pool as the registry reports it.
pub(crate) struct PoolReport {
    pub config: PoolConfig,
    pub in_flight: Arc<InFlight>,
    /// Unix milliseconds of the fetch loop's last iteration (written by the fetch loop).
    pub last_tick: Arc<AtomicI64>,
}

/// What one registry tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegistryReport {
    /// This process found its own row gone and registered again.
    pub reregistered: bool,
    /// Other processes pruned, and how many of their jobs were still in flight (left alone: they
    /// come back when their visibility lapses, H26).
    pub pruned: usize,
    pub in_flight: i64,
}

pub(crate) struct ProcessRegistry {
    /// A pool of one connection: heartbeats never queue behind job traffic.
    db: PgPool,
    name: String,
    host: String,
    pid: i32,
    pools: Vec<PoolReport>,
    health: Arc<Health>,
    /// The supervisor row's id: the owner tag of every claim (read by the fetch loops).
    pub owner: Arc<AtomicI64>,
    /// Ids of the service rows, in the order of `pools`, then the dispatcher.
    rows: tokio::sync::Mutex<Vec<i64>>,
    interval: Duration,
    /// How long one statement may go unanswered.
    within: Duration,
    alive_threshold: Duration,
    /// The job heartbeat's interval, recorded again at every beat (it floors every lease).
    lease_heartbeat: Duration,
    metrics: Arc<Metrics>,
    /// Fired once the process runs: its first beat then records that, not the booting phase.
    running: tokio::sync::Notify,
}

impl ProcessRegistry {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        db: PgPool,
        name: String,
        pools: Vec<PoolReport>,
        health: Arc<Health>,
        interval: Duration,
        alive_threshold: Duration,
        lease_heartbeat: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            db,
            name,
            host: hostname(),
            pid: i32::try_from(std::process::id()).unwrap_or(i32::MAX),
            pools,
            health,
            owner: Arc::new(AtomicI64::new(0)),
            rows: Default::default(),
            interval,
            within: interval * 2,
            alive_threshold,
            lease_heartbeat,
            metrics,
            running: tokio::sync::Notify::new(),
        }
    }

    /// The process runs: its next beat comes now rather than one interval after registering.
    pub fn running(&self) {
        self.running.notify_one();
    }

    /// Inserts this process's rows; the supervisor's id becomes the owner tag of claims.
    pub async fn register(&self) -> Result<i64, DbError> {
        let meta = self.supervisor_metadata();
        // One transaction: a prune (or an operator's DELETE) between the supervisor's row and its
        // children's would otherwise fail the children on their foreign key, and with it the
        // process's start. Now it sees all the rows or none; if it deletes them, the next
        // heartbeat finds them gone and registers again.
        let (id, rows) = on_pool(&self.db, self.within, async |c| {
            let mut tx = c.begin().await?;
            let (host, pid) = (&self.host, self.pid);
            let id = lockgate_sql::register_process(&mut *tx, "supervisor", &self.name, host, pid, None, &meta).await?;
            let mut rows = Vec::new();
            for pool in &self.pools {
                let meta = self.pool_metadata(pool);
                rows.push(
                    lockgate_sql::register_process(&mut *tx, "worker", &pool.config.name, host, pid, Some(id), &meta)
                        .await?,
                );
            }
            rows.push(
                lockgate_sql::register_process(&mut *tx, "dispatcher", "dispatcher", host, pid, Some(id), &json!({}))
                    .await?,
            );
            tx.commit().await?;
            Ok((id, rows))
        })
        .await?;
        *self.rows.lock().await = rows;
        self.owner.store(id, Ordering::SeqCst);
        self.health.set_registered(true);
        tracing::info!(process_id = id, host = %self.host, pid = self.pid, "registered");
        Ok(id)
    }

    /// The build (its functions revision, which `lockgate doctor` compares with the database's to
    /// name processes a rolling deploy left behind, `process_builds`) and the health.
    fn supervisor_metadata(&self) -> Value {
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "functions_revision": lockgate_sql::FUNCTIONS_REVISION,
            "health": self.health.summary(),
        })
    }

    fn pool_metadata(&self, pool: &PoolReport) -> Value {
        json!({
            "queues": pool.config.queues.iter().map(|q| q.as_str()).collect::<Vec<_>>(),
            "concurrency": pool.config.concurrency,
            "in_flight": pool.in_flight.len(),
            "last_tick_ms": pool.last_tick.load(Ordering::Relaxed),
        })
    }

    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        // The registration recorded a beat while the process was booting; the next comes once it
        // runs (so its row says so), or one interval after registering if that is sooner, or at
        // once when this service was restarted after a crash.
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return,
            () = self.running.notified() => {}
            () = tokio::time::sleep(crate::ticker::first_pass(self.interval)) => {}
        }
        crate::ticker::every(self.interval, Duration::ZERO, &shutdown, || async {
            match self.run_once().await {
                Ok(report) if report == RegistryReport::default() => {
                    self.metrics.prune_runs.inc();
                }
                Ok(report) => {
                    self.metrics.prune_runs.inc();
                    self.metrics.processes_pruned.inc_by(report.pruned as u64);
                    tracing::info!(
                        reregistered = report.reregistered,
                        pruned = report.pruned,
                        in_flight = report.in_flight,
                        "process registry"
                    );
                }
                Err(error) => tracing::warn!(%error, "process heartbeat failed"),
            }
        })
        .await;
    }

    pub async fn run_once(&self) -> Result<RegistryReport, DbError> {
        let mut report = RegistryReport::default();
        let owner = self.owner.load(Ordering::SeqCst);
        let mut beats = vec![(owner, self.supervisor_metadata())];
        let rows = self.rows.lock().await.clone();
        for (pool, id) in self.pools.iter().zip(&rows) {
            beats.push((*id, self.pool_metadata(pool)));
        }
        if let Some(dispatcher) = rows.last() {
            beats.push((*dispatcher, json!({})));
        }
        // Readiness follows this process's own beat (and its registering again), not the
        // housekeeping after it: a prune of other processes that fails (a queue table locked)
        // must not take every live process out of readiness (review helper-91).
        let beat = self.beat(owner, &beats).await;
        self.health.set_beat_failure(beat.as_ref().err());
        report.reregistered = beat?;
        // The start recorded it, and nothing in lockgate lowers it; recorded again here, an
        // operator's change to lockgate.settings (or a restore of an old copy of it) leaves
        // leases floored below this process's heartbeat for one beat at most. A read when the
        // recorded interval is at least as long.
        let (db, within) = (&self.db, self.within);
        on_pool(db, within, async |c| lockgate_sql::record_heartbeat_interval(Db::idle(c), self.lease_heartbeat).await)
            .await?;
        let threshold = self.alive_threshold.as_secs_f64();
        for (id, in_flight) in
            on_pool(db, within, async |c| lockgate_sql::prune_processes(Db::idle(c), threshold).await).await?
        {
            tracing::warn!(process_id = id, in_flight, "pruned a process silent past the alive threshold");
            report.pruned += 1;
            report.in_flight += in_flight;
        }
        Ok(report)
    }

    /// This process's heartbeat, and its registering again if it was pruned meanwhile (then true).
    async fn beat(&self, owner: i64, beats: &[(i64, Value)]) -> Result<bool, DbError> {
        let alive =
            on_pool(&self.db, self.within, async |c| lockgate_sql::heartbeat_processes(Db::idle(c), beats).await)
                .await?;
        if alive.contains(&owner) {
            return Ok(false);
        }
        self.on_pruned(owner).await?;
        Ok(true)
    }

    async fn on_pruned(&self, old_id: i64) -> Result<(), DbError> {
        self.health.set_registered(false);
        let held: usize = self.pools.iter().map(|p| p.in_flight.len()).sum();
        tracing::error!(
            process_id = old_id,
            held,
            "this process was pruned as dead while alive; registering again (its renewed deliveries stay its own)"
        );
        self.register().await.map(|_| ())
    }

    /// Deletes this process's rows (shutdown's last database step). A transient failure (a lock
    /// held past the statement's budget, a dropped connection, a restarting server) is tried
    /// again for up to one registry interval: once was all it had, and a row locked for a moment
    /// by another session left the process listed until it was pruned (review helper-99). No
    /// longer: the shutdown it ends should fit in a container's grace period.
    pub async fn deregister(&self) -> Result<(), DbError> {
        self.health.set_registered(false);
        let give_up = tokio::time::Instant::now() + self.interval;
        let mut pause = Duration::from_millis(50);
        loop {
            let owner = self.owner.load(Ordering::SeqCst);
            match on_pool(&self.db, self.within, async |c| lockgate_sql::deregister_process(Db::idle(c), owner).await)
                .await
            {
                Err(error) if error.is_transient() && tokio::time::Instant::now() + pause < give_up => {
                    tracing::debug!(%error, "could not deregister; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                done => return done,
            }
        }
    }
}

/// The host name, for operators reading `lockgate status`.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}
