//! One run: a fleet of engines behind one balancer, with the controller in the loop, in virtual time.
//!
//! A discrete-event simulation. One priority queue orders, by virtual time (ties by insertion):
//! - `Arrival`: the next client request (one pending at a time, from [`super::workload`]);
//! - `StepEnd(r)`: replica `r`'s engine step is over. The step was planned when it started
//!   ([`Engine::step_into`], the code `sim` runs); its events take effect now. The next step starts
//!   at once if the engine has work, as vLLM's engine loop does;
//! - `Scrape(r)`: the metrics pipeline records replica `r`'s gauges (waiting, running, KV usage) and
//!   its end-to-end latency and inference time (running, queue excluded) histograms' sums and
//!   count. With Prometheus every target has its own phase inside the scrape interval, as
//!   Prometheus spreads targets; the controller sees the last recorded value and its age. The mean
//!   processing and service times are the histograms' growth over the latency window (Prometheus:
//!   `rate(sum[1m]) / rate(count[1m])`, the first and last scrape inside the minute; direct scrape:
//!   since the previous cycle), and absent when no request finished in it;
//! - `Push`: one control cycle: the controller's own cycle ([`super::control`]) on the recorded
//!   samples; the ratios reach the balancer after the LB kind's delay ([`LbKind`]);
//! - `Apply`: pushed ratios take effect in every balancer instance;
//! - `EppRefresh`: `epp` copies every replica's gauges at once (every 50 ms); `EppRefreshOne(r)`:
//!   `epp-active` copies replica `r`'s, each replica on its own phase;
//! - `External(r)`: a request reaches replica `r` without passing this LB (`shared-backends`);
//! - `Tick`: once a second, spreads across replicas are sampled (and recorded for plots);
//! - `Speed(r)`: a scenario event (a replica slows down);
//! - `Turn(s)`: session `s`'s next turn (`multi-turn`): sent when the user has read the last answer
//!   and thought ([`super::prompts`]); a turn whose client gave up ends its session.
//!
//! Requests of `shared-prefix` and `multi-turn` carry their blocks' hash chain into the engine's
//! prefix cache and their key to the balancer; requests of every other scenario carry no blocks
//! and a key of their own (a client's first bytes or request id: nothing shared to hash on).
//!
//! Client timeouts are a FIFO beside the queue (all share one timeout, so they expire in arrival
//! order): a request still queued, never scheduled, `timeout_s` after it arrived is aborted by its
//! client and counted as rejected. Its TTFT counts as the timeout (a censored value: a p99 equal to
//! the timeout means more than 1% gave up).
//!
//! With `--lb-instances K` the traffic is split at random over K balancer instances of the same kind;
//! each counts only the requests it sent itself, and the controller's ratios go to all of them.
//!
//! Statistics cover requests of this LB that arrive inside the measured window `[warmup, duration)`; tokens/s
//! counts tokens produced inside it. After the last arrival the run continues until every request
//! is finished or has given up.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use std::sync::Arc;

use super::balancer::{Balancer, Lb, Route};
use super::control::{Control, ControlSpec, Controller, Observation};
use super::prompts::{MultiTurn, Prompt, Session, SharedPrefix};
use super::scenario::{replica_profile, Scenario, Tiering};
use super::stats::{percentile, sort, LogHistogram, Spread};
use super::workload::{Arrivals, LengthMix, Lengths, RateShape};
use llm_lc_balance::endpoint::Gauges;
use llm_lc_sim::engine::{Engine, EngineEvent, EngineRequest, EngineStats};
use llm_lc_sim::profile::ModelProfile;

/// `epp-sticky`'s longest tolerated TTFT: tau = prefill throughput x this (llm-d's guide).
const STICKY_MAX_TTFT_S: f64 = 18.0;

/// How stale each party's view of the fleet is.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Signals {
    /// `prometheus` (targets scraped at their own phase) or `direct`.
    pub source: &'static str,
    /// How often the controller's samples are refreshed.
    pub scrape_interval_s: f64,
    /// How often the controller computes and pushes ratios.
    pub push_interval_s: f64,
    /// How often `epp` refreshes its metrics.
    pub epp_refresh_s: f64,
    /// The controller's `stale_after` and `grace` (its defaults: 60 s and 30 s).
    pub stale_after_s: f64,
    pub grace_s: f64,
    /// Window of the mean processing time: Prometheus' `rate_window` (60 s), or one cycle for a
    /// direct scrape.
    pub latency_window_s: f64,
    /// Which LB receives the ratios: how long until a push takes effect.
    pub lb_kind: LbKind,
}

/// The load balancer kind the ratios are pushed to, for the delay before they take effect. The
/// figures are estimates of the path, not measurements of a particular installation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LbKind {
    /// The reference proxy via the webhook sink: one local HTTP call, effectively at once.
    Proxy,
    /// HAProxy runtime API: one socket connection with chained `set server` commands (~50 ms).
    Haproxy,
    /// Envoy REST EDS with `refresh_delay: 1s`: the new assignment is served on Envoy's next poll.
    Envoy,
    /// BIG-IP iControl REST: login/transaction (~0.6 s) plus a PATCH per changed member (~0.2 s).
    F5,
}

