//! lockgate's runtime: the producer-side [`Client`], and the long-running services that execute
//! jobs — worker pools (fetch, execute, complete), the heartbeat, the LISTEN notifier, the
//! maintenance sweeps and the recurring-job [`scheduler`] — supervised by [`Runtime`].
//!
//! The pipeline of one job: the fetch loop of a [`worker`] pool claims a batch of deliveries
//! (one round trip per queue), registers each in the process's in-flight set (which the
//! [`heartbeat`] renews and the pool's watchdog fences), and runs its handler; the outcome goes
//! to the completer (a batched, fenced archive), or to a fenced retry or dead-letter. See
//! `supervisor` for the lifecycle.

mod budgets;
mod builder;
mod client;
pub mod config;
mod error;
mod handler;
pub mod health;
pub mod heartbeat;
mod held;
mod in_flight;
mod job;
pub mod maintenance;
pub mod metrics;
mod notifier;
mod policies;
pub mod process_registry;
pub mod scheduler;
mod supervisor;
pub mod testing;
mod ticker;
pub mod worker;

pub use builder::RuntimeBuilder;
pub use client::Client;
pub use config::{PoolConfig, RuntimeConfig};
pub use error::{EnqueueError, RuntimeError};
pub use handler::{CancelReason, JobContext, JobError, RawHandler, Registry, RunHold};
pub use job::{Handler, Job};
pub use metrics::Metrics;
pub use supervisor::Runtime;
