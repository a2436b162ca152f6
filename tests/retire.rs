//! Retiring job types and queues (`lockgate.remove_job_type`, `lockgate.drop_queue`, design §90):
//! each refused, naming the use, while anything still needs what it removes, and complete once
//! nothing does; a drop that races a producer's uncommitted enqueue counts its job, never drops it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use lockgate_testkit::{wait_for, TestDb};
use sqlx::Connection;

async fn refusal(db: &TestDb, sql: &str) -> String {
    let err = sqlx::query(sql).execute(&db.pool).await.expect_err(sql);
    let db_err = err.as_database_error().expect("a database error");
    assert_eq!(db_err.code().as_deref(), Some("55006"), "{db_err}");
    db_err.message().to_string()
}

async fn removed(db: &TestDb, sql: &str) -> bool {
    sqlx::query_scalar(sql).fetch_one(&db.pool).await.unwrap()
}

/// Waits until a session of this database waits for a lock, running a statement like `like`.
async fn waiting_on_a_lock(db: &TestDb, what: &str, like: &str) {
    let sql = format!(
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'
            AND pid <> pg_backend_pid() AND query LIKE '{like}'"
    );
    wait_for(what, Duration::from_secs(15), || async { Ok((db.count(&sql).await? > 0).then_some(())) }).await.unwrap();
}

/// `lockgate.drop_queue(queue)` on a connection of its own, in a task.
fn spawn_drop(db: &TestDb, queue: &'static str) -> tokio::task::JoinHandle<Result<bool, sqlx::Error>> {
    let url = db.url.clone();
    tokio::spawn(async move {
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query_scalar("SELECT lockgate.drop_queue($1)").bind(queue).fetch_one(&mut conn).await
    })
}

/// Limited type `lim` on queue qb, its key `k` = 1 held by a first job there, and an empty queue
/// qa: a job of the key enqueued into qa parks for qa.
async fn hold_a_key_for_qa(db: &TestDb) {
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('lim', queue => 'qb', concurrency_limit => 1, concurrency_key => ARRAY['k'],
                                         concurrency_duration_ms => 60000);
         SELECT lockgate.create_queue('qa');
         SELECT lockgate.enqueue('lim', '{\"k\": 1}');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
}

/// Waits until a drop is trying for its locks (it never waits in a lock's queue: it tries again
/// every 10 ms), and has tried for a while.
async fn drop_trying(db: &TestDb) {
    wait_for("the drop to try for its locks", Duration::from_secs(15), || async {
        let trying = db
            .count(
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND state = 'active'
                    AND query LIKE '%drop' || '_queue%' AND now() - query_start > interval '100 milliseconds'",
            )
            .await?;
        Ok((trying > 0).then_some(()))
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_job_type_is_removed_only_once_nothing_needs_it() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('gone', queue => 'qa', concurrency_limit => 1, concurrency_key => ARRAY['k'],
                                         concurrency_duration_ms => 60000);
         SELECT lockgate.define_job_type('other', queue => 'qa');
         SELECT lockgate.enqueue('gone', '{\"k\": 1}');
         SELECT lockgate.enqueue('gone', '{\"k\": 1}');
         SELECT lockgate.define_recurring('tick', '@daily', 'gone');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let message = refusal(&db, "SELECT lockgate.remove_job_type('gone')").await;
    assert!(
        message.starts_with(
            "lockgate: job type \"gone\" is still in use: 1 queued, scheduled, retrying or running job(s); \
             1 parked job(s); recurring task(s) tick."
        ),
        "{message}"
    );
    // Cleared one by one: the queued job dead-lettered, the parked one promoted and cancelled.
    sqlx::raw_sql(
        "SELECT lockgate.dead_letter('qa', msg_id, read_ct, 'attempts_exhausted', 'boom', 1) FROM lockgate.claim('qa', 1, 30);
         SELECT lockgate.cancel(j.id) FROM lockgate.jobs(job_type => 'gone', states => '{queued}') j;
         SELECT lockgate.remove_recurring('tick');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let message = refusal(&db, "SELECT lockgate.remove_job_type('gone')").await;
    assert!(message.contains("in use: 1 dead letter(s). Let its jobs finish"), "{message}");
    sqlx::query("SELECT lockgate.dlq_purge('qa', NULL)").execute(&db.pool).await.unwrap();
    assert!(removed(&db, "SELECT lockgate.remove_job_type('gone')").await);
    assert!(!removed(&db, "SELECT lockgate.remove_job_type('gone')").await, "a second removal finds nothing");
    assert_eq!(db.count("SELECT 1 FROM lockgate.job_types").await.unwrap(), 1, "the other type stays");
    let refused = sqlx::query("SELECT lockgate.enqueue('gone', '{}')").execute(&db.pool).await.unwrap_err();
    assert!(refused.to_string().contains("unknown job type \"gone\""), "{refused}");

    // A batch that will call it back, then the callback's job.
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('report', queue => 'qa'); SELECT lockgate.create_batch(on_finish => 'report');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let message = refusal(&db, "SELECT lockgate.remove_job_type('report')").await;
    assert!(message.contains("in use: the callbacks of unfinished batch(es) 1."), "{message}");
    sqlx::query("SELECT lockgate.close_batch(1)").execute(&db.pool).await.unwrap();
    let message = refusal(&db, "SELECT lockgate.remove_job_type('report')").await;
    assert!(message.contains("in use: 1 queued, scheduled, retrying or running job(s)."), "{message}");
    sqlx::query("SELECT lockgate.cancel(j.id) FROM lockgate.jobs(job_type => 'report') j")
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(removed(&db, "SELECT lockgate.remove_job_type('report')").await);
}

#[tokio::test]
async fn a_queue_is_dropped_only_once_nothing_needs_it_and_can_be_made_again() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('t', queue => 'qa');
         SELECT lockgate.define_job_type('elsewhere', queue => 'qb');
         SELECT lockgate.enqueue('elsewhere', '{}', '{\"queue\": \"qa\"}');
         SELECT lockgate.define_recurring('tick', '@daily', 'elsewhere', options => '{\"queue\": \"qa\"}');
         SELECT lockgate.register_process('worker', 'workers', 'h', 1, NULL, '{\"queues\": [\"qa\"]}');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let message = refusal(&db, "SELECT lockgate.drop_queue('qa')").await;
    assert!(
        message.starts_with(
            "lockgate: queue \"qa\" is still in use: job type(s) t defined on it; 1 queued, scheduled, retrying or \
             running job(s); recurring task(s) tick; the pool(s) workers (pid 1 on h) serving it."
        ),
        "{message}"
    );
    sqlx::raw_sql(
        "SELECT lockgate.remove_job_type('t');
         SELECT lockgate.dead_letter('qa', msg_id, read_ct, 'attempts_exhausted', 'boom', 1) FROM lockgate.claim('qa', 1, 30);
         SELECT lockgate.remove_recurring('tick');
         DELETE FROM lockgate.processes;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let message = refusal(&db, "SELECT lockgate.drop_queue('qa')").await;
    assert!(message.contains("in use: 1 dead letter(s). Remove its job types"), "{message}");
    sqlx::query("SELECT lockgate.dlq_purge('qa', NULL)").execute(&db.pool).await.unwrap();
    assert!(removed(&db, "SELECT lockgate.drop_queue('qa')").await);
    assert!(!removed(&db, "SELECT lockgate.drop_queue('qa')").await, "a second drop finds nothing");
    let left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM lockgate.queues WHERE name = 'qa')
              + (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = 'pgmq' AND c.relname IN ('q_qa', 'a_qa'))
              + (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                  WHERE n.nspname = 'lockgate' AND p.proname LIKE '%\\_qa')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(left, 0, "its row, tables and steps are gone");
    let problems = db.count("SELECT 1 FROM lockgate.check_invariants()").await.unwrap();
    assert_eq!(problems, 0, "nothing is left pointing at the dropped queue");
    // Made again under the same name, it is a new queue that works as any other.
    sqlx::raw_sql("SELECT lockgate.define_job_type('t', queue => 'qa'); SELECT lockgate.enqueue('t', '{}');")
        .execute(&db.pool)
        .await
        .unwrap();
    let claimed = db.count("SELECT 1 FROM lockgate.claim('qa', 5, 30)").await.unwrap();
    assert_eq!(claimed, 1);
    // A queue whose table was dropped behind lockgate's back is retired the same way.
    sqlx::raw_sql("SELECT lockgate.create_queue('qd'); SELECT pgmq.drop_queue('qd');").execute(&db.pool).await.unwrap();
    assert!(removed(&db, "SELECT lockgate.drop_queue('qd')").await);
    let verdict: String = sqlx::query_scalar("SELECT verdict FROM lockgate.doctor() WHERE check_name = 'queue_tables'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(verdict, "ok");
}

/// A producer's enqueue into the queue, not yet committed when the drop starts: the drop keeps
/// trying for the queue's table, then counts the committed job and refuses, rather than drop the
/// table with the job in it.
#[tokio::test]
async fn a_drop_racing_an_uncommitted_enqueue_counts_its_job() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql("SELECT lockgate.define_job_type('elsewhere', queue => 'qb'); SELECT lockgate.create_queue('qa');")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut producer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.enqueue('elsewhere', '{}', '{\"queue\": \"qa\"}');")
        .execute(&mut producer)
        .await
        .unwrap();
    let drop = spawn_drop(&db, "qa");
    drop_trying(&db).await;
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    let refused = drop.await.unwrap().expect_err("the drop counts the committed job");
    assert!(refused.to_string().contains("1 queued, scheduled, retrying or running job(s)"), "{refused}");
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_qa").await.unwrap(), 1, "the job is still there");
}

/// Review of §90 (helper-93, F1/F2): at REPEATABLE READ the counts read a snapshot older than the
/// locks, so a job committed after it was missed and dropped with its table. Both functions need
/// READ COMMITTED, and say so with a serialization failure.
#[tokio::test]
async fn retiring_at_an_older_snapshot_is_refused_and_loses_no_job() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql("SELECT lockgate.define_job_type('elsewhere', queue => 'qb'); SELECT lockgate.create_queue('qa');")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut operator = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT txid_current_snapshot();")
        .execute(&mut operator)
        .await
        .unwrap();
    sqlx::query("SELECT lockgate.enqueue('elsewhere', '{}', '{\"queue\": \"qa\"}')").execute(&db.pool).await.unwrap();
    for call in ["SELECT lockgate.drop_queue('qa')", "SELECT lockgate.remove_job_type('elsewhere')"] {
        let refused = sqlx::query(call).execute(&mut operator).await.unwrap_err();
        let code = refused.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("40001"), "{call}: {refused}");
        assert!(refused.to_string().contains("needs READ COMMITTED, not repeatable read"), "{refused}");
        sqlx::raw_sql("ROLLBACK; BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1;")
            .execute(&mut operator)
            .await
            .unwrap();
    }
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_qa").await.unwrap(), 1, "the job is still there");
}

