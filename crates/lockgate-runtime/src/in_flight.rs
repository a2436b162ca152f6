//! The in-flight set of one worker pool: every delivery it is running or finishing, with the
//! context whose cancellation signal reaches the handler, and until when its budget is known to
//! hold in the database.
//!
//! Ownership: entries are inserted by the fetch loop when a delivery is claimed, renewed (or
//! marked lost) by the heartbeat, fenced by the pool's watchdog, moved through shutdown's states
//! by the pool and the executor, and removed by whoever lands the delivery's final statement
//! (completer, retry, dead-letter, release) or gives it up.
//!
//! No lock orders the final statements against the heartbeat any more (H28: a completion
//! blocked on a producer's row lock had held the old gate and stalled every renewal). The
//! database keeps them apart instead: the renewal skips rows another statement holds (`busy`)
//! and never renews a message a retry or a return marked as waiting, and a delivery whose final
//! statement is on its way is not reported lost when its row disappears (`renewed`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use lockgate_core::{JobId, QueueName};
use lockgate_sql::Renewal;

use crate::{CancelReason, JobContext};

/// How often the pool's watchdog looks for deliveries whose budget is running out (H27).
pub(crate) const FENCE_TICK: Duration = Duration::from_millis(50);

/// How long a cancelled handler may take to return on its own before its task is aborted: enough
/// to close a file, roll back a transaction or kill a command's process group, short enough not
/// to delay a shutdown's return of jobs.
pub(crate) const CANCEL_GRACE: Duration = Duration::from_millis(100);

/// How long an aborted handler task takes to be dropped, at most, unless it blocks its thread. One
/// that is not gone by then never yields: nothing can stop it, so it is waited for, its delivery
/// still leased, and warned about (design §95).
pub(crate) const ABORT_WAIT: Duration = Duration::from_millis(100);

/// How long before its budget runs out a running delivery's handler is cancelled (H27): the
/// watchdog may notice up to one tick late, the handler then has its grace and the abort its
/// wait, and 50 ms cover a busy scheduler. The budget is counted on this process's monotonic
/// clock from before the claim or renewal was sent, so the handler has ended before the database
/// can consider the lease over, whatever the two hosts' wall clocks say.
pub(crate) const FENCE_MARGIN: Duration =
    Duration::from_millis((FENCE_TICK.as_millis() + CANCEL_GRACE.as_millis() + ABORT_WAIT.as_millis() + 50) as u64);

/// A delivery's fencing token.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Delivery {
    pub queue: QueueName,
    pub msg_id: i64,
    pub read_ct: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Claimed ahead, waiting for a free handler slot; its handler has not started.
    Waiting,
    Running,
    /// Its outcome is decided (the handler returned, or its timeout passed), but the attempt has
    /// not ended: its handler's task blocks on, or work it holds (`JobContext::hold`) is still
    /// running. Renewed and fenced as a running one; shutdown tells it to stop but leaves its
    /// outcome to be written once it has ended (review helper-105).
    Decided,
    /// The handler returned; the final statement is on its way. Still renewed by the heartbeat.
    Finishing,
    /// Shutdown cancelled the handler; the pool returns the delivery once the handler has ended
    /// (H30). Still renewed meanwhile, so the job keeps its visibility and permit.
    Stopping,
    /// No handler runs for it any more (it ended after shutdown's cancellation, or never
    /// started): shutdown returns it to its queue.
    Stopped,
    /// The release statement is on its way.
    Returning,
    /// Its job was cancelled while its handler ran (or may have been: the heartbeat could not
    /// tell), and the handler has not ended yet: the message is gone, but the permit lease and
    /// while_executing lock it kept are renewed (`lockgate.extend_cancelled`) until the handler
    /// ends and its executor gives them back, so that no job of its key starts beside a handler
    /// that will not stop (design §95).
    Cancelled,
    /// Fenced by the watchdog (its budget was about to run out before a renewal landed): its
    /// handler is told to stop, and it may write nothing more, as a lost one. While its handler's
    /// task still exists (a handler that blocks its thread cannot be stopped), the heartbeat goes
    /// on asking to renew it: the database renews it only while its lease still holds there, so
    /// a renewal that was late but not too late keeps the key's permit for the handler that runs
    /// on, instead of letting it lapse beside it (review helper-145 F2).
    Fenced,
    /// Lost (the heartbeat found it owned by nobody or by a newer delivery): it may write nothing
    /// more.
    Lost,
}

