//! The database side of the model test: the connections a schedule runs on, the calls into the
//! public SQL API (adapting to the claim/extend signatures before and after the budget change,
//! so the same test runs against an older commit), the reset between cases, and what the checks
//! read back.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde_json::Value;
use sqlx::{Connection, PgConnection, Row};

use super::ops::{Queue, Ty, SHARED_CKEY, SHARED_K, SHARED_KEY};

/// Visibility every claim and renewal asks for.
pub const VT_SECONDS: f64 = 30.0;
/// The limited types' duration: longer than the visibility, as in production, so a lease lapsing
/// before its message's visibility only happens to a waiting job (a backlog) or a silent holder.
pub const DURATION_MS: i64 = 60_000;

/// The connections of one run: a producer, two workers (each its own "process" in the
/// registry), a dispatcher (sweeps, prunes) and an observer that moves clocks and reads state.
pub struct Conns {
    pub producer: PgConnection,
    pub workers: [PgConnection; 2],
    pub worker_pids: [i32; 2],
    pub dispatcher: PgConnection,
    pub observer: PgConnection,
}

impl Conns {
    pub async fn open(url: &str) -> Result<Self> {
        let mut workers = [PgConnection::connect(url).await?, PgConnection::connect(url).await?];
        let mut worker_pids = [0; 2];
        for (w, conn) in workers.iter_mut().enumerate() {
            worker_pids[w] = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *conn).await?;
        }
        Ok(Self {
            producer: PgConnection::connect(url).await?,
            workers,
            worker_pids,
            dispatcher: PgConnection::connect(url).await?,
            observer: PgConnection::connect(url).await?,
        })
    }
}

/// Which shape of the API this database has: `claim` returning `budget_seconds`, `extend`
/// taking an owner and returning `(msg_id, budget_seconds)` — or the older ones.
#[derive(Clone, Copy, Debug)]
pub struct Api {
    pub claim_budget: bool,
    pub extend_budget: bool,
    /// Uniqueness locks and batches exist (issue 11): the `uniq` type is then defined and every
    /// job goes into one open batch.
    pub bookkeeping: bool,
    /// `lockgate.cancel` exists (issue 12).
    pub cancel: bool,
    /// `lockgate.extend_cancelled` exists (design §95).
    pub extend_cancelled: bool,
    /// Types that share a concurrency key are each admitted under the strictest limit among its
    /// holders (design §109): `lim`, `limb` and (while limited) `free` jobs with `SHARED_K` then
    /// name one key.
    pub shared_limits: bool,
}

impl Api {
    pub async fn detect(conn: &mut PgConnection) -> Result<Self> {
        let claim_budget: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                             WHERE n.nspname = 'lockgate' AND p.proname = 'claim'
                               AND 'budget_seconds' = ANY (p.proargnames))",
        )
        .fetch_one(&mut *conn)
        .await?;
        let extend_budget: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                             WHERE n.nspname = 'lockgate' AND p.proname = 'extend'
                               AND 'budget_seconds' = ANY (p.proargnames))",
        )
        .fetch_one(&mut *conn)
        .await?;
        let bookkeeping: bool =
            sqlx::query_scalar("SELECT to_regclass('lockgate.unique_locks') IS NOT NULL").fetch_one(&mut *conn).await?;
        let cancel: bool = sqlx::query_scalar("SELECT to_regprocedure('lockgate.cancel(bigint)') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
        let extend_cancelled: bool = sqlx::query_scalar(
            "SELECT to_regprocedure('lockgate.extend_cancelled(text, bigint[], integer[], double precision)') IS NOT NULL",
        )
        .fetch_one(&mut *conn)
        .await?;
        let shared_limits: bool =
            sqlx::query_scalar("SELECT to_regprocedure('lockgate._holders(text, integer)') IS NOT NULL")
                .fetch_one(&mut *conn)
                .await?;
        Ok(Self { claim_budget, extend_budget, bookkeeping, cancel, extend_cancelled, shared_limits })
    }
}

