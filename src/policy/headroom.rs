//! `headroom`: the memoryless baseline. Each member's ratio is proportional to its headroom
//! `1 / (1 + score)`, where the score weighs KV usage and queue; nothing is remembered between cycles.
//!
//! It is the obvious first design and it oscillates under feedback from the balancer: a loaded server
//! gets a low ratio, drains, gets a high ratio, overloads. It stays selectable so the benchmark can
//! show the difference.

use serde::Deserialize;

use super::Inputs;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HeadroomParams {
    /// Weight of KV-cache usage (or of the running batch, for servers without a KV metric).
    pub kv_weight: f64,
    /// Weight of the queue.
    pub queue_weight: f64,
    /// Waiting requests that count as a full queue.
    pub queue_norm: f64,
    /// Running requests that count as a full batch, for servers that publish no KV usage.
    pub running_norm: f64,
}

impl Default for HeadroomParams {
    fn default() -> Self {
        HeadroomParams { kv_weight: 1.0, queue_weight: 1.0, queue_norm: 8.0, running_norm: 64.0 }
    }
}

impl HeadroomParams {
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut e = Vec::new();
        for (v, f) in [(self.kv_weight, "kv_weight"), (self.queue_weight, "queue_weight")] {
            if !(v.is_finite() && v >= 0.0) {
                e.push((f.to_string(), "must be a finite number >= 0".to_string()));
            }
        }
        if self.kv_weight + self.queue_weight <= 0.0 {
            e.push(("kv_weight".into(), "kv_weight and queue_weight cannot both be 0".into()));
        }
        for (v, f) in [(self.queue_norm, "queue_norm"), (self.running_norm, "running_norm")] {
            if !(v.is_finite() && v > 0.0) {
                e.push((f.to_string(), "must be > 0".to_string()));
            }
        }
        e
    }
}

pub struct Headroom {
    pub params: HeadroomParams,
}

impl Headroom {
    pub fn new(params: HeadroomParams) -> Self {
        Headroom { params }
    }

    pub fn compute(&self, input: &Inputs<'_>) -> Vec<u32> {
        let p = &self.params;
        let (lo, hi) = (input.range.min as f64, input.range.max as f64);
        input
            .fresh
            .iter()
            .map(|f| {
                let s = f.sample;
                let busy = match s.kv_usage {
                    Some(kv) => kv,
                    None => s.running / p.running_norm,
                };
                let score = p.kv_weight * busy + p.queue_weight * s.waiting / p.queue_norm;
                // Headroom 1/(1+score): full ratio when idle, half at a full cache, and still falling
                // (never flat) as the queue grows, so more load never earns a higher ratio.
                input.range.clamp(lo + (hi - lo) / (1.0 + score))
            })
            .collect()
    }
}
