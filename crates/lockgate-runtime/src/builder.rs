//! [`RuntimeBuilder`]: a runtime in one expression — handlers, queues, settings, and the future
//! that shuts it down.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lockgate_core::{JobPolicy, JobTypeName, QueueName, RecurringTask, ValidationError};
use lockgate_sql::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::DEFAULT_CONCURRENCY;
use crate::{Handler, Job, PoolConfig, RawHandler, Registry, Runtime, RuntimeConfig, RuntimeError};

/// Builds and runs a [`Runtime`]:
///
/// ```no_run
/// # use lockgate_runtime::{Job, JobContext, JobError, Runtime};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct SendEmail { to: String }
/// # impl Job for SendEmail { const TYPE: &'static str = "send_email"; }
/// # async fn example(pool: sqlx::PgPool) -> Result<(), lockgate_runtime::RuntimeError> {
/// Runtime::builder(pool)
///     .register::<SendEmail>(|_ctx: JobContext, job: SendEmail| async move {
///         println!("to {}", job.to);
///         Ok::<(), JobError>(())
///     })
///     .queue("default", 10)
///     .run() // until ctrl-c or SIGTERM; `run_until(future)` for any other signal
///     .await
/// # }
/// ```
///
/// Without [`queue`](Self::queue) or [`pool`](Self::pool), it serves the queue of every
/// registered type's policy, each with a pool of `DEFAULT_CONCURRENCY` (10) slots. A mistake
/// (an invalid name, policy or setting) is reported by `build`, `run` or `run_until`.
#[derive(Debug)]
#[must_use = "a builder does nothing until it is built or run"]
pub struct RuntimeBuilder {
    db: PgPool,
    config: RuntimeConfig,
    registry: Registry,
    pools: Vec<PoolConfig>,
    name: Option<String>,
    recurring: Option<Vec<RecurringTask>>,
    /// The first mistake, reported when the runtime is built.
    error: Option<ValidationError>,
}

impl Runtime {
    /// A [`RuntimeBuilder`] on `db`, with [`RuntimeConfig::default`].
    pub fn builder(db: PgPool) -> RuntimeBuilder {
        RuntimeBuilder {
            db,
            config: RuntimeConfig::default(),
            registry: Registry::new(),
            pools: Vec::new(),
            name: None,
            recurring: None,
            error: None,
        }
    }
}