impl LbKind {
    pub const NAMES: &'static [&'static str] = &["proxy", "haproxy", "envoy", "f5"];

    pub fn parse(s: &str) -> Result<LbKind, String> {
        Ok(match s {
            "proxy" => LbKind::Proxy,
            "haproxy" => LbKind::Haproxy,
            "envoy" => LbKind::Envoy,
            "f5" => LbKind::F5,
            other => return Err(format!("unknown --lb-kind {other:?}; use {}", LbKind::NAMES.join(", "))),
        })
    }

    /// Envoy's EDS poll interval.
    const ENVOY_REFRESH_S: f64 = 1.0;

    /// When ratios pushed at `now` changing `changed` members take effect; `phase` places Envoy's
    /// polls inside their interval.
    pub fn apply_at(self, now: f64, changed: usize, phase: f64) -> f64 {
        match self {
            LbKind::Proxy => now,
            LbKind::Haproxy => now + 0.05,
            LbKind::Envoy => {
                let p = Self::ENVOY_REFRESH_S;
                let k = ((now - phase) / p).floor() + 1.0;
                (phase + k * p).max(now)
            }
            LbKind::F5 => now + 0.6 + 0.2 * changed as f64,
        }
    }
}

impl Signals {
    pub fn prometheus() -> Signals {
        Signals {
            source: "prometheus",
            scrape_interval_s: 15.0,
            push_interval_s: 5.0,
            epp_refresh_s: 0.05,
            stale_after_s: 60.0,
            grace_s: 30.0,
            latency_window_s: 60.0,
            lb_kind: LbKind::Proxy,
        }
    }

    pub fn direct() -> Signals {
        Signals { source: "direct", scrape_interval_s: 1.0, latency_window_s: 5.0, ..Signals::prometheus() }
    }
}

/// Everything one run needs.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub profile: ModelProfile,
    pub scenario: Scenario,
    /// Base arrival rate, requests/s (the scenario's shape multiplies it).
    pub arrival_rps: f64,
    pub balancer: Balancer,
    pub controller: Controller,
    pub control: ControlSpec,
    pub signals: Signals,
    /// Clients give up on a request not scheduled within this many seconds.
    pub timeout_s: f64,
    pub seed: u64,
    /// Keep per-second per-replica series for plots.
    pub record_series: bool,
    /// Weights of the `static-*` balancers: proportional to each replica's calibrated capacity.
    pub static_weights: Vec<u32>,
    /// Requests/s reaching each replica from outside this LB.
    pub external_rps: Vec<f64>,
    /// Independent balancer instances sharing the traffic (each counts only its own requests).
    pub lb_instances: usize,
    /// How a scenario with regions is pooled (`Flat` for every other scenario).
    pub tiering: Tiering,
    /// `prefix-affinity`'s load bound, percent (HAProxy's `hash-balance-factor`).
    pub hash_balance_factor: u32,
    /// Requests of scenarios without shared prefixes carry a key of their own (the opt-in body
    /// key); otherwise none.
    pub body_keys: bool,
    /// `picker`'s settings.
    pub picker: llm_lc_balance::endpoint::picker::Settings,
}

impl RunSpec {
    /// Whether the controller runs: it drives the ratio balancers, and with `spill-over` decides
    /// which tiers any balancer may use.
    fn runs_controller(&self) -> bool {
        self.balancer.uses_ratios() || self.tiering == Tiering::SpillOver
    }

    /// The result's name: the balancer, and how the regions are pooled when there are regions.
    fn label(&self) -> String {
        match self.scenario.tiers.is_empty() {
            true => self.balancer.name().to_string(),
            false => format!("{}/{}", self.balancer.name(), self.tiering.name()),
        }
    }
}

/// One balancer's numbers over the measured window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BalancerResult {
    pub balancer: String,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub itl_p50_s: f64,
    pub itl_p99_s: f64,
    pub e2e_p99_s: f64,
    pub throughput_tok_s: f64,
    pub completed: u64,
    /// Requests given up (not scheduled within the timeout) or refused.
    pub rejected: u64,
    /// Time average of (max - min) KV usage across replicas, 0..1.
    pub kv_spread: f64,
    /// Time average of (max - min) waiting requests across replicas.
    pub queue_spread: f64,
    pub mean_kv_usage: f64,
    pub preemptions: u64,
    /// Pushes that changed at least one weight (how busy the LB's API would be).
    pub weight_updates: u64,
    /// Member weights written per member per minute in the measured window (on BIG-IP each is a
    /// configuration change); 0 for balancers that ignore ratios.
    pub member_writes_per_min: f64,
    /// Weights when the measured window closed (empty for balancers that ignore ratios).
    pub final_weights: Vec<u32>,
    /// Share of the measured requests each replica received.
    pub share: Vec<f64>,
    /// Prompt tokens found in the prefix cache / prompt tokens, over the measured window (0 where
    /// requests share nothing).
    pub prefix_hit_rate: f64,
}

/// Per-second series for plots.
#[derive(Debug, Clone, Default)]
pub struct Series {
    pub t: Vec<f32>,
    /// `[replica][tick]`
    pub kv: Vec<Vec<f32>>,
    pub waiting: Vec<Vec<f32>>,
    /// Time of each push and the weights after it.
    pub weight_t: Vec<f32>,
    pub weights: Vec<Vec<u32>>,
}

