//! Ratio intake and the live view, on a separate admin listener (loopback by default: ratios steer
//! traffic, so they must not be writable from the data path).
//!
//! - `POST /admin/ratios`: the controller's `webhook` sink posts `{"pool": "NAME", "ratios":
//!   {"10.0.0.1:8000": 57, ...}}` (`llm_lc_adapters::webhook::WebhookPayload`). 200 with what was
//!   applied; 404 for an unknown pool; 400 for a bad body; 401 without the configured bearer token.
//! - `GET /admin/ratios/{pool}`: the pool's weights in force, in the same `WebhookPayload` shape, so
//!   a sink can read back what the proxy holds and repair drift (a restarted proxy starts equal);
//!   204 while no ratios have arrived since the start.
//! - `GET /admin/state`: every pool's weights, in-flight counts, queue and saturation.
//! - `GET /healthz`.
//!
//! [`poll_ratios`] is the other intake: it reads the controller's `GET /v1/ratios` (the last cycle
//! report) every interval and applies each pool's ratios and saturation.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use llm_lc_adapters::webhook::WebhookPayload;
use llm_lc_adapters::{MemberId, Ratios, SecretRef};
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::config::PollConfig;
use super::metrics::labels;
use super::pool::{Applied, WeightSource};
use super::server::Shared;

#[derive(Clone)]
struct AdminState {
    shared: Arc<Shared>,
    token: Option<SecretRef>,
}

pub fn router(shared: Arc<Shared>, token: Option<SecretRef>) -> Router {
    Router::new()
        .route("/admin/ratios", post(post_ratios))
        .route("/admin/ratios/{pool}", get(get_ratios))
        .route("/admin/state", get(state))
        .route("/healthz", get(|| async { "ok\n" }))
        .fallback(|| async { err(StatusCode::NOT_FOUND, "no such admin endpoint") })
        .method_not_allowed_fallback(super::server::method_not_allowed)
        .with_state(AdminState { shared, token })
}

/// Admin errors have the same OpenAI shape as the API's.
fn err(status: StatusCode, msg: impl Into<String>) -> Response {
    let code = match status {
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::BAD_REQUEST => "invalid_body",
        _ => "admin_error",
    };
    super::errors::ProxyApiError::new(status, code, msg).into_response()
}

/// Check `Authorization: Bearer ...` against the configured token (read at each request, so a
/// rotated secret file takes effect without a restart).
fn authorized(st: &AdminState, headers: &HeaderMap) -> Result<(), (StatusCode, &'static str)> {
    let Some(token) = &st.token else { return Ok(()) };
    let want = match token.resolve() {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(error = %e, "admin bearer token cannot be read; refusing admin requests");
            return Err((
                StatusCode::SERVICE_UNAVAILABLE,
                "the proxy cannot read its admin token; see its log",
            ));
        }
    };
    let got = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match got {
        Some(g) if constant_time_eq(g.as_bytes(), want.as_bytes()) => Ok(()),
        _ => Err((StatusCode::UNAUTHORIZED, "missing or wrong bearer token")),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Apply ratios to a named pool and count it. `None` when the pool does not exist.
pub fn apply(shared: &Shared, pool: &str, ratios: &Ratios, source: WeightSource) -> Option<Applied> {
    let p = shared.pool(pool)?;
    let applied = p.apply_ratios(ratios, source);
    let src = match source {
        WeightSource::Webhook => "webhook",
        WeightSource::Poll => "poll",
        WeightSource::Api => "api",
        WeightSource::Equal => "equal",
    };
    shared.metrics.ratio_updates.get_or_create(&labels(&[("pool", pool), ("source", src)])).inc();
    if applied.unknown_count > 0 {
        shared
            .metrics
            .unknown_ratio_members
            .get_or_create(&labels(&[("pool", pool)]))
            .inc_by(applied.unknown_count as u64);
        if p.log_unknown_now(std::time::Instant::now()) {
            tracing::warn!(
                pool,
                count = applied.unknown_count,
                first = ?applied.unknown_members,
                "ratios name members this pool does not have; ignored (counted in \
                 llmlc_proxy_unknown_ratio_members_total, logged at most once a minute)"
            );
        }
    }
    Some(applied)
}

async fn post_ratios(State(st): State<AdminState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err((status, msg)) = authorized(&st, &headers) {
        return err(status, msg);
    }
    let payload: WebhookPayload = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            return err(
                StatusCode::BAD_REQUEST,
                format!("bad body ({e}); send {{\"pool\": \"NAME\", \"ratios\": {{\"10.0.0.1:8000\": 57}}}}"),
            )
        }
    };
    if let Some((m, r)) = payload.ratios.iter().find(|(_, r)| *r > llm_lc_adapters::MAX_RATIO) {
        return err(
            StatusCode::BAD_REQUEST,
            format!(
                "ratio {r} of member {} is above {}, the largest ratio accepted",
                llm_lc_adapters::name::shorten(m.as_str()),
                llm_lc_adapters::MAX_RATIO
            ),
        );
    }
    match apply(&st.shared, &payload.pool, &payload.ratios, WeightSource::Webhook) {
        Some(a) => Json(a).into_response(),
        None => {
            let known: Vec<&str> = st.shared.pools.iter().map(|p| p.name.as_str()).collect();
            err(
                StatusCode::NOT_FOUND,
                format!(
                    "no pool {}; pools are: {}",
                    llm_lc_adapters::name::shorten(&payload.pool),
                    known.join(", ")
                ),
            )
        }
    }
}

