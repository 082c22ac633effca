//! The web console under `/console` on `http.listen` (docs/operating/console.md): off
//! by default (`console.enabled`). One page and its script and style, embedded in the
//! binary, and a small JSON API under `/console/api/` that the page calls:
//!
//! - `summary`: the group and the pending counts by kind, from what the node already
//!   knows (as `/status`: no database), as open as `/status`.
//! - `rows`, `search`, `row`: rows with their errors, payloads, bodies and headers; the
//!   read or the admin token (`Authorization: Bearer`).
//! - `action` (POST, JSON): cancel, release, retry now, reschedule, through the SQL API
//!   of migration 0009 (one place per rule); the admin token.
//!
//! Every request under `/console` must name, in its `Host` header, a host the console
//! answers to (`console.allowed_hosts`, loopback names, `http.listen`'s host): a page
//! of another site whose DNS name was rebound to this address is answered 421 before
//! anything else. A client whose tokens failed [`throttle::BURST`] times is answered
//! 429 for a while (see [`throttle`]).
//!
//! The token is a header the page's script sets, never a cookie: a page of another site
//! cannot make the browser send it. A state-changing request must also be a JSON POST
//! whose `Origin` (when sent) is the console's own and whose `Sec-Fetch-Site` is not
//! `cross-site`; no CORS header is ever sent. Every refusal is counted
//! (`timeoutd_console_refused_total`) and logged, at most once a minute.
//!
//! The database work is [`api`]'s: one connection of its own, never the firing pool's
//! (contract section 8), and it runs on the HTTP server's thread.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Json, Redirect, Response};
use axum::routing::{get, post};
use serde::Serialize;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::config::{self, Secret, Settings};
use crate::http::Peer;
use crate::metrics::Metrics;
use crate::status::{DueSeen, Snapshot, Status};
use crate::telemetry::LogLimiter;

mod api;
mod throttle;

use crate::kind::Kind;
use api::{Action, ActionRequest, Db, DbError, RowsState};

const INDEX: &str = include_str!("console/assets/index.html");
const SCRIPT: &str = include_str!("console/assets/console.js");
const STYLE: &str = include_str!("console/assets/console.css");

/// What every console answer carries: no script but the console's own file, no inline
/// script or style, never framed, never sniffed, never cached, no referrer.
const SECURITY_HEADERS: [(header::HeaderName, &str); 6] = [
    (
        header::CONTENT_SECURITY_POLICY,
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; \
         connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; \
         frame-ancestors 'none'",
    ),
    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    (header::X_FRAME_OPTIONS, "DENY"),
    (header::REFERRER_POLICY, "no-referrer"),
    (header::CACHE_CONTROL, "no-store"),
    (
        header::HeaderName::from_static("cross-origin-resource-policy"),
        "same-origin",
    ),
];

/// The largest action request (a few ids and a time).
const MAX_BODY: usize = 16 * 1024;

/// At most one log line a minute about refused requests (each counted).
const REFUSALS_LOG_EVERY: Duration = Duration::from_secs(60);

/// A token as kept: its SHA-256, compared with a given one's in constant time.
struct Token([u8; 32]);

impl Token {
    fn new(secret: &Secret) -> Option<Self> {
        secret
            .is_set()
            .then(|| Self(Sha256::digest(secret.expose().as_bytes()).into()))
    }

    /// Whether `given` is this token. Both sides are digests of the same length, and
    /// every byte is compared whatever the earlier ones were: the time taken tells
    /// nothing about how much of a guess was right.
    fn matches(&self, given: &[u8]) -> bool {
        let given: [u8; 32] = Sha256::digest(given).into();
        let differ = self
            .0
            .iter()
            .zip(given.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(differ) == 0
    }
}

/// Who the request is, by its token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Access {
    Anonymous,
    Read,
    Admin,
}

