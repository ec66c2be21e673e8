//! The control loop's async shell: every interval, sample each pool, ask its [`Cycle`], push, report.
//!
//! Decisions live in [`crate::cycle`] (pure, unit-tested); this module does the I/O around them:
//! - Pools run concurrently and each samples within a deadline of one interval, so one pool's hung
//!   source never holds up the others.
//! - A push runs as a task of its own with its own time budget (`push_timeout`, default three
//!   intervals): a slow management plane finishes its push while later cycles report `in_progress`,
//!   and a cycle never waits on a push started by an earlier one.
//! - While a sink backs off, a read of the load balancer (membership) that succeeds ends the wait, so
//!   drift is repaired as soon as the load balancer answers again.
//! - State changes (source down, back up, stale; discovery failing and recovering) are logged once,
//!   not every cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use llm_lc_adapters::{build_sink, Applied, MemberId, RatioSink, Ratios, SinkConfig, SinkContext, SinkError};
use tokio::task::JoinHandle;

use crate::config::{Config, PoolConfig, SourceConfig};
use crate::cycle::{Cycle, CycleSettings, Decision, PushOutcome, PushResult, Sampled};
use crate::policy::PoolPolicy;
use crate::report::{now_rfc3339, CycleReport, MemberReport, PoolReport};
use crate::source::{FailureReason, Join, PoolQuery, Snapshot, Source, SourceError};
use crate::telemetry::{labels, PoolCounter, Telemetry};

/// How long a read of the load balancer may take while probing whether it answers again.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

type PushTask = JoinHandle<Result<Result<Applied, SinkError>, tokio::time::error::Elapsed>>;

struct PoolRuntime {
    cfg: PoolConfig,
    query: PoolQuery,
    cycle: Cycle,
    sink: Arc<dyn RatioSink>,
    /// Where membership is read from: the sink itself, or (in a dry run) the real sink of the
    /// config, used read-only.
    membership: Option<Arc<dyn RatioSink>>,
    /// `members: { kubernetes }`: the Service whose ready endpoints are the members.
    kubernetes: Option<Arc<crate::source::kubernetes::ServiceMembers>>,
    /// `members: { kubernetes }`: each member's endpoint zone and node, for tiers named by them.
    endpoint_labels: BTreeMap<MemberId, BTreeMap<String, String>>,
    push: Option<PushTask>,
    push_timeout: Duration,
    /// Warnings of the last successful push, so repeats are not logged every cycle.
    last_warnings: Vec<String>,
    /// Member discovery is failing (logged once per change).
    discovery_failing: bool,
    /// Names discovery offered last time that are not member names (logged once while offered).
    refused_names: std::collections::BTreeSet<String>,
    /// Members that could not be read last cycle, and why (warned once per change).
    failing: BTreeMap<MemberId, &'static str>,
    /// "This replica leads"; `None` means always (no election).
    leader: Option<tokio::sync::watch::Receiver<bool>>,
    /// Members whose per-member series this pool wrote last cycle.
    exported: BTreeSet<MemberId>,
}

/// One pool's state a reloaded controller starts from ([`Controller::carried`]).
#[derive(Debug, Clone, Default)]
pub struct Carried {
    pub ratios: Ratios,
    pub members: Vec<MemberId>,
    /// How the pool found its members: carried members apply only where this is unchanged.
    pub members_from: crate::config::MembersConfig,
}

/// The whole controller: sources, pools and the shared telemetry.
pub struct Controller {
    interval: Duration,
    sources: BTreeMap<String, Source>,
    pools: Vec<PoolRuntime>,
    telemetry: Arc<Telemetry>,
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("source {0:?}: {1}")]
    Source(String, SourceError),
    #[error("pool {0:?}: {1}")]
    Sink(String, SinkError),
    #[error("pool {0:?}: {1}")]
    Members(String, SourceError),
}

/// The pool's priority tiers, with the norms its policy reads loads with.
fn tiers_of(p: &PoolConfig) -> Option<crate::priority::Tiers> {
    // Validated by `Config::validate`; a regex that fails here would have been refused there.
    crate::priority::Tiers::new(p.priority.as_ref()?, p.stale_after, &p.policy).ok()
}

/// A stable per-pool seed for the backoff jitter (FNV-1a of the name).
fn seed_of(name: &str) -> u64 {
    llm_lc_common::fnv1a64(name.as_bytes())
}

