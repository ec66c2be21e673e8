//! One pool's control cycle as a pure state machine: what to push, or why not.
//!
//! [`Cycle::step`] takes what the source saw (a snapshot or the error), the pool's known members, the
//! time and whether this replica leads, and returns a [`Step`]: the pool's [`PoolState`], the
//! policy's ratios, and a [`Decision`]: push these ratios, or hold with a [`PushOutcome`] saying why.
//! [`Cycle::pushed`] then tells it how the push went. No I/O and no clock reads: the controller
//! (`crate::controller`, the async shell) and the benchmark drive the same code, one with the wall
//! clock and real sinks, the other in virtual time.
//!
//! The rules that keep a load balancer safe, each pinned by a test below:
//! - **Fail-static**: with the source down or every sample stale, nothing is pushed and the load
//!   balancer keeps its last ratios; after `reset_after` of that, `on_stale: equal` pushes equal
//!   ratios instead.
//! - **Drain guard**: a set of ratios that leaves no member able to take traffic is never pushed.
//! - **Backoff**: a failing push is retried after exponentially growing waits ([`backoff`]); proof
//!   that the load balancer answers again ([`Cycle::lb_answered`]) ends the wait at once.
//! - **Leadership**: a follower computes and reports but never pushes to a shared load balancer.
//! - **One push at a time**: while a push is in flight the cycle holds (`in_progress`) instead of
//!   stacking another one behind it.
//! - **Change policy** ([`change`]): which moves are worth a write.
//! - **Resync**: sinks that cannot read the load balancer back get the full set again every
//!   `resync_every` even when nothing changed, so a restarted receiver catches up.

pub mod backoff;
pub mod change;

use std::time::{Duration, Instant};

use llm_lc_adapters::{MemberId, Ratios};
use serde::{Deserialize, Serialize};

use crate::policy::{Outcome, PoolPolicy};
use crate::ratio::RatioRange;
use crate::source::Snapshot;
use backoff::Backoff;
use change::{ChangeFilter, ChangePolicy};

/// What the cycle does once the whole pool has had no fresh data for `reset_after` (the pool's
/// `on_stale`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStale {
    /// Keep the load balancer's last ratios.
    #[default]
    Hold,
    /// Push equal ratios: with no information, spread load evenly.
    Equal,
}

/// A pool's health as the controller sees it (serialized as in `/v1/ratios`: `ok`, `source_down`,
/// `stale`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolState {
    /// Before the first cycle; reported as `ok`.
    #[default]
    #[serde(rename = "ok")]
    Starting,
    Ok,
    /// The source failed (Prometheus down, every scrape failed).
    SourceDown,
    /// The source answered but no member has a fresh sample.
    Stale,
}

impl PoolState {
    pub fn as_str(self) -> &'static str {
        match self {
            PoolState::Starting | PoolState::Ok => "ok",
            PoolState::SourceDown => "source_down",
            PoolState::Stale => "stale",
        }
    }

    pub fn is_ok(self) -> bool {
        matches!(self, PoolState::Starting | PoolState::Ok)
    }
}

/// What became of a cycle's push (the `push` field of `/v1/ratios`, the `outcome` label of
/// `llmlc_pushes_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PushOutcome {
    /// At least one member's ratio was changed on the load balancer.
    Pushed,
    /// The load balancer already held these ratios.
    #[default]
    Unchanged,
    /// A dry run: computed and printed, pushed nowhere.
    DryRun,
    /// Fail-static: the source is down or stale, the load balancer keeps its last ratios.
    Held,
    /// The sink failed recently; waiting before the next attempt.
    Backoff,
    /// These ratios would leave no member able to take traffic.
    RefusedDrain,
    /// Another replica holds the leader lease.
    Follower,
    /// The previous push is still running (slow management plane).
    InProgress,
    /// The push failed.
    Error,
}

impl PushOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            PushOutcome::Pushed => "pushed",
            PushOutcome::Unchanged => "unchanged",
            PushOutcome::DryRun => "dry_run",
            PushOutcome::Held => "held",
            PushOutcome::Backoff => "backoff",
            PushOutcome::RefusedDrain => "refused_drain",
            PushOutcome::Follower => "follower",
            PushOutcome::InProgress => "in_progress",
            PushOutcome::Error => "error",
        }
    }
}

/// What the source gave this cycle.
pub enum Sampled<'a> {
    Snapshot(&'a Snapshot),
    /// The source failed; the message is reported and logged.
    Failed(&'a str),
}

/// The cycle's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Send these ratios to the sink, then call [`Cycle::pushed`].
    Push(Ratios),
    /// Send nothing, because of this.
    Hold(PushOutcome),
}

