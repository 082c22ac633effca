//! The operator endpoints on `http.listen`: `/healthz` (liveness), `/readyz`
//! (readiness), `/status` (JSON snapshot). One small axum server, stopped with the daemon.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::daemon::Probe;

/// Bind now (so a bad address fails the start, and port 0 is resolved), serve in the
/// background until `stop`.
pub async fn serve(
    addr: SocketAddr,
    probe: Arc<Probe>,
    stop: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .with_state(probe);
    tokio::spawn(async move {
        let server = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
        if let Err(e) = server.await {
            tracing::error!(error = %e, "http server failed");
        }
    });
    Ok(bound)
}

async fn healthz(State(probe): State<Arc<Probe>>) -> Response {
    match probe.stalled() {
        None => (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response(),
        Some(reason) => unavailable(&reason),
    }
}

async fn readyz(State(probe): State<Arc<Probe>>) -> Response {
    match probe.not_ready().await {
        None => (StatusCode::OK, Json(serde_json::json!({"status": "ready"}))).into_response(),
        Some(reason) => unavailable(&reason),
    }
}

async fn status(State(probe): State<Arc<Probe>>) -> Json<crate::daemon::Snapshot> {
    Json(probe.snapshot())
}

/// Connection state and pending counts are measured at scrape time (bounded), so the
/// numbers are fresh and nothing polls the database between scrapes.
async fn metrics(State(probe): State<Arc<Probe>>) -> Response {
    let postgres_ok = probe.refresh_pending().await;
    let body = probe.metrics.render(postgres_ok);
    let content_type = [(
        header::CONTENT_TYPE,
        "text/plain; version=0.0.4; charset=utf-8",
    )];
    (StatusCode::OK, content_type, body).into_response()
}

fn unavailable(reason: &str) -> Response {
    let body = serde_json::json!({"status": "unavailable", "reason": reason});
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}
