//! `capacity`: ratios from each server's estimated capacity, with feed-forward, corrected by what
//! users feel (queueing delay) and by traffic the LB does not see (utilization).
//!
//! Why not equalize KV usage (`feedback`): KV usage is not what users feel, and it is not
//! comparable across servers whose memory and speed differ differently. A tensor-parallel-2 replica
//! has 2.35x the KV cache but only ~1.7x the speed: at equal KV usage it gets 2.35x the requests and
//! queues. And an integrator needs many cycles to move a share by 3x.
//!
//! What it estimates per member, from the samples the controller already has:
//! - **capacity in concurrent requests** `K = min(max_num_seqs, running / KV usage)`: how many of
//!   today's requests fill the server (its batch limit or its memory, whichever binds). Smoothed:
//!   memory does not change suddenly, the mix on one server at one instant is noisy;
//! - **service time** `s`: preferably the mean time requests spent running (vLLM's
//!   `vllm:request_inference_time_seconds`), which carries no queueing and so is usable whether the
//!   server queues or not. Otherwise the mean end-to-end time, learnt while the server does not
//!   queue (then latency is service). End-to-end times of a queued server carry the waits of a
//!   backlog that may be gone: a replica left with a long queue was estimated 2-3x slower than it
//!   is and got its share back only minutes after the queue had drained. Feed-forward: when a
//!   queued server's time exceeds its estimate by half or more, the estimate jumps at once to it
//!   (an end-to-end time with the queue's part taken out, by Little's law:
//!   `latency x running / (running + waiting)`), so a server slowed to a third is at its new share
//!   as soon as its samples show it. Not on a memory-bound server (KV usage >= 0.9), nor for a
//!   minute after it was one (the times are one-minute means): it preempts and recomputes, and
//!   vLLM counts a preempted request's wait as running, so its times grow with the load, not with
//!   lost speed;
//! - **queueing delay** `d = waiting x s / K`: how long a request sent now waits for its first token.
//!
//! The ratio is `base x trim x delay factor`:
//! - `base` is what the LB needs to split traffic by capacity. Behind **least-connections** the LB
//!   keeps in-flight counts proportional to the ratios, so the ratio is `K`: a slower server holds
//!   each request longer and so gets fewer (least-connections already handles speed; weighting it
//!   again overfeeds the fast replicas). Behind **weighted round robin** the LB splits arrivals by
//!   ratio, so the ratio is the throughput capacity `K / s`.
//! - `delay factor = (1 + d_min / tau) / (1 + d / tau)`, weighted round robin only: what users feel.
//!   A member whose queue makes requests wait `tau` longer than on the best member gets half its
//!   share. Proportional, not integral: a draining backlog gets its share back as it drains (no
//!   starving, no windup). Least-connections counts queued requests itself, so it is not applied.
//! - `trim`: a slow integral on utilization `(running + waiting) / K` (capped at 1) toward the pool
//!   mean, outside a band of `trim_band` (noise would make it a random walk). It corrects what the
//!   model cannot see, mainly traffic that reaches a server without passing this LB; bounded to
//!   `[1/trim_max, trim_max]`. It integrates each reading once, weighted by the time it covers
//!   (`gain` is per 15 s): with samples every 15 s and a cycle every 5 s, integrating every cycle
//!   counted each reading three times and let the trims of identical replicas drift apart by +-25%
//!   (weighted round robin then overfed some); direct scrapes every second, counted fully, made it
//!   fifteen times faster than chosen, and it wound up on a passing backlog (the demo's slow
//!   replica was kept at 1-5% of the traffic for 20 s after its queue had drained).
//!
//! Ratios are rescaled so the pool mean sits mid-range; a pool-wide deadband keeps the LB API calm.
//! Members without estimates yet get the pool's mean. Pure: no clock, no I/O.

use llm_lc_adapters::MemberMap;
use serde::Deserialize;

use super::Inputs;
use crate::source::Sample;

/// Which LB algorithm the ratios feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// F5 `ratio-least-connections-member`, HAProxy `leastconn`, Envoy `LEAST_REQUEST`: ratio = `K`.
    #[default]
    LeastConnections,
    /// F5 `ratio-member`, HAProxy `roundrobin`, Envoy `ROUND_ROBIN`: ratio = `K / s`.
    RoundRobin,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapacityParams {
    /// What the ratios feed (see [`Mode`]).
    pub mode: Mode,
    /// Largest batch a server runs (vLLM `max_num_seqs`); a server that queues shows its own limit.
    pub max_num_seqs: f64,
    /// Weight of a new estimate (a slowdown on a queued server is taken at once).
    pub smoothing: f64,
    /// Weighted round robin only: queueing delay, in seconds, above the best member's that halves a
    /// member's share. (Least-connections counts queued requests itself.)
    pub delay_tau: f64,
    /// Exponent of the utilization correction per 15 s of readings (0 turns the trim off).
    pub gain: f64,
    /// Utilization differences from the pool mean smaller than this do not move the trim (noise
    /// and 15 s-old samples would make it a random walk).
    pub trim_band: f64,
    /// Bound of the trim: it stays within `[1/trim_max, trim_max]`.
    pub trim_max: f64,
    /// Relative changes smaller than this on every member keep the previous ratios.
    pub deadband: f64,
    /// Running requests that count as a full server, for servers that publish no KV usage.
    pub running_norm: f64,
}

impl Default for CapacityParams {
    /// Chosen on seeds 1-3 of the benchmark's goals grid (src/bench/RESULTS.md): smoothing 0.03
    /// beat 0.1 with weighted round robin on long-context mixes (noisy estimates made it 2-6x worse
    /// than fixed weights) and was no worse behind least-connections; delay_tau 2 s beat 1 s;
    /// with the trim integrating each reading once, gain 0.2 and trim_band 0.15 met 39 of 39 goal
    /// checks (gain 0.1: 37, 0.15: 38; band 0.12: 35).
    fn default() -> Self {
        CapacityParams {
            mode: Mode::LeastConnections,
            max_num_seqs: 256.0,
            smoothing: 0.03,
            delay_tau: 2.0,
            gain: 0.2,
            trim_band: 0.15,
            trim_max: 4.0,
            deadband: 0.05,
            running_norm: 64.0,
        }
    }
}

