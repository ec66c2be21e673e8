//! One replica's engine task: advances the pure [`Engine`] in real time, scaled by `time_scale`.
//!
//! HTTP handlers talk to it through a command channel ([`Cmd`]) and get their tokens back on a
//! per-request channel ([`Out`]). Like vLLM's engine core, a step runs to completion: requests that
//! arrive during a step join at the next one. The task sleeps until each step's end on an absolute
//! schedule, so coarse timers do not make it drift; when it falls more than [`MAX_LAG`] behind
//! (a starved CPU) it re-bases on the clock instead of bursting.
//!
//! Latency histograms record *model* time: real seconds x `time_scale`, taken from the step
//! schedule, so `--time-scale 10` shows the same TTFT as real time, ten times sooner.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use super::engine::{Engine, EngineEvent, EngineRequest, EngineStats, FinishReason, RejectReason};
use super::metrics::{LoraInfo, RequestMetrics};
use super::profile::ModelProfile;

/// How far behind schedule the task may run before it stops catching up.
pub const MAX_LAG: Duration = Duration::from_millis(50);

/// A request for the engine task.
pub(crate) enum Cmd {
    Submit(Submission),
    Abort {
        id: u64,
    },
    SetSpeed(f64),
    /// Stop stepping (requests still queue) or resume.
    SetHang(bool),
    /// A crash and restart: drop every request (their channels close) and start empty.
    Reset,
}

pub(crate) struct Submission {
    pub req: EngineRequest,
    /// The prompt's block hashes, for the prefix cache.
    pub blocks: std::sync::Arc<[u64]>,
    pub adapter: Option<String>,
    pub arrived: Instant,
    pub tx: UnboundedSender<Out>,
}

/// What a request's handler receives.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Out {
    /// One output token; the last one carries `(output_tokens, reason)`.
    Token {
        finish: Option<(u32, FinishReason)>,
    },
    Rejected(RejectReason),
}

/// What `/metrics` and `/admin` read; the engine task rewrites it after every step.
#[derive(Debug, Clone)]
pub(crate) struct Observed {
    pub stats: EngineStats,
    pub requests: RequestMetrics,
    pub lora: Option<LoraInfo>,
    pub speed: f64,
    pub hang: bool,
    /// Unix time of the (re)start: `_created` samples.
    pub started_unix: f64,
}

pub(crate) fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl Observed {
    pub fn new(speed: f64, num_gpu_blocks: u32, lora_slots: Option<u32>) -> Self {
        Observed {
            stats: EngineStats { num_gpu_blocks, ..EngineStats::default() },
            requests: RequestMetrics::default(),
            lora: lora_slots.map(|max_lora| LoraInfo { max_lora, ..LoraInfo::default() }),
            speed,
            hang: false,
            started_unix: unix_now(),
        }
    }
}

struct Track {
    tx: UnboundedSender<Out>,
    arrived: Instant,
    last_token: Option<Instant>,
    adapter: Option<String>,
    /// When the engine first scheduled it: the start of its time in the running batch.
    scheduled: Option<Instant>,
    prompt_tokens: u32,
    /// When its first token came: the start of its generation time (llama-server's counters).
    first_token: Option<Instant>,
}

struct Driver {
    profile: ModelProfile,
    engine: Engine,
    time_scale: f64,
    reqs: HashMap<u64, Track>,
    events: Vec<EngineEvent>,
    hang: bool,
    observed: Arc<Mutex<Observed>>,
}

/// Run the engine task until every command sender is gone.
pub(crate) async fn drive(
    profile: ModelProfile,
    engine: Engine,
    time_scale: f64,
    mut rx: UnboundedReceiver<Cmd>,
    observed: Arc<Mutex<Observed>>,
) {
    let mut d = Driver {
        profile,
        engine,
        time_scale,
        reqs: HashMap::new(),
        events: Vec::new(),
        hang: false,
        observed,
    };
    let mut last_end: Option<Instant> = None;
    loop {
        if d.hang || !d.engine.has_work() {
            match rx.recv().await {
                Some(cmd) => d.handle(cmd),
                None => return,
            }
            while let Ok(cmd) = rx.try_recv() {
                d.handle(cmd);
            }
            d.publish(|_| {});
            continue;
        }
        while let Ok(cmd) = rx.try_recv() {
            d.handle(cmd);
        }
        if d.hang || !d.engine.has_work() {
            d.publish(|_| {});
            continue;
        }
        let now = Instant::now();
        let start = match last_end {
            Some(t) if now.saturating_duration_since(t) < MAX_LAG => t,
            _ => now,
        };
        d.events.clear();
        let info = d.engine.step_into(&mut d.events);
        let end = start + Duration::from_secs_f64(info.duration_s / d.time_scale);
        tokio::time::sleep_until(end.into()).await;
        d.deliver(start, end);
        last_end = Some(end);
    }
}

