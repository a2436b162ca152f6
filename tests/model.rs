//! Model-based test of the SQL protocol (issue 10; SPEC G1, G2, G3, H24, H25, H26).
//!
//! proptest generates schedules — enqueues (committed and rolled back), claims from two workers,
//! a claim racing an uncommitted sweep, heartbeats, completions, retries, releases and dead
//! letters with current and stale tokens, sweeps, prunes, clocks running past visibility and
//! lease, redefined and removed limits, cancels, dead letters retried (`dlq_retry`), dead and
//! parked jobs discarded, idle keys reclaimed and unique locks reaped — and runs each against
//! one real database through the public SQL API over five connections. A reference model (tests/model/reference.rs) follows the jobs
//! and what each delivery's holder believes, and after every step the database is compared with
//! it:
//!
//! - (a) per key, the deliveries entitled to run (claimed, not finished, never told they lost,
//!   budget not run out) never exceed the key's limit, nor do its live permits, running or not,
//!   exceed the least current limit of their holders' types (G3; keys held when a limit was
//!   lowered are left out of the permit count);
//! - (b) a delivery entitled to run holds a live lease row of its key, from the claim that
//!   returned it on, and a claim's budget never outlives that lease or its visibility (H24);
//! - (c) each key's semaphore value equals its lease rows and stays within its limit (G2, H2);
//! - (d) every committed job is in exactly one of its queue, parked, the archive, the dead
//!   letters — where the model expects it — and no rolled-back job appears (G1, G8);
//! - (e) `check_invariants()` reports nothing (asked again after a sweep, rolled back, for what
//!   only a sweep repairs);
//! - (f) a stale token's complete/retry/release/dead_letter/extend changes nothing (G2, H1, H25),
//!   no call succeeds for a token that was not current, and `release_cancelled` releases nothing
//!   for a delivery other than the one its job was cancelled in;
//! - (g) a job never has two deliveries entitled to run (H26);
//! - (h) a current delivery of a healthy holder is never refused its renewal or its finish, and a
//!   heartbeat that finds a delivery lost reports it cancelled (`cancelled_messages`) exactly when
//!   its job was cancelled while that delivery ran;
//! - (i) uniqueness (issue 11; `uniq` is unique until executed, duplicates discarded): the
//!   until_executed lock rows are exactly one per live `uniq` job, owned by it, and an enqueue
//!   reports a duplicate exactly when a live job holds the key — so no stale or duplicate
//!   completion, dead letter or release ever drops a successor's lock (G2, H14). One key,
//!   `shared`, is named explicitly by jobs of both `uniq` and `wexec`: an until_executed enqueue
//!   of it is a duplicate of the `wexec` job whose run holds it too (lapsed or not: only a claim
//!   judges a lapse), and a `wexec` job is never delivered while a live `uniq` job holds it;
//! - (j) the batch every job is enqueued into until a step closes it counts exactly the committed
//!   jobs enqueued into it, the archived ones as succeeded and the dead-lettered ones as failed,
//!   at every commit (G2, H22); it is finished exactly when it is closed and each of them has a
//!   fate (only the batch sweep may finish one whose close met an open enqueue that then added
//!   nothing), its on_finish callback enqueued once; a close never waits for an open enqueue
//!   into the batch (H31);
//! - (k) per while_executing key (type `wexec`: unique while executing, duplicates rejected), at
//!   most one delivery is entitled to run at any instant (G3, H14);
//! - (l) the while_executing lock rows are exactly those the model expects: one per key whose
//!   job's run has not ended (a holder running out of budget ends nothing by itself: the job's
//!   next delivery takes the lock back, or another job's claim or a sweep takes it, design §103,
//!   §108),
//!   owned by that job; a cancelled running job's kept, with a
//!   held_until, until its worker calls `release_cancelled` (then that call must release it), and
//!   once held_until has passed until a claim takes the key over; a claim delivers a job only with
//!   its key free in that sense;
//! - (m) H6: no key has a free permit while jobs are parked behind it — a finish that gives a
//!   permit back promotes a parked job with it, or leaves the permit on its finished lease (at
//!   REPEATABLE READ, design §78), never back on the key past the parked job. (After a limit
//!   changes, only from the next sweep on: a raised limit waits for it, as the README says.)
//! - (n) once every job has its fate (after the drain), each job's history has one entry per
//!   attempt: each life numbered 1, 2, ... with no gap or repeat (a lost attempt written down when
//!   its job left its queue table), the last ending at the job's attempt (design §86).
//! - (o) a `while_executing` job that a claim put back to wait for its unique key holds no
//!   concurrency permit (design §114): the permit went back to its key and to the jobs parked on
//!   it, among them, maybe, the very job holding the unique key;
//! - (p) the drain needs no waiting lease to run out: every permit is held by a job that runs, or
//!   will once its visibility passes, or by a cancelled handler that stopped without giving it
//!   back (that lease alone may run out), so a job still live after rounds of claims,
//!   completions, passed visibilities and sweeps waits for a permit held by a job that does not
//!   run (§114's stall: a job put back for a unique key held by the job parked behind its permit).
//!
//! After the schedule, the case drains (`Run::drain`): running holders complete, handlers
//! blocking on after their cancel end, claims take what is visible, and when they find nothing,
//! clocks run past every visibility and a sweep runs, each step checked as above, until no job is
//! live (p); then, if some still are, past every waiting lease too; a job still live after that
//! (parked where nothing promotes it, or a message no claim takes) fails the case: G1's "no job
//! is lost" includes "none is stuck for good".
//!
//! A cancel (`lockgate.cancel`) does not stop a running handler: its worker learns of it from its
//! next heartbeat (`Extend` finds the delivery lost, and `cancelled_messages` says why), or when
//! its finish is refused, or never (a clock runs its budget out). Until then the holder of the
//! delivery its job was cancelled in stays entitled to run — it counts in (a), (g) and (k) — and
//! the cancel must have kept its permit and while_executing lock for it; once its handler has
//! ended, its worker calls `lockgate.release_cancelled`, as the runtime does. A claim may put a
//! `wexec` job whose key is held back for a second without returning it (a return, not a
//! delivery); the model expects nothing of such a claim but that it delivered nothing.
//!
//! Time is simulated by moving database times into the past, never by sleeping.
//!
//! Size: LOCKGATE_MODEL_CASES (default 64) cases of 1 to LOCKGATE_MODEL_STEPS (default 80)
//! steps; LOCKGATE_MODEL_SEED replays a run; LOCKGATE_MODEL_CHECKS (default "abcdefghijklmnop") keeps
//! only some checks. See docs/testing.md.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod model {
    pub mod db;
    pub mod ops;
    pub mod reference;
}

use std::cell::RefCell;
use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use lockgate_testkit::TestDb;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use serde_json::json;
use sqlx::{Connection, PgConnection};

use model::db::{self, Api, Claimed, Conns, State};
use model::ops::{self, Case, Finish, Op, Queue, StaleAction, Ty, SHARED_CKEY, SHARED_KEY};
use model::reference::{Checks, Delivery, Fate, Holder, Model};

/// The most rounds of claims, completions and lapsed clocks a case's drain takes (and the most
/// lapses of one kind in a round) before a job still live fails it.
const DRAIN_ROUNDS: usize = 40;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One case's run: the connections, the API shape, the model and, when asked, a trace.
struct Run<'a> {
    c: &'a mut Conns,
    api: Api,
    model: Model,
    checks: Checks,
    trace: Option<Vec<String>>,
    stats: BTreeMap<&'static str, usize>,
    /// Messages (queue, msg_id, read_ct) a claim racing a sweep put back: (o) leaves them out.
    racing_put_backs: BTreeSet<(Queue, i64, i32)>,
}

