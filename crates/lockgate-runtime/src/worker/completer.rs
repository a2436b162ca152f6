//! The completer: one task per worker pool that archives finished deliveries in batches. Every
//! request waiting when a batch starts joins it (one statement per queue), and each delivery
//! still gets its own fenced outcome: `Archived` if this statement archived it, otherwise
//! `AlreadyArchived`, or `Ambiguous` when an earlier try of the same batch broke mid-commit (H13).
//!
//! The same statements record the start of deliveries claimed ahead (H32): an executor hands
//! the start over as its handler begins, and the first statement after it is 5 ms old carries
//! it, so while jobs finish a start costs no commit of its own, and a job done sooner none at all.
//!
//! Executors hand a finished delivery over and go: their concurrency slot is free for the next
//! job while the completion is written. The delivery stays in the in-flight set (renewed by the
//! heartbeat) until its statement lands. The channel is bounded, so a slow database pushes back
//! on the executors instead of letting finished work pile up without limit.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use lockgate_core::{ArchiveOutcome, QueueName};
use lockgate_sql::PgPool;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, Mutex};
use tokio::task::JoinSet;

use std::time::{Duration, Instant};

use super::executor::give_back_if_cancelled;
use super::persist::{persist, PersistError};
use crate::held::{on_pool, HeldConnection};
use crate::in_flight::{Delivery, InFlight};
use crate::metrics::JobMetrics;

/// At most this many deliveries per statement: large enough to amortise a commit over a full
/// batch of claims, small enough to keep one statement's locks short.
const MAX_BATCH: usize = 256;

/// How old a start is before it is recorded (on the next completion statement, or one of its own):
/// a job that finishes sooner is archived before its start would be written, and needs none.
const START_RECORD_WAIT: std::time::Duration = std::time::Duration::from_millis(5);

/// Statements in flight at most (see `Completer::run`).
const MAX_STATEMENTS: usize = 2;

/// The delivery's outcome, or why it could not be written (its lease ended first, or the
/// statement failed permanently); the job then runs again after its visibility lapses.
pub type Completion = Result<ArchiveOutcome, String>;

/// Finished deliveries that may wait for the completer before executors must wait: two full
/// batches, so one batch can be collected while the previous one commits.
const QUEUE_CAPACITY: usize = 2 * MAX_BATCH;

/// What the completer needs to count and log a job once its archive lands.
pub(crate) struct Finished {
    pub job_id: lockgate_core::JobId,
    pub attempt: u32,
    /// The handler's run time (zero for a discarded duplicate, which never ran).
    pub duration: Duration,
    /// A duplicate archived without running (counted as discarded, not succeeded).
    pub discarded: bool,
    pub metrics: Arc<JobMetrics>,
}

impl Finished {
    /// Counts and logs a delivery this statement archived.
    fn archived(&self, queue: &QueueName, msg_id: i64) {
        let duration_ms = self.duration.as_secs_f64() * 1000.0;
        let (job_id, job_type, attempt) = (self.job_id, self.metrics.job_type.as_str(), self.attempt);
        if self.discarded {
            self.metrics.discarded.inc();
            tracing::info!(%queue, msg_id, job_id = job_id.0, job_type, attempt, "duplicate discarded");
        } else {
            self.metrics.succeeded.inc();
            tracing::info!(%queue, msg_id, job_id = job_id.0, job_type, attempt, duration_ms, "job succeeded");
        }
    }
}

enum Request {
    /// A finished delivery, to archive.
    Complete { delivery: Delivery, finished: Finished },
    /// A delivery claimed ahead whose handler has started, to record.
    Started(Delivery),
}

impl Request {
    fn delivery(&self) -> &Delivery {
        match self {
            Request::Complete { delivery, .. } | Request::Started(delivery) => delivery,
        }
    }
}

