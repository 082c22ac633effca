//! The rules a loaded [`Settings`] must meet, each refusal naming its key; kept apart
//! from loading so that every rule, and each bound it checks, has one home.

use std::path::Path;
use std::time::Duration;

use super::secret_url::redact_url;
use super::{ConfigError, SecretUrl, SecretUrls, Settings, pg_hosts};

impl Settings {
    /// Every rule a value must meet, each refusal naming its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_amqp_urls(&self.amqp.url)?;
        check_pg_url("postgres.url", &self.postgres.url)?;
        if let Some(session) = self.postgres.session_url() {
            check_pg_url("postgres.session_url", session)?;
        }
        check_name("amqp.announce_exchange", &self.amqp.announce_exchange)?;
        timeoutd_client::Schema::new(&self.postgres.schema)
            .map_err(|e| ConfigError::invalid("postgres.schema", e.to_string()))?;
        check_name("election.group", &self.election.group)?;
        if self.election.group.contains(['*', '#', '.']) {
            return Err(ConfigError::invalid(
                "election.group",
                "must not contain '.', '*' or '#' (it is a topic routing key)",
            ));
        }
        self.validate_durations()?;
        if self.election.secret.is_set() && self.election.secret.expose().len() < MIN_SECRET {
            return Err(ConfigError::invalid(
                "election.secret",
                format!("must be at least {MIN_SECRET} bytes (or empty: no group secret)"),
            ));
        }
        // Two at least: the active node's successor must hear it every interval to take
        // over within member_ttl + tick, as with every node announcing.
        check_range("election.announcers", self.election.announcers, 2, 100)?;
        check_range("scan.batch_size", self.scan.batch_size, 1, 10_000)?;
        check_range("runtime.worker_threads", self.runtime.worker_threads, 0, 64)?;
        check_range(
            "scan.concurrency",
            self.scan.concurrency,
            1,
            MAX_CONCURRENCY,
        )?;
        if self.scan.fresh_slots >= self.scan.concurrency {
            return Err(ConfigError::invalid(
                "scan.fresh_slots",
                "must be less than scan.concurrency (a backlog needs a batch of its own)",
            ));
        }
        if self.scan.concurrency + 2 > self.postgres.max_connections {
            return Err(ConfigError::invalid(
                "postgres.max_connections",
                "must be at least scan.concurrency + 2 (one LISTEN connection, one for probes)",
            ));
        }
        check_range(
            "postgres.max_connections",
            self.postgres.max_connections,
            1,
            100,
        )?;
        self.validate_http()?;
        self.validate_delay()?;
        self.validate_console()?;
        self.validate_signing()?;
        check_ca_file("amqp.ca_file", self.amqp.ca_file.as_deref())?;
        check_ca_file("postgres.ca_file", self.postgres.ca_file.as_deref())?;
        Ok(())
    }

    fn validate_http(&self) -> Result<(), ConfigError> {
        self.http_listen()?;
        if !(MIN_PENDING_REFRESH..=MAX_PENDING_REFRESH).contains(&self.http.pending_refresh) {
            return Err(ConfigError::invalid(
                "http.pending_refresh",
                "must be 100ms to 1h",
            ));
        }
        check_range(
            "http.max_connections_per_client",
            self.http.max_connections_per_client,
            1,
            10_000,
        )?;
        if !(MIN_CONNECTION_LIFETIME..=MAX_CONNECTION_LIFETIME)
            .contains(&self.http.connection_lifetime)
        {
            return Err(ConfigError::invalid(
                "http.connection_lifetime",
                "must be 1s to 1h",
            ));
        }
        Ok(())
    }

    fn validate_console(&self) -> Result<(), ConfigError> {
        let c = &self.console;
        for (key, token) in [
            ("console.admin_token", &c.admin_token),
            ("console.read_token", &c.read_token),
        ] {
            if token.is_set() && token.expose().len() < MIN_SECRET {
                return Err(ConfigError::invalid(
                    key,
                    format!("must be at least {MIN_SECRET} bytes (or empty: not set)"),
                ));
            }
        }
        if c.read_token.is_set() && c.read_token.expose() == c.admin_token.expose() {
            return Err(ConfigError::invalid(
                "console.read_token",
                "must differ from console.admin_token",
            ));
        }
        for (key, d) in [
            ("console.statement_timeout", c.statement_timeout),
            ("console.acquire_timeout", c.acquire_timeout),
        ] {
            if !(Duration::from_millis(100)..=MAX_CONSOLE_WAIT).contains(&d) {
                return Err(ConfigError::invalid(key, "must be 100ms to 1m"));
            }
        }
        for host in &c.allowed_hosts {
            let name_like = |ch: char| ch.is_ascii_alphanumeric() || "-.:[]_".contains(ch);
            if host != "*" && !host.chars().all(name_like) {
                return Err(ConfigError::invalid(
                    "console.allowed_hosts",
                    format!("{host:?} is not a host name, host:port or *"),
                ));
            }
        }
        if !(Duration::from_secs(1)..=MAX_CONNECTION_LIFETIME).contains(&c.idle_timeout) {
            return Err(ConfigError::invalid(
                "console.idle_timeout",
                "must be 1s to 1h",
            ));
        }
        Ok(())
    }

    fn validate_signing(&self) -> Result<(), ConfigError> {
        let a = &self.amqp;
        if a.signing_key.is_set() && a.signing_key.expose().len() < MIN_SECRET {
            return Err(ConfigError::invalid(
                "amqp.signing_key",
                format!("must be at least {MIN_SECRET} bytes (or empty: no signing)"),
            ));
        }
        if !timeoutd_client::signature::valid_key_id(&a.signing_key_id) {
            return Err(ConfigError::invalid(
                "amqp.signing_key_id",
                "must be 1 to 32 of A-Z a-z 0-9 . _ -",
            ));
        }
        Ok(())
    }

    fn validate_delay(&self) -> Result<(), ConfigError> {
        check_name("delay.exchange", &self.delay_exchange())?;
        check_name("delay.target_exchange", &self.delay.target_exchange)?;
        // Empty names were refused above (1 to 255 bytes); `amq.*` is the broker's.
        if self.delay_exchange().starts_with("amq.") {
            return Err(ConfigError::invalid(
                "delay.exchange",
                "must be a name of our own (not amq.*)",
            ));
        }
        self.delay_destinations()?;
        self.timeout_destinations()?;
        if self.delay.max_delay.is_zero() || self.delay.max_delay > MAX_MAX_DELAY {
            return Err(ConfigError::invalid(
                "delay.max_delay",
                "must be greater than 0s and at most 100 years",
            ));
        }
        if self.delay.max_pending_per_owner == 0 {
            return Err(ConfigError::invalid(
                "delay.max_pending_per_owner",
                "must be at least 1",
            ));
        }
        if self.delay.max_bytes_per_owner.as_u64() < self.delay.max_body.as_u64() {
            return Err(ConfigError::invalid(
                "delay.max_bytes_per_owner",
                "must be at least delay.max_body (one message must fit)",
            ));
        }
        if self.delay.prefetch == 0 {
            return Err(ConfigError::invalid("delay.prefetch", "must be 1 to 65535"));
        }
        if !(1..=MAX_INGEST_CONCURRENCY).contains(&self.delay.ingest_concurrency) {
            return Err(ConfigError::invalid(
                "delay.ingest_concurrency",
                format!("must be 1 to {MAX_INGEST_CONCURRENCY}"),
            ));
        }
        if self.scan.probe_interval > MAX_PROBE_INTERVAL {
            return Err(ConfigError::invalid(
                "scan.probe_interval",
                "must be at most 1m",
            ));
        }
        if self.delay.ingest_linger > MAX_INGEST_LINGER {
            return Err(ConfigError::invalid(
                "delay.ingest_linger",
                "must be 0s to 1s",
            ));
        }
        if !(Duration::from_secs(1)..=MAX_CANCEL_TTL).contains(&self.delay.cancel_ttl) {
            return Err(ConfigError::invalid(
                "delay.cancel_ttl",
                "must be 1s to 366 days",
            ));
        }
        Ok(())
    }

    fn validate_durations(&self) -> Result<(), ConfigError> {
        let e = &self.election;
        for (key, d) in [
            ("election.tick", e.tick),
            ("election.announce_interval", e.announce_interval),
            ("election.member_ttl", e.member_ttl),
            ("amqp.connect_timeout", self.amqp.connect_timeout),
            ("amqp.confirm_timeout", self.amqp.confirm_timeout),
            ("backoff.min", self.backoff.min),
            ("postgres.connect_timeout", self.postgres.connect_timeout),
            (
                "postgres.statement_timeout",
                self.postgres.statement_timeout,
            ),
            ("scan.retry_min", self.scan.retry_min),
            ("shutdown.grace", self.shutdown.grace),
            ("shutdown.timeout", self.shutdown.timeout),
        ] {
            if d.is_zero() {
                return Err(ConfigError::invalid(key, "must be greater than 0"));
            }
        }
        let order = [
            (
                "election.tick",
                e.tick,
                "election.announce_interval",
                e.announce_interval,
            ),
            (
                "election.announce_interval",
                e.announce_interval,
                "election.member_ttl",
                e.member_ttl,
            ),
            (
                "backoff.min",
                self.backoff.min,
                "backoff.max",
                self.backoff.max,
            ),
            (
                "scan.retry_min",
                self.scan.retry_min,
                "scan.retry_max",
                self.scan.retry_max,
            ),
        ];
        for (key, small, other, big) in order {
            if small > big || (key.starts_with("election") && small == big) {
                return Err(ConfigError::invalid(
                    key,
                    format!("must be less than {other} ({small:?} vs {big:?})"),
                ));
            }
        }
        self.validate_batch_bounds()?;
        self.validate_shutdown()?;
        let timing = self.timing();
        if timing.max_lag.is_zero() || timing.max_lag >= timing.member_ttl {
            return Err(ConfigError::invalid(
                "election.max_lag",
                "must be greater than 0 and less than election.member_ttl",
            ));
        }
        if timing.max_lag_exit <= timing.max_lag {
            return Err(ConfigError::invalid(
                "election.max_lag_exit",
                "must be greater than election.max_lag",
            ));
        }
        Ok(())
    }

    /// A stop waits at most `grace` for peers, and closes the connections in part of what
    /// `timeout` leaves after it: the rest must leave room for both.
    fn validate_shutdown(&self) -> Result<(), ConfigError> {
        let s = &self.shutdown;
        if s.timeout > MAX_SHUTDOWN_TIMEOUT {
            return Err(ConfigError::invalid(
                "shutdown.timeout",
                "must be at most 10m",
            ));
        }
        if s.grace >= s.timeout {
            return Err(ConfigError::invalid(
                "shutdown.grace",
                format!(
                    "must be less than shutdown.timeout ({:?} vs {:?}): what is left of it \
                     closes the connections and lets the process exit",
                    s.grace, s.timeout
                ),
            ));
        }
        Ok(())
    }

    /// A batch's transaction idles while its TimeOuts are published and confirmed, and
    /// the server ends an idle transaction after `statement_timeout`: the batch budget
    /// (`batch_budget`) must leave room for one full confirm wait.
    fn validate_batch_bounds(&self) -> Result<(), ConfigError> {
        if self.amqp.confirm_timeout * 2 > self.postgres.statement_timeout {
            return Err(ConfigError::invalid(
                "postgres.statement_timeout",
                "must be at least twice amqp.confirm_timeout",
            ));
        }
        // Held rows are sent within the horizon; half of what the batch may spend on
        // sending leaves the rest for rows already due in the same batch.
        let sending = self
            .batch_budget()
            .saturating_sub(self.amqp.confirm_timeout);
        if self.scan.horizon > sending / 2 {
            return Err(ConfigError::invalid(
                "scan.horizon",
                format!(
                    "must be at most {:?}: half of 3/4 of postgres.statement_timeout minus \
                     amqp.confirm_timeout (the time a batch may spend sending)",
                    sending / 2
                ),
            ));
        }
        let size = self.amqp.max_message_size.as_u64();
        if !(1024..=(512 << 20)).contains(&size) {
            return Err(ConfigError::invalid(
                "amqp.max_message_size",
                "must be between 1KiB and 512MiB (RabbitMQ's own ceiling)",
            ));
        }
        Ok(())
    }
}

