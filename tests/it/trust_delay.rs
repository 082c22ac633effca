//! Trust for delayed messages (contract section 8), from the outside, with real limited
//! broker users in a vhost of the test's own: an attacker that may write only to the
//! ingress exchange cannot make the daemon (whose user may do everything in the vhost)
//! deliver anywhere the deployment does not allow, cannot speak for timeoutd in headers,
//! cannot cancel or pre-empt another publisher's message, and cannot make the database
//! hold more than the bounds allow.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use timeoutd::election::Role;

use crate::common::{PATIENCE, World, wait_for, wait_for_async};
use crate::delayed::{count, headers, publish, publisher_at, usage_drift};
use crate::http::get;
use crate::principals::{Realm, Rights};

/// The exchange delayed messages go to by default, and the pattern of those allowed
/// besides (both in the realm's vhost).
const TARGET: &str = "team.target";
const ALLOWED: &str = "allowed.*";
/// Another team's exchange, which the attacker may not write to.
const VICTIM: &str = "victim.orders";

/// A realm with the daemon's user (everything in the vhost), an admin for the test's own
/// topology and consumers, and a world whose daemons log in as the daemon user.
struct Stage {
    realm: Realm,
    world: World,
    admin: String,
}

impl Stage {
    /// With `minimal`, the daemon's user has only the rights SECURITY.md ("Rights each part needs")
    /// give it for delayed messages (and the election); otherwise everything in the vhost,
    /// so that only timeoutd's own rule stands between a publisher and other exchanges.
    async fn new(minimal: bool, overrides: &[(&str, &str)]) -> Self {
        let mut realm = Realm::new().await;
        let mut world = World::new().await;
        let rights = if minimal {
            daemon_rights(&world.ingress())
        } else {
            Rights::all()
        };
        let daemon = realm.user("daemon", &rights).await;
        let admin = realm.user("admin", &Rights::all()).await;
        for (k, v) in [
            ("TIMEOUTD__AMQP__URL", daemon.as_str()),
            ("TIMEOUTD__DELAY__TARGET_EXCHANGE", TARGET),
            ("TIMEOUTD__DELAY__ALLOWED_EXCHANGES", ALLOWED),
        ]
        .into_iter()
        .chain(overrides.iter().copied())
        {
            world.overrides.push((k.to_owned(), v.to_owned()));
        }
        world.migrate().await;
        Self {
            realm,
            world,
            admin,
        }
    }

    /// A user that may write to the ingress exchange and nothing else, and its name.
    async fn publisher(&mut self, role: &str) -> (String, String) {
        let ingress = self.world.ingress();
        let url = self
            .realm
            .user(role, &Rights::write_only(&[ingress.as_str()]))
            .await;
        (user_of(&url), url)
    }

    async fn active_node(&self) -> timeoutd::daemon::Handle {
        let node = self.world.start().await;
        wait_for(PATIENCE, "node active", || {
            *node.role.borrow() == Role::Active
        })
        .await;
        node
    }

    async fn cleanup(self) {
        self.world.cleanup().await;
        self.realm.cleanup().await;
    }
}

/// What the daemon's broker user needs for delayed messages and the election: declare
/// (configure) the ingress exchange and queue, the target exchange, the announcement
/// exchange and its own server-named queue; bind and consume them (write on the
/// queues, read on the exchanges and queues); publish (write) to the target and the
/// allowed exchanges and announcements. Nothing else: no other exchange, no `amq.*`
/// exchange but its own `amq.gen-*` queue.
fn daemon_rights(ingress: &str) -> Rights {
    let ingress = regex_escape(ingress);
    let target = regex_escape(TARGET);
    let own = format!("{ingress}|timeoutd\\.announcements|amq\\.gen-.*");
    Rights::new(
        &format!("^({own}|{target})$"),
        &format!("^({own}|{target}|allowed\\..*)$"),
        &format!("^({own})$"),
    )
}

/// Per message id: when its publish started, and its delay in milliseconds.
type Sent = HashMap<String, (DateTime<Utc>, i64)>;

fn user_of(url: &str) -> String {
    url::Url::parse(url).expect("url").username().to_owned()
}

/// One message as it arrived.
#[derive(Debug, Clone)]
struct Got {
    at: DateTime<Utc>,
    properties: BasicProperties,
    data: Vec<u8>,
}

impl Got {
    fn message_id(&self) -> String {
        let id = self.properties.message_id().as_ref();
        id.map(|s| s.to_string()).unwrap_or_default()
    }
}

