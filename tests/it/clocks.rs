//! Clocks need not agree (contract section 8): daemons whose host clocks are off by
//! seconds or minutes (libfaketime) elect one active node, with and without a group
//! secret, and copies of their announcements sent again later still do not count.
//!
//! Needs libfaketime (Debian: `apt-get install libfaketime`); `TIMEOUTD_TEST_LIBFAKETIME`
//! names the library when it is somewhere else.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use chrono::Utc;
use futures_util::StreamExt;
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use timeoutd::wire::announcement::Announcement;
use uuid::Uuid;

use crate::common::{PATIENCE, Proc, World, amqp_at, amqp_url, consumed_queue};
use crate::http::{get, metric};

const ANNOUNCE: &str = "timeoutd.announcements";
const SECRET: &str = "0123456789abcdef-clock-group-secret";

fn libfaketime() -> String {
    let path = std::env::var("TIMEOUTD_TEST_LIBFAKETIME")
        .unwrap_or_else(|_| "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1".to_owned());
    assert!(
        std::path::Path::new(&path).exists(),
        "{path} is missing: install libfaketime (apt-get install libfaketime) or name it \
         in TIMEOUTD_TEST_LIBFAKETIME"
    );
    path
}

/// A daemon whose wall clock is off by `offset` (libfaketime syntax: "+30s", "-10m";
/// "" for the true time). Its monotonic clock is left alone.
async fn daemon(world: &World, offset: &str) -> Proc {
    let mut env = Vec::new();
    if !offset.is_empty() {
        env.push(("LD_PRELOAD".to_owned(), libfaketime()));
        env.push(("FAKETIME".to_owned(), offset.to_owned()));
        env.push(("FAKETIME_DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()));
    }
    Proc::spawn_with(world, &env).await
}

async fn status(addr: SocketAddr) -> serde_json::Value {
    let (code, body) = get(addr, "/status").await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("status json")
}

/// Exactly one node active, every node settled and knowing all of them.
async fn one_active(procs: &[Proc]) -> Option<Uuid> {
    let mut actives = Vec::new();
    for p in procs {
        let s = status(p.http_addr).await;
        let members = s["members"].as_array().map_or(0, Vec::len);
        if members < procs.len() || s["settled"] != true {
            return None;
        }
        if s["role"] == "active" {
            actives.push(p.node_id);
        }
    }
    (actives.len() == 1).then(|| actives[0])
}

async fn role_changes(p: &Proc) -> f64 {
    let (_, text) = get(p.http_addr, "/metrics").await;
    metric(&text, "timeoutd_role_changes_total{").unwrap_or(-1.0)
}

fn not_counted(s: &serde_json::Value) -> u64 {
    let r = &s["rejected_announcements"];
    r["by_reason"]["replayed"].as_u64().unwrap_or(0) + r["unvouched"].as_u64().unwrap_or(0)
}

/// What the group sent: each announcement whole (properties and body), and when it
/// arrived here.
type Captured = Vec<(Instant, BasicProperties, Vec<u8>)>;

async fn capture(conn: &lapin::Connection, group: &str, span: Duration) -> Captured {
    let ch = conn.create_channel().await.expect("channel");
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let (_, mut consumer) = consumed_queue(&ch, Some((ANNOUNCE, group, durable))).await;
    let mut captured = Vec::new();
    let until = Instant::now() + span;
    while let Ok(Some(Ok(d))) = tokio::time::timeout(
        until.saturating_duration_since(Instant::now()),
        consumer.next(),
    )
    .await
    {
        captured.push((Instant::now(), d.properties.clone(), d.data.clone()));
    }
    let _ = ch.close(200, "OK".into()).await;
    captured
}

async fn replay(conn: &lapin::Connection, group: &str, captured: &Captured) {
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    for (_, props, body) in captured {
        ch.basic_publish(
            ANNOUNCE.into(),
            group.into(),
            BasicPublishOptions::default(),
            body,
            props.clone(),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    }
    let _ = ch.close(200, "OK".into()).await;
}

/// Three daemons at `offsets` (one of them the true time) elect one active node and
/// keep it; the announcements each sends carry its own skewed clock. Then copies of
/// what they sent (captured, sent again 8 s later, when news that old is no longer
/// recent) change nothing: no role changes, and the copies are refused. Last, the
/// active node is killed: another takes over, and copies of the dead node's
/// announcements do not bring it back. Returns how long the group took to one active
/// node after the last daemon was ready.
async fn skewed_group(secret: bool, offsets: [&str; 3], skew: Duration) -> Duration {
    let mut world = World::new().await;
    if secret {
        world
            .overrides
            .push(("TIMEOUTD__ELECTION__SECRET".into(), SECRET.into()));
    }
    world.migrate().await;
    let group = world.group.clone();
    let mut procs = Vec::new();
    for offset in offsets {
        procs.push(daemon(&world, offset).await);
    }
    let started = Instant::now();
    let what = format!("{offsets:?} secret={secret}");
    let deadline = started + PATIENCE;
    let active = loop {
        if let Some(active) = one_active(&procs).await {
            break active;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: no single active node within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let took = started.elapsed();

    // Each node's announcements carry its own clock: the offset is really seen.
    let conn = amqp_at(&amqp_url()).await;
    let captured = capture(&conn, &group, Duration::from_secs(3)).await;
    let mut offsets_seen: HashMap<Uuid, i64> = HashMap::new();
    for (_, _, body) in &captured {
        let a = Announcement::decode(None, body, &group).expect("an announcement");
        offsets_seen.insert(a.node_id, (a.sent_at - Utc::now()).num_seconds());
    }
    for (p, offset) in procs.iter().zip(offsets) {
        let expected = skew.as_secs() as i64
            * match offset.chars().next() {
                Some('+') => 1,
                Some('-') => -1,
                _ => 0,
            };
        if let Some(seen) = offsets_seen.get(&p.node_id) {
            assert!(
                (seen - expected).abs() <= 5,
                "{what}: node {} at {offset} sends sent_at {seen} s off",
                p.node_id
            );
        }
    }
    assert!(
        offsets_seen.keys().any(|id| *id != active) || offsets_seen.len() == 1,
        "{what}: captured {offsets_seen:?}"
    );

    // Stays one active node for a while.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(one_active(&procs).await, Some(active), "{what}");
    }

    // Copies of everything captured, once the news is old.
    let before: Vec<f64> = futures_util::future::join_all(procs.iter().map(role_changes)).await;
    let refused_before: Vec<u64> = futures_util::future::join_all(
        procs
            .iter()
            .map(|p| async { not_counted(&status(p.http_addr).await) }),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    replay(&conn, &group, &captured).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after: Vec<f64> = futures_util::future::join_all(procs.iter().map(role_changes)).await;
    assert_eq!(before, after, "{what}: a copy changed a role");
    assert_eq!(one_active(&procs).await, Some(active), "{what}");
    for (p, earlier) in procs.iter().zip(refused_before) {
        let s = status(p.http_addr).await;
        assert!(
            not_counted(&s) >= earlier + captured.len() as u64 / 2,
            "{what}: node {} did not refuse the copies: {s}",
            p.node_id
        );
        assert!(
            !p.logged("arrive too late"),
            "{what}: a copy made node {} believe it lags",
            p.node_id
        );
    }

    // The active node dies; copies of its announcements do not bring it back.
    let i = procs
        .iter()
        .position(|p| p.node_id == active)
        .expect("active");
    let mut dead = procs.remove(i);
    dead.signal("KILL");
    let _ = dead.child.wait().await;
    let deadline = Instant::now() + PATIENCE;
    let successor = loop {
        if let Some(next) = one_active(&procs).await {
            break next;
        }
        assert!(Instant::now() < deadline, "{what}: no takeover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let of_dead: Captured = captured
        .iter()
        .filter(|(_, _, body)| {
            Announcement::decode(None, body, &group).is_ok_and(|a| a.node_id == active)
        })
        .cloned()
        .collect();
    assert!(
        !of_dead.is_empty(),
        "{what}: captured nothing of the active node"
    );
    for _ in 0..3 {
        replay(&conn, &group, &of_dead).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        for p in &procs {
            let s = status(p.http_addr).await;
            let members = s["members"].as_array().expect("members");
            assert!(
                members.iter().all(|m| m["node_id"] != active.to_string()),
                "{what}: the dead node is back: {s}"
            );
        }
        assert_eq!(one_active(&procs).await, Some(successor), "{what}");
    }
    let _ = conn.close(200, "OK".into()).await;
    drop(dead);
    drop(procs);
    world.cleanup().await;
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clocks_30_s_and_10_min_apart_elect_one_active_node() {
    for (offsets, skew) in [
        (["+30s", "-30s", ""], Duration::from_secs(30)),
        (["+10m", "", "-10m"], Duration::from_secs(600)),
    ] {
        let took = skewed_group(false, offsets, skew).await;
        eprintln!("clocks {offsets:?}: one active node {took:?} after the last was ready");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_group_secret_clocks_30_s_and_10_min_apart_elect_one_active_node() {
    for (offsets, skew) in [
        (["-30s", "", "+30s"], Duration::from_secs(30)),
        (["", "-10m", "+10m"], Duration::from_secs(600)),
    ] {
        let took = skewed_group(true, offsets, skew).await;
        eprintln!("clocks {offsets:?} (secret): one active node {took:?} after the last was ready");
    }
}

/// A node of the previous version: announces with the daemons' user and `seq`, but
/// names nothing (no `after`), as that version does, until `stop`, then leaves.
async fn previous_version_node(group: &str, id: &str, stop: tokio_util::sync::CancellationToken) {
    let conn = amqp_at(&amqp_url()).await;
    let user = url::Url::parse(&amqp_url())
        .expect("url")
        .username()
        .to_owned();
    let props = BasicProperties::default()
        .with_type(timeoutd::wire::announcement::MESSAGE_TYPE.into())
        .with_content_type("application/json".into())
        .with_user_id(user.as_str().into());
    let ch = conn.create_channel().await.expect("channel");
    let mut seq = 0;
    loop {
        let leaving = stop.is_cancelled();
        seq += 1;
        let body = format!(
            r#"{{"node_id":"{id}","group":"{group}","sent_at":"{}","seq":{seq},"active":true,"leaving":{leaving},"probe":false,"withdrawn":false}}"#,
            Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
        );
        ch.basic_publish(
            ANNOUNCE.into(),
            group.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            props.clone(),
        )
        .await
        .expect("publish");
        if leaving {
            break;
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
    let _ = conn.close(200, "OK".into()).await;
}

/// A rolling upgrade from the version before `after`, clocks agreeing: a current node
/// counts the earlier one (judged by `sent_at`, as that version judges), defers to its
/// lower id, and takes over once it leaves: one active node throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_the_previous_version_counts_while_clocks_agree() {
    const OLD: &str = "00000000-0000-4000-8000-00000000000b";
    let world = World::new().await;
    world.migrate().await;
    let group = world.group.clone();
    let stop = tokio_util::sync::CancellationToken::new();
    let old = tokio::spawn({
        let (group, stop) = (group.clone(), stop.clone());
        async move { previous_version_node(&group, OLD, stop).await }
    });
    let node = daemon(&world, "").await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        let s = status(node.http_addr).await;
        let knows_old = s["members"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["node_id"] == OLD));
        if s["settled"] == true && knows_old && s["role"] == "passive" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the old node does not count: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // It stays counted and lower for a few announce intervals.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(status(node.http_addr).await["role"], "passive");
    }
    stop.cancel();
    old.await.expect("old node");
    let deadline = Instant::now() + PATIENCE;
    while status(node.http_addr).await["role"] != "active" {
        assert!(
            Instant::now() < deadline,
            "no takeover after the old node left"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(node);
    world.cleanup().await;
}
