//! The cycle's safety rules, each pinned on the state machine alone: no sockets, no clocks.

use std::time::{Duration, Instant};

use llm_lc_adapters::{MemberId, Ratios};

use super::change::ChangePolicy;
use super::*;
use crate::policy::{PolicyConfig, PoolPolicy};
use crate::ratio::RatioRange;
use crate::source::{Sample, Snapshot};

const INTERVAL: Duration = Duration::from_secs(5);

fn members() -> Vec<MemberId> {
    vec![MemberId::from("a:1"), MemberId::from("b:1")]
}

fn sample(kv: f64, age_s: u64) -> Sample {
    Sample {
        waiting: 0.0,
        running: 4.0,
        kv_usage: Some(kv),
        latency: None,
        service: None,
        queue_time: None,
        token_time: None,
        prompt_cached: None,
        slots: None,
        age: Duration::from_secs(age_s),
    }
}

/// a is busier than b, so the policy wants different ratios.
fn fresh() -> Snapshot {
    Snapshot {
        members: [
            (MemberId::from("a:1"), Some(sample(0.9, 1))),
            (MemberId::from("b:1"), Some(sample(0.2, 1))),
        ]
        .into_iter()
        .collect(),
        rejected: vec![],
        failures: vec![],
        labels: Default::default(),
    }
}

fn stale() -> Snapshot {
    Snapshot {
        members: [(MemberId::from("a:1"), Some(sample(0.5, 600))), (MemberId::from("b:1"), None)]
            .into_iter()
            .collect(),
        rejected: vec![],
        failures: vec![],
        labels: Default::default(),
    }
}

fn cycle_with(settings: CycleSettings) -> Cycle {
    let policy = PoolPolicy::new(
        &PolicyConfig::default(),
        settings.range,
        Duration::from_secs(60),
        Duration::from_secs(30),
        INTERVAL,
    );
    Cycle::new(settings, policy)
}

fn settings() -> CycleSettings {
    CycleSettings::new(RatioRange { min: 1, max: 100 }, OnStale::Hold, Duration::from_secs(300))
}

fn push_of(step: &Step) -> Ratios {
    match &step.decision {
        Decision::Push(r) => r.clone(),
        other => panic!("expected a push, got {other:?}"),
    }
}

#[test]
fn fresh_data_is_pushed_and_a_success_is_reported_as_pushed() {
    let t0 = Instant::now();
    let mut c = cycle_with(settings());
    let s = c.step(Sampled::Snapshot(&fresh()), &members(), t0, true);
    assert_eq!(s.state, PoolState::Ok);
    assert_eq!(s.changed_from, None, "starting -> ok is not news");
    let sent = push_of(&s);
    assert_eq!(sent, s.desired);
    let a = sent.get(&MemberId::from("a:1")).expect("a");
    let b = sent.get(&MemberId::from("b:1")).expect("b");
    assert!(a < b, "the busier member gets less: {a} vs {b}");
    assert_eq!(c.pushed(PushResult::Applied { changed: 2 }, t0), PushOutcome::Pushed);
}

#[test]
fn source_down_holds_the_last_ratios_fail_static() {
    let t0 = Instant::now();
    let mut c = cycle_with(settings());
    let first = c.step(Sampled::Snapshot(&fresh()), &members(), t0, true);
    c.pushed(PushResult::Applied { changed: 2 }, t0);
    let s = c.step(Sampled::Failed("connection refused"), &members(), t0 + INTERVAL, true);
    assert_eq!(s.state, PoolState::SourceDown);
    assert_eq!(s.changed_from, Some(PoolState::Ok));
    assert_eq!(s.decision, Decision::Hold(PushOutcome::Held));
    assert_eq!(s.desired, first.desired, "reports the ratios the LB keeps");
    // Still down: no second state change to log.
    let s = c.step(Sampled::Failed("connection refused"), &members(), t0 + 2 * INTERVAL, true);
    assert_eq!(s.changed_from, None);
}

#[test]
fn all_stale_samples_hold_fail_static() {
    let t0 = Instant::now();
    let mut c = cycle_with(settings());
    let s = c.step(Sampled::Snapshot(&stale()), &members(), t0, true);
    assert_eq!(s.state, PoolState::Stale);
    assert_eq!(s.decision, Decision::Hold(PushOutcome::Held));
}

