//! The web console's HTTP API (docs/operating/console.md): off by default, tokens,
//! cross-site refusals, actions through the SQL API, and contract section 8 under a
//! flood of console requests. The page itself is tested in a browser by
//! `.ci/console-test`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use chrono::Utc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use timeoutd::client::Expectation;

use crate::common::{Inbox, PATIENCE, Proc, World, flood, wait_for, wait_for_async};
use crate::http::{get, metric};

const ADMIN: &str = "admin-token-of-the-test-0123456789";
const READ: &str = "read-token-of-the-test-0123456789";

/// An answer: status, headers (names lower-cased), body.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

/// One HTTP/1.1 request with these headers (and a body), as a browser or a script would
/// send it.
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<Answer> {
    request_from(None, addr, method, path, headers, body).await
}

/// [`request`] from another local address (`127.0.0.x`: another client to the server).
async fn request_from(
    from: Option<std::net::IpAddr>,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<Answer> {
    let mut s = match from {
        None => tokio::net::TcpStream::connect(addr).await?,
        Some(from) => {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(SocketAddr::new(from, 0))?;
            socket.connect(addr).await?
        }
    };
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.unwrap_or_default();
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status line in {raw:?}")))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok(Answer {
        status,
        headers,
        body: body.to_owned(),
    })
}

