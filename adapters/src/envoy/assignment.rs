//! Ratios -> the `ClusterLoadAssignment` Envoy is given, and its version. Pure: no I/O, no clock.
//!
//! Rules, each because of what Envoy does with the result:
//! - A ratio of 0 means "no new traffic". Envoy rejects a whole update if any `load_balancing_weight`
//!   is 0 (and keeps the old one), so a member at 0 is left out of the assignment instead: Envoy
//!   removes it, which is exactly "drain". It is remembered as drained so `current()` still shows it.
//!   With `standby` (the sink's `priority_levels`, for priority tiers) a member at 0 is given to
//!   Envoy at priority 1 with weight 1 instead: no traffic while priority 0 is healthy, health
//!   checked and connected all the same, and Envoy's own failover if priority 0 goes down between
//!   two cycles.
//! - Nothing to serve (no member, or every member at 0) is an error, never an empty assignment: an
//!   empty one would remove every endpoint of the cluster.
//! - Weights are sent as given (so `/clusters` shows the controller's numbers), unless their sum
//!   exceeds `u32::MAX`, which Envoy forbids per locality; then they are scaled down, each kept >= 1.
//! - Two members on the same address: Envoy keeps the first and ignores the other; we do the same,
//!   explicitly, and say so.
//! - The version is a hash of the assignment itself, so it changes exactly when weights or
//!   membership change, and stays meaningful across controller restarts (an Envoy that already holds
//!   this content is answered "not modified", and one holding anything else gets the new content).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use crate::{MemberId, Ratios};

use super::wire::{
    Address, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, SocketAddress, CLA_TYPE_URL,
};

/// A member with the IP address Envoy will be given for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub member: MemberId,
    pub addr: SocketAddr,
    /// The DNS name the member was written with, when it was not an IP literal.
    pub hostname: Option<String>,
}

/// What a sink holds for its cluster: the members Envoy is given with their weights, and the members
/// left out because their ratio is 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    pub served: BTreeMap<MemberId, u32>,
    pub drained: BTreeSet<MemberId>,
}

impl Held {
    /// As ratios: served members with their weights, drained members with 0.
    pub fn to_ratios(&self) -> Ratios {
        self.served
            .iter()
            .map(|(m, w)| (m.clone(), *w))
            .chain(self.drained.iter().map(|m| (m.clone(), 0)))
            .collect()
    }
}

/// One cluster's assignment, ready to serve or write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub cla: ClusterLoadAssignment,
    pub version: String,
    pub held: Held,
}

/// Why no assignment could be built. The previous one stays in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NothingToServe {
    NoMembers,
    AllZero,
}

impl std::fmt::Display for NothingToServe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NothingToServe::NoMembers => f.write_str(
                "no member with an address to give Envoy; an empty assignment would remove every endpoint, \
                 so the previous one is kept (check the pool's membership)",
            ),
            NothingToServe::AllZero => f.write_str(
                "every member has ratio 0; Envoy would have no endpoint, so the previous assignment is kept \
                 (check why the policy drains the whole pool)",
            ),
        }
    }
}

/// The priority level members of inactive tiers are given at, with `standby`.
pub const STANDBY_PRIORITY: u32 = 1;

/// Envoy's limit on the sum of endpoint weights in one locality.
pub const MAX_WEIGHT_SUM: u64 = u32::MAX as u64;

