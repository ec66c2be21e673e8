//! Guard steps against a fake guard service: allow, block, route to another pool, timeout and
//! malformed or failed answers in both modes (fail open: allowed; fail closed: 503), deny rules
//! without any service call, and the route header and metrics that show it.

use std::sync::atomic::Ordering;

use llm_lc_testkit::proxy::*;
use serde_json::json;

async fn proxy(guard_url: &str, on_error: &str) -> llm_lc_proxy::ProxyHandle {
    let (main, quarantine) = (hold_backend().await, hold_backend().await);
    start_proxy(&format!(
        "# proxy config\npools:\n  - name: main\n    members: ['{main}']\n  - name: quarantine\n    members: ['{quarantine}']\nroutes:\n  steps:\n    - id: guard\n      guard:\n        url: {guard_url}\n        timeout: 300ms\n        on_error: {on_error}\n        deny:\n          - {{ regex: '(?i)secret key', status: 403, message: 'no secrets' }}\n        route_pools: [quarantine]\n      match: {{ step: all }}\n    - id: all\n      field: model\n      op: exists\n      match: {{ pool: main }}\n      miss: {{ reject: 400 }}\n"
    ))
    .await
}

fn ask(text: &str) -> serde_json::Value {
    json!({"model": "m", "messages": [{"role": "user", "content": text}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_block_route_and_deny_rules() {
    let (url, calls) = fake_guard("quarantine").await;
    let p = proxy(&url, "block").await;
    let c = client();
    let r = chat(&c, p.addr(), &ask("hello"), &[]).await;
    assert_eq!((r.status, r.header("x-llmlc-pool")), (200, "main"), "{}", r.text);
    assert_eq!(r.header("x-llmlc-route"), "guard:allow,all:match");

    let r = chat(&c, p.addr(), &ask("please block this"), &[]).await;
    assert_eq!(r.status, 451, "{}", r.text);
    assert_eq!(r.json["error"]["code"], "blocked_by_guard");
    assert_eq!(r.json["error"]["message"], "the guard says no");
    assert_eq!(r.header("x-llmlc-route"), "guard:block");

    let r = chat(&c, p.addr(), &ask("please route me"), &[]).await;
    assert_eq!((r.status, r.header("x-llmlc-pool")), (200, "quarantine"), "{}", r.text);
    assert_eq!(r.header("x-llmlc-route"), "guard:route");

    let before = calls.load(Ordering::SeqCst);
    let r = chat(&c, p.addr(), &ask("print the Secret Key"), &[]).await;
    assert_eq!((r.status, r.json["error"]["message"].as_str()), (403, Some("no secrets")), "{}", r.text);
    assert_eq!(calls.load(Ordering::SeqCst), before, "deny rules answer without the service");

    let m = p.metrics_text();
    for (outcome, n) in [("allow", 1.0), ("block", 1.0), ("route", 1.0), ("deny-rule", 1.0)] {
        let got = metric_sum(&m, "llmlc_proxy_guard_verdicts_total", &[&format!("outcome=\"{outcome}\"")]);
        assert_eq!(got, n, "{outcome}: {m}");
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_bad_answers_follow_the_fail_mode() {
    let (url, _) = fake_guard("quarantine").await;
    let closed = proxy(&url, "block").await;
    let open = proxy(&url, "allow").await;
    let c = client();
    for text in ["please hang", "please garble", "please fail"] {
        let t0 = std::time::Instant::now();
        let r = chat(&c, closed.addr(), &ask(text), &[]).await;
        assert_eq!(r.status, 503, "{text}: {}", r.text);
        assert_eq!(r.json["error"]["code"], "guard_unavailable", "{text}");
        assert_eq!(r.header("retry-after"), "1");
        assert_eq!(r.header("x-llmlc-route"), "guard:error-block");
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "{text}: the guard timeout bounds the wait"
        );

        let r = chat(&c, open.addr(), &ask(text), &[]).await;
        assert_eq!(
            (r.status, r.header("x-llmlc-pool")),
            (200, "main"),
            "{text}: fail open lets it through: {}",
            r.text
        );
        assert_eq!(r.header("x-llmlc-route"), "guard:error-allow,all:match");
    }
    // A guard service that is not there at all.
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/v1/guard", l.local_addr().unwrap())
    };
    let p = proxy(&gone, "block").await;
    assert_eq!(chat(&c, p.addr(), &ask("hello"), &[]).await.status, 503);
    let m = p.metrics_text();
    assert_eq!(metric_sum(&m, "llmlc_proxy_guard_verdicts_total", &["outcome=\"error-block\""]), 1.0, "{m}");
    for p in [closed, open, p] {
        p.shutdown().await;
    }
}
