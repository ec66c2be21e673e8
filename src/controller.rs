//! The control loop: every interval, sample each pool, compute ratios, make each load balancer agree.
//!
//! It is a reconcile loop, not a fire-and-forget pusher: each cycle compares the desired ratios with
//! what the load balancer holds now (where the sink can read it) and corrects drift. The rules that
//! keep it safe when things break:
//! - Pools run concurrently and each within a deadline of one interval, so one pool's hung source or
//!   sink never holds up the others.
//! - Fail-static: when a pool's source is down or all its samples are stale, nothing is pushed (the LB
//!   keeps its last ratios); after `reset_after`, `on_stale: equal` pushes equal ratios instead.
//! - A set of ratios that would leave no member able to take traffic is never pushed.
//! - A failing sink is retried with exponential backoff and jitter; the loop itself never stops.
//! - State changes (source down, back up, stale) are logged once, not every cycle.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use llm_lc_adapters::{build_sink, RatioSink, Ratios, SinkConfig, SinkContext, SinkError};
use rand::Rng;

use crate::config::{Config, OnStale, PoolConfig};
use crate::policy::PoolPolicy;
use crate::report::{now_rfc3339, CycleReport, MemberReport, PoolReport};
use crate::source::{Join, PoolQuery, Snapshot, Source, SourceError};
use crate::telemetry::{labels, Telemetry};

/// Sinks that cannot read the LB back (webhook) are re-sent the full set this often even when
/// nothing changed, so a restarted receiver catches up.
const RESYNC_EVERY: Duration = Duration::from_secs(60);
/// Longest wait between retries of a failing sink.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PoolState {
    Starting,
    Ok,
    SourceDown,
    Stale,
}

impl PoolState {
    fn as_str(self) -> &'static str {
        match self {
            PoolState::Starting | PoolState::Ok => "ok",
            PoolState::SourceDown => "source_down",
            PoolState::Stale => "stale",
        }
    }
}

struct PoolRuntime {
    cfg: PoolConfig,
    query: PoolQuery,
    policy: PoolPolicy,
    sink: Box<dyn RatioSink>,
    /// The ratios computed last cycle: the policy's "previous" (what it asked the LB to hold).
    last_computed: Ratios,
    last_pushed: Option<(Ratios, Instant)>,
    /// Warnings of the last successful push, so repeats are not logged every cycle.
    last_warnings: Vec<String>,
    retry_at: Option<Instant>,
    failures: u32,
    state: PoolState,
    unhealthy_since: Option<Instant>,
    // --- leader election (src/leader.rs) ---
    /// "This replica leads"; `None` means always (no election).
    leader: Option<tokio::sync::watch::Receiver<bool>>,
    /// Whether pushing changes something outside this process (F5, HAProxy runtime API, webhook,
    /// Envoy file). Sinks that are *served* from this process (Envoy xDS, HAProxy agent) and dry-run
    /// keep working on followers: whoever answers has the same ratios.
    needs_leader: bool,
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
}