/// The cycle settings of a pool whose pushes go to `sink` (the dry-run sink with `--dry-run`).
pub fn cycle_settings(p: &PoolConfig, sink: &SinkConfig, reconciles: bool) -> CycleSettings {
    let mut s = CycleSettings::new(p.ratio, p.on_stale, p.reset_after);
    s.needs_leader = sink.needs_leader();
    s.reconciles = reconciles;
    s.dry_run = matches!(sink, SinkConfig::DryRun);
    s.change = p.change_policy();
    s.seed = seed_of(&p.name);
    s
}

impl Controller {
    /// Build from a validated config. With `dry_run`, every pool's sink is replaced by the dry-run
    /// sink: nothing is pushed anywhere, whatever the config says; pools whose members come from the
    /// load balancer still read them there (read-only).
    pub fn new(
        cfg: &Config,
        telemetry: Arc<Telemetry>,
        dry_run: bool,
        ctx: &SinkContext,
    ) -> Result<Self, BuildError> {
        for (field, why) in cfg.cautions() {
            tracing::warn!(field, "{why}");
        }
        let mut sources = BTreeMap::new();
        for (name, s) in &cfg.sources {
            sources
                .insert(name.clone(), Source::new(name, s).map_err(|e| BuildError::Source(name.clone(), e))?);
        }
        let mut pools = Vec::new();
        for p in &cfg.pools {
            let rate_window = match cfg.sources.get(&p.source) {
                Some(SourceConfig::Prometheus(pc)) => pc.rate_window,
                _ => Duration::from_secs(60),
            };
            let join = Join::new(&p.join).map_err(|e| BuildError::Source(p.source.clone(), e))?;
            let names = p.profile.resolve(&p.metrics);
            let queries = crate::source::profile::promql(
                &names,
                &p.queries,
                &p.join.label,
                p.selector.as_deref(),
                rate_window,
            );
            // Tiers named by series labels need a query that keeps them (the signal queries
            // aggregate them away).
            let tier_labels = p.priority.as_ref().map(|pr| pr.label_names()).filter(|l| !l.is_empty());
            let labels = tier_labels.map(|l| {
                let q =
                    crate::source::profile::labels_promql(&names, &p.join.label, p.selector.as_deref(), &l);
                (q, l)
            });
            let sink_cfg = if dry_run { SinkConfig::DryRun } else { p.sink.clone() };
            let sink: Arc<dyn RatioSink> =
                build_sink(&sink_cfg, &p.name, ctx).map_err(|e| BuildError::Sink(p.name.clone(), e))?.into();
            let membership = if dry_run && p.members.from_lb {
                let real = build_sink(&p.sink, &p.name, &SinkContext::default())
                    .map_err(|e| BuildError::Sink(p.name.clone(), e))?;
                Some(Arc::from(real))
            } else {
                None
            };
            let kubernetes = match &p.members.kubernetes {
                Some(k) => Some(Arc::new(
                    crate::source::kubernetes::ServiceMembers::new(k)
                        .map_err(|e| BuildError::Members(p.name.clone(), e))?,
                )),
                None => None,
            };
            let policy = PoolPolicy::new(&p.policy, p.ratio, p.stale_after, p.grace, cfg.interval);
            let settings = cycle_settings(p, &sink_cfg, sink.reconciles());
            pools.push(PoolRuntime {
                query: PoolQuery {
                    members: sorted(p.members.static_list.clone().unwrap_or_default()),
                    names,
                    queries,
                    join,
                    labels,
                    slots: p.slots.clone(),
                },
                cycle: Cycle::new(settings, policy).with_tiers(tiers_of(p)),
                sink,
                membership,
                kubernetes,
                endpoint_labels: BTreeMap::new(),
                push: None,
                push_timeout: p.push_timeout.unwrap_or(cfg.interval * 3),
                cfg: p.clone(),
                last_warnings: Vec::new(),
                discovery_failing: false,
                refused_names: Default::default(),
                failing: BTreeMap::new(),
                leader: None,
                exported: BTreeSet::new(),
            });
        }
        Ok(Controller { interval: cfg.interval, sources, pools, telemetry })
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    // --- leader election and config reload (src/leader.rs, src/reload.rs) ---

    /// Push only while `leader` holds `true`; otherwise pools compute and report as usual and their
    /// push outcome is `follower`.
    pub fn set_leadership(&mut self, leader: tokio::sync::watch::Receiver<bool>) {
        for p in &mut self.pools {
            p.leader = Some(leader.clone());
        }
    }

    /// What each pool knows that a reloaded controller should start from, by pool name: the ratios
    /// it computed last and the members it found.
    pub fn carried(&self) -> BTreeMap<String, Carried> {
        self.pools
            .iter()
            .map(|p| {
                let carried = Carried {
                    ratios: p.cycle.last_computed().clone(),
                    members: p.query.members.clone(),
                    members_from: p.cfg.members.clone(),
                };
                (p.cfg.name.clone(), carried)
            })
            .collect()
    }

    /// Start pools from what a previous controller knew, so a config reload neither resets ratios
    /// to the middle of the range nor greets every discovered member as new. Members carry over
    /// only where the pool finds them the same way as before. Pools not in `by_pool` start fresh.
    pub fn seed(&mut self, by_pool: &BTreeMap<String, Carried>) {
        for p in &mut self.pools {
            if let Some(c) = by_pool.get(&p.cfg.name) {
                p.cycle.seed_ratios(c.ratios.clone());
                if c.members_from == p.cfg.members && p.cfg.members.static_list.is_none() {
                    p.query.members = c.members.clone();
                }
            }
        }
    }

    /// Run one cycle: returns the report and whether every pool computed ratios from fresh data.
    pub async fn cycle(&mut self) -> (CycleReport, bool) {
        let started = Instant::now();
        let ts = now_rfc3339();
        let metrics = &self.telemetry.metrics;
        let deadline = self.interval;

        // 1. Membership, for pools that discover it.
        let sources = &self.sources;
        // Futures are built in loops, not closures: a closure returning a borrowing future makes the
        // cycle's future !Send (rustc #64552), and the demo spawns the controller.
        let telemetry = &self.telemetry;
        let mut refreshes = Vec::with_capacity(self.pools.len());
        for p in self.pools.iter_mut() {
            refreshes.push(p.refresh_members(sources, telemetry, deadline));
        }
        join_all(refreshes).await;

        // 2. Samples: each source once, for all of its pools.
        let mut snapshots: Vec<Option<Result<Snapshot, SourceError>>> =
            (0..self.pools.len()).map(|_| None).collect();
        let mut by_source: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, p) in self.pools.iter().enumerate() {
            by_source.entry(p.cfg.source.as_str()).or_default().push(i);
        }
        let mut sampling = Vec::with_capacity(by_source.len());
        for (name, idxs) in &by_source {
            let queries: Vec<&PoolQuery> = idxs.iter().map(|&i| &self.pools[i].query).collect();
            sampling.push(sample_within(name, &self.sources[*name], queries, deadline));
        }
        let sampled = join_all(sampling).await;
        for ((name, idxs), results) in by_source.iter().zip(sampled) {
            let mut counted = false;
            for (&i, r) in idxs.iter().zip(results) {
                if let Err(e) = &r {
                    if !counted {
                        metrics
                            .source_errors
                            .get_or_create(&labels(&[("source", name), ("reason", e.reason())]))
                            .inc();
                        counted = true;
                    }
                }
                snapshots[i] = Some(r);
            }
        }

        // 3. Decide and push, every pool concurrently; a push gets until the end of this cycle to
        //    report, and keeps running in the background within its own budget after that.
        let report_by = Instant::now() + deadline.saturating_sub(started.elapsed());
        let mut cycles = Vec::with_capacity(self.pools.len());
        for (p, snap) in self.pools.iter_mut().zip(snapshots) {
            let mut snap = snap.unwrap_or_else(|| Err(SourceError::Config("pool has no source".into())));
            if let (Ok(s), Some(_)) = (&mut snap, &p.cfg.priority) {
                // Endpoint zone and node join whatever labels the source reported.
                for (m, l) in &p.endpoint_labels {
                    if s.members.contains_key(m) {
                        s.labels
                            .entry(m.clone())
                            .or_default()
                            .extend(l.iter().map(|(k, v)| (k.clone(), v.clone())));
                    }
                }
            }
            cycles.push(p.cycle(snap, telemetry, report_by));
        }
        let reports = join_all(cycles).await;

        let good_pools = reports.iter().filter(|r| r.state.is_ok()).count();
        let all_good = good_pools == reports.len();
        let report = CycleReport { ts, pools: reports };
        metrics.cycle_duration.observe(started.elapsed().as_secs_f64());
        let result = if all_good {
            "ok"
        } else if good_pools > 0 {
            "partial"
        } else {
            "failed"
        };
        metrics.cycles.get_or_create(&labels(&[("result", result)])).inc();
        self.telemetry.record(report.clone(), good_pools > 0);
        (report, all_good)
    }

