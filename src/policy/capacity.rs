//! `capacity`: ratios from each server's estimated capacity, with feed-forward, corrected by what
//! users feel (queueing delay) and by what the pool's other traffic takes (utilization).
//!
//! Why not equalize KV usage (`feedback`): KV usage is not what users feel, and it is not
//! comparable across servers whose memory and speed differ differently. A tensor-parallel-2 replica
//! has 2.35x the KV cache but only ~1.7x the speed: at equal KV usage it gets 2.35x the requests and
//! queues. And an integrator needs many cycles to move a share by 3x.
//!
//! What it estimates per member, from the samples the controller already has:
//! - **capacity in concurrent requests** `K`: while the server queues, what it runs *is* its limit
//!   (KV or batch, whichever binds); otherwise `running / KV usage` (how many of today's requests
//!   would fill its cache), at most `max_num_seqs`;
//! - **service time** `s`: the mean processing time with the queueing part taken out (Little's law:
//!   `latency x running / (running + waiting)`);
//! - **queueing delay** `d = waiting x s / K`: how long a request sent now waits before its first
//!   token.
//!
//! The ratio is `base x trim x delay factor`:
//! - `base` is what the LB needs to split traffic by capacity. Behind **least-connections** the LB
//!   keeps in-flight counts proportional to the ratios, so the ratio is `K` (a slower server holds each
//!   request longer and so gets fewer: least-connections already handles speed). Behind **weighted
//!   round robin** the LB splits arrivals by ratio, so the ratio is the throughput capacity `K / s`.
//!   This is the feed-forward: when an estimate drops on a queued server it is taken at once, so a
//!   server slowed to a third is at its new share as soon as its samples show it (rises are
//!   smoothed: a recovery is confirmed before it is trusted).
//! - `delay factor = (1 + d_min / tau) / (1 + d / tau)`: what users feel. A member whose queue makes
//!   requests wait `tau` longer than on the best member gets half its share; it is proportional, not
//!   integral, so a draining backlog gives the share back as it drains (no starving, no windup).
//! - `trim`: a slow integral on utilization `(running + waiting) / K` (capped at 1) that moves shares
//!   toward equal utilization. It corrects what the model cannot see, mainly traffic that reaches a
//!   server without passing this LB; bounded to `[1/trim_max, trim_max]`.
//!
//! Ratios are rescaled so the pool mean sits mid-range; a pool-wide deadband keeps the LB API calm.
//! Members without estimates yet get the pool's mean base. Pure: no clock, no I/O.

use std::collections::BTreeMap;

use llm_lc_adapters::MemberId;
use serde::Deserialize;

use super::Inputs;
use crate::source::{Sample, Snapshot};

/// Which LB algorithm the ratios feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// F5 `ratio-least-connections-member`, HAProxy `leastconn`, Envoy `LEAST_REQUEST`: ratio = `K`.
    #[default]
    LeastConnections,
    /// F5 `ratio-member`, HAProxy `roundrobin`, Envoy `ROUND_ROBIN`: ratio = `K / s`.
    RoundRobin,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapacityParams {
    /// What the ratios feed (see [`Mode`]).
    pub mode: Mode,
    /// Largest batch a server runs (vLLM `max_num_seqs`); a server that queues shows its own limit.
    pub max_num_seqs: f64,
    /// Weight of a new estimate when it rises (a drop on a queued server is taken at once).
    pub smoothing: f64,
    /// Queueing delay, in seconds, above the best member's that halves a member's share.
    pub delay_tau: f64,
    /// Exponent of the utilization correction per cycle (0 turns the trim off).
    pub gain: f64,
    /// Bound of the trim: it stays within `[1/trim_max, trim_max]`.
    pub trim_max: f64,
    /// Relative changes smaller than this on every member keep the previous ratios.
    pub deadband: f64,
    /// Running requests that count as a full server, for servers that publish no KV usage.
    pub running_norm: f64,
}

