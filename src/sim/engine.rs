//! The engine model: vLLM v1's continuous-batching scheduler as a pure state machine.
//!
//! No I/O, no clock, no randomness: [`Engine::step`] plans one batch, says how long it takes in
//! seconds and what happened at its end. The live server advances it in (scaled) real time, the
//! benchmark in virtual time; both get the same answers for the same inputs.
//!
//! What it models (vLLM v1 `Scheduler.schedule`, FCFS policy):
//! - Running requests are scheduled first, oldest first, each getting the tokens it still needs
//!   (a prefill chunk, or one decode token) within the step's `max_num_batched_tokens` budget:
//!   chunked prefill.
//! - KV cache in blocks of 16 tokens with a fixed capacity. A request is admitted from the FIFO
//!   waiting queue only when the blocks of its whole prompt fit above the watermark, and only while
//!   fewer than `max_num_seqs` run; the head of the queue blocks the ones behind it (no skipping).
//! - Decoding takes one more block every 16 tokens. When none is free, the newest running request
//!   is preempted by recompute: its blocks are freed, it goes back to the *front* of the waiting
//!   queue, and on re-admission it prefills prompt + the tokens it already produced, then goes on.
//!   No admission happens in a step that preempted (as vLLM does).
//! - Prefix caching (vLLM's automatic prefix caching, [`super::prefix`]): a request added with
//!   [`Engine::add_request_with_blocks`] carries the hash chain of its blocks. On admission the
//!   longest cached run of its leading full blocks is reused (never the whole prompt: the last
//!   token is always computed, as vLLM does), and only the rest is prefilled. Blocks it computes
//!   are registered as they fill; when it leaves they stay cached, evictable, until memory is
//!   needed. A request without blocks (every scenario without shared prefixes) neither reads nor
//!   writes the cache, so those runs are what they were before the cache existed.
//! - Step time: `(overhead + prefill_token*prefill_tokens + seq*seqs + kv_token*kv_read) / speed`
//!   with the coefficients of the [`ModelProfile`] and a per-replica speed factor (a profile may
//!   price the batch from a measured table instead of `overhead + seq*seqs`).
//!
//! API, in the order a driver uses it:
//! - [`Engine::new`]`(&profile, speed)`, [`Engine::set_speed`], [`Engine::set_token_events`]
//!   (turn per-token [`EngineEvent::Token`] off when only first tokens and completions matter).
//! - [`Engine::add_request`]`(EngineRequest { id, prompt_tokens, max_tokens, eos_after })`;
//!   [`Engine::abort`]`(id)` when a client goes away.
//! - while [`Engine::has_work`]: [`Engine::step`] (allocates the event vector) or
//!   [`Engine::step_into`] (reuses the caller's vector: no allocation per step in steady state).
//!   Events take effect at the *end* of the step, `duration_s` after it starts.
//! - Events: [`EngineEvent::Scheduled`] (first admission, stamped at the step's start),
//!   `FirstToken`, `Token`, `Finished`, `Preempted` (stamped at the step's end).
//! - [`Engine::stats`] for gauges and counters (waiting, running, KV usage, preemptions, tokens).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::prefix::PrefixCache;
use super::profile::{ModelProfile, ProfileError, BLOCK_SIZE};

/// One request as the engine sees it: sizes only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineRequest {
    /// Caller's id, unique among the requests the engine holds.
    pub id: u64,
    /// Prompt length in tokens (>= 1).
    pub prompt_tokens: u32,
    /// Generation stops after this many tokens (finish reason `length`).
    pub max_tokens: u32,
    /// The model "emits EOS" after this many tokens (finish reason `stop`), if before `max_tokens`.
    /// `None` = never (as with `ignore_eos`).
    pub eos_after: Option<u32>,
}

impl EngineRequest {
    /// A request that generates exactly `max_tokens` tokens.
    pub fn new(id: u64, prompt_tokens: u32, max_tokens: u32) -> Self {
        EngineRequest { id, prompt_tokens, max_tokens, eos_after: None }
    }
}

