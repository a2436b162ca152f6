//! `lockgate doctor`: the checks an operator runs when something looks wrong, each with a verdict
//! (ok, warn, fail) and what to do. The database's checks are one SQL function,
//! `lockgate.doctor()`, shared with other languages and the dashboard; the two that compare the
//! database with this binary (schema version and functions checksum, through `check_schema`;
//! the stored recurring schedules, which this binary's cron parser reads) and with this host
//! (clock offset) run here. Exit status: 0 without a failure, 1 with one,
//! 2 when the database cannot be reached at all.

use std::time::Duration;

use anyhow::Result;
use chrono::{TimeDelta, Utc};
use lockgate::sql::{DbError, DoctorCheck, DoctorThresholds, Verdict};
use lockgate::{PgPool, Schedule};

use crate::db;
use crate::table;

/// Exit status when a check fails.
pub const EXIT_FAILED: i32 = 1;
/// Exit status when the database cannot be reached (no check could run).
pub const EXIT_UNREACHABLE: i32 = 2;

/// An offset the operator should hear about: log lines and database times start to disagree.
const CLOCK_WARN: TimeDelta = TimeDelta::seconds(1);
/// An offset past any NTP-synchronised host's: the host's clock is not being kept at all.
const CLOCK_FAIL: TimeDelta = TimeDelta::seconds(5);
/// Round trips measured; the shortest bounds the error best.
const CLOCK_SAMPLES: usize = 3;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print the checks as a JSON array of {check, verdict, detail, advice}.
    #[arg(long)]
    json: bool,
    /// A transaction idle this long while holding locks on lockgate's or PGMQ's tables fails.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    idle_in_transaction_threshold: Duration,
    /// A transaction active this long while holding such locks is a warning.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    long_running_threshold: Duration,
    /// A process whose heartbeat is older than this is stale (the runtime's `alive_threshold`).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    alive_threshold: Duration,
}

/// Runs every check, prints them, and returns the exit status.
pub async fn run(target: &db::Target, args: Args) -> Result<i32> {
    let checks = match db::connect_reading(target).await {
        Ok(pool) => {
            let checks = checks(&pool, &args).await?;
            pool.close().await;
            checks
        }
        Err(err) => vec![DoctorCheck {
            check: "connection".into(),
            verdict: Verdict::Fail,
            detail: format!("{err:#}"),
            advice: Some(
                "check the URL (--database-url, DATABASE_URL), that the server is up and reachable from this \
                 host, and that it accepts this role; a missing database is created by `lockgate migrate --create-database`"
                    .into(),
            ),
        }],
    };
    print(&checks, args.json)?;
    Ok(if checks.iter().any(|c| c.check == "connection") {
        EXIT_UNREACHABLE
    } else if checks.iter().any(|c| c.verdict == Verdict::Fail) {
        EXIT_FAILED
    } else {
        0
    })
}

async fn checks(pool: &PgPool, args: &Args) -> Result<Vec<DoctorCheck>> {
    let schema = schema_check(pool).await?;
    let schema_ok = schema.verdict == Verdict::Ok;
    let mut checks = vec![schema, clock_check(pool).await?];
    // Without this build's schema, lockgate.doctor() is missing or another version's.
    if schema_ok {
        let thresholds = DoctorThresholds {
            long_running: args.long_running_threshold,
            idle_in_transaction: args.idle_in_transaction_threshold,
            alive_threshold: args.alive_threshold,
        };
        match lockgate::sql::doctor(pool, &thresholds).await {
            Ok(found) => checks.extend(found),
            // A table a check reads stayed locked past the lock timeout: the sessions check,
            // which reads only the server's activity, names who holds it (review helper-140 F2).
            Err(err) if db::lock_timed_out(&err) => {
                checks.extend(lockgate::sql::doctor_sessions(pool, &thresholds).await?);
                checks.push(DoctorCheck {
                    check: "checks".into(),
                    verdict: Verdict::Fail,
                    detail: format!(
                        "the other checks did not run: a table they read stayed locked by another session for {}                          (lock_timeout)",
                        db::READ_LOCK_TIMEOUT
                    ),
                    advice: Some(
                        "end the session holding it (see sessions; a transaction held open for less than                          --idle-in-transaction-threshold is not named there: pg_locks and pg_stat_activity show it),                          or wait for the migrate rebuilding an index, then run lockgate doctor again"
                            .into(),
                    ),
                });
                return Ok(checks);
            }
            Err(err) => return Err(err.into()),
        }
        checks.push(recurring_check(pool).await?);
        if lockgate::sql::pooler::transaction_pooling() {
            let pooled = pooled_budgets_check(pool).await?;
            checks.retain(|c| c.check != pooled.check);
            checks.push(pooled);
        }
    }
    Ok(checks)
}

