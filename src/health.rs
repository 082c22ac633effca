//! What this node can do, as its own tasks find out: since when each of its checks has
//! been failing. The node task hands the earliest of those instants to the election
//! every tick (`Election::observe_health`), which withdraws the node once a check has
//! failed for longer than `member_ttl`, so that a healthy node takes over.

use std::sync::Mutex;
use std::time::Instant;

/// One thing the node must be able to do to be worth electing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Statements through the pool: scans, or a ping while passive.
    Postgres,
    /// The LISTEN connection that wakes the scan for new deadlines.
    Listen,
    /// Publishing TimeOuts: a confirm channel can be had, the connection holds.
    Publish,
}

const CHECKS: [Check; 3] = [Check::Postgres, Check::Listen, Check::Publish];

impl Check {
    pub fn name(self) -> &'static str {
        match self {
            Check::Postgres => "postgres",
            Check::Listen => "postgres_listen",
            Check::Publish => "publish",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The failing-since instant of every check, written by the tasks that run them.
#[derive(Debug, Default)]
pub struct Health {
    failing: Mutex<[Option<Instant>; 3]>,
}

impl Health {
    pub fn pass(&self, check: Check) {
        self.lock()[check.index()] = None;
    }

    /// A failure keeps the instant of the first one in a row.
    pub fn fail(&self, check: Check, now: Instant) {
        self.lock()[check.index()].get_or_insert(now);
    }

    pub fn record<T, E>(&self, check: Check, result: &Result<T, E>) {
        match result {
            Ok(_) => self.pass(check),
            Err(_) => self.fail(check, Instant::now()),
        }
    }

    /// Since when at least one check has been failing without a break.
    pub fn failing_since(&self) -> Option<Instant> {
        self.lock().iter().flatten().min().copied()
    }

    /// The names of the failing checks, for `/status` and `/readyz`.
    pub fn failing(&self) -> Vec<&'static str> {
        let failing = self.lock();
        CHECKS
            .iter()
            .filter(|c| failing[c.index()].is_some())
            .map(|c| c.name())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, [Option<Instant>; 3]> {
        // Plain instants: a panicking holder cannot leave them inconsistent.
        self.failing.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_earliest_unbroken_failure_counts() {
        let h = Health::default();
        let t0 = Instant::now();
        assert_eq!(h.failing_since(), None);
        h.fail(Check::Postgres, t0);
        h.fail(Check::Postgres, t0 + Duration::from_secs(1));
        h.fail(Check::Publish, t0 + Duration::from_secs(2));
        assert_eq!(h.failing_since(), Some(t0));
        assert_eq!(h.failing(), vec!["postgres", "publish"]);
        h.pass(Check::Postgres);
        assert_eq!(h.failing_since(), Some(t0 + Duration::from_secs(2)));
        h.pass(Check::Publish);
        assert_eq!(h.failing_since(), None);
        assert!(h.failing().is_empty());
    }
}
