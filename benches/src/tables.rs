//! What a workload leaves in its tables: sizes (heap, each index, everything with TOAST) and the
//! counters of `pg_stat_user_tables` (dead rows, updates, HOT updates). The burst and churn
//! workloads report them for the queue tables and for [`LOCKGATE_TABLES`].
//!
//! The counters reach the shared view when a backend flushes its statistics: at most about a
//! second after its transaction while it is busy, at once when it exits. Read while the measured
//! sessions run, they lag by that much; read after `BenchDb::settle`, they are complete.

use std::collections::BTreeMap;

use anyhow::Result;
use lockgate::PgPool;

/// The lockgate tables the claim (`sql/020_claim.sql`), heartbeat (`030_extend.sql`) and
/// completion (`040_complete.sql`) paths write, beside the queue and archive tables: leases,
/// permits and parked jobs of limited types, uniqueness locks, batches. A job with none of these
/// (the benchmark's no-op jobs) leaves them untouched, which is worth checking too.
pub const LOCKGATE_TABLES: [&str; 6] = [
    "lockgate.leases",
    "lockgate.semaphores",
    "lockgate.parked",
    "lockgate.unique_locks",
    "lockgate.batches",
    "lockgate.batch_jobs",
];

/// One table's counters in `pg_stat_user_tables`, cumulative since the database was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub dead_rows: i64,
    pub updates: i64,
    pub hot_updates: i64,
}

impl Counters {
    /// Updates and HOT updates from `before` to `self` (dead rows are a level, not a count).
    pub fn since(&self, before: &Self) -> Self {
        Self {
            dead_rows: self.dead_rows,
            updates: self.updates - before.updates,
            hot_updates: self.hot_updates - before.hot_updates,
        }
    }

    /// The share of updates that were HOT, in percent (none when nothing was updated).
    pub fn hot_percent(&self) -> Option<f64> {
        (self.updates > 0).then(|| 100.0 * self.hot_updates as f64 / self.updates as f64)
    }
}

/// The counters of `tables` (`schema.name`), by name; a table the view does not list is absent.
pub async fn counters(pool: &PgPool, tables: &[&str]) -> Result<BTreeMap<String, Counters>> {
    let mut conn = pool.acquire().await?;
    // A fresh read: a session keeps its statistics snapshot until the transaction ends, and the
    // pool's connection may have read them before.
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&mut *conn).await?;
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT schemaname || '.' || relname, n_dead_tup, n_tup_upd, n_tup_hot_upd
           FROM pg_stat_user_tables WHERE schemaname || '.' || relname = ANY ($1)",
    )
    .bind(tables)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, dead_rows, updates, hot_updates)| (name, Counters { dead_rows, updates, hot_updates }))
        .collect())
}

/// A table's size on disk, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sizes {
    /// The main fork alone (`pg_relation_size`).
    pub heap: i64,
    /// Each index (`pg_relation_size`), by name, in name order.
    pub indexes: Vec<(String, i64)>,
    /// Heap, indexes, TOAST and the free space and visibility maps (`pg_total_relation_size`).
    pub total: i64,
}

impl Sizes {
    /// "heap 0 KiB, indexes 2,208 KiB (q_bench_pkey 1,104, …), total 2,232 KiB"
    pub fn describe(&self) -> String {
        let indexes: Vec<String> = self.indexes.iter().map(|(name, bytes)| format!("{name} {}", kib(*bytes))).collect();
        let sum: i64 = self.indexes.iter().map(|(_, bytes)| bytes).sum();
        format!(
            "heap {} KiB, indexes {} KiB ({}), total {} KiB",
            kib(self.heap),
            kib(sum),
            indexes.join(", "),
            kib(self.total)
        )
    }
}

/// The sizes of `table` (`schema.name`).
pub async fn sizes(pool: &PgPool, table: &str) -> Result<Sizes> {
    let (heap, total): (i64, i64) =
        sqlx::query_as("SELECT pg_relation_size($1::regclass), pg_total_relation_size($1::regclass)")
            .bind(table)
            .fetch_one(pool)
            .await?;
    let indexes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT c.relname::text, pg_relation_size(i.indexrelid)
           FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
          WHERE i.indrelid = $1::regclass ORDER BY 1",
    )
    .bind(table)
    .fetch_all(pool)
    .await?;
    Ok(Sizes { heap, indexes, total })
}

/// Bytes as whole KiB with thousands separators.
pub fn kib(bytes: i64) -> String {
    crate::report::format_value(bytes as f64 / 1024.0, "KiB")
}
