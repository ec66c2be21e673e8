//! Which ratio changes are worth a write: the change policy.
//!
//! On BIG-IP every ratio write is a configuration change (mcpd, the audit log, config-sync to the
//! peer), so a ratio nudged from 55 to 57 every cycle is noise with a cost. A member's new ratio is
//! written at once when it moved by at least `min_change` (relative to what the load balancer was
//! last given); smaller moves wait until `max_hold` has passed since that member's last write. A
//! steady fleet with jitter then costs at most one write per member per `max_hold`, while a real
//! change (a replica slowed to a third) goes out as soon as the policy's ratio has moved that far.
//!
//! Pure: time is passed in, and what the load balancer was given is recorded only when a push
//! succeeded ([`ChangeFilter::committed`]), so a failed push is retried with the same values.

use std::time::{Duration, Instant};

use llm_lc_adapters::{MemberMap, Ratios, SinkConfig};
use serde::Deserialize;

use crate::policy::capacity::Mode;
use crate::policy::PolicyConfig;

/// `change:` of a pool. Defaults depend on the sink: see [`ChangePolicy::default_for`].
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChangePolicy {
    /// Write a member's ratio at once when it moved by at least this fraction of the value the load
    /// balancer holds (0 = write every change at once).
    pub min_change: f64,
    /// Write smaller moves once this long has passed since the member's last write.
    #[serde(with = "humantime_serde")]
    pub max_hold: Duration,
}

impl ChangePolicy {
    /// Every change is written at once: load balancers whose weights are runtime state (HAProxy's
    /// runtime API, Envoy EDS, the reference proxy), where a write costs nothing lasting.
    pub const EVERY_CHANGE: ChangePolicy = ChangePolicy { min_change: 0.0, max_hold: Duration::ZERO };

    /// BIG-IP: writes are configuration. 20% or once a minute keeps a steady fleet at no more than one
    /// write per member per minute; behind least-connections (`ratio-least-connections-member`)
    /// ratios within 20% of each other route alike, because the connection count corrects the rest.
    pub const CONFIGURATION: ChangePolicy =
        ChangePolicy { min_change: 0.2, max_hold: Duration::from_secs(60) };

    /// BIG-IP `ratio-member` (weighted round robin): nothing corrects a held weight, every error
    /// becomes a queue, so moves of 10% are written. On seeds 1-3 of the benchmark's goals grid this
    /// cut `ratio`'s p99 TTFT by 15-45% at 5 of 13 points (memory-bound fleets), cost 8-17% at 2,
    /// for about 25% more writes (src/bench/RESULTS.md).
    pub const CONFIGURATION_ROUND_ROBIN: ChangePolicy =
        ChangePolicy { min_change: 0.1, max_hold: Duration::from_secs(60) };

    /// The default for a pool: by what a write costs on its sink and, on BIG-IP, by how the ratios
    /// are used (the `capacity` policy's `mode`).
    pub fn default_for(sink: &SinkConfig, policy: &PolicyConfig) -> ChangePolicy {
        match sink {
            // In sideband mode nothing is written to BIG-IP: the iRule reads every change for free.
            SinkConfig::F5(f) if f.mode == llm_lc_adapters::f5::F5Mode::Push => {
                ChangePolicy::for_config_writes(policy)
            }
            _ => ChangePolicy::EVERY_CHANGE,
        }
    }

    /// For a load balancer where every write is configuration.
    pub fn for_config_writes(policy: &PolicyConfig) -> ChangePolicy {
        match policy {
            PolicyConfig::Capacity(p) if p.mode == Mode::RoundRobin => {
                ChangePolicy::CONFIGURATION_ROUND_ROBIN
            }
            _ => ChangePolicy::CONFIGURATION,
        }
    }

    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        if !(self.min_change.is_finite() && (0.0..=1.0).contains(&self.min_change)) {
            problems.push(("change.min_change".into(), "must be between 0 and 1".into()));
        }
        if self.max_hold > Duration::from_secs(24 * 3600) {
            problems.push(("change.max_hold".into(), "must be at most 24h".into()));
        }
        problems
    }
}

/// What each member was last given, and when.
#[derive(Debug, Clone)]
pub struct ChangeFilter {
    policy: ChangePolicy,
    /// In member order, like the ratios it is compared with (one walk, no lookups).
    sent: MemberMap<(u32, Instant)>,
}

impl ChangeFilter {
    pub fn new(policy: ChangePolicy) -> Self {
        ChangeFilter { policy, sent: MemberMap::default() }
    }

