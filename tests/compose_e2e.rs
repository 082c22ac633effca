//! The compose deployment, for real: `.ci/compose-test` brings up the stack of
//! `docker-compose.yml` (CI stand-in images, ports moved by `.ci/compose.ci.yml`:
//! RabbitMQ 4.3 on 127.0.0.1:35672, Postgres 18 on :35432, the replicas' HTTP on
//! :39464-39466) and runs these one at a time. Each scenario puts a steady load of
//! expectations on the running stack (hundreds due per second, routed to a durable queue
//! of its own), injects its fault with `docker`, and audits from the outside — what a
//! consumer received and what the table holds: lost, early, duplicates (with their
//! cause), each row's lateness (its first TimeOut after its deadline: p99 and the
//! latest), and the longest gap in the TimeOuts arriving while rows were due. A row is
//! judged alone: other rows flowing does not excuse one that waited for the fault. One
//! summary line per scenario. The load, the consumer and the audit are the shared
//! harness of `tests/outside` (the topology scenarios, `topology_e2e.rs`, use it too).
//!
//! Ignored by a plain `cargo nextest run` (they need Docker and the stack);
//! `.ci/compose-test` runs them with `--run-ignored only`.

mod outside;

use std::collections::HashMap;
use std::time::Duration;

use chrono::Utc;
use lapin::Connection;
use lapin::types::{AMQPValue, FieldTable};
use outside::{Consumer, Stack, compose, container, docker, network, scenario, wait_until};
use uuid::Uuid;

/// The stack of `docker-compose.yml` with the ports of `.ci/compose.ci.yml`.
static STACK: Stack = Stack {
    label: "compose",
    amqp: &["amqp://guest:guest@127.0.0.1:35672/%2f"],
    pg: &["postgres://postgres@127.0.0.1:35432/postgres"],
    schema: "timeoutd",
    replicas: &REPLICAS,
    delay_exchange: None,
    quorum_queues: false,
    infra_settled: || true,
};
/// The replicas and their published HTTP ports (`.ci/compose.ci.yml`).
const REPLICAS: [(&str, u16); 3] = [
    ("timeoutd-1", 39464),
    ("timeoutd-2", 39465),
    ("timeoutd-3", 39466),
];

