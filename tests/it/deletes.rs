//! How the firing transaction deletes what it fired: by itself when nothing can refuse a
//! delete, in savepoints (each refusal alone) when something can.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use chrono::Utc;
use timeoutd::client::Expectation;
use timeoutd::election::Role;
use timeoutd::store::{Confirmed, Deletes, DueRow, Kind, Store, Window};
use uuid::Uuid;

use crate::common::{Inbox, PATIENCE, World, wait_for, wait_for_async};

async fn deletes(store: &Store, kind: Kind) -> Deletes {
    let (tx, deletes) = store.begin_batch(kind).await.expect("begin batch");
    tx.rollback().await.expect("rollback");
    deletes
}

/// Whatever the process manager adds that could refuse a delete of a held row makes the
/// batch delete in savepoints; a table with none of it is deleted from directly, and a
/// trigger that does not fire on DELETE changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_deletes_in_savepoints_only_where_something_can_refuse() {
    let world = World::new().await;
    world.migrate().await;
    let store = Store::connect(&world.settings().postgres).expect("store");
    let s = &world.schema;
    let t = format!("{s}.expected_messages");
    world
        .exec(&format!(
            "CREATE FUNCTION {s}.refuse() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'refused'; END $$"
        ))
        .await;
    // (what the process manager adds, what removes it again, how a batch must delete)
    let cases = [
        (
            format!("CREATE TABLE {s}.pm (exp uuid REFERENCES {t}(id))"),
            format!("DROP TABLE {s}.pm"),
            Deletes::Guarded,
        ),
        (
            format!(
                "CREATE TRIGGER r BEFORE DELETE ON {t} FOR EACH ROW EXECUTE FUNCTION {s}.refuse()"
            ),
            format!("DROP TRIGGER r ON {t}"),
            Deletes::Guarded,
        ),
        (
            format!(
                "CREATE TRIGGER r AFTER DELETE ON {t} FOR EACH STATEMENT \
                 EXECUTE FUNCTION {s}.refuse()"
            ),
            format!("DROP TRIGGER r ON {t}"),
            Deletes::Guarded,
        ),
        (
            format!(
                "CREATE TRIGGER r BEFORE DELETE ON {t} FOR EACH ROW EXECUTE FUNCTION {s}.refuse(); \
                 ALTER TABLE {t} DISABLE TRIGGER r"
            ),
            format!("DROP TRIGGER r ON {t}"),
            Deletes::Direct,
        ),
        (
            format!(
                "CREATE TRIGGER r BEFORE INSERT ON {t} FOR EACH ROW EXECUTE FUNCTION {s}.refuse()"
            ),
            format!("DROP TRIGGER r ON {t}"),
            Deletes::Direct,
        ),
        (
            format!("CREATE RULE r AS ON DELETE TO {t} DO ALSO NOTHING"),
            format!("DROP RULE r ON {t}"),
            Deletes::Guarded,
        ),
        (
            format!("ALTER TABLE {t} ENABLE ROW LEVEL SECURITY"),
            format!("ALTER TABLE {t} DISABLE ROW LEVEL SECURITY"),
            Deletes::Guarded,
        ),
        (
            format!("CREATE TABLE {s}.child () INHERITS ({t})"),
            format!("DROP TABLE {s}.child"),
            Deletes::Guarded,
        ),
    ];
    assert_eq!(deletes(&store, Kind::Expectation).await, Deletes::Direct);
    assert_eq!(deletes(&store, Kind::Delayed).await, Deletes::Direct);
    for (add, remove, want) in cases {
        for step in add.split("; ") {
            world.exec(step).await;
        }
        assert_eq!(
            deletes(&store, Kind::Expectation).await,
            want,
            "after {add}"
        );
        world.exec(&remove).await;
        assert_eq!(
            deletes(&store, Kind::Expectation).await,
            Deletes::Direct,
            "after {remove}"
        );
    }
    let d = format!("{s}.delayed_messages");
    world
        .exec(&format!(
            "CREATE TRIGGER r BEFORE DELETE ON {d} FOR EACH ROW EXECUTE FUNCTION {s}.refuse()"
        ))
        .await;
    assert_eq!(deletes(&store, Kind::Delayed).await, Deletes::Guarded);
    assert_eq!(deletes(&store, Kind::Expectation).await, Deletes::Direct);
    store.close().await;
    world.cleanup().await;
}