struct Entry {
    read_ct: i32,
    state: State,
    /// Set when the executor takes the delivery over; `None` while it waits for a slot.
    ctx: Option<JobContext>,
    /// Until when this delivery's visibility (and lease) is known to hold in the database:
    /// the instant before its claim or last renewal was sent, plus the budget it returned.
    lease_until: Instant,
    /// Alive while the handler's task exists (the executor's `Arc` moves into it): a task that
    /// blocks its thread outlives the tokio runtime's shutdown, and the heartbeat renews for it
    /// until it ends (heartbeat.rs).
    handler: Weak<()>,
}

/// Which deliveries a heartbeat tick renews.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renew {
    /// Every one not lost.
    All,
    /// Not those claimed ahead: the caller's runtime, which would start them, is stalled.
    Started,
    /// Only those whose handler's task still exists: the caller's runtime has shut down.
    HandlerAlive,
}

/// Whether a claimed delivery may start its handler (`InFlight::start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// It is still owned with enough budget left: its handler runs.
    Run,
    /// Lost: forgotten, its visibility lapses. Its job may have been cancelled meanwhile, so the
    /// permit it kept goes back (`give_back_if_cancelled`).
    Lost,
    /// Still owned, with too little budget left to start a handler that could be stopped in
    /// time (H27): forgotten here, and returned to its queue unstarted, so that the delivery
    /// counts as no attempt (H32).
    Late,
    /// Shutdown is returning it, or it is no longer this set's.
    Refused,
}

/// Why a handler's outcome may not be written (`InFlight::begin_finishing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// The delivery is still owned: write its outcome.
    Write,
    /// Its lease is lost or fenced; the entry is forgotten.
    Lost,
    /// Shutdown is returning it; tell the pool whether the handler ended (`stopped`).
    Shutdown,
}

/// What one renewal did to the deliveries it asked about (`InFlight::renewed`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Renewed {
    pub renewed: usize,
    pub busy: usize,
    /// Lost for any reason but a cancel.
    pub lost: usize,
    /// Lost because their job was cancelled.
    pub cancelled: usize,
    /// Cancelled deliveries no handler had started: nothing runs for them, so their permits can
    /// be given back at once (`lockgate.release_cancelled`), as (msg_id, read_ct).
    pub cancelled_idle: Vec<(i64, i32)>,
}

/// A delivery the watchdog cancelled, for its log line.
pub(crate) struct Fenced {
    pub delivery: Delivery,
    pub job_id: Option<JobId>,
    pub overdue_by: Duration,
}

#[derive(Default)]
pub(crate) struct InFlight {
    entries: Mutex<HashMap<(QueueName, i64), Entry>>,
}

impl InFlight {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<(QueueName, i64), Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a claimed delivery, waiting for a handler slot (heartbeat renews it already). An
    /// earlier delivery of the same message that this process still runs is stale now (the
    /// message was returned and claimed again behind its back, by a return called by hand with
    /// its token, say): its handler is cancelled as a lost lease's is, never left running beside
    /// the new one unfenced (review helper-83; the entry it had is replaced).
    pub fn insert_waiting(&self, d: &Delivery, lease_until: Instant) {
        let entry = Entry { read_ct: d.read_ct, state: State::Waiting, ctx: None, lease_until, handler: Weak::new() };
        if let Some(old) = self.entries().insert((d.queue.clone(), d.msg_id), entry) {
            if let Some(ctx) = old.ctx.filter(|_| old.read_ct != d.read_ct) {
                tracing::warn!(
                    job_id = ctx.job_id.0,
                    "a running delivery's message was claimed again: its handler is cancelled"
                );
                ctx.fire(CancelReason::LeaseLost);
            }
        }
    }

