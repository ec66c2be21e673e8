//! A fake Kubernetes API server for Leases (`coordination.k8s.io/v1`): get, create and update, with
//! the API server's rules a leader-election client can trip over, so tests of the client are honest:
//! - bearer tokens are checked (401 `Unauthorized` otherwise);
//! - `metadata.resourceVersion` is required on update and must match the stored one (409 `Conflict`,
//!   "the object has been modified"); create with one set is a 400, a second create of the same name
//!   a 409 `AlreadyExists`; every write bumps the version;
//! - names must be DNS subdomains and match the URL; `apiVersion`/`kind`, when sent, must be
//!   `coordination.k8s.io/v1`/`Lease`;
//! - `acquireTime`/`renewTime` are `MicroTime`: RFC 3339 with exactly six fractional digits, as Go's
//!   layout `2006-01-02T15:04:05.000000Z07:00` demands (400 otherwise);
//! - `leaseDurationSeconds` must be > 0 and `leaseTransitions` >= 0 (422 `Invalid`).
//!
//! Errors are `Status` objects shaped like the real ones. Tests can make the server unavailable to
//! one token (503, as during an API-server outage seen from one node), inject 409s, or write a Lease
//! behind the clients' backs.
//!
//! It also serves EndpointSlices (`discovery.k8s.io/v1`), read-only, as a Service's controller would
//! have written them: `GET .../namespaces/NS/endpointslices?labelSelector=k=v[,k2=v2]` lists the
//! slices whose labels match every term (equality only; other selector syntax is a 400, as a typo
//! would be), with the list's `resourceVersion`. A token can be denied the list (403 `Forbidden`,
//! as without the RBAC rule).
//!
//! And InferencePools (`inference.networking.k8s.io/v1`, GET by name; 404 `NotFound` for another)
//! and Pods (`GET /api/v1/namespaces/NS/pods?labelSelector=...`, the same selector rules), both
//! read-only, for members read from an InferencePool.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};

const PREFIX: &str = "/apis/coordination.k8s.io/v1/namespaces/";

/// Counts of what the server saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub gets: u64,
    pub creates: u64,
    pub updates: u64,
    /// 409 answers (conflicts and already-exists).
    pub conflicts: u64,
    /// Other 4xx answers: something the client sent was wrong.
    pub rejected: u64,
}

#[derive(Default)]
struct Inner {
    tokens: BTreeSet<String>,
    leases: BTreeMap<(String, String), Value>,
    version: u64,
    down_for: BTreeSet<String>,
    inject_conflicts: u32,
    stats: Stats,
    /// Every 4xx message, for assertions and for debugging a failing test.
    errors: Vec<String>,
    /// EndpointSlices by (namespace, name), as JSON objects.
    slices: BTreeMap<(String, String), Value>,
    /// Tokens without RBAC on endpointslices.
    no_slices_for: BTreeSet<String>,
    /// InferencePools and Pods by (namespace, name), as JSON objects.
    inference_pools: BTreeMap<(String, String), Value>,
    pods: BTreeMap<(String, String), Value>,
    /// EndpointSlice lists served.
    slice_lists: u64,
}

type Shared = Arc<Mutex<Inner>>;

pub struct FakeKube {
    pub addr: std::net::SocketAddr,
    inner: Shared,
    task: tokio::task::JoinHandle<()>,
}