    /// Wait (briefly) for pushes still in flight, then release what sinks hold on load balancers
    /// (login tokens), each within a short deadline.
    pub async fn shutdown(&mut self) {
        let telemetry = self.telemetry.clone();
        let mut waits = Vec::new();
        for p in self.pools.iter_mut() {
            waits.push(p.settle_push(&telemetry, Instant::now() + Duration::from_secs(5)));
        }
        join_all(waits).await;
        join_all(self.pools.iter().map(|p| tokio::time::timeout(Duration::from_secs(5), p.sink.shutdown())))
            .await;
        join_all(
            self.pools
                .iter()
                .filter_map(|p| p.membership.as_ref())
                .map(|s| tokio::time::timeout(Duration::from_secs(5), s.shutdown())),
        )
        .await;
    }
}

impl PoolRuntime {
    fn reader(&self) -> &Arc<dyn RatioSink> {
        self.membership.as_ref().unwrap_or(&self.sink)
    }

    async fn refresh_members(
        &mut self,
        sources: &BTreeMap<String, Source>,
        telemetry: &Telemetry,
        deadline: Duration,
    ) {
        let pool = self.cfg.name.clone();
        let from_lb = self.cfg.members.from_lb;
        let found = if let Some(sel) = &self.cfg.members.prometheus_up {
            match sources.get(&self.cfg.source) {
                Some(src) => src.discover(sel, &self.query.join).await.map(Some),
                None => Ok(None),
            }
        } else if let Some(k) = self.kubernetes.clone() {
            match tokio::time::timeout(deadline, k.members()).await {
                Ok(r) => r.map(|labelled| {
                    let (ids, labels): (Vec<MemberId>, Vec<_>) = labelled.into_iter().unzip();
                    self.endpoint_labels = ids.iter().cloned().zip(labels).collect();
                    Some(ids)
                }),
                Err(_) => Err(SourceError::Unreachable {
                    what: format!("the Kubernetes API for pool {pool:?}"),
                    detail: format!("no answer within {deadline:?}"),
                }),
            }
        } else if from_lb {
            let reader = self.reader().clone();
            match tokio::time::timeout(deadline, reader.members()).await {
                Ok(r) => r.map_err(|e| SourceError::Unreachable {
                    what: format!("{} sink of pool {pool:?}", reader.kind()),
                    detail: e.to_string(),
                }),
                Err(_) => Err(SourceError::Unreachable {
                    what: format!("{} sink of pool {pool:?}", reader.kind()),
                    detail: format!("no answer within {deadline:?}"),
                }),
            }
        } else {
            Ok(None)
        };
        match found {
            Ok(Some(members)) => {
                let members = sorted(self.admit(members, telemetry));
                if from_lb {
                    self.cycle.lb_answered();
                }
                if self.discovery_failing {
                    tracing::info!(pool = %pool, members = members.len(), "member discovery works again");
                    self.discovery_failing = false;
                }
                // The same members again (the usual case) keep the ids the cycle already holds.
                if members != self.query.members {
                    let (gone, joined) = difference(&self.query.members, &members);
                    for m in gone {
                        tracing::info!(pool = %pool, member = %m, "member left the pool");
                        telemetry.metrics.forget_member(&pool, m.as_str());
                    }
                    for m in joined {
                        tracing::info!(pool = %pool, member = %m, "member joined the pool");
                    }
                    self.query.members = members;
                }
            }
            Ok(None) => {
                // Not discovering from the LB: while the sink backs off, a cheap read tells whether it
                // answers again.
                if !from_lb && self.cycle.backing_off(Instant::now()) && self.push.is_none() {
                    let reader = self.reader().clone();
                    if let Ok(Ok(Some(_))) = tokio::time::timeout(PROBE_TIMEOUT, reader.members()).await {
                        tracing::info!(pool = %pool, sink = reader.kind(), "load balancer answers again; retrying now");
                        self.cycle.lb_answered();
                    }
                }
            }
            // Keep the last known members: a discovery hiccup must not empty the pool.
            Err(e) => {
                if !self.discovery_failing {
                    tracing::warn!(pool = %pool, error = %e, "member discovery failed; keeping the last known members");
                    self.discovery_failing = true;
                }
            }
        }
    }

