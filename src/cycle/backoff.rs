//! When to try a failing load balancer again: exponential backoff with jitter, as a value.
//!
//! Pure: the caller passes the time, and the jitter comes from a generator seeded per pool, so a test
//! (or the benchmark) replays the same waits. Jitter keeps several controllers (or several pools on
//! one BIG-IP) from retrying in lockstep after a shared outage.

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Waits of `base * 2^(failures-1)`, capped at `max`, each scaled by a random factor in 0.8..1.2.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    failures: u32,
    retry_at: Option<Instant>,
    rng: ChaCha8Rng,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration, seed: u64) -> Self {
        Backoff { base, max, failures: 0, retry_at: None, rng: ChaCha8Rng::seed_from_u64(seed) }
    }

    /// Consecutive failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Whether a new attempt may start at `now`.
    pub fn ready(&self, now: Instant) -> bool {
        self.retry_at.is_none_or(|at| now >= at)
    }

    /// Record a failure at `now`; returns how long to wait before the next attempt.
    pub fn failed(&mut self, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let doublings = self.failures.saturating_sub(1).min(20);
        let wait = self.base.saturating_mul(1u32 << doublings).min(self.max);
        let wait = wait.mul_f64(self.rng.gen_range(0.8..1.2));
        self.retry_at = Some(now + wait);
        wait
    }

    /// Success, or proof that the load balancer answers again: the next attempt may start at once.
    pub fn reset(&mut self) {
        self.failures = 0;
        self.retry_at = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_with_bounded_jitter() {
        let t0 = Instant::now();
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(60), 7);
        let waits: Vec<f64> = (0..10).map(|_| b.failed(t0).as_secs_f64()).collect();
        let nominal = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0, 60.0];
        for (w, n) in waits.iter().zip(nominal) {
            assert!(*w >= n * 0.8 && *w <= n * 1.2, "wait {w} not within 20% of {n}");
        }
        assert_eq!(b.failures(), 10);
    }

    #[test]
    fn not_ready_until_the_wait_is_over_and_ready_after_reset() {
        let t0 = Instant::now();
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(60), 1);
        assert!(b.ready(t0));
        let w = b.failed(t0);
        assert!(!b.ready(t0 + w / 2));
        assert!(b.ready(t0 + w));
        b.failed(t0);
        b.reset();
        assert!(b.ready(t0));
        assert_eq!(b.failures(), 0);
    }

    #[test]
    fn same_seed_same_waits() {
        let t0 = Instant::now();
        let mut a = Backoff::new(Duration::from_secs(1), Duration::from_secs(60), 3);
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(60), 3);
        for _ in 0..5 {
            assert_eq!(a.failed(t0), b.failed(t0));
        }
    }
}
