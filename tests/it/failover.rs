use std::time::{Duration, Instant};

use timeoutd::client::Expectation;

use crate::common::{Inbox, Observer, Proc, World, wait_for};

/// Wait until the lowest node claims the role; returns its index.
async fn active_index(observer: &Observer, procs: &[Proc]) -> usize {
    let lowest = procs.iter().map(|p| p.node_id).min().expect("procs");
    wait_for(Duration::from_secs(10), "lowest node active", || {
        observer
            .first_after(Instant::now() - Duration::from_secs(60), |a| {
                a.active && a.node_id == lowest
            })
            .is_some()
    })
    .await;
    procs
        .iter()
        .position(|p| p.node_id == lowest)
        .expect("lowest")
}

/// kill -9 of the active daemon process: another takes over within member_ttl + tick
/// (plus scheduling slack) and fires what comes due afterwards, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_active_node_is_replaced_and_later_rows_fire() {
    let world = World::new().await;
    world.migrate().await;
    let observer = Observer::new(&world.group).await;
    let inbox = Inbox::new().await;
    let mut procs = Proc::group(&world, 3).await;
    let i = active_index(&observer, &procs).await;
    let dead = procs.remove(i);
    let killed_at = Instant::now();
    dead.signal("KILL");
    let mut took_over = None;
    wait_for(Duration::from_secs(10), "another node active", || {
        took_over = observer.first_after(killed_at, |a| a.active && a.node_id != dead.node_id);
        took_over.is_some()
    })
    .await;
    let took_over = took_over.expect("takeover");
    let gap = took_over.at - killed_at;
    println!("kill -9 of the active node: another active after {gap:?}");
    // Contract: member_ttl (3 s) + one tick (250 ms); 1 s of slack for a loaded CI box.
    assert!(gap <= Duration::from_millis(4250), "takeover took {gap:?}");
    let new_active = took_over.a.node_id;
    let mut ids = Vec::new();
    for n in 0..20 {
        let e = Expectation::new(&format!("after-kill-{n}"), "Reply", &inbox.queue)
            .due_in(Duration::from_millis(300));
        ids.push(world.expect(&e).await);
    }
    wait_for(
        Duration::from_secs(10),
        "rows due after the kill fired",
        || inbox.len() >= 20,
    )
    .await;
    let counts = inbox.counts();
    assert!(ids.iter().all(|id| counts.get(&id.to_string()) == Some(&1)));
    let senders: Vec<String> = inbox.all().iter().filter_map(|r| r.sender()).collect();
    assert_eq!(senders.len(), 20);
    assert!(
        senders.iter().all(|s| *s == new_active.to_string()),
        "{senders:?}"
    );
    drop(procs);
    drop(dead);
    world.cleanup().await;
}

/// SIGTERM of the active daemon process: it announces `leaving`, exits 0, and the next
/// node announces itself active within one tick of that `leaving`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_stop_hands_over_within_a_tick() {
    let world = World::new().await;
    world.migrate().await;
    let observer = Observer::new(&world.group).await;
    let mut procs = Proc::group(&world, 2).await;
    let i = active_index(&observer, &procs).await;
    let mut leaver = procs.remove(i);
    let asked = Instant::now();
    leaver.signal("TERM");
    let status = tokio::time::timeout(Duration::from_secs(15), leaver.child.wait())
        .await
        .expect("exits within the shutdown bound")
        .expect("wait");
    assert!(status.success(), "exit status {status:?}");
    let leaving = observer
        .first_after(asked, |a| a.leaving && a.node_id == leaver.node_id)
        .expect("leaving announced");
    let mut next = None;
    wait_for(Duration::from_secs(5), "successor active", || {
        next = observer.first_after(asked, |a| a.active && a.node_id == procs[0].node_id);
        next.is_some()
    })
    .await;
    let handover = next
        .expect("successor")
        .at
        .saturating_duration_since(leaving.at);
    println!("graceful stop: successor active {handover:?} after the leaving announcement");
    assert!(
        handover <= Duration::from_millis(250),
        "handover took {handover:?}"
    );
    assert!(leaver.logged("stopped"), "logged its stop");
    drop(procs);
    world.cleanup().await;
}
