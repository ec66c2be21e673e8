//! Ratio -> HAProxy weight, and back.
//!
//! HAProxy weights are integers 0..=256, where 0 stops new balanced traffic to the server. Ratios
//! arrive in the user's ratio range. Two mappings, chosen by config:
//! - no `ratio_max` (default): weight = ratio, clamped to `max_weight` (256). Fits ratio ranges that
//!   already lie inside 1..=256; a clamp is reported as a warning because it flattens the split.
//! - `ratio_max: M`: weight = round(ratio × max_weight / M), proportional, so shares between servers
//!   are kept (an affine map of lo..hi onto 1..256 would distort them).
//!
//! In both, a positive ratio never becomes 0 (rounding must not drain a server), and ratio 0 becomes
//! weight 0 only when `allow_drain` is set, otherwise weight 1.

/// HAProxy's largest server weight.
pub const HAPROXY_MAX_WEIGHT: u32 = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightMap {
    /// Ratio that maps to `max_weight`; `None` means ratios are weights.
    pub ratio_max: Option<u32>,
    /// Largest weight pushed, 1..=256.
    pub max_weight: u32,
    /// Whether ratio 0 may become weight 0.
    pub allow_drain: bool,
}

/// One mapped weight, and whether it had to be clamped to fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    pub weight: u32,
    pub clamped: bool,
}

impl WeightMap {
    pub fn weight(&self, ratio: u32) -> Mapped {
        if ratio == 0 {
            return Mapped { weight: if self.allow_drain { 0 } else { 1 }, clamped: false };
        }
        let scaled = match self.ratio_max {
            // Integer round-half-up in u64: ratio and max_weight are both u32, no overflow.
            Some(m) if m > 0 => {
                let m = u64::from(m);
                (u64::from(ratio) * u64::from(self.max_weight) * 2 + m) / (2 * m)
            }
            _ => u64::from(ratio),
        };
        let max = u64::from(self.max_weight.clamp(1, HAPROXY_MAX_WEIGHT));
        Mapped { weight: scaled.clamp(1, max) as u32, clamped: scaled > max }
    }

    /// The ratio a weight stands for (inverse of [`WeightMap::weight`], rounded), for `current()`.
    pub fn ratio(&self, weight: u32) -> u32 {
        match self.ratio_max {
            Some(m) if self.max_weight > 0 => {
                let w = u64::from(self.max_weight);
                ((u64::from(weight) * u64::from(m) * 2 + w) / (2 * w)).min(u64::from(u32::MAX)) as u32
            }
            _ => weight,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIRECT: WeightMap = WeightMap { ratio_max: None, max_weight: 256, allow_drain: false };

    #[test]
    fn direct_mapping_clamps_and_says_so() {
        assert_eq!(DIRECT.weight(7), Mapped { weight: 7, clamped: false });
        assert_eq!(DIRECT.weight(256), Mapped { weight: 256, clamped: false });
        assert_eq!(DIRECT.weight(1000), Mapped { weight: 256, clamped: true });
    }

    #[test]
    fn zero_drains_only_when_allowed() {
        assert_eq!(DIRECT.weight(0).weight, 1);
        assert_eq!(WeightMap { allow_drain: true, ..DIRECT }.weight(0).weight, 0);
    }

    #[test]
    fn scaling_keeps_proportions_and_never_rounds_to_zero() {
        let m = WeightMap { ratio_max: Some(1000), ..DIRECT };
        assert_eq!(m.weight(1000).weight, 256);
        assert_eq!(m.weight(500).weight, 128);
        assert_eq!(m.weight(250).weight, 64);
        assert_eq!(m.weight(1).weight, 1); // 0.256 rounds to 0, raised to 1
        assert_eq!(m.weight(2000), Mapped { weight: 256, clamped: true });
        assert_eq!(m.ratio(128), 500);
        assert_eq!(m.ratio(256), 1000);
    }

    #[test]
    fn smaller_max_weight() {
        let m = WeightMap { ratio_max: Some(100), max_weight: 100, allow_drain: false };
        for r in 1..=100 {
            assert_eq!(m.weight(r).weight, r);
            assert_eq!(m.ratio(r), r);
        }
    }
}