async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Answer {
    request(addr, method, path, headers, body)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// An action as the page posts it, with `token` (if any) and the page's own origin.
async fn act(addr: SocketAddr, token: Option<&str>, body: &serde_json::Value) -> Answer {
    let origin = format!("http://{addr}");
    let auth = token.map(bearer);
    let mut headers = vec![
        ("Content-Type", "application/json"),
        ("Origin", origin.as_str()),
        ("Sec-Fetch-Site", "same-origin"),
    ];
    if let Some(a) = &auth {
        headers.push(("Authorization", a.as_str()));
    }
    call(
        addr,
        "POST",
        "/console/api/action",
        &headers,
        Some(&body.to_string()),
    )
    .await
}

fn console_env(admin: Option<&str>, read: Option<&str>) -> Vec<(String, String)> {
    let mut env = vec![("TIMEOUTD__CONSOLE__ENABLED".to_owned(), "true".to_owned())];
    if let Some(a) = admin {
        env.push(("TIMEOUTD__CONSOLE__ADMIN_TOKEN".to_owned(), a.to_owned()));
    }
    if let Some(r) = read {
        env.push(("TIMEOUTD__CONSOLE__READ_TOKEN".to_owned(), r.to_owned()));
    }
    env
}

/// An expectation due in an hour (never fires during the test).
async fn later(world: &World, process: &str) -> uuid::Uuid {
    let e = Expectation::new(process, "Reply", "nowhere")
        .due_at(Utc::now() + chrono::Duration::hours(1));
    world.expect(&e).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_off_by_default() {
    let world = World::new().await;
    world.migrate().await;
    let node = world.start().await;
    for path in [
        "/console",
        "/console/",
        "/console/api/summary",
        "/console/console.js",
    ] {
        assert_eq!(get(node.http_addr, path).await.0, 404, "{path}");
    }
    let a = act(node.http_addr, Some(ADMIN), &serde_json::json!({})).await;
    assert_eq!(a.status, 404);
    node.stop().await;
    world.cleanup().await;
}

/// The page and its assets come from the binary, with a strict policy and no CORS; the
/// summary is as open as /status; rows need a token, actions the admin token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_open_rows_and_actions_and_nothing_more() {
    let mut world = World::new().await;
    world.overrides = console_env(Some(ADMIN), Some(READ));
    world.migrate().await;
    let node = world.start().await;
    let addr = node.http_addr;
    let id = later(&world, "console-tokens").await;

    let bare = call(addr, "GET", "/console", &[], None).await;
    assert_eq!(
        (bare.status, bare.headers["location"].as_str()),
        (308, "console/")
    );
    let page = call(addr, "GET", "/console/", &[], None).await;
    assert_eq!(page.status, 200);
    assert!(
        page.body.contains("<script src=\"console.js\""),
        "{}",
        page.body
    );
    let csp = &page.headers["content-security-policy"];
    assert!(csp.contains("default-src 'self'") && csp.contains("frame-ancestors 'none'"));
    assert_eq!(page.headers["x-content-type-options"], "nosniff");
    for asset in ["/console/console.js", "/console/console.css"] {
        assert_eq!(
            call(addr, "GET", asset, &[], None).await.status,
            200,
            "{asset}"
        );
    }
    let summary = call(addr, "GET", "/console/api/summary", &[], None).await;
    assert_eq!(summary.status, 200);
    assert!(summary.body.contains(&node.node_id.to_string()));
    assert!(
        !summary
            .headers
            .keys()
            .any(|k| k.starts_with("access-control-")),
        "no CORS: {:?}",
        summary.headers
    );

    let rows = "/console/api/rows?kind=expectation&state=pending";
    let wrong = bearer("not-a-token-of-this-console");
    let (admin, read) = (bearer(ADMIN), bearer(READ));
    for (headers, status) in [
        (vec![], 401),
        (vec![("Authorization", wrong.as_str())], 401),
        (vec![("Authorization", "Basic YWRtaW46YWRtaW4=")], 401),
        (vec![("Authorization", read.as_str())], 200),
        (vec![("Authorization", admin.as_str())], 200),
    ] {
        let a = call(addr, "GET", rows, &headers, None).await;
        assert_eq!(a.status, status, "{headers:?}: {}", a.body);
        if status == 200 {
            assert!(a.body.contains(&id.to_string()), "{}", a.body);
        } else {
            assert!(!a.body.contains(&id.to_string()));
        }
    }
    let search = "/console/api/search?q=console-tokens";
    let found = call(
        addr,
        "GET",
        search,
        &[("Authorization", read.as_str())],
        None,
    )
    .await;
    assert!(found.body.contains(&id.to_string()), "{}", found.body);
    let detail = format!("/console/api/row?kind=expectation&id={id}");
    assert_eq!(call(addr, "GET", &detail, &[], None).await.status, 401);
    let shown = call(
        addr,
        "GET",
        &detail,
        &[("Authorization", read.as_str())],
        None,
    )
    .await;
    assert_eq!(shown.status, 200, "{}", shown.body);

    // Least right: the read token reads, and acts on nothing.
    let cancel = serde_json::json!({"kind": "expectation", "action": "cancel", "id": id});
    for (token, status) in [
        (None, 401),
        (Some(READ), 403),
        (Some("x".repeat(20).as_str()), 401),
    ] {
        let a = act(addr, token, &cancel).await;
        assert_eq!(a.status, status, "{token:?}: {}", a.body);
        assert_eq!(world.count(&format!("id = '{id}'")).await, 1, "still there");
    }
    let a = act(addr, Some(ADMIN), &cancel).await;
    assert_eq!((a.status, a.body.as_str()), (200, "{\"done\":true}"));
    assert_eq!(world.count(&format!("id = '{id}'")).await, 0, "cancelled");
    let again = act(addr, Some(ADMIN), &cancel).await;
    assert_eq!(again.body, "{\"done\":false}", "gone already");

    let text = get(addr, "/metrics").await.1;
    for reason in ["unauthenticated", "forbidden"] {
        let series = format!(
            "timeoutd_console_refused_total{{group=\"{}\",reason=\"{reason}\"}}",
            world.group
        );
        assert!(
            metric(&text, &series).is_some_and(|n| n >= 1.0),
            "{series}\n{text}"
        );
    }
    assert!(
        text.contains("timeoutd_console_actions_total{") && text.contains("result=\"done\""),
        "{text}"
    );
    node.stop().await;
    world.cleanup().await;
}

/// A page of another site cannot act, even if it had the token: its Origin or
/// Sec-Fetch-Site gives it away, and only a JSON POST is an action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_site_requests_cannot_act() {
    let mut world = World::new().await;
    world.overrides = console_env(Some(ADMIN), None);
    world.migrate().await;
    let node = world.start().await;
    let addr = node.http_addr;
    let id = later(&world, "console-csrf").await;
    let body = serde_json::json!({"kind": "expectation", "action": "cancel", "id": id}).to_string();
    let auth = bearer(ADMIN);
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, u16);
    let refused: [Case; 5] = [
        (
            "another origin",
            vec![
                ("Origin", "http://evil.example"),
                ("Content-Type", "application/json"),
            ],
            403,
        ),
        (
            "Sec-Fetch-Site cross-site",
            vec![
                ("Sec-Fetch-Site", "cross-site"),
                ("Content-Type", "application/json"),
            ],
            403,
        ),
        (
            "an opaque origin",
            vec![("Origin", "null"), ("Content-Type", "application/json")],
            403,
        ),
        // What a cross-site <form> can send without a preflight.
        (
            "a form post",
            vec![("Content-Type", "application/x-www-form-urlencoded")],
            415,
        ),
        ("text/plain", vec![("Content-Type", "text/plain")], 415),
    ];
    for (what, mut headers, status) in refused {
        headers.push(("Authorization", auth.as_str()));
        let a = call(addr, "POST", "/console/api/action", &headers, Some(&body)).await;
        assert_eq!(a.status, status, "{what}: {}", a.body);
        assert!(!a.headers.keys().any(|k| k.starts_with("access-control-")));
        assert_eq!(
            world.count(&format!("id = '{id}'")).await,
            1,
            "{what}: still there"
        );
    }
    // Not a GET, whatever it carries.
    let path = format!("/console/api/action?kind=expectation&action=cancel&id={id}");
    let a = call(
        addr,
        "GET",
        &path,
        &[("Authorization", auth.as_str())],
        None,
    )
    .await;
    assert_eq!(a.status, 405);
    let preflight = call(
        addr,
        "OPTIONS",
        "/console/api/action",
        &[
            ("Origin", "http://evil.example"),
            ("Access-Control-Request-Method", "POST"),
        ],
        None,
    )
    .await;
    assert!(
        !preflight
            .headers
            .keys()
            .any(|k| k.starts_with("access-control-"))
    );
    assert_eq!(world.count(&format!("id = '{id}'")).await, 1);
    let text = get(addr, "/metrics").await.1;
    for reason in ["cross_site", "content_type"] {
        let series = format!(
            "timeoutd_console_refused_total{{group=\"{}\",reason=\"{reason}\"}}",
            world.group
        );
        assert!(
            metric(&text, &series).is_some_and(|n| n >= 2.0),
            "{series}\n{text}"
        );
    }
    node.stop().await;
    world.cleanup().await;
}

