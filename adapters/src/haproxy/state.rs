//! Parse `show servers state BACKEND`: which servers HAProxy has and the weights they carry now.
//!
//! The reply is a version line (`1`), a `# `-prefixed header naming the columns, then one space-separated
//! line per server. Columns are looked up by header name, not position, so added columns in later
//! HAProxy versions do not break us.

use std::net::IpAddr;

use crate::MemberId;

/// One server of a backend, as HAProxy reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerState {
    pub name: String,
    /// `srv_addr`: the IP HAProxy connects to (`-` or unspecified when not resolved yet).
    pub addr: String,
    pub port: u16,
    /// `srv_fqdn`: the hostname written in haproxy.cfg, when the server was given by name.
    pub fqdn: Option<String>,
    /// `srv_uweight`: the weight in force now (runtime changes included).
    pub weight: u32,
    /// `srv_iweight`: the weight from haproxy.cfg.
    pub initial_weight: u32,
}

impl ServerState {
    /// `addr:port` (IPv6 in brackets), or `None` when HAProxy has no usable address for the server
    /// (a `server-template` slot not resolved yet).
    pub fn member_id(&self) -> Option<MemberId> {
        if self.port == 0 {
            return None;
        }
        match self.addr.parse::<IpAddr>() {
            Ok(ip) if ip.is_unspecified() => None,
            Ok(IpAddr::V6(v6)) => Some(MemberId::new(format!("[{v6}]:{}", self.port))),
            Ok(IpAddr::V4(v4)) => Some(MemberId::new(format!("{v4}:{}", self.port))),
            Err(_) if self.addr.is_empty() || self.addr == "-" => None,
            Err(_) => Some(MemberId::new(format!("{}:{}", self.addr, self.port))),
        }
    }

    /// Whether this server is `host:port`: by IP (any spelling of the same address), or by the
    /// hostname it was configured with.
    pub fn has_address(&self, host: &str, port: u16) -> bool {
        if self.port != port {
            return false;
        }
        let same_ip = match (host.parse::<IpAddr>(), self.addr.parse::<IpAddr>()) {
            (Ok(a), Ok(b)) => a == b,
            _ => host.eq_ignore_ascii_case(&self.addr),
        };
        same_ip || self.fqdn.as_deref().is_some_and(|f| f.eq_ignore_ascii_case(host))
    }
}

/// Parse the reply of `show servers state BACKEND`. `Err` carries the reply when it is not a server
/// table (HAProxy answers errors in plain text, e.g. `Can't find backend.`).
pub fn parse_servers_state(reply: &str) -> Result<Vec<ServerState>, String> {
    let mut lines = reply.lines();
    let header = lines.by_ref().find_map(|l| l.strip_prefix("# ")).ok_or_else(|| reply.trim().to_string())?;
    let cols: Vec<&str> = fields(header);
    let col = |name: &str| cols.iter().position(|c| *c == name);
    let need = |name: &str| col(name).ok_or_else(|| format!("`show servers state` has no column {name}"));
    let (name_i, addr_i, port_i, uw_i, iw_i) =
        (need("srv_name")?, need("srv_addr")?, need("srv_port")?, need("srv_uweight")?, need("srv_iweight")?);
    let fqdn_i = col("srv_fqdn");

    let mut servers = Vec::new();
    for line in lines.filter(|l| !l.trim().is_empty()) {
        let f = fields(line);
        // A field holding a separator would shift every column after it and make a member of a
        // fragment; HAProxy writes as many fields as its header names, so anything else is refused.
        if f.len() != cols.len() {
            return Err(format!(
                "a line of `show servers state` has {} fields where the header names {}: {line}",
                f.len(),
                cols.len()
            ));
        }
        let field =
            |i: usize| f.get(i).copied().ok_or_else(|| format!("short line in `show servers state`: {line}"));
        let num = |i: usize| -> Result<u32, String> {
            let v = field(i)?;
            v.parse().map_err(|_| format!("column {} is not a number in: {line}", cols[i]))
        };
        servers.push(ServerState {
            name: field(name_i)?.to_string(),
            addr: field(addr_i)?.to_string(),
            port: u16::try_from(num(port_i)?).map_err(|_| format!("port out of range in: {line}"))?,
            fqdn: fqdn_i.and_then(|i| f.get(i)).filter(|v| **v != "-").map(|v| v.to_string()),
            weight: num(uw_i)?,
            initial_weight: num(iw_i)?,
        });
    }
    Ok(servers)
}

