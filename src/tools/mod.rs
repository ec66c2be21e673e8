//! The tools' side of the controller (feature `tools`): what the benchmark and the demo drive.
//!
//! The tool crates never depend on this crate (its binary depends on them), so they declare what
//! they need as traits and this module implements them with the controller's real parts:
//! - [`BenchControl`]: the benchmark's controller in the loop is a [`Cycle`], the same state machine
//!   the controller runs, fed the simulated observations in virtual time;
//! - [`InProcess`]: the demo starts the real controller from a config document, in-process;
//! - [`scale`]: `bench --controller-scale`, the cost of the real cycle at 10,000 members.

pub mod scale;

use std::sync::Arc;
use std::time::{Duration, Instant};

use llm_lc_adapters::{MemberId, Ratios};
use llm_lc_bench::control::{
    Control, ControlFactory, ControlSpec, Controller as BenchController, Observation,
};

use crate::control_loop::{self, Output};
use crate::controller::Controller;
use crate::cycle::change::ChangePolicy;
use crate::cycle::OnStale;
use crate::cycle::{Cycle, CycleSettings, Decision, PushResult, Sampled};
use crate::policy::{PolicyConfig, PoolPolicy};
use crate::priority::PriorityConfig;
use crate::ratio::RatioRange;
use crate::source::{Sample, Snapshot};
use crate::telemetry::Telemetry;

/// `feedback` + `gain=0.3` -> the same `PolicyConfig` a config file with those fields would give,
/// checked by the same validation.
pub fn parse_policy(name: &str, params: &[String]) -> Result<PolicyConfig, String> {
    let mut obj = serde_json::Map::new();
    obj.insert("kind".into(), serde_json::Value::String(name.to_string()));
    for p in params {
        let (k, v) = p
            .split_once('=')
            .ok_or_else(|| format!("--policy-param {p:?}: write KEY=VALUE, e.g. gain=0.3"))?;
        let value = match v.trim().parse::<f64>() {
            Ok(x) => serde_json::json!(x),
            Err(_) => serde_json::Value::String(v.trim().to_string()),
        };
        obj.insert(k.trim().to_string(), value);
    }
    let cfg: PolicyConfig = serde_json::from_value(serde_json::Value::Object(obj)).map_err(|e| {
        format!("policy {name:?} with {params:?}: {e} (known policies: capacity, feedback, headroom)")
    })?;
    let problems = cfg.validate();
    if !problems.is_empty() {
        let msg: Vec<String> = problems.into_iter().map(|(f, m)| format!("{f}: {m}")).collect();
        return Err(format!("policy {name}: {}", msg.join("; ")));
    }
    Ok(cfg)
}

/// The benchmark's tiers as a config file's `priority:` would give them: tier `k` names its
/// replicas' ids, the last tier takes the rest; thresholds default as in the config.
pub fn priority_config(spec: &ControlSpec) -> Result<Option<PriorityConfig>, String> {
    let Some(&last) = spec.tiers.iter().max() else {
        // No tiers, but thresholds given: check them the same way (one dummy pair of tiers).
        if spec.spill_at.is_none() && spec.return_below.is_none() {
            return Ok(None);
        }
        return priority_config(&ControlSpec { tiers: vec![0, 1], ..spec.clone() }).map(|_| None);
    };
    let tiers: Vec<serde_json::Value> = (0..=last)
        .map(|k| {
            let ids: Vec<String> = (0..spec.tiers.len())
                .filter(|&r| spec.tiers[r] == k)
                .map(|r| regex::escape(bench_member(r).as_str()))
                .collect();
            match (k == last, ids.is_empty()) {
                (true, _) => serde_json::json!({ "name": format!("tier{k}") }),
                (false, true) => serde_json::json!({ "name": format!("tier{k}"), "members": "" }),
                (false, false) => serde_json::json!({ "name": format!("tier{k}"), "members": ids.join("|") }),
            }
        })
        .collect();
    let mut obj = serde_json::json!({ "tiers": tiers });
    if let Some(v) = spec.spill_at {
        obj["spill_at"] = serde_json::json!(v);
    }
    if let Some(v) = spec.return_below {
        obj["return_below"] = serde_json::json!(v);
    }
    let cfg: PriorityConfig = serde_json::from_value(obj).map_err(|e| format!("priority tiers: {e}"))?;
    let problems = cfg.validate();
    if !problems.is_empty() {
        let msg: Vec<String> = problems.into_iter().map(|(f, m)| format!("{f}: {m}")).collect();
        return Err(format!("--spill-at / --return-below: {}", msg.join("; ")));
    }
    Ok(Some(cfg))
}

/// The member id of replica `r` in the benchmark.
fn bench_member(r: usize) -> MemberId {
    MemberId::new(format!("replica-{r:03}:8000"))
}

/// Builds [`BenchControl`]s for the benchmark.
pub struct BenchControls;

impl BenchControls {
    pub fn shared() -> BenchController {
        BenchController(Arc::new(BenchControls))
    }
}

impl ControlFactory for BenchControls {
    fn check(&self, spec: &ControlSpec) -> Result<(), String> {
        parse_policy(&spec.policy, &spec.policy_params)?;
        priority_config(spec).map(|_| ())
    }

    fn build(&self, spec: &ControlSpec) -> Result<Box<dyn Control>, String> {
        Ok(Box::new(BenchControl::new(spec)?))
    }
}

