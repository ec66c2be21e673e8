//! `epp-sticky`: llm-d's "sticky until saturated" default (router v0.10), as its documentation and
//! plugins describe it. Members whose approximate prefix index holds at least [`Sticky::affinity`]
//! of the prompt are warm; among the candidates the one with the fewest uncached prompt tokens in
//! flight wins, counting this request's own uncached part there (its token-load scorer); the warm
//! set is left only when even its least loaded member carries more than `tau` tokens, tau = peak
//! prefill throughput x the longest TTFT tolerated (about 287k tokens in llm-d's guide).
//! It replaced a weighted blend of prefix, queue, KV and no-hit-LRU scorers ([`super::Anchor`]).

/// The sticky picker's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sticky {
    /// Share of the prompt's blocks a member's index must hold to be warm (llm-d: 0.8).
    pub affinity: f64,
    /// Uncached prompt tokens in flight past which a warm member is saturated.
    pub tau_tokens: f64,
}

impl Sticky {
    /// llm-d's affinity threshold and a tau of `prefill_tokens_per_s` x `max_ttft_s`.
    pub fn from_prefill_rate(prefill_tokens_per_s: f64, max_ttft_s: f64) -> Sticky {
        Sticky { affinity: 0.8, tau_tokens: (prefill_tokens_per_s * max_ttft_s).max(0.0) }
    }
}

/// One member as the sticky picker sees it at a pick.
#[derive(Debug, Clone, Copy, Default)]
pub struct Warmth {
    /// Its index in the pool.
    pub index: usize,
    /// Uncached prompt tokens the picker has in flight there ([`super::Accounting::tokens`]).
    pub in_flight_tokens: u64,
    /// Leading prompt blocks its prefix index holds.
    pub matched: usize,
}

/// A request as the sticky picker needs it: its prompt in tokens and in whole blocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct Prompt {
    pub tokens: u64,
    pub blocks: usize,
    pub block_tokens: u64,
}

impl Prompt {
    /// Tokens of this prompt a member holding `matched` leading blocks still has to prefill.
    pub fn uncached(&self, matched: usize) -> u64 {
        self.tokens.saturating_sub((matched as u64).saturating_mul(self.block_tokens))
    }
}

impl Sticky {
    /// The members with the least load among the candidates (into `ties`, cleared first): the
    /// warm ones unless all of them are saturated, else everyone.
    pub fn best(&self, members: &[Warmth], prompt: Prompt, ties: &mut Vec<usize>) {
        ties.clear();
        let load = |m: &Warmth| m.in_flight_tokens.saturating_add(prompt.uncached(m.matched));
        let warm = |m: &Warmth| prompt.blocks > 0 && m.matched as f64 >= self.affinity * prompt.blocks as f64;
        let warm_min = members.iter().filter(|m| warm(m)).map(load).min();
        let stay = warm_min.is_some_and(|l| l as f64 <= self.tau_tokens);
        let eligible = |m: &&Warmth| !stay || warm(m);
        let Some(least) = members.iter().filter(eligible).map(load).min() else { return };
        ties.extend(members.iter().filter(eligible).filter(|m| load(m) == least).map(|m| m.index));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(index: usize, in_flight_tokens: u64, matched: usize) -> Warmth {
        Warmth { index, in_flight_tokens, matched }
    }

    const PROMPT: Prompt = Prompt { tokens: 1000, blocks: 10, block_tokens: 100 };

    #[test]
    fn a_warm_member_keeps_its_prefix_until_it_is_saturated() {
        let sticky = Sticky { affinity: 0.8, tau_tokens: 5000.0 };
        let mut ties = Vec::new();
        // Warm `0` (9 of 10 blocks) is busier than cold `1`, but under tau: it stays.
        sticky.best(&[m(0, 4000, 9), m(1, 0, 0)], PROMPT, &mut ties);
        assert_eq!(ties, [0]);
        // 7 of 10 blocks is not warm: the least load wins (`1`'s 1000 against 300 + 4000).
        sticky.best(&[m(0, 4000, 7), m(1, 0, 0)], PROMPT, &mut ties);
        assert_eq!(ties, [1]);
        // Past tau the warm set is left: 9000 + 100 against 1000.
        sticky.best(&[m(0, 9000, 9), m(1, 0, 0)], PROMPT, &mut ties);
        assert_eq!(ties, [1]);
        // Among warm members the least loaded; equal loads tie.
        sticky.best(&[m(0, 200, 10), m(1, 100, 10), m(2, 0, 0)], PROMPT, &mut ties);
        assert_eq!(ties, [1]);
        sticky.best(&[m(0, 0, 0), m(1, 0, 0)], PROMPT, &mut ties);
        assert_eq!(ties, [0, 1]);
        sticky.best(&[], PROMPT, &mut ties);
        assert!(ties.is_empty());
    }

    #[test]
    fn tau_is_prefill_rate_times_the_longest_ttft_and_a_prompt_without_blocks_is_never_warm() {
        assert_eq!(Sticky::from_prefill_rate(15_928.0, 18.0).tau_tokens, 286_704.0);
        assert_eq!(Sticky::from_prefill_rate(f64::NAN, 1.0).tau_tokens, 0.0);
        let short = Prompt { tokens: 50, blocks: 0, block_tokens: 100 };
        assert_eq!(short.uncached(3), 0);
        let mut ties = Vec::new();
        Sticky::from_prefill_rate(1e6, 1.0).best(&[m(0, 10, 0), m(1, 0, 0)], short, &mut ties);
        assert_eq!(ties, [1]);
    }
}
