//! The Rust client API inside the caller's own transaction, against a running daemon.

use std::time::Duration;

use chrono::Utc;
use timeoutd::client::{self, Expectation};

use crate::common::{Inbox, PATIENCE, World, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_cancel_and_reschedule_inside_a_transaction() {
    let world = World::new().await;
    world.migrate().await;
    let inbox = Inbox::new().await;
    let schema = world.schema.clone();
    let soon = |p: &str| Expectation::new(p, "Reply", &inbox.queue).due_in(Duration::from_secs(2));

    // Rolled back with the caller's transaction: never fires.
    let mut tx = world.pool.begin().await.expect("tx");
    let ghost = client::expect(&mut tx, &schema, &soon("rolled-back"))
        .await
        .expect("expect");
    tx.rollback().await.expect("rollback");

    let mut tx = world.pool.begin().await.expect("tx");
    let cancelled = client::expect(&mut tx, &schema, &soon("cancelled"))
        .await
        .expect("expect");
    let moved = client::expect(&mut tx, &schema, &soon("moved"))
        .await
        .expect("expect");
    let fires = client::expect(&mut tx, &schema, &soon("fires"))
        .await
        .expect("expect");
    tx.commit().await.expect("commit");

    let mut tx = world.pool.begin().await.expect("tx");
    assert!(
        client::cancel(&mut tx, &schema, cancelled)
            .await
            .expect("cancel")
    );
    let later = Utc::now() + chrono::Duration::hours(1);
    assert!(
        client::reschedule(&mut tx, &schema, moved, later)
            .await
            .expect("reschedule")
    );
    assert!(
        !client::cancel(&mut tx, &schema, ghost)
            .await
            .expect("cancel"),
        "never existed"
    );
    tx.commit().await.expect("commit");

    let node = world.start().await;
    wait_for(PATIENCE, "the one TimeOut", || inbox.len() == 1).await;
    let counts = inbox.counts();
    assert_eq!(counts.get(&fires.to_string()), Some(&1));
    // After the TimeOut fired, cancelling and rescheduling report "too late".
    let mut conn = world.pool.acquire().await.expect("conn");
    assert!(
        !client::cancel(&mut conn, &schema, fires)
            .await
            .expect("cancel")
    );
    assert!(
        !client::reschedule(&mut conn, &schema, fires, later)
            .await
            .expect("reschedule")
    );
    assert_eq!(
        world.count(&format!("id = '{moved}'")).await,
        1,
        "moved row waits"
    );
    assert!(
        client::cancel(&mut conn, &schema, moved)
            .await
            .expect("cancel")
    );
    assert!(
        client::cancel(&mut conn, "bad; schema", moved)
            .await
            .is_err()
    );
    // The pool closes in cleanup only once every connection is back.
    drop(conn);
    node.stop().await;
    world.cleanup().await;
}
