//! The slice of Envoy's xDS JSON that EDS needs: `DiscoveryRequest`, `DiscoveryResponse` and
//! `ClusterLoadAssignment`, as Envoy's REST transport and its filesystem subscriptions spell them.
//!
//! Envoy writes snake_case field names; protobuf's JSON mapping also accepts lowerCamelCase, so the
//! readers take both (a hand-edited file may use either). Unknown fields are ignored: Envoy's
//! request carries a large `node` (every extension it was built with) that only its `id` matters from.

use serde::{Deserialize, Serialize};

/// Type URL of a `ClusterLoadAssignment`, in requests, responses and each resource's `@type`.
pub const CLA_TYPE_URL: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// What Envoy POSTs to `/v3/discovery:endpoints` every refresh period.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct DiscoveryRequest {
    /// The version Envoy last accepted; empty on its first request after a start.
    #[serde(default, alias = "versionInfo")]
    pub version_info: String,
    #[serde(default)]
    pub node: Option<Node>,
    /// EDS service names Envoy wants; empty means all (wildcard).
    #[serde(default, alias = "resourceNames")]
    pub resource_names: Vec<String>,
    #[serde(default, alias = "typeUrl")]
    pub type_url: String,
    /// Set by Envoy on gRPC streams when it rejected the last response (NACK).
    #[serde(default, alias = "errorDetail", skip_serializing_if = "Option::is_none")]
    pub error_detail: Option<serde_json::Value>,
}

/// Who is asking. Only the identity is kept; the rest of Envoy's node description is ignored.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct Node {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub cluster: String,
}

/// The answer: one `ClusterLoadAssignment` per requested, known cluster.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct DiscoveryResponse {
    #[serde(default, alias = "versionInfo")]
    pub version_info: String,
    #[serde(default)]
    pub resources: Vec<ClusterLoadAssignment>,
    #[serde(default = "cla_type_url", alias = "typeUrl")]
    pub type_url: String,
}

/// `envoy.config.endpoint.v3.ClusterLoadAssignment`, packed as a `google.protobuf.Any` (hence `@type`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct ClusterLoadAssignment {
    #[serde(rename = "@type", default = "cla_type_url")]
    pub type_url: String,
    #[serde(alias = "clusterName")]
    pub cluster_name: String,
    #[serde(default)]
    pub endpoints: Vec<LocalityLbEndpoints>,
}

/// One locality's endpoints. The controller puts every member it serves in one locality at priority
/// 0, and with `priority_levels` the members of inactive tiers in a second one at priority 1.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct LocalityLbEndpoints {
    #[serde(default, alias = "lbEndpoints")]
    pub lb_endpoints: Vec<LbEndpoint>,
    /// Envoy sends traffic to priority 1 only while priority 0 is less than ~71% healthy (its
    /// overprovisioning factor 1.4). Left out at 0, so assignments without priorities (and their
    /// versions) are as before.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct LbEndpoint {
    pub endpoint: Endpoint,
    /// Envoy requires >= 1; absent means 1.
    #[serde(default = "one", alias = "loadBalancingWeight")]
    pub load_balancing_weight: u32,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct Endpoint {
    pub address: Address,
    /// The member's DNS name when it was given as one; Envoy shows it in `/clusters` and can use it
    /// for `auto_host_rewrite`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct Address {
    #[serde(alias = "socketAddress")]
    pub socket_address: SocketAddress,
}

/// Envoy's EDS takes IP literals only (`malformed IP address` otherwise); names are resolved first.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct SocketAddress {
    pub address: String,
    #[serde(alias = "portValue")]
    pub port_value: u16,
}

fn cla_type_url() -> String {
    CLA_TYPE_URL.to_string()
}

fn one() -> u32 {
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_envoys_request_and_ignores_the_node_details() {
        // Shape of a real Envoy 1.40 request body, trimmed (the real node lists ~200 extensions).
        let body = r#"{"version_info":"v1","node":{"id":"edge-1","cluster":"edge","user_agent_name":"envoy",
            "extensions":[{"name":"envoy.cluster.eds","category":"envoy.clusters"}]},
            "resource_names":["vllm"],"type_url":"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"}"#;
        let req: DiscoveryRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.version_info, "v1");
        assert_eq!(req.node.unwrap().id, "edge-1");
        assert_eq!(req.resource_names, vec!["vllm".to_string()]);
        assert_eq!(req.type_url, CLA_TYPE_URL);
    }

    #[test]
    fn camel_case_and_missing_weight_are_read_like_envoy_reads_them() {
        let body = r#"{"versionInfo":"7","resources":[{"@type":"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "clusterName":"vllm","endpoints":[{"lbEndpoints":[{"endpoint":{"address":{"socketAddress":{"address":"10.0.0.1","portValue":8000}}}}]}]}]}"#;
        let resp: DiscoveryResponse = serde_json::from_str(body).unwrap();
        let ep = &resp.resources[0].endpoints[0].lb_endpoints[0];
        assert_eq!(resp.resources[0].cluster_name, "vllm");
        assert_eq!(ep.load_balancing_weight, 1);
        assert_eq!(ep.endpoint.address.socket_address.port_value, 8000);
    }
}
