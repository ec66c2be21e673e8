//! The reference proxy as the first hop in front of an LB that hashes the prefix key
//! (`set_prefix_key: true` on the pool): what the proxy sends upstream, and, with the shipped
//! HAProxy prefix config behind it, that the groups the proxy sees land on one server each even
//! where HAProxy's own body key cannot tell them apart.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use llm_lc_testkit::envoy::{serve, CountingBackend};
use llm_lc_testkit::haproxy::{shipped_prefix_config, wait_all_up, Haproxy};
use llm_lc_testkit::proxy::{client, start_proxy};

const KEY: &str = "x-llm-prefix-key";

/// A backend that answers with the prefix-key header it received ("-" when none).
async fn echo_key() -> SocketAddr {
    let router = axum::Router::new().fallback(|headers: axum::http::HeaderMap| async move {
        headers
            .get(KEY)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_else(|| "-".into())
    });
    let served = serve(router).await;
    let addr = served.addr().parse().expect("served address");
    std::mem::forget(served); // lives as long as the test process
    addr
}

/// Two pools on the same upstream, chosen by model: `keyed` sets the header, `plain` does not.
fn config(upstream: &str) -> String {
    format!(
        "prefix_key_from_body: true\npools:\n  - name: keyed\n    members: ['{upstream}']\n    set_prefix_key: true\n  - name: plain\n    \
         members: ['{upstream}']\nroutes:\n  steps:\n    - id: model\n      field: model\n      op: equals\n      \
         value: plain\n      match: {{ pool: plain }}\n      miss: {{ pool: keyed }}\n"
    )
}

/// A chat body whose first 600 bytes are the same for every group (a long `user` field first), so
/// only a key taken from the messages tells the groups apart (HAProxy's opt-in body key could not).
fn chat(model: &str, group: usize, question: usize) -> String {
    let padding = "x".repeat(600);
    format!(
        r#"{{"model":"{model}","user":"{padding}","messages":[{{"role":"system","content":"Group {group} handbook: {}"}},{{"role":"user","content":"question {question}"}}]}}"#,
        "policy text ".repeat(30)
    )
}

async fn post(addr: SocketAddr, body: String, header: Option<&[u8]>) -> String {
    let mut req = client()
        .post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body);
    if let Some(h) = header {
        req = req.header(KEY, reqwest::header::HeaderValue::from_bytes(h).expect("header bytes"));
    }
    let r = req.send().await.expect("request through the proxy");
    assert!(r.status().is_success(), "proxy answered {}", r.status());
    r.text().await.expect("answer body")
}

#[tokio::test]
async fn the_proxy_forwards_its_key_as_hex_and_never_the_clients_raw_bytes() {
    let upstream = echo_key().await;
    let p = start_proxy(&config(&upstream.to_string())).await;
    let addr = p.addr();

    // From the body: 16 hex digits, equal within a group, different across groups.
    let a1 = post(addr, chat("m", 1, 1), None).await;
    let a2 = post(addr, chat("m", 1, 2), None).await;
    let b1 = post(addr, chat("m", 2, 1), None).await;
    assert!(a1.len() == 16 && a1.bytes().all(|b| b.is_ascii_hexdigit()), "forwarded key {a1:?}");
    assert_eq!(a1, a2, "one group, one key");
    assert_ne!(a1, b1, "two groups, two keys");

    // The client's own header, odd bytes and all, is replaced by its hash: the same key each time.
    let odd: &[u8] = b"\xff\xfe session \"7\" \\ ";
    let o1 = post(addr, chat("m", 1, 1), Some(odd)).await;
    let o2 = post(addr, chat("m", 2, 5), Some(odd)).await;
    assert_eq!(o1, o2, "the client's header is the key, whatever the body");
    assert!(o1.len() == 16 && o1.bytes().all(|b| b.is_ascii_hexdigit()), "forwarded {o1:?}");
    assert_ne!(o1, a1);

    // No prompt, no header: nothing to send.
    assert_eq!(post(addr, r#"{"model":"m"}"#.into(), None).await, "-");

    // A pool without set_prefix_key passes the client's header through untouched and adds none.
    assert_eq!(post(addr, chat("plain", 1, 1), None).await, "-");
    assert_eq!(post(addr, chat("plain", 1, 1), Some(b"session-9")).await, "session-9");

    // Without prefix_key_from_body (the default) only a client's header makes a key.
    let cfg = config(&upstream.to_string()).replace("prefix_key_from_body: true\n", "");
    let q = start_proxy(&cfg).await;
    assert_eq!(post(q.addr(), chat("m", 1, 1), None).await, "-", "no body key by default");
    assert_eq!(post(q.addr(), chat("m", 1, 1), Some(odd)).await, o1, "the header's key is the same");
}

#[tokio::test]
async fn behind_the_proxy_haproxy_keeps_each_group_the_proxy_sees_on_one_server() {
    let mut backends = Vec::new();
    for i in 0..3 {
        backends.push(CountingBackend::start(&format!("s{i}")).await);
    }
    let members: Vec<String> = backends.iter().map(|b| b.addr()).collect();
    let hx = Haproxy::start(&shipped_prefix_config(&members)).await;
    for backend in ["llm_prefix", "llm"] {
        wait_all_up(&hx, backend, &["vllm-0", "vllm-1", "vllm-2"]).await;
    }
    let p = start_proxy(&config(&format!("127.0.0.1:{}", hx.port("fe")))).await;

    // Through the plain pool HAProxy gets no key and balances by leastconn: sequential requests
    // rotate, so no group keeps a server.
    let mut split = 0;
    for g in 0..4 {
        let mut seen = BTreeSet::new();
        for q in 0..3 {
            seen.insert(post(p.addr(), chat("plain", g, q), None).await);
        }
        split += usize::from(seen.len() > 1);
    }
    assert_eq!(split, 4, "without the proxy's key HAProxy should not keep groups together");

    // Through the keyed pool each group keeps one server, and the groups spread.
    let mut used = BTreeSet::new();
    for g in 0..8 {
        let mut seen = BTreeSet::new();
        for q in 0..4 {
            seen.insert(post(p.addr(), chat("m", g, q), None).await);
        }
        assert_eq!(seen.len(), 1, "group {g} went to {seen:?}");
        used.extend(seen);
    }
    assert!(used.len() >= 2, "8 groups all on {used:?}");
}
