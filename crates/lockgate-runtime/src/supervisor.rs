//! The supervisor: [`Runtime`] runs every service of one `lockgate run` process and owns their
//! lifecycle.
//!
//! Startup: check the schema, record the registry's job-type policies and this process's
//! heartbeat interval (which floors every lease), create the pools' queues, load the policy
//! cache, then start the notifier, the heartbeat, the maintenance sweeps (archive retention and
//! the concurrency sweep) and the worker pools.
//!
//! Shutdown, when the caller's token fires (TERM/INT), in this order:
//! 1. every pool stops claiming;
//! 2. running jobs get `shutdown_timeout` to finish;
//! 3. the rest are cancelled and returned to their queue, visible at once, and that statement
//!    lands before the pool's `run` returns (G7; seed 002: nothing may exit the process while
//!    it is in flight — the caller awaits `run`, and nothing here races it with a timer);
//! 4. the heartbeat stops (it kept the leases of finishing jobs alive until now);
//! 5. the notifier and the maintenance sweeps stop; `run` returns.

use std::sync::Arc;

use lockgate_sql::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::heartbeat::Heartbeat;
use crate::in_flight::InFlight;
use crate::maintenance::{ArchiveRetention, ConcurrencySweep};
use crate::notifier::Notifier;
use crate::policies::PolicyCache;
use crate::worker::WorkerPool;
use crate::{PoolConfig, Registry, RuntimeConfig, RuntimeError};

/// One process's worth of lockgate: worker pools, heartbeat, notifier and maintenance.
#[derive(Debug)]
pub struct Runtime {
    db: PgPool,
    config: RuntimeConfig,
    registry: Registry,
    pools: Vec<PoolConfig>,
}

impl Runtime {
    pub fn new(
        db: PgPool,
        config: RuntimeConfig,
        registry: Registry,
        pools: Vec<PoolConfig>,
    ) -> Result<Self, RuntimeError> {
        config.validate()?;
        for pool in &pools {
            pool.validate()?;
        }
        Ok(Self { db, config, registry, pools })
    }

    /// Runs until `shutdown` fires, then shuts down in the documented order.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), RuntimeError> {
        lockgate_sql::check_schema(&self.db).await?;
        for (name, policy) in self.registry.job_types() {
            lockgate_sql::define_job_type(&self.db, name, policy).await?;
        }
        lockgate_sql::record_heartbeat_interval(&self.db, self.config.heartbeat_interval).await?;
        for queue in self.pools.iter().flat_map(|p| &p.queues) {
            lockgate_sql::create_queue(&self.db, queue.as_str()).await?;
        }
        let policies = Arc::new(PolicyCache::load(&self.db).await?);

        let mut notifier = Notifier::new(self.db.clone());
        let mut sets = Vec::new();
        let mut pools = Vec::new();
        for pool in &self.pools {
            let wake = Arc::new(Notify::new());
            pool.queues.iter().for_each(|q| notifier.subscribe(q.as_str(), Arc::clone(&wake)));
            let in_flight = Arc::new(InFlight::default());
            sets.push(Arc::clone(&in_flight));
            let registry = self.registry.clone();
            let policies = Arc::clone(&policies);
            pools.push(WorkerPool::new(
                pool.clone(),
                self.config.clone(),
                self.db.clone(),
                registry,
                policies,
                in_flight,
                wake,
            ));
        }

        let services = CancellationToken::new();
        let tracker = TaskTracker::new();
        tracker.spawn(notifier.run(services.clone()));
        let retention =
            ArchiveRetention::new(self.db.clone(), self.config.archive_retention, self.config.maintenance_interval);
        tracker.spawn(retention.run(services.clone()));
        tracker.spawn(ConcurrencySweep::new(self.db.clone(), self.config.sweep_interval).run(services.clone()));
        let heartbeat =
            Heartbeat::new(self.db.clone(), sets, self.config.heartbeat_interval, self.config.visibility_timeout);
        let heartbeat_stop = CancellationToken::new();
        let heartbeat = tokio::spawn(heartbeat.run(heartbeat_stop.clone()));

        let workers = TaskTracker::new();
        for pool in pools {
            workers.spawn(pool.run(shutdown.clone()));
        }
        tracing::info!(pools = self.pools.len(), "lockgate running");
        workers.close();
        workers.wait().await;

        heartbeat_stop.cancel();
        let _ = heartbeat.await;
        services.cancel();
        tracker.close();
        tracker.wait().await;
        tracing::info!("lockgate stopped");
        Ok(())
    }
}
