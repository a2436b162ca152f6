//! What a handler sees (its [`JobContext`]) and returns ([`JobError`]), and the [`Registry`]
//! that maps job types to handlers and policies.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use lockgate_core::{JobId, JobPolicy, JobTypeName, ValidationError};
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::job::{Handler, Job};

/// Why a running job's cancellation signal fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// The process is shutting down and the job outlived `shutdown_timeout`; it goes back to its
    /// queue and runs again.
    Shutdown,
    /// The heartbeat found the delivery no longer owned: its visibility lapsed and another
    /// delivery may own it. Nothing this delivery does can complete it any more.
    LeaseLost,
    /// The attempt ran past its job type's timeout and counts as failed.
    Timeout,
    /// The job was cancelled (`lockgate.cancel`): it is archived as cancelled, its permit given
    /// back, and nothing this delivery does can change it.
    Cancelled,
}

impl std::fmt::Display for CancelReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Shutdown => "shutdown",
            Self::LeaseLost => "lease lost",
            Self::Timeout => "timeout",
            Self::Cancelled => "cancelled",
        })
    }
}

/// What a handler knows about the job it runs.
#[derive(Debug, Clone)]
pub struct JobContext {
    pub job_id: JobId,
    pub job_type: String,
    pub queue: String,
    pub msg_id: i64,
    /// The delivery's read count: with `queue` and `msg_id`, the token that fences this delivery's
    /// steps (a later delivery of the job has a higher one), as `lockgate.start_statement` takes it.
    pub read_ct: i32,
    /// 1 for the first attempt.
    pub attempt: u32,
    pub max_attempts: u32,
    pub(crate) cancel: CancellationToken,
    pub(crate) reason: Arc<Mutex<Option<CancelReason>>>,
    /// Until when the delivery's lease is known to hold (`InFlight`): set when the handler
    /// starts, moved on by each renewal.
    pub(crate) lease: Arc<watch::Sender<Instant>>,
    /// The attempt's liveness: strong while its handler's task or any [`RunHold`] exists.
    pub(crate) run: Weak<()>,
    /// What the attempt's holds said they stand for ([`RunHold::describe`]).
    pub(crate) held: Arc<HeldWork>,
}

/// The descriptions of an attempt's live holds, by hold.
#[derive(Debug, Default)]
pub(crate) struct HeldWork {
    next: std::sync::atomic::AtomicU64,
    named: Mutex<std::collections::BTreeMap<u64, String>>,
}

impl HeldWork {
    /// The work still held, as described, one description after another; empty if none was.
    pub(crate) fn described(&self) -> String {
        let named = self.named.lock().unwrap_or_else(|e| e.into_inner());
        named.values().cloned().collect::<Vec<_>>().join("; ")
    }
}

/// Keeps an attempt in flight while it is held: see [`JobContext::hold`]. Dropping it says the
/// work it stands for has ended.
#[derive(Debug)]
#[must_use = "the attempt is held only while the RunHold lives"]
pub struct RunHold {
    run: Option<Arc<()>>,
    id: u64,
    held: Arc<HeldWork>,
}

impl RunHold {
    /// Whether this hold keeps its attempt in flight: false for one taken after the attempt
    /// ended, which holds nothing.
    pub fn is_held(&self) -> bool {
        self.run.is_some()
    }

    /// Names the work this hold stands for ("the process group 4242 of `backup.sh`"): while the
    /// attempt waits for it, the warning that it has not ended says what it waits for. A hold
    /// that holds nothing (taken after its attempt was over) keeps no name.
    pub fn describe(&self, what: impl Into<String>) {
        if self.run.is_some() {
            // Made before the lock: a conversion that drops another hold of the attempt would
            // take the lock again (review helper-111).
            let what = what.into();
            self.held.named.lock().unwrap_or_else(|e| e.into_inner()).insert(self.id, what);
        }
    }
}

impl Drop for RunHold {
    fn drop(&mut self) {
        self.held.named.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }
}

