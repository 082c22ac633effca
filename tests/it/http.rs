use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use timeoutd::client::Expectation;

use crate::common::{Inbox, World, wait_for, wait_for_async};

/// A plain HTTP/1.1 GET: (status code, body).
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.expect("read");
    let code = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = raw.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (code, body)
}

/// Over real HTTP: live at once, ready once settled, and /status shows the role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_and_status_follow_the_node() {
    let world = World::new().await;
    world.migrate().await;
    let node = world.start().await;
    let addr = node.http_addr;
    assert_eq!(get(addr, "/healthz").await.0, 200);
    wait_for_async(Duration::from_secs(5), "ready", || async {
        get(addr, "/readyz").await.0 == 200
    })
    .await;
    wait_for_async(Duration::from_secs(5), "status says active", || async {
        let (code, body) = get(addr, "/status").await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        code == 200 && v["role"] == "active"
    })
    .await;
    let (_, body) = get(addr, "/status").await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["node_id"], node.node_id.to_string().as_str());
    assert_eq!(v["group"], world.group.as_str());
    assert_eq!(v["lowest"], node.node_id.to_string().as_str());
    assert_eq!(v["bus_connected"], true);
    node.stop().await;
    world.cleanup().await;
}

/// Without a broker the node is alive but not ready, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_without_rabbitmq_names_the_side() {
    let mut world = World::new().await;
    world.overrides.push((
        "TIMEOUTD__AMQP__URL".into(),
        "amqp://guest:guest@127.0.0.1:1/%2f".into(),
    ));
    let node = world.start().await;
    let (code, body) = get(node.http_addr, "/readyz").await;
    assert_eq!(code, 503);
    assert!(body.contains("rabbitmq"), "{body}");
    assert_eq!(get(node.http_addr, "/healthz").await.0, 200);
    node.stop().await;
    world.cleanup().await;
}

pub fn metric(text: &str, name_and_labels_prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name_and_labels_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// /metrics and /status over HTTP follow a role change (a second node takes over when the
/// first leaves) and count fired TimeOuts and publish failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_status_follow_role_changes_and_firing() {
    let world = World::new().await;
    world.migrate().await;
    let inbox = Inbox::new().await;
    let first = world.start().await;
    wait_for(Duration::from_secs(5), "first active", || {
        *first.role.borrow() == timeoutd::election::Role::Active
    })
    .await;
    let second = world.start().await;
    let (a, b) = (first.http_addr, second.http_addr);
    for i in 0..3 {
        world
            .expect(&Expectation::new(&format!("m-{i}"), "Reply", &inbox.queue))
            .await;
    }
    world
        .expect(&Expectation::new(
            "nowhere",
            "Reply",
            &format!("no-queue-{}", world.group),
        ))
        .await;
    wait_for(Duration::from_secs(10), "three TimeOuts", || {
        inbox.len() == 3
    })
    .await;
    let active_one = if first.node_id < second.node_id { a } else { b };
    // Both nodes may have fired some (the lower one takes over once settled).
    wait_for_async(Duration::from_secs(10), "fired counted", || async {
        let (_, ta) = get(a, "/metrics").await;
        let (_, tb) = get(b, "/metrics").await;
        let fired = |t: &str| metric(t, "timeoutd_timeouts_fired_total{").unwrap_or(0.0);
        fired(&ta) + fired(&tb) >= 3.0 && (ta + &tb).contains("reason=\"returned\"")
    })
    .await;
    wait_for_async(Duration::from_secs(10), "two members", || async {
        let (_, text) = get(active_one, "/metrics").await;
        metric(&text, "timeoutd_members{") == Some(2.0)
            && metric(&text, "timeoutd_active{") == Some(1.0)
    })
    .await;
    let (code, text) = get(active_one, "/metrics").await;
    assert_eq!(code, 200);
    for family in [
        "timeoutd_active{",
        "timeoutd_members{",
        "timeoutd_scan_duration_seconds_bucket{",
        "timeoutd_fire_lateness_seconds_count{",
        "timeoutd_announcements_received_total{",
        "timeoutd_pending_failing{",
        "timeoutd_amqp_connected{",
        "timeoutd_postgres_connected{",
    ] {
        assert!(text.contains(family), "{family} missing:\n{text}");
    }
    assert_eq!(metric(&text, "timeoutd_active{"), Some(1.0));
    assert_eq!(metric(&text, "timeoutd_members{"), Some(2.0));
    assert_eq!(metric(&text, "timeoutd_pending_failing{"), Some(1.0));
    // The active one leaves: the other's /metrics and /status show the takeover.
    let (leaver, stayer) = if first.node_id < second.node_id {
        (first, second)
    } else {
        (second, first)
    };
    leaver.stop().await;
    let addr = stayer.http_addr;
    wait_for_async(Duration::from_secs(5), "takeover visible", || async {
        let (_, text) = get(addr, "/metrics").await;
        let (_, status) = get(addr, "/status").await;
        metric(&text, "timeoutd_active{") == Some(1.0)
            && metric(&text, "timeoutd_role_changes_total{").unwrap_or(0.0) >= 1.0
            && status.contains("\"role\":\"active\"")
    })
    .await;
    stayer.stop().await;
    world.cleanup().await;
}

