//! Decide which `set server ... weight` commands one cycle needs: match desired members to the
//! backend's servers, map ratios to weights, keep only the servers whose weight differs, and refuse
//! a push that would leave every server of the backend at weight 0.
//!
//! Pure: the runtime API is read before and written after, elsewhere.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::state::ServerState;
use super::weights::WeightMap;
use crate::{MemberId, Ratios};

/// How a member of the controller finds its HAProxy server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MatchBy {
    /// `host:port` against the server's address (any spelling of the same IP) or the hostname it was
    /// configured with.
    #[default]
    Address,
    /// The member id, or its host part, equals the server name (`vllm-0` or `vllm-0:8000` finds
    /// `server vllm-0 ...`). Members that match no name still match by address, so ids that came from
    /// the backend itself (`members: {from: lb}`) keep working.
    Name,
}

/// One weight change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Push {
    pub server: String,
    pub member: MemberId,
    pub from: u32,
    pub to: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub pushes: Vec<Push>,
    /// Members that needed no change.
    pub unchanged: usize,
    /// Members with at least one push.
    pub changed: usize,
    pub warnings: Vec<String>,
}

/// The servers `member` stands for. Several servers may share one address; all of them follow it.
pub fn servers_for<'a>(servers: &'a [ServerState], member: &MemberId, by: MatchBy) -> Vec<&'a ServerState> {
    let host_port = member.host_port();
    if by == MatchBy::Name {
        let host = host_port.map(|(h, _)| h);
        let named: Vec<_> =
            servers.iter().filter(|s| s.name == member.as_str() || Some(s.name.as_str()) == host).collect();
        if !named.is_empty() {
            return named;
        }
    }
    match host_port {
        Some((host, port)) => servers.iter().filter(|s| s.has_address(host, port)).collect(),
        None => Vec::new(),
    }
}

pub fn plan(
    servers: &[ServerState],
    desired: &Ratios,
    map: &WeightMap,
    by: MatchBy,
    backend: &str,
) -> Result<Plan, String> {
    let mut plan = Plan::default();
    // server name -> member that claimed it, so two members never fight over one server.
    let mut claimed: BTreeMap<&str, &MemberId> = BTreeMap::new();

    for (member, ratio) in desired.iter() {
        let found = servers_for(servers, member, by);
        if found.is_empty() {
            plan.warnings.push(format!(
                "member {member} has no server in HAProxy backend {backend} (matched by {}; the backend has {}); \
                 add it to haproxy.cfg or fix the member list",
                match by {
                    MatchBy::Address => "address",
                    MatchBy::Name => "name, then address",
                },
                describe(servers)
            ));
            continue;
        }
        let mapped = map.weight(ratio);
        if mapped.clamped {
            plan.warnings.push(format!(
                "ratio {ratio} of {member} is above the largest weight {}; pushed {} (set `ratio_max` to scale \
                 ratios instead of clamping them)",
                map.max_weight, mapped.weight
            ));
        }
        let mut changed = false;
        for s in found {
            if let Some(other) = claimed.get(s.name.as_str()) {
                plan.warnings.push(format!(
                    "server {backend}/{} matches both {other} and {member}; it follows {other}",
                    s.name
                ));
                continue;
            }
            claimed.insert(&s.name, member);
            if s.weight != mapped.weight {
                plan.pushes.push(Push {
                    server: s.name.clone(),
                    member: member.clone(),
                    from: s.weight,
                    to: mapped.weight,
                });
                changed = true;
            }
        }
        if changed {
            plan.changed += 1;
        } else {
            plan.unchanged += 1;
        }
    }

    // Never leave the whole backend at weight 0: HAProxy would stop sending new requests anywhere.
    if plan.pushes.iter().any(|p| p.to == 0) && !servers.is_empty() {
        let after =
            |s: &ServerState| plan.pushes.iter().find(|p| p.server == s.name).map_or(s.weight, |p| p.to);
        if servers.iter().all(|s| after(s) == 0) {
            return Err(format!(
                "refusing to set weight 0 on every server of backend {backend}: HAProxy would send new requests \
                 nowhere. Keep at least one member's ratio above 0 (the weights were left as they are)"
            ));
        }
    }
    Ok(plan)
}

