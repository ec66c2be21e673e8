//! `GET /v1/ratios/{pool}`: one pool's ratios as plain text, for load balancers that pull them
//! (the BIG-IP sideband iRule, deploy/bigip/irule/sideband.tcl) and cannot parse JSON cheaply.
//!
//! ```text
//! # llm-load-controller pool llama-8b state ok ts 2026-12-03T06:00:00Z
//! 10.1.1.11 8000 37
//! 2001:db8::21 8000 50
//! vllm-0 8000 12
//! ```
//!
//! One member per line: address (IPv6 without brackets, route domain `%N` kept), port, ratio,
//! separated by one space, so a Tcl `split` and `lassign` read it. Lines starting with `#` are
//! comments. Members the controller has no ratio for are left out: the puller keeps its own choice
//! for them. So is any member that is not strictly `host:port` (a name that slipped past discovery's
//! check cannot add a field or a line), and the header shows the pool name as one token.

use llm_lc_adapters::{name, MemberId};

use crate::report::CycleReport;

/// The text for `pool`, or `None` when the last cycle has no such pool.
pub fn pool_text(report: &CycleReport, pool: &str) -> Option<String> {
    let p = report.pools.iter().find(|p| p.pool == pool)?;
    let mut out = format!(
        "# llm-load-controller pool {} state {} ts {}\n",
        name::escape_name(&p.pool),
        p.state.as_str(),
        report.ts
    );
    for m in &p.members {
        if let Some(line) = member_line(&m.member, m.ratio) {
            out.push_str(&line);
        }
    }
    Some(out)
}

/// `10.1.1.1:80` -> `10.1.1.1 80 7`; `[2001:db8::1]:80` -> `2001:db8::1 80 7`; `None` for an id
/// without a port or with anything a host:port may not hold.
fn member_line(id: &str, ratio: u32) -> Option<String> {
    if !name::is_host_port(id) {
        return None;
    }
    let id = MemberId::from(id);
    let (host, port) = id.host_port()?;
    Some(format!("{host} {port} {ratio}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_written_as_address_port_ratio() {
        assert_eq!(member_line("10.1.1.1:80", 7).as_deref(), Some("10.1.1.1 80 7\n"));
        assert_eq!(member_line("10.1.1.1%2:80", 7).as_deref(), Some("10.1.1.1%2 80 7\n"));
        assert_eq!(member_line("[2001:db8::1]:8000", 9).as_deref(), Some("2001:db8::1 8000 9\n"));
        assert_eq!(member_line("vllm-0:8000", 1).as_deref(), Some("vllm-0 8000 1\n"));
        assert_eq!(member_line("no-port", 1), None);
        assert_eq!(member_line(":80", 1), None);
        for forged in ["a b:80", "a:80\n10.9.9.9 80 100", "a\t1:80", "a\":80", "<b>:80"] {
            assert_eq!(member_line(forged, 1), None, "{forged:?}");
        }
    }
}
