//! The notifier: one LISTEN connection per process that wakes a pool's fetch loop as soon as a
//! job is enqueued on one of its queues (`lockgate.enqueue` notifies `lockgate_<queue>`). It is
//! an accelerator only: the fetch loop polls every `poll_interval` on its own, so a lost
//! connection costs latency, never jobs (H20). While it is down it reconnects with backoff. It
//! also hears the keys whose finished permits wait for a producer's commit (`lockgate.finished`)
//! and hands them to `FinishedPermits`, an accelerator in the same way: the sweep covers them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockgate_sql::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::maintenance::FinishedPermits;

const MAX_RECONNECT_PAUSE: Duration = Duration::from_secs(5);

pub(crate) struct Notifier {
    /// The pool whose connect options the LISTEN connection uses (it is not taken from the pool).
    db: PgPool,
    health: Arc<Health>,
    /// Channel name → the wake-ups of the pools that serve that queue.
    channels: HashMap<String, Vec<Arc<Wake>>>,
    /// Told the keys named on `lockgate.finished`.
    finished: Arc<FinishedPermits>,
}

/// A pool's wake-up: what the notifier signals when one of the pool's queues got a job. The
/// generation counts the signals, so a busy fetch loop, which is not waiting, can still tell that
/// one came (it then looks again at queues it had found empty).
#[derive(Default)]
pub(crate) struct Wake {
    notify: Notify,
    generation: AtomicU64,
}

impl Wake {
    pub fn wake(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_one();
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Waits for the next wake-up (or returns at once for one that came since the last wait).
    pub async fn notified(&self) {
        self.notify.notified().await;
    }
}

impl Notifier {
    pub fn new(db: PgPool, health: Arc<Health>, finished: Arc<FinishedPermits>) -> Self {
        Self { db, health, channels: HashMap::new(), finished }
    }

    pub fn subscribe(&mut self, queue: &str, wake: Arc<Wake>) {
        self.channels.entry(format!("lockgate_{queue}")).or_default().push(wake);
    }

    fn wake_all(&self) {
        self.channels.values().flatten().for_each(|w| w.wake());
    }

    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut pause = Duration::from_millis(100);
        loop {
            match self.listen(&shutdown).await {
                Ok(()) => return,
                Err(error) => {
                    tracing::warn!(%error, "LISTEN connection lost; polling covers wake-ups until it is back");
                    self.health.set_listen_down(true);
                    self.wake_all();
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(MAX_RECONNECT_PAUSE);
        }
    }

    /// Listens until shutdown (Ok) or a connection error (Err).
    async fn listen(&self, shutdown: &CancellationToken) -> Result<(), sqlx::Error> {
        let mut listener = PgListener::connect_with(&self.db).await?;
        let channels: Vec<&str> =
            self.channels.keys().map(String::as_str).chain(std::iter::once(lockgate_sql::FINISHED_CHANNEL)).collect();
        listener.listen_all(channels).await?;
        if self.health.listen_down() {
            tracing::info!("LISTEN connection restored");
        }
        self.health.set_listen_down(false);
        // Anything enqueued while we were not listening is found by this wake-up's claim.
        self.wake_all();
        loop {
            let notification = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                n = listener.try_recv() => n?,
            };
            match notification {
                Some(n) if n.channel() == lockgate_sql::FINISHED_CHANNEL => self.finished.finished(n.payload()),
                Some(n) => {
                    if let Some(wakes) = self.channels.get(n.channel()) {
                        wakes.iter().for_each(|w| w.wake());
                    }
                }
                None => return Err(sqlx::Error::PoolClosed),
            }
        }
    }
}
