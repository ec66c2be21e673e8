//! A proxy done properly: SSE passes through chunk by chunk, a client that leaves cancels the
//! upstream request, connect failures retry on another member, first-byte and idle timeouts, and
//! OpenAI-style errors (400, 413, 404, 503, upstream errors passed through); `/v1/models` is
//! aggregated from the pools.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::routing::post;
use axum::Router;
use futures::StreamExt;
use llm_lc_sim::ModelProfile;
use llm_lc_testkit::proxy::*;
use llm_lc_testkit::{ports, wait};
use serde_json::{json, Value};
use tokio::sync::Notify;

fn config(members: &str, extra: &str) -> String {
    format!(
        "# proxy config\nalgorithm: weighted-round-robin\n{extra}pools:\n  - name: llm\n    members: {members}\nroutes:\n  steps:\n    - id: all\n      field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400, message: 'say which model' }}\n"
    )
}

/// A backend whose SSE answer sends one event, then waits for `release` before the rest (or
/// forever with `hang_after_first`).
async fn gated_backend(release: Arc<Notify>, hang_after_first: bool) -> SocketAddr {
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let release = release.clone();
            async move {
                let stream = futures::stream::unfold(0u8, move |step| {
                    let release = release.clone();
                    async move {
                        match step {
                            0 => Some((
                                Ok::<Bytes, std::io::Error>(Bytes::from_static(b"data: {\"n\":1}\n\n")),
                                1,
                            )),
                            1 => {
                                if hang_after_first {
                                    std::future::pending::<()>().await;
                                }
                                release.notified().await;
                                Some((Ok(Bytes::from_static(b"data: {\"n\":2}\n\ndata: [DONE]\n\n")), 2))
                            }
                            _ => None,
                        }
                    }
                });
                axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(stream))
                    .unwrap()
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_reaches_the_client_chunk_by_chunk() {
    let release = Arc::new(Notify::new());
    let backend = gated_backend(release.clone(), false).await;
    let proxy = start_proxy(&config(&members_yaml(&[backend]), "")).await;
    let resp = client()
        .post(format!("http://{}/v1/chat/completions", proxy.addr()))
        .json(&json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.bytes_stream();
    // The second event is only sent once we have the first: if the proxy buffered, this would hang.
    let first = tokio::time::timeout(Duration::from_secs(5), body.next()).await.expect("first event in time");
    assert_eq!(first.unwrap().unwrap(), Bytes::from_static(b"data: {\"n\":1}\n\n"));
    release.notify_one();
    let mut rest = Vec::new();
    while let Some(c) = tokio::time::timeout(Duration::from_secs(5), body.next()).await.expect("rest in time")
    {
        rest.extend_from_slice(&c.unwrap());
    }
    assert_eq!(rest, b"data: {\"n\":2}\n\ndata: [DONE]\n\n");

    // Through the simulated vLLM too: many token events, then [DONE]; TTFT is recorded.
    let f = fleet(ModelProfile::tiny(), 1, &[], &[], 20.0).await;
    let proxy2 = start_proxy(&config(&members_yaml(&f.addrs()), "")).await;
    let resp = client()
        .post(format!("http://{}/v1/chat/completions", proxy2.addr()))
        .json(&json!({"model": "sim-tiny", "stream": true, "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let text = resp.text().await.unwrap();
    assert_eq!(text.matches("data: ").count(), 20 + 2, "role chunk, 20 tokens, [DONE]: {text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    let m =
        client().get(format!("http://{}/metrics", proxy2.addr())).send().await.unwrap().text().await.unwrap();
    assert_eq!(metric_sum(&m, "llmlc_proxy_ttft_seconds_count", &["pool=\"llm\""]), 1.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_upstream_request() {
    let f = fleet(ModelProfile::tiny(), 1, &[], &[], 1.0).await;
    let proxy = start_proxy(&config(&members_yaml(&f.addrs()), "")).await;
    let resp = client()
        .post(format!("http://{}/v1/completions", proxy.addr()))
        .json(&json!({"model": "sim-tiny", "prompt": "x", "stream": true, "max_tokens": 1500}))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    body.next().await.expect("a first chunk").expect("ok");
    assert_eq!(f.stats(0).unwrap().running, 1);
    drop(body);
    wait::until(Duration::from_secs(10), "the replica to abort the request", || async {
        (f.stats(0).unwrap().running == 0 && f.stats(0).unwrap().waiting == 0).then_some(())
    })
    .await;
    wait::until(Duration::from_secs(5), "the proxy's in-flight count to drop", || async {
        (proxy.pools()[0].members[0].in_flight == 0 && proxy.pools()[0].in_flight == 0).then_some(())
    })
    .await;
    assert!(f.stats(0).unwrap().generation_tokens_total < 1500, "the request did not run to the end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_retry_on_another_member_and_eject_it() {
    let f = fleet(ModelProfile::tiny(), 1, &[], &[], 50.0).await;
    let refused = ports::refused();
    let dead = refused.addr;
    let proxy = start_proxy(&config(&members_yaml(&[dead, f.addrs()[0]]), "")).await;
    let c = client();
    for _ in 0..20 {
        let r = chat(
            &c,
            proxy.addr(),
            &json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            &[],
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.header("x-llmlc-member"), f.addrs()[0].to_string());
    }
    let v = &proxy.pools()[0];
    assert!(v.members[0].ejected, "the refusing member is skipped for a while");
    let m = c.get(format!("http://{}/metrics", proxy.addr())).send().await.unwrap().text().await.unwrap();
    assert_eq!(
        metric_sum(&m, "llmlc_proxy_connect_retries_total", &[&format!("member=\"{dead}\"")]),
        1.0,
        "{m}"
    );

    // Every member refusing: 503, OpenAI-shaped, with Retry-After.
    let (refused_a, refused_b) = (ports::refused(), ports::refused());
    let proxy = start_proxy(&config(&members_yaml(&[refused_a.addr, refused_b.addr]), "")).await;
    let r =
        chat(&c, proxy.addr(), &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}), &[])
            .await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.json["error"]["code"], "no_member_available");
    assert!(r.json["error"]["message"].as_str().unwrap().contains("tried 2"), "{}", r.text);
    assert_eq!(r.header("retry-after"), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_byte_and_idle_timeouts() {
    let timeouts = "timeouts: { connect: 1s, first_byte: 400ms, idle: 300ms }\n";
    // A replica that accepts but never answers: 504 after the first-byte timeout.
    let f = fleet(ModelProfile::tiny(), 1, &[], &[], 10.0).await;
    f.set_hang(0, true).unwrap();
    let proxy = start_proxy(&config(&members_yaml(&f.addrs()), timeouts)).await;
    let c = client();
    let t = std::time::Instant::now();
    let r = chat(
        &c,
        proxy.addr(),
        &json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        &[],
    )
    .await;
    assert_eq!(r.status, 504, "{}", r.text);
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(r.json["error"]["message"].as_str().unwrap().contains("first-byte timeout"), "{}", r.text);
    assert_eq!(proxy.pools()[0].in_flight, 0);

    // A stream that goes silent after its first event: the body ends with an error after `idle`.
    let backend = gated_backend(Arc::new(Notify::new()), true).await;
    let proxy = start_proxy(&config(&members_yaml(&[backend]), timeouts)).await;
    let resp = c
        .post(format!("http://{}/v1/chat/completions", proxy.addr()))
        .json(&json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    assert!(body.next().await.unwrap().is_ok());
    let end =
        tokio::time::timeout(Duration::from_secs(5), body.next()).await.expect("the proxy ends the stream");
    assert!(matches!(end, Some(Err(_))), "a silent upstream breaks the stream: {end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_openai_shaped_and_upstream_errors_pass_through() {
    let f = fleet(ModelProfile::tiny(), 1, &[], &["sql-lora"], 50.0).await;
    let proxy = start_proxy(&config(&members_yaml(&f.addrs()), "limits: { max_body_bytes: 2000 }\n")).await;
    let c = client();
    let a = proxy.addr();

    let r = post_raw(&c, a, "/v1/chat/completions", "{\"model\": ", &[]).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json["error"]["type"], "invalid_request_error");
    assert_eq!(r.json["error"]["code"], "invalid_json");

    let big =
        json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "x".repeat(5000)}]}).to_string();
    let r = post_raw(&c, a, "/v1/chat/completions", &big, &[]).await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert!(r.json["error"]["message"].as_str().unwrap().contains("max_body_bytes"));

    let r = post_raw(&c, a, "/v1/chat/completions", "{\"messages\": []}", &[]).await;
    assert_eq!((r.status, r.json["error"]["message"].as_str()), (400, Some("say which model")));

    let r = post_raw(&c, a, "/v1/embeddings", "{}", &[]).await;
    assert_eq!(r.status, 404);
    assert!(r.json["error"]["message"].is_string());

    // The model server's own errors come back as it wrote them.
    let r =
        chat(&c, a, &json!({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}), &[])
            .await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert!(r.text.contains("no-such-model"), "vLLM's message passes through: {}", r.text);
    f.set_fail_rate(0, 1.0).unwrap();
    let r = chat(
        &c,
        a,
        &json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        &[],
    )
    .await;
    assert_eq!(r.status, 500);
    assert!(r.text.contains("simulated failure"), "{}", r.text);
    let m = c.get(format!("http://{a}/metrics")).send().await.unwrap().text().await.unwrap();
    assert_eq!(metric_sum(&m, "llmlc_proxy_requests_total", &["status=\"500\""]), 1.0, "{m}");

    // /v1/models: the members' list (model and adapter), tagged with the pool.
    let v: Value = c.get(format!("http://{a}/v1/models")).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().filter_map(|d| d["id"].as_str()).collect();
    assert_eq!(ids, vec!["sim-tiny", "sql-lora"]);
    assert_eq!(v["data"][0]["pool"], "llm");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_aggregated_across_pools_and_checked() {
    let a = fleet(ModelProfile::tiny(), 1, &["alpha"], &[], 50.0).await;
    let b = fleet(ModelProfile::tiny(), 1, &["beta"], &[], 50.0).await;
    let yaml = format!(
        "# proxy config\npools:\n  - name: a\n    members: {}\n  - name: b\n    members: {}\n    models: [beta]\nroutes:\n  steps:\n    - id: m\n      field: model\n      op: prefix\n      value: al\n      match: {{ pool: a }}\n      miss: {{ pool: b }}\n",
        members_yaml(&a.addrs()),
        members_yaml(&b.addrs())
    );
    let proxy = start_proxy(&yaml).await;
    let c = client();
    let v: Value =
        c.get(format!("http://{}/v1/models", proxy.addr())).send().await.unwrap().json().await.unwrap();
    let ids: Vec<(&str, &str)> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["id"].as_str().unwrap(), d["pool"].as_str().unwrap()))
        .collect();
    assert_eq!(ids, vec![("alpha", "a"), ("beta", "b")]);
    // Pool b only serves beta: another model routed there is a 404 from the proxy itself.
    let r = chat(
        &c,
        proxy.addr(),
        &json!({"model": "gamma", "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json["error"]["code"], "model_not_found");
    assert_eq!(r.json["error"]["param"], "model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn member_connections_are_kept_alive_for_streamed_and_whole_answers() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let accepted = Arc::new(AtomicUsize::new(0));
    let app = Router::new().route(
        "/v1/chat/completions",
        post(|body: Bytes| async move {
            let v: Value = serde_json::from_slice(&body).unwrap_or_default();
            if v["stream"] == true {
                let events = futures::stream::iter(["data: {\"n\":1}\n\n", "data: [DONE]\n\n"])
                    .map(|e| Ok::<_, std::io::Error>(Bytes::from_static(e.as_bytes())));
                axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(events))
                    .unwrap()
            } else {
                axum::response::IntoResponse::into_response(axum::Json(
                    json!({"object": "chat.completion", "choices": []}),
                ))
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let counter = accepted.clone();
    let l = axum::serve::ListenerExt::tap_io(l, move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    });
    tokio::spawn(async move { axum::serve(l, app).await });
    let proxy = start_proxy(&config(&members_yaml(&[addr]), "")).await;
    let c = client();
    for i in 0..20 {
        let stream = i % 2 == 0;
        let resp = c
            .post(format!("http://{}/v1/chat/completions", proxy.addr()))
            .json(&json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let text = resp.text().await.unwrap();
        assert!(
            if stream { text.ends_with("data: [DONE]\n\n") } else { text.contains("chat.completion") },
            "{text}"
        );
    }
    // Twenty sequential requests, alternately streamed and whole: one member connection serves all.
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}
