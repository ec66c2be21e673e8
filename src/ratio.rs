//! The range of a pool's integer ratios: what every policy clamps to and the sinks map to weights.
//! A leaf: it imports nothing of this crate, so the policy, the cycle and the config file can all
//! use it without importing each other.

use serde::Deserialize;

/// Range of the integer ratios this pool's policy produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RatioRange {
    pub min: u32,
    pub max: u32,
}

impl Default for RatioRange {
    fn default() -> Self {
        RatioRange { min: 1, max: 100 }
    }
}

impl RatioRange {
    pub fn clamp(&self, v: f64) -> u32 {
        if v.is_nan() {
            return self.min;
        }
        (v.round() as i64).clamp(self.min as i64, self.max as i64) as u32
    }

    pub fn mid(&self) -> f64 {
        (self.min as f64 + self.max as f64) / 2.0
    }

    /// Problems as `(field, message)`, the field relative to the range (`min`, `max`).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if self.max == 0 {
            out.push(("max".into(), "must be > 0".into()));
        }
        if self.max > llm_lc_adapters::MAX_RATIO {
            out.push((
                "max".into(),
                format!(
                    "must be <= {} (BIG-IP's largest ratio; no load balancer tells more apart)",
                    llm_lc_adapters::MAX_RATIO
                ),
            ));
        }
        if self.min > self.max {
            out.push(("min".into(), "must be <= ratio.max".into()));
        }
        if self.min == 0 {
            out.push((
                "min".into(),
                "must be >= 1 (a ratio of 0 drains a member; drain is a sink option)".into(),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_range_is_bounded_on_both_sides() {
        assert!(RatioRange::default().validate().is_empty());
        let top = RatioRange { min: 1, max: llm_lc_adapters::MAX_RATIO };
        assert!(top.validate().is_empty());
        let huge = RatioRange { min: 1, max: 100_000_000 };
        let problems = huge.validate();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].0, "max");
        assert!(problems[0].1.contains("65535"), "{problems:?}");
    }
}
