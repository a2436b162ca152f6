//! Types that share a concurrency key (design §109; review helper-119 F1): an explicit
//! `concurrency_key` several types name is one key, and each job is admitted under the strictest
//! limit among the key's holders as well as its own type's, by every path that takes a permit:
//! an enqueue, a promotion at a completion, a promotion by the sweep, a claim that takes a
//! permit again. Each test drives the public SQL API as psql would and checks, after every step,
//! that no key has more deliveries entitled to run than the least limit of their types.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{complete_default, lapse_visibility, violations};
use lockgate_testkit::TestDb;
use sqlx::{Connection, PgPool};

/// A delivery as `lockgate.claim` returns it: (msg_id, read_ct).
type Delivery = (i64, i32);

/// A database with one type per `(name, limit)`, none with key paths: their jobs share a key
/// only by naming it.
async fn types(limits: &[(&str, i32)]) -> TestDb {
    let db = TestDb::migrated().await.unwrap();
    for (name, limit) in limits {
        sqlx::query("SELECT lockgate.define_job_type($1, concurrency_limit => $2)")
            .bind(name)
            .bind(limit)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    db
}

/// Enqueues a job of `ty` naming `key` explicitly; its status.
async fn enqueue(db: &PgPool, ty: &str, key: &str) -> String {
    sqlx::query_scalar("SELECT status FROM lockgate.enqueue($1, '{}', jsonb_build_object('concurrency_key', $2::text))")
        .bind(ty)
        .bind(key)
        .fetch_one(db)
        .await
        .unwrap()
}

/// Runs one statement whose result the test does not need.
async fn run(db: &PgPool, statement: &str) {
    sqlx::query(statement).execute(db).await.unwrap();
}

/// Claims one delivery of queue `default`, the oldest visible.
async fn claim_one(db: &PgPool) -> Vec<Delivery> {
    sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 1, 30)").fetch_all(db).await.unwrap()
}

/// How many permits jobs of type `ty` hold.
async fn leases_of(db: &PgPool, ty: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM lockgate.leases WHERE job_type = $1").bind(ty).fetch_one(db).await.unwrap()
}

async fn claim(db: &PgPool) -> Vec<Delivery> {
    sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('default', 10, 30)").fetch_all(db).await.unwrap()
}

/// Per key, the deliveries the database lets run now (claimed, not waiting, still invisible,
/// holding a lease that outlasts their visibility) and their types, as (key, count, the least
/// limit of their types, the types): a row only where the count passes that limit.
async fn over_limit(db: &PgPool) -> Vec<(String, i64, i32, String)> {
    sqlx::query_as(
        "SELECT l.key, count(*), min(t.concurrency_limit), string_agg(t.name, ',' ORDER BY t.name)
           FROM pgmq.q_default m
           JOIN lockgate.leases l ON l.queue = 'default' AND l.msg_id = m.msg_id
           JOIN lockgate.job_types t ON t.name = m.headers->>'type'
          WHERE m.read_ct > 0 AND m.vt > now() AND NOT m.headers ? 'retry_at' AND l.expires_at >= m.vt
          GROUP BY l.key HAVING count(*) > min(t.concurrency_limit)",
    )
    .fetch_all(db)
    .await
    .unwrap()
}

/// The types of the jobs parked behind `key`, in the order promotion takes them.
async fn parked(db: &PgPool, key: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT job_type FROM lockgate.parked WHERE key = $1 ORDER BY priority, id")
        .bind(key)
        .fetch_all(db)
        .await
        .unwrap()
}

/// The types of the deliveries claimed in `ds`.
async fn types_of(db: &PgPool, ds: &[Delivery]) -> Vec<String> {
    let ids: Vec<i64> = ds.iter().map(|d| d.0).collect();
    sqlx::query_scalar("SELECT headers->>'type' FROM pgmq.q_default WHERE msg_id = ANY ($1) ORDER BY 1")
        .bind(ids)
        .fetch_all(db)
        .await
        .unwrap()
}