async fn get_ratios(State(st): State<AdminState>, Path(pool): Path<String>, headers: HeaderMap) -> Response {
    if let Err((status, msg)) = authorized(&st, &headers) {
        return err(status, msg);
    }
    let Some(p) = st.shared.pool(&pool) else {
        return err(StatusCode::NOT_FOUND, format!("no pool {}", llm_lc_adapters::name::shorten(&pool)));
    };
    let v = p.view();
    if v.weights_from == WeightSource::Equal {
        return StatusCode::NO_CONTENT.into_response();
    }
    let ratios: Ratios = v.members.into_iter().map(|m| (m.member, m.weight)).collect();
    Json(WebhookPayload { pool, ratios }).into_response()
}

async fn state(State(st): State<AdminState>, headers: HeaderMap) -> Response {
    if let Err((status, msg)) = authorized(&st, &headers) {
        return err(status, msg);
    }
    let pools: Vec<_> = st.shared.pools.iter().map(|p| p.view()).collect();
    Json(json!({ "pools": pools })).into_response()
}

/// The parts of the controller's cycle report (`llm_load_controller::report::CycleReport`) the proxy uses.
#[derive(Debug, Deserialize)]
struct PolledReport {
    #[serde(default)]
    pools: Vec<PolledPool>,
}

#[derive(Debug, Deserialize)]
struct PolledPool {
    pool: String,
    #[serde(default)]
    saturation: Option<f64>,
    #[serde(default)]
    members: Vec<PolledMember>,
}

#[derive(Debug, Deserialize)]
struct PolledMember {
    member: MemberId,
    ratio: u32,
    /// The member's gauges as the controller last read them (`gauges_from: controller`). Read
    /// leniently: a gauge that is not a number is no gauge, never a report refused.
    #[serde(default)]
    waiting: Option<serde_json::Value>,
    #[serde(default)]
    running: Option<serde_json::Value>,
    #[serde(default)]
    kv_usage: Option<serde_json::Value>,
}

impl PolledMember {
    /// Its gauges, when the report has a queue for it.
    fn gauges(&self) -> Option<llm_lc_balance::endpoint::Gauges> {
        let number = |v: &Option<serde_json::Value>| {
            v.as_ref().and_then(serde_json::Value::as_f64).filter(|v| v.is_finite() && *v >= 0.0)
        };
        Some(llm_lc_balance::endpoint::Gauges {
            waiting: number(&self.waiting)?.round() as u32,
            running: number(&self.running).map_or(0, |v| v.round() as u32),
            kv_usage: number(&self.kv_usage).unwrap_or(0.0),
        })
    }
}

/// Poll once: apply every known pool's ratios and saturation. Returns how many pools were applied.
pub async fn poll_once(shared: &Shared, client: &reqwest::Client, cfg: &PollConfig) -> Result<usize, String> {
    let mut req = client.get(&cfg.url).timeout(Duration::from_secs(5));
    if let Some(t) = &cfg.bearer_token {
        req = req.bearer_auth(t.resolve()?);
    }
    let resp =
        req.send().await.map_err(|e| format!("GET {}: {}", cfg.url, super::errors::error_chain(&e)))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| format!("GET {}: reading the body: {e}", cfg.url))?;
    if !status.is_success() {
        return Err(format!(
            "GET {} answered {status}: {}",
            cfg.url,
            text.chars().take(200).collect::<String>()
        ));
    }
    let report: PolledReport = serde_json::from_str(&text).map_err(|e| {
        format!("GET {}: not a cycle report ({e}); is this the controller's /v1/ratios?", cfg.url)
    })?;
    let mut n = 0;
    for p in report.pools {
        let Some(pool) = shared.pool(&p.pool) else { continue };
        pool.set_saturation(p.saturation);
        if p.members.is_empty() {
            continue;
        }
        if pool.uses_endpoint_picker() && pool.gauges_from == super::config::GaugesFrom::Controller {
            for (i, name) in pool.members.iter().enumerate() {
                pool.set_gauges(
                    i,
                    p.members.iter().find(|m| &m.member == name).and_then(PolledMember::gauges),
                );
            }
        }
        let ratios: Ratios = p.members.into_iter().map(|m| (m.member, m.ratio)).collect();
        apply(shared, &p.pool, &ratios, WeightSource::Poll);
        n += 1;
    }
    Ok(n)
}

/// Poll until cancelled. Failures are logged (once per change of error) and retried next interval;
/// the last weights stay in force meanwhile (fail static).
pub async fn poll_ratios(
    shared: Arc<Shared>,
    client: reqwest::Client,
    cfg: PollConfig,
    stop: CancellationToken,
) {
    let mut last_err: Option<String> = None;
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match poll_once(&shared, &client, &cfg).await {
            Ok(_) => {
                if last_err.take().is_some() {
                    tracing::info!(url = %cfg.url, "polling ratios works again");
                }
            }
            Err(e) => {
                if last_err.as_deref() != Some(e.as_str()) {
                    tracing::warn!(error = %e, "cannot poll ratios; keeping the current weights");
                }
                last_err = Some(e);
            }
        }
    }
}
