//! What one push must change: desired ratios matched to the pool's members, compared with what the
//! BIG-IP has, clamped into its range. Pure: no I/O, so every rule is unit-tested here.
//!
//! With priority groups (a pool with priority tiers, see the controller's `priority` module), ratio
//! 0 means "member of an inactive tier": BIG-IP has no ratio 0, so such a member moves to
//! [`STANDBY_GROUP`] (its ratio is left as it is) and every member with a ratio to
//! [`ACTIVE_GROUP`]. With the pool's priority group activation on (`min-active-members` >= 1),
//! BIG-IP sends traffic only to the highest group that has enough available members, so the
//! standby tier takes traffic when the controller spills over, and on its own when every active
//! member is down.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::names::{endpoint_of_id, endpoint_of_member, Endpoint};
use super::wire::Member;
use crate::{MemberId, Ratios};

/// BIG-IP's pool member ratio range as TMOS stores it.
pub const WIRE_MIN: u32 = 1;
pub const WIRE_MAX: u32 = 65_535;
/// The largest ratio written unless the user opts in to more: F5's AS3 schema and Ansible modules
/// document member ratio as 1..100, and a BIG-IP that enforces that fails a whole transaction on
/// one larger value.
pub const DEFAULT_MAX_RATIO: u32 = 100;

/// Priority group of members that carry traffic (BIG-IP prefers the higher number).
pub const ACTIVE_GROUP: u32 = 2;
/// Priority group of members of inactive tiers: used only while the active group has fewer
/// available members than the pool's `min-active-members`.
pub const STANDBY_GROUP: u32 = 1;

/// One member whose ratio or priority group must change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub id: MemberId,
    pub partition: String,
    pub name: String,
    /// Ratio before and after (equal when only the group changes).
    pub from: u32,
    pub to: u32,
    /// The new priority group, when it changes.
    pub group: Option<u32>,
}

impl Change {
    /// The member as BIG-IP names it, for messages: `/Common/10.1.1.1:80`.
    pub fn full_path(&self) -> String {
        format!("/{}/{}", self.partition, self.name)
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub changes: Vec<Change>,
    pub unchanged: usize,
    /// Desired members the pool does not have (reported, not fatal).
    pub missing: Vec<String>,
    /// Pool members the controller gave no ratio (reported, not fatal).
    pub unmanaged: Vec<String>,
    /// Values clamped into 1..=max.
    pub clamped: Vec<String>,
}

impl Plan {
    pub fn warnings(&self) -> Vec<String> {
        self.missing.iter().chain(&self.unmanaged).chain(&self.clamped).cloned().collect()
    }
}

/// The controller's ratio in 1..=`max`: identity, clamped; `true` when it had to be clamped.
pub fn to_wire(ratio: u32, max: u32) -> (u32, bool) {
    let w = ratio.clamp(WIRE_MIN, max.clamp(WIRE_MIN, WIRE_MAX));
    (w, w != ratio)
}

/// The id the controller uses for a pool member: from its address and port when the address is an
/// IP, otherwise its name as BIG-IP lists it.
pub fn member_id(m: &Member) -> MemberId {
    match endpoint_of_member(&m.address, &m.name) {
        Some(ep) => ep.member_id(),
        None => MemberId::new(m.name.clone()),
    }
}

/// Match `desired` to `members` and list what differs; ratios are clamped into 1..=`max`. With
/// `groups`, ratio 0 puts a member in the standby priority group instead (see the module docs).
pub fn plan(pool: &str, members: &[Member], desired: &Ratios, max: u32, groups: bool) -> Plan {
    let mut by_endpoint: HashMap<Endpoint, usize> = HashMap::new();
    let mut by_name: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, m) in members.iter().enumerate() {
        if let Some(ep) = endpoint_of_member(&m.address, &m.name) {
            by_endpoint.insert(ep, i);
        }
        by_name.insert(m.name.as_str(), i);
    }