fn check_url(key: &str, raw: &str, schemes: &[&str]) -> Result<(), ConfigError> {
    let url = url::Url::parse(raw)
        .map_err(|e| ConfigError::invalid(key, format!("not a URL ({e}): {}", redact_url(raw))))?;
    if !schemes.contains(&url.scheme()) {
        return Err(ConfigError::invalid(
            key,
            format!("scheme must be one of {schemes:?}, got {:?}", url.scheme()),
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(ConfigError::invalid(key, "has no host"));
    }
    Ok(())
}

/// Every broker URL is complete and valid, and all log in as the same user to the same
/// vhost: the user is what our announcements carry as `user_id` (and what admission
/// trusts), the vhost is where the group lives.
fn check_amqp_urls(urls: &SecretUrls) -> Result<(), ConfigError> {
    const KEY: &str = "amqp.url";
    let mut first: Option<(String, String)> = None;
    if urls.is_empty() {
        return Err(ConfigError::invalid(KEY, "names no broker URL"));
    }
    for url in urls.iter() {
        check_url(KEY, url.expose(), &["amqp", "amqps"])?;
        let uri: lapin::uri::AMQPUri = url
            .expose()
            .parse()
            .map_err(|e| ConfigError::invalid(KEY, format!("{e}: {}", url.redacted())))?;
        let this = (uri.authority.userinfo.username, uri.vhost);
        match &first {
            None => first = Some(this),
            Some(f) if *f != this => {
                return Err(ConfigError::invalid(
                    KEY,
                    format!(
                        "every URL must log in as the same user to the same vhost \
                         (user {:?}, vhost {:?} first; user {:?}, vhost {:?} in {})",
                        f.0,
                        f.1,
                        this.0,
                        this.1,
                        url.redacted()
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// A single-host URL, or libpq's multi-host form: each host checked as a URL of its own.
fn check_pg_url(key: &str, url: &SecretUrl) -> Result<(), ConfigError> {
    let hosts = pg_hosts(url.expose())
        .map_err(|e| ConfigError::invalid(key, format!("{e}: {}", url.redacted())))?;
    for host in &hosts.urls {
        check_url(key, host.expose(), &["postgres", "postgresql"])?;
    }
    Ok(())
}

/// A non-empty AMQP short string.
fn check_name(key: &str, s: &str) -> Result<(), ConfigError> {
    if s.is_empty() || s.len() > 255 {
        return Err(ConfigError::invalid(key, "must be 1 to 255 bytes"));
    }
    Ok(())
}

/// A CA file, when set, must be readable now and hold at least one PEM certificate: the
/// TLS libraries would otherwise skip it at connect time, or fail much later.
fn check_ca_file(key: &str, path: Option<&Path>) -> Result<(), ConfigError> {
    let Some(path) = path else {
        return Ok(());
    };
    let pem = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::invalid(key, format!("cannot read {}: {e}", path.display())))?;
    if !pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(ConfigError::invalid(
            key,
            format!("{} holds no PEM certificate", path.display()),
        ));
    }
    Ok(())
}

/// The most batches `scan.concurrency` allows.
pub(crate) const MAX_CONCURRENCY: u32 = 16;
/// Shorter group secrets are guessable; 32 random bytes in hex or base64 are plenty.
const MIN_SECRET: usize = 16;
/// Longer delays overflow no timestamp but are a publisher's mistake.
const MAX_MAX_DELAY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// A year and a day: longer would only keep forgotten cancels.
const MAX_CANCEL_TTL: Duration = Duration::from_secs(366 * 24 * 3600);
/// More parallel inserts than this only compete for the database's cores and the pool.
const MAX_INGEST_CONCURRENCY: u8 = 16;
/// A batch that lingers longer only adds to every message's ingest lag.
const MAX_INGEST_LINGER: Duration = Duration::from_secs(1);
/// A stop longer than this is an orchestrator's business (its own grace period), not ours.
const MAX_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(600);
/// Beyond this a notification lost to a silently dead LISTEN connection waits too long.
const MAX_PROBE_INTERVAL: Duration = Duration::from_secs(60);

/// Shorter would cut a scrape of a large /metrics on a slow link.
const MIN_CONNECTION_LIFETIME: Duration = Duration::from_secs(1);
/// An operator waits no longer than this for a console answer; nor should a statement
/// of the console run longer.
const MAX_CONSOLE_WAIT: Duration = Duration::from_secs(60);
/// Longer lets a held connection outlast any reason to keep it.
const MAX_CONNECTION_LIFETIME: Duration = Duration::from_secs(3600);
/// Counting the tables more often would be a scan loop of its own on the database.
const MIN_PENDING_REFRESH: Duration = Duration::from_millis(100);
/// Counts older than this tell an operator nothing about the backlog.
const MAX_PENDING_REFRESH: Duration = Duration::from_secs(3600);

fn check_range(key: &str, v: u32, min: u32, max: u32) -> Result<(), ConfigError> {
    if !(min..=max).contains(&v) {
        return Err(ConfigError::invalid(
            key,
            format!("must be between {min} and {max}, got {v}"),
        ));
    }
    Ok(())
}
