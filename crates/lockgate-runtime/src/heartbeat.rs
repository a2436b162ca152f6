//! The heartbeat: one task per process that, every `heartbeat_interval`, renews the visibility
//! and leases of every delivery the process holds — one fenced statement per queue per tick
//! (G6). A delivery the statement does not return has lost its lease: its handler's cancellation
//! fires and it can write nothing more. A delivery it reports busy (another statement held its
//! rows) is neither renewed nor lost, and is asked about again next tick.
//!
//! Isolation (H28): the heartbeat renews on a connection of its own, outside the runtime's pool,
//! and on a thread of its own, outside the caller's tokio runtime (the supervisor runs it in a
//! single-threaded runtime of its own), so neither an exhausted pool nor statements queued on it,
//! nor handlers that block every thread of the caller's runtime, can delay a renewal; the renewal
//! never waits for a row lock; and each renewal has a budget of half an interval on the server
//! (`statement_timeout`) and one interval on this side. A renewal that has not answered by then
//! (the server is gone, or the network silently dropped it) is abandoned with its connection,
//! and the next tick starts on a fresh one. Even a heartbeat stuck in a hung TCP call cannot let
//! a handler outlive its lease: the pool's watchdog fences on the budgets alone (H27).
//!
//! Jobs claimed ahead are renewed only while the caller's runtime, which would start them, is
//! answering: each tick sends it a probe task, and a tick that finds the last one not run (every
//! thread of that runtime blocked for a whole interval) leaves them to lapse, with a warning, so
//! that other workers take them rather than wait for the stall to end. Once their budget is short,
//! the pool no longer starts them either (H32). A probe cancelled rather than run says that
//! runtime has shut down, and its tasks with it, but not a handler's task that blocks a thread,
//! which runs on past the shutdown (review helper-102): the heartbeat then tells every handler to
//! stop, fences them itself, renews the jobs whose handler task still exists, and stops once the
//! last has ended. Work a handler handed to another task or to `spawn_blocking` outlives its task
//! unseen, unless it holds the attempt (`JobContext::hold`): told to stop, it must stop by itself
//! (review helper-103).
//!
//! A cancelled job's message is gone, but a handler that has not stopped yet (one blocking its
//! thread, or work it holds) keeps what the cancel kept for it: each tick renews that permit lease
//! and while_executing lock (`lockgate.extend_cancelled`) until the handler has ended and its
//! executor gives them back (design §95).

use std::collections::HashSet;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockgate_core::QueueName;
use lockgate_sql::{DbError, PgPool, Renewal};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgConnection};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::in_flight::{Delivery, InFlight, Renew};
use crate::metrics::Metrics;
use crate::worker::executor::give_back_if_cancelled;

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeartbeatReport {
    pub renewed: usize,
    /// Skipped because another statement held their rows; asked again next tick.
    pub busy: usize,
    /// Lost for any reason but a cancel: a lapsed lease, a newer delivery.
    pub lost: usize,
    /// Lost because their job was cancelled (not counted in `lost`).
    pub cancelled: usize,
    pub failed_queues: usize,
}

/// The deliveries asked about that a renewal neither renewed nor found busy.
fn lost_among(asked: &[(i64, i32)], renewal: &Renewal) -> Vec<(i64, i32)> {
    let answered: HashSet<i64> =
        renewal.renewed.iter().map(|(id, _)| *id).chain(renewal.busy.iter().copied()).collect();
    asked.iter().copied().filter(|(id, _)| !answered.contains(id)).collect()
}

