//! The supervisor: [`Runtime`] runs every service of one `lockgate run` process and owns their
//! lifecycle.
//!
//! Startup: check the schema, record the registry's job-type policies, sync the configured
//! recurring tasks, record this process's heartbeat interval (which floors every lease), create
//! the pools' queues, load the policy cache, register in `lockgate.processes` (each step
//! retried while the database is restarting or drops the connection, H19), then start the
//! health and metrics endpoints, the metrics' gauge reader, the notifier, the heartbeat, the process registry, the maintenance sweeps,
//! the recurring-job scheduler and the worker pools. Each service
//! runs supervised: one that panics or stops on its own is logged and restarted with backoff,
//! and three crashes within a minute make the process not ready.
//!
//! Shutdown, when the caller's token fires (TERM/INT), in this order:
//! 1. the process reports draining, and every pool stops claiming (nothing is claimed without
//!    a free slot, so no claimed job waits unstarted);
//! 2. running jobs get `shutdown_timeout` to finish;
//! 3. the rest are cancelled, and each is returned to its queue, visible at once, keeping its
//!    permit, once its handler (and every process it started) has ended (H30); that statement
//!    lands before the pool's `run` returns (G7);
//! 4. the heartbeat stops (it kept the leases of finishing jobs alive until now);
//! 5. the registry stops, then the process deregisters;
//! 6. the notifier, sweeps, scheduler, gauge reader and health endpoints stop; `run` returns.
//!
//! Nothing here races that sequence with a timer (seed 002): the caller awaits `run` and exits
//! only after it returns. A second signal or QUIT is the binary's immediate exit.

use std::future::Future;
use std::sync::atomic::AtomicI64;
use std::sync::Arc;
use std::time::Duration;

use lockgate_core::{JobPolicy, JobTypeName, QueueName, RecurringTask, ValidationError};
use lockgate_sql::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::budgets::Budget;
use crate::health::{self, Health};
use crate::heartbeat::{GiveBack, Heartbeat};
use crate::held::answer_within;
use crate::in_flight::InFlight;
use crate::maintenance::{ArchiveRetention, BookkeepingSweep, ConcurrencySweep, FinishedPermits};
use crate::metrics::{Metrics, MetricsRefresh};
use crate::notifier::{Notifier, Wake};
use crate::policies::PolicyCache;
use crate::process_registry::{PoolReport, ProcessRegistry};
use crate::scheduler::Scheduler;
use crate::worker::WorkerPool;
use crate::{PoolConfig, Registry, RuntimeConfig, RuntimeError};

/// The first restart of a crashed service waits this long; doubled up to `MAX_RESTART_PAUSE`.
const FIRST_RESTART_PAUSE: Duration = Duration::from_millis(200);
const MAX_RESTART_PAUSE: Duration = Duration::from_secs(30);
/// A service that ran this long before crashing is not crash-looping: its backoff starts over.
const STABLE_RUN: Duration = Duration::from_secs(60);

/// One process's worth of lockgate: worker pools, heartbeat, notifier, registry, sweeps.
#[derive(Debug)]
pub struct Runtime {
    db: PgPool,
    config: RuntimeConfig,
    registry: Registry,
    pools: Vec<PoolConfig>,
    name: String,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    /// The recurring tasks this process's configuration owns, synced at start; `None` leaves
    /// every stored task as it is.
    recurring: Option<Vec<RecurringTask>>,
    /// A listener bound for `health_listen` before the runtime existed ([`Runtime::with_health_listener`]).
    health_listener: Option<std::net::TcpListener>,
}

impl Runtime {
    pub fn new(
        db: PgPool,
        config: RuntimeConfig,
        registry: Registry,
        pools: Vec<PoolConfig>,
    ) -> Result<Self, RuntimeError> {
        config.validate()?;
        for (i, pool) in pools.iter().enumerate() {
            pool.validate()?;
            // Logs, metrics and `lockgate status` tell pools apart by name (review helper-136
            // F3: two pools of one name were accepted in silence).
            if pools[..i].iter().any(|p| p.name == pool.name) {
                return Err(
                    ValidationError::new("pool name", &pool.name, "each pool a name of its own".to_string()).into()
                );
            }
        }
        Ok(Self {
            db,
            config,
            registry,
            pools,
            name: "lockgate".into(),
            health: Arc::default(),
            metrics: Arc::default(),
            recurring: None,
            health_listener: None,
        })
    }

