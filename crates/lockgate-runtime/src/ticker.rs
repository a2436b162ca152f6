//! The loop every periodic service shares: run a tick every `interval` until `shutdown` fires,
//! cancellation first. A tick that overruns delays the next one instead of bunching them.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Calls `tick` every `interval` (the first at once) until `shutdown` fires.
pub(crate) async fn every<F, Fut>(interval: Duration, shutdown: &CancellationToken, mut tick: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        tick().await;
    }
}