/// Everything one step decided.
#[derive(Debug, Clone)]
pub struct Step {
    pub state: PoolState,
    /// `Some(old)` when the state changed this step (log it once, not every cycle).
    pub changed_from: Option<PoolState>,
    /// The policy's outcome, when it ran (fresh data); `None` when failing static.
    pub policy: Option<Outcome>,
    /// The ratios the controller wants now (policy's, equal ones, or the last computed when holding).
    pub desired: Ratios,
    pub decision: Decision,
    /// Priority pooling's decision this cycle, for pools with tiers and fresh data.
    pub tiers: Option<crate::priority::SpillStep>,
}

/// How a push ended, as the shell saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushResult {
    /// The sink applied the ratios; `changed` members were written.
    Applied { changed: usize },
    /// The sink failed (or the push overran its time budget).
    Failed { retryable: bool },
}

/// The fixed settings of one pool's cycle.
#[derive(Debug, Clone)]
pub struct CycleSettings {
    pub range: RatioRange,
    pub on_stale: OnStale,
    pub reset_after: Duration,
    /// The sink changes something outside this process, so only the leader may push.
    pub needs_leader: bool,
    /// The sink reads the load balancer inside `apply` and writes only drift: apply it every cycle.
    pub reconciles: bool,
    /// A dry run: pushes "succeed" without going anywhere.
    pub dry_run: bool,
    pub change: ChangePolicy,
    /// For sinks that cannot read back: re-send everything this often.
    pub resync_every: Duration,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// Seed of the backoff jitter (derive it from the pool name: reproducible, different per pool).
    pub seed: u64,
}

impl CycleSettings {
    /// Defaults for everything but the pool's own rules.
    pub fn new(range: RatioRange, on_stale: OnStale, reset_after: Duration) -> Self {
        CycleSettings {
            range,
            on_stale,
            reset_after,
            needs_leader: false,
            reconciles: false,
            dry_run: false,
            change: ChangePolicy::EVERY_CHANGE,
            resync_every: Duration::from_secs(60),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            seed: 0,
        }
    }
}

/// One pool's control cycle: policy memory, what was pushed, backoff, fail-static state.
pub struct Cycle {
    settings: CycleSettings,
    policy: PoolPolicy,
    state: PoolState,
    unhealthy_since: Option<Instant>,
    /// What the policy computed last: its "previous" (what it asked the load balancer to hold).
    last_computed: Ratios,
    /// What was last sent successfully, and when (resync of sinks that cannot read back).
    last_sent: Option<(Ratios, Instant)>,
    /// Sent but not yet answered.
    in_flight: Option<Ratios>,
    backoff: Backoff,
    last_wait: Option<Duration>,
    change: ChangeFilter,
    /// Priority pooling: which tiers carry traffic (`None`: one flat pool).
    tiers: Option<crate::priority::Tiers>,
}

impl Cycle {
    pub fn new(settings: CycleSettings, policy: PoolPolicy) -> Self {
        let backoff = Backoff::new(settings.backoff_base, settings.backoff_max, settings.seed);
        let change = ChangeFilter::new(settings.change);
        Cycle {
            settings,
            policy,
            state: PoolState::Starting,
            unhealthy_since: None,
            last_computed: Ratios::default(),
            last_sent: None,
            in_flight: None,
            backoff,
            last_wait: None,
            change,
            tiers: None,
        }
    }

    /// With priority pooling: ratios of inactive tiers are pushed as 0. The policy keeps computing
    /// every member's ratio (its memory stays whole), so a tier that comes back starts from its own.
    /// The name of `m`'s priority tier, when the pool has tiers.
    pub fn tier_of(&self, m: &MemberId) -> Option<&str> {
        self.tiers.as_ref().map(|t| t.spill.tier_name(t.spill.tier_of(m)))
    }

    pub fn with_tiers(mut self, tiers: Option<crate::priority::Tiers>) -> Self {
        self.tiers = tiers;
        self
    }

    pub fn state(&self) -> PoolState {
        self.state
    }

    /// The ratios computed last (carried over by a config reload).
    pub fn last_computed(&self) -> &Ratios {
        &self.last_computed
    }

    /// Start from ratios a previous controller computed, so a reload does not reset them.
    pub fn seed_ratios(&mut self, ratios: Ratios) {
        self.last_computed = ratios;
    }

    /// Consecutive push failures.
    pub fn failures(&self) -> u32 {
        self.backoff.failures()
    }

