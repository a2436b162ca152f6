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
//! stalled VM) is done by a watchdog: one `lockgate command-watchdog` process per lockgate
//! process, in a process group of its own, outside every program's group. lockgate tells it over
//! a pipe, for each running group, until when the job's lease holds; it kills a group shortly
//! before that time if no renewal came (lockgate stopped renewing), and every group it knows when
//! the pipe closes (lockgate died), so a program never runs beside its job's next delivery
//! (design §75). lockgate tells it a group is done once it killed the group itself, before it
//! reaps the program, so that the pgid cannot be reused while the watchdog may still target it.
//!
//! Groups are killed with `kill -KILL -- -<pgid>` (kill(1), POSIX) rather than a libc call: the
//! workspace forbids unsafe code, and this saves a dependency for a call made once per job.

use std::collections::{HashMap, HashSet};
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

/// How long before the lease ends the watchdog kills a group whose lease lockgate has not renewed:
/// time for the line to reach the watchdog (it counts from when it reads it; up to 76 ms under
/// load, measured), for kill(1) to start and for the kernel to deliver. Short of `FENCE_MARGIN`
/// (300 ms), so that a lockgate that runs cancels the job itself first.
const WATCHDOG_MARGIN: Duration = Duration::from_millis(150);

/// The environment variable naming, in every program and what it starts, the watchdog watching it.
const WATCHDOG_ENV: &str = "LOCKGATE_WATCHDOG";

/// How long a line to the watchdog may take to write: a pipe the watchdog no longer reads (it is
/// stopped) fills up, and a handler must never wait on it. Past this the watchdog is replaced.
const WRITE_TIMEOUT: Duration = Duration::from_millis(500);

/// The watchdog of this process's command groups, and what it was told: started before the first
/// program, started again (and told every group) when it died or stopped reading.
static WATCHDOG: tokio::sync::Mutex<Watched> = tokio::sync::Mutex::const_new(Watched { process: None, groups: None });

struct Watched {
    process: Option<(Child, ChildStdin)>,
    /// Until when each running group may run, as last told.
    groups: Option<HashMap<u32, Instant>>,
}

/// The binary to start the watchdog from: the running one, through /proc so that an upgrade that
/// replaced the file on disk still starts this version.
pub fn watchdog_program() -> anyhow::Result<PathBuf> {
    let exe = Path::new("/proc/self/exe");
    if exe.exists() {
        return Ok(exe.to_path_buf());
    }
    std::env::current_exe().map_err(|e| {
        anyhow::anyhow!(
            "command jobs need the path of the lockgate binary to start their watchdog, from /proc/self/exe: {e}"
        )
    })
}

/// The line telling the watchdog that group `pgid` may run until `until` (less the margin).
fn lease_line(pgid: u32, until: Instant) -> String {
    let left = until.saturating_duration_since(Instant::now()).saturating_sub(WATCHDOG_MARGIN);
    format!("{pgid} {}\n", left.as_millis())
}

impl Watched {
    /// A running watchdog: the one there is if it has not exited, else a new one told every group.
    async fn ensure(&mut self) -> std::io::Result<(u32, &mut ChildStdin)> {
        if let Some((process, _)) = self.process.as_mut() {
            if process.try_wait().ok().flatten().is_some() {
                self.process = None;
            }
        }
        if self.process.is_none() {
            let program = watchdog_program().map_err(std::io::Error::other)?;
            let mut process = Command::new(&program)
                .arg0("lockgate")
                .arg("command-watchdog")
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()?;
            let mut pipe = process.stdin.take().ok_or_else(|| std::io::Error::other("the watchdog has no stdin"))?;
            let lines: String = self.groups.iter().flatten().map(|(pgid, until)| lease_line(*pgid, *until)).collect();
            if !lines.is_empty() {
                write_line(&mut pipe, &lines).await?;
            }
            self.process = Some((process, pipe));
        }
        match self.process.as_mut() {
            Some((process, pipe)) => Ok((process.id().unwrap_or_default(), pipe)),
            None => Err(std::io::Error::other("no watchdog")),
        }
    }

    /// Writes `line`, replacing a watchdog that died or stopped reading once.
    async fn send(&mut self, line: &str) -> std::io::Result<()> {
        let written = write_line(self.ensure().await?.1, line).await;
        if written.is_ok() {
            return written;
        }
        if let Some((mut process, _)) = self.process.take() {
            let _ = process.start_kill();
        }
        write_line(self.ensure().await?.1, line).await
    }
}

async fn write_line(pipe: &mut ChildStdin, line: &str) -> std::io::Result<()> {
    match tokio::time::timeout(WRITE_TIMEOUT, pipe.write_all(line.as_bytes())).await {
        Ok(written) => written,
        Err(_) => Err(std::io::Error::other("the watchdog stopped reading")),
    }
}

