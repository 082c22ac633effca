use std::collections::BTreeSet;
use std::process::Output;
use std::time::Duration;

use crate::common::{Inbox, PATIENCE, Proc, World, exit_within, wait_for, wait_for_async};
use crate::http::get;
use crate::principals::ctl;

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
        (
            "TIMEOUTD__HTTP__PENDING_REFRESH",
            "10ms",
            "http.pending_refresh",
        ),
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
        "the documented fields (docs/operating/running.md): {ready}"
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
    let exit = tokio::time::timeout(exit_within(&world), daemon.child.wait())
        .await
        .expect("stops on SIGTERM")
        .expect("wait");
    assert!(exit.success(), "{exit:?}");
    wait_for(PATIENCE, "stdout read to its end", || {
        daemon.stdout_closed()
    })
    .await;
    let stdout = daemon.stdout.lock().expect("lock").clone();
    assert_eq!(stdout.len(), 1, "exactly one line on stdout: {stdout:?}");
    world.cleanup().await;
}

/// The walk-through of docs/integrating/timeouts.md: a daemon binary, `timeoutd expect --in`, exactly one TimeOut;
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
    wait_for(PATIENCE, "the TimeOut", || inbox.len() == 1).await;
    let members = timeoutd(&world, &["members", "--once", "--json"], &[]);
    assert!(members.status.success(), "{members:?}");
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

