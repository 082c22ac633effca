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
        BTreeSet::from([
            "ready",
            "node_id",
            "group",
            "http_addr",
            "version",
            "worker_threads"
        ]),
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

    let exit = daemon.terminate(&world).await;
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

/// Contract section 8: `pending` (text and JSON), the verbs and `check-config` show row
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
    let runs: [Run; 11] = [
        (&["pending", "--list"], &[]),
        (&["pending", "--failing"], &[]),
        (&["pending", "--held", "--message-id", NASTY], &[]),
        (&["pending", "--list", "--json"], &[]),
        (&["cancel", "--message-id", &other], &[]),
        (&["cancel", "--message-id", &other, "--json"], &[]),
        (&["cancel", "--process-id", &other], &[]),
        (&["reschedule", "--message-id", &other, "--in", "1m"], &[]),
        (&["release", "--message-id", &other, "--owner", NASTY], &[]),
        (&["retry", "--message-id", &other, "--json"], &[]),
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
/// common mistake: here, a schema nobody migrated (also for the verbs). It logs nothing besides.
#[tokio::test]
async fn an_error_is_printed_once_with_each_cause_once_and_a_hint() {
    let world = World::new().await;
    for args in [
        &["pending"][..],
        &["pending", "--list", "--json"],
        &["cancel", "--process-id", "p"],
        &["release", "--message-id", "m", "--json"],
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
        // A table in a missing schema is 42P01; a function of the SQL API there (what
        // `expect` calls) is 3F000.
        assert!(
            error.contains("SQLSTATE 42P01") || error.contains("SQLSTATE 3F000"),
            "{error}"
        );
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

/// `timeoutd ARGS --json`: the exit code and the one JSON document on stdout.
fn json_run(world: &World, args: &[&str]) -> (Option<i32>, serde_json::Value) {
    let mut args = args.to_vec();
    args.push("--json");
    let out = timeoutd(world, &args, &[]);
    let doc = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: not one JSON document ({e}): {out:?}"));
    (out.status.code(), doc)
}

/// `pending` with `filter`, as JSON: the ids (expectations) and message_ids (delayed
/// messages) it lists.
fn listed(world: &World, filter: &[&str]) -> (Vec<String>, Vec<String>) {
    let mut args = vec!["pending"];
    args.extend_from_slice(filter);
    let (code, v) = json_run(world, &args);
    assert_eq!(code, Some(0), "{args:?}: {v}");
    let ids = |rows: &serde_json::Value, field: &str| -> Vec<String> {
        rows.as_array()
            .map(|rows| {
                rows.iter()
                    .map(|r| r[field].as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    (
        ids(&v["rows"], "id"),
        ids(&v["delayed"]["rows"], "message_id"),
    )
}

/// Store a delayed message of `owner` due in an hour, in `state`: `""` pending, `failing`
/// (a failed publish, retry in an hour), `held`, or `no body` (held, stored without it).
async fn delayed_row(world: &World, owner: &str, message_id: &str, state: &str) {
    let (attempts, retry_at, dropped) = match state {
        "" => (0, "NULL", false),
        "failing" => (1, "now() + interval '1 hour'", false),
        "held" => (1, "'infinity'", false),
        "no body" => (1, "'infinity'", true),
        other => panic!("no state {other}"),
    };
    world
        .exec(&format!(
            "INSERT INTO {}.delayed_messages (owner, message_id, deliver_at, exchange, \
             routing_key, body, attempts, last_error, retry_at, body_dropped) VALUES \
             ({}, {}, now() + interval '1 hour', 'x', 'k', 'b', {attempts}, \
             CASE WHEN {attempts} > 0 THEN 'a failure' END, {retry_at}, {dropped})",
            world.schema,
            sql_literal(owner),
            sql_literal(message_id)
        ))
        .await;
}

/// An expectation due in an hour; with `state` `failing` (a failed publish, retry in an
/// hour) or `parked`.
async fn expectation_row(
    world: &World,
    process_id: &str,
    message_type: &str,
    state: &str,
) -> String {
    let id = world
        .expect(
            &timeoutd::client::Expectation::new(process_id, message_type, "k")
                .due_in(Duration::from_secs(3600)),
        )
        .await;
    let retry_at = match state {
        "" => return id.to_string(),
        "failing" => "now() + interval '1 hour'",
        "parked" => "'infinity'",
        other => panic!("no state {other}"),
    };
    world
        .exec(&format!(
            "UPDATE {}.expected_messages SET attempts = 1, last_error = 'a failure', \
             retry_at = {retry_at} WHERE id = '{id}'",
            world.schema
        ))
        .await;
    id.to_string()
}

/// Every verb on both kinds, through the binary: done (exit 0) then not in the state it
/// needs (exit 4), each with its JSON document; `pending`'s filters list what they name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_verb_on_both_kinds_says_done_or_exits_4() {
    let world = World::new().await;
    world.migrate().await;
    let plain = expectation_row(&world, "p1", "A", "").await;
    let other = expectation_row(&world, "p1", "B", "").await;
    let third = expectation_row(&world, "p2", "A", "").await;
    let failing = expectation_row(&world, "p3", "A", "failing").await;
    let parked = expectation_row(&world, "p3", "B", "parked").await;
    delayed_row(&world, "", "d-plain", "").await;
    delayed_row(&world, "alice", "d-alice", "").await;
    delayed_row(&world, "", "d-failing", "failing").await;
    delayed_row(&world, "", "d-held", "held").await;

    // Filters.
    let all = listed(&world, &["--list"]);
    assert_eq!(all.0.len(), 5, "{all:?}");
    assert_eq!(all.1.len(), 4, "{all:?}");
    assert_eq!(
        listed(&world, &["--process-id", "p1"]).0,
        [&*plain, &*other]
    );
    assert_eq!(
        listed(&world, &["--process-id", "p1"]).1,
        Vec::<String>::new()
    );
    assert_eq!(
        listed(
            &world,
            &["--list", "--process-id", "p1", "--message-type", "B"]
        )
        .0,
        [&*other]
    );
    assert_eq!(listed(&world, &["--message-type", "A"]).0.len(), 3);
    assert_eq!(
        listed(&world, &["--owner", "alice"]),
        (vec![], vec!["d-alice".into()])
    );
    assert_eq!(listed(&world, &["--message-id", "d-held"]).1, ["d-held"]);
    assert_eq!(
        listed(&world, &["--kind", "delayed"]).0,
        Vec::<String>::new()
    );
    assert_eq!(
        listed(&world, &["--kind", "expectation"]).1,
        Vec::<String>::new()
    );
    assert_eq!(
        listed(&world, &["--held"]),
        (vec![parked.clone()], vec!["d-held".into()])
    );
    let mut failing_ids = listed(&world, &["--failing"]).0;
    failing_ids.sort();
    let mut want = vec![failing.clone(), parked.clone()];
    want.sort();
    assert_eq!(failing_ids, want, "--failing: held and parked included");
    assert_eq!(
        listed(&world, &["--failing", "--kind", "delayed"]).1,
        ["d-failing", "d-held"]
    );
    let text = timeoutd(&world, &["pending", "--held"], &[]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("PARKED") && text.contains("HELD"), "{text}");
    assert!(!text.contains("d-plain"), "{text}");

    // Expectations.
    let (code, v) = json_run(
        &world,
        &["reschedule", "--id", &plain, "--at", "2031-01-02T03:04:05Z"],
    );
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["verb"], "reschedule");
    assert_eq!(v["kind"], "expectation");
    assert_eq!(v["id"], plain.as_str());
    assert_eq!(v["done"], true);
    assert_eq!(v["at"], "2031-01-02T03:04:05+00:00");
    assert_eq!(
        world
            .count(&format!(
                "id = '{plain}' AND timeout_at = '2031-01-02T03:04:05Z'"
            ))
            .await,
        1
    );
    let (code, v) = json_run(&world, &["retry", "--id", &plain]);
    assert_eq!(
        (code, &v["done"]),
        (Some(4), &false.into()),
        "not failing: {v}"
    );
    let (code, v) = json_run(&world, &["release", "--id", &failing]);
    assert_eq!(
        (code, &v["done"]),
        (Some(4), &false.into()),
        "not parked: {v}"
    );
    let (code, v) = json_run(&world, &["retry", "--id", &failing]);
    assert_eq!((code, &v["done"]), (Some(0), &true.into()), "{v}");
    assert_eq!(
        world
            .count(&format!("id = '{failing}' AND retry_at IS NULL"))
            .await,
        1
    );
    let (code, v) = json_run(&world, &["retry", "--id", &parked]);
    assert_eq!(code, Some(4), "parked is not waiting for a retry: {v}");
    let (code, v) = json_run(&world, &["release", "--id", &parked]);
    assert_eq!(
        (code, &v["verb"], &v["done"]),
        (Some(0), &"release".into(), &true.into()),
        "{v}"
    );
    let (code, _) = json_run(&world, &["release", "--id", &parked]);
    assert_eq!(code, Some(4), "released once");
    let (code, v) = json_run(&world, &["cancel", "--id", &third]);
    assert_eq!((code, &v["done"]), (Some(0), &true.into()), "{v}");
    let (code, v) = json_run(&world, &["cancel", "--id", &third]);
    assert_eq!((code, &v["done"]), (Some(4), &false.into()), "{v}");
    let (code, _) = json_run(&world, &["reschedule", "--id", &third, "--in", "5m"]);
    assert_eq!(code, Some(4), "cancelled: not pending");
    let out = timeoutd(&world, &["cancel", "--id", &third], &[]);
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("not pending: expectation"),
        "{out:?}"
    );
    // By process: of one message type, then all of it.
    let (code, v) = json_run(
        &world,
        &["cancel", "--process-id", "p1", "--message-type", "B"],
    );
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["process_id"], "p1");
    assert_eq!(v["message_type"], "B");
    assert_eq!(v["cancelled"], 1);
    let (code, v) = json_run(&world, &["cancel", "--process-id", "p1"]);
    assert_eq!(
        (code, &v["cancelled"], &v["message_type"]),
        (Some(0), &1.into(), &serde_json::Value::Null),
        "{v}"
    );
    let (code, v) = json_run(&world, &["cancel", "--process-id", "p1"]);
    assert_eq!(
        (code, &v["cancelled"], &v["done"]),
        (Some(4), &0.into(), &false.into()),
        "{v}"
    );
    assert_eq!(world.count("process_id = 'p1'").await, 0);

    // Delayed messages, by owner.
    let delayed = |filter: &str| {
        let sql = format!(
            "SELECT count(*) FROM {}.delayed_messages WHERE {filter}",
            world.schema
        );
        let pool = world.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    let (code, v) = json_run(
        &world,
        &["reschedule", "--message-id", "d-alice", "--in", "2h"],
    );
    assert_eq!(code, Some(4), "not the anonymous owner's: {v}");
    let (code, v) = json_run(
        &world,
        &[
            "reschedule",
            "--message-id",
            "d-alice",
            "--owner",
            "alice",
            "--in",
            "2h",
        ],
    );
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["kind"], "delayed");
    assert_eq!(v["message_id"], "d-alice");
    assert_eq!(v["owner"], "alice");
    assert!(v["at"].is_string(), "{v}");
    assert_eq!(
        delayed("message_id = 'd-alice' AND deliver_at > now() + interval '90 minutes'").await,
        1
    );
    let (code, _) = json_run(&world, &["retry", "--message-id", "d-plain"]);
    assert_eq!(code, Some(4), "not failing");
    let (code, _) = json_run(&world, &["retry", "--message-id", "d-failing"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        delayed("message_id = 'd-failing' AND retry_at IS NULL").await,
        1
    );
    let (code, _) = json_run(&world, &["release", "--message-id", "d-plain"]);
    assert_eq!(code, Some(4), "not held");
    let (code, _) = json_run(&world, &["release", "--message-id", "d-held"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        delayed("message_id = 'd-held' AND retry_at IS NULL").await,
        1
    );
    let (code, v) = json_run(&world, &["cancel", "--message-id", "d-plain"]);
    assert_eq!(
        (code, &v["verb"], &v["owner"], &v["done"]),
        (Some(0), &"cancel".into(), &"".into(), &true.into()),
        "{v}"
    );
    let again = timeoutd(&world, &["cancel", "--message-id", "d-plain"], &[]);
    assert_eq!(again.status.code(), Some(4));
    assert_eq!(
        String::from_utf8_lossy(&again.stdout).trim(),
        "not pending: \"d-plain\" of owner \"\" (already delivered, cancelled, or unknown)"
    );
    world.cleanup().await;
}

/// Exit 7: the database refuses to release a held message stored without its body, and a
/// role without EXECUTE on the SQL API may not act at all; the reason is on stderr, the
/// JSON document says `refused`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_verbs_exit_7_with_the_reason() {
    let world = World::new().await;
    world.migrate().await;
    delayed_row(&world, "", "no-body", "no body").await;
    let (code, v) = json_run(&world, &["release", "--message-id", "no-body"]);
    assert_eq!(code, Some(7), "{v}");
    assert_eq!(v["done"], false);
    assert!(
        v["refused"]
            .as_str()
            .unwrap_or_default()
            .contains("without its body"),
        "{v}"
    );
    let out = timeoutd(&world, &["release", "--message-id", "no-body"], &[]);
    assert_eq!(out.status.code(), Some(7));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("refused"),
        "{out:?}"
    );
    // A role with the schema but none of the API.
    let role = format!("td_cli_{}", &world.schema[2..10]);
    world.exec(&format!("CREATE ROLE {role} LOGIN")).await;
    world
        .exec(&format!("GRANT USAGE ON SCHEMA {} TO {role}", world.schema))
        .await;
    let mut url = url::Url::parse(&crate::common::pg_url()).expect("pg url");
    url.set_username(&role).expect("username");
    let env = [("TIMEOUTD__POSTGRES__URL", url.as_str())];
    let out = timeoutd(&world, &["cancel", "--message-id", "no-body"], &env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert!(
        err.contains("permission denied") && err.contains("_api"),
        "{err}"
    );
    assert_eq!(
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.delayed_messages",
            world.schema
        )))
        .fetch_one(&world.pool)
        .await
        .expect("count"),
        1,
        "nothing cancelled"
    );
    world.exec(&format!("DROP OWNED BY {role}")).await;
    world.exec(&format!("DROP ROLE {role}")).await;
    world.cleanup().await;
}

/// With a daemon running: `reschedule` moves a TimeOut (it arrives, not before the new
/// time), `release` fires a parked expectation again, and `retry` fires a failing one
/// now once its exchange exists (its own retry time is an hour away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reschedule_release_and_retry_fire_through_the_daemon() {
    let mut world = World::new().await;
    world
        .overrides
        .push(("TIMEOUTD__SCAN__RETRY_MIN".to_owned(), "1h".to_owned()));
    world
        .overrides
        .push(("TIMEOUTD__SCAN__RETRY_MAX".to_owned(), "1h".to_owned()));
    world.migrate().await;
    let inbox = Inbox::new().await;
    let later = world
        .expect(
            &timeoutd::client::Expectation::new("moved", "A", &inbox.queue)
                .due_in(Duration::from_secs(3600)),
        )
        .await
        .to_string();
    let parked = world
        .expect(
            &timeoutd::client::Expectation::new("parked", "A", &inbox.queue)
                .due_in(Duration::from_secs(3600)),
        )
        .await
        .to_string();
    world
        .exec(&format!(
            "UPDATE {}.expected_messages SET timeout_at = now() - interval '1 minute', \
             attempts = 1, last_error = 'could not delete', retry_at = 'infinity' \
             WHERE id = '{parked}'",
            world.schema
        ))
        .await;
    let exchange = format!("x-{}", world.group);
    let failing = world
        .expect(&timeoutd::client::Expectation::new("failing", "A", "k").exchange(&exchange))
        .await
        .to_string();
    let node = world.start().await;
    wait_for_async(PATIENCE, "the failing row's first attempt", || async {
        world
            .count(&format!("id = '{failing}' AND attempts > 0"))
            .await
            == 1
    })
    .await;

    let (code, v) = json_run(&world, &["reschedule", "--id", &later, "--in", "2s"]);
    assert_eq!(code, Some(0), "{v}");
    let at: chrono::DateTime<chrono::Utc> =
        v["at"].as_str().and_then(|s| s.parse().ok()).expect("at");
    let (code, v) = json_run(&world, &["release", "--id", &parked]);
    assert_eq!(code, Some(0), "{v}");
    wait_for(PATIENCE, "the moved and the released TimeOuts", || {
        inbox.counts().get(&later) == Some(&1) && inbox.counts().get(&parked) == Some(&1)
    })
    .await;
    let moved = inbox
        .all()
        .into_iter()
        .find(|r| r.message_id() == later)
        .expect("moved");
    assert!(
        moved.fired_at() >= at,
        "fired {} before {at}",
        moved.fired_at()
    );

    inbox.bind_new_exchange(&exchange, "k").await;
    let (code, v) = json_run(&world, &["retry", "--id", &failing]);
    assert_eq!(code, Some(0), "{v}");
    wait_for(PATIENCE, "the retried TimeOut", || {
        inbox.counts().get(&failing) == Some(&1)
    })
    .await;
    node.stop().await;
    world.cleanup().await;
}

