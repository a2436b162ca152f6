//! The process's cache of job-type policies from `lockgate.job_types`. Policies are read from
//! the database (not from the registry) so every process and every SQL producer applies the
//! same stored policy. A miss reloads unless a reload already started after the job was
//! claimed: an enqueue checks its type exists, so a type defined before the enqueue committed
//! is always seen by such a reload, and a type that does not exist costs at most one query per
//! claim batch.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lockgate_core::JobPolicy;
use lockgate_sql::{DbError, PgPool};
use tokio::sync::RwLock;

/// Edited policies reach running workers within this long.
const MAX_AGE: Duration = Duration::from_secs(30);

pub(crate) struct PolicyCache {
    inner: RwLock<(HashMap<String, JobPolicy>, Instant)>,
}

impl PolicyCache {
    pub async fn load(db: &PgPool) -> Result<Self, DbError> {
        let map = Self::fetch(db).await?;
        Ok(Self { inner: RwLock::new((map, Instant::now())) })
    }

    async fn fetch(db: &PgPool) -> Result<HashMap<String, JobPolicy>, DbError> {
        let rows = lockgate_sql::load_job_types(db).await?;
        Ok(rows.into_iter().map(|(name, policy)| (name.as_str().to_string(), policy)).collect())
    }

    /// Every stored policy, as last loaded.
    pub async fn all(&self) -> Vec<(String, JobPolicy)> {
        self.inner.read().await.0.iter().map(|(name, policy)| (name.clone(), policy.clone())).collect()
    }

    /// The stored policy of `job_type` for a job claimed at `claimed_at`, or `None` when the
    /// database has no such type.
    pub async fn get(&self, db: &PgPool, job_type: &str, claimed_at: Instant) -> Option<JobPolicy> {
        {
            let guard = self.inner.read().await;
            if let Some(policy) = guard.0.get(job_type).filter(|_| guard.1.elapsed() < MAX_AGE) {
                return Some(policy.clone());
            }
        }
        let mut guard = self.inner.write().await;
        if guard.1 <= claimed_at || guard.1.elapsed() >= MAX_AGE {
            let started = Instant::now();
            match Self::fetch(db).await {
                Ok(map) => *guard = (map, started),
                // Keep serving what we know; a blip must not dead-letter jobs of known types.
                Err(error) => tracing::warn!(%error, "could not reload job types"),
            }
        }
        guard.0.get(job_type).cloned()
    }
}
