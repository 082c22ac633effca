//! The SQL API (migration 0009, docs/integrating/sql-api.md) against the real broker and
//! database, judged from the outside: what a consumer receives and what the tables hold.
//! The outbox at concurrency with random rollbacks; the trace context a TimeOut carries;
//! release and retry acting only on rows in their state; one role never acting on
//! another's delayed messages. (Python and Node drive every function too: tests/recipes.)

use std::collections::HashSet;
use std::time::Duration;

use rand::Rng;
use timeoutd::client::{self, Expectation};
use uuid::Uuid;

use crate::common::{Inbox, PATIENCE, Proc, World, pg_url, wait_for, wait_for_async};
use crate::delayed::delayed_world;

const TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// Random application transactions on four connections at once, each writing an
/// outbox message and an expectation due now, then committing or rolling back: exactly
/// the committed ones arrive, each once, and nothing of a rolled-back one ever does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_delivers_what_commits_and_nothing_that_rolls_back() {
    let (world, target) = delayed_world().await;
    let outbox = Inbox::on_exchange(&target, "#").await;
    let timeouts = Inbox::new().await;
    let node = Proc::spawn(&world).await;

    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&pg_url())
        .await
        .expect("pg");
    let mut writers = Vec::new();
    for w in 0..4 {
        let (pool, schema, target, queue) = (
            pool.clone(),
            world.schema.clone(),
            target.clone(),
            timeouts.queue.clone(),
        );
        writers.push(tokio::spawn(async move {
            let (mut kept, mut dropped) = (Vec::new(), Vec::new());
            for i in 0..40 {
                let mut tx = pool.begin().await.expect("begin");
                let body = format!("w{w}-{i}");
                let sent = client::publish_at_commit(
                    &mut tx,
                    &schema,
                    &target,
                    "orders.paid",
                    body.as_bytes(),
                    &serde_json::json!({"content_type": "text/plain",
                                        "headers": {"traceparent": TRACE, "n": i}}),
                )
                .await
                .expect("publish_at_commit");
                let e = Expectation::new(&body, "Paid", &queue);
                let expected = client::expect(&mut tx, &schema, &e).await.expect("expect");
                if rand::rng().random_bool(0.5) {
                    tx.commit().await.expect("commit");
                    kept.push((sent, expected.to_string()));
                } else {
                    tx.rollback().await.expect("rollback");
                    dropped.push((sent, expected.to_string()));
                }
            }
            (kept, dropped)
        }));
    }
    let (mut kept, mut dropped) = (Vec::new(), Vec::new());
    for w in writers {
        let (k, d) = w.await.expect("writer");
        kept.extend(k);
        dropped.extend(d);
    }
    assert!(!kept.is_empty() && !dropped.is_empty(), "a mix of both");
    wait_for(PATIENCE, "every committed message and TimeOut", || {
        outbox.len() >= kept.len() && timeouts.len() >= kept.len()
    })
    .await;
    // Nothing is left that could still fire: whatever was stored has been sent.
    wait_for_async(PATIENCE, "the tables empty", || async {
        world.count("true").await == 0 && count_delayed(&world).await == 0
    })
    .await;

    let got: HashSet<String> = outbox.all().iter().map(|r| r.message_id()).collect();
    let fired: HashSet<String> = timeouts.all().iter().map(|r| r.message_id()).collect();
    let (sent, expected): (HashSet<String>, HashSet<String>) = kept.iter().cloned().unzip();
    assert_eq!(
        got, sent,
        "the outbox delivered exactly the committed messages"
    );
    assert_eq!(fired, expected, "exactly the committed expectations fired");
    for (m, e) in &dropped {
        assert!(
            !got.contains(m) && !fired.contains(e),
            "a rolled-back one arrived"
        );
    }
    for r in outbox.all() {
        assert_eq!(r.header_str("traceparent").as_deref(), Some(TRACE));
        assert_eq!(
            r.properties.content_type().as_ref().map(|s| s.as_str()),
            Some("text/plain")
        );
        assert_eq!(
            r.properties.delivery_mode(),
            &Some(2),
            "persistent by default"
        );
    }
    pool.close().await;
    drop(node);
    world.cleanup().await;
}

