//! Members from Kubernetes: a pool's members are the ready endpoints of a Service, read from its
//! EndpointSlices (`discovery.k8s.io/v1`, label `kubernetes.io/service-name`), or the ready pods of
//! an InferencePool ([`super::inference_pool`]).
//!
//! ```yaml
//! members: { kubernetes: { service: vllm, namespace: llm-serving, port: http } }
//! members: { kubernetes: { inference_pool: vllm-llama3, namespace: llm-serving } }
//! ```
//!
//! Why EndpointSlices: on OpenShift pods come and go (rollouts, autoscaling, evictions) and the
//! Service's slices are the cluster's own answer to "who serves now, and is ready". Only endpoints
//! whose `conditions.ready` is not false count (Kubernetes says a missing condition means ready); a
//! terminating pod is not ready, so it leaves the pool before it stops serving.
//!
//! How: one LIST per pool per cycle (a poll, not a watch). At the default 5 s that is 0.2 requests
//! per second per pool, served from the API server's watch cache; it needs no long-lived stream and
//! no resync logic, and a failed LIST keeps the last known members, like every other discovery.
//! The hand-written client of `crate::leader` makes the call (docs/configuration.md, "Members from Kubernetes", says why not kube-rs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use llm_lc_adapters::{MemberId, SecretRef};
use serde::Deserialize;

use crate::kube::{ApiError, KubeApi, SERVICE_ACCOUNT_DIR};
use crate::source::SourceError;

/// `members: { kubernetes: {...} }` in the config file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesMembers {
    /// The Service whose endpoints are the members (or `inference_pool`).
    #[serde(default)]
    pub service: Option<String>,
    /// The InferencePool (`inference.networking.k8s.io/v1`) whose ready pods are the members, on
    /// its target ports (or `service`).
    #[serde(default)]
    pub inference_pool: Option<String>,
    /// Its namespace. Default: `POD_NAMESPACE`, else the service account's namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The endpoint port: its number (the pods' port, as the slices list it) or its name in the
    /// Service. May be left out when the Service has one port. With `inference_pool`: one of its
    /// target port numbers, to use only that one (default: all of them).
    #[serde(default)]
    pub port: Option<PortRef>,
    /// API server URL. Default: in-cluster (`KUBERNETES_SERVICE_HOST`/`PORT`).
    #[serde(default)]
    pub api_url: Option<String>,
    /// Bearer token. Default: the pod's service-account token file, re-read on every call.
    #[serde(default)]
    pub token: Option<SecretRef>,
    /// CA bundle of the API server. Default: the service account's `ca.crt`.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Deadline of one LIST.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_secs(5)
}

/// A port by number or by name, as a Service's `targetPort` is written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged, expecting = "a port number (8000) or a port name (http)")]
pub enum PortRef {
    Number(u16),
    Name(String),
}

impl std::fmt::Display for PortRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PortRef::Number(n) => write!(f, "{n}"),
            PortRef::Name(s) => write!(f, "{s}"),
        }
    }
}