/// A finished run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub result: BalancerResult,
    /// Sorted TTFTs of the measured requests (timeouts counted as the timeout), for CDFs.
    pub ttft_sorted: Vec<f32>,
    pub series: Option<Series>,
    pub events: u64,
    pub wall_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Ev {
    Arrival,
    StepEnd(u32),
    Scrape(u32),
    Push,
    EppRefresh,
    EppRefreshOne(u32),
    Apply,
    External(u32),
    Tick,
    Speed(u32, f64),
    Turn(u32),
}

struct Entry {
    t: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    /// Reversed: `BinaryHeap` is a max-heap and we want the earliest (then the first inserted).
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Req {
    serial: u64,
    arrival: f64,
    last_token: f64,
    replica: u32,
    measured: bool,
    scheduled: bool,
    /// When it was first scheduled (its time running starts).
    scheduled_at: f64,
    live: bool,
    /// Which balancer instance sent it; `EXTERNAL` for traffic from outside this LB.
    lb: u16,
    /// Its session (`multi-turn`), or `NO_SESSION`.
    session: u32,
}

const EXTERNAL: u16 = u16::MAX;
const NO_SESSION: u32 = u32::MAX;

/// Where requests come from: independent draws, or prompts with shared prefixes.
enum Traffic {
    Plain,
    Shared(SharedPrefix),
    Turns(MultiTurn),
}

/// Mean end-to-end and running times over the latency window, in seconds.
type Means = (f64, f64);

struct Replica {
    engine: Engine,
    busy: bool,
    /// Events of the step in progress; they take effect at its end.
    pending: Vec<EngineEvent>,
    /// Last scrape: gauges, when they were taken, and the mean processing and service times over
    /// the window.
    sample: Option<(EngineStats, f64, Option<Means>)>,
    /// The server's e2e latency and inference time histograms, as their `_sum`s and `_count` would
    /// say (both are observed when a request finishes, so they share the count).
    e2e_sum: f64,
    run_sum: f64,
    e2e_count: u64,
    /// Scrapes of (time, e2e sum, run sum, count) still inside the latency window.
    scraped: VecDeque<(f64, f64, f64, u64)>,
}

struct Sim<'a> {
    spec: &'a RunSpec,
    now: f64,
    seq: u64,
    heap: BinaryHeap<Entry>,
    timeouts: VecDeque<(f64, u32, u64)>,
    reps: Vec<Replica>,
    reqs: Vec<Req>,
    free: Vec<u32>,
    serial: u64,
    in_flight: u64,
    lbs: Vec<Lb>,
    lb_rng: ChaCha8Rng,
    /// Pushed weights waiting to take effect, in push order.
    pending_weights: VecDeque<Vec<u32>>,
    /// The controller's weights in effect (`None` before its first push took effect).
    applied: Option<Vec<u32>>,
    envoy_phase: f64,
    control: Option<Box<dyn Control>>,
    arrivals: Arrivals,
    /// Traffic from outside this LB: per replica, its arrivals and their generator.
    external: Vec<(Arrivals, ChaCha8Rng)>,
    external_lengths: ChaCha8Rng,
    arrival_rng: ChaCha8Rng,
    length_rng: ChaCha8Rng,
    lengths: Lengths,
    traffic: Traffic,
    /// Keys of requests that share nothing (drawn for every balancer, read by `prefix-affinity`).
    key_rng: ChaCha8Rng,
    /// Live `multi-turn` sessions by slot, and free slots.
    sessions: Vec<Option<Session>>,
    free_sessions: Vec<u32>,
    /// Fleet-wide prefix cache (queries, hits) when the measured window opened and closed.
    cache_marks: [Option<(u64, u64)>; 2],
    // statistics
    ttft: Vec<f32>,
    e2e: Vec<f32>,
    itl: LogHistogram,
    tokens: u64,
    completed: u64,
    rejected: u64,
    kv_spread: Spread,
    queue_spread: Spread,
    kv_sum: f64,
    kv_n: u64,
    weight_updates: u64,
    /// Member weights changed by pushes made in the measured window.
    window_member_writes: u64,
    /// Weights when the measured window closed (the drain after it is not steady state).
    window_weights: Option<Vec<u32>>,
    dispatched: Vec<u64>,
    series: Option<Series>,
    events: u64,
}

/// Independent, reproducible streams derived from the run seed.
fn stream(seed: u64, k: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(k))
}

