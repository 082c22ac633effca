use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::Utc;
use lapin::types::AMQPValue;
use rand::seq::SliceRandom;
use sqlx::AssertSqlSafe;
use timeoutd::client::Expectation;

use crate::common::{Inbox, PATIENCE, World, wait_active, wait_for, wait_for_async};

/// 500 expectations all due 1.5 s from now (and 50 due in an hour): each TimeOut arrives
/// exactly once, never before its deadline, with the contract's properties and body; the
/// rows not due stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fires_500_due_rows_exactly_once_and_leaves_the_rest() {
    let world = World::new().await;
    world.migrate().await;
    let inbox = Inbox::new().await;
    let node = world.start().await;
    wait_active(&node).await;
    let due_at = Utc::now() + chrono::Duration::milliseconds(1500);
    let mut ids = HashSet::new();
    for i in 0..500 {
        let e = Expectation::new(&format!("proc-{i}"), "PaymentReceived", &inbox.queue)
            .due_at(due_at)
            .payload(serde_json::json!({"n": i, "nested": {"ok": true}}));
        ids.insert(world.expect(&e).await.to_string());
    }
    for i in 0..50 {
        let e = Expectation::new(&format!("later-{i}"), "Never", &inbox.queue)
            .due_in(Duration::from_secs(3600));
        world.expect(&e).await;
    }
    wait_for(PATIENCE, "500 TimeOuts", || inbox.len() >= 500).await;
    let got = inbox.all();
    let last = got.iter().map(|r| r.at).max().expect("some");
    let secs = (last - due_at)
        .to_std()
        .expect("after deadline")
        .as_secs_f64();
    println!(
        "500 rows fired in {:.3}s after their deadline: {:.0} rows/s",
        secs,
        500.0 / secs
    );
    let counts = inbox.counts();
    assert_eq!(counts.len(), 500, "distinct message ids");
    assert!(counts.values().all(|n| *n == 1), "each exactly once");
    assert_eq!(counts.keys().cloned().collect::<HashSet<_>>(), ids);
    for r in &got {
        assert!(
            r.at >= due_at,
            "received {} before deadline {}",
            r.at,
            due_at
        );
        check_contract(r, node.node_id, &inbox.queue);
    }
    wait_for_async(PATIENCE, "due rows deleted", || async {
        world.count("timeout_at <= now()").await == 0
    })
    .await;
    assert_eq!(world.count("true").await, 50, "rows not due stay");
    // Settle a moment longer: nothing more arrives (no duplicate from a late retry).
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_millis(500) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(inbox.len(), 500);
    node.stop().await;
    world.cleanup().await;
}

fn check_contract(r: &crate::common::Received, node: uuid::Uuid, queue: &str) {
    let p = &r.properties;
    let id = p.message_id().as_ref().expect("message_id").to_string();
    let process = p
        .correlation_id()
        .as_ref()
        .expect("correlation_id")
        .to_string();
    assert_eq!(p.kind().as_ref().map(|k| k.as_str()), Some("TimeOut"));
    assert_eq!(
        p.content_type().as_ref().map(|k| k.as_str()),
        Some("application/json")
    );
    assert_eq!(*p.delivery_mode(), Some(2));
    let fired = r.body["fired_at"].as_str().expect("fired_at");
    let fired: chrono::DateTime<Utc> = fired.parse().expect("RFC 3339 fired_at");
    assert_eq!(*p.timestamp(), Some(fired.timestamp() as u64));
    let header = p
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-timeoutd-node").cloned());
    let node_str = match header {
        Some(AMQPValue::LongString(s)) => s.to_string(),
        other => panic!("x-timeoutd-node header: {other:?}"),
    };
    assert_eq!(node_str, node.to_string());
    assert_eq!(r.routing_key.as_str(), queue);
    let b = &r.body;
    assert_eq!(b["expectation_id"].as_str(), Some(id.as_str()));
    assert_eq!(b["process_id"].as_str(), Some(process.as_str()));
    assert_eq!(b["message_type"], "PaymentReceived");
    let deadline: chrono::DateTime<Utc> = b["timeout_at"]
        .as_str()
        .expect("timeout_at")
        .parse()
        .expect("RFC 3339 timeout_at");
    assert!(
        fired >= deadline,
        "fired_at {fired} before timeout_at {deadline}"
    );
    let n = b["payload"]["n"].as_i64().expect("payload echoed");
    assert_eq!(process, format!("proc-{n}"));
    assert_eq!(b["payload"]["nested"]["ok"], true);
}

