//! `llm-load-controller bench`: the virtual-time fleet benchmark.
//!
//! Many replicas of the simulator's engine model ([`llm_lc_sim::engine::Engine`], the code `sim`
//! serves) run in virtual time behind a simulated load balancer ([`llm_lc_balance`], the code the
//! proxy runs, or an endpoint picker like the Gateway API Inference Extension's), with the
//! controller's real per-pool cycle ([`control`]) in the loop on samples as stale as
//! Prometheus or a direct scrape would give. An hour of traffic over dozens of replicas takes
//! seconds to a minute; the same seed gives the same numbers.
//!
//! - [`workload`]: request sizes (ShareGPT-like, long-context mix) and Poisson arrivals with spikes
//!   and ramps; [`scenario`]: the named fleets and events; [`capacity`]: what 100% load is.
//! - [`balancer`]: the balancers compared; [`fleet`]: the discrete-event simulation of one run.
//! - [`stats`]: percentiles and spreads; [`report`]: tables and JSON; [`plot`]: SVG pictures;
//!   [`goals`]: the goals grid (`--sweep --goals`), medians and ranges over seeds.
//! - [`control`]: the controller in the loop, handed in by the controller's binary.
//!
//! Evidence and the defaults chosen from it: `src/bench/RESULTS.md`.

#![forbid(unsafe_code)]

pub mod balancer;
pub mod capacity;
pub mod control;
pub mod fleet;
pub mod goals;
pub mod pick_cost;
pub mod picker_goals;
pub mod plot;
pub mod prompts;
pub mod report;
pub mod scenario;
pub mod stats;
pub mod workload;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;

use balancer::Balancer;
use control::{ControlSpec, Controller};
use fleet::{BalancerResult, LbKind, RunOutcome, RunSpec, Signals};
use llm_lc_balance::endpoint::picker::Settings as PickerSettings;
use llm_lc_sim::profile::ModelProfile;
use scenario::Tiering;

/// Arguments of `llm-load-controller bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Scenario: homogeneous, heterogeneous, degraded, spike, long-context, ramp, mixed-memory,
    /// tp-mixed, mem-only, slow-drift, shared-backends, batch-limits, large, region-spill, shared-prefix,
    /// multi-turn.
    #[arg(long, default_value = "heterogeneous")]
    pub scenario: String,
    /// Offered load as a fraction of the fleet's capacity (see src/bench/capacity.rs).
    #[arg(long, default_value_t = 0.85)]
    pub load: f64,
    /// Balancers to compare, comma-separated, or `all` (adds ratio-p2c, epp-active, static-ratio,
    /// static-ratio-least-request). Default: round-robin,random,least-request,ratio,
    /// ratio-least-request,epp (with --goals: the goals set).
    #[arg(long, value_delimiter = ',')]
    pub balancers: Vec<String>,
    /// The controller's policy: capacity, feedback or headroom.
    #[arg(long, default_value = "capacity")]
    pub policy: String,
    /// Policy parameter override, KEY=VALUE, repeatable (e.g. --policy-param gain=0.3).
    #[arg(long = "policy-param", value_name = "KEY=VALUE")]
    pub policy_params: Vec<String>,
    /// `picker` setting override, NAME=VALUE, repeatable (e.g. --picker-param overload=0.5).
    #[arg(long = "picker-param", value_name = "NAME=VALUE")]
    pub picker_params: Vec<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seeds of a sweep, comma-separated (default: --seed); a range such as 4-8 is accepted.
    #[arg(long, value_delimiter = ',')]
    pub seeds: Vec<String>,
    /// With --sweep: run the goals grid (every grid scenario at 85%, tp-mixed at 95%, mixed-memory
    /// with 32 LB instances) and print the goals table (medians and ranges over --seeds).
    #[arg(long)]
    pub goals: bool,
    /// text (table), json, or markdown.
    #[arg(long, default_value = "text")]
    pub output: String,
    /// Write SVG pictures to this directory.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Run every grid scenario (or --scenarios) at every --loads and print one table.
    #[arg(long)]
    pub sweep: bool,
    /// Scenarios of the sweep, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub scenarios: Vec<String>,
    /// Loads of the sweep, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.7,0.85,0.95")]
    pub loads: Vec<f64>,
    /// Runs in parallel (threads). Results do not depend on it.
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// Measure the controller's cost per cycle and memory at scale instead.
    #[arg(long)]
    pub controller_scale: bool,
    /// Measure what one pick of the endpoint picker costs (64 members, 100k index entries).
    #[arg(long)]
    pub pick_cost: bool,
    #[command(flatten)]
    pub knobs: Box<Knobs>,
}

