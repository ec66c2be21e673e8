//! `capacity`: ratios from each server's estimated capacity, corrected by what users feel (the
//! queueing delay) and by what the LB cannot see (traffic that reaches a server some other way).
//!
//! **Why capacity and not equal KV usage** (the `feedback` policy): KV usage is not what users
//! feel, and it does not compare across servers whose memory and speed differ differently. A
//! tensor-parallel-2 replica has 2.35x the KV cache but only ~1.7x the speed: at equal KV usage it
//! gets 2.35x the requests and queues. And an integrator needs many cycles to move a share by 3x,
//! where an estimate moves it in one.
//!
//! **What it does, each cycle, per member with a fresh sample** (one module per step):
//! 1. [`estimate`]: read the sample into what is remembered of the member: capacity `K` in
//!    concurrent requests (what binds: memory, slots or the batch limit) and service time `s`
//!    (a time without queueing), smoothed, except a slowdown on a queued server, believed at once.
//! 2. [`base`]: the base ratio for the LB's algorithm. Behind least-connections `K` (the LB keeps
//!    in-flight counts proportional to the ratios and handles speed itself); behind weighted
//!    round robin `K / s` (the LB splits arrivals). Also the queueing delay `d = waiting x s / K`
//!    and utilization `(running + waiting) / K`.
//! 3. [`corrections`]: `ratio = base x trim x delay factor`. The delay factor (round robin
//!    only) halves the share of a member whose queue makes requests wait `delay_tau` longer
//!    than on the best one; the trim slowly evens out utilization, for load the model cannot see.
//! 4. [`queue_rule`]: on a member's first reading, one that queues beside a member with room is
//!    cut below what a member with room of its size gets, so a dry run or `run --once` already
//!    ranks a queued server last; the cut lasts while the readings confirm it.
//! 5. [`settle`]: rescale so the pool mean sits mid-range, clamp to the range, and keep the
//!    previous ratios when no member would move by `deadband`.
//!
//! Members without estimates yet get the pool's mean capacity. Pure: no clock, no I/O; time
//! enters as sample ages and the cycle interval. Why each special case is there is said where it
//! is, and each is pinned by a test in `tests.rs`; how the numbers were chosen, and the variants
//! that lost, are in src/bench/RESULTS.md ("The `capacity` policy and how its defaults were
//! chosen").

mod base;
mod corrections;
mod estimate;
mod params;
mod queue_rule;
mod settle;
#[cfg(test)]
mod tests;

use llm_lc_adapters::MemberMap;

use self::base::Base;
use self::estimate::{Estimator, Member};
pub use self::params::{CapacityParams, Mode};
use super::Inputs;
use crate::source::Sample;

/// Queue length that weighs as much as a full server in the pool's saturation figure.
pub const SATURATION_QUEUE_NORM: f64 = 256.0;

pub struct Capacity {
    pub params: CapacityParams,
    /// The controller's cycle interval: how much older a reading seen again has become.
    interval: std::time::Duration,
    /// Per-member memory, kept in line with the snapshot's members (index = position).
    members: MemberMap<Member>,
}

impl Capacity {
    pub fn new(params: CapacityParams, interval: std::time::Duration) -> Self {
        Capacity { params, interval, members: MemberMap::default() }
    }

    pub fn compute(&mut self, input: &Inputs<'_>) -> Vec<u32> {
        // Memory follows the pool: members that left are forgotten, new ones start fresh.
        self.members.sync_to(input.snapshot.members.keys(), Member::new);
        if input.fresh.is_empty() {
            return Vec::new();
        }
        let p = &self.params;
        let range = input.range;
        // Working values are vectors in the order of the fresh members; memory is read by dense index.
        let samples: Vec<&Sample> = input.fresh.iter().map(|f| f.sample).collect();
        let estimator = Estimator { params: p, interval: self.interval };
        let mut state: Vec<Member> = input
            .fresh
            .iter()
            .map(|f| {
                let old = self.members.at(f.index).map_or_else(Member::new, |(_, m)| *m);
                estimator.observe(old, f.sample)
            })
            .collect();

        let base = Base::new(p.mode, p.max_num_seqs, &state, &samples);
        let d_min = base.delay.iter().copied().fold(f64::INFINITY, f64::min);
        let mean_util = base::mean(&base.util).unwrap_or(0.0);
        let mut next: Vec<f64> = Vec::with_capacity(state.len());
        for (i, m) in state.iter_mut().enumerate() {
            corrections::step_trim(p, m, base.util[i], mean_util);
            next.push(base.ratio[i] * m.trim * corrections::delay_factor(p, d_min, base.delay[i]));
        }
        queue_rule::apply(&mut next, &base.ratio, &mut state, &samples, &base.k, p.trim_max);
        corrections::recentre_trims(&mut state, p.trim_max);
        settle::rescale(&mut next, range);
        let quiet = settle::quiet(&next, &state, range, p.deadband);

        let mut out = Vec::with_capacity(state.len());
        for ((f, v), mut m) in input.fresh.iter().zip(next).zip(state) {
            let r = match m.last {
                Some(prev) if quiet => prev,
                _ => range.clamp(v),
            };
            m.last = Some(r);
            out.push(r);
            // Why this ratio, for an operator asking (RUST_LOG=llm_load_controller::policy=debug).
            tracing::debug!(
                member = %f.id,
                capacity = m.k,
                service_s = m.s,
                trim = m.trim,
                ratio = r,
                "capacity estimate"
            );
            if let Some(slot) = self.members.at_mut(f.index) {
                *slot = m;
            }
        }
        out
    }
}
