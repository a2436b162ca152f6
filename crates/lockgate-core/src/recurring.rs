//! Recurring tasks: a cron schedule read in a time zone, and the job each of its ticks enqueues.
//!
//! A [`Schedule`] turns a cron expression (5 fields, or 6 with seconds first, or a nickname such
//! as `@daily`; parsed by the `croner` crate) and an IANA time zone (`chrono-tz`) into instants.
//! Ticks follow Vixie cron across daylight-saving changes: a wall-clock time that does not exist
//! (spring forward) fires at the first instant after the gap; a time that happens twice (fall
//! back) fires once, at its first occurrence, for a fixed-time schedule, and on both passes for
//! one with a wildcard or a step in its seconds, minutes or hours.
//!
//! [`Schedule::due`] is the scheduler's whole rule: the tick to enqueue now is the latest one
//! after the last tick enqueued, so after any downtime one tick is enqueued, not one per missed
//! tick.

use std::str::FromStr;

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;
use serde_json::{Map, Value};

use crate::policy::validate_priority;
use crate::{JobTypeName, QueueName, ValidationError};

/// Schedules without a time zone are read in UTC, which has no daylight-saving changes.
pub const DEFAULT_TIMEZONE: &str = "UTC";
/// Cron expressions are stored and shown in `lockgate recurring list`; 256 characters is generous.
const MAX_CRON_LEN: usize = 256;
/// Task names follow the job-type rule: they are logged, listed and used as keys.
const MAX_TASK_NAME_LEN: usize = 128;

/// A parsed cron expression and the time zone its wall-clock fields are read in.
#[derive(Debug, Clone)]
pub struct Schedule {
    cron: Cron,
    timezone: Tz,
}

impl Schedule {
    /// Parses `cron` (seconds optional) and `timezone` (an IANA name such as `Europe/Berlin`).
    pub fn parse(cron: &str, timezone: &str) -> Result<Self, ValidationError> {
        let allowed = "5 fields (minute hour day-of-month month day-of-week), 6 with seconds first, \
                       or @yearly, @monthly, @weekly, @daily or @hourly";
        if cron.len() > MAX_CRON_LEN {
            return Err(ValidationError::new("cron", cron, format!("{allowed}, at most {MAX_CRON_LEN} characters")));
        }
        let parser = CronParser::builder().seconds(Seconds::Optional).year(Year::Disallowed).build();
        let parsed =
            parser.parse(cron).map_err(|err| ValidationError::new("cron", cron, format!("{allowed} ({err})")))?;
        let timezone = Tz::from_str(timezone).map_err(|_| {
            ValidationError::new("timezone", timezone, "an IANA time zone name such as \"Europe/Berlin\" or \"UTC\"")
        })?;
        let schedule = Self { cron: parsed, timezone };
        // Every schedule that matches once matches again within the calendar's cycle, so a
        // search from any fixed instant tells a date that never exists (30 February).
        if schedule.next_after(DateTime::UNIX_EPOCH).is_none() {
            return Err(ValidationError::new("cron", cron, "an expression that matches some date"));
        }
        Ok(schedule)
    }

    /// The first tick strictly after `after`, or `None` if the expression never matches again.
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        // Ticks fall on whole seconds; searching from the second that holds `after` keeps a
        // fraction of a second from shifting the answer.
        let from = whole_second(after).with_timezone(&self.timezone);
        self.cron.find_next_occurrence(&from, false).ok().map(|t| t.with_timezone(&Utc))
    }

    /// The latest tick at or before `at`.
    pub fn latest_at_or_before(&self, at: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let from = whole_second(at).with_timezone(&self.timezone);
        self.cron.find_previous_occurrence(&from, true).ok().map(|t| t.with_timezone(&Utc))
    }

    /// The tick to enqueue at `now` for a task whose ticks up to `since` are done (enqueued, or
    /// from before the task was active): the latest tick in `(since, now]`. However many ticks
    /// were missed, this is one.
    pub fn due(&self, since: DateTime<Utc>, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.latest_at_or_before(now).filter(|tick| *tick > since)
    }

    /// When the task runs next as of `now`: the tick that is due and not yet enqueued if there is
    /// one (then in the past: no scheduler has enqueued it yet), else the next tick.
    pub fn next_run(&self, since: DateTime<Utc>, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.due(since, now).or_else(|| self.next_after(since.max(now)))
    }
}

fn whole_second(at: DateTime<Utc>) -> DateTime<Utc> {
    at.duration_trunc(TimeDelta::seconds(1)).unwrap_or(at)
}