/// The finer settings of `bench` (boxed: they make the argument struct large).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Simulation")]
pub struct Knobs {
    /// Smallest ratio the controller gives.
    #[arg(long, default_value_t = 1)]
    pub ratio_min: u32,
    /// Largest ratio the controller gives.
    #[arg(long, default_value_t = 100)]
    pub ratio_max: u32,
    /// Where the controller's samples come from: prometheus (15 s scrape) or direct (1 s).
    #[arg(long, default_value = "prometheus")]
    pub source: String,
    /// Override the scrape interval of the source.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub scrape_interval: Option<Duration>,
    /// How often the controller computes and pushes ratios.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub push_interval: Duration,
    /// Independent balancer instances sharing the traffic, each counting only its own requests
    /// (several proxies or LB nodes in front of one fleet); the controller's ratios go to all.
    #[arg(long, default_value_t = 1)]
    pub lb_instances: usize,
    /// The LB the ratios are pushed to, for the delay before they take effect: proxy (at once),
    /// haproxy (~50 ms), envoy (next 1 s EDS poll), f5 (~0.6 s + 0.2 s per changed member).
    #[arg(long, default_value = "proxy")]
    pub lb_kind: String,
    /// `region-spill`, `spill-over`: the local tier's saturation at which the remote one joins
    /// (the controller's `priority.spill_at`; default as in the config file, 0.7).
    #[arg(long)]
    pub spill_at: Option<f64>,
    /// `region-spill`, `spill-over`: the remote tier leaves when the local one would carry the load
    /// below this, held for `priority.return_hold` (5m) (`priority.return_below`; default 0.5).
    #[arg(long)]
    pub return_below: Option<f64>,
    /// How often the epp balancers refresh their metrics.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    pub epp_refresh: Duration,
    /// Clients give up on a request not scheduled within this long (counted as rejected).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Length of the run in virtual time, warm-up included (default 12m; `large`: 1h).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// Warm-up excluded from the results (default 2m).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub warmup: Option<Duration>,
    /// Number of replicas (the scenario's speed pattern is kept).
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Model/GPU profile of the engines: llama-8b-h100 or tiny.
    #[arg(long, default_value = "llama-8b-h100")]
    pub profile: String,
    /// Pools for --controller-scale.
    #[arg(long, default_value_t = 1000)]
    pub pools: usize,
    /// Members per pool for --controller-scale.
    #[arg(long, default_value_t = 10)]
    pub members: usize,
    /// Cycles measured by --controller-scale.
    #[arg(long, default_value_t = 20)]
    pub cycles: usize,
    /// `prefix-affinity`: a member takes its keys while under this percentage of its weighted share
    /// of the requests in flight (HAProxy's `hash-balance-factor`, Envoy's `hash_balance_factor`).
    #[arg(long, default_value_t = llm_lc_balance::ring::DEFAULT_BALANCE_FACTOR)]
    pub hash_balance_factor: u32,
    /// Scenarios without shared prefixes: give every request a key of its own, as the opt-in body
    /// key does (HAProxy's first bytes, the proxy's `prefix_key_from_body`). Default: no key, as
    /// when only clients that share send the `x-llm-prefix-key` header.
    #[arg(long)]
    pub body_keys: bool,
}

