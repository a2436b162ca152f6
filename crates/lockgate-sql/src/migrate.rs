//! Installing and checking lockgate's schema.
//!
//! `migrate` holds lockgate's advisory lock from start to end, on the one connection it runs on,
//! so any number of processes may run it at once (H21): the first installs, the others wait and
//! find nothing left to do. It installs or upgrades PGMQ with the pgmq crate's embedded installer
//! (adopting PGMQ an earlier lockgate installed, and leaving alone the extension or SQL it cannot
//! version; docs/design.md section 47), applies the numbered files of `migrations/` not yet
//! recorded, then re-applies every function of `sql/` and records the schema version and a
//! checksum of those functions. Every other command calls `check_schema` first and refuses to run
//! against a missing or older schema.

use std::fmt;

use pgmq::install;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool, Row};

use crate::pooler::{on, query, query_as, query_scalar, transaction_pooling};

use crate::DbError;

struct Migration {
    version: i32,
    name: &'static str,
    /// `None` for PGMQ, which the pgmq crate's installer puts in place before lockgate's own
    /// transaction: the record says what it found and did.
    sql: Option<&'static str>,
}

const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "pgmq", sql: None },
    Migration {
        version: 2,
        name: "lockgate_schema",
        sql: Some(include_str!("../../../migrations/0002_lockgate_schema.sql")),
    },
    Migration { version: 3, name: "concurrency", sql: Some(include_str!("../../../migrations/0003_concurrency.sql")) },
    Migration { version: 4, name: "processes", sql: Some(include_str!("../../../migrations/0004_processes.sql")) },
    Migration {
        version: 5,
        name: "batched_promotion",
        sql: Some(include_str!("../../../migrations/0005_batched_promotion.sql")),
    },
    Migration { version: 6, name: "claim_index", sql: Some(include_str!("../../../migrations/0006_claim_index.sql")) },
    Migration { version: 7, name: "job_ids", sql: Some(include_str!("../../../migrations/0007_job_ids.sql")) },
    Migration {
        version: 8,
        name: "fenced_leases",
        sql: Some(include_str!("../../../migrations/0008_fenced_leases.sql")),
    },
    Migration {
        version: 9,
        name: "started_runs",
        sql: Some(include_str!("../../../migrations/0009_started_runs.sql")),
    },
    Migration {
        version: 10,
        name: "uniqueness_batches",
        sql: Some(include_str!("../../../migrations/0010_uniqueness_batches.sql")),
    },
    Migration { version: 11, name: "recurring", sql: Some(include_str!("../../../migrations/0011_recurring.sql")) },
    Migration {
        version: 12,
        name: "pause_and_return_cap",
        sql: Some(include_str!("../../../migrations/0012_pause_and_return_cap.sql")),
    },
    Migration { version: 13, name: "job_lookup", sql: Some(include_str!("../../../migrations/0013_job_lookup.sql")) },
    Migration {
        version: 14,
        name: "job_history_cancel",
        sql: Some(include_str!("../../../migrations/0014_job_history_cancel.sql")),
    },
    Migration {
        version: 15,
        name: "unique_lock_hold",
        sql: Some(include_str!("../../../migrations/0015_unique_lock_hold.sql")),
    },
    Migration { version: 16, name: "sweep_state", sql: Some(include_str!("../../../migrations/0016_sweep_state.sql")) },
    Migration {
        version: 17,
        name: "batch_totals",
        sql: Some(include_str!("../../../migrations/0017_batch_totals.sql")),
    },
    Migration {
        version: 18,
        name: "leases_without_foreign_key",
        sql: Some(include_str!("../../../migrations/0018_leases_without_foreign_key.sql")),
    },
    Migration {
        version: 19,
        name: "key_row_guards",
        sql: Some(include_str!("../../../migrations/0019_key_row_guards.sql")),
    },
    Migration {
        version: 20,
        name: "key_changes_refused",
        sql: Some(include_str!("../../../migrations/0020_key_changes_refused.sql")),
    },
    Migration { version: 21, name: "claim_rank", sql: Some(include_str!("../../../migrations/0021_claim_rank.sql")) },
    Migration {
        version: 22,
        name: "claim_index_probe",
        sql: Some(include_str!("../../../migrations/0022_claim_index_probe.sql")),
    },
    Migration {
        version: 23,
        name: "finished_leases",
        sql: Some(include_str!("../../../migrations/0023_finished_leases.sql")),
    },
    Migration {
        version: 24,
        name: "batch_outcomes",
        sql: Some(include_str!("../../../migrations/0024_batch_outcomes.sql")),
    },
    Migration {
        version: 25,
        name: "unique_keys_first",
        sql: Some(include_str!("../../../migrations/0025_unique_keys_first.sql")),
    },
    Migration {
        version: 26,
        name: "running_unique_locks",
        sql: Some(include_str!("../../../migrations/0026_running_unique_locks.sql")),
    },
    Migration {
        version: 27,
        name: "shared_key_holders",
        sql: Some(include_str!("../../../migrations/0027_shared_key_holders.sql")),
    },
    Migration {
        version: 28,
        name: "batch_membership_messages",
        sql: Some(include_str!("../../../migrations/0028_batch_membership_messages.sql")),
    },
];

