//! The producer side: enqueue typed or raw jobs, alone, in batches, or inside the caller's
//! transaction (G8), and define job types. Every method is one round trip, but for the first
//! typed enqueue of a type by a client, which first defines the type if it is missing.
//!
//! An enqueue in its own transaction notifies in it only when no other transaction is notifying
//! that way at the moment (`lockgate._notify_unless_busy`): its wake-up then arrives with its
//! commit. Otherwise, once it has committed, a wake task sends the wake-up (`lockgate.wake`) on a
//! connection of its own, for every enqueue that committed while its last one was in flight at
//! once (docs/design.md section 50). One wake task serves every client on the same Tokio
//! runtime, database and login, so producers that each have a client of their own share
//! wake-ups too. The enqueue returns at its commit; [`Client::wakes_sent`] waits for the
//! wake-ups.
//!
//! A typed enqueue defines its job type on first use: if `lockgate.job_types` has no row for
//! it, `J::policy()` is stored; a stored policy (a worker's, an operator's `lockgate.toml`) is
//! never replaced by one (only [`Client::define`] replaces). The client remembers, for itself
//! and its clones, which types it has seen defined, so this costs one transaction per type.
//!
//! Enqueues that run in their own transaction (`enqueue`, `enqueue_raw`, `enqueue_many`,
//! `enqueue_many_raw` and the `_with` forms) go through the client's *lane*: one connection
//! taken out of the pool on first use and kept by the client (shared by its clones). sqlx's pool tests every connection
//! it takes back with a round trip (`ping` on release, whatever `test_before_acquire` says) and
//! hands it back through a spawned task, which costs a producer in a loop about as much as its
//! statement. When the lane is busy (another task of the same client is enqueueing), a call goes
//! through the pool as before.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, Mutex as StdMutex, Weak};
use std::time::{Duration, Instant};

use lockgate_core::{
    BatchId, EnqueueOptions, EnqueueStatus, EnqueuedJob, JobId, JobPolicy, JobTypeName, QueueName, RecurringTask,
    ValidationError,
};
use lockgate_sql::pooler::Db;
use lockgate_sql::{
    BatchCallbacks, BatchInfo, Cancelled, CancelledCount, DbError, JobFilter, JobRecord, PgPool, RecurringRow,
    RecurringSource,
};
use serde_json::Value;
use sqlx::{Connection, PgConnection};
use tokio::sync::{mpsc, oneshot, Mutex, MutexGuard};

use crate::{EnqueueError, Job, Metrics};

/// A lane connection idle for longer than this is pinged before it is used again, as the pool
/// would (a server restart or an idle-session timeout may have closed it meanwhile).
const LANE_IDLE_PING: Duration = Duration::from_secs(5);

/// A job enqueued to run at a `run_at` no further ahead of this process's clock than this is
/// woken as if it ran now: the database's clock decides when it becomes visible, and a needless
/// wake-up costs one claim that finds nothing, where a missing one costs `poll_interval`.
const RUN_AT_CLOCK_MARGIN: Duration = Duration::from_secs(60);

/// How long a wake-up (its connect included) may go unanswered before it is given up with its
/// connection (a flow the network dropped without a reset): a wake-up is a few milliseconds, and
/// one awaited for good held every later wake-up of its task, and `wakes_sent` (so `lockgate
/// enqueue`) for good (review helper-141 F8).
const WAKE_WITHIN: Duration = Duration::from_secs(5);

/// A handle for producers. Cheap to clone (it holds a pool, and shares its lane connection and
/// its wake task, which it shares with every other client on the same runtime, database and
/// login).
#[derive(Debug, Clone)]
pub struct Client {
    pool: PgPool,
    lane: Arc<Mutex<Lane>>,
    /// The sender of the wake task, found or started on the first wake-up; the task ends when
    /// the last client holding it is dropped, after sending what it was given.
    wakes: Arc<StdMutex<Option<Arc<WakeSender>>>>,
    /// Where its enqueues are counted (`lockgate_jobs_enqueued_total`), when given.
    metrics: Option<Arc<Metrics>>,
    /// The typed job types known to be in `lockgate.job_types` (defined by this client or
    /// found there), shared by clones. Only a successful definition is remembered.
    defined: Arc<StdMutex<HashSet<&'static str>>>,
}

