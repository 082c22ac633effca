//! Static checks of the deployment files: the Kubernetes sidecar example, the
//! Prometheus alerts, the Grafana dashboard and the compose demo. They must name only
//! metrics timeoutd exports, configuration keys it knows and endpoints it serves.
//!
//! Does not use the timeoutd crate; only `serde_yaml`, `serde_json` and std.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use serde_yaml::Value;

use support::{assert_env_vars_name_config_keys, compose, default_toml, read, service};

const K8S: &str = "deploy/kubernetes/sidecar.yaml";
const NETWORK_POLICY: &str = "deploy/kubernetes/networkpolicy.yaml";
const ALERTS: &str = "deploy/prometheus/alerts.yaml";
const DASHBOARD: &str = "deploy/grafana/timeoutd.json";

/// The metrics reference, which a unit test (src/metrics/tests.rs) holds to what
/// `/metrics` exports.
const METRICS_DOC: &str = "docs/operating/metrics.md";
const ALERTS_TEST: &str = "deploy/prometheus/alerts_test.yaml";
const RUNBOOKS: &str = "docs/operating/alerts.md";

/// Every metric timeoutd exports (histograms by their base name), from the first column
/// of the reference table of docs/operating/metrics.md.
fn metrics() -> BTreeSet<String> {
    let names: BTreeSet<String> = read(METRICS_DOC)
        .lines()
        .filter_map(|l| l.strip_prefix("| `timeoutd_"))
        .filter_map(|l| l.split_once('`'))
        .map(|(name, _)| format!("timeoutd_{name}"))
        .collect();
    assert!(
        names.len() > 20,
        "{METRICS_DOC}: no reference table? {names:?}"
    );
    names
}
const HISTOGRAM_SUFFIXES: [&str; 3] = ["_bucket", "_sum", "_count"];
const REQUIRED_ALERTS: [&str; 6] = [
    "TimeoutdForeignAnnouncements",
    "TimeoutdNoActiveNode",
    "TimeoutdSplitBrain",
    "TimeoutdLatenessHigh",
    "TimeoutdPublishFailures",
    "TimeoutdFailingRows",
];
const SIDECAR: &str = "timeoutd";
const HTTP_PORT: u64 = 9464;
const SIDECAR_ENV: [&str; 3] = [
    "TIMEOUTD__AMQP__URL",
    "TIMEOUTD__POSTGRES__URL",
    "TIMEOUTD__ELECTION__GROUP",
];
const SECRET_ENV: [&str; 2] = ["TIMEOUTD__AMQP__URL", "TIMEOUTD__POSTGRES__URL"];
const DEMO_QUEUE: &str = "demo.timeouts";

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// `value.a.b.c` for `path = ["a", "b", "c"]`, or a panic naming the path.
fn at<'a>(value: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(value, |v, key| {
        v.get(key)
            .unwrap_or_else(|| panic!("missing {} in {v:?}", path.join(".")))
    })
}

fn str_at<'a>(value: &'a Value, path: &[&str]) -> &'a str {
    let found = at(value, path);
    found
        .as_str()
        .unwrap_or_else(|| panic!("{} is not a string: {found:?}", path.join(".")))
}

fn u64_at(value: &Value, path: &[&str]) -> u64 {
    let found = at(value, path);
    found
        .as_u64()
        .unwrap_or_else(|| panic!("{} is not a number: {found:?}", path.join(".")))
}

/// The metric names an expression mentions, histogram series by their base name.
fn metrics_in(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|token| token.starts_with("timeoutd_"))
        .map(|token| {
            HISTOGRAM_SUFFIXES
                .iter()
                .find_map(|suffix| token.strip_suffix(suffix))
                .unwrap_or(token)
                .to_owned()
        })
        .collect()
}

