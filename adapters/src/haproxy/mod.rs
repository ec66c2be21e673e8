//! HAProxy sink: keeps a backend's server weights equal to the pool's ratios.
//!
//! Two ways to reach HAProxy, chosen by `mode`:
//! - `runtime-api` (default): each `apply` reads `show servers state BACKEND` over the runtime API,
//!   maps members to servers, and pushes only the weights that differ, chained with `;` in one more
//!   connection. Because every cycle starts from what HAProxy has now, weights lost to a reload or
//!   restart are restored on the next cycle without special handling. Needs `stats socket ... level
//!   admin` (reads alone work at `level user`).
//! - `agent`: the controller answers HAProxy's `agent-check` (see [`agent`]); HAProxy pulls. No admin
//!   socket needed. If `address` is also given, `members()`/`current()` read from the runtime API.
//!
//! Ratios map to weights 1..=256 as [`weights`] describes; weight 0 (drain) only with `allow_drain`, and
//! never on every server of the backend at once.
//!
//! Several HAProxy instances serving the same backend (router replicas, an HA pair) are listed in
//! `addresses`: each is read and weighted on its own, concurrently, so one that is down or slow does
//! not block the others; the cycle succeeds when at least one instance took the weights, and each
//! instance's outcome is kept ([`HaproxySink::instance_outcomes`]) and named in the warnings.
//! The sink holds no retry state: every `apply` tries every instance, so an instance that is back
//! is weighted on the next cycle.
//!
//! ```yaml
//! sink:
//!   kind: haproxy
//!   address: unix:/var/run/haproxy/admin.sock   # or 127.0.0.1:9999
//!   # addresses: [10.0.0.5:9999, 10.0.0.6:9999] # several instances of the same backend
//!   backend: llm
//! ```

pub mod agent;
pub mod plan;
pub mod runtime;
pub mod state;
pub mod weights;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::join_all;
use serde::Deserialize;

pub use agent::{AgentHandle, AgentResponder};
pub use plan::MatchBy;
pub use runtime::{RuntimeAddr, RuntimeClient};

use crate::{Applied, MemberId, RatioSink, Ratios, SinkError};
use weights::{WeightMap, HAPROXY_MAX_WEIGHT};

/// How the weights reach HAProxy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HaproxyMode {
    /// Push with `set server ... weight` over the runtime API.
    #[default]
    RuntimeApi,
    /// Answer HAProxy's `agent-check` on `agent_listen`.
    Agent,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HaproxyConfig {
    #[serde(default)]
    pub mode: HaproxyMode,
    /// Runtime API address: `unix:/path/to/socket` or `host:port`. Required in `runtime-api` mode;
    /// optional in `agent` mode (then used only to read membership and weights).
    #[serde(default)]
    pub address: Option<String>,
    /// More runtime API addresses, one per HAProxy instance serving the same backend; each instance
    /// gets the weights. May be used instead of, or next to, `address`.
    #[serde(default)]
    pub addresses: Vec<String>,
    /// Backend whose servers get the weights.
    pub backend: String,
    /// How members find their server: `address` (default) or `name`.
    #[serde(default)]
    pub match_by: MatchBy,
    /// Limit on each runtime API exchange (connect, write, read).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Let ratio 0 become weight 0 (no new traffic). Off: ratio 0 becomes weight 1.
    #[serde(default)]
    pub allow_drain: bool,
    /// The ratio that maps to `max_weight`; ratios scale proportionally. Unset: weight = ratio, clamped.
    #[serde(default)]
    pub ratio_max: Option<u32>,
    /// Largest weight pushed, 1..=256.
    #[serde(default = "default_max_weight")]
    pub max_weight: u32,
    /// `agent` mode: where the agent-check responder listens, e.g. `0.0.0.0:5555`.
    #[serde(default)]
    pub agent_listen: Option<String>,
}

fn default_timeout() -> Duration {
    Duration::from_secs(2)
}

fn default_max_weight() -> u32 {
    HAPROXY_MAX_WEIGHT
}