impl Driver {
    fn sim_s(&self, from: Instant, to: Instant) -> f64 {
        to.saturating_duration_since(from).as_secs_f64() * self.time_scale
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Submit(s) => {
                let id = s.req.id;
                match self.engine.add_request_with_blocks(s.req, s.blocks) {
                    Ok(()) => {
                        let t = Track {
                            tx: s.tx,
                            arrived: s.arrived,
                            last_token: None,
                            adapter: s.adapter,
                            scheduled: None,
                            prompt_tokens: s.req.prompt_tokens,
                            first_token: None,
                        };
                        self.reqs.insert(id, t);
                    }
                    Err(e) => {
                        let _ = s.tx.send(Out::Rejected(e));
                    }
                }
            }
            Cmd::Abort { id } => {
                if self.engine.abort(id).is_some() {
                    self.reqs.remove(&id);
                    self.publish(|o| o.requests.finished(FinishReason::Abort));
                }
            }
            Cmd::SetSpeed(s) => {
                self.engine.set_speed(s);
                let speed = self.engine.speed();
                self.publish(|o| o.speed = speed);
            }
            Cmd::SetHang(h) => {
                self.hang = h;
                self.publish(|o| o.hang = h);
            }
            Cmd::Reset => {
                let speed = self.engine.speed();
                // The profile was validated when the fleet started, so this cannot fail; keep the
                // old engine if it somehow does rather than panic.
                if let Ok(e) = Engine::new(&self.profile, speed) {
                    self.engine = e;
                }
                self.reqs.clear();
                self.hang = false;
                let blocks = self.profile.num_gpu_blocks;
                self.publish(|o| {
                    let lora = o.lora.as_ref().map(|l| l.max_lora);
                    *o = Observed::new(speed, blocks, lora);
                });
            }
        }
    }

    /// Hand the step's events to their requests and record latencies. `start`/`end` bound the step.
    fn deliver(&mut self, start: Instant, end: Instant) {
        let mut obs = match self.observed.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let events = std::mem::take(&mut self.events);
        let mut k = 0;
        while k < events.len() {
            match events[k] {
                EngineEvent::Scheduled { id } => {
                    if let Some(t) = self.reqs.get_mut(&id) {
                        // A preempted request is scheduled again; its running time starts at the first.
                        // The step may have been timed before a request that joined it arrived.
                        t.scheduled.get_or_insert(start.max(t.arrived));
                        let q = start.saturating_duration_since(t.arrived).as_secs_f64() * self.time_scale;
                        obs.requests.queue.observe(q);
                    }
                }
                EngineEvent::FirstToken { id } | EngineEvent::Token { id } => {
                    let first = matches!(events[k], EngineEvent::FirstToken { .. });
                    let finish = match events.get(k + 1) {
                        Some(EngineEvent::Finished { id: fid, output_tokens, reason }) if *fid == id => {
                            k += 1;
                            Some((*output_tokens, *reason))
                        }
                        _ => None,
                    };
                    let mut done = false;
                    if let Some(t) = self.reqs.get_mut(&id) {
                        let since_arrival =
                            end.saturating_duration_since(t.arrived).as_secs_f64() * self.time_scale;
                        if first {
                            obs.requests.ttft.observe(since_arrival);
                            let llama = &mut obs.requests.llama;
                            llama.prompt_tokens += u64::from(t.prompt_tokens);
                            let began = t.scheduled.unwrap_or(t.arrived);
                            llama.prompt_s +=
                                end.saturating_duration_since(began).as_secs_f64() * self.time_scale;
                            t.first_token = Some(end);
                        } else if let Some(prev) = t.last_token {
                            obs.requests
                                .itl
                                .observe(end.saturating_duration_since(prev).as_secs_f64() * self.time_scale);
                        }
                        t.last_token = Some(end);
                        // A client that went away is aborted by its handler's guard; ignore send errors.
                        let _ = t.tx.send(Out::Token { finish });
                        if let Some((output_tokens, reason)) = finish {
                            obs.requests.e2e.observe(since_arrival);
                            let llama = &mut obs.requests.llama;
                            llama.predicted_tokens += u64::from(output_tokens);
                            if let Some(at) = t.first_token {
                                llama.predicted_s +=
                                    end.saturating_duration_since(at).as_secs_f64() * self.time_scale;
                            }
                            if let Some(at) = t.scheduled {
                                obs.requests.inference.observe(
                                    end.saturating_duration_since(at).as_secs_f64() * self.time_scale,
                                );
                            }
                            obs.requests.finished(reason);
                            done = true;
                        }
                    }
                    if done {
                        self.reqs.remove(&id);
                    }
                }
                EngineEvent::Finished { id, output_tokens, reason } => {
                    // Not preceded by its token (cannot happen with the engine as written); still
                    // close the request properly.
                    if let Some(t) = self.reqs.remove(&id) {
                        let _ = t.tx.send(Out::Token { finish: Some((output_tokens, reason)) });
                        obs.requests.e2e.observe(self.sim_s(t.arrived, end));
                        obs.requests.finished(reason);
                    }
                }
                EngineEvent::Preempted { .. } => {}
            }
            k += 1;
        }
        self.events = events;
        obs.stats = self.engine.stats();
        if let Some(lora) = obs.lora.as_mut() {
            fill_lora(lora, &self.reqs);
        }
    }

    fn publish(&self, f: impl FnOnce(&mut Observed)) {
        let mut obs = match self.observed.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut obs);
        obs.stats = self.engine.stats();
        if let Some(lora) = obs.lora.as_mut() {
            fill_lora(lora, &self.reqs);
        }
    }
}

/// Adapters with requests running (admitted at least once) and waiting (never admitted yet).
fn fill_lora(lora: &mut LoraInfo, reqs: &HashMap<u64, Track>) {
    let mut running: BTreeMap<&str, ()> = BTreeMap::new();
    let mut waiting: BTreeMap<&str, ()> = BTreeMap::new();
    for t in reqs.values() {
        if let Some(a) = &t.adapter {
            if t.scheduled.is_some() {
                running.insert(a, ());
            } else {
                waiting.insert(a, ());
            }
        }
    }
    lora.running = running.into_keys().map(str::to_string).collect();
    lora.waiting = waiting.into_keys().map(str::to_string).collect();
}