async fn sound(db: &PgPool, when: &str) {
    assert_eq!(over_limit(db).await, vec![], "{when}: a key runs more jobs than one of its holders' limits");
    assert_eq!(violations(db).await, Vec::<String>::new(), "{when}: check_invariants()");
}

#[tokio::test]
async fn g3_an_enqueue_takes_no_permit_past_the_strictest_limit_among_the_keys_holders() {
    let db = types(&[("strict", 1), ("loose", 3)]).await;
    // A loose job holds the key: a strict one waits, though the key has 1 of loose's 3 taken.
    assert_eq!(enqueue(&db.pool, "loose", "acct").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "strict", "acct").await, "parked", "strict admitted beside a loose holder");
    // A strict job holds the key: a loose one waits, though the key has 1 of loose's 3 taken.
    assert_eq!(enqueue(&db.pool, "strict", "solo").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "loose", "solo").await, "parked", "loose admitted beside a strict holder");
    // Jobs of one type are admitted under their own limit, as before.
    assert_eq!(enqueue(&db.pool, "loose", "acct").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "loose", "acct").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "loose", "acct").await, "parked");
    let ds = claim(&db.pool).await;
    assert_eq!(types_of(&db.pool, &ds).await, ["loose", "loose", "loose", "strict"]);
    sound(&db.pool, "after the claim").await;
}

#[tokio::test]
async fn g3_a_completion_promotes_no_job_past_the_limit_of_the_holders_that_remain() {
    // pair (limit 2) and trio (limit 3) on one key: a trio holder, a pair holder beside it (2 is
    // within both), and two trio jobs parked.
    let db = types(&[("pair", 2), ("trio", 3)]).await;
    assert_eq!(enqueue(&db.pool, "trio", "k").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "pair", "k").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "trio", "k").await, "parked", "a third beside a pair holder");
    assert_eq!(enqueue(&db.pool, "trio", "k").await, "parked");
    let ds = claim(&db.pool).await;
    assert_eq!(types_of(&db.pool, &ds).await, ["pair", "trio"]);
    sound(&db.pool, "both running").await;

    // The trio holder (enqueued first) finishes: the pair holder remains, so one trio job is
    // promoted (2 of pair's 2), not two (3 of trio's 3).
    let (trio, pair) = (ds[0].0.min(ds[1].0), ds[0].0.max(ds[1].0));
    assert!(complete_default(&db.pool, (trio, 1)).await);
    assert_eq!(parked(&db.pool, "k").await, ["trio"], "one trio job promoted, one still parked");
    let next = claim(&db.pool).await;
    assert_eq!(types_of(&db.pool, &next).await, ["trio"]);
    sound(&db.pool, "a trio job promoted beside the pair holder").await;

    // The pair holder finishes: only trio jobs hold the key, so the last one goes through.
    assert!(complete_default(&db.pool, (pair, 1)).await);
    assert_eq!(parked(&db.pool, "k").await, Vec::<String>::new());
    assert_eq!(types_of(&db.pool, &claim(&db.pool).await).await, ["trio"]);
    sound(&db.pool, "trio jobs alone").await;
}

#[tokio::test]
async fn g3_a_strict_job_parked_behind_looser_holders_starts_only_on_an_empty_key_and_alone() {
    let db = types(&[("strict", 1), ("loose", 3)]).await;
    for _ in 0..2 {
        assert_eq!(enqueue(&db.pool, "loose", "k").await, "enqueued");
    }
    assert_eq!(enqueue(&db.pool, "strict", "k").await, "parked");
    assert_eq!(enqueue(&db.pool, "loose", "k").await, "enqueued", "loose's own enqueues take its free permit");
    assert_eq!(enqueue(&db.pool, "loose", "k").await, "parked");
    let ds = claim(&db.pool).await;
    assert_eq!(ds.len(), 3);
    for (i, d) in ds.iter().enumerate() {
        assert!(complete_default(&db.pool, *d).await);
        sound(&db.pool, &format!("after completion {i}")).await;
        if i < 2 {
            assert_eq!(parked(&db.pool, "k").await, ["strict", "loose"], "strict waits for an empty key");
        }
    }
    // The key emptied: the strict job is promoted, alone; the loose job behind it waits for it.
    assert_eq!(parked(&db.pool, "k").await, ["loose"]);
    let strict = claim(&db.pool).await;
    assert_eq!(types_of(&db.pool, &strict).await, ["strict"]);
    sound(&db.pool, "strict running").await;
    assert!(complete_default(&db.pool, strict[0]).await);
    assert_eq!(types_of(&db.pool, &claim(&db.pool).await).await, ["loose"]);
    sound(&db.pool, "the last loose job running").await;
}