/// A task that enqueues one job of `job_type` with `args` on every tick of its schedule. Stored
/// in `lockgate.recurring_tasks` (`Client::define_recurring`, `lockgate.define_recurring`, or
/// the `[recurring.<name>]` tables of `lockgate.toml`).
#[derive(Debug, Clone, PartialEq)]
pub struct RecurringTask {
    /// The task's name: an ASCII letter, then letters, digits, `_`, `.`, `:` or `-`; at most 128.
    pub name: String,
    /// Seconds optional: `0 30 2 * * *` and `30 2 * * *` are the same schedule.
    pub cron: String,
    /// The IANA time zone the cron fields are read in.
    pub timezone: String,
    pub job_type: String,
    /// The job's arguments: a JSON object.
    pub args: Value,
    /// Overrides the job type's queue.
    pub queue: Option<QueueName>,
    /// Overrides the job type's priority.
    pub priority: Option<i16>,
    /// `None` keeps the stored task's state (a new task is enabled), so a definition that says
    /// nothing undoes no `lockgate recurring disable`.
    pub enabled: Option<bool>,
}

impl RecurringTask {
    /// A task in UTC with empty arguments and the job type's queue and priority.
    pub fn new(name: impl Into<String>, cron: impl Into<String>, job_type: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            cron: cron.into(),
            timezone: DEFAULT_TIMEZONE.to_string(),
            job_type: job_type.into(),
            args: Value::Object(Map::new()),
            queue: None,
            priority: None,
            enabled: None,
        }
    }

    /// Checks everything that can be checked without the database (whether the job type and the
    /// queue exist is checked when the task is stored); returns the parsed schedule.
    pub fn validate(&self) -> Result<Schedule, ValidationError> {
        validate_task_name(&self.name)?;
        let schedule = Schedule::parse(&self.cron, &self.timezone)?;
        JobTypeName::new(self.job_type.clone())?;
        if !self.args.is_object() {
            return Err(ValidationError::new("args", &self.args, "a JSON object"));
        }
        if let Some(priority) = self.priority {
            validate_priority(priority)?;
        }
        Ok(schedule)
    }

    /// The enqueue options each tick's job gets (`lockgate.define_recurring`'s `options`).
    pub fn options(&self) -> Value {
        let mut map = Map::new();
        if let Some(queue) = &self.queue {
            map.insert("queue".into(), Value::from(queue.as_str()));
        }
        if let Some(priority) = self.priority {
            map.insert("priority".into(), Value::from(priority));
        }
        Value::Object(map)
    }
}