/// Review of §90 (helper-93, F3): a limited job enqueued into the queue parks in lockgate.parked
/// without touching the queue's table, so the table's lock did not wait for it, and the drop left
/// it parked for a queue that no longer existed. The drop waits for parking too.
#[tokio::test]
async fn a_drop_racing_an_uncommitted_park_into_the_queue_counts_it() {
    let db = TestDb::migrated().await.unwrap();
    hold_a_key_for_qa(&db).await;
    let mut producer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    // The key is held by the first job (in qb): this one parks, for qa.
    sqlx::raw_sql("BEGIN; SELECT lockgate.enqueue('lim', '{\"k\": 1}', '{\"queue\": \"qa\"}');")
        .execute(&mut producer)
        .await
        .unwrap();
    let drop = spawn_drop(&db, "qa");
    drop_trying(&db).await;
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    let refused = drop.await.unwrap().expect_err("the drop counts the parked job");
    assert!(refused.to_string().contains("1 parked job(s)"), "{refused}");
    assert_eq!(db.count("SELECT 1 FROM lockgate.queues WHERE name = 'qa'").await.unwrap(), 1);
}

/// Review of §90 (helper-93, F4–F7): a removed type's history is still found by `jobs`; a drop
/// that waited for another drop of the same queue finds nothing and says so; the caller's
/// lock_timeout is left as it was; NULL names nothing.
#[tokio::test]
async fn retiring_leaves_history_findable_and_the_callers_settings_alone() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('once', queue => 'qa');
         SELECT lockgate.enqueue('once', '{}');
         SELECT lockgate.complete('qa', ARRAY[msg_id], ARRAY[read_ct]) FROM lockgate.claim('qa', 1, 30);
         SELECT lockgate.remove_job_type('once');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let found = db.count("SELECT 1 FROM lockgate.jobs(job_type => 'once')").await.unwrap();
    assert_eq!(found, 1, "the archived job of the removed type");
    let typo = sqlx::query("SELECT * FROM lockgate.jobs(job_type => 'onec')").execute(&db.pool).await.unwrap_err();
    assert!(typo.to_string().contains("unknown job type \"onec\""), "{typo}");

    let mut first = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.drop_queue('qa');").execute(&mut first).await.unwrap();
    let second = spawn_drop(&db, "qa");
    waiting_on_a_lock(&db, "the second drop to wait", "%lockgate.drop_queue(%").await;
    let timeout: String = sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut first).await.unwrap();
    assert_eq!(timeout, "0", "the caller's lock_timeout is left as it was");
    sqlx::query("COMMIT").execute(&mut first).await.unwrap();
    assert!(!second.await.unwrap().unwrap(), "nothing was left to drop");
    let null: bool = sqlx::query_scalar("SELECT lockgate.drop_queue(NULL)").fetch_one(&db.pool).await.unwrap();
    assert!(!null);
}