    /// Waiting → Running, when the executor takes the delivery over with its handler's context.
    /// Not when shutdown returned it, its lease was lost, or its budget is too short to start a
    /// handler that could still be stopped in time (H27); a lost or expiring one is forgotten
    /// (its visibility lapses and it is delivered again).
    pub fn start(&self, d: &Delivery, ctx: JobContext, now: Instant) -> Start {
        let mut entries = self.entries();
        let key = (d.queue.clone(), d.msg_id);
        match entries.get_mut(&key) {
            Some(e) if e.read_ct == d.read_ct && e.state == State::Waiting && now + FENCE_MARGIN < e.lease_until => {
                e.state = State::Running;
                ctx.lease.send_replace(e.lease_until);
                e.ctx = Some(ctx);
                Start::Run
            }
            Some(e) if e.read_ct == d.read_ct && e.state == State::Waiting => {
                entries.remove(&key);
                Start::Late
            }
            Some(e) if e.read_ct == d.read_ct && e.state == State::Lost => {
                entries.remove(&key);
                Start::Lost
            }
            _ => Start::Refused,
        }
    }

    pub fn len(&self) -> usize {
        self.entries().len()
    }

    /// Running → Finishing when the delivery is still owned. A lost one is forgotten here (no one
    /// else will); one that shutdown is returning is left to it.
    pub fn begin_finishing(&self, d: &Delivery) -> Finish {
        let mut entries = self.entries();
        let key = (d.queue.clone(), d.msg_id);
        match entries.get_mut(&key) {
            Some(e) if e.read_ct == d.read_ct && matches!(e.state, State::Running | State::Decided) => {
                e.state = State::Finishing;
                Finish::Write
            }
            Some(e) if e.read_ct == d.read_ct && e.state == State::Stopping => Finish::Shutdown,
            Some(e) if e.read_ct == d.read_ct && matches!(e.state, State::Lost | State::Fenced | State::Cancelled) => {
                entries.remove(&key);
                Finish::Lost
            }
            _ => Finish::Lost,
        }
    }

    /// Shutdown's cancelled handler has ended (however long that took: until then its delivery
    /// is renewed, H30): the pool returns the delivery.
    pub fn stopped(&self, d: &Delivery) {
        if let Some(e) = self.entries().get_mut(&(d.queue.clone(), d.msg_id)) {
            if e.read_ct == d.read_ct && e.state == State::Stopping {
                e.state = State::Stopped;
            }
        }
    }

    pub fn remove(&self, d: &Delivery) {
        let mut entries = self.entries();
        if entries.get(&(d.queue.clone(), d.msg_id)).is_some_and(|e| e.read_ct == d.read_ct) {
            entries.remove(&(d.queue.clone(), d.msg_id));
        }
    }

    /// Until when the delivery's lease is known to hold; `None` once it is gone, lost, fenced or
    /// cancelled.
    pub fn lease_until(&self, d: &Delivery) -> Option<Instant> {
        let entries = self.entries();
        let e = entries.get(&(d.queue.clone(), d.msg_id))?;
        (e.read_ct == d.read_ct && !matches!(e.state, State::Lost | State::Fenced | State::Cancelled))
            .then_some(e.lease_until)
    }

    /// The running delivery's handler task is starting: `run` lives in that task (and in the
    /// attempt's holds, `JobContext::hold`), and says, while it exists, that the handler does
    /// (`Renew::HandlerAlive`).
    pub fn handler_started(&self, d: &Delivery, run: &Arc<()>) {
        if let Some(e) = self.entries().get_mut(&(d.queue.clone(), d.msg_id)).filter(|e| e.read_ct == d.read_ct) {
            e.handler = Arc::downgrade(run);
        }
    }

    /// Whether any handler task of this set still exists for a delivery not lost (a lost one has
    /// nothing more to renew; a fenced one may still have).
    pub fn any_handler_alive(&self) -> bool {
        self.entries().values().any(|e| e.state != State::Lost && e.handler.strong_count() > 0)
    }

    /// Deliveries the heartbeat should renew, by queue (see `Renew`).
    pub fn renewable(&self, which: Renew) -> HashMap<QueueName, Vec<(i64, i32)>> {
        let mut out: HashMap<QueueName, Vec<(i64, i32)>> = HashMap::new();
        for ((queue, msg_id), e) in self.entries().iter() {
            let alive = e.handler.strong_count() > 0;
            let wanted = match which {
                Renew::All => true,
                Renew::Started => e.state != State::Waiting,
                Renew::HandlerAlive => alive,
            };
            let asked = match e.state {
                State::Lost | State::Cancelled => false,
                State::Fenced => alive,
                _ => true,
            };
            if asked && wanted {
                out.entry(queue.clone()).or_default().push((*msg_id, e.read_ct));
            }
        }
        out
    }

