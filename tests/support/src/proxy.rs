//! Helpers shared by the `proxy_*` integration tests: the proxy and a simulated fleet on free
//! loopback ports, request helpers, and upstream doubles (feature `tools`).

use std::net::SocketAddr;
use std::time::Duration;

use llm_lc_proxy::{self as proxy, ProxyConfig, ProxyHandle};
use llm_lc_sim::{start_fleet, Fleet, FleetConfig, ModelProfile, ReplicaConfig};
use serde_json::Value;
use tokio::net::TcpListener;

/// Start the proxy from YAML text on free loopback ports.
pub async fn start_proxy(yaml: &str) -> ProxyHandle {
    let cfg: ProxyConfig = serde_yaml_ng::from_str(yaml).expect("test proxy config parses");
    start_proxy_cfg(cfg).await
}

pub async fn start_proxy_cfg(cfg: ProxyConfig) -> ProxyHandle {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let a = TcpListener::bind("127.0.0.1:0").await.expect("bind admin");
    proxy::start(cfg, l, a).await.expect("proxy starts")
}

/// `['127.0.0.1:P', ...]` for a YAML member list.
pub fn members_yaml(addrs: &[SocketAddr]) -> String {
    format!("[{}]", addrs.iter().map(|a| format!("'{a}'")).collect::<Vec<_>>().join(", "))
}

/// The tiny profile with a step time that does not depend on the batch: every request of N tokens
/// takes N steps whatever the load, so request counts follow in-flight counts exactly. 256 sequences
/// fit at once.
pub fn constant_profile() -> ModelProfile {
    let mut p = ModelProfile::tiny();
    p.name = "constant".into();
    p.max_num_seqs = 256;
    p.max_num_batched_tokens = 8192;
    p.num_gpu_blocks = 8192;
    p.prefill_token_s = 0.0;
    p.seq_s = 0.0;
    p.kv_token_s = 0.0;
    p.step_overhead_s = 0.002;
    p
}

/// A fleet of `n` replicas serving `models` (and `lora` adapters), `time_scale` times faster.
pub async fn fleet(
    profile: ModelProfile,
    n: usize,
    models: &[&str],
    lora: &[&str],
    time_scale: f64,
) -> Fleet {
    let mut cfg = FleetConfig::new(profile, &vec![1.0; n]);
    cfg.time_scale = time_scale;
    cfg.replicas = (0..n)
        .map(|_| ReplicaConfig {
            speed: 1.0,
            models: models.iter().map(|s| s.to_string()).collect(),
            lora_adapters: lora.iter().map(|s| s.to_string()).collect(),
            slots: None,
        })
        .collect();
    start_fleet(cfg).await.expect("fleet starts")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(60)).build().expect("client")
}

/// A finished response: status, headers, body as JSON (Null when it is not JSON) and text.
pub struct Resp {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub json: Value,
    pub text: String,
}

impl Resp {
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
    }
}

/// POST `body` (raw text) to `path` on the proxy.
pub async fn post_raw(
    c: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Resp {
    let mut req = c
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.expect("request sent");
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let text = r.text().await.expect("body");
    let json = serde_json::from_str(&text).unwrap_or(Value::Null);
    Resp { status, headers, json, text }
}

pub async fn chat(c: &reqwest::Client, addr: SocketAddr, body: &Value, headers: &[(&str, &str)]) -> Resp {
    post_raw(c, addr, "/v1/chat/completions", &body.to_string(), headers).await
}

/// Total output tokens a fleet has produced, over all its replicas.
pub fn tokens(f: &Fleet) -> u64 {
    (0..f.len()).map(|i| f.stats(i).expect("replica").generation_tokens_total).sum()
}

/// Sum of a metric family's samples whose label text contains every one of `labels`.
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// A fake guard service on a free port. It reads the `text` the proxy sends and answers by what it
/// contains: `please block` → block 451, `please route` → route to pool `route_pool`, `please hang`
/// → no answer for 30 s, `please garble` → 200 with a body that is not JSON, `please fail` → 500;
/// anything else → allow. Returns its URL and the number of calls so far.
pub async fn fake_guard(route_pool: &str) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let (c, pool) = (calls.clone(), route_pool.to_string());
    let app = axum::Router::new().route(
        "/v1/guard",
        axum::routing::post(move |axum::Json(ask): axum::Json<Value>| {
            let (c, pool) = (c.clone(), pool.clone());
            async move {
                use axum::response::IntoResponse;
                c.fetch_add(1, Ordering::SeqCst);
                let text = ask["text"].as_str().unwrap_or("").to_string();
                if text.contains("please hang") {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                if text.contains("please garble") {
                    return "this is not JSON".into_response();
                }
                if text.contains("please fail") {
                    return (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "guard broke").into_response();
                }
                let v = if text.contains("please block") {
                    serde_json::json!({"verdict": "block", "status": 451, "message": "the guard says no"})
                } else if text.contains("please route") {
                    serde_json::json!({"verdict": "route", "pool": pool})
                } else {
                    assert!(
                        ask["request"].is_object() && ask["step"].is_string(),
                        "the proxy sends the request: {ask}"
                    );
                    serde_json::json!({"verdict": "allow"})
                };
                axum::Json(v).into_response()
            }
        }),
    );
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind guard");
    let addr = l.local_addr().expect("guard addr");
    tokio::spawn(async move { axum::serve(l, app).await });
    (format!("http://{addr}/v1/guard"), calls)
}

/// A model-server stand-in for accounting and protocol tests. A body containing `hold` gets no
/// answer until the connection closes; `"stream":true` gets a short SSE stream; `chunked` gets a
/// JSON answer sent chunked (no Content-Length); anything else a JSON answer with a length.
pub async fn hold_backend() -> SocketAddr {
    use axum::body::{Body, Bytes};
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(|body: String| async move {
            if body.contains("hold") {
                std::future::pending::<()>().await;
            }
            let answer = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#;
            if body.contains("\"stream\":true") {
                let events = ["data: {\"n\":1}\n\n", "data: {\"n\":2}\n\n", "data: [DONE]\n\n"];
                let s = futures::stream::iter(events.map(|e| Ok::<_, std::io::Error>(Bytes::from_static(e.as_bytes()))));
                return axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(s))
                    .expect("response");
            }
            if body.contains("chunked") {
                let parts = [&answer[..10], &answer[10..]].map(|p| Ok::<_, std::io::Error>(Bytes::from(p.to_string())));
                return axum::response::Response::builder()
                    .header("content-type", "application/json")
                    .body(Body::from_stream(futures::stream::iter(parts)))
                    .expect("response");
            }
            axum::response::Response::builder()
                .header("content-type", "application/json")
                .body(Body::from(answer))
                .expect("response")
        }),
    );
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind backend");
    let addr = l.local_addr().expect("backend addr");
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// Sum of in-flight counts over a proxy's members, and its queued requests (live view).
pub fn in_flight_and_queued(p: &ProxyHandle) -> (u32, usize) {
    let pools = p.pools();
    (
        pools.iter().flat_map(|v| v.members.iter()).map(|m| m.in_flight).sum(),
        pools.iter().map(|v| v.queued).sum(),
    )
}
