//! Priority pooling: "local first, spill over when local capacity runs out".
//!
//! A pool's members are split into ordered tiers (the local cluster or region first, then the next
//! one); a member's tier is the first that names it, and a member no tier names belongs to the last
//! one. A tier names members by a regex on the member id (`members`), by labels (`labels`) of their
//! series in Prometheus/Thanos (e.g. a Thanos external label `cluster`, read with a `group by`
//! query each cycle) or of their Kubernetes endpoints (`zone`, `node`), or by both. Labels are
//! remembered once seen, so a member whose data goes missing keeps its tier; one whose labels were
//! never seen is in the last tier. Only the *active* tiers carry traffic: tier 0 always, the next
//! one once the active tiers are saturated, and so on. Inactive tiers get ratio 0, which each load
//! balancer expresses natively:
//! - **HAProxy**: weight 0 (`allow_drain: true` is required): no new balanced traffic, health checks
//!   and stickiness untouched. HAProxy's `backup` flag cannot be set at run time, and it only spills
//!   when every primary server is down, not when they are busy.
//! - **Envoy**: Envoy rejects weight 0, so the member is left out of the EDS assignment (it drains),
//!   or with `priority_levels: true` on the sink given at priority 1: Envoy sends it nothing while
//!   priority 0 is healthy and fails over to it by itself if priority 0 goes down.
//! - **BIG-IP**: priority groups (`priority_groups: true` on the f5 sink): active members in group 2,
//!   inactive ones in group 1, with the pool's priority group activation on (`minActiveMembers` >= 1,
//!   checked by the sink). BIG-IP has no ratio 0; sideband mode cannot express tiers and is refused.
//!
//! The decision, each cycle, with hysteresis so a tier does not flap:
//! - **spill** to one more tier when the mean capped load (`min(1, load)`, the same figure as
//!   `llmlc_pool_saturation_ratio`) of the fresh members of the active tiers reaches `spill_at`;
//! - **return** from the last active tier when the load the active tiers carry now, spread over the
//!   members that would remain, has stayed below `return_below` (< `spill_at`) for `return_hold`
//!   (default 5 minutes, like the Kubernetes HPA's scale-down stabilization): moving back must not
//!   itself push the local tier over the spill threshold. The hold is there because the loads are
//!   states (KV usage, queues), not flows: right after a spill the local queues drain and the
//!   local tier looks light even when it cannot carry the traffic alone; without the hold the
//!   `region-spill` benchmark flapped every ~45 s (spill, drain, return, overload, spill);
//! - a member of an active tier without fresh data counts as full (a preferred tier that went dark
//!   spills rather than holds), and traffic only returns to tiers whose members are all in sight;
//! - at most one tier moves per cycle; tiers with no member are skipped; with no fresh data at all
//!   the active set is kept (fail-static, like the ratios themselves).
//!
//! Pure: samples in, active tier count and shaped ratios out; no clock, no I/O.

use std::collections::BTreeMap;

use llm_lc_adapters::{MemberId, Ratios};
use serde::Deserialize;

use crate::source::{validate, Snapshot};

/// `priority:` of a pool in the config file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriorityConfig {
    /// Tiers in order of preference; at least two.
    pub tiers: Vec<TierConfig>,
    /// Spill to the next tier when the active tiers' saturation reaches this (0..1].
    #[serde(default = "defaults::spill_at")]
    pub spill_at: f64,
    /// Return from the last active tier when the remaining tiers would carry the load below this.
    #[serde(default = "defaults::return_below")]
    pub return_below: f64,
    /// ... on every cycle for this long.
    #[serde(default = "defaults::return_hold", with = "humantime_serde")]
    pub return_hold: std::time::Duration,
}

/// One tier: a name for reports, and which members are in it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierConfig {
    pub name: String,
    /// Regex (anchored) on the member id, e.g. `10\.1\..*` for one cluster's pod network. Leave it
    /// and `labels` out on the last tier to mean "everything else".
    #[serde(default)]
    pub members: Option<String>,
    /// Labels (name -> anchored regex on the value) a member must carry, every one: of its series
    /// with a Prometheus source (`{ cluster: "east-.*" }`), or of its endpoint with Kubernetes
    /// members (`zone`, `node`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