#[tokio::test]
async fn g3_a_job_promoted_in_the_same_transaction_binds_the_next_admission_before_its_lease_is_written() {
    // Three trio holders (limit 3); a pair job (limit 2) and a quad job (limit 4) parked behind.
    let db = types(&[("pair", 2), ("trio", 3), ("quad", 4)]).await;
    for _ in 0..3 {
        assert_eq!(enqueue(&db.pool, "trio", "k").await, "enqueued");
    }
    assert_eq!(enqueue(&db.pool, "pair", "k").await, "parked");
    assert_eq!(enqueue(&db.pool, "quad", "k").await, "parked", "a fourth beside trio holders");
    let trios = claim(&db.pool).await;
    assert_eq!(trios.len(), 3);
    assert!(complete_default(&db.pool, trios[0]).await);
    assert_eq!(parked(&db.pool, "k").await, ["pair", "quad"], "pair's 2 are taken");
    // The second completion promotes the pair job beside the last trio holder; the quad job is
    // then looked at in the same transaction, before the pair job's lease exists: the key's
    // leases show only the trio holder (limit 3), but the pair job's limit binds it.
    assert!(complete_default(&db.pool, trios[1]).await);
    assert_eq!(parked(&db.pool, "k").await, ["quad"], "quad promoted beside a pair job");
    assert_eq!(types_of(&db.pool, &claim(&db.pool).await).await, ["pair"]);
    sound(&db.pool, "the pair job and a trio job running").await;
}

#[tokio::test]
async fn g3_the_sweep_and_a_claim_taking_a_permit_again_admit_no_job_past_the_strictest_holder() {
    let db = types(&[("strict", 1), ("loose", 3)]).await;
    assert_eq!(enqueue(&db.pool, "loose", "k").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "strict", "k").await, "parked");
    let first = claim(&db.pool).await;
    assert_eq!(first.len(), 1);
    // Its holder goes silent past both budgets: the sweep gives its permit to the strict job.
    run(&db.pool, "UPDATE lockgate.leases SET expires_at = now() - interval '1 second'").await;
    lapse_visibility(&db.pool).await;
    let (expired, promoted): (i32, i32) =
        sqlx::query_as("SELECT expired, promoted FROM lockgate.sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!((expired, promoted), (1, 1));
    // The loose job's message, visible again, and the strict job's are claimed together: the
    // strict job took the key's only permit it allows, so the loose job is parked again.
    let ds = claim(&db.pool).await;
    assert_eq!(types_of(&db.pool, &ds).await, ["strict"], "the lapsed loose job ran beside the strict one");
    assert_eq!(parked(&db.pool, "k").await, ["loose"]);
    sound(&db.pool, "after the claims").await;
}

