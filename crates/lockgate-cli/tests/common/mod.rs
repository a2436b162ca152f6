//! Shared arrangements for the tests that run the real `lockgate` binary as child processes:
//! a scratch directory with a config, spawning and signalling processes, bounded waits.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use lockgate_testkit::{wait_for, wait_for_count, TestDb};

pub const WAIT: Duration = Duration::from_secs(20);

/// Short timings for tests: leases lapse in 2 s, polling every 200 ms; no health port (many
/// processes run at once on this host).
pub const DEFAULT_RUNTIME: &str = "visibility_timeout = \"2s\"\nheartbeat_interval = \"300ms\"\n\
    shutdown_timeout = \"1s\"\npoll_interval = \"200ms\"\nhealth_listen = \"off\"";

/// An SQL function that catches its cancel (`query_canceled`) and sleeps on: a statement only a
/// terminate of its backend ends early.
pub const STUBBORN_SLEEP: &str = "CREATE FUNCTION stubborn_sleep(jsonb) RETURNS void LANGUAGE plpgsql AS $$
     BEGIN
         PERFORM pg_sleep(30);
     EXCEPTION WHEN query_canceled THEN
         PERFORM pg_sleep(30);
     END $$;";

pub fn lockgate(db: &TestDb, args: &[&str]) -> Command {
    with_test_env(Command::new(env!("CARGO_BIN_EXE_lockgate")), db, args)
}

/// `cmd` given `args` and the tests' environment for lockgate: the database, the log filter.
fn with_test_env(mut cmd: Command, db: &TestDb, args: &[&str]) -> Command {
    cmd.args(args).env("DATABASE_URL", &db.url).env("LOCKGATE_LOG", "info,sqlx=warn");
    cmd
}

pub fn output(db: &TestDb, args: &[&str]) -> Output {
    lockgate(db, args).output().expect("lockgate runs")
}

/// Waits until `sql` counts `n`, then stops `child` (started with its output piped) with TERM,
/// checks that it exited 0, and returns its output. Not counted within `WAIT`, it is killed and the
/// test fails saying `what` went wrong, with the output.
pub async fn stopped_once_counted(db: &TestDb, mut child: Child, sql: &str, n: i64, what: &str) -> Output {
    if let Err(e) = lockgate_testkit::wait_for_count(&db.pool, sql, n, WAIT).await {
        child.kill().unwrap();
        let o = child.wait_with_output().unwrap();
        panic!("{e}: {what}\n{}", text(&o));
    }
    signal(&child, "TERM");
    let status = wait_exit(&mut child).await;
    let o = child.wait_with_output().unwrap();
    assert!(status.success(), "{}", text(&o));
    o
}

pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A scratch directory with a config whose one job type runs `script` with `sh -c`. The
/// processes it started that are still running when it is dropped (a test that failed half-way)
/// are killed, so a failed test leaves nothing behind.
pub struct Setup {
    pub dir: PathBuf,
    pub config: PathBuf,
    started: std::sync::Mutex<Vec<u32>>,
}

impl Setup {
    pub fn new(script: &str, extra: &str) -> Self {
        Self::with_runtime(DEFAULT_RUNTIME, script, extra)
    }

    /// A config with `runtime` as its [runtime] section and one job type `task` running `script`
    /// (with `$DIR` replaced by the scratch directory) plus the `extra` job-type keys.
    pub fn with_runtime(runtime: &str, script: &str, extra: &str) -> Self {
        Self::with_job_type(runtime, &format!("command = [\"sh\", \"-c\", {script:?}]\n{extra}"))
    }