/// The functions of `sql/`, applied in this order on every migrate.
const FUNCTIONS: &[&str] = &[
    include_str!("../../../sql/001_queues.sql"),
    include_str!("../../../sql/002_job_types.sql"),
    include_str!("../../../sql/010_enqueue.sql"),
    include_str!("../../../sql/015_concurrency.sql"),
    include_str!("../../../sql/016_uniqueness.sql"),
    include_str!("../../../sql/017_batches.sql"),
    include_str!("../../../sql/020_claim.sql"),
    include_str!("../../../sql/030_extend.sql"),
    include_str!("../../../sql/040_complete.sql"),
    include_str!("../../../sql/041_retry.sql"),
    include_str!("../../../sql/042_dead_letter.sql"),
    include_str!("../../../sql/043_release.sql"),
    include_str!("../../../sql/045_cancel.sql"),
    include_str!("../../../sql/046_statements.sql"),
    include_str!("../../../sql/050_dlq.sql"),
    include_str!("../../../sql/060_status.sql"),
    include_str!("../../../sql/065_keys.sql"),
    include_str!("../../../sql/066_metrics.sql"),
    include_str!("../../../sql/068_jobs.sql"),
    include_str!("../../../sql/069_doctor.sql"),
    include_str!("../../../sql/070_archive_retention.sql"),
    include_str!("../../../sql/080_sweep.sql"),
    include_str!("../../../sql/090_processes.sql"),
    include_str!("../../../sql/100_recurring.sql"),
    include_str!("../../../sql/110_retire.sql"),
];

/// The schema version this build expects.
pub const LATEST_MIGRATION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The schema compatibility version this build speaks (docs/design.md §44). Within one
/// compatibility version, migrations only add (tables, nullable columns or columns with a
/// default, functions, arguments with defaults) and every function keeps its signature and
/// meaning, so a process of an older build keeps working against a schema a newer build
/// migrated: a rolling deploy migrates first, and old and new processes run side by side. Not
/// allowed without a bump: dropping or retyping a column, a new NOT NULL column without a default,
/// a constraint or trigger that refuses what older code writes (Rust writes `lockgate.settings`
/// and `lockgate.schema_state` directly), changing what a function returns or does. Bump it, in
/// the same change, when a migration or a function rewrite breaks that: older processes are then
/// refused with both versions named.
pub const SCHEMA_COMPAT: i32 = 1;

/// The revision of the SQL functions (`sql/`), bumped with every change to them, since most
/// function changes ship without a numbered migration: a build's schema is (its last migration,
/// this revision), and a database migrated by a build with a higher one is newer, not "different"
/// (so an older process runs on it within its compatibility version, and an older `migrate` leaves
/// it alone instead of putting its older functions back). `functions_are_pinned_to_their_revision`
/// fails when `sql/` changes without a bump.
pub const FUNCTIONS_REVISION: i32 = 129;

/// A fixed key for the migration advisory lock ("lockgate" in ASCII).
const MIGRATE_LOCK_KEY: i64 = 0x6c6f_636b_6761_7465;