fn assert_known_metrics(origin: &str, expr: &str) -> BTreeSet<String> {
    let used = metrics_in(expr);
    assert!(
        !used.is_empty(),
        "{origin}: {expr:?} uses no timeoutd metric"
    );
    let known = metrics();
    for name in &used {
        assert!(
            known.contains(name),
            "{origin}: {expr:?} uses {name}, which timeoutd does not export"
        );
    }
    used
}

// ---------------------------------------------------------------------------
// deploy/kubernetes/sidecar.yaml
// ---------------------------------------------------------------------------

fn k8s_documents() -> Vec<Value> {
    documents(K8S)
}

fn documents(path: &str) -> Vec<Value> {
    let text = read(path);
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{path}: a document is not valid YAML: {e}"))
        })
        .filter(|doc| !doc.is_null())
        .collect()
}

fn k8s_object(docs: &[Value], kind: &str) -> Value {
    let mut found = docs.iter().filter(|d| str_at(d, &["kind"]) == kind);
    let object = found.next().cloned();
    assert!(found.next().is_none(), "{K8S}: more than one {kind}");
    object.unwrap_or_else(|| panic!("{K8S}: no {kind}"))
}

fn sidecar(deployment: &Value) -> Value {
    let containers = at(deployment, &["spec", "template", "spec", "containers"]);
    let containers = containers.as_sequence().expect("containers is a list");
    let found = containers.iter().find(|c| str_at(c, &["name"]) == SIDECAR);
    found
        .cloned()
        .unwrap_or_else(|| panic!("{K8S}: no container named {SIDECAR:?}"))
}

/// The sidecar's env entries by name.
fn sidecar_env(sidecar: &Value) -> BTreeMap<String, Value> {
    let env = at(sidecar, &["env"]).as_sequence().expect("env is a list");
    env.iter()
        .map(|e| (str_at(e, &["name"]).to_owned(), e.clone()))
        .collect()
}

#[test]
fn k8s_manifest_has_deployment_secret_and_disruption_budget() {
    let docs = k8s_documents();
    let deployment = k8s_object(&docs, "Deployment");
    let pdb = k8s_object(&docs, "PodDisruptionBudget");
    k8s_object(&docs, "Secret");
    assert_eq!(u64_at(&deployment, &["spec", "replicas"]), 3);
    assert_eq!(u64_at(&pdb, &["spec", "maxUnavailable"]), 1);
    assert_eq!(
        at(&pdb, &["spec", "selector"]),
        at(&deployment, &["spec", "selector"]),
        "the budget covers the deployment's pods"
    );
    let containers = at(&deployment, &["spec", "template", "spec", "containers"]);
    let names: Vec<&str> = containers
        .as_sequence()
        .expect("containers is a list")
        .iter()
        .map(|c| str_at(c, &["name"]))
        .collect();
    assert_eq!(names, ["app", SIDECAR], "an app container and the sidecar");
}

#[test]
fn sidecar_probes_the_http_endpoints() {
    let sidecar = sidecar(&k8s_object(&k8s_documents(), "Deployment"));
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(str_at(&sidecar, &[probe, "httpGet", "path"]), path);
        assert_eq!(u64_at(&sidecar, &[probe, "httpGet", "port"]), HTTP_PORT);
    }
    let env = sidecar_env(&sidecar);
    let listen = env
        .get("TIMEOUTD__HTTP__LISTEN")
        .map(|e| str_at(e, &["value"]));
    assert_eq!(listen, Some("0.0.0.0:9464"), "probes and scrapes reach it");
}

#[test]
fn pods_are_scraped_on_the_http_port() {
    let deployment = k8s_object(&k8s_documents(), "Deployment");
    let annotations = at(
        &deployment,
        &["spec", "template", "metadata", "annotations"],
    );
    let port = HTTP_PORT.to_string();
    assert_eq!(str_at(annotations, &["prometheus.io/scrape"]), "true");
    assert_eq!(str_at(annotations, &["prometheus.io/port"]), port);
    assert_eq!(str_at(annotations, &["prometheus.io/path"]), "/metrics");
}