    /// Discovered names are from outside (labels, the LB's pool, EndpointSlices): see [`admit`].
    fn admit(&mut self, found: Vec<MemberId>, telemetry: &Telemetry) -> Vec<MemberId> {
        let (admitted, refused) = admit(&self.cfg.name, found, telemetry, &self.refused_names);
        self.refused_names = refused;
        admitted
    }

    fn leading(&self) -> bool {
        self.leader.as_ref().is_none_or(|l| *l.borrow())
    }

    async fn cycle(
        &mut self,
        snap: Result<Snapshot, SourceError>,
        telemetry: &Telemetry,
        report_by: Instant,
    ) -> PoolReport {
        let m = &telemetry.metrics;
        let pool = self.cfg.name.clone();
        let pool_l = labels(&[("pool", &pool)]);
        // A push from an earlier cycle that has ended: take its result before deciding again.
        if self.push.as_ref().is_some_and(|t| t.is_finished()) {
            let outcome = self.settle_push(telemetry, Instant::now()).await;
            count_push(telemetry, &pool, self.sink.kind(), outcome);
        }

        let now = Instant::now();
        let leading = self.leading();
        let before = self.cycle.last_computed().clone();
        let error = snap.as_ref().err().map(|e| e.to_string());
        let step = match &snap {
            Ok(s) => self.cycle.step(Sampled::Snapshot(s), &self.query.members, now, leading),
            Err(_) => self.cycle.step(
                Sampled::Failed(error.as_deref().unwrap_or_default()),
                &self.query.members,
                now,
                leading,
            ),
        };
        if let Some(old) = step.changed_from {
            log_state_change(&pool, old, step.state, error.as_deref());
        }
        let active_tiers: Option<Vec<String>> = match (&step.tiers, &self.cfg.priority) {
            (Some(t), Some(p)) => {
                let names: Vec<String> = p.tiers.iter().take(t.active).map(|x| x.name.clone()).collect();
                if let Some(spilled) = t.moved {
                    let verb =
                        if spilled { "spilled over to the next tier" } else { "returned from the last tier" };
                    tracing::info!(pool = %pool, active = ?names, saturation = t.saturation.unwrap_or_default(), "{verb}");
                }
                m.pool_active_tiers.get_or_create(&pool_l).set(t.active as f64);
                Some(names)
            }
            _ => None,
        };
        m.pool_members.get_or_create(&pool_l).set(self.query.members.len() as f64);
        m.pool_up.get_or_create(&pool_l).set(if step.state.is_ok() { 1.0 } else { 0.0 });

        let mut report = PoolReport {
            pool: pool.clone(),
            state: step.state,
            error,
            policy: self.cfg.policy.name(),
            sink: self.sink.kind(),
            active_tiers,
            ..Default::default()
        };
        if let Ok(snap) = &snap {
            self.member_health(snap, telemetry);
            for r in &snap.rejected {
                m.pool_counter(
                    PoolCounter::SamplesRejected,
                    &pool,
                    &[("signal", r.signal.as_str()), ("reason", r.reason)],
                )
                .inc();
                tracing::debug!(pool = %pool, member = %r.member, signal = r.signal.as_str(), value = r.value, reason = r.reason, "sample rejected");
            }
        }
        if let Some(outcome) = &step.policy {
            m.pool_fresh_members.get_or_create(&pool_l).set(outcome.fresh as f64);
            if let Some(s) = outcome.saturation {
                m.pool_saturation.get_or_create(&pool_l).set(s);
            }
            report.saturation = outcome.saturation;
        }
        report.members = self.member_reports(snap.as_ref().ok(), &step.desired, &before, telemetry);
        // Whatever path a member left by (discovery, a failed sample, a reload), its series go
        // when it is no longer reported: the set exported is exactly the set reported.
        let reported: BTreeSet<MemberId> =
            report.members.iter().map(|r| MemberId::from(r.member.as_str())).collect();
        for gone in self.exported.difference(&reported) {
            telemetry.metrics.forget_member(&pool, gone.as_str());
        }
        self.exported = reported;

        report.push = match step.decision {
            Decision::Hold(outcome) => outcome,
            Decision::Push(ratios) => {
                let sink = self.sink.clone();
                let budget = self.push_timeout;
                self.push =
                    Some(tokio::spawn(
                        async move { tokio::time::timeout(budget, sink.apply(&ratios)).await },
                    ));
                self.settle_push(telemetry, report_by).await
            }
        };
        count_push(telemetry, &pool, self.sink.kind(), report.push);
        report
    }

