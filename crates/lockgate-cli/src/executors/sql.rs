//! The SQL executor: runs one configured statement with the job's arguments bound as `$1`
//! (jsonb), in its own transaction. The statement is fixed by the operator's config; job data
//! only ever arrives as a bound value.

use std::future::Future;
use std::pin::Pin;

use lockgate::sql::pooler::query_scalar;
use lockgate::{JobContext, JobError, PgPool, RawHandler, RunHold};
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::postgres::PgConnection;
use sqlx::postgres::PgTypeInfo;
use sqlx::{Connection as _, Executor as _, Statement as _};

/// Whether `statement` prepares against the database (tables and columns exist, the syntax is
/// right), with `$1` typed as the jsonb it is bound as and no other parameter.
///
/// Directly, it is prepared as the executor runs it (the protocol's prepare, which takes `CALL`
/// and other utility statements too). Through a transaction-mode pooler the server is the
/// transaction's and may hold other clients' named statements (sqlx's `sqlx_s_N` among them),
/// which the protocol's named prepare collided with (review helper-81): there it is prepared with
/// SQL's `PREPARE`, under a name of its own, and deallocated in the same transaction; `PREPARE`
/// takes only queries (SELECT, INSERT, UPDATE, DELETE, MERGE, VALUES), so another statement is
/// run unchecked there, with a warning (review helper-82). A table the statement names may be
/// locked by another transaction (an ALTER TABLE left open): the check waits `PREPARE_LOCK_WAIT`
/// for it, then fails naming the lock rather than hanging the start.
pub async fn check(db: &PgPool, statement: &str) -> anyhow::Result<()> {
    // Both prepare (review helper-110): an empty statement ran as nothing and every job of its
    // type succeeded; a `BEGIN` left its pooled session in a transaction that the next jobs' writes
    // joined and lost when the session was closed, each of them reported as succeeded.
    if blank(statement) {
        anyhow::bail!(
            "its sql statement is empty (white space and comments only): every job would succeed doing nothing"
        );
    }
    let keyword = first_keyword(statement);
    if TRANSACTION_CONTROL.contains(&keyword.as_str()) {
        anyhow::bail!(
            "its sql statement is transaction control ({}): a job's statement runs in the transaction lockgate \
             gives it, and one it left open would take in the writes of the jobs after it on the same connection",
            keyword.to_ascii_uppercase()
        );
    }
    let mut tx = db.begin().await?;
    let budget = format!("SET LOCAL lock_timeout = '{}ms'", PREPARE_LOCK_WAIT.as_millis());
    sqlx::query(&budget).persistent(false).execute(&mut *tx).await?;
    let prepared = if lockgate::pooler::transaction_pooling() {
        prepare_by_name(&mut tx, statement).await
    } else {
        prepare_by_protocol(&mut tx, statement).await
    };
    let parameters = match prepared {
        Ok(Some(parameters)) => parameters,
        Ok(None) => {
            tracing::warn!(
                statement,
                "this sql statement is not a query, which cannot be checked through a transaction-mode pooler: \
                 it runs unchecked"
            );
            0
        }
        Err(err) => {
            let database = err.as_database_error();
            if database.and_then(|db| db.code()).as_deref() == Some("55P03") {
                anyhow::bail!(
                    "its sql statement could not be checked: a table it uses stayed locked by another transaction \
                     for {} s",
                    PREPARE_LOCK_WAIT.as_secs()
                );
            }
            // Another client's prepared statement met on the server: the URL goes through a
            // transaction-mode pooler without saying so, not a fault of the statement (review
            // helper-136 F5). Returned as the driver's error, so that `main` adds its hint.
            if matches!(database.and_then(|db| db.code()).as_deref(), Some("42P05" | "26000"))
                && !lockgate::sql::pooler::transaction_pooling()
            {
                return Err(anyhow::Error::from(err).context("its sql statement could not be checked"));
            }
            let cause = database.map_or_else(|| err.to_string(), |db| db.message().to_string());
            anyhow::bail!("its sql statement does not prepare: {cause}");
        }
    };
    tx.rollback().await?;
    if parameters > 1 {
        anyhow::bail!(
            "its sql statement has {parameters} parameters: only $1 is bound, to the job's arguments (jsonb); \
             read the others from it, e.g. ($1->>'id')::bigint"
        );
    }
    Ok(())
}

