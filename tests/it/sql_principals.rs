//! SQL roles are principals (contract section 8): two process managers share one
//! schema, each a login role granted only `<schema>_api`. Neither can act on the other's
//! expectations or learn that they exist, neither can make timeoutd publish where the
//! deployment does not allow, and what either can store is bounded as at the ingress.
//! Judged from the outside: what the functions answer, what the tables hold, what a
//! consumer receives.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use crate::common::{Inbox, PATIENCE, Proc, World, pg_url, wait_for, wait_for_async};

/// A login role granted only the API, and a pool as it.
async fn principal(world: &World, name: &str) -> PgPool {
    world.exec(&format!("CREATE ROLE {name} LOGIN")).await;
    world
        .exec(&format!("GRANT {}_api TO {name}", world.schema))
        .await;
    let mut url = url::Url::parse(&pg_url()).expect("pg url");
    url.set_username(name).expect("username");
    PgPool::connect(url.as_str())
        .await
        .expect("principal connects")
}

/// The SQLSTATE a statement fails with, or its answer as text.
async fn answer(pool: &PgPool, sql: &str) -> Result<String, String> {
    sqlx::query_scalar::<_, Option<String>>(sqlx::AssertSqlSafe(format!("SELECT ({sql})::text")))
        .fetch_one(pool)
        .await
        .map(|v| v.unwrap_or_default())
        .map_err(|e| {
            e.as_database_error()
                .and_then(|d| d.code())
                .map_or_else(|| e.to_string(), |c| c.to_string())
        })
}