/// One scenario at one load: every balancer's results and what was run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioReport {
    pub scenario: String,
    pub load: f64,
    pub policy: String,
    pub policy_params: Vec<String>,
    /// `--picker-param` overrides of the picker's settings.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub picker_params: Vec<String>,
    pub profile: String,
    pub replicas: usize,
    pub speeds: Vec<f64>,
    /// Fraction of the profile's KV cache per replica.
    pub kv_scale: Vec<f64>,
    /// Each replica's own batch limit, where the scenario gives one (empty: none does).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub max_num_seqs: Vec<Option<u32>>,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub seed: u64,
    pub signals: Signals,
    /// Balancer instances, each counting only its own requests.
    pub lb_instances: usize,
    /// Clients give up on a request not scheduled within this long.
    pub timeout_s: f64,
    /// Saturation throughput of each replica for this mix, requests/s (speed and KV included), at
    /// the speeds 100% load is computed on.
    pub replica_capacity_rps: Vec<f64>,
    /// Their sum: what 100% load is.
    pub capacity_rps: f64,
    /// Requests/s reaching each replica from outside this LB (`shared-backends`).
    pub external_rps: Vec<f64>,
    /// Arrival rate through this LB: load x capacity minus the external traffic.
    pub arrival_rps: f64,
    /// Weights of the `static-*` balancers: capacity at the start, largest = --ratio-max.
    pub static_weights: Vec<u32>,
    pub results: Vec<BalancerResult>,
}

/// A scenario report plus what only the process needs (plots, timing).
pub struct ScenarioRun {
    pub report: ScenarioReport,
    pub outcomes: Vec<RunOutcome>,
}

/// The settings shared by every run of one invocation.
#[derive(Debug, Clone)]
pub struct Settings {
    pub profile: ModelProfile,
    pub balancers: Vec<Balancer>,
    /// The controller in the loop, and its settings.
    pub controller: Controller,
    pub control: ControlSpec,
    pub signals: Signals,
    pub timeout_s: f64,
    pub duration_s: Option<f64>,
    pub warmup_s: Option<f64>,
    pub replicas: Option<usize>,
    pub seed: u64,
    pub jobs: usize,
    pub record_series: bool,
    pub lb_instances: usize,
    pub hash_balance_factor: u32,
    pub body_keys: bool,
    /// `picker`'s settings, and the overrides they were made with.
    pub picker: PickerSettings,
    pub picker_params: Vec<String>,
}

impl Settings {
    /// Check and convert command-line arguments.
    pub fn from_args(args: &BenchArgs, controller: Controller) -> anyhow::Result<Settings> {
        let a = &args.knobs;
        let profile = ModelProfile::by_name(&a.profile)?;
        let balancers = parse_balancers(&args.balancers)?;
        if a.ratio_min > a.ratio_max || a.ratio_max == 0 {
            bail!(
                "--ratio-min ({}) must be <= --ratio-max ({}), and --ratio-max >= 1",
                a.ratio_min,
                a.ratio_max
            );
        }
        let mut signals = match a.source.as_str() {
            "prometheus" => Signals::prometheus(),
            "direct" => Signals::direct(),
            other => bail!("unknown --source {other:?}; use prometheus or direct"),
        };
        if let Some(s) = a.scrape_interval {
            signals.scrape_interval_s = s.as_secs_f64();
        }
        signals.push_interval_s = a.push_interval.as_secs_f64();
        signals.lb_kind = LbKind::parse(&a.lb_kind).map_err(anyhow::Error::msg)?;
        if a.lb_instances == 0 || a.lb_instances > 10_000 {
            bail!("--lb-instances must be between 1 and 10000, got {}", a.lb_instances);
        }
        signals.epp_refresh_s = a.epp_refresh.as_secs_f64();
        for (name, v) in [
            ("--scrape-interval", signals.scrape_interval_s),
            ("--push-interval", signals.push_interval_s),
            ("--epp-refresh", signals.epp_refresh_s),
        ] {
            if v < 0.001 {
                bail!("{name} must be at least 1ms");
            }
        }
        if a.timeout.is_zero() {
            bail!("--timeout must be > 0");
        }
        let control = ControlSpec {
            policy: args.policy.clone(),
            policy_params: args.policy_params.clone(),
            ratio_min: a.ratio_min,
            ratio_max: a.ratio_max,
            push_interval_s: signals.push_interval_s,
            stale_after_s: signals.stale_after_s,
            grace_s: signals.grace_s,
            replicas: 0,
            lb_mode: String::new(),
            config_writes: signals.lb_kind == LbKind::F5,
            tiers: Vec::new(),
            spill_at: a.spill_at,
            return_below: a.return_below,
        };
        controller.0.check(&control).map_err(anyhow::Error::msg)?;
        let mut picker = PickerSettings::default();
        for p in &args.picker_params {
            picker.set(p).map_err(anyhow::Error::msg)?;
        }
        Ok(Settings {
            profile,
            balancers,
            controller,
            control,
            signals,
            timeout_s: a.timeout.as_secs_f64(),
            duration_s: a.duration.map(|d| d.as_secs_f64()),
            warmup_s: a.warmup.map(|d| d.as_secs_f64()),
            replicas: a.replicas,
            seed: args.seed,
            jobs: args.jobs.max(1),
            record_series: args.plot.is_some(),
            lb_instances: a.lb_instances,
            hash_balance_factor: a.hash_balance_factor,
            body_keys: a.body_keys,
            picker,
            picker_params: args.picker_params.clone(),
        })
    }
}

