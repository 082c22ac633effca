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

// ---------------------------------------------------------------------------
// Trust (contract section 8): what the containers may do, who may reach them
// ---------------------------------------------------------------------------

/// The demo's own containers, built from the project's image like the replicas.
const DEMO: [&str; 2] = ["demo-producer", "demo-consumer"];
/// What RabbitMQ and Postgres keep: their entrypoints start as root, chown their data and
/// switch to their own user.
const INFRA_CAPS: [&str; 5] = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SETGID", "SETUID"];

fn strings(service: &Value, key: &str) -> Vec<String> {
    service
        .get(key)
        .and_then(Value::as_sequence)
        .map(|items| {
            items
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// The host address of a published port (short `[HOST:]HOST_PORT:CONTAINER_PORT` or long
/// syntax); `None` when it publishes on every interface.
fn published_on(port: &Value) -> Option<String> {
    match port {
        Value::String(short) => {
            let parts: Vec<&str> = short.split(':').collect();
            (parts.len() == 3).then(|| parts[0].to_owned())
        }
        Value::Mapping(_) => port
            .get("host_ip")
            .and_then(Value::as_str)
            .map(str::to_owned),
        Value::Tagged(tagged) => published_on(&tagged.value),
        _ => None,
    }
}

fn assert_ports_on_loopback(origin: &str, services: &Value) {
    let services = services.as_mapping().expect("services is a mapping");
    for (name, service) in services {
        let ports = service.get("ports").map(|p| match p {
            Value::Tagged(tagged) => tagged.value.clone(),
            other => other.clone(),
        });
        for port in ports.iter().filter_map(Value::as_sequence).flatten() {
            assert_eq!(
                published_on(port).as_deref(),
                Some("127.0.0.1"),
                "{origin}: {name:?} publishes {port:?} beyond this machine"
            );
        }
    }
}

#[test]
fn every_published_port_is_on_loopback() {
    let compose = compose();
    assert_ports_on_loopback("docker-compose.yml", &compose["services"]);
    let ci: Value = serde_yaml::from_str(&read(".ci/compose.ci.yml")).expect("compose.ci.yml");
    assert_ports_on_loopback(".ci/compose.ci.yml", &ci["services"]);
}

#[test]
fn timeoutd_containers_are_read_only_without_capabilities() {
    let compose = compose();
    for name in REPLICAS.iter().chain(DEMO.iter()) {
        let s = service(&compose, name);
        assert_eq!(
            s.get("read_only").and_then(Value::as_bool),
            Some(true),
            "{name}"
        );
        assert_eq!(strings(s, "cap_drop"), ["ALL"], "{name}: cap_drop");
        assert!(strings(s, "cap_add").is_empty(), "{name}: cap_add");
        assert!(
            strings(s, "security_opt").contains(&"no-new-privileges:true".to_owned()),
            "{name}: security_opt"
        );
    }
}

#[test]
fn infra_keeps_only_the_capabilities_to_switch_user() {
    let compose = compose();
    for name in INFRA {
        let s = service(&compose, name);
        assert_eq!(strings(s, "cap_drop"), ["ALL"], "{name}: cap_drop");
        for cap in strings(s, "cap_add") {
            assert!(INFRA_CAPS.contains(&cap.as_str()), "{name}: cap_add {cap}");
        }
        assert!(
            strings(s, "security_opt").contains(&"no-new-privileges:true".to_owned()),
            "{name}: security_opt"
        );
    }
}

/// The runtime stage strips every setuid/setgid bit and fails the build if one is left.
#[test]
fn runtime_image_has_no_setuid_programs() {
    let instructions = dockerfile_instructions();
    let runtime_from = instructions
        .iter()
        .rposition(|(i, _)| i == "FROM")
        .expect("a runtime stage");
    let runtime: Vec<&String> = instructions[runtime_from..]
        .iter()
        .filter(|(i, _)| i == "RUN")
        .map(|(_, args)| args)
        .collect();
    let strips = runtime
        .iter()
        .any(|r| r.contains("-perm /6000") && r.contains("chmod a-s"));
    let checks = runtime.iter().any(|r| {
        r.contains("if find / -xdev -perm /6000 -type f | grep .") && r.contains("exit 1")
    });
    assert!(strips && checks, "runtime RUN lines: {runtime:?}");
}