/// One queue of the admin's, bound to exchanges, collecting what arrives.
struct Tap {
    queue: String,
    got: Arc<Mutex<Vec<Got>>>,
    ch: Channel,
    _conn: Connection,
}

impl Tap {
    async fn new(url: &str, name: &str) -> Self {
        let conn = crate::common::amqp_at(url).await;
        let ch = conn.create_channel().await.expect("channel");
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("queue");
        let opts = BasicConsumeOptions {
            no_ack: true,
            ..BasicConsumeOptions::default()
        };
        let mut consumer = ch
            .basic_consume(name.into(), "".into(), opts, FieldTable::default())
            .await
            .expect("consume");
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = got.clone();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                sink.lock().expect("lock").push(Got {
                    at: Utc::now(),
                    properties: d.properties,
                    data: d.data,
                });
            }
        });
        Self {
            queue: name.to_owned(),
            got,
            ch,
            _conn: conn,
        }
    }

    /// Also receive what `exchange` routes with `key` (declared as a durable topic
    /// exchange unless it is the broker's).
    async fn bind(&self, exchange: &str, key: &str) {
        if !exchange.starts_with("amq.") {
            let durable = ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            };
            self.ch
                .exchange_declare(
                    exchange.into(),
                    ExchangeKind::Topic,
                    durable,
                    FieldTable::default(),
                )
                .await
                .expect("exchange");
        }
        self.ch
            .queue_bind(
                self.queue.as_str().into(),
                exchange.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind");
    }

    fn ids(&self) -> Vec<String> {
        self.got
            .lock()
            .expect("lock")
            .iter()
            .map(Got::message_id)
            .collect()
    }

    /// What arrived, and when.
    fn all(&self) -> Vec<Got> {
        self.got.lock().expect("lock").clone()
    }
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

async fn metrics(node: &timeoutd::daemon::Handle) -> String {
    get(node.http_addr, "/metrics").await.1
}