impl CapacityParams {
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut e = Vec::new();
        let mut check = |ok: bool, f: &str, m: &str| {
            if !ok {
                e.push((f.to_string(), m.to_string()));
            }
        };
        check(self.max_num_seqs >= 1.0 && self.max_num_seqs.is_finite(), "max_num_seqs", "must be >= 1");
        check(self.smoothing > 0.0 && self.smoothing <= 1.0, "smoothing", "must be in (0, 1]");
        check(self.delay_tau > 0.0 && self.delay_tau.is_finite(), "delay_tau", "must be > 0 (seconds)");
        check((0.0..=1.0).contains(&self.gain), "gain", "must be in [0, 1]");
        check((0.0..1.0).contains(&self.trim_band), "trim_band", "must be in [0, 1)");
        check(self.trim_max >= 1.0 && self.trim_max.is_finite(), "trim_max", "must be >= 1");
        check((0.0..1.0).contains(&self.deadband), "deadband", "must be in [0, 1)");
        check(self.running_norm > 0.0 && self.running_norm.is_finite(), "running_norm", "must be > 0");
        e
    }
}

/// Queue length that weighs as much as a full server in the pool's saturation figure.
pub const SATURATION_QUEUE_NORM: f64 = 256.0;
/// At most this share of the smallest ratio of a member with room goes to a member that queues
/// (see [`queue_rule`]).
const QUEUED_SHARE: f64 = 0.9;
/// How much a queue as long as the member's capacity weighs in the queue rule's cut.
const QUEUE_WEIGHT: f64 = 2.0;
/// Requests' worth of the pool's memory reading the queue rule pulls each member's toward.
const SHRINK_REQUESTS: f64 = 8.0;
/// Fewer running requests than this say too little about a server's capacity.
const MIN_RUNNING: f64 = 4.0;
/// Below this memory use `running / usage` is mostly rounding.
const MIN_USAGE: f64 = 0.02;
/// A service time this much longer than the estimate, on a queued server, is a slowdown, not noise.
const SLOWDOWN: f64 = 1.5;
/// The trim's `gain` is per this much time of readings (a Prometheus scrape interval).
const TRIM_PERIOD: std::time::Duration = std::time::Duration::from_secs(15);
/// KV usage from which a server is memory-bound: it preempts requests and recomputes them.
const MEMORY_BOUND: f64 = 0.9;
/// How long after a server was memory-bound its times may still carry preemptions: the times are
/// means over a window (Prometheus `rate(...[1m])`), the KV usage is of this instant.
const MEMORY_BOUND_ECHO: std::time::Duration = std::time::Duration::from_secs(60);

/// What the policy remembers of one member.
#[derive(Debug, Clone, Copy, Default)]
struct Member {
    /// Capacity in concurrent requests.
    k: Option<f64>,
    /// Service time, seconds.
    s: Option<f64>,
    /// `s` has been learnt from the time running: end-to-end latency (which carries the queue's
    /// waits) no longer moves it, even in a cycle where the time running is missing.
    s_running: bool,
    trim: f64,
    last: Option<u32>,
    /// Age of the sample seen last cycle (see [`Capacity::is_new`]).
    age: Option<std::time::Duration>,
    /// Time since the last new reading (see [`Capacity::trim_weight`]).
    unread: std::time::Duration,
    /// How much this cycle's reading moves the trim: 0 for one seen before.
    trim_weight: f64,
    /// Time since the member was last seen memory-bound; `None`: not seen so.
    since_full: Option<std::time::Duration>,
    /// The queue rule's cut (see [`queue_rule`]): set on the first reading of a member that
    /// queues beside one with room, kept while later readings confirm it, dropped otherwise.
    queue_cut: Option<f64>,
}

impl Member {
    /// Nothing known yet; no trim.
    fn new() -> Self {
        Member { trim: 1.0, ..Member::default() }
    }
}

pub struct Capacity {
    pub params: CapacityParams,
    /// The controller's cycle interval: how much older a reading seen again has become.
    interval: std::time::Duration,
    /// Per-member memory, kept in line with the snapshot's members (index = position).
    members: MemberMap<Member>,
}

impl Capacity {
    pub fn new(params: CapacityParams, interval: std::time::Duration) -> Self {
        Capacity { params, interval, members: MemberMap::default() }
    }

    /// Whether a sample of age `age` is a new reading, after one of age `prev` a cycle ago. The same
    /// reading seen again is a whole interval older; a new one is younger than that. Comparing
    /// the ages alone would call a new scrape that took a millisecond longer than the last one
    /// (direct scrapes: ages of a few ms that jitter) a repeat.
    fn is_new(&self, prev: Option<std::time::Duration>, age: std::time::Duration) -> bool {
        prev.is_none_or(|prev| age < prev + self.interval / 2 || self.interval.is_zero())
    }

    /// How much a new reading moves the trim: the time since the previous one, per
    /// [`TRIM_PERIOD`], at most 1. So the trim's speed is set in seconds, whatever the source:
    /// Prometheus readings every 15 s count fully, direct scrapes every second a fifteenth each
    /// (counted fully, they made the trim fifteen times faster and it chased every transient).
    fn trim_weight(&self, unread: std::time::Duration) -> f64 {
        if self.interval.is_zero() {
            return 1.0;
        }
        (unread.as_secs_f64() / TRIM_PERIOD.as_secs_f64()).min(1.0)
    }

    /// How full the server is, 0..1: its KV usage, else its busy slots, else running requests
    /// over `running_norm`.
    fn usage(&self, s: &Sample) -> f64 {
        match (s.kv_usage, s.slots) {
            (Some(kv), _) => kv,
            (None, Some(slots)) => (s.running / slots.max(1.0)).min(1.0),
            (None, None) => s.running / self.params.running_norm,
        }
    }