impl HaproxyConfig {
    /// Runtime-API mode with defaults for everything else.
    pub fn runtime(address: impl Into<String>, backend: impl Into<String>) -> Self {
        HaproxyConfig {
            mode: HaproxyMode::RuntimeApi,
            address: Some(address.into()),
            addresses: Vec::new(),
            backend: backend.into(),
            match_by: MatchBy::default(),
            timeout: default_timeout(),
            allow_drain: false,
            ratio_max: None,
            max_weight: default_max_weight(),
            agent_listen: None,
        }
    }

    /// Agent mode listening on `listen`, with defaults for everything else.
    pub fn agent(listen: impl Into<String>, backend: impl Into<String>) -> Self {
        HaproxyConfig {
            mode: HaproxyMode::Agent,
            address: None,
            agent_listen: Some(listen.into()),
            ..Self::runtime("", backend)
        }
    }

    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        let mut err = |f: &str, m: String| errs.push((f.to_string(), m));
        if self.backend.is_empty() {
            err("backend", "required: the HAProxy backend whose servers get the weights".into());
        } else if !runtime::valid_name(&self.backend) {
            err(
                "backend",
                format!("`{}`: HAProxy names hold only letters, digits, '-', '_', '.', ':'", self.backend),
            );
        }
        let mut seen = BTreeSet::new();
        for (i, a) in self.addresses.iter().enumerate() {
            match RuntimeAddr::parse(a) {
                Ok(parsed) => {
                    if !seen.insert(parsed.to_string()) {
                        err(&format!("addresses[{i}]"), format!("`{a}` is listed twice"));
                    }
                }
                Err(e) => err(&format!("addresses[{i}]"), e),
            }
        }
        match (&self.address, self.mode) {
            (Some(a), _) => match RuntimeAddr::parse(a) {
                Ok(parsed) => {
                    if seen.contains(&parsed.to_string()) {
                        err("address", format!("`{a}` is also in `addresses`"));
                    }
                }
                Err(e) => err("address", e),
            },
            (None, _) if !self.addresses.is_empty() => {}
            (None, HaproxyMode::RuntimeApi) => err(
                "address",
                "required with mode runtime-api: `unix:/var/run/haproxy/admin.sock` or `127.0.0.1:9999`, matching \
                 a `stats socket ... level admin` line in haproxy.cfg (or use `mode: agent`)"
                    .into(),
            ),
            (None, HaproxyMode::Agent) => {}
        }
        match (&self.agent_listen, self.mode) {
            (Some(l), HaproxyMode::Agent) => {
                if l.parse::<SocketAddr>().is_err() {
                    err("agent_listen", format!("`{l}` is not an IP:port to listen on, e.g. `0.0.0.0:5555`"));
                }
            }
            (None, HaproxyMode::Agent) => err(
                "agent_listen",
                "required with mode agent: the IP:port HAProxy's agent-check connects to, e.g. `0.0.0.0:5555`".into(),
            ),
            (Some(_), HaproxyMode::RuntimeApi) => {
                err("agent_listen", "only used with `mode: agent`; remove it or set the mode".into())
            }
            (None, HaproxyMode::RuntimeApi) => {}
        }
        if self.timeout.is_zero() {
            err("timeout", "must be > 0, e.g. `2s`".into());
        }
        if !(1..=HAPROXY_MAX_WEIGHT).contains(&self.max_weight) {
            err("max_weight", format!("{} is outside HAProxy's weights 1..=256", self.max_weight));
        }
        if self.ratio_max == Some(0) {
            err("ratio_max", "must be > 0: the ratio that maps to `max_weight`".into());
        }
        errs
    }

    /// Every runtime API address: `address` first, then `addresses`.
    pub fn runtime_addresses(&self) -> impl Iterator<Item = &String> {
        self.address.iter().chain(&self.addresses)
    }

    fn weight_map(&self) -> WeightMap {
        WeightMap { ratio_max: self.ratio_max, max_weight: self.max_weight, allow_drain: self.allow_drain }
    }
}

