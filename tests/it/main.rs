//! Integration tests against a real RabbitMQ and Postgres: the test services of
//! `tests/services.yml` unless the `TIMEOUTD_TEST_*` variables name others (see
//! docs/testing.md and `common`). One binary, one module per concern; its tests run as
//! well as threads of one process (`cargo test`) as each in a process (`cargo nextest`).

mod addresses;
mod adversarial;
mod bad_input;
mod cli;
mod client;
mod clients;
mod clocks;
mod common;
mod console;
mod delayed;
mod delayed_chaos;
mod deletes;
mod due_bursts;
mod economy;
mod election;
mod failover;
mod faults;
mod fencing;
mod firing;
mod frames;
mod http;
mod large_rows;
mod migrations;
mod notify_flood;
mod on_time;
mod principals;
mod proxy;
mod signing;
mod sql_api;
mod sql_principals;
mod stopping;
mod tls;
mod trust_delay;
mod trust_election;
mod trust_grants;
mod unroutable;