    /// The capacity one sample shows, in concurrent requests, and whether it is exact (taken at
    /// once rather than smoothed). From memory where the server publishes KV usage (capped by its
    /// slots or `max_num_seqs`); from its slot count where it publishes none; and, without either,
    /// from what it runs while it queues (a full server shows its own limit).
    fn capacity_shown(&self, s: &Sample) -> Option<(f64, bool)> {
        let p = &self.params;
        let limit = s.slots.unwrap_or(p.max_num_seqs);
        match (s.kv_usage, s.slots) {
            (Some(kv), _) => {
                (s.running >= MIN_RUNNING && kv >= MIN_USAGE).then(|| ((s.running / kv).min(limit), false))
            }
            (None, Some(slots)) => Some((slots, true)),
            (None, None) => (s.waiting >= 1.0 && s.running >= 1.0).then(|| (s.running.min(limit), false)),
        }
    }

    /// Update a member's estimates from one fresh sample.
    fn observe(&self, mut m: Member, s: &Sample) -> Member {
        let p = &self.params;
        m.unread += self.interval;
        m.trim_weight = 0.0;
        if self.is_new(m.age, s.age) {
            m.trim_weight = self.trim_weight(m.unread);
            m.unread = std::time::Duration::ZERO;
        }
        m.age = Some(s.age);
        let queued = s.waiting >= 1.0;

        let blend = |old: Option<f64>, new: f64, at_once: bool| match old {
            Some(_) if at_once => new,
            Some(o) => o + p.smoothing * (new - o),
            None => new,
        };
        // Memory per request is a hardware constant times the workload's mix: smoothed only (the
        // mix on one server at one instant is noisy, and memory does not change suddenly).
        let usage = self.usage(s);
        m.since_full = if usage >= MEMORY_BOUND {
            Some(Default::default())
        } else {
            m.since_full.map(|d| d + self.interval)
        };
        if let Some((k, exact)) = self.capacity_shown(s) {
            m.k = Some(blend(m.k, k, exact).max(1.0));
        }
        let valid = |t: &f64| *t > 0.0 && t.is_finite();
        // Time in the system less time in the queue: a service time as good as the server's own,
        // and unlike the latency alone it does not stay high while a past backlog's waits are
        // still in the window.
        let latency_less_queue = s.latency.zip(s.queue_time).map(|(l, q)| l - q);
        // Time running, or else the work per generated token (llama.cpp): neither carries queueing.
        if let Some(t) =
            s.service.filter(valid).or(s.token_time.filter(valid)).or(latency_less_queue.filter(valid))
        {
            // Time running carries no queueing: usable whether the server queues or not. A much
            // longer reading on a queued server is a slowdown: believed at once (feed-forward).
            // Not on a server whose memory is full, or was within the times' window: it preempts
            // and recomputes, so its requests run longer because of the load, not because it lost
            // speed (and it queues, so the delay factor already keeps new requests off it).
            let full = usage >= MEMORY_BOUND
                || (!self.interval.is_zero() && m.since_full.is_some_and(|d| d < MEMORY_BOUND_ECHO));
            let slowdown = queued && !full && m.s.is_some_and(|o| t > SLOWDOWN * o);
            m.s = Some(blend(m.s, t, slowdown));
            m.s_running = true;
        } else if let Some(l) = s.latency.filter(valid).filter(|_| !m.s_running) {
            if !queued {
                m.s = Some(blend(m.s, l, false));
            } else if m.s.is_none_or(|o| l > SLOWDOWN * o) {
                // Feed-forward: a queued server whose requests take much longer than its estimate
                // has lost capacity; believe it at once, with the queue's part taken out (Little's
                // law: the share of the time in the system spent running). Smaller readings from a
                // queued server are not used: the latency window still holds the waits of requests
                // queued earlier, and the queue now may be new, so their mix is not a service time.
                let in_system = s.running + s.waiting;
                m.s = Some(l * s.running.max(1.0).min(in_system) / in_system.max(1.0));
            }
        }
        m
    }

