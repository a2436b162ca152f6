//! Running one delivery: decode it, check its type and attempt count, run its handler under
//! the job type's timeout and the delivery's cancellation signal, then write exactly one final
//! statement — complete, retry in place, or dead-letter — fenced on the delivery's token.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use lockgate_core::{Claim, JobHeaders, JobPolicy};
use lockgate_sql::pooler::Db;
use lockgate_sql::DeadLetterReason;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::completer::Finished;
use super::persist::persist;
use super::slots::Slot;
use super::Shared;
use crate::handler::HandlerFailure;
use crate::held::{answer_within, on_pool};
use crate::in_flight::{Delivery, Finish, Start, ABORT_WAIT, CANCEL_GRACE};
use crate::metrics::JobMetrics;
use crate::{CancelReason, JobContext, JobError};

/// Runs one claimed delivery (registered as waiting in the in-flight set) to its final
/// statement. The permits are its claim slot and its handler slot.
pub(crate) async fn execute(
    shared: Arc<Shared>,
    claim: Claim,
    claimed_at: Instant,
    permits: (Slot, OwnedSemaphorePermit),
) {
    // The job's id, type and attempt are known once its headers are decoded (run_delivery).
    let span = tracing::info_span!(
        "job",
        queue = %claim.queue,
        msg_id = claim.msg_id,
        read_ct = claim.read_ct,
        job_id = tracing::field::Empty,
        job_type = tracing::field::Empty,
        attempt = tracing::field::Empty
    );
    run_delivery(shared, claim, claimed_at).instrument(span).await;
    drop(permits);
}

