//! The `/metrics` (Prometheus text format) and `/healthz` endpoints every
//! service serves.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::{extract::State, http::StatusCode, routing::get, Router};
use prometheus::{Encoder, Registry, TextEncoder};

use crate::Shutdown;

/// Whether the service is ready to do its work; `/healthz` answers 503 until it is.
#[derive(Clone, Default)]
pub struct Health(Arc<AtomicBool>);

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.0.store(ready, Ordering::Relaxed);
    }
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Clone)]
struct AppState {
    registry: Registry,
    health: Health,
}

async fn metrics(
    State(state): State<AppState>,
) -> (StatusCode, [(&'static str, &'static str); 1], Vec<u8>) {
    let mut body = Vec::new();
    let encoder = TextEncoder::new();
    match encoder.encode(&state.registry.gather(), &mut body) {
        Ok(()) => (
            StatusCode::OK,
            [("content-type", "text/plain; version=0.0.4")],
            body,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "text/plain")],
            e.to_string().into_bytes(),
        ),
    }
}

async fn healthz(State(state): State<AppState>) -> (StatusCode, &'static str) {
    if state.health.is_ready() {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
    }
}

/// Binds `addr` (port 0 picks a free one) and serves until shutdown; returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    registry: Registry,
    health: Health,
    shutdown: Shutdown,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(AppState { registry, health });
    tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.wait().await })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(bound)
}