async fn count_delayed(world: &World) -> i64 {
    let sql = format!("SELECT count(*) FROM {}.delayed_messages", world.schema);
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(&world.pool)
        .await
        .expect("count")
}

/// An expectation written with a W3C trace context fires a TimeOut carrying it as the
/// `traceparent` header; one written without carries none. An idempotency key returns
/// the pending expectation's id and adds nothing; a bad traceparent is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_carries_the_trace_context_it_was_expected_with() {
    let world = World::new().await;
    world.migrate().await;
    let timeouts = Inbox::new().await;
    let mut conn = world.pool.acquire().await.expect("conn");
    let traced = Expectation::new("traced", "Reply", &timeouts.queue)
        .traceparent(TRACE)
        .idempotency_key("order-1/reply");
    let id = client::expect(&mut conn, &world.schema, &traced)
        .await
        .expect("expect");
    let again =
        Expectation::new("traced", "Reply", &timeouts.queue).idempotency_key("order-1/reply");
    assert_eq!(
        client::expect(&mut conn, &world.schema, &again)
            .await
            .expect("expect"),
        id,
        "the same key, the same expectation"
    );
    let plain = Expectation::new("plain", "Reply", &timeouts.queue);
    let plain_id = client::expect(&mut conn, &world.schema, &plain)
        .await
        .expect("expect");
    let bad = Expectation::new("bad", "Reply", &timeouts.queue).traceparent("not-a-trace");
    let e = client::expect(&mut conn, &world.schema, &bad)
        .await
        .expect_err("refused");
    assert!(e.to_string().contains("traceparent"), "{e}");
    drop(conn);

    let node = Proc::spawn(&world).await;
    wait_for(PATIENCE, "two TimeOuts", || timeouts.len() >= 2).await;
    let all = timeouts.all();
    let by_id = |id: Uuid| {
        all.iter()
            .find(|r| r.message_id() == id.to_string())
            .unwrap_or_else(|| panic!("no TimeOut for {id}"))
    };
    assert_eq!(by_id(id).header_str("traceparent").as_deref(), Some(TRACE));
    assert_eq!(by_id(plain_id).header_str("traceparent"), None);
    assert_eq!(all.len(), 2, "the idempotent second call added nothing");
    drop(node);
    world.cleanup().await;
}