async fn run_delivery(shared: Arc<Shared>, mut claim: Claim, claimed_at: Instant) {
    let delivery = Delivery { queue: claim.queue.clone(), msg_id: claim.msg_id, read_ct: claim.read_ct };
    if let Some(reason) = claim.unreadable.take() {
        let dead = Undeliverable { reason: DeadLetterReason::Undecodable, error: &reason, job_type: None };
        return dead_letter_now(&shared, &claim, claimed_at, dead, claim.read_ct).await;
    }
    let headers = match JobHeaders::decode(claim.headers.as_ref(), claim.msg_id) {
        Ok(headers) => headers,
        Err(reason) => {
            let dead = Undeliverable { reason: DeadLetterReason::Undecodable, error: &reason, job_type: None };
            return dead_letter_now(&shared, &claim, claimed_at, dead, claim.read_ct).await;
        }
    };
    if headers.returns >= claim.read_ct {
        // Each return follows a delivery, so this delivery (read_ct) comes after at most
        // read_ct - 1 of them: more is a header written by hand, and would make every delivery
        // attempt 1, retried for ever.
        let error = format!(
            "returns {} in the headers is more than the deliveries before this one ({})",
            headers.returns,
            claim.read_ct - 1
        );
        let dead =
            Undeliverable { reason: DeadLetterReason::Undecodable, error: &error, job_type: Some(&headers.job_type) };
        return dead_letter_now(&shared, &claim, claimed_at, dead, claim.read_ct).await;
    }
    // Moved out, not copied: the statements that follow read the row, not this value.
    let Some(args) = claim.message.take().filter(|m| m.is_object()) else {
        let error = "job arguments are not a JSON object";
        let job_type = Some(headers.job_type.as_str());
        let dead = Undeliverable { reason: DeadLetterReason::Undecodable, error, job_type };
        return dead_letter_now(&shared, &claim, claimed_at, dead, claim.read_ct).await;
    };
    let Some(policy) = shared.policies.get(&shared.db, &headers.job_type, claimed_at).await else {
        let error = format!("job type {:?} is not defined in lockgate.job_types", headers.job_type);
        // Counted under "unknown": a type no one defined is whatever a producer wrote, and must
        // not become a metric label of its own.
        let dead = Undeliverable { reason: DeadLetterReason::UnknownJobType, error: &error, job_type: None };
        return dead_letter_now(&shared, &claim, claimed_at, dead, claim.read_ct).await;
    };
    let attempt = claim.attempt(&headers);
    let span = tracing::Span::current();
    span.record("job_id", headers.job_id.0);
    span.record("job_type", headers.job_type.as_str());
    span.record("attempt", attempt);
    if attempt > policy.max_attempts {
        let error = format!(
            "delivery would be attempt {attempt} of {}: no attempt is left (the previous one was lost to a worker \
             crash or lease loss, or max_attempts was lowered)",
            policy.max_attempts
        );
        let job_type = Some(headers.job_type.as_str());
        let dead = Undeliverable { reason: DeadLetterReason::AttemptsExhausted, error: &error, job_type };
        // The attempts made, which a lowered max_attempts may be below.
        let made = i32::try_from(attempt - 1).unwrap_or(i32::MAX);
        return dead_letter_now(&shared, &claim, claimed_at, dead, made).await;
    }
    // The attempt's liveness: moved into the handler's task, cloned by its holds.
    let alive = Arc::new(());
    let ctx = JobContext {
        job_id: headers.job_id,
        job_type: headers.job_type.clone(),
        queue: claim.queue.to_string(),
        msg_id: claim.msg_id,
        read_ct: claim.read_ct,
        attempt,
        max_attempts: policy.max_attempts,
        cancel: CancellationToken::new(),
        reason: Default::default(),
        lease: Arc::new(tokio::sync::watch::channel(claimed_at).0),
        run: Arc::downgrade(&alive),
        held: Default::default(),
    };
    let metrics = shared.metrics.job(claim.queue.as_str(), &headers.job_type);
    match shared.in_flight.start(&delivery, ctx.clone(), Instant::now()) {
        Start::Run => {}
        Start::Lost => {
            tracing::info!(job_id = ctx.job_id.0, "claimed job not started: its lease was lost");
            // Cancelled meanwhile (its heartbeat may not have said so): what it kept goes back.
            give_back_if_cancelled(&shared.db, &delivery).await;
            return;
        }
        Start::Late => {
            // The claim's answer came so late (a stalled network, a paused process) that what is
            // left of the lease cannot cover a handler: returned unstarted, it runs again at once
            // and this delivery is no attempt (H32). If the return fails, its visibility lapses.
            let returned = on_pool(&shared.db, answer_within(&shared.config), async |c| {
                lockgate_sql::return_unstarted(Db::idle(c), claim.queue.as_str(), delivery.msg_id, delivery.read_ct)
                    .await
            })
            .await;
            tracing::warn!(
                job_id = ctx.job_id.0,
                returned = returned.as_ref().is_ok_and(|r| *r),
                "claimed job not started: too little of its lease was left to start it (its claim answered late, \
                 or this process's threads were blocked, by a handler that blocks its thread, say, while it waited \
                 to start)"
            );
            if !returned.is_ok_and(|r| r) {
                give_back_if_cancelled(&shared.db, &delivery).await;
            }
            return;
        }
        Start::Refused => {
            tracing::info!(job_id = ctx.job_id.0, "claimed job given back before it started (shutdown)");
            return;
        }
    }
    if let Some(holder) = headers.duplicate_of {
        // A while_executing duplicate its type discards: archived without running.
        tracing::info!(job_id = ctx.job_id.0, duplicate_of = holder.0, "discarded: a job of its unique key is running");
        match shared.in_flight.begin_finishing(&delivery) {
            Finish::Write => {
                let finished =
                    Finished { job_id: ctx.job_id, attempt, duration: Duration::ZERO, discarded: true, metrics };
                shared.completer.submit(delivery, finished).await;
            }
            Finish::Lost => give_back_if_cancelled(&shared.db, &delivery).await,
            Finish::Shutdown => shared.in_flight.stopped(&delivery),
        }
        return;
    }
    if claim.claimed_ahead {
        // Recorded by the completer's next statement, so this run counts as an attempt even if
        // the process dies while it runs (H32).
        shared.completer.record_start(delivery.clone()).await;
    }
    observe_start_latency(&metrics, &claim);
    let started = Instant::now();
    shared.in_flight.handler_started(&delivery, &alive);
    let result = run_handler(&shared, &delivery, &ctx, &policy, args, alive).await;
    let duration = started.elapsed();
    metrics.duration.observe(duration.as_secs_f64());
    match shared.in_flight.begin_finishing(&delivery) {
        Finish::Write => {}
        Finish::Lost => {
            // Its lease is lost or fenced: this delivery may write nothing more.
            let reason = ctx.cancel_reason().map_or_else(|| "none".to_string(), |r| r.to_string());
            tracing::info!(job_id = ctx.job_id.0, %reason, "delivery given up without an outcome");
            if ctx.cancel_reason() == Some(CancelReason::Cancelled) {
                metrics.cancelled.inc();
            }
            // Whatever stopped it first (a timeout, shutdown, a lapsed lease), its job may have
            // been cancelled meanwhile; then the permit it kept goes back now that it has ended.
            give_back_if_cancelled(&shared.db, &delivery).await;
            return;
        }
        Finish::Shutdown => {
            // Its handler has ended: the pool returns it to its queue (H30).
            shared.in_flight.stopped(&delivery);
            return;
        }
    }
    let duration_ms = duration.as_secs_f64() * 1000.0;
    match result {
        Ok(()) => {
            let finished = Finished { job_id: ctx.job_id, attempt, duration, discarded: false, metrics };
            shared.completer.submit(delivery, finished).await;
        }
        Err(HandlerFailure::Decode(reason)) => {
            tracing::warn!(attempt, error = %reason, duration_ms, "arguments do not decode; dead-lettering");
            let outcome = Outcome::DeadLetter { reason: DeadLetterReason::Undecodable, error: &reason };
            let written = finish(&shared, &claim, &delivery, outcome, attempt).await;
            if written {
                metrics.dead_lettered.inc();
            }
        }
        Err(HandlerFailure::Failed(error)) => {
            let attempt = Attempt { number: attempt, duration_ms, metrics: &metrics };
            fail(&shared, &claim, &delivery, &policy, attempt, &error).await;
        }
    }
}

