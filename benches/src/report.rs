//! Results: one row per measure (lockgate's median/min/max over rounds, the baseline's median,
//! their ratio, the target and whether it was met), printed as a table and written as JSON.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::machine::Machine;
use crate::stats::Summary;

/// A target check: the value compared (a ratio, or milliseconds) and whether it passes.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub value: f64,
    pub met: bool,
    /// How the value reads in the table, e.g. "0.86×" or "3.1 ms".
    pub shown: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub workload: String,
    pub measure: String,
    pub unit: String,
    pub lockgate: Summary,
    /// What the baseline column holds (raw PGMQ loop, or a lockgate reference for self-relative
    /// targets), and its summary.
    pub baseline_name: Option<String>,
    pub baseline: Option<Summary>,
    /// lockgate median / baseline median.
    pub ratio: Option<f64>,
    pub target: String,
    pub check: Option<Check>,
}

impl Row {
    pub fn new(workload: &str, measure: impl Into<String>, unit: &str, lockgate: Summary) -> Self {
        Self {
            workload: workload.into(),
            measure: measure.into(),
            unit: unit.into(),
            lockgate,
            baseline_name: None,
            baseline: None,
            ratio: None,
            target: "report".into(),
            check: None,
        }
    }

    pub fn baseline(mut self, name: impl Into<String>, baseline: Option<Summary>) -> Self {
        self.ratio = baseline.as_ref().filter(|b| b.median > 0.0).map(|b| self.lockgate.median / b.median);
        self.baseline_name = Some(name.into());
        self.baseline = baseline;
        self
    }

    /// Target: lockgate/baseline ≥ `min_ratio`.
    pub fn ratio_target(mut self, min_ratio: f64) -> Self {
        self.target = format!("≥ {min_ratio}× baseline");
        self.check = self.ratio.map(|r| Check { value: r, met: r >= min_ratio, shown: format!("{r:.2}×") });
        self
    }

    /// Target: lockgate/baseline ≤ `max_ratio` (for measures where lower is better, such as
    /// latencies).
    pub fn max_ratio_target(mut self, max_ratio: f64) -> Self {
        self.target = format!("≤ {max_ratio}× baseline");
        self.check = self.ratio.map(|r| Check { value: r, met: r <= max_ratio, shown: format!("{r:.2}×") });
        self
    }

    pub fn target(mut self, target: impl Into<String>, check: Option<Check>) -> Self {
        self.target = target.into();
        self.check = check;
        self
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkloadReport {
    pub name: String,
    pub params: serde_json::Value,
    pub rows: Vec<Row>,
    /// What limits it: per-job statement counts and server times, memory, notes.
    pub diagnostics: Vec<String>,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub command: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub rounds: usize,
    pub machine: Machine,
    pub workloads: Vec<WorkloadReport>,
}

impl Report {
    pub fn write_json(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let json = serde_json::to_string_pretty(self)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))
    }

    /// The results table (Markdown, so it pastes into docs/benchmarks.md), then diagnostics.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ =
            writeln!(out, "lockgate-bench, {} rounds, {}", self.rounds, self.started_at.format("%Y-%m-%d %H:%M UTC"));
        let _ = writeln!(out, "machine: {}", self.machine.line());
        let _ = writeln!(out, "command: {}\n", self.command);
        let header =
            ["workload", "measure", "lockgate median", "min", "max", "baseline median", "ratio", "target", "result"];
        let rows: Vec<[String; 9]> = self.workloads.iter().flat_map(|w| &w.rows).map(cells).collect();
        let widths: Vec<usize> = (0..header.len())
            .map(|i| rows.iter().map(|r| r[i].chars().count()).chain([header[i].len()]).max().unwrap_or(0))
            .collect();
        let line = |cells: &[String]| {
            let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
            format!("| {} |", padded.join(" | "))
        };
        let _ = writeln!(out, "{}", line(&header.map(String::from)));
        let _ = writeln!(out, "{}", line(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>()));
        for row in &rows {
            let _ = writeln!(out, "{}", line(row));
        }
        for w in self.workloads.iter().filter(|w| !w.diagnostics.is_empty()) {
            let _ = writeln!(out, "\n{} ({:.0} s):", w.name, w.seconds);
            for d in &w.diagnostics {
                let _ = writeln!(out, "  {d}");
            }
        }
        out
    }
}

fn cells(row: &Row) -> [String; 9] {
    let v = |x: f64| format_value(x, &row.unit);
    let result = match &row.check {
        Some(c) if c.met => format!("met ({})", c.shown),
        Some(c) => format!("MISSED ({})", c.shown),
        None => "–".into(),
    };
    [
        row.workload.clone(),
        format!("{} ({})", row.measure, row.unit),
        v(row.lockgate.median),
        v(row.lockgate.min),
        v(row.lockgate.max),
        match (&row.baseline, &row.baseline_name) {
            (Some(b), Some(name)) => format!("{} ({name})", v(b.median)),
            _ => "–".into(),
        },
        row.ratio.map_or("–".into(), |r| format!("{r:.2}×")),
        row.target.clone(),
        result,
    ]
}

/// Rates and sizes as whole numbers with thousands separators; milliseconds, MiB and percentages
/// with decimals.
pub fn format_value(x: f64, unit: &str) -> String {
    match unit {
        "ms" => return format!("{x:.2}"),
        "MiB" => return format!("{x:+.1}"),
        "%" => return format!("{x:.1}"),
        _ => {}
    }
    let whole = x.round() as i64;
    let digits = whole.abs().to_string();
    let mut grouped = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(ch);
    }
    if whole < 0 {
        grouped.insert(0, '-');
    }
    grouped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_group_thousands_and_latencies_keep_two_decimals() {
        assert_eq!(format_value(1234567.4, "jobs/s"), "1,234,567");
        assert_eq!(format_value(999.0, "jobs/s"), "999");
        assert_eq!(format_value(4.456, "ms"), "4.46");
        assert_eq!(format_value(0.44, "%"), "0.4");
    }
}
