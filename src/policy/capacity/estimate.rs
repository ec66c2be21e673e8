//! The estimate: what one member's readings say about it, remembered across cycles. Capacity `K`
//! in concurrent requests, service time `s`, and the bookkeeping the corrections need (is this a
//! new reading, how much time it covers, was the server memory-bound lately).
//!
//! Capacity is taken from what binds: memory (`running / KV usage`, capped by the batch limit),
//! else the slot count, else what a queueing server runs (a full server shows its own limit).
//! The batch limit is read from behaviour before any declared number: a server seen in [`PLATEAU`]
//! new readings running the most it has ever run while requests wait and its memory has room (KV
//! usage under [`ROOMY`]) shows its limit; a server that runs more than the limit learnt shows a
//! higher one; and a member with no estimate yet that queues with room holds what it runs, for
//! that cycle only (one reading, as a dry run's `--once` has; not remembered, so a start-up
//! transient costs one cycle, not a hundred).
//! Memory has a twin of that rule: `running / KV usage` is only believed from [`MIN_RUNNING`]
//! requests up, but a server that runs fewer while requests wait and its memory is over half used
//! holds what it runs (real vLLM with 8 MiB of KV and 1,400-token prompts holds two; without this
//! it got the pool's mean and half the traffic).
//! Engines publish no batch limit (vLLM's `max_num_seqs` is nowhere on its page) and a small
//! model's KV usage makes `running / usage` say "hundreds" of any server, so without this a
//! `--max-num-seqs 1` replica looks as big as a `--max-num-seqs 4` one.
//! Service time is a time that carries no queueing: the time running, else llama.cpp's time per
//! generated token, else latency less queue time; only without any of those the end-to-end
//! latency, learnt while the server does not queue (a queued server's latency carries the waits
//! of a backlog that may be gone). A much longer time on a queued server is a slowdown and is
//! believed at once (feed-forward), except on a server that is or just was memory-bound: it
//! preempts and recomputes, so its times grow with the load, not with lost speed.

use std::time::Duration;

use super::params::CapacityParams;
use crate::source::Sample;

/// Fewer running requests than this say too little about a server's capacity.
pub(super) const MIN_RUNNING: f64 = 4.0;
/// Below this memory use `running / usage` is mostly rounding.
pub(super) const MIN_USAGE: f64 = 0.02;
/// A service time this much longer than the estimate, on a queued server, is a slowdown, not noise.
const SLOWDOWN: f64 = 1.5;
/// The trim's `gain` is per this much time of readings (a Prometheus scrape interval).
const TRIM_PERIOD: Duration = Duration::from_secs(15);
/// KV usage from which a server is memory-bound: it preempts requests and recomputes them.
pub(super) const MEMORY_BOUND: f64 = 0.9;
/// KV usage under which requests that wait do not wait for memory: what the server runs is its
/// batch limit. (Between this and [`MEMORY_BOUND`] a long prompt may wait for blocks.)
pub(super) const ROOMY: f64 = 0.5;
/// New readings that must show the most the member has ever run, while requests wait, before
/// that count is its batch limit. Two in a row were not enough: in the bench a replica admitting a
/// burst showed 175 of 256 twice (src/bench/RESULTS.md, "Batch limits read from behaviour").
pub(super) const PLATEAU: u32 = 3;
/// How long after a server was memory-bound its times may still carry preemptions: the times are
/// means over a window (Prometheus `rate(...[1m])`), the KV usage is of this instant.
const MEMORY_BOUND_ECHO: Duration = Duration::from_secs(60);

