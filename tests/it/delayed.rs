//! Delayed messages (contract section 7) against the real broker and database: published
//! as a plugin user would, with `x-delay`, they arrive at the target after the delay,
//! never before, byte for byte; bad input is kept and held; cancels work three ways.

use std::collections::HashMap;
use std::time::Duration;

use chrono::Utc;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString};
use lapin::{BasicProperties, Channel};
use timeoutd::election::Role;

use crate::common::{Inbox, PATIENCE, World, wait_active, wait_for, wait_for_async};

/// A world whose delayed messages go to a target exchange of its own, or to any `t.*`.
pub async fn delayed_world() -> (World, String) {
    let mut world = World::new().await;
    let target = format!("t.delayed.{}", world.group);
    world.overrides.push((
        "TIMEOUTD__DELAY__TARGET_EXCHANGE".to_owned(),
        target.clone(),
    ));
    // The other exchanges the tests send to (t.other.<group>, t.missing.<group>).
    world.overrides.push((
        "TIMEOUTD__DELAY__ALLOWED_EXCHANGES".to_owned(),
        "t.*".to_owned(),
    ));
    world.migrate().await;
    (world, target)
}

/// A publisher with confirms, as a plugin user's would be.
pub async fn publisher() -> (lapin::Connection, Channel) {
    publisher_at(&crate::common::amqp_url()).await
}

/// As [`publisher`], logged in as (and in the vhost of) `url`.
pub async fn publisher_at(url: &str) -> (lapin::Connection, Channel) {
    let conn = crate::common::amqp_at(url).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    (conn, ch)
}

pub async fn publish(ch: &Channel, exchange: &str, key: &str, props: BasicProperties, body: &[u8]) {
    let confirm = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert!(confirm.is_ack(), "broker confirmed");
}

pub fn headers(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(k.into(), v);
    }
    t
}

fn header<'a>(p: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    p.headers().as_ref()?.inner().get(name)
}

/// The plugin's way: `x-delay` in milliseconds. The message arrives at the target after
/// the delay (never before), with its routing key, body bytes, properties and headers
/// (every AMQP type, the trace context too) as published; `x-delay` is gone, `x-timeoutd-delayed-ms` and
/// `x-timeoutd-node` are added, `user_id` travels as a header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_delay_arrives_after_the_delay_byte_for_byte() {
    let (world, target) = delayed_world().await;
    let inbox = Inbox::on_exchange(&target, "orders.#").await;
    let node = world.start().await;
    wait_active(&node).await;
    let (_conn, ch) = publisher().await;
    let custom = headers(vec![
        ("x-delay", AMQPValue::LongInt(1500)),
        ("tenant", AMQPValue::LongString(LongString::from("acme"))),
        // The trace context, as OpenTelemetry's AMQP propagators write it.
        (
            "traceparent",
            AMQPValue::LongString(LongString::from(
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )),
        ),
        (
            "tracestate",
            AMQPValue::LongString(LongString::from("vendor=opaque")),
        ),
        ("n", AMQPValue::LongLongInt(-7)),
        ("f", AMQPValue::Double(0.25)),
        ("flag", AMQPValue::Boolean(true)),
        (
            "dec",
            AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 314,
            }),
        ),
        (
            "bin",
            AMQPValue::ByteArray(ByteArray::from(vec![0u8, 255, 1])),
        ),
        (
            "list",
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::ShortInt(3),
                AMQPValue::Void,
            ])),
        ),
        (
            "nested",
            AMQPValue::FieldTable(headers(vec![("k", AMQPValue::Timestamp(1_700_000_000))])),
        ),
    ]);
    let props = BasicProperties::default()
        .with_message_id("order-42-retry".into())
        .with_correlation_id("order-42".into())
        .with_type("RetryPayment".into())
        .with_content_type("application/octet-stream".into())
        .with_content_encoding("identity".into())
        .with_delivery_mode(2)
        .with_priority(3)
        .with_reply_to("replies".into())
        .with_expiration("600000".into())
        .with_timestamp(1_700_000_123)
        .with_app_id("billing".into())
        .with_user_id("guest".into())
        .with_headers(custom.clone());
    let body: Vec<u8> = (0..=255u8).chain([0, 0, 10]).collect();
    let sent = Utc::now();
    publish(
        &ch,
        &world.ingress(),
        "orders.eu.retry",
        props.clone(),
        &body,
    )
    .await;
    wait_for(PATIENCE, "the delayed message", || inbox.len() == 1).await;
    let got = &inbox.all()[0];
    let held = (got.at - sent).num_milliseconds();
    assert!(held >= 1500, "arrived after {held} ms, before its delay");
    assert_eq!(got.raw, body, "body byte for byte");
    assert_eq!(got.routing_key, "orders.eu.retry");
    let p = &got.properties;
    assert_eq!(p.message_id(), props.message_id());
    assert_eq!(p.correlation_id(), props.correlation_id());
    assert_eq!(p.kind(), props.kind());
    assert_eq!(p.content_type(), props.content_type());
    assert_eq!(p.content_encoding(), props.content_encoding());
    assert_eq!(p.delivery_mode(), props.delivery_mode());
    assert_eq!(p.priority(), props.priority());
    assert_eq!(p.reply_to(), props.reply_to());
    assert_eq!(p.expiration(), props.expiration());
    assert_eq!(p.timestamp(), props.timestamp());
    assert_eq!(p.app_id(), props.app_id());
    assert_eq!(p.user_id(), &None, "user_id is not republished");
    for (k, v) in custom.inner() {
        if k.as_str() != "x-delay" {
            assert_eq!(header(p, k.as_str()), Some(v), "header {k}");
        }
    }
    assert_eq!(header(p, "x-delay"), None, "x-delay removed");
    assert_eq!(
        header(p, "x-timeoutd-user-id"),
        Some(&AMQPValue::LongString(LongString::from("guest")))
    );
    let Some(AMQPValue::LongLongInt(ms)) = header(p, "x-timeoutd-delayed-ms") else {
        panic!("x-timeoutd-delayed-ms missing: {p:?}");
    };
    assert!(*ms >= 1500, "held {ms} ms");
    assert_eq!(got.sender(), Some(node.node_id.to_string()));
    wait_for_async(PATIENCE, "row deleted", || async {
        count(&world, "true").await == 0
    })
    .await;
    node.stop().await;
    world.cleanup().await;
}

