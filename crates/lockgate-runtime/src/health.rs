//! Health: what `/livez` and `/readyz` report, and the small HTTP server that serves them and
//! `/metrics` (bound to 127.0.0.1 unless configured otherwise).
//!
//! Ready means: booted, not draining, registered, its last process heartbeat landed, and no
//! service crash-looping (three crashes within a minute). A heartbeat the server refused (a
//! read-only server, an unreachable one) makes the process not ready until one lands: it can
//! neither renew nor complete. A lost LISTEN connection is reported as degraded but keeps the
//! process ready: polling still delivers every job (H20).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::metrics::{self, Metrics};

const BOOTING: u8 = 0;
const RUNNING: u8 = 1;
const DRAINING: u8 = 2;

/// Three crashes within this window mark a service as crash-looping.
const CRASH_WINDOW: Duration = Duration::from_secs(60);
const CRASH_LOOP_COUNT: usize = 3;

/// The process's health, written by the supervisor, the notifier and the registry.
#[derive(Debug, Default)]
pub struct Health {
    phase: AtomicU8,
    registered: AtomicBool,
    listen_down: AtomicBool,
    /// No LISTEN by design (transaction pooling without a listen URL): the fetch loops poll.
    listen_off: AtomicBool,
    /// Since when the process heartbeat has failed, and its last error; `None` once one lands.
    beat_failing: Mutex<Option<(Instant, String)>>,
    crashes: Mutex<HashMap<&'static str, VecDeque<Instant>>>,
}

impl Health {
    pub(crate) fn set_running(&self) {
        self.phase.store(RUNNING, Ordering::SeqCst);
    }

    pub(crate) fn set_draining(&self) {
        self.phase.store(DRAINING, Ordering::SeqCst);
    }

    pub(crate) fn set_registered(&self, registered: bool) {
        self.registered.store(registered, Ordering::SeqCst);
    }

    pub(crate) fn set_listen_down(&self, down: bool) {
        self.listen_down.store(down, Ordering::SeqCst);
    }

    pub(crate) fn set_listen_off(&self) {
        self.listen_off.store(true, Ordering::SeqCst);
    }

    /// Records a process heartbeat's outcome: a failure's error (named as a refusal to write when
    /// the server is read-only), or `None` when it landed.
    pub(crate) fn set_beat_failure(&self, error: Option<&lockgate_sql::DbError>) {
        let mut failing = self.beat_failing.lock().unwrap_or_else(|e| e.into_inner());
        *failing = error.map(|error| {
            let since = failing.as_ref().map_or_else(Instant::now, |(since, _)| *since);
            let text = if error.is_read_only() {
                format!("the server refuses writes (read-only): {error}")
            } else {
                error.to_string()
            };
            (since, text)
        });
    }

    pub fn listen_down(&self) -> bool {
        self.listen_down.load(Ordering::SeqCst)
    }

    pub(crate) fn record_crash(&self, service: &'static str) {
        let mut crashes = self.crashes.lock().unwrap_or_else(|e| e.into_inner());
        crashes.entry(service).or_default().push_back(Instant::now());
    }

    fn crash_looping(&self) -> Vec<&'static str> {
        let mut crashes = self.crashes.lock().unwrap_or_else(|e| e.into_inner());
        let mut looping = Vec::new();
        for (service, times) in crashes.iter_mut() {
            while times.front().is_some_and(|t| t.elapsed() > CRASH_WINDOW) {
                times.pop_front();
            }
            if times.len() >= CRASH_LOOP_COUNT {
                looping.push(*service);
            }
        }
        looping
    }

    /// `Ok` with notes when ready, `Err` with the reasons when not.
    pub fn readiness(&self) -> Result<Vec<String>, Vec<String>> {
        let mut reasons = Vec::new();
        match self.phase.load(Ordering::SeqCst) {
            BOOTING => reasons.push("booting".to_string()),
            DRAINING => reasons.push("draining".to_string()),
            _ => {}
        }
        if !self.registered.load(Ordering::SeqCst) {
            reasons.push("not registered in lockgate.processes".to_string());
        }
        if let Some((since, error)) = &*self.beat_failing.lock().unwrap_or_else(|e| e.into_inner()) {
            reasons.push(format!("process heartbeat failing for {}s: {error}", since.elapsed().as_secs()));
        }
        reasons.extend(self.crash_looping().into_iter().map(|s| format!("{s} is crash-looping")));
        let notes = if self.listen_off.load(Ordering::SeqCst) {
            vec!["no LISTEN under transaction pooling without listen_database_url: polling".to_string()]
        } else if self.listen_down() {
            vec!["degraded: LISTEN connection down, polling".to_string()]
        } else {
            vec![]
        };
        if reasons.is_empty() {
            Ok(notes)
        } else {
            Err(reasons)
        }
    }

    fn phase_name(&self) -> &'static str {
        match self.phase.load(Ordering::SeqCst) {
            BOOTING => "booting",
            RUNNING => "running",
            _ => "draining",
        }
    }

    /// A summary for the registry's metadata.
    pub fn summary(&self) -> Value {
        let listen = if self.listen_off.load(Ordering::SeqCst) {
            "off"
        } else if self.listen_down() {
            "down"
        } else {
            "up"
        };
        json!({ "phase": self.phase_name(), "listen": listen })
    }
}

/// Serves `/livez`, `/readyz` and `/metrics` on `addr` until `shutdown`. A bind failure is
/// logged, not fatal. A scrape only encodes what the process holds: it never queries the database.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    if let Ok(bound) = listener.local_addr() {
        tracing::info!(addr = %bound, "health endpoints on /livez and /readyz, metrics on /metrics");
    }
    let ready = Arc::clone(&health);
    let app = Router::new().route("/livez", get(|| async { (StatusCode::OK, "ok\n") })).route(
        "/readyz",
        get(move || {
            let health = Arc::clone(&ready);
            async move {
                match health.readiness() {
                    Ok(notes) => (StatusCode::OK, Json(json!({ "ready": true, "notes": notes }))),
                    Err(reasons) => {
                        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "ready": false, "reasons": reasons })))
                    }
                }
            }
        }),
    );
    let app = app.route(
        "/metrics",
        get(move || {
            let metrics = Arc::clone(&metrics);
            async move { ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], metrics.encode()) }
        }),
    );
    let served = axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await;
    if let Err(error) = served {
        tracing::warn!(%error, "health endpoints stopped");
    }
}