/// What the policy remembers of one member.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Member {
    /// Capacity in concurrent requests.
    pub k: Option<f64>,
    /// Service time, seconds.
    pub s: Option<f64>,
    /// `s` has been learnt from a time without queueing: end-to-end latency (which carries the
    /// queue's waits) no longer moves it, even in a cycle where that time is missing.
    s_running: bool,
    /// The utilization correction (see [`super::corrections`]).
    pub trim: f64,
    /// The ratio given last cycle; `None` before the member's first reading.
    pub last: Option<u32>,
    /// Age of the sample seen last cycle (see [`Estimator::is_new`]).
    age: Option<Duration>,
    /// Time since the last new reading (see [`Estimator::trim_weight`]).
    unread: Duration,
    /// How much this cycle's reading moves the trim: 0 for one seen before.
    pub trim_weight: f64,
    /// Time since the member was last seen memory-bound; `None`: not seen so.
    since_full: Option<Duration>,
    /// The queue rule's cut (see [`super::queue_rule`]).
    pub queue_cut: Option<f64>,
    /// The batch limit the member has shown (see the module docs); `None` until it has.
    pub limit: Option<f64>,
    /// The most it has been seen running (a batch limit is never below it).
    max_running: f64,
    /// New readings that ran exactly `max_running` while requests waited and memory had room:
    /// [`PLATEAU`] of them make it the limit.
    at_max_queued: u32,
}

impl Member {
    /// Nothing known yet; no trim.
    pub fn new() -> Self {
        Member { trim: 1.0, ..Member::default() }
    }
}

/// Reads samples into [`Member`]s: the settings and the cycle interval they are read at.
pub(super) struct Estimator<'a> {
    pub params: &'a CapacityParams,
    /// The controller's cycle interval (at least 100 ms, `config`): how much older a reading seen
    /// again has become.
    pub interval: Duration,
}

impl Estimator<'_> {
    /// Whether a sample of age `age` is a new reading, after one of age `prev` a cycle ago. The same
    /// reading seen again is a whole interval older; a new one is younger than that. (Comparing
    /// the ages alone calls a direct scrape whose age jittered up by a millisecond a repeat.)
    pub fn is_new(&self, prev: Option<Duration>, age: Duration) -> bool {
        prev.is_none_or(|prev| age < prev + self.interval / 2)
    }

    /// How much a new reading moves the trim: the time since the previous one, per
    /// [`TRIM_PERIOD`], at most 1. So the trim's speed is set in seconds, whatever the source:
    /// Prometheus readings every 15 s count fully, direct scrapes every second a fifteenth each.
    fn trim_weight(&self, unread: Duration) -> f64 {
        (unread.as_secs_f64() / TRIM_PERIOD.as_secs_f64()).min(1.0)
    }

    /// The capacity one sample shows, in concurrent requests, and whether it is exact (taken at
    /// once rather than smoothed). From memory where the server publishes KV usage (capped by its
    /// slots or `max_num_seqs`); from its slot count where it publishes none; and, without either,
    /// from what it runs while it queues.
    fn capacity_shown(&self, s: &Sample, learnt: Option<f64>) -> Option<(f64, bool)> {
        // At its learnt limit with requests waiting and memory to spare: that is what it holds.
        if queued_with_room(s) && learnt == Some(s.running) {
            return Some((s.running, true));
        }
        // A declared number never caps below what the server is seen running.
        let limit = learnt.or(s.slots).unwrap_or(self.params.max_num_seqs).max(s.running);
        match (s.kv_usage, s.slots) {
            (Some(kv), _) if s.running >= MIN_RUNNING && kv >= MIN_USAGE => {
                Some(((s.running / kv).min(limit), false))
            }
            // Too few running to tell memory per request, but requests wait while memory is in
            // use: the next one did not fit, so this is what the server holds of this mix.
            (Some(_), _) if queued_with_memory_in_use(s) => Some((s.running, false)),
            (Some(_), _) => None,
            (None, Some(slots)) => Some((slots, true)),
            // A queueing server runs all it can (`limit` is never below what it runs).
            (None, None) => (s.waiting >= 1.0 && s.running >= 1.0).then_some((s.running, false)),
        }
    }

    /// `new` folded into the estimate `old`: smoothed, or taken as it is when `at_once`.
    fn blend(&self, old: Option<f64>, new: f64, at_once: bool) -> f64 {
        match old {
            Some(_) if at_once => new,
            Some(o) => o + self.params.smoothing * (new - o),
            None => new,
        }
    }

    /// Update a member's estimates from one fresh sample.
    pub fn observe(&self, mut m: Member, s: &Sample) -> Member {
        m.unread += self.interval;
        m.trim_weight = 0.0;
        let new = self.is_new(m.age, s.age);
        if new {
            m.trim_weight = self.trim_weight(m.unread);
            m.unread = Duration::ZERO;
            learn_limit(&mut m, s);
        }
        m.age = Some(s.age);
        // Memory-bound needs a memory reading: a llama.cpp server with every slot busy does not
        // preempt, it queues (like a vLLM server at its batch limit).
        let memory_bound = s.kv_usage.is_some_and(|kv| kv >= MEMORY_BOUND);
        m.since_full =
            if memory_bound { Some(Duration::ZERO) } else { m.since_full.map(|d| d + self.interval) };
        // Memory per request is a hardware constant times the workload's mix: smoothed only (the
        // mix on one server at one instant is noisy, and memory does not change suddenly).
        if let Some((k, exact)) = self.capacity_shown(s, m.limit) {
            m.k = Some(self.blend(m.k, k, exact));
        }
        self.observe_service(&mut m, s, memory_bound);
        m
    }

    /// The service-time half of [`Estimator::observe`].
    fn observe_service(&self, m: &mut Member, s: &Sample, memory_bound: bool) {
        let queued = s.waiting >= 1.0;
        let valid = |t: &f64| *t > 0.0 && t.is_finite();
        let latency_less_queue = s.latency.zip(s.queue_time).map(|(l, q)| l - q);
        if let Some(t) =
            s.service.filter(valid).or(s.token_time.filter(valid)).or(latency_less_queue.filter(valid))
        {
            // Not a slowdown on a server whose memory is full, or was within the times' window
            // (and it queues, so the delay factor already keeps new requests off it).
            let full = memory_bound || m.since_full.is_some_and(|d| d < MEMORY_BOUND_ECHO);
            let slowdown = queued && !full && m.s.is_some_and(|o| t > SLOWDOWN * o);
            m.s = Some(self.blend(m.s, t, slowdown));
            m.s_running = true;
        } else if let Some(l) = s.latency.filter(valid).filter(|_| !m.s_running) {
            if !queued {
                m.s = Some(self.blend(m.s, l, false));
            } else if m.s.is_none_or(|o| l > SLOWDOWN * o) {
                // A queued server whose requests take much longer than its estimate has lost
                // capacity: believed at once, with the queue's part taken out (Little's law: the
                // share of the time in the system spent running). Smaller readings from a queued
                // server are not used: the latency window may still hold an old backlog's waits.
                let in_system = s.running + s.waiting;
                m.s = Some(l * s.running.max(1.0).min(in_system) / in_system.max(1.0));
            }
        }
    }
}

