//! Several addresses per service (docs/operating/addresses.md): a broker address list
//! with dead members and a failover between live ones; a multi-host `postgres.url` with
//! a dead first host, a first host that dies mid-run, and `target_session_attrs=read-write`
//! against a second, throwaway Postgres cluster that turns read-only mid-run. Judged from
//! outside: every row's TimeOut received once, none early, the tables left empty.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use timeoutd::client::{self, Expectation};

use crate::common::{Inbox, PATIENCE, Proc, World, amqp_addr, pg_addr, wait_for, wait_for_async};
use crate::proxy::{Mode, Proxy};

/// How long a TimeOut published before a fault may take to reach the consumer.
const IN_FLIGHT: chrono::TimeDelta = chrono::TimeDelta::seconds(5);

/// A port on which nothing listens (bound, then released).
async fn closed_port() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    l.local_addr().expect("addr")
}

fn amqp_at(addr: SocketAddr) -> String {
    format!("amqp://guest:guest@{addr}/%2f")
}

/// Rows inserted, by id, with their deadlines.
#[derive(Default)]
struct Rows(HashMap<String, DateTime<Utc>>);

impl Rows {
    /// `n` rows due from 1 s on over `spread`, into `schema` of `pool`.
    async fn insert(
        &mut self,
        pool: &PgPool,
        schema: &str,
        name: &str,
        inbox: &Inbox,
        n: usize,
        spread: Duration,
    ) {
        let start = Utc::now() + chrono::Duration::seconds(1);
        let mut tx = pool.begin().await.expect("tx");
        for i in 0..n {
            let offset = spread.mul_f64(i as f64 / n as f64);
            let due = start + chrono::Duration::from_std(offset).expect("duration");
            let e = Expectation::new(&format!("{name}-{i}"), "Reply", &inbox.queue).due_at(due);
            client::expect(&mut tx, schema, &e).await.expect("insert");
            self.0.insert(e.id.to_string(), due);
        }
        tx.commit().await.expect("commit");
    }

    /// Every row received exactly once, none before its deadline.
    async fn all_fired_once(&self, inbox: &Inbox) {
        assert_eq!(self.all_fired(inbox).await, 0, "duplicates");
    }

    /// Every row received, none before its deadline; a row received twice only if its
    /// first copy came before `fault` (with `IN_FLIGHT` for delivery): a message the node
    /// could not know delivered when its connection was cut (contract section 6), never
    /// one sent afterwards. Returns how many duplicates.
    async fn all_fired_across(&self, inbox: &Inbox, fault: DateTime<Utc>) -> usize {
        let duplicates = self.all_fired(inbox).await;
        let mut first: HashMap<String, DateTime<Utc>> = HashMap::new();
        for r in inbox.all() {
            let at = first.entry(r.message_id()).or_insert(r.at);
            *at = (*at).min(r.at);
        }
        for (id, n) in inbox.counts() {
            if n > 1 && self.0.contains_key(&id) {
                assert!(
                    first[&id] <= fault + IN_FLIGHT,
                    "{id} received {n} times, first at {} after the fault at {fault}",
                    first[&id]
                );
            }
        }
        println!(
            "rows={} lost=0 early=0 duplicates={duplicates} (each sent before the fault)",
            self.0.len()
        );
        duplicates
    }

    /// Every row received, none before its deadline; how many duplicates (same id).
    async fn all_fired(&self, inbox: &Inbox) -> usize {
        wait_for(PATIENCE * 2, "every row received", || {
            let counts = inbox.counts();
            self.0.keys().all(|id| counts.contains_key(id))
        })
        .await;
        // Anything late still in flight would show as a duplicate: let it land.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let counts = inbox.counts();
        let duplicates: usize = self
            .0
            .keys()
            .map(|id| counts.get(id).copied().unwrap_or(0).saturating_sub(1))
            .sum();
        let early = inbox
            .all()
            .iter()
            .filter(|r| {
                let id = r.message_id();
                self.0.get(&id).is_some_and(|due| r.at < *due)
            })
            .count();
        assert_eq!(early, 0, "fired early");
        duplicates
    }
}