impl Run<'_> {
    fn log(&mut self, line: String) {
        if let Some(trace) = &mut self.trace {
            trace.push(line);
        }
    }

    async fn setup(&mut self, case: &Case) -> Result<()> {
        db::reset(&mut self.c.observer, self.api).await?;
        db::define_types(
            &mut self.c.observer,
            self.api,
            case.lim_limit,
            case.limb_limit,
            case.free_limit,
            case.wexec_limit,
            case.uniq_limit,
        )
        .await?;
        self.model.bookkeeping = self.api.bookkeeping;
        self.model.limits.insert(Ty::Lim, case.lim_limit);
        self.model.limits.insert(Ty::LimB, case.limb_limit);
        for (ty, limit) in [(Ty::Free, case.free_limit), (Ty::Wexec, case.wexec_limit), (Ty::Uniq, case.uniq_limit)] {
            if let Some(limit) = limit {
                self.model.limits.insert(ty, limit);
            }
        }
        for w in 0..2 {
            self.model.owners[w] = db::register(&mut self.c.observer, w).await?;
        }
        let shown = |l: Option<u32>| l.map_or_else(|| "none".to_string(), |l| l.to_string());
        self.log(format!(
            "    limits: lim {}, limb {}, free {}, wexec {}, uniq {} (duration {} ms, visibility {} s)",
            case.lim_limit,
            case.limb_limit,
            shown(case.free_limit),
            shown(case.wexec_limit),
            shown(case.uniq_limit),
            db::DURATION_MS,
            db::VT_SECONDS
        ));
        Ok(())
    }

    /// Runs one operation; returns what happened, for the trace.
    async fn step(&mut self, op: &Op) -> Result<String> {
        match op {
            Op::Enqueue { ty, k } => {
                let rows: Vec<(Option<i64>, i64, String)> =
                    sqlx::query_as("SELECT msg_id, job_id, status FROM lockgate.enqueue($1, $2, $3)")
                        .bind(ty.name())
                        .bind(json!({ "k": k }))
                        .bind(db::job_options(
                            self.api,
                            !self.model.batch.closed,
                            *ty,
                            *k,
                            self.model.limits.contains_key(ty),
                        ))
                        .fetch_all(&mut self.c.producer)
                        .await?;
                self.enqueued(*ty, &[*k], &rows, !self.model.batch.closed)
            }
            Op::EnqueueMany { ty, ks } => {
                let args: Vec<serde_json::Value> = ks.iter().map(|k| json!({ "k": k })).collect();
                let rows: Vec<(Option<i64>, i64, String)> =
                    sqlx::query_as("SELECT msg_id, job_id, status FROM lockgate.enqueue_many($1, $2, $3)")
                        .bind(ty.name())
                        .bind(args)
                        .bind(db::enqueue_options(self.api, !self.model.batch.closed))
                        .fetch_all(&mut self.c.producer)
                        .await?;
                self.enqueued(*ty, ks, &rows, !self.model.batch.closed)
            }
            Op::EnqueueRolledBack { ty, k } => {
                let mut tx = self.c.producer.begin().await?;
                let (msg_id, job_id, status): (Option<i64>, i64, String) =
                    sqlx::query_as("SELECT msg_id, job_id, status FROM lockgate.enqueue($1, $2, $3)")
                        .bind(ty.name())
                        .bind(json!({ "k": k }))
                        .bind(db::job_options(
                            self.api,
                            !self.model.batch.closed,
                            *ty,
                            *k,
                            self.model.limits.contains_key(ty),
                        ))
                        .fetch_one(&mut *tx)
                        .await?;
                // A duplicate's job_id names the live job holding the key: nothing of this
                // enqueue exists, and that job must not be taken for a rolled-back one.
                let duplicate = status == "duplicate";
                if !duplicate {
                    self.model.rolled_back.insert(job_id);
                }
                // While the transaction is open, others must see nothing of it (G8). (e) is left
                // to the check after the step, which asks again after a sweep: what a sweep repairs
                // (a cancelled job's kept lease, run out) is no violation.
                let state = State::read(&mut self.c.observer, self.api).await?;
                let mut violations = self.model.check(&state, &self.checks);
                violations.retain(|v| !v.starts_with("(e)"));
                tx.rollback().await?;
                if duplicate {
                    self.check_duplicate(*ty, *k, job_id)?;
                }
                if !violations.is_empty() {
                    bail!("while the enqueue's transaction was open:\n  {}", violations.join("\n  "));
                }
                Ok(format!("job {job_id} {status} (msg {msg_id:?}), rolled back"))
            }
            Op::Claim { worker, queue, qty } => {
                let (worker, queue) = (*worker, *queue);
                let before = self.put_backs_before(queue).await?;
                let started = Instant::now();
                let rows =
                    db::claim(&mut self.c.workers[worker], self.api, queue, *qty, self.model.owners[worker]).await?;
                self.count_put_backs(queue, before).await?;
                self.claimed(worker, queue, rows, started).await
            }
            Op::ClaimRacingSweep { worker, queue, qty } => self.claim_racing_sweep(*worker, *queue, *qty).await,
            Op::Extend { mask, blocked } => self.extend(*mask, *blocked).await,
            Op::Finish { pick, how } => {
                let Some(i) = pick_from(&self.model.finishable(), *pick).copied() else {
                    return Ok("no running delivery: nothing to do".into());
                };
                self.finish(i, *how).await
            }
            Op::FinishBehindProducer { pick, how, commit } => {
                let Some(i) = pick_from(&self.model.finishable(), *pick).copied() else {
                    return Ok("no running delivery: nothing to do".into());
                };
                self.finish_behind_producer(i, *how, *commit).await
            }
            Op::FinishOnOldSnapshot { pick, how } => {
                let Some(i) = pick_from(&self.model.finishable(), *pick).copied() else {
                    return Ok("no running delivery: nothing to do".into());
                };
                self.finish_on_old_snapshot(i, *how).await
            }
            Op::Thaw { pick, how } => {
                let Some(i) = pick_from(&self.model.fenced(), *pick).copied() else {
                    return Ok("no delivery out of budget: nothing to do".into());
                };
                self.finish(i, *how).await
            }
            Op::Stale { pick, action } => self.stale(*pick, *action).await,
            Op::Sweep => {
                let mut said = db::sweep(&mut self.c.dispatcher).await?;
                self.model.limits_changed = false;
                self.model.swept();
                if self.api.bookkeeping {
                    let finished: i32 = sqlx::query_scalar("SELECT lockgate.batch_sweep()")
                        .fetch_one(&mut self.c.dispatcher)
                        .await
                        .context("lockgate.batch_sweep")?;
                    self.model.batch.left_to_sweep = false;
                    said.push_str(&format!("; batch sweep: {finished}"));
                }
                Ok(said)
            }
            Op::Close { during } => self.close(*during).await,
            Op::Prune { worker } => self.prune(*worker).await,
            Op::LapseLease { pick } => {
                // Leases still live on messages that are visible (jobs waiting in a backlog), or
                // whose message is gone (kept by a cancel for a running delivery: its end is past
                // that delivery's budget).
                let targets: Vec<(String, i64)> = sqlx::query_as(
                    "SELECT l.queue, l.msg_id FROM lockgate.leases l
                       LEFT JOIN pgmq.q_default d ON l.queue = 'default' AND d.msg_id = l.msg_id
                       LEFT JOIN pgmq.q_other o ON l.queue = 'other' AND o.msg_id = l.msg_id
                      WHERE l.expires_at > clock_timestamp()
                        AND (COALESCE(d.vt, o.vt) <= clock_timestamp() OR COALESCE(d.msg_id, o.msg_id) IS NULL)
                      ORDER BY l.queue, l.msg_id",
                )
                .fetch_all(&mut self.c.observer)
                .await?;
                let Some((queue, msg_id)) = pick_from(&targets, *pick).cloned() else {
                    return Ok("no waiting message holds a live lease: nothing to do".into());
                };
                sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second' WHERE queue = $1 AND msg_id = $2")
                    .bind(&queue)
                    .bind(msg_id)
                    .execute(&mut self.c.observer)
                    .await?;
                let q = Queue::from_name(&queue).ok_or_else(|| anyhow!("lease on unknown queue {queue}"))?;
                self.budget_passed(q, msg_id).await?;
                let fenced = self.model.fence_message(q, msg_id, "its lease ran out");
                Ok(format!("lease of ({queue}, {msg_id}) expired{}", fenced_note(&fenced)))
            }
            Op::LapseVisibility { pick } => {
                let mut targets = Vec::new();
                for q in Queue::ALL {
                    let ids: Vec<i64> = sqlx::query_scalar(&format!(
                        "SELECT msg_id FROM {} WHERE vt > clock_timestamp() ORDER BY msg_id",
                        q.table("q")
                    ))
                    .fetch_all(&mut self.c.observer)
                    .await?;
                    targets.extend(ids.into_iter().map(|m| (q, m)));
                }
                // A cancelled job's message is archived, but the visibility its running delivery
                // had at the cancel is its holder's budget still.
                targets.extend(self.model.cancelled_invisible());
                let Some((queue, msg_id)) = pick_from(&targets, *pick).copied() else {
                    return Ok("no invisible message: nothing to do".into());
                };
                set_vt_past(&mut self.c.observer, queue, msg_id).await?;
                self.budget_passed(queue, msg_id).await?;
                let fenced = self.model.fence_message(queue, msg_id, "its visibility ran out");
                Ok(format!("visibility of ({}, {msg_id}) passed{}", queue.name(), fenced_note(&fenced)))
            }
            Op::LapseKeptLease { pick } => {
                // Leases still live, not finished, whose message is gone, kept by a cancel for a
                // delivery whose handler has stopped without giving them back.
                let leases: Vec<(String, i64)> = sqlx::query_as(
                    "SELECT l.queue, l.msg_id FROM lockgate.leases l
                       LEFT JOIN pgmq.q_default d ON l.queue = 'default' AND d.msg_id = l.msg_id
                       LEFT JOIN pgmq.q_other o ON l.queue = 'other' AND o.msg_id = l.msg_id
                      WHERE l.expires_at > clock_timestamp() AND l.finished_at IS NULL
                        AND COALESCE(d.msg_id, o.msg_id) IS NULL
                      ORDER BY l.queue, l.msg_id",
                )
                .fetch_all(&mut self.c.observer)
                .await?;
                let targets: Vec<(String, i64)> = leases
                    .into_iter()
                    .filter(|(queue, msg_id)| {
                        let of = |d: &&Delivery| d.queue.name() == queue && d.msg_id == *msg_id;
                        self.model.deliveries.iter().filter(of).any(|d| d.cancelled)
                            && !self.model.deliveries.iter().filter(of).any(|d| d.holder == Holder::Running)
                    })
                    .collect();
                let Some((queue, msg_id)) = pick_from(&targets, *pick).cloned() else {
                    return Ok("no lease kept for a stopped handler: nothing to do".into());
                };
                sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second' WHERE queue = $1 AND msg_id = $2")
                    .bind(&queue)
                    .bind(msg_id)
                    .execute(&mut self.c.observer)
                    .await?;
                let q = Queue::from_name(&queue).ok_or_else(|| anyhow!("lease on unknown queue {queue}"))?;
                self.budget_passed(q, msg_id).await?;
                Ok(format!("kept lease of ({queue}, {msg_id}) expired"))
            }
            Op::Silence { pick } => {
                let Some(i) = pick_from(&self.model.running(), *pick).copied() else {
                    return Ok("no running delivery: nothing to do".into());
                };
                let d = self.model.deliveries[i].clone();
                set_vt_past(&mut self.c.observer, d.queue, d.msg_id).await?;
                sqlx::query("UPDATE lockgate.leases SET expires_at = now() - interval '1 second' WHERE queue = $1 AND msg_id = $2")
                    .bind(d.queue.name())
                    .bind(d.msg_id)
                    .execute(&mut self.c.observer)
                    .await?;
                self.budget_passed(d.queue, d.msg_id).await?;
                let fenced = self.model.fence_message(d.queue, d.msg_id, "silent past its budget");
                Ok(format!("d{} {}: visibility and lease expired{}", d.id, d.token(), fenced_note(&fenced)))
            }
            Op::Cancel { pick } => self.cancel(*pick).await,
            Op::DlqRetry { pick } => self.dlq_retry(*pick).await,
            Op::Discard { pick } => self.discard(*pick).await,
            Op::Reap => {
                let keys: i32 = sqlx::query_scalar("SELECT lockgate.reclaim_idle_keys('0 seconds')")
                    .fetch_one(&mut self.c.dispatcher)
                    .await
                    .context("lockgate.reclaim_idle_keys")?;
                let mut said = format!("{keys} idle key(s) reclaimed");
                if self.api.bookkeeping {
                    let locks: i32 = sqlx::query_scalar("SELECT lockgate.reap_unique_locks('0 seconds')")
                        .fetch_one(&mut self.c.dispatcher)
                        .await
                        .context("lockgate.reap_unique_locks")?;
                    self.model.reaped();
                    said.push_str(&format!(", {locks} unique lock(s) reaped"));
                }
                Ok(said)
            }
            Op::Redefine { ty, limit } => {
                self.model.limits_changed = true;
                let old = self.model.limits.get(ty).copied();
                // A limit set again after it was removed finds the jobs that kept their permits
                // through the unlimited time running, as a lowered one does.
                if old.is_none_or(|old| *limit < old) {
                    // Jobs running now may finish under the old limit (see Model::carried). Jobs
                    // that hold a permit without running do not carry it over: their claim
                    // re-admits them under the new limit (design §80).
                    // On a key types share, every job running on it is carried: the type's jobs
                    // bind the others' admissions too (design §109).
                    let keys: BTreeSet<String> = self
                        .model
                        .deliveries
                        .iter()
                        .filter(|d| d.holder == Holder::Running && d.ty == Some(*ty))
                        .filter_map(|d| d.key.clone())
                        .collect();
                    let running: Vec<(String, i64)> = self
                        .model
                        .deliveries
                        .iter()
                        .filter(|d| d.holder == Holder::Running)
                        .filter_map(|d| d.key.clone().filter(|k| keys.contains(k)).map(|k| (k, d.job_id)))
                        .collect();
                    for (key, job) in running {
                        self.model.carried.entry(key).or_default().insert(job);
                    }
                    if *limit > 0 {
                        let held: Vec<String> = sqlx::query_scalar("SELECT DISTINCT key FROM lockgate.leases")
                            .fetch_all(&mut self.c.observer)
                            .await?;
                        self.model.lowered_on.extend(held);
                    }
                }
                let new = (*limit > 0).then_some(*limit);
                db::define(&mut self.c.observer, self.api, *ty, new).await?;
                match new {
                    Some(limit) => self.model.limits.insert(*ty, limit),
                    None => self.model.limits.remove(ty),
                };
                Ok(format!("{} limit {old:?} -> {new:?}", ty.name()))
            }
        }
    }

    /// `lockgate.close_batch` of the case's batch; with `during`, while an enqueue of (type, k)
    /// into it is open on the producer connection, which then commits (true) or rolls back. The
    /// close must not wait for that enqueue (H31) and cannot finish the batch while it is open;
    /// the enqueue's job, committed, counts in the batch, and once every job of the batch has a
    /// fate with none left to count, only the batch sweep finishes it.
    async fn close(&mut self, during: Option<(Ty, u8, bool)>) -> Result<String> {
        if !self.api.bookkeeping {
            return Ok("no batches in this schema: nothing to do".into());
        }
        let close = "SELECT lockgate.close_batch($1)";
        if self.model.batch.closed {
            let refused = sqlx::query_scalar::<_, String>(close).bind(db::BATCH).fetch_one(&mut self.c.producer).await;
            return match refused {
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("LG003") => Ok(format!("refused: {e}")),
                other => bail!("closing a closed batch answered {other:?}, not an LG003 error"),
            };
        }
        let Some((ty, k, commit)) = during else {
            let state: String = sqlx::query_scalar(close).bind(db::BATCH).fetch_one(&mut self.c.producer).await?;
            self.model.batch.closed = true;
            let expected = if self.model.batch_counted() { "finished" } else { "closed" };
            if state != expected {
                bail!("(j) close_batch returned {state}, expected {expected}");
            }
            *self
                .stats
                .entry(if state == "finished" {
                    "batch finished by its close"
                } else {
                    "batch closed with jobs to count"
                })
                .or_default() += 1;
            return Ok(state);
        };
        let mut tx = self.c.producer.begin().await?;
        let (msg_id, job_id, status): (Option<i64>, i64, String) =
            sqlx::query_as("SELECT msg_id, job_id, status FROM lockgate.enqueue($1, $2, $3)")
                .bind(ty.name())
                .bind(json!({ "k": k }))
                .bind(db::job_options(self.api, true, ty, k, self.model.limits.contains_key(&ty)))
                .fetch_one(&mut *tx)
                .await?;
        let closing = sqlx::query_scalar::<_, String>(close).bind(db::BATCH).fetch_one(&mut self.c.dispatcher);
        let state = match tokio::time::timeout(Duration::from_secs(10), closing).await {
            Ok(state) => state?,
            Err(_) => bail!("(j) close_batch waited for an open enqueue into the batch (H31)"),
        };
        self.model.batch.closed = true;
        let rows = [(msg_id, job_id, status.clone())];
        let said = if commit {
            tx.commit().await?;
            self.enqueued(ty, &[k], &rows, true)?
        } else {
            tx.rollback().await?;
            if status == "duplicate" {
                self.check_duplicate(ty, k, job_id)?;
            } else {
                self.model.rolled_back.insert(job_id);
            }
            format!("job {job_id} {status} (msg {msg_id:?}), rolled back")
        };
        self.model.batch.left_to_sweep = self.model.batch_counted();
        if self.model.batch.left_to_sweep {
            *self.stats.entry("batch left to the batch sweep").or_default() += 1;
        }
        if state != "closed" {
            bail!("(j) close_batch returned {state} while an enqueue into the batch was open");
        }
        Ok(format!("closed during an enqueue ({said})"))
    }

    /// Records the jobs an enqueue of `ty` with keys `ks` (in argument order) returned, into the
    /// case's batch or not.
    fn enqueued(&mut self, ty: Ty, ks: &[u8], rows: &[(Option<i64>, i64, String)], in_batch: bool) -> Result<String> {
        let mut said = Vec::new();
        for ((msg_id, job_id, status), k) in rows.iter().zip(ks) {
            match status.as_str() {
                "enqueued" | "parked" => {
                    if let Some(key) = self.model.unique_key(ty, *k) {
                        if let Some(holder) = self.model.key_holder(&key) {
                            bail!("(i) job {job_id} was {status} with unique key {key} that job {holder} holds");
                        }
                        self.model.took_key(&key);
                        self.model.unique.insert(*job_id, key);
                    }
                    self.model.jobs.insert(*job_id, Fate::Live);
                    if in_batch && self.api.bookkeeping {
                        self.model.batch_jobs.insert(*job_id);
                    }
                }
                "duplicate" => self.check_duplicate(ty, *k, *job_id)?,
                other => bail!("enqueue of a blocking type returned status {other} for job {job_id}"),
            }
            said.push(match msg_id {
                Some(m) => format!("job {job_id} {status} as msg {m}"),
                None => format!("job {job_id} {status}"),
            });
        }
        Ok(said.join(", "))
    }

    /// (i) An enqueue reported a duplicate: the key must be held by that live job.
    fn check_duplicate(&mut self, ty: Ty, k: u8, holder: i64) -> Result<()> {
        let key = self.model.unique_key(ty, k);
        match key.as_deref().and_then(|key| self.model.key_holder(key)) {
            Some(h) if h == holder => {
                if self.model.live_holder(key.as_deref().unwrap_or_default()).is_none() {
                    *self.stats.entry("until_executed duplicate of a while_executing run").or_default() += 1;
                }
                Ok(())
            }
            other => bail!(
                "(i) enqueue of {} k {k} reported a duplicate of job {holder}, but the key's live holder is {other:?}",
                ty.name()
            ),
        }
    }

    /// Records what a claim returned, and checks each returned delivery at once: its job is
    /// live, and its budget outlives neither its visibility nor its lease (H24).
    async fn claimed(&mut self, worker: usize, queue: Queue, rows: Vec<Claimed>, started: Instant) -> Result<String> {
        let mut problems = Vec::new();
        let mut said = Vec::new();
        if self.model.limits.contains_key(&Ty::Wexec) && self.model.wlocks.values().any(|l| l.kept.is_none()) {
            // A claim parks a limited job again when its lease is gone and its key full; a
            // while_executing lock its run held goes with it (only `wexec` once it has a limit).
            let parked: Vec<i64> =
                sqlx::query_scalar("SELECT job_id FROM lockgate.parked").fetch_all(&mut self.c.observer).await?;
            self.model.parked_again(&parked);
        }
        for r in &rows {
            let (vt_left, lease_left) = self.time_left(queue, r.msg_id).await?;
            // The key is the one the message carries once the claim committed: a claim may give a
            // job a key its type gained after it was enqueued (H33).
            let key = self.message_key(queue, r.msg_id).await?;
            if key != r.key() {
                *self.stats.entry("claim returned a ckey other than its message's").or_default() += 1;
            }
            // A job whose type is limited when it is claimed must run holding a permit (G3).
            let limited = key.is_some() || r.ty().is_some_and(|ty| self.model.limits.contains_key(&ty));
            if self.api.claim_budget {
                problems.extend(
                    self.budget_problems("claim", queue, r.msg_id, r.budget, limited, vt_left, lease_left, started),
                );
            }
            if self.checks.on('d') && self.model.jobs.get(&r.job_id()) != Some(&Fate::Live) {
                problems.push(format!(
                    "(d) claim returned ({}, {}) of job {} which is {:?}",
                    queue.name(),
                    r.msg_id,
                    r.job_id(),
                    self.model.jobs.get(&r.job_id())
                ));
            }
            let delivery = Delivery {
                id: 0,
                worker,
                queue,
                msg_id: r.msg_id,
                read_ct: r.read_ct,
                job_id: r.job_id(),
                ty: r.ty(),
                key: key.clone(),
                limited,
                wkey: r.headers.get("wkey").and_then(serde_json::Value::as_str).map(str::to_string),
                holder: Holder::Running,
                cancelled: false,
                blocked: false,
            };
            let id = self.model.add_delivery(delivery, r.budget);
            if key.as_deref() == Some(SHARED_CKEY) {
                *self.stats.entry("run of the shared concurrency key claimed").or_default() += 1;
                let types: BTreeSet<Option<Ty>> = self.model.running_on(SHARED_CKEY).into_iter().collect();
                if types.len() > 1 {
                    *self.stats.entry("shared concurrency key run beside another type's").or_default() += 1;
                }
                if types.len() > 2 {
                    *self.stats.entry("shared concurrency key run beside two other types'").or_default() += 1;
                }
                let on_key: i64 = sqlx::query_scalar(
                    "SELECT count(DISTINCT job_type) FROM (SELECT job_type FROM lockgate.leases WHERE key = $1
                      UNION ALL SELECT job_type FROM lockgate.parked WHERE key = $1) x",
                )
                .bind(SHARED_CKEY)
                .fetch_one(&mut self.c.observer)
                .await?;
                if on_key > 2 {
                    *self
                        .stats
                        .entry("shared concurrency key claimed, three types holding or parked on it")
                        .or_default() += 1;
                }
                if types.iter().flatten().any(|ty| !self.model.limits.contains_key(ty)) {
                    *self
                        .stats
                        .entry("shared concurrency key run beside a holder whose type lost its limit")
                        .or_default() += 1;
                }
            }
            match self.model.deliveries[id].wkey.as_deref() {
                Some(SHARED_KEY) => {
                    *self.stats.entry("while_executing run of the shared key claimed").or_default() += 1
                }
                Some(_) => *self.stats.entry("while_executing run claimed").or_default() += 1,
                None => {}
            }
            if let Some(problem) = self.model.delivered(id).filter(|_| self.checks.on('l')) {
                problems.push(problem);
            }
            said.push(format!(
                "d{id} ({}, {}, {}) job {} key {} lease {}{}",
                queue.name(),
                r.msg_id,
                r.read_ct,
                r.job_id(),
                key.unwrap_or_else(|| "-".into()),
                match lease_left {
                    Some(l) => format!("{l:+.1}s"),
                    None => "none".into(),
                },
                match &self.model.deliveries[id].wkey {
                    Some(w) => format!(" while_executing {w}"),
                    None => String::new(),
                }
            ));
        }
        if !problems.is_empty() {
            bail!("{}", problems.join("\n  "));
        }
        Ok(if said.is_empty() { "nothing".into() } else { said.join("; ") })
    }

    /// The concurrency key a message carries now.
    async fn message_key(&mut self, queue: Queue, msg_id: i64) -> Result<Option<String>> {
        Ok(sqlx::query_scalar(&format!("SELECT headers->>'ckey' FROM {} WHERE msg_id = $1", queue.table("q")))
            .bind(msg_id)
            .fetch_optional(&mut self.c.observer)
            .await?
            .flatten())
    }

    /// Seconds until the message's visibility and its lease (if any) end.
    async fn time_left(&mut self, queue: Queue, msg_id: i64) -> Result<(Option<f64>, Option<f64>)> {
        Ok(sqlx::query_as(&format!(
            "SELECT extract(epoch FROM m.vt - clock_timestamp())::float8,
                    (SELECT extract(epoch FROM l.expires_at - clock_timestamp())::float8
                       FROM lockgate.leases l WHERE l.queue = $1 AND l.msg_id = m.msg_id)
               FROM {} m WHERE m.msg_id = $2",
            queue.table("q")
        ))
        .bind(queue.name())
        .bind(msg_id)
        .fetch_optional(&mut self.c.observer)
        .await?
        .unwrap_or((None, None)))
    }

    /// (b) A budget handed to a holder (by a claim or a renewal, counted from before the call
    /// was sent) must end no later than the delivery's visibility and, for a limited job, its
    /// lease: otherwise the holder could run on after its permit was given to another job.
    #[allow(clippy::too_many_arguments)]
    fn budget_problems(
        &self,
        what: &str,
        queue: Queue,
        msg_id: i64,
        budget: f64,
        limited: bool,
        vt_left: Option<f64>,
        lease_left: Option<f64>,
        started: Instant,
    ) -> Vec<String> {
        if !self.checks.on('b') {
            return Vec::new();
        }
        // An upper bound on the time since the call was sent, plus slack for comparing the
        // test's monotonic clock with the server's wall clock (a 26 ms disagreement was seen on
        // a loaded machine); a budget that outlives its lease does so by seconds, not by this.
        let elapsed = started.elapsed().as_secs_f64() + 0.25;
        let mut out = Vec::new();
        let (q, name) = (queue.name(), "visibility");
        match vt_left {
            Some(v) if budget > v + elapsed => out.push(format!(
                "(b) {what} of ({q}, {msg_id}) gave budget {budget:.3} s but its {name} ends in {v:.3} s"
            )),
            None => {
                out.push(format!("(b) {what} of ({q}, {msg_id}) gave budget {budget:.3} s but the message is gone"))
            }
            _ => {}
        }
        if limited {
            match lease_left {
                Some(l) if budget > l + elapsed => out.push(format!(
                    "(b) {what} of ({q}, {msg_id}) gave budget {budget:.3} s but its lease ends in {l:.3} s"
                )),
                None => {
                    out.push(format!("(b) {what} of ({q}, {msg_id}) gave budget {budget:.3} s but it has no lease"))
                }
                _ => {}
            }
        }
        out
    }

    /// Cancels a live job: the database must find it live and cancel it, and from then on the
    /// checks expect it archived once, its batch counted as failed, and every delivery of it
    /// stale. A job that was not running gives back its permit and unique lock at once; one that
    /// was running keeps them, and the holder of the delivery it was cancelled in runs on,
    /// unaware, until a heartbeat reports the delivery lost (`extend`), its budget runs out (a
    /// clock op) or it finishes and is refused (`finish`); only then does its worker call
    /// `lockgate.release_cancelled`.
    async fn cancel(&mut self, pick: usize) -> Result<String> {
        if !self.api.cancel {
            return Ok("no lockgate.cancel in this schema: nothing to do".into());
        }
        let live: Vec<i64> =
            self.model.jobs.iter().filter(|(_, fate)| **fate == Fate::Live).map(|(job, _)| *job).collect();
        let Some(job) = pick_from(&live, pick).copied() else {
            return Ok("no live job: nothing to do".into());
        };
        let found: Option<(String, String, bool)> =
            sqlx::query_as("SELECT state, queue, cancelled FROM lockgate.cancel($1)")
                .bind(job)
                .fetch_optional(&mut self.c.dispatcher)
                .await?;
        match found {
            Some((state, queue, true)) => {
                let mut running = None;
                if state == "running" {
                    // The delivery the cancel kept the job's permit for: the archived message's token.
                    let q = Queue::from_name(&queue)
                        .ok_or_else(|| anyhow!("job {job} cancelled on unknown queue {queue}"))?;
                    let (msg_id, read_ct): (i64, i32) = sqlx::query_as(&format!(
                        "SELECT msg_id, read_ct FROM {} WHERE COALESCE((headers->>'job_id')::bigint, msg_id) = $1
                            AND headers->>'cancelled_in' = 'running'",
                        q.table("a")
                    ))
                    .bind(job)
                    .fetch_one(&mut self.c.observer)
                    .await?;
                    let i = self
                        .model
                        .deliveries
                        .iter()
                        .position(|d| d.queue == q && d.msg_id == msg_id && d.read_ct == read_ct)
                        .ok_or_else(|| {
                            anyhow!("job {job} was cancelled running as ({queue}, {msg_id}, {read_ct}), a delivery no claim returned")
                        })?;
                    running = Some(i);
                    *self.stats.entry("cancel of a running job (holder runs on)").or_default() += 1;
                }
                self.model.cancel_job(job, running);
                Ok(match running {
                    Some(i) => {
                        let d = &self.model.deliveries[i];
                        format!(
                            "job {job} cancelled (it was {state}); d{} {} kept for its holder [{:?}]",
                            d.id,
                            d.token(),
                            d.holder
                        )
                    }
                    None => format!("job {job} cancelled (it was {state})"),
                })
            }
            Some((state, _, false)) => bail!("(d) live job {job} was not cancelled: lockgate.cancel found it {state}"),
            None => bail!("(d) live job {job} was not found by lockgate.cancel"),
        }
    }

    /// `lockgate.dlq_retry` of one dead-lettered job: it must be sent again as one new message
    /// carrying its id, unless it is unique and another live job holds its key, when it must stay
    /// dead and the answer must name that holder (d, i). A job of the batch leaves it, counted as
    /// failed (j). Called with report_busy, as the CLI calls it (the form whose unique-key take
    /// runs in a block of its own): nothing else holds a dead letter or a key between steps, so
    /// an answer of busy fails the case too.
    async fn dlq_retry(&mut self, pick: usize) -> Result<String> {
        let dead: Vec<i64> =
            self.model.jobs.iter().filter(|(_, fate)| **fate == Fate::DeadLettered).map(|(job, _)| *job).collect();
        let Some(job) = pick_from(&dead, pick).copied() else {
            return Ok("no dead-lettered job: nothing to do".into());
        };
        let rows: Vec<(Option<i64>, Option<i64>, String)> =
            sqlx::query_as("SELECT msg_id, job_id, status FROM lockgate.dlq_retry(NULL, ARRAY[$1]::bigint[], true)")
                .bind(job)
                .fetch_all(&mut self.c.dispatcher)
                .await?;
        let key = self.model.unique.get(&job).cloned();
        let holder = key.as_deref().and_then(|key| self.model.key_holder(key));
        match (rows.as_slice(), holder) {
            ([(Some(msg_id), Some(id), status)], None) if *id == job && status == "enqueued" => {
                if let Some(key) = key {
                    self.model.took_key(&key);
                }
                self.model.jobs.insert(job, Fate::Live);
                if self.model.batch_jobs.contains(&job) {
                    self.model.retried_out.insert(job);
                }
                Ok(format!("job {job} sent again as message {msg_id}"))
            }
            ([(None, Some(id), status)], Some(holder)) if *id == holder && status == "duplicate" => {
                *self.stats.entry("dlq_retry of a duplicate").or_default() += 1;
                Ok(format!("job {job} stays dead: job {holder} holds its unique key"))
            }
            (other, holder) => bail!(
                "(d) dlq_retry of dead-lettered job {job} answered {other:?}; expected {}",
                match holder {
                    Some(h) => format!("a duplicate of live job {h}"),
                    None => "it enqueued".into(),
                }
            ),
        }
    }

    /// `lockgate.discard_job` of one dead-lettered or parked job: the database must find it in
    /// that state and delete it (d); a parked one is counted as failed in its batch (j) and its
    /// unique key goes (i).
    async fn discard(&mut self, pick: usize) -> Result<String> {
        let parked: Vec<i64> =
            sqlx::query_scalar("SELECT job_id FROM lockgate.parked").fetch_all(&mut self.c.observer).await?;
        let mut targets: Vec<(i64, &str)> = self
            .model
            .jobs
            .iter()
            .filter(|(_, fate)| **fate == Fate::DeadLettered)
            .map(|(job, _)| (*job, "dead"))
            .chain(parked.iter().map(|job| (*job, "parked")))
            .collect();
        targets.sort();
        let Some((job, expected)) = pick_from(&targets, pick).copied() else {
            return Ok("no dead-lettered or parked job: nothing to do".into());
        };
        let (state, discarded): (Option<String>, bool) =
            sqlx::query_as("SELECT state, discarded FROM lockgate.discard_job($1)")
                .bind(job)
                .fetch_one(&mut self.c.dispatcher)
                .await?;
        if state.as_deref() != Some(expected) || !discarded {
            bail!("(d) discard_job of {expected} job {job} answered ({state:?}, {discarded})");
        }
        self.model.jobs.insert(job, Fate::Discarded);
        Ok(format!("job {job} discarded (it was {expected})"))
    }

    /// Clock: the budget of the deliveries of (queue, msg_id) has passed, and with it the
    /// held_until of a while_executing lock a cancel kept for one of them (the visibility that
    /// delivery had at the cancel).
    async fn budget_passed(&mut self, queue: Queue, msg_id: i64) -> Result<()> {
        if self.api.bookkeeping && self.model.wlocks.values().any(|l| l.kept.is_some()) {
            sqlx::query(
                "UPDATE lockgate.unique_locks SET held_until = now() - interval '1 second'
                  WHERE queue = $1 AND msg_id = $2 AND held_until > now()",
            )
            .bind(queue.name())
            .bind(msg_id)
            .execute(&mut self.c.observer)
            .await?;
        }
        self.model.budget_passed(queue, msg_id);
        Ok(())
    }

    /// Delivery i's handler has ended after its worker learned it lost the delivery (or was
    /// refused its finish): the worker gives back what a cancel kept for it, as the runtime does
    /// (`give_back_if_cancelled`). (f) Only the delivery its job was cancelled in may release
    /// anything. Returns what it said, for the trace.
    /// The heartbeat of delivery i, whose handler was told of its cancel and blocks on, renews
    /// what the cancel kept (`lockgate.extend_cancelled`): it must answer exactly while the kept
    /// lease or while_executing lock is live (h, f), and leave it live; answered nothing, the
    /// holder is no longer entitled (what it kept ran out: the frozen-process case).
    async fn extend_cancelled(&mut self, i: usize, problems: &mut Vec<String>) -> Result<String> {
        let d = self.model.deliveries[i].clone();
        let live = self.kept_live(&d).await?;
        let answer = db::extend_cancelled(&mut self.c.workers[d.worker], d.queue, d.msg_id, d.read_ct).await?;
        *self.stats.entry("blocked cancelled handler renewed").or_default() += 1;
        let renewed = answer.iter().any(|(m, _)| *m == d.msg_id);
        if live && !renewed && self.checks.on('h') {
            problems.push(format!(
                "(h) extend_cancelled of {} answered nothing while what its cancel kept was live",
                d.describe()
            ));
        }
        if renewed && !live && self.checks.on('f') {
            problems
                .push(format!("(f) extend_cancelled of {} renewed what was no longer held: {answer:?}", d.describe()));
        }
        if renewed && !self.kept_live(&d).await? && self.checks.on('h') {
            problems.push(format!("(h) extend_cancelled of {} answered, but left nothing live", d.describe()));
        }
        if !renewed {
            self.model.deliveries[i].holder = Holder::Fenced("what its cancel kept ran out".into());
        }
        Ok(format!("d{} (cancelled, blocking) renewed: {answer:?}", d.id))
    }

    /// Whether the permit lease or while_executing lock of delivery `d`'s message is live.
    async fn kept_live(&mut self, d: &Delivery) -> Result<bool> {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM lockgate.leases WHERE queue = $1 AND msg_id = $2 AND expires_at > clock_timestamp()
                                                            AND finished_at IS NULL)
                 OR EXISTS (SELECT 1 FROM lockgate.unique_locks WHERE queue = $1 AND msg_id = $2
                               AND mode = 'while_executing' AND held_until > clock_timestamp())",
        )
        .bind(d.queue.name())
        .bind(d.msg_id)
        .fetch_one(&mut self.c.observer)
        .await?)
    }

    async fn release_cancelled(&mut self, i: usize, problems: &mut Vec<String>) -> Result<String> {
        let d = self.model.deliveries[i].clone();
        let gave: bool = sqlx::query_scalar("SELECT lockgate.release_cancelled($1, $2, $3)")
            .bind(d.queue.name())
            .bind(d.msg_id)
            .bind(d.read_ct)
            .fetch_one(&mut self.c.workers[d.worker])
            .await?;
        if gave && !d.cancelled && self.checks.on('f') {
            problems.push(format!("(f) release_cancelled with {} released something", d.describe()));
        }
        if self.model.released(i) && !gave && self.checks.on('l') {
            problems.push(format!(
                "(l) release_cancelled with {} released nothing, though its while_executing lock was kept for it",
                d.describe()
            ));
        }
        Ok(if gave {
            format!("d{} released what its cancel kept", d.id)
        } else {
            format!("d{} released nothing", d.id)
        })
    }

    /// A sweep runs on the dispatcher and stays uncommitted while a worker claims; the sweep
    /// commits as soon as the claim is seen waiting on a lock (or once it has returned, if it
    /// never waits). Which of the two happens is decided by the database, not by timing.
    async fn claim_racing_sweep(&mut self, worker: usize, queue: Queue, qty: u8) -> Result<String> {
        let owner = self.model.owners[worker];
        let api = self.api;
        let pid = self.c.worker_pids[worker];
        let mut sweep_tx = self.c.dispatcher.begin().await?;
        let swept: String = sqlx::query_scalar("SELECT row_to_json(s)::text FROM lockgate.sweep(1000) s")
            .fetch_one(&mut *sweep_tx)
            .await?;
        self.model.swept();
        let started = Instant::now();
        let (rows, waited) = {
            let claim = db::claim(&mut self.c.workers[worker], api, queue, qty, owner);
            tokio::pin!(claim);
            let deadline = Instant::now() + Duration::from_secs(20);
            // Polls the claim (never dropping it mid-statement) and the claim's backend's wait state.
            let early = loop {
                if let Ok(rows) = tokio::time::timeout(Duration::from_millis(2), &mut claim).await {
                    break Some(rows);
                }
                let waiting: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock')",
                )
                .bind(pid)
                .fetch_one(&mut self.c.observer)
                .await?;
                if waiting {
                    break None;
                }
                if Instant::now() > deadline {
                    bail!("the claim neither returned nor waited on a lock within 20 s");
                }
            };
            let waited = early.is_none();
            sweep_tx.commit().await?;
            let rows = match early {
                Some(rows) => rows?,
                None => claim.await?,
            };
            (rows, waited)
        };
        self.note_racing_put_backs(queue).await?;
        let said = self.claimed(worker, queue, rows, started).await?;
        Ok(format!("sweep {swept}; claim {} -> {said}", if waited { "waited for the sweep" } else { "did not wait" }))
    }

    async fn extend(&mut self, mask: u8, blocked: bool) -> Result<String> {
        let picked: Vec<usize> = self
            .model
            .running()
            .into_iter()
            .take(8)
            .enumerate()
            .filter(|(b, _)| mask & (1 << b) != 0)
            .map(|(_, i)| i)
            .collect();
        let blocking = self.model.running().into_iter().any(|i| self.model.deliveries[i].blocked);
        if picked.is_empty() && !(blocked && blocking) {
            return Ok("no running delivery picked: nothing to do".into());
        }
        let mut said = Vec::new();
        let mut problems = Vec::new();
        // Handlers that were told of their cancel and block on: their heartbeat renews what the
        // cancel kept, while they still block; otherwise they have ended (design §95).
        let (mut told, picked): (Vec<usize>, Vec<usize>) =
            picked.into_iter().partition(|&i| self.model.deliveries[i].blocked);
        if blocked {
            // Each tick renews every handler still blocking, picked or not.
            told = self.model.running().into_iter().filter(|&i| self.model.deliveries[i].blocked).collect();
        }
        for i in told {
            if blocked {
                said.push(self.extend_cancelled(i, &mut problems).await?);
            } else {
                self.model.deliveries[i].holder = Holder::Fenced("its handler ended after its cancel".into());
                said.push(self.release_cancelled(i, &mut problems).await?);
            }
        }
        let mut groups: BTreeMap<(usize, Queue), Vec<usize>> = BTreeMap::new();
        for i in picked {
            let d = &self.model.deliveries[i];
            groups.entry((d.worker, d.queue)).or_default().push(i);
        }
        for ((worker, queue), ds) in groups {
            let mut healthy = Vec::new();
            for &i in &ds {
                healthy.push(self.current(i).await?);
            }
            let tokens: Vec<(i64, i32)> =
                ds.iter().map(|&i| (self.model.deliveries[i].msg_id, self.model.deliveries[i].read_ct)).collect();
            let started = Instant::now();
            let renewed =
                db::extend(&mut self.c.workers[worker], self.api, queue, &tokens, self.model.owners[worker]).await?;
            let mut lost = Vec::new();
            for (&i, healthy) in ds.iter().zip(healthy) {
                let (msg_id, limited) = {
                    let d = &self.model.deliveries[i];
                    (d.msg_id, d.limited)
                };
                if let (true, Some(Some(budget))) = (self.api.extend_budget, renewed.get(&msg_id)) {
                    let (vt_left, lease_left) = self.time_left(queue, msg_id).await?;
                    problems.extend(
                        self.budget_problems("renewal", queue, msg_id, *budget, limited, vt_left, lease_left, started),
                    );
                }
                let d = &mut self.model.deliveries[i];
                match renewed.get(&d.msg_id) {
                    Some(Some(budget)) if *budget > 0.0 => said.push(format!("d{} renewed {budget:.1}s", d.id)),
                    Some(None) => said.push(format!("d{} skipped (locked)", d.id)),
                    answer => {
                        said.push(format!("d{} lost", d.id));
                        if healthy && self.checks.on('h') {
                            problems.push(format!(
                                "(h) the renewal of {} was refused ({answer:?}) while it was current and leased",
                                d.describe()
                            ));
                        }
                        lost.push(i);
                    }
                }
            }
            let mut cancelled = Vec::new();
            if !lost.is_empty() && self.api.cancel {
                // As the heartbeat does: which of the lost deliveries were cancelled, so their
                // handlers learn why. (h) Exactly the deliveries a job was cancelled in.
                let (ids, cts): (Vec<i64>, Vec<i32>) =
                    lost.iter().map(|&i| (self.model.deliveries[i].msg_id, self.model.deliveries[i].read_ct)).unzip();
                cancelled = sqlx::query_scalar("SELECT lockgate.cancelled_messages($1, $2, $3)")
                    .bind(queue.name())
                    .bind(ids)
                    .bind(cts)
                    .fetch_all(&mut self.c.workers[worker])
                    .await?;
            }
            for i in lost {
                let d = &self.model.deliveries[i];
                let told = cancelled.contains(&d.msg_id);
                if self.api.cancel && told != d.cancelled && self.checks.on('h') {
                    problems.push(format!(
                        "(h) the heartbeat found {} lost, and cancelled_messages said it was {}cancelled",
                        d.describe(),
                        if told { "" } else { "not " }
                    ));
                }
                if told && blocked && self.api.extend_cancelled {
                    // Told, its handler does not stop: it runs on, keeping what its cancel kept.
                    *self.stats.entry("cancelled handler blocking on").or_default() += 1;
                    said.push(format!("d{} told it was cancelled: blocks on", d.id));
                    self.model.deliveries[i].blocked = true;
                    continue;
                }
                self.model.deliveries[i].holder = Holder::Fenced("its renewal said it was lost".into());
                if told {
                    // Once its handler has ended, its worker gives back what the cancel kept.
                    *self.stats.entry("heartbeat told a holder of its cancel").or_default() += 1;
                    let gave = self.release_cancelled(i, &mut problems).await?;
                    said.push(format!("d{} told it was cancelled: {gave}", self.model.deliveries[i].id));
                }
            }
        }
        if !problems.is_empty() {
            bail!("{}", problems.join("\n  "));
        }
        Ok(said.join(", "))
    }

    /// Whether delivery i is current in the database: its message holds its read_ct and, for a
    /// limited job, a live lease.
    async fn current(&mut self, i: usize) -> Result<bool> {
        let d = &self.model.deliveries[i];
        let limited = d.limited;
        Ok(sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM {} m WHERE m.msg_id = $1 AND m.read_ct = $2)
                AND (NOT $3 OR EXISTS (SELECT 1 FROM lockgate.leases l
                                        WHERE l.queue = $4 AND l.msg_id = $1 AND l.expires_at > clock_timestamp()))",
            d.queue.table("q")
        ))
        .bind(d.msg_id)
        .bind(d.read_ct)
        .bind(limited)
        .bind(d.queue.name())
        .fetch_one(&mut self.c.observer)
        .await?)
    }

    /// Delivery i's holder finishes it. A running holder whose delivery is current must be
    /// heard (h); any call that takes effect must have held the current token (f).
    /// A producer enqueues a job of delivery `i`'s type and key (`k` read back from its
    /// concurrency key, `lim:[1]`) in a transaction it keeps open, holding the key's row; the
    /// holder finishes the delivery, which must land without waiting for that row (H28); then the
    /// producer commits or rolls back.
    async fn finish_behind_producer(&mut self, i: usize, how: Finish, commit: bool) -> Result<String> {
        let d = self.model.deliveries[i].clone();
        let Some(ty) = d.ty else {
            return Ok(format!("{} has no known type: nothing to do", d.describe()));
        };
        let k = key_argument(&d);
        let in_batch = !self.model.batch.closed;
        sqlx::query("BEGIN").execute(&mut self.c.producer).await?;
        let rows = self.producer_enqueue(ty, k, in_batch).await?;
        // A committed enqueue is recorded as of when it ran, before the finish: what it saw then
        // (a duplicate of the running job, say) is what it answered.
        let said = if commit { self.enqueued(ty, &[k], &rows, in_batch)? } else { "rolled back".into() };
        let finished = tokio::time::timeout(Duration::from_secs(10), self.finish(i, how))
            .await
            .map_err(|_| anyhow!("{how:?} of {} waited for the producer's open transaction", d.describe()))??;
        if commit {
            sqlx::query("COMMIT").execute(&mut self.c.producer).await?;
        } else {
            sqlx::query("ROLLBACK").execute(&mut self.c.producer).await?;
            for (_, job_id, status) in &rows {
                if status != "duplicate" {
                    self.model.rolled_back.insert(*job_id);
                }
            }
        }
        Ok(format!("{finished}; the producer's enqueue of {} {{k:{k}}}: {said}", ty.name()))
    }

    /// `lockgate.enqueue` of (ty, {k}) on the producer connection, in whatever transaction it has
    /// open: (msg_id, job_id, status).
    async fn producer_enqueue(&mut self, ty: Ty, k: u8, in_batch: bool) -> Result<Vec<(Option<i64>, i64, String)>> {
        Ok(sqlx::query_as("SELECT msg_id, job_id, status FROM lockgate.enqueue($1, $2, $3)")
            .bind(ty.name())
            .bind(json!({ "k": k }))
            .bind(db::job_options(self.api, in_batch, ty, k, self.model.limits.contains_key(&ty)))
            .fetch_all(&mut self.c.producer)
            .await?)
    }

    /// §78's schedule, which a finish that takes its snapshot in its own first statement never
    /// meets: the snapshot is older than a committed enqueue that may have parked a job behind
    /// the delivery. The finish must not give the permit past that job ((a), (c), and the drain
    /// finding nothing stuck); a serialization failure is an answer its caller retries, and the
    /// delivery runs on.
    async fn finish_on_old_snapshot(&mut self, i: usize, how: Finish) -> Result<String> {
        let d = self.model.deliveries[i].clone();
        let Some(ty) = d.ty else {
            return Ok(format!("{} has no known type: nothing to do", d.describe()));
        };
        let k = key_argument(&d);
        let conn = &mut self.c.workers[d.worker];
        sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut *conn).await?;
        sqlx::query("SELECT 1").execute(&mut *conn).await?;
        let in_batch = !self.model.batch.closed;
        let rows = self.producer_enqueue(ty, k, in_batch).await?;
        let said = self.enqueued(ty, &[k], &rows, in_batch)?;
        let finished = self.finish_in(i, how, Snapshot::Open).await?;
        Ok(format!("the producer's enqueue of {} {{k:{k}}}: {said}; then {finished}", ty.name()))
    }

    async fn finish(&mut self, i: usize, how: Finish) -> Result<String> {
        // Worker 1 completes and dead-letters at REPEATABLE READ, as an SQL caller may: its permits
        // are left finished for a READ COMMITTED give-back (design §78), which the reference must
        // see happen by the next enqueue of the key, or the sweep.
        let worker = self.model.deliveries[i].worker;
        let snapshot = if worker == 1 && matches!(how, Finish::Complete | Finish::DeadLetter) {
            Snapshot::Repeatable
        } else {
            Snapshot::Own
        };
        self.finish_in(i, how, snapshot).await
    }

    async fn finish_in(&mut self, i: usize, how: Finish, snapshot: Snapshot) -> Result<String> {
        let healthy = self.model.deliveries[i].holder == Holder::Running && self.current(i).await?;
        let message_current = self.message_current(i).await?;
        let d = self.model.deliveries[i].clone();
        let conn = &mut self.c.workers[d.worker];
        let repeatable = snapshot != Snapshot::Own;
        if snapshot == Snapshot::Repeatable {
            sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut *conn).await?;
        }
        let ran = match how {
            Finish::Complete => {
                db::complete(conn, d.queue, d.msg_id, d.read_ct).await.map(|ids| ids.contains(&d.msg_id))
            }
            Finish::Retry { backoff } => {
                db::retry(conn, d.queue, d.msg_id, d.read_ct, if backoff { 3600.0 } else { 0.0 }).await
            }
            Finish::Release => db::release(conn, d.queue, d.msg_id, d.read_ct).await.map(|ids| ids.contains(&d.msg_id)),
            Finish::DeadLetter => db::dead_letter(conn, d.queue, d.msg_id, d.read_ct).await,
        };
        let took = match ran {
            Ok(took) => took,
            Err(error) if repeatable && db::sqlstate(&error).as_deref() == Some("40001") => {
                sqlx::query("ROLLBACK").execute(&mut *conn).await?;
                *self.stats.entry("finish failed to serialize").or_default() += 1;
                return Ok(format!(
                    "d{} {} -> serialization failure, rolled back: runs on ({error:#})",
                    d.id,
                    d.token()
                ));
            }
            Err(error) => return Err(error),
        };
        if repeatable {
            sqlx::query("COMMIT").execute(&mut *conn).await?;
        }
        self.model.deliveries[i].holder = Holder::Finished(format!("{how:?}, took effect: {took}"));
        let mut released = String::new();
        if !took && self.api.cancel {
            // The worker, refused, gives back what a cancel of its job kept for it, if anything.
            let mut problems = Vec::new();
            released = format!(", {}", self.release_cancelled(i, &mut problems).await?);
            if !problems.is_empty() {
                bail!("{}", problems.join("\n  "));
            }
        }
        if took {
            if !message_current && self.checks.on('f') {
                bail!("(f) {how:?} took effect for {} whose token was not current", d.describe());
            }
            self.model.run_ended(d.job_id);
            match how {
                Finish::Complete => {
                    self.model.jobs.insert(d.job_id, Fate::Archived);
                    self.model.gone.insert((d.queue, d.msg_id));
                }
                Finish::DeadLetter => {
                    self.model.jobs.insert(d.job_id, Fate::DeadLettered);
                    self.model.gone.insert((d.queue, d.msg_id));
                }
                Finish::Retry { .. } | Finish::Release => {}
            }
            // A batch count at REPEATABLE READ never finishes the batch (its snapshot may miss a
            // producer's commit): the last job counted so leaves the finish to the batch sweep.
            if repeatable
                && self.model.batch.closed
                && self.model.batch_jobs.contains(&d.job_id)
                // (a job retried out of the dead letters is no longer the batch's)
                && !self.model.retried_out.contains(&d.job_id)
                && self.model.batch_counted()
            {
                self.model.batch.left_to_sweep = true;
                *self.stats.entry("batch left to the batch sweep").or_default() += 1;
            }
        } else if healthy && self.checks.on('h') {
            bail!("(h) {how:?} of {} was refused while it was current and leased", d.describe());
        }
        Ok(format!("d{} {} -> {}{released}", d.id, d.token(), if took { "took effect" } else { "refused" }))
    }

    async fn message_current(&mut self, i: usize) -> Result<bool> {
        let d = &self.model.deliveries[i];
        Ok(sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM {} m WHERE m.msg_id = $1 AND m.read_ct = $2)",
            d.queue.table("q")
        ))
        .bind(d.msg_id)
        .bind(d.read_ct)
        .fetch_one(&mut self.c.observer)
        .await?)
    }

    /// (f) A stale token's call must change nothing and say so.
    async fn stale(&mut self, pick: usize, action: StaleAction) -> Result<String> {
        let Some(i) = pick_from(&self.model.stale(), pick).copied() else {
            return Ok("no stale token yet: nothing to do".into());
        };
        let d = self.model.deliveries[i].clone();
        // A cancelled job's delivery whose holder ran out of budget may still renew what its
        // cancel kept, while that is live: no one else can hold it, and holding it longer admits
        // fewer jobs, never more (its worker's handler may still be running, design §95).
        let kept_live = action == StaleAction::ExtendCancelled && d.cancelled && self.kept_live(&d).await?;
        let before = db::snapshot(&mut self.c.observer).await?;
        let conn = &mut self.c.workers[d.worker];
        let answer = match action {
            StaleAction::Complete => format!("{:?}", db::complete(conn, d.queue, d.msg_id, d.read_ct).await?),
            StaleAction::Retry => format!("{}", db::retry(conn, d.queue, d.msg_id, d.read_ct, 0.0).await?),
            StaleAction::Release => format!("{:?}", db::release(conn, d.queue, d.msg_id, d.read_ct).await?),
            StaleAction::DeadLetter => format!("{}", db::dead_letter(conn, d.queue, d.msg_id, d.read_ct).await?),
            StaleAction::Extend => {
                let owner = self.model.owners[d.worker];
                let renewed = db::extend(conn, self.api, d.queue, &[(d.msg_id, d.read_ct)], owner).await?;
                // A skipped (locked) answer is no renewal either.
                let answer: Vec<i64> = renewed.iter().filter(|(_, b)| b.is_some()).map(|(m, _)| *m).collect();
                format!("{answer:?}")
            }
            StaleAction::ExtendCancelled if self.api.extend_cancelled => {
                format!("{:?}", db::extend_cancelled(conn, d.queue, d.msg_id, d.read_ct).await?)
            }
            StaleAction::ExtendCancelled => return Ok("no lockgate.extend_cancelled: nothing to do".into()),
        };
        let after = db::snapshot(&mut self.c.observer).await?;
        if kept_live {
            return Ok(format!("d{} {} -> {answer}, what its cancel kept was still live", d.id, d.token()));
        }
        if self.checks.on('f') {
            if !matches!(answer.as_str(), "[]" | "false") {
                bail!("(f) stale {action:?} with {} answered {answer}, as if it owned the delivery", d.describe());
            }
            if before != after {
                bail!(
                    "(f) stale {action:?} with {} changed the database:\n    before: {before}\n    after:  {after}",
                    d.describe()
                );
            }
        }
        Ok(format!("d{} {} -> {answer}, nothing changed", d.id, d.token()))
    }

    /// The process's registry heartbeat stalls past the alive threshold; its job heartbeats (and
    /// so its deliveries' visibility and leases) stay as they are. A pruned process re-registers.
    async fn prune(&mut self, worker: usize) -> Result<String> {
        let owner = self.model.owners[worker];
        sqlx::query("UPDATE lockgate.processes SET last_heartbeat_at = now() - interval '120 seconds' WHERE id = $1 OR supervisor_id = $1")
            .bind(owner)
            .execute(&mut self.c.observer)
            .await?;
        let pruned: Vec<String> = sqlx::query_scalar("SELECT row_to_json(p)::text FROM lockgate.prune_processes(60) p")
            .fetch_all(&mut self.c.dispatcher)
            .await?;
        let alive: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM lockgate.processes WHERE id = $1)")
            .bind(owner)
            .fetch_one(&mut self.c.observer)
            .await?;
        if !alive {
            self.model.owners[worker] = db::register(&mut self.c.observer, worker).await?;
        }
        Ok(format!("pruned {pruned:?}; worker {worker} is now process {}", self.model.owners[worker]))
    }

    /// After the schedule, the other half of G1: every job still live can still finish. The
    /// running holders complete their jobs; when no claim finds anything, clocks run past every
    /// visibility (a backoff, a put-back, a cancelled handler's budget) and every waiting lease,
    /// and a sweep runs; the workers claim and complete until no job is live. Every step is
    /// checked as the schedule's are. A job left parked where no completion or sweep promotes
    /// it, or a message no claim takes, fails the case, naming where it is.
    ///
    /// (p) First without any lease running out but those a cancel kept for a handler that
    /// stopped without giving them back: handlers blocking on after their cancel end (their
    /// worker gives back what the cancel kept), and clocks pass visibilities only. Every permit
    /// is then held by a job that runs, will run once its visibility passes, or waits for a
    /// sweep's promotion, so nothing needs a lease to lapse to move on: a job still live after
    /// that waits for a permit held by a job that does not run (design §114: a job put back to
    /// wait for a unique key held by the very job parked behind its permit). The drain then goes
    /// on with leases lapsing, to tell that stall (p) from a job stuck for good (d).
    async fn drain(&mut self) -> Result<()> {
        let mut n = 0;
        let mut stalled = None;
        if self.checks.on('p') {
            if self.drain_rounds(&mut n, false).await? {
                return self.check_histories().await;
            }
            let live: Vec<i64> =
                self.model.jobs.iter().filter(|(_, fate)| **fate == Fate::Live).map(|(job, _)| *job).collect();
            let state = State::read(&mut self.c.observer, self.api).await?;
            let leases: Vec<(String, i64, String, Option<String>)> = sqlx::query_as(
                "SELECT queue, msg_id, key, to_jsonb(l)->>'job_type' FROM lockgate.leases l ORDER BY queue, msg_id",
            )
            .fetch_all(&mut self.c.observer)
            .await?;
            stalled = Some(format!(
                "(p) jobs {live:?} are still live after {DRAIN_ROUNDS} rounds of claims, completions, passed \
                 visibilities and sweeps with no lease running out; queued {:?}, parked {:?}, leases {leases:?}",
                state.messages.iter().map(|m| (m.queue.name(), m.msg_id, m.job_id)).collect::<Vec<_>>(),
                state.parked
            ));
            self.log(format!("   {}", stalled.as_deref().unwrap_or_default()));
        }
        if self.drain_rounds(&mut n, true).await? {
            if let Some(stalled) = stalled {
                bail!("after the drain: {stalled}; once leases ran out, they finished");
            }
            return self.check_histories().await;
        }
        let live: Vec<i64> =
            self.model.jobs.iter().filter(|(_, fate)| **fate == Fate::Live).map(|(job, _)| *job).collect();
        let state = State::read(&mut self.c.observer, self.api).await?;
        bail!(
            "(d) jobs {live:?} are still live after {DRAIN_ROUNDS} rounds of claims, completions, lapsed clocks and sweeps; \
             queued {:?}, parked {:?}",
            state.messages.iter().map(|m| (m.queue.name(), m.msg_id, m.job_id)).collect::<Vec<_>>(),
            state.parked
        )
    }

    /// Up to `DRAIN_ROUNDS` rounds of the drain, waiting leases running out only with `leases`;
    /// returns whether every job has its fate.
    async fn drain_rounds(&mut self, n: &mut usize, leases: bool) -> Result<bool> {
        for _ in 0..DRAIN_ROUNDS {
            if self.model.jobs.values().all(|fate| *fate != Fate::Live) {
                return Ok(true);
            }
            let mut ops: Vec<Op> =
                self.model.running().iter().map(|_| Op::Finish { pick: 0, how: Finish::Complete }).collect();
            ops.extend(Queue::ALL.map(|queue| Op::Claim { worker: 0, queue, qty: 3 }));
            let mut claimed = false;
            for op in &ops {
                let said = self.drain_step(n, op).await?;
                claimed |= matches!(op, Op::Claim { .. }) && !said.ends_with("nothing");
            }
            // A handler blocking on after its cancel ends: its worker gives back what the cancel
            // kept (the heartbeat picks the first eight running deliveries, all of them blocking
            // once the others have finished).
            for _ in 0..DRAIN_ROUNDS {
                if !self.model.running().iter().any(|&i| self.model.deliveries[i].blocked) {
                    break;
                }
                self.drain_step(n, &Op::Extend { mask: 0xff, blocked: false }).await?;
            }
            if claimed {
                continue;
            }
            let mut lapses = vec![Op::LapseVisibility { pick: 0 }, Op::LapseKeptLease { pick: 0 }];
            if leases {
                lapses.push(Op::LapseLease { pick: 0 });
            }
            for op in lapses {
                for _ in 0..DRAIN_ROUNDS {
                    if self.drain_step(n, &op).await?.contains("nothing to do") {
                        break;
                    }
                }
            }
            self.drain_step(n, &Op::Sweep).await?;
        }
        Ok(self.model.jobs.values().all(|fate| *fate != Fate::Live))
    }

    /// Check (n), once every job has its fate: one history entry per attempt.
    async fn check_histories(&mut self) -> Result<()> {
        if !self.checks.on('n') {
            return Ok(());
        }
        let broken = db::histories_broken(&mut self.c.observer).await?;
        if !broken.is_empty() {
            bail!("after the drain:\n  {}", broken.join("\n  "));
        }
        Ok(())
    }

    /// One step of the drain, logged and checked as the schedule's steps are.
    async fn drain_step(&mut self, n: &mut usize, op: &Op) -> Result<String> {
        *n += 1;
        let said = self.step(op).await.map_err(|e| anyhow!("drain step {n} ({op}): {e:#}"))?;
        self.log(format!("   d{n}. {op}  ->  {said}"));
        self.check().await.map_err(|e| anyhow!("after drain step {n} ({op}):\n  {e:#}"))?;
        Ok(said)
    }

    /// Every check against the database, after a step.
    async fn check(&mut self) -> Result<()> {
        let state = State::read(&mut self.c.observer, self.api).await?;
        let mut violations = self.model.check(&state, &self.checks);
        if self.checks.on('e') && !state.invariants.is_empty() {
            // What a sweep repairs is not a violation; what survives a sweep is.
            let after_sweep = db::invariants_after_sweep(&mut self.c.observer).await?;
            violations.retain(|v| !v.starts_with("(e)"));
            if !after_sweep.is_empty() {
                violations.push(format!("(e) check_invariants() even after a sweep: {after_sweep:?}"));
            }
        }
        if self.checks.on('o') {
            violations.extend(self.put_back_with_permits().await?);
        }
        if self.checks.on('m') && !self.model.limits_changed {
            violations.extend(
                db::free_permits_behind_parked_jobs(&mut self.c.observer, self.api).await?.into_iter().map(
                    |(key, value, lim, parked)| {
                        format!("(m) key {key} has a free permit ({value} of {lim} taken) and {parked} parked jobs")
                    },
                ),
            );
        }
        if !violations.is_empty() {
            bail!("{}", violations.join("\n  "));
        }
        Ok(())
    }
}

