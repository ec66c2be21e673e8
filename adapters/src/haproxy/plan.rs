//! Decide which `set server ... weight` commands one cycle needs: match desired members to the
//! backend's servers, map ratios to weights, keep only the servers whose weight differs, and refuse
//! a push that would leave every server of the backend at weight 0.
//!
//! Pure: the runtime API is read before and written after, elsewhere.

use std::collections::HashMap;
use std::net::IpAddr;

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
/// Builds an index each call: for many members, build one [`ServerIndex`] and ask it.
pub fn servers_for<'a>(servers: &'a [ServerState], member: &MemberId, by: MatchBy) -> Vec<&'a ServerState> {
    ServerIndex::new(servers).servers_for(member, by)
}

/// A backend's servers indexed by parsed IP, by host name (address text and configured FQDN) and by
/// server name, built once per read so that matching N members costs O(N), not O(N x servers)
/// with an address parse in each comparison.
pub struct ServerIndex<'a> {
    servers: &'a [ServerState],
    by_ip: HashMap<(IpAddr, u16), Vec<usize>>,
    /// Lower-cased `srv_addr` text and `srv_fqdn`, with the port.
    by_host: HashMap<(String, u16), Vec<usize>>,
    by_name: HashMap<&'a str, Vec<usize>>,
}

impl<'a> ServerIndex<'a> {
    pub fn new(servers: &'a [ServerState]) -> Self {
        let mut ix = ServerIndex {
            servers,
            by_ip: HashMap::with_capacity(servers.len()),
            by_host: HashMap::with_capacity(servers.len()),
            by_name: HashMap::with_capacity(servers.len()),
        };
        for (i, s) in servers.iter().enumerate() {
            ix.by_name.entry(s.name.as_str()).or_default().push(i);
            if let Ok(ip) = s.addr.parse::<IpAddr>() {
                ix.by_ip.entry((ip, s.port)).or_default().push(i);
            }
            ix.by_host.entry((s.addr.to_ascii_lowercase(), s.port)).or_default().push(i);
            if let Some(f) = &s.fqdn {
                let key = (f.to_ascii_lowercase(), s.port);
                let list = ix.by_host.entry(key).or_default();
                if list.last() != Some(&i) {
                    list.push(i);
                }
            }
        }
        ix
    }

