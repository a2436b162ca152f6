//! `lockgate migrate`: create the database if missing, then install or upgrade PGMQ and lockgate.
//!
//! Creating a missing database is the default, as the quick start relies on it;
//! `--create-database` says so explicitly, and is what errors about a missing database suggest
//! (a script that spells it out keeps working if the default ever changes).

use anyhow::{bail, Result};

use crate::db;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Create the database when it does not exist (the default; accepted so scripts can say it).
    #[arg(long)]
    create_database: bool,
}

pub async fn run(target: &db::Target, args: Args) -> Result<()> {
    // Both spellings create a missing database; see the module docs.
    let _ = args.create_database;
    // Its lock is a session's, and PGMQ's installer prepares statements as sqlx does: neither
    // survives a pooler that lends a server connection per transaction.
    if db::says_transaction_pooling(&target.url()) {
        bail!(
            "lockgate migrate cannot run through a transaction-mode pooler (pooler=transaction in {}): run it with \
             a direct database URL, or one through a session-mode pooler",
            db::redact(&target.url())
        );
    }
    db::create_database_if_missing(target).await?;
    let pool = db::connect(target, 2).await?;
    let report = lockgate::migrate(&pool).await?;
    let at = db::redact(&target.url());
    if let Some(found) = report.newer {
        println!(
            "{at} is at lockgate schema version {found}, newer than this build's {} and compatible with it: nothing to do",
            lockgate::sql::LATEST_MIGRATION
        );
        return Ok(());
    }
    println!("{}", report.pgmq);
    if report.applied.is_empty() {
        println!("lockgate schema is up to date in {at} (SQL functions refreshed)");
    } else {
        println!("applied {} in {at}", report.applied.join(", "));
    }
    Ok(())
}