/// Review helper-124 F3: the sweep's repair judged a key's room by its parked job's own limit,
/// so keys whose looser job waits behind a stricter type's holder were picked at every pass
/// (oldest first, `max_keys` of them, keeping `full_scan` on), and a key with real room that only
/// the repair promotes (here: its type's limit raised) was never looked at while they ran.
#[tokio::test]
async fn the_sweeps_repair_passes_over_keys_held_by_a_stricter_type_to_one_with_room() {
    let db = types(&[("a", 1), ("b", 2), ("c", 3)]).await;
    for i in 1..=5 {
        let key = format!("k{i}");
        assert_eq!(enqueue(&db.pool, "a", &key).await, "enqueued");
        assert_eq!(enqueue(&db.pool, "c", &key).await, "parked", "c waits behind a's holder");
    }
    for status in ["enqueued", "enqueued", "parked"] {
        assert_eq!(enqueue(&db.pool, "b", "z").await, status);
    }
    run(&db.pool, "SELECT lockgate.define_job_type('b', concurrency_limit => 3)").await;
    // max_keys 2 stands for the default 1,000: more keys than that wait behind stricter holders.
    let promoted: i32 = sqlx::query_scalar("SELECT promoted FROM lockgate.sweep(2)").fetch_one(&db.pool).await.unwrap();
    assert_eq!(promoted, 1, "z's job, under b's raised limit");
    assert_eq!(parked(&db.pool, "z").await, Vec::<String>::new());
    let full_scan: bool =
        sqlx::query_scalar("SELECT full_scan FROM lockgate.sweep_state").fetch_one(&db.pool).await.unwrap();
    assert!(!full_scan, "no key left with room: the next passes go by the cursor");
    // The cursor's pass judges them the same way: nothing to promote while a's holders run.
    let promoted: i32 = sqlx::query_scalar("SELECT promoted FROM lockgate.sweep(2)").fetch_one(&db.pool).await.unwrap();
    assert_eq!(promoted, 0);
    let roomy: Vec<String> =
        sqlx::query_scalar("SELECT detail FROM lockgate._doctor_parked()").fetch_all(&db.pool).await.unwrap();
    assert_eq!(roomy, ["no key has parked jobs and a free permit"]);
    sound(&db.pool, "after the sweeps").await;
}

/// A lowered limit binds the other types' jobs that hold permits of its keys without running
/// too: they took them under the old limit, and are re-admitted at their claim as the lowered
/// type's own are (design §80, §109; found by the model: a job of another type that held a
/// permit started beside a holder over that holder's lowered limit).
#[tokio::test]
async fn g3_a_lowered_limit_re_admits_the_waiting_holders_of_every_type_on_its_keys() {
    let db = types(&[("x", 2), ("y", 2)]).await;
    assert_eq!(enqueue(&db.pool, "y", "k").await, "enqueued");
    let y1 = claim_one(&db.pool).await;
    assert_eq!(types_of(&db.pool, &y1).await, ["y"], "y1 runs");
    assert_eq!(enqueue(&db.pool, "x", "k").await, "enqueued", "x1 holds a permit, not started");
    run(&db.pool, "SELECT lockgate.define_job_type('y', concurrency_limit => 1)").await;
    // y1 runs on under the limit it started with; x1 must not start beside it.
    assert!(claim(&db.pool).await.is_empty(), "x1 started beside y1, over y's new limit of 1");
    assert_eq!(parked(&db.pool, "k").await, ["x"]);
    sound(&db.pool, "x1 parked again").await;
    assert!(complete_default(&db.pool, y1[0]).await);
    assert_eq!(types_of(&db.pool, &claim(&db.pool).await).await, ["x"]);
    sound(&db.pool, "x1 alone").await;
}