    /// A config with `runtime` as its [runtime] section and one job type `task` made of `keys`
    /// (with `$DIR` replaced by the scratch directory).
    pub fn with_job_type(runtime: &str, keys: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("lockgate-test-{}-{:08x}", std::process::id(), fastrand::u32(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("lockgate.toml");
        let keys = keys.replace("$DIR", dir.to_str().unwrap());
        let text = format!(
            "[runtime]\n{runtime}\n\n[[pool]]\nqueues = [\"default\"]\nconcurrency = 2\n\n[job_types.task]\n{keys}\n"
        );
        std::fs::write(&config, text).unwrap();
        Self { dir, config, started: Default::default() }
    }

    pub fn run(&self, db: &TestDb) -> Child {
        self.start(lockgate(db, &["run", "--config", self.config.to_str().unwrap()]), Stdio::null())
    }

    /// Like `run`, in a session of its own (`setsid`, which execs it in place), as a service
    /// manager starts it. Whatever process inherits its children when it dies is then in another
    /// session, so the kernel counts their process groups orphaned (wakes a stopped one with
    /// SIGHUP and SIGCONT) on any machine: in the test's session, a reaper of that session (CI's
    /// may be one) left them not orphaned and never woken.
    pub fn run_in_own_session(&self, db: &TestDb) -> Child {
        let mut setsid = Command::new("setsid");
        setsid.arg(env!("CARGO_BIN_EXE_lockgate"));
        self.start(with_test_env(setsid, db, &["run", "--config", self.config.to_str().unwrap()]), Stdio::null())
    }

    /// Like `run`, with global flags before `run` (e.g. `--log-format json`) and stderr written
    /// to `stderr`.
    pub fn run_with(&self, db: &TestDb, flags: &[&str], stderr: Stdio) -> Child {
        let mut args = flags.to_vec();
        args.extend(["run", "--config", self.config.to_str().unwrap()]);
        self.start(lockgate(db, &args), stderr)
    }

    /// Starts `run` (its stdout discarded, its stderr to `stderr`), recorded to be killed if the
    /// test fails half-way.
    pub fn start(&self, mut run: Command, stderr: Stdio) -> Child {
        let child = run.stdout(Stdio::null()).stderr(stderr).spawn().unwrap();
        self.started.lock().unwrap().push(child.id());
        child
    }

    pub fn starts(&self) -> usize {
        std::fs::read_to_string(self.dir.join("starts")).map(|s| s.lines().count()).unwrap_or(0)
    }

    pub async fn wait_starts(&self, n: usize) {
        wait_for(&format!("{n} job start(s)"), WAIT, || async { Ok((self.starts() >= n).then_some(())) })
            .await
            .unwrap();
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let config = self.config.to_string_lossy().into_owned();
        for pid in self.started.lock().map(|p| p.clone()).unwrap_or_default() {
            // Only a process still running this setup's config (the pid may have been reused).
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&config) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// First start: record it and run for a long time; later starts: record and succeed.
pub const LONG_FIRST_RUN: &str = "cat >/dev/null; echo start >> $DIR/starts; \
    if [ ! -f $DIR/first ]; then touch $DIR/first; exec sleep 30; fi";

/// A migrated database where `setup`'s job types are defined: defining them is part of `lockgate
/// run`, so it is started once and stopped with TERM.
pub async fn defined(setup: &Setup) -> TestDb {
    let db = TestDb::migrated().await.unwrap();
    let mut child = setup.run(&db);
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.processes WHERE kind = 'supervisor'", 1, WAIT)
        .await
        .unwrap();
    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success());
    db
}

/// A database as `defined` makes it, with one job of type `task` enqueued.
pub async fn migrated_with_one_job(setup: &Setup) -> TestDb {
    let db = defined(setup).await;
    let o = output(&db, &["enqueue", "task", "{\"n\": 1}"]);
    assert!(o.status.success(), "{}", text(&o));
    db
}

pub fn signal(child: &Child, name: &str) {
    let status = Command::new("kill").args(["-s", name, &child.id().to_string()]).status().unwrap();
    assert!(status.success());
}

pub async fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(std::time::Instant::now() < deadline, "the process did not exit within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