    /// Count and log members that could not be read: a warning when a member starts failing (or
    /// fails differently), an info line when it is readable again; never one line per cycle. The
    /// policy treats such a member as without data: it keeps its ratio for `grace`, then gets the
    /// pool mean.
    fn member_health(&mut self, snap: &Snapshot, telemetry: &Telemetry) {
        let pool = self.cfg.name.clone();
        let mut now_failing = BTreeMap::new();
        for f in &snap.failures {
            let reason = f.reason.as_str();
            telemetry
                .metrics
                .member_errors
                .get_or_create(&labels(&[("pool", &pool), ("member", f.member.as_str()), ("reason", reason)]))
                .inc();
            if self.failing.get(&f.member) != Some(&reason) {
                tracing::warn!(pool = %pool, member = %f.member, reason, detail = %f.detail, "member cannot be read; it keeps its ratio for `grace`, then gets the pool mean");
            }
            now_failing.insert(f.member.clone(), reason);
        }
        for (m, _) in self.failing.iter().filter(|(m, _)| !now_failing.contains_key(*m)) {
            if snap.members.contains_key(m) {
                tracing::info!(pool = %pool, member = %m, "member is readable again");
            }
        }
        self.failing = now_failing;
    }

    /// One report line per member: the ratio wanted now, the last computed one, and the sample.
    fn member_reports(
        &self,
        snap: Option<&Snapshot>,
        desired: &Ratios,
        before: &Ratios,
        telemetry: &Telemetry,
    ) -> Vec<MemberReport> {
        let m = &telemetry.metrics;
        let pool = &self.cfg.name;
        let report = |member: &MemberId, s: Option<&crate::source::Sample>| {
            let ml = labels(&[("pool", pool), ("member", member.as_str())]);
            let ratio = desired.get(member).unwrap_or(0);
            m.member_ratio.get_or_create(&ml).set(f64::from(ratio));
            if let Some(s) = s {
                m.member_waiting.get_or_create(&ml).set(s.waiting);
                m.member_running.get_or_create(&ml).set(s.running);
                if let Some(kv) = s.kv_usage {
                    m.member_kv_usage.get_or_create(&ml).set(kv);
                }
                if let Some(l) = s.latency {
                    m.member_latency.get_or_create(&ml).set(l);
                }
                for (family, v) in [
                    (&m.member_service, s.service),
                    (&m.member_queue_time, s.queue_time),
                    (&m.member_token_time, s.token_time),
                    (&m.member_prompt_cached, s.prompt_cached),
                    (&m.member_slots, s.slots),
                ] {
                    if let Some(v) = v {
                        family.get_or_create(&ml).set(v);
                    }
                }
                m.member_sample_age.get_or_create(&ml).set(s.age.as_secs_f64());
            }
            MemberReport {
                member: member.to_string(),
                ratio,
                old_ratio: before.get(member),
                waiting: s.map(|s| s.waiting),
                running: s.map(|s| s.running),
                kv_usage: s.and_then(|s| s.kv_usage),
                latency_s: s.and_then(|s| s.latency),
                service_s: s.and_then(|s| s.service),
                queue_time_s: s.and_then(|s| s.queue_time),
                token_time_s: s.and_then(|s| s.token_time),
                prompt_cached: s.and_then(|s| s.prompt_cached),
                slots: s.and_then(|s| s.slots),
                age_s: s.map(|s| s.age.as_secs_f64()),
                tier: self.cycle.tier_of(member).map(str::to_string),
            }
        };
        match snap {
            Some(snap) if !snap.members.is_empty() => {
                snap.members.iter().map(|(member, s)| report(member, s.as_ref())).collect()
            }
            // No sample this cycle: the members found now, not members the ratios still remember
            // (a member that left while sampling failed would otherwise come back as a series).
            _ => desired
                .iter()
                .filter(|(m, _)| self.query.members.is_empty() || self.query.members.binary_search(m).is_ok())
                .map(|(member, _)| report(member, None))
                .collect(),
        }
    }

