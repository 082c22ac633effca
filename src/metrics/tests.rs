use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// A node that has done one of everything it counts: every family has a series.
fn busy() -> Metrics {
    let m = Metrics::new("g\"x", Uuid::nil());
    m.set_active(true);
    m.set_members(2);
    m.set_amqp_connected(true);
    m.fenced(1);
    m.role_changed();
    m.announced();
    m.received("probe");
    m.rejected("malformed");
    m.publish_failed("expectation", "returned");
    m.parked(1);
    m.scanned(
        "expectation",
        Duration::from_millis(3),
        &[Duration::from_millis(7), Duration::from_secs(2)],
    );
    m.step("delayed", "lock", Duration::from_millis(1));
    m.set_pending(
        "delayed",
        PendingCounts {
            pending: 1,
            due: 0,
            overdue: 0,
            failing: 0,
        },
        Duration::ZERO,
    );
    m.set_pending(
        "expectation",
        PendingCounts {
            pending: 4,
            due: 3,
            overdue: 2,
            failing: 1,
        },
        Duration::ZERO,
    );
    m.ingest_dropped();
    m.set_ingress_consuming(true);
    m.console_refused("cross_site");
    m.notification_dropped("foreign");
    m.console_action("expectation", "cancel", "done");
    m
}

#[test]
fn renders_every_family_with_labels_and_cumulative_buckets() {
    let text = busy().render(true);
    if std::env::var_os("TIMEOUTD_PRINT_METRICS").is_some() {
        println!("{text}");
    }
    let labels = r#"group="g\"x""#;
    for line in [
        format!(
            "timeoutd_node_info{{{labels},node_id=\"{}\"}} 1",
            Uuid::nil()
        ),
        format!(
            "timeoutd_build_info{{{labels},version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        ),
        format!("timeoutd_timeouts_fired_total{{{labels}}} 2"),
        format!("timeoutd_announcements_received_total{{{labels},kind=\"probe\"}} 1"),
        format!(
            "timeoutd_publish_failures_total{{{labels},kind=\"expectation\",reason=\"returned\"}} 1"
        ),
        format!("timeoutd_fired_total{{{labels},kind=\"expectation\"}} 2"),
        format!("timeoutd_fire_lateness_seconds_bucket{{{labels},le=\"0.01\"}} 1"),
        format!("timeoutd_fire_lateness_seconds_bucket{{{labels},le=\"2.5\"}} 2"),
        format!("timeoutd_fire_lateness_seconds_count{{{labels}}} 2"),
        format!("timeoutd_postgres_connected{{{labels}}} 1"),
        format!("timeoutd_candidate{{{labels}}} 1"),
        format!("timeoutd_pending{{{labels}}} 4"),
    ] {
        assert!(text.contains(&line), "missing {line}\n{text}");
    }
    assert!(text.ends_with("# EOF\n"), "{text}");
}

/// Only the info series names the node: a restart makes no other series anew.
#[test]
fn only_the_node_info_series_carries_the_node_id() {
    let text = busy().render(true);
    let with_id: Vec<&str> = text.lines().filter(|l| l.contains("node_id")).collect();
    assert_eq!(with_id.len(), 1, "{with_id:?}");
    assert!(with_id[0].starts_with("timeoutd_node_info{"), "{with_id:?}");
}

/// A metric as Prometheus names it: its type and its labels (`group` and a histogram's
/// `le` aside: every series has the one, every histogram the other).
#[derive(Debug, PartialEq, Eq)]
struct Described {
    kind: String,
    labels: BTreeSet<String>,
}

/// What `/metrics` exports, read back from the exposition: the name a query uses
/// (counters with `_total`, info metrics with `_info`), its type, its labels.
fn exported(text: &str) -> BTreeMap<String, Described> {
    let mut families: BTreeMap<String, Described> = BTreeMap::new();
    let mut names: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').expect("# TYPE name type");
            let name = match kind {
                "counter" => format!("{family}_total"),
                "info" => format!("{family}_info"),
                _ => family.to_owned(),
            };
            names.push((family.to_owned(), name.clone()));
            let labels = BTreeSet::new();
            families.insert(
                name,
                Described {
                    kind: kind.to_owned(),
                    labels,
                },
            );
        } else if !line.starts_with('#') {
            let series = line.split(' ').next().unwrap_or_default();
            let (sample, labels) = series.split_once('{').expect("every series has labels");
            let (_, name) = names
                .iter()
                .rev()
                .find(|(family, _)| sample.starts_with(family.as_str()))
                .expect("a sample of a family");
            let labels = labels.trim_end_matches('}');
            let keys = labels_of(labels);
            let d = families.get_mut(name).expect("described");
            d.labels
                .extend(keys.into_iter().filter(|k| k != "group" && k != "le"));
        }
    }
    families
}

