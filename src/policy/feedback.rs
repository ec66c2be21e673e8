//! `feedback`: an integral controller. Each cycle multiplies every member's ratio by
//! `(mean load / its load) ^ gain`, so ratios keep moving until load is equal across the pool. Servers
//! of different speed end at capacity-proportional shares: a half-speed GPU that receives half the
//! traffic carries the same load as the others, and then nothing changes.
//!
//! Load is KV usage plus queue, multiplied by how slow the member is compared with the pool
//! (`(mean processing time / pool mean) ^ latency_weight`) when every member reports a processing
//! time. Behind a least-connections balancer every server holds about as many requests, so KV usage
//! and queue look alike on a fast and a slow GPU; only the time each request takes tells them apart.
//!
//! What keeps it calm: loads are smoothed (EWMA), each cycle's change is limited (`max_step`), a
//! member whose load is already moving toward the mean fast enough to get there within
//! `settle_cycles`, or whose queue is shrinking, is left alone (the last corrections are still taking
//! effect: a backlog drains at the server's own pace, and integrating on regardless would cut the
//! ratio far below the server's capacity), ratios
//! are rescaled so the pool mean sits at the middle of the range (nothing winds up against a bound),
//! and when no member would change by `deadband` (relative) or more, nothing changes at all. When the whole pool is idle
//! there is nothing to learn from, and every member gets the same ratio.

use llm_lc_adapters::MemberMap;
use serde::Deserialize;

use super::{load, Inputs};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FeedbackParams {
    /// Exponent of the correction per cycle: 0 never moves, 1 corrects the whole imbalance at once.
    pub gain: f64,
    /// Weight of the newest load observation in the EWMA (1 = no smoothing).
    pub smoothing: f64,
    /// Largest relative change of a ratio in one cycle (0.25 = at most 25% up or ~20% down).
    pub max_step: f64,
    /// Relative changes smaller than this keep the previous ratio (nothing is pushed).
    pub deadband: f64,
    /// Waiting requests that weigh as much as a full KV cache.
    pub queue_norm: f64,
    /// Running requests that count as a full batch, for servers that publish no KV usage.
    pub running_norm: f64,
    /// Below this load on every member the pool counts as idle: all ratios equal.
    pub idle_load: f64,
    /// Hold a member's ratio while its load approaches the mean fast enough to reach it within this
    /// many cycles (0 turns the damping off).
    pub settle_cycles: f64,
    /// Exponent of the relative processing time in the load (0 ignores processing time).
    pub latency_weight: f64,
}

impl Default for FeedbackParams {
    /// Chosen by the benchmark's 21-point grid (src/bench/RESULTS.md, "Choosing the policy"): a slow
    /// integral (gain 0.05) on unsmoothed samples, queue weighed lightly (256). Behind weighted
    /// least-request that kept p99 TTFT within 1.25x of the per-request picker at all 21 points
    /// (geometric mean 0.62x of it); the previous, faster settings oscillated. Processing time is
    /// off by default: it helps ratio-least-connections a little at moderate load but triples p99 at
    /// 95% on mixed-speed fleets and wrecks plain weighted round robin.
    fn default() -> Self {
        FeedbackParams {
            gain: 0.05,
            smoothing: 1.0,
            max_step: 0.25,
            deadband: 0.05,
            queue_norm: 256.0,
            running_norm: 64.0,
            idle_load: 0.02,
            settle_cycles: 3.0,
            latency_weight: 0.0,
        }
    }
}

impl FeedbackParams {
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut e = Vec::new();
        let mut check = |ok: bool, f: &str, m: &str| {
            if !ok {
                e.push((f.to_string(), m.to_string()));
            }
        };
        check(self.gain > 0.0 && self.gain <= 2.0, "gain", "must be in (0, 2]");
        check(self.smoothing > 0.0 && self.smoothing <= 1.0, "smoothing", "must be in (0, 1]");
        check(self.max_step > 0.0 && self.max_step.is_finite(), "max_step", "must be > 0");
        check((0.0..1.0).contains(&self.deadband), "deadband", "must be in [0, 1)");
        check(self.queue_norm > 0.0 && self.queue_norm.is_finite(), "queue_norm", "must be > 0");
        check(self.running_norm > 0.0 && self.running_norm.is_finite(), "running_norm", "must be > 0");
        check(self.idle_load >= 0.0 && self.idle_load.is_finite(), "idle_load", "must be >= 0");
        check(self.settle_cycles >= 0.0 && self.settle_cycles.is_finite(), "settle_cycles", "must be >= 0");
        check((0.0..=4.0).contains(&self.latency_weight), "latency_weight", "must be in [0, 4]");
        e
    }
}

pub struct Feedback {
    pub params: FeedbackParams,
    /// What the policy remembers per member, one entry each so a cycle costs one lookup per member
    /// and phase, not one per remembered quantity.
    /// Per-member memory, kept in line with the snapshot's members (index = position).
    state: MemberMap<Memory>,
}

/// One member's memory across cycles.
#[derive(Debug, Clone, Copy, Default)]
struct Memory {
    /// Unrounded ratio, so small corrections accumulate instead of vanishing in rounding/deadband.
    level: Option<f64>,
    /// Smoothed load.
    smoothed: Option<f64>,
    /// What this policy last output (for the deadband).
    last: Option<u32>,
    /// The queue at the last cycle, to tell a draining backlog from a growing one.
    waiting: Option<f64>,
    /// Smoothed mean processing time; kept across cycles in which no request finished.
    latency: Option<f64>,
}