/// With a long tick, a row inserted while the node sleeps still fires at its deadline:
/// the insert's NOTIFY wakes the node, which then sleeps exactly until the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_deadline_wakes_the_node_before_its_tick() {
    let mut world = World::new().await;
    world.overrides.extend(
        [
            ("TIMEOUTD__ELECTION__TICK", "4s"),
            ("TIMEOUTD__ELECTION__ANNOUNCE_INTERVAL", "5s"),
            ("TIMEOUTD__ELECTION__MEMBER_TTL", "15s"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    world.migrate().await;
    let inbox = Inbox::new().await;
    let node = world.start().await;
    wait_active(&node).await;
    // Active on an empty table: the node now sleeps for a whole tick unless woken.
    let due = Utc::now() + chrono::Duration::milliseconds(700);
    world
        .expect(&Expectation::new("woken", "Reply", &inbox.queue).due_at(due))
        .await;
    wait_for(PATIENCE, "the TimeOut", || inbox.len() == 1).await;
    let got = inbox.all();
    assert!(got[0].at >= due, "fired before its deadline");
    // By the node's own stamp: woken by the deadline, it fires on it; woken by its
    // tick, it would fire anywhere up to a whole tick (4 s) late.
    let late = (got[0].fired_at() - due).to_std().unwrap_or_default();
    let tick = world.settings().election.tick;
    assert!(late < tick / 2, "fired {late:?} after its deadline");
    println!("woken by NOTIFY: fired {late:?} after its deadline");
    node.stop().await;
    world.cleanup().await;
}

/// With probes a minute apart, only notifications tell of new rows. Three times the
/// active node's LISTEN session is terminated and rows due at once are written right
/// after, while it reconnects, and nothing after them (a later row's batch would take
/// them along): each still fires once, long before any probe would have found it (the
/// node probes every tick while it cannot listen, and looks once more as soon as it
/// listens again). "Long before" is by the node's own stamp: within half the probe
/// interval of the row's writing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_while_the_listen_connection_is_down_do_not_wait_for_a_probe() {
    let mut world = World::new().await;
    world.overrides.push((
        "TIMEOUTD__SCAN__PROBE_INTERVAL".to_owned(),
        "60s".to_owned(),
    ));
    world.migrate().await;
    let inbox = Inbox::new().await;
    let node = world.start().await;
    wait_active(&node).await;
    let started = Instant::now();
    let mut written = 0;
    let mut written_at = HashMap::new();
    for round in 0..3 {
        wait_for_async(PATIENCE, "a LISTEN session", || {
            listen_sessions(&world, node.node_id)
        })
        .await;
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = $1 AND query LIKE 'LISTEN%'",
        )
        .bind(format!("timeoutd-{}", node.node_id))
        .fetch_one(&world.pool)
        .await
        .expect("terminate");
        assert_eq!(killed, 1, "round {round}: the LISTEN session");
        for i in 0..3 {
            let e = Expectation::new(&format!("gap-{round}-{i}"), "Reply", &inbox.queue);
            let at = Utc::now();
            written_at.insert(world.expect(&e).await.to_string(), at);
            written += 1;
        }
        // A row found only by the probe a minute later would be caught below, by its
        // stamp; this wait only has to outlast a loaded machine.
        wait_for(PATIENCE * 2, "the rows of the gap", || {
            inbox.len() >= written
        })
        .await;
    }
    let took = started.elapsed();
    let counts = inbox.counts();
    assert_eq!(counts.len(), written, "distinct");
    assert!(counts.values().all(|n| *n == 1), "each exactly once");
    let probes = world.settings().scan.probe_interval;
    for r in inbox.all() {
        let after = (r.fired_at() - written_at[&r.message_id()])
            .to_std()
            .unwrap_or_default();
        assert!(
            after < probes / 2,
            "{} fired {after:?} after it was written",
            r.message_id()
        );
    }
    // Received before its batch commits: the delete follows.
    wait_for_async(PATIENCE, "every row deleted", || async {
        world.count("true").await == 0
    })
    .await;
    println!("{written} rows written around 3 lost LISTEN sessions fired within {took:?}");
    node.stop().await;
    world.cleanup().await;
}

