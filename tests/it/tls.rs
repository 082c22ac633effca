//! Transport security against TLS listeners beside the plain ones: RabbitMQ's AMQPS
//! listener ([`amqps_url`]) and Postgres with `ssl = on` (the plain [`pg_url`] with an
//! `sslmode`), both with a certificate for the URLs' host from a throwaway CA
//! ([`tls_ca`]). The test services (`tests/services.yml`) have them; so do the machine's
//! own services after `.ci/tls-setup` (CI's main stage, `.ci/local-services.env`).
//! Nothing is skipped: without them these tests fail and say how to get them.

use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use timeoutd::client::Expectation;
use timeoutd::election::Role;

use crate::common::{
    Inbox, PATIENCE, Proc, World, amqps_url, pg_url, tls_ca, wait_for, wait_for_async,
};
use crate::http::get;

const SETUP: &str = "the TLS tests need the test services (`docker compose -f \
    tests/services.yml up -d --wait`) or TLS listeners of the services the TIMEOUTD_TEST_* \
    variables name (`.ci/tls-setup`, as root, for this machine's own)";

/// The TLS settings of the services under test: the CA that signed their certificate,
/// a certificate that is not a CA (the server's own: trusting it alone does not verify
/// the server), the AMQPS URL.
struct Tls {
    ca: String,
    wrong_ca: String,
    amqps: String,
}

impl Tls {
    /// The settings, after checking that the listeners are there (failing, naming the
    /// fix, when they are not).
    async fn require(world: &World) -> Self {
        let ca: PathBuf = tls_ca().unwrap_or_else(|e| panic!("{e}; {SETUP}"));
        assert!(ca.is_file(), "the CA {} is missing; {SETUP}", ca.display());
        let wrong_ca = ca.with_file_name("server.pem");
        assert!(
            wrong_ca.is_file(),
            "{} is missing; {SETUP}",
            wrong_ca.display()
        );
        let amqps = amqps_url();
        let addr = crate::common::host_port(&amqps);
        if let Err(e) = tokio::net::TcpStream::connect(&addr).await {
            panic!("RabbitMQ does not listen on {addr} ({e}); {SETUP}");
        }
        let ssl: String = sqlx::query_scalar("SELECT current_setting('ssl')")
            .fetch_one(&world.pool)
            .await
            .expect("postgres answers");
        assert!(ssl == "on", "Postgres has ssl = {ssl}; {SETUP}");
        Self {
            ca: ca.display().to_string(),
            wrong_ca: wrong_ca.display().to_string(),
            amqps,
        }
    }
}

/// [`pg_url`] with `sslmode` set to `mode`.
fn pg_tls_url(mode: &str) -> String {
    let mut url = url::Url::parse(&pg_url()).expect("pg url");
    let others: Vec<(String, String)> = url
        .query_pairs()
        .filter(|(k, _)| k != "sslmode")
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    url.query_pairs_mut()
        .clear()
        .extend_pairs(others)
        .append_pair("sslmode", mode);
    url.to_string()
}

fn set(world: &mut World, var: &str, value: &str) {
    world.overrides.push((var.to_owned(), value.to_owned()));
}

/// `SELECT ssl, version FROM pg_stat_ssl` for a session opened with the daemon's own
/// connection options.
async fn session_ssl(world: &World) -> Result<(bool, Option<String>), String> {
    let store = timeoutd::store::Store::connect(&world.settings().postgres).expect("store");
    let row = sqlx::query_as("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .map_err(|e| format!("{e}"));
    store.close().await;
    row
}

fn timeoutd(world: &World, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_timeoutd"))
        .args(args)
        .envs(world.env())
        .output()
        .expect("run timeoutd")
}

/// A daemon on amqps:// (system roots + `amqp.ca_file`) and Postgres `verify-full`
/// (`postgres.ca_file`) becomes ready and active and fires a TimeOut; its Postgres
/// sessions are encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fires_over_amqps_and_verified_postgres_tls() {
    let mut world = World::new().await;
    let tls = Tls::require(&world).await;
    set(&mut world, "TIMEOUTD__AMQP__URL", &tls.amqps);
    set(&mut world, "TIMEOUTD__AMQP__CA_FILE", &tls.ca);
    set(
        &mut world,
        "TIMEOUTD__POSTGRES__URL",
        &pg_tls_url("verify-full"),
    );
    set(&mut world, "TIMEOUTD__POSTGRES__CA_FILE", &tls.ca);

    let (ssl, version) = session_ssl(&world).await.expect("verify-full session");
    assert!(ssl, "the daemon's Postgres session is not encrypted");
    println!("postgres session: ssl = {ssl}, {version:?}");

    world.migrate().await;
    let inbox = Inbox::new().await;
    let node = world.start().await;
    wait_for(PATIENCE, "node active over TLS", || {
        *node.role.borrow() == Role::Active
    })
    .await;
    let addr = node.http_addr;
    wait_for_async(PATIENCE, "ready over TLS", || async {
        get(addr, "/readyz").await.0 == 200
    })
    .await;
    let e = Expectation::new("tls-proc", "PaymentReceived", &inbox.queue)
        .due_in(Duration::from_millis(300));
    let id = world.expect(&e).await;
    wait_for(PATIENCE, "the TimeOut", || inbox.len() >= 1).await;
    let got = inbox.all();
    assert_eq!(got.len(), 1);
    let message_id = got[0]
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string());
    assert_eq!(message_id, Some(id.to_string()));
    assert_eq!(
        got[0].properties.kind().as_ref().map(|s| s.as_str()),
        Some("TimeOut")
    );
    wait_for_async(PATIENCE, "row deleted", || async {
        world.count("true").await == 0
    })
    .await;
    node.stop().await;
    world.cleanup().await;
}

