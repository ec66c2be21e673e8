//! The named scenarios: which fleet, which traffic, what goes wrong and when.
//!
//! Times are in seconds of virtual time. Every scenario has a warm-up (excluded from the results:
//! queues fill and the controller learns from equal ratios) and then a measured window; events such
//! as the spike or the degradation happen inside the measured window.
//!
//! | name | fleet | traffic |
//! |---|---|---|
//! | `homogeneous` | 6 equal replicas | steady Poisson, ShareGPT-like |
//! | `heterogeneous` | 6 replicas, 2 at half speed (an older GPU generation) | steady |
//! | `degraded` | 6 equal; replica 0 slows to a third at the middle of the measured window | steady |
//! | `spike` | 6 equal | load doubles for 60 s in the middle of the measured window |
//! | `long-context` | 6 equal | a quarter of requests carry 1.5k-7k token prompts |
//! | `ramp` | heterogeneous fleet | load rises from 30% to 100% of `--load` over the first half |
//! | `mixed-memory` | 6 replicas, 2 like A100-40GB next to H100-80GB: half speed *and* a third of the KV cache | long-context mix |
//! | `large` | 24 replicas, a third at half speed | steady, one hour by default |
//! | `tp-mixed` | 6 replicas, 2 tensor-parallel-2 (two GPUs each): 1.7x speed, 2.35x KV | long-context mix |
//! | `mem-only` | 6 replicas of equal speed, 2 with a third of the KV cache | long-context mix |
//! | `slow-drift` | 6 replicas; 0 and 3 slow down step by step to 0.4 over the first 60% of the window | steady |
//! | `shared-backends` | 6 equal replicas; 0, 2 and 4 also serve traffic that does not pass this LB | steady |
//! | `shared-prefix` | 6 equal replicas | groups of requests sharing a long prefix, Zipf-popular ([`super::prompts`]) |
//! | `multi-turn` | 6 equal replicas | chat sessions resending their history, think time between turns |
//! | `region-spill` | 6 equal replicas in two regions (0-2 local, 3-5 remote, 80 ms round trip away); at the middle of the window 0 and 1 slow to a third | steady, `--load` of the local region |
//!
//! `tp-mixed`: tensor parallelism over two GPUs doubles the memory, and the KV cache gets everything
//! the second copy of the weights does not take (2 x 80 GB x 0.9 - 16 GB weights - activations:
//! ~2.35x one GPU's KV), while the speed-up is well below 2x (all-reduce per layer; ~1.7x is a common
//! measurement for an 8B model). It is the fleet where equalizing KV usage overfeeds a replica whose
//! memory grew more than its speed.
//!
//! `slow-drift`: throttling, a noisy neighbour or a growing share of long requests make replicas
//! slower over minutes. 100% load is computed on the speeds the fleet ends with (otherwise the end of
//! the run is overloaded whatever the balancer does); `static-ratio` weights stay at the start.
//!
//! `shared-backends`: another entry point, another cluster or batch clients send requests straight to
//! some replicas (60%, 30% and 15% of replicas 0, 2 and 4's capacity). The servers' metrics show it,
//! this LB's connection counts do not. `--load` is the whole fleet's utilization: this LB's traffic is
//! the rest.
//!
//! `region-spill`: priority pooling's case. The clients and the balancer are in the local region;
//! a request served by the remote region pays a cross-region round trip ([`REGION_RTT_S`], added to
//! its TTFT and end-to-end time). `--load` is a fraction of the *local* region's capacity, so the
//! local region alone is enough until it loses capacity (two of its three replicas slow to a third:
//! a failing node, a noisy neighbour, a rollout). Each balancer runs three ways
//! ([`Tiering`]): `local-only` (the remote region is not in the pool), `flat` (one pool across
//! both regions) and `spill-over` (the controller's priority tiers: remote only while the local
//! tier is saturated).
//!
//! `mixed-memory`'s smaller replicas: an A100-40GB at vLLM's `gpu_memory_utilization=0.9` has 36 GB,
//! minus ~16 GB of Llama-3.1-8B weights and ~3 GB of activations, so ~17 GB of KV = ~130k tokens, a
//! third of the H100 profile's 400k; half the speed as in `heterogeneous` (Lambda's vLLM benchmark:
//! H100 ~2x A100). It is the case where equal in-flight counts are wrong even for least-request:
//! the small replica runs out of KV blocks (and preempts) long before its batch is full.