/// retry: a row waiting out its backoff after a failed publish is tried now, and
/// nothing else is touched; release: only a parked or held row fires again, and a
/// delayed message stored without its body is refused (SQLSTATE 55000). cancel by
/// process id cancels that process' expectations only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_and_retry_act_only_on_rows_in_their_state() {
    let (mut world, _target) = delayed_world().await;
    // A failed publish waits a minute: only retry_expectation makes it fire sooner.
    world.overrides.extend([
        ("TIMEOUTD__BACKOFF__MIN".to_owned(), "60s".to_owned()),
        ("TIMEOUTD__BACKOFF__MAX".to_owned(), "60s".to_owned()),
    ]);
    let timeouts = Inbox::new().await;
    let missing = format!("t.missing.{}", world.group);
    let node = Proc::spawn(&world).await;
    let call = |sql: String| {
        let pool = world.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
        }
    };
    let s = world.schema.clone();

    // Fails: its exchange does not exist yet.
    let failing = world
        .expect(&Expectation::new("p-fail", "Reply", "k").exchange(&missing))
        .await;
    wait_for_async(PATIENCE, "the publish failed once", || async {
        world
            .count(&format!("id = '{failing}' AND attempts > 0"))
            .await
            == 1
    })
    .await;
    assert!(
        !call(format!("SELECT {s}.release_expectation('{failing}')"))
            .await
            .expect("release"),
        "not parked: release does nothing"
    );
    timeouts.bind_new_exchange(&missing, "k").await;
    assert!(
        call(format!("SELECT {s}.retry_expectation('{failing}')"))
            .await
            .expect("retry")
    );
    wait_for(PATIENCE, "the retried TimeOut", || {
        timeouts.counts().contains_key(&failing.to_string())
    })
    .await;

    // Parked (confirmed, not deletable): fires again only when released.
    let parked = world
        .expect(
            &Expectation::new("p-park", "Reply", &timeouts.queue).due_in(Duration::from_secs(3600)),
        )
        .await;
    world
        .exec(&format!(
            "UPDATE {s}.expected_messages SET timeout_at = now() - interval '1 s', \
             attempts = 1, last_error = 'parked for the test', retry_at = 'infinity' \
             WHERE id = '{parked}'"
        ))
        .await;
    assert!(
        !call(format!("SELECT {s}.retry_expectation('{parked}')"))
            .await
            .expect("retry"),
        "parked: retry does nothing"
    );
    assert!(
        call(format!("SELECT {s}.release_expectation('{parked}')"))
            .await
            .expect("release")
    );
    wait_for(PATIENCE, "the released TimeOut", || {
        timeouts.counts().contains_key(&parked.to_string())
    })
    .await;

    // Cancel by process: that process' only.
    for (p, t) in [("p-a", "One"), ("p-a", "Two"), ("p-b", "One")] {
        world
            .expect(&Expectation::new(p, t, &timeouts.queue).due_in(Duration::from_secs(3600)))
            .await;
    }
    let n: i32 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {s}.cancel_expectations('p-a', 'One') + {s}.cancel_expectations('p-a')"
    )))
    .fetch_one(&world.pool)
    .await
    .expect("cancel_expectations");
    assert_eq!(n, 2);
    assert_eq!(world.count("process_id = 'p-b'").await, 1);

    // Through the API to the default exchange, straight at a queue: refused at the call.
    let refused = call(format!(
        "SELECT {s}.publish_at_commit('', '{}', 'x'::bytea) IS NOT NULL",
        timeouts.queue
    ))
    .await
    .expect_err("refused");
    let code = refused
        .as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.to_string());
    assert_eq!(code.as_deref(), Some("42501"), "{refused}");
    // Written to the table directly: held when it falls due, never delivered; released,
    // it is judged again and held again.
    let sneaky = "sneaky".to_owned();
    let owner: String = sqlx::query_scalar("SELECT 'sql:' || session_user")
        .fetch_one(&world.pool)
        .await
        .expect("session_user");
    world
        .exec(&format!(
            "INSERT INTO {s}.delayed_messages (owner, message_id, deliver_at, exchange, \
             routing_key, properties, body) VALUES ('{owner}', '{sneaky}', now(), '', '{}', \
             '{{}}', 'x')",
            timeouts.queue
        ))
        .await;
    let held = format!(
        "SELECT count(*) FROM {s}.delayed_messages WHERE message_id = '{sneaky}' \
         AND retry_at = 'infinity'"
    );
    let is_held = || async {
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(held.clone()))
            .fetch_one(&world.pool)
            .await
            .expect("held")
            == 1
    };
    wait_for_async(PATIENCE, "the message held", is_held).await;
    let charged =
        format!("SELECT attempts FROM {s}.delayed_messages WHERE message_id = '{sneaky}'");
    let attempts = || async {
        sqlx::query_scalar::<_, i32>(sqlx::AssertSqlSafe(charged.clone()))
            .fetch_one(&world.pool)
            .await
            .expect("attempts")
    };
    let before = attempts().await;
    assert!(
        call(format!("SELECT {s}.release_delayed('{sneaky}', '{owner}')"))
            .await
            .expect("release")
    );
    wait_for_async(PATIENCE, "judged again and held again", || async {
        attempts().await > before && is_held().await
    })
    .await;
    assert!(
        !timeouts.counts().contains_key(&sneaky),
        "a message for the default exchange was delivered"
    );

    // A delayed message held without its body: release refuses it, and it stays held.
    world
        .exec(&format!(
            "INSERT INTO {s}.delayed_messages (owner, message_id, deliver_at, exchange, \
             routing_key, body, body_dropped, attempts, last_error, retry_at) VALUES \
             ('', 'no-body', now(), 't.x', 'k', '', true, 1, 'too large', 'infinity')"
        ))
        .await;
    let e = call(format!("SELECT {s}.release_delayed('no-body', '')"))
        .await
        .expect_err("refused");
    let code = e
        .as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.to_string());
    assert_eq!(code.as_deref(), Some("55000"), "{e}");
    drop(node);
    world.cleanup().await;
}