/// Why a request was refused: its answer and the `reason` label of the metric.
#[derive(Debug)]
enum Refusal {
    /// No token where one is needed, or a token that is neither of the configured ones.
    Unauthenticated,
    /// The read token where an action needs the admin token.
    Forbidden,
    /// The token that part needs is not configured.
    ReadOnly(&'static str),
    /// From another site (`Origin`, `Sec-Fetch-Site`).
    CrossSite,
    /// An action that is not a JSON POST.
    ContentType,
    /// Too many failed tokens from this client lately; try again after this long.
    Throttled(Duration),
    /// A `Host` the console does not answer to (DNS rebinding).
    Host,
}

impl Refusal {
    fn reason(&self) -> &'static str {
        match self {
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::Forbidden => "forbidden",
            Refusal::ReadOnly(_) => "read_only",
            Refusal::CrossSite => "cross_site",
            Refusal::ContentType => "content_type",
            Refusal::Throttled(_) => "throttled",
            Refusal::Host => "host",
        }
    }

    fn answer(&self) -> Response {
        let (status, text) = match self {
            Refusal::Unauthenticated => (
                StatusCode::UNAUTHORIZED,
                "a valid token is needed (Authorization: Bearer <token>)",
            ),
            Refusal::Forbidden => (
                StatusCode::FORBIDDEN,
                "actions need the admin token (console.admin_token)",
            ),
            Refusal::ReadOnly(what) => (StatusCode::FORBIDDEN, *what),
            Refusal::CrossSite => (
                StatusCode::FORBIDDEN,
                "refused: the request comes from another site",
            ),
            Refusal::ContentType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "actions are POST requests with Content-Type: application/json",
            ),
            Refusal::Throttled(_) => (
                StatusCode::TOO_MANY_REQUESTS,
                "too many failed tokens from this address: try again later",
            ),
            Refusal::Host => (
                StatusCode::MISDIRECTED_REQUEST,
                "the console does not answer to this Host (console.allowed_hosts)",
            ),
        };
        let mut r = error(status, text);
        if let Refusal::Throttled(wait) = self {
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        if matches!(self, Refusal::Unauthenticated) {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// The console's state, shared by its handlers.
pub(crate) struct Console {
    status: Arc<Status>,
    metrics: Arc<Metrics>,
    admin: Option<Token>,
    read: Option<Token>,
    db: Db,
    quiet: Mutex<LogLimiter>,
    /// What decides which `Host` headers are answered.
    hosts: config::Console,
    listen: String,
    throttle: Mutex<throttle::Throttle>,
}

/// The console's routes (with `console.enabled`), to merge into the HTTP server's.
pub(crate) fn routes(
    settings: &Settings,
    node_id: Uuid,
    status: Arc<Status>,
    metrics: Arc<Metrics>,
) -> Router {
    let console = Arc::new(Console {
        status,
        metrics,
        admin: Token::new(&settings.console.admin_token),
        read: Token::new(&settings.console.read_token),
        db: Db::new(settings, node_id),
        quiet: Mutex::new(LogLimiter::new(REFUSALS_LOG_EVERY)),
        hosts: settings.console.clone(),
        listen: settings.http.listen.clone(),
        throttle: Mutex::default(),
    });
    Router::new()
        // Relative, so that it holds behind a proxy serving the console under a prefix.
        .route(
            "/console",
            get(|| async { Redirect::permanent("console/") }),
        )
        .route(
            "/console/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/console/console.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/console/console.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
        .route("/console/api/summary", get(summary))
        .route("/console/api/rows", get(rows))
        .route("/console/api/search", get(search))
        .route("/console/api/row", get(row))
        .route("/console/api/action", post(action))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            own_host,
        ))
        .layer(axum::middleware::map_response(secure))
        .with_state(console)
}

/// Before anything else: a request whose `Host` the console does not answer to is
/// refused (421).
async fn own_host(
    State(c): State<Arc<Console>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()))
        .unwrap_or_default();
    if !c.hosts.host_allowed(&c.listen, host) {
        return c.refuse(Refusal::Host, "host");
    }
    next.run(request).await
}