/// The client's own connection, detached from the pool, and when it was last used.
#[derive(Debug, Default)]
struct Lane {
    conn: Option<PgConnection>,
    last_used: Option<Instant>,
}

/// A lane in use: its connection is out of the lane until [`LaneUse::finish`] puts it back. If
/// the caller's future is dropped before that (the statement was cancelled), the connection is
/// dropped with it, since its protocol state is unknown.
struct LaneUse<'a> {
    lane: MutexGuard<'a, Lane>,
    conn: PgConnection,
}

impl Client {
    /// Uses `pool`; the schema must be migrated (see [`Client::check_schema`]).
    pub fn new(pool: PgPool) -> Self {
        Self { pool, lane: Arc::default(), wakes: Arc::default(), metrics: None, defined: Arc::default() }
    }

    /// Counts the jobs this client enqueues (or parks) in `metrics`, by queue and job type:
    /// pass [`Runtime::metrics`](crate::Runtime::metrics) to see them on that runtime's
    /// `/metrics`. `enqueue_in`, which runs on the caller's connection, is not counted.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Counts the jobs an enqueue stored (enqueued or parked; not discarded or duplicates).
    fn count_enqueued<'a>(&self, job_type: &str, jobs: impl IntoIterator<Item = &'a EnqueuedJob>) {
        let Some(metrics) = &self.metrics else { return };
        for job in jobs {
            if matches!(job.status, EnqueueStatus::Enqueued | EnqueueStatus::Parked) {
                metrics.job(&job.queue, job_type).enqueued.inc();
            }
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Fails with a message naming `lockgate migrate` when the schema is missing or older.
    pub async fn check_schema(&self) -> Result<(), DbError> {
        lockgate_sql::check_schema(&self.pool).await.map(|_| ())
    }

    /// Stores `J`'s policy (creating its queue if missing), replacing a stored one, so SQL
    /// producers apply it too. Typed enqueues do not need it: they define a missing type
    /// themselves (without replacing a stored policy).
    pub async fn define<J: Job>(&self) -> Result<(), EnqueueError> {
        self.define_job_type(&JobTypeName::new(J::TYPE)?, &J::policy()).await?;
        self.defined_set().insert(J::TYPE);
        Ok(())
    }

    /// Makes sure `J`'s type is stored, storing `J::policy()` if it is missing: once per type
    /// for this client and its clones. A failure is returned and not remembered.
    async fn define_on_first_use<J: Job>(&self) -> Result<(), EnqueueError> {
        if self.defined_set().contains(J::TYPE) {
            return Ok(());
        }
        let name = JobTypeName::new(J::TYPE)?;
        let policy = J::policy();
        policy.validate()?;
        if lockgate_sql::define_job_type_if_missing(&self.pool, &name, &policy).await? {
            tracing::info!(job_type = J::TYPE, queue = %policy.queue, "defined a job type on its first enqueue");
        }
        self.defined_set().insert(J::TYPE);
        Ok(())
    }

    /// Forgets `J`'s type when the database says it is unknown (deleted since it was seen), so
    /// the next enqueue defines it again.
    fn forget_if_unknown<J: Job, T>(&self, result: Result<T, EnqueueError>) -> Result<T, EnqueueError> {
        if let Err(EnqueueError::UnknownJobType { job_type }) = &result {
            if job_type == J::TYPE {
                self.defined_set().remove(J::TYPE);
            }
        }
        result
    }

    fn defined_set(&self) -> std::sync::MutexGuard<'_, HashSet<&'static str>> {
        self.defined.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub async fn define_job_type(&self, name: &JobTypeName, policy: &JobPolicy) -> Result<(), EnqueueError> {
        policy.validate()?;
        Ok(lockgate_sql::define_job_type(&self.pool, name, policy).await?)
    }

    /// Creates an open batch with optional callbacks (job types that must be defined). Enqueue
    /// into it with `EnqueueOptions::batch`, in any number of calls, then [`Client::close_batch`].
    pub async fn create_batch(&self, callbacks: &BatchCallbacks) -> Result<BatchId, EnqueueError> {
        if let Some(p) = callbacks.properties.as_ref().filter(|p| !p.is_object()) {
            return Err(ValidationError::new("properties", p, "a JSON object").into());
        }
        // A callback's unknown type stays the database's error, which says which callback.
        lockgate_sql::create_batch(&self.pool, callbacks).await.map_err(EnqueueError::Database)
    }

    /// Closes a batch: no job can be added any more, and it finishes (enqueueing its callbacks)
    /// when its last job is counted, or at once if none is pending. Returns `closed` or
    /// `finished`. Closing twice is an error.
    pub async fn close_batch(&self, batch: BatchId) -> Result<String, EnqueueError> {
        Ok(lockgate_sql::close_batch(&self.pool, batch).await?)
    }

    /// One job by id, in whatever state it is, with its attempt and errors; `None` for an
    /// unknown id (or one archive retention has pruned).
    pub async fn job(&self, id: JobId) -> Result<Option<JobRecord>, DbError> {
        lockgate_sql::job(&self.pool, id).await
    }

    /// Jobs matching `filter` in every state, newest id first: at most `limit` (1 to 1000), with
    /// ids below `before` (the last id of the previous page) when given.
    pub async fn jobs(&self, filter: &JobFilter, limit: i32, before: Option<JobId>) -> Result<Vec<JobRecord>, DbError> {
        lockgate_sql::jobs(&self.pool, filter, limit, before).await
    }

    /// Cancels a job in whatever state it is: a waiting or parked job leaves at once, a running
    /// one's handler is cancelled at its next heartbeat (its permit is given back now, and its
    /// late completion changes nothing). The job is kept, archived as cancelled. `None` for an
    /// unknown id; `cancelled: false` for a job that had finished already.
    pub async fn cancel(&self, id: JobId) -> Result<Option<Cancelled>, DbError> {
        lockgate_sql::cancel(&self.pool, id).await
    }

    /// Cancels up to `limit` jobs matching `filter` that can still be cancelled, each in a
    /// transaction of its own; returns how many matched and how many were cancelled.
    pub async fn cancel_jobs(&self, filter: &JobFilter, limit: i32) -> Result<CancelledCount, DbError> {
        lockgate_sql::cancel_jobs(&self.pool, filter, limit).await
    }

    /// Pauses a queue for every process: claims skip it (running jobs finish, producers still
    /// enqueue) until [`Client::resume_queue`]; the pause survives restarts. False if it was
    /// paused already; `DbError::UnknownQueue` for a queue that does not exist.
    pub async fn pause_queue(&self, queue: &QueueName) -> Result<bool, DbError> {
        lockgate_sql::pause_queue(&self.pool, queue.as_str()).await
    }

    /// Resumes a paused queue and wakes idle workers; false if it was not paused.
    pub async fn resume_queue(&self, queue: &QueueName) -> Result<bool, DbError> {
        lockgate_sql::resume_queue(&self.pool, queue.as_str()).await
    }

    /// A batch's progress (total, succeeded, failed, pending), or `None` for an unknown id.
    pub async fn batch(&self, batch: BatchId) -> Result<Option<BatchInfo>, DbError> {
        lockgate_sql::batch_info(&self.pool, batch).await
    }

    /// Stores (or replaces) a recurring task: from then on, every `lockgate run` enqueues one job
    /// per tick of its schedule. The cron expression, time zone and arguments are checked here,
    /// the job type and queue by the database (`EnqueueError::Database` with
    /// `DbError::UnknownJobType` or `UnknownQueue`, whose message names the task).
    pub async fn define_recurring(&self, task: &RecurringTask) -> Result<(), EnqueueError> {
        task.validate()?;
        lockgate_sql::define_recurring(&self.pool, task, RecurringSource::Sql).await.map_err(EnqueueError::Database)
    }

    /// Enables or disables a recurring task; an unknown name is `DbError::UnknownRecurringTask`.
    /// Enabling enqueues none of the ticks missed while it was disabled.
    pub async fn set_recurring_enabled(&self, name: &str, enabled: bool) -> Result<(), DbError> {
        lockgate_sql::set_recurring_enabled(&self.pool, name, enabled).await
    }

    /// Deletes a recurring task; false if there was none.
    pub async fn remove_recurring(&self, name: &str) -> Result<bool, DbError> {
        lockgate_sql::remove_recurring(&self.pool, name).await
    }

    /// Every recurring task with its last tick; `lockgate_core::Schedule::next_run` gives the next.
    pub async fn list_recurring(&self) -> Result<Vec<RecurringRow>, DbError> {
        lockgate_sql::list_recurring(&self.pool).await
    }

    /// Enqueues one typed job in its own transaction, with its type's policy (its queue,
    /// priority, ...), defining the type on first use.
    pub async fn enqueue<J: Job>(&self, job: &J) -> Result<EnqueuedJob, EnqueueError> {
        self.enqueue_with(job, &EnqueueOptions::default()).await
    }

    /// [`Client::enqueue`] with options: a delay or run time, another priority or queue, an
    /// explicit key, a batch.
    pub async fn enqueue_with<J: Job>(&self, job: &J, options: &EnqueueOptions) -> Result<EnqueuedJob, EnqueueError> {
        let args = to_args(J::TYPE, job)?;
        let options = options.to_json()?;
        self.define_on_first_use::<J>().await?;
        let result = self.enqueue_one(J::TYPE, &args, &options).await;
        self.forget_if_unknown::<J, _>(result)
    }

    /// Enqueues one typed job inside the caller's transaction: it exists if and only if that
    /// transaction commits (G8). Pass `&mut tx` for a `sqlx::Transaction`. The first use of a
    /// type looks it up on `conn`; a missing type is defined on the client's pool, outside that
    /// transaction (a definition is no business of the caller's rollback), which then needs a
    /// connection of its own.
    pub async fn enqueue_in<J: Job>(&self, conn: &mut PgConnection, job: &J) -> Result<EnqueuedJob, EnqueueError> {
        self.enqueue_in_with(conn, job, &EnqueueOptions::default()).await
    }

    /// [`Client::enqueue_in`] with options.
    pub async fn enqueue_in_with<J: Job>(
        &self,
        conn: &mut PgConnection,
        job: &J,
        options: &EnqueueOptions,
    ) -> Result<EnqueuedJob, EnqueueError> {
        let args = to_args(J::TYPE, job)?;
        let options = options.to_json()?;
        // Found on the caller's connection, a stored type needs no second one (the caller may
        // hold the pool's only connection).
        if !self.defined_set().contains(J::TYPE)
            && lockgate_sql::job_type_exists(&mut *conn, &JobTypeName::new(J::TYPE)?).await?
        {
            self.defined_set().insert(J::TYPE);
        }
        let defined_now = !self.defined_set().contains(J::TYPE);
        self.define_on_first_use::<J>().await?;
        // Notifies in the caller's transaction: only its commit makes the job claimable.
        let result = lockgate_sql::enqueue(conn, J::TYPE, &args, &options, true).await.map_err(EnqueueError::from);
        match self.forget_if_unknown::<J, _>(result) {
            // Defined a moment ago and committed, yet unknown here: the caller's snapshot is older.
            Err(EnqueueError::UnknownJobType { job_type }) if defined_now => {
                Err(EnqueueError::DefinedAfterSnapshot { job_type })
            }
            result => result,
        }
    }

    /// Enqueues many jobs of one type in one statement; results are in input order.
    pub async fn enqueue_many<J: Job>(&self, jobs: &[J]) -> Result<Vec<EnqueuedJob>, EnqueueError> {
        self.enqueue_many_with(jobs, &EnqueueOptions::default()).await
    }

    /// [`Client::enqueue_many`] with options, the same for every job.
    pub async fn enqueue_many_with<J: Job>(
        &self,
        jobs: &[J],
        options: &EnqueueOptions,
    ) -> Result<Vec<EnqueuedJob>, EnqueueError> {
        let args = jobs.iter().map(|j| to_args(J::TYPE, j)).collect::<Result<Vec<_>, _>>()?;
        let options = options.to_json()?;
        self.define_on_first_use::<J>().await?;
        let result = self.enqueue_batch(J::TYPE, &args, &options).await;
        self.forget_if_unknown::<J, _>(result)
    }

    /// Enqueues many jobs of one type by name with JSON arguments, in one statement. The type
    /// must be defined (there is no policy to define it with): `EnqueueError::UnknownJobType`.
    pub async fn enqueue_many_raw(
        &self,
        job_type: &str,
        args: &[Value],
        options: &EnqueueOptions,
    ) -> Result<Vec<EnqueuedJob>, EnqueueError> {
        for a in args {
            check_args(job_type, a)?;
        }
        self.enqueue_batch(job_type, args, &options.to_json()?).await
    }

    /// Enqueues a job by type name with JSON arguments (the CLI's path). The type must be
    /// defined: `EnqueueError::UnknownJobType`.
    pub async fn enqueue_raw(
        &self,
        job_type: &str,
        args: &Value,
        options: &EnqueueOptions,
    ) -> Result<EnqueuedJob, EnqueueError> {
        check_args(job_type, args)?;
        self.enqueue_one(job_type, args, &options.to_json()?).await
    }

    async fn enqueue_one(&self, job_type: &str, args: &Value, options: &Value) -> Result<EnqueuedJob, EnqueueError> {
        let mut lane = self.lane().await?;
        let db = self.via(&mut lane);
        let result = if wake_task_runs_freely() {
            lockgate_sql::enqueue_and_wake(db, job_type, args, options, runs_now(options)).await
        } else {
            lockgate_sql::enqueue(db, job_type, args, options, true).await.map(|job| (job, true))
        };
        let (job, woken) = LaneUse::finish(lane, result)?;
        self.count_enqueued(job_type, [&job]);
        if !woken {
            self.wake(std::slice::from_ref(&job), options);
        }
        Ok(job)
    }

    async fn enqueue_batch(
        &self,
        job_type: &str,
        args: &[Value],
        options: &Value,
    ) -> Result<Vec<EnqueuedJob>, EnqueueError> {
        let mut lane = self.lane().await?;
        let db = self.via(&mut lane);
        let result = if wake_task_runs_freely() {
            lockgate_sql::enqueue_many_and_wake(db, job_type, args, options, runs_now(options)).await
        } else {
            lockgate_sql::enqueue_many(db, job_type, args, options, true).await.map(|jobs| (jobs, true))
        };
        let (jobs, woken) = LaneUse::finish(lane, result)?;
        self.count_enqueued(job_type, &jobs);
        if !woken {
            self.wake(&jobs, options);
        }
        Ok(jobs)
    }

    /// Asks the wake task to wake the workers idle on the queue of `jobs`, whose enqueue has
    /// committed, when one of them was enqueued to run now (a delayed job is claimed at a poll
    /// once its time comes; a parked one at its promotion, which notifies). Returns at once: the
    /// enqueue's outcome is its commit, and a caller's timeout must not fire on a committed job
    /// (a retry would enqueue it twice). A wake-up that is never sent (the process exits first;
    /// see [`Client::wakes_sent`]) or fails costs the job only its prompt start: idle workers
    /// claim it at their next poll.
    fn wake(&self, jobs: &[EnqueuedJob], options: &Value) {
        let Some(job) = jobs.iter().find(|j| j.status == EnqueueStatus::Enqueued) else { return };
        if runs_now(options) {
            self.send_to_wake_task(WakeRequest::Queue(job.queue.clone(), self.pool.clone()));
        }
    }

    /// Waits until every wake-up asked for before this call has been sent (or has failed, which
    /// is logged). A process that exits right after enqueueing calls it, or its jobs start only
    /// at the workers' next poll, `poll_interval` later.
    pub async fn wakes_sent(&self) {
        let (done, sent) = oneshot::channel();
        if self.send_to_wake_task(WakeRequest::Flush(done)) {
            // An error means the task is gone, with nothing left to send.
            let _ = sent.await;
        }
    }

    /// Hands `request` to the wake task: the client's own, else the one its runtime has for its
    /// database and login, else a new one; false if there was nothing to start it on (no Tokio
    /// runtime: then nothing is pending either).
    fn send_to_wake_task(&self, request: WakeRequest) -> bool {
        let mut wakes = self.wakes.lock().unwrap_or_else(|e| e.into_inner());
        let request = match wakes.as_ref() {
            Some(tx) => match tx.send(request) {
                Ok(()) => return true,
                Err(mpsc::error::SendError(request)) => request,
            },
            None => request,
        };
        // This client has no running task (it never asked for one, or its runtime is gone):
        // nothing of its own is pending.
        if matches!(request, WakeRequest::Flush(_)) {
            return false;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return false };
        let target = WakeTarget::of(&self.pool, &runtime);
        let mut tasks = WAKE_TASKS.lock().unwrap_or_else(|e| e.into_inner());
        let request = match tasks.get(&target).and_then(Weak::upgrade) {
            Some(tx) => match tx.send(request) {
                Ok(()) => {
                    *wakes = Some(tx);
                    return true;
                }
                Err(mpsc::error::SendError(request)) => request,
            },
            None => request,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        runtime.spawn(send_wakes(rx));
        let sent = tx.send(request).is_ok();
        let tx = Arc::new(tx);
        tasks.retain(|_, task| task.strong_count() > 0);
        tasks.insert(target, Arc::downgrade(&tx));
        *wakes = Some(tx);
        sent
    }

    /// Where a statement runs: on the lane's connection when the caller holds the lane, else
    /// through the pool.
    fn via<'a>(&'a self, lane: &'a mut Option<LaneUse<'_>>) -> Db<'a> {
        match lane {
            Some(lane) => Db::idle(&mut lane.conn),
            None => Db::from(&self.pool),
        }
    }

    /// The lane's connection, ready for a statement, or `None` when another task holds the
    /// lane or the pool is closed (the caller then goes through the pool, which reports a closed
    /// pool itself). Fails as the pool's `acquire` fails when no connection can be had.
    async fn lane(&self) -> Result<Option<LaneUse<'_>>, DbError> {
        let Ok(mut lane) = self.lane.try_lock() else { return Ok(None) };
        if self.pool.is_closed() {
            lane.conn = None;
            return Ok(None);
        }
        let idle = lane.last_used.is_none_or(|at| at.elapsed() > LANE_IDLE_PING);
        let conn = match lane.conn.take() {
            Some(mut conn) if idle => conn.ping().await.is_ok().then_some(conn),
            conn => conn,
        };
        let conn = match conn {
            Some(conn) => conn,
            // A connection from the pool, with the pool's options and `after_connect`, that no
            // longer counts against it.
            None => self.pool.acquire().await?.detach(),
        };
        Ok(Some(LaneUse { lane, conn }))
    }
}

