//! The Postgres rights SECURITY.md lists are enough, and nothing more is needed: the
//! schema is migrated by its owner, then a daemon logs in as a role with exactly the
//! documented grants (and `postgres.migrate_on_start = false`) and fires a TimeOut and
//! a delayed message; a process manager's role granted only the SQL API's role expects,
//! moves and cancels through it, and cannot touch the tables. A grant missing from the
//! list would fail here with "permission denied".

use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::AMQPValue;
use timeoutd::client::{self, Expectation};
use uuid::Uuid;

use crate::common::{Inbox, PATIENCE, Proc, World, pg_url, wait_for, wait_for_async};
use crate::delayed::{headers, publish, publisher};

/// The grants of SECURITY.md, for `schema`: (role kind, statements).
fn grants(schema: &str, daemon: &str, manager: &str) -> Vec<String> {
    vec![
        format!("GRANT USAGE ON SCHEMA {schema} TO {daemon}"),
        format!("GRANT SELECT, UPDATE, DELETE ON {schema}.expected_messages TO {daemon}"),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.delayed_messages, \
             {schema}.delayed_cancels TO {daemon}"
        ),
        format!("GRANT SELECT, UPDATE ON {schema}.pending_counts TO {daemon}"),
        format!("GRANT SELECT, UPDATE ON {schema}.api_rules TO {daemon}"),
        format!("GRANT {schema}_api TO {daemon}"),
        format!("GRANT {schema}_api TO {manager}"),
    ]
}

const TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// The URL of `role` on the test database.
fn url_as(role: &str) -> String {
    let mut url = url::Url::parse(&pg_url()).expect("pg url");
    url.set_username(role).expect("username");
    url.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_and_a_process_manager_work_with_the_documented_grants_alone() {
    let mut world = World::new().await;
    let target = format!("t.delayed.{}", world.group);
    // Before migrating: the SQL door's rules are written from these settings.
    world.overrides.push((
        "TIMEOUTD__DELAY__TARGET_EXCHANGE".to_owned(),
        target.clone(),
    ));
    world.migrate().await;
    let tag = &Uuid::new_v4().simple().to_string()[..8];
    let (daemon, manager) = (format!("td_daemon_{tag}"), format!("td_manager_{tag}"));
    for role in [&daemon, &manager] {
        world.exec(&format!("CREATE ROLE {role} LOGIN")).await;
    }
    for grant in grants(&world.schema, &daemon, &manager) {
        world.exec(&grant).await;
    }
    world.overrides.extend([
        ("TIMEOUTD__POSTGRES__URL".to_owned(), url_as(&daemon)),
        (
            "TIMEOUTD__POSTGRES__MIGRATE_ON_START".to_owned(),
            "false".to_owned(),
        ),
    ]);
    let timeouts = Inbox::new().await;
    let delayed = Inbox::on_exchange(&target, "#").await;
    let node = Proc::spawn(&world).await;

    // The process manager, as its own role.
    let pm = sqlx::PgPool::connect(&url_as(&manager))
        .await
        .expect("manager connects");
    let mut conn = pm.acquire().await.expect("conn");
    let fires =
        Expectation::new("granted", "Reply", &timeouts.queue).due_in(Duration::from_millis(500));
    let fired = client::expect(&mut conn, &world.schema, &fires)
        .await
        .expect("expect");
    let moved =
        Expectation::new("moved", "Reply", &timeouts.queue).due_in(Duration::from_secs(3600));
    let moved_id = client::expect(&mut conn, &world.schema, &moved)
        .await
        .expect("expect");
    let soon = chrono::Utc::now() + chrono::Duration::milliseconds(500);
    assert!(
        client::reschedule(&mut conn, &world.schema, moved_id, soon)
            .await
            .expect("reschedule")
    );
    let cancelled =
        Expectation::new("cancelled", "Reply", &timeouts.queue).due_in(Duration::from_secs(3600));
    let cancelled_id = client::expect(&mut conn, &world.schema, &cancelled)
        .await
        .expect("expect");
    assert!(
        client::cancel(&mut conn, &world.schema, cancelled_id)
            .await
            .expect("cancel")
    );
    // The outbox, in the manager's own transaction.
    let mut tx = pm.begin().await.expect("begin");
    let outbox = client::publish_at_commit(
        &mut tx,
        &world.schema,
        &target,
        "outbox",
        b"at commit",
        &serde_json::json!({"headers": {"traceparent": TRACE}}),
    )
    .await
    .expect("publish_at_commit");
    tx.commit().await.expect("commit");
    // The operator's command line runs as the daemon's role: with its grants it moves
    // and cancels the manager's delayed message (owner sql:<manager>).
    let later: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {}.schedule_delayed($1, 'k', 'x', now() + interval '1 hour')",
        world.schema
    )))
    .bind(&target)
    .fetch_one(&mut *conn)
    .await
    .expect("schedule_delayed");
    let owner = format!("sql:{manager}");
    for verb in [&["reschedule", "--in", "2h"][..], &["cancel"]] {
        let mut args = verb.to_vec();
        args.extend(["--message-id", later.as_str(), "--owner", owner.as_str()]);
        let out = crate::cli::timeoutd(&world, &args, &[]);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
    }
    // The API and nothing else: the tables are out of the manager's reach.
    for sql in [
        format!("SELECT count(*) FROM {}.expected_messages", world.schema),
        format!("DELETE FROM {}.delayed_messages", world.schema),
    ] {
        let e = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&mut *conn)
            .await
            .expect_err("no table rights");
        assert!(e.to_string().contains("permission denied"), "{sql}: {e}");
    }
    drop(conn);

    wait_for_async(PATIENCE, "the ingress consuming", || async {
        let (_, body) = crate::http::get(node.http_addr, "/status").await;
        body.contains("\"consuming\":true")
    })
    .await;
    let (amqp, ch) = publisher().await;
    let props = BasicProperties::default()
        .with_message_id("granted-delayed".into())
        .with_headers(headers(vec![("x-delay", AMQPValue::LongLongInt(300))]));
    publish(&ch, &world.ingress(), "k", props, b"later").await;

    wait_for(PATIENCE, "both TimeOuts and both delayed messages", || {
        timeouts.len() == 2 && delayed.len() == 2
    })
    .await;
    let sent = delayed.all();
    let outboxed = sent
        .iter()
        .find(|r| r.message_id() == outbox)
        .expect("the outbox message");
    assert_eq!(outboxed.raw, b"at commit");
    assert_eq!(outboxed.header_str("traceparent").as_deref(), Some(TRACE));
    assert_eq!(
        outboxed.header_str("x-timeoutd-user-id"),
        Some(format!("sql:{manager}"))
    );
    let ids: Vec<String> = timeouts.all().iter().map(|r| r.message_id()).collect();
    assert!(ids.contains(&fired.to_string()) && ids.contains(&moved_id.to_string()));
    // A TimeOut is delivered before its row's delete commits: wait for the commit.
    wait_for_async(PATIENCE, "fired rows deleted", || async {
        world.count("true").await == 0
    })
    .await;
    assert!(
        !node.logged("permission denied"),
        "the daemon needed a right the list lacks"
    );
    let _ = amqp.close(200, "OK".into()).await;
    pm.close().await;
    drop(node);
    let roles = format!("{daemon}, {manager}");
    let schema = world.schema.clone();
    world.cleanup().await;
    let admin = sqlx::PgPool::connect(&pg_url()).await.expect("pg");
    for sql in [
        format!("DROP SCHEMA IF EXISTS {schema} CASCADE"),
        format!("DROP ROLE IF EXISTS {roles}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&admin)
            .await
            .expect("drop");
    }
    admin.close().await;
}
