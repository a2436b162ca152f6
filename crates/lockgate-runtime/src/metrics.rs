//! Metrics: the families `/metrics` serves (Prometheus text, encoded by prometheus-client;
//! nothing here formats text by hand), who writes each, and the service that reads the gauges
//! from the database.
//!
//! Two kinds of values, two sources:
//! - counters and histograms of what *this process* did (jobs it finished, renewals it made,
//!   sweeps it ran), written where it happens. On the job path each is an atomic add on a handle
//!   looked up once per (queue, job type) and cached ([`JobMetrics`]): no label set is built per
//!   job.
//! - gauges of the whole database (per queue, per concurrency key, per process kind), written
//!   only by [`MetricsRefresh`] from one statement (`lockgate.metrics_snapshot`) every
//!   `metrics_interval`. A scrape only encodes: scraping more often, or from more scrapers,
//!   costs the database nothing.
//!
//! One [`Metrics`] per [`Runtime`](crate::Runtime), shared like its health; a [`Client`](crate::Client)
//! counts its enqueues into it once given it (`Client::with_metrics`).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use lockgate_sql::pooler::Db;
use lockgate_sql::{DbError, MetricsSnapshot, PgPool};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use tokio_util::sync::CancellationToken;

use crate::held::on_pool;

/// The content type of [`Metrics::encode`]'s text (OpenMetrics, which Prometheus scrapes).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabels {
    queue: String,
    job_type: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TypeLabels {
    job_type: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueStateLabels {
    queue: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KeyLabels {
    key: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SweepLabels {
    sweep: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SweepActionLabels {
    sweep: &'static str,
    action: &'static str,
}

type Histograms = Family<TypeLabels, Histogram, fn() -> Histogram>;

/// 5 ms to two minutes in twelve buckets (×2.5): a handler's run or a job's wait in the queue
/// spans milliseconds to minutes, and twelve buckets keep a type's series few.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.5, 12))
}

/// The queue states `lockgate_queue_jobs` reports, as its `state` label.
const QUEUE_STATES: [&str; 5] = ["ready", "scheduled", "running", "parked", "dead"];

/// The handles of one (queue, job type): what the job path increments. Cloned out of the
/// families once, so an increment is an atomic add and nothing else.
#[derive(Debug)]
pub(crate) struct JobMetrics {
    /// The job type these handles count, for the completer's log lines (stored once here
    /// instead of copied into every completion).
    pub job_type: String,
    pub enqueued: Counter,
    pub succeeded: Counter,
    pub retried: Counter,
    pub dead_lettered: Counter,
    pub cancelled: Counter,
    pub discarded: Counter,
    /// Per job type (the queue is not a label of the histograms).
    pub duration: Histogram,
    pub start_latency: Histogram,
}

/// Every metric family of one process, and the registry that encodes them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    enqueued: Family<JobLabels, Counter>,
    succeeded: Family<JobLabels, Counter>,
    retried: Family<JobLabels, Counter>,
    dead_lettered: Family<JobLabels, Counter>,
    cancelled: Family<JobLabels, Counter>,
    discarded: Family<JobLabels, Counter>,
    duration: Histograms,
    start_latency: Histograms,
    pub(crate) renewals: Counter,
    pub(crate) leases_lost: Counter,
    pub(crate) renewal_failures: Counter,
    sweep_runs: Family<SweepLabels, Counter>,
    sweep_errors: Family<SweepLabels, Counter>,
    sweep_actions: Family<SweepActionLabels, Counter>,
    pub(crate) prune_runs: Counter,
    pub(crate) processes_pruned: Counter,
    queue_jobs: Family<QueueStateLabels, Gauge>,
    oldest_ready: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    queue_paused: Family<QueueLabels, Gauge>,
    key_held: Family<KeyLabels, Gauge>,
    key_parked: Family<KeyLabels, Gauge>,
    processes: Family<KindLabels, Gauge>,
    refresh_errors: Counter,
    /// Job handles by queue, then job type (two lookups by `&str`, no key built per job).
    jobs: RwLock<HashMap<String, HashMap<String, Arc<JobMetrics>>>>,
    /// The snapshot the gauges show; written only by [`MetricsRefresh`], to drop the series of
    /// queues, keys and kinds that are gone.
    shown: Mutex<MetricsSnapshot>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut metrics = Self {
            registry: Registry::with_prefix("lockgate"),
            enqueued: Family::default(),
            succeeded: Family::default(),
            retried: Family::default(),
            dead_lettered: Family::default(),
            cancelled: Family::default(),
            discarded: Family::default(),
            duration: Family::new_with_constructor(seconds_histogram as fn() -> Histogram),
            start_latency: Family::new_with_constructor(seconds_histogram as fn() -> Histogram),
            renewals: Counter::default(),
            leases_lost: Counter::default(),
            renewal_failures: Counter::default(),
            sweep_runs: Family::default(),
            sweep_errors: Family::default(),
            sweep_actions: Family::default(),
            prune_runs: Counter::default(),
            processes_pruned: Counter::default(),
            queue_jobs: Family::default(),
            oldest_ready: Family::default(),
            queue_paused: Family::default(),
            key_held: Family::default(),
            key_parked: Family::default(),
            processes: Family::default(),
            refresh_errors: Counter::default(),
            jobs: RwLock::default(),
            shown: Mutex::default(),
        };
        metrics.register();
        metrics
    }

    /// Names every family (prometheus-client adds the `_total` of counters and the unit).
    fn register(&mut self) {
        let r = &mut self.registry;
        r.register("jobs_enqueued", "Jobs enqueued by this process's Client", self.enqueued.clone());
        r.register("jobs_succeeded", "Jobs this process ran and archived", self.succeeded.clone());
        r.register("jobs_retried", "Failed attempts this process scheduled for a retry", self.retried.clone());
        r.register("jobs_dead_lettered", "Jobs this process moved to the dead letters", self.dead_lettered.clone());
        r.register("jobs_cancelled", "Running jobs of this process stopped by a cancel", self.cancelled.clone());
        r.register("jobs_discarded", "Duplicates this process archived without running", self.discarded.clone());
        r.register_with_unit("job_duration", "Handler run time", Unit::Seconds, self.duration.clone());
        r.register_with_unit(
            "job_start_latency",
            "From enqueue to the handler's start, on a message's first delivery",
            Unit::Seconds,
            self.start_latency.clone(),
        );
        r.register("heartbeat_renewals", "Deliveries whose lease the heartbeat renewed", self.renewals.clone());
        r.register("leases_lost", "Deliveries the heartbeat found no longer owned", self.leases_lost.clone());
        r.register("heartbeat_failures", "Renewal statements that failed", self.renewal_failures.clone());
        r.register("sweep_runs", "Maintenance sweep passes", self.sweep_runs.clone());
        r.register("sweep_errors", "Maintenance sweep passes that failed", self.sweep_errors.clone());
        r.register("sweep_actions", "What the sweeps did, by action", self.sweep_actions.clone());
        r.register(
            "process_prune_runs",
            "Process registry ticks that ran (each prunes processes silent past the alive threshold)",
            self.prune_runs.clone(),
        );
        r.register(
            "processes_pruned",
            "Processes pruned as silent past the alive threshold",
            self.processes_pruned.clone(),
        );
        r.register("queue_jobs", "Jobs per queue and state (read every metrics_interval)", self.queue_jobs.clone());
        r.register_with_unit(
            "queue_oldest_ready_age",
            "How long the oldest ready job has waited since it became ready",
            Unit::Seconds,
            self.oldest_ready.clone(),
        );
        r.register("queue_paused", "1 while claims skip the queue", self.queue_paused.clone());
        r.register(
            "key_permits_held",
            "Permits held per concurrency key (busiest keys, then other)",
            self.key_held.clone(),
        );
        r.register(
            "key_parked_jobs",
            "Parked jobs per concurrency key (busiest keys, then other)",
            self.key_parked.clone(),
        );
        r.register("processes", "Registered processes per kind", self.processes.clone());
        r.register(
            "metrics_refresh_errors",
            "Failed reads of the gauges from the database",
            self.refresh_errors.clone(),
        );
    }

    /// The registry in Prometheus's text format (what `/metrics` answers).
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail; an encoder error would be a bug in a label.
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::warn!(%error, "could not encode the metrics");
        }
        text
    }

    /// The handles of one (queue, job type), created on first use.
    pub(crate) fn job(&self, queue: &str, job_type: &str) -> Arc<JobMetrics> {
        let jobs = self.jobs.read().unwrap_or_else(|e| e.into_inner());
        if let Some(handles) = jobs.get(queue).and_then(|types| types.get(job_type)) {
            return Arc::clone(handles);
        }
        drop(jobs);
        let mut jobs = self.jobs.write().unwrap_or_else(|e| e.into_inner());
        let types = jobs.entry(queue.to_string()).or_default();
        let handles = types.entry(job_type.to_string()).or_insert_with(|| Arc::new(self.new_job(queue, job_type)));
        Arc::clone(handles)
    }

    fn new_job(&self, queue: &str, job_type: &str) -> JobMetrics {
        let labels = JobLabels { queue: queue.to_string(), job_type: job_type.to_string() };
        let by_type = TypeLabels { job_type: job_type.to_string() };
        JobMetrics {
            job_type: job_type.to_string(),
            enqueued: self.enqueued.get_or_create_owned(&labels),
            succeeded: self.succeeded.get_or_create_owned(&labels),
            retried: self.retried.get_or_create_owned(&labels),
            dead_lettered: self.dead_lettered.get_or_create_owned(&labels),
            cancelled: self.cancelled.get_or_create_owned(&labels),
            discarded: self.discarded.get_or_create_owned(&labels),
            duration: self.duration.get_or_create_owned(&by_type),
            start_latency: self.start_latency.get_or_create_owned(&by_type),
        }
    }

    /// Counts one pass of a maintenance sweep, and what it did (`action`, count).
    pub(crate) fn sweep_ran(&self, sweep: &'static str, actions: &[(&'static str, u64)]) {
        self.sweep_runs.get_or_create(&SweepLabels { sweep }).inc();
        for &(action, n) in actions {
            self.sweep_actions.get_or_create(&SweepActionLabels { sweep, action }).inc_by(n);
        }
    }

    /// Counts a failed pass of a maintenance sweep.
    pub(crate) fn sweep_failed(&self, sweep: &'static str) {
        self.sweep_errors.get_or_create(&SweepLabels { sweep }).inc();
    }

    /// Shows `snapshot` in the gauges, dropping the series of what it no longer lists.
    fn show(&self, snapshot: &MetricsSnapshot) {
        let mut shown = self.shown.lock().unwrap_or_else(|e| e.into_inner());
        for gone in shown.queues.iter().filter(|q| !snapshot.queues.iter().any(|n| n.queue == q.queue)) {
            for state in QUEUE_STATES {
                self.queue_jobs.remove(&QueueStateLabels { queue: gone.queue.clone(), state });
            }
            self.oldest_ready.remove(&QueueLabels { queue: gone.queue.clone() });
            self.queue_paused.remove(&QueueLabels { queue: gone.queue.clone() });
        }
        for gone in shown.keys.iter().filter(|k| !snapshot.keys.iter().any(|n| n.key == k.key)) {
            self.key_held.remove(&KeyLabels { key: gone.key.clone() });
            self.key_parked.remove(&KeyLabels { key: gone.key.clone() });
        }
        for gone in shown.processes.iter().filter(|p| !snapshot.processes.iter().any(|n| n.kind == p.kind)) {
            self.processes.remove(&KindLabels { kind: gone.kind.clone() });
        }
        for q in &snapshot.queues {
            let counts = [q.ready, q.scheduled, q.running, q.parked, q.dead];
            for (state, n) in QUEUE_STATES.into_iter().zip(counts) {
                self.queue_jobs.get_or_create(&QueueStateLabels { queue: q.queue.clone(), state }).set(n);
            }
            let labels = QueueLabels { queue: q.queue.clone() };
            self.oldest_ready.get_or_create(&labels).set(q.oldest_ready_seconds.unwrap_or(0.0));
            self.queue_paused.get_or_create(&labels).set(i64::from(q.paused));
        }
        for k in &snapshot.keys {
            self.key_held.get_or_create(&KeyLabels { key: k.key.clone() }).set(k.held);
            self.key_parked.get_or_create(&KeyLabels { key: k.key.clone() }).set(k.parked);
        }
        for p in &snapshot.processes {
            self.processes.get_or_create(&KindLabels { kind: p.kind.clone() }).set(p.count);
        }
        *shown = snapshot.clone();
    }
}