#[test]
fn on_stale_equal_pushes_equal_ratios_only_after_reset_after() {
    let t0 = Instant::now();
    let mut st = settings();
    st.on_stale = OnStale::Equal;
    st.reset_after = Duration::from_secs(30);
    let mut c = cycle_with(st);
    let s = c.step(Sampled::Failed("down"), &members(), t0, true);
    assert_eq!(s.decision, Decision::Hold(PushOutcome::Held));
    let s = c.step(Sampled::Failed("down"), &members(), t0 + Duration::from_secs(29), true);
    assert_eq!(s.decision, Decision::Hold(PushOutcome::Held));
    let s = c.step(Sampled::Failed("down"), &members(), t0 + Duration::from_secs(30), true);
    let sent = push_of(&s);
    assert_eq!(sent.iter().map(|(_, r)| r).collect::<Vec<_>>(), vec![51, 51]);
}

#[test]
fn ratios_that_drain_every_member_are_never_pushed() {
    let t0 = Instant::now();
    let mut st = CycleSettings::new(RatioRange { min: 0, max: 0 }, OnStale::Equal, Duration::ZERO);
    st.reconciles = true;
    let mut c = cycle_with(st);
    let s = c.step(Sampled::Failed("down"), &members(), t0, true);
    assert_eq!(s.decision, Decision::Hold(PushOutcome::RefusedDrain));
    let s = c.step(Sampled::Snapshot(&fresh()), &members(), t0 + INTERVAL, true);
    assert_eq!(s.decision, Decision::Hold(PushOutcome::RefusedDrain));
}

#[test]
fn a_failed_push_backs_off_and_a_successful_read_ends_the_wait() {
    let t0 = Instant::now();
    let mut st = settings();
    st.reconciles = true;
    let mut c = cycle_with(st);
    push_of(&c.step(Sampled::Snapshot(&fresh()), &members(), t0, true));
    assert_eq!(c.pushed(PushResult::Failed { retryable: true }, t0), PushOutcome::Error);
    let wait = c.retry_wait().expect("a wait after a failure");
    assert!(wait >= Duration::from_millis(800) && wait <= Duration::from_millis(1200));
    // Within the wait: backoff. After it: push again.
    let s = c.step(Sampled::Snapshot(&fresh()), &members(), t0 + wait / 2, true);
    assert_eq!(s.decision, Decision::Hold(PushOutcome::Backoff));
    push_of(&c.step(Sampled::Snapshot(&fresh()), &members(), t0 + wait, true));
    // Fail a few more times: the wait grows.
    let mut now = t0 + wait;
    for _ in 0..4 {
        c.pushed(PushResult::Failed { retryable: true }, now);
        now += c.retry_wait().expect("wait");
        push_of(&c.step(Sampled::Snapshot(&fresh()), &members(), now, true));
    }
    c.pushed(PushResult::Failed { retryable: true }, now);
    let long = c.retry_wait().expect("wait");
    assert!(long >= Duration::from_secs(25), "after 6 failures the wait is ~32 s, got {long:?}");
    assert_eq!(
        c.step(Sampled::Snapshot(&fresh()), &members(), now + INTERVAL, true).decision,
        Decision::Hold(PushOutcome::Backoff)
    );
    // The LB answers a read again: drift is repaired now, not after the wait.
    c.lb_answered();
    push_of(&c.step(Sampled::Snapshot(&fresh()), &members(), now + 2 * INTERVAL, true));
}

#[test]
fn a_follower_computes_but_never_pushes_to_a_shared_lb() {
    let t0 = Instant::now();
    let mut st = settings();
    st.needs_leader = true;
    let mut c = cycle_with(st);
    let s = c.step(Sampled::Snapshot(&fresh()), &members(), t0, false);
    assert_eq!(s.decision, Decision::Hold(PushOutcome::Follower));
    assert_eq!(s.state, PoolState::Ok);
    assert!(!s.desired.is_empty(), "followers still compute and report");
    push_of(&c.step(Sampled::Snapshot(&fresh()), &members(), t0 + INTERVAL, true));
    // Sinks served from this process (needs_leader false) work on followers too.
    let mut c = cycle_with(settings());
    push_of(&c.step(Sampled::Snapshot(&fresh()), &members(), t0, false));
}

