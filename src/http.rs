//! The operator endpoints on `http.listen`: `/healthz` (liveness), `/readyz`
//! (readiness), `/status` (JSON snapshot), `/metrics`. One small axum server, stopped
//! with the daemon. Every answer comes from what the node already knows (`Probe`): no
//! request, however many, reaches the database or the broker.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::status::{Probe, Snapshot};

/// The bound server, run (and supervised) by the daemon.
pub(crate) struct Server {
    listener: TcpListener,
    app: Router,
    stop: CancellationToken,
}

impl Server {
    /// Serve until `stop`.
    pub(crate) async fn run(self) -> std::io::Result<()> {
        axum::serve(self.listener, self.app)
            .with_graceful_shutdown(self.stop.cancelled_owned())
            .await
    }
}

/// Bind now (so a bad address fails the start, and port 0 is resolved).
pub(crate) async fn bind(
    addr: SocketAddr,
    probe: Arc<Probe>,
    stop: CancellationToken,
) -> std::io::Result<(SocketAddr, Server)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .with_state(probe);
    let server = Server {
        listener,
        app,
        stop,
    };
    Ok((bound, server))
}

async fn healthz(State(probe): State<Arc<Probe>>) -> Response {
    match probe.stalled() {
        None => (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response(),
        Some(reason) => unavailable(&reason),
    }
}

async fn readyz(State(probe): State<Arc<Probe>>) -> Response {
    match probe.not_ready() {
        None => (StatusCode::OK, Json(serde_json::json!({"status": "ready"}))).into_response(),
        Some(reason) => unavailable(&reason),
    }
}

async fn status(State(probe): State<Arc<Probe>>) -> Json<Snapshot> {
    Json(probe.snapshot())
}

async fn metrics(State(probe): State<Arc<Probe>>) -> Response {
    let body = probe.metrics_text();
    let content_type = [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)];
    (StatusCode::OK, content_type, body).into_response()
}

fn unavailable(reason: &str) -> Response {
    let body = serde_json::json!({"status": "unavailable", "reason": reason});
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}