/// member_ttl 3 s + tick 250 ms + settling, a probe interval (1 s) for the rows a
/// departed node held until the successor ended its sessions, and scheduling slack on a
/// 2-core machine shared with the stack.
const TAKEOVER: Duration = Duration::from_millis(6000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn up_three_healthy_one_active_and_the_demo_fires_each_expectation_once() {
    let (_, active) = STACK.settled().await;
    println!("compose up: three healthy replicas, one active ({active})");
    // The demo producer registers one expectation every 3 s, due 5 s later. Only what
    // this test sees counts: other scenarios' faults may legitimately duplicate some.
    let since = Utc::now().to_rfc3339();
    wait_until(
        Duration::from_secs(60),
        "the demo consumer prints TimeOuts",
        || async { demo_counts(&since).len() >= 4 },
    )
    .await;
    let counts = demo_counts(&since);
    assert!(
        counts.values().all(|n| *n == 1),
        "one TimeOut per expectation: {counts:?}"
    );
    println!(
        "compose demo: {} expectations, each TimeOut exactly once",
        counts.len()
    );
}

/// TimeOuts the demo consumer printed since `since`, by process id.
fn demo_counts(since: &str) -> HashMap<String, usize> {
    let log = compose(&["logs", "--no-log-prefix", "--since", since, "demo-consumer"]);
    let mut counts = HashMap::new();
    for line in log.lines() {
        if let Some(rest) = line.split("correlation_id=Some(\"").nth(1)
            && let Some(process) = rest.split('"').next()
        {
            *counts.entry(process.to_owned()).or_insert(0) += 1;
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn stop_of_the_active_replica() {
    let cause = "none expected: a stopped replica commits its batch before leaving";
    scenario(
        &STACK,
        "stop",
        cause,
        Duration::from_secs(2),
        |(service, _)| async move {
            compose(&["stop", service]);
            tokio::time::sleep(Duration::from_secs(2)).await;
            compose(&["start", service]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn kill_of_the_active_replica() {
    let cause = "the killed replica had published and not committed";
    scenario(&STACK, "kill", cause, TAKEOVER, |(service, _)| async move {
        docker(&["kill", "-s", "KILL", &container(service)]);
        tokio::time::sleep(Duration::from_secs(5)).await;
        compose(&["start", service]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn pause_of_the_active_replica_longer_than_member_ttl() {
    let cause = "TimeOuts the paused replica had published and not deleted when it froze";
    scenario(
        &STACK,
        "pause",
        cause,
        TAKEOVER,
        |(service, _)| async move {
            let id = container(service);
            docker(&["pause", &id]);
            tokio::time::sleep(Duration::from_secs(8)).await;
            docker(&["unpause", &id]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn the_active_replica_cut_from_postgres_only() {
    let cause = "the cut replica had confirmed TimeOuts it could not commit";
    scenario(
        &STACK,
        "cut-postgres",
        cause,
        TAKEOVER,
        |(service, _)| async move {
            let (id, net) = (container(service), network("db"));
            docker(&["network", "disconnect", &net, &id]);
            tokio::time::sleep(Duration::from_secs(8)).await;
            docker(&["network", "connect", &net, &id]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn the_active_replica_cut_from_rabbitmq_only() {
    // The others see it depart after member_ttl; the successor ends its sessions.
    let cause = "TimeOuts published before the cut whose confirms never came";
    scenario(
        &STACK,
        "cut-rabbitmq",
        cause,
        TAKEOVER,
        |(service, _)| async move {
            let (id, net) = (container(service), network("bus"));
            docker(&["network", "disconnect", &net, &id]);
            tokio::time::sleep(Duration::from_secs(12)).await;
            docker(&["network", "connect", &net, &id]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn restart_of_rabbitmq() {
    let cause = "TimeOuts published whose confirms were lost with the broker";
    scenario(
        &STACK,
        "restart-rabbitmq",
        cause,
        Duration::from_secs(40),
        |_| async move {
            compose(&["restart", "rabbitmq"]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn restart_of_postgres() {
    let cause = "confirmed TimeOuts whose commit the restart cut off";
    scenario(
        &STACK,
        "restart-postgres",
        cause,
        Duration::from_secs(40),
        |_| async move {
            compose(&["restart", "postgres"]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn rolling_restart_of_all_replicas() {
    let cause = "none expected: each replica stops gracefully";
    scenario(&STACK, "rolling-restart", cause, TAKEOVER, |_| async move {
        for (service, _) in REPLICAS {
            compose(&["restart", service]);
            STACK.settled().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn the_runtime_image_runs_as_non_root_and_its_commands_work() {
    STACK.settled().await;
    let uid = compose(&["exec", "-T", "timeoutd-1", "id", "-u"]);
    assert_ne!(uid, "0", "runs as non-root");
    compose(&["exec", "-T", "timeoutd-1", "timeoutd", "check-config"]);
    let members = compose(&[
        "exec",
        "-T",
        "timeoutd-1",
        "timeoutd",
        "members",
        "--once",
        "--json",
    ]);
    let members: serde_json::Value = serde_json::from_str(&members).expect("members --json");
    assert_eq!(members.as_array().map(Vec::len), Some(3), "{members}");
    let health = docker(&[
        "inspect",
        "-f",
        "{{.State.Health.Status}}",
        &container("timeoutd-1"),
    ]);
    assert_eq!(health, "healthy");
    println!("compose runtime image: uid {uid}, check-config ok, members --once sees 3, healthy");
}

/// Delayed messages confirmed by the broker are never lost across a broker restart: with
/// every replica stopped, 300 messages (x-delay 2 s, publisher confirms) wait in the
/// ingress quorum queue; RabbitMQ restarts; the replicas start again, store them and
/// deliver each one to the target exchange, never before its delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the compose stack: run by .ci/compose-test"]
async fn delayed_messages_in_the_quorum_queue_survive_a_rabbitmq_restart() {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions};
    STACK.settled().await;
    let key = format!("e2e.delayed.{}", Uuid::new_v4().simple());
    let queue = format!("e2e-{key}");
    let consumer = Consumer::start(&STACK, &queue).await;
    bind_target(&queue, &key).await;
    for (service, _) in REPLICAS {
        compose(&["stop", service]);
    }
    let conn = STACK.broker().await.expect("broker");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let mut sent = HashMap::new();
    for i in 0..300 {
        let id = format!("{key}-{i}");
        let mut h = FieldTable::default();
        h.insert("x-delay".into(), AMQPValue::LongInt(2000));
        let props = lapin::BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(h);
        let confirm = ch
            .basic_publish(
                "timeoutd.delay.demo".into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                id.as_bytes(),
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "confirmed");
        sent.insert(id, Utc::now());
    }
    let _ = conn.close(200, "done".into()).await;
    compose(&["restart", "rabbitmq"]);
    for (service, _) in REPLICAS {
        compose(&["start", service]);
    }
    STACK.settled().await;
    wait_until(Duration::from_secs(90), "every delayed message", || async {
        consumer.snapshot().len() == sent.len()
    })
    .await;
    let got = consumer.snapshot();
    for (id, at) in &sent {
        let first = got[id].iter().map(|g| g.at).min().expect("received");
        assert!(
            first >= *at + chrono::Duration::milliseconds(2000),
            "{id} early"
        );
    }
    let copies: usize = got.values().map(|v| v.len() - 1).sum();
    println!(
        "compose delayed-restart-rabbitmq: {} confirmed while no replica ran, broker restarted: \
         lost 0, early 0, extra copies {copies}",
        sent.len()
    );
    consumer.stop.cancel();
    STACK.drop_queue(&queue).await;

    async fn bind_target(queue: &str, key: &str) {
        let conn: Connection = STACK.broker().await.expect("broker");
        let ch = conn.create_channel().await.expect("channel");
        ch.queue_bind(
            queue.into(),
            "timeoutd.delayed".into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind to the target exchange the replicas declared");
        let _ = conn.close(200, "done".into()).await;
    }
}
