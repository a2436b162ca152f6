//! The pool's claim slots, and how many of them it may hold.
//!
//! A slot is held from a delivery's claim until its executor is done with it, so the pool holds
//! at most `limit` deliveries: the ones running plus the ones claimed ahead, waiting in memory
//! for a handler slot. How far ahead it claims adapts to the jobs: enough to cover what the
//! handlers consume during about two claim round trips (so a freed handler slot never waits for
//! a claim), never fewer than `concurrency` and never more than five times it. Fast jobs thus
//! get large claims, one commit carrying many jobs; slow jobs are never hoarded by one process
//! while another has free handlers, since few of them finish during a round trip. The
//! claim-ahead is also bounded in bytes (`max_claim_ahead_bytes`), by the average size of the
//! arguments claimed so far: large payloads are claimed fewer at a time, down to none ahead. The
//! pool's first claim, before any size is known, is for its free handler slots only.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Deliveries the pool holds (claimed and not yet finished by their executor).
#[derive(Default)]
pub(crate) struct ClaimSlots {
    held: AtomicUsize,
    freed: Notify,
}

/// One held delivery's slot; dropping it frees the slot and wakes the fetch loop.
pub(crate) struct Slot(Arc<ClaimSlots>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::SeqCst);
        self.0.freed.notify_one();
    }
}

impl ClaimSlots {
    /// Waits until fewer than `limit` deliveries are held, then takes every free slot up to it.
    /// Only the fetch loop takes slots, so nothing can take the room between the check and the add.
    pub async fn take(self: &Arc<Self>, limit: usize) -> Vec<Slot> {
        loop {
            let taken = self.try_take(limit);
            if !taken.is_empty() {
                return taken;
            }
            // A slot freed since the check left a stored wake-up: this returns at once.
            self.freed.notified().await;
        }
    }

    /// Takes every free slot up to `limit` without waiting (none when the pool is full).
    pub fn try_take(self: &Arc<Self>, limit: usize) -> Vec<Slot> {
        let held = self.held.load(Ordering::SeqCst);
        let room = limit.saturating_sub(held);
        self.held.fetch_add(room, Ordering::SeqCst);
        (0..room).map(|_| Slot(Arc::clone(self))).collect()
    }
}

/// How often the handlers' consumption rate is re-measured.
const RATE_WINDOW: Duration = Duration::from_millis(10);
/// Weight of the newest measurement in the moving averages.
const SMOOTHING: f64 = 0.5;

/// Sizes the pool's claim-ahead from the handlers' consumption rate and the claim round trip.
pub(crate) struct Prefetch {
    concurrency: usize,
    /// Jobs started since `window_start`.
    started: usize,
    window_start: Instant,
    /// Jobs started per second (moving average).
    rate: f64,
    /// Seconds per claim statement (moving average).
    latency: f64,
    max_ahead_bytes: usize,
    /// Bytes of arguments per claimed job (moving average); `None` until a claim returned jobs.
    payload: Option<f64>,
}

impl Prefetch {
    pub fn new(concurrency: usize, max_ahead_bytes: usize) -> Self {
        Self {
            concurrency,
            started: 0,
            window_start: Instant::now(),
            rate: 0.0,
            latency: 0.0,
            max_ahead_bytes,
            payload: None,
        }
    }

    /// A claim returned `jobs` jobs whose arguments take about `bytes` bytes.
    pub fn observe_payloads(&mut self, bytes: usize, jobs: usize) {
        if jobs > 0 {
            let each = bytes as f64 / jobs as f64;
            self.payload = Some(self.payload.map_or(each, |avg| SMOOTHING * each + (1.0 - SMOOTHING) * avg));
        }
    }

    pub fn observe_claim(&mut self, took: Duration) {
        self.latency = SMOOTHING * took.as_secs_f64() + (1.0 - SMOOTHING) * self.latency;
    }

    pub fn observe_started(&mut self, jobs: usize) {
        self.started += jobs;
    }