/// The label names of `a="x",b="y\"z"`.
fn labels_of(labels: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let mut rest = labels;
    while let Some((key, value)) = rest.split_once("=\"") {
        keys.push(key.trim_start_matches(',').to_owned());
        let mut escaped = false;
        let end = value
            .char_indices()
            .find(|&(_, c)| {
                let close = c == '"' && !escaped;
                escaped = c == '\\' && !escaped;
                close
            })
            .map_or(value.len(), |(i, _)| i + 1);
        rest = &value[end..];
    }
    keys
}

/// The table of docs/operating/metrics.md: `| name | type | labels | meaning |`.
fn documented() -> BTreeMap<String, Described> {
    let doc = include_str!("../../docs/operating/metrics.md");
    let mut rows = BTreeMap::new();
    for line in doc.lines().filter(|l| l.starts_with("| `timeoutd_")) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 4, "{line}");
        let unquote = |s: &str| s.trim_matches('`').to_owned();
        let labels = cells[2]
            .split(',')
            .map(|l| unquote(l.trim()))
            .filter(|l| !l.is_empty() && l != "—")
            .collect();
        let kind = unquote(cells[1]);
        assert!(!cells[3].is_empty(), "{line}: no meaning");
        let old = rows.insert(unquote(cells[0]), Described { kind, labels });
        assert!(old.is_none(), "{line}: twice");
    }
    rows
}

/// docs/operating/metrics.md lists every metric `/metrics` exports, with its type and
/// labels, and no other.
#[test]
fn the_metrics_reference_matches_the_code() {
    let exported = exported(&busy().render(true));
    let documented = documented();
    let names = |m: &BTreeMap<String, Described>| m.keys().cloned().collect::<BTreeSet<_>>();
    let missing: Vec<_> = names(&exported)
        .difference(&names(&documented))
        .cloned()
        .collect();
    let stale: Vec<_> = names(&documented)
        .difference(&names(&exported))
        .cloned()
        .collect();
    assert!(
        missing.is_empty(),
        "exported, not in docs/operating/metrics.md: {missing:?}"
    );
    assert!(
        stale.is_empty(),
        "in docs/operating/metrics.md, not exported: {stale:?}"
    );
    for (name, d) in &exported {
        assert_eq!(Some(d), documented.get(name), "{name}: code vs docs");
    }
}

/// The console's summary: each kind's last counts and this node's mean lateness.
#[test]
fn the_pending_summary_keeps_the_last_counts_and_the_lateness() {
    let m = busy();
    let summary = m.pending_summary();
    let e = summary
        .iter()
        .find(|s| s.kind == "expectation")
        .expect("expectation counted");
    assert_eq!((e.counts.pending, e.counts.failing), (4, 1));
    assert_eq!(e.fired_here, 2);
    let mean = e.mean_lateness_s.expect("a mean");
    assert!((mean - 1.0035).abs() < 1e-9, "{mean}");
    let d = summary
        .iter()
        .find(|s| s.kind == "delayed")
        .expect("delayed");
    assert_eq!((d.fired_here, d.mean_lateness_s), (0, None));
}