mod defaults {
    // Chosen on seeds 1-3 of `bench --scenario region-spill` (src/bench/RESULTS.md): 0.7/0.5 spilled
    // earlier than 0.85/0.6 after the local region lost capacity (p99 TTFT 4-5 s instead of 5-16 s)
    // without spilling before it.
    pub fn spill_at() -> f64 {
        0.7
    }
    pub fn return_below() -> f64 {
        0.5
    }
    pub fn return_hold() -> std::time::Duration {
        std::time::Duration::from_secs(300)
    }
}

impl PriorityConfig {
    /// Problems visible without data, as `(field, message)` relative to `priority`.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        if self.tiers.len() < 2 {
            errs.push(("tiers".into(), "needs at least two tiers (one tier is a plain pool)".into()));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, t) in self.tiers.iter().enumerate() {
            if t.name.trim().is_empty() {
                errs.push((format!("tiers[{i}].name"), "must not be empty".into()));
            } else if !names.insert(t.name.as_str()) {
                errs.push((format!("tiers[{i}].name"), format!("duplicate tier name {:?}", t.name)));
            }
            let invalid = |e: regex::Error| format!("invalid regex: {}", validate::regex_error(&e));
            match &t.members {
                Some(re) => {
                    if let Err(e) = anchored(re) {
                        errs.push((format!("tiers[{i}].members"), invalid(e)));
                    }
                }
                None if t.labels.is_empty() && i + 1 < self.tiers.len() => errs.push((
                    format!("tiers[{i}].members"),
                    "only the last tier may leave both `members` and `labels` out (it takes every member no \
                     other tier names)"
                        .into(),
                )),
                None => {}
            }
            for (name, re) in &t.labels {
                // `__`-names are Prometheus' own (`__name__`): never a series label to match.
                if !validate::label_name(name) || name.starts_with("__") {
                    errs.push((
                        format!("tiers[{i}].labels.{name}"),
                        "not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)".into(),
                    ));
                }
                if let Err(e) = anchored(re) {
                    errs.push((format!("tiers[{i}].labels.{name}"), invalid(e)));
                }
            }
        }
        if !(self.spill_at > 0.0 && self.spill_at <= 1.0) {
            errs.push(("spill_at".into(), "must be within (0, 1]".into()));
        }
        if self.return_hold > std::time::Duration::from_secs(24 * 3600) {
            errs.push(("return_hold".into(), "at most 24h".into()));
        }
        if !(self.return_below >= 0.0 && self.return_below < self.spill_at) {
            errs.push((
                "return_below".into(),
                "must be >= 0 and below spill_at (the gap is the hysteresis)".into(),
            ));
        }
        errs
    }
}

fn anchored(re: &str) -> Result<regex::Regex, regex::Error> {
    regex::Regex::new(&format!("^(?:{re})$"))
}

impl PriorityConfig {
    /// The series labels the tiers name, which the source must report per member.
    pub fn label_names(&self) -> Vec<String> {
        let names: std::collections::BTreeSet<&String> =
            self.tiers.iter().flat_map(|t| t.labels.keys()).collect();
        names.into_iter().cloned().collect()
    }
}

/// How one tier names its members; a tier with neither part names none (the last, catch-all tier).
struct TierMatch {
    members: Option<regex::Regex>,
    labels: Vec<(String, regex::Regex)>,
}

impl TierMatch {
    fn names(&self, m: &MemberId, labels: Option<&BTreeMap<String, String>>) -> bool {
        if self.members.is_none() && self.labels.is_empty() {
            return false;
        }
        self.members.as_ref().is_none_or(|re| re.is_match(m.as_str()))
            && self
                .labels
                .iter()
                .all(|(name, re)| labels.and_then(|l| l.get(name)).is_some_and(|v| re.is_match(v)))
    }
}

/// What one cycle decided.
#[derive(Debug, Clone, PartialEq)]
pub struct SpillStep {
    /// Tiers carrying traffic: `0..active`.
    pub active: usize,
    /// Saturation of the active tiers (members without fresh data count as full), when the pool had
    /// any fresh data.
    pub saturation: Option<f64>,
    /// `Some(true)` spilled to one more tier this cycle, `Some(false)` returned from one.
    pub moved: Option<bool>,
}