/// Tables the migrator itself needs before it can read what is applied.
const BOOTSTRAP: &str = "
CREATE SCHEMA IF NOT EXISTS lockgate;
CREATE TABLE IF NOT EXISTS lockgate.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    note       text,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS lockgate.schema_state (
    singleton          boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    migration          integer NOT NULL,
    functions_checksum text NOT NULL,
    migrated_at        timestamptz NOT NULL DEFAULT now()
);
";

/// Columns of `lockgate.schema_state` added after it first shipped, with what NULL (a database
/// last migrated before them) reads as: the compatibility version (1) and the functions' revision
/// (0). Added only where missing, so a migrate with nothing to do takes no ACCESS EXCLUSIVE lock.
const STATE_COLUMNS: &[&str] = &["compat", "functions_revision"];

/// The PGMQ version migration 0001 installed, from SQL vendored in this repository, before PGMQ
/// came from the pgmq crate: a database it migrated has that PGMQ and no installer's record of it.
const VENDORED_PGMQ: &str = "1.11.1";

/// What a migrate run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    /// Names of the numbered migrations this run applied.
    pub applied: Vec<String>,
    /// What it found of PGMQ and did with it.
    pub pgmq: PgmqStep,
    /// The database's schema version when a newer, compatible build had migrated it: nothing was
    /// done.
    pub newer: Option<i32>,
}

/// What `migrate` did with PGMQ (docs/design.md section 47).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgmqStep {
    /// It was missing: installed by the pgmq crate's installer, at this version.
    Installed { version: String },
    /// Recorded by the pgmq crate's installer (or installed by an earlier lockgate, and recorded
    /// now) and already at the version the installer carries.
    Current { version: String },
    /// Recorded by the pgmq crate's installer, and upgraded with upstream's scripts.
    Upgraded { from: String, to: String },
    /// The pgmq extension, or SQL that no installer recorded: left as it was.
    LeftAsFound { how: &'static str },
    /// Not looked at: a newer build migrated this database.
    NotChecked,
}

impl fmt::Display for PgmqStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Installed { version } => write!(f, "PGMQ {version} installed by the pgmq crate"),
            Self::Current { version } => write!(f, "PGMQ {version} is up to date"),
            Self::Upgraded { from, to } => write!(f, "PGMQ upgraded from {from} to {to} by the pgmq crate"),
            Self::LeftAsFound { how } => write!(f, "PGMQ was already installed {how}; left as it was"),
            Self::NotChecked => write!(f, "PGMQ not checked: a newer build migrated this database"),
        }
    }
}

/// How PGMQ is present, as `migrate` finds it under its lock.
enum FoundPgmq {
    Missing,
    /// Recorded in `pgmq.__pgmq_migrations` by the pgmq crate's installer.
    Recorded,
    /// Installed by an earlier lockgate from its vendored SQL (`VENDORED_PGMQ`).
    Vendored,
    /// Installed some other way; the installer must not run over it.
    Foreign(&'static str),
}

/// How a database's schema fits this build (`check_schema`), when it can run on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaFit {
    /// This build's migrations and functions.
    Exact,
    /// Migrated by a newer build of this compatibility version (schema version `found`).
    NewerCompatible { found: i32 },
}

/// A schema newer than this build (`found`, migrated by a build of compatibility version
/// `compat`): fine when it speaks this build's compatibility version, refused otherwise.
fn newer_schema(found: i32, compat: Option<i32>) -> Result<(), DbError> {
    let compat = compat.unwrap_or(1);
    if compat == SCHEMA_COMPAT {
        tracing::info!(
            found,
            expected = LATEST_MIGRATION,
            compat,
            "the schema is newer than this build and compatible with it: running on it"
        );
        return Ok(());
    }
    Err(DbError::SchemaIncompatible {
        found,
        found_compat: compat,
        expected: LATEST_MIGRATION,
        expected_compat: SCHEMA_COMPAT,
    })
}