/// Build the assignment for `cluster` from resolved members and their ratios. Returns warnings
/// (duplicates, scaling) alongside.
pub fn build(
    cluster: &str,
    members: &[(Resolved, u32)],
    standby: bool,
) -> Result<(Assignment, Vec<String>), NothingToServe> {
    if members.is_empty() {
        return Err(NothingToServe::NoMembers);
    }
    let mut warnings = Vec::new();
    let mut sorted: Vec<&(Resolved, u32)> = members.iter().collect();
    sorted.sort_by(|a, b| a.0.member.cmp(&b.0.member));

    let mut drained = BTreeSet::new();
    let mut seen: BTreeMap<SocketAddr, &MemberId> = BTreeMap::new();
    let mut live: Vec<(&Resolved, u32)> = Vec::new();
    // The members at 0 (in member order): the standby priority's endpoints when `standby`.
    let mut parked: Vec<&Resolved> = Vec::new();
    for (r, ratio) in sorted {
        if let Some(first) = seen.get(&r.addr) {
            warnings.push(format!(
                "{} and {} are both {}; Envoy takes one endpoint per address, so only {} is given to it",
                first, r.member, r.addr, first
            ));
            continue;
        }
        seen.insert(r.addr, &r.member);
        if *ratio == 0 {
            drained.insert(r.member.clone());
            parked.push(r);
        } else {
            live.push((r, *ratio));
        }
    }
    if live.is_empty() {
        return Err(NothingToServe::AllZero);
    }

    let weights = fit_sum(&live.iter().map(|(_, w)| *w).collect::<Vec<_>>());
    if weights.iter().zip(&live).any(|(a, (_, b))| a != b) {
        warnings.push(format!(
            "weights of cluster {cluster} sum to more than {MAX_WEIGHT_SUM} (Envoy's limit); scaled down in proportion"
        ));
    }

    let endpoint = |r: &Resolved, w: u32| LbEndpoint {
        endpoint: Endpoint {
            address: Address {
                socket_address: SocketAddress { address: r.addr.ip().to_string(), port_value: r.addr.port() },
            },
            hostname: r.hostname.clone(),
        },
        load_balancing_weight: w,
    };
    let mut served = BTreeMap::new();
    let mut lb_endpoints = Vec::with_capacity(live.len());
    for ((r, _), w) in live.iter().zip(weights) {
        served.insert(r.member.clone(), w);
        lb_endpoints.push(endpoint(r, w));
    }
    let mut endpoints = vec![LocalityLbEndpoints { lb_endpoints, priority: 0 }];
    if standby && !parked.is_empty() {
        // In member order, like the served ones (the version must not depend on input order).
        let standby: Vec<LbEndpoint> = parked.iter().map(|r| endpoint(r, 1)).collect();
        endpoints.push(LocalityLbEndpoints { lb_endpoints: standby, priority: STANDBY_PRIORITY });
    }
    let cla = ClusterLoadAssignment {
        type_url: CLA_TYPE_URL.to_string(),
        cluster_name: cluster.to_string(),
        endpoints,
    };
    let version = version_of(&cla);
    Ok((Assignment { cla, version, held: Held { served, drained } }, warnings))
}

/// Scale weights down so their sum fits Envoy's limit, keeping each >= 1 and the order of sizes.
/// Unchanged when they already fit.
pub fn fit_sum(weights: &[u32]) -> Vec<u32> {
    let sum: u64 = weights.iter().map(|&w| w as u64).sum();
    if sum <= MAX_WEIGHT_SUM {
        return weights.to_vec();
    }
    // Each weight becomes max(1, floor(w * budget / sum)) <= w * budget / sum + 1, so the total is at
    // most budget + n = MAX_WEIGHT_SUM.
    let budget = MAX_WEIGHT_SUM.saturating_sub(weights.len() as u64) as u128;
    weights.iter().map(|&w| ((w as u128 * budget / sum as u128) as u32).max(1)).collect()
}

/// Content version: FNV-1a (64 bit) of the assignment's JSON. Stable across processes and Rust
/// versions, unlike `std`'s hasher, so a restarted controller recognises what Envoy already holds.
pub fn version_of(cla: &ClusterLoadAssignment) -> String {
    // Serializing plain structs of strings and integers cannot fail.
    let bytes = serde_json::to_vec(cla).unwrap_or_default();
    format!("{:016x}", fnv1a64(&bytes))
}

pub(crate) use llm_lc_common::fnv1a64;

