//! The simulated load balancers: which replica each request goes to.
//!
//! All but the two `epp` variants are [`llm_lc_balance::Picker`], the code the reference proxy
//! runs. What each one knows, as in life:
//! - in-flight counts are the balancer's own (a real LB counts its connections), exact and instant;
//!   with several balancer instances each counts only what it sent itself;
//! - weights are the controller's ratios, as of the last push that took effect; the `static-*`
//!   balancers instead hold fixed weights proportional to each replica's calibrated capacity at the
//!   start of the run (what an operator sets by hand from a spec sheet);
//! - `epp` and `epp-active` see the model servers' own gauges, refreshed every 50 ms.
//!
//! `epp` stands for the Gateway API Inference Extension's endpoint picker in its load-only
//! configuration (prefix-cache scoring has nothing to score here: requests share no prefixes):
//! `queue-scorer` (waiting queue, min-max normalized across endpoints, 1 when all are equal) and
//! `kv-cache-utilization-scorer` (1 - KV usage), both weight 2 as in the project's published default
//! config, then `max-score-picker` (highest total, ties at random). It does not count its own
//! in-flight requests and refreshes every replica at the same instant: between refreshes it keeps
//! choosing from the same numbers, so a 50 ms window's requests herd onto one replica. It is kept as
//! that herding variant.
//!
//! `epp-active` is the stronger baseline a sceptical user would configure: the same two scorers
//! plus llm-d's active-request scorer (the picker's own in-flight count per replica, `(max - c) /
//! max` as llm-d normalises it, weight 2), and each replica's metrics refreshed on its own timer at an independent
//! phase (as separate scrapes are), so no single instant decides a window's worth of requests.
//!
//! `prefix-affinity` is what we ship for prompts that share prefixes: the request's prefix key
//! hashed on a consistent-hash ring weighted by the controller's ratios, with HAProxy's bounded
//! load ([`llm_lc_balance::ring`]); a request without a key is a `ratio-least-request` pick.
//!
//! `epp-prefix` is the anchor for it, a per-request picker like llm-d's with its approximate
//! prefix-cache scorer: per replica an index of the block hashes it was sent (LRU, as many blocks as
//! the replica's KV cache holds), scoring each replica by the share of the request's leading
//! prompt blocks found in its index, weight 3, beside the queue and KV-usage scorers, weight 2 each
//! (llm-d's published scheduler defaults), with `epp-active`'s per-replica 50 ms refresh phases.
//!
//! The three anchors' scoring and the prefix index live in [`llm_lc_balance::endpoint`], where the
//! reference proxy and the load balancers' doors can reach them; this module keeps the refresh
//! timing and the benchmark's bookkeeping.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use llm_lc_balance::endpoint::picker::{self, Choice, Request};
use llm_lc_balance::endpoint::{
    Accounting, Anchor, Candidate, Gauges, PrefixIndex, Prompt, RequestPicker, Sticky, Warmth,
};
use llm_lc_balance::{Algorithm, Picker};
use llm_lc_sim::profile::BLOCK_SIZE;

/// A balancer under test. Names are fixed (CLI, JSON, tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Balancer {
    RoundRobin,
    Random,
    LeastRequest,
    /// Smooth weighted round robin with the controller's ratios (BIG-IP `ratio-member`).
    Ratio,
    /// Weighted least-request, full scan (BIG-IP `ratio-least-connections-member`, HAProxy `leastconn`).
    RatioLeastRequest,
    /// Weighted least-request over two random members (Envoy `LEAST_REQUEST` with weights).
    RatioP2c,
    /// Per-request picker on 50 ms-old queue and KV metrics (Gateway API Inference Extension).
    Epp,
    /// `epp` plus its own in-flight count (llm-d's active-request scorer), per-replica refresh phases.
    EppActive,
    /// Weighted round robin with fixed weights proportional to calibrated capacity.
    StaticRatio,
    /// Weighted least-request with fixed weights proportional to calibrated capacity.
    StaticRatioLeastRequest,
    /// Consistent hashing of the prefix key with bounded load, the ring weighted by the ratios.
    PrefixAffinity,
    /// `epp`'s scorers plus an approximate prefix-cache scorer (llm-d).
    EppPrefix,
    /// llm-d's "sticky until saturated" default: warm members first, least uncached tokens in flight.
    EppSticky,
    /// Ours ([`llm_lc_balance::endpoint::picker`]): capacity-aware backlog, sticky, a shared home.
    Picker,
}

