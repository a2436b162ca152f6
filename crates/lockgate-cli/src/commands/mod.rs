//! One module per subcommand.

pub mod demo;
pub mod dlq;
pub mod enqueue;
pub mod migrate;
pub mod run;
pub mod status;
