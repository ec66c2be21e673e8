//! Model canary: a route target can rewrite the body's `model` to one of several adapter versions in
//! fixed percentages (`model_split: {sql-v1: 90, sql-v2: 10}`).
//!
//! The choice uses the shared smooth weighted round robin ([`llm_lc_balance`]), so the percentages are
//! honoured exactly over every window of 100 requests (not just on average, as a random draw would),
//! and the versions interleave evenly instead of coming in bursts.

use std::sync::Mutex;

use llm_lc_balance::{Algorithm, Picker};

use super::route::Split;

/// One smooth-WRR state per split of the routing table.
pub struct Splitter {
    splits: Vec<(Vec<String>, Mutex<Picker>)>,
}

impl Splitter {
    pub fn new(splits: &[Split]) -> Splitter {
        let splits = splits
            .iter()
            .map(|s| {
                let names: Vec<String> = s.models.iter().map(|(m, _)| m.clone()).collect();
                let weights: Vec<u32> = s.models.iter().map(|(_, p)| *p).collect();
                let mut p = Picker::new(Algorithm::WeightedRoundRobin, names.len(), 0);
                p.set_weights(&weights);
                (names, Mutex::new(p))
            })
            .collect();
        Splitter { splits }
    }

    /// The model name for the next request through split `k`.
    pub fn choose(&self, k: usize) -> Option<String> {
        let (names, picker) = self.splits.get(k)?;
        let i = match picker.lock() {
            Ok(mut p) => p.pick(|_| true),
            Err(poisoned) => poisoned.into_inner().pick(|_| true),
        }?;
        names.get(i).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_are_exact_over_each_hundred() {
        let s = Splitter::new(&[Split {
            at: "x.match".into(),
            models: vec![("v1".into(), 90), ("v2".into(), 10)],
        }]);
        for _ in 0..3 {
            let picks: Vec<String> = (0..100).filter_map(|_| s.choose(0)).collect();
            assert_eq!(picks.iter().filter(|m| *m == "v2").count(), 10);
        }
        assert_eq!(s.choose(5), None);
    }
}