/// `x-timeoutd-deliver-at` (RFC 3339) sets the due time; `x-timeoutd-exchange` picks
/// another exchange; a message without `message_id` gets one; a message with no delay is
/// delivered at once: before one published after it and due a few seconds later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_at_exchange_override_and_ids() {
    let (world, target) = delayed_world().await;
    let other = format!("t.other.{}", world.group);
    let inbox = Inbox::on_exchange(&target, "#").await;
    inbox.bind_new_exchange(&other, "#").await;
    let node = world.start().await;
    wait_active(&node).await;
    let (_conn, ch) = publisher().await;
    publish(
        &ch,
        &world.ingress(),
        "k.now",
        BasicProperties::default(),
        b"now",
    )
    .await;
    // Even a loaded machine stores and sends the first message sooner than this.
    let at = Utc::now() + chrono::Duration::milliseconds(3000);
    let h = headers(vec![
        (
            "x-timeoutd-deliver-at",
            AMQPValue::LongString(LongString::from(at.to_rfc3339().as_str())),
        ),
        (
            "x-timeoutd-exchange",
            AMQPValue::LongString(LongString::from(other.as_str())),
        ),
    ]);
    let props = BasicProperties::default()
        .with_message_id("at-1".into())
        .with_headers(h);
    publish(&ch, &world.ingress(), "k.at", props, b"at").await;
    wait_for(PATIENCE, "both messages", || inbox.len() == 2).await;
    let got = inbox.all();
    let now = got.iter().find(|r| r.raw == b"now").expect("now");
    assert!(
        uuid::Uuid::parse_str(&now.message_id()).is_ok(),
        "a message without id got a uuid: {:?}",
        now.message_id()
    );
    let at_msg = got.iter().find(|r| r.raw == b"at").expect("at");
    assert!(
        at_msg.at >= at,
        "deliver-at message early: {} < {at}",
        at_msg.at
    );
    assert_eq!(at_msg.message_id(), "at-1");
    assert!(now.at < at_msg.at, "no delay: delivered at once");
    node.stop().await;
    world.cleanup().await;
}