/// The HAProxy sink for one pool. See the module docs.
pub struct HaproxySink {
    backend: String,
    pool: String,
    match_by: MatchBy,
    map: WeightMap,
    /// One client per HAProxy instance (empty in agent mode without addresses).
    runtimes: Vec<RuntimeClient>,
    /// Per instance, what the last `apply` did there.
    outcomes: Mutex<Vec<InstanceOutcome>>,
    agent: Option<AgentHandle>,
    /// Per member, the ratio last applied and the weight it became. `current()` reports that ratio
    /// while HAProxy still holds that weight, so the controller's "LB already has desired" check is
    /// exact even where the mapping is lossy (clamping, scaling, ratio 0 -> weight 1, names).
    last: Mutex<BTreeMap<MemberId, (u32, u32)>>,
}

impl HaproxySink {
    /// Check the config and, in agent mode, start listening (so call it inside the tokio runtime).
    pub fn new(cfg: &HaproxyConfig, pool: &str) -> Result<Self, SinkError> {
        let problems = cfg.validate();
        if !problems.is_empty() {
            let list: Vec<String> = problems.iter().map(|(f, m)| format!("{f}: {m}")).collect();
            return Err(SinkError::Config(format!("haproxy sink of pool {pool}: {}", list.join("; "))));
        }
        let runtimes = cfg
            .runtime_addresses()
            .map(|a| Ok(RuntimeClient::new(RuntimeAddr::parse(a).map_err(SinkError::Config)?, cfg.timeout)))
            .collect::<Result<Vec<_>, SinkError>>()?;
        let agent = match (cfg.mode, &cfg.agent_listen) {
            (HaproxyMode::Agent, Some(listen)) => Some(bind_agent(listen, pool)?),
            _ => None,
        };
        Ok(HaproxySink {
            backend: cfg.backend.clone(),
            pool: pool.to_string(),
            match_by: cfg.match_by,
            map: cfg.weight_map(),
            runtimes,
            outcomes: Mutex::default(),
            agent,
            last: Mutex::default(),
        })
    }