/// One row a claim returned.
#[derive(Clone, Debug)]
pub struct Claimed {
    pub msg_id: i64,
    pub read_ct: i32,
    pub headers: Value,
    /// Seconds the holder may run (the visibility on the older API).
    pub budget: f64,
}

impl Claimed {
    pub fn job_id(&self) -> i64 {
        self.headers.get("job_id").and_then(Value::as_i64).unwrap_or(self.msg_id)
    }
    pub fn key(&self) -> Option<String> {
        self.headers.get("ckey").and_then(Value::as_str).map(str::to_string)
    }
    pub fn ty(&self) -> Option<Ty> {
        self.headers.get("type").and_then(Value::as_str).and_then(Ty::from_name)
    }
}

pub async fn claim(conn: &mut PgConnection, api: Api, queue: Queue, qty: u8, owner: i64) -> Result<Vec<Claimed>> {
    let budget = if api.claim_budget { "budget_seconds" } else { "$3::float8" };
    let rows = sqlx::query(&format!("SELECT msg_id, read_ct, headers, {budget} FROM lockgate.claim($1, $2, $3, $4)"))
        .bind(queue.name())
        .bind(i32::from(qty))
        .bind(VT_SECONDS)
        .bind(owner)
        .fetch_all(&mut *conn)
        .await
        .context("lockgate.claim")?;
    Ok(rows
        .into_iter()
        .map(|r| Claimed {
            msg_id: r.get(0),
            read_ct: r.get(1),
            headers: r.get::<Option<Value>, _>(2).unwrap_or(Value::Null),
            budget: r.get::<Option<f64>, _>(3).unwrap_or(0.0),
        })
        .collect())
}

/// Renews deliveries; per msg_id returned: Some(budget) renewed, None skipped (locked). A
/// delivery missing from the result is lost.
pub async fn extend(
    conn: &mut PgConnection,
    api: Api,
    queue: Queue,
    tokens: &[(i64, i32)],
    owner: i64,
) -> Result<BTreeMap<i64, Option<f64>>> {
    let (ids, cts): (Vec<i64>, Vec<i32>) = tokens.iter().copied().unzip();
    // The older extend took no owner and returned the renewed msg_ids; their budget was the
    // visibility asked for.
    let sql = if api.extend_budget {
        "SELECT msg_id, budget_seconds FROM lockgate.extend($1, $2, $3, $4, $5)"
    } else {
        "SELECT e, $4::float8 FROM lockgate.extend($1, $2, $3, $4) e"
    };
    let mut query = sqlx::query(sql).bind(queue.name()).bind(ids).bind(cts).bind(VT_SECONDS);
    if api.extend_budget {
        query = query.bind(owner);
    }
    let rows = query.fetch_all(&mut *conn).await.context("lockgate.extend")?;
    Ok(rows.into_iter().map(|r| (r.get::<i64, _>(0), r.get::<Option<f64>, _>(1))).collect())
}

/// `lockgate.extend_cancelled` of one delivery: (msg_id, busy) if it still holds what its cancel
/// kept (design §95).
pub async fn extend_cancelled(
    conn: &mut PgConnection,
    queue: Queue,
    msg_id: i64,
    read_ct: i32,
) -> Result<Vec<(i64, bool)>> {
    sqlx::query_as("SELECT msg_id, busy FROM lockgate.extend_cancelled($1, ARRAY[$2::bigint], ARRAY[$3::integer], $4)")
        .bind(queue.name())
        .bind(msg_id)
        .bind(read_ct)
        .bind(VT_SECONDS)
        .fetch_all(&mut *conn)
        .await
        .context("lockgate.extend_cancelled")
}

