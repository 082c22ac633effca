use super::validate::MAX_CONCURRENCY;
use super::*;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn load(pairs: &[(&str, &str)]) -> Result<Settings, ConfigError> {
    Settings::load_from(None, env(pairs))
}

fn amqp_urls(s: &Settings) -> Vec<&str> {
    s.amqp.url.iter().map(SecretUrl::expose).collect()
}

#[test]
fn amqp_url_takes_a_list_or_a_comma_separated_string() {
    let s = load(&[(
        "TIMEOUTD__AMQP__URL",
        "amqp://u:p@r1:5672/%2f, amqp://u:q@r2:5673/%2f,",
    )])
    .expect("valid");
    assert_eq!(
        amqp_urls(&s),
        ["amqp://u:p@r1:5672/%2f", "amqp://u:q@r2:5673/%2f"]
    );
    let dir = std::env::temp_dir().join(format!("timeoutd-urls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("c.toml");
    std::fs::write(
        &file,
        "[amqp]\nurl = [\"amqps://u:s3cret@r1/vh\", \"amqps://u:s3cret@r2/vh\"]\n",
    )
    .expect("write");
    let s = Settings::load_from(Some(&file), env(&[])).expect("valid");
    assert_eq!(
        amqp_urls(&s),
        ["amqps://u:s3cret@r1/vh", "amqps://u:s3cret@r2/vh"]
    );
    // check-config prints a list, redacted, that reads back as the same list.
    let shown = toml::to_string(&s).expect("toml");
    assert!(!shown.contains("s3cret"), "{shown}");
    let back: Settings = toml::from_str(&shown).expect("parses back");
    assert_eq!(
        amqp_urls(&back),
        ["amqps://u:***@r1/vh", "amqps://u:***@r2/vh"]
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn postgres_url_takes_libpq_multi_host_form() {
    let s = load(&[(
        "TIMEOUTD__POSTGRES__URL",
        "postgres://pm:hunter2@db1:5432,db2:5433/app?target_session_attrs=read-write",
    )])
    .expect("valid");
    let shown = format!("{s:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("pm:***@db1:5432,db2:5433/app"), "{shown}");
    let hosts = pg_hosts(s.postgres.url.expose()).expect("hosts");
    assert_eq!(hosts.urls.len(), 2);
    assert_eq!(hosts.target, TargetSession::ReadWrite);
}

#[test]
fn defaults_match_the_contract() {
    let s = load(&[]).expect("defaults are valid");
    assert_eq!(amqp_urls(&s), ["amqp://guest:guest@127.0.0.1:5672/%2f"]);
    assert_eq!(s.amqp.announce_exchange, "timeoutd.announcements");
    assert_eq!(
        s.postgres.url.expose(),
        "postgres://postgres@127.0.0.1:5432/postgres"
    );
    assert_eq!(s.postgres.schema, "timeoutd");
    assert!(s.postgres.migrate_on_start);
    assert_eq!(s.election.group, "default");
    assert_eq!(s.election.tick, Duration::from_millis(250));
    assert_eq!(s.election.announce_interval, Duration::from_secs(1));
    assert_eq!(s.election.member_ttl, Duration::from_secs(3));
    assert_eq!(s.scan.batch_size, 500);
    assert_eq!(s.http.listen, "127.0.0.1:9464");
    assert_eq!(s.log.format, LogFormat::Text);
    assert_eq!(s.timing().max_lag, Duration::from_millis(1500));
    assert_eq!(s.timing().rule, Rule::Lowest { announcers: 3 });
    // The stop promise: exit within a second of SIGTERM, whatever the peers do.
    assert_eq!(s.shutdown.grace, Duration::from_millis(500));
    assert_eq!(s.shutdown.timeout, Duration::from_secs(1));
    assert_eq!(s.runtime.workers(), Some(1));
}

/// `0` leaves the number of worker threads to the runtime (one per core).
#[test]
fn zero_worker_threads_means_one_per_core() {
    let s = load(&[("TIMEOUTD__RUNTIME__WORKER_THREADS", "0")]).expect("valid");
    assert_eq!(s.runtime.workers(), None);
    let s = load(&[("TIMEOUTD__RUNTIME__WORKER_THREADS", "4")]).expect("valid");
    assert_eq!(s.runtime.workers(), Some(4));
}

/// A stop that waits for a batch as long as it may take (the bound before the stop was
/// bounded by peers) is still a valid configuration.
#[test]
fn a_long_grace_is_valid_below_the_timeout() {
    let s = load(&[
        ("TIMEOUTD__SHUTDOWN__GRACE", "9s"),
        ("TIMEOUTD__SHUTDOWN__TIMEOUT", "10s"),
    ])
    .expect("valid");
    assert_eq!(s.shutdown.grace, Duration::from_secs(9));
}

#[test]
fn the_announce_rule_is_configurable() {
    let all = load(&[("TIMEOUTD__ELECTION__RULE", "all")]).expect("valid");
    assert_eq!(all.timing().rule, Rule::All);
    let five = load(&[("TIMEOUTD__ELECTION__ANNOUNCERS", "5")]).expect("valid");
    assert_eq!(five.timing().rule, Rule::Lowest { announcers: 5 });
}

#[test]
fn environment_overrides_with_double_underscores() {
    let s = load(&[
        ("TIMEOUTD__AMQP__URL", "amqp://u:p@rabbit:5672/%2f"),
        ("TIMEOUTD__ELECTION__TICK", "100ms"),
        ("TIMEOUTD__SCAN__BATCH_SIZE", "42"),
        ("TIMEOUTD__POSTGRES__MIGRATE_ON_START", "false"),
        ("TIMEOUTD__ELECTION__MAX_LAG", "1s"),
    ])
    .expect("valid");
    assert_eq!(amqp_urls(&s), ["amqp://u:p@rabbit:5672/%2f"]);
    assert_eq!(s.election.tick, Duration::from_millis(100));
    assert_eq!(s.scan.batch_size, 42);
    assert!(!s.postgres.migrate_on_start);
    assert_eq!(s.timing().max_lag, Duration::from_secs(1));
}

#[test]
fn a_file_overrides_defaults_and_env_overrides_the_file() {
    let dir = std::env::temp_dir().join(format!("timeoutd-cfg-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("c.toml");
    std::fs::write(
        &path,
        "[election]\ngroup = \"from-file\"\ntick = \"500ms\"\n",
    )
    .expect("write");
    let s = Settings::load_from(Some(&path), env(&[("TIMEOUTD__ELECTION__TICK", "200ms")]))
        .expect("valid");
    assert_eq!(s.election.group, "from-file");
    assert_eq!(s.election.tick, Duration::from_millis(200));
    std::fs::remove_dir_all(dir).ok();
}

/// A CA file must exist and hold a PEM certificate; either key is checked.
#[test]
fn ca_files_must_hold_a_pem_certificate() {
    let dir = std::env::temp_dir().join(format!("timeoutd-ca-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let good = dir.join("ca.pem");
    std::fs::write(
        &good,
        "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
    )
    .expect("write");
    let bad = dir.join("ca.der");
    std::fs::write(&bad, "not a certificate").expect("write");
    let (good, bad) = (good.to_str().expect("utf-8"), bad.to_str().expect("utf-8"));
    for (var, key) in [
        ("TIMEOUTD__AMQP__CA_FILE", "amqp.ca_file"),
        ("TIMEOUTD__POSTGRES__CA_FILE", "postgres.ca_file"),
    ] {
        let s = load(&[(var, good)]).expect("a PEM file is accepted");
        assert!(s.amqp.ca_file.is_some() || s.postgres.ca_file.is_some());
        let err = load(&[(var, bad)]).expect_err(var).to_string();
        assert!(
            err.contains(key) && err.contains("no PEM certificate"),
            "{err}"
        );
    }
    std::fs::remove_dir_all(dir).ok();
}

/// Table: (env var, value, key the error must name).
#[test]
fn invalid_values_are_refused_naming_the_key() {
    let cases = [
        ("TIMEOUTD__AMQP__URL", "http://x", "amqp.url"),
        ("TIMEOUTD__AMQP__URL", "not a url", "amqp.url"),
        ("TIMEOUTD__AMQP__URL", " , ", "amqp.url"),
        (
            "TIMEOUTD__AMQP__URL",
            "amqp://a:p@r1/%2f,amqp://b:p@r2/%2f",
            "amqp.url",
        ),
        (
            "TIMEOUTD__AMQP__URL",
            "amqp://r1/%2f,amqp://r2/other",
            "amqp.url",
        ),
        (
            "TIMEOUTD__POSTGRES__URL",
            "postgres://h1,,h2/db",
            "postgres.url",
        ),
        (
            "TIMEOUTD__POSTGRES__URL",
            "postgres://h1,h2/db?target_session_attrs=standby",
            "postgres.url",
        ),
        ("TIMEOUTD__POSTGRES__URL", "mysql://x/db", "postgres.url"),
        (
            "TIMEOUTD__POSTGRES__SCHEMA",
            "x; drop table y",
            "postgres.schema",
        ),
        ("TIMEOUTD__POSTGRES__SCHEMA", "Upper", "postgres.schema"),
        ("TIMEOUTD__ELECTION__GROUP", "", "election.group"),
        ("TIMEOUTD__ELECTION__SECRET", "too short", "election.secret"),
        (
            "TIMEOUTD__CONSOLE__ADMIN_TOKEN",
            "too short",
            "console.admin_token",
        ),
        (
            "TIMEOUTD__CONSOLE__READ_TOKEN",
            "too short",
            "console.read_token",
        ),
        (
            "TIMEOUTD__CONSOLE__STATEMENT_TIMEOUT",
            "0s",
            "console.statement_timeout",
        ),
        (
            "TIMEOUTD__CONSOLE__ACQUIRE_TIMEOUT",
            "2m",
            "console.acquire_timeout",
        ),
        (
            "TIMEOUTD__CONSOLE__IDLE_TIMEOUT",
            "0s",
            "console.idle_timeout",
        ),
        ("TIMEOUTD__ELECTION__GROUP", "a.#", "election.group"),
        ("TIMEOUTD__ELECTION__TICK", "0s", "election.tick"),
        ("TIMEOUTD__ELECTION__TICK", "2s", "election.tick"),
        ("TIMEOUTD__ELECTION__TICK", "soon", "tick"),
        (
            "TIMEOUTD__ELECTION__ANNOUNCE_INTERVAL",
            "3s",
            "election.announce_interval",
        ),
        ("TIMEOUTD__ELECTION__MAX_LAG", "5s", "election.max_lag"),
        ("TIMEOUTD__ELECTION__ANNOUNCERS", "1", "election.announcers"),
        (
            "TIMEOUTD__ELECTION__ANNOUNCERS",
            "101",
            "election.announcers",
        ),
        ("TIMEOUTD__ELECTION__RULE", "some", "rule"),
        ("TIMEOUTD__SCAN__BATCH_SIZE", "0", "scan.batch_size"),
        ("TIMEOUTD__SCAN__BATCH_SIZE", "many", "batch_size"),
        ("TIMEOUTD__HTTP__LISTEN", "localhost", "http.listen"),
        ("TIMEOUTD__LOG__FORMAT", "xml", "format"),
        ("TIMEOUTD__DELAY__PREFETCH", "0", "delay.prefetch"),
        ("TIMEOUTD__DELAY__PREFETCH", "70000", "prefetch"),
        (
            "TIMEOUTD__DELAY__INGEST_CONCURRENCY",
            "0",
            "delay.ingest_concurrency",
        ),
        (
            "TIMEOUTD__DELAY__INGEST_CONCURRENCY",
            "17",
            "delay.ingest_concurrency",
        ),
        (
            "TIMEOUTD__DELAY__INGEST_LINGER",
            "2s",
            "delay.ingest_linger",
        ),
        (
            "TIMEOUTD__SCAN__PROBE_INTERVAL",
            "2m",
            "scan.probe_interval",
        ),
        ("TIMEOUTD__DELAY__CANCEL_TTL", "0s", "delay.cancel_ttl"),
        ("TIMEOUTD__DELAY__CANCEL_TTL", "400days", "delay.cancel_ttl"),
        ("TIMEOUTD__DELAY__EXCHANGE", "", "delay.exchange"),
        ("TIMEOUTD__DELAY__EXCHANGE", "amq.topic", "delay.exchange"),
        (
            "TIMEOUTD__DELAY__TARGET_EXCHANGE",
            "",
            "delay.target_exchange",
        ),
        ("TIMEOUTD__DELAY__MAX_BODY", "lots", "max_body"),
        (
            "TIMEOUTD__DELAY__TARGET_EXCHANGE",
            "amq.topic",
            "delay.target_exchange",
        ),
        (
            "TIMEOUTD__DELAY__TARGET_EXCHANGE",
            "timeoutd.announcements",
            "delay.target_exchange",
        ),
        (
            "TIMEOUTD__DELAY__TARGET_EXCHANGE",
            "timeoutd.delay.other-group",
            "delay.target_exchange",
        ),
        (
            "TIMEOUTD__DELAY__ALLOWED_EXCHANGES",
            "orders,team-[a",
            "delay.allowed_exchanges",
        ),
        ("TIMEOUTD__DELAY__MAX_DELAY", "0s", "delay.max_delay"),
        ("TIMEOUTD__DELAY__MAX_DELAY", "101years", "delay.max_delay"),
        (
            "TIMEOUTD__DELAY__MAX_PENDING_PER_OWNER",
            "0",
            "delay.max_pending_per_owner",
        ),
        (
            "TIMEOUTD__DELAY__MAX_BYTES_PER_OWNER",
            "1MiB",
            "delay.max_bytes_per_owner",
        ),
        ("TIMEOUTD__DELAY__ENABLED", "maybe", "enabled"),
        ("TIMEOUTD__ELECTION__COLOUR", "blue", "colour"),
        (
            "TIMEOUTD__AMQP__ANNOUNCE_EXCHANGE",
            "",
            "amqp.announce_exchange",
        ),
        (
            "TIMEOUTD__AMQP__CONNECT_TIMEOUT",
            "0ms",
            "amqp.connect_timeout",
        ),
        (
            "TIMEOUTD__AMQP__CONFIRM_TIMEOUT",
            "1h",
            "postgres.statement_timeout",
        ),
        (
            "TIMEOUTD__AMQP__CONFIRM_TIMEOUT",
            "6s",
            "postgres.statement_timeout",
        ),
        (
            "TIMEOUTD__AMQP__MAX_MESSAGE_SIZE",
            "12",
            "amqp.max_message_size",
        ),
        (
            "TIMEOUTD__AMQP__MAX_MESSAGE_SIZE",
            "lots",
            "max_message_size",
        ),
        (
            "TIMEOUTD__POSTGRES__MAX_CONNECTIONS",
            "0",
            "postgres.max_connections",
        ),
        (
            "TIMEOUTD__POSTGRES__MIGRATE_ON_START",
            "maybe",
            "migrate_on_start",
        ),
        (
            "TIMEOUTD__POSTGRES__STATEMENT_TIMEOUT",
            "0s",
            "postgres.statement_timeout",
        ),
        (
            "TIMEOUTD__ELECTION__MEMBER_TTL",
            "500ms",
            "election.announce_interval",
        ),
        (
            "TIMEOUTD__ELECTION__MAX_LAG_EXIT",
            "1s",
            "election.max_lag_exit",
        ),
        ("TIMEOUTD__SCAN__RETRY_MIN", "1h", "scan.retry_min"),
        ("TIMEOUTD__SCAN__BATCH_SIZE", "100000", "scan.batch_size"),
        (
            "TIMEOUTD__RUNTIME__WORKER_THREADS",
            "65",
            "runtime.worker_threads",
        ),
        ("TIMEOUTD__BACKOFF__MIN", "1m", "backoff.min"),
        ("TIMEOUTD__SHUTDOWN__TIMEOUT", "0s", "shutdown.timeout"),
        ("TIMEOUTD__SHUTDOWN__TIMEOUT", "11m", "shutdown.timeout"),
        ("TIMEOUTD__SHUTDOWN__GRACE", "0s", "shutdown.grace"),
        ("TIMEOUTD__SHUTDOWN__GRACE", "1s", "shutdown.grace"),
        (
            "TIMEOUTD__AMQP__CA_FILE",
            "/nonexistent/ca.pem",
            "amqp.ca_file",
        ),
        (
            "TIMEOUTD__POSTGRES__CA_FILE",
            "/nonexistent/ca.pem",
            "postgres.ca_file",
        ),
    ];
    for (var, value, key) in cases {
        let err = load(&[(var, value)]).expect_err(var).to_string();
        assert!(err.contains(key), "{var}={value:?}: {err}");
    }
}

/// A default never makes another key's valid value invalid: every valid
/// `scan.concurrency` works with the defaults of `scan.fresh_slots` and
/// `postgres.max_connections`, which follow it.
#[test]
fn every_valid_concurrency_works_with_the_other_defaults() {
    for concurrency in 1..=MAX_CONCURRENCY {
        let c = concurrency.to_string();
        let s = load(&[("TIMEOUTD__SCAN__CONCURRENCY", &c)])
            .unwrap_or_else(|e| panic!("scan.concurrency = {c}: {e}"));
        assert_eq!(s.scan.concurrency, concurrency);
        assert_eq!(s.scan.fresh_slots, u32::from(concurrency > 1), "{c}");
        assert!(s.postgres.max_connections >= concurrency + 2, "{c}");
        assert!(s.postgres.max_connections >= 8, "{c}");
    }
    let s = load(&[]).expect("defaults");
    assert_eq!((s.scan.fresh_slots, s.postgres.max_connections), (1, 8));
    let out_of_range = load(&[("TIMEOUTD__SCAN__CONCURRENCY", "17")]).expect_err("17");
    assert!(
        out_of_range.to_string().contains("scan.concurrency"),
        "{out_of_range}"
    );
}

/// A value that is set is taken as it is and judged as usual, never clamped.
#[test]
fn derived_keys_set_explicitly_are_kept_and_checked() {
    let s = load(&[
        ("TIMEOUTD__SCAN__CONCURRENCY", "3"),
        ("TIMEOUTD__SCAN__FRESH_SLOTS", "2"),
        ("TIMEOUTD__POSTGRES__MAX_CONNECTIONS", "30"),
    ])
    .expect("valid");
    assert_eq!((s.scan.fresh_slots, s.postgres.max_connections), (2, 30));
    let cases = [
        (("TIMEOUTD__SCAN__FRESH_SLOTS", "2"), "scan.fresh_slots"),
        (
            ("TIMEOUTD__POSTGRES__MAX_CONNECTIONS", "3"),
            "postgres.max_connections",
        ),
        (("TIMEOUTD__SCAN__FRESH_SLOTS", "many"), "fresh_slots"),
    ];
    for (set, key) in cases {
        let err = load(&[("TIMEOUTD__SCAN__CONCURRENCY", "2"), set]).expect_err(set.0);
        assert!(err.to_string().contains(key), "{set:?}: {err}");
    }
    // What check-config prints (the derived values) loads back as the same settings.
    let s = load(&[("TIMEOUTD__SCAN__CONCURRENCY", "1")]).expect("valid");
    let back: Settings = toml::from_str(&toml::to_string(&s).expect("toml")).expect("back");
    back.validate().expect("valid");
    assert_eq!(
        (back.scan.fresh_slots, back.postgres.max_connections),
        (0, 8)
    );
}

#[test]
fn redaction_hides_passwords_and_keeps_the_rest() {
    let s = load(&[
        ("TIMEOUTD__AMQP__URL", "amqps://user:s3cret@rabbit:5671/vh"),
        (
            "TIMEOUTD__POSTGRES__URL",
            "postgres://pm:hunter2@db/app?password=x&sslmode=require",
        ),
        ("TIMEOUTD__ELECTION__SECRET", "group-secret-of-sixteen+"),
    ])
    .expect("valid");
    let shown = format!("{s:?}");
    assert!(
        !shown.contains("s3cret") && !shown.contains("hunter2"),
        "{shown}"
    );
    assert!(!shown.contains("group-secret"), "{shown}");
    assert_eq!(s.election.secret.expose(), "group-secret-of-sixteen+");
    assert!(shown.contains("user:***@rabbit"), "{shown}");
    assert!(shown.contains("sslmode=require"), "{shown}");
    assert!(!shown.contains("password=x"), "{shown}");
}

#[test]
fn console_tokens_are_secrets_and_differ() {
    let s = load(&[
        ("TIMEOUTD__CONSOLE__ENABLED", "true"),
        ("TIMEOUTD__CONSOLE__ADMIN_TOKEN", "admin-token-0123456789"),
        ("TIMEOUTD__CONSOLE__READ_TOKEN", "read-token-0123456789"),
    ])
    .expect("valid");
    let shown = format!("{s:?}{}", toml::to_string(&s).expect("toml"));
    assert!(
        !shown.contains("admin-token") && !shown.contains("read-token"),
        "{shown}"
    );
    assert!(shown.contains("admin_token = \"***\""), "{shown}");
    let same = load(&[
        ("TIMEOUTD__CONSOLE__ADMIN_TOKEN", "one-token-for-both-0123"),
        ("TIMEOUTD__CONSOLE__READ_TOKEN", "one-token-for-both-0123"),
    ])
    .expect_err("the same token twice")
    .to_string();
    assert!(same.contains("console.read_token"), "{same}");
    assert!(!same.contains("one-token"), "{same}");
}

#[test]
fn an_invalid_url_error_does_not_echo_the_password() {
    let err = load(&[("TIMEOUTD__AMQP__URL", "ftp://u:topsecret@h/")])
        .expect_err("scheme")
        .to_string();
    assert!(!err.contains("topsecret"), "{err}");
}

#[test]
fn check_config_toml_round_trips_and_hides_passwords() {
    let s = load(&[("TIMEOUTD__POSTGRES__URL", "postgres://pm:hunter2@db/app")]).expect("valid");
    let shown = toml::to_string(&s).expect("toml");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("[election]"), "{shown}");
    // What check-config prints is itself a valid configuration file.
    let back: Settings = toml::from_str(&shown).expect("parses back");
    assert_eq!(back.election.group, s.election.group);
    assert_eq!(back.postgres.url.expose(), "postgres://pm:***@db/app");
}

#[test]
fn the_delay_exchange_names_the_group() {
    let s = load(&[("TIMEOUTD__ELECTION__GROUP", "billing")]).expect("valid");
    assert_eq!(s.delay_exchange(), "timeoutd.delay.billing");
    let s = load(&[("TIMEOUTD__DELAY__EXCHANGE", "billing.delayed")]).expect("valid");
    assert_eq!(s.delay_exchange(), "billing.delayed");
}

#[test]
fn allowed_exchanges_come_as_a_list_or_a_comma_separated_string() {
    let s = load(&[]).expect("defaults");
    assert!(s.delay.allowed_exchanges.is_empty());
    assert_eq!(s.delay.max_delay, Duration::from_millis(u32::MAX.into()));
    let r = s.delay_destinations().expect("rule");
    assert_eq!(r.check("timeoutd.delayed"), Ok(()));
    assert!(r.check("orders").is_err());
    let s = load(&[(
        "TIMEOUTD__DELAY__ALLOWED_EXCHANGES",
        " orders , billing.* ,",
    )])
    .expect("valid");
    assert_eq!(s.delay.allowed_exchanges, ["orders", "billing.*"]);
    let dir = std::env::temp_dir().join(format!("timeoutd-cfg-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("c.toml");
    std::fs::write(&path, "[delay]\nallowed_exchanges = [\"a\", \"b.*\"]\n").expect("write");
    let s = Settings::load_from(Some(&path), env(&[])).expect("valid");
    assert_eq!(s.delay.allowed_exchanges, ["a", "b.*"]);
    // check-config prints it back as a list the file form reads again.
    let shown = toml::to_string(&s).expect("toml");
    assert!(
        shown.contains(r#"allowed_exchanges = ["a", "b.*"]"#),
        "{shown}"
    );
    std::fs::remove_dir_all(dir).ok();
    // Listing an exchange that is never allowed changes nothing for it.
    let s = load(&[("TIMEOUTD__DELAY__ALLOWED_EXCHANGES", "*")]).expect("valid");
    let r = s.delay_destinations().expect("rule");
    assert!(r.check("amq.topic").is_err());
    assert_eq!(r.check("anything"), Ok(()));
}

/// `postgres.session_url`: unset by default (the pool's own address), checked like
/// `postgres.url` when set, and redacted in what check-config prints.
#[test]
fn session_url_is_optional_checked_and_redacted() {
    let s = load(&[]).expect("defaults");
    assert!(s.postgres.session_url().is_none());
    let s = load(&[(
        "TIMEOUTD__POSTGRES__SESSION_URL",
        "postgres://timeoutd:hunter2@db1:5432,db2:5432/app?target_session_attrs=primary",
    )])
    .expect("valid");
    assert!(s.postgres.session_url().is_some());
    let printed = toml::to_string(&s).expect("toml");
    assert!(!printed.contains("hunter2"), "{printed}");
    assert!(printed.contains("db1:5432,db2:5432"), "{printed}");
    let err =
        load(&[("TIMEOUTD__POSTGRES__SESSION_URL", "db.internal:5432")]).expect_err("not a URL");
    assert!(err.to_string().contains("postgres.session_url"), "{err}");
}
