//! Model/GPU profiles: the numbers that make the engine model behave like one model on one GPU.
//!
//! A profile holds vLLM's scheduler limits (`max_num_seqs`, `max_num_batched_tokens`, KV blocks) and
//! the four coefficients of the step-time model in [`crate::engine`]:
//!
//! ```text
//! step_s = (overhead + prefill_token * prefill_tokens + seq * seqs_in_batch + kv_token * kv_tokens_read) / speed
//! ```
//!
//! Where each number of [`ModelProfile::llama_8b_h100`] comes from (also in `src/sim/README.md`,
//! with the fidelity test's results):
//! - KV capacity: Llama-3.1-8B has 32 layers, 8 KV heads of dim 128, bf16: one token of KV is
//!   2 (K,V) x 32 x 8 x 128 x 2 bytes = 128 KiB (Hugging Face's Llama 3.1 blog lists 0.125 GB per
//!   1k tokens for 8B). An 80 GB H100 at vLLM's default `gpu_memory_utilization=0.9` gives 72 GB;
//!   minus ~16 GB of weights and ~4 GB of activations/CUDA graphs leaves ~52 GB = ~400k tokens =
//!   25,000 blocks of 16.
//! - Fixed step cost 6.0 ms: decode at batch 1 is memory-bound. 16 GB of weights over H100 SXM's
//!   3.35 TB/s (NVIDIA datasheet) is 4.8 ms at the roofline; a published vLLM sweep of this model on
//!   A100-40GB measured 75 tok/s at concurrency 1, 77% of that GPU's bandwidth roofline
//!   (johnmusgrave.com, "vLLM throughput-latency sweep on NVIDIA A100"). The same efficiency on H100
//!   gives 6.2 ms per token, i.e. ~160 tok/s.
//! - KV read 45 ns per token of context per step: 128 KiB at 3.35 TB/s is 39 ns at the roofline;
//!   paged decode attention reaches ~85% of it.
//! - Per-sequence 12 us: the batched GEMMs stop being free as the batch approaches H100's ridge
//!   point (~300 tokens), plus sampling and scheduler CPU per sequence. Fitted so that 256
//!   sequences at ShareGPT-like context (~512 tokens) decode at ~15 ms per token, the upper end of
//!   the 6-15 ms ITL range reported for 8B on H100 from batch 1 to large batches.
//! - Prefill 35 us per token (~28k tok/s): compute-bound, 2 x 8e9 = 16 GFLOP per token at ~45% of
//!   H100's 989 dense bf16 TFLOPS. A 1k-token prompt on an idle server: TTFT ~41 ms.
//! - Scheduler limits: vLLM's long-standing defaults `max_num_seqs=256`, chunked prefill with
//!   `max_num_batched_tokens=8192` (vLLM V1 on H100-class GPUs; newer releases raise
//!   `max_num_seqs` to 1024 for the OpenAI server, most deployments pin 256), `max_model_len=8192`
//!   as a typical deployment cap, and vLLM v0's 1% admission `watermark`.
//! - A slower GPU generation is `speed=0.5`: Lambda's vLLM benchmark reports H100 ~2x A100 on
//!   both throughput and latency (LambdaLabsML/vllm-benchmark).
//!
//! [`ModelProfile::llamacpp_cpu`] is llama.cpp's `llama-server` serving the seeded random-weight
//! tiny llama of `tests/llamacpp/` (4 layers, 256 wide, 32k vocabulary, F32) on one CPU thread of
//! this class of machine: each slot is one sequence of the batch (`--parallel` = `max_num_seqs`,
//! set per replica with [`ModelProfile::with_slots`]) with its own 1024 tokens of context (`-c`
//! is the sum over the slots), and the whole prompt is one step (llama.cpp's `n_batch` 2048). Its
//! step coefficients are measured on the real server, not chosen: `src/bench/RESULTS.md` ("The
//! simulator against a real llama-server") has the measurement and the side-by-side check.
//!
//! [`ModelProfile::tiny`] is a small, fast profile for unit and HTTP tests: its numbers are chosen,
//! not measured, so that queueing, preemption and saturation show up with a handful of requests.

use serde::{Deserialize, Serialize};

/// Tokens per KV block (vLLM's default `block_size` on CUDA).
pub const BLOCK_SIZE: u32 = 16;

/// Context of one llama.cpp slot, tokens (the tests' `-c` is this times the slots).
pub const LLAMACPP_CTX_PER_SLOT: u32 = 1024;
// The random-weight tiny llama on one CPU thread, measured on the real server (RESULTS.md, "The
// simulator against a real llama-server"): a decode step by batch size, from the per-request
// `timings.predicted_ms / predicted_n` of 1-4 concurrent streaming 256-token requests (medians of
// 8, two runs; streaming costs the server 2-8% over plain answers, and the checks stream), and
// the prompt's cost per token from idle prompts of ~24 and ~410 tokens (the difference of their
// `prompt_ms`; the step under it is the batch-1 step). Its 32k-entry output layer, computed for
// every sequence in the batch, is most of a step; the prompt's tokens skip it.
const LLAMACPP_BATCH_STEP_S: [f64; 4] = [1.60e-3, 2.89e-3, 4.34e-3, 3.29e-3];
const LLAMACPP_PREFILL_TOKEN_S: f64 = 0.105e-3;

