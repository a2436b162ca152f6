//! A worker pool: the fetch loop that claims deliveries from its queues in strict priority
//! order whenever it has free capacity, the executors that run them, and the completer that
//! archives them in batches.
//!
//! The pool claims ahead of its handler slots: jobs claimed ahead wait in memory (renewed by
//! the heartbeat like running ones) for a handler slot, so a freed slot never waits a claim
//! round trip. How far ahead adapts to the jobs' speed (see `slots`).
//!
//! Shutdown (the pool's part of the supervisor's order): stop claiming and return the jobs
//! claimed ahead at once; give running jobs `shutdown_timeout`; then cancel the rest and return
//! them to their queue, visible at once, in one fenced statement per queue that lands before
//! `run` returns; let finishing jobs land their outcome; stop the completer last.

mod completer;
mod executor;
mod held;
mod persist;
mod slots;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockgate_core::{Claim, QueueName};
use lockgate_sql::PgPool;
use tokio::sync::{Notify, Semaphore};

use held::HeldConnection;
use slots::{ClaimSlots, Prefetch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::in_flight::{Delivery, InFlight};
use crate::policies::PolicyCache;
use crate::{PoolConfig, Registry, RuntimeConfig};
pub use completer::{complete_deliveries, Completion};
use completer::{Completer, CompleterHandle};

/// What every executor of a pool shares.
pub(crate) struct Shared {
    pub db: PgPool,
    pub config: RuntimeConfig,
    pub registry: Registry,
    pub policies: Arc<PolicyCache>,
    pub in_flight: Arc<InFlight>,
    pub completer: CompleterHandle,
    /// This process's registry id, tagged on every claim (0 until registered); written by the
    /// process registry.
    pub owner: Arc<AtomicI64>,
    /// Unix milliseconds of the fetch loop's last iteration; read by the process registry.
    pub last_tick: Arc<AtomicI64>,
}

/// Pause after a failed claim, doubled up to the poll interval while the database is away.
const CLAIM_RETRY_PAUSE: Duration = Duration::from_millis(100);
/// With a backlog, a claim waits this long for more free slots when fewer than half of
/// `CLAIM_BATCH_TARGET` are free: a millisecond costs little next to a commit per claim.
const CLAIM_COALESCE: Duration = Duration::from_millis(1);
/// The claim size the coalescing aims for (PGMQ users read 16 at a time).
const CLAIM_BATCH_TARGET: usize = 16;

pub struct WorkerPool {
    config: PoolConfig,
    shared: Arc<Shared>,
    completer: Completer,
    wake: Arc<Notify>,
}

impl WorkerPool {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: PoolConfig,
        runtime: RuntimeConfig,
        db: PgPool,
        registry: Registry,
        policies: Arc<PolicyCache>,
        in_flight: Arc<InFlight>,
        wake: Arc<Notify>,
        owner: Arc<AtomicI64>,
        last_tick: Arc<AtomicI64>,
    ) -> Self {
        let (completer, handle) = Completer::new(db.clone(), Arc::clone(&in_flight));
        let shared = Shared { db, config: runtime, registry, policies, in_flight, completer: handle, owner, last_tick };
        Self { config, shared: Arc::new(shared), completer, wake }
    }

    /// Runs until `shutdown` fires, then drains as the module docs describe.
    pub async fn run(self, shutdown: CancellationToken) {
        let Self { config, shared, completer, wake } = self;
        let completer = tokio::spawn(completer.run());
        let tracker = TaskTracker::new();
        let slots = Arc::new(ClaimSlots::default());
        let running = Arc::new(Semaphore::new(config.concurrency));
        fetch_loop(&config, &shared, &slots, &running, &tracker, &wake, &shutdown).await;
        tracing::info!(pool = %config.name, held = shared.in_flight.len(), "pool stopped claiming");
        tracker.close();
        release(&shared, false).await;
        if tokio::time::timeout(shared.config.shutdown_timeout, tracker.wait()).await.is_err() {
            release(&shared, true).await;
            tracker.wait().await;
        }
        drop(shared);
        let _ = completer.await;
        tracing::info!(pool = %config.name, "pool drained");
    }
}