impl FakeKube {
    /// Serve on a free loopback port, accepting the given bearer tokens.
    pub async fn start(tokens: &[&str]) -> FakeKube {
        let inner: Shared = Arc::new(Mutex::new(Inner {
            tokens: tokens.iter().map(|t| t.to_string()).collect(),
            ..Default::default()
        }));
        let app = Router::new().fallback(handle).with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the fake API server");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeKube { addr, inner, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The stored Lease as JSON.
    pub fn lease(&self, namespace: &str, name: &str) -> Option<Value> {
        self.lock().leases.get(&(namespace.to_string(), name.to_string())).cloned()
    }

    /// `spec.holderIdentity` of the stored Lease; `None` when absent, empty or no Lease.
    pub fn holder(&self, namespace: &str, name: &str) -> Option<String> {
        self.lease(namespace, name)
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
            .filter(|h| !h.is_empty())
    }

    /// Write a Lease's spec directly, as another client would: bumps the resourceVersion.
    pub fn write_spec(&self, namespace: &str, name: &str, spec: Value) {
        let mut g = self.lock();
        g.version += 1;
        let rv = g.version.to_string();
        let obj = json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": rv, "uid": format!("uid-{name}")},
            "spec": spec,
        });
        g.leases.insert((namespace.to_string(), name.to_string()), obj);
    }

    /// Answer every request made with `token` with 503 while `down` (the API server unreachable
    /// from that client's point of view).
    pub fn set_down_for(&self, token: &str, down: bool) {
        let mut g = self.lock();
        if down {
            g.down_for.insert(token.to_string());
        } else {
            g.down_for.remove(token);
        }
    }

    /// Answer the next `n` updates with 409 Conflict, as if another writer always got there first.
    pub fn inject_conflicts(&self, n: u32) {
        self.lock().inject_conflicts = n;
    }

    pub fn stats(&self) -> Stats {
        self.lock().stats.clone()
    }

    /// Create or replace an EndpointSlice. `endpoints` are `(address, ready)`; `ports` are
    /// `(name, port)`. Labelled `kubernetes.io/service-name: SERVICE` like the ones Kubernetes makes.
    pub fn put_endpoint_slice(
        &self,
        namespace: &str,
        name: &str,
        service: &str,
        address_type: &str,
        endpoints: &[(&str, Option<bool>)],
        ports: &[(&str, u16)],
    ) {
        let mut g = self.lock();
        g.version += 1;
        let rv = g.version.to_string();
        let eps: Vec<Value> = endpoints
            .iter()
            .map(|(addr, ready)| {
                let mut cond = serde_json::Map::new();
                if let Some(r) = ready {
                    cond.insert("ready".into(), json!(r));
                    cond.insert("serving".into(), json!(r));
                    cond.insert("terminating".into(), json!(false));
                }
                json!({"addresses": [addr], "conditions": cond, "targetRef": {"kind": "Pod", "name": format!("pod-{addr}")}})
            })
            .collect();
        let ports: Vec<Value> =
            ports.iter().map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP"})).collect();
        let obj = json!({
            "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {
                "name": name, "namespace": namespace, "resourceVersion": rv,
                "labels": {"kubernetes.io/service-name": service, "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
            },
            "addressType": address_type,
            "endpoints": eps,
            "ports": ports,
        });
        g.slices.insert((namespace.to_string(), name.to_string()), obj);
    }

    /// Put every endpoint of an EndpointSlice in `zone` on `node` (what the EndpointSlice controller
    /// copies from the pod's node: `topology.kubernetes.io/zone` and its name).
    pub fn set_endpoint_zone(&self, namespace: &str, name: &str, zone: &str, node: &str) {
        let mut g = self.lock();
        g.version += 1;
        let rv = g.version.to_string();
        if let Some(obj) = g.slices.get_mut(&(namespace.to_string(), name.to_string())) {
            obj["metadata"]["resourceVersion"] = json!(rv);
            for ep in obj["endpoints"].as_array_mut().into_iter().flatten() {
                ep["zone"] = json!(zone);
                ep["nodeName"] = json!(node);
            }
        }
    }

    /// Create or replace an InferencePool selecting pods by `labels`, serving on `ports`.
    pub fn put_inference_pool(&self, namespace: &str, name: &str, labels: &[(&str, &str)], ports: &[u16]) {
        let mut g = self.lock();
        g.version += 1;
        let rv = g.version.to_string();
        let match_labels: serde_json::Map<String, Value> =
            labels.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
        let obj = json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": rv},
            "spec": {
                "selector": {"matchLabels": match_labels},
                "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
                "endpointPickerRef": {"name": format!("{name}-epp"), "port": {"number": 9002}},
            },
        });
        g.inference_pools.insert((namespace.to_string(), name.to_string()), obj);
    }

    /// Create or replace a Pod with `labels` at `ip` on `node`, `ready` or not, `terminating` or
    /// not (a deletion timestamp set).
    #[allow(clippy::too_many_arguments)]
    pub fn put_pod(
        &self,
        namespace: &str,
        name: &str,
        labels: &[(&str, &str)],
        ip: &str,
        node: &str,
        ready: bool,
        terminating: bool,
    ) {
        let mut g = self.lock();
        g.version += 1;
        let rv = g.version.to_string();
        let labels: serde_json::Map<String, Value> =
            labels.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
        let mut meta = json!({"name": name, "namespace": namespace, "resourceVersion": rv, "labels": labels});
        if terminating {
            meta["deletionTimestamp"] = json!("2026-12-07T10:00:00Z");
        }
        let obj = json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Ready", "status": if ready { "True" } else { "False" }},
                ],
            },
        });
        g.pods.insert((namespace.to_string(), name.to_string()), obj);
    }

    pub fn delete_endpoint_slice(&self, namespace: &str, name: &str) {
        let mut g = self.lock();
        g.version += 1;
        g.slices.remove(&(namespace.to_string(), name.to_string()));
    }

    /// Answer `token`'s EndpointSlice lists with 403, as without the RBAC rule.
    pub fn deny_endpoint_slices_for(&self, token: &str) {
        self.lock().no_slices_for.insert(token.to_string());
    }

    /// How many EndpointSlice lists were served.
    pub fn endpoint_slice_lists(&self) -> u64 {
        self.lock().slice_lists
    }

    /// Messages of the 4xx answers other than conflicts so far.
    pub fn errors(&self) -> Vec<String> {
        self.lock().errors.clone()
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn status(code: StatusCode, reason: &str, message: String, name: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason,
        "details": {"name": name, "group": "coordination.k8s.io", "kind": "leases"},
        "code": code.as_u16(),
    });
    (code, [("content-type", "application/json")], body.to_string()).into_response()
}