    /// The most deliveries the pool may hold now: its handler slots plus the claim-ahead.
    pub fn limit(&mut self, now: Instant) -> usize {
        let elapsed = now.saturating_duration_since(self.window_start);
        if elapsed >= RATE_WINDOW {
            let rate = self.started as f64 / elapsed.as_secs_f64();
            self.rate = SMOOTHING * rate + (1.0 - SMOOTHING) * self.rate;
            self.started = 0;
            self.window_start = now;
        }
        let cover = (2.0 * self.rate * self.latency).ceil() as usize;
        let ahead = cover.clamp(self.concurrency, 5 * self.concurrency);
        let by_bytes = match self.payload {
            None => 0,
            Some(each) => (self.max_ahead_bytes as f64 / each.max(1.0)).floor() as usize,
        };
        self.concurrency + ahead.min(by_bytes)
    }
}

/// About how many bytes a JSON value takes in memory as text: its strings and keys, and a few
/// bytes for every other value. Cheap (no allocation), for sizing the claim-ahead.
pub(crate) fn approx_bytes(value: &serde_json::Value) -> usize {
    use serde_json::Value;
    match value {
        Value::Null | Value::Bool(_) | Value::Number(_) => 8,
        Value::String(s) => s.len() + 2,
        Value::Array(items) => 2 + items.iter().map(approx_bytes).sum::<usize>(),
        Value::Object(fields) => 2 + fields.iter().map(|(k, v)| k.len() + 3 + approx_bytes(v)).sum::<usize>(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_jobs_are_claimed_one_pool_ahead_and_fast_ones_up_to_five() {
        let start = Instant::now();
        let mut slow = Prefetch::new(16, usize::MAX);
        assert_eq!(slow.limit(start), 16, "the first claim, before any payload size is known: free slots only");
        slow.observe_payloads(16 * 100, 16);
        slow.observe_claim(Duration::from_millis(2));
        slow.observe_started(16); // 16 jobs in a second: one-second jobs
        assert_eq!(slow.limit(start + Duration::from_secs(1)), 32);

        let mut fast = Prefetch::new(16, usize::MAX);
        fast.observe_payloads(100, 1);
        for window in 1..=10 {
            fast.observe_claim(Duration::from_millis(2));
            fast.observe_started(2_000); // 20,000 jobs a second
            fast.limit(start + RATE_WINDOW * window);
        }
        assert_eq!(fast.limit(start + RATE_WINDOW * 10), 96);
    }

    #[test]
    fn the_claim_ahead_holds_at_most_its_bytes_of_arguments() {
        let start = Instant::now();
        let mib = 1024 * 1024;
        let mut big = Prefetch::new(16, 16 * mib);
        big.observe_payloads(16 * mib, 16);
        for window in 1..=10 {
            big.observe_claim(Duration::from_millis(2));
            big.observe_started(2_000);
            big.limit(start + RATE_WINDOW * window);
        }
        assert_eq!(big.limit(start + RATE_WINDOW * 10), 16 + 16, "1 MiB jobs: 16 ahead, not 80");
        big.observe_payloads(8 * mib, 2); // 4 MiB each, weighed with the past: 2.5 MiB
        assert_eq!(big.limit(start + RATE_WINDOW * 10), 16 + 6);
        let mut none = Prefetch::new(4, 0);
        none.observe_payloads(40, 4);
        assert_eq!(none.limit(start), 4, "a cap of 0: claims only for free handler slots");
        let small = serde_json::json!({"account": 7, "note": "hello", "tags": ["a", "b"]});
        assert_eq!(approx_bytes(&small), 2 + (7 + 3 + 8) + (4 + 3 + 7) + (4 + 3 + 2 + 3 + 3));
    }

    #[tokio::test]
    async fn slots_wait_for_room_and_free_on_drop() {
        let slots = Arc::new(ClaimSlots::default());
        let first = slots.take(3).await;
        assert_eq!(first.len(), 3);
        assert!(slots.try_take(3).is_empty());
        let waiter = tokio::spawn({
            let slots = Arc::clone(&slots);
            async move { slots.take(3).await.len() }
        });
        drop(first);
        assert_eq!(waiter.await.unwrap(), 3);
        assert_eq!(slots.held.load(Ordering::SeqCst), 0);
    }
}
