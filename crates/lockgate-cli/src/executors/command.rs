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
//! a pipe, for each run of a program, until when the job's lease holds, before the program
//! starts and at each renewal, and then the program's process group. The watchdog kills a run
//! shortly before that time if no renewal came (lockgate stopped renewing), and every run it
//! knows when the pipe closes (lockgate died), so a program never runs beside its job's next
//! delivery (design §75). A run is killed by its group and by its mark: every program carries
//! `LOCKGATE_WATCHDOG=<lockgate's pid>.<run>` in its environment, so a run whose group the
//! watchdog was never told (lockgate frozen or killed between the start and that line) is found
//! too. lockgate tells it a run is done once it killed the group itself, before it reaps the
//! program, so that the pgid cannot be reused while the watchdog may still target it.
//!
//! Groups are killed with killpg(2), never through a `kill` program found on PATH: a container
//! image without one (procps) silently killed nothing (review helper-84, F1).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lockgate::{JobContext, JobError, RawHandler, RunHold};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
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
/// load, measured), for the signal to be sent and delivered. Short of `FENCE_MARGIN`
/// (300 ms), so that a lockgate that runs cancels the job itself first.
const WATCHDOG_MARGIN: Duration = Duration::from_millis(150);

/// The environment variable marking, in every program and what it starts, the run it belongs to:
/// `<lockgate's pid>.<run>`.
const WATCHDOG_ENV: &str = "LOCKGATE_WATCHDOG";

/// Run ids, one per program started by this process.
static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// How long a line to the watchdog may take to write: a pipe the watchdog no longer reads (it is
/// stopped) fills up, and a handler must never wait on it. Past this the watchdog is replaced.
const WRITE_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a new watchdog may take to say it is ready (it has made SIGHUP harmless) before it is
/// given up on: no program starts under a watchdog that is not. It starts in milliseconds; the
/// wait holds every command job's line to the watchdog, so it is kept short.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// The watchdog of this process's command groups, and what it was told: started before the first
/// program, started again (and told every group) when it died or stopped reading.
static WATCHDOG: tokio::sync::Mutex<Watched> = tokio::sync::Mutex::const_new(Watched { process: None, runs: None });

struct Watched {
    process: Option<(Child, ChildStdin)>,
    /// Until when each run may go on, as last told, and its process group once started.
    runs: Option<HashMap<u64, (Instant, Option<u32>)>>,
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

/// The line telling the watchdog that run `run` may go on until `until` (less the margin).
fn lease_line(run: u64, until: Instant) -> String {
    let left = until.saturating_duration_since(Instant::now()).saturating_sub(WATCHDOG_MARGIN);
    format!("{run} {}\n", left.as_millis())
}

/// What the watchdog is told of a run: until when it may go on, and its group once known.
fn run_lines(run: u64, until: Instant, pgid: Option<u32>) -> String {
    let group = pgid.map(|pgid| format!("{run} = {pgid}\n")).unwrap_or_default();
    lease_line(run, until) + &group
}

impl Watched {
    /// A running watchdog's pipe: the one there is if it has not exited, else a new one's, told
    /// every run.
    async fn ensure(&mut self) -> std::io::Result<&mut ChildStdin> {
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
                .arg(std::process::id().to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .process_group(0)
                // Killed if given up on while starting (a wait abandoned with its job, say); the
                // running watchdog's handle lives in a static, never dropped while lockgate runs.
                .kill_on_drop(true)
                .spawn()?;
            // Given up on, it is dropped here, and killed (kill_on_drop).
            ready(&mut process).await?;
            let mut pipe = process.stdin.take().ok_or_else(|| std::io::Error::other("the watchdog has no stdin"))?;
            let lines: String =
                self.runs.iter().flatten().map(|(run, (until, pgid))| run_lines(*run, *until, *pgid)).collect();
            if !lines.is_empty() {
                write_line(&mut pipe, &lines).await?;
            }
            self.process = Some((process, pipe));
        }
        match self.process.as_mut() {
            Some((_, pipe)) => Ok(pipe),
            None => Err(std::io::Error::other("no watchdog")),
        }
    }