async fn secure(mut r: Response) -> Response {
    let headers = r.headers_mut();
    for (name, value) in SECURITY_HEADERS {
        headers.insert(name, HeaderValue::from_static(value));
    }
    r
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

fn error(status: StatusCode, text: &str) -> Response {
    (status, Json(serde_json::json!({ "error": text }))).into_response()
}

impl Console {
    /// Count and (rate-limited) log a refusal, and answer it.
    fn refuse(&self, refusal: Refusal, what: &str) -> Response {
        self.metrics.console_refused(refusal.reason());
        let mut quiet = self.quiet.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(suppressed) = quiet.allow(Instant::now()) {
            tracing::warn!(
                reason = refusal.reason(),
                request = what,
                suppressed,
                "console request refused"
            );
        }
        refusal.answer()
    }

    /// The request's access by its `Authorization` header. A header that is there but
    /// names no configured token is refused, not taken as anonymous: a typo should say
    /// so.
    ///
    /// A client (`peer`) whose tokens failed too often lately is refused (429) without
    /// its token being looked at; each token that fails counts against it.
    fn access(&self, headers: &HeaderMap, peer: IpAddr) -> Result<Access, Refusal> {
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Ok(Access::Anonymous);
        };
        let now = Instant::now();
        let mut throttle = self.throttle.lock().unwrap_or_else(|e| e.into_inner());
        throttle.check(peer, now).map_err(Refusal::Throttled)?;
        let given = value.as_bytes().strip_prefix(b"Bearer ");
        // Both compared, whichever matches: the time taken does not tell which.
        let admin = given.is_some_and(|g| self.admin.as_ref().is_some_and(|t| t.matches(g)));
        let read = given.is_some_and(|g| self.read.as_ref().is_some_and(|t| t.matches(g)));
        match (admin, read) {
            (true, _) => Ok(Access::Admin),
            (false, true) => Ok(Access::Read),
            (false, false) => {
                throttle.failed(peer, now);
                Err(Refusal::Unauthenticated)
            }
        }
    }

    /// Rows need the read or the admin token.
    fn may_read(&self, headers: &HeaderMap, peer: IpAddr) -> Result<(), Refusal> {
        if self.admin.is_none() && self.read.is_none() {
            return Err(Refusal::ReadOnly(
                "rows need console.read_token or console.admin_token; neither is configured",
            ));
        }
        match self.access(headers, peer)? {
            Access::Anonymous => Err(Refusal::Unauthenticated),
            Access::Read | Access::Admin => Ok(()),
        }
    }

    /// Actions: a JSON POST from the console's own origin, with the admin token.
    fn may_act(&self, headers: &HeaderMap, peer: IpAddr) -> Result<(), Refusal> {
        same_origin(headers)?;
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(Refusal::ContentType);
        }
        if self.admin.is_none() {
            return Err(Refusal::ReadOnly(
                "actions need console.admin_token, which is not configured: the console is \
                 read-only",
            ));
        }
        match self.access(headers, peer)? {
            Access::Admin => Ok(()),
            Access::Read => Err(Refusal::Forbidden),
            Access::Anonymous => Err(Refusal::Unauthenticated),
        }
    }

    /// A database step's failure, as an answer (503 when the console's connection is
    /// busy or the database does not answer in time; counted as `busy`).
    fn failed(&self, e: DbError) -> Response {
        match e {
            DbError::Busy(why) => {
                self.metrics.console_refused("busy");
                error(StatusCode::SERVICE_UNAVAILABLE, &why)
            }
            DbError::Refused(why) => error(StatusCode::CONFLICT, &why),
            DbError::Input(why) => error(StatusCode::BAD_REQUEST, &why),
            DbError::Other(why) => {
                tracing::warn!(error = %why, "console: database step failed");
                error(StatusCode::BAD_GATEWAY, &why)
            }
        }
    }
}