/// `--json` of `migrate`, `check-config` and `expect`: one document each, with the fields
/// docs/operating/running.md names, secrets redacted.
#[tokio::test]
async fn migrate_check_config_and_expect_print_one_json_document() {
    let world = World::new().await;
    let (code, v) = json_run(&world, &["migrate"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["migrated"], true);
    assert_eq!(v["schema"], world.schema.as_str());
    let secret = "the-group-secret-0123456789";
    let mut args = vec!["check-config", "--json"];
    let out = timeoutd(&world, &args, &[("TIMEOUTD__ELECTION__SECRET", secret)]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains(secret), "{text}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one document");
    assert_eq!(v["valid"], true);
    assert_eq!(v["settings"]["election"]["group"], world.group.as_str());
    assert_eq!(v["settings"]["postgres"]["schema"], world.schema.as_str());
    args.clear();
    let (code, v) = json_run(
        &world,
        &[
            "expect",
            "--process-id",
            "p",
            "--message-type",
            "T",
            "--routing-key",
            "k",
            "--at",
            "2031-01-02T03:04:05Z",
        ],
    );
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["timeout_at"], "2031-01-02T03:04:05+00:00");
    let id = v["id"].as_str().expect("id");
    assert_eq!(world.count(&format!("id = '{id}'")).await, 1);
    world.cleanup().await;
}

/// The daemon's tasks run on `runtime.worker_threads` threads: one unless configured,
/// one per core with `0`. The ready line says how many the runtime has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_runs_on_the_configured_worker_threads() {
    let world = World::new().await;
    // `0` leaves it to tokio: its own variable if set, else one per core.
    let cores = std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    for (set, expected) in [(None, 1), (Some("3"), 3), (Some("0"), cores)] {
        let extra: Vec<(String, String)> = set
            .map(|n| ("TIMEOUTD__RUNTIME__WORKER_THREADS".to_owned(), n.to_owned()))
            .into_iter()
            .collect();
        let mut daemon = Proc::spawn_with(&world, &extra).await;
        assert_eq!(
            daemon.ready["worker_threads"], expected,
            "runtime.worker_threads = {set:?}: {}",
            daemon.ready
        );
        let exit = daemon.terminate(&world).await;
        assert!(exit.success(), "{exit}");
    }
    world.cleanup().await;
}