    /// Writes `line`, replacing a watchdog that died or stopped reading once.
    async fn send(&mut self, line: &str) -> std::io::Result<()> {
        let written = write_line(self.ensure().await?, line).await;
        if written.is_ok() {
            return written;
        }
        if let Some((mut process, _)) = self.process.take() {
            let _ = process.start_kill();
        }
        write_line(self.ensure().await?, line).await
    }
}

/// Waits for a new watchdog's one byte saying it is ready. Until then a SIGSTOP and the death of
/// lockgate would kill it with SIGHUP, its programs left running (see [`survive_hangup`]).
async fn ready(process: &mut Child) -> std::io::Result<()> {
    let mut out = process.stdout.take().ok_or_else(|| std::io::Error::other("the watchdog has no stdout"))?;
    let mut byte = [0u8; 1];
    match tokio::time::timeout(READY_TIMEOUT, out.read_exact(&mut byte)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(std::io::Error::other(format!("the watchdog exited as it started ({e})"))),
        Err(_) => Err(std::io::Error::other(format!("the watchdog was not ready within {READY_TIMEOUT:?}"))),
    }
}

async fn write_line(pipe: &mut ChildStdin, line: &str) -> std::io::Result<()> {
    match tokio::time::timeout(WRITE_TIMEOUT, pipe.write_all(line.as_bytes())).await {
        Ok(written) => written,
        Err(_) => Err(std::io::Error::other("the watchdog stopped reading")),
    }
}

/// Starts `command` as a new process group under the watchdog. The watchdog is told the run may
/// go on until `until` before the program starts, and its group once it has: a lockgate frozen
/// or killed in between leaves a run the watchdog still ends, by its mark. A program the watchdog
/// cannot be told of is not started, or killed.
async fn spawn_watched(command: &mut Command, until: Instant, hold: RunHold) -> Result<(Child, Group), String> {
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    {
        let mut watched = WATCHDOG.lock().await;
        watched.runs.get_or_insert_with(HashMap::new).insert(run, (until, None));
        if let Err(e) = watched.send(&lease_line(run, until)).await {
            watched.runs.as_mut().map(|r| r.remove(&run));
            return Err(format!("lockgate's command watchdog could not be started or told: {e}"));
        }
    }
    let mark = format!("{}.{run}", std::process::id());
    let mut child = match command.env(WATCHDOG_ENV, mark).spawn() {
        Ok(child) => child,
        Err(e) => {
            forget(run).await;
            return Err(format!("could not start it: {e}"));
        }
    };
    let Some(pgid) = child.id() else {
        forget(run).await;
        return Err("it exited before it could be tracked".to_string());
    };
    hold.describe(format!("the process group {pgid} of {:?}", command.as_std().get_program()));
    let mut group = Group::new(pgid, run, hold);
    let told = {
        let mut watched = WATCHDOG.lock().await;
        if let Some(entry) = watched.runs.as_mut().and_then(|r| r.get_mut(&run)) {
            entry.1 = Some(pgid);
        }
        watched.send(&format!("{run} = {pgid}\n")).await
    };
    if let Err(e) = told {
        group.kill_and_reap(&mut child).await;
        return Err(format!("it was stopped: lockgate's command watchdog could not be told of it: {e}"));
    }
    Ok((child, group))
}

/// Tells the watchdog that run `run` may go on until `until`.
async fn tell_lease(run: u64, until: Instant) -> std::io::Result<()> {
    let mut watched = WATCHDOG.lock().await;
    if let Some(entry) = watched.runs.as_mut().and_then(|r| r.get_mut(&run)) {
        entry.0 = until;
    }
    watched.send(&lease_line(run, until)).await
}

/// Tells the watchdog that lockgate is done with run `run`.
async fn forget(run: u64) {
    let mut watched = WATCHDOG.lock().await;
    if watched.runs.as_mut().and_then(|r| r.remove(&run)).is_some() {
        let _ = watched.send(&format!("{run} -\n")).await;
    }
}

/// Process group ids of running commands: inserted at spawn, removed once the group is gone.
static GROUPS: Mutex<Option<HashSet<u32>>> = Mutex::new(None);

fn groups() -> std::sync::MutexGuard<'static, Option<HashSet<u32>>> {
    GROUPS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Kills every command's process group still running (for exits that skip destructors).
pub fn kill_children() {
    let targets: Vec<u32> = groups().iter().flatten().copied().collect();
    kill_groups(&targets);
}

/// Sends SIGKILL to process group `pgid` (never 0 or 1: those would be lockgate's own group and
/// every process it may signal); an error (the group is gone) is nothing to do.
fn kill_group(pgid: u32) {
    if let Ok(pgid @ 2..) = i32::try_from(pgid) {
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    }
}

/// One command's process group, and its run, killed when the handler is dropped before it was
/// reaped.
struct Group {
    pgid: u32,
    run: u64,
    gone: bool,
    /// Holds the attempt in flight while any process of the group may be alive: its handler is
    /// not aborted meanwhile, and nothing is written for its job until the group is gone (H30,
    /// design §95). A process can take far longer than the handler's grace to die after SIGKILL
    /// (gigabytes to unmap, an uninterruptible I/O wait), holding its files and locks (review
    /// helper-104).
    hold: Option<RunHold>,
}

impl Group {
    fn new(pgid: u32, run: u64, hold: RunHold) -> Self {
        groups().get_or_insert_with(HashSet::new).insert(pgid);
        Self { pgid, run, gone: false, hold: Some(hold) }
    }