/// One pool's controller in a benchmark run: the real [`Cycle`] on simulated observations. The
/// simulated balancer takes weights instantly and can be read back, so every decision to push is
/// applied and acknowledged at once.
pub struct BenchControl {
    cycle: Cycle,
    members: Vec<MemberId>,
    initial: u32,
    /// Virtual time zero.
    epoch: Instant,
}

impl BenchControl {
    pub fn new(spec: &ControlSpec) -> Result<Self, String> {
        // `capacity` needs to know what its ratios feed; the benchmark knows the balancer, so it
        // says so unless the parameters already do (as an operator would write it in the config).
        let mut params = spec.policy_params.clone();
        if spec.policy == "capacity"
            && !spec.lb_mode.is_empty()
            && !params.iter().any(|p| p.trim_start().starts_with("mode="))
        {
            params.push(format!("mode={}", spec.lb_mode));
        }
        let policy_cfg = parse_policy(&spec.policy, &params)?;
        let range = RatioRange { min: spec.ratio_min, max: spec.ratio_max };
        let interval = Duration::from_secs_f64(spec.push_interval_s.max(1e-3));
        let policy = PoolPolicy::new(
            &policy_cfg,
            range,
            Duration::from_secs_f64(spec.stale_after_s.max(0.0)),
            Duration::from_secs_f64(spec.grace_s.max(0.0)),
            interval,
        );
        let mut settings = CycleSettings::new(range, OnStale::Hold, Duration::from_secs(300));
        settings.reconciles = true;
        if spec.config_writes {
            // What the controller uses for an F5 sink by default (`ChangePolicy::default_for`).
            settings.change = ChangePolicy::for_config_writes(&policy_cfg);
        }
        let stale_after = Duration::from_secs_f64(spec.stale_after_s.max(0.0));
        let tiers = match priority_config(spec)? {
            Some(cfg) => Some(crate::priority::Tiers::new(&cfg, stale_after, &policy_cfg)?),
            None => None,
        };
        Ok(BenchControl {
            cycle: Cycle::new(settings, policy).with_tiers(tiers),
            members: (0..spec.replicas).map(bench_member).collect(),
            initial: spec.initial_ratio(),
            epoch: Instant::now(),
        })
    }

    fn snapshot(&self, observations: &[Option<Observation>]) -> Snapshot {
        Snapshot {
            members: self
                .members
                .iter()
                .zip(observations)
                .map(|(m, o)| {
                    let sample = o.map(|o| Sample {
                        waiting: o.waiting,
                        running: o.running,
                        kv_usage: Some(o.kv_usage),
                        latency: o.latency_s,
                        service: o.service_s,
                        queue_time: None,
                        token_time: None,
                        prompt_cached: None,
                        slots: None,
                        age: Duration::from_secs_f64(o.age_s.max(0.0)),
                    });
                    (m.clone(), sample)
                })
                .collect(),
            rejected: vec![],
            failures: vec![],
            labels: Default::default(),
        }
    }

    fn in_order(&self, ratios: &Ratios) -> Vec<u32> {
        self.members.iter().map(|m| ratios.get(m).unwrap_or(self.initial)).collect()
    }
}

impl Control for BenchControl {
    fn cycle(&mut self, now_s: f64, observations: &[Option<Observation>]) -> Option<Vec<u32>> {
        let snap = self.snapshot(observations);
        let now = self.epoch + Duration::from_secs_f64(now_s.max(0.0));
        let step = self.cycle.step(Sampled::Snapshot(&snap), &self.members, now, true);
        match step.decision {
            Decision::Push(sent) => {
                self.cycle.pushed(PushResult::Applied { changed: sent.len() }, now);
                Some(self.in_order(&sent))
            }
            Decision::Hold(_) => None,
        }
    }
}

/// Starts the real controller in-process for the demo.
pub struct InProcess;

impl llm_lc_demo::ControllerLauncher for InProcess {
    fn start(&self, config: &str) -> anyhow::Result<llm_lc_demo::ControllerTask> {
        let cfg = crate::config::parse(std::path::Path::new("<demo>"), config)
            .map_err(|e| anyhow::anyhow!("demo controller config: {e}"))?;
        let telemetry = Telemetry::new(cfg.interval, cfg.unready_after_cycles);
        let ctl = Controller::new(&cfg, telemetry, false, &Default::default())?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let stop = async move {
            let _ = rx.await;
        };
        let task = tokio::spawn(control_loop::run(ctl, Output::Quiet, false, stop, None));
        Ok((task, tx))
    }
}

/// `bench`: either the controller's own cost (`--controller-scale`) or the balancing benchmark with
/// the real cycle in the loop.
pub fn bench(args: llm_lc_bench::BenchArgs) -> anyhow::Result<()> {
    if args.controller_scale {
        let r = scale::measure(args.knobs.pools, args.knobs.members, args.knobs.cycles, args.seed)?;
        match args.output.as_str() {
            "json" => println!("{}", serde_json::to_string_pretty(&r)?),
            _ => print!("{}", scale::render(&r)),
        }
        return Ok(());
    }
    if args.pick_cost {
        let c = llm_lc_bench::pick_cost::measure(64, 100_000, 250, 20_000, args.seed);
        match args.output.as_str() {
            "json" => println!("{}", serde_json::to_string_pretty(&c)?),
            _ => print!("{}", llm_lc_bench::pick_cost::render(&c)),
        }
        return Ok(());
    }
    llm_lc_bench::run(args, BenchControls::shared())
}