async fn empty(pool: &PgPool, schema: &str) {
    let sql = format!("SELECT count(*) FROM {schema}.expected_messages");
    wait_for_async(PATIENCE, "table empty", || async {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
            .fetch_one(pool)
            .await
            .expect("count");
        n == 0
    })
    .await;
}

/// Whether `node` said it uses the Postgres host `host` ("host:port") from now on.
fn uses_host(node: &Proc, host: &str) -> bool {
    node.log
        .lock()
        .expect("lock")
        .iter()
        .any(|l| l.contains("using this host") && l.contains(host))
}

/// How many LISTEN sessions `node` holds on the server of `pool`.
async fn listening_on(pool: &PgPool, node: &Proc) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE 'LISTEN %'",
    )
    .bind(format!("timeoutd-{}", node.node_id))
    .fetch_one(pool)
    .await
    .expect("pg_stat_activity")
}

/// The log line of `node` that says it (re)connected to RabbitMQ through `addr`.
fn connected_through(node: &Proc, addr: SocketAddr) -> bool {
    let port = format!("127.0.0.1:{}", addr.port());
    node.log
        .lock()
        .expect("lock")
        .iter()
        .any(|l| l.contains("connected to RabbitMQ") && l.contains(&port))
}

/// `amqp.url` lists a dead address and two proxies in front of the broker: the daemon
/// connects through one of the live ones, fires; that one then refuses and cuts its
/// connections, and the daemon reconnects through the other and fires everything once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_address_list_skips_the_dead_and_fails_over() {
    let upstream: SocketAddr = amqp_addr().parse().expect("addr");
    let (p1, p2) = (Proxy::start(upstream).await, Proxy::start(upstream).await);
    let dead = closed_port().await;
    let mut world = World::new().await;
    let urls = [dead, p1.addr, p2.addr].map(amqp_at).join(",");
    world
        .overrides
        .push(("TIMEOUTD__AMQP__URL".to_owned(), urls));
    world.migrate().await;
    let inbox = Inbox::new().await;
    let node = Proc::spawn(&world).await;
    let mut used = None;
    wait_for(PATIENCE, "connected through a live address", || {
        used = [&p1, &p2]
            .into_iter()
            .find(|p| connected_through(&node, p.addr));
        used.is_some()
    })
    .await;
    let (used, other) = match used {
        Some(p) if p.addr == p1.addr => (&p1, &p2),
        _ => (&p2, &p1),
    };
    let mut rows = Rows::default();
    rows.insert(
        &world.pool,
        &world.schema,
        "amqp-list",
        &inbox,
        600,
        Duration::from_secs(6),
    )
    .await;
    wait_for(PATIENCE, "TimeOuts flowing", || inbox.len() >= 40).await;
    let fault = Utc::now();
    used.set(Mode::Refuse);
    used.cut();
    wait_for(PATIENCE, "reconnected through the other address", || {
        node.logged("reconnected to RabbitMQ") && connected_through(&node, other.addr)
    })
    .await;
    rows.all_fired_across(&inbox, fault).await;
    empty(&world.pool, &world.schema).await;
    assert!(!node.logged("guest:guest@"), "a broker password was logged");
    drop(node);
    world.cleanup().await;
}

fn pg_at(hosts: &str, query: &str) -> String {
    format!("postgres://postgres@{hosts}/postgres{query}")
}

