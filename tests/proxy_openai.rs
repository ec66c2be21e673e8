//! The OpenAI surface third-party clients and load testers expect: `/health` (and `/healthz`),
//! `/v1/models` listing exactly the names a client may send (with `created` and `owned_by`),
//! duplicate JSON keys refused naming the key, every error OpenAI-shaped with the right status and a
//! Content-Length (the simulated servers' too), and non-streamed answers with a Content-Length.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use llm_lc_proxy::config;
use llm_lc_sim::ModelProfile;
use llm_lc_testkit::proxy::*;
use serde_json::{json, Value};

fn config_yaml(members: &str, extra: &str, pool_extra: &str) -> String {
    format!(
        "# proxy config\n{extra}pools:\n  - name: llm\n    members: {members}\n{pool_extra}routes:\n  steps:\n    - id: all\n      field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400, message: 'say which model' }}\n"
    )
}

/// An OpenAI error body, with a Content-Length that matches it.
fn assert_openai_error(r: &Resp, status: u16) {
    assert_eq!(r.status, status, "{}", r.text);
    let e = &r.json["error"];
    assert!(
        e["message"].is_string()
            && e["type"].is_string()
            && e.get("param").is_some()
            && e.get("code").is_some(),
        "not OpenAI-shaped: {}",
        r.text
    );
    assert_eq!(r.header("content-length"), r.text.len().to_string(), "{status} has a Content-Length");
    assert!(r.header("content-type").starts_with("application/json"), "{status}: {:?}", r.headers);
}