#[test]
fn sidecar_env_names_config_keys() {
    let env = sidecar_env(&sidecar(&k8s_object(&k8s_documents(), "Deployment")));
    for required in SIDECAR_ENV {
        assert!(
            env.contains_key(required),
            "{K8S}: sidecar lacks {required}"
        );
    }
    assert_env_vars_name_config_keys(K8S, env.keys().map(String::as_str));
}

#[test]
fn sidecar_urls_come_from_the_secret() {
    let docs = k8s_documents();
    let secret = k8s_object(&docs, "Secret");
    let env = sidecar_env(&sidecar(&k8s_object(&docs, "Deployment")));
    for name in SECRET_ENV {
        let entry = env.get(name).expect("URL variable present");
        let reference = at(entry, &["valueFrom", "secretKeyRef"]);
        assert_eq!(
            str_at(reference, &["name"]),
            str_at(&secret, &["metadata", "name"]),
            "{name}: refers to the Secret of the manifest"
        );
        at(&secret, &["stringData", str_at(reference, &["key"])]);
    }
}

#[test]
fn sidecar_runs_as_non_root_on_a_read_only_root() {
    let sidecar = sidecar(&k8s_object(&k8s_documents(), "Deployment"));
    let security = at(&sidecar, &["securityContext"]);
    let flag = |key: &str| at(security, &[key]).as_bool();
    assert_eq!(flag("runAsNonRoot"), Some(true));
    assert_eq!(flag("readOnlyRootFilesystem"), Some(true));
    assert_eq!(flag("allowPrivilegeEscalation"), Some(false));
    assert_eq!(u64_at(security, &["runAsUser"]), 10001, "the image's user");
}

#[test]
fn grace_period_outlasts_the_shutdown_timeout() {
    let deployment = k8s_object(&k8s_documents(), "Deployment");
    let grace = u64_at(
        &deployment,
        &["spec", "template", "spec", "terminationGracePeriodSeconds"],
    );
    let key = ("shutdown".to_owned(), "timeout".to_owned());
    let timeout = default_toml().get(&key).cloned().expect("shutdown.timeout");
    let timeout: u64 = timeout
        .strip_suffix('s')
        .and_then(|s| s.parse().ok())
        .expect("shutdown.timeout in whole seconds");
    assert!(
        grace > timeout,
        "grace {grace}s <= shutdown.timeout {timeout}s"
    );
}

// ---------------------------------------------------------------------------
// deploy/prometheus/alerts.yaml
// ---------------------------------------------------------------------------

fn alert_rules() -> Vec<Value> {
    let rules: Value = serde_yaml::from_str(&read(ALERTS)).expect("alerts.yaml is not YAML");
    let groups = at(&rules, &["groups"]).as_sequence().expect("groups list");
    groups
        .iter()
        .flat_map(|g| at(g, &["rules"]).as_sequence().expect("rules list").clone())
        .collect()
}

#[test]
fn alerts_cover_the_failure_modes() {
    let rules = alert_rules();
    let names: BTreeSet<&str> = rules.iter().map(|r| str_at(r, &["alert"])).collect();
    for required in REQUIRED_ALERTS {
        assert!(names.contains(required), "{ALERTS}: no alert {required}");
    }
    for rule in &rules {
        let name = str_at(rule, &["alert"]);
        for path in [
            &["for"][..],
            &["labels", "severity"],
            &["annotations", "summary"],
        ] {
            assert!(!str_at(rule, path).is_empty(), "{name}: empty {path:?}");
        }
    }
}

