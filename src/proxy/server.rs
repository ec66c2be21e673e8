//! The OpenAI API listener: `/v1/chat/completions` and `/v1/completions` go through both stages,
//! `/v1/models` lists the model names a client may send, `/metrics`, `/health` (what vLLM serves and
//! load testers check) and `/healthz` describe the proxy.
//!
//! One request: read the body (413 past the limit), parse it strictly (400, duplicate keys
//! included), walk the routing table (a rejection or a guard's block answers here), apply a model
//! split, check the model against the pool (404), classify its criticality, wait for admission
//! (429/503), choose a member and forward (a refused connection retries on another member; 503
//! when none is left). The response carries `x-llmlc-route`, `x-llmlc-pool` and `x-llmlc-member`.
//!
//! Accounting is held by guards owned by the request's future — the queue place
//! ([`super::criticality`]), the admission [`Permit`], the member's in-flight count ([`Picked`]) —
//! so every exit releases them, a client that goes away at any point (its handler dropped)
//! included; once the response starts, the body stream owns them until it ends or is dropped.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use serde_json::{json, Value};

use super::body::{parse_strict, BodyError};
use super::config::ProxyConfig;
use super::criticality::{Criticality, Permit, Refusal};
use super::errors::ProxyApiError;
use super::metrics::{labels, ProxyMetrics};
use super::pool::{Picked, Pool};
use super::route::{lookup, parse_path, Decision, RouteTable, Seg, Target, Walk};
use super::split::Splitter;
use super::upstream::{ForwardError, Started, Upstream};

pub const ROUTE_HEADER: &str = "x-llmlc-route";
pub const POOL_HEADER: &str = "x-llmlc-pool";
pub const MEMBER_HEADER: &str = "x-llmlc-member";
pub const MODEL_HEADER: &str = "x-llmlc-model";

/// Handles of one pool's metric series, created once.
pub struct PoolMetrics {
    ttft: Histogram,
    duration: Histogram,
    routed: Counter,
    /// Admitted, by criticality (critical, standard, sheddable).
    admitted: [Counter; 3],
    /// Answered 200, by member.
    ok: Vec<Counter>,
}

/// Everything the handlers share.
pub struct Shared {
    pub table: RouteTable,
    pub splitter: Splitter,
    pub pools: Vec<Arc<Pool>>,
    pub pool_index: HashMap<String, usize>,
    pub metrics: ProxyMetrics,
    pub upstream: Upstream,
    pub max_body_bytes: usize,
    pub criticality_header: String,
    pub criticality_field: Vec<Seg>,
    pub criticality_default: Criticality,
    pub prefix_key_from_body: bool,
    pool_metrics: Vec<PoolMetrics>,
    /// Per step: its (miss, match) counters.
    step_counters: Vec<[Counter; 2]>,
    /// `created` of the models the proxy lists itself.
    started_unix: u64,
}

fn class_index(c: Criticality) -> usize {
    match c {
        Criticality::Critical => 0,
        Criticality::Standard => 1,
        Criticality::Sheddable => 2,
    }
}