/// A login role granted only `<schema>_api` writes delayed messages as its own
/// (`sql:<role>`); it may not cancel, move, release or retry another owner's (SQLSTATE
/// 42501), even when it names the owner; it may act on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_acts_on_its_own_delayed_messages_only() {
    let mut world = World::new().await;
    world.overrides.push((
        "TIMEOUTD__DELAY__TARGET_EXCHANGE".to_owned(),
        "t.delayed".to_owned(),
    ));
    world.migrate().await;
    let tag = &Uuid::new_v4().simple().to_string()[..8];
    let (alice, bob) = (format!("td_alice_{tag}"), format!("td_bob_{tag}"));
    for role in [&alice, &bob] {
        world.exec(&format!("CREATE ROLE {role} LOGIN")).await;
        world
            .exec(&format!("GRANT {}_api TO {role}", world.schema))
            .await;
    }
    let as_role = |role: &str| {
        let mut url = url::Url::parse(&pg_url()).expect("pg url");
        url.set_username(role).expect("username");
        url.to_string()
    };
    let (a, b) = (
        sqlx::PgPool::connect(&as_role(&alice))
            .await
            .expect("alice"),
        sqlx::PgPool::connect(&as_role(&bob)).await.expect("bob"),
    );
    let s = &world.schema;
    let schedule = format!(
        "SELECT {s}.schedule_delayed('t.delayed', 'k', 'x'::bytea, now() + interval '1 hour', \
         '{{}}', 'm-1')"
    );
    for pool in [&a, &b] {
        let id: String = sqlx::query_scalar(sqlx::AssertSqlSafe(schedule.clone()))
            .fetch_one(pool)
            .await
            .expect("schedule_delayed");
        assert_eq!(id, "m-1");
    }
    let owners: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT owner FROM {s}.delayed_messages ORDER BY owner"
    )))
    .fetch_all(&world.pool)
    .await
    .expect("owners");
    assert_eq!(owners, [format!("sql:{alice}"), format!("sql:{bob}")]);
    for verb in [
        format!("{s}.cancel_delayed('m-1', 'sql:{bob}')"),
        format!("{s}.reschedule_delayed('m-1', now(), 'sql:{bob}')"),
        format!("{s}.release_delayed('m-1', 'sql:{bob}')"),
        format!("{s}.retry_delayed('m-1', 'sql:{bob}')"),
    ] {
        let e = sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(format!("SELECT {verb}")))
            .fetch_one(&a)
            .await
            .expect_err("refused");
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.to_string());
        assert_eq!(code.as_deref(), Some("42501"), "{verb}: {e}");
    }
    let cancelled: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {s}.cancel_delayed('m-1')"
    )))
    .fetch_one(&a)
    .await
    .expect("own cancel");
    assert!(cancelled);
    let left: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT owner FROM {s}.delayed_messages"
    )))
    .fetch_all(&world.pool)
    .await
    .expect("owners");
    assert_eq!(left, [format!("sql:{bob}")], "bob's message untouched");
    a.close().await;
    b.close().await;
    world.cleanup().await;
    let admin = sqlx::PgPool::connect(&pg_url()).await.expect("pg");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP ROLE IF EXISTS {alice}, {bob}"
    )))
    .execute(&admin)
    .await
    .expect("drop roles");
    admin.close().await;
}