/// Starts `command` as a new process group under the watchdog: the watchdog is running before the
/// program starts, and is then told the group may run until `until`. The program carries the
/// watchdog's pid in `LOCKGATE_WATCHDOG`, so that a watchdog whose lockgate died between the
/// start and the line still finds it. A program the watchdog cannot be told of is killed.
async fn spawn_watched(command: &mut Command, until: Instant) -> Result<(Child, Group), String> {
    let watchdog = {
        let mut watched = WATCHDOG.lock().await;
        watched.ensure().await.map_err(|e| format!("lockgate's command watchdog could not be started: {e}"))?.0
    };
    let mut child =
        command.env(WATCHDOG_ENV, watchdog.to_string()).spawn().map_err(|e| format!("could not start it: {e}"))?;
    let pgid = child.id().ok_or("it exited before it could be tracked")?;
    let mut group = Group::new(pgid);
    if let Err(e) = tell_lease(pgid, until).await {
        group.kill_and_reap(&mut child).await;
        return Err(format!("it was stopped: lockgate's command watchdog could not be told of it: {e}"));
    }
    Ok((child, group))
}

/// Tells the watchdog that group `pgid` may run until `until`.
async fn tell_lease(pgid: u32, until: Instant) -> std::io::Result<()> {
    let mut watched = WATCHDOG.lock().await;
    watched.groups.get_or_insert_with(HashMap::new).insert(pgid, until);
    watched.send(&lease_line(pgid, until)).await
}

/// Tells the watchdog that lockgate is done with group `pgid`.
async fn forget(pgid: u32) {
    let mut watched = WATCHDOG.lock().await;
    if watched.groups.as_mut().and_then(|g| g.remove(&pgid)).is_some() {
        let _ = watched.send(&format!("{pgid} -\n")).await;
    }
}

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
        // Before the program is reaped (unless it already was: it exited on its own), while its
        // pid, the group's id, cannot be given to another process.
        forget(self.pgid).await;
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
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(forget(self.pgid));
            }
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

/// The process group in a `/proc/<pid>/stat` line.
fn process_group(stat: &str) -> Option<u32> {
    stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().nth(2)?.parse().ok())
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
    watchdog_program()?;
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
        let mut lease = ctx.lease_ends();
        let until = *lease.borrow_and_update();
        let mut command = Command::new(program);
        command
            .args(rest)
            .env("LOCKGATE_JOB_ID", ctx.job_id.to_string())
            .env("LOCKGATE_JOB_TYPE", &ctx.job_type)
            .env("LOCKGATE_ATTEMPT", ctx.attempt.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let (mut child, mut group) =
            spawn_watched(&mut command, until).await.map_err(|e| JobError::new(format!("{program}: {e}")))?;
        let pgid = group.pgid;
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
        let outcome = {
            let ran = async { tokio::join!(feed, child.wait()).1 };
            tokio::pin!(ran);
            let mut renewing = true;
            loop {
                tokio::select! {
                    status = &mut ran => break Ok(status),
                    () = ctx.cancelled() => break Err(format!("{program} was cancelled ({:?})", ctx.cancel_reason())),
                    changed = lease.changed(), if renewing => {
                        // Each renewal goes to the watchdog, until the lease can no longer move
                        // (the delivery is settled). A watchdog that can no longer be told stops
                        // the program: it would run unwatched.
                        renewing = changed.is_ok();
                        let until = *lease.borrow_and_update();
                        if renewing {
                            if let Err(e) = tell_lease(pgid, until).await {
                                break Err(format!("{program} was stopped: lockgate's command watchdog is gone ({e})"));
                            }
                        }
                    }
                }
            }
        };
        group.kill_and_reap(&mut child).await;
        let status = outcome.map_err(JobError::new)?;
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

/// `lockgate command-watchdog`: watches the process groups of one lockgate process's command
/// jobs. Reads lines from stdin: `<pgid> <ms>`, group pgid may run ms more from now (each line
/// replaces the last for that group); `<pgid> -`, lockgate is done with the group. Kills a group
/// with SIGKILL when its time is up, and every group it knows when stdin closes (lockgate died:
/// the kernel closed the pipe's other end) or a line makes no sense. Started before any async
/// runtime (see main): plain threads and a channel, so it starts fast and holds little.
pub fn watchdog() -> ! {
    survive_hangup();
    let (lines, updates) = mpsc::channel::<(u32, Option<u64>)>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Some(update) = line.ok().as_deref().and_then(parse_watchdog_line) else { break };
            if lines.send(update).is_err() {
                break;
            }
        }
    });
    let mut deadlines: HashMap<u32, Instant> = HashMap::new();
    loop {
        let next = deadlines.values().min().copied();
        let update = match next {
            Some(at) => updates.recv_timeout(at.saturating_duration_since(Instant::now())),
            None => updates.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match update {
            Ok((pgid, Some(ms))) => {
                deadlines.insert(pgid, Instant::now() + Duration::from_millis(ms.min(u64::from(u32::MAX))));
            }
            Ok((pgid, None)) => {
                deadlines.remove(&pgid);
            }
            Err(RecvTimeoutError::Timeout) => {
                let now = Instant::now();
                let due: Vec<u32> = deadlines.iter().filter(|(_, at)| **at <= now).map(|(pgid, _)| *pgid).collect();
                kill_groups(&due);
                deadlines.retain(|_, at| *at > now);
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    // lockgate died (or wrote nonsense): every group it told of, and every process that carries
    // this watchdog's pid, in case lockgate died between starting a program and telling of it.
    let mut pgids: HashSet<u32> = deadlines.into_keys().collect();
    pgids.extend(marked_groups(std::process::id()));
    kill_groups(&pgids.into_iter().collect::<Vec<_>>());
    std::process::exit(0)
}

/// Makes SIGHUP harmless to the watchdog. A watchdog that is stopped (SIGSTOP) when its lockgate
/// dies is in an orphaned process group, to which the kernel sends SIGHUP and then SIGCONT: the
/// hangup, at its default action, killed it before it could read the closed pipe and kill its
/// groups. Caught instead (tokio's handler stays installed for the life of the process, whatever
/// becomes of the runtime that installed it), the SIGCONT wakes it to do just that.
fn survive_hangup() {
    use tokio::signal::unix::{signal, SignalKind};
    let installed = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .and_then(|runtime| runtime.block_on(async { signal(SignalKind::hangup()) }));
    if let Err(e) = installed {
        eprintln!("lockgate command-watchdog: SIGHUP could not be caught: {e}");
    }
}

/// The process groups of the processes whose environment names watchdog `watchdog`, from /proc.
fn marked_groups(watchdog: u32) -> Vec<u32> {
    let marker = format!("{WATCHDOG_ENV}={watchdog}");
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|var| var == marker.as_bytes()))
        })
        .filter_map(|pid| process_group(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?))
        .filter(|pgid| *pgid > 1)
        .collect()
}

