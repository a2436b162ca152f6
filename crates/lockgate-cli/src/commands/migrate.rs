//! `lockgate migrate`: create the database if missing, then install or upgrade PGMQ and lockgate.

use anyhow::Result;

use crate::db;

pub async fn run(url: Option<String>) -> Result<()> {
    let url = db::resolve(url);
    db::create_database_if_missing(&url).await?;
    let pool = db::connect(&url, 2).await?;
    let report = lockgate::migrate(&pool).await?;
    if let Some(found) = report.newer {
        println!(
            "{} is at lockgate schema version {found}, newer than this build's {} and compatible with it: nothing to do",
            db::redact(&url),
            lockgate::sql::LATEST_MIGRATION
        );
        return Ok(());
    }
    if report.pgmq_preinstalled {
        println!("PGMQ was already installed; left as it was");
    }
    if report.applied.is_empty() {
        println!("lockgate schema is up to date in {} (SQL functions refreshed)", db::redact(&url));
    } else {
        println!("applied {} in {}", report.applied.join(", "), db::redact(&url));
    }
    Ok(())
}
