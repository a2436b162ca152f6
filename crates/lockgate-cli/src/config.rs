//! The TOML configuration of `lockgate run`. Unknown keys, bad durations and invalid names are
//! errors that name the key; nothing is silently defaulted except what is documented.
//!
//! ```toml
//! database_url = "postgres://postgres@127.0.0.1:5432/lockgate"   # optional
//! connect_timeout = "5s"          # optional; --connect-timeout / LOCKGATE_CONNECT_TIMEOUT win
//! listen_database_url = "postgres://…"  # optional: a direct URL for LISTEN when database_url
//!                                   # goes through a transaction-mode pooler (?pooler=transaction)
//!
//! [runtime]                       # every key optional; defaults shown
//! visibility_timeout = "30s"
//! heartbeat_interval = "5s"
//! shutdown_timeout = "25s"
//! poll_interval = "1s"
//! archive_retention = "7d"
//! maintenance_interval = "30s"
//! sweep_interval = "5s"
//! process_heartbeat_interval = "5s"
//! alive_threshold = "60s"
//! health_listen = "127.0.0.1:9187"  # "off" serves no health or metrics endpoints
//! max_shutdown_returns = 5          # later shutdown returns of a started run count as attempts
//! metrics_interval = "15s"          # how often /metrics' gauges are read from the database
//! metrics_max_keys = 50             # concurrency keys with a series of their own; the rest: "other"
//! max_claim_ahead_bytes = 16777216  # claimed-ahead job arguments a pool holds in memory (0: none)
//!
//! [[pool]]
//! name = "default"
//! queues = ["critical", "default"]  # strict priority order
//! concurrency = 10
//!
//! [job_types.resize_image]
//! queue = "default"
//! command = ["./resize.sh"]         # or: http = "http://127.0.0.1:8080/jobs", or: sql = "..."
//!                                   # or: http = { url = "http://…", timeout = "10s" } (default 30s)
//! max_attempts = 5
//! backoff = { base = "1s", max = "10m", jitter = 0.1 }
//! timeout = "5m"
//! priority = 0
//! concurrency = { limit = 1, key = ["account_id"], duration = "15m", on_conflict = "block" }
//! unique = { mode = "until_executed", key = ["image_id"], on_conflict = "reject" }
//!
//! [recurring.nightly_resize]       # one job per tick; the tasks are stored when `run` starts
//! cron = "30 2 * * *"               # seconds optional: "0 30 2 * * *" is the same
//! timezone = "Europe/Berlin"        # default "UTC"
//! job_type = "resize_image"
//! args = { path = "all" }           # a table: the job's JSON arguments; default {}
//! queue = "default"                 # optional: overrides the job type's queue
//! priority = 5                      # optional: overrides the job type's priority
//! enabled = true                    # optional: omitted, `lockgate recurring disable` stands
//! ```
//!
//! A configuration with a `[recurring]` table owns the tasks it lists: at start, `run` stores
//! them and removes the tasks an earlier configuration listed that this one no longer does.
//! Without any `[recurring]` table, `run` leaves the stored tasks alone.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use lockgate::config::DEFAULT_CONCURRENCY;
use lockgate::{
    Backoff, ConcurrencyPolicy, JobPolicy, JobTypeName, OnConflict, PoolConfig, QueueName, RecurringTask,
    RuntimeConfig, UniqueMode, UniqueOnConflict, UniquePolicy, DEFAULT_CONCURRENCY_DURATION, DEFAULT_TIMEZONE,
};
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub database_url: Option<String>,
    listen_database_url: Option<String>,
    connect_timeout: Option<String>,
    #[serde(default)]
    runtime: RuntimeSection,
    #[serde(default, rename = "pool")]
    pools: Vec<PoolSection>,
    #[serde(default)]
    job_types: BTreeMap<String, JobTypeSection>,
    /// `None` (no `[recurring]` table at all) leaves the stored tasks alone.
    recurring: Option<BTreeMap<String, RecurringSection>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuntimeSection {
    visibility_timeout: Option<String>,
    heartbeat_interval: Option<String>,
    shutdown_timeout: Option<String>,
    poll_interval: Option<String>,
    archive_retention: Option<String>,
    maintenance_interval: Option<String>,
    sweep_interval: Option<String>,
    process_heartbeat_interval: Option<String>,
    alive_threshold: Option<String>,
    health_listen: Option<String>,
    max_shutdown_returns: Option<u32>,
    metrics_interval: Option<String>,
    metrics_max_keys: Option<u32>,
    max_claim_ahead_bytes: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolSection {
    name: Option<String>,
    queues: Vec<String>,
    concurrency: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobTypeSection {
    queue: Option<String>,
    priority: Option<i16>,
    max_attempts: Option<u32>,
    backoff: Option<BackoffSection>,
    timeout: Option<String>,
    command: Option<Vec<String>>,
    http: Option<HttpSection>,
    sql: Option<String>,
    concurrency: Option<ConcurrencySection>,
    unique: Option<UniqueSection>,
}

/// `http = "URL"`, or `http = { url = "URL", timeout = "10s" }` to change the request deadline.
#[derive(Debug)]
enum HttpSection {
    Url(String),
    Table(HttpTable),
}

/// By hand, not `#[serde(untagged)]`: an untagged enum reports a table's misspelt key as "data did
/// not match any variant of untagged enum HttpSection" (review helper-92); the table's own
/// `deny_unknown_fields` names it.
impl<'de> Deserialize<'de> for HttpSection {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Section;
        impl<'de> serde::de::Visitor<'de> for Section {
            type Value = HttpSection;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a URL, or a table such as { url = \"https://…\", timeout = \"10s\" }")
            }

            fn visit_str<E: serde::de::Error>(self, url: &str) -> Result<HttpSection, E> {
                Ok(HttpSection::Url(url.to_string()))
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<HttpSection, A::Error> {
                HttpTable::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(HttpSection::Table)
            }
        }
        deserializer.deserialize_any(Section)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpTable {
    url: String,
    timeout: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UniqueSection {
    mode: String,
    #[serde(default)]
    key: Vec<String>,
    on_conflict: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConcurrencySection {
    limit: u32,
    #[serde(default)]
    key: Vec<String>,
    duration: Option<String>,
    on_conflict: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecurringSection {
    cron: String,
    timezone: Option<String>,
    job_type: String,
    args: Option<toml::Value>,
    queue: Option<String>,
    priority: Option<i16>,
    enabled: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BackoffSection {
    base: Option<String>,
    max: Option<String>,
    jitter: Option<f64>,
}

/// How a configured job type is executed.
#[derive(Debug, Clone, PartialEq)]
pub enum Executor {
    /// Run a program; the arguments are written to its stdin as JSON.
    Command(Vec<String>),
    /// POST the arguments as JSON to this URL; any 2xx succeeds. `timeout` is the request's
    /// deadline when configured (the executor has a default).
    Http { url: String, timeout: Option<Duration> },
    /// Run this statement with the arguments bound as `$1` (jsonb).
    Sql(String),
}

/// A configured job type: its stored policy and its executor.
#[derive(Debug, Clone)]
pub struct JobTypeConfig {
    pub name: JobTypeName,
    pub policy: JobPolicy,
    pub executor: Executor,
}

impl Config {
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("could not read config file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("invalid config file {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Self> {
        Ok(toml::from_str(text)?)
    }

    /// How long a connect may take before its cause is reported; `None` when not configured.
    pub fn connect_timeout(&self) -> Result<Option<Duration>> {
        let Some(text) = self.connect_timeout.as_deref() else { return Ok(None) };
        let timeout = duration("connect_timeout", text)?;
        if timeout.is_zero() {
            bail!("invalid connect_timeout {text:?}: a positive duration such as \"5s\"");
        }
        Ok(Some(timeout))
    }

    pub fn runtime(&self) -> Result<RuntimeConfig> {
        let r = &self.runtime;
        let d = RuntimeConfig::default();
        let config = RuntimeConfig {
            visibility_timeout: duration_or("runtime.visibility_timeout", &r.visibility_timeout, d.visibility_timeout)?,
            heartbeat_interval: duration_or("runtime.heartbeat_interval", &r.heartbeat_interval, d.heartbeat_interval)?,
            shutdown_timeout: duration_or("runtime.shutdown_timeout", &r.shutdown_timeout, d.shutdown_timeout)?,
            poll_interval: duration_or("runtime.poll_interval", &r.poll_interval, d.poll_interval)?,
            archive_retention: duration_or("runtime.archive_retention", &r.archive_retention, d.archive_retention)?,
            maintenance_interval: duration_or(
                "runtime.maintenance_interval",
                &r.maintenance_interval,
                d.maintenance_interval,
            )?,
            sweep_interval: duration_or("runtime.sweep_interval", &r.sweep_interval, d.sweep_interval)?,
            process_heartbeat_interval: duration_or(
                "runtime.process_heartbeat_interval",
                &r.process_heartbeat_interval,
                d.process_heartbeat_interval,
            )?,
            alive_threshold: duration_or("runtime.alive_threshold", &r.alive_threshold, d.alive_threshold)?,
            health_listen: health_listen(r.health_listen.as_deref())?,
            health_listen_optional: r.health_listen.is_none(),
            max_shutdown_returns: r.max_shutdown_returns.unwrap_or(d.max_shutdown_returns),
            metrics_interval: duration_or("runtime.metrics_interval", &r.metrics_interval, d.metrics_interval)?,
            metrics_max_keys: r.metrics_max_keys.unwrap_or(d.metrics_max_keys),
            listen_database_url: self.listen_database_url.clone(),
            max_claim_ahead_bytes: r.max_claim_ahead_bytes.unwrap_or(d.max_claim_ahead_bytes),
        };
        config.validate()?;
        Ok(config)
    }

    /// The configured pools; with none, one pool named `default` serving every job type's queue.
    pub fn pools(&self, job_types: &[JobTypeConfig]) -> Result<Vec<PoolConfig>> {
        if self.pools.is_empty() {
            let mut queues: Vec<QueueName> = job_types.iter().map(|j| j.policy.queue.clone()).collect();
            queues.sort();
            queues.dedup();
            if queues.is_empty() {
                bail!("nothing to run: configure at least one [[pool]] or [job_types.<name>]");
            }
            return Ok(vec![PoolConfig::new("default", queues, DEFAULT_CONCURRENCY)]);
        }
        let mut pools = Vec::new();
        for (i, p) in self.pools.iter().enumerate() {
            let queues = p.queues.iter().map(|q| QueueName::new(q.clone())).collect::<Result<Vec<_>, _>>()?;
            let name = p.name.clone().unwrap_or_else(|| format!("pool{}", i + 1));
            let pool = PoolConfig::new(name, queues, p.concurrency.unwrap_or(DEFAULT_CONCURRENCY));
            pool.validate().with_context(|| format!("[[pool]] {}", pool.name))?;
            if pools.iter().any(|p: &PoolConfig| p.name == pool.name) {
                bail!(
                    "[[pool]] {}: invalid name \"{}\": each pool a name of its own (two pools are named so)",
                    pool.name,
                    pool.name
                );
            }
            pools.push(pool);
        }
        Ok(pools)
    }

    pub fn job_types(&self) -> Result<Vec<JobTypeConfig>> {
        self.job_types.iter().map(|(name, section)| job_type(name, section)).collect()
    }

    /// The recurring tasks this configuration owns, validated; `None` without a `[recurring]` table.
    pub fn recurring(&self) -> Result<Option<Vec<RecurringTask>>> {
        let Some(sections) = &self.recurring else { return Ok(None) };
        let tasks = sections.iter().map(|(name, section)| {
            recurring_task(name, section).with_context(|| format!("invalid [recurring.{name}]"))
        });
        tasks.collect::<Result<Vec<_>>>().map(Some)
    }
}

fn recurring_task(name: &str, s: &RecurringSection) -> Result<RecurringTask> {
    let task = RecurringTask {
        timezone: s.timezone.clone().unwrap_or_else(|| DEFAULT_TIMEZONE.to_string()),
        // Checked by `validate`: a table, since the job's arguments are a JSON object.
        args: s.args.clone().map_or_else(|| Value::Object(Default::default()), json),
        queue: s.queue.clone().map(QueueName::new).transpose()?,
        priority: s.priority,
        enabled: s.enabled,
        ..RecurringTask::new(name, s.cron.clone(), s.job_type.clone())
    };
    task.validate()?;
    Ok(task)
}

/// A TOML value as JSON; a TOML date or time becomes its string, as JSON has none.
fn json(value: toml::Value) -> Value {
    match value {
        toml::Value::String(s) => Value::String(s),
        toml::Value::Integer(i) => Value::from(i),
        toml::Value::Float(f) => Value::from(f),
        toml::Value::Boolean(b) => Value::Bool(b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(items) => Value::Array(items.into_iter().map(json).collect()),
        toml::Value::Table(table) => Value::Object(table.into_iter().map(|(k, v)| (k, json(v))).collect()),
    }
}

fn job_type(name: &str, s: &JobTypeSection) -> Result<JobTypeConfig> {
    let at = |field: &str| format!("job_types.{name}.{field}");
    let name = JobTypeName::new(name)?;
    let mut policy = JobPolicy::on_queue(QueueName::new(s.queue.clone().unwrap_or_else(|| "default".into()))?);
    if let Some(p) = s.priority {
        policy.priority = p;
    }
    if let Some(m) = s.max_attempts {
        policy.max_attempts = m;
    }
    if let Some(b) = &s.backoff {
        let d = Backoff::default();
        policy.backoff = Backoff {
            base: duration_or(&at("backoff.base"), &b.base, d.base)?,
            max: duration_or(&at("backoff.max"), &b.max, d.max)?,
            jitter: b.jitter.unwrap_or(d.jitter),
        };
    }
    policy.timeout = s.timeout.as_deref().map(|t| duration(&at("timeout"), t)).transpose()?;
    if let Some(c) = &s.concurrency {
        policy.concurrency = Some(ConcurrencyPolicy {
            limit: c.limit,
            key: c.key.clone(),
            duration: duration_or(&at("concurrency.duration"), &c.duration, DEFAULT_CONCURRENCY_DURATION)?,
            on_conflict: c
                .on_conflict
                .as_deref()
                .map_or(Ok(OnConflict::Block), OnConflict::parse)
                .with_context(|| format!("job type {name}"))?,
        });
    }
    if let Some(u) = &s.unique {
        policy.unique = Some(UniquePolicy {
            mode: UniqueMode::parse(&u.mode).with_context(|| format!("job type {name}"))?,
            key: u.key.clone(),
            on_conflict: u
                .on_conflict
                .as_deref()
                .map_or(Ok(UniqueOnConflict::Reject), UniqueOnConflict::parse)
                .with_context(|| format!("job type {name}"))?,
        });
    }
    policy.validate().with_context(|| format!("job type {name}"))?;
    let executor = match (&s.command, &s.http, &s.sql) {
        (Some(cmd), None, None) if !cmd.is_empty() => Executor::Command(cmd.clone()),
        (Some(_), None, None) => bail!("{}: give the program to run, e.g. [\"./script.sh\"]", at("command")),
        (None, Some(HttpSection::Url(url)), None) => Executor::Http { url: url.clone(), timeout: None },
        (None, Some(HttpSection::Table(t)), None) => {
            let timeout = t.timeout.as_deref().map(|v| duration(&at("http.timeout"), v)).transpose()?;
            if let (Some(text), Some(Duration::ZERO)) = (&t.timeout, timeout) {
                bail!("invalid {} {text:?}: a positive duration such as \"10s\"", at("http.timeout"));
            }
            Executor::Http { url: t.url.clone(), timeout }
        }
        (None, None, Some(sql)) => Executor::Sql(sql.clone()),
        _ => bail!("job_types.{name}: give exactly one of command, http or sql"),
    };
    Ok(JobTypeConfig { name, policy, executor })
}

/// Where `lockgate run` serves /livez and /readyz: loopback by default, so a health port is
/// never exposed beyond the host unless the operator says so.
pub const DEFAULT_HEALTH_LISTEN: &str = "127.0.0.1:9187";

fn health_listen(value: Option<&str>) -> Result<Option<std::net::SocketAddr>> {
    match value.unwrap_or(DEFAULT_HEALTH_LISTEN) {
        "off" => Ok(None),
        addr => addr.parse().map(Some).with_context(|| {
            format!("invalid runtime.health_listen {addr:?}: an address such as \"127.0.0.1:9187\", or \"off\"")
        }),
    }
}

fn duration_or(field: &str, value: &Option<String>, default: Duration) -> Result<Duration> {
    value.as_deref().map_or(Ok(default), |v| duration(field, v))
}

fn duration(field: &str, value: &str) -> Result<Duration> {
    let parsed = humantime::parse_duration(value).with_context(|| {
        format!("invalid {field} {value:?}: a duration such as \"500ms\", \"30s\", \"5m\" or \"7d\"")
    })?;
    if parsed > lockgate::MAX_DURATION {
        anyhow::bail!("invalid {field} {value:?}: a duration of at most 100 years (\"36525d\")");
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        let result = Config::parse(text).and_then(|c| {
            c.runtime()?;
            let jobs = c.job_types()?;
            c.pools(&jobs)?;
            Ok(())
        });
        format!("{:#}", result.expect_err(text))
    }

    #[test]
    fn a_full_config_parses() {
        let c = Config::parse(
            r#"
            database_url = "postgres://x@h/db"
            [runtime]
            visibility_timeout = "1m"
            max_claim_ahead_bytes = 1048576
            [[pool]]
            queues = ["high", "default"]
            concurrency = 4
            [job_types.resize]
            command = ["./resize.sh", "--fast"]
            backoff = { base = "2s", max = "1h", jitter = 0.2 }
            timeout = "5m"
            concurrency = { limit = 2, key = ["account.id"], duration = "1m", on_conflict = "discard" }
            unique = { mode = "while_executing", key = ["image"], on_conflict = "discard" }
            "#,
        )
        .unwrap();
        assert_eq!(c.runtime().unwrap().visibility_timeout, Duration::from_secs(60));
        assert_eq!(c.runtime().unwrap().max_claim_ahead_bytes, 1024 * 1024);
        let jobs = c.job_types().unwrap();
        assert_eq!(jobs[0].executor, Executor::Command(vec!["./resize.sh".into(), "--fast".into()]));
        let http = Config::parse("[job_types.h]\nhttp = { url = \"http://h/\", timeout = \"10s\" }").unwrap();
        let executor = Executor::Http { url: "http://h/".into(), timeout: Some(Duration::from_secs(10)) };
        assert_eq!(http.job_types().unwrap()[0].executor, executor);
        assert_eq!(jobs[0].policy.timeout, Some(Duration::from_secs(300)));
        let concurrency = jobs[0].policy.concurrency.clone().unwrap();
        assert_eq!((concurrency.limit, concurrency.on_conflict), (2, OnConflict::Discard));
        assert_eq!(concurrency.key, vec!["account.id".to_string()]);
        assert_eq!(c.pools(&jobs).unwrap()[0].concurrency, 4);
        let unique = jobs[0].policy.unique.clone().unwrap();
        assert_eq!((unique.mode, unique.on_conflict), (UniqueMode::WhileExecuting, UniqueOnConflict::Discard));
        assert_eq!(unique.key, vec!["image".to_string()]);
    }

    #[test]
    fn bad_configs_name_the_problem() {
        assert!(err("colour = 1").contains("unknown field `colour`"));
        assert!(err("[runtime]\npoll_interval = \"soon\"").contains("invalid runtime.poll_interval \"soon\""));
        assert!(err("[runtime]\nvisibility_timeout = \"1s\"").contains("visibility_timeout"));
        assert!(err("[job_types.x]\ncommand = [\"a\"]\nhttp = \"http://h\"")
            .contains("exactly one of command, http or sql"));
        assert!(err("[job_types.x]\nsql = \"select 1\"\nmax_attempts = 0").contains("max_attempts"));
        assert!(err("[job_types.x]\nsql = \"select 1\"\nqueue = \"Bad\"").contains("invalid queue \"Bad\""));
        assert!(err("[[pool]]\nqueues = []").contains("at least one queue"));
        // Each names its pool or job type once, outside the value (review helper-92).
        assert_eq!(
            err("[[pool]]\nname = \"main\"\nqueues = [\"a\"]\nconcurrency = 0"),
            "[[pool]] main: invalid concurrency \"0\": an integer from 1 to 10000 in pool main"
        );
        // Review (helper-116, F3): sized the connection pool by it, and the start aborted.
        assert_eq!(
            err("[[pool]]\nname = \"main\"\nqueues = [\"a\"]\nconcurrency = 3000000000"),
            "[[pool]] main: invalid concurrency \"3000000000\": an integer from 1 to 10000 in pool main"
        );
        assert!(err("[[pool]]\nqueues = [\"a\", \"b\", \"a\"]")
            .contains("invalid queues \"a\": each queue once in pool pool1"));
        // Review helper-136 F3: logs, metrics and status tell pools apart by name.
        assert_eq!(
            err("[[pool]]\nname = \"a\"\nqueues = [\"x\"]\n[[pool]]\nname = \"a\"\nqueues = [\"y\"]"),
            "[[pool]] a: invalid name \"a\": each pool a name of its own (two pools are named so)"
        );
        assert!(err("[job_types.x]\nsql = \"s\"\nconcurrency = { limit = 1, on_conflict = \"blok\" }")
            .contains("job type x: invalid concurrency.on_conflict \"blok\""));
        assert!(err("[job_types.x]\nsql = \"s\"\nunique = { mode = \"always\" }")
            .contains("job type x: invalid unique.mode"));
        assert!(err("[runtime]\nhealth_listen = \"everywhere\"").contains("invalid runtime.health_listen"));
        assert!(err("[runtime]\nalive_threshold = \"1s\"").contains("alive_threshold"));
        assert!(err("[job_types.x]\nsql = \"s\"\nconcurrency = { limit = 0 }").contains("concurrency.limit"));
        assert!(err("[job_types.x]\nsql = \"s\"\nconcurrency = { limit = 1, on_conflict = \"wait\" }")
            .contains("block, discard or raise"));
        assert!(err("[job_types.x]\nsql = \"s\"\ntimeout = \"-1s\"").contains("invalid job_types.x.timeout"));
        assert!(err("[job_types.x]\nhttp = { url = \"http://h\", timeout = \"soon\" }")
            .contains("invalid job_types.x.http.timeout \"soon\""));
        // Named, not "did not match any variant of untagged enum" (review helper-92).
        assert!(err("[job_types.x]\nhttp = { url = \"http://h\", timeot = \"10s\" }")
            .contains("unknown field `timeot`, expected `url` or `timeout`"));
        assert!(err("[job_types.x]\nhttp = { ur = \"http://h\" }").contains("unknown field `ur`"));
        assert!(err("[job_types.x]\nhttp = 5").contains("invalid type: integer `5`, expected a URL, or a table"));
        assert!(err("[job_types.x]\nsql = \"s\"\nunique = { mode = \"forever\" }")
            .contains("until_executed or while_executing"));
        assert!(err("[job_types.x]\nsql = \"s\"\nunique = { mode = \"until_executed\", on_conflict = \"raise\" }")
            .contains("reject or discard"));
        assert!(err("[job_types.x]\nsql = \"s\"\nunique = { mode = \"until_executed\", key = [\"a..b\"] }")
            .contains("unique.key"));
        // Review (helper-77, #3, #8, #12): durations PostgreSQL cannot add to its clock, accepted
        // and then failing every claim of a queue, every retry, or the start with another name.
        for config in [
            "[runtime]\nvisibility_timeout = \"100000000y\"",
            "[job_types.x]\nsql = \"s\"\nconcurrency = { limit = 1, duration = \"10000000y\" }",
            "[job_types.x]\nsql = \"s\"\nbackoff = { base = \"1s\", max = \"101y\" }",
        ] {
            let error = err(config);
            let key = ["runtime.visibility_timeout", "job_types.x.concurrency.duration", "job_types.x.backoff.max"]
                .into_iter()
                .find(|key| error.contains(key));
            assert!(key.is_some() && error.contains("at most 100 years"), "{config}: {error}");
        }
    }

    fn recurring_err(section: &str) -> String {
        let text = format!("[recurring.nightly]\n{section}");
        let result = Config::parse(&text).and_then(|c| c.recurring());
        format!("{:#}", result.expect_err(&text))
    }

    #[test]
    fn recurring_tables_become_validated_tasks() {
        let c = Config::parse(
            r#"
            [recurring.nightly]
            cron = "0 30 2 * * *"
            timezone = "Europe/Berlin"
            job_type = "report"
            args = { kind = "daily", sizes = [1, 2], since = 2026-01-01 }
            queue = "reports"
            priority = 3
            enabled = false
            [recurring.hourly]
            cron = "@hourly"
            job_type = "report"
            "#,
        )
        .unwrap();
        let tasks = c.recurring().unwrap().unwrap();
        assert_eq!(tasks.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["hourly", "nightly"]);
        let (hourly, nightly) = (&tasks[0], &tasks[1]);
        assert_eq!((hourly.timezone.as_str(), &hourly.args, hourly.enabled), ("UTC", &serde_json::json!({}), None));
        assert_eq!(nightly.args, serde_json::json!({"kind": "daily", "sizes": [1, 2], "since": "2026-01-01"}));
        assert_eq!(nightly.options(), serde_json::json!({"queue": "reports", "priority": 3}));
        assert_eq!(nightly.enabled, Some(false));
        assert!(Config::parse("").unwrap().recurring().unwrap().is_none(), "no [recurring]: leave tasks alone");
        assert_eq!(Config::parse("[recurring]").unwrap().recurring().unwrap(), Some(vec![]), "owns none");
    }

    #[test]
    fn bad_recurring_tables_name_the_problem() {
        let e = recurring_err("cron = \"every day\"\njob_type = \"r\"");
        assert!(e.contains("[recurring.nightly]") && e.contains("invalid cron \"every day\""), "{e}");
        let e = recurring_err("cron = \"@daily\"\ntimezone = \"Mars/Base\"\njob_type = \"r\"");
        assert!(e.contains("invalid timezone \"Mars/Base\""), "{e}");
        let e = recurring_err("cron = \"@daily\"\njob_type = \"r\"\nargs = 5");
        assert!(e.contains("invalid args \"5\": a JSON object"), "{e}");
        let e = recurring_err("cron = \"@daily\"\njob_type = \"r\"\ncolour = 1");
        assert!(e.contains("unknown field `colour`"), "{e}");
        let e = recurring_err("job_type = \"r\"");
        assert!(e.contains("missing field `cron`"), "{e}");
        let e = recurring_err("cron = \"@daily\"\njob_type = \"r\"\npriority = 10");
        assert!(e.contains("invalid priority \"10\""), "{e}");
    }
}