/// A state-changing request from a page of another site is refused: its `Origin`, which
/// browsers send with every POST, must be the console's own (the `Host` it was sent
/// to), and its `Sec-Fetch-Site` must not be `cross-site`. A client that is no browser
/// sends neither, and needs the token all the same.
fn same_origin(headers: &HeaderMap) -> Result<(), Refusal> {
    let text = |name| headers.get(name).map(|v| v.to_str().unwrap_or("\u{fffd}"));
    if text(header::HeaderName::from_static("sec-fetch-site"))
        .is_some_and(|s| s.eq_ignore_ascii_case("cross-site"))
    {
        return Err(Refusal::CrossSite);
    }
    let Some(origin) = text(header::ORIGIN) else {
        return Ok(());
    };
    let host = text(header::HOST).ok_or(Refusal::CrossSite)?;
    let own = ["http://", "https://"]
        .iter()
        .any(|scheme| origin.strip_prefix(scheme) == Some(host));
    if own { Ok(()) } else { Err(Refusal::CrossSite) }
}

/// The query string's parameters (the page sends a few plain ones).
fn params(query: Option<String>) -> Vec<(String, String)> {
    query
        .map(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .into_owned()
                .collect()
        })
        .unwrap_or_default()
}

fn param<'a>(params: &'a [(String, String)], name: &str) -> Option<&'a str> {
    params
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// What the console's summary shows.
#[derive(Serialize)]
struct Summary {
    node: Snapshot,
    pending: Vec<crate::metrics::PendingSummary>,
    due: Vec<DueSeen>,
    /// Which parts the configuration opens: rows (a token configured), actions (the
    /// admin token configured).
    rows: bool,
    actions: bool,
}

async fn summary(State(c): State<Arc<Console>>) -> Json<Summary> {
    Json(Summary {
        node: c.status.snapshot(),
        pending: c.metrics.pending_summary(),
        due: c.status.due_seen(),
        rows: c.admin.is_some() || c.read.is_some(),
        actions: c.admin.is_some(),
    })
}

async fn rows(
    State(c): State<Arc<Console>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    if let Err(r) = c.may_read(&headers, peer.ip()) {
        return c.refuse(r, "rows");
    }
    let p = params(q);
    let (Some(kind), Some(state)) = (
        param(&p, "kind").and_then(Kind::parse),
        param(&p, "state").and_then(RowsState::parse),
    ) else {
        return error(
            StatusCode::BAD_REQUEST,
            "kind (expectation, delayed) and state (pending, failing, held) are needed",
        );
    };
    match c.db.rows(kind, state).await {
        Ok(rows) => Json(rows).into_response(),
        Err(e) => c.failed(e),
    }
}

async fn search(
    State(c): State<Arc<Console>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    if let Err(r) = c.may_read(&headers, peer.ip()) {
        return c.refuse(r, "search");
    }
    let p = params(q);
    let Some(q) = param(&p, "q").map(str::trim).filter(|q| !q.is_empty()) else {
        return error(StatusCode::BAD_REQUEST, "q (what to look for) is needed");
    };
    match c.db.search(q).await {
        Ok(rows) => Json(rows).into_response(),
        Err(e) => c.failed(e),
    }
}

async fn row(
    State(c): State<Arc<Console>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    if let Err(r) = c.may_read(&headers, peer.ip()) {
        return c.refuse(r, "row");
    }
    let p = params(q);
    let (Some(kind), Some(id)) = (
        param(&p, "kind").and_then(Kind::parse),
        param(&p, "id").and_then(|i| Uuid::parse_str(i).ok()),
    ) else {
        return error(
            StatusCode::BAD_REQUEST,
            "kind (expectation, delayed) and id (the row's uuid) are needed",
        );
    };
    match c.db.row(kind, id).await {
        Ok(Some(row)) => Json(row).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, "no such row (fired or cancelled?)"),
        Err(e) => c.failed(e),
    }
}