impl KubernetesMembers {
    /// Problems visible without the API server, as `(field, message)` relative to `kubernetes`.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        // Service names are DNS-1035 labels; namespaces DNS-1123 labels; InferencePools DNS-1123
        // subdomains (Kubernetes' own rules).
        match (&self.service, &self.inference_pool) {
            (Some(service), None) => {
                if !is_dns_label(service) || !service.starts_with(|c: char| c.is_ascii_lowercase()) {
                    errs.push((
                        "service".into(),
                        format!(
                            "{service:?} is not a Service name (lowercase letters, digits and '-', starting with a letter, at most 63)"
                        ),
                    ));
                }
            }
            (None, Some(pool)) => {
                if !is_dns_subdomain(pool) {
                    errs.push((
                        "inference_pool".into(),
                        format!("{pool:?} is not an object name (lowercase letters, digits, '-' and '.', at most 253)"),
                    ));
                }
                if matches!(self.port, Some(PortRef::Name(_))) {
                    errs.push((
                        "port".into(),
                        "an InferencePool's target ports are numbers: name one of them, or leave `port` out"
                            .into(),
                    ));
                }
            }
            _ => errs.push(("service".into(), "set exactly one of `service` and `inference_pool`".into())),
        }
        if let Some(ns) = &self.namespace {
            if !is_dns_label(ns) {
                errs.push((
                    "namespace".into(),
                    format!("{ns:?} is not a namespace name (lowercase letters, digits and '-', at most 63)"),
                ));
            }
        }
        match &self.port {
            Some(PortRef::Number(0)) => errs.push(("port".into(), "must be 1..65535".into())),
            Some(PortRef::Name(n)) if !is_port_name(n) => errs.push((
                "port".into(),
                format!("{n:?} is neither a number nor a port name (at most 15 lowercase letters, digits and '-')"),
            )),
            _ => {}
        }
        if let Some(u) = &self.api_url {
            match url::Url::parse(u) {
                Ok(p) if matches!(p.scheme(), "http" | "https") => {}
                Ok(p) => {
                    errs.push(("api_url".into(), format!("scheme must be http or https, not {}", p.scheme())))
                }
                Err(e) => errs.push(("api_url".into(), format!("not a URL: {e}"))),
            }
        }
        if self.timeout.is_zero() || self.timeout > Duration::from_secs(300) {
            errs.push(("timeout".into(), "must be within 1ms..5m".into()));
        }
        errs
    }
}