/// A short list of a backend's servers for messages.
fn describe(servers: &[ServerState]) -> String {
    if servers.is_empty() {
        return "no servers".into();
    }
    let mut list: Vec<String> = servers
        .iter()
        .take(5)
        .map(|s| format!("{} ({})", s.name, s.member_id().map_or_else(|| "no address".into(), |m| m.0)))
        .collect();
    if servers.len() > 5 {
        list.push(format!("and {} more", servers.len() - 5));
    }
    list.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn srv(name: &str, addr: &str, port: u16, weight: u32) -> ServerState {
        ServerState { name: name.into(), addr: addr.into(), port, fqdn: None, weight, initial_weight: 1 }
    }

    fn ratios(v: &[(&str, u32)]) -> Ratios {
        v.iter().map(|(m, r)| (MemberId::from(*m), *r)).collect()
    }

    const MAP: WeightMap = WeightMap { ratio_max: None, max_weight: 256, allow_drain: false };

    #[test]
    fn pushes_only_differences() {
        let servers = [srv("a", "10.0.0.1", 80, 5), srv("b", "10.0.0.2", 80, 1)];
        let p =
            plan(&servers, &ratios(&[("10.0.0.1:80", 5), ("10.0.0.2:80", 9)]), &MAP, MatchBy::Address, "be")
                .unwrap();
        assert_eq!(p.pushes, vec![Push { server: "b".into(), member: "10.0.0.2:80".into(), from: 1, to: 9 }]);
        assert_eq!((p.changed, p.unchanged), (1, 1));
        assert!(p.warnings.is_empty());
    }

    #[test]
    fn unknown_members_are_warnings_naming_them() {
        let servers = [srv("a", "10.0.0.1", 80, 1)];
        let p =
            plan(&servers, &ratios(&[("10.0.0.9:80", 3), ("10.0.0.1:80", 3)]), &MAP, MatchBy::Address, "be")
                .unwrap();
        assert_eq!(p.pushes.len(), 1);
        assert_eq!(p.warnings.len(), 1);
        assert!(
            p.warnings[0].contains("10.0.0.9:80") && p.warnings[0].contains("a (10.0.0.1:80)"),
            "{:?}",
            p.warnings
        );
    }

    #[test]
    fn match_by_name_falls_back_to_address() {
        let servers = [srv("vllm-0", "10.0.0.1", 8000, 1), srv("vllm-1", "10.0.0.2", 8000, 1)];
        let d = ratios(&[("vllm-0:8000", 4), ("10.0.0.2:8000", 6)]);
        let p = plan(&servers, &d, &MAP, MatchBy::Name, "be").unwrap();
        let got: Vec<_> = p.pushes.iter().map(|p| (p.server.as_str(), p.to)).collect();
        // Desired members iterate in id order: "10.0.0.2:8000" before "vllm-0:8000".
        assert_eq!(got, vec![("vllm-1", 6), ("vllm-0", 4)]);
        // By address, the name does not match anything.
        let p = plan(&servers, &d, &MAP, MatchBy::Address, "be").unwrap();
        assert_eq!(p.pushes.len(), 1);
        assert_eq!(p.warnings.len(), 1);
    }

    #[test]
    fn one_server_is_not_claimed_twice() {
        let mut s = srv("a", "127.0.0.1", 80, 1);
        s.fqdn = Some("localhost".into());
        let p =
            plan(&[s], &ratios(&[("127.0.0.1:80", 3), ("localhost:80", 7)]), &MAP, MatchBy::Address, "be")
                .unwrap();
        assert_eq!(p.pushes.len(), 1);
        assert_eq!(p.pushes[0].to, 3);
        assert!(p.warnings[0].contains("matches both"));
    }

    #[test]
    fn drain_is_allowed_for_some_never_for_all() {
        let drain = WeightMap { allow_drain: true, ..MAP };
        let servers = [srv("a", "10.0.0.1", 80, 2), srv("b", "10.0.0.2", 80, 2), srv("c", "10.0.0.3", 80, 0)];
        let p = plan(
            &servers,
            &ratios(&[("10.0.0.1:80", 0), ("10.0.0.2:80", 3)]),
            &drain,
            MatchBy::Address,
            "be",
        )
        .unwrap();
        assert!(p.pushes.iter().any(|p| p.server == "a" && p.to == 0));
        let err = plan(
            &servers,
            &ratios(&[("10.0.0.1:80", 0), ("10.0.0.2:80", 0)]),
            &drain,
            MatchBy::Address,
            "be",
        )
        .unwrap_err();
        assert!(err.contains("every server of backend be"), "{err}");
        // Without allow_drain, 0 becomes weight 1 and nothing is refused.
        let p =
            plan(&servers, &ratios(&[("10.0.0.1:80", 0), ("10.0.0.2:80", 0)]), &MAP, MatchBy::Address, "be")
                .unwrap();
        assert!(p.pushes.iter().all(|p| p.to == 1));
    }

    #[test]
    fn clamping_is_reported() {
        let servers = [srv("a", "10.0.0.1", 80, 1)];
        let p = plan(&servers, &ratios(&[("10.0.0.1:80", 900)]), &MAP, MatchBy::Address, "be").unwrap();
        assert_eq!(p.pushes[0].to, 256);
        assert!(p.warnings[0].contains("ratio_max"));
    }
}
