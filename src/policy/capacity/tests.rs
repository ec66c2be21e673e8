//! The `capacity` policy's behaviour, one test per rule, and one per special case of the code.

use std::time::Duration;

use super::estimate::PLATEAU;
use super::*;
use crate::policy::testutil::{self, snap};
use crate::policy::{PolicyConfig, PoolPolicy};
use crate::ratio::RatioRange;

fn policy(mode: Mode) -> PoolPolicy {
    PoolPolicy::new(
        &PolicyConfig::Capacity(CapacityParams { mode, ..Default::default() }),
        RatioRange { min: 1, max: 100 },
        Duration::from_secs(60),
        Duration::from_secs(30),
        Duration::from_secs(5),
    )
}

fn s(waiting: f64, running: f64, kv: f64, latency: f64) -> Option<Sample> {
    Some(Sample { latency: Some(latency), ..testutil::sample(waiting, running, kv) })
}

fn ratios(
    p: &mut PoolPolicy,
    members: &[(&str, Option<Sample>)],
    prev: &mut llm_lc_adapters::Ratios,
) -> Vec<u32> {
    *prev = p.compute(&snap(members), prev).ratios;
    members.iter().map(|(m, _)| prev.get(&llm_lc_adapters::MemberId::from(*m)).unwrap_or(0)).collect()
}

#[test]
fn round_robin_mode_follows_a_slowdown_to_a_third_within_three_cycles_and_holds() {
    // Memory over half full: the slowed server's queue is not read as its batch limit (`ROOMY`).
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let even = [
        ("a:1", s(0.0, 100.0, 0.6, 10.0)),
        ("b:1", s(0.0, 100.0, 0.6, 10.0)),
        ("c:1", s(0.0, 100.0, 0.6, 10.0)),
    ];
    for _ in 0..3 {
        let r = ratios(&mut p, &even, &mut prev);
        assert_eq!(r[0], r[1]);
    }
    // `a` slows to a third: each request takes three times as long, a queue forms, then drains
    // once its share is cut.
    // The latency the server reports is end to end: 30 s of service plus the queue's wait.
    let slow = |w: f64| s(w, 100.0, 0.6, 30.0 + w * 30.0 / 100.0);
    let fast = || s(0.0, 100.0, 0.6, 10.0);
    let phases = [
        [("a:1", slow(30.0)), ("b:1", fast()), ("c:1", fast())],
        [("a:1", slow(10.0)), ("b:1", fast()), ("c:1", fast())],
        [("a:1", slow(0.0)), ("b:1", fast()), ("c:1", fast())],
    ];
    let mut last = vec![];
    for (cycle, members) in phases.iter().enumerate() {
        last = ratios(&mut p, members, &mut prev);
        // While it queues it gets less than its new capacity share, never nothing.
        assert!(last[0] >= 1 && last[0] < last[1], "cycle {cycle}: {last:?}");
    }
    let share = f64::from(last[0]) / f64::from(last[1]);
    assert!((0.28..=0.40).contains(&share), "after 3 cycles a third of the others: {last:?}");
    // Steady inputs: no oscillation, not even by one.
    for _ in 0..10 {
        assert_eq!(ratios(&mut p, &phases[2], &mut prev), last);
    }
}

/// A sample with vLLM's time running (`service`) besides the end-to-end latency.
fn timed(waiting: f64, kv: f64, latency: f64, service: f64) -> Option<Sample> {
    s(waiting, 100.0, kv, latency).map(|x| Sample { service: Some(service), ..x })
}

#[test]
fn the_time_running_is_the_service_time_whether_the_server_queues_or_not() {
    // Memory over half full: the slowed server's queue is not read as its batch limit (`ROOMY`).
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let even = [
        ("a:1", timed(0.0, 0.6, 10.0, 10.0)),
        ("b:1", timed(0.0, 0.6, 10.0, 10.0)),
        ("c:1", timed(0.0, 0.6, 10.0, 10.0)),
    ];
    for _ in 0..3 {
        ratios(&mut p, &even, &mut prev);
    }
    // `a` slows to a third. Its end-to-end times carry a minute of queueing on top; the time
    // running says 30 s, which is taken at once (a slowdown) and not shrunk by the queue.
    let fast = || timed(0.0, 0.6, 10.0, 10.0);
    let phases = [
        [("a:1", timed(30.0, 0.6, 90.0, 30.0)), ("b:1", fast()), ("c:1", fast())],
        [("a:1", timed(10.0, 0.6, 70.0, 30.0)), ("b:1", fast()), ("c:1", fast())],
        [("a:1", timed(0.0, 0.6, 50.0, 30.0)), ("b:1", fast()), ("c:1", fast())],
    ];
    let mut last = vec![];
    for members in &phases {
        last = ratios(&mut p, members, &mut prev);
    }
    let share = f64::from(last[0]) / f64::from(last[1]);
    assert!((0.28..=0.40).contains(&share), "a third of the others after 3 cycles: {last:?}");
    for _ in 0..10 {
        assert_eq!(ratios(&mut p, &phases[2], &mut prev), last, "and it holds");
    }
}

/// A sample with vLLM's queue time (`vllm:request_queue_time_seconds`) besides the
/// end-to-end latency, and no time running.
fn waited(waiting: f64, latency: f64, queue_time: f64) -> Option<Sample> {
    s(waiting, 100.0, 0.6, latency).map(|x| Sample { queue_time: Some(queue_time), ..x })
}