impl Run<'_> {
    /// Check (o), design §114: a `while_executing` job put back by a claim to wait for its unique
    /// key (invisible until its `put_back_until`) holds no concurrency permit. Those put back by a
    /// claim racing a sweep's open transaction are left out: a key row or unique lock the sweep
    /// holds puts a job back keeping its permit, by design (a wait of a moment).
    async fn put_back_with_permits(&mut self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for q in Queue::ALL {
            let rows: Vec<(i64, i32, i64, Option<String>, String, i64)> = sqlx::query_as(&format!(
                "SELECT m.msg_id, m.read_ct, COALESCE((m.headers->>'job_id')::bigint, m.msg_id), m.headers->>'wkey', l.key,
                        (SELECT count(*) FROM lockgate.parked p WHERE p.key = l.key)
                   FROM {} m JOIN lockgate.leases l ON l.queue = $1 AND l.msg_id = m.msg_id
                  WHERE m.headers ? 'wkey' AND m.vt > clock_timestamp()
                    AND (m.headers->>'put_back_until')::timestamptz = m.vt
                  ORDER BY m.msg_id",
                q.table("q")
            ))
            .bind(q.name())
            .fetch_all(&mut self.c.observer)
            .await?;
            for (msg_id, read_ct, job, wkey, key, parked) in rows {
                if self.racing_put_backs.contains(&(q, msg_id, read_ct)) {
                    continue;
                }
                out.push(format!(
                    "(o) job {job} ({}, {msg_id}, {read_ct}), put back to wait for unique key {}, holds a permit of \
                     key {key} ({parked} jobs parked on it)",
                    q.name(),
                    wkey.as_deref().unwrap_or("-")
                ));
            }
        }
        Ok(out)
    }

    /// Before a claim: the database's clock, and the visible `while_executing` messages whose
    /// unique key's holder is parked on their own concurrency key (design §114's cycle).
    async fn put_backs_before(&mut self, queue: Queue) -> Result<(chrono::DateTime<chrono::Utc>, Vec<i64>)> {
        let now: chrono::DateTime<chrono::Utc> =
            sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(&mut self.c.observer).await?;
        let cycle: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT m.msg_id FROM {} m
               JOIN lockgate.unique_locks u ON u.key = m.headers->>'wkey'
               JOIN lockgate.parked p ON p.job_id = u.job_id AND p.key = m.headers->>'ckey'
              WHERE m.vt <= clock_timestamp()",
            queue.table("q")
        ))
        .fetch_all(&mut self.c.observer)
        .await?;
        Ok((now, cycle))
    }

    /// After a claim: counts the `while_executing` jobs it put back, those of a limited type, and
    /// those in §114's cycle (see `put_backs_before`), for the run's summary.
    async fn count_put_backs(
        &mut self,
        queue: Queue,
        (before, cycle): (chrono::DateTime<chrono::Utc>, Vec<i64>),
    ) -> Result<()> {
        let put_back: Vec<(i64, bool)> = sqlx::query_as(&format!(
            "SELECT m.msg_id, m.headers ? 'ckey' FROM {} m
              WHERE m.headers ? 'wkey' AND (m.headers->>'put_back_until')::timestamptz >= $1 + interval '1 second'",
            queue.table("q")
        ))
        .bind(before)
        .fetch_all(&mut self.c.observer)
        .await?;
        for (msg_id, limited) in put_back {
            *self.stats.entry("while_executing job put back").or_default() += 1;
            if limited {
                *self.stats.entry("limited while_executing job put back (its permit given back)").or_default() += 1;
            }
            if cycle.contains(&msg_id) {
                *self
                    .stats
                    .entry("put back while its unique key's holder was parked on its concurrency key (§114)")
                    .or_default() += 1;
            }
        }
        Ok(())
    }

    /// The put-backs a claim racing a sweep left, which (o) leaves out.
    async fn note_racing_put_backs(&mut self, queue: Queue) -> Result<()> {
        let rows: Vec<(i64, i32)> = sqlx::query_as(&format!(
            "SELECT m.msg_id, m.read_ct FROM {} m
              WHERE m.headers ? 'wkey' AND m.vt > clock_timestamp()
                AND (m.headers->>'put_back_until')::timestamptz = m.vt",
            queue.table("q")
        ))
        .fetch_all(&mut self.c.observer)
        .await?;
        self.racing_put_backs.extend(rows.into_iter().map(|(m, r)| (queue, m, r)));
        Ok(())
    }
}

