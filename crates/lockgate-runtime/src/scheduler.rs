//! The recurring-job scheduler: every `lockgate run` (every `Runtime`) runs one. Each pass reads
//! the tasks and the database's clock, and for each enabled task whose latest tick is after the
//! last one enqueued, enqueues that tick (`lockgate.enqueue_recurring_tick`). Any number of
//! schedulers may run: the tick's row, inserted in the enqueue's transaction, lets one of them
//! enqueue it and tells the others it is taken (H23). After downtime only the latest missed tick
//! is due, so a downtime enqueues one job per task, not one per missed tick.
//!
//! Between passes it sleeps until the next tick of any task, at most `RELOAD_INTERVAL`, so a
//! task defined or changed through SQL is seen within that long. The clock is the database's
//! (`now()`), so processes whose clocks disagree still compute the same ticks. A failed pass is
//! logged and the next one runs after `RELOAD_INTERVAL`. A statement not answered within its
//! bound (`held::answer_within`) is given up with its connection (design §119).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use lockgate_core::{Schedule, ValidationError};
use lockgate_sql::pooler::Db;
use lockgate_sql::{DbError, PgPool, ScheduledTask};
use tokio_util::sync::CancellationToken;

use crate::config::RuntimeConfig;
use crate::held::{answer_within, on_pool};

/// Tasks are re-read at least this often: a task defined, changed or enabled through SQL or the
/// CLI is scheduled within a second, for two small statements per second per process.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// How long a pass may go on trying the tasks whose last tick's statement failed, once the
/// others are done: at least one of them is tried, and more while the pass is younger than this.
/// Each may wait its tick's `lock_timeout` (500 ms) for a key a producer holds, so without a
/// bound N held tasks made every pass last N × 500 ms, and every other task lost ticks (review
/// helper-143 F3).
pub const FAILING_BUDGET: Duration = Duration::from_millis(500);

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerReport {
    /// Ticks this pass enqueued (including jobs parked or discarded by their concurrency limit).
    pub enqueued: usize,
    /// Ticks another scheduler had enqueued already (or whose task was disabled meanwhile, or
    /// whose job's unique key an earlier job holds, its type discarding duplicates).
    pub taken: usize,
    /// Ticks whose enqueue failed (recorded on the task with the error; not retried).
    pub failed: usize,
    /// Ticks not looked at because another transaction held their task's row (a scheduler
    /// enqueuing the same tick, a definition not yet committed): the next pass looks again.
    pub busy: usize,
    /// Ticks whose statement failed (a key held past the tick's lock timeout, a lost
    /// connection): logged, and tried again by a later pass; the other tasks went on.
    pub errors: usize,
    /// Due ticks of tasks whose last tick's statement failed that this pass left to a later one,
    /// its time for them (`FAILING_BUDGET`) spent.
    pub deferred: usize,
    /// The earliest tick of any enabled task after this pass's clock.
    pub next_tick_at: Option<DateTime<Utc>>,
}

/// Enqueues the due tick of every enabled recurring task.
pub struct Scheduler {
    db: PgPool,
    within: Duration,
    /// Parsed schedules by task name, with the cron and time zone they were parsed from: a
    /// schedule is parsed once, and an invalid one (stored through SQL, which checks only the
    /// expression's shape) is logged once.
    schedules: HashMap<String, ParsedSchedule>,
    /// Passes so far: each starts at another task, so a task whose tick keeps failing never
    /// delays the same others first.
    passes: usize,
    /// Tasks whose last tick's statement failed: each pass tries them after the others, and only
    /// as many as `FAILING_BUDGET` allows.
    failing: HashSet<String>,
    /// Fired by `run`'s shutdown: a pass under way stops before its next task.
    shutdown: CancellationToken,
}

struct ParsedSchedule {
    cron: String,
    timezone: String,
    schedule: Result<Schedule, ValidationError>,
}

impl Scheduler {
    pub fn new(db: PgPool) -> Self {
        Self {
            db,
            within: answer_within(&RuntimeConfig::default()),
            schedules: HashMap::new(),
            passes: 0,
            failing: HashSet::new(),
            shutdown: CancellationToken::new(),
        }
    }

    /// Gives up a statement not answered within `within`, with its connection (default: the
    /// default configuration's bound, `held::answer_within`).
    pub fn answer_within(mut self, within: Duration) -> Self {
        self.within = within;
        self
    }