impl Shared {
    pub fn new(cfg: &ProxyConfig, table: RouteTable) -> Result<Shared, String> {
        let pools: Vec<Arc<Pool>> = cfg
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| Pool::new(p, cfg.algorithm, cfg.seed.wrapping_add(i as u64)).map(Arc::new))
            .collect::<Result<_, _>>()?;
        let pool_index = pools.iter().enumerate().map(|(i, p)| (p.name.clone(), i)).collect();
        let metrics = ProxyMetrics::new();
        let pool_metrics = pools
            .iter()
            .map(|p| {
                let pl = labels(&[("pool", &p.name)]);
                let admitted =
                    [Criticality::Critical, Criticality::Standard, Criticality::Sheddable].map(|c| {
                        metrics
                            .admissions
                            .get_or_create(&labels(&[("pool", &p.name), ("criticality", c.as_str())]))
                            .clone()
                    });
                PoolMetrics {
                    ttft: metrics.ttft.get_or_create(&pl).clone(),
                    duration: metrics.duration.get_or_create(&pl).clone(),
                    routed: metrics
                        .route_results
                        .get_or_create(&labels(&[("result", &format!("pool:{}", p.name))]))
                        .clone(),
                    admitted,
                    ok: p
                        .members
                        .iter()
                        .map(|m| {
                            metrics
                                .requests
                                .get_or_create(&labels(&[
                                    ("pool", &p.name),
                                    ("member", m.as_str()),
                                    ("status", "200"),
                                ]))
                                .clone()
                        })
                        .collect(),
                }
            })
            .collect();
        let step_counters = table
            .steps
            .iter()
            .map(|st| {
                ["miss", "match"].map(|b| {
                    metrics.route_steps.get_or_create(&labels(&[("step", &st.id), ("branch", b)])).clone()
                })
            })
            .collect();
        let started_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Ok(Shared {
            splitter: Splitter::new(&table.splits),
            table,
            pools,
            pool_index,
            metrics,
            upstream: Upstream::new(&cfg.timeouts)?,
            max_body_bytes: cfg.limits.max_body_bytes,
            criticality_header: cfg.criticality.header.to_ascii_lowercase(),
            criticality_field: parse_path(&cfg.criticality.field).unwrap_or_default(),
            criticality_default: cfg.criticality.default,
            prefix_key_from_body: cfg.prefix_key_from_body,
            pool_metrics,
            step_counters,
            started_unix,
        })
    }

    pub fn pool(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pool_index.get(name).and_then(|&i| self.pools.get(i))
    }

    fn count(&self, pool: &str, member: &str, status: StatusCode) {
        self.metrics
            .requests
            .get_or_create(&labels(&[("pool", pool), ("member", member), ("status", status.as_str())]))
            .inc();
    }
}

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        // vLLM's health endpoint (200, empty body), which load testers such as guidellm check.
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/healthz", get(|| async { "ok\n" }))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared)
}

async fn not_found() -> Response {
    ProxyApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such endpoint; this proxy serves POST /v1/chat/completions, POST /v1/completions, GET /v1/models",
    )
    .into_response()
}

pub async fn method_not_allowed() -> Response {
    ProxyApiError::method_not_allowed().into_response()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

async fn chat(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    handle(s, Endpoint::Chat, headers, body).await
}

async fn completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    handle(s, Endpoint::Completions, headers, body).await
}

/// Read the body, refusing it as soon as it passes `limit` bytes (a declared Content-Length past
/// the limit is refused before reading anything).
async fn read_limited(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ProxyApiError> {
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ProxyApiError::too_large(limit));
    }
    let mut out = Vec::with_capacity(declared.map(|n| n as usize).unwrap_or(1024));
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ProxyApiError::new(
                StatusCode::BAD_REQUEST,
                "body_read_error",
                format!("could not read the request body: {e}"),
            )
        })?;
        if out.len() + chunk.len() > limit {
            return Err(ProxyApiError::too_large(limit));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(out))
}

fn set_header(r: &mut Response, name: &'static str, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        r.headers_mut().insert(name, v);
    }
}

/// Walk the routing table, asking guard steps (deny rules, then the guard service) on the way.
async fn decide(s: &Shared, json: &Value, headers: &HeaderMap, ep: Endpoint) -> Decision {
    let (mut cur, mut hops) = (s.table.start, Vec::new());
    loop {
        match s.table.walk(cur, hops, json, headers) {
            Walk::Done(d) => return d,
            Walk::Guard { hops: h, step } => {
                let st = &s.table.steps[step];
                let Some(g) = st.guard.as_deref() else {
                    return Decision {
                        hops: h,
                        target: Target::Reject {
                            status: 500,
                            message: "guard step without a guard (a bug)".into(),
                        },
                        code: None,
                    };
                };
                let o = match g.check_rules(json) {
                    Some(o) => o,
                    None => g.ask(s.upstream.client(), &st.id, ep.path(), json).await,
                };
                if o.kind.starts_with("error") {
                    tracing::warn!(step = %st.id, outcome = o.kind, note = %o.note, "guard service failed");
                }
                s.metrics.guard.get_or_create(&labels(&[("step", &st.id), ("outcome", o.kind)])).inc();
                match s.table.after_guard(step, h, &o) {
                    Ok(d) => return d,
                    Err((n, h)) => (cur, hops) = (n, h),
                }
            }
        }
    }
}

