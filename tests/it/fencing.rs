//! No row waits for a node that is gone. The active node is frozen (SIGSTOP), cut off
//! from RabbitMQ, or cut off from Postgres for far longer than `member_ttl`, while rows
//! come due steadily; it holds some of them locked (ahead of their deadline: a wide
//! `scan.horizon`), and `idle_in_transaction_session_timeout` is long enough not to
//! rescue them. The successor must end its sessions and fire those rows too.
//!
//! Judged per row from the outside: none lost, none early, and every row's first
//! TimeOut no later than `member_ttl` + `scan.probe_interval` + slack after its deadline
//! (the fault lasts three times that). Duplicates are allowed only as the contract's
//! "cannot know": rows the frozen node had published but not deleted.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use timeoutd::client::{self, Expectation};

use crate::common::{Inbox, Observer, Proc, World, amqp_addr, pg_addr, wait_for, wait_for_async};
use crate::proxy::{Mode, Proxy};

const MEMBER_TTL: Duration = Duration::from_secs(3);
/// How long each fault lasts: far beyond the bound, so a row that waited for the node
/// cannot pass.
const FAULT: Duration = Duration::from_secs(15);
/// member_ttl + probe_interval (1 s) + a tick, and 2 s of slack for a loaded machine.
const LATEST: Duration = Duration::from_millis(3000 + 1000 + 250 + 2000);

#[derive(Clone, Copy)]
enum Fault {
    Freeze,
    CutFromRabbitmq,
    CutFromPostgres,
}

/// Two daemons, each behind proxies of its own (so either can be cut off alone).
struct Pair {
    world: World,
    procs: Vec<Proc>,
    proxies: Vec<(Proxy, Proxy)>,
}

