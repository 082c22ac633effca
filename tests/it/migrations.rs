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

/// A migrating role that may not create roles (a managed database's owner role, say)
/// still migrates: the API role is left out with a notice, and the API's functions are
/// still closed to PUBLIC, so nobody may call them until someone grants it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_not_create_roles_migrates_and_the_api_stays_closed() {
    let world = World::new().await;
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let (owner, stranger) = (format!("td_owner_{tag}"), format!("td_stranger_{tag}"));
    for role in [&owner, &stranger] {
        world
            .exec(&format!("CREATE ROLE {role} LOGIN NOCREATEROLE"))
            .await;
    }
    world
        .exec(&format!(
            "GRANT CREATE ON DATABASE {} TO {owner}",
            database(&pg_url())
        ))
        .await;
    let as_role = |role: &str| {
        let mut url = url::Url::parse(&pg_url()).expect("pg url");
        url.set_username(role).expect("username");
        url.to_string()
    };
    let mut settings = world.settings();
    settings.postgres.url = timeoutd::config::SecretUrl::new(as_role(&owner));
    settings.postgres.session = timeoutd::config::SecretUrl::new(as_role(&owner));
    let store = Store::connect(&settings.postgres).expect("store");
    store.migrate().await.expect("migrates without CREATEROLE");
    store.close().await;
    let api_role: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_roles WHERE rolname = $1")
        .bind(format!("{}_api", world.schema))
        .fetch_one(&world.pool)
        .await
        .expect("pg_roles");
    assert_eq!(api_role, 0, "no role created");
    world
        .exec(&format!(
            "GRANT USAGE ON SCHEMA {} TO {stranger}",
            world.schema
        ))
        .await;
    let pool = sqlx::PgPool::connect(&as_role(&stranger))
        .await
        .expect("stranger");
    let e = sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(format!(
        "SELECT {}.cancel_expectation(gen_random_uuid())",
        world.schema
    )))
    .fetch_one(&pool)
    .await
    .expect_err("EXECUTE is not PUBLIC's");
    assert!(e.to_string().contains("permission denied"), "{e}");
    pool.close().await;
    world.cleanup().await;
    let admin = sqlx::PgPool::connect(&pg_url()).await.expect("pg");
    for sql in [
        format!(
            "REVOKE CREATE ON DATABASE {} FROM {owner}",
            database(&pg_url())
        ),
        format!("DROP ROLE IF EXISTS {owner}, {stranger}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&admin)
            .await
            .expect("clean up roles");
    }
    admin.close().await;
}

/// The database name of a Postgres URL.
fn database(url: &str) -> String {
    let url = url::Url::parse(url).expect("pg url");
    let name = url.path().trim_start_matches('/');
    if name.is_empty() {
        "postgres".to_owned()
    } else {
        name.to_owned()
    }
}
