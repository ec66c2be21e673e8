//! What the simulated clients send: request sizes and arrival times.
//!
//! Lengths ([`LengthMix`]):
//! - `sharegpt`: log-normal prompt and output lengths with the means Kwon et al. report for the
//!   ShareGPT dataset in the vLLM/PagedAttention paper (SOSP 2023, section 6.1 and figure 11: mean
//!   input 161.31 tokens, mean output 337.99 tokens). The log-normal shape and its spreads
//!   (sigma 1.0 for prompts, 0.8 for outputs, the `sim` default) are our choice, not a fit to the raw
//!   data: they give the long right tail that dataset is known for (median prompt ~100 tokens, a few
//!   percent above 1,000). Prompts are cut to 4,096 and outputs to 2,048 tokens, and both to the
//!   model's `max_model_len`.
//! - `long-context`: the same, with a quarter of the requests replaced by long-document requests
//!   (RAG, summarization): prompts log-normal around 4,000 tokens (sigma 0.35, 1,500..7,000) and
//!   short answers around 200 tokens (sigma 0.6). The share and sizes are chosen, not sourced: they
//!   make KV cache, not the batch size, the limit, which is the point of this scenario.
//!
//! Arrivals ([`Arrivals`]): a non-homogeneous Poisson process by thinning (Lewis and Shedler): draw
//! candidates at the peak rate and keep each with probability rate(t)/peak. The rate is a base rate
//! times a [`RateShape`] factor (constant, a spike, a ramp).
//!
//! Each stream has its own seeded generator, so every balancer in a comparison sees exactly the
//! same requests at exactly the same times.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal};
use serde::Serialize;

/// Mean prompt length of ShareGPT, tokens (Kwon et al., SOSP 2023).
pub const SHAREGPT_MEAN_PROMPT: f64 = 161.31;
/// Mean output length of ShareGPT, tokens (same source).
pub const SHAREGPT_MEAN_OUTPUT: f64 = 337.99;
const PROMPT_SIGMA: f64 = 1.0;
const OUTPUT_SIGMA: f64 = 0.8;
const PROMPT_CAP: u32 = 4096;
const OUTPUT_CAP: u32 = 2048;
/// Share of long-document requests in the `long-context` mix.
pub const LONG_SHARE: f64 = 0.25;

/// Which request-size distribution clients draw from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LengthMix {
    Sharegpt,
    LongContext,
    /// Prompts in groups sharing a long prefix ([`super::prompts::SharedPrefix`]).
    SharedPrefix,
    /// Sessions resending their history ([`super::prompts::MultiTurn`]).
    MultiTurn,
}

impl LengthMix {
    pub fn name(self) -> &'static str {
        match self {
            LengthMix::Sharegpt => "sharegpt",
            LengthMix::LongContext => "long-context",
            LengthMix::SharedPrefix => "shared-prefix",
            LengthMix::MultiTurn => "multi-turn",
        }
    }

    /// Whether requests of this mix share prefixes (and come from [`super::prompts`]).
    pub fn has_structure(self) -> bool {
        matches!(self, LengthMix::SharedPrefix | LengthMix::MultiTurn)
    }
}

/// A sampler of (prompt tokens, output tokens) for one mix and one model length limit.
#[derive(Debug, Clone)]
pub struct Lengths {
    mix: LengthMix,
    max_model_len: u32,
    prompt: LogNormal<f64>,
    output: LogNormal<f64>,
    long_prompt: LogNormal<f64>,
    long_output: LogNormal<f64>,
}

/// Log-normal with the given mean (not median): mu = ln(mean) - sigma^2/2.
fn lognormal_mean(mean: f64, sigma: f64) -> LogNormal<f64> {
    // Parameters are constants checked by the unit tests; a bad one is a programming error.
    LogNormal::new(mean.ln() - sigma * sigma / 2.0, sigma).expect("finite log-normal parameters")
}

fn lognormal_median(median: f64, sigma: f64) -> LogNormal<f64> {
    LogNormal::new(median.ln(), sigma).expect("finite log-normal parameters")
}

impl Lengths {
    pub fn new(mix: LengthMix, max_model_len: u32) -> Lengths {
        Lengths {
            mix,
            max_model_len: max_model_len.max(2),
            prompt: lognormal_mean(SHAREGPT_MEAN_PROMPT, PROMPT_SIGMA),
            output: lognormal_mean(SHAREGPT_MEAN_OUTPUT, OUTPUT_SIGMA),
            long_prompt: lognormal_median(4000.0, 0.35),
            long_output: lognormal_median(200.0, 0.6),
        }
    }

    /// One request's (prompt, output) lengths, both >= 1 and together within `max_model_len`.
    pub fn sample(&self, rng: &mut ChaCha8Rng) -> (u32, u32) {
        let long = self.mix == LengthMix::LongContext && rng.gen_bool(LONG_SHARE);
        let (p, o) = if long {
            let p = self.long_prompt.sample(rng).clamp(1500.0, 7000.0);
            let o = self.long_output.sample(rng).clamp(1.0, 1024.0);
            (p, o)
        } else {
            let p = self.prompt.sample(rng).clamp(1.0, PROMPT_CAP as f64);
            let o = self.output.sample(rng).clamp(1.0, OUTPUT_CAP as f64);
            (p, o)
        };
        let mut o = (o.round() as u32).clamp(1, self.max_model_len / 2);
        let p = (p.round() as u32).clamp(1, self.max_model_len - o);
        o = o.min(self.max_model_len - p);
        (p, o)
    }
}