/// FNV-1a over the function files: a stable fingerprint, not a security measure.
pub fn functions_checksum() -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in FUNCTIONS.iter().flat_map(|f| f.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// Installs or upgrades everything lockgate needs in this database.
pub async fn migrate(pool: &PgPool) -> Result<MigrateReport, DbError> {
    // Its lock is a session's, and PGMQ's installer prepares statements as sqlx does: neither
    // survives a pooler that lends a server connection per transaction.
    if transaction_pooling() {
        return Err(DbError::MigrateThroughPooler);
    }
    // PGMQ's installer takes a pool and opens transactions of its own on it. It gets a pool of
    // one connection, the one that holds lockgate's lock: a session-level lock, so that it spans
    // lockgate's transactions and the installer's. No ping before handing the connection out (a
    // failed one would be replaced by a connection without the lock); closing the pool ends the
    // session, and the lock with it, however the run ends.
    let locked = PgPoolOptions::new()
        .max_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .test_before_acquire(false)
        .connect_with(pool.connect_options().as_ref().clone())
        .await?;
    let report = migrate_locked(&locked).await;
    // Given back before the session ends, as it would be then: should the URL go through a
    // transaction-mode pooler that it does not name, the session outlives this pool on the
    // pooler's server, and its lock with it (review helper-136 F4).
    let _ = query("SELECT pg_advisory_unlock($1)").bind(MIGRATE_LOCK_KEY).execute(&locked).await;
    locked.close().await;
    report
}

/// Takes lockgate's migrate lock on the session of `locked`, waiting for another migrate for as
/// long as it runs (in the server's queue of waiters, as `pg_advisory_lock` waits). A holder still
/// there after `NAME_HOLDER_AFTER` is named once in the log: it may be no migrate at all but a
/// session a transaction-mode pooler keeps open, whose migrate ran through a URL that did not say
/// `pooler=transaction` (review helper-136 F4: every later migrate waited for it in silence). The
/// first wait runs in a transaction with its own `lock_timeout`; the lock it takes is the
/// session's, kept past that transaction's commit.
async fn take_migrate_lock(locked: &PgPool) -> Result<(), DbError> {
    let mut tx = locked.begin().await?;
    query(&format!("SET LOCAL lock_timeout = '{}ms'", NAME_HOLDER_AFTER.as_millis())).execute(&mut *tx).await?;
    match query("SELECT pg_advisory_lock($1)").bind(MIGRATE_LOCK_KEY).execute(&mut *tx).await {
        Ok(_) => {
            tx.commit().await?;
            return Ok(());
        }
        Err(err) if err.as_database_error().and_then(|e| e.code()).as_deref() == Some("55P03") => {
            tx.rollback().await?;
        }
        Err(err) => return Err(err.into()),
    }
    let holder: Option<LockHolder> = query_as(
        "SELECT a.pid, a.state, a.application_name, extract(epoch FROM now() - a.state_change)::float8
           FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
          WHERE l.locktype = 'advisory' AND l.granted AND l.database = (SELECT oid FROM pg_database
                                                                         WHERE datname = current_database())
            AND l.classid = ($1 >> 32)::oid AND l.objid = ($1 & 4294967295)::oid AND l.objsubid = 1
          LIMIT 1",
    )
    .bind(MIGRATE_LOCK_KEY)
    .fetch_optional(locked)
    .await?;
    if let Some((pid, state, application, seconds)) = holder {
        tracing::warn!(
            pid,
            state = state.as_deref().unwrap_or("?"),
            application = application.as_deref().unwrap_or(""),
            seconds = seconds.unwrap_or(0.0).round(),
            "waiting for lockgate's migrate lock, which backend {pid} holds: another migrate at work, or a \
             session a transaction-mode pooler keeps (a migrate run through a pooler URL that did not say \
             pooler=transaction); if it is no migrate at work, end it: SELECT pg_terminate_backend({pid})"
        );
    }
    query("SELECT pg_advisory_lock($1)").bind(MIGRATE_LOCK_KEY).execute(locked).await?;
    Ok(())
}

/// The backend holding the migrate lock: pid, state, application name, seconds in that state.
type LockHolder = (i32, Option<String>, Option<String>, Option<f64>);

/// How long migrate waits for its lock before it names the session holding it.
const NAME_HOLDER_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

async fn migrate_locked(locked: &PgPool) -> Result<MigrateReport, DbError> {
    // On the pool's one connection, which every transaction below runs on.
    take_migrate_lock(locked).await?;
    let mut tx = locked.begin().await?;
    sqlx::raw_sql(BOOTSTRAP).execute(&mut *tx).await?;
    let present: Vec<String> = query_scalar(
        "SELECT attname::text FROM pg_attribute
          WHERE attrelid = 'lockgate.schema_state'::regclass AND attnum > 0 AND NOT attisdropped",
    )
    .fetch_all(&mut *tx)
    .await?;
    for column in STATE_COLUMNS.iter().filter(|c| !present.iter().any(|p| p == *c)) {
        sqlx::raw_sql(&format!("ALTER TABLE lockgate.schema_state ADD COLUMN IF NOT EXISTS {column} integer"))
            .execute(&mut *tx)
            .await?;
    }
    // A binary older than the database must not rewrite newer functions with its own: against a
    // compatible schema it has nothing to do (a rolling deploy's old processes may run migrate at
    // start), against an incompatible one it is refused. Nor does it touch PGMQ.
    let recorded: Option<(i32, Option<i32>, Option<i32>)> =
        query_as("SELECT migration, functions_revision, compat FROM lockgate.schema_state")
            .fetch_optional(&mut *tx)
            .await?;
    if let Some((found, revision, compat)) = recorded {
        if (found, revision.unwrap_or(0)) > (LATEST_MIGRATION, FUNCTIONS_REVISION) {
            newer_schema(found, compat)?;
            tx.commit().await?;
            return Ok(MigrateReport { applied: Vec::new(), pgmq: PgmqStep::NotChecked, newer: Some(found) });
        }
    }
    let found = found_pgmq(&mut tx).await?;
    tx.commit().await?;
    let pgmq = install_pgmq(locked, found).await?;

    let note = pgmq.to_string();
    let mut attempt = 1;
    let applied = loop {
        match apply(locked, &note).await {
            Err(err) if waited_for_a_lock(&err) && attempt < MIGRATE_ATTEMPTS => {
                tokio::time::sleep(std::time::Duration::from_millis(100 * u64::from(attempt.min(10)))).await;
                attempt += 1;
            }
            Err(err) if waited_for_a_lock(&err) => return Err(DbError::MigrateBlocked { attempts: attempt }),
            other => break other?,
        }
    };
    Ok(MigrateReport { applied, pgmq, newer: None })
}

/// Attempts of [`apply`] before migrate gives up on a lock other transactions keep holding.
const MIGRATE_ATTEMPTS: u32 = 30;

/// The tables each migration alters (an index, a column, a trigger, a constraint), which the
/// paths write. A migration that holds one of them while it waits for another closes a cycle with
/// any path that holds the second and waits for the first (an enqueue updates the key's row, then
/// adds its lease; a completion deletes its lease, then gives the permit back; a producer writes a
/// batch membership, then enqueues): under a steady stream of limited enqueues each attempt timed
/// out (review helper-141 F2, and helper-146 F2 for migrations 27 and 28 together). [`apply`]
/// takes the tables of every pending migration at once first, without queueing (docs/design.md
/// §127). Migrations 21 and 22 rebuild each queue's claim index, tables not known here: they queue
/// for them as before.
const LOCKED_TOGETHER: &[(i32, &[&str])] = &[
    (14, &["lockgate.dead_letters"]),
    (15, &["lockgate.unique_locks"]),
    (16, &["lockgate.leases"]),
    (17, &["lockgate.batches"]),
    (18, &["lockgate.semaphores", "lockgate.leases"]),
    (19, &["lockgate.semaphores", "lockgate.leases"]),
    (20, &["lockgate.semaphores", "lockgate.leases"]),
    (23, &["lockgate.leases"]),
    (24, &["lockgate.batch_jobs"]),
    (26, &["lockgate.unique_locks"]),
    (27, &["lockgate.semaphores", "lockgate.leases"]),
    (28, &["lockgate.batch_jobs"]),
];

/// How long [`apply`] tries to take the tables of [`LOCKED_TOGETHER`] at once before it lets the
/// migrations queue for them one by one under `lock_timeout`, and how often it tries.
const LOCK_PROBES_FOR: std::time::Duration = std::time::Duration::from_millis(500);
const LOCK_PROBE_EVERY: std::time::Duration = std::time::Duration::from_millis(5);

/// Takes the existing tables of `tables` in ACCESS EXCLUSIVE mode, all in one `LOCK ... NOWAIT`
/// tried again every few milliseconds: a try that finds one of them in use fails at once and
/// queues for nothing, so no path waits behind it and no cycle can form. Past `LOCK_PROBES_FOR`
/// without them, it gives up, and the caller's statements wait for them one by one as before
/// (bounded by `lock_timeout`).
async fn lock_together(tx: &mut PgConnection, tables: &[&str]) -> Result<(), sqlx::Error> {
    let present: Vec<String> = query_scalar("SELECT t FROM unnest($1::text[]) AS t WHERE to_regclass(t) IS NOT NULL")
        .bind(tables.iter().map(|t| (*t).to_string()).collect::<Vec<_>>())
        .fetch_all(&mut *tx)
        .await?;
    if present.is_empty() {
        return Ok(());
    }
    // The names are this file's constants, never input.
    let lock = format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE NOWAIT", present.join(", "));
    let until = std::time::Instant::now() + LOCK_PROBES_FOR;
    loop {
        query("SAVEPOINT lock_together").execute(&mut *tx).await?;
        match query(&lock).execute(&mut *tx).await {
            Ok(_) => {
                return query("RELEASE SAVEPOINT lock_together").execute(&mut *tx).await.map(drop);
            }
            Err(err) if err.as_database_error().and_then(|e| e.code()).is_some_and(|code| code == "55P03") => {
                query("ROLLBACK TO SAVEPOINT lock_together").execute(&mut *tx).await?;
                if std::time::Instant::now() >= until {
                    return Ok(());
                }
                tokio::time::sleep(LOCK_PROBE_EVERY).await;
            }
            Err(err) => return Err(err),
        }
    }
}

/// The migrations not yet applied, then every function, in one transaction; returns the names
/// of the migrations applied. A migration's DDL on a table lockgate's paths write (a trigger on
/// the semaphores, say) waits for every transaction that has written it, and every later
/// statement on the table queues behind that wait: one open producer transaction would stall
/// every claim and completion until it ended, and two such locks, taken in the opposite order of
/// a completion's, can deadlock with it. So no lock is waited for longer than `lock_timeout`
/// here: the attempt is undone (holding nothing) and run again by [`migrate`], a little later.
async fn apply(locked: &PgPool, pgmq_note: &str) -> Result<Vec<String>, sqlx::Error> {
    let mut tx = locked.begin().await?;
    // At once on this session, which holds the lock. Should the pool have replaced a connection
    // that broke since, this one waits for its turn like any other migrate (and reads what is
    // applied only now).
    query("SELECT pg_advisory_xact_lock($1)").bind(MIGRATE_LOCK_KEY).execute(&mut *tx).await?;
    query("SET LOCAL lock_timeout = '500ms'").execute(&mut *tx).await?;
    let applied: Vec<i32> = query_scalar("SELECT version FROM lockgate.schema_migrations").fetch_all(&mut *tx).await?;
    let mut together: Vec<&str> = LOCKED_TOGETHER
        .iter()
        .filter(|(version, _)| !applied.contains(version))
        .flat_map(|(_, tables)| tables.iter().copied())
        .collect();
    together.sort_unstable();
    together.dedup();
    if !together.is_empty() {
        lock_together(&mut tx, &together).await?;
    }
    let mut names = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)) {
        let note = match m.sql {
            Some(sql) => {
                sqlx::raw_sql(sql).execute(&mut *tx).await?;
                None
            }
            None => Some(pgmq_note),
        };
        query("INSERT INTO lockgate.schema_migrations (version, name, note) VALUES ($1, $2, $3)")
            .bind(m.version)
            .bind(m.name)
            .bind(note)
            .execute(&mut *tx)
            .await?;
        names.push(m.name.to_string());
    }
    for functions in FUNCTIONS {
        sqlx::raw_sql(functions).execute(&mut *tx).await?;
    }
    query(
        "INSERT INTO lockgate.schema_state (migration, functions_checksum, compat, functions_revision)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (singleton) DO UPDATE SET migration = $1, functions_checksum = $2, compat = $3,
                                               functions_revision = $4, migrated_at = now()",
    )
    .bind(LATEST_MIGRATION)
    .bind(functions_checksum())
    .bind(SCHEMA_COMPAT)
    .bind(FUNCTIONS_REVISION)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(names)
}

