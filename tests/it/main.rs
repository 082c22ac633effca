//! Integration tests against the real RabbitMQ (127.0.0.1:5672) and Postgres
//! (127.0.0.1:5432) of the machine. One binary, one module per concern.

mod cli;
mod common;
mod election;
mod failover;
mod firing;
mod http;
mod tls;
mod unroutable;