async fn action(
    State(c): State<Arc<Console>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = c.may_act(&headers, peer.ip()) {
        return c.refuse(r, "action");
    }
    let asked: ActionRequest = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("not an action: {e}")),
    };
    let (kind, what): (Kind, Action) = (asked.kind(), asked.action());
    let done = c.db.act(&asked).await;
    let result = match &done {
        Ok(true) => "done",
        Ok(false) => "no_change",
        Err(_) => "error",
    };
    c.metrics.console_action(kind.name(), what.name(), result);
    match done {
        Ok(done) => {
            tracing::info!(
                kind = kind.name(),
                action = what.name(),
                row = %asked.target(),
                done,
                "console action"
            );
            Json(serde_json::json!({ "done": done })).into_response()
        }
        Err(e) => c.failed(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("header value"));
        }
        h
    }

    /// DNS rebinding: only loopback names, the listen address's host and the listed
    /// names are answered, any port unless the listed name has one.
    #[test]
    fn only_the_configured_hosts_are_answered() {
        let console = |allowed: &[&str]| config::Console {
            enabled: true,
            admin_token: Secret::default(),
            read_token: Secret::default(),
            statement_timeout: Duration::from_secs(1),
            acquire_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            allowed_hosts: allowed.iter().map(|h| (*h).to_owned()).collect(),
        };
        let c = console(&[]);
        for ok in [
            "localhost:9464",
            "LOCALHOST",
            "127.0.0.1:1",
            "[::1]:9464",
            "10.0.0.5:9464",
        ] {
            assert!(c.host_allowed("10.0.0.5:9464", ok), "{ok}");
        }
        for bad in [
            "",
            "evil.example:9464",
            "127.0.0.1.evil.example",
            "10.0.0.5",
        ] {
            assert!(!c.host_allowed("0.0.0.0:9464", bad), "{bad}");
        }
        let c = console(&["timeoutd.example.com", "ops.example.com:8443"]);
        assert!(c.host_allowed("0.0.0.0:9464", "Timeoutd.Example.com"));
        assert!(c.host_allowed("0.0.0.0:9464", "timeoutd.example.com:443"));
        assert!(c.host_allowed("0.0.0.0:9464", "ops.example.com:8443"));
        assert!(!c.host_allowed("0.0.0.0:9464", "ops.example.com:443"));
        assert!(!c.host_allowed("0.0.0.0:9464", "example.com"));
        assert!(console(&["*"]).host_allowed("0.0.0.0:9464", "anything:1"));
    }

    #[test]
    fn a_token_matches_itself_only() {
        let t = Token(Sha256::digest(b"sixteen-bytes-or-more").into());
        assert!(t.matches(b"sixteen-bytes-or-more"));
        assert!(!t.matches(b"sixteen-bytes-or-mor"));
        assert!(!t.matches(b""));
    }

    #[test]
    fn only_the_consoles_own_origin_may_act() {
        let own = headers(&[
            ("host", "127.0.0.1:9464"),
            ("origin", "http://127.0.0.1:9464"),
        ]);
        assert!(same_origin(&own).is_ok());
        assert!(
            same_origin(&headers(&[("host", "h:1")])).is_ok(),
            "no browser"
        );
        for bad in [
            headers(&[
                ("host", "127.0.0.1:9464"),
                ("origin", "http://evil.example"),
            ]),
            headers(&[("host", "127.0.0.1:9464"), ("origin", "null")]),
            headers(&[("origin", "http://127.0.0.1:9464")]),
            headers(&[("host", "h:1"), ("sec-fetch-site", "cross-site")]),
            headers(&[
                ("host", "127.0.0.1:9464"),
                ("origin", "http://127.0.0.1:9464.evil.example"),
            ]),
        ] {
            assert!(same_origin(&bad).is_err(), "{bad:?}");
        }
    }
}