/// The msg_ids a fenced completion archived.
pub async fn complete(conn: &mut PgConnection, queue: Queue, msg_id: i64, read_ct: i32) -> Result<Vec<i64>> {
    let rows = sqlx::query("SELECT * FROM lockgate.complete($1, ARRAY[$2::bigint], ARRAY[$3::integer])")
        .bind(queue.name())
        .bind(msg_id)
        .bind(read_ct)
        .fetch_all(&mut *conn)
        .await
        .context("lockgate.complete")?;
    Ok(rows.into_iter().map(|r| r.get::<i64, _>(0)).collect())
}

/// The attempt a delivery is, as its worker counts it (1 for a stale token, whose call is fenced).
fn attempt_of(queue: Queue) -> String {
    format!(
        "COALESCE((SELECT lockgate._attempt_of(m.headers, m.read_ct) FROM {} m WHERE m.msg_id = $2 AND m.read_ct = $3), 1)",
        queue.table("q")
    )
}

pub async fn retry(conn: &mut PgConnection, queue: Queue, msg_id: i64, read_ct: i32, delay: f64) -> Result<bool> {
    sqlx::query_scalar(&format!(
        "SELECT lockgate.retry($1, $2, $3, $4, 'model: attempt failed', {})",
        attempt_of(queue)
    ))
    .bind(queue.name())
    .bind(msg_id)
    .bind(read_ct)
    .bind(delay)
    .fetch_one(&mut *conn)
    .await
    .context("lockgate.retry")
}

pub async fn release(conn: &mut PgConnection, queue: Queue, msg_id: i64, read_ct: i32) -> Result<Vec<i64>> {
    let rows = sqlx::query("SELECT * FROM lockgate.release($1, ARRAY[$2::bigint], ARRAY[$3::integer])")
        .bind(queue.name())
        .bind(msg_id)
        .bind(read_ct)
        .fetch_all(&mut *conn)
        .await
        .context("lockgate.release")?;
    Ok(rows.into_iter().map(|r| r.get::<i64, _>(0)).collect())
}

pub async fn dead_letter(conn: &mut PgConnection, queue: Queue, msg_id: i64, read_ct: i32) -> Result<bool> {
    sqlx::query_scalar(&format!(
        "SELECT lockgate.dead_letter($1, $2, $3, 'attempts_exhausted', 'model: last attempt failed', {})",
        attempt_of(queue)
    ))
    .bind(queue.name())
    .bind(msg_id)
    .bind(read_ct)
    .fetch_one(&mut *conn)
    .await
    .context("lockgate.dead_letter")
}

pub async fn sweep(conn: &mut PgConnection) -> Result<String> {
    sqlx::query_scalar("SELECT row_to_json(s)::text FROM lockgate.sweep(1000) s")
        .fetch_one(&mut *conn)
        .await
        .context("lockgate.sweep")
}

pub async fn define_types(
    conn: &mut PgConnection,
    api: Api,
    lim_limit: u32,
    limb_limit: u32,
    free_limit: Option<u32>,
    wexec_limit: Option<u32>,
    uniq_limit: Option<u32>,
) -> Result<()> {
    define(conn, api, Ty::Lim, Some(lim_limit)).await?;
    define(conn, api, Ty::Free, free_limit).await?;
    define(conn, api, Ty::LimB, Some(limb_limit)).await?;
    // Without uniqueness (an older schema), just other types.
    define(conn, api, Ty::Uniq, uniq_limit).await?;
    define(conn, api, Ty::Wexec, wexec_limit).await
}

pub async fn define(conn: &mut PgConnection, api: Api, ty: Ty, limit: Option<u32>) -> Result<()> {
    let unique = match ty {
        Ty::Uniq if api.bookkeeping => {
            ", unique_mode => 'until_executed', unique_key => array['k'], unique_on_conflict => 'discard'"
        }
        Ty::Wexec if api.bookkeeping => {
            ", unique_mode => 'while_executing', unique_key => array['k'], unique_on_conflict => 'reject'"
        }
        _ => "",
    };
    sqlx::query(&format!(
        "SELECT lockgate.define_job_type($1, queue => $2, concurrency_limit => $3,
                concurrency_key => CASE WHEN $3 IS NULL THEN NULL ELSE array['k'] END,
                concurrency_duration_ms => $4{unique})"
    ))
    .bind(ty.name())
    .bind(ty.queue().name())
    .bind(limit.map(|l| l as i32))
    .bind(DURATION_MS)
    .execute(&mut *conn)
    .await
    .context("lockgate.define_job_type")?;
    Ok(())
}