/// Without an admin token the console acts on nothing; without any token it shows no
/// row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tokens_the_console_is_read_only() {
    let mut world = World::new().await;
    world.overrides = console_env(None, Some(READ));
    world.migrate().await;
    let node = world.start().await;
    let id = later(&world, "console-read-only").await;
    let cancel = serde_json::json!({"kind": "expectation", "action": "cancel", "id": id});
    let a = act(node.http_addr, Some(READ), &cancel).await;
    assert_eq!(a.status, 403, "{}", a.body);
    assert!(a.body.contains("read-only"), "{}", a.body);
    assert_eq!(world.count(&format!("id = '{id}'")).await, 1);
    node.stop().await;

    world.overrides = console_env(None, None);
    let node = world.start().await;
    let summary = call(node.http_addr, "GET", "/console/api/summary", &[], None).await;
    assert_eq!(summary.status, 200);
    assert!(summary.body.contains("\"rows\":false"), "{}", summary.body);
    let rows = call(
        node.http_addr,
        "GET",
        "/console/api/rows?kind=expectation&state=pending",
        &[("Authorization", &bearer(READ))],
        None,
    )
    .await;
    assert_eq!(rows.status, 403, "{}", rows.body);
    node.stop().await;
    world.cleanup().await;
}

/// Every action goes through the SQL API and does what it says there, for both kinds;
/// the daemon's role acts on any owner's delayed message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_change_the_rows_through_the_sql_api() {
    let mut world = World::new().await;
    world.overrides = console_env(Some(ADMIN), None);
    world.migrate().await;
    let node = world.start().await;
    let addr = node.http_addr;
    let s = world.schema.clone();

    // An expectation, parked; then released, rescheduled, cancelled.
    let id = later(&world, "console-actions").await;
    world
        .exec(&format!("UPDATE {s}.expected_messages SET retry_at = 'infinity', attempts = 1, last_error = 'parked by the test' WHERE id = '{id}'"))
        .await;
    let held = call(
        addr,
        "GET",
        "/console/api/rows?kind=expectation&state=held",
        &[("Authorization", &bearer(ADMIN))],
        None,
    )
    .await;
    assert!(held.body.contains("parked by the test"), "{}", held.body);
    let e = |action: &str| serde_json::json!({"kind": "expectation", "action": action, "id": id});
    assert_eq!(
        act(addr, Some(ADMIN), &e("retry")).await.body,
        "{\"done\":false}",
        "not failing"
    );
    assert_eq!(
        act(addr, Some(ADMIN), &e("release")).await.body,
        "{\"done\":true}"
    );
    assert_eq!(
        world
            .count(&format!("id = '{id}' AND retry_at IS NULL"))
            .await,
        1
    );
    let at = Utc::now() + chrono::Duration::hours(5);
    let mut r = e("reschedule");
    let missing = act(addr, Some(ADMIN), &r).await;
    assert_eq!(missing.status, 400, "{}", missing.body);
    r["at"] = serde_json::json!(at.to_rfc3339());
    assert_eq!(act(addr, Some(ADMIN), &r).await.body, "{\"done\":true}");
    let moved = world
        .count(&format!(
            "id = '{id}' AND abs(extract(epoch FROM timeout_at - '{}'::timestamptz)) < 0.001",
            at.to_rfc3339()
        ))
        .await;
    assert_eq!(moved, 1, "rescheduled");
    assert_eq!(
        act(addr, Some(ADMIN), &e("cancel")).await.body,
        "{\"done\":true}"
    );
    assert_eq!(world.count(&format!("id = '{id}'")).await, 0);

    // A delayed message of another owner, held with a body that is not UTF-8.
    world
        .exec(&format!(
            "INSERT INTO {s}.delayed_messages (owner, message_id, deliver_at, exchange, routing_key, properties, body, retry_at, attempts, last_error) \
             VALUES ('billing', 'console-m1', now() + interval '1 hour', 'amq.direct', 'k', \
             '{{\"headers\": [[\"x-trace\", {{\"t\": \"str\", \"v\": \"<b>hi</b>\"}}]]}}', '\\xff00fe', 'infinity', 1, 'exchange not allowed')"
        ))
        .await;
    let delayed = |sql: &str| {
        let sql = format!(
            "SELECT count(*) FROM {s}.delayed_messages WHERE message_id = 'console-m1' AND {sql}"
        );
        let pool = world.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    let found = call(
        addr,
        "GET",
        "/console/api/search?q=console-m1",
        &[("Authorization", &bearer(ADMIN))],
        None,
    )
    .await;
    let listed: serde_json::Value = serde_json::from_str(&found.body).expect("json");
    let row_id = listed[0]["id"].as_str().expect("an id").to_owned();
    assert_eq!(listed[0]["owner"], "billing");
    assert_eq!(listed[0]["held"], true);
    let detail = call(
        addr,
        "GET",
        &format!("/console/api/row?kind=delayed&id={row_id}"),
        &[("Authorization", &bearer(ADMIN))],
        None,
    )
    .await;
    let detail: serde_json::Value = serde_json::from_str(&detail.body).expect("json");
    assert_eq!(
        (detail["preview"].as_str(), detail["preview_hex"].as_bool()),
        (Some("ff00fe"), Some(true))
    );
    assert_eq!(detail["size"], 3);
    assert!(detail["properties"].to_string().contains("x-trace"));
    let d = |action: &str| serde_json::json!({"kind": "delayed", "action": action, "message_id": "console-m1", "owner": "billing"});
    assert_eq!(
        act(addr, Some(ADMIN), &d("release")).await.body,
        "{\"done\":true}"
    );
    assert_eq!(delayed("retry_at IS NULL").await, 1, "released");
    let mut r = d("reschedule");
    r["at"] = serde_json::json!((Utc::now() + chrono::Duration::hours(2)).to_rfc3339());
    assert_eq!(act(addr, Some(ADMIN), &r).await.body, "{\"done\":true}");
    assert_eq!(
        delayed("deliver_at > now() + interval '90 minutes'").await,
        1
    );
    let mut wrong_owner = d("cancel");
    wrong_owner["owner"] = serde_json::json!("someone-else");
    assert_eq!(
        act(addr, Some(ADMIN), &wrong_owner).await.body,
        "{\"done\":false}"
    );
    assert_eq!(
        act(addr, Some(ADMIN), &d("cancel")).await.body,
        "{\"done\":true}"
    );
    assert_eq!(delayed("true").await, 0, "cancelled");
    let unknown = act(
        addr,
        Some(ADMIN),
        &serde_json::json!({"kind": "delayed", "action": "drop", "message_id": "x", "owner": ""}),
    )
    .await;
    assert_eq!(unknown.status, 400, "{}", unknown.body);
    node.stop().await;
    world.cleanup().await;
}