fn reject(g: &mut Inner, code: StatusCode, reason: &str, message: String, name: &str) -> Response {
    if code == StatusCode::CONFLICT {
        g.stats.conflicts += 1;
    } else if code.is_client_error() {
        g.stats.rejected += 1;
        g.errors.push(message.clone());
    }
    status(code, reason, message, name)
}

fn is_dns_subdomain(s: &str) -> bool {
    let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    !s.is_empty() && s.len() <= 253 && s.chars().all(ok) && edge(s.chars().next()) && edge(s.chars().last())
}

/// Go's `time.Parse("2006-01-02T15:04:05.000000Z07:00", s)`: exactly six fractional digits, then
/// `Z` or `±hh:mm`.
fn is_micro_time(s: &str) -> bool {
    let b = s.as_bytes();
    let digits =
        |r: std::ops::Range<usize>| b.get(r.clone()).is_some_and(|x| x.iter().all(u8::is_ascii_digit));
    let head = b.len() >= 27
        && digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && b[10] == b'T'
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19)
        && b[19] == b'.'
        && digits(20..26);
    head && match &b[26..] {
        [b'Z'] => true,
        [sign, h1, h2, b':', m1, m2] => {
            (*sign == b'+' || *sign == b'-') && [h1, h2, m1, m2].iter().all(|c| c.is_ascii_digit())
        }
        _ => false,
    }
}

