//! Criticality at a saturated pool: sheddable gets 429 with Retry-After, standard waits in a bounded
//! queue (429 when it is full), critical goes first; the controller's reported saturation sheds
//! sheddable traffic too. All counted in the proxy's metrics.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::get;
use axum::{Json, Router};
use llm_lc_testkit::proxy::*;
use llm_lc_testkit::wait;
use llm_load_controller::report::{CycleReport, MemberReport, PoolReport};
use serde_json::json;

fn config(members: &str, extra: &str) -> String {
    format!(
        "# proxy config\n{extra}pools:\n  - name: llm\n    members: {members}\n    max_in_flight_per_member: 1\n    queue_size: 3\n    queue_timeout: 20s\nroutes:\n  steps:\n    - id: all\n      field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ pool: llm }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_is_shed_standard_queues_critical_goes_first() {
    // Real time: a request of N tokens takes N steps of 2 ms.
    let f = fleet(constant_profile(), 1, &[], &[], 1.0).await;
    let proxy = Arc::new(start_proxy(&config(&members_yaml(&f.addrs()), "")).await);
    let c = client();
    let addr = proxy.addr();

    // Fill the pool's only slot with a long request.
    let long = {
        let c = c.clone();
        tokio::spawn(async move {
            chat(&c, addr, &json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}), &[]).await.status
        })
    };
    wait::until(Duration::from_secs(5), "the long request to be admitted", || async {
        (proxy.pools()[0].in_flight == 1).then_some(())
    })
    .await;

    // Sheddable: refused at once.
    let r = chat(
        &c,
        addr,
        &json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}]}),
        &[("x-criticality", "sheddable")],
    )
    .await;
    assert_eq!(r.status, 429, "{}", r.text);
    assert_eq!(r.header("retry-after"), "1");
    assert_eq!(r.json["error"]["code"], "shed");
    assert_eq!(r.json["error"]["type"], "rate_limit_error");

    // Two standard, then one critical (from the body field): they queue; the critical one will run first.
    let done = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for (i, (name, body, headers)) in [
        ("s1", json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}), vec![]),
        ("s2", json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}), vec![("x-criticality", "standard")]),
        ("c1", json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "metadata": {"criticality": "critical"}}), vec![]),
    ]
    .into_iter()
    .enumerate()
    {
        let (c, done) = (c.clone(), done.clone());
        waiters.push(tokio::spawn(async move {
            let r = chat(&c, addr, &body, &headers).await;
            done.lock().unwrap().push(name);
            r.status
        }));
        wait::until(Duration::from_secs(5), "the request to queue", || async {
            (proxy.pools()[0].queued == i + 1).then_some(())
        })
        .await;
    }
    // The queue (3) is full: another standard request is refused.
    let r =
        chat(&c, addr, &json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}]}), &[])
            .await;
    assert_eq!((r.status, r.json["error"]["code"].as_str()), (429, Some("queue_full")), "{}", r.text);
    // A bad class is a client error.
    let r = chat(
        &c,
        addr,
        &json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}]}),
        &[("x-criticality", "urgent")],
    )
    .await;
    assert_eq!(r.status, 400);

    assert_eq!(long.await.unwrap(), 200);
    for w in waiters {
        assert_eq!(w.await.unwrap(), 200);
    }
    assert_eq!(*done.lock().unwrap(), vec!["c1", "s1", "s2"], "critical first, then standard in order");

    let m = c.get(format!("http://{addr}/metrics")).send().await.unwrap().text().await.unwrap();
    assert_eq!(
        metric_sum(&m, "llmlc_proxy_refused_total", &["criticality=\"sheddable\"", "reason=\"shed\""]),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric_sum(&m, "llmlc_proxy_refused_total", &["criticality=\"standard\"", "reason=\"queue_full\""]),
        1.0,
        "{m}"
    );
    assert_eq!(metric_sum(&m, "llmlc_proxy_admitted_total", &["criticality=\"critical\""]), 1.0, "{m}");
    assert_eq!(metric_sum(&m, "llmlc_proxy_admitted_total", &["criticality=\"standard\""]), 3.0, "{m}");
    assert_eq!(proxy.pools()[0].in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_saturation_sheds_sheddable_traffic() {
    let f = fleet(constant_profile(), 1, &[], &[], 20.0).await;
    let member = f.addrs()[0].to_string();
    // The controller's /v1/ratios, in its own report type: the pool at 95% saturation.
    let report = CycleReport {
        ts: "2026-01-01T00:00:00Z".into(),
        pools: vec![PoolReport {
            pool: "llm".into(),
            state: llm_load_controller::cycle::PoolState::Ok,
            policy: "feedback",
            sink: "webhook",
            push: llm_load_controller::cycle::PushOutcome::Pushed,
            saturation: Some(0.95),
            members: vec![MemberReport { member: member.clone(), ratio: 7, ..Default::default() }],
            ..Default::default()
        }],
    };
    let body = serde_json::to_value(&report).unwrap();
    let app = Router::new().route("/v1/ratios", get(move || async move { Json(body.clone()) }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ctl = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });

    let proxy = start_proxy(&config(
        &members_yaml(&f.addrs()),
        &format!("ratios:\n  poll: {{ url: 'http://{ctl}/v1/ratios', interval: 100ms }}\n"),
    ))
    .await;
    wait::until(Duration::from_secs(5), "the poll to bring saturation and ratios", || async {
        let v = &proxy.pools()[0];
        (v.controller_saturation == Some(0.95) && v.members[0].weight == 7).then_some(())
    })
    .await;
    let c = client();
    let r = chat(
        &c,
        proxy.addr(),
        &json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        &[("x-criticality", "sheddable")],
    )
    .await;
    assert_eq!(r.status, 429, "{}", r.text);
    let r = chat(
        &c,
        proxy.addr(),
        &json!({"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "standard traffic still flows below the proxy's own limit: {}", r.text);
}
