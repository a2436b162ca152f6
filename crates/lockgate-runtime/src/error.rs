//! Errors of the runtime's two boundaries: enqueueing (what producers match on) and running.

use lockgate_core::ValidationError;
use lockgate_sql::DbError;

/// Why an enqueue was refused. Nothing is enqueued when any of these is returned.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error("job arguments could not be serialized: {0}")]
    Serialize(#[from] serde_json::Error),
    #[error("job arguments of {job_type} must serialize to a JSON object")]
    NotAnObject { job_type: String },
    #[error(transparent)]
    Database(#[from] DbError),
}

impl EnqueueError {
    /// Whether the same enqueue may succeed if retried (the database was unreachable).
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Database(e) if e.is_transient())
    }
}

/// Why the runtime could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Config(#[from] ValidationError),
    #[error(transparent)]
    Database(#[from] DbError),
}