    let mut out = Plan::default();
    let mut matched = BTreeSet::new();
    for (id, ratio) in desired.iter() {
        // IP ids match on address, route domain and port (BIG-IP's `name` may be a node name);
        // anything else must be the member's name exactly.
        let found = match endpoint_of_id(id) {
            Some(ep) => by_endpoint.get(&ep).copied(),
            None => by_name.get(id.as_str()).copied(),
        };
        let Some(i) = found else {
            out.missing.push(format!(
                "member {id} has a ratio but is not in BIG-IP pool {pool}: add it to the pool, or fix the \
                 controller's membership (route domain and port must match: 10.1.1.1%2:80, [2001:db8::1]:80)"
            ));
            continue;
        };
        matched.insert(i);
        let m = &members[i];
        let standby = groups && ratio == 0;
        let to = if standby {
            m.ratio
        } else {
            let (to, clamped) = to_wire(ratio, max);
            if clamped {
                out.clamped.push(format!(
                    "member {id}: ratio {ratio} is outside the sink's {WIRE_MIN}..={max} (max_ratio); sent {to}"
                ));
            }
            to
        };
        let group = match (groups, standby) {
            (false, _) => None,
            (true, true) => Some(STANDBY_GROUP),
            (true, false) => Some(ACTIVE_GROUP),
        }
        .filter(|g| *g != m.priority_group);
        if m.ratio == to && group.is_none() {
            out.unchanged += 1;
        } else {
            out.changes.push(Change {
                id: id.clone(),
                partition: m.partition.clone(),
                name: m.name.clone(),
                from: m.ratio,
                to,
                group,
            });
        }
    }
    for (i, m) in members.iter().enumerate() {
        if !matched.contains(&i) {
            out.unmanaged.push(format!(
                "BIG-IP pool {pool} member /{}/{} (address {}) gets no ratio from the controller; left at {}",
                m.partition, m.name, m.address, m.ratio
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(name: &str, address: &str, ratio: u32) -> Member {
        Member {
            name: name.into(),
            partition: "Common".into(),
            address: address.into(),
            ratio,
            priority_group: 0,
        }
    }

    fn r(pairs: &[(&str, u32)]) -> Ratios {
        pairs.iter().map(|(k, v)| (MemberId::from(*k), *v)).collect()
    }

    #[test]
    fn only_differences_change() {
        let members = [m("10.0.0.1:80", "10.0.0.1", 5), m("10.0.0.2:80", "10.0.0.2", 1)];
        let p = plan("/Common/p", &members, &r(&[("10.0.0.1:80", 5), ("10.0.0.2:80", 7)]), 100, false);
        assert_eq!(p.unchanged, 1);
        assert_eq!(p.changes.len(), 1);
        assert_eq!(p.changes[0].name, "10.0.0.2:80");
        assert_eq!((p.changes[0].from, p.changes[0].to), (1, 7));
        assert!(p.warnings().is_empty());
    }

    #[test]
    fn route_domain_ipv6_and_node_names_match_on_address() {
        let members = [
            m("10.1.1.1%2:80", "10.1.1.1%2", 1),
            m("2001:db8::1.80", "2001:db8::1", 1),
            m("vllm-0:8000", "10.2.0.1", 1),
            m("10.1.1.1:80", "10.1.1.1", 1),
        ];
        let p = plan(
            "/Common/p",
            &members,
            &r(&[("10.1.1.1%2:80", 2), ("[2001:db8::1]:80", 3), ("10.2.0.1:8000", 4), ("10.1.1.1:80", 5)]),
            100,
            false,
        );
        let got: Vec<(String, u32)> = p.changes.iter().map(|c| (c.name.clone(), c.to)).collect();
        assert_eq!(
            got,
            vec![
                ("10.1.1.1%2:80".to_string(), 2),
                ("10.1.1.1:80".to_string(), 5),
                ("vllm-0:8000".to_string(), 4),
                ("2001:db8::1.80".to_string(), 3),
            ]
        );
        assert!(p.warnings().is_empty(), "{:?}", p.warnings());
    }

    #[test]
    fn route_domain_must_match() {
        let p =
            plan("/Common/p", &[m("10.1.1.1%2:80", "10.1.1.1%2", 1)], &r(&[("10.1.1.1:80", 3)]), 100, false);
        assert!(p.changes.is_empty());
        assert_eq!(p.missing.len(), 1);
        assert!(p.missing[0].contains("10.1.1.1:80") && p.missing[0].contains("/Common/p"));
        assert_eq!(p.unmanaged.len(), 1);
        assert!(p.unmanaged[0].contains("/Common/10.1.1.1%2:80"));
    }

    #[test]
    fn clamping_into_wire_range() {
        let members = [m("10.0.0.1:80", "10.0.0.1", 3), m("10.0.0.2:80", "10.0.0.2", 3)];
        let p =
            plan("/Common/p", &members, &r(&[("10.0.0.1:80", 0), ("10.0.0.2:80", 70_000)]), WIRE_MAX, false);
        let got: Vec<u32> = p.changes.iter().map(|c| c.to).collect();
        assert_eq!(got, vec![1, 65_535]);
        assert_eq!(p.clamped.len(), 2);
        assert_eq!(to_wire(1, WIRE_MAX), (1, false));
        assert_eq!(to_wire(65_535, WIRE_MAX), (65_535, false));
        // The default cap is F5's documented 100.
        let p = plan(
            "/Common/p",
            &members,
            &r(&[("10.0.0.1:80", 100), ("10.0.0.2:80", 250)]),
            DEFAULT_MAX_RATIO,
            false,
        );
        let got: Vec<u32> = p.changes.iter().map(|c| c.to).collect();
        assert_eq!(got, vec![100, 100]);
        assert!(p.clamped[0].contains("1..=100"), "{:?}", p.clamped);
    }

    #[test]
    fn non_ip_ids_match_member_names() {
        let p = plan("/Common/p", &[m("vllm-0:8000", "10.2.0.1", 1)], &r(&[("vllm-0:8000", 9)]), 100, false);
        assert_eq!(p.changes.len(), 1);
        assert_eq!(member_id(&m("vllm-0:8000", "10.2.0.1", 1)).as_str(), "10.2.0.1:8000");
        assert_eq!(member_id(&m("fqdn-node:80", "any6", 1)).as_str(), "fqdn-node:80");
    }

    #[test]
    fn with_groups_ratio_zero_is_the_standby_group_and_the_ratio_is_kept() {
        let mut east = m("10.0.0.1:80", "10.0.0.1", 50);
        east.priority_group = 0;
        let mut west = m("10.9.0.1:80", "10.9.0.1", 40);
        west.priority_group = ACTIVE_GROUP;
        let desired = r(&[("10.0.0.1:80", 60), ("10.9.0.1:80", 0)]);
        let p = plan("/Common/p", &[east.clone(), west.clone()], &desired, 100, true);
        let got: Vec<(&str, u32, u32, Option<u32>)> =
            p.changes.iter().map(|c| (c.name.as_str(), c.from, c.to, c.group)).collect();
        assert_eq!(
            got,
            vec![("10.0.0.1:80", 50, 60, Some(ACTIVE_GROUP)), ("10.9.0.1:80", 40, 40, Some(STANDBY_GROUP))]
        );
        assert!(p.warnings().is_empty(), "ratio 0 is not clamped with groups: {:?}", p.warnings());
        // Already in place: nothing to do.
        east.ratio = 60;
        east.priority_group = ACTIVE_GROUP;
        west.priority_group = STANDBY_GROUP;
        let p = plan("/Common/p", &[east.clone(), west.clone()], &desired, 100, true);
        assert_eq!((p.changes.len(), p.unchanged), (0, 2));
        // Spill over: the standby member gets a ratio and joins the active group in one change.
        let p = plan("/Common/p", &[east, west], &r(&[("10.0.0.1:80", 60), ("10.9.0.1:80", 30)]), 100, true);
        assert_eq!(p.changes.len(), 1);
        assert_eq!((p.changes[0].to, p.changes[0].group), (30, Some(ACTIVE_GROUP)));
    }
}
