//! No message closes a connection, on the way in or out (contract section 8), from the
//! outside with the real broker: a publisher that may write only to the delay ingress
//! sends headers that come to just under `frame_max` (the broker adds its own on
//! delivery), many headers, and headers nested deep (thousands of levels, written byte by
//! byte: a client library would overflow its own stack); and a row written straight into
//! `delayed_messages` fits alone but not with timeoutd's own headers. Every other message
//! is delivered once and on time, each refused one is counted with its reason or held,
//! and the node's broker connection is the one it opened at the start.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use timeoutd::bus::{HEADROOM, MAX_HEADER_DEPTH, MAX_HEADER_VALUES, header_frame_size};
use timeoutd::client::Expectation;
use timeoutd::election::Role;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{Inbox, PATIENCE, World, rabbitmqctl, wait_for, wait_for_async};
use crate::delayed::{publish, publisher_at};
use crate::http::get;
use crate::principals::{Realm, Rights};

const TARGET: &str = "frames.target";
const TIMEOUTS: &str = "frames.timeouts";
/// RabbitMQ's default `frame_max`, which the tests check the broker offers.
const FRAME_MAX: usize = 131_072;

/// A vhost of the test's own: the daemon's user (everything in it), an admin for the
/// test's queues, and a publisher that may write only to the ingress exchange.
struct Stage {
    realm: Realm,
    world: World,
    admin: String,
    attacker: String,
}

impl Stage {
    async fn new() -> Self {
        let mut realm = Realm::new().await;
        let mut world = World::new().await;
        let daemon = realm.user("daemon", &Rights::all()).await;
        let admin = realm.user("admin", &Rights::all()).await;
        let ingress = world.ingress();
        let attacker = realm
            .user("attacker", &Rights::write_only(&[ingress.as_str()]))
            .await;
        for (k, v) in [
            ("TIMEOUTD__AMQP__URL", daemon.as_str()),
            ("TIMEOUTD__DELAY__TARGET_EXCHANGE", TARGET),
        ] {
            world.overrides.push((k.to_owned(), v.to_owned()));
        }
        world.migrate().await;
        Self {
            realm,
            world,
            admin,
            attacker,
        }
    }

    /// An active node consuming the ingress, and the broker's id of its connection.
    async fn node(&self) -> (timeoutd::daemon::Handle, String) {
        let node = self.world.start().await;
        wait_for(PATIENCE, "node active", || {
            *node.role.borrow() == Role::Active
        })
        .await;
        wait_for(PATIENCE, "ingress consuming", || {
            node.snapshot().ingress.is_some_and(|i| i.consuming)
        })
        .await;
        let conns = connections(node.node_id).await;
        assert_eq!(conns.len(), 1, "one connection: {conns:?}");
        (node, conns[0].clone())
    }

    async fn cleanup(self) {
        self.world.cleanup().await;
        self.realm.cleanup().await;
    }
}

/// The broker's ids (`pid`) of the connections a node opened (named after its id). A
/// connection that closed and was opened again has another.
async fn connections(node: uuid::Uuid) -> Vec<String> {
    let out = rabbitmqctl()
        .args([
            "-q",
            "--no-table-headers",
            "list_connections",
            "pid",
            "client_properties",
        ])
        .output()
        .await
        .expect("rabbitmqctl");
    let name = format!("timeoutd {node}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&name))
        .filter_map(|l| l.split('\t').next())
        .map(str::to_owned)
        .collect()
}

/// The node's connection is still the one it opened: never closed by either side.
async fn same_connection(node: &timeoutd::daemon::Handle, first: &str) {
    let now = connections(node.node_id).await;
    assert_eq!(
        now,
        vec![first.to_owned()],
        "the node's connection was never closed"
    );
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

async fn ingested(node: &timeoutd::daemon::Handle, result: &str) -> u64 {
    let metrics = get(node.http_addr, "/metrics").await.1;
    let label = format!("result=\"{result}\"");
    metrics
        .lines()
        .find(|l| l.starts_with("timeoutd_delayed_ingested_total{") && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Properties with `x-delay` and the headers given, `message_id` = `id`.
fn delayed(id: &str, delay_ms: i64, mut extra: Vec<(String, AMQPValue)>) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms));
    for (k, v) in extra.drain(..) {
        h.insert(k.as_str().into(), v);
    }
    BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2)
        .with_headers(h)
}

