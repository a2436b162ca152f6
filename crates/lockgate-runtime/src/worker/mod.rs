//! A worker pool: the fetch loop that claims deliveries from its queues in strict priority
//! order whenever it has free capacity, the executors that run them, the completer that
//! archives them in batches, and the watchdog that cancels a handler whose budget is running out.
//!
//! The pool claims ahead of its handler slots: jobs claimed ahead wait in memory (renewed by
//! the heartbeat like running ones) for a handler slot, so a freed slot never waits a claim
//! round trip. How far ahead adapts to the jobs' speed (see `slots`).
//!
//! A pool of several queues claims from all of them in one statement (`lockgate.claim_queues`),
//! in order, and leaves the queues a claim found empty (it returned fewer than it asked for) out
//! of the next claims until a wake-up for the pool or `poll_interval` (`Drained`), so a pool of
//! 50 queues does not probe its empty ones at every claim. Each queue's claim still stands alone (H29): if
//! the statement fails, the pool claims queue by queue, and an error on one queue is logged and
//! that queue alone waits before its next try, while the pool's other queues carry on.
//!
//! Self-fencing (H27): the watchdog ticks every `FENCE_TICK` on its own task, independent of the
//! heartbeat (which may be stuck in a hung TCP call), and cancels every running handler whose
//! budget, as last renewed, ends within `FENCE_MARGIN`, measured on this process's monotonic
//! clock. A partitioned worker thus stops its handlers before the database can let anyone else
//! take their permits.
//!
//! Shutdown (the pool's part of the supervisor's order): stop claiming and return the jobs
//! claimed ahead at once; give running jobs `shutdown_timeout`; then cancel the rest, wait for
//! each handler to end (a command's whole process group killed and reaped), and return only
//! those, visible at once, in one fenced statement per queue that lands before `run` returns
//! (H30); a handler that will not stop within its grace (it blocks its thread, and cannot be
//! aborted) is waited for, its delivery renewed meanwhile, and returned once it has ended (design
//! §95). Finishing jobs land their outcome; the completer stops last.

mod completer;
pub(crate) mod executor;
mod persist;
mod slots;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockgate_core::{Claim, QueueName};
use lockgate_sql::PgPool;
use tokio::sync::Semaphore;

use crate::held::{self, answer_within, HeldConnection};
use slots::{ClaimSlots, Prefetch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::in_flight::{Delivery, InFlight, FENCE_TICK};
use crate::metrics::Metrics;
use crate::notifier::Wake;
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
    /// The process's metrics: executors and the completer count outcomes here.
    pub metrics: Arc<Metrics>,
}

/// Pause after a failed claim on a queue, doubled up to the poll interval while it keeps failing.
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
    wake: Arc<Wake>,
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
        wake: Arc<Wake>,
        owner: Arc<AtomicI64>,
        last_tick: Arc<AtomicI64>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (completer, handle) = Completer::new(db.clone(), Arc::clone(&in_flight), answer_within(&runtime));
        let shared =
            Shared { db, config: runtime, registry, policies, in_flight, completer: handle, owner, last_tick, metrics };
        Self { config, shared: Arc::new(shared), completer, wake }
    }

    /// Runs until `shutdown` fires, then drains as the module docs describe.
    pub async fn run(self, shutdown: CancellationToken) {
        let Self { config, shared, completer, wake } = self;
        let completer = tokio::spawn(completer.run());
        let fence_stop = CancellationToken::new();
        let watchdog = tokio::spawn(watchdog(Arc::clone(&shared.in_flight), fence_stop.clone()));
        let tracker = TaskTracker::new();
        let slots = Arc::new(ClaimSlots::default());
        let running = Arc::new(Semaphore::new(config.concurrency));
        fetch_loop(&config, &shared, &slots, &running, &tracker, &wake, &shutdown).await;
        tracing::info!(pool = %config.name, held = shared.in_flight.len(), "pool stopped claiming");
        tracker.close();
        // Claimed ahead, never started: nothing to stop, so they go back at once.
        shared.in_flight.stop_waiting();
        return_stopped(&shared).await;
        if tokio::time::timeout(shared.config.shutdown_timeout, tracker.wait()).await.is_err() {
            let cancelled = shared.in_flight.stop_running();
            tracing::info!(pool = %config.name, cancelled, "shutdown_timeout passed; cancelling running jobs");
            // Every executor ends once its handler has ended, however long one that blocks its
            // thread takes (H30, design §95); only then are the stopped ones returned.
            tracker.wait().await;
            return_stopped(&shared).await;
        }
        drop(shared);
        let _ = completer.await;
        fence_stop.cancel();
        let _ = watchdog.await;
        tracing::info!(pool = %config.name, "pool drained");
    }
}

