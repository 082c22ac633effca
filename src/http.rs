//! The operator endpoints on `http.listen`: `/healthz` (liveness), `/readyz`
//! (readiness), `/status` (JSON snapshot), `/metrics`, and with `console.enabled` the
//! web console under `/console` (see `console`). One small axum server, stopped with
//! the daemon. Every answer of the first four comes from what the node already knows
//! (`Status`): no request, however many, reaches the database or the broker. The
//! console's rows come from one database connection of its own, never the firing's.
//!
//! The server runs on a thread and a runtime of its own, at a lower priority: a flood of
//! requests then costs at most that one thread's CPU, never queues ahead of the firing
//! tasks in the daemon's runtime, and gives way to them whenever they need a CPU
//! (measured: with both on one runtime, 300 scrapers made TimeOuts seconds late and the
//! scan's own steps slow enough to turn readiness red; on a thread of its own at the
//! same priority, up to 0.7 s late on two cores).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::status::{Snapshot, Status};

mod guard;
pub(crate) use guard::{Limits, Peer};

/// The server thread's nice value: the firing threads (0) get about ten times its share
/// of a contended CPU, and it still answers the kubelet's probes under load.
#[cfg(target_os = "linux")]
const NICE: i32 = 10;

/// How long requests under way may finish once the daemon stops; then their
/// connections are dropped (a client that never finishes its request cannot hold the
/// stop).
const GRACE: Duration = Duration::from_secs(1);

/// The bound server, run (and supervised) by the daemon.
pub(crate) struct Server {
    /// Bound, and not tied to the daemon's runtime: it is served on the server's own.
    listener: std::net::TcpListener,
    limits: Limits,
    app: Router,
    stop: CancellationToken,
}

impl Server {
    /// Serve on a thread of its own until `stop` (and [`GRACE`]).
    pub(crate) async fn run(self) -> std::io::Result<()> {
        let (done, served) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("timeoutd-http".into())
            .spawn(move || {
                let _ = done.send(self.serve());
            })?;
        served
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("the HTTP thread panicked")))
    }

    fn serve(self) -> std::io::Result<()> {
        give_way();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let Self {
            listener,
            limits,
            app,
            stop,
        } = self;
        // Dropping the runtime when this returns drops every connection still open.
        runtime.block_on(async move {
            let listener = guard::Guarded::new(TcpListener::from_std(listener)?, limits);
            // The peer's address reaches the handlers (the console throttles by it).
            let app = app.into_make_service_with_connect_info::<Peer>();
            let serve =
                axum::serve(listener, app).with_graceful_shutdown(stop.clone().cancelled_owned());
            tokio::select! {
                served = serve => served,
                () = async {
                    stop.cancelled().await;
                    tokio::time::sleep(GRACE).await;
                } => Ok(()),
            }
        })
    }
}

/// Lower the calling thread's priority to [`NICE`] (a thread id is a process id to
/// `setpriority` on Linux; lowering needs no privilege).
#[cfg(target_os = "linux")]
fn give_way() {
    let me = rustix::thread::gettid();
    if let Err(e) = rustix::process::setpriority_process(Some(me), NICE) {
        tracing::warn!(error = %e, "cannot lower the HTTP thread's priority");
    }
}

#[cfg(not(target_os = "linux"))]
fn give_way() {}

/// Bind now (so a bad address fails the start, and port 0 is resolved).
pub(crate) async fn bind(
    addr: SocketAddr,
    limits: Limits,
    status: Arc<Status>,
    console: Option<Router>,
    stop: CancellationToken,
) -> std::io::Result<(SocketAddr, Server)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let listener = listener.into_std()?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status_json))
        .route("/metrics", get(metrics))
        .with_state(status)
        .merge(console.unwrap_or_default());
    let server = Server {
        listener,
        limits,
        app,
        stop,
    };
    Ok((bound, server))
}

async fn healthz(State(status): State<Arc<Status>>) -> Response {
    match status.stalled() {
        None => (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response(),
        Some(reason) => unavailable(&reason),
    }
}

async fn readyz(State(status): State<Arc<Status>>) -> Response {
    match status.not_ready() {
        None => (StatusCode::OK, Json(serde_json::json!({"status": "ready"}))).into_response(),
        Some(reason) => unavailable(&reason),
    }
}

async fn status_json(State(status): State<Arc<Status>>) -> Json<Snapshot> {
    Json(status.snapshot())
}

async fn metrics(State(status): State<Arc<Status>>) -> Response {
    let body = status.metrics_text();
    let content_type = [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)];
    (StatusCode::OK, content_type, body).into_response()
}

fn unavailable(reason: &str) -> Response {
    let body = serde_json::json!({"status": "unavailable", "reason": reason});
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}