fn parse_balancers(list: &[String]) -> anyhow::Result<Vec<Balancer>> {
    if list.is_empty() {
        return Ok(balancer::DEFAULT_SET.to_vec());
    }
    if list.len() == 1 && list[0] == "all" {
        return Ok(balancer::ALL.to_vec());
    }
    let mut out = Vec::new();
    for s in list {
        let b = Balancer::parse(s.trim()).map_err(anyhow::Error::msg)?;
        if !out.contains(&b) {
            out.push(b);
        }
    }
    Ok(out)
}

/// Run every balancer of `settings` on one scenario at one load.
pub fn run_scenario(name: &str, load: f64, settings: &Settings) -> anyhow::Result<ScenarioRun> {
    if !(load > 0.0 && load.is_finite()) {
        bail!("--load must be a positive fraction of capacity (0.85 = 85%), got {load}");
    }
    let sc = scenario::build(name, settings.replicas, settings.duration_s, settings.warmup_s)
        .map_err(anyhow::Error::msg)?;
    let mut per_replica = Vec::with_capacity(sc.speeds.len());
    let mut at_start = Vec::with_capacity(sc.speeds.len());
    for (r, ((&speed, &rate_speed), &kv)) in
        sc.speeds.iter().zip(&sc.rate_speeds).zip(&sc.kv_scale).enumerate()
    {
        let p = scenario::replica_profile(&settings.profile, kv, sc.max_num_seqs_of(r));
        let one = capacity::replica_rps(&p, sc.mix).map_err(anyhow::Error::msg)?;
        per_replica.push(rate_speed * one);
        at_start.push(speed * one);
    }
    let capacity_rps: f64 = per_replica.iter().sum();
    let external_rps: Vec<f64> = per_replica.iter().zip(&sc.external).map(|(c, e)| c * e).collect();
    let arrival_rps = load * capacity_rps - external_rps.iter().sum::<f64>();
    if arrival_rps <= 0.0 {
        bail!("--load {load} leaves nothing for this LB: the external traffic alone is more");
    }
    let static_weights = static_weights(&at_start, settings.control.ratio_min, settings.control.ratio_max);
    // A scenario with regions runs every balancer three ways; others once, flat.
    let tierings: &[Tiering] = if sc.tiers.is_empty() { &[Tiering::Flat] } else { &Tiering::ALL };
    let runs = settings.balancers.iter().flat_map(|&b| tierings.iter().map(move |&t| (b, t)));
    let specs: Vec<RunSpec> = runs
        .map(|(b, tiering)| RunSpec {
            profile: settings.profile.clone(),
            scenario: sc.clone(),
            arrival_rps,
            balancer: b,
            controller: settings.controller.clone(),
            control: ControlSpec {
                replicas: sc.speeds.len(),
                lb_mode: b.weight_mode().to_string(),
                // A ring's weight change moves keys off the servers that cache them: like a BIG-IP
                // write, it has a lasting cost, so it gets the same change policy. Where no request
                // has a key the ring is idle and the requests go by the unkeyed backend's weights
                // (the shipped configs' leastconn backend), which have no such cost.
                config_writes: settings.control.config_writes
                    || (b == Balancer::PrefixAffinity && (sc.mix.has_structure() || settings.body_keys)),
                tiers: if tiering == Tiering::SpillOver { sc.tiers.clone() } else { Vec::new() },
                ..settings.control.clone()
            },
            tiering,
            signals: settings.signals,
            timeout_s: settings.timeout_s,
            seed: settings.seed,
            record_series: settings.record_series,
            static_weights: static_weights.clone(),
            external_rps: external_rps.clone(),
            lb_instances: settings.lb_instances,
            hash_balance_factor: settings.hash_balance_factor,
            body_keys: settings.body_keys,
            picker: settings.picker,
        })
        .collect();
    let outcomes = run_all(&specs, settings.jobs)?;
    let report = ScenarioReport {
        scenario: sc.name.clone(),
        load,
        policy: settings.control.policy.clone(),
        policy_params: settings.control.policy_params.clone(),
        picker_params: settings.picker_params.clone(),
        profile: settings.profile.name.clone(),
        replicas: sc.speeds.len(),
        speeds: sc.speeds.clone(),
        kv_scale: sc.kv_scale.clone(),
        max_num_seqs: sc.max_num_seqs.clone(),
        duration_s: sc.duration_s,
        warmup_s: sc.warmup_s,
        seed: settings.seed,
        signals: settings.signals,
        lb_instances: settings.lb_instances,
        timeout_s: settings.timeout_s,
        replica_capacity_rps: per_replica,
        capacity_rps,
        external_rps,
        arrival_rps,
        static_weights,
        results: outcomes.iter().map(|o| o.result.clone()).collect(),
    };
    Ok(ScenarioRun { report, outcomes })
}