/// A process manager may write a deadline that has already passed — by an hour, or by a
/// little more than `scan.fresh`, out of the on-time lane's reach — while the active node
/// scans from where it stands (past such a row). Its notification sends the node back to
/// it: each fires within seconds, not at the next sweep 30 s on (by the node's stamp,
/// within half of that from its writing), and the probes (a minute apart here) have no
/// part in it. Rounds mix such rows, in random order, with rows coming due at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_written_already_overdue_fires_at_once_not_at_the_next_sweep() {
    let mut world = World::new().await;
    world.overrides.push((
        "TIMEOUTD__SCAN__PROBE_INTERVAL".to_owned(),
        "60s".to_owned(),
    ));
    world.migrate().await;
    let inbox = Inbox::new().await;
    let node = world.start().await;
    wait_active(&node).await;
    // Fresh rows first, so that the scan stands at now when the overdue ones come.
    let mut written = 0;
    let mut written_at = HashMap::new();
    let mut slowest = Duration::ZERO;
    for round in 0..4 {
        let mut overdue_ms: Vec<i64> = (0..6)
            .map(|_| 1_500 + rand::random_range(0..3_600_000))
            .chain([1_200, 0, -50])
            .collect();
        overdue_ms.shuffle(&mut rand::rng());
        let started = Instant::now();
        for (i, ms) in overdue_ms.iter().enumerate() {
            let due = Utc::now() - chrono::Duration::milliseconds(*ms);
            let e =
                Expectation::new(&format!("late-{round}-{i}"), "Reply", &inbox.queue).due_at(due);
            let at = Utc::now();
            written_at.insert(world.expect(&e).await.to_string(), at);
            written += 1;
        }
        // A row left for the sweep would still arrive within this wait, and be caught
        // below by its stamp.
        wait_for(PATIENCE, "the round's rows", || inbox.len() >= written).await;
        slowest = slowest.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..1_500))).await;
    }
    let counts = inbox.counts();
    assert_eq!(counts.len(), written, "distinct");
    assert!(counts.values().all(|n| *n == 1), "each exactly once");
    // Half the time between sweeps: each round starts right after the last one's rows
    // fired, so a row that waited for a sweep cannot be lucky twice.
    for r in inbox.all() {
        let after = (r.fired_at() - written_at[&r.message_id()])
            .to_std()
            .unwrap_or_default();
        assert!(
            after < SWEEP / 2,
            "{} fired {after:?} after it was written",
            r.message_id()
        );
    }
    wait_for_async(PATIENCE, "every row deleted", || async {
        world.count("true").await == 0
    })
    .await;
    println!("{written} rows written overdue or due now: the slowest round took {slowest:?}");
    node.stop().await;
    world.cleanup().await;
}

/// A LISTEN connection that stops delivering without a word (its TCP connection
/// stalls, as a half-open one does): the node's round trip on it goes unanswered, so
/// within two probe intervals it counts the connection as lost and looks for what was
/// written meanwhile. Rows written then, overdue and behind where the scan stands, fire
/// within seconds, not at the next sweep. (The daemon's pool goes straight to the server
/// here, through a pooler or not: only its sessions pass the proxy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_connection_that_goes_silent_is_noticed_within_two_probe_intervals() {
    let mut world = World::new().await;
    let server = crate::common::pg_addr();
    let proxy = crate::proxy::Proxy::start(server.parse().expect("an address")).await;
    // With `postgres.session_url` set the pool counts as pooled, and the server must
    // bound its sessions: these do, by their startup options.
    let url = |addr: &str| {
        let mut url = url::Url::parse(&crate::common::pg_url().replace(&server, addr))
            .expect("the Postgres URL");
        url.query_pairs_mut().append_pair(
            "options",
            "-c statement_timeout=60000 -c idle_in_transaction_session_timeout=60000",
        );
        url.to_string()
    };
    world.overrides.extend([
        ("TIMEOUTD__POSTGRES__URL".to_owned(), url(&server)),
        (
            "TIMEOUTD__POSTGRES__SESSION_URL".to_owned(),
            url(&proxy.addr.to_string()),
        ),
    ]);
    world.migrate().await;
    let inbox = Inbox::new().await;
    let node = world.start().await;
    wait_active(&node).await;
    wait_for_async(PATIENCE, "a LISTEN session", || {
        listen_sessions(&world, node.node_id)
    })
    .await;
    // A row fired: the scan stands past it.
    let e = Expectation::new("first", "Reply", &inbox.queue).due_at(Utc::now());
    world.expect(&e).await;
    wait_for(PATIENCE, "the first row", || inbox.len() >= 1).await;
    proxy.set(crate::proxy::Mode::Stall);
    let written = Instant::now();
    for i in 0..20 {
        let due = Utc::now() - chrono::Duration::minutes(1 + i);
        let e = Expectation::new(&format!("behind-{i}"), "Reply", &inbox.queue).due_at(due);
        world.expect(&e).await;
    }
    wait_for(PATIENCE, "the rows written behind", || inbox.len() >= 21).await;
    let took = written.elapsed();
    println!("rows written while LISTEN was silent fired {took:?} after they were written");
    // Two probe intervals (1 s each) and a new LISTEN; a sweep would take up to 30 s.
    assert!(
        took < SWEEP / 3,
        "rows written while LISTEN was silent waited {took:?}"
    );
    proxy.set(crate::proxy::Mode::Pass);
    proxy.cut();
    node.stop().await;
    world.cleanup().await;
}

