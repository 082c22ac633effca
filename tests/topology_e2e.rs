//! The topology users run, for real: `.ci/topology-test` brings up
//! `tests/topology/compose.yml` (CI stand-in images; project timeoutd-topology) — a
//! 3-node RabbitMQ 4.3 cluster (pause_minority), Postgres 18 primary + synchronous
//! streaming standby, PgBouncer (transaction mode), the group "topology" (timeoutd-1..3,
//! every broker and both Postgres hosts in their URLs) and the group "bouncer"
//! (bouncer-1..2, Postgres through PgBouncer) — and runs these one at a time on that one
//! stack. Each scenario puts TimeOuts and delayed messages on it at once, injects its
//! fault with `docker` (and `tests/topology/pg-failover`, `pg-rejoin`), restores the
//! stack, and audits from the outside with the harness of `tests/outside`: lost, early,
//! duplicates, lateness, longest gap. One summary line per scenario.
//!
//! Ignored by a plain `cargo nextest run` (they need Docker and the stack);
//! `.ci/topology-test` runs them with `--run-ignored only`, in the order of their names.

mod outside;

use std::collections::HashMap;
use std::time::Duration;

use chrono::Utc;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use outside::{
    Consumer, Stack, compose, container, docker, network, scenario, try_run, wait_until,
};
use uuid::Uuid;

const BROKERS: [&str; 3] = ["rabbit-1", "rabbit-2", "rabbit-3"];
const PG_NODES: [&str; 2] = ["pg-1", "pg-2"];
/// The published ports of tests/topology/compose.yml.
const AMQP: &[&str] = &[
    "amqp://guest:guest@127.0.0.1:45671/%2f",
    "amqp://guest:guest@127.0.0.1:45672/%2f",
    "amqp://guest:guest@127.0.0.1:45673/%2f",
];
const PG: &[&str] = &[
    "postgres://postgres@127.0.0.1:45432/postgres",
    "postgres://postgres@127.0.0.1:45433/postgres",
];
const INGRESS: &str = "timeoutd.delay.topology";

/// The group "topology": every address in its URLs.
static TOPOLOGY: Stack = Stack {
    label: "topology",
    amqp: AMQP,
    pg: PG,
    schema: "timeoutd",
    replicas: &[
        ("timeoutd-1", 49464),
        ("timeoutd-2", 49465),
        ("timeoutd-3", 49466),
    ],
    delay_exchange: Some(INGRESS),
    quorum_queues: true,
    infra_settled,
};

/// The group "bouncer": Postgres through PgBouncer.
static BOUNCER: Stack = Stack {
    label: "topology",
    amqp: AMQP,
    pg: PG,
    schema: "bouncer",
    replicas: &[("bouncer-1", 49467), ("bouncer-2", 49468)],
    delay_exchange: Some("timeoutd.delay.bouncer"),
    quorum_queues: true,
    infra_settled,
};

/// The three brokers running as one cluster with no partition, a Postgres primary with
/// a streaming synchronous standby, PgBouncer healthy.
fn infra_settled() -> bool {
    brokers_settled() && pg_primary().is_some_and(|p| sync_standbys(p) == 1) && healthy("pgbouncer")
}

fn healthy(service: &str) -> bool {
    outside::healthy(service)
}

fn brokers_settled() -> bool {
    if !BROKERS.iter().all(|b| healthy(b)) {
        return false;
    }
    let Ok(out) = try_run(
        "docker",
        &[
            "compose",
            "exec",
            "-T",
            "rabbit-1",
            "rabbitmq-diagnostics",
            "-q",
            "cluster_status",
            "--formatter",
            "json",
        ],
    ) else {
        return false;
    };
    let Ok(status) = serde_json::from_str::<serde_json::Value>(&out) else {
        return false;
    };
    let running = status["running_nodes"].as_array().map_or(0, Vec::len);
    let partitioned = status["partitions"]
        .as_object()
        .is_some_and(|p| !p.is_empty());
    running == 3 && !partitioned
}

