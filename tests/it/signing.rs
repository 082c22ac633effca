//! Signed messages (`amqp.signing_key`): every TimeOut, delayed message and outbox
//! message a daemon publishes carries `x-timeoutd-signature`, which the client crate's
//! `signature::verify` accepts with the message as it arrived, and refuses when the
//! message is sent on to another routing key or with another body; a publisher's own
//! signature header is removed. Without a key nothing is signed.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, LongString};
use timeoutd::client::Expectation;
use timeoutd::client::signature::{self, SIGNATURE_HEADER, SignatureError, Signed};

use crate::common::{Inbox, PATIENCE, Received, wait_active, wait_for};
use crate::delayed::{delayed_world, headers, publish, publisher};

const KEY: &str = "signing-key-of-the-test-0123456789";

/// What the signature covers, from a message as it arrived through `exchange`.
fn covered<'a>(r: &'a Received, exchange: &'a str, text: &'a Headers) -> Signed<'a> {
    let p = &r.properties;
    Signed {
        exchange,
        routing_key: &r.routing_key,
        message_id: p.message_id().as_ref().map(|s| s.as_str()),
        correlation_id: p.correlation_id().as_ref().map(|s| s.as_str()),
        kind: p.kind().as_ref().map(|s| s.as_str()),
        timestamp: *p.timestamp(),
        node: text.node.as_deref(),
        user_id: text.user_id.as_deref(),
        delayed_ms: text.delayed_ms,
        body: &r.raw,
    }
}

struct Headers {
    node: Option<String>,
    user_id: Option<String>,
    delayed_ms: Option<i64>,
    signature: Option<String>,
}

fn headers_of(r: &Received) -> Headers {
    let delayed_ms = r
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-timeoutd-delayed-ms").cloned())
        .and_then(|v| match v {
            AMQPValue::LongLongInt(n) => Some(n),
            AMQPValue::LongInt(n) => Some(i64::from(n)),
            _ => None,
        });
    Headers {
        node: r.header_str("x-timeoutd-node"),
        user_id: r.header_str("x-timeoutd-user-id"),
        delayed_ms,
        signature: r.header_str(SIGNATURE_HEADER),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_delayed_messages_are_signed_and_verify() {
    let (mut world, target) = delayed_world().await;
    world.overrides.extend([
        ("TIMEOUTD__AMQP__SIGNING_KEY".to_owned(), KEY.to_owned()),
        ("TIMEOUTD__AMQP__SIGNING_KEY_ID".to_owned(), "k7".to_owned()),
    ]);
    let timeouts = Inbox::new().await;
    let delayed = Inbox::on_exchange(&target, "orders.#").await;
    let node = world.start().await;
    wait_active(&node).await;
    world
        .expect(
            &Expectation::new("order-42", "PaymentReceived", &timeouts.queue)
                .payload(serde_json::json!({"order": 42})),
        )
        .await;
    let (_conn, ch) = publisher().await;
    let props = BasicProperties::default()
        .with_message_id("delayed-1".into())
        .with_headers(headers(vec![
            ("x-delay", AMQPValue::LongInt(200)),
            // A publisher's own signature is not what consumers receive.
            (
                SIGNATURE_HEADER,
                AMQPValue::LongString(LongString::from("v1:k7:forged")),
            ),
        ]));
    publish(
        &ch,
        &world.ingress(),
        "orders.paid",
        props,
        b"{\"paid\":42}",
    )
    .await;
    wait_for(PATIENCE, "a TimeOut", || timeouts.len() == 1).await;
    wait_for(PATIENCE, "a delayed message", || delayed.len() == 1).await;
    let keys: &[(&str, &[u8])] = &[("k6", b"the key before this one"), ("k7", KEY.as_bytes())];
    for (r, exchange) in [
        (&timeouts.all()[0], ""),
        (&delayed.all()[0], target.as_str()),
    ] {
        let h = headers_of(r);
        let sig = h.signature.clone().expect("signed");
        assert!(sig.starts_with("v1:k7:"), "{sig}");
        let m = covered(r, exchange, &h);
        assert_eq!(signature::verify(&sig, &m, keys), Ok(()), "{m:?}");
        let replayed = Signed {
            routing_key: "payments.refunds",
            ..m
        };
        assert_eq!(
            signature::verify(&sig, &replayed, keys),
            Err(SignatureError::Mismatch)
        );
        let body = [r.raw.as_slice(), b" "].concat();
        let changed = Signed { body: &body, ..m };
        assert_eq!(
            signature::verify(&sig, &changed, keys),
            Err(SignatureError::Mismatch)
        );
        let elsewhere = Signed {
            exchange: "amq.topic",
            ..m
        };
        assert!(signature::verify(&sig, &elsewhere, keys).is_err());
    }
    // Printed for the docs' Python and Node snippets (tests/recipes checks them).
    println!(
        "signed TimeOut: {:?}",
        headers_of(&timeouts.all()[0]).signature
    );
    node.stop().await;
    world.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_nothing_is_signed() {
    let (world, _) = delayed_world().await;
    let timeouts = Inbox::new().await;
    let node = world.start().await;
    wait_active(&node).await;
    world
        .expect(&Expectation::new("order-1", "Reply", &timeouts.queue))
        .await;
    wait_for(PATIENCE, "a TimeOut", || timeouts.len() == 1).await;
    assert_eq!(timeouts.all()[0].header_str(SIGNATURE_HEADER), None);
    node.stop().await;
    world.cleanup().await;
}