    pub async fn run(mut self, shutdown: CancellationToken) {
        self.shutdown = shutdown.clone();
        loop {
            let pause = match self.pass().await {
                Ok(pause) => pause,
                Err(error) => {
                    tracing::warn!(%error, "recurring scheduler pass failed");
                    RELOAD_INTERVAL
                }
            };
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// One pass on the database's clock; returns how long to sleep until the next tick.
    async fn pass(&mut self) -> Result<Duration, DbError> {
        let now = on_pool(&self.db, self.within, async |c| lockgate_sql::database_now(Db::idle(c)).await).await?;
        let clock_read = Instant::now();
        let report = self.run_once(now).await?;
        let until_next = report.next_tick_at.and_then(|next| (next - now).to_std().ok()).unwrap_or(RELOAD_INTERVAL);
        Ok(until_next.min(RELOAD_INTERVAL).saturating_sub(clock_read.elapsed()))
    }

    /// Enqueues the tick due at `now` of every enabled task (tests pin `now`; `run` passes the
    /// database's clock). A tick after the database's own clock is refused by the database.
    pub async fn run_once(&mut self, now: DateTime<Utc>) -> Result<SchedulerReport, DbError> {
        let started = Instant::now();
        let tasks =
            on_pool(&self.db, self.within, async |c| lockgate_sql::scheduled_recurring(Db::idle(c)).await).await?;
        let names: HashSet<&str> = tasks.iter().map(|t| t.name.as_str()).collect();
        self.schedules.retain(|name, _| names.contains(name.as_str()));
        self.failing.retain(|name| names.contains(name.as_str()));
        let mut report = SchedulerReport::default();
        let enabled: Vec<&ScheduledTask> = tasks.iter().collect();
        self.passes = self.passes.wrapping_add(1);
        let start = if enabled.is_empty() { 0 } else { self.passes % enabled.len() };
        // The tasks whose last tick's statement failed come last, so that one whose key a
        // producer holds never delays the others (H29's rule for queues).
        let (healthy, failing): (Vec<&ScheduledTask>, Vec<&ScheduledTask>) =
            enabled[start..].iter().chain(&enabled[..start]).partition(|t| !self.failing.contains(&t.name));
        let mut failing_tried = 0;
        for task in healthy.into_iter().chain(failing) {
            if self.shutdown.is_cancelled() {
                break;
            }
            let Some(schedule) = self.schedule(task) else { continue };
            let done_until = task.ticks_done_until();
            let due = schedule.due(done_until, now);
            let next = schedule.next_after(now.max(done_until));
            report.next_tick_at = report.next_tick_at.into_iter().chain(next).min();
            let Some(tick) = due else { continue };
            if self.failing.contains(&task.name) {
                if failing_tried > 0 && started.elapsed() >= FAILING_BUDGET {
                    report.deferred += 1;
                    continue;
                }
                failing_tried += 1;
            }
            match self.enqueue_tick(task, tick, &mut report).await {
                Ok(()) => {
                    self.failing.remove(&task.name);
                }
                Err(error) => {
                    report.errors += 1;
                    self.failing.insert(task.name.clone());
                    tracing::warn!(task = %task.name, %tick, %error, "recurring tick failed; a later pass tries again");
                }
            }
        }
        Ok(report)
    }

    /// Enqueues `tick` of `task`, computed from the schedule `task` holds: a schedule changed
    /// since it was read makes the database refuse the tick (inactive).
    async fn enqueue_tick(
        &self,
        task: &ScheduledTask,
        tick: DateTime<Utc>,
        report: &mut SchedulerReport,
    ) -> Result<(), DbError> {
        let schedule = Some((task.cron.as_str(), task.timezone.as_str()));
        let outcome = on_pool(&self.db, self.within, async |c| {
            lockgate_sql::enqueue_recurring_tick(Db::idle(c), &task.name, tick, schedule).await
        })
        .await?;
        let task = task.name.as_str();
        match outcome.status.as_str() {
            "taken" | "inactive" => report.taken += 1,
            // Another transaction holds the task (a scheduler enqueuing this tick, a definition
            // not yet committed): the next pass looks again.
            "busy" => {
                report.busy += 1;
                tracing::debug!(task, %tick, "recurring task held by another transaction; the next pass looks again");
            }
            // A unique type that discards duplicates: the tick's job is the holder's, enqueued
            // earlier (review helper-143 F7: it was logged as enqueued).
            "duplicate" => {
                report.taken += 1;
                tracing::info!(task, %tick, holder = outcome.job_id, "recurring tick not enqueued: its unique key is held by an earlier job");
            }
            "failed" => {
                report.failed += 1;
                let error = outcome.error.unwrap_or_default();
                tracing::warn!(task, %tick, %error, "recurring tick could not be enqueued");
            }
            status => {
                report.enqueued += 1;
                tracing::info!(task, %tick, job_id = outcome.job_id, status, "recurring tick enqueued");
            }
        }
        Ok(())
    }

    /// The task's parsed schedule, parsed again only when its cron or time zone changed.
    fn schedule(&mut self, task: &ScheduledTask) -> Option<&Schedule> {
        let stale = self.schedules.get(&task.name).is_none_or(|p| p.cron != task.cron || p.timezone != task.timezone);
        if stale {
            let schedule = Schedule::parse(&task.cron, &task.timezone);
            if let Err(error) = &schedule {
                tracing::warn!(task = %task.name, %error, "recurring task not scheduled: invalid schedule");
            }
            let parsed = ParsedSchedule { cron: task.cron.clone(), timezone: task.timezone.clone(), schedule };
            self.schedules.insert(task.name.clone(), parsed);
        }
        self.schedules.get(&task.name)?.schedule.as_ref().ok()
    }
}