/// From the message's enqueue to its handler's start, on the message's first delivery only: a
/// retry's or a returned job's wait is its backoff or the shutdown, not the queue's. (A promoted
/// or dead-letter-retried job is a new message: its wait counts from then.)
fn observe_start_latency(metrics: &JobMetrics, claim: &Claim) {
    if claim.read_ct == 1 {
        let waited = (chrono::Utc::now() - claim.enqueued_at).to_std().unwrap_or_default();
        metrics.start_latency.observe(waited.as_secs_f64());
    }
}

/// Runs the handler until it returns, its timeout passes, or its cancellation fires (then it
/// gets `CANCEL_GRACE` to return on its own before it is aborted, unless work of it is held,
/// `JobContext::hold`: a command's group still dying, a statement still ending, which the abort
/// would cut short). Returns only once the handler's task is gone and no hold of its attempt is
/// left: a task that blocks its thread cannot be aborted, and is waited for (`until_ended`), so
/// that nothing is written or given back for its delivery while it still runs.
async fn run_handler(
    shared: &Shared,
    delivery: &Delivery,
    ctx: &JobContext,
    policy: &JobPolicy,
    args: serde_json::Value,
    alive: Arc<()>,
) -> Result<(), HandlerFailure> {
    let Some(handler) = shared.registry.handler(&ctx.job_type) else {
        let msg = format!("no handler for job type {:?} in this process", ctx.job_type);
        return Err(HandlerFailure::Failed(JobError::new(msg)));
    };
    let mut call = handler(ctx.clone(), args);
    let timeout = policy.timeout;
    let timed_out = |limit: Duration| HandlerFailure::Failed(JobError::new(format!("timed out after {limit:?}")));
    let timed_ctx = ctx.clone();
    let run = Arc::downgrade(&alive);
    // The handler runs in a task of its own, so a panic is caught as a failed attempt (instead of
    // leaving the delivery in flight forever) and cancellation can abort it.
    // `alive` lives as long as the task does, a task that blocks its thread past the runtime's
    // shutdown included (`InFlight::handler_started`).
    let mut task = AbortOnDrop(tokio::spawn(async move {
        let _alive = alive;
        match timeout {
            Some(limit) => match tokio::time::timeout(limit, &mut call).await {
                Ok(result) => result,
                Err(_) => {
                    // A timeout cancels like everything else that stops a handler: it is told,
                    // and winds down (a command's group is killed, a SQL statement cancelled on
                    // the server) within its grace, after which the select below aborts it.
                    // Dropped at once, what it started outside the process ran on beside the
                    // retry.
                    timed_ctx.fire(CancelReason::Timeout);
                    let _ = call.await;
                    Err(timed_out(limit))
                }
            },
            None => call.await,
        }
    }));
    let result = tokio::select! {
        biased;
        joined = &mut task.0 => joined_result(joined),
        () = ctx.cancelled() => {
            if ctx.cancel_reason() == Some(CancelReason::Timeout) {
                // The attempt has failed, whatever its wind-down takes: a shutdown meanwhile
                // must not turn it into a return that counts no attempt (review helper-105).
                shared.in_flight.decided(delivery);
            }
            // Let the handler see the signal and wind down; then stop it, and wait until its
            // task is really gone (its destructors, such as a command's kill, have run).
            match tokio::time::timeout(CANCEL_GRACE, &mut task.0).await {
                Ok(joined) => joined_result(joined),
                Err(_) => {
                    // The task's own reference, and holds: work winding down that must not be
                    // cut short. Left to end, and its outcome kept.
                    let held = run.strong_count() > 1;
                    if !held {
                        task.0.abort();
                    }
                    let joined = until_ended(
                        async {
                            let joined = (&mut task.0).await;
                            released(&run).await;
                            joined
                        },
                        ctx,
                    )
                    .await;
                    match (held, ctx.cancel_reason(), timeout) {
                        (true, _, _) => joined_result(joined),
                        (false, Some(CancelReason::Timeout), Some(limit)) => Err(timed_out(limit)),
                        (false, _, _) => Err(HandlerFailure::Failed(JobError::new("cancelled"))),
                    }
                }
            }
        }
    };
    // Work of the attempt held past its task (`JobContext::hold`) ends before anything is written;
    // the outcome stands meanwhile, a shutdown's included (review helper-105).
    if run.strong_count() > 0 {
        shared.in_flight.decided(delivery);
        until_ended(released(&run), ctx).await;
    }
    result
}