/// Review of §90 (helper-94, F1): the other order. The drop holds its locks first; a limited job
/// then parks for the queue, its insert waiting for the drop, which commits; the insert went
/// through, and the job was parked for a queue that no longer existed. The enqueue looks for the
/// queue again after its insert, and fails. And a drop never waits holding a lock, so a
/// completion promoting into the queue is in no deadlock with it (F2).
#[tokio::test]
async fn a_park_that_waited_for_a_drop_fails_instead_of_parking_for_no_queue() {
    let db = TestDb::migrated().await.unwrap();
    hold_a_key_for_qa(&db).await;
    let mut operator = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.drop_queue('qa');").execute(&mut operator).await.unwrap();
    let url = db.url.clone();
    let producer = tokio::spawn(async move {
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query_scalar::<_, String>(
            "SELECT status FROM lockgate.enqueue('lim', '{\"k\": 1}', '{\"queue\": \"qa\"}')",
        )
        .fetch_one(&mut conn)
        .await
    });
    waiting_on_a_lock(&db, "the park to wait for the drop", "%lockgate.enqueue%").await;
    sqlx::query("COMMIT").execute(&mut operator).await.unwrap();
    let refused = producer.await.unwrap().expect_err("the park finds the queue gone");
    assert!(refused.to_string().contains("queue \"qa\" does not exist"), "{refused}");
    assert_eq!(db.count("SELECT 1 FROM lockgate.parked").await.unwrap(), 0, "nothing parked for no queue");
    assert_eq!(db.count("SELECT 1 FROM lockgate.check_invariants()").await.unwrap(), 0);
}

/// Review of §90 (helper-94, F2): the drop took the queue's table, then lockgate.parked, waiting
/// for each; a completion promoting a parked job into the queue takes them in the other order,
/// and one of the two was the deadlock detector's victim, the completion among them (its job
/// would run again). The drop now never waits while it holds a lock: the completion goes
/// through, and the drop then counts the job it promoted.
#[tokio::test]
async fn a_completion_promoting_into_a_queue_being_dropped_is_never_a_deadlock_victim() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('lim', queue => 'qhome', concurrency_limit => 1, concurrency_key => ARRAY['k'],
                                         concurrency_duration_ms => 60000);
         SELECT lockgate.define_job_type('free', queue => 'qhome');
         SELECT lockgate.create_queue('qp');
         SELECT lockgate.enqueue('lim', '{\"k\": 1}');
         SELECT lockgate.enqueue('lim', '{\"k\": 1}', '{\"queue\": \"qp\"}');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(db.count("SELECT 1 FROM lockgate.parked WHERE queue = 'qp'").await.unwrap(), 1);
    let (msg_id, read_ct): (i64, i32) =
        sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('qhome', 1, 60)").fetch_one(&db.pool).await.unwrap();
    // A producer writing the queue's table for a while: the drop keeps trying meanwhile.
    let mut producer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.enqueue('free', '{}', '{\"queue\": \"qp\"}');")
        .execute(&mut producer)
        .await
        .unwrap();
    let drop = spawn_drop(&db, "qp");
    drop_trying(&db).await;
    let completed: Vec<i64> = sqlx::query_scalar("SELECT * FROM lockgate.complete('qhome', $1, $2)")
        .bind(vec![msg_id])
        .bind(vec![read_ct])
        .fetch_all(&db.pool)
        .await
        .expect("the completion lands, promoting into qp");
    assert_eq!(completed, vec![msg_id]);
    sqlx::query("ROLLBACK").execute(&mut producer).await.unwrap();
    let refused = drop.await.unwrap().expect_err("the drop counts the promoted job");
    assert!(refused.to_string().contains("1 queued, scheduled, retrying or running job(s)"), "{refused}");
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_qp").await.unwrap(), 1);
}

/// Review of §90 (helper-95, F1): a producer at REPEATABLE READ, its snapshot older than a drop's
/// commit, still saw the queue's row after its park waited for the drop, and parked its job for a
/// queue that no longer existed. The park now looks the queue's table up in the catalog as it is.
#[tokio::test]
async fn a_repeatable_read_park_that_waited_for_a_drop_fails_too() {
    let db = TestDb::migrated().await.unwrap();
    hold_a_key_for_qa(&db).await;
    let mut producer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM lockgate.queues;")
        .execute(&mut producer)
        .await
        .unwrap();
    let mut operator = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.drop_queue('qa');").execute(&mut operator).await.unwrap();
    let parking = tokio::spawn(async move {
        let parked = sqlx::query_scalar::<_, String>(
            "SELECT status FROM lockgate.enqueue('lim', '{\"k\": 1}', '{\"queue\": \"qa\"}')",
        )
        .fetch_one(&mut producer)
        .await;
        (parked, producer)
    });
    waiting_on_a_lock(&db, "the park to wait for the drop", "%lockgate.enqueue%").await;
    sqlx::query("COMMIT").execute(&mut operator).await.unwrap();
    let (parked, mut producer) = parking.await.unwrap();
    let refused = parked.expect_err("the park finds the queue's table gone");
    assert!(refused.to_string().contains("queue \"qa\" does not exist"), "{refused}");
    sqlx::query("ROLLBACK").execute(&mut producer).await.unwrap();
    assert_eq!(db.count("SELECT 1 FROM lockgate.parked").await.unwrap(), 0, "nothing parked for no queue");
}

/// `sql` on a connection of its own, in a task, as one transaction.
fn spawn_sql(db: &TestDb, sql: &'static str) -> tokio::task::JoinHandle<Result<(), sqlx::Error>> {
    let url = db.url.clone();
    tokio::spawn(async move {
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query(sql).execute(&mut conn).await.map(|_| ())
    })
}

/// Design §91: a recurring task or a batch callback names a type without writing a job of it, so
/// nothing a removal counted waited for it. A definition uncommitted while the removal ran was
/// counted in nothing (the type went, and the task's ticks or the batch's callback met a type no
/// one defines); a definition that read the type before the removal committed stored it all the
/// same. Each now holds the type's row FOR KEY SHARE: in the first order the removal waits and
/// counts it, in the second the definition waits and finds the type gone.
#[tokio::test]
async fn definitions_naming_a_type_being_removed_are_counted_or_refused() {
    let db = TestDb::migrated().await.unwrap();
    let definitions = [
        (
            "SELECT lockgate.define_recurring('tick', '@daily', 'gone')",
            "recurring task(s) tick",
            "SELECT lockgate.remove_recurring('tick')",
        ),
        (
            "SELECT lockgate.create_batch(on_finish => 'gone')",
            "the callbacks of unfinished batch(es)",
            "DELETE FROM lockgate.batches",
        ),
    ];
    for (define, counted_as, undo) in definitions {
        sqlx::query("SELECT lockgate.define_job_type('gone', queue => 'qa')").execute(&db.pool).await.unwrap();
        // The definition first: the removal waits for it and counts what it committed.
        let mut definer = sqlx::PgConnection::connect(&db.url).await.unwrap();
        sqlx::raw_sql(&format!("BEGIN; {define};")).execute(&mut definer).await.unwrap();
        let removal = spawn_sql(&db, "SELECT lockgate.remove_job_type('gone')");
        waiting_on_a_lock(&db, "the removal to wait for the definition", "%remove_job_type%").await;
        sqlx::query("COMMIT").execute(&mut definer).await.unwrap();
        let refused = removal.await.unwrap().expect_err("the removal counts the definition");
        assert!(refused.to_string().contains(counted_as), "{define}: {refused}");
        sqlx::query(undo).execute(&db.pool).await.unwrap();

        // The removal first: the definition waits for it and finds the type gone.
        let mut operator = sqlx::PgConnection::connect(&db.url).await.unwrap();
        sqlx::raw_sql("BEGIN; SELECT lockgate.remove_job_type('gone');").execute(&mut operator).await.unwrap();
        let definition = spawn_sql(&db, define);
        waiting_on_a_lock(&db, "the definition to wait for the removal", "%lockgate.%").await;
        sqlx::query("COMMIT").execute(&mut operator).await.unwrap();
        let refused = definition.await.unwrap().expect_err("the definition finds the type gone");
        assert!(refused.to_string().contains("unknown job type \"gone\""), "{define}: {refused}");
        assert_eq!(db.count("SELECT 1 FROM lockgate.recurring_tasks").await.unwrap(), 0, "{define}");
        assert_eq!(db.count("SELECT 1 FROM lockgate.batches").await.unwrap(), 0, "{define}");
    }
}