    /// Cancelled deliveries whose handler task still exists, by queue: what they kept is renewed
    /// for them (`lockgate.extend_cancelled`) in every mode of the heartbeat.
    pub fn cancelled_running(&self) -> HashMap<QueueName, Vec<(i64, i32)>> {
        let mut out: HashMap<QueueName, Vec<(i64, i32)>> = HashMap::new();
        for ((queue, msg_id), e) in self.entries().iter() {
            if e.state == State::Cancelled && e.handler.strong_count() > 0 {
                out.entry(queue.clone()).or_default().push((*msg_id, e.read_ct));
            }
        }
        out
    }

    /// Records a renewal of cancelled deliveries (`cancelled_running`): those that hold nothing
    /// any more (`held` lists the others) are lost, and asked about no more. Returns how many
    /// were renewed.
    pub fn cancelled_renewed(&self, queue: &QueueName, asked: &[(i64, i32)], held: &[(i64, bool)]) -> usize {
        let held: HashMap<i64, bool> = held.iter().copied().collect();
        let mut entries = self.entries();
        for (msg_id, read_ct) in asked {
            if let Some(e) = entries.get_mut(&(queue.clone(), *msg_id)) {
                if e.read_ct == *read_ct && e.state == State::Cancelled && !held.contains_key(msg_id) {
                    e.state = State::Lost;
                }
            }
        }
        held.values().filter(|busy| !**busy).count()
    }

    /// Records a renewal of one queue's deliveries, sent at `sent_at`: renewed ones get a new
    /// lease end; busy ones keep theirs (another statement held their rows; asked again next
    /// tick); the rest lost their lease, and their handlers are cancelled. A delivery whose final
    /// statement is on its way (finishing or returning) and is missing was most likely settled
    /// by that very statement: it is neither counted nor reported as lost, and its statement's
    /// own fence decides.
    pub fn renewed(&self, queue: &QueueName, asked: &[(i64, i32)], renewal: &Renewal, sent_at: Instant) -> Renewed {
        self.record_renewal(queue, asked, renewal, sent_at, false)
    }

    /// As `renewed`, when the heartbeat could not tell which of the lost deliveries were
    /// cancelled (the question about them failed): their handlers are told they lost their lease,
    /// and each one still running keeps what a cancel may have kept for it (`Cancelled`, renewed
    /// through `extend_cancelled`, which renews nothing for a job that was not cancelled). Taken
    /// for lost leases, a cancelled job's permit was dropped while its handler ran on (review
    /// helper-105); taken for busy, a lease really lost ran on to its budget (review helper-107).
    pub fn renewed_not_knowing_cancels(
        &self,
        queue: &QueueName,
        asked: &[(i64, i32)],
        renewal: &Renewal,
        sent_at: Instant,
    ) -> Renewed {
        self.record_renewal(queue, asked, renewal, sent_at, true)
    }

    fn record_renewal(
        &self,
        queue: &QueueName,
        asked: &[(i64, i32)],
        renewal: &Renewal,
        sent_at: Instant,
        unsure: bool,
    ) -> Renewed {
        let budgets: HashMap<i64, Duration> = renewal.renewed.iter().copied().collect();
        let busy: HashSet<i64> = renewal.busy.iter().copied().collect();
        let cancelled: HashSet<i64> = renewal.cancelled.iter().copied().collect();
        let mut report = Renewed::default();
        let mut entries = self.entries();
        for (msg_id, read_ct) in asked {
            let Some(e) = entries.get_mut(&(queue.clone(), *msg_id)) else {
                continue;
            };
            if e.read_ct != *read_ct {
                continue;
            }
            if let Some(budget) = budgets.get(msg_id) {
                // Never shortened: a renewal that answered after a later one must not undo it.
                e.lease_until = e.lease_until.max(sent_at + *budget);
                if let Some(ctx) = &e.ctx {
                    ctx.lease.send_replace(e.lease_until);
                }
                report.renewed += 1;
            } else if busy.contains(msg_id) {
                report.busy += 1;
            } else if !matches!(e.state, State::Lost | State::Finishing | State::Returning) {
                // No handler runs for it: never started, or ended under shutdown (which will not
                // return it now that it is lost).
                let idle = e.ctx.is_none() || e.state == State::Stopped;
                let reason = if cancelled.contains(msg_id) { CancelReason::Cancelled } else { CancelReason::LeaseLost };
                // A cancelled handler still running keeps what its job held until it ends.
                let maybe_cancelled = reason == CancelReason::Cancelled || unsure;
                e.state = if maybe_cancelled && !idle { State::Cancelled } else { State::Lost };
                if let Some(ctx) = &e.ctx {
                    ctx.fire(reason);
                }
                // Not knowing, an idle one is given back too: `release_cancelled` gives back nothing
                // for a job that was not cancelled (review helper-108).
                if idle && maybe_cancelled {
                    report.cancelled_idle.push((*msg_id, *read_ct));
                }
                if reason == CancelReason::Cancelled {
                    report.cancelled += 1;
                } else {
                    report.lost += 1;
                }
            }
        }
        report
    }