/// A lock waited for past `lock_timeout` (55P03), or a deadlock PostgreSQL broke by failing this
/// transaction (40P01).
fn waited_for_a_lock(err: &sqlx::Error) -> bool {
    err.as_database_error().and_then(|e| e.code()).is_some_and(|code| code == "55P03" || code == "40P01")
}

/// What is there of PGMQ. The extension is never run over by the SQL installer (its objects
/// belong to the extension); SQL the installer did not record is adopted only when an earlier
/// lockgate installed it, since only then is its version known. An empty record table (left by
/// the crate's `installed_version` on a database it did not install) records nothing.
async fn found_pgmq(conn: &mut PgConnection) -> Result<FoundPgmq, DbError> {
    let (extension, meta, table): (bool, bool, bool) = query_as(
        "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pgmq'), to_regclass('pgmq.meta') IS NOT NULL,
                to_regclass('pgmq.__pgmq_migrations') IS NOT NULL",
    )
    .fetch_one(&mut *conn)
    .await?;
    if extension {
        return Ok(FoundPgmq::Foreign("as the pgmq extension"));
    }
    if table && query_scalar("SELECT EXISTS (SELECT 1 FROM pgmq.__pgmq_migrations)").fetch_one(&mut *conn).await? {
        return Ok(FoundPgmq::Recorded);
    }
    if !meta {
        return Ok(FoundPgmq::Missing);
    }
    // Migration 0001 recorded without a note: it ran the vendored SQL (a note says it skipped).
    let vendored: bool =
        query_scalar("SELECT EXISTS (SELECT 1 FROM lockgate.schema_migrations WHERE version = 1 AND note IS NULL)")
            .fetch_one(&mut *conn)
            .await?;
    Ok(if vendored { FoundPgmq::Vendored } else { FoundPgmq::Foreign("as SQL that no installer recorded") })
}