fn ingested(text: &str, result: &str) -> f64 {
    let label = format!("result=\"{result}\"");
    text.lines()
        .find(|l| l.starts_with("timeoutd_delayed_ingested_total{") && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// The confused deputy, every way the issue tried it, from two attacker connections at
/// once in a random order: `x-timeoutd-exchange` naming another team's exchange,
/// `amq.topic`, the default exchange with a queue's name, the announcement exchange,
/// another group's ingress. Nothing arrives at any of them; each is stored held with its
/// reason (listed by `pending --failing`, counted as `held_not_allowed`), while the
/// attacker's messages to allowed exchanges (the target, a pattern, and one whose
/// instruction header is differently cased, which is not read) arrive, without the
/// publisher's spoofed identity headers. A row naming a forbidden exchange that got into
/// the table another way (an earlier version or configuration) is held at delivery, not
/// sent and not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_only_publisher_cannot_use_the_daemons_rights() {
    let mut stage = Stage::new(false, &[]).await;
    let (attacker, attacker_url) = stage.publisher("attacker").await;
    let group = &stage.world.group;
    let other_ingress = format!("timeoutd.delay.other-{group}");
    let victims = Tap::new(&stage.admin, "victims").await;
    for (x, key) in [
        (VICTIM, "#"),
        ("amq.topic", "#"),
        ("timeoutd.announcements", "#"),
        (other_ingress.as_str(), "#"),
    ] {
        victims.bind(x, key).await;
    }
    let allowed = Tap::new(&stage.admin, "allowed").await;
    allowed.bind(TARGET, "#").await;
    allowed.bind("allowed.out", "#").await;
    // Stored before (an earlier version, or delay.allowed_exchanges narrowed since).
    let t = format!("{}.delayed_messages", stage.world.schema);
    stage
        .world
        .exec(&format!(
            "INSERT INTO {t} (message_id, deliver_at, exchange, routing_key, properties, body) \
             VALUES ('old-1', now(), '{VICTIM}', 'k', '{{\"message_id\": \"old-1\"}}', 'x')"
        ))
        .await;
    let node = stage.active_node().await;
    let attacks: Vec<(&str, &str)> = vec![
        (VICTIM, "orders.created"),
        ("amq.topic", "anything"),
        ("", "victims"),
        ("timeoutd.announcements", group.as_str()),
        (other_ingress.as_str(), "k"),
    ];
    let mut plan: Vec<(String, Option<&str>, &str)> = Vec::new();
    for round in 0..3 {
        for (x, key) in &attacks {
            plan.push((format!("attack-{round}-{x}"), Some(*x), *key));
        }
        plan.push((format!("ok-{round}-target"), None, "k"));
        plan.push((format!("ok-{round}-pattern"), Some("allowed.out"), "k"));
    }
    let seed = rand::random();
    println!("seed {seed}");
    plan.shuffle(&mut StdRng::seed_from_u64(seed));
    let halves: Vec<Vec<_>> = plan
        .chunks(plan.len().div_ceil(2))
        .map(<[_]>::to_vec)
        .collect();
    let ingress = stage.world.ingress();
    let mut sending = Vec::new();
    for half in halves {
        let (url, ingress, attacker) = (attacker_url.clone(), ingress.clone(), attacker.clone());
        let half: Vec<(String, Option<String>, String)> = half
            .into_iter()
            .map(|(id, x, k)| (id, x.map(str::to_owned), k.to_owned()))
            .collect();
        sending.push(tokio::spawn(async move {
            let (_conn, ch) = publisher_at(&url).await;
            for (id, x, key) in half {
                let mut h = vec![
                    ("X-Timeoutd-User-Id", text("admin")),
                    (
                        "X-TIMEOUTD-NODE",
                        text("00000000-0000-0000-0000-000000000000"),
                    ),
                    ("x-timeoutd-delayed-ms", AMQPValue::LongLongInt(0)),
                    // Not read (instructions are exact-case), and removed.
                    ("X-Timeoutd-Exchange", text(VICTIM)),
                ];
                if let Some(x) = &x {
                    h.push(("x-timeoutd-exchange", text(x)));
                }
                let props = BasicProperties::default()
                    .with_message_id(id.as_str().into())
                    .with_user_id(attacker.as_str().into())
                    .with_headers(headers(h));
                publish(&ch, &ingress, &key, props, id.as_bytes()).await;
            }
        }));
    }
    for s in sending {
        s.await.expect("attacker");
    }
    let oks = plan.iter().filter(|p| p.0.starts_with("ok-")).count();
    let held = (plan.len() - oks) as i64 + 1;
    wait_for(PATIENCE, "the allowed messages", || {
        allowed.ids().len() >= oks
    })
    .await;
    let refused = "retry_at = 'infinity' AND attempts = 1 \
                   AND (last_error LIKE '%never receives%' OR last_error LIKE '%matches no%')";
    wait_for_async(PATIENCE, "every attack held", || async {
        count(&stage.world, refused).await == held
    })
    .await;
    // Only the attacks stay (a delivered row goes once its batch commits).
    wait_for_async(PATIENCE, "the delivered rows deleted", || async {
        count(&stage.world, "true").await == held
    })
    .await;
    let out = crate::cli::timeoutd(&stage.world, &["pending", "--failing", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rows = v["delayed"]["rows"].as_array().expect("rows");
    assert_eq!(rows.len() as i64, held, "{v}");
    for row in rows {
        assert_eq!(row["held"], true, "{row}");
        let why = row["last_error"].as_str().unwrap_or_default();
        assert!(
            why.contains("never receives") || why.contains("matches no"),
            "{row}"
        );
    }
    // The row stored before was judged at delivery: held there, with the reason.
    let old: (i32, String) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT attempts, last_error FROM {t} WHERE message_id = 'old-1'"
    )))
    .fetch_one(&stage.world.pool)
    .await
    .expect("old row");
    assert_eq!(old.0, 1, "held once, not retried");
    assert!(
        old.1.contains("not allowed") && old.1.contains(VICTIM),
        "{}",
        old.1
    );
    let seen = metrics(&node).await;
    assert_eq!(
        ingested(&seen, "held_not_allowed"),
        (held - 1) as f64,
        "{seen}"
    );
    let reached: Vec<String> = victims
        .ids()
        .into_iter()
        .filter(|id| !id.is_empty())
        .collect();
    assert_eq!(reached, Vec::<String>::new(), "nothing reached a victim");
    assert!(
        victims
            .all()
            .iter()
            .all(|d| !d.data.starts_with(b"attack") && !d.data.starts_with(b"ok")),
        "no delayed message among the victims' deliveries"
    );
    let mut ids = allowed.ids();
    ids.sort();
    assert_eq!(ids.len(), oks, "each allowed message once: {ids:?}");
    for d in allowed.all() {
        let h = d.properties.headers().clone().expect("headers");
        let names: Vec<&str> = h.inner().keys().map(|k| k.as_str()).collect();
        for name in &names {
            assert!(
                !name.to_ascii_lowercase().starts_with("x-timeoutd-")
                    || [
                        "x-timeoutd-node",
                        "x-timeoutd-delayed-ms",
                        "x-timeoutd-user-id"
                    ]
                    .contains(name),
                "{name} reached the consumer"
            );
        }
        let get = |k: &str| h.inner().get(k).cloned();
        assert_eq!(
            get("x-timeoutd-node"),
            Some(text(&node.node_id.to_string()))
        );
        assert_eq!(get("x-timeoutd-user-id"), Some(text(&attacker)));
    }
    node.stop().await;
    stage.cleanup().await;
}

