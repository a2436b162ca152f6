//! The command executor: runs a program with the job's arguments as JSON on stdin. Exit status
//! 0 succeeds; otherwise the attempt fails with the end of stderr as its error. The child is
//! killed if the attempt is cancelled (timeout, shutdown, lease lost), because the runtime drops
//! the future and the child was spawned with `kill_on_drop`; and on an immediate exit (QUIT, a
//! second TERM), which runs no destructors, `kill_children` kills every child still running so
//! none outlives its process and runs beside the job's next delivery.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::Mutex;

use lockgate::{JobContext, JobError, RawHandler};
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// Errors keep the last 2 KiB of stderr: enough to diagnose, bounded for the attempt history.
const STDERR_TAIL: usize = 2048;

/// Pids of running children: inserted at spawn, removed when the child is reaped.
static CHILDREN: Mutex<Option<HashSet<u32>>> = Mutex::new(None);

fn children() -> std::sync::MutexGuard<'static, Option<HashSet<u32>>> {
    CHILDREN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Kills every command child still running (for exits that skip destructors).
pub fn kill_children() {
    let pids: Vec<String> = children().iter().flatten().map(|pid| pid.to_string()).collect();
    if !pids.is_empty() {
        let _ = std::process::Command::new("kill").arg("-KILL").args(&pids).status();
    }
}

/// Forgets a child's pid when its wait ends (or is abandoned).
struct Tracked(Option<u32>);

impl Drop for Tracked {
    fn drop(&mut self) {
        if let (Some(pid), Some(set)) = (self.0, children().as_mut()) {
            set.remove(&pid);
        }
    }
}

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
        let _tracked = Tracked(child.id());
        if let Some(pid) = child.id() {
            children().get_or_insert_with(HashSet::new).insert(pid);
        }
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