/// The pool's self-fencing watchdog (H27): see the module docs. Also run by a heartbeat whose
/// caller's runtime shut down under it, for the handlers that outlive that runtime.
pub(crate) async fn watchdog(in_flight: Arc<InFlight>, stop: CancellationToken) {
    crate::ticker::every(FENCE_TICK, Duration::ZERO, &stop, || async {
        for fenced in in_flight.fence(Instant::now()) {
            let Delivery { queue, msg_id, .. } = &fenced.delivery;
            tracing::warn!(
                %queue,
                msg_id,
                job_id = fenced.job_id.map(|id| id.0),
                overdue_ms = fenced.overdue_by.as_millis() as u64,
                "no renewal landed in time: cancelling the handler before its lease can end in the database"
            );
        }
    })
    .await;
}

/// Queues of a pool of several that a claim found empty (it returned fewer than it asked of
/// them; `FOR UPDATE SKIP LOCKED` passes over rows other claimers hold, and a claim that took
/// messages it does not return, dead-lettered, parked or put back, wakes the pool itself), left
/// out of the next claims until a wake-up for the pool (a job enqueued on one of them) or
/// `poll_interval`. A job that becomes visible without a wake-up (a retry's backoff or a delay
/// ending) waits at most `poll_interval` there, as it does for an idle pool. A pool of one queue
/// claims again at once after a short claim (docs/design.md section 51).
#[derive(Default)]
struct Drained {
    since: HashMap<QueueName, Instant>,
    /// The pool's wake-up generation when the marks were made.
    generation: u64,
}

impl Drained {
    /// Forgets every mark after a wake-up, and marks older than `poll`.
    fn refresh(&mut self, wake: &Wake, poll: Duration) {
        let generation = wake.generation();
        if generation != self.generation {
            self.since.clear();
            self.generation = generation;
        }
        self.since.retain(|_, at| at.elapsed() < poll);
    }

    fn skips(&self, queue: &QueueName) -> bool {
        self.since.contains_key(queue)
    }
}

/// A queue whose last claim failed waits until `until` before it is claimed from again (H29).
struct QueueBackoff {
    until: Instant,
    pause: Duration,
}