    /// The ratios to send: `desired` where the change is worth a write, the value last written
    /// otherwise. Members never written get their desired ratio.
    pub fn filter(&self, desired: &Ratios, now: Instant) -> Ratios {
        let mut sent = self.sent.aligned(desired.members());
        Ratios::from(desired.as_map().map(|_, &want| match sent.next().flatten() {
            Some(&(had, at)) if had != want && !self.worth_writing(had, want, at, now) => had,
            _ => want,
        }))
    }

    fn worth_writing(&self, had: u32, want: u32, at: Instant, now: Instant) -> bool {
        let moved = f64::from(had.abs_diff(want));
        let threshold = (self.policy.min_change * f64::from(had)).max(1.0);
        // After max_hold a smaller move goes out too, but not rounding noise: a policy that wobbles
        // one unit around its value would otherwise cost every member a write every max_hold.
        let floor = (self.policy.min_change / 8.0 * f64::from(had)).max(1.0);
        moved >= threshold || (now.saturating_duration_since(at) >= self.policy.max_hold && moved >= floor)
    }

    /// The load balancer accepted `sent` at `now`. Members that left the pool are forgotten.
    pub fn committed(&mut self, sent: &Ratios, now: Instant) {
        let mut before = self.sent.aligned(sent.members());
        let next = sent.as_map().map(|_, &r| match before.next().flatten() {
            Some(&(was, at)) if was == r => (r, at),
            _ => (r, now),
        });
        self.sent = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm_lc_adapters::MemberId;

    fn ratios(rs: &[(&str, u32)]) -> Ratios {
        rs.iter().map(|(m, r)| (MemberId::from(*m), *r)).collect()
    }

    #[test]
    fn small_moves_wait_for_max_hold_large_ones_go_at_once() {
        let t0 = Instant::now();
        let mut f = ChangeFilter::new(ChangePolicy::CONFIGURATION);
        f.committed(&ratios(&[("a:1", 50), ("b:1", 50)]), t0);
        let t1 = t0 + Duration::from_secs(5);
        // a moves 4% (held), b moves 40% (written).
        let out = f.filter(&ratios(&[("a:1", 52), ("b:1", 30)]), t1);
        assert_eq!(out, ratios(&[("a:1", 50), ("b:1", 30)]));
        f.committed(&out, t1);
        // A minute after a's last write, its small move goes out; b was written 5 s later, so its
        // own small move still waits.
        let t2 = t0 + Duration::from_secs(60);
        let out = f.filter(&ratios(&[("a:1", 52), ("b:1", 31)]), t2);
        assert_eq!(out, ratios(&[("a:1", 52), ("b:1", 30)]));
    }

    #[test]
    fn steady_jitter_costs_at_most_one_write_per_member_per_max_hold() {
        let t0 = Instant::now();
        let mut f = ChangeFilter::new(ChangePolicy::CONFIGURATION);
        let mut last = ratios(&[("a:1", 55), ("b:1", 52), ("c:1", 71), ("d:1", 24)]);
        f.committed(&last, t0);
        let mut writes = 0;
        // Ten minutes of 5 s cycles, every ratio jittering by up to ~10%.
        for cycle in 1..=120u32 {
            let j = |base: u32, k: u32| base + (cycle * k) % (base / 10 + 1);
            let desired =
                ratios(&[("a:1", j(55, 3)), ("b:1", j(52, 5)), ("c:1", j(71, 7)), ("d:1", j(24, 1))]);
            let now = t0 + Duration::from_secs(5 * u64::from(cycle));
            let out = f.filter(&desired, now);
            writes += out.iter().filter(|(m, r)| last.get(m) != Some(*r)).count();
            f.committed(&out, now);
            last = out;
        }
        assert!(writes <= 4 * 10, "{writes} writes in 10 minutes for 4 members");
        assert!(writes > 0, "jitter that persists is written eventually");
    }

    #[test]
    fn every_change_policy_passes_everything() {
        let t0 = Instant::now();
        let mut f = ChangeFilter::new(ChangePolicy::EVERY_CHANGE);
        f.committed(&ratios(&[("a:1", 50)]), t0);
        assert_eq!(f.filter(&ratios(&[("a:1", 51)]), t0), ratios(&[("a:1", 51)]));
    }

    #[test]
    fn new_members_and_uncommitted_values_are_sent_as_desired() {
        let t0 = Instant::now();
        let mut f = ChangeFilter::new(ChangePolicy::CONFIGURATION);
        f.committed(&ratios(&[("a:1", 50)]), t0);
        let out = f.filter(&ratios(&[("a:1", 51), ("new:1", 7)]), t0);
        assert_eq!(out, ratios(&[("a:1", 50), ("new:1", 7)]));
        // A member that left is forgotten: back later, it is new again.
        f.committed(&ratios(&[("new:1", 7)]), t0);
        assert_eq!(f.filter(&ratios(&[("a:1", 51)]), t0), ratios(&[("a:1", 51)]));
    }
}