/// Every alert fires in at least one `promtool test rules` case (which `.ci/promtool`
/// runs), and docs/operating/alerts.md has a runbook section for it.
#[test]
fn every_alert_has_a_promtool_test_and_a_runbook() {
    let tests: Value =
        serde_yaml::from_str(&read(ALERTS_TEST)).expect("alerts_test.yaml is not YAML");
    let mut fired = BTreeSet::new();
    for test in at(&tests, &["tests"]).as_sequence().expect("tests list") {
        for case in at(test, &["alert_rule_test"]).as_sequence().expect("cases") {
            let expected = at(case, &["exp_alerts"]).as_sequence().expect("exp_alerts");
            if !expected.is_empty() {
                fired.insert(str_at(case, &["alertname"]).to_owned());
            }
        }
    }
    let runbooks = read(RUNBOOKS);
    for rule in alert_rules() {
        let name = str_at(&rule, &["alert"]);
        assert!(
            fired.contains(name),
            "{ALERTS_TEST}: no test where {name} fires"
        );
        assert!(
            runbooks.lines().any(|l| l == format!("## {name}")),
            "{RUNBOOKS}: no section `## {name}`"
        );
    }
}

/// Series are by `instance` (stable across restarts), never by `node_id` (new at every
/// start), but in `timeoutd_node_info`.
#[test]
fn queries_never_group_by_node_id() {
    let rules = alert_rules();
    let alert_exprs = rules.iter().map(|r| str_at(r, &["expr"]).to_owned());
    let panel_exprs = panels(&dashboard()).into_iter().flat_map(|p| {
        p["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["expr"].as_str().map(str::to_owned))
            .collect::<Vec<_>>()
    });
    for expr in alert_exprs.chain(panel_exprs) {
        assert!(
            !expr.contains("node_id") || expr.contains("timeoutd_node_info"),
            "{expr}"
        );
    }
}

#[test]
fn alert_exprs_use_known_metrics() {
    for rule in alert_rules() {
        let origin = format!("{ALERTS}: {}", str_at(&rule, &["alert"]));
        assert_known_metrics(&origin, str_at(&rule, &["expr"]));
    }
}

// ---------------------------------------------------------------------------
// deploy/grafana/timeoutd.json
// ---------------------------------------------------------------------------

fn dashboard() -> serde_json::Value {
    serde_json::from_str(&read(DASHBOARD)).expect("timeoutd.json is not JSON")
}

/// All panels, those nested in rows included.
fn panels(dashboard: &serde_json::Value) -> Vec<serde_json::Value> {
    let mut all = Vec::new();
    let mut todo = vec![dashboard.clone()];
    while let Some(node) = todo.pop() {
        for panel in node["panels"].as_array().into_iter().flatten() {
            all.push(panel.clone());
            todo.push(panel.clone());
        }
    }
    all
}

#[test]
fn dashboard_has_datasource_and_group_variables() {
    let dashboard = dashboard();
    assert_eq!(dashboard["schemaVersion"], 39);
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list");
    let variable = |name: &str| variables.iter().find(|v| v["name"] == name).cloned();
    let datasource = variable("DS_PROMETHEUS").expect("a DS_PROMETHEUS variable");
    assert_eq!(datasource["type"], "datasource");
    assert_eq!(datasource["query"], "prometheus");
    let group = variable("group").expect("a group variable");
    assert_eq!(
        group["query"]["query"],
        "label_values(timeoutd_active, group)"
    );
}

#[test]
fn dashboard_panel_ids_are_unique() {
    let mut seen = BTreeSet::new();
    for panel in panels(&dashboard()) {
        let id = panel["id"].as_u64().expect("every panel has a numeric id");
        assert!(seen.insert(id), "panel id {id} used twice");
    }
}

#[test]
fn dashboard_queries_use_known_metrics_and_show_them_all() {
    let mut shown = BTreeSet::new();
    for panel in panels(&dashboard()) {
        let title = panel["title"].as_str().unwrap_or("?").to_owned();
        for target in panel["targets"].as_array().into_iter().flatten() {
            assert_eq!(target["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
            let expr = target["expr"].as_str().expect("a target has an expr");
            assert!(expr.contains("group=~\"$group\""), "{title}: {expr:?}");
            shown.extend(assert_known_metrics(&format!("{DASHBOARD}: {title}"), expr));
        }
    }
    let missing: Vec<_> = metrics()
        .into_iter()
        .filter(|m| !shown.contains(m))
        .collect();
    assert!(missing.is_empty(), "no panel shows {missing:?}");
}

// ---------------------------------------------------------------------------
// docker-compose.yml demo and Dockerfile
// ---------------------------------------------------------------------------

fn compose_service(name: &str) -> Value {
    service(&compose(), name).clone()
}

/// A service's `command` as one string (list items joined by spaces).
fn command_of(service: &Value) -> String {
    match at(service, &["command"]) {
        Value::Sequence(items) => items
            .iter()
            .map(|i| i.as_str().expect("command items are strings"))
            .collect::<Vec<_>>()
            .join(" "),
        other => other.as_str().expect("command is a string").to_owned(),
    }
}

fn depends_condition<'a>(service: &'a Value, on: &str) -> &'a str {
    str_at(service, &["depends_on", on, "condition"])
}

#[test]
fn demo_producer_registers_expectations_for_the_demo_queue() {
    let producer = compose_service("demo-producer");
    let command = command_of(&producer);
    assert!(command.contains("timeoutd expect"), "{command}");
    assert!(command.contains(&format!("--routing-key {DEMO_QUEUE}")));
    assert_eq!(depends_condition(&producer, "postgres"), "service_healthy");
    assert_eq!(
        depends_condition(&producer, "timeoutd-1"),
        "service_healthy"
    );
}

#[test]
fn demo_consumer_reads_the_demo_queue() {
    let consumer = compose_service("demo-consumer");
    let entrypoint = at(&consumer, &["entrypoint"]).as_sequence();
    let program = entrypoint.and_then(|e| e.first()).and_then(Value::as_str);
    assert_eq!(program, Some("timeoutd-consume"));
    // The demo queue, bound to where the replicas deliver delayed messages.
    assert_eq!(
        command_of(&consumer),
        format!("{DEMO_QUEUE} timeoutd.delayed demo.#")
    );
    assert_eq!(depends_condition(&consumer, "rabbitmq"), "service_healthy");
}

#[test]
fn demo_services_env_vars_name_config_keys() {
    for name in ["demo-producer", "demo-consumer"] {
        let service = compose_service(name);
        let env = at(&service, &["environment"]).as_mapping();
        let env = env.expect("environment is a mapping");
        assert_env_vars_name_config_keys(name, env.keys().filter_map(Value::as_str));
    }
}

#[test]
fn dockerfile_installs_the_demo_consumer() {
    let dockerfile = read("Dockerfile");
    assert!(
        dockerfile.contains("--example consume"),
        "builds the example"
    );
    assert!(
        dockerfile.contains("/examples/consume /usr/local/bin/timeoutd-consume"),
        "installs it as timeoutd-consume"
    );
}

// ---------------------------------------------------------------------------
// Trust (contract section 8): TLS to both services, who reaches the pods
// ---------------------------------------------------------------------------

/// Ports the pods may connect to: DNS, the broker over TLS, the database.
const EGRESS_PORTS: [u64; 3] = [53, 5671, 5432];

#[test]
fn secret_urls_use_verified_tls_with_the_mounted_ca() {
    let docs = k8s_documents();
    let secret = k8s_object(&docs, "Secret");
    let amqp = str_at(&secret, &["stringData", "amqp-url"]);
    let postgres = str_at(&secret, &["stringData", "postgres-url"]);
    assert!(amqp.starts_with("amqps://"), "{amqp}");
    assert!(postgres.contains("sslmode=verify-full"), "{postgres}");
    let deployment = k8s_object(&docs, "Deployment");
    let sidecar = sidecar(&deployment);
    let env = sidecar_env(&sidecar);
    let config_map = k8s_object(&docs, "ConfigMap");
    let volumes = at(&deployment, &["spec", "template", "spec", "volumes"]);
    let mounts = at(&sidecar, &["volumeMounts"])
        .as_sequence()
        .expect("mounts");
    for var in ["TIMEOUTD__AMQP__CA_FILE", "TIMEOUTD__POSTGRES__CA_FILE"] {
        let path = env.get(var).map(|e| str_at(e, &["value"]));
        let path = path.unwrap_or_else(|| panic!("{K8S}: no {var}"));
        let mount = mounts
            .iter()
            .find(|m| path.starts_with(&format!("{}/", str_at(m, &["mountPath"]))))
            .unwrap_or_else(|| panic!("{var}={path} is in no mount"));
        assert_eq!(at(mount, &["readOnly"]).as_bool(), Some(true), "{var}");
        let volume = volumes
            .as_sequence()
            .expect("volumes")
            .iter()
            .find(|v| str_at(v, &["name"]) == str_at(mount, &["name"]))
            .expect("the mount's volume");
        assert_eq!(
            str_at(volume, &["configMap", "name"]),
            str_at(&config_map, &["metadata", "name"])
        );
        let file = path.rsplit('/').next().unwrap_or_default();
        let pem = str_at(&config_map, &["data", file]);
        assert!(pem.contains("-----BEGIN CERTIFICATE-----"), "{file}: {pem}");
    }
}

#[test]
fn network_policy_selects_the_pods_and_lets_only_the_scraper_in() {
    let docs = documents(NETWORK_POLICY);
    assert_eq!(docs.len(), 1, "{NETWORK_POLICY}: one document");
    let policy = &docs[0];
    assert_eq!(str_at(policy, &["kind"]), "NetworkPolicy");
    assert_eq!(str_at(policy, &["apiVersion"]), "networking.k8s.io/v1");
    let deployment = k8s_object(&k8s_documents(), "Deployment");
    let labels = at(&deployment, &["spec", "template", "metadata", "labels"]);
    let selector = at(policy, &["spec", "podSelector", "matchLabels"]);
    let selector = selector.as_mapping().expect("matchLabels");
    assert!(!selector.is_empty(), "selects some pods, not all");
    for (key, value) in selector {
        assert_eq!(
            labels.get(key),
            Some(value),
            "selects the deployment's pods"
        );
    }
    let types: Vec<&str> = at(policy, &["spec", "policyTypes"])
        .as_sequence()
        .expect("policyTypes")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(types, ["Ingress", "Egress"]);
    let rules = |key: &str| at(policy, &["spec", key]).as_sequence().expect(key).clone();
    let ports = |rule: &Value| -> Vec<u64> {
        let ports = rule.get("ports").and_then(Value::as_sequence);
        let ports =
            ports.unwrap_or_else(|| panic!("a rule without ports opens them all: {rule:?}"));
        ports.iter().map(|p| u64_at(p, &["port"])).collect()
    };
    let mut metrics_rules = 0;
    for rule in rules("ingress") {
        if !ports(&rule).contains(&HTTP_PORT) {
            continue;
        }
        metrics_rules += 1;
        let from = at(&rule, &["from"]).as_sequence().expect("from");
        assert!(!from.is_empty(), "9464 from anywhere");
        for peer in from {
            at(peer, &["namespaceSelector", "matchLabels"]);
            assert!(peer.get("ipBlock").is_none(), "9464 by address: {peer:?}");
        }
    }
    assert_eq!(metrics_rules, 1, "one way in to {HTTP_PORT}");
    for rule in rules("egress") {
        for port in ports(&rule) {
            assert!(EGRESS_PORTS.contains(&port), "egress to {port}");
        }
        let to = at(&rule, &["to"]).as_sequence().expect("to");
        assert!(!to.is_empty(), "egress anywhere: {rule:?}");
    }
}
