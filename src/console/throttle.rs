//! Failed token attempts per client address, as a token bucket: each client may fail
//! [`BURST`] times at once, and once more every [`REFILL`]; past that, every request of
//! it that carries a token is answered 429 (with `Retry-After`) until a failure is
//! allowed again, whatever the token: a guess is then neither checked nor told apart.
//! The table holds at most [`MAX_CLIENTS`] addresses (IPv6 ones by their /64, which one
//! host may hold whole); past that, entries whose bucket is full again go first, then
//! the one that failed longest ago: an attacker with many addresses costs bounded
//! memory (and has, with each address, no more guesses than it would anyway).

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Failures a client may make at once.
pub(super) const BURST: u32 = 10;
/// Another failure is allowed this long after the last one taken.
pub(super) const REFILL: Duration = Duration::from_secs(6);
/// Addresses remembered at once.
pub(super) const MAX_CLIENTS: usize = 4096;

/// A client as counted: an IPv4 address, or the /64 of an IPv6 one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Client(u128);

impl Client {
    fn of(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(v4) => Client(u128::from(u32::from(v4))),
            IpAddr::V6(v6) => Client((u128::from(v6) >> 64 << 64) | 1),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Failures allowed as of `at`.
    left: f64,
    at: Instant,
}

impl Bucket {
    fn left(&self, now: Instant) -> f64 {
        let refilled = now.saturating_duration_since(self.at).as_secs_f64() / REFILL.as_secs_f64();
        (self.left + refilled).min(f64::from(BURST))
    }
}

#[derive(Debug, Default)]
pub(super) struct Throttle {
    clients: HashMap<Client, Bucket>,
}

impl Throttle {
    /// `Err(wait)`: the client has no failure left; one is allowed again after `wait`.
    pub(super) fn check(&self, ip: IpAddr, now: Instant) -> Result<(), Duration> {
        let Some(bucket) = self.clients.get(&Client::of(ip)) else {
            return Ok(());
        };
        let left = bucket.left(now);
        if left >= 1.0 {
            return Ok(());
        }
        Err(REFILL.mul_f64(1.0 - left))
    }

    /// The client failed once (a token that is none of the configured ones).
    pub(super) fn failed(&mut self, ip: IpAddr, now: Instant) {
        let client = Client::of(ip);
        if !self.clients.contains_key(&client) && self.clients.len() >= MAX_CLIENTS {
            self.make_room(now);
        }
        let bucket = self.clients.entry(client).or_insert(Bucket {
            left: f64::from(BURST),
            at: now,
        });
        bucket.left = (bucket.left(now) - 1.0).max(0.0);
        bucket.at = now;
    }

    /// Forget the clients whose bucket is full again; if none is, the one that failed
    /// longest ago.
    fn make_room(&mut self, now: Instant) {
        self.clients.retain(|_, b| b.left(now) < f64::from(BURST));
        if self.clients.len() < MAX_CLIENTS {
            return;
        }
        if let Some(oldest) = self
            .clients
            .iter()
            .min_by_key(|(_, b)| b.at)
            .map(|(c, _)| *c)
        {
            self.clients.remove(&oldest);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.clients.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn a_client_fails_its_burst_then_waits_for_a_refill() {
        let mut t = Throttle::default();
        let now = Instant::now();
        let (guesser, other) = (ip("10.0.0.1"), ip("10.0.0.2"));
        for _ in 0..BURST {
            assert!(t.check(guesser, now).is_ok());
            t.failed(guesser, now);
        }
        let wait = t.check(guesser, now).expect_err("throttled");
        assert!(wait > Duration::ZERO && wait <= REFILL, "{wait:?}");
        assert!(t.check(other, now).is_ok(), "another address is not");
        assert!(
            t.check(ip("::ffff:10.0.0.1"), now).is_err(),
            "mapped: the same"
        );
        assert!(
            t.check(guesser, now + wait).is_ok(),
            "one more after the wait"
        );
        t.failed(guesser, now + wait);
        assert!(t.check(guesser, now + wait).is_err());
    }

    #[test]
    fn an_ipv6_host_is_counted_by_its_64() {
        let mut t = Throttle::default();
        let now = Instant::now();
        for i in 0..BURST {
            t.failed(ip(&format!("2001:db8:1:2::{i:x}")), now);
        }
        assert!(t.check(ip("2001:db8:1:2:ffff::1"), now).is_err());
        assert!(t.check(ip("2001:db8:1:3::1"), now).is_ok());
    }

    /// Many addresses fill the table to its bound, never past it, and a client that is
    /// throttled stays so while fewer failed since it than the table holds.
    #[test]
    fn the_table_is_bounded() {
        let mut t = Throttle::default();
        let now = Instant::now();
        let guesser = ip("192.0.2.1");
        for _ in 0..BURST {
            t.failed(guesser, now);
        }
        for i in 0..(MAX_CLIENTS as u32 * 3) {
            let later = now + Duration::from_micros(u64::from(i) + 1);
            t.failed(IpAddr::V4((0x0a00_0000 + i).into()), later);
            assert!(t.len() <= MAX_CLIENTS);
        }
        assert_eq!(t.len(), MAX_CLIENTS);
        // Each of those failed once (bucket not full), so the oldest went first: the
        // guesser, whose last failure is the oldest of all.
        assert!(t.check(guesser, now).is_ok());
    }
}