/// The checks the API server makes on a Lease body; `Err((code, reason, message))`.
fn validate(
    obj: &Value,
    ns: &str,
    url_name: Option<&str>,
) -> Result<String, (StatusCode, &'static str, String)> {
    let bad = |m: String| Err((StatusCode::BAD_REQUEST, "BadRequest", m));
    if !obj.is_object() {
        return bad("the body is not a JSON object".into());
    }
    if let Some(v) = obj.get("apiVersion") {
        if v != "coordination.k8s.io/v1" {
            return bad(format!(
                "the API version in the data ({v}) does not match the expected API version (coordination.k8s.io/v1)"
            ));
        }
    }
    if let Some(k) = obj.get("kind") {
        if k != "Lease" {
            return bad(format!("the kind in the data ({k}) does not match the expected kind (Lease)"));
        }
    }
    let meta = &obj["metadata"];
    let name = meta["name"].as_str().unwrap_or_default().to_string();
    if let Some(u) = url_name {
        if name != u {
            return bad(format!("the name of the object ({name}) does not match the name on the URL ({u})"));
        }
    }
    if let Some(n) = meta.get("namespace").and_then(Value::as_str) {
        if n != ns {
            return bad(
                "the namespace of the provided object does not match the namespace sent on the request"
                    .into(),
            );
        }
    }
    if !is_dns_subdomain(&name) {
        return Err((
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!("Lease.coordination.k8s.io {name:?} is invalid: metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'"),
        ));
    }
    let spec = &obj["spec"];
    for f in ["acquireTime", "renewTime"] {
        match spec.get(f) {
            None | Some(Value::Null) => {}
            Some(Value::String(t)) if is_micro_time(t) => {}
            Some(v) => {
                return bad(format!(
                    "Lease in version \"v1\" cannot be handled as a Lease: parsing time {v} as \"2006-01-02T15:04:05.000000Z07:00\": cannot parse (spec.{f})"
                ))
            }
        }
    }
    let invalid = |m: String| Err((StatusCode::UNPROCESSABLE_ENTITY, "Invalid", m));
    match spec.get("leaseDurationSeconds") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_i64().is_some_and(|d| d > 0 && d <= i32::MAX as i64) => {}
        Some(v) => return invalid(format!("Lease.coordination.k8s.io {name:?} is invalid: spec.leaseDurationSeconds: Invalid value: {v}: must be greater than 0")),
    }
    match spec.get("leaseTransitions") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_i64().is_some_and(|d| (0..=i32::MAX as i64).contains(&d)) => {}
        Some(v) => return invalid(format!("Lease.coordination.k8s.io {name:?} is invalid: spec.leaseTransitions: Invalid value: {v}: must be greater than or equal to 0")),
    }
    if let Some(h) = spec.get("holderIdentity") {
        if !(h.is_null() || h.is_string()) {
            return bad(format!("spec.holderIdentity: expected a string, got {h}"));
        }
    }
    Ok(name)
}

