//! Progress while a run goes: one bar per measured step (jobs done of jobs to do, with the
//! live rate) under the workload's spinner, and a log line per finished measurement. Hidden when
//! disabled; indicatif also hides it when stderr is not a terminal.

use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Clone)]
pub struct Progress {
    multi: MultiProgress,
}

impl Progress {
    pub fn new(enabled: bool) -> Self {
        let target = if enabled { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
        Self { multi: MultiProgress::with_draw_target(target) }
    }

    /// A bar of `len` jobs for one measured step; finish it with `done`.
    pub fn bar(&self, len: u64, label: impl Into<String>) -> ProgressBar {
        let style =
            ProgressStyle::with_template("{prefix:>32} [{bar:30}] {human_pos}/{human_len} {per_sec:>12} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
        let bar = self.multi.add(ProgressBar::new(len).with_style(style).with_prefix(label.into()));
        bar.enable_steady_tick(Duration::from_millis(200));
        bar
    }

    /// A spinner for unmeasured steps (creating databases, filling queues).
    pub fn spinner(&self, label: impl Into<String>) -> ProgressBar {
        let style = ProgressStyle::with_template("{spinner} {prefix} {msg} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        let bar = self.multi.add(ProgressBar::new_spinner().with_style(style).with_prefix(label.into()));
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    }

    /// A warning: above the bars when they are drawn, else on stderr.
    pub fn warn(&self, line: impl AsRef<str>) {
        if self.multi.is_hidden() {
            eprintln!("warning: {}", line.as_ref());
        } else {
            let _ = self.multi.println(format!("warning: {}", line.as_ref()));
        }
    }

    /// Prints a line above the bars (nothing when hidden).
    pub fn note(&self, line: impl AsRef<str>) {
        let _ = self.multi.println(line.as_ref());
    }
}
