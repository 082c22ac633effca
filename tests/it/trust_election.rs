//! Only members steer the election (contract section 8), shown from the outside with real
//! broker users: daemons that log in with the rights a deployment gives them, and
//! attackers that may write to the announcement exchange (and nothing else), or that
//! share the daemons' broker user. Each attack runs while rows fire; what counts is what
//! the daemons do (roles, `/status`, metrics, logs) and when the TimeOuts arrive.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use chrono::Utc;
use futures_util::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use timeoutd::client::Expectation;
use timeoutd::wire::announcement::{Announcement, MESSAGE_TYPE, SIGNATURE_HEADER};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::common::{
    Inbox, PATIENCE, Proc, World, amqp_at, consumed_queue, wait_for, wait_for_async,
};
use crate::http::{get, metric};
use crate::principals::{Realm, Rights, names};

const ANNOUNCE: &str = "timeoutd.announcements";
/// The lowest id there is: whoever announces it would be the active node.
const LOWEST: &str = "00000000-0000-4000-8000-000000000000";

/// The rights a daemon of `group` needs when its TimeOuts go through the default
/// exchange (SECURITY.md lists the same): its server-named announcement queue, the
/// announcement exchange, the group's delay ingress and the delay target; on the
/// announcement exchange, its group's routing key alone.
fn daemon_rights(group: &str) -> Rights {
    let ingress = format!("timeoutd.delay.{group}");
    let own = [ANNOUNCE, ingress.as_str(), "timeoutd.delayed"];
    let gen_and = |extra: &[&str]| names(extra).replacen("^(", "^(amq\\.gen-.*|", 1);
    let mut write = own.to_vec();
    write.push("amq.default");
    let mut rights = Rights::new(
        &gen_and(&own),
        &gen_and(&write),
        &gen_and(&[ANNOUNCE, ingress.as_str()]),
    );
    let key = names(&[group]);
    rights.topic.push((ANNOUNCE.to_owned(), key.clone(), key));
    rights
}

/// A realm with a daemon user, a world whose daemons log in as it, and an admin URL for
/// the test's own queues.
struct Setup {
    realm: Realm,
    world: World,
    daemon_url: String,
    admin_url: String,
}

impl Setup {
    async fn new(overrides: &[(&str, &str)]) -> Self {
        let mut realm = Realm::new().await;
        let mut world = World::new().await;
        let admin_url = realm.user("admin", &Rights::all()).await;
        // RabbitMQ 4 sets topic permissions only on an exchange that exists.
        declare_announcements(&admin_url).await;
        let daemon_url = realm.user("timeoutd", &daemon_rights(&world.group)).await;
        world
            .overrides
            .push(("TIMEOUTD__AMQP__URL".into(), daemon_url.clone()));
        for (k, v) in overrides {
            world.overrides.push(((*k).into(), (*v).into()));
        }
        world.migrate().await;
        Self {
            realm,
            world,
            daemon_url,
            admin_url,
        }
    }

    async fn cleanup(self) {
        self.world.cleanup().await;
        self.realm.cleanup().await;
    }
}

async fn status(addr: SocketAddr) -> serde_json::Value {
    let (code, body) = get(addr, "/status").await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("status json")
}

/// Node id → role, from each node's own `/status`.
async fn roles(procs: &[Proc]) -> HashMap<Uuid, String> {
    let mut out = HashMap::new();
    for p in procs {
        let s = status(p.http_addr).await;
        out.insert(p.node_id, s["role"].as_str().unwrap_or_default().to_owned());
    }
    out
}