/// Every series the README documents, read from /metrics after the event it counts:
/// start (role, candidate, members, connections, announcements), a junk announcement,
/// TimeOuts fired (count, lateness, scan duration), an unroutable row (failure by reason,
/// pending counts), a row the process manager's foreign key keeps (parked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_series_moves_after_its_event() {
    let mut world = World::new().await;
    let out = format!("t.out.{}", world.group);
    world
        .overrides
        .push(("TIMEOUTD__DELAY__ALLOWED_EXCHANGES".to_owned(), out.clone()));
    world.migrate().await;
    let inbox = Inbox::new().await;
    inbox.bind_new_exchange(&out, &inbox.queue).await;
    let node = world.start().await;
    let addr = node.http_addr;
    wait_for(Duration::from_secs(5), "active", || {
        *node.role.borrow() == timeoutd::election::Role::Active
    })
    .await;
    hold_with_foreign_key(&world, &Expectation::new("held", "Reply", &inbox.queue)).await;
    for i in 0..3 {
        let e = Expectation::new(&format!("s-{i}"), "Reply", &inbox.queue);
        world.expect(&e).await;
    }
    let nowhere = format!("no-queue-{}", world.group);
    world
        .expect(&Expectation::new("nowhere", "Reply", &nowhere))
        .await;
    crate::bad_input::publish_junk(&world.group, &[(None, b"{not json".to_vec())]).await;
    delayed_events(&world, &out, &inbox.queue, addr).await;
    let by_label = [
        ("timeoutd_fired_total{", "kind=\"delayed\"", 1.0),
        ("timeoutd_fired_total{", "kind=\"expectation\"", 4.0),
        ("timeoutd_lateness_seconds_count{", "kind=\"delayed\"", 1.0),
        (
            "timeoutd_publish_failures_total{",
            "kind=\"expectation\"",
            1.0,
        ),
        (
            "timeoutd_pending_rows{",
            "kind=\"delayed\",state=\"failing\"",
            1.0,
        ),
        (
            "timeoutd_pending_rows{",
            "kind=\"expectation\",state=\"pending\"",
            2.0,
        ),
        ("timeoutd_delayed_ingested_total{", "result=\"stored\"", 1.0),
        ("timeoutd_delayed_ingested_total{", "result=\"held\"", 1.0),
        (
            "timeoutd_delayed_ingested_total{",
            "result=\"duplicate\"",
            1.0,
        ),
        (
            "timeoutd_delayed_ingested_total{",
            "result=\"cancelled\"",
            1.0,
        ),
        ("timeoutd_delayed_ingest_seconds_count{", "", 1.0),
        ("timeoutd_delayed_ingress_consuming{", "", 1.0),
    ];
    let expected = [
        ("timeoutd_active{", 1.0),
        ("timeoutd_candidate{", 1.0),
        ("timeoutd_members{", 1.0),
        ("timeoutd_amqp_connected{", 1.0),
        ("timeoutd_postgres_connected{", 1.0),
        ("timeoutd_role_changes_total{", 1.0),
        ("timeoutd_announcements_sent_total{", 1.0),
        ("timeoutd_announcements_received_total{", 1.0),
        ("timeoutd_announcements_rejected_total{", 1.0),
        ("timeoutd_timeouts_fired_total{", 4.0),
        ("timeoutd_rows_parked_total{", 1.0),
        ("timeoutd_publish_failures_total{", 1.0),
        ("timeoutd_scan_duration_seconds_count{", 1.0),
        ("timeoutd_fire_lateness_seconds_count{", 4.0),
        ("timeoutd_pending_total{", 2.0),
        ("timeoutd_pending_due{", 2.0),
        ("timeoutd_pending_overdue{", 2.0),
        ("timeoutd_pending_failing{", 2.0),
    ];
    let moved = |text: &str| {
        expected
            .iter()
            .all(|(name, at_least)| metric(text, name).is_some_and(|v| v >= *at_least))
            && by_label.iter().all(|(name, label, at_least)| {
                labelled(text, name, label).is_some_and(|v| v >= *at_least)
            })
    };
    wait_for_async(Duration::from_secs(15), "every series moved", || async {
        moved(&get(addr, "/metrics").await.1)
    })
    .await;
    let (_, last) = get(addr, "/metrics").await;
    for (name, at_least) in expected {
        let v = metric(&last, name).unwrap_or(f64::NAN);
        println!("{name}… {v} (≥ {at_least})");
    }
    for (name, label, at_least) in by_label {
        let v = labelled(&last, name, label).unwrap_or(f64::NAN);
        println!("{name}…{label}… {v} (≥ {at_least})");
    }
    node.stop().await;
    world.cleanup().await;
}