/// Resolves once no hold of the attempt is left (`JobContext::hold`), the task's own included.
async fn released(run: &Weak<()>) {
    while run.strong_count() > 0 {
        tokio::time::sleep(HOLD_POLL).await;
    }
}

/// Waits for the end of an attempt: its handler's task gone and its holds released. One told to
/// stop and not over within `ABORT_WAIT` blocks its thread (a synchronous call, CPU work not moved
/// to `spawn_blocking`) and cannot be stopped, or holds work still ending: its delivery stays in
/// flight meanwhile, so the heartbeat renews its visibility and permit (those a cancelled job
/// kept included) and no job of its key starts beside it; its outcome, return or give-back waits
/// until it ends (design §95). Warned about, at growing intervals, once told to stop (held work
/// an attempt goes on with after its handler returned is no fault by itself).
async fn until_ended<T>(ended: impl std::future::Future<Output = T>, ctx: &JobContext) -> T {
    let since = Instant::now();
    tokio::pin!(ended);
    let mut wait = ABORT_WAIT;
    loop {
        match tokio::time::timeout(wait, &mut ended).await {
            Ok(joined) => return joined,
            Err(_) if ctx.is_cancelled() => {
                let held = ctx.held.described();
                tracing::warn!(
                    job_id = ctx.job_id.0,
                    reason = %ctx.cancel_reason().map_or_else(|| "none".to_string(), |r| r.to_string()),
                    waited_ms = since.elapsed().as_millis() as u64,
                    held = if held.is_empty() { "nothing named" } else { held.as_str() },
                    "an attempt told to stop has not ended: its handler blocks its thread (run blocking work in \
                     tokio::task::spawn_blocking and check JobContext::is_cancelled), or work it holds \
                     (JobContext::hold, named in `held`) is still ending; its job stays leased, and its outcome \
                     waits, until it ends"
                );
            }
            Err(_) => {}
        }
        wait = (wait * 2).min(MAX_WARN_INTERVAL);
    }
}