impl LaneUse<'_> {
    /// Puts the lane's connection back, if the statement used it, unless the statement's error
    /// says it may be broken (anything but an error the server reported on a healthy session).
    fn finish<T>(used: Option<Self>, result: Result<T, DbError>) -> Result<T, DbError> {
        let Some(LaneUse { mut lane, conn }) = used else { return result };
        lane.last_used = Some(Instant::now());
        let healthy = match &result {
            Ok(_) => true,
            Err(err @ DbError::Sqlx(sqlx::Error::Database(_))) => !err.is_transient(),
            Err(DbError::Sqlx(_)) => false,
            Err(_) => true,
        };
        if healthy {
            lane.conn = Some(conn);
        }
        result
    }
}

/// Whether a wake task spawned now runs while its caller waits: on a multi-threaded Tokio
/// runtime it does. On a current-thread runtime it runs only while the runtime is driven, and a
/// producer that drives one for each call (a synchronous wrapper's `block_on`) would send its
/// wake-ups late or, dropping the runtime, never: there the enqueue notifies in its own
/// transaction, as SQL's does.
fn wake_task_runs_freely() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| matches!(h.runtime_flavor(), tokio::runtime::RuntimeFlavor::MultiThread))
}

/// What a wake task is asked: a queue to wake (with the asking client's pool, which a new
/// connection of the task's may come from), or to say when everything asked before is sent.
#[derive(Debug)]
enum WakeRequest {
    Queue(String, PgPool),
    Flush(oneshot::Sender<()>),
}