/// Fixed weights proportional to capacity, the largest at `max` (what an operator derives from a
/// spec sheet or a calibration run), never below `min` or 1.
pub fn static_weights(capacity: &[f64], min: u32, max: u32) -> Vec<u32> {
    let top = capacity.iter().copied().fold(0.0, f64::max);
    capacity
        .iter()
        .map(|&c| {
            let w = if top > 0.0 { (f64::from(max) * c / top).round() } else { f64::from(max) };
            (w as u32).clamp(min.max(1), max.max(1))
        })
        .collect()
}

/// `4-8` or `4` -> seeds.
fn parse_seeds(list: &[String], default: u64) -> anyhow::Result<Vec<u64>> {
    let mut out = Vec::new();
    for item in list {
        let item = item.trim();
        let parsed = match item.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u64, u64) = (a.trim().parse()?, b.trim().parse()?);
                if b < a || b - a > 1000 {
                    bail!("--seeds {item}: write a short ascending range such as 4-8");
                }
                (a..=b).collect()
            }
            None => vec![item.parse().with_context(|| format!("--seeds {item:?}: not a number"))?],
        };
        for s in parsed {
            if !out.contains(&s) {
                out.push(s);
            }
        }
    }
    if out.is_empty() {
        out.push(default);
    }
    Ok(out)
}