/// The six balancers of the issue, in report order.
pub const DEFAULT_SET: &[Balancer] = &[
    Balancer::RoundRobin,
    Balancer::Random,
    Balancer::LeastRequest,
    Balancer::Ratio,
    Balancer::RatioLeastRequest,
    Balancer::Epp,
];

/// Every balancer.
pub const ALL: &[Balancer] = &[
    Balancer::RoundRobin,
    Balancer::Random,
    Balancer::LeastRequest,
    Balancer::StaticRatio,
    Balancer::StaticRatioLeastRequest,
    Balancer::Ratio,
    Balancer::RatioLeastRequest,
    Balancer::RatioP2c,
    Balancer::Epp,
    Balancer::EppActive,
    Balancer::PrefixAffinity,
    Balancer::EppPrefix,
    Balancer::EppSticky,
    Balancer::Picker,
];

/// The balancers of the prefix goals (src/bench/RESULTS.md): what we ship, its anchor, and the
/// cache-blind baselines.
pub const PREFIX_SET: &[Balancer] =
    &[Balancer::LeastRequest, Balancer::RatioLeastRequest, Balancer::PrefixAffinity, Balancer::EppPrefix];

/// The balancers of the goals grid (src/bench/RESULTS.md): the controller's two modes against the
/// strongest baselines of each kind, and our endpoint picker.
pub const GOALS_SET: &[Balancer] = &[
    Balancer::LeastRequest,
    Balancer::StaticRatio,
    Balancer::StaticRatioLeastRequest,
    Balancer::Ratio,
    Balancer::RatioLeastRequest,
    Balancer::Epp,
    Balancer::EppActive,
    Balancer::Picker,
];