/// The first check label, "(a)" to "(l)", a failure names (empty for other errors).
fn violation_kind(message: &str) -> String {
    message
        .match_indices('(')
        .map(|(i, _)| &message[i..])
        .find(|rest| rest.len() >= 3 && rest.as_bytes()[2] == b')' && rest.as_bytes()[1].is_ascii_lowercase())
        .map(|rest| rest[..3].to_string())
        .unwrap_or_default()
}

fn pick_from<T>(items: &[T], pick: usize) -> Option<&T> {
    if items.is_empty() {
        None
    } else {
        items.get(pick % items.len())
    }
}

fn fenced_note(fenced: &[usize]) -> String {
    if fenced.is_empty() {
        String::new()
    } else {
        format!(" (holder of {} out of budget)", fenced.iter().map(|d| format!("d{d}")).collect::<Vec<_>>().join(", "))
    }
}

async fn set_vt_past(conn: &mut PgConnection, queue: Queue, msg_id: i64) -> Result<()> {
    sqlx::query(&format!("UPDATE {} SET vt = now() - interval '1 second' WHERE msg_id = $1", queue.table("q")))
        .bind(msg_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// The test's database and connections, kept across cases (one database per test; the tables
/// are emptied between cases).
struct Harness {
    db: TestDb,
    conns: Option<Conns>,
    api: Option<Api>,
    /// Steps run, by what they did, over the whole search (what the schedules exercised).
    stats: BTreeMap<&'static str, usize>,
}

impl Harness {
    /// Runs one case from a clean database; with `trace`, records every step and its outcome.
    async fn run(&mut self, case: &Case, checks: &Checks, trace: bool) -> (Result<()>, Vec<String>) {
        if self.conns.is_none() {
            // After a failed case a connection may be mid-transaction or mid-statement: start over.
            let _ = self.db.terminate_backends().await;
            match Conns::open(&self.db.url).await {
                Ok(c) => self.conns = Some(c),
                Err(e) => return (Err(e), Vec::new()),
            }
        }
        let conns = self.conns.as_mut().expect("connections opened above");
        let api = match self.api {
            Some(api) => api,
            None => match Api::detect(&mut conns.observer).await {
                Ok(api) => *self.api.insert(api),
                Err(e) => return (Err(e), Vec::new()),
            },
        };
        let mut run = Run {
            c: conns,
            api,
            model: Model::default(),
            checks: checks.clone(),
            trace: trace.then(Vec::new),
            stats: BTreeMap::new(),
            racing_put_backs: BTreeSet::new(),
        };
        let result = async {
            run.setup(case).await?;
            for (n, op) in case.ops.iter().enumerate() {
                let outcome = run.step(op).await.map_err(|e| anyhow!("step {} ({op}): {e:#}", n + 1));
                match outcome {
                    Ok(said) => {
                        // What actually happened, by kind: an op with no target does nothing.
                        let kind = match op {
                            Op::ClaimRacingSweep { .. } if said.contains("waited for the sweep") => {
                                "claim racing a sweep (waited on its locks)"
                            }
                            Op::Claim { .. } | Op::ClaimRacingSweep { .. } if said.ends_with("nothing") => {
                                "claim (found nothing)"
                            }
                            _ if said.contains("nothing to do") => "(no target, skipped)",
                            _ => op.kind(),
                        };
                        *run.stats.entry(kind).or_default() += 1;
                        run.log(format!("{:>4}. {op}  ->  {said}", n + 1));
                    }
                    Err(e) => {
                        run.log(format!("{:>4}. {op}  ->  FAILED", n + 1));
                        return Err(e);
                    }
                }
                run.check().await.map_err(|e| anyhow!("after step {} ({op}):\n  {e:#}", n + 1))?;
            }
            run.drain().await
        }
        .await;
        let lines = run.trace.take().unwrap_or_default();
        for (kind, n) in std::mem::take(&mut run.stats) {
            *self.stats.entry(kind).or_default() += n;
        }
        if result.is_err() {
            self.conns = None;
        }
        (result, lines)
    }
}

#[test]
fn g3_model_random_schedules_never_admit_more_than_the_limit_lose_nothing_and_fence_stale_tokens() {
    let cases: u32 = env_or("LOCKGATE_MODEL_CASES", 64);
    let max_steps: usize = env_or("LOCKGATE_MODEL_STEPS", 80);
    let checks = Checks(env_or("LOCKGATE_MODEL_CHECKS", "abcdefghijklmnop".to_string()));
    let seed: u64 = match std::env::var("LOCKGATE_MODEL_SEED") {
        Ok(s) => s
            .trim_start_matches("0x")
            .parse::<u64>()
            .or_else(|_| u64::from_str_radix(s.trim_start_matches("0x"), 16))
            .expect("LOCKGATE_MODEL_SEED: a number"),
        Err(_) => RandomState::new().build_hasher().finish(),
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let db = rt.block_on(TestDb::migrated()).expect("a migrated test database");
    let harness = RefCell::new(Harness { db, conns: None, api: None, stats: BTreeMap::new() });

    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config {
        cases,
        // Each shrink step replays a schedule against the database; bound the search.
        max_shrink_iters: env_or("LOCKGATE_MODEL_SHRINK_ITERS", 2000),
        max_shrink_time: 240_000,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes));
    let started = Instant::now();
    let steps = std::cell::Cell::new(0usize);
    let result = runner.run(&ops::case(max_steps), |case| {
        steps.set(steps.get() + case.ops.len());
        let (result, _) = rt.block_on(harness.borrow_mut().run(&case, &checks, false));
        result.map_err(|e| TestCaseError::fail(format!("{e:#}")))
    });
    match result {
        Ok(()) => {
            let api = harness.borrow().api.expect("API detected");
            let stats = harness.borrow().stats.iter().map(|(k, n)| format!("{k}: {n}")).collect::<Vec<_>>().join(", ");
            eprintln!(
                "model: {cases} cases, {} steps, {:.1} s, seed {seed} ({api:?})\nmodel: steps run: {stats}",
                steps.get(),
                started.elapsed().as_secs_f64()
            );
        }
        Err(TestError::Fail(reason, minimal)) => {
            // proptest shrinks the list first and its elements after, so ops that only became
            // removable once others were simplified stay: remove them one at a time while the
            // same kind of violation still shows.
            let kind = violation_kind(reason.message());
            let mut minimal = minimal;
            let mut removed = true;
            while removed {
                removed = false;
                for i in (0..minimal.ops.len()).rev() {
                    let mut smaller = minimal.clone();
                    smaller.ops.remove(i);
                    let (result, _) = rt.block_on(harness.borrow_mut().run(&smaller, &checks, false));
                    if result.is_err_and(|e| violation_kind(&format!("{e:#}")) == kind) {
                        minimal = smaller;
                        removed = true;
                    }
                }
            }
            // Replay the shrunk schedule with a trace, so the report shows what each step did.
            let (replayed, trace) = rt.block_on(harness.borrow_mut().run(&minimal, &checks, true));
            let violation = match &replayed {
                Err(e) => format!("{e:#}"),
                Ok(()) => {
                    format!("none on replay: the failure depends on timing; the search saw:\n  {}", reason.message())
                }
            };
            panic!(
                "model test failed; replay with LOCKGATE_MODEL_SEED={seed} LOCKGATE_MODEL_CASES={cases} LOCKGATE_MODEL_STEPS={max_steps}\n\
                 violation: {violation}\n\n\
                 shrunk schedule ({} steps), as executed:\n{}\n\nas data: {minimal:?}",
                minimal.ops.len(),
                trace.join("\n"),
            );
        }
        Err(TestError::Abort(reason)) => panic!("model test aborted: {reason} (seed {seed})"),
    }
}

/// Runs fixed schedules through the same model and checks, each from a clean database; fails
/// with the first one's trace that breaks a check.
fn replay_known_schedules(schedules: Vec<(&str, Case)>) {
    let checks = Checks(env_or("LOCKGATE_MODEL_CHECKS", "abcdefghijklmnop".to_string()));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let db = rt.block_on(TestDb::migrated()).expect("a migrated test database");
    let mut harness = Harness { db, conns: None, api: None, stats: BTreeMap::new() };
    for (what, case) in schedules {
        let (result, trace) = rt.block_on(harness.run(&case, &checks, true));
        if let Err(e) = result {
            panic!("{what}:\n  {e:#}\n\nschedule, as executed:\n{}", trace.join("\n"));
        }
        if std::env::var_os("LOCKGATE_MODEL_TRACE").is_some() {
            eprintln!("{what}:\n{}", trace.join("\n"));
        }
    }
}

fn schedule(lim_limit: u32, ops: Vec<Op>) -> Case {
    Case { lim_limit, limb_limit: 1, free_limit: None, wexec_limit: None, uniq_limit: None, ops }
}

const LIM0: Op = Op::Enqueue { ty: Ty::Lim, k: 0 };

fn claim(worker: usize) -> Op {
    Op::Claim { worker, queue: Queue::Default, qty: 10 }
}

/// Defect 1 of issue 10, as reported and in its racing form: a claim must not trust a lease
/// that has expired or that an uncommitted sweep is deleting.
#[test]
fn h24_model_a_claim_after_the_lease_expired_never_runs_beside_the_promoted_job() {
    replay_known_schedules(vec![
        (
            "the issue's reproduction: M's lease lapses while it waits; claim M; sweep; claim P",
            schedule(1, vec![LIM0, LIM0, Op::LapseLease { pick: 0 }, claim(0), Op::Sweep, claim(1)]),
        ),
        (
            "a claim racing an uncommitted sweep that expires the silent holder's lease and promotes P",
            schedule(
                1,
                vec![
                    LIM0,
                    LIM0,
                    claim(0),
                    Op::Silence { pick: 0 },
                    Op::ClaimRacingSweep { worker: 1, queue: Queue::Default, qty: 10 },
                    claim(0),
                ],
            ),
        ),
    ]);
}

/// Defect 2: after its message was re-claimed, the old delivery's heartbeat renews nothing.
#[test]
fn h25_model_a_stale_renewal_keeps_no_lease_alive() {
    replay_known_schedules(vec![(
        "the holder falls silent past its visibility, the job is claimed again, the old holder renews",
        schedule(
            1,
            vec![
                LIM0,
                claim(0),
                Op::LapseVisibility { pick: 0 },
                claim(1),
                Op::Stale { pick: 0, action: StaleAction::Extend },
                Op::Stale { pick: 0, action: StaleAction::Complete },
                Op::Stale { pick: 0, action: StaleAction::Release },
            ],
        ),
    )]);
}

/// Defect 3: a process whose registry heartbeat stalls while its job heartbeats are healthy is
/// pruned without its running job being handed to another worker.
#[test]
fn h26_model_a_prune_never_hands_a_healthy_delivery_to_another_worker() {
    replay_known_schedules(vec![(
        "worker 0 runs M; its registry row goes silent; prune; worker 1 claims",
        schedule(1, vec![LIM0, claim(0), Op::Prune { worker: 0 }, claim(1), Op::Extend { mask: 0xff, blocked: false }]),
    )]);
}

/// Defect 10: a lowered limit lets the jobs admitted before it finish, and admits no other job
/// past it; a limit added to a type applies to its jobs already queued.
#[test]
fn h33_model_a_redefined_limit_admits_no_job_past_it() {
    replay_known_schedules(vec![
        (
            "two jobs hold permits under limit 3 without running; the limit drops to 1; they start one at a time \
             (review helper-79, design §80)",
            Case {
                lim_limit: 1,
                limb_limit: 3,
                free_limit: None,
                wexec_limit: None,
                uniq_limit: None,
                ops: vec![Op::EnqueueMany { ty: Ty::LimB, ks: vec![1, 1] }, Op::Redefine { ty: Ty::LimB, limit: 1 }],
            },
        ),
        (
            "three jobs hold permits under limit 3, two run; the limit drops to 1; the third (admitted before, not \
             started) and the fourth wait until the key is below the new limit",
            Case {
                lim_limit: 2,
                limb_limit: 3,
                free_limit: None,
                wexec_limit: None,
                uniq_limit: None,
                ops: vec![
                    Op::EnqueueMany { ty: Ty::LimB, ks: vec![0, 0, 0, 0] },
                    Op::Claim { worker: 0, queue: Queue::Other, qty: 2 },
                    Op::Redefine { ty: Ty::LimB, limit: 1 },
                    Op::Finish { pick: 0, how: Finish::Complete },
                    Op::Sweep,
                    Op::Claim { worker: 1, queue: Queue::Other, qty: 10 },
                    Op::Finish { pick: 0, how: Finish::Complete },
                    Op::Sweep,
                    Op::Claim { worker: 1, queue: Queue::Other, qty: 10 },
                ],
            },
        ),
        (
            "two jobs of an unlimited type wait; the type gains limit 1; a claim runs one of them, with a permit",
            schedule(
                1,
                vec![
                    Op::Enqueue { ty: Ty::Free, k: 0 },
                    Op::Enqueue { ty: Ty::Free, k: 0 },
                    Op::Redefine { ty: Ty::Free, limit: 1 },
                    claim(0),
                    claim(1),
                    Op::Finish { pick: 0, how: Finish::Complete },
                    Op::Sweep,
                    claim(1),
                ],
            ),
        ),
    ]);
}

/// Issue 11 (H14, H22): a finished unique job's stale and duplicate deliveries never drop its
/// successor's lock, and never count in the batch again.
#[test]
fn h14_model_a_stale_delivery_never_releases_a_successors_unique_lock_or_counts_twice() {
    const UNIQ0: Op = Op::Enqueue { ty: Ty::Uniq, k: 0 };
    replay_known_schedules(vec![(
        "job A runs, its visibility passes, it is claimed again and completed; B takes the key; A's stale \
         delivery completes, dead-letters, retries and releases; a third enqueue is B's duplicate",
        schedule(
            1,
            vec![
                UNIQ0,
                claim(0),
                Op::LapseVisibility { pick: 0 },
                claim(1),
                Op::Finish { pick: 0, how: Finish::Complete },
                UNIQ0,
                Op::Stale { pick: 0, action: StaleAction::Complete },
                Op::Stale { pick: 0, action: StaleAction::DeadLetter },
                Op::Stale { pick: 1, action: StaleAction::Complete },
                Op::Stale { pick: 0, action: StaleAction::Retry },
                Op::Stale { pick: 0, action: StaleAction::Release },
                UNIQ0,
            ],
        ),
    )]);
}

/// Issue 11 (G2, H22, H31): a batch finishes exactly when it is closed and every job enqueued
/// into it has a fate, its callback enqueued once; a close never waits for an enqueue into the
/// batch, and when that enqueue adds nothing after all, the batch sweep finishes the batch.
#[test]
fn h22_model_a_closed_batch_finishes_once_when_its_last_job_is_counted() {
    const FREE0: Op = Op::Enqueue { ty: Ty::Free, k: 0 };
    replay_known_schedules(vec![
        (
            "two jobs; the batch is closed; one completes, one is dead-lettered: the second finishes it;              a later job goes outside the batch; closing again is refused",
            schedule(
                1,
                vec![
                    FREE0,
                    FREE0,
                    Op::Close { during: None },
                    claim(0),
                    Op::Finish { pick: 0, how: Finish::Complete },
                    claim(1),
                    Op::Finish { pick: 0, how: Finish::DeadLetter },
                    FREE0,
                    Op::Close { during: None },
                ],
            ),
        ),
        (
            "a job is dead-lettered, then the batch is closed: the close finishes it",
            schedule(
                1,
                vec![FREE0, claim(0), Op::Finish { pick: 0, how: Finish::DeadLetter }, Op::Close { during: None }],
            ),
        ),
        (
            "a job completes; the batch is closed while an enqueue into it is open, which rolls back: only              the batch sweep can finish it",
            schedule(
                1,
                vec![
                    FREE0,
                    claim(0),
                    Op::Finish { pick: 0, how: Finish::Complete },
                    Op::Close { during: Some((Ty::Lim, 0, false)) },
                    Op::Sweep,
                ],
            ),
        ),
        (
            "the batch is closed while an enqueue into it is open, which commits: its job counts, and its              completion finishes the batch",
            schedule(
                1,
                vec![
                    Op::Close { during: Some((Ty::Uniq, 1, true)) },
                    Op::Sweep,
                    claim(0),
                    Op::Finish { pick: 0, how: Finish::Complete },
                ],
            ),
        ),
    ]);
}

/// Issue 12 (G3): a cancel does not stop a running handler; its worker learns of it at its next
/// heartbeat, or when its finish is refused, or never (its budget runs out). Until then the
/// cancelled job keeps its permit, and the next job of its key must wait.
#[test]
fn g3_model_a_cancelled_running_job_keeps_its_permit_until_its_handler_stopped() {
    const CANCEL_A: Op = Op::Cancel { pick: 0 };
    replay_known_schedules(vec![
        (
            "A runs under limit 1 and is cancelled; B of its key parks, and a sweep and a claim run nothing; A's \
             heartbeat reports it cancelled, its worker gives back the permit; B runs",
            schedule(
                1,
                vec![
                    LIM0,
                    claim(0),
                    CANCEL_A,
                    LIM0,
                    Op::Sweep,
                    claim(1),
                    Op::Extend { mask: 1, blocked: false },
                    Op::Sweep,
                    claim(1),
                ],
            ),
        ),
        (
            "A runs under limit 1 and is cancelled; B parks; A's heartbeat tells it, and its handler blocks on: \
             its heartbeats renew the kept permit through sweeps and claims, which run nothing; then it ends and \
             its worker gives the permit back; B runs (design §95)",
            schedule(
                1,
                vec![
                    LIM0,
                    claim(0),
                    CANCEL_A,
                    LIM0,
                    Op::Extend { mask: 1, blocked: true },
                    Op::Sweep,
                    claim(1),
                    Op::Extend { mask: 1, blocked: true },
                    Op::Sweep,
                    claim(1),
                    Op::Extend { mask: 1, blocked: false },
                    Op::Sweep,
                    claim(1),
                ],
            ),
        ),
        (
            "A runs and is cancelled; B parks; A's handler returns before any heartbeat: its completion is refused, \
             its worker gives back the permit; B runs",
            schedule(
                1,
                vec![
                    LIM0,
                    claim(0),
                    CANCEL_A,
                    LIM0,
                    Op::Finish { pick: 0, how: Finish::Complete },
                    Op::Sweep,
                    claim(1),
                ],
            ),
        ),
        (
            "A runs and is cancelled; B parks; A's worker dies: once A's budget has run out the sweep frees the \
             permit and B runs; A's late completion changes nothing",
            schedule(
                1,
                vec![
                    LIM0,
                    claim(0),
                    CANCEL_A,
                    LIM0,
                    Op::LapseVisibility { pick: 0 },
                    Op::Sweep,
                    claim(1),
                    Op::LapseLease { pick: 0 },
                    Op::Sweep,
                    claim(1),
                    Op::Thaw { pick: 0, how: Finish::Complete },
                ],
            ),
        ),
    ]);
}

/// G3/H14 under a cancel: a while_executing job cancelled while it runs keeps its key until its
/// handler has stopped (its worker calls release_cancelled) or its budget has passed (the lock's
/// held_until); the next job of the key is put back meanwhile, and never runs beside it.
#[test]
fn g3_model_a_cancelled_while_executing_job_keeps_its_key_until_its_handler_stopped() {
    const W0: Op = Op::Enqueue { ty: Ty::Wexec, k: 0 };
    const CANCEL_A: Op = Op::Cancel { pick: 0 };
    replay_known_schedules(vec![
        (
            "A and B of one key: a claim runs A and puts B back; A is cancelled; B's second passes, a claim puts \
             it back again; A's heartbeat reports the cancel and its worker gives the key back; B runs",
            schedule(
                1,
                vec![
                    W0,
                    W0,
                    claim(0),
                    CANCEL_A,
                    Op::LapseVisibility { pick: 0 },
                    claim(1),
                    Op::Extend { mask: 1, blocked: false },
                    Op::LapseVisibility { pick: 0 },
                    claim(1),
                ],
            ),
        ),
        (
            "A runs and is cancelled; B is put back; A's handler returns before any heartbeat: its completion is \
             refused and its worker gives the key back; B runs",
            schedule(
                1,
                vec![
                    W0,
                    claim(0),
                    CANCEL_A,
                    W0,
                    claim(1),
                    Op::Finish { pick: 0, how: Finish::Complete },
                    Op::LapseVisibility { pick: 0 },
                    claim(1),
                ],
            ),
        ),
        (
            "A runs and is cancelled; B is put back; A's worker dies: once A's budget has passed a claim takes the \
             key over and B runs; A's late completion is refused and releases nothing of B's",
            schedule(
                1,
                vec![
                    W0,
                    claim(0),
                    CANCEL_A,
                    W0,
                    claim(1),
                    Op::Silence { pick: 0 },
                    Op::LapseVisibility { pick: 0 },
                    claim(1),
                    Op::Thaw { pick: 0, how: Finish::Complete },
                ],
            ),
        ),
    ]);
}

/// G3/H14 after a crash (design §103): a while_executing job whose worker went silent holds its
/// key only until its visibility has passed; then the next job of the key takes it over and runs,
/// the silent holder's late renewal finds its delivery lost, and its late completion releases
/// nothing of the new holder's. (The model checks that the takeover keeps one run per key and the
/// lock rows exact; tests/uniqueness.rs checks that it happens.)
#[test]
fn g3_model_a_while_executing_key_whose_holder_went_silent_goes_to_the_next_job() {
    const W0: Op = Op::Enqueue { ty: Ty::Wexec, k: 0 };
    replay_known_schedules(vec![(
        "A runs and B is put back; A's worker goes silent past its visibility; a claim gives B the key and B runs; \
         A's worker wakes and completes A, releasing nothing of B's; B completes",
        schedule(
            1,
            vec![
                W0,
                W0,
                claim(0),
                Op::Silence { pick: 0 },
                Op::LapseVisibility { pick: 0 },
                claim(1),
                Op::Thaw { pick: 0, how: Finish::Complete },
                Op::Finish { pick: 0, how: Finish::Complete },
            ],
        ),
    )]);
}

/// §78: a finish at REPEATABLE READ whose snapshot is older than a job parked behind its
/// delivery never gives the permit back past that job; found by the random search in three
/// steps once it could take such a snapshot (with the isolation check removed, the key was left
/// with its permit free and the job parked).
#[test]
fn h06_model_a_finish_on_an_older_snapshot_never_gives_its_permit_past_a_job_parked_since() {
    let limb = |how| Case {
        lim_limit: 1,
        limb_limit: 1,
        free_limit: None,
        wexec_limit: None,
        uniq_limit: None,
        ops: vec![
            Op::Enqueue { ty: Ty::LimB, k: 0 },
            Op::Claim { worker: 0, queue: Queue::Other, qty: 1 },
            Op::FinishOnOldSnapshot { pick: 0, how },
        ],
    };
    replay_known_schedules(vec![
        ("a dead letter on a snapshot older than the park", limb(Finish::DeadLetter)),
        ("a completion on a snapshot older than the park", limb(Finish::Complete)),
    ]);
}

/// The `k` argument a delivery's key was derived from (`type:[k]`, or `SHARED_K` for the
/// explicit key `SHARED_CKEY`; 0 when it cannot be read).
fn key_argument(d: &Delivery) -> u8 {
    if d.key.as_deref() == Some(SHARED_CKEY) {
        return ops::SHARED_K;
    }
    d.key.as_deref().and_then(|key| key.rsplit_once(":[")?.1.strip_suffix(']')?.parse().ok()).unwrap_or(0)
}

/// The snapshot a finish decides in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Snapshot {
    /// Its own statement's, at READ COMMITTED.
    Own,
    /// A REPEATABLE READ transaction's, begun just before it.
    Repeatable,
    /// The REPEATABLE READ transaction already open on the holder's connection, with its snapshot
    /// taken before other steps committed.
    Open,
}

/// Design §105: jobs of both uniqueness modes name one key (`shared`). A `while_executing` run
/// holding it makes an `until_executed` enqueue of it a duplicate, even once the run has lapsed
/// (only a claim judges a lapse: a producer's open transaction holding the lapsed run's lock row
/// would hold its completion back, review helper-120 F1); the lapsed job delivered again takes
/// its key back. And a `while_executing` job is not delivered while a live `until_executed` job
/// holds the key, visible or running, lapsed or not.
#[test]
fn g3_model_an_explicit_key_shared_by_both_unique_modes_is_held_by_one_job_at_a_time() {
    const W: Op = Op::Enqueue { ty: Ty::Wexec, k: ops::SHARED_K };
    const U: Op = Op::Enqueue { ty: Ty::Uniq, k: ops::SHARED_K };
    replay_known_schedules(vec![
        (
            "W runs holding the key and lapses; U is a duplicate of it; W is delivered again and takes its key back; \
             W completes; U takes the key",
            schedule(
                1,
                vec![
                    W,
                    claim(0),
                    Op::LapseVisibility { pick: 0 },
                    U,
                    claim(1),
                    Op::Finish { pick: 0, how: Finish::Complete },
                    U,
                ],
            ),
        ),
        (
            "W runs holding the key; U is a duplicate of it; W completes; U takes the key",
            schedule(1, vec![W, claim(0), U, Op::Finish { pick: 0, how: Finish::Complete }, U]),
        ),
        (
            "U holds the key and runs, and lapses; W is put back, never delivered beside it",
            schedule(1, vec![U, W, claim(0), Op::LapseVisibility { pick: 0 }, claim(1)]),
        ),
    ]);
}

/// Design §109: `lim` and `limb` jobs, of different limits and queues, name one concurrency key
/// (`cshared`), and each is admitted under the strictest limit among the key's holders, by every
/// path: an enqueue, a promotion at a completion (with holders of the other type left, and in
/// the same transaction as another promotion whose lease is not written yet), a claim taking a
/// permit again after the sweep gave the key to a parked job. (Worker 1 finishes at REPEATABLE
/// READ, leaving its permits to a later give-back: the completions that must promote at once are
/// worker 0's.)
#[test]
fn g3_model_an_explicit_concurrency_key_shared_by_two_limits_admits_no_job_past_the_strictest_holder() {
    const L: Op = Op::Enqueue { ty: Ty::Lim, k: ops::SHARED_K };
    const B: Op = Op::Enqueue { ty: Ty::LimB, k: ops::SHARED_K };
    let other = |worker| Op::Claim { worker, queue: Queue::Other, qty: 10 };
    let limits = |lim_limit, limb_limit, ops| Case {
        lim_limit,
        limb_limit,
        free_limit: None,
        wexec_limit: None,
        uniq_limit: None,
        ops,
    };
    replay_known_schedules(vec![
        (
            "lim (limit 1) holds the key; limb (limit 3) waits for it, not beside it",
            limits(1, 3, vec![L, B, claim(0), other(1), Op::Finish { pick: 0, how: Finish::Complete }, other(1)]),
        ),
        (
            "lim (limit 2) and limb (limit 3) hold the key; two limb jobs parked; the limb holder completes: one \
             limb job is promoted beside the lim holder, not two",
            limits(2, 3, vec![B, L, B, B, claim(1), other(0), Op::Finish { pick: 1, how: Finish::Complete }, other(0)]),
        ),
        (
            "limb (limit 1) holds the key, limb and lim parked; it completes: the limb job promoted binds the lim \
             job looked at next in the same transaction, before its lease exists",
            limits(
                2,
                1,
                vec![B, B, L, claim(0), other(0), Op::Finish { pick: 0, how: Finish::Complete }, claim(0), other(0)],
            ),
        ),
        (
            "limb (limit 3) holds the key, lim (limit 1) parked; limb's holder goes silent, and the sweep expires its \
             lease and promotes lim; limb's message, claimed again, parks behind it",
            limits(1, 3, vec![B, L, other(0), Op::Silence { pick: 0 }, Op::Sweep, claim(0), other(0)]),
        ),
    ]);
}

/// Design §109 with three types on one key: `free` jobs, while their type is limited, name
/// `cshared` too, beside `lim` and `limb` jobs, and each is admitted under the strictest current
/// limit among the key's holders. A type that loses its limit binds nothing: its parked jobs are
/// promoted and run without a permit, beside any holder; its running holders keep their permits
/// until they finish, and those permits count against the other types' limits (G3).
#[test]
fn g3_model_an_explicit_concurrency_key_shared_by_three_types_admits_no_job_past_the_strictest_holder() {
    const L: Op = Op::Enqueue { ty: Ty::Lim, k: ops::SHARED_K };
    const B: Op = Op::Enqueue { ty: Ty::LimB, k: ops::SHARED_K };
    const F: Op = Op::Enqueue { ty: Ty::Free, k: ops::SHARED_K };
    let other = |worker| Op::Claim { worker, queue: Queue::Other, qty: 10 };
    let finish = |pick| Op::Finish { pick, how: Finish::Complete };
    let limits = |lim_limit, limb_limit, free_limit, ops| Case {
        lim_limit,
        limb_limit,
        free_limit: Some(free_limit),
        wexec_limit: None,
        uniq_limit: None,
        ops,
    };
    replay_known_schedules(vec![
        (
            "free (limit 1) holds the key; lim (limit 2) and limb (limit 3) wait for it, not beside it; free's \
             holder completes and both are promoted, the lim job binding limb's",
            limits(2, 3, 1, vec![F, L, claim(0), B, other(1), finish(0), claim(0), other(1)]),
        ),
        (
            "limb (limit 1) holds the key; free (limit 3) waits for it, not beside it; free loses its limit: its job \
             is promoted and runs without a permit beside limb's holder, and binds nothing; lim (limit 2) still \
             waits for limb's holder, and runs beside free's job once it completes",
            limits(
                2,
                1,
                3,
                vec![
                    B,
                    F,
                    other(0),
                    claim(0),
                    Op::Redefine { ty: Ty::Free, limit: 0 },
                    Op::Sweep,
                    claim(0),
                    L,
                    claim(0),
                    finish(0),
                    claim(0),
                ],
            ),
        ),
        (
            "free (limit 2) and limb (limit 2) hold the key; free loses its limit, its holder keeps its permit, which \
             counts: lim (limit 1) waits until both holders completed",
            limits(
                1,
                2,
                2,
                vec![
                    F,
                    claim(0),
                    B,
                    other(1),
                    Op::Redefine { ty: Ty::Free, limit: 0 },
                    Op::Sweep,
                    L,
                    claim(0),
                    finish(0),
                    claim(0),
                    finish(0),
                    claim(0),
                ],
            ),
        ),
    ]);
}

/// Design §114: a limited `wexec` job waiting for its unique key gives back its concurrency
/// permit when a claim puts it back. Both types name the unique key `shared` and, limited, the
/// concurrency key `cshared`: the `wexec` job holds the key's one permit (taken at its enqueue),
/// the `uniq` job takes the unique key at its enqueue and parks behind that permit, and the
/// `wexec` job's claim meets the unique key held. With the permit kept (`_yield_permit` not
/// called), each waited for the other until the `wexec` job's lease lapsed: (o) at the put-back,
/// and (p) in the drain (nothing moved until a lease ran out).
#[test]
fn h06_model_a_job_put_back_for_a_unique_key_gives_its_permit_to_the_job_parked_behind_it() {
    const W: Op = Op::Enqueue { ty: Ty::Wexec, k: ops::SHARED_K };
    const U: Op = Op::Enqueue { ty: Ty::Uniq, k: ops::SHARED_K };
    const L: Op = Op::Enqueue { ty: Ty::Lim, k: ops::SHARED_K };
    let finish = |pick| Op::Finish { pick, how: Finish::Complete };
    let limits = |wexec_limit, uniq_limit, ops| Case {
        lim_limit: 1,
        limb_limit: 1,
        free_limit: None,
        wexec_limit: Some(wexec_limit),
        uniq_limit,
        ops,
    };
    replay_known_schedules(vec![
        (
            "W (limit 1) holds the permit of cshared, waiting; U (limit 1) takes the unique key and parks on \
             cshared; W's claim meets the unique key held: W is put back and gives its permit to U, which runs; W, \
             claimed again, parks behind U, and runs once U completes",
            limits(
                1,
                Some(1),
                vec![W, U, claim(0), claim(0), Op::LapseVisibility { pick: 0 }, claim(0), finish(0), claim(0)],
            ),
        ),
        (
            "as above, but W's lease lapsed while it waited: its claim takes a permit again, and the put-back \
             gives it back to U",
            limits(1, Some(1), vec![W, U, Op::LapseLease { pick: 0 }, claim(0), claim(0), finish(0), claim(0)]),
        ),
        (
            "W (limit 1) holds the permit of cshared, waiting; lim parks behind it; U (unlimited) takes the unique \
             key and runs: W is put back and its permit goes to the lim job, which runs beside U",
            limits(
                1,
                None,
                vec![W, L, U, claim(0), claim(1), finish(0), finish(0), Op::LapseVisibility { pick: 0 }, claim(0)],
            ),
        ),
    ]);
}
