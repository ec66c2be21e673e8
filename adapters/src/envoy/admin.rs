//! Reading one cluster's endpoints from Envoy's admin interface (`GET /clusters?format=json`), for
//! membership discovery (`members: { from_lb: true }`) and dry runs: what Envoy routes to now.

use serde::Deserialize;

use crate::MemberId;

#[derive(Deserialize)]
struct Clusters {
    #[serde(default)]
    cluster_statuses: Vec<ClusterStatus>,
}

#[derive(Deserialize)]
struct ClusterStatus {
    name: String,
    #[serde(default)]
    host_statuses: Vec<HostStatus>,
}

#[derive(Deserialize)]
struct HostStatus {
    address: Address,
}

#[derive(Deserialize)]
struct Address {
    socket_address: Option<SocketAddress>,
}

#[derive(Deserialize)]
struct SocketAddress {
    address: String,
    port_value: u16,
}

/// The members (`ip:port`, IPv6 in brackets) of `cluster` in an admin `/clusters?format=json` body;
/// `None` when Envoy has no such cluster.
pub fn members_of(body: &[u8], cluster: &str) -> Result<Option<Vec<MemberId>>, String> {
    let parsed: Clusters =
        serde_json::from_slice(body).map_err(|e| format!("not Envoy's /clusters?format=json answer: {e}"))?;
    let Some(c) = parsed.cluster_statuses.into_iter().find(|c| c.name == cluster) else {
        return Ok(None);
    };
    let mut out: Vec<MemberId> = c
        .host_statuses
        .into_iter()
        .filter_map(|h| h.address.socket_address)
        .map(|s| {
            if s.address.contains(':') {
                MemberId::new(format!("[{}]:{}", s.address, s.port_value))
            } else {
                MemberId::new(format!("{}:{}", s.address, s.port_value))
            }
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_hosts_of_one_cluster() {
        let body = br#"{"cluster_statuses":[
            {"name":"other","host_statuses":[{"address":{"socket_address":{"address":"10.0.0.9","port_value":1}}}]},
            {"name":"vllm","added_via_api":true,"host_statuses":[
                {"address":{"socket_address":{"address":"10.0.0.2","port_value":8000}},"weight":3},
                {"address":{"socket_address":{"address":"::1","port_value":8000}}},
                {"address":{"pipe":{"path":"/tmp/x"}}}]}]}"#;
        let m = members_of(body, "vllm").expect("parses").expect("cluster");
        assert_eq!(m, vec![MemberId::from("10.0.0.2:8000"), MemberId::from("[::1]:8000")]);
        assert_eq!(members_of(body, "nope").expect("parses"), None);
        assert!(members_of(b"<html>", "vllm").is_err());
    }
}