/// A trigger of the process manager refuses to let some rows go: their TimeOuts were
/// confirmed, so they are parked, alone; every other row of the same batches is deleted;
/// each TimeOut arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_a_trigger_refuses_to_delete_are_parked_alone() {
    let world = World::new().await;
    world.migrate().await;
    let s = &world.schema;
    world
        .exec(&format!(
            "CREATE FUNCTION {s}.keep() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF OLD.process_id LIKE 'keep-%' THEN RAISE EXCEPTION 'still needed'; \
             END IF; RETURN OLD; END $$"
        ))
        .await;
    world
        .exec(&format!(
            "CREATE TRIGGER keep BEFORE DELETE ON {s}.expected_messages FOR EACH ROW \
             EXECUTE FUNCTION {s}.keep()"
        ))
        .await;
    let inbox = Inbox::new().await;
    let node = world.start().await;
    wait_for(PATIENCE, "node active", || {
        *node.role.borrow() == Role::Active
    })
    .await;
    let due_at = Utc::now() + chrono::Duration::milliseconds(1000);
    let mut ids = HashSet::new();
    for i in 0..300 {
        // Every tenth row, at random places in the batches.
        let process = if i % 10 == 3 {
            format!("keep-{i}")
        } else {
            format!("go-{i}")
        };
        let e = Expectation::new(&process, "Paid", &inbox.queue).due_at(due_at);
        ids.insert(world.expect(&e).await.to_string());
    }
    wait_for(PATIENCE, "300 TimeOuts", || inbox.len() >= 300).await;
    wait_for_async(PATIENCE, "settled", || async {
        world.count("retry_at IS DISTINCT FROM 'infinity'").await == 0
    })
    .await;
    assert_eq!(world.count("process_id LIKE 'keep-%'").await, 30);
    assert_eq!(world.count("true").await, 30, "every other row deleted");
    // Parked rows never fire again.
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let counts = inbox.counts();
    assert_eq!(counts.keys().cloned().collect::<HashSet<_>>(), ids);
    assert!(counts.values().all(|n| *n == 1), "each exactly once");
    node.stop().await;
    world.cleanup().await;
}

/// Rows fired from a table nothing guards are deleted by the transaction that locked
/// them, not by a subtransaction: their deleter is a plain transaction id, never a
/// MultiXact. (A row deleted under a MultiXact keeps its index entry alive until vacuum,
/// and every later scan of the due index walks it again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fired_rows_are_deleted_by_the_transaction_that_locked_them() {
    const XMAX_IS_MULTI: i32 = 0x1000;
    let world = World::new().await;
    world.migrate().await;
    world
        .exec("CREATE EXTENSION IF NOT EXISTS pageinspect")
        .await;
    let inbox = Inbox::new().await;
    let node = world.start().await;
    wait_for(PATIENCE, "node active", || {
        *node.role.borrow() == Role::Active
    })
    .await;
    // Few enough for one page that is not full: Postgres does not prune it on its own,
    // so the deleted tuples stay to be read.
    let due_at = Utc::now() + chrono::Duration::milliseconds(500);
    for i in 0..20 {
        let e = Expectation::new(&format!("p-{i}"), "Paid", &inbox.queue).due_at(due_at);
        world.expect(&e).await;
    }
    wait_for(PATIENCE, "20 TimeOuts", || inbox.len() >= 20).await;
    wait_for_async(PATIENCE, "rows deleted", || async {
        world.count("true").await == 0
    })
    .await;
    let sql = format!(
        "SELECT t_infomask FROM heap_page_items(get_raw_page('{}.expected_messages', 0)) \
         WHERE t_xmax <> '0'",
        world.schema
    );
    let masks: Vec<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(&world.pool)
        .await
        .expect("page items");
    assert_eq!(masks.len(), 20, "the deleted tuples are on the page");
    for mask in masks {
        assert_eq!(
            mask & XMAX_IS_MULTI,
            0,
            "a row was deleted under a MultiXact (infomask {mask:#x})"
        );
    }
    node.stop().await;
    world.cleanup().await;
}