    pub fn servers(&self) -> &'a [ServerState] {
        self.servers
    }

    /// Same rules as [`ServerState::has_address`] (any spelling of the same IP, or the hostname
    /// it was configured with) and, with [`MatchBy::Name`], the server name first.
    pub fn servers_for(&self, member: &MemberId, by: MatchBy) -> Vec<&'a ServerState> {
        let host_port = member.host_port();
        let mut found: Vec<usize> = Vec::new();
        if by == MatchBy::Name {
            found.extend(self.by_name.get(member.as_str()).into_iter().flatten());
            if let Some((host, _)) = host_port {
                if host != member.as_str() {
                    found.extend(self.by_name.get(host).into_iter().flatten());
                }
            }
        }
        if found.is_empty() {
            if let Some((host, port)) = host_port {
                if let Ok(ip) = host.parse::<IpAddr>() {
                    found.extend(self.by_ip.get(&(ip, port)).into_iter().flatten());
                }
                found.extend(self.by_host.get(&(host.to_ascii_lowercase(), port)).into_iter().flatten());
            }
        }
        // In backend order, each server once.
        found.sort_unstable();
        found.dedup();
        found.into_iter().map(|i| &self.servers[i]).collect()
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
    let index = ServerIndex::new(servers);
    // server name -> member that claimed it, so two members never fight over one server.
    let mut claimed: HashMap<&str, &MemberId> = HashMap::new();

    for (member, ratio) in desired.iter() {
        let found = index.servers_for(member, by);
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
        let pushed: HashMap<&str, u32> = plan.pushes.iter().map(|p| (p.server.as_str(), p.to)).collect();
        let after = |s: &ServerState| pushed.get(s.name.as_str()).copied().unwrap_or(s.weight);
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
        .map(|s| {
            format!("{} ({})", s.name, s.member_id().map_or_else(|| "no address".into(), |m| m.to_string()))
        })
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
    fn ten_thousand_servers_plan_in_linear_time() {
        let n = 10_000u32;
        let servers: Vec<ServerState> = (0..n)
            .map(|i| {
                srv(&format!("s{i}"), &format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255), 8000, 1)
            })
            .collect();
        let desired: Ratios = (0..n)
            .map(|i| {
                (MemberId::new(format!("10.{}.{}.{}:8000", i >> 16, (i >> 8) & 255, i & 255)), 1 + i % 50)
            })
            .collect();
        let started = std::time::Instant::now();
        let p = plan(&servers, &desired, &MAP, MatchBy::Address, "be").unwrap();
        let took = started.elapsed();
        println!("planned {n} servers x {n} members in {took:?}");
        assert_eq!(p.changed + p.unchanged, n as usize);
        assert_eq!(p.pushes.len(), (n - n / 50) as usize, "every member not already at 1");
        assert!(p.warnings.is_empty());
        // Quadratic matching (a scan with an address parse per server per member) took seconds here;
        // the bound is loose for debug builds on a shared machine.
        assert!(took < std::time::Duration::from_millis(500), "{took:?}");
        // Draining one member does not make the all-zero check quadratic either.
        let drain = WeightMap { allow_drain: true, ..MAP };
        let mut zeros = desired.clone();
        zeros.insert(MemberId::from("10.0.0.0:8000"), 0);
        let started = std::time::Instant::now();
        plan(&servers, &zeros, &drain, MatchBy::Name, "be").unwrap();
        assert!(started.elapsed() < std::time::Duration::from_millis(500), "{:?}", started.elapsed());
    }

    #[test]
    fn index_matches_like_has_address() {
        let mut named = srv("web", "10.0.0.5", 80, 1);
        named.fqdn = Some("Web.Example".into());
        let servers =
            [srv("a", "::1", 80, 1), srv("b", "127.0.0.1", 80, 1), named, srv("c", "127.0.0.1", 81, 1)];
        let ix = ServerIndex::new(&servers);
        let names = |m: &str, by| {
            ix.servers_for(&MemberId::from(m), by).iter().map(|s| s.name.clone()).collect::<Vec<_>>()
        };
        assert_eq!(names("[0:0:0:0:0:0:0:1]:80", MatchBy::Address), vec!["a"]);
        assert_eq!(names("127.0.0.1:80", MatchBy::Address), vec!["b"]);
        assert_eq!(names("web.example:80", MatchBy::Address), vec!["web"]);
        assert_eq!(names("web:80", MatchBy::Name), vec!["web"]);
        assert_eq!(names("web:80", MatchBy::Address), Vec::<String>::new());
        assert_eq!(names("127.0.0.1:82", MatchBy::Address), Vec::<String>::new());
        // Every member/server pair agrees with the scan it replaces.
        for m in ["::1:80", "[::1]:80", "127.0.0.1:81", "WEB.EXAMPLE:80", "10.0.0.5:80", "b:80", "a"] {
            let member = MemberId::from(m);
            for by in [MatchBy::Address, MatchBy::Name] {
                let scan: Vec<&str> = match (by, member.host_port()) {
                    (_, None) if by == MatchBy::Address => vec![],
                    _ => {
                        let named: Vec<&str> = servers
                            .iter()
                            .filter(|s| {
                                by == MatchBy::Name
                                    && (s.name == m
                                        || Some(s.name.as_str()) == member.host_port().map(|h| h.0))
                            })
                            .map(|s| s.name.as_str())
                            .collect();
                        if !named.is_empty() {
                            named
                        } else if let Some((h, p)) = member.host_port() {
                            servers.iter().filter(|s| s.has_address(h, p)).map(|s| s.name.as_str()).collect()
                        } else {
                            vec![]
                        }
                    }
                };
                let got: Vec<&str> = ix.servers_for(&member, by).iter().map(|s| s.name.as_str()).collect();
                assert_eq!(got, scan, "{m} {by:?}");
            }
        }
    }

    #[test]
    fn clamping_is_reported() {
        let servers = [srv("a", "10.0.0.1", 80, 1)];
        let p = plan(&servers, &ratios(&[("10.0.0.1:80", 900)]), &MAP, MatchBy::Address, "be").unwrap();
        assert_eq!(p.pushes[0].to, 256);
        assert!(p.warnings[0].contains("ratio_max"));
    }
}
