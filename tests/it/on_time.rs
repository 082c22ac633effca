//! Firing on the dot (docs/design/firing-on-the-dot.md): rows that come due within
//! `scan.horizon` are locked ahead and each is sent at its own due time, never before it;
//! a process manager that cancels or moves a row while it is held waits for that batch
//! and gets an answer that matches what the consumer sees; a backlog drains oldest first
//! while rows coming due meanwhile keep their time. Checked from the outside: what a
//! consumer received, what the table holds, what the process manager's statements said.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, SubsecRound, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::AssertSqlSafe;
use timeoutd::client::Expectation;
use timeoutd::election::Role;
use uuid::Uuid;

use crate::common::{Inbox, PATIENCE, World, wait_active, wait_for};

/// What the process manager does to a row while it may be held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Touch {
    Leave,
    Cancel,
    Move,
}

/// What the process manager's statement said, and how long it waited.
#[derive(Debug, Clone, Copy)]
struct Said {
    rows: u64,
    new_deadline: Option<DateTime<Utc>>,
    took: Duration,
}

/// 600 rows due at random instants over the next two seconds, into a durable queue of two
/// nodes (one active). A third of them cancelled and a third moved 1–2 s later, each at
/// a random moment in the last 120 ms before its deadline, when its batch may hold it.
/// Every row's fate must match: left → once, never early; cancel said 1 → never, said
/// 0 → once (it was on its way); move said 1 → once, not before the new deadline, said
/// 0 → once, not before the old one. A statement that met a held row waited at most the
/// horizon plus a confirm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_rows_go_out_at_their_own_deadlines_and_cancels_wait_for_them() {
    let world = World::new().await;
    world.migrate().await;
    let inbox = Inbox::new().await;
    let nodes = [world.start().await, world.start().await];
    wait_for(PATIENCE, "an active node", || {
        nodes.iter().any(|n| *n.role.borrow() == Role::Active)
    })
    .await;
    let mut rng = StdRng::seed_from_u64(0x0d07);
    // Far enough out that writing the 600 rows one by one ends before the first is due.
    // Whole microseconds, as Postgres stores them: a deadline with nanoseconds would be
    // later than the stored one, and a TimeOut stamped at the stored deadline would look
    // early by less than a microsecond.
    let start = (Utc::now() + chrono::Duration::milliseconds(2_000)).trunc_subsecs(6);
    let mut rows: HashMap<Uuid, (DateTime<Utc>, Touch)> = HashMap::new();
    for i in 0..600 {
        let due = start + chrono::Duration::microseconds(rng.random_range(0..2_000_000));
        let e = Expectation::new(&format!("dot-{i}"), "Reply", &inbox.queue).due_at(due);
        let touch = [Touch::Leave, Touch::Cancel, Touch::Move][i % 3];
        rows.insert(world.expect(&e).await, (due, touch));
    }
    let mut tasks = Vec::new();
    for (id, (due, touch)) in &rows {
        if *touch == Touch::Leave {
            continue;
        }
        let at = *due - chrono::Duration::milliseconds(rng.random_range(0..120));
        let later = rng.random_range(1.0..2.0);
        let (id, touch, pool, schema) = (*id, *touch, world.pool.clone(), world.schema.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep((at - Utc::now()).to_std().unwrap_or_default()).await;
            (id, touch_row(&pool, &schema, id, touch, later).await)
        }));
    }
    let mut said = HashMap::new();
    for t in tasks {
        let (id, s) = t.await.expect("statement");
        said.insert(id, s);
    }
    let expected = rows
        .iter()
        .filter(|(id, (_, t))| !(*t == Touch::Cancel && said[*id].rows == 1))
        .count();
    wait_for(PATIENCE, "every row that must arrive", || {
        inbox.counts().len() >= expected
    })
    .await;
    // Anything extra would show up within a tick or two.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let settings = world.settings();
    let bound = settings.scan.horizon + settings.amqp.confirm_timeout;
    let summary = check(&rows, &said, &inbox, bound);
    assert_eq!(world.count("true").await, 0, "every row fired or cancelled");
    println!("on the dot: {summary}");
    for node in nodes {
        node.stop().await;
    }
    world.cleanup().await;
}

async fn touch_row(pool: &sqlx::PgPool, schema: &str, id: Uuid, touch: Touch, later: f64) -> Said {
    // Hundreds of these share the test's pool: the wait for a connection is the test's
    // own, not the held row's, so the clock starts once the statement has one.
    let mut conn = pool.acquire().await.expect("connection");
    let started = Instant::now();
    let t = format!("{schema}.expected_messages");
    let (rows, new_deadline) = match touch {
        Touch::Cancel => {
            let sql = format!("DELETE FROM {t} WHERE id = $1");
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(id)
                .execute(&mut *conn)
                .await;
            (done.expect("delete").rows_affected(), None)
        }
        _ => {
            let sql = format!(
                "UPDATE {t} SET timeout_at = clock_timestamp() + make_interval(secs => $2) \
                 WHERE id = $1 RETURNING timeout_at"
            );
            let moved: Option<DateTime<Utc>> = sqlx::query_scalar(AssertSqlSafe(sql))
                .bind(id)
                .bind(later)
                .fetch_optional(&mut *conn)
                .await
                .expect("update");
            (u64::from(moved.is_some()), moved)
        }
    };
    Said {
        rows,
        new_deadline,
        took: started.elapsed(),
    }
}