    /// Serves the health endpoints on `listener` (bound for `health_listen` by a caller that
    /// served them while it waited for the database, [`health::serve_booting`]) instead of
    /// binding `health_listen` again.
    pub fn with_health_listener(mut self, listener: std::net::TcpListener) -> Self {
        self.health_listener = Some(listener);
        self
    }

    /// Declares the recurring tasks this process's configuration owns (the `[recurring]` tables
    /// of `lockgate.toml`): `run` stores them at start and removes the configuration-owned tasks
    /// that are not among them (tasks defined through SQL or the Client are left alone). A task
    /// whose `enabled` is `None` keeps the state an operator gave it.
    pub fn with_recurring(mut self, tasks: Vec<RecurringTask>) -> Result<Self, ValidationError> {
        for task in &tasks {
            task.validate()?;
        }
        self.recurring = Some(tasks);
        Ok(self)
    }

    /// Checks that every recurring task names a job type and a queue that exist, in this runtime
    /// (its registry's types and their queues, its pools' queues) or in the database. `run` makes
    /// this check before it stores anything, so a start refused for a task leaves the database
    /// as it was; `lockgate define` makes it too.
    pub async fn check_recurring(&self) -> Result<(), RuntimeError> {
        match self.recurring_problem().await? {
            Some(problem) => Err(problem),
            None => Ok(()),
        }
    }

    /// The first recurring task that names what does not exist, as the error to stop with.
    async fn recurring_problem(&self) -> Result<Option<RuntimeError>, lockgate_sql::DbError> {
        let Some(tasks) = &self.recurring else { return Ok(None) };
        let types = self.registry.job_types();
        let mut stored_queues: Option<Vec<String>> = None;
        for task in tasks {
            let problem = |problem: String| Ok(Some(RuntimeError::Recurring { task: task.name.clone(), problem }));
            let known = match JobTypeName::new(task.job_type.clone()) {
                Ok(name) => {
                    types.iter().any(|(t, _)| *t == name) || lockgate_sql::job_type_exists(&self.db, &name).await?
                }
                Err(invalid) => return problem(invalid.to_string()),
            };
            if !known {
                return problem(format!(
                    "unknown job type \"{}\": neither this configuration nor the database defines it",
                    task.job_type
                ));
            }
            let Some(queue) = &task.queue else { continue };
            if types.iter().any(|(_, p)| p.queue == *queue) || self.pools.iter().any(|p| p.queues.contains(queue)) {
                continue;
            }
            if stored_queues.is_none() {
                stored_queues = Some(lockgate_sql::list_queues(&self.db).await?);
            }
            if !stored_queues.iter().flatten().any(|q| q == queue.as_str()) {
                return problem(format!(
                    "queue \"{queue}\" does not exist: no pool or job type of this configuration has it, nor the database"
                ));
            }
        }
        Ok(None)
    }

    /// Names the process in `lockgate.processes` (default `lockgate`).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The health this runtime reports on `/readyz`; readable by embedders.
    pub fn health(&self) -> Arc<Health> {
        Arc::clone(&self.health)
    }

