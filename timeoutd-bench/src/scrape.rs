//! The daemon's `/metrics`: one scrape, its parse, and what a phase changed between two
//! scrapes. The benchmark learns what the daemon did from here, not from its log.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::prelude::*;

pub(crate) const ACTIVE: &str = "timeoutd_active";
pub(crate) const FIRED: &str = "timeoutd_timeouts_fired_total";
pub(crate) const PUBLISH_FAILURES: &str = "timeoutd_publish_failures_total";
pub(crate) const SCAN_DURATION: &str = "timeoutd_scan_duration_seconds";
pub(crate) const LATENESS: &str = "timeoutd_fire_lateness_seconds";
/// Rows fired, by `kind` (expectation, delayed).
pub(crate) const KIND_FIRED: &str = "timeoutd_fired_total";
/// Publish time − due time, by `kind`.
pub(crate) const KIND_LATENESS: &str = "timeoutd_lateness_seconds";
/// Where a batch's time went, by `kind` and `step`.
pub(crate) const BATCH_STEP: &str = "timeoutd_batch_step_seconds";
/// Delayed messages taken in, by `result` (stored, held, duplicate, cancelled, dropped).
pub(crate) const INGESTED: &str = "timeoutd_delayed_ingested_total";
/// One observation per ingress batch: its arrival to its commit.
pub(crate) const INGEST_TIME: &str = "timeoutd_delayed_ingest_seconds";
pub(crate) const INGRESS_CONSUMING: &str = "timeoutd_delayed_ingress_consuming";

/// A scrape that does not answer in this time is a stuck daemon, not a slow one: the
/// endpoint bounds its own database probe to 1 s.
const SCRAPE_LIMIT: Duration = Duration::from_secs(5);
/// Far above the daemon's few kilobytes; stops a runaway answer from filling memory.
const MAX_BYTES: u64 = 4 * 1024 * 1024;

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sample {
    pub(crate) name: String,
    pub(crate) labels: Vec<(String, String)>,
    pub(crate) value: f64,
}

impl Sample {
    pub(crate) fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The samples of one scrape, in exposition order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Scrape {
    pub(crate) samples: Vec<Sample>,
}

impl Scrape {
    /// The text format (Prometheus or OpenMetrics); `#` lines (HELP, TYPE, EOF) skipped.
    pub(crate) fn parse(text: &str) -> Result<Self> {
        let samples = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| parse_sample(l).with_context(|| format!("metrics line {l:?}")))
            .collect::<Result<_>>()?;
        Ok(Self { samples })
    }

    /// The first series of `name`: enough for a gauge of one daemon.
    pub(crate) fn get(&self, name: &str) -> Option<f64> {
        self.samples
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.value)
    }

    /// Every series of `name` added up: a counter split by a label (`reason`) is one total.
    pub(crate) fn sum(&self, name: &str) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.value)
            .sum()
    }

    /// The series whose label `key` is `value` (e.g. `kind="delayed"`).
    pub(crate) fn only(&self, key: &str, value: &str) -> Self {
        let samples = self
            .samples
            .iter()
            .filter(|s| s.label(key) == Some(value))
            .cloned()
            .collect();
        Self { samples }
    }

    /// Several daemons' scrapes as one: the same series of each added up (counters and
    /// histogram buckets of a group; only `timeoutd_node_info` names the node).
    pub(crate) fn merged(scrapes: &[Scrape]) -> Self {
        let mut samples: Vec<Sample> = Vec::new();
        for sample in scrapes.iter().flat_map(|s| &s.samples) {
            let labels = sample.labels.clone();
            match samples
                .iter_mut()
                .find(|x| x.name == sample.name && x.labels == labels)
            {
                Some(x) => x.value += sample.value,
                None => samples.push(Sample {
                    name: sample.name.clone(),
                    labels,
                    value: sample.value,
                }),
            }
        }
        Self { samples }
    }

    /// A histogram's cumulative buckets, `(le, count)` by ascending `le` (+Inf last).
    pub(crate) fn buckets(&self, histogram: &str) -> Vec<(f64, f64)> {
        let name = format!("{histogram}_bucket");
        let mut buckets: Vec<(f64, f64)> = self
            .samples
            .iter()
            .filter(|s| s.name == name)
            .filter_map(|s| Some((parse_value(s.label("le")?).ok()?, s.value)))
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        buckets
    }
}

