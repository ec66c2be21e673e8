//! Ratio policies: pure, deterministic functions from a pool's samples (and their own memory) to one
//! integer ratio per member. No I/O, no clock reads: time enters only as sample ages and cycle counts.
//!
//! [`PoolPolicy`] holds the rules every algorithm shares: what counts as stale, how long a member
//! without fresh data keeps its ratio (the grace period) before it falls back to the pool mean, that a
//! new member starts at the pool mean, and clamping to the configured range. The algorithms
//! ([`capacity`], [`headroom`], [`feedback`]) only see members with fresh samples.

pub mod capacity;
pub mod feedback;
pub mod headroom;
#[cfg(test)]
mod properties;

use std::collections::BTreeMap;
use std::time::Duration;

use llm_lc_adapters::{MemberId, Ratios};
use serde::Deserialize;

use crate::ratio::RatioRange;
use crate::source::{Sample, Snapshot};

/// Which algorithm a pool uses, with its parameters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum PolicyConfig {
    /// Memoryless: ratio proportional to `1 / (1 + score)` of KV usage and queue.
    Headroom(headroom::HeadroomParams),
    /// Integral: moves every ratio toward equal load across the pool each cycle.
    Feedback(feedback::FeedbackParams),
    /// Capacity estimated from what each server runs and how fast, with feed-forward, corrected by
    /// queueing delay and utilization.
    Capacity(capacity::CapacityParams),
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::Capacity(capacity::CapacityParams::default())
    }
}

impl PolicyConfig {
    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::Headroom(_) => "headroom",
            PolicyConfig::Feedback(_) => "feedback",
            PolicyConfig::Capacity(_) => "capacity",
        }
    }

    /// The queue and running-request norms loads are read with (for saturation and priority tiers).
    pub fn norms(&self) -> (f64, f64) {
        match self {
            PolicyConfig::Headroom(h) => (h.queue_norm, h.running_norm),
            PolicyConfig::Feedback(f) => (f.queue_norm, f.running_norm),
            PolicyConfig::Capacity(c) => (capacity::SATURATION_QUEUE_NORM, c.running_norm),
        }
    }

    pub fn validate(&self) -> Vec<(String, String)> {
        match self {
            PolicyConfig::Headroom(p) => p.validate(),
            PolicyConfig::Feedback(p) => p.validate(),
            PolicyConfig::Capacity(p) => p.validate(),
        }
    }
}

/// How "loaded" a server is, as one number where 1 means a full KV cache (or a full batch) and each
/// `queue_norm` waiting requests add one more. Both policies and the saturation figure use it.
pub fn load(s: &Sample, queue_norm: f64, running_norm: f64) -> f64 {
    let busy = match (s.kv_usage, s.slots) {
        (Some(kv), _) => kv,
        (None, Some(slots)) => s.running / slots.max(1.0),
        (None, None) => s.running / running_norm.max(1e-9),
    };
    busy + s.waiting / queue_norm.max(1e-9)
}

/// Pool saturation for autoscalers: mean over fresh members of `min(1, load)`.
pub fn saturation(fresh: &[Fresh<'_>], queue_norm: f64, running_norm: f64) -> Option<f64> {
    if fresh.is_empty() {
        return None;
    }
    let total: f64 = fresh.iter().map(|f| load(f.sample, queue_norm, running_norm).min(1.0)).sum();
    Some(total / fresh.len() as f64)
}

/// A member with a fresh sample, as the algorithms see it.
#[derive(Debug, Clone, Copy)]
pub struct Fresh<'a> {
    /// Its position among the snapshot's members: the dense index of per-member memory.
    pub index: usize,
    pub id: &'a MemberId,
    pub sample: &'a Sample,
    /// Its starting ratio: its previous ratio, or the pool mean when it is new.
    pub start: f64,
}

/// One algorithm's view of a cycle: the fresh members in member order, and the whole snapshot (its
/// member list is what per-member memory is kept in line with).
pub struct Inputs<'a> {
    pub fresh: &'a [Fresh<'a>],
    pub snapshot: &'a Snapshot,
    pub range: RatioRange,
}

enum Algo {
    Headroom(headroom::Headroom),
    Feedback(feedback::Feedback),
    Capacity(capacity::Capacity),
}

/// What a cycle of the policy produced and why.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub ratios: Ratios,
    /// Members that had fresh samples.
    pub fresh: usize,
    /// Members without fresh data that kept their previous ratio (within grace).
    pub held: Vec<MemberId>,
    /// Members without fresh data (or new) that were given the pool mean.
    pub defaulted: Vec<MemberId>,
    /// 0..1, see [`saturation`].
    pub saturation: Option<f64>,
}

