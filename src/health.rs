//! What this node can do, as its own tasks find out: since when each of its checks has
//! been failing. The node task hands the earliest of those instants to the election
//! every tick (`Election::observe_health`), which withdraws the node once a check has
//! failed for longer than `member_ttl`, so that a healthy node takes over.

use std::sync::Mutex;
use std::time::{Duration, Instant};

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

/// The failing-since instant of every check, written by the tasks that run them, and the
/// steps under way.
#[derive(Debug, Default)]
pub struct Health {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    failing: [Option<Instant>; 3],
    /// When each check last passed.
    passed: [Option<Instant>; 3],
    /// Steps under way: (id, check, since).
    steps: Vec<(u64, Check, Instant)>,
    next_id: u64,
}

/// How one check stands (see [`Health::standing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    Passing,
    /// Failing, or a step of it under way too long, for this long.
    Failing(Duration),
    /// Not passed yet, nor failed: its tasks have not got to it.
    Untried,
}

/// A step in flight longer than this is listed as failing in `/status`.
const SLOW_STEP: Duration = Duration::from_secs(1);

/// A step of a check under way (see [`Health::step`]); it ends when dropped.
pub struct Step<'a> {
    health: &'a Health,
    id: u64,
}

impl Drop for Step<'_> {
    /// A step given up while it hung (its future dropped: a batch abandoned at a stop
    /// or a role change) did not pass: if it had been under way for `SLOW_STEP` and its
    /// check has not passed since it began, the check stays failing since then, until
    /// it passes. Otherwise a node cut off from Postgres would look fit again as soon
    /// as its hung batch was dropped, rejoin and take the role back.
    fn drop(&mut self) {
        let mut state = self.health.lock();
        let Some(at) = state.steps.iter().position(|(id, _, _)| *id == self.id) else {
            return;
        };
        let (_, check, since) = state.steps.remove(at);
        let passed = state.passed[check.index()].is_some_and(|p| p >= since);
        if !passed && since.elapsed() >= SLOW_STEP {
            state.failing[check.index()].get_or_insert(since);
        }
    }
}

impl Health {
    pub fn pass(&self, check: Check) {
        let mut state = self.lock();
        state.failing[check.index()] = None;
        state.passed[check.index()] = Some(Instant::now());
    }

    /// A failure keeps the instant of the first one in a row.
    pub fn fail(&self, check: Check, now: Instant) {
        self.lock().failing[check.index()].get_or_insert(now);
    }

    pub fn record<T, E>(&self, check: Check, result: &Result<T, E>) {
        match result {
            Ok(_) => self.pass(check),
            Err(_) => self.fail(check, Instant::now()),
        }
    }

