//! When the sink may try its credentials again after BIG-IP refused them.
//!
//! Directory services lock an account after a few wrong passwords, and a controller that logs in
//! every cycle (every 2-5 s) reaches any lockout threshold within a minute. So after a refusal the
//! next attempt waits `base`, then twice that, and so on up to [`MAX_LOGIN_BACKOFF`]; the only thing
//! that ends the wait early is a different password (a rotated Secret file). Pure: the caller passes
//! the time and a fingerprint of the credentials, so the schedule is unit-tested exactly.

use std::time::{Duration, Instant};

use super::config::MAX_LOGIN_BACKOFF;

/// What the gate says about trying now.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Go ahead.
    Try,
    /// Same credentials as the refused ones, and the wait is not over.
    Wait { remaining: Duration, refusals: u32 },
}

/// Refusal memory of one session.
#[derive(Debug)]
pub struct LoginGate {
    base: Duration,
    /// Refusals of the current credentials (sets the wait).
    refusals: u32,
    /// Refusals since the last accepted login, whatever the credentials (for the log).
    streak: u32,
    until: Option<Instant>,
    /// Fingerprint of the credentials BIG-IP refused last.
    refused: Option<u64>,
}

impl LoginGate {
    pub fn new(base: Duration) -> Self {
        LoginGate { base, refusals: 0, streak: 0, until: None, refused: None }
    }

    /// May credentials with this fingerprint be sent now?
    pub fn check(&self, now: Instant, fingerprint: u64) -> Verdict {
        match self.until {
            Some(until) if now < until && self.refused == Some(fingerprint) => {
                Verdict::Wait { remaining: until - now, refusals: self.refusals }
            }
            _ => Verdict::Try,
        }
    }

    /// BIG-IP refused these credentials at `now`; returns the wait before the next attempt, and
    /// whether this starts a streak of refusals (the moment to tell the operator).
    pub fn refused(&mut self, now: Instant, fingerprint: u64) -> (Duration, bool) {
        let first = self.streak == 0;
        self.streak += 1;
        // New credentials refused start their own schedule: they are a different mistake.
        if self.refused != Some(fingerprint) {
            self.refusals = 0;
        }
        let wait = self.base.saturating_mul(1u32 << self.refusals.min(16)).min(MAX_LOGIN_BACKOFF);
        self.refusals += 1;
        self.refused = Some(fingerprint);
        self.until = Some(now + wait);
        (wait, first)
    }

    /// A login succeeded; returns how many refusals preceded it.
    pub fn accepted(&mut self) -> u32 {
        let n = self.streak;
        *self = LoginGate::new(self.base);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_password_is_tried_at_most_three_times_a_minute_then_ever_more_rarely() {
        // A controller cycling every 2 s asks the gate before each login.
        let mut gate = LoginGate::new(Duration::from_secs(15));
        let t0 = Instant::now();
        let mut attempts = Vec::new();
        for cycle in 0..1000u64 {
            let now = t0 + Duration::from_secs(2 * cycle);
            if gate.check(now, 7) == Verdict::Try {
                attempts.push(2 * cycle);
                gate.refused(now, 7);
            }
        }
        let in_first_minute = attempts.iter().filter(|&&t| t < 60).count();
        assert!(in_first_minute <= 3, "{attempts:?}");
        assert_eq!(attempts[..4], [0, 16, 46, 106], "15 s, then 30 s, then 60 s");
        // Capped at 5 minutes: the gaps stop growing.
        let gaps: Vec<u64> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|&g| g <= 302), "{gaps:?}");
        assert!(gaps.last().is_some_and(|&g| g >= 300), "{gaps:?}");
    }

    #[test]
    fn new_credentials_are_tried_at_once_and_success_resets() {
        let mut gate = LoginGate::new(Duration::from_secs(15));
        let t0 = Instant::now();
        gate.refused(t0, 1);
        gate.refused(t0, 1);
        assert!(matches!(gate.check(t0 + Duration::from_secs(1), 1), Verdict::Wait { refusals: 2, .. }));
        assert_eq!(gate.check(t0 + Duration::from_secs(1), 2), Verdict::Try, "rotated password");
        let (wait, first) = gate.refused(t0 + Duration::from_secs(1), 2);
        assert_eq!(wait, Duration::from_secs(15), "a new mistake starts its own schedule");
        assert!(!first, "still the same streak for the log");
        assert_eq!(gate.accepted(), 3);
        assert_eq!(gate.check(t0, 2), Verdict::Try);
        let (_, first) = gate.refused(t0, 2);
        assert!(first);
    }
}