/// Runs the pgmq crate's embedded installer where it may: a fresh install, or upstream's upgrade
/// scripts from the recorded version to the one the crate carries (none where it is current).
async fn install_pgmq(locked: &PgPool, found: FoundPgmq) -> Result<PgmqStep, DbError> {
    match found {
        FoundPgmq::Foreign(how) => return Ok(PgmqStep::LeftAsFound { how }),
        FoundPgmq::Missing => {
            install::install_sql_from_embedded(locked).await?;
            return Ok(PgmqStep::Installed { version: installed_pgmq(locked).await? });
        }
        // Recorded as if the installer had installed it, so that it runs only the upgrades.
        FoundPgmq::Vendored => install::init_migrations_table(locked, VENDORED_PGMQ.parse()?).await?,
        FoundPgmq::Recorded => {}
    }
    let from = installed_pgmq(locked).await?;
    install::install_sql_from_embedded(locked).await?;
    let to = installed_pgmq(locked).await?;
    Ok(if from == to { PgmqStep::Current { version: to } } else { PgmqStep::Upgraded { from, to } })
}

/// The PGMQ version the installer has recorded.
async fn installed_pgmq(locked: &PgPool) -> Result<String, DbError> {
    install::installed_version(locked)
        .await?
        .map(|version| version.to_string())
        .ok_or_else(|| DbError::PgmqInstall("the installer recorded no version".into()))
}