type WakeSender = mpsc::UnboundedSender<WakeRequest>;

/// What a wake task's connection reaches, and where the task runs: a notification is seen only
/// on its own database, and `lockgate.wake` runs with the session's role and settings, so clients
/// share a task only when they connect to the same database as the same user with the same
/// startup options (where a role or a search path may be set) and TLS mode; and only on the
/// same Tokio runtime, since a task dies with its runtime, taking with it what other clients had
/// asked. (A role switched in a pool's `after_connect` is not seen: pools that differ only there
/// share a task, whose connection comes from one of them.)
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct WakeTarget {
    runtime: tokio::runtime::Id,
    host: String,
    port: u16,
    socket: Option<PathBuf>,
    database: Option<String>,
    username: String,
    options: Option<String>,
    tls: String,
}

impl WakeTarget {
    fn of(pool: &PgPool, runtime: &tokio::runtime::Handle) -> Self {
        let options = pool.connect_options();
        Self {
            runtime: runtime.id(),
            host: options.get_host().to_string(),
            port: options.get_port(),
            socket: options.get_socket().cloned(),
            database: options.get_database().map(str::to_string),
            username: options.get_username().to_string(),
            options: options.get_options().map(str::to_string),
            tls: format!("{:?}", options.get_ssl_mode()),
        }
    }
}

