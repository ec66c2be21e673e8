//! The reference proxy with `algorithm: picker` (issue 41) in front of simulated vLLM servers on
//! loopback: a prompt stays with the member that has it cached, other prompts spread, the members'
//! gauges are read from their `/metrics` pages, a member whose page cannot be read is still
//! served, a drained member is not, and `/admin/state` shows what the picker knows.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::{Json, Router};
use llm_lc_adapters::{MemberId, Ratios};
use llm_lc_proxy::ProxyHandle;
use llm_lc_sim::ModelProfile;
use llm_lc_testkit::proxy::*;
use llm_lc_testkit::wait;
use serde_json::{json, Value};

fn config(members: &str) -> String {
    format!(
        "algorithm: picker\npools:\n  - name: llm\n    members: {members}\n    metrics_interval: 50ms\nroutes:\n  steps:\n    - id: all\n      field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400, message: 'say which model' }}\n"
    )
}

/// A chat body whose prompt is a long system prompt of `doc` and a short question.
fn ask(doc: &str, question: &str) -> Value {
    json!({"model": "sim-tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": doc},
        {"role": "user", "content": question}]})
}

fn document(n: usize) -> String {
    format!("document {n}: ") + &"the same long context, sent again and again. ".repeat(30)
}

async fn member_of(proxy: &ProxyHandle, body: &Value) -> String {
    let r = chat(&client(), proxy.addr(), body, &[]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.header("x-llmlc-member").to_string()
}

/// The picker's view of every member, as `/admin/state` serves it.
async fn state(proxy: &ProxyHandle) -> Value {
    let r = client().get(format!("http://{}/admin/state", proxy.admin_addr())).send().await.expect("state");
    assert_eq!(r.status(), 200);
    r.json().await.expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_stays_with_its_member_and_other_prompts_spread() {
    let f = fleet(ModelProfile::tiny(), 3, &[], &[], 50.0).await;
    let proxy = start_proxy(&config(&members_yaml(&f.addrs()))).await;
    // The members' gauges arrive from their pages.
    wait::until(Duration::from_secs(10), "every member's gauges read", || async {
        let s = state(&proxy).await;
        let members = s["pools"][0]["members"].as_array().cloned().unwrap_or_default();
        members.iter().all(|m| m["picker"]["waiting"].is_u64()).then_some(())
    })
    .await;
    let home = member_of(&proxy, &ask(&document(0), "first question")).await;
    for q in 0..8 {
        let again = member_of(&proxy, &ask(&document(0), &format!("question {q}"))).await;
        assert_eq!(again, home, "the member that has the document cached keeps it");
    }
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for n in 1..31 {
        *seen.entry(member_of(&proxy, &ask(&document(n), "a question")).await).or_default() += 1;
    }
    assert_eq!(seen.len(), 3, "thirty other documents go to every member: {seen:?}");
    let s = state(&proxy).await;
    assert_eq!(s["pools"][0]["algorithm"], "picker");
    let members = s["pools"][0]["members"].as_array().cloned().unwrap_or_default();
    let indexed: Vec<u64> =
        members.iter().map(|m| m["picker"]["indexed_blocks"].as_u64().unwrap_or(0)).collect();
    assert!(indexed.iter().all(|&b| b > 0), "each member's index holds what it was sent: {indexed:?}");
    // Every request has ended: nothing is left in flight in the picker's accounting.
    assert!(
        members.iter().all(|m| m["picker"]["requests"] == 0 && m["picker"]["uncached_tokens"] == 0),
        "{s}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_without_gauges_is_still_served_and_a_drained_member_is_not() {
    let f = fleet(ModelProfile::tiny(), 2, &[], &[], 50.0).await;
    // It answers chat completions and has no metrics page.
    let blind = hold_backend().await;
    let addrs = [f.addrs()[0], f.addrs()[1], blind];
    let proxy = start_proxy(&config(&members_yaml(&addrs))).await;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for n in 0..30 {
        *seen.entry(member_of(&proxy, &ask(&document(n), "q")).await).or_default() += 1;
    }
    assert!(
        seen.contains_key(&blind.to_string()),
        "the member without a metrics page is chosen too: {seen:?}"
    );
    let s = state(&proxy).await;
    assert!(s["pools"][0]["members"][2]["picker"]["waiting"].is_null(), "no gauges shown for it: {s}");
    // The controller drains the second simulated member: the picker never sends it anything.
    let ratios: Ratios =
        addrs.iter().zip([100, 0, 100]).map(|(a, r)| (MemberId::from(a.to_string().as_str()), r)).collect();
    proxy.apply_ratios("llm", &ratios).expect("ratios apply");
    for n in 100..130 {
        assert_ne!(member_of(&proxy, &ask(&document(n), "q")).await, addrs[1].to_string());
    }
    // A request without a prompt is still placed (by the ratios).
    let r =
        chat(&client(), proxy.addr(), &json!({"model": "sim-tiny", "max_tokens": 2, "messages": []}), &[])
            .await;
    assert_ne!(r.header("x-llmlc-member"), addrs[1].to_string(), "{}", r.text);
    proxy.shutdown().await;
}

/// A stand-in for the controller's `GET /v1/ratios`: its last cycle report for pool `llm`.
async fn controller_report(report: Value) -> SocketAddr {
    let app =
        Router::new().route("/v1/ratios", axum::routing::get(move || async move { Json(report.clone()) }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_can_come_from_the_controllers_report_instead() {
    let f = fleet(ModelProfile::tiny(), 2, &[], &[], 50.0).await;
    let [a, b] = [f.addrs()[0], f.addrs()[1]];
    let report = json!({"pools": [{"pool": "llm", "members": [
        {"member": a.to_string(), "ratio": 50, "waiting": 40.0, "running": 60.0, "kv_usage": 0.5},
        {"member": b.to_string(), "ratio": 50, "waiting": 0.0, "running": 3.0, "kv_usage": f64::NAN.to_string()}]}]});
    let ctl = controller_report(report).await;
    let yaml = config(&members_yaml(&[a, b]))
        .replace("    metrics_interval: 50ms\n", "    gauges_from: controller\n")
        + &format!("ratios:\n  poll: {{ url: 'http://{ctl}/v1/ratios', interval: 100ms }}\n");
    let proxy = start_proxy(&yaml).await;
    // The simulated servers have nothing waiting; the controller says 40 on the first: what the
    // picker shows is the controller's.
    wait::until(Duration::from_secs(10), "the controller's gauges", || async {
        let s = state(&proxy).await;
        (s["pools"][0]["members"][0]["picker"]["waiting"] == 40
            && s["pools"][0]["members"][1]["picker"]["running"] == 3)
            .then_some(())
    })
    .await;
    // A hundred requests on the first against three: new prompts go to the second.
    for n in 0..5 {
        assert_eq!(member_of(&proxy, &ask(&document(200 + n), "q")).await, b.to_string());
    }
    proxy.shutdown().await;

    // `controller` without a report to poll is a config error naming the field.
    let bad: llm_lc_proxy::ProxyConfig = serde_yaml_ng::from_str(
        &config(&members_yaml(&[a])).replace("    metrics_interval: 50ms\n", "    gauges_from: controller\n"),
    )
    .expect("parses");
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let adm = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let e = llm_lc_proxy::start(bad, l, adm).await.err().expect("refused").to_string();
    assert!(e.contains("pools[0].gauges_from") && e.contains("ratios.poll"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_header_with_odd_bytes_names_the_home_and_is_never_logged() {
    let f = fleet(ModelProfile::tiny(), 3, &[], &[], 50.0).await;
    let proxy = start_proxy(&config(&members_yaml(&f.addrs()))).await;
    let odd = reqwest::header::HeaderValue::from_bytes(b"sess\xff\xfe-ion\x80\t!").expect("header bytes");
    let c = client();
    let send = |body: Value| {
        let req = c
            .post(format!("http://{}/v1/chat/completions", proxy.addr()))
            .header("x-llm-prefix-key", odd.clone())
            .json(&body);
        async move {
            let r = req.send().await.expect("sent");
            assert_eq!(r.status(), 200);
            r.headers().get("x-llmlc-member").and_then(|v| v.to_str().ok()).unwrap_or("").to_string()
        }
    };
    // The same key with different bodies: one home.
    let home = send(ask(&document(900), "first")).await;
    for n in 0..6 {
        assert_eq!(send(ask(&document(901 + n), "other")).await, home, "the key wins over the body");
    }
    // Nothing of the key's bytes in the proxy's metrics or state.
    let s = state(&proxy).await.to_string();
    let m = proxy.metrics_text();
    assert!(!s.contains("sess") && !m.contains("sess"), "the raw key is never echoed");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_request_leaves_nothing_in_the_pickers_accounting() {
    let members = [hold_backend().await, hold_backend().await];
    let proxy = start_proxy(&config(&members_yaml(&members))).await;
    // Requests the members hold (their prompts say "hold"), streamed or not, then the clients go.
    let tasks: Vec<_> = (0..6)
        .map(|n| {
            let addr = proxy.addr();
            tokio::spawn(async move {
                let mut body = ask(&document(300 + n), "hold");
                body["stream"] = json!(n % 2 == 0);
                let _ = client().post(format!("http://{addr}/v1/chat/completions")).json(&body).send().await;
            })
        })
        .collect();
    let open = |s: &Value| -> (u64, u64) {
        let members = s["pools"][0]["members"].as_array().cloned().unwrap_or_default();
        members.iter().fold((0, 0), |(r, t), m| {
            (
                r + m["picker"]["requests"].as_u64().unwrap_or(0),
                t + m["picker"]["uncached_tokens"].as_u64().unwrap_or(0),
            )
        })
    };
    wait::until(Duration::from_secs(10), "six requests open in the picker", || async {
        let (r, t) = open(&state(&proxy).await);
        (r == 6 && t > 0).then_some(())
    })
    .await;
    for t in &tasks {
        t.abort();
    }
    wait::until(Duration::from_secs(10), "the picker's accounting back to nothing", || async {
        (open(&state(&proxy).await) == (0, 0)).then_some(())
    })
    .await;
    proxy.shutdown().await;
}