impl Default for CapacityParams {
    /// Chosen on seeds 1-3 of the benchmark's goals grid (src/bench/RESULTS.md).
    fn default() -> Self {
        CapacityParams {
            mode: Mode::LeastConnections,
            max_num_seqs: 256.0,
            smoothing: 0.3,
            delay_tau: 1.0,
            gain: 0.1,
            trim_max: 4.0,
            deadband: 0.05,
            running_norm: 64.0,
        }
    }
}

impl CapacityParams {
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut e = Vec::new();
        let mut check = |ok: bool, f: &str, m: &str| {
            if !ok {
                e.push((f.to_string(), m.to_string()));
            }
        };
        check(self.max_num_seqs >= 1.0 && self.max_num_seqs.is_finite(), "max_num_seqs", "must be >= 1");
        check(self.smoothing > 0.0 && self.smoothing <= 1.0, "smoothing", "must be in (0, 1]");
        check(self.delay_tau > 0.0 && self.delay_tau.is_finite(), "delay_tau", "must be > 0 (seconds)");
        check((0.0..=1.0).contains(&self.gain), "gain", "must be in [0, 1]");
        check(self.trim_max >= 1.0 && self.trim_max.is_finite(), "trim_max", "must be >= 1");
        check((0.0..1.0).contains(&self.deadband), "deadband", "must be in [0, 1)");
        check(self.running_norm > 0.0 && self.running_norm.is_finite(), "running_norm", "must be > 0");
        e
    }
}

/// Queue length that weighs as much as a full server in the pool's saturation figure.
pub const SATURATION_QUEUE_NORM: f64 = 256.0;
/// Fewer running requests than this say too little about a server's capacity.
const MIN_RUNNING: f64 = 4.0;
/// Below this memory use `running / usage` is mostly rounding.
const MIN_USAGE: f64 = 0.02;

/// What the policy remembers of one member.
#[derive(Debug, Clone, Copy, Default)]
struct Member {
    /// Capacity in concurrent requests.
    k: Option<f64>,
    /// Service time, seconds.
    s: Option<f64>,
    trim: f64,
    last: Option<u32>,
}

pub struct Capacity {
    pub params: CapacityParams,
    members: BTreeMap<MemberId, Member>,
}

impl Capacity {
    pub fn new(params: CapacityParams) -> Self {
        Capacity { params, members: BTreeMap::new() }
    }

    /// Drop the memory of members that left the pool.
    pub fn forget_except(&mut self, snap: &Snapshot) {
        self.members.retain(|m, _| snap.members.contains_key(m));
    }

    fn usage(&self, s: &Sample) -> f64 {
        s.kv_usage.unwrap_or(s.running / self.params.running_norm)
    }

    /// Update a member's estimates from one fresh sample.
    fn observe(&self, mut m: Member, s: &Sample) -> Member {
        let p = &self.params;
        let queued = s.waiting >= 1.0;
        // A drop seen while the server queues is real (it cannot serve more): take it at once.
        let blend = |old: Option<f64>, new: f64, drop_now: bool| match old {
            Some(_) if drop_now => new,
            Some(o) => o + p.smoothing * (new - o),
            None => new,
        };
        let usage = self.usage(s);
        let k_obs = if queued && s.running >= 1.0 {
            Some(s.running.min(p.max_num_seqs))
        } else if s.running >= MIN_RUNNING && usage >= MIN_USAGE {
            Some((s.running / usage).min(p.max_num_seqs))
        } else {
            None
        };
        if let Some(k) = k_obs {
            let drop_now = queued && m.k.is_some_and(|o| k < o);
            m.k = Some(blend(m.k, k, drop_now).max(1.0));
        }
        if let Some(l) = s.latency.filter(|l| *l > 0.0 && l.is_finite()) {
            let in_system = s.running + s.waiting;
            let service = if in_system > 0.0 { l * s.running.max(1.0).min(in_system) / in_system } else { l };
            // A longer service time is a capacity drop: at once when the server queues.
            let drop_now = queued && m.s.is_some_and(|o| service > o);
            m.s = Some(blend(m.s, service, drop_now));
        }
        m
    }

