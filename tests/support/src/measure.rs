//! Small arithmetic the engine measurements share: medians of noisy readings and relative
//! differences.

/// The middle element of `v` by `key` (the upper one of an even count). Panics on an empty `v`.
pub fn median_by<T>(mut v: Vec<T>, key: impl Fn(&T) -> f64) -> T {
    v.sort_by(|a, b| key(a).total_cmp(&key(b)));
    v.swap_remove(v.len() / 2)
}

/// Relative difference of `sim` from `real`.
pub fn off(sim: f64, real: f64) -> f64 {
    (sim - real).abs() / real.abs().max(1e-9)
}
