//! Structured logs: `tracing` to stderr (text, or JSON with `RELAY_LOG_FORMAT=json`),
//! filtered by `RUST_LOG` (default `info`), and the same lines forwarded over
//! NATS to the tracker, which writes `runs/<id>/logs/<service>.log`. Forwarding
//! never blocks: lines are dropped (and counted) when the queue is full.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::Shutdown;

const QUEUE: usize = 4096;

/// Lines waiting to be shipped to the tracker.
pub struct LogForwarding {
    rx: Mutex<Option<mpsc::Receiver<String>>>,
    /// Lines dropped because the queue was full.
    pub dropped: Arc<AtomicU64>,
}

struct ForwardLayer {
    tx: mpsc::Sender<String>,
    dropped: Arc<AtomicU64>,
}

struct LineVisitor<'a>(&'a mut String);

impl Visit for LineVisitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for ForwardLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        if *meta.level() > tracing::Level::INFO || meta.target().starts_with("async_nats") {
            return;
        }
        let mut line = format!(
            "{} {:>5} {}:",
            chrono::Utc::now().format("%Y-%m-%dT%H:%M:%S%.6fZ"),
            meta.level(),
            meta.target()
        );
        event.record(&mut LineVisitor(&mut line));
        if self.tx.try_send(line).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Installs the global subscriber. Call once per process; a second call
/// (e.g. several services in one test process) leaves the first in place.
pub fn init() -> LogForwarding {
    init_with_default("info")
}

/// [`init`] with another filter when `RUST_LOG` is not set.
pub fn init_with_default(default_filter: &str) -> LogForwarding {
    let (tx, rx) = mpsc::channel(QUEUE);
    let dropped = Arc::new(AtomicU64::new(0));
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let json = std::env::var("RELAY_LOG_FORMAT").is_ok_and(|v| v == "json");
    let forward = ForwardLayer {
        tx,
        dropped: dropped.clone(),
    };
    let registry = tracing_subscriber::registry().with(filter).with(forward);
    let _ = if json {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr),
            )
            .try_init()
    } else {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    // Colour on a terminal only: `relay up` sends logs to files.
                    .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                    .with_writer(std::io::stderr),
            )
            .try_init()
    };
    LogForwarding {
        rx: Mutex::new(Some(rx)),
        dropped,
    }
}

impl LogForwarding {
    /// Ships queued lines to `subject` every 200 ms until shutdown.
    pub fn start(
        &self,
        client: async_nats::Client,
        subject: String,
        service: String,
        instance: String,
        shutdown: Shutdown,
    ) {
        let Some(mut rx) = self.rx.lock().expect("log queue lock").take() else {
            return;
        };
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                let stopping = tokio::select! {
                    _ = tick.tick() => false,
                    _ = shutdown.wait() => true,
                };
                let mut lines = Vec::new();
                while let Ok(line) = rx.try_recv() {
                    lines.push(line);
                }
                if !lines.is_empty() {
                    let batch = relay_proto::LogBatch {
                        schema: relay_proto::SCHEMA_VERSION,
                        service: service.clone(),
                        instance: instance.clone(),
                        lines,
                    };
                    let _ = client
                        .publish(subject.clone(), relay_proto::encode(&batch).into())
                        .await;
                }
                if stopping {
                    let _ = client.flush().await;
                    break;
                }
            }
        });
    }
}