/// A multi-host `postgres.url` whose first host is dead at start, then whose host in use
/// (a proxy in front of the same database) dies mid-run: the daemon starts on the next
/// host, moves on when its host dies, and every row fires once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_postgres_url_skips_a_dead_host_and_moves_on_when_its_host_dies() {
    let upstream: SocketAddr = pg_addr().parse().expect("addr");
    let proxy = Proxy::start(upstream).await;
    let dead = closed_port().await;
    let mut world = World::new().await;
    let hosts = format!("{dead},{},{}", proxy.addr, pg_addr());
    world
        .overrides
        .push(("TIMEOUTD__POSTGRES__URL".to_owned(), pg_at(&hosts, "")));
    // Through the host list, as the daemon does at start.
    world.migrate().await;
    let inbox = Inbox::new().await;
    let node = Proc::spawn(&world).await;
    let proxied = format!("127.0.0.1:{}", proxy.addr.port());
    wait_for(PATIENCE, "the proxied host in use", || {
        uses_host(&node, &proxied)
    })
    .await;
    let mut rows = Rows::default();
    rows.insert(
        &world.pool,
        &world.schema,
        "pg-hosts",
        &inbox,
        600,
        Duration::from_secs(6),
    )
    .await;
    wait_for(PATIENCE, "TimeOuts flowing", || inbox.len() >= 40).await;
    let fault = Utc::now();
    proxy.set(Mode::Refuse);
    proxy.cut();
    let direct = pg_addr();
    wait_for(PATIENCE, "the last host in use", || {
        uses_host(&node, &direct)
    })
    .await;
    rows.all_fired_across(&inbox, fault).await;
    empty(&world.pool, &world.schema).await;
    drop(node);
    world.cleanup().await;
}

/// A throwaway Postgres 15 cluster of our own on this port (never the main one).
const SECOND_PORT: u16 = 5442;
const SECOND_CLUSTER: &str = "timeoutd_addresses";

