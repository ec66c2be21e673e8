//! The proxy from the attacker's side: model names, metadata, header values and a guard service's
//! route answer carrying quotes, line breaks, braces and HTML. Every answer is a JSON error that
//! parses (or a normal answer), no response header carries the attacker's text, and the proxy's
//! `/metrics` passes `promtool check metrics` with no label value the request chose.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use llm_lc_proxy::config;
use llm_lc_sim::ModelProfile;
use llm_lc_testkit::proxy::*;
use serde_json::json;

const NASTY: &str = "m\"} 1\nllmlc_forged_series{a=\"<script>alert(1)</script>\\";

fn promtool() -> PathBuf {
    let debian = PathBuf::from("/usr/bin/promtool");
    if debian.exists() {
        debian
    } else {
        "promtool".into()
    }
}

/// promtool's findings on `page`, less the one lint of OpenMetrics counter HELP names.
fn promtool_findings(page: &str) -> Vec<String> {
    use std::io::Write as _;
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`, installed by tests/run.sh)");
    child.stdin.take().expect("stdin").write_all(page.as_bytes()).expect("write page");
    let out = child.wait_with_output().expect("promtool runs");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    said.lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| {
            !l.strip_suffix("_total no help text").is_some_and(|f| page.contains(&format!("# HELP {f} ")))
        })
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_text_reaches_no_label_header_or_line_of_its_own() {
    let large = fleet(ModelProfile::tiny(), 1, &["llama-70b"], &["sql-lora-v1", "sql-lora-v2"], 50.0).await;
    let interactive = fleet(ModelProfile::tiny(), 1, &["llama-8b"], &[], 50.0).await;
    let batch = fleet(ModelProfile::tiny(), 1, &["llama-8b"], &[], 50.0).await;
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/proxy.yaml");
    let mut cfg = config::load(&example).expect("config/proxy.yaml loads").config;
    cfg.ratios.poll = None;
    // The guard service answers "route to pool <NASTY>" to `please route`.
    let (guard_url, guard_calls) = fake_guard(NASTY).await;
    cfg.routes.steps[0].guard.as_mut().expect("a guard step").url = Some(guard_url);
    for p in &mut cfg.pools {
        let f = match p.name.as_str() {
            "large" => &large,
            "interactive" => &interactive,
            _ => &batch,
        };
        p.members = f.addrs().iter().map(|a| a.to_string().as_str().into()).collect();
    }
    let proxy = start_proxy_cfg(cfg).await;
    let c = client();
    let user = |text: &str| json!([{"role": "user", "content": text}]);
    let requests = [
        json!({"model": NASTY, "messages": user("hi"), "max_tokens": 2}),
        json!({"model": "llama-8b", "messages": user("hi"), "max_tokens": 2, "metadata": {"interactive": NASTY, "criticality": NASTY}}),
        json!({"model": "llama-8b", "messages": [{"role": NASTY, "content": "hi"}], "max_tokens": 2}),
        json!({"model": "llama-8b", "messages": user("please route"), "max_tokens": 2}),
        json!({"model": ["llama-8b"], "messages": user("hi")}),
        json!({"model": "llama-8b", "messages": user("hi"), "max_tokens": 2}),
    ];
    let headers = [("x-criticality", "<b>\"critical\"</b>"), ("x-llm-role", "a\"}{b")];
    let mut statuses = Vec::new();
    for (i, body) in requests.iter().enumerate() {
        // Hostile headers on one request: a refused criticality stops it before the guard.
        let headers: &[(&str, &str)] = if i == 1 { &headers } else { &[] };
        let r = post_raw(&c, proxy.addr(), "/v1/chat/completions", &body.to_string(), headers).await;
        assert!(r.json.is_object(), "every answer is JSON ({}): {}", r.status, r.text);
        if r.status >= 400 {
            assert!(r.json["error"]["message"].is_string(), "an OpenAI-shaped error: {}", r.text);
        }
        for (name, value) in &r.headers {
            let v = String::from_utf8_lossy(value.as_bytes());
            assert!(!v.contains("<script>") && !v.contains("forged"), "header {name}: {v}");
        }
        statuses.push(r.status);
    }
    assert_eq!(statuses[0], 404, "an unknown model is a 404: {statuses:?}");
    assert_eq!(statuses[1], 400, "a criticality outside the classes is refused: {statuses:?}");
    // A guard answer naming a pool outside its `route_pools` is a guard failure, and the example's
    // guard fails open: the request goes on by the table.
    assert_eq!(statuses[3], 200, "a route to a pool that is not allowed is not followed: {statuses:?}");
    assert!(guard_calls.load(std::sync::atomic::Ordering::SeqCst) >= 2, "the guard service was asked");
    assert_eq!(statuses[5], 200, "and ordinary requests still pass: {statuses:?}");

    let page = c.get(format!("http://{}/metrics", proxy.addr())).send().await.unwrap().text().await.unwrap();
    let findings = promtool_findings(&page);
    assert!(findings.is_empty(), "promtool check metrics: {findings:?}\n{page}");
    assert!(!page.lines().any(|l| l.starts_with("llmlc_forged_series")), "{page}");
    let values: BTreeSet<&str> = page
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('{').map(|(_, rest)| rest))
        .collect();
    for v in &values {
        assert!(!v.contains("script") && !v.contains("critical\\\""), "a label from the request: {v}");
    }
}

/// Raw request heads the HTTP layer refuses before the proxy reads them: the answer is the same
/// OpenAI-style JSON error as every other refusal, not hyper's empty body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_the_http_layer_refuses_get_json_errors() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let f = fleet(ModelProfile::tiny(), 1, &["m"], &[], 50.0).await;
    let proxy = start_proxy(&format!(
        "listen: 127.0.0.1:0\npools:\n  - name: llm\n    members: {}\nroutes:\n  steps:\n    - id: model\n      \
         field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400 }}\n",
        members_yaml(&f.addrs())
    ))
    .await;
    let many_headers: String = (0..200).map(|i| format!("x-h{i}: v\r\n")).collect();
    for (raw, status, code) in [
        ("GET /v1/models HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n".to_string(), 400, "bad_request"),
        ("G\u{1}T / HTTP/1.1\r\nHost: x\r\n\r\n".to_string(), 400, "bad_request"),
        (
            format!("GET /v1/models HTTP/1.1\r\nHost: x\r\n{many_headers}\r\n"),
            431,
            "request_header_too_large",
        ),
    ] {
        let mut tcp = tokio::net::TcpStream::connect(proxy.addr()).await.expect("connect");
        tcp.write_all(raw.as_bytes()).await.expect("write");
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_to_end(&mut answer)).await;
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "{raw:?} -> {text}");
        assert!(text.to_ascii_lowercase().contains("content-type: application/json"), "{text}");
        let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(v["error"]["code"], code, "{text}");
    }
}
