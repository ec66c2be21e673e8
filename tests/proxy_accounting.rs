//! Exact accounting: a request counted in flight on a member, or waiting in the admission queue,
//! is uncounted on every exit — including a client that disconnects before the first response
//! byte (streamed or not), while queued, or while the proxy is retrying on another member — and
//! the split afterwards is even again.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use llm_lc_adapters::{MemberId, Ratios};
use llm_lc_proxy::ProxyHandle;
use llm_lc_testkit::proxy::*;
use llm_lc_testkit::{ports, wait};
use serde_json::json;

fn config(members: &str, pool_extra: &str) -> String {
    format!(
        "# proxy config\nalgorithm: weighted-least-request\nseed: 7\npools:\n  - name: llm\n    members: {members}\n{pool_extra}routes:\n  steps:\n    - id: all\n      field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400 }}\n"
    )
}

/// Start a request that the backend holds, in its own task (aborting the task is the client
/// going away: its connection closes).
fn held(addr: SocketAddr, stream: bool) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hold"}], "stream": stream});
        let _ = client().post(format!("http://{addr}/v1/chat/completions")).json(&body).send().await;
    })
}

async fn wait_counts(p: &ProxyHandle, want: (u32, usize), what: &str) {
    wait::until(Duration::from_secs(10), what, || async { (in_flight_and_queued(p) == want).then_some(()) })
        .await;
}

/// The gauges on /metrics agree with the live view.
async fn metrics_say(p: &ProxyHandle, in_flight: f64, queued: f64) {
    let m = client().get(format!("http://{}/metrics", p.addr())).send().await.unwrap().text().await.unwrap();
    assert_eq!(metric_sum(&m, "llmlc_proxy_in_flight", &[]), in_flight, "{m}");
    assert_eq!(metric_sum(&m, "llmlc_proxy_queued", &[]), queued, "{m}");
}

/// `n` sequential requests; how many each member answered.
async fn split(addr: SocketAddr, n: usize) -> BTreeMap<String, usize> {
    let c = client();
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let r = chat(&c, addr, &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}), &[])
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        *out.entry(r.header("x-llmlc-member").to_string()).or_default() += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_before_the_first_byte_releases_the_member_streamed_or_not() {
    let members = [hold_backend().await, hold_backend().await];
    let proxy = start_proxy(&config(&members_yaml(&members), "")).await;
    let tasks: Vec<_> = (0..6).map(|i| held(proxy.addr(), i % 2 == 0)).collect();
    wait_counts(&proxy, (6, 0), "six held requests in flight").await;
    metrics_say(&proxy, 6.0, 0.0).await;
    for t in &tasks {
        t.abort();
    }
    wait_counts(&proxy, (0, 0), "in-flight back to 0 after the clients left").await;
    metrics_say(&proxy, 0.0, 0.0).await;
    // Before the fix one leaked count sent every sequential request to the other member.
    let s = split(proxy.addr(), 40).await;
    assert_eq!(s.len(), 2, "{s:?}");
    assert!(s.values().all(|&n| n >= 12), "sequential requests split evenly again: {s:?}");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_while_queued_gives_the_queue_place_back() {
    let member = hold_backend().await;
    let extra = "    max_in_flight_per_member: 1\n    queue_size: 2\n    queue_timeout: 60s\n";
    let proxy = start_proxy(&config(&members_yaml(&[member]), extra)).await;
    let busy = held(proxy.addr(), true);
    wait_counts(&proxy, (1, 0), "one request in flight").await;
    let waiting = [held(proxy.addr(), false), held(proxy.addr(), true)];
    wait_counts(&proxy, (1, 2), "two requests queued").await;
    metrics_say(&proxy, 1.0, 2.0).await;
    for t in &waiting {
        t.abort();
    }
    // Long before the 60 s queue timeout.
    wait_counts(&proxy, (1, 0), "queued back to 0 after the waiting clients left").await;
    // The queue has its two places again: two more wait (a third would be refused as full).
    let again = [held(proxy.addr(), false), held(proxy.addr(), false)];
    wait_counts(&proxy, (1, 2), "the queue takes two again").await;
    let r = chat(&client(), proxy.addr(), &json!({"model": "m", "messages": []}), &[]).await;
    assert_eq!((r.status, r.json["error"]["code"].as_str()), (429, Some("queue_full")), "{}", r.text);
    for t in again.iter().chain([&busy]) {
        t.abort();
    }
    wait_counts(&proxy, (0, 0), "everything released").await;
    metrics_say(&proxy, 0.0, 0.0).await;
    let s = split(proxy.addr(), 3).await;
    assert_eq!(s.values().sum::<usize>(), 3, "the slot is free for new requests: {s:?}");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_during_a_retry_releases_both_members() {
    // The heaviest member refuses connections, so the request is retried on the other one, which
    // holds it; then the client leaves.
    let refused = ports::refused();
    let closed = refused.addr;
    let holder = hold_backend().await;
    let proxy = start_proxy(&config(&members_yaml(&[closed, holder]), "    eject_for: 1ms\n")).await;
    let ratios: Ratios = [
        (MemberId::from(closed.to_string().as_str()), 100),
        (MemberId::from(holder.to_string().as_str()), 1),
    ]
    .into_iter()
    .collect();
    proxy.apply_ratios("llm", &ratios).unwrap();
    let mut tasks = Vec::new();
    for i in 0..4u32 {
        // One at a time, each after the refused member's (1 ms) ejection ended, so each one tries
        // it first and is retried on the other.
        wait::until(Duration::from_secs(5), "the refused member back in rotation", || async {
            (!proxy.pools()[0].members[0].ejected).then_some(())
        })
        .await;
        tasks.push(held(proxy.addr(), i % 2 == 0));
        wait_counts(&proxy, (i + 1, 0), "the request held on the second member after a retry").await;
    }
    let view = proxy.pools();
    assert_eq!(view[0].members[0].in_flight, 0, "the refused member was uncounted at the retry");
    let m = proxy.metrics_text();
    assert_eq!(metric_sum(&m, "llmlc_proxy_connect_retries_total", &[]), 4.0, "{m}");
    for t in &tasks {
        t.abort();
    }
    wait_counts(&proxy, (0, 0), "in-flight back to 0").await;
    metrics_say(&proxy, 0.0, 0.0).await;
    proxy.shutdown().await;
}