/// Through a transaction-mode pooler (`pooler=transaction`), `lockgate run` cannot set its own
/// statement budgets: the role's `lock_timeout` and `statement_timeout` are its statements'
/// budgets (H28). This replaces the database's `statement_timeout` check, whose "lockgate run
/// sets its own budgets" is then untrue (review helper-136 F6).
async fn pooled_budgets_check(pool: &PgPool) -> Result<DoctorCheck> {
    let (lock, statement) = lockgate::sql::pooler::session_budgets(pool).await?;
    let shown = |ms: i64| if ms == 0 { "off (0)".to_string() } else { format!("{ms} ms") };
    let detail = format!(
        "through a transaction-mode pooler lockgate run's statements run under this role's lock_timeout {} and \
         statement_timeout {}: it cannot set budgets of its own there",
        shown(lock),
        shown(statement)
    );
    if lock > 0 && statement > 0 {
        return Ok(ok("statement_timeout", detail));
    }
    Ok(DoctorCheck {
        check: "statement_timeout".into(),
        verdict: Verdict::Warn,
        detail,
        advice: Some(
            "with either off, a producer's transaction held open on a key can hold a completion or a renewal past its \
             lease (H28): ALTER ROLE <role lockgate runs as> SET statement_timeout = '7500ms' and SET lock_timeout = \
             '3750ms' (a quarter of visibility_timeout, and the lock half of that; for the default 30 s)"
                .into(),
        ),
    })
}

/// Enabled recurring tasks whose stored schedule no scheduler can follow: `define_recurring`
/// checks only an expression's shape, so a field out of its range (`61 * * * *`) is stored, and
/// the task never ticks; the scheduler says so in its log, once per pass (review helper-116 F2).
async fn recurring_check(pool: &PgPool) -> Result<DoctorCheck> {
    let bad: Vec<String> = lockgate::sql::list_recurring(pool)
        .await?
        .into_iter()
        .filter(|t| t.enabled)
        .filter_map(|t| {
            Schedule::parse(&t.cron, &t.timezone)
                .err()
                .map(|e| format!("{} (\"{}\" in {}: {e})", t.name, t.cron, t.timezone))
        })
        .collect();
    if bad.is_empty() {
        return Ok(ok("recurring_schedules", "every enabled recurring task has a schedule it can follow".into()));
    }
    Ok(DoctorCheck {
        check: "recurring_schedules".into(),
        verdict: Verdict::Warn,
        detail: format!("{} enabled recurring task(s) never tick: {}", bad.len(), bad.join("; ")),
        advice: Some(
            "define each again with a valid cron expression and time zone (lockgate recurring add, which checks \
             both, or lockgate.define_recurring), or disable it (lockgate recurring disable)"
                .into(),
        ),
    })
}