/// How often the end of an attempt's holds is looked for.
const HOLD_POLL: Duration = Duration::from_millis(5);

/// The longest interval between two warnings about a handler that will not stop.
const MAX_WARN_INTERVAL: Duration = Duration::from_secs(60);

/// Aborts the handler's task when the executor stops waiting for it.
struct AbortOnDrop(tokio::task::JoinHandle<Result<(), HandlerFailure>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn joined_result(joined: Result<Result<(), HandlerFailure>, tokio::task::JoinError>) -> Result<(), HandlerFailure> {
    match joined {
        Ok(result) => result,
        Err(e) if e.is_panic() => {
            let panic = e.into_panic();
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(HandlerFailure::Failed(JobError::new(format!("handler panicked: {message}"))))
        }
        Err(_) => Err(HandlerFailure::Failed(JobError::new("cancelled"))),
    }
}

/// A failed attempt: its number, how long its handler ran, and where to count it.
struct Attempt<'a> {
    number: u32,
    duration_ms: f64,
    metrics: &'a JobMetrics,
}

/// A failed attempt: retry in place after backoff, or dead-letter after the last attempt.
async fn fail(
    shared: &Shared,
    claim: &Claim,
    delivery: &Delivery,
    policy: &JobPolicy,
    a: Attempt<'_>,
    error: &JobError,
) {
    let (message, attempt, duration_ms) = (error.message(), a.number, a.duration_ms);
    if attempt >= policy.max_attempts {
        tracing::warn!(attempt, error = message, duration_ms, "last attempt failed; dead-lettering");
        let outcome = Outcome::DeadLetter { reason: DeadLetterReason::AttemptsExhausted, error: message };
        let written = finish(shared, claim, delivery, outcome, attempt).await;
        if written {
            a.metrics.dead_lettered.inc();
        }
    } else {
        let delay = policy.backoff.delay(attempt);
        let retry_in_ms = delay.as_millis() as u64;
        tracing::info!(attempt, error = message, duration_ms, retry_in_ms, "attempt failed; retrying");
        let written = finish(shared, claim, delivery, Outcome::Retry { delay, error: message }, attempt).await;
        if written {
            a.metrics.retried.inc();
        }
    }
}

/// What a failed attempt writes.
#[derive(Clone, Copy)]
enum Outcome<'a> {
    Retry { delay: Duration, error: &'a str },
    DeadLetter { reason: DeadLetterReason, error: &'a str },
}

/// Lands a retry or dead-letter statement through blips; true if it was written. A heartbeat
/// racing it cannot push a retry's backoff out: the renewal skips the rows the statement holds
/// and never renews a message the retry marked as waiting.
async fn finish(shared: &Shared, claim: &Claim, delivery: &Delivery, outcome: Outcome<'_>, attempt: u32) -> bool {
    let within = answer_within(&shared.config);
    let result = persist(
        "finish",
        || shared.in_flight.lease_until(delivery),
        || {
            on_pool(&shared.db, within, async |c| match outcome {
                Outcome::Retry { delay, error } => lockgate_sql::retry(Db::idle(c), claim, delay, error, attempt).await,
                Outcome::DeadLetter { reason, error } => {
                    lockgate_sql::dead_letter(Db::idle(c), claim, reason, error, attempt).await
                }
            })
        },
    )
    .await;
    shared.in_flight.remove(delivery);
    match result {
        Ok((true, _)) => return true,
        Ok((false, _)) => {
            tracing::info!("delivery no longer owned; its outcome was not written");
            give_back_if_cancelled(&shared.db, delivery).await;
        }
        Err(error) => tracing::warn!(%error, "outcome not written; the job will run again"),
    }
    false
}

/// A delivery dead-lettered before any handler ran: why, and its job type when its headers
/// told it.
struct Undeliverable<'a> {
    reason: DeadLetterReason,
    error: &'a str,
    job_type: Option<&'a str>,
}