/// The service that reads the gauges: one `lockgate.metrics_snapshot` every `interval`.
pub(crate) struct MetricsRefresh {
    db: PgPool,
    metrics: Arc<Metrics>,
    interval: Duration,
    max_keys: u32,
    within: Duration,
}

impl MetricsRefresh {
    /// Gives up a read not answered within `within`, with its connection (`held::answer_within`).
    pub fn new(db: PgPool, metrics: Arc<Metrics>, interval: Duration, max_keys: u32, within: Duration) -> Self {
        Self { db, metrics, interval, max_keys, within }
    }

    pub async fn run(self, shutdown: CancellationToken) {
        // The first refresh at once: a scrape right after the start finds the gauges.
        crate::ticker::every(self.interval, Duration::ZERO, &shutdown, || async {
            if let Err(error) = self.run_once().await {
                self.metrics.refresh_errors.inc();
                tracing::warn!(%error, "could not read the metrics' gauges; they keep their last values");
            }
        })
        .await;
    }

    /// Reads the snapshot and shows it; returns what it read.
    pub async fn run_once(&self) -> Result<MetricsSnapshot, DbError> {
        let max_keys = i32::try_from(self.max_keys).unwrap_or(i32::MAX);
        let snapshot =
            on_pool(&self.db, self.within, async |c| lockgate_sql::metrics_snapshot(Db::idle(c), max_keys).await)
                .await?;
        self.metrics.show(&snapshot);
        Ok(snapshot)
    }
}