/// The protocol's prepare, as the executor's statements are prepared; the statement closed again.
/// Returns how many parameters it takes.
async fn prepare_by_protocol(conn: &mut PgConnection, statement: &str) -> Result<Option<usize>, sqlx::Error> {
    // $1 declared whether or not the text shows it (a statement naming only $2 is told what is
    // bound, not that $1's type is unknown; review helper-83).
    let prepared = conn.prepare_with(statement, &[PgTypeInfo::with_name("jsonb")]).await?;
    let parameters = match prepared.parameters() {
        Some(sqlx::Either::Left(types)) => types.len(),
        Some(sqlx::Either::Right(count)) => count,
        None => 0,
    };
    conn.clear_cached_statements().await?;
    Ok(Some(parameters))
}

/// SQL's `PREPARE` under a name of this process's own, deallocated before the transaction ends;
/// `None` for a statement that is not a query, which `PREPARE` does not take. Returns how many
/// parameters it takes.
async fn prepare_by_name(conn: &mut PgConnection, statement: &str) -> Result<Option<usize>, sqlx::Error> {
    const QUERIES: [&str; 8] = ["select", "insert", "update", "delete", "merge", "values", "with", "table"];
    if !QUERIES.contains(&first_keyword(statement).as_str()) {
        return Ok(None);
    }
    let name = format!("lockgate_check_{}_{}", std::process::id(), CHECKS.fetch_add(1, Ordering::Relaxed));
    sqlx::query(&format!("PREPARE {name} (jsonb) AS {statement}")).persistent(false).execute(&mut *conn).await?;
    let count: i32 =
        sqlx::query_scalar("SELECT cardinality(parameter_types) FROM pg_prepared_statements WHERE name = $1")
            .persistent(false)
            .bind(&name)
            .fetch_one(&mut *conn)
            .await?;
    sqlx::query(&format!("DEALLOCATE {name}")).persistent(false).execute(&mut *conn).await?;
    Ok(Some(usize::try_from(count).unwrap_or(0)))
}

/// The statement's first keyword, lowercased, past white space, comments (block comments nest, as
/// PostgreSQL reads them) and opening parentheses.
fn first_keyword(statement: &str) -> String {
    let rest = past_comments(statement, |c| c.is_whitespace() || c == '(');
    rest.chars().take_while(char::is_ascii_alphabetic).collect::<String>().to_ascii_lowercase()
}

/// `statement` past its leading comments and the characters `skipped` takes.
fn past_comments(statement: &str, skipped: impl Fn(char) -> bool) -> &str {
    let mut rest = statement;
    loop {
        rest = rest.trim_start_matches(&skipped);
        if let Some(line) = rest.strip_prefix("--") {
            rest = line.split_once('\n').map_or("", |(_, after)| after);
        } else if rest.starts_with("/*") {
            rest = past_block_comment(rest);
        } else {
            return rest;
        }
    }
}

/// The first keywords of the statements that begin or end transactions, and of savepoints.
const TRANSACTION_CONTROL: [&str; 8] = ["begin", "start", "commit", "end", "rollback", "abort", "savepoint", "release"];

/// Whether `statement` holds nothing but white space, comments and semicolons.
fn blank(statement: &str) -> bool {
    past_comments(statement, |c| c.is_whitespace() || c == ';').is_empty()
}

/// `text` past the block comment it starts with, nested ones included ("" when it never ends).
fn past_block_comment(text: &str) -> &str {
    let mut depth = 0usize;
    let mut i = 0;
    let bytes = text.as_bytes();
    while i + 1 < bytes.len() {
        match (bytes[i], bytes[i + 1]) {
            (b'/', b'*') => {
                depth += 1;
                i += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return &text[i..];
                }
            }
            _ => i += 1,
        }
    }
    ""
}

/// Names of the checks' prepared statements, unique in this process.
static CHECKS: AtomicU64 = AtomicU64::new(0);

/// How long the start-up check of a statement waits for a lock on a table it names.
const PREPARE_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

pub struct SqlExecutor {
    db: PgPool,
    statement: String,
}

/// How often the server checks, while the statement runs, that lockgate's end of the connection
/// is still open (`client_connection_check_interval`, PostgreSQL 14 and later).
const CLIENT_CHECK: &str = "100ms";

