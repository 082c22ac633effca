use std::collections::BTreeSet;
use std::process::Output;
use std::time::Duration;

use crate::common::{Inbox, Proc, World, wait_for};
use crate::http::get;

pub fn timeoutd(world: &World, args: &[&str], extra_env: &[(&str, &str)]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_timeoutd"))
        .args(args)
        .envs(world.env())
        .envs(extra_env.iter().copied())
        .output()
        .expect("run timeoutd")
}

/// Invalid configuration is refused at start with exit code 2 and the key named.
#[tokio::test]
async fn invalid_config_exits_2_naming_the_key() {
    let world = World::new().await;
    let cases = [
        (
            "TIMEOUTD__ELECTION__ANNOUNCE_INTERVAL",
            "5s",
            "election.announce_interval",
        ),
        ("TIMEOUTD__POSTGRES__SCHEMA", "bad-name", "postgres.schema"),
        ("TIMEOUTD__SCAN__BATCH_SIZE", "0", "scan.batch_size"),
    ];
    for (var, value, key) in cases {
        for cmd in ["run", "check-config"] {
            let out = timeoutd(&world, &[cmd], &[(var, value)]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{cmd} {var}={value}: {err}");
            assert!(err.contains(key), "{err}");
        }
    }
    world.cleanup().await;
}

/// check-config prints the effective configuration without the password.
#[tokio::test]
async fn check_config_redacts_secrets() {
    let world = World::new().await;
    let url = "amqp://guest:sup3rsecret@127.0.0.1:5672/%2f";
    let group_secret = "the-group-secret-0123456789";
    let env = [
        ("TIMEOUTD__AMQP__URL", url),
        ("TIMEOUTD__ELECTION__SECRET", group_secret),
    ];
    let out = timeoutd(&world, &["check-config"], &env);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(shown.contains("guest:***@127.0.0.1"), "{shown}");
    assert!(!shown.contains("sup3rsecret"), "{shown}");
    assert!(shown.contains("secret = \"***\""), "{shown}");
    assert!(!shown.contains(group_secret), "{shown}");
    assert!(shown.contains(&world.group), "{shown}");
    world.cleanup().await;
}

/// `timeoutd run` prints one JSON ready line on stdout (the logs are on stderr): its node
/// id is the one `/status` reports at its `http_addr` — the real bound address, as
/// `http.listen` is on port 0 here — and nothing else ever appears on stdout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_prints_one_ready_line_naming_the_node_and_its_http_address() {
    let world = World::new().await;
    world.migrate().await;
    let mut daemon = Proc::spawn(&world).await;
    let ready = daemon.ready.clone();
    let fields: BTreeSet<&str> = ready
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        fields,
        BTreeSet::from(["ready", "node_id", "group", "http_addr", "version"]),
        "the documented fields (README, Commands): {ready}"
    );
    assert_eq!(ready["ready"], true, "{ready}");
    assert_eq!(ready["group"], world.group.as_str(), "{ready}");
    assert_eq!(ready["version"], env!("CARGO_PKG_VERSION"), "{ready}");
    let addr = daemon.http_addr;
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{ready}");

    let (code, body) = get(addr, "/status").await;
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).expect("/status is JSON");
    assert_eq!(status["node_id"], ready["node_id"], "{status}");
    assert_eq!(status["node_id"], daemon.node_id.to_string().as_str());
    assert_eq!(status["group"], world.group.as_str(), "{status}");

    daemon.signal("TERM");
    let exit = tokio::time::timeout(Duration::from_secs(20), daemon.child.wait())
        .await
        .expect("stops on SIGTERM")
        .expect("wait");
    assert!(exit.success(), "{exit:?}");
    wait_for(Duration::from_secs(5), "stdout read to its end", || {
        daemon.stdout_closed()
    })
    .await;
    let stdout = daemon.stdout.lock().expect("lock").clone();
    assert_eq!(stdout.len(), 1, "exactly one line on stdout: {stdout:?}");
    world.cleanup().await;
}

/// The README walk-through: a daemon binary, `timeoutd expect --in`, exactly one TimeOut;
/// `timeoutd pending` and `members --once --json` see the state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_command_fires_one_timeout_through_the_daemon_binary() {
    let world = World::new().await;
    let migrate = timeoutd(&world, &["migrate"], &[]);
    assert!(migrate.status.success(), "{migrate:?}");
    let inbox = Inbox::new().await;
    let daemon = Proc::spawn(&world).await;
    let out = timeoutd(
        &world,
        &[
            "expect",
            "--process-id",
            "order-7",
            "--message-type",
            "PaymentReceived",
            "--routing-key",
            &inbox.queue,
            "--in",
            "1s",
            "--payload",
            r#"{"order":7}"#,
        ],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    let id = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("prints the id")
        .to_owned();
    let pending = timeoutd(&world, &["pending", "--list", "--json"], &[]);
    let pending: serde_json::Value =
        serde_json::from_slice(&pending.stdout).expect("pending --json");
    assert_eq!(pending["counts"]["pending"], 1, "{pending}");
    assert_eq!(pending["rows"][0]["id"], id.as_str());
    wait_for(Duration::from_secs(10), "the TimeOut", || inbox.len() == 1).await;
    let members = timeoutd(&world, &["members", "--once", "--json"], &[]);
    let members: serde_json::Value =
        serde_json::from_slice(&members.stdout).expect("members --json");
    assert_eq!(
        members[0]["node_id"],
        daemon.node_id.to_string().as_str(),
        "{members}"
    );
    assert_eq!(members[0]["active"], true);
    assert_eq!(inbox.counts().get(&id), Some(&1));
    assert_eq!(inbox.all()[0].body["payload"]["order"], 7);
    drop(daemon);
    world.cleanup().await;
}

/// `pending` counts and lists failing rows with their error, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_shows_failing_rows_without_touching_them() {
    let world = World::new().await;
    world.migrate().await;
    let stuck = timeoutd::client::Expectation::new("stuck", "Reply", "k")
        .exchange("no-such-exchange-anywhere");
    world.expect(&stuck).await;
    let later =
        timeoutd::client::Expectation::new("later", "Reply", "k").due_in(Duration::from_secs(3600));
    world.expect(&later).await;
    let node = world.start().await;
    crate::common::wait_for_async(Duration::from_secs(10), "failure recorded", || async {
        world.count("attempts > 0").await == 1
    })
    .await;
    node.stop().await;
    let out = timeoutd(&world, &["pending", "--failing", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["counts"]["pending"], 2, "{v}");
    assert_eq!(v["counts"]["failing"], 1, "{v}");
    assert_eq!(v["counts"]["due"], 1, "{v}");
    assert_eq!(v["rows"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["rows"][0]["process_id"], "stuck");
    assert!(
        v["rows"][0]["last_error"]
            .as_str()
            .unwrap_or_default()
            .contains("does not exist")
    );
    let text = timeoutd(&world, &["pending"], &[]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("pending 2") && text.contains("failing 1"),
        "{text}"
    );
    assert_eq!(
        world.count("attempts = 1").await,
        1,
        "pending changed nothing"
    );
    world.cleanup().await;
}