/// Contract section 8 with the console on: 200 clients asking for its page, summary,
/// rows, searches and row details, and posting actions with and without tokens, while
/// rows come due. As the scrape flood (tests/it/http.rs): every TimeOut once, none
/// early, nine in ten no later than `member_ttl`; and the console never holds more than
/// its one database session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_flood_neither_delays_timeouts_nor_takes_more_than_its_connection() {
    if World::through_pooler() {
        eprintln!("SKIPPED through a pooler: it counts each node's sessions on the server");
        return;
    }
    const CLIENTS: usize = 200;
    const ROWS: usize = 200;
    let mut world = World::new().await;
    world.overrides = console_env(Some(ADMIN), Some(READ));
    world.migrate().await;
    let inbox = Inbox::new().await;
    let node = Proc::spawn(&world).await;
    let addr = node.http_addr;
    wait_for_async(PATIENCE, "active", || async {
        get(addr, "/status").await.1.contains("\"role\":\"active\"")
    })
    .await;
    let keep = later(&world, "console-flood").await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let flood = console_flood(addr, CLIENTS, keep, stopped.clone());
    let console = format!("timeoutd-{}-console", node.node_id);
    let sessions = tokio::spawn(watch_console_sessions(
        world.pool.clone(),
        console.clone(),
        stopped.clone(),
    ));
    let first = Utc::now() + chrono::Duration::seconds(2);
    let mut due = HashMap::new();
    for i in 0..ROWS {
        let at = first + chrono::Duration::milliseconds(30 * i as i64);
        let e = Expectation::new(&format!("cflood-{i}"), "Reply", &inbox.queue).due_at(at);
        due.insert(world.expect(&e).await.to_string(), e.timeout_at);
    }
    wait_for(PATIENCE, "every TimeOut", || inbox.len() >= ROWS).await;
    let _ = stop.send(true);
    let asked = flood.join().expect("the clients' thread");
    let (most_at_once, pids) = sessions.await.expect("session watcher");
    let member_ttl = world.settings().election.member_ttl;
    let mut late = Vec::new();
    for r in inbox.all() {
        if let Some(deadline) = due.get(&r.message_id()) {
            assert!(r.at >= *deadline, "early: {} at {}", r.message_id(), r.at);
            late.push((r.fired_at() - *deadline).to_std().unwrap_or_default());
        }
    }
    late.sort();
    println!(
        "console flood: {asked:?}; lateness p50 {:?}, max {:?}; console sessions at once \
         {most_at_once}, backends {pids}",
        late[late.len() / 2],
        late.last()
    );
    assert_eq!(inbox.counts().len(), ROWS, "each row once");
    let within = late.iter().filter(|l| **l <= member_ttl).count();
    assert!(
        within * 10 >= late.len() * 9,
        "{} of {} TimeOuts fired later than {member_ttl:?}: {:?}",
        late.len() - within,
        late.len(),
        &late[within..]
    );
    assert!(
        asked.rows_ok > 0 && asked.refused > 0,
        "the flood ran: {asked:?}"
    );
    assert_eq!(
        asked.acted, 0,
        "no action without the admin token: {asked:?}"
    );
    assert!(
        most_at_once <= 1,
        "one console session at most, saw {most_at_once}"
    );
    assert_eq!(
        world.count(&format!("id = '{keep}'")).await,
        1,
        "refused actions changed nothing"
    );
    drop(node);
    world.cleanup().await;
}

