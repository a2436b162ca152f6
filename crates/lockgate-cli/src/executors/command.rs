//! The command executor: runs a program with the job's arguments as JSON on stdin. Exit status
//! 0 succeeds; otherwise the attempt fails with the end of stderr as its error. The child is
//! killed if the attempt is cancelled (timeout, shutdown, lease lost), because the runtime drops
//! the future and the child was spawned with `kill_on_drop`.

use std::future::Future;
use std::pin::Pin;
use std::process::Stdio;

use lockgate::{JobContext, JobError, RawHandler};
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// Errors keep the last 2 KiB of stderr: enough to diagnose, bounded for the attempt history.
const STDERR_TAIL: usize = 2048;

pub struct CommandExecutor {
    argv: Vec<String>,
}

impl CommandExecutor {
    pub fn new(argv: Vec<String>) -> Self {
        Self { argv }
    }

    async fn run(&self, ctx: JobContext, args: Value) -> Result<(), JobError> {
        let (program, rest) = self.argv.split_first().ok_or_else(|| JobError::new("empty command"))?;
        let mut child = Command::new(program)
            .args(rest)
            .env("LOCKGATE_JOB_ID", ctx.job_id.to_string())
            .env("LOCKGATE_JOB_TYPE", &ctx.job_type)
            .env("LOCKGATE_ATTEMPT", ctx.attempt.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| JobError::new(format!("could not start {program}: {e}")))?;
        if let Some(mut stdin) = child.stdin.take() {
            // A program that exits without reading its input is not an error of ours.
            let _ = stdin.write_all(args.to_string().as_bytes()).await;
        }
        let output = child.wait_with_output().await?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail = &stderr[stderr.len().saturating_sub(STDERR_TAIL)..];
        let tail = tail.trim();
        Err(JobError::new(if tail.is_empty() {
            format!("{program} exited with {}", output.status)
        } else {
            tail.to_string()
        }))
    }
}

impl RawHandler for CommandExecutor {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(self.run(ctx, args))
    }
}