    pub fn compute(&mut self, input: &Inputs<'_>) -> Vec<u32> {
        // Memory follows the pool: members that left are forgotten, new ones start fresh.
        self.members.sync_to(input.snapshot.members.keys(), Member::new);
        if input.fresh.is_empty() {
            return Vec::new();
        }
        let p = self.params.clone();
        let range = input.range;
        let target_mean = range.mid();
        // Working values are vectors in the order of the fresh members; memory is read by dense index.
        let samples: Vec<&Sample> = input.fresh.iter().map(|f| f.sample).collect();
        let mut state: Vec<Member> = input
            .fresh
            .iter()
            .map(|f| {
                let old = self.members.at(f.index).map_or_else(Member::new, |(_, m)| *m);
                self.observe(old, f.sample)
            })
            .collect();
        let known_k: Vec<f64> = state.iter().filter_map(|m| m.k).collect();
        let known_s: Vec<f64> = state.iter().filter_map(|m| m.s).collect();
        let mean_k = mean(&known_k).unwrap_or(p.max_num_seqs);
        let mean_s = mean(&known_s);
        // Weighted round robin needs every member's service time; a partial picture would favour
        // whoever lacks one, so it falls back to capacity in requests for all.
        let use_s = p.mode == Mode::RoundRobin && known_s.len() == state.len();

        let n = state.len();
        let (mut base, mut delay, mut util) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        let ks = base_k(&state, &samples, mean_k);
        for ((m, s), &k) in state.iter().zip(&samples).zip(&ks) {
            let service = m.s.or(mean_s).unwrap_or(1.0);
            base.push(if use_s { k / service.max(1e-3) } else { k });
            delay.push(s.waiting * service / k);
            util.push(((s.running + s.waiting) / k).min(1.0));
        }
        let d_min = delay.iter().copied().fold(f64::INFINITY, f64::min);
        let mean_util = mean(&util).unwrap_or(0.0);

        let mut next: Vec<f64> = Vec::with_capacity(n);
        for (i, m) in state.iter_mut().enumerate() {
            let u = util[i];
            // Trim toward equal utilization; a floor keeps an idle member from an infinite factor.
            if m.trim_weight > 0.0 && p.gain > 0.0 && mean_util > 0.05 && (u - mean_util).abs() > p.trim_band
            {
                let f = ((mean_util + 0.05) / (u + 0.05)).powf(p.gain * m.trim_weight);
                m.trim = (m.trim * f).clamp(1.0 / p.trim_max, p.trim_max);
            }
            let h = if p.mode == Mode::RoundRobin {
                (1.0 + d_min / p.delay_tau) / (1.0 + delay[i] / p.delay_tau)
            } else {
                1.0
            };
            next.push(base[i] * m.trim * h);
        }
        let sizes = judged_sizes(&base, &ks, &samples);
        queue_rule(&mut next, &sizes, &mut state, &samples, &ks, p.trim_max);
        // The trims are relative: keep their geometric mean at 1 so they cannot drift together.
        let log_mean = state.iter().map(|m| m.trim.ln()).sum::<f64>() / n as f64;
        for m in &mut state {
            m.trim = (m.trim / log_mean.exp()).clamp(1.0 / p.trim_max, p.trim_max);
        }
        let mean_next = next.iter().sum::<f64>() / n as f64;
        if mean_next > 0.0 && mean_next.is_finite() {
            for v in &mut next {
                *v = (*v * target_mean / mean_next).clamp(range.min as f64, range.max as f64);
            }
        } else {
            next.fill(target_mean);
        }
        // Pool-wide deadband: when nobody would move by `deadband`, nobody moves (nothing pushed).
        let quiet = next.iter().zip(&state).all(|(v, m)| match m.last {
            Some(prev) if prev > 0 => {
                ((range.clamp(*v) as f64 - prev as f64).abs() / prev as f64) < p.deadband
            }
            _ => false,
        });
        let mut out = Vec::with_capacity(n);
        for ((f, v), mut m) in input.fresh.iter().zip(next).zip(state) {
            let r = match m.last {
                Some(prev) if quiet => prev,
                _ => range.clamp(v),
            };
            m.last = Some(r);
            out.push(r);
            // Why this ratio, for an operator asking (RUST_LOG=llm_load_controller::policy=debug).
            tracing::debug!(
                member = %f.id,
                capacity = m.k,
                service_s = m.s,
                trim = m.trim,
                ratio = r,
                "capacity estimate"
            );
            if let Some(slot) = self.members.at_mut(f.index) {
                *slot = m;
            }
        }
        out
    }
}

/// Each member's capacity in concurrent requests: its estimate, else the pool's mean; a member
/// without an estimate that does not queue holds at least what it runs now and one more.
fn base_k(state: &[Member], samples: &[&Sample], mean_k: f64) -> Vec<f64> {
    state
        .iter()
        .zip(samples)
        .map(|(m, s)| {
            m.k.unwrap_or_else(|| if s.waiting < 1.0 { mean_k.max(s.running + 1.0) } else { mean_k }).max(1.0)
        })
        .collect()
}

/// Whether a member can start one more request now: nothing waits, a slot is free, memory is not
/// full.
fn has_room(s: &Sample, k: f64) -> bool {
    s.waiting < 1.0 && s.running + 1.0 <= k && s.kv_usage.is_none_or(|kv| kv < MEMORY_BOUND)
}

/// The queue rule, in every mode and from the first cycle: a request sent to a member that
/// queues waits, one sent to a member with room starts at once. On a member's first reading the
/// policy has nothing but that reading, so it takes it as a judgement: a member that shows waiting
/// requests while another has room gets less than a member with room of its size would
/// ([`judged_sizes`]; `QUEUED_SHARE` of it, less the longer its queue is against its capacity:
/// `1 / (1 + QUEUE_WEIGHT x waiting / K)`, which also ranks the queued members among themselves).
/// The cut holds while each new reading confirms it (still queued, another member with room) and
/// ends with the first reading that does not, never to return: a queue that persists beside room
/// is then cut further by the trim (the queued member is at full utilization), a passing one
/// costs nothing. (Giving it back over 15 s instead cost `ratio` 1.3x on long-context, seeds 1-3.)
///
/// Only from a member's first reading, never armed later: applied afresh every cycle the rule is
/// a proportional controller coupled across members, and it ran away in the benchmark (a big
/// server with one waiting request dropped below a server a third its size, the others then
/// queued in turn: p99 5x-70x worse on the mem-only, heterogeneous and shared-backends fleets).
/// Behind least-connections the LB sees queued requests itself; what it cannot see (load from
/// elsewhere) is what the trim is for.
fn queue_rule(
    next: &mut [f64],
    sizes: &[f64],
    state: &mut [Member],
    samples: &[&Sample],
    k: &[f64],
    trim_max: f64,
) {
    // What each member with room gets per unit of its judged size; the least of those.
    let room_min = (0..next.len())
        .filter(|&i| has_room(samples[i], k[i]))
        .map(|i| next[i] / sizes[i].max(1e-9))
        .fold(f64::INFINITY, f64::min);
    for i in 0..next.len() {
        let (s, m) = (samples[i], &mut state[i]);
        let confirmed = s.waiting >= 1.0 && room_min.is_finite() && next[i] > 0.0;
        m.queue_cut = match (m.queue_cut, m.last.is_none()) {
            (_, true) if confirmed => {
                let cap = sizes[i] * room_min * QUEUED_SHARE / (1.0 + QUEUE_WEIGHT * s.waiting / k[i]);
                Some((cap / next[i]).clamp(1.0 / trim_max, 1.0))
            }
            // A new reading that does not confirm the cut ends it.
            (Some(_), false) if !confirmed && m.trim_weight > 0.0 => None,
            (c, _) => c,
        };
        next[i] *= m.queue_cut.unwrap_or(1.0);
    }
}