/// Why a request finished (vLLM's `finished_reason` label values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FinishReason {
    /// Reached `max_tokens`.
    Length,
    /// The model emitted EOS.
    Stop,
    /// Aborted by the caller.
    Abort,
}

impl FinishReason {
    /// The label value vLLM uses.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

/// Something that happened to a request at the end of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineEvent {
    /// The request entered the batch for the first time (not after a preemption). Unlike the
    /// others, this one is stamped at the *start* of the step: its queue time ends there.
    Scheduled { id: u64 },
    /// The prefill finished and the first output token exists.
    FirstToken { id: u64 },
    /// One more output token (not emitted for the first token, nor when token events are off).
    Token { id: u64 },
    /// The request is done and has left the engine; `output_tokens` counts every token produced.
    Finished { id: u64, output_tokens: u32, reason: FinishReason },
    /// The request lost its KV blocks and went back to the front of the waiting queue.
    Preempted { id: u64 },
}

/// What one step did, besides its events.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepInfo {
    /// Wall time of the step on this replica, seconds (0 when nothing was scheduled).
    pub duration_s: f64,
    /// Sequences in the batch.
    pub batch_size: u32,
    /// Prompt (or recompute) tokens computed in this step.
    pub prefill_tokens: u32,
    /// Sequences that decoded one token.
    pub decode_seqs: u32,
    /// Tokens of KV read by attention.
    pub kv_tokens_read: u64,
    /// Requests preempted in this step.
    pub preempted: u32,
}

/// One step: how long it took and what happened at its end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutcome {
    pub duration_s: f64,
    pub events: Vec<EngineEvent>,
    pub info: StepInfo,
}

/// Gauges and counters of an engine, for `/metrics` and for the benchmark.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub waiting: u32,
    pub running: u32,
    /// Used KV blocks / capacity, 0..=1 (`vllm:kv_cache_usage_perc`).
    pub kv_usage: f64,
    pub used_blocks: u32,
    pub num_gpu_blocks: u32,
    /// Preemptions so far (`vllm:num_preemptions_total`).
    pub num_preemptions: u64,
    /// Prompt tokens of requests that produced their first token (`vllm:prompt_tokens_total`).
    pub prompt_tokens_total: u64,
    /// Output tokens produced (`vllm:generation_tokens_total`).
    pub generation_tokens_total: u64,
    /// Steps that scheduled something.
    pub steps: u64,
    /// Sum of step durations, seconds: the engine's busy time.
    pub busy_s: f64,
    /// Sum of the batch sizes of those steps (mean batch = this / `steps`).
    pub busy_seq_steps: u64,
    /// Prompt tokens looked up in the prefix cache on first admission
    /// (`vllm:prefix_cache_queries_total`).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found cached (`vllm:prefix_cache_hits_total`).
    pub prefix_cache_hits: u64,
}

/// Why a request was refused; the server turns these into vLLM's 400 answers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    #[error("the prompt is empty; send at least one token")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1, got 0")]
    ZeroMaxTokens,
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested \
         {total} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). \
         Please reduce the length of the messages or completion.",
        total = u64::from(*prompt_tokens) + u64::from(*max_tokens)
    )]
    TooLong { prompt_tokens: u32, max_tokens: u32, max_model_len: u32 },
    #[error("request id {0} is already in the engine")]
    DuplicateId(u64),
}

#[derive(Debug, Clone)]
struct Seq {
    id: u64,
    prompt: u32,
    max_tokens: u32,
    eos_after: Option<u32>,
    /// Tokens known: prompt + generated.
    num_tokens: u32,
    /// Tokens whose KV is in the cache.
    computed: u32,
    generated: u32,
    blocks: u32,
    live: bool,
    scheduled_once: bool,
    /// Hash chain of the sequence's blocks (prompt and the output to come); empty = no caching.
    hashes: Arc<[u64]>,
    /// Cached blocks this sequence references (hits and blocks it registered).
    held: Vec<u64>,
}