fn psql(node: &str, sql: &str) -> Option<String> {
    try_run(
        "docker",
        &[
            "compose",
            "exec",
            "-T",
            node,
            "psql",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-XtAc",
            sql,
        ],
    )
    .ok()
}

/// The Postgres node that takes writes.
fn pg_primary() -> Option<&'static str> {
    PG_NODES
        .into_iter()
        .find(|n| psql(n, "SELECT NOT pg_is_in_recovery()").as_deref() == Some("t"))
}

fn sync_standbys(primary: &str) -> usize {
    psql(
        primary,
        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'",
    )
    .and_then(|n| n.parse().ok())
    .unwrap_or(0)
}

/// The broker node (compose service) that the daemon with this node id is connected to,
/// from the cluster's own list of connections: the one named `timeoutd <node id>`, and
/// the address it was accepted on (`client -> server`), which is the node's on "bus".
fn broker_of(node_id: Uuid) -> Option<&'static str> {
    let name = format!("timeoutd {node_id}");
    let out = BROKERS.into_iter().find_map(|broker| {
        try_run(
            "docker",
            &[
                "compose",
                "exec",
                "-T",
                broker,
                "rabbitmqctl",
                "-q",
                "list_connections",
                "name",
                "client_properties",
                "--formatter",
                "json",
            ],
        )
        .ok()
    })?;
    let conns: Vec<serde_json::Value> = serde_json::from_str(&out).ok()?;
    let conn = conns.iter().find(|c| c.to_string().contains(&name))?;
    let server = conn["name"].as_str()?.split(" -> ").nth(1)?;
    let ip = server.rsplit_once(':')?.0;
    let bus = network("bus");
    BROKERS.into_iter().find(|b| {
        let format = format!("{{{{(index .NetworkSettings.Networks \"{bus}\").IPAddress}}}}");
        try_run("docker", &["inspect", "-f", &format, &container(b)]).as_deref() == Ok(ip)
    })
}

/// The ingress quorum queue's leader and members (node names), as the cluster says.
fn ingress_members() -> Option<(String, Vec<String>)> {
    for broker in BROKERS {
        let Ok(out) = try_run(
            "docker",
            &[
                "compose",
                "exec",
                "-T",
                broker,
                "rabbitmqctl",
                "-q",
                "list_queues",
                "name",
                "type",
                "leader",
                "members",
                "--formatter",
                "json",
            ],
        ) else {
            continue;
        };
        let queues: Vec<serde_json::Value> = serde_json::from_str(&out).ok()?;
        let q = queues.into_iter().find(|q| q["name"] == INGRESS)?;
        let members = q["members"]
            .as_array()?
            .iter()
            .filter_map(|m| m.as_str().map(str::to_owned))
            .collect();
        return Some((q["leader"].as_str()?.to_owned(), members));
    }
    None
}

/// The compose service of a broker node name (`rabbit@rabbit-2.cluster`).
fn service_of(node: &str) -> &'static str {
    BROKERS
        .into_iter()
        .find(|b| node.contains(&format!("@{b}.")))
        .expect("a broker of the topology")
}

