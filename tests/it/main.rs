//! Integration tests against the real RabbitMQ (127.0.0.1:5672) and Postgres
//! (127.0.0.1:5432) of the machine. One binary, one module per concern.

mod adversarial;
mod bad_input;
mod cli;
mod client;
mod common;
mod election;
mod failover;
mod faults;
mod firing;
mod http;
mod proxy;
mod tls;
mod unroutable;