    /// The watchdog's tick (H27): cancels every running handler whose budget ends within
    /// `FENCE_MARGIN` of `now`, and marks its delivery lost. Returns them for logging.
    pub fn fence(&self, now: Instant) -> Vec<Fenced> {
        let mut fenced = Vec::new();
        for ((queue, msg_id), e) in self.entries().iter_mut() {
            if matches!(e.state, State::Running | State::Decided) && now + FENCE_MARGIN >= e.lease_until {
                e.state = State::Fenced;
                if let Some(ctx) = &e.ctx {
                    ctx.fire(CancelReason::LeaseLost);
                }
                fenced.push(Fenced {
                    delivery: Delivery { queue: queue.clone(), msg_id: *msg_id, read_ct: e.read_ct },
                    job_id: e.ctx.as_ref().map(|c| c.job_id),
                    overdue_by: (now + FENCE_MARGIN).saturating_duration_since(e.lease_until),
                });
            }
        }
        fenced
    }

    /// Shutdown, first step: deliveries claimed ahead that no handler took yet have nothing to
    /// stop; they are returned at once.
    pub fn stop_waiting(&self) {
        for e in self.entries().values_mut() {
            if e.state == State::Waiting {
                e.state = State::Stopped;
            }
        }
    }

    /// Shutdown, after `shutdown_timeout`: cancels every running handler. The deliveries are
    /// returned only once their handlers have ended (`stopped`). Returns how many were cancelled.
    /// An attempt whose outcome is decided is told to stop too, and its outcome is still written
    /// once it has ended.
    pub fn stop_running(&self) -> usize {
        let mut n = 0;
        for e in self.entries().values_mut() {
            if matches!(e.state, State::Running | State::Decided) {
                let timed_out = e.ctx.as_ref().is_some_and(|c| c.cancel_reason() == Some(CancelReason::Timeout));
                if timed_out {
                    // Its timeout passed before its executor could mark it decided (the handler
                    // blocked the thread the executor was woken on): it has failed all the same
                    // (review helper-107).
                    e.state = State::Decided;
                } else if e.state == State::Running {
                    e.state = State::Stopping;
                }
                if let Some(ctx) = &e.ctx {
                    ctx.fire(CancelReason::Shutdown);
                }
                n += 1;
            }
        }
        n
    }

    /// Running → Decided: the attempt's outcome is known (its handler returned, or its timeout
    /// passed), though the attempt goes on (its task blocks, or work it holds runs).
    pub fn decided(&self, d: &Delivery) {
        if let Some(e) = self.entries().get_mut(&(d.queue.clone(), d.msg_id)) {
            if e.read_ct == d.read_ct && e.state == State::Running {
                e.state = State::Decided;
            }
        }
    }