fn validate_task_name(name: &str) -> Result<(), ValidationError> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'));
    if !first_ok || !rest_ok || name.len() > MAX_TASK_NAME_LEN {
        let allowed = "an ASCII letter followed by letters, digits, '_', '.', ':' or '-', at most 128 characters";
        return Err(ValidationError::new("recurring task name", name, allowed));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn utc(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc)
    }

    /// The ticks a scheduler enqueues while the clock moves from `from` to `to` in steps of
    /// `step`, applying the scheduler's rule at every step.
    fn ticks_enqueued(schedule: &Schedule, from: &str, to: &str, step: TimeDelta) -> Vec<DateTime<Utc>> {
        let (mut now, end) = (utc(from), utc(to));
        let mut since = now;
        let mut ticks = Vec::new();
        while now <= end {
            if let Some(tick) = schedule.due(since, now) {
                ticks.push(tick);
                since = tick;
            }
            now += step;
        }
        ticks
    }

    fn berlin(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> Vec<DateTime<Utc>> {
        match chrono_tz::Europe::Berlin.with_ymd_and_hms(y, mo, d, h, mi, 0) {
            chrono::LocalResult::Single(t) => vec![t.with_timezone(&Utc)],
            chrono::LocalResult::Ambiguous(a, b) => vec![a.with_timezone(&Utc), b.with_timezone(&Utc)],
            chrono::LocalResult::None => vec![],
        }
    }

    #[test]
    fn seconds_are_optional_and_ticks_fall_on_whole_seconds() {
        let five = Schedule::parse("30 2 * * *", "UTC").unwrap();
        let six = Schedule::parse("0 30 2 * * *", "UTC").unwrap();
        let at = utc("2026-05-01T10:00:00.250Z");
        assert_eq!(five.next_after(at), Some(utc("2026-05-02T02:30:00Z")));
        assert_eq!(five.next_after(at), six.next_after(at));
        let every_second = Schedule::parse("* * * * * *", "UTC").unwrap();
        assert_eq!(every_second.next_after(at), Some(utc("2026-05-01T10:00:01Z")));
        assert_eq!(every_second.latest_at_or_before(at), Some(utc("2026-05-01T10:00:00Z")));
        assert!(Schedule::parse("@daily", "UTC").is_ok());
    }

    #[test]
    fn after_downtime_one_tick_is_due_the_latest() {
        let hourly = Schedule::parse("0 * * * *", "UTC").unwrap();
        let since = utc("2026-05-01T00:00:00Z");
        let now = utc("2026-05-01T09:41:00Z");
        assert_eq!(hourly.due(since, now), Some(utc("2026-05-01T09:00:00Z")), "nine missed ticks, one due");
        assert_eq!(hourly.due(utc("2026-05-01T09:00:00Z"), now), None, "the latest tick was enqueued");
        assert_eq!(hourly.next_run(utc("2026-05-01T09:00:00Z"), now), Some(utc("2026-05-01T10:00:00Z")));
        assert_eq!(hourly.next_run(since, now), Some(utc("2026-05-01T09:00:00Z")), "due, shown as the next run");
    }

    #[test]
    fn dst_a_daily_0230_job_runs_once_on_the_spring_forward_day_at_the_end_of_the_gap() {
        // Europe/Berlin, 2026-03-29: 02:00 CET becomes 03:00 CEST; 02:30 does not exist.
        assert!(berlin(2026, 3, 29, 2, 30).is_empty());
        let daily = Schedule::parse("30 2 * * *", "Europe/Berlin").unwrap();
        let ticks = ticks_enqueued(&daily, "2026-03-27T12:00:00Z", "2026-03-31T12:00:00Z", TimeDelta::seconds(30));
        let expected = [
            utc("2026-03-28T01:30:00Z"), // 02:30 CET
            utc("2026-03-29T01:00:00Z"), // 03:00 CEST, the first instant after the gap
            utc("2026-03-30T00:30:00Z"), // 02:30 CEST
            utc("2026-03-31T00:30:00Z"),
        ];
        assert_eq!(ticks, expected);
    }

    #[test]
    fn dst_a_job_in_the_repeated_hour_runs_once_on_the_fall_back_day() {
        // Europe/Berlin, 2026-10-25: 03:00 CEST becomes 02:00 CET; 02:30 happens twice.
        assert_eq!(berlin(2026, 10, 25, 2, 30).len(), 2);
        let daily = Schedule::parse("30 2 * * *", "Europe/Berlin").unwrap();
        let ticks = ticks_enqueued(&daily, "2026-10-24T12:00:00Z", "2026-10-26T12:00:00Z", TimeDelta::seconds(30));
        assert_eq!(
            ticks,
            [utc("2026-10-25T00:30:00Z"), utc("2026-10-26T01:30:00Z")],
            "02:30 CEST only, then 02:30 CET"
        );
        // 01:30 comes before the change: once, and still at 01:30 local the day after.
        let daily = Schedule::parse("30 1 * * *", "Europe/Berlin").unwrap();
        let ticks = ticks_enqueued(&daily, "2026-10-24T12:00:00Z", "2026-10-26T12:00:00Z", TimeDelta::seconds(30));
        assert_eq!(ticks, [utc("2026-10-24T23:30:00Z"), utc("2026-10-26T00:30:00Z")]);
        // New York repeats 01:00-02:00 (2026-11-01): a daily 01:30 job runs once, at 01:30 EDT.
        let daily = Schedule::parse("30 1 * * *", "America/New_York").unwrap();
        let ticks = ticks_enqueued(&daily, "2026-10-31T12:00:00Z", "2026-11-02T12:00:00Z", TimeDelta::seconds(30));
        assert_eq!(ticks, [utc("2026-11-01T05:30:00Z"), utc("2026-11-02T06:30:00Z")]);
    }

    #[test]
    fn dst_an_interval_job_runs_on_both_passes_of_the_repeated_hour() {
        let half_hourly = Schedule::parse("*/30 * * * *", "Europe/Berlin").unwrap();
        let ticks =
            ticks_enqueued(&half_hourly, "2026-10-24T23:45:00Z", "2026-10-25T02:10:00Z", TimeDelta::seconds(30));
        let expected = [
            "2026-10-25T00:00:00Z", // 02:00 CEST
            "2026-10-25T00:30:00Z", // 02:30 CEST
            "2026-10-25T01:00:00Z", // 02:00 CET
            "2026-10-25T01:30:00Z", // 02:30 CET
            "2026-10-25T02:00:00Z", // 03:00 CET
        ];
        assert_eq!(ticks, expected.map(utc));
    }

    #[test]
    fn bad_schedules_and_tasks_name_the_problem() {
        for bad in ["", "* * * *", "61 * * * *", "* * * * * * *", "every day", "@fortnightly"] {
            let err = Schedule::parse(bad, "UTC").unwrap_err();
            assert_eq!(err.field, "cron", "{bad:?}");
            assert!(err.to_string().contains("5 fields"), "{err}");
        }
        let err = Schedule::parse("0 0 30 2 *", "UTC").unwrap_err();
        assert!(err.to_string().contains("matches some date"), "{err}");
        let err = Schedule::parse("* * * * *", "Mars/Olympus_Mons").unwrap_err();
        assert_eq!((err.field, err.value.as_str()), ("timezone", "Mars/Olympus_Mons"));
        let mut task = RecurringTask::new("nightly", "0 3 * * *", "report");
        assert!(task.validate().is_ok());
        task.args = serde_json::json!([1, 2]);
        assert_eq!(task.validate().unwrap_err().field, "args");
        let task = RecurringTask { priority: Some(10), ..RecurringTask::new("nightly", "0 3 * * *", "report") };
        assert_eq!(task.validate().unwrap_err().field, "priority");
        let err = RecurringTask::new("no spaces", "0 3 * * *", "report").validate().unwrap_err();
        assert_eq!(err.field, "recurring task name");
        let err = RecurringTask::new("nightly", "0 3 * * *", "bad type").validate().unwrap_err();
        assert_eq!(err.field, "job_type");
    }
}