    pub fn compute(&mut self, input: &Inputs<'_>) -> BTreeMap<MemberId, u32> {
        if input.fresh.is_empty() {
            return BTreeMap::new();
        }
        let p = self.params.clone();
        let range = input.range;
        let target_mean = range.mid();
        let mut state: BTreeMap<MemberId, Member> = BTreeMap::new();
        for (m, s) in input.fresh {
            let old = self.members.get(*m).copied().unwrap_or(Member { trim: 1.0, ..Member::default() });
            state.insert((*m).clone(), self.observe(old, s));
        }
        let known_k: Vec<f64> = state.values().filter_map(|m| m.k).collect();
        let known_s: Vec<f64> = state.values().filter_map(|m| m.s).collect();
        let mean_k = mean(&known_k).unwrap_or(p.max_num_seqs);
        let mean_s = mean(&known_s);
        // Weighted round robin needs every member's service time; a partial picture would favour
        // whoever lacks one, so it falls back to capacity in requests for all.
        let use_s = p.mode == Mode::RoundRobin && known_s.len() == state.len();

        let mut base = BTreeMap::new();
        let mut delay = BTreeMap::new();
        let mut util = BTreeMap::new();
        for (id, m) in &state {
            let s = input.fresh.get(id).copied();
            let k = m.k.unwrap_or(mean_k).max(1.0);
            let service = m.s.or(mean_s).unwrap_or(1.0);
            base.insert(id.clone(), if use_s { k / service.max(1e-3) } else { k });
            let (waiting, running) = s.map_or((0.0, 0.0), |s| (s.waiting, s.running));
            delay.insert(id.clone(), waiting * service / k);
            util.insert(id.clone(), ((running + waiting) / k).min(1.0));
        }
        let d_min = delay.values().copied().fold(f64::INFINITY, f64::min);
        let mean_util = mean(&util.values().copied().collect::<Vec<_>>()).unwrap_or(0.0);

        let mut next: BTreeMap<MemberId, f64> = BTreeMap::new();
        for (id, m) in state.iter_mut() {
            let u = util[id];
            // Trim toward equal utilization; a floor keeps an idle member from an infinite factor.
            if p.gain > 0.0 && mean_util > 0.05 {
                let f = ((mean_util + 0.05) / (u + 0.05)).powf(p.gain);
                m.trim = (m.trim * f).clamp(1.0 / p.trim_max, p.trim_max);
            }
            let h = (1.0 + d_min / p.delay_tau) / (1.0 + delay[id] / p.delay_tau);
            next.insert(id.clone(), base[id] * m.trim * h);
        }
        // The trims are relative: keep their geometric mean at 1 so they cannot drift together.
        let log_mean = state.values().map(|m| m.trim.ln()).sum::<f64>() / state.len() as f64;
        for m in state.values_mut() {
            m.trim = (m.trim / log_mean.exp()).clamp(1.0 / p.trim_max, p.trim_max);
        }
        let mean_next = next.values().sum::<f64>() / next.len() as f64;
        if mean_next > 0.0 && mean_next.is_finite() {
            for v in next.values_mut() {
                *v = (*v * target_mean / mean_next).clamp(range.min as f64, range.max as f64);
            }
        } else {
            for v in next.values_mut() {
                *v = target_mean;
            }
        }
        // Pool-wide deadband: when nobody would move by `deadband`, nobody moves (nothing pushed).
        let quiet = next.iter().all(|(id, v)| match state[id].last {
            Some(prev) if prev > 0 => {
                ((range.clamp(*v) as f64 - prev as f64).abs() / prev as f64) < p.deadband
            }
            _ => false,
        });
        let mut out = BTreeMap::new();
        for (id, v) in next {
            let Some(m) = state.get_mut(&id) else { continue };
            let r = match m.last {
                Some(prev) if quiet => prev,
                _ => range.clamp(v),
            };
            m.last = Some(r);
            out.insert(id, r);
        }
        for (id, m) in state {
            self.members.insert(id, m);
        }
        out
    }
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}
