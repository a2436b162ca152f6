//! Recurring-task statements: define, enable or disable, remove, list, the configuration's sync,
//! and the scheduler's one write per tick (`lockgate.enqueue_recurring_tick`, which makes a tick
//! enqueue once however many schedulers race on it, H23).

use chrono::{DateTime, Utc};
use lockgate_core::RecurringTask;
use serde_json::Value;
use sqlx::{PgPool, Row};

use crate::pooler::{on, query, query_scalar, Db};

use crate::DbError;

/// Who defined a task: the `[recurring]` tables of a configuration, which remove it again when
/// they no longer list it, or a call of `lockgate.define_recurring` (SQL, the Client, the CLI).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecurringSource {
    Config,
    Sql,
}

impl RecurringSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Config => "config",
            Self::Sql => "sql",
        }
    }
}

/// One row of `lockgate.recurring_tasks`.
#[derive(Debug, Clone, PartialEq)]
pub struct RecurringRow {
    pub name: String,
    pub cron: String,
    pub timezone: String,
    pub job_type: String,
    pub args: Value,
    pub options: Value,
    pub enabled: bool,
    pub source: String,
    /// No tick at or before this instant is enqueued (set at creation, on a schedule change and
    /// when the task is enabled again).
    pub active_since: DateTime<Utc>,
    /// The latest tick enqueued, or whose enqueue failed.
    pub last_tick_at: Option<DateTime<Utc>>,
    pub last_job_id: Option<i64>,
    /// `enqueued`, `parked`, `discarded` or `failed`.
    pub last_status: Option<String>,
    pub last_error: Option<String>,
}

impl RecurringRow {
    /// The instant up to which the task's ticks are done: enqueued, or from before it was active.
    pub fn ticks_done_until(&self) -> DateTime<Utc> {
        self.last_tick_at.map_or(self.active_since, |last| last.max(self.active_since))
    }
}

/// What a scheduler reads of an enabled task each pass: its schedule and how far its ticks are
/// done. Not its arguments and options, which the tick's own statement reads: every scheduler
/// read every task whole every second, disabled ones too, some 18 MB/s for twenty tasks with
/// large arguments (review helper-143 F2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledTask {
    pub name: String,
    pub cron: String,
    pub timezone: String,
    pub active_since: DateTime<Utc>,
    pub last_tick_at: Option<DateTime<Utc>>,
}

impl ScheduledTask {
    /// As [`RecurringRow::ticks_done_until`].
    pub fn ticks_done_until(&self) -> DateTime<Utc> {
        self.last_tick_at.map_or(self.active_since, |last| last.max(self.active_since))
    }
}

/// The enabled tasks, by name, as a scheduler reads them.
pub async fn scheduled_recurring<'c>(db: impl Into<Db<'c>>) -> Result<Vec<ScheduledTask>, DbError> {
    on(db.into(), async |conn| {
        let rows = query(
            "SELECT name, cron, timezone, active_since, last_tick_at FROM lockgate.recurring_tasks
              WHERE enabled ORDER BY name",
        )
        .fetch_all(conn)
        .await?;
        Ok(rows
            .iter()
            .map(|r| ScheduledTask {
                name: r.get(0),
                cron: r.get(1),
                timezone: r.get(2),
                active_since: r.get(3),
                last_tick_at: r.get(4),
            })
            .collect())
    })
    .await
}

/// What `lockgate.enqueue_recurring_tick` did with one tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TickOutcome {
    /// `enqueued`, `parked`, `discarded`, `failed`, `taken` (another scheduler enqueued this tick
    /// or a later one) or `inactive` (the task is disabled, removed, or was not active then).
    pub status: String,
    pub job_id: Option<i64>,
    /// Why the enqueue failed (`failed` only).
    pub error: Option<String>,
}

/// Stores (or replaces) a task (`lockgate.define_recurring`). The caller validates it first.
pub async fn define_recurring<'c>(
    db: impl Into<Db<'c>>,
    task: &RecurringTask,
    source: RecurringSource,
) -> Result<(), DbError> {
    on(db.into(), async |conn| {
        query("SELECT lockgate.define_recurring($1, $2, $3, $4, $5, $6, $7, $8)")
            .bind(&task.name)
            .bind(&task.cron)
            .bind(&task.job_type)
            .bind(&task.args)
            .bind(&task.timezone)
            .bind(task.options())
            .bind(task.enabled)
            .bind(source.as_str())
            .execute(conn)
            .await?;
        Ok(())
    })
    .await
}