#[test]
fn sinks_that_cannot_read_back_get_changes_and_a_periodic_resync() {
    let t0 = Instant::now();
    let mut st = settings();
    st.resync_every = Duration::from_secs(60);
    let mut c = cycle_with(st);
    let first = push_of(&c.step(Sampled::Snapshot(&stale_equal_load()), &members(), t0, true));
    c.pushed(PushResult::Applied { changed: 2 }, t0);
    // Equal load: the policy keeps the same ratios, so nothing is re-sent ...
    let s = c.step(Sampled::Snapshot(&stale_equal_load()), &members(), t0 + INTERVAL, true);
    assert_eq!(s.decision, Decision::Hold(PushOutcome::Unchanged));
    // ... until a minute has passed.
    let again = push_of(&c.step(
        Sampled::Snapshot(&stale_equal_load()),
        &members(),
        t0 + Duration::from_secs(60),
        true,
    ));
    assert_eq!(again, first);
}

/// Two members at the same load: a steady policy.
fn stale_equal_load() -> Snapshot {
    Snapshot {
        members: [
            (MemberId::from("a:1"), Some(sample(0.5, 1))),
            (MemberId::from("b:1"), Some(sample(0.5, 1))),
        ]
        .into_iter()
        .collect(),
        rejected: vec![],
        failures: vec![],
        labels: Default::default(),
    }
}

#[test]
fn reconciling_sinks_are_applied_every_cycle_to_repair_drift() {
    let t0 = Instant::now();
    let mut st = settings();
    st.reconciles = true;
    let mut c = cycle_with(st);
    for k in 0..3 {
        let now = t0 + INTERVAL * k;
        push_of(&c.step(Sampled::Snapshot(&stale_equal_load()), &members(), now, true));
        c.pushed(PushResult::Applied { changed: 0 }, now);
    }
}

#[test]
fn one_push_at_a_time() {
    let t0 = Instant::now();
    let mut st = settings();
    st.reconciles = true;
    let mut c = cycle_with(st);
    push_of(&c.step(Sampled::Snapshot(&fresh()), &members(), t0, true));
    assert!(c.push_in_flight());
    let s = c.step(Sampled::Snapshot(&fresh()), &members(), t0 + INTERVAL, true);
    assert_eq!(s.decision, Decision::Hold(PushOutcome::InProgress));
    c.pushed(PushResult::Applied { changed: 1 }, t0 + INTERVAL);
    push_of(&c.step(Sampled::Snapshot(&fresh()), &members(), t0 + 2 * INTERVAL, true));
}

#[test]
fn dry_run_pushes_are_reported_as_dry_run() {
    let t0 = Instant::now();
    let mut st = settings();
    st.dry_run = true;
    st.reconciles = true;
    let mut c = cycle_with(st);
    push_of(&c.step(Sampled::Snapshot(&fresh()), &members(), t0, true));
    assert_eq!(c.pushed(PushResult::Applied { changed: 2 }, t0), PushOutcome::DryRun);
}

/// Two members; `a` at the given KV usage, `b` at 0.3.
fn loads(a_kv: f64) -> Snapshot {
    Snapshot {
        members: [
            (MemberId::from("a:1"), Some(sample(a_kv, 1))),
            (MemberId::from("b:1"), Some(sample(0.3, 1))),
        ]
        .into_iter()
        .collect(),
        rejected: vec![],
        failures: vec![],
        labels: Default::default(),
    }
}

#[test]
fn the_change_policy_holds_small_moves_until_max_hold_and_sends_big_ones_at_once() {
    let t0 = Instant::now();
    let mut st = settings();
    st.reconciles = true;
    st.change = ChangePolicy::CONFIGURATION;
    // The memoryless policy: each cycle's ratios follow that cycle's loads, so the test sets them.
    let policy = PoolPolicy::new(
        &PolicyConfig::Headroom(Default::default()),
        st.range,
        Duration::from_secs(60),
        Duration::from_secs(30),
        INTERVAL,
    );
    let mut c = Cycle::new(st, policy);
    let first = push_of(&c.step(Sampled::Snapshot(&loads(0.3)), &members(), t0, true));
    c.pushed(PushResult::Applied { changed: 2 }, t0);
    let a = MemberId::from("a:1");
    // Small moves of a's load: the policy's ratio moves by a few percent and is held back.
    let mut now = t0;
    for kv in [0.33, 0.36, 0.33, 0.38] {
        now += INTERVAL;
        let s = c.step(Sampled::Snapshot(&loads(kv)), &members(), now, true);
        assert_ne!(s.desired, first, "the policy moved (kv {kv})");
        assert_eq!(push_of(&s), first, "a move of a few percent is not written (kv {kv})");
        c.pushed(PushResult::Applied { changed: 0 }, now);
    }
    // A real change (a's load triples): written at once.
    now += INTERVAL;
    let s = c.step(Sampled::Snapshot(&loads(0.95)), &members(), now, true);
    let sent = push_of(&s);
    assert_eq!(sent.get(&a), s.desired.get(&a), "a big move goes out in the same cycle");
    c.pushed(PushResult::Applied { changed: 1 }, now);
    // b's small move, held so far, goes out once a minute has passed since b's last write.
    let s = c.step(Sampled::Snapshot(&loads(0.95)), &members(), t0 + Duration::from_secs(60), true);
    assert_eq!(push_of(&s), s.desired);
}