/// Bad input is kept, never dropped: an unparsable `x-delay` or deliver-at, a non-string
/// exchange header and a body over `delay.max_body` are stored, held (never delivered)
/// with their reason, and listed by `pending --failing`; a good message in the same
/// stream is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_headers_and_oversized_bodies_are_kept_as_failing() {
    let (mut world, target) = delayed_world().await;
    world
        .overrides
        .push(("TIMEOUTD__DELAY__MAX_BODY".to_owned(), "1KiB".to_owned()));
    let inbox = Inbox::on_exchange(&target, "#").await;
    let node = world.start().await;
    wait_active(&node).await;
    let (_conn, ch) = publisher().await;
    let bad = [
        (
            "bad-delay",
            vec![("x-delay", AMQPValue::LongString(LongString::from("soon")))],
            10,
        ),
        ("bad-type", vec![("x-delay", AMQPValue::Boolean(true))], 10),
        (
            "bad-at",
            vec![(
                "x-timeoutd-deliver-at",
                AMQPValue::LongString(LongString::from("tomorrow")),
            )],
            10,
        ),
        (
            "bad-exchange",
            vec![("x-timeoutd-exchange", AMQPValue::LongInt(5))],
            10,
        ),
        ("too-big", vec![], 4096),
    ];
    for (id, h, size) in &bad {
        let props = BasicProperties::default()
            .with_message_id((*id).into())
            .with_headers(headers(h.clone()));
        publish(&ch, &world.ingress(), "k", props, &vec![b'x'; *size]).await;
    }
    let good = BasicProperties::default().with_message_id("good".into());
    publish(&ch, &world.ingress(), "k", good, b"fine").await;
    wait_for(PATIENCE, "the good message", || inbox.len() == 1).await;
    wait_for_async(PATIENCE, "bad ones stored", || async {
        count(&world, "attempts > 0").await == bad.len() as i64
    })
    .await;
    let out = crate::cli::timeoutd(&world, &["pending", "--failing", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rows = v["delayed"]["rows"].as_array().expect("rows").clone();
    assert_eq!(rows.len(), bad.len(), "{v}");
    for (id, ..) in &bad {
        let row = rows
            .iter()
            .find(|r| r["message_id"] == *id)
            .unwrap_or_else(|| panic!("{id} listed: {v}"));
        assert_eq!(row["held"], true, "{row}");
        assert!(
            row["last_error"].as_str().is_some_and(|e| !e.is_empty()),
            "{row}"
        );
    }
    // Only the one over delay.max_body lost its body, and says so: the SQL API refuses
    // to release it.
    assert_eq!(count(&world, "body_dropped").await, 1);
    assert_eq!(
        count(&world, "body_dropped AND message_id = 'too-big'").await,
        1
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(inbox.len(), 1, "held messages are never delivered");
    node.stop().await;
    world.cleanup().await;
}

/// Cancel by SQL, by the CLI and by a cancel message: each removes its pending message,
/// which is then never delivered; the one not cancelled is. The cancelled ones are due
/// long after the test, so that however slowly the cancels go they meet them pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_by_sql_cli_and_message() {
    let (world, target) = delayed_world().await;
    let inbox = Inbox::on_exchange(&target, "#").await;
    let node = world.start().await;
    wait_active(&node).await;
    let (_conn, ch) = publisher().await;
    let cancelled = "message_id IN ('by-sql', 'by-cli', 'by-message')";
    for (id, delay) in [
        ("by-sql", 600_000),
        ("by-cli", 600_000),
        ("by-message", 600_000),
        ("kept", 2500),
    ] {
        let props = BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(headers(vec![("x-delay", AMQPValue::LongInt(delay))]));
        publish(&ch, &world.ingress(), "k", props, id.as_bytes()).await;
    }
    wait_for_async(PATIENCE, "the three to cancel stored", || async {
        count(&world, cancelled).await == 3
    })
    .await;
    let sql = format!(
        "DELETE FROM {}.delayed_messages WHERE message_id = 'by-sql'",
        world.schema
    );
    let deleted = sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&world.pool)
        .await
        .expect("delete")
        .rows_affected();
    assert_eq!(deleted, 1);
    let out = crate::cli::timeoutd(&world, &["cancel", "--message-id", "by-cli"], &[]);
    assert!(out.status.success(), "{out:?}");
    let again = crate::cli::timeoutd(&world, &["cancel", "--message-id", "by-cli"], &[]);
    assert_eq!(
        again.status.code(),
        Some(4),
        "not pending any more: {again:?}"
    );
    let cancel = BasicProperties::default().with_headers(headers(vec![(
        "x-timeoutd-cancel",
        AMQPValue::LongString(LongString::from("by-message")),
    )]));
    publish(&ch, &world.ingress(), "k", cancel, b"").await;
    wait_for_async(PATIENCE, "the cancelled ones gone", || async {
        count(&world, cancelled).await == 0
    })
    .await;
    wait_for(PATIENCE, "the kept message", || inbox.len() == 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = inbox.all();
    assert_eq!(got.len(), 1, "cancelled ones never delivered");
    assert_eq!(got[0].raw, b"kept");
    node.stop().await;
    world.cleanup().await;
}

/// Owners whose stored messages the usage ledger (migration 0007) counts wrongly.
pub async fn usage_drift(world: &World) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM (SELECT owner, sum(messages) AS n FROM {s}.delayed_usage \
         GROUP BY owner) AS u FULL JOIN (SELECT owner, count(*) AS n \
         FROM {s}.delayed_messages GROUP BY owner) AS m USING (owner) \
         WHERE coalesce(u.n, 0) <> coalesce(m.n, 0)",
        s = world.schema
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(&world.pool)
        .await
        .expect("usage")
}

