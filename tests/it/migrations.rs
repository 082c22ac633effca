//! Migrations: a failed attempt leaves no lock behind.

use std::time::Duration;

use timeoutd::store::Store;

use crate::common::*;

/// sqlx's migrator holds a session-level advisory lock while it runs, and an error
/// returns before it is released. A dirty migrations table makes it fail after taking
/// the lock: the store must not keep that session, or the lock stays held as long as
/// the node lives and every other node's migrations wait for it. (Postgres can also
/// grant the lock to a `pg_advisory_lock` that `lock_timeout` cancels at that moment:
/// 100 daemons started together, most of them then waited for minutes; see
/// docs/performance.md, Scale.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_migration_leaves_no_advisory_lock() {
    let world = World::new().await;
    world.migrate().await;
    world
        .exec(&format!(
            "UPDATE {0}._sqlx_migrations SET success = false \
             WHERE version = (SELECT max(version) FROM {0}._sqlx_migrations)",
            world.schema
        ))
        .await;
    let name = format!("it-migrations-{}", world.group);
    let store = Store::connect_as(&world.settings().postgres, &name).expect("store");
    assert!(
        store.migrate().await.is_err(),
        "a dirty migrations table is refused"
    );
    let held = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = $1",
        )
        .bind(&name)
        .fetch_one(&world.pool)
        .await
        .expect("pg_locks")
    };
    wait_for_async(
        Duration::from_secs(5),
        "the failed attempt's session to let go of the migrator's lock",
        || async { held().await == 0 },
    )
    .await;
    store.close().await;
    world.cleanup().await;
}