impl JobContext {
    /// Resolves when the job must stop: shutdown deadline, lease lost, timeout or cancel. Long handlers
    /// should select on it; the runtime stops polling the handler right after it fires.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await;
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    pub fn cancel_reason(&self) -> Option<CancelReason> {
        *self.reason.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Until when this attempt's lease is known to hold, on this process's monotonic clock; each
    /// heartbeat renewal moves it on. Past it, another worker may run the job. The runtime
    /// cancels the handler before then (H27), but only while this process runs: a handler that
    /// hands its work to something outside the process (a child process, a remote service) can
    /// pass this on, so that the work stops in time even if the process is frozen or killed.
    pub fn lease_ends(&self) -> watch::Receiver<Instant> {
        self.lease.subscribe()
    }

    /// Holds this attempt in flight for work of it that may outlive the handler's own task: a
    /// process it started that is still dying, a statement still ending on the server, work
    /// handed to `tokio::task::spawn_blocking` or to a thread. While any hold lives, the job
    /// stays leased (its visibility and permit renewed, those of a cancelled job included), its
    /// outcome, retry, return or give-back waits, and a handler told to stop is not aborted
    /// after its grace but waited for. Drop the hold when that work has ended (design §95).
    /// Taken after the attempt is over, it holds nothing. [`RunHold::describe`] names the work,
    /// for the warning about an attempt told to stop that has not ended.
    ///
    /// Take it in the handler, before handing the work on, and move it with the work: taken in a
    /// spawned task, it may come after the handler has returned and hold nothing (warned about;
    /// [`RunHold::is_held`] says so).
    pub fn hold(&self) -> RunHold {
        let id = self.held.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let run = self.run.upgrade();
        if run.is_none() {
            tracing::warn!(
                job_id = self.job_id.0,
                "a hold was taken after its attempt ended, and holds nothing: take it in the handler, before \
                 handing the work to a task or thread, and move it there"
            );
        }
        RunHold { run, id, held: self.held.clone() }
    }

    pub(crate) fn fire(&self, reason: CancelReason) {
        let mut slot = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(reason);
        self.cancel.cancel();
    }
}

/// A failed attempt's error. Any `std::error::Error` converts into it, so `?` works in handlers.
pub struct JobError {
    message: String,
}

impl JobError {
    /// A NUL character, which PostgreSQL's text cannot hold, is kept as U+FFFD (as invalid UTF-8
    /// is where text is read lossily): unreplaced, the attempt's error could not be written, and
    /// the attempt was taken for lost (review helper-110).
    pub fn new(message: impl Into<String>) -> Self {
        Self { message: storable(message.into()) }
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

/// The message is the error and its causes, each said once: a cause its error's own message
/// already contains (sqlx's do) is skipped, so "relation … does not exist" is not kept twice.
impl<E: std::error::Error> From<E> for JobError {
    fn from(err: E) -> Self {
        let mut message = err.to_string();
        let mut source = err.source();
        while let Some(cause) = source {
            let cause_text = cause.to_string();
            if !message.contains(&cause_text) {
                message.push_str(": ");
                message.push_str(&cause_text);
            }
            source = cause.source();
        }
        Self { message: storable(message) }
    }
}

/// `message` without NUL characters, each replaced by U+FFFD.
fn storable(message: String) -> String {
    if message.contains('\0') {
        message.replace('\0', "\u{FFFD}")
    } else {
        message
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobError({:?})", self.message)
    }
}

/// How an erased handler's call ended.
pub(crate) enum HandlerFailure {
    /// The arguments do not decode into the handler's type: dead-letter, never retry.
    Decode(String),
    Failed(JobError),
}

pub(crate) type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), HandlerFailure>> + Send>>;

/// A handler for raw JSON arguments, as built-in executors and typed wrappers provide.
pub trait RawHandler: Send + Sync + 'static {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>>;
}

type Erased = Arc<dyn Fn(JobContext, Value) -> HandlerFuture + Send + Sync>;

/// Job types this process can run: a handler and the policy recorded at startup for each.
#[derive(Clone, Default)]
pub struct Registry {
    handlers: HashMap<String, Erased>,
    policies: Vec<(JobTypeName, JobPolicy)>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry").field("job_types", &self.handlers.keys().collect::<Vec<_>>()).finish()
    }
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a typed handler for `J`, with `J::policy()`.
    pub fn register<J: Job, H: Handler<J>>(&mut self, handler: H) -> Result<&mut Self, ValidationError> {
        let handler = Arc::new(handler);
        let erased: Erased = Arc::new(move |ctx, args| {
            let handler = Arc::clone(&handler);
            Box::pin(async move {
                let job: J = serde_json::from_value(args)
                    .map_err(|e| HandlerFailure::Decode(format!("arguments do not decode: {e}")))?;
                handler.handle(ctx, job).await.map_err(HandlerFailure::Failed)
            })
        });
        self.insert(JobTypeName::new(J::TYPE)?, J::policy(), erased)
    }