async fn handle(
    State(inner): State<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut g = inner.lock().unwrap_or_else(|p| p.into_inner());
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default()
        .to_string();
    if !g.tokens.contains(&token) {
        return reject(&mut g, StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized".into(), "");
    }
    if g.down_for.contains(&token) {
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is currently unable to handle the request".into(),
            "",
        );
    }
    let path = uri.path();
    if let Some(ns) = path
        .strip_prefix("/apis/discovery.k8s.io/v1/namespaces/")
        .and_then(|r| r.strip_suffix("/endpointslices"))
    {
        return list_slices(&mut g, &method, ns, uri.query().unwrap_or_default(), &token);
    }
    if let Some((ns, name)) = path
        .strip_prefix("/apis/inference.networking.k8s.io/v1/namespaces/")
        .and_then(|r| r.split_once("/inferencepools/"))
    {
        if method != Method::GET {
            let m = "the fake serves InferencePools read-only".to_string();
            return reject(&mut g, StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", m, "");
        }
        return match g.inference_pools.get(&(ns.to_string(), name.to_string())).cloned() {
            Some(obj) => {
                (StatusCode::OK, [("content-type", "application/json")], obj.to_string()).into_response()
            }
            None => {
                let m = format!("inferencepools.inference.networking.k8s.io \"{name}\" not found");
                reject(&mut g, StatusCode::NOT_FOUND, "NotFound", m, name)
            }
        };
    }
    if let Some(ns) = path.strip_prefix("/api/v1/namespaces/").and_then(|r| r.strip_suffix("/pods")) {
        if method != Method::GET {
            let m = "the fake serves Pods read-only".to_string();
            return reject(&mut g, StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", m, "");
        }
        let terms = match selector_terms(uri.query().unwrap_or_default()) {
            Ok(t) => t,
            Err(m) => return reject(&mut g, StatusCode::BAD_REQUEST, "BadRequest", m, ""),
        };
        let items = selected(&g.pods, ns, &terms);
        let body = json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": g.version.to_string()}, "items": items});
        return (StatusCode::OK, [("content-type", "application/json")], body.to_string()).into_response();
    }
    let rest = match path.strip_prefix(PREFIX) {
        Some(r) => r,
        None => {
            return reject(
                &mut g,
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("the server could not find the requested resource ({path})"),
                "",
            )
        }
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let (ns, name) = match parts.as_slice() {
        [ns, "leases"] => (ns.to_string(), None),
        [ns, "leases", name] if !name.is_empty() => (ns.to_string(), Some(name.to_string())),
        _ => {
            return reject(
                &mut g,
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("the server could not find the requested resource ({path})"),
                "",
            )
        }
    };
    // A boxed error keeps the Result small (clippy::result_large_err); it is unboxed at once.
    let parse_body = |g: &mut Inner| -> Result<Value, Box<Response>> {
        let ct = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default();
        if !ct.starts_with("application/json") {
            return Err(Box::new(reject(g, StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", format!("the body of the request was in an unknown format - accepted media types include: application/json (got {ct:?})"), "")));
        }
        serde_json::from_slice(&body).map_err(|e| {
            Box::new(reject(g, StatusCode::BAD_REQUEST, "BadRequest", format!("invalid JSON: {e}"), ""))
        })
    };
    match (method, name) {
        (Method::GET, Some(name)) => {
            g.stats.gets += 1;
            match g.leases.get(&(ns.clone(), name.clone())) {
                Some(l) => (StatusCode::OK, axum::Json(l.clone())).into_response(),
                // A missing Lease is an answer, not a client mistake: not counted in `errors`.
                None => status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("leases.coordination.k8s.io {name:?} not found"),
                    &name,
                ),
            }
        }
        (Method::POST, None) => {
            g.stats.creates += 1;
            let mut obj = match parse_body(&mut g) {
                Ok(o) => o,
                Err(r) => return *r,
            };
            let name = match validate(&obj, &ns, None) {
                Ok(n) => n,
                Err((c, r, m)) => return reject(&mut g, c, r, m, ""),
            };
            if obj["metadata"].get("resourceVersion").is_some_and(|v| !v.is_null()) {
                return reject(
                    &mut g,
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "resourceVersion should not be set on objects to be created".into(),
                    &name,
                );
            }
            let key = (ns.clone(), name.clone());
            if g.leases.contains_key(&key) {
                return reject(
                    &mut g,
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    format!("leases.coordination.k8s.io {name:?} already exists"),
                    &name,
                );
            }
            g.version += 1;
            let meta = &mut obj["metadata"];
            meta["namespace"] = json!(ns);
            meta["resourceVersion"] = json!(g.version.to_string());
            meta["uid"] = json!(format!("uid-{name}-{}", g.version));
            obj["apiVersion"] = json!("coordination.k8s.io/v1");
            obj["kind"] = json!("Lease");
            g.leases.insert(key, obj.clone());
            (StatusCode::CREATED, axum::Json(obj)).into_response()
        }
        (Method::PUT, Some(url_name)) => {
            g.stats.updates += 1;
            let mut obj = match parse_body(&mut g) {
                Ok(o) => o,
                Err(r) => return *r,
            };
            let name = match validate(&obj, &ns, Some(&url_name)) {
                Ok(n) => n,
                Err((c, r, m)) => return reject(&mut g, c, r, m, &url_name),
            };
            let key = (ns.clone(), name.clone());
            let Some(stored) = g.leases.get(&key).cloned() else {
                return reject(
                    &mut g,
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("leases.coordination.k8s.io {name:?} not found"),
                    &name,
                );
            };
            let sent_rv = obj["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_string();
            if sent_rv.is_empty() {
                return reject(&mut g, StatusCode::UNPROCESSABLE_ENTITY, "Invalid", format!("Lease.coordination.k8s.io {name:?} is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update"), &name);
            }
            let modified = || {
                format!("Operation cannot be fulfilled on leases.coordination.k8s.io {name:?}: the object has been modified; please apply your changes to the latest version and try again")
            };
            if g.inject_conflicts > 0 {
                g.inject_conflicts -= 1;
                return reject(&mut g, StatusCode::CONFLICT, "Conflict", modified(), &name);
            }
            if stored["metadata"]["resourceVersion"].as_str() != Some(sent_rv.as_str()) {
                return reject(&mut g, StatusCode::CONFLICT, "Conflict", modified(), &name);
            }
            g.version += 1;
            obj["metadata"]["namespace"] = json!(ns);
            obj["metadata"]["resourceVersion"] = json!(g.version.to_string());
            obj["metadata"]["uid"] = stored["metadata"]["uid"].clone();
            obj["apiVersion"] = json!("coordination.k8s.io/v1");
            obj["kind"] = json!("Lease");
            g.leases.insert(key, obj.clone());
            (StatusCode::OK, axum::Json(obj)).into_response()
        }
        (m, _) => reject(
            &mut g,
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{m} is not supported here"),
            "",
        ),
    }
}

/// `GET .../namespaces/NS/endpointslices?labelSelector=...`: the matching slices as a list.
fn list_slices(g: &mut Inner, method: &Method, ns: &str, query: &str, token: &str) -> Response {
    if method != Method::GET {
        return reject(
            g,
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the fake serves EndpointSlices read-only".into(),
            "",
        );
    }
    if g.no_slices_for.contains(token) {
        return reject(
            g,
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("endpointslices.discovery.k8s.io is forbidden: User \"system:serviceaccount:x:y\" cannot list resource \"endpointslices\" in API group \"discovery.k8s.io\" in the namespace \"{ns}\""),
            "",
        );
    }
    let terms = match selector_terms(query) {
        Ok(t) => t,
        Err(m) => return reject(g, StatusCode::BAD_REQUEST, "BadRequest", m, ""),
    };
    g.slice_lists += 1;
    let items = selected(&g.slices, ns, &terms);
    let body = json!({
        "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"resourceVersion": g.version.to_string()},
        "items": items,
    });
    (StatusCode::OK, [("content-type", "application/json")], body.to_string()).into_response()
}

/// The objects of namespace `ns` whose labels match every term.
fn selected(objects: &BTreeMap<(String, String), Value>, ns: &str, terms: &[(String, String)]) -> Vec<Value> {
    objects
        .iter()
        .filter(|((n, _), _)| n == ns)
        .map(|(_, v)| v)
        .filter(|v| terms.iter().all(|(k, val)| v["metadata"]["labels"][k.as_str()] == val.as_str()))
        .cloned()
        .collect()
}

/// The `key=value` terms of a query's `labelSelector` (other selector syntax is refused, as a typo
/// would be by the real server's parser).
fn selector_terms(query: &str) -> Result<Vec<(String, String)>, String> {
    let mut terms: Vec<(String, String)> = Vec::new();
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        if k != "labelSelector" {
            continue;
        }
        for term in v.split(',').filter(|t| !t.is_empty()) {
            match term.split_once('=') {
                Some((key, val)) if !key.ends_with('!') && !val.starts_with('=') => {
                    terms.push((key.trim().to_string(), val.trim().to_string()))
                }
                _ => {
                    return Err(format!(
                        "unable to parse requirement: the fake takes key=value terms only: {term:?}"
                    ))
                }
            }
        }
    }
    Ok(terms)
}

#[cfg(test)]
mod tests {
    use super::is_micro_time;

    #[test]
    fn micro_time_needs_exactly_six_digits() {
        assert!(is_micro_time("2024-05-01T12:00:00.123456Z"));
        assert!(is_micro_time("2024-05-01T12:00:00.123456+02:00"));
        assert!(!is_micro_time("2024-05-01T12:00:00.123Z"));
        assert!(!is_micro_time("2024-05-01T12:00:00.123456789Z"));
        assert!(!is_micro_time("2024-05-01T12:00:00Z"));
        assert!(!is_micro_time("2024-05-01 12:00:00.123456Z"));
    }
}