/// Everything the engine model needs to know about one model on one GPU type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    /// Profile name, as given to `--profile`.
    pub name: String,
    /// Model name served by default (`/v1/models`, `model_name` label).
    pub model: String,
    /// Longest sequence (prompt + output) the model accepts, in tokens.
    pub max_model_len: u32,
    /// KV cache capacity, in blocks of [`BLOCK_SIZE`] tokens.
    pub num_gpu_blocks: u32,
    /// Admission keeps this fraction of blocks free (vLLM v0 `watermark`).
    pub watermark: f64,
    /// Most sequences in one batch (vLLM `max_num_seqs`).
    pub max_num_seqs: u32,
    /// Token budget of one step, prefill chunks + decodes (vLLM `max_num_batched_tokens`).
    pub max_num_batched_tokens: u32,
    /// Fixed cost of one step, seconds (weights read, launches, scheduling).
    pub step_overhead_s: f64,
    /// Cost per prompt token computed in a step, seconds.
    pub prefill_token_s: f64,
    /// Cost per sequence in the batch, seconds.
    pub seq_s: f64,
    /// Cost per token of KV read by attention, seconds.
    pub kv_token_s: f64,
    /// Measured cost of one step by batch size (index 0 = one sequence), replacing
    /// `overhead + seq x batch` where given: a CPU's batched matrix products are not linear in
    /// the batch (llama.cpp on one thread runs a batch of 4 faster than one of 3). Past the end,
    /// the last entry's cost per sequence.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batch_step_s: Vec<f64>,
    /// Time the server's front end takes before the engine sees a request (parsing, tokenizing,
    /// handing it to the engine process), seconds; a client sees it in its TTFT, no slot is held.
    /// Real vLLM 0.32 on the CPU: 5-7 ms (tests/vllm_fidelity.rs measures it). Only the HTTP
    /// simulator applies it; the benchmark's engines run without a front end.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub request_overhead_s: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// A profile that cannot run: the engine would reject every request or loop forever.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProfileError {
    #[error("profile {name}: {what}; fix the profile numbers")]
    Invalid { name: String, what: String },
    #[error("unknown profile {0:?}; known profiles: {known}", known = ModelProfile::NAMES.join(", "))]
    Unknown(String),
}