/// Design §91: a recurring task that enqueues into a queue (`{"queue": …}`) names it without
/// writing to its table, so the drop's table lock did not wait for it: a task uncommitted while the
/// drop counted was left ticking into a dropped queue, and one that looked for the queue before the
/// drop committed was stored all the same. The task holds the queue's row FOR KEY SHARE, which the
/// drop takes FOR UPDATE with its other locks.
#[tokio::test]
async fn a_recurring_task_naming_a_queue_being_dropped_is_counted_or_refused() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql("SELECT lockgate.define_job_type('elsewhere', queue => 'qb'); SELECT lockgate.create_queue('qa');")
        .execute(&db.pool)
        .await
        .unwrap();
    const DEFINE: &str =
        "SELECT lockgate.define_recurring('tick', '@daily', 'elsewhere', options => '{\"queue\": \"qa\"}')";
    let mut definer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql(&format!("BEGIN; {DEFINE};")).execute(&mut definer).await.unwrap();
    let drop = spawn_drop(&db, "qa");
    drop_trying(&db).await;
    sqlx::query("COMMIT").execute(&mut definer).await.unwrap();
    let refused = drop.await.unwrap().expect_err("the drop counts the task");
    assert!(refused.to_string().contains("recurring task(s) tick"), "{refused}");
    sqlx::query("SELECT lockgate.remove_recurring('tick')").execute(&db.pool).await.unwrap();

    let mut operator = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.drop_queue('qa');").execute(&mut operator).await.unwrap();
    let definition = spawn_sql(&db, DEFINE);
    waiting_on_a_lock(&db, "the definition to wait for the drop", "%define_recurring%").await;
    sqlx::query("COMMIT").execute(&mut operator).await.unwrap();
    let refused = definition.await.unwrap().expect_err("the definition finds the queue gone");
    let db_err = refused.as_database_error().expect("a database error");
    assert_eq!(db_err.code().as_deref(), Some("LG001"), "{db_err}");
    assert!(db_err.message().contains("unknown queue \"qa\""), "{db_err}");
    assert_eq!(db.count("SELECT 1 FROM lockgate.recurring_tasks").await.unwrap(), 0);

    // A type defined on the queue as it is dropped: the definition waits, and makes the queue
    // again, as a moment later it would (it failed on the foreign key).
    sqlx::query("SELECT lockgate.create_queue('qa')").execute(&db.pool).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.drop_queue('qa');").execute(&mut operator).await.unwrap();
    let definition = spawn_sql(&db, "SELECT lockgate.define_job_type('here', queue => 'qa')");
    waiting_on_a_lock(&db, "the type's definition to wait for the drop", "%define_job_type%").await;
    sqlx::query("COMMIT").execute(&mut operator).await.unwrap();
    definition.await.unwrap().expect("the type is defined, on the queue made again");
    sqlx::query("SELECT lockgate.enqueue('here', '{}')").execute(&db.pool).await.unwrap();
    assert_eq!(db.count("SELECT 1 FROM pgmq.q_qa").await.unwrap(), 1);
    assert_eq!(db.count("SELECT 1 FROM lockgate.check_invariants()").await.unwrap(), 0);
}

/// Design §91 (helper-94's MEDIUM): a removal counts a type's jobs queue by queue, then its dead
/// letters; a `dlq_retry` committed between the two moved a dead letter of the type into a queue
/// already counted, and the type went with a job of it queued. The retry now holds the type's row
/// FOR KEY SHARE, so the removal waits for it before counting anything. The schedule is forced:
/// queue qz's table is held, so a removal that did not wait for the retry has counted qa and waits
/// at qz while the retry commits.
#[tokio::test]
async fn a_dead_letter_retried_while_its_type_is_removed_is_counted() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('gone', queue => 'qa');
         SELECT lockgate.define_job_type('other', queue => 'qz');
         SELECT lockgate.enqueue('gone', '{}');
         SELECT lockgate.dead_letter('qa', msg_id, read_ct, 'attempts_exhausted', 'boom', 1) FROM lockgate.claim('qa', 1, 30);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(db.count("SELECT 1 FROM lockgate.dead_letters").await.unwrap(), 1);
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE pgmq.q_qz IN ACCESS EXCLUSIVE MODE;").execute(&mut holder).await.unwrap();
    let mut retrier = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT * FROM lockgate.dlq_retry('qa', NULL);").execute(&mut retrier).await.unwrap();
    let removal = spawn_sql(&db, "SELECT lockgate.remove_job_type('gone')");
    waiting_on_a_lock(&db, "the removal to wait", "%remove_job_type%").await;
    sqlx::query("COMMIT").execute(&mut retrier).await.unwrap();
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    let refused = removal.await.unwrap().expect_err("the removal counts the retried job");
    assert!(refused.to_string().contains("in use: 1 queued, scheduled, retrying or running job(s)."), "{refused}");
    assert_eq!(db.count("SELECT 1 FROM lockgate.job_types WHERE name = 'gone'").await.unwrap(), 1);
}

/// The SQLSTATE of a database error, or the error itself.
fn sqlstate(e: &sqlx::Error) -> String {
    e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned()).unwrap_or_else(|| e.to_string())
}

/// How long the randomised schedule runs: at least `least`, then until a drop and a removal have
/// both happened, and at most `most` whatever happened. A fixed 5 s left a loaded CI machine, once,
/// with no removal at all, and the search's own check failed.
struct Schedule {
    start: std::time::Instant,
    least: Duration,
    most: Duration,
    retired: std::sync::Arc<std::sync::Mutex<[u32; 2]>>,
}

impl Schedule {
    fn over(&self) -> bool {
        let ran = self.start.elapsed();
        let both = || self.retired.lock().unwrap().iter().all(|n| *n > 0);
        ran >= self.most || (ran >= self.least && both())
    }
}