/// What the flood's clients got.
#[derive(Debug, Default)]
struct Asked {
    rows_ok: u64,
    busy: u64,
    refused: u64,
    acted: u64,
    other: u64,
    failed: u64,
}

impl std::ops::AddAssign for Asked {
    fn add_assign(&mut self, g: Self) {
        self.rows_ok += g.rows_ok;
        self.busy += g.busy;
        self.refused += g.refused;
        self.acted += g.acted;
        self.other += g.other;
        self.failed += g.failed;
    }
}

/// `clients` clients asking, in turn, for the summary, a list, a search and a row
/// (authorised), for a cancel of `keep` with the read token (refused) and with a wrong
/// token, until `stopped`.
fn console_flood(
    addr: SocketAddr,
    clients: usize,
    keep: uuid::Uuid,
    stopped: tokio::sync::watch::Receiver<bool>,
) -> std::thread::JoinHandle<Asked> {
    flood(clients, stopped, move |step| async move {
        let (read, wrong) = (bearer(READ), bearer("a-wrong-token-for-the-flood"));
        let cancel =
            serde_json::json!({"kind": "expectation", "action": "cancel", "id": keep}).to_string();
        let detail = format!("/console/api/row?kind=expectation&id={keep}");
        let (method, path, auth, body): (&str, &str, Option<&str>, Option<&str>) = match step % 6 {
            0 => ("GET", "/console/api/summary", None, None),
            1 => (
                "GET",
                "/console/api/rows?kind=expectation&state=pending",
                Some(&read),
                None,
            ),
            2 => (
                "GET",
                "/console/api/search?q=console-flood",
                Some(&read),
                None,
            ),
            3 => ("GET", &detail, Some(&read), None),
            4 => ("POST", "/console/api/action", Some(&read), Some(&cancel)),
            _ => ("POST", "/console/api/action", Some(&wrong), Some(&cancel)),
        };
        let mut headers = vec![("Content-Type", "application/json")];
        if let Some(a) = auth {
            headers.push(("Authorization", a));
        }
        let mut got = Asked::default();
        // The wrong token from an address of its own: its failures throttle that one.
        let from = (step % 6 == 5).then_some(std::net::IpAddr::from([127, 0, 0, 2]));
        match request_from(from, addr, method, path, &headers, body).await {
            Ok(a) if a.status == 200 && method == "POST" => got.acted += 1,
            Ok(a) if a.status == 200 => got.rows_ok += 1,
            Ok(a) if a.status == 503 => got.busy += 1,
            Ok(a) if matches!(a.status, 401 | 403 | 429) => got.refused += 1,
            Ok(_) => got.other += 1,
            Err(_) => {
                got.failed += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        got
    })
}

/// The console's sessions every 20 ms until `stopped`: the most at once, and how many
/// backends it used in all.
async fn watch_console_sessions(
    pool: sqlx::PgPool,
    name: String,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) -> (usize, usize) {
    let mut pids = std::collections::HashSet::new();
    let mut most = 0;
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        let seen: Vec<i32> =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
                .bind(&name)
                .fetch_all(&pool)
                .await
                .expect("pg_stat_activity");
        most = most.max(seen.len());
        pids.extend(seen);
    }
    (most, pids.len())
}

/// The console's one connection: none before a request needs it; one request at a time
/// on it, the next answered 503 once `console.acquire_timeout` has passed; closed after
/// `console.idle_timeout` unused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_opened_when_needed_busy_answers_503_closed_when_idle() {
    if World::through_pooler() {
        eprintln!("SKIPPED through a pooler: it counts the node's sessions on the server");
        return;
    }
    let mut world = World::new().await;
    world.overrides = console_env(Some(ADMIN), None);
    for (k, v) in [
        ("TIMEOUTD__CONSOLE__ACQUIRE_TIMEOUT", "500ms"),
        ("TIMEOUTD__CONSOLE__STATEMENT_TIMEOUT", "20s"),
        ("TIMEOUTD__CONSOLE__IDLE_TIMEOUT", "2s"),
    ] {
        world.overrides.push((k.to_owned(), v.to_owned()));
    }
    world.migrate().await;
    let node = world.start().await;
    let addr = node.http_addr;
    let name = format!("timeoutd-{}-console", node.node_id);
    let sessions = || {
        let (pool, name) = (world.pool.clone(), name.clone());
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(name)
            .fetch_one(&pool)
            .await
            .expect("pg_stat_activity")
        }
    };
    let id = later(&world, "console-busy").await;
    for _ in 0..5 {
        let s = call(addr, "GET", "/console/api/summary", &[], None).await;
        assert_eq!(s.status, 200);
    }
    assert_eq!(sessions().await, 0, "the summary needs no connection");

    // The test holds the row: the console's cancel waits for it, on its one connection.
    let mut holder = world.pool.begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {}.expected_messages WHERE id = $1 FOR UPDATE",
        world.schema
    )))
    .bind(id)
    .execute(&mut *holder)
    .await
    .expect("lock the row");
    let cancel = tokio::spawn(async move {
        act(
            addr,
            Some(ADMIN),
            &serde_json::json!({"kind": "expectation", "action": "cancel", "id": id}),
        )
        .await
    });
    wait_for_async(PATIENCE, "the cancel waits for the row", || async {
        sessions().await == 1
    })
    .await;
    let asked = std::time::Instant::now();
    let busy = call(
        addr,
        "GET",
        "/console/api/rows?kind=expectation&state=pending",
        &[("Authorization", &bearer(ADMIN))],
        None,
    )
    .await;
    assert_eq!(busy.status, 503, "{}", busy.body);
    assert!(
        asked.elapsed() >= Duration::from_millis(500),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(sessions().await, 1, "never a second connection");
    holder.rollback().await.expect("release the row");
    let cancelled = cancel.await.expect("the cancel");
    assert_eq!(cancelled.body, "{\"done\":true}");
    assert_eq!(world.count(&format!("id = '{id}'")).await, 0);
    let text = get(addr, "/metrics").await.1;
    let series = format!(
        "timeoutd_console_refused_total{{group=\"{}\",reason=\"busy\"}}",
        world.group
    );
    assert_eq!(metric(&text, &series), Some(1.0), "{text}");
    wait_for_async(PATIENCE, "the idle connection closed", || async {
        sessions().await == 0
    })
    .await;
    node.stop().await;
    world.cleanup().await;
}

