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
//!
//! By job: [`members`] (discovery and the one door for names), [`sampling`] (each source within
//! the deadline), [`push`] (the push task and its settling), [`report`] (member lines, gauges,
//! state changes); this file builds the pools and runs one cycle of each.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use llm_lc_adapters::{build_sink, Applied, MemberId, RatioSink, Ratios, SinkConfig, SinkContext, SinkError};
use tokio::task::JoinHandle;

use crate::config::{Config, PoolConfig, SourceConfig};
use crate::cycle::{Cycle, CycleSettings, Decision, Sampled};
use crate::policy::PoolPolicy;
use crate::report::{now_rfc3339, CycleReport, PoolReport};
use crate::source::{Join, PoolQuery, Snapshot, Source, SourceError};
use crate::telemetry::{labels, PoolCounter, Telemetry};

pub mod members;
pub mod push;
pub mod report;
pub mod sampling;

pub use members::admit;
use members::sorted;
use push::count_push;
use report::log_state_change;
use sampling::sample_within;

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
}
