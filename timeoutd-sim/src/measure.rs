//! The measures of a run: how long the group had zero or several active nodes, how
//! fast it got back to one after each disruption, and what the announcements cost.

use serde::Serialize;

const NS: f64 = 1e9;

/// Time-weighted active counts and takeover samples, fed as the run goes.
#[derive(Debug, Default)]
pub struct Measures {
    /// Measuring starts here (end of the warm-up), in virtual ns.
    from: u64,
    /// Since when the current active count holds.
    since: u64,
    active: usize,
    zero_ns: u64,
    multi_ns: u64,
    longest_zero_ns: u64,
    longest_multi_ns: u64,
    /// Disruptions still waiting for a single active node.
    open: Vec<u64>,
    takeovers_ns: Vec<u64>,
    pub deliveries: u64,
    /// Deliveries a node's admission dropped (forgeries, replays, duplicates).
    pub rejected: u64,
    /// Deliveries from senders a node could not vouch for yet (answered, not counted).
    pub unvouched: u64,
    /// The attacker's deliveries that counted anywhere.
    pub attacker_counted: u64,
}

impl Measures {
    pub fn new(from: u64) -> Self {
        Self {
            from,
            since: from,
            ..Self::default()
        }
    }

    fn measuring(&self, now: u64) -> bool {
        now >= self.from
    }

    /// The number of active nodes changed (or may have) at `now`; `settled` is whether
    /// the group outside any partition has exactly one active node.
    pub fn observe(&mut self, now: u64, active: usize, settled: bool) {
        if settled {
            for at in self.open.drain(..) {
                self.takeovers_ns.push(now - at);
            }
        }
        if active == self.active || !self.measuring(now) {
            self.active = active;
            return;
        }
        self.close_stretch(now);
        self.active = active;
        self.since = now;
    }

    fn close_stretch(&mut self, now: u64) {
        let stretch = now.saturating_sub(self.since.max(self.from));
        match self.active {
            0 => {
                self.zero_ns += stretch;
                self.longest_zero_ns = self.longest_zero_ns.max(stretch);
            }
            1 => {}
            _ => {
                self.multi_ns += stretch;
                self.longest_multi_ns = self.longest_multi_ns.max(stretch);
            }
        }
    }

    /// A disruption happened: time how long until a single active node.
    pub fn disrupted(&mut self, now: u64) {
        if self.measuring(now) {
            self.open.push(now);
        }
    }

    pub fn delivered(&mut self, now: u64) {
        if self.measuring(now) {
            self.deliveries += 1;
        }
    }

    /// The report at the end of the run (`until`).
    pub fn finish(mut self, until: u64, head: Head) -> Report {
        self.close_stretch(until);
        // A disruption never resolved counts as taking the rest of the run.
        let open: Vec<u64> = self.open.iter().map(|at| until - at).collect();
        self.takeovers_ns.extend(open);
        self.takeovers_ns.sort_unstable();
        let span = (until - self.from) as f64;
        let secs = span / NS;
        let intervals = secs / head.announce_interval_s;
        let pct = |p: f64| percentile(&self.takeovers_ns, p);
        Report {
            zero_active_fraction: self.zero_ns as f64 / span,
            multi_active_fraction: self.multi_ns as f64 / span,
            longest_zero_active_s: self.longest_zero_ns as f64 / NS,
            longest_multi_active_s: self.longest_multi_ns as f64 / NS,
            deliveries_per_interval: self.deliveries as f64 / intervals,
            deliveries_per_node_per_s: self.deliveries as f64 / secs / head.nodes as f64,
            takeovers: self.takeovers_ns.len(),
            takeover_p50_s: pct(0.50),
            takeover_p99_s: pct(0.99),
            takeover_max_s: pct(1.0),
            rejected: self.rejected,
            unvouched: self.unvouched,
            attacker_counted: self.attacker_counted,
            head,
        }
    }
}

/// Nearest-rank percentile in seconds (0 without samples).
fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / NS
}

/// What the run was (repeated in the report so each JSON line stands alone).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Head {
    pub scenario: crate::Scenario,
    pub nodes: usize,
    pub old_nodes: usize,
    pub rule: crate::SimRule,
    pub announcers: usize,
    pub seed: u64,
    pub seconds: f64,
    /// As a fraction (0.01 = 1 %).
    pub loss: f64,
    pub jitter_ms: f64,
    pub announce_interval_s: f64,
    pub attack: crate::Attack,
    pub secret: bool,
    /// Each node's clock is off by up to this much either way.
    pub clock_skew_s: f64,
}

/// One line of the table.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    #[serde(flatten)]
    pub head: Head,
    pub zero_active_fraction: f64,
    pub multi_active_fraction: f64,
    pub longest_zero_active_s: f64,
    pub longest_multi_active_s: f64,
    pub deliveries_per_interval: f64,
    pub deliveries_per_node_per_s: f64,
    /// Disruptions timed (each until a single active node outside any partition).
    pub takeovers: usize,
    pub takeover_p50_s: f64,
    pub takeover_p99_s: f64,
    pub takeover_max_s: f64,
    /// Deliveries the members did not count (whole run, warm-up included).
    pub rejected: u64,
    /// Deliveries from senders not vouched for yet: answered, not counted (whole run).
    pub unvouched: u64,
    /// The attacker's deliveries that counted at some node (whole run): 0 when every
    /// forgery and replay is refused.
    pub attacker_counted: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s: Vec<u64> = (1..=100).map(|i| i * 1_000_000_000).collect();
        assert_eq!(percentile(&s, 0.99), 99.0);
        assert_eq!(percentile(&s, 1.0), 100.0);
        assert_eq!(percentile(&[], 0.99), 0.0);
    }

    #[test]
    fn stretches_count_only_after_the_warmup() {
        let mut m = Measures::new(10);
        m.observe(0, 0, false);
        m.observe(5, 1, true);
        m.observe(20, 0, false);
        m.observe(30, 2, false);
        m.observe(35, 1, true);
        assert_eq!((m.zero_ns, m.multi_ns, m.longest_zero_ns), (10, 5, 10));
    }
}