    /// The deliveries that no handler runs for any more, to be returned to their queue now.
    pub fn take_stopped(&self) -> Vec<Delivery> {
        let mut out = Vec::new();
        for ((queue, msg_id), e) in self.entries().iter_mut() {
            if e.state == State::Stopped {
                e.state = State::Returning;
                out.push(Delivery { queue: queue.clone(), msg_id: *msg_id, read_ct: e.read_ct });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(msg_id: i64) -> Delivery {
        Delivery { queue: QueueName::new("q").expect("valid"), msg_id, read_ct: 1 }
    }

    fn ctx(msg_id: i64) -> JobContext {
        JobContext {
            job_id: JobId(msg_id),
            job_type: "t".into(),
            queue: "q".into(),
            msg_id,
            read_ct: 1,
            attempt: 1,
            max_attempts: 1,
            cancel: Default::default(),
            reason: Default::default(),
            lease: std::sync::Arc::new(tokio::sync::watch::channel(Instant::now()).0),
            run: std::sync::Weak::new(),
            held: Default::default(),
        }
    }

    /// Delivery `msg_id` claimed with a two-second budget and started, its handler's task alive
    /// while the returned `Arc` is: its delivery, its handler's context and that `Arc`.
    fn running(set: &InFlight, msg_id: i64, now: Instant) -> (Delivery, JobContext, Arc<()>) {
        let (d, c) = (delivery(msg_id), ctx(msg_id));
        set.insert_waiting(&d, now + Duration::from_secs(2));
        assert_eq!(set.start(&d, c.clone(), now), Start::Run);
        let alive = Arc::new(());
        set.handler_started(&d, &alive);
        (d, c, alive)
    }

    #[test]
    fn h27_the_watchdog_cancels_a_running_handler_before_its_budget_ends() {
        let set = InFlight::default();
        let now = Instant::now();
        let (d, c) = (delivery(1), ctx(1));
        set.insert_waiting(&d, now + Duration::from_secs(2));
        assert_eq!(set.start(&d, c.clone(), now), Start::Run);
        // The handler sees the lease's end (what the command executor's watchdog is told).
        let lease = c.lease_ends();
        assert_eq!(*lease.borrow(), now + Duration::from_secs(2));
        assert!(set.fence(now).is_empty());
        // Renewed: the end moves out, and an older renewal answering late cannot pull it back.
        let renewal = Renewal { renewed: vec![(1, Duration::from_secs(2))], ..Renewal::default() };
        set.renewed(&d.queue, &[(1, 1)], &renewal, now + Duration::from_secs(1));
        set.renewed(&d.queue, &[(1, 1)], &renewal, now);
        assert_eq!(*lease.borrow(), now + Duration::from_secs(3));
        assert!(set.fence(now + Duration::from_secs(2)).is_empty());
        // Busy: neither renewed nor lost.
        let busy = Renewal { busy: vec![1], ..Renewal::default() };
        assert_eq!(set.renewed(&d.queue, &[(1, 1)], &busy, now).busy, 1);
        assert!(!c.is_cancelled());
        let fenced = set.fence(now + Duration::from_secs(3) - FENCE_MARGIN);
        assert_eq!(fenced.len(), 1);
        assert_eq!(c.cancel_reason(), Some(CancelReason::LeaseLost));
        assert_eq!(set.begin_finishing(&d), Finish::Lost);
        assert_eq!(set.len(), 0);
    }

    #[test]
    fn a_running_delivery_whose_message_is_claimed_again_is_cancelled() {
        let set = InFlight::default();
        let now = Instant::now();
        let d = delivery(1);
        set.insert_waiting(&d, now + Duration::from_secs(30));
        let c = ctx(1);
        assert_eq!(set.start(&d, c.clone(), now), Start::Run);
        let again = Delivery { read_ct: 2, ..d.clone() };
        set.insert_waiting(&again, now + Duration::from_secs(30));
        assert_eq!(c.cancel_reason(), Some(CancelReason::LeaseLost));
        assert_eq!(set.begin_finishing(&d), Finish::Lost, "the old delivery's outcome is not written");
    }

    #[test]
    fn h27_a_delivery_whose_budget_is_nearly_over_never_starts() {
        let set = InFlight::default();
        let now = Instant::now();
        let d = delivery(1);
        set.insert_waiting(&d, now + FENCE_MARGIN);
        assert_eq!(set.start(&d, ctx(1), now), Start::Late);
        assert_eq!(set.len(), 0, "forgotten here: the executor returns it to its queue unstarted");
    }

    #[test]
    fn h28_a_finishing_delivery_settled_by_its_own_statement_is_not_lost() {
        let set = InFlight::default();
        let now = Instant::now();
        let (d, c) = (delivery(1), ctx(1));
        set.insert_waiting(&d, now + Duration::from_secs(2));
        assert_eq!(set.start(&d, c.clone(), now), Start::Run);
        assert_eq!(set.begin_finishing(&d), Finish::Write);
        let gone = Renewal::default();
        assert_eq!(set.renewed(&d.queue, &[(1, 1)], &gone, now), Renewed::default());
        assert!(set.lease_until(&d).is_some(), "its completion still retries until its lease ends");
    }

    /// From review: a delivery whose handler ended under shutdown, found cancelled before the
    /// pool returned it, is no longer returned; its permit and lock must go back at once.
    #[test]
    fn a_cancelled_delivery_no_handler_runs_for_is_given_back() {
        let set = InFlight::default();
        let now = Instant::now();
        let (ended, waiting, running) = (delivery(1), delivery(2), delivery(3));
        for d in [&ended, &waiting, &running] {
            set.insert_waiting(d, now + Duration::from_secs(2));
        }
        assert_eq!(set.start(&ended, ctx(1), now), Start::Run);
        assert_eq!(set.start(&running, ctx(3), now), Start::Run);
        set.stop_running();
        assert_eq!(set.begin_finishing(&ended), Finish::Shutdown);
        set.stopped(&ended);
        let cancelled = Renewal { cancelled: vec![1, 2, 3], ..Renewal::default() };
        let report = set.renewed(&ended.queue, &[(1, 1), (2, 1), (3, 1)], &cancelled, now);
        assert_eq!(report.cancelled_idle, vec![(1, 1), (2, 1)], "not the one whose handler is still stopping");
        assert!(set.take_stopped().is_empty(), "a cancelled delivery is not returned");
    }

    /// Design §95: a cancelled job's handler that has not stopped keeps what its job held, renewed
    /// through `extend_cancelled` while its task exists, and is asked about no more once that
    /// holds nothing; its outcome is never written, and its executor gives the permit back.
    #[test]
    fn a_cancelled_delivery_whose_handler_still_runs_keeps_its_permit_renewed() {
        let set = InFlight::default();
        let now = Instant::now();
        let (d, c, alive) = running(&set, 1, now);
        let cancelled = Renewal { cancelled: vec![1], ..Renewal::default() };
        assert_eq!(set.renewed(&d.queue, &[(1, 1)], &cancelled, now).cancelled, 1);
        assert_eq!(c.cancel_reason(), Some(CancelReason::Cancelled));
        assert!(set.renewable(Renew::All).is_empty(), "its message is gone: not renewed by extend");
        assert!(set.lease_until(&d).is_none(), "nothing may be written for it");
        assert_eq!(set.cancelled_running().get(&d.queue), Some(&vec![(1, 1)]));
        assert!(set.any_handler_alive(), "a runtime shut down meanwhile still renews for it");
        // Renewed, then skipped by a busy row: still asked about.
        assert_eq!(set.cancelled_renewed(&d.queue, &[(1, 1)], &[(1, false)]), 1);
        assert_eq!(set.cancelled_renewed(&d.queue, &[(1, 1)], &[(1, true)]), 0);
        assert_eq!(set.cancelled_running().len(), 1);
        // The handler's task is gone: not asked about; its executor gives the permit back.
        drop(alive);
        assert!(set.cancelled_running().is_empty());
        assert_eq!(set.begin_finishing(&d), Finish::Lost);
        assert_eq!(set.len(), 0);
        // Held nothing any more (its lease ran out): lost, asked about no more.
        let (d2, _, _alive) = running(&set, 2, now);
        set.renewed(&d2.queue, &[(2, 1)], &Renewal { cancelled: vec![2], ..Renewal::default() }, now);
        assert_eq!(set.cancelled_renewed(&d2.queue, &[(2, 1)], &[]), 0);
        assert!(set.cancelled_running().is_empty());
        assert!(!set.any_handler_alive(), "a lost delivery has nothing to renew");
    }

    /// Review helper-105: an attempt whose outcome is decided (its handler returned with work
    /// held, or its timeout passed) is renewed and fenced as a running one; shutdown tells it to
    /// stop, but its outcome is still written once it has ended.
    #[test]
    fn a_decided_attempt_keeps_its_outcome_through_a_shutdown_and_is_still_fenced() {
        let set = InFlight::default();
        let now = Instant::now();
        let (d, c) = (delivery(1), ctx(1));
        set.insert_waiting(&d, now + Duration::from_secs(2));
        assert_eq!(set.start(&d, c.clone(), now), Start::Run);
        set.decided(&d);
        assert_eq!(set.renewable(Renew::All).get(&d.queue), Some(&vec![(1, 1)]));
        assert_eq!(set.stop_running(), 1);
        assert_eq!(c.cancel_reason(), Some(CancelReason::Shutdown), "its held work is told to stop");
        assert_eq!(set.begin_finishing(&d), Finish::Write, "its outcome stands");
        let (d2, c2) = (delivery(2), ctx(2));
        set.insert_waiting(&d2, now + Duration::from_secs(2));
        assert_eq!(set.start(&d2, c2.clone(), now), Start::Run);
        set.decided(&d2);
        assert_eq!(set.fence(now + Duration::from_secs(2)).len(), 1, "fenced as a running one");
        assert_eq!(set.begin_finishing(&d2), Finish::Lost);
    }

    /// Review helper-145 F2: a delivery the watchdog fenced whose handler's task still exists (one
    /// that blocks its thread) is still asked about by the heartbeat, so a renewal that was late
    /// but not too late keeps its lease while the handler runs on; it still writes nothing, and
    /// once the handler has ended it is forgotten. One the database no longer holds is lost.
    #[test]
    fn a_fenced_delivery_whose_handler_runs_on_is_still_renewed_and_writes_nothing() {
        let set = InFlight::default();
        let now = Instant::now();
        let (d, c, alive) = running(&set, 1, now);
        assert_eq!(set.fence(now + Duration::from_secs(2)).len(), 1);
        assert_eq!(c.cancel_reason(), Some(CancelReason::LeaseLost));
        assert!(set.lease_until(&d).is_none(), "nothing may be written for it");
        assert_eq!(set.renewable(Renew::All).get(&d.queue), Some(&vec![(1, 1)]), "asked about while its handler runs");
        assert_eq!(set.renewable(Renew::HandlerAlive).get(&d.queue), Some(&vec![(1, 1)]));
        assert!(set.any_handler_alive());
        let renewal = Renewal { renewed: vec![(1, Duration::from_secs(2))], ..Renewal::default() };
        assert_eq!(set.renewed(&d.queue, &[(1, 1)], &renewal, now).renewed, 1);
        assert!(set.fence(now + Duration::from_secs(3)).is_empty(), "fenced once");
        assert!(set.lease_until(&d).is_none(), "renewed, it still writes nothing");
        drop(alive);
        assert!(set.renewable(Renew::All).is_empty(), "its handler has ended: asked about no more");
        assert_eq!(set.begin_finishing(&d), Finish::Lost);
        assert_eq!(set.len(), 0);
        // Fenced, and no longer held by the database: lost, asked about no more.
        let (d2, _, _alive) = running(&set, 2, now);
        assert_eq!(set.fence(now + Duration::from_secs(2)).len(), 1);
        assert_eq!(set.renewed(&d2.queue, &[(2, 1)], &Renewal::default(), now).lost, 1);
        assert!(set.renewable(Renew::All).is_empty());
        assert!(!set.any_handler_alive());
    }

    #[test]
    fn h30_shutdown_returns_a_delivery_only_after_its_handler_ended() {
        let set = InFlight::default();
        let now = Instant::now();
        let (ended, stuck, waiting) = (delivery(1), delivery(2), delivery(3));
        for d in [&ended, &stuck, &waiting] {
            set.insert_waiting(d, now + Duration::from_secs(2));
        }
        assert_eq!(set.start(&ended, ctx(1), now), Start::Run);
        assert_eq!(set.start(&stuck, ctx(2), now), Start::Run);
        set.stop_waiting();
        assert_eq!(set.take_stopped(), vec![waiting.clone()]);
        assert_eq!(set.stop_running(), 2);
        assert!(set.take_stopped().is_empty(), "nothing returned while handlers run");
        assert_eq!(set.begin_finishing(&ended), Finish::Shutdown);
        set.stopped(&ended);
        assert_eq!(set.take_stopped(), vec![ended]);
        // A handler that will not stop is still renewed, and returned only once it has ended.
        assert!(set.lease_until(&stuck).is_some());
        assert!(set.renewable(Renew::All)[&stuck.queue].contains(&(2, 1)));
        assert_eq!(set.begin_finishing(&stuck), Finish::Shutdown);
        set.stopped(&stuck);
        assert_eq!(set.take_stopped(), vec![stuck]);
    }
}