fn parse_sample(line: &str) -> Result<Sample> {
    let end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .context("no value")?;
    let (name, rest) = line.split_at(end);
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => parse_labels(inner)?,
        None => (Vec::new(), rest),
    };
    // A timestamp or an exemplar may follow the value; neither is needed here.
    let value = rest.split_whitespace().next().context("no value")?;
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value: parse_value(value)?,
    })
}

/// `k="v",…}` (the opening brace already consumed); returns the labels and what follows.
fn parse_labels(mut s: &str) -> Result<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        if let Some(rest) = s.strip_prefix('}') {
            return Ok((labels, rest));
        }
        let (key, rest) = s.split_once("=\"").context("label without =\"")?;
        let (value, rest) = quoted(rest)?;
        labels.push((key.trim().to_owned(), value));
        s = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// A label value up to its closing quote, unescaped (`\\`, `\"`, `\n`).
fn quoted(s: &str) -> Result<(String, &str)> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Ok((out, &s[i + 1..])),
            '\\' => match chars.next() {
                Some((_, 'n')) => out.push('\n'),
                Some((_, escaped)) => out.push(escaped),
                None => break,
            },
            c => out.push(c),
        }
    }
    bail!("unterminated label value")
}

/// Rust's float syntax already takes the exposition's `+Inf`, `-Inf` and `NaN`.
fn parse_value(s: &str) -> Result<f64> {
    s.parse().with_context(|| format!("not a number: {s:?}"))
}

/// `GET /metrics` and parse it.
pub(crate) async fn scrape(addr: SocketAddr) -> Result<Scrape> {
    Scrape::parse(&get_metrics(addr).await?)
}

/// `GET /metrics`: the body of a complete 200 answer.
pub(crate) async fn get_metrics(addr: SocketAddr) -> Result<String> {
    metrics_body(get(addr, "/metrics", SCRAPE_LIMIT).await?)
}

/// The body of a 200 answer; anything else, or a body cut short, is an error.
fn metrics_body((status, body): (u16, String)) -> Result<String> {
    if status != 200 {
        bail!("/metrics answered {status}");
    }
    // OpenMetrics ends with `# EOF`: without it the answer was truncated.
    if !body.trim_end().ends_with("# EOF") {
        bail!("/metrics: answer without `# EOF` (truncated)");
    }
    Ok(body)
}

/// One GET over HTTP/1.0, bounded by `limit`: the server answers without chunking and
/// closes, so the body is everything after the headers. A local scrape needs no client
/// library.
pub(crate) async fn get(addr: SocketAddr, path: &str, limit: Duration) -> Result<(u16, String)> {
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.take(MAX_BYTES).read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(raw)
    };
    let raw = tokio::time::timeout(limit, exchange)
        .await
        .map_err(|_| anyhow!("GET http://{addr}{path}: no answer within {limit:?}"))?
        .with_context(|| format!("GET http://{addr}{path}"))?;
    response(&String::from_utf8_lossy(&raw))
}

/// The status code and body of an answer.
fn response(raw: &str) -> Result<(u16, String)> {
    let (head, body) = raw.split_once("\r\n\r\n").context("no end of headers")?;
    let status = head.lines().next().unwrap_or_default();
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad status line {status:?}"))?;
    Ok((code, body.to_owned()))
}

/// What the daemon did between two scrapes, from its counters and histograms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct ScanDelta {
    /// Batches that locked rows (one scan-duration observation each).
    pub(crate) batches: u64,
    /// Sum of their durations.
    pub(crate) busy_ms: f64,
    pub(crate) mean_batch_ms: f64,
    /// The upper bound of the smallest scan-duration bucket holding every batch: the
    /// longest batch took at most this. A bucket bound, not a measurement; 0 without
    /// batches, null in JSON when beyond the last finite bucket.
    pub(crate) max_batch_le_ms: f64,
    pub(crate) fired: u64,
    pub(crate) publish_failures: u64,
    /// Fire time − deadline as the daemon saw it, mean and a bucket bound on p99.
    pub(crate) lateness_mean_ms: f64,
    pub(crate) lateness_p99_le_ms: f64,
    /// Where the batches' time went (`timeoutd_batch_step_seconds`).
    pub(crate) steps: Steps,
}

/// One step of the batches between two scrapes: mean per batch that took it, and a bucket
/// bound on its p99.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct StepTime {
    pub(crate) count: u64,
    pub(crate) mean_ms: f64,
    pub(crate) p99_le_ms: f64,
}

