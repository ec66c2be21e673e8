//! What a prompt is made of, where prompts share prefixes: the block content the engine's prefix
//! cache sees, and the key a client (or the reference proxy) gives the load balancer to hash.
//!
//! Two workloads, both drawn from their own seeded streams so every balancer sees the same
//! requests (parameters and their reasons: src/bench/RESULTS.md, "Workloads with shared prefixes"):
//!
//! - `shared-prefix` ([`SharedPrefix`]): RAG over a document set, or many apps each with its own
//!   long system prompt. Requests come in [`SHARED_GROUPS`] groups; a group's prefix is long
//!   (log-normal around [`SHARED_PREFIX_MEDIAN`] tokens), so that its prefill is most of an uncached
//!   request's time to first token; popularity is Zipf-skewed (exponent [`SHARED_ZIPF`]); each
//!   request adds a short question of its own and gets a medium answer. The key is the group.
//! - `multi-turn` ([`MultiTurn`]): chat sessions of several turns. Turn 1 is an opening message
//!   (often a pasted document); every later turn resends the whole conversation (every earlier
//!   message and answer) plus a short new message, after the user thinks for a while. The key is the
//!   session. A session ends after its turns or when the next turn would not fit the model.
//!
//! Block content is an id per 16-token block: a group's prefix blocks (or a session's history
//! blocks) are the same ids in every request that carries them, everything else is unique. The
//! engine turns the ids into a hash chain ([`llm_lc_sim::prefix::chain`]), so a block is shared
//! only with its whole prefix.
//!
//! The load (`--load 0.85`) of these workloads is measured against the fleet's capacity *without*
//! reuse (every prompt token computed, [`super::capacity`]): what a cache-blind fleet could do.

use std::sync::Arc;

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, LogNormal};

use llm_lc_sim::prefix::chain;
use llm_lc_sim::profile::BLOCK_SIZE;

/// `shared-prefix`: number of prefix groups.
pub const SHARED_GROUPS: u32 = 400;
/// Median group prefix, tokens (log-normal, sigma [`SHARED_PREFIX_SIGMA`], 1,000..6,000).
pub const SHARED_PREFIX_MEDIAN: f64 = 3000.0;
pub const SHARED_PREFIX_SIGMA: f64 = 0.3;
/// Zipf exponent of group popularity.
pub const SHARED_ZIPF: f64 = 0.8;
/// Median of a request's own question and of its answer, tokens (log-normal, sigma 0.6).
pub const SHARED_SUFFIX_MEDIAN: f64 = 80.0;
pub const SHARED_OUTPUT_MEDIAN: f64 = 200.0;

/// `multi-turn`: turns per session, uniform in this range.
pub const TURNS: (u32, u32) = (2, 10);
/// Median opening message, later messages and answers, tokens (log-normal, sigma 0.6).
pub const OPENING_MEDIAN: f64 = 800.0;
pub const MESSAGE_MEDIAN: f64 = 60.0;
pub const ANSWER_MEDIAN: f64 = 250.0;
/// Mean think time between an answer and the next turn, seconds (exponential).
pub const THINK_MEAN_S: f64 = 20.0;

/// One request with structure: sizes, block ids of its prompt and answer, and its affinity key.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// Hash chain of the prompt's and the answer's blocks.
    pub blocks: Arc<[u64]>,
    /// What the client puts in the prefix-key header.
    pub key: u64,
}

fn lognormal(median: f64, sigma: f64) -> LogNormal<f64> {
    LogNormal::new(median.ln(), sigma).expect("finite log-normal parameters")
}

/// A block id no other block has: `tag` separates the id spaces of prefixes, sessions and
/// one-off content.
fn id(tag: u64, owner: u64, index: u64) -> u64 {
    (tag << 60) ^ (owner << 24) ^ index
}

const TAG_GROUP: u64 = 1;
const TAG_SESSION: u64 = 2;
const TAG_UNIQUE: u64 = 3;

/// The `shared-prefix` request stream.
#[derive(Debug, Clone)]
pub struct SharedPrefix {
    /// Cumulative popularity of the groups (Zipf), for inverse-CDF draws.
    cdf: Vec<f64>,
    prefix_len: Vec<u32>,
    suffix: LogNormal<f64>,
    output: LogNormal<f64>,
    max_model_len: u32,
    serial: u64,
}

