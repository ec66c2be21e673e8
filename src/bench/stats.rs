//! Summaries of a run: exact percentiles of per-request latencies, a log-bucket histogram for the
//! per-token gaps (too many to keep), and time averages of spreads across replicas.

/// Nearest-rank percentile of a sorted slice (`p` in 0..=1, [`llm_lc_common::percentile`]); `NaN`
/// when empty.
pub fn percentile(sorted: &[f32], p: f64) -> f64 {
    llm_lc_common::percentile(sorted, p).map_or(f64::NAN, f64::from)
}

/// Sort latencies for [`percentile`]; values are finite by construction.
pub fn sort(v: &mut [f32]) {
    v.sort_unstable_by(|a, b| a.total_cmp(b));
}

/// Histogram with logarithmic buckets from 10 us to 10,000 s, 200 per decade (1.2% wide), for
/// quantiles of many small durations without storing them.
#[derive(Debug, Clone)]
pub struct LogHistogram {
    counts: Vec<u64>,
    total: u64,
}

const LOG_MIN: f64 = -5.0;
const DECADES: usize = 9;
const PER_DECADE: f64 = 200.0;

impl Default for LogHistogram {
    fn default() -> Self {
        LogHistogram { counts: vec![0; DECADES * PER_DECADE as usize + 2], total: 0 }
    }
}

impl LogHistogram {
    pub fn add(&mut self, v: f64) {
        let i = if v <= 0.0 || !v.is_finite() {
            0
        } else {
            let x = (v.log10() - LOG_MIN) * PER_DECADE;
            (x.max(-1.0) as isize + 1).clamp(0, self.counts.len() as isize - 1) as usize
        };
        self.counts[i] += 1;
        self.total += 1;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    /// Upper edge of the bucket holding the `p` quantile; `NaN` when empty.
    pub fn quantile(&self, p: f64) -> f64 {
        if self.total == 0 {
            return f64::NAN;
        }
        let rank = ((p * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                // Bucket i (i >= 1) covers [10^(LOG_MIN + (i-1)/PER_DECADE), 10^(LOG_MIN + i/PER_DECADE)).
                return 10f64.powf(LOG_MIN + i as f64 / PER_DECADE);
            }
        }
        f64::NAN
    }
}

/// Running time average of `max - min` over replicas, sampled at fixed ticks.
#[derive(Debug, Clone, Default)]
pub struct Spread {
    sum: f64,
    n: u64,
}

impl Spread {
    pub fn add<I: IntoIterator<Item = f64>>(&mut self, values: I) {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if hi >= lo {
            self.sum += hi - lo;
            self.n += 1;
        }
    }

    pub fn mean(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.sum / self.n as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f32> = (1..=100).map(|x| x as f32).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn log_histogram_quantiles_within_a_bucket() {
        let mut h = LogHistogram::default();
        for i in 1..=10_000 {
            h.add(i as f64 * 1e-3); // 1 ms .. 10 s
        }
        let p50 = h.quantile(0.5);
        let p99 = h.quantile(0.99);
        assert!((p50 / 5.0 - 1.0).abs() < 0.013, "{p50}");
        assert!((p99 / 9.9 - 1.0).abs() < 0.013, "{p99}");
        h.add(0.0);
        h.add(1e9);
        assert_eq!(h.count(), 10_002);
    }

    #[test]
    fn spread_is_mean_of_max_minus_min() {
        let mut s = Spread::default();
        s.add([0.1, 0.5, 0.3]);
        s.add([0.2, 0.2]);
        assert!((s.mean() - 0.2).abs() < 1e-12);
    }
}
