//! BIG-IP object names and how they appear in iControl REST paths, and how a pool member is matched
//! to one of our [`MemberId`]s.
//!
//! Facts this module relies on (from F5's iControl REST user guide and the DevCentral "Demystifying
//! iControl REST" series, restated):
//! - an object is addressed as `~Partition~name` (or `~Partition~subPath~name`): every `/` of the full
//!   path becomes `~`;
//! - a route-domain address carries `%ID` (`10.1.1.1%2`); a literal `%` in a URL must travel as `%25`,
//!   so the member `10.1.1.1%2:80` is addressed as `~Common~10.1.1.1%252:80`;
//! - a pool member's name is `node:port` for IPv4 and named nodes, and `node.port` for IPv6 nodes
//!   (`2001:db8::1.80`), because the colons already belong to the address;
//! - the member's `address` property is always the IP (with `%ID` when in a non-default route
//!   domain), while its `name` may be a node name: matching is done on address and port.

use std::fmt;
use std::net::IpAddr;

use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};

use crate::MemberId;

/// Characters that cannot appear raw in one path segment. `%` is the one that matters for BIG-IP
/// (route domains); the rest would make the URL ambiguous if a name ever contained them. `\` too:
/// the URL parser reads it as `/` in http(s) URLs and then resolves `..`, so a member name read
/// back from the BIG-IP holding `\..\` would otherwise aim a PATCH at another iControl path.
const SEGMENT: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'/')
    .add(b'\\')
    .add(b'?')
    .add(b'<')
    .add(b'>')
    .add(b'{')
    .add(b'}');

/// A pool's full path, checked: `/Partition/name` or `/Partition/folder/name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPath(String);

