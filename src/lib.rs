//! timeoutd: a sidecar that fires `TimeOut` messages for a process manager's overdue
//! expectations. See README.md for the contract and the design notes.

pub mod announcement;
pub mod backoff;
pub mod bus;
pub mod cli;
pub mod client;
pub mod commands;
pub mod config;
pub mod daemon;
pub mod election;
pub mod health;
pub mod http;
pub mod metrics;
pub mod scan;
pub mod scheduler;
pub mod store;
pub mod telemetry;