    fn remember(&self, applied: BTreeMap<MemberId, (u32, u32)>) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = applied;
    }

    /// Where the agent-check responder listens (agent mode), with the real port when `:0` was asked.
    pub fn agent_addr(&self) -> Option<SocketAddr> {
        self.agent.as_ref().map(|a| a.local_addr())
    }

    /// The first runtime API client, when an address is configured.
    pub fn runtime(&self) -> Option<&RuntimeClient> {
        self.runtimes.first()
    }

    /// One runtime API client per configured HAProxy instance.
    pub fn runtimes(&self) -> &[RuntimeClient] {
        &self.runtimes
    }

    /// What the last `apply` did on each HAProxy instance, in configuration order (empty before the
    /// first `apply`, and in agent mode).
    pub fn instance_outcomes(&self) -> Vec<InstanceOutcome> {
        self.outcomes.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn target(&self) -> String {
        match self.runtimes.as_slice() {
            [] => format!("haproxy backend {} (pool {})", self.backend, self.pool),
            [r] => self.target_for(r),
            many => {
                let list: Vec<String> = many.iter().map(|r| r.addr().to_string()).collect();
                format!("haproxy backend {} via {} (pool {})", self.backend, list.join(", "), self.pool)
            }
        }
    }

    fn target_for(&self, rt: &RuntimeClient) -> String {
        format!("haproxy backend {} via {} (pool {})", self.backend, rt.addr(), self.pool)
    }

    /// Re-label a runtime-client error with the backend, instance and pool it concerns.
    fn retarget(&self, rt: &RuntimeClient, e: SinkError) -> SinkError {
        let target = self.target_for(rt);
        match e {
            SinkError::Unreachable { detail, .. } => SinkError::Unreachable { target, detail },
            SinkError::Temporary { detail, .. } => SinkError::Temporary { target, detail },
            SinkError::Rejected { detail, .. } => SinkError::Rejected { target, detail },
            SinkError::Auth { detail, .. } => SinkError::Auth { target, detail },
            other => other,
        }
    }

    async fn servers(&self, rt: &RuntimeClient) -> Result<Vec<state::ServerState>, SinkError> {
        rt.servers_state(&self.backend).await.map_err(|e| self.retarget(rt, e))
    }

    /// The servers of every instance, each read concurrently; an instance's failure is its own.
    async fn servers_everywhere(&self) -> Vec<Result<Vec<state::ServerState>, SinkError>> {
        // Futures built in a loop, not a closure: closures returning borrowing futures make callers'
        // futures !Send.
        let mut reads = Vec::with_capacity(self.runtimes.len());
        for rt in &self.runtimes {
            reads.push(self.servers(rt));
        }
        join_all(reads).await
    }

    /// Read, plan and push on one instance. Returns the plan's counts and which members it found.
    async fn apply_instance(
        &self,
        rt: &RuntimeClient,
        desired: &Ratios,
    ) -> Result<(Applied, BTreeSet<MemberId>), SinkError> {
        let servers = self.servers(rt).await?;
        let plan = plan::plan(&servers, desired, &self.map, self.match_by, &self.backend)
            .map_err(|detail| SinkError::Rejected { target: self.target_for(rt), detail })?;
        if !plan.pushes.is_empty() {
            let sets: Vec<(String, u32)> = plan.pushes.iter().map(|p| (p.server.clone(), p.to)).collect();
            tracing::debug!(backend = %self.backend, instance = %rt.addr(), pushes = ?plan.pushes, "haproxy: setting weights");
            let refused = rt.set_weights(&self.backend, &sets).await.map_err(|e| self.retarget(rt, e))?;
            if !refused.is_empty() {
                return Err(self.refusal_error(rt, &plan.pushes, &refused));
            }
        }
        let index = plan::ServerIndex::new(&servers);
        let found = desired
            .iter()
            .filter(|(m, _)| !index.servers_for(m, self.match_by).is_empty())
            .map(|(m, _)| m.clone())
            .collect();
        Ok((Applied { changed: plan.changed, unchanged: plan.unchanged, warnings: plan.warnings }, found))
    }

    async fn apply_runtime(&self, desired: &Ratios) -> Result<Applied, SinkError> {
        let mut applies = Vec::with_capacity(self.runtimes.len());
        for rt in &self.runtimes {
            applies.push(self.apply_instance(rt, desired));
        }
        let results = join_all(applies).await;
        *self.outcomes.lock().unwrap_or_else(|p| p.into_inner()) = self
            .runtimes
            .iter()
            .zip(&results)
            .map(|(rt, r)| InstanceOutcome {
                address: rt.addr().to_string(),
                ok: r.is_ok(),
                changed: r.as_ref().map_or(0, |(a, _)| a.changed),
                error: r.as_ref().err().map(|e| e.to_string()),
            })
            .collect();
        let mut combined: Option<Applied> = None;
        let mut found = BTreeSet::new();
        let mut failures = Vec::new();
        for (rt, r) in self.runtimes.iter().zip(results) {
            match r {
                Ok((a, f)) => {
                    found.extend(f);
                    combined = Some(match combined.take() {
                        None => a,
                        Some(mut c) => {
                            // Members are counted once: changed where any instance changed them.
                            c.changed = c.changed.max(a.changed);
                            c.unchanged = c.unchanged.min(a.unchanged);
                            for w in a.warnings {
                                if !c.warnings.contains(&w) {
                                    c.warnings.push(w);
                                }
                            }
                            c
                        }
                    });
                }
                Err(e) => failures.push((rt, e)),
            }
        }
        let Some(mut applied) = combined else {
            // No instance took the weights: the push failed (the first error says why).
            return Err(failures
                .into_iter()
                .next()
                .map(|(_, e)| e)
                .unwrap_or_else(|| SinkError::Config(format!("{}: no runtime API address", self.target()))));
        };
        let weighted = self.runtimes.len() - failures.len();
        for (rt, e) in failures {
            applied.warnings.push(format!(
                "haproxy instance {} not weighted this cycle ({weighted} of {} instances were): {e}",
                rt.addr(),
                self.runtimes.len()
            ));
        }
        self.remember(
            desired
                .iter()
                .filter(|(m, _)| found.contains(*m))
                .map(|(m, r)| (m.clone(), (r, self.map.weight(r).weight)))
                .collect(),
        );
        Ok(applied)
    }

    /// One error for the `set` commands HAProxy refused, each with server, member and HAProxy's words.
    fn refusal_error(
        &self,
        rt: &RuntimeClient,
        pushes: &[plan::Push],
        refused: &[runtime::Refusal],
    ) -> SinkError {
        let target = self.target_for(rt);
        let items: Vec<String> = refused
            .iter()
            .map(|r| {
                let member =
                    pushes.iter().find(|p| p.server == r.server).map(|p| p.member.as_str()).unwrap_or("?");
                format!(
                    "{}/{} (member {member}) weight {}: \"{}\"{}",
                    self.backend,
                    r.server,
                    r.weight,
                    r.message,
                    hint(&r.message)
                )
            })
            .collect();
        let detail = format!(
            "HAProxy refused {} of {} weight changes: {}",
            refused.len(),
            pushes.len(),
            items.join("; ")
        );
        if refused.iter().any(|r| r.message.contains("Permission denied")) {
            SinkError::Auth { target, detail }
        } else if refused.iter().all(|r| r.message.starts_with("No such")) {
            // The state was read a moment ago, so the server vanished in between (a reload with a new
            // config): the next cycle re-reads and will not ask for it again.
            SinkError::Temporary { target, detail }
        } else {
            SinkError::Rejected { target, detail }
        }
    }

    fn apply_agent(&self, agent: &AgentHandle, desired: &Ratios) -> Result<Applied, SinkError> {
        let mut warnings = Vec::new();
        let mut percentages = Ratios::default();
        for (member, ratio) in desired.iter() {
            let mapped = self.map.weight(ratio);
            if mapped.clamped {
                warnings.push(format!(
                    "ratio {ratio} of {member} is above the largest weight {}; answering {}% (set `ratio_max` to \
                     scale ratios instead of clamping them)",
                    self.map.max_weight, mapped.weight
                ));
            }
            percentages.insert(member.clone(), mapped.weight);
        }
        // The agent cannot see servers it has no ratio for; refusing an all-zero table is the closest
        // it gets to "never drain the whole backend".
        if !percentages.is_empty() && percentages.drains_everything() {
            return Err(SinkError::Rejected {
                target: self.target(),
                detail:
                    "refusing to answer 0% for every member: HAProxy would send new requests nowhere. Keep \
                         at least one member's ratio above 0 (the agent keeps its previous answers)"
                        .into(),
            });
        }
        let changed = agent.update(&percentages);
        self.remember(desired.iter().map(|(m, r)| (m.clone(), (r, self.map.weight(r).weight))).collect());
        Ok(Applied { changed, unchanged: desired.len() - changed, warnings })
    }
}

