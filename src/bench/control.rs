//! The controller as the benchmark drives it: observations in, weights out, in virtual time.
//!
//! This crate does not depend on the controller (the controller's binary depends on the tools, so
//! the arrow cannot point back). The controller hands in a [`ControlFactory`] instead; its
//! implementation (in the controller's `tools` module) runs the controller's real per-pool cycle
//! (policy, fail-static, drain guard, change policy) on these observations. What the benchmark
//! measures is what the controller runs.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;

/// What the controller's source reports for one replica.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    pub waiting: f64,
    pub running: f64,
    /// KV-cache usage, 0..1.
    pub kv_usage: f64,
    /// Mean processing time over the source's window; `None` when no request finished in it.
    pub latency_s: Option<f64>,
    /// Mean time requests ran (queue excluded) over the same window, as vLLM's
    /// `vllm:request_inference_time_seconds` says; `None` when no request finished in it.
    pub service_s: Option<f64>,
    /// How old the observation is.
    pub age_s: f64,
}

/// The controller's settings for one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ControlSpec {
    /// Policy name (`capacity`, `feedback`, `headroom`) and `KEY=VALUE` parameters, as in the config file.
    pub policy: String,
    pub policy_params: Vec<String>,
    pub ratio_min: u32,
    pub ratio_max: u32,
    /// The controller's cycle interval.
    pub push_interval_s: f64,
    pub stale_after_s: f64,
    pub grace_s: f64,
    pub replicas: usize,
    /// What the ratios feed: `round-robin` (weighted round robin) or `least-connections` (the
    /// weighted least-request family). A policy that cares (`capacity`'s `mode`) takes it from here
    /// unless the parameters set it; empty when unknown.
    pub lb_mode: String,
    /// Every weight write is a configuration change on the load balancer (BIG-IP): the controller
    /// then writes a member only when its ratio moved enough or a while has passed (its change
    /// policy for such sinks), and the benchmark counts what that costs.
    pub config_writes: bool,
    /// Priority tiers: each replica's tier (0 = preferred), empty for one flat pool. With tiers the
    /// controller pushes 0 for replicas of inactive tiers (`region-spill`, `spill-over`).
    pub tiers: Vec<usize>,
    /// Priority pooling's thresholds (`spill_at`, `return_below`); `None`: the controller's defaults.
    pub spill_at: Option<f64>,
    pub return_below: Option<f64>,
}

impl ControlSpec {
    /// The ratio every member has before the first push (a freshly configured pool).
    pub fn initial_ratio(&self) -> u32 {
        let mid = (f64::from(self.ratio_min) + f64::from(self.ratio_max)) / 2.0;
        (mid.round() as u32).clamp(self.ratio_min, self.ratio_max)
    }
}

/// One pool's controller in a run.
pub trait Control: Send {
    /// One cycle at virtual time `now_s`: the weights to give the balancer (one per replica, in
    /// order), or `None` to leave its weights as they are (fail-static).
    fn cycle(&mut self, now_s: f64, observations: &[Option<Observation>]) -> Option<Vec<u32>>;
}

/// Builds a [`Control`] per run; supplied by the controller.
pub trait ControlFactory: Send + Sync {
    /// Check the spec (policy name and parameters) before any run starts.
    fn check(&self, spec: &ControlSpec) -> Result<(), String>;
    fn build(&self, spec: &ControlSpec) -> Result<Box<dyn Control>, String>;
}

/// A shareable factory (the runs of a sweep execute on several threads).
#[derive(Clone)]
pub struct Controller(pub Arc<dyn ControlFactory>);

impl fmt::Debug for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Controller(..)")
    }
}
