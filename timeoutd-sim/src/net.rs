//! The link model: what happens to one delivery between the exchange and a queue.

use std::time::Duration;

use rand::Rng;
use rand::rngs::StdRng;

/// Delay, loss and duplication of every delivery (every link alike).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Links {
    /// Fixed part of the delay (broker hop).
    pub base: Duration,
    /// Uniform extra delay in `[0, jitter]`: messages sent close together reorder.
    pub jitter: Duration,
    /// Fraction of deliveries lost, 0..=1.
    pub loss: f64,
    /// Fraction of deliveries handed out twice (a redelivery), 0..=1.
    pub duplicate: f64,
}

impl Links {
    /// Delays (in ns from now) of the copies of one delivery: none when lost, two when
    /// duplicated.
    pub fn copies(&self, rng: &mut StdRng) -> Vec<u64> {
        if rng.random_bool(self.loss) {
            return Vec::new();
        }
        let mut out = vec![self.delay(rng)];
        if self.duplicate > 0.0 && rng.random_bool(self.duplicate) {
            out.push(self.delay(rng));
        }
        out
    }

    fn delay(&self, rng: &mut StdRng) -> u64 {
        let jitter = self.jitter.as_nanos() as u64;
        let extra = if jitter == 0 {
            0
        } else {
            rng.random_range(0..=jitter)
        };
        self.base.as_nanos() as u64 + extra
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn links(loss: f64, duplicate: f64) -> Links {
        Links {
            base: Duration::from_millis(1),
            jitter: Duration::from_millis(50),
            loss,
            duplicate,
        }
    }

    #[test]
    fn loss_and_duplication_follow_their_fractions() {
        let links = links(0.1, 0.05);
        let mut rng = StdRng::seed_from_u64(7);
        let copies: Vec<usize> = (0..100_000).map(|_| links.copies(&mut rng).len()).collect();
        let lost = copies.iter().filter(|c| **c == 0).count() as f64 / 1e5;
        let twice = copies.iter().filter(|c| **c == 2).count() as f64 / 1e5;
        assert!((lost - 0.1).abs() < 0.01, "{lost}");
        assert!((twice - 0.045).abs() < 0.01, "{twice}");
    }

    #[test]
    fn delays_stay_within_base_and_jitter() {
        let links = links(0.0, 0.0);
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..10_000 {
            let d = links.copies(&mut rng)[0];
            assert!((1_000_000..=51_000_000).contains(&d), "{d}");
        }
    }
}