/// What the last `apply` did on one HAProxy instance: a per-instance health signal (e.g. a gauge
/// `haproxy_instance_up{pool,instance}` and a counter of failures by instance).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceOutcome {
    /// The runtime API address, as configured (`unix:/path` or `host:port`).
    pub address: String,
    /// The weights were read and every needed change accepted.
    pub ok: bool,
    /// Members whose weight changed on this instance.
    pub changed: usize,
    /// Why not, when not ok (never contains credentials: runtime API addresses have none).
    pub error: Option<String>,
}

impl HaproxySink {
    /// Ratios one instance holds: every server as `addr:port` (weights converted back through
    /// `ratio_max`), plus every member of the last `apply` under its own id, reported as the ratio
    /// applied while its servers still have the weight it became, else their weight converted back.
    fn current_of(&self, servers: &[state::ServerState], last: &BTreeMap<MemberId, (u32, u32)>) -> Ratios {
        let mut out = BTreeMap::new();
        for s in servers {
            if let Some(id) = s.member_id() {
                out.entry(id).or_insert(self.map.ratio(s.weight));
            }
        }
        let index = plan::ServerIndex::new(servers);
        for (member, (ratio, weight)) in last {
            let found = index.servers_for(member, self.match_by);
            let Some(first) = found.first() else { continue };
            let value =
                if found.iter().all(|s| s.weight == *weight) { *ratio } else { self.map.ratio(first.weight) };
            out.insert(member.clone(), value);
        }
        out.into_iter().collect()
    }
}