impl ModelProfile {
    /// Names accepted by [`ModelProfile::by_name`].
    pub const NAMES: &'static [&'static str] = &["llama-8b-h100", "llamacpp-cpu", "tiny"];

    /// Look a built-in profile up by name.
    pub fn by_name(name: &str) -> Result<ModelProfile, ProfileError> {
        match name {
            "llama-8b-h100" => Ok(Self::llama_8b_h100()),
            "llamacpp-cpu" => Ok(Self::llamacpp_cpu()),
            "tiny" => Ok(Self::tiny()),
            other => Err(ProfileError::Unknown(other.to_string())),
        }
    }

    /// Llama-3.1-8B-Instruct, bf16, on one H100 SXM 80 GB (sources in the module doc).
    pub fn llama_8b_h100() -> ModelProfile {
        ModelProfile {
            name: "llama-8b-h100".into(),
            model: "meta-llama/Llama-3.1-8B-Instruct".into(),
            max_model_len: 8192,
            num_gpu_blocks: 25_000,
            watermark: 0.01,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            step_overhead_s: 6.0e-3,
            prefill_token_s: 35e-6,
            seq_s: 12e-6,
            kv_token_s: 45e-9,
            batch_step_s: Vec::new(),
            request_overhead_s: 0.0,
        }
    }

    /// llama.cpp's `llama-server` with the random-weight tiny llama on one CPU thread, one slot
    /// (module doc; [`ModelProfile::with_slots`] for more).
    pub fn llamacpp_cpu() -> ModelProfile {
        ModelProfile {
            name: "llamacpp-cpu".into(),
            model: "random-llama-s1.gguf".into(),
            max_model_len: LLAMACPP_CTX_PER_SLOT,
            num_gpu_blocks: LLAMACPP_CTX_PER_SLOT / BLOCK_SIZE,
            watermark: 0.0,
            max_num_seqs: 1,
            max_num_batched_tokens: 2048,
            step_overhead_s: LLAMACPP_BATCH_STEP_S[0],
            prefill_token_s: LLAMACPP_PREFILL_TOKEN_S,
            seq_s: 0.0,
            kv_token_s: 0.0,
            batch_step_s: LLAMACPP_BATCH_STEP_S.to_vec(),
            request_overhead_s: 0.0,
        }
    }

    /// The same engine with `slots` slots, as `llama-server --parallel slots`: each slot brings
    /// its own context, so the cache grows with them (`-c` is summed over the slots).
    pub fn with_slots(mut self, slots: u32) -> ModelProfile {
        let per_slot = self.num_gpu_blocks / self.max_num_seqs.max(1);
        self.max_num_seqs = slots;
        self.num_gpu_blocks = per_slot.saturating_mul(slots);
        self
    }

    /// A small, fast profile for tests: 4096 tokens of KV, 8 sequences, 256-token steps.
    pub fn tiny() -> ModelProfile {
        ModelProfile {
            name: "tiny".into(),
            model: "sim-tiny".into(),
            max_model_len: 2048,
            num_gpu_blocks: 256,
            watermark: 0.01,
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
            step_overhead_s: 2.0e-3,
            prefill_token_s: 20e-6,
            seq_s: 100e-6,
            kv_token_s: 200e-9,
            batch_step_s: Vec::new(),
            request_overhead_s: 0.0,
        }
    }

    /// What the batch costs in a step, before prompt tokens and KV reads: the measured table
    /// where there is one, else `overhead + seq x batch`.
    pub fn batch_cost_s(&self, batch: u32) -> f64 {
        match self.batch_step_s.len() {
            0 => self.step_overhead_s + self.seq_s * f64::from(batch),
            n if (batch as usize) <= n => self.batch_step_s[(batch.max(1) - 1) as usize],
            n => self.batch_step_s[n - 1] / n as f64 * f64::from(batch),
        }
    }

    /// KV capacity in tokens.
    pub fn kv_capacity_tokens(&self) -> u64 {
        u64::from(self.num_gpu_blocks) * u64::from(BLOCK_SIZE)
    }

    /// Blocks admission keeps free.
    pub fn watermark_blocks(&self) -> u32 {
        (self.watermark * f64::from(self.num_gpu_blocks)).floor() as u32
    }

    /// Check that the numbers can run: every accepted request must fit the cache on its own, so
    /// no request can wait forever.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let bad = |what: String| Err(ProfileError::Invalid { name: self.name.clone(), what });
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 || self.max_model_len == 0 {
            return bad("max_num_seqs, max_num_batched_tokens and max_model_len must be > 0".into());
        }
        if !(0.0..0.5).contains(&self.watermark) {
            return bad(format!("watermark {} must be in [0, 0.5)", self.watermark));
        }
        let need = self.max_model_len.div_ceil(BLOCK_SIZE) + self.watermark_blocks();
        if need > self.num_gpu_blocks {
            return bad(format!(
                "num_gpu_blocks {} cannot hold one max_model_len sequence plus the watermark ({need} blocks)",
                self.num_gpu_blocks
            ));
        }
        let coeffs = [self.step_overhead_s, self.prefill_token_s, self.seq_s, self.kv_token_s];
        if coeffs.iter().any(|c| !c.is_finite() || *c < 0.0) || self.step_overhead_s <= 0.0 {
            return bad("step-time coefficients must be finite, >= 0, and the overhead > 0".into());
        }
        if self.batch_step_s.iter().any(|c| !c.is_finite() || *c <= 0.0) {
            return bad("batch_step_s entries must be finite and > 0".into());
        }
        if !(0.0..=60.0).contains(&self.request_overhead_s) {
            return bad(format!("request_overhead_s {} must be in [0, 60] seconds", self.request_overhead_s));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_are_valid() {
        for name in ModelProfile::NAMES {
            let p = ModelProfile::by_name(name).unwrap();
            p.validate().unwrap();
            assert_eq!(&p.name, name);
        }
    }

    #[test]
    fn h100_profile_holds_about_400k_tokens() {
        let cap = ModelProfile::llama_8b_h100().kv_capacity_tokens();
        assert!((350_000..=450_000).contains(&cap), "{cap}");
    }

    #[test]
    fn unknown_profile_lists_known_ones() {
        let e = ModelProfile::by_name("gpt-5").unwrap_err().to_string();
        assert!(e.contains("llama-8b-h100") && e.contains("llamacpp-cpu") && e.contains("tiny"), "{e}");
    }

    #[test]
    fn llamacpp_slots_bring_their_context_and_the_table_prices_the_batch() {
        let p = ModelProfile::llamacpp_cpu().with_slots(4);
        p.validate().unwrap();
        assert_eq!((p.max_num_seqs, p.kv_capacity_tokens()), (4, 4 * u64::from(LLAMACPP_CTX_PER_SLOT)));
        // Measured, not linear: a batch of 4 costs less than one of 3.
        assert!(p.batch_cost_s(4) < p.batch_cost_s(3));
        assert_eq!(p.batch_cost_s(1), LLAMACPP_BATCH_STEP_S[0]);
        assert!((p.batch_cost_s(8) - 2.0 * LLAMACPP_BATCH_STEP_S[3]).abs() < 1e-12);
        let h = ModelProfile::llama_8b_h100();
        assert!((h.batch_cost_s(2) - (h.step_overhead_s + 2.0 * h.seq_s)).abs() < 1e-15);
    }

    #[test]
    fn too_small_cache_is_rejected() {
        let mut p = ModelProfile::tiny();
        p.num_gpu_blocks = 10;
        assert!(p.validate().is_err());
    }
}