#[test]
fn the_queue_time_is_taken_out_of_the_latency_after_a_backlog() {
    // `a` had a backlog that has drained: nothing waits now, but the latency window still holds
    // the minute its requests waited. Its speed never changed (10 s running); with the queue
    // time known, its share comes back at once instead of after the window has rolled over.
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let calm = || waited(0.0, 10.0, 0.0);
    for _ in 0..3 {
        ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
    }
    let even = ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
    let drained = [("a:1", waited(0.0, 40.0, 30.0)), ("b:1", calm()), ("c:1", calm())];
    for cycle in 0..3 {
        let r = ratios(&mut p, &drained, &mut prev);
        assert!(r[0] + 1 >= r[1], "cycle {cycle}: {r:?}, even {even:?}");
    }
    // Without the queue time the same latency reads as a server four times slower.
    let mut blind = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let plain = |l: f64| s(0.0, 100.0, 0.4, l);
    for _ in 0..3 {
        ratios(&mut blind, &[("a:1", plain(10.0)), ("b:1", plain(10.0)), ("c:1", plain(10.0))], &mut prev);
    }
    let mut r = vec![];
    for _ in 0..3 {
        r = ratios(
            &mut blind,
            &[("a:1", plain(40.0)), ("b:1", plain(10.0)), ("c:1", plain(10.0))],
            &mut prev,
        );
    }
    assert!(f64::from(r[0]) <= 0.9 * f64::from(r[1]), "the latency alone cuts it: {r:?}");
}

#[test]
fn a_slowdown_shows_through_the_queue_time_on_a_queued_server() {
    // `a` slows to a third and queues: latency 90 s of which 60 s waiting. Running time is
    // 30 s, believed at once as a slowdown, as with vLLM's own time-running histogram.
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let calm = || waited(0.0, 10.0, 0.0);
    for _ in 0..3 {
        ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
    }
    let mut last = vec![];
    for _ in 0..3 {
        last =
            ratios(&mut p, &[("a:1", waited(10.0, 90.0, 60.0)), ("b:1", calm()), ("c:1", calm())], &mut prev);
    }
    let share = f64::from(last[0]) / f64::from(last[1]);
    assert!(share <= 0.40, "a third of the others or less while it queues: {last:?}");
}

#[test]
fn a_missing_time_running_does_not_let_the_queue_into_the_service_time() {
    // `a` queues; its time running is unchanged, but one cycle it is missing (an optional
    // query failed, the series is late) and only the end-to-end latency, 4x longer because of
    // the queue's waits, arrives. That is not a slowdown: `a` keeps its share.
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let calm = || timed(0.0, 0.4, 10.0, 10.0);
    for _ in 0..3 {
        ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
    }
    let queued = || timed(3.0, 0.6, 40.0, 10.0);
    let without_running = queued().map(|x| Sample { service: None, ..x });
    let r0 = ratios(&mut p, &[("a:1", queued()), ("b:1", calm()), ("c:1", calm())], &mut prev);
    ratios(&mut p, &[("a:1", without_running), ("b:1", calm()), ("c:1", calm())], &mut prev);
    let r = ratios(&mut p, &[("a:1", queued()), ("b:1", calm()), ("c:1", calm())], &mut prev);
    assert!(f64::from(r[0]) >= 0.9 * f64::from(r0[0]), "before {r0:?}, after {r:?}");
}

#[test]
fn long_running_times_on_a_memory_bound_server_are_not_a_slowdown() {
    // `a` is full (KV 95%) and queues: it preempts and recomputes, so its requests run 1.6x
    // longer for a while. That is load, not lost speed: the estimate moves by smoothing only,
    // and once the pressure is gone `a` is back at an equal share.
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let calm = |kv: f64| timed(0.0, kv, 10.0, 10.0);
    for _ in 0..3 {
        ratios(&mut p, &[("a:1", calm(0.4)), ("b:1", calm(0.4)), ("c:1", calm(0.4))], &mut prev);
    }
    for _ in 0..3 {
        ratios(
            &mut p,
            &[("a:1", timed(5.0, 0.95, 40.0, 16.0)), ("b:1", calm(0.4)), ("c:1", calm(0.4))],
            &mut prev,
        );
    }
    let r = ratios(&mut p, &[("a:1", calm(0.4)), ("b:1", calm(0.4)), ("c:1", calm(0.4))], &mut prev);
    let share = f64::from(r[0]) / f64::from(r[1]);
    assert!(share > 0.8, "no jump to 1.6x the service time: {r:?}");
}

#[test]
fn a_server_just_out_of_memory_pressure_is_not_taken_for_slowed_down() {
    // `a` was full and preempting; its KV usage has just dropped to 80% but the times of the
    // last minute still carry the recomputes (1.6x) while it works off a queue. Not a slowdown
    // for the minute after it was full; the same reading a minute later is one.
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let calm = || timed(0.0, 0.4, 10.0, 10.0);
    for _ in 0..3 {
        ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
    }
    ratios(&mut p, &[("a:1", timed(5.0, 0.95, 40.0, 10.0)), ("b:1", calm()), ("c:1", calm())], &mut prev);
    let share = |r: &[u32]| f64::from(r[0]) / f64::from(r[1]);
    let slower = || timed(2.0, 0.8, 40.0, 16.0);
    let r = ratios(&mut p, &[("a:1", slower()), ("b:1", calm()), ("c:1", calm())], &mut prev);
    assert!(share(&r) > 0.75, "just out of memory pressure: {r:?}");
    // Twelve 5 s cycles without memory pressure: the echo is over, the slowdown is believed.
    for _ in 0..12 {
        ratios(&mut p, &[("a:1", timed(0.0, 0.4, 10.0, 10.0)), ("b:1", calm()), ("c:1", calm())], &mut prev);
    }
    let r = ratios(&mut p, &[("a:1", slower()), ("b:1", calm()), ("c:1", calm())], &mut prev);
    assert!(share(&r) < 0.7, "a minute later the same reading is a slowdown: {r:?}");
}

#[test]
fn the_trim_moves_per_second_of_readings_not_per_reading() {
    // `a` is at 90% utilization, the others at 30% (traffic this LB does not see). Fifteen
    // direct scrapes a second apart must move the trim about as far as one Prometheus reading
    // 15 s apart; counted per reading they would move it fifteen times as far.
    let members = [
        ("a:1", s(0.0, 90.0, 0.9, 10.0)),
        ("b:1", s(0.0, 30.0, 0.3, 10.0)),
        ("c:1", s(0.0, 30.0, 0.3, 10.0)),
    ];
    let share_after = |interval: u64, cycles: usize| {
        let mut p = PoolPolicy::new(
            &PolicyConfig::Capacity(CapacityParams::default()),
            RatioRange { min: 1, max: 100 },
            Duration::from_secs(60),
            Duration::from_secs(30),
            Duration::from_secs(interval),
        );
        let mut prev = Default::default();
        let mut r = vec![];
        for _ in 0..cycles {
            r = ratios(&mut p, &members, &mut prev);
        }
        f64::from(r[0]) / f64::from(r[1])
    };
    // Same memory per request, so without a trim the shares are equal.
    let prometheus = share_after(15, 1);
    let direct = share_after(1, 15);
    assert!((0.75..0.9).contains(&prometheus), "one 15 s reading: {prometheus}");
    assert!((0.75..0.95).contains(&direct), "fifteen 1 s readings: {direct} (one 15 s: {prometheus})");
}