/// A world whose daemons and SQL door allow TimeOuts to `orders.*` only (no default
/// exchange) and bound delayed messages tightly.
fn guarded(world: &mut World) {
    world.overrides.extend(
        [
            ("TIMEOUTD__TIMEOUTS__ALLOWED_EXCHANGES", "orders.*"),
            ("TIMEOUTD__TIMEOUTS__ALLOW_DEFAULT_EXCHANGE", "false"),
            ("TIMEOUTD__TIMEOUTS__MAX_PAYLOAD", "1KiB"),
            ("TIMEOUTD__DELAY__TARGET_EXCHANGE", "orders.delayed"),
            ("TIMEOUTD__DELAY__MAX_BODY", "1KiB"),
            ("TIMEOUTD__DELAY__MAX_DELAY", "1h"),
            ("TIMEOUTD__DELAY__MAX_PENDING_PER_OWNER", "5"),
            ("TIMEOUTD__DELAY__MAX_BYTES_PER_OWNER", "64KiB"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_granted_the_api_acts_on_its_own_expectations_only() {
    let mut world = World::new().await;
    guarded(&mut world);
    world.migrate().await;
    let s = world.schema.clone();
    let tag = &Uuid::new_v4().simple().to_string()[..8];
    let (a_name, b_name) = (format!("td_pm_a_{tag}"), format!("td_pm_b_{tag}"));
    let a = principal(&world, &a_name).await;
    let b = principal(&world, &b_name).await;

    let expect = |key: &str| {
        format!(
            "{s}.expect('order-42', 'Paid', 'rk', now() + interval '1 hour', 'orders.out', \
             idempotency_key => '{key}')"
        )
    };
    let a_id = answer(&a, &expect("k1")).await.expect("a expects");
    let never = Uuid::new_v4();
    // Every verb on A's row answers B exactly as on an id that never existed.
    for (theirs, unknown) in [
        (
            format!("{s}.cancel_expectation('{a_id}')"),
            format!("{s}.cancel_expectation('{never}')"),
        ),
        (
            format!("{s}.reschedule_expectation('{a_id}', 'infinity')"),
            format!("{s}.reschedule_expectation('{never}', 'infinity')"),
        ),
        (
            format!("{s}.release_expectation('{a_id}')"),
            format!("{s}.release_expectation('{never}')"),
        ),
        (
            format!("{s}.retry_expectation('{a_id}')"),
            format!("{s}.retry_expectation('{never}')"),
        ),
        (
            format!("{s}.cancel_expectations('order-42')"),
            format!("{s}.cancel_expectations('order-{never}')"),
        ),
    ] {
        assert_eq!(
            answer(&b, &theirs).await,
            answer(&b, &unknown).await,
            "{theirs}"
        );
    }
    assert_eq!(
        answer(&b, &format!("{s}.cancel_expectations('order-42')")).await,
        Ok("0".to_owned())
    );
    // Naming A as the owner is refused outright.
    let named = format!("{s}.cancel_expectation('{a_id}', 'sql:{a_name}')");
    assert_eq!(answer(&b, &named).await, Err("42501".to_owned()));
    // The same idempotency key is B's own: a row of its own, A's untouched.
    let b_id = answer(&b, &expect("k1")).await.expect("b expects");
    assert_ne!(a_id, b_id, "B's key does not return A's row");
    assert_eq!(answer(&a, &expect("k1")).await, Ok(a_id.clone()));
    let rows: Vec<(String, String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id::text, owner, exchange FROM {s}.expected_messages \
         WHERE timeout_at < 'infinity' ORDER BY owner"
    )))
    .fetch_all(&world.pool)
    .await
    .expect("rows");
    assert_eq!(
        rows,
        [
            (
                a_id.clone(),
                format!("sql:{a_name}"),
                "orders.out".to_owned()
            ),
            (
                b_id.clone(),
                format!("sql:{b_name}"),
                "orders.out".to_owned()
            )
        ]
    );
    // A acts on its own.
    assert_eq!(
        answer(&a, &format!("{s}.cancel_expectations('order-42')")).await,
        Ok("1".to_owned())
    );
    assert_eq!(world.count("true").await, 1, "only B's row is left");
    a.close().await;
    b.close().await;
    world.cleanup().await;
    drop_roles(&[&a_name, &b_name]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_door_refuses_destinations_and_sizes_the_deployment_does_not_allow() {
    let mut world = World::new().await;
    guarded(&mut world);
    world.migrate().await;
    let s = world.schema.clone();
    let tag = &Uuid::new_v4().simple().to_string()[..8];
    let name = format!("td_pm_{tag}");
    let pm = principal(&world, &name).await;

    let timeout_to = |exchange: &str| {
        format!("{s}.expect('p', 'T', 'rk', now() + interval '1 hour', '{exchange}')")
    };
    for refused in [
        "",
        "amq.direct",
        "amq.topic",
        "timeoutd.announcements",
        &world.ingress(),
        "timeoutd.delay.another-group",
        "billing",
    ] {
        assert_eq!(
            answer(&pm, &timeout_to(refused)).await,
            Err("42501".to_owned()),
            "a TimeOut to {refused:?}"
        );
    }
    assert!(answer(&pm, &timeout_to("orders.out")).await.is_ok());
    // What travels as an AMQP short string, and the payload, are bounded at the door.
    let long = "repeat('x', 256)";
    let payload = "jsonb_build_object('k', repeat('x', 1100))";
    for (what, call) in [
        (
            "a 256-byte routing key",
            format!("{s}.expect('p', 'T', {long}, now(), 'orders.out')"),
        ),
        (
            "a 256-byte exchange",
            format!("{s}.expect('p', 'T', 'rk', now(), 'orders.' || repeat('x', 249))"),
        ),
        (
            "a 256-byte process_id",
            format!("{s}.expect({long}, 'T', 'rk', now(), 'orders.out')"),
        ),
        (
            "a 256-byte message_type",
            format!("{s}.expect('p', {long}, 'rk', now(), 'orders.out')"),
        ),
        (
            "a 256-byte idempotency key",
            format!("{s}.expect('p', 'T', 'rk', now(), 'orders.out', idempotency_key => {long})"),
        ),
        (
            "a payload over timeouts.max_payload",
            format!("{s}.expect('p', 'T', 'rk', now(), 'orders.out', {payload})"),
        ),
    ] {
        assert_eq!(answer(&pm, &call).await, Err("54000".to_owned()), "{what}");
    }
    let fits = format!("{s}.expect('p', 'T', repeat('x', 255), now(), 'orders.out', '{{}}')");
    assert!(answer(&pm, &fits).await.is_ok(), "255 bytes fit");

    let delayed = |exchange: &str, body: &str, at: &str, properties: &str| {
        format!("{s}.schedule_delayed('{exchange}', 'rk', {body}, {at}, {properties})")
    };
    let small = "'x'::bytea";
    let soon = "now() + interval '1 minute'";
    for (what, call, code) in [
        (
            "the default exchange",
            delayed("", small, soon, "'{}'"),
            "42501",
        ),
        (
            "amq.direct",
            delayed("amq.direct", small, soon, "'{}'"),
            "42501",
        ),
        (
            "an exchange not allowed",
            delayed("billing", small, soon, "'{}'"),
            "42501",
        ),
        (
            "the ingress",
            delayed(&world.ingress(), small, soon, "'{}'"),
            "42501",
        ),
        (
            "a body over max_body",
            delayed(
                "orders.delayed",
                "convert_to(repeat('x', 2000), 'UTF8')",
                soon,
                "'{}'",
            ),
            "54000",
        ),
        (
            "deliver_at 'infinity'",
            delayed("orders.delayed", small, "'infinity'", "'{}'"),
            "54000",
        ),
        (
            "a 256-byte routing key",
            format!("{s}.schedule_delayed('orders.delayed', repeat('k', 256), {small}, {soon})"),
            "54000",
        ),
        (
            "a 256-byte message_id",
            format!(
                "{s}.schedule_delayed('orders.delayed', 'rk', {small}, {soon}, \
                 message_id => repeat('m', 256))"
            ),
            "54000",
        ),
        (
            "a 256-byte correlation_id",
            delayed(
                "orders.delayed",
                small,
                soon,
                "jsonb_build_object('correlation_id', repeat('c', 256))",
            ),
            "54000",
        ),
        (
            "a 256-byte header name",
            delayed(
                "orders.delayed",
                small,
                soon,
                "jsonb_build_object('headers', jsonb_build_object(repeat('h', 256), 'v'))",
            ),
            "54000",
        ),
        (
            "300 headers",
            delayed(
                "orders.delayed",
                small,
                soon,
                "jsonb_build_object('headers', (SELECT jsonb_object_agg('h' || i, i) \
                 FROM generate_series(1, 300) AS i))",
            ),
            "54000",
        ),
        (
            "70 KiB of headers",
            delayed(
                "orders.delayed",
                small,
                soon,
                "jsonb_build_object('headers', (SELECT jsonb_object_agg('h' || i, \
                 repeat('v', 1000)) FROM generate_series(1, 70) AS i))",
            ),
            "54000",
        ),
    ] {
        assert_eq!(answer(&pm, &call).await, Err(code.to_owned()), "{what}");
    }
    // Five fit the owner's quota; the sixth, in the same statement or later, does not.
    let five = format!(
        "(SELECT count({}) FROM generate_series(1, 5) AS i)",
        delayed("orders.delayed", small, soon, "'{}'").replace("'rk'", "'rk-' || i")
    );
    assert_eq!(answer(&pm, &five).await, Ok("5".to_owned()));
    let outbox = format!("{s}.publish_at_commit('orders.delayed', 'rk', 'x'::bytea)");
    assert_eq!(answer(&pm, &outbox).await, Err("53400".to_owned()));
    // Rescheduling keeps within delay.max_delay too.
    let later = format!("{s}.reschedule_delayed('any', 'infinity')");
    assert_eq!(answer(&pm, &later).await, Err("54000".to_owned()));
    // The quota answers a role about itself only.
    let own = format!("{s}.delayed_usage_admit(ARRAY['sql:{name}'], ARRAY[1::int8], 100, 100000)");
    assert_eq!(answer(&pm, &own).await, Ok("{t}".to_owned()));
    let other = own.replace(&format!("sql:{name}"), "sql:victim");
    assert_eq!(answer(&pm, &other).await, Err("42501".to_owned()));
    // The ledger is the triggers' alone: no role forges usage for another.
    let forged = format!("INSERT INTO {s}.delayed_usage VALUES ('sql:victim', 1000000000, 0)");
    let e = sqlx::query(sqlx::AssertSqlSafe(forged))
        .execute(&pm)
        .await
        .expect_err("no right on the ledger");
    assert_eq!(
        e.as_database_error().and_then(|d| d.code()).as_deref(),
        Some("42501")
    );
    // A role granted delayed_messages alone (an operator's script) writes and cancels
    // rows directly: the triggers keep the ledger with the schema owner's rights.
    let operator = format!("td_op_{tag}");
    world.exec(&format!("CREATE ROLE {operator} LOGIN")).await;
    world
        .exec(&format!("GRANT USAGE ON SCHEMA {s} TO {operator}"))
        .await;
    world
        .exec(&format!(
            "GRANT SELECT, INSERT, DELETE ON {s}.delayed_messages TO {operator}"
        ))
        .await;
    let mut url = url::Url::parse(&pg_url()).expect("pg url");
    url.set_username(&operator).expect("username");
    let op = PgPool::connect(url.as_str()).await.expect("operator");
    for sql in [
        format!(
            "INSERT INTO {s}.delayed_messages (owner, message_id, deliver_at, exchange, \
             routing_key, properties, body) VALUES ('ops', 'm', now() + interval '1 hour', \
             'orders.delayed', 'k', '{{}}', 'x')"
        ),
        format!("DELETE FROM {s}.delayed_messages WHERE owner = 'ops'"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&op)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let usage: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT sum(messages)::int8 FROM {s}.delayed_usage WHERE owner = 'ops'"
    )))
    .fetch_one(&world.pool)
    .await
    .expect("usage");
    assert_eq!(usage, Some(0), "the insert and the delete both counted");
    // The ledger credits what it charged, however Postgres compresses the row.
    world
        .exec(&format!(
            "INSERT INTO {s}.delayed_messages (owner, message_id, deliver_at, exchange, \
             routing_key, properties, body) VALUES ('squeezed', 'm', now() + interval '1 hour', \
             'orders.delayed', 'k', jsonb_build_object('headers', jsonb_build_array( \
             jsonb_build_array('h', jsonb_build_object('t', 'str', 'v', repeat('abc', 20000))))), 'x')"
        ))
        .await;
    world
        .exec(&format!(
            "DELETE FROM {s}.delayed_messages WHERE owner = 'squeezed'"
        ))
        .await;
    let left: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT sum(bytes)::int8 FROM {s}.delayed_usage WHERE owner = 'squeezed'"
    )))
    .fetch_one(&world.pool)
    .await
    .expect("usage");
    assert_eq!(left, Some(0), "a compressed row credited as charged");
    pm.close().await;
    op.close().await;
    world.cleanup().await;
    drop_roles(&[&name, &operator]).await;
}