/// Run specs on up to `jobs` threads; results come back in the order of `specs`.
fn run_all(specs: &[RunSpec], jobs: usize) -> anyhow::Result<Vec<RunOutcome>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<Result<RunOutcome, String>>>> =
        specs.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..jobs.min(specs.len()).max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(spec) = specs.get(i) else { break };
                let r = fleet::run(spec);
                if let Ok(mut slot) = slots[i].lock() {
                    *slot = Some(r);
                }
            });
        }
    });
    let mut out = Vec::with_capacity(specs.len());
    for (slot, spec) in slots.into_iter().zip(specs) {
        let r = slot
            .into_inner()
            .ok()
            .flatten()
            .ok_or_else(|| anyhow::anyhow!("run of {} did not complete", spec.balancer.name()))?;
        out.push(
            r.map_err(anyhow::Error::msg).with_context(|| format!("balancer {}", spec.balancer.name()))?,
        );
    }
    Ok(out)
}

/// `llm-load-controller bench`, with `controller` in the loop. (`--controller-scale` is measured by
/// the controller itself: it is a benchmark of the controller, not of balancing.)
pub fn run(args: BenchArgs, controller: Controller) -> anyhow::Result<()> {
    let settings = Settings::from_args(&args, controller)?;
    if !matches!(args.output.as_str(), "text" | "json" | "markdown") {
        bail!("unknown --output {:?}; use text, json or markdown", args.output);
    }
    if args.sweep {
        let seeds = parse_seeds(&args.seeds, args.seed)?;
        let mut settings = settings;
        // (scenario, load, LB instances) points of the sweep.
        let points: Vec<(String, f64, usize)> = if args.goals {
            if args.balancers.is_empty() {
                settings.balancers = balancer::GOALS_SET.to_vec();
            }
            goals::points(&args.scenarios)
        } else {
            let names: Vec<String> = if args.scenarios.is_empty() {
                scenario::GRID.iter().map(|s| s.to_string()).collect()
            } else {
                args.scenarios.clone()
            };
            names
                .iter()
                .flat_map(|n| args.loads.iter().map(move |&l| (n.clone(), l, settings.lb_instances)))
                .collect()
        };
        let mut reports = Vec::new();
        let started = std::time::Instant::now();
        for &seed in &seeds {
            for (name, load, instances) in &points {
                let mut point = Settings { seed, lb_instances: *instances, ..settings.clone() };
                // The picker's own points run its anchors, not the whole goals set.
                let picker_point = picker_goals::POINTS.contains(&(name.as_str(), *load, *instances));
                if args.goals && args.balancers.is_empty() && picker_point {
                    point.balancers = picker_goals::balancers(name);
                }
                let r = run_scenario(name, *load, &point)?;
                eprintln!(
                    "{name} at {:.0}%, {instances} LB, seed {seed}: {:.1} s wall ({} runs)",
                    load * 100.0,
                    r.outcomes.iter().map(|o| o.wall_s).sum::<f64>(),
                    r.outcomes.len()
                );
                if let Some(dir) = &args.plot {
                    plot::write_all(dir, &r)?;
                }
                reports.push(r.report);
            }
        }
        eprintln!("sweep: {:.1} s wall", started.elapsed().as_secs_f64());
        match args.output.as_str() {
            "json" => println!("{}", serde_json::to_string_pretty(&reports)?),
            _ if args.goals => {
                print!("{}", goals::markdown(&reports));
                print!("{}", picker_goals::markdown(&reports));
            }
            _ => print!("{}", report::sweep_markdown(&reports)),
        }
        return Ok(());
    }
    let r = run_scenario(&args.scenario, args.load, &settings)?;
    let wall: f64 = r.outcomes.iter().map(|o| o.wall_s).sum();
    let events: u64 = r.outcomes.iter().map(|o| o.events).sum();
    eprintln!(
        "{} runs of {:.0} s virtual time: {:.2} s wall, {} events",
        r.outcomes.len(),
        r.report.duration_s,
        wall,
        events
    );
    if let Some(dir) = &args.plot {
        let files = plot::write_all(dir, &r)?;
        for f in files {
            eprintln!("wrote {}", f.display());
        }
    }
    match args.output.as_str() {
        "json" => println!("{}", serde_json::to_string_pretty(&r.report)?),
        "markdown" => print!("{}", report::markdown(&r.report)),
        _ => print!("{}", report::text(&r.report)),
    }
    Ok(())
}
