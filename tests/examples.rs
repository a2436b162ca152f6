//! The README's examples (`examples/*.rs`, which `cargo test` also builds as programs), run
//! against a fresh database each: they must finish on their own, within a deadline. Each example
//! is compiled here as a module and its `run(url)` called, so what runs is always the current
//! source (never a stale binary), whether the examples were built or not.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::time::Duration;

use lockgate_testkit::TestDb;

#[allow(dead_code)]
#[path = "../examples/quick_start.rs"]
mod quick_start;

#[allow(dead_code)]
#[path = "../examples/producer.rs"]
mod producer;

#[allow(dead_code)]
#[path = "../examples/testing.rs"]
mod testing_example;

/// Runs an example on an empty database (it migrates it itself) and fails past `deadline`.
async fn run_example<F: Future<Output = anyhow::Result<()>>>(run: impl FnOnce(String) -> F, deadline: Duration) {
    let db = TestDb::empty().await.expect("test database");
    tokio::time::timeout(deadline, run(db.url.clone()))
        .await
        .expect("the example finishes within its deadline")
        .expect("the example succeeds");
}

#[tokio::test]
async fn quick_start_runs_its_jobs_and_stops() {
    run_example(|url| async move { quick_start::run(&url).await }, Duration::from_secs(60)).await;
}

#[tokio::test]
async fn producer_enqueues_without_a_worker() {
    run_example(|url| async move { producer::run(&url).await }, Duration::from_secs(60)).await;
}

#[tokio::test]
async fn testing_example_passes() {
    run_example(|url| async move { testing_example::run(&url).await }, Duration::from_secs(60)).await;
}

/// Every ```rust block of the README is part of an example file, named in the lines just before
/// it, so what the README shows is what compiles and runs.
#[test]
fn the_readme_shows_the_examples_as_they_are() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let lines: Vec<&str> = readme.lines().collect();
    let mut blocks = 0;
    let mut i = 0;
    while i < lines.len() {
        if lines[i] != "```rust" {
            i += 1;
            continue;
        }
        let end = i + lines[i..].iter().position(|l| *l == "```").unwrap();
        let snippet = lines[i + 1..end].join("\n");
        let named = lines[i.saturating_sub(8)..i]
            .iter()
            .rev()
            .find_map(|l| l.split("`examples/").nth(1).and_then(|rest| rest.split('`').next()))
            .unwrap_or_else(|| panic!("README line {}: a ```rust block that names no examples/ file", i + 1));
        let example = std::fs::read_to_string(format!("{root}/examples/{named}")).unwrap();
        assert!(example.contains(&snippet), "README line {}: not a part of examples/{named}", i + 1);
        blocks += 1;
        i = end + 1;
    }
    assert!(blocks >= 4, "{blocks} rust blocks");
}

/// A statement of the README's SQL API section, with what the README says it gives: rows (a
/// comment after it, or comment lines of cells below it), an empty result ("nothing", "no rows")
/// or an error (`-- ERROR: …` below it).
#[derive(Debug, Default)]
struct Example {
    readme_line: usize,
    sql: String,
    rows: Option<Vec<String>>,
    error: Option<String>,
}

/// The section's ```sql blocks, statement by statement.
fn sql_examples(readme: &str) -> Vec<Example> {
    let lines: Vec<&str> = readme.lines().collect();
    let start = lines.iter().position(|l| *l == "## SQL API").expect("an SQL API section");
    let end = start + lines[start..].iter().position(|l| *l == "## CLI reference").expect("a CLI reference");
    let mut examples: Vec<Example> = Vec::new();
    let (mut in_block, mut in_body) = (false, false);
    let mut current = Example::default();
    for (i, line) in lines.iter().enumerate().take(end).skip(start) {
        if line.trim_start().starts_with("```") {
            in_block = line.trim() == "```sql";
            continue;
        }
        if !in_block {
            continue;
        }
        let (code, comment) = match line.find("--") {
            Some(at) if !in_body => (&line[..at], Some(line[at + 2..].trim())),
            _ => (*line, None),
        };
        if code.trim().is_empty() {
            // A comment line of its own: the rows, or the error, of the statement before it.
            if let (Some(comment), Some(last)) = (comment, examples.last_mut()) {
                if let Some(error) = comment.strip_prefix("ERROR:") {
                    last.error = Some(error.split("(SQLSTATE").next().unwrap().trim().to_string());
                } else if comment.contains('|') {
                    last.rows.get_or_insert_with(Vec::new).push(cells(comment));
                }
            }
            continue;
        }
        if current.sql.is_empty() {
            current.readme_line = i + 1;
        }
        current.sql.push_str(code);
        current.sql.push('\n');
        in_body ^= code.matches("$$").count() % 2 == 1;
        if !in_body && code.trim_end().ends_with(';') {
            let checked = ["SELECT", "CALL"].iter().any(|k| current.sql.trim_start().starts_with(k));
            if let Some(said) = comment.filter(|_| checked) {
                current.rows = inline_rows(said);
            }
            examples.push(std::mem::take(&mut current));
        }
    }
    examples
}