/// The engine of one replica. See the module doc.
#[derive(Debug, Clone)]
pub struct Engine {
    max_num_seqs: u32,
    max_num_batched_tokens: u32,
    max_model_len: u32,
    num_gpu_blocks: u32,
    watermark_blocks: u32,
    /// The profile's step costs (batch, prompt tokens, KV reads).
    cost: ModelProfile,
    speed: f64,
    token_events: bool,

    slots: Vec<Seq>,
    free_slots: Vec<u32>,
    index: HashMap<u64, u32>,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    /// Blocks no request uses, including cached ones nobody references (evictable).
    free_blocks: u32,
    cache: PrefixCache,
    /// Scratch: (slot, new tokens) scheduled in the current step.
    sched: Vec<(u32, u32)>,
    stats: EngineStats,
}

/// Slowest speed factor accepted; lower values are raised to it so a step always ends.
pub const MIN_SPEED: f64 = 1e-3;

fn blocks_for(tokens: u32) -> u32 {
    tokens.div_ceil(BLOCK_SIZE)
}

impl Engine {
    /// An idle engine for `profile`, running at `speed` x the profile's GPU (1.0 = as profiled).
    pub fn new(profile: &ModelProfile, speed: f64) -> Result<Engine, ProfileError> {
        profile.validate()?;
        let mut e = Engine {
            max_num_seqs: profile.max_num_seqs,
            max_num_batched_tokens: profile.max_num_batched_tokens,
            max_model_len: profile.max_model_len,
            num_gpu_blocks: profile.num_gpu_blocks,
            watermark_blocks: profile.watermark_blocks(),
            cost: profile.clone(),
            speed: 1.0,
            token_events: true,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            free_blocks: profile.num_gpu_blocks,
            cache: PrefixCache::default(),
            sched: Vec::new(),
            stats: EngineStats { num_gpu_blocks: profile.num_gpu_blocks, ..EngineStats::default() },
        };
        e.set_speed(speed);
        Ok(e)
    }

    /// Change the speed factor; takes effect from the next step. Non-finite or tiny values become
    /// [`MIN_SPEED`].
    pub fn set_speed(&mut self, speed: f64) {
        self.speed = if speed.is_finite() && speed > MIN_SPEED { speed } else { MIN_SPEED };
    }

    /// Current speed factor.
    pub fn speed(&self) -> f64 {
        self.speed
    }

    /// Emit [`EngineEvent::Token`] for every token (default) or not (first tokens, completions and
    /// preemptions are always emitted).
    pub fn set_token_events(&mut self, on: bool) {
        self.token_events = on;
    }

    /// Longest prompt + output accepted.
    pub fn max_model_len(&self) -> u32 {
        self.max_model_len
    }