/// How often the active node sweeps the due index from its start (`BACKLOG_RESCAN`).
const SWEEP: Duration = Duration::from_secs(30);

/// Whether the node has a LISTEN session now.
async fn listen_sessions(world: &World, node: uuid::Uuid) -> bool {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
         AND query LIKE 'LISTEN%'",
    )
    .bind(format!("timeoutd-{node}"))
    .fetch_one(&world.pool)
    .await
    .expect("sessions");
    n == 1
}

/// Right after a mass insert the planner's statistics still describe the table before
/// it: they promise a hundred rows in a window that holds 20,000, and reading them all
/// with a bitmap scan and sorting them looks cheap (65–300 ms a batch in the benchmark's
/// delayed burst). The firing transaction must still take its rows in the due index's
/// order, for both kinds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_statement_reads_the_due_index_in_order_under_stale_statistics() {
    use timeoutd::store::{BEGIN, SCAN_BEGIN, lock_delayed_sql, lock_due_sql};
    let world = World::new().await;
    world.migrate().await;
    let kinds = [
        (
            "expected_messages",
            lock_due_sql as fn(&str) -> String,
            EXPECTATION_ROWS,
        ),
        ("delayed_messages", lock_delayed_sql, DELAYED_ROWS),
    ];
    for (name, sql, rows) in kinds {
        let table = format!("{}.{name}", world.schema);
        // Statistics of 10,000 rows due over 10 s until 10 s ago (as a steady load
        // leaves them); then 20,000 due now.
        for step in [
            format!("ALTER TABLE {table} SET (autovacuum_enabled = false)"),
            rows.replace("{t}", &table).replace("{n}", "10000").replace(
                "{due}",
                "now() - interval '20 seconds' + random() * interval '10 seconds'",
            ),
            format!("ANALYZE {table}"),
            format!("DELETE FROM {table}"),
            rows.replace("{t}", &table)
                .replace("{n}", "20000")
                .replace("{due}", "now()"),
        ] {
            world.exec(&step).await;
        }
        let explain = format!("EXPLAIN {}", sql(&table));
        let plan_under = |begin: &'static str| {
            let (pool, explain) = (world.pool.clone(), explain.clone());
            async move {
                let mut conn = pool.acquire().await.expect("connection");
                let mut tx = sqlx::Connection::begin_with(&mut *conn, begin)
                    .await
                    .expect("begin");
                let plan: Vec<String> = sqlx::query_scalar(AssertSqlSafe(explain))
                    .bind(500i64)
                    .bind(1i64 << 20)
                    .bind(Vec::<uuid::Uuid>::new())
                    .bind(0.1f64)
                    .bind(Some(1.0f64))
                    .bind(None::<chrono::DateTime<Utc>>)
                    .fetch_all(&mut *tx)
                    .await
                    .expect("explain");
                tx.rollback().await.expect("rollback");
                plan.join("\n")
            }
        };
        println!("{name}, a plain transaction:\n{}", plan_under(BEGIN).await);
        let plan = plan_under(SCAN_BEGIN).await;
        println!("{name}, the firing transaction:\n{plan}");
        assert!(!plan.contains("Sort"), "{name}: the scan sorts:\n{plan}");
        assert!(
            plan.contains("Index Scan"),
            "{name}: no index scan:\n{plan}"
        );
    }
}

/// `{t}` the table, `{n}` how many, `{due}` their due time.
const EXPECTATION_ROWS: &str = "INSERT INTO {t} (process_id, message_type, timeout_at, \
     exchange, routing_key, payload) SELECT 'p-' || i, 'T', {due}, 'x', 'k', '{}' \
     FROM generate_series(1, {n}) AS i";
const DELAYED_ROWS: &str = "INSERT INTO {t} (message_id, deliver_at, exchange, routing_key, \
     body) SELECT gen_random_uuid()::text, {due}, 'x', 'k', '\\x00' \
     FROM generate_series(1, {n}) AS i";