/// DNS rebinding: a page of another site whose name now resolves to the console's
/// address sends its own name as `Host`. Every console path answers such a request 421
/// before anything else, tokens or not; loopback names, the listen address and
/// `console.allowed_hosts` are answered. `/status` and `/metrics` answer any `Host`
/// (read-only, and scrapers name the pod's address).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_answers_only_its_own_host_names() {
    let mut world = World::new().await;
    world.overrides = console_env(Some(ADMIN), Some(READ));
    world.overrides.push((
        "TIMEOUTD__CONSOLE__ALLOWED_HOSTS".to_owned(),
        "timeoutd.example.com, ops.example.com:8443".to_owned(),
    ));
    world.migrate().await;
    let node = world.start().await;
    let addr = node.http_addr;
    let keep = later(&world, "rebinding").await;
    let admin = bearer(ADMIN);
    let cancel = serde_json::json!({"kind": "expectation", "action": "cancel", "id": keep});
    let port = addr.port();
    let ask = |host: String, path: &'static str| {
        let admin = admin.clone();
        let cancel = cancel.to_string();
        async move {
            let origin = format!("http://{host}");
            let mut headers = vec![("Host", host.as_str()), ("Authorization", admin.as_str())];
            let (method, body) = if path == "/console/api/action" {
                headers.extend([
                    ("Content-Type", "application/json"),
                    ("Origin", origin.as_str()),
                ]);
                ("POST", Some(cancel.as_str()))
            } else {
                ("GET", None)
            };
            call(addr, method, path, &headers, body).await
        }
    };
    let paths = [
        "/console/",
        "/console/console.js",
        "/console/api/summary",
        "/console/api/rows?kind=expectation&state=pending",
        "/console/api/search?q=rebinding",
        "/console/api/action",
    ];
    for host in [
        format!("evil.example:{port}"),
        "evil.example".to_owned(),
        format!("127.0.0.1.evil.example:{port}"),
        format!("ops.example.com:{port}"),
        String::new(),
    ] {
        for path in paths {
            let a = ask(host.clone(), path).await;
            assert_eq!(a.status, 421, "{host:?} {path}: {a:?}");
            assert!(!a.headers.contains_key("access-control-allow-origin"));
        }
    }
    assert_eq!(
        world.count(&format!("id = '{keep}'")).await,
        1,
        "nothing acted"
    );
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        "timeoutd.example.com".to_owned(),
        "TIMEOUTD.example.com:443".to_owned(),
        "ops.example.com:8443".to_owned(),
    ] {
        for path in &paths[..5] {
            let a = ask(host.clone(), path).await;
            assert_eq!(a.status, 200, "{host:?} {path}: {a:?}");
        }
    }
    for path in ["/status", "/metrics", "/healthz"] {
        let a = call(addr, "GET", path, &[("Host", "evil.example")], None).await;
        assert_eq!(a.status, 200, "{path} answers any Host");
    }
    let a = ask(format!("localhost:{port}"), "/console/api/action").await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(world.count(&format!("id = '{keep}'")).await, 0, "acted");
    let text = call(addr, "GET", "/metrics", &[], None).await.body;
    assert!(
        text.contains("timeoutd_console_refused_total{") && text.contains("reason=\"host\""),
        "refusals counted by reason"
    );
    node.stop().await;
    world.cleanup().await;
}

