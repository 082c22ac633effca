//! timeoutd: a sidecar that fires `TimeOut` messages for a process manager's overdue
//! expectations. See README.md for the contract and the design notes.
//!
//! The library surface is what the binary, the benchmark and the tests use: the client
//! API, configuration, starting a daemon, the pure election, the wire formats, the store's
//! statements. Everything else is crate-private.

pub mod admission;
pub mod bus;
pub mod cli;
pub use timeoutd_client as client;
pub mod commands;
pub mod config;
pub mod daemon;
pub mod election;
pub mod status;
pub mod store;
pub mod wire;

mod backoff;
mod fence;
mod fire;
mod health;
mod http;
mod ingress;
mod metrics;
mod node;
mod scheduler;
mod shutdown;
mod telemetry;
