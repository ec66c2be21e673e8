//! Choosing a server inside a pool: the algorithms the reference proxy and the benchmark's simulated
//! load balancers share, so what the benchmark measures is what the proxy does.
//!
//! Pure and deterministic: members are indexes `0..n`, randomness comes from a seeded generator, and
//! in-flight counts are whatever the caller reports through [`Picker::started`] / [`Picker::finished`].
//!
//! - `round-robin`, `random`, `least-request`: ignore weights.
//! - `weighted-round-robin`: nginx's smooth weighted round robin. Each pick adds every member's
//!   weight to its running score, picks the highest score and subtracts the total from it: over any
//!   window of `sum(weights)` picks each member is chosen exactly `weight` times, interleaved evenly.
//! - `weighted-least-request`: the member with the fewest in-flight requests per unit of weight, like
//!   BIG-IP's `ratio-least-connections-member` and HAProxy's weighted `leastconn` (full scan).
//! - `weighted-least-request-p2c`: the same score over two members drawn at random (power of two
//!   choices): O(1) per pick and less herding when many proxies share a fleet.
//! - `prefix-affinity`: a request with a key (a prefix or session key) goes where its key hashes
//!   on a weighted consistent-hash ring, unless that member is over its load bound ([`ring`]:
//!   HAProxy's `hash-type consistent` with `hash-balance-factor`); a request without a key is a
//!   `weighted-least-request` pick.
//! - `picker`: the per-request endpoint picker ([`endpoint::picker`]), where the caller can give it
//!   the request's prompt and the members' gauges (the reference proxy does). [`Picker`] itself
//!   answers it as `weighted-least-request` on the controller's ratios: the fallback when the
//!   request says nothing of its prompt.

#![forbid(unsafe_code)]

pub mod endpoint;
pub mod ring;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Algorithm {
    RoundRobin,
    Random,
    LeastRequest,
    WeightedRoundRobin,
    WeightedLeastRequest,
    WeightedLeastRequestP2c,
    PrefixAffinity,
    /// The per-request endpoint picker; `weighted-least-request` where it has nothing to go on.
    Picker,
}

impl Algorithm {
    pub fn uses_weights(self) -> bool {
        matches!(
            self,
            Algorithm::WeightedRoundRobin
                | Algorithm::WeightedLeastRequest
                | Algorithm::WeightedLeastRequestP2c
                | Algorithm::PrefixAffinity
                | Algorithm::Picker
        )
    }
}

#[derive(Debug, Clone)]
struct Slot {
    weight: u32,
    in_flight: u32,
    /// Smooth WRR running score.
    current: i64,
}

#[derive(Debug, Clone)]
pub struct Picker {
    algo: Algorithm,
    slots: Vec<Slot>,
    next_rr: usize,
    rng: ChaCha8Rng,
    /// `prefix-affinity`'s ring, rebuilt when the weights change.
    ring: ring::Ring,
    balance_factor: u32,
}

impl Picker {
    /// `n` members, all with weight 1 until [`Picker::set_weights`] says otherwise.
    pub fn new(algo: Algorithm, n: usize, seed: u64) -> Picker {
        Picker {
            algo,
            slots: (0..n).map(|_| Slot { weight: 1, in_flight: 0, current: 0 }).collect(),
            next_rr: 0,
            rng: ChaCha8Rng::seed_from_u64(seed),
            ring: if algo == Algorithm::PrefixAffinity {
                ring::Ring::new(&vec![1; n])
            } else {
                ring::Ring::default()
            },
            balance_factor: ring::DEFAULT_BALANCE_FACTOR,
        }
    }