/// Runs `f` until the schedule is over, pausing 0-`pause_ms` ms between calls; an error whose
/// SQLSTATE is not in `accepted` fails the test, naming the task and the error.
async fn keep_doing<F>(task: &'static str, accepted: &[&str], pause_ms: u64, until: &Schedule, mut f: F)
where
    F: AsyncFnMut() -> Result<(), sqlx::Error>,
{
    while !until.over() {
        if let Err(e) = f().await {
            assert!(accepted.contains(&sqlstate(&e).as_str()), "{task}: {e}");
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=pause_ms))).await;
    }
}

/// What a chaos phase may not leave: a name that points at nothing (a recurring task's type or
/// queue, an unfinished batch's callback type, a parked job's queue) or a job of a type no one
/// defines; and lockgate's own invariants.
async fn nothing_dangles(db: &TestDb, when: &str) {
    for (what, sql) in [
        (
            "recurring tasks naming what is gone",
            "SELECT 1 FROM lockgate.recurring_tasks r
              WHERE NOT EXISTS (SELECT 1 FROM lockgate.job_types t WHERE t.name = r.job_type)
                 OR (r.options ? 'queue' AND NOT EXISTS (SELECT 1 FROM lockgate.queues q WHERE q.name = r.options->>'queue'))",
        ),
        (
            "unfinished batches calling back a removed type",
            "SELECT 1 FROM lockgate.batches b
              WHERE (b.state <> 'finished' OR b.callbacks_pending)
                AND b.on_finish IS NOT NULL AND NOT EXISTS (SELECT 1 FROM lockgate.job_types t WHERE t.name = b.on_finish)",
        ),
        ("parked jobs of a dropped queue", "SELECT 1 FROM lockgate.parked p WHERE NOT EXISTS (SELECT 1 FROM lockgate.queues q WHERE q.name = p.queue)"),
        (
            "queued jobs of a removed type",
            "SELECT 1 FROM pgmq.q_qhome m WHERE NOT EXISTS (SELECT 1 FROM lockgate.job_types t WHERE t.name = m.headers->>'type')",
        ),
        (
            "dead letters of a removed type or a dropped queue",
            "SELECT 1 FROM lockgate.dead_letters d
              WHERE NOT EXISTS (SELECT 1 FROM lockgate.job_types t WHERE t.name = d.job_type)
                 OR NOT EXISTS (SELECT 1 FROM lockgate.queues q WHERE q.name = d.queue)",
        ),
        ("invariants broken", "SELECT 1 FROM lockgate.check_invariants()"),
    ] {
        assert_eq!(db.count(sql).await.unwrap(), 0, "{when}: {what}");
    }
}