/// A row as psql -A prints it: cells trimmed, joined by `|`.
fn cells(text: &str) -> String {
    text.split('|').map(str::trim).collect::<Vec<_>>().join("|")
}

/// What a comment after a statement says it returns: "nothing …" or "no rows" (none), rows joined
/// by " and ", each cut at its explanation (": ", ", ", " ("); None for what it cannot check.
fn inline_rows(said: &str) -> Option<Vec<String>> {
    if said.starts_with("nothing") || said.starts_with("no rows") {
        return Some(Vec::new());
    }
    if said.contains('…') {
        return None;
    }
    let cut = [": ", ", ", " ("].iter().filter_map(|sep| said.find(sep)).min().unwrap_or(said.len());
    Some(said[..cut].split(" and ").map(cells).collect())
}

/// A cell as the README shows it matches psql's, and a timing (a number with a fraction) matches
/// any number with one.
fn cell_matches(shown: &str, got: &str) -> bool {
    shown == got
        || (shown.contains('.') && shown.parse::<f64>().is_ok() && got.contains('.') && got.parse::<f64>().is_ok())
}

/// The README's SQL API examples "run in order against a freshly migrated database": run so,
/// with psql, each statement gives the rows, the empty result or the error its comments say (a
/// review, helper-81, found half of them wrong and one deleting a parked job).
#[tokio::test]
async fn the_readme_sql_examples_give_what_they_say_when_run_in_order() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let examples = sql_examples(&readme);
    assert!(examples.len() > 60, "{} statements found", examples.len());
    let db = TestDb::migrated().await.unwrap();
    let mut script = String::new();
    let mut script_lines = Vec::new();
    for (i, e) in examples.iter().enumerate() {
        script.push_str(&format!("\\echo @@{i}\n"));
        let first = script.lines().count() + 1;
        script.push_str(&e.sql);
        script_lines.push(first..script.lines().count() + 1);
    }
    let path =
        std::env::temp_dir().join(format!("lockgate-readme-{}-{:08x}.sql", std::process::id(), fastrand::u32(..)));
    std::fs::write(&path, &script).unwrap();
    let o = std::process::Command::new("psql")
        .args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=0", "-f"])
        .arg(&path)
        .arg(db.url.split('?').next().unwrap())
        .output()
        .expect("psql runs");
    std::fs::remove_file(&path).ok();
    assert!(o.status.success(), "psql: {}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let mut outputs: Vec<Vec<&str>> = vec![Vec::new(); examples.len()];
    let mut at = None;
    for line in stdout.lines() {
        match line.strip_prefix("@@").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) => at = Some(n),
            None => outputs[at.expect("output before the first statement")].push(line),
        }
    }
    let mut errors: Vec<Option<&str>> = vec![None; examples.len()];
    for line in stderr.lines() {
        let Some((place, message)) = line.split_once(": ERROR:") else { continue };
        let n: usize = place.rsplit(':').next().and_then(|n| n.parse().ok()).expect("psql names the line");
        let i = script_lines.iter().position(|r| r.contains(&n)).expect("the line of a statement");
        errors[i] = Some(message.trim());
    }
    let mut wrong = Vec::new();
    for (i, e) in examples.iter().enumerate() {
        let place = format!("README line {}: {}", e.readme_line, e.sql.lines().next().unwrap_or("").trim());
        match (&e.error, errors[i]) {
            (Some(said), Some(got)) if got.contains(said.as_str()) => {}
            (None, None) => {}
            (said, got) => wrong.push(format!("{place}\n    error said {said:?}, got {got:?}")),
        }
        if let Some(rows) = &e.rows {
            let got = &outputs[i];
            let same = rows.len() == got.len()
                && rows.iter().zip(got).all(|(r, g)| {
                    let (r, g): (Vec<&str>, Vec<&str>) = (r.split('|').collect(), g.split('|').collect());
                    r.len() == g.len() && r.iter().zip(&g).all(|(r, g)| cell_matches(r, g))
                });
            if !same {
                wrong.push(format!("{place}\n    said {rows:?}\n    gave {got:?}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