/// Review helper-127 F1 and helper-128 F1: when a definition lowering a limit looked for the other
/// types' holders it binds (to re-admit them at their claim), it missed a producer's enqueue of
/// the key not yet committed, and a claim of its own type's job taking a permit of the key again,
/// not yet committed: their jobs started over the new limit. The claim now checks, in its own
/// snapshot, that a key held by several types is within the least of its holders' current
/// limits before a job of it starts, so any interleaving with the definition is safe.
#[tokio::test]
async fn g3_a_lowered_limit_binds_holders_whose_enqueue_or_claim_was_open_while_it_was_lowered() {
    let db = types(&[("b", 3)]).await;
    run(&db.pool, "SELECT lockgate.define_job_type('a', queue => 'qa', concurrency_limit => 3)").await;
    // An enqueue open across the lowering: a's job runs; b's is enqueued, not committed.
    assert_eq!(enqueue(&db.pool, "a", "k").await, "enqueued");
    let a: Vec<Delivery> =
        sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('qa', 10, 30)").fetch_all(&db.pool).await.unwrap();
    assert_eq!(a.len(), 1, "a's job runs");
    let mut producer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut producer).await.unwrap();
    let status: String =
        sqlx::query_scalar("SELECT status FROM lockgate.enqueue('b', '{}', '{\"concurrency_key\": \"k\"}')")
            .fetch_one(&mut producer)
            .await
            .unwrap();
    assert_eq!(status, "enqueued", "2 of 3, not committed");
    run(&db.pool, "SELECT lockgate.define_job_type('a', queue => 'qa', concurrency_limit => 1)").await;
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    assert!(claim(&db.pool).await.is_empty(), "b's job started beside a's, over a's new limit of 1");
    assert_eq!(parked(&db.pool, "k").await, ["b"]);
    sound(&db.pool, "b's job parked").await;

    // A claim open across the lowering: b's two jobs hold permits of k2, a's took one and lapsed.
    run(&db.pool, "SELECT lockgate.define_job_type('a', queue => 'qa', concurrency_limit => 3)").await;
    assert_eq!(enqueue(&db.pool, "b", "k2").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "b", "k2").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "a", "k2").await, "enqueued");
    sqlx::query(
        "UPDATE lockgate.leases SET expires_at = now() - interval '1 second' WHERE key = 'k2' AND job_type = 'a'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (expired,): (i32,) = sqlx::query_as("SELECT expired FROM lockgate.sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(expired, 1);
    let mut claimer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut claimer).await.unwrap();
    let taken: Vec<(i64,)> =
        sqlx::query_as("SELECT msg_id FROM lockgate.claim('qa', 10, 30)").fetch_all(&mut claimer).await.unwrap();
    assert_eq!(taken.len(), 1, "a's job takes a permit of k2 again, not committed");
    run(&db.pool, "SELECT lockgate.define_job_type('a', queue => 'qa', concurrency_limit => 1)").await;
    sqlx::query("COMMIT").execute(&mut claimer).await.unwrap();
    assert!(claim(&db.pool).await.is_empty(), "b's jobs started beside a's, over a's new limit of 1");
    assert_eq!(parked(&db.pool, "k2").await, ["b", "b"]);
    let leases: Vec<String> =
        sqlx::query_scalar("SELECT job_type FROM lockgate.leases WHERE key = 'k2'").fetch_all(&db.pool).await.unwrap();
    assert_eq!(leases, ["a"]);
    assert_eq!(violations(&db.pool).await, Vec::<String>::new());
}

/// Review helper-127 F3: a job re-keyed at its claim (its type's key paths changed, H33) gives its
/// old key's permit back; when its new key's row is held by another transaction it is put back
/// for a moment, and the old key's parked job takes that permit then, not at the next sweep.
#[tokio::test]
async fn a_re_keyed_job_put_back_for_its_new_key_gives_its_old_keys_permit_to_the_parked_job() {
    let db = TestDb::migrated().await.unwrap();
    run(&db.pool, "SELECT lockgate.define_job_type('a', concurrency_limit => 1, concurrency_key => ARRAY['x'])").await;
    for _ in 0..2 {
        run(&db.pool, "SELECT lockgate.enqueue('a', '{\"x\": 1}')").await;
    }
    assert_eq!(parked(&db.pool, "a:[1]").await, ["a"]);
    run(&db.pool, "SELECT lockgate.define_job_type('a', concurrency_limit => 1, concurrency_key => ARRAY['y'])").await;
    run(&db.pool, "SELECT lockgate.enqueue('a', '{\"x\": 2}')").await;
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT 1 FROM lockgate.semaphores WHERE key = 'a:[null]' FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();
    // The third job runs on its key; the first, re-keyed, is put back for a:[null].
    assert_eq!(claim(&db.pool).await.len(), 1);
    assert_eq!(parked(&db.pool, "a:[1]").await, Vec::<String>::new(), "the old key's parked job promoted");
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
}