/// The value of the first series `name…` whose labels contain `label`.
fn labelled(text: &str, name: &str, label: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Delayed messages: one delivered (to `queue`, through the allowed exchange `out`), one held
/// (junk `x-delay`), one published twice while pending (a duplicate) and then cancelled.
/// The cancel waits until the duplicate was counted: ingest batches run concurrently, and
/// a cancel stored first makes both copies `arrived_cancelled` instead.
async fn delayed_events(world: &World, out: &str, queue: &str, addr: std::net::SocketAddr) {
    use lapin::BasicProperties;
    use lapin::types::{AMQPValue, LongString};

    use crate::delayed::{headers, publish, publisher};
    let (_conn, ch) = publisher().await;
    let now = headers(vec![(
        "x-timeoutd-exchange",
        AMQPValue::LongString(LongString::from(out)),
    )]);
    let out = BasicProperties::default().with_headers(now);
    publish(&ch, &world.ingress(), queue, out, b"delayed").await;
    let junk = headers(vec![(
        "x-delay",
        AMQPValue::LongString(LongString::from("x")),
    )]);
    let held = BasicProperties::default().with_headers(junk);
    publish(&ch, &world.ingress(), "k", held, b"held").await;
    for _ in 0..2 {
        let later = headers(vec![("x-delay", AMQPValue::LongInt(60_000))]);
        let twice = BasicProperties::default()
            .with_message_id("twice".into())
            .with_headers(later);
        publish(&ch, &world.ingress(), "k", twice, b"twice").await;
    }
    wait_for_async(Duration::from_secs(10), "the duplicate counted", || async {
        let text = get(addr, "/metrics").await.1;
        labelled(
            &text,
            "timeoutd_delayed_ingested_total{",
            "result=\"duplicate\"",
        )
        .is_some_and(|v| v >= 1.0)
    })
    .await;
    let cancel = headers(vec![(
        "x-timeoutd-cancel",
        AMQPValue::LongString(LongString::from("twice")),
    )]);
    publish(
        &ch,
        &world.ingress(),
        "k",
        BasicProperties::default().with_headers(cancel),
        b"",
    )
    .await;
}

/// Insert `e` referenced by a table of the "process manager" in the same transaction, so
/// the daemon never sees it unreferenced: its delete will be refused.
async fn hold_with_foreign_key(world: &World, e: &Expectation) {
    let s = &world.schema;
    let ddl = format!("CREATE TABLE {s}.pm_refs (exp uuid REFERENCES {s}.expected_messages(id))");
    sqlx::query(sqlx::AssertSqlSafe(ddl))
        .execute(&world.pool)
        .await
        .expect("pm table");
    let mut tx = world.pool.begin().await.expect("tx");
    timeoutd::client::expect(&mut tx, s, e)
        .await
        .expect("insert");
    let refer = format!("INSERT INTO {s}.pm_refs VALUES ($1)");
    sqlx::query(sqlx::AssertSqlSafe(refer))
        .bind(e.id)
        .execute(&mut *tx)
        .await
        .expect("reference");
    tx.commit().await.expect("commit");
}
