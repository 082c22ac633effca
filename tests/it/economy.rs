//! Connection economy, judged from Postgres's side (`pg_stat_activity`): a passive node
//! holds at most one connection, the active one what its role needs, and a passive one
//! that takes over fires at once (docs/operating/capacity.md, "Connections per role").

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::Connection;
use timeoutd::client::Expectation;
use uuid::Uuid;

use crate::common::{
    Inbox, Observer, PATIENCE, Proc, World, lowest_active, wait_for, wait_for_async,
};

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
    if World::through_pooler() {
        eprintln!("SKIPPED through a pooler: it counts each node's sessions on the server");
        return;
    }
    let world = World::new().await;
    world.migrate().await;
    let settings = world.settings();
    let observer = Observer::new(&world.group).await;
    let inbox = Inbox::new().await;
    let since = Instant::now();
    let mut procs = Proc::group(&world, 3).await;
    let i = lowest_active(&observer, &procs, since).await;
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
    observer
        .await_first_after(killed_at, "another node active", |a| {
            a.active && a.node_id != dead.node_id
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

/// `n` rows due from 0.5 s on, 10 ms apart: each received once, none early, every one
/// fired by `sender`.
async fn fire_once_from(world: &World, inbox: &Inbox, prefix: &str, n: u64, sender: Uuid) {
    let mut due = Vec::new();
    for k in 0..n {
        let e = Expectation::new(&format!("{prefix}-{k}"), "Reply", &inbox.queue)
            .due_in(Duration::from_millis(500 + 10 * k));
        due.push(world.expect(&e).await);
    }
    wait_for(PATIENCE, "every row fired", || {
        inbox.counts().len() >= due.len()
    })
    .await;
    // Anything fired twice would still be on its way.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let counts = inbox.counts();
    for id in &due {
        assert_eq!(counts.get(&id.to_string()), Some(&1), "{id} once");
    }
    for r in inbox.all() {
        let deadline: DateTime<Utc> = r.body["timeout_at"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("timeout_at");
        assert!(r.fired_at() >= deadline, "early: {}", r.body);
        assert_eq!(r.sender(), Some(sender.to_string()));
    }
}

/// A throwaway PgBouncer (the binary `TIMEOUTD_TEST_PGBOUNCER` names, else `pgbouncer` on
/// the PATH) in front of the test database, its ini in a temporary directory: database
/// `direct` passes the session settings on as they come (none: `options` is ignored),
/// `session` sets them for the schema with `connect_query`, as docs/operating/pgbouncer.md
/// says. `None` when there is no such binary.
struct Bouncer {
    child: std::process::Child,
    port: u16,
    dir: std::path::PathBuf,
}

impl Bouncer {
    fn start(world: &World) -> Option<Self> {
        let bin = std::env::var("TIMEOUTD_TEST_PGBOUNCER").unwrap_or_else(|_| "pgbouncer".into());
        let found = std::process::Command::new(&bin)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return None;
        }
        let settings = world.settings().postgres;
        let pg = url::Url::parse(&crate::common::pg_url()).expect("pg url");
        let (host, port) = (pg.host_str().expect("host"), pg.port().unwrap_or(5432));
        let user = if pg.username().is_empty() {
            "postgres"
        } else {
            pg.username()
        };
        let db = pg.path().trim_start_matches('/');
        let timeout = settings.statement_timeout.as_millis();
        let connect_query = format!(
            "SET search_path = {}; SET statement_timeout = {timeout}; \
             SET lock_timeout = 1000; SET idle_in_transaction_session_timeout = {timeout}",
            world.schema
        );
        let free = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let listen = free.local_addr().expect("addr").port();
        drop(free);
        let dir = std::env::temp_dir().join(format!("timeoutd-pgbouncer-{}", world.schema));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let ini = format!(
            "[databases]\n\
             direct = host={host} port={port} dbname={db} user={user}\n\
             session = host={host} port={port} dbname={db} user={user} \
             connect_query='{connect_query}'\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n\
             auth_type = any\npool_mode = session\nmax_client_conn = 100\n\
             default_pool_size = 20\nignore_startup_parameters = extra_float_digits, options\n\
             logfile =\npidfile =\n"
        );
        let path = dir.join("pgbouncer.ini");
        std::fs::write(&path, ini).expect("write ini");
        let mut cmd = std::process::Command::new(&bin);
        // PgBouncer refuses to run as root.
        if std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").expect("/proc"))
            == 0
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
            cmd.args(["-u", "nobody"]);
        }
        let child = cmd
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("log")).expect("log file"))
            .spawn()
            .expect("spawn pgbouncer");
        Some(Self {
            child,
            port: listen,
            dir,
        })
    }

    /// What it logged, for failures.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Through PgBouncer in session mode (docs/operating/pgbouncer.md): a migration through