/// A batch deletes what it locked by where each row lies (its `ctid`, read by the lock
/// statement), neither looking them up in the primary key nor passing over the table:
/// among 24,000 rows not due, the transaction's own counts of index and sequential scans
/// on the table do not move. Where a place holds no row, the rows are deleted by id
/// instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_rows_are_deleted_where_they_lie_else_by_id() {
    let world = World::new().await;
    world.migrate().await;
    let store = Store::connect(&world.settings().postgres).expect("store");
    let due_at = Utc::now() - chrono::Duration::seconds(1);
    for i in 0..6 {
        world
            .expect(&Expectation::new(&format!("p-{i}"), "Paid", "nowhere").due_at(due_at))
            .await;
    }
    // On a table of six rows a pass over it is as cheap as going to each place, and the
    // planner may take either; among thousands only the places are cheap.
    let table = format!("{}.expected_messages", world.schema);
    world
        .exec(&format!(
            "INSERT INTO {table} SELECT (json_populate_record(m, json_build_object(\
             'id', gen_random_uuid(), 'timeout_at', now() + interval '1 hour'))).* \
             FROM {table} m, generate_series(1, 4000)"
        ))
        .await;
    world.exec(&format!("ANALYZE {table}")).await;
    let due = "timeout_at <= now()";
    assert_eq!(world.count("true").await - world.count(due).await, 24_000);
    let window = Window {
        horizon: Duration::ZERO,
        fresh: None,
        from: None,
    };
    let scans = format!(
        "SELECT idx_scan, seq_scan FROM pg_stat_xact_user_tables \
         WHERE relid = '{table}'::regclass"
    );
    let scans_now = async |tx: &mut sqlx::PgConnection| -> (i64, i64) {
        sqlx::query_as(sqlx::AssertSqlSafe(scans.clone()))
            .fetch_one(tx)
            .await
            .expect("scans")
    };
    let lock = async || {
        let (mut tx, deletes) = store
            .begin_batch(Kind::Expectation)
            .await
            .expect("begin batch");
        assert_eq!(deletes, Deletes::Direct);
        let rows: Vec<DueRow> = store
            .lock_due(&mut tx, Kind::Expectation, 3, 64 * 1024, &[], window)
            .await
            .expect("lock");
        assert_eq!(rows.len(), 3);
        (tx, rows)
    };
    let confirmed = |rows: &[DueRow]| -> Vec<(Uuid, String)> {
        rows.iter()
            .map(|r| {
                (
                    r.id,
                    r.tid.clone().expect("the lock statement reads the tid"),
                )
            })
            .collect()
    };
    let settle = async |tx: &mut sqlx::PgConnection, rows: &[(Uuid, String)]| {
        let confirmed: Vec<Confirmed> = rows
            .iter()
            .map(|(id, tid)| Confirmed {
                id: *id,
                tid: Some(tid.as_str()),
            })
            .collect();
        store
            .settle(tx, Kind::Expectation, Deletes::Direct, &confirmed, &[])
            .await
            .expect("settle");
    };

    let (mut tx, rows) = lock().await;
    let before = scans_now(&mut tx).await;
    settle(&mut tx, &confirmed(&rows)).await;
    assert_eq!(
        scans_now(&mut tx).await,
        before,
        "deleted without an index lookup or a pass over the table"
    );
    tx.commit().await.expect("commit");
    assert_eq!(world.count(due).await, 3, "three rows deleted");

    let (mut tx, rows) = lock().await;
    let mut named = confirmed(&rows);
    named[1].1 = "(4294967294,1)".to_owned();
    settle(&mut tx, &named).await;
    tx.commit().await.expect("commit");
    assert_eq!(world.count(due).await, 0, "the rest deleted by id");
    assert_eq!(world.count("true").await, 24_000, "no row that was not due");
    world.cleanup().await;
}

/// A table inheriting from the expectations can appear under a batch's lock (creating it
/// does not wait for the batch), and its rows lie at places of their own, the same
/// places as rows of the table itself. A batch deleting by place would then delete the
/// parent's row that lies where the child's does: the lock statement reads a place only
/// for a row of the table itself, and the rest of the batch goes by id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_of_a_table_that_inherits_is_not_deleted_by_place() {
    let world = World::new().await;
    world.migrate().await;
    let store = Store::connect(&world.settings().postgres).expect("store");
    let (s, due_at) = (&world.schema, Utc::now() - chrono::Duration::seconds(1));
    let t = format!("{s}.expected_messages");
    for i in 0..3 {
        world
            .expect(&Expectation::new(&format!("p-{i}"), "Paid", "nowhere").due_at(due_at))
            .await;
    }
    let (mut tx, deletes) = store
        .begin_batch(Kind::Expectation)
        .await
        .expect("begin batch");
    assert_eq!(deletes, Deletes::Direct, "no child table yet");
    world
        .exec(&format!("CREATE TABLE {s}.child () INHERITS ({t})"))
        .await;
    world
        .exec(&format!(
            "INSERT INTO {s}.child SELECT * FROM ONLY {t} ORDER BY ctid LIMIT 1"
        ))
        .await;
    world
        .exec(&format!("UPDATE {s}.child SET id = gen_random_uuid()"))
        .await;
    let child_id: Uuid =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT id FROM {s}.child")))
            .fetch_one(&world.pool)
            .await
            .expect("child row");
    let window = Window {
        horizon: Duration::ZERO,
        fresh: None,
        from: None,
    };
    let rows: Vec<DueRow> = store
        .lock_due(&mut tx, Kind::Expectation, 10, 64 * 1024, &[], window)
        .await
        .expect("lock");
    assert_eq!(rows.len(), 4, "the child's row is due too");
    let child = rows
        .iter()
        .find(|r| r.id == child_id)
        .expect("child locked");
    assert_eq!(child.tid, None, "no place read for the child's row");
    let place: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT ctid::text FROM {s}.child"
    )))
    .fetch_one(&world.pool)
    .await
    .expect("child's place");
    assert!(
        rows.iter()
            .any(|r| r.tid.as_deref() == Some(place.as_str())),
        "a row of the table itself lies at the child's place {place}"
    );
    let confirmed = [Confirmed {
        id: child_id,
        tid: child.tid.as_deref(),
    }];
    store
        .settle(&mut tx, Kind::Expectation, Deletes::Direct, &confirmed, &[])
        .await
        .expect("settle");
    tx.commit().await.expect("commit");
    let left = async |sql: String| -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&world.pool)
            .await
            .expect("count")
    };
    assert_eq!(
        left(format!("SELECT count(*) FROM {s}.child")).await,
        0,
        "the child's row deleted"
    );
    assert_eq!(
        left(format!("SELECT count(*) FROM ONLY {t}")).await,
        3,
        "no row of the table itself deleted"
    );
    world.cleanup().await;
}