/// A delayed message (1 s) with a `pad` header that brings its content-header frame to
/// `size` bytes.
fn padded_to(id: &str, size: usize) -> BasicProperties {
    let without = header_frame_size(&delayed(id, 1000, vec![("pad".into(), text(""))]));
    let pad = "p".repeat(size - without);
    let props = delayed(id, 1000, vec![("pad".into(), text(&pad))]);
    assert_eq!(header_frame_size(&props), size);
    props
}

/// The frame_max the broker gives a client that asks for none.
async fn broker_frame_max(url: &str) -> usize {
    let (conn, _ch) = publisher_at(url).await;
    let max = conn.configuration().frame_max() as usize;
    let _ = conn.close(200, "OK".into()).await;
    max
}

/// The one-message attack of the issue: a write-only publisher sends one delayed message
/// whose header frame is 16 bytes under `frame_max` (the broker takes it, and adds its
/// own headers when it delivers it), ahead of 100 ordinary delayed messages, while 200
/// expectations fall due. The message is refused to the broker and counted
/// (`rejected_headers_too_large`); every other one is delivered once and on time; the
/// node's connection is never closed. Before the fix, lapin closed the connection at the
/// frame ("received large frame"), the broker redelivered it to the next connection, and
/// nothing was delivered while it looped (or, had the frame fitted, the broker closed the
/// connection when timeoutd delivered it with its own headers added).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_message_just_under_frame_max_stops_nothing() {
    let stage = Stage::new().await;
    assert_eq!(broker_frame_max(&stage.admin).await, FRAME_MAX);
    let timeouts = Inbox::at(&stage.admin, Some((TIMEOUTS, "#"))).await;
    let target = Inbox::at(&stage.admin, Some((TARGET, "#"))).await;
    let (node, conn) = stage.node().await;
    let ingress = stage.world.ingress();
    let (_c, ch) = publisher_at(&stage.attacker).await;
    publish(
        &ch,
        &ingress,
        "k",
        padded_to("attack", FRAME_MAX - 16),
        b"attack",
    )
    .await;
    let due = Utc::now() + chrono::Duration::seconds(4);
    let mut expected = HashMap::new();
    for i in 0..200 {
        let e = Expectation::new(&format!("p-{i}"), "Reply", "r")
            .exchange(TIMEOUTS)
            .due_at(due);
        expected.insert(stage.world.expect(&e).await.to_string(), due);
    }
    let mut sent: HashMap<String, DateTime<Utc>> = HashMap::new();
    for i in 0..100 {
        let id = format!("d-{i}");
        sent.insert(id.clone(), Utc::now());
        publish(&ch, &ingress, "k", delayed(&id, 2000, Vec::new()), b"d").await;
    }
    wait_for(PATIENCE, "every TimeOut and delayed message", || {
        timeouts.len() >= 200 && target.len() >= 100
    })
    .await;
    // Anything late or twice would have arrived by now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (id, n) in timeouts.counts() {
        assert_eq!(n, 1, "TimeOut {id} once");
        assert!(expected.contains_key(&id), "a TimeOut of ours: {id}");
    }
    for r in timeouts.all() {
        let late = r.fired_at() - expected[&r.message_id()];
        assert!(
            late < chrono::Duration::seconds(4),
            "TimeOut {} fired {late} after its deadline",
            r.message_id()
        );
    }
    for (id, n) in target.counts() {
        assert_eq!(n, 1, "delayed message {id} once");
        assert!(
            sent.contains_key(&id),
            "none but ours, not the attack: {id}"
        );
    }
    for r in target.all() {
        let after = r.at - sent[&r.message_id()];
        assert!(
            after >= chrono::Duration::milliseconds(2000)
                && after < chrono::Duration::milliseconds(2000 + 4000),
            "delayed message {} arrived {after} after its publish",
            r.message_id()
        );
    }
    same_connection(&node, &conn).await;
    wait_for_async(PATIENCE, "the attack refused", || async {
        ingested(&node, "rejected_headers_too_large").await == 1
    })
    .await;
    assert_eq!(ingested(&node, "stored").await, 100);
    node.stop().await;
    stage.cleanup().await;
}

/// A nested table `levels` deep (the outermost included), as AMQP field-table bytes.
fn nested_bytes(levels: usize) -> Vec<u8> {
    let mut inner = 0u32.to_be_bytes().to_vec();
    for _ in 1..levels {
        let mut entry = vec![1, b'a', b'F'];
        entry.extend_from_slice(&inner);
        inner = (entry.len() as u32).to_be_bytes().to_vec();
        inner.extend_from_slice(&entry);
    }
    inner
}