/// A watchdog line: `<pgid> <ms>` or `<pgid> -`.
fn parse_watchdog_line(line: &str) -> Option<(u32, Option<u64>)> {
    let (pgid, rest) = line.trim().split_once(' ')?;
    let pgid = pgid.parse().ok().filter(|p| *p > 1)?;
    match rest {
        "-" => Some((pgid, None)),
        ms => Some((pgid, Some(ms.parse().ok()?))),
    }
}

fn kill_groups(pgids: &[u32]) {
    if pgids.is_empty() {
        return;
    }
    let _ = std::process::Command::new("kill")
        .arg("-KILL")
        .arg("--")
        .args(pgids.iter().map(|p| format!("-{p}")))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

impl RawHandler for CommandExecutor {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(self.run(ctx, args))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review of §75 (helper-75, F2): a watchdog that stops reading (SIGSTOP) let its pipe fill,
    /// and every handler then waited on a write forever. A write gives up after WRITE_TIMEOUT.
    #[tokio::test]
    async fn a_line_to_a_watchdog_that_stopped_reading_gives_up() {
        let mut reader = Command::new("sleep").arg("60").stdin(Stdio::piped()).kill_on_drop(true).spawn().unwrap();
        let mut pipe = reader.stdin.take().unwrap();
        let started = Instant::now();
        let line = "4242 1000\n".repeat(20_000);
        assert!(write_line(&mut pipe, &line).await.is_err(), "a full pipe is not written");
        assert!(started.elapsed() < WRITE_TIMEOUT * 4, "{:?}", started.elapsed());
    }

    #[test]
    fn watchdog_lines_name_a_group_and_its_time_or_its_end() {
        assert_eq!(parse_watchdog_line("4242 1500"), Some((4242, Some(1500))));
        assert_eq!(parse_watchdog_line("4242 -\n"), Some((4242, None)));
        for bad in ["", "4242", "4242 x", "1 100", "0 100", "-5 100", "4242 -1", "99999999999 1"] {
            assert_eq!(parse_watchdog_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn stat_lines_are_read_after_the_command_name() {
        assert_eq!(process_group("42 (a) b (c) R 1 40 40 0"), Some(40));
        assert_eq!(process_group("42 (sleep) S"), None);
        assert!(in_group_and_alive("42 (sleep) S 1 40 40 0", 40));
        assert!(!in_group_and_alive("42 (sleep) Z 1 40 40 0", 40), "a zombie has ended");
        assert!(!in_group_and_alive("42 (sleep) S 1 41 41 0", 40));
        assert!(in_group_and_alive("42 (a) b (c) R 1 40 40 0", 40));
    }
}