/// Found by the model: a job that took a permit under its type's limit, and whose type then lost
/// it, started holding that permit; on a key types share it then counted against another type's
/// lowered limit. It gives the permit back at its claim and runs without one, as its type's jobs
/// now do (a running one keeps its permit until it finishes).
#[tokio::test]
async fn a_waiting_holder_whose_type_lost_its_limit_gives_its_permit_back_at_its_claim() {
    // x on a queue of its own, so that y's job is claimed first.
    let db = types(&[("y", 2)]).await;
    run(&db.pool, "SELECT lockgate.define_job_type('x', queue => 'xq', concurrency_limit => 1)").await;
    assert_eq!(enqueue(&db.pool, "x", "k").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "y", "k").await, "parked");
    run(&db.pool, "SELECT lockgate.define_job_type('x', queue => 'xq')").await;
    let promoted: i32 = sqlx::query_scalar("SELECT promoted FROM lockgate.sweep()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(promoted, 1, "x binds nothing now");
    assert_eq!(types_of(&db.pool, &claim(&db.pool).await).await, ["y"], "y's job runs");
    run(&db.pool, "SELECT lockgate.define_job_type('y', concurrency_limit => 1)").await;
    let x1: Vec<(i64, i32, Option<String>)> =
        sqlx::query_as("SELECT msg_id, read_ct, headers->>'ckey' FROM lockgate.claim('xq', 10, 30)")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(x1.len(), 1, "x's job runs, unlimited");
    assert_eq!(x1[0].2, None, "without its key");
    let x_leases = leases_of(&db.pool, "x").await;
    assert_eq!(x_leases, 0, "without the permit it took under its old limit");
    sound(&db.pool, "y's job and x's").await;
}

/// A claim that parks a job again (its permit given back under a lowered limit) gives the permit
/// to the key's next parked job, of another type, where it has room, as a completion would (H6),
/// instead of leaving it to the next sweep (found by the model, check (m)).
#[tokio::test]
async fn a_permit_given_back_by_a_claim_that_parks_its_job_goes_to_the_next_parked_job() {
    let db = types(&[("x", 2), ("y", 2)]).await;
    assert_eq!(enqueue(&db.pool, "y", "k").await, "enqueued");
    let y1 = claim_one(&db.pool).await;
    assert_eq!(types_of(&db.pool, &y1).await, ["y"]);
    assert_eq!(enqueue(&db.pool, "x", "k").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "y", "k").await, "parked", "y2 behind y1 and x1");
    run(&db.pool, "SELECT lockgate.define_job_type('x', concurrency_limit => 1)").await;
    // x1, claimed, gives its permit back and finds none under its new limit (y1 holds one): it
    // parks, and y2 takes the permit (2 of y's 2).
    assert!(claim(&db.pool).await.is_empty());
    assert_eq!(parked(&db.pool, "k").await, ["x"], "y2 promoted by the claim");
    assert_eq!(types_of(&db.pool, &claim(&db.pool).await).await, ["y"]);
    sound(&db.pool, "y1 and y2 running").await;
}

/// Review helper-126 F2: a parked job whose type's limit was removed was promoted, on a key still
/// held by another type's jobs, as if limited (the holders' limit stood in for its own): it took
/// a permit and held it while it ran. It is released without one, as on a key of its own.
#[tokio::test]
async fn a_parked_job_whose_type_lost_its_limit_is_promoted_without_a_permit_beside_other_holders() {
    let db = types(&[("a", 3), ("u", 2)]).await;
    assert_eq!(enqueue(&db.pool, "a", "k").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "a", "k").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "u", "k").await, "parked");
    run(&db.pool, "SELECT lockgate.define_job_type('u')").await;
    let ds = claim(&db.pool).await;
    assert!(complete_default(&db.pool, ds[0]).await);
    assert_eq!(parked(&db.pool, "k").await, Vec::<String>::new());
    let u_leases = leases_of(&db.pool, "u").await;
    assert_eq!(u_leases, 0, "u's job runs without a permit");
    assert_eq!(enqueue(&db.pool, "a", "k").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "a", "k").await, "enqueued", "3 of a's 3");
    sound(&db.pool, "a's jobs and u's").await;
}