async fn handle(s: Arc<Shared>, ep: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let t0 = Instant::now();
    let bytes = match read_limited(&headers, body, s.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let mut json: Value = match parse_strict(&bytes) {
        Ok(v) => v,
        Err(BodyError::DuplicateKey { key, at }) => {
            return ProxyApiError::duplicate_key(&key, &at).into_response()
        }
        Err(BodyError::Syntax(e)) => return ProxyApiError::bad_json(&e).into_response(),
    };
    if !json.is_object() {
        return ProxyApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            "request body must be a JSON object",
        )
        .into_response();
    }

    // Stage 1.
    let decision = decide(&s, &json, &headers, ep).await;
    for h in &decision.hops {
        if h.outcome.is_none() {
            s.step_counters[h.step][usize::from(h.matched)].inc();
        }
    }
    let route = decision.route(&s.table);
    let (pool_name, split) = match &decision.target {
        Target::Pool { pool, split } => (pool.as_str(), *split),
        Target::Reject { status, message } => {
            s.metrics.route_results.get_or_create(&labels(&[("result", &format!("reject:{status}"))])).inc();
            let status = StatusCode::from_u16(*status).unwrap_or(StatusCode::FORBIDDEN);
            let mut e =
                ProxyApiError::new(status, decision.code.unwrap_or("rejected_by_route"), message.clone());
            if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
                e = e.with_retry_after(1);
            }
            let mut r = e.into_response();
            set_header(&mut r, ROUTE_HEADER, &route);
            s.count("", "", status);
            return r;
        }
        Target::Step(_) => {
            return ProxyApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "route_bug",
                "routing ended on a step",
            )
            .into_response()
        }
    };
    let Some(&pi) = s.pool_index.get(pool_name) else {
        return ProxyApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "route_bug",
            format!("no pool {pool_name}"),
        )
        .into_response();
    };
    let pool = s.pools[pi].clone();
    let pm = &s.pool_metrics[pi];
    pm.routed.inc();

    // Model split (canary) and the pool's model list.
    let mut body = bytes;
    let mut rewritten = None;
    if let Some(k) = split {
        if let (Some(model), Some(obj)) = (s.splitter.choose(k), json.as_object_mut()) {
            obj.insert("model".into(), Value::String(model.clone()));
            match serde_json::to_vec(&json) {
                Ok(v) => body = Bytes::from(v),
                Err(e) => {
                    return ProxyApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "encode", e.to_string())
                        .into_response()
                }
            }
            rewritten = Some(model);
        }
    }
    let model = json.get("model").and_then(Value::as_str).unwrap_or("");
    if !pool.models.is_empty() && !pool.models.iter().any(|m| m == model) {
        let mut r = ProxyApiError::model_not_found(model, &pool.name).into_response();
        set_header(&mut r, ROUTE_HEADER, &route);
        return r;
    }

    // Criticality and admission. If the client goes away while this waits, the dropped future
    // gives its queue place back.
    let class = match criticality(&s, &headers, &json) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let permit = match pool.admission.admit(class, pool.controller_saturated(), pool.queue_timeout).await {
        Ok(p) => p,
        Err(why) => {
            s.metrics
                .refusals
                .get_or_create(&labels(&[
                    ("pool", &pool.name),
                    ("criticality", class.as_str()),
                    ("reason", why.as_str()),
                ]))
                .inc();
            let mut r = refusal(why, &pool.name, class).into_response();
            set_header(&mut r, ROUTE_HEADER, &route);
            s.count(&pool.name, "", r.status());
            return r;
        }
    };
    pm.admitted[class_index(class)].inc();

    // Stage 2, with retries on refused connections. `picked` holds the member's in-flight count:
    // dropped on every exit from here, including this future being dropped mid-forward.
    let uris = match ep {
        Endpoint::Chat => &pool.chat_uris,
        Endpoint::Completions => &pool.completion_uris,
    };
    let mut tried: Vec<usize> = Vec::new();
    let key = crate::prefix_key::prefix_key(&headers, &json, s.prefix_key_from_body);
    // Only the endpoint picker reads the prompt: the other algorithms never pay for hashing it.
    let prompt = if pool.uses_endpoint_picker() {
        llm_lc_balance::endpoint::prompt::prompt_blocks(
            &json,
            llm_lc_balance::endpoint::picker::Settings::default().max_blocks,
        )
    } else {
        None
    };
    let forwarded = forwarded_headers(&pool, headers, key);
    let (picked, started) = loop {
        let Some(picked) = pool.pick_counted(&tried, key, prompt.as_ref()) else {
            let msg = if tried.is_empty() {
                format!("pool {} has no member available", pool.name)
            } else {
                format!("no member of pool {} accepted a connection (tried {})", pool.name, tried.len())
            };
            let mut r = ProxyApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_member_available", msg)
                .with_retry_after(1)
                .into_response();
            set_header(&mut r, ROUTE_HEADER, &route);
            s.count(&pool.name, "", StatusCode::SERVICE_UNAVAILABLE);
            return r;
        };
        let i = picked.member;
        match s.upstream.send(&uris[i], &forwarded, body.clone()).await {
            Ok(st) => break (picked, st),
            Err(ForwardError::Connect(e)) => {
                drop(picked);
                tracing::warn!(pool = %pool.name, member = %pool.members[i], error = %e, "connect failed; trying another member");
                pool.eject(i);
                s.metrics
                    .retries
                    .get_or_create(&labels(&[("pool", &pool.name), ("member", pool.members[i].as_str())]))
                    .inc();
                tried.push(i);
            }
            Err(e) => {
                drop(picked);
                let status = match e {
                    ForwardError::FirstByteTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
                    _ => StatusCode::BAD_GATEWAY,
                };
                let mut r =
                    ProxyApiError::new(status, "upstream_failed", format!("member {}: {e}", pool.members[i]))
                        .into_response();
                set_header(&mut r, ROUTE_HEADER, &route);
                set_header(&mut r, POOL_HEADER, &pool.name);
                set_header(&mut r, MEMBER_HEADER, pool.members[i].as_str());
                s.count(&pool.name, pool.members[i].as_str(), status);
                return r;
            }
        }
    };
    respond(&s, pi, picked, permit, started, t0, &route, rewritten)
}

