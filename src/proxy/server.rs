//! The OpenAI API listener: `/v1/chat/completions` and `/v1/completions` go through both stages,
//! `/v1/models` is aggregated from the pools, `/metrics` and `/healthz` describe the proxy.
//!
//! One request: read the body (413 past the limit), parse it (400), walk the routing table (a
//! rejection answers here), apply a model split, check the model against the pool (404), classify
//! its criticality, wait for admission (429/503), choose a member and forward (a refused connection
//! retries on another member; 503 when none is left). The response carries `x-llmlc-route`,
//! `x-llmlc-pool` and `x-llmlc-member`.

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
use serde_json::{json, Value};

use super::config::ProxyConfig;
use super::criticality::{Criticality, Permit, Refusal};
use super::errors::ProxyApiError;
use super::metrics::{labels, ProxyMetrics};
use super::pool::Pool;
use super::route::{lookup, parse_path, RouteTable, Seg, Target};
use super::split::Splitter;
use super::upstream::{ForwardError, Started, Upstream};

pub const ROUTE_HEADER: &str = "x-llmlc-route";
pub const POOL_HEADER: &str = "x-llmlc-pool";
pub const MEMBER_HEADER: &str = "x-llmlc-member";
pub const MODEL_HEADER: &str = "x-llmlc-model";

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
}

impl Shared {
    pub fn new(cfg: &ProxyConfig, table: RouteTable) -> Result<Shared, String> {
        let pools: Vec<Arc<Pool>> = cfg
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| Arc::new(Pool::new(p, cfg.algorithm, cfg.seed.wrapping_add(i as u64))))
            .collect();
        let pool_index = pools.iter().enumerate().map(|(i, p)| (p.name.clone(), i)).collect();
        Ok(Shared {
            splitter: Splitter::new(&table.splits),
            table,
            pools,
            pool_index,
            metrics: ProxyMetrics::new(),
            upstream: Upstream::new(&cfg.timeouts)?,
            max_body_bytes: cfg.limits.max_body_bytes,
            criticality_header: cfg.criticality.header.to_ascii_lowercase(),
            criticality_field: parse_path(&cfg.criticality.field).unwrap_or_default(),
            criticality_default: cfg.criticality.default,
        })
    }

    pub fn pool(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pool_index.get(name).and_then(|&i| self.pools.get(i))
    }
}

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .fallback(not_found)
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

async fn chat(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    handle(s, "/v1/chat/completions", headers, body).await
}

async fn completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    handle(s, "/v1/completions", headers, body).await
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