use serde::Serialize;

use super::workload::{LengthMix, RateShape};
use llm_lc_sim::profile::ModelProfile;

/// Every scenario name, in the order the sweep runs them.
pub const NAMES: &[&str] = &[
    "homogeneous",
    "heterogeneous",
    "degraded",
    "spike",
    "long-context",
    "ramp",
    "mixed-memory",
    "tp-mixed",
    "mem-only",
    "slow-drift",
    "shared-backends",
    "batch-limits",
    "large",
    "region-spill",
    "shared-prefix",
    "multi-turn",
];
/// The scenarios whose requests share prefixes (goals of their own, src/bench/RESULTS.md).
pub const PREFIX: &[&str] = &["shared-prefix", "multi-turn"];
/// The scenarios of the goals grid (`bench --sweep`): every 6-replica scenario.
pub const GRID: &[&str] = &[
    "homogeneous",
    "heterogeneous",
    "degraded",
    "spike",
    "long-context",
    "ramp",
    "mixed-memory",
    "tp-mixed",
    "mem-only",
    "slow-drift",
    "shared-backends",
];

/// One replica's speed changes to `speed` at `at_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SpeedChange {
    pub at_s: f64,
    pub replica: usize,
    pub speed: f64,
}

/// A fully specified scenario (before the load is applied).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Scenario {
    pub name: String,
    /// Speed factor per replica at the start (1 = the profile's GPU).
    pub speeds: Vec<f64>,
    /// Fraction of the profile's KV cache each replica has (1 = as profiled).
    pub kv_scale: Vec<f64>,
    /// Batch limit (vLLM `--max-num-seqs`) of each replica where it is not the profile's; empty:
    /// the profile's everywhere. Published nowhere: the controller sees it only in behaviour.
    pub max_num_seqs: Vec<Option<u32>>,
    pub speed_changes: Vec<SpeedChange>,
    /// Speeds at which 100% load is computed (the start, except where the fleet drifts for good).
    pub rate_speeds: Vec<f64>,
    /// Traffic that reaches each replica without passing this LB, as a fraction of its capacity.
    pub external: Vec<f64>,
    /// Priority tier of each replica (0 = local region) when the scenario has regions; empty
    /// otherwise.
    pub tiers: Vec<usize>,
    /// Round trip added to the TTFT and end-to-end time of requests each replica serves (a replica
    /// in another region); empty = none.
    pub rtt_s: Vec<f64>,
    pub mix: LengthMix,
    pub shape: RateShape,
    pub duration_s: f64,
    pub warmup_s: f64,
}

/// A tensor-parallel-2 replica against one GPU (see the module docs).
pub const TP2_SPEED: f64 = 1.7;
pub const TP2_KV: f64 = 2.35;
/// `slow-drift`: where the drifting replicas end, and how often their speed steps.
pub const DRIFT_TO: f64 = 0.4;
pub const DRIFT_STEP_S: f64 = 15.0;

/// Default measured length of the grid scenarios; with the warm-up a run is 12 virtual minutes.
pub const DEFAULT_DURATION_S: f64 = 720.0;
pub const DEFAULT_WARMUP_S: f64 = 120.0;

/// `batch-limits`: the batch limit of the replicas that have one of their own.
pub const BATCH_LIMIT: u32 = 24;

/// `region-spill`: the round trip between the two regions (e.g. US East to US West is 60-80 ms).
pub const REGION_RTT_S: f64 = 0.08;

/// How a scenario with regions is pooled (`region-spill`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tiering {
    /// One pool of every replica: no tiers (and the only way for scenarios without regions).
    Flat,
    /// Only the local region's replicas are in the pool.
    LocalOnly,
    /// The controller's priority tiers: the remote region gets traffic only while the local one is
    /// saturated (spill at `--spill-at`, back below `--return-below`).
    SpillOver,
}