/// The headers sent upstream: the client's, with the prefix key in its hashed form when the pool
/// asks for it (the client's raw header never goes through then: the LB behind hashes our digits).
fn forwarded_headers(pool: &Pool, mut headers: HeaderMap, key: Option<u64>) -> HeaderMap {
    if pool.set_prefix_key {
        headers.remove(crate::prefix_key::PREFIX_KEY_HEADER);
        if let Some(k) = key {
            headers.insert(crate::prefix_key::PREFIX_KEY_HEADER, crate::prefix_key::header_value(k));
        }
    }
    headers
}

/// Build the streamed response; the in-flight count and the admission slot are held until its
/// body ends or is dropped.
#[allow(clippy::too_many_arguments)]
fn respond(
    s: &Arc<Shared>,
    pi: usize,
    picked: Picked,
    permit: Permit,
    started: Started,
    t0: Instant,
    route: &str,
    rewritten: Option<String>,
) -> Response {
    let Started { status, headers, first_at, body } = started;
    let pool = &s.pools[pi];
    let pm = &s.pool_metrics[pi];
    let member = picked.member;
    picked.first_byte();
    pm.ttft.observe(first_at.duration_since(t0).as_secs_f64());
    if status == StatusCode::OK {
        pm.ok[member].inc();
    } else {
        s.count(&pool.name, pool.members[member].as_str(), status);
    }
    let guard = InFlight { _picked: picked, _permit: permit, duration: pm.duration.clone(), t0 };
    let body = body.map(move |chunk| {
        let _keep = &guard;
        chunk
    });
    let mut r = Response::new(Body::from_stream(body));
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    set_header(&mut r, ROUTE_HEADER, route);
    set_header(&mut r, POOL_HEADER, &pool.name);
    set_header(&mut r, MEMBER_HEADER, pool.members[member].as_str());
    if let Some(m) = rewritten {
        set_header(&mut r, MODEL_HEADER, &m);
    }
    r
}

/// Held by a response body: on drop (end of body, error, or client gone) the member's in-flight
/// count goes down and the admission slot passes on.
struct InFlight {
    _picked: Picked,
    _permit: Permit,
    duration: Histogram,
    t0: Instant,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.duration.observe(self.t0.elapsed().as_secs_f64());
    }
}

fn criticality(s: &Shared, headers: &HeaderMap, json: &Value) -> Result<Criticality, ProxyApiError> {
    let bad = |v: &str, from: &str| {
        ProxyApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_criticality",
            format!("criticality {v:?} from {from} is not one of critical, standard, sheddable"),
        )
    };
    if let Some(h) = headers.get(s.criticality_header.as_str()) {
        let v = String::from_utf8_lossy(h.as_bytes());
        return Criticality::parse(&v).ok_or_else(|| bad(&v, &format!("header {}", s.criticality_header)));
    }
    match lookup(json, &s.criticality_field) {
        None | Some(Value::Null) => Ok(s.criticality_default),
        Some(Value::String(v)) => Criticality::parse(v).ok_or_else(|| bad(v, "the body")),
        Some(other) => Err(bad(&other.to_string(), "the body")),
    }
}