#[tokio::test]
async fn g3_a_lease_taken_before_its_type_was_recorded_binds_the_keys_recorded_limit() {
    // What migration 27 leaves: a lease with no type, a key with no sole type.
    let db = types(&[("strict", 1), ("loose", 3)]).await;
    assert_eq!(enqueue(&db.pool, "strict", "k").await, "enqueued");
    run(&db.pool, "UPDATE lockgate.leases SET job_type = NULL").await;
    run(&db.pool, "UPDATE lockgate.semaphores SET sole_type = NULL").await;
    assert_eq!(enqueue(&db.pool, "loose", "k").await, "parked", "the untyped holder's limit 1 binds");
    assert_eq!(enqueue(&db.pool, "strict", "k").await, "parked");
    sound(&db.pool, "untyped holder").await;
}

/// Design §113 (found by the model, seed 5096178720460862966): a parked job that leaves its key
/// other than by promotion (an operator's discard, a cancel) may have been the head holding back
/// a looser type's job the key has room for; that job is promoted at once, as a completion
/// would, not at the next sweep.
#[tokio::test]
async fn a_parked_head_discarded_or_cancelled_lets_the_job_behind_it_take_the_free_permit() {
    for (key, how) in [("a", "discard_job"), ("b", "cancel")] {
        let db = types(&[("strict", 1), ("loose", 3)]).await;
        for _ in 0..3 {
            assert_eq!(enqueue(&db.pool, "loose", key).await, "enqueued");
        }
        assert_eq!(enqueue(&db.pool, "strict", key).await, "parked");
        assert_eq!(enqueue(&db.pool, "loose", key).await, "parked");
        let first = claim_one(&db.pool).await;
        assert!(complete_default(&db.pool, first[0]).await);
        assert_eq!(parked(&db.pool, key).await, ["strict", "loose"], "the strict head has no room: 2 holders");
        let head: i64 = sqlx::query_scalar("SELECT job_id FROM lockgate.parked WHERE key = $1 AND job_type = 'strict'")
            .bind(key)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        run(&db.pool, &format!("SELECT * FROM lockgate.{how}({head})")).await;
        assert_eq!(parked(&db.pool, key).await, Vec::<String>::new(), "{how}: the loose job behind the head waits");
        assert_eq!(leases_of(&db.pool, "loose").await, 3, "{how}");
        sound(&db.pool, how).await;
    }
}