async fn fetch_loop(
    config: &PoolConfig,
    shared: &Arc<Shared>,
    slots: &Arc<ClaimSlots>,
    running: &Arc<Semaphore>,
    tracker: &TaskTracker,
    wake: &Notify,
    shutdown: &CancellationToken,
) {
    let mut pause = CLAIM_RETRY_PAUSE;
    let mut backlog = false;
    let mut prefetch = Prefetch::new(config.concurrency);
    let mut conn = HeldConnection::new(shared.db.clone());
    loop {
        shared.last_tick.store(chrono::Utc::now().timestamp_millis(), Ordering::Relaxed);
        let limit = prefetch.limit(std::time::Instant::now());
        let mut permits = tokio::select! {
            biased;
            () = shutdown.cancelled() => return,
            taken = slots.take(limit) => taken,
        };
        // With a backlog, a claim for one free slot wastes a round trip and a commit: give the
        // other slots a moment to free up so the claim carries a batch.
        if backlog && permits.len() < limit.min(CLAIM_BATCH_TARGET) / 2 {
            tokio::time::sleep(CLAIM_COALESCE).await;
            permits.extend(slots.try_take(limit));
        }
        let claimed_at = std::time::Instant::now();
        let claims = match claim_in_order(config, shared, &mut conn, permits.len()).await {
            Ok(claims) => {
                prefetch.observe_claim(claimed_at.elapsed());
                pause = CLAIM_RETRY_PAUSE;
                backlog = claims.len() == permits.len();
                claims
            }
            Err(error) => {
                tracing::warn!(pool = %config.name, %error, "claim failed; retrying");
                drop(permits);
                tokio::select! { () = shutdown.cancelled() => return, () = tokio::time::sleep(pause) => {} }
                pause = (pause * 2).min(shared.config.poll_interval.max(CLAIM_RETRY_PAUSE));
                continue;
            }
        };
        if claims.is_empty() {
            drop(permits);
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = wake.notified() => {}
                () = tokio::time::sleep(shared.config.poll_interval) => {}
            }
            continue;
        }
        let lease_until = claimed_at + shared.config.visibility_timeout;
        for c in &claims {
            let delivery = Delivery { queue: c.queue.clone(), msg_id: c.msg_id, read_ct: c.read_ct };
            shared.in_flight.insert_waiting(&delivery, lease_until);
        }
        // Start them in claim order (priority order) as handler slots free up; the next claim
        // goes out as soon as the last of this batch has started. On shutdown the ones not
        // started stay registered as waiting and are returned at once.
        for (claim, permit) in claims.into_iter().zip(permits) {
            let run = tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                run = Arc::clone(running).acquire_owned() => match run { Ok(r) => r, Err(_) => return },
            };
            tracker.spawn(executor::execute(Arc::clone(shared), claim, claimed_at, (permit, run)));
            prefetch.observe_started(1);
        }
    }
}

/// Claims up to `room` deliveries, earlier queues first; each queue's batch in priority order.
async fn claim_in_order(
    config: &PoolConfig,
    shared: &Shared,
    conn: &mut HeldConnection,
    room: usize,
) -> Result<Vec<Claim>, lockgate_sql::DbError> {
    let mut claimed = Vec::with_capacity(room);
    for queue in &config.queues {
        let want = room - claimed.len();
        if want == 0 {
            break;
        }
        let owner = Some(shared.owner.load(Ordering::SeqCst)).filter(|id| *id != 0);
        let visibility = shared.config.visibility_timeout;
        let mut batch =
            conn.run(async |c| lockgate_sql::claim_as(c, queue, want as i32, visibility, owner).await).await?;
        batch.sort_by_key(|c| (priority_of(c), c.msg_id));
        claimed.extend(batch);
    }
    Ok(claimed)
}

/// The priority a claim's headers carry (0 when absent, as the claim's own ORDER BY reads it).
fn priority_of(claim: &Claim) -> i64 {
    claim.headers.as_ref().and_then(|h| h.get("priority")).and_then(serde_json::Value::as_i64).unwrap_or(0)
}

/// Shutdown: return every delivery claimed ahead (and, with `running`, every one still running)
/// to its queue, visible at once (G7).
async fn release(shared: &Shared, running: bool) {
    let deliveries = shared.in_flight.begin_release(running);
    let mut by_queue: HashMap<QueueName, Vec<Delivery>> = HashMap::new();
    for d in deliveries {
        by_queue.entry(d.queue.clone()).or_default().push(d);
    }
    for (queue, deliveries) in by_queue {
        let tokens: Vec<(i64, i32)> = deliveries.iter().map(|d| (d.msg_id, d.read_ct)).collect();
        let lease_until = || deliveries.iter().map(|d| shared.in_flight.lease_until(d)).min().flatten();
        let result = persist::persist("release", lease_until, || async {
            let _gate = shared.in_flight.gate.read().await;
            let result = lockgate_sql::release(&shared.db, &queue, &tokens).await;
            if result.is_ok() {
                deliveries.iter().for_each(|d| shared.in_flight.remove(d));
            }
            result
        })
        .await;
        for d in &deliveries {
            shared.in_flight.remove(d);
        }
        match result {
            Ok((released, _)) => {
                tracing::info!(%queue, released = released.len(), "returned unfinished jobs to their queue")
            }
            Err(error) => {
                tracing::warn!(%queue, %error, "could not return jobs; they come back when their visibility lapses")
            }
        }
    }
}
