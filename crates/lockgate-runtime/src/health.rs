//! Health: what `/livez` and `/readyz` report, and the small HTTP server that serves them and
//! `/metrics` (bound to 127.0.0.1 unless configured otherwise).
//!
//! Ready means: booted, not draining, registered, its last process heartbeat landed, and no
//! service crash-looping (three crashes within a minute). A heartbeat the server refused (a
//! read-only server, an unreachable one) makes the process not ready until one lands: it can
//! neither renew nor complete. A lost LISTEN connection is reported as degraded but keeps the
//! process ready: polling still delivers every job (H20).
//!
//! The server takes at most `MAX_CONNECTIONS` connections at once (more wait in the kernel's
//! backlog) and serves each for `CONNECTION_LIFETIME` at most: a peer that opened thousands of
//! idle connections took the file descriptors the jobs needed, and every job failed; one that sent
//! half a request held the process's shutdown for as long as it pleased (review helper-140 F12,
//! F3). At shutdown, requests in progress get `SHUTDOWN_GRACE`, then every connection is dropped.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
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

/// The socket of `health_listen`, bound before anything else is done: an address the operator
/// chose that cannot be bound fails the start, before anything is written; only the CLI's default
/// address (`health_listen_optional`), which another process on the host may hold, is skipped
/// with a warning. `None` when the endpoints are off.
pub fn bind(config: &crate::RuntimeConfig) -> Result<Option<std::net::TcpListener>, crate::RuntimeError> {
    let Some(addr) = config.health_listen else { return Ok(None) };
    match std::net::TcpListener::bind(addr) {
        Ok(listener) => Ok(Some(listener)),
        Err(error) if config.health_listen_optional => {
            tracing::warn!(%addr, %error, "health endpoints not served: cannot bind the default address");
            Ok(None)
        }
        Err(source) => Err(crate::RuntimeError::HealthListen { addr, source }),
    }
}

/// Serves `/livez` (200) and `/readyz` (503, booting) on `listener` until `stop`: for a caller
/// that waits for the database before it can build its runtime (`lockgate run`), which then
/// serves them on a clone of the same socket ([`Runtime::with_health_listener`](crate::Runtime)),
/// so that no probe finds the port closed meanwhile (review helper-140 F11).
pub async fn serve_booting(listener: std::net::TcpListener, stop: CancellationToken) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = TcpListener::from_std(listener)?;
    serve(listener, Arc::new(Health::default()), Arc::new(Metrics::default()), stop).await;
    Ok(())
}

/// Serves `/livez`, `/readyz` and `/metrics` on `addr` until `shutdown`. A bind failure is
/// logged, not fatal. A scrape only encodes what the process holds: it never queries the database.
pub(crate) async fn serve(
    listener: TcpListener,
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
    let listener = BoundedListener { inner: listener, slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)) };
    let stop = shutdown.clone();
    let served = axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await });
    tokio::select! {
        served = served => {
            if let Err(error) = served {
                tracing::warn!(%error, "health endpoints stopped");
            }
        }
        () = async { shutdown.cancelled().await; tokio::time::sleep(SHUTDOWN_GRACE).await } => {
            tracing::debug!("health connections still open at shutdown: dropped");
        }
    }
}

/// Connections the health server serves at once.
const MAX_CONNECTIONS: usize = 64;

/// How long one connection is served: a probe or a scrape takes milliseconds.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(10);

/// How long requests in progress at shutdown may take to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// A TCP listener that accepts a connection only while it serves fewer than its slots.
struct BoundedListener {
    inner: TcpListener,
    slots: Arc<Semaphore>,
}

impl axum::serve::Listener for BoundedListener {
    type Io = BoundedConnection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (BoundedConnection, SocketAddr) {
        let slot = Arc::clone(&self.slots).acquire_owned().await.expect("the slots are never closed");
        let (io, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        (BoundedConnection::new(io, slot), addr)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// How long a connection may take to send a request's head, from its accept or from its last
/// response: a probe or a scraper sends it at once. One that sends nothing, or half a head, gives
/// its slot back then: 64 such connections held every slot for their whole lifetime, and the
/// orchestrator's probes went unanswered (review helper-142 F6).
const REQUEST_HEAD_WITHIN: Duration = Duration::from_secs(1);

/// A connection holding its listener's slot until it is dropped, whose reads fail once its
/// lifetime is over, or once a request's head is late (the server then closes it).
struct BoundedConnection {
    io: TcpStream,
    _slot: OwnedSemaphorePermit,
    lifetime_ends: tokio::time::Instant,
    /// When the head of the request under way must be in; `None` while one is being answered.
    head_by: Option<tokio::time::Instant>,
    /// The last four bytes read, to find a head's end (an empty line) across reads.
    last4: u32,
    timer: Pin<Box<Sleep>>,
}

impl BoundedConnection {
    fn new(io: TcpStream, slot: OwnedSemaphorePermit) -> Self {
        let now = tokio::time::Instant::now();
        let head_by = now + REQUEST_HEAD_WITHIN;
        let timer = Box::pin(tokio::time::sleep_until(head_by));
        Self { io, _slot: slot, lifetime_ends: now + CONNECTION_LIFETIME, head_by: Some(head_by), last4: 0, timer }
    }
}

impl AsyncRead for BoundedConnection {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let deadline = this.head_by.map_or(this.lifetime_ends, |by| by.min(this.lifetime_ends));
        if this.timer.deadline() != deadline {
            this.timer.as_mut().reset(deadline);
        }
        if this.timer.as_mut().poll(cx).is_ready() {
            let over = std::io::Error::new(std::io::ErrorKind::TimedOut, "health connection late or past its lifetime");
            return Poll::Ready(Err(over));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &polled {
            for &byte in &buf.filled()[before..] {
                this.last4 = (this.last4 << 8) | u32::from(byte);
                if this.last4 == u32::from_be_bytes(*b"\r\n\r\n") {
                    this.head_by = None;
                }
            }
        }
        polled
    }
}

impl AsyncWrite for BoundedConnection {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        // Answering: the next request's head is due within the same time from now.
        self.head_by = Some(tokio::time::Instant::now() + REQUEST_HEAD_WITHIN);
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
