//! Errors of the runtime's two boundaries: enqueueing (what producers match on) and running.

use lockgate_core::{JobId, ValidationError};
use lockgate_sql::DbError;

/// Why an enqueue was refused, or did not answer. Nothing is enqueued when any of these is
/// returned, except an error whose [`EnqueueError::may_have_committed`] is true: the connection
/// broke after the enqueue was sent, and its transaction may have committed (review helper-141
/// F3: retried, the job was enqueued twice).
///
/// The refusals a producer handles carry their data: the unknown type, the full key, the held
/// unique key and its holder. Everything else the database says is [`EnqueueError::Database`],
/// whose driver error, when there is one, is its source.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error("job arguments could not be serialized: {0}")]
    Serialize(#[from] serde_json::Error),
    /// The arguments (as given, or as a typed job serialized) are JSON of another kind.
    #[error("the arguments of a {job_type} job must be a JSON object, not {kind}")]
    NotAnObject { job_type: String, kind: &'static str },
    /// The job type is not in `lockgate.job_types` (a typed enqueue defines its type on first
    /// use, so this is a raw enqueue's, or a type deleted since).
    #[error("unknown job type \"{job_type}\"")]
    UnknownJobType { job_type: String },
    /// `enqueue_in` defined the job type on first use, on another connection, but the caller's
    /// transaction cannot see it: its snapshot is older (REPEATABLE READ or SERIALIZABLE).
    #[error(
        "job type \"{job_type}\" was defined by this enqueue, but the transaction's snapshot is older than the \
         definition (REPEATABLE READ or SERIALIZABLE): define it before the transaction begins (Client::define)"
    )]
    DefinedAfterSnapshot { job_type: String },
    /// The job's concurrency key has no free permit and its type raises on conflict.
    #[error("concurrency limit reached for key \"{key}\"")]
    LimitReached { key: String },
    /// The job's unique key is held by job `holder` and its type rejects duplicates.
    #[error("unique key \"{key}\" of job type \"{job_type}\" is held by job {holder}")]
    Duplicate { key: String, job_type: String, holder: JobId },
    #[error(transparent)]
    Database(DbError),
}

impl From<DbError> for EnqueueError {
    fn from(err: DbError) -> Self {
        match err {
            DbError::UnknownJobType { job_type, .. } => Self::UnknownJobType { job_type },
            DbError::LimitReached { key, .. } => Self::LimitReached { key },
            DbError::Duplicate { key, job_type, holder, .. } => Self::Duplicate { key, job_type, holder },
            other => Self::Database(other),
        }
    }
}

impl EnqueueError {
    /// Whether the same enqueue may succeed if retried (the database was unreachable). When
    /// [`may_have_committed`](Self::may_have_committed) is true too, a retry may enqueue the job a
    /// second time: give the job a unique key (its retry is then a `Duplicate` naming the first),
    /// or look it up before retrying.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Database(e) if e.is_transient())
    }

    /// Whether the enqueue may have committed although it returned this error: the connection
    /// broke, or stopped answering, after the statement was sent (an I/O or protocol error of
    /// the driver), or the server or a pooler said the session ended mid-statement (SQLSTATE
    /// 08000, 08003, 08006, 08P01: PgBouncer's "server conn crashed?"; 57P01, 57P02: a backend
    /// terminated or a server crashing, which may come after the commit: review helper-142 F4).
    /// A refusal, an invalid call and any other server error are false: nothing was enqueued.
    /// A connection that broke as the pool opened it reads as true too (the driver tells it
    /// apart from nothing else): look the job up.
    pub fn may_have_committed(&self) -> bool {
        match self {
            Self::Database(DbError::Sqlx(sqlx::Error::Io(_) | sqlx::Error::Protocol(_))) => true,
            Self::Database(DbError::Sqlx(sqlx::Error::Database(db))) => {
                matches!(db.code().as_deref(), Some("08000" | "08003" | "08006" | "08P01" | "57P01" | "57P02"))
            }
            _ => false,
        }
    }
}

/// Why the runtime could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Config(#[from] ValidationError),
    #[error(transparent)]
    Database(#[from] DbError),
    /// A recurring task names a job type or a queue that neither this runtime nor the database
    /// has: found before anything is stored.
    #[error("recurring task \"{task}\": {problem}")]
    Recurring { task: String, problem: String },
    /// `health_listen` names an address that cannot be bound (and is not optional).
    #[error("cannot serve the health endpoints on health_listen {addr}: {source}")]
    HealthListen { addr: std::net::SocketAddr, source: std::io::Error },
    /// The heartbeat's thread (or its runtime) could not be started: the system refused a thread.
    #[error("cannot start the heartbeat's thread: {0}")]
    HeartbeatThread(std::io::Error),
}