/// The steps of a batch, in order: lock the rows, wait for a held row's due time, hand the
/// messages to the broker, wait for the last confirm, delete and commit.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct Steps {
    pub(crate) lock: StepTime,
    pub(crate) wake: StepTime,
    pub(crate) publish: StepTime,
    pub(crate) confirm: StepTime,
    pub(crate) settle: StepTime,
}

impl Steps {
    pub(crate) fn between(before: &Scrape, after: &Scrape) -> Self {
        let step = |name: &str| {
            let (b, a) = (before.only("step", name), after.only("step", name));
            let delta = |n: &str| a.sum(n) - b.sum(n);
            let count = delta(&format!("{BATCH_STEP}_count"));
            StepTime {
                count: whole(count),
                mean_ms: mean(delta(&format!("{BATCH_STEP}_sum")) * 1e3, count),
                p99_le_ms: bound_ms(quantile_bound(&b, &a, BATCH_STEP, 0.99)),
            }
        };
        Self {
            lock: step("lock"),
            wake: step("wake"),
            publish: step("publish"),
            confirm: step("confirm"),
            settle: step("settle"),
        }
    }

    /// `lock 2.1 ms (p99 ≤ 5 ms), …` for the steps that happened.
    pub(crate) fn text(&self) -> String {
        let all = [
            ("lock", self.lock),
            ("wake", self.wake),
            ("publish", self.publish),
            ("confirm", self.confirm),
            ("settle", self.settle),
        ];
        all.iter()
            .filter(|(_, t)| t.count > 0)
            .map(|(n, t)| format!("{n} {:.1} ms (p99 {})", t.mean_ms, bound_text(t.p99_le_ms)))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl ScanDelta {
    pub(crate) fn between(before: &Scrape, after: &Scrape) -> Self {
        let delta = |name: &str| after.sum(name) - before.sum(name);
        let count = |h: &str| delta(&format!("{h}_count"));
        let sum_ms = |h: &str| delta(&format!("{h}_sum")) * 1e3;
        let batches = count(SCAN_DURATION);
        let late = count(LATENESS);
        Self {
            batches: whole(batches),
            busy_ms: sum_ms(SCAN_DURATION),
            mean_batch_ms: mean(sum_ms(SCAN_DURATION), batches),
            max_batch_le_ms: bound_ms(quantile_bound(before, after, SCAN_DURATION, 1.0)),
            fired: whole(delta(FIRED)),
            publish_failures: whole(delta(PUBLISH_FAILURES)),
            lateness_mean_ms: mean(sum_ms(LATENESS), late),
            lateness_p99_le_ms: bound_ms(quantile_bound(before, after, LATENESS, 0.99)),
            steps: Steps::between(before, after),
        }
    }
}

impl ScanDelta {
    /// As [`ScanDelta::between`], with fired rows, publish failures and lateness of one
    /// `kind` only (batches are counted over every kind: run it when only one has rows).
    pub(crate) fn of_kind(before: &Scrape, after: &Scrape, kind: &str) -> Self {
        let (b, a) = (before.only("kind", kind), after.only("kind", kind));
        let delta = |name: &str| a.sum(name) - b.sum(name);
        let late = delta(&format!("{KIND_LATENESS}_count"));
        let late_ms = delta(&format!("{KIND_LATENESS}_sum")) * 1e3;
        Self {
            fired: whole(delta(KIND_FIRED)),
            publish_failures: whole(delta(PUBLISH_FAILURES)),
            lateness_mean_ms: mean(late_ms, late),
            lateness_p99_le_ms: bound_ms(quantile_bound(&b, &a, KIND_LATENESS, 0.99)),
            ..Self::between(before, after)
        }
    }
}

/// What the delayed-message ingress did between two scrapes (of one daemon, or merged).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct IngestDelta {
    pub(crate) stored: u64,
    pub(crate) held: u64,
    pub(crate) duplicates: u64,
    /// Ingress batches (one ingest-time observation each).
    pub(crate) batches: u64,
    pub(crate) mean_batch_msgs: f64,
    /// Arrival of a batch → its commit: mean, and a bucket bound on p99.
    pub(crate) mean_ms: f64,
    pub(crate) p99_le_ms: f64,
}

impl IngestDelta {
    pub(crate) fn between(before: &Scrape, after: &Scrape) -> Self {
        let result = |r: &str| {
            whole(after.only("result", r).sum(INGESTED) - before.only("result", r).sum(INGESTED))
        };
        let delta = |name: &str| after.sum(name) - before.sum(name);
        let batches = delta(&format!("{INGEST_TIME}_count"));
        let stored = result("stored");
        Self {
            stored,
            held: result("held"),
            duplicates: result("duplicate"),
            batches: whole(batches),
            mean_batch_msgs: mean(stored as f64, batches),
            mean_ms: mean(delta(&format!("{INGEST_TIME}_sum")) * 1e3, batches),
            p99_le_ms: bound_ms(quantile_bound(before, after, INGEST_TIME, 0.99)),
        }
    }
}

/// The smallest bucket bound `le` that holds a `q` share of the observations made between
/// the scrapes (cumulative buckets: every bucket at or above the largest observation
/// moves, so the bound is where the moved count first reaches the total). 0 if none.
pub(crate) fn quantile_bound(before: &Scrape, after: &Scrape, histogram: &str, q: f64) -> f64 {
    let old = before.buckets(histogram);
    let moved: Vec<(f64, f64)> = after
        .buckets(histogram)
        .into_iter()
        .map(|(le, n)| (le, n - bucket_count(&old, le)))
        .collect();
    let total = moved.last().map_or(0.0, |b| b.1);
    if total <= 0.0 {
        return 0.0;
    }
    let needed = (q * total).ceil();
    moved
        .iter()
        .find(|(_, n)| *n >= needed)
        .map_or(f64::INFINITY, |b| b.0)
}

/// Seconds × 1000 leaves float noise (0.025 s → 25.000000000000004 ms); bounds are round.
fn bound_ms(secs: f64) -> f64 {
    (secs * 1e6).round() / 1e3
}

fn bucket_count(buckets: &[(f64, f64)], le: f64) -> f64 {
    buckets.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1)
}