    /// Wait for the push in flight until `by`; if it ended, hand its result to the cycle and return
    /// the outcome, else report it as still in progress.
    async fn settle_push(&mut self, telemetry: &Telemetry, by: Instant) -> PushOutcome {
        let Some(task) = self.push.as_mut() else { return PushOutcome::Unchanged };
        let wait = by.saturating_duration_since(Instant::now());
        let joined = match tokio::time::timeout(wait, task).await {
            Err(_) => return PushOutcome::InProgress,
            Ok(joined) => joined,
        };
        self.push = None;
        let pool = self.cfg.name.clone();
        let kind = self.sink.kind();
        let failures_before = self.cycle.failures();
        let result = match joined {
            Ok(Ok(Ok(applied))) => Ok(applied),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_elapsed)) => Err(SinkError::Unreachable {
                target: format!("pool {pool:?}"),
                detail: format!("push not done within its budget of {:?} (push_timeout)", self.push_timeout),
            }),
            Err(join) => Err(SinkError::Unreachable {
                target: format!("pool {pool:?}"),
                detail: format!("push task ended: {join}"),
            }),
        };
        let now = Instant::now();
        let instances = self.sink.instances();
        for inst in &instances {
            let ok = if inst.ok { 1.0 } else { 0.0 };
            telemetry.metrics.sink_instance_ok(&pool, kind, &inst.address).set(ok);
        }
        let addresses: Vec<&str> = instances.iter().map(|i| i.address.as_str()).collect();
        telemetry.metrics.retain_sink_instances(&pool, kind, &addresses);
        match result {
            Ok(applied) => {
                // Reconciling sinks report the same warnings every cycle, and some only the first
                // time: log each warning when it appears, not again while it stays or when another
                // one comes or goes. Sinks leave the logging to this one place.
                for w in applied.warnings.iter().filter(|w| !self.last_warnings.contains(w)) {
                    tracing::warn!(pool = %pool, sink = kind, "{w}");
                }
                self.last_warnings = applied.warnings.clone();
                if failures_before > 0 {
                    tracing::info!(pool = %pool, sink = kind, "sink recovered");
                }
                if applied.changed > 0 && self.sink.reaches_lb() {
                    telemetry
                        .metrics
                        .pool_counter(PoolCounter::SinkWrites, &pool, &[("sink", kind)])
                        .inc_by(applied.changed as u64);
                }
                let outcome = self.cycle.pushed(PushResult::Applied { changed: applied.changed }, now);
                if outcome == PushOutcome::Pushed {
                    tracing::info!(pool = %pool, sink = kind, changed = applied.changed, "pushed ratios");
                }
                outcome
            }
            Err(e) => {
                let outcome = self.cycle.pushed(PushResult::Failed { retryable: e.retryable() }, now);
                let retry_in_s = self.cycle.retry_wait().unwrap_or_default().as_secs_f64();
                let attempt = self.cycle.failures();
                if !e.retryable() || attempt == 1 {
                    tracing::error!(pool = %pool, sink = kind, error = %e, retry_in_s, "push failed");
                } else {
                    tracing::warn!(pool = %pool, sink = kind, error = %e, retry_in_s, attempt, "push failed again");
                }
                outcome
            }
        }
    }
}

