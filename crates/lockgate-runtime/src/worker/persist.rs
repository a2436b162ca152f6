//! Landing a delivery's final statement through database blips (H18): a transient error is
//! retried with backoff until the statement lands or the delivery's lease is known to be over
//! (after which another delivery may own the message, and the fence makes any write moot).

use std::future::Future;
use std::time::{Duration, Instant};

use lockgate_sql::DbError;

use super::held::no_answer;

/// First pause after a failed attempt; doubled up to `MAX_PAUSE`.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
/// Long enough not to hammer a restarting server, short enough to land soon after it is back.
const MAX_PAUSE: Duration = Duration::from_secs(2);
/// How long an attempt sent as its lease ends may still wait for its answer.
const LAST_ANSWER: Duration = Duration::from_secs(2);

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
        // An attempt still unanswered when the lease ends as known at its start (or
        // `LAST_ANSWER` after it is sent, if that is later) is given up, as a lost connection
        // is: tried again while the lease lasts (the heartbeat may have renewed it). A statement
        // on a connection the network dropped without a reset was awaited for good, holding its
        // job's slot (review helper-135 F6).
        let answered = match lease_until() {
            Some(until) => {
                let sent = Instant::now();
                let give_up = until.max(sent + LAST_ANSWER);
                tokio::time::timeout_at(give_up.into(), attempt())
                    .await
                    .unwrap_or_else(|_| Err(no_answer(give_up.saturating_duration_since(sent))))
            }
            None => attempt().await,
        };
        match answered {
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// Review helper-135 F6: an attempt that is never answered is given up, and tried again
    /// while the lease lasts; once the lease has ended, persist gives up.
    #[tokio::test]
    async fn an_unanswered_attempt_is_given_up_and_tried_again_while_the_lease_lasts() {
        let tries = AtomicU32::new(0);
        // A lease the heartbeat keeps renewing: 3 s from whenever it is asked.
        let landed = persist(
            "test",
            || Some(Instant::now() + Duration::from_secs(3)),
            || async {
                if tries.fetch_add(1, Ordering::SeqCst) == 0 {
                    std::future::pending::<()>().await;
                }
                Ok::<_, DbError>(7)
            },
        );
        // The first attempt waits for the lease's end as known when it was sent, then the
        // second lands.
        let (value, failed_before) = tokio::time::timeout(Duration::from_secs(20), landed).await.unwrap().unwrap();
        assert_eq!((value, failed_before, tries.load(Ordering::SeqCst)), (7, true, 2));

        let ended = Instant::now() + Duration::from_millis(100);
        let never = persist("test", || Some(ended), std::future::pending::<Result<(), DbError>>);
        let given_up = tokio::time::timeout(LAST_ANSWER * 2, never).await.expect("given up after LAST_ANSWER");
        assert!(matches!(given_up, Err(PersistError::LeaseEnded)), "{given_up:?}");
    }
}
