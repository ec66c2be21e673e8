//! Property and convergence tests shared by the load-equalizing policies (`capacity`, which does not
//! equalize load, has its own tests in its module).

use std::time::Duration;

use llm_lc_adapters::{MemberId, Ratios};
use proptest::prelude::*;

use super::testutil::{ratios, sample, snap};
use super::*;
use crate::source::Snapshot;

const RANGE: RatioRange = RatioRange { min: 1, max: 100 };

fn policies() -> Vec<PolicyConfig> {
    vec![PolicyConfig::Headroom(Default::default()), PolicyConfig::Feedback(Default::default())]
}

fn new_policy(cfg: &PolicyConfig) -> PoolPolicy {
    PoolPolicy::new(cfg, RANGE, Duration::from_secs(30), Duration::from_secs(15), Duration::from_secs(5))
}

fn arb_sample() -> impl Strategy<Value = Option<Sample>> {
    prop_oneof![
        1 => Just(None),
        6 => (0.0f64..50.0, 0.0f64..256.0, 0.0f64..=1.0, 0u64..60).prop_map(|(w, r, kv, age)| {
            let mut s = sample(w.floor(), r.floor(), kv);
            s.age = Duration::from_secs(age);
            Some(s)
        }),
    ]
}

fn arb_snapshot() -> impl Strategy<Value = Snapshot> {
    proptest::collection::vec(arb_sample(), 1..8).prop_map(|v| Snapshot {
        members: v
            .into_iter()
            .enumerate()
            .map(|(i, s)| (MemberId::new(format!("10.0.0.{i}:8000")), s))
            .collect(),
        rejected: vec![],
        failures: vec![],
        labels: Default::default(),
    })
}

fn arb_prev() -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(0u32..200, 0..8)
}

fn prev_for(snap: &Snapshot, v: &[u32]) -> Ratios {
    snap.members.keys().zip(v.iter()).map(|(m, r)| (m.clone(), *r)).collect()
}

proptest! {
    #[test]
    fn ratios_stay_in_range_over_many_cycles(snaps in proptest::collection::vec(arb_snapshot(), 1..6), prev in arb_prev()) {
        for cfg in policies() {
            let mut p = new_policy(&cfg);
            let mut last = prev_for(&snaps[0], &prev);
            for s in &snaps {
                let o = p.compute(s, &last);
                prop_assert_eq!(o.ratios.len(), s.members.len());
                for (_, r) in o.ratios.iter() {
                    prop_assert!((RANGE.min..=RANGE.max).contains(&r), "{} out of range", r);
                }
                last = o.ratios;
            }
        }
    }

    #[test]
    fn equal_loads_give_equal_ratios(n in 2usize..8, w in 0.0f64..20.0, r in 0.0f64..100.0, kv in 0.0f64..=1.0, start in 1u32..=100) {
        for cfg in policies() {
            let mut p = new_policy(&cfg);
            let s = Snapshot {
                members: (0..n).map(|i| (MemberId::new(format!("m{i}:1")), Some(sample(w, r, kv)))).collect(),
                rejected: vec![],
 failures: vec![],
 labels: Default::default(),
            };
            let prev: Ratios = s.members.keys().map(|m| (m.clone(), start)).collect();
            let o = p.compute(&s, &prev);
            let first = o.ratios.iter().next().map(|(_, r)| r);
            prop_assert!(o.ratios.iter().all(|(_, r)| Some(r) == first), "{:?}", o.ratios);
        }
    }

    #[test]
    fn more_load_never_gets_a_higher_ratio(
        loads in proptest::collection::vec((0.0f64..30.0, 0.0f64..=1.0), 2..8),
        start in 1u32..=100,
        cycles in 1usize..4,
    ) {
        for cfg in policies() {
            let mut p = new_policy(&cfg);
            let s = Snapshot {
                members: loads.iter().enumerate().map(|(i, (w, kv))| (MemberId::new(format!("m{i}:1")), Some(sample(w.floor(), 8.0, *kv)))).collect(),
                rejected: vec![],
 failures: vec![],
 labels: Default::default(),
            };
            // The same previous state for everyone, then the same loads for a few cycles.
            let mut prev: Ratios = s.members.keys().map(|m| (m.clone(), start)).collect();
            for _ in 0..cycles {
                prev = p.compute(&s, &prev).ratios;
            }
            // "Load" as this policy measures it.
            let (qn, rn) = match &cfg {
                PolicyConfig::Headroom(h) => (h.queue_norm, h.running_norm),
                PolicyConfig::Feedback(f) => (f.queue_norm, f.running_norm),
                PolicyConfig::Capacity(c) => (capacity::SATURATION_QUEUE_NORM, c.running_norm),
            };
            let members: Vec<_> = s.members.iter().collect();
            for (a, sa) in &members {
                for (b, sb) in &members {
                    let (sa, sb) = (sa.as_ref().expect("sample"), sb.as_ref().expect("sample"));
                    let la = load(sa, qn, rn);
                    let lb = load(sb, qn, rn);
                    if la > lb {
                        prop_assert!(prev.get(a) <= prev.get(b), "{}: load {} ratio {:?} > {}: load {} ratio {:?}", a, la, prev.get(a), b, lb, prev.get(b));
                    }
                }
            }
        }
    }

    #[test]
    fn all_idle_gives_equal_ratios(n in 2usize..8, prev in arb_prev()) {
        for cfg in policies() {
            let mut p = new_policy(&cfg);
            let s = Snapshot {
                members: (0..n).map(|i| (MemberId::new(format!("m{i}:1")), Some(sample(0.0, 0.0, 0.0)))).collect(),
                rejected: vec![],
 failures: vec![],
 labels: Default::default(),
            };
            let o = p.compute(&s, &prev_for(&s, &prev));
            let first = o.ratios.iter().next().map(|(_, r)| r);
            prop_assert!(o.ratios.iter().all(|(_, r)| Some(r) == first), "{:?}", o.ratios);
        }
    }

    #[test]
    fn same_inputs_same_outputs(snaps in proptest::collection::vec(arb_snapshot(), 1..5), prev in arb_prev()) {
        for cfg in policies() {
            let (mut a, mut b) = (new_policy(&cfg), new_policy(&cfg));
            let mut pa = prev_for(&snaps[0], &prev);
            let mut pb = pa.clone();
            for s in &snaps {
                let (oa, ob) = (a.compute(s, &pa), b.compute(s, &pb));
                prop_assert_eq!(&oa, &ob);
                pa = oa.ratios;
                pb = ob.ratios;
            }
        }
    }
}