fn count_push(telemetry: &Telemetry, pool: &str, sink: &str, outcome: PushOutcome) {
    telemetry
        .metrics
        .pool_counter(PoolCounter::Pushes, pool, &[("sink", sink), ("outcome", outcome.as_str())])
        .inc();
}

fn log_state_change(
    pool: &str,
    _old: crate::cycle::PoolState,
    new: crate::cycle::PoolState,
    detail: Option<&str>,
) {
    use crate::cycle::PoolState;
    match new {
        PoolState::Ok => tracing::info!(pool = %pool, "pool has fresh data again; computing ratios"),
        PoolState::SourceDown => tracing::warn!(
            pool = %pool,
            error = detail.unwrap_or(""),
            "source failed; load balancer keeps its last ratios (fail-static)"
        ),
        PoolState::Stale => tracing::warn!(
            pool = %pool,
            "no member has fresh samples; load balancer keeps its last ratios (fail-static)"
        ),
        PoolState::Starting => {}
    }
}

/// Sample one source for its pools, giving up after `deadline` (a named function rather than an
/// async closure, so the cycle's future stays `Send` for `tokio::spawn`).
async fn sample_within(
    name: &str,
    source: &Source,
    queries: Vec<&PoolQuery>,
    deadline: Duration,
) -> Vec<Result<Snapshot, SourceError>> {
    // Members' own reads stop a tenth early, so a slow one is its own failure and the rest of the
    // sample still arrives before the deadline cuts everything.
    let budget = deadline.saturating_sub(deadline / 10);
    match tokio::time::timeout(deadline, source.sample_within(&queries, Some(budget))).await {
        Ok(r) => r,
        Err(_) => queries
            .iter()
            .map(|_| {
                Err(SourceError::Unreachable {
                    what: format!("source {name:?}"),
                    detail: format!("no answer within the cycle interval ({deadline:?})"),
                })
            })
            .collect(),
    }
}

