//! One replica's HTTP server: the OpenAI-compatible API, `/health`, `/metrics`, and the `/admin`
//! routes the fleet hands it (handled in [`super::fleet`], which builds the servers).
//!
//! Routes (as vLLM serves them):
//! - `POST /v1/completions`, `POST /v1/chat/completions`: streaming (SSE) and not.
//! - `GET /v1/models`: the replica's model names and LoRA adapters (adapters list their base model
//!   as `parent`).
//! - `GET /health`: 200 with an empty body while the replica is up (also while "hung", like a vLLM
//!   whose GPU is stuck but whose API process still answers).
//! - `GET /metrics`: Prometheus text in the replica's [`MetricsStyle`].
//! - `GET /props`: only in the llama.cpp style, as llama-server answers it: `total_slots` (the
//!   batch limit) and each slot's context in `default_generation_settings.n_ctx`; 404 otherwise,
//!   as vLLM has no such route.
//!
//! Every error, those of the HTTP layer included (unknown path 404, wrong method 405, a body over
//! axum's 2 MiB limit 413), is an OpenAI-style JSON error ([`ApiError`]). (Real vLLM answers an
//! unknown path with FastAPI's `{"detail": "Not Found"}`; the simulator keeps one shape.)
//!
//! A request whose replica goes down mid-answer loses its connection (the body ends with an error),
//! as with a crashed server. A client that disconnects has its request aborted in the engine.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};

use super::driver::{unix_now, Cmd, Observed, Out, Submission};
use super::engine::{Engine, EngineRequest, FinishReason};
use super::metrics::{self, MetricsStyle, MetricsView};
use super::openai::{self, ApiError, Endpoint, GenRequest, ResponseMeta};
use super::profile::{ModelProfile, BLOCK_SIZE};
use super::tokenize;

/// Everything one replica's handlers share.
pub(crate) struct Replica {
    pub index: usize,
    /// The profile's `request_overhead_s` in real time: how long a request takes to reach the engine.
    pub front_end: Duration,
    pub profile: ModelProfile,
    /// Served model names; the first is the default and the `model_name` label.
    pub models: Vec<String>,
    pub adapters: Vec<String>,
    pub style: MetricsStyle,
    pub output_len: OutputLen,
    pub cmd: UnboundedSender<Cmd>,
    pub observed: Arc<Mutex<Observed>>,
    /// Fraction of generation requests answered 500, as f64 bits.
    pub fail_rate: AtomicU64,
    pub hang: AtomicBool,
    pub rng: Mutex<ChaCha8Rng>,
    pub next_id: AtomicU64,
}

impl Replica {
    pub fn observed(&self) -> std::sync::MutexGuard<'_, Observed> {
        match self.observed.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    pub fn fail_rate(&self) -> f64 {
        f64::from_bits(self.fail_rate.load(Ordering::Relaxed))
    }

    fn roll(&self) -> f64 {
        match self.rng.lock() {
            Ok(mut r) => r.gen::<f64>(),
            Err(p) => p.into_inner().gen::<f64>(),
        }
    }

    fn sample_output_len(&self) -> u32 {
        match self.rng.lock() {
            Ok(mut r) => self.output_len.sample(&mut *r),
            Err(p) => self.output_len.sample(&mut *p.into_inner()),
        }
    }

    /// The model name to echo and the adapter, for a requested model.
    fn resolve(&self, model: Option<&str>) -> Result<(String, Option<String>), ApiError> {
        match model {
            None => Ok((self.models[0].clone(), None)),
            Some(m) if self.models.iter().any(|x| x == m) => Ok((m.to_string(), None)),
            Some(m) if self.adapters.iter().any(|x| x == m) => Ok((m.to_string(), Some(m.to_string()))),
            Some(m) => Err(ApiError::model_not_found(m)),
        }
    }
}

/// Router state: this replica.
#[derive(Clone)]
pub(crate) struct AppState {
    pub replica: Arc<Replica>,
}

/// Output length when a request gives no `max_tokens`: log-normal around `median` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OutputLen {
    pub median: f64,
    /// Standard deviation of the log; 0 gives exactly `median`.
    pub sigma: f64,
}

impl Default for OutputLen {
    /// Median 200 tokens, sigma 0.8: chat answers of a few dozen to ~1000 tokens.
    fn default() -> Self {
        OutputLen { median: 200.0, sigma: 0.8 }
    }
}