/// Per fresh member, this cycle's working values, in the order of `Inputs::fresh`.
struct Row {
    load: f64,
    /// How much the smoothed load moved since the last cycle (0 for newcomers).
    trend: f64,
    draining: bool,
    start: f64,
    last: Option<u32>,
}

impl Feedback {
    pub fn new(params: FeedbackParams) -> Self {
        Feedback { params, state: MemberMap::default() }
    }

    /// The memory of the member at dense index `i` (its position in the snapshot).
    fn memory(&mut self, i: usize) -> &mut Memory {
        self.state.at_mut(i).expect("policy memory is synced to the snapshot's members")
    }

    /// Per fresh member (in `Inputs::fresh` order), how much slower than the pool it processes
    /// requests, when every fresh member has a processing time (a partial picture would favour
    /// whoever happens to lack one). Empty when processing time is not used.
    fn slowness(&mut self, input: &Inputs<'_>) -> Vec<f64> {
        let (smoothing, weight) = (self.params.smoothing, self.params.latency_weight);
        let mut known = Vec::with_capacity(input.fresh.len());
        for f in input.fresh {
            let (mem, s) = (self.memory(f.index), f.sample);
            if let Some(l) = s.latency.filter(|l| *l > 0.0) {
                mem.latency = Some(match mem.latency {
                    Some(old) => smoothing * l + (1.0 - smoothing) * old,
                    None => l,
                });
            }
            if let Some(l) = mem.latency {
                known.push(l);
            }
        }
        if weight == 0.0 || known.len() != input.fresh.len() {
            return Vec::new();
        }
        let mean = known.iter().sum::<f64>() / known.len() as f64;
        known.into_iter().map(|l| (l / mean).powf(weight)).collect()
    }

    pub fn compute(&mut self, input: &Inputs<'_>) -> Vec<u32> {
        // Memory follows the pool: members that left are forgotten, new ones start fresh.
        self.state.sync_to(input.snapshot.members.keys(), Memory::default);
        if input.fresh.is_empty() {
            return Vec::new();
        }
        let range = input.range;
        let target_mean = range.mid();
        let slowness = self.slowness(input);
        let p = self.params.clone();
        let mut rows: Vec<Row> = Vec::with_capacity(input.fresh.len());
        for (i, f) in input.fresh.iter().enumerate() {
            let (s, from_start) = (f.sample, f.start);
            let mem = self.memory(f.index);
            let before = mem.waiting.replace(s.waiting);
            let l = load(s, p.queue_norm, p.running_norm) * slowness.get(i).copied().unwrap_or(1.0);
            let (smoothed, moved) = match mem.smoothed {
                Some(old) => {
                    let new = p.smoothing * l + (1.0 - p.smoothing) * old;
                    (new, new - old)
                }
                None => (l, 0.0),
            };
            mem.smoothed = Some(smoothed);
            rows.push(Row {
                load: smoothed,
                trend: moved,
                draining: before.is_some_and(|w| s.waiting < w),
                start: mem.level.unwrap_or(from_start),
                last: mem.last,
            });
        }

        let idle = rows.iter().all(|r| r.load < p.idle_load);
        let next: Vec<f64> = if idle {
            vec![target_mean; rows.len()]
        } else {
            let mean_load = rows.iter().map(|r| r.load).sum::<f64>() / rows.len() as f64;
            // A small floor keeps an idle member in a busy pool from producing an infinite factor.
            let eps = p.idle_load.max(1e-3);
            let (lo, hi) = (1.0 / (1.0 + p.max_step), 1.0 + p.max_step);
            let mut next: Vec<f64> = rows
                .iter()
                .map(|r| {
                    let gap = r.load - mean_load;
                    let converging = gap * r.trend < 0.0 && r.trend.abs() * p.settle_cycles >= gap.abs();
                    let draining_backlog = gap > 0.0 && r.draining;
                    let settling = p.settle_cycles > 0.0 && (converging || draining_backlog);
                    let factor = if settling {
                        1.0
                    } else {
                        ((mean_load + eps) / (r.load + eps)).powf(p.gain).clamp(lo, hi)
                    };
                    r.start * factor
                })
                .collect();
            // Rescale so the pool mean sits mid-range: shares are relative, and a fixed mean keeps
            // every member away from the bounds (no windup) and the numbers stable between cycles.
            let mean_next = next.iter().sum::<f64>() / next.len() as f64;
            if mean_next > 0.0 {
                for v in &mut next {
                    *v = (*v * target_mean / mean_next).clamp(range.min as f64, range.max as f64);
                }
            }
            next
        };

        // The deadband is pool-wide: when no member would move by `deadband` or more, nobody moves
        // (nothing is pushed); otherwise everyone takes the new value. Deciding per member would let
        // rounding and hysteresis swap the order of two members whose loads are in the other order.
        // An idle pool must come out exactly equal, so the deadband does not apply there.
        let quiet = !idle
            && rows.iter().zip(&next).all(|(r, v)| match r.last {
                Some(prev) if prev > 0 => {
                    ((range.clamp(*v) as f64 - prev as f64).abs() / prev as f64) < p.deadband
                }
                _ => false,
            });
        let mut out = Vec::with_capacity(rows.len());
        for (f, (row, v)) in input.fresh.iter().zip(rows.iter().zip(next)) {
            let r = match row.last {
                Some(prev) if quiet => prev,
                _ => range.clamp(v),
            };
            let mem = self.memory(f.index);
            mem.level = Some(v);
            mem.last = Some(r);
            out.push(r);
        }
        out
    }
}