    /// The metrics this runtime serves on `/metrics`; give them to a [`Client`](crate::Client)
    /// (`Client::with_metrics`) to count its enqueues there too.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// Runs until `shutdown` fires, then shuts down in the documented order.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), RuntimeError> {
        let health_listener = match self.health_listener.take() {
            Some(listener) => Some(listener),
            None => health::bind(&self.config)?,
        };
        let services = CancellationToken::new();
        // However `run` ends, a start that failed included, the services stop with it.
        let _services_stop = services.clone().drop_guard();
        let tracker = TaskTracker::new();
        // Served while the start waits for the database too: `/livez` answers, `/readyz` says
        // booting (review helper-140 F11: nothing answered a probe until the start was done).
        if let Some(listener) = health_listener {
            let addr = listener.local_addr().ok();
            let listener =
                listener.set_nonblocking(true).and_then(|()| tokio::net::TcpListener::from_std(listener)).map_err(
                    |source| RuntimeError::HealthListen { addr: addr.unwrap_or(([0, 0, 0, 0], 0).into()), source },
                )?;
            let (health, metrics) = (Arc::clone(&self.health), Arc::clone(&self.metrics));
            tracker.spawn(health::serve(listener, health, metrics, services.clone()));
        }
        let db = &self.db;
        let up = &shutdown;
        start_up("check the schema", up, || lockgate_sql::check_schema(db)).await?;
        if let Some(problem) = start_up("check the recurring tasks", up, || self.recurring_problem()).await? {
            return Err(problem);
        }
        let job_types = self.registry.job_types();
        if !job_types.is_empty() {
            start_up("define the job types", up, || lockgate_sql::define_job_types(db, job_types)).await?;
        }
        // The pools' queues before the recurring tasks, which may enqueue into one of them.
        for queue in self.pools.iter().flat_map(|p| &p.queues) {
            start_up("create a queue", up, || lockgate_sql::create_queue(db, queue.as_str())).await?;
        }
        if let Some(tasks) = &self.recurring {
            let removed =
                start_up("sync the recurring tasks", up, || lockgate_sql::sync_config_recurring(db, tasks)).await?;
            if !removed.is_empty() {
                tracing::info!(removed = %removed.join(","), "removed recurring tasks the configuration no longer lists");
            }
        }
        let interval = self.config.heartbeat_interval;
        start_up("record the heartbeat interval", up, || lockgate_sql::record_heartbeat_interval(db, interval)).await?;
        let policies = Arc::new(start_up("load the job types", up, || PolicyCache::load(db)).await?);
        self.warn_of_unserved_types(&policies.all().await);
        // The runtime's own pool: sized for its loops (not for handlers, which bring their own),
        // and without sqlx's ping before every acquire — a round trip per statement that the
        // loops do not need, since every one of them retries a statement that failed.
        // Its statements have lock and statement budgets that fit inside the lease (H28); the
        // caller's pool, which handlers and producers use, keeps its own settings. The heartbeat
        // no longer draws from it (it has a connection of its own), so the pool is one smaller
        // and the process opens no more connections than before.
        let total_concurrency: usize = self.pools.iter().map(|p| p.concurrency).sum();
        let connections = 3 + self.pools.len() + total_concurrency / 4;
        let options = self.db.connect_options().as_ref().clone();
        let db = start_up("connect", up, || async {
            PgPoolOptions::new()
                .max_connections(u32::try_from(connections).unwrap_or(u32::MAX))
                .test_before_acquire(false)
                .connect_with(Budget::runtime(&self.config).apply(options.clone()))
                .await
                .map_err(lockgate_sql::DbError::from)
        })
        .await?;
        if lockgate_sql::pooler::transaction_pooling() {
            warn_of_role_budgets(&db, &self.config).await;
        }

