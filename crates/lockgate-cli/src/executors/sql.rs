//! The SQL executor: runs one configured statement with the job's arguments bound as `$1`
//! (jsonb), in its own transaction. The statement is fixed by the operator's config; job data
//! only ever arrives as a bound value.

use std::future::Future;
use std::pin::Pin;

use lockgate::sql::pooler::query_scalar;
use lockgate::{JobContext, JobError, PgPool, RawHandler};
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::postgres::PgConnection;
use sqlx::Connection as _;

/// Whether `statement` prepares against the database (tables and columns exist, the syntax is
/// right), with `$1` typed as the jsonb it is bound as.
///
/// It is prepared with SQL's `PREPARE`, under a name of its own, sent as one unnamed statement
/// and deallocated in the same transaction: through a transaction-mode pooler the server is the
/// transaction's and may hold other clients' named statements (sqlx's `sqlx_s_N` among them),
/// which a driver-level prepare collided with (review helper-81). A table the statement names may
/// be locked by another transaction (an ALTER TABLE left open): the check waits
/// `PREPARE_LOCK_WAIT` for it, then fails naming the lock rather than hanging the start.
pub async fn check(db: &PgPool, statement: &str) -> anyhow::Result<()> {
    let parameters = if statement.contains("$1") { " (jsonb)" } else { "" };
    let name = format!("lockgate_check_{}_{}", std::process::id(), CHECKS.fetch_add(1, Ordering::Relaxed));
    let mut tx = db.begin().await?;
    let budget = format!("SET LOCAL lock_timeout = '{}ms'", PREPARE_LOCK_WAIT.as_millis());
    sqlx::query(&budget).persistent(false).execute(&mut *tx).await?;
    let prepare = format!("PREPARE {name}{parameters} AS {statement}");
    if let Err(err) = sqlx::query(&prepare).persistent(false).execute(&mut *tx).await {
        let database = err.as_database_error();
        if database.and_then(|db| db.code()).as_deref() == Some("55P03") {
            anyhow::bail!(
                "its sql statement could not be checked: a table it uses stayed locked by another transaction for {} s",
                PREPARE_LOCK_WAIT.as_secs()
            );
        }
        let cause = database.map_or_else(|| err.to_string(), |db| db.message().to_string());
        anyhow::bail!("its sql statement does not prepare: {cause}");
    }
    sqlx::query(&format!("DEALLOCATE {name}")).persistent(false).execute(&mut *tx).await?;
    tx.rollback().await?;
    Ok(())
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

impl SqlExecutor {
    pub fn new(db: PgPool, statement: String) -> Self {
        Self { db, statement }
    }

    async fn run(&self, ctx: JobContext, args: Value) -> Result<(), JobError> {
        let mut conn = self.db.acquire().await?;
        // In a transaction of its own under transaction pooling (the pooled path of
        // lockgate_sql::pooler), so that the statement and the backend pid it is cancelled by are
        // the same server's; on its own connection otherwise.
        if lockgate::pooler::transaction_pooling() {
            let mut tx = conn.begin().await?;
            let ran = self.watched(&mut tx, &ctx, args, true).await;
            match ran {
                Ok(()) => tx.commit().await?,
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(e);
                }
            }
        } else {
            self.watched(&mut conn, &ctx, args, false).await?;
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
        args: Value,
        local: bool,
    ) -> Result<(), JobError> {
        let check = conn.server_version_num().is_some_and(|v| v >= 140_000);
        let backend: i32 = if check {
            query_scalar("SELECT pg_backend_pid() FROM set_config('client_connection_check_interval', $1, $2)")
                .bind(CLIENT_CHECK)
                .bind(local)
                .fetch_one(&mut *conn)
                .await?
        } else {
            query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *conn).await?
        };
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
        }
        let reason = ctx.cancel_reason().map_or_else(|| "cancelled".to_string(), |r| r.to_string());
        let cancelled = query_scalar::<bool>("SELECT pg_cancel_backend($1)").bind(backend).fetch_one(&self.db).await;
        if let Err(e) = cancelled {
            tracing::warn!(backend, error = %e, "a cancelled job's SQL statement could not be cancelled on the server");
        }
        // Ends with the cancel's error, or with the statement's own result had it just finished.
        // A statement may catch the cancel (plpgsql's `EXCEPTION WHEN query_canceled`) and run
        // on: past a short wait its backend is terminated, which no statement can catch (review
        // helper-78). Both fit in the handler's grace.
        if tokio::time::timeout(CANCEL_WAIT, &mut running).await.is_err() {
            let terminated =
                query_scalar::<bool>("SELECT pg_terminate_backend($1)").bind(backend).fetch_one(&self.db).await;
            if let Err(e) = terminated {
                tracing::warn!(backend, error = %e, "a cancelled job's SQL statement could not be ended on the server");
            }
            let _ = running.await;
        }
        Err(JobError::new(format!("its statement was cancelled ({reason})")))
    }
}

impl RawHandler for SqlExecutor {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(self.run(ctx, args))
    }
}
