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
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

/// Rows due within this much of each other go out together, at the latest one's time:
/// tokio's timers fire on millisecond ticks anyway.
pub const SLOT: Duration = Duration::from_millis(1);
/// The largest rate difference between two clocks that NTP allows, as a fraction.
const DRIFT: u32 = 2_000;

/// The database clock as read by one statement (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DbClock {
    /// When the statement's answer arrived.
    pub at: Instant,
    /// The database clock read by the statement (the latest of its rows' reads).
    pub db: DateTime<Utc>,
}

impl DbClock {
    /// The earliest local instant at which the database clock surely shows `t`: `at`
    /// itself for a time already past.
    pub fn local(&self, t: DateTime<Utc>) -> Instant {
        let ahead = (t - self.db).to_std().unwrap_or_default();
        self.at + ahead + ahead / DRIFT
    }

    /// The database clock at the local instant `now`, as far as we know it: at most what
    /// it really shows, so a row sent at `local(t)` or later is stamped `t` or later.
    pub fn db_at(&self, now: Instant) -> DateTime<Utc> {
        let since = now.saturating_duration_since(self.at);
        let since = since.saturating_sub(since / (DRIFT + 1));
        self.db + chrono::Duration::from_std(since).unwrap_or_default()
    }
}

/// Rows sent together: a range of the batch's rows (in due order) and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub rows: Range<usize>,
    /// The latest local due instant of its rows: none of them is early then.
    pub at: Instant,
}

/// Group rows, given their local due instants in ascending order, into slots of at most
/// `width`: each slot opens at its first row and goes out at its last row's instant.
pub fn plan(due: &[Instant], width: Duration) -> Vec<Slot> {
    let mut slots: Vec<Slot> = Vec::new();
    let mut opened = None;
    for (i, &at) in due.iter().enumerate() {
        match (slots.last_mut(), opened) {
            (Some(slot), Some(first)) if at.saturating_duration_since(first) < width => {
                slot.rows.end = i + 1;
                slot.at = slot.at.max(at);
            }
            _ => {
                slots.push(Slot { rows: i..i + 1, at });
                opened = Some(at);
            }
        }
    }
    slots
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    fn rows_close_together_share_a_slot_sent_at_the_last_of_them() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_micros(n * 100);
        let due = [t0, t0, ms(5), ms(9), ms(10), ms(25), ms(100)];
        let slots = plan(&due, SLOT);
        let got: Vec<(Range<usize>, Instant)> = slots.into_iter().map(|s| (s.rows, s.at)).collect();
        assert_eq!(
            got,
            vec![
                (0..4, ms(9)),
                (4..5, ms(10)),
                (5..6, ms(25)),
                (6..7, ms(100))
            ]
        );
        assert!(plan(&[], SLOT).is_empty());
    }

    proptest! {
        /// Never early: a row sent at its slot's instant is stamped no earlier than its
        /// due time, for any clock reading and due times up to an hour ahead or behind.
        #[test]
        fn no_row_is_sent_or_stamped_before_it_is_due(
            offsets in proptest::collection::vec(-3_600_000_000i64..3_600_000_000, 1..200),
        ) {
            let c = clock();
            let mut due: Vec<DateTime<Utc>> = offsets
                .iter()
                .map(|us| c.db + chrono::Duration::microseconds(*us))
                .collect();
            due.sort();
            let local: Vec<Instant> = due.iter().map(|t| c.local(*t)).collect();
            let slots = plan(&local, SLOT);
            let covered: usize = slots.iter().map(|s| s.rows.len()).sum();
            prop_assert_eq!(covered, due.len());
            for slot in &slots {
                prop_assert!(slot.at >= c.at);
                for i in slot.rows.clone() {
                    prop_assert!(slot.at >= local[i]);
                    prop_assert!(c.db_at(slot.at) >= due[i].min(c.db));
                    if due[i] > c.db {
                        prop_assert!(c.db_at(slot.at) >= due[i]);
                    }
                    // Never more than a slot late by the local clock.
                    prop_assert!(slot.at.saturating_duration_since(local[i]) < SLOT);
                }
            }
        }
    }
}
