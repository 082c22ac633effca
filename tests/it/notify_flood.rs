//! A `NOTIFY` flood on timeoutd's channel by a login role with no rights at all (any
//! role that may connect may notify any channel): junk payloads and plausible ones
//! (`expectation:<now>`, `expectation:<long ago>`, `delayed:<now>`), 200,000 of them,
//! while rows fire. Every row fires once, none early, none late; and the active node's
//! work stays bounded: its batches during the flood (`timeoutd_batch_step_seconds`
//! `step="lock"`) and its transactions in the whole run (`pg_stat_database`, on a
//! database of the test's own) stay within a small multiple of a run without it.

use std::collections::HashMap;
use std::time::Duration;

use chrono::Utc;
use sqlx::{Connection, PgPool};
use timeoutd::client::Expectation;

use crate::common::{Inbox, PATIENCE, World, pg_url, wait_active, wait_for};
use crate::http::get;

const ROWS: usize = 100;
const NOTIFICATIONS: usize = 200_000;
const TRANSACTIONS: usize = 80;

/// The database's transactions so far (committed and rolled back).
async fn transactions(pool: &PgPool, db: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database WHERE datname = $1",
    )
    .bind(db)
    .fetch_one(pool)
    .await
    .expect("pg_stat_database")
}

/// `ROWS` expectations due over `spread` from `first`, written in one transaction.
async fn write_rows(
    pool: &PgPool,
    schema: &str,
    queue: &str,
    tag: &str,
    first: chrono::DateTime<Utc>,
    due: &mut HashMap<String, chrono::DateTime<Utc>>,
) {
    let mut tx = pool.begin().await.expect("tx");
    for i in 0..ROWS {
        let at = first + chrono::Duration::milliseconds(40 * i as i64);
        let e = Expectation::new(&format!("{tag}-{i}"), "Reply", queue).due_at(at);
        let id = timeoutd::client::expect(&mut tx, schema, &e)
            .await
            .expect("expect");
        due.insert(id.to_string(), at);
    }
    tx.commit().await.expect("commit");
}

/// Batches the node has begun (their locking queries), from its /metrics.
async fn batches(addr: std::net::SocketAddr) -> f64 {
    let (_, text) = get(addr, "/metrics").await;
    text.lines()
        .filter(|l| {
            l.starts_with("timeoutd_batch_step_seconds_count{") && l.contains("step=\"lock\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notify_flood_by_any_login_neither_delays_rows_nor_multiplies_work() {
    let mut world = World::new().await;
    let tag = world.schema.trim_start_matches("t_").to_owned();
    let db = format!("flood_{tag}");
    world.exec(&format!("CREATE DATABASE {db}")).await;
    let mut url = url::Url::parse(&pg_url()).expect("url");
    url.set_path(&format!("/{db}"));
    world
        .overrides
        .push(("TIMEOUTD__POSTGRES__URL".to_owned(), url.to_string()));
    world.migrate().await;
    let pool = PgPool::connect(url.as_str())
        .await
        .expect("the test's database");
    // A login role with no grant at all: PUBLIC may connect, and anyone may notify.
    let role = format!("flood_{tag}");
    world
        .exec(&format!("CREATE ROLE {role} LOGIN PASSWORD 'flood'"))
        .await;
    let mut as_role = url.clone();
    as_role.set_username(&role).expect("user");
    as_role.set_password(Some("flood")).expect("password");
    let channel = format!("timeoutd_{}", world.schema);

    let inbox = Inbox::new().await;
    let node = world.start().await;
    wait_active(&node).await;
    let addr = node.http_addr;
    let mut due = HashMap::new();
    let started = transactions(&world.pool, &db).await;

    // Without a flood: ROWS rows over 4 s.
    let first = Utc::now() + chrono::Duration::seconds(2);
    write_rows(&pool, &world.schema, &inbox.queue, "calm", first, &mut due).await;
    let calm_from = batches(addr).await;
    wait_for(PATIENCE, "the calm rows", || inbox.len() >= ROWS).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let calm = batches(addr).await - calm_from;

    // With a flood: as many rows over the same time, and the notifications meanwhile.
    let first = Utc::now() + chrono::Duration::seconds(2);
    write_rows(&pool, &world.schema, &inbox.queue, "flood", first, &mut due).await;
    let flood_from = batches(addr).await;
    let flooder = tokio::spawn({
        let (url, channel) = (as_role.to_string(), channel.clone());
        async move {
            let mut c = sqlx::PgConnection::connect(&url)
                .await
                .expect("the flooder connects");
            let per = NOTIFICATIONS / TRANSACTIONS;
            for t in 0..TRANSACTIONS {
                // Distinct payloads: Postgres folds equal ones within a transaction.
                let sql = format!(
                    "SELECT pg_notify($1, CASE i % 5 \
                       WHEN 0 THEN 'junk-' || i \
                       WHEN 1 THEN 'other:' || i \
                       WHEN 2 THEN 'expectation:' || (extract(epoch FROM now()) * 1e6)::bigint + i \
                       WHEN 3 THEN 'expectation:' || i \
                       ELSE 'delayed:' || (extract(epoch FROM now()) * 1e6)::bigint + i END) \
                     FROM generate_series({}, {}) AS i",
                    t * per,
                    (t + 1) * per - 1
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(&channel)
                    .execute(&mut c)
                    .await
                    .expect("notify");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = c.close().await;
        }
    });
    wait_for(PATIENCE, "the flood's rows", || inbox.len() >= 2 * ROWS).await;
    flooder.await.expect("the flooder");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let flooded = batches(addr).await - flood_from;

    let mut late = Vec::new();
    for r in inbox.all() {
        let deadline = due[&r.message_id()];
        assert!(r.fired_at() >= deadline, "early: {}", r.message_id());
        late.push((r.fired_at() - deadline).to_std().unwrap_or_default());
    }
    late.sort();
    assert_eq!(inbox.counts().len(), 2 * ROWS, "each row once");
    let (_, text) = get(addr, "/metrics").await;
    let dropped = |reason: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("timeoutd_notifications_dropped_total{")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let (foreign, flood) = (dropped("foreign"), dropped("flood"));
    assert!(
        foreign >= 1.0 && flood >= 1.0,
        "counted: foreign {foreign}, flood {flood}"
    );
    node.stop().await;
    pool.close().await;
    // The node's sessions have ended: their counts are in.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let spent = transactions(&world.pool, &db).await - started;
    println!(
        "notify flood: {NOTIFICATIONS} notifications ({foreign} dropped as foreign, {flood} \
         over the bound); batches without {calm}, with {flooded}; \
         transactions in the database over the run {spent}; lateness p50 {:?}, p99 {:?}, \
         max {:?}",
        late[late.len() / 2],
        late[late.len() * 99 / 100],
        late.last()
    );
    assert!(
        *late.last().expect("rows") <= Duration::from_secs(1),
        "a row more than a second late: {:?}",
        late.last()
    );
    assert!(
        flooded <= 3.0 * calm + 40.0,
        "the flood multiplied the batches: {flooded} against {calm} without it"
    );
    assert!(spent <= 800, "{spent} transactions in the run");
    world
        .exec(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await;
    world.exec(&format!("DROP ROLE {role}")).await;
    world.cleanup().await;
}