/// Rows written to the table directly are judged again at firing: a TimeOut to the
/// default exchange is held with the reason, never published, while the row next to it
/// fires; the SQL door follows the rules of the node that fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_written_directly_to_a_refused_exchange_is_held_and_its_neighbour_fires() {
    let mut world = World::new().await;
    guarded(&mut world);
    let allowed = format!("orders.{}", world.group);
    let inbox = Inbox::on_exchange(&allowed, "#").await;
    let private = Inbox::new().await;
    world.migrate().await;
    let s = world.schema.clone();
    world
        .exec(&format!(
            "INSERT INTO {s}.expected_messages (process_id, message_type, timeout_at, exchange, \
             routing_key) VALUES ('stolen', 'T', now(), '', '{q}'), \
             ('mine', 'T', now(), '{allowed}', 'k')",
            q = private.queue
        ))
        .await;
    let node = Proc::spawn(&world).await;
    wait_for(PATIENCE, "the allowed TimeOut", || inbox.len() == 1).await;
    wait_for_async(PATIENCE, "the other row held", || async {
        world
            .count("retry_at = 'infinity' AND last_error LIKE '%never receives TimeOuts%'")
            .await
            == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        private.len(),
        0,
        "nothing reached the queue by the default exchange"
    );
    let written_by: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT written_by FROM {s}.api_rules"
    )))
    .fetch_one(&world.pool)
    .await
    .expect("api_rules");
    assert!(
        written_by.is_some_and(|w| w.starts_with("node ") || w == "test"),
        "the door's rules come from the settings"
    );
    drop(node);
    world.cleanup().await;
}