        // Under transaction pooling LISTEN would subscribe one server connection that the pooler
        // then lends to others: it needs a direct URL, or the fetch loops poll.
        let listen = match &self.config.listen_database_url {
            Some(url) => {
                let options: PgConnectOptions = url.parse().map_err(lockgate_sql::DbError::from)?;
                // Idle between notifications by design: never ended for it by the server. A
                // SET once connected, not a startup option, which a session-mode pooler may refuse.
                Some(
                    PgPoolOptions::new()
                        .max_connections(1)
                        .after_connect(|conn, _| {
                            Box::pin(async move {
                                sqlx::query(
                                    "SELECT set_config('idle_session_timeout', '0', false)
                                      WHERE current_setting('server_version_num')::integer >= 140000",
                                )
                                .execute(conn)
                                .await
                                .map(drop)
                            })
                        })
                        .connect_lazy_with(options.application_name("lockgate")),
                )
            }
            None if lockgate_sql::pooler::transaction_pooling() => {
                tracing::info!(
                    poll_interval = ?self.config.poll_interval,
                    "transaction pooling without listen_database_url: no LISTEN, the fetch loops poll"
                );
                self.health.set_listen_off();
                None
            }
            None => Some(db.clone()),
        };
        let mut notifier = Notifier::new(
            listen.clone().unwrap_or_else(|| db.clone()),
            Arc::clone(&self.health),
            Arc::new(FinishedPermits::new(db.clone(), answer_within(&self.config))),
        );
        let mut sets = Vec::new();
        let mut reports = Vec::new();
        let mut pool_parts = Vec::new();
        for pool in &self.pools {
            let wake = Arc::new(Wake::default());
            pool.queues.iter().for_each(|q| notifier.subscribe(q.as_str(), Arc::clone(&wake)));
            let in_flight = Arc::new(InFlight::default());
            let last_tick = Arc::new(AtomicI64::new(0));
            sets.push(Arc::clone(&in_flight));
            reports.push(PoolReport {
                config: pool.clone(),
                in_flight: Arc::clone(&in_flight),
                last_tick: Arc::clone(&last_tick),
            });
            pool_parts.push((pool.clone(), in_flight, wake, last_tick));
        }
        let registry_db = start_up("connect", up, || async {
            PgPoolOptions::new()
                .max_connections(1)
                .connect_with(Budget::registry(&self.config).apply(options.clone()))
                .await
                .map_err(lockgate_sql::DbError::from)
        })
        .await?;
        let process_registry = Arc::new(ProcessRegistry::new(
            registry_db,
            self.name.clone(),
            reports,
            Arc::clone(&self.health),
            self.config.process_heartbeat_interval,
            self.config.alive_threshold,
            self.config.heartbeat_interval,
            Arc::clone(&self.metrics),
        ));
        let heartbeat_stop = CancellationToken::new();
        // Started before the registration, whose failure ends the start (the guard stops it
        // then). Once started, it stops when `run` stops it, or when the caller's runtime has shut
        // down (heartbeat.rs). A `run` dropped while that runtime lives leaves every service
        // running, the heartbeat included, as it always did: stop it with its token.
        let start_failed = heartbeat_stop.clone().drop_guard();
        // The heartbeat renews on a connection of its own, not one of the runtime pool's (H28),
        // and on a thread of its own: handlers that block every thread of the caller's runtime
        // (a synchronous call, CPU work without spawn_blocking) must not stop the renewals that
        // keep their jobs' messages and permits, or another worker runs the job beside them.
        let heartbeat_task = on_own_thread("lockgate-heartbeat", {
            let connect = Budget::heartbeat(&self.config).apply(options.clone());
            let (config, sets, owner) = (self.config.clone(), sets.clone(), Arc::clone(&process_registry.owner));
            let give_back = GiveBack { db: db.clone(), main: tokio::runtime::Handle::current() };
            let metrics = Arc::clone(&self.metrics);
            supervise("heartbeat", Arc::clone(&self.health), heartbeat_stop.clone(), move |token| {
                let beat = Heartbeat::new(
                    connect.clone(),
                    give_back.clone(),
                    sets.clone(),
                    config.heartbeat_interval,
                    config.visibility_timeout,
                    Arc::clone(&owner),
                    Arc::clone(&metrics),
                );
                beat.run(token)
            })
        })
        .await
        .map_err(RuntimeError::HeartbeatThread)?;

        start_up("register the process", up, || process_registry.register()).await?;
        start_failed.disarm();

