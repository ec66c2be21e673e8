//! The controller's EDS server state: one assignment per Envoy cluster, written by the Envoy sinks and
//! read by Envoy's polls (`POST /v3/discovery:endpoints`, REST-JSON xDS).
//!
//! How Envoy's REST polling behaves (checked against Envoy 1.40) and what is answered:
//! - Envoy polls every `refresh_delay` plus a random jitter of up to one more `refresh_delay`, sending
//!   the version it last accepted. Same version as ours: `304 Not Modified` (Envoy counts an attempt,
//!   changes nothing). Otherwise: `200` with the assignment and its version.
//! - A cluster nobody has pushed ratios for yet (controller just started): `304` as well. Envoy keeps
//!   the endpoints it has; an Envoy that is starting keeps the cluster initialising (up to its
//!   `initial_fetch_timeout`, 15 s by default) instead of going live with no endpoints.
//! - Several names in one request: the known ones are answered, each once however often it is
//!   named, unknown ones left out (Envoy then keeps what it has for them), under one combined
//!   version. A request naming more than [`MAX_RESOURCE_NAMES`] entries is refused.
//!
//! The endpoint has no authentication, so everything a request leaves behind is bounded: at most
//! [`MAX_POLLERS_PER_CLUSTER`] pollers per served cluster, each node id and version cut to a few
//! hundred bytes ([`llm_lc_adapters::name::shorten`](crate::name::shorten)), forgotten after
//! [`POLLER_TTL`] of silence; an answer holds each served cluster at most once.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tokio::sync::watch;

use super::assignment::{fnv1a64, Assignment, Held};
use super::wire::{DiscoveryRequest, DiscoveryResponse, CLA_TYPE_URL};

/// Path Envoy's REST EDS subscription POSTs to (from the `FetchEndpoints` rpc's HTTP rule).
pub const EDS_PATH: &str = "/v3/discovery:endpoints";

/// Nodes remembered per cluster; the endpoint is unauthenticated, so what it records is bounded.
pub const MAX_POLLERS_PER_CLUSTER: usize = 256;

/// A poller not heard from for this long is forgotten (Envoy polls every `refresh_delay`, seconds).
pub const POLLER_TTL: Duration = Duration::from_secs(600);

/// Most `resource_names` entries one request may carry (repeats included). An Envoy names each of
/// its EDS clusters once; tens of thousands of entries is not an Envoy.
pub const MAX_RESOURCE_NAMES: usize = 4096;

/// A request naming more than [`MAX_RESOURCE_NAMES`] entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request names {0} resources; at most {MAX_RESOURCE_NAMES} are answered (an Envoy names each EDS cluster once)")]
pub struct TooManyNames(pub usize);

/// The distinct names of a request, in first-seen order, or why they are refused.
pub fn distinct_names(names: &[String]) -> Result<Vec<&str>, TooManyNames> {
    if names.len() > MAX_RESOURCE_NAMES {
        return Err(TooManyNames(names.len()));
    }
    let mut seen = std::collections::BTreeSet::new();
    Ok(names.iter().map(String::as_str).filter(|n| seen.insert(*n)).collect())
}

/// What the controller's EDS endpoint serves: one ClusterLoadAssignment per cluster. Shared between
/// the sinks (writers), the HTTP handler and gRPC streams (readers).
pub struct EdsRegistry {
    state: Mutex<RegistryState>,
    /// Bumped on every change of any assignment, so long-lived streams can push instead of poll.
    changes: watch::Sender<u64>,
}

#[derive(Default)]
struct RegistryState {
    clusters: BTreeMap<String, Assignment>,
    /// Output target (`cluster NAME`, `file PATH`) -> the pool that feeds it.
    claims: BTreeMap<String, String>,
    polls: BTreeMap<String, BTreeMap<String, PollSeen>>,
}

#[derive(Debug, Clone)]
struct PollSeen {
    version: String,
    at: Instant,
}

/// An Envoy that asked for a cluster: which version it reported holding, and how long ago.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poller {
    pub node_id: String,
    pub version: String,
    pub since: Duration,
    /// Whether the version it holds is the one the registry serves now.
    pub up_to_date: bool,
}

/// The answer to one discovery request.
#[derive(Debug, Clone, PartialEq)]
pub enum Discovery {
    /// Envoy already holds this, or there is nothing to give it: keep what you have.
    NotModified,
    Response(DiscoveryResponse),
}

impl Default for EdsRegistry {
    fn default() -> Self {
        EdsRegistry { state: Mutex::new(RegistryState::default()), changes: watch::channel(0).0 }
    }
}

impl fmt::Debug for EdsRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        let versions: BTreeMap<&str, &str> =
            st.clusters.iter().map(|(c, a)| (c.as_str(), a.version.as_str())).collect();
        f.debug_struct("EdsRegistry").field("clusters", &versions).finish()
    }
}

