//! The command executor: runs a program with the job's arguments as JSON on stdin. Exit status
//! 0 succeeds; otherwise the attempt fails with the end of stderr as its error.
//!
//! The program runs in a process group of its own, so the program and every process it starts
//! can be stopped together (H27, H30). When the attempt is cancelled (shutdown, lease lost,
//! self-fencing), the handler sends SIGKILL to the whole group, reaps the program, and returns
//! only once no process of the group is left alive: the runtime returns a job, or lets another
//! worker take its permit, only after that. When the program exits on its own, whatever it left
//! running in its group is killed the same way, so nothing of a finished job runs beside its
//! key's next job. If the handler is dropped instead (its type's timeout, or the runtime aborting
//! a handler past its grace), the group is killed from the drop. On an immediate exit (QUIT, a
//! second TERM), which runs no destructors, `kill_children` kills every group still running. A
//! process that leaves its group on purpose (`setsid`) is out of reach.
//!
//! What no code of lockgate's can do once lockgate is killed (`kill -9`) or frozen (SIGSTOP, a
//! stalled VM) is done by the group's leader: a watchdog (`lockgate command-watchdog`, started
//! before the program and in the same group) that lockgate tells, over a pipe, until when the
//! job's lease holds. It kills the group when the pipe closes (lockgate died) or shortly before
//! the lease ends without a renewal (lockgate stopped renewing it), so the program never runs
//! beside the job's next delivery (design §75).
//!
//! Groups are killed with `kill -KILL -- -<pgid>` (kill(1), POSIX) rather than a libc call: the
//! workspace forbids unsafe code, and this saves a dependency for a call made once per job.

use std::collections::HashSet;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lockgate::{JobContext, JobError, RawHandler};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, Command};

/// Errors keep the last 2 KiB of stderr: enough to diagnose, bounded for the attempt history.
const STDERR_TAIL: usize = 2048;

/// How long stderr may stay open once the group is gone (a process that left the group with
/// `setsid` may hold it): the error message is not worth waiting longer for.
const STDERR_DRAIN: Duration = Duration::from_millis(100);

/// How often a killed group is checked for survivors.
const REAP_POLL: Duration = Duration::from_millis(5);

/// How long before the lease ends the watchdog kills the group when lockgate has not renewed it:
/// time for kill(1) to start and the kernel to deliver, on a busy host. While lockgate runs, its
/// own fence (`FENCE_MARGIN`, 300 ms) cancels the job earlier.
const WATCHDOG_MARGIN: Duration = Duration::from_millis(100);

/// Process group ids of running commands: inserted at spawn, removed once the group is gone.
static GROUPS: Mutex<Option<HashSet<u32>>> = Mutex::new(None);

fn groups() -> std::sync::MutexGuard<'static, Option<HashSet<u32>>> {
    GROUPS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Kills every command's process group still running (for exits that skip destructors).
pub fn kill_children() {
    let targets: Vec<String> = groups().iter().flatten().map(|pgid| format!("-{pgid}")).collect();
    if !targets.is_empty() {
        let _ = std::process::Command::new("kill")
            .arg("-KILL")
            .arg("--")
            .args(&targets)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// One command's process group, killed when the handler is dropped before it was reaped.
struct Group {
    pgid: u32,
    gone: bool,
}

impl Group {
    fn new(pgid: u32) -> Self {
        groups().get_or_insert_with(HashSet::new).insert(pgid);
        Self { pgid, gone: false }
    }

    /// Kills every process of the group, reaps the program, and waits until no process of the
    /// group is alive (its other members are reaped by whoever inherited them).
    async fn kill_and_reap(&mut self, child: &mut Child) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.pgid)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
        let _ = child.wait().await;
        while group_alive(self.pgid) {
            tokio::time::sleep(REAP_POLL).await;
        }
        self.gone = true;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if !self.gone {
            // Dropped mid-run: no await is possible here, so kill synchronously; the program
            // itself is reaped by tokio (`kill_on_drop`).
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.pgid)])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        if let Some(set) = groups().as_mut() {
            set.remove(&self.pgid);
        }
    }
}

/// Whether any process of group `pgid` is alive (not a zombie), read from /proc. Where /proc is
/// not readable, kill(1) with signal 0 answers instead (zombies count as alive there).
fn group_alive(pgid: u32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return std::process::Command::new("kill")
            .args(["-0", "--", &format!("-{pgid}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    };
    dir.flatten().filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok()).any(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| in_group_and_alive(&stat, pgid))
    })
}

/// Parses `/proc/<pid>/stat`: `pid (comm) state ppid pgrp ...`; comm may hold spaces and
/// parentheses, so the fields are read after the last `)`.
fn in_group_and_alive(stat: &str, pgid: u32) -> bool {
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    let state = fields.next();
    let pgrp = fields.nth(1).and_then(|p| p.parse::<u32>().ok());
    pgrp == Some(pgid) && !matches!(state, Some("Z" | "X" | "x"))
}