/// The enqueue options of every job: into the run's batch, where batches exist, while it is open.
pub fn enqueue_options(api: Api, batch_open: bool) -> Value {
    if api.bookkeeping && batch_open {
        serde_json::json!({ "batch": BATCH })
    } else {
        serde_json::json!({})
    }
}

/// The options of a single enqueue of (ty, {k}): `enqueue_options`, and the explicit key a
/// `SHARED_K` names: the unique key of a unique type, the concurrency key of any type while it
/// is `limited` (a type without a limit refuses a concurrency key).
pub fn job_options(api: Api, batch_open: bool, ty: Ty, k: u8, limited: bool) -> Value {
    let mut options = enqueue_options(api, batch_open);
    if api.bookkeeping && matches!(ty, Ty::Uniq | Ty::Wexec) && k == SHARED_K {
        options["unique_key"] = SHARED_KEY.into();
    }
    if api.shared_limits && limited && k == SHARED_K {
        options["concurrency_key"] = SHARED_CKEY.into();
    }
    options
}

/// The one batch every job of a case goes into (the first id after the reset) until a step
/// closes it. Its on_finish callback is of type `fin`, on a queue of its own (`cb`) that no step
/// claims from, so each enqueue of it stays there to be counted.
pub const BATCH: i64 = 1;

pub async fn register(conn: &mut PgConnection, worker: usize) -> Result<i64> {
    sqlx::query_scalar("SELECT lockgate.register_process('supervisor', $1, 'model-host', $2)")
        .bind(format!("model-worker-{worker}"))
        .bind(1000 + worker as i32)
        .fetch_one(&mut *conn)
        .await
        .context("lockgate.register_process")
}

/// Empties every table a case writes and restarts the id sequences, so each case starts from
/// the same state and a shrunk schedule replays with the same ids.
pub async fn reset(conn: &mut PgConnection, api: Api) -> Result<()> {
    sqlx::raw_sql(
        "SELECT lockgate.create_queue('default'), lockgate.create_queue('other');
         TRUNCATE pgmq.q_default, pgmq.a_default, pgmq.q_other, pgmq.a_other, lockgate.leases, lockgate.semaphores,
                  lockgate.parked, lockgate.dead_letters, lockgate.processes RESTART IDENTITY CASCADE;
         ALTER SEQUENCE lockgate.job_id_seq RESTART;",
    )
    .execute(&mut *conn)
    .await
    .context("resetting the database between cases")?;
    if api.bookkeeping {
        sqlx::raw_sql(
            "SELECT lockgate.define_job_type('fin', queue => 'cb');
             TRUNCATE pgmq.q_cb, pgmq.a_cb, lockgate.unique_locks, lockgate.batch_jobs, lockgate.batches RESTART IDENTITY;
             SELECT lockgate.create_batch(on_finish => 'fin');",
        )
        .execute(&mut *conn)
        .await
        .context("resetting uniqueness locks and batches")?;
    }
    Ok(())
}

