//! Maintenance sweeps, one per file. Each has the same shape: a constructor, a ticker loop in
//! `run(shutdown)`, and the work in a `run_once` that returns counts, so tests can drive a
//! sweep directly.

mod archive_retention;
mod bookkeeping_sweep;
mod concurrency_sweep;
mod finished_permits;

pub use archive_retention::ArchiveRetention;
pub use bookkeeping_sweep::{BookkeepingReport, BookkeepingSweep, REAP_AGE_FLOOR};
pub use concurrency_sweep::ConcurrencySweep;
pub(crate) use finished_permits::FinishedPermits;