/// A seeded mix of outbox messages with header counts and sizes around the SQL door's
/// bounds (and, as AMQP, around `frame_max`): each is refused at the call (54000) or
/// delivered exactly once; nothing is held, and the node never reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mix_of_header_sizes_through_sql_is_refused_at_the_call_or_delivered_once() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    let mut world = World::new().await;
    let target = format!("t.mix.{}", world.group);
    world.overrides.push((
        "TIMEOUTD__DELAY__TARGET_EXCHANGE".to_owned(),
        target.clone(),
    ));
    world.migrate().await;
    let inbox = Inbox::on_exchange(&target, "#").await;
    let node = Proc::spawn(&world).await;
    let s = world.schema.clone();
    let tag = &Uuid::new_v4().simple().to_string()[..8];
    let name = format!("td_mix_{tag}");
    let pm = principal(&world, &name).await;
    let seed = std::env::var("SQL_MIX_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("SQL_MIX_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut sent, mut refused) = (Vec::new(), 0);
    for i in 0..40 {
        let count: u32 = rng.random_range(0..=320);
        let size: u32 = match rng.random_range(0..3) {
            0 => rng.random_range(0..=16),
            1 => rng.random_range(100..=600),
            _ => rng.random_range(1_000..=4_000),
        };
        let call = format!(
            "{s}.publish_at_commit('{target}', 'k', 'x'::bytea, \
             jsonb_build_object('headers', coalesce((SELECT jsonb_object_agg('h' || n, \
             repeat('v', {size})) FROM generate_series(1, {count}) AS n), '{{}}')), 'mix-{i}')"
        );
        match answer(&pm, &call).await {
            Ok(id) => sent.push(id),
            Err(code) => {
                assert_eq!(
                    code, "54000",
                    "message {i}: {count} headers of {size} bytes"
                );
                refused += 1;
            }
        }
    }
    eprintln!("{} admitted, {refused} refused", sent.len());
    wait_for(PATIENCE, "every admitted message delivered", || {
        inbox.len() >= sent.len()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let counts = inbox.counts();
    for id in &sent {
        assert_eq!(counts.get(id), Some(&1), "{id} delivered once");
    }
    assert_eq!(inbox.len(), sent.len(), "nothing else delivered");
    assert_eq!(world.count("true").await, 0);
    let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.delayed_messages"
    )))
    .fetch_one(&world.pool)
    .await
    .expect("left");
    assert_eq!(left, 0, "nothing held");
    assert!(
        !node.logged("reconnected to RabbitMQ"),
        "the node's connection stayed up"
    );
    pm.close().await;
    drop(node);
    world.cleanup().await;
    drop_roles(&[&name]).await;
}

/// A role of the API role's name that can log in is never granted the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_login_role_of_the_api_name_is_refused() {
    let world = World::new().await;
    let api = format!("{}_api", world.schema);
    world.exec(&format!("CREATE ROLE {api} LOGIN")).await;
    let store = timeoutd::store::Store::connect(&world.settings().postgres).expect("store");
    let e = store.migrate().await.expect_err("refused");
    assert!(format!("{e:?}").contains("more than a group role"), "{e:?}");
    store.close().await;
    world.cleanup().await;
}

async fn drop_roles(roles: &[&str]) {
    let admin = PgPool::connect(&pg_url()).await.expect("pg");
    for role in roles {
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP OWNED BY {role}; DROP ROLE IF EXISTS {role}"
        )))
        .execute(&admin)
        .await;
    }
    admin.close().await;
}