fn hint(message: &str) -> &'static str {
    if message.contains("static LB algorithm") {
        " (weights of a static-rr or map-based hash backend cannot change at runtime; use `balance roundrobin` \
         or `balance leastconn`)"
    } else if message.contains("Permission denied") {
        " (the runtime API socket is not `level admin`; add `level admin` to its `stats socket` line; reads work \
         at level user, writes do not)"
    } else if message.starts_with("No such") {
        " (gone since the state was read, probably a reload; the next cycle re-reads)"
    } else {
        ""
    }
}

fn bind_agent(listen: &str, pool: &str) -> Result<AgentHandle, SinkError> {
    // Bound synchronously so that `new` reports a taken port at once, then handed to tokio.
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(SinkError::Config(format!(
            "haproxy sink of pool {pool}: agent mode must be built inside the tokio runtime (it starts a listener)"
        )));
    }
    let cannot = |e: std::io::Error| {
        SinkError::Config(format!(
            "haproxy sink of pool {pool}: cannot listen on agent_listen {listen}: {e}; pick a free port or address"
        ))
    };
    let std_listener = std::net::TcpListener::bind(listen).map_err(cannot)?;
    std_listener.set_nonblocking(true).map_err(cannot)?;
    let listener = tokio::net::TcpListener::from_std(std_listener).map_err(cannot)?;
    let (handle, local) = AgentResponder::serve(listener).map_err(cannot)?;
    tracing::info!(pool, %local, "haproxy agent-check responder listening");
    Ok(handle)
}