    /// `prefix-affinity`'s load bound, in percent of a member's weighted share (HAProxy's
    /// `hash-balance-factor`; below 100 means 100).
    pub fn set_balance_factor(&mut self, factor: u32) {
        self.balance_factor = factor.max(100);
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algo
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// New weights, one per member; 0 takes a member out of weighted choices. Smooth-WRR scores are
    /// kept where the member set is unchanged, so a weight update does not restart the interleaving.
    pub fn set_weights(&mut self, weights: &[u32]) {
        if weights.len() != self.slots.len() {
            self.slots.resize(weights.len(), Slot { weight: 1, in_flight: 0, current: 0 });
            for s in &mut self.slots {
                s.current = 0;
            }
        }
        for (s, &w) in self.slots.iter_mut().zip(weights) {
            s.weight = w;
        }
        if self.algo == Algorithm::PrefixAffinity && self.ring.weights() != weights {
            self.ring = ring::Ring::new(weights);
        }
    }

    pub fn weights(&self) -> Vec<u32> {
        self.slots.iter().map(|s| s.weight).collect()
    }

    pub fn in_flight(&self, i: usize) -> u32 {
        self.slots.get(i).map(|s| s.in_flight).unwrap_or(0)
    }

    /// A request was sent to member `i`.
    pub fn started(&mut self, i: usize) {
        if let Some(s) = self.slots.get_mut(i) {
            s.in_flight += 1;
        }
    }

    /// A request to member `i` ended (any way).
    pub fn finished(&mut self, i: usize) {
        if let Some(s) = self.slots.get_mut(i) {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
    }

    /// Choose a member for a request with this affinity key (`None`: the request has none). Only
    /// `prefix-affinity` reads the key; every other algorithm is [`Picker::pick`].
    pub fn pick_keyed(&mut self, key: Option<u64>, eligible: impl Fn(usize) -> bool) -> Option<usize> {
        let Some(key) = key.filter(|_| self.algo == Algorithm::PrefixAffinity) else {
            return self.pick(eligible);
        };
        let any_positive = (0..self.slots.len()).any(|i| eligible(i) && self.slots[i].weight > 0);
        let in_flight: Vec<u32> = self.slots.iter().map(|s| s.in_flight).collect();
        let slots = &self.slots;
        let ok = |i: usize| eligible(i) && (!any_positive || slots[i].weight > 0);
        match self.ring.pick(key, &in_flight, self.balance_factor, ok) {
            Some(i) => Some(i),
            // Every weight is 0, so the ring is empty: any eligible member will do.
            None => self.least_by(score, &|i, _| eligible(i)),
        }
    }

    /// Choose a member among those `eligible` says may take traffic (healthy, not already tried).
    /// Weighted algorithms skip weight-0 members unless nothing else is eligible.
    pub fn pick(&mut self, eligible: impl Fn(usize) -> bool) -> Option<usize> {
        let weighted = self.algo.uses_weights();
        let any_positive = weighted && (0..self.slots.len()).any(|i| eligible(i) && self.slots[i].weight > 0);
        let ok = |i: usize, slots: &[Slot]| eligible(i) && (!any_positive || slots[i].weight > 0);
        let n = self.slots.len();
        if n == 0 {
            return None;
        }
        match self.algo {
            Algorithm::RoundRobin => {
                for k in 0..n {
                    let i = (self.next_rr + k) % n;
                    if ok(i, &self.slots) {
                        self.next_rr = (i + 1) % n;
                        return Some(i);
                    }
                }
                None
            }
            Algorithm::Random => {
                let cands: Vec<usize> = (0..n).filter(|&i| ok(i, &self.slots)).collect();
                (!cands.is_empty()).then(|| cands[self.rng.gen_range(0..cands.len())])
            }
            Algorithm::LeastRequest => self.least_by(|s| s.in_flight as f64, &ok),
            Algorithm::WeightedLeastRequest | Algorithm::PrefixAffinity | Algorithm::Picker => {
                self.least_by(score, &ok)
            }
            Algorithm::WeightedLeastRequestP2c => {
                let cands: Vec<usize> = (0..n).filter(|&i| ok(i, &self.slots)).collect();
                match cands.len() {
                    0 => None,
                    1 => Some(cands[0]),
                    len => {
                        let a = self.rng.gen_range(0..len);
                        let mut b = self.rng.gen_range(0..len - 1);
                        if b >= a {
                            b += 1;
                        }
                        let (a, b) = (cands[a], cands[b]);
                        Some(if score(&self.slots[b]) < score(&self.slots[a]) { b } else { a })
                    }
                }
            }
            Algorithm::WeightedRoundRobin => {
                let mut total: i64 = 0;
                let mut best: Option<usize> = None;
                for i in 0..n {
                    if !ok(i, &self.slots) {
                        continue;
                    }
                    // A weight-0 member can only be here when every eligible member has weight 0.
                    let w = self.slots[i].weight.max(if any_positive { 0 } else { 1 }) as i64;
                    self.slots[i].current += w;
                    total += w;
                    if best.is_none_or(|b| self.slots[i].current > self.slots[b].current) {
                        best = Some(i);
                    }
                }
                if let Some(b) = best {
                    self.slots[b].current -= total;
                }
                best
            }
        }
    }

    /// Lowest `key` among eligible members; ties broken at random so equal members share evenly.
    fn least_by(
        &mut self,
        key: impl Fn(&Slot) -> f64,
        ok: &impl Fn(usize, &[Slot]) -> bool,
    ) -> Option<usize> {
        let mut best = f64::INFINITY;
        let mut ties: Vec<usize> = Vec::new();
        for i in 0..self.slots.len() {
            if !ok(i, &self.slots) {
                continue;
            }
            let k = key(&self.slots[i]);
            if k < best - 1e-12 {
                best = k;
                ties.clear();
                ties.push(i);
            } else if (k - best).abs() <= 1e-12 {
                ties.push(i);
            }
        }
        match ties.len() {
            0 => None,
            1 => Some(ties[0]),
            len => Some(ties[self.rng.gen_range(0..len)]),
        }
    }
}

/// In-flight per unit of weight, counting the request about to be sent, so an idle heavy member beats
/// an idle light one.
fn score(s: &Slot) -> f64 {
    (s.in_flight as f64 + 1.0) / s.weight.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(p: &mut Picker, picks: usize, finish: bool) -> Vec<usize> {
        let mut c = vec![0; p.len()];
        for _ in 0..picks {
            let i = p.pick(|_| true).expect("some member");
            c[i] += 1;
            p.started(i);
            if finish {
                p.finished(i);
            }
        }
        c
    }

    #[test]
    fn smooth_wrr_is_exact_and_interleaved() {
        let mut p = Picker::new(Algorithm::WeightedRoundRobin, 3, 1);
        p.set_weights(&[5, 1, 1]);
        let seq: Vec<usize> = (0..7).map(|_| p.pick(|_| true).expect("pick")).collect();
        // nginx's documented sequence for 5:1:1.
        assert_eq!(seq, vec![0, 0, 1, 0, 2, 0, 0]);
        assert_eq!(counts(&mut p, 700, true), vec![500, 100, 100]);
    }

    #[test]
    fn weighted_least_request_follows_weights_under_load() {
        // Requests never finish: the steady state is in-flight proportional to weight.
        let mut p = Picker::new(Algorithm::WeightedLeastRequest, 2, 7);
        p.set_weights(&[3, 1]);
        let c = counts(&mut p, 400, false);
        assert_eq!(c, vec![300, 100]);
    }

    #[test]
    fn p2c_follows_weights_roughly() {
        let mut p = Picker::new(Algorithm::WeightedLeastRequestP2c, 4, 42);
        p.set_weights(&[3, 1, 1, 1]);
        let c = counts(&mut p, 6000, false);
        // With two-of-four sampling the heavy member is not always a candidate; it still takes the
        // largest share by far.
        assert!(c[0] > 2 * c[1] && c[0] > 2 * c[2], "{c:?}");
    }

    #[test]
    fn weight_zero_members_get_nothing_unless_everyone_is_zero() {
        for algo in [
            Algorithm::WeightedRoundRobin,
            Algorithm::WeightedLeastRequest,
            Algorithm::WeightedLeastRequestP2c,
        ] {
            let mut p = Picker::new(algo, 3, 3);
            p.set_weights(&[0, 2, 2]);
            assert_eq!(counts(&mut p, 100, true)[0], 0, "{algo:?}");
            p.set_weights(&[0, 0, 0]);
            assert!(p.pick(|_| true).is_some(), "{algo:?}: an all-zero pool still serves");
        }
    }

    #[test]
    fn ineligible_members_are_skipped_by_every_algorithm() {
        for algo in [
            Algorithm::RoundRobin,
            Algorithm::Random,
            Algorithm::LeastRequest,
            Algorithm::WeightedRoundRobin,
            Algorithm::WeightedLeastRequest,
            Algorithm::WeightedLeastRequestP2c,
        ] {
            let mut p = Picker::new(algo, 3, 9);
            for _ in 0..50 {
                assert_ne!(p.pick(|i| i != 1), Some(1), "{algo:?}");
            }
            assert_eq!(p.pick(|_| false), None, "{algo:?}");
        }
    }

    #[test]
    fn prefix_affinity_keeps_a_key_on_one_member_until_it_is_over_its_bound() {
        let mut p = Picker::new(Algorithm::PrefixAffinity, 4, 5);
        p.set_weights(&[50, 50, 50, 50]);
        let home = p.pick_keyed(Some(77), |_| true).expect("pick");
        // Other keys keep the pool busy; key 77 stays home while home is within 1.5x its share.
        for i in 0..4 {
            p.started(i);
            p.started(i);
        }
        assert_eq!(p.pick_keyed(Some(77), |_| true), Some(home));
        for _ in 0..3 {
            p.started(home);
        }
        let moved = p.pick_keyed(Some(77), |_| true).expect("pick");
        assert_ne!(moved, home, "5 in flight against a bound of ceil(12 x 1.5) / 4 = 4 or 5");
        assert_eq!(p.pick_keyed(Some(77), |i| i != home && i != moved).map(|i| i == home), Some(false));
        // No key: weighted least-request, which picks an idle member.
        p.finished(3);
        p.finished(3);
        assert!(p.pick_keyed(None, |_| true).is_some());
        // A weight-0 member gets no keys while anyone else has weight.
        p.set_weights(&[0, 50, 50, 50]);
        assert!((0..200).all(|k| p.pick_keyed(Some(k), |_| true) != Some(0)));
    }

    #[test]
    fn same_seed_same_choices() {
        let run = |seed| {
            let mut p = Picker::new(Algorithm::Random, 5, seed);
            (0..50).map(|_| p.pick(|_| true).expect("pick")).collect::<Vec<_>>()
        };
        assert_eq!(run(11), run(11));
        assert_ne!(run(11), run(12));
    }
}
