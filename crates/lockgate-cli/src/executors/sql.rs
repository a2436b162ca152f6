//! The SQL executor: runs one configured statement with the job's arguments bound as `$1`
//! (jsonb), in its own transaction. The statement is fixed by the operator's config; job data
//! only ever arrives as a bound value.

use std::future::Future;
use std::pin::Pin;

use lockgate::{JobContext, JobError, PgPool, RawHandler};
use serde_json::Value;
use sqlx::postgres::PgTypeInfo;
use sqlx::{Connection as _, Executor as _};

/// Whether `statement` prepares against the database (tables and columns exist, the syntax is
/// right), with `$1` typed as the jsonb it is bound as.
pub async fn check(db: &PgPool, statement: &str) -> anyhow::Result<()> {
    let parameters = if statement.contains("$1") { vec![PgTypeInfo::with_name("jsonb")] } else { vec![] };
    // In a transaction, rolled back, with the statement closed before the end: through a
    // transaction-mode pooler the server is the transaction's, and no prepared statement may
    // outlive it (lockgate_sql::pooler).
    let mut tx = db.begin().await?;
    if let Err(err) = tx.prepare_with(statement, &parameters).await {
        let cause = err.as_database_error().map_or_else(|| err.to_string(), |db| db.message().to_string());
        anyhow::bail!("its sql statement does not prepare: {cause}");
    }
    tx.clear_cached_statements().await?;
    tx.rollback().await?;
    Ok(())
}

pub struct SqlExecutor {
    db: PgPool,
    statement: String,
}

impl SqlExecutor {
    pub fn new(db: PgPool, statement: String) -> Self {
        Self { db, statement }
    }

    async fn run(&self, args: Value) -> Result<(), JobError> {
        // Unnamed and in a transaction of its own under transaction pooling (the pooled path of
        // lockgate_sql::pooler); prepared once per connection otherwise.
        let query = lockgate::sql::pooler::query(&self.statement);
        let query = if self.statement.contains("$1") { query.bind(args) } else { query };
        if lockgate::pooler::transaction_pooling() {
            let mut tx = self.db.begin().await?;
            query.execute(&mut *tx).await?;
            tx.commit().await?;
        } else {
            query.execute(&self.db).await?;
        }
        Ok(())
    }
}

impl RawHandler for SqlExecutor {
    fn call(&self, _ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(self.run(args))
    }
}
