//! `lockgate dlq list|retry|purge`: operate the dead letters, by queue, by job id, or all.

use anyhow::{bail, Result};
use lockgate::sql::{
    dlq_last, dlq_list, dlq_page, dlq_purge, dlq_retry, list_queues, DeadLetter, DlqFilter, DlqRetried, DlqRetryOutcome,
};
use lockgate::PgPool;

use crate::db;
use crate::table::{self, Align, Table};

/// Arguments and errors are cut to this many characters in the listing (`--json` has them whole).
const SHOWN_CHARS: usize = 120;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// List dead letters, oldest first, with their arguments and every attempt's error.
    List {
        #[command(flatten)]
        select: Select,
        /// At most this many rows (at least 1).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
        /// Print every field as JSON: arguments, headers and every attempt's error in full.
        #[arg(long)]
        json: bool,
    },
    /// Send dead letters back to their queue to run again (same job id, attempts start over).
    Retry {
        #[command(flatten)]
        select: Select,
    },
    /// Delete dead letters for good.
    Purge {
        #[command(flatten)]
        select: Select,
    },
}

#[derive(Debug, clap::Args)]
pub struct Select {
    /// Only this queue.
    #[arg(long)]
    queue: Option<String>,
    /// Only these job ids (repeatable).
    #[arg(long = "job-id")]
    job_ids: Vec<i64>,
    /// Every dead letter (required for retry and purge without --queue or --job-id).
    #[arg(long, conflicts_with_all = ["queue", "job_ids"])]
    all: bool,
}

impl Select {
    fn filter(&self, destructive: bool) -> Result<DlqFilter> {
        let narrowed = self.queue.is_some() || !self.job_ids.is_empty();
        if destructive && !narrowed && !self.all {
            bail!("name what to act on: --queue NAME, --job-id ID (repeatable), or --all");
        }
        Ok(DlqFilter { queue: self.queue.clone(), job_ids: (!self.job_ids.is_empty()).then(|| self.job_ids.clone()) })
    }
}

/// Dead letters one statement of `dlq retry` sends back at most.
const RETRY_CHUNK: i64 = 1000;

/// Retries the dead letters `select` matches. Named by job id, in one statement; by queue or all,
/// a statement (and a transaction) per `RETRY_CHUNK` of them, in the order they died, up to the
/// last one that matched when the command started: one statement for them all held every row it
/// retried to its end, and under a `statement_timeout` shorter than its run (100,000 dead letters
/// take about 10 s) it was undone every time and nothing was ever retried (review helper-144 F8).
async fn retry(pool: &PgPool, select: &DlqFilter) -> Result<Vec<DlqRetried>> {
    if select.job_ids.is_some() {
        return Ok(dlq_retry(pool, select).await?);
    }
    let Some(upto) = dlq_last(pool, select).await? else { return Ok(Vec::new()) };
    let (mut rows, mut after) = (Vec::new(), i64::MIN);
    loop {
        let page = dlq_page(pool, select, after, upto, RETRY_CHUNK).await?;
        let Some(&(last, _)) = page.last() else { break };
        after = last;
        let chunk = DlqFilter { queue: select.queue.clone(), job_ids: Some(page.iter().map(|(_, id)| *id).collect()) };
        rows.extend(dlq_retry(pool, &chunk).await?);
    }
    Ok(rows)
}

pub async fn run(target: &db::Target, command: Command) -> Result<()> {
    let pool = db::connect_checked(target, 1).await?;
    let select = match &command {
        Command::List { select, .. } => select.filter(false)?,
        Command::Retry { select } | Command::Purge { select } => select.filter(true)?,
    };
    refuse_what_does_not_exist(&pool, &select).await?;
    match command {
        Command::List { limit, json, .. } => {
            let rows = dlq_list(&pool, &select, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print_list(&rows);
            }
        }
        Command::Retry { .. } => {
            let rows = retry(&pool, &select).await?;
            if rows.is_empty() {
                println!("nothing to retry: no dead letter matched");
                return Ok(());
            }
            let retried = rows.iter().filter(|r| matches!(r.outcome, DlqRetryOutcome::Retried { .. })).count();
            println!("retried {retried} dead letter(s)");
            let mut busy = 0;
            for r in &rows {
                let job =
                    r.job_id.map_or("of a message that was not lockgate's".to_string(), |j| format!("of job {j}"));
                match r.outcome {
                    DlqRetryOutcome::Retried { .. } => {}
                    DlqRetryOutcome::Duplicate { holder } => {
                        println!("kept a dead letter of queue {}: its unique key is held by job {holder}", r.queue)
                    }
                    DlqRetryOutcome::QueueMissing => {
                        println!(
                            "kept the dead letter {job}: its queue {q} no longer exists (its table was dropped): \
                             `SELECT lockgate.create_queue('{q}')` makes it again",
                            q = r.queue
                        )
                    }
                    DlqRetryOutcome::TypeMissing => {
                        println!("kept the dead letter {job} of queue {}: {TYPE_MISSING}", r.queue)
                    }
                    DlqRetryOutcome::Busy => {
                        busy += 1;
                        println!("kept the dead letter {job} of queue {}: {BUSY}", r.queue)
                    }
                }
            }
            if busy > 0 {
                bail!("{busy} dead letter(s) were not retried: another transaction held them; run the command again");
            }
            // A kept dead letter is no success: a script must not read "retried" into exit 0
            // (review helper-92: `job retry` of the same dead letter already exited 1).
            if retried < rows.len() {
                bail!("{} of {} dead letter(s) were not retried (named above)", rows.len() - retried, rows.len());
            }
        }
        Command::Purge { .. } => {
            let n = dlq_purge(&pool, &select).await?;
            println!("purged {n} dead letter(s)");
            // Each named one was a dead letter a moment ago: one not purged left the dead letters
            // meanwhile (a retry or purge that committed first), and may be running. A script
            // must not read exit 0 as "gone" (review helper-144 F6).
            if let Some(ids) = select.job_ids.as_ref().filter(|ids| n < ids.len() as i64) {
                bail!(
                    "{} of the {} named dead letter(s) left the dead letters before this purge (retried or purged by \
                     another operation): `lockgate job show ID` shows where each is",
                    ids.len() as i64 - n,
                    ids.len()
                );
            }
        }
    }
    Ok(())
}