#[cfg(test)]
mod tests {
    use lockgate_sql::{KeyMetrics, QueueMetrics};

    use super::*;

    fn queue(name: &str, ready: i64) -> QueueMetrics {
        QueueMetrics {
            queue: name.into(),
            ready,
            scheduled: 0,
            running: 0,
            parked: 0,
            dead: 0,
            oldest_ready_seconds: None,
            paused: false,
        }
    }

    #[test]
    fn counters_of_one_queue_and_type_share_their_handles_and_encode_with_units() {
        let metrics = Metrics::new();
        metrics.job("default", "email").succeeded.inc();
        metrics.job("default", "email").succeeded.inc();
        metrics.job("default", "email").duration.observe(0.2);
        let text = metrics.encode();
        assert!(text.contains("lockgate_jobs_succeeded_total{queue=\"default\",job_type=\"email\"} 2"), "{text}");
        assert!(text.contains("lockgate_job_duration_seconds_count{job_type=\"email\"} 1"), "{text}");
    }

    #[test]
    fn gauges_show_the_last_snapshot_and_drop_what_is_gone() {
        let metrics = Metrics::new();
        let keys = vec![KeyMetrics { key: "k1".into(), held: 2, parked: 3 }];
        metrics.show(&MetricsSnapshot { queues: vec![queue("a", 4), queue("b", 1)], keys, processes: vec![] });
        metrics.show(&MetricsSnapshot { queues: vec![queue("a", 5)], keys: vec![], processes: vec![] });
        let text = metrics.encode();
        assert!(text.contains("lockgate_queue_jobs{queue=\"a\",state=\"ready\"} 5"), "{text}");
        assert!(!text.contains("queue=\"b\""), "a dropped queue's series go: {text}");
        assert!(!text.contains("key=\"k1\""), "a key no longer held goes: {text}");
    }
}