/// Everything a stale operation must leave untouched, as one comparable text.
pub async fn snapshot(conn: &mut PgConnection) -> Result<String> {
    let mut parts = Vec::new();
    for q in Queue::ALL {
        parts.push(format!(
            "(SELECT string_agg(format('%s/%s/%s/%s', msg_id, read_ct, vt, headers), ' ' ORDER BY msg_id) FROM {})",
            q.table("q")
        ));
        parts.push(format!("(SELECT string_agg(msg_id::text, ' ' ORDER BY msg_id) FROM {})", q.table("a")));
    }
    parts.push(
        "(SELECT string_agg(format('%s/%s/%s/%s', queue, msg_id, key, expires_at), ' ' ORDER BY queue, msg_id)
            FROM lockgate.leases)"
            .into(),
    );
    parts.push(
        "(SELECT string_agg(format('%s/%s/%s', key, lim, value), ' ' ORDER BY key) FROM lockgate.semaphores)".into(),
    );
    parts.push("(SELECT string_agg(format('%s/%s', id, job_id), ' ' ORDER BY id) FROM lockgate.parked)".into());
    parts.push(
        "(SELECT string_agg(format('%s/%s', job_id, reason), ' ' ORDER BY job_id) FROM lockgate.dead_letters)".into(),
    );
    let bookkeeping: bool =
        sqlx::query_scalar("SELECT to_regclass('lockgate.unique_locks') IS NOT NULL").fetch_one(&mut *conn).await?;
    if bookkeeping {
        parts.push(
            "(SELECT string_agg(format('%s/%s/%s/%s', key, job_id, msg_id, to_jsonb(u)->>'held_until'), ' ' ORDER BY key)
                FROM lockgate.unique_locks u)"
                .into(),
        );
        parts.push(
            "(SELECT string_agg(format('%s/%s/%s/%s', x.id, x.total, x.succeeded, x.failed), ' ' ORDER BY x.id)
                FROM lockgate.batches b CROSS JOIN LATERAL lockgate.batch(b.id) x)"
                .into(),
        );
    }
    let sql = format!("SELECT concat_ws(' | ', {})", parts.join(", "));
    Ok(sqlx::query_scalar(&sql).fetch_one(&mut *conn).await?)
}

/// A message as the checks see it.
#[derive(Clone, Debug)]
pub struct Message {
    pub queue: Queue,
    pub msg_id: i64,
    pub job_id: i64,
}

#[derive(Clone, Debug)]
pub struct Lease {
    pub queue: String,
    pub msg_id: i64,
    pub key: String,
    pub live: bool,
    /// The type of the job holding it (None on a schema before migration 27).
    pub job_type: Option<String>,
}

/// The database state every check reads, in one snapshot (REPEATABLE READ).
#[derive(Debug, Default)]
pub struct State {
    pub messages: Vec<Message>,
    pub archived: Vec<(Queue, i64)>,
    pub parked: Vec<(i64, String)>,
    pub dead: Vec<i64>,
    pub leases: Vec<Lease>,
    pub semaphores: Vec<(String, i32, i32)>,
    pub invariants: Vec<(Option<String>, Option<String>)>,
    /// until_executed locks: (key, owning job).
    pub unique_locks: Vec<(String, i64)>,
    /// while_executing locks: (key, owning job, held_until: None when not set (a run holds it),
    /// else whether it has passed (a cancel kept it for its handler)).
    pub wexec_locks: Vec<(String, i64, Option<bool>)>,
    /// The case's batch: (total, succeeded, failed).
    pub batch: Option<(i64, i64, i64)>,
    pub batch_state: Option<String>,
    /// Messages of the batch's callback type, waiting or archived.
    pub batch_callbacks: i64,
}