/// A pool's tier state across cycles.
pub struct Spill {
    names: Vec<String>,
    matchers: Vec<TierMatch>,
    /// The tier labels last seen for each member (kept while the member's data is missing).
    labels: BTreeMap<MemberId, BTreeMap<String, String>>,
    spill_at: f64,
    return_below: f64,
    return_hold: std::time::Duration,
    /// Since when the return condition has held without a break.
    below_since: Option<std::time::Instant>,
    /// Tiers carrying traffic: `0..active`, at least 1.
    active: usize,
}

impl Spill {
    /// From a validated config (an invalid regex here would have been refused by `validate`).
    pub fn new(cfg: &PriorityConfig) -> Result<Spill, String> {
        let matchers = cfg
            .tiers
            .iter()
            .map(|t| {
                let members = t.members.as_deref().map(anchored).transpose().map_err(|e| e.to_string())?;
                let labels = t
                    .labels
                    .iter()
                    .map(|(k, v)| anchored(v).map(|re| (k.clone(), re)).map_err(|e| e.to_string()))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(TierMatch { members, labels })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Spill {
            names: cfg.tiers.iter().map(|t| t.name.clone()).collect(),
            matchers,
            labels: BTreeMap::new(),
            spill_at: cfg.spill_at,
            return_below: cfg.return_below,
            return_hold: cfg.return_hold,
            below_since: None,
            active: 1,
        })
    }

    /// The tier of a member: the first that names it, else the last.
    pub fn tier_of(&self, m: &MemberId) -> usize {
        let labels = self.labels.get(m);
        self.matchers.iter().position(|t| t.names(m, labels)).unwrap_or(self.matchers.len().saturating_sub(1))
    }

    /// Take in the labels a source reported this cycle; members no longer in `members` are
    /// forgotten, members without a report keep what was last seen.
    pub fn learn(&mut self, members: &[MemberId], seen: &BTreeMap<MemberId, BTreeMap<String, String>>) {
        for (m, l) in seen {
            self.labels.insert(m.clone(), l.clone());
        }
        if self.labels.len() > members.len() {
            let keep: std::collections::BTreeSet<&MemberId> = members.iter().collect();
            self.labels.retain(|m, _| keep.contains(m));
        }
    }

    pub fn tier_name(&self, tier: usize) -> &str {
        self.names.get(tier).map(String::as_str).unwrap_or("")
    }

    pub fn active(&self) -> usize {
        self.active
    }

    /// One cycle at `now`: `loads` are the capped loads (`min(1, load)`) of the members with fresh
    /// samples; `members` all members of the pool.
    pub fn step(
        &mut self,
        members: &[MemberId],
        loads: &BTreeMap<MemberId, f64>,
        now: std::time::Instant,
    ) -> SpillStep {
        let n = self.names.len();
        let mut count = vec![0usize; n];
        let mut fresh = vec![0usize; n];
        let mut sum = vec![0f64; n];
        for m in members {
            let t = self.tier_of(m);
            count[t] += 1;
            if let Some(l) = loads.get(m) {
                fresh[t] += 1;
                sum[t] += l.clamp(0.0, 1.0);
            }
        }
        // The active set always holds at least one member, as long as any tier has one: an empty
        // preferred tier (the local cluster scaled to zero) is passed over.
        while self.active < n && count[..self.active].iter().sum::<usize>() == 0 {
            self.active += 1;
        }
        // A member of an active tier without fresh data counts as full: capacity that cannot be
        // seen cannot be counted on, and a preferred tier that went dark altogether (its cluster
        // unreachable) must spill rather than hold. With no fresh data anywhere nothing moves.
        let count_active: usize = count[..self.active].iter().sum();
        let unknown_active = count_active - fresh[..self.active].iter().sum::<usize>();
        let load_active: f64 = sum[..self.active].iter().sum();
        let any_fresh = fresh.iter().any(|&f| f > 0);
        let saturation = (any_fresh && count_active > 0)
            .then(|| (load_active + unknown_active as f64) / count_active as f64);
        let mut moved = None;
        if let Some(sat) = saturation {
            // The next tier that has members.
            let next = (self.active..n).find(|&t| count[t] > 0);
            let mut below = false;
            if let (true, Some(next)) = (sat >= self.spill_at, next) {
                self.active = next + 1;
                moved = Some(true);
            } else if self.active > 1 {
                // The fresh load the active tiers carry, spread over the members that would remain;
                // only onto tiers fully in sight.
                let last = (0..self.active).rev().find(|&t| count[t] > 0).unwrap_or(0);
                let remain: usize = count[..last].iter().sum();
                let remain_fresh: usize = fresh[..last].iter().sum();
                below = last > 0
                    && remain > 0
                    && remain_fresh == remain
                    && load_active / (remain as f64) < self.return_below;
                if below
                    && now.saturating_duration_since(*self.below_since.get_or_insert(now)) >= self.return_hold
                {
                    self.active = last;
                    moved = Some(false);
                    below = false;
                }
            }
            if !below {
                // Spilled, returned, or the condition broke: the next hold starts afresh.
                self.below_since = None;
            }
        }
        SpillStep { active: self.active, saturation, moved }
    }

    /// `ratios` with every member of an inactive tier at 0 (no new traffic).
    pub fn shape(&self, ratios: &Ratios) -> Ratios {
        ratios.iter().map(|(m, r)| (m.clone(), if self.tier_of(m) < self.active { r } else { 0 })).collect()
    }
}

/// A pool's tiers with what it takes to read loads from a snapshot: what the cycle holds.
pub struct Tiers {
    pub spill: Spill,
    pub stale_after: std::time::Duration,
    pub queue_norm: f64,
    pub running_norm: f64,
}

impl Tiers {
    /// A pool's tiers as both the controller and the benchmark build them: the spill rule of
    /// `cfg`, samples older than `stale_after` ignored, loads read with the norms of the pool's
    /// policy. An error for a tier selector that does not compile.
    pub fn new(
        cfg: &PriorityConfig,
        stale_after: std::time::Duration,
        policy: &crate::policy::PolicyConfig,
    ) -> Result<Tiers, String> {
        let spill = Spill::new(cfg)?;
        let (queue_norm, running_norm) = policy.norms();
        Ok(Tiers { spill, stale_after, queue_norm, running_norm })
    }