/// Review helper-133 F2: the cancel of a parked head whose queue was dropped outside lockgate
/// (dead-lettered there) hands the key on as the other cancels do.
#[tokio::test]
async fn a_parked_head_cancelled_after_its_queue_was_dropped_lets_the_job_behind_it_start() {
    let db = types(&[("loose", 3)]).await;
    run(&db.pool, "SELECT lockgate.define_job_type('strict', queue => 'gone', concurrency_limit => 1)").await;
    for _ in 0..3 {
        assert_eq!(enqueue(&db.pool, "loose", "k").await, "enqueued");
    }
    assert_eq!(enqueue(&db.pool, "strict", "k").await, "parked");
    assert_eq!(enqueue(&db.pool, "loose", "k").await, "parked");
    let first = claim_one(&db.pool).await;
    assert!(complete_default(&db.pool, first[0]).await);
    run(&db.pool, "DROP TABLE pgmq.q_gone").await;
    let head: i64 = sqlx::query_scalar("SELECT job_id FROM lockgate.parked WHERE job_type = 'strict'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    run(&db.pool, &format!("SELECT * FROM lockgate.cancel({head})")).await;
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters WHERE job_id IS NOT NULL").await.unwrap(), 1);
    assert_eq!(parked(&db.pool, "k").await, Vec::<String>::new(), "the loose job behind the cancelled head waits");
    assert_eq!(leases_of(&db.pool, "loose").await, 3);
    // check_invariants() names the dropped queue; the keys are all that matters here.
    assert_eq!(over_limit(&db.pool).await, vec![]);
}

async fn sole_type(db: &PgPool, key: &str) -> Option<String> {
    sqlx::query_scalar("SELECT sole_type FROM lockgate.semaphores WHERE key = $1")
        .bind(key)
        .fetch_one(db)
        .await
        .unwrap()
}

/// A key whose holders were of several types returns to the one-statement admission (its sole
/// type recorded again) once they are of one type again, at the next admission or promotion,
/// rather than only once it empties; a lease that names no type (taken before migration 27)
/// keeps it from doing so.
#[tokio::test]
async fn a_key_held_by_one_type_again_is_recorded_so_by_the_next_admission_or_promotion() {
    let db = types(&[("mid", 2), ("loose", 3)]).await;
    // By an enqueue: a loose holder and a mid one; mid finishes; the next loose enqueue.
    assert_eq!(enqueue(&db.pool, "loose", "a").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "mid", "a").await, "enqueued");
    assert_eq!(sole_type(&db.pool, "a").await, None, "held by two types");
    let ds = claim(&db.pool).await;
    let mid = ds.iter().max_by_key(|d| d.0).copied().unwrap();
    assert!(complete_default(&db.pool, mid).await);
    assert_eq!(enqueue(&db.pool, "loose", "a").await, "enqueued");
    assert_eq!(sole_type(&db.pool, "a").await.as_deref(), Some("loose"));
    sound(&db.pool, "key a").await;

    // By a promotion: a loose holder, a mid one, a loose job parked; mid finishes.
    assert_eq!(enqueue(&db.pool, "loose", "b").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "mid", "b").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "loose", "b").await, "parked");
    let ds = claim(&db.pool).await;
    let mid = ds.iter().max_by_key(|d| d.0).copied().unwrap();
    assert_eq!(types_of(&db.pool, &[mid]).await, ["mid"], "the last enqueued");
    assert!(complete_default(&db.pool, mid).await);
    assert_eq!(parked(&db.pool, "b").await, Vec::<String>::new(), "promoted");
    assert_eq!(sole_type(&db.pool, "b").await.as_deref(), Some("loose"));
    sound(&db.pool, "key b").await;

    // A lease naming no type beside one of loose's: the key stays recorded as held by several.
    assert_eq!(enqueue(&db.pool, "loose", "c").await, "enqueued");
    assert_eq!(enqueue(&db.pool, "loose", "c").await, "enqueued");
    run(&db.pool, "UPDATE lockgate.leases SET job_type = NULL WHERE key = 'c' AND msg_id = (SELECT min(msg_id) FROM lockgate.leases WHERE key = 'c')").await;
    run(&db.pool, "UPDATE lockgate.semaphores SET sole_type = NULL WHERE key = 'c'").await;
    assert_eq!(enqueue(&db.pool, "loose", "c").await, "enqueued");
    assert_eq!(sole_type(&db.pool, "c").await, None);
    sound(&db.pool, "key c").await;
}

#[tokio::test]
async fn check_invariants_names_a_key_recorded_as_held_by_one_type_that_another_holds() {
    let db = types(&[("strict", 1), ("loose", 3)]).await;
    assert_eq!(enqueue(&db.pool, "loose", "k").await, "enqueued");
    assert_eq!(violations(&db.pool).await, Vec::<String>::new());
    run(&db.pool, "UPDATE lockgate.semaphores SET sole_type = 'strict'").await;
    let found = violations(&db.pool).await;
    assert!(
        found.iter().any(|v| v.contains("recorded as held by type strict alone") && v.contains("loose")),
        "{found:?}"
    );
}