        let notifier = Arc::new(notifier);
        let health = &self.health;
        if listen.is_some() {
            tracker.spawn(supervise("notifier", health.clone(), services.clone(), {
                let notifier = Arc::clone(&notifier);
                move |token| Arc::clone(&notifier).run(token)
            }));
        }
        tracker.spawn(supervise("archive_retention", health.clone(), services.clone(), {
            let (db, config) = (db.clone(), self.config.clone());
            let metrics = Arc::clone(&self.metrics);
            move |token| {
                ArchiveRetention::new(db.clone(), config.archive_retention, config.maintenance_interval)
                    .answer_within(answer_within(&config))
                    .with_metrics(Arc::clone(&metrics))
                    .run(token)
            }
        }));
        tracker.spawn(supervise("concurrency_sweep", health.clone(), services.clone(), {
            let (db, interval, metrics) = (db.clone(), self.config.sweep_interval, Arc::clone(&self.metrics));
            let within = answer_within(&self.config);
            move |token| {
                ConcurrencySweep::new(db.clone(), interval)
                    .answer_within(within)
                    .with_metrics(Arc::clone(&metrics))
                    .run(token)
            }
        }));
        tracker.spawn(supervise("bookkeeping_sweep", health.clone(), services.clone(), {
            let (db, interval, reap_interval) =
                (db.clone(), self.config.sweep_interval, self.config.maintenance_interval);
            let (metrics, within) = (Arc::clone(&self.metrics), answer_within(&self.config));
            move |token| {
                BookkeepingSweep::new(db.clone(), interval, reap_interval)
                    .answer_within(within)
                    .with_metrics(Arc::clone(&metrics))
                    .run(token)
            }
        }));
        tracker.spawn(supervise("metrics_refresh", health.clone(), services.clone(), {
            let (db, metrics) = (db.clone(), Arc::clone(&self.metrics));
            let (interval, max_keys) = (self.config.metrics_interval, self.config.metrics_max_keys);
            let within = answer_within(&self.config);
            move |token| MetricsRefresh::new(db.clone(), Arc::clone(&metrics), interval, max_keys, within).run(token)
        }));
        tracker.spawn(supervise("recurring_scheduler", health.clone(), services.clone(), {
            let (db, within) = (db.clone(), answer_within(&self.config));
            move |token| Scheduler::new(db.clone()).answer_within(within).run(token)
        }));
        let registry_stop = CancellationToken::new();
        let registry_task = tokio::spawn(supervise("process_registry", health.clone(), registry_stop.clone(), {
            let registry = Arc::clone(&process_registry);
            move |token| Arc::clone(&registry).run(token)
        }));
        let workers = TaskTracker::new();
        for (pool, in_flight, wake, last_tick) in pool_parts {
            let (db, config, registry, policies) =
                (db.clone(), self.config.clone(), self.registry.clone(), policies.clone());
            let (owner, metrics) = (Arc::clone(&process_registry.owner), Arc::clone(&self.metrics));
            workers.spawn(supervise("worker_pool", health.clone(), shutdown.clone(), move |token| {
                let pool = WorkerPool::new(
                    pool.clone(),
                    config.clone(),
                    db.clone(),
                    registry.clone(),
                    policies.clone(),
                    Arc::clone(&in_flight),
                    Arc::clone(&wake),
                    Arc::clone(&owner),
                    Arc::clone(&last_tick),
                    Arc::clone(&metrics),
                );
                pool.run(token)
            }));
        }
        self.health.set_running();
        process_registry.running();
        self.log_started();
        tokio::select! {
            () = shutdown.cancelled() => self.health.set_draining(),
            () = workers.wait() => {}
        }
        workers.close();
        workers.wait().await;

        heartbeat_stop.cancel();
        let _ = heartbeat_task.await;
        // The registry stops first, so no tick in flight can find the row gone and re-register.
        registry_stop.cancel();
        let _ = registry_task.await;
        if let Err(error) = process_registry.deregister().await {
            tracing::error!(%error, "could not deregister; the row will be pruned after the alive threshold");
        }
        services.cancel();
        tracker.close();
        tracker.wait().await;
        tracing::info!("lockgate stopped");
        Ok(())
    }
}