    /// One cycle on a snapshot: decide the active tiers, and shape the policy's ratios.
    pub fn apply(
        &mut self,
        snap: &Snapshot,
        ratios: &Ratios,
        now: std::time::Instant,
    ) -> (Ratios, SpillStep) {
        let members: Vec<MemberId> = snap.members.keys().cloned().collect();
        self.spill.learn(&members, &snap.labels);
        let loads = fresh_loads(snap, self.stale_after, self.queue_norm, self.running_norm);
        let step = self.spill.step(&members, &loads, now);
        (self.spill.shape(ratios), step)
    }
}

/// Capped loads of the members with samples no older than `stale_after`, as [`Spill::step`] takes
/// them (the same `load` the policies and the saturation gauge use).
pub fn fresh_loads(
    snap: &Snapshot,
    stale_after: std::time::Duration,
    queue_norm: f64,
    running_norm: f64,
) -> BTreeMap<MemberId, f64> {
    snap.members
        .iter()
        .filter_map(|(m, s)| {
            let s = s.as_ref().filter(|s| s.age <= stale_after)?;
            Some((m.clone(), crate::policy::load(s, queue_norm, running_norm).min(1.0)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn cfg() -> PriorityConfig {
        PriorityConfig {
            tiers: vec![
                TierConfig {
                    name: "east".into(),
                    members: Some(r"10\.1\..*".into()),
                    labels: BTreeMap::new(),
                },
                TierConfig { name: "west".into(), members: None, labels: BTreeMap::new() },
            ],
            spill_at: 0.85,
            return_below: 0.6,
            return_hold: Duration::ZERO,
        }
    }

    fn ids(v: &[&str]) -> Vec<MemberId> {
        v.iter().map(|s| MemberId::from(*s)).collect()
    }

    const EAST: [&str; 2] = ["10.1.0.1:8000", "10.1.0.2:8000"];
    const WEST: [&str; 2] = ["10.2.0.1:8000", "10.2.0.2:8000"];

    fn all() -> Vec<MemberId> {
        ids(&[EAST[0], EAST[1], WEST[0], WEST[1]])
    }

    fn loads(east: f64, west: f64) -> BTreeMap<MemberId, f64> {
        EAST.iter()
            .map(|m| (MemberId::from(*m), east))
            .chain(WEST.iter().map(|m| (MemberId::from(*m), west)))
            .collect()
    }

    #[test]
    fn members_fall_into_the_first_tier_that_names_them_else_the_last() {
        let s = Spill::new(&cfg()).expect("valid");
        assert_eq!(s.tier_of(&MemberId::from("10.1.3.4:8000")), 0);
        assert_eq!(s.tier_of(&MemberId::from("10.2.0.1:8000")), 1);
        // Anchored: a member merely containing the pattern is not in the tier.
        assert_eq!(s.tier_of(&MemberId::from("110.1.0.1:8000")), 1);
    }

    #[test]
    fn tiers_named_by_labels_follow_what_the_source_saw_and_remember_it() {
        let by_label = |k: &str, v: &str| [(k.to_string(), v.to_string())].into_iter().collect();
        let c = PriorityConfig {
            tiers: vec![
                TierConfig { name: "east".into(), members: None, labels: by_label("cluster", "east-.*") },
                TierConfig { name: "west".into(), members: None, labels: BTreeMap::new() },
            ],
            ..cfg()
        };
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        assert_eq!(c.label_names(), ["cluster"]);
        let mut s = Spill::new(&c).expect("valid");
        let (a, b, x) = (MemberId::from("a:1"), MemberId::from("b:1"), MemberId::from("x:1"));
        let members = vec![a.clone(), b.clone(), x.clone()];
        // Never seen: the last tier.
        assert_eq!(s.tier_of(&a), 1);
        let seen: BTreeMap<MemberId, BTreeMap<String, String>> = [
            (a.clone(), by_label("cluster", "east-1")),
            (b.clone(), by_label("cluster", "west-1")),
            (x.clone(), BTreeMap::new()),
        ]
        .into_iter()
        .collect();
        s.learn(&members, &seen);
        assert_eq!([&a, &b, &x].map(|m| s.tier_of(m)), [0, 1, 1]);
        // a's data goes missing this cycle: it keeps its tier.
        s.learn(&members, &BTreeMap::new());
        assert_eq!(s.tier_of(&a), 0);
        // a leaves the pool: forgotten.
        s.learn(&members[1..], &BTreeMap::new());
        assert_eq!(s.tier_of(&a), 1);
        // Both parts given: both must match.
        let both = TierConfig {
            name: "e".into(),
            members: Some("a:.*".into()),
            labels: by_label("cluster", "east-.*"),
        };
        let mut s =
            Spill::new(&PriorityConfig { tiers: vec![both, c.tiers[1].clone()], ..cfg() }).expect("valid");
        s.learn(&members, &seen);
        assert_eq!([&a, &b].map(|m| s.tier_of(m)), [0, 1]);
        // Bad label names and regexes are named by field.
        let bad = PriorityConfig {
            tiers: vec![
                TierConfig {
                    name: "e".into(),
                    members: None,
                    labels: [("__name__".into(), "(".into())].into(),
                },
                c.tiers[1].clone(),
            ],
            ..cfg()
        };
        let fields: Vec<String> = bad.validate().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["tiers[0].labels.__name__", "tiers[0].labels.__name__"]);
    }

    #[test]
    fn spills_when_local_saturates_and_returns_only_below_the_lower_threshold() {
        let mut s = Spill::new(&cfg()).expect("valid");
        let m = all();
        assert_eq!(s.step(&m, &loads(0.5, 0.0), Instant::now()).active, 1);
        let r = ratios_of(&m);
        assert_eq!(s.shape(&r).get(&MemberId::from(WEST[0])), Some(0), "remote idle while local has room");
        // Local saturated: spill.
        let st = s.step(&m, &loads(0.9, 0.0), Instant::now());
        assert_eq!((st.active, st.moved), (2, Some(true)));
        assert_eq!(s.shape(&r).get(&MemberId::from(WEST[0])), Some(50));
        // Spilled, the load spreads: east 0.6, west 0.4 -> active saturation 0.5, but the load
        // (2 x 0.6 + 2 x 0.4 = 2.0) over east's two members is 1.0, not below 0.6: stay.
        assert_eq!(s.step(&m, &loads(0.6, 0.4), Instant::now()).active, 2);
        // Between the thresholds nothing moves, in either direction (no flapping).
        for _ in 0..5 {
            assert_eq!(s.step(&m, &loads(0.35, 0.3), Instant::now()).active, 2);
        }
        // Demand falls: (2 x 0.3 + 2 x 0.2) / 2 = 0.5 < 0.6: return.
        let st = s.step(&m, &loads(0.3, 0.2), Instant::now());
        assert_eq!((st.active, st.moved), (1, Some(false)));
    }

    #[test]
    fn return_waits_until_the_condition_has_held_for_return_hold() {
        let mut s =
            Spill::new(&PriorityConfig { return_hold: Duration::from_secs(300), ..cfg() }).expect("valid");
        let m = all();
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        assert_eq!(s.step(&m, &loads(0.9, 0.0), at(0)).moved, Some(true));
        // Light right after the spill (the local queues drained): held, not returned.
        assert_eq!(s.step(&m, &loads(0.2, 0.1), at(5)).active, 2);
        assert_eq!(s.step(&m, &loads(0.2, 0.1), at(200)).active, 2);
        // A break in the condition restarts the hold.
        assert_eq!(s.step(&m, &loads(0.6, 0.4), at(250)).active, 2);
        assert_eq!(s.step(&m, &loads(0.2, 0.1), at(300)).active, 2);
        assert_eq!(s.step(&m, &loads(0.2, 0.1), at(599)).active, 2);
        let st = s.step(&m, &loads(0.2, 0.1), at(600));
        assert_eq!((st.active, st.moved), (1, Some(false)), "held for 300 s: back");
        // The default is five minutes.
        let parsed: PriorityConfig =
            serde_json::from_str(r#"{"tiers":[{"name":"a","members":"x"},{"name":"b"}]}"#).expect("parses");
        assert_eq!(parsed.return_hold, Duration::from_secs(300));
    }

    fn ratios_of(m: &[MemberId]) -> Ratios {
        m.iter().map(|x| (x.clone(), 50)).collect()
    }

    #[test]
    fn an_empty_local_tier_is_passed_over_and_no_data_moves_nothing() {
        let mut s = Spill::new(&cfg()).expect("valid");
        let west_only = ids(&WEST);
        let st = s.step(&west_only, &BTreeMap::new(), Instant::now());
        assert_eq!((st.active, st.saturation, st.moved), (2, None, None), "local scaled to zero");
        let mut s = Spill::new(&cfg()).expect("valid");
        assert_eq!(
            s.step(&all(), &BTreeMap::new(), Instant::now()),
            SpillStep { active: 1, saturation: None, moved: None }
        );
    }

    #[test]
    fn a_dark_local_tier_spills_and_traffic_returns_only_to_a_tier_in_sight() {
        let mut s = Spill::new(&cfg()).expect("valid");
        let west_only: BTreeMap<MemberId, f64> = WEST.iter().map(|m| (MemberId::from(*m), 0.1)).collect();
        let st = s.step(&all(), &west_only, Instant::now());
        assert_eq!((st.active, st.saturation, st.moved), (2, Some(1.0), Some(true)), "east unreadable");
        // East back, lightly loaded, but one of its replicas still unreadable: stay spilled.
        let mut partial = west_only.clone();
        partial.insert(MemberId::from(EAST[0]), 0.1);
        assert_eq!(s.step(&all(), &partial, Instant::now()).active, 2);
        assert_eq!(s.step(&all(), &loads(0.1, 0.1), Instant::now()).moved, Some(false));
    }

    #[test]
    fn config_errors_name_the_field() {
        let mut c = cfg();
        c.tiers[0].members = None;
        c.tiers[1].name = "".into();
        c.return_below = 0.9;
        let fields: Vec<String> = c.validate().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["tiers[0].members", "tiers[1].name", "return_below"]);
        let mut c = cfg();
        c.tiers[0].members = Some("(".into());
        c.tiers.truncate(1);
        let fields: Vec<String> = c.validate().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["tiers", "tiers[0].members"]);
    }
}