/// Without `amqp.ca_file`, amqps:// to the self-signed broker is refused for the
/// certificate: the daemon stays up, not ready, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_without_the_ca_is_refused() {
    let mut world = World::new().await;
    let tls = Tls::require(&world).await;
    set(&mut world, "TIMEOUTD__AMQP__URL", &tls.amqps);
    world.migrate().await;
    let node = Proc::spawn(&world).await;
    wait_for(
        PATIENCE,
        "a certificate error connecting to RabbitMQ",
        || node.logged("cannot connect to RabbitMQ") && node.logged("certificate"),
    )
    .await;
    let addr = node.http_addr;
    let (code, body) = get(addr, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("rabbitmq"), "{body}");
    assert_eq!(get(addr, "/healthz").await.0, 200);
    let (_, status) = get(addr, "/status").await;
    let v: serde_json::Value = serde_json::from_str(&status).expect("json");
    assert_eq!(v["bus_connected"], false, "{status}");
    let line = node
        .log
        .lock()
        .expect("lock")
        .iter()
        .find(|l| l.contains("cannot connect to RabbitMQ"))
        .cloned()
        .unwrap_or_default();
    println!("refused as expected: {line}");
    node.signal("TERM");
    world.cleanup().await;
}

/// Postgres `verify-full`: `timeoutd migrate` succeeds with `postgres.ca_file` and fails
/// without it (the certificate is not trusted); `require` encrypts without verifying, and
/// with a root certificate verifies the chain as libpq does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_verify_full_needs_the_ca() {
    let mut world = World::new().await;
    let tls = Tls::require(&world).await;
    set(
        &mut world,
        "TIMEOUTD__POSTGRES__URL",
        &pg_tls_url("verify-full"),
    );

    let refused = timeoutd(&world, &["migrate"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "verify-full without the CA: {err}"
    );
    assert!(err.contains("certificate"), "{err}");
    println!("refused as expected: {}", err.trim());
    session_ssl(&world)
        .await
        .expect_err("verify-full without the CA must not connect");

    set(&mut world, "TIMEOUTD__POSTGRES__CA_FILE", &tls.ca);
    let ok = timeoutd(&world, &["migrate"]);
    assert!(ok.status.success(), "verify-full with the CA: {ok:?}");
    assert_eq!(world.count("true").await, 0, "schema created");

    // require: encrypted, certificate not checked.
    world.overrides.clear();
    set(
        &mut world,
        "TIMEOUTD__POSTGRES__URL",
        &pg_tls_url("require"),
    );
    let (ssl, _) = session_ssl(&world).await.expect("require session");
    assert!(ssl, "sslmode=require is not encrypted");
    // require + a root certificate that does not sign the server's: refused.
    set(&mut world, "TIMEOUTD__POSTGRES__CA_FILE", &tls.wrong_ca);
    let err = session_ssl(&world)
        .await
        .expect_err("require with a root certificate verifies the chain");
    assert!(err.contains("certificate"), "{err}");
    // The plain listener of the other tests is untouched.
    let plain = sqlx::PgPool::connect(&pg_tls_url("disable"))
        .await
        .expect("plain connection still accepted");
    plain.close().await;
    world.cleanup().await;
}