    /// Registers a handler of raw JSON arguments under `name` with `policy`.
    pub fn register_raw(
        &mut self,
        name: JobTypeName,
        policy: JobPolicy,
        handler: Arc<dyn RawHandler>,
    ) -> Result<&mut Self, ValidationError> {
        let erased: Erased = Arc::new(move |ctx, args| {
            let handler = Arc::clone(&handler);
            Box::pin(async move { handler.call(ctx, args).await.map_err(HandlerFailure::Failed) })
        });
        self.insert(name, policy, erased)
    }

    fn insert(&mut self, name: JobTypeName, policy: JobPolicy, handler: Erased) -> Result<&mut Self, ValidationError> {
        policy.validate()?;
        // Two handlers under one name (two Rust types with one `TYPE`, say): the last replaced the
        // first in silence, and jobs of the first shape were dead-lettered as undecodable (review
        // helper-145 F4).
        if self.handlers.contains_key(name.as_str()) {
            return Err(ValidationError::new(
                "job_type",
                name.as_str(),
                "a name registered once: another handler has it",
            ));
        }
        self.handlers.insert(name.as_str().to_string(), handler);
        self.policies.push((name, policy));
        Ok(self)
    }

    pub(crate) fn handler(&self, job_type: &str) -> Option<&Erased> {
        self.handlers.get(job_type)
    }

    /// Every registered job type with the policy it records at startup.
    pub fn job_types(&self) -> &[(JobTypeName, JobPolicy)] {
        &self.policies
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(run: &Arc<()>) -> JobContext {
        JobContext {
            job_id: JobId(1),
            job_type: "t".into(),
            queue: "q".into(),
            msg_id: 1,
            read_ct: 1,
            attempt: 1,
            max_attempts: 1,
            cancel: CancellationToken::new(),
            reason: Default::default(),
            lease: Arc::new(watch::channel(Instant::now()).0),
            run: Arc::downgrade(run),
            held: Default::default(),
        }
    }

    /// A description that carries a hold of its own, dropped as it is made into text.
    struct Carried(RunHold, &'static str);

    impl From<Carried> for String {
        fn from(carried: Carried) -> String {
            drop(carried.0);
            carried.1.to_string()
        }
    }

    #[test]
    fn a_description_that_drops_a_hold_as_it_is_made_does_not_block() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let alive = Arc::new(());
            let ctx = ctx(&alive);
            let hold = ctx.hold();
            hold.describe(Carried(ctx.hold(), "the process group 7"));
            let _ = done.send(ctx.held.described());
        });
        let described = finished.recv_timeout(std::time::Duration::from_secs(5));
        assert_eq!(described.as_deref(), Ok("the process group 7"), "describe took its own lock again");
    }

    #[test]
    fn an_error_keeps_no_nul_character() {
        assert_eq!(JobError::new("bad\0byte").message(), "bad\u{FFFD}byte");
        let io = std::io::Error::other("from\0io");
        assert_eq!(JobError::from(io).message(), "from\u{FFFD}io");
    }

    #[test]
    fn a_hold_is_named_while_it_lives_and_only_if_it_holds() {
        let alive = Arc::new(());
        let ctx = ctx(&alive);
        let group = ctx.hold();
        assert!(group.is_held());
        group.describe("the process group 7 of \"sh\"");
        let statement = ctx.hold();
        statement.describe("the statement on backend 9");
        assert_eq!(ctx.held.described(), "the process group 7 of \"sh\"; the statement on backend 9");
        drop(group);
        assert_eq!(ctx.held.described(), "the statement on backend 9");
        drop(statement);
        drop(alive);
        let late = ctx.hold();
        assert!(!late.is_held());
        late.describe("after the attempt");
        assert_eq!(ctx.held.described(), "", "a hold taken after the attempt holds nothing and names nothing");
    }
}