/// a database entry that drops the session settings is refused and writes nothing; with
/// the settings set by `connect_query`, a group of two fires every row once, none early,
/// and the passive node holds one connection through the pooler too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_in_session_mode() {
    let world = World::new().await;
    let Some(bouncer) = Bouncer::start(&world) else {
        eprintln!(
            "SKIPPED: no pgbouncer binary (install Debian's `pgbouncer`, or set \
             TIMEOUTD_TEST_PGBOUNCER to one)"
        );
        world.cleanup().await;
        return;
    };
    let deadline = Instant::now() + PATIENCE;
    while sqlx::PgConnection::connect(&bouncer.url("direct"))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "pgbouncer does not answer: {}",
            bouncer.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let migrate = |url: String| {
        std::process::Command::new(env!("CARGO_BIN_EXE_timeoutd"))
            .arg("migrate")
            .envs(world.env_with(&[("TIMEOUTD__POSTGRES__URL".to_owned(), url)]))
            .output()
            .expect("timeoutd migrate")
    };
    let refused = migrate(bouncer.url("direct"));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(said.contains("search_path"), "{said}");
    let created: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = $1")
        .bind(&world.schema)
        .fetch_one(&world.pool)
        .await
        .expect("schema count");
    assert_eq!(created, 0, "nothing written through the dropped settings");

    let url = bouncer.url("session");
    let extra = [("TIMEOUTD__POSTGRES__URL".to_owned(), url)];
    world.exec(&format!("CREATE SCHEMA {}", world.schema)).await;
    let observer = Observer::new(&world.group).await;
    let inbox = Inbox::new().await;
    let since = Instant::now();
    let procs = vec![
        Proc::spawn_with(&world, &extra).await,
        Proc::spawn_with(&world, &extra).await,
    ];
    let i = lowest_active(&observer, &procs, since).await;
    let passive = procs[1 - i].node_id;
    fire_once_from(&world, &inbox, "bounced", 20, procs[i].node_id).await;
    wait_for_async(
        PATIENCE,
        "the passive node down to one connection",
        || async { connections(&world, &[passive]).await[&passive] <= 1 },
    )
    .await;
    drop(procs);
    drop(bouncer);
    world.cleanup().await;
}

/// A database of the test services' PgBouncer in transaction mode
/// (`TIMEOUTD_TEST_PGBOUNCER_URL`, by default theirs: tests/services.yml), in front of the
/// Postgres of `TIMEOUTD_TEST_PG_URL`. `None` when the variable is set empty (CI's main
/// stage: the machine's own services have no such pooler).
fn pooler(database: &str) -> Option<String> {
    let base = std::env::var("TIMEOUTD_TEST_PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:24433".to_owned());
    (!base.trim().is_empty()).then(|| format!("{}/{database}", base.trim_end_matches('/')))
}

/// Through PgBouncer in transaction mode with `postgres.session_url` naming the server
/// itself (docs/operating/pgbouncer.md): a pooler database whose server does not bound
/// the sessions is refused with what to set; through one that does, a group of two fires
/// every row once, none early, from the active node, whose `LISTEN` session is the
/// direct one (through the pooler it would hear nothing reliably).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_in_transaction_mode() {
    let (Some(pooled), Some(unbounded)) = (pooler("pooled"), pooler("unbounded")) else {
        eprintln!("SKIPPED: TIMEOUTD_TEST_PGBOUNCER_URL is empty (no transaction pooler)");
        return;
    };
    let world = World::new().await;
    // The migrations' advisory lock needs a session: through session_url, the server.
    world.migrate().await;
    let direct = crate::common::pg_url();
    let through = |url: &str| {
        [
            ("TIMEOUTD__POSTGRES__URL".to_owned(), url.to_owned()),
            ("TIMEOUTD__POSTGRES__SESSION_URL".to_owned(), direct.clone()),
        ]
    };
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_timeoutd"))
        .arg("pending")
        .envs(world.env())
        .envs(through(&unbounded))
        .output()
        .expect("timeoutd pending");
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(
        said.contains("statement_timeout and idle_in_transaction_session_timeout are 0"),
        "{said}"
    );

    let extra = through(&pooled);
    let observer = Observer::new(&world.group).await;
    let inbox = Inbox::new().await;
    let since = Instant::now();
    let procs = vec![
        Proc::spawn_with(&world, &extra).await,
        Proc::spawn_with(&world, &extra).await,
    ];
    let i = lowest_active(&observer, &procs, since).await;
    fire_once_from(&world, &inbox, "pooled", 200, procs[i].node_id).await;
    // The LISTEN session comes from where this test's own direct connection comes
    // from, not from the pooler.
    let listening: Vec<(bool,)> = sqlx::query_as(
        "SELECT client_addr IS NOT DISTINCT FROM inet_client_addr() FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE 'LISTEN %'",
    )
    .bind(format!("timeoutd-{}", procs[i].node_id))
    .fetch_all(&world.pool)
    .await
    .expect("pg_stat_activity");
    assert_eq!(listening, vec![(true,)], "one direct LISTEN session");
    drop(procs);
    world.cleanup().await;
}