    /// Would `add_request` accept these sizes? (Everything but the id check.) Servers call this
    /// before answering, to give vLLM's 400 without a round trip to the engine task.
    pub fn check_sizes(max_model_len: u32, req: &EngineRequest) -> Result<(), RejectReason> {
        if req.prompt_tokens == 0 {
            return Err(RejectReason::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(RejectReason::ZeroMaxTokens);
        }
        if u64::from(req.prompt_tokens) + u64::from(req.max_tokens) > u64::from(max_model_len) {
            return Err(RejectReason::TooLong {
                prompt_tokens: req.prompt_tokens,
                max_tokens: req.max_tokens,
                max_model_len,
            });
        }
        Ok(())
    }

    /// Queue a request at the back of the waiting queue.
    pub fn add_request(&mut self, req: EngineRequest) -> Result<(), RejectReason> {
        self.add_request_with_blocks(req, Arc::from([]))
    }

    /// Queue a request whose blocks have these hashes ([`super::prefix::chain`]), in order from the
    /// prompt's first block; the list may cover output blocks too (a conversation's next turn
    /// resends them) and may be shorter than the sequence.
    pub fn add_request_with_blocks(
        &mut self,
        req: EngineRequest,
        hashes: Arc<[u64]>,
    ) -> Result<(), RejectReason> {
        Self::check_sizes(self.max_model_len, &req)?;
        if self.index.contains_key(&req.id) {
            return Err(RejectReason::DuplicateId(req.id));
        }
        let seq = Seq {
            id: req.id,
            prompt: req.prompt_tokens,
            max_tokens: req.max_tokens,
            eos_after: req.eos_after.filter(|&n| n >= 1),
            num_tokens: req.prompt_tokens,
            computed: 0,
            generated: 0,
            blocks: 0,
            live: true,
            scheduled_once: false,
            hashes,
            held: Vec::new(),
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = seq;
                s
            }
            None => {
                self.slots.push(seq);
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(req.id, slot);
        self.waiting.push_back(slot);
        Ok(())
    }

    /// Drop a request wherever it is, freeing its blocks. Returns the tokens it had produced, or
    /// `None` if the engine does not hold it.
    pub fn abort(&mut self, id: u64) -> Option<u32> {
        let slot = self.index.remove(&id)?;
        if let Some(pos) = self.waiting.iter().position(|&s| s == slot) {
            self.waiting.remove(pos);
        } else if let Some(pos) = self.running.iter().position(|&s| s == slot) {
            self.running.remove(pos);
        }
        self.release_blocks(slot);
        let seq = &mut self.slots[slot as usize];
        seq.live = false;
        let produced = seq.generated;
        self.free_slots.push(slot);
        Some(produced)
    }

    /// True while any request waits or runs.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Gauges and counters now.
    pub fn stats(&self) -> EngineStats {
        let used = self.num_gpu_blocks - self.free_blocks;
        EngineStats {
            waiting: self.waiting.len() as u32,
            running: self.running.len() as u32,
            kv_usage: f64::from(used) / f64::from(self.num_gpu_blocks),
            used_blocks: used,
            ..self.stats
        }
    }

    /// Ids of running requests, oldest admission first (for tests and debugging).
    pub fn running_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.running.iter().map(|&s| self.slots[s as usize].id)
    }

    /// Ids of waiting requests, front of the queue first.
    pub fn waiting_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.waiting.iter().map(|&s| self.slots[s as usize].id)
    }

    /// Plan and run one step; see [`Engine::step_into`].
    pub fn step(&mut self) -> StepOutcome {
        let mut events = Vec::new();
        let info = self.step_into(&mut events);
        StepOutcome { duration_s: info.duration_s, events, info }
    }