/// How long a cancelled statement may take to end before its backend is terminated.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_millis(30);

/// How often a terminated backend's exit is looked for.
const EXIT_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// How long a cancelled statement's reply is waited for before the server is asked, on another
/// connection, whether a backend still carries the statement's mark.
const REPLY_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// How often a running statement's backend is looked at, on another connection: a statement the
/// server no longer runs twice in a row, with no reply meanwhile, lost its reply.
const REPLY_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

impl SqlExecutor {
    pub fn new(db: PgPool, statement: String) -> Self {
        Self { db, statement }
    }

    async fn run(&self, ctx: JobContext, args: Value) -> Result<(), JobError> {
        // Held until the statement has ended on the server: the handler is not aborted while its
        // backend may still run it (a statement that checks for interrupts only now and then
        // outlives the handler's grace), and nothing is written for the job before (review
        // helper-104, design §95).
        let hold = ctx.hold();
        let mut conn = self.db.acquire().await?;
        // In a transaction of its own under transaction pooling (the pooled path of
        // lockgate_sql::pooler), so that the statement and the backend pid it is cancelled by are
        // the same server's; on its own connection otherwise.
        if lockgate::pooler::transaction_pooling() {
            let mut tx = conn.begin().await?;
            let ran = self.watched(&mut tx, &ctx, &hold, args, true).await;
            match ran {
                Ok(()) => tx.commit().await?,
                Err(Stopped::Terminated(e)) => {
                    drop(tx);
                    conn.close_on_drop();
                    return Err(e);
                }
                Err(Stopped::Failed(e)) => {
                    let _ = tx.rollback().await;
                    return Err(e);
                }
            }
        } else {
            let ran = self.watched(&mut conn, &ctx, &hold, args, false).await;
            if let Err(Stopped::Terminated(e)) = ran {
                // Its backend is gone: the connection is closed, not given back to be tested.
                conn.close_on_drop();
                return Err(e);
            }
            // The backend's mark (lockgate.start_statement) goes with the statement: left on a
            // connection lent to other work, it would have that work's backend ended when the job is
            // delivered again. A connection that cannot say it is unmarked is not lent again.
            if let Err(e) = sqlx::query("RESET application_name").execute(&mut *conn).await {
                tracing::debug!(error = %e, "an sql job's connection could not be unmarked: it is closed");
                conn.close_on_drop();
            }
            let Err(Stopped::Failed(e)) = ran else {
                return Ok(());
            };
            // A session that is read-only (its database or role made it so when it began, and
            // it stays so whatever the server does since) is closed, not given back: every job
            // lent it would fail (review helper-90). One statement, on failures only.
            let read_only = query_scalar::<bool>("SELECT current_setting('transaction_read_only') = 'on'")
                .fetch_one(&mut *conn)
                .await
                .unwrap_or(false);
            if read_only {
                let _ = conn.close().await;
            }
            return Err(e);
        }
        Ok(())
    }

