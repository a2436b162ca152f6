//! The process's cache of job-type policies from `lockgate.job_types`. Policies are read from
//! the database (not from the registry) so every process and every SQL producer applies the
//! same stored policy. A miss reloads once, at most every `MIN_RELOAD_INTERVAL`, so a type
//! defined by another process is found and a type that does not exist costs one query.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lockgate_core::JobPolicy;
use lockgate_sql::{DbError, PgPool};
use tokio::sync::RwLock;

/// Reloads are cheap (one small table) but not free; a second is plenty for a new type to show.
const MIN_RELOAD_INTERVAL: Duration = Duration::from_secs(1);
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

    /// The stored policy of `job_type`, or `None` when the database has no such type.
    pub async fn get(&self, db: &PgPool, job_type: &str) -> Option<JobPolicy> {
        {
            let guard = self.inner.read().await;
            let age = guard.1.elapsed();
            match guard.0.get(job_type) {
                Some(policy) if age < MAX_AGE => return Some(policy.clone()),
                None if age < MIN_RELOAD_INTERVAL => return None,
                _ => {}
            }
        }
        let mut guard = self.inner.write().await;
        if guard.1.elapsed() >= MIN_RELOAD_INTERVAL {
            match Self::fetch(db).await {
                Ok(map) => *guard = (map, Instant::now()),
                // Keep serving what we know; a blip must not dead-letter jobs of known types.
                Err(error) => tracing::warn!(%error, "could not reload job types"),
            }
        }
        guard.0.get(job_type).cloned()
    }
}