/// How long the worker keeps trying to give back a cancelled job's permit through database blips
/// before leaving it to run out with its lease (the sweep frees it then).
const GIVE_BACK_DEADLINE: Duration = Duration::from_secs(30);
/// How long one attempt of that give-back may go unanswered before it is given up.
const GIVE_BACK_ATTEMPT: Duration = Duration::from_secs(10);

/// A delivery whose handler has ended found its message gone: if its job was cancelled while it
/// ran, the permit it kept until now goes back (`lockgate.release_cancelled`, fenced on this
/// delivery; a no-op otherwise). Retried through blips; on failure the permit waits for its lease
/// to run out.
pub(crate) async fn give_back_if_cancelled(db: &lockgate_sql::PgPool, delivery: &Delivery) {
    let (queue, msg_id, read_ct) = (delivery.queue.as_str(), delivery.msg_id, delivery.read_ct);
    let deadline = Instant::now() + GIVE_BACK_DEADLINE;
    match persist(
        "release_cancelled",
        || Some(deadline),
        || {
            on_pool(db, GIVE_BACK_ATTEMPT, async |c| {
                lockgate_sql::release_cancelled(Db::idle(c), queue, msg_id, read_ct).await
            })
        },
    )
    .await
    {
        Ok((true, _)) => tracing::info!(
            queue,
            msg_id,
            "a cancelled job's handler ended: its permit and while_executing lock are given back"
        ),
        Ok((false, _)) => {}
        Err(error) => tracing::warn!(queue, msg_id, %error, "a cancelled job's permit waits for its lease"),
    }
}

/// Dead-letters a delivery that never reached a handler (it is not in the in-flight set).
async fn dead_letter_now(shared: &Shared, claim: &Claim, claimed_at: Instant, dead: Undeliverable<'_>, attempts: i32) {
    let Undeliverable { reason, error, job_type } = dead;
    tracing::warn!(reason = reason.as_str(), error, "dead-lettering undeliverable message");
    let lease_until = claimed_at + claim.budget;
    let attempts = u32::try_from(attempts).unwrap_or(1);
    let within = answer_within(&shared.config);
    let result = persist(
        "dead_letter",
        || Some(lease_until),
        || {
            on_pool(&shared.db, within, async |c| {
                lockgate_sql::dead_letter(Db::idle(c), claim, reason, error, attempts).await
            })
        },
    )
    .await;
    shared.in_flight.remove(&Delivery { queue: claim.queue.clone(), msg_id: claim.msg_id, read_ct: claim.read_ct });
    match result {
        // Counted under job type "unknown" when its headers did not decode or its type is not defined.
        Ok((true, _)) => {
            shared.metrics.job(claim.queue.as_str(), job_type.unwrap_or("unknown")).dead_lettered.inc();
        }
        Ok((false, _)) => {
            tracing::info!("delivery no longer owned; its dead letter was not written");
            let delivery = Delivery { queue: claim.queue.clone(), msg_id: claim.msg_id, read_ct: claim.read_ct };
            give_back_if_cancelled(&shared.db, &delivery).await;
        }
        Err(error) => tracing::warn!(%error, "dead-letter not written; the message will be delivered again"),
    }
}