/// The executors' handle on the completer. The completer stops when every handle is dropped.
#[derive(Clone)]
pub(crate) struct CompleterHandle {
    tx: mpsc::Sender<Request>,
}

impl CompleterHandle {
    /// Hands a finished delivery over; waits only while the completer's queue is full.
    pub async fn submit(&self, delivery: Delivery, finished: Finished) {
        let job_id = finished.job_id;
        if self.tx.send(Request::Complete { delivery, finished }).await.is_err() {
            tracing::warn!(
                job_id = job_id.0,
                "the completer has stopped; the job will run again after its visibility lapses"
            );
        }
    }

    /// Hands over the start of a delivery claimed ahead, to be recorded once it is
    /// `START_RECORD_WAIT` old unless its completion comes first.
    pub async fn record_start(&self, delivery: Delivery) {
        if self.tx.send(Request::Started(delivery)).await.is_err() {
            tracing::warn!("the completer has stopped; a job's start is not recorded");
        }
    }
}

pub(crate) struct Completer {
    db: PgPool,
    in_flight: Arc<InFlight>,
    rx: mpsc::Receiver<Request>,
    /// How long a completion statement may go unanswered before its connection is given up.
    answer_within: Duration,
}

impl Completer {
    pub fn new(db: PgPool, in_flight: Arc<InFlight>, answer_within: Duration) -> (Self, CompleterHandle) {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        (Self { db, in_flight, rx, answer_within }, CompleterHandle { tx })
    }