/// The second cluster, created (trust authentication, loopback) and started if need be,
/// read-write. `None` (the test skips) where `pg_createcluster` is not available.
async fn second_cluster() -> Option<PgPool> {
    let exists = std::process::Command::new("pg_lsclusters")
        .args(["15", SECOND_CLUSTER])
        .output()
        .ok()?;
    if !exists.status.success() {
        let created = std::process::Command::new("pg_createcluster")
            .args(["15", SECOND_CLUSTER, "-p", &SECOND_PORT.to_string()])
            .args(["--", "--auth=trust"])
            .output()
            .ok()?;
        if !created.status.success() {
            eprintln!(
                "SKIP: pg_createcluster failed: {}",
                String::from_utf8_lossy(&created.stderr)
            );
            return None;
        }
    }
    // Already running is fine (exit code 2).
    let _ = std::process::Command::new("pg_ctlcluster")
        .args(["15", SECOND_CLUSTER, "start"])
        .output();
    let url = format!("postgres://postgres@127.0.0.1:{SECOND_PORT}/postgres");
    let deadline = std::time::Instant::now() + PATIENCE;
    let pool = loop {
        match PgPool::connect(&url).await {
            Ok(pool) => break pool,
            Err(e) if std::time::Instant::now() > deadline => {
                eprintln!("SKIP: the second cluster accepts no connection: {e}");
                return None;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    read_only(&pool, false).await;
    Some(pool)
}

/// Make the whole server read-only (or not again) for every new transaction, as a
/// demoted primary is to its clients.
async fn read_only(pool: &PgPool, on: bool) {
    let set = if on {
        "ALTER SYSTEM SET default_transaction_read_only = on"
    } else {
        "ALTER SYSTEM RESET default_transaction_read_only"
    };
    sqlx::query(set).execute(pool).await.expect("alter system");
    sqlx::query("SELECT pg_reload_conf()")
        .execute(pool)
        .await
        .expect("reload");
    // The reload reaches each backend on its own time.
    let want = if on { "on" } else { "off" };
    wait_for_async(PATIENCE, "the setting in force", || async {
        let now: String = sqlx::query_scalar("SHOW default_transaction_read_only")
            .fetch_one(pool)
            .await
            .expect("show");
        now == want
    })
    .await;
}

async fn migrate_at(url: &str, schema: &str) {
    let mut settings = timeoutd::config::Settings::load_from(
        None,
        [
            ("TIMEOUTD__POSTGRES__URL".to_owned(), url.to_owned()),
            ("TIMEOUTD__POSTGRES__SCHEMA".to_owned(), schema.to_owned()),
            // The rows' TimeOuts go to inboxes on the default exchange (see `World::env`).
            (
                "TIMEOUTD__TIMEOUTS__ALLOW_DEFAULT_EXCHANGE".to_owned(),
                "true".to_owned(),
            ),
        ],
    )
    .expect("settings");
    settings.postgres.migrate_on_start = false;
    let store = timeoutd::store::Store::connect(&settings.postgres).expect("store");
    store.migrate_for(&settings, "test").await.expect("migrate");
    store.close().await;
}

/// `target_session_attrs=read-write` with the second cluster listed first: the daemon
/// fires its rows there; that server then turns read-only (as a demoted primary), and
/// the daemon drops its pooled connections to it, moves to the main server and fires
/// the rows there. Rows of each server fire once, none early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_write_follows_the_writable_server() {
    let Some(second) = second_cluster().await else {
        return;
    };
    let mut world = World::new().await;
    let second_host = format!("127.0.0.1:{SECOND_PORT}");
    let hosts = format!("{second_host},{}", pg_addr());
    world.overrides.push((
        "TIMEOUTD__POSTGRES__URL".to_owned(),
        pg_at(&hosts, "?target_session_attrs=read-write"),
    ));
    migrate_at(&pg_at(&second_host, ""), &world.schema).await;
    migrate_at(&pg_at(&pg_addr(), ""), &world.schema).await;
    let inbox = Inbox::new().await;
    let node = Proc::spawn(&world).await;
    let mut first = Rows::default();
    first
        .insert(
            &second,
            &world.schema,
            "rw-second",
            &inbox,
            200,
            Duration::from_secs(2),
        )
        .await;
    first.all_fired_once(&inbox).await;
    empty(&second, &world.schema).await;

    read_only(&second, true).await;
    let mut then = Rows::default();
    then.insert(
        &world.pool,
        &world.schema,
        "rw-main",
        &inbox,
        200,
        Duration::from_secs(2),
    )
    .await;
    then.all_fired_once(&inbox).await;
    empty(&world.pool, &world.schema).await;
    assert!(uses_host(&node, &pg_addr()), "moved to the main server");
    // Its LISTEN session too: left on the read-only server, it would hear nothing.
    wait_for_async(PATIENCE, "LISTEN on the main server", || async {
        listening_on(&world.pool, &node).await == 1 && listening_on(&second, &node).await == 0
    })
    .await;
    read_only(&second, false).await;
    let drop_schema = format!(
        "BEGIN READ WRITE; DROP SCHEMA IF EXISTS {} CASCADE; COMMIT",
        world.schema
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(drop_schema))
        .execute(&second)
        .await
        .expect("drop schema");
    second.close().await;
    drop(node);
    world.cleanup().await;
}

/// A throwaway primary and its streaming standby (synchronous, so what the primary
/// committed is on the standby when it is promoted), never the main cluster.
const PAIR_PRIMARY: (&str, u16) = ("timeoutd_addresses_primary", 5444);
const PAIR_STANDBY: (&str, u16) = ("timeoutd_addresses_standby", 5443);

fn run(what: &str, args: &[&str]) -> bool {
    match std::process::Command::new(what).args(args).output() {
        Ok(out) if out.status.success() => true,
        Ok(out) => {
            eprintln!(
                "{what} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            false
        }
        Err(e) => {
            eprintln!("{what}: {e}");
            false
        }
    }
}

async fn connect_to(port: u16) -> Option<PgPool> {
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        match PgPool::connect(&url).await {
            Ok(pool) => return Some(pool),
            Err(e) if std::time::Instant::now() > deadline => {
                eprintln!("no connection to port {port}: {e}");
                return None;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The pair, the standby rebuilt from the primary (a previous run may have promoted
/// it). `None` (the test skips) where the clusters cannot be made.
async fn standby_pair() -> Option<(PgPool, PgPool)> {
    let (primary, p_port) = PAIR_PRIMARY;
    let (standby, s_port) = PAIR_STANDBY;
    for (name, port) in [PAIR_PRIMARY, PAIR_STANDBY] {
        if !run("pg_lsclusters", &["15", name]) {
            let port = port.to_string();
            let created = run(
                "pg_createcluster",
                &["15", name, "-p", &port, "--", "--auth=trust"],
            );
            if !created {
                eprintln!("SKIP: cannot create cluster {name}");
                return None;
            }
        }
    }
    let _ = run("pg_ctlcluster", &["15", primary, "start"]);
    let p = connect_to(p_port).await?;
    // Asynchronous while there is no standby, or every commit would wait for one.
    sqlx::query("ALTER SYSTEM RESET synchronous_standby_names")
        .execute(&p)
        .await
        .ok()?;
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&p)
        .await
        .ok()?;
    // Schemas of earlier runs, left when their primary was stopped.
    let old: Vec<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 't\\_%'")
            .fetch_all(&p)
            .await
            .ok()?;
    for schema in old {
        let sql = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
        let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&p).await;
    }
    let _ = run("pg_ctlcluster", &["15", standby, "stop", "-m", "immediate"]);
    let dir = format!("/var/lib/postgresql/15/{standby}");
    let _ = std::fs::remove_dir_all(&dir);
    let port = p_port.to_string();
    let rebuilt = run(
        "install",
        &["-d", "-m", "700", "-o", "postgres", "-g", "postgres", &dir],
    ) && run(
        "runuser",
        &[
            "-u",
            "postgres",
            "--",
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "postgres",
            "-D",
            &dir,
            "-R",
            "-X",
            "stream",
        ],
    ) && run("pg_ctlcluster", &["15", standby, "start"]);
    if !rebuilt {
        eprintln!("SKIP: cannot rebuild the standby {standby}");
        return None;
    }
    let s = connect_to(s_port).await?;
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&s)
        .await
        .ok()?;
    assert!(in_recovery, "the rebuilt standby is a standby");
    sqlx::query("ALTER SYSTEM SET synchronous_standby_names = '*'")
        .execute(&p)
        .await
        .ok()?;
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&p)
        .await
        .ok()?;
    Some((p, s))
}

/// `target_session_attrs=primary` with the standby listed first: the daemon skips it
/// (in recovery) and fires on the primary. The primary is then killed (immediate stop)
/// and the standby promoted, as Patroni would: the daemon moves to it and every row
/// fires, none lost, none early (a batch in flight at the kill may fire twice, with the
/// same message id: counted and printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_follows_a_promotion() {
    let Some((p, s)) = standby_pair().await else {
        return;
    };
    let primary = format!("127.0.0.1:{}", PAIR_PRIMARY.1);
    let standby = format!("127.0.0.1:{}", PAIR_STANDBY.1);
    let mut world = World::new().await;
    world.overrides.push((
        "TIMEOUTD__POSTGRES__URL".to_owned(),
        pg_at(
            &format!("{standby},{primary}"),
            "?target_session_attrs=primary",
        ),
    ));
    migrate_at(&pg_at(&primary, ""), &world.schema).await;
    let inbox = Inbox::new().await;
    let node = Proc::spawn(&world).await;
    let mut rows = Rows::default();
    rows.insert(
        &p,
        &world.schema,
        "promote",
        &inbox,
        600,
        Duration::from_secs(8),
    )
    .await;
    wait_for(PATIENCE, "TimeOuts flowing", || inbox.len() >= 40).await;
    assert!(uses_host(&node, &primary), "started on the primary");
    p.close().await;
    assert!(run(
        "pg_ctlcluster",
        &["15", PAIR_PRIMARY.0, "stop", "-m", "immediate"]
    ));
    assert!(run("pg_ctlcluster", &["15", PAIR_STANDBY.0, "promote"]));
    wait_for(PATIENCE, "moved to the promoted standby", || {
        uses_host(&node, &standby)
    })
    .await;
    let duplicates = rows.all_fired(&inbox).await;
    empty(&s, &world.schema).await;
    println!(
        "fault=pg-promotion rows={} lost=0 early=0 duplicates={duplicates} (same message_id)",
        rows.0.len()
    );
    s.close().await;
    drop(node);
    world.cleanup().await;
}