#[async_trait]
impl RatioSink for HaproxySink {
    fn kind(&self) -> &'static str {
        "haproxy"
    }

    fn instances(&self) -> Vec<crate::InstanceStatus> {
        if self.runtimes.len() < 2 {
            return Vec::new();
        }
        self.instance_outcomes()
            .into_iter()
            .map(|o| crate::InstanceStatus { address: o.address, ok: o.ok })
            .collect()
    }

    fn reconciles(&self) -> bool {
        true
    }

    /// The backend's servers as `addr:port`, from `show servers state`. Servers without an address yet
    /// (unresolved `server-template` slots) are left out.
    /// With several instances: the union over those that answered (an error only when none did).
    async fn members(&self) -> Result<Option<Vec<MemberId>>, SinkError> {
        if self.runtimes.is_empty() {
            return Ok(None);
        }
        let mut ids: BTreeSet<MemberId> = BTreeSet::new();
        let mut first_err = None;
        let mut any = false;
        for r in self.servers_everywhere().await {
            match r {
                Ok(servers) => {
                    any = true;
                    ids.extend(servers.iter().filter_map(|s| s.member_id()));
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match (any, first_err) {
            (false, Some(e)) => Err(e),
            _ => Ok(Some(ids.into_iter().collect())),
        }
    }

    /// Ratios HAProxy holds now: every server as `addr:port` (weights converted back through
    /// `ratio_max`), plus every member of the last `apply` under its own id, reported as the ratio
    /// applied while its servers still have the weight it became, else as their weight converted back.
    /// In agent mode without `address`: `None` (the agent cannot see what HAProxy applied).
    ///
    /// With several instances, each answering instance is read; where they disagree on a member, the
    /// value that is not the one last applied is reported, so drift on any instance shows.
    async fn current(&self) -> Result<Option<Ratios>, SinkError> {
        if self.runtimes.is_empty() {
            return Ok(None);
        }
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut out: Option<Ratios> = None;
        let mut first_err = None;
        for r in self.servers_everywhere().await {
            let servers = match r {
                Ok(s) => s,
                Err(e) => {
                    first_err.get_or_insert(e);
                    continue;
                }
            };
            let here = self.current_of(&servers, &last);
            match &mut out {
                None => out = Some(here),
                Some(acc) => {
                    for (m, v) in here.iter() {
                        match acc.get(m) {
                            None => acc.insert(m.clone(), v),
                            Some(seen) if seen != v && last.get(m).map(|l| l.0) == Some(seen) => {
                                acc.insert(m.clone(), v)
                            }
                            Some(_) => {}
                        }
                    }
                }
            }
        }
        match (out, first_err) {
            (Some(r), _) => Ok(Some(r)),
            (None, Some(e)) => Err(e),
            (None, None) => Ok(None),
        }
    }

    async fn apply(&self, desired: &Ratios) -> Result<Applied, SinkError> {
        match (&self.agent, self.runtimes.is_empty()) {
            (Some(agent), _) => self.apply_agent(agent, desired),
            (None, false) => self.apply_runtime(desired).await,
            (None, true) => Err(SinkError::Config(format!(
                "{}: neither a runtime API address nor an agent",
                self.target()
            ))),
        }
    }

    async fn shutdown(&self) {
        if let Some(agent) = &self.agent {
            agent.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: serde_json::Value) -> HaproxyConfig {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn minimal_runtime_config_needs_address_and_backend() {
        let c = parse(serde_json::json!({"address": "unix:/run/haproxy/admin.sock", "backend": "llm"}));
        assert_eq!(c.mode, HaproxyMode::RuntimeApi);
        assert_eq!(c.timeout, Duration::from_secs(2));
        assert_eq!((c.max_weight, c.allow_drain, c.match_by), (256, false, MatchBy::Address));
        assert!(c.validate().is_empty(), "{:?}", c.validate());

        let c = parse(serde_json::json!({"backend": "llm"}));
        assert_eq!(c.validate()[0].0, "address");
    }

    #[test]
    fn bad_values_name_their_field() {
        let c = parse(serde_json::json!({
            "address": "nowhere", "backend": "llm;shutdown", "timeout": "0s", "max_weight": 300, "ratio_max": 0,
            "agent_listen": "0.0.0.0:5555", "match_by": "name"
        }));
        let errs = c.validate();
        let fields: Vec<&str> = errs.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(fields, vec!["backend", "address", "agent_listen", "timeout", "max_weight", "ratio_max"]);
        assert!(
            serde_json::from_value::<HaproxyConfig>(serde_json::json!({"backend": "b", "typo": 1})).is_err()
        );
    }

    #[test]
    fn several_addresses_replace_or_join_address_and_are_checked() {
        let c =
            parse(serde_json::json!({"addresses": ["unix:/run/a.sock", "10.0.0.5:9999"], "backend": "llm"}));
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        assert_eq!(c.runtime_addresses().count(), 2);
        let c = parse(serde_json::json!({
            "address": "10.0.0.5:9999", "addresses": ["nowhere", "10.0.0.6:9999", "10.0.0.6:9999", "10.0.0.5:9999"],
            "backend": "llm"
        }));
        let fields: Vec<String> = c.validate().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, vec!["addresses[0]", "addresses[2]", "address"]);
    }

    #[test]
    fn agent_mode_needs_a_listen_address_only() {
        let c = parse(serde_json::json!({"mode": "agent", "backend": "llm", "agent_listen": "127.0.0.1:0"}));
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        let c = parse(serde_json::json!({"mode": "agent", "backend": "llm"}));
        assert_eq!(c.validate()[0].0, "agent_listen");
    }

    #[test]
    fn new_reports_every_problem() {
        let Err(SinkError::Config(msg)) = HaproxySink::new(&HaproxyConfig::runtime("", ""), "p1") else {
            panic!("expected a config error")
        };
        assert!(msg.contains("pool p1") && msg.contains("backend:") && msg.contains("address:"), "{msg}");
    }

    #[test]
    fn agent_mode_outside_a_runtime_is_a_clear_error() {
        let Err(SinkError::Config(msg)) = HaproxySink::new(&HaproxyConfig::agent("127.0.0.1:0", "llm"), "p")
        else {
            panic!("expected a config error")
        };
        assert!(msg.contains("tokio runtime"), "{msg}");
    }
}