/// Why one renewal statement did not answer.
#[derive(Debug, thiserror::Error)]
enum RenewError {
    #[error("no answer within {0:?}; the connection is dropped")]
    NoAnswer(Duration),
    #[error(transparent)]
    Database(#[from] DbError),
}

/// The runtime's pool and the caller's runtime, which the pool's connections belong to: the
/// permits of cancelled jobs are given back there, in tasks of their own, since that may wait for
/// a key's row lock and a renewal never waits (H28); and the probe that tells whether that
/// runtime is answering runs there.
#[derive(Clone)]
pub(crate) struct GiveBack {
    pub db: PgPool,
    pub main: Handle,
}

pub struct Heartbeat {
    /// The heartbeat's own connection's options, with its statement budget.
    connect: PgConnectOptions,
    conn: Option<PgConnection>,
    /// Where the permits of cancelled jobs are given back.
    give_back: GiveBack,
    sets: Vec<Arc<InFlight>>,
    interval: Duration,
    visibility: Duration,
    /// This process's registry id: renewed messages are re-tagged with it (H26).
    owner: Arc<AtomicI64>,
    /// Renewals, lost leases and failed statements are counted here, tick by tick.
    metrics: Arc<Metrics>,
}

impl Heartbeat {
    pub(crate) fn new(
        connect: PgConnectOptions,
        give_back: GiveBack,
        sets: Vec<Arc<InFlight>>,
        interval: Duration,
        visibility: Duration,
        owner: Arc<AtomicI64>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self { connect, conn: None, give_back, sets, interval, visibility, owner, metrics }
    }

    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stalled = false;
        let mut orphaned = false;
        let mut probe: Option<JoinHandle<()>> = None;
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let answering = match probe.take() {
                None => true,
                // Cancelled, not run: the caller's runtime has shut down (without `run` being
                // stopped). Its tasks are gone, but not a handler's task blocking a thread, which
                // runs on past the shutdown: renewed until the last of them ends.
                Some(sent) if sent.is_finished() => {
                    if sent.await.is_err() {
                        orphaned = true;
                        self.outlive_the_runtime(&shutdown);
                    }
                    true
                }
                Some(_) => false,
            };
            let which = if orphaned {
                if !self.sets.iter().any(|set| set.any_handler_alive()) {
                    shutdown.cancel();
                    return;
                }
                Renew::HandlerAlive
            } else {
                probe = Some(self.give_back.main.spawn(async {}));
                if answering {
                    Renew::All
                } else {
                    Renew::Started
                }
            };
            if !answering && !stalled {
                tracing::warn!(
                    interval = ?self.interval,
                    "the runtime's threads ran nothing for a heartbeat interval: a handler may be blocking them \
                     (run blocking work in tokio::task::spawn_blocking); running jobs are still renewed, jobs \
                     claimed ahead are left for other workers"
                );
            }
            stalled = !answering;
            let report = self.run_once(which).await;
            self.metrics.renewals.inc_by(report.renewed as u64);
            self.metrics.leases_lost.inc_by(report.lost as u64);
            self.metrics.renewal_failures.inc_by(report.failed_queues as u64);
            if report.lost > 0 || report.failed_queues > 0 {
                tracing::warn!(
                    renewed = report.renewed,
                    busy = report.busy,
                    lost = report.lost,
                    failed_queues = report.failed_queues,
                    "heartbeat"
                );
            } else if report.busy > 0 || report.cancelled > 0 {
                tracing::debug!(
                    renewed = report.renewed,
                    busy = report.busy,
                    cancelled = report.cancelled,
                    "heartbeat"
                );
            }
        }
    }

    /// The caller's runtime has shut down under a running `run`: as a shutdown does, every
    /// handler is told to stop, and what may still run is fenced from here, the pools' watchdogs
    /// having gone with that runtime (review helper-103).
    fn outlive_the_runtime(&self, shutdown: &CancellationToken) {
        for set in &self.sets {
            set.stop_running();
            tokio::spawn(crate::worker::watchdog(Arc::clone(set), shutdown.clone()));
        }
        tracing::warn!(
            "the tokio runtime running lockgate shut down before lockgate was stopped: its handlers are told \
             to stop, and the jobs of those still running are renewed until they end; stop lockgate through \
             its token first"
        );
    }

    /// One tick, renewing the deliveries `which` says.
    pub(crate) async fn run_once(&mut self, which: Renew) -> HeartbeatReport {
        let mut report = HeartbeatReport::default();
        let owner = Some(self.owner.load(Ordering::SeqCst)).filter(|id| *id != 0);
        let sets = self.sets.clone();
        for set in &sets {
            for (queue, asked) in set.renewable(which) {
                // The new budget counts from before the statement is sent: the database starts
                // it no earlier than this, whatever its clock says (H27).
                let mut sent_at = Instant::now();
                let mut extended = self.extend(&queue, &asked, owner).await;
                // A connection the server or the network reset fails the next statement at once:
                // tried again straight away on a fresh one. Left to the next tick, one reset cost a
                // whole interval, and a lease floored at twice the interval was then fenced: a
                // handler that blocks its thread ran on beside its job's next delivery (review
                // helper-145 F10, F2).
                if matches!(&extended, Err(RenewError::Database(e)) if e.is_transient())
                    && sent_at.elapsed() < self.interval / 2
                {
                    tracing::info!(%queue, "renewal failed on its connection; trying again at once on a fresh one");
                    sent_at = Instant::now();
                    extended = self.extend(&queue, &asked, owner).await;
                }
                match extended {
                    Ok(mut renewal) => {
                        let r = match self.cancelled_among_lost(&queue, &asked, &renewal).await {
                            Some(cancelled) => {
                                renewal.cancelled = cancelled;
                                set.renewed(&queue, &asked, &renewal, sent_at)
                            }
                            None => set.renewed_not_knowing_cancels(&queue, &asked, &renewal, sent_at),
                        };
                        report.renewed += r.renewed;
                        report.busy += r.busy;
                        report.lost += r.lost;
                        report.cancelled += r.cancelled;
                        self.release_cancelled(&queue, &r.cancelled_idle);
                    }
                    Err(error) => {
                        tracing::warn!(%queue, %error, "renewal failed; the next tick tries again");
                        report.failed_queues += 1;
                    }
                }
            }
            // Cancelled jobs whose handler has not stopped keep their permit until it does.
            for (queue, asked) in set.cancelled_running() {
                let visibility = self.visibility;
                let renewal = self
                    .ask(async |conn| {
                        let db = lockgate_sql::pooler::Db::idle(conn);
                        lockgate_sql::extend_cancelled(db, queue.as_str(), &asked, visibility).await
                    })
                    .await;
                match renewal {
                    Ok(held) => report.renewed += set.cancelled_renewed(&queue, &asked, &held),
                    Err(error) => {
                        tracing::warn!(%queue, %error, "renewal of cancelled jobs' permits failed; the next tick tries again");
                        report.failed_queues += 1;
                    }
                }
            }
        }
        report
    }

    /// Of the deliveries a renewal lost (neither renewed nor busy), those whose job was cancelled,
    /// so their handlers learn why, and those still running keep what the cancel kept for them
    /// (design §95). Asked only when some were lost; `None` when the question failed.
    async fn cancelled_among_lost(
        &mut self,
        queue: &QueueName,
        asked: &[(i64, i32)],
        renewal: &Renewal,
    ) -> Option<Vec<i64>> {
        let lost = lost_among(asked, renewal);
        if lost.is_empty() {
            return Some(Vec::new());
        }
        let conn = self.conn.as_mut()?;
        let asked = lockgate_sql::cancelled_messages(lockgate_sql::pooler::Db::idle(&mut *conn), queue.as_str(), &lost);
        match tokio::time::timeout(self.interval, asked).await {
            Ok(Ok(cancelled)) => Some(cancelled),
            Ok(Err(error)) => {
                tracing::warn!(
                    %queue,
                    %error,
                    "could not tell cancelled deliveries from lost ones: their handlers are told their lease is lost, \
                     and what a cancel may have kept for them is renewed"
                );
                if error.is_transient() {
                    self.conn = None;
                }
                None
            }
            Err(_) => {
                tracing::warn!(
                    %queue,
                    "could not tell cancelled deliveries from lost ones in time: their handlers are told their lease \
                     is lost, and what a cancel may have kept for them is renewed"
                );
                self.conn = None;
                None
            }
        }
    }

    /// Gives back the permits of cancelled deliveries that no handler had started, each in a task
    /// of its own on the runtime's pool (in the caller's runtime): each is a statement of its own
    /// (a few milliseconds more when its key's row is held, sql/015_concurrency.sql), and this
    /// tick must not wait for them.
    fn release_cancelled(&self, queue: &QueueName, idle: &[(i64, i32)]) {
        for &(msg_id, read_ct) in idle {
            let (db, delivery) = (self.give_back.db.clone(), Delivery { queue: queue.clone(), msg_id, read_ct });
            self.give_back.main.spawn(async move { give_back_if_cancelled(&db, &delivery).await });
        }
    }

    /// One renewal on the heartbeat's connection.
    async fn extend(
        &mut self,
        queue: &QueueName,
        asked: &[(i64, i32)],
        owner: Option<i64>,
    ) -> Result<Renewal, RenewError> {
        let visibility = self.visibility;
        self.ask(async |conn| {
            lockgate_sql::extend(lockgate_sql::pooler::Db::idle(conn), queue, asked, visibility, owner).await
        })
        .await
    }

    /// One statement on the heartbeat's connection (opened first if there is none), answered
    /// within one interval or abandoned with its connection.
    async fn ask<T>(
        &mut self,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, DbError>,
    ) -> Result<T, RenewError> {
        let (connect, conn) = (&self.connect, &mut self.conn);
        let answered = tokio::time::timeout(self.interval, async {
            let conn = match conn {
                Some(conn) => conn,
                None => conn.insert(connect.connect().await.map_err(DbError::from)?),
            };
            statement(conn).await
        })
        .await;
        match answered {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(error)) => {
                // A broken connection is replaced; a statement error (an unknown queue, say)
                // leaves it usable for the other queues.
                if error.is_transient() {
                    self.conn = None;
                }
                Err(error.into())
            }
            Err(_) => {
                self.conn = None;
                Err(RenewError::NoAnswer(self.interval))
            }
        }
    }
}