fn mean(sum: f64, count: f64) -> f64 {
    if count > 0.0 { sum / count } else { 0.0 }
}

/// Counters are whole numbers; a restart between scrapes would make a delta negative.
fn whole(v: f64) -> u64 {
    v.max(0.0).round() as u64
}

/// A bucket bound in the report's words.
pub(crate) fn bound_text(le_ms: f64) -> String {
    if le_ms == 0.0 {
        "n/a".to_owned()
    } else if le_ms.is_infinite() {
        "beyond the last bucket".to_owned()
    } else {
        format!("≤ {le_ms} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LABELS: &str = r#"group="bench-1""#;

    fn histogram(name: &str, buckets: &[(&str, u64)], sum: f64) -> String {
        let mut text = format!("# TYPE {name} histogram\n# UNIT {name} seconds\n");
        for (le, n) in buckets {
            text += &format!("{name}_bucket{{{LABELS},le=\"{le}\"}} {n}\n");
        }
        let count = buckets.last().map_or(0, |b| b.1);
        text += &format!("{name}_sum{{{LABELS}}} {sum}\n{name}_count{{{LABELS}}} {count}\n");
        text
    }

    fn exposition(scan: &[(&str, u64)], scan_sum: f64, fired: u64) -> Scrape {
        let mut text =
            format!("# HELP timeoutd_active 1 if active\ntimeoutd_active{{{LABELS}}} 1\n");
        text += &format!("{FIRED}{{{LABELS}}} {fired}\n");
        text += &format!("{PUBLISH_FAILURES}{{{LABELS},reason=\"returned\"}} 1\n");
        text += &format!("{PUBLISH_FAILURES}{{{LABELS},reason=\"nacked\"}} 2\n");
        text += &histogram(SCAN_DURATION, scan, scan_sum);
        text += "# EOF\n";
        match Scrape::parse(&text) {
            Ok(s) => s,
            Err(e) => panic!("{e:#}\n{text}"),
        }
    }

    #[test]
    fn parses_counters_with_total_and_labels() {
        let s = exposition(&[("+Inf", 0)], 0.0, 7);
        assert_eq!(s.get(FIRED), Some(7.0));
        assert_eq!(s.get(ACTIVE), Some(1.0));
        assert_eq!(s.sum(PUBLISH_FAILURES), 3.0);
        let fired = s
            .samples
            .iter()
            .find(|x| x.name == FIRED)
            .map(|x| x.labels.clone());
        let expected = [("group", "bench-1")].map(|(k, v)| (k.to_owned(), v.to_owned()));
        assert_eq!(fired, Some(expected.to_vec()));
        assert_eq!(s.get("timeoutd_absent"), None);
    }

    #[test]
    fn parses_histogram_buckets_in_order_with_inf() {
        let s = exposition(&[("0.001", 1), ("0.01", 3), ("+Inf", 4)], 0.5, 0);
        let expected = vec![(0.001, 1.0), (0.01, 3.0), (f64::INFINITY, 4.0)];
        assert_eq!(s.buckets(SCAN_DURATION), expected);
        assert_eq!(s.get(&format!("{SCAN_DURATION}_count")), Some(4.0));
        assert_eq!(s.get(&format!("{SCAN_DURATION}_sum")), Some(0.5));
    }

    #[test]
    fn unescapes_label_values_and_ignores_timestamps() {
        let text = r#"m{a="x\"y,}",b="back\\slash\nnl"} 2.5 1700000000"#;
        let s = Scrape::parse(text).map_err(|e| format!("{e:#}"));
        let sample = s.map(|s| s.samples[0].clone());
        let labels =
            [("a", "x\"y,}"), ("b", "back\\slash\nnl")].map(|(k, v)| (k.to_owned(), v.to_owned()));
        let expected = Sample {
            name: "m".to_owned(),
            labels: labels.to_vec(),
            value: 2.5,
        };
        assert_eq!(sample, Ok(expected));
    }

    #[test]
    fn parses_lines_without_labels_and_special_values() {
        let s = Scrape::parse("a 1\nb NaN\nc -Inf\n\n# EOF").map_err(|e| format!("{e:#}"));
        let values = s.map(|s| s.samples.iter().map(|x| x.value).collect::<Vec<_>>());
        let values = values.unwrap_or_default();
        assert_eq!(values[0], 1.0);
        assert!(values[1].is_nan());
        assert_eq!(values[2], f64::NEG_INFINITY);
    }

    #[test]
    fn rejects_malformed_lines() {
        for bad in ["m{a=\"x} 1", "m{a} 1", "m{a=\"1\"}", "m abc", "lonely"] {
            assert!(Scrape::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn delta_counts_batches_and_bounds_the_longest_by_its_bucket() {
        let before = exposition(
            &[("0.001", 1), ("0.01", 1), ("0.1", 1), ("+Inf", 1)],
            0.0005,
            10,
        );
        // Three more batches: 4 ms, 6 ms and 40 ms.
        let after = exposition(
            &[("0.001", 1), ("0.01", 3), ("0.1", 4), ("+Inf", 4)],
            0.0505,
            1510,
        );
        let d = ScanDelta::between(&before, &after);
        assert_eq!((d.batches, d.fired), (3, 1500));
        assert!((d.busy_ms - 50.0).abs() < 1e-9, "{d:?}");
        assert!((d.mean_batch_ms - 50.0 / 3.0).abs() < 1e-9, "{d:?}");
        assert!((d.max_batch_le_ms - 100.0).abs() < 1e-9, "{d:?}");
        assert_eq!(d.publish_failures, 0);
        assert_eq!((d.lateness_mean_ms, d.lateness_p99_le_ms), (0.0, 0.0));
    }

    #[test]
    fn bounds_read_as_round_milliseconds() {
        assert_eq!(bound_text(bound_ms(0.025)), "≤ 25 ms");
        assert_eq!(bound_text(bound_ms(0.0025)), "≤ 2.5 ms");
        assert_eq!(
            bound_text(bound_ms(f64::INFINITY)),
            "beyond the last bucket"
        );
        assert_eq!(bound_text(0.0), "n/a");
    }

    #[test]
    fn quantile_bound_beyond_the_last_bucket_is_infinite() {
        let before = exposition(&[("1", 0), ("+Inf", 0)], 0.0, 0);
        let after = exposition(&[("1", 1), ("+Inf", 2)], 30.5, 0);
        assert_eq!(quantile_bound(&before, &after, SCAN_DURATION, 0.5), 1.0);
        assert_eq!(
            quantile_bound(&before, &after, SCAN_DURATION, 1.0),
            f64::INFINITY
        );
        assert_eq!(quantile_bound(&after, &after, SCAN_DURATION, 1.0), 0.0);
    }

    /// One daemon's delayed-message series (`node` its id in `timeoutd_node_info`).
    fn delayed_exposition(node: u8, stored: u64, ingest: &[(&str, u64)], fired: u64) -> Scrape {
        let labels = r#"group="bench-1""#;
        let mut text = format!("timeoutd_node_info{{{labels},node_id=\"{node}\"}} 1\n");
        text += &format!("{INGESTED}{{{labels},result=\"stored\"}} {stored}\n");
        text += &format!("{INGESTED}{{{labels},result=\"held\"}} 1\n");
        for (le, n) in ingest {
            text += &format!("{INGEST_TIME}_bucket{{{labels},le=\"{le}\"}} {n}\n");
        }
        let count = ingest.last().map_or(0, |b| b.1);
        text += &format!("{INGEST_TIME}_sum{{{labels}}} {}\n", count as f64 * 0.004);
        text += &format!("{INGEST_TIME}_count{{{labels}}} {count}\n");
        for (kind, n) in [("expectation", 1000), ("delayed", fired)] {
            text += &format!("{KIND_FIRED}{{{labels},kind=\"{kind}\"}} {n}\n");
            text +=
                &format!("{KIND_LATENESS}_bucket{{{labels},kind=\"{kind}\",le=\"0.01\"}} {n}\n");
            text +=
                &format!("{KIND_LATENESS}_bucket{{{labels},kind=\"{kind}\",le=\"+Inf\"}} {n}\n");
            text += &format!(
                "{KIND_LATENESS}_sum{{{labels},kind=\"{kind}\"}} {}\n",
                n as f64 * 0.002
            );
            text += &format!("{KIND_LATENESS}_count{{{labels},kind=\"{kind}\"}} {n}\n");
        }
        text += "# EOF\n";
        match Scrape::parse(&text) {
            Ok(s) => s,
            Err(e) => panic!("{e:#}\n{text}"),
        }
    }

    #[test]
    fn merged_adds_up_the_daemons_of_a_group() {
        let a = delayed_exposition(1, 100, &[("0.005", 2), ("+Inf", 3)], 0);
        let b = delayed_exposition(2, 50, &[("0.005", 1), ("+Inf", 1)], 0);
        let m = Scrape::merged(&[a.clone(), b]);
        assert_eq!(m.only("result", "stored").sum(INGESTED), 150.0);
        assert_eq!(m.sum(INGESTED), 152.0);
        assert_eq!(
            m.buckets(INGEST_TIME),
            vec![(0.005, 3.0), (f64::INFINITY, 4.0)]
        );
        let nodes = m.samples.iter().filter(|s| s.label("node_id").is_some());
        assert_eq!(nodes.count(), 2, "one node_info series per daemon");
        assert_eq!(m.samples.len(), a.samples.len() + 1);
    }

    #[test]
    fn ingest_delta_counts_stored_and_bounds_batch_time() {
        let before = delayed_exposition(1, 100, &[("0.005", 2), ("+Inf", 2)], 0);
        let after = delayed_exposition(1, 1100, &[("0.005", 3), ("+Inf", 4)], 0);
        let d = IngestDelta::between(&before, &after);
        assert_eq!((d.stored, d.held, d.duplicates, d.batches), (1000, 0, 0, 2));
        assert!((d.mean_batch_msgs - 500.0).abs() < 1e-9, "{d:?}");
        assert!((d.mean_ms - 4.0).abs() < 1e-9, "{d:?}");
        assert_eq!(d.p99_le_ms, f64::INFINITY);
    }

    #[test]
    fn of_kind_counts_only_that_kind() {
        let before = delayed_exposition(1, 0, &[("+Inf", 0)], 10);
        let after = delayed_exposition(1, 0, &[("+Inf", 0)], 110);
        let d = ScanDelta::of_kind(&before, &after, "delayed");
        assert_eq!(d.fired, 100);
        assert!((d.lateness_mean_ms - 2.0).abs() < 1e-9, "{d:?}");
        assert_eq!(d.lateness_p99_le_ms, 10.0);
        assert_eq!(ScanDelta::of_kind(&before, &after, "expectation").fired, 0);
    }

    #[test]
    fn body_needs_200_and_eof() {
        let body = |raw: &str| response(raw).and_then(metrics_body);
        let ok = "HTTP/1.0 200 OK\r\ncontent-length: 8\r\n\r\na 1\n# EOF\n";
        assert_eq!(body(ok).ok().as_deref(), Some("a 1\n# EOF\n"));
        assert!(body("HTTP/1.0 503 Service Unavailable\r\n\r\n# EOF\n").is_err());
        assert!(body("HTTP/1.0 200 OK\r\n\r\na 1\n").is_err());
        assert!(body("HTTP/1.0 200 OK\r\n").is_err());
    }
}
