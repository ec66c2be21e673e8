//! The base ratio per mode, and the two per-member figures the corrections read: the queueing
//! delay a request sent now would see, and utilization.
//!
//! Behind least-connections the LB keeps in-flight counts proportional to the ratios, so the
//! base is the capacity `K`: a slower server holds each request longer and so gets fewer (the LB
//! already handles speed; weighting it again overfeeds the fast replicas). Behind weighted round
//! robin the LB splits arrivals by ratio, so the base is the throughput capacity `K / s`.

use super::estimate::{queued_with_room, Member};
use super::params::Mode;
use crate::source::Sample;

/// Per member, in the order of the fresh members.
pub(super) struct Base {
    /// Capacity in concurrent requests used this cycle (see [`capacities`]).
    pub k: Vec<f64>,
    /// The base ratio: `K`, or `K / s` behind weighted round robin.
    pub ratio: Vec<f64>,
    /// Queueing delay `d = waiting x s / K`, seconds: how long a request sent now waits.
    pub delay: Vec<f64>,
    /// `(running + waiting) / K`, capped at 1.
    pub util: Vec<f64>,
}

impl Base {
    pub fn new(mode: Mode, max_num_seqs: f64, state: &[Member], samples: &[&Sample]) -> Base {
        // What each member is known to hold, or shows it holds this cycle (queued with room: what
        // it runs), so one member's evidence sizes the others that have none.
        let known_k: Vec<f64> = state
            .iter()
            .zip(samples)
            .filter_map(|(m, s)| m.k.or_else(|| queued_with_room(s).then_some(s.running.max(1.0))))
            .collect();
        let known_s: Vec<f64> = state.iter().filter_map(|m| m.s).collect();
        let mean_k = mean(&known_k).unwrap_or(max_num_seqs);
        let mean_s = mean(&known_s);
        // Weighted round robin needs every member's service time; a partial picture would favour
        // whoever lacks one, so it falls back to capacity in requests for all.
        let use_s = mode == Mode::RoundRobin && known_s.len() == state.len();
        let k = capacities(state, samples, mean_k);
        let n = state.len();
        let (mut ratio, mut delay, mut util) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for ((m, s), &k) in state.iter().zip(samples).zip(&k) {
            let service = m.s.or(mean_s).unwrap_or(1.0);
            ratio.push(if use_s { k / service } else { k });
            delay.push(s.waiting * service / k);
            util.push(((s.running + s.waiting) / k).min(1.0));
        }
        Base { k, ratio, delay, util }
    }
}

/// Each member's capacity in concurrent requests: its estimate, else the pool's mean; a member
/// without an estimate that does not queue holds at least what it runs now and one more, and one
/// that queues while its memory has room holds what it runs (it is at its batch limit: the
/// 1-seq vLLM beside a 4-seq one, read once by a dry run). Neither is remembered.
fn capacities(state: &[Member], samples: &[&Sample], mean_k: f64) -> Vec<f64> {
    state
        .iter()
        .zip(samples)
        .map(|(m, s)| {
            m.k.unwrap_or_else(|| {
                if s.waiting < 1.0 {
                    mean_k.max(s.running + 1.0)
                } else if queued_with_room(s) {
                    s.running
                } else {
                    mean_k
                }
            })
            .max(1.0)
        })
        .collect()
}

pub(super) fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}