async fn fetch_loop(
    config: &PoolConfig,
    shared: &Arc<Shared>,
    slots: &Arc<ClaimSlots>,
    running: &Arc<Semaphore>,
    tracker: &TaskTracker,
    wake: &Wake,
    shutdown: &CancellationToken,
) {
    let mut backlog = false;
    let mut prefetch = Prefetch::new(config.concurrency, shared.config.max_claim_ahead_bytes);
    let mut conn = HeldConnection::new(shared.db.clone(), answer_within(&shared.config));
    let mut backoff: HashMap<QueueName, QueueBackoff> = HashMap::new();
    let mut drained = Drained::default();
    loop {
        shared.last_tick.store(chrono::Utc::now().timestamp_millis(), Ordering::Relaxed);
        let limit = prefetch.limit(Instant::now());
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
        let claimed_at = Instant::now();
        drained.refresh(wake, shared.config.poll_interval);
        let skip = Skip { backoff: &mut backoff, drained: &mut drained };
        let (claims, all_ok) = claim_in_order(config, shared, &mut conn, permits.len(), skip).await;
        if all_ok {
            prefetch.observe_claim(claimed_at.elapsed());
        }
        backlog = claims.len() == permits.len();
        let bytes: usize = claims.iter().filter_map(|c| c.message.as_ref()).map(slots::approx_bytes).sum();
        prefetch.observe_payloads(bytes, claims.len());
        if claims.is_empty() {
            drop(permits);
            // A queue backing off is retried when its pause ends, even with no wake-up.
            let poll = shared.config.poll_interval;
            let retry = backoff.values().map(|b| b.until.saturating_duration_since(Instant::now())).min();
            let idle = retry.map_or(poll, |r| r.min(poll));
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = wake.notified() => {}
                () = tokio::time::sleep(idle) => {}
            }
            continue;
        }
        for c in &claims {
            let delivery = Delivery { queue: c.queue.clone(), msg_id: c.msg_id, read_ct: c.read_ct };
            // The claim's budget started before the claim was sent (H27).
            shared.in_flight.insert_waiting(&delivery, claimed_at + c.budget);
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
        // Let the executors just spawned reach their handlers before the next claim is sent: a
        // spawned task waits in this thread's queue until the loop yields, and the claim's own
        // work (and the database's, on a small machine) would otherwise come first.
        tokio::task::yield_now().await;
    }
}

/// Claims up to `room` deliveries, earlier queues first; each queue's batch in priority order.
/// Every delivery is claimed ahead (`start_now` 0): the claim records no start, and each
/// executor records its own once its handler has started (H32). A claim whose reply is lost
/// after it committed (a connection cut, a reply that never came) then spent no attempt of the
/// jobs it took: their next claim counts that delivery as a return (review helper-135 F4: one
/// that recorded its first deliveries as started dead-lettered a `max_attempts = 1` job that
/// never ran).
/// A pool of several queues claims from all of them in one statement (`claim_queues`); if that
/// fails, queue by queue, so that each queue stands alone (H29): one whose claim fails is logged
/// and backs off, and the others are claimed from as usual. Returns the claims and whether every
/// queue tried answered.
async fn claim_in_order(
    config: &PoolConfig,
    shared: &Shared,
    conn: &mut HeldConnection,
    room: usize,
    skip: Skip<'_>,
) -> (Vec<Claim>, bool) {
    let Skip { backoff, drained } = skip;
    let several = config.queues.len() > 1;
    let ready: Vec<QueueName> = config
        .queues
        .iter()
        .filter(|q| backoff.get(*q).is_none_or(|b| Instant::now() >= b.until) && !drained.skips(q))
        .cloned()
        .collect();
    if ready.len() > 1 {
        let owner = Some(shared.owner.load(Ordering::SeqCst)).filter(|id| *id != 0);
        let (visibility, want, now) = (shared.config.visibility_timeout, room as i32, Some(0));
        let ready = &ready;
        match conn
            .run(async |c| {
                let db = lockgate_sql::pooler::Db::idle(c);
                lockgate_sql::claim_queues(db, ready, want, visibility, owner, now).await
            })
            .await
        {
            Ok(mut claimed) => {
                for queue in ready {
                    backoff.remove(queue);
                }
                // Queue order first, then each queue's batch as claim_in_order's per-queue path sorts it.
                let position = |c: &Claim| ready.iter().position(|q| *q == c.queue).unwrap_or(usize::MAX);
                claimed.sort_by_key(|c| (position(c), priority_of(c), c.msg_id));
                // Each queue the statement reached was asked for what the earlier ones left.
                let mut left = room;
                for queue in ready {
                    if left == 0 {
                        break;
                    }
                    let took = claimed.iter().filter(|c| c.queue == *queue).count();
                    if took < left {
                        drained.since.insert(queue.clone(), Instant::now());
                    }
                    left = left.saturating_sub(took);
                }
                return (claimed, true);
            }
            Err(error) => {
                tracing::debug!(pool = %config.name, %error, "claim across queues failed; claiming queue by queue");
            }
        }
    }
    let mut claimed = Vec::with_capacity(room);
    let mut all_ok = true;
    for queue in &config.queues {
        let want = room - claimed.len();
        if want == 0 {
            break;
        }
        if backoff.get(queue).is_some_and(|b| Instant::now() < b.until) || drained.skips(queue) {
            continue;
        }
        let owner = Some(shared.owner.load(Ordering::SeqCst)).filter(|id| *id != 0);
        let visibility = shared.config.visibility_timeout;
        match conn
            .run(async |c| {
                lockgate_sql::claim_as(
                    lockgate_sql::pooler::Db::idle(c),
                    queue,
                    want as i32,
                    visibility,
                    owner,
                    Some(0),
                )
                .await
            })
            .await
        {
            Ok(mut batch) => {
                backoff.remove(queue);
                if several && batch.len() < want {
                    drained.since.insert(queue.clone(), Instant::now());
                }
                batch.sort_by_key(|c| (priority_of(c), c.msg_id));
                claimed.extend(batch);
            }
            Err(error) => {
                all_ok = false;
                let longest = shared.config.poll_interval.max(CLAIM_RETRY_PAUSE);
                let pause = backoff.get(queue).map_or(CLAIM_RETRY_PAUSE, |b| (b.pause * 2).min(longest));
                backoff.insert(queue.clone(), QueueBackoff { until: Instant::now() + pause, pause });
                tracing::warn!(
                    pool = %config.name,
                    %queue,
                    %error,
                    retry_in_ms = pause.as_millis() as u64,
                    "claim failed on this queue; the pool's other queues carry on"
                );
            }
        }
    }
    (claimed, all_ok)
}

