//! Statement budgets of the runtime's own connections (H28). A runtime statement that waits on a
//! row lock (a producer's open transaction on a key, another process's completion) or runs long
//! must give up while the deliveries it touches still have budget left, instead of waiting for
//! as long as the other transaction pleases: `lock_timeout` and `statement_timeout` are set per
//! connection, in the startup options of the runtime's own pools, never on a caller's pool, so a
//! user's transactions through `Client` are left alone. A statement that gives up fails with
//! SQLSTATE 55P03 or 57014, which the persist and retry loops treat as transient.

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

use crate::RuntimeConfig;

/// How long a statement on one kind of connection may wait for a lock, and run in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Budget {
    pub lock: Duration,
    pub statement: Duration,
}

impl Budget {
    /// Claims, completions, retries, dead-letters, returns and sweeps. A claim's deliveries
    /// start their budget (`visibility_timeout`, or a shorter lease) before the statement is
    /// sent, so a claim may use at most a quarter of it and still hand over three quarters;
    /// waiting for a lock may use half of that. A completion that gives up is retried while its
    /// delivery's budget lasts, and between its attempts the heartbeat can renew it.
    pub fn runtime(config: &RuntimeConfig) -> Self {
        let statement = at_least_1ms(config.visibility_timeout / 4);
        Self { lock: at_least_1ms(statement / 2), statement }
    }

    /// The heartbeat's renewals. One renewal that has not landed within half an interval is
    /// abandoned (the next tick tries again on a fresh statement), so one slow renewal never
    /// delays the next and every tick's statement has ended before the next one is sent. The
    /// renewal never waits for a row lock (it skips locked rows), so the lock budget only guards
    /// against a future change of the SQL.
    pub fn heartbeat(config: &RuntimeConfig) -> Self {
        let statement = at_least_1ms(config.heartbeat_interval / 2);
        Self { lock: at_least_1ms(statement / 2), statement }
    }

    /// The process registry's heartbeats and prunes: one tick's statements end within one
    /// `process_heartbeat_interval`, so a stuck prune cannot stall the process's own heartbeat.
    pub fn registry(config: &RuntimeConfig) -> Self {
        let statement = at_least_1ms(config.process_heartbeat_interval);
        Self { lock: at_least_1ms(statement / 2), statement }
    }

    /// `options` with this budget in its startup parameters, and READ COMMITTED as the default
    /// isolation: lockgate's statements are written for it, whatever the database's default. At
    /// REPEATABLE READ a completion's snapshot, older than its lock of a key's row, missed a job
    /// parked behind the key meanwhile (review helper-76). And no `idle_session_timeout`: the
    /// runtime's connections idle between their uses by design (the heartbeat's between two
    /// renewals, the LISTEN connection between notifications), and a server that ended them at
    /// a database's timeout failed every renewal (review helper-80). Not under transaction pooling:
    /// PgBouncer refuses a connection that sends `options`, and a session setting would follow
    /// the server connection to other clients; the budgets are then the role's (README,
    /// "Poolers").
    pub fn apply(self, options: PgConnectOptions) -> PgConnectOptions {
        if lockgate_sql::pooler::transaction_pooling() {
            return options;
        }
        options.options([
            ("lock_timeout", format!("{}ms", self.lock.as_millis())),
            ("statement_timeout", format!("{}ms", self.statement.as_millis())),
            // A space in a startup option's value is escaped with a backslash.
            ("default_transaction_isolation", r"read\ committed".to_string()),
            ("idle_session_timeout", "0".to_string()),
        ])
    }
}

/// Zero would mean "no limit" to PostgreSQL.
fn at_least_1ms(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h28_budgets_fit_inside_the_lease_and_the_heartbeat_interval() {
        let config = RuntimeConfig::default();
        let runtime = Budget::runtime(&config);
        assert!(runtime.lock < runtime.statement && runtime.statement * 2 < config.visibility_timeout);
        let heartbeat = Budget::heartbeat(&config);
        assert!(heartbeat.statement < config.heartbeat_interval);
        let tiny = RuntimeConfig { heartbeat_interval: Duration::from_millis(1), ..config };
        assert_eq!(Budget::heartbeat(&tiny).lock, Duration::from_millis(1), "never 0, which means no limit");
    }
}
