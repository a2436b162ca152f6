//! Typed jobs: a serde type with a name and a policy, and the handlers that run it.

use std::future::Future;

use lockgate_core::{JobPolicy, QueueName};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{JobContext, JobError};

/// A job's arguments as a Rust type. They serialize to a JSON object (the PGMQ message).
///
/// ```
/// use lockgate_core::{JobPolicy, QueueName};
/// use lockgate_runtime::Job;
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct SendEmail { to: String }
///
/// impl Job for SendEmail {
///     const TYPE: &'static str = "send_email";
///     fn policy() -> JobPolicy {
///         let mut policy = JobPolicy::on_queue(QueueName::new("mail").expect("valid name"));
///         policy.max_attempts = 5;
///         policy
///     }
/// }
/// ```
pub trait Job: Serialize + DeserializeOwned + Send + 'static {
    /// The job type's name, stored with every job and in `lockgate.job_types`.
    const TYPE: &'static str;

    /// The policy registered for this type: queue `default` and lockgate's defaults unless
    /// overridden.
    fn policy() -> JobPolicy {
        JobPolicy::on_queue(QueueName::new("default").expect("\"default\" is a valid queue name"))
    }
}

/// Runs jobs of type `J`. Implemented for every `Fn(JobContext, J) -> impl Future` closure.
pub trait Handler<J>: Send + Sync + 'static {
    fn handle(&self, ctx: JobContext, job: J) -> impl Future<Output = Result<(), JobError>> + Send;
}

impl<J, F, Fut> Handler<J> for F
where
    F: Fn(JobContext, J) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), JobError>> + Send,
{
    fn handle(&self, ctx: JobContext, job: J) -> impl Future<Output = Result<(), JobError>> + Send {
        self(ctx, job)
    }
}