/// A nested table `levels` deep (the outermost included).
fn nested(levels: usize) -> FieldTable {
    let mut t = FieldTable::default();
    for _ in 1..levels {
        let mut outer = FieldTable::default();
        outer.insert("a".into(), AMQPValue::FieldTable(t));
        t = outer;
    }
    t
}

/// What the ingress should make of a message of the mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Delivered,
    Refused(&'static str),
}

/// A randomized mix through the ingress, from the write-only publisher: header frames
/// well under, just over and just under the ingress's bound and up to 16 bytes under
/// `frame_max`, up to 1,100 header values, nesting from 1 to 300 levels; and a few
/// nested 5,000 deep, written byte by byte (lapin's parser, recursive, overflowed its
/// thread's stack on them and aborted the process). Every message is delivered once or
/// counted as refused for its reason, nothing crashes, the node's connection stays up.
/// Seeded (`FRAMES_SEED` replays one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_random_mix_of_headers_is_delivered_or_refused_and_nothing_closes() {
    let stage = Stage::new().await;
    let frame_max = broker_frame_max(&stage.admin).await;
    let bound = frame_max - HEADROOM;
    let target = Inbox::at(&stage.admin, Some((TARGET, "#"))).await;
    let (node, conn) = stage.node().await;
    let ingress = stage.world.ingress();
    let seed: u64 = std::env::var("FRAMES_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("FRAMES_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let (_c, ch) = publisher_at(&stage.attacker).await;
    let mut verdicts: HashMap<String, Verdict> = HashMap::new();
    for i in 0..40 {
        let id = format!("mix-{i}");
        let (props, verdict) = match rng.random_range(0..4) {
            0 => {
                // Size: well under, just under or just over the bound (the broker's own
                // header adds a few dozen bytes: 200 bytes either side), or at frame_max.
                let (size, verdict) = match rng.random_range(0..4) {
                    0 => (rng.random_range(200..bound - 200), Verdict::Delivered),
                    1 => (bound - 200, Verdict::Delivered),
                    2 => (
                        rng.random_range(bound + 200..frame_max - 16),
                        Verdict::Refused("rejected_headers_too_large"),
                    ),
                    _ => (
                        frame_max - 16,
                        Verdict::Refused("rejected_headers_too_large"),
                    ),
                };
                (padded_to(&id, size), verdict)
            }
            1 => {
                let n = if rng.random_bool(0.5) {
                    rng.random_range(1..MAX_HEADER_VALUES - 10)
                } else {
                    rng.random_range(MAX_HEADER_VALUES + 1..MAX_HEADER_VALUES + 100)
                };
                let extra = (0..n)
                    .map(|k| (format!("h{k}"), AMQPValue::LongInt(k as i32)))
                    .collect();
                // x-delay is one of the values.
                let verdict = if n < MAX_HEADER_VALUES {
                    Verdict::Delivered
                } else {
                    Verdict::Refused("rejected_too_many_headers")
                };
                (delayed(&id, 500, extra), verdict)
            }
            _ => {
                let levels = match rng.random_range(0..3) {
                    0 => rng.random_range(2..=MAX_HEADER_DEPTH),
                    1 => rng.random_range(MAX_HEADER_DEPTH + 1..=64),
                    _ => rng.random_range(65..=300),
                };
                // The headers table is level 1, the nested one starts at level 2.
                let extra = vec![("deep".to_owned(), AMQPValue::FieldTable(nested(levels - 1)))];
                let verdict = if levels <= MAX_HEADER_DEPTH {
                    Verdict::Delivered
                } else {
                    Verdict::Refused("rejected_headers_too_deep")
                };
                (delayed(&id, 500, extra), verdict)
            }
        };
        publish(&ch, &ingress, "k", props, id.as_bytes()).await;
        verdicts.insert(id, verdict);
    }
    for i in 0..3 {
        let id = format!("abyss-{i}");
        raw_publish(&stage.attacker, &ingress, &id, &nested_bytes(5000)).await;
        verdicts.insert(id, Verdict::Refused("rejected_headers_too_deep"));
    }
    let delivered = verdicts
        .values()
        .filter(|v| **v == Verdict::Delivered)
        .count();
    let mut refused: HashMap<&str, u64> = HashMap::new();
    for v in verdicts.values() {
        if let Verdict::Refused(r) = v {
            *refused.entry(r).or_default() += 1;
        }
    }
    println!("{delivered} to deliver, refused: {refused:?}");
    wait_for(PATIENCE, "every message allowed delivered", || {
        target.len() >= delivered
    })
    .await;
    for (result, n) in &refused {
        wait_for_async(PATIENCE, "the refusals counted", || async {
            ingested(&node, result).await >= *n
        })
        .await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (id, n) in target.counts() {
        assert_eq!(n, 1, "{id} once");
        assert_eq!(verdicts.get(&id), Some(&Verdict::Delivered), "{id} allowed");
    }
    assert_eq!(target.len(), delivered);
    for (result, n) in &refused {
        assert_eq!(ingested(&node, result).await, *n, "{result}");
    }
    same_connection(&node, &conn).await;
    node.stop().await;
    stage.cleanup().await;
}

/// A row written straight into `delayed_messages` (as a role granted the table may)
/// whose properties fit `frame_max` alone, but not with the headers timeoutd adds when it
/// delivers it: held with the reason (`retry_at = 'infinity'`), not sent and not retried;
/// the rows beside it are delivered and the connection stays up. Before the fix the
/// broker closed the connection (frame too large) at every attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_does_not_fit_with_timeoutds_headers_is_held() {
    use timeoutd::wire::{Properties, Value};
    let stage = Stage::new().await;
    let frame_max = broker_frame_max(&stage.admin).await;
    let target = Inbox::at(&stage.admin, Some((TARGET, "#"))).await;
    let (node, conn) = stage.node().await;
    let mut p = Properties {
        message_id: Some("big".into()),
        headers: vec![("pad".into(), Value::Str(String::new()))],
        ..Properties::default()
    };
    let without = header_frame_size(&timeoutd::bus::lapin_properties(&p).expect("valid"));
    p.headers = vec![(
        "pad".into(),
        Value::Str("p".repeat(frame_max - 40 - without)),
    )];
    let alone = header_frame_size(&timeoutd::bus::lapin_properties(&p).expect("valid"));
    assert_eq!(alone, frame_max - 40, "fits alone");
    let t = format!("{}.delayed_messages", stage.world.schema);
    let big = serde_json::to_string(&p).expect("json");
    stage
        .world
        .exec(&format!(
            "INSERT INTO {t} (message_id, deliver_at, exchange, routing_key, properties, body) \
             VALUES ('big', now(), '{TARGET}', 'k', '{big}', 'x')"
        ))
        .await;
    for i in 0..10 {
        stage
            .world
            .exec(&format!(
                "INSERT INTO {t} (message_id, deliver_at, exchange, routing_key, properties, \
                 body) VALUES ('n-{i}', now(), '{TARGET}', 'k', \
                 '{{\"message_id\": \"n-{i}\"}}', 'x')"
            ))
            .await;
    }
    wait_for(PATIENCE, "the rows beside it delivered", || {
        target.len() >= 10
    })
    .await;
    let held = "message_id = 'big' AND retry_at = 'infinity' AND last_error LIKE '%frame_max%'";
    wait_for_async(PATIENCE, "the big row held", || async {
        crate::delayed::count(&stage.world, held).await == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        crate::delayed::count(&stage.world, "message_id = 'big' AND attempts = 1").await,
        1,
        "not retried"
    );
    for (id, n) in target.counts() {
        assert_eq!(n, 1, "{id} once");
        assert!(id.starts_with("n-"), "not the big one: {id}");
    }
    assert_eq!(target.len(), 10);
    same_connection(&node, &conn).await;
    node.stop().await;
    stage.cleanup().await;
}

/// Publish one message whose headers are `deep` (a field table, as bytes) beside
/// `x-delay`, with a confirm, speaking AMQP 0-9-1 byte by byte: lapin would build (and
/// serialize) such a table recursively.
async fn raw_publish(url: &str, exchange: &str, id: &str, deep: &[u8]) {
    let url = url::Url::parse(url).expect("url");
    let decode = percent_decode;
    let vhost = decode(url.path().trim_start_matches('/'));
    let vhost = if vhost.is_empty() {
        "/".to_owned()
    } else {
        vhost
    };
    let addr = format!(
        "{}:{}",
        url.host_str().expect("host"),
        url.port().unwrap_or(5672)
    );
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"AMQP\x00\x00\x09\x01").await.expect("write");
    expect_method(&mut s, (10, 10)).await;
    let mut m = method(10, 11);
    m.extend_from_slice(&0u32.to_be_bytes());
    short(&mut m, "PLAIN");
    long(
        &mut m,
        format!(
            "\0{}\0{}",
            decode(url.username()),
            decode(url.password().unwrap_or(""))
        )
        .as_bytes(),
    );
    short(&mut m, "en_US");
    write_frame(&mut s, 1, 0, &m).await;
    let tune = expect_method(&mut s, (10, 30)).await;
    let mut m = method(10, 31);
    m.extend_from_slice(&tune[4..10]);
    m.extend_from_slice(&0u16.to_be_bytes());
    write_frame(&mut s, 1, 0, &m).await;
    let mut m = method(10, 40);
    short(&mut m, &vhost);
    short(&mut m, "");
    m.push(0);
    write_frame(&mut s, 1, 0, &m).await;
    expect_method(&mut s, (10, 41)).await;
    let mut m = method(20, 10);
    short(&mut m, "");
    write_frame(&mut s, 1, 1, &m).await;
    expect_method(&mut s, (20, 11)).await;
    let mut m = method(85, 10);
    m.push(0);
    write_frame(&mut s, 1, 1, &m).await;
    expect_method(&mut s, (85, 11)).await;
    let mut m = method(60, 40);
    m.extend_from_slice(&0u16.to_be_bytes());
    short(&mut m, exchange);
    short(&mut m, "k");
    m.push(0);
    write_frame(&mut s, 1, 1, &m).await;
    let mut entries = Vec::new();
    short(&mut entries, "x-delay");
    entries.push(b'l');
    entries.extend_from_slice(&500i64.to_be_bytes());
    short(&mut entries, "deep");
    entries.push(b'F');
    entries.extend_from_slice(deep);
    let body = id.as_bytes();
    let mut h = Vec::new();
    h.extend_from_slice(&60u16.to_be_bytes());
    h.extend_from_slice(&0u16.to_be_bytes());
    h.extend_from_slice(&(body.len() as u64).to_be_bytes());
    // headers, delivery-mode, message-id
    h.extend_from_slice(&((1u16 << 13) | (1 << 12) | (1 << 7)).to_be_bytes());
    h.extend_from_slice(&(entries.len() as u32).to_be_bytes());
    h.extend_from_slice(&entries);
    h.push(2);
    short(&mut h, id);
    write_frame(&mut s, 2, 1, &h).await;
    write_frame(&mut s, 3, 1, body).await;
    expect_method(&mut s, (60, 80)).await;
    let mut m = method(10, 50);
    m.extend_from_slice(&200u16.to_be_bytes());
    short(&mut m, "OK");
    m.extend_from_slice(&[0, 0, 0, 0]);
    write_frame(&mut s, 1, 0, &m).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), expect_method(&mut s, (10, 51))).await;
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn method(class: u16, method: u16) -> Vec<u8> {
    let mut m = class.to_be_bytes().to_vec();
    m.extend_from_slice(&method.to_be_bytes());
    m
}

fn short(buf: &mut Vec<u8>, s: &str) {
    buf.push(s.len() as u8);
    buf.extend_from_slice(s.as_bytes());
}

fn long(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u32).to_be_bytes());
    buf.extend_from_slice(b);
}

async fn write_frame(s: &mut TcpStream, kind: u8, channel: u16, payload: &[u8]) {
    let mut f = vec![kind];
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(0xCE);
    s.write_all(&f).await.expect("write frame");
}

/// The next method frame's payload, which must be `(class, method)`.
async fn expect_method(s: &mut TcpStream, want: (u16, u16)) -> Vec<u8> {
    loop {
        let mut head = [0u8; 7];
        s.read_exact(&mut head).await.expect("frame");
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        let mut payload = vec![0u8; size + 1];
        s.read_exact(&mut payload).await.expect("payload");
        payload.pop();
        if head[0] != 1 {
            continue;
        }
        let got = (
            u16::from_be_bytes([payload[0], payload[1]]),
            u16::from_be_bytes([payload[2], payload[3]]),
        );
        assert_eq!(
            got,
            want,
            "AMQP method: {}",
            String::from_utf8_lossy(&payload)
        );
        return payload;
    }
}