/// The numbered migrations this build carries that the database has not recorded, by number and
/// name (all of them where lockgate was never installed), for `lockgate doctor`.
pub async fn pending_migrations(pool: &PgPool) -> Result<Vec<String>, DbError> {
    let installed: bool =
        query_scalar("SELECT to_regclass('lockgate.schema_migrations') IS NOT NULL").fetch_one(pool).await?;
    let applied: Vec<i32> = if installed {
        query_scalar("SELECT version FROM lockgate.schema_migrations").fetch_all(pool).await?
    } else {
        Vec::new()
    };
    Ok(MIGRATIONS
        .iter()
        .filter(|m| !applied.contains(&m.version))
        .map(|m| format!("{:04}_{}", m.version, m.name))
        .collect())
}

/// Refuses a database where lockgate or PGMQ is missing, older, newer, or whose functions differ.
pub async fn check_schema(pool: &PgPool) -> Result<SchemaFit, DbError> {
    on(pool.into(), check_schema_on).await
}

async fn check_schema_on(conn: &mut PgConnection) -> Result<SchemaFit, DbError> {
    // The first schema the session resolves names in, temporary ones aside: pg_catalog unless the
    // search_path lists another before it. PGMQ's table is looked up in the catalog, not by
    // to_regclass, which needs a privilege on its schema that a producer's role lacks (README, "A
    // producer's role").
    let row = query(
        "SELECT to_regclass('lockgate.schema_state') IS NOT NULL,
                EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                         WHERE n.nspname = 'pgmq' AND c.relname = 'meta'),
                (SELECT s FROM unnest(current_schemas(true)) s WHERE s NOT LIKE 'pg\\_temp%' LIMIT 1),
                current_setting('search_path')",
    )
    .fetch_one(&mut *conn)
    .await?;
    let first: Option<String> = row.get(2);
    if first.as_deref().is_some_and(|first| first != "pg_catalog") {
        // lockgate's functions call now(), clock_timestamp() and the rest unqualified: a schema
        // ahead of pg_catalog may define its own, and leases, visibility and enqueue times would
        // follow its clock (review helper-80).
        return Err(DbError::CatalogShadowed { first: first.unwrap_or_default(), search_path: row.get(3) });
    }
    if !row.get::<bool, _>(0) {
        return Err(DbError::NotInstalled("no lockgate schema found".into()));
    }
    if !row.get::<bool, _>(1) {
        return Err(DbError::NotInstalled("PGMQ is missing".into()));
    }
    // Columns added since the table first shipped read as NULL where a database lacks them.
    let present: Vec<String> = query_scalar(
        "SELECT attname::text FROM pg_attribute
          WHERE attrelid = 'lockgate.schema_state'::regclass AND attnum > 0 AND NOT attisdropped",
    )
    .fetch_all(&mut *conn)
    .await?;
    let column = |name: &str| if present.iter().any(|p| p == name) { name.to_string() } else { "NULL::integer".into() };
    let state = query(&format!(
        "SELECT migration, functions_checksum, {}, {} FROM lockgate.schema_state",
        column("compat"),
        column("functions_revision")
    ))
    .fetch_optional(&mut *conn)
    .await?;
    let Some(state) = state else {
        return Err(DbError::NotInstalled("the schema was never completely migrated".into()));
    };
    let found: i32 = state.get(0);
    let revision = state.get::<Option<i32>, _>(3).unwrap_or(0);
    if found < LATEST_MIGRATION {
        return Err(DbError::SchemaOutdated { found, expected: LATEST_MIGRATION });
    }
    if (found, revision) > (LATEST_MIGRATION, FUNCTIONS_REVISION) {
        // Its functions are the newer build's (their checksum is not this build's): compatible
        // ones keep the signatures and meaning this build relies on.
        newer_schema(found, state.get(2))?;
        return Ok(SchemaFit::NewerCompatible { found });
    }
    // An older revision of the functions, or the same revision with other functions (a
    // development build): this build's must be installed first.
    if revision < FUNCTIONS_REVISION || state.get::<String, _>(1) != functions_checksum() {
        return Err(DbError::FunctionsOutdated);
    }
    Ok(SchemaFit::Exact)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksum of the functions at `FUNCTIONS_REVISION`. A change to `sql/` fails this test:
    /// bump `FUNCTIONS_REVISION` and set this to the new checksum, in the same change.
    const PINNED_CHECKSUM: &str = "1fb2248c90411deb";

    #[test]
    fn functions_are_pinned_to_their_revision() {
        assert_eq!(
            (functions_checksum().as_str(), FUNCTIONS_REVISION),
            (PINNED_CHECKSUM, FUNCTIONS_REVISION),
            "sql/ changed: bump FUNCTIONS_REVISION and set PINNED_CHECKSUM to the new checksum"
        );
    }
}