    /// Runs the statement so that it never outlives the attempt on the server. Dropping a query
    /// stops nothing there: the backend ran it to its end, beside the job's retry or next
    /// delivery (for a key limited to 1, two at once). So a cancelled attempt (its timeout, a
    /// lapsing lease, shutdown, an operator's cancel) cancels the statement on its backend and
    /// returns only once it has ended; and the backend checks that lockgate is still connected,
    /// so a killed lockgate's statement is stopped too (design §76).
    async fn watched(
        &self,
        conn: &mut PgConnection,
        ctx: &JobContext,
        hold: &RunHold,
        args: Value,
        local: bool,
    ) -> Result<(), Stopped> {
        // The backend is marked as running this delivery's statement, so that a sweep or claim that
        // takes the job from this process while it is frozen or cut off ends the statement first
        // (design §100); a delivery that no longer owns its job starts nothing.
        let check = conn.server_version_num().is_some_and(|v| v >= 140_000);
        let started: Option<i32> = if check {
            query_scalar(
                "SELECT lockgate.start_statement($3, $4, $5, $2) \
                   FROM set_config('client_connection_check_interval', $1, $2)",
            )
            .bind(CLIENT_CHECK)
            .bind(local)
            .bind(&ctx.queue)
            .bind(ctx.msg_id)
            .bind(ctx.read_ct)
            .fetch_one(&mut *conn)
            .await?
        } else {
            query_scalar("SELECT lockgate.start_statement($1, $2, $3, $4)")
                .bind(&ctx.queue)
                .bind(ctx.msg_id)
                .bind(ctx.read_ct)
                .bind(local)
                .fetch_one(&mut *conn)
                .await?
        };
        let Some(backend) = started else {
            return Err(Stopped::Failed(JobError::new(
                "its statement was not started: the delivery no longer holds the job (its visibility ran out, \
                 or it was delivered again)",
            )));
        };
        hold.describe(format!("the statement on backend {backend}"));
        let query = lockgate::sql::pooler::query(&self.statement);
        let query = if self.statement.contains("$1") { query.bind(args) } else { query };
        let running = query.execute(&mut *conn);
        tokio::pin!(running);
        tokio::select! {
            biased;
            ran = &mut running => {
                ran?;
                return Ok(());
            }
            () = ctx.cancelled() => {}
            () = self.reply_lost(backend, ctx) => {
                // The server ran the statement, and its reply never came (a connection the network
                // dropped without a reset): awaited for good, the attempt, its key and the
                // process's shutdown waited for good (review helper-142 F8). Its backend is ended
                // (an open transaction of it rolls back), and the attempt fails: its outcome is
                // unknown, so the job runs again, as after any lost reply. Should the reply come
                // after all, it is the attempt's outcome.
                if let Some(ran) = self.reply_or_backend_gone(backend, ctx, &mut running).await {
                    ran?;
                    return Ok(());
                }
                tracing::warn!(backend, "an SQL job's statement ended on the server but its reply never came: its connection is given up");
                return Err(Stopped::Terminated(JobError::new(
                    "its statement ended on the server, but its connection gave no answer (dropped by the network?): \
                     its outcome is unknown",
                )));
            }
        }
        let reason = ctx.cancel_reason().map_or_else(|| "cancelled".to_string(), |r| r.to_string());
        // Each signal and look runs in a transaction of its own under a pooler (review helper-106:
        // sent as two exchanges outside one, a pooler split them across servers, and the
        // statement ran on to its end).
        if let Err(e) = lockgate::sql::signal_backend(&self.db, backend, false).await {
            tracing::warn!(backend, error = %e, "a cancelled job's SQL statement could not be cancelled on the server");
        }
        // Ends with the cancel's error, or with the statement's own result had it just finished.
        // A statement may catch the cancel (plpgsql's `EXCEPTION WHEN query_canceled`) and run
        // on: past a short wait its backend is terminated, which no statement can catch (review
        // helper-78).
        let error = JobError::new(format!("its statement was cancelled ({reason})"));
        if tokio::time::timeout(CANCEL_WAIT, &mut running).await.is_err() {
            // The backend's start, so that its exit is not confused with a new backend given its
            // pid (under a pooler, one that may live for hours).
            let started = self.until_answered(ctx, || lockgate::sql::backend_start(&self.db, backend)).await.flatten();
            let terminated = self.until_answered(ctx, || lockgate::sql::signal_backend(&self.db, backend, true)).await;
            if terminated != Some(true) {
                tracing::warn!(
                    backend,
                    "a cancelled job's SQL statement could not be ended on the server: it is waited for until it ends"
                );
            }
            // Resolves once the backend has sent its termination (or the statement has ended by
            // itself, if the terminate could not be sent). A terminated backend exits just after
            // (its transaction, and the locks it held, end on the way): waited for, so the next
            // run of the job or its key never meets it still running (review helper-104). One not
            // terminated stays ours, idle: its connection is closed instead (review helper-108).
            // A connection whose flow the network dropped never answers: awaited for good, it held
            // a slot of the pool, and the process's shutdown, for good (review helper-142 F1).
            if self.reply_or_backend_gone(backend, ctx, &mut running).await.is_none() {
                tracing::warn!(
                    backend,
                    "a cancelled job's SQL statement gave no answer on its connection, and no backend runs it any \
                     more: its connection is given up"
                );
                return Err(Stopped::Terminated(error));
            }
            if let (Some(true), Some(started)) = (terminated, started) {
                tracing::info!(backend, "a cancelled job's SQL statement would not end: its backend was terminated");
                while self
                    .until_answered(ctx, || lockgate::sql::backend_listed(&self.db, backend, started))
                    .await
                    .unwrap_or(false)
                {
                    tokio::time::sleep(EXIT_POLL).await;
                }
            }
            return Err(Stopped::Terminated(error));
        }
        Err(Stopped::Failed(error))
    }
}

