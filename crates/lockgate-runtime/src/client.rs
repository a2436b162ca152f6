//! The producer side: enqueue typed or raw jobs, alone, in batches, or inside the caller's
//! transaction (G8), and define job types. Every method is one round trip.

use lockgate_core::{EnqueueOptions, EnqueuedJob, JobPolicy, JobTypeName};
use lockgate_sql::{DbError, PgPool};
use serde_json::Value;
use sqlx::PgConnection;

use crate::{EnqueueError, Job};

/// A handle for producers. Cheap to clone (it holds a pool).
#[derive(Debug, Clone)]
pub struct Client {
    pool: PgPool,
}

impl Client {
    /// Uses `pool`; the schema must be migrated (see [`Client::check_schema`]).
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Fails with a message naming `lockgate migrate` when the schema is missing or older.
    pub async fn check_schema(&self) -> Result<(), DbError> {
        lockgate_sql::check_schema(&self.pool).await
    }

    /// Stores `J`'s policy (creating its queue if missing), so SQL producers apply it too.
    pub async fn define<J: Job>(&self) -> Result<(), EnqueueError> {
        self.define_job_type(&JobTypeName::new(J::TYPE)?, &J::policy()).await
    }

    pub async fn define_job_type(&self, name: &JobTypeName, policy: &JobPolicy) -> Result<(), EnqueueError> {
        policy.validate()?;
        Ok(lockgate_sql::define_job_type(&self.pool, name, policy).await?)
    }

    /// Enqueues one typed job in its own transaction.
    pub async fn enqueue<J: Job>(&self, job: &J, options: &EnqueueOptions) -> Result<EnqueuedJob, EnqueueError> {
        let args = to_args(J::TYPE, job)?;
        Ok(lockgate_sql::enqueue(&self.pool, J::TYPE, &args, &options.to_json()?).await?)
    }

    /// Enqueues one typed job inside the caller's transaction: it exists if and only if that
    /// transaction commits (G8). Pass `&mut *tx` for a `sqlx::Transaction`.
    pub async fn enqueue_in<J: Job>(
        conn: &mut PgConnection,
        job: &J,
        options: &EnqueueOptions,
    ) -> Result<EnqueuedJob, EnqueueError> {
        let args = to_args(J::TYPE, job)?;
        Ok(lockgate_sql::enqueue(conn, J::TYPE, &args, &options.to_json()?).await?)
    }

    /// Enqueues many jobs of one type in one statement; results are in input order.
    pub async fn enqueue_many<J: Job>(
        &self,
        jobs: &[J],
        options: &EnqueueOptions,
    ) -> Result<Vec<EnqueuedJob>, EnqueueError> {
        let args = jobs.iter().map(|j| to_args(J::TYPE, j)).collect::<Result<Vec<_>, _>>()?;
        Ok(lockgate_sql::enqueue_many(&self.pool, J::TYPE, &args, &options.to_json()?).await?)
    }

    /// Enqueues many jobs of one type by name with JSON arguments, in one statement.
    pub async fn enqueue_many_raw(
        &self,
        job_type: &str,
        args: &[Value],
        options: &EnqueueOptions,
    ) -> Result<Vec<EnqueuedJob>, EnqueueError> {
        for a in args {
            check_args(job_type, a)?;
        }
        Ok(lockgate_sql::enqueue_many(&self.pool, job_type, args, &options.to_json()?).await?)
    }

    /// Enqueues a job by type name with JSON arguments (the CLI's path).
    pub async fn enqueue_raw(
        &self,
        job_type: &str,
        args: &Value,
        options: &EnqueueOptions,
    ) -> Result<EnqueuedJob, EnqueueError> {
        check_args(job_type, args)?;
        Ok(lockgate_sql::enqueue(&self.pool, job_type, args, &options.to_json()?).await?)
    }
}

fn to_args<J: Job>(job_type: &str, job: &J) -> Result<Value, EnqueueError> {
    let args = serde_json::to_value(job)?;
    check_args(job_type, &args)?;
    Ok(args)
}

fn check_args(job_type: &str, args: &Value) -> Result<(), EnqueueError> {
    // The size bound (MAX_PAYLOAD_BYTES) is enforced once, by the SQL function, for every
    // producer; serializing here only to measure would double the cost of every enqueue.
    if !args.is_object() {
        return Err(EnqueueError::NotAnObject { job_type: job_type.to_string() });
    }
    Ok(())
}
