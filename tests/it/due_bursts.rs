//! Work conservation from the outside (docs/design/firing-on-the-dot.md): bursts written
//! already due — by one statement that commits after its `now()`, microseconds apart, in
//! the past, by single-row transactions that end after their rows' deadline, delayed
//! messages due now or in the past — drain without a pause, one after another on one
//! node and again right after a takeover. Judged by what a consumer receives: every
//! row once, none before its due time, and never a long silence while rows are due.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::AssertSqlSafe;
use timeoutd::election::Role;

use crate::common::{Inbox, PATIENCE, World, wait_active, wait_for};

/// The longest a consumer may hear nothing while rows are due. A pause of the kind these
/// tests look for lasted as long as a sweep (30 s); a loaded machine is slow, not silent.
const SILENCE: chrono::Duration = chrono::Duration::seconds(8);

/// The latest any row may arrive after every row was written and due: each burst drains
/// in about a second here; a row left for a sweep would wait up to 30 s.
const LATE: chrono::Duration = chrono::Duration::seconds(15);

/// Rows per burst: with batches of 20, more than the on-time lane takes while they are
/// fresh, so most of each burst drains as a backlog.
const ROWS: i64 = 4_000;

#[derive(Debug, Clone, Copy)]
enum Shape {
    /// One `INSERT … SELECT` due at its `now()`, committed 0.9 s later.
    DueNow,
    /// One statement, due 1 µs apart from its `now()`, committed 0.9 s later.
    MicrosApart,
    /// One statement, due a minute before its `now()`.
    MinuteAgo,
    /// One statement, due at `'-infinity'`.
    MinusInfinity,
    /// Single-row transactions on four connections, all due half a second after the
    /// first begins; they end after that.
    SingleRowsLate,
    /// Delayed messages due at the statement's `now()` (`x-delay: 0` through SQL),
    /// committed 0.9 s later.
    DelayedNow,
    /// Delayed messages due a second before the statement's `now()`.
    DelayedSecondAgo,
}

/// What a burst wrote: each message id with its due time, and when the last write
/// committed.
struct Written {
    due: HashMap<String, DateTime<Utc>>,
    committed: DateTime<Utc>,
}

async fn write(world: &World, shape: Shape, inbox: &Inbox, key: &str) -> Written {
    let s = &world.schema;
    let expectations = |due: &str| {
        format!(
            "INSERT INTO {s}.expected_messages (process_id, message_type, timeout_at, \
             exchange, routing_key) SELECT 'burst-' || i, 'Reply', {due}, '', $1 \
             FROM generate_series(1, $2) AS i \
             RETURNING id::text, greatest(timeout_at, '1970-01-01T00:00:00Z')"
        )
    };
    let delayed = |due: &str| {
        format!(
            "SELECT m, {due} FROM (SELECT {s}.schedule_delayed($1, '{key}', 'x'::bytea, \
             {due}) AS m FROM generate_series(1, $2)) AS w"
        )
    };
    let (sql, target, linger) = match shape {
        Shape::DueNow => (expectations("now()"), inbox.queue.clone(), 0.9),
        Shape::MicrosApart => (
            expectations("now() + i * interval '1 microsecond'"),
            inbox.queue.clone(),
            0.9,
        ),
        Shape::MinuteAgo => (
            expectations("now() - interval '1 minute'"),
            inbox.queue.clone(),
            0.0,
        ),
        Shape::MinusInfinity => (
            expectations("'-infinity'::timestamptz"),
            inbox.queue.clone(),
            0.0,
        ),
        Shape::DelayedNow => (delayed("now()"), target_of(world), 0.9),
        Shape::DelayedSecondAgo => (
            delayed("now() - interval '1 second'"),
            target_of(world),
            0.0,
        ),
        Shape::SingleRowsLate => return single_rows_late(world, inbox).await,
    };
    let mut tx = world.pool.begin().await.expect("begin");
    let rows: Vec<(String, DateTime<Utc>)> = sqlx::query_as(AssertSqlSafe(sql))
        .bind(target)
        .bind(ROWS)
        .fetch_all(&mut *tx)
        .await
        .expect("burst");
    // Committed after its now(): a probe in between finds the table without them.
    sqlx::query("SELECT pg_sleep($1)")
        .bind(linger)
        .execute(&mut *tx)
        .await
        .expect("linger");
    tx.commit().await.expect("commit");
    Written {
        due: rows.into_iter().collect(),
        committed: Utc::now(),
    }
}

fn target_of(world: &World) -> String {
    format!("t.delayed.{}", world.group)
}