fn is_dns_label(s: &str) -> bool {
    let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    !s.is_empty() && s.len() <= 63 && s.chars().all(ok) && !s.starts_with('-') && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// IANA service name, as Kubernetes validates port names.
fn is_port_name(s: &str) -> bool {
    is_dns_label(s) && s.len() <= 15 && s.chars().any(|c| c.is_ascii_lowercase()) && !s.contains("--")
}

// --- the wire: only the fields we read (unknown ones are ignored, as API clients must) ---

#[derive(Debug, Deserialize)]
pub struct SliceList {
    #[serde(default)]
    pub items: Vec<Slice>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Slice {
    #[serde(default)]
    pub metadata: Meta,
    /// `IPv4`, `IPv6` or `FQDN` (deprecated; not an address Envoy or BIG-IP can take).
    pub address_type: String,
    #[serde(default)]
    pub endpoints: Vec<Endpoint>,
    /// `null` means "all ports" (a headless Service without ports): no port to pick.
    #[serde(default)]
    pub ports: Option<Vec<SlicePort>>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Meta {
    #[serde(default)]
    pub name: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    #[serde(default)]
    pub addresses: Vec<String>,
    #[serde(default)]
    pub conditions: Conditions,
    /// The endpoint's zone (`topology.kubernetes.io/zone` of its node), when the cluster says.
    #[serde(default)]
    pub zone: Option<String>,
    #[serde(default)]
    pub node_name: Option<String>,
}

/// The labels an endpoint gives its member for priority tiers (`labels: { zone: ... }`).
pub const ENDPOINT_LABELS: [&str; 2] = ["zone", "node"];

/// A member with its endpoint's `zone` and `node` (where set), the labels tiers can name.
pub type Labelled = (MemberId, BTreeMap<String, String>);

#[derive(Debug, Default, Deserialize)]
pub struct Conditions {
    pub ready: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct SlicePort {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub port: Option<i32>,
}

/// The pool's members from the Service's slices: `address:port` (IPv6 as `[address]:port`) of every
/// ready endpoint, sorted, without duplicates (an endpoint may sit in two slices while they are
/// rebalanced). An error names the ports there are when `port` matches none, or is needed.
pub fn ready_members(
    slices: &[Slice],
    port: Option<&PortRef>,
    service: &str,
) -> Result<Vec<MemberId>, String> {
    Ok(ready_endpoints(slices, port, service)?.into_iter().map(|(m, _)| m).collect())
}

/// [`ready_members`] with each member's endpoint labels.
pub fn ready_endpoints(
    slices: &[Slice],
    port: Option<&PortRef>,
    service: &str,
) -> Result<Vec<Labelled>, String> {
    let mut out = Vec::new();
    let mut seen_ports: Vec<String> = Vec::new();
    let mut matched_any = false;
    for s in slices {
        let v6 = match s.address_type.as_str() {
            "IPv4" => false,
            "IPv6" => true,
            _ => continue,
        };
        let ports = s.ports.as_deref().unwrap_or_default();
        for p in ports {
            let label = match (&p.name, p.port) {
                (Some(n), Some(num)) if !n.is_empty() => format!("{n} ({num})"),
                (_, Some(num)) => num.to_string(),
                _ => continue,
            };
            if !seen_ports.contains(&label) {
                seen_ports.push(label);
            }
        }
        let chosen = match port {
            Some(PortRef::Number(n)) => ports.iter().find(|p| p.port == Some(i32::from(*n))),
            Some(PortRef::Name(name)) => ports.iter().find(|p| p.name.as_deref() == Some(name.as_str())),
            None if ports.len() == 1 => ports.first(),
            None if ports.is_empty() => None,
            None => {
                return Err(format!(
                    "Service {service:?} has several ports ({}); set members.kubernetes.port",
                    seen_ports.join(", ")
                ))
            }
        };
        let Some(num) = chosen.and_then(|p| p.port).and_then(|n| u16::try_from(n).ok()).filter(|n| *n > 0)
        else {
            continue;
        };
        matched_any = true;
        for ep in s.endpoints.iter().filter(|e| e.conditions.ready != Some(false)) {
            // The addresses of one endpoint are fungible (Kubernetes: "assumed to be fungible").
            let Some(addr) = ep.addresses.first() else { continue };
            let member = MemberId::new(if v6 { format!("[{addr}]:{num}") } else { format!("{addr}:{num}") });
            let labels = [("zone", &ep.zone), ("node", &ep.node_name)]
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_string(), v.clone()?)))
                .collect();
            out.push((member, labels));
        }
    }
    if !matched_any && !seen_ports.is_empty() {
        let wanted = port.map(|p| p.to_string()).unwrap_or_default();
        return Err(format!(
            "Service {service:?} has no port {wanted:?} in its EndpointSlices (ports: {})",
            seen_ports.join(", ")
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out.dedup_by(|a, b| a.0 == b.0);
    Ok(out)
}

/// A pool's discovery of members from one Service, ready to be asked each cycle.
pub struct ServiceMembers {
    api: KubeApi,
    namespace: String,
    cfg: KubernetesMembers,
}

impl ServiceMembers {
    /// Resolve the API server, credentials and namespace (defaults: the pod's own).
    pub fn new(cfg: &KubernetesMembers) -> Result<ServiceMembers, SourceError> {
        let sa = Path::new(SERVICE_ACCOUNT_DIR);
        let url = cfg.api_url.clone().or_else(KubeApi::in_cluster_url).ok_or_else(|| {
            SourceError::Config(
                "members.kubernetes: no API server: not in a pod (KUBERNETES_SERVICE_HOST is unset) and no \
                 members.kubernetes.api_url (`kubectl proxy` gives http://127.0.0.1:8001)"
                    .into(),
            )
        })?;
        let token = cfg.token.clone().or_else(|| {
            let f = sa.join("token");
            f.exists().then_some(SecretRef::File(f))
        });
        let ca_path = cfg.ca_file.clone().or_else(|| {
            let f = sa.join("ca.crt");
            (url.starts_with("https:") && f.exists()).then_some(f)
        });
        let config_err = |e: ApiError| SourceError::Config(format!("members.kubernetes: {e}"));
        let ca = ca_path.as_deref().map(KubeApi::read_ca).transpose().map_err(config_err)?;
        let namespace = cfg
            .namespace
            .clone()
            .or_else(|| std::env::var("POD_NAMESPACE").ok().filter(|s| !s.is_empty()))
            .or_else(|| std::fs::read_to_string(sa.join("namespace")).ok().map(|s| s.trim().to_string()))
            .ok_or_else(|| {
                SourceError::Config(
                    "members.kubernetes: cannot tell the Service's namespace: set members.kubernetes.namespace"
                        .into(),
                )
            })?;
        let api = KubeApi::new(&url, token, ca.as_deref(), cfg.timeout).map_err(config_err)?;
        Ok(ServiceMembers { api, namespace, cfg: cfg.clone() })
    }

    fn what(&self) -> String {
        match (&self.cfg.service, &self.cfg.inference_pool) {
            (Some(service), _) => format!("EndpointSlices of Service {}/{service}", self.namespace),
            (None, pool) => format!(
                "InferencePool {}/{} and its pods",
                self.namespace,
                pool.as_deref().unwrap_or_default()
            ),
        }
    }

    fn api_error(&self, e: ApiError) -> SourceError {
        match e {
            ApiError::Transport { detail, .. } => SourceError::Unreachable { what: self.what(), detail },
            ApiError::Decode(detail) => SourceError::Malformed { what: self.what(), detail },
            other => SourceError::Unreachable { what: self.what(), detail: other.to_string() },
        }
    }

    /// The ready members now, with their zone and node where known.
    pub async fn members(&self) -> Result<Vec<Labelled>, SourceError> {
        match (&self.cfg.service, &self.cfg.inference_pool) {
            (Some(service), _) => self.service_members(service).await,
            (None, Some(pool)) => self.pool_members(pool).await,
            (None, None) => Ok(Vec::new()),
        }
    }

    async fn service_members(&self, service: &str) -> Result<Vec<Labelled>, SourceError> {
        let selector: String =
            url::form_urlencoded::byte_serialize(format!("kubernetes.io/service-name={service}").as_bytes())
                .collect();
        let path = format!(
            "/apis/discovery.k8s.io/v1/namespaces/{}/endpointslices?labelSelector={selector}",
            self.namespace
        );
        let list: SliceList = self.api.get_json(&path).await.map_err(|e| self.api_error(e))?;
        ready_endpoints(&list.items, self.cfg.port.as_ref(), service)
            .map_err(|detail| SourceError::Malformed { what: self.what(), detail })
    }

    async fn pool_members(&self, name: &str) -> Result<Vec<Labelled>, SourceError> {
        use super::inference_pool::{ready_pod_members, InferencePool, PodList, API};
        let malformed = |detail: String| SourceError::Malformed { what: self.what(), detail };
        let pool: InferencePool = self
            .api
            .get_json(&format!("/apis/{API}/namespaces/{}/inferencepools/{name}", self.namespace))
            .await
            .map_err(|e| self.api_error(e))?;
        let selector = pool.label_selector().map_err(malformed)?;
        let mut ports = pool.ports().map_err(malformed)?;
        if let Some(PortRef::Number(n)) = self.cfg.port {
            if !ports.contains(&n) {
                return Err(malformed(format!(
                    "members.kubernetes.port {n} is not one of its target ports ({})",
                    ports.iter().map(u16::to_string).collect::<Vec<_>>().join(", ")
                )));
            }
            ports = vec![n];
        }
        let query: String = url::form_urlencoded::byte_serialize(selector.as_bytes()).collect();
        let list: PodList = self
            .api
            .get_json(&format!("/api/v1/namespaces/{}/pods?labelSelector={query}", self.namespace))
            .await
            .map_err(|e| self.api_error(e))?;
        Ok(ready_pod_members(&pool.spec.selector.match_labels, &ports, &list.items))
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(kind: &str, eps: &[(&str, Option<bool>)], ports: &[(&str, i32)]) -> Slice {
        Slice {
            metadata: Meta::default(),
            address_type: kind.into(),
            endpoints: eps
                .iter()
                .map(|(a, r)| Endpoint {
                    addresses: vec![a.to_string()],
                    conditions: Conditions { ready: *r },
                    zone: None,
                    node_name: None,
                })
                .collect(),
            ports: Some(
                ports.iter().map(|(n, p)| SlicePort { name: Some(n.to_string()), port: Some(*p) }).collect(),
            ),
        }
    }

    fn ids(v: Vec<MemberId>) -> Vec<String> {
        v.into_iter().map(|m| m.to_string()).collect()
    }

    #[test]
    fn ready_and_unknown_endpoints_count_not_ready_ones_do_not() {
        let s = [slice(
            "IPv4",
            &[("10.0.0.2", Some(true)), ("10.0.0.1", None), ("10.0.0.3", Some(false))],
            &[("http", 8000)],
        )];
        assert_eq!(
            ids(ready_members(&s, None, "vllm").expect("one port")),
            ["10.0.0.1:8000", "10.0.0.2:8000"]
        );
    }

    #[test]
    fn the_port_is_chosen_by_name_or_number_and_a_wrong_one_names_the_ports() {
        let s = [
            slice("IPv4", &[("10.0.0.1", Some(true))], &[("http", 8000), ("metrics", 9000)]),
            slice("IPv6", &[("fd00::1", Some(true))], &[("http", 8000), ("metrics", 9000)]),
            slice("FQDN", &[("x.example", Some(true))], &[("http", 8000)]),
        ];
        let by_name = ready_members(&s, Some(&PortRef::Name("metrics".into())), "vllm").expect("named");
        assert_eq!(ids(by_name), ["10.0.0.1:9000", "[fd00::1]:9000"]);
        let by_number = ready_members(&s, Some(&PortRef::Number(8000)), "vllm").expect("number");
        assert_eq!(ids(by_number), ["10.0.0.1:8000", "[fd00::1]:8000"]);
        let e = ready_members(&s, None, "vllm").expect_err("two ports");
        assert!(e.contains("several ports (http (8000), metrics (9000))"), "{e}");
        let e = ready_members(&s, Some(&PortRef::Name("grpc".into())), "vllm").expect_err("no such port");
        assert!(e.contains("no port \"grpc\""), "{e}");
    }

    #[test]
    fn endpoints_carry_their_zone_and_node_from_the_slice_json() {
        let json = r#"{"items":[{"metadata":{"name":"vllm-a"},"addressType":"IPv4","ports":[{"name":"http","port":8000}],
            "endpoints":[{"addresses":["10.0.0.1"],"conditions":{"ready":true},"zone":"zone-a","nodeName":"worker-1"},
                         {"addresses":["10.0.0.2"],"conditions":{"ready":true}}]}]}"#;
        let list: SliceList = serde_json::from_str(json).expect("slice list");
        let got = ready_endpoints(&list.items, None, "vllm").expect("ok");
        let labels = |i: usize| got[i].1.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>();
        assert_eq!(got[0].0.as_str(), "10.0.0.1:8000");
        assert_eq!(labels(0), ["node=worker-1", "zone=zone-a"]);
        assert!(labels(1).is_empty(), "no zone: no label, never an empty one");
    }

    #[test]
    fn an_endpoint_in_two_slices_is_one_member_and_no_slices_is_no_members() {
        let a = slice("IPv4", &[("10.0.0.1", Some(true))], &[("http", 8000)]);
        let b = slice("IPv4", &[("10.0.0.1", Some(true)), ("10.0.0.2", Some(true))], &[("http", 8000)]);
        assert_eq!(
            ids(ready_members(&[a, b], None, "vllm").expect("ok")),
            ["10.0.0.1:8000", "10.0.0.2:8000"]
        );
        assert!(ready_members(&[], None, "vllm").expect("empty").is_empty());
    }

    #[test]
    fn names_are_validated_like_kubernetes_does() {
        let mut c = KubernetesMembers {
            service: Some("Vllm_svc".into()),
            inference_pool: None,
            namespace: Some("-bad".into()),
            port: Some(PortRef::Name("a-very-long-port-name".into())),
            api_url: Some("ftp://x".into()),
            token: None,
            ca_file: None,
            timeout: Duration::from_secs(5),
        };
        let fields: Vec<String> = c.validate().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["service", "namespace", "port", "api_url"]);
        c = KubernetesMembers {
            service: Some("vllm".into()),
            namespace: None,
            port: Some(PortRef::Number(8000)),
            api_url: None,
            ..c
        };
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        // An InferencePool instead: exactly one of the two, its name a subdomain, a numbered port.
        let pool =
            KubernetesMembers { service: None, inference_pool: Some("vllm.llama-3".into()), ..c.clone() };
        assert!(pool.validate().is_empty(), "{:?}", pool.validate());
        let both = KubernetesMembers { inference_pool: Some("p".into()), ..c.clone() };
        assert_eq!(both.validate()[0].1, "set exactly one of `service` and `inference_pool`");
        let named = KubernetesMembers { port: Some(PortRef::Name("http".into())), ..pool.clone() };
        assert_eq!(named.validate()[0].0, "port");
        let bad = KubernetesMembers { inference_pool: Some("Bad_Pool".into()), ..pool };
        assert_eq!(bad.validate()[0].0, "inference_pool");
    }
}