pub async fn count(world: &World, filter: &str) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM {}.delayed_messages WHERE {filter}",
        world.schema
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(&world.pool)
        .await
        .expect("count")
}

/// A crash between the commit and the ack redelivers a message that is already stored:
/// it is stored once and delivered once. The "crash" is staged: the message is stored
/// through the daemon's own insert first, then published as the redelivery would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_message_is_stored_and_delivered_once() {
    use timeoutd::store::Quota;
    use timeoutd::wire::delayed::ingest;
    use timeoutd::wire::{Message, Properties, Value};
    let (world, target) = delayed_world().await;
    let inbox = Inbox::on_exchange(&target, "#").await;
    let store = timeoutd::store::Store::connect(&world.settings().postgres).expect("store");
    let first = Message {
        exchange: world.ingress(),
        routing_key: "k".into(),
        properties: Properties {
            message_id: Some("once".into()),
            // Still pending when the redelivery arrives: "stored once" is a promise
            // while pending.
            headers: vec![("x-delay".into(), Value::I32(5000))],
            ..Properties::default()
        },
        body: b"once".to_vec(),
    };
    let node = world.start().await;
    wait_active(&node).await;
    // Stored only once the node runs: the redelivery follows it by one publish, well
    // inside the delay, however slowly the node came up.
    let rules = timeoutd::wire::delayed::Rules::of(&world.settings()).expect("rules");
    let stored = store
        .ingest(
            &[ingest(first, &rules, Utc::now())],
            std::time::Duration::from_secs(60),
            Quota::NONE,
        )
        .await
        .expect("stored before the crash");
    assert_eq!(stored.stored, 1);
    let (_conn, ch) = publisher().await;
    let again = BasicProperties::default()
        .with_message_id("once".into())
        .with_headers(headers(vec![("x-delay", AMQPValue::LongInt(5000))]));
    publish(&ch, &world.ingress(), "k", again, b"once").await;
    wait_for(PATIENCE, "the message", || inbox.len() == 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(inbox.len(), 1, "delivered once");
    assert_eq!(count(&world, "true").await, 0);
    store.close().await;
    node.stop().await;
    world.cleanup().await;
}

/// Every delayed message is judged alone at delivery too: one addressed to an exchange
/// that does not exist and one that no queue takes (returned) stay in the table, failing
/// with their own reason and retried; the good one beside them is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeliverable_delayed_messages_stay_failing_and_the_rest_arrive() {
    let (world, target) = delayed_world().await;
    let inbox = Inbox::on_exchange(&target, "good.#").await;
    let node = world.start().await;
    wait_active(&node).await;
    let (_conn, ch) = publisher().await;
    let missing = format!("t.missing.{}", world.group);
    let to = |exchange: &str| {
        headers(vec![(
            "x-timeoutd-exchange",
            AMQPValue::LongString(LongString::from(exchange)),
        )])
    };
    let cases = [
        ("no-exchange", "good.x", Some(to(&missing))),
        ("unroutable", "nobody.listens", None),
        ("good", "good.x", None),
    ];
    for (id, key, h) in cases {
        let mut props = BasicProperties::default().with_message_id(id.into());
        if let Some(h) = h {
            props = props.with_headers(h);
        }
        publish(&ch, &world.ingress(), key, props, id.as_bytes()).await;
    }
    wait_for(PATIENCE, "the good one", || inbox.len() == 1).await;
    wait_for_async(PATIENCE, "two failing", || async {
        count(&world, "attempts > 0 AND last_error IS NOT NULL").await == 2
    })
    .await;
    // The good one's row may still be there: it is delivered before its delete commits.
    let sql = format!(
        "SELECT message_id, last_error FROM {}.delayed_messages WHERE message_id <> 'good' \
         ORDER BY message_id",
        world.schema
    );
    let rows: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .fetch_all(&world.pool)
        .await
        .expect("rows");
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0].0, "no-exchange");
    assert!(rows[0].1.contains("does not exist"), "{rows:?}");
    assert_eq!(rows[1].0, "unroutable");
    assert!(rows[1].1.contains("unroutable"), "{rows:?}");
    assert_eq!(inbox.all()[0].raw, b"good");
    node.stop().await;
    world.cleanup().await;
}