#[test]
fn state_changes_are_reported_once() {
    let t0 = Instant::now();
    let mut c = cycle_with(settings());
    let seen: Vec<Option<PoolState>> = [
        Sampled::Snapshot(&fresh()),
        Sampled::Failed("x"),
        Sampled::Failed("x"),
        Sampled::Snapshot(&stale()),
        Sampled::Snapshot(&fresh()),
        Sampled::Snapshot(&fresh()),
    ]
    .into_iter()
    .enumerate()
    .map(|(k, s)| {
        let step = c.step(s, &members(), t0 + INTERVAL * k as u32, true);
        if matches!(step.decision, Decision::Push(_)) {
            c.pushed(PushResult::Applied { changed: 0 }, t0);
        }
        step.changed_from
    })
    .collect();
    assert_eq!(
        seen,
        vec![None, Some(PoolState::Ok), None, Some(PoolState::SourceDown), Some(PoolState::Stale), None]
    );
}

/// Issue 13's acceptance on the state machine: behind BIG-IP (the configuration change policy), a
/// replica slowed to a third is still re-weighted within 3 cycles: its move is far beyond 20%, so it
/// is written, not held for a minute.
#[test]
fn a_replica_slowed_to_a_third_is_written_within_three_cycles_under_the_f5_change_policy() {
    use crate::policy::capacity::{CapacityParams, Mode};
    let t0 = Instant::now();
    let mut st = settings();
    st.reconciles = true;
    st.change = ChangePolicy::CONFIGURATION;
    let policy = PoolPolicy::new(
        &PolicyConfig::Capacity(CapacityParams { mode: Mode::RoundRobin, ..Default::default() }),
        st.range,
        Duration::from_secs(60),
        Duration::from_secs(30),
        INTERVAL,
    );
    let mut c = Cycle::new(st, policy);
    let s = |waiting: f64, latency: f64| {
        Some(Sample {
            waiting,
            running: 100.0,
            // Over half full: a queue here is not read as a batch limit (the policy's `ROOMY`).
            kv_usage: Some(0.6),
            latency: Some(latency),
            service: None,
            queue_time: None,
            token_time: None,
            prompt_cached: None,
            slots: None,
            age: Duration::ZERO,
        })
    };
    let snap = |a: Option<Sample>| Snapshot {
        members: [("a:1", a), ("b:1", s(0.0, 10.0)), ("c:1", s(0.0, 10.0))]
            .into_iter()
            .map(|(m, x)| (MemberId::from(m), x))
            .collect(),
        rejected: vec![],
        failures: vec![],
        labels: Default::default(),
    };
    let three: Vec<MemberId> = ["a:1", "b:1", "c:1"].into_iter().map(MemberId::from).collect();
    let mut now = t0;
    let mut sent = Ratios::default();
    for _ in 0..3 {
        let step = c.step(Sampled::Snapshot(&snap(s(0.0, 10.0))), &three, now, true);
        if let Decision::Push(r) = step.decision {
            sent = r;
        }
        c.pushed(PushResult::Applied { changed: 0 }, now);
        now += INTERVAL;
    }
    let a = MemberId::from("a:1");
    let before = sent.get(&a).expect("a has a ratio");
    for w in [30.0, 10.0, 0.0] {
        let step = c.step(Sampled::Snapshot(&snap(s(w, 30.0 + w * 0.3))), &three, now, true);
        if let Decision::Push(r) = step.decision {
            sent = r;
        }
        c.pushed(PushResult::Applied { changed: 1 }, now);
        now += INTERVAL;
    }
    let (a_now, b_now) = (sent.get(&a).expect("a"), sent.get(&MemberId::from("b:1")).expect("b"));
    assert!(f64::from(a_now) <= 0.8 * f64::from(before), "a was cut and written: {before} -> {a_now}");
    let share = f64::from(a_now) / f64::from(b_now);
    assert!((0.25..=0.45).contains(&share), "a at about a third of b after 3 cycles: {a_now} vs {b_now}");
}