/// How big the queue rule judges each member, relative to the others: its base ratio, with its
/// memory reading pulled toward the pool's pooled one (all running over all KV usage) as if
/// [`SHRINK_REQUESTS`] more requests had been seen at the pool's rate. A reading from few
/// requests says little (4 requests at 10% say 40, the next 4 may say 80): against such a member,
/// a queued one is judged as an equal. Servers that really differ show it with many requests, and
/// the rule then never moves a big server's share onto a small one (done with raw sizes, it did:
/// a big server with one waiting request dropped below one a third its size).
fn judged_sizes(base: &[f64], k: &[f64], samples: &[&Sample]) -> Vec<f64> {
    let (running, usage) = samples
        .iter()
        .filter_map(|s| Some((s.running, s.kv_usage?)))
        .filter(|(r, kv)| *r >= MIN_RUNNING && *kv >= MIN_USAGE)
        .fold((0.0, 0.0), |(r, u), (sr, su)| (r + sr, u + su));
    let pooled = (usage > 0.0).then(|| running / usage);
    (0..base.len())
        .map(|i| match (pooled, samples[i].kv_usage) {
            (Some(pool), Some(_)) => {
                let r = samples[i].running;
                let shrunk = (r * k[i] + SHRINK_REQUESTS * pool) / (r + SHRINK_REQUESTS);
                base[i] * shrunk / k[i].max(1e-9)
            }
            _ => base[i],
        })
        .collect()
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::policy::testutil::snap;
    use crate::policy::{PolicyConfig, PoolPolicy};
    use crate::ratio::RatioRange;

    fn policy(mode: Mode) -> PoolPolicy {
        PoolPolicy::new(
            &PolicyConfig::Capacity(CapacityParams { mode, ..Default::default() }),
            RatioRange { min: 1, max: 100 },
            Duration::from_secs(60),
            Duration::from_secs(30),
            Duration::from_secs(5),
        )
    }

    fn s(waiting: f64, running: f64, kv: f64, latency: f64) -> Option<Sample> {
        Some(Sample {
            waiting,
            running,
            kv_usage: Some(kv),
            latency: Some(latency),
            service: None,
            queue_time: None,
            token_time: None,
            prompt_cached: None,
            slots: None,
            age: Duration::from_secs(1),
        })
    }

    fn ratios(
        p: &mut PoolPolicy,
        members: &[(&str, Option<Sample>)],
        prev: &mut llm_lc_adapters::Ratios,
    ) -> Vec<u32> {
        *prev = p.compute(&snap(members), prev).ratios;
        members.iter().map(|(m, _)| prev.get(&llm_lc_adapters::MemberId::from(*m)).unwrap_or(0)).collect()
    }

    #[test]
    fn round_robin_mode_follows_a_slowdown_to_a_third_within_three_cycles_and_holds() {
        let mut p = policy(Mode::RoundRobin);
        let mut prev = Default::default();
        let even = [
            ("a:1", s(0.0, 100.0, 0.4, 10.0)),
            ("b:1", s(0.0, 100.0, 0.4, 10.0)),
            ("c:1", s(0.0, 100.0, 0.4, 10.0)),
        ];
        for _ in 0..3 {
            let r = ratios(&mut p, &even, &mut prev);
            assert_eq!(r[0], r[1]);
        }
        // `a` slows to a third: each request takes three times as long, a queue forms, then drains
        // once its share is cut.
        // The latency the server reports is end to end: 30 s of service plus the queue's wait.
        let slow = |w: f64| s(w, 100.0, 0.4, 30.0 + w * 30.0 / 100.0);
        let fast = || s(0.0, 100.0, 0.4, 10.0);
        let phases = [
            [("a:1", slow(30.0)), ("b:1", fast()), ("c:1", fast())],
            [("a:1", slow(10.0)), ("b:1", fast()), ("c:1", fast())],
            [("a:1", slow(0.0)), ("b:1", fast()), ("c:1", fast())],
        ];
        let mut last = vec![];
        for (cycle, members) in phases.iter().enumerate() {
            last = ratios(&mut p, members, &mut prev);
            // While it queues it gets less than its new capacity share, never nothing.
            assert!(last[0] >= 1 && last[0] < last[1], "cycle {cycle}: {last:?}");
        }
        let share = f64::from(last[0]) / f64::from(last[1]);
        assert!((0.28..=0.40).contains(&share), "after 3 cycles a third of the others: {last:?}");
        // Steady inputs: no oscillation, not even by one.
        for _ in 0..10 {
            assert_eq!(ratios(&mut p, &phases[2], &mut prev), last);
        }
    }

    /// A sample with vLLM's time running (`service`) besides the end-to-end latency.
    fn timed(waiting: f64, kv: f64, latency: f64, service: f64) -> Option<Sample> {
        s(waiting, 100.0, kv, latency).map(|x| Sample { service: Some(service), ..x })
    }

    #[test]
    fn the_time_running_is_the_service_time_whether_the_server_queues_or_not() {
        let mut p = policy(Mode::RoundRobin);
        let mut prev = Default::default();
        let even = [
            ("a:1", timed(0.0, 0.4, 10.0, 10.0)),
            ("b:1", timed(0.0, 0.4, 10.0, 10.0)),
            ("c:1", timed(0.0, 0.4, 10.0, 10.0)),
        ];
        for _ in 0..3 {
            ratios(&mut p, &even, &mut prev);
        }
        // `a` slows to a third. Its end-to-end times carry a minute of queueing on top; the time
        // running says 30 s, which is taken at once (a slowdown) and not shrunk by the queue.
        let fast = || timed(0.0, 0.4, 10.0, 10.0);
        let phases = [
            [("a:1", timed(30.0, 0.4, 90.0, 30.0)), ("b:1", fast()), ("c:1", fast())],
            [("a:1", timed(10.0, 0.4, 70.0, 30.0)), ("b:1", fast()), ("c:1", fast())],
            [("a:1", timed(0.0, 0.4, 50.0, 30.0)), ("b:1", fast()), ("c:1", fast())],
        ];
        let mut last = vec![];
        for members in &phases {
            last = ratios(&mut p, members, &mut prev);
        }
        let share = f64::from(last[0]) / f64::from(last[1]);
        assert!((0.28..=0.40).contains(&share), "a third of the others after 3 cycles: {last:?}");
        for _ in 0..10 {
            assert_eq!(ratios(&mut p, &phases[2], &mut prev), last, "and it holds");
        }
    }

    /// A sample with vLLM's queue time (`vllm:request_queue_time_seconds`) besides the
    /// end-to-end latency, and no time running.
    fn waited(waiting: f64, latency: f64, queue_time: f64) -> Option<Sample> {
        s(waiting, 100.0, 0.4, latency).map(|x| Sample { queue_time: Some(queue_time), ..x })
    }

    #[test]
    fn the_queue_time_is_taken_out_of_the_latency_after_a_backlog() {
        // `a` had a backlog that has drained: nothing waits now, but the latency window still holds
        // the minute its requests waited. Its speed never changed (10 s running); with the queue
        // time known, its share comes back at once instead of after the window has rolled over.
        let mut p = policy(Mode::RoundRobin);
        let mut prev = Default::default();
        let calm = || waited(0.0, 10.0, 0.0);
        for _ in 0..3 {
            ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
        }
        let even = ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
        let drained = [("a:1", waited(0.0, 40.0, 30.0)), ("b:1", calm()), ("c:1", calm())];
        for cycle in 0..3 {
            let r = ratios(&mut p, &drained, &mut prev);
            assert!(r[0] + 1 >= r[1], "cycle {cycle}: {r:?}, even {even:?}");
        }
        // Without the queue time the same latency reads as a server four times slower.
        let mut blind = policy(Mode::RoundRobin);
        let mut prev = Default::default();
        let plain = |l: f64| s(0.0, 100.0, 0.4, l);
        for _ in 0..3 {
            ratios(
                &mut blind,
                &[("a:1", plain(10.0)), ("b:1", plain(10.0)), ("c:1", plain(10.0))],
                &mut prev,
            );
        }
        let mut r = vec![];
        for _ in 0..3 {
            r = ratios(
                &mut blind,
                &[("a:1", plain(40.0)), ("b:1", plain(10.0)), ("c:1", plain(10.0))],
                &mut prev,
            );
        }
        assert!(f64::from(r[0]) <= 0.9 * f64::from(r[1]), "the latency alone cuts it: {r:?}");
    }

    #[test]
    fn a_slowdown_shows_through_the_queue_time_on_a_queued_server() {
        // `a` slows to a third and queues: latency 90 s of which 60 s waiting. Running time is
        // 30 s, believed at once as a slowdown, as with vLLM's own time-running histogram.
        let mut p = policy(Mode::RoundRobin);
        let mut prev = Default::default();
        let calm = || waited(0.0, 10.0, 0.0);
        for _ in 0..3 {
            ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
        }
        let mut last = vec![];
        for _ in 0..3 {
            last = ratios(
                &mut p,
                &[("a:1", waited(10.0, 90.0, 60.0)), ("b:1", calm()), ("c:1", calm())],
                &mut prev,
            );
        }
        let share = f64::from(last[0]) / f64::from(last[1]);
        assert!(share <= 0.40, "a third of the others or less while it queues: {last:?}");
    }

    #[test]
    fn a_missing_time_running_does_not_let_the_queue_into_the_service_time() {
        // `a` queues; its time running is unchanged, but one cycle it is missing (an optional
        // query failed, the series is late) and only the end-to-end latency, 4x longer because of
        // the queue's waits, arrives. That is not a slowdown: `a` keeps its share.
        let mut p = policy(Mode::RoundRobin);
        let mut prev = Default::default();
        let calm = || timed(0.0, 0.4, 10.0, 10.0);
        for _ in 0..3 {
            ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
        }
        let queued = || timed(3.0, 0.6, 40.0, 10.0);
        let without_running = queued().map(|x| Sample { service: None, ..x });
        let r0 = ratios(&mut p, &[("a:1", queued()), ("b:1", calm()), ("c:1", calm())], &mut prev);
        ratios(&mut p, &[("a:1", without_running), ("b:1", calm()), ("c:1", calm())], &mut prev);
        let r = ratios(&mut p, &[("a:1", queued()), ("b:1", calm()), ("c:1", calm())], &mut prev);
        assert!(f64::from(r[0]) >= 0.9 * f64::from(r0[0]), "before {r0:?}, after {r:?}");
    }

    #[test]
    fn long_running_times_on_a_memory_bound_server_are_not_a_slowdown() {
        // `a` is full (KV 95%) and queues: it preempts and recomputes, so its requests run 1.6x
        // longer for a while. That is load, not lost speed: the estimate moves by smoothing only,
        // and once the pressure is gone `a` is back at an equal share.
        let mut p = policy(Mode::RoundRobin);
        let mut prev = Default::default();
        let calm = |kv: f64| timed(0.0, kv, 10.0, 10.0);
        for _ in 0..3 {
            ratios(&mut p, &[("a:1", calm(0.4)), ("b:1", calm(0.4)), ("c:1", calm(0.4))], &mut prev);
        }
        for _ in 0..3 {
            ratios(
                &mut p,
                &[("a:1", timed(5.0, 0.95, 40.0, 16.0)), ("b:1", calm(0.4)), ("c:1", calm(0.4))],
                &mut prev,
            );
        }
        let r = ratios(&mut p, &[("a:1", calm(0.4)), ("b:1", calm(0.4)), ("c:1", calm(0.4))], &mut prev);
        let share = f64::from(r[0]) / f64::from(r[1]);
        assert!(share > 0.8, "no jump to 1.6x the service time: {r:?}");
    }

    #[test]
    fn a_server_just_out_of_memory_pressure_is_not_taken_for_slowed_down() {
        // `a` was full and preempting; its KV usage has just dropped to 80% but the times of the
        // last minute still carry the recomputes (1.6x) while it works off a queue. Not a slowdown
        // for the minute after it was full; the same reading a minute later is one.
        let mut p = policy(Mode::RoundRobin);
        let mut prev = Default::default();
        let calm = || timed(0.0, 0.4, 10.0, 10.0);
        for _ in 0..3 {
            ratios(&mut p, &[("a:1", calm()), ("b:1", calm()), ("c:1", calm())], &mut prev);
        }
        ratios(&mut p, &[("a:1", timed(5.0, 0.95, 40.0, 10.0)), ("b:1", calm()), ("c:1", calm())], &mut prev);
        let share = |r: &[u32]| f64::from(r[0]) / f64::from(r[1]);
        let slower = || timed(2.0, 0.8, 40.0, 16.0);
        let r = ratios(&mut p, &[("a:1", slower()), ("b:1", calm()), ("c:1", calm())], &mut prev);
        assert!(share(&r) > 0.75, "just out of memory pressure: {r:?}");
        // Twelve 5 s cycles without memory pressure: the echo is over, the slowdown is believed.
        for _ in 0..12 {
            ratios(
                &mut p,
                &[("a:1", timed(0.0, 0.4, 10.0, 10.0)), ("b:1", calm()), ("c:1", calm())],
                &mut prev,
            );
        }
        let r = ratios(&mut p, &[("a:1", slower()), ("b:1", calm()), ("c:1", calm())], &mut prev);
        assert!(share(&r) < 0.7, "a minute later the same reading is a slowdown: {r:?}");
    }

    #[test]
    fn the_trim_moves_per_second_of_readings_not_per_reading() {
        // `a` is at 90% utilization, the others at 30% (traffic this LB does not see). Fifteen
        // direct scrapes a second apart must move the trim about as far as one Prometheus reading
        // 15 s apart; counted per reading they would move it fifteen times as far.
        let members = [
            ("a:1", s(0.0, 90.0, 0.9, 10.0)),
            ("b:1", s(0.0, 30.0, 0.3, 10.0)),
            ("c:1", s(0.0, 30.0, 0.3, 10.0)),
        ];
        let share_after = |interval: u64, cycles: usize| {
            let mut p = PoolPolicy::new(
                &PolicyConfig::Capacity(CapacityParams::default()),
                RatioRange { min: 1, max: 100 },
                Duration::from_secs(60),
                Duration::from_secs(30),
                Duration::from_secs(interval),
            );
            let mut prev = Default::default();
            let mut r = vec![];
            for _ in 0..cycles {
                r = ratios(&mut p, &members, &mut prev);
            }
            f64::from(r[0]) / f64::from(r[1])
        };
        // Same memory per request, so without a trim the shares are equal.
        let prometheus = share_after(15, 1);
        let direct = share_after(1, 15);
        assert!((0.75..0.9).contains(&prometheus), "one 15 s reading: {prometheus}");
        assert!((0.75..0.95).contains(&direct), "fifteen 1 s readings: {direct} (one 15 s: {prometheus})");
    }

    #[test]
    fn least_connections_mode_gives_capacity_in_requests_not_equal_kv() {
        let mut p = policy(Mode::LeastConnections);
        let mut prev = Default::default();
        // Same running count, `c` has a third of the memory (three times the usage); `b` is faster
        // (latency) but least-connections handles speed itself, so speed must not count.
        let members = [
            ("a:1", s(0.0, 60.0, 0.3, 10.0)),
            ("b:1", s(0.0, 60.0, 0.3, 5.0)),
            ("c:1", s(0.0, 60.0, 0.9, 10.0)),
        ];
        let r = ratios(&mut p, &members, &mut prev);
        assert_eq!(r[0], r[1], "{r:?}");
        let share = f64::from(r[2]) / f64::from(r[0]);
        // A third of the memory, a third of the ratio; the trim's first step (c is the fullest
        // member, at 0.9 against 0.3) takes up to a fifth more off.
        assert!((0.26..0.4).contains(&share), "a third of the memory, about a third of the ratio: {r:?}");
        // A big-memory replica is capped at the batch limit, not given 2.35x the requests.
        let mut p = policy(Mode::LeastConnections);
        let mut prev = Default::default();
        let tp = [("a:1", s(0.0, 200.0, 0.7, 10.0)), ("tp:1", s(0.0, 200.0, 0.3, 6.0))];
        let r = ratios(&mut p, &tp, &mut prev);
        assert!(r[1] as f64 <= r[0] as f64 * 1.35, "batch limit binds the TP-2 replica: {r:?}");
    }

    #[test]
    fn a_draining_backlog_gets_its_share_back_as_it_drains() {
        // Weighted round robin (least-connections sees the queued requests itself): `a` has the same
        // speed but a backlog, which it drains at its own pace.
        let mut p = policy(Mode::RoundRobin);
        let mut prev = Default::default();
        let mut seen = vec![];
        for waiting in [80.0, 60.0, 40.0, 20.0, 0.0, 0.0] {
            let members = [
                ("a:1", s(waiting, 100.0, 0.9, 10.0 + waiting * 10.0 / 100.0)),
                ("b:1", s(0.0, 100.0, 0.9, 10.0)),
                ("c:1", s(0.0, 100.0, 0.9, 10.0)),
            ];
            let r = ratios(&mut p, &members, &mut prev);
            seen.push(f64::from(r[0]) / f64::from(r[1]));
        }
        assert!(seen.windows(2).all(|w| w[1] >= w[0]), "share only grows while the backlog drains: {seen:?}");
        assert!(seen[0] < 0.3, "a long backlog cuts the share: {seen:?}");
        assert!(*seen.last().unwrap_or(&0.0) > 0.8, "drained: back near an equal share: {seen:?}");
    }

    #[test]
    fn traffic_from_outside_the_lb_is_trimmed_away_slowly_and_boundedly() {
        let mut p = policy(Mode::LeastConnections);
        let mut prev = Default::default();
        // `a` holds twice the requests of the others at the same memory per request (external load).
        let members = [
            ("a:1", s(0.0, 200.0, 0.8, 10.0)),
            ("b:1", s(0.0, 100.0, 0.4, 10.0)),
            ("c:1", s(0.0, 100.0, 0.4, 10.0)),
        ];
        let mut last = ratios(&mut p, &members, &mut prev);
        for _ in 0..60 {
            let r = ratios(&mut p, &members, &mut prev);
            assert!(r[0] <= last[0], "monotone: {r:?} after {last:?}");
            last = r;
        }
        let share = f64::from(last[0]) / f64::from(last[1]);
        assert!((1.0 / 16.0 - 0.02..0.7).contains(&share), "trimmed, within trim_max^2: {last:?}");
    }

    #[test]
    fn the_trim_integrates_each_reading_once_whatever_its_age_jitter() {
        let c = Capacity::new(CapacityParams::default(), Duration::from_secs(5));
        let ms = Duration::from_millis;
        // Direct scrapes: a new reading every cycle, ages of a few ms that jitter either way.
        assert!(c.is_new(Some(ms(3)), ms(4)) && c.is_new(Some(ms(4)), ms(2)));
        // Prometheus every 15 s, a cycle every 5 s: the same reading 5 s older, twice, then a new one.
        assert!(!c.is_new(Some(ms(1_000)), ms(6_000)) && !c.is_new(Some(ms(6_000)), ms(11_000)));
        assert!(c.is_new(Some(ms(11_000)), ms(1_200)));
        // A late cycle makes a repeat older still, never new; the first reading is new.
        assert!(!c.is_new(Some(ms(1_000)), ms(9_000)) && c.is_new(None, ms(9_000)));
    }

    /// The three servers of issue 25: free room, a short queue, a long queue on a full cache.
    fn loaded_trio(service: Option<f64>) -> [(&'static str, Option<Sample>); 3] {
        let with = |w: f64, r: f64, kv: f64| {
            Some(Sample { waiting: w, running: r, kv_usage: Some(kv), latency: None, service, ..base() })
        };
        [("a:1", with(0.0, 4.0, 0.10)), ("b:1", with(2.0, 30.0, 0.55)), ("c:1", with(12.0, 60.0, 0.95))]
    }

    fn base() -> Sample {
        Sample {
            waiting: 0.0,
            running: 0.0,
            kv_usage: None,
            latency: None,
            service: None,
            queue_time: None,
            token_time: None,
            prompt_cached: None,
            slots: None,
            age: Duration::from_secs(1),
        }
    }

    #[test]
    fn a_visible_queue_ranks_below_free_room_on_the_first_cycle_in_every_mode() {
        for mode in [Mode::LeastConnections, Mode::RoundRobin] {
            for service in [None, Some(2.0)] {
                let mut p = policy(mode);
                let mut prev = Default::default();
                let r = ratios(&mut p, &loaded_trio(service), &mut prev);
                assert!(r[0] > r[1] && r[1] > r[2], "{mode:?}, service {service:?}: {r:?}");
                // And while the load stays, so does the order (a minute of 5 s cycles).
                for cycle in 0..12 {
                    let r = ratios(&mut p, &loaded_trio(service), &mut prev);
                    assert!(r[0] > r[1] && r[1] > r[2], "{mode:?}, {service:?}, cycle {cycle}: {r:?}");
                }
            }
        }
    }

    #[test]
    fn a_queue_beside_an_idle_member_is_cut_until_the_idle_one_has_half_as_much_again() {
        // Same servers; `a` is kept full and queued by traffic that does not pass this LB, `b` idles.
        for mode in [Mode::LeastConnections, Mode::RoundRobin] {
            let mut p = policy(mode);
            let mut prev = Default::default();
            let members = [
                ("a:1", Some(Sample { waiting: 3.0, running: 40.0, kv_usage: Some(0.8), ..base() })),
                ("b:1", Some(Sample { kv_usage: Some(0.0), ..base() })),
            ];
            let first = ratios(&mut p, &members, &mut prev);
            assert!(first[1] > first[0], "{mode:?}: at once {first:?}");
            let mut last = first;
            for _ in 0..12 {
                let r = ratios(&mut p, &members, &mut prev);
                assert!(r[0] <= last[0], "{mode:?}: only ever cut: {r:?} after {last:?}");
                last = r;
            }
            assert!(f64::from(last[1]) >= 1.5 * f64::from(last[0]), "{mode:?}: within a minute {last:?}");
        }
    }

    #[test]
    fn slots_are_the_capacity_of_a_server_without_a_kv_gauge() {
        // llama.cpp: 4 slots against 1, whatever each runs at the moment.
        let slots =
            |n: f64, w: f64, r: f64| Some(Sample { waiting: w, running: r, slots: Some(n), ..base() });
        for members in [
            [("big:1", slots(4.0, 0.0, 0.0)), ("small:1", slots(1.0, 0.0, 0.0))],
            [("big:1", slots(4.0, 0.0, 3.0)), ("small:1", slots(1.0, 1.0, 1.0))],
            [("big:1", slots(4.0, 0.0, 4.0)), ("small:1", slots(1.0, 0.0, 1.0))],
        ] {
            let r = ratios(&mut policy(Mode::LeastConnections), &members, &mut Default::default());
            assert!(f64::from(r[0]) >= 3.5 * f64::from(r[1]), "{members:?}: {r:?}");
        }
    }

    #[test]
    fn without_kv_or_slots_a_full_server_shows_its_limit_and_one_with_room_holds_more() {
        // Equal weights put 3 requests on a 4-slot server and 2 on a 1-slot one: the small one runs
        // 1 and queues 1 (its limit is 1), the big one runs 3 and has room (so at least 4).
        let mut p = policy(Mode::LeastConnections);
        let members = [
            ("big:1", Some(Sample { running: 3.0, ..base() })),
            ("small:1", Some(Sample { waiting: 1.0, running: 1.0, ..base() })),
        ];
        let r = ratios(&mut p, &members, &mut Default::default());
        assert!(f64::from(r[0]) >= 3.5 * f64::from(r[1]), "{r:?}");
    }

    #[test]
    fn idle_pool_is_equal_and_invalid_params_are_named() {
        let mut p = policy(Mode::LeastConnections);
        let mut prev = Default::default();
        let r = ratios(&mut p, &[("a:1", s(0.0, 0.0, 0.0, 1.0)), ("b:1", s(0.0, 0.0, 0.0, 1.0))], &mut prev);
        assert_eq!(r, vec![51, 51]);
        let bad = CapacityParams { delay_tau: 0.0, trim_max: 0.5, ..Default::default() };
        let fields: Vec<String> = bad.validate().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, vec!["delay_tau".to_string(), "trim_max".to_string()]);
    }
}