impl SharedPrefix {
    /// The groups' prefix lengths come from `rng` (a property of the workload, not of the run).
    pub fn new(max_model_len: u32, rng: &mut ChaCha8Rng) -> SharedPrefix {
        let weights: Vec<f64> = (1..=SHARED_GROUPS).map(|k| f64::from(k).powf(-SHARED_ZIPF)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        let len = lognormal(SHARED_PREFIX_MEDIAN, SHARED_PREFIX_SIGMA);
        let room = max_model_len.saturating_sub(1100).max(BLOCK_SIZE);
        let prefix_len =
            (0..SHARED_GROUPS).map(|_| (len.sample(rng).clamp(1000.0, 6000.0) as u32).min(room)).collect();
        SharedPrefix {
            cdf,
            prefix_len,
            suffix: lognormal(SHARED_SUFFIX_MEDIAN, 0.6),
            output: lognormal(SHARED_OUTPUT_MEDIAN, 0.6),
            max_model_len,
            serial: 0,
        }
    }

    /// The next request.
    pub fn next(&mut self, rng: &mut ChaCha8Rng) -> Prompt {
        let u: f64 = rng.gen();
        let group = self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1);
        let prefix = self.prefix_len[group];
        let suffix = self.suffix.sample(rng).clamp(8.0, 600.0) as u32;
        let output = (self.output.sample(rng).clamp(1.0, 1024.0) as u32)
            .min(self.max_model_len.saturating_sub(prefix + suffix))
            .max(1);
        self.serial += 1;
        let prompt = prefix + suffix;
        // The prefix's whole blocks are the group's; the block it ends in mixes in the question.
        let shared = u64::from(prefix / BLOCK_SIZE);
        let total = u64::from((prompt + output).div_ceil(BLOCK_SIZE));
        let ids = (0..total).map(|i| {
            if i < shared {
                id(TAG_GROUP, group as u64, i)
            } else {
                id(TAG_UNIQUE, self.serial, i)
            }
        });
        Prompt { prompt_tokens: prompt, output_tokens: output, blocks: chain(ids).into(), key: group as u64 }
    }

    /// Sizes only, for the capacity calibration.
    pub fn sizes(&mut self, rng: &mut ChaCha8Rng) -> (u32, u32) {
        let p = self.next(rng);
        (p.prompt_tokens, p.output_tokens)
    }
}

/// One conversation of `multi-turn`, planned whole when it starts (so every balancer sees the
/// same sessions, whatever order their turns finish in).
#[derive(Debug, Clone)]
pub struct Session {
    pub id: u64,
    /// (new message, answer) tokens of each turn.
    turns: Vec<(u32, u32)>,
    /// Think time after each turn's answer, seconds.
    thinks: Vec<f64>,
    next: usize,
    /// Tokens of the conversation so far (every message and answer).
    history: u32,
}

impl Session {
    /// How long the user thinks after the turn just answered.
    pub fn think_s(&self) -> f64 {
        self.thinks.get(self.next.saturating_sub(1)).copied().unwrap_or(0.0)
    }

    /// Turns planned.
    pub fn len(&self) -> usize {
        self.turns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }
}

/// The `multi-turn` request stream: sessions, and each session's next turn.
#[derive(Debug, Clone)]
pub struct MultiTurn {
    opening: LogNormal<f64>,
    message: LogNormal<f64>,
    answer: LogNormal<f64>,
    think: Exp<f64>,
    max_model_len: u32,
    sessions: u64,
}

impl MultiTurn {
    pub fn new(max_model_len: u32) -> MultiTurn {
        MultiTurn {
            opening: lognormal(OPENING_MEDIAN, 0.6),
            message: lognormal(MESSAGE_MEDIAN, 0.6),
            answer: lognormal(ANSWER_MEDIAN, 0.6),
            think: Exp::new(1.0 / THINK_MEAN_S).expect("positive rate"),
            max_model_len,
            sessions: 0,
        }
    }

    /// A new session, every turn drawn now; it stops early where a turn would not fit the model.
    pub fn start(&mut self, rng: &mut ChaCha8Rng) -> Session {
        self.sessions += 1;
        let planned = rng.gen_range(TURNS.0..=TURNS.1);
        let (mut turns, mut thinks, mut history) = (Vec::new(), Vec::new(), 0u32);
        for k in 0..planned {
            let message = if k == 0 {
                self.opening.sample(rng).clamp(20.0, 4000.0)
            } else {
                self.message.sample(rng).clamp(4.0, 600.0)
            } as u32;
            let answer = self.answer.sample(rng).clamp(8.0, 1024.0) as u32;
            let think = self.think.sample(rng);
            if history + message + answer > self.max_model_len {
                break;
            }
            history += message + answer;
            turns.push((message, answer));
            thinks.push(think);
        }
        Session { id: self.sessions, turns, thinks, next: 0, history: 0 }
    }

