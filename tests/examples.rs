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