impl PoolPath {
    /// Parse a pool name as users write it. The partition is required: `/Common/llm_pool`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let hint = "write the pool with its partition, e.g. /Common/llm_pool";
        let rest = s.strip_prefix('/').ok_or_else(|| format!("pool {s:?} has no partition; {hint}"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
            return Err(format!("pool {s:?} is not /Partition/name; {hint}"));
        }
        if let Some(c) = s.chars().find(|c| matches!(c, '~' | '%' | '?' | '#' | ' ') || c.is_control()) {
            return Err(format!("pool {s:?} contains {c:?}, which BIG-IP object names cannot contain"));
        }
        Ok(PoolPath(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The path segment that addresses this pool: `~Common~llm_pool`.
    pub fn segment(&self) -> String {
        object_segment(&self.0)
    }
}

impl fmt::Display for PoolPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The path segment addressing an object with this full path (`/Common/10.1.1.1%2:80` becomes
/// `~Common~10.1.1.1%252:80`).
pub fn object_segment(full_path: &str) -> String {
    utf8_percent_encode(&full_path.replace('/', "~"), SEGMENT).to_string()
}

/// The segment for a member as BIG-IP listed it: its `partition` and `name`, never rebuilt from our
/// own idea of the name, so node-named and IPv6 members are addressed exactly as BIG-IP knows them.
pub fn member_segment(partition: &str, name: &str) -> String {
    object_segment(&format!("/{partition}/{name}"))
}

/// What identifies a pool member across naming styles: IP (canonical form), route domain, port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub route_domain: Option<u16>,
    pub port: u16,
}

impl Endpoint {
    /// The [`MemberId`] the controller uses for this endpoint: `10.1.1.1:80`, `10.1.1.1%2:80`,
    /// `[2001:db8::1]:80`, `[2001:db8::1%2]:80`.
    pub fn member_id(&self) -> MemberId {
        let rd = self.route_domain.map(|d| format!("%{d}")).unwrap_or_default();
        match self.ip {
            IpAddr::V4(ip) => MemberId::new(format!("{ip}{rd}:{}", self.port)),
            IpAddr::V6(ip) => MemberId::new(format!("[{ip}{rd}]:{}", self.port)),
        }
    }
}

/// Split `10.1.1.1%2` into the IP and its route domain. `None` when the host is not an IP address.
pub fn parse_address(addr: &str) -> Option<(IpAddr, Option<u16>)> {
    let (ip, rd) = match addr.split_once('%') {
        Some((ip, rd)) => (ip, Some(rd.parse::<u16>().ok()?)),
        None => (addr, None),
    };
    Some((ip.parse().ok()?, rd))
}

/// The endpoint a [`MemberId`] names, when its host is an IP address.
pub fn endpoint_of_id(id: &MemberId) -> Option<Endpoint> {
    let (host, port) = id.host_port()?;
    let (ip, route_domain) = parse_address(host)?;
    Some(Endpoint { ip, route_domain, port })
}

/// The port in a member name: after the last `:` (`10.1.1.1:80`, `node-a:80`) or, for IPv6 names
/// that hold several colons, after the last `.` (`2001:db8::1.80`).
pub fn port_of_member_name(name: &str) -> Option<u16> {
    let sep = if name.matches(':').count() > 1 { '.' } else { ':' };
    name.rsplit_once(sep)?.1.parse().ok()
}

/// The endpoint of a pool member from the `address` and `name` BIG-IP reported.
pub fn endpoint_of_member(address: &str, name: &str) -> Option<Endpoint> {
    let (ip, route_domain) = parse_address(address)?;
    Some(Endpoint { ip, route_domain, port: port_of_member_name(name)? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_paths() {
        assert_eq!(PoolPath::parse("/Common/llm_pool").unwrap().segment(), "~Common~llm_pool");
        assert_eq!(PoolPath::parse("/Tenant/app.app/pool").unwrap().segment(), "~Tenant~app.app~pool");
        assert!(PoolPath::parse("llm_pool").unwrap_err().contains("partition"));
        assert!(PoolPath::parse("/llm_pool").is_err());
        assert!(PoolPath::parse("/Common/").is_err());
        assert!(PoolPath::parse("/Common/a~b").is_err());
    }

    #[test]
    fn member_segments_encode_route_domains() {
        assert_eq!(member_segment("Common", "10.1.1.1:80"), "~Common~10.1.1.1:80");
        assert_eq!(member_segment("Common", "10.1.1.1%2:80"), "~Common~10.1.1.1%252:80");
        assert_eq!(member_segment("Common", "2001:db8::1.80"), "~Common~2001:db8::1.80");
        assert_eq!(member_segment("Common", "2001:db8::1%3.80"), "~Common~2001:db8::1%253.80");
    }

    #[test]
    fn backslashes_and_dots_cannot_climb_out_of_the_member_path() {
        let segment = member_segment("Common", "a\\..\\..\\b");
        assert_eq!(segment, "~Common~a%5C..%5C..%5Cb");
        let url = reqwest::Url::parse("https://lb/mgmt/tm/ltm/pool/~Common~p/members/")
            .and_then(|base| base.join(&segment))
            .expect("joins");
        assert_eq!(url.path(), "/mgmt/tm/ltm/pool/~Common~p/members/~Common~a%5C..%5C..%5Cb");
    }

    #[test]
    fn member_names_and_ids_agree() {
        let cases = [
            ("10.1.1.1", "10.1.1.1:80", "10.1.1.1:80"),
            ("10.1.1.1%2", "10.1.1.1%2:80", "10.1.1.1%2:80"),
            ("10.1.1.1", "vllm-0:8000", "10.1.1.1:8000"),
            ("2001:db8::1", "2001:db8::1.80", "[2001:db8::1]:80"),
            ("2001:db8::1%2", "2001:db8::1%2.80", "[2001:db8::1%2]:80"),
        ];
        for (address, name, id) in cases {
            let ep = endpoint_of_member(address, name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(ep.member_id().as_str(), id);
            assert_eq!(endpoint_of_id(&MemberId::from(id)), Some(ep), "{id}");
        }
    }

    #[test]
    fn ipv6_ids_match_whatever_the_spelling() {
        let a = endpoint_of_id(&MemberId::from("[2001:0db8:0:0::1]:80")).unwrap();
        let b = endpoint_of_member("2001:db8::1", "2001:db8::1.80").unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn non_ip_hosts_have_no_endpoint() {
        assert_eq!(endpoint_of_id(&MemberId::from("vllm-0.svc:8000")), None);
        assert_eq!(parse_address("10.1.1.1%x"), None);
    }
}