/// A publisher owns its ids: another publisher (anonymous, or with its own user) that
/// cancels the victim's message ids before and after they are published, and pre-publishes
/// them with a day's delay, changes nothing for the victim: each of its messages arrives
/// once, not before its due time. The attacker cannot claim the victim's user either
/// (the broker refuses a `user_id` that is not the connection's own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_publisher_can_neither_cancel_nor_preempt_a_message() {
    let mut stage = Stage::new(false, &[]).await;
    let (victim, victim_url) = stage.publisher("victim").await;
    let victim_later = victim_url.clone();
    let (attacker, attacker_url) = stage.publisher("attacker").await;
    let inbox = Tap::new(&stage.admin, "inbox").await;
    inbox.bind(TARGET, "#").await;
    let ingress = stage.world.ingress();
    let node = stage.active_node().await;
    {
        let (_conn, ch) = publisher_at(&attacker_url).await;
        let forged = BasicProperties::default().with_user_id(victim.as_str().into());
        let refused = ch
            .basic_publish(
                ingress.as_str().into(),
                "k".into(),
                BasicPublishOptions::default(),
                b"x",
                forged,
            )
            .await
            .expect("written")
            .await;
        let e = refused.expect_err("the broker refuses another user's user_id");
        assert!(e.to_string().contains("PRECONDITION_FAILED"), "{e}");
    }
    let ids: Vec<String> = (0..24).map(|i| format!("order-{i}")).collect();
    // Before: pre-publish each id for a day, and cancel it, as anonymous and as itself.
    let cancel = |id: &str, user: Option<&str>| {
        let p =
            BasicProperties::default().with_headers(headers(vec![("x-timeoutd-cancel", text(id))]));
        match user {
            Some(u) => p.with_user_id(u.into()),
            None => p,
        }
    };
    let preempt = |id: &str, user: Option<&str>| {
        let p = BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(headers(vec![(
                "x-delay",
                AMQPValue::LongLongInt(86_400_000),
            )]));
        match user {
            Some(u) => p.with_user_id(u.into()),
            None => p,
        }
    };
    // Before: for even ids, a copy pending for a day (as anonymous and as itself), for
    // odd ones a cancel to be remembered.
    {
        let (_conn, ch) = publisher_at(&attacker_url).await;
        for (i, id) in ids.iter().enumerate() {
            for user in [None, Some(attacker.as_str())] {
                if i % 2 == 0 {
                    publish(&ch, &ingress, "k", preempt(id, user), b"attacker").await;
                } else {
                    publish(&ch, &ingress, "k", cancel(id, user), b"").await;
                }
            }
        }
    }
    wait_for_async(PATIENCE, "the copies pending", || async {
        count(&stage.world, "body = 'attacker'").await == ids.len() as i64
    })
    .await;
    // Then the victim publishes, while the attacker keeps cancelling from another
    // connection at the same time.
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let due: Arc<Mutex<Sent>> = Arc::default();
    let victim_task = {
        let (ids, ingress, due, victim) =
            (ids.clone(), ingress.clone(), due.clone(), victim.clone());
        tokio::spawn(async move {
            let (_conn, ch) = publisher_at(&victim_url).await;
            let mut rng = StdRng::seed_from_u64(seed);
            for id in ids {
                let delay: i64 = rng.random_range(1500..3500);
                let props = BasicProperties::default()
                    .with_message_id(id.as_str().into())
                    .with_user_id(victim.as_str().into())
                    .with_headers(headers(vec![("x-delay", AMQPValue::LongLongInt(delay))]));
                let sent = Utc::now();
                publish(&ch, &ingress, "k", props, b"victim").await;
                due.lock().expect("lock").insert(id, (sent, delay));
            }
        })
    };
    let attacker_task = {
        let (ids, ingress, attacker) = (ids.clone(), ingress.clone(), attacker.clone());
        tokio::spawn(async move {
            let (_conn, ch) = publisher_at(&attacker_url).await;
            for _ in 0..3 {
                for id in &ids {
                    for user in [None, Some(attacker.as_str())] {
                        publish(&ch, &ingress, "k", cancel(id, user), b"").await;
                    }
                }
            }
        })
    };
    victim_task.await.expect("victim");
    attacker_task.await.expect("attacker");
    wait_for(PATIENCE, "every victim message", || {
        inbox.ids().len() >= ids.len()
    })
    .await;
    let due = due.lock().expect("lock").clone();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for d in inbox.all() {
        let id = d.message_id();
        assert_eq!(
            d.data, b"victim",
            "only the victim's copy is delivered ({id})"
        );
        let user = d
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-timeoutd-user-id").cloned());
        assert_eq!(user, Some(text(&victim)));
        *seen.entry(id).or_default() += 1;
    }
    for id in &ids {
        assert_eq!(seen.get(id), Some(&1), "{id} arrived once");
    }
    // Received before its batch commits the delete.
    let victims = format!("owner = '{victim}'");
    wait_for_async(PATIENCE, "every victim row deleted", || async {
        count(&stage.world, &victims).await == 0
    })
    .await;
    for d in inbox.all() {
        let at = d.at;
        let id = d.message_id();
        let (sent, delay) = due[&id];
        let Some(AMQPValue::LongLongInt(held)) = d
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-timeoutd-delayed-ms").cloned())
        else {
            panic!("{id}: no x-timeoutd-delayed-ms");
        };
        assert!(held >= delay, "{id} held {held} ms of {delay}");
        assert!(
            at >= sent + chrono::Duration::milliseconds(delay),
            "{id} early"
        );
    }
    // An operator's cancel names the owner too: by another owner, it is not pending.
    {
        let (_conn, ch) = publisher_at(&victim_later).await;
        let props = BasicProperties::default()
            .with_message_id("by-cli".into())
            .with_user_id(victim.as_str().into())
            .with_headers(headers(vec![("x-delay", AMQPValue::LongLongInt(600_000))]));
        publish(&ch, &ingress, "k", props, b"victim").await;
    }
    wait_for_async(PATIENCE, "by-cli stored", || async {
        count(&stage.world, "message_id = 'by-cli'").await == 1
    })
    .await;
    let cancel = |owner: &str| {
        let args = ["cancel", "--message-id", "by-cli", "--owner", owner];
        crate::cli::timeoutd(&stage.world, &args, &[]).status.code()
    };
    assert_eq!(cancel(""), Some(4), "not the anonymous owner's");
    assert_eq!(cancel(&attacker), Some(4), "not the attacker's");
    assert_eq!(cancel(&victim), Some(0), "the victim's");
    node.stop().await;
    stage.cleanup().await;
}