    pub fn push_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// One cycle. `members` are the pool's known members (used when there is no snapshot).
    pub fn step(&mut self, sampled: Sampled<'_>, members: &[MemberId], now: Instant, leading: bool) -> Step {
        let (state, outcome, shaped) = match sampled {
            Sampled::Failed(_) => (PoolState::SourceDown, None, None),
            Sampled::Snapshot(snap) => {
                let outcome = self.policy.compute(snap, &self.last_computed);
                if outcome.fresh == 0 {
                    (PoolState::Stale, Some(outcome), None)
                } else {
                    let shaped = self.tiers.as_mut().map(|t| t.apply(snap, &outcome.ratios, now));
                    (PoolState::Ok, Some(outcome), shaped)
                }
            }
        };
        let changed_from = self.set_state(state, now);

        if state == PoolState::Ok {
            let outcome = outcome.expect("a fresh pool always has a policy outcome");
            self.last_computed = outcome.ratios.clone();
            let (desired, tiers) = match shaped {
                Some((r, step)) => (r, Some(step)),
                None => (outcome.ratios.clone(), None),
            };
            let decision = self.decide(&desired, now, leading);
            return Step { state, changed_from, policy: Some(outcome), desired, decision, tiers };
        }

        // Fail-static, unless the pool has been blind for `reset_after` and equal ratios were asked for.
        let blind_for = self.unhealthy_since.map(|t| now.saturating_duration_since(t)).unwrap_or_default();
        if self.settings.on_stale == OnStale::Equal
            && blind_for >= self.settings.reset_after
            && !members.is_empty()
        {
            let equal = self.settings.range.clamp(self.settings.range.mid());
            let desired: Ratios = members.iter().map(|m| (m.clone(), equal)).collect();
            self.last_computed = desired.clone();
            let decision = self.decide(&desired, now, leading);
            return Step { state, changed_from, policy: None, desired, decision, tiers: None };
        }
        Step {
            state,
            changed_from,
            policy: None,
            desired: self.last_computed.clone(),
            decision: Decision::Hold(PushOutcome::Held),
            tiers: None,
        }
    }

    fn set_state(&mut self, state: PoolState, now: Instant) -> Option<PoolState> {
        if state == self.state {
            return None;
        }
        if state == PoolState::Ok {
            self.unhealthy_since = None;
        } else if self.unhealthy_since.is_none() {
            self.unhealthy_since = Some(now);
        }
        let old = std::mem::replace(&mut self.state, state);
        // Leaving `Starting` for `Ok` is not news.
        (old != PoolState::Starting || state != PoolState::Ok).then_some(old)
    }

    fn decide(&mut self, desired: &Ratios, now: Instant, leading: bool) -> Decision {
        if desired.is_empty() {
            return Decision::Hold(PushOutcome::Unchanged);
        }
        let to_send = self.change.filter(desired, now);
        if desired.drains_everything() || to_send.drains_everything() {
            return Decision::Hold(PushOutcome::RefusedDrain);
        }
        if self.settings.needs_leader && !leading {
            return Decision::Hold(PushOutcome::Follower);
        }
        if self.in_flight.is_some() {
            return Decision::Hold(PushOutcome::InProgress);
        }
        if !self.backoff.ready(now) {
            return Decision::Hold(PushOutcome::Backoff);
        }
        // Sinks that reconcile read the LB inside `apply` and write only drift, so they are applied
        // every cycle; the others on change, and again every `resync_every`.
        if !self.settings.reconciles {
            if let Some((sent, at)) = &self.last_sent {
                if *sent == to_send && now.saturating_duration_since(*at) < self.settings.resync_every {
                    return Decision::Hold(PushOutcome::Unchanged);
                }
            }
        }
        self.in_flight = Some(to_send.clone());
        Decision::Push(to_send)
    }

    /// How the push of the last [`Decision::Push`] ended. Returns its outcome for the report.
    pub fn pushed(&mut self, result: PushResult, now: Instant) -> PushOutcome {
        let Some(sent) = self.in_flight.take() else {
            return PushOutcome::Unchanged;
        };
        match result {
            PushResult::Applied { changed } => {
                self.backoff.reset();
                self.last_wait = None;
                self.change.committed(&sent, now);
                self.last_sent = Some((sent, now));
                if self.settings.dry_run {
                    PushOutcome::DryRun
                } else if changed == 0 {
                    PushOutcome::Unchanged
                } else {
                    PushOutcome::Pushed
                }
            }
            PushResult::Failed { .. } => {
                self.last_wait = Some(self.backoff.failed(now));
                PushOutcome::Error
            }
        }
    }

    /// The wait before the next attempt, set by the last failed push (for the log line).
    pub fn retry_wait(&self) -> Option<Duration> {
        self.last_wait
    }

    /// The load balancer answered a read (membership, state): whatever it failed with is over, so
    /// drift is repaired on this cycle instead of after the backoff.
    pub fn lb_answered(&mut self) {
        if self.in_flight.is_none() {
            self.backoff.reset();
        }
    }

    /// Whether the cycle is waiting out a backoff at `now` (the shell then probes the LB with a read).
    pub fn backing_off(&self, now: Instant) -> bool {
        !self.backoff.ready(now)
    }
}

#[cfg(test)]
mod tests;