    /// The session's next turn, or `None` when it is over.
    pub fn turn(&self, s: &mut Session) -> Option<Prompt> {
        let &(message, answer) = s.turns.get(s.next)?;
        s.next += 1;
        let prompt = s.history + message;
        s.history = prompt + answer;
        // The conversation is append-only: block i holds the same tokens in every turn that has it.
        let total = u64::from(s.history.div_ceil(BLOCK_SIZE));
        let blocks = chain((0..total).map(|i| id(TAG_SESSION, s.id, i))).into();
        Some(Prompt { prompt_tokens: prompt, output_tokens: answer, blocks, key: s.id })
    }

    /// Mean turns of a session (sessions stop early where a turn would not fit the model), over a
    /// fixed sample: the session rate that gives a request rate.
    pub fn mean_turns(max_model_len: u32) -> f64 {
        let mut w = MultiTurn::new(max_model_len);
        let mut rng = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0x7u64 << 40);
        let n = 20_000;
        let turns: usize = (0..n).map(|_| w.start(&mut rng).len()).sum();
        (turns as f64 / f64::from(n)).max(1.0)
    }

    /// Sizes of every turn of sessions in order, for the capacity calibration (each turn weighs
    /// one request, as in the open-loop runs).
    pub fn sizes(&mut self, rng: &mut ChaCha8Rng, out: &mut Vec<(u32, u32)>) {
        let mut s = self.start(rng);
        while let Some(p) = self.turn(&mut s) {
            out.push((p.prompt_tokens, p.output_tokens));
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn groups_share_their_prefix_blocks_and_nothing_else() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut w = SharedPrefix::new(8192, &mut rng);
        let reqs: Vec<Prompt> = (0..2000).map(|_| w.next(&mut rng)).collect();
        let same: Vec<&Prompt> = reqs.iter().filter(|p| p.key == reqs[0].key).collect();
        assert!(same.len() > 2, "the popular groups repeat");
        let shared = (w.prefix_len[reqs[0].key as usize] / BLOCK_SIZE) as usize;
        assert_eq!(same[0].blocks[..shared], same[1].blocks[..shared]);
        assert_ne!(same[0].blocks[shared], same[1].blocks[shared], "the questions differ");
        let other = reqs.iter().find(|p| p.key != reqs[0].key).expect("another group");
        assert_ne!(other.blocks[0], reqs[0].blocks[0]);
        // Skew: the most popular group is far above the average share.
        let top = reqs.iter().filter(|p| p.key == 0).count();
        assert!(top as f64 > 5.0 * 2000.0 / f64::from(SHARED_GROUPS), "{top}");
        // The prefix is most of the prompt.
        let prefix_share: f64 = reqs
            .iter()
            .map(|p| f64::from(w.prefix_len[p.key as usize]) / f64::from(p.prompt_tokens))
            .sum::<f64>()
            / reqs.len() as f64;
        assert!(prefix_share > 0.9, "{prefix_share}");
        assert!(reqs.iter().all(|p| p.prompt_tokens + p.output_tokens <= 8192));
    }

    #[test]
    fn a_session_resends_its_history_and_grows() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut w = MultiTurn::new(8192);
        let mut s = w.start(&mut rng);
        let turns: Vec<Prompt> = std::iter::from_fn(|| w.turn(&mut s)).collect();
        assert_eq!(turns.len(), s.len());
        assert!(turns.len() >= 2, "{}", turns.len());
        for pair in turns.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            assert!(b.prompt_tokens > a.prompt_tokens + a.output_tokens - 1);
            let history_blocks = ((a.prompt_tokens + a.output_tokens) / BLOCK_SIZE) as usize;
            assert_eq!(a.blocks[..history_blocks], b.blocks[..history_blocks], "history resent");
            assert_eq!(a.key, b.key);
        }
        let mut other = w.start(&mut rng);
        let first = w.turn(&mut other).expect("a first turn");
        assert_ne!(first.key, turns[0].key);
        assert_ne!(first.blocks[0], turns[0].blocks[0]);
    }
}