impl Balancer {
    pub fn name(self) -> &'static str {
        match self {
            Balancer::RoundRobin => "round-robin",
            Balancer::Random => "random",
            Balancer::LeastRequest => "least-request",
            Balancer::Ratio => "ratio",
            Balancer::RatioLeastRequest => "ratio-least-request",
            Balancer::RatioP2c => "ratio-p2c",
            Balancer::Epp => "epp",
            Balancer::EppActive => "epp-active",
            Balancer::StaticRatio => "static-ratio",
            Balancer::StaticRatioLeastRequest => "static-ratio-least-request",
            Balancer::PrefixAffinity => "prefix-affinity",
            Balancer::EppPrefix => "epp-prefix",
            Balancer::EppSticky => "epp-sticky",
            Balancer::Picker => "picker",
        }
    }

    pub fn parse(s: &str) -> Result<Balancer, String> {
        ALL.iter().copied().find(|b| b.name() == s).ok_or_else(|| {
            format!(
                "unknown balancer {s:?}; known balancers: {}",
                ALL.iter().map(|b| b.name()).collect::<Vec<_>>().join(", ")
            )
        })
    }

    /// Whether the controller's ratios drive this balancer.
    pub fn uses_ratios(self) -> bool {
        matches!(
            self,
            Balancer::Ratio
                | Balancer::RatioLeastRequest
                | Balancer::RatioP2c
                | Balancer::PrefixAffinity
                | Balancer::Picker
        )
    }

    /// Whether this balancer holds fixed capacity-proportional weights.
    pub fn uses_static_weights(self) -> bool {
        matches!(self, Balancer::StaticRatio | Balancer::StaticRatioLeastRequest)
    }

    /// Whether this balancer reads the servers' gauges (an endpoint picker).
    pub fn is_epp(self) -> bool {
        matches!(
            self,
            Balancer::Epp
                | Balancer::EppActive
                | Balancer::EppPrefix
                | Balancer::EppSticky
                | Balancer::Picker
        )
    }

    /// Whether this balancer keeps an approximate prefix index of what it sent each replica.
    pub fn indexes_prefixes(self) -> bool {
        matches!(self, Balancer::EppPrefix | Balancer::EppSticky | Balancer::Picker)
    }

    /// Whether each replica's metrics refresh on their own phase (`epp` refreshes all at once).
    pub fn refreshes_per_replica(self) -> bool {
        matches!(self, Balancer::EppActive | Balancer::EppPrefix | Balancer::EppSticky | Balancer::Picker)
    }

    /// The LB algorithm the controller's ratios feed, as a policy knows it: `round-robin` for
    /// weighted round robin, `least-connections` for the weighted least-request family.
    pub fn weight_mode(self) -> &'static str {
        match self {
            Balancer::Ratio | Balancer::StaticRatio => "round-robin",
            _ => "least-connections",
        }
    }

    fn algorithm(self) -> Option<Algorithm> {
        Some(match self {
            Balancer::RoundRobin => Algorithm::RoundRobin,
            Balancer::Random => Algorithm::Random,
            Balancer::LeastRequest => Algorithm::LeastRequest,
            Balancer::Ratio | Balancer::StaticRatio => Algorithm::WeightedRoundRobin,
            Balancer::RatioLeastRequest | Balancer::StaticRatioLeastRequest => {
                Algorithm::WeightedLeastRequest
            }
            Balancer::RatioP2c => Algorithm::WeightedLeastRequestP2c,
            Balancer::PrefixAffinity => Algorithm::PrefixAffinity,
            Balancer::Epp
            | Balancer::EppActive
            | Balancer::EppPrefix
            | Balancer::EppSticky
            | Balancer::Picker => return None,
        })
    }
}

/// What a balancer may know of a request: its affinity key and its prompt's block hashes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Route<'a> {
    pub key: Option<u64>,
    /// The prompt's full blocks (a prefix of the request's hash chain).
    pub blocks: &'a [u64],
    /// The prompt's length in tokens (`epp-sticky` counts what is left to prefill).
    pub prompt_tokens: u32,
}

/// A balancer's state during one run.
pub struct Lb {
    kind: Balancer,
    picker: Picker,
    /// Separate generator for `epp` ties, so it never disturbs the picker's stream.
    rng: ChaCha8Rng,
    pub epp: Vec<Gauges>,
    ties: Vec<usize>,
    /// Replicas this balancer may choose (all, unless the pool is tiered: `region-spill`).
    eligible: Vec<bool>,
    /// `epp-prefix`: what each replica was sent.
    sent: Vec<PrefixIndex>,
    /// Scratch space for an endpoint pick's candidates.
    candidates: Vec<Candidate>,
    /// `epp-sticky`: its settings, what it dispatched, scratch space, and the uncached tokens of
    /// the last pick (counted once the request has its id: [`Lb::opened`]).
    sticky: Sticky,
    accounting: Accounting,
    warmth: Vec<Warmth>,
    picked_uncached: u64,
    /// `picker`: ours, and its last choice (opened once the request has its id).
    endpoint: Option<RequestPicker>,
    chosen: Option<Choice>,
}