impl Runtime {
    /// Warnings at start for what runs but is likely not what was meant (review helper-81): a job
    /// type of this process whose queue none of its pools serves (its jobs wait for another
    /// process), and a job type stored on a queue this process serves that it has no handler for
    /// (the jobs of it this process claims fail their attempts, "no handler").
    fn warn_of_unserved_types(&self, stored: &[(String, JobPolicy)]) {
        let served: std::collections::HashSet<&str> =
            self.pools.iter().flat_map(|p| &p.queues).map(QueueName::as_str).collect();
        for (name, policy) in self.registry.job_types() {
            if !served.contains(policy.queue.as_str()) {
                tracing::warn!(
                    job_type = %name,
                    queue = %policy.queue,
                    "no pool of this process serves the queue of a job type it runs: its jobs wait for another process"
                );
            }
        }
        let handled: std::collections::HashSet<&str> =
            self.registry.job_types().iter().map(|(name, _)| name.as_str()).collect();
        let mut foreign: Vec<&(String, JobPolicy)> = stored
            .iter()
            .filter(|(name, policy)| served.contains(policy.queue.as_str()) && !handled.contains(name.as_str()))
            .collect();
        foreign.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, policy) in foreign {
            tracing::warn!(
                job_type = %name,
                queue = %policy.queue,
                "this process serves the queue of a job type it has no handler for: jobs of it that it claims fail \
                 their attempts (no handler); serve that queue only from processes that run the type, or remove a \
                 type no one runs any more (lockgate undefine)"
            );
        }
    }

    /// What this process runs, for the operator reading its start: the job types, then one line
    /// per pool with its queues (in claim order) and concurrency.
    fn log_started(&self) {
        let types: Vec<&str> = self.registry.job_types().iter().map(|(name, _)| name.as_str()).collect();
        tracing::info!(pools = self.pools.len(), job_types = %types.join(","), "lockgate running");
        for pool in &self.pools {
            let queues: Vec<&str> = pool.queues.iter().map(|q| q.as_str()).collect();
            tracing::info!(pool = %pool.name, queues = %queues.join(","), concurrency = pool.concurrency, "pool started");
        }
    }
}

