//! From corrected ratios to the integers pushed: rescaled so the pool mean sits mid-range, and a
//! pool-wide deadband that keeps the LB's API calm.

use super::estimate::Member;
use crate::ratio::RatioRange;

/// Scale `next` so its mean is the middle of `range`, clamped to it; all mid-range when the
/// ratios have no usable mean (all zero).
pub(super) fn rescale(next: &mut [f64], range: RatioRange) {
    let target_mean = range.mid();
    let mean_next = next.iter().sum::<f64>() / next.len() as f64;
    if mean_next > 0.0 && mean_next.is_finite() {
        for v in next {
            *v = (*v * target_mean / mean_next).clamp(range.min as f64, range.max as f64);
        }
    } else {
        next.fill(target_mean);
    }
}

/// Whether no member would move by `deadband` or more from the ratio it was given last: then
/// nobody moves (nothing is pushed). A member without a previous ratio always moves, and so does
/// one whose previous ratio was 0 (a move from 0 is infinitely large).
pub(super) fn quiet(next: &[f64], state: &[Member], range: RatioRange, deadband: f64) -> bool {
    next.iter().zip(state).all(|(v, m)| match m.last {
        Some(prev) => ((range.clamp(*v) as f64 - prev as f64).abs() / prev as f64) < deadband,
        _ => false,
    })
}