/// The process's wake tasks, by runtime, database and login. A task lives while a client holds
/// its sender; an entry whose task has ended is replaced by the next client that needs one.
static WAKE_TASKS: LazyLock<StdMutex<HashMap<WakeTarget, Weak<WakeSender>>>> = LazyLock::new(Default::default);

/// A wake task: sends `lockgate.wake` for the queues it is given, on a connection of its own,
/// kept. A new one is taken from the pools of the requests being sent, the latest first,
/// skipping closed ones (with each pool's `after_connect` and `acquire_timeout`), and detached
/// from it; no pool is kept beyond the statement, so a client dropped or a pool closed takes
/// nothing from the others. Every request waiting when it starts a statement joins it, so
/// producers enqueueing at once, through one client or many, share wake-ups, each sent after
/// its commit. A failed statement, or one not answered within `WAKE_WITHIN`, is tried once more on
/// a new connection, then logged.
async fn send_wakes(mut requests: mpsc::UnboundedReceiver<WakeRequest>) {
    let mut conn: Option<PgConnection> = None;
    while let Some(first) = requests.recv().await {
        let mut queues = BTreeSet::new();
        let mut flushes = Vec::new();
        // The pools of this statement's requests, the latest first.
        let mut pools: Vec<PgPool> = Vec::new();
        let mut take = |request| match request {
            WakeRequest::Queue(queue, from) => {
                queues.insert(queue);
                // Once per pool (its clones share their options).
                pools.retain(|p| !Arc::ptr_eq(&p.connect_options(), &from.connect_options()));
                pools.insert(0, from);
            }
            WakeRequest::Flush(done) => flushes.push(done),
        };
        take(first);
        while let Ok(request) = requests.try_recv() {
            take(request);
        }
        if !queues.is_empty() {
            let queues: Vec<String> = queues.into_iter().collect();
            let mut result = wake_on(&pools, &mut conn, &queues).await;
            if result.is_err() {
                conn = None;
                result = wake_on(&pools, &mut conn, &queues).await;
            }
            if let Err(error) = result {
                conn = None;
                tracing::warn!(?queues, %error,
                    "could not wake idle workers after an enqueue; they claim its jobs at their next poll");
            }
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

async fn wake_on(pools: &[PgPool], conn: &mut Option<PgConnection>, queues: &[String]) -> Result<(), DbError> {
    // The connect included (a pool waits 30 s for one by default: review helper-142 F7). Given
    // up, the connection is dropped by the caller (closed, not reused for the next).
    let wake = async {
        let conn = match conn {
            Some(conn) => conn,
            None => conn.insert(connect(pools).await?),
        };
        lockgate_sql::wake(Db::idle(conn), queues).await
    };
    tokio::time::timeout(WAKE_WITHIN, wake).await.unwrap_or_else(|_| Err(crate::held::no_answer(WAKE_WITHIN)))
}

/// A connection from the first of `pools` that is open and gives one (within its own
/// `acquire_timeout`), detached from it; the last failure when none does.
async fn connect(pools: &[PgPool]) -> Result<PgConnection, DbError> {
    let mut failure = DbError::from(sqlx::Error::PoolClosed);
    for pool in pools.iter().filter(|p| !p.is_closed()) {
        match pool.acquire().await {
            Ok(conn) => return Ok(conn.detach()),
            Err(error) => failure = error.into(),
        }
    }
    Err(failure)
}

/// Whether enqueue `options` (as `EnqueueOptions::to_json` or a raw caller gave them) may let
/// the job run at once: no delay above zero (counted from the database's clock, so no clock
/// skew changes it), and no `run_at` more than `RUN_AT_CLOCK_MARGIN` ahead of this process's
/// clock. An option it cannot read counts as running now.
fn runs_now(options: &Value) -> bool {
    let delayed = options.get("delay").and_then(Value::as_f64).is_some_and(|d| d > 0.0);
    let later = options
        .get("run_at")
        .and_then(Value::as_str)
        .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok())
        .is_some_and(|at| at > chrono::Utc::now() + RUN_AT_CLOCK_MARGIN);
    !delayed && !later
}

fn to_args<J: Job>(job_type: &str, job: &J) -> Result<Value, EnqueueError> {
    let args = serde_json::to_value(job)?;
    check_args(job_type, &args)?;
    Ok(args)
}

fn check_args(job_type: &str, args: &Value) -> Result<(), EnqueueError> {
    // The size bound (MAX_PAYLOAD_BYTES) is enforced once, by the SQL function, for every
    // producer; serializing here only to measure would double the cost of every enqueue.
    let kind = match args {
        Value::Object(_) => return Ok(()),
        Value::Array(_) => "an array",
        Value::String(_) => "a string",
        Value::Number(_) => "a number",
        Value::Bool(_) => "a boolean",
        Value::Null => "null",
    };
    Err(EnqueueError::NotAnObject { job_type: job_type.to_string(), kind })
}