async fn the_active_broker() -> (&'static str, Uuid, &'static str) {
    let (service, id) = TOPOLOGY.settled().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(broker) = broker_of(id) {
            return (service, id, broker);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out: the active daemon's broker connection"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The start of a broker node that was stopped or killed, and its return to the cluster.
async fn start_broker(broker: &str) {
    compose(&["start", broker]);
    wait_until(
        Duration::from_secs(180),
        "the broker node back in the cluster",
        || async { brokers_settled() },
    )
    .await;
}

/// A broker restart drops up to a heartbeat's worth of connections silently; the
/// daemons' reconnect, the cluster's queue leader elections and the scheduling slack of
/// a 2-core machine running eleven containers.
const BROKER_FAULT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the topology stack: run by .ci/topology-test"]
async fn a0_the_ingress_quorum_queue_has_three_members() {
    TOPOLOGY.settled().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let (leader, members) = loop {
        match ingress_members() {
            Some((leader, members)) if members.len() == 3 => break (leader, members),
            found => assert!(
                std::time::Instant::now() < deadline,
                "timed out: the ingress queue with three members: {found:?}"
            ),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    println!("topology ingress {INGRESS}: quorum queue, leader {leader}, members {members:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the topology stack: run by .ci/topology-test"]
async fn a_kill_9_of_the_broker_node_the_active_daemon_uses() {
    let cause = "TimeOuts and delayed messages published whose confirms died with the node";
    let (_, _, broker) = the_active_broker().await;
    println!("topology broker-kill: the active daemon uses {broker}: kill -9");
    scenario(
        &TOPOLOGY,
        "broker-kill",
        cause,
        BROKER_FAULT,
        |_| async move {
            docker(&["kill", "-s", "KILL", &container(broker)]);
            tokio::time::sleep(Duration::from_secs(10)).await;
            start_broker(broker).await;
        },
    )
    .await;
}

/// While the ingress queue's leader node is down, a burst of delayed messages (publisher
/// confirms) is published with a delay that ends after the node is back: every confirmed
/// one is delivered, none early — besides the steady load's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the topology stack: run by .ci/topology-test"]
async fn b_delayed_messages_stored_while_a_broker_node_is_down() {
    const BURST: usize = 300;
    const DELAY_MS: i64 = 20_000;
    let cause = "delayed messages whose delivery's confirm or commit the fault cut off";
    TOPOLOGY.settled().await;
    let (leader, _) = ingress_members().expect("the ingress queue");
    let down = service_of(&leader);
    let queue = format!("e2e-burst-{}", &Uuid::new_v4().simple().to_string()[..8]);
    let burst = Consumer::start(&TOPOLOGY, &queue).await;
    let mut sent = HashMap::new();
    let queue_for_fault = queue.clone();
    let sent_ref = &mut sent;
    scenario(
        &TOPOLOGY,
        "broker-down-delayed",
        cause,
        Duration::from_secs(DELAY_MS as u64 / 1000 + 30),
        |_| async move {
            compose(&["stop", down]);
            *sent_ref = publish_burst(&queue_for_fault, BURST, DELAY_MS).await;
            start_broker(down).await;
        },
    )
    .await;
    wait_until(
        Duration::from_secs(120),
        "every confirmed message of the burst",
        || async {
            let got = burst.snapshot();
            sent.keys().all(|id| got.contains_key(id))
        },
    )
    .await;
    let got = burst.snapshot();
    let early = sent
        .iter()
        .filter(|(id, at)| got[*id].iter().any(|g| g.at < **at))
        .count();
    let copies: usize = sent.keys().map(|id| got[id].len() - 1).sum();
    let latest = sent
        .iter()
        .filter_map(|(id, at)| {
            let first = got[id].iter().map(|g| g.at).min()?;
            (first - *at).to_std().ok()
        })
        .max()
        .unwrap_or_default();
    println!(
        "topology scenario=broker-down-delayed burst: {} confirmed while {down} (the ingress \
         leader) was down, x-delay {DELAY_MS} ms: lost 0, early {early}, duplicates {copies}, \
         latest {:.2}s after its due time",
        sent.len(),
        latest.as_secs_f64()
    );
    burst.stop.cancel();
    TOPOLOGY.drop_queue(&queue).await;
    assert_eq!(sent.len(), BURST, "every message of the burst confirmed");
    assert_eq!(early, 0);
}

/// `count` delayed messages through the ingress, each confirmed: their ids and the
/// times before which they must not arrive.
async fn publish_burst(
    key: &str,
    count: usize,
    delay_ms: i64,
) -> HashMap<String, chrono::DateTime<Utc>> {
    let conn = TOPOLOGY.broker().await.expect("a broker node");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let mut sent = HashMap::new();
    for i in 0..count {
        let id = format!("burst-{key}-{i}");
        let mut h = FieldTable::default();
        h.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms));
        let props = lapin::BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(h);
        let due = Utc::now() + chrono::Duration::milliseconds(delay_ms);
        let confirm = ch
            .basic_publish(
                INGRESS.into(),
                key.into(),
                BasicPublishOptions::default(),
                id.as_bytes(),
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "{id} confirmed");
        sent.insert(id, due);
    }
    let _ = conn.close(200, "done".into()).await;
    sent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the topology stack: run by .ci/topology-test"]
async fn c_postgres_primary_killed_and_the_standby_promoted() {
    let cause = "TimeOuts and delayed messages published whose commit the failover cut off";
    scenario(
        &TOPOLOGY,
        "pg-failover",
        cause,
        Duration::from_secs(60),
        |_| async move {
            let before = pg_primary().expect("a primary");
            println!("{}", outside::run("bash", &["tests/topology/pg-failover"]));
            // A while on the new primary alone, then the old one back as its standby.
            tokio::time::sleep(Duration::from_secs(10)).await;
            println!("{}", outside::run("bash", &["tests/topology/pg-rejoin"]));
            let after = pg_primary().expect("a primary");
            assert_ne!(before, after, "the standby was promoted");
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the topology stack: run by .ci/topology-test"]
async fn d_rolling_restart_of_the_brokers() {
    let cause = "TimeOuts and delayed messages published whose confirms a closing node lost";
    scenario(
        &TOPOLOGY,
        "broker-rolling-restart",
        cause,
        BROKER_FAULT,
        |_| async move {
            for broker in BROKERS {
                compose(&["restart", broker]);
                wait_until(
                    Duration::from_secs(180),
                    "the broker node back in the cluster",
                    || async { brokers_settled() },
                )
                .await;
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the topology stack: run by .ci/topology-test"]
async fn e_one_broker_node_partitioned_from_the_others() {
    let cause = "publishes on the cut node whose confirms did not come within \
                 amqp.confirm_timeout (RabbitMQ 4.3 did not pause it: its daemons kept \
                 connections and one stayed active there), retried and also delivered once \
                 the cluster healed";
    let (_, _, broker) = the_active_broker().await;
    let mut placement = Vec::new();
    for (service, port) in TOPOLOGY.replicas {
        let node = outside::status(*port).await;
        let id = node
            .as_ref()
            .and_then(|s| s["node_id"].as_str()?.parse().ok());
        let role = node
            .as_ref()
            .and_then(|s| s["role"].as_str().map(str::to_owned));
        let on = id.and_then(broker_of).unwrap_or("?");
        placement.push(format!("{service} ({}) on {on}", role.unwrap_or_default()));
    }
    println!(
        "topology broker-partition: the active daemon uses {broker}: cut from the cluster; \
         daemons: {}",
        placement.join(", ")
    );
    // The test's consumer and publisher on the majority: on the cut node they would see
    // nothing until the cluster heals (RabbitMQ 4.3 keeps the minority's connections), and
    // the gap measured would be theirs.
    outside::avoid_broker(BROKERS.iter().position(|b| *b == broker));
    scenario(
        &TOPOLOGY,
        "broker-partition",
        cause,
        BROKER_FAULT,
        |_| async move {
            let (id, net) = (container(broker), network("cluster"));
            docker(&["network", "disconnect", &net, &id]);
            // net_ticktime is 10 s: the majority notices, the minority pauses.
            tokio::time::sleep(Duration::from_secs(30)).await;
            let alias = format!("{broker}.cluster");
            docker(&["network", "connect", "--alias", &alias, &net, &id]);
            wait_until(
                Duration::from_secs(180),
                "the cluster whole again",
                || async { brokers_settled() },
            )
            .await;
        },
    )
    .await;
    outside::avoid_broker(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the topology stack: run by .ci/topology-test"]
async fn f_daemons_through_pgbouncer_while_postgres_restarts() {
    let cause = "TimeOuts and delayed messages published whose commit the restart cut off";
    scenario(
        &BOUNCER,
        "pgbouncer-postgres-restart",
        cause,
        Duration::from_secs(60),
        |_| async move {
            let primary = pg_primary().expect("a primary");
            compose(&["restart", primary]);
        },
    )
    .await;
}