impl Controller {
    /// Build from a validated config. With `dry_run`, every pool's sink is replaced by the dry-run sink:
    /// nothing is pushed anywhere, whatever the config says.
    pub fn new(
        cfg: &Config,
        telemetry: Arc<Telemetry>,
        dry_run: bool,
        ctx: &SinkContext,
    ) -> Result<Self, BuildError> {
        let mut sources = BTreeMap::new();
        for (name, s) in &cfg.sources {
            sources
                .insert(name.clone(), Source::new(name, s).map_err(|e| BuildError::Source(name.clone(), e))?);
        }
        let mut pools = Vec::new();
        for p in &cfg.pools {
            let rate_window = match cfg.sources.get(&p.source) {
                Some(crate::config::SourceConfig::Prometheus(pc)) => pc.rate_window,
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
            let sink_cfg = if dry_run { SinkConfig::DryRun } else { p.sink.clone() };
            let sink =
                build_sink(&sink_cfg, &p.name, ctx).map_err(|e| BuildError::Sink(p.name.clone(), e))?;
            pools.push(PoolRuntime {
                query: PoolQuery {
                    members: p.members.static_list.clone().unwrap_or_default(),
                    names,
                    queries,
                    join,
                },
                policy: PoolPolicy::new(&p.policy, p.ratio, p.stale_after, p.grace, cfg.interval),
                sink,
                cfg: p.clone(),
                last_computed: Ratios::default(),
                last_pushed: None,
                last_warnings: Vec::new(),
                retry_at: None,
                failures: 0,
                state: PoolState::Starting,
                unhealthy_since: None,
                leader: None,
                needs_leader: pushes_outside(&sink_cfg),
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

    /// The ratios each pool computed last, by pool name (to carry over into a reloaded controller).
    pub fn computed_ratios(&self) -> BTreeMap<String, Ratios> {
        self.pools.iter().map(|p| (p.cfg.name.clone(), p.last_computed.clone())).collect()
    }

    /// Start pools from ratios a previous controller computed, so a config reload does not reset them
    /// to the middle of the range. Pools not in `by_pool` start fresh.
    pub fn seed_ratios(&mut self, by_pool: &BTreeMap<String, Ratios>) {
        for p in &mut self.pools {
            if let Some(r) = by_pool.get(&p.cfg.name) {
                p.last_computed = r.clone();
            }
        }
    }

    /// Run one cycle: returns the report and whether every pool computed ratios from fresh data.
    pub async fn cycle(&mut self) -> (CycleReport, bool) {
        let started = Instant::now();
        let ts = now_rfc3339();
        let metrics = &self.telemetry.metrics;

        // 1. Membership, for pools that discover it.
        let sources = &self.sources;
        // Futures are built in loops, not closures: a closure returning a borrowing future makes the
        // cycle's future !Send (rustc #64552), and the demo spawns the controller.
        let telemetry = &self.telemetry;
        let mut refreshes = Vec::with_capacity(self.pools.len());
        for p in self.pools.iter_mut() {
            refreshes.push(p.refresh_members(sources, telemetry));
        }
        join_all(refreshes).await;

        // 2. Samples: each source once, for all of its pools.
        let mut snapshots: Vec<Option<Result<Snapshot, SourceError>>> =
            (0..self.pools.len()).map(|_| None).collect();
        let mut by_source: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, p) in self.pools.iter().enumerate() {
            by_source.entry(p.cfg.source.as_str()).or_default().push(i);
        }
        let deadline = self.interval;
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

        // 3. Policy and push, every pool concurrently, each within one interval.
        let mut cycles = Vec::with_capacity(self.pools.len());
        for (p, snap) in self.pools.iter_mut().zip(snapshots) {
            let snap = snap.unwrap_or_else(|| Err(SourceError::Config("pool has no source".into())));
            cycles.push(p.cycle(snap, telemetry, deadline));
        }
        let reports = join_all(cycles).await;

        let good_pools = reports.iter().filter(|r| r.state == "ok").count();
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

    /// Release what sinks hold on load balancers (login tokens), each within a short deadline.
    pub async fn shutdown(&self) {
        join_all(self.pools.iter().map(|p| tokio::time::timeout(Duration::from_secs(5), p.sink.shutdown())))
            .await;
    }
}

impl PoolRuntime {
    async fn refresh_members(&mut self, sources: &BTreeMap<String, Source>, telemetry: &Telemetry) {
        let found = if let Some(sel) = &self.cfg.members.prometheus_up {
            match sources.get(&self.cfg.source) {
                Some(src) => src.discover(sel, &self.query.join).await.map(Some),
                None => Ok(None),
            }
        } else if self.cfg.members.from_lb {
            self.sink.members().await.map_err(|e| SourceError::Unreachable {
                what: format!("{} sink of pool {:?}", self.sink.kind(), self.cfg.name),
                detail: e.to_string(),
            })
        } else {
            Ok(None)
        };
        match found {
            Ok(Some(members)) => {
                for gone in self.query.members.iter().filter(|m| !members.contains(m)) {
                    tracing::info!(pool = %self.cfg.name, member = %gone, "member left the pool");
                    telemetry.metrics.forget_member(&self.cfg.name, gone.as_str());
                }
                for new in members.iter().filter(|m| !self.query.members.contains(m)) {
                    tracing::info!(pool = %self.cfg.name, member = %new, "member joined the pool");
                }
                self.query.members = members;
            }
            Ok(None) => {}
            // Keep the last known members: a discovery hiccup must not empty the pool.
            Err(e) => {
                tracing::warn!(pool = %self.cfg.name, error = %e, "member discovery failed; keeping the last known members")
            }
        }
    }

    fn set_state(&mut self, state: PoolState, detail: Option<&str>) {
        if state == self.state {
            return;
        }
        let pool = &self.cfg.name;
        match state {
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
        if state == PoolState::Ok {
            self.unhealthy_since = None;
        } else if self.unhealthy_since.is_none() {
            self.unhealthy_since = Some(Instant::now());
        }
        self.state = state;
    }

    async fn cycle(
        &mut self,
        snap: Result<Snapshot, SourceError>,
        telemetry: &Telemetry,
        deadline: Duration,
    ) -> PoolReport {
        let m = &telemetry.metrics;
        let pool = self.cfg.name.clone();
        let mut report = PoolReport {
            pool: pool.clone(),
            policy: self.cfg.policy.name(),
            sink: self.sink.kind(),
            ..Default::default()
        };
        let pool_l = labels(&[("pool", &pool)]);

        let snap = match snap {
            Ok(s) => s,
            Err(e) => {
                let msg = e.to_string();
                self.set_state(PoolState::SourceDown, Some(&msg));
                report.error = Some(msg);
                return self.fail_static(report, telemetry, deadline).await;
            }
        };
        for r in &snap.rejected {
            m.samples_rejected
                .get_or_create(&labels(&[
                    ("pool", &pool),
                    ("signal", r.signal.as_str()),
                    ("reason", r.reason),
                ]))
                .inc();
            tracing::debug!(pool = %pool, member = %r.member, signal = r.signal.as_str(), value = r.value, reason = r.reason, "sample rejected");
        }
        let outcome = self.policy.compute(&snap, &self.last_computed);
        m.pool_fresh_members.get_or_create(&pool_l).set(outcome.fresh as f64);
        if let Some(s) = outcome.saturation {
            m.pool_saturation.get_or_create(&pool_l).set(s);
        }
        report.saturation = outcome.saturation;
        report.members = snap
            .members
            .iter()
            .map(|(member, s)| {
                let ml = labels(&[("pool", &pool), ("member", member.as_str())]);
                let ratio = outcome.ratios.get(member).unwrap_or(0);
                m.member_ratio.get_or_create(&ml).set(ratio as f64);
                if let Some(s) = s {
                    m.member_waiting.get_or_create(&ml).set(s.waiting);
                    m.member_running.get_or_create(&ml).set(s.running);
                    if let Some(kv) = s.kv_usage {
                        m.member_kv_usage.get_or_create(&ml).set(kv);
                    }
                    if let Some(l) = s.latency {
                        m.member_latency.get_or_create(&ml).set(l);
                    }
                    m.member_sample_age.get_or_create(&ml).set(s.age.as_secs_f64());
                }
                MemberReport {
                    member: member.to_string(),
                    ratio,
                    old_ratio: self.last_computed.get(member),
                    waiting: s.as_ref().map(|s| s.waiting),
                    running: s.as_ref().map(|s| s.running),
                    kv_usage: s.as_ref().and_then(|s| s.kv_usage),
                    latency_s: s.as_ref().and_then(|s| s.latency),
                    age_s: s.as_ref().map(|s| s.age.as_secs_f64()),
                }
            })
            .collect();

        if outcome.fresh == 0 {
            m.pool_up.get_or_create(&pool_l).set(0.0);
            self.set_state(PoolState::Stale, None);
            return self.fail_static(report, telemetry, deadline).await;
        }
        m.pool_up.get_or_create(&pool_l).set(1.0);
        self.set_state(PoolState::Ok, None);
        self.last_computed = outcome.ratios.clone();
        report.state = PoolState::Ok.as_str();
        report.push = self.push(&outcome.ratios, telemetry, deadline).await;
        report
    }

    /// Source down or all data stale: push nothing, unless the pool has been blind for `reset_after`
    /// and the user asked for equal ratios then.
    async fn fail_static(
        &mut self,
        mut report: PoolReport,
        telemetry: &Telemetry,
        deadline: Duration,
    ) -> PoolReport {
        telemetry.metrics.pool_up.get_or_create(&labels(&[("pool", &self.cfg.name)])).set(0.0);
        report.state = self.state.as_str();
        let blind_for = self.unhealthy_since.map(|t| t.elapsed()).unwrap_or_default();
        if self.cfg.on_stale == OnStale::Equal
            && blind_for >= self.cfg.reset_after
            && !self.query.members.is_empty()
        {
            let equal = self.cfg.ratio.clamp(self.cfg.ratio.mid());
            let ratios: Ratios = self.query.members.iter().map(|m| (m.clone(), equal)).collect();
            for mr in &mut report.members {
                mr.ratio = equal;
            }
            if report.members.is_empty() {
                report.members = ratios
                    .iter()
                    .map(|(m, r)| MemberReport { member: m.to_string(), ratio: r, ..Default::default() })
                    .collect();
            }
            self.last_computed = ratios.clone();
            report.push = self.push(&ratios, telemetry, deadline).await;
        } else {
            for mr in &mut report.members {
                mr.ratio = mr.old_ratio.unwrap_or(mr.ratio);
            }
            report.push = "held";
            telemetry
                .metrics
                .pushes
                .get_or_create(&labels(&[
                    ("pool", &self.cfg.name),
                    ("sink", self.sink.kind()),
                    ("outcome", "held"),
                ]))
                .inc();
        }
        report
    }

    /// Make the LB hold `desired`, unless that would drain everything or the sink is backing off.
    async fn push(&mut self, desired: &Ratios, telemetry: &Telemetry, deadline: Duration) -> &'static str {
        let outcome = self.push_inner(desired, deadline).await;
        telemetry
            .metrics
            .pushes
            .get_or_create(&labels(&[
                ("pool", &self.cfg.name),
                ("sink", self.sink.kind()),
                ("outcome", outcome),
            ]))
            .inc();
        outcome
    }

    async fn push_inner(&mut self, desired: &Ratios, deadline: Duration) -> &'static str {
        let pool = self.cfg.name.clone();
        if desired.is_empty() {
            return "unchanged";
        }
        if desired.drains_everything() {
            tracing::error!(pool = %pool, "refusing to push ratios that leave no member able to take traffic");
            return "refused_drain";
        }
        if !self.may_push() {
            return "follower";
        }
        if let Some(at) = self.retry_at {
            if Instant::now() < at {
                return "backoff";
            }
        }
        // Sinks that reconcile read the LB inside `apply` and write only drift, so they are called every
        // cycle; the others are pushed on change and re-sent now and then in case the receiver lost it.
        if !self.sink.reconciles()
            && self.last_pushed.as_ref().is_some_and(|(r, at)| r == desired && at.elapsed() < RESYNC_EVERY)
        {
            return "unchanged";
        }
        match tokio::time::timeout(deadline, self.sink.apply(desired)).await {
            Ok(Ok(applied)) => {
                // Reconciling sinks report the same warnings every cycle; log them when they change.
                if applied.warnings != self.last_warnings {
                    for w in &applied.warnings {
                        tracing::warn!(pool = %pool, sink = self.sink.kind(), "{w}");
                    }
                    self.last_warnings = applied.warnings.clone();
                }
                if self.failures > 0 {
                    tracing::info!(pool = %pool, sink = self.sink.kind(), "sink recovered");
                }
                self.failures = 0;
                self.retry_at = None;
                self.last_pushed = Some((desired.clone(), Instant::now()));
                if self.sink.kind() == "dry-run" {
                    "dry_run"
                } else if applied.changed == 0 {
                    "unchanged"
                } else {
                    tracing::info!(pool = %pool, sink = self.sink.kind(), changed = applied.changed, "pushed ratios");
                    "pushed"
                }
            }
            Ok(Err(e)) => self.failed(e),
            Err(_) => self.failed(timeout_err(&pool, deadline)),
        }
    }

    fn may_push(&self) -> bool {
        !self.needs_leader || self.leader.as_ref().is_none_or(|l| *l.borrow())
    }

    /// Log, then back off exponentially with jitter: 1, 2, 4 ... intervals' worth of seconds, capped.
    fn failed(&mut self, e: SinkError) -> &'static str {
        self.failures += 1;
        let base = Duration::from_secs(1) * 2u32.saturating_pow(self.failures.saturating_sub(1).min(6));
        let wait = base.min(MAX_BACKOFF).mul_f64(rand::thread_rng().gen_range(0.8..1.2));
        self.retry_at = Some(Instant::now() + wait);
        let level_error = !e.retryable() || self.failures == 1;
        if level_error {
            tracing::error!(pool = %self.cfg.name, sink = self.sink.kind(), error = %e, retry_in_s = wait.as_secs_f64(), "push failed");
        } else {
            tracing::warn!(pool = %self.cfg.name, sink = self.sink.kind(), error = %e, retry_in_s = wait.as_secs_f64(), attempt = self.failures, "push failed again");
        }
        "error"
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
    match tokio::time::timeout(deadline, source.sample(&queries)).await {
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

/// Whether a sink changes state outside this process (and so must be left to the leader).
fn pushes_outside(sink: &SinkConfig) -> bool {
    use llm_lc_adapters::envoy::EnvoyMode;
    use llm_lc_adapters::haproxy::HaproxyMode;
    match sink {
        SinkConfig::DryRun => false,
        SinkConfig::Envoy(e) => e.mode != EnvoyMode::Xds,
        SinkConfig::Haproxy(h) => h.mode != HaproxyMode::Agent,
        SinkConfig::F5(_) | SinkConfig::Webhook(_) => true,
    }
}

fn timeout_err(pool: &str, d: Duration) -> SinkError {
    SinkError::Unreachable { target: format!("pool {pool:?}"), detail: format!("no answer within {d:?}") }
}

/// How each cycle is printed on stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// A table per pool per cycle.
    Text,
    /// One JSON object per cycle, on one line.
    Json,
    /// Nothing on stdout (logs still go to stderr).
    Quiet,
}

/// Run cycles on the interval until `shutdown` resolves (or once, with `once`). Returns whether the
/// last cycle computed ratios for every pool. A cycle in flight when `shutdown` fires is abandoned:
/// sinks apply changes atomically or not at all, so nothing half-done is left behind.
pub async fn run(
    mut controller: Controller,
    output: Output,
    once: bool,
    shutdown: impl std::future::Future<Output = ()>,
) -> bool {
    let mut ticker = tokio::time::interval(controller.interval());
    // A slow cycle delays the next one instead of firing a burst to catch up.
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let mut last_ok = true;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = ticker.tick() => {}
        }
        let (report, ok) = tokio::select! {
            _ = &mut shutdown => break,
            r = controller.cycle() => r,
        };
        last_ok = ok;
        match output {
            Output::Text => println!("{}", report.to_table()),
            Output::Json => println!("{}", report.to_json_line()),
            Output::Quiet => {}
        }
        if once {
            break;
        }
    }
    controller.shutdown().await;
    last_ok
}