impl EdsRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// `POST /v3/discovery:endpoints`, the REST EDS route (the listener's whole Envoy face is
    /// [`EdsRegistry::router`], in the module above, which adds the gRPC services).
    pub fn rest_router(self: Arc<Self>) -> axum::Router {
        axum::Router::new().route(EDS_PATH, post(discovery_handler)).with_state(self)
    }

    /// Answer one discovery request (a REST poll) and note who asked.
    pub fn discover(&self, req: &DiscoveryRequest) -> Result<Discovery, TooManyNames> {
        let names = distinct_names(&req.resource_names)?;
        self.record(req);
        Ok(self.answer(&names, &req.version_info))
    }

    /// Note that an Envoy asked for these clusters holding `req.version_info`. Only clusters the
    /// registry knows (claimed or served) are recorded.
    /// A request naming more than [`MAX_RESOURCE_NAMES`] entries records nothing.
    pub fn record(&self, req: &DiscoveryRequest) {
        self.record_at(req, Instant::now());
    }

    fn record_at(&self, req: &DiscoveryRequest, now: Instant) {
        let Ok(distinct) = distinct_names(&req.resource_names) else { return };
        let mut st = self.lock();
        // Outside text, kept: bounded in size whatever was sent.
        let node = crate::name::shorten(req.node.as_ref().map(|n| n.id.as_str()).unwrap_or("")).into_owned();
        let version = crate::name::shorten_text(&req.version_info).into_owned();
        let names: Vec<String> = if distinct.is_empty() {
            st.clusters.keys().cloned().collect()
        } else {
            distinct.into_iter().map(str::to_string).collect()
        };
        for name in names {
            if st.clusters.contains_key(&name) || st.claims.contains_key(&cluster_target(&name)) {
                let polls = st.polls.entry(name).or_default();
                polls.retain(|_, p| now.saturating_duration_since(p.at) < POLLER_TTL);
                if polls.len() >= MAX_POLLERS_PER_CLUSTER && !polls.contains_key(&node) {
                    if let Some(oldest) = polls.iter().min_by_key(|(_, p)| p.at).map(|(k, _)| k.clone()) {
                        polls.remove(&oldest);
                    }
                }
                polls.insert(node.clone(), PollSeen { version: version.clone(), at: now });
            }
        }
    }

    /// What to send an Envoy that holds `version` of `names` (empty: every cluster). Each cluster is
    /// answered once however often it is named.
    pub fn answer<S: AsRef<str>>(&self, names: &[S], version: &str) -> Discovery {
        let st = self.lock();
        let known: Vec<&Assignment> = if names.is_empty() {
            st.clusters.values().collect()
        } else {
            let mut seen = std::collections::BTreeSet::new();
            names
                .iter()
                .map(AsRef::as_ref)
                .filter(|n| seen.insert(*n))
                .filter_map(|n| st.clusters.get(n))
                .collect()
        };
        if known.is_empty() {
            return Discovery::NotModified;
        }
        let next = combined_version(&known);
        if next == version {
            return Discovery::NotModified;
        }
        Discovery::Response(DiscoveryResponse {
            version_info: next,
            resources: known.iter().map(|a| a.cla.clone()).collect(),
            type_url: CLA_TYPE_URL.to_string(),
        })
    }

    /// The assignment served for `cluster`, if any sink has pushed one.
    pub fn assignment(&self, cluster: &str) -> Option<Assignment> {
        self.lock().clusters.get(cluster).cloned()
    }

    /// The Envoys that asked for `cluster` within [`POLLER_TTL`], most recent first.
    pub fn pollers(&self, cluster: &str) -> Vec<Poller> {
        let st = self.lock();
        let current = st.clusters.get(cluster).map(|a| a.version.as_str());
        let mut out: Vec<Poller> = st
            .polls
            .get(cluster)
            .map(|p| {
                p.iter()
                    .filter(|(_, seen)| seen.at.elapsed() < POLLER_TTL)
                    .map(|(node, seen)| Poller {
                        node_id: node.clone(),
                        version: seen.version.clone(),
                        since: seen.at.elapsed(),
                        up_to_date: Some(seen.version.as_str()) == current,
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by_key(|p| p.since);
        out
    }

    /// A receiver that changes whenever any assignment does.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Make `pool` the only writer of `target`. Claiming again from the same pool is fine (config reload).
    pub(crate) fn claim(&self, target: &str, pool: &str) -> Result<(), String> {
        let mut st = self.lock();
        match st.claims.get(target) {
            Some(owner) if owner != pool => Err(owner.clone()),
            _ => {
                st.claims.insert(target.to_string(), pool.to_string());
                Ok(())
            }
        }
    }

    /// Give up a claim. The assignment stays served, so Envoy keeps its weights until a new sink
    /// for the same cluster pushes (fail static).
    pub(crate) fn release(&self, target: &str, pool: &str) {
        let mut st = self.lock();
        if st.claims.get(target).map(String::as_str) == Some(pool) {
            st.claims.remove(target);
        }
    }

    /// Store a new assignment for `cluster`; returns what was held before. Notifies streams only when
    /// the version changed.
    pub(crate) fn store(&self, cluster: &str, a: Assignment) -> Option<Held> {
        let mut st = self.lock();
        let changed = st.clusters.get(cluster).map(|old| old.version != a.version).unwrap_or(true);
        let prev = st.clusters.insert(cluster.to_string(), a).map(|old| old.held);
        drop(st);
        if changed {
            self.changes.send_modify(|g| *g = g.wrapping_add(1));
        }
        prev
    }

    pub(crate) fn held(&self, cluster: &str) -> Option<Held> {
        self.lock().clusters.get(cluster).map(|a| a.held.clone())
    }

    fn lock(&self) -> MutexGuard<'_, RegistryState> {
        // A panic while holding the lock cannot leave the maps half-updated (each change is one
        // insert), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub(crate) fn cluster_target(cluster: &str) -> String {
    format!("cluster {cluster}")
}

/// One resource: its own version. Several: a hash of their names and versions.
fn combined_version(known: &[&Assignment]) -> String {
    if let [one] = known {
        return one.version.clone();
    }
    let mut bytes = Vec::new();
    for a in known {
        bytes.extend_from_slice(a.cla.cluster_name.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(a.version.as_bytes());
        bytes.push(0);
    }
    format!("{:016x}", fnv1a64(&bytes))
}

async fn discovery_handler(State(reg): State<Arc<EdsRegistry>>, body: Bytes) -> Response {
    let req: DiscoveryRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, format!("body is not a JSON xDS DiscoveryRequest: {e}\n"))
                .into_response()
        }
    };
    if !req.type_url.is_empty() && req.type_url != CLA_TYPE_URL {
        return (
            StatusCode::BAD_REQUEST,
            format!(
                "this endpoint serves {CLA_TYPE_URL} only, not {}\n",
                crate::name::shorten_text(&req.type_url)
            ),
        )
            .into_response();
    }
    match reg.discover(&req) {
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
        Ok(Discovery::NotModified) => StatusCode::NOT_MODIFIED.into_response(),
        Ok(Discovery::Response(resp)) => {
            tracing::debug!(
                node = %crate::name::shorten(req.node.as_ref().map(|n| n.id.as_str()).unwrap_or("")),
                from = %crate::name::shorten_text(&req.version_info),
                to = %resp.version_info,
                "serving EDS update"
            );
            axum::Json(resp).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::assignment::{build, Resolved};
    use super::super::wire::Node;
    use super::*;
    use crate::MemberId;

    fn assignment(cluster: &str, w: &[(&str, u32)]) -> Assignment {
        let members: Vec<(Resolved, u32)> = w
            .iter()
            .map(|(a, r)| {
                (Resolved { member: MemberId::from(*a), addr: a.parse().unwrap(), hostname: None }, *r)
            })
            .collect();
        build(cluster, &members, false).unwrap().0
    }

    fn req(names: &[&str], version: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version.into(),
            node: Some(Node { id: "edge-1".into(), cluster: "edge".into() }),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            type_url: CLA_TYPE_URL.into(),
            error_detail: None,
        }
    }

    fn ask(reg: &EdsRegistry, r: &DiscoveryRequest) -> Discovery {
        reg.discover(r).expect("a request an Envoy could send")
    }

    #[test]
    fn a_cluster_named_thousands_of_times_is_answered_once_and_a_flood_is_refused() {
        let reg = EdsRegistry::new();
        reg.store("vllm", assignment("vllm", &[("10.0.0.1:80", 3), ("10.0.0.2:80", 1)]));
        let many = vec!["vllm"; MAX_RESOURCE_NAMES];
        let Discovery::Response(resp) = ask(&reg, &req(&many, "")) else { panic!("expected a response") };
        assert_eq!(resp.resources.len(), 1, "one copy of the assignment, not {}", MAX_RESOURCE_NAMES);
        let flood = vec!["vllm"; 30_000];
        assert_eq!(reg.discover(&req(&flood, "")), Err(TooManyNames(30_000)));
        assert_eq!(reg.answer(&["vllm", "vllm", "vllm"], ""), ask(&reg, &req(&["vllm"], "")));
    }

    #[test]
    fn what_pollers_leave_behind_is_bounded_in_size_count_and_time() {
        let reg = EdsRegistry::new();
        reg.store("vllm", assignment("vllm", &[("10.0.0.1:80", 3)]));
        let huge = "n".repeat(1 << 20);
        for i in 0..600 {
            let mut r = req(&["vllm"], &"v".repeat(1 << 16));
            r.node = Some(Node { id: format!("{i}-{huge}"), cluster: String::new() });
            ask(&reg, &r);
        }
        let p = reg.pollers("vllm");
        assert_eq!(p.len(), MAX_POLLERS_PER_CLUSTER);
        let kept: usize = p.iter().map(|p| p.node_id.len() + p.version.len()).sum();
        assert!(kept < MAX_POLLERS_PER_CLUSTER * 1024, "{kept} bytes kept for 600 polls of 1 MiB ids");
        // A poller silent for longer than the TTL is gone, from the view and from the map.
        let reg = EdsRegistry::new();
        reg.store("vllm", assignment("vllm", &[("10.0.0.1:80", 3)]));
        let Some(long_ago) = Instant::now().checked_sub(POLLER_TTL + Duration::from_secs(1)) else { return };
        reg.record_at(&req(&["vllm"], ""), long_ago);
        assert!(reg.pollers("vllm").is_empty(), "expired");
        let mut r = req(&["vllm"], "");
        r.node = Some(Node { id: "edge-2".into(), cluster: String::new() });
        reg.record(&r);
        assert_eq!(reg.lock().polls["vllm"].len(), 1, "the expired poller was dropped from the map");
    }

    #[test]
    fn answers_new_versions_and_304s_the_same_one() {
        let reg = EdsRegistry::new();
        assert_eq!(ask(&reg, &req(&["vllm"], "")), Discovery::NotModified, "nothing pushed yet");
        reg.store("vllm", assignment("vllm", &[("10.0.0.1:80", 3), ("10.0.0.2:80", 1)]));
        let Discovery::Response(resp) = ask(&reg, &req(&["vllm"], "")) else { panic!("expected a response") };
        assert_eq!(resp.resources.len(), 1);
        assert_eq!(resp.resources[0].cluster_name, "vllm");
        assert_eq!(ask(&reg, &req(&["vllm"], &resp.version_info)), Discovery::NotModified);
        assert!(matches!(ask(&reg, &req(&["vllm"], "stale")), Discovery::Response(_)));
        assert_eq!(ask(&reg, &req(&["other"], "")), Discovery::NotModified, "unknown cluster");
        let Discovery::Response(both) = ask(&reg, &req(&["vllm", "other"], "")) else { panic!() };
        assert_eq!(both.resources.len(), 1, "unknown names are left out");
    }

    #[test]
    fn wildcard_and_combined_versions() {
        let reg = EdsRegistry::new();
        reg.store("a", assignment("a", &[("10.0.0.1:80", 1)]));
        reg.store("b", assignment("b", &[("10.0.0.2:80", 1)]));
        let Discovery::Response(all) = ask(&reg, &req(&[], "")) else { panic!() };
        assert_eq!(all.resources.len(), 2);
        assert_eq!(ask(&reg, &req(&[], &all.version_info)), Discovery::NotModified);
        reg.store("b", assignment("b", &[("10.0.0.2:80", 2)]));
        assert!(matches!(ask(&reg, &req(&[], &all.version_info)), Discovery::Response(_)));
    }

    #[test]
    fn claims_are_per_pool_and_store_notifies_only_on_change() {
        let reg = EdsRegistry::new();
        assert!(reg.claim("cluster vllm", "p1").is_ok());
        assert!(reg.claim("cluster vllm", "p1").is_ok());
        assert_eq!(reg.claim("cluster vllm", "p2"), Err("p1".into()));
        reg.release("cluster vllm", "p2");
        assert!(reg.claim("cluster vllm", "p2").is_err(), "only the owner releases");
        reg.release("cluster vllm", "p1");
        assert!(reg.claim("cluster vllm", "p2").is_ok());

        let rx = reg.subscribe();
        reg.store("vllm", assignment("vllm", &[("10.0.0.1:80", 3)]));
        assert!(rx.has_changed().unwrap());
        let mut rx = reg.subscribe();
        rx.mark_unchanged();
        reg.store("vllm", assignment("vllm", &[("10.0.0.1:80", 3)]));
        assert!(!rx.has_changed().unwrap(), "same content is not a change");
    }

    #[test]
    fn pollers_are_recorded_for_known_clusters_only() {
        let reg = EdsRegistry::new();
        ask(&reg, &req(&["nobody-claims-this"], ""));
        assert!(reg.pollers("nobody-claims-this").is_empty());
        reg.store("vllm", assignment("vllm", &[("10.0.0.1:80", 3)]));
        let v = reg.assignment("vllm").unwrap().version;
        ask(&reg, &req(&["vllm"], &v));
        let p = reg.pollers("vllm");
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].node_id, "edge-1");
        assert!(p[0].up_to_date);
    }
}
