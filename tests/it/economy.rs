//! Connection economy, judged from Postgres's side (`pg_stat_activity`): a passive node
//! holds at most one connection, the active one what its role needs, and a passive one
//! that takes over fires at once (docs/operating/capacity.md, "Connections per role").

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use timeoutd::client::Expectation;
use uuid::Uuid;

use crate::common::{Inbox, Observer, PATIENCE, Proc, World, wait_for, wait_for_async};

/// The connections each of `nodes` holds now: every session named after it (its pool
/// `timeoutd-<id>`, the observer `timeoutd-<id>-observe`), in any state.
async fn connections(world: &World, nodes: &[Uuid]) -> HashMap<Uuid, i64> {
    let names: Vec<String> = nodes.iter().map(|n| format!("timeoutd-{n}")).collect();
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT n, (SELECT count(*) FROM pg_stat_activity a \
                    WHERE a.application_name = n OR a.application_name = n || '-observe') \
         FROM unnest($1::text[]) n",
    )
    .bind(&names)
    .fetch_all(&world.pool)
    .await
    .expect("pg_stat_activity");
    nodes
        .iter()
        .map(|n| {
            let name = format!("timeoutd-{n}");
            let held = rows.iter().find(|(m, _)| *m == name).map_or(0, |(_, c)| *c);
            (*n, held)
        })
        .collect()
}

/// Wait until the lowest of `procs` claims the role; returns its index.
async fn active_index(observer: &Observer, procs: &[Proc], since: Instant) -> usize {
    let lowest = procs.iter().map(|p| p.node_id).min().expect("procs");
    wait_for(PATIENCE, "lowest node active", || {
        observer
            .first_after(since, |a| a.active && a.node_id == lowest)
            .is_some()
    })
    .await;
    procs
        .iter()
        .position(|p| p.node_id == lowest)
        .expect("lowest")
}

/// Sample every node's connections `times` times, `every` apart; panics on a passive
/// node holding more than one or the active one more than `active_most`. Returns the
/// most each held.
async fn sample(
    world: &World,
    nodes: &[Uuid],
    active: Uuid,
    active_most: i64,
    times: usize,
) -> HashMap<Uuid, i64> {
    let mut most: HashMap<Uuid, i64> = HashMap::new();
    for _ in 0..times {
        for (node, held) in connections(world, nodes).await {
            let bound = if node == active { active_most } else { 1 };
            assert!(
                held <= bound,
                "node {node} ({}) holds {held} connections (at most {bound})",
                if node == active { "active" } else { "passive" }
            );
            let m = most.entry(node).or_default();
            *m = (*m).max(held);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    most
}

/// Three daemons with the default settings: once settled, each passive node holds at
/// most one connection, sampled for a while, and the active one no more than its pool
/// and its observer; idle, the active node drops what its batches opened and keeps its
/// LISTEN, one connection per kind for the probes, and its observer. After a kill -9 of
/// the active node a passive one takes over and fires every row, each once, none before
/// its deadline, and the remaining passive node still holds one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_nodes_hold_one_connection_and_take_over() {
    let world = World::new().await;
    world.migrate().await;
    let settings = world.settings();
    let observer = Observer::new(&world.group).await;
    let inbox = Inbox::new().await;
    let since = Instant::now();
    let mut procs = Proc::group(&world, 3).await;
    let i = active_index(&observer, &procs, since).await;
    let nodes: Vec<Uuid> = procs.iter().map(|p| p.node_id).collect();
    let active = procs[i].node_id;
    let passive: Vec<Uuid> = nodes.iter().copied().filter(|n| *n != active).collect();
    wait_for_async(PATIENCE, "passive nodes down to one connection", || async {
        let held = connections(&world, &passive).await;
        held.values().all(|c| *c <= 1)
    })
    .await;
    // The pool's bound and the observer: what the active node may ever hold.
    let active_most = i64::from(settings.postgres.max_connections) + 1;
    let most = sample(&world, &nodes, active, active_most, 20).await;
    println!("settled, most held per node over 5 s: {most:?} (active {active})");
    // Idle: LISTEN, a probe connection per kind (2 with delayed messages), the observer.
    let idle_most = 2 + 2;
    wait_for_async(PATIENCE, "the idle active node trimmed", || async {
        connections(&world, &[active]).await[&active] <= idle_most
    })
    .await;
    let most = sample(&world, &nodes, active, idle_most, 12).await;
    println!("idle, most held per node over 3 s: {most:?}");

    // Rows due soon after the kill, and rows inserted after it.
    let mut due = HashMap::new();
    for n in 0..20 {
        let e = Expectation::new(&format!("before-kill-{n}"), "Reply", &inbox.queue)
            .due_in(Duration::from_secs(2));
        due.insert(world.expect(&e).await, ());
    }
    let dead = procs.remove(i);
    let killed_at = Instant::now();
    dead.signal("KILL");
    wait_for(PATIENCE, "another node active", || {
        observer
            .first_after(killed_at, |a| a.active && a.node_id != dead.node_id)
            .is_some()
    })
    .await;
    for n in 0..20 {
        let e = Expectation::new(&format!("after-kill-{n}"), "Reply", &inbox.queue)
            .due_in(Duration::from_millis(300));
        due.insert(world.expect(&e).await, ());
    }
    wait_for(PATIENCE, "every row fired", || {
        inbox.counts().len() >= due.len()
    })
    .await;
    // A duplicate would show within a tick or two.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let counts = inbox.counts();
    for id in due.keys() {
        assert_eq!(counts.get(&id.to_string()), Some(&1), "{id} once");
    }
    for r in inbox.all() {
        let deadline: DateTime<Utc> = r.body["timeout_at"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("timeout_at");
        assert!(r.fired_at() >= deadline, "early: {}", r.body);
    }
    assert_eq!(world.count("true").await, 0, "every row fired");

    // The new active node and the one passive node left.
    let new_active = procs.iter().map(|p| p.node_id).min().expect("procs");
    let left: Vec<Uuid> = procs.iter().map(|p| p.node_id).collect();
    let passive: Vec<Uuid> = left.iter().copied().filter(|n| *n != new_active).collect();
    wait_for_async(
        PATIENCE,
        "the passive node down to one connection",
        || async {
            connections(&world, &passive)
                .await
                .values()
                .all(|c| *c <= 1)
        },
    )
    .await;
    let most = sample(&world, &left, new_active, active_most, 12).await;
    println!("after the takeover, most held per node over 3 s: {most:?}");
    drop(procs);
    drop(dead);
    world.cleanup().await;
}
