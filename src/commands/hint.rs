//! One-line hints for the mistakes newcomers make most (no migrations yet, a wrong URL,
//! a service that is not running, a login or permission refused), printed under the
//! error they cause. Judged from the error's types and codes, never guessed from
//! anything else.

use std::io::ErrorKind;

use crate::bus::BusError;
use crate::config::Settings;
use crate::store::sqlstate::code as sqlstate;

/// SQLSTATEs (Postgres appendix A) with their hint.
const SQLSTATE_HINTS: [(&str, &str); 8] = [
    (
        sqlstate::UNDEFINED_TABLE,
        "the schema has no timeoutd tables yet: run `timeoutd migrate` (or `timeoutd run` \
         with postgres.migrate_on_start = true) with the same postgres.url and \
         postgres.schema",
    ),
    (
        sqlstate::INVALID_SCHEMA_NAME,
        "the schema does not exist yet: run `timeoutd migrate` (or `timeoutd run` with \
         postgres.migrate_on_start = true) with the same postgres.url and postgres.schema",
    ),
    (
        sqlstate::INVALID_PASSWORD,
        "Postgres refused the password: check the user and password in postgres.url",
    ),
    (
        sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
        "Postgres refused the login: check the user in postgres.url (and pg_hba.conf)",
    ),
    (
        sqlstate::INVALID_CATALOG_NAME,
        "the database named in postgres.url does not exist: check its path (/<database>)",
    ),
    (
        sqlstate::INVALID_SQL_STATEMENT_NAME,
        "the server does not know a prepared statement of this connection: a pooler in \
         transaction mode between? PgBouncer needs max_prepared_statements > 0 (1.21 or \
         later); see docs/operating/pgbouncer.md",
    ),
    (
        sqlstate::DUPLICATE_PREPARED_STATEMENT,
        "a prepared statement of this connection exists already on the server: a pooler \
         in transaction mode between? PgBouncer needs max_prepared_statements > 0 (1.21 \
         or later); see docs/operating/pgbouncer.md",
    ),
    (
        sqlstate::INSUFFICIENT_PRIVILEGE,
        "the database role lacks a privilege: see the grants in SECURITY.md (the daemon's \
         role needs USAGE on the schema and rights on its tables; `migrate` needs CREATE)",
    ),
];

/// A hint for `e`, if it is one of the common mistakes.
pub(crate) fn hint(e: &anyhow::Error, settings: &Settings) -> Option<String> {
    let pg = || where_is(settings.postgres.url.expose());
    let amqp = || {
        let at: Vec<String> = settings
            .amqp
            .url
            .iter()
            .map(|u| where_is(u.expose()))
            .collect();
        at.join(", ")
    };
    for cause in e.chain() {
        if let Some(db) = cause.downcast_ref::<sqlx::Error>() {
            return postgres_hint(db, &pg());
        }
        if cause.downcast_ref::<BusError>().is_some() {
            return amqp_hint(e, &amqp());
        }
    }
    None
}

fn postgres_hint(e: &sqlx::Error, at: &str) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code()?;
            SQLSTATE_HINTS
                .iter()
                .find(|(c, _)| *c == code)
                .map(|(_, hint)| (*hint).to_owned())
        }
        sqlx::Error::PoolTimedOut => Some(format!(
            "no connection to Postgres within postgres.connect_timeout: is it running and \
             reachable at {at} (postgres.url)?"
        )),
        sqlx::Error::Io(io) => Some(io_hint(io.kind(), "Postgres", at, "postgres.url")),
        sqlx::Error::Tls(_) => Some(format!(
            "TLS with Postgres at {at} failed: check sslmode in postgres.url and \
             postgres.ca_file"
        )),
        _ => None,
    }
}

fn amqp_hint(e: &anyhow::Error, at: &str) -> Option<String> {
    let text = format!("{e:#}");
    if text.contains("ACCESS_REFUSED - Login was refused") {
        return Some("RabbitMQ refused the login: check the user and password in amqp.url".into());
    }
    if text.contains("NOT_ALLOWED - vhost") {
        return Some(format!(
            "the vhost named in amqp.url does not exist on {at}, or its user may not use it: \
             `rabbitmqctl list_vhosts`, `rabbitmqctl set_permissions`"
        ));
    }
    if text.contains("ACCESS_REFUSED") {
        return Some(
            "the broker user lacks a permission (configure, write or read on an exchange or \
             queue): see the permissions in SECURITY.md"
                .into(),
        );
    }
    let io = e.chain().find_map(|c| c.downcast_ref::<std::io::Error>())?;
    Some(io_hint(io.kind(), "RabbitMQ", at, "amqp.url"))
}

fn io_hint(kind: ErrorKind, service: &str, at: &str, key: &str) -> String {
    match kind {
        ErrorKind::ConnectionRefused => {
            format!("nothing listens at {at}: is {service} running there, is {key} right?")
        }
        _ => format!("cannot reach {service} at {at}: check {key} and the network"),
    }
}

/// `host:port` of a URL (never its user or password), for hints.
fn where_is(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) => match (u.host_str(), u.port_or_known_default()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (Some(host), None) => host.to_owned(),
            _ => "the host of the URL".to_owned(),
        },
        Err(_) => hosts_of(url).unwrap_or_else(|| "the host of the URL".to_owned()),
    }
}

/// The host list of a libpq multi-host URL (`postgres://u:p@h1:5432,h2:5433/db`), which
/// is no URL to a URL parser; never the user or password.
fn hosts_of(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?']).next()?;
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    (!hosts.is_empty()).then(|| hosts.replace(',', ", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings::load_from(
            None,
            [(
                "TIMEOUTD__POSTGRES__URL".to_owned(),
                "postgres://pm:hunter2@db.example:6543/app".to_owned(),
            )],
        )
        .expect("valid")
    }

    #[test]
    fn a_postgres_that_does_not_answer_names_where_it_was_looked_for() {
        let e = anyhow::Error::new(crate::store::StoreError::Db(sqlx::Error::PoolTimedOut))
            .context("counting expectations");
        let hint = hint(&e, &settings()).expect("a hint");
        assert!(hint.contains("db.example:6543"), "{hint}");
        assert!(!hint.contains("hunter2"), "{hint}");
    }

    #[test]
    fn a_refused_connection_to_the_broker_says_nothing_listens() {
        let io = std::io::Error::new(ErrorKind::ConnectionRefused, "refused");
        let e = anyhow::Error::new(BusError::Amqp(lapin::Error::from(io)))
            .context("connecting to RabbitMQ");
        let hint = hint(&e, &settings()).expect("a hint");
        assert!(
            hint.contains("127.0.0.1:5672") && hint.contains("RabbitMQ"),
            "{hint}"
        );
    }

    #[test]
    fn a_multi_host_postgres_url_is_named_by_its_hosts_without_its_password() {
        let at =
            where_is("postgres://pm:hunter2@db1:5432,db2:5433/app?target_session_attrs=primary");
        assert_eq!(at, "db1:5432, db2:5433");
    }

    #[test]
    fn other_errors_get_no_hint() {
        let e = anyhow::anyhow!("something else");
        assert_eq!(hint(&e, &settings()), None);
    }
}