/// Design §90, §91, searched: producers (limited and not, single and many, READ COMMITTED and
/// REPEATABLE READ) enqueue into queue qx, a definer defines and removes recurring tasks naming
/// qx and type `gone`, a batcher creates and closes batches calling `gone` back, a worker claims
/// from qx and qhome and completes or dead-letters, a retrier retries dead letters, and an
/// operator drops qx and removes `gone` whenever nothing needs them, making them again a moment
/// later. Afterwards nothing names what is gone, and once drained every job an enqueue committed
/// was completed, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retiring_amid_producers_workers_and_definitions_loses_no_job_and_leaves_nothing_dangling() {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('free', queue => 'qhome');
         SELECT lockgate.define_job_type('lim', queue => 'qhome', concurrency_limit => 1, concurrency_key => ARRAY['k'],
                                         concurrency_duration_ms => 60000);
         SELECT lockgate.define_job_type('gone', queue => 'qhome');
         SELECT lockgate.create_queue('qx');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let enqueued: Arc<Mutex<Vec<i64>>> = Arc::default();
    let completed: Arc<Mutex<HashMap<i64, u32>>> = Arc::default();
    let retired: Arc<Mutex<[u32; 2]>> = Arc::default();
    let schedule = Schedule {
        start: std::time::Instant::now(),
        least: Duration::from_secs(5),
        most: Duration::from_secs(30),
        retired: retired.clone(),
    };
    let until = &schedule;
    let connect = || sqlx::PgConnection::connect(&db.url);

    let producer = |producer: u8, mut conn: sqlx::PgConnection| {
        let enqueued = enqueued.clone();
        async move {
            // 42P01 and 42883: an enqueue straight into qx as its drop commits meets the table,
            // or the queue's enqueue step, gone between its look and its use (design §90, LOW).
            keep_doing("producer", &["LG001", "40001", "42P01", "42883"], 5, until, async || {
                // Quiet every other 300 ms, so that the queue empties and its drop goes through.
                if until.start.elapsed().as_millis() / 300 % 2 == 0 {
                    return Ok(());
                }
                let isolation = if fastrand::bool() { "READ COMMITTED" } else { "REPEATABLE READ" };
                let k = fastrand::u8(0..3);
                let (call, args) = match (producer, fastrand::u8(0..3)) {
                    (0, 0) => ("enqueue", "'free', '{}'".to_string()),
                    (0, _) => ("enqueue", format!("'lim', '{{\"k\": {k}}}'")),
                    _ => ("enqueue_many", format!("'lim', ARRAY['{{\"k\": {k}}}', '{{\"k\": {}}}']::jsonb[]", k + 1)),
                };
                sqlx::raw_sql(&format!("BEGIN ISOLATION LEVEL {isolation}")).execute(&mut conn).await?;
                let ids = sqlx::query_scalar::<_, i64>(&format!(
                    "SELECT job_id FROM lockgate.{call}({args}, '{{\"queue\": \"qx\"}}')"
                ))
                .fetch_all(&mut conn)
                .await;
                let ids = match ids {
                    Ok(ids) => ids,
                    Err(e) => {
                        sqlx::raw_sql("ROLLBACK").execute(&mut conn).await?;
                        return Err(e);
                    }
                };
                sqlx::raw_sql("COMMIT").execute(&mut conn).await?;
                enqueued.lock().unwrap().extend(ids);
                Ok(())
            })
            .await;
        }
    };
    let producers = (producer(0, connect().await.unwrap()), producer(1, connect().await.unwrap()));
    let definer = {
        let mut conn = connect().await.unwrap();
        async move {
            keep_doing("definer", &["LG001", "LG002"], 10, until, async || {
                let ty = if fastrand::bool() { "gone" } else { "free" };
                let options = if fastrand::bool() { "{\"queue\": \"qx\"}" } else { "{}" };
                sqlx::query("SELECT lockgate.define_recurring('tick', '@daily', $1, options => $2::jsonb)")
                    .bind(ty)
                    .bind(options)
                    .execute(&mut conn)
                    .await?;
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..5))).await;
                sqlx::query("SELECT lockgate.remove_recurring('tick')").execute(&mut conn).await?;
                Ok(())
            })
            .await;
        }
    };
    let batcher = {
        let mut conn = connect().await.unwrap();
        let enqueued = enqueued.clone();
        async move {
            keep_doing("batcher", &["LG002"], 40, until, async || {
                // A batch of one job: its callback is enqueued by the batch sweep once the worker
                // has completed the job (review helper-96: into a queue a removal had counted).
                let batch: i64 = sqlx::query_scalar("SELECT lockgate.create_batch(on_finish => 'gone')")
                    .fetch_one(&mut conn)
                    .await?;
                let job: i64 = sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue('free', '{}', $1)")
                    .bind(serde_json::json!({ "batch": batch }))
                    .fetch_one(&mut conn)
                    .await?;
                enqueued.lock().unwrap().push(job);
                sqlx::query("SELECT lockgate.close_batch($1)").bind(batch).execute(&mut conn).await.map(|_| ())
            })
            .await;
        }
    };
    let worker = {
        let mut conn = connect().await.unwrap();
        let completed = completed.clone();
        async move {
            keep_doing("worker", &["LG001", "42P01", "42883"], 2, until, async || {
                for queue in ["qx", "qhome"] {
                    let claimed: Vec<(i64, i32, i64)> = sqlx::query_as(
                        "SELECT msg_id, read_ct, COALESCE((headers->>'job_id')::bigint, msg_id) FROM lockgate.claim($1, 8, 30)",
                    )
                    .bind(queue)
                    .fetch_all(&mut conn)
                    .await?;
                    let (mut ids, mut cts, mut jobs) = (Vec::new(), Vec::new(), HashMap::new());
                    for (msg_id, read_ct, job_id) in claimed {
                        if fastrand::u8(0..8) == 0 {
                            sqlx::query("SELECT lockgate.dead_letter($1, $2, $3, 'attempts_exhausted', 'boom', 1)")
                                .bind(queue)
                                .bind(msg_id)
                                .bind(read_ct)
                                .execute(&mut conn)
                                .await?;
                        } else {
                            ids.push(msg_id);
                            cts.push(read_ct);
                            jobs.insert(msg_id, job_id);
                        }
                    }
                    let archived: Vec<i64> = sqlx::query_scalar("SELECT * FROM lockgate.complete($1, $2, $3)")
                        .bind(queue)
                        .bind(&ids)
                        .bind(&cts)
                        .fetch_all(&mut conn)
                        .await?;
                    let mut completed = completed.lock().unwrap();
                    for msg_id in archived {
                        *completed.entry(jobs[&msg_id]).or_default() += 1;
                    }
                }
                Ok(())
            })
            .await;
        }
    };
    let retrier = {
        let mut conn = connect().await.unwrap();
        async move {
            keep_doing("retrier", &[], 20, until, async || {
                sqlx::query("SELECT * FROM lockgate.dlq_retry(NULL, NULL)").execute(&mut conn).await?;
                sqlx::query("SELECT * FROM lockgate.batch_sweep()").execute(&mut conn).await?;
                sqlx::query("SELECT * FROM lockgate.sweep()").execute(&mut conn).await.map(|_| ())
            })
            .await;
        }
    };
    let operator = {
        let mut conn = connect().await.unwrap();
        let retired = retired.clone();
        async move {
            keep_doing("operator", &["55006", "55P03"], 2, until, async || {
                let (retire, again, which) = if fastrand::bool() {
                    ("SELECT lockgate.drop_queue('qx')", "SELECT lockgate.create_queue('qx')", 0)
                } else {
                    (
                        "SELECT lockgate.remove_job_type('gone')",
                        "SELECT lockgate.define_job_type('gone', queue => 'qhome')",
                        1,
                    )
                };
                let done: bool = sqlx::query_scalar(retire).fetch_one(&mut conn).await?;
                if done {
                    retired.lock().unwrap()[which] += 1;
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..30))).await;
                    sqlx::query(again).execute(&mut conn).await?;
                }
                Ok(())
            })
            .await;
        }
    };
    tokio::join!(producers.0, producers.1, definer, batcher, worker, retrier, operator);
    nothing_dangles(&db, "after the schedule").await;

    // Drained: every dead letter retried, every job claimed and completed, until nothing is left.
    sqlx::raw_sql("SELECT lockgate.create_queue('qx'); SELECT lockgate.define_job_type('gone', queue => 'qhome');")
        .execute(&db.pool)
        .await
        .unwrap();
    let drained = wait_for("the drain", Duration::from_secs(30), || async {
        sqlx::query("SELECT * FROM lockgate.dlq_retry(NULL, NULL)").execute(&db.pool).await?;
        sqlx::query("SELECT * FROM lockgate.batch_sweep()").execute(&db.pool).await?;
        sqlx::query("SELECT * FROM lockgate.sweep()").execute(&db.pool).await?;
        for queue in ["qx", "qhome"] {
            let claimed: Vec<(i64, i32, i64)> = sqlx::query_as(
                "SELECT msg_id, read_ct, COALESCE((headers->>'job_id')::bigint, msg_id) FROM lockgate.claim($1, 50, 30)",
            )
            .bind(queue)
            .fetch_all(&db.pool)
            .await?;
            let jobs: HashMap<i64, i64> = claimed.iter().map(|c| (c.0, c.2)).collect();
            let archived: Vec<i64> = sqlx::query_scalar("SELECT * FROM lockgate.complete($1, $2, $3)")
                .bind(queue)
                .bind(claimed.iter().map(|c| c.0).collect::<Vec<_>>())
                .bind(claimed.iter().map(|c| c.1).collect::<Vec<_>>())
                .fetch_all(&db.pool)
                .await?;
            let mut completed = completed.lock().unwrap();
            for msg_id in archived {
                *completed.entry(jobs[&msg_id]).or_default() += 1;
            }
        }
        let left = db
            .count(
                "SELECT 1 FROM pgmq.q_qx UNION ALL SELECT 1 FROM pgmq.q_qhome UNION ALL SELECT 1 FROM lockgate.parked
                 UNION ALL SELECT 1 FROM lockgate.dead_letters",
            )
            .await?;
        Ok((left == 0).then_some(()))
    })
    .await;
    if let Err(e) = drained {
        let left: Vec<String> = sqlx::query_scalar(
            "SELECT 'qx ' || m.msg_id || ' ' || m.read_ct || ' ' || m.vt || ' ' || m.headers FROM pgmq.q_qx m
             UNION ALL SELECT 'qhome ' || m.msg_id || ' ' || m.headers FROM pgmq.q_qhome m
             UNION ALL SELECT 'parked ' || row_to_json(p)::text FROM lockgate.parked p
             UNION ALL SELECT 'dead ' || row_to_json(d)::text FROM lockgate.dead_letters d
             UNION ALL SELECT 'lease ' || row_to_json(l)::text FROM lockgate.leases l
             UNION ALL SELECT 'semaphore ' || row_to_json(x)::text FROM lockgate.semaphores x",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        panic!("{e}; left:\n{}", left.join("\n"));
    }
    nothing_dangles(&db, "after the drain").await;
    let enqueued = enqueued.lock().unwrap().clone();
    let completed = completed.lock().unwrap().clone();
    let retired = *retired.lock().unwrap();
    let lost: Vec<i64> = enqueued.iter().copied().filter(|id| !completed.contains_key(id)).collect();
    let twice: Vec<(i64, u32)> = completed.iter().filter(|(_, n)| **n > 1).map(|(id, n)| (*id, *n)).collect();
    eprintln!(
        "retire chaos: {} jobs enqueued, {} completed, queue dropped {} times, type removed {} times",
        enqueued.len(),
        completed.len(),
        retired[0],
        retired[1]
    );
    assert!(lost.is_empty(), "jobs enqueued and never completed: {lost:?}");
    assert!(twice.is_empty(), "jobs completed more than once: {twice:?}");
    assert!(retired[0] > 0 && retired[1] > 0, "the schedule retired nothing: {retired:?}");
}