/// The one door for discovered names (Prometheus labels, EndpointSlices, the LB's own pool): those
/// that are not member names ([`llm_lc_adapters::name::check`]) are left out of this refresh,
/// counted (`member_errors_total{reason="invalid_name"}`, without the name) and logged, escaped,
/// once while they keep coming (`warned`: the names refused last refresh). Returns the admitted
/// members and the names refused now.
pub fn admit(
    pool: &str,
    found: Vec<MemberId>,
    telemetry: &Telemetry,
    warned: &std::collections::BTreeSet<String>,
) -> (Vec<MemberId>, std::collections::BTreeSet<String>) {
    let mut refused = std::collections::BTreeSet::new();
    let admitted = found
        .into_iter()
        .filter(|m| match llm_lc_adapters::name::check(m.as_str()) {
            Ok(()) => true,
            Err(why) => {
                let shown = m.to_string();
                if !warned.contains(&shown) {
                    tracing::warn!(pool, name = %shown, error = %why, "discovery offered a name that is not a member name; left out");
                }
                telemetry
                    .metrics
                    .member_errors
                    .get_or_create(&labels(&[("pool", pool), ("reason", FailureReason::InvalidName.as_str())]))
                    .inc();
                refused.insert(shown);
                false
            }
        })
        .collect();
    (admitted, refused)
}

/// A pool's members in member order, each once: the order the snapshot, the policy and the ratios
/// keep, so a cycle walks them side by side instead of looking members up.
fn sorted(mut members: Vec<MemberId>) -> Vec<MemberId> {
    members.sort();
    members.dedup();
    members
}

/// Members of `old` not in `new`, and of `new` not in `old`; both sorted. One walk of each.
fn difference<'a>(old: &'a [MemberId], new: &'a [MemberId]) -> (Vec<&'a MemberId>, Vec<&'a MemberId>) {
    let (mut gone, mut joined) = (Vec::new(), Vec::new());
    let (mut o, mut n) = (old.iter().peekable(), new.iter().peekable());
    loop {
        match (o.peek(), n.peek()) {
            (Some(a), Some(b)) if a < b => gone.extend(o.next()),
            (Some(a), Some(b)) if a > b => joined.extend(n.next()),
            (Some(_), Some(_)) => {
                o.next();
                n.next();
            }
            (Some(_), None) => gone.extend(o.next()),
            (None, Some(_)) => joined.extend(n.next()),
            (None, None) => return (gone, joined),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(s: &[&str]) -> Vec<MemberId> {
        s.iter().map(|m| MemberId::from(*m)).collect()
    }

    #[test]
    fn members_are_kept_sorted_and_once() {
        assert_eq!(sorted(ids(&["b:1", "a:1", "b:1"])), ids(&["a:1", "b:1"]));
    }

    #[test]
    fn difference_names_who_left_and_who_joined() {
        let (old, new) = (ids(&["a:1", "b:1", "d:1"]), ids(&["b:1", "c:1", "e:1"]));
        let (gone, joined) = difference(&old, &new);
        assert_eq!(gone.iter().map(|m| m.as_str()).collect::<Vec<_>>(), ["a:1", "d:1"]);
        assert_eq!(joined.iter().map(|m| m.as_str()).collect::<Vec<_>>(), ["c:1", "e:1"]);
        let (gone, joined) = difference(&old, &old);
        assert!(gone.is_empty() && joined.is_empty());
    }
}
