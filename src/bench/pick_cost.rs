//! What one pick of the endpoint picker costs (`bench --pick-cost`): a picker over `members`
//! members whose indexes hold `entries` block hashes in all, asked for prompts of `blocks` blocks,
//! half of them a prefix it has seen (warm somewhere) and half new. Wall time per pick, including
//! recording the dispatch and its release, on this machine's clock: a cost, not a simulation.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use llm_lc_balance::endpoint::picker::{Request, Settings};
use llm_lc_balance::endpoint::{Gauges, RequestPicker};

/// The measurement and what it was made on.
#[derive(Debug, Clone, Serialize)]
pub struct PickCost {
    pub members: usize,
    pub index_entries: usize,
    pub prompt_blocks: usize,
    pub picks: usize,
    pub median_us: f64,
    pub p99_us: f64,
}

/// Measure `picks` picks (after as many for warm-up).
pub fn measure(members: usize, entries: usize, blocks: usize, picks: usize, seed: u64) -> PickCost {
    let members = members.max(1);
    let blocks = blocks.max(1);
    let mut p = RequestPicker::new(members, entries.div_ceil(members) + blocks, Settings::default());
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for i in 0..members {
        let g = Gauges {
            waiting: rng.gen_range(0..4),
            running: rng.gen_range(0..64),
            kv_usage: rng.gen_range(0.0..0.9),
        };
        p.set_gauges(i, Some(g));
    }
    p.set_capacity(&(0..members).map(|_| rng.gen_range(20.0..100.0)).collect::<Vec<_>>());
    // Fill the indexes: `entries / blocks` prefixes, each sent once.
    let prefixes = (entries / blocks).max(1);
    let chain = |prefix: u64| -> Vec<u64> { (0..blocks as u64).map(|b| (prefix << 20) ^ b).collect() };
    let mut id = 0u64;
    for prefix in 0..prefixes as u64 {
        let c = chain(prefix);
        let r = Request { blocks: &c, tokens: blocks as u64 * 16, block_tokens: 16, key: None };
        if let Some(choice) = p.pick(r, |_| true) {
            p.remember(choice, r);
        }
    }
    let mut times = Vec::with_capacity(picks);
    for round in 0..picks * 2 {
        // Half seen before, half new.
        let prefix =
            if rng.gen_bool(0.5) { rng.gen_range(0..prefixes as u64) } else { 1_000_000 + round as u64 };
        let c = chain(prefix);
        let r = Request { blocks: &c, tokens: blocks as u64 * 16 + 50, block_tokens: 16, key: None };
        let t = Instant::now();
        if let Some(choice) = p.pick(r, |_| true) {
            p.dispatched(id, choice, r);
            p.first_token(id);
            p.finished(id);
        }
        let took = t.elapsed().as_secs_f64() * 1e6;
        id += 1;
        if round >= picks {
            times.push(took);
        }
    }
    times.sort_by(f64::total_cmp);
    let at = |q: f64| llm_lc_common::percentile(&times, q).unwrap_or(0.0);
    PickCost {
        members,
        index_entries: entries,
        prompt_blocks: blocks,
        picks,
        median_us: at(0.5),
        p99_us: at(0.99),
    }
}

/// One line for people.
pub fn render(c: &PickCost) -> String {
    format!(
        "pick cost: {} members, {} index entries, prompts of {} blocks, {} picks: median {:.1} us, p99 {:.1} us\n",
        c.members, c.index_entries, c.prompt_blocks, c.picks, c.median_us, c.p99_us
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_small_picker_is_measured_and_the_numbers_are_sane() {
        let c = super::measure(8, 2_000, 50, 200, 1);
        assert_eq!((c.members, c.picks), (8, 200));
        assert!(c.median_us > 0.0 && c.median_us <= c.p99_us, "{c:?}");
        assert!(super::render(&c).contains("8 members"));
    }
}