/// Review of §91 (helper-97, F1): a removal lists the queues, then counts the type's jobs in each
/// table; a queue dropped in between (any queue, unrelated to the type) failed the removal with
/// the database's "relation does not exist". A table gone since the list has nothing to count.
#[tokio::test]
async fn a_removal_meeting_a_queue_dropped_during_its_count_goes_on() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql("SELECT lockgate.define_job_type('gone', queue => 'qa'); SELECT lockgate.create_queue('qz');")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut operator = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.drop_queue('qz');").execute(&mut operator).await.unwrap();
    let removal = spawn_sql(&db, "SELECT lockgate.remove_job_type('gone')");
    waiting_on_a_lock(&db, "the removal to wait at qz's table", "%remove_job_type%").await;
    sqlx::query("COMMIT").execute(&mut operator).await.unwrap();
    removal.await.unwrap().expect("the removal goes on past the dropped queue");
    assert_eq!(db.count("SELECT 1 FROM lockgate.job_types").await.unwrap(), 0);
}

/// Review of §90 (helper-97, F2): the drop took the queue's archive only at pgmq.drop_queue's
/// DROP TABLE, waiting there while it held lockgate.parked: a transaction reading the archive
/// stalled parking in every queue for the drop's whole budget, and one that then parked closed a
/// deadlock (a producer in another queue could be its victim). The archive is now tried with
/// NOWAIT beside the table, all or none, so parking elsewhere goes on while the drop waits.
#[tokio::test]
async fn a_reader_of_the_archive_stalls_no_parking_while_a_drop_waits_for_it() {
    let db = TestDb::migrated().await.unwrap();
    hold_a_key_for_qa(&db).await;
    sqlx::query("SELECT lockgate.create_queue('qidle')").execute(&db.pool).await.unwrap();
    let mut reader = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT count(*) FROM pgmq.a_qidle;").execute(&mut reader).await.unwrap();
    let drop = spawn_drop(&db, "qidle");
    drop_trying(&db).await;
    let started = std::time::Instant::now();
    let parked: String = sqlx::query_scalar("SELECT status FROM lockgate.enqueue('lim', '{\"k\": 1}')")
        .fetch_one(&db.pool)
        .await
        .expect("the park lands");
    assert_eq!(parked, "parked");
    assert!(started.elapsed() < Duration::from_secs(1), "the park waited {:?} for the drop", started.elapsed());
    assert!(!drop.is_finished(), "the drop still waits for the archive's reader");
    sqlx::query("COMMIT").execute(&mut reader).await.unwrap();
    assert!(drop.await.unwrap().expect("the drop goes through once the reader is done"));
}

/// Review of §91 (helper-97, F3, F4): a removal that cannot lock the type's row (an open
/// transaction created a batch calling it back) says so in its own words, not the database's bare
/// lock timeout; and a refusal names the first ten of what holds it, and how many more.
#[tokio::test]
async fn a_removal_names_its_lock_wait_and_lists_ten_uses() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('report', queue => 'qa')").execute(&db.pool).await.unwrap();
    let mut producer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT lockgate.create_batch(on_finish => 'report');").execute(&mut producer).await.unwrap();
    let mut operator = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("SET lock_timeout = '200ms'").execute(&mut operator).await.unwrap();
    let refused = sqlx::query("SELECT lockgate.remove_job_type('report')").execute(&mut operator).await.unwrap_err();
    let db_err = refused.as_database_error().expect("a database error");
    assert_eq!(db_err.code().as_deref(), Some("55P03"), "{db_err}");
    assert!(db_err.message().starts_with("lockgate: could not lock job type \"report\" within 200ms"), "{db_err}");
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    sqlx::query("SELECT lockgate.create_batch(on_finish => 'report') FROM generate_series(1, 11)")
        .execute(&db.pool)
        .await
        .unwrap();
    let message = refusal(&db, "SELECT lockgate.remove_job_type('report')").await;
    assert!(message.contains("batch(es) 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 2 more."), "{message}");
}

/// Review of §91 (helper-96, F1): a removal counted the queues, then the parked jobs, then the
/// batches; a batch's callback enqueued after its queue was counted, and a parked job promoted into
/// a queue already counted, were seen nowhere, and the type went with a job of it queued. Batches
/// are now counted first and parked jobs before and after the queues. The schedule is forced:
/// queue qz's table is held, so the removal has counted qa (and qb) and waits at qz while the
/// batch's last job and the holder of the parked job's key complete.
#[tokio::test]
async fn jobs_moving_into_a_counted_queue_during_a_removal_are_counted() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('gone', queue => 'qa', concurrency_limit => 1, concurrency_key => ARRAY['k'],
                                         concurrency_duration_ms => 60000);
         SELECT lockgate.define_job_type('holder', queue => 'qb', concurrency_limit => 1, concurrency_key => ARRAY['k'],
                                         concurrency_duration_ms => 60000);
         SELECT lockgate.define_job_type('free', queue => 'qb');
         SELECT lockgate.create_queue('qz');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for case in ["callback", "promotion"] {
        if case == "callback" {
            // A closed batch of one job, whose completion enqueues the callback into qa.
            sqlx::raw_sql(
                "SELECT lockgate.create_batch(on_finish => 'gone');
                 SELECT lockgate.enqueue('free', '{}', '{\"batch\": 1}');
                 SELECT lockgate.close_batch(1);",
            )
            .execute(&db.pool)
            .await
            .unwrap();
        } else {
            // A job of `gone` parked behind key `shared`, which a job of `holder` holds.
            sqlx::raw_sql(
                "SELECT lockgate.enqueue('holder', '{}', '{\"concurrency_key\": \"shared\"}');
                 SELECT lockgate.enqueue('gone', '{}', '{\"concurrency_key\": \"shared\"}');",
            )
            .execute(&db.pool)
            .await
            .unwrap();
            assert_eq!(db.count("SELECT 1 FROM lockgate.parked").await.unwrap(), 1);
        }
        let (msg_id, read_ct): (i64, i32) = sqlx::query_as("SELECT msg_id, read_ct FROM lockgate.claim('qb', 1, 60)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
        sqlx::raw_sql("BEGIN; LOCK TABLE pgmq.q_qz IN ACCESS EXCLUSIVE MODE;").execute(&mut holder).await.unwrap();
        let removal = spawn_sql(&db, "SELECT lockgate.remove_job_type('gone')");
        waiting_on_a_lock(&db, "the removal to wait at qz", "%remove_job_type%").await;
        sqlx::query("SELECT lockgate.complete('qb', $1, $2)")
            .bind(vec![msg_id])
            .bind(vec![read_ct])
            .execute(&db.pool)
            .await
            .unwrap();
        // A finished batch's callbacks are enqueued by the batch sweep, in a transaction of its own.
        sqlx::query("SELECT lockgate.batch_sweep()").execute(&db.pool).await.unwrap();
        assert_eq!(db.count("SELECT 1 FROM pgmq.q_qa").await.unwrap(), 1, "{case}: the job of `gone` is in qa");
        sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
        let refused = removal.await.unwrap().expect_err("the removal counts the job that moved");
        assert_eq!(sqlstate(&refused), "55006", "{case}: {refused}");
        assert_eq!(db.count("SELECT 1 FROM lockgate.job_types WHERE name = 'gone'").await.unwrap(), 1, "{case}");
        sqlx::query(
            "SELECT lockgate.cancel(j.id) FROM lockgate.jobs(job_type => 'gone') j WHERE j.state <> 'cancelled'",
        )
        .execute(&db.pool)
        .await
        .unwrap();
    }
}