/// A client that presents wrong tokens is answered 401 ten times, then 429 with
/// `Retry-After` for every request with a token (the right one too: a guess is not
/// checked), until that much later; another address is not held up meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_tokens_are_throttled_per_client() {
    let mut world = World::new().await;
    world.overrides = console_env(Some(ADMIN), Some(READ));
    world.migrate().await;
    let node = world.start().await;
    let addr = node.http_addr;
    let rows = "/console/api/rows?kind=expectation&state=pending";
    let guesser = std::net::IpAddr::from([127, 0, 0, 3]);
    let other = std::net::IpAddr::from([127, 0, 0, 4]);
    let from = |ip, token: &str| {
        let auth = bearer(token);
        async move {
            request_from(
                Some(ip),
                addr,
                "GET",
                rows,
                &[("Authorization", &auth)],
                None,
            )
            .await
            .expect("request")
        }
    };
    for i in 0..10 {
        let a = from(guesser, &format!("a-wrong-guess-number-{i:04}")).await;
        assert_eq!(a.status, 401, "guess {i}: {a:?}");
    }
    let throttled = from(guesser, "one-more-wrong-guess-0000").await;
    assert_eq!(throttled.status, 429, "{throttled:?}");
    let wait: u64 = throttled.headers["retry-after"].parse().expect("seconds");
    assert!((1..=6).contains(&wait), "Retry-After {wait}");
    let right = from(guesser, READ).await;
    assert_eq!(right.status, 429, "the right token is not even looked at");
    assert_eq!(
        from(other, READ).await.status,
        200,
        "another client is not held up"
    );
    let anonymous = call(addr, "GET", "/console/api/summary", &[], None).await;
    assert_eq!(anonymous.status, 200, "no token, nothing throttled");
    tokio::time::sleep(Duration::from_secs(wait)).await;
    assert_eq!(from(guesser, READ).await.status, 200, "after Retry-After");
    let metrics = call(addr, "GET", "/metrics", &[], None).await.body;
    assert!(metrics.contains("reason=\"throttled\""), "counted");
    node.stop().await;
    world.cleanup().await;
}
