//! Static checks of the container setup: `docker-compose.yml` and the
//! `Dockerfile` against each other and against `config/default.toml`.
//!
//! Does not use the timeoutd crate; only `serde_yaml` and std.

mod support;

use std::collections::BTreeSet;

use serde_yaml::Value;

use support::{assert_env_vars_name_config_keys, compose, read, service};

const REPLICAS: [&str; 3] = ["timeoutd-1", "timeoutd-2", "timeoutd-3"];
const INFRA: [&str; 2] = ["rabbitmq", "postgres"];
const REQUIRED_ENV: [&str; 4] = [
    "TIMEOUTD__AMQP__URL",
    "TIMEOUTD__POSTGRES__URL",
    "TIMEOUTD__ELECTION__GROUP",
    "TIMEOUTD__HTTP__LISTEN",
];

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// Names of a service's environment variables; `environment` may be a
/// mapping (`KEY: value`) or a list (`- KEY=value`).
fn env_keys(service: &Value) -> BTreeSet<String> {
    match service.get("environment") {
        Some(Value::Mapping(map)) => map
            .keys()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        Some(Value::Sequence(list)) => list
            .iter()
            .filter_map(Value::as_str)
            .map(|item| item.split('=').next().unwrap_or(item).to_owned())
            .collect(),
        _ => BTreeSet::new(),
    }
}

/// Dockerfile instructions as `(INSTRUCTION, arguments)`, with `\`
/// continuation lines joined and comments dropped.
fn dockerfile_instructions() -> Vec<(String, String)> {
    let mut logical = Vec::new();
    let mut current = String::new();
    for line in read("Dockerfile").lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(trimmed);
                logical.push(std::mem::take(&mut current));
            }
        }
    }
    logical
        .iter()
        .filter_map(|l| l.trim().split_once(char::is_whitespace))
        .map(|(instr, args)| (instr.to_uppercase(), args.trim().to_owned()))
        .collect()
}

/// Variable names set by the Dockerfile's `ENV` instructions.
fn dockerfile_env_keys() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for (_, args) in dockerfile_instructions().iter().filter(|(i, _)| i == "ENV") {
        match args.split_once(char::is_whitespace) {
            // Legacy form `ENV KEY value`.
            Some((first, _)) if !first.contains('=') => {
                keys.insert(first.to_owned());
            }
            _ => keys.extend(
                args.split_whitespace()
                    .filter_map(|t| t.split_once('='))
                    .map(|(k, _)| k.to_owned()),
            ),
        }
    }
    keys
}

// ---------------------------------------------------------------------------
// docker-compose.yml
// ---------------------------------------------------------------------------

#[test]
fn compose_defines_infra_and_three_replicas() {
    let compose = compose();
    for name in INFRA.iter().chain(REPLICAS.iter()) {
        service(&compose, name);
    }
}

#[test]
fn replicas_have_required_environment() {
    let compose = compose();
    for name in REPLICAS {
        let keys = env_keys(service(&compose, name));
        for required in REQUIRED_ENV {
            assert!(
                keys.contains(required),
                "{name}: environment lacks {required} (has {keys:?})"
            );
        }
    }
}

#[test]
fn replicas_wait_for_healthy_infra() {
    let compose = compose();
    for name in REPLICAS {
        let depends_on = service(&compose, name)
            .get("depends_on")
            .unwrap_or_else(|| panic!("{name}: no depends_on"));
        for infra in INFRA {
            let condition = depends_on
                .get(infra)
                .and_then(|d| d.get("condition"))
                .and_then(Value::as_str);
            assert_eq!(
                condition,
                Some("service_healthy"),
                "{name}: depends_on.{infra}.condition"
            );
        }
    }
}

#[test]
fn replicas_publish_distinct_host_ports() {
    let compose = compose();
    let mut seen = BTreeSet::new();
    for name in REPLICAS {
        let ports = service(&compose, name)
            .get("ports")
            .and_then(Value::as_sequence);
        let ports = ports.unwrap_or_else(|| panic!("{name}: no ports list"));
        for port in ports.iter().filter_map(Value::as_str) {
            assert!(
                seen.insert(port.to_owned()),
                "{name}: host port mapping {port:?} used twice"
            );
        }
    }
    assert!(
        seen.len() >= REPLICAS.len(),
        "every replica publishes a port: {seen:?}"
    );
}

#[test]
fn rabbitmq_image_has_management_plugin() {
    let compose = compose();
    let image = service(&compose, "rabbitmq")
        .get("image")
        .and_then(Value::as_str);
    let image = image.expect("rabbitmq: no image");
    assert!(
        image.contains("management"),
        "rabbitmq image {image:?} lacks the management plugin"
    );
}

// ---------------------------------------------------------------------------
// Environment variables name real configuration keys
// ---------------------------------------------------------------------------

#[test]
fn compose_env_vars_name_config_keys() {
    let compose = compose();
    for name in REPLICAS {
        let keys = env_keys(service(&compose, name));
        assert_env_vars_name_config_keys(name, keys.iter().map(String::as_str));
    }
}

#[test]
fn dockerfile_env_vars_name_config_keys() {
    let keys = dockerfile_env_keys();
    assert_env_vars_name_config_keys("Dockerfile", keys.iter().map(String::as_str));
}

// ---------------------------------------------------------------------------
// Dockerfile
// ---------------------------------------------------------------------------

#[test]
fn dockerfile_is_multi_stage() {
    let froms = dockerfile_instructions()
        .iter()
        .filter(|(i, _)| i == "FROM")
        .count();
    assert!(
        froms >= 2,
        "Dockerfile has {froms} FROM line(s); expected a multi-stage build"
    );
}

#[test]
fn dockerfile_runs_as_non_root() {
    let instructions = dockerfile_instructions();
    let user = instructions
        .iter()
        .rev()
        .find(|(i, _)| i == "USER")
        .map(|(_, args)| args.as_str());
    let user = user.expect("Dockerfile has no USER line");
    let name = user.split(':').next().unwrap_or(user).trim();
    assert!(
        !matches!(name, "root" | "0" | ""),
        "Dockerfile runs as root (USER {user})"
    );
}
