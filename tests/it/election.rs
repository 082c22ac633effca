use std::time::{Duration, Instant};

use timeoutd::election::Role;

use crate::common::{Observer, World, wait_for};

/// Three nodes started together: within the settle period exactly one is active, the
/// lowest id, and every node agrees on who that is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_elect_the_lowest_within_settle() {
    let world = World::new().await;
    world.migrate().await;
    let observer = Observer::new(&world.group).await;
    let started = Instant::now();
    let nodes = vec![
        world.start().await,
        world.start().await,
        world.start().await,
    ];
    let lowest = nodes.iter().map(|n| n.node_id).min().expect("three");
    let one_active = || {
        let active: Vec<_> = nodes
            .iter()
            .filter(|n| *n.role.borrow() == Role::Active)
            .map(|n| n.node_id)
            .collect();
        active == vec![lowest]
    };
    // Settle is one announce interval (1 s); allow scheduling slack on a busy machine.
    wait_for(Duration::from_secs(3), "one active node", one_active).await;
    let elected_after = started.elapsed();
    wait_for(Duration::from_secs(3), "all settled on the lowest", || {
        nodes.iter().all(|n| {
            let s = n.snapshot();
            s.settled && s.lowest == lowest && s.members.len() == 3
        })
    })
    .await;
    // The claim reaches the observer a moment after the role changed.
    wait_for(
        Duration::from_secs(3),
        "the observer hears the claim",
        || observer.all().iter().any(|s| s.a.active),
    )
    .await;
    // Nobody but the lowest ever claimed to be active.
    let claims: Vec<_> = observer
        .all()
        .into_iter()
        .filter(|s| s.a.active)
        .map(|s| s.a.node_id)
        .collect();
    assert!(
        !claims.is_empty() && claims.iter().all(|id| *id == lowest),
        "{claims:?}"
    );
    println!("three nodes: one active after {elected_after:?}");
    for n in nodes {
        n.stop().await;
    }
    world.cleanup().await;
}
