//! The queue rule, in every mode and from the first cycle: a request sent to a member that
//! queues waits, one sent to a member with room starts at once.
//!
//! On a member's first reading the policy has nothing but that reading, so it takes it as a
//! judgement: a member that shows waiting requests while another has room gets less than a member
//! with room of its size would ([`judged_sizes`]): `QUEUED_SHARE` of it, less the longer its queue
//! is against its capacity, `1 / (1 + QUEUE_WEIGHT x waiting / K)`, which also ranks the queued
//! members among themselves. The cut holds while each new reading confirms it (still queued,
//! another member with room) and ends with the first reading that does not, never to return: a
//! queue that persists beside room is then cut further by the trim (the queued member is at full
//! utilization), a passing one costs nothing.
//!
//! Only from a member's first reading, never armed later: applied afresh every cycle the rule is
//! a proportional controller coupled across members on 15 s-old readings, and it runs away (the
//! variants and their numbers: src/bench/RESULTS.md, "The queue rule").

use super::estimate::{Member, MEMORY_BOUND, MIN_RUNNING, MIN_USAGE};
use crate::source::Sample;

/// At most this share of the smallest ratio of a member with room goes to a member that queues.
const QUEUED_SHARE: f64 = 0.9;
/// How much a queue as long as the member's capacity weighs in the cut.
const QUEUE_WEIGHT: f64 = 2.0;
/// Requests' worth of the pool's memory reading each member's is pulled toward.
const SHRINK_REQUESTS: f64 = 8.0;

/// Whether a member can start one more request now: nothing waits, a slot is free, memory is not
/// full.
fn has_room(s: &Sample, k: f64) -> bool {
    s.waiting < 1.0 && s.running + 1.0 <= k && s.kv_usage.is_none_or(|kv| kv < MEMORY_BOUND)
}

/// Apply the rule to this cycle's ratios `next` (base x corrections), `base` the base ratios and
/// `k` the capacities; arms, keeps or ends each member's cut in `state`.
pub(super) fn apply(
    next: &mut [f64],
    base: &[f64],
    state: &mut [Member],
    samples: &[&Sample],
    k: &[f64],
    trim_max: f64,
) {
    let sizes = judged_sizes(base, k, samples);
    // What each member with room gets per unit of its judged size; the least of those.
    let room_min = (0..next.len())
        .filter(|&i| has_room(samples[i], k[i]))
        .map(|i| next[i] / sizes[i].max(1e-9))
        .fold(f64::INFINITY, f64::min);
    for i in 0..next.len() {
        let (s, m) = (samples[i], &mut state[i]);
        let confirmed = s.waiting >= 1.0 && room_min.is_finite();
        m.queue_cut = match (m.queue_cut, m.last.is_none()) {
            (_, true) if confirmed => {
                let cap = sizes[i] * room_min * QUEUED_SHARE / (1.0 + QUEUE_WEIGHT * s.waiting / k[i]);
                Some((cap / next[i]).clamp(1.0 / trim_max, 1.0))
            }
            // A new reading that does not confirm the cut ends it.
            (Some(_), false) if !confirmed && m.trim_weight > 0.0 => None,
            (c, _) => c,
        };
        next[i] *= m.queue_cut.unwrap_or(1.0);
    }
}

/// How big the rule judges each member, relative to the others: its base ratio, with its
/// memory reading pulled toward the pool's pooled one (all running over all KV usage) as if
/// [`SHRINK_REQUESTS`] more requests had been seen at the pool's rate. A reading from few
/// requests says little (4 requests at 10% say 40, the next 4 may say 80): against such a member,
/// a queued one is judged as an equal. Servers that really differ show it with many requests, and
/// the rule then never moves a big server's share onto a small one.
fn judged_sizes(base: &[f64], k: &[f64], samples: &[&Sample]) -> Vec<f64> {
    let (running, usage) = samples
        .iter()
        .filter_map(|s| Some((s.running, s.kv_usage?)))
        .filter(|(r, kv)| *r >= MIN_RUNNING && *kv >= MIN_USAGE)
        .fold((0.0, 0.0), |(r, u), (sr, su)| (r + sr, u + su));
    let pooled = (usage > 0.0).then(|| running / usage);
    (0..base.len())
        .map(|i| match (pooled, samples[i].kv_usage) {
            (Some(pool), Some(_)) => {
                let r = samples[i].running;
                let shrunk = (r * k[i] + SHRINK_REQUESTS * pool) / (r + SHRINK_REQUESTS);
                base[i] * shrunk / k[i].max(1e-9)
            }
            _ => base[i],
        })
        .collect()
}