fn refusal(why: Refusal, pool: &str, class: Criticality) -> ProxyApiError {
    match why {
        Refusal::Shed => ProxyApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "shed",
            format!("pool {pool} is saturated and this request is {}; retry later", class.as_str()),
        ),
        Refusal::QueueFull => ProxyApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "queue_full",
            format!("pool {pool} is saturated and its wait queue is full; retry later"),
        ),
        Refusal::Displaced => ProxyApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "displaced",
            format!("pool {pool} is saturated and a critical request took this request's place in the queue"),
        ),
        Refusal::QueueTimeout => ProxyApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "queue_timeout",
            format!("pool {pool} stayed saturated for the whole queue timeout"),
        ),
    }
    .with_retry_after(1)
}

/// `/v1/models`: exactly the names a client may send. Candidates are every pool's `models`, the
/// names the routing table compares `model` with (canary bases such as `sql-lora` among them), and
/// what the members of pools without a model list serve; a candidate is listed when some request
/// naming it reaches a pool that takes it ([`RouteTable::accepts_model`]). Names only reachable
/// through a canary rewrite (`sql-lora-v1`) are not listed: a client sending them gets 404.
async fn models(State(s): State<Arc<Shared>>) -> Response {
    let mut candidates: Vec<(String, Option<Value>)> = Vec::new();
    let add = |id: &str, entry: Option<Value>, c: &mut Vec<(String, Option<Value>)>| {
        if !c.iter().any(|(x, _)| x == id) {
            c.push((id.to_string(), entry));
        }
    };
    // In pool order: a pool's model list, or what its members serve (then the pool takes those).
    let mut served: HashMap<&str, Vec<String>> = HashMap::new();
    for pool in &s.pools {
        if !pool.models.is_empty() {
            for m in &pool.models {
                add(m, None, &mut candidates);
            }
            continue;
        }
        let entries = ask_members(&s, pool).await;
        let ids = served.entry(pool.name.as_str()).or_default();
        for e in entries {
            if let Some(id) = e.get("id").and_then(Value::as_str).map(str::to_string) {
                ids.push(id.clone());
                add(&id, Some(e), &mut candidates);
            }
        }
    }
    for m in s.table.model_values() {
        add(&m, None, &mut candidates);
    }
    let mut data: Vec<Value> = Vec::new();
    for (id, entry) in candidates {
        let takes = |pool: &str, split: bool| {
            split
                || s.pool(pool).is_some_and(|p| {
                    if p.models.is_empty() {
                        served.get(pool).is_some_and(|ids| ids.contains(&id))
                    } else {
                        p.models.contains(&id)
                    }
                })
        };
        let Some(pool) = s.table.accepts_model(&id, takes) else { continue };
        let mut e = entry.unwrap_or_else(|| json!({"id": id, "object": "model"}));
        if let Some(o) = e.as_object_mut() {
            o.entry("object").or_insert_with(|| json!("model"));
            o.entry("created").or_insert_with(|| json!(s.started_unix));
            o.entry("owned_by").or_insert_with(|| json!("llm-load-controller"));
            o.insert("pool".into(), Value::String(pool));
        }
        data.push(e);
    }
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn ask_members(s: &Shared, pool: &Pool) -> Vec<Value> {
    for base in &pool.bases {
        let req = s.upstream.client().get(format!("{base}/v1/models")).timeout(Duration::from_secs(2));
        let Ok(resp) = req.send().await else { continue };
        if !resp.status().is_success() {
            continue;
        }
        if let Ok(v) = resp.json::<Value>().await {
            if let Some(Value::Array(d)) = v.get("data") {
                return d.clone();
            }
        }
    }
    Vec::new()
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    // Gauges are read from the live state at scrape time, so they can never drift.
    for pool in &s.pools {
        let v = pool.view();
        s.metrics.queued.get_or_create(&labels(&[("pool", &pool.name)])).set(v.queued as i64);
        for m in &v.members {
            let l = labels(&[("pool", &pool.name), ("member", m.member.as_str())]);
            s.metrics.in_flight.get_or_create(&l).set(i64::from(m.in_flight));
            s.metrics.weight.get_or_create(&l).set(f64::from(m.weight));
        }
    }
    (
        [(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
        s.metrics.encode(),
    )
        .into_response()
}
