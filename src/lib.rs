//! timeoutd: a sidecar that fires `TimeOut` messages for a process manager's overdue
//! expectations, and delays any AMQP message published to it. The user guide is in
//! `docs/` (start at `docs/README.md`); the architecture in `docs/design/architecture.md`.
//!
//! The library surface is what the binary, the benchmark, the simulator and the tests
//! use: the client API, configuration, starting a daemon, the pure election and its
//! admission, the wire formats, the store's statements. Everything else is
//! crate-private.
//!
//! # Module map
//!
//! Imports point down this list: the pure state machines and formats know nothing of the
//! tasks and adapters that drive them.
//!
//! Commands and the daemon:
//! - [`cli`]: the command line (clap): the commands and their flags.
//! - [`commands`]: one function per command (`run`, `migrate`, `check-config`, `expect`,
//!   `members`, `pending`, `cancel`) and the exit codes.
//! - [`daemon`]: start the node, firing, ingress, fencing and HTTP tasks, supervise them,
//!   stop within `shutdown.grace` / `shutdown.timeout` and say what was given up.
//! - [`config`]: settings from the built-in defaults, a file and the environment;
//!   validation naming the key; URLs and secrets that never print.
//!
//! Tasks (crate-private):
//! - `node`: the node task; owns the [`election::Election`], drives it with ticks,
//!   announcements and the node's health, publishes the lease view the firing task checks.
//! - `firing`: the firing wing, one folder (`src/firing/`; its module docs follow one
//!   `TimeOut` through it): `firing::task` runs while active what the pure
//!   `firing::pacer` says (start a batch, probe the due index), `firing::notice` turns
//!   `NOTIFY` into pacer input, `firing::batch` is one transaction (lock, publish each row
//!   at its due time by `firing::clock`, one fate per row, settle, commit), `firing::row` all
//!   it knows of a kind of row, `firing::large` reads large contents beside the sending,
//!   `firing::memory` what it keeps between batches about single rows, `firing::report`
//!   what a finished batch tells, `firing::checks` a passive node's checks.
//! - `ingress`: the delay ingress task (every node): store arriving delayed messages,
//!   acknowledge after the commit, give them back while the database is away.
//! - `fence`: the active node ends the database sessions of departed or withdrawn members
//!   so the rows they held fire now.
//! - `http`: `/healthz`, `/readyz`, `/status`, `/metrics` on a thread of its own;
//!   `http::guard` bounds connections per client and their lifetime.
//! - `console`: the web console under `/console` (off by default): the embedded page,
//!   tokens, its own host names, failed tokens throttled and cross-site refusals;
//!   `console::api` reads rows and acts through the SQL API on one database connection
//!   of its own.
//!
//! Pure logic:
//! - [`kind`]: the kinds of due rows (expectations, delayed messages): the one name the
//!   scan, the store, the metrics, the CLI and the console share.
//! - [`election`]: the GUID election as a pure state machine (no clock, no I/O).
//! - [`admission`]: which announcements count (broker user, group secret, replays), before
//!   the election hears them.
//! - [`destinations`]: where a delayed message may go (contract section 8): the one rule,
//!   judged at ingest, at delivery and when the configuration loads.
//! - [`wire`]: every wire format without lapin: the announcement, the TimeOut, the delayed
//!   message (what an arriving one asks for, what a due one becomes), the signature of
//!   what timeoutd publishes, AMQP field values that survive jsonb.
//! - `backoff`: capped exponential backoff with jitter.
//! - `health`: since when each of the node's own checks has been failing.
//! - `shutdown`: the exit reasons, waits that give way to a stop, what a stop gave up.
//!
//! Adapters:
//! - [`bus`]: RabbitMQ through lapin, the only module that sees it: connect, declare,
//!   announce, the confirm-channel pool, publishing a batch with each message's fate,
//!   the ingress queue, and what the broker has shown it accepts from us.
//! - [`store`]: Postgres through sqlx: pool, migrations, `LISTEN`, the due-row statements
//!   of each table, settling a batch (delete, charge, park), fencing statements.
//! - [`status`]: what a node knows about itself ([`status::Status`]), for `/status`,
//!   readiness, liveness and the tests; it renders the metrics, which each task holds.
//! - `metrics`: the Prometheus series, one method per event.
//! - `telemetry`: logging (text or JSON) and the limiter that keeps a flood of bad input
//!   to a few lines.
//! - [`client`]: the `timeoutd-client` crate, re-exported: what a Rust process manager
//!   links to write expectations and decode TimeOuts.

pub mod admission;
pub mod bus;
pub mod cli;
pub use timeoutd_client as client;
pub mod commands;
pub mod config;
pub mod daemon;
pub mod destinations;
pub mod election;
pub mod kind;
pub mod status;
pub mod store;
pub mod wire;

mod backoff;
mod console;
mod fence;
mod firing;
mod health;
mod http;
mod ingress;
mod metrics;
mod node;
mod shutdown;
mod telemetry;
