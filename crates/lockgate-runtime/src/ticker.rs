//! The loop every periodic service shares: run a tick every `interval` until `shutdown` fires,
//! cancellation first. A tick that overruns delays the next one instead of bunching them. A tick
//! still running when `shutdown` fires is finished first: once `run` returns, none of the
//! runtime's statements still runs on the server, where it could meet its caller's next ones (a
//! dropped sweep deadlocked with the benchmark's TRUNCATE). Every statement of a tick is held to a
//! bound (`held::on_pool`), so the wait is bounded too (design §119).

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Calls `tick` every `interval`, the first time `first` from now, until `shutdown` fires.
pub(crate) async fn every<F, Fut>(interval: Duration, first: Duration, shutdown: &CancellationToken, mut tick: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + first, interval);
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

/// A random delay shorter than `interval`: when a maintenance service makes its first pass. A
/// process's first moments go to its start-up and its first claims rather than to every pass at
/// once, and processes started together (a deploy) make their passes at spread-out moments
/// instead of all at the same one, interval after interval. At once in a restarted service
/// ([`first_pass`]).
pub(crate) fn phase(interval: Duration) -> Duration {
    first_pass(interval.mul_f64(fastrand::f64()))
}

tokio::task_local! {
    /// Set for a service the supervisor restarted after a crash.
    static RESTARTED: bool;
}

/// Runs `service` as the supervisor's restart (`restarted`) or first start of it.
pub(crate) async fn started<F: Future>(restarted: bool, service: F) -> F::Output {
    RESTARTED.scope(restarted, service).await
}

/// When a service's first pass comes: after `delay` when the process starts it, at once when
/// the supervisor restarted it after a crash, so that a service that crashes at its pass crashes
/// again at once (the crash loop shows within its window) and a restarted heartbeat does not
/// leave its row silent for one more interval.
pub(crate) fn first_pass(delay: Duration) -> Duration {
    if RESTARTED.try_with(|restarted| *restarted).unwrap_or(false) {
        Duration::ZERO
    } else {
        delay
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_phase_falls_within_its_interval_and_varies() {
        let interval = Duration::from_secs(5);
        let phases: Vec<Duration> = (0..64).map(|_| phase(interval)).collect();
        assert!(phases.iter().all(|p| *p < interval));
        assert!(phases.iter().any(|p| *p != phases[0]), "one phase for every service would bunch their passes");
    }

    #[tokio::test]
    async fn a_restarted_service_makes_its_first_pass_at_once() {
        let delay = Duration::from_secs(5);
        assert_eq!(first_pass(delay), delay, "outside the supervisor");
        assert_eq!(started(false, async { first_pass(delay) }).await, delay, "a first start");
        assert_eq!(started(true, async { first_pass(delay) }).await, Duration::ZERO, "a restart");
        assert_eq!(started(true, async { phase(delay) }).await, Duration::ZERO, "a restart's random phase");
    }

    #[tokio::test]
    async fn the_first_tick_comes_after_its_delay_and_the_others_every_interval() {
        let (shutdown, ticks, start) = (CancellationToken::new(), AtomicUsize::new(0), Instant::now());
        let first = Duration::from_millis(60);
        let mut at = Vec::new();
        every(Duration::from_millis(10), first, &shutdown, || {
            at.push(start.elapsed());
            if ticks.fetch_add(1, Ordering::SeqCst) == 2 {
                shutdown.cancel();
            }
            async {}
        })
        .await;
        assert_eq!(at.len(), 3);
        assert!(at[0] >= first, "first tick at {:?}, before its {first:?}", at[0]);
        assert!(at[2] >= first + Duration::from_millis(20), "ticks {at:?}");
    }
}
