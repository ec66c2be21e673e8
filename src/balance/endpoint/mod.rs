//! Endpoint pickers: a per-request choice from what the model servers report of themselves (their
//! queue and KV usage, refreshed by scrape), the picker's own accounting of what it dispatched,
//! and an approximate index of the prompt blocks it sent each server ([`prefix`]).
//!
//! Here are the anchors the benchmark measures our ratios against, modelled on the Gateway API
//! Inference Extension's endpoint picker and llm-d's scheduler ([`Anchor`], and llm-d's newer
//! [`Sticky`] default with the dispatch [`Accounting`] it needs); the reference proxy and the load
//! balancers' doors can offer the same code. Pure and deterministic like the rest of
//! the crate: members are indexes, ties are broken by the caller's seeded generator.

pub mod accounting;
pub mod page;
pub mod picker;
pub mod prefix;
pub mod prompt;
pub mod sticky;

pub use accounting::Accounting;
pub use picker::RequestPicker;
pub use prefix::PrefixIndex;
pub use sticky::{Prompt, Sticky, Warmth};

/// What an endpoint picker knows of one member's own gauges, as of its last refresh.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Gauges {
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f64,
}

/// A per-request picker the field uses, as a set of weighted scorers; the highest total wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anchor {
    /// The Inference Extension's load-only default: queue scorer (waiting, min-max normalised
    /// across the candidates, 1 when all are equal) and KV-cache scorer (1 - usage), weight 2 each.
    Epp,
    /// `Epp` plus llm-d's active-request scorer, weight 2: the picker's own in-flight count `c`
    /// against the most any member has, `(max - c) / max`, 1 for a member with none (llm-d's
    /// normalisation: in flight {2, 3} scores {0.33, 0}, where min-max would say {1, 0}).
    EppActive,
    /// `Epp` plus llm-d's approximate prefix-cache scorer (the share of the prompt's leading blocks
    /// the member's [`PrefixIndex`] holds), weight 3.
    EppPrefix,
}

/// Weights of the queue and KV-cache scorers in the Inference Extension's default profile.
const QUEUE_WEIGHT: f64 = 2.0;
const KV_WEIGHT: f64 = 2.0;
/// Weight of llm-d's active-request scorer.
const ACTIVE_WEIGHT: f64 = 2.0;
/// Weight of llm-d's prefix-cache scorer.
const PREFIX_WEIGHT: f64 = 3.0;
/// Scores this close are a tie.
const TIE: f64 = 1e-12;

/// One member as an anchor sees it at a pick.
#[derive(Debug, Clone, Copy, Default)]
pub struct Candidate {
    /// Its index in the pool.
    pub index: usize,
    pub gauges: Gauges,
    /// Requests the picker itself sent there and not yet finished.
    pub in_flight: u32,
    /// Leading prompt blocks its [`PrefixIndex`] holds (0 without a prompt).
    pub matched: usize,
}

/// `(max - v) / (max - min)` over the candidates, 1 when all are equal: the lower the better.
fn min_max(v: u32, lo: u32, hi: u32) -> f64 {
    if hi == lo {
        1.0
    } else {
        f64::from(hi - v) / f64::from(hi - lo)
    }
}

/// llm-d's active-request score: `(max - v) / max`, 1 when `v` is 0.
fn of_max(v: u32, max: u32) -> f64 {
    if v == 0 || max == 0 {
        1.0
    } else {
        f64::from(max.saturating_sub(v)) / f64::from(max)
    }
}

