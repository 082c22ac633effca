//! Integration tests against a real RabbitMQ and Postgres: the machine's own
//! (127.0.0.1:5672, 127.0.0.1:5432) unless `TIMEOUTD_TEST_AMQP_URL`,
//! `TIMEOUTD_TEST_PG_URL` and `TIMEOUTD_TEST_RABBITMQCTL` name others. One binary, one
//! module per concern.

mod addresses;
mod adversarial;
mod bad_input;
mod cli;
mod client;
mod common;
mod delayed;
mod delayed_chaos;
mod deletes;
mod election;
mod failover;
mod faults;
mod fencing;
mod firing;
mod http;
mod large_rows;
mod on_time;
mod principals;
mod proxy;
mod stopping;
mod tls;
mod trust_delay;
mod trust_election;
mod trust_grants;
mod unroutable;