    /// Kills every process of the group, reaps the program, and waits until no process of the
    /// group is alive (its other members are reaped by whoever inherited them).
    async fn kill_and_reap(&mut self, child: &mut Child) {
        kill_group(self.pgid);
        // Before the program is reaped (unless it already was: it exited on its own), while its
        // pid, the group's id, cannot be given to another process.
        forget(self.run).await;
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
            // Dropped mid-run: the program itself is reaped by tokio (`kill_on_drop`); the
            // attempt stays held until no process of the group is alive.
            kill_group(self.pgid);
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(forget(self.run));
            }
            let (pgid, hold) = (self.pgid, self.hold.take());
            let waited = std::thread::Builder::new().name("lockgate-reap".into()).spawn(move || {
                while group_alive(pgid) {
                    std::thread::sleep(REAP_POLL);
                }
                drop(hold);
            });
            if let Err(e) = waited {
                tracing::warn!(pgid, error = %e, "could not wait for a killed command's processes to end");
            }
        }
        if let Some(set) = groups().as_mut() {
            set.remove(&self.pgid);
        }
    }
}

/// Whether any process of group `pgid` is alive (not a zombie), read from /proc. Where /proc is
/// not readable, killpg with no signal answers instead (zombies count as alive there).
fn group_alive(pgid: u32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return i32::try_from(pgid).is_ok_and(|pgid| killpg(Pid::from_raw(pgid), None).is_ok());
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
        None if program.starts_with('/') => anyhow::bail!("its command {program:?} was not found"),
        // Resolved as the spawn resolves it, against lockgate's working directory, whatever
        // directory the configuration file is in (review helper-92: the message did not say).
        None if program.contains('/') => {
            let cwd = std::env::current_dir().map_or_else(|_| "?".to_string(), |d| d.display().to_string());
            anyhow::bail!(
                "its command {program:?} was not found in {cwd}, the directory lockgate runs in (a relative path \
                 is not read from the configuration file's directory; give an absolute path, or run lockgate there)"
            )
        }
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
        let (mut child, mut group) = spawn_watched(&mut command, until, ctx.hold())
            .await
            .map_err(|e| JobError::new(format!("{program}: {e}")))?;
        let run = group.run;
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
            // The program's exit ends the run, whether or not its input was all written: a
            // process it left behind may hold stdin open without reading it, and a write waiting
            // on that pipe would hold the job (and its permit) until that process ended (review
            // helper-84, F2). The rest of the input goes with the pipe.
            let ran = async {
                tokio::pin!(feed);
                let mut fed = false;
                loop {
                    tokio::select! {
                        () = &mut feed, if !fed => fed = true,
                        status = child.wait() => break status,
                    }
                }
            };
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
                            if let Err(e) = tell_lease(run, until).await {
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

/// A line from lockgate to its watchdog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// `<run> <ms>`: the run may go on `ms` more from now (each such line replaces the last).
    Until(u64, u64),
    /// `<run> = <pgid>`: the run's process group.
    Group(u64, u32),
    /// `<run> -`: lockgate is done with the run.
    Done(u64),
}

/// `lockgate command-watchdog <lockgate's pid>`: watches the runs of one lockgate process's
/// command jobs, told by the lines of [`Line`] on stdin. Kills a run with SIGKILL when its time is
/// up: its group, and the group of every process its mark names. Kills every run it knows, and
/// every process marked by its lockgate, when stdin closes (lockgate died: the kernel closed the
/// pipe's other end) or a line makes no sense. Started before any async runtime (see main): plain
/// threads and a channel, so it starts fast and holds little.
pub fn watchdog() -> ! {
    survive_hangup();
    // Ready: lockgate starts no program before this byte.
    {
        use std::io::Write;
        let mut out = std::io::stdout();
        if out.write_all(b"+").and_then(|()| out.flush()).is_err() {
            std::process::exit(1);
        }
    }
    // Its lockgate, named by lockgate itself: the parent may already be another process.
    let lockgate: u32 =
        std::env::args().nth(2).and_then(|pid| pid.parse().ok()).unwrap_or_else(std::os::unix::process::parent_id);
    let (lines, updates) = mpsc::channel::<Line>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Some(update) = line.ok().as_deref().and_then(parse_watchdog_line) else { break };
            if lines.send(update).is_err() {
                break;
            }
        }
    });
    let mut runs: HashMap<u64, (Instant, Option<u32>)> = HashMap::new();
    loop {
        let next = runs.values().map(|(at, _)| *at).min();
        let update = match next {
            Some(at) => updates.recv_timeout(at.saturating_duration_since(Instant::now())),
            None => updates.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match update {
            Ok(Line::Until(run, ms)) => {
                let at = Instant::now() + Duration::from_millis(ms.min(u64::from(u32::MAX)));
                runs.entry(run).or_insert((at, None)).0 = at;
            }
            Ok(Line::Group(run, pgid)) => {
                if let Some(entry) = runs.get_mut(&run) {
                    entry.1 = Some(pgid);
                }
            }
            Ok(Line::Done(run)) => {
                runs.remove(&run);
            }
            Err(RecvTimeoutError::Timeout) => {
                let now = Instant::now();
                let due: Vec<(u64, Option<u32>)> =
                    runs.iter().filter(|(_, (at, _))| *at <= now).map(|(run, (_, pgid))| (*run, *pgid)).collect();
                let marks: HashSet<String> = due.iter().map(|(run, _)| format!("{lockgate}.{run}")).collect();
                let mut pgids: Vec<u32> = due.iter().filter_map(|(_, pgid)| *pgid).collect();
                pgids.extend(marked_groups(|mark| marks.contains(mark)));
                kill_groups(&pgids);
                runs.retain(|_, (at, _)| *at > now);
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    // lockgate died (or wrote nonsense): every run it told of, and every process it marked, in
    // case it died between starting a program and telling of its group.
    let prefix = format!("{lockgate}.");
    let mut pgids: HashSet<u32> = runs.values().filter_map(|(_, pgid)| *pgid).collect();
    pgids.extend(marked_groups(|mark| mark.starts_with(&prefix)));
    kill_groups(&pgids.into_iter().collect::<Vec<_>>());
    std::process::exit(0)
}

/// Makes SIGHUP harmless to the watchdog. A watchdog that is stopped (SIGSTOP) when its lockgate
/// dies is in an orphaned process group, to which the kernel sends SIGHUP and then SIGCONT: the
/// hangup, at its default action, killed it before it could read the closed pipe and kill its
/// runs. Caught instead (tokio's handler stays installed for the life of the process, whatever
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

/// The process groups of the processes whose mark (`LOCKGATE_WATCHDOG`) `wanted` accepts, from /proc.
fn marked_groups(wanted: impl Fn(&str) -> bool) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    let name = format!("{WATCHDOG_ENV}=");
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                env.split(|b| *b == 0).any(|var| {
                    var.strip_prefix(name.as_bytes())
                        .and_then(|mark| std::str::from_utf8(mark).ok())
                        .is_some_and(&wanted)
                })
            })
        })
        .filter_map(|pid| process_group(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?))
        .filter(|pgid| *pgid > 1)
        .collect()
}