/// Wait until exactly one node is active and every node knows all `procs`; the active one.
async fn settled_group(procs: &[Proc]) -> Uuid {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut actives = Vec::new();
        let mut known = true;
        for p in procs {
            let s = status(p.http_addr).await;
            let members = s["members"].as_array().map_or(0, Vec::len);
            known &= members >= procs.len() && s["settled"] == true;
            if s["role"] == "active" {
                actives.push(p.node_id);
            }
        }
        if known && actives.len() == 1 {
            return actives[0];
        }
        assert!(
            Instant::now() < deadline,
            "no single active node with every member known within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn role_changes(p: &Proc) -> f64 {
    let (_, text) = get(p.http_addr, "/metrics").await;
    metric(&text, "timeoutd_role_changes_total{").unwrap_or(-1.0)
}

fn announcement(node: &str, active: bool, leaving: bool, group: &str) -> Vec<u8> {
    Announcement {
        node_id: node.parse().expect("uuid"),
        group: group.to_owned(),
        sent_at: Utc::now(),
        seq: u64::MAX,
        active,
        leaving,
        probe: false,
        withdrawn: false,
        after: Some(Vec::new()),
    }
    .encode()
}

/// Publish on the group's announcement key with confirms: `Err` when the broker refuses.
async fn publish(
    conn: &Connection,
    group: &str,
    props: BasicProperties,
    body: &[u8],
) -> Result<(), lapin::Error> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let confirm = ch
        .basic_publish(
            ANNOUNCE.into(),
            group.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await?;
    confirm.await?;
    let _ = ch.close(200, "OK".into()).await;
    Ok(())
}

fn typed() -> BasicProperties {
    BasicProperties::default()
        .with_type(MESSAGE_TYPE.into())
        .with_content_type("application/json".into())
}

/// Rows due every `every` for `span`, fired to `inbox`; how late each arrived.
async fn fire_during(world: &World, inbox: &Inbox, span: Duration, every: Duration) -> usize {
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed() < span {
        let e = Expectation::new(&format!("p-{n}"), "Reply", &inbox.queue)
            .due_in(Duration::from_millis(300));
        world.expect(&e).await;
        n += 1;
        tokio::time::sleep(every).await;
    }
    n
}

/// Every row arrived once, none fired later than `late` after its deadline (by the
/// firing node's stamp: the broker's delivery to this test does not count).
async fn all_on_time(inbox: &Inbox, rows: usize, late: Duration) {
    wait_for(PATIENCE, "every TimeOut", || inbox.len() >= rows).await;
    let counts = inbox.counts();
    assert_eq!(counts.len(), rows, "each row once: {counts:?}");
    for r in inbox.all() {
        let due: chrono::DateTime<Utc> = r.body["timeout_at"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("timeout_at");
        let lateness = (r.fired_at() - due).to_std().unwrap_or_default();
        assert!(lateness < late, "{} fired {lateness:?} late", r.body);
    }
}

fn rejected(s: &serde_json::Value, reason: &str) -> u64 {
    s["rejected_announcements"]["by_reason"][reason]
        .as_u64()
        .unwrap_or(0)
}

/// An attacker that may write only to the announcement exchange announces the lowest id
/// there is (as active), forges `leaving` for the active node, and names itself or no
/// user at all; it cannot name the daemons' user (the broker refuses). None of it
/// counts: the same node stays active, no role changes anywhere, every TimeOut on time,
/// and every node shows what it dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announcements_from_other_broker_users_do_not_count() {
    let mut setup = Setup::new(&[]).await;
    let group = setup.world.group.clone();
    let attacker_url = setup
        .realm
        .user("intruder", &Rights::write_only(&[ANNOUNCE]))
        .await;
    let attacker_user = url::Url::parse(&attacker_url)
        .expect("url")
        .username()
        .to_owned();
    let daemon_user = url::Url::parse(&setup.daemon_url)
        .expect("url")
        .username()
        .to_owned();
    let inbox = Inbox::at(&setup.admin_url, None).await;
    let procs = Proc::group(&setup.world, 3).await;
    let active = settled_group(&procs).await;
    let before: Vec<f64> = futures_util::future::join_all(procs.iter().map(role_changes)).await;

    let attacker = amqp_at(&attacker_url).await;
    // The broker itself refuses a user_id that is not the connection's own.
    let impersonation = publish(
        &attacker,
        &group,
        typed().with_user_id(daemon_user.as_str().into()),
        &announcement(LOWEST, true, false, &group),
    )
    .await;
    let refused = impersonation.expect_err("the broker refuses someone else's user_id");
    assert!(
        refused.to_string().contains("PRECONDITION_FAILED"),
        "{refused}"
    );

    let attack = {
        let group = group.clone();
        let active = active.to_string();
        async move {
            let until = Instant::now() + Duration::from_secs(8);
            while Instant::now() < until {
                let forged = [
                    (typed(), announcement(LOWEST, true, false, &group)),
                    (
                        typed().with_user_id(attacker_user.as_str().into()),
                        announcement(LOWEST, true, false, &group),
                    ),
                    (typed(), announcement(&active, false, true, &group)),
                ];
                for (props, body) in forged {
                    publish(&attacker, &group, props, &body)
                        .await
                        .expect("the exchange takes the attacker's messages");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            attacker
        }
    };
    let firing = fire_during(
        &setup.world,
        &inbox,
        Duration::from_secs(8),
        Duration::from_millis(400),
    );
    // An operator watching meanwhile, as the daemons' user.
    let watch = {
        let env = setup.world.env();
        tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_secs(2));
            std::process::Command::new(env!("CARGO_BIN_EXE_timeoutd"))
                .args(["members", "--once"])
                .envs(env)
                .output()
                .expect("members runs")
        })
    };
    let (attacker, rows, watched) = tokio::join!(attack, firing, watch);
    let _ = attacker.close(200, "OK".into()).await;
    let watched = watched.expect("members");
    let shown = String::from_utf8_lossy(&watched.stdout);
    assert!(watched.status.success(), "{shown}");
    for p in &procs {
        assert!(shown.contains(&p.node_id.to_string()), "{shown}");
    }
    assert!(
        !shown.contains(LOWEST),
        "the forged id is no member: {shown}"
    );
    assert!(shown.contains("did not count"), "{shown}");

    all_on_time(&inbox, rows, Duration::from_secs(5)).await;
    let after: Vec<f64> = futures_util::future::join_all(procs.iter().map(role_changes)).await;
    assert_eq!(before, after, "no role changed during the attack");
    let roles = roles(&procs).await;
    assert_eq!(roles[&active], "active", "{roles:?}");
    for p in &procs {
        let s = status(p.http_addr).await;
        assert!(rejected(&s, "unauthenticated") > 0, "{s}");
        assert!(rejected(&s, "foreign_user") > 0, "{s}");
        let members = s["members"].as_array().expect("members");
        assert!(
            members.iter().all(|m| m["node_id"] != LOWEST),
            "the forged id is no member: {s}"
        );
        let (_, text) = get(p.http_addr, "/metrics").await;
        let counted = text
            .lines()
            .any(|l| l.contains("rejected_total") && l.contains("reason=\"unauthenticated\""));
        assert!(counted, "rejections counted in the metrics");
        assert_eq!(get(p.http_addr, "/readyz").await.0, 200);
    }
    drop(procs);
    setup.cleanup().await;
}