/// Every row's fate against what the process manager was told.
fn check(
    rows: &HashMap<Uuid, (DateTime<Utc>, Touch)>,
    said: &HashMap<Uuid, Said>,
    inbox: &Inbox,
    bound: Duration,
) -> String {
    let got = inbox.all();
    let mut by_id: HashMap<String, Vec<&crate::common::Received>> = HashMap::new();
    for r in &got {
        by_id.entry(r.message_id()).or_default().push(r);
    }
    let (mut waited, mut longest, mut late) = (0, Duration::ZERO, Vec::new());
    for (id, (due, touch)) in rows {
        let copies = by_id.get(&id.to_string()).cloned().unwrap_or_default();
        let s = said.get(id);
        let (count, not_before) = match (touch, s) {
            (Touch::Leave, _) => (1, *due),
            (Touch::Cancel, Some(s)) if s.rows == 1 => (0, *due),
            (Touch::Move, Some(s)) if s.rows == 1 => (1, s.new_deadline.expect("moved")),
            _ => (1, *due),
        };
        assert_eq!(copies.len(), count, "{touch:?} row {id} due {due}: {s:?}");
        for c in copies {
            assert!(
                c.at >= not_before,
                "early: {id} at {} before {not_before}",
                c.at
            );
            let fired_at: DateTime<Utc> = c.body["fired_at"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .expect("fired_at");
            assert!(
                fired_at >= not_before,
                "stamped early: {id} {fired_at} < {not_before}"
            );
            let ms = (c.at - not_before).num_microseconds().unwrap_or(0) as f64 / 1000.0;
            late.push(ms);
        }
        if let Some(s) = s {
            assert!(
                s.took <= bound,
                "{touch:?} of {id} waited {:?} > {bound:?}",
                s.took
            );
            waited += usize::from(s.took > Duration::from_millis(5));
            longest = longest.max(s.took);
        }
    }
    late.sort_by(f64::total_cmp);
    let p = |q: f64| late[((late.len() - 1) as f64 * q) as usize];
    format!(
        "{} rows, {} received, lateness p50 {:.1} ms p99 {:.1} ms (this build, this \
         machine); {waited} cancels/moves waited for a held row, the longest {longest:?}",
        rows.len(),
        got.len(),
        p(0.5),
        p(0.99)
    )
}

/// 40,000 rows overdue by up to an hour (the database was away), then 60 rows coming due
/// while they drain and 20 written already due: with the default `scan.fresh_slots` the
/// fresh rows, foreseen or not, keep their time instead of waiting for the whole backlog;
/// every row arrives exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_rows_keep_their_time_while_a_backlog_drains() {
    let world = World::new().await;
    world.migrate().await;
    let inbox = Inbox::new().await;
    let backlog = 40_000;
    let sql = format!(
        "INSERT INTO {}.expected_messages (process_id, message_type, timeout_at, exchange, \
         routing_key) SELECT 'old-' || i, 'Reply', now() - make_interval(secs => 3600 * random()), \
         '', $1 FROM generate_series(1, $2) AS i",
        world.schema
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(&inbox.queue)
        .bind(backlog)
        .execute(&world.pool)
        .await
        .expect("backlog");
    let node = world.start().await;
    wait_active(&node).await;
    let mut fresh = HashMap::new();
    let first = Utc::now() + chrono::Duration::milliseconds(300);
    for i in 0..60 {
        let due = first + chrono::Duration::milliseconds(10 * i);
        let e = Expectation::new(&format!("fresh-{i}"), "Reply", &inbox.queue).due_at(due);
        fresh.insert(world.expect(&e).await.to_string(), due);
    }
    for i in 0..20 {
        let due = Utc::now();
        let e = Expectation::new(&format!("now-{i}"), "Reply", &inbox.queue).due_at(due);
        fresh.insert(world.expect(&e).await.to_string(), due);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let total = backlog as usize + fresh.len();
    wait_for(PATIENCE * 3, "every row", || inbox.len() >= total).await;
    let got = inbox.all();
    let counts = inbox.counts();
    assert_eq!(counts.len(), total, "distinct");
    assert!(counts.values().all(|n| *n == 1), "each exactly once");
    let last_old = got
        .iter()
        .filter(|r| !fresh.contains_key(&r.message_id()))
        .map(|r| r.at)
        .max()
        .expect("backlog received");
    let mut fresh_late = Vec::new();
    // Rows due in the drain's last moments may tie with its last row: only those due well
    // before it ended show whether a fresh row waited for the whole backlog.
    let tie = chrono::Duration::milliseconds(200);
    let mut during = 0;
    for r in got.iter().filter(|r| fresh.contains_key(&r.message_id())) {
        let due = fresh[&r.message_id()];
        assert!(r.at >= due, "early");
        if due + tie < last_old {
            during += 1;
            assert!(
                r.at < last_old,
                "a fresh row due at {due} waited for the whole backlog: {} vs last backlog \
                 row {last_old}",
                r.at
            );
        }
        fresh_late.push((r.at - due).num_milliseconds());
    }
    assert!(
        during > 0,
        "the backlog drained before any fresh row came due ({last_old}): nothing shown"
    );
    fresh_late.sort_unstable();
    println!(
        "catch-up: {backlog} overdue rows drained by {last_old}; 80 fresh rows late by at most \
         {} ms (median {} ms) while it drained",
        fresh_late[fresh_late.len() - 1],
        fresh_late[fresh_late.len() / 2]
    );
    node.stop().await;
    world.cleanup().await;
}