/// Read an assignment back into held weights (priority 0), naming each endpoint as the controller
/// names members:
/// `hostname:port` when a hostname is set, else `ip:port` (`[ip]:port` for IPv6).
pub fn served_from(cla: &ClusterLoadAssignment) -> BTreeMap<MemberId, u32> {
    at_priority(cla, |p| p == 0)
}

/// The members an assignment holds at a standby priority (> 0): ratio 0 for the controller.
pub fn standby_from(cla: &ClusterLoadAssignment) -> BTreeSet<MemberId> {
    at_priority(cla, |p| p > 0).into_keys().collect()
}

fn at_priority(cla: &ClusterLoadAssignment, wanted: impl Fn(u32) -> bool) -> BTreeMap<MemberId, u32> {
    let mut out = BTreeMap::new();
    for ep in cla.endpoints.iter().filter(|l| wanted(l.priority)).flat_map(|l| l.lb_endpoints.iter()) {
        let sa = &ep.endpoint.address.socket_address;
        let host = match (&ep.endpoint.hostname, sa.address.parse::<IpAddr>()) {
            (Some(h), _) if !h.is_empty() => h.clone(),
            (_, Ok(IpAddr::V6(ip))) => format!("[{ip}]"),
            _ => sa.address.clone(),
        };
        out.insert(MemberId::new(format!("{host}:{}", sa.port_value)), ep.load_balancing_weight);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(member: &str, addr: &str) -> Resolved {
        Resolved { member: MemberId::from(member), addr: addr.parse().unwrap(), hostname: None }
    }

    fn weights(a: &Assignment) -> Vec<(String, u32)> {
        a.cla.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| (e.endpoint.address.socket_address.address.clone(), e.load_balancing_weight))
            .collect()
    }

    #[test]
    fn zero_is_left_out_and_remembered_as_drained() {
        let (a, w) = build(
            "vllm",
            &[(r("10.0.0.1:80", "10.0.0.1:80"), 3), (r("10.0.0.2:80", "10.0.0.2:80"), 0)],
            false,
        )
        .unwrap();
        assert!(w.is_empty());
        assert_eq!(weights(&a), vec![("10.0.0.1".to_string(), 3)]);
        assert!(a.cla.endpoints.iter().flat_map(|l| &l.lb_endpoints).all(|e| e.load_balancing_weight >= 1));
        assert_eq!(a.held.to_ratios().get(&MemberId::from("10.0.0.2:80")), Some(0));
    }

    #[test]
    fn with_standby_zero_goes_to_priority_one_and_reads_back_as_zero() {
        let members = [
            (r("10.0.0.3:80", "10.0.0.3:80"), 0),
            (r("10.0.0.1:80", "10.0.0.1:80"), 3),
            (r("10.0.0.2:80", "10.0.0.2:80"), 0),
        ];
        let (a, _) = build("vllm", &members, true).unwrap();
        assert_eq!(a.cla.endpoints.len(), 2);
        assert_eq!((a.cla.endpoints[0].priority, a.cla.endpoints[1].priority), (0, STANDBY_PRIORITY));
        let standby: Vec<(&str, u32)> = a.cla.endpoints[1]
            .lb_endpoints
            .iter()
            .map(|e| (e.endpoint.address.socket_address.address.as_str(), e.load_balancing_weight))
            .collect();
        assert_eq!(standby, [("10.0.0.2", 1), ("10.0.0.3", 1)], "member order, weight 1");
        assert_eq!(served_from(&a.cla), [(MemberId::from("10.0.0.1:80"), 3)].into_iter().collect());
        assert_eq!(standby_from(&a.cla), a.held.drained);
        assert_eq!(a.held.to_ratios().get(&MemberId::from("10.0.0.3:80")), Some(0));
        // Priorities change what Envoy holds, so the version; order of input does not.
        let (plain, _) = build("vllm", &members, false).unwrap();
        assert_ne!(plain.version, a.version);
        let mut shuffled = members.clone();
        shuffled.reverse();
        assert_eq!(build("vllm", &shuffled, true).unwrap().0.version, a.version);
        // The priority is written only when it is not 0: plain assignments are unchanged on the wire.
        let json = serde_json::to_string(&plain.cla).unwrap();
        assert!(!json.contains("priority"), "{json}");
        assert!(serde_json::to_string(&a.cla).unwrap().contains("\"priority\":1"));
        // Still nothing to serve when every member is at 0.
        assert_eq!(
            build("vllm", &[(r("10.0.0.1:80", "10.0.0.1:80"), 0)], true),
            Err(NothingToServe::AllZero)
        );
    }

    #[test]
    fn all_zero_or_empty_is_refused() {
        assert_eq!(build("vllm", &[], false), Err(NothingToServe::NoMembers));
        assert_eq!(
            build("vllm", &[(r("10.0.0.1:80", "10.0.0.1:80"), 0)], false),
            Err(NothingToServe::AllZero)
        );
    }

    #[test]
    fn version_follows_content_only() {
        let one = [(r("10.0.0.1:80", "10.0.0.1:80"), 3), (r("10.0.0.2:80", "10.0.0.2:80"), 1)];
        let (a, _) = build("vllm", &one, false).unwrap();
        // Same content in another order: same version.
        let (b, _) = build("vllm", &[one[1].clone(), one[0].clone()], false).unwrap();
        assert_eq!(a.version, b.version);
        // A weight changes: new version.
        let (c, _) = build("vllm", &[one[0].clone(), (one[1].0.clone(), 2)], false).unwrap();
        assert_ne!(a.version, c.version);
        // A member leaves: new version.
        let (d, _) = build("vllm", &one[..1], false).unwrap();
        assert_ne!(a.version, d.version);
        // Draining a member changes what Envoy sees, so the version too; the drained set is not
        // part of the content, so re-draining the same member does not.
        let (e, _) = build("vllm", &[one[0].clone(), (one[1].0.clone(), 0)], false).unwrap();
        assert_eq!(d.version, e.version);
    }

    #[test]
    fn version_is_stable_across_processes() {
        // Pinned: a changed hash function would make every Envoy refetch once after an upgrade
        // (harmless), but a hash that varied per process would break "not modified" answers.
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
    }

    #[test]
    fn oversized_sums_are_scaled_into_envoys_limit() {
        let w = fit_sum(&[u32::MAX, u32::MAX, 1]);
        let sum: u64 = w.iter().map(|&x| x as u64).sum();
        assert!(sum <= MAX_WEIGHT_SUM, "{w:?}");
        assert!(w.iter().all(|&x| x >= 1));
        assert!(w[0] > w[2]);
        assert_eq!(fit_sum(&[3, 1]), vec![3, 1]);
        let (_, warns) =
            build("c", &[(r("a:1", "10.0.0.1:1"), u32::MAX), (r("b:1", "10.0.0.2:1"), 7)], false).unwrap();
        assert_eq!(warns.len(), 1);
    }

    #[test]
    fn duplicate_addresses_keep_the_first_member() {
        let (a, w) = build(
            "c",
            &[(r("localhost:80", "127.0.0.1:80"), 5), (r("127.0.0.1:80", "127.0.0.1:80"), 2)],
            false,
        )
        .unwrap();
        assert_eq!(weights(&a), vec![("127.0.0.1".to_string(), 2)]);
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn reads_back_member_names() {
        let mut h = r("vllm-0.ns.svc:8000", "10.1.2.3:8000");
        h.hostname = Some("vllm-0.ns.svc".into());
        let (a, _) = build("c", &[(h, 4), (r("[2001:db8::1]:80", "[2001:db8::1]:80"), 2)], false).unwrap();
        let back = served_from(&a.cla);
        assert_eq!(back.get(&MemberId::from("vllm-0.ns.svc:8000")), Some(&4));
        assert_eq!(back.get(&MemberId::from("[2001:db8::1]:80")), Some(&2));
        assert_eq!(back, a.held.served);
    }
}
