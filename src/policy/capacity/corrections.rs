//! The corrections applied to the base ratio: the delay factor (what users feel) and the trim
//! (what the model cannot see).
//!
//! - **Delay factor**, weighted round robin only: `(1 + d_min / tau) / (1 + d / tau)`. A member
//!   whose queue makes requests wait `tau` longer than on the best member gets half its share.
//!   Proportional, not integral: a draining backlog gets its share back as it drains (no starving,
//!   no windup). Least-connections counts queued requests itself, so it gets none.
//! - **Trim**: a slow integral of utilization toward the pool mean, outside a band (`trim_band`;
//!   noise inside it would make a random walk), bounded to `[1/trim_max, trim_max]`. It corrects
//!   mainly traffic that reaches a server without passing this LB. Each reading moves it once,
//!   weighted by the time it covers (`gain` is per 15 s), so its speed is the same whatever the
//!   source's sample rate. Trims are relative: their geometric mean is kept at 1.

use super::estimate::Member;
use super::params::{CapacityParams, Mode};

/// Below this pool-mean utilization the pool is idle and utilization differences are noise; it
/// is also the floor that keeps an idle member from an infinite factor.
const IDLE_UTIL: f64 = 0.05;

/// The delay factor of a member whose queueing delay is `d`, the best member's being `d_min`.
pub(super) fn delay_factor(p: &CapacityParams, d_min: f64, d: f64) -> f64 {
    if p.mode == Mode::RoundRobin {
        (1.0 + d_min / p.delay_tau) / (1.0 + d / p.delay_tau)
    } else {
        1.0
    }
}

/// Move a member's trim by one step toward equal utilization: `u` its utilization, `mean_util`
/// the pool's. Nothing moves in an idle pool or inside the band, and a reading seen before has
/// weight 0 (see [`super::estimate`]).
pub(super) fn step_trim(p: &CapacityParams, m: &mut Member, u: f64, mean_util: f64) {
    if mean_util > IDLE_UTIL && (u - mean_util).abs() > p.trim_band {
        let f = ((mean_util + IDLE_UTIL) / (u + IDLE_UTIL)).powf(p.gain * m.trim_weight);
        m.trim = (m.trim * f).clamp(1.0 / p.trim_max, p.trim_max);
    }
}

/// Keep the trims' geometric mean at 1, so they cannot drift together.
pub(super) fn recentre_trims(state: &mut [Member], trim_max: f64) {
    let log_mean = state.iter().map(|m| m.trim.ln()).sum::<f64>() / state.len() as f64;
    for m in state {
        m.trim = (m.trim / log_mean.exp()).clamp(1.0 / trim_max, trim_max);
    }
}
