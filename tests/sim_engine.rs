//! Properties of the pure engine model over random workloads and random (valid) profiles:
//! no request lost or duplicated, exact token counts, KV never over capacity, batch limits held,
//! preempted requests finish, FIFO admission, and determinism.

use std::collections::BTreeMap;

use llm_lc_sim::engine::{Engine, EngineEvent, EngineRequest, FinishReason};
use llm_lc_sim::profile::{ModelProfile, BLOCK_SIZE};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Arrival {
    at_step: u32,
    prompt: u32,
    max_tokens: u32,
    eos_after: Option<u32>,
}

fn profile_strategy() -> impl Strategy<Value = ModelProfile> {
    (4u32..=64, 1u32..=16, 16u32..=512, 0.0f64..0.05).prop_map(|(blocks_extra, seqs, budget, wm)| {
        let mut p = ModelProfile::tiny();
        p.max_model_len = 512;
        p.watermark = wm;
        // Room for one max_model_len sequence plus the watermark, plus a little: preemption is common.
        let need = p.max_model_len.div_ceil(BLOCK_SIZE);
        p.num_gpu_blocks = need + blocks_extra + (wm * f64::from(need + blocks_extra)).ceil() as u32 + 1;
        p.max_num_seqs = seqs;
        p.max_num_batched_tokens = budget;
        p
    })
}

fn workload_strategy() -> impl Strategy<Value = Vec<Arrival>> {
    prop::collection::vec(
        (0u32..200, 1u32..300, 1u32..200, prop::option::of(1u32..100)).prop_map(|(at, prompt, max, eos)| {
            Arrival { at_step: at, prompt, max_tokens: max.min(512 - prompt), eos_after: eos }
        }),
        1..60,
    )
    .prop_map(|mut v| {
        v.sort_by_key(|a| a.at_step);
        v
    })
}

struct Run {
    events: Vec<(u32, EngineEvent)>,
    durations: Vec<f64>,
}

fn run(profile: &ModelProfile, work: &[Arrival]) -> Run {
    let mut e = Engine::new(profile, 1.0).expect("valid profile");
    let (mut events, mut durations) = (Vec::new(), Vec::new());
    let mut next = 0;
    let mut step = 0u32;
    let mut buf = Vec::new();
    loop {
        while next < work.len() && work[next].at_step <= step {
            let a = &work[next];
            e.add_request(EngineRequest {
                id: next as u64,
                prompt_tokens: a.prompt,
                max_tokens: a.max_tokens,
                eos_after: a.eos_after,
            })
            .expect("sizes fit max_model_len");
            next += 1;
        }
        if next == work.len() && !e.has_work() {
            break;
        }
        buf.clear();
        let info = e.step_into(&mut buf);
        let s = e.stats();
        assert!(s.used_blocks <= profile.num_gpu_blocks, "KV over capacity");
        assert!(s.running <= profile.max_num_seqs, "batch over max_num_seqs");
        assert!(
            info.prefill_tokens + info.decode_seqs <= profile.max_num_batched_tokens,
            "step over token budget"
        );
        assert!(info.duration_s >= 0.0 && info.duration_s.is_finite());
        durations.push(info.duration_s);
        events.extend(buf.iter().map(|ev| (step, *ev)));
        step += 1;
        assert!(step < 2_000_000, "engine does not drain");
    }
    assert_eq!(e.stats().used_blocks, 0, "all blocks free at the end");
    Run { events, durations }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn every_request_finishes_once_with_exact_tokens(profile in profile_strategy(), work in workload_strategy()) {
        let r = run(&profile, &work);
        let mut finished: BTreeMap<u64, (u32, FinishReason)> = BTreeMap::new();
        let mut tokens: BTreeMap<u64, u32> = BTreeMap::new();
        let mut first_seen: BTreeMap<u64, bool> = BTreeMap::new();
        for (_, ev) in &r.events {
            match *ev {
                EngineEvent::FirstToken { id } => {
                    prop_assert!(first_seen.insert(id, true).is_none(), "two first tokens for {}", id);
                    *tokens.entry(id).or_default() += 1;
                }
                EngineEvent::Token { id } => {
                    prop_assert!(first_seen.contains_key(&id), "token before first token for {}", id);
                    *tokens.entry(id).or_default() += 1;
                }
                EngineEvent::Finished { id, output_tokens, reason } => {
                    prop_assert!(finished.insert(id, (output_tokens, reason)).is_none(), "{} finished twice", id);
                }
                EngineEvent::Preempted { id } => {
                    prop_assert!(!finished.contains_key(&id), "preempted after finishing");
                }
                EngineEvent::Scheduled { .. } => {}
            }
        }
        prop_assert_eq!(finished.len(), work.len(), "lost requests");
        for (id, a) in work.iter().enumerate() {
            let id = id as u64;
            let (n, reason) = finished[&id];
            let expect = match a.eos_after {
                Some(e) if e < a.max_tokens => (e, FinishReason::Stop),
                _ => (a.max_tokens, FinishReason::Length),
            };
            prop_assert_eq!((n, reason), expect, "request {}", id);
            prop_assert_eq!(tokens[&id], n, "streamed tokens of {}", id);
        }
    }

    #[test]
    fn admission_is_fifo(profile in profile_strategy(), work in workload_strategy()) {
        let r = run(&profile, &work);
        let order: Vec<u64> = r.events.iter().filter_map(|(_, e)| match e {
            EngineEvent::Scheduled { id } => Some(*id),
            _ => None,
        }).collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        prop_assert_eq!(order, sorted, "first admissions out of arrival order");
    }

    #[test]
    fn same_input_same_output(profile in profile_strategy(), work in workload_strategy()) {
        let a = run(&profile, &work);
        let b = run(&profile, &work);
        prop_assert_eq!(a.events, b.events);
        prop_assert_eq!(a.durations, b.durations);
    }
}

#[test]
fn preempted_requests_resume_and_finish() {
    // 20 blocks of room above one max-length sequence: long generations must preempt.
    let mut p = ModelProfile::tiny();
    p.max_model_len = 512;
    p.num_gpu_blocks = 40;
    p.max_num_seqs = 16;
    let work: Vec<Arrival> =
        (0..12).map(|_| Arrival { at_step: 0, prompt: 20, max_tokens: 400, eos_after: None }).collect();
    let r = run(&p, &work);
    let preempted: Vec<u64> = r
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            EngineEvent::Preempted { id } => Some(*id),
            _ => None,
        })
        .collect();
    assert!(!preempted.is_empty(), "this workload must preempt");
    for id in &preempted {
        assert!(r
            .events
            .iter()
            .any(|(_, e)| matches!(e, EngineEvent::Finished { id: f, output_tokens: 400, .. } if f == id)));
    }
}

#[test]
fn waiting_request_behind_a_big_one_is_not_overtaken() {
    // The head needs more blocks than are free; a small request behind it must wait too (FIFO).
    let mut p = ModelProfile::tiny();
    p.max_model_len = 512;
    p.num_gpu_blocks = 40;
    p.watermark = 0.0;
    let mut e = Engine::new(&p, 1.0).unwrap();
    e.add_request(EngineRequest::new(0, 400, 100)).unwrap(); // 25 blocks
    e.step();
    e.add_request(EngineRequest::new(1, 300, 10)).unwrap(); // 19 blocks: does not fit in 15
    e.add_request(EngineRequest::new(2, 16, 10)).unwrap(); // 1 block: would fit
    e.step();
    assert_eq!(e.waiting_ids().collect::<Vec<_>>(), vec![1, 2]);
}