/// The fields of a line: HAProxy separates them with one ASCII space. (Unicode whitespace, which
/// `split_whitespace` also splits on, is part of a field.)
fn fields(line: &str) -> Vec<&str> {
    line.split(' ').filter(|f| !f.is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Captured from HAProxy 2.6.12 (Debian 12).
    const REPLY: &str = "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight \
        srv_iweight srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state \
        srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl srv_check_port \
        srv_check_addr srv_agent_addr srv_agent_port\n\
        3 be 1 s1 127.0.0.1 2 0 50 10 4 1 0 2 0 0 0 0 - 18081 - 0 0 - - 0\n\
        3 be 2 s2 127.0.0.1 2 0 1 1 4 1 0 2 0 0 0 0 localhost 18082 - 0 0 - - 0\n\
        3 be 3 s3 ::1 2 0 1 1 4 1 0 2 0 0 0 0 - 18083 - 0 0 - - 0\n\n";

    #[test]
    fn a_field_holding_a_separator_is_refused_not_split() {
        let header_only = REPLY.split_inclusive('\n').take(2).collect::<String>();
        let with = |addr: &str| {
            format!("{header_only}3 be 1 s1 {addr} 2 0 50 10 4 1 0 2 0 0 0 0 - 18081 - 0 0 - - 0\n")
        };
        // U+0085 is whitespace to Rust, not to HAProxy: one field, a name the door refuses.
        let s = parse_servers_state(&with("10.0.0.1\u{85}")).expect("one field");
        assert_eq!(s[0].member_id(), Some(MemberId::from("10.0.0.1\u{85}:18081")));
        // A space would shift the columns: the reply is refused.
        let err = parse_servers_state(&with("10.0.0.9 18082")).expect_err("shifted");
        assert!(err.contains("26 fields where the header names 25"), "{err}");
    }

    #[test]
    fn parses_the_real_reply() {
        let s = parse_servers_state(REPLY).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!((s[0].name.as_str(), s[0].weight, s[0].initial_weight, s[0].port), ("s1", 50, 10, 18081));
        assert_eq!(s[1].fqdn.as_deref(), Some("localhost"));
        assert_eq!(s[0].fqdn, None);
        assert_eq!(s[0].member_id(), Some(MemberId::from("127.0.0.1:18081")));
        assert_eq!(s[2].member_id(), Some(MemberId::from("[::1]:18083")));
    }

    #[test]
    fn matches_addresses_in_any_spelling_and_by_fqdn() {
        let s = parse_servers_state(REPLY).unwrap();
        assert!(s[2].has_address("0:0:0:0:0:0:0:1", 18083));
        assert!(s[1].has_address("LOCALHOST", 18082));
        assert!(s[1].has_address("127.0.0.1", 18082));
        assert!(!s[1].has_address("127.0.0.1", 18081));
    }

    #[test]
    fn error_text_is_returned() {
        assert_eq!(parse_servers_state("Can't find backend.\n\n"), Err("Can't find backend.".to_string()));
    }

    #[test]
    fn empty_backend_and_unresolved_slots() {
        let head = REPLY.split_inclusive('\n').take(2).collect::<String>();
        assert_eq!(parse_servers_state(&head).unwrap(), vec![]);
        let slot = format!("{head}3 be 4 t1 0.0.0.0 0 32 1 1 4 1 0 2 0 0 0 0 - 0 - 0 0 - - 0\n");
        assert_eq!(parse_servers_state(&slot).unwrap()[0].member_id(), None);
    }

    #[test]
    fn garbage_lines_are_errors_not_panics() {
        let head = REPLY.split_inclusive('\n').take(2).collect::<String>();
        assert!(parse_servers_state(&format!("{head}3 be 1 s1\n")).is_err());
        assert!(parse_servers_state(&format!(
            "{head}3 be 1 s1 1.2.3.4 2 0 x 1 4 1 0 2 0 0 0 0 - 80 - 0 0 - - 0\n"
        ))
        .is_err());
    }
}
