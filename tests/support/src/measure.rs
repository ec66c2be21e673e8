//! What the engine measurements share: medians of noisy readings, relative differences, and the
//! simulator-against-real-engine comparison ([`Agreement`]).

use crate::load::LoadStats;

/// The middle element of `v` by `key` (the upper one of an even count). Panics on an empty `v`.
pub fn median_by<T>(mut v: Vec<T>, key: impl Fn(&T) -> f64) -> T {
    v.sort_by(|a, b| key(a).total_cmp(&key(b)));
    v.swap_remove(v.len() / 2)
}

/// Relative difference of `sim` from `real`.
pub fn off(sim: f64, real: f64) -> f64 {
    (sim - real).abs() / real.abs().max(1e-9)
}

/// The simulator against a real engine, case by case: each case runs the same load on the real
/// server (A), on the simulated one, then on the real one again (B). What is compared is TTFT p50,
/// p90, p99 and the mean queue, the simulator against the mean of A and B; A against that mean
/// says how far the real engine is from itself.
#[derive(Debug, Default)]
pub struct Agreement {
    /// The simulator's largest relative difference so far.
    pub worst: f64,
    /// Real A's largest relative difference from the real mean so far.
    pub worst_self: f64,
}

impl Agreement {
    /// The header of the table [`Agreement::add`] prints rows of; `case` names the case columns
    /// (`"a | b"` for two).
    pub fn header(case: &str) {
        println!("| {case} | engine | TTFT p50 | p90 | p99 | mean queue | requests |");
        println!("{}|", "|---".repeat(case.split('|').count() + 6));
    }

    /// One case's three runs: prints their rows (`case` fills the case columns) and takes in
    /// their differences. Queues near zero differ by a few readings, so they are compared on the
    /// scale of one request.
    pub fn add(&mut self, case: &str, a: &LoadStats, sim: &LoadStats, b: &LoadStats) {
        for (name, x) in [("real A", a), ("sim", sim), ("real B", b)] {
            let ms = |q: f64| x.ttft_quantile(q).as_secs_f64() * 1e3;
            println!(
                "| {case} | {name} | {:.0} ms | {:.0} ms | {:.0} ms | {:.2} | {} |",
                ms(0.5),
                ms(0.9),
                ms(0.99),
                x.mean_deferred(),
                x.completed
            );
        }
        for q in [0.5, 0.9, 0.99] {
            let t = |x: &LoadStats| x.ttft_quantile(q).as_secs_f64();
            let real = (t(a) + t(b)) / 2.0;
            self.worst = self.worst.max(off(t(sim), real));
            self.worst_self = self.worst_self.max(off(t(a), real));
        }
        let real_q = (a.mean_deferred() + b.mean_deferred()) / 2.0;
        let queue_off = |x: &LoadStats| (x.mean_deferred() - real_q).abs() / real_q.max(1.0);
        self.worst = self.worst.max(queue_off(sim));
        self.worst_self = self.worst_self.max(queue_off(a));
    }

    /// Print the two worst differences and fail if the simulator is more than `bound` off.
    pub fn check(&self, bound: f64) {
        println!("real A and B from their mean: {:.0}% at worst", self.worst_self * 100.0);
        println!("the simulator from the real mean: {:.0}% at worst", self.worst * 100.0);
        assert!(self.worst <= bound, "the simulator is {:.0}% off the real engine", self.worst * 100.0);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn run(ttft_ms: &[u64], queue: f64) -> LoadStats {
        LoadStats {
            ttft: ttft_ms.iter().map(|&t| Duration::from_millis(t)).collect(),
            completed: ttft_ms.len(),
            deferred: vec![queue],
            ..LoadStats::default()
        }
    }

    #[test]
    fn the_simulator_is_compared_with_the_mean_of_the_two_real_runs() {
        let mut g = Agreement::default();
        // Real runs at 100 and 140 ms (mean 120), the simulator at 150: 25% off; A 17% off.
        g.add("x", &run(&[100], 0.0), &run(&[150], 0.0), &run(&[140], 0.0));
        assert!((g.worst - 0.25).abs() < 1e-9 && (g.worst_self - 20.0 / 120.0).abs() < 1e-9, "{g:?}");
        // Queues: 4 against a real mean of 2 is 100% off; under one request they are compared
        // on the scale of one.
        g.add("y", &run(&[120], 2.0), &run(&[120], 4.0), &run(&[120], 2.0));
        assert!((g.worst - 1.0).abs() < 1e-9, "{g:?}");
        let mut small = Agreement::default();
        small.add("z", &run(&[120], 0.1), &run(&[120], 0.3), &run(&[120], 0.1));
        assert!((small.worst - 0.2).abs() < 1e-9, "{small:?}");
    }
}
