//! Junk on the bus and odd rows: each gets a clear log line, the daemon keeps working.

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use timeoutd::client::Expectation;

use crate::common::{Inbox, Observer, PATIENCE, Proc, World, amqp, wait_for, wait_for_async};

/// Publish raw bodies on the group's announcement routing key, as the daemons' own
/// broker user (the test's connection logs in as it): junk from a member, judged past
/// the proof of membership.
pub async fn publish_junk(group: &str, junk: &[(Option<&str>, Vec<u8>)]) {
    let conn = amqp().await;
    let ch = conn.create_channel().await.expect("channel");
    let user = url::Url::parse(&crate::common::amqp_url())
        .expect("url")
        .username()
        .to_owned();
    for (kind, body) in junk {
        let mut props = BasicProperties::default().with_user_id(user.as_str().into());
        if let Some(k) = kind {
            props = props.with_type((*k).into());
        }
        ch.basic_publish(
            "timeoutd.announcements".into(),
            group.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .expect("publish")
        .await
        .expect("sent");
    }
    conn.close(200, "done".into()).await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_announcements_are_logged_and_dropped() {
    let world = World::new().await;
    world.migrate().await;
    let observer = Observer::new(&world.group).await;
    let node = Proc::spawn(&world).await;
    wait_for(PATIENCE, "active", || {
        observer.all().iter().any(|s| s.a.active)
    })
    .await;
    let other_group = format!(
        r#"{{"node_id":"00000000-0000-4000-8000-000000000000","group":"not-{}","sent_at":"2026-01-01T00:00:00Z"}}"#,
        world.group
    );
    let junk: Vec<(Option<&str>, Vec<u8>)> = vec![
        (None, b"{not json".to_vec()),
        (
            None,
            br#"{"node_id": 42, "group": "g", "sent_at": true}"#.to_vec(),
        ),
        (None, br#"{"group": "g"}"#.to_vec()),
        (None, vec![b'x'; 1 << 20]),
        (Some("OrderPlaced"), br#"{"order": 1}"#.to_vec()),
        (None, other_group.into_bytes()),
    ];
    publish_junk(&world.group, &junk).await;
    for reason in ["malformed", "too_large", "foreign_type", "other_group"] {
        wait_for(PATIENCE, reason, || {
            node.log.lock().expect("log").iter().any(|l| {
                l.contains("dropped announcement")
                    && l.contains(&format!("\"reason\":\"{reason}\""))
            })
        })
        .await;
    }
    // Still the only member, still active, still firing.
    let inbox = Inbox::new().await;
    let e = Expectation::new("after-junk", "Reply", &inbox.queue);
    world.expect(&e).await;
    wait_for(PATIENCE, "a TimeOut after the junk", || inbox.len() == 1).await;
    drop(node);
    world.cleanup().await;
}

/// Rows the process manager should not have written, but might: each is handled, none
/// stops the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_rows_fire_or_stay_visible_as_failing() {
    let world = World::new().await;
    world.migrate().await;
    let exchange = format!("x-{}", world.group);
    let inbox = Inbox::on_exchange(&exchange, "#").await;
    let long = "k".repeat(300);
    let to_inbox = |p: &str| Expectation::new(p, "Reply", "pm.timeouts").exchange(&exchange);
    let fire = [
        // Empty routing key still matches a '#' binding.
        Expectation::new("empty-key", "Reply", "").exchange(&exchange),
        to_inbox("payload-number").payload(serde_json::json!(42)),
        to_inbox("payload-string").payload(serde_json::json!("text")),
        to_inbox("payload-array").payload(serde_json::json!([1, "two", null])),
        to_inbox("payload-null").payload(serde_json::Value::Null),
        to_inbox("ancient").due_at("1970-01-01T00:00:00Z".parse().expect("date")),
    ];
    // Default exchange, no queue named "": returned as unroutable.
    let unroutable = Expectation::new("empty-key-default", "Reply", "");
    let future = to_inbox("far-future").due_at("9999-01-01T00:00:00Z".parse().expect("date"));
    for e in fire.iter().chain([&unroutable, &future]) {
        world.expect(e).await;
    }
    // Names longer than AMQP allows, which expect() refuses (54000), written to the
    // table directly.
    let p300 = "p".repeat(300);
    for (process, key) in [("long-key", long.as_str()), (p300.as_str(), "pm.timeouts")] {
        let sql = format!(
            "INSERT INTO {}.expected_messages (process_id, message_type, timeout_at, \
             exchange, routing_key) VALUES ($1, 'Reply', now(), $2, $3)",
            world.schema
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(process)
            .bind(&exchange)
            .bind(key)
            .execute(&world.pool)
            .await
            .expect("insert");
    }
    let stay_failing = 3;
    infinite_deadlines(&world, &exchange).await;
    let node = world.start().await;
    wait_for(PATIENCE, "the good rows", || inbox.len() == fire.len() + 1).await;
    let bodies: Vec<serde_json::Value> = inbox.all().into_iter().map(|r| r.body).collect();
    let payload_of = |p: &str| {
        bodies
            .iter()
            .find(|b| b["process_id"] == p)
            .map(|b| b["payload"].clone())
            .expect(p)
    };
    assert_eq!(payload_of("payload-number"), serde_json::json!(42));
    assert_eq!(
        payload_of("payload-array"),
        serde_json::json!([1, "two", null])
    );
    assert!(bodies.iter().any(|b| b["process_id"] == "minus-infinity"));
    wait_for_async(PATIENCE, "failures recorded", || async {
        world.count("attempts > 0").await == stay_failing
    })
    .await;
    assert_eq!(world.count("last_error LIKE '%255 bytes%'").await, 2);
    assert_eq!(
        world
            .count("process_id IN ('far-future', 'plus-infinity')")
            .await,
        2
    );
    assert_eq!(*node.role.borrow(), timeoutd::election::Role::Active);
    node.stop().await;
    world.cleanup().await;
}

/// `'infinity'` never comes due; `'-infinity'` is due and must still decode and fire.
async fn infinite_deadlines(world: &World, exchange: &str) {
    let sql = format!(
        "INSERT INTO {}.expected_messages (process_id, message_type, timeout_at, exchange, \
         routing_key) VALUES ('plus-infinity', 'Reply', 'infinity', $1, 'k'), \
         ('minus-infinity', 'Reply', '-infinity', $1, 'k')",
        world.schema
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(exchange)
        .execute(&world.pool)
        .await
        .expect("insert");
}