impl Tiering {
    /// The three ways a scenario with regions is run, in report order.
    pub const ALL: [Tiering; 3] = [Tiering::LocalOnly, Tiering::Flat, Tiering::SpillOver];

    pub fn name(self) -> &'static str {
        match self {
            Tiering::Flat => "flat",
            Tiering::LocalOnly => "local-only",
            Tiering::SpillOver => "spill-over",
        }
    }
}

/// Build scenario `name`. `replicas`, `duration_s` and `warmup_s` override the defaults; event times
/// scale with the measured window.
pub fn build(
    name: &str,
    replicas: Option<usize>,
    duration_s: Option<f64>,
    warmup_s: Option<f64>,
) -> Result<Scenario, String> {
    let (default_n, default_duration) = match name {
        "large" => (24, 3600.0),
        n if NAMES.contains(&n) => (6, DEFAULT_DURATION_S),
        other => {
            return Err(format!("unknown scenario {other:?}; known scenarios: {}", NAMES.join(", ")));
        }
    };
    let n = replicas.unwrap_or(default_n);
    if n == 0 {
        return Err("--replicas must be at least 1".into());
    }
    let duration_s = duration_s.unwrap_or(default_duration);
    let warmup_s = warmup_s.unwrap_or(DEFAULT_WARMUP_S);
    if !(duration_s > warmup_s && warmup_s >= 0.0 && duration_s.is_finite()) {
        return Err(format!(
            "--duration ({duration_s} s) must be finite and longer than --warmup ({warmup_s} s)"
        ));
    }
    let measured = duration_s - warmup_s;
    let mid = warmup_s + measured / 2.0;
    let equal = vec![1.0; n];
    // A third of the fleet at half speed, spread out rather than bunched at the end (2 of 6: 1 and 4).
    let mixed: Vec<f64> = (0..n).map(|i| if i % 3 == 1 { 0.5 } else { 1.0 }).collect();
    let mut s = Scenario {
        name: name.to_string(),
        kv_scale: vec![1.0; n],
        max_num_seqs: vec![],
        speeds: equal,
        speed_changes: vec![],
        rate_speeds: vec![],
        external: vec![0.0; n],
        tiers: vec![],
        rtt_s: vec![],
        mix: LengthMix::Sharegpt,
        shape: RateShape::Constant,
        duration_s,
        warmup_s,
    };
    match name {
        "homogeneous" => {}
        "heterogeneous" | "large" => s.speeds = mixed,
        "degraded" => s.speed_changes = vec![SpeedChange { at_s: mid, replica: 0, speed: 1.0 / 3.0 }],
        "spike" => {
            let len = 60.0_f64.min(measured / 4.0);
            s.shape = RateShape::Spike { start_s: mid, end_s: mid + len, factor: 2.0 };
        }
        "long-context" => s.mix = LengthMix::LongContext,
        "ramp" => {
            s.speeds = mixed;
            s.shape = RateShape::Ramp { start_s: warmup_s, end_s: mid, from: 0.3, to: 1.0 };
        }
        "mixed-memory" => {
            s.speeds = mixed;
            s.kv_scale = (0..n).map(|i| if i % 3 == 1 { 1.0 / 3.0 } else { 1.0 }).collect();
            s.mix = LengthMix::LongContext;
        }
        "tp-mixed" => {
            s.speeds = (0..n).map(|i| if i % 3 == 1 { TP2_SPEED } else { 1.0 }).collect();
            s.kv_scale = (0..n).map(|i| if i % 3 == 1 { TP2_KV } else { 1.0 }).collect();
            s.mix = LengthMix::LongContext;
        }
        "mem-only" => {
            s.kv_scale = (0..n).map(|i| if i % 3 == 1 { 1.0 / 3.0 } else { 1.0 }).collect();
            s.mix = LengthMix::LongContext;
        }
        "slow-drift" => {
            // Steps of DRIFT_STEP_S from the end of the warm-up to 60% of the window.
            let end = warmup_s + 0.6 * measured;
            let steps = ((end - warmup_s) / DRIFT_STEP_S).floor().max(1.0) as usize;
            for r in (0..n).filter(|r| r % 3 == 0) {
                for k in 1..=steps {
                    let f = k as f64 / steps as f64;
                    let speed = 1.0 + f * (DRIFT_TO - 1.0);
                    s.speed_changes.push(SpeedChange {
                        at_s: warmup_s + k as f64 * DRIFT_STEP_S,
                        replica: r,
                        speed,
                    });
                }
            }
            s.rate_speeds = (0..n).map(|r| if r % 3 == 0 { DRIFT_TO } else { 1.0 }).collect();
        }
        "shared-backends" => {
            s.external = (0..n).map(|i| [0.6, 0.0, 0.3, 0.0, 0.15, 0.0][i % 6]).collect();
        }
        "batch-limits" => {
            // What the seed demo is about, on the model of real vLLM: replicas that differ in a
            // limit no metric publishes. 1 and 4 run at most BATCH_LIMIT requests at once (a
            // latency-tuned `--max-num-seqs`), 2 and 5 are slower with half the memory.
            s.max_num_seqs = (0..n).map(|i| (i % 3 == 1).then_some(BATCH_LIMIT)).collect();
            s.speeds = (0..n).map(|i| if i % 3 == 2 { 0.6 } else { 1.0 }).collect();
            s.kv_scale = (0..n).map(|i| if i % 3 == 2 { 0.5 } else { 1.0 }).collect();
        }
        "shared-prefix" => s.mix = LengthMix::SharedPrefix,
        "multi-turn" => s.mix = LengthMix::MultiTurn,
        "region-spill" if n < 2 => return Err("region-spill needs at least 2 replicas (two regions)".into()),
        "region-spill" => {
            // The first half of the replicas is local (at least one), the rest remote.
            let local = n.div_ceil(2);
            s.tiers = (0..n).map(|r| usize::from(r >= local)).collect();
            s.rtt_s = s.tiers.iter().map(|&t| if t == 0 { 0.0 } else { REGION_RTT_S }).collect();
            // 100% load is the local region's capacity; it then loses all but a third of two of
            // its replicas (one, with a single local replica).
            s.rate_speeds = s.tiers.iter().map(|&t| if t == 0 { 1.0 } else { 0.0 }).collect();
            s.speed_changes = (0..local.min(2))
                .map(|replica| SpeedChange { at_s: mid, replica, speed: 1.0 / 3.0 })
                .collect();
        }
        _ => unreachable!("checked above"),
    }
    if s.rate_speeds.is_empty() {
        s.rate_speeds = s.speeds.clone();
    }
    Ok(s)
}

