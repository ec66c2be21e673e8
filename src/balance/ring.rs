//! Consistent hashing with bounded load, as HAProxy does it (`balance hash` with
//! `hash-type consistent` and `hash-balance-factor`), weighted by the members' weights.
//!
//! The ring: each member owns `weight x POINTS_PER_WEIGHT` points. A point's place depends only on
//! the member and the point's number, so a weight change adds or removes that member's last points
//! and moves no other key (HAProxy gives each server `weight x 16` nodes the same way). A key goes
//! to the owner of the first point at or after its hash, walking on past members that may not take
//! it.
//!
//! The bound (HAProxy's `chash_server_is_eligible`): with `served` requests in flight in the pool,
//! the pool has `ceil((served + 1) x factor / 100)` slots, shared out in proportion to weight
//! (whole slots per unit of weight, the remainder spread by cumulative weight, never less than 1);
//! a member already holding its slots is passed over. `factor` 150 lets a member run at 1.5x its
//! weighted share before its keys spill to the next member on the ring, which then holds them
//! while the first is busy: affinity while it is cheap, balance when it is not.

/// Ring points per unit of weight (HAProxy's `BE_WEIGHT_SCALE`).
pub const POINTS_PER_WEIGHT: u32 = 16;

/// Most points a ring holds whatever the weights (4 MiB of points): past it, each member's points
/// shrink in proportion to its weight (at least one each), so a weight of 10^8 from outside costs
/// the same memory as a sane one. Below it, the ring is HAProxy's exactly.
pub const MAX_POINTS: u64 = 1 << 18;

/// HAProxy's documented starting point for `hash-balance-factor`.
pub const DEFAULT_BALANCE_FACTOR: u32 = 150;

/// The hash ring of one pool. Members are indexes `0..n`.
#[derive(Debug, Clone, Default)]
pub struct Ring {
    /// (position, member), sorted by position.
    points: Vec<(u64, u32)>,
    weights: Vec<u32>,
}

impl Ring {
    /// The ring for these weights; weight-0 members own no points.
    pub fn new(weights: &[u32]) -> Ring {
        let counts = point_counts(weights);
        let mut points = Vec::with_capacity(counts.iter().sum::<u64>() as usize);
        for (m, &n) in counts.iter().enumerate() {
            for k in 0..n {
                points.push((mix(((m as u64) << 32) | k), m as u32));
            }
        }
        points.sort_unstable();
        Ring { points, weights: weights.to_vec() }
    }

    pub fn weights(&self) -> &[u32] {
        &self.weights
    }

    /// Members in the order a key visits them: the owner of its point first, then each member the
    /// first time the walk meets it.
    pub fn walk(&self, key: u64) -> impl Iterator<Item = usize> + '_ {
        let h = mix(key);
        let start = self.points.partition_point(|&(p, _)| p < h);
        let n = self.points.len();
        let mut seen = vec![false; self.weights.len()];
        (0..n).filter_map(move |k| {
            let m = self.points[(start + k) % n].1 as usize;
            (!std::mem::replace(&mut seen[m], true)).then_some(m)
        })
    }

    /// The member for `key`: the first on its walk that `ok` accepts and that is under its bound
    /// (see the module doc), else the first `ok` accepts, else `None`.
    pub fn pick(
        &self,
        key: u64,
        in_flight: &[u32],
        factor: u32,
        ok: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        let served: u64 = in_flight.iter().map(|&x| u64::from(x)).sum();
        let mut fallback = None;
        for m in self.walk(key) {
            if !ok(m) {
                continue;
            }
            if in_flight.get(m).copied().unwrap_or(0) < self.slots(m, served, factor) {
                return Some(m);
            }
            fallback.get_or_insert(m);
        }
        fallback
    }

    /// Member `m`'s share of `ceil((served + 1) x factor / 100)` slots.
    fn slots(&self, m: usize, served: u64, factor: u32) -> u32 {
        // In u128: weights near u32::MAX times a remainder of the same size pass u64.
        let total_weight: u128 = self.weights.iter().map(|&w| u128::from(w)).sum();
        if total_weight == 0 {
            return u32::MAX;
        }
        let tot_slots = (u128::from(served + 1) * u128::from(factor.max(100))).div_ceil(100);
        let (per_weight, remainder) = (tot_slots / total_weight, tot_slots % total_weight);
        let w = u128::from(self.weights[m]);
        let before: u128 = self.weights[..m].iter().map(|&x| u128::from(x)).sum();
        let slots =
            w * per_weight + ((before + w) * remainder) / total_weight - (before * remainder) / total_weight;
        u32::try_from(slots.max(1)).unwrap_or(u32::MAX)
    }
}

