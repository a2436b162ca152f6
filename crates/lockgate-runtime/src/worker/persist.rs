//! Landing a delivery's final statement through database blips (H18): a transient error is
//! retried with backoff until the statement lands or the delivery's lease is known to be over
//! (after which another delivery may own the message, and the fence makes any write moot). Each
//! attempt must end by itself: the callers run theirs on a connection that gives up a statement
//! not answered in time, and closes it (`held::HeldConnection`, `held::on_pool`), so that an
//! attempt on a connection the network dropped without a reset ends as a lost connection does
//! (review helper-135 F6, F7). Cut short from here, an attempt would hand its half-used
//! connection back to sqlx's pool, whose test of it waits for the lost reply (review helper-138
//! F1: one such connection per given-up statement, until the pool starved).

use std::future::Future;
use std::time::{Duration, Instant};

use lockgate_sql::DbError;

/// First pause after a failed attempt; doubled up to `MAX_PAUSE`.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
/// Long enough not to hammer a restarting server, short enough to land soon after it is back.
const MAX_PAUSE: Duration = Duration::from_secs(2);

/// Why a final statement did not land.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PersistError {
    #[error("lease ended before the database could be reached")]
    LeaseEnded,
    #[error(transparent)]
    Database(#[from] DbError),
}

/// Runs `attempt` until it succeeds, fails permanently, or `lease_until` passes. Returns the
/// value and whether any earlier try failed (so a caller can tell Ambiguous from AlreadyArchived).
pub(crate) async fn persist<T, F, Fut>(
    what: &str,
    lease_until: impl Fn() -> Option<Instant>,
    mut attempt: F,
) -> Result<(T, bool), PersistError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, DbError>>,
{
    let mut pause = FIRST_PAUSE;
    let mut failed_before = false;
    loop {
        match attempt().await {
            Ok(value) => return Ok((value, failed_before)),
            Err(err) if err.is_transient() => {
                tracing::warn!(error = %err, what, "database unavailable; will retry");
                failed_before = true;
            }
            Err(err) => return Err(err.into()),
        }
        if lease_until().is_none_or(|until| Instant::now() + pause >= until) {
            return Err(PersistError::LeaseEnded);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_PAUSE);
    }
}