/// Cancel messages are exact with several consuming nodes: three nodes consume the
/// ingress while four publishers send, with confirms, 600 messages delayed 3–5 s, and a
/// cancel message right after the confirm of about half of them (at once or a few ms
/// later, so a message and its cancel are often taken by two nodes at the same moment),
/// and for some ids the cancel *before* the message. Judged alone, from the outside: a
/// message cancelled after its confirm never arrives, whichever node stored what first;
/// one sent after its cancel never arrives either; every other one arrives exactly once,
/// never early; the table ends empty and remembers each cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_messages_are_exact_with_three_consuming_nodes() {
    let (world, target) = delayed_world().await;
    let inbox = Inbox::on_exchange(&target, "#").await;
    let nodes = [
        world.start().await,
        world.start().await,
        world.start().await,
    ];
    wait_for(PATIENCE, "an active node", || {
        nodes.iter().any(|n| *n.role.borrow() == Role::Active)
    })
    .await;
    let mut shares = Vec::new();
    for p in 0..4u64 {
        shares.push(tokio::spawn(send_and_cancel(
            world.ingress(),
            0xca9c + p,
            p * 150,
            150,
        )));
    }
    let mut fates = HashMap::new();
    for s in shares {
        fates.extend(s.await.expect("publisher"));
    }
    let arriving = fates.values().filter(|f| f.cancel == Cancel::No).count();
    wait_for(PATIENCE * 2, "every message not cancelled", || {
        inbox.len() >= arriving
    })
    .await;
    // A cancelled message would be due by now: give it a moment to show up.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let counts = inbox.counts();
    for (id, fate) in &fates {
        let n = counts.get(id).copied().unwrap_or(0);
        let want = usize::from(fate.cancel == Cancel::No);
        assert_eq!(n, want, "{id} ({fate:?}) arrived {n} times");
    }
    for r in inbox.all() {
        let fate = &fates[&r.message_id()];
        assert!(
            r.at >= fate.confirmed + fate.delay,
            "{} early",
            r.message_id()
        );
    }
    assert_eq!(count(&world, "true").await, 0, "nothing left pending");
    // Three nodes stored, cancelled, folded and fired concurrently: the ledger still adds up.
    assert_eq!(
        usage_drift(&world).await,
        0,
        "usage ledger agrees with the table"
    );
    let remembered: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.delayed_cancels WHERE expires_at > now()",
        world.schema
    )))
    .fetch_one(&world.pool)
    .await
    .expect("cancels");
    let cancels = fates.values().filter(|f| f.cancel != Cancel::No).count();
    assert_eq!(remembered as usize, cancels, "every cancel remembered");
    println!(
        "cancel exactness: {} messages, {cancels} cancelled ({} before their message), \
         {arriving} arrived once each",
        fates.len(),
        fates
            .values()
            .filter(|f| f.cancel == Cancel::Before)
            .count()
    );
    for node in nodes {
        node.stop().await;
    }
    world.cleanup().await;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cancel {
    No,
    /// Right after the message's confirm (a few ms later at most).
    After,
    /// Before the message was published.
    Before,
}

#[derive(Debug, Clone)]
struct Fate {
    cancel: Cancel,
    confirmed: chrono::DateTime<Utc>,
    delay: chrono::Duration,
}