impl Anchor {
    /// The candidates with the highest total score, into `ties` (cleared first; empty when there
    /// are no candidates). `prompt_blocks` is the request's block count (0: no prompt to match);
    /// `max_in_flight` the most the picker has in flight on any member of the pool, candidate or
    /// not (llm-d's scorer divides by the largest count it tracks).
    pub fn best(
        self,
        candidates: &[Candidate],
        prompt_blocks: usize,
        max_in_flight: u32,
        ties: &mut Vec<usize>,
    ) {
        ties.clear();
        let span = |f: fn(&Candidate) -> u32| {
            candidates.iter().map(f).fold((u32::MAX, 0), |(lo, hi), v| (lo.min(v), hi.max(v)))
        };
        let (wlo, whi) = span(|c| c.gauges.waiting);
        let max_in_flight = candidates.iter().map(|c| c.in_flight).fold(max_in_flight, u32::max);
        let mut best = f64::NEG_INFINITY;
        for c in candidates {
            let mut score =
                QUEUE_WEIGHT * min_max(c.gauges.waiting, wlo, whi) + KV_WEIGHT * (1.0 - c.gauges.kv_usage);
            if self == Anchor::EppActive {
                score += ACTIVE_WEIGHT * of_max(c.in_flight, max_in_flight);
            }
            if self == Anchor::EppPrefix && prompt_blocks > 0 {
                score += PREFIX_WEIGHT * c.matched as f64 / prompt_blocks as f64;
            }
            if score > best + TIE {
                best = score;
                ties.clear();
                ties.push(c.index);
            } else if (score - best).abs() <= TIE {
                ties.push(c.index);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(index: usize, waiting: u32, kv_usage: f64, in_flight: u32, matched: usize) -> Candidate {
        Candidate { index, gauges: Gauges { waiting, running: 0, kv_usage }, in_flight, matched }
    }

    #[test]
    fn each_anchor_weighs_what_it_knows() {
        let mut ties = Vec::new();
        // Short queue and free memory win for every anchor.
        let load = [c(0, 10, 0.9, 0, 0), c(1, 0, 0.5, 0, 0), c(2, 0, 0.2, 0, 0)];
        for a in [Anchor::Epp, Anchor::EppActive, Anchor::EppPrefix] {
            a.best(&load, 0, 0, &mut ties);
            assert_eq!(ties, [2], "{a:?}");
        }
        // Its own in flight only counts for `EppActive`: 2 against 0 loses 2 points.
        let own = [c(0, 0, 0.3, 2, 0), c(1, 0, 0.3, 0, 0)];
        Anchor::Epp.best(&own, 0, 0, &mut ties);
        assert_eq!(ties, [0, 1]);
        Anchor::EppActive.best(&own, 0, 0, &mut ties);
        assert_eq!(ties, [1]);
        // A full prefix match is worth 3: more than a queue (2), not a half match (1.5) beside one.
        let cached = [c(0, 4, 0.3, 0, 50), c(1, 0, 0.3, 0, 0)];
        Anchor::EppPrefix.best(&cached, 50, 0, &mut ties);
        assert_eq!(ties, [0]);
        let half = [c(0, 4, 0.3, 0, 25), c(1, 0, 0.3, 0, 0)];
        Anchor::EppPrefix.best(&half, 50, 0, &mut ties);
        assert_eq!(ties, [1]);
        Anchor::EppPrefix.best(&[], 50, 0, &mut ties);
        assert!(ties.is_empty());
    }

    #[test]
    fn the_active_request_score_is_llm_ds_not_min_max() {
        // In flight {2, 3}: llm-d scores {1/3, 0}, 2/3 of a point apart at weight 2; min-max
        // would put them a whole 2 points apart and outweigh a KV usage 0.4 lower.
        let mut ties = Vec::new();
        let two_three = [c(0, 0, 0.7, 2, 0), c(1, 0, 0.3, 3, 0)];
        Anchor::EppActive.best(&two_three, 0, 0, &mut ties);
        assert_eq!(ties, [1], "2 + 0.6 + 0.67 against 2 + 1.4 + 0");
        // The most in flight on any member counts, a candidate or not: 2 of a pool maximum of 8
        // scores 0.75.
        assert!((of_max(2, 8) - 0.75).abs() < 1e-12 && of_max(0, 8) == 1.0 && of_max(3, 0) == 1.0);
        let spread = [c(0, 0, 0.3, 2, 0), c(1, 0, 0.3, 3, 0)];
        Anchor::EppActive.best(&spread, 0, 8, &mut ties);
        assert_eq!(ties, [0]);
    }
}
