//! sweep: what one concurrency-sweep pass costs with a big parked backlog, and what idle-key
//! reclamation leaves of a million keys used once (issue 14).
//!
//! The backlog is written in SQL, not enqueued (a million enqueues would take minutes and measure
//! the enqueue): `--keys` keys of a type limited to 1, each full (its semaphore at 1, a lease of
//! 15 minutes on a message id far above any real one) with `--parked` jobs parked behind them in
//! all. One pass with nothing to do is timed first (after the pass that follows the migration,
//! which looks at every key once), then a pass in which `--promotable` holders' leases have run
//! out (dead holders): it expires them and promotes a job of each key, in a transaction rolled
//! back so that every round starts from the same backlog. The reference column is the statement
//! the sweep ran on every pass before issue 14 (every parked job joined with its key, grouped,
//! the 1,000 oldest keys with room), timed on the same backlog. Target: ≤ 10 ms per pass.
//!
//! Idle keys: `--idle-keys` semaphore rows at 0, unchanged for an hour (what a million jobs with
//! distinct keys leave once they have run), then `lockgate.reclaim_idle_keys` passes until none
//! is left; reported: the passes' time and the table's size before and after (vacuumed).

use std::time::Instant;

use anyhow::{bail, Result};
use sqlx::PgPool;

use super::{Ctx, Outcome};
use crate::plan::SweepArgs;
use crate::queue::QUEUE;
use crate::report::{Check, Row};
use crate::stats::Summary;

/// Passes timed per round and measure; the median of each round is the round's figure.
const PASSES: usize = 9;
/// The target of every pass, in milliseconds.
const TARGET_MS: f64 = 10.0;
/// Lease message ids start here: far above the job id sequence, so no promotion collides.
const FAKE_MSG_ID: i64 = 1_000_000_000_000;

pub async fn run(ctx: &Ctx, args: &SweepArgs) -> Result<Outcome> {
    if args.keys == 0 || args.parked < args.keys || args.promotable > args.keys {
        bail!("sweep needs 0 < keys <= parked and promotable <= keys (got {args:?})");
    }
    let db = ctx.create_db("sweep").await?;
    let spinner = ctx.progress.spinner(format!("sweep: writing {} parked jobs over {} keys", args.parked, args.keys));
    backlog(&db.pool, args).await?;
    spinner.finish_and_clear();
    // The first pass after the migration looks at every key once (sweep_state.full_scan).
    sqlx::query("SELECT lockgate.sweep()").execute(&db.pool).await?;
    let (mut idle, mut busy, mut before) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ctx.options.rounds {
        ctx.progress.note(format!("{}: timing passes", ctx.label("sweep", round)));
        idle.push(median_ms(&db.pool, "SELECT lockgate.sweep()", false, args).await?);
        busy.push(median_ms(&db.pool, "SELECT lockgate.sweep()", true, args).await?);
        before.push(median_ms(&db.pool, OLD_REPAIR, false, args).await?);
    }
    let measure = |what: &str| format!("{what}, {} parked over {} keys", args.parked, args.keys);
    let check = |s: &Option<Summary>| {
        s.as_ref().map(|s| Check { value: s.median, met: s.median <= TARGET_MS, shown: format!("{:.1} ms", s.median) })
    };
    let mut outcome = Outcome::default();
    let (idle, busy, before) = (Summary::of(&idle), Summary::of(&busy), Summary::of(&before));
    let Some(idle_summary) = idle.clone() else { bail!("sweep ran no rounds") };
    outcome.rows.push(
        Row::new("sweep", measure("pass, nothing to do"), "ms", idle_summary)
            .baseline("pre-14 repair statement", before.clone())
            .target(format!("≤ {TARGET_MS} ms"), check(&idle)),
    );
    if let Some(busy_summary) = busy.clone() {
        let what = format!("pass expiring {} dead holders' leases", args.promotable);
        outcome.rows.push(
            Row::new("sweep", measure(&what), "ms", busy_summary)
                .baseline("pre-14 repair statement", before)
                .target(format!("≤ {TARGET_MS} ms"), check(&busy)),
        );
    }
    let (rows, diagnostics) = reclaim(ctx, &db.pool, args.idle_keys).await?;
    outcome.rows.extend(rows);
    outcome.diagnostics.extend(diagnostics);
    db.close().await?;
    Ok(outcome)
}

/// The statement the sweep ran on every pass before issue 14 (sql/080_sweep.sql, step 2).
const OLD_REPAIR: &str = "SELECT p.key FROM lockgate.parked p
      LEFT JOIN lockgate.semaphores s ON s.key = p.key
      LEFT JOIN lockgate.job_types jt ON jt.name = p.job_type
     WHERE s.key IS NULL OR jt.name IS NULL OR jt.concurrency_limit IS NULL OR s.value < jt.concurrency_limit
     GROUP BY p.key ORDER BY min(p.parked_at) LIMIT 1000";