/// Review of §91 (helper-96, F3): a definition that waited for a type's or queue's row that was
/// removed and made again in one transaction found the old row gone and said the type or queue
/// did not exist; it looks again.
#[tokio::test]
async fn a_definition_waiting_for_a_type_removed_and_defined_again_finds_the_new_one() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql("SELECT lockgate.define_job_type('t', queue => 'qa'); SELECT lockgate.create_queue('qx');")
        .execute(&db.pool)
        .await
        .unwrap();
    for (again, define) in [
        (
            "SELECT lockgate.remove_job_type('t'); SELECT lockgate.define_job_type('t', queue => 'qa');",
            "SELECT lockgate.create_batch(on_finish => 't')",
        ),
        (
            "SELECT lockgate.remove_job_type('t'); SELECT lockgate.define_job_type('t', queue => 'qa');",
            "SELECT lockgate.define_recurring('tick', '@daily', 't')",
        ),
        (
            "SELECT lockgate.drop_queue('qx'); SELECT lockgate.create_queue('qx');",
            "SELECT lockgate.define_recurring('tock', '@daily', 't', options => '{\"queue\": \"qx\"}')",
        ),
    ] {
        let mut operator = sqlx::PgConnection::connect(&db.url).await.unwrap();
        sqlx::raw_sql(&format!("BEGIN; {again}")).execute(&mut operator).await.unwrap();
        let definition = spawn_sql(&db, define);
        waiting_on_a_lock(&db, "the definition to wait", "%lockgate.%").await;
        sqlx::query("COMMIT").execute(&mut operator).await.unwrap();
        definition.await.unwrap().unwrap_or_else(|e| panic!("{define}: {e}"));
        sqlx::raw_sql("DELETE FROM lockgate.batches; DELETE FROM lockgate.recurring_tasks;")
            .execute(&db.pool)
            .await
            .unwrap();
    }
}

/// Review helper-136 F10: a job type moved to another queue leaves its queued jobs in the old one,
/// which no pool may serve any longer: doctor names such a queue (jobs ready for longer than the
/// alive threshold, no live process serving it, not paused), and is content once a live process
/// serves it or it is paused.
#[tokio::test]
async fn doctor_names_a_queue_with_jobs_ready_that_no_live_process_serves() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::raw_sql(
        "SELECT lockgate.define_job_type('mv', queue => 'old');
         SELECT lockgate.enqueue('mv', '{}');
         SELECT lockgate.define_job_type('mv', queue => 'new');
         UPDATE pgmq.q_old SET vt = now() - interval '2 minutes';",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let unserved = async || -> Vec<(String, String)> {
        sqlx::query_as("SELECT verdict, detail FROM lockgate.doctor() WHERE check_name = 'unserved_queues'")
            .fetch_all(&db.pool)
            .await
            .unwrap()
    };
    let found = unserved().await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, "warn");
    assert!(
        found[0].1.starts_with("queue old: 1 job(s) ready, the oldest for 120 s")
            && found[0].1.ends_with("(job types defined on it now: none)"),
        "{found:?}"
    );
    // A live supervisor's worker serving it.
    sqlx::raw_sql(
        "SELECT lockgate.register_process('worker', 'workers', 'h', 1,
                                          lockgate.register_process('supervisor', 'p', 'h', 1), '{\"queues\": [\"old\"]}');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(unserved().await[0].0, "ok");
    // Its supervisor silent past the alive threshold: no longer serving.
    sqlx::query("UPDATE lockgate.processes SET last_heartbeat_at = now() - interval '5 minutes'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(unserved().await[0].0, "warn");
    sqlx::query("SELECT lockgate.pause_queue('old')").execute(&db.pool).await.unwrap();
    assert_eq!(unserved().await[0].0, "ok", "a paused queue waits on purpose");
}

/// Review helper-144 F3: a queue whose table was dropped outside lockgate (`pgmq.drop_queue`) is
/// made again by `lockgate.create_queue`, as doctor and `dlq retry` say to do: its dead letters can
/// then be retried, their messages numbered above every id there was. Before, `create_queue`
/// found the queue's row and returned, doing nothing, and no lockgate command brought it back.
#[tokio::test]
async fn create_queue_makes_a_dropped_table_again_and_its_dead_letters_run() {
    let db = TestDb::migrated().await.unwrap();
    sqlx::query("SELECT lockgate.define_job_type('t', queue => 'qx')").execute(&db.pool).await.unwrap();
    let job: i64 =
        sqlx::query_scalar("SELECT job_id FROM lockgate.enqueue('t', '{\"n\": 1}')").fetch_one(&db.pool).await.unwrap();
    sqlx::query(
        "INSERT INTO lockgate.dead_letters (queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at)
         VALUES ('qx', $1, $1, 't', '{\"n\": 1}', jsonb_build_object('type', 't', 'job_id', $1), 'attempts_exhausted', 'failed', 1, now())",
    )
    .bind(job)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("SELECT pgmq.drop_queue('qx')").execute(&db.pool).await.unwrap();
    let retry = "SELECT status FROM lockgate.dlq_retry('qx', NULL, true)";
    let kept: String = sqlx::query_scalar(retry).fetch_one(&db.pool).await.unwrap();
    assert_eq!(kept, "queue_missing");
    sqlx::query("SELECT lockgate.create_queue('qx')").execute(&db.pool).await.unwrap();
    let retried: String = sqlx::query_scalar(retry).fetch_one(&db.pool).await.unwrap();
    assert_ne!(retried, "queue_missing");
    let (msg_id, job_id): (i64, i64) =
        sqlx::query_as("SELECT msg_id, (headers->>'job_id')::bigint FROM pgmq.q_qx").fetch_one(&db.pool).await.unwrap();
    assert!(msg_id > job, "a new id, above the dropped message's ({msg_id} after {job})");
    assert_eq!(job_id, job, "the job keeps its id");
    let broken: i64 =
        sqlx::query_scalar("SELECT count(*) FROM lockgate.check_invariants()").fetch_one(&db.pool).await.unwrap();
    assert_eq!(broken, 0);
}