async fn send(method: reqwest::Method, url: String, body: Option<String>) -> Resp {
    let mut req = client().request(method, url);
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b);
    }
    let r = req.send().await.expect("request");
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let text = r.text().await.expect("body");
    let json = serde_json::from_str(&text).unwrap_or(Value::Null);
    Resp { status, headers, json, text }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_models_list_exactly_the_names_a_client_may_send() {
    // The example table: pools with model lists, a canary on sql-lora. Nothing needs to run behind.
    let mut cfg =
        config::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("config/proxy.yaml")).unwrap().config;
    cfg.ratios.poll = None;
    let proxy = start_proxy_cfg(cfg).await;
    let a = proxy.addr();
    let r = send(reqwest::Method::GET, format!("http://{a}/health"), None).await;
    assert_eq!((r.status, r.text.as_str()), (200, ""));
    let r = send(reqwest::Method::GET, format!("http://{a}/healthz"), None).await;
    assert_eq!(r.status, 200);
    let r = send(reqwest::Method::GET, format!("http://{a}/v1/models"), None).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let data = r.json["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().filter_map(|d| d["id"].as_str()).collect();
    // sql-lora-v1/-v2 are only reached through the canary: a client sending them gets 404.
    assert_eq!(ids, vec!["llama-70b", "llama-8b", "sql-lora"], "{}", r.text);
    for d in data {
        assert!(d["created"].as_u64().is_some_and(|c| c > 1_600_000_000), "{d}");
        assert_eq!(d["owned_by"], "llm-load-controller");
        assert_eq!(d["object"], "model");
    }
    let r = chat(&client(), a, &json!({"model": "sql-lora-v1", "messages": []}), &[]).await;
    assert_eq!(r.status, 404, "{}", r.text);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_keys_are_refused_naming_the_key() {
    let proxy = start_proxy(&config_yaml(&members_yaml(&[hold_backend().await]), "", "")).await;
    let c = client();
    let r = post_raw(
        &c,
        proxy.addr(),
        "/v1/chat/completions",
        r#"{"model":"nope","model":"llama-8b","messages":[]}"#,
        &[],
    )
    .await;
    assert_openai_error(&r, 400);
    assert_eq!(
        (r.json["error"]["code"].as_str(), r.json["error"]["param"].as_str()),
        (Some("duplicate_key"), Some("model"))
    );
    assert!(r.json["error"]["message"].as_str().unwrap().contains("\"model\""), "{}", r.text);
    let r = post_raw(
        &c,
        proxy.addr(),
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","role":"system","content":"x"}]}"#,
        &[],
    )
    .await;
    assert_openai_error(&r, 400);
    assert_eq!(r.json["error"]["param"], "role");
    // The same keys in different objects are fine.
    let r = post_raw(
        &c,
        proxy.addr(),
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}"#,
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    proxy.shutdown().await;
}

/// A member that accepts connections and closes them at once (502), or never answers (504).
async fn rude_member(answer_never: bool) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            if answer_never {
                held.push(s);
            }
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_openai_shaped_with_its_status() {
    let backend = hold_backend().await;
    let p = start_proxy(&config_yaml(
        &members_yaml(&[backend]),
        "limits: { max_body_bytes: 2000 }\n",
        "    max_in_flight_per_member: 1\n    queue_size: 0\n",
    ))
    .await;
    let a = p.addr();
    let url = |path: &str| format!("http://{a}{path}");
    let c = client();
    assert_openai_error(&post_raw(&c, a, "/v1/chat/completions", "{\"model\": ", &[]).await, 400);
    assert_openai_error(&post_raw(&c, a, "/v1/chat/completions", &"x".repeat(5000), &[]).await, 413);
    assert_openai_error(&send(reqwest::Method::GET, url("/v1/embeddings"), None).await, 404);
    let r = send(reqwest::Method::GET, url("/v1/chat/completions"), None).await;
    assert_openai_error(&r, 405);
    assert_eq!(r.json["error"]["code"], "method_not_allowed");
    assert_openai_error(&send(reqwest::Method::POST, url("/v1/models"), Some("{}".into())).await, 405);
    // 429: the pool is full and the queue has no room.
    let busy = tokio::spawn(async move {
        let _ = client()
            .post(format!("http://{a}/v1/chat/completions"))
            .body(r#"{"model":"m","messages":[{"role":"user","content":"hold"}]}"#)
            .send()
            .await;
    });
    llm_lc_testkit::wait::until(Duration::from_secs(5), "the pool to fill", || async {
        (in_flight_and_queued(&p).0 == 1).then_some(())
    })
    .await;
    let r = chat(&c, a, &json!({"model": "m", "messages": []}), &[]).await;
    assert_openai_error(&r, 429);
    assert_eq!(r.header("retry-after"), "1");
    busy.abort();
    p.shutdown().await;

    // 502 (the member closes the connection) and 504 (it never answers).
    let p = start_proxy(&config_yaml(&members_yaml(&[rude_member(false).await]), "", "")).await;
    assert_openai_error(&chat(&c, p.addr(), &json!({"model": "m", "messages": []}), &[]).await, 502);
    p.shutdown().await;
    let p = start_proxy(&config_yaml(
        &members_yaml(&[rude_member(true).await]),
        "timeouts: { first_byte: 200ms }\n",
        "",
    ))
    .await;
    assert_openai_error(&chat(&c, p.addr(), &json!({"model": "m", "messages": []}), &[]).await, 504);
    p.shutdown().await;
    // 503: nothing accepts connections.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let p = start_proxy(&config_yaml(&members_yaml(&[closed]), "", "")).await;
    assert_openai_error(&chat(&c, p.addr(), &json!({"model": "m", "messages": []}), &[]).await, 503);
    // Admin errors have the same shape.
    let r = send(reqwest::Method::POST, format!("http://{}/admin/ratios", p.admin_addr()), Some("{".into()))
        .await;
    assert_openai_error(&r, 400);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streamed_answers_carry_content_length() {
    let p = start_proxy(&config_yaml(&members_yaml(&[hold_backend().await]), "", "")).await;
    let c = client();
    for body in [
        json!({"model": "m", "messages": []}),
        json!({"model": "m", "messages": [], "metadata": {"x": "chunked"}}),
    ] {
        let r = chat(&c, p.addr(), &body, &[]).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.header("content-length"), r.text.len().to_string(), "{body}: {:?}", r.headers);
        assert_eq!(r.json["object"], "chat.completion");
    }
    // A stream stays a stream (chunked, no length).
    let r = chat(&c, p.addr(), &json!({"model": "m", "messages": [], "stream": true}), &[]).await;
    assert_eq!(r.header("content-length"), "");
    assert!(r.text.ends_with("data: [DONE]\n\n"), "{}", r.text);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_server_errors_are_openai_shaped_too() {
    let f = fleet(ModelProfile::tiny(), 1, &[], &[], 50.0).await;
    let s = f.addrs()[0];
    let big = json!({"model": "sim-tiny", "prompt": "x".repeat(3 << 20)}).to_string();
    let r = send(reqwest::Method::POST, format!("http://{s}/v1/completions"), Some(big.clone())).await;
    assert_openai_error(&r, 413);
    assert_eq!(r.json["error"]["code"], 413);
    assert_openai_error(&send(reqwest::Method::GET, format!("http://{s}/v1/completions"), None).await, 405);
    assert_openai_error(&send(reqwest::Method::GET, format!("http://{s}/nope"), None).await, 404);
    // Through the proxy (with a larger limit) the member's 413 passes through as it wrote it.
    let p = start_proxy(&config_yaml(&members_yaml(&[s]), "limits: { max_body_bytes: 8388608 }\n", "")).await;
    let r = post_raw(&client(), p.addr(), "/v1/completions", &big, &[]).await;
    assert_openai_error(&r, 413);
    assert_eq!(r.json["error"]["type"], "RequestEntityTooLargeError");
    p.shutdown().await;
}