/// Run one balancer on one scenario.
pub fn run(spec: &RunSpec) -> Result<RunOutcome, String> {
    let started = Instant::now();
    let sc = &spec.scenario;
    let n = sc.speeds.len();
    if n == 0 {
        return Err("a fleet needs at least one replica".into());
    }
    if !(spec.arrival_rps >= 0.0 && spec.arrival_rps.is_finite()) {
        return Err(format!("arrival rate {} must be a finite number >= 0", spec.arrival_rps));
    }
    let mut reps = Vec::with_capacity(n);
    if sc.kv_scale.len() != n {
        return Err("the scenario needs one KV scale per replica".into());
    }
    for (r, (&speed, &kv)) in sc.speeds.iter().zip(&sc.kv_scale).enumerate() {
        let profile = replica_profile(&spec.profile, kv, sc.max_num_seqs_of(r));
        let mut engine = Engine::new(&profile, speed).map_err(|e| e.to_string())?;
        engine.set_token_events(true);
        reps.push(Replica {
            engine,
            busy: false,
            pending: Vec::with_capacity(512),
            sample: None,
            e2e_sum: 0.0,
            run_sum: 0.0,
            e2e_count: 0,
            scraped: VecDeque::new(),
        });
    }
    let sig = &spec.signals;
    if !sc.tiers.is_empty() && sc.tiers.len() != n || !sc.rtt_s.is_empty() && sc.rtt_s.len() != n {
        return Err("the scenario needs one tier and one round trip per replica".into());
    }
    let control = if spec.runs_controller() {
        let control = ControlSpec {
            push_interval_s: sig.push_interval_s,
            stale_after_s: sig.stale_after_s,
            grace_s: sig.grace_s,
            replicas: n,
            ..spec.control.clone()
        };
        Some(spec.controller.0.build(&control)?)
    } else {
        None
    };
    let instances = spec.lb_instances.clamp(1, usize::from(EXTERNAL) - 1);
    let mut lbs = Vec::with_capacity(instances);
    for k in 0..instances {
        // Instance 0 keeps the single balancer's seed, so `--lb-instances 1` is the plain run.
        let mut lb = Lb::new(spec.balancer, n, (spec.seed ^ 0x1b).wrapping_add(k as u64 * 0x9e37));
        lb.set_balance_factor(spec.hash_balance_factor);
        lb.set_picker(spec.picker);
        if spec.balancer.indexes_prefixes() {
            lb.set_cache_blocks(&reps.iter().map(|r| r.engine.stats().num_gpu_blocks).collect::<Vec<_>>());
        }
        // llm-d's guide: tau = peak prefill throughput x 18 s (287k tokens at 15,928 tokens/s).
        lb.set_sticky(1.0 / spec.profile.prefill_token_s.max(1e-9), STICKY_MAX_TTFT_S);
        if spec.balancer.uses_ratios() {
            // Before the first push every member has the same ratio, as a freshly configured pool.
            lb.set_weights(&vec![spec.control.initial_ratio(); n]);
        }
        if spec.balancer.uses_static_weights() {
            if spec.static_weights.len() != n {
                return Err("static weights need one weight per replica".into());
            }
            lb.set_weights(&spec.static_weights);
        }
        // Local-only for good; spill-over until the controller's first push (a new pool with tiers
        // starts on its preferred tier).
        if matches!(spec.tiering, Tiering::LocalOnly | Tiering::SpillOver) {
            lb.set_eligible(sc.tiers.iter().map(|&t| t == 0).collect());
        }
        lbs.push(lb);
    }
    if !spec.external_rps.is_empty() && spec.external_rps.len() != n {
        return Err("external traffic needs one rate per replica".into());
    }
    let external = spec
        .external_rps
        .iter()
        .enumerate()
        .map(|(r, &rps)| {
            (Arrivals::new(rps.max(0.0), RateShape::Constant), stream(spec.seed, 100 + r as u64))
        })
        .collect();
    let mut sim = Sim {
        spec,
        now: 0.0,
        seq: 0,
        heap: BinaryHeap::new(),
        timeouts: VecDeque::new(),
        reps,
        reqs: Vec::new(),
        free: Vec::new(),
        serial: 0,
        in_flight: 0,
        lbs,
        lb_rng: stream(spec.seed, 5),
        pending_weights: VecDeque::new(),
        applied: spec.balancer.uses_ratios().then(|| vec![spec.control.initial_ratio(); n]),
        envoy_phase: stream(spec.seed, 6).gen_range(0.0..1.0),
        control,
        // `multi-turn` arrivals are sessions; `arrival_rps` counts requests (turns).
        arrivals: match sc.mix {
            LengthMix::MultiTurn => {
                Arrivals::new(spec.arrival_rps / MultiTurn::mean_turns(spec.profile.max_model_len), sc.shape)
            }
            _ => Arrivals::new(spec.arrival_rps, sc.shape),
        },
        external,
        external_lengths: stream(spec.seed, 7),
        arrival_rng: stream(spec.seed, 1),
        length_rng: stream(spec.seed, 2),
        lengths: Lengths::new(sc.mix, spec.profile.max_model_len),
        traffic: match sc.mix {
            LengthMix::Sharegpt | LengthMix::LongContext => Traffic::Plain,
            // The groups are the workload's, the same in every run of every seed.
            LengthMix::SharedPrefix => Traffic::Shared(SharedPrefix::new(
                spec.profile.max_model_len,
                &mut ChaCha8Rng::seed_from_u64(0x9e0_0b5),
            )),
            LengthMix::MultiTurn => Traffic::Turns(MultiTurn::new(spec.profile.max_model_len)),
        },
        key_rng: stream(spec.seed, 8),
        sessions: Vec::new(),
        free_sessions: Vec::new(),
        cache_marks: [None, None],
        ttft: Vec::new(),
        e2e: Vec::new(),
        itl: LogHistogram::default(),
        tokens: 0,
        completed: 0,
        rejected: 0,
        kv_spread: Spread::default(),
        queue_spread: Spread::default(),
        kv_sum: 0.0,
        kv_n: 0,
        weight_updates: 0,
        window_member_writes: 0,
        window_weights: None,
        dispatched: vec![0; n],
        series: spec.record_series.then(|| Series {
            kv: vec![Vec::new(); n],
            waiting: vec![Vec::new(); n],
            ..Series::default()
        }),
        events: 0,
    };
    sim.schedule_initial();
    sim.main_loop();
    let mut out = sim.finish();
    out.wall_s = started.elapsed().as_secs_f64();
    Ok(out)
}

