//! Settings: built-in defaults (config/default.toml), an optional file, then
//! `TIMEOUTD__SECTION__KEY` environment variables; validation and redaction.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use crate::destinations::{DestinationError, Destinations, Names};
use crate::election::{Rule, Timing};

mod addresses;
mod secret_url;
mod validate;
pub use addresses::{PgHosts, SecretUrls, TargetSession, pg_hosts};
pub use secret_url::{Secret, SecretUrl};

/// The defaults shipped with the binary; the same file documents every key.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// A refused configuration: which key and why. Exit code 2.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid configuration: {key}: {reason}")]
    Invalid { key: String, reason: String },
    /// The file or the environment could not be read into settings (the config crate's
    /// message names the key): its text is ours, not a source to print twice.
    #[error("invalid configuration: {0}")]
    Load(config::ConfigError),
}

impl From<config::ConfigError> for ConfigError {
    fn from(e: config::ConfigError) -> Self {
        Self::Load(e)
    }
}

impl ConfigError {
    fn invalid(key: &str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            key: key.to_owned(),
            reason: reason.into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub amqp: Amqp,
    pub postgres: Postgres,
    pub election: Election,
    pub scan: Scan,
    pub timeouts: Timeouts,
    pub http: Http,
    pub log: Log,
    pub backoff: Backoff,
    pub shutdown: Shutdown,
    pub delay: Delay,
    pub console: Console,
    pub runtime: Runtime,
}

/// The threads the daemon's tasks run on, which also drive its timers and sockets (the
/// HTTP endpoints and lapin's frame handling have threads of their own).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Runtime {
    /// Worker threads of the async runtime; 0: one per core (or `TOKIO_WORKER_THREADS`).
    /// One by default: the tasks hand work to each other and to the broker's I/O thread
    /// all the time, and on the few cores a sidecar shares, a second worker mostly wakes
    /// to steal a task from the first (docs/performance.md).
    pub worker_threads: u32,
}

impl Runtime {
    /// The number to give the runtime builder; `None`: its own default.
    pub fn workers(&self) -> Option<usize> {
        usize::try_from(self.worker_threads).ok().filter(|&n| n > 0)
    }
}

/// The web console on `http.listen` under `/console` (docs/operating/console.md).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Console {
    /// Off by default: `/console` answers 404.
    pub enabled: bool,
    /// Needed for every action (cancel, release, retry, reschedule) and enough to read
    /// rows; empty: the console takes no action.
    pub admin_token: Secret,
    /// Enough to read rows (failing, held, search, a row's detail); empty: only the
    /// admin token reads them.
    pub read_token: Secret,
    /// The server's bound on each of the console's statements.
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    /// How long a request waits for the console's one connection (or for it to
    /// connect); then it is answered 503.
    #[serde(with = "humantime_serde")]
    pub acquire_timeout: Duration,
    /// The console's connection is closed after this long unused.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Host names (with or without a port) the console answers to besides loopback
    /// names and `http.listen`'s host; `*`: any (see [`Console::host_allowed`]).
    #[serde(deserialize_with = "names")]
    pub allowed_hosts: Vec<String>,
}

impl Console {
    /// Whether a request's `Host` header (`name`, `name:port`, `[v6]:port`) is one the
    /// console answers to: a loopback name (`localhost`, `127.0.0.1`, `[::1]`), the
    /// host of `listen` unless it is unspecified (`0.0.0.0`, `[::]`), or one of
    /// `allowed_hosts` (a listed name without a port matches any port). Names are
    /// compared without letter case; a name another DNS name resolves to (DNS
    /// rebinding) matches none of these.
    pub fn host_allowed(&self, listen: &str, host: &str) -> bool {
        if self.allowed_hosts.iter().any(|a| a == "*") {
            return true;
        }
        let host = host.trim().to_ascii_lowercase();
        let (name, _) = split_host(&host);
        if name.is_empty() {
            return false;
        }
        let listen = listen.to_ascii_lowercase();
        let (listen_name, _) = split_host(&listen);
        let unspecified = matches!(listen_name, "0.0.0.0" | "[::]" | "");
        let loopback = ["localhost", "127.0.0.1", "[::1]"];
        loopback.contains(&name)
            || (!unspecified && listen_name == name)
            || self.allowed_hosts.iter().any(|a| {
                let a = a.trim().to_ascii_lowercase();
                match split_host(&a) {
                    (n, None) => n == name,
                    (_, Some(_)) => a == host,
                }
            })
    }
}

/// `name[:port]` or `[v6][:port]` as the name and the port if any.
fn split_host(host: &str) -> (&str, Option<&str>) {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => {
                let port = host[end + 1..].strip_prefix(':');
                (&host[..=end], port)
            }
            None => (host, None),
        };
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => (name, Some(port)),
        _ => (host, None),
    }
}