/// [`Shape::SingleRowsLate`].
async fn single_rows_late(world: &World, inbox: &Inbox) -> Written {
    let due = Utc::now() + chrono::Duration::milliseconds(500);
    let sql = format!(
        "INSERT INTO {}.expected_messages (process_id, message_type, timeout_at, exchange, \
         routing_key) VALUES ($1, 'Reply', $2, '', $3) RETURNING id::text",
        world.schema
    );
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (pool, sql, queue) = (world.pool.clone(), sql.clone(), inbox.queue.clone());
            tokio::spawn(async move {
                let mut ids = Vec::new();
                for i in (w..ROWS).step_by(4) {
                    // The last rows wait for their deadline: the writes end after it,
                    // however fast the machine.
                    if i >= ROWS - 40 {
                        let wait = (due - Utc::now()).to_std().unwrap_or_default();
                        tokio::time::sleep(wait).await;
                    }
                    let id: String = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
                        .bind(format!("single-{i}"))
                        .bind(due)
                        .bind(&queue)
                        .fetch_one(&pool)
                        .await
                        .expect("single row");
                    ids.push(id);
                }
                ids
            })
        })
        .collect();
    let mut written = HashMap::new();
    for w in writers {
        written.extend(w.await.expect("writer").into_iter().map(|id| (id, due)));
    }
    let committed = Utc::now();
    Written {
        due: written,
        committed,
    }
}

/// Where each kind's messages arrive: TimeOuts through the default exchange, delayed
/// messages through the target exchange (bound before a daemon declares it).
struct Inboxes {
    timeouts: Inbox,
    delayed: Inbox,
}

/// Write `shape` and judge what arrives: each once, none early, no long silence.
async fn burst(world: &World, shape: Shape, inboxes: &Inboxes) {
    let inbox = match shape {
        Shape::DelayedNow | Shape::DelayedSecondAgo => &inboxes.delayed,
        _ => &inboxes.timeouts,
    };
    inbox.got.lock().expect("lock").clear();
    let written = write(world, shape, inbox, "k").await;
    let n = written.due.len();
    assert_eq!(n, ROWS as usize, "{shape:?}: rows written");
    wait_for(PATIENCE * 2, "every row of the burst", || inbox.len() >= n).await;
    let got = inbox.all();
    let counts = inbox.counts();
    assert_eq!(counts.len(), n, "{shape:?}: distinct messages");
    assert!(counts.values().all(|c| *c == 1), "{shape:?}: each once");
    let mut at: Vec<DateTime<Utc>> = got.iter().map(|r| r.at).collect();
    // From when the last row was written, or came due.
    let start = written
        .committed
        .max(written.due.values().max().copied().expect("rows"));
    for r in &got {
        let due = written
            .due
            .get(&r.message_id())
            .expect("a message of the burst");
        assert!(
            r.at >= *due,
            "{shape:?}: received {} before its due time {due}",
            r.at
        );
        assert!(
            r.at - start < LATE,
            "{shape:?}: {} arrived {} ms after every row was written and due",
            r.message_id(),
            (r.at - start).num_milliseconds()
        );
    }
    at.sort_unstable();
    // The longest silence: from `start` to the first receipt, and between receipts.
    let mut silence = (at[0] - start).max(chrono::Duration::zero());
    for pair in at.windows(2) {
        silence = silence.max(pair[1] - pair[0]);
    }
    let last = at[at.len() - 1] - start;
    println!(
        "{shape:?}: {n} rows, last {} ms after they were all written and due, longest \
         silence {} ms",
        last.num_milliseconds(),
        silence.num_milliseconds()
    );
    assert!(
        silence < SILENCE,
        "{shape:?}: nothing arrived for {} ms while rows were due",
        silence.num_milliseconds()
    );
}

/// Every shape, one after another on a settled group of two (whatever ran before), then
/// the first again right after the active node stops and the other takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_written_already_due_drain_without_a_pause() {
    let mut world = World::new().await;
    for (key, value) in [
        ("TIMEOUTD__SCAN__BATCH_SIZE", "20".to_owned()),
        // A probe between each burst's now() and its commit.
        ("TIMEOUTD__SCAN__PROBE_INTERVAL", "250ms".to_owned()),
        ("TIMEOUTD__DELAY__TARGET_EXCHANGE", target_of(&world)),
    ] {
        world.overrides.push((key.to_owned(), value));
    }
    world.migrate().await;
    let inboxes = Inboxes {
        timeouts: Inbox::new().await,
        delayed: Inbox::on_exchange(&target_of(&world), "#").await,
    };
    let nodes = vec![world.start().await, world.start().await];
    wait_for(PATIENCE, "an active node", || {
        nodes.iter().any(|n| *n.role.borrow() == Role::Active)
    })
    .await;
    for shape in [
        Shape::DueNow,
        Shape::MicrosApart,
        Shape::MinuteAgo,
        Shape::MinusInfinity,
        Shape::SingleRowsLate,
        Shape::DelayedNow,
        Shape::DelayedSecondAgo,
    ] {
        burst(&world, shape, &inboxes).await;
    }
    let (active, passive): (Vec<_>, Vec<_>) = nodes
        .into_iter()
        .partition(|n| *n.role.borrow() == Role::Active);
    for node in active {
        node.stop().await;
    }
    let survivor = passive.into_iter().next().expect("a passive node");
    wait_active(&survivor).await;
    burst(&world, Shape::DueNow, &inboxes).await;
    burst(&world, Shape::DelayedNow, &inboxes).await;
    survivor.stop().await;
    world.cleanup().await;
}
