//! The simulated replica's OpenAI-compatible API over real HTTP: both endpoints, streaming and not,
//! models and LoRA adapters, bad input, client disconnects.

use std::time::{Duration, Instant};

use llm_lc_sim::{ModelProfile, OutputLen};
use llm_lc_testkit::sim::*;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_non_streaming_has_vllm_shape() {
    let f = fleet(ModelProfile::tiny(), &[1.0], |_| {}).await;
    let url = format!("{}/v1/completions", f.urls()[0]);
    let (status, body) =
        post(&url, &json!({"model": "sim-tiny", "prompt": prompt_of(40), "max_tokens": 7}).to_string()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["model"], "sim-tiny");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["index"], 0);
    assert!(!choice["text"].as_str().unwrap().is_empty());
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47, "prompt_tokens_details": null})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_is_incremental_and_framed_like_vllm() {
    // Real-time H100 profile: ~6 ms per token, so 40 tokens take >= ~240 ms end to end.
    let f = fleet(ModelProfile::llama_8b_h100(), &[1.0], |_| {}).await;
    let t0 = Instant::now();
    let resp = client()
        .post(format!("{}/v1/chat/completions", f.urls()[0]))
        .json(&json!({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 40, "stream": true,
                      "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream; charset=utf-8");
    let events = sse_events(resp).await;
    // role chunk + 40 token chunks + usage chunk + [DONE]
    assert_eq!(events.len(), 43, "{events:?}");
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..42].iter().map(|(_, e)| serde_json::from_str(e).unwrap()).collect();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    assert!(chunks.iter().all(|c| c["id"] == id && c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    for c in &chunks[1..40] {
        assert!(c["choices"][0]["finish_reason"].is_null());
        assert!(c["choices"][0]["delta"]["content"].is_string());
        assert!(c.get("usage").is_none(), "chat chunks carry no usage key (vLLM dumps them exclude_unset)");
    }
    assert_eq!(chunks[40]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[41]["choices"], json!([]));
    // 4 content chars -> 1 token + Llama 3 template (1 + 5 + 4), "Hello there" = 11 chars -> 3 tokens.
    assert_eq!(chunks[41]["usage"]["prompt_tokens"], 13);
    assert_eq!(chunks[41]["usage"]["completion_tokens"], 40);
    // Incremental: the tokens did not arrive in one burst.
    let first_token_at = events[1].0;
    let last_token_at = events[40].0;
    let spread = last_token_at - first_token_at;
    assert!(spread >= Duration::from_millis(150), "40 tokens arrived within {spread:?}");
    assert!(first_token_at - t0 < spread, "first token came late: TTFT {:?}", first_token_at - t0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_streaming_without_include_usage() {
    let f = fleet(ModelProfile::tiny(), &[1.0], |_| {}).await;
    let resp = client()
        .post(format!("{}/v1/completions", f.urls()[0]))
        .json(&json!({"prompt": "once upon a time", "max_tokens": 5, "stream": true}))
        .send()
        .await
        .unwrap();
    let events = sse_events(resp).await;
    assert_eq!(events.len(), 6);
    assert_eq!(events[5].1, "[DONE]");
    for (i, (_, e)) in events[..5].iter().enumerate() {
        let c: Value = serde_json::from_str(e).unwrap();
        assert_eq!(c["object"], "text_completion");
        assert!(c.get("usage").is_some_and(Value::is_null), "completion chunks carry usage: null");
        let fr = &c["choices"][0]["finish_reason"];
        assert_eq!(fr.is_null(), i < 4, "{c}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_non_streaming_and_models_with_lora() {
    let f = fleet(ModelProfile::tiny(), &[1.0], |c| {
        c.replicas[0].models = vec!["base-a".into(), "alias-b".into()];
        c.replicas[0].lora_adapters = vec!["sql-lora".into()];
    })
    .await;
    let base = &f.urls()[0];
    let models: Value = client().get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> =
        models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec!["base-a", "alias-b", "sql-lora"]);
    assert_eq!(models["data"][2]["parent"], "base-a");

    let chat = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).to_string()
    };
    let (s, body) = post(&format!("{base}/v1/chat/completions"), &chat("sql-lora")).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "sql-lora");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["usage"]["completion_tokens"], 3);
    let (s, _) = post(&format!("{base}/v1/chat/completions"), &chat("alias-b")).await;
    assert_eq!(s, 200);
    let (s, body) = post(&format!("{base}/v1/chat/completions"), &chat("gpt-4")).await;
    assert_eq!(s, 404);
    assert_eq!(body["error"]["type"], "NotFoundError");
    assert!(body["error"]["message"].as_str().unwrap().contains("gpt-4"));

    // Adapters appear in vllm:lora_requests_info; metrics carry the first model name.
    let text = metrics_text(base).await;
    assert!(text.contains("vllm:lora_requests_info{max_lora=\"1\""), "{text}");
    assert_eq!(
        metric(&text, "vllm:request_success_total", &["model_name=\"base-a\"", "finished_reason=\"length\""]),
        Some(2.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_400_and_never_kills_the_server() {
    let f = fleet(ModelProfile::tiny(), &[1.0], |_| {}).await;
    let base = &f.urls()[0];
    let cases: Vec<(&str, String, &str)> = vec![
        ("/v1/completions", "{\"prompt\": ".into(), "malformed JSON"),
        ("/v1/completions", "".into(), "empty"),
        ("/v1/completions", json!({"model": "sim-tiny"}).to_string(), "prompt"),
        ("/v1/completions", json!({"prompt": 42}).to_string(), "prompt"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0}).to_string(), "at least 1"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 1e30}).to_string(), "invalid request"),
        ("/v1/chat/completions", json!({"model": "sim-tiny"}).to_string(), "messages"),
        ("/v1/chat/completions", json!({"messages": "hi"}).to_string(), "invalid request"),
        // 2048-token context: 2100 tokens of prompt.
        (
            "/v1/completions",
            json!({"prompt": prompt_of(2100), "max_tokens": 5}).to_string(),
            "maximum context length is 2048",
        ),
        (
            "/v1/completions",
            json!({"prompt": prompt_of(2000), "max_tokens": 100}).to_string(),
            "2100 tokens (2000 in the messages, 100 in the completion)",
        ),
    ];
    for (path, body, needle) in &cases {
        let (s, v) = post(&format!("{base}{path}"), body).await;
        assert_eq!(s, 400, "{path} {body:.80}: {v}");
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(v["error"]["type"], "BadRequestError");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{path} {body:.80}: {msg}");
    }
    // Seeded garbage: every answer is a 4xx, never a dropped connection.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for _ in 0..150 {
        let len = rng.gen_range(0..200);
        let bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let r = client()
                .post(format!("{base}{path}"))
                .body(bytes.clone())
                .send()
                .await
                .expect("server answers");
            assert!(r.status().is_client_error(), "{path}: {}", r.status());
        }
    }
    let (s, _) = post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": "still alive", "max_tokens": 2}).to_string(),
    )
    .await;
    assert_eq!(s, 200);
    let r = client().get(format!("{base}/no/such/path")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    // The fleet's /admin routes are served on the replica's port with the same error shape: a
    // wrong method is a JSON 405, a bad body a JSON 4xx, and a good call works.
    let r = client().get(format!("{base}/admin/replicas/0/speed")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    let v: Value = r.json().await.expect("JSON 405");
    assert_eq!(v["error"]["code"], 405, "{v}");
    let r = client().post(format!("{base}/admin/replicas/0/speed")).body("{").send().await.unwrap();
    assert!(r.status().is_client_error(), "{}", r.status());
    assert!(r.json::<Value>().await.is_ok(), "JSON error body");
    let r = client().get(format!("{base}/admin/replicas")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_aborts_the_request() {
    let f = fleet(ModelProfile::llama_8b_h100(), &[1.0], |_| {}).await;
    let base = f.urls()[0].clone();
    let resp = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "long story", "max_tokens": 5000, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut stream = futures::StreamExt::boxed(resp.bytes_stream());
    let _first = futures::StreamExt::next(&mut stream).await.expect("a first chunk").unwrap();
    assert_eq!(f.stats(0).unwrap().running, 1);
    drop(stream);
    llm_lc_testkit::wait::until(Duration::from_secs(5), "the engine to drop the aborted request", || {
        let base = base.clone();
        async move {
            let text = metrics_text(&base).await;
            let aborted = metric(&text, "vllm:request_success_total", &["finished_reason=\"abort\""])?;
            let running = metric(&text, "vllm:num_requests_running", &[])?;
            (aborted == 1.0 && running == 0.0).then_some(())
        }
    })
    .await;
    assert_eq!(f.stats(0).unwrap().used_blocks, 0, "aborted request's KV blocks are freed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_length_without_max_tokens_and_ignore_eos() {
    let f = fleet(ModelProfile::tiny(), &[1.0], |c| {
        c.output_len = OutputLen { median: 9.0, sigma: 0.0 };
        c.time_scale = 50.0;
    })
    .await;
    let url = format!("{}/v1/completions", f.urls()[0]);
    // No max_tokens: the model "emits EOS" after a length drawn from the distribution.
    let (s, b) = post(&url, &json!({"prompt": prompt_of(48)}).to_string()).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["usage"]["completion_tokens"], 9);
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    // ignore_eos without max_tokens: generation runs to the context limit (2048 - 48).
    let (s, b) = post(&url, &json!({"prompt": prompt_of(48), "ignore_eos": true}).to_string()).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["usage"]["completion_tokens"], 2000);
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    // max_tokens given: exactly that many, EOS or not.
    let (_, b) = post(&url, &json!({"prompt": "x", "max_tokens": 30}).to_string()).await;
    assert_eq!(b["usage"]["completion_tokens"], 30);
    let text = metrics_text(&f.urls()[0]).await;
    assert_eq!(metric(&text, "vllm:request_success_total", &["finished_reason=\"stop\""]), Some(1.0));
    assert_eq!(metric(&text, "vllm:request_success_total", &["finished_reason=\"length\""]), Some(2.0));
    assert_eq!(metric(&text, "vllm:generation_tokens_total", &[]), Some(2039.0));
}

/// `request_overhead_s`: the front end's time before the engine sees a request (real vLLM's is
/// 5-7 ms on the CPU). A client waits it; the engine's own queue-time histogram does not hold it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_end_overhead_delays_the_answer_not_the_engine() {
    let mut profile = ModelProfile::tiny();
    profile.request_overhead_s = 0.2;
    let f = fleet(profile, &[1.0], |_| {}).await;
    let url = format!("{}/v1/completions", f.urls()[0]);
    let t0 = Instant::now();
    let (status, body) =
        post(&url, &json!({"model": "sim-tiny", "prompt": prompt_of(40), "max_tokens": 2}).to_string()).await;
    assert_eq!(status, 200, "{body}");
    assert!(t0.elapsed() >= Duration::from_millis(200), "{:?}", t0.elapsed());
    let page = client().get(format!("{}/metrics", f.urls()[0])).send().await.expect("metrics");
    let page = page.text().await.expect("page");
    let queue_sum: f64 = page
        .lines()
        .find_map(|l| l.strip_prefix("vllm:request_queue_time_seconds_sum")?.rsplit(' ').next()?.parse().ok())
        .expect("queue time on the page");
    assert!(queue_sum < 0.1, "{queue_sum}");
    // Not a number of seconds a profile may hold.
    let mut bad = ModelProfile::tiny();
    bad.request_overhead_s = f64::NAN;
    assert!(bad.validate().is_err());
}