/// Makes the database's config-owned tasks exactly `tasks`, in one statement: defines each, in
/// the order given, then removes the config-owned tasks it does not list. Returns the names
/// removed. One statement, not a transaction of several: each definition locks its task's row,
/// and a process frozen (or cut off) between two statements held them all, so that no scheduler
/// of any process could tick those tasks until its session ended (review helper-143 F1); the
/// server runs one statement to its commit whatever its client does.
pub async fn sync_config_recurring(db: &PgPool, tasks: &[RecurringTask]) -> Result<Vec<String>, DbError> {
    let column = |f: fn(&RecurringTask) -> String| tasks.iter().map(f).collect::<Vec<_>>();
    let names = column(|t| t.name.clone());
    let args: Vec<serde_json::Value> = tasks.iter().map(|t| t.args.clone()).collect();
    let options: Vec<serde_json::Value> = tasks.iter().map(RecurringTask::options).collect();
    let enabled: Vec<Option<bool>> = tasks.iter().map(|t| t.enabled).collect();
    let removed: Vec<String> = query_scalar(
        "WITH defined AS (
             SELECT count(lockgate.define_recurring(t.name, t.cron, t.job_type, t.args, t.timezone, t.options,
                                                    t.enabled, 'config')) AS n
               FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::text[], $6::jsonb[], $7::boolean[])
                    AS t(name, cron, job_type, args, timezone, options, enabled))
         SELECT lockgate.prune_config_recurring($1) FROM defined",
    )
    .bind(&names)
    .bind(column(|t| t.cron.clone()))
    .bind(column(|t| t.job_type.clone()))
    .bind(args)
    .bind(column(|t| t.timezone.clone()))
    .bind(options)
    .bind(enabled)
    .fetch_all(db)
    .await?;
    Ok(removed)
}

/// Enables or disables a task; `DbError::UnknownRecurringTask` names an unknown one.
pub async fn set_recurring_enabled<'c>(db: impl Into<Db<'c>>, name: &str, enabled: bool) -> Result<(), DbError> {
    on(db.into(), async |conn| {
        query("SELECT lockgate.set_recurring_enabled($1, $2)").bind(name).bind(enabled).execute(conn).await?;
        Ok(())
    })
    .await
}

/// Deletes a task and its ticks; false if there was none.
pub async fn remove_recurring<'c>(db: impl Into<Db<'c>>, name: &str) -> Result<bool, DbError> {
    on(db.into(), async |conn| {
        Ok(query_scalar("SELECT lockgate.remove_recurring($1)").bind(name).fetch_one(conn).await?)
    })
    .await
}

/// Every task, by name.
pub async fn list_recurring<'c>(db: impl Into<Db<'c>>) -> Result<Vec<RecurringRow>, DbError> {
    on(db.into(), async |conn| {
        let rows = query(
            "SELECT name, cron, timezone, job_type, args, options, enabled, source, active_since, last_tick_at,
                last_job_id, last_status, last_error
           FROM lockgate.list_recurring()",
        )
        .fetch_all(conn)
        .await?;
        Ok(rows
            .iter()
            .map(|r| RecurringRow {
                name: r.get(0),
                cron: r.get(1),
                timezone: r.get(2),
                job_type: r.get(3),
                args: r.get(4),
                options: r.get(5),
                enabled: r.get(6),
                source: r.get(7),
                active_since: r.get(8),
                last_tick_at: r.get(9),
                last_job_id: r.get(10),
                last_status: r.get(11),
                last_error: r.get(12),
            })
            .collect())
    })
    .await
}

/// Enqueues the job of `task`'s tick at `tick_at`, unless that tick (or a later one) was
/// enqueued already; in one transaction with the tick's row (H23). `schedule`, the task's
/// `(cron, timezone)` the tick was computed from, makes it `inactive` when the task's schedule
/// has changed since it was read (None: not compared).
pub async fn enqueue_recurring_tick<'c>(
    db: impl Into<Db<'c>>,
    task: &str,
    tick_at: DateTime<Utc>,
    schedule: Option<(&str, &str)>,
) -> Result<TickOutcome, DbError> {
    on(db.into(), async |conn| {
        let row = query("SELECT status, job_id, error FROM lockgate.enqueue_recurring_tick($1, $2, $3, $4)")
            .bind(task)
            .bind(tick_at)
            .bind(schedule.map(|(cron, _)| cron))
            .bind(schedule.map(|(_, timezone)| timezone))
            .fetch_one(conn)
            .await?;
        Ok(TickOutcome { status: row.get(0), job_id: row.get(1), error: row.get(2) })
    })
    .await
}

/// The database's clock (`now()`): the scheduler's clock, so that every process computes the
/// same ticks whatever its own clock says.
pub async fn database_now<'c>(db: impl Into<Db<'c>>) -> Result<DateTime<Utc>, DbError> {
    on(db.into(), async |conn| Ok(query_scalar("SELECT now()").fetch_one(conn).await?)).await
}