/// Requests wait, something runs, and memory has room: the server is at its batch limit.
pub(super) fn queued_with_room(s: &Sample) -> bool {
    s.waiting >= 1.0 && s.running >= 1.0 && s.kv_usage.is_none_or(|kv| kv < ROOMY)
}

/// Requests wait, something runs, and memory is over half used: the server may be holding all
/// that its memory allows (a long prompt needs its blocks free before it is admitted).
pub(super) fn queued_with_memory_in_use(s: &Sample) -> bool {
    s.waiting >= 1.0 && s.running >= 1.0 && s.kv_usage.is_some_and(|kv| kv >= ROOMY)
}

/// Learn the batch limit from one new reading (a reading seen again must not count twice). A
/// server never runs more than its limit, so only a queued reading at the most it has ever run
/// is evidence of it; [`PLATEAU`] such readings (not necessarily in a row: behind a load balancer
/// that reacts, a small server queues every other cycle) make it the limit, and running more than
/// the limit always raises it. A burst being admitted step by step shows less than the server has
/// run before, and is ignored. (Until the limit is known, a member without an estimate that
/// queues with room counts what it runs, for the cycle only: see `base::capacities`.)
fn learn_limit(m: &mut Member, s: &Sample) {
    if s.running > m.max_running {
        m.max_running = s.running;
        m.at_max_queued = 0;
    }
    if queued_with_room(s) && s.running == m.max_running {
        m.at_max_queued += 1;
        if m.at_max_queued >= PLATEAU {
            m.limit = Some(s.running);
        }
    }
    if m.limit.is_some_and(|l| s.running > l) {
        m.limit = Some(s.running);
    }
}
