//! Transport security against the TLS listeners `.ci/tls-setup` adds to the local
//! services: RabbitMQ on localhost:5671 and Postgres with `ssl = on`, both with a
//! certificate for `localhost` from a throwaway CA. Nothing is skipped: without that setup
//! these tests fail and say how to get it.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use timeoutd::client::Expectation;
use timeoutd::election::Role;

use crate::common::{Inbox, PATIENCE, Proc, World, pg_url, wait_for, wait_for_async};
use crate::http::get;

const TLS_DIR: &str = "/var/tmp/timeoutd-tls";
const CA: &str = "/var/tmp/timeoutd-tls/ca.pem";
/// Not a CA: the server's own certificate. Trusting it alone does not verify the server.
const WRONG_CA: &str = "/var/tmp/timeoutd-tls/server.pem";
const AMQPS_URL: &str = "amqps://guest:guest@localhost:5671/%2f";
const PG_VERIFY_FULL: &str = "postgres://postgres@localhost:5432/postgres?sslmode=verify-full";
const PG_REQUIRE: &str = "postgres://postgres@localhost:5432/postgres?sslmode=require";
const SETUP: &str = "the TLS listeners are not set up: run `bash .ci/tls-setup` (as root) first";

/// Fail, naming the fix, unless `.ci/tls-setup` has run.
async fn require_tls_setup(world: &World) {
    assert!(Path::new(CA).is_file(), "{CA} is missing; {SETUP}");
    if let Err(e) = tokio::net::TcpStream::connect("127.0.0.1:5671").await {
        panic!("RabbitMQ does not listen on 127.0.0.1:5671 ({e}); {SETUP}");
    }
    let (ssl, cert): (String, String) =
        sqlx::query_as("SELECT current_setting('ssl'), current_setting('ssl_cert_file')")
            .fetch_one(&world.pool)
            .await
            .expect("postgres answers");
    assert!(
        ssl == "on" && cert.starts_with(TLS_DIR),
        "Postgres has ssl = {ssl}, ssl_cert_file = {cert}; {SETUP}"
    );
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
    require_tls_setup(&world).await;
    set(&mut world, "TIMEOUTD__AMQP__URL", AMQPS_URL);
    set(&mut world, "TIMEOUTD__AMQP__CA_FILE", CA);
    set(&mut world, "TIMEOUTD__POSTGRES__URL", PG_VERIFY_FULL);
    set(&mut world, "TIMEOUTD__POSTGRES__CA_FILE", CA);

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
    require_tls_setup(&world).await;
    set(&mut world, "TIMEOUTD__AMQP__URL", AMQPS_URL);
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
    require_tls_setup(&world).await;
    set(&mut world, "TIMEOUTD__POSTGRES__URL", PG_VERIFY_FULL);

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

    set(&mut world, "TIMEOUTD__POSTGRES__CA_FILE", CA);
    let ok = timeoutd(&world, &["migrate"]);
    assert!(ok.status.success(), "verify-full with the CA: {ok:?}");
    assert_eq!(world.count("true").await, 0, "schema created");

    // require: encrypted, certificate not checked.
    world.overrides.clear();
    set(&mut world, "TIMEOUTD__POSTGRES__URL", PG_REQUIRE);
    let (ssl, _) = session_ssl(&world).await.expect("require session");
    assert!(ssl, "sslmode=require is not encrypted");
    // require + a root certificate that does not sign the server's: refused.
    set(&mut world, "TIMEOUTD__POSTGRES__CA_FILE", WRONG_CA);
    let err = session_ssl(&world)
        .await
        .expect_err("require with a root certificate verifies the chain");
    assert!(err.contains("certificate"), "{err}");
    // The plain listener of the other tests is untouched.
    let plain = sqlx::PgPool::connect(&format!("{}?sslmode=disable", pg_url()))
        .await
        .expect("plain connection still accepted");
    plain.close().await;
    world.cleanup().await;
}