/// How the arrival rate changes over a run, as a factor of the base rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum RateShape {
    Constant,
    /// `factor` x the base rate from `start_s` to `end_s`.
    Spike {
        start_s: f64,
        end_s: f64,
        factor: f64,
    },
    /// From `from` x base at `start_s` linearly to `to` x base at `end_s`; flat before and after.
    Ramp {
        start_s: f64,
        end_s: f64,
        from: f64,
        to: f64,
    },
}

impl RateShape {
    pub fn factor(&self, t: f64) -> f64 {
        match *self {
            RateShape::Constant => 1.0,
            RateShape::Spike { start_s, end_s, factor } => {
                if (start_s..end_s).contains(&t) {
                    factor
                } else {
                    1.0
                }
            }
            RateShape::Ramp { start_s, end_s, from, to } => {
                if t <= start_s {
                    from
                } else if t >= end_s {
                    to
                } else {
                    from + (to - from) * (t - start_s) / (end_s - start_s)
                }
            }
        }
    }

    /// Largest factor over the run (the thinning envelope).
    pub fn peak(&self) -> f64 {
        match *self {
            RateShape::Constant => 1.0,
            RateShape::Spike { factor, .. } => factor.max(1.0),
            RateShape::Ramp { from, to, .. } => from.max(to),
        }
    }
}

/// Arrival times of a non-homogeneous Poisson process, one at a time.
#[derive(Debug, Clone)]
pub struct Arrivals {
    base_rps: f64,
    shape: RateShape,
    peak_rps: f64,
    t: f64,
}

impl Arrivals {
    pub fn new(base_rps: f64, shape: RateShape) -> Arrivals {
        let peak_rps = base_rps * shape.peak();
        Arrivals { base_rps, shape, peak_rps, t: 0.0 }
    }

    /// Time of the next arrival, or `None` when the rate is zero everywhere.
    pub fn next(&mut self, rng: &mut ChaCha8Rng) -> Option<f64> {
        if !(self.peak_rps > 0.0 && self.peak_rps.is_finite()) {
            return None;
        }
        loop {
            // Exponential gap at the peak rate; 1 - u is in (0, 1], so the log is finite.
            let u: f64 = rng.gen();
            self.t += -(1.0 - u).ln() / self.peak_rps;
            let keep = self.base_rps * self.shape.factor(self.t) / self.peak_rps;
            if keep >= 1.0 || rng.gen::<f64>() < keep {
                return Some(self.t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn sharegpt_means_are_close_to_the_paper() {
        let l = Lengths::new(LengthMix::Sharegpt, 8192);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let n = 200_000;
        let (mut sp, mut so) = (0u64, 0u64);
        for _ in 0..n {
            let (p, o) = l.sample(&mut rng);
            assert!(p >= 1 && o >= 1 && p + o <= 8192);
            sp += p as u64;
            so += o as u64;
        }
        let (mp, mo) = (sp as f64 / n as f64, so as f64 / n as f64);
        // Caps trim the tail a little.
        assert!((mp - SHAREGPT_MEAN_PROMPT).abs() / SHAREGPT_MEAN_PROMPT < 0.05, "{mp}");
        assert!((mo - SHAREGPT_MEAN_OUTPUT).abs() / SHAREGPT_MEAN_OUTPUT < 0.05, "{mo}");
    }

    #[test]
    fn long_context_mix_has_a_quarter_long_prompts_and_fits_small_models() {
        let l = Lengths::new(LengthMix::LongContext, 8192);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let long = (0..10_000).filter(|_| l.sample(&mut rng).0 >= 1500).count();
        assert!((2200..2900).contains(&long), "{long}");
        let small = Lengths::new(LengthMix::LongContext, 2048);
        for _ in 0..10_000 {
            let (p, o) = small.sample(&mut rng);
            assert!(p >= 1 && o >= 1 && p + o <= 2048, "{p} {o}");
        }
    }

    #[test]
    fn poisson_rate_and_spike_are_respected() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let shape = RateShape::Spike { start_s: 100.0, end_s: 200.0, factor: 2.0 };
        let mut a = Arrivals::new(50.0, shape);
        let (mut before, mut during) = (0, 0);
        while let Some(t) = a.next(&mut rng) {
            if t >= 200.0 {
                break;
            }
            if t < 100.0 {
                before += 1;
            } else {
                during += 1;
            }
        }
        assert!((4700..5300).contains(&before), "{before}");
        assert!((9400..10600).contains(&during), "{during}");
    }

    #[test]
    fn ramp_interpolates() {
        let r = RateShape::Ramp { start_s: 0.0, end_s: 10.0, from: 0.2, to: 1.0 };
        assert!((r.factor(5.0) - 0.6).abs() < 1e-12);
        assert_eq!(r.factor(20.0), 1.0);
        assert_eq!(r.peak(), 1.0);
    }
}
