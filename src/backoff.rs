//! Capped exponential backoff with jitter, for reconnects, database retries and the
//! retry delay of rows whose publish failed.

use std::time::Duration;

use rand::Rng;

/// Delays for consecutive failures: `min`, doubling up to `max`, each with up to +50%
/// random jitter (never above `max`) so replicas do not retry in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            failures: 0,
        }
    }

    /// The delay before the next try; each call counts one more failure.
    pub fn next_delay(&mut self) -> Duration {
        let base = exponential(self.min, self.max, self.failures);
        self.failures = self.failures.saturating_add(1);
        let jitter = rand::rng().random_range(0.0..0.5);
        base.mul_f64(1.0 + jitter).min(self.max)
    }

    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

/// `min * 2^attempts`, capped at `max` (no jitter: stored in the row, reproducible).
pub fn exponential(min: Duration, max: Duration, attempts: u32) -> Duration {
    let factor = 2u32.saturating_pow(attempts.min(31));
    min.saturating_mul(factor).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(1));
        let got: Vec<u128> = (0..6)
            .map(|a| exponential(min, max, a).as_millis())
            .collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(exponential(min, max, u32::MAX), max);
    }

    #[test]
    fn jitter_stays_within_half_and_the_cap() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(1));
        let mut b = Backoff::new(min, max);
        for attempt in 0..40 {
            let base = exponential(min, max, attempt);
            let d = b.next_delay();
            assert!(
                d >= base && d <= max && d <= base.mul_f64(1.5),
                "{attempt}: {d:?}"
            );
        }
        // After a reset the next delay is the first one again.
        b.reset();
        assert!(b.next_delay() < Duration::from_millis(151));
    }
}
