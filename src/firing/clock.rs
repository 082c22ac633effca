//! When each locked row is sent. A batch locks rows that come due within a short horizon
//! and holds them; each goes out at its due time by the *database's* clock, never before.
//!
//! The lock statement reads the database clock (`db`, with `clock_timestamp()`), and its
//! answer arrives here at the local monotonic instant `at`. The database clock showed
//! `db` no later than `at`, so at `at + (t − db)` it shows `t` or later: sending then is
//! never early, whatever the round trip took (its length only makes us later, never
//! earlier). The two clocks may run at slightly different rates (NTP slews a clock by at
//! most 500 ppm); the wait is stretched by that much, so it holds for any horizon.

use std::ops::Range;
use std::time::Instant;

use chrono::{DateTime, Utc};

use super::row::Row;

/// The largest rate difference between two clocks that NTP allows, as a fraction.
const DRIFT: u32 = 2_000;

/// The database clock as read by one statement (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DbClock {
    /// When the statement's answer arrived.
    pub(crate) at: Instant,
    /// The database clock read by the statement (the latest of its rows' reads).
    pub(crate) db: DateTime<Utc>,
}

impl DbClock {
    /// The earliest local instant at which the database clock surely shows `t`: `at`
    /// itself for a time already past.
    pub(crate) fn local(&self, t: DateTime<Utc>) -> Instant {
        let ahead = (t - self.db).to_std().unwrap_or_default();
        self.at + ahead + ahead / DRIFT
    }

    /// The database clock at the local instant `now`, as far as we know it: at most what
    /// it really shows, so a row sent at `local(t)` or later is stamped `t` or later.
    pub(crate) fn db_at(&self, now: Instant) -> DateTime<Utc> {
        let since = now.saturating_duration_since(self.at);
        let since = since.saturating_sub(since / (DRIFT + 1));
        self.db + chrono::Duration::from_std(since).unwrap_or_default()
    }
}

/// The rows to send together once woken at `now` for the row at `first`: it and every
/// row after it whose local due instant has come (instants in ascending order). The
/// timer wakes us on a millisecond tick, so rows due within it go out on that wake-up;
/// holding the earlier ones until the last of a fixed slot would make them later by up
/// to the slot's width.
pub(crate) fn due_by(due: &[Instant], first: usize, now: Instant) -> Range<usize> {
    let end = first
        + due
            .get(first..)
            .map_or(0, |rest| rest.partition_point(|at| *at <= now));
    first..end.max((first + 1).min(due.len()))
}

/// The database clock of a lock statement that locked rows: the latest read among them.
pub(super) fn read_clock<R: Row>(rows: &[R], at: Instant) -> Option<DbClock> {
    let db = rows.iter().map(|r| r.common().fired_at).max()?;
    Some(DbClock { at, db })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    fn clock() -> DbClock {
        DbClock {
            at: Instant::now(),
            db: "2026-11-22T10:00:00Z".parse().expect("time"),
        }
    }

    #[test]
    fn a_past_due_time_is_now_and_a_future_one_is_stretched_for_drift() {
        let c = clock();
        assert_eq!(c.local(c.db - chrono::Duration::seconds(5)), c.at);
        let ahead = c.local(c.db + chrono::Duration::milliseconds(100));
        assert_eq!(ahead - c.at, Duration::from_micros(100_050));
    }

    #[test]
    fn a_wake_up_takes_every_row_due_by_then_and_at_least_its_own() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_micros(n * 100);
        let due = [t0, t0, ms(5), ms(9), ms(10), ms(25), ms(100)];
        assert_eq!(due_by(&due, 0, ms(9)), 0..4);
        assert_eq!(
            due_by(&due, 4, ms(24)),
            4..5,
            "its own row, even woken early"
        );
        assert_eq!(due_by(&due, 5, ms(1000)), 5..7);
        assert_eq!(due_by(&due, 7, ms(1000)), 7..7);
        assert_eq!(due_by(&[], 0, t0), 0..0);
    }

    proptest! {
        /// Never early: woken at or after a row's local instant, every row sent then is
        /// stamped no earlier than its due time, for any clock reading, due times up to an
        /// hour ahead or behind, and wake-ups up to 3 ms late; each row is sent once.
        #[test]
        fn no_row_is_sent_or_stamped_before_it_is_due(
            offsets in proptest::collection::vec(-3_600_000_000i64..3_600_000_000, 1..200),
            late_us in proptest::collection::vec(0u64..3_000, 200),
        ) {
            let c = clock();
            let mut due: Vec<DateTime<Utc>> = offsets
                .iter()
                .map(|us| c.db + chrono::Duration::microseconds(*us))
                .collect();
            due.sort();
            let local: Vec<Instant> = due.iter().map(|t| c.local(*t)).collect();
            let mut first = 0;
            let mut wakes = late_us.iter();
            while first < local.len() {
                let now = local[first] + Duration::from_micros(*wakes.next().unwrap_or(&0));
                let sent = due_by(&local, first, now);
                prop_assert_eq!(sent.start, first);
                prop_assert!(sent.end > first);
                prop_assert!(now >= c.at);
                for i in sent.clone() {
                    prop_assert!(now >= local[i]);
                    prop_assert!(c.db_at(now) >= due[i].min(c.db));
                    if due[i] > c.db {
                        prop_assert!(c.db_at(now) >= due[i]);
                    }
                }
                // Nothing due by then waits for a later wake-up.
                prop_assert!(local.get(sent.end).is_none_or(|at| *at > now));
                first = sent.end;
            }
        }
    }
}