/// The schema version and functions checksum, judged by the same `check_schema` that every other
/// command (and `lockgate run`) refuses to start without.
async fn schema_check(pool: &PgPool) -> Result<DoctorCheck> {
    let err = match lockgate::sql::check_schema(pool).await {
        Ok(lockgate::sql::SchemaFit::Exact) => {
            return Ok(ok(
                "schema",
                format!(
                    "lockgate schema version {} and SQL functions (revision {}, checksum {}) match this build",
                    lockgate::sql::LATEST_MIGRATION,
                    lockgate::sql::FUNCTIONS_REVISION,
                    lockgate::sql::functions_checksum()
                ),
            ))
        }
        Ok(lockgate::sql::SchemaFit::NewerCompatible { found }) => {
            return Ok(ok(
                "schema",
                format!(
                    "lockgate schema version {found} was migrated by a newer build of this build's compatibility \
                     version {} (this build: schema {}, functions revision {}): running on it",
                    lockgate::sql::SCHEMA_COMPAT,
                    lockgate::sql::LATEST_MIGRATION,
                    lockgate::sql::FUNCTIONS_REVISION
                ),
            ))
        }
        Err(DbError::Sqlx(err)) => return Err(err.into()),
        Err(err) => err,
    };
    let advice = if matches!(err, DbError::SchemaIncompatible { .. }) {
        "this binary is older than the database: use the lockgate release that migrated it (or a newer one)"
    } else if matches!(err, DbError::CatalogShadowed { .. }) {
        "set a search_path with pg_catalog first (or without it) for the roles and databases lockgate and its \
         producers use; the clock check below reads the shadowing schema's clock while it is there"
    } else {
        "run `lockgate migrate` with this binary (one transaction, safe to run from several processes); \
         the database's other checks run once the schema is this build's"
    };
    // Where nothing is installed, every migration is pending: the list would say nothing more.
    let pending = match err {
        DbError::NotInstalled(_) | DbError::CatalogShadowed { .. } => Vec::new(),
        _ => lockgate::sql::pending_migrations(pool).await?,
    };
    let detail =
        if pending.is_empty() { err.to_string() } else { format!("{err} (not applied: {})", pending.join(", ")) };
    Ok(DoctorCheck { check: "schema".into(), verdict: Verdict::Fail, detail, advice: Some(advice.into()) })
}

/// This host's clock against the database's, corrected by half the round trip of the fastest of
/// a few samples (which also bounds the error).
async fn clock_check(pool: &PgPool) -> Result<DoctorCheck> {
    let (mut round_trip, mut offset) = clock_sample(pool).await?;
    for _ in 1..CLOCK_SAMPLES {
        let (r, o) = clock_sample(pool).await?;
        if r < round_trip {
            (round_trip, offset) = (r, o);
        }
    }
    let seconds = offset.num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6;
    let detail = format!(
        "the database's clock is {:.3} s {} this host's (± {:.3} s)",
        seconds.abs(),
        if seconds >= 0.0 { "ahead of" } else { "behind" },
        round_trip.num_microseconds().unwrap_or(i64::MAX) as f64 / 2e6
    );
    let verdict = match offset.abs() {
        o if o > CLOCK_FAIL => Verdict::Fail,
        o if o > CLOCK_WARN => Verdict::Warn,
        _ => return Ok(ok("clock", detail)),
    };
    let advice = "leases, visibility, delays and recurring schedules run on the database's clock, and each \
                  process measures its heartbeats and job budgets with its own monotonic timers, so an offset \
                  breaks no guarantee; but this host's logs, and any run_at a producer here computes from its \
                  own clock, disagree with the database's times by that much. Keep every host and the database \
                  server synchronised with NTP (chrony, systemd-timesyncd)";
    Ok(DoctorCheck { check: "clock".into(), verdict, detail, advice: Some(advice.into()) })
}

/// One round trip and the database's offset from this host, assuming the database read its clock
/// halfway through it.
async fn clock_sample(pool: &PgPool) -> Result<(TimeDelta, TimeDelta)> {
    let before = Utc::now();
    let database = lockgate::sql::database_clock(pool).await?;
    let round_trip = Utc::now() - before;
    Ok((round_trip, database - (before + round_trip / 2)))
}

fn ok(check: &str, detail: String) -> DoctorCheck {
    DoctorCheck { check: check.into(), verdict: Verdict::Ok, detail, advice: None }
}

fn print(checks: &[DoctorCheck], json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(checks)?);
        return Ok(());
    }
    let width = checks.iter().map(|c| c.check.len()).max().unwrap_or(0);
    for c in checks {
        // A detail may quote another session's query or a process's name: escaped.
        println!("{:<4}  {:<width$}  {}", c.verdict.as_str(), c.check, table::escaped(&c.detail));
        if let Some(advice) = &c.advice {
            println!("{:<4}  {:<width$}  fix: {}", "", "", table::escaped(advice));
        }
    }
    let count = |v: Verdict| checks.iter().filter(|c| c.verdict == v).count();
    println!("\n{} ok, {} warn, {} fail", count(Verdict::Ok), count(Verdict::Warn), count(Verdict::Fail));
    Ok(())
}
