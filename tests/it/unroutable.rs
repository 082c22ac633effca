use timeoutd::client::Expectation;
use timeoutd::election::Role;

use crate::common::{Inbox, PATIENCE, World, wait_for, wait_for_async};

/// In one batch: a routable row, one returned as unroutable (default exchange, no such
/// queue), one for an exchange that does not exist. The good one fires; the bad ones
/// stay with attempts and last_error; the node keeps its role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_and_missing_exchange_rows_stay_with_attempts() {
    let world = World::new().await;
    world.migrate().await;
    let tag = &world.group;
    let exchange = format!("x-{tag}");
    let inbox = Inbox::on_exchange(&exchange, "pm.timeouts.#").await;
    let good = Expectation::new("p-good", "Reply", "pm.timeouts.orders").exchange(&exchange);
    let unroutable = Expectation::new("p-unroutable", "Reply", &format!("nowhere-{tag}"));
    let no_exchange =
        Expectation::new("p-noexchange", "Reply", "k").exchange(&format!("missing-{tag}"));
    for e in [&good, &unroutable, &no_exchange] {
        world.expect(e).await;
    }
    let node = world.start().await;
    wait_for(PATIENCE, "good TimeOut", || inbox.len() == 1).await;
    assert_eq!(
        inbox.all()[0]
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string()),
        Some(good.id.to_string())
    );
    wait_for_async(PATIENCE, "failures recorded", || async {
        world
            .count("attempts >= 1 AND last_error IS NOT NULL")
            .await
            == 2
    })
    .await;
    let unroutable_err = last_error(&world, unroutable.id).await;
    assert!(unroutable_err.contains("NO_ROUTE"), "{unroutable_err}");
    let missing_err = last_error(&world, no_exchange.id).await;
    assert!(missing_err.contains("does not exist"), "{missing_err}");
    assert_eq!(
        world
            .count("id = '{}'".replace("{}", &good.id.to_string()).as_str())
            .await,
        0
    );
    assert_eq!(*node.role.borrow(), Role::Active, "still active, no crash");
    // Backed off, not retried in a hot loop: after the first failure, retry_at is ahead.
    assert_eq!(
        world.count("attempts >= 1 AND retry_at > timeout_at").await,
        2
    );
    node.stop().await;
    world.cleanup().await;
}

async fn last_error(world: &World, id: uuid::Uuid) -> String {
    let sql = format!(
        "SELECT last_error FROM {}.expected_messages WHERE id = $1",
        world.schema
    );
    sqlx::query_scalar::<_, Option<String>>(sqlx::AssertSqlSafe(sql))
        .bind(id)
        .fetch_one(&world.pool)
        .await
        .expect("row still there")
        .unwrap_or_default()
}