impl State {
    pub async fn read(conn: &mut PgConnection, api: Api) -> Result<Self> {
        let mut tx = conn.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *tx).await?;
        let mut state = State::default();
        for q in Queue::ALL {
            let rows = sqlx::query(&format!(
                "SELECT msg_id, COALESCE((headers->>'job_id')::bigint, msg_id) FROM {}",
                q.table("q")
            ))
            .fetch_all(&mut *tx)
            .await?;
            state.messages.extend(rows.into_iter().map(|r| Message { queue: q, msg_id: r.get(0), job_id: r.get(1) }));
            let archived: Vec<i64> = sqlx::query_scalar(&format!(
                "SELECT COALESCE((headers->>'job_id')::bigint, msg_id) FROM {}",
                q.table("a")
            ))
            .fetch_all(&mut *tx)
            .await?;
            state.archived.extend(archived.into_iter().map(|j| (q, j)));
        }
        state.parked = sqlx::query_as("SELECT job_id, key FROM lockgate.parked").fetch_all(&mut *tx).await?;
        state.dead = sqlx::query_scalar("SELECT job_id FROM lockgate.dead_letters WHERE job_id IS NOT NULL")
            .fetch_all(&mut *tx)
            .await?;
        // job_type through to_jsonb: a schema before migration 27 has no such column.
        state.leases = sqlx::query(
            "SELECT queue, msg_id, key, expires_at > clock_timestamp(), to_jsonb(l)->>'job_type' FROM lockgate.leases l",
        )
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|r| Lease { queue: r.get(0), msg_id: r.get(1), key: r.get(2), live: r.get(3), job_type: r.get(4) })
        .collect();
        state.semaphores =
            sqlx::query_as("SELECT key, lim, value FROM lockgate.semaphores").fetch_all(&mut *tx).await?;
        state.invariants = sqlx::query_as("SELECT key, problem FROM lockgate.check_invariants()")
            .fetch_all(&mut *tx)
            .await
            .context("lockgate.check_invariants")?;
        if api.bookkeeping {
            state.unique_locks = sqlx::query_as(
                "SELECT key, job_id FROM lockgate.unique_locks WHERE mode <> 'while_executing' ORDER BY key",
            )
            .fetch_all(&mut *tx)
            .await?;
            // held_until through to_jsonb: a schema before it (migration 0015) has no such column.
            state.wexec_locks = sqlx::query_as(
                "SELECT key, job_id, (to_jsonb(u)->>'held_until')::timestamptz <= clock_timestamp()
                   FROM lockgate.unique_locks u WHERE mode = 'while_executing' ORDER BY key",
            )
            .fetch_all(&mut *tx)
            .await?;
            let batch: Option<(i64, i64, i64, String)> =
                sqlx::query_as("SELECT total, succeeded, failed, state FROM lockgate.batch($1)")
                    .bind(BATCH)
                    .fetch_optional(&mut *tx)
                    .await?;
            state.batch = batch.as_ref().map(|b| (b.0, b.1, b.2));
            state.batch_state = batch.map(|b| b.3);
            state.batch_callbacks = sqlx::query_scalar(
                "SELECT (SELECT count(*) FROM pgmq.q_cb WHERE headers->>'type' = 'fin')
                      + (SELECT count(*) FROM pgmq.a_cb WHERE headers->>'type' = 'fin')",
            )
            .fetch_one(&mut *tx)
            .await?;
        }
        tx.rollback().await?;
        Ok(state)
    }

    pub fn lease(&self, queue: Queue, msg_id: i64) -> Option<&Lease> {
        self.leases.iter().find(|l| l.queue == queue.name() && l.msg_id == msg_id)
    }
}

/// check_invariants() as it stands after a sweep, without keeping the sweep (rolled back), for
/// the problems a sweep is there to repair.
pub async fn invariants_after_sweep(conn: &mut PgConnection) -> Result<Vec<(Option<String>, Option<String>)>> {
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT lockgate.sweep(1000)").execute(&mut *tx).await?;
    let rows = sqlx::query_as("SELECT key, problem FROM lockgate.check_invariants()").fetch_all(&mut *tx).await?;
    tx.rollback().await?;
    Ok(rows)
}

/// The SQLSTATE of the database error behind `error`, if one is.
pub fn sqlstate(error: &anyhow::Error) -> Option<String> {
    error
        .chain()
        .find_map(|cause| cause.downcast_ref::<sqlx::Error>())
        .and_then(|e| e.as_database_error())
        .and_then(|e| e.code())
        .map(|code| code.into_owned())
}