#[test]
fn least_connections_mode_gives_capacity_in_requests_not_equal_kv() {
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    // Same running count, `c` has a third of the memory (three times the usage); `b` is faster
    // (latency) but least-connections handles speed itself, so speed must not count.
    let members =
        [("a:1", s(0.0, 60.0, 0.3, 10.0)), ("b:1", s(0.0, 60.0, 0.3, 5.0)), ("c:1", s(0.0, 60.0, 0.9, 10.0))];
    let r = ratios(&mut p, &members, &mut prev);
    assert_eq!(r[0], r[1], "{r:?}");
    let share = f64::from(r[2]) / f64::from(r[0]);
    // A third of the memory, a third of the ratio; the trim's first step (c is the fullest
    // member, at 0.9 against 0.3) takes up to a fifth more off.
    assert!((0.26..0.4).contains(&share), "a third of the memory, about a third of the ratio: {r:?}");
    // A big-memory replica is capped at the batch limit, not given 2.35x the requests.
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let tp = [("a:1", s(0.0, 200.0, 0.7, 10.0)), ("tp:1", s(0.0, 200.0, 0.3, 6.0))];
    let r = ratios(&mut p, &tp, &mut prev);
    assert!(r[1] as f64 <= r[0] as f64 * 1.35, "batch limit binds the TP-2 replica: {r:?}");
}

#[test]
fn a_draining_backlog_gets_its_share_back_as_it_drains() {
    // Weighted round robin (least-connections sees the queued requests itself): `a` has the same
    // speed but a backlog, which it drains at its own pace.
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let mut seen = vec![];
    for waiting in [80.0, 60.0, 40.0, 20.0, 0.0, 0.0] {
        let members = [
            ("a:1", s(waiting, 100.0, 0.9, 10.0 + waiting * 10.0 / 100.0)),
            ("b:1", s(0.0, 100.0, 0.9, 10.0)),
            ("c:1", s(0.0, 100.0, 0.9, 10.0)),
        ];
        let r = ratios(&mut p, &members, &mut prev);
        seen.push(f64::from(r[0]) / f64::from(r[1]));
    }
    assert!(seen.windows(2).all(|w| w[1] >= w[0]), "share only grows while the backlog drains: {seen:?}");
    assert!(seen[0] < 0.3, "a long backlog cuts the share: {seen:?}");
    assert!(*seen.last().unwrap_or(&0.0) > 0.8, "drained: back near an equal share: {seen:?}");
}

#[test]
fn traffic_from_outside_the_lb_is_trimmed_away_slowly_and_boundedly() {
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    // `a` holds twice the requests of the others at the same memory per request (external load).
    let members = [
        ("a:1", s(0.0, 200.0, 0.8, 10.0)),
        ("b:1", s(0.0, 100.0, 0.4, 10.0)),
        ("c:1", s(0.0, 100.0, 0.4, 10.0)),
    ];
    let mut last = ratios(&mut p, &members, &mut prev);
    for _ in 0..60 {
        let r = ratios(&mut p, &members, &mut prev);
        assert!(r[0] <= last[0], "monotone: {r:?} after {last:?}");
        last = r;
    }
    let share = f64::from(last[0]) / f64::from(last[1]);
    assert!((1.0 / 16.0 - 0.02..0.7).contains(&share), "trimmed, within trim_max^2: {last:?}");
}

#[test]
fn the_trim_integrates_each_reading_once_whatever_its_age_jitter() {
    let params = CapacityParams::default();
    let c = estimate::Estimator { params: &params, interval: Duration::from_secs(5) };
    let ms = Duration::from_millis;
    // Direct scrapes: a new reading every cycle, ages of a few ms that jitter either way.
    assert!(c.is_new(Some(ms(3)), ms(4)) && c.is_new(Some(ms(4)), ms(2)));
    // Prometheus every 15 s, a cycle every 5 s: the same reading 5 s older, twice, then a new one.
    assert!(!c.is_new(Some(ms(1_000)), ms(6_000)) && !c.is_new(Some(ms(6_000)), ms(11_000)));
    assert!(c.is_new(Some(ms(11_000)), ms(1_200)));
    // A late cycle makes a repeat older still, never new; the first reading is new.
    assert!(!c.is_new(Some(ms(1_000)), ms(9_000)) && c.is_new(None, ms(9_000)));
}