/// What one publisher can make the database hold is bounded, each bound with its reason
/// and metric: a body over `delay.max_body` is held without it, a delay over
/// `delay.max_delay` is held, and messages beyond the owner's quota of messages or bytes
/// are rejected to the broker, which dead-letters them here (the operator's policy on
/// the ingress queue). Another owner is not affected by the first one's quota. The
/// daemon runs with the minimal broker rights documented for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_one_publisher_can_store_is_bounded() {
    let mut stage = Stage::new(
        true,
        &[
            ("TIMEOUTD__DELAY__MAX_BODY", "1KiB"),
            ("TIMEOUTD__DELAY__MAX_DELAY", "15m"),
            ("TIMEOUTD__DELAY__MAX_PENDING_PER_OWNER", "5"),
            ("TIMEOUTD__DELAY__MAX_BYTES_PER_OWNER", "4KiB"),
            // One batch at a time: each reads the usage the one before committed.
            ("TIMEOUTD__DELAY__INGEST_CONCURRENCY", "1"),
        ],
    )
    .await;
    let (flooder, flooder_url) = stage.publisher("flooder").await;
    let (heavy, heavy_url) = stage.publisher("heavy").await;
    let (other, other_url) = stage.publisher("other").await;
    let dead = Tap::new(&stage.admin, "dead").await;
    dead.bind("dlx", "#").await;
    let policy = format!("^{}$", regex_escape(&stage.world.ingress()));
    let out = crate::common::rabbitmqctl()
        .args(["-q", "set_policy", "-p", &stage.realm.vhost])
        .args(["--apply-to", "queues", "dlx", &policy])
        .arg(r#"{"dead-letter-exchange":"dlx"}"#)
        .output()
        .await
        .expect("rabbitmqctl");
    assert!(out.status.success(), "{out:?}");
    let inbox = Tap::new(&stage.admin, "inbox").await;
    inbox.bind(TARGET, "#").await;
    let node = stage.active_node().await;
    let ingress = stage.world.ingress();
    let later = || headers(vec![("x-delay", AMQPValue::LongLongInt(600_000))]);
    {
        let (_conn, ch) = publisher_at(&flooder_url).await;
        let props = |id: &str| {
            BasicProperties::default()
                .with_message_id(id.into())
                .with_user_id(flooder.as_str().into())
        };
        publish(
            &ch,
            &ingress,
            "k",
            props("big").with_headers(later()),
            &[b'x'; 2000],
        )
        .await;
        let far = headers(vec![("x-delay", AMQPValue::LongLongInt(3_600_000))]);
        publish(&ch, &ingress, "k", props("far").with_headers(far), b"x").await;
        for i in 0..6 {
            let id = format!("flood-{i}");
            publish(&ch, &ingress, "k", props(&id).with_headers(later()), b"x").await;
        }
    }
    {
        let (_conn, ch) = publisher_at(&heavy_url).await;
        for i in 0..5 {
            let props = BasicProperties::default()
                .with_message_id(format!("heavy-{i}").into())
                .with_user_id(heavy.as_str().into())
                .with_headers(later());
            publish(&ch, &ingress, "k", props, &[b'y'; 1000]).await;
        }
    }
    {
        let (_conn, ch) = publisher_at(&other_url).await;
        let props = BasicProperties::default()
            .with_message_id("unaffected".into())
            .with_user_id(other.as_str().into());
        publish(&ch, &ingress, "k", props, b"fine").await;
    }
    wait_for(PATIENCE, "the other owner's message", || {
        inbox.ids() == ["unaffected"]
    })
    .await;
    let flooder_rows = format!("owner = '{flooder}'");
    let heavy_rows = format!("owner = '{heavy}'");
    wait_for_async(PATIENCE, "everything stored or dead-lettered", || async {
        let stored =
            count(&stage.world, &flooder_rows).await + count(&stage.world, &heavy_rows).await;
        stored + dead.ids().len() as i64 == 8 + 5
    })
    .await;
    assert_eq!(
        count(&stage.world, &flooder_rows).await,
        5,
        "the flooder's quota of messages"
    );
    let big: (i32, String) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT octet_length(body), last_error FROM {}.delayed_messages WHERE message_id = 'big'",
        stage.world.schema
    )))
    .fetch_one(&stage.world.pool)
    .await
    .expect("big");
    assert_eq!(big.0, 0, "the body is not stored");
    assert!(
        big.1.contains("2000 bytes") && big.1.contains("delay.max_body"),
        "{}",
        big.1
    );
    let far = count(
        &stage.world,
        "message_id = 'far' AND retry_at = 'infinity' AND last_error LIKE '%delay.max_delay%'",
    )
    .await;
    assert_eq!(far, 1, "held for its delay");
    let heavy_stored = count(&stage.world, &heavy_rows).await;
    assert!(
        (1..5).contains(&heavy_stored),
        "the bytes quota: {heavy_stored} of 5 stored"
    );
    let bytes: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT coalesce(sum(bytes), 0)::int8 FROM {}.delayed_usage WHERE owner = '{heavy}'",
        stage.world.schema
    )))
    .fetch_one(&stage.world.pool)
    .await
    .expect("usage");
    assert!(
        bytes <= 4096,
        "{bytes} bytes stored for one owner of a 4 KiB quota"
    );
    let mut gone = dead.ids();
    gone.sort();
    let mut expected: Vec<String> = vec!["flood-3".into(), "flood-4".into(), "flood-5".into()];
    expected.extend((heavy_stored..5).map(|i| format!("heavy-{i}")));
    expected.sort();
    assert_eq!(gone, expected, "the ones over quota were dead-lettered");
    let text = metrics(&node).await;
    assert_eq!(ingested(&text, "held_too_large"), 1.0, "{text}");
    assert_eq!(ingested(&text, "held_too_late"), 1.0, "{text}");
    assert_eq!(
        ingested(&text, "rejected_over_quota"),
        expected.len() as f64,
        "{text}"
    );
    assert_eq!(
        usage_drift(&stage.world).await,
        0,
        "usage ledger agrees with the table"
    );
    node.stop().await;
    stage.cleanup().await;
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let escape = "\\.+*?()|[]{}^$".contains(c);
            escape.then_some('\\').into_iter().chain([c])
        })
        .collect()
}