/// Where other services log in as the daemons' own broker user, a group secret is the
/// proof. Such a service captures real announcements and sends them again later (whole,
/// or with `leaving` set), and forges its own, unsigned or with a made-up signature.
/// None counts: no role changes, no node believes its own announcements are late, every
/// TimeOut on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_group_secret_replays_and_forgeries_do_not_count() {
    let secret = "0123456789abcdef-group-secret";
    let setup = Setup::new(&[("TIMEOUTD__ELECTION__SECRET", secret)]).await;
    let group = setup.world.group.clone();
    // The other service: the same user as the daemons.
    let shared = amqp_at(&setup.daemon_url).await;
    let inbox = Inbox::at(&setup.admin_url, None).await;
    let procs = Proc::group(&setup.world, 2).await;
    let active = settled_group(&procs).await;

    // Capture the group's announcements for a few seconds, as any member's user may.
    let ch = shared.create_channel().await.expect("channel");
    let durable = lapin::options::ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let (_, mut consumer) = consumed_queue(&ch, Some((ANNOUNCE, &group, durable))).await;
    let mut captured = Vec::new();
    let until = Instant::now() + Duration::from_secs(3);
    while let Ok(Some(Ok(d))) = tokio::time::timeout(
        until.saturating_duration_since(Instant::now()),
        consumer.next(),
    )
    .await
    {
        captured.push((d.properties.clone(), d.data.clone()));
    }
    let _ = ch.close(200, "OK".into()).await;
    assert!(captured.len() >= 2, "captured {}", captured.len());
    let before: Vec<f64> = futures_util::future::join_all(procs.iter().map(role_changes)).await;

    let attack = {
        let group = group.clone();
        let active = active.to_string();
        let shared = &shared;
        async move {
            let until = Instant::now() + Duration::from_secs(8);
            let mut i = 0;
            while Instant::now() < until {
                let (props, body) = &captured[i % captured.len()];
                i += 1;
                // Sent again whole, signature and all.
                publish(shared, &group, props.clone(), body)
                    .await
                    .expect("replay");
                // The same, turned into a `leaving` (the signature no longer fits).
                let mut leaving: serde_json::Value = serde_json::from_slice(body).expect("json");
                leaving["leaving"] = true.into();
                let leaving = serde_json::to_vec(&leaving).expect("json");
                publish(shared, &group, props.clone(), &leaving)
                    .await
                    .expect("altered");
                // Unsigned, from the shared user.
                let user = props.user_id().clone().expect("members send user_id");
                let unsigned = typed().with_user_id(user);
                publish(
                    shared,
                    &group,
                    unsigned.clone(),
                    &announcement(LOWEST, true, false, &group),
                )
                .await
                .expect("forgery");
                // A made-up signature.
                let mut headers = FieldTable::default();
                headers.insert(
                    SIGNATURE_HEADER.into(),
                    AMQPValue::LongString("ab".repeat(32).into()),
                );
                let signed = unsigned.with_headers(headers);
                publish(
                    shared,
                    &group,
                    signed,
                    &announcement(&active, false, true, &group),
                )
                .await
                .expect("forgery");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let firing = fire_during(
        &setup.world,
        &inbox,
        Duration::from_secs(8),
        Duration::from_millis(400),
    );
    let ((), rows) = tokio::join!(attack, firing);

    all_on_time(&inbox, rows, Duration::from_secs(5)).await;
    let after: Vec<f64> = futures_util::future::join_all(procs.iter().map(role_changes)).await;
    assert_eq!(before, after, "no role changed during the attack");
    assert_eq!(roles(&procs).await[&active], "active");
    for p in &procs {
        assert!(
            !p.logged("arrive too late"),
            "a replayed own announcement made node {} believe it lags",
            p.node_id
        );
        let s = status(p.http_addr).await;
        let replays = rejected(&s, "replayed") + rejected(&s, "stale");
        assert!(replays > 0, "{s}");
        assert!(rejected(&s, "bad_signature") > 0, "{s}");
        assert!(rejected(&s, "unauthenticated") > 0, "{s}");
    }
    let _ = shared.close(200, "OK".into()).await;
    drop(procs);
    setup.cleanup().await;
}

/// The announcement exchange, as the first daemon would declare it.
async fn declare_announcements(url: &str) {
    let conn = amqp_at(url).await;
    let ch = conn.create_channel().await.expect("channel");
    let durable = lapin::options::ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        ANNOUNCE.into(),
        lapin::ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await
    .expect("declare");
    let _ = conn.close(200, "OK".into()).await;
}

/// A node of an earlier version: announces with the daemons' user but without `user_id`
/// or `seq`, as those versions do (the body is what they send), until `stop`, then
/// leaves.
async fn legacy_node(url: &str, group: &str, id: &str, stop: CancellationToken) {
    let conn = amqp_at(url).await;
    let body = |leaving: bool| {
        format!(
            r#"{{"node_id":"{id}","group":"{group}","sent_at":"{}","active":true,"leaving":{leaving},"probe":false,"withdrawn":false}}"#,
            Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
        )
    };
    while !stop.is_cancelled() {
        publish(&conn, group, typed(), body(false).as_bytes())
            .await
            .expect("legacy announce");
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
    publish(&conn, group, typed(), body(true).as_bytes())
        .await
        .expect("legacy leaving");
    let _ = conn.close(200, "OK".into()).await;
}

/// A rolling upgrade from a version that sends no proof. By default a new node does not
/// count the old one (it acts itself: for a while two nodes are active, which the
/// database transaction makes safe); with `election.accept_unauthenticated` it counts
/// it as before — the old, lower node stays active until it leaves, and then the new
/// one takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_from_a_version_without_proof_counts_old_nodes_only_when_asked() {
    const OLD: &str = "00000000-0000-4000-8000-00000000000a";
    for accept in [false, true] {
        let accept_text = accept.to_string();
        let setup = Setup::new(&[(
            "TIMEOUTD__ELECTION__ACCEPT_UNAUTHENTICATED",
            accept_text.as_str(),
        )])
        .await;
        let group = setup.world.group.clone();
        // It stays until the new node has been judged beside it, however long the new
        // one takes to start and settle.
        let leave = CancellationToken::new();
        let old = tokio::spawn({
            let (url, group, leave) = (setup.daemon_url.clone(), group.clone(), leave.clone());
            async move { legacy_node(&url, &group, OLD, leave).await }
        });
        tokio::time::sleep(Duration::from_millis(600)).await;
        let node = Proc::spawn(&setup.world).await;
        let knows_old = |s: &serde_json::Value| {
            s["members"]
                .as_array()
                .is_some_and(|m| m.iter().any(|m| m["node_id"] == OLD))
        };
        wait_for_async(PATIENCE, "settled", || async {
            status(node.http_addr).await["settled"] == true
        })
        .await;
        // Two announce intervals: the old node has spoken meanwhile.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let s = status(node.http_addr).await;
        if accept {
            assert!(knows_old(&s), "the old node counts: {s}");
            assert_eq!(s["role"], "passive", "{s}");
            leave.cancel();
            old.await.expect("legacy node");
            wait_for_async(PATIENCE, "the new node takes over", || async {
                status(node.http_addr).await["role"] == "active"
            })
            .await;
        } else {
            assert!(!knows_old(&s), "the old node does not count: {s}");
            assert_eq!(s["role"], "active", "{s}");
            assert!(rejected(&s, "unauthenticated") > 0, "{s}");
            leave.cancel();
            old.await.expect("legacy node");
        }
        drop(node);
        setup.cleanup().await;
    }
}