impl SqlExecutor {
    /// Resolves once the server has shown, twice in a row `REPLY_CHECK` apart, that backend `pid`
    /// no longer runs this job's statement: while its reply has not come, it was lost. A look that
    /// fails (the server out of reach) proves nothing and starts over.
    async fn reply_lost(&self, pid: i32, ctx: &JobContext) {
        let mut not_running = 0;
        while not_running < 2 {
            tokio::time::sleep(REPLY_CHECK).await;
            match lockgate::sql::backend_runs_statement(&self.db, pid, &ctx.queue, ctx.msg_id).await {
                Ok(false) => not_running += 1,
                _ => not_running = 0,
            }
        }
    }

    /// Waits for the statement's reply (`running`) and, each `REPLY_WAIT` it has not come, asks
    /// the server, on another connection, to end backend `pid` while it carries this job's mark:
    /// the reply, or `None` once no backend carries the mark (a reply that will never come, its
    /// flow dropped by the network, is then given up with its connection). It never gives up
    /// while that backend carries the mark.
    async fn reply_or_backend_gone<F: Future + Unpin>(
        &self,
        pid: i32,
        ctx: &JobContext,
        running: &mut F,
    ) -> Option<F::Output> {
        loop {
            tokio::select! {
                biased;
                ran = &mut *running => return Some(ran),
                () = tokio::time::sleep(REPLY_WAIT) => {}
            }
            if lockgate::sql::end_marked_backend(&self.db, pid, &ctx.queue, ctx.msg_id).await.is_ok_and(|gone| gone) {
                return None;
            }
        }
    }

    /// Asks `question` until it is answered, or until the attempt's lease has run out (then the
    /// job may run elsewhere whatever this process waits for, and `None` is returned): a question
    /// that failed on a blip must not be taken for an answer (review helper-106). An error that is
    /// no blip (a permission refused) is not asked again (review helper-108).
    async fn until_answered<T, F, Fut>(&self, ctx: &JobContext, question: F) -> Option<T>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, lockgate::DbError>>,
    {
        let lease = ctx.lease_ends();
        loop {
            match question().await {
                Ok(answer) => return Some(answer),
                Err(e) if e.is_transient() && std::time::Instant::now() < *lease.borrow() => {
                    tracing::debug!(error = %e, "asking about a cancelled job's backend again");
                    tokio::time::sleep(EXIT_POLL * 10).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not learn whether a cancelled job's backend has ended");
                    return None;
                }
            }
        }
    }
}

/// How a watched statement did not succeed.
enum Stopped {
    /// It failed, or was cancelled and ended: its connection is usable.
    Failed(JobError),
    /// Its backend was terminated (the statement would not end on cancel): the connection is dead.
    Terminated(JobError),
}

impl<E: Into<JobError>> From<E> for Stopped {
    fn from(e: E) -> Self {
        Self::Failed(e.into())
    }
}

impl RawHandler for SqlExecutor {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(self.run(ctx, args))
    }
}

#[cfg(test)]
mod tests {
    use super::{blank, first_keyword};

    #[test]
    fn a_statement_of_space_comments_and_semicolons_is_blank() {
        for text in ["", "  \n\t", ";", "-- TODO write it $1", "/* a /* nested */ one */ ;\n-- and a line"] {
            assert!(blank(text), "{text:?}");
        }
        for text in ["SELECT 1", "-- a comment\nSELECT $1", "/* c */ INSERT INTO t VALUES ($1)", "'x'", "("] {
            assert!(!blank(text), "{text:?}");
        }
    }

    #[test]
    fn the_first_keyword_is_read_past_space_comments_and_parentheses() {
        assert_eq!(first_keyword("  INSERT INTO t VALUES ($1)"), "insert");
        assert_eq!(first_keyword("-- note\n/* block */ (SELECT 1)"), "select");
        assert_eq!(first_keyword("CALL p($1)"), "call");
        assert_eq!(first_keyword("-- only a comment"), "");
        assert_eq!(first_keyword("/* /* */ SELECT */ CALL p()"), "call");
        assert_eq!(first_keyword("/* never ends"), "");
    }
}
