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
//! for them.

use crate::report::CycleReport;

/// The text for `pool`, or `None` when the last cycle has no such pool.
pub fn pool_text(report: &CycleReport, pool: &str) -> Option<String> {
    let p = report.pools.iter().find(|p| p.pool == pool)?;
    let state = serde_json::to_value(p.state).ok().and_then(|v| v.as_str().map(str::to_string));
    let mut out = format!(
        "# llm-load-controller pool {} state {} ts {}\n",
        p.pool,
        state.as_deref().unwrap_or("unknown"),
        report.ts
    );
    for m in &p.members {
        let Some((addr, port)) = split_member(&m.member) else { continue };
        out.push_str(&format!("{addr} {port} {}\n", m.ratio));
    }
    Some(out)
}

/// `10.1.1.1:80` -> (`10.1.1.1`, `80`); `[2001:db8::1]:80` -> (`2001:db8::1`, `80`).
fn split_member(id: &str) -> Option<(&str, &str)> {
    let (host, port) = id.rsplit_once(':')?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    (!host.is_empty() && port.parse::<u16>().is_ok()).then_some((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_split_into_address_and_port() {
        assert_eq!(split_member("10.1.1.1:80"), Some(("10.1.1.1", "80")));
        assert_eq!(split_member("10.1.1.1%2:80"), Some(("10.1.1.1%2", "80")));
        assert_eq!(split_member("[2001:db8::1]:8000"), Some(("2001:db8::1", "8000")));
        assert_eq!(split_member("vllm-0:8000"), Some(("vllm-0", "8000")));
        assert_eq!(split_member("no-port"), None);
        assert_eq!(split_member(":80"), None);
    }
}