/// (key, value, limit, parked jobs) of every key with a permit free while jobs are parked on it:
/// free for the job promotion takes next. The limit is that job's type's (a key's row records
/// the limit of its last acquire, which a lowered limit that admitted nothing has not replaced),
/// or the least of the key's holders' types' limits where stricter (types sharing a key, design
/// §109: a holder whose type lost its limit binds nothing, though its permit counts; on an older
/// schema, whose leases name no type, the job's type's alone). Where types share keys, a next
/// parked job whose type has no limit needs no permit: promotion releases it whatever the key
/// holds, so such a key always has room for it (reported with the limit its count, plus one).
pub async fn free_permits_behind_parked_jobs(
    conn: &mut PgConnection,
    api: Api,
) -> Result<Vec<(String, i32, i32, i64)>> {
    let (holders, unlimited_head) = if api.shared_limits {
        (
            "SELECT min(ht.concurrency_limit) AS lim FROM lockgate.leases l
               JOIN lockgate.job_types ht ON ht.name = l.job_type WHERE l.key = s.key",
            "t.name IS NOT NULL AND t.concurrency_limit IS NULL",
        )
    } else {
        ("SELECT NULL::integer AS lim", "false")
    };
    Ok(sqlx::query_as(&format!(
        "SELECT s.key, s.value, b.lim, count(*)
           FROM lockgate.semaphores s
           JOIN lockgate.parked p ON p.key = s.key
          CROSS JOIN LATERAL (SELECT x.job_type FROM lockgate.parked x WHERE x.key = s.key
                               ORDER BY x.priority, x.id LIMIT 1) head
           LEFT JOIN lockgate.job_types t ON t.name = head.job_type
          CROSS JOIN LATERAL ({holders}) h
          CROSS JOIN LATERAL (SELECT CASE WHEN {unlimited_head} THEN s.value + 1
                                          ELSE LEAST(COALESCE(t.concurrency_limit, s.lim), h.lim) END AS lim) b
          WHERE s.value < b.lim GROUP BY s.key, s.value, b.lim ORDER BY s.key",
    ))
    .fetch_all(conn)
    .await?)
}

/// Check (n): every job's history, one entry per attempt: each life (a dead-letter retry starts
/// one, numbered from 1 again) is numbered 1, 2, ... without a gap or a repeat, and the last
/// ends at the job's attempt (or the one before, for a job cancelled with a delivery that never
/// started). Jobs discarded unrun are left out. One row per job that breaks it.
pub async fn histories_broken(conn: &mut PgConnection) -> Result<Vec<String>> {
    let jobs: Vec<(i64, String, i32, Value, Value)> =
        sqlx::query_as("SELECT id, state, attempt, attempts, headers FROM lockgate.jobs(max_rows => 1000)")
            .fetch_all(conn)
            .await?;
    let mut broken = Vec::new();
    for (id, state, attempt, attempts, headers) in jobs {
        if state == "discarded" || attempt > 100 {
            continue;
        }
        let numbers: Vec<i64> =
            attempts.as_array().into_iter().flatten().map(|a| a["attempt"].as_i64().unwrap_or(-1)).collect();
        // The entries before the mark dlq_retry left are earlier lives', each numbered from 1.
        let from = usize::try_from(headers["history_from"].as_u64().unwrap_or(0)).unwrap_or(usize::MAX);
        let (earlier, last) = numbers.split_at(from.min(numbers.len()));
        let mut lives: Vec<Vec<i64>> = Vec::new();
        for n in earlier {
            match lives.last_mut() {
                Some(life) if *n != 1 => life.push(*n),
                _ => lives.push(vec![*n]),
            }
        }
        lives.push(last.to_vec());
        let numbered = lives.iter().all(|life| life.iter().zip(1..).all(|(n, i)| *n == i));
        let ends = last.len() as i64 == i64::from(attempt)
            || (state == "cancelled" && last.len() as i64 == i64::from(attempt) - 1);
        if !numbered || !ends {
            broken.push(format!("(n) job {id} ({state}, attempt {attempt}) has the history {numbers:?}: {attempts}"));
        }
    }
    Ok(broken)
}
