//! What "capacity" means, so that `--load 0.85` means something.
//!
//! The capacity of one replica is its saturation throughput in requests per second for the
//! scenario's length mix: a closed-loop calibration run of one engine (the same [`Engine`] code) at
//! speed 1 that always holds twice `max_num_seqs` requests, so the batch is full and a queue is
//! always waiting. After a warm-up of 4x that many completions, it counts the next 20x (at least
//! 2,000) and divides by the virtual time they took. Step time scales exactly with 1/speed, so a
//! replica at speed `s` has `s` times that capacity, and the fleet's capacity is the sum over
//! replicas of `speed_i x capacity(profile_i)` (a replica with a smaller KV cache is calibrated with
//! its own profile), taken at the start of the run (a replica that degrades
//! later lowers the real capacity; the offered load stays what it was).
//!
//! The calibration uses its own fixed seed: capacity is a property of (profile, mix), not of the
//! run's seed. Results are cached for the process.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::prompts::{MultiTurn, SharedPrefix};
use super::workload::{LengthMix, Lengths};
use llm_lc_sim::engine::{Engine, EngineEvent, EngineRequest};
use llm_lc_sim::profile::ModelProfile;

const CALIBRATION_SEED: u64 = 0xca11_b8a7;

fn cache() -> &'static Mutex<HashMap<(String, LengthMix), f64>> {
    static CACHE: OnceLock<Mutex<HashMap<(String, LengthMix), f64>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Saturation throughput of one speed-1 replica, requests/s.
pub fn replica_rps(profile: &ModelProfile, mix: LengthMix) -> Result<f64, String> {
    let key = (format!("{profile:?}"), mix);
    if let Some(v) = cache().lock().ok().and_then(|c| c.get(&key).copied()) {
        return Ok(v);
    }
    let v = calibrate(profile, mix)?;
    if let Ok(mut c) = cache().lock() {
        c.insert(key, v);
    }
    Ok(v)
}

fn calibrate(profile: &ModelProfile, mix: LengthMix) -> Result<f64, String> {
    let mut engine = Engine::new(profile, 1.0).map_err(|e| e.to_string())?;
    engine.set_token_events(false);
    let lengths = Lengths::new(mix, profile.max_model_len);
    let mut rng = ChaCha8Rng::seed_from_u64(CALIBRATION_SEED);
    let mut draw = sizes(mix, profile.max_model_len, &mut rng);
    let depth = 2 * profile.max_num_seqs as u64;
    let warm = 4 * depth;
    let measure = (20 * depth).max(2000);
    let mut next_id = 0u64;
    let mut add = |engine: &mut Engine, rng: &mut ChaCha8Rng| -> Result<(), String> {
        let (p, o) = match draw.as_mut() {
            Some(draw) => draw(rng),
            None => lengths.sample(rng),
        };
        next_id += 1;
        engine.add_request(EngineRequest::new(next_id, p, o)).map_err(|e| e.to_string())
    };
    for _ in 0..depth {
        add(&mut engine, &mut rng)?;
    }
    let (mut t, mut done, mut t_start) = (0.0, 0u64, 0.0);
    let mut events = Vec::new();
    while done < warm + measure {
        events.clear();
        let info = engine.step_into(&mut events);
        if info.duration_s <= 0.0 {
            return Err(format!("profile {}: the engine stopped making progress", profile.name));
        }
        t += info.duration_s;
        for ev in &events {
            if let EngineEvent::Finished { .. } = ev {
                done += 1;
                if done == warm {
                    t_start = t;
                }
                add(&mut engine, &mut rng)?;
            }
        }
    }
    Ok(measure as f64 / (t - t_start))
}

/// One request's (prompt, output) tokens per call.
type SizeDraw = Box<dyn FnMut(&mut ChaCha8Rng) -> (u32, u32)>;

/// Sizes of the structured mixes, without their blocks: capacity is what the fleet serves with
/// no reuse at all. `None` for the plain mixes, which [`Lengths`] draws.
fn sizes(mix: LengthMix, max_model_len: u32, rng: &mut ChaCha8Rng) -> Option<SizeDraw> {
    match mix {
        LengthMix::Sharegpt | LengthMix::LongContext => None,
        LengthMix::SharedPrefix => {
            let mut w = SharedPrefix::new(max_model_len, rng);
            Some(Box::new(move |rng| w.sizes(rng)))
        }
        LengthMix::MultiTurn => {
            let mut w = MultiTurn::new(max_model_len);
            let mut queue: Vec<(u32, u32)> = Vec::new();
            Some(Box::new(move |rng| loop {
                if let Some(s) = queue.pop() {
                    return s;
                }
                w.sizes(rng, &mut queue);
                queue.reverse();
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h100_sharegpt_capacity_is_plausible_and_cached() {
        let p = ModelProfile::llama_8b_h100();
        let c = replica_rps(&p, LengthMix::Sharegpt).unwrap();
        // ~340 output tokens per request; an 8B model on one H100 serves a few thousand to ~20k
        // output tokens/s at full batch.
        let tok_s = c * 338.0;
        assert!((3_000.0..25_000.0).contains(&tok_s), "{c} req/s = {tok_s} tok/s");
        assert_eq!(replica_rps(&p, LengthMix::Sharegpt).unwrap(), c);
        let long = replica_rps(&p, LengthMix::LongContext).unwrap();
        assert!(long < c, "long prompts cost more: {long} vs {c}");
    }
}