impl Sim<'_> {
    fn at(&mut self, t: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Entry { t, seq: self.seq, ev });
    }

    fn schedule_initial(&mut self) {
        let spec = self.spec;
        let sig = spec.signals;
        if let Some(t) = self.arrivals.next(&mut self.arrival_rng) {
            if t < spec.scenario.duration_s {
                self.at(t, Ev::Arrival);
            }
        }
        if spec.runs_controller() {
            // Prometheus spreads its targets over the interval; the phases come from their own
            // stream so every balancer sees the same ones.
            let mut phase_rng = stream(spec.seed, 3);
            for r in 0..self.reps.len() {
                let phase = if sig.source == "prometheus" {
                    phase_rng.gen_range(0.0..sig.scrape_interval_s)
                } else {
                    0.0
                };
                self.at(phase, Ev::Scrape(r as u32));
            }
            self.at(sig.push_interval_s, Ev::Push);
        }
        if spec.balancer == Balancer::Epp {
            self.at(0.0, Ev::EppRefresh);
        }
        if spec.balancer.refreshes_per_replica() {
            // Each replica's metrics on their own timer, at an independent phase.
            let mut phase_rng = stream(spec.seed, 4);
            for r in 0..self.reps.len() {
                let phase = phase_rng.gen_range(0.0..sig.epp_refresh_s);
                self.at(phase, Ev::EppRefreshOne(r as u32));
            }
        }
        for r in 0..self.external.len() {
            let (arrivals, rng) = &mut self.external[r];
            if let Some(t) = arrivals.next(rng) {
                if t < spec.scenario.duration_s {
                    self.at(t, Ev::External(r as u32));
                }
            }
        }
        self.at(0.0, Ev::Tick);
        for c in &spec.scenario.speed_changes {
            if c.replica < self.reps.len() {
                self.at(c.at_s, Ev::Speed(c.replica as u32, c.speed));
            }
        }
    }

    fn in_window(&self, t: f64) -> bool {
        t >= self.spec.scenario.warmup_s && t < self.spec.scenario.duration_s
    }

    fn main_loop(&mut self) {
        let end = self.spec.scenario.duration_s;
        // A backstop only: every request either gets scheduled or gives up within the timeout, and
        // scheduled requests finish.
        let hard_stop = end + self.spec.timeout_s + 3600.0;
        loop {
            let next_t = self.heap.peek().map(|e| e.t).unwrap_or(f64::INFINITY);
            while let Some(&(deadline, id, serial)) = self.timeouts.front() {
                if deadline > next_t {
                    break;
                }
                self.timeouts.pop_front();
                self.now = deadline;
                self.timeout(id, serial);
            }
            let Some(e) = self.heap.pop() else { break };
            self.now = e.t;
            if e.t >= end && self.in_flight == 0 {
                break;
            }
            if e.t > hard_stop {
                break;
            }
            self.events += 1;
            match e.ev {
                Ev::Arrival => self.arrival(),
                Ev::StepEnd(r) => self.step_end(r as usize),
                Ev::Scrape(r) => {
                    self.scrape(r as usize);
                    let t = self.now + self.spec.signals.scrape_interval_s;
                    self.at(t, Ev::Scrape(r));
                }
                Ev::Push => self.push(),
                Ev::EppRefresh => {
                    for r in 0..self.reps.len() {
                        self.refresh_epp(r);
                    }
                    let t = self.now + self.spec.signals.epp_refresh_s;
                    self.at(t, Ev::EppRefresh);
                }
                Ev::EppRefreshOne(r) => {
                    self.refresh_epp(r as usize);
                    let t = self.now + self.spec.signals.epp_refresh_s;
                    self.at(t, Ev::EppRefreshOne(r));
                }
                Ev::Apply => {
                    if let Some(w) = self.pending_weights.pop_front() {
                        self.apply_weights(&w);
                    }
                }
                Ev::External(r) => self.external_arrival(r as usize),
                Ev::Tick => self.tick(),
                Ev::Speed(r, s) => self.reps[r as usize].engine.set_speed(s),
                Ev::Turn(s) => self.turn(s),
            }
        }
        // Whatever is still in flight at the backstop never finished: count it as rejected.
        self.rejected += self.reqs.iter().filter(|q| q.live && q.measured).count() as u64;
    }

    fn refresh_epp(&mut self, r: usize) {
        let s = self.reps[r].engine.stats();
        for lb in &mut self.lbs {
            lb.set_gauges(r, Gauges { waiting: s.waiting, running: s.running, kv_usage: s.kv_usage });
        }
    }

    fn apply_weights(&mut self, w: &[u32]) {
        if self.applied.as_deref() != Some(w) {
            self.weight_updates += 1;
        }
        let ratios = self.spec.balancer.uses_ratios();
        // Spill-over: replicas of inactive tiers (ratio 0) are out of every balancer's choice.
        let tiers =
            (self.spec.tiering == Tiering::SpillOver).then(|| w.iter().map(|&x| x > 0).collect::<Vec<_>>());
        for lb in &mut self.lbs {
            if ratios {
                lb.set_weights(w);
            }
            if let Some(t) = &tiers {
                lb.set_eligible(t.clone());
            }
        }
        self.applied = Some(w.to_vec());
    }

    /// Round trip added to what the client sees of a request served by replica `r`.
    fn rtt(&self, r: usize) -> f64 {
        self.spec.scenario.rtt_s.get(r).copied().unwrap_or(0.0)
    }

    /// A request from outside this LB: not measured, not counted by any balancer instance.
    fn external_arrival(&mut self, r: usize) {
        let (prompt, output) = self.lengths.sample(&mut self.external_lengths);
        let id = self.new_req(r, EXTERNAL, false);
        self.in_flight += 1;
        match self.reps[r].engine.add_request(EngineRequest::new(u64::from(id), prompt, output)) {
            Ok(()) => {
                let serial = self.reqs[id as usize].serial;
                self.timeouts.push_back((self.now + self.spec.timeout_s, id, serial));
                self.start_step(r);
            }
            Err(_) => self.release(id, r, true),
        }
        let (arrivals, rng) = &mut self.external[r];
        if let Some(t) = arrivals.next(rng) {
            if t < self.spec.scenario.duration_s {
                self.at(t, Ev::External(r as u32));
            }
        }
    }

    fn new_req(&mut self, r: usize, lb: u16, measured: bool) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.reqs.push(Req::default());
                (self.reqs.len() - 1) as u32
            }
        };
        self.serial += 1;
        self.reqs[id as usize] = Req {
            serial: self.serial,
            arrival: self.now,
            last_token: self.now,
            replica: r as u32,
            measured,
            scheduled: false,
            scheduled_at: 0.0,
            live: true,
            lb,
            session: NO_SESSION,
        };
        id
    }

    fn arrival(&mut self) {
        let spec = self.spec;
        match &mut self.traffic {
            Traffic::Plain => {
                let (prompt, output) = self.lengths.sample(&mut self.length_rng);
                let key = spec.body_keys.then(|| self.key_rng.gen::<u64>());
                self.dispatch(prompt, output, None, key, NO_SESSION);
            }
            Traffic::Shared(w) => {
                let p = w.next(&mut self.length_rng);
                self.dispatch_prompt(p, NO_SESSION);
            }
            Traffic::Turns(w) => {
                let session = w.start(&mut self.length_rng);
                let slot = match self.free_sessions.pop() {
                    Some(slot) => {
                        self.sessions[slot as usize] = Some(session);
                        slot
                    }
                    None => {
                        self.sessions.push(Some(session));
                        (self.sessions.len() - 1) as u32
                    }
                };
                self.turn(slot);
            }
        }
        if let Some(t) = self.arrivals.next(&mut self.arrival_rng) {
            if t < spec.scenario.duration_s {
                self.at(t, Ev::Arrival);
            }
        }
    }

    /// Session `slot`'s next turn, or its end.
    fn turn(&mut self, slot: u32) {
        let Traffic::Turns(w) = &self.traffic else { return };
        let next = self.sessions.get_mut(slot as usize).and_then(Option::as_mut).and_then(|s| w.turn(s));
        match next {
            Some(p) => self.dispatch_prompt(p, slot),
            None => self.end_session(slot),
        }
    }

    fn end_session(&mut self, slot: u32) {
        if let Some(s) = self.sessions.get_mut(slot as usize) {
            if s.take().is_some() {
                self.free_sessions.push(slot);
            }
        }
    }

    fn dispatch_prompt(&mut self, p: Prompt, session: u32) {
        self.dispatch(p.prompt_tokens, p.output_tokens, Some(p.blocks), Some(p.key), session);
    }

    /// Send one request of this LB's clients through a balancer instance to a replica.
    fn dispatch(
        &mut self,
        prompt: u32,
        output: u32,
        blocks: Option<Arc<[u64]>>,
        key: Option<u64>,
        session: u32,
    ) {
        let spec = self.spec;
        let k = if self.lbs.len() > 1 { self.lb_rng.gen_range(0..self.lbs.len()) } else { 0 };
        let prompt_blocks = match &blocks {
            Some(b) => &b[..b.len().min((prompt / llm_lc_sim::profile::BLOCK_SIZE) as usize)],
            None => &[][..],
        };
        let r = self.lbs[k].pick_route(Route { key, blocks: prompt_blocks, prompt_tokens: prompt });
        let measured = self.in_window(self.now);
        let id = self.new_req(r, k as u16, measured);
        self.lbs[k].opened(u64::from(id), r);
        self.reqs[id as usize].session = session;
        if measured {
            self.dispatched[r] += 1;
        }
        self.in_flight += 1;
        let req = EngineRequest::new(u64::from(id), prompt, output);
        let added = match blocks {
            Some(b) => self.reps[r].engine.add_request_with_blocks(req, b),
            None => self.reps[r].engine.add_request(req),
        };
        match added {
            Ok(()) => {
                self.timeouts.push_back((self.now + spec.timeout_s, id, self.serial));
                self.start_step(r);
            }
            Err(_) => {
                // Sizes are drawn within max_model_len, so this does not happen; count it if it does.
                self.release(id, r, true);
            }
        }
    }

    /// Start replica `r`'s next step if it is idle and has work.
    fn start_step(&mut self, r: usize) {
        let rep = &mut self.reps[r];
        if rep.busy || !rep.engine.has_work() {
            return;
        }
        rep.pending.clear();
        let info = rep.engine.step_into(&mut rep.pending);
        if info.duration_s <= 0.0 {
            return;
        }
        // Queue time ends when the step starts: from now on the client is being served.
        for ev in &rep.pending {
            if let EngineEvent::Scheduled { id } = *ev {
                let q = &mut self.reqs[id as usize];
                // A preempted request is scheduled again; its running time starts at the first.
                if !q.scheduled {
                    q.scheduled = true;
                    q.scheduled_at = self.now;
                }
            }
        }
        rep.busy = true;
        let t = self.now + info.duration_s;
        self.at(t, Ev::StepEnd(r as u32));
    }

    fn step_end(&mut self, r: usize) {
        let now = self.now;
        let in_window = self.in_window(now);
        let mut pending = std::mem::take(&mut self.reps[r].pending);
        for ev in pending.drain(..) {
            match ev {
                EngineEvent::Scheduled { .. } | EngineEvent::Preempted { .. } => {}
                EngineEvent::FirstToken { id } => {
                    let rtt = self.rtt(r);
                    if let Some(lb) = self.lbs.get_mut(usize::from(self.reqs[id as usize].lb)) {
                        lb.first_token(id);
                    }
                    let q = &mut self.reqs[id as usize];
                    if q.measured {
                        self.ttft.push((now - q.arrival + rtt) as f32);
                    }
                    q.last_token = now;
                    self.tokens += u64::from(in_window);
                }
                EngineEvent::Token { id } => {
                    let q = &mut self.reqs[id as usize];
                    if q.measured {
                        self.itl.add(now - q.last_token);
                    }
                    q.last_token = now;
                    self.tokens += u64::from(in_window);
                }
                EngineEvent::Finished { id, .. } => {
                    let q = self.reqs[id as usize];
                    let rep = &mut self.reps[r];
                    rep.e2e_sum += now - q.arrival;
                    rep.run_sum += now - q.scheduled_at;
                    rep.e2e_count += 1;
                    if q.measured {
                        self.e2e.push((now - q.arrival + self.rtt(r)) as f32);
                        self.completed += 1;
                    }
                    self.release(id as u32, r, false);
                    if q.session != NO_SESSION {
                        self.follow_up(q.session, now + self.rtt(r));
                    }
                }
            }
        }
        let rep = &mut self.reps[r];
        rep.pending = pending;
        rep.busy = false;
        self.start_step(r);
    }

    /// The user read the answer at `read_at`; the next turn comes after their think time, unless
    /// the run is over by then.
    fn follow_up(&mut self, slot: u32, read_at: f64) {
        let think = self.sessions.get(slot as usize).and_then(Option::as_ref).map(Session::think_s);
        match think {
            Some(think) if read_at + think < self.spec.scenario.duration_s => {
                self.at(read_at + think, Ev::Turn(slot))
            }
            _ => self.end_session(slot),
        }
    }

    fn release(&mut self, id: u32, r: usize, rejected: bool) {
        let q = &mut self.reqs[id as usize];
        if rejected && q.measured {
            self.rejected += 1;
            self.ttft.push(self.spec.timeout_s as f32);
        }
        let session = q.session;
        if rejected && session != NO_SESSION {
            self.end_session(session); // a client that gave up does not come back
        }
        let q = &mut self.reqs[id as usize];
        q.live = false;
        let lb = q.lb;
        self.free.push(id);
        self.in_flight -= 1;
        if let Some(lb) = self.lbs.get_mut(usize::from(lb)) {
            lb.finished(r);
            lb.closed(u64::from(id));
        }
    }

    fn timeout(&mut self, id: u32, serial: u64) {
        let q = self.reqs[id as usize];
        if !q.live || q.serial != serial || q.scheduled {
            return;
        }
        let r = q.replica as usize;
        self.reps[r].engine.abort(u64::from(id));
        self.release(id, r, true);
    }

    fn scrape(&mut self, r: usize) {
        let now = self.now;
        let window = self.spec.signals.latency_window_s;
        let rep = &mut self.reps[r];
        rep.scraped.push_back((now, rep.e2e_sum, rep.run_sum, rep.e2e_count));
        // Drop scrapes that left the window: rate() uses the first and the last sample inside it.
        while rep.scraped.len() > 1 && rep.scraped[0].0 <= now - window {
            rep.scraped.pop_front();
        }
        let (_, e2e0, run0, count0) = rep.scraped[0];
        let means = (rep.e2e_count > count0).then(|| {
            let n = (rep.e2e_count - count0) as f64;
            ((rep.e2e_sum - e2e0) / n, (rep.run_sum - run0) / n)
        });
        rep.sample = Some((rep.engine.stats(), now, means));
    }

    fn push(&mut self) {
        let now = self.now;
        let Some(control) = self.control.as_mut() else { return };
        let observations: Vec<Option<Observation>> = self
            .reps
            .iter()
            .map(|rep| {
                rep.sample.map(|(s, at, means)| Observation {
                    waiting: f64::from(s.waiting),
                    running: f64::from(s.running),
                    kv_usage: s.kv_usage,
                    latency_s: means.map(|m| m.0),
                    service_s: means.map(|m| m.1),
                    age_s: (now - at).max(0.0),
                })
            })
            .collect();
        if self.window_weights.is_none() && now >= self.spec.scenario.duration_s {
            self.window_weights = self.lbs.first().map(|lb| lb.weights());
        }
        // The controller's cycle decides; when it holds (fail-static), the balancer keeps its weights.
        let decided = control.cycle(now, &observations);
        if let Some(w) = decided {
            // Compared with what the LB will hold once earlier pushes land.
            let current = self.pending_weights.back().cloned().or_else(|| self.applied.clone());
            let changed = current.map_or(w.len(), |c| c.iter().zip(&w).filter(|(a, b)| a != b).count());
            if now >= self.spec.scenario.warmup_s && now < self.spec.scenario.duration_s {
                self.window_member_writes += changed as u64;
            }
            if changed > 0 {
                let at = self.spec.signals.lb_kind.apply_at(now, changed, self.envoy_phase);
                if at <= now {
                    self.apply_weights(&w);
                } else {
                    self.pending_weights.push_back(w.clone());
                    self.at(at, Ev::Apply);
                }
            }
            if let Some(s) = self.series.as_mut() {
                s.weight_t.push(now as f32);
                s.weights.push(w);
            }
        }
        let t = now + self.spec.signals.push_interval_s;
        self.at(t, Ev::Push);
    }

    fn tick(&mut self) {
        let now = self.now;
        let mark = usize::from(now >= self.spec.scenario.duration_s);
        if now >= self.spec.scenario.warmup_s && self.cache_marks[mark].is_none() {
            self.cache_marks[mark] = Some(self.cache_totals());
        }
        if self.in_window(now) {
            self.kv_spread.add(self.reps.iter().map(|r| r.engine.stats().kv_usage));
            self.queue_spread.add(self.reps.iter().map(|r| f64::from(r.engine.stats().waiting)));
            for rep in &self.reps {
                self.kv_sum += rep.engine.stats().kv_usage;
                self.kv_n += 1;
            }
        }
        if let Some(s) = self.series.as_mut() {
            s.t.push(now as f32);
            for (i, rep) in self.reps.iter().enumerate() {
                let st = rep.engine.stats();
                s.kv[i].push(st.kv_usage as f32);
                s.waiting[i].push(st.waiting as f32);
            }
        }
        self.at(now + 1.0, Ev::Tick);
    }

    /// Prefix cache (queries, hits) summed over the fleet.
    fn cache_totals(&self) -> (u64, u64) {
        self.reps
            .iter()
            .map(|r| r.engine.stats())
            .fold((0, 0), |(q, h), s| (q + s.prefix_cache_queries, h + s.prefix_cache_hits))
    }

    fn finish(mut self) -> RunOutcome {
        let ((q0, h0), (q1, h1)) = (
            self.cache_marks[0].unwrap_or((0, 0)),
            self.cache_marks[1].unwrap_or_else(|| self.cache_totals()),
        );
        let prefix_hit_rate = if q1 > q0 { (h1 - h0) as f64 / (q1 - q0) as f64 } else { 0.0 };
        sort(&mut self.ttft);
        sort(&mut self.e2e);
        let window = self.spec.scenario.duration_s - self.spec.scenario.warmup_s;
        let total: u64 = self.dispatched.iter().sum();
        let result = BalancerResult {
            balancer: self.spec.label(),
            ttft_p50_s: percentile(&self.ttft, 0.50),
            ttft_p90_s: percentile(&self.ttft, 0.90),
            ttft_p99_s: percentile(&self.ttft, 0.99),
            itl_p50_s: self.itl.quantile(0.50),
            itl_p99_s: self.itl.quantile(0.99),
            e2e_p99_s: percentile(&self.e2e, 0.99),
            throughput_tok_s: self.tokens as f64 / window,
            completed: self.completed,
            rejected: self.rejected,
            kv_spread: self.kv_spread.mean(),
            queue_spread: self.queue_spread.mean(),
            mean_kv_usage: if self.kv_n == 0 { 0.0 } else { self.kv_sum / self.kv_n as f64 },
            preemptions: self.reps.iter().map(|r| r.engine.stats().num_preemptions).sum(),
            weight_updates: self.weight_updates,
            member_writes_per_min: self.window_member_writes as f64
                / self.reps.len().max(1) as f64
                / (window / 60.0),
            final_weights: if self.spec.balancer.uses_ratios() || self.spec.balancer.uses_static_weights() {
                self.window_weights
                    .clone()
                    .or_else(|| self.lbs.first().map(|lb| lb.weights()))
                    .unwrap_or_default()
            } else {
                vec![]
            },
            share: self
                .dispatched
                .iter()
                .map(|&d| if total == 0 { 0.0 } else { d as f64 / total as f64 })
                .collect(),
            prefix_hit_rate,
        };
        RunOutcome { result, ttft_sorted: self.ttft, series: self.series, events: self.events, wall_s: 0.0 }
    }
}

#[cfg(test)]
mod lb_kind_tests {
    use super::LbKind;

    #[test]
    fn weights_take_effect_after_the_lb_kinds_delay() {
        assert_eq!(LbKind::Proxy.apply_at(10.0, 6, 0.3), 10.0);
        assert!((LbKind::Haproxy.apply_at(10.0, 6, 0.3) - 10.05).abs() < 1e-9);
        // Envoy serves the new assignment on its next EDS poll (every second, at phase 0.3).
        assert!((LbKind::Envoy.apply_at(10.0, 6, 0.3) - 10.3).abs() < 1e-9);
        assert!((LbKind::Envoy.apply_at(10.5, 6, 0.3) - 11.3).abs() < 1e-9);
        // BIG-IP: more changed members, more PATCH calls.
        assert!(LbKind::F5.apply_at(10.0, 6, 0.0) > LbKind::F5.apply_at(10.0, 1, 0.0));
        assert!(LbKind::parse("nginx").unwrap_err().contains("envoy"));
    }
}
