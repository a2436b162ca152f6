//! Finished permits: a job of a limited key that finished while another transaction held the
//! key's row (a producer that enqueued a job of the key and has not committed) leaves its permit
//! on its lease, marked finished, rather than wait inside its completion (design §72). Once that
//! completion commits, `lockgate._release_leases` names the key on `lockgate.finished`; the
//! notifier hands it here, and a statement of its own gives the permit back to the key's parked
//! jobs as soon as the producer commits. It waits for the key's row holding nothing else, so it
//! can close no cycle, and briefly (`TRY`): a key still held is tried again after a pause that
//! grows, for about two seconds, without holding a slot meanwhile, so one long producer
//! transaction over many keys does not stall the others (review of §72, helper-74). A row held
//! longer is left to the key's next holder or the concurrency sweep, which give such permits
//! back too. An accelerator only, like the notifier that feeds it. A try not answered within the
//! runtime's bound is given up with its connection (`held::on_pool`), so it frees its slot.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockgate_sql::PgPool;
use tokio::sync::Semaphore;

use crate::held::on_pool;

/// How long one try waits for the key's row: producer transactions are most often a few
/// milliseconds long.
const TRY: Duration = Duration::from_millis(100);

/// The pauses between tries of a key still held: about two seconds in all.
const PAUSES: [Duration; 5] = [
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(200),
    Duration::from_millis(400),
    Duration::from_millis(800),
];

/// Tries at once: each holds a connection of the runtime's pool while it waits.
const AT_ONCE: usize = 2;

pub(crate) struct FinishedPermits {
    db: PgPool,
    /// How long one try may go unanswered.
    within: Duration,
    slots: Semaphore,
    /// Keys with a give-back under way, and whether another notification came meanwhile (it may
    /// name a permit the one under way looked for too early: it runs once more).
    pending: Mutex<HashMap<String, bool>>,
}

impl FinishedPermits {
    pub fn new(db: PgPool, within: Duration) -> Self {
        Self { db, within, slots: Semaphore::new(AT_ONCE), pending: Mutex::new(HashMap::new()) }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<String, bool>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A notification naming `key`: gives its finished permits back, in a task.
    pub fn finished(self: &Arc<Self>, key: &str) {
        {
            let mut pending = self.pending();
            if let Some(again) = pending.get_mut(key) {
                *again = true;
                return;
            }
            pending.insert(key.to_string(), false);
        }
        let this = Arc::clone(self);
        let key = key.to_string();
        tokio::spawn(async move {
            loop {
                let mut pauses = PAUSES.iter();
                loop {
                    let given = match this.slots.acquire().await {
                        Ok(_slot) => {
                            on_pool(&this.db, this.within, async |c| {
                                lockgate_sql::give_back_finished(c, &key, TRY).await
                            })
                            .await
                        }
                        Err(_) => break,
                    };
                    match (given, pauses.next()) {
                        (Ok(true), _) => break,
                        (Ok(false), Some(pause)) => tokio::time::sleep(*pause).await,
                        (Ok(false), None) => {
                            tracing::debug!(key, "finished permit left to the sweep: its key's row stays held");
                            break;
                        }
                        (Err(error), _) => {
                            tracing::warn!(%error, key, "giving back a finished permit failed");
                            break;
                        }
                    }
                }
                let mut pending = this.pending();
                if pending.get(&key) == Some(&true) {
                    pending.insert(key.clone(), false);
                    continue;
                }
                pending.remove(&key);
                return;
            }
        });
    }
}