/// The profile of a replica with `kv_scale` of the base profile's KV blocks and, where given, its
/// own batch limit.
pub fn replica_profile(base: &ModelProfile, kv_scale: f64, max_num_seqs: Option<u32>) -> ModelProfile {
    let mut p = base.clone();
    if kv_scale != 1.0 {
        p.num_gpu_blocks = ((base.num_gpu_blocks as f64) * kv_scale).round().max(1.0) as u32;
        p.name = format!("{}-kv{:.2}", p.name, kv_scale);
    }
    if let Some(seqs) = max_num_seqs.filter(|&m| m != base.max_num_seqs) {
        p.max_num_seqs = seqs.max(1);
        p.name = format!("{}-seqs{seqs}", p.name);
    }
    p
}

impl Scenario {
    /// Replica `r`'s own batch limit, if it has one.
    pub fn max_num_seqs_of(&self, r: usize) -> Option<u32> {
        self.max_num_seqs.get(r).copied().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_builds_and_unknown_lists_names() {
        for n in NAMES {
            let s = build(n, None, None, None).unwrap();
            assert_eq!(s.name, *n);
        }
        let e = build("nope", None, None, None).unwrap_err();
        assert!(e.contains("heterogeneous"), "{e}");
        assert!(build("homogeneous", None, Some(10.0), Some(20.0)).is_err());
    }

    #[test]
    fn heterogeneous_has_two_half_speed_replicas_of_six() {
        let s = build("heterogeneous", None, None, None).unwrap();
        assert_eq!(s.speeds, vec![1.0, 0.5, 1.0, 1.0, 0.5, 1.0]);
        let l = build("large", None, None, None).unwrap();
        assert_eq!(l.speeds.len(), 24);
        assert_eq!(l.speeds.iter().filter(|&&x| x == 0.5).count(), 8);
    }

    #[test]
    fn mixed_memory_replicas_are_slower_and_smaller() {
        let s = build("mixed-memory", None, None, None).unwrap();
        assert_eq!(s.kv_scale[1], 1.0 / 3.0);
        assert_eq!(s.speeds[1], 0.5);
        let base = ModelProfile::llama_8b_h100();
        let small = replica_profile(&base, s.kv_scale[1], None);
        assert_eq!(small.num_gpu_blocks, 8333);
        small.validate().unwrap();
        assert_eq!(replica_profile(&base, 1.0, None), base);
        let limited = replica_profile(&base, 1.0, Some(BATCH_LIMIT));
        assert_eq!((limited.max_num_seqs, limited.num_gpu_blocks), (BATCH_LIMIT, base.num_gpu_blocks));
        let b = build("batch-limits", None, None, None).unwrap();
        assert_eq!(b.max_num_seqs_of(1), Some(BATCH_LIMIT));
        assert_eq!(b.max_num_seqs_of(0), None);
    }

    #[test]
    fn new_scenarios_have_the_fleets_they_claim() {
        let tp = build("tp-mixed", None, None, None).unwrap();
        assert_eq!((tp.speeds[1], tp.kv_scale[1], tp.speeds[0], tp.kv_scale[0]), (1.7, 2.35, 1.0, 1.0));
        let mem = build("mem-only", None, None, None).unwrap();
        assert!(mem.speeds.iter().all(|&v| v == 1.0));
        assert_eq!(mem.kv_scale.iter().filter(|&&k| k < 0.34).count(), 2);
        let drift = build("slow-drift", None, None, None).unwrap();
        let last = drift.speed_changes.iter().rfind(|c| c.replica == 0).unwrap();
        assert!((last.speed - DRIFT_TO).abs() < 1e-9 && last.at_s <= drift.warmup_s + 0.6 * 720.0);
        // Monotone, gradual: no step bigger than a tenth of the way.
        let r0: Vec<f64> = drift.speed_changes.iter().filter(|c| c.replica == 0).map(|c| c.speed).collect();
        assert!(r0.windows(2).all(|w| w[1] < w[0] && w[0] - w[1] < 0.1), "{r0:?}");
        assert_eq!(drift.rate_speeds[0], DRIFT_TO);
        assert_eq!(drift.speeds[0], 1.0);
        let shared = build("shared-backends", None, None, None).unwrap();
        assert_eq!(shared.external, vec![0.6, 0.0, 0.3, 0.0, 0.15, 0.0]);
        assert!(GRID.iter().all(|g| NAMES.contains(g)));
    }

    #[test]
    fn region_spill_has_a_local_and_a_remote_region() {
        let s = build("region-spill", None, None, None).unwrap();
        assert_eq!(s.tiers, vec![0, 0, 0, 1, 1, 1]);
        assert_eq!(s.rtt_s, vec![0.0, 0.0, 0.0, REGION_RTT_S, REGION_RTT_S, REGION_RTT_S]);
        assert_eq!(s.rate_speeds, vec![1.0, 1.0, 1.0, 0.0, 0.0, 0.0], "load is the local region's");
        let mid = s.warmup_s + (s.duration_s - s.warmup_s) / 2.0;
        let lost: Vec<usize> = s.speed_changes.iter().map(|c| c.replica).collect();
        assert_eq!(lost, vec![0, 1]);
        assert!(s.speed_changes.iter().all(|c| c.at_s == mid && c.speed < 0.34));
        assert!(!GRID.contains(&"region-spill"), "not part of the goals grid");
        assert!(build("region-spill", Some(1), None, None).unwrap_err().contains("at least 2"));
        assert_eq!(Tiering::ALL.map(Tiering::name), ["local-only", "flat", "spill-over"]);
    }
}