    /// Runs until every handle is dropped and the last request is answered.
    ///
    /// One statement is in flight while the completer keeps up. A second one starts only with a
    /// full batch waiting, that is when the database is the bottleneck (long statements, such as
    /// completions that promote parked jobs of many keys); a partial batch waits for the
    /// statement in flight, so batches stay large. Two statements never deadlock: each locks
    /// its own messages and leases, and semaphore rows in key order.
    ///
    /// A start to record rides on the first statement after it is `START_RECORD_WAIT` old, or
    /// gets one of its own then: a job that finishes sooner needs no record at all (its
    /// completion archives the run), so fast jobs cost nothing extra.
    pub async fn run(mut self) {
        let mut pending = Pending::default();
        let mut statements = JoinSet::new();
        // The connections of finished statements, kept for the next ones.
        let mut idle: Vec<HeldConnection> = Vec::new();
        let mut open = true;
        loop {
            while open && pending.finished.len() < MAX_BATCH {
                match self.rx.try_recv() {
                    Ok(request) => pending.push(request),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            let full = pending.finished.len() >= MAX_BATCH && statements.len() < MAX_STATEMENTS;
            let starts_due = pending.next_start_due(open).is_some_and(|due| due <= Instant::now());
            if (!pending.finished.is_empty() || starts_due) && (statements.is_empty() || full) {
                let batch = pending.take(open);
                let conn = idle.pop().unwrap_or_else(|| HeldConnection::new(self.db.clone(), self.answer_within));
                statements.spawn(complete_batch(conn, Arc::clone(&self.in_flight), batch));
                continue;
            }
            if !open && pending.finished.is_empty() && pending.starts.is_empty() && statements.is_empty() {
                return;
            }
            let starts_wait = pending.next_start_due(open).map(tokio::time::Instant::from_std);
            tokio::select! {
                request = self.rx.recv(), if open && pending.finished.len() < MAX_BATCH => match request {
                    Some(request) => pending.push(request),
                    None => open = false,
                },
                Some(joined) = statements.join_next(), if !statements.is_empty() => idle.extend(joined.ok()),
                () = tokio::time::sleep_until(starts_wait.unwrap_or_else(tokio::time::Instant::now)),
                    if starts_wait.is_some() && statements.is_empty() => {}
            }
        }
    }
}

/// The requests waiting for the next statement.
#[derive(Default)]
struct Pending {
    /// Completions.
    finished: Vec<Request>,
    /// Starts to record, oldest first, with when each arrived.
    starts: Vec<(Delivery, Instant)>,
}

impl Pending {
    fn push(&mut self, request: Request) {
        match request {
            Request::Complete { .. } => self.finished.push(request),
            Request::Started(delivery) => self.starts.push((delivery, Instant::now())),
        }
    }

    /// When the oldest start waiting is due (at once while closing).
    fn next_start_due(&self, open: bool) -> Option<Instant> {
        let (_, at) = self.starts.first()?;
        Some(if open { *at + START_RECORD_WAIT } else { *at })
    }

    /// Every completion, and the starts that are due. A start whose completion goes in this
    /// batch is dropped for good: the run is being archived.
    fn take(&mut self, open: bool) -> Vec<Request> {
        let mut batch = std::mem::take(&mut self.finished);
        // Keyed on the queue too: one completer serves every queue of its pool, and queues that
        // PGMQ created before lockgate adopted them may share msg_ids.
        let done: HashSet<Delivery> = batch.iter().map(|r| r.delivery().clone()).collect();
        self.starts.retain(|(d, _)| !done.contains(d));
        let now = Instant::now();
        let due = self.starts.partition_point(|(_, at)| !open || now.duration_since(*at) >= START_RECORD_WAIT);
        batch.extend(self.starts.drain(..due).map(|(d, _)| Request::Started(d)));
        batch
    }
}

/// Completes one batch, a statement per queue in it, on `conn`; gives the connection back.
async fn complete_batch(conn: HeldConnection, in_flight: Arc<InFlight>, batch: Vec<Request>) -> HeldConnection {
    let mut by_queue: HashMap<QueueName, Vec<Request>> = HashMap::new();
    for request in batch {
        by_queue.entry(request.delivery().queue.clone()).or_default().push(request);
    }
    // Behind a Mutex because `persist` may run its attempt more than once: each attempt's future
    // borrows the connection anew. (An async closure borrowing it mutably would do, but rustc
    // cannot yet prove such a future `Send` for the spawned task.)
    let conn = Mutex::new(conn);
    for (queue, requests) in by_queue {
        complete_queue(&conn, &in_flight, &queue, requests).await;
    }
    conn.into_inner()
}

async fn complete_queue(conn: &Mutex<HeldConnection>, in_flight: &InFlight, queue: &QueueName, requests: Vec<Request>) {
    let mut finished = Vec::new();
    let mut starting = Vec::new();
    for request in requests {
        match request {
            Request::Complete { delivery, finished: f } => finished.push((delivery, f)),
            Request::Started(delivery) => starting.push(delivery),
        }
    }
    // (A start whose completion is in this batch was already left out by `Pending::take`.)
    let deliveries: Vec<(i64, i32)> = finished.iter().map(|(d, _)| (d.msg_id, d.read_ct)).collect();
    let started: Vec<(i64, i32)> = starting.iter().map(|d| (d.msg_id, d.read_ct)).collect();
    // The batch's lease is as long as its shortest member's (starts alone: theirs).
    let lease_until = || {
        let completing = finished.iter().map(|(d, _)| d);
        let members: Vec<&Delivery> =
            if finished.is_empty() { starting.iter().collect() } else { completing.collect() };
        members.into_iter().map(|d| in_flight.lease_until(d)).min().flatten()
    };
    // A heartbeat racing this statement skips the rows it holds, and one that finds a delivery
    // gone after it committed does not report it lost (it is finishing): no lock between them
    // (H28).
    let result = persist("complete", lease_until, || async {
        conn.lock()
            .await
            .run(async |c| {
                lockgate_sql::complete(lockgate_sql::pooler::Db::idle(c), queue, &deliveries, &started).await
            })
            .await
    })
    .await;
    if let (Err(error), false) = (&result, started.is_empty()) {
        tracing::warn!(%queue, %error, started = started.len(), "could not record that claimed-ahead jobs started");
    }
    let outcomes = outcomes(&deliveries, result);
    for ((delivery, f), outcome) in finished.into_iter().zip(outcomes) {
        in_flight.remove(&delivery);
        let (queue, msg_id) = (&delivery.queue, delivery.msg_id);
        let (job_id, job_type, attempt) = (f.job_id, f.metrics.job_type.as_str(), f.attempt);
        match outcome {
            Ok(ArchiveOutcome::Archived) => f.archived(queue, msg_id),
            Ok(outcome) => {
                tracing::info!(%queue, msg_id, job_id = job_id.0, job_type, attempt, %outcome, "completion changed nothing");
                // Its job may have been cancelled while the handler ran: the permit it kept goes
                // back, in a task of its own (a statement of its own, which this batch's
                // other outcomes need not wait for).
                let db = conn.lock().await.pool().clone();
                tokio::spawn(async move { give_back_if_cancelled(&db, &delivery).await });
            }
            Err(error) => tracing::warn!(
                %queue,
                msg_id,
                job_id = job_id.0,
                job_type,
                attempt,
                %error,
                "completion not written; the job will run again"
            ),
        }
    }
}

/// Completes deliveries of one queue in one fenced statement, retrying blips until `deadline`,
/// and reports each delivery's own outcome, in input order. The completer's path, without its
/// batching; exposed for tools and fault-injection tests.
pub async fn complete_deliveries(
    db: &PgPool,
    queue: &QueueName,
    deliveries: &[(i64, i32)],
    deadline: Instant,
) -> Vec<Completion> {
    let within = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
    let result = persist(
        "complete",
        || Some(deadline),
        || {
            on_pool(db, within, async |c| {
                lockgate_sql::complete(lockgate_sql::pooler::Db::idle(c), queue, deliveries, &[]).await
            })
        },
    )
    .await;
    outcomes(deliveries, result)
}

/// Maps the archived msg_ids to per-delivery outcomes: archived by this statement, or not — and
/// then `Ambiguous` if an earlier try may have committed, else `AlreadyArchived`.
fn outcomes(deliveries: &[(i64, i32)], result: Result<(Vec<i64>, bool), PersistError>) -> Vec<Completion> {
    match result {
        Ok((archived, failed_before)) => {
            let archived: HashSet<i64> = archived.into_iter().collect();
            deliveries
                .iter()
                .map(|(msg_id, _)| {
                    Ok(match (archived.contains(msg_id), failed_before) {
                        (true, _) => ArchiveOutcome::Archived,
                        (false, true) => ArchiveOutcome::Ambiguous,
                        (false, false) => ArchiveOutcome::AlreadyArchived,
                    })
                })
                .collect()
        }
        Err(error) => deliveries.iter().map(|_| Err(error.to_string())).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(queue: &str, msg_id: i64) -> Delivery {
        Delivery { queue: QueueName::new(queue).unwrap(), msg_id, read_ct: 1 }
    }

    #[test]
    fn a_start_is_dropped_only_for_its_own_completion_and_never_for_another_queues() {
        let mut pending = Pending::default();
        pending.push(Request::Started(delivery("qa", 1)));
        pending.push(Request::Started(delivery("qb", 1)));
        let finished = Finished {
            job_id: lockgate_core::JobId(1),
            attempt: 1,
            duration: Duration::ZERO,
            discarded: false,
            metrics: crate::Metrics::new().job("qa", "t"),
        };
        pending.push(Request::Complete { delivery: delivery("qa", 1), finished });
        // Closing: every start is due at once.
        let batch = pending.take(false);
        let starts: Vec<&Delivery> =
            batch.iter().filter(|r| matches!(r, Request::Started(_))).map(Request::delivery).collect();
        assert_eq!(starts, vec![&delivery("qb", 1)], "qa's start goes with its completion; qb's is still written");
        assert!(pending.starts.is_empty());
    }
}