/// `members --once` with nobody in the group exits 6 and says so on stderr; `--help`
/// lists every exit code.
#[tokio::test]
async fn members_once_exits_6_when_no_member_answers() {
    let world = World::new().await;
    for args in [&["members", "--once"][..], &["members", "--once", "--json"]] {
        let out = timeoutd(&world, args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(6), "{args:?}: {out:?}");
        assert!(
            err.contains("no member of group") && err.contains(&world.group),
            "{err}"
        );
    }
    let help = timeoutd(&world, &["--help"], &[]);
    let help = String::from_utf8_lossy(&help.stdout);
    for (code, meaning) in timeoutd::commands::EXIT_CODES {
        assert!(help.contains(&format!("{code}  {meaning}")), "{help}");
    }
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
    crate::common::wait_for_async(PATIENCE, "failure recorded", || async {
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

/// Characters that could steer a terminal (move the cursor, recolour, reorder text),
/// found raw in `text`: every control character but the line ends, the bidi controls,
/// the line separators.
fn raw_controls(text: &str) -> Vec<char> {
    text.chars()
        .filter(|c| {
            (c.is_control() && *c != '\n')
                || matches!(
                    c,
                    '\u{061c}'
                        | '\u{200e}'
                        | '\u{200f}'
                        | '\u{202a}'..='\u{202e}'
                        | '\u{2066}'..='\u{2069}'
                        | '\u{2028}'
                        | '\u{2029}'
                )
        })
        .collect()
}

/// What a row may hold to attack an operator's terminal: a colour change, a carriage
/// return that overwrites the line, a bell, a right-to-left override, a C1 CSI.
const NASTY: &str = "a\u{1b}[31mRED\r\u{7}\u{202e}exe.txt\u{9b}2J";

/// Contract section 8: `pending` (text and JSON), `cancel` and `check-config` show row
/// and configuration data with every such character escaped, and still the same value
/// to a JSON reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_output_escapes_control_characters_from_rows() {
    let world = World::new().await;
    world.migrate().await;
    let row = timeoutd::client::Expectation::new(NASTY, NASTY, NASTY)
        .exchange(NASTY)
        .due_in(Duration::from_secs(3600));
    world.expect(&row).await;
    world
        .exec(&format!(
            "INSERT INTO {}.delayed_messages (message_id, deliver_at, exchange, routing_key, \
             body, attempts, last_error, retry_at) VALUES ({nasty}, now() + interval '1 hour', \
             {nasty}, {nasty}, '', 1, {nasty}, 'infinity')",
            world.schema,
            nasty = sql_literal(NASTY)
        ))
        .await;
    let other = format!("{NASTY}-not-stored");
    /// A command line and its extra environment.
    type Run<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
    let runs: [Run; 5] = [
        (&["pending", "--list"], &[]),
        (&["pending", "--failing"], &[]),
        (&["pending", "--list", "--json"], &[]),
        (&["cancel", "--message-id", &other], &[]),
        (
            &["check-config"],
            &[("TIMEOUTD__DELAY__TARGET_EXCHANGE", NASTY)],
        ),
    ];
    for (args, env) in runs {
        let out = timeoutd(&world, args, env);
        let shown = String::from_utf8_lossy(&out.stdout);
        assert!(shown.contains("RED"), "{args:?} shows the value: {shown}");
        assert_eq!(
            raw_controls(&shown),
            Vec::<char>::new(),
            "{args:?}: {shown}"
        );
        assert_eq!(
            raw_controls(&String::from_utf8_lossy(&out.stderr)),
            Vec::<char>::new(),
            "{args:?}"
        );
    }
    let json = timeoutd(&world, &["pending", "--list", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("still JSON");
    assert_eq!(v["rows"][0]["process_id"], NASTY, "{v}");
    assert_eq!(v["delayed"]["rows"][0]["exchange"], NASTY, "{v}");
    world.cleanup().await;
}

fn sql_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// A broker user of the test's own, with every right on the suite's vhost (what a
/// daemon needs there); `ctl(&["delete_user", …])` deletes it.
async fn broker_user(password: &str) -> String {
    let name = format!("secret-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let url = url::Url::parse(&crate::common::amqp_url()).expect("amqp url");
    let vhost = url.path().trim_start_matches('/');
    let vhost = percent_decode(if vhost.is_empty() { "%2f" } else { vhost });
    ctl(&["add_user", &name, password]).await;
    ctl(&["set_permissions", "-p", &vhost, &name, ".*", ".*", ".*"]).await;
    name
}

fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("v={s}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// Every way a log line could carry `secret`: as is, percent-encoded (as in a URL), as a
/// byte list (lapin prints frames so), in hex.
fn secret_forms(secret: &str) -> Vec<String> {
    let bytes = secret.as_bytes();
    let joined =
        |f: fn(&u8) -> String, sep: &str| bytes.iter().map(f).collect::<Vec<_>>().join(sep);
    let encoded: String = url::form_urlencoded::byte_serialize(bytes).collect();
    vec![
        secret.to_owned(),
        encoded.clone(),
        encoded.to_lowercase(),
        joined(|b| b.to_string(), ", "),
        joined(|b| b.to_string(), ","),
        joined(|b| format!("{b:02x}"), ""),
        joined(|b| format!("{b:02X}"), ""),
        joined(|b| format!("{b:02x}"), " "),
        joined(|b| format!("\\x{b:02x}"), ""),
    ]
}

fn assert_no_secret(what: &str, output: &[u8], secrets: &[&str]) {
    let text = String::from_utf8_lossy(output);
    for secret in secrets {
        for form in secret_forms(secret) {
            assert!(
                !text.contains(&form),
                "{what} prints a password as {form:?} ({} bytes of output)",
                text.len()
            );
        }
    }
}

/// Contract section 8, "Secrets stay secret": with `RUST_LOG=trace`, a broker user of
/// the test's own with a distinctive password, and a password in the Postgres URL (which
/// trust authentication never asks for, so only our own output could show it): `run`
/// (text and JSON logs) connects, fires and stops, `members`, `pending` and
/// `check-config` run, and none of them prints either password in any form. The same
/// logs hold no raw control character, though a row's exchange holds several.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_in_any_output_even_at_trace_level() {
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let (amqp_password, pg_password) = (format!("Amqp:S3/{tag}"), format!("Pg:S3/{tag}"));
    let user = broker_user(&amqp_password).await;
    let mut amqp = url::Url::parse(&crate::common::amqp_url()).expect("amqp url");
    amqp.set_username(&user).expect("user");
    amqp.set_password(Some(&amqp_password)).expect("password");
    let mut pg = url::Url::parse(&crate::common::pg_url()).expect("pg url");
    pg.set_password(Some(&pg_password)).expect("password");
    let mut world = World::new().await;
    world
        .overrides
        .push(("TIMEOUTD__AMQP__URL".into(), amqp.to_string()));
    world
        .overrides
        .push(("TIMEOUTD__POSTGRES__URL".into(), pg.to_string()));
    world.migrate().await;
    let inbox = Inbox::new().await;
    let secrets = [amqp_password.as_str(), pg_password.as_str()];
    for (n, format) in ["text", "json"].into_iter().enumerate() {
        let e = timeoutd::client::Expectation::new(&format!("p-{n}"), "Reply", &inbox.queue);
        world.expect(&e).await;
        let nasty = format!("nasty-{n}");
        let row = timeoutd::client::Expectation::new(&nasty, "Reply", "k").exchange(NASTY);
        world.expect(&row).await;
        let failed = format!("process_id = '{nasty}' AND attempts > 0");
        let fired_and_failed = || async { inbox.len() > n && world.count(&failed).await == 1 };
        let (stdout, stderr) = run_until(&world, format, fired_and_failed).await;
        let what = format!("run ({format} logs)");
        assert_no_secret(&what, &stdout, &secrets);
        assert_no_secret(&what, &stderr, &secrets);
        let log = String::from_utf8_lossy(&stderr);
        assert!(log.contains("TRACE"), "{what}: at trace level");
        if format == "text" {
            // Not a terminal: no colour, so every line starts `<time> <LEVEL> ` bare.
            for line in log.lines() {
                assert!(starts_with_a_bare_level(line), "{what}: {line:?}");
            }
        }
        let warnings: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .collect();
        assert!(
            log.contains("not published"),
            "{what}: the nasty row's warning; warnings and errors:\n{}",
            warnings.join("\n")
        );
        assert_eq!(raw_controls(&log), Vec::<char>::new(), "{what}");
    }
    let trace = [("RUST_LOG", "trace")];
    for args in [
        &["check-config"][..],
        &["pending", "--list"],
        &["members", "--once"],
    ] {
        let out = timeoutd(&world, args, &trace);
        // No daemon runs any more: `members --once` says nobody answered.
        let expected = if args[0] == "members" { 6 } else { 0 };
        assert_eq!(out.status.code(), Some(expected), "{args:?}: {out:?}");
        assert_no_secret(&format!("{args:?}"), &out.stdout, &secrets);
        assert_no_secret(&format!("{args:?}"), &out.stderr, &secrets);
    }
    ctl(&["delete_user", &user]).await;
    world.cleanup().await;
}

/// `2024-01-01T00:00:00.000000Z  INFO …`: a timestamp, spaces and a level, nothing
/// between them (a colour code would be).
fn starts_with_a_bare_level(line: &str) -> bool {
    let Some((time, rest)) = line.split_once(' ') else {
        return false;
    };
    let level = rest.trim_start().split(' ').next().unwrap_or_default();
    time.ends_with('Z')
        && chrono::DateTime::parse_from_rfc3339(time).is_ok()
        && ["TRACE", "DEBUG", "INFO", "WARN", "ERROR"].contains(&level)
}

/// A command that fails prints its error once, each cause once, and a hint for the
/// common mistake: here, a schema nobody migrated. It logs nothing besides.
#[tokio::test]
async fn an_error_is_printed_once_with_each_cause_once_and_a_hint() {
    let world = World::new().await;
    for args in [
        &["pending"][..],
        &["pending", "--list", "--json"],
        &[
            "expect",
            "--process-id",
            "p",
            "--message-type",
            "T",
            "--routing-key",
            "k",
        ],
    ] {
        let out = timeoutd(&world, args, &[]);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 2, "{args:?}: an error line and a hint:\n{err}");
        let (error, hint) = (lines[0], lines[1]);
        assert!(error.starts_with("error: "), "{error}");
        assert_eq!(error.matches("does not exist").count(), 1, "{error}");
        assert!(error.contains("SQLSTATE 42P01"), "{error}");
        assert!(
            !error.contains(" at line "),
            "the Postgres source line: {error}"
        );
        assert!(
            hint.starts_with("hint: ") && hint.contains("timeoutd migrate"),
            "{hint}"
        );
    }
    world.cleanup().await;
}

/// `timeoutd run` at trace level with `format` logs until `done`, then SIGTERM: what it
/// printed on stdout and stderr.
async fn run_until<F, Fut>(world: &World, format: &str, done: F) -> (Vec<u8>, Vec<u8>)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    use tokio::io::AsyncReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_timeoutd"))
        .arg("run")
        .envs(world.env())
        .env("RUST_LOG", "trace")
        .env("TIMEOUTD__LOG__FORMAT", format)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn timeoutd");
    let read = |mut r: Box<dyn tokio::io::AsyncRead + Unpin + Send>| {
        tokio::spawn(async move {
            let mut all = Vec::new();
            let _ = r.read_to_end(&mut all).await;
            all
        })
    };
    let stdout = read(Box::new(child.stdout.take().expect("stdout")));
    let stderr = read(Box::new(child.stderr.take().expect("stderr")));
    wait_for_async(PATIENCE, "done", done).await;
    let pid = child.id().expect("running").to_string();
    let term = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    assert!(term.is_ok_and(|s| s.success()), "kill -TERM");
    let exit = tokio::time::timeout(exit_within(world), child.wait())
        .await
        .expect("stops on SIGTERM")
        .expect("wait");
    assert!(exit.success(), "{exit:?}");
    let stdout = stdout.await.expect("stdout reader");
    let stderr = stderr.await.expect("stderr reader");
    (stdout, stderr)
}