/// Delayed messages (contract section 7).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Delay {
    pub enabled: bool,
    /// Ingress exchange and queue; `{group}` stands for `election.group`.
    pub exchange: String,
    /// Where a message goes when it names no exchange of its own.
    pub target_exchange: String,
    /// Exchanges (names or glob patterns) a message may name besides `target_exchange`;
    /// some are refused whatever is listed (see `destinations::Destinations`). A list
    /// in TOML, a comma-separated string in the environment.
    #[serde(deserialize_with = "names")]
    pub allowed_exchanges: Vec<String>,
    /// Unacknowledged messages a node holds at once.
    pub prefetch: u16,
    /// Ingest transactions a node runs at once; each inserts at most
    /// `prefetch / ingest_concurrency` messages, so the broker keeps delivering while
    /// the previous batch commits.
    pub ingest_concurrency: u8,
    /// How long a batch waits for more messages after its first arrived: fewer, larger
    /// transactions when messages arrive faster than one commits.
    #[serde(with = "humantime_serde")]
    pub ingest_linger: Duration,
    /// Larger bodies are not stored: the message is kept held without its body.
    pub max_body: bytesize::ByteSize,
    /// A message due later than this after its arrival is held, never delivered.
    #[serde(with = "humantime_serde")]
    pub max_delay: Duration,
    /// Messages one owner (AMQP `user_id`, or anonymous) may have stored at once;
    /// more are rejected to the broker.
    pub max_pending_per_owner: u64,
    /// Bytes (bodies and properties) one owner may have stored at once; more are
    /// rejected to the broker.
    pub max_bytes_per_owner: bytesize::ByteSize,
    /// How long a cancel message is remembered: its message arriving later (through
    /// another node, or redelivered) is dropped as cancelled.
    #[serde(with = "humantime_serde")]
    pub cancel_ttl: Duration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Backoff {
    #[serde(with = "humantime_serde")]
    pub min: Duration,
    #[serde(with = "humantime_serde")]
    pub max: Duration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Amqp {
    /// One or more broker URLs (see `docs/operating/addresses.md`).
    pub url: SecretUrls,
    pub announce_exchange: String,
    #[serde(deserialize_with = "optional_path", serialize_with = "ser_opt_path")]
    pub ca_file: Option<PathBuf>,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub confirm_timeout: Duration,
    /// Largest TimeOut the broker takes (its `max_message_size`); a larger one would
    /// close the channel, so it is refused before publishing, as that row's failure.
    pub max_message_size: bytesize::ByteSize,
    /// When set, every TimeOut and delayed message is published with an HMAC-SHA256
    /// signature header under this key (`timeoutd_client::signature`).
    pub signing_key: Secret,
    /// Names `signing_key` in the signature, so consumers can hold several keys while
    /// one replaces another.
    pub signing_key_id: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Postgres {
    pub url: SecretUrl,
    /// Where what needs a session of its own connects ("" = `url`); see
    /// [`Postgres::session_url`].
    #[serde(rename = "session_url")]
    pub session: SecretUrl,
    pub schema: String,
    pub migrate_on_start: bool,
    #[serde(deserialize_with = "optional_path", serialize_with = "ser_opt_path")]
    pub ca_file: Option<PathBuf>,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    pub max_connections: u32,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Election {
    pub group: String,
    #[serde(with = "humantime_serde")]
    pub tick: Duration,
    #[serde(with = "humantime_serde")]
    pub announce_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub member_ttl: Duration,
    #[serde(deserialize_with = "optional_duration", serialize_with = "ser_opt_dur")]
    pub max_lag: Option<Duration>,
    #[serde(deserialize_with = "optional_duration", serialize_with = "ser_opt_dur")]
    pub max_lag_exit: Option<Duration>,
    /// Who announces every interval (see `election::Rule`).
    pub rule: AnnounceRule,
    /// With rule `lowest`: how many of the lowest candidates announce.
    pub announcers: u32,
    /// Group secret: when set, an announcement counts only with a valid HMAC under it
    /// (instead of coming from the daemons' own broker user).
    pub secret: Secret,
    /// Also count announcements without proof (nodes of earlier versions), for a
    /// rolling upgrade only.
    pub accept_unauthenticated: bool,
    /// Only for announcements of earlier versions (no `after`), judged by their
    /// `sent_at`: how far such a sender's clock may be from ours.
    #[serde(with = "humantime_serde")]
    pub max_clock_skew: Duration,
}

/// `election.rule`: `lowest` (O(N) deliveries per interval) or `all` (every node
/// announces, as earlier versions do: O(N²)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AnnounceRule {
    Lowest,
    All,
}

/// Where TimeOuts may go (contract section 8), judged when a row is written through
/// the SQL API and again when it fires.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Timeouts {
    /// Exchanges (names or glob patterns) a TimeOut may be published to. The
    /// announcement and ingress exchanges never; `amq.*` only when named exactly.
    #[serde(deserialize_with = "names")]
    pub allowed_exchanges: Vec<String>,
    /// The default exchange `""` (straight into any queue by name) as a destination.
    pub allow_default_exchange: bool,
    /// Largest payload `expect()` takes, as JSON text.
    pub max_payload: bytesize::ByteSize,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scan {
    pub batch_size: u32,
    pub concurrency: u32,
    /// Rows due within this much are locked ahead and published at their deadline;
    /// zero locks rows only once they are due.
    #[serde(with = "humantime_serde")]
    pub horizon: Duration,
    /// Of `concurrency`, batches kept for rows that came due within the last second
    /// while a backlog drains (0: strictly oldest first).
    pub fresh_slots: u32,
    /// How often the due index is probed besides the notifications while the LISTEN
    /// connection is up (every `election.tick` while it is not, and never more often).
    #[serde(with = "humantime_serde")]
    pub probe_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub retry_min: Duration,
    #[serde(with = "humantime_serde")]
    pub retry_max: Duration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Http {
    pub listen: String,
    /// How often the pending gauges are counted, by one task on a connection of its own:
    /// `/metrics` only ever shows the last counts (and their age).
    #[serde(with = "humantime_serde")]
    pub pending_refresh: Duration,
    /// Open connections one remote address may hold (loopback peers: unlimited).
    pub max_connections_per_client: u32,
    /// A connection is closed this long after it was accepted, whatever it is doing.
    #[serde(with = "humantime_serde")]
    pub connection_lifetime: Duration,
    /// Loopback peers are not held to `max_connections_per_client`.
    pub exempt_loopback: bool,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Log {
    pub format: LogFormat,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Shutdown {
    /// How long a stop waits for what peers must answer: the batches in flight (confirms,
    /// commit), the `leaving` announcement, the delay ingress' acknowledgements. What is
    /// not done by then is given up (exit code 5).
    #[serde(with = "humantime_serde")]
    pub grace: Duration,
    /// Bound on the whole stop, from the request to the exit: connections are closed
    /// within half of what it leaves after `grace`; past it the process exits whatever.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

/// A list of names, or one string of comma-separated names (how the environment can
/// give a list).
fn names<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Names {
        List(Vec<String>),
        Joined(String),
    }
    let names = match Names::deserialize(d)? {
        Names::List(l) => l,
        Names::Joined(s) => s.split(',').map(str::to_owned).collect(),
    };
    Ok(names
        .into_iter()
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect())
}

/// `""` means "not set" for optional durations, so the default file can list the key.
fn optional_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let s = String::deserialize(d)?;
    if s.trim().is_empty() {
        return Ok(None);
    }
    humantime::parse_duration(s.trim())
        .map(Some)
        .map_err(serde::de::Error::custom)
}

fn ser_opt_dur<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(&humantime::format_duration(*d).to_string()),
        None => s.serialize_str(""),
    }
}

/// A key's value from the other keys.
type Derive = fn(&config::Config) -> Result<u32, config::ConfigError>;

/// Keys whose default follows another key's value, so that no default ever makes a
/// valid value of another key invalid: (key, its value from the other keys). Left ""
/// (the shipped default), a key gets that value; set, it is checked as usual.
const DERIVED: [(&str, Derive); 2] = [
    // One batch kept for fresh rows, when there is one to spare for the backlog.
    ("scan.fresh_slots", |c| {
        Ok(u32::from(c.get::<u32>("scan.concurrency")? > 1))
    }),
    // The batches, the LISTEN connection, the probes and room for the ingress; never
    // fewer than the 8 earlier versions shipped with.
    ("postgres.max_connections", |c| {
        Ok(c.get::<u32>("scan.concurrency")?.saturating_add(4).max(8))
    }),
];

/// `layered` with every [`DERIVED`] key left "" replaced by its derived value.
fn derive_defaults(layered: config::Config) -> Result<config::Config, config::ConfigError> {
    let mut resolved = config::Config::builder().add_source(layered.clone());
    for (key, derive) in DERIVED {
        let unset = layered.get_string(key).is_ok_and(|v| v.trim().is_empty());
        if unset {
            resolved = resolved.set_override(key, derive(&layered)?)?;
        }
    }
    resolved.build()
}

/// "" is how the contract spells "unset", both ways.
fn ser_opt_path<S: serde::Serializer>(p: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(
        &p.as_deref()
            .map(Path::display)
            .map(|p| p.to_string())
            .unwrap_or_default(),
    )
}

fn optional_path<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PathBuf>, D::Error> {
    let s = String::deserialize(d)?;
    Ok((!s.trim().is_empty()).then(|| PathBuf::from(s.trim())))
}

impl Postgres {
    /// `postgres.session_url` when set: the LISTEN session and the migrations (an
    /// advisory lock held across statements) connect there, and `url` is taken to go
    /// through a pooler in transaction mode, which cannot keep settings per client
    /// session (docs/operating/pgbouncer.md).
    pub fn session_url(&self) -> Option<&SecretUrl> {
        Some(&self.session).filter(|u| !u.expose().trim().is_empty())
    }
}

impl Settings {
    /// Defaults, then `file`, then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_from(file, std::env::vars())
    }

    /// As [`Settings::load`] with an explicit environment (tests).
    pub fn load_from(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let env: config::Map<String, String> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with("TIMEOUTD__"))
            .collect();
        let mut builder = config::Config::builder().add_source(config::File::from_str(
            DEFAULT_TOML,
            config::FileFormat::Toml,
        ));
        if let Some(path) = file {
            builder = builder.add_source(config::File::from(path).required(true));
        }
        let layered = builder
            .add_source(
                config::Environment::with_prefix("TIMEOUTD")
                    .prefix_separator("__")
                    .separator("__")
                    .source(Some(env)),
            )
            .build()?;
        let settings: Settings = derive_defaults(layered)?.try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Where delayed messages may go (the rule, built from `delay.*` and
    /// `amqp.announce_exchange`); refused when `delay.target_exchange` is one of the
    /// exchanges never allowed, or a pattern is not one.
    pub fn delay_destinations(&self) -> Result<Destinations, ConfigError> {
        Destinations::new(Names {
            target: &self.delay.target_exchange,
            allowed: &self.delay.allowed_exchanges,
            announce: &self.amqp.announce_exchange,
            ingress_template: &self.delay.exchange,
            ingress: &self.delay_exchange(),
        })
        .map_err(|e| match e {
            DestinationError::Target(why) => ConfigError::invalid("delay.target_exchange", why),
            e @ DestinationError::Pattern { .. } => {
                ConfigError::invalid("delay.allowed_exchanges", e.to_string())
            }
        })
    }

    /// Where TimeOuts may go (the rule, built from `timeouts.*`, `delay.exchange` and
    /// `amqp.announce_exchange`); refused when a pattern is not one.
    pub fn timeout_destinations(&self) -> Result<Destinations, ConfigError> {
        Destinations::for_timeouts(
            Names {
                target: "",
                allowed: &[],
                announce: &self.amqp.announce_exchange,
                ingress_template: &self.delay.exchange,
                ingress: &self.delay_exchange(),
            },
            &self.timeouts.allowed_exchanges,
            self.timeouts.allow_default_exchange,
        )
        .map_err(|e| ConfigError::invalid("timeouts.allowed_exchanges", e.to_string()))
    }

    /// `delay.exchange` with `{group}` replaced: the ingress exchange and queue name.
    pub fn delay_exchange(&self) -> String {
        self.delay.exchange.replace("{group}", &self.election.group)
    }

    /// How long one scan batch may take from locking its rows to its commit: three
    /// quarters of `postgres.statement_timeout`, the rest is left for delete and commit.
    pub fn batch_budget(&self) -> Duration {
        self.postgres.statement_timeout.mul_f64(0.75)
    }

    /// Client-side bound on one database step (`statement_timeout` + `connect_timeout`):
    /// the server's own bound cannot help when the network to it drops packets.
    pub fn db_bound(&self) -> Duration {
        self.postgres.statement_timeout + self.postgres.connect_timeout
    }

    pub fn timing(&self) -> Timing {
        let e = &self.election;
        let mut t = Timing::new(e.announce_interval, e.member_ttl);
        t.max_lag = e.max_lag.unwrap_or(t.max_lag);
        t.max_lag_exit = e.max_lag_exit.unwrap_or(t.max_lag_exit);
        t.rule = match e.rule {
            AnnounceRule::All => Rule::All,
            AnnounceRule::Lowest => Rule::Lowest {
                // At most 100 (validated): fits any usize.
                announcers: e.announcers as usize,
            },
        };
        t
    }

    pub fn http_listen(&self) -> Result<SocketAddr, ConfigError> {
        self.http
            .listen
            .parse()
            .map_err(|e| ConfigError::invalid("http.listen", format!("not a host:port ({e})")))
    }
}

#[cfg(test)]
mod tests;