/// Whether `argv`'s program can be started: found (a path with a `/` as given, otherwise
/// through `PATH`, as the spawn resolves it) and executable.
pub fn check(argv: &[String]) -> anyhow::Result<()> {
    let Some(program) = argv.first() else { anyhow::bail!("its command is empty") };
    let candidates: Vec<PathBuf> = if program.contains('/') {
        vec![PathBuf::from(program)]
    } else {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path).map(|dir| dir.join(program)).collect()
    };
    if candidates.iter().any(|c| is_executable(c)) {
        return Ok(());
    }
    match candidates.iter().find(|c| c.exists()) {
        Some(found) => anyhow::bail!("its command {program:?} ({}) is not an executable file", found.display()),
        None if program.contains('/') => anyhow::bail!("its command {program:?} was not found"),
        None => anyhow::bail!("its command {program:?} was not found in PATH"),
    }
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
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
        // The group's leader: the running binary, through /proc so that an upgrade that replaced
        // the file on disk still starts this version.
        let exe = Path::new("/proc/self/exe");
        let exe = if exe.exists() { exe.to_path_buf() } else { std::env::current_exe().unwrap_or_default() };
        let mut watchdog = Command::new(&exe)
            .arg("command-watchdog")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                JobError::new(format!("could not start lockgate's command watchdog ({}): {e}", exe.display()))
            })?;
        let pgid = watchdog.id().ok_or_else(|| JobError::new("lockgate's command watchdog exited at once"))?;
        let mut group = Group::new(pgid);
        let mut lease = ctx.lease_ends();
        let mut tell = watchdog.stdin.take();
        let until = *lease.borrow_and_update();
        let told = tell_lease(&mut tell, until).await;
        if let Err(e) = told {
            group.kill_and_reap(&mut watchdog).await;
            return Err(JobError::new(format!("could not reach lockgate's command watchdog: {e}")));
        }
        let spawned = Command::new(program)
            .args(rest)
            .env("LOCKGATE_JOB_ID", ctx.job_id.to_string())
            .env("LOCKGATE_JOB_TYPE", &ctx.job_type)
            .env("LOCKGATE_ATTEMPT", ctx.attempt.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(pgid as i32)
            .kill_on_drop(true)
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                group.kill_and_reap(&mut watchdog).await;
                return Err(JobError::new(format!("could not start {program}: {e}")));
            }
        };
        // stderr is read from the start (a full pipe would block the program) and kept apart,
        // since a process the program left behind may hold it open until the group is killed.
        let stderr = child.stderr.take().map(|mut pipe| {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let _ = pipe.read_to_end(&mut buf).await;
                buf
            })
        });
        let stdin = child.stdin.take();
        let input = args.to_string();
        let feed = async move {
            if let Some(mut stdin) = stdin {
                // A program that exits without reading its input is not an error of ours.
                let _ = stdin.write_all(input.as_bytes()).await;
            }
        };
        let status = {
            let ran = async { tokio::join!(feed, child.wait()).1 };
            tokio::pin!(ran);
            let mut renewing = true;
            loop {
                tokio::select! {
                    status = &mut ran => break Some(status),
                    () = ctx.cancelled() => break None,
                    changed = lease.changed(), if renewing => {
                        // Each renewal goes to the watchdog; once the lease can no longer move
                        // (the delivery is settled) or the watchdog is gone, nothing more is sent.
                        let until = *lease.borrow_and_update();
                        renewing = changed.is_ok() && tell_lease(&mut tell, until).await.is_ok();
                    }
                }
            }
        };
        group.kill_and_reap(&mut child).await;
        let _ = watchdog.wait().await;
        let Some(status) = status else {
            return Err(JobError::new(format!("{program} was cancelled ({:?})", ctx.cancel_reason())));
        };
        let status = status?;
        if status.success() {
            return Ok(());
        }
        let stderr = match stderr {
            Some(task) => tokio::time::timeout(STDERR_DRAIN, task).await.ok().and_then(Result::ok).unwrap_or_default(),
            None => Vec::new(),
        };
        let stderr = String::from_utf8_lossy(&stderr);
        let from = (stderr.len().saturating_sub(STDERR_TAIL)..stderr.len())
            .find(|i| stderr.is_char_boundary(*i))
            .unwrap_or(stderr.len());
        let tail = stderr[from..].trim();
        Err(JobError::new(if tail.is_empty() { format!("{program} exited with {status}") } else { tail.to_string() }))
    }
}

/// Tells the watchdog until when the lease holds, as the milliseconds left before it must kill
/// the group (one line each).
async fn tell_lease(pipe: &mut Option<ChildStdin>, until: Instant) -> std::io::Result<()> {
    let left = until.saturating_duration_since(Instant::now()).saturating_sub(WATCHDOG_MARGIN);
    match pipe {
        Some(pipe) => pipe.write_all(format!("{}\n", left.as_millis()).as_bytes()).await,
        None => Err(std::io::Error::other("no pipe to the watchdog")),
    }
}

/// `lockgate command-watchdog`, the leader of a command's process group: reads from stdin, one
/// per line, how many milliseconds the group may run from now (each line replaces the last), and
/// kills the whole group, itself included, when that time is up or stdin closes — lockgate
/// writes the lines and holds the pipe's other end, which the kernel closes when lockgate dies.
/// Until its first line it waits for one. Plain threads and a channel: it must start in a few
/// milliseconds and hold nothing.
pub fn watchdog() -> ! {
    let (lines, budgets) = mpsc::channel::<u64>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Some(ms) = line.ok().and_then(|l| l.trim().parse().ok()) else { break };
            if lines.send(ms).is_err() {
                break;
            }
        }
    });
    let mut deadline: Option<Instant> = None;
    loop {
        let next = match deadline {
            Some(at) => budgets.recv_timeout(at.saturating_duration_since(Instant::now())),
            None => budgets.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match next {
            Ok(ms) => deadline = Some(Instant::now() + Duration::from_millis(ms)),
            Err(_) => break,
        }
    }
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", std::process::id())])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    std::process::exit(0)
}

impl RawHandler for CommandExecutor {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(self.run(ctx, args))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_are_read_after_the_command_name() {
        assert!(in_group_and_alive("42 (sleep) S 1 40 40 0", 40));
        assert!(!in_group_and_alive("42 (sleep) Z 1 40 40 0", 40), "a zombie has ended");
        assert!(!in_group_and_alive("42 (sleep) S 1 41 41 0", 40));
        assert!(in_group_and_alive("42 (a) b (c) R 1 40 40 0", 40));
    }
}