/// A pool's policy with the rules shared by every algorithm.
pub struct PoolPolicy {
    algo: Algo,
    range: RatioRange,
    stale_after: Duration,
    grace_cycles: u32,
    /// Consecutive cycles each member has gone without fresh data.
    missing: BTreeMap<MemberId, u32>,
}

impl PoolPolicy {
    /// `grace` is converted to whole cycles of `interval`, so the policy itself never reads a clock.
    pub fn new(
        cfg: &PolicyConfig,
        range: RatioRange,
        stale_after: Duration,
        grace: Duration,
        interval: Duration,
    ) -> Self {
        let grace_cycles =
            if interval.is_zero() { 0 } else { (grace.as_secs_f64() / interval.as_secs_f64()).ceil() as u32 };
        let algo = match cfg {
            PolicyConfig::Headroom(p) => Algo::Headroom(headroom::Headroom::new(p.clone())),
            PolicyConfig::Feedback(p) => Algo::Feedback(feedback::Feedback::new(p.clone())),
            PolicyConfig::Capacity(p) => Algo::Capacity(capacity::Capacity::new(p.clone(), interval)),
        };
        PoolPolicy { algo, range, stale_after, grace_cycles, missing: BTreeMap::new() }
    }

    fn norms(&self) -> (f64, f64) {
        match &self.algo {
            Algo::Headroom(h) => (h.params.queue_norm, h.params.running_norm),
            Algo::Feedback(f) => (f.params.queue_norm, f.params.running_norm),
            Algo::Capacity(c) => (capacity::SATURATION_QUEUE_NORM, c.params.running_norm),
        }
    }