/// Two servers, one at half speed, fed by a weighted balancer: each server's KV usage grows with its
/// share of the traffic divided by its speed. The feedback policy must settle near a 2:1 split and
/// stay there; headroom, being memoryless, cannot hold any split and flips.
#[test]
fn feedback_converges_to_capacity_proportional_shares() {
    let mut p = new_policy(&PolicyConfig::Feedback(Default::default()));
    let speeds = [("fast:1", 1.0), ("slow:1", 0.5)];
    let mut prev = ratios(&[("fast:1", 50), ("slow:1", 50)]);
    let offered = 0.7; // fleet at 70% of its capacity
    let mut history = Vec::new();
    for _ in 0..40 {
        let total: f64 = prev.iter().map(|(_, r)| r as f64).sum();
        let members: Vec<(&str, Option<Sample>)> = speeds
            .iter()
            .map(|(m, speed)| {
                let share = prev.get(&MemberId::from(*m)).unwrap_or(1) as f64 / total;
                // Load relative to what this server can carry; 1.5 = total capacity in fast units.
                let kv = (offered * 1.5 * share / speed).min(1.0);
                (*m, Some(sample(0.0, 10.0, kv)))
            })
            .collect();
        prev = p.compute(&snap(&members), &prev).ratios;
        history.push(prev.clone());
    }
    let last = history.last().expect("ran");
    let fast = last.get(&MemberId::from("fast:1")).expect("fast") as f64;
    let slow = last.get(&MemberId::from("slow:1")).expect("slow") as f64;
    assert!((fast / slow - 2.0).abs() < 0.25, "fast {fast} slow {slow}");
    // Settled: integer ratios cannot hit 2:1 exactly, so the last ten cycles may only dither by a
    // couple of points, and most of them push nothing (the deadband keeps the LB API quiet).
    let tail = &history[30..];
    for w in tail.windows(2) {
        for (m, r) in w[1].iter() {
            let before = w[0].get(m).expect("same members");
            assert!(r.abs_diff(before) <= 3, "{m}: {before} -> {r} in {tail:?}");
        }
    }
    let quiet = tail.windows(2).filter(|w| w[0] == w[1]).count();
    assert!(quiet >= 5, "only {quiet} of 9 cycles were quiet: {tail:?}");
}

/// Behind least-connections both servers hold the same number of requests and show the same KV
/// usage; only the processing time reveals the slow one, and it must end with the lower ratio.
#[test]
fn feedback_uses_processing_time_to_find_the_slow_server() {
    let params = feedback::FeedbackParams { latency_weight: 1.0, gain: 0.5, ..Default::default() };
    let mut p = new_policy(&PolicyConfig::Feedback(params.clone()));
    let mut prev = Ratios::default();
    for _ in 0..10 {
        let mut fast = sample(0.0, 8.0, 0.4);
        fast.latency = Some(2.0);
        let mut slow = sample(0.0, 8.0, 0.4);
        slow.latency = Some(5.0);
        prev = p.compute(&snap(&[("fast:1", Some(fast)), ("slow:1", Some(slow))]), &prev).ratios;
    }
    let fast = prev.get(&MemberId::from("fast:1")).expect("fast");
    let slow = prev.get(&MemberId::from("slow:1")).expect("slow");
    assert!(slow * 3 < fast * 2, "fast {fast} slow {slow}");

    // Without processing times on every member, it is ignored: equal loads stay equal.
    let mut p = new_policy(&PolicyConfig::Feedback(params));
    let mut one = sample(0.0, 8.0, 0.4);
    one.latency = Some(5.0);
    let o = p.compute(&snap(&[("a:1", Some(one)), ("b:1", Some(sample(0.0, 8.0, 0.4)))]), &Ratios::default());
    assert_eq!(o.ratios.get(&MemberId::from("a:1")), o.ratios.get(&MemberId::from("b:1")));
}
