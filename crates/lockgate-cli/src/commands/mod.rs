//! One module per subcommand.

pub mod batch;
pub mod define;
pub mod demo;
pub mod dlq;
pub mod doctor;
pub mod enqueue;
pub mod job;
pub mod jobs;
pub mod migrate;
pub mod parked;
pub mod queue;
pub mod recurring;
pub mod run;
pub mod status;
pub mod undefine;