/// A watchdog line: `<run> <ms>`, `<run> = <pgid>` or `<run> -`.
fn parse_watchdog_line(line: &str) -> Option<Line> {
    let mut words = line.split_whitespace();
    let run: u64 = words.next()?.parse().ok()?;
    let line = match (words.next()?, words.next()) {
        ("-", None) => Line::Done(run),
        ("=", Some(pgid)) => Line::Group(run, pgid.parse().ok().filter(|p| *p > 1)?),
        (ms, None) => Line::Until(run, ms.parse().ok()?),
        _ => return None,
    };
    words.next().is_none().then_some(line)
}

fn kill_groups(pgids: &[u32]) {
    for pgid in pgids {
        kill_group(*pgid);
    }
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
    fn watchdog_lines_name_a_run_and_its_time_its_group_or_its_end() {
        assert_eq!(parse_watchdog_line("7 1500"), Some(Line::Until(7, 1500)));
        assert_eq!(parse_watchdog_line("7 = 4242\n"), Some(Line::Group(7, 4242)));
        assert_eq!(parse_watchdog_line("7 -\n"), Some(Line::Done(7)));
        for bad in ["", "7", "7 x", "7 = 1", "7 = 0", "7 = x", "-5 100", "7 -1", "7 100 9", "7 = 42 9", "x 100"] {
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