impl OutputLen {
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u32 {
        let v = match LogNormal::new(self.median.max(1.0).ln(), self.sigma.max(0.0)) {
            Ok(d) => d.sample(rng),
            Err(_) => self.median,
        };
        v.round().clamp(1.0, 1e6) as u32
    }
}

/// The replica's routes, with `admin` (the fleet's `/admin` routes, served on every replica's
/// port) merged in: the fleet builds servers, so the server takes its routes rather than knowing
/// the fleet.
pub(crate) fn router(state: AppState, admin: Router) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/props", get(props))
        .with_state(state)
        .merge(admin)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
}

async fn not_found() -> Response {
    ApiError::status(StatusCode::NOT_FOUND, "Not Found").into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::status(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed").into_response()
}

/// axum's body rejection (413 past its 2 MiB limit, 400 on a broken body) in the OpenAI shape.
fn body_or_error(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| ApiError::status(r.status(), r.body_text()))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn completions(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    match body_or_error(body).and_then(|b| openai::parse_completion(&b)) {
        Ok(g) => generate(&app.replica, g).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    match body_or_error(body).and_then(|b| openai::parse_chat(&b)) {
        Ok(g) => generate(&app.replica, g).await,
        Err(e) => e.into_response(),
    }
}

async fn models(State(app): State<AppState>) -> Json<serde_json::Value> {
    let r = &app.replica;
    let created = r.observed().started_unix as u64;
    let max_len = r.profile.max_model_len;
    let mut data: Vec<serde_json::Value> = r
        .models
        .iter()
        .map(|m| {
            json!({"id": m, "object": "model", "created": created, "owned_by": "vllm", "root": m,
                   "parent": null, "max_model_len": max_len})
        })
        .collect();
    data.extend(r.adapters.iter().map(|a| {
        json!({"id": a, "object": "model", "created": created, "owned_by": "vllm", "root": a,
               "parent": r.models[0], "max_model_len": null})
    }));
    Json(json!({"object": "list", "data": data}))
}

async fn metrics_text(State(app): State<AppState>) -> Response {
    let r = &app.replica;
    let text = {
        let obs = r.observed();
        let view = MetricsView {
            model_name: &r.models[0],
            engine: "0",
            stats: &obs.stats,
            requests: &obs.requests,
            block_size: BLOCK_SIZE,
            lora: obs.lora.as_ref(),
            created_unix: obs.started_unix,
            now_unix: unix_now(),
        };
        metrics::render(r.style, &view)
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn props(State(app): State<AppState>) -> Response {
    let r = &app.replica;
    if r.style != MetricsStyle::Llamacpp {
        return not_found().await;
    }
    let p = &r.profile;
    let per_slot = u64::from(p.num_gpu_blocks / p.max_num_seqs.max(1)) * u64::from(BLOCK_SIZE);
    Json(json!({
        "default_generation_settings": {"n_ctx": per_slot, "params": {"n_predict": -1}},
        "total_slots": p.max_num_seqs,
        "model_alias": r.models[0],
        "model_path": r.models[0],
        "modalities": {"vision": false, "audio": false},
    }))
    .into_response()
}

/// Aborts the request in the engine if the handler or its stream is dropped before the end.
struct AbortGuard {
    id: u64,
    cmd: UnboundedSender<Cmd>,
    done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cmd.send(Cmd::Abort { id: self.id });
        }
    }
}

async fn generate(r: &Arc<Replica>, g: GenRequest) -> Response {
    let (model, adapter) = match r.resolve(g.model.as_deref()) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let rate = r.fail_rate();
    if rate > 0.0 && r.roll() < rate {
        return ApiError::internal(format!(
            "simulated failure: replica {} fails {:.0}% of requests (set by /admin/replicas/{}/fail)",
            r.index,
            rate * 100.0,
            r.index
        ))
        .into_response();
    }
    let max_model_len = r.profile.max_model_len;
    let max_tokens = g.max_tokens.unwrap_or_else(|| max_model_len.saturating_sub(g.prompt_tokens));
    let eos_after = if g.max_tokens.is_none() && !g.ignore_eos { Some(r.sample_output_len()) } else { None };
    let id = r.next_id.fetch_add(1, Ordering::Relaxed);
    let req = EngineRequest { id, prompt_tokens: g.prompt_tokens, max_tokens, eos_after };
    if let Err(e) = Engine::check_sizes(max_model_len, &req) {
        return ApiError::bad_request(e.to_string()).into_response();
    }
    if !r.front_end.is_zero() {
        tokio::time::sleep(r.front_end).await;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let sub = Submission { req, blocks: g.blocks.clone().into(), adapter, arrived: Instant::now(), tx };
    if r.cmd.send(Cmd::Submit(sub)).is_err() {
        return ApiError::unavailable("the replica's engine has stopped; the fleet is shutting down")
            .into_response();
    }
    let guard = AbortGuard { id, cmd: r.cmd.clone(), done: false };
    let meta = ResponseMeta::new(g.endpoint, id, r.index as u64, unix_now() as u64, model);
    if g.stream {
        stream_response(g, meta, rx, guard)
    } else {
        full_response(g, meta, rx, guard).await
    }
}

/// A response whose connection breaks: what a client of a crashed server sees.
fn broken() -> Response {
    let err = std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "replica went down");
    Body::from_stream(futures::stream::once(async move { Err::<Bytes, _>(err) })).into_response()
}

async fn full_response(
    g: GenRequest,
    meta: ResponseMeta,
    mut rx: UnboundedReceiver<Out>,
    mut guard: AbortGuard,
) -> Response {
    let mut text = String::new();
    let mut n = 0u32;
    loop {
        match rx.recv().await {
            Some(Out::Token { finish }) => {
                text.push_str(tokenize::output_piece(n));
                n += 1;
                if let Some((produced, reason)) = finish {
                    guard.done = true;
                    let body = openai::full_response(
                        g.endpoint,
                        &meta,
                        &text,
                        reason.as_str(),
                        g.prompt_tokens,
                        produced,
                    );
                    return ([(header::CONTENT_TYPE, "application/json")], body).into_response();
                }
            }
            Some(Out::Rejected(e)) => {
                guard.done = true;
                return ApiError::bad_request(e.to_string()).into_response();
            }
            None => {
                guard.done = true; // the engine dropped it: nothing to abort
                return broken();
            }
        }
    }
}

enum Phase {
    Tokens,
    Usage(u32),
    Done,
    End,
}

struct StreamState {
    g: GenRequest,
    meta: ResponseMeta,
    rx: UnboundedReceiver<Out>,
    guard: AbortGuard,
    produced: u32,
    phase: Phase,
}

fn stream_response(
    g: GenRequest,
    meta: ResponseMeta,
    rx: UnboundedReceiver<Out>,
    guard: AbortGuard,
) -> Response {
    let state = StreamState { g, meta, rx, guard, produced: 0, phase: Phase::Tokens };
    let body = futures::stream::unfold(state, |mut s| async move {
        let item: Result<Bytes, std::io::Error> = match s.phase {
            Phase::End => return None,
            Phase::Done => {
                s.phase = Phase::End;
                Ok(Bytes::from_static(openai::SSE_DONE.as_bytes()))
            }
            Phase::Usage(completion) => {
                s.phase = Phase::Done;
                let u = openai::usage_chunk(s.g.endpoint, &s.meta, s.g.prompt_tokens, completion);
                Ok(Bytes::from(openai::sse(&u)))
            }
            Phase::Tokens => match s.rx.recv().await {
                Some(Out::Token { finish }) => {
                    let mut out = String::new();
                    if s.produced == 0 && s.g.endpoint == Endpoint::Chat {
                        out.push_str(&openai::sse(&openai::chat_role_chunk(&s.meta)));
                    }
                    let piece = tokenize::output_piece(s.produced);
                    s.produced += 1;
                    let reason = finish.map(|(_, r): (u32, FinishReason)| r.as_str());
                    let chunk = openai::token_chunk(s.g.endpoint, &s.meta, piece, reason);
                    out.push_str(&openai::sse(&chunk));
                    if let Some((produced, _)) = finish {
                        s.guard.done = true;
                        s.phase = if s.g.include_usage { Phase::Usage(produced) } else { Phase::Done };
                    }
                    Ok(Bytes::from(out))
                }
                Some(Out::Rejected(e)) => {
                    s.guard.done = true;
                    s.phase = Phase::Done;
                    let err = ApiError::bad_request(e.to_string());
                    Ok(Bytes::from(openai::sse(&err.body())))
                }
                None => {
                    s.guard.done = true;
                    s.phase = Phase::End;
                    Err(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "replica went down"))
                }
            },
        };
        Some((item, s))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| ApiError::internal("could not build the stream response").into_response())
}