    /// Plan and run one step, appending its events to `events` (which is not cleared). The events
    /// take effect `duration_s` after the step starts. A step with nothing to do lasts 0 s.
    pub fn step_into(&mut self, events: &mut Vec<EngineEvent>) -> StepInfo {
        let mut info = StepInfo::default();
        let mut budget = self.max_num_batched_tokens;
        self.sched.clear();

        // 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let seq = &self.slots[slot as usize];
            let new = (seq.num_tokens - seq.computed).min(budget);
            let extra = blocks_for(seq.computed + new).saturating_sub(seq.blocks);
            let mut scheduled = true;
            while extra > self.free_blocks {
                let Some(victim) = self.running.pop() else { break };
                self.preempt(victim, events);
                info.preempted += 1;
                if victim == slot {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break; // `slot` was the newest; everything after it is gone too.
            }
            self.take_blocks(extra);
            self.slots[slot as usize].blocks += extra;
            self.sched.push((slot, new));
            budget -= new;
            i += 1;
        }

        // 2. Admit from the waiting queue, FIFO, unless this step preempted.
        if info.preempted == 0 {
            while budget > 0 && (self.running.len() as u32) < self.max_num_seqs {
                let Some(&slot) = self.waiting.front() else { break };
                let seq = &self.slots[slot as usize];
                let need = blocks_for(seq.num_tokens);
                let (hits, unused_hits) = self.cached_prefix(seq);
                // Hits on blocks another request holds cost no memory; the rest come from free.
                if need - hits + unused_hits + self.watermark_blocks > self.free_blocks {
                    break; // head-of-line: the queue is FIFO.
                }
                self.waiting.pop_front();
                let hashes = Arc::clone(&seq.hashes);
                self.free_blocks -= unused_hits;
                for &h in &hashes[..hits as usize] {
                    self.cache.acquire(h);
                }
                self.take_blocks(need - hits);
                let seq = &mut self.slots[slot as usize];
                seq.held.extend_from_slice(&hashes[..hits as usize]);
                seq.blocks = need;
                seq.computed = hits * BLOCK_SIZE;
                let new = (seq.num_tokens - seq.computed).min(budget);
                if !seq.scheduled_once {
                    seq.scheduled_once = true;
                    self.stats.prefix_cache_queries += u64::from(seq.prompt);
                    self.stats.prefix_cache_hits += u64::from(seq.computed);
                    events.push(EngineEvent::Scheduled { id: seq.id });
                }
                self.running.push(slot);
                self.sched.push((slot, new));
                budget -= new;
            }
        }

        if self.sched.is_empty() {
            return info;
        }

        // 3. Cost of the batch.
        for &(slot, new) in &self.sched {
            let seq = &self.slots[slot as usize];
            let decode = new == 1 && seq.generated > 0 && seq.computed + 1 == seq.num_tokens;
            if decode {
                info.decode_seqs += 1;
            } else {
                info.prefill_tokens += new;
            }
            info.kv_tokens_read += u64::from(seq.computed + new);
        }
        info.batch_size = self.sched.len() as u32;
        let c = &self.cost;
        let (prefill, kv) = (f64::from(info.prefill_tokens), info.kv_tokens_read as f64);
        // Summed in the same order as before the table existed, so linear profiles give the
        // same floats to the last bit (the bench's tables are compared byte for byte).
        let cost = if c.batch_step_s.is_empty() {
            c.step_overhead_s
                + c.prefill_token_s * prefill
                + c.seq_s * f64::from(info.batch_size)
                + c.kv_token_s * kv
        } else {
            c.batch_cost_s(info.batch_size) + c.prefill_token_s * prefill + c.kv_token_s * kv
        };
        info.duration_s = cost / self.speed;
        self.stats.steps += 1;
        self.stats.busy_s += info.duration_s;
        self.stats.busy_seq_steps += u64::from(info.batch_size);

        // 4. Effects at the end of the step.
        let mut any_finished = false;
        for k in 0..self.sched.len() {
            let (slot, new) = self.sched[k];
            let seq = &mut self.slots[slot as usize];
            let full_before = (seq.computed / BLOCK_SIZE) as usize;
            seq.computed += new;
            let full_now = ((seq.computed / BLOCK_SIZE) as usize).min(seq.hashes.len());
            for b in full_before..full_now {
                let h = seq.hashes[b];
                if self.cache.insert(h) {
                    seq.held.push(h);
                }
            }
            if seq.computed < seq.num_tokens {
                continue; // a prefill chunk that is not the last
            }
            seq.generated += 1;
            seq.num_tokens += 1;
            self.stats.generation_tokens_total += 1;
            if seq.generated == 1 {
                self.stats.prompt_tokens_total += u64::from(seq.prompt);
                events.push(EngineEvent::FirstToken { id: seq.id });
            } else if self.token_events {
                events.push(EngineEvent::Token { id: seq.id });
            }
            let reason = if seq.eos_after == Some(seq.generated) && seq.generated < seq.max_tokens {
                Some(FinishReason::Stop)
            } else if seq.generated >= seq.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                events.push(EngineEvent::Finished { id: seq.id, output_tokens: seq.generated, reason });
                seq.live = false;
                self.index.remove(&seq.id);
                self.release_blocks(slot);
                self.free_slots.push(slot);
                any_finished = true;
            }
        }
        if any_finished {
            let slots = &self.slots;
            self.running.retain(|&s| slots[s as usize].live);
        }
        info
    }

    /// `(hit blocks, of which unreferenced)` of the longest cached run of `seq`'s leading blocks,
    /// stopping short of its last token (which must be computed to produce the next one).
    fn cached_prefix(&self, seq: &Seq) -> (u32, u32) {
        if seq.hashes.is_empty() || self.cache.is_empty() {
            return (0, 0);
        }
        let most = ((seq.num_tokens - 1) / BLOCK_SIZE) as usize;
        let (mut hits, mut unused) = (0, 0);
        for &h in seq.hashes.iter().take(most) {
            if !self.cache.contains(h) {
                break;
            }
            hits += 1;
            unused += u32::from(self.cache.is_evictable(h));
        }
        (hits, unused)
    }

    /// Take `n` free blocks, evicting cached prefixes only when no empty block is left.
    fn take_blocks(&mut self, n: u32) {
        let empty = self.free_blocks - self.cache.evictable();
        for _ in empty..n {
            self.cache.evict_one();
        }
        self.free_blocks -= n;
    }

    /// Give back every block of `slot`. Its own blocks are free at once; a cached block it shares is
    /// free when its last user lets go, and stays cached (evictable) until its memory is needed.
    fn release_blocks(&mut self, slot: u32) {
        let seq = &mut self.slots[slot as usize];
        let mut freed = seq.blocks - seq.held.len() as u32;
        for h in seq.held.drain(..) {
            freed += u32::from(self.cache.release(h));
        }
        self.free_blocks += freed;
        seq.blocks = 0;
    }

    fn preempt(&mut self, slot: u32, events: &mut Vec<EngineEvent>) {
        self.release_blocks(slot);
        let seq = &mut self.slots[slot as usize];
        seq.computed = 0;
        self.waiting.push_front(slot);
        self.stats.num_preemptions += 1;
        events.push(EngineEvent::Preempted { id: seq.id });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Engine {
        Engine::new(&ModelProfile::tiny(), 1.0).unwrap()
    }

    /// Step until idle; returns (total time, events).
    fn drain(e: &mut Engine) -> (f64, Vec<EngineEvent>) {
        let mut t = 0.0;
        let mut ev = Vec::new();
        let mut guard = 0;
        while e.has_work() {
            t += e.step_into(&mut ev).duration_s;
            guard += 1;
            assert!(guard < 1_000_000, "engine does not drain");
        }
        (t, ev)
    }

    #[test]
    fn single_request_produces_exactly_max_tokens() {
        let mut e = tiny();
        e.add_request(EngineRequest::new(7, 100, 5)).unwrap();
        let (_, ev) = drain(&mut e);
        assert_eq!(ev[0], EngineEvent::Scheduled { id: 7 });
        assert_eq!(ev[1], EngineEvent::FirstToken { id: 7 });
        assert_eq!(ev.iter().filter(|x| matches!(x, EngineEvent::Token { .. })).count(), 4);
        assert_eq!(
            *ev.last().unwrap(),
            EngineEvent::Finished { id: 7, output_tokens: 5, reason: FinishReason::Length }
        );
        let s = e.stats();
        assert_eq!((s.running, s.waiting, s.used_blocks), (0, 0, 0));
        assert_eq!((s.prompt_tokens_total, s.generation_tokens_total), (100, 5));
    }

    #[test]
    fn eos_stops_early_with_reason_stop() {
        let mut e = tiny();
        e.add_request(EngineRequest { id: 1, prompt_tokens: 10, max_tokens: 50, eos_after: Some(3) })
            .unwrap();
        let (_, ev) = drain(&mut e);
        assert_eq!(
            *ev.last().unwrap(),
            EngineEvent::Finished { id: 1, output_tokens: 3, reason: FinishReason::Stop }
        );
    }

    #[test]
    fn long_prompt_is_prefilled_in_chunks() {
        let mut e = tiny(); // 256-token budget
        e.add_request(EngineRequest::new(1, 1000, 1)).unwrap();
        let mut steps = 0;
        let mut ev = Vec::new();
        while e.has_work() {
            let info = e.step_into(&mut ev);
            assert!(info.prefill_tokens <= 256);
            steps += 1;
        }
        assert_eq!(steps, 4); // 256 * 3 + 232
    }

    #[test]
    fn rejects_bad_sizes_like_vllm() {
        let mut e = tiny();
        assert_eq!(e.add_request(EngineRequest::new(1, 0, 5)), Err(RejectReason::EmptyPrompt));
        assert_eq!(e.add_request(EngineRequest::new(1, 5, 0)), Err(RejectReason::ZeroMaxTokens));
        let err = e.add_request(EngineRequest::new(1, 2000, 100)).unwrap_err();
        assert!(err.to_string().contains("maximum context length is 2048 tokens"), "{err}");
        assert!(err.to_string().contains("2100 tokens"), "{err}");
        e.add_request(EngineRequest::new(1, 5, 5)).unwrap();
        assert_eq!(e.add_request(EngineRequest::new(1, 5, 5)), Err(RejectReason::DuplicateId(1)));
    }

    #[test]
    fn max_num_seqs_caps_the_batch() {
        let mut e = tiny(); // 8 seqs
        for id in 0..20 {
            e.add_request(EngineRequest::new(id, 4, 10)).unwrap();
        }
        e.step();
        let s = e.stats();
        assert_eq!((s.running, s.waiting), (8, 12));
    }

    #[test]
    fn preemption_takes_the_newest_and_everyone_finishes() {
        // 256 blocks; 8 requests of 16-token prompts that each grow to ~1000 tokens cannot all fit.
        let mut e = tiny();
        for id in 0..8 {
            e.add_request(EngineRequest::new(id, 16, 1000)).unwrap();
        }
        let mut ev = Vec::new();
        let mut first_preempted = None;
        while e.has_work() {
            e.step_into(&mut ev);
            if first_preempted.is_none() {
                first_preempted = ev.iter().find_map(|x| match x {
                    EngineEvent::Preempted { id } => Some(*id),
                    _ => None,
                });
            }
            assert!(e.stats().used_blocks <= 256);
        }
        assert_eq!(first_preempted, Some(7), "the newest request is preempted first");
        let finished = ev.iter().filter(|x| matches!(x, EngineEvent::Finished { .. })).count();
        assert_eq!(finished, 8);
        assert!(e.stats().num_preemptions > 0);
    }

    #[test]
    fn slower_replica_takes_proportionally_longer() {
        let mut fast = tiny();
        let mut slow = Engine::new(&ModelProfile::tiny(), 0.5).unwrap();
        for e in [&mut fast, &mut slow] {
            e.add_request(EngineRequest::new(1, 300, 20)).unwrap();
        }
        let (tf, _) = drain(&mut fast);
        let (ts, _) = drain(&mut slow);
        assert!((ts / tf - 2.0).abs() < 1e-9, "{tf} {ts}");
    }

    #[test]
    fn abort_frees_blocks_everywhere() {
        let mut e = tiny();
        e.add_request(EngineRequest::new(1, 100, 100)).unwrap();
        e.add_request(EngineRequest::new(2, 100, 100)).unwrap();
        e.step();
        assert!(e.stats().used_blocks > 0);
        assert_eq!(e.abort(1), Some(1));
        assert_eq!(e.abort(2), Some(1));
        assert_eq!(e.abort(3), None);
        assert!(!e.has_work());
        assert_eq!(e.stats().used_blocks, 0);
        // Slots are reused.
        e.add_request(EngineRequest::new(1, 10, 1)).unwrap();
        let (_, ev) = drain(&mut e);
        assert!(matches!(ev.last(), Some(EngineEvent::Finished { id: 1, .. })));
    }

    #[test]
    fn token_events_can_be_turned_off() {
        let mut e = tiny();
        e.set_token_events(false);
        e.add_request(EngineRequest::new(1, 10, 50)).unwrap();
        let (_, ev) = drain(&mut e);
        assert_eq!(ev.len(), 3); // scheduled, first token, finished
    }

    fn blocks(ids: impl IntoIterator<Item = u64>) -> Arc<[u64]> {
        crate::prefix::chain(ids).into()
    }

    /// Prefill tokens computed while draining.
    fn prefilled(e: &mut Engine) -> u32 {
        let mut ev = Vec::new();
        let mut n = 0;
        while e.has_work() {
            n += e.step_into(&mut ev).prefill_tokens;
        }
        n
    }

    #[test]
    fn a_shared_prefix_is_prefilled_once_in_whole_blocks() {
        let mut e = tiny();
        // 20 blocks of shared prefix + 2 of its own; a 330-token prompt (20 full blocks + 10).
        let first = blocks((0..20).chain([100, 101]));
        e.add_request_with_blocks(EngineRequest::new(1, 330, 2), first).unwrap();
        assert_eq!(prefilled(&mut e), 330);
        let second = blocks((0..20).chain([200, 201]));
        e.add_request_with_blocks(EngineRequest::new(2, 330, 2), second).unwrap();
        assert_eq!(prefilled(&mut e), 330 - 20 * 16, "only the unshared tokens are computed");
        let s = e.stats();
        assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (660, 320));
        // The very same prompt again: everything but the last token's block is reused.
        let third = blocks((0..20).chain([200, 201]));
        e.add_request_with_blocks(EngineRequest::new(3, 320, 2), third).unwrap();
        assert_eq!(prefilled(&mut e), 16, "the last block is recomputed to produce a token");
        assert_eq!(e.stats().used_blocks, 0, "cached blocks are free memory");
    }

    #[test]
    fn cached_prefixes_give_way_to_memory_pressure_oldest_first() {
        let mut e = tiny(); // 256 blocks
        let prefix = |g: u64| blocks((0..100).map(move |i| g * 1000 + i));
        e.add_request_with_blocks(EngineRequest::new(1, 1600, 1), prefix(1)).unwrap();
        prefilled(&mut e);
        e.add_request_with_blocks(EngineRequest::new(2, 1600, 1), prefix(2)).unwrap();
        prefilled(&mut e);
        // 200 cached blocks; a request with no prefix needing 100 blocks evicts group 1's first.
        e.add_request(EngineRequest::new(3, 1600, 1)).unwrap();
        prefilled(&mut e);
        e.add_request_with_blocks(EngineRequest::new(4, 1600, 1), prefix(2)).unwrap();
        assert_eq!(prefilled(&mut e), 16, "group 2, freed last, is still cached");
        e.add_request_with_blocks(EngineRequest::new(5, 1600, 1), prefix(1)).unwrap();
        assert!(prefilled(&mut e) > 1000, "group 1 was evicted");
    }

    #[test]
    fn a_block_in_use_is_shared_not_copied() {
        let mut e = tiny();
        let p = || blocks(0..50);
        e.add_request_with_blocks(EngineRequest::new(1, 800, 200), p()).unwrap();
        for _ in 0..5 {
            e.step(); // prefill done, decoding: its 50 blocks are registered and held
        }
        let before = e.stats().used_blocks;
        e.add_request_with_blocks(EngineRequest::new(2, 800, 200), p()).unwrap();
        e.step();
        let added = e.stats().used_blocks - before;
        assert!(added <= 2, "the second request reuses the held blocks: {added} new");
        e.abort(1);
        e.abort(2);
        assert_eq!(e.stats().used_blocks, 0);
    }

    #[test]
    fn idle_step_lasts_zero() {
        let mut e = tiny();
        let out = e.step();
        assert_eq!(out.duration_s, 0.0);
        assert!(out.events.is_empty());
    }
}