async fn handle(s: Arc<Shared>, path: &'static str, headers: HeaderMap, body: Body) -> Response {
    let t0 = Instant::now();
    let bytes = match read_limited(&headers, body, s.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let mut json: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => return ProxyApiError::bad_json(&e).into_response(),
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
    let decision = s.table.evaluate(&json, &headers);
    for h in &decision.hops {
        let branch = if h.matched { "match" } else { "miss" };
        s.metrics
            .route_steps
            .get_or_create(&labels(&[("step", &s.table.steps[h.step].id), ("branch", branch)]))
            .inc();
    }
    let route = decision.route(&s.table);
    let (pool_name, split) = match &decision.target {
        Target::Pool { pool, split } => (pool.clone(), *split),
        Target::Reject { status, message } => {
            s.metrics.route_results.get_or_create(&labels(&[("result", &format!("reject:{status}"))])).inc();
            let status = StatusCode::from_u16(*status).unwrap_or(StatusCode::FORBIDDEN);
            let mut r = ProxyApiError::new(status, "rejected_by_route", message.clone()).into_response();
            set_header(&mut r, ROUTE_HEADER, &route);
            s.metrics
                .requests
                .get_or_create(&labels(&[("pool", ""), ("member", ""), ("status", status.as_str())]))
                .inc();
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
    s.metrics.route_results.get_or_create(&labels(&[("result", &format!("pool:{pool_name}"))])).inc();
    let Some(pool) = s.pool(&pool_name).cloned() else {
        return ProxyApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "route_bug",
            format!("no pool {pool_name}"),
        )
        .into_response();
    };

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

    // Criticality and admission.
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
            s.metrics
                .requests
                .get_or_create(&labels(&[
                    ("pool", &pool.name),
                    ("member", ""),
                    ("status", r.status().as_str()),
                ]))
                .inc();
            return r;
        }
    };
    s.metrics
        .admissions
        .get_or_create(&labels(&[("pool", &pool.name), ("criticality", class.as_str())]))
        .inc();

    // Stage 2, with retries on refused connections.
    let mut tried: Vec<usize> = Vec::new();
    let (member, started) = loop {
        let Some(i) = pool.pick(&tried) else {
            let msg = if tried.is_empty() {
                format!("pool {} has no member available", pool.name)
            } else {
                format!("no member of pool {} accepted a connection (tried {})", pool.name, tried.len())
            };
            let mut r = ProxyApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_member_available", msg)
                .with_retry_after(1)
                .into_response();
            set_header(&mut r, ROUTE_HEADER, &route);
            s.metrics
                .requests
                .get_or_create(&labels(&[("pool", &pool.name), ("member", ""), ("status", "503")]))
                .inc();
            return r;
        };
        match s.upstream.send(&pool.bases[i], path, &headers, body.clone()).await {
            Ok(st) => break (i, st),
            Err(ForwardError::Connect(e)) => {
                tracing::warn!(pool = %pool.name, member = %pool.members[i], error = %e, "connect failed; trying another member");
                pool.finish(i);
                pool.eject(i);
                s.metrics
                    .retries
                    .get_or_create(&labels(&[("pool", &pool.name), ("member", pool.members[i].as_str())]))
                    .inc();
                tried.push(i);
            }
            Err(e) => {
                pool.finish(i);
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
                s.metrics
                    .requests
                    .get_or_create(&labels(&[
                        ("pool", &pool.name),
                        ("member", pool.members[i].as_str()),
                        ("status", status.as_str()),
                    ]))
                    .inc();
                return r;
            }
        }
    };
    respond(&s, pool, member, permit, started, t0, &route, rewritten)
}

/// Build the streamed response; the in-flight count and the admission slot are held until its
/// body ends or is dropped.
#[allow(clippy::too_many_arguments)]
fn respond(
    s: &Arc<Shared>,
    pool: Arc<Pool>,
    member: usize,
    permit: Permit,
    started: Started,
    t0: Instant,
    route: &str,
    rewritten: Option<String>,
) -> Response {
    let Started { status, headers, first_at, body } = started;
    s.metrics
        .ttft
        .get_or_create(&labels(&[("pool", &pool.name)]))
        .observe(first_at.duration_since(t0).as_secs_f64());
    s.metrics
        .requests
        .get_or_create(&labels(&[
            ("pool", &pool.name),
            ("member", pool.members[member].as_str()),
            ("status", status.as_str()),
        ]))
        .inc();
    let guard = InFlight { shared: s.clone(), pool: pool.clone(), member, _permit: permit, t0 };
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
    shared: Arc<Shared>,
    pool: Arc<Pool>,
    member: usize,
    _permit: Permit,
    t0: Instant,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.pool.finish(self.member);
        self.shared
            .metrics
            .duration
            .get_or_create(&labels(&[("pool", &self.pool.name)]))
            .observe(self.t0.elapsed().as_secs_f64());
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

/// `/v1/models`: each pool's configured models, or what one of its members lists. Merged by id.
async fn models(State(s): State<Arc<Shared>>) -> Response {
    let mut data: Vec<Value> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for pool in &s.pools {
        let entries: Vec<Value> = if !pool.models.is_empty() {
            pool.models
                .iter()
                .map(|m| json!({"id": m, "object": "model", "owned_by": "llm-load-controller"}))
                .collect()
        } else {
            ask_members(&s, pool).await
        };
        for mut e in entries {
            let Some(id) = e.get("id").and_then(Value::as_str).map(str::to_string) else { continue };
            if seen.insert(id) {
                if let Some(o) = e.as_object_mut() {
                    o.insert("pool".into(), Value::String(pool.name.clone()));
                }
                data.push(e);
            }
        }
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