    /// A step of `check` begins: until it ends, or the check passes meanwhile, it counts
    /// as failing since it began. A step that hangs (a network that silently drops
    /// packets: no error for minutes) then withdraws the node like an error would; a step
    /// of milliseconds never can, nor can a slow one (a walk over many deleted index
    /// entries) while other steps of the same check go on passing: the database answers.
    pub fn step(&self, check: Check) -> Step<'_> {
        let mut state = self.lock();
        state.next_id += 1;
        let id = state.next_id;
        state.steps.push((id, check, Instant::now()));
        Step { health: self, id }
    }

    /// Since when at least one check has been failing without a break, or one step has
    /// been under way.
    pub fn failing_since(&self) -> Option<Instant> {
        let state = self.lock();
        let steps = state.pending_steps().map(|(_, since)| since);
        state.failing.iter().flatten().copied().chain(steps).min()
    }

    /// The names of the failing checks (slow steps included), for `/status` and `/readyz`.
    pub fn failing(&self) -> Vec<&'static str> {
        let state = self.lock();
        let slow = |c: &Check| {
            state
                .pending_steps()
                .any(|(check, since)| check == *c && since.elapsed() > SLOW_STEP)
        };
        CHECKS
            .iter()
            .filter(|c| state.failing[c.index()].is_some() || slow(c))
            .map(|c| c.name())
            .collect()
    }

    /// How `check` stands as its own tasks last found it, for readiness and the
    /// connection gauges: nothing here waits for, or asks, anything.
    pub fn standing(&self, check: Check) -> Standing {
        let state = self.lock();
        let slow = state
            .pending_steps()
            .filter(|(c, since)| *c == check && since.elapsed() > SLOW_STEP)
            .map(|(_, since)| since);
        match state.failing[check.index()].into_iter().chain(slow).min() {
            Some(since) => Standing::Failing(since.elapsed()),
            None if state.passed[check.index()].is_some() => Standing::Passing,
            None => Standing::Untried,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Plain instants: a panicking holder cannot leave them inconsistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// The steps under way whose check has not passed since they began.
    fn pending_steps(&self) -> impl Iterator<Item = (Check, Instant)> + '_ {
        self.steps
            .iter()
            .filter(|(_, check, since)| self.passed[check.index()].is_none_or(|p| p < *since))
            .map(|(_, check, since)| (*check, *since))
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn standing_is_untried_until_a_task_reports_then_follows_the_last_report() {
        let h = Health::default();
        assert_eq!(h.standing(Check::Postgres), Standing::Untried);
        h.fail(Check::Postgres, Instant::now() - Duration::from_secs(2));
        assert!(matches!(
            h.standing(Check::Postgres),
            Standing::Failing(d) if d >= Duration::from_secs(2)
        ));
        assert_eq!(h.standing(Check::Publish), Standing::Untried);
        h.pass(Check::Postgres);
        assert_eq!(h.standing(Check::Postgres), Standing::Passing);
    }

    #[test]
    fn a_step_under_way_counts_as_failing_since_it_began_until_it_ends() {
        let h = Health::default();
        let before = Instant::now();
        let step = h.step(Check::Postgres);
        let since = h.failing_since().expect("a step under way");
        assert!(before <= since && since <= Instant::now(), "since it began");
        assert!(h.failing().is_empty(), "not slow yet");
        drop(step);
        assert_eq!(h.failing_since(), None);
    }

    #[test]
    fn a_slow_step_does_not_count_while_its_check_passes_meanwhile() {
        let h = Health::default();
        let slow = h.step(Check::Postgres);
        std::thread::sleep(Duration::from_millis(2));
        assert!(h.failing_since().is_some(), "nothing passed since it began");
        h.pass(Check::Postgres);
        assert_eq!(h.failing_since(), None, "the database answered meanwhile");
        let publish = h.step(Check::Publish);
        assert!(
            h.failing_since().is_some(),
            "another check's pass says nothing of it"
        );
        drop(publish);
        let later = h.step(Check::Postgres);
        assert!(
            h.failing_since().is_some(),
            "a step begun after the pass counts"
        );
        drop((slow, later));
        assert_eq!(h.failing_since(), None);
    }

    /// Begun this long ago (the clock is not ours to move).
    fn aged(h: &Health, step: &Step<'_>, by: Duration) {
        let mut state = h.lock();
        if let Some(s) = state.steps.iter_mut().find(|(id, _, _)| *id == step.id) {
            s.2 -= by;
        }
    }

    #[test]
    fn a_hung_step_given_up_keeps_its_check_failing_until_it_passes() {
        let h = Health::default();
        let hung = h.step(Check::Postgres);
        aged(&h, &hung, Duration::from_secs(5));
        let since = h.failing_since().expect("under way");
        drop(hung);
        assert_eq!(h.failing_since(), Some(since), "given up, not passed");
        h.pass(Check::Postgres);
        assert_eq!(h.failing_since(), None);
        // One that ended after its check passed meanwhile left nothing behind.
        let slow = h.step(Check::Postgres);
        aged(&h, &slow, Duration::from_secs(5));
        h.pass(Check::Postgres);
        drop(slow);
        assert_eq!(h.failing_since(), None);
    }
}
