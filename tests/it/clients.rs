//! What real clients send and do: kombu's `x-delay` as a double, header tables as they
//! come out, and an old exchange in the way of the ingress (moving off the plugin).

use std::time::{Duration, Instant};

use chrono::Utc;
use lapin::BasicProperties;
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{ExchangeKind, types::ShortString};

use crate::common::{Inbox, PATIENCE, Proc, amqp, wait_active, wait_for, wait_for_async};
use crate::delayed::{delayed_world, headers, publish, publisher};
use crate::http::get;

fn delayed_ms(p: &BasicProperties) -> i64 {
    match p
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-timeoutd-delayed-ms"))
    {
        Some(AMQPValue::LongLongInt(ms)) => *ms,
        other => panic!("no x-timeoutd-delayed-ms: {other:?}"),
    }
}

/// kombu (Celery) sends a whole delay as the double `2500.0`; other clients send
/// fractions. Each arrives once, after its whole milliseconds (the fraction dropped, as
/// the plugin does), never before. Headers come out sorted by key, nested tables too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_delay_as_a_double_or_float_is_delivered_after_its_whole_milliseconds() {
    let (world, target) = delayed_world().await;
    let inbox = Inbox::on_exchange(&target, "#").await;
    let node = world.start().await;
    wait_active(&node).await;
    let (_conn, ch) = publisher().await;
    let sent = [
        ("double", AMQPValue::Double(1500.0)),
        ("fraction", AMQPValue::Double(1500.9)),
        ("float", AMQPValue::Float(1500.0)),
    ];
    let started = Utc::now();
    for (id, delay) in &sent {
        let nested = headers(vec![
            ("z", AMQPValue::Boolean(true)),
            ("a", AMQPValue::Boolean(false)),
        ]);
        let h = headers(vec![
            ("x-delay", delay.clone()),
            ("zeta", AMQPValue::LongString(LongString::from("last"))),
            ("alpha", AMQPValue::FieldTable(nested)),
        ]);
        let props = BasicProperties::default()
            .with_message_id(ShortString::from(*id))
            .with_headers(h);
        publish(&ch, &world.ingress(), "client.test", props, b"x").await;
    }
    wait_for(PATIENCE, "three delayed messages", || inbox.len() >= 3).await;
    // A second copy would come at once after the first, if at all.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let counts = inbox.counts();
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "each once: {counts:?}");
    for got in inbox.all() {
        let id = got.message_id();
        assert!(
            delayed_ms(&got.properties) >= 1500,
            "{id}: held {} ms",
            delayed_ms(&got.properties)
        );
        assert!(
            got.at - started >= chrono::Duration::milliseconds(1500),
            "{id} arrived early: {:?} after the first publish",
            got.at - started
        );
        let h = got.properties.headers().as_ref().expect("headers");
        let keys: Vec<&str> = h.inner().keys().map(|k| k.as_str()).collect();
        // FieldTable is a BTreeMap: sorted is all this side can see. The point is what
        // timeoutd published, which is sorted too (see wire::value).
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
        assert!(!keys.contains(&"x-delay"), "{keys:?}");
    }
    node.stop().await;
    world.cleanup().await;
}

/// Migration step 2 done in the wrong order: the plugin's exchange (here: one of another
/// type under the ingress name) is still there. The ingress cannot be declared; /readyz
/// says so (the node stays active for TimeOuts), the cause is logged once with what to
/// do, and once the old exchange is gone the ingress consumes by itself and /readyz
/// turns green.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_exchange_in_the_way_of_the_ingress_keeps_readyz_red_until_it_is_gone() {
    let (world, target) = delayed_world().await;
    let inbox = Inbox::on_exchange(&target, "#").await;
    let conn = amqp().await;
    let ch = conn.create_channel().await.expect("channel");
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    ch.exchange_declare(
        world.ingress().as_str().into(),
        ExchangeKind::Direct,
        durable,
        FieldTable::default(),
    )
    .await
    .expect("the old exchange");
    let node = Proc::spawn(&world).await;
    let addr = node.http_addr;
    wait_for_async(PATIENCE, "/readyz names the ingress", || async {
        let (code, body) = get(addr, "/readyz").await;
        code == 503 && body.contains("exists with another type")
    })
    .await;
    let (_, body) = get(addr, "/readyz").await;
    assert!(body.contains(&world.ingress()), "{body}");
    assert!(body.contains("PRECONDITION_FAILED"), "{body}");
    // Retries go on (backoff from 100 ms) without a log line each.
    let since = Instant::now();
    wait_for_async(PATIENCE, "the node active all the same", || async {
        let (_, status) = get(addr, "/status").await;
        let v: serde_json::Value = serde_json::from_str(&status).expect("json");
        v["role"] == "active"
    })
    .await;
    while since.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logged = node
        .log
        .lock()
        .expect("lock")
        .iter()
        .filter(|l| l.contains("cannot consume the delay ingress"))
        .count();
    assert_eq!(logged, 1, "the cause logged once");
    assert!(node.logged("delete it"), "with what to do");
    ch.exchange_delete(
        world.ingress().as_str().into(),
        ExchangeDeleteOptions::default(),
    )
    .await
    .expect("delete the old exchange");
    wait_for_async(PATIENCE, "ready once it is gone", || async {
        get(addr, "/readyz").await.0 == 200
    })
    .await;
    let (_pconn, pch) = publisher().await;
    let props = BasicProperties::default()
        .with_message_id("after-the-fix".into())
        .with_headers(headers(vec![("x-delay", AMQPValue::LongInt(200))]));
    publish(&pch, &world.ingress(), "k", props, b"x").await;
    wait_for(PATIENCE, "delivered", || inbox.len() == 1).await;
    let _ = conn.close(200, "OK".into()).await;
    drop(node);
    world.cleanup().await;
}