/// The three servers of issue 25: free room, a short queue, a long queue on a full cache.
fn loaded_trio(service: Option<f64>) -> [(&'static str, Option<Sample>); 3] {
    let with = |w: f64, r: f64, kv: f64| {
        Some(Sample { waiting: w, running: r, kv_usage: Some(kv), latency: None, service, ..base() })
    };
    [("a:1", with(0.0, 4.0, 0.10)), ("b:1", with(2.0, 30.0, 0.55)), ("c:1", with(12.0, 60.0, 0.95))]
}

fn base() -> Sample {
    Sample { kv_usage: None, ..testutil::sample(0.0, 0.0, 0.0) }
}

#[test]
fn a_visible_queue_ranks_below_free_room_on_the_first_cycle_in_every_mode() {
    for mode in [Mode::LeastConnections, Mode::RoundRobin] {
        for service in [None, Some(2.0)] {
            let mut p = policy(mode);
            let mut prev = Default::default();
            let r = ratios(&mut p, &loaded_trio(service), &mut prev);
            assert!(r[0] > r[1] && r[1] > r[2], "{mode:?}, service {service:?}: {r:?}");
            // And while the load stays, so does the order (a minute of 5 s cycles).
            for cycle in 0..12 {
                let r = ratios(&mut p, &loaded_trio(service), &mut prev);
                assert!(r[0] > r[1] && r[1] > r[2], "{mode:?}, {service:?}, cycle {cycle}: {r:?}");
            }
        }
    }
}

#[test]
fn a_queue_beside_an_idle_member_is_cut_until_the_idle_one_has_half_as_much_again() {
    // Same servers; `a` is kept full and queued by traffic that does not pass this LB, `b` idles.
    for mode in [Mode::LeastConnections, Mode::RoundRobin] {
        let mut p = policy(mode);
        let mut prev = Default::default();
        let members = [
            ("a:1", Some(Sample { waiting: 3.0, running: 40.0, kv_usage: Some(0.8), ..base() })),
            ("b:1", Some(Sample { kv_usage: Some(0.0), ..base() })),
        ];
        let first = ratios(&mut p, &members, &mut prev);
        assert!(first[1] > first[0], "{mode:?}: at once {first:?}");
        let mut last = first;
        for _ in 0..12 {
            let r = ratios(&mut p, &members, &mut prev);
            assert!(r[0] <= last[0], "{mode:?}: only ever cut: {r:?} after {last:?}");
            last = r;
        }
        assert!(f64::from(last[1]) >= 1.5 * f64::from(last[0]), "{mode:?}: within a minute {last:?}");
    }
}

#[test]
fn slots_are_the_capacity_of_a_server_without_a_kv_gauge() {
    // llama.cpp: 4 slots against 1, whatever each runs at the moment.
    let slots = |n: f64, w: f64, r: f64| Some(Sample { waiting: w, running: r, slots: Some(n), ..base() });
    for members in [
        [("big:1", slots(4.0, 0.0, 0.0)), ("small:1", slots(1.0, 0.0, 0.0))],
        [("big:1", slots(4.0, 0.0, 3.0)), ("small:1", slots(1.0, 1.0, 1.0))],
        [("big:1", slots(4.0, 0.0, 4.0)), ("small:1", slots(1.0, 0.0, 1.0))],
    ] {
        let r = ratios(&mut policy(Mode::LeastConnections), &members, &mut Default::default());
        assert!(f64::from(r[0]) >= 3.5 * f64::from(r[1]), "{members:?}: {r:?}");
    }
}

#[test]
fn without_kv_or_slots_a_full_server_shows_its_limit_and_one_with_room_holds_more() {
    // Equal weights put 3 requests on a 4-slot server and 2 on a 1-slot one: the small one runs
    // 1 and queues 1 (its limit is 1), the big one runs 3 and has room (so at least 4).
    let mut p = policy(Mode::LeastConnections);
    let members = [
        ("big:1", Some(Sample { running: 3.0, ..base() })),
        ("small:1", Some(Sample { waiting: 1.0, running: 1.0, ..base() })),
    ];
    let r = ratios(&mut p, &members, &mut Default::default());
    assert!(f64::from(r[0]) >= 3.5 * f64::from(r[1]), "{r:?}");
}

#[test]
fn idle_pool_is_equal_and_invalid_params_are_named() {
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let r = ratios(&mut p, &[("a:1", s(0.0, 0.0, 0.0, 1.0)), ("b:1", s(0.0, 0.0, 0.0, 1.0))], &mut prev);
    assert_eq!(r, vec![51, 51]);
    let bad = CapacityParams { delay_tau: 0.0, trim_max: 0.5, ..Default::default() };
    let fields: Vec<String> = bad.validate().into_iter().map(|(f, _)| f).collect();
    assert_eq!(fields, vec!["delay_tau".to_string(), "trim_max".to_string()]);
}

// ---- The special cases, one test each (each fails without the code it names). ----

fn with(waiting: f64, running: f64, kv: Option<f64>) -> Sample {
    Sample { waiting, running, kv_usage: kv, ..base() }
}

fn run(p: &mut PoolPolicy, members: &[(&str, Sample)], prev: &mut llm_lc_adapters::Ratios) -> Vec<u32> {
    let m: Vec<(&str, Option<Sample>)> = members.iter().map(|(n, s)| (*n, Some(s.clone()))).collect();
    ratios(p, &m, prev)
}

#[test]
fn a_reading_from_few_requests_or_little_memory_leaves_the_capacity_to_the_pool() {
    // `estimate::MIN_RUNNING`, `estimate::MIN_USAGE`: one long request at 50% of memory is not a
    // server that holds two; eight short ones at 1% are not one that holds 800 (capped 256).
    for odd in [with(0.0, 1.0, Some(0.5)), with(0.0, 8.0, Some(0.01))] {
        let mut p = policy(Mode::LeastConnections);
        let members =
            [("a:1", with(0.0, 40.0, Some(0.4))), ("b:1", with(0.0, 40.0, Some(0.4))), ("c:1", odd)];
        let r = run(&mut p, &members, &mut Default::default());
        let share = f64::from(r[2]) / f64::from(r[0]);
        assert!((0.85..1.2).contains(&share), "{:?}: {r:?}", members[2]);
    }
}

#[test]
fn memory_capacity_is_capped_by_the_slots_where_both_are_known() {
    // `capacity_shown`'s limit: a server with 4 slots holds 4, whatever its memory would allow.
    let mut p = policy(Mode::LeastConnections);
    let slotted = Sample { slots: Some(4.0), ..with(0.0, 4.0, Some(0.1)) };
    let r = run(&mut p, &[("a:1", slotted), ("b:1", with(0.0, 4.0, Some(0.1)))], &mut Default::default());
    assert!(f64::from(r[1]) >= 5.0 * f64::from(r[0]), "4 slots against 40 requests' memory: {r:?}");
}

#[test]
fn a_change_of_slots_is_taken_at_once_not_smoothed() {
    // A llama-server restarted with 4 slots instead of 1 holds 4 from its next reading on.
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let slots = |n: f64| Sample { slots: Some(n), ..with(0.0, 0.0, None) };
    run(&mut p, &[("a:1", slots(1.0)), ("b:1", slots(4.0))], &mut prev);
    let r = run(&mut p, &[("a:1", slots(4.0)), ("b:1", slots(4.0))], &mut prev);
    assert_eq!(r[0], r[1], "{r:?}");
}

#[test]
fn llamacpp_time_per_token_is_the_service_time_even_below_a_millisecond() {
    // Behind weighted round robin `K / s`: 0.5 ms against 2 ms per generated token is 4:1. (A
    // floor of 1 ms on `s` once made it 2:1.)
    let mut p = policy(Mode::RoundRobin);
    let tok = |t: f64| Sample { token_time: Some(t), slots: Some(4.0), ..with(0.0, 0.0, None) };
    let r = run(&mut p, &[("a:1", tok(0.0005)), ("b:1", tok(0.002))], &mut Default::default());
    let share = f64::from(r[0]) / f64::from(r[1]);
    assert!((3.5..4.5).contains(&share), "{r:?}");
}

#[test]
fn a_time_of_zero_or_nan_is_no_reading() {
    // An empty histogram gives 0 or 0/0: that is not an infinitely fast server.
    for bad in [0.0, f64::NAN, f64::INFINITY] {
        let mut p = policy(Mode::RoundRobin);
        let t = |service: f64| Sample {
            service: Some(service),
            latency: Some(10.0),
            ..with(0.0, 40.0, Some(0.4))
        };
        // `a`'s latency (10 s) stands in: as fast as `b`, twice as fast as `c`.
        let r = run(&mut p, &[("a:1", t(bad)), ("b:1", t(10.0)), ("c:1", t(20.0))], &mut Default::default());
        assert!(r[0] == r[1] && r[1] > r[2], "service {bad}: {r:?}");
    }
}

#[test]
fn a_queued_server_a_little_slower_than_its_estimate_keeps_it() {
    // `SLOWDOWN`: end-to-end times of a queued server carry its queue; below 1.5x the estimate
    // they are not used at all (smoothing them in would teach it a slowness that is only waiting).
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    // Memory over half full: `a`'s queue is not its batch limit (see `ROOMY`).
    let l = |w: f64, latency: f64| Sample { latency: Some(latency), ..with(w, 40.0, Some(0.6)) };
    for _ in 0..3 {
        run(&mut p, &[("a:1", l(0.0, 10.0)), ("b:1", l(0.0, 10.0))], &mut prev);
    }
    for _ in 0..40 {
        run(&mut p, &[("a:1", l(1.0, 14.0)), ("b:1", l(0.0, 10.0))], &mut prev);
    }
    let r = run(&mut p, &[("a:1", l(0.0, 10.0)), ("b:1", l(0.0, 10.0))], &mut prev);
    let share = f64::from(r[0]) / f64::from(r[1]);
    assert!(share > 0.93, "{r:?}");
}

#[test]
fn round_robin_weighs_speed_only_when_every_member_has_a_service_time() {
    // A partial picture would favour whoever lacks one: then capacity in requests for all.
    let mut p = policy(Mode::RoundRobin);
    let t = |service: Option<f64>| Sample { service, ..with(0.0, 40.0, Some(0.4)) };
    let r = run(
        &mut p,
        &[("a:1", t(Some(10.0))), ("b:1", t(Some(30.0))), ("c:1", t(None))],
        &mut Default::default(),
    );
    assert!(r[0] == r[1] && r[1] == r[2], "{r:?}");
}

#[test]
fn least_connections_leaves_a_later_queue_to_the_lb() {
    // No delay factor behind least-connections, and no queue cut for a queue that appears after
    // the first reading: the LB sees queued requests itself.
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let calm = || with(0.0, 100.0, Some(0.5));
    run(&mut p, &[("a:1", calm()), ("b:1", calm())], &mut prev);
    let r = run(&mut p, &[("a:1", with(20.0, 100.0, Some(0.5))), ("b:1", calm())], &mut prev);
    assert_eq!(r[0], r[1], "{r:?}");
}

#[test]
fn an_idle_pool_is_not_trimmed() {
    // `corrections::IDLE_UTIL`: at 4% mean utilization one request more or less is noise.
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let slots = |r: f64| Sample { slots: Some(10.0), ..with(0.0, r, None) };
    let members = [
        ("a:1", slots(2.0)),
        ("b:1", slots(0.0)),
        ("c:1", slots(0.0)),
        ("d:1", slots(0.0)),
        ("e:1", slots(0.0)),
    ];
    let mut r = vec![];
    for _ in 0..12 {
        r = run(&mut p, &members, &mut prev);
    }
    assert!(r.iter().all(|&x| x == r[0]), "{r:?}");
}

#[test]
fn utilization_differences_inside_the_band_move_nothing() {
    // `trim_band`: 0.5 against 0.6 for an hour of readings is not a trend to chase.
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let slots = |r: f64| Sample { slots: Some(10.0), ..with(0.0, r, None) };
    let mut r = vec![];
    for _ in 0..720 {
        r = run(&mut p, &[("a:1", slots(5.0)), ("b:1", slots(6.0))], &mut prev);
    }
    assert_eq!(r[0], r[1], "{r:?}");
}

#[test]
fn an_idle_member_beside_busy_ones_gains_by_a_bounded_step() {
    // The floor in the trim's factor: utilization 0 would make it infinite (at once `trim_max`).
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let slots = |r: f64| Sample { slots: Some(10.0), ..with(0.0, r, None) };
    let members = [("a:1", slots(6.0)), ("b:1", slots(6.0)), ("c:1", slots(0.0))];
    let first = run(&mut p, &members, &mut prev);
    assert!(f64::from(first[2]) <= 1.4 * f64::from(first[0]), "one 5 s step: {first:?}");
}

#[test]
fn trims_are_recentred_so_they_cannot_drift_together() {
    // Two busy members and an idle one: without the recentring the busy ones sink to 1/trim_max
    // while the idle one rises to trim_max (16:1); with it their product stays 1 (at most 8:1,
    // here clamped further by the range).
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let slots = |r: f64| Sample { slots: Some(10.0), ..with(0.0, r, None) };
    let members = [("a:1", slots(9.0)), ("b:1", slots(9.0)), ("c:1", slots(0.0))];
    let mut r = vec![];
    for _ in 0..200 {
        r = run(&mut p, &members, &mut prev);
    }
    let spread = f64::from(r[2]) / f64::from(r[0]);
    assert!((4.0..9.0).contains(&spread), "{r:?}");
}

#[test]
fn a_capacity_below_one_request_counts_as_one() {
    // Guards the divisions by `K`; validated inputs do not reach it (KV usage <= 1, slots >= 1).
    let mut m = estimate::Member::new();
    m.k = Some(0.25);
    let s = with(2.0, 0.0, None);
    let b = base::Base::new(Mode::LeastConnections, 256.0, &[m], &[&s]);
    assert_eq!(b.k, vec![1.0]);
    assert!(b.delay[0].is_finite());
}

#[test]
fn small_moves_on_every_member_push_nothing() {
    // The pool-wide deadband: 50.5 -> 51/50 is under 5% for both, so both keep 51.
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let slots = |n: f64| Sample { slots: Some(n), ..with(0.0, 0.0, None) };
    let r0 = run(&mut p, &[("a:1", slots(20.0)), ("b:1", slots(20.0))], &mut prev);
    let r = run(&mut p, &[("a:1", slots(20.6)), ("b:1", slots(20.0))], &mut prev);
    assert_eq!(r, r0);
    // A move of 5% or more on one member moves them all.
    let r = run(&mut p, &[("a:1", slots(24.0)), ("b:1", slots(20.0))], &mut prev);
    assert!(r[0] > r[1], "{r:?}");
}

#[test]
fn ratios_too_large_to_sum_give_every_member_the_middle() {
    // A time so small that `K / s` overflows: no NaN pushed, the pool gets the mid-range.
    let mut p = policy(Mode::RoundRobin);
    let tok = |t: f64| Sample { token_time: Some(t), slots: Some(4.0), ..with(0.0, 0.0, None) };
    let r = run(&mut p, &[("a:1", tok(1e-320)), ("b:1", tok(0.002))], &mut Default::default());
    assert_eq!(r, vec![51, 51]);
}

/// The queue rule's fixtures: `a` queues, `b` has room (at one reading's age).
fn queue_pair(b: Sample, age_a: u64) -> [(&'static str, Sample); 2] {
    let a = Sample { age: Duration::from_secs(age_a), ..with(3.0, 40.0, Some(0.4)) };
    [("a:1", a), ("b:1", b)]
}

#[test]
fn a_repeated_reading_neither_ends_a_cut_nor_moves_the_trim() {
    // Prometheus every 15 s, a cycle every 5 s: `a`'s reading is seen again (5 s older) while
    // `b`'s new one shows it full. A repeat confirms nothing and ends nothing.
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let first = run(&mut p, &queue_pair(with(0.0, 40.0, Some(0.4)), 1), &mut prev);
    assert!(first[0] < first[1], "cut: {first:?}");
    let r = run(&mut p, &queue_pair(with(2.0, 40.0, Some(0.4)), 6), &mut prev);
    assert_eq!(r, first, "the cut holds");
    let r2 = run(&mut p, &queue_pair(with(2.0, 40.0, Some(0.4)), 1), &mut prev);
    assert!(r2[0] > r[0], "a new reading without room beside it ends the cut: {r:?} then {r2:?}");
}

#[test]
fn a_cut_ends_when_no_member_has_room_any_more() {
    // `has_room`: waiting, no free slot, or memory at 90% are no room. (`a` queues; `b` first
    // has room, then has none.)
    let kv = |w: f64, r: f64, kv: f64| with(w, r, Some(kv));
    let slots = |w: f64, r: f64| Sample { slots: Some(40.0), ..with(w, r, None) };
    // Memory over half full: a queue there may wait for memory (under half, what `a` runs would
    // be its batch limit, and `a` a smaller server, not one with load from elsewhere).
    for (a, room, full) in [
        (kv(3.0, 40.0, 0.6), kv(0.0, 40.0, 0.6), kv(2.0, 40.0, 0.6)),
        (kv(3.0, 40.0, 0.6), kv(0.0, 40.0, 0.6), kv(0.0, 40.0, 0.95)),
        (slots(3.0, 40.0), slots(0.0, 10.0), slots(0.0, 40.0)),
    ] {
        let mut p = policy(Mode::LeastConnections);
        let mut prev = Default::default();
        let cut = run(&mut p, &[("a:1", a.clone()), ("b:1", room)], &mut prev);
        let r = run(&mut p, &[("a:1", a), ("b:1", full.clone())], &mut prev);
        assert!(
            f64::from(r[0]) / f64::from(r[1]) > f64::from(cut[0]) / f64::from(cut[1]),
            "{full:?}: cut {cut:?}, then {r:?}"
        );
    }
}

#[test]
fn a_long_queue_is_cut_to_a_quarter_of_its_ratio_at_most() {
    // The cut's floor, `1 / trim_max`: a queue of 1,000 is not a reason to push ratio 1.
    let mut p = policy(Mode::LeastConnections);
    // (Memory over half full, so `a`'s queue is not read as its batch limit.)
    let members = [("a:1", with(1000.0, 40.0, Some(0.6))), ("b:1", with(0.0, 40.0, Some(0.6)))];
    let r = run(&mut p, &members, &mut Default::default());
    let share = f64::from(r[0]) / f64::from(r[1]);
    assert!((0.2..0.3).contains(&share), "{r:?}");
}

#[test]
fn with_no_estimate_anywhere_the_members_are_equal() {
    // The pool's mean capacity falls back to `max_num_seqs`: first readings of 1-3 requests say
    // nothing, and "one more than it runs" must not rank them.
    let mut p = policy(Mode::LeastConnections);
    let members = [
        ("a:1", with(0.0, 1.0, Some(0.3))),
        ("b:1", with(0.0, 2.0, Some(0.2))),
        ("c:1", with(0.0, 3.0, Some(0.5))),
    ];
    let r = run(&mut p, &members, &mut Default::default());
    assert!(r[0] == r[1] && r[1] == r[2], "{r:?}");
}

#[test]
fn a_server_with_every_slot_busy_is_not_memory_bound() {
    // Memory-bound needs a memory reading: a llama.cpp server whose slots are all busy queues, it
    // does not preempt, so its time per token tripling while it queues is believed at once.
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let tok = |w: f64, t: f64| Sample { token_time: Some(t), slots: Some(4.0), ..with(w, 4.0, None) };
    for _ in 0..3 {
        run(&mut p, &[("a:1", tok(0.0, 0.01)), ("b:1", tok(0.0, 0.01))], &mut prev);
    }
    let r = run(&mut p, &[("a:1", tok(3.0, 0.03)), ("b:1", tok(0.0, 0.01))], &mut prev);
    assert!(f64::from(r[0]) <= 0.4 * f64::from(r[1]), "{r:?}");
}

#[test]
fn round_robin_delay_of_a_member_without_a_time_uses_the_pool_mean() {
    // `c` has no service time of its own (so the base is `K` for all); its queue of 50 is 5 s of
    // waiting at the pool's 10 s per request, not 0.5 s at a guessed second.
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    let t = |w: f64, service: Option<f64>| Sample { service, ..with(w, 100.0, Some(0.5)) };
    run(
        &mut p,
        &[("a:1", t(0.0, Some(10.0))), ("b:1", t(0.0, Some(10.0))), ("c:1", t(0.0, None))],
        &mut prev,
    );
    let r = run(
        &mut p,
        &[("a:1", t(0.0, Some(10.0))), ("b:1", t(0.0, Some(10.0))), ("c:1", t(50.0, None))],
        &mut prev,
    );
    assert!(f64::from(r[2]) < 0.5 * f64::from(r[0]), "{r:?}");
}

#[test]
fn round_robin_delay_without_any_time_counts_a_second_per_request() {
    // Nothing known of speed: a queue still costs (a second per request), and the queued member
    // gets less than the one with room.
    let mut p = policy(Mode::RoundRobin);
    let mut prev = Default::default();
    run(&mut p, &[("a:1", with(0.0, 100.0, Some(0.5))), ("b:1", with(0.0, 100.0, Some(0.5)))], &mut prev);
    let r = run(
        &mut p,
        &[("a:1", with(50.0, 100.0, Some(0.5))), ("b:1", with(0.0, 100.0, Some(0.5)))],
        &mut prev,
    );
    assert!(f64::from(r[0]) <= 0.92 * f64::from(r[1]), "{r:?}");
}

#[test]
fn the_queue_rule_never_raises_a_ratio() {
    // `a`'s 4 requests at 10% say 10 requests of capacity; judged by size, pulled toward the
    // pool's reading, it counts as 110, so the cut it would get is above 1: it is held at 1.
    let mut p = policy(Mode::LeastConnections);
    let r = run(
        &mut p,
        &[("a:1", with(1.0, 4.0, Some(0.4))), ("b:1", with(0.0, 100.0, Some(0.25)))],
        &mut Default::default(),
    );
    assert!(r[0] <= 6, "its own base, 10 against 256: {r:?}");
}

#[test]
fn readings_from_few_requests_do_not_enter_the_pools_memory_figure() {
    // The judged sizes pull readings toward the pool's; a member running 1 request says nothing
    // of memory per request, whatever its KV usage: the other ratios are the same either way.
    let pool = |c: Sample| {
        let mut p = policy(Mode::LeastConnections);
        let r = run(
            &mut p,
            &[("a:1", with(3.0, 40.0, Some(0.4))), ("b:1", with(0.0, 40.0, Some(0.2))), ("c:1", c)],
            &mut Default::default(),
        );
        (r[0], r[1])
    };
    assert_eq!(pool(with(0.0, 1.0, Some(0.5))), pool(with(0.0, 1.0, Some(0.01))));
}

#[test]
fn the_trim_step_is_bounded_before_it_is_used() {
    // At the bound (`trim_max` 4 each way, 16:1) a further step is not pushed for a cycle before
    // the recentring clamps it.
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let slots = |r: f64| Sample { slots: Some(100.0), ..with(0.0, r, None) };
    let mut r = vec![];
    for _ in 0..200 {
        r = run(&mut p, &[("a:1", slots(90.0)), ("b:1", slots(0.0))], &mut prev);
        assert!(f64::from(r[1]) <= 16.5 * f64::from(r[0]), "{r:?}");
    }
    assert!(f64::from(r[1]) >= 12.0 * f64::from(r[0]), "at the bound: {r:?}");
}

#[test]
fn a_queued_member_without_an_estimate_is_not_credited_room() {
    // "One more than it runs" is for a member with room: `b` queues, runs 3 (too few for a memory
    // estimate) with half its memory used, so it holds 3 (`queued_with_memory_in_use`), not 4;
    // `a`, full at 1, holds 1.
    let mut p = policy(Mode::LeastConnections);
    let r = run(
        &mut p,
        &[("a:1", with(1.0, 1.0, None)), ("b:1", with(2.0, 3.0, Some(0.5)))],
        &mut Default::default(),
    );
    let share = f64::from(r[1]) / f64::from(r[0]);
    assert!((2.5..3.5).contains(&share), "{r:?}");
}

#[test]
fn a_server_without_kv_or_slots_shows_its_batch_limit_whatever_max_num_seqs_says() {
    // What a queueing server runs is its limit: 300 is 300, though `max_num_seqs` says 256 (what
    // an engine shows comes before what a config default assumes).
    let mut p = policy(Mode::LeastConnections);
    let r = run(
        &mut p,
        &[("a:1", with(1.0, 300.0, None)), ("b:1", with(1.0, 100.0, None))],
        &mut Default::default(),
    );
    let share = f64::from(r[0]) / f64::from(r[1]);
    assert!((2.8..3.2).contains(&share), "{r:?}");
}

#[test]
fn utilization_counts_a_queue_up_to_a_full_server() {
    // A queue of twice the capacity makes the member full (1), not 3x full: the trim's speed does
    // not grow with a queue that least-connections or the delay factor already answers.
    let m = estimate::Member::new();
    let s = with(200.0, 100.0, Some(0.5));
    let b = base::Base::new(Mode::LeastConnections, 100.0, &[m], &[&s]);
    assert_eq!(b.util, vec![1.0]);
}

/// The seed demo on real vLLM: two servers of one model, `--max-num-seqs 4` and `1`, behind
/// least-connections. The KV usage of a tiny model is ~0.002, so memory says "hundreds" of both;
/// what the small one shows every cycle (it runs 1 while 2 wait) is its batch limit.
#[test]
fn a_batch_limit_shown_in_behaviour_sets_the_capacity_declared_numbers_cannot() {
    let mut p = policy(Mode::LeastConnections);
    let mut prev = Default::default();
    let seen = [("a:1", s(0.0, 2.0, 0.003, 1.0)), ("b:1", s(2.0, 1.0, 0.001, 1.0))];
    // From the first reading on (a dry run's `--once`): memory says nothing of either, and `b`
    // runs 1 while 2 wait, `a` at least 2 and one more.
    let r = ratios(&mut p, &seen, &mut prev);
    assert!(r[0] >= 2 * r[1], "the 4-seq server gets at least twice the 1-seq one's ratio: {r:?}");
    for _ in 0..PLATEAU {
        ratios(&mut p, &seen, &mut prev);
    }
    // Now `a` carries the load and shows its own limit: 4 running while 1 waits, again and again.
    let busy = [("a:1", s(1.0, 4.0, 0.006, 1.0)), ("b:1", s(0.0, 1.0, 0.001, 1.0))];
    for _ in 0..PLATEAU {
        ratios(&mut p, &busy, &mut prev);
    }
    let r = ratios(&mut p, &busy, &mut prev);
    // Capacities 4 and 1; the utilization trim of the first phase (`b` full, `a` nearly idle)
    // still leans toward `a` for a while.
    let share = f64::from(r[0]) / f64::from(r[1]);
    assert!((3.0..=8.0).contains(&share), "capacities 4 and 1: {r:?}");
}

#[test]
fn the_batch_limit_is_learnt_only_from_a_plateau_of_new_readings_with_room_to_spare() {
    let params = CapacityParams::default();
    let e = Estimator { params: &params, interval: Duration::from_secs(5) };
    let at = |w: f64, r: f64, kv: f64, age_s: u64| Sample {
        age: Duration::from_secs(age_s),
        ..testutil::sample(w, r, kv)
    };
    // The same reading seen again (a Prometheus sample older by one interval) confirms nothing.
    let mut m = Member::new();
    for age in [1, 6, 11, 1, 6] {
        m = e.observe(m, &at(3.0, 8.0, 0.05, age));
    }
    assert_eq!(m.limit, None, "two readings, each seen again, are not a plateau of {PLATEAU}");
    let m = e.observe(m, &at(3.0, 8.0, 0.05, 1));
    assert_eq!(m.limit, Some(8.0));
    // Readings below the most it has run are a burst being admitted, not the limit; readings
    // without a queue in between do not undo the count (a small server behind a load balancer
    // that reacts queues every other cycle).
    let mut n = Member::new();
    for (w, r) in [(3.0, 8.0), (0.0, 5.0), (3.0, 7.0), (3.0, 8.0), (0.0, 2.0)] {
        n = e.observe(n, &at(w, r, 0.05, 1));
    }
    assert_eq!(n.limit, None, "two readings at the most it ran");
    let n = e.observe(n, &at(4.0, 8.0, 0.05, 1));
    assert_eq!(n.limit, Some(8.0));
    // A transient at the start is overruled by running more later.
    let mut t0 = Member::new();
    for (w, r) in [(2.0, 2.0), (0.0, 40.0), (2.0, 2.0), (2.0, 2.0)] {
        t0 = e.observe(t0, &at(w, r, 0.05, 1));
    }
    assert_eq!(t0.limit, None, "it has run 40: 2 is not its limit");
    // A burst being admitted shows a different count each time: no limit.
    let mut t = e.observe(Member::new(), &at(0.0, 10.0, 0.1, 1));
    for running in [30.0, 40.0, 55.0] {
        t = e.observe(t, &at(5.0, running, 0.1, 1));
    }
    assert_eq!(t.limit, None);
    // Waiting with memory more than half full may be waiting for memory: not a batch limit.
    let mut full = Member::new();
    for _ in 0..2 * PLATEAU {
        full = e.observe(full, &at(2.0, 12.0, 0.7, 1));
    }
    assert_eq!(full.limit, None);
    // Running more than the limit learnt raises it at once (a redeploy with a larger batch).
    let m = e.observe(m, &at(0.0, 12.0, 0.05, 1));
    assert_eq!(m.limit, Some(12.0));
}

#[test]
fn a_server_queued_with_memory_in_use_holds_what_it_runs_even_below_four() {
    // `estimate::queued_with_memory_in_use`: real vLLM with 8 MiB of KV beside one with 64 MiB,
    // long prompts: the small one runs 2 while 1 waits at 70% of its memory; the big one runs 8 at
    // 37%. Without the rule the small one got the pool's mean capacity, about half the traffic.
    let mut p = policy(Mode::LeastConnections);
    let r = run(
        &mut p,
        &[("big:1", with(0.0, 8.0, Some(0.37))), ("small:1", with(1.0, 2.0, Some(0.7)))],
        &mut Default::default(),
    );
    assert!(f64::from(r[0]) >= 5.0 * f64::from(r[1]), "21.6 against 2: {r:?}");
    // Below half its memory a queue is the batch limit's business, not memory's: nothing is
    // learnt from one reading of 2 running (the pool's mean stands in, capped by what it runs).
    let mut p = policy(Mode::LeastConnections);
    let r = run(
        &mut p,
        &[("big:1", with(0.0, 8.0, Some(0.37))), ("small:1", with(0.0, 2.0, Some(0.3)))],
        &mut Default::default(),
    );
    assert!(f64::from(r[1]) * 2.0 >= f64::from(r[0]), "{r:?}");
}