async fn send_and_cancel(ingress: String, seed: u64, from: u64, n: u64) -> HashMap<String, Fate> {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let (conn, ch) = publisher().await;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut fates = HashMap::new();
    for i in from..from + n {
        let id = format!("c-{i}");
        let cancel = match rng.random_range(0..20) {
            0..10 => Cancel::No,
            10..18 => Cancel::After,
            _ => Cancel::Before,
        };
        let delay_ms = rng.random_range(3000..5000);
        let cancel_props = || {
            BasicProperties::default().with_headers(headers(vec![(
                "x-timeoutd-cancel",
                AMQPValue::LongString(LongString::from(id.as_str())),
            )]))
        };
        if cancel == Cancel::Before {
            publish(&ch, &ingress, "k", cancel_props(), b"").await;
        }
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_headers(headers(vec![("x-delay", AMQPValue::LongInt(delay_ms))]));
        let sent = Utc::now();
        publish(&ch, &ingress, "k", props, id.as_bytes()).await;
        if cancel == Cancel::After {
            if rng.random_bool(0.5) {
                tokio::time::sleep(Duration::from_millis(rng.random_range(1..10))).await;
            }
            publish(&ch, &ingress, "k", cancel_props(), b"").await;
        }
        let fate = Fate {
            cancel,
            confirmed: sent,
            delay: chrono::Duration::milliseconds(delay_ms.into()),
        };
        fates.insert(id, fate);
    }
    let _ = conn.close(200, "OK".into()).await;
    fates
}

/// One kind's table cannot be read (a migration holds it: every statement on it waits)
/// for longer than `member_ttl`: the other kind's messages are delivered on time all the
/// while and the node keeps its role — probes run as tasks, and a statement under way
/// does not withdraw a node whose other statements succeed. (Before: the scan loop
/// awaited each blocked probe until its lock timeout, about a second every tick, and
/// messages came up to that late.) Forty messages, one every 150 ms over six seconds:
/// the fault made most of them late, while a stall of a loaded machine (measured under
/// `stress`: up to 0.8 s, with or without the lock, in the broker or the daemon) holds
/// those due during it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_expectations_table_holds_up_neither_delayed_messages_nor_the_role() {
    let (world, target) = delayed_world().await;
    let inbox = Inbox::on_exchange(&target, "locked.#").await;
    let node = world.start().await;
    wait_active(&node).await;
    let mut role = node.role.clone();
    let left_active = tokio::spawn(async move {
        while role.changed().await.is_ok() {
            if *role.borrow_and_update() != Role::Active {
                return;
            }
        }
    });
    let mut lock = world.pool.begin().await.expect("begin");
    let table = format!("{}.expected_messages", world.schema);
    // The schema is the test's own, made of hex digits.
    let statement = format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE");
    sqlx::query(sqlx::AssertSqlSafe(statement))
        .execute(&mut *lock)
        .await
        .expect("lock");
    let locked_at = std::time::Instant::now();
    const N: i32 = 40;
    let (_conn, ch) = publisher().await;
    let mut due = HashMap::new();
    for i in 0..N {
        let delay = 300 + 150 * i;
        let id = format!("locked-{i}");
        let props = BasicProperties::default()
            .with_message_id(id.clone().into())
            .with_delivery_mode(2)
            .with_headers(headers(vec![("x-delay", AMQPValue::LongInt(delay))]));
        let at = Utc::now() + chrono::Duration::milliseconds(delay.into());
        publish(&ch, &world.ingress(), &format!("locked.{i}"), props, b"x").await;
        due.insert(id, at);
    }
    wait_for(
        PATIENCE,
        "every delayed message while the other table is locked",
        || inbox.len() == N as usize,
    )
    .await;
    // Hold the lock past member_ttl (3 s) + a tick, when the node would have withdrawn.
    let hold = Duration::from_millis(4500);
    tokio::time::sleep(hold.saturating_sub(locked_at.elapsed())).await;
    assert!(
        !left_active.is_finished() && *node.role.borrow() == Role::Active,
        "the node left the active role while one table was locked"
    );
    left_active.abort();
    lock.rollback().await.expect("unlock");
    let mut late: Vec<i64> = inbox
        .all()
        .iter()
        .map(|got| (got.at - due[&got.message_id()]).num_milliseconds())
        .collect();
    late.sort_unstable();
    // Blocked behind the locked table, every tick would cost about a second (the lock
    // timeout): most messages late by hundreds of ms. On time, most are late by a few
    // ms; one stall of a loaded machine holds those due during it: judged by the median
    // and the share (a stall may hold a quarter of them), not by the latest.
    let under = |ms: i64| late.iter().filter(|l| **l < ms).count();
    println!("lateness (ms) while the other table was locked: {late:?}");
    assert!(
        late[0] >= 0 && late[late.len() / 2] < 100 && under(500) * 4 >= late.len() * 3,
        "lateness (ms) while the other table was locked: {late:?}"
    );
    node.stop().await;
    world.cleanup().await;
}

