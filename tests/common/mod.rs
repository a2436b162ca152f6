//! Shared arrangements for the root test suites: a runtime running in the background against a
//! fresh database, with timings short enough for tests and long enough to stay deterministic.

#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockgate::{PoolConfig, QueueName, Registry, Runtime, RuntimeConfig};
use lockgate_testkit::TestDb;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Timings for tests: leases lapse in 2 s, heartbeats every 300 ms, polling every 200 ms.
pub fn test_config() -> RuntimeConfig {
    RuntimeConfig {
        visibility_timeout: Duration::from_secs(2),
        heartbeat_interval: Duration::from_millis(300),
        shutdown_timeout: Duration::from_secs(1),
        poll_interval: Duration::from_millis(200),
        ..RuntimeConfig::default()
    }
}

pub fn queue(name: &str) -> QueueName {
    QueueName::new(name).expect("valid queue name")
}

/// A runtime running in a background task until `stop`.
pub struct Running {
    pub shutdown: CancellationToken,
    pub task: JoinHandle<Result<(), lockgate::RuntimeError>>,
}

impl Running {
    pub async fn start(
        db: &TestDb,
        config: RuntimeConfig,
        registry: Registry,
        queues: &[&str],
        concurrency: usize,
    ) -> Self {
        let pool = db.new_pool(10).await.expect("pool");
        let pools = vec![PoolConfig::new("test", queues.iter().map(|q| queue(q)).collect(), concurrency)];
        let runtime = Runtime::new(pool, config, registry, pools).expect("valid runtime");
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(runtime.run(shutdown.clone()));
        Self { shutdown, task }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.expect("runtime task").expect("runtime ran cleanly");
    }
}

/// Counts handler starts.
#[derive(Clone, Default)]
pub struct Counter(Arc<AtomicUsize>);

impl Counter {
    pub fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

pub const WAIT: Duration = Duration::from_secs(15);