/// What keeps a queue out of a claim: a pause after its last claim failed, or a recent claim
/// that found it empty.
struct Skip<'a> {
    backoff: &'a mut HashMap<QueueName, QueueBackoff>,
    drained: &'a mut Drained,
}

/// The priority a claim's headers carry (0 when absent, as the claim's own ORDER BY reads it).
fn priority_of(claim: &Claim) -> i64 {
    claim.headers.as_ref().and_then(|h| h.get("priority")).and_then(serde_json::Value::as_i64).unwrap_or(0)
}

/// Shutdown: return every delivery no handler runs for any more to its queue, visible at once
/// (G7), one fenced statement per queue.
async fn return_stopped(shared: &Shared) {
    let mut by_queue: HashMap<QueueName, Vec<Delivery>> = HashMap::new();
    for d in shared.in_flight.take_stopped() {
        by_queue.entry(d.queue.clone()).or_default().push(d);
    }
    for (queue, deliveries) in by_queue {
        let tokens: Vec<(i64, i32)> = deliveries.iter().map(|d| (d.msg_id, d.read_ct)).collect();
        let lease_until = || deliveries.iter().map(|d| shared.in_flight.lease_until(d)).min().flatten();
        let cap = Some(shared.config.max_shutdown_returns);
        let within = answer_within(&shared.config);
        let result = persist::persist("release", lease_until, || {
            held::on_pool(&shared.db, within, async |c| {
                lockgate_sql::release(lockgate_sql::pooler::Db::idle(c), &queue, &tokens, cap).await
            })
        })
        .await;
        for d in &deliveries {
            shared.in_flight.remove(d);
        }
        match result {
            Ok((released, _)) => {
                tracing::info!(%queue, released = released.len(), "returned unfinished jobs to their queue");
                // A job cancelled while it was stopping is not returned: its handler has ended, so
                // the permit it kept goes back now.
                for d in deliveries.iter().filter(|d| !released.contains(&d.msg_id)) {
                    executor::give_back_if_cancelled(&shared.db, d).await;
                }
            }
            Err(error) => {
                tracing::error!(%queue, %error, "could not return jobs; they come back when their visibility lapses")
            }
        }
    }
}
