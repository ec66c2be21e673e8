//! Members from a Gateway API Inference Extension `InferencePool` (`inference.networking.k8s.io/v1`):
//! the ready pods its `spec.selector` selects, on each of its `spec.targetPorts`.
//!
//! ```yaml
//! members: { kubernetes: { inference_pool: vllm-llama3, namespace: llm-serving } }
//! ```
//!
//! An InferencePool names no Service: the gateway's endpoint picker reads the pods itself. So do
//! we: one GET of the pool and one LIST of the pods its selector names per cycle. A pod counts when
//! its `Ready` condition is `True`, it has an IP, and it is not being deleted (a terminating pod
//! leaves before it stops serving). The pool's selector is `matchLabels` only in v1; its
//! `targetPorts` list one to eight port numbers. The member carries its pod's node as the `node`
//! label (a pod does not say its zone).

use std::collections::BTreeMap;

use llm_lc_adapters::MemberId;
use serde::Deserialize;

use super::kubernetes::Labelled;

/// The API group and version of the InferencePools read.
pub const API: &str = "inference.networking.k8s.io/v1";

// --- the wire: only the fields we read (unknown ones are ignored, as API clients must) ---

#[derive(Debug, Deserialize)]
pub struct InferencePool {
    pub spec: PoolSpec,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    pub selector: Selector,
    #[serde(default)]
    pub target_ports: Vec<TargetPort>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Selector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
pub struct TargetPort {
    pub number: i64,
}

#[derive(Debug, Deserialize)]
pub struct PodList {
    #[serde(default)]
    pub items: Vec<Pod>,
}

#[derive(Debug, Deserialize)]
pub struct Pod {
    #[serde(default)]
    pub metadata: PodMeta,
    #[serde(default)]
    pub spec: PodSpec,
    #[serde(default)]
    pub status: PodStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodMeta {
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub deletion_timestamp: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default)]
    pub node_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    /// Kubernetes spells it `podIP`, not camelCase's `podIp`.
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
    #[serde(default)]
    pub conditions: Vec<PodCondition>,
}

#[derive(Debug, Deserialize)]
pub struct PodCondition {
    #[serde(rename = "type")]
    pub kind: String,
    pub status: String,
}

impl InferencePool {
    /// The pool's selector as a `labelSelector` query value (`k=v,k2=v2`), or why it cannot be
    /// used: an empty selector would select every pod of the namespace.
    pub fn label_selector(&self) -> Result<String, String> {
        if self.spec.selector.match_labels.is_empty() {
            return Err("its spec.selector.matchLabels is empty (it would select every pod)".into());
        }
        Ok(self
            .spec
            .selector
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(","))
    }

    /// Its target ports, or why it has none usable.
    pub fn ports(&self) -> Result<Vec<u16>, String> {
        let ports: Vec<u16> = self
            .spec
            .target_ports
            .iter()
            .filter_map(|p| u16::try_from(p.number).ok().filter(|n| *n > 0))
            .collect();
        if ports.is_empty() {
            return Err("it lists no valid spec.targetPorts".into());
        }
        Ok(ports)
    }
}

/// The members: `ip:port` (IPv6 as `[ip]:port`) of every ready, live pod whose labels match the
/// selector (the API server filtered already; checked again, so a server that ignored the
/// selector cannot add strangers), on each port of `ports`, sorted, once each.
pub fn ready_pod_members(selector: &BTreeMap<String, String>, ports: &[u16], pods: &[Pod]) -> Vec<Labelled> {
    let mut out: Vec<Labelled> = Vec::new();
    for pod in pods {
        let matches = selector.iter().all(|(k, v)| pod.metadata.labels.get(k) == Some(v));
        let ready = pod.status.conditions.iter().any(|c| c.kind == "Ready" && c.status == "True");
        let Some(ip) = pod.status.pod_ip.as_deref().filter(|ip| !ip.is_empty()) else { continue };
        if !matches || !ready || pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let labels: BTreeMap<String, String> =
            pod.spec.node_name.iter().map(|n| ("node".to_string(), n.clone())).collect();
        for port in ports {
            let id = if ip.contains(':') { format!("[{ip}]:{port}") } else { format!("{ip}:{port}") };
            out.push((MemberId::new(id), labels.clone()));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out.dedup_by(|a, b| a.0 == b.0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods(json: &str) -> Vec<Pod> {
        serde_json::from_str::<PodList>(json).expect("pod list").items
    }

    #[test]
    fn ready_live_matching_pods_on_every_target_port() {
        let pool: InferencePool = serde_json::from_str(
            r#"{"apiVersion":"inference.networking.k8s.io/v1","kind":"InferencePool","metadata":{"name":"p"},
               "spec":{"selector":{"matchLabels":{"app":"vllm","model":"llama"}},"targetPorts":[{"number":8000},{"number":8001}],
                       "endpointPickerRef":{"name":"epp","port":{"number":9002}}}}"#,
        )
        .expect("pool");
        assert_eq!(pool.label_selector(), Ok("app=vllm,model=llama".into()));
        assert_eq!(pool.ports(), Ok(vec![8000, 8001]));
        let list = pods(
            r#"{"items":[
              {"metadata":{"labels":{"app":"vllm","model":"llama"}},"spec":{"nodeName":"w1"},
               "status":{"podIP":"10.0.0.2","conditions":[{"type":"Ready","status":"True"}]}},
              {"metadata":{"labels":{"app":"vllm","model":"llama"}},
               "status":{"podIP":"fd00::7","conditions":[{"type":"Ready","status":"True"}]}},
              {"metadata":{"labels":{"app":"vllm","model":"llama"}},
               "status":{"podIP":"10.0.0.3","conditions":[{"type":"Ready","status":"False"}]}},
              {"metadata":{"labels":{"app":"vllm","model":"llama"},"deletionTimestamp":"2026-12-07T10:00:00Z"},
               "status":{"podIP":"10.0.0.4","conditions":[{"type":"Ready","status":"True"}]}},
              {"metadata":{"labels":{"app":"vllm","model":"other"}},
               "status":{"podIP":"10.0.0.5","conditions":[{"type":"Ready","status":"True"}]}},
              {"metadata":{"labels":{"app":"vllm","model":"llama"}},
               "status":{"conditions":[{"type":"Ready","status":"True"}]}}]}"#,
        );
        let got = ready_pod_members(&pool.spec.selector.match_labels, &[8000], &list);
        let ids: Vec<&str> = got.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(ids, ["10.0.0.2:8000", "[fd00::7]:8000"]);
        assert_eq!(got[0].1.get("node").map(String::as_str), Some("w1"));
        assert!(got[1].1.is_empty());
    }

    #[test]
    fn a_pool_without_selector_or_ports_is_refused_with_the_reason() {
        let pool: InferencePool =
            serde_json::from_str(r#"{"spec":{"selector":{},"targetPorts":[{"number":0},{"number":70000}]}}"#)
                .expect("pool");
        assert!(pool.label_selector().expect_err("empty").contains("every pod"));
        assert!(pool.ports().expect_err("no port").contains("targetPorts"));
    }
}