/// Why a dead letter was kept for its type (`DlqRetryOutcome::TypeMissing`); shared with
/// `lockgate job retry`.
pub(crate) const TYPE_MISSING: &str =
    "its job type is not defined (removed, or never defined); define it again (lockgate.define_job_type or the \
     configuration's [job_types]) and retry, or purge the dead letter";

/// Why a dead letter was passed over (`DlqRetryOutcome::Busy`); shared with `lockgate job retry`.
pub(crate) const BUSY: &str = "another transaction holds it (a retry or purge under way, or a producer's \
                               enqueue of its unique key not yet committed)";

/// Refuses a selection naming what does not exist, so a typo is not mistaken for "nothing to do":
/// a queue that is not lockgate's and has no dead letters (a dropped queue's dead letters can
/// still be listed, retried and purged), a job id without a dead letter (on that queue, if one
/// is named). A valid selection that matches nothing is not an error.
async fn refuse_what_does_not_exist(pool: &PgPool, filter: &DlqFilter) -> Result<()> {
    if let Some(queue) = &filter.queue {
        let only_queue = DlqFilter { queue: Some(queue.clone()), job_ids: None };
        if !list_queues(pool).await?.contains(queue) && dlq_list(pool, &only_queue, 1).await?.is_empty() {
            bail!("queue \"{queue}\" does not exist (and has no dead letters)");
        }
    }
    if let Some(ids) = &filter.job_ids {
        let found = dlq_list(pool, filter, i64::MAX).await?;
        let missing: Vec<String> = ids
            .iter()
            // A dead letter without lockgate's headers has no job id: it goes by its msg_id, as
            // `lockgate job show` shows it.
            .filter(|id| !found.iter().any(|d| d.job_id.map(|j| j.0).or(d.msg_id) == Some(**id)))
            .map(i64::to_string)
            .collect();
        if !missing.is_empty() {
            let on = filter.queue.as_ref().map_or(String::new(), |q| format!(" on queue {q}"));
            bail!("no dead letter for job {}{on}", missing.join(", "));
        }
    }
    Ok(())
}

/// A table row per dead letter, each followed by its arguments and one line per failed attempt.
fn print_list(rows: &[DeadLetter]) {
    let mut t = Table::new(&[
        ("JOB", Align::Left),
        ("QUEUE", Align::Left),
        ("TYPE", Align::Left),
        ("REASON", Align::Left),
        ("ATTEMPTS", Align::Right),
        ("DEAD AT", Align::Left),
        ("ERROR", Align::Left),
    ]);
    for r in rows {
        t.row(vec![
            r.job_id.map(|j| j.0).or(r.msg_id).map_or("-".to_string(), |j| j.to_string()),
            r.queue.clone(),
            r.job_type.clone().unwrap_or_else(|| "-".into()),
            r.reason.clone(),
            r.attempts.to_string(),
            r.dead_at.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
            shorten(r.error.as_deref().unwrap_or("")),
        ]);
    }
    let lines = t.lines();
    println!("{}", lines[0]);
    for (line, r) in lines[1..].iter().zip(rows) {
        println!("{line}");
        println!("    args       {}", shorten(&r.args.as_ref().map_or("-".to_string(), |a| a.to_string())));
        for e in r.errors.as_array().into_iter().flatten() {
            let at = e["at"].as_str().and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok());
            // A lost attempt recorded no time: its worker stopped before it could.
            let at = at.map_or("-".to_string(), |at| at.to_utc().format("%Y-%m-%d %H:%M:%S UTC").to_string());
            let attempt = e["attempt"].to_string();
            let outcome =
                e["outcome"].as_str().filter(|o| *o != "failed").map(|o| format!("{o}: ")).unwrap_or_default();
            println!("    attempt {attempt:<2} {at:<23}  {outcome}{}", shorten(e["error"].as_str().unwrap_or("")));
        }
    }
}

/// One line, at most `SHOWN_CHARS` characters.
fn shorten(text: &str) -> String {
    let line = table::escaped(&text.replace('\n', " ")).into_owned();
    if line.chars().count() <= SHOWN_CHARS {
        return line;
    }
    format!("{}…", line.chars().take(SHOWN_CHARS - 1).collect::<String>())
}