/// Runs one start-up step, riding out a database that is restarting or that terminated the
/// connection (H19): a transient error is logged and retried with backoff until the step succeeds
/// or shutdown is asked for; any other error, and a read-only server, ends the start.
async fn start_up<T, F, Fut>(what: &str, shutdown: &CancellationToken, mut step: F) -> Result<T, RuntimeError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, lockgate_sql::DbError>>,
{
    let mut pause = Duration::from_millis(100);
    loop {
        let error = match step().await {
            Ok(value) => return Ok(value),
            // A read-only server at the start is a URL that reaches a standby far more often
            // than a failover under way: the start fails, with the error naming it, and the
            // process's own supervisor starts it again.
            Err(error) if error.is_transient() && !error.is_read_only() && !shutdown.is_cancelled() => error,
            Err(error) => return Err(error.into()),
        };
        tracing::warn!(%error, retry_in_ms = pause.as_millis() as u64, "could not {what} at start-up; retrying");
        tokio::select! {
            () = shutdown.cancelled() => return Err(error.into()),
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// Runs `service` on a new thread, in a single-threaded tokio runtime of its own (built there, so
/// that none is ever dropped on the caller's thread), with the caller's tracing subscriber if it
/// has one of its own (else the global one, looked up as the thread logs); the receiver resolves
/// once the service has returned (or the thread ended otherwise, its sender dropped).
async fn on_own_thread(
    name: &str,
    service: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
    let dispatch = tracing::dispatcher::get_default(Clone::clone);
    let scoped = !dispatch.is::<tracing::subscriber::NoSubscriber>();
    let (started, start) = tokio::sync::oneshot::channel();
    let (done, finished) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name(name.to_owned()).spawn(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(runtime) => runtime,
            Err(error) => {
                let _ = started.send(Err(error));
                return;
            }
        };
        let _ = started.send(Ok(()));
        if scoped {
            tracing::dispatcher::with_default(&dispatch, || runtime.block_on(service));
        } else {
            runtime.block_on(service);
        }
        let _ = done.send(());
    })?;
    start.await.map_err(|_| std::io::Error::other("the thread ended before its runtime was built"))??;
    Ok(finished)
}

/// Runs the service `make` builds until `token` fires; restarts it with backoff whenever it
/// panics or returns early, and records each crash in `health`. A restarted service makes its
/// first pass at once (`ticker::first_pass`).
async fn supervise<F, Fut>(name: &'static str, health: Arc<Health>, token: CancellationToken, mut make: F)
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut pause = FIRST_RESTART_PAUSE;
    let mut restarted = false;
    loop {
        let started = std::time::Instant::now();
        let outcome = tokio::spawn(crate::ticker::started(restarted, make(token.clone()))).await;
        restarted = true;
        // A service that ran well for a while before crashing starts its backoff over.
        if started.elapsed() > STABLE_RUN {
            pause = FIRST_RESTART_PAUSE;
        }
        if token.is_cancelled() {
            return;
        }
        match outcome {
            Err(e) if e.is_panic() => tracing::error!(service = name, "service panicked; restarting"),
            _ => tracing::error!(service = name, "service stopped unexpectedly; restarting"),
        }
        health.record_crash(name);
        tokio::select! {
            () = token.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(MAX_RESTART_PAUSE);
    }
}

/// Under transaction pooling the runtime's statement budgets (H28) are the role's settings: says
/// so at start when they are off or longer than the budgets the runtime would set itself (review
/// helper-136 F6: nothing said so but a README table).
async fn warn_of_role_budgets(db: &PgPool, config: &RuntimeConfig) {
    let budget = Budget::runtime(config);
    let (lock, statement) = (budget.lock.as_millis() as i64, budget.statement.as_millis() as i64);
    match lockgate_sql::pooler::session_budgets(db).await {
        Ok((role_lock, role_statement)) => {
            let loose = |set: i64, want: i64| set == 0 || set > want;
            if loose(role_lock, lock) || loose(role_statement, statement) {
                tracing::warn!(
                    lock_timeout_ms = role_lock,
                    statement_timeout_ms = role_statement,
                    "through a transaction-mode pooler lockgate cannot set its own statement budgets: its statements \
                     run under this role's lock_timeout and statement_timeout (0: off), so a producer's transaction \
                     held open on a key can hold a completion or renewal past its lease (H28); set them for the role \
                     lockgate runs as: ALTER ROLE ... SET lock_timeout = '{lock}ms'; ALTER ROLE ... SET \
                     statement_timeout = '{statement}ms' (a quarter of visibility_timeout, and the lock half of that)"
                );
            }
        }
        Err(error) => tracing::warn!(%error, "could not read this role's lock_timeout and statement_timeout"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn a_crashing_service_is_restarted_and_marks_the_process_crash_looping() {
        let health = Arc::new(Health::default());
        let token = CancellationToken::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let first_passes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let passes = Arc::clone(&first_passes);
        let task =
            tokio::spawn(supervise("flaky", Arc::clone(&health), token.clone(), move |stop: CancellationToken| {
                let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
                let passes = Arc::clone(&passes);
                async move {
                    passes.lock().unwrap().push(crate::ticker::first_pass(Duration::from_secs(5)));
                    if run <= 3 {
                        panic!("crash number {run}");
                    }
                    stop.cancelled().await;
                }
            }));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while runs.load(Ordering::SeqCst) < 4 {
            assert!(std::time::Instant::now() < deadline, "the service was not restarted a fourth time");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let reasons = health.readiness().unwrap_err();
        assert!(reasons.iter().any(|r| r == "flaky is crash-looping"), "{reasons:?}");
        token.cancel();
        task.await.unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 4, "a cancelled service is not restarted");
        let passes = first_passes.lock().unwrap().clone();
        assert_eq!(
            passes,
            [Duration::from_secs(5), Duration::ZERO, Duration::ZERO, Duration::ZERO],
            "restarts pass at once"
        );
    }
}