/// Points per member: `weight x POINTS_PER_WEIGHT`, scaled down in proportion when the total would
/// pass [`MAX_POINTS`].
fn point_counts(weights: &[u32]) -> Vec<u64> {
    let per_weight = u64::from(POINTS_PER_WEIGHT);
    let total: u64 = weights.iter().map(|&w| u64::from(w) * per_weight).sum();
    weights
        .iter()
        .map(|&w| {
            let full = u64::from(w) * per_weight;
            if total <= MAX_POINTS || w == 0 {
                full
            } else {
                ((u128::from(full) * u128::from(MAX_POINTS) / u128::from(total)) as u64).max(1)
            }
        })
        .collect()
}

/// splitmix64's finalizer: spreads keys and points over the ring.
pub use llm_lc_common::splitmix64 as mix;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_weights_make_a_bounded_ring_that_keeps_their_proportions() {
        let ring = Ring::new(&[100_000_000, 50_000_000, u32::MAX]);
        assert!(ring.points.len() as u64 <= MAX_POINTS, "{} points", ring.points.len());
        let counts = point_counts(&[100_000_000, 50_000_000, 0]);
        assert_eq!(counts[2], 0, "weight 0 owns nothing");
        assert!((counts[0] as f64 / counts[1] as f64 - 2.0).abs() < 0.01, "{counts:?}");
        assert_eq!(point_counts(&[100, 1]), [1600, 16], "small weights: HAProxy's ring exactly");
        assert!(ring.pick(7, &[0, 0, 0], 150, |_| true).is_some());
    }

    #[test]
    fn keys_spread_by_weight_and_a_weight_change_moves_only_that_members_keys() {
        let ring = Ring::new(&[100, 50, 50]);
        let owner = |r: &Ring, k: u64| r.walk(k).next().expect("an owner");
        let mut counts = [0u32; 3];
        for k in 0..30_000 {
            counts[owner(&ring, k)] += 1;
        }
        let share = f64::from(counts[0]) / 30_000.0;
        assert!((0.45..0.55).contains(&share), "{counts:?}");
        // Member 1 loses weight: some of its keys move, nobody else's do.
        let lighter = Ring::new(&[100, 25, 50]);
        for k in 0..30_000 {
            let (a, b) = (owner(&ring, k), owner(&lighter, k));
            assert!(a == b || a == 1, "key {k} moved from {a} to {b}");
        }
        assert_eq!(ring.walk(7).count(), 3, "the walk meets every member once");
    }

    #[test]
    fn a_member_over_its_bound_passes_its_keys_to_the_next_on_the_ring() {
        let ring = Ring::new(&[10, 10, 10]);
        let key = 42;
        let first = ring.walk(key).next().expect("owner");
        let second = ring.walk(key).nth(1).expect("next");
        let mut in_flight = vec![0u32; 3];
        assert_eq!(ring.pick(key, &in_flight, 150, |_| true), Some(first), "an idle pool: its owner");
        // One in flight at the owner: 2 x 1.5 = 3 slots over 3 members leaves the owner 1, used.
        in_flight[first] = 1;
        assert_eq!(ring.pick(key, &in_flight, 150, |_| true), Some(second));
        // A busy pool has room above the average: 2 each, 7 x 1.5 = 11 slots, 3 or 4 per member.
        let mut busy = vec![2u32; 3];
        assert_eq!(ring.pick(key, &busy, 150, |_| true), Some(first));
        busy[first] = 4;
        assert_eq!(ring.pick(key, &busy, 150, |_| true), Some(second), "4 is over 1.5x of 2.7");
        // Everyone over the bound: the owner after all, unless it may not take traffic.
        let full = vec![50u32; 3];
        assert_eq!(ring.pick(key, &full, 150, |_| true), Some(first));
        assert_eq!(ring.pick(key, &full, 150, |m| m != first), Some(second));
        assert_eq!(ring.pick(key, &full, 150, |_| false), None);
    }

    #[test]
    fn slots_follow_weight_and_sum_to_the_pool_bound() {
        let ring = Ring::new(&[3, 1, 1, 1]);
        let slots: Vec<u32> = (0..4).map(|m| ring.slots(m, 59, 150)).collect();
        assert_eq!(slots.iter().sum::<u32>(), 90, "{slots:?}");
        assert_eq!(slots, vec![45, 15, 15, 15]);
        assert_eq!(Ring::new(&[0, 0]).slots(0, 5, 150), u32::MAX, "no weights, no bound");
    }
}