impl Lb {
    pub fn new(kind: Balancer, n: usize, seed: u64) -> Lb {
        // Epp still keeps a picker for its in-flight bookkeeping; round robin is never asked to pick.
        let algo = kind.algorithm().unwrap_or(Algorithm::RoundRobin);
        Lb {
            kind,
            picker: Picker::new(algo, n, seed),
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_0e99),
            epp: vec![Gauges::default(); n],
            ties: Vec::with_capacity(n),
            eligible: vec![true; n],
            sent: Vec::new(),
            candidates: Vec::with_capacity(n),
            sticky: Sticky::from_prefill_rate(0.0, 0.0),
            accounting: Accounting::new(n),
            warmth: Vec::with_capacity(n),
            picked_uncached: 0,
            endpoint: (kind == Balancer::Picker)
                .then(|| RequestPicker::new(n, 0, picker::Settings::default())),
            chosen: None,
        }
    }

    /// `picker`'s settings (its state starts afresh).
    pub fn set_picker(&mut self, settings: picker::Settings) {
        if let Some(p) = &mut self.endpoint {
            *p = RequestPicker::new(p.len(), 0, settings);
        }
    }

    /// A replica's gauges, as of a refresh.
    pub fn set_gauges(&mut self, r: usize, gauges: Gauges) {
        if let Some(g) = self.epp.get_mut(r) {
            *g = gauges;
        }
        if let Some(p) = &mut self.endpoint {
            p.set_gauges(r, Some(gauges));
        }
    }

    /// `epp-prefix`: each replica's index holds as many blocks as its KV cache.
    pub fn set_cache_blocks(&mut self, blocks: &[u32]) {
        if let Some(p) = &mut self.endpoint {
            p.set_cache_blocks(&blocks.iter().map(|&b| b as usize).collect::<Vec<_>>());
            return;
        }
        self.sent = blocks.iter().map(|&b| PrefixIndex::with_capacity(b as usize)).collect();
    }

    /// `epp-sticky`'s saturation point: tau = `prefill_tokens_per_s` x `max_ttft_s`.
    pub fn set_sticky(&mut self, prefill_tokens_per_s: f64, max_ttft_s: f64) {
        self.sticky = Sticky::from_prefill_rate(prefill_tokens_per_s, max_ttft_s);
    }

    /// The request just picked got id `id` (`epp-sticky` counts its uncached tokens from now on).
    pub fn opened(&mut self, id: u64, replica: usize) {
        if self.kind == Balancer::EppSticky {
            self.accounting.dispatched(id, replica, self.picked_uncached);
        }
        if let (Some(p), Some(c)) = (&mut self.endpoint, self.chosen.take()) {
            p.open(id, c);
        }
    }

    /// Request `id`'s first token came back: its prefill no longer loads its replica.
    pub fn first_token(&mut self, id: u64) {
        // Only `epp-sticky` keeps the accounting: the others pay nothing per event.
        if self.kind == Balancer::EppSticky {
            self.accounting.first_token(id);
        }
        if let Some(p) = &mut self.endpoint {
            p.first_token(id);
        }
    }

    /// Request `id` ended (also for [`Lb::finished`]'s in-flight count, which the caller reports).
    pub fn closed(&mut self, id: u64) {
        if self.kind == Balancer::EppSticky {
            self.accounting.finished(id);
        }
        if let Some(p) = &mut self.endpoint {
            p.finished(id);
        }
    }

    /// `prefix-affinity`'s load bound (HAProxy's `hash-balance-factor`).
    pub fn set_balance_factor(&mut self, factor: u32) {
        self.picker.set_balance_factor(factor);
    }

    /// Limit the choice to some replicas (a tiered pool's active tiers). Nobody eligible means
    /// everybody is: a balancer with an empty pool would fail every request.
    pub fn set_eligible(&mut self, eligible: Vec<bool>) {
        self.eligible = if eligible.iter().any(|&e| e) { eligible } else { vec![true; eligible.len()] };
    }

    pub fn kind(&self) -> Balancer {
        self.kind
    }

    pub fn set_weights(&mut self, w: &[u32]) {
        self.picker.set_weights(w);
        if let Some(p) = &mut self.endpoint {
            p.set_capacity(&w.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
        }
    }

    pub fn weights(&self) -> Vec<u32> {
        self.picker.weights()
    }

    /// Choose a replica for a request that tells nothing about itself.
    pub fn pick(&mut self) -> usize {
        self.pick_route(Route::default())
    }

    /// Choose a replica for a new request and count it in flight there.
    pub fn pick_route(&mut self, route: Route<'_>) -> usize {
        let i = match self.kind {
            Balancer::Epp | Balancer::EppActive | Balancer::EppPrefix => self.pick_epp(route.blocks),
            Balancer::EppSticky => self.pick_sticky(route),
            Balancer::Picker => self.pick_endpoint(route),
            _ => {
                let eligible = &self.eligible;
                self.picker.pick_keyed(route.key, |i| eligible.get(i).copied().unwrap_or(true)).unwrap_or(0)
            }
        };
        if let Some(index) = self.sent.get_mut(i) {
            index.record(route.blocks);
        }
        self.picker.started(i);
        i
    }

    pub fn finished(&mut self, i: usize) {
        self.picker.finished(i);
    }

    pub fn in_flight(&self, i: usize) -> u32 {
        self.picker.in_flight(i)
    }

    /// Ours. It reads the prompt's blocks, not the client's key: the anchors it is measured against
    /// see only the body too.
    fn pick_endpoint(&mut self, route: Route<'_>) -> usize {
        let Some(p) = &mut self.endpoint else { return 0 };
        let request = Request {
            blocks: route.blocks,
            tokens: u64::from(route.prompt_tokens),
            block_tokens: u64::from(BLOCK_SIZE),
            key: None,
        };
        let eligible = &self.eligible;
        let Some(choice) = p.pick(request, |i| eligible.get(i).copied().unwrap_or(true)) else { return 0 };
        p.remember(choice, request);
        self.chosen = Some(choice);
        choice.member
    }

    fn pick_sticky(&mut self, route: Route<'_>) -> usize {
        let prompt = Prompt {
            tokens: u64::from(route.prompt_tokens),
            blocks: route.blocks.len(),
            block_tokens: u64::from(BLOCK_SIZE),
        };
        self.warmth.clear();
        for i in 0..self.eligible.len() {
            if self.eligible[i] {
                let matched = self.sent.get(i).map_or(0, |s| s.matched(route.blocks));
                self.warmth.push(Warmth { index: i, in_flight_tokens: self.accounting.tokens(i), matched });
            }
        }
        self.sticky.best(&self.warmth, prompt, &mut self.ties);
        let i = match self.ties.len() {
            0 => 0,
            1 => self.ties[0],
            n => self.ties[self.rng.gen_range(0..n)],
        };
        let matched = self.warmth.iter().find(|w| w.index == i).map_or(0, |w| w.matched);
        self.picked_uncached = prompt.uncached(matched);
        i
    }

    fn pick_epp(&mut self, blocks: &[u64]) -> usize {
        let anchor = match self.kind {
            Balancer::EppActive => Anchor::EppActive,
            Balancer::EppPrefix => Anchor::EppPrefix,
            _ => Anchor::Epp,
        };
        self.candidates.clear();
        for (i, gauges) in self.epp.iter().enumerate() {
            if self.eligible.get(i).copied().unwrap_or(true) {
                let matched = match anchor {
                    Anchor::EppPrefix => self.sent.get(i).map_or(0, |s| s.matched(blocks)),
                    _ => 0,
                };
                self.candidates.push(Candidate {
                    index: i,
                    gauges: *gauges,
                    in_flight: self.picker.in_flight(i),
                    matched,
                });
            }
        }
        let max_in_flight = (0..self.epp.len()).map(|i| self.picker.in_flight(i)).max().unwrap_or(0);
        anchor.best(&self.candidates, blocks.len(), max_in_flight, &mut self.ties);
        match self.ties.len() {
            0 => 0,
            1 => self.ties[0],
            n => self.ties[self.rng.gen_range(0..n)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for b in ALL {
            assert_eq!(Balancer::parse(b.name()), Ok(*b));
        }
        assert!(Balancer::parse("leastconn").unwrap_err().contains("ratio-least-request"));
    }

    #[test]
    fn epp_prefers_short_queue_and_free_kv_and_ignores_its_own_picks() {
        let mut lb = Lb::new(Balancer::Epp, 3, 1);
        lb.epp = vec![
            Gauges { waiting: 10, running: 0, kv_usage: 0.9 },
            Gauges { waiting: 0, running: 0, kv_usage: 0.5 },
            Gauges { waiting: 0, running: 0, kv_usage: 0.2 },
        ];
        // Stale view: every pick goes to the same best replica until the next refresh.
        for _ in 0..5 {
            assert_eq!(lb.pick(), 2);
        }
        assert_eq!(lb.in_flight(2), 5);
    }

    #[test]
    fn epp_active_counts_its_own_picks_and_spreads_them() {
        let mut lb = Lb::new(Balancer::EppActive, 3, 1);
        lb.epp = vec![Gauges { waiting: 0, running: 0, kv_usage: 0.3 }; 3];
        let mut c = [0; 3];
        for _ in 0..30 {
            c[lb.pick()] += 1;
        }
        // Same stale view for all 30 picks, yet its own in-flight count spreads them evenly.
        assert_eq!(c, [10, 10, 10]);
        let mut herd = Lb::new(Balancer::Epp, 3, 1);
        herd.epp = vec![
            Gauges { waiting: 0, running: 0, kv_usage: 0.3 },
            Gauges { waiting: 0, running: 0, kv_usage: 0.2 },
            Gauges { waiting: 0, running: 0, kv_usage: 0.3 },
        ];
        assert!((0..30).all(|_| herd.pick() == 1), "epp herds onto the best-looking replica");
    }

    #[test]
    fn static_balancers_are_not_driven_by_the_controller() {
        for b in [Balancer::StaticRatio, Balancer::StaticRatioLeastRequest] {
            assert!(b.uses_static_weights() && !b.uses_ratios(), "{b:?}");
        }
        assert_eq!(Balancer::StaticRatio.weight_mode(), "round-robin");
        assert_eq!(Balancer::RatioLeastRequest.weight_mode(), "least-connections");
        for name in ["epp-active", "static-ratio", "static-ratio-least-request", "epp"] {
            assert!(ALL.iter().any(|b| b.name() == name), "{name} in --balancers all");
        }
    }

    #[test]
    fn only_eligible_replicas_are_chosen_and_none_eligible_means_all() {
        for kind in
            [Balancer::LeastRequest, Balancer::RatioLeastRequest, Balancer::EppActive, Balancer::RoundRobin]
        {
            let mut lb = Lb::new(kind, 4, 1);
            lb.set_eligible(vec![true, true, false, false]);
            assert!((0..40).all(|_| lb.pick() < 2), "{kind:?}");
            lb.set_eligible(vec![false; 4]);
            let mut seen = [false; 4];
            for _ in 0..40 {
                seen[lb.pick()] = true;
            }
            assert!(seen[2] || seen[3], "{kind:?}: an empty set falls back to everyone");
        }
    }

    #[test]
    fn epp_prefix_follows_the_blocks_it_sent_and_forgets_the_oldest() {
        let mut lb = Lb::new(Balancer::EppPrefix, 3, 1);
        lb.set_cache_blocks(&[100, 100, 100]);
        lb.epp = vec![Gauges { waiting: 0, running: 0, kv_usage: 0.3 }; 3];
        let a: Vec<u64> = (0..50).collect();
        let first = lb.pick_route(Route { key: None, blocks: &a, prompt_tokens: 0 });
        // Same gauges everywhere: the replica that was sent the prefix scores 3 more.
        assert_eq!(lb.pick_route(Route { key: None, blocks: &a, prompt_tokens: 0 }), first);
        // A queue there outweighs a half match, not a full one.
        lb.epp[first].waiting = 4;
        assert_eq!(lb.pick_route(Route { key: None, blocks: &a, prompt_tokens: 0 }), first);
        let half: Vec<u64> = (0..25).chain(1000..1025).collect();
        assert_ne!(lb.pick_route(Route { key: None, blocks: &half, prompt_tokens: 0 }), first);
        // 100 blocks of other prompts push the old prefix out of the index.
        lb.epp[first].waiting = 0;
        let other: Vec<u64> = (5000..5100).collect();
        for _ in 0..2 {
            lb.sent[first].record(&other);
        }
        assert_eq!(lb.sent[first].matched(&a), 0);
    }

    #[test]
    fn epp_sticky_stays_warm_until_saturated_and_frees_tokens_at_the_first_token() {
        let mut lb = Lb::new(Balancer::EppSticky, 2, 1);
        lb.set_cache_blocks(&[1000, 1000]);
        // tau: 1,000 tokens/s for 1 s.
        lb.set_sticky(1000.0, 1.0);
        let blocks: Vec<u64> = (0..10).collect();
        let route = Route { key: None, blocks: &blocks, prompt_tokens: 160 };
        let home = lb.pick_route(route);
        lb.opened(1, home);
        // Warm now, with 160 uncached tokens in flight against 160 for the same prompt elsewhere
        // (nothing is cached there): it stays, and its own part there is 0.
        let again = lb.pick_route(route);
        assert_eq!(again, home);
        lb.opened(2, again);
        assert_eq!(lb.accounting.tokens(home), 160);
        // Saturated past tau (1,000 tokens): a cold member takes the next one.
        for id in 3..10 {
            lb.accounting.dispatched(id, home, 200);
        }
        assert_ne!(lb.pick_route(route), home);
        // First tokens free the prefill load; the ends free the rest.
        for id in 1..10 {
            lb.first_token(id);
        }
        assert_eq!(lb.accounting.tokens(home), 0);
        assert_eq!(lb.accounting.requests(home), 9);
        for id in 1..10 {
            lb.closed(id);
        }
        assert_eq!(lb.accounting.requests(home), 0);
    }

    #[test]
    fn the_picker_follows_the_ratios_and_keeps_a_prefix_where_it_sent_it() {
        let mut lb = Lb::new(Balancer::Picker, 2, 1);
        lb.set_cache_blocks(&[1000, 1000]);
        lb.set_weights(&[90, 30]);
        let mut c = [0; 2];
        for id in 0..40 {
            let r = lb.pick_route(Route { key: None, blocks: &[], prompt_tokens: 100 });
            lb.opened(id, r);
            c[r] += 1;
        }
        assert_eq!(c, [30, 10], "three times the ratio, three times the requests in flight");
        for id in 0..40 {
            lb.first_token(id);
            lb.closed(id);
        }
        let blocks: Vec<u64> = (0..20).collect();
        let route = Route { key: Some(7), blocks: &blocks, prompt_tokens: 320 };
        let home = lb.pick_route(route);
        lb.opened(100, home);
        assert!((101..110).all(|id| {
            let r = lb.pick_route(route);
            lb.opened(id, r);
            r == home
        }));
    }

    #[test]
    fn prefix_affinity_sends_a_key_home_and_plain_requests_by_weight() {
        let mut lb = Lb::new(Balancer::PrefixAffinity, 3, 1);
        lb.set_weights(&[50, 50, 50]);
        let home = lb.pick_route(Route { key: Some(9), blocks: &[], prompt_tokens: 0 });
        lb.finished(home);
        for _ in 0..10 {
            let i = lb.pick_route(Route { key: Some(9), blocks: &[], prompt_tokens: 0 });
            assert_eq!(i, home);
            lb.finished(i);
        }
        let mut c = [0; 3];
        for _ in 0..30 {
            c[lb.pick()] += 1;
        }
        assert_eq!(c, [10, 10, 10], "no key: weighted least-request");
    }

    #[test]
    fn ratio_least_request_uses_weights() {
        let mut lb = Lb::new(Balancer::RatioLeastRequest, 2, 1);
        lb.set_weights(&[3, 1]);
        let mut c = [0; 2];
        for _ in 0..40 {
            c[lb.pick()] += 1;
        }
        assert_eq!(c, [30, 10]);
    }
}