/// The ingress gathers a batch across awaits (it lingers for more messages), and the
/// ingress task's `select!` drops that future whenever a stored batch finishes first:
/// what was already taken must come back in the next batch, never be lost (a later
/// `multiple` ack would then acknowledge it unstored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingress_batch_dropped_while_it_gathers_loses_no_message() {
    use timeoutd::bus::{Bus, IngressSpec};
    const N: usize = 300;
    let world = World::new().await;
    let settings = world.settings();
    let (bus, _announcements) = Bus::connect(&settings.amqp, &world.group, "gather-test")
        .await
        .expect("connect");
    let spec = IngressSpec {
        name: world.ingress(),
        target_exchange: settings.delay.target_exchange.clone(),
        prefetch: 1000,
    };
    let mut ingress = bus.ingress(&spec).await.expect("ingress");
    let exchange = world.ingress();
    let publishing = tokio::spawn(async move {
        let (_conn, ch) = publisher().await;
        for i in 0..N {
            let props = BasicProperties::default().with_message_id(format!("m-{i}").into());
            publish(&ch, &exchange, "k", props, b"x").await;
        }
    });
    let mut seen: HashMap<String, usize> = HashMap::new();
    let (mut batches, mut dropped) = (0, 0);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while seen.values().sum::<usize>() < N && tokio::time::Instant::now() < deadline {
        tokio::select! {
            batch = ingress.next_batch(64, Duration::from_millis(50)) => {
                batches += 1;
                for a in batch.expect("batch") {
                    let message = a.message.expect("within the bounds");
                    let id = message.properties.message_id.unwrap_or_default();
                    *seen.entry(id).or_default() += 1;
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(3)) => dropped += 1,
        }
    }
    publishing.await.expect("publisher");
    println!("{N} messages in {batches} batches; next_batch dropped {dropped} times");
    assert!(
        dropped > batches,
        "the test did not interrupt gathering batches"
    );
    assert_eq!(seen.len(), N, "every message taken");
    assert!(seen.values().all(|n| *n == 1), "each once");
    world.cleanup().await;
}

/// A database that cannot take anything for a while (here: the table locked past the
/// daemon's lock_timeout, as when commits wait for a synchronous standby after a
/// restart; or PgBouncer's cached login failure) is the database being away, not a
/// refusal of the message: the messages wait in the queue and arrive afterwards as
/// published, none stored held with its properties lost, none dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_delayed_messages_table_holds_the_messages_back_and_loses_none() {
    let (world, target) = delayed_world().await;
    let inbox = Inbox::on_exchange(&target, "waits.#").await;
    let node = world.start().await;
    wait_active(&node).await;
    let mut lock = world.pool.begin().await.expect("begin");
    // The schema is the test's own, made of hex digits.
    let statement = format!(
        "LOCK TABLE {}.delayed_messages IN ACCESS EXCLUSIVE MODE",
        world.schema
    );
    sqlx::query(sqlx::AssertSqlSafe(statement))
        .execute(&mut *lock)
        .await
        .expect("lock");
    const N: usize = 5;
    let (_conn, ch) = publisher().await;
    for i in 0..N {
        let props = BasicProperties::default()
            .with_message_id(format!("waits-{i}").into())
            .with_delivery_mode(2)
            .with_headers(headers(vec![("x-delay", AMQPValue::LongInt(200))]));
        publish(&ch, &world.ingress(), &format!("waits.{i}"), props, b"x").await;
    }
    // Past the lock timeout (at most 1 s) of the batch, of each message alone and of a
    // held row's insert.
    tokio::time::sleep(Duration::from_secs(4)).await;
    lock.rollback().await.expect("unlock");
    wait_for(PATIENCE, "every delayed message", || inbox.len() >= N).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut ids: Vec<String> = inbox.all().iter().map(|g| g.message_id()).collect();
    ids.sort();
    let sent: Vec<String> = (0..N).map(|i| format!("waits-{i}")).collect();
    assert_eq!(ids, sent, "each message once, its message_id as published");
    assert_eq!(count(&world, "true").await, 0, "nothing left, nothing held");
    node.stop().await;
    world.cleanup().await;
}
