//! The in-flight set of one worker pool: every delivery it is running or finishing, with the
//! context whose cancellation signal reaches the handler.
//!
//! Ownership: entries are inserted by the executor before a handler starts, renewed or marked
//! lost by the heartbeat, moved to releasing by the shutdown path, and removed by whoever lands
//! the delivery's final statement (completer, retry, dead-letter, release).
//!
//! The `gate` orders those statements against the heartbeat: a transition (complete, retry,
//! dead-letter, release) runs its statement under the read side; the heartbeat renews under the
//! write side. So a heartbeat can never renew a delivery after its retry set the backoff
//! visibility (which would push the retry out), nor report a just-completed job as lost.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use lockgate_core::QueueName;
use tokio::sync::RwLock;

use crate::{CancelReason, JobContext};

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
    /// The handler returned; the final statement is on its way. Still renewed by the heartbeat.
    Finishing,
    /// Shutdown is returning it to its queue.
    Releasing,
    /// The heartbeat found it owned by nobody or by a newer delivery.
    Lost,
}

struct Entry {
    read_ct: i32,
    state: State,
    /// Set when the executor takes the delivery over; `None` while it waits for a slot.
    ctx: Option<JobContext>,
    /// Until when this delivery's visibility is known to hold (claim or last renewal).
    lease_until: Instant,
}

#[derive(Default)]
pub(crate) struct InFlight {
    entries: Mutex<HashMap<(QueueName, i64), Entry>>,
    pub gate: RwLock<()>,
}

impl InFlight {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<(QueueName, i64), Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a claimed delivery, waiting for a handler slot (heartbeat renews it already).
    pub fn insert_waiting(&self, d: &Delivery, lease_until: Instant) {
        let entry = Entry { read_ct: d.read_ct, state: State::Waiting, ctx: None, lease_until };
        self.entries().insert((d.queue.clone(), d.msg_id), entry);
    }

    /// Waiting → Running, when the executor takes the delivery over with its handler's context.
    /// False when shutdown returned it or its lease was lost meanwhile (a lost one is forgotten).
    pub fn start(&self, d: &Delivery, ctx: JobContext) -> bool {
        let mut entries = self.entries();
        let key = (d.queue.clone(), d.msg_id);
        match entries.get_mut(&key) {
            Some(e) if e.read_ct == d.read_ct && e.state == State::Waiting => {
                e.state = State::Running;
                e.ctx = Some(ctx);
                true
            }
            Some(e) if e.read_ct == d.read_ct && e.state == State::Lost => {
                entries.remove(&key);
                false
            }
            _ => false,
        }
    }

    pub fn len(&self) -> usize {
        self.entries().len()
    }

    /// Running → Finishing. False when shutdown or the heartbeat took the delivery away first:
    /// then the handler's outcome must not be written. A lost delivery is forgotten here (no
    /// one else will); a releasing one is left to the release.
    pub fn begin_finishing(&self, d: &Delivery) -> bool {
        let mut entries = self.entries();
        let key = (d.queue.clone(), d.msg_id);
        match entries.get_mut(&key) {
            Some(e) if e.read_ct == d.read_ct && e.state == State::Running => {
                e.state = State::Finishing;
                true
            }
            Some(e) if e.read_ct == d.read_ct && e.state == State::Lost => {
                entries.remove(&key);
                false
            }
            _ => false,
        }
    }

    /// The process was pruned: every delivery it holds is stale. Marks them all lost and
    /// cancels their handlers; returns how many.
    pub fn abandon_all(&self) -> usize {
        let mut n = 0;
        for e in self.entries().values_mut() {
            if e.state != State::Lost {
                e.state = State::Lost;
                if let Some(ctx) = &e.ctx {
                    ctx.fire(CancelReason::LeaseLost);
                }
                n += 1;
            }
        }
        n
    }

    pub fn remove(&self, d: &Delivery) {
        let mut entries = self.entries();
        if entries.get(&(d.queue.clone(), d.msg_id)).is_some_and(|e| e.read_ct == d.read_ct) {
            entries.remove(&(d.queue.clone(), d.msg_id));
        }
    }

    /// Until when the delivery's lease is known to hold; `None` once it is gone or lost.
    pub fn lease_until(&self, d: &Delivery) -> Option<Instant> {
        let entries = self.entries();
        let e = entries.get(&(d.queue.clone(), d.msg_id))?;
        (e.read_ct == d.read_ct && e.state != State::Lost).then_some(e.lease_until)
    }

    /// Deliveries the heartbeat should renew, by queue.
    pub fn renewable(&self) -> HashMap<QueueName, Vec<(i64, i32)>> {
        let mut out: HashMap<QueueName, Vec<(i64, i32)>> = HashMap::new();
        for ((queue, msg_id), e) in self.entries().iter() {
            if e.state != State::Lost {
                out.entry(queue.clone()).or_default().push((*msg_id, e.read_ct));
            }
        }
        out
    }

    /// Records a heartbeat's result for one queue: renewed deliveries get a new lease end;
    /// the others lost their lease and their handlers are cancelled. Returns how many were lost.
    pub fn renewed(&self, queue: &QueueName, asked: &[(i64, i32)], renewed: &[i64], until: Instant) -> usize {
        let renewed: std::collections::HashSet<i64> = renewed.iter().copied().collect();
        let mut lost = 0;
        let mut entries = self.entries();
        for (msg_id, read_ct) in asked {
            let Some(e) = entries.get_mut(&(queue.clone(), *msg_id)) else {
                continue;
            };
            if e.read_ct != *read_ct {
                continue;
            }
            if renewed.contains(msg_id) {
                e.lease_until = until;
            } else if e.state != State::Lost {
                e.state = State::Lost;
                if let Some(ctx) = &e.ctx {
                    ctx.fire(CancelReason::LeaseLost);
                }
                lost += 1;
            }
        }
        lost
    }

    /// Shutdown: every delivery still waiting for a slot (and, with `running`, every running
    /// one) becomes releasing and its handler is cancelled. Finishing ones are left to land
    /// their outcome.
    pub fn begin_release(&self, running: bool) -> Vec<Delivery> {
        let mut out = Vec::new();
        for ((queue, msg_id), e) in self.entries().iter_mut() {
            if e.state == State::Waiting || (running && e.state == State::Running) {
                e.state = State::Releasing;
                if let Some(ctx) = &e.ctx {
                    ctx.fire(CancelReason::Shutdown);
                }
                out.push(Delivery { queue: queue.clone(), msg_id: *msg_id, read_ct: e.read_ct });
            }
        }
        out
    }
}