async fn pair() -> Pair {
    let mut world = World::new().await;
    world.overrides.extend(
        [
            // Rows are locked up to 1 s ahead: at any instant the active node holds some.
            ("TIMEOUTD__SCAN__HORIZON", "1s"),
            // Long enough that the server's own timeout cannot be what frees the rows.
            ("TIMEOUTD__POSTGRES__STATEMENT_TIMEOUT", "60s"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    world.migrate().await;
    let mut procs = Vec::new();
    let mut proxies = Vec::new();
    for _ in 0..2 {
        let amqp = Proxy::start(amqp_addr().parse().expect("addr")).await;
        let pg = Proxy::start(pg_addr().parse().expect("addr")).await;
        let urls = urls(amqp.addr, pg.addr);
        procs.push(Proc::spawn_with(&world, &urls).await);
        proxies.push((amqp, pg));
    }
    Pair {
        world,
        procs,
        proxies,
    }
}

fn urls(amqp: SocketAddr, pg: SocketAddr) -> Vec<(String, String)> {
    let pg_url = url::Url::parse(&crate::common::pg_url()).expect("pg url");
    let mut pg_via = pg_url.clone();
    pg_via.set_host(Some(&pg.ip().to_string())).expect("host");
    pg_via.set_port(Some(pg.port())).expect("port");
    vec![
        (
            "TIMEOUTD__AMQP__URL".to_owned(),
            format!("amqp://guest:guest@{amqp}/%2f"),
        ),
        ("TIMEOUTD__POSTGRES__URL".to_owned(), pg_via.to_string()),
    ]
}

async fn run(name: &str, fault: Fault) {
    let mut p = pair().await;
    let observer = Observer::new(&p.world.group).await;
    let lowest = p.procs.iter().map(|x| x.node_id).min().expect("two");
    wait_for(Duration::from_secs(120), "the lowest node active", || {
        observer
            .first_after(Instant::now() - Duration::from_secs(600), |a| {
                a.active && a.node_id == lowest
            })
            .is_some()
    })
    .await;
    let i = p
        .procs
        .iter()
        .position(|x| x.node_id == lowest)
        .expect("lowest");
    let inbox = Inbox::new().await;
    // 40 rows a second for 24 s, from 2 s on: before, during and after the fault.
    let mut deadlines: HashMap<String, DateTime<Utc>> = HashMap::new();
    let start = Utc::now() + chrono::Duration::seconds(2);
    let mut tx = p.world.pool.begin().await.expect("tx");
    for n in 0..960 {
        let due = start + chrono::Duration::milliseconds(n * 25);
        let e = Expectation::new(&format!("{name}-{n}"), "Reply", &inbox.queue).due_at(due);
        client::expect(&mut tx, &p.world.schema, &e)
            .await
            .expect("insert");
        deadlines.insert(e.id.to_string(), due);
    }
    tx.commit().await.expect("commit");
    wait_for(Duration::from_secs(120), "TimeOuts flowing", || {
        inbox.len() >= 40
    })
    .await;
    let victim = &p.procs[i];
    let (amqp, pg) = &p.proxies[i];
    match fault {
        Fault::Freeze => victim.signal("STOP"),
        Fault::CutFromRabbitmq => amqp.set(Mode::Stall),
        Fault::CutFromPostgres => pg.set(Mode::Stall),
    }
    let fault_at = Utc::now();
    // Midway, what the server holds for each node: the first thing to read when a row
    // waited (a session the fence did not end, or a successor that did not take over).
    tokio::time::sleep(FAULT / 2).await;
    let sessions = sessions(&p).await;
    tokio::time::sleep(FAULT - FAULT / 2).await;
    let healed_at = Utc::now();
    match fault {
        Fault::Freeze => victim.signal("CONT"),
        Fault::CutFromRabbitmq => amqp.set(Mode::Pass),
        Fault::CutFromPostgres => pg.set(Mode::Pass),
    }
    let ids: Vec<String> = deadlines.keys().cloned().collect();
    wait_for(Duration::from_secs(180), "every row received", || {
        let got = inbox.counts();
        ids.iter().all(|id| got.contains_key(id))
    })
    .await;
    wait_for_async(Duration::from_secs(180), "table empty", || async {
        p.world.count("true").await == 0
    })
    .await;
    let mut first: HashMap<String, DateTime<Utc>> = HashMap::new();
    let mut early = 0;
    for r in inbox.all() {
        let id = r.message_id();
        if deadlines.get(&id).is_some_and(|due| r.at < *due) {
            early += 1;
        }
        let at = first.entry(id).or_insert(r.at);
        *at = (*at).min(r.at);
    }
    let mut late: Vec<(Duration, &String)> = deadlines
        .iter()
        .map(|(id, due)| ((first[id] - *due).to_std().unwrap_or_default(), id))
        .collect();
    late.sort();
    let worst = late.last().map(|(d, _)| *d).unwrap_or_default();
    let p99 = late[late.len() * 99 / 100].0;
    let duplicates = inbox.len() - deadlines.len();
    let fenced = p.procs[1 - i].logged("ended the database sessions");
    println!(
        "fence scenario={name} rows={} early={early} duplicates={duplicates} (same message_id) \
         lateness p99={:.2}s max={:.2}s (bound {:.2}s, fault {:.0}s) successor_fenced={fenced}",
        deadlines.len(),
        p99.as_secs_f64(),
        worst.as_secs_f64(),
        LATEST.as_secs_f64(),
        FAULT.as_secs_f64()
    );
    assert_eq!(early, 0);
    if worst > LATEST || std::env::var_os("FENCE_LOGS").is_some() {
        eprintln!(
            "fault from {fault_at} to {healed_at}; victim {}",
            p.procs[i].node_id
        );
        eprintln!("sessions midway: {sessions:#?}");
        for (d, id) in late.iter().rev().take(5) {
            eprintln!("late {d:?}: due {}", deadlines[*id]);
        }
        const EVENTS: [&str; 6] = [
            "role changed",
            "withdrawn",
            "ended the database sessions",
            "cannot end the sessions",
            "lease lost",
            "rejoin",
        ];
        for (k, proc) in p.procs.iter().enumerate() {
            let role = if k == i { "victim" } else { "successor" };
            for line in proc.log.lock().expect("log").iter() {
                if EVENTS.iter().any(|e| line.contains(e)) {
                    eprintln!(
                        "{role} event: {}",
                        line.chars().take(400).collect::<String>()
                    );
                }
            }
        }
        for (k, proc) in p.procs.iter().enumerate() {
            let role = if k == i { "victim" } else { "successor" };
            for line in proc.log.lock().expect("log").iter() {
                if !line.contains("DEBUG") && !line.contains("\"fired\"") {
                    eprintln!("{role}: {line}");
                }
            }
        }
    }
    assert!(
        worst <= LATEST,
        "{name}: a row fired {worst:?} late (bound {LATEST:?}): the rows the departed node \
         held waited for it"
    );
    p.procs.clear();
    drop(p.proxies);
    p.world.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_a_frozen_active_node_fire_within_member_ttl() {
    run("freeze", Fault::Freeze).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_an_active_node_cut_from_rabbitmq_fire_within_member_ttl() {
    run("cut-rabbitmq", Fault::CutFromRabbitmq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_an_active_node_cut_from_postgres_fire_within_member_ttl() {
    run("cut-postgres", Fault::CutFromPostgres).await;
}

/// The daemons' sessions on the server: node, state, and the relation locks held.
async fn sessions(p: &Pair) -> Vec<(String, String, String, Vec<String>)> {
    sqlx::query_as(
        "SELECT a.application_name, coalesce(a.state, ''), coalesce(a.wait_event, ''), \
         coalesce(array_agg(l.mode || ' ' || l.relation::regclass::text) \
           FILTER (WHERE l.relation IS NOT NULL), '{}') \
         FROM pg_stat_activity a LEFT JOIN pg_locks l ON l.pid = a.pid \
           AND l.locktype = 'relation' AND l.granted \
         WHERE a.application_name LIKE 'timeoutd-%' AND a.datname = current_database() \
         GROUP BY a.pid, a.application_name, a.state, a.wait_event ORDER BY 1",
    )
    .fetch_all(&p.world.pool)
    .await
    .unwrap_or_default()
}

/// Keeps `MEMBER_TTL` named where the bound is derived (the daemons run the default).
#[test]
fn the_bound_follows_the_default_member_ttl() {
    let s = timeoutd::config::Settings::load_from(None, Vec::<(String, String)>::new())
        .expect("defaults");
    assert_eq!(s.election.member_ttl, MEMBER_TTL);
}