impl RuntimeBuilder {
    fn check<T>(&mut self, result: Result<T, ValidationError>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(err) => {
                self.error.get_or_insert(err);
                None
            }
        }
    }

    /// Runs jobs of type `J` with `handler`; `J::policy()` is stored at start (replacing the
    /// stored one, as `Client::define` does).
    pub fn register<J: Job>(mut self, handler: impl Handler<J>) -> Self {
        let result = self.registry.register::<J, _>(handler).map(|_| ());
        self.check(result);
        self
    }

    /// Runs jobs of type `name` (raw JSON arguments) with `handler`, storing `policy` at start.
    pub fn register_raw(mut self, name: &str, policy: JobPolicy, handler: Arc<dyn RawHandler>) -> Self {
        let result =
            JobTypeName::new(name).and_then(|name| self.registry.register_raw(name, policy, handler).map(|_| ()));
        self.check(result);
        self
    }

    /// Uses a registry built elsewhere, replacing the handlers registered so far.
    pub fn registry(mut self, registry: Registry) -> Self {
        self.registry = registry;
        self
    }

    /// A worker pool named after `queue`, serving it alone with `concurrency` slots.
    pub fn queue(mut self, queue: &str, concurrency: usize) -> Self {
        if let Some(name) = self.check(QueueName::new(queue)) {
            self.pools.push(PoolConfig::new(queue, vec![name], concurrency));
        }
        self
    }

    /// A worker pool serving several queues in strict priority order (see [`PoolConfig`]).
    pub fn pool(mut self, pool: PoolConfig) -> Self {
        self.pools.push(pool);
        self
    }

    /// Replaces every setting at once.
    pub fn config(mut self, config: RuntimeConfig) -> Self {
        self.config = config;
        self
    }

    /// Changes settings in place, e.g. `.configure(|c| c.poll_interval = Duration::from_millis(200))`.
    pub fn configure(mut self, change: impl FnOnce(&mut RuntimeConfig)) -> Self {
        change(&mut self.config);
        self
    }

    /// See [`RuntimeConfig::visibility_timeout`].
    pub fn visibility_timeout(self, value: Duration) -> Self {
        self.configure(|c| c.visibility_timeout = value)
    }

    /// See [`RuntimeConfig::heartbeat_interval`].
    pub fn heartbeat_interval(self, value: Duration) -> Self {
        self.configure(|c| c.heartbeat_interval = value)
    }

    /// How long running jobs get to finish after the shutdown fires before they are cancelled
    /// and returned to their queues.
    pub fn shutdown_timeout(self, value: Duration) -> Self {
        self.configure(|c| c.shutdown_timeout = value)
    }

    /// See [`RuntimeConfig::poll_interval`].
    pub fn poll_interval(self, value: Duration) -> Self {
        self.configure(|c| c.poll_interval = value)
    }

    /// See [`RuntimeConfig::archive_retention`].
    pub fn archive_retention(self, value: Duration) -> Self {
        self.configure(|c| c.archive_retention = value)
    }

    /// See [`RuntimeConfig::maintenance_interval`].
    pub fn maintenance_interval(self, value: Duration) -> Self {
        self.configure(|c| c.maintenance_interval = value)
    }

    /// See [`RuntimeConfig::sweep_interval`].
    pub fn sweep_interval(self, value: Duration) -> Self {
        self.configure(|c| c.sweep_interval = value)
    }

    /// See [`RuntimeConfig::process_heartbeat_interval`].
    pub fn process_heartbeat_interval(self, value: Duration) -> Self {
        self.configure(|c| c.process_heartbeat_interval = value)
    }

    /// See [`RuntimeConfig::alive_threshold`].
    pub fn alive_threshold(self, value: Duration) -> Self {
        self.configure(|c| c.alive_threshold = value)
    }

    /// Serves `/livez`, `/readyz` and `/metrics` on `addr`.
    pub fn health_listen(self, addr: SocketAddr) -> Self {
        self.configure(|c| c.health_listen = Some(addr))
    }

    /// See [`RuntimeConfig::max_shutdown_returns`].
    pub fn max_shutdown_returns(self, value: u32) -> Self {
        self.configure(|c| c.max_shutdown_returns = value)
    }

    /// See [`RuntimeConfig::metrics_interval`].
    pub fn metrics_interval(self, value: Duration) -> Self {
        self.configure(|c| c.metrics_interval = value)
    }

    /// See [`RuntimeConfig::metrics_max_keys`].
    pub fn metrics_max_keys(self, value: u32) -> Self {
        self.configure(|c| c.metrics_max_keys = value)
    }

    /// Names the process in `lockgate.processes` (default `lockgate`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The recurring tasks this process owns (see [`Runtime::with_recurring`]).
    pub fn recurring(mut self, tasks: Vec<RecurringTask>) -> Self {
        self.recurring = Some(tasks);
        self
    }

    /// The runtime, or the first mistake in what was given.
    pub fn build(self) -> Result<Runtime, RuntimeError> {
        if let Some(err) = self.error {
            return Err(err.into());
        }
        let mut pools = self.pools;
        if pools.is_empty() {
            for (_, policy) in self.registry.job_types() {
                if !pools.iter().any(|p| p.queues.contains(&policy.queue)) {
                    pools.push(PoolConfig::new(policy.queue.as_str(), vec![policy.queue.clone()], DEFAULT_CONCURRENCY));
                }
            }
        }
        let mut runtime = Runtime::new(self.db, self.config, self.registry, pools)?;
        if let Some(name) = self.name {
            runtime = runtime.with_name(name);
        }
        if let Some(tasks) = self.recurring {
            runtime = runtime.with_recurring(tasks)?;
        }
        Ok(runtime)
    }

    /// Runs until `shutdown` resolves, then shuts down gracefully (running jobs get
    /// `shutdown_timeout` to finish, the rest go back to their queues) and returns.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), RuntimeError> {
        self.build()?.run_until(shutdown).await
    }

    /// Runs until ctrl-c (SIGINT) or, on Unix, SIGTERM (what `docker stop` and Kubernetes send),
    /// then shuts down gracefully. A second ctrl-c or SIGTERM, a second or more after the first,
    /// exits the process at once with status 130, as `lockgate run` does: listening for the
    /// signals took their default action away for the life of the process, and a shutdown that
    /// waits for a handler could not be interrupted any more (review helper-145 F1). The jobs
    /// still running come back when their visibility lapses, as after a crash. Use `run_until`
    /// to decide otherwise.
    pub async fn run(self) -> Result<(), RuntimeError> {
        let runtime = self.build()?;
        let token = CancellationToken::new();
        let run = runtime.run(token.clone());
        tokio::pin!(run);
        tokio::select! {
            result = &mut run => return result,
            () = terminate() => token.cancel(),
        }
        let first = std::time::Instant::now();
        let again = async {
            // A second signal within a second of the first is the same request (GNU `timeout`
            // sends TERM twice at once).
            loop {
                terminate().await;
                if first.elapsed() >= std::time::Duration::from_secs(1) {
                    break;
                }
            }
        };
        tokio::select! {
            result = &mut run => result,
            () = again => {
                tracing::error!(
                    "a second signal during the graceful shutdown: exiting at once; the jobs still running come back \
                     when their visibility lapses"
                );
                std::process::exit(130)
            }
        }
    }
}

impl Runtime {
    /// Runs until `shutdown` resolves, then shuts down in the documented order.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), RuntimeError> {
        let token = CancellationToken::new();
        let run = self.run(token.clone());
        tokio::pin!(run);
        tokio::select! {
            result = &mut run => return result,
            () = shutdown => token.cancel(),
        }
        run.await
    }
}

/// Resolves at ctrl-c or SIGTERM. A signal that cannot be listened to is left out (the other
/// still works); if neither can, this never resolves rather than shutting down at once.
async fn terminate() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