    /// One cycle. `prev` is what the load balancer holds now (or what was last pushed).
    pub fn compute(&mut self, snap: &Snapshot, prev: &Ratios) -> Outcome {
        // `prev` and the snapshot are both in member order: one walk instead of a lookup each.
        let prev_of: Vec<Option<&u32>> = prev.as_map().aligned(snap.members.keys()).collect();
        let (known_sum, known_n) = prev_of
            .iter()
            .flatten()
            .fold((0.0, 0usize), |(sum, n), &&r| (sum + self.range.clamp(r as f64) as f64, n + 1));
        let prev_mean = if known_n > 0 { known_sum / known_n as f64 } else { self.range.mid() };
        let mut fresh: Vec<Fresh<'_>> = Vec::with_capacity(snap.members.len());
        fresh.extend(snap.members.iter().zip(&prev_of).enumerate().filter_map(
            |(index, ((id, s), before))| {
                let sample = s.as_ref().filter(|s| s.age <= self.stale_after)?;
                let start = before.map(|&r| self.range.clamp(r as f64) as f64).unwrap_or(prev_mean);
                Some(Fresh { index, id, sample, start })
            },
        ));

        let inputs = Inputs { fresh: &fresh, snapshot: snap, range: self.range };
        // One ratio per fresh member, in the same order.
        let computed: Vec<u32> = match &mut self.algo {
            Algo::Headroom(h) => h.compute(&inputs),
            Algo::Feedback(f) => f.compute(&inputs),
            Algo::Capacity(c) => c.compute(&inputs),
        };
        let computed_mean = (!computed.is_empty())
            .then(|| computed.iter().map(|&r| r as f64).sum::<f64>() / computed.len() as f64);
        let pool_mean = self.range.clamp(computed_mean.unwrap_or(prev_mean));

        let mut out = Outcome { fresh: fresh.len(), ..Default::default() };
        let mut fresh_out = fresh.iter().zip(&computed).peekable();
        let mut prev_of = prev_of.into_iter();
        let mut i = 0;
        // Built from the snapshot's members, so already in member order.
        let ratios = snap.members.map(|m, _| {
            let before = prev_of.next().flatten();
            let index = i;
            i += 1;
            if let Some((_, &r)) = fresh_out.next_if(|(f, _)| f.index == index) {
                if !self.missing.is_empty() {
                    self.missing.remove(m);
                }
                return self.range.clamp(r as f64);
            }
            let n = self.missing.entry(m.clone()).or_insert(0);
            *n += 1;
            match before {
                Some(&r) if *n <= self.grace_cycles => {
                    out.held.push(m.clone());
                    self.range.clamp(r as f64)
                }
                _ => {
                    out.defaulted.push(m.clone());
                    pool_mean
                }
            }
        });
        if !self.missing.is_empty() {
            self.missing.retain(|m, _| snap.members.contains_key(m));
        }
        let (qn, rn) = self.norms();
        out.saturation = saturation(&fresh, qn, rn);
        out.ratios = Ratios::from(ratios);
        out
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    use super::*;

    pub fn sample(waiting: f64, running: f64, kv: f64) -> Sample {
        Sample {
            waiting,
            running,
            kv_usage: Some(kv),
            latency: None,
            service: None,
            queue_time: None,
            token_time: None,
            prompt_cached: None,
            slots: None,
            age: Duration::from_secs(1),
        }
    }

    pub fn snap(members: &[(&str, Option<Sample>)]) -> Snapshot {
        Snapshot {
            members: members.iter().map(|(m, s)| (MemberId::from(*m), s.clone())).collect(),
            rejected: vec![],
            failures: vec![],
            labels: Default::default(),
        }
    }

    pub fn ratios(rs: &[(&str, u32)]) -> Ratios {
        rs.iter().map(|(m, r)| (MemberId::from(*m), *r)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;

    fn policy(cfg: PolicyConfig) -> PoolPolicy {
        PoolPolicy::new(
            &cfg,
            RatioRange { min: 1, max: 100 },
            Duration::from_secs(30),
            Duration::from_secs(10),
            Duration::from_secs(5),
        )
    }

    fn both() -> Vec<PolicyConfig> {
        vec![
            PolicyConfig::Headroom(Default::default()),
            PolicyConfig::Feedback(Default::default()),
            PolicyConfig::Capacity(Default::default()),
        ]
    }

    #[test]
    fn missing_member_holds_for_grace_then_gets_pool_mean() {
        for cfg in both() {
            let mut p = policy(cfg);
            let prev = ratios(&[("a:1", 80), ("b:1", 20), ("c:1", 60)]);
            let s = snap(&[
                ("a:1", Some(sample(0.0, 4.0, 0.3))),
                ("b:1", None),
                ("c:1", Some(sample(0.0, 4.0, 0.3))),
            ]);
            // grace 10s at 5s interval = 2 cycles held.
            for cycle in 1..=2 {
                let o = p.compute(&s, &prev);
                assert_eq!(o.ratios.get(&MemberId::from("b:1")), Some(20), "cycle {cycle} holds");
                assert_eq!(o.held, vec![MemberId::from("b:1")]);
            }
            let o = p.compute(&s, &prev);
            let a = o.ratios.get(&MemberId::from("a:1")).expect("a");
            let c = o.ratios.get(&MemberId::from("c:1")).expect("c");
            let expect = ((a + c) as f64 / 2.0).round() as u32;
            assert_eq!(o.ratios.get(&MemberId::from("b:1")), Some(expect), "after grace: pool mean");
            assert_eq!(o.defaulted, vec![MemberId::from("b:1")]);
        }
    }

    #[test]
    fn stale_sample_counts_as_missing() {
        for cfg in both() {
            let mut p = policy(cfg);
            let mut old = sample(10.0, 4.0, 0.99);
            old.age = Duration::from_secs(31);
            let o = p.compute(
                &snap(&[("a:1", Some(old)), ("b:1", Some(sample(0.0, 1.0, 0.1)))]),
                &ratios(&[("a:1", 40)]),
            );
            assert_eq!(o.fresh, 1);
            assert_eq!(o.ratios.get(&MemberId::from("a:1")), Some(40));
        }
    }

    #[test]
    fn new_member_without_data_starts_at_pool_mean_not_max() {
        for cfg in both() {
            let mut p = policy(cfg);
            let prev = ratios(&[("a:1", 30), ("b:1", 30)]);
            let s = snap(&[
                ("a:1", Some(sample(1.0, 4.0, 0.5))),
                ("b:1", Some(sample(1.0, 4.0, 0.5))),
                ("new:1", None),
            ]);
            let o = p.compute(&s, &prev);
            let a = o.ratios.get(&MemberId::from("a:1")).expect("a");
            assert_eq!(o.ratios.get(&MemberId::from("new:1")), Some(a));
            assert!(a < 100);
        }
    }

    #[test]
    fn saturation_is_mean_capped_load() {
        let mut p = policy(PolicyConfig::default());
        let o = p.compute(
            &snap(&[("a:1", Some(sample(0.0, 4.0, 0.2))), ("b:1", Some(sample(80.0, 4.0, 0.9)))]),
            &Ratios::default(),
        );
        assert_eq!(o.saturation, Some(0.6));
    }
}
