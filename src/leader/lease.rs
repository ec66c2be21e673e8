//! The `coordination.k8s.io/v1` Lease as it travels over the wire, and Kubernetes' `MicroTime`.
//!
//! Only the fields leader election reads or writes are typed; everything else the API server sends
//! (uid, creationTimestamp, managedFields, newer spec fields) is kept as raw JSON so an update sends it
//! back unchanged instead of wiping it.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub const API_VERSION: &str = "coordination.k8s.io/v1";
pub const KIND: &str = "Lease";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    #[serde(default = "api_version")]
    pub api_version: String,
    #[serde(default = "kind")]
    pub kind: String,
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: LeaseSpec,
}

fn api_version() -> String {
    API_VERSION.into()
}
fn kind() -> String {
    KIND.into()
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The optimistic-concurrency token: an update must carry the version it was based on, and the
    /// API server answers 409 Conflict when someone else wrote in between.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `spec` of a Lease. Times are `MicroTime` strings (RFC 3339, exactly six fractional digits).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_identity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_duration_seconds: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquire_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_transitions: Option<i32>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl LeaseSpec {
    /// The holder, with an empty string read as "nobody" (a released lease).
    pub fn holder(&self) -> Option<&str> {
        self.holder_identity.as_deref().filter(|h| !h.is_empty())
    }
}

impl Lease {
    pub fn new(namespace: &str, name: &str, spec: LeaseSpec) -> Lease {
        Lease {
            api_version: API_VERSION.into(),
            kind: KIND.into(),
            metadata: ObjectMeta {
                name: name.into(),
                namespace: Some(namespace.into()),
                resource_version: None,
                other: Map::new(),
            },
            spec,
        }
    }
}

/// Now as a Kubernetes `MicroTime`: `2024-05-01T12:00:00.123456Z`. The API server parses it with Go's
/// layout `2006-01-02T15:04:05.000000Z07:00`, which demands exactly six fractional digits.
pub fn micro_time_now() -> String {
    micro_time(std::time::SystemTime::now())
}

pub fn micro_time(t: std::time::SystemTime) -> String {
    // humantime prints UTC with exactly the digits asked for, `Z` for the zone.
    humantime::format_rfc3339_micros(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_time_has_six_digits_and_utc() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(1_700_000_000_000_001_000);
        assert_eq!(micro_time(t), "2023-11-14T22:13:20.000001Z");
        let s = micro_time_now();
        assert_eq!(s.len(), 27, "{s}");
        assert!(s.ends_with('Z') && s.as_bytes()[19] == b'.', "{s}");
    }

    #[test]
    fn unknown_fields_survive_a_round_trip() {
        let raw = serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "x", "namespace": "ns", "resourceVersion": "7", "uid": "u-1",
                         "managedFields": [{"manager": "kubectl"}]},
            "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "strategy": "OldestEmulationVersion"}
        });
        let lease: Lease = serde_json::from_value(raw.clone()).expect("parse");
        assert_eq!(lease.spec.holder(), Some("a"));
        assert_eq!(lease.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(serde_json::to_value(&lease).expect("serialize"), raw);
    }

    #[test]
    fn empty_holder_means_released() {
        let spec = LeaseSpec { holder_identity: Some(String::new()), ..Default::default() };
        assert_eq!(spec.holder(), None);
    }
}