/// Writes the backlog: keys full, leases live, jobs parked round-robin over the keys.
async fn backlog(pool: &PgPool, args: &SweepArgs) -> Result<()> {
    sqlx::query(
        "SELECT lockgate.define_job_type('bench_account', queue => $1, concurrency_limit => 1,
                                         concurrency_key => ARRAY['a'])",
    )
    .bind(QUEUE)
    .execute(pool)
    .await?;
    let keys = i64::try_from(args.keys)?;
    sqlx::query(
        "INSERT INTO lockgate.semaphores (key, lim, value)
         SELECT 'bench_account:[' || k || ']', 1, 1 FROM generate_series(1, $1) k",
    )
    .bind(keys)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO lockgate.leases (queue, msg_id, key, duration_ms, expires_at)
         SELECT $2, $3 + k, 'bench_account:[' || k || ']', 900000, now() + interval '15 minutes'
           FROM generate_series(1, $1) k",
    )
    .bind(keys)
    .bind(QUEUE)
    .bind(FAKE_MSG_ID)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO lockgate.parked (key, queue, job_type, job_id, args, headers, priority, run_at, parked_at)
         SELECT 'bench_account:[' || (i % $2 + 1) || ']', $3, 'bench_account', nextval('lockgate.job_id_seq'),
                jsonb_build_object('a', i % $2 + 1),
                jsonb_build_object('type', 'bench_account', 'ckey', 'bench_account:[' || (i % $2 + 1) || ']'),
                0, now(), now() - make_interval(secs => $1 - i)
           FROM generate_series(1, $1) i",
    )
    .bind(i64::try_from(args.parked)?)
    .bind(keys)
    .bind(QUEUE)
    .execute(pool)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE lockgate.parked, lockgate.semaphores, lockgate.leases").execute(pool).await?;
    Ok(())
}

/// The median time of `PASSES` runs of `statement`, in ms. With `expire`, each run is in a
/// transaction that first lets `promotable` leases run out and is rolled back afterwards.
async fn median_ms(pool: &PgPool, statement: &str, expire: bool, args: &SweepArgs) -> Result<f64> {
    let mut times = Vec::with_capacity(PASSES);
    let mut conn = pool.acquire().await?;
    for pass in 0..PASSES {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        if expire {
            // Spread over the key space, a different set each pass.
            let stride = (args.keys / args.promotable.max(1)).max(1);
            sqlx::query(
                "UPDATE lockgate.leases SET expires_at = now() - interval '1 second'
                  WHERE msg_id IN (SELECT $1 + 1 + (($2 + g * $3) % $4) FROM generate_series(0, $5 - 1) g)",
            )
            .bind(FAKE_MSG_ID)
            .bind(i64::try_from(pass)?)
            .bind(i64::try_from(stride)?)
            .bind(i64::try_from(args.keys)?)
            .bind(i64::try_from(args.promotable)?)
            .execute(&mut *tx)
            .await?;
        }
        let started = Instant::now();
        sqlx::query(statement).execute(&mut *tx).await?;
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        if expire {
            tx.rollback().await?;
        } else {
            tx.commit().await?;
        }
    }
    Ok(Summary::of(&times).map_or(0.0, |s| s.median))
}

/// Idle-key reclamation: rows, passes, time and sizes.
async fn reclaim(ctx: &Ctx, pool: &PgPool, idle_keys: u64) -> Result<(Vec<Row>, Vec<String>)> {
    if idle_keys == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    let spinner = ctx.progress.spinner(format!("sweep: {idle_keys} idle keys"));
    sqlx::query(
        "INSERT INTO lockgate.semaphores (key, lim, value, updated_at)
         SELECT 'bench_idle:[' || k || ']', 1, 0, now() - interval '1 hour' FROM generate_series(1, $1) k",
    )
    .bind(i64::try_from(idle_keys)?)
    .execute(pool)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE lockgate.semaphores").execute(pool).await?;
    let size = || async {
        sqlx::query_scalar::<_, i64>("SELECT pg_total_relation_size('lockgate.semaphores')").fetch_one(pool).await
    };
    let before = size().await?;
    let (mut passes, mut reclaimed, mut times) = (0u32, 0i64, Vec::new());
    loop {
        let started = Instant::now();
        let n: i32 = sqlx::query_scalar("SELECT lockgate.reclaim_idle_keys()").fetch_one(pool).await?;
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        passes += 1;
        reclaimed += i64::from(n);
        if n == 0 {
            break;
        }
    }
    // VACUUM FULL, so the size is what the rows left take (autovacuum frees the space for reuse
    // without returning it to the file system).
    sqlx::raw_sql("VACUUM FULL lockgate.semaphores").execute(pool).await?;
    let after = size().await?;
    spinner.finish_and_clear();
    let Some(pass) = Summary::of(&times) else { bail!("no reclaim pass ran") };
    let row = Row::new("sweep", format!("reclaim pass (10,000 keys), {idle_keys} idle keys"), "ms", pass);
    let line = format!(
        "idle keys: {reclaimed} of {idle_keys} reclaimed in {passes} passes; lockgate.semaphores {} MiB before, {} MiB after VACUUM FULL (the backlog's busy keys stay)",
        before / (1024 * 1024),
        after / (1024 * 1024)
    );
    Ok((vec![row], vec![line]))
}
